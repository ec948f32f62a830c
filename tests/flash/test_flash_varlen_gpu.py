"""GPU: fastattn.flash's varlen functions against test_flash_gpu.py's float64 reference
(FlashAttention 2's documented semantics: each sequence at its own bottom right), fresh
random inputs, memory poisoned before each call; the packed variants, ALiBi with shared
offsets, dropout. test_flash_model.py runs these on the CPU over its model of fastattn.torch
(it sets test_flash_gpu's DEV and poison: the helpers are read through G at each call)."""

import itertools

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402,F401
from fastattn import flash  # noqa: E402

import test_flash_gpu as G  # noqa: E402

# -- varlen ---------------------------------------------------------------------------------------

VARLEN = list(itertools.product((torch.float16, torch.bfloat16), ((False, (-1, -1)), (True, (-1, -1)),
                                                                  (False, (8, 4)), (True, (20, -1)))))


@pytest.mark.parametrize("dtype,mask", VARLEN, ids=[f"{str(c[0])[6:]}-c{int(c[1][0])}-w{c[1][1]}" for c in VARLEN])
def test_varlen_each_sequence_at_its_own_bottom_right(dtype, mask):
    causal, window = mask
    lens_q, lens_k = (5, 64, 33), (70, 64, 10)  # shifts 65, 0, -23: the last has rows with no key
    hq, hk = 8, 2
    q = G.randn(sum(lens_q), hq, 64, dtype=dtype, grad=True)
    k, v = (G.randn(sum(lens_k), hk, 64, dtype=dtype, grad=True) for _ in range(2))
    G.poison()
    out, lse, _ = flash.flash_attn_varlen_func(q, k, v, G.cumulative(lens_q), G.cumulative(lens_k), max(lens_q),
                                               max(lens_k), causal=causal, window_size=window,
                                               return_attn_probs=True)
    assert out.shape == (sum(lens_q), hq, 64) and lse.shape == (hq, sum(lens_q))
    d_o = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_o)
    at_q, at_k = 0, 0
    for lq, lk in zip(lens_q, lens_k):
        q64, k64, v64 = (t.detach()[a:a + n].double()[None].requires_grad_()
                         for t, a, n in ((q, at_q, lq), (k, at_k, lk), (v, at_k, lk)))
        ref, ref_lse = G.reference(q64, k64, v64, causal, window, seqlen_k=max(lens_k))
        assert G.rel(out[at_q:at_q + lq][None], ref) < G.FWD_TOL[dtype]
        G.check_lse(lse[:, at_q:at_q + lq][None], ref_lse)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_o[at_q:at_q + lq][None].double())
        for g, rg, a, n in zip(grads, ref_grads, (at_q, at_k, at_k), (lq, lk, lk)):
            if rg.norm() > 0:
                assert G.rel(g[a:a + n][None], rg) < G.BWD_TOL[dtype]
            else:
                assert torch.all(g[a:a + n] == 0)
        at_q, at_k = at_q + lq, at_k + lk


def test_varlen_packed_variants():
    dtype = torch.bfloat16
    lens = (40, 128, 7)
    cu = G.cumulative(lens)
    qkv = G.randn(sum(lens), 3, 4, 64, dtype=dtype)
    out = flash.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    kv = qkv[:, 1:].contiguous()
    out2 = flash.flash_attn_varlen_kvpacked_func(qkv[:, 0], kv, cu, cu.clone(), max(lens), max(lens), causal=True)
    at = 0
    for n in lens:
        ref, _ = G.reference(*(t[at:at + n][None] for t in qkv.unbind(1)), True, (-1, -1))
        assert G.rel(out[at:at + n][None], ref) < G.FWD_TOL[dtype]
        assert G.rel(out2[at:at + n][None], ref) < G.FWD_TOL[dtype]
        at += n


