"""The native op library (fastattn/torch/csrc/ops.cpp) without a GPU: it builds against
the installed (CPU) torch and registers; its schemas are the Python ops'; its Meta
kernels and its C++ autograd run on meta tensors (the gradients' shapes show which
input each lands on); CPU tensors get a clear error; a missing compiler or a failing
build falls back to the Python path with one warning naming the cause; the path is
chosen by FASTATTN_TORCH_PATH. The CUDA kernels are exercised by test_torch_gpu.py."""

import itertools
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402
from helpers.torch import SOFTCAPS, assert_options_mean_the_same, assert_softcap_means_the_same  # noqa: E402
from fastattn.torch import _dense, _native, _paged, _plans, _specs, _varlen  # noqa: E402


def options(training=False, bias_grad=False, layout="bshd", dropout=0.0):
    return _dense.DenseOptions(layout=layout, causal=True, bottom_right=False, window_left=-1, window_right=-1,
                               scale=0.0, deterministic=False, alibi=False, training=training, dropout=dropout,
                               bias_grad=bias_grad)


def dense(device="meta", grad=False, layout="bshd"):
    # GQA with v's head dim different: every gradient has its own shape.
    shapes = {"bshd": [(2, 16, 4, 8), (2, 32, 2, 8), (2, 32, 2, 16)],
              "bhsd": [(2, 4, 16, 8), (2, 2, 32, 8), (2, 2, 32, 16)]}[layout]
    return tuple(torch.empty(s, device=device, dtype=torch.bfloat16, requires_grad=grad) for s in shapes)


def test_the_native_ops_have_the_python_ops_schemas(lib):
    ops = torch.ops.fastattn
    for native, python in ((ops.native_attention_forward.default, _dense.forward_op._opoverload),
                           (ops.native_attention_backward.default, _dense.backward_op._opoverload),
                           (ops.native_varlen_forward.default, _varlen.forward_op._opoverload),
                           (ops.native_varlen_backward.default, _varlen.backward_op._opoverload),
                           (ops.native_paged_forward.default, _paged.forward_op._opoverload)):
        n, p = native._schema, python._schema
        assert [(a.name, str(a.type)) for a in n.arguments] == [(a.name, str(a.type)) for a in p.arguments]
        assert [str(r.type) for r in n.returns] == [str(r.type) for r in p.returns]


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("training", [False, True])
def test_meta_forward_shapes(lib, layout, training):
    q, k, v = dense(layout=layout)
    o, stats = torch.ops.fastattn.native_attention_forward(q, k, v, None, None, None, None, None,
                                                           *options(training, layout=layout))
    assert o.device.type == "meta" and o.dtype == q.dtype
    assert o.shape == (q.shape[:3] + (16,) if layout == "bshd" else q.shape[:3] + (16,))
    assert o.is_contiguous()
    b, h, s = (2, 4, 16)
    assert stats.dtype == torch.float32 and tuple(stats.shape) == ((b, h, s, 1) if training else (0,))


def test_cpp_autograd_lands_each_gradient_on_its_input(lib):
    q, k, v = dense(grad=True)
    bias = torch.empty(1, 4, 16, 32, dtype=torch.bfloat16, device="meta", requires_grad=True)
    sink = torch.empty(4, device="meta", requires_grad=True)
    o, _ = torch.ops.fastattn.native_attention_forward(q, k, v, None, None, bias, sink, None,
                                                       *options(training=True, bias_grad=True))
    assert o.grad_fn.name() == "fastattn::DenseBackward"
    d_q, d_k, d_v, d_bias, d_sink = torch.autograd.grad(o.sum(), (q, k, v, bias, sink))
    for g, t in ((d_q, q), (d_k, k), (d_v, v), (d_bias, bias), (d_sink, sink)):
        assert g.shape == t.shape and g.dtype == t.dtype


def _recorded(**kw):
    q0, k, v = dense(grad=True)
    q = q0 * 1  # not a leaf: in-place changes to it are allowed, and seen
    o, _ = torch.ops.fastattn.native_attention_forward(q, k, v, None, None, None, None, None,
                                                       *options(training=True, **kw))
    return q0, q, k, v, o


