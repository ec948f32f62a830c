"""fastattn.torch's package shape, without a GPU: the one autograd definition that the
plain eager path (_executor.Train) and the custom ops share, the custom ops'
schemas against the options' named fields, and the options as plan-key parts.

The eager path and the ops run here on CPU tensors against a recording plan that
marks each output it is handed (first byte: which output it is), so that a gradient
landing on the wrong input, or the two paths disagreeing, shows."""

import ctypes

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastattn.torch import _api, _dense, _executor, _native, _paged, _plans, _varlen  # noqa: E402
from helpers.torch import take_python_path  # noqa: E402

# The first byte each output gets from RecordingPlan.
MARK = {"o": 6, "d_q": 1, "d_k": 2, "d_v": 3, "d_bias": 4, "d_sink": 5}


class RecordingPlan:
    """A plan's interface on host memory: records the keyword pointers each call gives (0:
    none, as Plan.forward reads it) by name and writes MARK's byte at the start of each
    output."""

    forward_workspace_size = backward_workspace_size = 64

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, o, stats, workspace, stream, seq_len_q=0, seq_len_kv=0, **extra):
        self.calls.append(("forward", sorted(n for n, p in extra.items() if p)))
        ctypes.memset(o, MARK["o"], 1)

    def backward(self, q, k, v, o, d_o, stats, d_q, d_k, d_v, workspace, stream, seq_len_q=0, seq_len_kv=0,
                 **extra):
        self.calls.append(("backward", sorted(n for n, p in extra.items() if p)))
        for name, ptr in (("d_q", d_q), ("d_k", d_k), ("d_v", d_v), ("d_bias", extra.get("d_bias")),
                          ("d_sink", extra.get("d_sink"))):
            if ptr:
                ctypes.memset(ptr, MARK[name], 1)


@pytest.fixture
def recording(monkeypatch):
    """Every plan lookup of the dense and varlen modules answers a RecordingPlan; CPU
    tensors need no stream and no capture check."""
    plan = RecordingPlan()
    for module in (_dense, _varlen):
        monkeypatch.setattr(module, "plan_for", lambda q, k, v, *rest: _plans.CachedPlan(
            plan, q, k, v, rest[-1].layout if isinstance(rest[-1], _dense.DenseOptions) else None))
        monkeypatch.setattr(module, "raw_stream", lambda device: 0)
    monkeypatch.setattr(_plans, "capturing", lambda: False)
    monkeypatch.setattr(_plans, "workspaces", {})
    return plan


def first_byte(t):
    return t.detach().contiguous().view(torch.uint8).flatten()[0].item()


