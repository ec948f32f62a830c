"""GPU: fastattn.flash against a float64 reference written from FlashAttention 2's
documented semantics (helpers.gpu.fa_allowed: bottom-right causal and windows, FA's
normalizations; a row that sees no key has out 0 and softmax_lse +inf, as FA writes), on
fresh random inputs, with PyTorch's caching allocator poisoned (NaN bytes) before each
call so that an unwritten output element shows.

Tolerances (relative Frobenius error, as test_torch_gpu.py): out fp16 4e-3 / bf16 2e-2,
gradients 1e-2 / 4e-2, softmax_lse 1e-3 on rows that see a key (float32 stats of the same
rounded inputs)."""

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402,F401
from fastattn import flash  # noqa: E402

from helpers.gpu import fa_allowed, softcap_with_lengths_refused  # noqa: E402

FWD_TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
BWD_TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
LSE_TOL = 1e-3
DEV = "cuda"


def poison():
    """NaN bytes in memory the caching allocator hands out next (0xFF.. is NaN in fp16,
    bf16 and fp32)."""
    x = torch.empty(256 << 20, dtype=torch.uint8, device=DEV).fill_(0xFF)
    del x


def reference(q, k, v, causal, window, scale=None, alibi=None, seqlen_k=None, softcap=0.0):
    """FlashAttention in float64 on dense (b, s, h, d) tensors, every sequence at full
    length: (out (b, sq, h, dv), lse (b, h, sq)). GQA by repeating k and v; alibi: FA's
    bias -slope * |i + sk - sq - j|, slopes (h,) or (b, h); softcap: FA's softcap *
    tanh(score / softcap) on the scaled scores, before the bias and the mask."""
    q, k, v = (t.double() for t in (q, k, v))
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qh = q.permute(0, 2, 1, 3)
    kh, vh = (t.permute(0, 2, 1, 3).repeat_interleave(h // hk, 1) for t in (k, v))
    s = scale * qh @ kh.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    if alibi is not None:
        s = s - alibi.double()[..., None, None] * (i + sk - sq - j).abs()
    mask = torch.from_numpy(fa_allowed(sq, sk, causal, window, seqlen_k)).to(q.device)
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    p = e / torch.where(l > 0, l, torch.ones_like(l))
    out = (p @ vh).permute(0, 2, 1, 3)
    lse = torch.where(l > 0, m + l.log(), torch.full_like(l, float("inf"))).squeeze(-1)
    return out, lse


def rel(a, b):
    a = a.double()
    assert torch.isfinite(a).all(), "non-finite output (an unwritten or poisoned element)"
    if b.norm() == 0:  # an exactly zero reference (a query that sees one key has d_q = 0): absolute
        return (a - b).abs().max().item()
    return ((a - b).norm() / b.norm()).item()


def check_lse(lse, ref):
    assert lse.dtype == torch.float32 and lse.shape == ref.shape
    finite = torch.isfinite(ref)
    assert torch.all(lse[~finite] == float("inf")), "a row that sees no key: FlashAttention's lse is +inf"
    if finite.any():
        assert rel(lse[finite], ref[finite]) < LSE_TOL


def randn(*shape, dtype, grad=False):
    return torch.randn(*shape, device=DEV, dtype=dtype, requires_grad=grad)


def check_grads(out, ref_out, inputs, ref_inputs, dtype):
    d_o = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, d_o)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, d_o.double())
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel(g, rg) < BWD_TOL[dtype], name


def cumulative(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)


# -- flash_attn_func ----------------------------------------------------------------------------

SHAPES = ((128, 128), (100, 257), (257, 100), (1, 200))  # seqlen_q =, <, > seqlen_k; a decode row
MASKS = ((False, (-1, -1)), (True, (-1, -1)), (False, (16, 8)), (True, (16, -1)), (False, (-1, 0)), (False, (0, 0)),
         (False, (7, 10000)), (True, (10000, 5)), (False, (3, -1)))
HEADS = ((8, 8), (8, 2), (8, 1))
DENSE = list(itertools.product((torch.float16, torch.bfloat16), SHAPES, MASKS))


@pytest.mark.parametrize("dtype,shape,mask", DENSE, ids=[f"{str(c[0])[6:]}-{c[1][0]}x{c[1][1]}-c{int(c[2][0])}-"
                                                         f"w{c[2][1][0]},{c[2][1][1]}" for c in DENSE])
