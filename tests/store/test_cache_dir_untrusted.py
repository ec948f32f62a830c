"""What lies in the cache directory is untrusted. A FIFO, a symlink, a
directory or a file named like an entry is not fastattn's: listed as such, never
opened in a way that blocks or follows a link, never deleted; fastattn cleans what it
made itself (its entries, lock files, temporary files, empty shard folders). A cache
path that is not a directory is an error naming it.

The regressions first, then generated directory contents (Hypothesis) through every
command that walks the directory. cuDNN is tests/fake_core.py (the `env` fixture).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import stat
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import cli, runtime, store
from fastattn.store import entry as entry_mod

BASE = dict(batch=1, heads_q=8, head_dim_qk=64, mask="causal")
SECRET = b"root:x:0:0:SECRET-NOT-FOR-THE-CACHE:/root:/bin/bash\n"


def key(i) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def entry_bytes(k: str) -> bytes:
    e = store.Entry(k, "plan", {"config": dict(BASE, seqlen_q=128)}, {"forward": b"x" * 10}, {}, 1.0)
    return entry_mod.encode(e)


def key_path(root, k: str) -> str:
    return os.path.join(str(root), k[:2], k + ".entry")


class Hung(BaseException):
    """Not an Exception (nor an OSError, as TimeoutError is): nothing in fastattn catches it."""


@contextlib.contextmanager
def deadline(seconds: int = 20):
    """Fails instead of hanging (a FIFO opened for reading blocks until a writer comes)."""
    def hung(*_):
        raise Hung(f"still running after {seconds} s: something blocked")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_json(argv, capsys):
    with deadline():
        code = cli.main(argv + ["--json"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "a bug in fastattn" not in out + err, (argv, out, err)
    return code, json.loads(out)


def mkdir(path):
    os.makedirs(path, exist_ok=True)
    return path


# -- the cases --------------------------------------------------------------------------


def test_a_fifo_named_like_an_entry_blocks_nothing(env, capsys):
    cache = env / "cache"
    fastattn.plan(dict(BASE, seqlen_q=128))
    fifo = key_path(cache, key("fifo"))
    mkdir(os.path.dirname(fifo))
    os.mkfifo(fifo)
    for argv in (["cache", "ls"], ["cache", "verify"], ["cache", "export", "--all", str(env / "b.tar.gz")],
                 ["cache", "prune", "--max-age", "1000d"]):
        code, body = run_json(argv, capsys)
        assert code == cli.EXIT_OK, (argv, body)
    code, body = run_json(["cache", "ls"], capsys)
    assert len(body["entries"]) == 1 and [s["path"] for s in body["not_ours"]] == [fifo]
    assert "not a regular file" in body["not_ours"][0]["why"]
    assert run_json(["cache", "export", "--all", str(env / "c.tar.gz")], capsys)[1]["exported"] == 1
    code, body = run_json(["cache", "clear"], capsys)
    assert body["removed"] == 1 and stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("what", ["fifo", "link to a file", "link to a folder", "shard folder link", "folder"])
def test_a_stray_at_a_plans_own_key_is_a_miss_and_stays(env, tmp_path_factory, what):
    outside = tmp_path_factory.mktemp("outside")
    cfg = fastattn.AttentionConfig(**BASE, seqlen_q=256)
    k = store.key_of(runtime.plan_cache().describe(cfg, 0))
    path = key_path(env / "cache", k)
    mkdir(os.path.dirname(os.path.dirname(path)))
    if what == "shard folder link":
        os.symlink(outside, os.path.dirname(path))
    else:
        mkdir(os.path.dirname(path))
    if what == "fifo":
        os.mkfifo(path)
    elif what == "link to a file":
        (outside / "file").write_bytes(SECRET)
        os.symlink(outside / "file", path)
    elif what == "link to a folder":
        os.symlink(outside, path)
    elif what == "folder":
        mkdir(path)
    before = sorted((str(p), p.read_bytes()) for p in outside.rglob("*") if p.is_file())
    with deadline():
        assert fastattn.plan(cfg) is not None  # built: what is there is not an entry
        runtime.clear()
        assert fastattn.plan(cfg) is not None  # and again in a new process: nothing was stored through it
    assert sorted((str(p), p.read_bytes()) for p in outside.rglob("*") if p.is_file()) == before
    st = os.lstat(os.path.dirname(path) if what == "shard folder link" else path)  # still there, as it was
    assert {"fifo": stat.S_ISFIFO, "folder": stat.S_ISDIR}.get(what, stat.S_ISLNK)(st.st_mode)


def test_a_symlinked_entry_is_never_followed(env, capsys, tmp_path_factory):
    cache, outside = env / "cache", tmp_path_factory.mktemp("outside")
    (outside / "passwd").write_bytes(SECRET)
    k_secret, k_valid = key("to-passwd"), key("to-a-valid-entry")
    (outside / "valid.entry").write_bytes(entry_bytes(k_valid))
    for k, target in ((k_secret, outside / "passwd"), (k_valid, outside / "valid.entry")):
        mkdir(os.path.dirname(key_path(cache, k)))
        os.symlink(target, key_path(cache, k))
    shard = outside / "shard"  # a whole shard folder that is a link: not descended into
    mkdir(shard)
    k_shard = "ee" + key("shard")[2:]
    (shard / (k_shard + ".entry")).write_bytes(entry_bytes(k_shard))
    os.symlink(shard, cache / "ee")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in outside.rglob("*") if p.is_file()}
    outputs = []
    for argv in (["cache", "ls"], ["cache", "verify"], ["cache", "export", "--all", str(env / "b.tar.gz")],
                 ["cache", "show", k_secret[:8]], ["cache", "prune", "--max-bytes", "1"], ["cache", "clear"]):
        code, body = run_json(argv, capsys)
        outputs.append(json.dumps(body))
        if argv[1] == "show":
            assert code == cli.EXIT_BAD_INPUT  # no entry has that key: the link is not one
        else:
            assert code == cli.EXIT_OK, (argv, body)
        if argv[1] == "ls":
            assert body["entries"] == []
            assert {s["path"] for s in body["not_ours"]} == {key_path(cache, k_secret), key_path(cache, k_valid),
                                                             str(cache / "ee")}
        if argv[1] == "export":
            assert body["exported"] == 0
    assert not any("SECRET" in o or "root:x" in o for o in outputs)
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in outside.rglob("*") if p.is_file()} == before
    assert all(os.path.islink(p) for p in (key_path(cache, k_secret), key_path(cache, k_valid), cache / "ee"))
    with pytest.raises(store.EntryError):  # and the runtime's read does not follow it either
        runtime.plan_cache().store.main.read(key_path(cache, k_valid))


def test_clear_and_prune_delete_only_fastattns_entries(env, capsys):
    cache = env / "cache"
    fastattn.plan(dict(BASE, seqlen_q=128))
    k = key("x")
    strays = [cache / k[:2] / "notakey.entry", cache / "zz" / "x.entry",
              cache / ("00" if k[:2] != "00" else "01") / (k + ".entry"),  # key-named, in another key's folder
              cache / k[:2] / (k.upper() + ".entry"), cache / k[:2] / (k + ".entry.entry"), cache / "notes.entry"]
    for p in strays:
        mkdir(p.parent)
        p.write_bytes(entry_bytes(k))
    folder = cache / key("dir")[:2] / (key("dir") + ".entry")  # a directory named like an entry
    mkdir(folder)
    (folder / "inside").write_bytes(b"mine")
    for argv in (["cache", "prune", "--max-bytes", "1"], ["cache", "clear"]):
        code, body = run_json(argv, capsys)
        assert code == cli.EXIT_OK, body
        assert all(p.exists() for p in strays) and (folder / "inside").read_bytes() == b"mine"
    body = run_json(["cache", "ls"], capsys)[1]
    assert body["entries"] == [] and len(body["not_ours"]) == len(strays) + 1


def test_clear_leaves_none_of_fastattns_own_debris(env, capsys):
    cache = env / "cache"
    for s in (1, 2, 3):
        fastattn.plan(dict(BASE, seqlen_q=128 * s))
    main = runtime.plan_cache().store.main
    stale = cache / key(1)[:2] / ".tmp-k1ll3d_w"  # as publish names them, holding the start of an entry
    mkdir(stale.parent)
    stale.write_bytes(entry_bytes(key(1))[:30])
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    held = key("held")
    with main.lock(held) as got:  # another builder at work: its lock file stays
        assert got
        code, body = run_json(["cache", "clear"], capsys)
        assert code == cli.EXIT_OK and body["removed"] == 3
        left = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
        assert left == ["CACHEDIR.TAG", "locks", f"locks/{held}.lock"], left
    code, body = run_json(["cache", "clear"], capsys)
    assert code == cli.EXIT_OK and sorted(cache.rglob("*")) == [cache / "CACHEDIR.TAG"]


@pytest.mark.parametrize("make", ["file", "fifo", "dangling link"])
@pytest.mark.parametrize("which", ["FASTATTN_CACHE_DIR", "FASTATTN_CACHE_EXTRA_DIRS"])
def test_a_cache_path_that_is_not_a_directory_is_named(env, capsys, monkeypatch, make, which):
    path = env / "not-a-dir"
    if make == "file":
        path.write_bytes(b"x")
    elif make == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(env / "nowhere", path)
    if which == "FASTATTN_CACHE_DIR":
        monkeypatch.setenv(which, str(path))
    else:
        monkeypatch.setenv(which, str(path))
    runtime.clear()
    for argv in (["cache", "ls"], ["cache", "verify"], ["cache", "prune", "--max-age", "1d"], ["cache", "clear"],
                 ["cache", "export", "--all", str(env / "b.tar.gz")]):
        if which == "FASTATTN_CACHE_EXTRA_DIRS" and argv[1] in ("prune", "clear"):
            continue  # they work on the main directory alone
        code, body = run_json(argv, capsys)
        assert code == cli.EXIT_BAD_INPUT, (argv, body)
        assert body["message"].startswith(f"cache directory {path}: ") and "not a directory" in body["message"]


def test_a_missing_cache_directory_is_an_empty_cache(env, capsys):
    code, body = run_json(["cache", "ls"], capsys)
    assert code == cli.EXIT_OK and body["entries"] == [] and body["not_ours"] == []


# -- generated directory contents ------------------------------------------------------------------

_KINDS = ("entry", "corrupt", "empty", "fifo", "link to file", "link to secret", "link to dir", "dangling link",
          "dir", "wrong shard", "odd name", "bytes name", "newline name", "shard link", "tmp", "old tmp", "lock",
          "fifo lock", "stray file", "stray dir")


def _populate(cache, outside, items) -> tuple[dict, set]:
    """Makes `items` (kind, seed) in `cache`; returns {path: kind} of what was made and
    the paths that are fastattn's own entries."""
    made, ours = {}, set()
    for kind, seed in items:
        k = key(f"{kind}-{seed}")
        p = key_path(cache, k)
        if kind == "wrong shard":
            p = os.path.join(str(cache), "ff" if k[:2] != "ff" else "fe", k + ".entry")
        elif kind == "odd name":
            p = os.path.join(str(cache), k[:2], ["x.entry", k[:63] + ".entry", k + ".ENTRY", k + "..entry",
                                                 k.upper() + ".entry"][seed % 5])
        elif kind == "bytes name":
            p = os.path.join(str(cache), k[:2], os.fsdecode(b"\xff\xfe" + k.encode()[:8] + b".entry"))
        elif kind == "newline name":
            p = os.path.join(str(cache), k[:2], k[:10] + "\nfake line.entry")
        elif kind == "shard link":
            p = os.path.join(str(cache), "%02x" % (200 + seed % 50))
        elif kind in ("tmp", "old tmp"):
            p = os.path.join(str(cache), k[:2], f".tmp-{seed:08d}")  # named as publish names them
        elif kind in ("lock", "fifo lock"):
            p = os.path.join(str(cache), "locks", k + ".lock")
        elif kind == "stray file":
            p = os.path.join(str(cache), ["README", "locks.txt", "ab.entry"][seed % 3])
        elif kind == "stray dir":
            p = os.path.join(str(cache), ["mine", "torch-ops", "a"][seed % 3])
        if os.path.lexists(p):
            continue
        os.makedirs(os.path.dirname(p), exist_ok=True)
        if kind == "entry":
            open(p, "wb").write(entry_bytes(k))
            ours.add(p)
        elif kind == "corrupt":
            open(p, "wb").write(entry_bytes(k)[: 20 + seed % 50] + b"\x00junk")
            ours.add(p)
        elif kind == "empty":
            open(p, "wb").close()
            ours.add(p)  # (in a directory that is fastattn's; elsewhere a stray: the test decides)
        elif kind in ("fifo", "fifo lock"):
            os.mkfifo(p)
        elif kind == "link to file":
            target = outside / f"valid-{seed}.entry"
            target.write_bytes(entry_bytes(k))
            os.symlink(target, p)
        elif kind == "link to secret":
            os.symlink(outside / "passwd", p)
        elif kind in ("link to dir", "shard link"):
            os.symlink(outside, p)
        elif kind == "dangling link":
            os.symlink(outside / "nowhere", p)
        elif kind in ("dir", "stray dir"):
            os.makedirs(p)
            open(os.path.join(p, "inside"), "wb").write(b"keep")
        elif kind in ("tmp", "old tmp", "lock"):
            open(p, "wb").write(b"" if kind == "lock" else entry_bytes(k)[: 2 + seed])  # as fastattn leaves them
            if kind == "old tmp":
                os.utime(p, (time.time() - 7200, time.time() - 7200))
        else:
            open(p, "wb").write(entry_bytes(k) if seed % 2 else SECRET)
        made[p] = kind
    return made, ours


