"""The SDPA mode (fastattn.torch.enable_sdpa) on the CPU: registration and undoing it, the
schema gate, FASTATTN_SDPA, the layouts and biases a call becomes, and the kernels' round
trip through PyTorch's own operator, autograd formula and Meta kernel (eager and under
torch.compile with fullgraph), with fastattn's dense work replaced by a float64 model of
it. The kernels are registered for the CPU key as well in these tests only (the mode
registers them for CUDA), so that the cuDNN operator can be called here; what they do
with a call does not depend on the key. What this cannot check: cuDNN, PyTorch's choice
of its cuDNN backend on a GPU, CUDA graphs (test_sdpa_mode_gpu.py)."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn.torch  # noqa: E402
from fastattn import InvalidArgumentError, NotSupportedError, bounded, runtime  # noqa: E402
from fastattn.torch import _dense, _sdpa_mode  # noqa: E402

OP = torch.ops.aten._scaled_dot_product_cudnn_attention.default


def _logical(t, layout):
    return t.permute({"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3)}[layout])


def _from_logical(t, layout):
    return t.permute({"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}[layout])


def _reference(q, k, v, bias, options):
    """(o, lse) of fastattn's dense attention in float64, on bhsd tensors."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = options.scale or 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.double()
    if options.causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = s.logsumexp(-1, keepdim=True)
    return (s - lse).exp() @ v, lse


class Model:
    """forward_impl / backward_impl / plan_for of _dense, in float64; records calls."""

    def __init__(self):
        self.calls = []
        self.no_deterministic = False  # a cuDNN that builds no deterministic backward
        self.bias_grad_full_only = False  # a cuDNN that builds a bias gradient for (batch, heads, ...) biases only

    def plan_for(self, q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, o, options):
        assert o is None and seq_len_q is None and sink is None
        if 0 in (*q.shape, *k.shape):  # as fastattn's config refuses it
            raise InvalidArgumentError("an extent of 0: must be >= 1")
        if q.shape[-1] % 8 or v.shape[-1] % 8:  # as cuDNN refuses them
            raise NotSupportedError("head dims: cuDNN takes multiples of 8")
        if options.deterministic and self.no_deterministic:
            raise NotSupportedError("backward: no deterministic engine here")
        if bias is not None:
            assert bias.is_contiguous() and bias.dim() == 4 and bias.dtype == q.dtype
        if options.bias_grad and self.bias_grad_full_only and 1 in bias.shape[:2]:
            raise NotSupportedError("bias gradient: a bias of (batch, heads, seq_q, seq_kv) only")
        self.calls.append(("plan", options))

    def forward_impl(self, q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, options):
        layout = options.layout
        o, lse = _reference(*(_logical(t, layout) for t in (q, k, v)), bias, options)
        self.calls.append(("forward", options.layout, bias is None))
        o = _from_logical(o, layout).to(q.dtype).contiguous()  # contiguous in the layout, as fastattn's
        return o, (lse.float() if options.training else None)

    def backward_impl(self, d_o, o, stats, q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, options):
        # By hand: the kernel runs below autograd, where no graph is recorded.
        layout = options.layout
        ql, kl, vl, do = (_logical(t, layout).double() for t in (q, k, v, d_o))
        assert stats.shape == (*ql.shape[:3], 1)
        rep = ql.shape[1] // kl.shape[1]
        kr, vr = kl.repeat_interleave(rep, 1), vl.repeat_interleave(rep, 1)
        scale = options.scale or 1.0 / math.sqrt(ql.shape[-1])
        s = ql @ kr.transpose(-1, -2) * scale
        if bias is not None:
            s = s + bias.double()
        if options.causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        p = s.softmax(-1)
        dp = do @ vr.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq = ds @ kr * scale
        dk = (ds.transpose(-1, -2) @ ql * scale).unflatten(1, (kl.shape[1], rep)).sum(2)
        dv = (p.transpose(-1, -2) @ do).unflatten(1, (kl.shape[1], rep)).sum(2)
        self.calls.append(("backward", layout))
        d_bias = None
        if options.bias_grad:  # ds summed over the bias's broadcast dims, in its dtype
            dims = [d for d in range(4) if bias.shape[d] == 1]
            d_bias = (ds.sum(dims, keepdim=True) if dims else ds).to(bias.dtype).contiguous()  # (sum([]): all dims)
        return (*(_from_logical(g, layout).to(q.dtype).contiguous() for g in (dq, dk, dv)), None, None, d_bias, None,
                None)


@pytest.fixture
def model(monkeypatch):
    m = Model()
    for name in ("plan_for", "forward_impl", "backward_impl"):
        monkeypatch.setattr(_dense, name, getattr(m, name))
    _sdpa_mode._routes.clear()
    lib = torch.library.Library("aten", "IMPL")  # the kernels on the CPU key: these tests' only
    lib.impl("_scaled_dot_product_cudnn_attention", _sdpa_mode._forward, "CPU")
    lib.impl("_scaled_dot_product_cudnn_attention_backward", _sdpa_mode._backward, "CPU")
    yield m
    lib._destroy()
    _sdpa_mode._routes.clear()


def _qkv(b, hq, hk, sq, skv, d, layout="bshd", dtype=torch.bfloat16):
    def make(h, s):
        t = torch.randn(*(b, s, h, d) if layout == "bshd" else (b, h, s, d), dtype=dtype)
        return (t.transpose(1, 2) if layout == "bshd" else t).requires_grad_()
    return make(hq, sq), make(hk, skv), make(hk, skv)


def _sdpa_reference(q, k, v, bias=None, causal=False, scale=None):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(
        q64, k64, v64, attn_mask=None if bias is None else bias.double(), is_causal=causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return o, (q64, k64, v64)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("causal,gqa,with_bias", [(True, False, False), (False, True, False), (False, False, True)])
def test_the_cudnn_operator_runs_fastattn_with_pytorchs_outputs_and_gradients(model, layout, causal, gqa, with_bias):
    q, k, v = _qkv(2, 4, 2 if gqa else 4, 5, 5 if causal else 7, 16, layout)
    bias = torch.randn(1, 1, 5, k.shape[2], dtype=torch.bfloat16).expand(2, 4, 5, k.shape[2]) if with_bias else None
    out, lse, cq, ck, max_q, max_k, seed, offset, debug = OP(q, k, v, bias, True, 0.0, causal, False, scale=0.3)
    meta = OP(*(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if t is not None else None
                for t in (q, k, v, bias)), True, 0.0, causal, False, scale=0.3)
    assert out.shape == meta[0].shape and out.stride() == meta[0].stride()  # the query's memory order
    assert lse.shape == meta[1].shape and lse.dtype == torch.float32
    assert (max_q, max_k) == (5, k.shape[2]) and seed.shape == () and offset.shape == ()
    ref, leaves = _sdpa_reference(q, k, v, bias, causal, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(ref)
    (out.double() * g).sum().backward()
    (ref * g).sum().backward()
    for ours, theirs in zip((q, k, v), leaves):
        assert ours.grad.stride() == ours.stride()  # the backward's Meta kernel: empty_like
        torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=3e-2, rtol=3e-2)
    kinds = [c[0] for c in model.calls]
    assert kinds.count("forward") == 1 and kinds.count("backward") == 1 and kinds.count("plan") == 1
    if with_bias:  # the expanded bias became one of cuDNN's broadcast shapes, contiguous
        assert model.calls[1][2] is False


def test_a_float32_bias_beside_bfloat16_queries_is_served_rounded_to_their_dtype(model):
    # PyTorch 2.11's own cuDNN kernel returns NaN for this call (on the H200): the mode serves it,
    # the bias rounded to bfloat16 (the Model asserts the dtype fastattn's plan gets).
    q, k, v = _qkv(2, 4, 4, 5, 7, 16, "bshd")
    bias = torch.randn(2, 1, 5, 7) * 4
    assert bias.dtype == torch.float32
    out = OP(q, k, v, bias, True, 0.0, False, False, scale=None)[0]
    assert [c[0] for c in model.calls] == ["plan", "forward"]
    # Against the bias as the mode promises to read it, rounded: against the float32 bias
    # itself, scores of up to ~12 are off by up to ~0.02 each, and the test failed one
    # draw in several (whichever draw the tests run before it left).
    ref, leaves = _sdpa_reference(q, k, v, _mask64(bias))
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(ref)
    (out.double() * g).sum().backward()
    (ref * g).sum().backward()
    for ours, theirs in zip((q, k, v), leaves):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=3e-2, rtol=3e-2)
    assert [c[0] for c in model.calls] == ["plan", "forward", "backward"]
    assert bias.dtype == torch.float32  # the caller's mask is left as it was
    # Another dtype than the query's or float32 (which SDPA itself refuses) is not taken.
    assert "float16" in _sdpa_mode._decide(q, k, v, bias.half(), 0.0, False, None, False)


