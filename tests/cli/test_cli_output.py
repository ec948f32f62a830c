"""A failed write to stdout (a full disk, a closed descriptor) is exit 4 and at most one
line on stderr, for every command and every path through it (results, usage errors,
--help, bugs), with or without --json; never a traceback, never a bug file. A reader
that goes away (`| head -1`, `| true`) is no failure: the exit code is the command's
own outcome, whether the reader took all, part or none of the output."""

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
    lines = [line for line in err.splitlines() if line.startswith("fastattn: cannot write")]
    if stdout.taken <= room or error == errno.EPIPE:  # everything fit, or the reader left: the own outcome
        assert code == _own_outcome(argv, as_json, monkeypatch) and not lines, (argv, code, err)
        return
    assert code == cli.EXIT_FAILED, (argv, err)
    assert len(lines) == 1 and os.strerror(error) in lines[0], err


def _own_outcome(argv, as_json, monkeypatch) -> int:
    """The exit code of the command with a stdout that takes everything."""
    with monkeypatch.context() as m:
        m.setattr(sys, "stdout", io.StringIO())
        m.setattr(sys, "stderr", io.StringIO())
        return cli.main(argv + (["--json"] if as_json else []))


def _fastattn(argv, tmp_path, **kwargs):
    env = dict(os.environ, FASTATTN_CACHE_DIR=str(tmp_path / "cache"), TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "fastattn", *argv], env=env, cwd=str(tmp_path), timeout=120,
                          **kwargs)


@pytest.mark.parametrize("argv", [["cache", "ls"], ["cache", "ls", "--json"], ["info"], ["--help"],
                                  ["probe", "--batch", "abc", "--json"], ["cache", "show", "ff", "--json"]])
def test_a_reader_that_went_away_leaves_the_outcomes_exit_code(argv, tmp_path):
    # `| true`: the pipe's reading end is closed before the command writes. The outcome
    # is the one the same command has with a reader that takes everything (`| head -1`
    # with output that fits the pipe: the write succeeds, then the reader leaves).
    whole = _fastattn(argv, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    read, write = os.pipe()
    os.close(read)
    try:
        gone = _fastattn(argv, tmp_path, stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert whole.stdout and "Traceback" not in whole.stderr + gone.stderr
    assert gone.returncode == whole.returncode, (argv, whole.returncode, gone.returncode, gone.stderr)
    assert "cannot write" not in gone.stderr, gone.stderr
    shell = subprocess.run(f"{sys.executable} -m fastattn {' '.join(argv)} | head -c 1 >/dev/null; "
                           f"echo ${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash", capture_output=True,
                           text=True, env=dict(os.environ, FASTATTN_CACHE_DIR=str(tmp_path / "cache")),
                           cwd=str(tmp_path), timeout=120)  # (not the checkout: its source tree would shadow fastattn)
    assert shell.stdout.strip() == str(whole.returncode), shell


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
