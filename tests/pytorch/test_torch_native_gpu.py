"""GPU: fastattn.torch's native path (the C++ op library) against its Python path.

The same plans run on both paths, so outputs agree bitwise, and gradients too where the
backward is deterministic (deterministic=True; cuDNN's other backward accumulates with
atomics, whose order differs from run to run on one path as well: those gradients are
compared to rounding, rel < 1e-3). Outputs are poisoned: the caching allocator is handed
a NaN-filled block first, so a kernel that skipped an element shows. Also: the hit path
runs no Python, torch.compile(fullgraph=True) records the native op, CUDA graphs
capture and replay it with new inputs, and 16 threads missing on new shapes at once
build each plan once. test_torch_gpu.py runs every fastattn.torch test on both paths.
"""

import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402,F401
from fastattn import AttentionConfig, runtime  # noqa: E402
from fastattn.torch import _dense, _native  # noqa: E402  (_varlen's ops come with the library)
from helpers.torch import Block, in_threads, take_python_path  # noqa: E402


@pytest.fixture(scope="module")
def lib():
    loaded = _native.library()
    assert loaded is not None, _native.status()  # on the GPU machine the native path must load
    _native._publish_ops()
    return loaded


def poison_allocator():
    """Leaves NaN-filled blocks in the caching allocator, which the next allocations reuse."""
    for n in (1 << 16, 1 << 20, 1 << 24):
        torch.full((n,), float("nan"), device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()


def run(path, monkeypatch, q, k, v, d_o, **kw):
    """(o, gradients of the leaves among q, k, v, bias, sinks) on `path`."""
    with monkeypatch.context() as m:
        if path == "python":
            take_python_path(m)
        poison_allocator()
        o = fastattn.torch.attention(q, k, v, **kw)
        leaves = [t for t in (q, k, v, kw.get("bias"), kw.get("sinks")) if t is not None and t.requires_grad]
        grads = torch.autograd.grad(o, leaves, d_o) if leaves else ()
    torch.cuda.synchronize()
    return o, grads


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


CASES = [
    dict(layout="bshd", dtype=torch.bfloat16, heads=(8, 2), causal=True),
    dict(layout="bhsd", dtype=torch.float16, heads=(8, 8), causal=False),
    dict(layout="sbhd", dtype=torch.bfloat16, heads=(4, 1), causal=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['layout']}-{c['dtype']}-{c['heads']}")
@pytest.mark.parametrize("training", (False, True), ids=("inference", "training"))
def test_native_and_python_paths_agree_bitwise(lib, monkeypatch, case, training):
    torch.manual_seed(1)
    b, s, d = 2, 192, 64
    shape = {"bshd": lambda h: (b, s, h, d), "bhsd": lambda h: (b, h, s, d), "sbhd": lambda h: (s, b, h, d)}
    hq, hkv = case["heads"]
    q, k, v = (torch.randn(shape[case["layout"]](h), device="cuda", dtype=case["dtype"], requires_grad=training)
               for h in (hq, hkv, hkv))
    d_o = torch.randn(shape[case["layout"]](hq), device="cuda", dtype=case["dtype"])
    kw = dict(causal=case["causal"], layout=case["layout"], deterministic=True)
    o_native, g_native = run("native", monkeypatch, q, k, v, d_o, **kw)
    o_python, g_python = run("python", monkeypatch, q, k, v, d_o, **kw)
    assert torch.isfinite(o_native).all()
    assert torch.equal(o_native, o_python)
    assert len(g_native) == len(g_python) == (3 if training else 0)
    for a, p in zip(g_native, g_python):
        assert torch.equal(a, p)
    if training:
        assert o_native.grad_fn.name() == "fastattn::DenseBackward"


@pytest.mark.parametrize("feature", ("padding", "bias_sinks", "dropout"))
def test_native_and_python_paths_agree_with_every_feature(lib, monkeypatch, feature):
    torch.manual_seed(2)
    b, s, hq, hkv, d, dtype = 2, 160, 8, 2, 64, torch.float16
    if feature == "bias_sinks":
        fastattn.probe(AttentionConfig(batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=s, head_dim_qk=d, mask="causal"))
        if fastattn.versions()["cudnn_loaded"] < 91300:
            pytest.skip("sinks need cuDNN 9.13 (test_features_gpu checks the refusal)")
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))
    d_o = torch.randn(b, s, hq, d, device="cuda", dtype=dtype)
    kw = dict(causal=True)
    if feature == "padding":
        kw["seq_lens_q"] = torch.tensor([160, 77], device="cuda", dtype=torch.int32)
        kw["deterministic"] = True
    elif feature == "bias_sinks":
        kw["bias"] = torch.randn(1, hq, s, s, device="cuda", dtype=dtype, requires_grad=True)
        kw["sinks"] = torch.randn(hq, device="cuda", requires_grad=True)
    results = {}
    for path in ("native", "python"):
        if feature == "dropout":
            torch.manual_seed(3)  # the same Philox seed and offset: the same mask
            kw["dropout_p"] = 0.2
        results[path] = run(path, monkeypatch, q, k, v, d_o, **kw)
    (o_n, g_n), (o_p, g_p) = results["native"], results["python"]
    assert torch.equal(o_n, o_p)
    assert len(g_n) == len(g_p) == (5 if feature == "bias_sinks" else 3)
    for a, p in zip(g_n, g_p):
        assert a.shape == p.shape
        if kw.get("deterministic"):
            assert torch.equal(a, p)
        else:
            assert rel(a, p) < 1e-3
    if feature == "padding":  # padded rows are zero on the native path too
        assert (o_n[1, 77:] == 0).all() and (g_n[0][1, 77:] == 0).all()