def test_a_call_fastattn_refuses_runs_pytorchs_own_kernel_and_its_backward_too(model, monkeypatch):
    ran = []

    def refuse(*args):
        raise NotSupportedError("cuDNN refuses this graph")

    monkeypatch.setattr(_dense, "plan_for", refuse)
    monkeypatch.setattr(torch.ops.aten, "_cudnn_attention_forward",
                        lambda *a, **kw: ran.append("forward") or ("pytorch's", a, kw), raising=False)
    q, k, v = _qkv(1, 2, 2, 3, 3, 8)
    got = _sdpa_mode._forward(q, k, v, None, True, 0.0, False, False, scale=None)
    assert got[0] == "pytorch's" and ran == ["forward"]
    route = _sdpa_mode._routes[next(iter(_sdpa_mode._routes))][0]
    assert "cuDNN refuses this graph" in route
    monkeypatch.setattr(torch.ops.aten, "_cudnn_attention_backward",
                        lambda *a, **kw: ran.append("backward") or "pytorch's backward", raising=False)
    assert _sdpa_mode._backward(q, q, k, v, q, None, None, None, None, None, None, 3, 3, 0.0, False) \
        == "pytorch's backward"
    assert ran == ["forward", "backward"]


def test_served_and_passed_on_calls_are_counted_in_fastattns_stats(model, monkeypatch):
    import fastattn

    monkeypatch.setattr(_sdpa_mode, "_calls", {})
    monkeypatch.setattr(_sdpa_mode, "_native_kernels", None)  # (the Python kernels here)
    q, k, v = _qkv(1, 2, 2, 3, 3, 8)
    for _ in range(3):
        OP(q, k, v, None, False, 0.0, True, False, scale=None)  # served: the model's plan
    assert fastattn.stats()["sdpa"] == {"served": 3, "head_dim_padded": 0, "mask_grad": 0, "passed_on": {}}
    monkeypatch.setattr(torch.ops.aten, "_cudnn_attention_forward", lambda *a, **kw: ("pytorch's",), raising=False)
    _sdpa_mode._forward(q, k, v, None, False, 0.0, True, True, scale=None)  # the debug mask: PyTorch's
    fp32 = torch.randn(1, 2, 3, 8)
    for _ in range(2):
        _sdpa_mode._forward(fp32, fp32, fp32, None, False, 0.0, False, False, scale=None)  # refused: float32
    got = fastattn.stats()["sdpa"]
    [(reason, n)] = [(r, n) for r, n in got["passed_on"].items() if "float32" in r]
    assert got["served"] == 3 and n == 2 and got["passed_on"][_sdpa_mode._DEBUG] == 1 and len(got["passed_on"]) == 2
    fastattn.clear()
    assert fastattn.stats()["sdpa"] == {"served": 0, "head_dim_padded": 0, "mask_grad": 0, "passed_on": {}}


def test_dtypes_and_strides_fastattn_does_not_read_go_to_pytorch_without_asking_it(model):
    q, k, v = (torch.randn(1, 2, 3, 8) for _ in range(3))
    assert "float32" in _sdpa_mode._decide(q, k, v, None, 0.0, False, None, False)
    q2 = torch.randn(1, 3, 8, 2).permute(0, 3, 1, 2)  # (b, h, s, d) with the head dim outermost but one
    assert "no memory order" in _sdpa_mode._decide(q2.bfloat16(), q2.bfloat16(), q2.bfloat16(), None, 0.0,
                                                   False, None, False)
    assert model.calls == []


def test_compiled_with_fullgraph_the_kernels_agree_with_pytorchs_meta_kernel(model):
    q, k, v = _qkv(2, 4, 4, 6, 6, 16, "bshd")

    def f(q, k, v):
        return OP(q, k, v, None, True, 0.0, True, False, scale=None)[0]

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    out.float().sum().backward()
    ref, leaves = _sdpa_reference(q, k, v, causal=True)
    ref.sum().backward()
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q.grad.double(), leaves[0].grad, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("layout,order", [("bhsd", (0, 1, 2, 3)), ("bshd", (0, 2, 1, 3)), ("sbhd", (2, 0, 1, 3))])
def test_layout_of_reads_the_memory_order(layout, order):
    shape = (2, 3, 5, 8)
    t = torch.empty([shape[i] for i in order]).permute([order.index(i) for i in range(4)])
    assert t.shape == shape and _sdpa_mode.layout_of(t) == layout
    assert _sdpa_mode.layout_of(torch.empty(1, 1, 5, 8)) == "bhsd"  # extents of 1 fit anywhere


def test_bias_takes_cudnns_broadcast_shapes():
    q, k = torch.empty(2, 4, 5, 8), torch.empty(2, 4, 7, 8)
    row = torch.randn(2, 1, 1, 7)
    assert _sdpa_mode._bias(row, q, k, False).shape == (2, 1, 1, 7)
    assert _sdpa_mode._bias(row, q, k, True).shape == (2, 1, 5, 7)  # one row is expanded for a backward
    full = torch.randn(4, 5, 7)
    b = _sdpa_mode._bias(full, q, k, False)
    assert b.shape == (1, 4, 5, 7) and b.is_contiguous()
    assert _sdpa_mode._bias(None, q, k, True) is None


def test_enable_and_disable_register_undo_and_repeat_safely():
    assert not fastattn.torch.sdpa_enabled()
    before = list(torch._C._get_sdp_priority_order())
    fastattn.torch.enable_sdpa()
    try:
        fastattn.torch.enable_sdpa()  # a second call changes nothing
        assert fastattn.torch.sdpa_enabled()
        # PyTorch's own choice for the calls fastattn does not take: its order as it was
        assert list(torch._C._get_sdp_priority_order()) == before
        q = torch.randn(1, 2, 4, 8)
        torch.testing.assert_close(torch.nn.functional.scaled_dot_product_attention(q, q, q),
                                   torch.ops.aten._scaled_dot_product_attention_math(q, q, q)[0])  # CPU: PyTorch's
    finally:
        fastattn.torch.disable_sdpa()
    fastattn.torch.disable_sdpa()
    assert not fastattn.torch.sdpa_enabled() and list(torch._C._get_sdp_priority_order()) == before


def _cuda_kernels(name, key="CUDA"):
    return [line for line in torch._C._dispatch_dump(f"aten::{name}").splitlines() if line.startswith(key + ":")]


# Each operator the mode takes over, with the keys it registers for: the composite's for the
# autograd key too (its kernel there alone would be passed over in inference mode).
_KEYS = {_sdpa_mode._COMPOSITE: ("CUDA", "AutogradCUDA"), _sdpa_mode._FORWARD: ("CUDA",),
         _sdpa_mode._BACKWARD: ("CUDA",)}


def _registered():
    return {(name, key): _cuda_kernels(name, key) for name, keys in _KEYS.items() for key in keys}


def test_on_the_native_path_the_mode_registers_the_op_librarys_kernels_and_removes_them(lib):
    before = _registered()
    assert all("sdpa.cpp" not in str(k) for k in before.values())
    fastattn.torch.enable_sdpa()
    try:
        assert _sdpa_mode._state.library is lib
        for where, kernels in _registered().items():
            assert len(kernels) == 1 and "fastattn/torch/csrc/sdpa.cpp" in kernels[0], where
    finally:
        fastattn.torch.disable_sdpa()
    assert _registered() == before  # PyTorch's own again (none on a CPU torch)
    fastattn.torch.enable_sdpa()  # and again
    fastattn.torch.disable_sdpa()


