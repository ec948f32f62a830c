"""fastattn.torch's FP8 entry points without a GPU: input errors, fake (meta) shapes and
dtypes, make_fx traces, the ops' schemas against Fp8Options, and a recording plan that
shows each scale, descale and amax reaching the plan under its own slot name."""

import ctypes
import inspect

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
from fastattn.config import FP8_BACKWARD_SCALARS, FP8_FORWARD_SCALARS  # noqa: E402
from fastattn.torch import _fp8, _plans, attention_fp8, attention_fp8_backward, attention_fp8_scaled  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def qkv(device="meta", dtype=E4M3, b=2, s=128, h=8, hkv=2, d=64, grad=False):
    return tuple(torch.zeros((b, s, hh, d), device=device, dtype=dtype, requires_grad=grad) for hh in (h, hkv, hkv))


def scalars(n, device="meta", value=1.0):
    return [torch.full((1,), value, device=device) for _ in range(n)]


def test_fake_forward_and_backward_shapes_and_dtypes():
    q, k, v = qkv()
    out = attention_fp8(q, k, v, *scalars(6), causal=True, training=True, grad_dtype=E5M2, out_dtype=torch.bfloat16)
    assert out.o.shape == q.shape and out.o.dtype == torch.bfloat16 and out.stats.shape == (2, 8, 128, 1)
    assert out.amax_s.shape == out.amax_o.shape == (1,) and out.amax_o.dtype == torch.float32
    assert attention_fp8(q, k, v, *scalars(6)).stats is None
    d_o = torch.zeros(q.shape, device="meta", dtype=E5M2)
    g = attention_fp8_backward(d_o, out.o, out.stats, q, k, v, *scalars(12), causal=True)
    assert (g.d_q.shape, g.d_k.shape, g.d_v.shape) == (q.shape, k.shape, v.shape)
    assert g.d_q.dtype == g.d_k.dtype == E5M2 and all(a.shape == (1,) for a in g[3:])


def test_scaled_helper_fake_shapes_and_gradients():
    q, k, v = qkv(dtype=torch.bfloat16, grad=True)
    o = attention_fp8_scaled(q, k, v, causal=True)
    assert o.shape == q.shape and o.dtype == torch.bfloat16
    o.sum().backward()
    assert q.grad.shape == q.shape and k.grad.dtype == torch.bfloat16 and v.grad.shape == v.shape


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: attention_fp8(q.to(torch.bfloat16), k, v, *scalars(6)), r"^q has dtype torch.bfloat16: FP8"),
    (lambda q, k, v: attention_fp8(q, k.to(E5M2), v.to(E5M2), *scalars(6)), "different dtypes"),
    (lambda q, k, v: attention_fp8(q, k, v, *scalars(6), out_dtype=torch.float32), r"^out_dtype=torch.float32"),
    (lambda q, k, v: attention_fp8(q, k, v, *scalars(6), training=True, grad_dtype=torch.bfloat16),
     r"^grad_dtype=torch.bfloat16"),
    (lambda q, k, v: attention_fp8(q, k, v, *scalars(6), layout="bsh"), r"^layout='bsh'"),
    (lambda q, k, v: attention_fp8(q, k, v, *scalars(5), torch.zeros(2, device="meta")),
     r"^scale_o: expected a torch.float32 tensor of one element"),
    (lambda q, k, v: attention_fp8_scaled(q, k, v), r"^q: attention_fp8_scaled takes torch.float16"),
    (lambda q, k, v: attention_fp8_scaled(*(t.to(torch.bfloat16) for t in (q, k, v)), fp8_dtype=torch.int8),
     r"^fp8_dtype=torch.int8"),
])
def test_bad_inputs_are_named(call, match):
    with pytest.raises(fastattn.InvalidArgumentError, match=match):
        call(*qkv())


def test_cpu_tensors_are_refused():
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^q is on cpu"):
        attention_fp8(*qkv(device="cpu"), *scalars(6, device="cpu"))


def test_traces_as_the_fp8_ops():
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v):
        o = attention_fp8_scaled(q, k, v, causal=True)
        return torch.autograd.grad(o.sum(), (q, k, v))

    graph = make_fx(step, tracing_mode="fake")(*qkv(dtype=torch.bfloat16, grad=True))
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert "fastattn.attention_fp8_forward.default" in targets
    assert "fastattn.attention_fp8_backward.default" in targets


