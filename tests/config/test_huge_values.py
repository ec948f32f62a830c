"""Values past what Python prints or reads: an integer longer than its str() limit
(sys.get_int_max_str_digits(), 4300 digits), a repr that raises, megabytes of text.
Each reaches a config as an InvalidArgumentError naming the field (or, in text that
the parser cannot read, the place), on every path: the constructor, from_dict,
from_json, coerce, warm files (JSON, JSON Lines, TOML); and the message that echoes
the value never fails itself (fastattn._fields.show)."""

from __future__ import annotations

import contextlib
import json
import sys
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn import _fields, shape_classes, config_files
from fastattn.config import FIELDS, AttentionConfig
from fastattn.errors import InvalidArgumentError

BASE = {"batch": 1, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}
LIMIT = sys.get_int_max_str_digits()
HUGE = 10**5000  # 5001 digits: str() and int() of text refuse it


@contextlib.contextmanager
def no_digit_limit():
    """What a test needs to write such an integer as text at all."""
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(LIMIT)


def dumps(value) -> str:
    with no_digit_limit():
        return json.dumps(value)


# -- the tester's cases ----------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("batch", HUGE), ("batch", -HUGE), ("scale", HUGE), ("window", (HUGE, 0)),
                                         ("num_pages", HUGE), ("layout", {t: [HUGE, 1, 1, 1] for t in "qkvo"}),
                                         ("dropout", Fraction(HUGE, 3)), ("dtype", HUGE), ("mask", HUGE)],
                         ids=lambda v: v if isinstance(v, str) else type(v).__name__)  # (not the integer)
def test_a_huge_integer_from_python_is_invalid_argument_naming_the_field(field, value):
    for make in (lambda: AttentionConfig(**{**BASE, field: value}),
                 lambda: AttentionConfig.from_dict({**BASE, field: value}),
                 lambda: AttentionConfig.coerce({**BASE, field: value}),
                 lambda: config_files.expand_entry({**BASE, field: value}, "w.json: configs[0]")):
        with pytest.raises(InvalidArgumentError, match=rf"^(w\.json: configs\[0\]: )?{field}") as e:
            make()
        assert "integer of 5001 digits" in str(e.value) or field in ("dropout", "layout")
        assert len(str(e.value)) < 600


def test_a_huge_integer_in_json_text_is_invalid_argument_with_its_place():
    text = '{"batch": %s, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}' % ("1" + "0" * 5000)
    for make in (lambda: AttentionConfig.from_json(text), lambda: AttentionConfig.coerce(text),
                 lambda: AttentionConfig.from_json(text.encode())):
        with pytest.raises(InvalidArgumentError) as e:
            make()
        assert str(e.value) == f"config JSON: an integer of 5001 digits: Python reads at most {LIMIT}: line 1 column 11"


def test_the_place_skips_digits_inside_strings():
    digits = "7" * 5000
    text = '{"heads_q": "%s",\n "batch":   -%s}' % (digits, digits)
    assert _fields.long_integer(text) == (2, 14, f"an integer of 5000 digits: Python reads at most {LIMIT}")
    assert _fields.long_integer(b"\xff\xfe") == (None, None, f"an integer of more than {LIMIT} digits: Python reads "
                                                              f"at most {LIMIT}")


@pytest.mark.parametrize("name,text,place", [
    ("w.json", '{"configs": [{"batch": 1},\n  {"batch": %s}]}', "w.json:2:13: not valid JSON"),
    ("w.jsonl", '{"batch": 1}\n\n{"batch": %s}\n', "w.jsonl:3:11: not valid JSON"),
    ("w.toml", '[[configs]]\nbatch = %s\n', "w.toml:2:9: not valid TOML"),
    ("w.toml", '# 1%s\n[[configs]]\nheads_q = 8\nbatch = 1_0%s\n', "w.toml:4:9: not valid TOML"),
    ("w.cfg", 'batch = %s\n', "w.cfg:1:9: not valid TOML"),  # neither named: read as JSON, then as TOML
])
def test_a_huge_integer_in_a_file_is_invalid_argument_with_the_file_and_place(tmp_path, name, text, place):
    path = tmp_path / name
    path.write_text(text.replace("%s", "1" + "0" * 5000))
    for read in (config_files.load_configs, config_files.read_entries):
        with pytest.raises(InvalidArgumentError) as e:
            read(str(path))
        assert place in str(e.value) and "integer of 500" in str(e.value), str(e.value)
        assert len(str(e.value)) < 600


def test_a_huge_integer_in_config_text_is_invalid_argument():
    with pytest.raises(InvalidArgumentError, match=r"^--config:1:11: not valid JSON: an integer of 5001 digits"):
        config_files.entries_in_text('{"batch": %s}' % ("1" + "0" * 5000), "--config")


def test_a_huge_range_bound_names_the_range():
    with pytest.raises(InvalidArgumentError, match=r"^w: configs\[0\]\.batch\.from=\[an integer of 5001 digits\]"):
        config_files.expand_entry({**BASE, "batch": {"from": [HUGE], "to": 2}}, "w: configs[0]")
    with pytest.raises(InvalidArgumentError, match=r"from=an integer of 5001 digits is greater than to=2$"):
        config_files.expand_entry({**BASE, "batch": {"from": HUGE, "to": 2}}, "w: configs[0]")
    with pytest.raises(InvalidArgumentError, match=r"more than 100000 values"):
        config_files.expand_entry({**BASE, "batch": {"from": 1, "to": HUGE}}, "w: configs[0]")


