"""GPU: the SDPA mode. A module calling torch.nn.functional.scaled_dot_product_attention gives
the same outputs and gradients with the mode on (fastattn's kernels, which the routes
record) and off (PyTorch's cuDNN backend), and both agree with PyTorch's math in float64;
under torch.compile(fullgraph=True) and in a CUDA graph capture; a call fastattn
cannot read (a query in no layout it takes) runs PyTorch's kernel without an error; and
the backends a user enables hold: without cuDNN's (sdpa_kernel, enable_cudnn_sdp) every
call is PyTorch's own."""

import contextlib
import gc
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import torch.nn.functional as F  # noqa: E402

import fastattn.torch  # noqa: E402
from fastattn.torch import _native, _sdpa_mode  # noqa: E402
from helpers.torch import in_threads, sdpa_mode_on, take_python_path  # noqa: E402

DEV = "cuda"
TOL = 3e-2  # bfloat16


@pytest.fixture(params=("native", "python"))
def mode(request, monkeypatch):
    """The mode on, with the op library's C++ kernels (csrc/sdpa.cpp; it must load on the
    GPU machine) or the Python ones (_sdpa_mode._forward, _backward)."""
    with sdpa_mode_on(request.param, monkeypatch):
        yield request.param


class Attn(torch.nn.Module):
    def __init__(self, heads=8, kv_heads=2, dim=64):
        super().__init__()
        self.h, self.hk, self.d = heads, kv_heads, dim
        self.qkv = torch.nn.Linear(heads * dim, (heads + 2 * kv_heads) * dim, bias=False)

    def forward(self, x, mask=None, causal=True):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d, self.hk * self.d, self.hk * self.d], -1)
        q, k, v = (t.view(b, s, -1, self.d).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                           enable_gqa=self.h != self.hk)
        return o.transpose(1, 2).reshape(b, s, -1)


def _run(model, x, **kw):
    x = x.detach().requires_grad_()
    model.zero_grad()
    out = model(x, **kw)
    out.float().square().sum().backward()
    return out.detach(), x.grad, model.qkv.weight.grad.clone()


@pytest.mark.parametrize("heads,kv_heads,masked", [(8, 8, False), (8, 2, False), (8, 8, True)])
def test_outputs_and_gradients_match_with_the_mode_on_and_off(mode, heads, kv_heads, masked):
    torch.manual_seed(0)
    model = Attn(heads, kv_heads).to(DEV, torch.bfloat16)
    x = torch.randn(2, 128, heads * 64, device=DEV, dtype=torch.bfloat16)
    mask = torch.randn(2, 1, 128, 128, device=DEV, dtype=torch.bfloat16) if masked else None
    before = fastattn.stats()["sdpa"]["served"]
    on = _run(model, x, mask=mask)
    assert fastattn.stats()["sdpa"]["served"] == before + 1, fastattn.stats()["sdpa"]  # one SDPA call, served
    routes = list(_sdpa_mode.sdpa_routes().values())
    if mode == "native":  # the C++ kernels ran the calls (each signature asked _route once)
        assert _native.library().sdpa_route_count() == len(routes), (routes, _native.library().sdpa_route_count())
    fastattn.torch.disable_sdpa()
    off = _run(model, x, mask=mask)
    fastattn.torch.enable_sdpa()
    ref = _run(model.double(), x.double(), mask=None if mask is None else mask.double())
    model.bfloat16()
    for a, b, r in zip(on, off, ref):
        torch.testing.assert_close(a.double(), r, atol=TOL * r.abs().max().item(), rtol=TOL)
        torch.testing.assert_close(b.double(), r, atol=TOL * r.abs().max().item(), rtol=TOL)
    # (PyTorch may give a call to another backend: then no route, and nothing to check here)
    assert all(r.startswith("fastattn") for r in routes), routes
    if not routes:
        pytest.skip("PyTorch gave these calls to a backend other than cuDNN")


def test_compiled_fullgraph_and_captured_in_a_cuda_graph(mode):
    torch.manual_seed(0)
    model = Attn().to(DEV, torch.bfloat16)
    x = torch.randn(2, 64, 512, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(x), want, atol=TOL, rtol=TOL)
        graph = torch.cuda.CUDAGraph()
        static = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(static)  # the plan is loaded outside the capture
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            out = model(static)
        static.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, model(static), atol=0, rtol=0)
    assert any(r.startswith("fastattn") for r in _sdpa_mode.sdpa_routes().values())


