"""GPU: fastattn.torch against PyTorch's math in float64, torch.compile, CUDA graphs."""

import functools
import itertools

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402,F401
from fastattn.torch import _dense, _executor, _native, _paged, _plans, _varlen  # noqa: E402
from fastattn import AttentionConfig  # noqa: E402

from helpers.gpu import alibi_slopes, allowed, softcap_with_lengths_refused  # noqa: E402
from helpers.torch import PYTHON_PATH_CODE, Block, in_threads, take_python_path, ulps_apart  # noqa: E402

FWD_TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
BWD_TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
AXES = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}


@pytest.fixture(autouse=True, params=("native", "python"))
def torch_path(request, monkeypatch):
    """Every test on both of fastattn.torch's paths: the C++ op library (attention(),
    attention_varlen(), attention_paged()) and the Python path. On the GPU machine the
    native path must load: no silent fallback."""
    if request.param == "python":
        take_python_path(monkeypatch)
    else:
        assert _native.library() is not None, _native.status()
        _native._publish_ops()
    return request.param


def to_bhsd(t, layout):
    return t.permute(*AXES[layout])


def from_bhsd_shape(shape, layout):
    b, h, s, d = shape
    return {"bshd": (b, s, h, d), "sbhd": (s, b, h, d), "bhsd": (b, h, s, d)}[layout]


def reference(q, k, v, cfg, layout):
    """float64 attention on (b, h, s, d) views; GQA by repeating k and v."""
    q64, k64, v64 = (to_bhsd(t, layout).double() for t in (q, k, v))
    group = q64.shape[1] // k64.shape[1]
    k64, v64 = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    mask = torch.from_numpy(allowed(cfg)).to(q.device)
    s = cfg.scale * q64 @ k64.transpose(-1, -2)
    if cfg.softcap:
        s = cfg.softcap * torch.tanh(s / cfg.softcap)
    if cfg.alibi:
        i = torch.arange(cfg.seqlen_q, device=q.device)[:, None]
        j = torch.arange(cfg.seqlen_kv, device=q.device)[None, :]
        s = s + torch.from_numpy(alibi_slopes(cfg.heads_q)).to(q.device)[None, :, None, None] * (j - i)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return p @ v64


def rel(a, b):
    a = a.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


CASES = list(itertools.product(
    (torch.float16, torch.bfloat16),
    (("none", 200, 200, None), ("causal", 200, 200, None), ("causal_bottom_right", 100, 300, None),
     ("causal", 200, 200, (47, 0))),
    ((4, 4), (4, 2), (4, 1)),
    ((128, 128), (128, 64)),
    ("bshd", "bhsd"),
))


@pytest.mark.parametrize("dtype,mask,heads,dims,layout", CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1][0]}-{c[1][3]}-{c[2]}-{c[3]}-{c[4]}" for c in CASES])
def test_forward_and_gradients_match_float64(dtype, mask, heads, dims, layout):
    mask_name, sq, skv, window = mask
    (hq, hkv), (dqk, dv) = heads, dims
    cfg = AttentionConfig(batch=2, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_kv=skv, head_dim_qk=dqk,
                          head_dim_v=dv, mask=mask_name, window=window)
    dev = "cuda"
    q = torch.randn(from_bhsd_shape((2, hq, sq, dqk), layout), device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(from_bhsd_shape((2, hkv, skv, dqk), layout), device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(from_bhsd_shape((2, hkv, skv, dv), layout), device=dev, dtype=dtype, requires_grad=True)
    o = fastattn.torch.attention(q, k, v, causal=mask_name == "causal",
                                 causal_bottom_right=mask_name == "causal_bottom_right", window=window, layout=layout)
    ref = reference(q.detach(), k.detach(), v.detach(), cfg, layout)
    assert rel(to_bhsd(o, layout), ref) < FWD_TOL[dtype]
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), d_o)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, cfg, layout)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), to_bhsd(d_o, layout).double())
    for g, rg in zip(grads, ref_grads):
        assert rel(g, rg) < BWD_TOL[dtype]


@pytest.mark.parametrize("mask,layout,padded", [("causal", "bshd", False), ("causal_bottom_right", "bhsd", True),
                                                ("none", "bhsd", False)])
