"""fastattn.flash's ALiBi without a GPU: the slopes' checks, cuDNN's own ALiBi where it is
FlashAttention's and an additive bias elsewhere (dense, varlen, kvcache), the bias rows'
shift, traced and fake-tensor calls, the standard slopes. Numerics: test_flash_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
from fastattn import flash  # noqa: E402
from fastattn.integrations.flash import _alibi, _common  # noqa: E402  (tests patch _common's entry points)
from fastattn.errors import InvalidArgumentError  # noqa: E402

from helpers.flash import M, calls_with as _calls_with, dense, kvcache, recorded as _recorded, varlen  # noqa: E402
from helpers.gpu import fa_allowed  # noqa: E402


def test_alibi_slopes_are_checked_and_any_reach_fastattn_torch():
    q, k, v = dense(device="cpu")  # CPU tensors: the slopes are checked before the device is
    for bad in (torch.ones(4), torch.ones(8, dtype=torch.float64), torch.ones(3, 8), [0.5] * 8):
        with pytest.raises(InvalidArgumentError, match=r"^alibi_slopes: expected a float32 tensor of shape \(8,\)"):
            flash.flash_attn_func(q, k, v, causal=True, alibi_slopes=bad)
    with pytest.raises(InvalidArgumentError, match=r"^alibi_slopes is on meta, q on cpu: expected one device"):
        flash.flash_attn_func(q, k, v, causal=True, alibi_slopes=torch.ones(8, device="meta"))
    slopes = torch.tensor(flash.standard_alibi_slopes(8), dtype=torch.float32)
    for good in (slopes, slopes.expand(2, 8), torch.full((8,), 0.5), torch.rand(2, 8)):
        for causal in (True, False):  # any slopes, causal or not, reach fastattn.torch's device check
            with pytest.raises(InvalidArgumentError, match=r"^q is on cpu"):
                flash.flash_attn_func(q, k, v, causal=causal, alibi_slopes=good)


@pytest.mark.parametrize("index", range(7))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("standard,batched", [(True, False), (False, False), (False, True)])
def test_alibi_reaches_every_function(index, causal, standard, batched):
    # Meta tensors (the ops' fake kernels, and the bias built on them): the shapes come back.
    slopes = torch.tensor(flash.standard_alibi_slopes(8), dtype=torch.float32) if standard else torch.rand(8) * 0.3
    slopes = slopes.to("meta")  # (on q's device, as FlashAttention requires: the bias path then, nothing to read)
    call = _calls_with(alibi_slopes=slopes.expand(2, 8) if batched else slopes, causal=causal)[index]
    out = call()
    assert out.shape[-1] == 64 and out.shape[-2] == 8


def _bias_of(slopes, sq, sk, shift=None):
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    return -slopes.double()[..., None, None] * (i + (sk - sq if shift is None else shift) - j).abs()


def test_alibi_takes_cudnns_own_where_it_is_flash_attentions_and_a_bias_elsewhere():
    paper = torch.tensor(flash.standard_alibi_slopes(8), dtype=torch.float32)
    other = torch.rand(2, 8) * 0.3
    q, k, v = (t.to(torch.float16) for t in dense(sq=64, sk=64, device="cpu"))

    def asked(q, k, v, **kw):
        with pytest.MonkeyPatch.context() as mp:
            return _recorded(mp, "attention", flash.flash_attn_func, q, k, v, **kw)

    # cuDNN's ALiBi: the paper's slopes, causal, as many queries as keys, no softcap.
    kw = asked(q, k, v, causal=True, alibi_slopes=paper)
    assert kw["alibi"] is True and kw["bias"] is None and kw["causal"] is True
    # Otherwise a bias: (1 or batch, heads, seqlen_q, seqlen_k), q's dtype, contiguous,
    # -slope * |i + sk - sq - j|, and the mask, top-left here, stays cuDNN's.
    for slopes, extra in ((other, dict(causal=True)), (paper, dict(causal=False)), (paper, dict(window_size=(8, 8))),
                          (paper, dict(causal=True, softcap=30.0))):
        kw = asked(q, k, v, alibi_slopes=slopes, **extra)
        bias = kw["bias"]
        assert kw["alibi"] is False and bias.dtype == torch.float16 and bias.is_contiguous()
        assert bias.shape == (slopes.shape[0] if slopes.dim() == 2 else 1, 8, 64, 64)
        assert torch.allclose(bias.double(), _bias_of(slopes, 64, 64).view(bias.shape), rtol=1e-3, atol=0)
        assert kw["causal"] == extra.get("causal", False) and kw["alignment"] == "top_left"
    # A bottom-right diagonal (seqlen_q < seqlen_k) goes into the bias, which cuDNN refuses beside one.
    q, k, v = dense(sq=5, sk=12, device="cpu")
    kw = asked(q, k, v, causal=True, window_size=(3, -1), alibi_slopes=paper)
    assert kw["causal"] is False and kw["window"] is None and kw["alignment"] == "top_left"
    assert kw["seq_lens_q"] is None
    i, j = torch.arange(5)[:, None], torch.arange(12)[None, :]
    rel = i + 7 - j
    allowed = (rel >= 0) & (rel <= 3)
    bias = kw["bias"][0].double()
    assert torch.all(bias[:, ~allowed] == _alibi._masked(torch.bfloat16))
    expected = _bias_of(paper, 5, 12)
    assert torch.allclose(bias[:, allowed], expected[:, allowed], rtol=1e-2, atol=0)


def test_alibi_bias_rows_are_shifted_to_keep_their_precision_and_the_lse_shifted_back():
    # 6 queries, 3 keys, no mask: the first three rows' diagonals lie before the keys, so
    # every key of theirs is far; each row is shifted by its largest bias (0 at the key
    # nearest its diagonal), which softmax ignores and the LSE gets back.
    slopes = torch.tensor([0.5, 2.0])
    q, k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    seen = []

    def fake(q, k, v, **kw):
        seen.append(kw["bias"])
        return torch.zeros(1, 6, 2, 8), torch.zeros(1, 2, 6)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_common, "attention", fake)
        _, lse, _ = flash.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True)
    bias = seen[0][0].double()  # (heads, 6, 3)
    nearest = torch.tensor([3.0, 2.0, 1.0, 0.0, 0.0, 0.0])  # from each diagonal i - 3 to the keys 0..2
    assert torch.equal(bias.amax(-1), torch.zeros(2, 6))
    assert torch.allclose(bias, _bias_of(slopes, 6, 3) + slopes.double()[:, None, None] * nearest[:, None])
    assert torch.allclose(lse[0].double(), -slopes.double()[:, None] * nearest)  # the LSE of all-zero scores, shifted


def test_alibi_in_a_trace_takes_the_bias_without_reading_the_slopes():
    from torch.fx.experimental.proxy_tensor import make_fx

    paper = torch.tensor(flash.standard_alibi_slopes(8), dtype=torch.float32)

    def step(q, k, v, slopes):
        out, lse, _ = flash.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
        return out, lse

    gm = make_fx(step, tracing_mode="fake")(*dense(), paper)  # the fake slopes hold no values: the bias path
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "fastattn" in str(n.target)]
    assert calls == ["fastattn.attention_forward.default"]
    forward = next(n for n in gm.graph.nodes if str(n.target) == "fastattn.attention_forward.default")
    assert forward.args[5] is not None  # the bias, computed in the graph from the slopes


def test_alibi_composes_under_fake_cuda_tensors():
    # What torch.compile's and torch.export's tracing hand the functions: every ALiBi path
    # (the bias, the padded dense varlen call, the gathered pages) traces without CUDA.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):
        c = dict(device="cuda", dtype=torch.bfloat16)
        slopes = torch.rand(2, 8, device="cuda")
        q, k, v = torch.zeros(2, 5, 8, 59, **c), torch.zeros(2, 9, 2, 59, **c), torch.zeros(2, 9, 2, 59, **c)
        assert flash.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes).shape == (2, 5, 8, 59)
        cu_q = torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 4, 12], dtype=torch.int32, device="cuda")
        q, k, v = torch.zeros(8, 8, 64, **c), torch.zeros(12, 2, 64, **c), torch.zeros(12, 2, 64, **c)
        out, lse, _ = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 8, causal=True, alibi_slopes=slopes,
                                                   return_attn_probs=True)
        assert out.shape == (8, 8, 64) and lse.shape == (8, 8)
        q, pages = torch.zeros(2, 1, 8, 64, **c), torch.zeros(6, 16, 2, 64, **c)
        table = torch.zeros(2, 3, dtype=torch.int32, device="cuda")
        lens = torch.full((2,), 20, dtype=torch.int32, device="cuda")
        assert flash.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=lens, block_table=table, causal=True,
                                             alibi_slopes=slopes).shape == (2, 1, 8, 64)


def test_varlen_alibi_paths():
    paper = torch.tensor(flash.standard_alibi_slopes(8), dtype=torch.float32)
    lens_q, lens_k = [3, 5], [7, 5]
    cu_q, cu_k = (torch.tensor([0, *np.cumsum(n)], dtype=torch.int32) for n in (lens_q, lens_k))
    q, k, v = torch.randn(8, 8, 64), torch.randn(12, 2, 64), torch.randn(12, 2, 64)
    with pytest.MonkeyPatch.context() as mp:  # one cu_seqlens, causal, the paper's slopes: cuDNN's ALiBi, packed
        kw = _recorded(mp, "attention_varlen", flash.flash_attn_varlen_func, q, k[:8], v[:8], cu_q, cu_q, 5, 5,
                       causal=True, alibi_slopes=paper)
    assert kw["alibi"] is True
    with pytest.MonkeyPatch.context() as mp:  # each sequence at its bottom right: a padded dense call with a bias
        kw = _recorded(mp, "attention", flash.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 5, 7, causal=True,
                       alibi_slopes=paper)
    assert kw["q"].shape == (2, 8, 8, 64) and kw["k"].shape == (2, 8, 2, 64)  # lengths rounded up to powers of two
    assert torch.equal(kw["q"][0, :3], q[:3]) and torch.equal(kw["q"][1, :5], q[3:]) and torch.all(kw["q"][0, 3:] == 0)
    assert torch.equal(kw["k"][1, :5], k[7:]) and torch.all(kw["v"][1, 5:] == 0)
    assert kw["seq_lens_q"].tolist() == lens_q and kw["seq_lens_kv"].tolist() == lens_k
    assert kw["causal"] is False and kw["window"] is None and kw["bias"].shape == (2, 8, 8, 8)
    for n, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        allowed = j <= i + lk - lq
        bias = kw["bias"][n, :, :lq, :lk].float()
        assert torch.allclose(bias[:, allowed], _bias_of(paper, lq, lk)[:, allowed].float(), rtol=1e-2)
        assert torch.all(bias[:, ~allowed] == _alibi._masked(torch.float32))


def test_varlen_alibi_packs_the_output_back_and_cuts_rows_without_keys():
    # The dense call's output, per sequence and row, comes back packed, and rows that see no
    # key (3 queries, 1 key, causal: the first two) get 0 and an LSE of +inf.
    lens_q, lens_k = [3, 2], [1, 4]
    cu_q, cu_k = (torch.tensor([0, *np.cumsum(n)], dtype=torch.int32) for n in (lens_q, lens_k))
    q, k, v = torch.randn(6, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)  # one token past cu_seqlens_q[-1]

    def fake(q, k, v, **kw):
        b, s, h, _ = q.shape
        rows = torch.arange(b * s, dtype=torch.float32).view(b, s, 1, 1).expand(b, s, h, v.shape[-1])
        return rows + 1.0, (torch.arange(b * s, dtype=torch.float32).view(b, 1, s) + 1.0).expand(b, h, s)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_common, "attention", fake)
        out, lse, _ = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, causal=True,
                                                   alibi_slopes=torch.ones(2), return_attn_probs=True)
    rows = 4  # bucket(3)
    expected = [0.0, 0.0, 1.0 + 2, rows + 1.0, rows + 2.0, 0.0]  # dense row + 1 of each token, 0 without key
    assert out[:, 0, 0].tolist() == expected
    assert lse[0].tolist() == [float("inf"), float("inf"), 3.0, rows + 1.0, rows + 2.0, float("inf")]


@pytest.mark.parametrize("paged", (False, True))
def test_kvcache_alibi_is_a_bias_at_each_sequences_bottom_right(paged):
    q = torch.randn(2, 2, 8, 64)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    if paged:
        k_cache, v_cache = torch.randn(8, 4, 2, 64), torch.randn(8, 4, 2, 64)
        table = torch.tensor([[3, 1, 0, 2], [7, 6, 5, 4]], dtype=torch.int32)
    else:
        k_cache, v_cache, table = torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64), None
    slopes = torch.rand(8)
    with pytest.MonkeyPatch.context() as mp:
        kw = _recorded(mp, "attention", flash.flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=lens,
                       block_table=table, causal=True, alibi_slopes=slopes)
    if paged:  # the pages gathered into a dense cache (a copy)
        assert torch.equal(kw["k"], k_cache[table.long()].flatten(1, 2))
    assert kw.get("causal", False) is False and kw.get("window") is None and kw.get("alignment", "top_left") == "top_left"
    assert kw["seq_lens_kv"] is lens and kw["bias"].shape == (2, 8, 2, 16)
    for n, lk in enumerate(lens.tolist()):
        i, j = torch.arange(2)[:, None], torch.arange(lk)[None, :]
        allowed = j <= i + lk - 2
        bias = kw["bias"][n, :, :, :lk]
        assert torch.allclose(bias[:, allowed].double(), _bias_of(slopes, 2, lk)[:, allowed], rtol=1e-6)
        assert torch.all(bias[:, ~allowed] == _alibi._masked(torch.float32))


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 8, 12, 16, 24, 32, 40, 64])
def test_standard_alibi_slopes_are_the_papers_and_cudnns(heads):
    import math

    def get_slopes(n):  # the ALiBi repository's get_slopes, as FlashAttention's tests use it
        def power_of_2(n):
            start = 2 ** (-2 ** -(math.log2(n) - 3))
            return [start * start ** i for i in range(n)]
        if math.log2(n).is_integer():
            return power_of_2(n)
        closest = 2 ** math.floor(math.log2(n))
        return power_of_2(closest) + get_slopes(2 * closest)[0::2][:n - closest]

    from helpers.gpu import alibi_slopes as cudnn_slopes  # cudnn-frontend's get_alibi_slope, in float32

    assert np.allclose(flash.standard_alibi_slopes(heads), get_slopes(heads), rtol=1e-12)
    assert np.allclose(flash.standard_alibi_slopes(heads), cudnn_slopes(heads), rtol=1e-6)
