"""GPU: launches through cached variant packs (csrc/packs.h). A plan's execute
keeps, per thread, the cuDNN variant pack of each (graph, pointers, workspace) it has
run, and replays a launch that repeats as a CUDA graph; these tests hold both to what
cudnn-frontend's own execute writes, bit for bit, as pointers, workspaces, streams,
data and plans change and as the cache evicts."""

from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import AttentionConfig

from helpers.gpu import DeviceBuffer, Tensor, random_inputs, reference, rel_error, synchronize

FWD_NAMES = ("q", "k", "v", "o", "stats")
BWD_NAMES = FWD_NAMES + ("d_o", "d_q", "d_k", "d_v")


def _core():
    from fastattn import _core

    return _core


def small(**changes) -> AttentionConfig:
    return AttentionConfig(batch=2, heads_q=4, heads_kv=2, seqlen_q=96, seqlen_kv=160, head_dim_qk=64,
                           dtype="bf16", mask="causal_bottom_right", training=True, deterministic=True).replace(
                               **changes)


class Tensors:
    """One call's tensors on fresh random data, outputs poisoned."""

    def __init__(self, cfg: AttentionConfig, plan, seed: int):
        self.cfg = cfg
        self.q, self.k, self.v, self.d_o = random_inputs(cfg, np.random.default_rng(seed), backward=True)
        self.t = {n: Tensor(cfg, n) for n in BWD_NAMES}
        for n, x in (("q", self.q), ("k", self.k), ("v", self.v), ("d_o", self.d_o)):
            self.t[n].write(x)
        self.ws = DeviceBuffer(plan.workspace_size)

    def ptrs(self, names):
        return {n: self.t[n].ptr for n in names}

    def poison(self):
        for n in ("o", "stats", "d_q", "d_k", "d_v"):
            self.t[n].buf.poison()

    def run(self, plan, mode: str, stream: int = 0, poison_workspace: bool = False):
        """Outputs poisoned (and the workspace: what a launch writes there itself must
        be written anew each call), then forward and backward through bench_execute in
        `mode` ("fastattn": execute, the cached packs and replays; "frontend_sorted":
        cudnn-frontend's execute) on `stream`."""
        self.poison()
        if poison_workspace:
            self.ws.poison()
        _core().bench_execute(plan, "forward", mode, 1, self.ws.ptr, stream, **self.ptrs(FWD_NAMES))
        _core().bench_execute(plan, "backward", mode, 1, self.ws.ptr, stream, **self.ptrs(BWD_NAMES))
        synchronize()
        return {n: self.t[n].raw() for n in ("o", "stats", "d_q", "d_k", "d_v")}

    def check_reference(self):
        o, _, (d_q, d_k, d_v) = reference(self.cfg, self.q, self.k, self.v, self.d_o)
        for n, ref, tol in (("o", o, 2e-2), ("d_q", d_q, 4e-2), ("d_k", d_k, 4e-2), ("d_v", d_v, 4e-2)):
            assert rel_error(self.t[n].read(), ref) < tol, n


def test_plain_plans_launch_through_cached_packs():
    p = fastattn.plan(small())
    assert _core().bench_direct_launch(p, "forward")
    assert _core().bench_direct_launch(p, "backward")


def test_graphs_whose_execute_does_more_keep_the_frontends():
    # Host seed and offset: values read per call, not pointers to keep.
    host_seed = AttentionConfig(batch=1, heads_q=2, seqlen_q=64, head_dim_qk=64, dtype="fp16", dropout=0.2,
                                host_seed=True, training=True)  # (test_features_gpu's dropout shape)
    assert fastattn.probe(host_seed).supported
    p = fastattn.plan(host_seed)
    assert not _core().bench_direct_launch(p, "forward")
    assert not _core().bench_direct_launch(p, "backward")