def test_softcap_forward_and_gradients_match_float64(mask, layout, padded):
    # Both paths (the fixture): the C entry reads softcap, the Python body checks it. The
    # padded case runs the padding mask inside the score modifier (apply_softcap).
    dtype, sq, skv = torch.bfloat16, 160, 224
    cfg = AttentionConfig(batch=2, heads_q=4, heads_kv=2, seqlen_q=sq, seqlen_kv=skv, head_dim_qk=64, mask=mask,
                          softcap=3.0)
    q = (torch.randn(from_bhsd_shape((2, 4, sq, 64), layout), device="cuda") * 5).to(dtype).requires_grad_()
    k, v = (torch.randn(from_bhsd_shape((2, 2, skv, 64), layout), device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(2))
    lens = torch.full((2,), sq, device="cuda", dtype=torch.int32) if padded else None
    lens_kv = torch.full((2,), skv, device="cuda", dtype=torch.int32) if padded else None
    call = functools.partial(fastattn.torch.attention, q, k, v, causal=mask == "causal",
                             causal_bottom_right=mask == "causal_bottom_right", layout=layout, softcap=3.0,
                             seq_lens_q=lens, seq_lens_kv=lens_kv)
    gap = softcap_with_lengths_refused() if padded else None
    if gap:  # cuDNN's refusal on this release, with the known gap's note beside its reason
        with pytest.raises(fastattn.NotSupportedError, match=f"known cuDNN gap {gap}"):
            call()
        return
    o = call()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, cfg, layout)
    assert rel(to_bhsd(o, layout), ref) < FWD_TOL[dtype]
    uncapped = reference(q64, k64, v64, cfg.replace(softcap=None), layout)
    assert rel(uncapped.detach(), ref.detach()) > 10 * FWD_TOL[dtype]  # the cap bites
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), d_o)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), to_bhsd(d_o, layout).double())
    for g, rg in zip(grads, ref_grads):
        assert rel(g, rg) < BWD_TOL[dtype]
    with pytest.raises(fastattn.InvalidArgumentError, match="softcap=-1.0"):
        fastattn.torch.attention(q, k, v, softcap=-1.0, layout=layout)


def test_cuda_tensor_mismatched_devices_and_cpu_errors():
    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(fastattn.InvalidArgumentError, match="on cpu"):
        fastattn.torch.attention(q, q.cpu(), q)


