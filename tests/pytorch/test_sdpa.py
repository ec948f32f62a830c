"""fastattn.torch.scaled_dot_product_attention on the CPU: its results and gradients against
torch.nn.functional.scaled_dot_product_attention's math in float64, with
fastattn.torch.attention replaced by a float64 model of its documented semantics (bhsd,
GQA, per-sequence lengths, causal masks at either corner, a bias of cuDNN's broadcast
shapes). The model checks the arguments fastattn would get as attention() and cuDNN
take them (shapes, dtypes, contiguity, a one-row bias without gradients, no bottom-right
causal mask with more queries than keys without lengths) and writes NaN in any row that
sees no key within its lengths, since what cuDNN writes there is not SDPA's: a result
that depends on such a row fails. What this cannot check: cuDNN itself, dropout's values
(test_gpu_sdpa.py runs both on the GPU)."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right, causal_upper_left  # noqa: E402

import fastattn.torch  # noqa: E402
from fastattn import InvalidArgumentError, NotSupportedError  # noqa: E402
from fastattn.torch import _sdpa  # noqa: E402

sdpa = fastattn.torch.scaled_dot_product_attention
F64 = torch.float64
NEG_INF = float("-inf")


def model_attention(q, k, v, *, causal=False, causal_bottom_right=False, window=None, scale=None, layout="bshd",
                    deterministic=False, seq_lens_q=None, seq_lens_kv=None, alibi=False, bias=None, dropout_p=0.0,
                    sinks=None, alignment="top_left", return_lse=False, softcap=0.0, calls=None):
    """fastattn.torch.attention's semantics for what scaled_dot_product_attention passes,
    in float64 with autograd; `calls` gets each call's mask arguments."""
    assert layout == "bhsd" and window is None and not (alibi or sinks is not None or return_lse or softcap)
    assert not causal_bottom_right and alignment in ("top_left", "bottom_right") and not deterministic
    assert q.dim() == k.dim() == v.dim() == 4 and q.dtype == k.dtype == v.dtype
    b, hq, sq, d = q.shape
    hk, skv = k.shape[1], k.shape[2]
    assert k.shape[0] == v.shape[0] == b and v.shape[1] == hk and hq % hk == 0 and v.shape[2] == skv
    assert k.shape[3] == d
    bottom_right = causal and alignment == "bottom_right"
    if seq_lens_q is None:
        assert seq_lens_kv is None
        assert not (bottom_right and sq > skv), "cuDNN takes a bottom-right causal mask with sq > skv only with lengths"
    else:
        for t, n in ((seq_lens_q, sq), (seq_lens_kv, skv)):
            assert t.dtype == torch.int32 and t.shape == (b,) and t.is_contiguous() and t.device == q.device
            assert ((t >= 0) & (t <= n)).all()
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))
    if bias is not None:
        assert bias.dtype == q.dtype and bias.is_contiguous() and bias.dim() == 4, (bias.dtype, bias.stride())
        assert bias.shape[0] in (1, b) and bias.shape[1] in (1, hq) and bias.shape[2] in (1, sq)
        assert bias.shape[3] == skv
        assert not (grads and bias.shape[2] == 1 and sq > 1), "fastattn refuses a one-row bias's backward"
    if calls is not None:
        calls.append(dict(causal=causal, bottom_right=bottom_right, seq_lens_q=seq_lens_q, seq_lens_kv=seq_lens_kv,
                          bias=bias, dropout_p=dropout_p, scale=scale, q=q))
    k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    s = (d ** -0.5 if scale is None else scale) * q @ k.transpose(-1, -2)
    if bias is not None:
        s = s + bias
    i = torch.arange(sq)[:, None]
    j = torch.arange(skv)[None, :]
    lq = torch.full((b,), sq) if seq_lens_q is None else seq_lens_q.long()
    lk = torch.full((b,), skv) if seq_lens_kv is None else seq_lens_kv.long()
    lq, lk = lq[:, None, None, None], lk[:, None, None, None]
    ok = (j < lk) & torch.ones(sq, 1, dtype=torch.bool)
    if causal:
        ok = ok & (j <= i + (lk - lq if bottom_right else 0))
    # Rows past a sequence's length: zeros (computed as ordinary rows, then replaced).
    # Rows within it that see no key: NaN (softmax of nothing), whatever cuDNN writes.
    past = i >= lq
    s = s.masked_fill(~(ok | past), NEG_INF)
    o = torch.softmax(s, -1) @ v
    return o.masked_fill(past, 0.0)


