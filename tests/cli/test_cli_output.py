"""A failed write to stdout (a full disk, a closed pipe, a closed descriptor) is exit 4
and at most one line on stderr, for every command and every path through it (results,
usage errors, --help, bugs), with or without --json; never a traceback, never a bug
file (issue 26, section 2, item 3)."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastattn import cli, runtime

# One of each path through `main`: a result (info, cache ls), a usage error (probe
# --batch abc), an expected failure (probe without a GPU, show of no key), --help and
# --version (argparse prints them), with and without --json.
COMMANDS = [["info"], ["cache", "ls"], ["probe", "--batch", "abc"], ["probe", "--batch", "1", "--heads-q", "8",
            "--seqlen-q", "64", "--head-dim-qk", "64"], ["cache", "show", "ff"], ["--help"], ["probe", "--help"],
            ["--version"], ["cache", "verify"], ["nope"]]


class _FailingStdout(io.TextIOBase):
    """A stdout that takes `room` characters, then fails with `error` at write or at
    flush (where a buffered stream meets a full disk)."""

    def __init__(self, room: int, error: int, at: str):
        self.room, self.error, self.at, self.taken = room, error, at, 0

    def writable(self):
        return True

    def write(self, text):
        self.taken += len(text)
        if self.at == "write" and self.taken > self.room:
            raise OSError(self.error, os.strerror(self.error))
        return len(text)

    def flush(self):
        if self.taken > self.room:
            raise OSError(self.error, os.strerror(self.error))


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a bug's traceback file would go
    runtime.clear()
    yield tmp_path
    runtime.clear()


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=st.sampled_from(COMMANDS), as_json=st.booleans(), room=st.sampled_from([0, 1, 40, 500]),
       error=st.sampled_from([errno.ENOSPC, errno.EIO, errno.EPIPE]), at=st.sampled_from(["write", "flush"]))
def test_a_failed_write_to_stdout_is_exit_4_and_one_line(isolated, monkeypatch, argv, as_json, room, error, at):
    stdout, stderr = _FailingStdout(room, error, at), io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", stdout)
        m.setattr(sys, "stderr", stderr)
        code = cli.main(argv + (["--json"] if as_json else []))
    err = stderr.getvalue()
    assert "Traceback" not in err and not [p for p in os.listdir(isolated) if p.startswith("fastattn-bug")], err
    if stdout.taken <= room:  # everything fit: the command's own outcome
        assert code != cli.EXIT_BUG, err
        return
    assert code == cli.EXIT_FAILED, (argv, err)
    lines = [line for line in err.splitlines() if line.startswith("fastattn: cannot write")]
    if error == errno.EPIPE:  # the reader went away: nothing to tell it, nor anyone
        assert not lines
    else:
        assert len(lines) == 1 and os.strerror(error) in lines[0], err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("argv", [["info"], ["info", "--json"], ["probe", "--batch", "abc", "--json"], ["--help"],
                                  ["cache", "ls", "--json"]])
def test_dev_full_is_exit_4_and_one_line(argv, tmp_path):
    # fastattn as installed (or as PYTHONPATH says): from tmp_path, not the checkout,
    # whose fastattn/ may be unbuilt.
    env = dict(os.environ, FASTATTN_CACHE_DIR=str(tmp_path / "cache"), TMPDIR=str(tmp_path))
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "fastattn", *argv], stdout=full, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=str(tmp_path), timeout=120)
    assert r.returncode == cli.EXIT_FAILED, r.stderr
    assert r.stderr.strip().splitlines() == ["fastattn: cannot write the output to stdout: No space left on device"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("fastattn-bug")]


def test_a_closed_stdout_is_exit_4(tmp_path):
    env = dict(os.environ, FASTATTN_CACHE_DIR=str(tmp_path / "cache"), TMPDIR=str(tmp_path))
    r = subprocess.run(f"{sys.executable} -m fastattn cache ls >&-", shell=True, stderr=subprocess.PIPE, text=True,
                       env=env, cwd=str(tmp_path), timeout=120)
    assert r.returncode == cli.EXIT_FAILED and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == ["fastattn: cannot write the output to stdout: it is closed"]
