"""Determinism on the CPU: while torch.use_deterministic_algorithms(True) is set, every launch
of a cuDNN backward in fastattn.torch whose plan lacks cuDNN's deterministic algorithm warns
(warn_only) or raises, as PyTorch's own non-deterministic kernels do, before any work: the
Python path's launches (the executor's backward_impl, the SDPA mode's kernel over it, the
shape classes', FP8's), and the op library's bridge to the same words; the miss handler
tells the op library which plans are deterministic. The SDPA mode's hand-over of calls with
a backward is in test_sdpa_mode.py. What this cannot check: the op library's launch itself
(csrc/table.cpp run, CUDA only) and cuDNN (test_determinism_gpu.py)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from fastattn.torch import _dense, _executor, _fp8, _native, _sdpa_mode, _shape_classes, _specs, _varlen  # noqa: E402
from helpers.torch import deterministic  # noqa: E402

WORDS = "cuDNN Attention defaults to a non-deterministic algorithm."  # PyTorch's cuDNN backward's (its tests match it)


@pytest.fixture(params=["python", "op library"])
def alert(request):
    """The alert as the Python path calls it, or through the op library's bridge (what
    csrc/table.cpp's run calls before a backward without cuDNN's deterministic algorithm)."""
    if request.param == "python":
        return _executor.alert_not_deterministic
    return request.getfixturevalue("lib").alert_not_deterministic


def test_the_alert_warns_with_warn_only_raises_without_and_is_silent_when_not_set(alert):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alert()  # the flag not set: nothing
    with deterministic(warn_only=True), pytest.warns(UserWarning) as caught:
        alert()
    (w,) = caught
    message = str(w.message)
    assert message.startswith(WORDS) and "torch.use_deterministic_algorithms(True, warn_only=True)" in message
    assert "deterministic=True" in message  # how to get a deterministic backward
    with deterministic(warn_only=False), pytest.raises(RuntimeError) as raised:
        alert()
    assert type(raised.value) is RuntimeError, raised.value  # PyTorch's own class for it
    assert str(raised.value).startswith(WORDS) and "'torch.use_deterministic_algorithms(True)'" in str(raised.value)
    assert "warn_only=True" in str(raised.value)


class Reached(Exception):
    """The launch got past the alert to its plan lookup."""


def _refuse(*args):
    raise Reached


def _dense_call(det):
    t = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    options = _dense.DenseOptions("bshd", False, False, -1, -1, 0.0, det, False, True, 0.0, False, 0.0)
    return _dense, lambda: _dense.backward_impl(t, t, t, t, t, t, None, None, None, None, None, options)


def _varlen_call(det):
    t = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    options = _varlen.VarlenOptions(4, 4, False, False, -1, -1, 0.0, det, True, False, 0.0, 0.0)
    return _varlen, lambda: _varlen.backward_impl(t, t, t, t, t, t, cu, cu, None, None, options)


def _classes_call(det):
    t = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    dense = _dense.DenseOptions("bshd", False, False, -1, -1, 0.0, det, False, True, 0.0, False, 0.0)
    options = _shape_classes.ClassOptions(dense, 8, 8)
    return _shape_classes, lambda: _shape_classes.backward_impl(t, t, t, t, t, t, None, None, None, options)


def _fp8_call(det):
    t = torch.zeros(1, 4, 2, 16, dtype=torch.float8_e4m3fn)
    options = _fp8.Fp8Options("bshd", False, False, -1, -1, 0.0, det, True, "bf16", "bf16")
    return _fp8, lambda: _fp8.backward_impl(t, t, t, t, t, t, (), None, None, options)


@pytest.mark.parametrize("call", [_dense_call, _varlen_call, _classes_call, _fp8_call],
                         ids=["attention", "attention_varlen", "shape classes", "attention_fp8"])
@pytest.mark.parametrize("warn_only", [False, True])
def test_every_python_backward_launch_alerts_before_its_work_unless_its_plan_is_deterministic(monkeypatch, call,
                                                                                                warn_only):
    for det in (False, True):
        module, backward = call(det)
        monkeypatch.setattr(module, "plan_for", _refuse)  # (read at each call: Reached once past the alert)
        with pytest.raises(Reached):
            backward()  # the flag not set
        with deterministic(warn_only):
            if det:  # deterministic=True: cuDNN's deterministic backward, no alert
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    with pytest.raises(Reached):
                        backward()
            elif warn_only:
                with pytest.warns(UserWarning, match=WORDS), pytest.raises(Reached):
                    backward()
            else:
                with pytest.raises(RuntimeError, match=WORDS):
                    backward()


def test_the_sdpa_modes_python_backward_takes_the_deterministic_plan_or_alerts(monkeypatch):
    # The mode's backward kernel runs _dense.backward_impl. While determinism is required
    # without warn_only its route asks for cuDNN's deterministic backward (a forward served
    # before the flag was set included); with warn_only it keeps the default one, whose
    # launch warns in PyTorch's words.
    asked = []

    def plan_for(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, o, options):
        if o is not None:  # the backward's lookup, past the alert
            asked.append(options.deterministic)
            raise Reached

    monkeypatch.setattr(_dense, "plan_for", plan_for)
    _sdpa_mode._routes.clear()
    q = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    lse, seed = torch.zeros(1, 2, 4), torch.zeros((), dtype=torch.long)
    args = (q, q, q, q, q, lse, seed, seed, torch.empty(0), torch.empty(0), torch.empty(0), 4, 4, 0.0, False)
    try:
        with pytest.raises(Reached):
            _sdpa_mode._backward(*args)
        with deterministic(warn_only=False), pytest.raises(Reached):
            _sdpa_mode._backward(*args)
        with deterministic(warn_only=True), pytest.warns(UserWarning, match=WORDS), pytest.raises(Reached):
            _sdpa_mode._backward(*args)
        assert asked == [False, True, False]
    finally:
        _sdpa_mode._routes.clear()


@pytest.mark.parametrize("det", [False, True])
def test_the_miss_handler_tells_the_op_library_whether_the_backward_is_deterministic(monkeypatch, det):
    from fastattn import _core

    class Plan:
        config = type("Config", (), {"deterministic": det})

    class Hit:
        plan, forward_workspace, backward_workspace = Plan(), 16, 32

    options = _native.PLAN_FOR["dense"][1]
    monkeypatch.setitem(_native.PLAN_FOR, "dense", (lambda *args: Hit, options))
    monkeypatch.setattr(_core, "abi_graphs", lambda plan: (1, 2))
    off = tuple(o.off for o in _specs.DENSE.options)  # (the miss hands the options as a plain tuple)
    assert _native._miss(_native.KINDS.index("dense"), 1, off) == (Hit.plan, 1, 2, 16, 32, det)