@pytest.fixture
def calls(monkeypatch):
    """attention() replaced by the model; the list of its calls' mask arguments."""
    made = []
    monkeypatch.setattr(_sdpa, "attention", lambda *a, **kw: model_attention(*a, **kw, calls=made))
    return made


def torch_sdpa(*args, **kwargs):
    kwargs.pop("recognize_mask", None)
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)


def rand(*shape, grad=False):
    return torch.randn(*shape, dtype=F64, requires_grad=grad)


def assert_same(args, kwargs, grad_of=()):
    """fastattn's result (and gradients of grad_of) equal SDPA's math in float64."""
    out = sdpa(*args, **kwargs)
    ref = torch_sdpa(*args, **kwargs)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10, equal_nan=False)
    if grad_of:
        d_o = torch.randn_like(ref)
        got = torch.autograd.grad(out, grad_of, d_o, allow_unused=True)
        want = torch.autograd.grad(ref, grad_of, d_o, allow_unused=True)
        for g, w in zip(got, want):
            assert w is not None and g is not None
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)
    return out


# -- masks models pass ------------------------------------------------------------------------

def causal_tl(sq, skv):
    return torch.ones(sq, skv, dtype=torch.bool).tril()


def causal_br(sq, skv):
    return torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)


def key_padding(lens, skv):
    """(b, 1, 1, skv): each row a prefix of True."""
    return (torch.arange(skv)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]


def right_padded_causal(lens, sq, mask_queries):
    """(b, 1, sq, sq): causal and key padding; the padded queries masked entirely or not."""
    i, j = torch.arange(sq)[:, None], torch.arange(sq)[None, :]
    n = torch.tensor(lens)[:, None, None]
    m = (j <= i) & (j < n)
    if mask_queries:
        m = m & (i < n)
    return m[:, None]


def padded_bottom_right(lens_q, lens_kv, sq, skv):
    """(b, 1, sq, skv): each sequence's causal mask at its own bottom right, within its lengths."""
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
    lq, lk = torch.tensor(lens_q)[:, None, None], torch.tensor(lens_kv)[:, None, None]
    return ((i < lq) & (j < lk) & (j <= i + lk - lq))[:, None]


def left_padded_causal(pads, sq):
    i, j = torch.arange(sq)[:, None], torch.arange(sq)[None, :]
    return ((j <= i) & (j >= torch.tensor(pads)[:, None, None]))[:, None]


def as_float(mask):
    return torch.zeros(mask.shape, dtype=F64).masked_fill(~mask, NEG_INF)


def to_rank(mask, lead, rank):
    """A (batch | 1, 1, sq, skv) mask for tensors of `rank` dims with leading dims `lead`."""
    if rank == 4:
        return mask
    if rank == 5:
        return mask.reshape(*(lead if mask.shape[0] > 1 else (1, 1)), *mask.shape[1:])
    assert mask.shape[0] == 1
    return mask[0] if rank == 3 else mask[0, 0]


# -- results against SDPA, over generated shapes and masks --------------------------------------

KINDS = ("none", "is_causal", "upper_left", "lower_right", "random", "causal_tl", "causal_br", "key_padding",
         "padded_causal", "padded_causal_rows", "padded_br", "left_padded", "per_head", "float_random")


