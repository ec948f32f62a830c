"""GPU: flash_attn_varlen_func with block_table and seqused_k (packed queries against a
paged KV cache, or against packed keys of which each sequence uses a prefix), against
test_flash_gpu's float64 reference of FlashAttention's semantics: each sequence's masks
at the bottom right of the keys it uses, a row that sees no key 0 (LSE +inf). Fresh
random inputs, memory poisoned before each call, shuffled pages with unused ones between.

Both paths: cuDNN's paged plan (forward, no LSE) and the gather into packed keys
(gradients into the page pools, the LSE, ALiBi, a head dim of 59). test_flash_model.py
runs these on the CPU over its model of fastattn.torch."""

import itertools

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from fastattn import flash  # noqa: E402

import test_flash_gpu as G  # noqa: E402  (its helpers, and DEV, read at each call: the model tests set it)

LENS_Q, LENS_K = (5, 64, 33), (70, 64, 10)  # shifts 65, 0, -23: the last has rows with no key under causal
USED = (60, 64, 7)  # seqused_k: a prefix of each sequence's keys
PAGED_MASKS = ((False, (-1, -1)), (True, (-1, -1)), (False, (8, 4)), (True, (20, -1)))


def paged_pool(b, per_seq, page, hk, d, dtype, grad=False, dv=None):
    """(k_pool, v_pool, block_table): b * per_seq pages of a pool with 5 more, shuffled."""
    pool = b * per_seq + 5
    k_pool = G.randn(pool, page, hk, d, dtype=dtype, grad=grad)
    v_pool = G.randn(pool, page, hk, dv or d, dtype=dtype, grad=grad)
    table = torch.randperm(pool, device=G.DEV)[:b * per_seq].to(torch.int32).reshape(b, per_seq)
    return k_pool, v_pool, table


def sequence_keys(pool, table, n, length):
    """Sequence n's first `length` keys from the pool (differentiable: gradients reach the pool)."""
    return pool[table[n].long()].reshape(-1, *pool.shape[2:])[:length]


def check_per_sequence(out, lse, q, keys_of, values_of, lens_q, causal, window, max_k, alibi=None):
    """out (and lse) of each sequence against the reference; returns the reference's out and
    lse packed like out (for gradients)."""
    dtype = out.dtype
    refs, at = [], 0
    for n, lq in enumerate(lens_q):
        ref, ref_lse = G.reference(q[at:at + lq][None], keys_of(n)[None], values_of(n)[None], causal, window,
                                   seqlen_k=max_k, alibi=None if alibi is None else alibi[n:n + 1])
        assert G.rel(out[at:at + lq][None], ref) < G.FWD_TOL[dtype], n
        empty = ~torch.isfinite(ref_lse[0])  # (h, lq): rows that see no key are exactly 0
        assert torch.all(out[at:at + lq].transpose(0, 1)[empty] == 0)
        if lse is not None:
            G.check_lse(lse[:, at:at + lq][None], ref_lse)
        refs.append(ref[0])
        at += lq
    return torch.cat(refs)


@pytest.mark.parametrize("seqused", (False, True), ids=("cu_seqlens_k", "seqused_k"))
@pytest.mark.parametrize("causal,window", PAGED_MASKS, ids=[f"c{int(c)}-w{w[0]},{w[1]}" for c, w in PAGED_MASKS])
def test_varlen_paged_forward_on_cudnns_paged_plan(causal, window, seqused):
    dtype, hq, hk, d, page, per_seq = torch.bfloat16, 8, 2, 64, 16, 8
    b = len(LENS_Q)
    k_pool, v_pool, table = paged_pool(b, per_seq, page, hk, d, dtype)
    q = G.randn(sum(LENS_Q), hq, d, dtype=dtype)
    used = USED if seqused else LENS_K
    seqused_k = torch.tensor(USED, dtype=torch.int32, device=G.DEV) if seqused else None
    G.poison()
    out = flash.flash_attn_varlen_func(q, k_pool, v_pool, G.cumulative(LENS_Q), G.cumulative(LENS_K), max(LENS_Q),
                                       max(LENS_K), causal=causal, window_size=window, block_table=table,
                                       seqused_k=seqused_k)
    assert out.shape == (sum(LENS_Q), hq, d)
    check_per_sequence(out, None, q, lambda n: sequence_keys(k_pool, table, n, used[n]),
                       lambda n: sequence_keys(v_pool, table, n, used[n]), LENS_Q, causal, window, max(LENS_K))