def test_cpp_autograd_refuses_a_second_backward_through_a_freed_graph(lib):
    q0, _, k, v, o = _recorded()
    torch.autograd.grad(o.sum(), (q0, k, v))
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(o.sum(), (q0, k, v))


def test_cpp_autograd_keeps_the_graph_with_retain_graph(lib):
    q0, _, k, v, o = _recorded()
    first = torch.autograd.grad(o.sum(), (q0, k, v), retain_graph=True)
    second = torch.autograd.grad(o.sum(), (q0, k, v))
    assert [g.shape for g in first] == [g.shape for g in second] == [q0.shape, k.shape, v.shape]


def test_cpp_autograd_sees_an_input_changed_in_place_after_the_forward(lib):
    q0, q, k, v, o = _recorded()
    q.mul_(2)  # the saved q is no longer what the forward read
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(o.sum(), (q0,))


def test_cpp_autograd_runs_saved_tensor_hooks(lib):
    """torch.autograd.graph.saved_tensors_hooks (activation offloading, checkpointing
    tools) see every tensor the node saves, and backward gets them back through unpack."""
    packed, unpacked = [], []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    def unpack(t):
        unpacked.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        q0, q, k, v, o = _recorded()
    assert {tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(o.shape)} <= set(packed)
    d_q, = torch.autograd.grad(o.sum(), (q0,))
    assert d_q.shape == q0.shape and sorted(unpacked) == sorted(packed)


def test_cpp_autograd_gives_only_the_gradients_asked_for(lib):
    q0, _, k, v, o = _recorded()
    d_v, = torch.autograd.grad(o.sum(), (v,))
    assert d_v.shape == v.shape and q0.grad is None and k.grad is None


def test_cpp_autograd_records_no_node_when_no_input_wants_a_gradient(lib):
    q, k, v = dense(grad=False)
    o, stats = torch.ops.fastattn.native_attention_forward(q, k, v, None, None, None, None, None,
                                                           *options(training=True))
    assert o.grad_fn is None and not o.requires_grad and tuple(stats.shape) == (2, 4, 16, 1)
    with torch.no_grad():
        q, k, v = dense(grad=True)
        o, _ = torch.ops.fastattn.native_attention_forward(q, k, v, None, None, None, None, None,
                                                           *options(training=True))
    assert o.grad_fn is None


def test_cpp_autograd_gives_no_gradient_to_a_bias_without_bias_grad(lib):
    q, k, v = dense(grad=True)
    bias = torch.empty(1, 4, 16, 32, dtype=torch.bfloat16, device="meta")
    o, _ = torch.ops.fastattn.native_attention_forward(q, k, v, None, None, bias, None, None,
                                                       *options(training=True))
    d_q, = torch.autograd.grad(o.sum(), (q,))
    assert d_q.shape == q.shape


def test_backward_through_an_inference_call_is_refused(lib):
    q, k, v = dense(grad=True)
    o, _ = torch.ops.fastattn.native_attention_forward(q, k, v, None, None, None, None, None, *options(False))
    assert o.grad_fn is None  # inference: no node, nothing saved


def varlen_options(training=False):
    return _varlen.VarlenOptions(max_q=64, max_kv=64, causal=True, bottom_right=False, window_left=-1,
                                 window_right=-1, scale=0.0, deterministic=False, training=training, alibi=False,
                                 dropout=0.0)


@pytest.mark.parametrize("training", (False, True), ids=("inference", "training"))
def test_varlen_meta_and_cpp_autograd(lib, training):
    q, k, v = (torch.empty(t, h, d, device="meta", dtype=torch.float16, requires_grad=training)
               for t, h, d in ((40, 4, 8), (56, 2, 8), (56, 2, 16)))
    cu_q = torch.empty(4, dtype=torch.int32, device="meta")
    o, stats = torch.ops.fastattn.native_varlen_forward(q, k, v, cu_q, cu_q, None, None, *varlen_options(training))
    assert o.shape == (40, 4, 16) and o.dtype == q.dtype
    assert tuple(stats.shape) == ((40, 4) if training else (0,))
    if training:
        assert o.grad_fn.name() == "fastattn::VarlenBackward"
        grads = torch.autograd.grad(o.sum(), (q, k, v))
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    else:
        assert o.grad_fn is None