@st.composite
def calls_of_sdpa(draw):
    """(args, kwargs, tensors to differentiate) of one call."""
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))  # the tensors' values: Hypothesis's to replay
    rank = draw(st.sampled_from((4, 4, 4, 2, 3, 5)))
    hk = 1 if rank == 2 else draw(st.integers(1, 2))
    group = 1 if rank == 2 else draw(st.sampled_from((1, 1, 2, 3)))
    hq = hk * group
    kind = draw(st.sampled_from(KINDS))
    sq, skv = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    if kind in ("padded_causal", "padded_causal_rows", "left_padded"):
        sq = skv
    d, dv = draw(st.sampled_from((4, 8))), draw(st.sampled_from((4, 6)))
    lead = {2: (), 3: (), 4: (draw(st.integers(1, 3)),), 5: (draw(st.integers(1, 2)), draw(st.integers(1, 2)))}[rank]
    heads = () if rank == 2 else (hq,)
    kv_heads = () if rank == 2 else (hk,)
    batch = math.prod(lead)
    weights = (*lead, *heads, sq, skv)
    grad = draw(st.booleans())
    q = rand(*lead, *heads, sq, d, grad=grad)
    k = rand(*lead, *kv_heads, skv, d, grad=grad)
    v = rand(*lead, *kv_heads, skv, dv, grad=grad)
    kwargs = {"scale": draw(st.sampled_from((None, 0.3, 2.0))),
              "enable_gqa": group > 1 or rank > 2 and draw(st.booleans()), "recognize_mask": draw(st.booleans())}
    lens = st.lists(st.integers(0, skv), min_size=batch, max_size=batch)
    mask = None
    if kind == "is_causal":
        kwargs["is_causal"] = True
    elif kind == "upper_left":
        mask = causal_upper_left(sq, skv)
    elif kind == "lower_right":
        with warnings.catch_warnings():  # PyTorch's, about its fused kernels with sq > skv
            warnings.simplefilter("ignore")
            mask = causal_lower_right(sq, skv)
    elif kind in ("random", "float_random"):
        shape = tuple(n if draw(st.booleans()) else 1 for n in weights)[draw(st.integers(0, len(weights) - 1)):]
        mask = torch.rand(shape) < draw(st.sampled_from((0.2, 0.6, 0.95)))
        if kind == "float_random":  # values, -inf where the draw masked, some rows -inf throughout
            mask = torch.randn(shape, dtype=F64).masked_fill(~mask, NEG_INF)
    elif kind == "causal_tl":
        mask = causal_tl(sq, skv)
    elif kind == "causal_br":
        mask = causal_br(sq, skv)
    elif kind == "key_padding":
        mask = key_padding(draw(lens), skv)
    elif kind in ("padded_causal", "padded_causal_rows"):
        mask = right_padded_causal(draw(lens), sq, kind == "padded_causal_rows")
    elif kind == "padded_br":
        lens_kv = draw(lens)
        lens_q = draw(st.lists(st.integers(0, sq), min_size=batch, max_size=batch))
        mask = padded_bottom_right(lens_q, lens_kv, sq, skv)
    elif kind == "left_padded":
        mask = left_padded_causal(draw(lens), sq)
    elif kind == "per_head":
        mask = torch.rand(*heads, 1, skv) < 0.7
    if kind in ("key_padding", "padded_causal", "padded_causal_rows", "padded_br", "left_padded"):
        mask = to_rank(mask, lead, rank)
    if isinstance(mask, torch.Tensor) and mask.__class__ is torch.Tensor:
        if mask.dtype == torch.bool and kind not in ("random", "per_head") and draw(st.booleans()):
            mask = as_float(mask)  # the same mask, additive
        how = draw(st.sampled_from(("as is", "expanded", "materialized", "transposed")))
        if how == "expanded":
            mask = mask.expand(weights)
        elif how == "materialized":
            mask = mask.expand(weights).contiguous()
        elif how == "transposed":
            mask = mask.expand(weights).transpose(-1, -2).contiguous().transpose(-1, -2)
        if mask.dtype == F64 and draw(st.integers(0, 3)) == 0:
            mask = mask.float()  # SDPA takes a float32 mask beside any query dtype
        if mask.is_floating_point() and draw(st.booleans()):
            mask = mask.detach().clone().requires_grad_()
    grad_of = [t for t in (q, k, v) if t.requires_grad]
    if isinstance(mask, torch.Tensor) and mask.requires_grad:
        grad_of.append(mask)
    return (q, k, v, mask), kwargs, tuple(grad_of)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=calls_of_sdpa())
def test_matches_sdpa_in_float64(call):
    args, kwargs, grad_of = call
    made = []
    saved = _sdpa.attention
    _sdpa.attention = lambda *a, **kw: model_attention(*a, **kw, calls=made)
    try:
        assert_same(args, kwargs, grad_of)
    finally:
        _sdpa.attention = saved
    assert len(made) == 1


# -- what each mask becomes ----------------------------------------------------------------------

B, H, SQ, SKV, D = 3, 2, 5, 7, 8


def qkv(sq=SQ, skv=SKV, grad=False, heads_kv=H):
    return rand(B, H, sq, D, grad=grad), rand(B, heads_kv, skv, D, grad=grad), rand(B, heads_kv, skv, D, grad=grad)


