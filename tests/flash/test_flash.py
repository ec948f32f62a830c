"""fastattn.flash without a GPU: FlashAttention 2's signatures, the arguments it refuses
(NotSupportedError, naming each), argument errors, shapes on meta tensors, the KV-cache
append, and a property: the mask each call asks fastattn.torch for is FlashAttention's.
ALiBi: test_flash_alibi.py. Numerics are in test_flash_gpu.py."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
from fastattn import flash  # noqa: E402
from fastattn.integrations.flash import _alibi, _common, _interface  # noqa: E402  (tests patch _common's entry points)
from fastattn.errors import InvalidArgumentError, NotSupportedError  # noqa: E402

from helpers.gpu import fa_allowed  # noqa: E402  (FlashAttention's mask, from its documentation)
from helpers.flash import M, calls_with as _calls_with, dense, kvcache, recorded as _recorded, varlen  # noqa: E402
from helpers.paths import ROOT  # noqa: E402

# flash_attn 2.6-2.8's flash_attn_interface, argument by argument (names, order, defaults).
_FA_DENSE_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                  ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
FA_SIGNATURES = {
    "flash_attn_func": [("q", None), ("k", None), ("v", None)] + _FA_DENSE_TAIL,
    "flash_attn_qkvpacked_func": [("qkv", None)] + _FA_DENSE_TAIL,
    "flash_attn_kvpacked_func": [("q", None), ("kv", None)] + _FA_DENSE_TAIL,
    "flash_attn_varlen_func": [("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
                               ("max_seqlen_q", None), ("max_seqlen_k", None)] + _FA_DENSE_TAIL
    + [("block_table", None), ("seqused_k", None)],  # seqused_k: fastattn.flash's, at the end (FA's C++ takes it)
    "flash_attn_varlen_qkvpacked_func": [("qkv", None), ("cu_seqlens", None), ("max_seqlen", None)] + _FA_DENSE_TAIL,
    "flash_attn_varlen_kvpacked_func": [("q", None), ("kv", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
                                        ("max_seqlen_q", None), ("max_seqlen_k", None)] + _FA_DENSE_TAIL,
    "flash_attn_with_kvcache": [("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None),
                                ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
                                ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
                                ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                                ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
                                ("num_splits", 0), ("return_softmax_lse", False)],
}
_REQUIRED = {"q", "k", "v", "qkv", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "cu_seqlens",
             "max_seqlen", "k_cache", "v_cache"}


@pytest.mark.parametrize("name", sorted(FA_SIGNATURES))
def test_signatures_are_flash_attentions(name):
    params = list(inspect.signature(getattr(flash, name)).parameters.values())
    got = [(p.name, p.default) for p in params]
    expected = [(n, inspect.Parameter.empty if (n in _REQUIRED and d is None and not (
        name == "flash_attn_with_kvcache" and n in ("k", "v"))) else d) for n, d in FA_SIGNATURES[name]]
    assert got == expected
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)  # FA's are positional too
    assert name in flash.__all__


# -- what cuDNN cannot do: NotSupportedError naming the argument -------------------------------

@pytest.mark.parametrize("index", range(7))
def test_softcap_reaches_every_function_and_is_checked(index):
    # softcap runs in cuDNN's graph now (its score modifier): every function takes it and
    # hands it on (meta tensors here: the shapes come back); 0 is FlashAttention's "off".
    _calls_with(softcap=30.0)[index]()
    _calls_with(softcap=0)[index]()
    with pytest.raises(InvalidArgumentError, match=r"^softcap='30': must be a number"):
        _calls_with(softcap="30")[index]()
    with pytest.raises(InvalidArgumentError, match=r"^softcap=-1.0: must be a finite number > 0"):
        _calls_with(softcap=-1.0)[index]()


@pytest.mark.parametrize("call,match", [
    (lambda: flash.flash_attn_func(*dense(), dropout_p=0.1, return_attn_probs=True),
     r"^return_attn_probs=True with dropout_p > 0: .*S_dmask"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache()[:3], block_table=kvcache()[3],
                                           cache_batch_idx=torch.zeros(2, dtype=torch.int32)),
     r"^cache_batch_idx with block_table"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache()[:3], block_table=kvcache()[3],
                                           cache_leftpad=torch.zeros(2, dtype=torch.int32)),
     r"^cache_leftpad with block_table"),
])
def test_what_cudnn_cannot_do_is_refused_by_name(call, match):
    with pytest.raises(NotSupportedError, match=match):
        call()


def test_varlen_takes_dropout_and_standard_alibi_slopes():
    # Both pass fastattn.flash's checks and run (meta tensors: the ops' fake kernels).
    q, k, v, cu_q, cu_k = varlen()
    slopes = torch.tensor(flash.standard_alibi_slopes(q.shape[1]), dtype=torch.float32, device="meta")
    for extra in (dict(dropout_p=0.1), dict(causal=True, alibi_slopes=slopes),
                  dict(causal=True, alibi_slopes=slopes.expand(cu_q.shape[0] - 1, -1))):
        assert flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 200, **extra).shape == q.shape
    with pytest.raises(InvalidArgumentError, match=r"^dropout_p=1.5"):
        flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 200, dropout_p=1.5)


# -- argument errors --------------------------------------------------------------------------

@pytest.mark.parametrize("call,match", [
    (lambda: flash.flash_attn_func(*dense(), causal="true"), r"^causal='true': must be True or False"),
    (lambda: flash.flash_attn_func(*dense(), window_size={"left": 4}), r"^window_size=\{'left': 4\}: must be a pair"),
    (lambda: flash.flash_attn_func(*dense(), window_size=(-2, 4)), r"^window_size\[0\] \(left\)=-2: must be >= -1"),
    (lambda: flash.flash_attn_func(*dense(), dropout_p=1.0), r"^dropout_p=1.0: must be in \[0, 1\)"),
    (lambda: flash.flash_attn_func(*dense(), softmax_scale=-1.0), r"^scale=-1.0: must be a finite number > 0"),
    (lambda: flash.flash_attn_func(*dense(), deterministic="no"), r"^deterministic='no': must be True or False"),
    (lambda: flash.flash_attn_func(*dense(), return_attn_probs=1), r"^return_attn_probs=1: must be True or False"),
    (lambda: flash.flash_attn_func(dense()[0][0], *dense()[1:]), r"^q: expected a torch.Tensor \(batch, seqlen_q"),
    (lambda: flash.flash_attn_func("q", *dense()[1:]), r"^q: expected a torch.Tensor .* got str"),
    (lambda: flash.flash_attn_qkvpacked_func(torch.empty(2, 128, 2, 8, 64, **M)), r"^qkv has shape \(2, 128, 2"),
    (lambda: flash.flash_attn_kvpacked_func(dense()[0], torch.empty(2, 128, 3, 2, 64, **M)), r"^kv has shape"),
    (lambda: flash.flash_attn_varlen_func(*varlen(), 100, 200.0), r"^max_seqlen_k=200.0: must be an int"),
    (lambda: flash.flash_attn_varlen_qkvpacked_func(torch.empty(201, 2, 8, 64, **M), varlen()[3], 100),
     r"^qkv has shape \(201, 2, 8, 64\)"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache()[:3], k=torch.empty(2, 1, 2, 64, **M)), r"^k and v: give both"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache(paged=False)[:3], torch.empty(2, 1, 2, 64, **M),
                                           torch.empty(2, 1, 2, 64, **M)), r"^k, v given without cache_seqlens"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache()[:3], cache_seqlens=torch.zeros(2), block_table=kvcache()[3]),
     r"^cache_seqlens: expected an int32 tensor of shape \(2,\).* got torch.float32"),  # (a decode step's: a miss)
    (lambda: flash.flash_attn_with_kvcache(*kvcache(paged=False)[:3], cache_seqlens=torch.zeros(2)),
     r"^cache_seqlens: expected an int or an int32 tensor of shape \(2,\)"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache()[:3], num_splits=-1), r"^num_splits=-1: must be >= 0"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache()[:3], rotary_interleaved="no"),
     r"^rotary_interleaved='no': must be True or False"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache()[:3], return_softmax_lse=None),
     r"^return_softmax_lse=None: must be True or False"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache()[:3], num_splits=True), r"^num_splits=True: must be an integer"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache()[:3], num_splits=2**31), r"^num_splits=2147483648: must be < 2"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache()[:3], num_splits=1.0), r"^num_splits=1.0: must be an integer"),
    (lambda: flash.flash_attn_with_kvcache(*kvcache()[:3], rotary_interleaved=1),
     r"^rotary_interleaved=1: must be True or False"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(InvalidArgumentError, match=match):
        call()
    assert torch.is_grad_enabled()  # flash_attn_with_kvcache sets the grad mode back, raising too


def test_the_kvcache_call_leaves_the_grad_mode_as_it_found_it():
    q, k_cache, v_cache = kvcache(paged=False)[:3]
    new = torch.empty(2, 1, 2, 64, **M)
    for enabled in (True, False):
        with torch.set_grad_enabled(enabled):
            with pytest.raises(InvalidArgumentError, match="k, v given without cache_seqlens"):
                flash.flash_attn_with_kvcache(q, k_cache, v_cache, new, new)  # raised past the grad mode's switch
            assert torch.is_grad_enabled() is enabled


# -- shapes (meta tensors run the custom ops' fake implementations) ----------------------------

@pytest.mark.parametrize("sq,sk", [(100, 300), (128, 128), (400, 300)])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 3)), (True, (16, 0))])
def test_dense_shapes_and_lse_layout(sq, sk, causal, window):
    q, k, v = dense(sq=sq, sk=sk)
    assert flash.flash_attn_func(q, k, v, causal=causal, window_size=window).shape == (2, sq, 8, 64)
    out, lse, s_dmask = flash.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    assert out.shape == (2, sq, 8, 64) and lse.shape == (2, 8, sq) and lse.dtype == torch.float32
    assert s_dmask is None  # FlashAttention's S_dmask without dropout


def test_packed_and_varlen_and_kvcache_shapes():
    qkv = torch.empty(2, 128, 3, 8, 64, **M)
    out, lse, _ = flash.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    assert out.shape == (2, 128, 8, 64) and lse.shape == (2, 8, 128)
    q, k, v, cu_q, cu_k = varlen()
    out, lse, none = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 200, causal=True, return_attn_probs=True)
    assert out.shape == (201, 8, 64) and lse.shape == (8, 201) and lse.dtype == torch.float32 and none is None
    packed = torch.empty(201, 3, 8, 64, **M)
    assert flash.flash_attn_varlen_qkvpacked_func(packed, cu_q, 100, causal=True).shape == (201, 8, 64)
    qc, kc, vc, table, lens = kvcache(sq=3)
    new = torch.empty(2, 3, 2, 64, **M)
    assert flash.flash_attn_with_kvcache(qc, kc, vc, new, new, cache_seqlens=lens, block_table=table,
                                         causal=True).shape == (2, 3, 8, 64)
    qc, kc, vc, _, lens = kvcache(sq=3, paged=False)
    out, lse = flash.flash_attn_with_kvcache(qc, kc, vc, cache_seqlens=5, causal=True, return_softmax_lse=True)
    assert out.shape == (2, 3, 8, 64) and lse.shape == (2, 8, 3)


def test_kvpacked_shapes():
    q = torch.empty(2, 100, 8, 64, **M)
    kv = torch.empty(2, 300, 2, 2, 64, **M)
    out, lse, _ = flash.flash_attn_kvpacked_func(q, kv, causal=True, return_attn_probs=True)
    assert out.shape == (2, 100, 8, 64) and lse.shape == (2, 8, 100)


def test_gradients_flow_through_the_packed_views():
    qkv = torch.empty(2, 64, 3, 4, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = flash.flash_attn_qkvpacked_func(qkv, causal=True)
    assert out.requires_grad and out.grad_fn is not None


# -- the mask asked of fastattn.torch is FlashAttention's -------------------------------------

def fastattn_allowed(sq: int, sk: int, kwargs: dict) -> np.ndarray:
    """The same, from the arguments fastattn.flash gave fastattn.torch, in fastattn.torch's
    documented convention (attention()'s docstring)."""
    shift = sk - sq if kwargs["alignment"] == "bottom_right" else 0
    left, right = kwargs["window"] or (-1, -1)
    if kwargs["causal"]:
        assert right in (-1, 0)  # fastattn refuses a causal mask with right > 0
        right = 0
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    ok = np.ones((sq, sk), dtype=bool)
    if right >= 0:
        ok &= j <= i + shift + right
    if left >= 0:
        ok &= j >= i + shift - left
    return ok


_bound = st.sampled_from([-1, 0, 1, 3, 17, 63, 64, 200, 1000])


@settings(max_examples=250, deadline=None, derandomize=True)
@given(sq=st.sampled_from([1, 5, 64, 100]), sk=st.sampled_from([1, 7, 64, 100, 150]), causal=st.booleans(),
       left=_bound, right=_bound)
def test_dense_calls_ask_for_flash_attentions_mask(sq, sk, causal, left, right):
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention", flash.flash_attn_func, *dense(sq=sq, sk=sk), causal=causal,
                       window_size=(left, right))
    fa = fa_allowed(sq, sk, causal, (left, right))
    asked = kw["q"].shape[1]  # the queries that see a key; the rows cut before them see none
    assert not fa[:sq - asked].any() and (asked == sq or fa[sq - asked].any())
    assert (fastattn_allowed(asked, sk, kw) == fa[sq - asked:]).all()
    bottom = kw["alignment"] == "bottom_right"
    assert not (bottom and asked == sk)  # one diagonal there: the top-left graph, which takes dropout and ALiBi
    # cuDNN takes the bottom-right diagonal with more queries than keys only with lengths: full ones.
    assert (kw["seq_lens_q"] is not None) == (bottom and asked > sk)
    if kw["seq_lens_q"] is not None:
        assert kw["seq_lens_q"].shape == (2,) and kw["seq_lens_kv"].shape == (2,)


