"""GPU: flash_attn_with_kvcache's combinations as FlashAttention's test_flash_attn_kvcache
enumerates them (a dense cache, a paged one, cache_batch_idx, cache_leftpad, new keys or
none, rotary embedding of a part or all of the head dim, interleaved or not, causal, local
or neither, ALiBi, MHA / MQA / GQA), against a float64 reference written from
FlashAttention's semantics: the rotary embedding at its positions (helpers.torch's
rotary_reference, complex multiplication), the new keys appended rotated at cache_seqlens,
each sequence's keys from cache_leftpad to cache_seqlens + seqlen_new with the masks and
ALiBi at their bottom right (test_flash_gpu's reference). Fresh random inputs, memory
poisoned before each call; the cache checked after (the append, nothing else written).
test_flash_model.py runs these on the CPU over its model of fastattn.torch."""

import itertools

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from fastattn import flash  # noqa: E402

import test_flash_gpu as G  # noqa: E402  (its helpers, and DEV, read at each call: the model tests set it)
from helpers.torch import rotary_reference  # noqa: E402

LAYOUTS = ("dense", "paged", "batch_idx", "leftpad", "batch_idx+leftpad")
ROTARY = ((0.0, True), (0.5, True), (1.0, False))  # (rotary_dim / headdim, interleaved)
MASKS = ((False, (-1, -1)), (True, (-1, -1)), (False, (24, 8)))
CASES = list(itertools.product(LAYOUTS, ROTARY, MASKS))
HEADS_KV = (6, 1, 3)  # MHA, MQA, GQA against 6 query heads, across the cases

B, SQ, NEW, HQ, D, PAGE, PER_SEQ = 3, 4, 3, 6, 64, 16, 8
S = PAGE * PER_SEQ  # the cache's capacity per sequence, dense or paged
CACHED = (7, 37, 100)  # cache_seqlens: where each sequence's cached keys end
LEFTPAD = (0, 20, 99)  # where they start, with cache_leftpad
ROWS = (4, 0, 2)  # cache_batch_idx, into a cache of 5 rows


