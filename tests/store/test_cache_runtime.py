"""The runtime with the persistent cache, on the CPU: cuDNN replaced by tests/fake_core.py,
everything else real (keys, entries, files, locks, counters, processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

import fastattn
from fastattn import runtime, store

import fake_core
from helpers.paths import TESTS
CFG = dict(batch=1, heads_q=32, seqlen_q=512, head_dim_qk=128, mask="causal", training=True)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache directory and a fresh "process" (runtime state cleared)."""
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(runtime, "_core", lambda: fake_core)
    monkeypatch.setattr(fake_core, "CUDNN_VERSION", [91900])
    monkeypatch.setattr(fake_core, "GPU_NAME", ["NVIDIA H200"])
    runtime.clear()
    yield tmp_path / "cache"
    runtime.clear()


def new_process():
    """What a fresh process would have: nothing in memory."""
    runtime.clear()


def test_second_process_loads_instead_of_building(cache_dir):
    a = fastattn.plan(CFG)
    assert fastattn.stats()["builds"] == 1 and fastattn.stats()["cache"]["writes"] == 1
    new_process()
    b = fastattn.plan(CFG)
    s = fastattn.stats()
    assert s["builds"] == 0 and s["disk_hits"] == 1 and s["deserializations"] == 1 and s["load_seconds"] > 0
    assert b.output() == a.output() and b.forward_engine == "fake_fwd" and b.backward_engine == "fake_bwd"
    r = fastattn.probe(CFG)
    assert r.source == "memory"
    new_process()
    r = fastattn.probe(CFG)
    assert r.supported and r.source == "disk" and r.backward_workspace_size == 1024 and r.cached


def test_refusals_are_stored_and_refresh_rebuilds(cache_dir):
    refused = {**CFG, "head_dim_qk": 1024}
    r = fastattn.probe(refused)
    assert not r.supported and r.source == "built" and "head_dim_qk=1024" in r.reason
    new_process()
    r2 = fastattn.probe(refused)
    assert not r2.supported and r2.source == "disk" and r2.reason == r.reason
    s = fastattn.stats()
    assert s["builds"] == 0 and s["negative_hits"] == 1
    with pytest.raises(fastattn.NotSupportedError, match="head_dim_qk=1024"):
        fastattn.plan(refused)
    r3 = fastattn.probe(refused, refresh=True)
    assert r3.source == "built" and fastattn.stats()["builds"] == 1


def test_entries_of_another_cudnn_or_gpu_are_not_used(cache_dir, monkeypatch):
    fastattn.plan(CFG)
    new_process()
    monkeypatch.setattr(fake_core, "CUDNN_VERSION", [92000])
    fastattn.plan(CFG)
    assert fastattn.stats()["builds"] == 1 and fastattn.stats()["disk_hits"] == 0
    new_process()
    monkeypatch.setattr(fake_core, "GPU_NAME", ["NVIDIA H100 80GB HBM3"])
    fastattn.plan(CFG)
    assert fastattn.stats()["builds"] == 1
    assert len(list(store.DiskStore(str(cache_dir)).entries())) == 3


def test_plan_changing_environment_variables_are_in_the_key(cache_dir, monkeypatch):
    fastattn.plan(CFG)
    new_process()
    monkeypatch.setenv("CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT", "0")
    fastattn.plan(CFG)
    assert fastattn.stats()["builds"] == 1
    new_process()
    monkeypatch.setenv("CUDNN_LOGLEVEL_DBG", "2")  # logging only: same key
    fastattn.plan(CFG)
    assert fastattn.stats()["builds"] == 0


def _only_entry(cache_dir):
    (info,) = list(store.DiskStore(str(cache_dir)).entries())
    return info


def test_corrupt_entry_is_rebuilt_and_replaced(cache_dir):
    fastattn.plan(CFG)
    path = _only_entry(cache_dir).path
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 10)
        f.write(b"XXXXXXXXXX")
    new_process()
    fastattn.plan(CFG)
    s = fastattn.stats()
    assert s["builds"] == 1 and s["cache"]["corrupt"] == 1
    new_process()
    fastattn.plan(CFG)
    assert fastattn.stats()["builds"] == 0  # the rebuild replaced the entry


def test_entry_cudnn_rejects_is_rebuilt_and_replaced(cache_dir):
    fastattn.plan(CFG)
    info = _only_entry(cache_dir)
    s = store.DiskStore(str(cache_dir))
    entry = s.get(info.key)
    entry.blobs["forward"] = b"garbage the checksum covers"
    s.put(entry)
    new_process()
    fastattn.plan(CFG)
    st = fastattn.stats()
    assert st["bad_entries"] == 1 and st["builds"] == 1
    new_process()
    fastattn.plan(CFG)
    assert fastattn.stats()["builds"] == 0


def test_cache_off_and_read_only(cache_dir, monkeypatch):
    monkeypatch.setenv("FASTATTN_CACHE_MODE", "off")
    new_process()
    fastattn.plan(CFG)
    assert not os.path.exists(cache_dir)
    monkeypatch.setenv("FASTATTN_CACHE_MODE", "read-write")
    new_process()
    fastattn.plan(CFG)
    monkeypatch.setenv("FASTATTN_CACHE_MODE", "read-only")
    new_process()
    fastattn.plan(CFG)
    fastattn.plan({**CFG, "seqlen_q": 1024})
    s = fastattn.stats()
    assert s["disk_hits"] == 1 and s["builds"] == 1 and s["cache"]["writes"] == 0
    assert len(list(store.DiskStore(str(cache_dir)).entries())) == 1