def test_flash_attn_func_matches_flash_attentions_semantics(dtype, shape, mask):
    (sq, sk), (causal, window) = shape, mask
    hq, hk = HEADS[DENSE.index((dtype, shape, mask)) % len(HEADS)]  # GQA / MQA across the cases
    torch.manual_seed(hash((sq, sk, causal, window)) % 2**31)
    q, k, v = randn(2, sq, hq, 64, dtype=dtype, grad=True), randn(2, sk, hk, 64, dtype=dtype, grad=True), \
        randn(2, sk, hk, 64, dtype=dtype, grad=True)
    poison()
    out, lse, s_dmask = flash.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    assert s_dmask is None
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, causal, window)
    assert rel(out, ref) < FWD_TOL[dtype]
    check_lse(lse, ref_lse)
    empty = ~torch.isfinite(ref_lse)  # (b, h, sq): rows without keys must be exactly 0
    assert torch.all(out.permute(0, 2, 1, 3)[empty] == 0)
    check_grads(out, ref, (q, k, v), (q64, k64, v64), dtype)


def test_softmax_scale_and_deterministic():
    q, k, v = (randn(2, 300, h, 128, dtype=torch.bfloat16, grad=True) for h in (8, 2, 2))
    out = flash.flash_attn_func(q, k, v, softmax_scale=0.05, causal=True, deterministic=True)
    ref, _ = reference(q.detach(), k.detach(), v.detach(), True, (-1, -1), scale=0.05)
    assert rel(out, ref) < FWD_TOL[torch.bfloat16]
    d_o = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), d_o, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v), d_o)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


SOFTCAP_MASKS = ((False, (-1, -1)), (True, (-1, -1)), (False, (32, 16)))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("causal,window", SOFTCAP_MASKS)
def test_softcap_forward_lse_and_backward(dtype, causal, window):
    # Scores spread wide (q scaled up) so that the cap bites: the capped answer differs
    # from the uncapped one by far more than the tolerance, and matches float64's.
    q = (randn(2, 200, 8, 64, dtype=torch.float32) * 6).to(dtype).requires_grad_()
    k, v = (randn(2, 170, 2, 64, dtype=dtype, grad=True) for _ in range(2))
    # More queries than keys at the bottom right: beside softcap the plan takes no lengths
    # (the score modifier applies the diagonal), so cuDNN releases without softcap graphs
    # with lengths (fastattn.defects.GAPS) serve it too.
    out, lse, _ = flash.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=5.0,
                                        return_attn_probs=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, causal, window, softcap=5.0)
    assert rel(out, ref) < FWD_TOL[dtype]
    assert rel(reference(q64, k64, v64, causal, window)[0].detach(), ref.detach()) > 10 * FWD_TOL[dtype]
    check_lse(lse, ref_lse)
    check_grads(out, ref, (q, k, v), (q64, k64, v64), dtype)


