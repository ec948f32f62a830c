"""fastattn.flash end to end on the CPU, over a float64 model of fastattn.torch's
documented semantics (the alignment's shift per sequence, windows, padding lengths,
packed sequences, page tables, the LSE layouts): the GPU tests of test_flash_gpu.py run
here with their device set to the CPU and fastattn.torch's entry points replaced by the
model. What this checks: fastattn.flash's own arithmetic (FlashAttention's
normalizations, the lengths it passes, the KV-cache append, the packed views, the LSE
layouts) and the GPU tests' own logic. What it cannot check: cuDNN (the GPU run does),
including what cuDNN writes for a row that sees no key (the model writes FlashAttention's
0 and +inf there). The model refuses what cuDNN documents that it refuses (refuse()), so
that a composition fastattn.flash makes around a refusal is seen taking its path here."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from fastattn.errors import NotSupportedError  # noqa: E402
from fastattn.integrations.flash import _common  # noqa: E402  (whose fastattn.torch entry points the tests replace)
from fastattn.torch._dense import _check_extras  # noqa: E402
from fastattn.torch._plans import AXES  # noqa: E402
from fastattn.torch._varlen import bucket  # noqa: E402

import test_flash_gpu as G  # noqa: E402
import test_flash_kvcache_gpu as K  # noqa: E402
import test_flash_varlen_gpu as V  # noqa: E402
import test_flash_paged_gpu as P  # noqa: E402
from helpers.gpu import alibi_slopes  # noqa: E402


def _stored_bottom_right(s_q, s_kv, bottom, causal, window, bias, dropout_p, alibi, padded) -> bool:
    """Whether the plan cuDNN is asked for keeps a bottom-right diagonal with a right bound:
    the config's own stored form (AttentionConfig's alignment), not a copy of its rule."""
    from fastattn import AttentionConfig

    cfg = AttentionConfig(batch=1, heads_q=1, seqlen_q=s_q, seqlen_kv=s_kv, head_dim_qk=8,
                          mask="causal" if causal else "none", alignment="bottom_right" if bottom else None,
                          window=window or (-1, -1), bias="11ss" if bias is not None else "none", dropout=dropout_p,
                          padding=padded, alibi=alibi)
    return cfg.mask == "causal_bottom_right" or (cfg.alignment == "bottom_right" and cfg.window[1] >= 0)


def refuse(q, k, v, *, training, s_q, s_kv, bottom, mask, alibi=False, bias=None, dropout_p=0.0, softcap=0.0,
           causal=False, window=None, padded=True):
    """cuDNN's documented refusals (cudnn-frontend 1.28's validate() of its SDPA nodes) for
    a plan of s_q x s_kv, as NotSupportedError: fastattn.flash must compose around them."""
    if q.shape[-1] % 8 or v.shape[-1] % 8:
        raise NotSupportedError("model of cuDNN: hidden_dim should be multiple of 8")
    if training and s_q == 1 and s_kv == 1:  # a training plan builds its backward graph too
        raise NotSupportedError("model of cuDNN: s_q = s_kv = 1 is not supported.")
    if bottom and mask and (alibi or bias is not None or dropout_p) and _stored_bottom_right(
            s_q, s_kv, bottom, causal, window, bias, dropout_p, alibi, padded):
        raise NotSupportedError("model of cuDNN: Bottom right causal mask is only supported with is_bias=False, "
                                "is_alibi=False, is_dropout=False")
    if alibi and mask != "causal":
        raise NotSupportedError("model of cuDNN: When alibi mask is used, diagonal_band_right_bound needs to be set "
                                "to 0.")
    if alibi and softcap:
        raise NotSupportedError("model of cuDNN: Attention score mod enabled and hence other subgraphs are disabled.")
    if bias is not None and training and bias.shape[2] == 1 and s_q > 1:
        raise NotSupportedError("model of fastattn: a bias of one row has no correct backward here")


def _mask_kind(causal, window):
    left, right = window or (-1, -1)
    return "causal" if causal or right == 0 else "window" if (left, right) != (-1, -1) else None


def _one(q, k, v, causal, window, scale, shift, alibi=False, softcap=0.0, bias=None):
    """One sequence, (h, sq, d) float64, fastattn's convention: query i sees keys j with
    i + shift - left <= j <= i + shift + right (causal: right 0); bias (1 or h, sq, sk)
    added after the cap, before the mask, as cuDNN's graph adds it. (out, lse)."""
    hq, sq, d = q.shape
    hk, sk = k.shape[0], k.shape[1]
    if sk == 0:  # no key at all: FlashAttention's 0 and +inf
        return q.new_zeros(hq, sq, v.shape[2]), q.new_full((hq, sq), float("inf"))
    k, v = k.repeat_interleave(hq // hk, 0), v.repeat_interleave(hq // hk, 0)
    s = (d ** -0.5 if scale is None else scale) * q @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    if alibi:  # cuDNN's: slope * (j - i) at the top left
        s = s + torch.from_numpy(alibi_slopes(hq))[:, None, None] * (j - i)
    left, right = window or (-1, -1)
    if causal:
        right = 0
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        ok &= j <= i + shift + right
    if left >= 0:
        ok &= j >= i + shift - left
    s = s.masked_fill(~ok, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    out = e / torch.where(l > 0, l, torch.ones_like(l)) @ v
    lse = torch.where(l > 0, m + l.log(), torch.full_like(l, float("inf"))).squeeze(-1)
    return out, lse


def model_attention(q, k, v, *, causal=False, causal_bottom_right=False, window=None, scale=None, layout="bshd",
                    deterministic=False, seq_lens_q=None, seq_lens_kv=None, alibi=False, bias=None, dropout_p=0.0,
                    sinks=None, alignment="top_left", return_lse=False, softcap=0.0):
    assert layout == "bshd" and sinks is None and isinstance(deterministic, bool)
    if seq_lens_kv is None:
        seq_lens_kv = seq_lens_q
    for t in (seq_lens_q, seq_lens_kv):
        assert t is None or (t.dtype == torch.int32 and t.shape == (q.shape[0],))
    _check_extras(q, k, "bshd", bias, None)
    b, sq = q.shape[0], q.shape[1]
    sk = k.shape[1]
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))
    bottom = alignment == "bottom_right" or causal_bottom_right
    refuse(q, k, v, training=grads or return_lse, s_q=sq, s_kv=sk, bottom=bottom,
           mask=_mask_kind(causal or causal_bottom_right, window), alibi=alibi, bias=bias, dropout_p=dropout_p,
           softcap=softcap, causal=causal or causal_bottom_right, window=window, padded=seq_lens_q is not None)
    if dropout_p:
        pytest.skip("dropout: the model has none (the GPU run checks it)")
    outs, lses = [], []
    for n in range(b):
        lq = sq if seq_lens_q is None else int(seq_lens_q[n])
        lk = sk if seq_lens_kv is None else int(seq_lens_kv[n])
        shift = lk - lq if bottom else 0
        bias_n = None if bias is None else bias[n if bias.shape[0] > 1 else 0, :, :lq, :lk].double()
        o, lse = _one(*(t[n, :m].double().transpose(0, 1) for t, m in ((q, lq), (k, lk), (v, lk))),
                      causal or causal_bottom_right, window, scale, shift, alibi, softcap, bias_n)
        outs.append(torch.cat([o.transpose(0, 1), o.new_zeros(sq - lq, *o.shape[::2])]))
        lses.append(torch.cat([lse, lse.new_zeros(lse.shape[0], sq - lq)], 1))
    out = torch.stack(outs).to(q.dtype)
    return (out, torch.stack(lses).float()) if return_lse else out


