"""One meaning per variable on every command: a bad value of any FASTATTN_* variable
fastattn reads at run time is exit 2 naming the variable, whichever subcommand runs and
whether or not its path reads that variable (fastattn/env.py declares them; `main`
checks them all before a command starts)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fastattn import cli, env as _env
from fastattn.errors import InvalidArgumentError
from helpers.cli import run

# Kinds whose every text is a value (a path, text): nothing to refuse.
FREE = ("path", "paths", "text")
CHECKED = sorted(v.name for v in _env.VARIABLES.values() if v.scope == "runtime" and v.kind not in FREE)
_chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
_BAD = {  # values each kind refuses, to mix with generated text
    "bool": ["garbage", "2", "y", "1.0"], "choice": ["garbage", "read_write"], "seconds": ["garbage", "-1", "1e999",
    "nan", "1_0", "0x10"], "size": ["garbage", "-1", "1Q", "9E"], "count": ["garbage", "0", "-1", "1.5", "1_0",
    "99999999999"], "url": ["garbage", "redis://h:99999/0", "http://h"],
    "classes": ["garbage", "4096,256", "0", "auto,256"], "secret": [""],
}


def _bad_values(name: str):
    kind = _env.VARIABLES[name].kind
    if kind == "secret":  # only empty (set, but nothing in it) is refused
        return st.text(alphabet=" \t", max_size=3)
    return st.one_of(st.sampled_from(_BAD[kind]), st.text(_chars, min_size=1, max_size=12))


def _refused(name: str, value: str) -> bool:
    try:
        _env.get(name, {name: value})
    except InvalidArgumentError:
        return True
    return False


def test_every_checked_kind_has_bad_values_here():
    kinds = {_env.VARIABLES[n].kind for n in CHECKED}
    assert kinds <= set(_BAD) and {"FASTATTN_SDPA", "FASTATTN_WARM_UP", "FASTATTN_SHAPE_CLASSES",
                                   "FASTATTN_REMOTE_TIMEOUT"} <= set(CHECKED)
    # The test suite's and the build's variables are not the command's to check.
    assert not any(n.startswith("FASTATTN_TEST_") or n.endswith("_INCLUDE") for n in CHECKED)


@pytest.fixture
def commands(tmp_path, monkeypatch, no_work):
    """Real invocations of every subcommand, with a cache of their own."""
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "cache"))
    warm_file = tmp_path / "w.json"
    warm_file.write_text('{"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64}')
    return [["info"], ["cache", "ls"], ["cache", "verify"], ["cache", "prune"],
            ["warm", str(warm_file), "--no-torch-ops"], ["warm"],
            ["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "64", "--head-dim-qk", "64"],
            ["matrix", "--head-dims", "64"]]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_bad_value_is_exit_2_naming_the_variable_on_every_command(commands, capsys, data):
    # FASTATTN_SDPA=garbage was exit 2 for info, exit 0 without a word for `cache ls`, exit 3 for warm.
    name = data.draw(st.sampled_from(CHECKED), label="variable")
    value = data.draw(_bad_values(name), label="value")
    assume(_refused(name, value))
    with mock.patch.dict(os.environ, {name: value}):
        for argv in commands:
            code, out, err = run(argv, capsys)
            assert code == cli.EXIT_BAD_INPUT, (argv, out, err)
            assert err.startswith(f"fastattn: InvalidArgumentError: {name}"), (argv, err)


@pytest.mark.parametrize("name", ["FASTATTN_SDPA", "FASTATTN_WARM_UP", "FASTATTN_SHAPE_CLASSES",
                                  "FASTATTN_REMOTE_TIMEOUT"])
def test_the_reported_variables_are_named_with_their_value_in_json_too(commands, capsys, monkeypatch, name):
    import json

    monkeypatch.setenv(name, "garbage")
    for argv in commands:
        code, out, _ = run(argv + ["--json"], capsys)
        body = json.loads(out)
        assert code == cli.EXIT_BAD_INPUT and body["error"] == "InvalidArgumentError", (argv, body)
        assert body["message"].startswith(f"{name}='garbage': "), (argv, body)


def test_help_and_version_need_no_good_environment(capsys, monkeypatch):
    monkeypatch.setenv("FASTATTN_SDPA", "garbage")
    assert run(["--version"], capsys)[0] == cli.EXIT_OK
    assert run(["cache", "ls", "--help"], capsys)[0] == cli.EXIT_OK


def test_the_suites_and_the_builds_variables_are_not_checked_by_the_command(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FASTATTN_REQUIRE_REDIS", "garbage")
    monkeypatch.setenv("FASTATTN_CUDNN_INCLUDE", "")
    assert run(["cache", "ls"], capsys)[0] == cli.EXIT_OK