@pytest.mark.parametrize("training", (False, True), ids=("inference", "training"))
def test_varlen_native_and_python_paths_agree_bitwise(lib, monkeypatch, training):
    torch.manual_seed(4)
    cu = torch.tensor([0, 100, 250, 384], device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(384, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=training)
               for h in (8, 2, 2))
    d_o = torch.randn(384, 8, 64, device="cuda", dtype=torch.bfloat16)
    results = {}
    for path in ("native", "python"):
        with monkeypatch.context() as m:
            if path == "python":
                take_python_path(m)
            poison_allocator()
            o = fastattn.torch.attention_varlen(q, k, v, cu, cu, 150, 150, causal=True, deterministic=True)
            grads = torch.autograd.grad(o, (q, k, v), d_o) if training else ()
        torch.cuda.synchronize()
        results[path] = o, grads
    (o_n, g_n), (o_p, g_p) = results["native"], results["python"]
    assert torch.isfinite(o_n).all() and torch.equal(o_n, o_p)
    assert all(torch.equal(a, b) for a, b in zip(g_n, g_p)) and len(g_n) == len(g_p)
    if training:
        assert o_n.grad_fn.name() == "fastattn::VarlenBackward"


@pytest.mark.parametrize("q_lens,bottom_right", [((1, 1, 1), False), ((16, 5, 16), True)], ids=("decode", "prefill"))
def test_paged_native_and_python_paths_agree_bitwise(lib, monkeypatch, q_lens, bottom_right):
    torch.manual_seed(5)
    b, sq, hq, hkv, d, page, num_pages = 3, max(q_lens), 8, 2, 128, 64, 20
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.float16)
    k_cache, v_cache = (torch.randn(num_pages, page, hkv, d, device="cuda", dtype=torch.float16) for _ in range(2))
    table = torch.randperm(num_pages, device="cuda", dtype=torch.int32)[:b * 4].view(b, 4).contiguous()
    cache_seqlens = torch.tensor([200, 65, 256], device="cuda", dtype=torch.int32)
    seq_lens_q = None if sq == 1 else torch.tensor(q_lens, device="cuda", dtype=torch.int32)
    results = {}
    for path in ("native", "python"):
        with monkeypatch.context() as m:
            if path == "python":
                take_python_path(m)
            poison_allocator()
            results[path] = fastattn.torch.attention_paged(q, k_cache, v_cache, table, cache_seqlens,
                                                           seq_lens_q=seq_lens_q, causal_bottom_right=bottom_right)
        torch.cuda.synchronize()
    assert torch.isfinite(results["native"]).all()
    assert torch.equal(results["native"], results["python"])