def test_alibi_launches_directly_and_writes_what_the_frontend_writes():
    # The frontend copies ALiBi's slopes into the workspace on every call, from host
    # memory it frees at once; fastattn's launch copies them from a device constant
    # (csrc/packs.h, capture_direct). The workspace is poisoned before every run, so a
    # slope not written (or written elsewhere) anew by each launch, its pack or its replay
    # shows; forward and backward, past the replay threshold, on two tensor sets.
    cfg = small(mask="causal", alibi=True, seqlen_q=80, seqlen_kv=80)
    assert fastattn.probe(cfg).supported, fastattn.probe(cfg).reason
    p = fastattn.plan(cfg)
    assert _core().bench_direct_launch(p, "forward") and _core().bench_direct_launch(p, "backward")
    a, b = Tensors(cfg, p, seed=3), Tensors(cfg, p, seed=4)
    want_a = a.run(p, "frontend_sorted", poison_workspace=True)
    want_b = b.run(p, "frontend_sorted", poison_workspace=True)
    replays = _core().bench_pack_counts()[2]
    for _ in range(5):  # three runs through the pack, then replays
        assert a.run(p, "fastattn", poison_workspace=True) == want_a
        assert b.run(p, "fastattn", poison_workspace=True) == want_b
    assert _core().bench_pack_counts()[2] - replays >= 4  # the last two rounds replayed (a, b; fwd, bwd)
    a.check_reference()
    b.check_reference()


def new_stream(non_blocking: bool = False) -> int:
    """A new stream: blocking by default, so that work on it is ordered after the legacy
    stream's (the tests' cudaMemset poisoning); non-blocking for captures, which must not
    touch the legacy stream."""
    from cuda.bindings import runtime as rt

    flags = rt.cudaStreamNonBlocking if non_blocking else rt.cudaStreamDefault
    err, stream = rt.cudaStreamCreateWithFlags(flags)
    assert int(err) == 0
    return int(stream)


def test_repeated_pointers_hit_then_replay_and_every_call_writes_what_the_frontend_writes():
    # A config of its own: its graph's packs are keyed by its serial, so pointers that the
    # allocator hands out again after another test cannot be hits already (in the whole
    # suite run in reverse order they were, and two of the four packs were found, not made).
    cfg = small(seqlen_q=88, seqlen_kv=152)
    p = fastattn.plan(cfg)
    a, b = Tensors(cfg, p, seed=1), Tensors(cfg, p, seed=2)
    want_a, want_b = a.run(p, "frontend_sorted"), b.run(p, "frontend_sorted")
    counts = [_core().bench_pack_counts()]
    for _ in range(3):  # a launch's first three runs go through its pack
        assert a.run(p, "fastattn") == want_a
        assert b.run(p, "fastattn") == want_b  # other tensors and another workspace
        counts.append(_core().bench_pack_counts())
    assert counts[1][1] - counts[0][1] == 4  # new pointers: four packs made (a, b; fwd, bwd)
    assert [(c[0] - p_[0], c[1] - p_[1]) for p_, c in zip(counts[1:], counts[2:])] == [(4, 0), (4, 0)]
    assert counts[3][2] == counts[0][2]  # no replay yet
    stream = new_stream()
    for s_ in (0, stream):  # then replays, on the stream captured for or another
        assert a.run(p, "fastattn", s_) == want_a
        assert b.run(p, "fastattn", s_) == want_b
    assert _core().bench_pack_counts()[2] - counts[3][2] == 8
    a.check_reference()
    b.check_reference()


def test_new_data_behind_cached_pointers_is_read():
    cfg = small()
    p = fastattn.plan(cfg)
    a = Tensors(cfg, p, seed=3)
    for _ in range(4):  # past the pack and into the replay
        a.run(p, "fastattn")
    for seed in (4, 5):
        fresh = Tensors(cfg, p, seed=seed)  # new values written into a's buffers
        for n, x in (("q", fresh.q), ("k", fresh.k), ("v", fresh.v), ("d_o", fresh.d_o)):
            a.t[n].write(x)
        a.q, a.k, a.v, a.d_o = fresh.q, fresh.k, fresh.v, fresh.d_o
        replays0 = _core().bench_pack_counts()[2]
        a.run(p, "fastattn")
        assert _core().bench_pack_counts()[2] - replays0 == 2
        a.check_reference()