def test_varlen_cpu_tensors_get_a_clear_error(lib):
    q = torch.empty(8, 2, 8, dtype=torch.float16)
    cu = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"fastattn: q is on cpu: fastattn runs on CUDA tensors"):
        torch.ops.fastattn.native_varlen_forward(q, q, q, cu, cu, None, None, *varlen_options())


def test_paged_meta_shape_and_cpu_error(lib):
    q = torch.empty(3, 1, 8, 64, device="meta", dtype=torch.bfloat16)
    k_cache = torch.empty(20, 64, 2, 64, device="meta", dtype=torch.bfloat16)
    v_cache = torch.empty(20, 64, 2, 32, device="meta", dtype=torch.bfloat16)
    table = torch.empty(3, 4, device="meta", dtype=torch.int32)
    lens = torch.empty(3, device="meta", dtype=torch.int32)
    o = torch.ops.fastattn.native_paged_forward(q, k_cache, v_cache, table, lens, None, False, True, -1, -1, 0.0)
    assert o.shape == (3, 1, 8, 32) and o.dtype == q.dtype
    with pytest.raises(ValueError, match=r"fastattn: q is on cpu: fastattn runs on CUDA tensors"):
        torch.ops.fastattn.native_paged_forward(*(torch.empty_like(t, device="cpu") for t in (q, k_cache, v_cache, table, lens)),
                                                None, False, True, -1, -1, 0.0)


def test_the_paged_eager_callable_runs_the_op_where_its_kernel_does_not(lib):
    # Off CUDA (and inside dispatch modes) call_paged runs the op: its Meta kernel's shape,
    # its CPU kernel's error, as torch.ops gives them; attention_paged calls it eagerly.
    assert _native.PAGED[0] is lib.call_paged
    q = torch.empty(3, 1, 8, 64, device="meta", dtype=torch.bfloat16)
    k_cache = torch.empty(20, 64, 2, 64, device="meta", dtype=torch.bfloat16)
    v_cache = torch.empty(20, 64, 2, 32, device="meta", dtype=torch.bfloat16)
    table = torch.empty(3, 4, device="meta", dtype=torch.int32)
    lens = torch.empty(3, device="meta", dtype=torch.int32)
    options = _paged.PagedOptions(False, True, -1, -1, 0.0, 0.0)
    o = lib.call_paged(q, k_cache, v_cache, table, lens, None, *options)
    assert o.device.type == "meta" and o.shape == (3, 1, 8, 32) and o.dtype == q.dtype
    with pytest.raises(ValueError, match=r"fastattn: q is on cpu: fastattn runs on CUDA tensors"):
        lib.call_paged(*(torch.empty_like(t, device="cpu") for t in (q, k_cache, v_cache, table, lens)), None, *options)


def test_meta_backward_shapes(lib):
    q, k, v = dense()
    o = torch.empty(2, 16, 4, 16, dtype=torch.bfloat16, device="meta")
    stats = torch.empty(2, 4, 16, 1, device="meta")
    grads = torch.ops.fastattn.native_attention_backward(o, o, stats, q, k, v, None, None, None, None, None,
                                                         *options(training=True))
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    assert grads[3].numel() == 0 and grads[4].numel() == 0  # no bias gradient, no sinks


def test_cpu_tensors_get_a_clear_error(lib):
    q, k, v = dense(device="cpu")
    with pytest.raises(ValueError, match=r"fastattn: q is on cpu: fastattn runs on CUDA tensors"):
        torch.ops.fastattn.native_attention_forward(q, k, v, None, None, None, None, None, *options())


# The eager entry (eager.cpp): attention()'s plain eager CUDA calls, past the dispatcher,
# taking attention()'s own arguments (call); nothing else enters that way.