def dense_inputs():
    q, k, v = (torch.zeros(2, 16, h, 8, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    bias = torch.zeros(1, 4, 16, 16, dtype=torch.bfloat16, requires_grad=True)
    sink = torch.zeros(4, requires_grad=True)
    return q, k, v, bias, sink


def dense_options(training=True, bias_grad=True):
    return _dense.DenseOptions(layout="bshd", causal=True, bottom_right=False, window_left=-1, window_right=-1,
                               scale=0.0, deterministic=False, alibi=False, training=training, dropout=0.0,
                               bias_grad=bias_grad)


def test_the_eager_function_and_the_custom_ops_give_the_same_gradients_in_the_same_places(recording):
    q, k, v, bias, sink = dense_inputs()
    options = dense_options()
    leaves = (q, k, v, bias, sink)
    o_eager = _executor.Train.apply(_dense, options, False, q, k, v, None, None, bias, sink, None)
    grads_eager = torch.autograd.grad(o_eager.sum(), leaves)
    eager_calls = list(recording.calls)
    recording.calls.clear()
    o_op = _dense.forward_op(q, k, v, None, None, bias, sink, None, *options)[0]
    grads_op = torch.autograd.grad(o_op.sum(), leaves)
    assert recording.calls == eager_calls == [("forward", ["bias", "sink"]),
                                              ("backward", ["bias", "d_bias", "d_sink", "sink"])]
    for o in (o_eager, o_op):
        assert o.shape == q.shape and first_byte(o) == MARK["o"]
    for grads in (grads_eager, grads_op):
        assert [first_byte(g) for g in grads] == [MARK[n] for n in ("d_q", "d_k", "d_v", "d_bias", "d_sink")]
        assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in leaves]


def test_no_bias_gradient_unless_asked(recording):
    q, k, v, bias, sink = dense_inputs()
    bias = bias.detach()
    options = dense_options(bias_grad=False)
    for o in (_executor.Train.apply(_dense, options, False, q, k, v, None, None, bias, None, None),
              _dense.forward_op(q, k, v, None, None, bias, None, None, *options)[0]):
        recording.calls.clear()
        grads = torch.autograd.grad(o.sum(), (q, k, v))
        assert [first_byte(g) for g in grads] == [MARK["d_q"], MARK["d_k"], MARK["d_v"]]
        assert recording.calls == [("backward", ["bias"])]  # no d_bias pointer handed to the plan


def test_varlen_shares_the_rule(recording):
    q, k, v = (torch.zeros(40, h, 8, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 10, 40], dtype=torch.int32)
    options = _varlen.VarlenOptions(max_q=32, max_kv=32, causal=True, bottom_right=False, window_left=-1,
                                    window_right=-1, scale=0.0, deterministic=False, training=True, alibi=False,
                                    dropout=0.0)
    for o in (_executor.Train.apply(_varlen, options, False, q, k, v, cu, cu, None, None),
              _varlen.forward_op(q, k, v, cu, cu, None, None, *options)[0]):
        grads = torch.autograd.grad(o.sum(), (q, k, v))
        assert first_byte(o) == MARK["o"]
        assert [first_byte(g) for g in grads] == [MARK["d_q"], MARK["d_k"], MARK["d_v"]]
    # With sinks: the sink's pointer in both directions, and its gradient where it belongs.
    sink = torch.zeros(4, requires_grad=True)
    for o in (_executor.Train.apply(_varlen, options, False, q, k, v, cu, cu, sink, None),
              _varlen.forward_op(q, k, v, cu, cu, sink, None, *options)[0]):
        recording.calls.clear()
        grads = torch.autograd.grad(o.sum(), (q, k, v, sink))
        assert [first_byte(g) for g in grads] == [MARK[n] for n in ("d_q", "d_k", "d_v", "d_sink")]
        assert grads[3].shape == sink.shape and grads[3].dtype == torch.float32
        assert recording.calls == [("backward", ["cu_seqlens_kv", "cu_seqlens_q", "d_sink", "sink"])]


def test_backward_through_an_inference_call_is_refused(recording):
    q, k, v, _, _ = dense_inputs()
    o = _dense.forward_op(q, k, v, None, None, None, None, None, *dense_options(training=False, bias_grad=False))[0]
    with pytest.raises(RuntimeError, match="backward through a call made without gradients enabled"):
        torch.autograd.grad(o.sum(), (q, k, v))


@pytest.mark.parametrize("op,options,first", [
    (_dense.forward_op, _dense.DenseOptions, 8), (_dense.backward_op, _dense.DenseOptions, 11),
    (_varlen.forward_op, _varlen.VarlenOptions, 7), (_varlen.backward_op, _varlen.VarlenOptions, 10),
    (_paged.forward_op, _paged.PagedOptions, 6),
])
def test_the_ops_take_the_options_fields_after_the_tensors(op, options, first):
    # The eager path and the ops' autograd build options from these positions (Rule,
    # register): a schema and a NamedTuple that drift apart would swap options silently.
    args = op._opoverload._schema.arguments
    assert all("Tensor" in str(a.type) for a in args[:first])  # Tensor or Tensor? (Optional[Tensor])
    assert not any("Tensor" in str(a.type) for a in args[first:])
    assert tuple(a.name for a in args[first:]) == options._fields


def test_the_eager_function_is_the_one_autograd_of_both_entry_points():
    assert _api.Train is _executor.Train
    for module, options in ((_dense, _dense.DenseOptions), (_varlen, _varlen.VarlenOptions),
                            (_paged, _paged.PagedOptions)):
        args = module.forward_op._opoverload._schema.arguments
        assert len(options._fields) + len(module.SPEC.inputs) == len(args)


def _recorded_options(monkeypatch, **kwargs):
    """The options attention() hands the forward op for these keywords."""
    seen = []

    def op(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, *options):
        seen.append(options)
        return q, None

    monkeypatch.setattr(_dense, "forward_op", op)
    q, k, v = (torch.empty(2, 64, h, 64, device="meta", dtype=torch.bfloat16) for h in (8, 2, 2))
    _api.attention(q, k, v, **kwargs)
    return seen[0]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(mask=st.sampled_from(["none", "causal", "bottom_right"]),
       window=st.none() | st.tuples(st.integers(-1, 4096), st.integers(-1, 4096)),
       scale=st.none() | st.floats(1e-3, 10.0), deterministic=st.booleans(), alibi=st.booleans(),
       layout=st.sampled_from(["bshd", "bhsd", "sbhd"]))
def test_options_are_named_fields_equal_and_hashable_as_plan_key_parts(mask, window, scale, deterministic, alibi,
                                                                       layout):
    with pytest.MonkeyPatch.context() as mp:
        kwargs = dict(causal=mask == "causal", causal_bottom_right=mask == "bottom_right", window=window,
                      scale=scale, deterministic=deterministic, alibi=alibi, layout=layout)
        got = _recorded_options(mp, **kwargs)
        again = _recorded_options(mp, **kwargs)
    expected = _dense.DenseOptions(
        layout=layout, causal=mask != "none", bottom_right=mask == "bottom_right",  # a causal mask, its diagonal
        window_left=-1 if window is None else window[0], window_right=-1 if window is None else window[1],
        scale=0.0 if scale is None else scale, deterministic=deterministic, alibi=alibi, training=False, dropout=0.0,
        bias_grad=False)
    options = _dense.DenseOptions(*got)
    assert options == expected and hash(options) == hash(expected)
    assert again == got and hash(again) == hash(got)  # the same call: the same key part
    for field in ("causal", "deterministic", "alibi"):  # any one option changed: another plan
        changed = expected._replace(**{field: not getattr(expected, field)})
        assert changed != options and {changed: 1}.get(options) is None


def test_the_hot_path_builds_options_of_the_named_type(monkeypatch):
    # attention(), attention_varlen() and attention_paged() build their options with
    # tuple.__new__ (cheaper than a NamedTuple's __new__): they must still be the
    # NamedTuple, with its fields readable by name.
    seen = []
    monkeypatch.setattr(_dense, "forward_op", lambda *args: seen.append(args[8:]) or (args[0], None))
    monkeypatch.setattr(_api, "plain_eager", lambda q: False)
    q, k, v = (torch.empty(2, 64, 4, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))
    _api.attention(q, k, v, causal=True, window=(3, 0))
    assert _dense.DenseOptions(*seen[0]).window_left == 3
    captured = []
    monkeypatch.setattr(_dense, "forward_impl", lambda *args: captured.append(args[-1]) or (args[0], None))
    monkeypatch.setattr(_api, "plain_eager", lambda q: True)
    take_python_path(monkeypatch)  # the Python path's eager branch (the native one: test_torch_native)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the eager branch, on meta tensors
    monkeypatch.setattr(_dense, "_check", lambda *a: None)
    _api.attention(q, k, v, causal=True, window=(3, 0))
    options = captured[0]
    assert type(options) is _dense.DenseOptions and options.window_left == 3 and options.causal
    assert options == _dense.DenseOptions(*seen[0])


def test_torch_compile_traces_every_entry_point_without_a_graph_break():
    # Dynamo runs the entry points' own Python (the options' tuple.__new__ included):
    # fullgraph=True fails on anything it cannot trace. Meta tensors: no GPU needed.
    def meta(*shape, dtype=torch.bfloat16, grad=False):
        return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)

    def dense(q, k, v, bias, sinks):
        return _api.attention(q, k, v, causal=True, window=(8, 0), scale=0.5, bias=bias, sinks=sinks,
                                dropout_p=0.1)

    q, k, v = (meta(2, 64, h, 64, grad=True) for h in (8, 2, 2))
    bias, sinks = meta(1, 8, 64, 64, grad=True), meta(8, dtype=torch.float32, grad=True)
    torch.compile(dense, fullgraph=True, backend="aot_eager")(q, k, v, bias, sinks).sum().backward()
    assert q.grad.shape == q.shape and bias.grad.shape == bias.shape and sinks.grad.shape == sinks.shape

    q, k, v = (meta(201, h, 64, grad=True) for h in (8, 2, 2))
    cu = meta(4, dtype=torch.int32)
    o = torch.compile(lambda *a: _api.attention_varlen(*a, 100, 100, causal=True), fullgraph=True,
                      backend="aot_eager")(q, k, v, cu, cu)
    o.sum().backward()
    assert o.shape == (201, 8, 64) and k.grad.shape == k.shape

    q, (k, v) = meta(3, 1, 8, 64), (meta(12, 16, 2, 64) for _ in range(2))
    o = torch.compile(lambda *a: _api.attention_paged(*a, causal_bottom_right=True), fullgraph=True,
                      backend="aot_eager")(q, k, v, meta(3, 4, dtype=torch.int32), meta(3, dtype=torch.int32))
    assert o.shape == (3, 1, 8, 64)
