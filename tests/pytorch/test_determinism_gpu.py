"""GPU: torch.use_deterministic_algorithms(True) and fastattn's cuDNN backward. A backward
without cuDNN's deterministic algorithm raises (a RuntimeError, before any work) or, with
warn_only=True, warns and runs, as PyTorch's own non-deterministic kernels do, on both
paths: fastattn.torch.attention, attention_varlen, fastattn.flash's functions and the SDPA
mode's backward; deterministic=True gives a backward that neither warns nor raises, and
repeats bit for bit. While determinism is required the SDPA mode gives a call with a
backward cuDNN's deterministic backward (bit for bit on every run), or hands it to
PyTorch where the loaded cuDNN builds none; with warn_only it serves it as PyTorch's cuDNN
backend does, its backward warning in PyTorch's cuDNN backward's words (PyTorch's
test_fused_backwards_throws_determinism_warning)."""

import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import torch.nn.functional as F  # noqa: E402

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402
from fastattn.flash import flash_attn_func  # noqa: E402
from fastattn.torch import _native, _sdpa_mode  # noqa: E402
from helpers.torch import deterministic, on_path, sdpa_mode_on  # noqa: E402

DEV = "cuda"
TOL = 3e-2  # bfloat16
WORDS = "cuDNN Attention defaults to a non-deterministic algorithm."  # PyTorch's cuDNN backward's
_B = torch.nn.attention.SDPBackend


@pytest.fixture(params=("native", "python"))
def path(request, monkeypatch):
    """fastattn.torch's entry points on the op library (it must load on the GPU machine) or
    on the Python path."""
    on_path(request.param, monkeypatch)
    return request.param


def _dense(dim=64):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 128, 8, dim, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(2, 128, 8, dim, device=DEV, dtype=torch.bfloat16)


def _reference(q, k, v, g):
    """(o, d_q, d_k, d_v) of causal attention on bshd tensors in float64 (outside any
    determinism context: cuBLAS refuses one without CUBLAS_WORKSPACE_CONFIG)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=True).transpose(1, 2)
    return (o, *torch.autograd.grad(o, leaves, g.double()))


def _close(got, want):
    for a, r in zip(got, want):
        torch.testing.assert_close(a.double(), r, atol=TOL * r.abs().max().item(), rtol=TOL)


_ENTRIES = {
    "attention": lambda q, k, v, det: fastattn.torch.attention(q, k, v, causal=True, deterministic=det),
    "flash_attn_func": lambda q, k, v, det: flash_attn_func(q, k, v, causal=True, deterministic=det),
}


@pytest.mark.parametrize("entry", list(_ENTRIES))
def test_a_non_deterministic_backward_raises_while_determinism_is_required(path, entry):
    q, k, v, g = _dense()
    with deterministic(warn_only=False):
        o = _ENTRIES[entry](q, k, v, False)  # the forward is deterministic: it runs
        if path == "native" and entry == "attention":
            assert o.grad_fn.name() == "fastattn::DenseBackward"  # (the op library's backward)
        with pytest.raises(RuntimeError, match=WORDS) as raised:
            torch.autograd.grad(o, (q, k, v), g)
    assert "deterministic=True" in str(raised.value) and "warn_only=True" in str(raised.value)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("entry", list(_ENTRIES))
def test_with_warn_only_a_non_deterministic_backward_warns_and_runs(path, entry):
    q, k, v, g = _dense()
    want = _reference(q, k, v, g)
    with deterministic(warn_only=True):
        o = _ENTRIES[entry](q, k, v, False)
        with pytest.warns(UserWarning, match=WORDS):
            grads = torch.autograd.grad(o, (q, k, v), g)
    _close((o, *grads), want)


@pytest.mark.parametrize("entry", list(_ENTRIES))
@pytest.mark.parametrize("warn_only", [False, True])
def test_deterministic_true_neither_warns_nor_raises_and_repeats_bit_for_bit(path, entry, warn_only):
    # (bf16, head dim 128, causal: a config cuDNN has a deterministic backward for on the
    # GPUs the suite runs on, as tests/attention/test_attention_gpu.py's own test asks)
    q, k, v, g = _dense(dim=128)
    want = _reference(q, k, v, g)
    runs = []
    with deterministic(warn_only), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            o = _ENTRIES[entry](q, k, v, True)
            runs.append((o, *torch.autograd.grad(o, (q, k, v), g)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    _close(runs[0], want)


def test_attention_varlen_alerts_unless_deterministic(path):
    torch.manual_seed(1)
    cu = torch.tensor([0, 100, 250, 384], device=DEV, dtype=torch.int32)
    q, k, v = (torch.randn(384, h, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2))
    g = torch.randn(384, 8, 64, device=DEV, dtype=torch.bfloat16)

    def step(det):
        o = fastattn.torch.attention_varlen(q, k, v, cu, cu, 150, 150, causal=True, deterministic=det)
        return (o, *torch.autograd.grad(o, (q, k, v), g))

    with deterministic(warn_only=False):
        with pytest.raises(RuntimeError, match=WORDS):
            step(False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            first, second = step(True), step(True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    with deterministic(warn_only=True), pytest.warns(UserWarning, match=WORDS):
        got = step(False)
    for a, b in zip(got, first):
        torch.testing.assert_close(a, b, atol=TOL * b.abs().max().item(), rtol=TOL)


# -- the SDPA mode ------------------------------------------------------------------------------

@pytest.fixture(params=("native", "python"))
def mode(request, monkeypatch):
    """The mode on, with the op library's C++ kernels or the Python ones (as test_sdpa_mode_gpu.py)."""
    with sdpa_mode_on(request.param, monkeypatch):
        yield request.param


