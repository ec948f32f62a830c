"""`fastattn cache clear | prune` and the commands that walk the directory, where the
directory does not do what is asked: a cache that is read-only or off by
configuration is refused, as import and pull refuse it (exit 2); entries that cannot be
removed (a read-only mount, an immutable folder) are counted with the reason (exit 4),
never reported as removed; an entry another process removed meanwhile is gone, not
damaged; a prune looks at each entry once, and writes only for what it removes. cuDNN
is tests/fake_core.py."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import threading

import pytest

import fastattn
from fastattn import cli, runtime, store
from fastattn.store import disk

from helpers.cli import BASE, fill, run
from helpers.paths import TESTS

def run_json(argv, capsys):
    code, out, err = run(argv + ["--json"], capsys)
    return code, json.loads(out)


def entry_files(cache) -> list[str]:
    return sorted(str(p) for p in cache.rglob("*.entry"))


def _new_process(monkeypatch, **variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    runtime.clear()


# -- 2. read-only means read-only ----------------------------------------------------------------

COMMANDS = [["cache", "clear"], ["cache", "prune", "--max-age", "0.001s"], ["cache", "prune", "--max-bytes", "1"]]


@pytest.mark.parametrize("mode", ["read-only", "off"])
@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[1:]))
def test_clear_and_prune_refuse_a_cache_that_is_not_writable(env, capsys, monkeypatch, mode, argv):
    fill()
    before = entry_files(env / "cache")
    _new_process(monkeypatch, FASTATTN_CACHE_MODE=mode)
    code, body = run_json(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT, body
    assert f"FASTATTN_CACHE_MODE={mode}" in body["message"], body
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT and f"FASTATTN_CACHE_MODE={mode}" in err and "removed" not in out
    assert entry_files(env / "cache") == before and len(before) == 4


def test_a_read_only_store_removes_nothing(tmp_path):
    s = store.DiskStore(str(tmp_path))
    s.put(store.Entry("ab" + "0" * 62, "unsupported", {"config": {}}, created=1.0))
    ro = store.DiskStore(str(tmp_path), writable=False)
    for pruned in (ro.clear(), ro.prune(max_bytes=0), ro.prune(max_age=0)):
        assert pruned.removed == 0 and pruned.not_removed == 1 and "read-only" in " ".join(pruned.failed)
    assert len(list(s.entries())) == 1


# -- 3. success that did nothing -----------------------------------------------------------------


def _cli_in_a_process(cache, argv, **variables):
    """`fastattn <argv> --json` in a new process, with tests/fake_site on its path."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))  # the fastattn under test
    environ = {**os.environ, "FASTATTN_CACHE_DIR": str(cache), **variables,
               "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS / "fake_site"), str(TESTS), here,
                                                         os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "fastattn", *argv, "--json"], env=environ, capture_output=True,
                          text=True, timeout=120)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[1:]))
def test_on_a_read_only_mount_nothing_removed_is_exit_4(env, argv):
    fill()
    cache = env / "cache"
    before = entry_files(cache)
    # What a read-only mount answers (tests/fake_site/sitecustomize.py): root ignores modes.
    code, body, err = _cli_in_a_process(cache, argv, FASTATTN_TEST_READONLY_FS=str(cache))
    assert code == cli.EXIT_FAILED, body
    assert body["removed"] == 0 and body["not_removed"] == 4, body
    assert [r["reason"] for r in body["not_removed_because"]] == ["Read-only file system"], body
    assert "could not remove 4 entries" in err and "Read-only file system" in err
    assert entry_files(cache) == before


def _refuse_unlink_in(monkeypatch, folder, error=errno.EPERM):
    """os.unlink (and os.remove) fail for what is in `folder`, as in a folder made
    immutable (chattr +i), which a test running as root cannot otherwise have."""
    real_unlink = os.unlink

    def unlink(path, *a, **k):
        if os.path.dirname(os.path.abspath(os.fsdecode(path))) == str(folder):
            raise OSError(error, os.strerror(error), path)
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "remove", unlink)


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[1:]))
def test_what_one_immutable_folder_keeps_is_counted_with_its_reason(env, capsys, monkeypatch, argv):
    fill()
    cache = env / "cache"
    before = entry_files(cache)
    stuck = os.path.dirname(before[0])
    kept = [p for p in before if os.path.dirname(p) == stuck]
    _new_process(monkeypatch)
    _refuse_unlink_in(monkeypatch, stuck)
    code, body = run_json(argv, capsys)
    assert code == cli.EXIT_FAILED, body
    assert body["removed"] == len(before) - len(kept) and body["not_removed"] == len(kept), body
    [why] = body["not_removed_because"]
    assert why["reason"] == "Operation not permitted" and why["count"] == len(kept) and why["example"] in kept
    assert entry_files(cache) == kept
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_FAILED
    assert f"could not remove {len(kept)} entr" in out + err and "Operation not permitted" in err