@pytest.mark.parametrize("sq,causal", [(1, False), (1, True), (5, True)])
@pytest.mark.parametrize("grad,lse", [(True, False), (False, True), (False, False)])
def test_one_query_and_one_key_train_as_a_padded_plan(sq, causal, grad, lse):
    # cuDNN's training plans refuse s_q = s_kv = 1 (causal 5 x 1: the four rows above the
    # diagonal are cut first): the query block is padded to two rows, the real one of
    # length 1. Inference keeps the plan as it is.
    q, k, v = dense(sq=sq, sk=1, grad=grad, device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention", flash.flash_attn_func, q, k, v, causal=causal, return_attn_probs=lse)
    if grad or lse:
        assert kw["q"].shape == (2, 2, 8, 64) and kw["seq_lens_q"].tolist() == [1, 1]
        assert kw["seq_lens_kv"].tolist() == [1, 1] and kw["q"].requires_grad == grad
    else:
        assert kw["q"].shape == (2, 1, 8, 64) and kw["seq_lens_q"] is None
    q, k, v = dense(sq=sq, sk=1, grad=grad)
    out = flash.flash_attn_func(q, k, v, causal=causal)  # meta tensors, the fake kernels: shapes
    assert out.shape == q.shape and (out.grad_fn is not None) == grad


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grad,lse", [(True, False), (False, True), (False, False)])
def test_one_query_against_many_keys_trains_as_a_padded_plan(causal, grad, lse):
    # A training plan of one query is not bitwise repeatable on cuDNN 9.19
    # (benchmarks/probe_decode.py): two rows, the second padding, the keys' own lengths; inference as it is.
    q, k, v = dense(sq=1, sk=7, grad=grad, device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention", flash.flash_attn_func, q, k, v, causal=causal, return_attn_probs=lse)
    if grad or lse:
        assert kw["q"].shape == (2, 2, 8, 64) and torch.all(kw["q"][:, 1] == 0)
        assert kw["seq_lens_q"].tolist() == [1, 1] and kw["seq_lens_kv"].tolist() == [7, 7]
        assert kw["alignment"] == ("bottom_right" if causal else "top_left")
    else:
        assert kw["q"].shape == (2, 1, 8, 64) and kw["seq_lens_q"] is None


def test_one_query_and_one_key_kvcache_lse_and_padding_rows_are_zero():
    q = torch.randn(2, 1, 8, 64, dtype=torch.float64)
    kc, vc = torch.randn(2, 1, 2, 64, dtype=torch.float64), torch.randn(2, 1, 2, 64, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention", flash.flash_attn_with_kvcache, q, kc, vc, return_softmax_lse=True)
    assert kw["q"].shape == (2, 2, 8, 64) and torch.equal(kw["q"][:, :1], q) and torch.all(kw["q"][:, 1] == 0)
    assert kw["seq_lens_q"].tolist() == [1, 1] and kw["seq_lens_kv"].tolist() == [1, 1]


@pytest.mark.parametrize("max_q,max_k,grad,padded", [(1, 1, True, True), (1, 1, False, False), (1, 2, True, True),
                                                     (1, 2, False, False), (2, 1, True, False)])
def test_varlen_one_token_sequences_train_with_a_plan_for_two(max_q, max_k, grad, padded):
    q, k, v, cu_q, cu_k = varlen()
    q.requires_grad_(grad)
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention_varlen", flash.flash_attn_varlen_func, q, k, v, cu_q, cu_k, max_q, max_k)
    assert kw["args"][2:] == ((2 if padded else max_q), max_k)


@pytest.mark.parametrize("dqk,dv", [(59, 59), (33, 72), (64, 20), (3, 3), (250, 250)])
def test_head_dims_are_padded_to_multiples_of_8_with_the_real_scale(dqk, dv):
    q = torch.randn(2, 5, 4, dqk, dtype=torch.float64)
    k, v = torch.randn(2, 7, 2, dqk, dtype=torch.float64), torch.randn(2, 7, 2, dv, dtype=torch.float64)
    for scale in (None, 0.25):
        with pytest.MonkeyPatch.context() as mp:
            kw = _recorded(mp, "attention", flash.flash_attn_func, q, k, v, softmax_scale=scale, causal=True)
        for name, t in (("q", q), ("k", k), ("v", v)):
            d = t.shape[-1]
            got = kw[name]
            assert got.shape[-1] == -(-d // 8) * 8 and torch.equal(got[..., :d], t) and torch.all(got[..., d:] == 0)
        assert kw["scale"] == (dqk ** -0.5 if scale is None else scale)
    out = flash.flash_attn_func(*(t.to("meta", torch.bfloat16) for t in (q, k, v)), causal=True)
    assert out.shape == (2, 5, 4, dv)


def test_head_dims_that_are_multiples_of_8_or_unequal_are_passed_as_they_are():
    q, k, v = dense()
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention", flash.flash_attn_func, q, k, v)
    assert kw["q"] is q and kw["k"] is k and kw["v"] is v and kw["scale"] is None  # no copy
    q, k, v = dense(d=257)  # above 256 no padding helps: cuDNN refuses with its reason
    with pytest.MonkeyPatch.context() as mp:
        assert _recorded(mp, "attention", flash.flash_attn_func, q, k, v)["q"] is q
    with pytest.raises(InvalidArgumentError, match="head"):  # q's and k's differ: fastattn.torch says so
        flash.flash_attn_func(torch.empty(2, 8, 4, 59, **M), torch.empty(2, 8, 4, 60, **M),
                              torch.empty(2, 8, 4, 59, **M))


def test_packed_head_dims_are_padded_once_packed():
    qkv = torch.empty(2, 16, 3, 4, 59, **M, requires_grad=True)
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention", flash.flash_attn_qkvpacked_func, qkv)
    assert kw["q"].shape == (2, 16, 4, 64) and kw["q"].stride() == (16 * 3 * 4 * 64, 3 * 4 * 64, 64, 1)  # one copy
    assert kw["scale"] == 59 ** -0.5
    out = flash.flash_attn_qkvpacked_func(qkv, causal=True)
    assert out.shape == (2, 16, 4, 59) and out.grad_fn is not None
    q, kv = torch.empty(2, 16, 4, 20, **M), torch.empty(2, 24, 2, 2, 20, **M)
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention", flash.flash_attn_kvpacked_func, q, kv)
    assert kw["k"].shape == (2, 24, 2, 24) and kw["k"].stride()[1] == 2 * 2 * 24 and kw["q"].shape[-1] == 24
    assert flash.flash_attn_kvpacked_func(q, kv).shape == (2, 16, 4, 20)
    q, k, v, cu_q, cu_k = varlen(d=59)
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention_varlen", flash.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 100, 200)
    assert all(kw[n].shape[-1] == 64 and kw[n].is_contiguous() for n in "qkv") and kw["scale"] == 59 ** -0.5
    assert flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, 200).shape == (201, 8, 59)
    packed = torch.empty(201, 3, 8, 59, **M)
    assert flash.flash_attn_varlen_qkvpacked_func(packed, cu_q, 100, causal=True).shape == (201, 8, 59)


@pytest.mark.parametrize("paged", (False, True))
def test_kvcache_pads_head_dims_not_multiples_of_8_after_the_append(paged):
    q, k_cache, v_cache, table, lens = kvcache(d=59, paged=paged)
    k_new, v_new = (torch.randn(q.shape[0], 1, k_cache.shape[2], 59, **M) for _ in range(2))
    with pytest.MonkeyPatch.context() as mp:  # a paged cache with a padded head dim is gathered: attention
        kw = _recorded(mp, "attention", flash.flash_attn_with_kvcache, q, k_cache, v_cache, k_new, v_new,
                       cache_seqlens=lens, block_table=table)
    assert all(kw[n].shape[-1] == 64 for n in "qkv") and kw["scale"] == 59 ** -0.5
    assert flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table).shape[-1] == 59
    assert k_cache.shape[-1] == v_cache.shape[-1] == 59  # the caller's caches, appended to, not replaced


def test_rows_without_keys_are_zero_with_an_lse_of_inf():
    q, k, v = dense(sq=300, sk=100)
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention", flash.flash_attn_func, q, k, v, causal=True, return_attn_probs=True)
    assert kw["q"].shape[1] == 100 and kw["alignment"] == "top_left" and kw["seq_lens_q"] is None
    q, k, v = dense(sq=300, sk=100, device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_common, "attention", lambda q, k, v, **kw: (torch.ones(*q.shape), torch.ones(2, 8, q.shape[1])))
        out, lse, _ = flash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == (2, 300, 8, 64) and torch.all(out[:, :200] == 0) and torch.all(out[:, 200:] == 1)
    assert lse.shape == (2, 8, 300) and torch.all(lse[..., :200] == float("inf")) and torch.all(lse[..., 200:] == 1)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(sq=st.sampled_from([1, 5, 64]), sk=st.sampled_from([1, 7, 100]), causal=st.booleans(), left=_bound,
       right=_bound, same_cu=st.booleans())
def test_varlen_calls_ask_for_flash_attentions_mask(sq, sk, causal, left, right, same_cu):
    q, k, v, cu_q, cu_k = varlen()
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention_varlen", flash.flash_attn_varlen_func, q, k, v, cu_q, cu_q if same_cu else cu_k,
                       sq, sk, causal=causal, window_size=(left, right))
    # Per sequence, with its own lengths: each (sq_b, sk_b) with sk_b <= max_seqlen_k.
    for sq_b, sk_b in ((sq, sk), (max(1, sq // 2), sk), (sq, max(1, sk - 3))):
        if same_cu:
            sk_b = sq_b  # one cu_seqlens: each sequence's q and k lengths are equal
        fa = fa_allowed(sq_b, sk_b, causal, (left, right), seqlen_k=sk)  # max_seqlen_k normalizes
        assert (fastattn_allowed(sq_b, sk_b, kw) == fa).all()


@settings(max_examples=120, deadline=None, derandomize=True)
@given(sq=st.sampled_from([1, 4]), cached=st.sampled_from([0, 5, 40]), new=st.sampled_from([0, 1, 4]),
       causal=st.booleans(), left=_bound, right=_bound, paged=st.booleans())
def test_kvcache_calls_ask_for_flash_attentions_mask(sq, cached, new, causal, left, right, paged):
    q, k_cache, v_cache, table, lens = kvcache(sq=sq, paged=paged)
    extra = {} if not new else dict(k=torch.empty(2, new, 2, 64, **M), v=torch.empty(2, new, 2, 64, **M))
    name = "attention_paged" if paged else "attention"
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, name, flash.flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=lens,
                       block_table=table, causal=causal, window_size=(left, right), **extra)
    assert kw["alignment"] == "bottom_right"  # each sequence's queries sit at the end of its keys
    sk_max = 4 * 16
    sk = cached + new
    fa = fa_allowed(sq, sk, causal, (left, right), seqlen_k=sk_max)  # the cache's capacity normalizes
    if sk:
        assert (fastattn_allowed(sq, sk, kw) == fa).all()


# -- the KV cache append (plain torch: runs on the CPU) ---------------------------------------

def test_append_writes_each_sequence_at_its_length_dense_and_paged():
    torch.manual_seed(0)
    b, s_new, hk, d, page = 3, 4, 2, 8, 4
    lengths = torch.tensor([0, 5, 9], dtype=torch.int32)
    k_new, v_new = torch.randn(b, s_new, hk, d), torch.randn(b, s_new, hk, d)
    # dense, with cache_batch_idx picking rows 4, 0, 2 of a 5-row cache
    k_cache, v_cache = torch.zeros(5, 16, hk, d), torch.zeros(5, 16, hk, d)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32)
    _interface._append(k_cache, v_cache, k_new, v_new, lengths, None, rows)
    for i, (r, n) in enumerate(zip(rows.tolist(), lengths.tolist())):
        assert torch.equal(k_cache[r, n:n + s_new], k_new[i]) and torch.equal(v_cache[r, n:n + s_new], v_new[i])
    assert k_cache.count_nonzero() == k_new.count_nonzero()  # nothing else written
    # paged, with shuffled pages
    table = torch.randperm(12, dtype=torch.int64).reshape(b, 4).to(torch.int32)
    k_pool, v_pool = torch.zeros(12, page, hk, d), torch.zeros(12, page, hk, d)
    _interface._append(k_pool, v_pool, k_new, v_new, lengths, table, None)
    for i, n in enumerate(lengths.tolist()):
        seq_k = k_pool[table[i].long()].reshape(-1, hk, d)  # the sequence's pages in order
        seq_v = v_pool[table[i].long()].reshape(-1, hk, d)
        assert torch.equal(seq_k[n:n + s_new], k_new[i]) and torch.equal(seq_v[n:n + s_new], v_new[i])
    assert k_pool.count_nonzero() == k_new.count_nonzero()


# -- fastattn.torch's alignment, LSE and bias shapes -------------------------------------------

def test_attention_alignment_and_lse_options():
    from fastattn.torch import attention

    q, k, v = dense(sq=64, sk=128)
    with pytest.raises(InvalidArgumentError, match=r"^alignment='bottom': must be 'top_left' or 'bottom_right'"):
        attention(q, k, v, window=(4, 4), alignment="bottom")
    with pytest.raises(InvalidArgumentError, match=r"^return_lse='yes': must be True or False"):
        attention(q, k, v, return_lse="yes")
    o, lse = attention(q, k, v, window=(4, 4), alignment="bottom_right", return_lse=True)
    assert o.shape == q.shape and lse.shape == (2, 8, 64) and lse.dtype == torch.float32
    o, lse = attention(*dense(sq=64, sk=128, grad=True), causal=True, return_lse=True)
    assert o.requires_grad


def test_attention_key_padding_bias_shapes_are_named():
    from fastattn.torch._dense import _bias_shape

    q = torch.empty(2, 64, 8, 32, **M)
    for shape, name in (((1, 1, 1, 128), "111s"), ((2, 1, 1, 128), "b11s"), ((1, 8, 1, 128), "1h1s"),
                        ((2, 8, 1, 128), "bh1s"), ((2, 8, 64, 128), "bhss"), ((1, 1, 64, 128), "11ss")):
        assert _bias_shape(q, torch.empty(shape, **M), "bshd") == name
    assert _bias_shape(torch.empty(2, 1, 8, 32, **M), torch.empty(2, 1, 1, 128, **M), "bshd") == "b1ss"  # sq 1
    q, k, v = dense(sq=64, sk=128)
    assert fastattn.torch.attention(q, k, v, bias=torch.empty(2, 1, 1, 128, **M)).shape == q.shape


def test_attention_paged_asks_for_an_explicit_alignment():
    from fastattn.torch import attention_paged

    q, k, v, table, lens = kvcache()
    with pytest.raises(InvalidArgumentError, match=r"^attention_paged\(causal=True\) needs an explicit alignment"):
        attention_paged(q, k, v, table, lens, causal=True)
    with pytest.raises(InvalidArgumentError, match=r"^attention_paged\(window=\(8, 0\)\) needs an explicit alignment"):
        attention_paged(q, k, v, table, lens, window=(8, 0))
    with pytest.raises(InvalidArgumentError, match=r"contradict"):
        attention_paged(q, k, v, table, lens, causal_bottom_right=True, alignment="top_left")
    with pytest.raises(InvalidArgumentError, match=r"^alignment='br'"):
        attention_paged(q, k, v, table, lens, causal=True, alignment="br")
    for kwargs in (dict(causal=True, alignment="bottom_right"), dict(causal=True, alignment="top_left"),
                   dict(causal_bottom_right=True), dict(), dict(window=(8, 0), alignment="bottom_right")):
        assert attention_paged(q, k, v, table, lens, **kwargs).shape == (2, 1, 8, 64)


def test_the_benchmark_imports_and_parses_its_arguments():
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_flash.py"), "--help"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "--json" in r.stdout and "--quick" in r.stdout and "summary:" in r.stdout


def test_the_benchmarks_flop_count_of_a_bottom_right_causal_mask_is_its_pairs():
    from helpers.benchmarks import load

    bench = load("bench_flash")
    for sq, sk in [(1, 1), (3, 7), (7, 3), (16, 300), (5, 5)]:
        pairs = sum(1 for i in range(sq) for j in range(sk) if j <= i + sk - sq)  # FlashAttention's causal mask
        assert bench._causal_pairs(sq, sk) == pairs


@pytest.mark.parametrize("sq,sk", [(128, 128), (64, 200), (300, 100)])
def test_flash_attn_func_traces_to_fastattns_ops(sq, sk):
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v):
        out, lse, _ = flash.flash_attn_func(q, k, v, causal=True, window_size=(32, 8), return_attn_probs=True)
        return out, lse

    gm = make_fx(step, tracing_mode="fake")(*dense(sq=sq, sk=sk))
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "fastattn" in str(n.target)]
    assert calls == ["fastattn.attention_forward.default"]
    out, lse = (n.meta["val"] for n in gm.graph.output_node().args[0])
    assert tuple(out.shape) == (2, sq, 8, 64) and tuple(lse.shape) == (2, 8, sq)


# Values a caller might pass for a bool or an int option: the kvcache call's inline checks
# (its common cases first) must refuse and accept exactly what fastattn._fields.check does.
_ODD_VALUES = st.one_of(st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True), st.none(),
                        st.text(max_size=3), st.sampled_from([np.bool_(True), np.int64(3), np.float32(1.0), 1 + 0j]))


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(("num_splits", "rotary_interleaved", "return_softmax_lse")), value=_ODD_VALUES)
def test_the_kvcache_options_inline_checks_agree_with_the_fields_checks(name, value):
    kind = "int" if name == "num_splits" else "bool"
    try:
        fastattn._fields.check(kind, name, value)
        want = None
    except InvalidArgumentError as e:
        want = str(e)
    try:
        flash.flash_attn_with_kvcache(*kvcache(paged=False)[:3], **{name: value})
        got = None
    except InvalidArgumentError as e:
        got = str(e)
    assert got == want, (name, value)