def test_unwritable_cache_warns_once_and_work_goes_on(cache_dir, monkeypatch, caplog):
    cache_dir.parent.mkdir(exist_ok=True)
    cache_dir.write_text("a file where the directory should be")
    new_process()
    for s in (128, 256, 384):
        assert fastattn.plan({**CFG, "seqlen_q": s})
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    assert fastattn.stats()["builds"] == 3


def test_extra_read_only_directory(cache_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "baked"))
    new_process()
    fastattn.plan(CFG)
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("FASTATTN_CACHE_EXTRA_DIRS", str(tmp_path / "baked"))
    new_process()
    fastattn.plan(CFG)
    assert fastattn.stats()["builds"] == 0 and fastattn.stats()["disk_hits"] == 1
    assert not os.path.exists(cache_dir)  # nothing had to be written


def test_preload_loads_what_matches_this_gpu(cache_dir, monkeypatch):
    configs = [{**CFG, "seqlen_q": s} for s in (256, 512, 1024, 2048)]
    for c in configs:
        fastattn.plan(c)
    fastattn.probe({**CFG, "head_dim_qk": 1024})
    new_process()
    monkeypatch.setattr(fake_core, "GPU_NAME", ["Another GPU"])
    fastattn.plan({**CFG, "seqlen_q": 4096})  # an entry for another GPU
    monkeypatch.setattr(fake_core, "GPU_NAME", ["NVIDIA H200"])
    new_process()
    results = fastattn.preload(threads=4)
    assert len(results) == 5 and sum(r.supported for r in results) == 4
    assert {r.config.seqlen_q for r in results if r.supported} == {256, 512, 1024, 2048}
    s = fastattn.stats()
    assert s["builds"] == 0 and s["disk_hits"] == 4 and s["negative_hits"] == 1
    new_process()
    future = fastattn.preload([configs[0], configs[1]], background=True)
    assert [r.source for r in future.result(timeout=30)] == ["disk", "disk"]
    with pytest.raises(fastattn.InvalidArgumentError, match="^threads=0"):
        fastattn.preload([], threads=0)


def test_preload_loads_the_most_recently_used_first(cache_dir):
    # What a process is likeliest to ask for first: preload(None) goes by each entry's
    # last use (a hit sets it), whatever the listing's order.
    configs = [{**CFG, "seqlen_q": s} for s in (256, 512, 1024, 2048)]
    for c in configs:
        fastattn.plan(c)
    cache = runtime.plan_cache()
    now = time.time()
    for age, c in zip((300, 100, 400, 200), configs):  # used 100 s ago: 512; then 2048, 256, 1024
        path = cache.store.tiers[0].path_for(cache.key(fastattn.AttentionConfig(**c)))
        os.utime(path, (now - age, now - 1000))
    new_process()
    assert [c.seqlen_q for c in runtime.plan_cache().configs()] == [512, 2048, 256, 1024]
    assert [r.config.seqlen_q for r in fastattn.preload(threads=1)] == [512, 2048, 256, 1024]
    new_process()
    fastattn.plan(configs[3])  # a hit: 2048 is now the most recent
    assert [c.seqlen_q for c in runtime.plan_cache().configs()] == [2048, 512, 256, 1024]


def test_background_preload_lists_the_cache_in_its_worker(cache_dir, monkeypatch):
    # preload(background=True) returns before it reads the cache's headers (a listing
    # reads every entry's): the caller's thread resolves the device and the settings only.
    import threading

    from fastattn.plan_cache import PlanCache

    for s in (256, 512):
        fastattn.plan({**CFG, "seqlen_q": s})
    new_process()
    listing, release, real = threading.Event(), threading.Event(), PlanCache.configs

    def slow_listing(self, device=None):
        listing.set()
        assert release.wait(30)
        return real(self, device)

    monkeypatch.setattr(PlanCache, "configs", slow_listing)
    future = fastattn.preload(background=True)
    assert listing.wait(30) and not future.done()  # returned while its worker lists
    release.set()
    assert sorted(r.config.seqlen_q for r in future.result(timeout=30)) == [256, 512]


_RACER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {here!r})
    import fake_core, fastattn
    from fastattn import runtime
    fake_core.install(runtime)
    start = float(sys.argv[1])
    while time.time() < start:
        time.sleep(0.001)
    p = fastattn.plan({cfg!r})
    s = fastattn.stats()
    print(s["builds"], s["disk_hits"], p.output())
""")


def test_processes_started_together_build_once(cache_dir, tmp_path):
    log = tmp_path / "builds.log"
    env = {**os.environ, "FASTATTN_CACHE_DIR": str(cache_dir), "FAKE_BUILD_LOG": str(log),
           "FAKE_BUILD_SECONDS": "0.5"}
    start = time.time() + 1.5
    script = _RACER.format(here=str(TESTS), cfg=CFG)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(start)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=TESTS) for _ in range(8)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    rows = [o[0].split() for o in outs]
    assert len(log.read_text().splitlines()) == 1
    assert sorted(int(r[0]) for r in rows) == [0] * 7 + [1]
    assert len({r[2] for r in rows}) == 1


def test_a_plan_that_cannot_be_serialized_still_works(cache_dir, monkeypatch, caplog):
    def broken(self):
        raise fastattn.InternalError("serialize: no")

    monkeypatch.setattr(fake_core.FakePlan, "serialize", broken)
    p = fastattn.plan(CFG)
    assert p is not None and fastattn.stats()["builds"] == 1
    assert "cannot serialize" in caplog.text
    assert list(store.DiskStore(str(cache_dir)).entries()) == []


def test_a_device_this_process_does_not_have_is_named(cache_dir):
    with pytest.raises(fastattn.InvalidArgumentError, match=r"device=5: this process sees 2 CUDA device"):
        fastattn.plan(CFG, device=5)
    assert fastattn.plan(CFG, device=1) is not None