def test_a_hit_runs_no_python(lib):
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    forward = _native.DENSE[0]
    args = (q, k, v, None, None, None, None, None, "bshd", True, False, -1, -1, 0.0, False, False, False, 0.0, False)
    forward(*args)  # the miss: Python builds or finds the plan
    python_calls = []

    def profile(frame, event, arg):
        if event == "call":
            python_calls.append(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        for _ in range(10):
            forward(*args)
    finally:
        sys.setprofile(None)
    assert python_calls == []


def test_the_eager_entry_runs_no_python_on_a_hit(lib):
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    # attention()'s own arguments, in its order (causal, bshd), as its C entry takes them.
    args = (q, k, v, True, False, None, None, "bshd", False, None, None, False, None, 0.0, None, "top_left", False,
            0.0)
    torch.autograd.grad(_native.CALL(*args), (q, k, v), torch.ones_like(q))  # the misses
    python_calls = []

    def profile(frame, event, arg):
        if event == "call":
            python_calls.append(frame.f_code.co_qualname)

    inference = tuple(t.detach() for t in (q, k, v)) + args[3:]  # no gradients: the inference call
    _native.CALL(*inference)
    sys.setprofile(profile)
    try:
        for _ in range(5):
            _native.CALL(*inference)
            _native.CALL(*args)  # the training forward: the C++ autograd node
    finally:
        sys.setprofile(None)
    assert python_calls == []
    # attention() itself: its own frame and dynamo's flag (torch.compiler's), then the C
    # entry (call), for inference and training.
    frames = []

    def profile_frames(frame, event, arg):
        if event == "call":
            frames.append((frame.f_code.co_qualname, frame.f_code.co_filename))

    def calls():
        fastattn.torch.attention(*inference[:3], causal=True)
        fastattn.torch.attention(q, k, v, causal=True, window=(64, 0), scale=0.125)

    calls()  # the second call's misses
    sys.setprofile(profile_frames)
    try:
        for _ in range(5):
            calls()
    finally:
        sys.setprofile(None)
    frames = [(name, file) for name, file in frames if file != __file__]  # calls() itself
    ours = {(name, Path(file).name) for name, file in frames if "fastattn" in file}
    theirs = {Path(file).parent.name for name, file in frames if "fastattn" not in file}
    assert ours == {("attention", "_api.py")} and theirs <= {"compiler"}, frames


@pytest.mark.parametrize("training", (False, True), ids=("inference", "training"))
def test_the_eager_entry_and_the_dispatcher_op_agree_bitwise(lib, training):
    # attention()'s plain eager calls take the eager entry; traced or moded calls the
    # dispatcher's op, whose autograd node runs the backward through the dispatcher.
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 200, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    d_o = torch.randn_like(q)
    results = []
    for call in ("call", "dispatcher"):
        leaves = [t.clone().requires_grad_(training) for t in (q, k, v)]
        poison_allocator()
        if call == "call":  # attention()'s own arguments, read in C
            o = _native.CALL(*leaves, True, False, (16, 0), None, "bshd", True, None, None, False, None, 0.0, None,
                             "top_left", False, 0.0)
        else:
            o = _native.DENSE[0](*leaves, None, None, None, None, None, "bshd", True, False, 16, 0, 0.0, True, False,
                                 training, 0.0, False)[0]
        grads = torch.autograd.grad(o, leaves, d_o) if training else ()
        torch.cuda.synchronize()
        results.append((o, grads))
    (o1, g1), *others = results
    assert torch.isfinite(o1).all()
    for o2, g2 in others:
        assert torch.equal(o1, o2)
        for a, b in zip(g1, g2):
            assert torch.isfinite(a).all() and torch.equal(a, b)


def test_a_training_step_looks_up_each_plan_once(lib, monkeypatch):
    # Misses call _dense.plan_for through the C++ table's handler: after the first step
    # (one forward and one backward miss), steps are Python-free hits.
    calls = []
    original = _dense.plan_for
    monkeypatch.setattr(_dense, "plan_for", lambda *a: calls.append(1) or original(*a))
    q, k, v = (torch.randn(1, 328, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    steps = []
    for _ in range(5):
        o = fastattn.torch.attention(q, k, v, causal=True)
        o.sum().backward()
        steps.append(len(calls))
    torch.cuda.synchronize()
    assert steps[0] <= 2 and steps == [steps[0]] * 5  # a shape no other test uses: 2, the forward's and backward's


def test_torch_compile_fullgraph_records_the_native_op(lib):
    torch.manual_seed(0)
    block = Block().cuda().to(torch.bfloat16)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(block, backend=backend, fullgraph=True)
    inductor = torch.compile(block, fullgraph=True)
    for s in (128, 256):
        x = torch.randn(2, s, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y_eager = block(x)
        g_eager = torch.autograd.grad(y_eager.sum(), x)[0]
        for fn in (compiled, inductor):
            y = fn(x)
            assert rel(y, y_eager) < 1e-2
            assert rel(torch.autograd.grad(y.sum(), x)[0], g_eager) < 2e-2
    assert any("native_attention_forward" in t for t in seen), seen
    assert not any(t.endswith("attention_forward") and "native" not in t for t in seen), seen


def test_cuda_graph_captures_a_training_step_and_replays_new_inputs(lib):
    shape = (1, 256, 8, 64)
    static = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    d_o = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: plans built
            o = fastattn.torch.attention(*static, causal=True, deterministic=True)
            torch.autograd.grad(o, static, d_o)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    kept = lib.kept_workspace_bytes()
    with torch.cuda.graph(graph):
        out = fastattn.torch.attention(*static, causal=True, deterministic=True)
        grads = torch.autograd.grad(out, static, d_o)
    # A capturing stream takes its workspace from the graph's pool, never a kept one.
    assert lib.kept_workspace_bytes() == kept
    for _ in range(3):
        fresh = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
        graph.replay()
        fresh = [f.requires_grad_() for f in fresh]
        expected = fastattn.torch.attention(*fresh, causal=True, deterministic=True)
        expected_grads = torch.autograd.grad(expected, fresh, d_o)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))


def test_the_workspace_is_kept_per_stream_and_reused(lib):
    torch.manual_seed(5)
    shape = (1, 256, 8, 128)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    d_o = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    options = _dense.DenseOptions(layout="bshd", causal=True, bottom_right=False, window_left=-1, window_right=-1,
                                  scale=0.0, deterministic=True, alibi=False, training=True, dropout=0.0,
                                  bias_grad=False)
    c = _dense.plan_for(q, k, v, None, None, None, None, None, None, options)
    need = max(c.forward_workspace, c.backward_workspace)
    assert 0 < need <= 16 << 20, need  # this shape's backward has one, small enough to keep

    def step():
        poison_allocator()
        o = fastattn.torch.attention(q, k, v, causal=True, deterministic=True)
        return (o, *torch.autograd.grad(o, (q, k, v), d_o))

    torch.cuda.synchronize()
    lib.clear()
    assert lib.kept_workspace_bytes() == 0
    first = step()
    kept = lib.kept_workspace_bytes()
    assert kept >= need
    second = step()
    assert lib.kept_workspace_bytes() == kept  # reused, not grown
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        third = step()  # a stream of its own: its own workspace
    torch.cuda.current_stream().wait_stream(side)
    assert lib.kept_workspace_bytes() == 2 * kept
    other = []
    worker = threading.Thread(target=lambda: other.append(step()))  # a thread of its own: its own too
    worker.start()
    worker.join()
    deadline = time.monotonic() + 5  # ... released when the thread exits (its C++ thread_locals are
    while lib.kept_workspace_bytes() != 2 * kept and time.monotonic() < deadline:  # destroyed after join())
        time.sleep(0.01)
    assert lib.kept_workspace_bytes() == 2 * kept
    torch.cuda.synchronize()
    for a, b, c, d in zip(first, second, third, other[0]):
        assert torch.isfinite(a).all() and torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    lib.clear()
    assert lib.kept_workspace_bytes() == 0


def test_sixteen_threads_on_new_shapes_build_each_plan_once(lib):
    # Four shapes no other test uses, each called by four threads at once, released
    # together: the table is shared, misses race, the runtime builds each plan once.
    shapes = [(1, 200 + 8 * i, 4, 64) for i in range(4)]  # in no other test: the session's cache has none
    inputs = {s: [torch.randn(s, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for s in shapes}
    torch.cuda.synchronize()
    before = runtime.stats()
    outs = in_threads(16, lambda i: fastattn.torch.attention(*inputs[shapes[i % 4]], causal=True))
    after = runtime.stats()
    made = (after["builds"] - before["builds"]) + (after["deserializations"] - before["deserializations"])
    assert made == 4
    for i, o in outs.items():
        assert torch.equal(o, fastattn.torch.attention(*inputs[shapes[i % 4]], causal=True))