def test_shape_classes_show_what_they_refuse():
    with pytest.raises(InvalidArgumentError, match=r"^shape_classes=\(an integer of 5001 digits,\): boundary an "):
        shape_classes.parse((HUGE,))


# -- show(): the one way a message echoes a value -------------------------------------------


class _NoRepr:
    def __repr__(self):
        raise RuntimeError("no repr")

    __str__ = __repr__

    def _repr_pretty_(self, p, cycle):  # how Hypothesis prints it
        p.text("_NoRepr()")


def test_show():
    assert _fields.show(HUGE) == "an integer of 5001 digits"
    assert _fields.show(-HUGE + 1) == "a negative integer of 5000 digits"
    assert _fields.show(10**38) == "1" + "0" * 38 and _fields.show(2**128) == "an integer of 39 digits"
    assert _fields.show((HUGE, 0)) == "(an integer of 5001 digits, 0)"
    assert _fields.show({"q": [1, 2], "b": None}) == "{'q': [1, 2], 'b': None}"  # the user's order
    assert _fields.show("bf16") == "'bf16'" and _fields.show(frozenset()) == "frozenset()"
    assert _fields.show(True) == "True" and _fields.show(0.1) == "0.1" and _fields.show(b"x") == "b'x'"
    assert _fields.show(_NoRepr()).startswith("<_NoRepr") and _fields.show([_NoRepr()]).startswith("[<_NoRepr")
    for value in ("x" * 10**6, list(range(10**5)), {i: "y" * 1000 for i in range(100)}, [[[[[[1]]]]]] * 100):
        assert len(_fields.show(value)) <= _fields.SHOWN


def test_digits_are_counted_exactly():
    for n in (1, 9, 10, 99, 100, 10**39 - 1, 10**39, 10**40, 2**128, 2**129, 10**1000 - 1, 10**1000):
        assert _fields._digits(n) == len(str(n))


# -- properties --------------------------------------------------------------------------------

_huge_ints = st.builds(lambda digits, sign: sign * 10 ** (digits - 1), st.integers(LIMIT - 10, LIMIT + 100),
                       st.sampled_from([1, -1]))
_numbers = st.integers() | _huge_ints | st.floats() | st.sampled_from([2**31, 2**63, -1, 0, 1.5])
_json_values = st.recursive(st.none() | st.booleans() | _numbers | st.text(max_size=8),
                            lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=8)
_python_values = st.recursive(
    _json_values | st.binary(max_size=8) | st.complex_numbers() | st.fractions()
    | st.decimals(allow_nan=True) | st.builds(Fraction, _huge_ints) | st.just(_NoRepr()) | st.just(object()),
    lambda inner: st.lists(inner, max_size=4).map(tuple) | st.frozensets(st.integers() | st.text(max_size=4))
    | st.dictionaries(st.sampled_from("qkvo"), inner, max_size=4), max_leaves=8)
_names = st.sampled_from([f.name for f in FIELDS])


def _config_or_invalid(make) -> None:
    try:
        cfg = make()
    except InvalidArgumentError as e:
        assert len(str(e)) < 2000  # a message, not the value
        return
    assert AttentionConfig.from_json(cfg.to_json()) == cfg


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.dictionaries(_names, _python_values, max_size=3))
def test_any_python_value_for_any_field_is_a_config_or_invalid_argument(values):
    data = {**BASE, **values}
    _config_or_invalid(lambda: AttentionConfig(**data))
    _config_or_invalid(lambda: AttentionConfig.coerce(data))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(values=st.dictionaries(_names | st.text(max_size=4), _json_values, max_size=3),
       kind=st.sampled_from(["json", "toml"]))
def test_any_json_text_is_a_config_or_invalid_argument(tmp_path_factory, values, kind):
    text = dumps({**BASE, **values})
    _config_or_invalid(lambda: AttentionConfig.from_json(text))
    _config_or_invalid(lambda: AttentionConfig.from_json(text.encode()))
    path = tmp_path_factory.mktemp("w") / f"w.{kind}"
    if kind == "toml":  # the same values as TOML, where they can be written so (no nulls, no mixed arrays)
        text = "\n".join(f"{k} = {dumps(v)}" for k, v in values.items() if isinstance(v, (int, str)))
    path.write_text(text)
    try:
        config_files.load_configs(str(path))
    except InvalidArgumentError as e:
        assert len(str(e)) < 2000


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(alphabet=st.sampled_from('{}[]",:0123456789-.eE \ntrufalsn'), max_size=60), _huge_ints)
def test_any_text_with_a_huge_integer_is_invalid_argument(text, huge):
    with no_digit_limit():
        doctored = text.replace("9", str(huge), 1)
    _config_or_invalid(lambda: AttentionConfig.from_json(doctored))
    try:
        for entry, where in zip(*config_files.entries_in_text(doctored, "--config")):
            config_files.expand_entry(entry, where)
    except InvalidArgumentError as e:
        assert len(str(e)) < 2000


def test_decimal_and_fraction_values_are_numbers():
    assert AttentionConfig(**BASE, scale=Decimal("0.5")).scale == 0.5
    assert AttentionConfig(**BASE, dropout=Fraction(1, 4)).dropout == 0.25