def test_on_the_python_path_the_mode_registers_python_kernels(lib, monkeypatch):
    from helpers.torch import take_python_path

    take_python_path(monkeypatch)
    before = _registered()
    fastattn.torch.enable_sdpa()
    try:
        assert isinstance(_sdpa_mode._state.library, torch.library.Library)
        for where, kernels in _registered().items():
            assert len(kernels) == 1 and "sdpa.cpp" not in kernels[0] and "registered at" in kernels[0], where
    finally:
        fastattn.torch.disable_sdpa()
    assert _registered() == before


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_the_op_librarys_kernels_keep_the_route_python_decides(lib, model, layout):
    # What csrc/sdpa.cpp converts _route's answer into and keeps, read back: the options
    # (every field, through the generated FA_DENSE_FROM), the Meta kernel's strides and
    # logsumexp shape, the gradients' strides; one miss per signature.
    lib.clear()
    q, k, v = (t.detach() for t in _qkv(2, 8, 2, 16, 24, 64, layout))
    bias = torch.randn(1, 1, 16, 24, dtype=torch.bfloat16)
    # (the last: the deterministic backward's route, a signature of its own)
    for args in ((q, k, v, None, 0.0, True, None, True, False), (q, k, v, bias, 0.25, False, 0.125, False, False),
                 (q, k, v, bias.float(), 0.0, False, None, True, False), (q, k, v, None, 0.0, True, None, True, True)):
        want = _sdpa_mode._route(*args)
        got = lib.sdpa_route(*args)
        assert got == (True, tuple(want.options), list(want.out_stride), list(want.lse_shape),
                       [list(s) for s in want.grad_strides]), (got, want)
        assert want.options.deterministic == args[-1]
    assert lib.sdpa_route_count() == 4
    lib.sdpa_route(q, k, v, None, 0.0, True, None, True, False)
    assert lib.sdpa_route_count() == 4 and len(model.calls) == 4  # kept: no second miss
    # deterministic without training is the plain route (inference has no backward to choose)
    assert lib.sdpa_route(q, k, v, bias, 0.25, False, 0.125, False, True)[1] == tuple(
        _sdpa_mode._route(q, k, v, bias, 0.25, False, 0.125, False, False).options)
    assert lib.sdpa_route_count() == 4
    fp32 = q.float()
    assert lib.sdpa_route(fp32, fp32, fp32, None, 0.0, False, None, False, False) == (False,)
    assert isinstance(_sdpa_mode._route(fp32, fp32, fp32, None, 0.0, False, None, False), str)
    lib.clear()
    assert lib.sdpa_route_count() == 0


def test_the_op_librarys_routes_are_bounded_least_recently_used_first_and_their_calls_still_counted(lib, model,
                                                                                                    monkeypatch):
    # csrc/sdpa.cpp's route map past its cap (FASTATTN_MEMORY_MAX_ENTRIES; set_max_entries
    # here): it drops the least recently used, counts the drops, and the calls of a dropped
    # route stay counted (folded when the route goes).
    lib.clear()
    lib.zero_evictions()
    monkeypatch.setattr(_sdpa_mode, "_native_kernels", lib)  # (what enable_sdpa() sets on the native path)
    monkeypatch.setattr(_sdpa_mode, "_calls", {})
    asked = []

    def route(q, *rest):
        asked.append(q.shape[2])
        return _sdpa_mode._route(q, *rest)

    cap = lib.max_entries()
    lib.sdpa_kernels(True, route, "CPU", list(_sdpa_mode.EARLY), composite=_sdpa_mode._composite)
    lib.set_max_entries(4)
    try:
        def signature(s, dtype=torch.bfloat16):
            q = torch.randn(1, 2, s, 16, dtype=dtype)
            return (q, q, q, None, 0.0, False, None, False, False)

        for s in (1, 2, 3, 4):
            assert lib.sdpa_route(*signature(s))[0] is True
        lib.sdpa_route(*signature(1))  # a hit: now more recent than 2, 3 and 4
        lib.sdpa_route(*signature(5))  # past the cap: 2 dropped (the least recently used)
        assert lib.sdpa_route_count() == 4 and asked == [1, 2, 3, 4, 5]
        for s in (1, 3, 4, 5):
            lib.sdpa_route(*signature(s))
        assert asked == [1, 2, 3, 4, 5]  # all kept: no miss
        lib.sdpa_route(*signature(2))
        assert asked == [1, 2, 3, 4, 5, 2] and lib.evictions() == {"native_calls": 0, "sdpa_routes": 2}
        assert fastattn.stats()["evictions"]["sdpa_routes"] >= 2  # (the Python routes' count beside)

        # Calls through the kernels, refused (float32) and handed to PyTorch's operator (which
        # has no CPU kernel): each counted, whichever routes are dropped meanwhile.
        lib.zero_sdpa_calls()
        for _ in range(2):
            for s in range(1, 9):
                q = torch.randn(1, 2, s, 16)
                with pytest.raises(NotImplementedError):
                    torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, False)
        assert lib.sdpa_route_count() <= 4
        passed = sum(n for served, _, n in lib.sdpa_calls() if not served)
        assert passed == 16 and _sdpa_mode.sdpa_calls()["passed_on"] == {
            "dtype torch.float32: fastattn takes float16 and bfloat16": 16}
    finally:
        lib.set_max_entries(cap)
        lib.sdpa_kernels(False)
        lib.clear()
        lib.zero_evictions()


def test_the_op_librarys_kernels_hand_a_refused_call_to_pytorchs_own_operators(lib):
    # The C++ kernels registered for the CPU here (the mode registers them for CUDA): a call
    # fastattn refuses (float32) reaches aten::_cudnn_attention_forward / _backward with its
    # stack, which has no CPU kernel: their error, not _scaled_dot_product_cudnn_attention's,
    # says the hand-over arrived (a null operator handle crashed here before review).
    assert not fastattn.torch.sdpa_enabled()
    lib.clear()
    lib.sdpa_kernels(True, _sdpa_mode._route, "CPU", list(_sdpa_mode.EARLY), composite=_sdpa_mode._composite)
    try:
        q = torch.randn(1, 2, 8, 16)
        with pytest.raises(NotImplementedError, match=r"aten::_cudnn_attention_forward' with arguments from the 'CPU'"):
            torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, False)
        lse, seed = torch.empty(1, 2, 8), torch.empty((), dtype=torch.long)
        with pytest.raises(NotImplementedError, match=r"aten::_cudnn_attention_backward' with arguments from the 'CPU'"):
            torch.ops.aten._scaled_dot_product_cudnn_attention_backward(q, q, q, q, q, lse, seed, seed, torch.empty(0),
                                                                        torch.empty(0), torch.empty(0), 8, 8, 0.0,
                                                                        False)
        assert lib.sdpa_route_count() == 2  # both refusals kept (an inference forward's key, the backward's)
        # One forward call, passed on with _route's reason (a backward is not a call of its own).
        counted = [(served, reason, n) for served, reason, n in lib.sdpa_calls() if n]
        assert len(counted) == 1 and counted[0][0] is False and "float32" in counted[0][1] and counted[0][2] == 1
        lib.zero_sdpa_calls()
        assert not any(n for _, _, n in lib.sdpa_calls())
        with pytest.raises(ValueError, match="'CUDA' or 'CPU'"):
            lib.sdpa_kernels(True, _sdpa_mode._route, "Meta")
    finally:
        lib.sdpa_kernels(False)
        lib.clear()
    with pytest.raises(NotImplementedError, match=r"aten::_scaled_dot_product_cudnn_attention' with arguments"):
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, False)  # PyTorch's (none on the CPU) again


def test_a_torch_whose_operator_takes_other_arguments_is_refused(monkeypatch):
    monkeypatch.setattr(_sdpa_mode, "FORWARD_ARGS", ("query", "key"))
    with pytest.raises(NotSupportedError, match="_scaled_dot_product_cudnn_attention takes"):
        fastattn.torch.enable_sdpa()
    assert not fastattn.torch.sdpa_enabled()


def test_native_mode_without_an_op_library_enables_the_python_kernels_and_says_why(tmp_path):
    # FASTATTN_SDPA=1 with FASTATTN_TORCH_PATH=native and no compiler: the import must not
    # fail (attention() raises at its call, as ever); the mode warns and runs its Python kernels.
    env = {**os.environ, "FASTATTN_SDPA": "1", "FASTATTN_TORCH_PATH": "native", "CXX": str(tmp_path / "no-cxx"),
           "FASTATTN_TORCH_OPS_DIR": str(tmp_path / "ops"), "PYTHONPATH": os.pathsep.join(sys.path)}
    code = ("import warnings, torch; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    import fastattn.torch as t\n"
            "from fastattn.torch import _sdpa_mode\n"
            "print(t.sdpa_enabled(), isinstance(_sdpa_mode._state.library, torch.library.Library))\n"
            "print([str(x.message) for x in w if 'SDPA mode runs its Python kernels' in str(x.message)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "True True" and "native op library is unavailable" in lines[1], out.stdout


@pytest.mark.parametrize("value,enabled", [("1", True), ("", False), ("0", False)])
def test_fastattn_sdpa_enables_the_mode_at_import_only_when_set(value, enabled):
    env = {**os.environ, "FASTATTN_SDPA": value, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", "import fastattn.torch as t; print(t.sdpa_enabled())"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(enabled)


# -- benchmarks/bench_sdpa_mode.py and the host-time loop it shares with bench_torch.py ----------

def test_the_benchmark_parses_its_arguments_and_refuses_to_run_without_cuda():
    from helpers import benchmarks

    r = benchmarks.run("bench_sdpa_mode", "--help")
    assert r.returncode == 0, r.stderr
    assert all(flag in r.stdout for flag in ("--json", "--quick", "--rounds", "--repeats")) and "summary:" in r.stdout
    r = benchmarks.run("bench_sdpa_mode", "--quick", cuda=False)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    bench = benchmarks.load("bench_sdpa_mode")
    quick = bench.parse_args(["--quick", "--json", "x.json"])
    assert (quick.iters, quick.repeats, quick.rounds, quick.forward_only, quick.json) == (100, 5, 2, True, "x.json")
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])