def run_case(layout, fraction, interleaved, causal, window, hk, new=NEW, alibi=False, lse=False, d=D):
    dtype = torch.float16
    D = d  # noqa: N806 - the head dim of this case
    paged, batch_idx, leftpad = layout == "paged", "batch_idx" in layout, "leftpad" in layout
    q = G.randn(B, SQ, HQ, D, dtype=dtype)
    k_new, v_new = (G.randn(B, new, hk, D, dtype=dtype) for _ in range(2)) if new else (None, None)
    if paged:  # shuffled pages, with unused ones among them
        pool = B * PER_SEQ + 4
        k_cache, v_cache = (G.randn(pool, PAGE, hk, D, dtype=dtype) for _ in range(2))
        table = torch.randperm(pool, device=G.DEV)[:B * PER_SEQ].to(torch.int32).reshape(B, PER_SEQ)
        row_of = lambda c, n: c[table[n].long()].reshape(S, hk, D)  # noqa: E731
    else:
        k_cache, v_cache = (G.randn(5 if batch_idx else B, S, hk, D, dtype=dtype) for _ in range(2))
        table = None
        row_of = lambda c, n: c[ROWS[n] if batch_idx else n]  # noqa: E731
    rotary_dim = int(fraction * D) // 16 * 16  # FlashAttention's test: a multiple of 16
    cos = sin = None
    if rotary_dim:
        angle = torch.rand(S, rotary_dim // 2, device=G.DEV, dtype=torch.float64) * 6.283185307179586
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    cached = torch.tensor(CACHED, dtype=torch.int32, device=G.DEV)
    pads = torch.tensor(LEFTPAD, dtype=torch.int32, device=G.DEV) if leftpad else None
    rows = torch.tensor(ROWS, dtype=torch.int32, device=G.DEV) if batch_idx else None
    slopes = torch.rand(B, HQ, device=G.DEV) * 0.3 if alibi else None  # FlashAttention's tests' draw
    before_k = [row_of(k_cache, n).clone() for n in range(B)]
    before_v = [row_of(v_cache, n).clone() for n in range(B)]
    G.poison()
    got = flash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, cached, rows, pads, table,
                                        causal=causal, window_size=window, rotary_interleaved=interleaved,
                                        alibi_slopes=slopes, return_softmax_lse=lse)
    out, out_lse = got if lse else (got, None)
    assert out.shape == (B, SQ, HQ, D) and (out_lse is None or out_lse.shape == (B, HQ, SQ))
    per_row = causal or window != (-1, -1)  # FlashAttention rotates q's rows at their own positions then
    for n in range(B):
        cs, lp = CACHED[n], LEFTPAD[n] if leftpad else 0
        k_row, v_row = before_k[n].double(), before_v[n].double()
        after_k, after_v = row_of(k_cache, n), row_of(v_cache, n)
        q_n = q[n:n + 1].double()
        if new:
            k_n = k_new[n:n + 1].double()
            if rotary_dim:
                k_n = rotary_reference(k_n, cos, sin, cs + torch.arange(new, device=G.DEV)[None], interleaved)
            assert torch.allclose(after_k[cs:cs + new].double(), k_n[0], rtol=5e-3, atol=5e-3)  # rounded once
            assert torch.equal(after_v[cs:cs + new], v_new[n])
            k_row[cs:cs + new], v_row[cs:cs + new] = k_n[0], v_new[n].double()
        kept = torch.ones(S, dtype=torch.bool, device=G.DEV)
        kept[cs:cs + new] = False
        assert torch.equal(after_k[kept], before_k[n][kept]) and torch.equal(after_v[kept], before_v[n][kept])
        if rotary_dim:
            positions = cs + (torch.arange(SQ, device=G.DEV) if per_row else torch.zeros(SQ, dtype=torch.int64,
                                                                                         device=G.DEV))
            q_n = rotary_reference(q_n, cos, sin, positions[None], interleaved)
        keys, values = k_row[lp:cs + new], v_row[lp:cs + new]
        ref, ref_lse = G.reference(q_n, keys[None], values[None], causal, window, seqlen_k=S,
                                   alibi=None if slopes is None else slopes[n:n + 1])
        assert G.rel(out[n:n + 1], ref) < G.FWD_TOL[dtype], n
        if out_lse is not None:
            G.check_lse(out_lse[n:n + 1], ref_lse)


@pytest.mark.parametrize("layout,rotary,mask", CASES,
                         ids=[f"{c[0]}-ro{c[1][0]}{'i' if c[1][1] else 'n'}-c{int(c[2][0])}-w{c[2][1][0]}"
                              for c in CASES])
def test_kvcache_combinations_with_rotary_and_leftpad(layout, rotary, mask):
    i = CASES.index((layout, rotary, mask))
    # The LSE with half the head dim rotated: a paged cache then takes the gather to a dense one.
    run_case(layout, *rotary, *mask, hk=HEADS_KV[i % 3], lse=rotary[0] == 0.5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal,window", ((True, (-1, -1)), (False, (24, 8))))
def test_kvcache_alibi_with_rotary_and_leftpad(layout, causal, window):
    # ALiBi at each sequence's bottom right, counted from its cache_leftpad (FlashAttention's).
    run_case(layout, 0.5, False, causal, window, hk=3, alibi=True, lse=True)


@pytest.mark.parametrize("layout", ("paged", "batch_idx+leftpad"))
def test_kvcache_without_new_keys(layout):
    run_case(layout, 0.0, True, True, (-1, -1), hk=2, new=0, lse=layout != "paged")


@pytest.mark.parametrize("layout", ("dense", "paged", "batch_idx+leftpad"))
def test_kvcache_head_dim_not_a_multiple_of_8(layout):
    # FlashAttention's kvcache test draws d = 59: padded to 64 for cuDNN after the append (the
    # caches keep their 59), rotary on a part of it, the LSE on one layout.
    run_case(layout, 0.5, True, True, (-1, -1), hk=3, lse=layout == "dense", d=59)