def test_deterministic_backward_is_bitwise_stable():
    q, k, v = (torch.randn(2, 512, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (8, 2, 2))
    o = fastattn.torch.attention(q, k, v, causal=True, deterministic=True)
    d_o = torch.randn_like(o)
    first = torch.autograd.grad(o, (q, k, v), d_o, retain_graph=True)
    for _ in range(2):
        again = torch.autograd.grad(o, (q, k, v), d_o, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    block = Block().cuda().to(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    for s in (128, 256):  # a new shape must not break the graph
        x = torch.randn(2, s, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y_eager = block(x)
        y_comp = compiled(x)
        assert rel(y_comp, y_eager.double()) < 1e-2
        g_eager = torch.autograd.grad(y_eager.sum(), x)[0]
        g_comp = torch.autograd.grad(y_comp.sum(), x)[0]
        assert rel(g_comp, g_eager.double()) < 2e-2


def test_jit_trace_records_attention_and_replays_it_on_new_inputs():
    # torch.jit.trace records only calls that reach PyTorch's dispatcher: a traced call
    # must take the custom ops, not an eager entry the tracer cannot see (whose output
    # the trace would keep as a constant).
    import warnings

    def f(q, k, v):
        return fastattn.torch.attention(q, k, v, causal=True)

    shape = (1, 128, 4, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(f, (q, k, v), check_trace=False)
    assert "fastattn::" in str(traced.graph)
    q2, k2, v2 = (torch.randn_like(q) for _ in range(3))
    assert torch.equal(traced(q2, k2, v2), f(q2, k2, v2))


def test_cuda_graph_capture_and_replay():
    shape = (1, 256, 8, 64)
    static = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fastattn.torch.attention(*static, causal=True)  # warm-up: plan built, workspace sized
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    kept = dict(_plans.workspaces)
    with torch.cuda.graph(graph):
        out = fastattn.torch.attention(*static, causal=True)
    assert _plans.workspaces == kept  # a graph replays on any stream: it owns its workspace
    for _ in range(3):
        fresh = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        expected = fastattn.torch.attention(*fresh, causal=True)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


_ALIBI_CAPTURE = """
import sys, torch, fastattn.torch
if sys.argv[1] == "python":
    TAKE_PYTHON_PATH
shape = (1, 256, 8, 64)
static = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.no_grad(), torch.cuda.stream(stream):
    fastattn.torch.attention(*static, causal=True, alibi=True)  # warm-up: the plan exists
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.no_grad(), torch.cuda.graph(graph):
    out = fastattn.torch.attention(*static, causal=True, alibi=True)
for _ in range(4):
    churn = [torch.full((n,), 1e4 + n) for n in range(1, 64) for _ in range(8)]  # small host blocks, other values
    for s in static:
        s.copy_(torch.randn_like(s))
    graph.replay()
    with torch.no_grad():
        expected = fastattn.torch.attention(*static, causal=True, alibi=True)
    torch.cuda.synchronize()
    del churn
    if not torch.equal(out, expected):
        sys.exit(f"a replay differs from eager by up to {(out.float() - expected.float()).abs().max().item():.3g}")
print("ok")
""".replace("TAKE_PYTHON_PATH", PYTHON_PATH_CODE)


def test_alibi_captured_in_a_cuda_graph_replays_what_eager_computes(torch_path, tmp_path):
    # cudnn-frontend writes ALiBi's slopes into the workspace per execute with a
    # host-to-device copy from a copy it frees at once (graph_interface.h,
    # run_auxiliary_kernels: `for (auto [uid, data] : ...)`). Eagerly the copy is staged
    # before it returns; a caller's capture records the host address instead, which later
    # host allocations may reuse (host memory is churned with other values between
    # replays, to give a stale address the chance to show), or refuses a pageable copy and
    # leaves the capture broken. In a process of its own: a broken capture must not stop
    # the suite.
    import os
    import subprocess
    import sys

    env = {**os.environ, "FASTATTN_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", _ALIBI_CAPTURE, torch_path], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def test_the_custom_ops_and_the_eager_path_agree_bitwise():
    # Plain eager calls skip the custom ops' wrappers (_executor.Train); torch.compile and
    # tracing go through the ops. Both must compute the same thing.
    q, k, v = (torch.randn(2, 192, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2))
    d_o = torch.randn(2, 192, 8, 64, device="cuda", dtype=torch.bfloat16)
    o = fastattn.torch.attention(q, k, v, causal=True, deterministic=True)
    grads = torch.autograd.grad(o, (q, k, v), d_o)
    o_op = _dense.forward_op(q, k, v, None, None, None, None, None, "bshd", True, False, -1, -1, 0.0, True, False, True,
                             0.0, False)[0]
    assert torch.equal(o, o_op)
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(o_op, (q, k, v), d_o)))
    cu = torch.tensor([0, 100, 250, 384], device="cuda", dtype=torch.int32)
    flat = [t.detach().reshape(-1, *t.shape[2:]).requires_grad_() for t in (q, k, v)]
    o = fastattn.torch.attention_varlen(*flat, cu, cu, 150, 150, causal=True, deterministic=True)
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, flat, d_o)
    o_op = _varlen.forward_op(*flat, cu, cu, None, None, 256, 256, True, False, -1, -1, 0.0, True, True, False, 0.0)[0]
    assert torch.equal(o, o_op)
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(o_op, flat, d_o)))



@pytest.mark.parametrize("feature", ("bias_sinks", "dropout", "padding"))
def test_the_custom_ops_and_the_eager_path_agree_with_every_feature(feature):
    # The tensors and options that travel by name (DenseOptions, _specs.DENSE): the same
    # inputs through _executor.Train and through the custom ops give the same output and
    # gradients, each on its own input. Backward is not deterministic here (cuDNN's
    # deterministic mode does not cover every feature): gradients agree to rounding.
    b, s, hq, hkv, d, dtype = 2, 160, 8, 2, 64, torch.float16
    if feature == "bias_sinks":
        fastattn.probe(AttentionConfig(batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=s, head_dim_qk=d, mask="causal"))
        if fastattn.versions()["cudnn_loaded"] < 91300:
            pytest.skip("sinks need cuDNN 9.13 (test_features_gpu checks the refusal)")
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))
    bias = sinks = rng = lengths = None
    if feature == "bias_sinks":
        bias = torch.randn(1, hq, s, s, device="cuda", dtype=dtype, requires_grad=True)
        sinks = torch.randn(hq, device="cuda", requires_grad=True)
    elif feature == "dropout":
        rng = torch.randint(0, 2**62, (4,), device="cuda", dtype=torch.int64)  # one mask for both paths
    else:
        lengths = torch.tensor([160, 77], device="cuda", dtype=torch.int32)
    options = _dense.DenseOptions(layout="bshd", causal=True, bottom_right=False, window_left=-1, window_right=-1,
                                  scale=0.0, deterministic=False, alibi=False, training=True,
                                  dropout=0.2 if rng is not None else 0.0, bias_grad=bias is not None)
    tensors = (q, k, v, lengths, lengths, bias, sinks, rng)
    leaves = [t for t in (q, k, v, bias, sinks) if t is not None]
    o = _executor.Train.apply(_dense, options, False, *tensors)
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, leaves, d_o)
    o_op = _dense.forward_op(*tensors, *options)[0]
    assert torch.equal(o, o_op)
    for g, g_op, t in zip(grads, torch.autograd.grad(o_op, leaves, d_o), leaves):
        assert g.shape == g_op.shape == t.shape
        assert rel(g_op, g.double()) < 1e-3