def test_softcap_in_varlen_and_kvcache():
    dtype = torch.bfloat16
    lens = [37, 120, 64]
    cu = torch.tensor([0, *itertools.accumulate(lens)], device=DEV, dtype=torch.int32)
    q = (randn(sum(lens), 4, 64, dtype=torch.float32) * 6).to(dtype)
    k, v = (randn(sum(lens), 2, 64, dtype=dtype) for _ in range(2))
    gap = softcap_with_lengths_refused()
    if gap:  # packed sequences and a cache's lengths are per-sequence lengths: refused, saying so
        with pytest.raises(fastattn.NotSupportedError, match=f"known cuDNN gap {gap}"):
            flash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, softcap=4.0)
        qd, kc = randn(2, 1, 4, 64, dtype=dtype), randn(2, 96, 2, 64, dtype=dtype)
        with pytest.raises(fastattn.NotSupportedError, match=f"known cuDNN gap {gap}"):
            flash.flash_attn_with_kvcache(qd, kc, kc, cache_seqlens=torch.tensor([96, 50], device=DEV,
                                                                               dtype=torch.int32),
                                          causal=True, softcap=4.0)
        return
    out = flash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, softcap=4.0)
    for a, n in zip(cu.tolist(), lens):
        ref, _ = reference(*(t[None, a:a + n] for t in (q, k, v)), True, (-1, -1), softcap=4.0)
        assert rel(out[a:a + n], ref[0]) < FWD_TOL[dtype]
    # decode against a dense and a paged cache: the cap applies to every cached key
    b, sk = 2, 96
    qd = (randn(b, 1, 4, 64, dtype=torch.float32) * 6).to(dtype)
    kc, vc = (randn(b, sk, 2, 64, dtype=dtype) for _ in range(2))
    lengths = torch.tensor([sk, 50], device=DEV, dtype=torch.int32)
    dense = flash.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lengths, causal=True, softcap=4.0)
    pages = kc.reshape(b * sk // 16, 16, 2, 64), vc.reshape(b * sk // 16, 16, 2, 64)
    table = torch.arange(b * sk // 16, device=DEV, dtype=torch.int32).reshape(b, sk // 16)
    paged = flash.flash_attn_with_kvcache(qd, *pages, cache_seqlens=lengths, block_table=table, causal=True,
                                          softcap=4.0)
    for n, m in enumerate(lengths.tolist()):
        ref, _ = reference(qd[n:n + 1], kc[n:n + 1, :m], vc[n:n + 1, :m], True, (-1, -1), softcap=4.0)
        assert rel(dense[n:n + 1], ref) < FWD_TOL[dtype]
        assert rel(paged[n:n + 1], ref) < FWD_TOL[dtype]


def test_softcap_with_alibi_composes_as_a_bias():
    # cuDNN refuses its ALiBi beside its score modifier: the slopes go into a bias, which
    # cuDNN adds after the modifier, FlashAttention's order (softcap, then ALiBi).
    dtype = torch.float16
    q = (randn(2, 128, 4, 64, dtype=torch.float32) * 6).to(dtype).requires_grad_()
    k, v = (randn(2, 128, 4, 64, dtype=dtype, grad=True) for _ in range(2))
    slopes = torch.tensor(flash.standard_alibi_slopes(4), device=DEV, dtype=torch.float32)
    out, lse, _ = flash.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, softcap=5.0, return_attn_probs=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, True, (-1, -1), alibi=slopes, softcap=5.0)
    assert rel(out, ref) < FWD_TOL[dtype]
    check_lse(lse, ref_lse)
    check_grads(out, ref, (q, k, v), (q64, k64, v64), dtype)


@pytest.mark.parametrize("batched", (False, True))
def test_standard_alibi_slopes_with_causal(batched):
    dtype = torch.float16
    q, k, v = (randn(2, 160, h, 64, dtype=dtype, grad=True) for h in (8, 8, 8))
    slopes = torch.tensor(flash.standard_alibi_slopes(8), device=DEV, dtype=torch.float32)
    slopes = slopes.expand(2, 8).contiguous() if batched else slopes
    out, lse, _ = flash.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, True, (-1, -1), alibi=slopes)
    assert rel(out, ref) < FWD_TOL[dtype]
    check_lse(lse, ref_lse)
    check_grads(out, ref, (q, k, v), (q64, k64, v64), dtype)


# ALiBi with any slopes, causal or not, FlashAttention's -slope * |i + sk - sq - j|: cuDNN's
# own where that is FlashAttention's (the paper's slopes, causal, as many queries as keys),
# a bias elsewhere (with the mask in it where the diagonal is at the bottom right).
ALIBI = list(itertools.product((torch.float16, torch.bfloat16), ((128, 128), (100, 257), (257, 100), (1, 200)),
                               ((False, (-1, -1)), (True, (-1, -1)), (False, (16, 8)), (True, (32, -1)))))


def alibi_slopes_of(kind, b, h):
    if kind == "paper":
        return torch.tensor(flash.standard_alibi_slopes(h), device=DEV, dtype=torch.float32)
    return torch.rand(*((b, h) if kind == "batched" else (h,)), device=DEV) * 0.3  # FlashAttention's tests' draw


@pytest.mark.parametrize("kind", ("paper", "random", "batched"))
@pytest.mark.parametrize("dtype,shape,mask", ALIBI, ids=[f"{str(c[0])[6:]}-{c[1][0]}x{c[1][1]}-c{int(c[2][0])}-"
                                                         f"w{c[2][1][0]},{c[2][1][1]}" for c in ALIBI])