def test_op_schemas_follow_the_options_fields():
    for op, n_tensors in ((torch.ops.fastattn.attention_fp8_forward.default, 11),
                          (torch.ops.fastattn.attention_fp8_backward.default, 20)):
        names = [a.name for a in op._schema.arguments]
        assert names[n_tensors:] == list(_fp8.Fp8Options._fields)
    fwd = [a.name for a in torch.ops.fastattn.attention_fp8_forward.default._schema.arguments]
    assert fwd[3:9] == list(_fp8.FORWARD_SCALARS) and _fp8.FORWARD_SCALARS == FP8_FORWARD_SCALARS[:6]
    assert set(_fp8.BACKWARD_SCALARS) | {"amax_d_q", "amax_d_k", "amax_d_v", "amax_d_p"} == set(FP8_BACKWARD_SCALARS)


def test_the_scalar_lists_are_in_the_parameters_order():
    # _fp8 zips FORWARD_SCALARS / BACKWARD_SCALARS (derived from the slot table) with the
    # scalars as each function and op takes them, positionally, and BACKWARD_AMAXES with
    # Fp8Grads' amaxes: a slot table in another order must fail here, not pass each scale
    # to another slot.
    assert _fp8.FORWARD_SCALARS == ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    assert _fp8.BACKWARD_SCALARS == ("descale_q", "descale_k", "descale_v", "descale_o", "descale_d_o", "descale_s",
                                     "descale_d_p", "scale_s", "scale_d_q", "scale_d_k", "scale_d_v", "scale_d_p")
    assert _fp8.BACKWARD_AMAXES == ("amax_d_q", "amax_d_k", "amax_d_v", "amax_d_p") == _fp8.Fp8Grads._fields[3:]
    assert tuple(_fp8.Fp8Output._fields[2:]) == tuple(n for n in FP8_FORWARD_SCALARS if n.startswith("amax_"))

    def params(f, start, n):
        return tuple(inspect.signature(f).parameters)[start:start + n]

    assert params(attention_fp8, 3, 6) == params(_fp8.forward_impl, 3, 6) == _fp8.FORWARD_SCALARS
    assert params(attention_fp8_backward, 6, 12) == _fp8.BACKWARD_SCALARS
    fwd = [a.name for a in torch.ops.fastattn.attention_fp8_forward.default._schema.arguments]
    bwd = [a.name for a in torch.ops.fastattn.attention_fp8_backward.default._schema.arguments]
    assert tuple(fwd[3:9]) == _fp8.FORWARD_SCALARS and tuple(bwd[6:18]) == _fp8.BACKWARD_SCALARS


class RecordingPlan:
    """Records each call's keywords with the float32 each pointed to at the call (the
    scalars may be freed after it), and writes a mark per name into each amax."""

    forward_workspace_size = backward_workspace_size = 0

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, o, stats, workspace, stream, seq_len_q=0, seq_len_kv=0, **kw):
        self.calls.append(("forward", {n: ctypes.c_float.from_address(p).value for n, p in kw.items()}))
        for i, name in enumerate(("amax_s", "amax_o")):
            ctypes.c_float.from_address(kw[name]).value = 100 + i

    def backward(self, q, k, v, o, d_o, stats, d_q, d_k, d_v, workspace, stream, seq_len_q=0, seq_len_kv=0, **kw):
        self.calls.append(("backward", {n: ctypes.c_float.from_address(p).value for n, p in kw.items()}))
        for i, name in enumerate(("amax_d_q", "amax_d_k", "amax_d_v", "amax_d_p")):
            ctypes.c_float.from_address(kw[name]).value = 200 + i


@pytest.fixture
def recording(monkeypatch):
    plan = RecordingPlan()
    monkeypatch.setattr(_fp8, "plan_for", lambda q, k, v, o, scalars, names, sq, skv, options: _plans.CachedPlan(
        plan, q, k, v, options.layout))
    monkeypatch.setattr(_fp8, "raw_stream", lambda device: 0)
    # CPU tensors stand in for CUDA ones here: the checks that refuse them are tested above.
    monkeypatch.setattr(_fp8, "check", lambda *args: None)
    monkeypatch.setattr(_fp8, "check_scalar", lambda *args: None)
    monkeypatch.setattr(_plans, "capturing", lambda: False)
    return plan