def test_a_call_fastattn_does_not_take_runs_pytorchs_kernel(mode):
    q = torch.randn(2, 8, 64, 64, device=DEV, dtype=torch.bfloat16)
    fp32 = q.float()
    torch.testing.assert_close(F.scaled_dot_product_attention(fp32, fp32, fp32),
                               torch.ops.aten._scaled_dot_product_attention_math(fp32, fp32, fp32)[0], atol=1e-4,
                               rtol=1e-4)
    odd = torch.randn(64, 64, 2, 8, device=DEV, dtype=torch.bfloat16).permute(2, 3, 0, 1)  # head dim outermost
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
                                         torch.nn.attention.SDPBackend.MATH]):
        got = F.scaled_dot_product_attention(odd, odd, odd)
    want = torch.ops.aten._scaled_dot_product_attention_math(odd.double(), odd.double(), odd.double())[0]
    torch.testing.assert_close(got.double(), want, atol=TOL, rtol=TOL)


def test_dropout_is_seeded_unbiased_and_its_backward_drops_what_the_forward_dropped(mode):
    # v the identity (as many keys as the head dim): o is then the dropped-out attention
    # matrix A itself (P * mask / (1 - p)), and d_v of sum(o * g) is A^T g, which holds only
    # if the backward drops what the forward dropped (the seed and offset round trip).
    p, s = 0.25, 64
    q = torch.randn(2, 4, s, s, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, 4, s, s, device=DEV, dtype=torch.bfloat16)
    v = torch.eye(s, device=DEV, dtype=torch.bfloat16).expand(2, 4, s, s).contiguous().requires_grad_()
    cudnn = [torch.nn.attention.SDPBackend.CUDNN_ATTENTION]
    with torch.nn.attention.sdpa_kernel(cudnn):
        torch.manual_seed(1)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        g = torch.randn_like(o)
        (d_v,) = torch.autograd.grad(o, v, g)
        torch.manual_seed(1)
        again = F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (the same training graph)
        with torch.no_grad():
            mean = sum(F.scaled_dot_product_attention(q, k, v, dropout_p=p).float() for _ in range(200)) / 200
            plain = F.scaled_dot_product_attention(q, k, v).float()
    assert torch.equal(o, again)  # torch's generator seeds it
    dropped = (o == 0).float().mean().item()
    assert abs(dropped - p) < 0.03, dropped  # a quarter of the weights dropped
    want = o.float().transpose(-1, -2) @ g.float()
    torch.testing.assert_close(d_v.float(), want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)
    # Unbiased: each weight's mean over the draws within 6 of its standard errors (a draw's
    # weight is P / (1 - p) or 0), plus bf16's rounding of each draw.
    stderr = plain.abs() * (p / (1 - p) / 200) ** 0.5 + 1e-2 * plain.abs() + 1e-4
    z = ((mean - plain).abs() / stderr).max().item()
    assert z < 6, z
    routes = list(_sdpa_mode.sdpa_routes().values())
    assert routes and all(r.startswith("fastattn") for r in routes), routes


