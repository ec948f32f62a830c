"""An interrupted `fastattn warm` (SIGINT, SIGTERM to its parent alone, as a supervisor
sends them) stops its workers and its compilers at once and leaves no temporary file or
folder behind; what a killed one (SIGKILL) leaves is recognised as stale and removed by
the next run. The command runs in a child, its workers on tests/fake_core.py."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fastattn
from fastattn import cli

ENTRY = {"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64}


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody has reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds} s for {what}")
        time.sleep(0.05)


def _warm(tmp: Path, argv: list[str], **env) -> subprocess.Popen:
    """`fastattn warm ARGV` in a child whose temporary directory is tmp/tmp."""
    (tmp / "tmp").mkdir(exist_ok=True)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = {**os.environ, "TMPDIR": str(tmp / "tmp"), "FASTATTN_CACHE_DIR": str(tmp / "cache"),
            "FASTATTN_TEST_FAKE_CORE": "1", **env,
            "PYTHONPATH": os.pathsep.join([os.path.join(here, "fake_site"), here,
                                           os.path.dirname(os.path.dirname(fastattn.__file__)),
                                           os.environ.get("PYTHONPATH", "")])}
    full.pop("FASTATTN_REMOTE_CACHE", None)
    return subprocess.Popen([sys.executable, "-m", "fastattn", "warm", *argv], cwd=tmp, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)


def _entries(tmp: Path) -> list[str]:
    return [p.name for p in (tmp / "cache").rglob("*.entry")]


def _leftovers(tmp: Path) -> list[str]:
    return sorted(os.listdir(tmp / "tmp"))


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, cli.EXIT_INTERRUPTED), (signal.SIGTERM, cli.EXIT_TERMINATED)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_warms_parent_stops_its_workers_at_once_and_leaves_nothing(tmp_path, sig, code):
    # SIGINT left the workers building for ~2.5 s and writing entries; SIGTERM also left
    # the fastattn-warm-* folder of their logs.
    f = tmp_path / "w.json"
    # Four kernel families (head dims): two workers start, one family each.
    f.write_text(json.dumps({"configs": [{**ENTRY, "head_dim_qk": d} for d in (32, 64, 128, 256)]}))
    builds = tmp_path / "builds.log"
    proc = _warm(tmp_path, [str(f), "--workers", "2", "--no-torch-ops"], FAKE_BUILD_SECONDS="4",
                 FAKE_BUILD_LOG=str(builds))
    try:
        _wait_for(lambda: builds.exists() and len(builds.read_text().splitlines()) >= 2, 60, "two workers building")
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == code, (out, err)
    assert b"Traceback" not in out + err, err
    _wait_for(lambda: not any(_alive(w) for w in workers), 1.5, "the workers to stop")
    time.sleep(4.5)  # past the builds' end: a worker left running would have stored its entry by now
    assert _entries(tmp_path) == [] and _leftovers(tmp_path) == [], (_entries(tmp_path), _leftovers(tmp_path))


def test_a_warm_folder_left_by_a_killed_warm_is_removed_by_the_next_and_a_live_ones_is_not(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead, live = tmp / "fastattn-warm-dead1234", tmp / "fastattn-warm-live1234"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "worker-0.log").write_text("...")
        (folder / "owner.lock").write_text("")
    users = tmp / "fastattn-warm-notes.txt"  # not a folder: not one of fastattn's
    users.write_text("a user's file")
    with open(live / "owner.lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # its warm is running
        f = tmp_path / "w.json"
        f.write_text(json.dumps({"configs": [ENTRY]}))
        proc = _warm(tmp_path, [str(f), "--workers", "1", "--no-torch-ops"])
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == cli.EXIT_OK, (out, err)
        assert not dead.exists() and live.exists() and users.exists(), _leftovers(tmp_path)


_FAKE_CXX = """#!/bin/sh
[ "$1" = --version ] && {{ echo "a compiler that takes a minute"; exit 0; }}
echo $$ >> "{pids}"
exec sleep 60
"""


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, cli.EXIT_INTERRUPTED), (signal.SIGTERM, cli.EXIT_TERMINATED)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_warm_stops_the_op_librarys_compilers_and_removes_their_folder(tmp_path, sig, code):
    # SIGTERM left the op library's half-built object folder behind, never cleaned, and
    # its compilers running.
    pytest.importorskip("torch", reason="PyTorch is an optional extra")
    pids = tmp_path / "compilers.pids"
    cxx = tmp_path / "slow-c++"
    cxx.write_text(_FAKE_CXX.format(pids=pids))
    cxx.chmod(0o755)
    ops = tmp_path / "ops"
    f = tmp_path / "w.json"
    f.write_text(json.dumps({"configs": []}))
    proc = _warm(tmp_path, [str(f), "--torch-ops"], CXX=str(cxx), FASTATTN_TORCH_OPS_DIR=str(ops))
    try:
        _wait_for(lambda: pids.exists() and len(pids.read_text().split()) >= 1, 120, "a compiler to start")
        time.sleep(0.3)  # (the other unit's, where there are two cores)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == code, (out, err)
    compilers = [int(p) for p in pids.read_text().split()]
    _wait_for(lambda: not any(_alive(p) for p in compilers), 1.5, "the compilers to stop")
    left = sorted(p.name for p in ops.rglob("*") if p.name.startswith("objects.") or p.name.endswith(".so.tmp"))
    assert left == [] and _leftovers(tmp_path) == [], (left, _leftovers(tmp_path), err)


def test_the_object_folders_a_killed_build_left_are_removed_by_the_next_build(tmp_path, monkeypatch):
    pytest.importorskip("torch", reason="PyTorch is an optional extra")
    from fastattn.torch import _native

    monkeypatch.setenv("FASTATTN_TORCH_OPS_DIR", str(tmp_path / "ops"))
    folder = _native.library_path().parent
    (folder / "objects.x1y2z3" / "sub").mkdir(parents=True)
    (folder / "objects.x1y2z3" / "unit0.o").write_bytes(b"half")
    (folder / "tmpab12cd.so.tmp").write_bytes(b"half")
    (folder / "notes.txt").write_text("not the build's")
    monkeypatch.setenv("CXX", "false")  # a build that fails at once: the sweep comes first
    with pytest.raises(RuntimeError, match="compiling"):
        _native.build()
    assert sorted(os.listdir(folder)) == ["build.lock", "generated", "notes.txt"], os.listdir(folder)
