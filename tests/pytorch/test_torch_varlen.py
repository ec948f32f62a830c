"""attention_varlen()'s C entry (fastattn/torch/csrc/eager.cpp's call_varlen) without a GPU: it
takes only calls that attention_varlen()'s Python body takes, with the same meaning (its
readers, readers.h, through the tests' own extension: the `readers` fixture), and hands
everything else back. Its CUDA work is exercised by test_torch_gpu.py and
test_ragged_gpu.py."""


import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
from helpers.torch import SOFTCAPS, assert_options_mean_the_same, assert_softcap_means_the_same  # noqa: E402
from fastattn.torch import _native, _varlen  # noqa: E402


# attention_varlen()'s 13 arguments after the tensors' 5, in its order.
DEFAULTS = dict(max_seqlen_q=64, max_seqlen_kv=64, causal=False, causal_bottom_right=False, window=None, scale=None,
                deterministic=False, alignment="top_left", alibi=False, dropout_p=0.0, return_lse=False, softcap=0.0,
                sinks=None)


def packed(device="meta", tokens=(48, 48), hq=4, hkv=2, dqk=8, dv=8, dtype=torch.bfloat16, batch=3):
    q = torch.empty(tokens[0], hq, dqk, device=device, dtype=dtype)
    k = torch.empty(tokens[1], hkv, dqk, device=device, dtype=dtype)
    v = torch.empty(tokens[1], hkv, dv, device=device, dtype=dtype)
    cu = torch.zeros(batch + 1, device=device, dtype=torch.int32)
    return q, k, v, cu, cu


def args(tensors, **kw):
    return (*tensors, *{**DEFAULTS, **kw}.values())


_any_bool = st.sampled_from([True, False, 0, 1, None, "true", np.bool_(True)])
_length = st.one_of(st.integers(-2, 300), st.sampled_from([2**31 - 1, 2**31, 2**70, True, 64.0, "64", None,
                                                            np.int64(64)]))
_bound = st.one_of(st.integers(-3, 3), st.sampled_from([2**31, True, None, 1.5, np.int64(4)]))
_window = st.one_of(st.none(), st.tuples(_bound, _bound), st.lists(_bound, min_size=1, max_size=3),
                    st.sampled_from(["ab", {1: 2}]))
_scale = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2),
                   st.sampled_from([1e-50, 1e39, "0.1", np.float32(0.5), True]))
_alignment = st.sampled_from(["top_left", "bottom_right", "bottom-right", "", None, 1])
_dropout = st.one_of(st.sampled_from([0.0, -0.0, 0, False, None, "0", np.float64(0.0)]), st.floats(-1, 2))
_lse = st.sampled_from([False, True, 0, None])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(max_seqlen_q=_length, max_seqlen_kv=_length, causal=_any_bool, causal_bottom_right=_any_bool, window=_window,
       scale=_scale, deterministic=_any_bool, alignment=_alignment, alibi=_any_bool, dropout_p=_dropout,
       return_lse=_lse, softcap=SOFTCAPS)
def test_call_varlen_takes_only_values_the_python_body_takes_with_the_same_meaning(readers, **kw):
    got = readers.read_varlen_call(*args(packed(), **kw))
    if got is None:
        return  # the Python body takes the call, and checks and reports
    o = _varlen.VarlenOptions(*got)
    assert_softcap_means_the_same(kw["softcap"], o.softcap)
    for name in ("max_seqlen_q", "max_seqlen_kv"):  # the body's own check
        n = kw[name]
        assert not isinstance(n, bool) and isinstance(n, int) and n >= 1
    assert (o.max_q, o.max_kv) == (_varlen.bucket(kw["max_seqlen_q"]), _varlen.bucket(kw["max_seqlen_kv"]))
    assert_options_mean_the_same(kw, o.causal, o.bottom_right, o.deterministic, o.alibi, o.window_left,
                                 o.window_right, o.scale)
    assert (o.training, o.dropout) == (False, 0.0)  # the eager call decides training