def form(call):
    """What attention() got: (causal, bottom_right, seq_lens_q, seq_lens_kv, bias shape, queries)."""
    lens = None if call["seq_lens_q"] is None else (call["seq_lens_q"].tolist(), call["seq_lens_kv"].tolist())
    bias = None if call["bias"] is None else tuple(call["bias"].shape)
    return call["causal"], call["bottom_right"], lens, bias, call["q"].shape[2]



RECOGNIZED = [
    # (name, sq, skv, mask, form with recognize_mask=True)
    ("all True", SQ, SKV, torch.ones(SQ, SKV, dtype=torch.bool), (False, False, None, None, SQ)),
    ("causal, top left", SQ, SKV, causal_tl(SQ, SKV), (True, False, None, None, SQ)),
    ("causal, square", 6, 6, causal_tl(6, 6)[None, None].expand(B, H, 6, 6).contiguous(), (True, False, None, None, 6)),
    ("causal, bottom right", SQ, SKV, causal_br(SQ, SKV), (True, True, None, None, SQ)),
    ("causal, bottom right, more queries", SKV, SQ, causal_br(SKV, SQ), (True, False, None, None, SQ)),
    ("key padding", SQ, SKV, key_padding([7, 3, 0], SKV), (False, False, ([5, 5, 0], [7, 3, 0]), None, SQ)),
    ("key padding over the queries", SQ, SKV, key_padding([1, 7, 4], SKV).expand(B, 1, SQ, SKV).contiguous(),
     (False, False, ([5, 5, 5], [1, 7, 4]), None, SQ)),
    ("one key padding for all", SQ, SKV, key_padding([4], SKV), (False, False, ([5, 5, 5], [4, 4, 4]), None, SQ)),
    ("right-padded causal", 6, 6, right_padded_causal([6, 2, 4], 6, False),
     (True, False, ([6, 6, 6], [6, 2, 4]), None, 6)),
    ("right-padded causal, padded rows masked", 6, 6, right_padded_causal([6, 2, 0], 6, True),
     (True, False, ([6, 2, 0], [6, 2, 0]), None, 6)),
    ("each sequence's bottom right", SQ, SKV, padded_bottom_right([2, 5, 1], [6, 7, 1], SQ, SKV),
     (True, True, ([2, 5, 1], [6, 7, 1]), None, SQ)),
    # queries without a key within the lengths (more queries than keys): the bias, never lengths
    ("bottom right, a row without keys", SQ, SKV, padded_bottom_right([4, 5, 1], [2, 7, 1], SQ, SKV),
     (False, False, None, (B, 1, SQ, SKV), SQ)),
    ("left-padded causal", 6, 6, left_padded_causal([0, 2, 3], 6), (False, False, None, (B, 1, 6, 6), 6)),
    ("per head", SQ, SKV, torch.stack([causal_tl(SQ, SKV), torch.ones(SQ, SKV, dtype=torch.bool)]),
     (False, False, None, (1, H, SQ, SKV), SQ)),
    ("the same over heads", SQ, SKV, (torch.rand(B, 1, SQ, SKV) < 0.5).expand(B, H, SQ, SKV).contiguous(),
     (False, False, None, (B, 1, SQ, SKV), SQ)),
    ("a window", SQ, SKV, causal_tl(SQ, SKV) & ~causal_tl(SQ, SKV).tril(-2), (False, False, None, (1, 1, SQ, SKV), SQ)),
]


@pytest.mark.parametrize("name,sq,skv,mask,want", RECOGNIZED, ids=[r[0] for r in RECOGNIZED])
@pytest.mark.parametrize("additive", (False, True))
def test_recognized_masks_take_the_cheapest_exact_form(calls, name, sq, skv, mask, want, additive):
    q, k, v = qkv(sq, skv)
    mask = as_float(mask) if additive else mask
    assert_same((q, k, v, mask), {"recognize_mask": True})
    assert form(calls[0]) == want


@pytest.mark.parametrize("name,sq,skv,mask,want", RECOGNIZED, ids=[r[0] for r in RECOGNIZED])
def test_without_recognize_mask_every_mask_is_a_bias_and_gradients_match(calls, name, sq, skv, mask, want):
    q, k, v = qkv(sq, skv, grad=True)
    assert_same((q, k, v, mask), {}, (q, k, v))
    m = _sdpa._mask_4d(mask, q, k)
    rows = sq if m.shape[2] == 1 else m.shape[2]  # a one-row bias is expanded for the backward
    assert form(calls[0]) == (False, False, None, (m.shape[0], m.shape[1], rows, skv), sq)