def test_alibi_any_slopes_causal_or_not(dtype, shape, mask, kind):
    (sq, sk), (causal, window) = shape, mask
    q = randn(2, sq, 8, 64, dtype=dtype, grad=True)
    k, v = (randn(2, sk, 2, 64, dtype=dtype, grad=True) for _ in range(2))
    slopes = alibi_slopes_of(kind, 2, 8)
    poison()
    out, lse, _ = flash.flash_attn_func(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes,
                                        return_attn_probs=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, causal, window, alibi=slopes)
    assert rel(out, ref) < FWD_TOL[dtype]
    check_lse(lse, ref_lse)
    check_grads(out, ref, (q, k, v), (q64, k64, v64), dtype)


@pytest.mark.parametrize("same_cu", (True, False))
@pytest.mark.parametrize("causal,window", ((False, (-1, -1)), (True, (-1, -1)), (False, (8, 4)), (True, (20, -1))))
def test_varlen_alibi_any_slopes(same_cu, causal, window):
    dtype = torch.bfloat16
    # Different cu_seqlens: shifts 65, 0, -23 (the last has rows that see no key when causal).
    lens_q, lens_k = ((37, 128, 1, 90),) * 2 if same_cu else ((5, 64, 33), (70, 64, 10))
    cu_q = cumulative(lens_q)
    cu_k = cu_q if same_cu else cumulative(lens_k)
    q = randn(sum(lens_q), 8, 64, dtype=dtype, grad=True)
    k, v = (randn(sum(lens_k), 2, 64, dtype=dtype, grad=True) for _ in range(2))
    slopes = alibi_slopes_of("batched", len(lens_q), 8)
    poison()
    out, lse, _ = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                               window_size=window, alibi_slopes=slopes, return_attn_probs=True)
    assert out.shape == (sum(lens_q), 8, 64) and lse.shape == (8, sum(lens_q))
    d_o = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_o)
    at_q = at_k = 0
    for n, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        q64, k64, v64 = (t.detach()[a:a + m].double()[None].requires_grad_()
                         for t, a, m in ((q, at_q, lq), (k, at_k, lk), (v, at_k, lk)))
        ref, ref_lse = reference(q64, k64, v64, causal, window, alibi=slopes[n:n + 1], seqlen_k=max(lens_k))
        assert rel(out[at_q:at_q + lq][None], ref) < FWD_TOL[dtype]
        check_lse(lse[:, at_q:at_q + lq][None], ref_lse)
        empty = ~torch.isfinite(ref_lse[0])  # (h, lq): rows that see no key are exactly 0
        assert torch.all(out[at_q:at_q + lq].transpose(0, 1)[empty] == 0)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_o[at_q:at_q + lq][None].double())
        for name, g, rg, a, m in zip("qkv", grads, ref_grads, (at_q, at_k, at_k), (lq, lk, lk)):
            assert rel(g[a:a + m][None], rg) < BWD_TOL[dtype], name
        at_q, at_k = at_q + lq, at_k + lk


def test_the_compositions_combine():
    # One query against one key, a head dim of 59 and ALiBi slopes of FlashAttention's
    # tests' draw, together: dense and varlen with gradients, a KV cache of one key with the LSE.
    dtype = torch.float16
    slopes = alibi_slopes_of("batched", 3, 4)
    q = randn(3, 1, 4, 59, dtype=dtype, grad=True)
    k, v = (randn(3, 1, 2, 59, dtype=dtype, grad=True) for _ in range(2))
    out, lse, _ = flash.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, True, (-1, -1), alibi=slopes)
    assert rel(out, ref) < FWD_TOL[dtype]
    check_lse(lse, ref_lse)
    check_grads(out, ref, (q, k, v), (q64, k64, v64), dtype)

    cu = cumulative((1, 1, 1))
    qv, kv, vv = (t.detach().reshape(3, *t.shape[2:]).requires_grad_() for t in (q, k, v))
    out, lse, _ = flash.flash_attn_varlen_func(qv, kv, vv, cu, cu.clone(), 1, 1, window_size=(0, 0), alibi_slopes=slopes,
                                               return_attn_probs=True)
    ref, ref_lse = reference(q64, k64, v64, False, (0, 0), alibi=slopes)
    assert rel(out, ref.reshape(out.shape)) < FWD_TOL[dtype]
    check_lse(lse[:, :, None].transpose(0, 1), ref_lse)
    d_o = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qv, kv, vv), d_o)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_o.double().reshape(ref.shape))
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel(g, rg.reshape(g.shape)) < BWD_TOL[dtype], name

    k_cache, v_cache = (randn(3, 1, 2, 64, dtype=dtype) for _ in range(2))
    qc = randn(3, 1, 4, 64, dtype=dtype)
    out, lse = flash.flash_attn_with_kvcache(qc, k_cache, v_cache, causal=True, alibi_slopes=slopes,
                                             return_softmax_lse=True)
    ref, ref_lse = reference(qc, k_cache, v_cache, True, (-1, -1), alibi=slopes)
    assert rel(out, ref) < FWD_TOL[dtype]
    check_lse(lse, ref_lse)