def test_plans_on_the_same_pointers_use_their_own_packs():
    causal, full = small(), small(mask="none")
    pc, pf = fastattn.plan(causal), fastattn.plan(full)
    t = Tensors(causal, pc, seed=5)  # the same shapes and strides serve both
    want_c, want_f = t.run(pc, "frontend_sorted"), t.run(pf, "frontend_sorted")
    assert want_c["o"] != want_f["o"]
    for _ in range(5):  # packs, then replays
        assert t.run(pc, "fastattn") == want_c
        assert t.run(pf, "fastattn") == want_f


def test_a_reloaded_plan_gets_packs_of_its_own():
    cfg = small()
    p = fastattn.plan(cfg)
    t = Tensors(cfg, p, seed=6)
    want = t.run(p, "frontend_sorted")
    assert t.run(p, "fastattn") == want
    q = _core().load_plan(cfg, p.device, *p.serialize())
    _, misses0, _ = _core().bench_pack_counts()
    assert t.run(q, "fastattn") == want
    assert _core().bench_pack_counts()[1] - misses0 == 2


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_more_pointer_sets_than_the_cache_holds_all_run_right(direction):
    # 300 layers, each with its own tensors, run four times over: more keys than the
    # cache's 256 packs, so packs are evicted and made again, and those that survive
    # three runs replay; every layer's outputs must be the frontend's, byte for byte.
    cfg = AttentionConfig(batch=1, heads_q=2, seqlen_q=32, head_dim_qk=64, dtype="fp16", mask="causal",
                          training=True, deterministic=True)
    p = fastattn.plan(cfg)
    layers = 300
    names = FWD_NAMES if direction == "forward" else BWD_NAMES
    outs = ("o", "stats") if direction == "forward" else ("d_q", "d_k", "d_v")
    size = {n: cfg.storage_elements(n) * (4 if n == "stats" else 2) for n in names}
    stride = (max(size.values()) + 255) // 256 * 256
    rng = np.random.default_rng(7)
    bufs = {n: DeviceBuffer(stride * layers) for n in names}
    for n in names:
        if n in outs:
            continue
        if n in ("o", "stats"):  # the backward's saved forward outputs: run the forward to get them
            continue
        bufs[n].upload(rng.standard_normal(stride * layers // 2).astype(np.float16).view(np.uint16))
    ws = DeviceBuffer(p.workspace_size)
    ptrs = {n: b.ptr for n, b in bufs.items()}
    if direction == "backward":  # o and stats from the forward, per layer
        fwd = {n: ptrs[n] for n in FWD_NAMES}
        _core().bench_execute(p, "forward", "frontend_sorted", layers, ws.ptr, 0, layers=layers, layer_bytes=stride,
                              **fwd)
        synchronize()

    def run(mode):
        for n in outs:
            bufs[n].poison()
        _core().bench_execute(p, direction, mode, 4 * layers, ws.ptr, 0, layers=layers, layer_bytes=stride, **ptrs)
        synchronize()
        got = {}
        for n in outs:
            raw = bufs[n].download(np.uint8, stride * layers).reshape(layers, stride)[:, :size[n]]
            got[n] = raw.copy()
        return got

    want = run("frontend_sorted")
    _, misses0, _ = _core().bench_pack_counts()
    got = run("fastattn")
    assert _core().bench_pack_counts()[1] - misses0 >= layers
    for n in outs:
        assert not np.all(want[n] == 0xFF), n  # written
        bad = [i for i in range(layers) if not np.array_equal(got[n][i], want[n][i])]
        assert not bad, f"{n}: layers {bad[:5]} differ"


def test_a_stream_being_captured_records_cudnns_launch_not_a_replay():
    # The caller's own CUDA graph, captured over a key that already replays: the capture
    # must record cuDNN's launch (a replay launched into a capturing stream would not be
    # the caller's to own), and the caller's graph must write what the frontend writes.
    from cuda.bindings import runtime as rt

    cfg = small()
    p = fastattn.plan(cfg)
    t = Tensors(cfg, p, seed=8)
    want = t.run(p, "frontend_sorted")
    for _ in range(4):  # the key replays from the fourth run
        t.run(p, "fastattn")
    stream = new_stream(non_blocking=True)
    t.poison()
    synchronize()
    hits0, misses0, replays0 = _core().bench_pack_counts()
    assert int(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)[0]) == 0
    _core().bench_execute(p, "forward", "fastattn", 1, t.ws.ptr, stream, **t.ptrs(FWD_NAMES))
    _core().bench_execute(p, "backward", "fastattn", 1, t.ws.ptr, stream, **t.ptrs(BWD_NAMES))
    err, graph = rt.cudaStreamEndCapture(stream)
    assert int(err) == 0
    assert _core().bench_pack_counts() == (hits0 + 2, misses0, replays0)  # found, not replayed
    err, exec_ = rt.cudaGraphInstantiate(graph, 0)
    assert int(err) == 0
    assert int(rt.cudaGraphLaunch(exec_, stream)[0]) == 0
    synchronize()
    assert {n: t.t[n].raw() for n in want} == want
    rt.cudaGraphExecDestroy(exec_)
    rt.cudaGraphDestroy(graph)


def test_replays_are_made_while_another_thread_captures_in_global_mode():
    # fastattn captures a repeating launch on a stream of its own. Meanwhile another
    # thread captures its own graph in CUDA's global mode (PyTorch's default), where a
    # potentially unsafe call from any thread invalidates that capture: fastattn's
    # capture, instantiation and eviction must not be such calls for it. (Should this
    # fail, try the worker's launches in "frontend_sorted" mode too: if cuDNN's own
    # execute invalidates the capture, the limit is cuDNN's, not the replays'.)
    import threading

    from cuda.bindings import runtime as rt

    cfg = small()
    p = fastattn.plan(cfg)
    warm, t = Tensors(cfg, p, seed=9), Tensors(cfg, p, seed=10)
    want = t.run(p, "frontend_sorted")
    t.poison()
    synchronize()
    ready, capturing, done, errors = threading.Event(), threading.Event(), threading.Event(), []
    worker_stream = new_stream(non_blocking=True)

    def worker():
        try:
            # This thread's handle, capture stream and a replay, made before the capture.
            _core().bench_execute(p, "forward", "fastattn", 4, warm.ws.ptr, worker_stream, **warm.ptrs(FWD_NAMES))
            rt.cudaStreamSynchronize(worker_stream)
            ready.set()
            capturing.wait(30)
            _, _, replays0 = _core().bench_pack_counts()
            for direction, names in (("forward", FWD_NAMES), ("backward", BWD_NAMES)):
                _core().bench_execute(p, direction, "fastattn", 4, t.ws.ptr, worker_stream, **t.ptrs(names))
            assert _core().bench_pack_counts()[2] - replays0 == 2  # captured and replayed in the window
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            errors.append(e)
        finally:
            ready.set()
            done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    ready.wait(60)
    stream = new_stream(non_blocking=True)
    assert int(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal)[0]) == 0
    capturing.set()
    done.wait(60)
    err, graph = rt.cudaStreamEndCapture(stream)
    thread.join()
    assert not errors, errors
    assert int(err) == 0, f"the other thread's capture was invalidated: {err}"
    rt.cudaGraphDestroy(graph)
    synchronize()
    assert {n: t.t[n].raw() for n in want} == want


def test_a_freed_plan_leaves_its_replays_harmless():
    # Packs and replays keep their frontend graph alive (csrc/packs.h, Entry::keep):
    # a plan freed while its entries remain must leave nothing dangling, whether the
    # entries are evicted later or outlive it to the thread's exit.
    import gc
    import threading

    cfg = small()
    p = fastattn.plan(cfg)
    blobs = p.serialize()
    t = Tensors(cfg, p, seed=11)
    want = t.run(p, "frontend_sorted")
    errors = []

    def in_a_thread():
        try:
            q = _core().load_plan(cfg, p.device, *blobs)
            for _ in range(4):  # into the replay
                assert t.run(q, "fastattn") == want
            del q
            gc.collect()
            for _ in range(4):  # the same pointers, another plan: its own packs and replays
                assert t.run(p, "fastattn") == want
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            errors.append(e)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()  # the thread's exit drops its packs, replays and the freed plan's graph
    assert not errors, errors
    assert t.run(p, "fastattn") == want
