"""Property tests of the whole command line: every subcommand with generated argument
lists, run in-process through cli.main on the fake core (no GPU, no worker processes).

Each run asserts: an exit code in the documented set (never 5, a bug), no traceback
in stdout or stderr, stdout one JSON document when --json is on the line, and no file
written anywhere but the cache directory and the working directory the command was
given (where a user's --report, --png or bundle lands). Bounded and derandomized."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fake_core
import fastattn.warm
from fastattn import cli, runtime
from fastattn.cli._main import build_parser
from fastattn.warm import WarmItem, WarmReport

ALLOWED = {cli.EXIT_OK, cli.EXIT_UNSUPPORTED, cli.EXIT_BAD_INPUT, cli.EXIT_NO_GPU, cli.EXIT_FAILED}
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _fake_warm(configs, *, workers=None, device=None, progress=None, timeout=600.0):
    """warm() without worker processes: the fake core's answers by head dim."""
    items = []
    for c in configs:
        refused = c.head_dim_qk == 1024
        items.append(WarmItem(c, status="unsupported" if refused else "built", reason="forward: refused " * refused))
    counts = {s: sum(i.status == s for i in items) for s in ("built", "loaded", "unsupported", "failed")}
    return WarmReport(items, 0.0, workers or 1, counts, 1)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(runtime, "_core", lambda: fake_core)
    monkeypatch.setattr(fake_core, "GPU_NAME", ["NVIDIA H200"])
    monkeypatch.setattr(fastattn.warm, "warm", _fake_warm)
    monkeypatch.delenv("FASTATTN_REMOTE_CACHE", raising=False)
    # warm builds the torch op library where torch is installed: a compiler that fails at
    # once (reported, not fatal) instead of a real build per example.
    monkeypatch.setenv("CXX", "false")
    yield
    runtime.clear()


def _flags(*path: str) -> list[str]:
    """A subcommand's option strings, from the parser itself (new flags are covered too)."""
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if a.dest in ("command", "cache_command"))
        parser = sub.choices[name]
    return sorted(s for a in parser._actions for s in a.option_strings)


# Values that have broken commands before, and their neighbours; never head dims 72 or 80
# (the fake core's stand-ins for a crash and a hang).
VALUES = ["0", "1", "-1", "-2", "-8", "8", "64", "1024", "2147483648", "1e400", "inf", "nan", "-inf", "x", "",
          "1.5", "0.1", "64,128", "64,0", "1,,2", "causal", "causal_bottom_right", "none", "bf16", "dense,bias",
          "paged", "500M", "1e3G", "30d", "soon", "[1,2]", "{}", '{"window": {"left": 16, "right": 0}}',
          '{"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64}', "r.json", "g.png", "b.tgz",
          "junk.bin", "w.toml", "w.json", "/nonexistent/dir/f", ".", "deadbeef", "--", "-h", "-"]


def _argv(prefix: list[str], flags: list[str], starts=([],)):
    """Flag-value pairs (mostly) and stray tokens, after one of `starts`; --json or not."""
    pair = st.tuples(st.sampled_from(flags), st.sampled_from(VALUES)).map(list)
    single = st.sampled_from(flags + VALUES).map(lambda t: [t])
    parts = st.lists(st.one_of(pair, pair, single), max_size=6)
    return st.tuples(st.sampled_from(starts), parts, st.booleans()).map(
        lambda t: prefix + t[0] + sum(t[1], []) + (["--json"] if t[2] else []))


PROBE_OK = ["--batch", "1", "--heads-q", "8", "--seqlen-q", "128", "--head-dim-qk", "64"]


def _run(argv: list[str]) -> None:
    with tempfile.TemporaryDirectory() as root:
        work, cache, bugs = (os.path.join(root, d) for d in ("work", "cache", "bugs"))
        for d in (work, bugs):
            os.mkdir(d)
        with open(os.path.join(work, "junk.bin"), "wb") as f:
            f.write(os.urandom(64))
        with open(os.path.join(work, "w.toml"), "w") as f:
            f.write("[[configs]]\nbatch = 1\nheads_q = 8\nseqlen_q = [64, 128]\nhead_dim_qk = [64, 1024]\n")
        with open(os.path.join(work, "w.json"), "w") as f:
            f.write('{"configs": [{"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64, "dtype": "fp8"}]}')
        before = set(os.listdir(work))
        out, err = io.StringIO(), io.StringIO()
        old_cwd, old_env, old_tmp = os.getcwd(), os.environ.get("FASTATTN_CACHE_DIR"), tempfile.tempdir
        os.environ["FASTATTN_CACHE_DIR"] = cache
        tempfile.tempdir = bugs  # where a bug's traceback file would go
        runtime.clear()
        try:
            os.chdir(work)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main(argv)
        finally:
            os.chdir(old_cwd)
            tempfile.tempdir = old_tmp
            if old_env is None:
                os.environ.pop("FASTATTN_CACHE_DIR", None)
            else:
                os.environ["FASTATTN_CACHE_DIR"] = old_env
        text = out.getvalue() + err.getvalue()
        assert code in ALLOWED, (argv, code, text)
        assert "Traceback" not in text, (argv, text)
        if "--json" in argv:
            json.loads(out.getvalue())
        assert os.listdir(bugs) == [], argv
        assert set(os.listdir(root)) <= {"work", "cache", "bugs"}, argv
        made = set(os.listdir(work)) - before
        assert made <= set(argv), (argv, made)  # only files the user named (a report, a bundle, a PNG)


@SETTINGS
@given(_argv(["probe"], _flags("probe"), starts=([], PROBE_OK, PROBE_OK)))
def test_probe(fake, argv):
    _run(argv)


@SETTINGS
@given(_argv(["matrix"], _flags("matrix"), starts=([], ["--head-dims", "64,1024", "--seqlens", "64"])))
def test_matrix(fake, argv):
    _run(argv)


@SETTINGS
@given(_argv(["warm"], _flags("warm"), starts=([], ["w.toml"], ["w.json"])))
def test_warm(fake, argv):
    _run(argv)


@SETTINGS
@given(st.sampled_from(["ls", "show", "verify", "prune", "clear", "export", "import", "push", "pull"]).flatmap(
    lambda sub: _argv(["cache", sub], _flags("cache", sub))))
def test_cache(fake, argv):
    _run(argv)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(_argv([], ["info", "probe", "warm", "matrix", "cache", "--version", "--help", "-h"]))
def test_top_level(fake, argv):
    _run(argv)



@given(body=st.one_of(st.binary(max_size=200),
                      st.text(max_size=80).map(lambda t: f"__version__ = '{t}'\n".encode("utf-8", "surrogatepass"))))
@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_torch_version_file_of_any_bytes_gives_a_version_or_none(tmp_path, body):
    """`fastattn warm` reads torch/version.py to find a built op library without importing
    torch: whatever that file holds, the answer is a one-line version string or None."""
    from fastattn import _opslib

    (tmp_path / "version.py").write_bytes(body)
    found = _opslib.version_in(tmp_path)
    assert found is None or (isinstance(found, str) and found and "\n" not in found)
    assert _opslib.version_in(tmp_path / "missing") is None