def test_dropout_is_unbiased_at_either_corner():
    dtype = torch.bfloat16
    q, k, v = (randn(1, 128, 4, 64, dtype=dtype) for _ in range(3))
    plain = flash.flash_attn_func(q, k, v, causal=True).double()
    samples = [flash.flash_attn_func(q, k, v, dropout_p=0.1, causal=True).double() for _ in range(200)]
    assert all(torch.isfinite(s).all() for s in samples) and not torch.equal(samples[0], samples[1])
    mean = torch.stack(samples).mean(0)  # inverted dropout: E[out] is the dropout-free out
    assert ((mean - plain).norm() / plain.norm()).item() < 0.1
    # Training with dropout: gradients exist and are finite.
    qg = q.clone().requires_grad_()
    flash.flash_attn_func(qg, k, v, dropout_p=0.1, causal=True).sum().backward()
    assert torch.isfinite(qg.grad).all()
    # Fewer queries than keys: FlashAttention's bottom-right causal mask beside dropout, which
    # cuDNN takes in its top-left form (AttentionConfig's alignment): unbiased there too.
    q64 = q[:, :64]
    plain = flash.flash_attn_func(q64, k, v, causal=True).double()
    samples = [flash.flash_attn_func(q64, k, v, dropout_p=0.1, causal=True).double() for _ in range(200)]
    assert all(torch.isfinite(s).all() for s in samples)
    mean = torch.stack(samples).mean(0)
    assert ((mean - plain).norm() / plain.norm()).item() < 0.1


# -- one query and one key: cuDNN's training plans refuse s_q = s_kv = 1 ---------------------------

# (seqlen_q, causal, window) against one key: a query and its key alone, or more queries
# than the key, the rows above the diagonal cut, which leaves one query and one key.
ONE_KEY = ((1, False, (-1, -1)), (1, True, (-1, -1)), (1, False, (0, 0)), (239, True, (-1, -1)),
           (40, False, (3, 0)), (6, True, (0, -1)))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("sq,causal,window", ONE_KEY)
def test_one_query_and_one_key_train(dtype, sq, causal, window):
    q = randn(3, sq, 4, 64, dtype=dtype, grad=True)
    k, v = (randn(3, 1, 2, 64, dtype=dtype, grad=True) for _ in range(2))
    poison()
    out, lse, _ = flash.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (3, 4, sq)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, causal, window)
    assert rel(out, ref) < FWD_TOL[dtype]
    check_lse(lse, ref_lse)
    check_grads(out, ref, (q, k, v), (q64, k64, v64), dtype)  # one key: d_q = d_k = 0, d_v = d_o summed
    with torch.no_grad():  # inference runs the plan as it is
        assert rel(flash.flash_attn_func(q, k, v, causal=causal, window_size=window), ref.detach()) < FWD_TOL[dtype]


@pytest.mark.parametrize("same_cu", (True, False))
def test_varlen_one_token_sequences_train(same_cu):
    dtype, lens = torch.bfloat16, (1, 1, 1)
    cu = cumulative(lens)
    q = randn(3, 8, 64, dtype=dtype, grad=True)
    k, v = (randn(3, 2, 64, dtype=dtype, grad=True) for _ in range(2))
    poison()
    out, lse, _ = flash.flash_attn_varlen_func(q, k, v, cu, cu if same_cu else cu.clone(), 1, 1, causal=True,
                                               return_attn_probs=True)
    d_o = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_o)
    for n in range(3):
        q64, k64, v64 = (t.detach()[n:n + 1].double()[None].requires_grad_() for t in (q, k, v))
        ref, ref_lse = reference(q64, k64, v64, True, (-1, -1))
        assert rel(out[n:n + 1][None], ref) < FWD_TOL[dtype]
        check_lse(lse[:, n:n + 1][None], ref_lse)
        for name, g, rg in zip("qkv", grads, torch.autograd.grad(ref, (q64, k64, v64), d_o[n:n + 1][None].double())):
            assert rel(g[n:n + 1][None], rg) < BWD_TOL[dtype], name


