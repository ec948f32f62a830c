"""What `cache clear` and `cache prune` may remove: only what fastattn wrote. A cache
directory fastattn makes carries a CACHEDIR.TAG naming fastattn; one made by an older
fastattn (entries, no tag) is recognised by its contents and tagged; a directory that is
neither keeps its other files and folders, whatever their names. Every file removed
besides entries (a killed writer's temporary file, an idle lock file, an emptied
folder) is counted and named. cuDNN is tests/fake_core.py (the `env` fixture)."""

from __future__ import annotations

import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import cli, runtime, store
from fastattn.store import entry as entry_mod

from helpers.cli import BASE, run

OLD = time.time() - 7200


def run_json(argv, capsys):
    code, out, err = run(argv + ["--json"], capsys)
    return code, json.loads(out)


def old(path):
    os.utime(path, (OLD, OLD))
    return path


def an_entry(k: str) -> bytes:
    return entry_mod.encode(store.Entry(k, "unsupported", {"config": {"i": 1}}, created=1.0))


def _new_process(monkeypatch, directory):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(directory))
    runtime.clear()


ARGV = [["cache", "clear"], ["cache", "prune", "--max-age", "0.001s"], ["cache", "prune", "--max-bytes", "1"]]


@pytest.mark.parametrize("argv", ARGV, ids=lambda a: " ".join(a[1:]))
def test_a_directory_fastattn_did_not_make_keeps_its_files_and_folders(env, capsys, monkeypatch, argv):
    mine = env / "mine"
    (mine / "cd").mkdir(parents=True)
    draft = mine / "cd" / ".tmp-draft.txt"
    draft.write_text("my draft")
    old(draft)
    (mine / "ab").mkdir()
    _new_process(monkeypatch, mine)
    code, body = run_json(argv, capsys)
    assert code == cli.EXIT_OK, body
    assert draft.read_text() == "my draft" and (mine / "ab").is_dir()
    assert body["removed"] == 0 and body["also_removed"] == []
    assert not (mine / "CACHEDIR.TAG").exists()  # not fastattn's directory: not tagged either


def test_a_user_file_shaped_like_fastattns_own_is_left_alone(env, capsys, monkeypatch):
    cache = env / "cache"
    fastattn.plan(dict(BASE, seqlen_q=128))
    k = next(runtime.plan_cache().store.main.entries()).key
    shard = cache / k[:2]
    tmp_like = shard / ".tmp-abcdefgh"  # named as a writer's temporary file, holding text
    tmp_like.write_text("notes")
    old(tmp_like)
    (cache / "locks").mkdir(exist_ok=True)
    lock_like = cache / "locks" / (k + ".lock")  # named as a lock file, not empty
    lock_like.write_text("keep")
    other = "ee" * 32
    for argv in ARGV:
        code, body = run_json(argv, capsys)
        assert code == cli.EXIT_OK, body
        assert tmp_like.read_text() == "notes" and lock_like.read_text() == "keep"
    # In a user's folder, a file named as an entry is fastattn's only with fastattn's magic.
    mine = env / "mine"
    (mine / "ee").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    entry_like = mine / "ee" / (other + ".entry")
    entry_like.write_bytes(b"not an entry at all")
    _new_process(monkeypatch, mine)
    for argv in ARGV:
        code, body = run_json(argv, capsys)
        assert code == cli.EXIT_OK and body["left_alone"] == 1, body
        assert entry_like.read_bytes() == b"not an entry at all"
    body = run_json(["cache", "ls"], capsys)[1]
    assert [s["path"] for s in body["not_ours"]] == [str(entry_like)] and body["entries"] == []


def test_what_clear_removes_besides_entries_is_counted_and_named(env, capsys):
    cache = env / "cache"
    fastattn.plan(dict(BASE, seqlen_q=128))
    k = next(runtime.plan_cache().store.main.entries()).key
    killed = cache / k[:2] / ".tmp-k1ll3d_x"  # what a writer killed mid-write leaves
    killed.write_bytes(an_entry(k)[:40])
    old(killed)
    code, body = run_json(["cache", "clear"], capsys)
    assert code == cli.EXIT_OK and body["removed"] == 1, body
    also = {item["path"]: item["what"] for item in body["also_removed"]}
    assert also[str(killed)].startswith("a temporary file") and not killed.exists()
    assert also[str(cache / k[:2])] == "an empty shard folder"
    runtime.clear()
    fastattn.plan(dict(BASE, seqlen_q=128))
    killed.parent.mkdir(exist_ok=True)
    killed.write_bytes(b"")
    old(killed)
    code, text, _ = run(["cache", "clear"], capsys)
    assert code == cli.EXIT_OK and "removed 1 entries" in text and str(killed) in text


def test_a_new_cache_directory_is_tagged(env, capsys):
    fastattn.plan(dict(BASE, seqlen_q=128))
    tag = (env / "cache" / "CACHEDIR.TAG").read_text()
    assert tag.startswith("Signature: 8a477f597d28d172789f06886806bc55") and "fastattn" in tag
    code, body = run_json(["cache", "clear"], capsys)
    assert code == cli.EXIT_OK and (env / "cache" / "CACHEDIR.TAG").exists()  # the directory stays fastattn's
    assert body["left_alone"] == 0