def test_threads_calling_on_one_stream_match_serial_calls(torch_path):
    # Eight threads, all on the default stream, each with its own inputs, calls in flight
    # at once: a workspace shared between threads on one stream would mix one call's
    # constants (copied into it at each launch) with another's kernels. Shapes whose
    # plans have a workspace, two of them, so that calls differ in more than pointers.
    shapes = [(1, 232, 4, 64), (1, 248, 4, 64)]  # not test_torch_native_gpu.py's 16-thread shapes
    inputs = [[torch.randn(shapes[i % 2], device="cuda", dtype=torch.bfloat16) for _ in range(3)] for i in range(8)]
    expected = [fastattn.torch.attention(*x, causal=True) for x in inputs]
    torch.cuda.synchronize()
    outs = in_threads(8, lambda i: [fastattn.torch.attention(*inputs[i], causal=True) for _ in range(20)])
    for i in range(8):
        assert all(torch.equal(o, expected[i]) for o in outs[i]), i


def test_calls_in_flight_on_two_streams_match_serial_calls(torch_path):
    # Each stream keeps its own workspace (_plans.workspace); calls running on two
    # streams at once must not share one. Forward is deterministic: results equal bitwise.
    inputs = [[torch.randn(2, 512, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(24)]
    expected = [fastattn.torch.attention(*x, causal=True) for x in inputs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    for i, x in enumerate(inputs):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(fastattn.torch.attention(*x, causal=True))
    torch.cuda.synchronize()
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert torch.equal(o, e), i
    plan = next(c for c in _plans.plans.values() if c.out_shape == [2, 512, 8, 64])
    if plan.forward_workspace and torch_path == "python":  # the native path keeps its own (in C++)
        kept = {key for key in _plans.workspaces if key[1] in {s.cuda_stream for s in streams}}
        assert len(kept) == 2


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
@pytest.mark.parametrize("causal", (False, True), ids=("none", "causal"))
def test_padding_matches_float64_per_sequence_and_zeroes_padded_rows(dtype, causal):
    lengths = [200, 77, 129]  # not multiples of 64
    b, s, hq, hkv, d = len(lengths), max(lengths), 4, 2, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for h in (hq, hkv, hkv))
    d_o = torch.randn(b, s, hq, d, device="cuda", dtype=dtype)
    for i, n in enumerate(lengths):  # large finite garbage: a kernel that lets it count is caught
        for t in (q, k, v, d_o):    # (not NaN: cuDNN multiplies padded rows by zero, see the README)
            t[i, n:] = torch.empty_like(t[i, n:]).uniform_(-3e4, 3e4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    seq = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    o = fastattn.torch.attention(q, k, v, causal=causal, seq_lens_q=seq)
    grads = torch.autograd.grad(o, (q, k, v), d_o)
    for i, n in enumerate(lengths):
        one = AttentionConfig(batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=n, head_dim_qk=d,
                              mask="causal" if causal else "none")
        q64, k64, v64 = (t[i:i + 1, :n].detach().double().requires_grad_() for t in (q, k, v))
        ref = reference(q64, k64, v64, one, "bshd")
        assert rel(to_bhsd(o[i:i + 1, :n], "bshd"), ref) < FWD_TOL[dtype]
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), to_bhsd(d_o[i:i + 1, :n], "bshd").double())
        for g, rg in zip(grads, ref_grads):
            assert rel(g[i:i + 1, :n], rg) < BWD_TOL[dtype]
        assert torch.all(o[i, n:] == 0) and all(torch.all(g[i, n:] == 0) for g in grads)


def test_alibi_matches_float64():
    cfg = AttentionConfig(batch=2, heads_q=8, heads_kv=2, seqlen_q=200, head_dim_qk=64, dtype="bf16", mask="causal",
                          alibi=True)
    q, k, v = (torch.randn(2, 200, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2))
    o = fastattn.torch.attention(q, k, v, causal=True, alibi=True)
    ref = reference(q.detach(), k.detach(), v.detach(), cfg, "bshd")
    assert rel(to_bhsd(o, "bshd"), ref) < FWD_TOL[torch.bfloat16]
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), d_o)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(reference(q64, k64, v64, cfg, "bshd"), (q64, k64, v64),
                                    to_bhsd(d_o, "bshd").double())
    for g, rg in zip(grads, ref_grads):
        assert rel(g, rg) < BWD_TOL[torch.bfloat16]