def test_the_benchmarks_ratios_and_summary():
    from helpers import benchmarks

    bench = benchmarks.load("bench_sdpa_mode")
    rounds = {"mode_on": {"held": [10.0, 12.0, 30.0], "wall": [11.0] * 3, "train": [40.0] * 3},
              "torch_cudnn": {"held": [20.0, 20.0, 40.0], "wall": [22.0] * 3, "train": [50.0] * 3},
              "torch_flash": {"held": [15.0] * 3, "wall": [16.0] * 3, "train": [45.0] * 3}}
    r = bench.host_ratios(rounds)
    assert r["ratio_held_mode_on_to_torch_cudnn"] == 12.0 / 20.0
    assert r["ratio_held_mode_on_to_torch_cudnn_paired"] == 0.6  # median of 0.5, 0.6, 0.75
    assert r["ratio_train_torch_flash_to_torch_cudnn"] == 0.9
    runs = {"mode_warm": [{"seconds": 0.1}, {"error": "x"}, {"seconds": 0.3}],
            "torch_cudnn": [{"seconds": 1.0}, {"seconds": 1.2}, {"seconds": 1.5}],
            "torch_flash": [{"seconds": 0.2}] * 3}
    c = bench.coldstart_medians(runs)
    assert c["mode_warm"]["seconds"] == 0.2 and c["mode_warm"]["errors"] == 1
    assert c["ratio_mode_warm_to_torch_cudnn"] == 0.2 / 1.2
    assert c["ratio_mode_warm_to_torch_cudnn_paired"] == pytest.approx(0.15)  # rounds 1 and 3: 0.1, 0.2
    host = {"shape": "s", "mode_calls": {"served": 900, "passed_on": {}}, **r}
    for p in bench.PEERS:
        host.update({f"{p}_{k}": 1.0 for k in ("held_us", "us", "gpu_us", "train_us")}, **{f"{p}_held_valid_rounds": 3})
    c["mode_cold"] = {"error": "boom"}
    lines = bench.summary({"host_overhead": [host], "coldstart": {"fwd": c}})
    text = "\n".join(lines)
    assert "target <= 0.6" in text and "mode_cold error: boom" in text and "n/a" in text
    assert "the mode served 900 calls, passed on {}" in text


def test_the_benchmarks_masked_shapes_their_mask_and_a_refusing_peer():
    from helpers import benchmarks

    bench = benchmarks.load("bench_sdpa_mode")
    keep = bench.padded_mask(2, 64, "bool", device="cpu")
    assert keep.shape == (2, 1, 64, 64) and keep.dtype == torch.bool
    assert torch.equal(keep[0, 0], torch.ones(64, 64, dtype=torch.bool).tril())  # the first sequence: causal
    pad = bench.LEFT_PADDING
    assert not keep[1, 0, :, :pad].any() and not keep[1, 0, :pad].any(-1).any()  # padding queries keep no key
    assert torch.equal(keep[1, 0, pad:, pad:], torch.ones(64 - pad, 64 - pad, dtype=torch.bool).tril())
    additive = bench.padded_mask(2, 64, "float", device="cpu")
    assert additive.dtype == torch.bfloat16 and torch.equal(additive == 0, keep)
    assert torch.isinf(additive[~keep]).all() and (additive[~keep] < 0).all()
    assert {m for *_, m in bench.SHAPES.values()} == {None, "bool", "float"}
    # torch_cudnn left out (a refusal): no ratios, the error said; the target only for unmasked calls
    rounds = {p: {"held": [1.0], "wall": [1.0], "train": [1.0]} for p in ("mode_on", "torch_efficient")}
    assert bench.host_ratios(rounds) == {}
    host = {"shape": "padded", "mask": "bool", "mode_calls": {"served": 0, "passed_on": {"why": 3}},
            "peers": ["mode_on", "torch_efficient"],
            "errors": {"torch_cudnn": "No available kernel. Aborting execution."}}
    for p in ("mode_on", "torch_efficient"):
        host.update({f"{p}_{k}": 2.0 for k in ("held_us", "us", "gpu_us", "train_us")}, **{f"{p}_held_valid_rounds": 3})
    text = "\n".join(bench.summary({"host_overhead": [host]}))
    assert "torch_cudnn left out: No available kernel" in text and "torch_efficient 2.00" in text
    assert "the mode served 0 calls, passed on {'why': 3}" in text
    assert "/ torch_cudnn" not in text and "target" not in text


def test_host_rounds_interleaves_the_peers_and_times_each_loop(monkeypatch):
    from helpers import benchmarks

    common = benchmarks.load("_common")

    class Event:
        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def query(self):
            return False  # the sleep still runs: every held round valid

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    seen = []

    class Enter:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            seen.append(self.name)

        def __exit__(self, *exc):
            pass

    counts = {"a": 0, "b": 0}
    calls = {n: (lambda n=n: Enter(n), lambda n=n: counts.__setitem__(n, counts[n] + 1), lambda: None)
             for n in ("a", "b")}
    out = common.host_rounds(calls, iters=5, repeats=4)
    assert set(out) == {"a", "b"}
    for r in out.values():
        assert len(r["held"]) == len(r["wall"]) == len(r["train"]) == 4 and r["held_valid"] == 4
    assert counts == {"a": 20 + 4 * (5 + 5), "b": 20 + 4 * (5 + 5)}  # warm-up, then held and wall loops
    assert seen[:2] == ["a", "b"] and len(seen) == 2 + 8  # entered once per warm-up and per round
    counts.update(a=0, b=0)
    common.host_rounds(calls, iters=5, repeats=1, held_iters=2)  # a shorter held loop
    assert counts == {"a": 20 + 2 + 5, "b": 20 + 2 + 5}
    assert common.rotated("abc", 4) == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert common.paired_ratio([1.0, None, 3.0], [2.0, 1.0, 0.0]) == 0.5
    assert common.paired_ratio([None], [1.0]) is None


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_an_inference_call_returns_the_logsumexp_pytorchs_meta_kernel_gives(model, layout):
    q, k, v = (t.detach() for t in _qkv(2, 4, 2, 5, 7, 16, layout))
    for training in (False, True, False):  # the second inference call takes the kept route
        out, lse = OP(q, k, v, None, training, 0.0, False, False)[:2]
        meta = OP(*(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (q, k, v)),
                  None, training, 0.0, False, False)
        assert out.shape == meta[0].shape and out.stride() == meta[0].stride()
        assert lse.shape == meta[1].shape and lse.dtype == torch.float32 and lse.is_contiguous()


# -- the composite: aten::scaled_dot_product_attention whatever backend PyTorch would pick ----

SDPA = torch.nn.functional.scaled_dot_product_attention


@pytest.fixture
def composite(model, monkeypatch):
    """The Python composite kernel on the CPU and AutogradCPU keys (the mode registers it for
    CUDA), beside `model`'s cuDNN-operator kernels; counts from zero."""
    monkeypatch.setattr(_sdpa_mode, "_calls", {})
    monkeypatch.setattr(_sdpa_mode, "_native_kernels", None)
    lib = torch.library.Library("aten", "IMPL")
    lib.impl(_sdpa_mode._COMPOSITE, _sdpa_mode._composite, "CPU")
    lib.impl(_sdpa_mode._COMPOSITE, _sdpa_mode._composite, "AutogradCPU")
    yield model
    lib._destroy()


def _masks(b, h, sq, skv):
    """The masks models pass, by name: (mask, its float64 form for the reference)."""
    g = torch.Generator().manual_seed(7)
    keep = torch.rand(b, 1, sq, skv, generator=g) > 0.3
    keep[0, 0, 1] = False  # a row that keeps no key: zeros, as PyTorch's math kernel
    additive = torch.randn(h, sq, skv, generator=g).bfloat16()
    minus_inf = additive.clone()
    minus_inf[1, 2] = float("-inf")
    return {
        "none": None,
        "bool (b, 1, sq, skv) with a row keeping no key": keep,
        "additive 3-d (h, sq, skv)": additive,
        "additive with a row of -inf": minus_inf,
        "float32 2-d (sq, skv)": torch.randn(sq, skv, generator=g) * 3,
        "bool expanded along the keys": (torch.rand(b, 1, sq, 1, generator=g) > 0.2).expand(b, 1, sq, skv),
    }


