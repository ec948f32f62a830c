"""Every message a user reads is fastattn's own words, naming the flag, field or file
and the value: never argparse's internal names ("required: command", "cache_command")
nor Python's own wording ("not NoneType", "maximum recursion depth", "decode using
utf-8-sig", "[Errno 2]", a codec's "can't decode byte"). Many bad inputs are driven
through the command and the API's config readers, and their messages searched for
Python's phrasing."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import AttentionConfig, cli
from helpers.cli import run

# Python's (and argparse's internal) phrasing: none of it is fastattn's.
PYTHON_WORDS = re.compile(
    r"NoneType|\bnot (?:int|str|float|list|dict|bool|bytes|tuple)\b|maximum recursion depth|utf-8-sig|\[Errno \d+\]"
    r"|codec can't|can't decode|invalid start byte|Traceback|required: command\b|cache_command|object has no attribute"
    r"|unhashable|positional argument|invalid literal|could not convert|Unexpected UTF-8 BOM|JSONDecodeError"
    r"|UnicodeDecodeError|RecursionError|TypeError|KeyError|ValueError|a bug in fastattn")

ENTRY = {"batch": 1, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}
BOM = "\ufeff"

# Config file contents a person can write by mistake, for warm FILE and probe --config FILE.
BAD_FILES = [
    "null", "1", '"x"', "true", "[null]", "[1]", '["x"]', "[[]]", '{"configs": null}', '{"configs": [null]}',
    '{"configs": [1]}', '{"configs": "x"}', '{"configs": {}}', "[" * 5000, "{" * 5000, '{"a":' * 5000,
    BOM + json.dumps(ENTRY), json.dumps({**ENTRY, "batch": None}), json.dumps({**ENTRY, "batch": "1"}),
    json.dumps({**ENTRY, "batch": [None]}), json.dumps({**ENTRY, "mask": 3}), json.dumps({**ENTRY, "window": 3}),
    json.dumps({**ENTRY, "window": [None, None]}), json.dumps({**ENTRY, "window": {"a": 1}}),
    json.dumps({**ENTRY, "layout": 3}), json.dumps({**ENTRY, "layout": [3]}), json.dumps({**ENTRY, "scale": "x"}),
    json.dumps({**ENTRY, "seqlen_q": {"from": None, "to": 3}}), json.dumps({**ENTRY, "seqlen_q": {"from": 1}}),
    json.dumps({**ENTRY, "dtype": None}), json.dumps({**ENTRY, "training": "yes"}), '{"batch": 1,}',
    "", " ", "\n\n", "a = ", "[[configs]]\nbatch = ", "batch = 1\nbatch = 2",
]
BAD_BYTES = [b"\xff\xfe{}", b'{"batch": 1, "x": "\xff"}', b"\x00", BOM.encode() + b"\xff"]


# What the `no_work` fixture says when a command takes its input as valid and starts.
VALID = "started work before refusing its input"


def _assert_own_words(text: str, what) -> None:
    if VALID in text:
        return  # a valid input (a window [null, null] is unbounded): nothing was refused
    found = PYTHON_WORDS.search(text)
    assert found is None, (what, found.group(), text)


def _file_readers(path: str) -> list[list[str]]:
    return [["warm", path, "--no-torch-ops"], ["probe", "--config", path]]


@pytest.mark.parametrize("content", BAD_FILES + BAD_BYTES)
@pytest.mark.parametrize("suffix", [".json", ".toml", ".jsonl", ""])
def test_a_bad_config_file_is_said_in_fastattns_words(content, suffix, tmp_path, capsys, cache_dir, no_work):
    path = tmp_path / f"c{suffix}"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    for argv in _file_readers(str(path)):
        code, out, err = run(argv, capsys)
        assert code == cli.EXIT_BAD_INPUT or VALID in err, (argv, code, err)
        _assert_own_words(err, argv)


@pytest.mark.parametrize("content", BAD_FILES)
def test_bad_json_text_for_probe_is_said_in_fastattns_words(content, capsys, cache_dir, no_work):
    if not content.strip():
        return  # (an empty --config is refused as an empty path)
    code, out, err = run(["probe", "--config", content], capsys)
    assert code == cli.EXIT_BAD_INPUT or VALID in err, (content, err)
    _assert_own_words(err, content)


@pytest.mark.parametrize("argv", [[], ["cache"], ["nope"], ["cache", "nope"], ["probe", "--nope"], ["--json"],
                                  ["cache", "--json"], ["warm", "a", "b"], ["probe", "--window", "1"]])
def test_usage_errors_are_said_in_fastattns_words(argv, capsys, cache_dir, no_work):
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT, (argv, err)
    _assert_own_words(out + err, argv)


def test_a_missing_command_is_named_with_the_commands():
    import io
    import sys

    for argv, names in (([], "info, probe, warm, matrix, cache"), (["cache"], "ls, show, verify")):
        err = io.StringIO()
        stderr, sys.stderr = sys.stderr, err
        try:
            assert cli.main(argv) == cli.EXIT_BAD_INPUT
        finally:
            sys.stderr = stderr
        assert "a command is needed" in err.getvalue() and names in err.getvalue(), err.getvalue()


@pytest.mark.parametrize("value", [None, 3, b"\xff", BOM + json.dumps(ENTRY), (BOM + json.dumps(ENTRY)).encode(),
                                   "[" * 100000, "null", "[1]", json.dumps({**ENTRY, "batch": None})])
def test_the_apis_config_readers_say_it_in_fastattns_words(value):
    try:
        cfg = AttentionConfig.from_json(value) if not isinstance(value, int) else AttentionConfig.coerce(value)
    except fastattn.InvalidArgumentError as e:
        _assert_own_words(str(e), value)
        return
    assert isinstance(cfg, AttentionConfig) and str(value).lstrip(BOM).startswith("{") or value.startswith(b"\xef")


_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                          max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(sorted(f.name for f in fastattn.config.FIELDS)), value=_json_values,
       wrap=st.sampled_from(["fields", "configs"]))
def test_any_json_value_for_any_field_is_said_in_fastattns_words(field, value, wrap, tmp_path, capsys, cache_dir,
                                                                 no_work):
    entry = {**ENTRY, field: value}
    text = json.dumps({"configs": [entry]} if wrap == "configs" else entry)
    (tmp_path / "w.json").write_text(text)
    code, out, err = run(["warm", str(tmp_path / "w.json"), "--no-torch-ops"], capsys)
    _assert_own_words(err, text)