def test_kvcache_lse_with_a_cache_of_one_key():
    # return_softmax_lse runs the training plan, whose backward graph cuDNN refuses at 1 x 1.
    dtype = torch.float16
    q = randn(2, 1, 4, 64, dtype=dtype)
    k_cache, v_cache = (randn(2, 1, 4, 64, dtype=dtype) for _ in range(2))
    out, lse = flash.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, return_softmax_lse=True)
    ref, ref_lse = reference(q, k_cache, v_cache, True, (-1, -1))
    assert rel(out, ref) < FWD_TOL[dtype]
    check_lse(lse, ref_lse)


# -- head dims that are not multiples of 8: padded, as FlashAttention pads them --------------------

HEAD_DIMS = ((59, 59), (111, 111), (33, 72), (64, 20), (250, 250), (3, 3))  # (head_dim_qk, head_dim_v)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("dqk,dv", HEAD_DIMS)
def test_head_dims_not_multiples_of_8(dtype, dqk, dv):
    q = randn(2, 130, 8, dqk, dtype=dtype, grad=True)
    k, v = randn(2, 150, 2, dqk, dtype=dtype, grad=True), randn(2, 150, 2, dv, dtype=dtype, grad=True)
    poison()
    out, lse, _ = flash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == (2, 130, 8, dv) and lse.shape == (2, 8, 130)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, True, (-1, -1))  # the default scale: 1/sqrt(dqk), not the padded one's
    assert rel(out, ref) < FWD_TOL[dtype]
    check_lse(lse, ref_lse)
    check_grads(out, ref, (q, k, v), (q64, k64, v64), dtype)
    with torch.no_grad():
        scaled = flash.flash_attn_func(q, k, v, softmax_scale=0.3, window_size=(20, 5))
    assert rel(scaled, reference(q64, k64, v64, False, (20, 5), scale=0.3)[0].detach()) < FWD_TOL[dtype]


@pytest.mark.parametrize("d", (59, 20))
def test_head_dims_not_multiples_of_8_packed_and_varlen(d):
    dtype = torch.bfloat16
    qkv = randn(2, 100, 3, 4, d, dtype=dtype, grad=True)
    out = flash.flash_attn_qkvpacked_func(qkv, causal=True)
    qkv64 = qkv.detach().double().requires_grad_()
    ref, _ = reference(*qkv64.unbind(2), True, (-1, -1))
    assert out.shape == (2, 100, 4, d) and rel(out, ref) < FWD_TOL[dtype]
    d_o = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, (qkv,), d_o)
    (rg,) = torch.autograd.grad(ref, (qkv64,), d_o.double())
    assert g.shape == qkv.shape and rel(g, rg) < BWD_TOL[dtype]

    q, kv = randn(2, 70, 4, d, dtype=dtype, grad=True), randn(2, 90, 2, 1, d, dtype=dtype, grad=True)
    out = flash.flash_attn_kvpacked_func(q, kv, window_size=(16, 16))
    q64, kv64 = q.detach().double().requires_grad_(), kv.detach().double().requires_grad_()
    ref, _ = reference(q64, *kv64.unbind(2), False, (16, 16))
    assert rel(out, ref) < FWD_TOL[dtype]
    d_o = torch.randn_like(out)
    for g, rg in zip(torch.autograd.grad(out, (q, kv), d_o), torch.autograd.grad(ref, (q64, kv64), d_o.double())):
        assert rel(g, rg) < BWD_TOL[dtype]

    lens_q, lens_k = (37, 128, 1), (50, 128, 9)
    q = randn(sum(lens_q), 4, d, dtype=dtype, grad=True)
    k, v = (randn(sum(lens_k), 2, d, dtype=dtype, grad=True) for _ in range(2))
    poison()
    out, lse, _ = flash.flash_attn_varlen_func(q, k, v, cumulative(lens_q), cumulative(lens_k), max(lens_q),
                                               max(lens_k), causal=True, return_attn_probs=True)
    assert out.shape == (sum(lens_q), 4, d)
    d_o = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_o)
    at_q = at_k = 0
    for lq, lk in zip(lens_q, lens_k):
        q64, k64, v64 = (t.detach()[a:a + n].double()[None].requires_grad_()
                         for t, a, n in ((q, at_q, lq), (k, at_k, lk), (v, at_k, lk)))
        ref, ref_lse = reference(q64, k64, v64, True, (-1, -1))
        assert rel(out[at_q:at_q + lq][None], ref) < FWD_TOL[dtype]
        check_lse(lse[:, at_q:at_q + lq][None], ref_lse)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_o[at_q:at_q + lq][None].double())
        for name, g, rg, a, n in zip("qkv", grads, ref_grads, (at_q, at_k, at_k), (lq, lk, lk)):
            assert rel(g[a:a + n][None], rg) < BWD_TOL[dtype], name
        at_q, at_k = at_q + lq, at_k + lk