def _mask64(mask, dtype=torch.bfloat16):
    """The reference's mask: a float mask as the kernel reads it (rounded to the queries'
    dtype: what the mode promises for a float32 one), in float64."""
    return mask if mask is None or mask.dtype == torch.bool else mask.to(dtype).double()


def _assert_sdpas_in_float64(out, q, k, v, mask, grad_tol=3e-2, **kwargs):
    """A served call's output, and the gradients it gives q, k and v (and a mask that
    requires grad: summed back to its own shape) through a random output gradient, against
    PyTorch's SDPA in float64 with the mask as the mode reads it (_mask64). A mask's rows
    that keep no key (-inf throughout) get no gradient: zeros."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    trainable = mask is not None and mask.requires_grad
    m64 = _mask64(mask if not trainable else mask.detach(), q.dtype)
    if trainable:
        m64.requires_grad_()
    ref = SDPA(q64, k64, v64, attn_mask=m64, **kwargs)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(ref)
    (out.double() * g).sum().backward()
    (ref * g).sum().backward()
    for ours, theirs in zip((q, k, v), (q64, k64, v64)):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=grad_tol, rtol=grad_tol)
    if trainable:
        assert mask.grad is not None and mask.grad.shape == mask.shape and mask.grad.dtype == mask.dtype
        empty = (m64.detach() == float("-inf")).all(-1, keepdim=True).expand(mask.shape)
        theirs = m64.grad.masked_fill(empty, 0.0)  # (PyTorch's math: 0 or NaN there, by version)
        torch.testing.assert_close(mask.grad.double(), theirs, atol=grad_tol, rtol=grad_tol)


@pytest.mark.parametrize("mask_name", list(_masks(2, 4, 5, 7)))
@pytest.mark.parametrize("gqa", [False, True])
def test_every_sdpa_call_fastattn_takes_is_served_with_gradients(composite, mask_name, gqa):
    q, k, v = _qkv(2, 4, 2 if gqa else 4, 5, 7, 16, "bshd")
    mask = _masks(2, 4, 5, 7)[mask_name]
    out = SDPA(q, k, v, attn_mask=mask, enable_gqa=gqa)
    assert _sdpa_mode.sdpa_calls() == {"served": 1, "head_dim_padded": 0, "mask_grad": 0, "passed_on": {}}
    assert [c[0] for c in composite.calls] == ["plan", "forward"]
    _assert_sdpas_in_float64(out, q, k, v, mask, enable_gqa=gqa)
    # the reference itself (float64) is PyTorch's, counted as passed on with the dtype's reason
    assert [r for r in _sdpa_mode.sdpa_calls()["passed_on"]] == ["dtype torch.float64: fastattn takes float16 "
                                                                  "and bfloat16"]
    assert [c[0] for c in composite.calls] == ["plan", "forward", "backward"]
    if mask is not None:  # the rows that keep no key (False, or -inf, throughout): zeros, and no gradient
        empty = ~(mask if mask.dtype == torch.bool else mask != float("-inf")).expand(2, 4, 5, 7).any(-1)
        assert empty.any() or not ("keeping no key" in mask_name or "-inf" in mask_name)  # (those have such rows)
        assert (out[empty] == 0).all() and (q.grad[empty] == 0).all()  # (b, h, s, d) views


def test_in_inference_mode_the_device_keys_kernel_serves(composite):
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, 3, 6, 16))
    with torch.inference_mode():
        out = SDPA(q, k, v, is_causal=True, enable_gqa=True)
    assert _sdpa_mode.sdpa_calls()["served"] == 1 and composite.calls[-1] == ("forward", "bshd", True)
    options = composite.calls[0][1]
    assert options.causal and not options.training  # no logsumexp asked where nothing needs a gradient
    ref = SDPA(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_calls_fastattn_does_not_take_run_pytorchs_composite_with_its_answers_and_errors(composite):
    early = _sdpa_mode.EARLY
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, 3, 6, 16, "bhsd"))
    # float32: the route's reason; PyTorch's answer
    f = [t.float() for t in (q, k, v)]
    torch.testing.assert_close(SDPA(*f, enable_gqa=True),
                               torch.ops.aten._scaled_dot_product_attention_math(*f, enable_gqa=True)[0])
    # 3 dims: not a shape a route is kept for (bf16: PyTorch may run its flash CPU kernel, which
    # rounds otherwise than math, as 2.14 does)
    q3 = q.flatten(0, 1)
    torch.testing.assert_close(SDPA(q3, q3, q3), torch.ops.aten._scaled_dot_product_attention_math(q3, q3, q3)[0],
                               atol=1e-2, rtol=2e-2)
    # PyTorch's own errors, unchanged: fewer key heads without enable_gqa; an integer mask
    with pytest.raises(RuntimeError):
        SDPA(q, k, v)
    with pytest.raises(RuntimeError):
        SDPA(q, k, v, attn_mask=torch.zeros(3, 6, dtype=torch.int32), enable_gqa=True)
    with pytest.raises(RuntimeError):
        SDPA(q, k, v, attn_mask=torch.zeros(3, 5, dtype=torch.bool), enable_gqa=True)  # does not broadcast
    calls = _sdpa_mode.sdpa_calls()
    assert calls["served"] == 0 and composite.calls == []
    assert calls["passed_on"] == {"dtype torch.float32: fastattn takes float16 and bfloat16": 1, early[0]: 1,
                                  early[1]: 2, early[2]: 1}


def test_compiled_with_fullgraph_sdpa_is_served(composite):
    q, k, v = _qkv(2, 4, 2, 6, 6, 16, "bshd")
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()

    def f(q, k, v, keep):
        return SDPA(q, k, v, attn_mask=keep, enable_gqa=True)

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, keep)
    out.float().sum().backward()
    assert "forward" in [c[0] for c in composite.calls] and "backward" in [c[0] for c in composite.calls]
    ref, leaves = _sdpa_reference(q, k, v, causal=True)
    ref.sum().backward()
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q.grad.double(), leaves[0].grad, atol=3e-2, rtol=3e-2)


def test_compiled_with_fullgraph_a_mask_that_requires_grad_gets_its_gradient(composite, monkeypatch):
    # torch.compile traces the composite on fake tensors: the dense custom op's fake kernel and
    # its autograd are in the graph, and the mask's gradient comes back summed to its shape.
    # (The fake kernel's checks refuse CPU tensors, as a miss does: here they pass.)
    monkeypatch.setattr(_dense, "check_traced", lambda *args: None)
    q, k, v = _qkv(2, 4, 2, 6, 6, 16, "bshd")
    mask = torch.randn(4, 6, 6).bfloat16().requires_grad_()

    def f(q, k, v, mask):
        return SDPA(q, k, v, attn_mask=mask, enable_gqa=True)

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, mask)
    assert any(c[0] == "plan" and c[1].bias_grad for c in composite.calls)
    _assert_sdpas_in_float64(out, q, k, v, mask, enable_gqa=True)
    assert composite.calls[-1][0] == "backward"


def test_the_op_librarys_composite_serves_and_hands_on_the_same_calls(lib, model, monkeypatch):
    # The C++ composite (csrc/sdpa.cpp) on the CPU keys; the cuDNN operator's CPU kernels then
    # replaced by the Python ones over `model` (the C++ ones run cuDNN, which the CPU has not).
    import warnings

    lib.clear()
    monkeypatch.setattr(_sdpa_mode, "_calls", {})
    with pytest.raises(RuntimeError, match=f"{len(_sdpa_mode.EARLY)} early reasons, got 1"):
        lib.sdpa_kernels(True, _sdpa_mode._route, "CPU", ["one"], composite=_sdpa_mode._composite)
    lib.sdpa_kernels(True, _sdpa_mode._route, "CPU", list(_sdpa_mode.EARLY), composite=_sdpa_mode._composite)
    python = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        python.impl(_sdpa_mode._FORWARD, _sdpa_mode._forward, "CPU")
        python.impl(_sdpa_mode._BACKWARD, _sdpa_mode._backward, "CPU")
    try:
        for name, mask in _masks(2, 4, 5, 7).items():
            for gqa in (False, True):
                q, k, v = _qkv(2, 4, 2 if gqa else 4, 5, 7, 16, "bshd")
                out = SDPA(q, k, v, attn_mask=mask, enable_gqa=gqa)
                ref = SDPA(*(t.detach().double() for t in (q, k, v)), attn_mask=_mask64(mask), enable_gqa=gqa)
                torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2, msg=name)
                out.float().sum().backward()
                assert q.grad is not None and torch.isfinite(q.grad.float()).all(), name
        q, k, v = (t.detach() for t in _qkv(1, 4, 2, 3, 6, 16, "bhsd"))
        with pytest.raises(RuntimeError):
            SDPA(q, k, v)  # fewer key heads without enable_gqa: PyTorch's error
        q3 = q.flatten(0, 1)  # (bf16: PyTorch's own CPU kernel, which may round otherwise than math)
        torch.testing.assert_close(SDPA(q3, q3, q3), torch.ops.aten._scaled_dot_product_attention_math(q3, q3, q3)[0],
                                   atol=1e-2, rtol=2e-2)
        counted: dict = {}
        for served, reason, n in lib.sdpa_calls():
            if n:
                counted[None if served else reason] = counted.get(None if served else reason, 0) + n
        f64 = "dtype torch.float64: fastattn takes float16 and bfloat16"
        served = 2 * len(_masks(2, 4, 5, 7))
        assert counted == {None: served, f64: served, _sdpa_mode.EARLY[0]: 1, _sdpa_mode.EARLY[2]: 1}, counted
        # The Python kernels below counted their calls too (the C++ composite does not tell them it did).
        assert _sdpa_mode._calls == {None: served}
    finally:
        python._destroy()
        lib.sdpa_kernels(False)
        lib.clear()


# -- the composite on any call a user can make (Hypothesis) ----------------------------------

@st.composite
def _calls(draw):
    """An SDPA call: shapes (no queries or no keys among them), layout, dtype, GQA, causal,
    and a mask of any rank, dtype, broadcast and memory order SDPA takes (and some it
    refuses). Float masks keep a finite entry in every row but, at times, the first (a row
    of -inf alone: zeros, as PyTorch's math kernel gives)."""
    b, hk, rep = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    sq, skv, d = (draw(st.sampled_from([0, 1, 2, 3, 4, 5, 5])), draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6])),
                  draw(st.sampled_from([8, 16, 12])))  # (12: padded to 16)
    call = dict(b=b, hq=hk * rep, hk=hk, sq=sq, skv=skv, d=d, layout=draw(st.sampled_from(["bhsd", "bshd"])),
                dtype=draw(st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float16, torch.float32])),
                gqa=rep > 1 or draw(st.booleans()), causal=False, mask=None,
                scale=draw(st.sampled_from([None, None, None, None, 0.3, 2.0, 0.0, -1.0])), rank3=draw(st.integers(0, 9)) == 0)
    kind = draw(st.sampled_from(["none", "causal", "bool", "bool", "same", "same", "float32", "other float", "int"]))
    if kind == "causal":
        call["causal"] = True
    elif kind != "none":
        full = (b, hk * rep, sq, skv)
        rank = draw(st.integers(0, 4))
        shape = [draw(st.sampled_from([1, n])) for n in full[4 - rank:]]
        if rank and draw(st.integers(0, 4)) == 0:
            shape[-1] = draw(st.sampled_from([1, 2, skv + 1]))  # (often one SDPA refuses)
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        if kind == "bool":
            m = torch.rand(shape, generator=g) < draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
        else:
            m = torch.randn(shape, generator=g) * 2
            if rank and shape[-1]:  # (-inf, with a finite entry each row)
                m = m.masked_fill(torch.rand(shape, generator=g) < 0.3, float("-inf"))
                m[..., 0] = torch.randn(shape[:-1], generator=g)
                if rank >= 2 and shape[-2] and draw(st.integers(0, 3)) == 0:
                    m[..., 0, :] = float("-inf")
            m = m.to({"same": call["dtype"], "float32": torch.float32, "int": torch.int32,
                      "other float": torch.float16 if call["dtype"] == torch.bfloat16 else torch.bfloat16}[kind]
                     if kind != "int" else torch.int32)
        how = draw(st.sampled_from(["as is", "expanded", "transposed"]))
        if how == "expanded" and all(s in (1, n) for s, n in zip(shape, full[4 - rank:])):
            m = m.expand(full[4 - rank:])  # stride 0 where it broadcast
        elif how == "transposed" and rank >= 2:
            m = m.transpose(-1, -2).contiguous().transpose(-1, -2)  # keys not the innermost dim
        if m.is_floating_point() and draw(st.integers(0, 5)) == 0:
            m = m.requires_grad_()  # a mask's own gradient: fastattn's dense op with bias_grad
        call["mask"] = m
    return call