@pytest.mark.parametrize("kw", [
    {}, {"causal": True}, {"causal_bottom_right": True}, {"window": (128, 0)}, {"scale": 0.125},
    {"alignment": "bottom_right", "causal": True}, {"deterministic": True}, {"alibi": True, "causal": True},
    {"dropout_p": 0}, {"max_seqlen_q": 1, "max_seqlen_kv": 4097},
    {"sinks": torch.empty(4, device="meta"), "causal": True, "alignment": "bottom_right"},
], ids=repr)
def test_call_varlen_takes_the_common_calls(readers, kw):
    assert readers.read_varlen_call(*args(packed(), **kw)) is not None


def _tensor_cases():
    dtypes = st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.int32])
    dims = st.sampled_from([2, 3, 3, 3, 4])
    return st.fixed_dictionaries({
        "q": st.tuples(st.integers(0, 40), st.integers(0, 8), st.sampled_from([0, 8, 16]), dtypes,
                       st.booleans(), dims),
        "k": st.tuples(st.integers(0, 40), st.integers(0, 8), st.sampled_from([0, 8, 16]), dtypes,
                       st.booleans(), dims),
        "v": st.tuples(st.integers(0, 40), st.integers(0, 8), st.sampled_from([0, 8, 16]), dtypes,
                       st.booleans(), dims),
        "cu": st.tuples(st.integers(0, 5), st.sampled_from([torch.int32, torch.int64]), st.booleans(),
                        st.integers(1, 2)),
        "cu_kv_len": st.one_of(st.none(), st.integers(0, 5)),
    })


def _make(spec):
    tokens, heads, dim, dtype, contiguous, ndim = spec
    t = torch.empty(tokens, heads, dim * (1 if contiguous else 2), device="meta", dtype=dtype)
    t = t if contiguous else t[..., ::2]
    return {2: t.flatten(1), 3: t, 4: t.unsqueeze(0)}[ndim]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_tensor_cases())
def test_call_varlen_tensor_checks_pass_only_what_check_varlen_passes(readers, case):
    q, k, v = _make(case["q"]), _make(case["k"]), _make(case["v"])
    n, cu_dtype, cu_contiguous, cu_dim = case["cu"]
    cu_q = torch.zeros((n * 2,) if not cu_contiguous else (n,), device="meta", dtype=cu_dtype)
    cu_q = cu_q if cu_contiguous else cu_q[::2]
    cu_q = cu_q if cu_dim == 1 else cu_q[None]
    cu_kv = cu_q if case["cu_kv_len"] is None else torch.zeros(case["cu_kv_len"], device="meta", dtype=torch.int32)
    ok = readers.check_varlen_tensors(q, k, v, cu_q, cu_kv)
    try:
        _varlen._check_varlen(q, k, v, cu_q, cu_kv)
        python_ok = True
    except fastattn.InvalidArgumentError:
        python_ok = False
    assert not ok or python_ok, "the C entry took tensors the Python body refuses"


def test_call_varlen_tensor_checks_take_the_common_tensors(readers):
    for kw in ({}, {"hkv": 4}, {"hkv": 1, "dv": 16}, {"dtype": torch.float16}, {"tokens": (5, 900)}):
        assert readers.check_varlen_tensors(*packed(**kw)), kw


@pytest.mark.parametrize("grad_mode", [True, False])
def test_call_varlen_decides_gradients_as_autograd_does(readers, grad_mode):
    # training where the grad mode is on and an input that takes a gradient wants one, as
    # attention_varlen()'s Python body decides. Each input: 0 wants no gradient, 1 wants
    # one, 2 (sink) not given.
    for wanted in itertools.product((0, 1), (0, 1), (0, 1), (0, 1, 2)):
        q, k, v, _, _ = packed()
        tensors = [q, k, v, torch.empty(4, device="meta")]
        tensors = [None if w == 2 else t.requires_grad_(w == 1) for t, w in zip(tensors, wanted)]
        with torch.set_grad_enabled(grad_mode):
            assert readers.varlen_grads(*tensors) == (grad_mode and 1 in wanted), wanted