# -- packed ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window", ((True, (-1, -1)), (False, (32, 32))))
def test_qkvpacked_and_kvpacked(causal, window):
    dtype = torch.bfloat16
    qkv = randn(2, 200, 3, 4, 64, dtype=dtype, grad=True)
    poison()
    out, lse, _ = flash.flash_attn_qkvpacked_func(qkv, causal=causal, window_size=window, return_attn_probs=True)
    qkv64 = qkv.detach().double().requires_grad_()
    ref, ref_lse = reference(*qkv64.unbind(2), causal, window)
    assert rel(out, ref) < FWD_TOL[dtype]
    check_lse(lse, ref_lse)
    d_o = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, (qkv,), d_o)
    (rg,) = torch.autograd.grad(ref, (qkv64,), d_o.double())
    assert rel(g, rg) < BWD_TOL[dtype]

    q = randn(2, 90, 8, 64, dtype=dtype, grad=True)
    kv = randn(2, 250, 2, 2, 64, dtype=dtype, grad=True)
    out = flash.flash_attn_kvpacked_func(q, kv, causal=causal, window_size=window)
    q64, kv64 = q.detach().double().requires_grad_(), kv.detach().double().requires_grad_()
    ref, _ = reference(q64, *kv64.unbind(2), causal, window)
    assert rel(out, ref) < FWD_TOL[dtype]
    d_o = torch.randn_like(out)
    for g, rg in zip(torch.autograd.grad(out, (q, kv), d_o), torch.autograd.grad(ref, (q64, kv64), d_o.double())):
        assert rel(g, rg) < BWD_TOL[dtype]


# -- KV cache -------------------------------------------------------------------------------------

KV = list(itertools.product((False, True), (1, 4), (0, 1), ((False, (-1, -1)), (True, (-1, -1)), (True, (24, -1)))))


@pytest.mark.parametrize("paged,sq,append,mask", KV, ids=[f"{'paged' if c[0] else 'dense'}-q{c[1]}-new{c[2]}-"
                                                          f"c{int(c[3][0])}-w{c[3][1][0]}" for c in KV])
