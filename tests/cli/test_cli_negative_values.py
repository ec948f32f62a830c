"""A flag's value that starts with a dash and a digit (`--max-age -5d`, `--max-bytes
-1G`) is its value, as after `=`: a bad one is named with the flag (exit 2), never
"expected one argument". argparse alone takes only plain numbers (-5, -.5)
as values."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fastattn import cli
from fastattn.cli._common import echo

from helpers.cli import run


def run_json(argv, capsys):
    code, out, err = run(argv + ["--json"], capsys)
    return code, json.loads(out)


@pytest.mark.parametrize("flag, value", [("--max-age", "-5d"), ("--max-age", "-1s"), ("--max-age", "-0.5h"),
                                         ("--max-age", "-1e3"), ("--max-bytes", "-1G"), ("--max-bytes", "-5")])
@pytest.mark.parametrize("form", ["space", "equals"])
def test_a_negative_value_is_named(env, capsys, flag, value, form):
    argv = ["cache", "prune", flag, value] if form == "space" else ["cache", "prune", f"{flag}={value}"]
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT
    assert f"argument {flag}: {echo(value)} is negative" in err, err
    code, body = run_json(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT and flag in body["message"] and echo(value) in body["message"]


_VALUE_CHARS = "0123456789.-+eEsmhdwkgtbiKGT x"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(["--max-age", "--max-bytes"]),
       value=st.text(alphabet=_VALUE_CHARS, min_size=1, max_size=12).filter(lambda v: not v.startswith("--")),
       form=st.sampled_from(["space", "equals"]))
@example(flag="--max-age", value="-h ", form="space")
@example(flag="--max-bytes", value="-h 1", form="equals")
def test_every_value_is_taken_or_named(env, capsys, flag, value, form):
    """Whatever follows --max-age or --max-bytes (but another flag), the prune runs on
    it or says which flag and which value it refuses (exit 2)."""
    argv = ["cache", "prune", flag, value] if form == "space" else ["cache", "prune", f"{flag}={value}"]
    if form == "space" and len(value) > 1 and value[0] == "-" and " " not in value and not re.match(r"-\.?[0-9]",
                                                                                               value):
        return  # `-x`, `-e5`: a flag, as argparse reads a word of one dash that is not a number
    if form == "space" and value.startswith("-h"):
        # `-h 5`: argparse reads a word that starts with a short flag as that flag with the
        # rest attached (`-hX`), before its rule that a word with a space is a value, so
        # the flag's value is missing, which it says (Hypothesis drew '-h ').
        code, body = run_json(argv, capsys)
        assert code == cli.EXIT_BAD_INPUT and body["message"] == f"argument {flag}: expected one argument", body
        return
    code, body = run_json(argv, capsys)
    if code == cli.EXIT_OK:
        assert "removed" in body
        return
    assert code == cli.EXIT_BAD_INPUT, body
    assert body["message"].startswith(f"argument {flag}: {echo(value)} "), body