def _bhsd():
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 8, 96, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(2, 8, 96, 128, device=DEV, dtype=torch.bfloat16)


def _has_deterministic(q, causal=True) -> bool:
    """Whether the loaded cuDNN builds a deterministic backward for the mode's plan of q's
    shape (bhsd tensors): what the probe says, the graph that would run."""
    b, h, s, d = q.shape
    cfg = fastattn.AttentionConfig(batch=b, heads_q=h, seqlen_q=s, head_dim_qk=d, layout="bhsd",
                                   dtype="bf16" if q.dtype == torch.bfloat16 else "fp16",
                                   mask="causal" if causal else "none", training=True, deterministic=True)
    return fastattn.probe(cfg).supported


def _grads(q, k, v, g):
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (o, *torch.autograd.grad(o, (q, k, v), g))


def test_while_determinism_is_required_the_mode_takes_cudnns_deterministic_backward(mode):
    # A call with a backward takes cuDNN's deterministic backward (a plan of its own): served,
    # no alert, the same gradients bit for bit on every run, right against float64. Where
    # the loaded cuDNN builds none, PyTorch's choice runs it (NO_DETERMINISTIC).
    q, k, v, g = _bhsd()
    before = fastattn.stats()["sdpa"]
    with deterministic(warn_only=False), warnings.catch_warnings():
        warnings.simplefilter("error")
        first, second = _grads(q, k, v, g), _grads(q, k, v, g)
    after = fastattn.stats()["sdpa"]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    if not _has_deterministic(q):
        reason = _sdpa_mode.NO_DETERMINISTIC
        assert after["passed_on"].get(reason, 0) == before["passed_on"].get(reason, 0) + 2, after
        return
    assert after["served"] == before["served"] + 2, after
    want = _reference(*(t.transpose(1, 2) for t in (q, k, v, g)))
    _close((t.transpose(1, 2) for t in first), want)


def test_a_served_forward_whose_backward_runs_under_determinism_takes_the_deterministic_one(mode):
    # The forward ran before determinism was required; its backward, required deterministic
    # when it runs, takes cuDNN's deterministic backward: no alert, the same gradients bit
    # for bit every time it runs from that forward, right against float64. A run wholly
    # under the flag gets its forward from the deterministic config's own plan, another
    # build of the same graph: where that gives the same bits (9.19 and 9.28 always did),
    # the gradients are the same bit for bit too; 9.24 has built one graph to other bits
    # now and then (docs/VERIFICATION.md, "Builds of one graph").
    q, k, v, g = _bhsd()
    if not _has_deterministic(q):
        pytest.skip("this cuDNN builds no deterministic backward for the config")
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with deterministic(warn_only=False), warnings.catch_warnings():
        warnings.simplefilter("error")
        late = torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
        again = torch.autograd.grad(o, (q, k, v), g)
        strict = _grads(q, k, v, g)
    assert all(torch.equal(a, b) for a, b in zip(late, again))
    if torch.equal(o, strict[0]):
        assert all(torch.equal(a, b) for a, b in zip(late, strict[1:]))
    want = _reference(*(t.transpose(1, 2) for t in (q, k, v, g)))
    _close((t.transpose(1, 2) for t in (o, *late)), want)


@pytest.mark.parametrize("warn_only", [True, False])
def test_pytorchs_determinism_test_holds_with_the_mode_on(mode, warn_only):
    # PyTorch's test_fused_backwards_throws_determinism_warning, its cuDNN case: warn_only,
    # its words (the mode serves as PyTorch's cuDNN backend, with its default backward).
    # Without warn_only: cuDNN's deterministic backward where the loaded cuDNN builds one,
    # else a RuntimeError (PyTorch's: with only cuDNN enabled, no kernel).
    q, k, v = (torch.randn(1, 8, 64, 64, device=DEV, dtype=torch.float16, requires_grad=True) for _ in range(3))
    has_one = _has_deterministic(q, causal=False)
    before = fastattn.stats()["sdpa"]["served"]
    with deterministic(warn_only), torch.nn.attention.sdpa_kernel([_B.CUDNN_ATTENTION]):
        if warn_only:
            with pytest.warns(UserWarning, match=WORDS):
                F.scaled_dot_product_attention(q, k, v).sum().backward()
        elif has_one:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                F.scaled_dot_product_attention(q, k, v).sum().backward()
        else:
            with pytest.raises(RuntimeError):
                F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert fastattn.stats()["sdpa"]["served"] == before + (warn_only or has_one)