def _theirs(q, k, v, c):
    """PyTorch's own answer to the call (its composite, the mode bypassed), or its error."""
    try:
        return torch.ops.aten.scaled_dot_product_attention.default.decompose(
            q, k, v, c["mask"], 0.0, c["causal"], scale=c["scale"], enable_gqa=c["gqa"])
    except (RuntimeError, IndexError) as e:  # (a mask of fewer than 2 dims: an IndexError)
        return e


def _counts():
    """(served, handed on) calls so far, as fastattn.stats()["sdpa"] counts them."""
    calls = _sdpa_mode.sdpa_calls()
    return calls["served"], sum(calls["passed_on"].values())


_counts.handed_on = lambda: _sdpa_mode.sdpa_calls()["passed_on"]
_counts.padded = lambda: _sdpa_mode.sdpa_calls()["head_dim_padded"]
_counts.mask_grad = lambda: _sdpa_mode.sdpa_calls()["mask_grad"]


@pytest.fixture(params=["python", "native"])
def either_composite(request, model, monkeypatch):
    """The composite kernel on the CPU keys, _sdpa_mode's or the op library's (C++), over
    `model`'s cuDNN-operator kernels; gives a function of the (served, handed on) calls
    the composite counted so far, whose .handed_on() gives the handed-on ones by reason."""
    import warnings

    monkeypatch.setattr(_sdpa_mode, "_calls", {})
    if request.param == "python":
        monkeypatch.setattr(_sdpa_mode, "_native_kernels", None)
        python = torch.library.Library("aten", "IMPL")
        python.impl(_sdpa_mode._COMPOSITE, _sdpa_mode._composite, "CPU")
        python.impl(_sdpa_mode._COMPOSITE, _sdpa_mode._composite, "AutogradCPU")

        yield _counts

        python._destroy()
        return
    native = request.getfixturevalue("lib")
    native.clear()
    native.sdpa_kernels(True, _sdpa_mode._route, "CPU", list(_sdpa_mode.EARLY), composite=_sdpa_mode._composite)
    python = torch.library.Library("aten", "IMPL")  # the cuDNN operator's: model's again (C++ ones run cuDNN)

    def forward(*args, **kwargs):  # (below the C++ composite, which counted the call: as its t_counted)
        _sdpa_mode._local.counted = True
        try:
            return _sdpa_mode._forward(*args, **kwargs)
        finally:
            _sdpa_mode._local.counted = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        python.impl(_sdpa_mode._FORWARD, forward, "CPU")
        python.impl(_sdpa_mode._BACKWARD, _sdpa_mode._backward, "CPU")

    # (the op library's counts, and _sdpa_mode's of the calls it hands to the Python composite:
    # a mask that requires grad)
    monkeypatch.setattr(_sdpa_mode, "_native_kernels", native)
    try:
        yield _counts
    finally:
        python._destroy()
        native.sdpa_kernels(False)
        native.clear()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=_calls())
def test_the_composite_serves_or_hands_on_any_call_as_pytorch_would_answer_it(either_composite, c):
    # Every call is counted once; PyTorch's errors are PyTorch's; a call handed on is
    # PyTorch's own answer, bit for bit; a served one is PyTorch's answer in float64 within
    # bfloat16's rounding (a float mask rounded to the queries' dtype), forward and backward,
    # with a boolean mask's rows that keep no key zeros.
    counts = either_composite
    q, k, v = _qkv(c["b"], c["hq"], c["hk"], c["sq"], c["skv"], c["d"], c["layout"], c["dtype"])
    if c["rank3"]:  # (batch x heads, seq, dim): not a call fastattn keeps a route for
        q, k, v = (t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v))
    want = _theirs(q.detach(), k.detach(), v.detach(), c)
    served, handed_on = counts()
    try:
        out = SDPA(q, k, v, attn_mask=c["mask"], is_causal=c["causal"], scale=c["scale"], enable_gqa=c["gqa"])
    except (RuntimeError, IndexError) as e:
        assert type(e) is type(want), f"PyTorch answers this call or raises {want!r}; the mode raised {e!r}"
        event("PyTorch's error")
        return
    assert not isinstance(want, Exception), f"PyTorch raises {want!r}; the mode answered"
    now = counts()
    assert sum(now) == served + handed_on + 1
    if now[0] == served:
        event("handed on")
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)  # (scale 0 with a mask: NaN)
        return
    event("served, " + ("no mask" if c["mask"] is None else f"{c['mask'].dtype} mask"))
    m = c["mask"]
    _assert_sdpas_in_float64(out, q, k, v, m, grad_tol=4e-2, is_causal=c["causal"], scale=c["scale"],
                             enable_gqa=c["gqa"])
    assert not c["rank3"] and c["sq"] > 0 and (c["scale"] is None or c["scale"] > 0)  # (those are handed on)
    if m is not None:  # rows that keep no key (False, or -inf, throughout): zeros, and no gradient
        keep = m if m.dtype == torch.bool else m != float("-inf")
        empty = ~keep.expand(c["b"], c["hq"], c["sq"], c["skv"]).any(-1)
        if empty.any():
            event("served, a row that keeps no key")
        assert (out[empty] == 0).all() and (q.grad[empty] == 0).all()


