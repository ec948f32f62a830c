"""fastattn.torch's in-memory tables keyed by shape are bounded (fastattn/bounded.py): the
Python table of plans per call signature (`_plans.plans`), the SDPA mode's Python routes,
the kept length arrays and refused class keys. Each holds at most the cap, drops the least
recently used first, counts what it drops in fastattn.stats()["evictions"], and a call
whose entry was dropped gets the same plan again (from the runtime, never a build), also
inside a CUDA-graph capture. On tests/fake_core.py's plans and meta tensors; the op
library's C++ route map: tests/pytorch/test_sdpa_mode.py; its plan table, with real plans:
tests/pytorch/test_torch_bounded_gpu.py."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402,F401
from fastattn import bounded, runtime  # noqa: E402
from fastattn.torch import _dense, _paged, _plans, _sdpa_mode  # noqa: E402

OPTIONS = _dense.DenseOptions("bshd", True, False, -1, -1, 0.0, False, False, False, 0.0, False, 0.0)


@pytest.fixture
def table(env, monkeypatch):
    """fastattn.torch's Python table, emptied for the test (and restored after), over the
    fake core; outside any capture. Sets the cap: table(n)."""
    saved = dict(_plans.plans)
    _plans.plans.clear()
    monkeypatch.setattr(_plans, "capturing", lambda: False)
    monkeypatch.setattr(runtime, "warm_torch_backward", lambda: None)

    def set_cap(n: int) -> None:
        monkeypatch.setattr(bounded, "_max", n)

    yield set_cap
    _plans.plans.clear()
    _plans.plans.update(saved)


def qkv(seqlen: int):
    q = torch.empty(1, seqlen, 2, 64, device="meta", dtype=torch.bfloat16)
    return q, q, q


def call(seqlen: int) -> _plans.CachedPlan:
    """What attention() on (1, seqlen, 2, 64) tensors looks up: its plan, through the table."""
    return _dense.plan_for(*qkv(seqlen), None, None, None, None, None, None, OPTIONS)


def held() -> set[int]:
    return {key[0][1] for key in _plans.plans}  # (q.shape's seqlen)


def test_the_table_holds_the_cap_and_counts_what_it_drops(table):
    table(8)
    for s in range(64, 64 + 40):
        call(s)
        assert len(_plans.plans) <= 8
    assert fastattn.stats()["evictions"]["torch_calls"] == 40 - len(_plans.plans) > 0


def test_the_least_recently_used_calls_go_first(table):
    table(8)
    for s in range(1, 9):
        call(s)
    call(1)  # hits: the most recent but the new one
    call(2)
    call(9)  # past the cap: trimmed to 7, the two least recently used (3 and 4) dropped
    assert held() == {1, 2, 5, 6, 7, 8, 9}
    assert fastattn.stats()["evictions"]["torch_calls"] == 2


@pytest.mark.parametrize("n", [2, 4, 64])
def test_a_shape_used_between_every_two_new_ones_stays_hot(table, n):
    table(n)
    hot = call(4096)
    for s in range(1, 2 * n + 40):
        assert call(4096) is hot  # a hit every time: the same CachedPlan, never asked of the runtime again
        call(s)
    assert fastattn.stats()["evictions"]["torch_calls"] > 40


def test_a_dropped_call_gets_an_equal_plan_without_a_build(table):
    table(2)  # (the runtime's cap too: it drops the plan as well, and loads it from the cache)
    first = call(64)
    for s in range(1, 5):
        call(s)
    assert 64 not in held()
    before = fastattn.stats()
    again = call(64)
    assert again is not first and again.plan.output() == first.plan.output()  # the same plan, loaded again
    assert (again.out_shape, again.stats_shape, again.forward_workspace, again.out_like_q) == \
           (first.out_shape, first.stats_shape, first.forward_workspace, first.out_like_q)
    after = fastattn.stats()
    assert after["builds"] == before["builds"] and after["deserializations"] == before["deserializations"] + 1


def test_a_capture_only_drops_references_and_never_loads_or_builds(table, monkeypatch):
    table(2)
    kept = call(128)
    cfg = _dense.config_for(*qkv(128), None, None, None, None, None, OPTIONS)
    for s in range(1, 4):
        call(s)
        fastattn.plan(cfg)  # used in the runtime between every two: it keeps it; this table drops it
    assert 128 not in held() and runtime.planned(cfg) is kept.plan
    monkeypatch.setattr(_plans, "capturing", lambda: True)
    before = fastattn.stats()
    assert call(128).plan is kept.plan  # a miss inside the capture: the plan the runtime holds
    with pytest.raises(fastattn.InvalidArgumentError, match="being captured"):
        call(4096)  # held by nobody: refused before any cuDNN work
    after = fastattn.stats()
    assert (after["builds"], after["deserializations"]) == (before["builds"], before["deserializations"])
    assert after["evictions"]["torch_calls"] == before["evictions"]["torch_calls"] + 1  # (the capture's insert)


def test_threads_missing_and_hitting_at_once_keep_the_table_within_its_cap(table):
    table(6)
    errors, barrier = [], threading.Barrier(8)

    def work(i):
        try:
            barrier.wait()
            for n in range(60):
                s = 64 + (i * 7 + n) % 20
                c = call(s)
                assert c.out_shape == [1, s, 2, 64]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(_plans.plans) <= 6
    assert fastattn.stats()["builds"] == 20  # each shape built once, however often dropped


# -- the SDPA mode's Python routes -----------------------------------------------------------------


@pytest.fixture
def routes(monkeypatch):
    """The Python route map, emptied, with _decide counted (a route per signature's shape)."""
    decided = []

    def decide(q, *rest):
        decided.append(q.shape[2])
        return f"a reason for {q.shape[2]}"

    monkeypatch.setattr(_sdpa_mode, "_decide", decide)
    monkeypatch.setattr(_sdpa_mode, "_routes", {})
    monkeypatch.setattr(_sdpa_mode, "capturing", lambda: False)
    runtime.clear()
    yield decided
    runtime.clear()


def route(seqlen: int):
    q = torch.empty(1, 2, seqlen, 8, dtype=torch.bfloat16)
    return _sdpa_mode._route(q, q, q, None, 0.0, False, None, False)


def test_the_sdpa_routes_are_bounded_least_recently_used_first(routes, monkeypatch):
    monkeypatch.setattr(bounded, "_max", 4)
    for s in (1, 2, 3, 4):
        route(s)
    route(1)
    route(5)  # past the cap: trimmed to 4 (an eighth of 4 is 0; one goes): 2, the least recently used
    assert sorted(k[0][2] for k in _sdpa_mode._routes) == [1, 3, 4, 5]
    assert route(2) == "a reason for 2" and routes == [1, 2, 3, 4, 5, 2]  # decided again, alike
    assert fastattn.stats()["evictions"]["sdpa_routes"] == 2 and len(_sdpa_mode._routes) == 4


def test_the_sdpa_reasons_counted_are_bounded_and_every_call_still_counted(monkeypatch):
    monkeypatch.setattr(bounded, "_max", 3)
    monkeypatch.setattr(_sdpa_mode, "_calls", {})
    monkeypatch.setattr(_sdpa_mode, "_native_kernels", None)
    for i in range(10):
        _sdpa_mode._count(f"query strides ({i}, 1): in no memory order fastattn reads")
        _sdpa_mode._count(None)
    calls = _sdpa_mode.sdpa_calls()
    assert calls["served"] == 10 and sum(calls["passed_on"].values()) == 10
    assert len(calls["passed_on"]) == 3 and calls["passed_on"][bounded.OTHER_REASONS] == 8


# -- the kept arrays and refusals ------------------------------------------------------------------


def test_kept_length_arrays_are_per_stream_and_bounded(monkeypatch):
    monkeypatch.setattr(bounded, "_max", 4)
    monkeypatch.setattr(_paged, "_full_lengths", bounded.Table("arrays"))
    monkeypatch.setattr(_paged, "capturing", lambda: False)
    stream = [7]
    monkeypatch.setattr(_paged, "raw_stream", lambda device: stream[0])  # (the current stream's handle)
    runtime.clear()
    q = torch.empty(2, 3, 4, 8)
    a = _paged.query_lengths(q, 0)
    assert _paged.query_lengths(q, 0) is a  # kept
    stream[0] = 8
    assert _paged.query_lengths(q, 0) is not a  # another stream's own
    stream[0] = 7
    assert a.tolist() == [3, 3]
    for s in range(1, 10):
        _paged.query_lengths(torch.empty(2, s, 4, 8), 0)
    assert len(_paged._full_lengths) <= 4 and fastattn.stats()["evictions"]["arrays"] > 0
    runtime.clear()