@pytest.mark.parametrize("name,sq,skv,mask,want", RECOGNIZED, ids=[r[0] for r in RECOGNIZED])
def test_recognized_masks_have_sdpas_gradients(calls, name, sq, skv, mask, want):
    q, k, v = qkv(sq, skv, grad=True)
    assert_same((q, k, v, mask), {"recognize_mask": True}, (q, k, v))
    assert form(calls[0]) == want


def test_is_causal_and_causal_bias_need_no_mask(calls):
    q, k, v = qkv()
    assert_same((q, k, v), {"is_causal": True})
    assert_same((q, k, v, causal_upper_left(SQ, SKV)), {})
    assert_same((q, k, v, causal_lower_right(SQ, SKV)), {})
    q2, k2, v2 = qkv(SKV, SQ)
    with pytest.warns(UserWarning, match="NaN"):  # PyTorch's, about its fused kernels: fastattn writes zeros
        bias = causal_lower_right(SKV, SQ)
    out = assert_same((q2, k2, v2, bias), {})
    assert (out[:, :, :SKV - SQ] == 0).all()
    assert [form(c) for c in calls] == [(True, False, None, None, SQ), (True, False, None, None, SQ),
                                        (True, True, None, None, SQ), (True, False, None, None, SQ)]


def test_a_rows_mask_is_kept_one_row_without_gradients_and_expanded_with(calls):
    q, k, v = qkv()
    mask = key_padding([7, 3, 1], SKV)
    assert_same((q, k, v, mask), {})
    q, k, v = qkv(grad=True)
    assert_same((q, k, v, mask), {}, (q, k, v))
    assert [form(c)[3] for c in calls] == [(B, 1, 1, SKV), (B, 1, SQ, SKV)]


def test_broadcast_dims_stay_broadcast(calls):
    q, k, v = qkv()
    expanded = causal_tl(SQ, SKV).logical_not().expand(B, H, SQ, SKV)  # stride 0 over batch and heads
    assert_same((q, k, v, expanded), {})
    assert_same((q, k, v, expanded.transpose(0, 1)[:, :1].transpose(0, 1)), {})
    assert [form(c)[3] for c in calls] == [(1, 1, SQ, SKV)] * 2


def test_a_mask_over_whole_rows_needs_no_bias(calls):
    q, k, v = qkv()
    rows = torch.rand(B, 1, SQ, 1) < 0.5  # each query keeps all its keys or none
    out = assert_same((q, k, v, rows), {})
    assert form(calls[0])[3] is None and (out.masked_select(~rows) == 0).all()


def test_a_float_mask_that_fits_is_passed_as_it_is(calls):
    q, k, v = qkv()
    mask = rand(B, 1, SQ, SKV)
    assert_same((q, k, v, mask), {})
    assert calls[0]["bias"].data_ptr() == mask.data_ptr()  # no copy
    assert_same((q, k, v, mask.transpose(-1, -2).contiguous().transpose(-1, -2)), {})
    assert calls[1]["bias"].is_contiguous()


def test_a_float32_mask_is_rounded_once_to_the_querys_dtype_in_its_broadcast_shape():
    # SDPA takes a float32 mask beside bfloat16 / float16 queries (its math kernel rounds the
    # scores plus the mask to the query's dtype); cuDNN adds the bias in that dtype. The
    # copy is made of the compact mask, not of its expansion.
    q = torch.randn(B, H, SQ, 8, dtype=torch.bfloat16)
    k = torch.randn(B, H, SKV, 8, dtype=torch.bfloat16)
    m = torch.randn(1, 1, SQ, SKV) * 3
    got = _sdpa._mask_4d(m.expand(B, H, SQ, SKV), q, k)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 1, SQ, SKV)
    assert torch.equal(got, m.to(torch.bfloat16))
    m.requires_grad_()
    _sdpa._mask_4d(m, q, k).float().sum().backward()  # the rounding passes the gradient on
    assert m.grad.dtype == torch.float32 and torch.equal(m.grad, torch.ones_like(m))