def reference_with_extras(q, k, v, cfg, layout, bias=None, sinks=None):
    """float64 attention with an additive bias and sinks (a logit per query head in
    every softmax denominator)."""
    q64, k64, v64 = (to_bhsd(t, layout).double() for t in (q, k, v))
    group = q64.shape[1] // k64.shape[1]
    k64, v64 = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    mask = torch.from_numpy(allowed(cfg)).to(q.device)
    s = cfg.scale * q64 @ k64.transpose(-1, -2)
    if bias is not None:
        s = s + bias.double()
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(s, dim=-1) @ v64
    column = sinks.double()[None, :, None, None].expand(*s.shape[:3], 1)
    return torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1] @ v64


@pytest.mark.parametrize("bias_shape", ((1, 8), (2, 1)), ids=("1hss", "b1ss"))
def test_bias_and_sinks_match_float64_with_their_gradients(bias_shape):
    b, s, hq, hkv, d, dtype = 2, 160, 8, 2, 64, torch.float16
    cfg = AttentionConfig(batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=s, head_dim_qk=d, mask="causal")
    fastattn.probe(cfg)  # loads cuDNN: its version is known from here on
    if fastattn.versions()["cudnn_loaded"] < 91300:
        pytest.skip("sinks need cuDNN 9.13 (test_features_gpu checks the refusal)")
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv))
    bias = torch.randn(*bias_shape, s, s, device="cuda", dtype=dtype, requires_grad=True)
    sinks = torch.randn(hq, device="cuda", requires_grad=True)
    o = fastattn.torch.attention(q, k, v, causal=True, bias=bias, sinks=sinks)
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, bias, sinks), d_o)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias, sinks)]
    ref = reference_with_extras(*leaves[:3], cfg, "bshd", bias=leaves[3], sinks=leaves[4])
    assert rel(to_bhsd(o, "bshd"), ref) < FWD_TOL[dtype]
    ref_grads = torch.autograd.grad(ref, leaves, to_bhsd(d_o, "bshd").double())
    for name, g, rg in zip(("d_q", "d_k", "d_v", "d_bias", "d_sinks"), grads, ref_grads):
        assert rel(g, rg) < BWD_TOL[dtype], name


