"""Numbers a person writes, in a flag or a FASTATTN_* variable: one parser per kind
(fastattn.parsing: a count, a real number, a duration, a size in bytes), so that a
kind reads the same text as the same value wherever it is written; every numeric flag
range-checked (a value past its bound is named, exit 2); 0 is zero everywhere, and where
zero would empty the cache (--max-bytes, --max-age, FASTATTN_CACHE_MAX_BYTES) it is
refused, naming what does that, never taken as "no limit" in one place and "nothing"
in another."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import cli, runtime
from fastattn import env as _env
from helpers.cli import parser_actions, run

KINDS = ("count", "real", "duration", "bytes")


def _numeric_flags():
    """(command, flag, kind, action) of every flag whose value is a number or a list of
    numbers (a flag added later is swept too)."""
    return [(path, a.option_strings[0], a.type.number_kind, a) for path, a in parser_actions()
            if a.option_strings and getattr(a.type, "number_kind", None) is not None]


NUMERIC = _numeric_flags()


def test_every_numeric_flag_has_a_kind_and_the_known_ones_are_found():
    flags = {(c, f): k for c, f, k, _ in NUMERIC}
    assert set(flags.values()) <= set(KINDS)
    assert flags[("warm",), "--timeout"] == "duration" and flags[("cache", "prune"), "--max-age"] == "duration"
    assert flags[("cache", "prune"), "--max-bytes"] == "bytes" and flags[("probe",), "--scale"] == "real"
    assert flags[("matrix",), "--head-dims"] == "count" and flags[("warm",), "--workers"] == "count"
    # Every flag that takes a typed value and is not a path, a choice or a list of
    # names is numeric (so that none escapes the sweep below).
    names = {"input_path", "output_file", "choices", "length range", "shape_classes"}
    for parser_path, action in ((p, a) for p, a in parser_actions() if a.type is not None):
        if getattr(action.type, "number_kind", None) is None:
            assert action.type.__name__ in names, (parser_path, action.option_strings, action.type)


# Values past any bound a flag of the kind has, in the forms the kind takes.
HUGE = {"count": ["9" * 30, "2147483648"], "real": ["1e300", "9" * 400],
        "duration": ["1e300", "99999999999999999999d", "1e7w"], "bytes": ["9" * 30, "99999999999T", "9E"]}


@pytest.mark.parametrize("command,flag,kind", [(c, f, k) for c, f, k, _ in NUMERIC])
def test_every_numeric_flag_refuses_a_value_past_its_bound(command, flag, kind, capsys, cache_dir, no_work):
    for value in HUGE[kind]:
        argv = [*command, f"{flag}={value}"] + (["1"] if flag == "--window" else [])
        code, out, err = run(argv, capsys)
        assert code == cli.EXIT_BAD_INPUT and f"argument {flag}" in err, (argv, err)


@pytest.mark.parametrize("argv", [["warm", "--timeout", "1e300"], ["warm", "--timeout", "1000001"],
                                  ["cache", "prune", "--max-age", "99999999999999999999d"],
                                  ["cache", "prune", "--max-age", "36501d"]])
def test_the_issues_huge_values_are_refused(argv, capsys, cache_dir, no_work):
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT and "must be <=" in err, err


# -- one parser per kind: a flag and a variable of one kind read text alike ----------------------


def _flag_value(command, flag, text):
    action = next(a for c, f, _, a in NUMERIC if c == command and f == flag)
    try:
        return action.type(text)
    except argparse.ArgumentTypeError:
        return None


def _env_value(name, text):
    try:
        return _env.get(name, {name: text})
    except fastattn.InvalidArgumentError:
        return None


_number_text = st.one_of(
    st.from_regex(r"\A ?[+-]?([0-9]{1,8}(\.[0-9]{0,3})?|\.[0-9]{1,3})([eE][+-]?[0-9]{1,2})?[smhdwKMGTkmgt]?(i?[bB])? ?\Z"),
    st.text(alphabet="0123456789.eE+-_ smhdwKMGTiB,\u0660", max_size=10))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(text=_number_text)
def test_a_duration_reads_alike_in_a_flag_and_a_variable(text):
    """--timeout and FASTATTN_REMOTE_WAIT (both at most 1e6 s) take the same texts,
    as the same number of seconds; --max-age takes them too (a larger bound)."""
    if not text.strip():
        return  # (an empty variable is its default)
    flag, var = _flag_value(("warm",), "--timeout", text), _env_value("FASTATTN_REMOTE_WAIT", text)
    if flag is not None or var is not None:
        assert flag == var or (var == 0 and flag is None), (text, flag, var)  # (--timeout must be > 0)
    if var is not None and var > 0:
        assert _flag_value(("cache", "prune"), "--max-age", text) == var


@settings(max_examples=400, deadline=None, derandomize=True)
@given(text=_number_text)
def test_a_size_reads_alike_in_a_flag_and_a_variable(text):
    if not text.strip():
        return
    flag, var = _flag_value(("cache", "prune"), "--max-bytes", text), _env_value("FASTATTN_WARM_UP_MAX_BYTES", text)
    assert flag == var or (var == 0 and flag is None), (text, flag, var)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(text=_number_text)
def test_a_count_reads_alike_in_a_flag_and_a_variable(text):
    """--workers (an integer >= 1) and FASTATTN_MEMORY_MAX_ENTRIES (0 refused: a table that
    keeps nothing) take the same texts, as the same number."""
    if not text.strip():
        return
    flag, var = _flag_value(("warm",), "--workers", text), _env_value("FASTATTN_MEMORY_MAX_ENTRIES", text)
    assert flag == var, (text, flag, var)


def test_a_bare_number_is_seconds_and_the_help_says_so():
    assert _flag_value(("cache", "prune"), "--max-age", "90") == 90.0 == _env.get("FASTATTN_REMOTE_WAIT",
                                                                                {"FASTATTN_REMOTE_WAIT": "90"})
    assert _flag_value(("warm",), "--timeout", "2m") == 120.0 == _env.get("FASTATTN_REMOTE_WAIT",
                                                                        {"FASTATTN_REMOTE_WAIT": "2m"})
    for _, flag, kind, action in NUMERIC:
        if kind == "duration":
            assert "a bare number is seconds" in action.help, (flag, action.help)
    assert "a bare number is seconds" in _env.markdown()


# -- 0 is zero; a zero that would empty the cache is refused -----------------------------------


@pytest.mark.parametrize("flag", ["--max-bytes", "--max-age"])
@pytest.mark.parametrize("zero", ["0", "0.0", "0K", "0d", "+0"])
def test_a_zero_limit_does_not_empty_the_cache(flag, zero, capsys, env):
    if flag == "--max-bytes" and zero in ("0d", "0.0") or flag == "--max-age" and zero.endswith("K"):
        return  # (not a size, not a duration: refused as such)
    from helpers.cli import fill

    fill(1)
    before = len(list(runtime.plan_cache().store.entries()))
    code, out, err = run(["cache", "prune", flag, zero], capsys)
    assert code == cli.EXIT_BAD_INPUT and "fastattn cache clear" in err, err
    assert len(list(runtime.plan_cache().store.entries())) == before > 0


def test_the_cache_size_variable_takes_zero_as_zero_and_none_as_no_limit():
    from fastattn import store

    with pytest.raises(fastattn.InvalidArgumentError, match=r"^FASTATTN_CACHE_MAX_BYTES='0': .*none.*MODE=off"):
        store.settings_from_env({"FASTATTN_CACHE_MAX_BYTES": "0"})
    for spelling in ("none", "None", " NONE "):
        assert store.settings_from_env({"FASTATTN_CACHE_MAX_BYTES": spelling}).max_bytes is None
    assert _env.get("FASTATTN_WARM_UP_MAX_BYTES", {"FASTATTN_WARM_UP_MAX_BYTES": "0"}) == 0  # zero: no plans
    with pytest.raises(fastattn.InvalidArgumentError):  # no limit is not a warm-up setting
        _env.get("FASTATTN_WARM_UP_MAX_BYTES", {"FASTATTN_WARM_UP_MAX_BYTES": "none"})


# -- any text: taken within the bounds, or refused naming the flag ----------------------------------


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(range(len(NUMERIC))), text=st.one_of(_number_text, st.text(max_size=8)))
def test_any_text_is_a_value_in_range_or_a_named_refusal(which, text, capsys, cache_dir, no_work):
    command, flag, kind, action = NUMERIC[which]
    try:
        value = action.type(text)
    except argparse.ArgumentTypeError as e:
        message = str(e)
        assert "Error" not in message and "could not convert" not in message and "invalid literal" not in message
        return
    values = value if isinstance(value, list) else [value]
    for v in values:
        assert isinstance(v, float if kind in ("real", "duration") else int), (flag, text, v)
        assert abs(v) < 2**63