def test_the_only_eager_entry_takes_attentions_own_arguments(lib):
    assert not hasattr(lib, "attention")  # the 13-argument entry with bit-packed flags is gone
    # The tests' readers and the benchmark's profile are built beside the library, not into it.
    assert not {"read_call", "read_varlen_call", "check_varlen_tensors", "profile_eager"} & set(dir(lib))
    q, k, v = dense(device="cpu")
    assert lib.call(*call_args(q, k, v, causal=True)) is NotImplemented  # CPU tensors: the Python body reports
    with pytest.raises(TypeError, match=r"18 positional arguments \(3 given\)"):
        lib.call(q, k, v)


# attention()'s 17 arguments in its order, for lib.call / readers.read_call.
CALL_DEFAULTS = dict(causal=False, causal_bottom_right=False, window=None, scale=None, layout="bshd",
                     deterministic=False, seq_lens_q=None, seq_lens_kv=None, alibi=False, bias=None, dropout_p=0.0,
                     sinks=None, alignment="top_left", return_lse=False, softcap=0.0)


def call_args(q, k, v, **kw):
    return (q, k, v, *{**CALL_DEFAULTS, **kw}.values())


# Values of each scalar argument, the ones read_call takes and ones it must hand back.
_any_bool = st.sampled_from([True, False, 0, 1, None, "true", 1.0, np.bool_(True)])
_bound = st.one_of(st.integers(-3, 3), st.sampled_from([2**31 - 1, 2**31, -(2**70), 2**70, True, None, 1.5, "0",
                                                         np.int64(4)]))
_window = st.one_of(st.none(), st.tuples(_bound, _bound), st.lists(_bound, min_size=1, max_size=3),
                    st.sampled_from(["ab", {1: 2}, {1, 2}, (np.int64(1), 0)]))
_scale = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 2),
                   st.sampled_from([1e-50, 1e39, 3.4e38, "0.1", np.float32(0.5), True]))
_layout = st.sampled_from(["bshd", "sbhd", "bhsd", "BSHD", "bsh", "", None, b"bshd", 0])
_alignment = st.sampled_from(["top_left", "bottom_right", "bottom-right", "", None, 1])
_dropout = st.one_of(st.sampled_from([0.0, -0.0, 0, False, None, "0", np.float64(0.0), 2**70, -(2**70)]),
                     st.floats(-1, 2))
_lse = st.sampled_from([False, True, 0, None])
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(causal=_any_bool, causal_bottom_right=_any_bool, window=_window, scale=_scale, layout=_layout,
       deterministic=_any_bool, alibi=_any_bool, dropout_p=_dropout, alignment=_alignment, return_lse=_lse,
       softcap=SOFTCAPS,
       lens=st.sampled_from(["none", "q", "both", "kv only"]), extras=st.booleans())
def test_call_takes_only_values_the_python_body_takes_with_the_same_meaning(readers, lens, extras, **kw):
    # What the C entry takes must be what attention()'s Python body would accept, with
    # the same meaning; whatever else it hands back (None) to the body, which checks
    # and reports. The body's own converters decide here.
    q, k, v = dense()
    lengths = torch.empty(2, dtype=torch.int32, device="meta")
    kw["seq_lens_q"] = lengths if lens in ("q", "both") else None
    kw["seq_lens_kv"] = lengths if lens in ("both", "kv only") else None
    if extras:
        kw["bias"], kw["sinks"] = torch.empty(1, 1, 16, 32, device="meta"), torch.empty(4, device="meta")
    got = readers.read_call(*call_args(q, k, v, **kw))
    if got is None:
        return
    options, lens_kv = got
    o = _dense.DenseOptions(*options)
    assert_softcap_means_the_same(kw["softcap"], o.softcap)
    assert kw["layout"] in _plans.AXES and o.layout == kw["layout"]
    assert_options_mean_the_same(kw, o.causal, o.bottom_right, o.deterministic, o.alibi, o.window_left,
                                 o.window_right, o.scale)
    assert (o.training, o.dropout, o.bias_grad) == (False, 0.0, False)  # the eager call decides gradients
    assert lens != "kv only" and lens_kv == (lens != "none")