@pytest.mark.parametrize("hq,hk,dv", ((4, 4, 64), (4, 1, 64), (4, 4, 32)), ids=("mha", "mqa", "dv32"))
def test_varlen_alibi_and_shared_offsets(hq, hk, dv):
    # One cu_seqlens for q and k (self-attention): the offsets attention_varlen computes
    # once serve several of cuDNN's tensors (MHA: q's and k's; equal head dims: k's and
    # v's, q's and o's), the rest computed apart. ALiBi with the paper's slopes, causal.
    dtype = torch.bfloat16
    lens = (37, 128, 1, 90)
    cu = G.cumulative(lens)
    q = G.randn(sum(lens), hq, 64, dtype=dtype, grad=True)
    k = G.randn(sum(lens), hk, 64, dtype=dtype, grad=True)
    v = G.randn(sum(lens), hk, dv, dtype=dtype, grad=True)
    slopes = torch.tensor(flash.standard_alibi_slopes(hq), dtype=torch.float32, device=G.DEV)
    G.poison()
    out, lse, _ = flash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                               alibi_slopes=slopes, return_attn_probs=True)
    d_o = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_o)
    at = 0
    for n in lens:
        q64, k64, v64 = (t.detach()[at:at + n].double()[None].requires_grad_() for t in (q, k, v))
        ref, ref_lse = G.reference(q64, k64, v64, True, (-1, -1), alibi=slopes)
        assert G.rel(out[at:at + n][None], ref) < G.FWD_TOL[dtype]
        G.check_lse(lse[:, at:at + n][None], ref_lse)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_o[at:at + n][None].double())
        for name, g, rg in zip("qkv", grads, ref_grads):
            # A one-token sequence's d_q is 0 in exact arithmetic, ~1e-7 in cuDNN's (G.rel()
            # compares absolutely against a zero reference).
            assert G.rel(g[at:at + n][None], rg) < G.BWD_TOL[dtype], name
        at += n


def test_varlen_dropout_is_unbiased_and_refused_where_cudnn_refuses():
    dtype = torch.bfloat16
    lens = (50, 128)
    cu = G.cumulative(lens)
    q, k, v = (G.randn(sum(lens), 4, 64, dtype=dtype) for _ in range(3))
    plain = flash.flash_attn_varlen_func(q, k, v, cu, cu, 128, 128, causal=True).double()
    samples = [flash.flash_attn_varlen_func(q, k, v, cu, cu, 128, 128, dropout_p=0.1, causal=True).double()
               for _ in range(200)]
    assert all(torch.isfinite(s).all() for s in samples) and not torch.equal(samples[0], samples[1])
    mean = torch.stack(samples).mean(0)  # inverted dropout: E[out] is the dropout-free out
    assert ((mean - plain).norm() / plain.norm()).item() < 0.1
    torch.manual_seed(5)  # the generator decides the mask: the same seed, the same bits
    again = flash.flash_attn_varlen_func(q, k, v, cu, cu, 128, 128, dropout_p=0.1, causal=True)
    torch.manual_seed(5)
    assert torch.equal(again, flash.flash_attn_varlen_func(q, k, v, cu, cu, 128, 128, dropout_p=0.1, causal=True))
    qg = q.clone().requires_grad_()
    flash.flash_attn_varlen_func(qg, k, v, cu, cu, 128, 128, dropout_p=0.1, causal=True).sum().backward()
    assert torch.isfinite(qg.grad).all() and qg.grad.abs().sum() > 0
    # Different q and k lengths put a causal diagonal at each sequence's bottom right,
    # which cuDNN refuses with dropout: NotSupportedError with its reason.
    with pytest.raises(fastattn.NotSupportedError, match="dropout"):
        flash.flash_attn_varlen_func(q[:100], k, v, G.cumulative((40, 60)), cu, 64, 128, dropout_p=0.1, causal=True)