GATHERED = ("grad", "alibi", "d59", "page256")


@pytest.mark.parametrize("kind", GATHERED)
def test_varlen_paged_gradients_lse_alibi_and_odd_head_dims_through_the_gather(kind):
    # What cuDNN's paged plan has not (a backward, the LSE, ALiBi, head dims not multiples
    # of 8): the pages each sequence uses are gathered into packed keys; gradients flow back
    # into the pools (FlashAttention has no paged backward: this one is fastattn.flash's).
    dtype = torch.float16 if kind == "alibi" else torch.bfloat16
    hq, hk, page, per_seq = 4, 2, 16, 8
    d = 59 if kind == "d59" else 64
    if kind == "page256":  # FlashAttention's own page size, one page per sequence
        page, per_seq = 256, 1
    causal, window = {"grad": (True, (-1, -1)), "alibi": (False, (-1, -1)), "d59": (True, (20, -1)),
                      "page256": (False, (8, 4))}[kind]
    b = len(LENS_Q)
    grad = kind in ("grad", "page256")
    k_pool, v_pool, table = paged_pool(b, per_seq, page, hk, d, dtype, grad=grad)
    q = G.randn(sum(LENS_Q), hq, d, dtype=dtype, grad=grad)
    slopes = torch.rand(b, hq, device=G.DEV) * 0.3 if kind == "alibi" else None
    seqused_k = torch.tensor(USED, dtype=torch.int32, device=G.DEV) if kind == "page256" else None
    used = USED if kind == "page256" else LENS_K
    lse_too = kind != "d59"  # (the LSE alone takes the gather; d59 takes it for its head dim)
    G.poison()
    got = flash.flash_attn_varlen_func(q, k_pool, v_pool, G.cumulative(LENS_Q), G.cumulative(LENS_K), max(LENS_Q),
                                       max(LENS_K), causal=causal, window_size=window, alibi_slopes=slopes,
                                       return_attn_probs=lse_too, block_table=table, seqused_k=seqused_k)
    out, lse = got[:2] if lse_too else (got, None)
    assert out.shape == (sum(LENS_Q), hq, d) and (lse is None or lse.shape == (hq, sum(LENS_Q)))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k_pool, v_pool))
    ref = check_per_sequence(out, lse, q64, lambda n: sequence_keys(k64, table, n, used[n]),
                             lambda n: sequence_keys(v64, table, n, used[n]), LENS_Q, causal, window, max(LENS_K),
                             alibi=slopes)
    if grad:
        G.check_grads(out, ref, (q, k_pool, v_pool), (q64, k64, v64), dtype)  # unused pages: zero in both


@pytest.mark.parametrize("causal,window", ((True, (-1, -1)), (False, (16, 0))))
def test_varlen_seqused_k_without_block_table(causal, window):
    # Packed keys placed by cu_seqlens_k, each sequence using its first seqused_k: gathered
    # into packed keys of their own (cuDNN's packed plans read lengths from one cumulative
    # tensor), forward, LSE and backward; the unused keys get no gradient.
    dtype, hq, hk, d = torch.bfloat16, 8, 2, 64
    cu_k = G.cumulative(LENS_K)
    q = G.randn(sum(LENS_Q), hq, d, dtype=dtype, grad=True)
    k, v = (G.randn(sum(LENS_K), hk, d, dtype=dtype, grad=True) for _ in range(2))
    G.poison()
    out, lse, _ = flash.flash_attn_varlen_func(q, k, v, G.cumulative(LENS_Q), cu_k, max(LENS_Q), max(LENS_K),
                                               causal=causal, window_size=window, return_attn_probs=True,
                                               seqused_k=torch.tensor(USED, dtype=torch.int32, device=G.DEV))
    starts = [0, *itertools.accumulate(LENS_K)]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = check_per_sequence(out, lse, q64, lambda n: k64[starts[n]:starts[n] + USED[n]],
                             lambda n: v64[starts[n]:starts[n] + USED[n]], LENS_Q, causal, window, max(LENS_K))
    d_o = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_o)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_o.double())
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert G.rel(g, rg) < G.BWD_TOL[dtype], name
    for start, n, m in zip(starts, LENS_K, USED):
        assert torch.all(grads[1][start + m:start + n] == 0) and torch.all(grads[2][start + m:start + n] == 0)