def test_call_varlen_hands_back_what_it_does_not_run(lib, readers):
    assert lib.call_varlen(*args(packed(device="cpu"))) is NotImplemented  # not CUDA
    assert lib.call_varlen(*args(packed())) is NotImplemented  # meta
    q, k, v, cu, _ = packed(device="cpu")
    assert lib.call_varlen(*args((q, "k", v, cu, cu))) is NotImplemented
    assert lib.call_varlen(*args(packed(device="cpu"), dropout_p=0.1)) is NotImplemented
    with pytest.raises(TypeError, match=r"18 positional arguments \(3 given\)"):
        lib.call_varlen(q, k, v)
    with pytest.raises(TypeError, match=r"18 positional arguments \(2 given\)"):
        readers.read_varlen_call(q, k)


def test_attention_varlen_reports_through_its_python_body_with_the_c_entry_published(lib, monkeypatch):
    # CPU tensors: the C entry hands the call back, and the body names what is wrong.
    monkeypatch.setattr(_native, "CALL_VARLEN", lib.call_varlen)
    q, k, v, cu, _ = packed(device="cpu")
    with pytest.raises(fastattn.InvalidArgumentError, match="q is on cpu"):
        fastattn.torch.attention_varlen(q, k, v, cu, cu, 16, 16)
    q, k, v, cu, _ = packed(device="meta", hkv=0)
    with pytest.raises(fastattn.InvalidArgumentError, match="heads and head_dim must be at least 1"):
        fastattn.torch.attention_varlen(q, k, v, cu, cu, 16, 16)


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(["max_seqlen_q", "max_seqlen_kv"]),
       value=st.one_of(st.integers(max_value=0), st.integers(min_value=2**31), st.sampled_from([True, 1.0, "8", None])))
def test_attention_varlen_names_a_bad_max_length(name, value):
    # Every value outside [1, 2**31) is an InvalidArgumentError naming the argument, on
    # the Python path too (2**80 must not reach torch.ops, which raises a RuntimeError).
    q, k, v, cu, _ = packed()
    lengths = {"max_seqlen_q": 16, "max_seqlen_kv": 16, name: value}
    with pytest.raises(fastattn.InvalidArgumentError, match=f"^{name}="):
        fastattn.torch.attention_varlen(q, k, v, cu, cu, lengths["max_seqlen_q"], lengths["max_seqlen_kv"])


@pytest.mark.parametrize("max_q,grad,lse,sinks,want", [
    (1, True, False, False, 2), (1, False, True, False, 2), (1, False, False, False, 1), (2, True, False, False, 2),
    (3, True, False, False, 4), (1, False, False, True, 2), (3, False, False, True, 4)])
def test_a_training_plan_and_one_with_sinks_declare_at_least_two_queries(monkeypatch, max_q, grad, lse, sinks, want):
    # cuDNN 9.19's ragged backward of one query with fewer key heads than query heads is
    # wrong (benchmarks/probe_decode.py), and it refuses sinks in a graph of one query: such a
    # plan declares two (the C entry likewise).
    seen = []
    monkeypatch.setattr(_varlen, "forward_op", lambda *a: seen.append(a[5:]) or (a[0], a[0].new_empty(a[0].shape[:2])))
    q, k, v, cu, _ = packed()
    q.requires_grad_(grad)
    fastattn.torch.attention_varlen(q, k, v, cu, cu, max_q, 64, return_lse=lse,
                                    sinks=torch.empty(4, device="meta") if sinks else None)
    assert (seen[0][0] is not None) == sinks and seen[0][2:4] == (want, 64)  # the sink, rng, then max_q, max_kv
