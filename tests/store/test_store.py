"""The persistent store with synthetic blobs: format, corruption, atomicity,
concurrency, read-only and full directories, pruning, tiers, key stability."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastattn import store
from fastattn.store import DiskStore, Entry, TieredCache, CacheSettings, entry as entry_mod

KEY = "ab" + "0" * 62


def make_entry(key=KEY, size=1000, seed=1, kind="plan"):
    blob = bytes((seed * 31 + i) % 251 for i in range(size))
    blobs = {"forward": blob, "backward": blob[::-1]} if kind == "plan" else {}
    return Entry(key, kind, {"config": {"batch": seed}}, blobs, {"forward_engine": "eng"}, created=123.5)


# -- keys ---------------------------------------------------------------------------------

GOLDEN_DESCRIPTION = store.describe(
    {"batch": 1, "heads_q": 32, "seqlen_q": 4096, "head_dim_qk": 128},
    fastattn_version="0.1.0",
    frontend_version="1.28.0",
    cudnn_version=91900,
    gpu_name="NVIDIA H200",
    compute_capability=(9, 0),
    sm_count=132,
    policy="heuristics=A,FALLBACK;build=HEURISTICS_CHOICE",
    env={"CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT": "0"},
)


def test_golden_key():
    # A change here changes every key: bump store.FORMAT_VERSION with it, deliberately.
    assert store.FORMAT_VERSION == 2
    assert store.key_of(GOLDEN_DESCRIPTION) == "9b3be5e0dc442d8fafc65f0fe6688cf061e65b5e35b084ce2ee967b376b3396d"


def test_key_covers_every_field():
    base = store.key_of(GOLDEN_DESCRIPTION)
    changes = [
        ("cudnn", 91901), ("cudnn_frontend", "1.29.0"), ("fastattn", "0.2.0"), ("policy", "other"),
        ("env", {}), ("config", {"batch": 2}),
        ("gpu", {**GOLDEN_DESCRIPTION["gpu"], "sm_count": 114}),
        ("gpu", {**GOLDEN_DESCRIPTION["gpu"], "name": "NVIDIA H100 80GB HBM3"}),
        ("gpu", {**GOLDEN_DESCRIPTION["gpu"], "compute_capability": [10, 0]}),
        ("format", 3),
    ]
    keys = {store.key_of({**GOLDEN_DESCRIPTION, field: value}) for field, value in changes}
    assert base not in keys and len(keys) == len(changes)


def test_key_ignores_dict_order():
    shuffled = dict(reversed(list(GOLDEN_DESCRIPTION.items())))
    assert store.key_of(shuffled) == store.key_of(GOLDEN_DESCRIPTION)


def test_env_vars_in_the_key():
    env = {"CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT": "0", "CUDNN_LOGLEVEL_DBG": "3", "PATH": "/bin",
           "CUDNN_FRONTEND_LOG_INFO": "1", "CUDNN_FRONTEND_CUDART_LIB_NAME": "/x/libcudart.so.13",
           "CUDNN_SOMETHING_NEW": "1"}
    assert store.build_env_vars(env) == {"CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT": "0", "CUDNN_SOMETHING_NEW": "1"}


@given(st.dictionaries(st.sampled_from(["CUDNN_A", "CUDNN_B", "CUDNN_LOGLEVEL_DBG", "PATH", "cudnn_x", "CUDNN_"])
                       | st.text(max_size=12), st.text(max_size=8), max_size=12))
def test_env_vars_are_the_cudnn_ones_in_name_order(env):
    got = store.build_env_vars(env)
    assert list(got) == sorted(got)
    ignored = store.keys._NOT_PLAN_CHANGING  # (logging and library locations only)
    assert "CUDNN_LOGLEVEL_DBG" in ignored
    assert got == {k: v for k, v in env.items() if k.startswith("CUDNN_") and k not in ignored}


# -- entry format -------------------------------------------------------------------------


def test_entry_round_trip():
    e = make_entry()
    back = entry_mod.decode(entry_mod.encode(e), expected_key=KEY)
    assert back == e
    neg = make_entry(kind="unsupported")
    neg.meta = {"reason": "forward: no"}
    assert entry_mod.decode(entry_mod.encode(neg)) == neg


def test_entry_header_is_readable():
    data = entry_mod.encode(make_entry())
    assert data.startswith(b"FASTATTN")
    assert b'"forward_engine":"eng"' in data[:400]
    assert entry_mod.read_header(data)["key"] == KEY


def _variants(data: bytes):
    yield "empty", b""
    yield "truncated fixed part", data[:10]
    for cut in (20, len(data) // 2, len(data) - 1):
        yield f"truncated at {cut}", data[:cut]
    yield "extra byte", data + b"\0"
    yield "wrong magic", b"NOTFASTA" + data[8:]
    yield "wrong version", data[:8] + (99).to_bytes(4, "little") + data[12:]
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    yield "flipped blob byte", bytes(flipped)
    flipped = bytearray(data)
    flipped[40] ^= 0x01
    yield "flipped header byte", bytes(flipped)
    yield "huge header length", data[:12] + (2**31).to_bytes(4, "little") + data[16:]
    yield "foreign file", b"\x7fELF" + os.urandom(200)
    yield "json garbage", data[:16] + b"{" * (len(data) - 16)


def test_every_kind_of_damage_is_detected():
    data = entry_mod.encode(make_entry())
    for name, bad in _variants(data):
        with pytest.raises(entry_mod.EntryError):
            entry_mod.decode(bad, expected_key=KEY)
            pytest.fail(name)


def test_header_is_read_without_the_blobs(tmp_path):
    import io

    data = entry_mod.encode(make_entry(size=100_000))
    f = io.BytesIO(data)
    assert entry_mod.read_header_from_file(f)["key"] == KEY
    assert f.tell() < 1000
    with pytest.raises(entry_mod.EntryError):
        entry_mod.read_header_from_file(io.BytesIO(data[:20]))


def test_entry_for_another_key_is_rejected():
    data = entry_mod.encode(make_entry())
    with pytest.raises(entry_mod.EntryError, match="not"):
        entry_mod.decode(data, expected_key="cd" + "1" * 62)


# -- the disk store -------------------------------------------------------------------------


def test_put_get_and_permissions(tmp_path):
    s = DiskStore(str(tmp_path / "c"))
    assert s.get(KEY) is None and s.counters["misses"] == 1
    assert s.put(make_entry())
    got = s.get(KEY)
    assert got == make_entry() and s.counters["hits"] == 1 and s.counters["writes"] == 1
    path = s.path_for(KEY)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert [i.key for i in s.entries()] == [KEY]
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".tmp")]


def test_shared_directory_permissions(tmp_path):
    old = os.umask(0o002)
    try:
        s = DiskStore(str(tmp_path / "c"), shared=True)
        s.put(make_entry())
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(s.path_for(KEY)).st_mode) == 0o664


def test_corrupt_files_are_counted_misses_and_replaced(tmp_path, caplog):
    s = DiskStore(str(tmp_path))
    data = entry_mod.encode(make_entry())
    path = s.path_for(KEY)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for i, (name, bad) in enumerate(_variants(data)):
        with open(path, "wb") as f:
            f.write(bad)
        assert s.get(KEY) is None, name
        assert s.counters["corrupt"] == i + 1
    assert len([r for r in caplog.records if "ignoring" in r.getMessage()]) == 1  # logged once
    assert s.put(make_entry()) and s.get(KEY) == make_entry()


def test_unreadable_file_is_a_miss(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    s = DiskStore(str(tmp_path))
    s.put(make_entry())
    os.chmod(s.path_for(KEY), 0)
    assert s.get(KEY) is None


def test_read_only_directory_warns_once_and_work_goes_on(tmp_path, caplog, monkeypatch):
    s = DiskStore(str(tmp_path))

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    assert not s.put(make_entry()) and not s.put(make_entry(seed=2))
    warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and "Read-only" in warnings[0].getMessage()
    assert s.counters["write_failures"] == 1 and not s.writable
    assert s.get(KEY) is None


def test_full_disk_is_a_skipped_write(tmp_path, monkeypatch, caplog):
    s = DiskStore(str(tmp_path))
    real_write = os.write

    def full(fd, data):
        if len(data) > 100:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    assert not s.put(make_entry())
    monkeypatch.setattr(os, "write", real_write)
    folder = os.path.dirname(s.path_for(KEY))
    assert os.listdir(folder) == []  # the partial temporary file was removed
    assert "No space left" in caplog.text and s.get(KEY) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_real_read_only_directory(tmp_path):
    os.chmod(tmp_path, 0o500)
    try:
        s = DiskStore(str(tmp_path / "c"))
        assert not s.put(make_entry())
    finally:
        os.chmod(tmp_path, 0o700)


def _slow_writer(root, ready_path):
    s = DiskStore(root)
    real_write = os.write

    def slow(fd, data):
        n = real_write(fd, data[:64])
        open(ready_path, "w").close()
        time.sleep(60)
        return n

    os.write = slow
    s.put(make_entry(size=100_000))


def test_writer_killed_mid_write_leaves_no_entry(tmp_path):
    root, ready = str(tmp_path / "c"), str(tmp_path / "ready")
    ctx = multiprocessing.get_context("spawn")  # fork is unsafe where threads run (CUDA, cuDNN on the GPU machine)
    p = ctx.Process(target=_slow_writer, args=(root, ready))
    p.start()
    deadline = time.time() + 30
    while not os.path.exists(ready) and time.time() < deadline:
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    s = DiskStore(root)
    assert s.get(KEY) is None and list(s.entries()) == []
    folder = os.path.dirname(s.path_for(KEY))
    temps = os.listdir(folder)
    assert temps and all(n.startswith(".tmp-") for n in temps)  # the leftover is not an entry
    old = time.time() - 7200
    for n in temps:
        os.utime(os.path.join(folder, n), (old, old))
    s.prune()
    assert not os.path.exists(folder)  # and pruning sweeps it, and the shard folder it left empty


_HAMMER = textwrap.dedent("""
    import sys, random
    from fastattn.store import DiskStore
    from test_store import make_entry
    root, wid = sys.argv[1], int(sys.argv[2])
    s = DiskStore(root)
    keys = ["%02x" % k + "0" * 62 for k in range(4)]
    for i in range(150):
        key = random.choice(keys)
        if random.random() < 0.5:
            s.put(make_entry(key=key, size=random.randint(1, 50_000), seed=wid * 1000 + i))
        else:
            s.get(key)
    print(s.counters["corrupt"])