def _outside_state(outside) -> dict:
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_atime_ns) for p in outside.rglob("*")
            if p.is_file() and not p.is_symlink()}


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_KINDS), st.integers(0, 9)), max_size=12),
       st.sampled_from(["clear", "prune", "none"]))
def test_generated_cache_contents_never_hang_follow_or_lose_what_is_not_ours(env, capsys, monkeypatch,
                                                                             tmp_path_factory, items, finish):
    base = tmp_path_factory.mktemp("gen")
    cache, outside = base / "cache", base / "outside"
    os.makedirs(cache)
    os.makedirs(outside)
    (outside / "passwd").write_bytes(SECRET)
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(cache))
    runtime.clear()
    made, ours = _populate(cache, outside, items)
    fastattns = store.DiskStore(str(cache), writable=False).is_fastattns()
    if not fastattns:  # a user's folder: a file named as an entry without the magic is not fastattn's
        ours = {p for p in ours if made[p] != "empty"}
    before = _outside_state(outside)
    texts = []
    for argv in (["cache", "ls"], ["cache", "verify"], ["cache", "export", "--all", str(base / "b.tar.gz")]):
        code, body = run_json(argv, capsys)
        assert code in (cli.EXIT_OK, cli.EXIT_FAILED), (argv, body)  # verify: 4 with damaged entries
        texts.append(json.dumps(body))
        if argv[1] == "ls":
            assert {e["path"] for e in body["entries"]} == ours
    # The text forms too: a name with a newline or undecodable bytes is shown escaped.
    with deadline():
        code = cli.main(["cache", "ls"])
    out, err = capsys.readouterr()
    texts.append(out + err)
    assert "\nfake line" not in out
    assert not any("SECRET" in t for t in texts)
    if finish != "none":
        argv = ["cache", "clear"] if finish == "clear" else ["cache", "prune", "--max-age", "0.001s"]
        code, body = run_json(argv, capsys)
        assert code == cli.EXIT_OK and body["removed"] == len(ours), body
        for p, kind in made.items():
            mine = p in ours or kind in ("old tmp", "lock")
            assert os.path.lexists(p) != mine, (p, kind)
        for folder in os.listdir(cache):  # no empty shard folder of fastattn's is left behind
            path = os.path.join(cache, folder)
            if fastattns and len(folder) == 2 and not os.path.islink(path) and os.path.isdir(path):
                assert os.listdir(path), path
    assert _outside_state(outside) == before