def test_an_older_fastattns_directory_keeps_working_and_is_tagged(env, capsys, monkeypatch):
    for s in (1, 2):
        fastattn.plan(dict(BASE, seqlen_q=128 * s))
    cache = env / "cache"
    os.unlink(cache / "CACHEDIR.TAG")  # as an older fastattn left it
    (cache / "0f").mkdir()  # an empty shard folder, as a killed prune can leave
    _new_process(monkeypatch, cache)
    code, body = run_json(["cache", "ls"], capsys)
    assert code == cli.EXIT_OK and len(body["entries"]) == 2 and body["not_ours"] == []
    fastattn.plan(dict(BASE, seqlen_q=128))
    assert fastattn.stats()["disk_hits"] == 1 and fastattn.stats()["builds"] == 0
    code, body = run_json(["cache", "prune", "--max-age", "1d"], capsys)
    assert code == cli.EXIT_OK and (cache / "CACHEDIR.TAG").exists()
    assert not (cache / "0f").exists() and body["also_removed"] == [{"path": str(cache / "0f"),
                                                                    "what": "an empty shard folder"}]


def test_a_directory_shared_with_other_files_is_never_tagged(env, capsys, monkeypatch):
    mine = env / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    _new_process(monkeypatch, mine)
    fastattn.plan(dict(BASE, seqlen_q=128))
    assert runtime.plan_cache().store.main.entries()  # it works as a cache
    assert not (mine / "CACHEDIR.TAG").exists()  # a tag would hide notes.txt from backups
    code, body = run_json(["cache", "clear"], capsys)
    assert code == cli.EXIT_OK and body["removed"] == 1 and (mine / "notes.txt").read_text() == "mine"
    for name in set(os.listdir(mine)) - {"notes.txt"}:  # an empty folder there may be the user's: it stays
        assert not os.listdir(mine / name)


def test_import_never_replaces_a_file_that_is_not_fastattns(env, capsys, monkeypatch):
    monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")
    mine = env / "mine"  # a user's folder that also holds a cache
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    _new_process(monkeypatch, mine)
    fastattn.plan(dict(BASE, seqlen_q=128))
    bundle = env / "b.tar.gz"
    assert run_json(["cache", "export", str(bundle)], capsys)[0] == cli.EXIT_OK
    info = next(runtime.plan_cache().store.main.entries())
    os.unlink(info.path)
    with open(info.path, "wb") as f:  # a user's file where the entry would go
        f.write(b"my own file")
    runtime.clear()
    code, body = run_json(["cache", "import", str(bundle)], capsys)
    assert code == cli.EXIT_FAILED and "not fastattn's" in body["message"], body
    assert open(info.path, "rb").read() == b"my own file"


# What fastattn wrote, in a directory it made: removed; anything else with the same names
# (other bytes, another kind of file): kept.
_ITEMS = st.lists(st.tuples(st.sampled_from(["entry", "damaged entry", "no magic", "tmp", "tmp text", "draft",
                                             "lock", "lock text", "empty shard", "user folder"]),
                            st.integers(0, 255)), max_size=10)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=_ITEMS, tagged=st.booleans())
def test_clear_removes_exactly_what_fastattn_wrote(env, capsys, monkeypatch, tmp_path_factory, items, tagged):
    cache = tmp_path_factory.mktemp("gen") / "cache"
    cache.mkdir()
    if tagged:
        store.DiskStore(str(cache))._tag()
    ours, theirs, made, unmarked = set(), set(), set(), set()
    for what, seed in items:
        k = "%02x" % seed + "%062x" % seed
        shard = cache / k[:2]
        shard.mkdir(exist_ok=True)
        if what in ("entry", "damaged entry", "no magic"):
            p = shard / (k + ".entry")
            data = {"entry": an_entry(k), "damaged entry": an_entry(k)[:30], "no magic": b"x" * 40}[what]
        elif what in ("tmp", "tmp text", "draft"):
            p = shard / {"tmp": ".tmp-%08x" % seed, "tmp text": ".tmp-t%07x" % seed, "draft": ".tmp-draft.txt"}[what]
            data = an_entry(k)[: seed % 50] if what == "tmp" else b"text"
        elif what in ("lock", "lock text"):
            (cache / "locks").mkdir(exist_ok=True)
            p = cache / "locks" / (k + ".lock")
            data = b"" if what == "lock" else b"text"
        else:
            p = shard / "inside" if what == "user folder" else None
            if p is not None:
                p.mkdir(exist_ok=True)
                theirs.add(str(p))
                made.add(what)
            continue
        if p.exists():
            continue
        made.add(what)
        p.write_bytes(data)
        old(p)
        if what == "no magic":
            unmarked.add(str(p))
        else:
            (ours if what in ("entry", "damaged entry", "tmp", "lock") else theirs).add(str(p))
    fastattns = tagged or (not made & {"draft", "user folder"} and bool(made & {"entry", "damaged entry"}))
    # A file named as an entry is fastattn's in its own directory, damaged or not.
    (ours if fastattns else theirs).update(unmarked)
    _new_process(monkeypatch, cache)
    code, body = run_json(["cache", "clear"], capsys)
    assert code == cli.EXIT_OK, body
    assert all(not os.path.lexists(p) for p in ours) and all(os.path.lexists(p) for p in theirs)
    named = {item["path"] for item in body["also_removed"]}
    assert {p for p in ours if not p.endswith(".entry")} <= named
    assert body["removed"] == sum(1 for p in ours if p.endswith(".entry"))
    # Folders: those holding what stays stay; an empty one goes when the directory is
    # fastattn's (tagged, or an older fastattn's: only its shapes, an entry among them).
    left = {os.path.join(r, n) for r, ds, fs in os.walk(cache) for n in ds + fs}
    holding = {os.path.dirname(p) for p in theirs}
    for p in left - theirs - holding - {str(cache / "CACHEDIR.TAG")}:
        assert os.path.isdir(p) and not os.listdir(p) and not fastattns, p
    assert os.path.exists(cache / "CACHEDIR.TAG") == fastattns
