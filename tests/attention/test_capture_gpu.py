"""A fastattn call inside a caller's CUDA-graph capture (torch.cuda.graph: CUDA's global
capture mode) after what a long-lived process accumulates: this thread's cuDNN handle
bound to many streams, and to streams that were destroyed since. The capture either
works or the call raises before touching it; the process's CUDA state and PyTorch's
generator stay healthy either way (tests/conftest.py checks after every GPU test)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn.torch as fat  # noqa: E402


def _inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]


def _on_new_streams(n: int, q, k, v) -> None:
    """A call on each of n new streams, each destroyed after its call: the handle ends
    bound to a stream that no longer exists, having seen n others."""
    from cuda.bindings import runtime as rt

    for _ in range(n):
        err, raw = rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)
        assert int(err) == 0
        stream = torch.cuda.ExternalStream(int(raw))
        with torch.cuda.stream(stream):
            fat.attention(q, k, v, causal=True)
        stream.synchronize()
        del stream
        assert int(rt.cudaStreamDestroy(raw)[0]) == 0


def _capture_and_replay(q, k, v):
    eager = fat.attention(q, k, v, causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fat.attention(q, k, v, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("streams", [1, 300])
def test_capture_after_the_handle_was_bound_to_destroyed_streams(streams):
    q, k, v = _inputs(streams)
    _on_new_streams(streams, q, k, v)
    _capture_and_replay(q, k, v)


def test_capture_after_another_shape_ran_on_destroyed_streams():
    # The captured call's own plan has never seen those streams; another plan has.
    q, k, v = _inputs(5)
    _on_new_streams(50, *(t[:, :64].contiguous() for t in (q, k, v)))
    _capture_and_replay(q, k, v)


def test_capture_on_a_thread_whose_handle_is_new():
    # A thread's first fastattn call is inside the capture: its handle is made then.
    import threading

    q, k, v = _inputs(6)
    fat.attention(q, k, v, causal=True)  # the plan exists
    errors = []

    def work():
        try:
            _capture_and_replay(q, k, v)
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors


@pytest.mark.parametrize("path", ["native", "python"])
def test_a_failed_launch_raises_fastattns_class_on_both_paths(path, monkeypatch):
    # q two bytes past a 16-byte boundary: the core refuses the address at execute. Both
    # paths raise the class errors.py's code table names (InvalidArgumentError), not the
    # op library's bare ValueError ("fastattn: ...").
    import fastattn
    from fastattn.torch import _native
    from helpers.torch import take_python_path

    if path == "python":
        take_python_path(monkeypatch)
    else:
        assert _native.library() is not None, _native.status()
    q, k, v = _inputs(7)
    shifted = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape).copy_(q)
    with pytest.raises(fastattn.InvalidArgumentError, match="q=0x[0-9a-f]+ is not 16-byte aligned"):
        fat.attention(shifted, k, v, causal=True)


def test_a_call_whose_plan_is_not_loaded_raises_before_touching_the_capture():
    # A shape this process has never run: its plan would be loaded or built inside the
    # capture, which would invalidate it. The call raises instead, the capture ends
    # cleanly (capture_end succeeds), and the generator stays usable (conftest checks).
    import fastattn

    q, k, v = (t[:, :71].contiguous() for t in _inputs(8))  # seqlen 71: no other test runs this shape
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(fastattn.InvalidArgumentError, match="being captured on the current stream"):
        with torch.cuda.graph(graph):
            fat.attention(q, k, v, causal=True)
    torch.randn(4, device="cuda")  # PyTorch's generator is not left in capture state
    _capture_and_replay(q, k, v)  # and after one call outside a capture, the capture works


# Plans whose graphs cuDNN compiles at run time (a score modifier, a bias) and a plain one:
# freeing a runtime-compiled graph unloads its kernels.
FREED = {
    "softcap": dict(softcap=30.0),
    "bias": dict(bias="1hss"),
    "plain": dict(),
}


@pytest.mark.parametrize("freed", sorted(FREED))
def test_capture_that_evicts_every_pack_of_a_freed_plan(freed):
    # A plan freed by an earlier test leaves its graph alive only in this thread's pack
    # table; a miss inside torch.cuda.graph that evicted it would destroy the graph, which
    # invalidates the capture, and the next launch fails with
    # CUDNN_STATUS_EXECUTION_FAILED_CUDART (the whole GPU suite, one test after another).
    # Here the table is made to evict inside the capture on purpose: thousands of distinct
    # pointer sets (it holds 256). csrc/packs.h defers what a capture evicts.
    import gc

    import fastattn

    base = dict(batch=1, heads_q=2, heads_kv=2, seqlen_q=64, seqlen_kv=64, head_dim_qk=64, dtype="bf16")
    old_cfg = fastattn.AttentionConfig(**base, **FREED[freed])
    g = torch.Generator(device="cuda").manual_seed(41)
    shape = (1, 64, 2, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    o = torch.empty_like(q)
    stream = torch.cuda.current_stream().cuda_stream
    old = fastattn.plan(old_cfg)
    bias = torch.zeros(old_cfg.shape("bias"), device="cuda", dtype=torch.bfloat16) if "bias" in FREED[freed] else None
    ws = torch.empty(max(old.workspace_size, 1), device="cuda", dtype=torch.uint8)
    extra = {"bias": bias.data_ptr()} if bias is not None else {}
    for _ in range(4):  # past the replay threshold: the entry holds a CUDA graph too
        old.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), 0, ws.data_ptr(), stream, **extra)
    torch.cuda.synchronize()
    del old
    fastattn.clear()
    gc.collect()  # the pack table now holds the freed plan's graph alone

    cfg = fastattn.AttentionConfig(**base, mask="causal")
    new = fastattn.plan(cfg)
    count = 3000
    # q moves 16 bytes (8 elements) per call: every call is a pointer set of its own.
    big_q = torch.randn(q.numel() + 8 * count, device="cuda", dtype=torch.bfloat16, generator=g)
    ws = torch.empty(max(new.workspace_size, 1), device="cuda", dtype=torch.uint8)
    last = big_q[8 * (count - 1):8 * (count - 1) + q.numel()].view(shape)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s = torch.cuda.current_stream().cuda_stream
        for i in range(count):
            new.forward(big_q.data_ptr() + 16 * i, k.data_ptr(), v.data_ptr(), o.data_ptr(), 0, ws.data_ptr(), s)
    o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).double() for t in (last, k, v)), is_causal=True).transpose(1, 2)
    assert torch.isfinite(o).all()
    assert (o.double() - ref).abs().max().item() < 2e-2



_ALIBI = dict(batch=1, heads_q=4, heads_kv=4, seqlen_q=128, seqlen_kv=128, head_dim_qk=64, dtype="bf16",
              mask="causal", alibi=True, training=True)


def _host_churn():
    """Small C heap blocks (glibc's, where cudnn-frontend's temporaries live) holding
    0x7f bytes, kept until the caller drops them: a copy recorded from a freed host
    temporary would read one of them."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]  # (without it ctypes passes an int: a truncated pointer)
    blocks = []
    for n in range(8, 80, 8):
        for _ in range(32):
            p = libc.malloc(n)
            ctypes.memset(p, 0x7F, n)
            blocks.append(p)
    return libc, blocks