def test_a_clear_that_removes_everything_is_exit_0(env, capsys):
    fill()
    code, body = run_json(["cache", "clear"], capsys)
    assert code == cli.EXIT_OK and body["removed"] == 4 and body["not_removed"] == 0
    assert "error" not in body


# -- 4. races are not damage ---------------------------------------------------------------------


@pytest.fixture
def vanish(monkeypatch):
    """vanish(path, stage): the file at `path` is removed (as by another process's
    clear) just before fastattn's next lstat of it ("lstat"), or just before its
    `n`th open for reading ("open", "open2": the listing's header read, then a
    command's read of the whole entry)."""

    def arm(path: str, stage: str):
        if stage == "lstat":
            real = os.lstat

            def lstat(p, *a, **k):
                if os.fsdecode(p) == path:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                return real(p, *a, **k)

            monkeypatch.setattr(os, "lstat", lstat)
            return
        real_open, left = disk._open_regular, [2 if stage == "open2" else 1]

        def open_regular(p):
            if p == path:
                left[0] -= 1
                if left[0] == 0:
                    os.unlink(path)
            return real_open(p)

        monkeypatch.setattr(disk, "_open_regular", open_regular)

    return arm


@pytest.mark.parametrize("stage", ["lstat", "open"])
def test_ls_skips_an_entry_removed_while_listed(env, capsys, vanish, stage):
    fill()
    victim = entry_files(env / "cache")[1]
    vanish(victim, stage)
    code, body = run_json(["cache", "ls"], capsys)
    assert code == cli.EXIT_OK and body["damaged"] == 0 and body["not_ours"] == [], body
    assert len(body["entries"]) == 3 and victim not in {e["path"] for e in body["entries"]}


@pytest.mark.parametrize("stage", ["lstat", "open"])
def test_show_of_an_entry_removed_meanwhile_finds_none(env, capsys, vanish, stage):
    fill()
    victim = entry_files(env / "cache")[1]
    key = os.path.basename(victim)[: -len(".entry")]
    vanish(victim, stage)
    code, body = run_json(["cache", "show", key], capsys)
    assert code == cli.EXIT_BAD_INPUT and "no entry" in body["message"], body


@pytest.mark.parametrize("load", [False, True])
@pytest.mark.parametrize("stage", ["lstat", "open", "open2"])
def test_verify_does_not_call_an_entry_removed_meanwhile_damaged(env, capsys, vanish, stage, load):
    fill()
    victim = entry_files(env / "cache")[1]
    vanish(victim, stage)
    code, body = run_json(["cache", "verify"] + (["--load"] if load else []), capsys)
    assert code == cli.EXIT_OK and body["bad"] == 0, body
    assert not any(e["status"] == "damaged" for e in body["entries"])
    if stage == "open2":  # listed, then gone at its read: said so
        [gone] = [e for e in body["entries"] if e["path"] == victim]
        assert gone["status"] == "removed meanwhile" and body["removed_meanwhile"] == 1
    else:
        assert victim not in {e["path"] for e in body["entries"]} and body["removed_meanwhile"] == 0
    code, out, err = run(["cache", "verify"], capsys)
    assert code == cli.EXIT_OK and "damaged" not in out and "0 bad" in out


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[1:]))
def test_prune_of_an_entry_removed_meanwhile_is_no_failure(env, capsys, monkeypatch, argv):
    fill()
    victim = entry_files(env / "cache")[1]
    real_unlink = os.unlink

    def unlink(path, *a, **k):  # another process's clear gets there first
        if os.fsdecode(path) == victim and os.path.lexists(victim):
            real_unlink(victim)
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    code, body = run_json(argv, capsys)
    assert code == cli.EXIT_OK and body["removed"] == 3 and body["not_removed"] == 0, body
    assert entry_files(env / "cache") == []