""")


def test_concurrent_writers_and_readers_never_see_a_torn_entry(tmp_path):
    root = str(tmp_path / "c")
    here = os.path.dirname(os.path.abspath(__file__))
    # Keep the caller's PYTHONPATH: where fastattn is not installed (the GPU machine
    # runs the suite from the source tree), it is how the children find it.
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    procs = [subprocess.Popen([sys.executable, "-c", _HAMMER, root, str(w)], stdout=subprocess.PIPE, text=True,
                              cwd=here, env={**os.environ, "PYTHONPATH": path}) for w in range(6)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all(o == "0" for o in outs), outs  # no reader ever saw a corrupt entry
    s = DiskStore(root)
    assert all(s.get(i.key) is not None for i in s.entries())


def test_lock_is_exclusive_and_released_when_the_holder_dies(tmp_path):
    root = str(tmp_path / "c")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from fastattn.store import DiskStore
        with DiskStore({root!r}).lock({KEY!r}) as got:
            print(got, flush=True)
            time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert holder.stdout.readline().strip() == "True"
    s = DiskStore(root)
    t0 = time.monotonic()
    with s.lock(KEY, timeout=0.3) as got:
        assert not got and time.monotonic() - t0 >= 0.3
    holder.kill()
    holder.wait()
    t0 = time.monotonic()
    with s.lock(KEY, timeout=10) as got:
        assert got and time.monotonic() - t0 < 2


def test_prune_removes_least_recently_used_first(tmp_path):
    s = DiskStore(str(tmp_path))
    keys = [f"{k:02x}" + "0" * 62 for k in range(5)]
    now = time.time()
    for i, key in enumerate(keys):
        s.put(make_entry(key=key, size=10_000, seed=i))
        os.utime(s.path_for(key), (now - 1000 + i * 100, now))  # atime: keys[0] least recent
    s.get(keys[0])  # a hit makes it the most recent
    size = os.path.getsize(s.path_for(keys[0]))
    pruned = s.prune(max_bytes=3 * size)
    assert pruned.removed == 2 and pruned.not_removed == 0
    assert sorted(i.key for i in s.entries()) == sorted([keys[0], keys[3], keys[4]])
    assert s.counters["pruned"] == 2


def _reads_set_atime(folder) -> bool:
    """Whether a plain read sets the access time of a file unused for three days on this
    file system (relatime does; noatime does not, and then nothing can be seen)."""
    probe = os.path.join(folder, "atime-probe")
    with open(probe, "wb") as f:
        f.write(b"x")
    os.utime(probe, (time.time() - 3 * 86400, time.time() - 4 * 86400))
    with open(probe, "rb") as f:
        f.read()
    bumped = time.time() - os.stat(probe).st_atime < 3600
    os.unlink(probe)
    return bumped


def test_listing_and_pruning_leave_each_entry_its_last_use(tmp_path):
    # An entry's access time is its last use (set on a hit): reading its header for a
    # listing, `cache ls`, a prune's scan or preload must not make an entry unused for
    # days look just used, or LRU pruning keeps the stale ones (seen: relatime set it).
    if not _reads_set_atime(str(tmp_path)):
        pytest.skip("this file system does not set access times on reads (noatime): nothing to see")
    s = DiskStore(str(tmp_path))
    old, new = "aa" + "0" * 62, "bb" + "0" * 62
    s.put(make_entry(key=old))
    s.put(make_entry(key=new))
    days_ago = time.time() - 3 * 86400
    os.utime(s.path_for(old), (days_ago, days_ago - 86400))
    for _ in range(2):
        assert {i.key: round(i.last_used) for i in s.entries()}[old] == round(days_ago)
    assert s.prune(max_age=86400).removed == 1 and [i.key for i in s.entries()] == [new]


def test_an_entry_of_another_owner_is_read_without_o_noatime(tmp_path, monkeypatch):
    # O_NOATIME is refused (EPERM) on a file the process does not own, as in a shared
    # read-only directory: the read goes on without it.
    from fastattn.store import disk

    s = DiskStore(str(tmp_path))
    s.put(make_entry())
    real_open, refused = os.open, []

    def not_the_owner(path, flags, *args, **kwargs):
        if disk._NOATIME and flags & disk._NOATIME:
            refused.append(path)
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(disk.os, "open", not_the_owner)
    assert s.get(KEY) == make_entry() and [i.key for i in s.entries()] == [KEY]
    assert refused or not disk._NOATIME


def test_prune_by_age_and_clear(tmp_path):
    s = DiskStore(str(tmp_path))
    a, b = "aa" + "0" * 62, "bb" + "0" * 62
    s.put(make_entry(key=a))
    s.put(make_entry(key=b))
    old = time.time() - 10 * 86400
    os.utime(s.path_for(a), (old, old))
    assert s.prune(max_age=86400).removed == 1 and [i.key for i in s.entries()] == [b]
    assert s.clear().removed == 1 and list(s.entries()) == []


def test_size_limit_prunes_on_write(tmp_path):
    one = len(entry_mod.encode(make_entry(size=10_000)))
    s = DiskStore(str(tmp_path), max_bytes=3 * one)
    for i in range(6):
        s.put(make_entry(key=f"{i:02x}" + "0" * 62, size=10_000, seed=i))
        time.sleep(0.01)
    assert sum(i.size for i in s.entries()) <= 3 * one
    assert s.counters["pruned"] >= 3


# -- tiers and settings ---------------------------------------------------------------------


def test_extra_read_only_directories_are_consulted_after_the_main_one(tmp_path):
    baked = DiskStore(str(tmp_path / "baked"))
    baked.put(make_entry(seed=7))
    cache = TieredCache(CacheSettings(str(tmp_path / "main"), extra_dirs=(str(tmp_path / "baked"),)))
    entry, tier = cache.get(KEY)
    assert entry.description == {"config": {"batch": 7}} and tier.root == baked.root
    cache.put(make_entry(seed=8))  # writes go to the main directory, which now wins
    entry, tier = cache.get(KEY)
    assert entry.description == {"config": {"batch": 8}} and tier is cache.main
    assert DiskStore(str(tmp_path / "baked")).get(KEY).description == {"config": {"batch": 7}}
    assert not cache.extras[0].writable


def test_modes(tmp_path):
    off = TieredCache(CacheSettings(str(tmp_path), mode="off"))
    assert off.tiers == [] and off.get(KEY) is None and not off.put(make_entry())
    ro = TieredCache(CacheSettings(str(tmp_path), mode="read-only"))
    assert not ro.put(make_entry()) and not os.path.exists(ro.main.path_for(KEY))


def test_settings_from_env(tmp_path):
    s = store.settings_from_env({"FASTATTN_CACHE_DIR": str(tmp_path), "FASTATTN_CACHE_MODE": "Read-Only",
                                 "FASTATTN_CACHE_EXTRA_DIRS": f"/a{os.pathsep}/b", "FASTATTN_CACHE_SHARED": "1",
                                 "FASTATTN_CACHE_MAX_BYTES": "none"})
    assert s == CacheSettings(str(tmp_path), "read-only", ("/a", "/b"), True, None)
    d = store.settings_from_env({})
    assert d.mode == "read-write" and d.max_bytes == store.DEFAULT_MAX_BYTES and "fastattn" in d.directory
    from fastattn import InvalidArgumentError

    for var, bad in (("FASTATTN_CACHE_MODE", "sometimes"), ("FASTATTN_CACHE_MAX_BYTES", "lots"),
                     ("FASTATTN_CACHE_MAX_BYTES", "-1"), ("FASTATTN_CACHE_SHARED", "maybe")):
        with pytest.raises(InvalidArgumentError, match=rf"^{var}="):
            store.settings_from_env({var: bad})