def test_the_modes_first_call_in_a_fresh_process_imports_none_of_torchs_lazy_modules(tmp_path):
    # A server's first SDPA call with the mode on: fastattn's, on a warm cache, without
    # sympy or torch.fx's symbolic shapes (a Meta kernel call brings them: seconds of that
    # first call on the H200).
    code = ("import sys, torch, torch.nn.functional as F, fastattn.torch; fastattn.torch.enable_sdpa(); "
            "from fastattn.torch import _sdpa_mode; "
            "q = torch.randn(1, 128, 8, 64, device='cuda', dtype=torch.bfloat16).transpose(1, 2); "
            "before = set(sys.modules); o = F.scaled_dot_product_attention(q, q, q, is_causal=True); "
            "torch.cuda.synchronize(); routes = set(_sdpa_mode.sdpa_routes().values()); "
            "assert routes == {'fastattn (bshd)'}, routes; "
            "print(sorted(m for m in ('sympy', 'torch.fx.experimental.symbolic_shapes', 'torch._dynamo') "
            "if m in sys.modules and m not in before))")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "FASTATTN_CACHE_DIR": str(tmp_path)}
    for _ in range(2):  # an empty cache, then the warm one a server starts with
        r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                           env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_a_float32_mask_beside_bfloat16_queries_is_served_and_finite(mode):
    # PyTorch 2.11 sends this call to its cuDNN kernel, which returns NaN for it (measured by
    # benchmarks/probe_sdpa_gates.py): the mode serves it, the mask rounded to bfloat16.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 96, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = torch.randn(2, 1, 96, 96, device=DEV) * 4
    before = fastattn.stats()["sdpa"]["served"]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert fastattn.stats()["sdpa"]["served"] == before + 1, fastattn.stats()["sdpa"]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    # (against the mask as the mode reads it, rounded to bfloat16: what it promises)
    ref = torch.ops.aten._scaled_dot_product_attention_math(*leaves, attn_mask=mask.bfloat16().double())[0]
    want = torch.autograd.grad(ref, leaves, g.double())
    for got, r in zip((out, *grads), (ref, *want)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), r, atol=TOL * r.abs().max().item(), rtol=TOL)


