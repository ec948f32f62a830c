"""GPU: fastattn.torch's tables past their cap (FASTATTN_MEMORY_MAX_ENTRIES, set small here):
more distinct shapes than the cap through attention() on both paths (the op library's C++
table, the Python one) and through the SDPA mode give outputs that agree with PyTorch's
math in float64, the tables drop the least recently used and count it, a shape used
between every two new ones never misses, a shape asked again after its entries were
dropped is served from the cache without a build, and an entry the table drops while
another thread runs it keeps running right (the thread's last hit holds it). The CPU
tests of the same tables: test_torch_bounded.py, test_sdpa_mode.py, tests/runtime/test_bounded.py."""

import threading

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import torch.nn.functional as F  # noqa: E402

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402,F401
from fastattn import bounded  # noqa: E402
from fastattn.torch import _native, _plans, _sdpa_mode  # noqa: E402
from helpers.torch import take_python_path  # noqa: E402

TOL = 2e-2  # bfloat16, relative to the reference's norm
HEADS, DIM = 2, 64


@pytest.fixture(params=("native", "python"))
def small(request, monkeypatch):
    """A cap of 8 for every table (the op library's too, on the native path); the path
    taken; the op library's plan misses counted by the call's sequence length
    (small.misses)."""
    lib = _native.library()
    assert lib is not None, _native.status()  # on the GPU machine the native path must load
    if request.param == "python":
        take_python_path(monkeypatch)
    else:
        _native._publish_ops()
    monkeypatch.setattr(bounded, "_max", 8)
    cap = lib.max_entries()
    lib.set_max_entries(8)
    lib.clear()
    misses = []
    dense, options = _native.PLAN_FOR["dense"]

    def counted(q, *args):
        misses.append(q.shape[1])
        return dense(q, *args)

    monkeypatch.setitem(_native.PLAN_FOR, "dense", (counted, options))
    fastattn.clear()
    state = type("Small", (), {"path": request.param, "lib": lib, "misses": misses})
    yield state
    lib.set_max_entries(cap)
    lib.clear()
    fastattn.clear()


def inputs(seqlen: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + seqlen)
    return [torch.randn(1, seqlen, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]


def reference(q, k, v):
    """Causal attention in float64 on (b, s, h, d) tensors."""
    q64, k64, v64 = (t.transpose(1, 2).double() for t in (q, k, v))
    return F.scaled_dot_product_attention(q64, k64, v64, is_causal=True).transpose(1, 2)


def rel(a, b):
    assert torch.isfinite(a).all()
    return ((a.double() - b).norm() / b.norm()).item()


def check(seqlen: int, seed: int = 0):
    q, k, v = inputs(seqlen, seed)
    out = fastattn.torch.attention(q, k, v, causal=True)
    assert rel(out, reference(q, k, v)) < TOL, seqlen


def test_more_shapes_than_the_cap_run_right_and_the_tables_drop_the_least_used(small):
    hot = 512
    lengths = [64 + 16 * i for i in range(24)]
    for s in lengths:
        check(hot)  # used between every two new shapes: never dropped, never missed again
        check(s)
    torch.cuda.synchronize()
    stats = fastattn.stats()
    evictions = stats["evictions"]
    table = "native_calls" if small.path == "native" else "torch_calls"
    assert evictions[table] > 0 and evictions["plans"] > 0, evictions
    if small.path == "native":
        assert small.misses.count(hot) == 1 and small.lib.table_size() <= 8, small.misses
    else:
        assert len(_plans.plans) <= 8
    # Every shape again: those dropped come back from the persistent cache, never built again.
    builds = stats["builds"]
    for s in lengths:
        check(s, seed=1)
    assert fastattn.stats()["builds"] == builds


def test_an_entry_dropped_while_another_thread_runs_it_stays_valid(small):
    # The runner's shape is dropped from the op library's table by the other thread's
    # inserts (a cap of 1) again and again while the runner calls it: it runs from its last
    # hit, whose shared entry outlives the drop, and its outputs stay right. Then the runner
    # exits: its last hit, perhaps the entry's last owner, releases the plan (under the
    # GIL, at thread exit). (On the Python path the runner holds its CachedPlan alike.)
    others = range(64, 64 + 8 * 16, 16)
    for s in others:
        check(s)  # built before: the dropper's calls below are quick misses of the C++ table
    small.lib.set_max_entries(1)
    q, k, v = inputs(256)
    first = fastattn.torch.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert rel(first, reference(q, k, v)) < TOL
    errors, runs, drops = [], [], []
    started, done = threading.Event(), threading.Event()

    def runner():
        try:
            drops.append(small.lib.evictions()["native_calls"])
            started.set()
            while not done.is_set() or len(runs) < 50:
                out = fastattn.torch.attention(q, k, v, causal=True)
                runs.append(torch.equal(out, first))  # (the same plan on the same inputs: cuDNN's forward repeats)
            drops.append(small.lib.evictions()["native_calls"])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def dropper():
        try:
            started.wait(60)
            for _ in range(5):
                for s in others:
                    check(s)
            torch.cuda.current_stream().synchronize()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done.set()

    threads = [threading.Thread(target=runner), threading.Thread(target=dropper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert errors == [] and all(runs) and len(runs) >= 50, (errors, runs.count(False))
    if small.path == "native":
        assert drops[1] - drops[0] >= 30 and small.lib.table_size() == 1, drops  # dropped while it ran
    check(256)  # asked again after it was dropped: served, right


def test_a_captured_call_replays_right_after_every_table_dropped_its_plan(small):
    # A CUDA graph holds no reference to the plan it captured: once the tables drop it (and
    # nothing else holds it, so it is freed), the graph must still replay right (the core
    # keeps what a captured launch reads alive: csrc/device.h).
    import gc

    q, k, v = inputs(256)
    fastattn.torch.attention(q, k, v, causal=True)  # loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fastattn.torch.attention(q, k, v, causal=True)
    for s in range(64, 64 + 16 * 12, 16):  # 12 new shapes past a cap of 8: every table drops 256's
        check(s)
    gc.collect()
    assert all(key[0][1] != 256 for key in _plans.plans if isinstance(key[0], torch.Size))
    for seed in (1, 2):
        for t, new in zip((q, k, v), inputs(256, seed)):
            t.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, reference(q, k, v)) < TOL


def test_the_sdpa_mode_serves_more_signatures_than_the_cap_and_counts_every_call(small):
    fastattn.torch.enable_sdpa()
    try:
        _sdpa_mode._routes.clear()
        served = fastattn.stats()["sdpa"]["served"]
        lengths = [64 + 16 * i for i in range(20)]
        for round_ in range(2):
            for s in lengths:
                q, k, v = (t.transpose(1, 2) for t in inputs(s, round_))  # (b, h, s, d) views
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
                assert rel(out, want) < TOL, s
        torch.cuda.synchronize()
        stats = fastattn.stats()
        assert stats["sdpa"]["served"] == served + 2 * len(lengths), stats["sdpa"]  # dropped routes' calls too
        assert stats["evictions"]["sdpa_routes"] > 0, stats["evictions"]
        if small.path == "native":
            assert small.lib.sdpa_route_count() <= 8
        else:
            assert len(_sdpa_mode._routes) <= 8
    finally:
        fastattn.torch.disable_sdpa()