@pytest.mark.parametrize("via", ["flash", "torch"])
@pytest.mark.parametrize("softcap,window", [(0.0, (-1, -1)), (50.0, (-1, -1)), (50.0, (40, 7))])
def test_varlen_one_query_per_sequence_with_fewer_key_heads_trains_right(via, softcap, window):
    # cuDNN 9.19's ragged backward declared for one query with fewer key heads than query
    # heads gave d_q, d_k, d_v hundreds of times off (1e22 with softcap; FlashAttention's
    # test_flash_attn_varlen_output; benchmarks/probe_decode.py): the plan declares two.
    # Through fastattn.torch too (its native C entry and Python body share the rule).
    dtype = torch.bfloat16
    lens_k = (147, 131, 140, 127)
    lens_q = (1,) * len(lens_k)
    hq, hk = 4, 1
    q = (G.randn(len(lens_k), hq, 64, dtype=dtype) * (softcap or 1)).requires_grad_()
    k, v = (G.randn(sum(lens_k), hk, 64, dtype=dtype, grad=True) for _ in range(2))
    cu_q, cu_k = G.cumulative(lens_q), G.cumulative(lens_k)
    G.poison()
    gap = G.softcap_with_lengths_refused() if softcap else None
    if gap:  # packed sequences are per-sequence lengths: refused on this release, saying so
        with pytest.raises(fastattn.NotSupportedError, match=f"known cuDNN gap {gap}"):
            if via == "flash":
                flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max(lens_k), softcap=softcap, window_size=window)
            else:
                fastattn.torch.attention_varlen(q, k, v, cu_q, cu_k, 1, max(lens_k), softcap=softcap,
                                                window=None if window == (-1, -1) else window,
                                                alignment="bottom_right")
        return
    if via == "flash":
        out = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max(lens_k), softcap=softcap, window_size=window)
    else:
        out = fastattn.torch.attention_varlen(q, k, v, cu_q, cu_k, 1, max(lens_k), softcap=softcap,
                                              window=None if window == (-1, -1) else window,
                                              alignment="bottom_right")
    d_o = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_o)
    at_k = 0
    for i, lk in enumerate(lens_k):
        q64, k64, v64 = (t.detach()[a:a + n].double()[None].requires_grad_()
                         for t, a, n in ((q, i, 1), (k, at_k, lk), (v, at_k, lk)))
        ref, _ = G.reference(q64, k64, v64, False, window, softcap=softcap)
        assert G.rel(out[i:i + 1][None], ref) < G.FWD_TOL[dtype]
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_o[i:i + 1][None].double())
        for name, g, rg, a, n in zip("qkv", grads, ref_grads, (i, at_k, at_k), (1, lk, lk)):
            assert G.rel(g[a:a + n][None], rg) < G.BWD_TOL[dtype], (i, name)
        at_k += lk


@pytest.mark.parametrize("d", [111, 256])
def test_one_query_training_calls_repeat_bitwise(d):
    # FlashAttention's test_flash_attn_race_condition (seqlen_q 1, seqlen_k 239, batch 60):
    # identical calls, identical bits, forward and backward (cuDNN 9.19's one-query
    # training forward was not: fastattn.flash runs two rows; benchmarks/probe_decode.py).
    torch.manual_seed(0)
    q = G.randn(60, 1, 4, d, dtype=torch.float16, grad=True)
    k, v = (G.randn(60, 239, 4, d, dtype=torch.float16, grad=True) for _ in range(2))
    out0, lse0, _ = flash.flash_attn_func(q, k, v, return_attn_probs=True)
    g = torch.randn_like(out0)
    grads0 = torch.autograd.grad(out0, (q, k, v), g)
    for i in range(20):
        out, lse, _ = flash.flash_attn_func(q, k, v, return_attn_probs=True)
        assert torch.equal(out, out0) and torch.equal(lse, lse0), i
        grads = torch.autograd.grad(out, (q, k, v), g)
        assert torch.equal(grads[1], grads0[1]) and torch.equal(grads[2], grads0[2]), i