def model_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, causal_bottom_right=False, window=None,
                 scale=None, deterministic=False, alignment="top_left", alibi=False, dropout_p=0.0, return_lse=False,
                 softcap=0.0):
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    refuse(q, k, v, training=grads or return_lse, s_q=bucket(max_q), s_kv=bucket(max_k),
           bottom=alignment == "bottom_right" or causal_bottom_right,
           mask=_mask_kind(causal or causal_bottom_right, window), alibi=alibi, dropout_p=dropout_p, softcap=softcap)
    if dropout_p:
        pytest.skip("dropout: the model has none (the GPU run checks it)")
    outs, lses = [], []
    for n in range(cu_q.shape[0] - 1):
        a, z, ak, zk = int(cu_q[n]), int(cu_q[n + 1]), int(cu_k[n]), int(cu_k[n + 1])
        shift = (zk - ak) - (z - a) if alignment == "bottom_right" or causal_bottom_right else 0
        o, lse = _one(q[a:z].double().transpose(0, 1), k[ak:zk].double().transpose(0, 1),
                      v[ak:zk].double().transpose(0, 1), causal or causal_bottom_right, window, scale, shift, alibi,
                      softcap)
        outs.append(o.transpose(0, 1))
        lses.append(lse)
    out = torch.cat(outs).to(q.dtype)
    return (out, torch.cat(lses, 1).float()) if return_lse else out