def test_rows_without_keys_are_zeros_with_zero_gradients(calls):
    q, k, v = qkv(grad=True)
    mask = torch.rand(B, H, SQ, SKV) < 0.5
    mask[0, 1, 2] = False
    mask[2, :, 4] = False
    for m in (mask, as_float(mask)):
        out = assert_same((q, k, v, m), {}, (q, k, v))
        assert (out[0, 1, 2] == 0).all() and (out[2, :, 4] == 0).all()
        assert torch.isfinite(calls[-1]["bias"]).any(-1).all()  # the kernel sees no row of -inf
    float_mask = as_float(mask).requires_grad_()
    assert_same((q, k, v, float_mask), {}, (q, k, v, float_mask))


def test_a_float_masks_gradient_is_sdpas(calls):
    q, k, v = qkv(grad=True)
    for shape in ((SQ, SKV), (B, 1, SQ, SKV), (1, H, 1, SKV), (B, H, SQ, 1)):
        mask = rand(*shape, grad=True)
        assert_same((q, k, v, mask), {"recognize_mask": True}, (q, k, v, mask))
        assert calls[-1]["bias"] is not None  # never recognized: it needs its gradient


def test_float_masks_of_other_values_are_not_recognized(calls):
    q, k, v = qkv()
    tl = as_float(causal_tl(SQ, SKV))
    for mask in (tl.masked_fill(tl == NEG_INF, torch.finfo(F64).min), tl + 1.0):
        assert_same((q, k, v, mask), {"recognize_mask": True})
        assert form(calls[-1])[3] == (1, 1, SQ, SKV)


def test_values_are_not_read_while_tracing(calls, monkeypatch):
    q, k, v = qkv()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert_same((q, k, v, causal_tl(SQ, SKV)), {"recognize_mask": True})
    assert form(calls[0])[3] == (1, 1, SQ, SKV)


@pytest.mark.parametrize("shape", ((SQ, D), (H, SQ, D), (2, B, H, SQ, D), (1, 2, 1, H, SQ, D)))
def test_other_ranks(calls, shape):
    q = rand(*shape, grad=True)
    k, v = rand(*shape[:-2], SKV, D, grad=True), rand(*shape[:-2], SKV, 4, grad=True)
    mask = torch.rand(*shape[:-1], SKV) < 0.7
    for m in (mask, mask[..., :1, :], key_padding([3], SKV)[0, 0]):
        assert_same((q, k, v, m), {"recognize_mask": True}, (q, k, v))
        assert_same((q, k, v, m), {}, (q, k, v))


def test_gqa(calls):
    q, k, v = qkv(heads_kv=1, grad=True)
    for mask in (None, torch.rand(B, H, SQ, SKV) < 0.6, key_padding([2, 7, 5], SKV)):
        assert_same((q, k, v, mask), {"enable_gqa": True, "recognize_mask": True}, (q, k, v))
        assert calls[-1]["q"].shape[1] == H and form(calls[-1])[3] in (None, (B, H, SQ, SKV))


def test_scale_and_dropout_are_passed_on(calls):
    q, k, v = qkv()
    assert_same((q, k, v), {"scale": 0.7})
    sdpa(q, k, v, None, 0.25)
    sdpa(q, k, v, dropout_p=0.5, scale=3)
    assert [(c["scale"], c["dropout_p"]) for c in calls] == [(0.7, 0.0), (None, 0.25), (3, 0.5)]


def test_the_signature_is_sdpas():
    import inspect

    ours = inspect.signature(sdpa).parameters
    theirs = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    assert list(ours)[:8] == theirs and list(ours)[8:] == ["recognize_mask"]
    assert [p.kind for p in ours.values()][5:] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] + \
        [inspect.Parameter.KEYWORD_ONLY] * 3
    assert fastattn.torch.__all__.count("scaled_dot_product_attention") == 1


# -- what raises --------------------------------------------------------------------------------

def _q(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype)