def test_kvcache_decode_and_prefill_with_append(paged, sq, append, mask, alibi=False):
    causal, window = mask
    dtype, b, hq, hk, d, page, per_seq = torch.bfloat16, 3, 8, 2, 64, 16, 8
    slopes = torch.rand(b, hq, device=DEV) * 0.3 if alibi else None  # FlashAttention's tests draw (batch, nheads)
    cached = torch.tensor([0, 37, 100], dtype=torch.int32, device=DEV)
    new = sq * append  # FlashAttention's usual call: the new tokens are the queries' own
    q = randn(b, sq, hq, d, dtype=dtype)
    k_new, v_new = (randn(b, new, hk, d, dtype=dtype) for _ in range(2)) if new else (None, None)
    if paged:  # shuffled pages: each sequence's pages anywhere in the pool
        pool = b * per_seq
        k_cache, v_cache = (randn(pool, page, hk, d, dtype=dtype) for _ in range(2))
        table = torch.randperm(pool, device=DEV).to(torch.int32).reshape(b, per_seq)
        dense_view = lambda c: c[table.long()].reshape(b, per_seq * page, hk, d)  # noqa: E731
    else:
        k_cache, v_cache = (randn(b, per_seq * page, hk, d, dtype=dtype) for _ in range(2))
        table = None
        dense_view = lambda c: c  # noqa: E731
    before_k, before_v = dense_view(k_cache).clone(), dense_view(v_cache).clone()
    poison()
    got = flash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cached, block_table=table,
                                        causal=causal, window_size=window, alibi_slopes=slopes,
                                        return_softmax_lse=not paged)
    out, lse = got if not paged else (got, None)
    after_k, after_v = dense_view(k_cache), dense_view(v_cache)
    for i, n in enumerate(cached.tolist()):
        if new:  # appended in place at each sequence's length; nothing else changed
            assert torch.equal(after_k[i, n:n + new], k_new[i]) and torch.equal(after_v[i, n:n + new], v_new[i])
        keep = torch.ones(per_seq * page, dtype=torch.bool, device=DEV)
        keep[n:n + new] = False
        assert torch.equal(after_k[i, keep], before_k[i, keep]) and torch.equal(after_v[i, keep], before_v[i, keep])
        sk = n + new
        if sk == 0:
            if alibi:  # (a bias path: fastattn.flash writes FlashAttention's 0 and +inf itself)
                assert torch.all(out[i] == 0) and (lse is None or torch.all(lse[i] == float("inf")))
            continue
        ref, ref_lse = reference(q[i:i + 1], after_k[i:i + 1, :sk], after_v[i:i + 1, :sk], causal, window,
                                 seqlen_k=per_seq * page, alibi=None if slopes is None else slopes[i:i + 1])
        assert rel(out[i:i + 1], ref) < FWD_TOL[dtype]
        if lse is not None:
            check_lse(lse[i:i + 1], ref_lse)


@pytest.mark.parametrize("paged,sq,append,mask", KV, ids=[f"{'paged' if c[0] else 'dense'}-q{c[1]}-new{c[2]}-"
                                                          f"c{int(c[3][0])}-w{c[3][1][0]}" for c in KV])
def test_kvcache_alibi_any_slopes(paged, sq, append, mask):
    test_kvcache_decode_and_prefill_with_append(paged, sq, append, mask, alibi=True)


def test_kvcache_cache_batch_idx_and_int_cache_seqlens():
    dtype, b, hq, hk, d = torch.float16, 2, 4, 4, 64
    k_cache, v_cache = (randn(5, 128, hk, d, dtype=dtype) for _ in range(2))
    rows = torch.tensor([3, 1], dtype=torch.int32, device=DEV)
    q = randn(b, 1, hq, d, dtype=dtype)
    out = flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=50, cache_batch_idx=rows, causal=True)
    for i, r in enumerate(rows.tolist()):
        ref, _ = reference(q[i:i + 1], k_cache[r:r + 1, :50], v_cache[r:r + 1, :50], True, (-1, -1))
        assert rel(out[i:i + 1], ref) < FWD_TOL[dtype]


# -- fastattn.torch: a key-padding bias ------------------------------------------------------------

def test_torch_attention_takes_a_key_padding_bias_with_its_gradient():
    """A (b, 1, 1, s_kv) key-padding bias: forward against float64; with gradients the call
    is refused with the reason (cuDNN 9.19's backward got d_q, d_k wrong for one-row biases
    on the H200; see test_alignment_bias_gpu.py)."""
    dtype = torch.float16
    q, k, v = (randn(2, 100, 4, 64, dtype=dtype, grad=True) for _ in range(3))
    bias = (torch.randn(2, 1, 1, 100, device=DEV) * 2).to(dtype)
    with pytest.raises(fastattn.NotSupportedError, match="a bias of one row"):
        fastattn.torch.attention(q, k, v, bias=bias)
    with torch.no_grad():
        out = fastattn.torch.attention(q, k, v, bias=bias)
    q64, k64, v64, b64 = (t.detach().double() for t in (q, k, v, bias))
    s = (q64.transpose(1, 2) @ k64.permute(0, 2, 3, 1)) / 8.0 + b64
    ref = (torch.softmax(s, -1) @ v64.transpose(1, 2)).transpose(1, 2)
    assert rel(out, ref) < FWD_TOL[dtype]
