"""GPU: FP8 attention (fastattn.torch.attention_fp8 / attention_fp8_backward /
attention_fp8_scaled and the plans under them) against float64 references on the
dequantized inputs.

Error bounds, from FP8's precision. Inputs are exact in the reference (it takes the
FP8 values times their descales), so the error comes from the roundings inside and at
the end of the kernels: e4m3 keeps 3 mantissa bits (a rounding is off by at most 2**-4
relative, root-mean-square 2**-4 / sqrt(3) ~ 0.036 for uniform rounding), e5m2 keeps 2
(2**-3, RMS ~ 0.072).
- forward: P (the softmax probabilities) is rounded to e4m3 before P @ V, and o to its
  FP8 type: two roundings, RMS ~ 0.036 * sqrt(2) ~ 0.051 relative in the norm; we allow
  FWD_TOL = 0.09 (rounding of one row's P is correlated through the row's sum), and no
  element off by more than 2**-2 of the largest (a wrong element, not rounding).
- backward (gradients e5m2, TransformerEngine's hybrid recipe): P (e4m3), dP (e5m2) and
  the gradient itself (e5m2) are rounded, with O (e4m3) in D = rowsum(dO * O): RMS
  ~ sqrt(0.036**2 * 2 + 0.072**2 * 2) ~ 0.11; BWD_TOL = 0.2.
- amaxes: amax_s is taken on P before any FP8 rounding: equal to the reference's
  max P to relative 1e-2. amax_o and the gradients' amaxes are taken after FP8-rounded
  intermediates (P, dP), so they are held to their tensor's own bound (FWD_TOL, BWD_TOL
  relative), not 1e-2.
Outputs are poisoned (NaN bytes) before each run.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
from fastattn import AttentionConfig  # noqa: E402
from fastattn.torch import attention_fp8, attention_fp8_backward, attention_fp8_scaled  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FWD_TOL, BWD_TOL, AMAX_S_TOL = 0.09, 0.2, 1e-2
POISON = 0xFF  # NaN in e4m3fn (0x7f/0xff) and e5m2 (0xff), in float32 and bf16


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN's FP8 attention needs compute capability 9.0 or newer")


def poisoned(shape, dtype, like=None):
    t = torch.empty(shape, dtype=dtype, device="cuda") if like is None else torch.empty_strided(
        like.shape, like.stride(), dtype=dtype, device="cuda")
    t.view(torch.uint8).fill_(POISON)
    return t


def quantize(x, dtype, headroom=1.0):
    """(x in FP8, descale as a (1,) float32 tensor): x8 * descale ~ x."""
    scale = FP8_MAX[dtype] / (x.abs().amax().float() * headroom)
    return (x.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype), scale.reciprocal().reshape(1)


def one(value):
    return torch.full((1,), float(value), dtype=torch.float32, device="cuda")


def rel(a, b):
    a = a.double()
    assert torch.isfinite(a).all(), "non-finite values (poison left unwritten?)"
    return ((a - b).norm() / b.norm()).item()


def max_off(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def bhsd(t):  # bshd -> (b, h, s, d)
    return t.permute(0, 2, 1, 3)


def reference(q, k, v, d_o, causal, scale, lens=None):
    """float64 (o, p max, d_q, d_k, d_v) on bshd tensors (real values), GQA by repetition."""
    q, k, v = (bhsd(t).double().detach().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ kk.transpose(-1, -2)
    sq, skv = s.shape[-2:]
    mask = torch.ones(sq, skv, dtype=torch.bool, device="cuda")
    if causal:
        mask = torch.tril(mask)
    mask = mask.expand(s.shape).clone()
    if lens is not None:
        for b, n in enumerate(lens.tolist()):
            mask[b, :, :, n:] = False
            mask[b, :, n:, :] = False
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    o = p @ vv
    if d_o is None:
        return bhsd(o).detach(), p.max().item(), None
    o.backward(bhsd(d_o).double())
    return bhsd(o).detach(), p.max().item(), tuple(bhsd(t.grad) for t in (q, k, v))


def inputs(b, s, h, hkv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda hh: torch.randn((b, s, hh, d), generator=g, device="cuda")  # noqa: E731
    return make(h), make(hkv), make(hkv), torch.randn((b, s, h, d), generator=g, device="cuda")


CASES = [(causal, h, hkv, d) for causal in (False, True) for h, hkv in ((8, 8), (8, 2)) for d in (64, 128)]


def run_forward(q, k, v, causal, lens=None, training=False, out_dtype=E4M3, grad_dtype=E5M2):
    (q8, dq), (k8, dk), (v8, dv) = quantize(q, E4M3), quantize(k, E4M3), quantize(v, E4M3)
    scale_o = FP8_MAX[E4M3] / v.abs().amax().float().reshape(1)  # |o| <= max |v|
    out = attention_fp8(q8, k8, v8, dq, dk, dv, one(1 / 448), one(448), scale_o, causal=causal, seq_lens_q=lens,
                        training=training, grad_dtype=grad_dtype, out_dtype=out_dtype)
    real = lambda x8, d: x8.double() * d.double()  # noqa: E731
    return out, (q8, k8, v8), (dq, dk, dv), scale_o, (real(q8, dq), real(k8, dk), real(v8, dv))


@pytest.mark.parametrize("causal,h,hkv,d", CASES)
def test_forward_against_float64(causal, h, hkv, d):
    q, k, v, _ = inputs(2, 256, h, hkv, d, seed=hash((causal, h, hkv, d)) % 2**31)
    out, _, _, scale_o, real = run_forward(q, k, v, causal)
    o_ref, p_max, _ = reference(*real, None, causal, 1 / math.sqrt(d))
    o = out.o.double() / scale_o.double()
    assert rel(o, o_ref) < FWD_TOL and max_off(o, o_ref) < 0.25
    assert out.amax_s.item() == pytest.approx(p_max, rel=AMAX_S_TOL)
    assert out.amax_o.item() == pytest.approx(o_ref.abs().max().item(), rel=FWD_TOL)


@pytest.mark.parametrize("causal,h,hkv,d", [c for c in CASES if c[3] == 128])  # Hopper: d = 128 only (below)
def test_backward_against_float64(causal, h, hkv, d):
    q, k, v, d_o = inputs(2, 256, h, hkv, d, seed=1 + hash((causal, h, hkv, d)) % 2**31)
    out, (q8, k8, v8), (dq, dk, dv), scale_o, real = run_forward(q, k, v, causal, training=True)
    d_o8, ddo = quantize(d_o, E5M2)
    o_ref, _, grads_ref = reference(*real, d_o8.double() * ddo.double(), causal, 1 / math.sqrt(d))
    # Output scales from the reference's amaxes with 2x headroom: this test checks the
    # kernels, not a scaling policy (attention_fp8_scaled's is tested below).
    scales = [FP8_MAX[E5M2] / (2 * g.abs().max().item()) for g in grads_ref]
    b = d_o.double().norm(dim=-1).max().item() * v.double().norm(dim=-1).max().item()
    scale_dp = FP8_MAX[E5M2] / b
    g = attention_fp8_backward(d_o8, out.o, out.stats, q8, k8, v8, dq, dk, dv, scale_o.reciprocal(), ddo,
                               one(1 / 448), one(1 / scale_dp), one(448), one(scales[0]), one(scales[1]),
                               one(scales[2]), one(scale_dp), causal=causal)
    for name, got, scale, ref, amax in zip(("d_q", "d_k", "d_v"), g[:3], scales, grads_ref, g[3:6]):
        assert got.dtype == E5M2
        assert rel(got.double() / scale, ref) < BWD_TOL, name
        assert amax.item() == pytest.approx(ref.abs().max().item(), rel=BWD_TOL), name


def test_padding():
    q, k, v, _ = inputs(3, 256, 8, 2, 128, seed=7)
    lens = torch.tensor([256, 100, 17], dtype=torch.int32, device="cuda")
    for t in (q, k, v):  # padded rows finite (cuDNN reads them)
        t[1, 100:], t[2, 17:] = 0, 0
    # The block o is given next holds non-zero bytes: padded rows are zero because fastattn
    # zeroes them (cuDNN 9.19 leaves them unwritten, 9.28.1 computes them), not by chance.
    junk = [torch.full((q.numel(),), 0x5A, dtype=torch.uint8, device="cuda") for _ in range(8)]
    del junk
    out, _, _, scale_o, real = run_forward(q, k, v, True, lens=lens)
    o_ref, _, _ = reference(*real, None, True, 1 / math.sqrt(128), lens=lens)
    o = out.o.double() / scale_o.double()
    assert rel(o, o_ref) < FWD_TOL and (o[1, 100:] == 0).all() and (o[2, 17:] == 0).all()


def test_scales_are_applied_as_documented():
    # The same real inputs encoded with 4x the FP8 values and a quarter of the descale,
    # and o stored at twice scale_o, give the same attention: exact, as powers of two.
    q, k, v, _ = inputs(1, 128, 4, 4, 64, seed=11)
    (q8, dq), (k8, dk), (v8, dv) = (quantize(t, E4M3, headroom=8.0) for t in (q, k, v))
    scale_o = FP8_MAX[E4M3] / (4 * v.abs().amax().float().reshape(1))
    a = attention_fp8(q8, k8, v8, dq, dk, dv, one(1 / 448), one(448), scale_o, causal=True)
    x4 = lambda t: (t.float() * 4).to(E4M3)  # noqa: E731
    b = attention_fp8(x4(q8), x4(k8), x4(v8), dq / 4, dk / 4, dv / 4, one(1 / 448), one(448), scale_o * 2,
                      causal=True)
    # Exact wherever a's o is a normal e4m3 number (>= 2**-6); below, a's subnormals
    # have a coarser relative step than b's doubled values: one subnormal step apart.
    doubled, got = a.o.float() * 2, b.o.float()
    normal = a.o.float().abs() >= 2.0 ** -6
    assert torch.equal(got[normal], doubled[normal]) and normal.float().mean() > 0.9
    assert ((got - doubled).abs() <= 2.0 ** -8).all()
    assert torch.equal(a.amax_o, b.amax_o) and torch.equal(a.amax_s, b.amax_s)


def test_plans_survive_serialize_and_load_bit_for_bit():
    from fastattn import _core

    cfg = AttentionConfig(batch=1, heads_q=4, seqlen_q=256, head_dim_qk=128, dtype="fp8_e4m3", mask="causal",
                          training=True)
    built = fastattn.plan(cfg)
    fwd_blob, bwd_blob = built.serialize()
    loaded = _core.load_plan(cfg, built.device, fwd_blob, bwd_blob, built.forward_engine, built.backward_engine)
    q, k, v, _ = inputs(1, 256, 4, 4, 128, seed=5)
    (q8, dq), (k8, dk), (v8, dv) = (quantize(t, E4M3) for t in (q, k, v))
    scal = dict(descale_q=one(dq.item()), descale_k=one(dk.item()), descale_v=one(dv.item()), descale_s=one(1 / 448),
                scale_s=one(448), scale_o=one(448 / v.abs().max().item()))
    results = []
    for plan in (built, loaded):
        o, stats = poisoned(q8.shape, E4M3), poisoned((1, 4, 256, 1), torch.float32)
        amax_s, amax_o = poisoned((1,), torch.float32), poisoned((1,), torch.float32)
        ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
        plan.forward(q8.data_ptr(), k8.data_ptr(), v8.data_ptr(), o.data_ptr(), stats.data_ptr(), ws.data_ptr(),
                     torch.cuda.current_stream().cuda_stream,
                     **{n: t.data_ptr() for n, t in scal.items()}, amax_s=amax_s.data_ptr(), amax_o=amax_o.data_ptr())
        torch.cuda.synchronize()
        results.append((o.view(torch.uint8).clone(), stats.clone(), amax_s.clone(), amax_o.clone()))
    assert all(torch.equal(x, y) for x, y in zip(*results))


@pytest.mark.parametrize("cfg_kw,words", [
    (dict(bias="1hss"), ("bias",)),  # cuDNN: "SDPA FP8 does not support bias"
    # fastattn's own refusal (the frontend's FP8 backward has no ALiBi), made before the
    # forward is built: cuDNN 9.28.1 refuses that forward with "No valid execution plans built".
    (dict(alibi=True, mask="causal", training=True), ("backward: graph construction: sdpa_fp8_backward",)),
    # fastattn's own refusal, by the option's name (graphs.h's score_modifier): sdpa_fp8
    # has no score modifier, and a graph built without the cap would compute another function.
    (dict(softcap=30.0), ("softcap: fastattn's FP8 graphs",)),
    (dict(softcap=30.0, training=True), ("softcap: fastattn's FP8 graphs",)),
])
def test_a_refused_combination_gives_the_reason(cfg_kw, words):
    cfg = AttentionConfig(**{**dict(batch=1, heads_q=4, seqlen_q=256, head_dim_qk=128, dtype="fp8_e4m3"), **cfg_kw})
    result = fastattn.probe(cfg)
    assert not result.supported and any(w in result.reason for w in words), result.reason


def test_backward_head_dim_is_cudnns_call():
    # cudnn-frontend 1.28's FP8 backward takes head dim 128 only on Hopper (<= 128 on Blackwell).
    cfg = AttentionConfig(batch=1, heads_q=4, seqlen_q=256, head_dim_qk=64, dtype="fp8_e4m3", training=True)
    result = fastattn.probe(cfg)
    if torch.cuda.get_device_capability()[0] == 9:
        assert not result.supported and "128" in result.reason and result.reason.startswith("backward"), result.reason
    else:
        assert result.supported, result.reason


def test_sixteen_bit_output_is_cudnns_call():
    # cuDNN 9.19 takes HALF/BFLOAT16 output from FP8 inputs on Blackwell only: the probe
    # answers either way, with cuDNN's reason when it refuses.
    cfg = AttentionConfig(batch=1, heads_q=4, seqlen_q=256, head_dim_qk=128, dtype="fp8_e4m3", out_dtype="bf16")
    result = fastattn.probe(cfg)
    if torch.cuda.get_device_capability()[0] == 9:
        assert not result.supported and "BFLOAT16 output" in result.reason, result.reason
    else:
        assert result.supported, result.reason


def _scaled_reference(q, k, v, d_o, causal):
    o_ref, _, grads = reference(q.double(), k.double(), v.double(), d_o.double(), causal, 1 / math.sqrt(q.shape[-1]))
    return o_ref, grads


@pytest.mark.parametrize("causal", [False, True])
def test_scaled_helper_end_to_end(causal):
    # bf16 in and out through current scaling: the FP8 bounds above plus the inputs' own
    # e4m3 rounding (q, k, v, d_o: one more rounding each, RMS 0.036 / 0.072).
    q, k, v, d_o = (t.to(torch.bfloat16) for t in inputs(2, 256, 8, 2, 128, seed=int(causal) + 21))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = attention_fp8_scaled(q, k, v, causal=causal)
    o.backward(d_o)
    o_ref, grads = _scaled_reference(q, k, v, d_o, causal)
    assert o.dtype == torch.bfloat16 and rel(o, o_ref) < 0.12
    for name, got, ref in zip(("d_q", "d_k", "d_v"), (q.grad, k.grad, v.grad), grads):
        assert rel(got, ref) < 0.3, name


def test_scaled_helper_compiles_and_captures():
    q, k, v, d_o = (t.to(torch.bfloat16) for t in inputs(1, 256, 4, 4, 64, seed=31))
    eager = attention_fp8_scaled(q, k, v, causal=True)
    compiled = torch.compile(lambda a, b, c: attention_fp8_scaled(a, b, c, causal=True), fullgraph=True)
    # Inductor may fuse the scale arithmetic differently (one float32 ulp in a scale can
    # move an FP8 rounding): close, not bitwise.
    assert rel(compiled(q, k, v), eager.double()) < 1e-2
    static = [t.clone() for t in (q, k, v)]
    attention_fp8_scaled(*static, causal=True)  # warm: the plan exists before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention_fp8_scaled(*static, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_ragged_forward_or_cudnns_reason():
    # Packed sequences (THD): cuDNN decides. Supported: compared per sequence against
    # float64; refused: the reason must be about packed (THD / ragged) tensors.
    lens = [200, 56, 130]
    cfg = AttentionConfig(batch=3, heads_q=8, heads_kv=2, seqlen_q=256, head_dim_qk=128, dtype="fp8_e4m3",
                          mask="causal", padding=True, ragged=True, max_tokens_q=sum(lens), max_tokens_kv=sum(lens))
    result = fastattn.probe(cfg)
    if not result.supported:
        assert any(w in result.reason for w in ("THD", "ragged", "Ragged")), result.reason
        return
    plan = fastattn.plan(cfg)
    tokens = sum(lens)
    q, k, v, _ = inputs(1, tokens, 8, 2, 128, seed=41)
    (q8, dq), (k8, dk), (v8, dv) = (quantize(t[0], E4M3) for t in (q, k, v))
    scale_o = FP8_MAX[E4M3] / v.abs().amax().float().reshape(1)
    o = poisoned((tokens, 8, 128), E4M3)
    starts = [0, lens[0], lens[0] + lens[1], tokens]
    offsets = lambda h: torch.tensor([s * h * 128 for s in starts], dtype=torch.int32, device="cuda")  # noqa: E731
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    amax_s, amax_o = poisoned((1,), torch.float32), poisoned((1,), torch.float32)
    ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
    oq, okv = offsets(8), offsets(2)
    scal = dict(descale_q=dq, descale_k=dk, descale_v=dv, descale_s=one(1 / 448), scale_s=one(448), scale_o=scale_o)
    plan.forward(q8.data_ptr(), k8.data_ptr(), v8.data_ptr(), o.data_ptr(), 0, ws.data_ptr(),
                 torch.cuda.current_stream().cuda_stream, seq.data_ptr(), seq.data_ptr(), ragged_q=oq.data_ptr(),
                 ragged_k=okv.data_ptr(), ragged_v=okv.data_ptr(), ragged_o=oq.data_ptr(),
                 **{n: t.data_ptr() for n, t in scal.items()}, amax_s=amax_s.data_ptr(), amax_o=amax_o.data_ptr())
    torch.cuda.synchronize()
    for b, n in enumerate(lens):
        sl = slice(starts[b], starts[b] + n)
        real = [(x8[sl].double() * d.double())[None] for x8, d in ((q8, dq), (k8, dk), (v8, dv))]
        o_ref, _, _ = reference(*real, None, True, 1 / math.sqrt(128))
        assert rel(o[sl].double()[None] / scale_o.double(), o_ref) < FWD_TOL, f"sequence {b}"


def test_ragged_backward_on_hopper_is_refused_with_the_reason():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuDNN refuses FP8 THD backward on Hopper only")
    cfg = AttentionConfig(batch=2, heads_q=8, seqlen_q=256, head_dim_qk=128, dtype="fp8_e4m3", mask="causal",
                          padding=True, ragged=True, training=True)
    result = fastattn.probe(cfg)
    assert not result.supported and "THD" in result.reason, result.reason


def test_plan_takes_torch_fp8_tensors_as_checked_arrays():
    # Arrays instead of ints go through fastattn._arrays (DLPack): dtype, shape and device
    # checked against the config, FP8 and the float32 scalars included.
    cfg = AttentionConfig(batch=1, heads_q=4, seqlen_q=128, head_dim_qk=64, dtype="fp8_e4m3", mask="causal")
    plan = fastattn.plan(cfg)
    q, k, v, _ = inputs(1, 128, 4, 4, 64, seed=51)
    (q8, dq), (k8, dk), (v8, dv) = (quantize(t, E4M3) for t in (q, k, v))
    o, amax_s, amax_o = poisoned(q8.shape, E4M3), poisoned((1, 1, 1, 1), torch.float32), poisoned((1, 1, 1, 1),
                                                                                                  torch.float32)
    scale_o = (FP8_MAX[E4M3] / v.abs().amax().float()).reshape(1, 1, 1, 1)
    ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
    scal = dict(descale_q=dq.reshape(1, 1, 1, 1), descale_k=dk.reshape(1, 1, 1, 1), descale_v=dv.reshape(1, 1, 1, 1),
                descale_s=one(1 / 448).reshape(1, 1, 1, 1), scale_s=one(448).reshape(1, 1, 1, 1), scale_o=scale_o)
    plan.forward(q8, k8, v8, o, workspace=ws, stream=torch.cuda.current_stream().cuda_stream, **scal, amax_s=amax_s,
                 amax_o=amax_o)
    torch.cuda.synchronize()
    real = [x8.double() * d.double() for x8, d in ((q8, dq), (k8, dk), (v8, dv))]
    o_ref, _, _ = reference(*real, None, True, 1 / math.sqrt(64))
    assert rel(o.double() / scale_o.double().reshape(1), o_ref) < FWD_TOL
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^q: dtype"):
        plan.forward(q.to(torch.bfloat16), k8, v8, o, workspace=ws, **scal, amax_s=amax_s, amax_o=amax_o)


def test_e5m2_inputs_or_cudnns_reason():
    # e5m2 q, k, v (2 mantissa bits: twice e4m3's rounding, FWD_TOL doubled).
    cfg = AttentionConfig(batch=1, heads_q=4, seqlen_q=256, head_dim_qk=128, dtype="fp8_e5m2", mask="causal")
    result = fastattn.probe(cfg)
    if not result.supported:
        assert result.reason, "refused without a reason"
        return
    q, k, v, _ = inputs(1, 256, 4, 4, 128, seed=61)
    (q8, dq), (k8, dk), (v8, dv) = (quantize(t, E5M2) for t in (q, k, v))
    scale_o = FP8_MAX[E5M2] / v.abs().amax().float().reshape(1)
    out = attention_fp8(q8, k8, v8, dq, dk, dv, one(1 / 448), one(448), scale_o, causal=True)
    real = [x8.double() * d.double() for x8, d in ((q8, dq), (k8, dk), (v8, dv))]
    o_ref, _, _ = reference(*real, None, True, 1 / math.sqrt(128))
    assert out.o.dtype == E5M2 and rel(out.o.double() / scale_o.double(), o_ref) < 2 * FWD_TOL


def test_scaled_helper_trains_under_torch_compile():
    q, k, v, d_o = (t.to(torch.bfloat16) for t in inputs(1, 256, 4, 4, 128, seed=71))

    compiled_fn = torch.compile(lambda a, b, c: attention_fp8_scaled(a, b, c, causal=True), fullgraph=True)
    results = []
    for fn in (lambda a, b, c: attention_fp8_scaled(a, b, c, causal=True), compiled_fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = fn(*leaves)
        results.append((o, *torch.autograd.grad(o, leaves, d_o)))  # backward through the compiled graph's
    eager, compiled = results
    for name, got, want in zip(("o", "d_q", "d_k", "d_v"), compiled, eager):
        assert rel(got, want.double()) < 1e-2, name  # see test_scaled_helper_compiles_and_captures