@pytest.mark.parametrize("d_qk,d_v", [(12, 12), (12, 20), (16, 12), (59, 59), (16, 16)])
def test_head_dims_not_multiples_of_8_are_served_padded(either_composite, d_qk, d_v):
    # cuDNN takes head dims of multiples of 8 (the model refuses others, as cuDNN): the mode
    # pads them with zeros as PyTorch's flash backend does, the scale at the real head dim's
    # (SDPA's default, 1/sqrt(d_qk)), the output cut back to v's; autograd pads the gradients.
    counts = either_composite
    g = torch.Generator().manual_seed(d_qk * 100 + d_v)
    q = torch.randn(2, 4, 5, d_qk, generator=g).bfloat16().requires_grad_()
    k = torch.randn(2, 2, 7, d_qk, generator=g).bfloat16().requires_grad_()
    v = torch.randn(2, 2, 7, d_v, generator=g).bfloat16().requires_grad_()
    out = SDPA(q, k, v, is_causal=True, enable_gqa=True)
    assert counts() == (1, 0), counts.handed_on()
    assert counts.padded() == (d_qk % 8 != 0 or d_v % 8 != 0)
    assert out.shape == (2, 4, 5, d_v)
    _assert_sdpas_in_float64(out, q, k, v, None, is_causal=True, enable_gqa=True)
    assert q.grad.shape == q.shape and v.grad.shape == v.shape
    with torch.no_grad():  # an explicit scale is kept as given
        scaled = SDPA(q, k, v, scale=0.3, enable_gqa=True)
    ref = SDPA(q.double(), k.double(), v.double(), scale=0.3, enable_gqa=True)
    torch.testing.assert_close(scaled.double(), ref, atol=2e-2, rtol=2e-2)
    assert counts()[0] == 2


@pytest.mark.parametrize("shape,dtype,minus_inf_row", [
    ((5, 7), torch.float32, False),  # a learned (seq_q, seq_kv) bias, float32 beside bfloat16 queries
    ((4, 5, 7), torch.bfloat16, True),  # per head, with a row of -inf (no key kept: zeros, no gradient)
    ((2, 1, 1, 7), torch.bfloat16, False),  # one row per sequence, broadcast over heads and queries
    ((2, 4, 5, 7), torch.float32, False),
])
@pytest.mark.parametrize("full_only", [False, True])
def test_a_mask_that_requires_grad_is_served_and_its_gradient_reaches_it(either_composite, model, shape, dtype,
                                                                         minus_inf_row, full_only):
    # PyTorch's cuDNN operator gives no gradient for its attn_bias: the mode runs such a call
    # on fastattn's dense op with bias_grad, and autograd sums d_bias back to the mask's own
    # shape and dtype. Where cuDNN builds the bias gradient for (batch, heads) biases only
    # (full_only), the mask is expanded to that first.
    counts = either_composite
    model.bias_grad_full_only = full_only
    q, k, v = _qkv(2, 4, 2, 5, 7, 16, "bshd")
    g = torch.Generator().manual_seed(11)
    mask = torch.randn(shape, generator=g).to(dtype)
    if minus_inf_row:
        mask[1, 2] = float("-inf")
    mask.requires_grad_()
    out = SDPA(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=True)
    assert counts() == (1, 0) and counts.mask_grad() == 1, counts.handed_on()
    plans = [c[1] for c in model.calls if c[0] == "plan"]
    assert plans and all(o.bias_grad and o.training for o in plans)
    _assert_sdpas_in_float64(out, q, k, v, mask, enable_gqa=True)
    assert [c[0] for c in model.calls][-1] == "backward"
    if minus_inf_row:
        assert (out[:, 1, 2] == 0).all() and (mask.grad[1, 2] == 0).all()
    # Without grad mode, or for a mask that does not require grad, the cuDNN operator's way.
    with torch.no_grad():
        SDPA(q, k, v, attn_mask=mask, enable_gqa=True)
    assert counts()[0] == 2 and counts.mask_grad() == 1  # (the float64 reference above: handed on)
    assert not [c for c in model.calls if c[0] == "plan"][-1][1].bias_grad


def test_a_mask_that_requires_grad_is_handed_on_where_fastattn_cannot_serve_it(either_composite, model):
    # A mask of another float dtype than the queries' and float32 (as the cuDNN operator's
    # route refuses it): PyTorch's composite, and its error. Under required determinism where
    # cuDNN builds no deterministic backward: PyTorch's composite, whose gradient reaches the mask.
    counts = either_composite
    q, k, v = _qkv(1, 4, 2, 3, 6, 16, "bhsd")
    m = torch.zeros(3, 6, dtype=torch.float16, requires_grad=True)
    with pytest.raises(RuntimeError, match="attn_mask dtype"):
        SDPA(q, k, v, attn_mask=m, enable_gqa=True)
    assert counts() == (0, 1) and list(counts.handed_on()) == ["attn_bias is torch.float16, query torch.bfloat16"]
    from helpers.torch import deterministic

    model.no_deterministic = True
    m = torch.zeros(3, 6, dtype=torch.bfloat16, requires_grad=True)
    with deterministic(False):
        SDPA(q, k, v, attn_mask=m, enable_gqa=True).float().sum().backward()
    assert m.grad is not None and counts() == (0, 2)
    assert counts.handed_on()[_sdpa_mode.NO_DETERMINISTIC] == 1


def test_where_fastattn_cannot_run_the_mode_stands_aside_and_says_so_once(composite, monkeypatch, caplog):
    # cuDNN not loadable (or a CUDA failure) is no refusal of one call: every call is then
    # PyTorch's, counted with the reason, and the reason is logged once, not per call.
    from fastattn import LibraryError

    def unloadable(*args):
        raise LibraryError("libcudnn.so.9 could not be loaded")

    monkeypatch.setattr(_dense, "plan_for", unloadable)
    monkeypatch.setattr(runtime, "_warned", bounded.Table("warnings"))
    reason = "LibraryError: libcudnn.so.9 could not be loaded"
    with caplog.at_level("WARNING", logger="fastattn"):
        for s in (3, 5, 3):
            q, k, v = (t.detach() for t in _qkv(1, 4, 4, s, s, 16))
            out = SDPA(q, k, v, is_causal=True)
            assert torch.equal(out, torch.ops.aten.scaled_dot_product_attention.default.decompose(
                q, k, v, None, 0.0, True))  # PyTorch's own answer
    assert _sdpa_mode.sdpa_calls() == {"served": 0, "head_dim_padded": 0, "mask_grad": 0, "passed_on": {reason: 3}}
    assert [r.getMessage() for r in caplog.records] == [
        f"the SDPA mode hands calls to PyTorch's kernels (counted in fastattn.stats()['sdpa']): {reason}"]


def test_a_boolean_masks_zero_and_minus_inf_are_kept_for_real_tensors_only(either_composite):
    # The bias of a boolean mask comes from 0 and -inf kept on the device (no copy from the
    # host each call); torch.compile traces with fake tensors, which must not meet the kept
    # real ones, nor be kept themselves: an eager call, then a compiled one, then eager.
    q, k, v = _qkv(2, 4, 2, 6, 6, 16, "bshd")
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    keep[1, 0, 2] = False  # a row that keeps no key

    def f(q, k, v, keep):
        return SDPA(q, k, v, attn_mask=keep, enable_gqa=True)

    torch._dynamo.reset()
    with torch.no_grad():
        eager = f(q, k, v, keep)
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, keep)
        again = f(q, k, v, keep)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    torch.testing.assert_close(again, eager, atol=0, rtol=0)
    assert (eager[1, :, 2] == 0).all() and (eager[1, :, 3] != 0).any()  # (b, h, s, d): the row keeping no key
    assert either_composite()[0] >= 2  # the eager calls served (the compiled one may run below the composite)


