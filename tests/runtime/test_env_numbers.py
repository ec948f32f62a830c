"""The numeric kinds of fastattn.env (seconds, size, count, classes, a URL's database): ASCII
digits only, and bounds that every variable of the kind shares: a "seconds" value is
at most MAX_SECONDS (1e10 passed, and then overflowed redis-py's socket timeout: exit
5 from `fastattn info`), a size below 8 EiB however many digits it is written with. And
the Redis tier takes an OverflowError from its client as any other Redis failure."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import env as _env
from fastattn import shape_classes

OF_KIND = {kind: sorted(v.name for v in _env.VARIABLES.values() if v.kind == kind and v.scope == "runtime")
           for kind in {v.kind for v in _env.VARIABLES.values()}}
CFG = dict(batch=1, heads_q=8, seqlen_q=128, head_dim_qk=64)


def refused(name: str, value: str, why: str = "") -> str:
    with pytest.raises(fastattn.InvalidArgumentError) as e:
        _env.get(name, {name: value})
    assert str(e.value).startswith(f"{name}="), str(e.value)
    assert why in str(e.value), str(e.value)
    return str(e.value)


# -- seconds: a maximum for the kind ----------------------------------------------------------


def test_every_seconds_variable_has_the_kinds_maximum():
    assert OF_KIND["seconds"] == ["FASTATTN_REMOTE_RETRY", "FASTATTN_REMOTE_TIMEOUT", "FASTATTN_REMOTE_WAIT"]
    for name in OF_KIND["seconds"]:
        assert _env.get(name, {name: "1e6"}) == _env.MAX_SECONDS == 1e6
        assert _env.get(name, {name: " 1000000.0 "}) == 1e6
        for value in ("1e10", "1000000.5", "1e300", "9" * 400):
            assert refused(name, value).endswith("': must be <= 1000000 (seconds)")
    assert "at most 1000000 s" in _env.markdown()


def test_a_huge_remote_timeout_is_refused_by_the_api_before_redis(env, monkeypatch):
    monkeypatch.setenv("FASTATTN_REMOTE_CACHE", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")
    monkeypatch.setenv("FASTATTN_REMOTE_TIMEOUT", "1e10")
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^FASTATTN_REMOTE_TIMEOUT='1e10': must be <= 1000000"):
        fastattn.plan(CFG)


# -- ASCII digits in every numeric kind -----------------------------------------------------------

OTHER_DIGITS = ["١٢", "１２", "१२", "12٣", "²"]  # Arabic-Indic, full-width, Devanagari, mixed, superscript


@pytest.mark.parametrize("digits", OTHER_DIGITS)
def test_numbers_are_ascii_digits_in_every_numeric_kind(digits):
    for name in OF_KIND["seconds"]:
        refused(name, digits)
    for name in OF_KIND["size"]:  # FASTATTN_CACHE_MAX_BYTES=١٢ was 12 bytes
        refused(name, digits, "must be a size in bytes")
        refused(name, digits + "M", "must be a size in bytes")
    for name in OF_KIND["count"]:
        refused(name, digits, "must be an integer")
    for name in OF_KIND["classes"]:
        refused(name, f"256,{digits}", "comma-separated lengths")
    for name in OF_KIND["url"]:
        refused(name, f"redis://h:6379/{digits}", "the database must be a number")
        refused(name, f"unix:///tmp/r.sock?db={digits}", "the database must be a number")
    with pytest.raises(fastattn.InvalidArgumentError, match="^--seqlens="):
        shape_classes.parse_range(f"1..{digits}")


def test_seconds_are_written_as_numbers_not_as_python_literals():
    for name in OF_KIND["seconds"]:
        for value in ("1_0", "0x10", "1e", "+", "."):
            refused(name, value, "seconds")
        for value, seconds in (("0.25", 0.25), ("+1E3", 1000.0), (".5", 0.5), ("5.", 5.0), ("1e-3", 0.001)):
            assert _env.get(name, {name: value}) == seconds


def test_a_size_of_any_length_is_refused_not_a_crash():
    for name in OF_KIND["size"]:
        for value in ("1" + "0" * 5000, "9" * 400 + "K", "9" * 20, "8388608T", "9223372036854775808"):
            assert "must be below 8 EiB" in refused(name, value)
        assert _env.get(name, {name: "9223372036854775807"}) == 2**63 - 1
        assert _env.get(name, {name: "0" * 5000 + "12"}) == 12


def test_classes_of_any_length_are_refused_not_a_crash():
    for name in OF_KIND["classes"]:
        assert "a boundary of 5001 digits is not an int" in refused(name, "256," + "1" + "0" * 5000)
        assert "a boundary of 11 digits" in refused(name, "99999999999")
    with pytest.raises(fastattn.InvalidArgumentError, match=r"expected 1 <= LO <= HI"):
        shape_classes.parse_range("1.." + "9" * 5000)
    assert shape_classes.parse_range("0000000000001..0000000000002") == (1, 2)
    assert shape_classes.parse_range("0" * 5000 + "1..0" + "0" * 5000 + "2") == (1, 2)
    assert shape_classes.parse("0" * 5000 + "256, 1024") == shape_classes.parse("256,1024")


# -- count: an integer of ASCII digits, 0 refused where it would empty a table ------------------------


def test_every_count_variable_reads_integers_within_its_bounds():
    assert OF_KIND["count"] == ["FASTATTN_MEMORY_MAX_ENTRIES"]
    for name in OF_KIND["count"]:
        assert _env.get(name, {}) == _env.VARIABLES[name].default == 4096
        assert _env.get(name, {name: "  "}) == 4096  # (empty: the default)
        for text, value in (("1", 1), (" 64 ", 64), ("+8", 8), ("0" * 50 + "12", 12), ("2147483647", 2**31 - 1)):
            assert _env.get(name, {name: text}) == value
        assert refused(name, "0", "a table of 0 entries keeps nothing").endswith("write a number >= 1")
        refused(name, "-0", "a table of 0 entries")
        refused(name, "-5", "is negative")
        for value in ("2147483648", "9" * 30, "1" + "0" * 5000):
            assert refused(name, value).endswith("must be <= 2147483647")
        for value in ("1.5", "1e3", "4K", "1_000", "0x10", "lots", "none"):
            refused(name, value, "must be an integer")


# -- any text ---------------------------------------------------------------------------------------

_NUMERIC = ("seconds", "size", "count", "classes")
_digitish = st.text(alphabet=st.sampled_from("0123456789.eE+-_ ,KMGTib" + "".join(OTHER_DIGITS) + "٠"), max_size=12)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(k for k in OF_KIND if OF_KIND[k])), st.data())
def test_any_text_for_any_kind_is_a_value_or_names_the_variable(kind, data):
    name = data.draw(st.sampled_from(OF_KIND[kind]))
    text = data.draw(st.one_of(st.text(), _digitish, st.builds(lambda d: "1" * d, st.integers(4000, 5000))))
    try:
        value = _env.get(name, {name: text})
    except fastattn.InvalidArgumentError as e:
        assert str(e).startswith(f"{name}=") or str(e) == f"{name} is set but empty", str(e)
        assert len(str(e)) < 1000
        return
    if kind in _NUMERIC and text.strip():
        assert text.strip().isascii(), (name, text, value)
    if kind == "seconds":
        assert value <= _env.MAX_SECONDS
    if kind == "size":
        assert 0 <= value < 2**63
    if kind == "count":
        assert isinstance(value, int) and 1 <= value <= _env.MAX_COUNT


# -- the Redis tier: an OverflowError is a Redis failure -------------------------------------------


def test_an_overflow_from_the_redis_client_is_a_miss_not_a_crash(caplog):
    pytest.importorskip("redis", reason="the redis client is an optional extra")
    from fastattn.store.remote import RemoteSettings, RemoteStore

    # Past what fastattn.env allows (the belt), as a caller of RemoteStore could pass it (the braces):
    # the client's socket.settimeout raises OverflowError before it connects to anything.
    tier = RemoteStore(RemoteSettings(url="redis://127.0.0.1:1/0", timeout=1e10, retry_after=60.0), secret=b"k")
    key = "ab" * 32

    def flight():
        with tier.flight(key) as found:
            return found

    operations = [lambda: tier.get(key), lambda: tier.put(fastattn.store.Entry(key, "plan", {}, {}, {}, 1.0)),
                  flight, lambda: tier.status(check=True)["state"]]
    with caplog.at_level(logging.WARNING, logger="fastattn"):
        for errors, operation in enumerate(operations, 1):
            tier._down_until = 0.0  # (not resting after the one before)
            result = operation()
            assert result in (None, False) or result.startswith("down (OverflowError")
            assert tier.counters["remote_errors"] == errors and tier.state.startswith("down (OverflowError")
    assert "unreachable" in caplog.text