def test_each_scale_reaches_its_slot(recording):
    q, k, v = qkv(device="cpu")
    fwd = [torch.full((1,), float(i)) for i in range(6)]
    out = attention_fp8(q, k, v, *fwd, training=True, grad_dtype=E5M2)
    (kind, kw), = recording.calls
    assert kind == "forward" and set(kw) == set(FP8_FORWARD_SCALARS)
    for i, name in enumerate(_fp8.FORWARD_SCALARS):
        assert kw[name] == i, name
    assert (out.amax_s.item(), out.amax_o.item()) == (100, 101)
    bwd = [torch.full((1,), float(i)) for i in range(12)]
    g = attention_fp8_backward(torch.zeros(q.shape, dtype=E5M2), out.o, out.stats, q, k, v, *bwd)
    kind, kw = recording.calls[1]
    assert kind == "backward" and set(kw) == set(FP8_BACKWARD_SCALARS)
    for i, name in enumerate(_fp8.BACKWARD_SCALARS):
        assert kw[name] == i, name
    assert [a.item() for a in g[3:]] == [200, 201, 202, 203] and g.d_q.dtype == E5M2


def test_scaled_helper_scales(recording):
    q, k, v = (t.float().uniform_(-2, 2).to(torch.bfloat16).requires_grad_() for t in qkv(device="cpu"))
    with torch.no_grad():
        v[0, 0, 0, 0] = 8.0  # amax(v) = 8
    o = attention_fp8_scaled(q, k, v)
    kw = recording.calls[0][1]
    value = lambda name: kw[name]  # noqa: E731
    assert value("descale_v") == pytest.approx(8.0 / 448) and value("scale_o") == pytest.approx(448 / 8.0)
    assert value("scale_s") == 448 and value("descale_s") == pytest.approx(1 / 448)
    o.sum().backward()
    kw = recording.calls[1][1]
    # d_o is all ones: amax 1; d_v's bound is amax(d_o) * seqlen_q * (heads_q / heads_kv) = 128 * 4.
    assert value("descale_d_o") == pytest.approx(1 / 57344) and value("scale_d_v") == pytest.approx(57344 / 512)
    assert q.grad.dtype == torch.bfloat16 and k.grad.shape == k.shape


from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_ODD = st.sampled_from([None, 0, 1, -1, 0.5, "causal", "bf16", True, (1, 2), [0, -1], {"a": 1}, float("nan")])


@settings(max_examples=120, derandomize=True, deadline=None)
@given(causal=st.one_of(st.booleans(), _ODD), window=st.one_of(st.none(), st.tuples(
    st.integers(-3, 300), st.integers(-3, 300)), _ODD), scale=st.one_of(st.none(), st.floats(-1, 4), _ODD),
       out_dtype=st.sampled_from([None, E4M3, E5M2, torch.bfloat16, torch.float16, torch.float32, "bf16", 3]),
       grad_dtype=st.sampled_from([None, E4M3, E5M2, torch.bfloat16, "e5m2"]), training=st.one_of(st.booleans(),
                                                                                                   _ODD),
       layout=st.sampled_from(["bshd", "bhsd", "sbhd", "bsh", 3]))
@example(causal=False, window=(-3, 5), scale=None, out_dtype=None, grad_dtype=None, training=False, layout="bshd")
@example(causal=True, window=None, scale=0.0, out_dtype=torch.float32, grad_dtype=None, training=True, layout="bhsd")
def test_options_are_accepted_or_named(causal, window, scale, out_dtype, grad_dtype, training, layout):
    q, k, v = qkv()
    try:
        out = attention_fp8(q, k, v, *scalars(6), causal=causal, window=window, scale=scale, out_dtype=out_dtype,
                            grad_dtype=grad_dtype, training=training, layout=layout)
    except fastattn.InvalidArgumentError as e:
        named = str(e).split("=")[0].split(":")[0]
        assert named.startswith(("causal", "window", "scale", "out_dtype", "grad_dtype", "training", "layout",
                                 "q ", "k ", "heads")), str(e)
        return
    assert out.o.dtype == (out_dtype or E4M3) and (out.stats is not None) == training