def model_paged(q, k_cache, v_cache, table, lengths, *, seq_lens_q=None, causal=False, causal_bottom_right=False,
                window=None, scale=None, alignment=None, softcap=0.0):
    if q.shape[-1] % 8 or v_cache.shape[-1] % 8:
        raise NotSupportedError("model of cuDNN: hidden_dim should be multiple of 8")
    b, per_seq, page = table.shape[0], table.shape[1], k_cache.shape[1]
    k = k_cache[table.long()].reshape(b, per_seq * page, *k_cache.shape[2:])
    v = v_cache[table.long()].reshape(b, per_seq * page, *v_cache.shape[2:])
    assert alignment is not None or not (causal or window)
    return model_attention(q, k, v, causal=causal, causal_bottom_right=causal_bottom_right, window=window,
                           scale=scale, seq_lens_q=seq_lens_q, seq_lens_kv=lengths, alignment=alignment or "top_left",
                           softcap=softcap)


@pytest.fixture
def model(monkeypatch):
    monkeypatch.setattr(G, "DEV", "cpu")
    monkeypatch.setattr(G, "poison", lambda: None)
    # The model builds what cuDNN 9.19 builds: no known gap (fastattn.defects.GAPS) refuses here.
    monkeypatch.setattr(G, "softcap_with_lengths_refused", lambda: None)
    monkeypatch.setattr(_common, "attention", model_attention)
    monkeypatch.setattr(_common, "attention_varlen", model_varlen)
    monkeypatch.setattr(_common, "attention_paged", model_paged)
    monkeypatch.setattr(_common, "paged_run", lambda q, kc, vc, table, lengths, seq_lens_q, o: model_paged(
        q, kc, vc, table, lengths, seq_lens_q=seq_lens_q, causal=o.causal, window=None if (o.window_left, o.window_right)
        == (-1, -1) else (o.window_left, o.window_right), scale=o.scale or None,
        alignment="bottom_right" if o.bottom_right else "top_left", softcap=o.softcap))
    assert AXES["bshd"] == (0, 2, 1, 3)


_DENSE = [c for c in G.DENSE if c[0] is torch.bfloat16]


@pytest.mark.parametrize("dtype,shape,mask", _DENSE)
def test_dense(model, dtype, shape, mask):
    G.test_flash_attn_func_matches_flash_attentions_semantics(dtype, shape, mask)


@pytest.mark.parametrize("causal,window", ((True, (-1, -1)), (False, (32, 32))))
def test_packed(model, causal, window):
    G.test_qkvpacked_and_kvpacked(causal, window)


@pytest.mark.parametrize("dtype,mask", [c for c in V.VARLEN if c[0] is torch.bfloat16])
def test_varlen(model, dtype, mask):
    V.test_varlen_each_sequence_at_its_own_bottom_right(dtype, mask)


def test_varlen_packed(model):
    V.test_varlen_packed_variants()


@pytest.mark.parametrize("hq,hk,dv", ((4, 4, 64), (4, 1, 64), (4, 4, 32)))
def test_varlen_alibi(model, hq, hk, dv):
    V.test_varlen_alibi_and_shared_offsets(hq, hk, dv)


@pytest.mark.parametrize("softcap,window", [(0.0, (-1, -1)), (50.0, (40, 7))])
def test_varlen_one_query_per_sequence(model, softcap, window):
    V.test_varlen_one_query_per_sequence_with_fewer_key_heads_trains_right("flash", softcap, window)


@pytest.mark.parametrize("paged,sq,append,mask", G.KV)
def test_kvcache(model, paged, sq, append, mask):
    G.test_kvcache_decode_and_prefill_with_append(paged, sq, append, mask)


def test_kvcache_batch_idx(model):
    G.test_kvcache_cache_batch_idx_and_int_cache_seqlens()