_CLEARER = """
import os, sys, time
from fastattn.store import DiskStore, Entry, key_of
root, stop, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = DiskStore(root)
descriptions = [{"config": {"i": i}} for i in range(n)]
print("ready", flush=True)
while not os.path.exists(stop):
    for d in descriptions:
        s.put(Entry(key_of(d), "unsupported", d, created=1.0))
    s.clear()
"""


def test_verify_and_ls_beside_a_real_concurrent_clear(env, capsys, monkeypatch):
    """Another process fills and clears the directory in a loop; verify and ls run
    beside it and never see damage. (Before the fix, most runs saw some.)"""
    cache, stop = env / "cache", env / "stop"
    _new_process(monkeypatch)
    clearer = subprocess.Popen([sys.executable, "-c", _CLEARER, str(cache), str(stop), "300"],
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert clearer.stdout.readline().strip() == "ready"
        seen = 0
        for _ in range(15):
            code, body = run_json(["cache", "verify"], capsys)
            assert code == cli.EXIT_OK and body["bad"] == 0, [e for e in body["entries"] if e["status"] != "ok"]
            seen += len(body["entries"])
            code, body = run_json(["cache", "ls"], capsys)
            assert code == cli.EXIT_OK and body["damaged"] == 0 and body["not_ours"] == [], body
    finally:
        stop.touch()
        clearer.wait(timeout=60)
    assert seen > 0  # the race was run, not missed


def test_a_clear_beside_another_clear_is_no_failure(env, capsys, monkeypatch):
    """Two clears at once: what the other removed is neither removed here nor a failure."""
    _new_process(monkeypatch)
    main = runtime.plan_cache().store.main
    for i in range(400):
        main.put(store.Entry("%064x" % (i + 1), "unsupported", {"config": {"i": i}}, created=1.0))
    results = []
    threads = [threading.Thread(target=lambda: results.append(store.DiskStore(main.root).clear())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.removed for r in results) == 400 and all(r.not_removed == 0 for r in results)


# -- 9. a prune costs one look at each entry, and writes only for what it removes ------------------


def _counted(real, calls: list):
    def call(path, *a, **k):
        calls.append(os.fsdecode(path))
        return real(path, *a, **k)

    return call


@pytest.mark.parametrize("argv, looks, removed", [
    (["cache", "clear"], 1, 300), (["cache", "prune", "--max-age", "0.001s"], 1, 300),
    (["cache", "prune", "--max-age", "100d"], 1, 0), (["cache", "prune", "--max-bytes", "1"], 2, 300),
    (["cache", "prune", "--max-bytes", "100M"], 1, 0)], ids=lambda a: " ".join(a[1:]) if isinstance(a, list) else "")
def test_prune_looks_at_each_entry_once(env, capsys, monkeypatch, argv, looks, removed):
    """One lstat an entry (a second only for the entries the size limit removes, just
    before each goes): no second walk of the directory for the strays, no look again
    at an entry removed as it is listed. One unlink an entry removed and one for its
    lock file; none for an entry kept, nor for its lock file."""
    _new_process(monkeypatch)
    main = runtime.plan_cache().store.main
    n = 300
    for i in range(n):
        key = "%064x" % (i * 7919 + 1)
        with main.lock(key):  # as a build does: its lock file stays
            main.put(store.Entry(key, "unsupported", {"config": {"i": i}}, created=1.0))
    calls = {"lstat": [], "unlink": []}
    for name in calls:
        monkeypatch.setattr(os, name, _counted(getattr(os, name), calls[name]))
    code, body = run_json(argv, capsys)
    assert code == cli.EXIT_OK and body["removed"] == removed, body
    assert sum(1 for p in calls["lstat"] if p.endswith(".entry")) == looks * n
    assert sum(1 for p in calls["unlink"] if p.endswith(".entry")) == removed
    assert sum(1 for p in calls["unlink"] if p.endswith(".lock")) == removed
    locks = env / "cache" / "locks"
    assert (len(os.listdir(locks)) if locks.exists() else 0) == n - removed