def test_dropout_draws_from_torch_and_backward_uses_the_same_mask():
    # v[j] = e_j (seqlen <= head dim): o[i, j] is the dropped, rescaled weight, so o shows
    # the mask, and d_v must be o^T @ d_o if backward drops the same weights.
    b, s, h, d, p = 2, 64, 4, 64, 0.3
    q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16) for _ in range(2))
    v = torch.eye(s, d, device="cuda", dtype=torch.float16)[None, :, None, :].expand(b, s, h, d).contiguous()
    v.requires_grad_()
    torch.manual_seed(5)
    o = fastattn.torch.attention(q, k, v, dropout_p=p)
    torch.manual_seed(5)
    assert torch.equal(o, fastattn.torch.attention(q, k, v, dropout_p=p))  # the generator decides the mask
    dropped = (o.detach() == 0).double().mean().item()
    assert abs(dropped - p) < 5 * (p * (1 - p) / o.numel()) ** 0.5
    d_o = torch.randn_like(o)
    (d_v,) = torch.autograd.grad(o, (v,), d_o)
    w = to_bhsd(o.detach(), "bshd").double()  # (b, h, s_q, s_kv): the weights after dropout
    expected = w.transpose(-1, -2) @ to_bhsd(d_o, "bshd").double()
    assert rel(to_bhsd(d_v, "bshd"), expected) < BWD_TOL[torch.float16]
    assert not torch.equal(o, fastattn.torch.attention(q, k, v, dropout_p=p))  # a new draw, a new mask


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
@pytest.mark.parametrize("causal", (False, True), ids=("none", "causal"))
def test_varlen_matches_float64_per_sequence(dtype, causal):
    lengths_q, lengths_kv = [200, 77, 129, 1], [200, 100, 129, 33]
    hq, hkv, d = 8, 2, 128
    cu_q = torch.tensor([0] + lengths_q, device="cuda").cumsum(0).to(torch.int32)
    cu_kv = torch.tensor([0] + lengths_kv, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths_q), hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lengths_kv), hkv, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    o = fastattn.torch.attention_varlen(q, k, v, cu_q, cu_kv, max(lengths_q), max(lengths_kv), causal=causal)
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), d_o)
    # The float64 reference, one sequence at a time, packed back like the outputs. Compared
    # whole: a sequence's own reference can be exactly zero (the length-1 causal query
    # sees one key, so its d_q is 0), which a per-sequence relative error cannot take.
    ref_o, ref_dq, ref_dk, ref_dv = (torch.zeros(t.shape, device="cuda", dtype=torch.float64) for t in (o, q, k, v))
    for i, (lq, lk) in enumerate(zip(lengths_q, lengths_kv)):
        a, b = cu_q[i].item(), cu_kv[i].item()
        one = AttentionConfig(batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=lq, seqlen_kv=lk, head_dim_qk=d,
                              mask="causal" if causal else "none")
        leaves = [t.detach()[s:s + n][None].double().requires_grad_() for t, s, n in ((q, a, lq), (k, b, lk),
                                                                                      (v, b, lk))]
        ref = reference(*leaves, one, "bshd")
        ref_grads = torch.autograd.grad(ref, leaves, to_bhsd(d_o[a:a + lq][None], "bshd").double())
        ref_o[a:a + lq] = ref.detach().transpose(1, 2)[0]  # (1, h, s, d) -> (s, h, d)
        for full, s, n, rg in zip((ref_dq, ref_dk, ref_dv), (a, b, b), (lq, lk, lk), ref_grads):
            full[s:s + n] = rg[0]
    assert rel(o, ref_o) < FWD_TOL[dtype]
    for name, g, rg in zip(("d_q", "d_k", "d_v"), grads, (ref_dq, ref_dk, ref_dv)):
        assert rel(g, rg) < BWD_TOL[dtype], name
    # Batches of two sequences whose longest are 100 and then 120 share one plan (bucket 128).
    for cut, longest in ((50, 100), (30, 120)):
        before = fastattn.stats()["builds"]
        cu = torch.tensor([0, cut, 150], device="cuda", dtype=torch.int32)
        fastattn.torch.attention_varlen(q[:150], k[:150], v[:150], cu, cu, longest, longest, causal=causal)
    assert fastattn.stats()["builds"] == before