@pytest.mark.parametrize("kind", ["float", "bool", "none"])
def test_a_call_over_no_keys_gets_pytorchs_answer(either_composite, kind):
    # Zero keys: every row keeps none. The mask's conversion must not refuse the empty dim
    # (amax does), and the answer is PyTorch's own.
    q = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 0, 8, dtype=torch.bfloat16)
    mask = {"float": torch.zeros(3, 0, dtype=torch.bfloat16), "bool": torch.ones(3, 0, dtype=torch.bool),
            "none": None}[kind]
    got = SDPA(q, k, k, attn_mask=mask)
    want = torch.ops.aten._scaled_dot_product_attention_math(q, k, k, attn_mask=mask)[0]
    assert got.shape == (1, 2, 3, 8)
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
    assert sum(either_composite()) == 1  # served or passed on: counted once


# -- the backends the user enables ---------------------------------------------------------

_B = torch.nn.attention.SDPBackend
_FOUR = (_B.FLASH_ATTENTION, _B.EFFICIENT_ATTENTION, _B.MATH, _B.CUDNN_ATTENTION)
_OFF = _sdpa_mode.EARLY[3]  # PyTorch's cuDNN backend disabled


def _the_call_under(counts, enter):
    """An SDPA call (bfloat16, causal, a gradient) inside the context `enter()` gives,
    beside PyTorch's own answer to it there (the mode bypassed): (served, reasons handed on
    by this call, the output or PyTorch's error, PyTorch's answer or error, q, k, v)."""
    q, k, v = _qkv(1, 4, 4, 5, 7, 16, "bhsd")
    served, _ = counts()
    before = counts.handed_on()
    with enter():
        want = _theirs(q.detach(), k.detach(), v.detach(), dict(mask=None, causal=True, scale=None, gqa=False))
        try:
            out = SDPA(q, k, v, is_causal=True)
        except RuntimeError as e:
            out = e
    handed = {r: n - before.get(r, 0) for r, n in counts.handed_on().items() if n != before.get(r, 0)}
    return counts()[0] - served, handed, out, want, (q, k, v)


@pytest.mark.parametrize("backends", [c for n in range(1, 5) for c in itertools.combinations(_FOUR, n)],
                         ids=lambda c: "+".join(b.name for b in c))
def test_under_sdpa_kernel_the_mode_serves_only_where_pytorchs_cudnn_backend_is_enabled(either_composite, backends):
    # sdpa_kernel sets PyTorch's process-wide flags (torch._C._set_sdp_use_*) for its context;
    # the mode reads the cuDNN one per call. Without it the call is PyTorch's own, on the
    # backends enabled: its output bit for bit, or its error (on the CPU, PyTorch has no
    # kernel for efficient or cuDNN alone).
    served, handed, out, want, (q, k, v) = _the_call_under(
        either_composite, lambda: torch.nn.attention.sdpa_kernel(list(backends)))
    assert torch.backends.cuda.cudnn_sdp_enabled()  # (restored after the context)
    if _B.CUDNN_ATTENTION in backends:
        assert (served, handed) == (1, {}), handed
        _assert_sdpas_in_float64(out, q, k, v, None, is_causal=True)
        return
    assert (served, handed) == (0, {_OFF: 1}), handed
    if isinstance(want, Exception):
        assert type(out) is type(want) and str(out) == str(want)
    else:
        assert torch.equal(out, want)
        out.float().sum().backward()  # PyTorch's own autograd: gradients reach q, k, v
        assert all(t.grad is not None for t in (q, k, v))


@pytest.mark.parametrize("flag", ["flash", "mem_efficient", "math", "cudnn"])
def test_each_enable_sdp_flag_off_process_wide_leaves_the_mode_serving_but_the_cudnn_one(either_composite, flag):
    # torch.backends.cuda.enable_<flag>_sdp(False), as a library may call at import: with
    # cuDNN's off every call is PyTorch's (counted with the reason) until it is on again.
    set_flag = getattr(torch.backends.cuda, f"enable_{flag}_sdp")

    @contextlib.contextmanager
    def off():
        set_flag(False)
        try:
            yield
        finally:
            set_flag(True)

    served, handed, out, want, _ = _the_call_under(either_composite, off)
    if flag == "cudnn":
        assert (served, handed) == (0, {_OFF: 1}) and torch.equal(out, want)
    else:
        assert (served, handed) == (1, {})
    served, handed, *_ = _the_call_under(either_composite, contextlib.nullcontext)
    assert (served, handed) == (1, {})  # on again: served


def test_the_priority_order_is_not_read_where_cudnn_is_enabled(either_composite):
    # PyTorch's own priority order puts cuDNN after math on some GPUs and versions: the mode
    # serves wherever cuDNN is enabled, whatever order the backends are listed in.
    served, handed, *_ = _the_call_under(either_composite, lambda: torch.nn.attention.sdpa_kernel(
        [_B.MATH, _B.CUDNN_ATTENTION], set_priority=True))
    assert (served, handed) == (1, {})


@pytest.mark.parametrize("warn_only,cudnn_has_one", [(False, True), (False, False), (True, True)])
def test_while_deterministic_algorithms_are_required_a_call_with_a_backward_takes_a_deterministic_one(
        either_composite, model, warn_only, cudnn_has_one):
    # torch.use_deterministic_algorithms(True): a call with a backward takes cuDNN's
    # deterministic backward (a plan of its own), and where cuDNN builds none PyTorch's
    # choice runs it (which leaves its cuDNN backend out): its answer, bit for bit. With
    # warn_only the mode serves as PyTorch's cuDNN backend: its default backward, which
    # warns (test_determinism*.py). A call without a backward is served either way.
    from helpers.torch import deterministic

    model.no_deterministic = not cudnn_has_one
    served, handed, out, want, (q, k, v) = _the_call_under(either_composite, lambda: deterministic(warn_only))
    plans = [options for what, options in (c for c in model.calls if c[0] == "plan")]
    if not cudnn_has_one:
        assert (served, handed) == (0, {_sdpa_mode.NO_DETERMINISTIC: 1}) and torch.equal(out, want)
    else:
        assert (served, handed) == (1, {})
        assert plans[-1].training and plans[-1].deterministic == (not warn_only)
        with deterministic(warn_only):
            out.float().sum().backward()  # the backward's route: the same deterministic plan
        assert all(t.grad is not None for t in (q, k, v)) and model.calls[-1][0] == "backward"
    q, k, v = (t.detach() for t in _qkv(1, 4, 4, 5, 7, 16, "bhsd"))
    served = either_composite()[0]
    with deterministic(warn_only):
        SDPA(q, k, v, is_causal=True)
        with torch.no_grad():
            SDPA(*(t.requires_grad_() for t in (q, k, v)), is_causal=True)
    assert either_composite()[0] == served + 2
    assert not any(o.deterministic for o in (c[1] for c in model.calls[-2:] if c[0] == "plan"))  # inference


def test_a_compiled_call_traced_under_a_math_only_context_holds_pytorchs_math(either_composite):
    # torch.compile's trace runs the composite's kernel on fake tensors: the flag it reads
    # there decides what the graph holds, as for PyTorch's own composite.
    q, k, v = (t.detach() for t in _qkv(1, 4, 4, 5, 7, 16, "bhsd"))

    def f(q, k, v):
        return SDPA(q, k, v, is_causal=True)

    torch._dynamo.reset()
    with torch.nn.attention.sdpa_kernel(_B.MATH):
        want = torch.ops.aten.scaled_dot_product_attention.default.decompose(q, k, v, None, 0.0, True)
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    torch._dynamo.reset()
    assert torch.equal(got, want)
    assert either_composite()[0] == 0 and set(either_composite.handed_on()) == {_OFF}


class _Arg:
    def __init__(self, name, default=False):
        self.name, self._default = name, default

    def has_default_value(self):
        return self._default


def test_the_installed_torchs_sdpa_schemas_are_the_ones_the_mode_is_written_for():
    from fastattn.torch import _sdpa_mode

    _sdpa_mode._check_schemas()  # raises NotSupportedError naming the operator otherwise


@pytest.mark.parametrize("name, extra, refused", [
    ("_cudnn_attention_forward", [], False),
    # torch 2.14 appends seqused_k and block_table, each with a default: a pass-on leaves them at it
    ("_cudnn_attention_forward", [_Arg("seqused_k", True), _Arg("block_table", True)], False),
    ("_cudnn_attention_forward", [_Arg("new_required")], True),
    # an operator the mode implements itself must match exactly: its kernel reads its arguments
    ("_scaled_dot_product_cudnn_attention", [_Arg("seqused_k", True)], True),
])
def test_an_operator_schema_may_grow_only_where_the_mode_passes_calls_on(name, extra, refused):
    from fastattn.torch import _sdpa_mode

    expected = _sdpa_mode.FALLBACK_FORWARD_ARGS
    args = [_Arg(n, n == "scale") for n in expected] + extra
    assert _sdpa_mode.schema_problem(name, expected, args) is refused
    assert _sdpa_mode.schema_problem(name, expected, args[:len(expected) - 1]) is True  # one argument fewer