@pytest.mark.parametrize("batched", (False, True))
def test_alibi(model, batched):
    G.test_standard_alibi_slopes_with_causal(batched)


def test_scale(model):
    G.test_softmax_scale_and_deterministic()


@pytest.mark.parametrize("causal,window", G.SOFTCAP_MASKS)
def test_softcap(model, causal, window):
    G.test_softcap_forward_lse_and_backward(torch.float16, causal, window)


def test_softcap_varlen_and_kvcache(model):
    G.test_softcap_in_varlen_and_kvcache()


@pytest.mark.parametrize("sq,causal,window", G.ONE_KEY)
def test_one_query_and_one_key(model, sq, causal, window):
    G.test_one_query_and_one_key_train(torch.bfloat16, sq, causal, window)


@pytest.mark.parametrize("same_cu", (True, False))
def test_varlen_one_token_sequences(model, same_cu):
    G.test_varlen_one_token_sequences_train(same_cu)


def test_kvcache_lse_one_key(model):
    G.test_kvcache_lse_with_a_cache_of_one_key()


@pytest.mark.parametrize("dqk,dv", G.HEAD_DIMS)
def test_head_dims(model, dqk, dv):
    G.test_head_dims_not_multiples_of_8(torch.bfloat16, dqk, dv)


@pytest.mark.parametrize("d", (59, 20))
def test_head_dims_packed_and_varlen(model, d):
    G.test_head_dims_not_multiples_of_8_packed_and_varlen(d)


@pytest.mark.parametrize("kind", ("paper", "random", "batched"))
@pytest.mark.parametrize("dtype,shape,mask", [c for c in G.ALIBI if c[0] is torch.bfloat16])
def test_alibi_any_slopes(model, dtype, shape, mask, kind):
    G.test_alibi_any_slopes_causal_or_not(dtype, shape, mask, kind)


@pytest.mark.parametrize("same_cu", (True, False))
@pytest.mark.parametrize("causal,window", ((False, (-1, -1)), (True, (-1, -1)), (False, (8, 4)), (True, (20, -1))))
def test_varlen_alibi_any_slopes(model, same_cu, causal, window):
    G.test_varlen_alibi_any_slopes(same_cu, causal, window)


@pytest.mark.parametrize("paged,sq,append,mask", G.KV)
def test_kvcache_alibi(model, paged, sq, append, mask):
    G.test_kvcache_alibi_any_slopes(paged, sq, append, mask)


def test_softcap_with_alibi(model):
    G.test_softcap_with_alibi_composes_as_a_bias()


def test_compositions_combine(model):
    G.test_the_compositions_combine()


@pytest.mark.parametrize("seqused", (False, True))
@pytest.mark.parametrize("causal,window", P.PAGED_MASKS)
def test_varlen_paged_plan(model, causal, window, seqused):
    P.test_varlen_paged_forward_on_cudnns_paged_plan(causal, window, seqused)


@pytest.mark.parametrize("kind", P.GATHERED)
def test_varlen_paged_gather(model, kind):
    P.test_varlen_paged_gradients_lse_alibi_and_odd_head_dims_through_the_gather(kind)


@pytest.mark.parametrize("causal,window", ((True, (-1, -1)), (False, (16, 0))))
def test_varlen_seqused_k(model, causal, window):
    P.test_varlen_seqused_k_without_block_table(causal, window)


@pytest.mark.parametrize("layout,rotary,mask", K.CASES)
def test_kvcache_combinations(model, layout, rotary, mask):
    K.test_kvcache_combinations_with_rotary_and_leftpad(layout, rotary, mask)


@pytest.mark.parametrize("layout", K.LAYOUTS)
@pytest.mark.parametrize("causal,window", ((True, (-1, -1)), (False, (24, 8))))
def test_kvcache_alibi_rotary_leftpad(model, layout, causal, window):
    K.test_kvcache_alibi_with_rotary_and_leftpad(layout, causal, window)


@pytest.mark.parametrize("layout", ("paged", "batch_idx+leftpad"))
def test_kvcache_without_new_keys(model, layout):
    K.test_kvcache_without_new_keys(layout)


@pytest.mark.parametrize("layout", ("dense", "paged", "batch_idx+leftpad"))
def test_kvcache_head_dim_59(model, layout):
    K.test_kvcache_head_dim_not_a_multiple_of_8(layout)