def test_alibi_forward_and_backward_captured_replay_the_float64_answer():
    # cudnn-frontend's execute copies ALiBi's slopes from a host temporary it frees at
    # once (csrc/packs.h, capture_direct); a capture recording that copy replays stale
    # host memory. fastattn copies them from a device constant, which outlives the plan.
    # Before each replay: the plans are dropped, the workspace poisoned (the slopes must be
    # written by the replay itself), the outputs NaN, the C heap churned.
    import gc

    import fastattn

    from helpers.gpu import reference, rel_error

    cfg = fastattn.AttentionConfig(**_ALIBI, deterministic=True)
    assert fastattn.probe(cfg).supported, fastattn.probe(cfg).reason
    plans = [fastattn.plan(cfg)]  # dropped before the replays
    p = plans[0]
    g = torch.Generator(device="cuda").manual_seed(43)
    shape = (1, 128, 4, 64)
    q, k, v, d_o = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    o, d_q, d_k, d_v = (torch.empty_like(q) for _ in range(4))
    stats = torch.empty(cfg.shape("stats"), device="cuda", dtype=torch.float32)
    ws = torch.empty(max(p.workspace_size, 1), device="cuda", dtype=torch.uint8)

    def step(stream, p=p):
        p.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr(), ws.data_ptr(), stream)
        p.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(),
                   d_q.data_ptr(), d_k.data_ptr(), d_v.data_ptr(), ws.data_ptr(), stream)

    for _ in range(4):  # past fastattn's own replay threshold: its internal replay runs too
        ws.fill_(0xFF)
        step(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    bhsd = [t.permute(0, 2, 1, 3).double().cpu().numpy() for t in (q, k, v, d_o)]
    ref_o, _, ref_grads = reference(cfg, *bhsd)
    eager = [t.clone() for t in (o, d_q, d_k, d_v)]
    for name, got, want, tol in zip(("o", "d_q", "d_k", "d_v"), eager, (ref_o, *ref_grads), (2e-2, 4e-2, 4e-2, 4e-2)):
        assert rel_error(got.permute(0, 2, 1, 3).double().cpu().numpy(), want) < tol, name
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(torch.cuda.current_stream().cuda_stream)
    del p, step
    plans.clear()
    fastattn.clear()
    gc.collect()
    for _ in range(3):
        libc, blocks = _host_churn()
        ws.fill_(0xFF)
        for t in (o, d_q, d_k, d_v):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for b in blocks:
            libc.free(b)
        for name, got, want in zip(("o", "d_q", "d_k", "d_v"), (o, d_q, d_k, d_v), eager):
            assert torch.equal(got, want), f"{name}: a replay differs from eager by up to " \
                f"{(got.float() - want.float()).abs().max().item():.3g}"


def test_a_plan_that_would_copy_host_memory_inside_a_capture_is_refused_before_touching_it():
    # Host seeds make the frontend's execute the only way to launch (csrc/packs.h), and it
    # would record a copy of ALiBi's slopes from freed host memory: refused, the capture
    # intact, and eagerly the plan runs.
    import fastattn

    cfg = fastattn.AttentionConfig(**_ALIBI, dropout=0.1, host_seed=True)
    assert fastattn.probe(cfg).supported, fastattn.probe(cfg).reason
    p = fastattn.plan(cfg)
    q, k, v = (t[:1].contiguous() for t in _inputs(9))
    o = torch.empty_like(q)
    stats = torch.empty(cfg.shape("stats"), device="cuda", dtype=torch.float32)
    ws = torch.empty(max(p.workspace_size, 1), device="cuda", dtype=torch.uint8)

    def forward(stream):
        p.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr(), ws.data_ptr(), stream,
                  seed=1, offset=0)

    graph = torch.cuda.CUDAGraph()
    with pytest.raises(fastattn.NotSupportedError, match="cannot be captured in a CUDA graph.*host seeds"):
        with torch.cuda.graph(graph):
            forward(torch.cuda.current_stream().cuda_stream)
    torch.randn(4, device="cuda")  # the generator is not left in capture state
    o.fill_(float("nan"))
    forward(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