def test_varlen_with_sinks_matches_float64_with_their_gradients():
    # Packed sequences with sinks (gpt-oss under continuous batching): each sequence's queries
    # the last of its keys (causal at the bottom right), two of them one query (decode steps);
    # forward and every gradient, the sinks' included, against float64 per sequence. Then a
    # batch of single queries alone (max_seqlen_q 1: cuDNN refuses sinks in a graph of one
    # query, so the plan is declared for two).
    probe_cfg = AttentionConfig(batch=1, heads_q=8, heads_kv=2, seqlen_q=64, head_dim_qk=64, mask="causal")
    fastattn.probe(probe_cfg)  # loads cuDNN: its version is known from here on
    if fastattn.versions()["cudnn_loaded"] < 91300:
        pytest.skip("sinks need cuDNN 9.13 (test_features_gpu checks the refusal)")
    dtype, hq, hkv, d = torch.bfloat16, 8, 2, 64
    lengths_q, lengths_kv = [150, 1, 64, 1], [150, 90, 200, 33]
    cu_q = torch.tensor([0] + lengths_q, device="cuda").cumsum(0).to(torch.int32)
    cu_kv = torch.tensor([0] + lengths_kv, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths_q), hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lengths_kv), hkv, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    sinks = torch.randn(hq, device="cuda", requires_grad=True)
    o = fastattn.torch.attention_varlen(q, k, v, cu_q, cu_kv, max(lengths_q), max(lengths_kv), causal=True,
                                        alignment="bottom_right", sinks=sinks)
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, sinks), d_o)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref_o, loss = torch.zeros(o.shape, device="cuda", dtype=torch.float64), 0.0
    for i, (lq, lk) in enumerate(zip(lengths_q, lengths_kv)):
        a, b = cu_q[i].item(), cu_kv[i].item()
        one = AttentionConfig(batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=lq, seqlen_kv=lk, head_dim_qk=d,
                              mask="causal_bottom_right")
        ref = reference_with_extras(leaves[0][a:a + lq][None], leaves[1][b:b + lk][None], leaves[2][b:b + lk][None],
                                    one, "bshd", sinks=leaves[3])  # (1, h, s, d)
        ref_o[a:a + lq] = ref.detach()[0].transpose(0, 1)
        loss = loss + (ref[0].transpose(0, 1) * d_o[a:a + lq].double()).sum()
    ref_grads = torch.autograd.grad(loss, leaves)
    assert rel(o, ref_o) < FWD_TOL[dtype]
    for name, g, rg in zip(("d_q", "d_k", "d_v", "d_sinks"), grads, ref_grads):
        assert rel(g, rg) < BWD_TOL[dtype], name
    # A decode step: one query per sequence against its keys, inference.
    cu_one = torch.arange(5, device="cuda", dtype=torch.int32)
    with torch.no_grad():
        o = fastattn.torch.attention_varlen(q[:4], k, v, cu_one, cu_kv, 1, max(lengths_kv), causal=True,
                                            alignment="bottom_right", sinks=sinks)
    for i, lk in enumerate(lengths_kv):
        b = cu_kv[i].item()
        one = AttentionConfig(batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=1, seqlen_kv=lk, head_dim_qk=d,
                              mask="causal_bottom_right")
        ref = reference_with_extras(leaves[0][i:i + 1][None], leaves[1][b:b + lk][None], leaves[2][b:b + lk][None],
                                    one, "bshd", sinks=leaves[3])
        assert rel(o[i:i + 1], ref.detach()[0].transpose(0, 1)) < FWD_TOL[dtype], i