_Q, _K = _q(B, H, SQ, D), _q(B, H, SKV, D)
ERRORS = [
    # (what, args, kwargs, exception, message)
    ("1-d query", (_q(D), _q(D), _q(D)), {}, InvalidArgumentError, r"^query has shape \(8,\): expected"),
    ("no tensor", (_Q, [1], _K), {}, InvalidArgumentError, r"^key: expected a torch.Tensor, got list"),
    ("dtypes", (_Q, _K.float(), _K), {}, InvalidArgumentError, r"^query, key and value have different dtypes"),
    ("integer", (_Q.long(), _K.long(), _K.long()), {}, InvalidArgumentError, r"^query: expected a floating dtype"),
    ("head dims", (_Q, _q(B, H, SKV, 4), _K), {}, InvalidArgumentError, r"^head dims differ: query 8, key 4"),
    ("kv lengths", (_Q, _K, _q(B, H, 3, D)), {}, InvalidArgumentError, r"^key has 7 keys but value has 3"),
    ("gqa off", (_Q, _q(B, 1, SKV, D), _q(B, 1, SKV, D)), {}, InvalidArgumentError,
     r"^heads: query has 2, key 1, value 1: different head counts need enable_gqa=True"),
    ("gqa ratio", (_q(B, 3, SQ, D), _q(B, 2, SKV, D), _q(B, 2, SKV, D)), {"enable_gqa": True},
     InvalidArgumentError, r"^heads: query has 3, key and value 2: enable_gqa needs"),
    ("gqa 2-d", (_q(SQ, D), _q(SKV, D), _q(SKV, D)), {"enable_gqa": True}, InvalidArgumentError,
     r"^enable_gqa=True with query of shape \(5, 8\)"),
    ("k v heads", (_q(B, 4, SQ, D), _q(B, 2, SKV, D), _q(B, 1, SKV, D)), {"enable_gqa": True}, NotSupportedError,
     r"^heads: key has 2, value 1"),
    ("batch broadcast", (_Q, _q(1, H, SKV, D), _q(1, H, SKV, D)), {}, NotSupportedError,
     r"fastattn takes the same batch dims for the three \(SDPA would broadcast them\)"),
    ("ranks", (_Q, _K[0], _K[0]), {}, NotSupportedError, r"same batch dims"),
    ("empty", (_q(B, H, 0, D), _K, _K), {}, NotSupportedError, r"no attention with an extent of 0"),
    ("mask and is_causal", (_Q, _K, _K, torch.ones(SQ, SKV, dtype=torch.bool)), {"is_causal": True},
     InvalidArgumentError, r"^attn_mask and is_causal=True are exclusive"),
    ("causal bias and is_causal", (_Q, _K, _K, causal_upper_left(SQ, SKV)), {"is_causal": True},
     InvalidArgumentError, r"^attn_mask and is_causal=True are exclusive"),
    ("causal bias lengths", (_Q, _K, _K, causal_upper_left(SQ, 4)), {}, InvalidArgumentError,
     r"^attn_mask is a causal mask of 5 queries and 4 keys, for 5 queries and 7 keys"),
    ("mask shape", (_Q, _K, _K, torch.ones(SQ, SQ, dtype=torch.bool)), {}, InvalidArgumentError,
     r"^attn_mask has shape \(5, 5\): it must broadcast to the attention weights' \(3, 2, 5, 7\)"),
    ("mask rank", (_Q, _K, _K, torch.ones(1, B, H, SQ, SKV, dtype=torch.bool)), {}, InvalidArgumentError,
     r"^attn_mask has shape \(1, 3, 2, 5, 7\)"),
    ("mask dtype", (_Q, _K, _K, torch.ones(SQ, SKV, dtype=torch.int32)), {}, InvalidArgumentError,
     r"^attn_mask: expected a boolean or floating mask, got torch.int32"),
    ("mask float dtype", (_Q, _K, _K, torch.zeros(SQ, SKV, dtype=torch.float16)), {}, InvalidArgumentError,
     r"^attn_mask: a torch.float16 mask for torch.float64 tensors: SDPA takes a boolean mask, a float32 one or one "
     r"in query's dtype$"),
    ("mask no tensor", (_Q, _K, _K, [[True]]), {}, InvalidArgumentError, r"^attn_mask: expected a torch.Tensor or None"),
    ("mask device", (_Q, _K, _K, torch.ones(SQ, SKV, dtype=torch.bool, device="meta")), {}, InvalidArgumentError,
     r"^attn_mask is on meta, query on cpu"),
    ("is_causal type", (_Q, _K, _K), {"is_causal": 1}, InvalidArgumentError, r"^is_causal=1: expected a bool"),
    ("enable_gqa type", (_Q, _K, _K), {"enable_gqa": None}, InvalidArgumentError, r"^enable_gqa=None: expected"),
    ("recognize_mask type", (_Q, _K, _K), {"recognize_mask": "yes"}, InvalidArgumentError, r"^recognize_mask="),
    ("dropout type", (_Q, _K, _K), {"dropout_p": "0.1"}, InvalidArgumentError, r"^dropout_p='0.1': expected a float"),
    ("dropout range", (_Q, _K, _K), {"dropout_p": 1.5}, InvalidArgumentError, r"^dropout_p=1.5: must be in \[0, 1\]"),
    ("dropout negative", (_Q, _K, _K), {"dropout_p": -0.1}, InvalidArgumentError, r"^dropout_p=-0.1"),
    ("dropout 1", (_Q, _K, _K), {"dropout_p": 1.0}, NotSupportedError, r"^dropout_p=1.0: cuDNN's dropout takes"),
    ("scale type", (_Q, _K, _K), {"scale": "0.1"}, InvalidArgumentError, r"^scale='0.1': expected a float or None"),
    ("scale 0", (_Q, _K, _K), {"scale": 0.0}, NotSupportedError, r"^scale=0.0: fastattn takes a softmax scale > 0"),
    ("scale negative", (_Q, _K, _K), {"scale": -1}, NotSupportedError, r"^scale=-1"),
]


