"""Flag values as the command reads and quotes them: a usage error names the flag and
quotes its value, shortened (a 5000-digit value is its first characters and its
length, not a screenful).
"""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn import cli
from fastattn.cli import _common
from helpers.cli import run

LONG = "9" * 5000
PROBE = ["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "128", "--head-dim-qk", "64"]


@pytest.mark.parametrize("argv,flag", [
    (["probe", "--batch", LONG], "--batch"),
    (["probe", "--scale", LONG], "--scale"),
    (["probe", "--window", LONG, "0"], "--window"),
    (["probe", "--dtype", "x" * 5000], "--dtype"),
    (["matrix", "--head-dims", LONG], "--head-dims"),
    (["matrix", "--masks", "x" * 5000], "--masks"),
    (["warm", "--seqlens", LONG], "--seqlens"),
    (["warm", "--shape-classes", LONG], "--shape-classes"),
    (["cache", "prune", "--max-bytes", LONG], "--max-bytes"),
    (["cache", "prune", "--max-age", LONG], "--max-age"),
    (["warm", "--report", "x" * 5000 + "/r.json"], "--report"),
    (["probe", "--config", "x" * 5000], "--config"),
    (["probe", "x" * 5000], "unrecognized arguments"),
    (PROBE + ["--config", "{" + "x" * 5000], "--config"),
    (["cache", "show", "a" * 5000], "key"),
])
def test_a_long_value_is_echoed_shortened(argv, flag, capsys, cache_dir, no_work):
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT and flag in err, err
    message = err.splitlines()[-1]
    assert len(message) < 400 and "characters)" in message, message
    code, out, _ = run(argv + ["--json"], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_BAD_INPUT and len(body["message"]) < 400 and flag in body["message"], body


def test_echo_quotes_short_values_whole_and_long_ones_shortened():
    assert _common.echo("64") == "'64'"
    assert _common.echo("a\nb") == "'a\\nb'"
    shown = _common.echo("7" * 5000)
    assert shown.startswith("'777") and shown.endswith("...' (5000 characters)") and len(shown) < 120
    assert _common.echo("x" * 80) == repr("x" * 80)  # at the limit: whole


# -- numbers: ASCII digits only -------------------------------------------------------------------

# int() and float() take more than a person types as a number: 1_0, Arabic-Indic and
# fullwidth digits, surrounding Unicode spaces. A flag takes ASCII decimal digits (an
# optional sign, a decimal point and exponent for a real number), nothing else.
NOT_ASCII_NUMBERS = ["1_0", "\u0661\u0660", "\u0663", "\uff11\uff12", "1\u0660", "0x10", "1e3", "", " ", "--1", "+-1"]


@pytest.mark.parametrize("text", NOT_ASCII_NUMBERS)
def test_the_integer_parsers_take_ascii_digits_only(text):
    import argparse

    for parse in (_common.integer(1), _common.integer(-1), _common.integer(None, None)):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
    with pytest.raises(argparse.ArgumentTypeError):
        _common.ints(f"64,{text}" if text.strip() else "x")


@pytest.mark.parametrize("text", ["1_0", "\u0661\u0660", "\u0661.\u0665", "1_0.5", "\uff11", "0x1p3", "1e3_0"])
def test_the_real_number_parsers_take_ascii_digits_only(text):
    import argparse

    for parse in (_common.number(above=0), lambda t: _common.size(t + "M"), lambda t: _common.duration(_common.MAX_AGE)(t + "d")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


@pytest.mark.parametrize("text", ["\u0661..\u0664", "\u0661\u0660", "1_0", "9" * 5000, "1..9" + "9" * 5000])
def test_the_length_range_takes_ascii_digits_only(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError) as e:
        _common.length_range(text)
    assert len(str(e.value)) < 300 and "sys.set_int_max_str_digits" not in str(e.value)


@pytest.mark.parametrize("text", ["\u0662\u0665\u0666", "256,\u0661\u0660\u0662\u0664", "9" * 5000])
def test_the_shape_classes_take_ascii_digits_only(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError) as e:
        _common.shape_classes(text)
    assert len(str(e.value)) < 300 and "sys.set_int_max_str_digits" not in str(e.value)


@pytest.mark.parametrize("argv,flag", [(["probe", "--batch", "1_0"], "--batch"),
                                       (["probe", "--batch", "\u0661"], "--batch"),
                                       (["matrix", "--head-dims", "6_4"], "--head-dims"),
                                       (["probe", "--scale", "\u0661.\u0665"], "--scale"),
                                       (["warm", "--seqlens", "\u0661..\u0664"], "--seqlens"),
                                       (["cache", "prune", "--max-age", "\u0661d"], "--max-age")])
def test_a_number_that_is_not_ascii_is_a_usage_error(argv, flag, capsys, cache_dir, no_work):
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT and f"argument {flag}:" in err, err


def test_the_integer_parsers_take_what_people_type():
    assert _common.integer(1)("64") == 64 and _common.integer(1)(" 7 ") == 7 and _common.integer(1)("+5") == 5
    assert _common.integer(-1)("-1") == -1 and _common.integer(0)("0") == 0
    assert _common.ints("64, 128") == [64, 128]
    with pytest.raises(argparse.ArgumentTypeError, match="item 3 is empty"):  # (tests/cli/test_cli_lists.py)
        _common.ints("64, 128,")
    assert _common.number(above=0)("1.5e-3") == 1.5e-3 and _common.number(above=0)(".5") == 0.5
    assert _common.size("1.5G") == int(1.5 * (1 << 30)) and _common.duration(_common.MAX_AGE)("2.5h") == 9000.0
    assert _common.length_range("1..32768") == (1, 32768)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.one_of(st.text(max_size=12), st.from_regex(r"\A\s?[+-]?[0-9]{1,25}\s?\Z"),
                      st.text(alphabet="0123456789_+- \u0660\u0661\uff11", max_size=8)),
       minimum=st.sampled_from([None, -1, 0, 1]))
def test_the_integer_parser_takes_ascii_integers_in_range_or_names_the_rule(text, minimum):
    import argparse
    import re

    parse = _common.integer(minimum)
    try:
        value = parse(text)
    except argparse.ArgumentTypeError as e:
        assert len(str(e)) < 300
        m = re.fullmatch(r"[+-]?[0-9]+", text.strip(" \t\n\r\x0b\x0c"))
        if m:  # an integer, out of range
            assert (minimum is not None and int(text) < minimum) or int(text) > _common.INT_MAX, text
        return
    assert re.fullmatch(r"[+-]?[0-9]+", text.strip(" \t\n\r\x0b\x0c")) and value == int(text)
    assert (minimum is None or value >= minimum) and value <= _common.INT_MAX
