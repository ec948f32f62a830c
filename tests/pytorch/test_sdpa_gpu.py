"""GPU: fastattn.torch.scaled_dot_product_attention against PyTorch's SDPA (its math backend
in float64, on CUDA) for the masks models pass, forward and backward, each through the form
it takes (recorded: causal, lengths or a bias); and dropout, a CUDA graph capture and
torch.compile. test_sdpa.py checks the translation itself over many more cases."""

import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

import fastattn.torch  # noqa: E402
from fastattn.torch import _sdpa  # noqa: E402


DEV = "cuda"
FWD_TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
BWD_TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
B, HQ, HK, D = 3, 4, 2, 64


def poison():
    """NaN bytes in memory the caching allocator hands out next (0xFF.. is NaN in fp16,
    bf16 and fp32), so that an output row fastattn leaves unwritten shows."""
    x = torch.empty(256 << 20, dtype=torch.uint8, device=DEV).fill_(0xFF)
    del x


@pytest.fixture
def forms(monkeypatch):
    """The real attention(), each call's mask arguments recorded."""
    return record_forms(monkeypatch)


def record_forms(monkeypatch):
    """_sdpa's attention() (whichever is there) wrapped: the list of its calls' mask arguments."""
    made = []
    real = _sdpa.attention

    def recording(*args, **kwargs):
        made.append({"causal": kwargs["causal"], "alignment": kwargs["alignment"],
                     "lengths": None if kwargs["seq_lens_q"] is None else
                     (kwargs["seq_lens_q"].tolist(), kwargs["seq_lens_kv"].tolist()),
                     "bias": None if kwargs["bias"] is None else tuple(kwargs["bias"].shape)})
        return real(*args, **kwargs)

    monkeypatch.setattr(_sdpa, "attention", recording)
    return made