@pytest.mark.parametrize("what,args,kwargs,error,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_arguments_are_checked_before_any_work(calls, what, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        sdpa(*args, **kwargs)
    assert calls == []


def test_scale_is_keyword_only_as_in_sdpa():
    with pytest.raises(TypeError):
        sdpa(_Q, _K, _K, None, 0.0, False, 0.5)


def test_attentions_own_refusals_pass_through():
    """Without the model: attention() refuses CPU tensors (fastattn runs on CUDA)."""
    q, k = _q(B, H, SQ, D, dtype=torch.float16), _q(B, H, SKV, D, dtype=torch.float16)
    with pytest.raises(InvalidArgumentError):
        sdpa(q, k, k, torch.ones(SQ, SKV, dtype=torch.bool))


def test_torch_compile_traces_it_without_a_graph_break(calls):
    """fullgraph=True through the Python around attention() (here the model): the mask's
    values are not read while tracing, so recognize_mask takes the bias there."""
    q, k, v = qkv(grad=True)
    compiled = torch.compile(lambda *a, **kw: sdpa(*a, **kw), fullgraph=True, backend="eager")
    for mask, kwargs in ((causal_tl(SQ, SKV), {"recognize_mask": True}), (key_padding([7, 3, 0], SKV), {}),
                         (as_float(causal_br(SQ, SKV)), {"recognize_mask": True}), (None, {"is_causal": True}),
                         (causal_lower_right(SQ, SKV), {})):
        out = compiled(q, k, v, mask, **kwargs)
        ref = torch_sdpa(q, k, v, mask, **kwargs)
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
        d_o = torch.randn_like(ref)
        for g, w in zip(torch.autograd.grad(out, (q, k, v), d_o), torch.autograd.grad(ref, (q, k, v), d_o)):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)
    assert [form(c)[2:4] for c in calls] == [(None, (1, 1, SQ, SKV)), (None, (B, 1, SQ, SKV)),
                                             (None, (1, 1, SQ, SKV)), (None, None), (None, None)]


# -- the GPU tests' own logic ---------------------------------------------------------------------

@pytest.fixture
def gpu_tests_on_the_model(monkeypatch):
    import test_sdpa_gpu as G

    monkeypatch.setattr(G, "DEV", "cpu")
    monkeypatch.setattr(G, "poison", lambda: None)
    monkeypatch.setattr(_sdpa, "attention", model_attention)
    return G


def _gpu_cases():
    import test_sdpa_gpu as G

    return G.CASES


@pytest.mark.parametrize("case", _gpu_cases(), ids=[c[0] for c in _gpu_cases()])
def test_gpu_cases_on_the_model(gpu_tests_on_the_model, monkeypatch, case):
    """test_gpu_sdpa.py's cases with the model for attention(), in float16 and bfloat16
    on the CPU: the forms they expect and their references, before a GPU runs them."""
    G = gpu_tests_on_the_model
    G.test_matches_sdpa_forward_and_backward(G.record_forms(monkeypatch), *case)


def test_the_gpu_float32_mask_test_on_the_model(gpu_tests_on_the_model, monkeypatch):
    G = gpu_tests_on_the_model
    G.test_a_float32_mask_beside_bfloat16_tensors_is_the_mask_in_bfloat16(G.record_forms(monkeypatch))