def _math64(q, k, v, mask, causal, gqa):
    """PyTorch's math kernel in float64 (a mask's rows that keep no key: zeros). A
    boolean mask is converted first, as SDPA's entry converts it (0 where True, -inf where
    False): the math kernel called directly adds a boolean mask as 1 and 0."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    m = None if mask is None else mask.double()
    if mask is not None and mask.dtype == torch.bool:
        m = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device).masked_fill(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(*leaves, attn_mask=m, is_causal=causal,
                                                             enable_gqa=gqa)[0], leaves


_B = torch.nn.attention.SDPBackend


def _case(name):
    """(mask, is_causal, enable_gqa, the backends PyTorch may pick) of each call PyTorch 2.11
    gives a backend other than cuDNN on the H200 (benchmarks/probe_sdpa_gates.py), or that a
    user restricts to cuDNN and others, or whose rows of -inf alone PyTorch's kernels need not
    answer alike."""
    g = torch.Generator(device=DEV).manual_seed(3)
    keep = torch.rand(2, 1, 96, 96, device=DEV, generator=g) > 0.2
    keep[1, 0, 5] = False  # a row that keeps no key
    minus_inf = torch.randn(2, 1, 96, 96, device=DEV, dtype=torch.bfloat16, generator=g)
    minus_inf[1, 0, 5] = float("-inf")  # the same in an additive mask
    return {
        "3-d additive mask": (torch.randn(8, 96, 96, device=DEV, dtype=torch.bfloat16, generator=g), False, False,
                              None),
        "boolean mask expanded along the keys, GQA": (
            (torch.rand(2, 1, 96, 1, device=DEV, generator=g) > 0.1).expand(2, 1, 96, 96), False, True, None),
        "boolean mask with a row keeping no key, GQA": (keep, False, True, None),
        "additive mask with a row of -inf": (minus_inf, False, False, None),
        "causal GQA with flash and cuDNN enabled": (None, True, True, [_B.FLASH_ATTENTION, _B.CUDNN_ATTENTION]),
        "boolean mask with math and cuDNN enabled": (keep, False, False, [_B.MATH, _B.CUDNN_ATTENTION]),
    }[name]


@pytest.mark.parametrize("name", ["3-d additive mask", "boolean mask expanded along the keys, GQA",
                                  "boolean mask with a row keeping no key, GQA", "additive mask with a row of -inf",
                                  "causal GQA with flash and cuDNN enabled",
                                  "boolean mask with math and cuDNN enabled"])
def test_calls_pytorch_gives_other_backends_are_served_too(mode, name):
    mask, causal, gqa, backends = _case(name)
    torch.manual_seed(0)
    q = torch.randn(2, 8, 96, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2 if gqa else 8, 96, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    before = fastattn.stats()["sdpa"]
    if backends is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    else:
        with torch.nn.attention.sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    after = fastattn.stats()["sdpa"]
    assert after["served"] == before["served"] + 1 and after["passed_on"] == before["passed_on"], after
    ref, leaves = _math64(q, k, v, mask, causal, gqa)
    want = torch.autograd.grad(ref, leaves, g.double())
    for got, r in zip((out, *grads), (ref, *want)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), r, atol=TOL * r.abs().max().item(), rtol=TOL)
    if mask is not None:  # rows that keep no key (False, or -inf, throughout): zeros
        keep = mask if mask.dtype == torch.bool else mask != float("-inf")
        assert (out[~keep.expand(2, 8, 96, 96).any(-1)] == 0).all()


@pytest.mark.parametrize("d_qk,d_v", [(60, 60), (12, 20), (64, 36)])
def test_head_dims_not_multiples_of_8_are_served_padded(mode, d_qk, d_v):
    # cuDNN takes head dims of multiples of 8; PyTorch's flash backend pads the others, and the
    # mode serves them padded likewise (the scale at the real head dim's), forward and backward.
    torch.manual_seed(0)
    q = torch.randn(2, 8, 96, d_qk, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 96, d_qk, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, 96, d_v, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    before = fastattn.stats()["sdpa"]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    after = fastattn.stats()["sdpa"]
    assert after["served"] == before["served"] + 1 and after["passed_on"] == before["passed_on"], after
    assert after["head_dim_padded"] == before["head_dim_padded"] + 1
    assert out.shape == (2, 8, 96, d_v)
    ref, leaves = _math64(q, k, v, None, True, True)
    want = torch.autograd.grad(ref, leaves, g.double())
    for got, r in zip((out, *grads), (ref, *want)):
        assert got.shape == r.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), r, atol=TOL * r.abs().max().item(), rtol=TOL)


@pytest.mark.parametrize("shape,dtype", [((8, 96, 96), torch.bfloat16), ((96, 96), torch.float32),
                                         ((2, 8, 96, 96), torch.bfloat16), ((2, 1, 1, 96), torch.float32)])
def test_a_mask_that_requires_grad_gets_its_gradient(mode, shape, dtype):
    # A learned bias: PyTorch's cuDNN operator gives it no gradient, so the mode runs the call
    # on fastattn's dense op with cuDNN's bias gradient. A per-head (1, heads, seq_q, seq_kv)
    # bias is the shape cuDNN's bias gradient is built for (fastattn's bias_grad feature): it
    # is served; any other is served (expanded to (batch, heads) where cuDNN wants that) or
    # handed on with cuDNN's reason. Either way the gradients, the mask's included, are right.
    torch.manual_seed(0)
    q = torch.randn(2, 8, 96, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 96, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    mask = torch.randn(shape, device=DEV, dtype=dtype).requires_grad_()
    before = fastattn.stats()["sdpa"]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, mask), g)
    after = fastattn.stats()["sdpa"]
    served = after["served"] - before["served"]
    handed = {r: n - before["passed_on"].get(r, 0) for r, n in after["passed_on"].items()
              if n != before["passed_on"].get(r, 0)}
    assert (served, handed) == (1, {}) or (served == 0 and len(handed) == 1 and shape != (8, 96, 96)), (served, handed)
    assert after["mask_grad"] - before["mask_grad"] == served
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    m64 = mask.detach().to(torch.bfloat16).double().requires_grad_()  # (the mask as the kernels read it)
    ref = torch.ops.aten._scaled_dot_product_attention_math(*leaves, attn_mask=m64, enable_gqa=True)[0]
    want = torch.autograd.grad(ref, (*leaves, m64), g.double())
    assert grads[3].shape == mask.shape and grads[3].dtype == mask.dtype
    for got, r in zip((out, *grads), (ref, *want)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), r, atol=TOL * r.abs().max().item(), rtol=TOL)


def _step(q, k, v, g, backends=None):
    """(output, d_q, d_k, d_v) of one causal SDPA training call, in an sdpa_kernel context
    of `backends` where given."""
    with torch.nn.attention.sdpa_kernel(backends) if backends else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), g))


def _inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 96, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(2, 8, 96, 64, device=DEV, dtype=torch.bfloat16)


@pytest.mark.parametrize("backends", [[_B.MATH], [_B.FLASH_ATTENTION], [_B.EFFICIENT_ATTENTION],
                                      [_B.FLASH_ATTENTION, _B.EFFICIENT_ATTENTION, _B.MATH]],
                         ids=lambda b: "+".join(x.name for x in b))
def test_under_sdpa_kernel_without_cudnn_the_call_is_pytorchs_own(mode, backends):
    # A user who restricts the backends gets their kernels: fastattn serves nothing, each
    # call is counted as handed on with the reason, and the output is the one the mode off
    # gives (bit for bit: these forward kernels are deterministic; the math backward too).
    q, k, v, g = _inputs()
    before = fastattn.stats()["sdpa"]
    on = _step(q, k, v, g, backends)
    after = fastattn.stats()["sdpa"]
    off_reason = _sdpa_mode.EARLY[3]
    assert after["served"] == before["served"], after
    assert after["passed_on"].get(off_reason, 0) == before["passed_on"].get(off_reason, 0) + 1, after
    fastattn.torch.disable_sdpa()
    try:
        off = _step(q, k, v, g, backends)
    finally:
        fastattn.torch.enable_sdpa()
    assert torch.equal(on[0], off[0])
    for a, b in zip(on[1:], off[1:]):
        if backends == [_B.MATH]:
            assert torch.equal(a, b)
        else:  # (flash's and efficient's backwards accumulate in whatever order their blocks finish)
            torch.testing.assert_close(a, b, atol=TOL * b.abs().max().item(), rtol=TOL)


def test_under_sdpa_kernel_cudnn_attention_fastattn_serves(mode):
    q, k, v, g = _inputs()
    before = fastattn.stats()["sdpa"]
    got = _step(q, k, v, g, [_B.CUDNN_ATTENTION])
    after = fastattn.stats()["sdpa"]
    assert after["served"] == before["served"] + 1 and after["passed_on"] == before["passed_on"], after
    ref, leaves = _math64(q, k, v, None, True, False)
    want = (ref, *torch.autograd.grad(ref, leaves, g.double()))
    for a, r in zip(got, want):
        torch.testing.assert_close(a.double(), r, atol=TOL * r.abs().max().item(), rtol=TOL)
    assert any(r.startswith("fastattn") for r in _sdpa_mode.sdpa_routes().values())


def test_enable_cudnn_sdp_false_process_wide_hands_every_call_to_pytorch_until_it_is_on_again(mode):
    # What a library turning cuDNN SDPA off at import does: every call, in every thread, is
    # PyTorch's, on its other backends, counted with the reason.
    q, k, v, g = _inputs()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        before = fastattn.stats()["sdpa"]
        results = in_threads(2, lambda i: _step(q, k, v, g)[0])
        after = fastattn.stats()["sdpa"]
        fastattn.torch.disable_sdpa()
        try:
            want = _step(q, k, v, g)[0]
        finally:
            fastattn.torch.enable_sdpa()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    off_reason = _sdpa_mode.EARLY[3]
    assert after["served"] == before["served"], after
    assert after["passed_on"].get(off_reason, 0) == before["passed_on"].get(off_reason, 0) + 2, after
    for got in results.values():
        assert torch.equal(got, want)
    before = fastattn.stats()["sdpa"]["served"]
    _step(q, k, v, g)
    assert fastattn.stats()["sdpa"]["served"] == before + 1  # on again: served


def test_in_inference_mode_calls_are_served(mode):
    q = torch.randn(2, 8, 1, 64, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 200, 64, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    before = fastattn.stats()["sdpa"]["served"]
    with torch.inference_mode():
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # a decode step
    assert fastattn.stats()["sdpa"]["served"] == before + 1
    ref = _math64(q, k, v, None, False, True)[0]
    torch.testing.assert_close(out.double(), ref, atol=TOL * ref.abs().max().item(), rtol=TOL)


@pytest.mark.parametrize("name", ["boolean mask with a row keeping no key, GQA", "additive mask with a row of -inf"])
def test_masked_calls_are_captured_in_a_cuda_graph_and_replay_new_masks(mode, name):
    # The mask's conversion runs on the device only: a copy from the host (at::where's
    # scalar operands) would wait for the stream, which a capture refuses.
    mask, _, gqa, _ = _case(name)
    torch.manual_seed(0)
    hk = 2 if gqa else 8
    shapes = ((2, 8, 96, 64), (2, hk, 96, 64), (2, hk, 96, 64))
    static = [torch.randn(s, device=DEV, dtype=torch.bfloat16) for s in shapes]
    static_mask = mask.clone()

    def call():
        return F.scaled_dot_product_attention(*static, attn_mask=static_mask, enable_gqa=gqa)

    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call()  # the plan is loaded outside the capture
        torch.cuda.current_stream().wait_stream(s)
        before = fastattn.stats()["sdpa"]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        after = fastattn.stats()["sdpa"]
        assert after["served"] == before["served"] + 1 and after["passed_on"] == before["passed_on"], after
        for t in static:
            t.copy_(torch.randn_like(t))
        new_mask = mask.roll(7, dims=-1)  # other keys kept, and the empty row still empty
        static_mask.copy_(new_mask)
        graph.replay()
        torch.testing.assert_close(out, call(), atol=0, rtol=0)
    ref = _math64(*static, new_mask, False, gqa)[0]
    torch.testing.assert_close(out.double(), ref, atol=TOL * ref.abs().max().item(), rtol=TOL)
    keep = new_mask if new_mask.dtype == torch.bool else new_mask != float("-inf")
    assert (out[~keep.expand(2, 8, 96, 96).any(-1)] == 0).all() and (~keep.any(-1)).any()


def _queued_behind_a_sleep(step) -> str | None:
    """Runs step() with a ~0.5 s sleep kernel queued ahead of it, PyTorch's synchronizing calls
    an error meanwhile (torch.cuda.set_sync_debug_mode: a pageable copy, .item(), a stream
    synchronization); None where step() returned while the sleep still ran, else what the
    step did that can wait: its host time, the caching allocator's counts over it (cudaMalloc,
    cudaFree, retries, synchronizations) and the live threads."""
    gc.disable()  # a full collection late in a long suite can take a good part of the sleep
    prior = torch.cuda.get_sync_debug_mode()
    try:
        allocator = torch.cuda.memory_stats()
        torch.cuda._sleep(1_000_000_000)
        asleep = torch.cuda.Event()
        asleep.record()
        start = time.perf_counter()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(prior)
        host_s = time.perf_counter() - start
        if not asleep.query():
            return None
        after = torch.cuda.memory_stats()
        counts = {k: after.get(k, 0) - allocator.get(k, 0)
                  for k in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}
        return (f"host time {host_s:.3f} s, allocator {counts}, "
                f"threads {sorted(t.name for t in threading.enumerate())}")
    finally:
        gc.enable()
        torch.cuda.synchronize()


@pytest.mark.parametrize("name", ["boolean mask with a row keeping no key, GQA", "additive mask with a row of -inf"])
def test_a_masked_call_and_its_backward_never_wait_for_the_gpu(mode, name):
    # The host queues the calls behind a sleep kernel and returns while the sleep still runs: a
    # copy from the host, or any other synchronization of the calls', waits it out every time.
    mask, _, gqa, _ = _case(name)
    q = torch.randn(2, 8, 96, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2 if gqa else 8, 96, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        out.backward(out)  # (out as its own gradient: nothing else to allocate)
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    # Two steps first: the first loads the plans and makes the constants, the second is the first
    # to add into existing .grad.
    step()
    step()
    torch.cuda.synchronize()
    before = fastattn.stats()["sdpa"]["served"]
    # Up to three tries: on the H200 one try in a few waited the whole sleep out, in suites of
    # three processes sharing the GPU, with no PyTorch synchronization in the step; a first
    # launch of a kernel (CUDA's lazy loading can synchronize the context) or a cudaMalloc the
    # allocator makes once would do that, and the next try would not wait. A per-call wait
    # waits every time. A try that waited is reported as a warning, with what it did.
    waits = []
    for _ in range(3):
        waited = _queued_behind_a_sleep(step)
        if waited is None:
            break
        waits.append(waited)
    else:
        pytest.fail(f"the masked calls waited for the GPU in each of 3 tries: {waits}")
    for waited in waits:
        warnings.warn(f"a try of the masked calls waited for the GPU, the next did not: {waited}", stacklevel=1)
    assert fastattn.stats()["sdpa"]["served"] == before + 2 * (len(waits) + 1)
