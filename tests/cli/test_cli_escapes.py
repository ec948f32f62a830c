"""What the command prints never carries a terminal control: a stored header's strings
(a GPU's name, a defect's, a verdict's reason), a flag's value, anything else, are
shown with each non-printable character escaped (an ANSI escape as \\x1b, a newline
inside a value as \\n, a NUL as \\x00), so that a cache entry from elsewhere cannot
paint the terminal, move its cursor or forge a line of the listing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastattn import cli, runtime, store
from fastattn.cli import _common
from fastattn.store import entry as entry_mod
from fastattn.verdict import Verdict
from helpers.cli import run

BASE = dict(batch=1, heads_q=8, head_dim_qk=64, mask="causal", seqlen_q=128)
NASTY = "\x1b[31mRED\x1b[0m\nforged line\r\x00\x07\u2028\x9b"


def _write(root, *, gpu: str = "NVIDIA H200", defects=(), reason: str | None = None, kind: str = "plan") -> str:
    """Writes an entry whose header holds the strings given; its key (its description's)."""
    description = {"config": BASE, "gpu": {"name": gpu}, "defects": list(defects)}
    key = store.key_of(description)
    meta = {}
    if reason is not None:
        meta["verdict"] = Verdict("skipped", 91900, 6.25e-2, (), reason, 0.0).to_dict()
    entry = store.Entry(key, kind, description, {"forward": b"x"}, meta, 1.0)
    path = os.path.join(root, key[:2], key + ".entry")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(entry_mod.encode(entry))
    return key


def _all_printable(text: str) -> None:
    for line in text.split("\n"):
        assert line.isprintable(), repr(line)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FASTATTN_REMOTE_CACHE", raising=False)
    runtime.clear()
    yield tmp_path / "cache"
    runtime.clear()


def test_stored_strings_are_shown_escaped(cache, capsys):
    keys = [_write(cache, gpu=NASTY), _write(cache, defects=["fine", NASTY]), _write(cache, reason=NASTY)]
    code, out, err = run(["cache", "ls"], capsys)
    assert code == cli.EXIT_OK
    _all_printable(out + err)
    assert len(out.splitlines()) == 1 + 3 + 1  # the heading, a line per entry, the total: none forged
    assert "\\x1b[31mRED\\x1b[0m\\nforged line\\r\\x00\\x07\\u2028\\x9b" in out  # escaped, not dropped
    for key in keys:
        code, out, err = run(["cache", "show", key[:12]], capsys)
        assert code == cli.EXIT_OK
        _all_printable(out + err)
    code, out, err = run(["cache", "verify"], capsys)
    _all_printable(out + err)
    code, out, _ = run(["cache", "ls", "--json"], capsys)
    rows = json.loads(out)["entries"]
    assert {r["config"]["seqlen_q"] for r in rows} == {128}
    assert all(r["summary"].isprintable() for r in rows)


def test_a_damaged_entrys_reason_is_shown_escaped(cache, capsys):
    key = "b1" * 32
    raw = json.dumps({"key": key, "kind": "plan", "description": {"gpu": NASTY}, "created": 1.0, "blobs": [],
                      "meta": {}}, ensure_ascii=False).encode()
    path = cache / key[:2] / f"{key}.entry"
    path.parent.mkdir(parents=True)
    path.write_bytes(entry_mod._FIXED.pack(entry_mod.MAGIC, store.FORMAT_VERSION, len(raw)) + raw
                     + hashlib.sha256(raw).digest())
    for argv in (["cache", "ls"], ["cache", "verify"], ["cache", "show", "b1"]):
        code, out, err = run(argv, capsys)
        assert "Traceback" not in out + err
        _all_printable(out + err)


@pytest.mark.parametrize("argv", [["probe", NASTY], ["cache", "show", NASTY], ["probe", "--dtype", NASTY],
                                  ["warm", "--seqlens", NASTY], [NASTY]])
def test_a_flag_value_is_echoed_escaped(cache, capsys, argv):
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT
    _all_printable(out + err)


def test_printable_escapes_only_what_is_not():
    assert _common.printable("NVIDIA H200 é ß 日本") == "NVIDIA H200 é ß 日本"
    assert _common.printable("a\nb\x1b[0m\x00") == "a\\nb\\x1b[0m\\x00"
    assert _common.printable_lines("one\x1b\ntwo\r") == "one\\x1b\ntwo\\r"


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gpu=st.text(max_size=20), defect=st.text(max_size=20), reason=st.text(min_size=1, max_size=20))
def test_any_stored_string_is_shown_printable(cache, capsys, gpu, defect, reason):
    runtime.clear()
    shutil.rmtree(cache, ignore_errors=True)  # one entry an example: its key is its strings'
    key = _write(cache, gpu=gpu, defects=[defect], reason=reason)
    for argv in (["cache", "ls"], ["cache", "show", key], ["cache", "verify"]):
        code, out, err = run(argv, capsys)
        assert code == cli.EXIT_OK, err
        _all_printable(out + err)
    code, out, _ = run(["cache", "ls"], capsys)
    assert len(out.splitlines()) == 3