def reference(q, k, v, mask, **kwargs):
    """SDPA's math in float64 on the same device: (o, leaves for gradients)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if type(mask) is torch.Tensor and mask.dtype != torch.bool:  # (not a CausalBias)
        mask = mask.detach().double().requires_grad_(mask.requires_grad)
        if mask.requires_grad:
            leaves.append(mask)
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(*leaves[:3], mask, **kwargs), leaves


def rel(a, b):
    a = a.double()
    assert torch.isfinite(a).all()
    n = b.norm()
    return ((a - b).norm() / (n if n > 0 else 1)).item()


def lower_right(sq, skv):
    with warnings.catch_warnings():  # PyTorch's, about its fused kernels with sq > skv (fastattn writes zeros)
        warnings.simplefilter("ignore")
        return causal_lower_right(sq, skv)


def key_padding(lens, skv):
    return (torch.arange(skv, device=DEV)[None, :] < torch.tensor(lens, device=DEV)[:, None])[:, None, None, :]


def causal(sq, skv, lens=None, left=False):
    """(b | 1, 1, sq, skv) causal at the top left; with lens, each sequence's keys past (or,
    left=True, before) its length masked."""
    i, j = torch.arange(sq, device=DEV)[:, None], torch.arange(skv, device=DEV)[None, :]
    m = (j <= i)[None, None]
    if lens is not None:
        n = torch.tensor(lens, device=DEV)[:, None, None, None]
        m = m & ((j >= skv - n) if left else (j < n))
    return m


def float_mask(sq, skv, shape):
    """Random values, -inf on a fifth of the entries and on one row throughout."""
    m = torch.randn(*shape, sq, skv, device=DEV)
    m = m.masked_fill(torch.rand_like(m) < 0.2, float("-inf"))
    m[..., 1, :] = float("-inf")
    return m


F16, BF16 = torch.float16, torch.bfloat16
# (id, dtype, sq, skv, mask factory, recognize_mask, the form attention() gets)
CASES = [
    ("none-gqa", F16, 200, 200, lambda: None, False, dict(causal=False, lengths=None, bias=None)),
    ("is_causal", BF16, 200, 300, "is_causal", False, dict(causal=True, alignment="top_left", bias=None)),
    ("lower_right", F16, 100, 300, lambda: lower_right(100, 300), False,
     dict(causal=True, alignment="bottom_right", bias=None)),
    ("lower_right-more-queries", BF16, 300, 100, lambda: lower_right(300, 100), False,
     dict(causal=True, alignment="top_left", bias=None)),
    ("tril-recognized", BF16, 256, 256, lambda: causal(256, 256), True, dict(causal=True, lengths=None, bias=None)),
    ("tril-as-bias", F16, 256, 256, lambda: causal(256, 256), False, dict(causal=False, bias=(1, 1, 256, 256))),
    ("key-padding-recognized", F16, 128, 192, lambda: key_padding([192, 77, 0], 192), True,
     dict(causal=False, lengths=([128, 128, 0], [192, 77, 0]), bias=None)),
    ("key-padding-as-bias", BF16, 128, 192, lambda: key_padding([192, 77, 0], 192), False,
     dict(causal=False, bias=(B, 1, 128, 192))),
    ("right-padded-causal", BF16, 160, 160, lambda: causal(160, 160, [160, 100, 33]), True,
     dict(causal=True, alignment="top_left", lengths=([160, 160, 160], [160, 100, 33]), bias=None)),
    ("left-padded-causal", F16, 160, 160, lambda: causal(160, 160, [160, 100, 33], left=True), True,
     dict(causal=False, bias=(B, 1, 160, 160))),
    ("float-mask-with-gradient", BF16, 128, 128, lambda: float_mask(128, 128, (1, HQ)), False,
     dict(causal=False, bias=(1, HQ, 128, 128))),
    ("float-key-row", F16, 96, 200, lambda: float_mask(96, 200, (B, 1))[:, :, :1], False,
     dict(bias=(B, 1, 96, 200))),
]


@pytest.mark.parametrize("name,dtype,sq,skv,make,recognize,want", CASES, ids=[c[0] for c in CASES])
def test_matches_sdpa_forward_and_backward(forms, name, dtype, sq, skv, make, recognize, want):
    q = torch.randn(B, HQ, sq, D, device=DEV, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, HK, skv, D, device=DEV, dtype=dtype, requires_grad=True) for _ in range(2))
    kwargs = {"is_causal": True} if make == "is_causal" else {}
    mask = None if make == "is_causal" else make()
    if type(mask) is torch.Tensor and mask.dtype != torch.bool:  # (not a CausalBias)
        mask = mask.to(dtype).requires_grad_(name == "float-mask-with-gradient")
    leaves = [q, k, v] + ([mask] if type(mask) is torch.Tensor and mask.requires_grad else [])
    poison()
    o = fastattn.torch.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, recognize_mask=recognize,
                                                    **kwargs)
    ref, ref_leaves = reference(q, k, v, mask, enable_gqa=True, **kwargs)
    assert o.shape == ref.shape and o.dtype == dtype
    assert rel(o, ref) < FWD_TOL[dtype]
    assert len(forms) == 1 and all(forms[0][key] == value for key, value in want.items()), forms
    d_o = torch.randn_like(o)
    poison()
    grads = torch.autograd.grad(o, leaves, d_o)
    ref_grads = torch.autograd.grad(ref, ref_leaves, d_o.double())
    for g, rg in zip(grads, ref_grads):
        assert rel(g, rg) < BWD_TOL[dtype]


def test_a_float32_mask_beside_bfloat16_tensors_is_the_mask_in_bfloat16(forms):
    # SDPA takes a float32 mask beside bfloat16 queries; fastattn rounds it to bfloat16 (in
    # which cuDNN adds it), and its gradient comes back in float32.
    q = torch.randn(B, HQ, 96, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, HK, 160, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    mask = (torch.randn(B, 1, 96, 160, device=DEV) * 4).requires_grad_()
    poison()
    o = fastattn.torch.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)
    rounded = mask.detach().to(torch.bfloat16).float().requires_grad_()
    ref, leaves = reference(q, k, v, rounded, enable_gqa=True)
    assert len(forms) == 1 and not forms[0]["causal"] and forms[0]["bias"] == (B, 1, 96, 160), forms
    assert rel(o, ref) < FWD_TOL[torch.bfloat16]
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, mask), d_o)
    assert grads[3].dtype == torch.float32
    for g, rg in zip(grads, torch.autograd.grad(ref, leaves, d_o.double())):
        assert rel(g, rg) < BWD_TOL[torch.bfloat16]


def test_dropout_draws_from_torchs_generator_and_keeps_the_expectation():
    q, k, v = (torch.randn(2, HQ, 128, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = key_padding([128, 50], 128)
    run = lambda: fastattn.torch.scaled_dot_product_attention(q, k, v, mask, 0.3, recognize_mask=True)  # noqa: E731
    torch.manual_seed(7)
    a = run()
    torch.manual_seed(7)
    b = run()
    c = run()
    assert torch.equal(a, b) and not torch.equal(a, c) and torch.isfinite(a).all()
    # E[dropout(P)] = P: the mean of many draws approaches the result without dropout
    # (their relative spread: sqrt(p / (1 - p) / 256) ~ 0.04).
    mean = sum(run().double() for _ in range(256)) / 256
    plain = fastattn.torch.scaled_dot_product_attention(q, k, v, mask, recognize_mask=True).double()
    assert rel(mean, plain) < 0.1
    grads = torch.autograd.grad(a, (q, k, v), torch.randn_like(a))
    assert all(torch.isfinite(g).all() for g in grads)


def test_recognize_mask_takes_the_bias_inside_a_cuda_graph_capture(forms):
    q, k, v = (torch.randn(2, HQ, 128, D, device=DEV, dtype=torch.float16) for _ in range(3))
    mask = causal(128, 128)
    call = lambda recognize: fastattn.torch.scaled_dot_product_attention(  # noqa: E731
        q, k, v, mask, recognize_mask=recognize)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(True), call(False)  # warm: the plans for both forms exist (a capture builds none)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            forms.clear()
            out = call(True)
    torch.cuda.current_stream().wait_stream(s)
    # Not read during the capture (no synchronization): the mask ran as a bias.
    assert [f["causal"] for f in forms] == [False] and forms[0]["bias"] == (1, 1, 128, 128)
    q.copy_(torch.randn_like(q))
    graph.replay()
    ref, _ = reference(q, k, v, mask)
    assert rel(out, ref) < FWD_TOL[torch.float16]


def test_torch_compile_fullgraph():
    q, k, v = (torch.randn(2, HQ, 128, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = key_padding([128, 40], 128)
    f = torch.compile(lambda q, k, v, m: fastattn.torch.scaled_dot_product_attention(q, k, v, m, recognize_mask=True),
                      fullgraph=True)
    o = f(q, k, v, mask)
    ref, leaves = reference(q, k, v, mask)
    assert rel(o, ref) < FWD_TOL[torch.bfloat16]
    d_o = torch.randn_like(o)
    for g, rg in zip(torch.autograd.grad(o, (q, k, v), d_o), torch.autograd.grad(ref, leaves, d_o.double())):
        assert rel(g, rg) < BWD_TOL[torch.bfloat16]