@pytest.mark.parametrize("entry", sorted(_specs.CALLS))
def test_the_c_entries_read_the_entry_points_own_arguments(entry):
    # The C entry's reader is generated from _specs.CALLS and reads its arguments by
    # position: CALLS must be the entry point's signature, and the Python body must hand
    # them over in that order.
    import ast
    import inspect
    import textwrap

    function = getattr(fastattn.torch, entry)
    declared = [a.name for a in _specs.CALLS[entry][1]]
    assert [p for p in inspect.signature(function).parameters if p != "shape_classes"] == declared
    source = textwrap.dedent(inspect.getsource(function))
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "call"]
    # (each entry point's one call of its C entry, named call)
    assert len(calls) == 1 and [ast.unparse(a) for a in calls[0].args] == declared


@pytest.mark.parametrize("kw", [
    {}, {"causal": True}, {"causal_bottom_right": True}, {"window": (128, 0)}, {"window": [-1, 64]},
    {"scale": 0.125}, {"layout": "bhsd"}, {"layout": "sbhd"}, {"alignment": "bottom_right", "causal": True},
    {"deterministic": True}, {"alibi": True, "causal": True}, {"dropout_p": 0}, {"bias": "tensor"},
], ids=repr)
def test_call_takes_the_common_calls(readers, kw):
    # The calls that should never pay for attention()'s Python body.
    q, k, v = dense()
    if kw.get("bias") == "tensor":
        kw["bias"] = torch.empty(1, 1, 16, 32, device="meta")
    assert readers.read_call(*call_args(q, k, v, **kw)) is not None


@pytest.mark.parametrize("grad_mode", [True, False])
def test_call_decides_gradients_as_autograd_does(readers, grad_mode):
    # training where the grad mode is on and an input that takes a gradient wants one (as
    # attention()'s Python body decides), bias_grad where bias wants one too.
    # Each input: 0 wants no gradient, 1 wants one, 2 (bias, sink) not given.
    for wanted in itertools.product((0, 1), (0, 1), (0, 1), (0, 1, 2), (0, 1, 2)):
        q, k, v = dense()
        tensors = [q, k, v, torch.empty(1, 1, 16, 32, device="meta"), torch.empty(4, device="meta")]
        tensors = [None if w == 2 else t.requires_grad_(w == 1) for t, w in zip(tensors, wanted)]
        with torch.set_grad_enabled(grad_mode):
            training = grad_mode and 1 in wanted
            assert readers.dense_grads(*tensors) == (training, training and wanted[3] == 1), wanted


def test_call_hands_back_what_it_does_not_run(lib):
    q, k, v = dense(device="cpu")
    assert lib.call(*call_args(q, k, v)) is NotImplemented  # not CUDA
    assert lib.call(*call_args(*dense())) is NotImplemented  # meta
    assert lib.call(*call_args(q, "k", v)) is NotImplemented
    assert lib.call(*call_args(q, k, v, dropout_p=0.1)) is NotImplemented
    with pytest.raises(TypeError, match=r"18 positional arguments \(3 given\)"):
        lib.call(q, k, v)


def test_attention_reports_through_its_python_body_with_the_c_entry_published(lib, monkeypatch):
    # With the C entry in place, a call it hands back still gets the body's errors.
    monkeypatch.setattr(_native, "CALL", lib.call)
    q, k, v = dense(device="cpu")
    with pytest.raises(fastattn.InvalidArgumentError, match="fastattn runs on CUDA tensors"):
        fastattn.torch.attention(q, k, v, causal=True)
    q, k, v = dense()  # meta: past the device check, to the options'
    with pytest.raises(fastattn.InvalidArgumentError, match="causal_bottom_right"):
        fastattn.torch.attention(q, k, v, causal=True, causal_bottom_right=True)
    with pytest.raises(fastattn.InvalidArgumentError, match="window"):
        fastattn.torch.attention(q, k, v, window=(-2, 0))


def test_a_bad_layout_is_named(lib):
    q, k, v = dense()
    with pytest.raises(ValueError, match=r"layout='bsh'"):
        torch.ops.fastattn.native_attention_forward(q, k, v, None, None, None, None, None,
                                                    *options()._replace(layout="bsh"))


