"""The exit code is the outcome, whatever stderr is: closed (`2>&-`: sys.stderr is
None), a full disk (ENOSPC on every write), a pipe nobody reads. A line fastattn could
not write to stderr is lost, never an exception out of `main` (which exited 1 instead
of 2, 3, 4 or 5), and never a failed flush at the interpreter's exit (which exits 120).

Child processes for closed and full stderr (a full one is a copy of /dev/full's node
in tmp_path, where this process may mknod); in this process, a stderr whose every
write raises OSError(ENOSPC) for each path that writes there.
"""

from __future__ import annotations

import errno
import io
import json
import os
import stat
import subprocess
import sys

import pytest

import fastattn
import fastattn.warm
from fastattn import cli, runtime
from fastattn.errors import LibraryError
from fastattn.warm import WarmItem, WarmReport

PROBE = ["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "128", "--head-dim-qk", "64"]

# `fastattn <argv>` in a child, with what `case` names made to happen (no GPU, a bug, a
# warm whose workers warn and draw progress), on any machine.
_CHILD = """
import sys
import fastattn.warm
from fastattn import cli, runtime
from fastattn.errors import LibraryError

case = sys.argv[1]
if case == "no-gpu":
    def probe(*a, **k):
        raise LibraryError("fastattn cannot use the GPU: (a test's stand-in)")
    runtime.probe = probe
elif case == "bug":
    def probe(*a, **k):
        raise RuntimeError("a test's stand-in for a bug")
    runtime.probe = probe
elif case == "warm":
    from test_cli_stderr import _fake_warm  # (this file's: its folder is on the child's path)
    fastattn.warm.warm = _fake_warm
sys.exit(cli.main(sys.argv[2:]))
"""

CASES = [
    ("usage error", "none", ["probe", "--batch", "0"], cli.EXIT_BAD_INPUT),
    ("usage error, JSON", "none", ["probe", "--batch", "0", "--json"], cli.EXIT_BAD_INPUT),
    ("bad input", "none", ["cache", "prune"], cli.EXIT_BAD_INPUT),
    ("no GPU", "no-gpu", PROBE, cli.EXIT_NO_GPU),
    ("a bug", "bug", PROBE, cli.EXIT_BUG),
    ("warm's warnings", "warm", ["warm", "--no-torch-ops"], cli.EXIT_OK),
]


def _child(tmp_path, case, argv, **popen):
    env = {**os.environ, "FASTATTN_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(fastattn.__file__)),
                                          os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    env.pop("FASTATTN_REMOTE_CACHE", None)
    return subprocess.run([sys.executable, "-c", _CHILD, case, *argv], cwd=tmp_path, env=env, timeout=120,
                          stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, **popen)


@pytest.mark.parametrize("what,case,argv,code", CASES, ids=[c[0] for c in CASES])
def test_the_exit_code_with_stderr_closed(tmp_path, what, case, argv, code):
    r = _child(tmp_path, case, argv, preexec_fn=lambda: os.close(2))
    assert r.returncode == code, r.stdout
    if case != "warm" and "--json" not in argv:  # what stderr was to say is lost, not said on stdout
        assert r.stdout == b""


@pytest.fixture
def full(tmp_path):
    """A file on a full disk, as far as its writer can tell: a copy of /dev/full's node."""
    path = tmp_path / "full"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except OSError as e:
        pytest.skip(f"cannot mknod here ({e})")
    return path


@pytest.mark.parametrize("what,case,argv,code", CASES, ids=[c[0] for c in CASES])
def test_the_exit_code_with_stderr_on_a_full_disk(tmp_path, full, what, case, argv, code):
    with open(full, "w") as err:
        r = _child(tmp_path, case, argv, stderr=err)
    assert r.returncode == code, r.stdout


class _FullStderr(io.TextIOBase):
    """sys.stderr on a full disk; `tty`: as a terminal (warm draws its bar there)."""

    def __init__(self, tty=False):
        self.tty, self.tried = tty, 0

    def write(self, text):
        self.tried += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    def isatty(self):
        return self.tty


def _no_gpu(*a, **k):
    raise LibraryError("fastattn cannot use the GPU: (a test's stand-in)")


def _boom(*a, **k):
    raise RuntimeError("a test's stand-in for a bug")


def _interrupt(*a, **k):
    raise KeyboardInterrupt


def _fake_warm(configs, progress=None, **k):
    items = [WarmItem(c, status="built") for c in configs]
    for i, item in enumerate(items):
        if progress is not None:
            progress(i + 1, len(items), item)
    return WarmReport(items, 0.0, 1, {"built": len(items), "loaded": 0, "unsupported": 0, "failed": 0}, 1,
                      warnings=["a worker's warning"])


IN_PROCESS = [
    ("usage error", None, ["probe", "--batch", "0"], cli.EXIT_BAD_INPUT),
    ("bad input", None, ["cache", "prune"], cli.EXIT_BAD_INPUT),
    ("no GPU", ("probe", _no_gpu), PROBE, cli.EXIT_NO_GPU),
    ("a bug", ("probe", _boom), PROBE, cli.EXIT_BUG),
    ("interrupted", ("probe", _interrupt), PROBE, cli.EXIT_INTERRUPTED),
    ("warm's bar and warnings", ("warm", _fake_warm), ["warm", "--no-torch-ops"], cli.EXIT_OK),
]


@pytest.mark.parametrize("tty", [False, True])
@pytest.mark.parametrize("what,patch,argv,code", IN_PROCESS, ids=[c[0] for c in IN_PROCESS])
def test_the_exit_code_when_every_stderr_write_fails(tmp_path, monkeypatch, capsys, what, patch, argv, code, tty):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # a bug's traceback file
    runtime.clear()
    if patch is not None:
        name, fn = patch
        monkeypatch.setattr(fastattn.warm if name == "warm" else runtime, name, fn)
    full = _FullStderr(tty)
    monkeypatch.setattr(sys, "stderr", full)
    assert cli.main(argv) == code
    assert full.tried  # it did try to say something
    monkeypatch.setattr(sys, "stderr", None)  # closed: nothing to try
    assert cli.main(argv) == code


def test_a_cache_that_cannot_be_written_is_still_exit_4(env, capsys, monkeypatch):
    fastattn.plan({"batch": 1, "heads_q": 8, "head_dim_qk": 64, "seqlen_q": 128})
    bundle = str(env / "b.tgz")
    assert cli.main(["cache", "export", bundle]) == cli.EXIT_OK
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(env / "target"))
    monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")  # (the bundle is unsigned)
    runtime.clear()

    def refuse(*a, **k):  # root writes anywhere: a failed write made by hand
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    monkeypatch.setattr(sys, "stderr", _FullStderr())
    assert cli.main(["cache", "import", bundle]) == cli.EXIT_FAILED
    monkeypatch.setattr(sys, "stderr", None)
    capsys.readouterr()
    assert cli.main(["cache", "import", bundle, "--json"]) == cli.EXIT_FAILED
    assert json.loads(capsys.readouterr().out)["error"] == "CannotWrite"
