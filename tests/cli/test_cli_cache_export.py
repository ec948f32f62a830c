"""`fastattn cache export` where the bundle cannot be written or could not be imported: a
write that fails once the work is under way (a full disk, `ulimit -f`) is exit 4 and
leaves nothing behind; a bundle that no fastattn would import (over import's limits) is
refused before anything is written (exit 2); the bundle is written as it is made, never
held whole in memory. cuDNN is tests/fake_core.py (the `env` fixture)."""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import tracemalloc

import pytest

from fastattn import cli, runtime, store
from fastattn.store import bundle
from fastattn.store.keys import key_of

from helpers.cli import fill, run
from helpers.paths import ROOT


def run_json(argv, capsys):
    code, out, err = run(argv + ["--json"], capsys)
    return code, json.loads(out)


def _limit_file_size(limit: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_export_under_a_file_size_limit_is_exit_4_and_leaves_nothing(env):
    fill()
    out = env / "out"
    out.mkdir()
    target = out / "b.tar.gz"
    proc = subprocess.run([sys.executable, "-m", "fastattn", "cache", "export", "--all", str(target)],
                          capture_output=True, text=True, preexec_fn=_limit_file_size(300),
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == cli.EXIT_FAILED, (proc.stdout, proc.stderr)
    assert "cannot write the bundle" in proc.stderr and "File too large" in proc.stderr
    assert "InvalidArgumentError" not in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(out) == []  # no bundle, no temporary file


@pytest.mark.parametrize("as_json", [False, True])
def test_export_onto_a_full_disk_is_exit_4(env, capsys, monkeypatch, as_json):
    fill()
    real = os.fsync

    def full(fd):
        real(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    target = env / "b.tar.gz"
    if as_json:
        code, body = run_json(["cache", "export", "--all", str(target)], capsys)
        assert code == cli.EXIT_FAILED and body["error"] == "CannotWrite" and "No space left" in body["message"]
    else:
        code, out, err = run(["cache", "export", "--all", str(target)], capsys)
        assert code == cli.EXIT_FAILED and "No space left on device" in err and "InvalidArgumentError" not in err
    assert os.listdir(env) == ["cache"]


def test_export_refuses_up_front_what_import_would_refuse(env, capsys, monkeypatch):
    fill()
    total = sum(i.size for _, i in runtime.plan_cache().store.entries())
    monkeypatch.setattr(bundle, "_MAX_TOTAL", total - 1)
    target = env / "b.tar.gz"
    code, body = run_json(["cache", "export", "--all", str(target)], capsys)
    assert code == cli.EXIT_BAD_INPUT and "cache import refuses" in body["message"], body
    assert not target.exists() and os.listdir(env) == ["cache"]
    monkeypatch.setattr(bundle, "_MAX_TOTAL", 4 << 30)
    monkeypatch.setattr(bundle, "_MAX_MANIFEST", 100)  # (as many entries as import takes)
    code, body = run_json(["cache", "export", "--all", str(target)], capsys)
    assert code == cli.EXIT_BAD_INPUT and "manifest" in body["message"] and not target.exists(), body


def test_an_exported_bundle_near_the_limits_imports(env, capsys, monkeypatch):
    # What export takes, import takes: the bundle file's bound (its gzip and tar
    # overhead) is decided by export as import decides it.
    fill()
    target = env / "b.tar.gz"
    assert run_json(["cache", "export", "--all", str(target)], capsys)[0] == cli.EXIT_OK
    size = os.path.getsize(target)
    monkeypatch.setattr(bundle, "_MAX_BUNDLE", size - 1)
    code, body = run_json(["cache", "export", "--all", "--force", str(target)], capsys)
    assert code == cli.EXIT_BAD_INPUT and "cache import refuses" in body["message"], body
    monkeypatch.setattr(bundle, "_MAX_BUNDLE", 4 << 30)
    monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")
    runtime.clear()
    assert run_json(["cache", "import", "--force", str(target)], capsys)[0] == cli.EXIT_OK


def test_export_holds_one_entry_at_a_time(tmp_path):
    s = store.DiskStore(str(tmp_path / "cache"))
    blob = 4 << 20
    for i in range(6):  # 24 MiB of entries that gzip cannot shrink, each under its own key
        described = {"config": {"i": i}}
        s.put(store.Entry(key_of(described), "plan", described, {"forward": os.urandom(blob)}, created=1.0))
    tracemalloc.start()
    try:
        count = bundle.export_bundle([s], str(tmp_path / "b.tar.gz"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 6
    assert peak < 4 * blob, f"{peak / 2**20:.1f} MiB held for 24 MiB of entries"


def test_an_entry_changed_while_exported_is_exit_4_and_no_bundle(env, capsys, monkeypatch):
    fill()
    real = store.DiskStore.read
    reads = []

    def changing(self, path):
        reads.append(path)
        data = real(self, path)
        return data if len(reads) <= 4 else data[:-1] + bytes([data[-1] ^ 1])  # the second pass sees another file

    monkeypatch.setattr(store.DiskStore, "read", changing)
    target = env / "b.tar.gz"
    code, body = run_json(["cache", "export", "--all", str(target)], capsys)
    assert code == cli.EXIT_FAILED and "changed or was removed" in body["message"], body
    assert os.listdir(env) == ["cache"]