@pytest.mark.parametrize("dynamic", (False, True), ids=("static", "dynamic"))
def test_torch_compile_traces_the_native_op_without_a_graph_break(lib, dynamic):
    # fullgraph=True fails on any graph break; the backend records the graph's ops.
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def block(q, k, v):
        return torch.ops.fastattn.native_attention_forward(q, k, v, None, None, None, None, None,
                                                           *options())[0] * 2

    torch._dynamo.reset()
    out = torch.compile(block, backend=backend, fullgraph=True, dynamic=dynamic)(*dense())
    assert out.shape == (2, 16, 4, 16)
    assert any("native_attention_forward" in s for s in seen), seen


@pytest.mark.parametrize("training", (False, True), ids=("inference", "training"))
def test_aot_autograd_traces_forward_and_backward_with_dynamic_shapes(lib, training):
    # What inductor sees: AOTAutograd runs the Autograd kernel (the C++ Function) and the
    # Meta kernels on fake tensors whose sequence lengths are symbols (sizes() would
    # throw there); two lengths through one compiled function.
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = []

    def record(gm, example_inputs):
        graphs.append(" ".join(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return make_boxed_func(gm)

    def block(q, k, v):
        return torch.ops.fastattn.native_attention_forward(q, k, v, None, None, None, None, None,
                                                           *options(training=training))[0].float().sum()

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True,
                             dynamic=True)
    for s in (16, 24):
        q, k, v = (torch.empty(2, s, h, 8, device="meta", dtype=torch.bfloat16, requires_grad=training)
                   for h in (4, 2, 2))
        out = compiled(q, k, v)
        if training:
            grads = torch.autograd.grad(out, (q, k, v))
            assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert any("native_attention_forward" in g for g in graphs), graphs
    if training:
        assert any("native_attention_backward" in g for g in graphs), graphs


def test_attention_under_torch_compile_records_the_native_op_once_decided(lib, monkeypatch):
    # attention()'s own Python under dynamo: the decided native path is traced as the
    # native op (fullgraph: no graph break on the way), with autograd through it.
    for name in ("DENSE", "VARLEN", "PAGED", "CALL"):
        monkeypatch.setattr(_native, name, getattr(_native, name))  # restored afterwards
    _native._publish_ops()  # C entry included: dynamo must trace past it
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def block(q, k, v):
        return fastattn.torch.attention(q, k, v, causal=True, window=(8, 0)) * 2

    torch._dynamo.reset()
    out = torch.compile(block, backend=backend, fullgraph=True)(*dense(grad=True))
    assert out.shape == (2, 16, 4, 16)
    assert any("native_attention_forward" in s for s in seen), seen
    assert not any("fastattn.attention_forward" in s for s in seen), seen


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    full.pop("FASTATTN_TORCH_OPS_DIR", None)  # the library is built under the test's own cache directory
    # From outside the checkout: `python -c` puts the working directory first on sys.path,
    # and the checkout's unbuilt source package would shadow the installed one.
    return subprocess.run([sys.executable, "-W", "always::RuntimeWarning", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, env=full, timeout=300, cwd=tempfile.gettempdir())


DECIDE = """
    import warnings
    from fastattn.torch import _native
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        lib = _native.library()
        _native.library()  # decided once: no second warning
    print("LIB", lib)
    print("STATUS", _native.status())
    for x in w:
        print("WARNING", x.category.__name__, x.message)
"""


def test_auto_mode_never_compiles_at_a_call(tmp_path):
    """A first call must not wait 40-100 s for a compiler: auto mode takes a library built
    ahead of time (fastattn warm) and otherwise the Python path, quietly,
    saying why in fastattn info's status."""
    r = _run(DECIDE, CXX="false", FASTATTN_CACHE_DIR=str(tmp_path), FASTATTN_TORCH_PATH="auto")
    assert r.returncode == 0, r.stderr
    assert "LIB None" in r.stdout and "WARNING" not in r.stdout
    assert "'path': 'python'" in r.stdout and "not built for this torch yet" in r.stdout
    assert "`fastattn warm` builds it" in r.stdout
    assert not (tmp_path / "torch-ops").exists()


@pytest.mark.parametrize("cxx,cause", [
    ("/nonexistent/c++", "no C++ compiler: CXX='/nonexistent/c++' not found"),
    ("false", "compiling ops.cpp"),  # (+ eager.cpp, where it shares ops.cpp's unit: _opslib.units)
])
def test_native_mode_names_the_build_failure(tmp_path, cxx, cause):
    r = _run(DECIDE, CXX=cxx, FASTATTN_CACHE_DIR=str(tmp_path), FASTATTN_TORCH_PATH="native")
    assert r.returncode != 0 and cause in r.stderr


def test_native_mode_refuses_to_fall_back(tmp_path):
    r = _run(DECIDE, CXX="false", FASTATTN_CACHE_DIR=str(tmp_path), FASTATTN_TORCH_PATH="native")
    assert r.returncode != 0
    assert "FASTATTN_TORCH_PATH=native, but the native op library is unavailable" in r.stderr
    assert "compiling ops.cpp" in r.stderr


def test_python_mode_never_builds(tmp_path):
    r = _run(DECIDE, CXX="false", FASTATTN_CACHE_DIR=str(tmp_path), FASTATTN_TORCH_PATH="python")
    assert r.returncode == 0, r.stderr
    assert "LIB None" in r.stdout and "WARNING" not in r.stdout
    assert "FASTATTN_TORCH_PATH=python" in r.stdout
    assert not (tmp_path / "torch-ops").exists()


def test_the_build_directory_can_be_set(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTATTN_TORCH_OPS_DIR", str(tmp_path / "ops"))
    assert _native.library_path().parent.parent == tmp_path / "ops"
    monkeypatch.delenv("FASTATTN_TORCH_OPS_DIR")
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "cache"))
    assert _native.library_path().parent.parent == tmp_path / "cache" / "torch-ops"


@pytest.mark.parametrize("value", ["fast", "1", "Native!"])
def test_a_bad_mode_is_named(monkeypatch, value):
    monkeypatch.setenv(_native.ENV, value)
    with pytest.raises(fastattn.InvalidArgumentError, match=f"FASTATTN_TORCH_PATH={value!r}: must be one of"):
        _native.mode()


def test_the_build_tag_names_what_the_library_depends_on():
    tag = _native.tag()
    assert f"torch{torch.__version__}" in tag and f"fastattn{fastattn.__version__}" in tag
    assert f"cxx11abi{int(torch._C._GLIBCXX_USE_CXX11_ABI)}" in tag
    assert f"py{sys.version_info.major}{sys.version_info.minor}" in tag


def test_a_built_library_is_reused_not_rebuilt(lib, op_library, monkeypatch):
    # The op_library fixture built it (`fastattn warm`, into its own directory): build()
    # there finds it (a compiler that fails proves nothing was compiled).
    from pathlib import Path

    root = Path(op_library[2])
    monkeypatch.setenv("CXX", "false")
    assert _native.build(root) == _native.library_path(root) and _native.library_path(root).exists()


@pytest.mark.parametrize("code", range(1, 9))
def test_a_failed_execute_raises_the_python_paths_exception(lib, code):
    # ops.cpp's run() raises through fastattn.errors' one code table: the same class (and
    # message) as _core raises for the same status, through pybind11 and the dispatcher.
    from fastattn import errors

    want = errors.error_for_code(code, "the core's message")
    with pytest.raises(errors.FastAttnError) as info:
        lib.raise_status(code, "the core's message")
    assert type(info.value) is type(want) and str(info.value) == str(want)


def test_the_op_librarys_compile_line_makes_a_returned_temporary_an_error(tmp_path):
    # What sdpa.cpp had before review (a const reference to findSchemaOrThrow's temporary:
    # null at run time): the warning that is a bug fails the build; torch's headers are
    # system headers, whose own warnings stay theirs.
    from pathlib import Path

    source = tmp_path / "bad.cpp"
    source.write_text("#include <string>\nconst std::string &name() { return std::string(\"x\"); }\n")
    cmd = _native.compile_command(source, tmp_path / "bad.o", "bad", tmp_path)
    assert any(a.startswith("-isystem") for a in cmd) and "-w" not in cmd
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "error" in r.stderr and "temporar" in r.stderr, r.stderr
    source.write_text("#include <string>\nstd::string name() { return std::string(\"x\"); }\n")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and Path(tmp_path / "bad.o").exists(), r.stderr
