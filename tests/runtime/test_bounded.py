"""The in-memory tables keyed by shape are bounded (fastattn/bounded.py,
FASTATTN_MEMORY_MAX_ENTRIES): the runtime's plans, FASTATTN_RECORD's configs, the
warnings given and the reasons counted. Each holds at most the cap, drops the least
recently used first, counts what it drops in stats()["evictions"], and an evicted plan
asked for again is the same answer (from the cache, not a build). fastattn.torch's tables:
tests/pytorch/test_torch_bounded.py."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import AttentionConfig, bounded, _record, runtime, config_files

BASE = dict(batch=1, heads_q=4, head_dim_qk=64)


def cfg(seqlen: int, **extra) -> AttentionConfig:
    return AttentionConfig(**{**BASE, **extra}, seqlen_q=seqlen)


@pytest.fixture
def cap(monkeypatch):
    """Sets the cap (as FASTATTN_MEMORY_MAX_ENTRIES read at first use would): cap(n)."""
    def set_cap(n: int) -> None:
        monkeypatch.setattr(bounded, "_max", n)
    return set_cap


@pytest.fixture
def fast(env, monkeypatch):
    monkeypatch.setenv("FAKE_BUILD_SECONDS", "0")
    return env


def held() -> set[int]:
    return {c.seqlen_q for c, _ in runtime._entries}


# -- the runtime's plans ------------------------------------------------------------------------


def test_the_cap_holds_and_every_dropped_entry_is_counted(fast, cap):
    cap(8)
    for s in range(1, 41):
        fastattn.plan(cfg(s))
        assert len(runtime._entries) <= 8
    s = fastattn.stats()
    assert s["evictions"]["plans"] == 40 - len(runtime._entries) > 0
    assert s["builds"] == 40 and s["plans"] == len(runtime._entries)
    assert set(s["evictions"]) == set(bounded.NAMES)


def test_the_least_recently_used_go_first(fast, cap):
    cap(8)
    for s in range(1, 9):  # 8 entries: at the cap
        fastattn.plan(cfg(s))
    fastattn.plan(cfg(1))  # used again: now the most recent but one
    fastattn.probe(cfg(2))
    fastattn.plan(cfg(9))  # 9 > 8: trimmed to 7, the two least recently used (3 and 4) dropped
    assert held() == {1, 2, 5, 6, 7, 8, 9}
    assert fastattn.stats()["evictions"]["plans"] == 2


@pytest.mark.parametrize("n", [2, 4, 64])
def test_a_shape_used_between_every_two_new_ones_is_never_dropped(fast, cap, n):
    cap(n)  # (2: the least that holds a hot shape beside each new one)
    hot = cfg(4096)
    for s in range(1, 2 * n + 40):
        fastattn.plan(hot)
        fastattn.plan(cfg(s))
        assert (hot, 0) in runtime._entries
    s = fastattn.stats()
    assert s["builds"] == 2 * n + 40 and s["evictions"]["plans"] > 40  # the hot one built once, the others dropped


def test_a_dropped_plan_asked_again_is_the_same_answer_from_the_cache_not_a_build(fast, cap):
    cap(2)
    refused = cfg(64, head_dim_qk=1024)  # the fake core refuses it
    first = [fastattn.probe(c) for c in (cfg(64), refused)]
    plan = fastattn.plan(cfg(64))
    for s in range(100, 110):
        fastattn.plan(cfg(s))
    assert (cfg(64), 0) not in runtime._entries and (refused, 0) not in runtime._entries
    builds = fastattn.stats()["builds"]
    again = [fastattn.probe(c) for c in (cfg(64), refused)]
    assert fastattn.stats()["builds"] == builds  # both from the persistent cache
    assert [r.source for r in again] == ["disk", "disk"]
    for a, b in zip(first, again):
        assert (a.config, a.supported, a.reason, a.forward_workspace_size) == \
               (b.config, b.supported, b.reason, b.forward_workspace_size)
    with pytest.raises(fastattn.NotSupportedError, match="fake cuDNN refuses head_dim_qk=1024"):
        fastattn.plan(refused)
    assert fastattn.plan(cfg(64)).output() == plan.output()  # another object, the same plan


def test_a_dropped_plan_stays_valid_where_it_is_held_and_is_freed_where_it_is_not(fast, cap):
    cap(2)
    kept = fastattn.plan(cfg(64))
    gone = weakref.ref(fastattn.plan(cfg(128)))
    for s in range(200, 210):
        fastattn.plan(cfg(s))
    gc.collect()
    assert gone() is None  # the table held the only reference: host memory is bounded
    assert kept.output() and kept.config == cfg(64)  # the caller's plan is untouched


def test_a_build_in_flight_is_never_dropped_and_its_waiters_get_it(fast, cap, monkeypatch):
    cap(2)
    import fake_core

    started, release = threading.Event(), threading.Event()
    real = fake_core.build_plan

    def slow(config, device):
        if config.seqlen_q == 999:
            started.set()
            release.wait(30)
        return real(config, device)

    monkeypatch.setattr(fake_core, "build_plan", slow)
    got = []
    threads = [threading.Thread(target=lambda: got.append(fastattn.plan(cfg(999)))) for _ in range(3)]
    threads[0].start()
    assert started.wait(30)
    for t in threads[1:]:
        t.start()
    for s in range(1, 20):  # past the cap many times while it builds
        fastattn.plan(cfg(s))
    assert (cfg(999), 0) in runtime._entries
    release.set()
    for t in threads:
        t.join(30)
    assert len(got) == 3 and all(p is got[0] for p in got)
    assert fastattn.stats()["builds"] == 20  # 19 others and one for the three callers


def test_planned_after_an_eviction_answers_none_and_loads_nothing(fast, cap):
    cap(2)
    fastattn.plan(cfg(64))
    assert runtime.planned(cfg(64)) is not None
    for s in range(1, 5):
        fastattn.plan(cfg(s))
    loads = fastattn.stats()["deserializations"]
    assert runtime.planned(cfg(64)) is None and runtime.planned(cfg(64), wait=True) is None
    assert fastattn.stats()["deserializations"] == loads  # (what a capture asks: never a load)


def test_loads_ahead_are_bounded_too_and_a_dropped_one_loads_at_its_use(fast, cap):
    configs = [cfg(s) for s in (64, 128, 256, 512)]
    fastattn.preload(configs)  # built and stored
    runtime.clear()
    cap(2)
    cache = runtime.plan_cache()
    for c in configs:
        assert runtime.load_ahead(c, 0, cache, fastattn.store.key_of(cache.describe(c, 0)))
        assert len(runtime._entries) <= 2
    assert fastattn.stats()["evictions"]["plans"] == 2
    assert fastattn.probe(configs[0]).source == "disk"  # dropped ahead of use: loaded now
    assert fastattn.probe(configs[3]).source == "memory"


def test_clear_zeroes_the_evictions(fast, cap):
    cap(1)
    fastattn.plan(cfg(1))
    fastattn.plan(cfg(2))
    assert fastattn.stats()["evictions"]["plans"] == 1
    fastattn.clear()
    assert fastattn.stats()["evictions"] == dict.fromkeys(bounded.NAMES, 0)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(cap_=st.integers(1, 12), asks=st.lists(st.integers(1, 30), min_size=1, max_size=80))
def test_any_sequence_of_requests_stays_within_the_cap_and_keeps_the_last_one(cap_, asks):
    # A stand-in build (no cache, no sleep): only the registry's bookkeeping is exercised.
    saved = (runtime._build, runtime._resolve_device, bounded._max)
    runtime._build = lambda config, device, refresh=False, touch=True: (
        object(), runtime.ProbeResult(config, device, True, "", 0, 0, "e", "", 0.0, "built"), None)
    runtime._resolve_device = lambda d: 0
    bounded._max = cap_
    runtime.clear()
    try:
        for s in asks:
            fastattn.plan(cfg(s))
            assert len(runtime._entries) <= cap_ and (cfg(s), 0) in runtime._entries
        st_ = fastattn.stats()
        assert st_["misses"] == 0 and st_["memory_hits"] + st_["evictions"]["plans"] + len(runtime._entries) \
            >= len(set(asks))
        assert st_["evictions"]["plans"] == len(asks) - st_["memory_hits"] - len(runtime._entries)
    finally:
        runtime._build, runtime._resolve_device, bounded._max = saved
        runtime.clear()


# -- the tables that drop the oldest added: Table, FASTATTN_RECORD, warnings, reasons ------------


@settings(max_examples=100, deadline=None, derandomize=True)
@given(cap_=st.integers(1, 20), keys=st.lists(st.integers(0, 40), max_size=120))
def test_a_table_keeps_at_most_the_cap_the_newest_added_and_counts_the_rest(cap_, keys):
    saved = bounded._max
    bounded._max = cap_
    bounded.reset()
    try:
        t = bounded.Table("arrays")
        for k in keys:
            if t.get(k) is None:
                t.keep(k, str(k))
            assert len(t) <= cap_ and t[k] == str(k)
        held, adds = _fifo_model(keys, cap_)
        assert list(t) == held
        assert bounded.evictions()["arrays"] == adds - len(t)
    finally:
        bounded._max = saved
        bounded.reset()


def _fifo_model(keys: list[int], cap_: int) -> tuple[list[int], int]:
    """What a table holds after keys were asked for in order (each miss adds its key; past
    the cap the oldest added go, down to the cap less an eighth), and how many were added."""
    held: list[int] = []
    adds = 0
    for k in keys:
        if k in held:
            continue
        adds += 1
        if len(held) + 1 > cap_:
            del held[:len(held) + 1 - (cap_ - cap_ // 8)]
        held.append(k)
    return held, adds


def test_recorded_configs_are_bounded_and_one_forgotten_is_written_again(env, monkeypatch, cap):
    cap(2)
    _record.reset()
    path = env / "asked.jsonl"
    monkeypatch.setenv("FASTATTN_RECORD", str(path))
    try:
        for s in (1, 2, 3, 1, 3):
            _record.note(cfg(s))
            assert len(_record._seen) <= 2
    finally:
        _record.reset()
    assert [AttentionConfig.from_json(line).seqlen_q for line in path.read_text().splitlines()] == [1, 2, 3, 1]
    assert fastattn.stats()["evictions"]["recorded"] == 2
    assert config_files.load_configs(str(path)) == [cfg(1), cfg(2), cfg(3)]  # what warm builds: each once


def test_warnings_are_bounded_and_reasons_past_the_cap_share_one_row(env, cap, caplog):
    cap(3)
    with caplog.at_level("WARNING", logger="fastattn"):
        for i in range(10):
            runtime.count_fallback("transformers", f"reason {i}")
            runtime.count_fallback("transformers", f"reason {i}")
    fallbacks = fastattn.stats()["fallbacks"]["transformers"]
    assert fallbacks == {"reason 0": 2, "reason 1": 2, "reason 2": 2, bounded.OTHER_REASONS: 14}
    assert len(runtime._warned) <= 3 and fastattn.stats()["evictions"]["warnings"] > 0
    assert caplog.text.count("reason 9") == 1  # each still logged once while it is remembered


def test_the_cap_is_read_once_through_the_settings_parser(monkeypatch):
    monkeypatch.setattr(bounded, "_max", None)
    monkeypatch.setenv("FASTATTN_MEMORY_MAX_ENTRIES", "0")
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^FASTATTN_MEMORY_MAX_ENTRIES='0': a table of 0"):
        bounded.max_entries()
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^FASTATTN_MEMORY_MAX_ENTRIES='0'"):
        fastattn.probe(cfg(64))  # before any library or table is touched
    monkeypatch.setenv("FASTATTN_MEMORY_MAX_ENTRIES", "12")
    assert bounded.max_entries() == 12
    monkeypatch.setenv("FASTATTN_MEMORY_MAX_ENTRIES", "99")
    assert bounded.max_entries() == 12  # once per process
    monkeypatch.setattr(bounded, "_max", None)
    monkeypatch.delenv("FASTATTN_MEMORY_MAX_ENTRIES")
    assert bounded.max_entries() == 4096


def test_a_bad_cap_fails_fastattn_torch_at_import_and_the_command_with_exit_2(tmp_path, capsys, monkeypatch):
    import os
    import subprocess
    import sys

    from fastattn import cli
    from helpers.paths import ROOT

    pytest.importorskip("torch", reason="PyTorch is an optional extra")
    code = "try:\n    import fastattn.torch\nexcept ValueError as e:\n    print(type(e).__name__, e)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "FASTATTN_MEMORY_MAX_ENTRIES": "lots",
                            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("InvalidArgumentError FASTATTN_MEMORY_MAX_ENTRIES='lots': must be an integer"), r.stdout
    monkeypatch.setenv("FASTATTN_MEMORY_MAX_ENTRIES", "-3")
    assert cli.main(["info", "--json"]) == cli.EXIT_BAD_INPUT
    assert "FASTATTN_MEMORY_MAX_ENTRIES='-3': is negative" in capsys.readouterr().out


def test_info_says_the_cap(monkeypatch, capsys):
    import json

    from fastattn import cli

    monkeypatch.setattr(bounded, "_max", 77)
    assert cli.main(["info", "--json"]) == cli.EXIT_OK
    body = json.loads(capsys.readouterr().out)
    assert body["memory"] == {"max_entries": 77} and set(body["stats"]["evictions"]) == set(bounded.NAMES)


def test_a_table_whose_lock_another_thread_held_keeps_in_a_forked_child():
    import os

    t = bounded.Table("arrays")
    t._lock.acquire()  # (as another thread's keep at the moment of the fork)
    try:
        pid = os.fork()
        if pid == 0:
            try:
                t.keep("k", 1)
                os._exit(0 if t == {"k": 1} else 1)
            finally:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
    finally:
        t._lock.release()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