def paged_case(dtype, q_lens, kv_lens, hq=8, hkv=2, d=128, page=64, num_pages=20):
    """q, the page pools (shuffled pages, finite garbage wherever no sequence's token is),
    the block table, the lengths, and each sequence's KV laid out densely."""
    b, sq = len(q_lens), max(q_lens)
    per_seq = -(-max(kv_lens) // page)
    pools = [torch.empty(num_pages, page, hkv, d, device="cuda", dtype=dtype).uniform_(-3e4, 3e4) for _ in range(2)]
    order = torch.randperm(num_pages).tolist()
    table = torch.zeros(b, per_seq, dtype=torch.int32)
    dense = []
    for i, n in enumerate(kv_lens):
        k, v = (torch.randn(n, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
        dense.append((k, v))
        for j in range(-(-n // page)):
            p = order.pop()
            table[i, j] = p
            rows = slice(j * page, min(n, (j + 1) * page))
            pools[0][p, :rows.stop - rows.start] = k[rows]
            pools[1][p, :rows.stop - rows.start] = v[rows]
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    return q, pools[0], pools[1], table.cuda(), lens, dense


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
@pytest.mark.parametrize("q_lens,bottom_right", [((1, 1, 1), False), ((16, 5, 16), True)], ids=("decode", "prefill"))
def test_paged_matches_float64_per_sequence(dtype, q_lens, bottom_right):
    kv_lens = (300, 17, 129)
    q, k_cache, v_cache, table, lens, dense = paged_case(dtype, q_lens, kv_lens)
    uneven = len(set(q_lens)) > 1
    seq_q = torch.tensor(q_lens, dtype=torch.int32, device="cuda") if uneven else None
    with torch.no_grad():
        o = fastattn.torch.attention_paged(q, k_cache, v_cache, table, lens, seq_lens_q=seq_q,
                                           causal_bottom_right=bottom_right)
    for i, (lq, lk) in enumerate(zip(q_lens, kv_lens)):
        one = AttentionConfig(batch=1, heads_q=8, heads_kv=2, seqlen_q=lq, seqlen_kv=lk, head_dim_qk=128,
                              mask="causal_bottom_right" if bottom_right else "none")
        ref = reference(q[i:i + 1, :lq], dense[i][0][None], dense[i][1][None], one, "bshd")
        assert rel(to_bhsd(o[i:i + 1, :lq], "bshd"), ref) < FWD_TOL[dtype], i
        assert torch.all(o[i, lq:] == 0), i
    # New lengths and new data in the same shapes: the same plan.
    builds = fastattn.stats()["builds"]
    lens.copy_(torch.tensor((250, 64, 1), dtype=torch.int32))
    with torch.no_grad():
        fastattn.torch.attention_paged(q, k_cache, v_cache, table, lens, seq_lens_q=seq_q,
                                       causal_bottom_right=bottom_right)
    assert fastattn.stats()["builds"] == builds


def test_paged_decode_captures_in_a_cuda_graph_and_replays_new_lengths():
    q, k_cache, v_cache, table, lens, _ = paged_case(torch.bfloat16, (1, 1, 1), (300, 17, 129))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        fastattn.torch.attention_paged(q, k_cache, v_cache, table, lens)  # warm-up: the plan exists
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = fastattn.torch.attention_paged(q, k_cache, v_cache, table, lens)
    # cuDNN's paged decode is not bitwise repeatable, even between eager calls (an element
    # one bf16 ulp apart, one run in three): a replay is held to what attention_paged
    # promises, one ulp of o's dtype from an eager call; a replay that read stale lengths
    # or a stale query is off by far more. Many lengths: each round is a chance to see it.
    rng = torch.Generator().manual_seed(0)
    draws = [tuple(torch.randint(1, 321, (3,), generator=rng).tolist()) for _ in range(30)]
    for new_lens in ((1, 64, 320), (299, 5, 128), *draws):
        q.copy_(torch.randn_like(q))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        with torch.no_grad():
            expected = fastattn.torch.attention_paged(q, k_cache, v_cache, table, lens)
        torch.cuda.synchronize()
        again = lambda: fastattn.torch.attention_paged(q, k_cache, v_cache, table, lens)  # noqa: E731
        assert (ulps_apart(out, expected) <= 1).all(), f"lengths {new_lens}: {differences(out, expected, again, graph)}"


def differences(out, expected, again, graph) -> str:
    """What a replay and an eager call disagree on, and which suspect it points to: where
    and by how much; NaN on either side; whether eager calls agree with each other and a
    second replay with the first (a kernel that is not deterministic); whether an eager
    call agrees once the kept query lengths are made anew (a stray write into them) or
    with its kept workspace filled with 0xFF (a kernel reading stale workspace); the
    plan's engine; the threads alive (a leftover writer)."""
    import threading

    d = (out.float() - expected.float()).abs()
    rows = d.amax(dim=(1, 2, 3)).nonzero().flatten().tolist()
    ulps = ulps_apart(out, expected).nan_to_num(float("inf")).max().item()
    kept = {k: v.tolist() for k, v in _paged._full_lengths.items()}
    nan = (int(out.isnan().sum()), int(expected.isnan().sum()))  # torch.equal is False where both hold a NaN
    with torch.no_grad():
        eager_again = [torch.equal(expected, again()) for _ in range(3)]
        first = out.clone()
        graph.replay()
        torch.cuda.synchronize()
        replay_again = torch.equal(first, out)
        for ws in _plans.workspaces.values():
            ws.fill_(0xFF)
        stale_workspace = torch.equal(out, again())
        _paged._full_lengths.clear()
        fresh_lengths = torch.equal(out, again())
    engines = sorted({str(getattr(c.plan, "forward_engine", "?")) for key, c in _plans.plans.items()
                      if key and key[0] == "paged"})
    return (f"{int((d > 0).sum())} of {d.numel()} elements differ, up to {d.max().item():.3g} ({ulps:.3g} ulp), "
            f"in batch rows {rows}; "
            f"NaN in the replay, the eager call: {nan}; eager again equal: {eager_again}; replay again equal: "
            f"{replay_again}; eager equal to the replay with the workspace filled 0xFF: {stale_workspace}, with the "
            f"query lengths made anew: {fresh_lengths}; the query lengths kept: {kept}; paged engines {engines}; "
            f"threads {[t.name for t in threading.enumerate()]}")
