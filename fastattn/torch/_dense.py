"""attention()'s op (the entry point is in _api): dense (batch, head, seq, dim) tensors in
any of three layouts, with padding masks, ALiBi, a bias, dropout and sinks; forward and backward.

Two custom ops, fastattn::attention_forward and fastattn::attention_backward, with fake
(meta) implementations and the shared autograd rule (_autograd), so that
torch.compile(fullgraph=True) traces them without a graph break; plain eager calls run
the same work under _autograd.Eager.
"""

from __future__ import annotations

import torch

from ..config import AttentionConfig, bias_name
from ..errors import InvalidArgumentError
from . import _autograd, _native, _specs
from ._plans import check_shapes
from ._plans import (AXES, DTYPES, Cached, check_qkv_tensors, config_shape, out_shape, plans, raw_stream,
                     remember, stats_shape, tensor_key, workspace)


# attention()'s scalar options (_specs.DENSE.options): part of the plan key as they are,
# and the custom ops' arguments after the tensors, in this order.
DenseOptions = _specs.named_tuple("dense", "DenseOptions")


def plan_for(q, k, v, o, seq_len_q, seq_len_kv, bias, sink, options: DenseOptions) -> Cached:
    """The plan for these tensors; o=None means the forward's own fresh output. What a
    call costs once its plan exists: one dict lookup on a tuple of shapes, strides and
    options. The key holds everything _check and _check_extras look at, so only a miss
    validates and builds an AttentionConfig. Forward keys leave out o, which the forward
    allocates itself (contiguous in the layout, so its strides follow from the shapes);
    backward keys include the o and d_o they are given."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), None if o is None else o.stride(),
           q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(), v.get_device(), options,
           None if seq_len_q is None else (tensor_key(seq_len_q), tensor_key(seq_len_kv)),
           None if bias is None and sink is None else (tensor_key(bias), tensor_key(sink)))
    hit = plans.get(key)
    if hit is not None:
        return hit
    return remember(key, config_for(q, k, v, o, seq_len_q, seq_len_kv, bias, sink, options), q, k, v, options.layout)


def config_for(q, k, v, o, seq_len_q, seq_len_kv, bias, sink, options: DenseOptions) -> AttentionConfig:
    """The call's AttentionConfig, every check made: a miss's (plan_for), and a trace's
    (the forward op's fake kernel: meta tensors, FakeTensorMode, make_fx, torch.export),
    so that a traced call refuses what an eager one does."""
    layout = options.layout
    _check(q, k, v, layout, seq_len_q, seq_len_kv)
    _check_extras(q, k, layout, bias, sink)
    return AttentionConfig(
        **config_shape(q, k, v, o, layout), dtype=DTYPES[q.dtype], **_specs.config_fields(options),
        padding=seq_len_q is not None, bias="none" if bias is None else _bias_shape(q, bias, layout),
        sinks=sink is not None)


def forward_impl(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, options: DenseOptions):
    """(o, stats); stats is None when not training."""
    c = plan_for(q, k, v, None, seq_len_q, seq_len_kv, bias, sink, options)
    training = options.training
    padded = seq_len_q is not None
    # Rows past a sequence's length are zero, not whatever the allocator held: they
    # flow into the next layer (and its weight gradients) unless the caller masks them.
    if padded:
        o = q.new_zeros(c.out_shape)
    else:
        o = torch.empty_like(q) if c.out_like_q else q.new_empty(c.out_shape)
    stats = q.new_empty(c.stats_shape, dtype=torch.float32) if training else None
    stream = raw_stream(c.device)
    # Workspace from PyTorch's caching allocator, used on this stream only (_plans.workspace).
    ws = workspace(q, c.forward_workspace, c.device, stream)
    if bias is None and sink is None and rng is None:  # the common call: positional only, no keyword dict
        c.plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr() if training else 0,
                       ws.data_ptr() if ws is not None else 0, stream,
                       seq_len_q.data_ptr() if padded else 0, seq_len_kv.data_ptr() if padded else 0)
    else:
        c.plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr() if training else 0,
                       ws.data_ptr() if ws is not None else 0, stream,
                       seq_len_q.data_ptr() if padded else 0, seq_len_kv.data_ptr() if padded else 0,
                       **_extra_pointers(bias, sink, rng))
    return o, stats


def backward_impl(d_o, o, stats, q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, options: DenseOptions):
    """(d_q, d_k, d_v, d_bias or None, d_sink or None); options.training is True."""
    if d_o.stride() != o.stride():
        # The backward graph reads d_o at o's strides (cuDNN's plan is built for them).
        d_o = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device).copy_(d_o)
    c = plan_for(q, k, v, o, seq_len_q, seq_len_kv, bias, sink, options)
    padded = seq_len_q is not None
    d_q, d_k, d_v = (torch.empty_like(t) if like else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                           device=t.device)
                     for t, like in zip((q, k, v), c.grads_like))
    if padded:
        for g in (d_q, d_k, d_v):
            g.zero_()  # padded rows get zero gradients (see forward_impl)
    stream = raw_stream(c.device)
    ws = workspace(q, c.backward_workspace, c.device, stream)
    bias_grad = options.bias_grad
    d_bias = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else None
    d_sink = torch.empty_like(sink) if sink is not None else None
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(), d_q.data_ptr(),
            d_k.data_ptr(), d_v.data_ptr(), ws.data_ptr() if ws is not None else 0, stream,
            seq_len_q.data_ptr() if padded else 0, seq_len_kv.data_ptr() if padded else 0)
    if bias is None and sink is None and rng is None:  # the common call: positional only (see forward_impl)
        c.plan.backward(*args)
    else:
        extras = _extra_pointers(bias, sink, rng)
        if bias_grad:
            extras["d_bias"] = d_bias.data_ptr()
        if sink is not None:
            extras["d_sink"] = d_sink.data_ptr()
        c.plan.backward(*args, **extras)
    return d_q, d_k, d_v, d_bias, d_sink


def _extra_pointers(bias, sink, rng) -> dict[str, int]:
    """The features' tensors as plan.forward / plan.backward keywords. rng holds Philox's
    seed at element 0 and its offset at element 2 (16 bytes on: fastattn wants every
    device pointer 16-byte aligned)."""
    out = {}
    if bias is not None:
        out["bias"] = bias.data_ptr()
    if sink is not None:
        out["sink"] = sink.data_ptr()
    if rng is not None:
        out["seed"], out["offset"] = rng.data_ptr(), rng.data_ptr() + 16
    return out


def _extra_grads_like(q, bias, sink, bias_grad: bool):
    """Buffers for d_bias and d_sink, or empty tensors (a custom op returns tensors)."""
    d_bias = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else q.new_empty(0)
    d_sink = torch.empty_like(sink) if sink is not None else q.new_empty(0, dtype=torch.float32)
    return d_bias, d_sink


# -- the custom ops: tensors, then DenseOptions' fields in order (schemas from _specs) --------

FORWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? seq_len_q, Tensor? seq_len_kv, Tensor? bias, Tensor? sink, "
                  f"Tensor? rng, {_specs.options_schema('dense')}) -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor d_o, Tensor o, Tensor stats, Tensor q, Tensor k, Tensor v, Tensor? seq_len_q, "
                   f"Tensor? seq_len_kv, Tensor? bias, Tensor? sink, Tensor? rng, {_specs.options_schema('dense')}) "
                   "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _forward(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, *options):
    """(o, stats); stats is empty when not training."""
    options = DenseOptions(*options)
    o, stats = forward_impl(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, options)
    return o, stats if stats is not None else _stats_like(q, options.layout, False)


forward_op = torch.library.custom_op("fastattn::attention_forward", _forward, mutates_args=(), schema=FORWARD_SCHEMA)


def _stats_like(q: torch.Tensor, layout: str, training: bool) -> torch.Tensor:
    # Inference writes no stats: an empty tensor keeps the op's signature fixed.
    return q.new_empty(stats_shape(q, layout) if training else [0], dtype=torch.float32)


@forward_op.register_fake
def _(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, *options):
    options = DenseOptions(*options)
    if options.layout in AXES:  # (a layout the body refuses itself is left to it)
        config_for(q, k, v, None, seq_len_q, seq_len_kv if seq_len_kv is not None else seq_len_q, bias, sink,
                   options)  # a trace refuses what eager does
    return q.new_empty(out_shape(q, v, options.layout)), _stats_like(q, options.layout, options.training)


def _backward(d_o, o, stats, q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, *options):
    """(d_q, d_k, d_v, d_bias, d_sink); d_bias and d_sink are empty when not computed."""
    d_q, d_k, d_v, d_bias, d_sink = backward_impl(d_o, o, stats, q, k, v, seq_len_q, seq_len_kv, bias, sink, rng,
                                                  DenseOptions(*options))
    if d_bias is None or d_sink is None:  # a custom op returns tensors
        empty_bias, empty_sink = _extra_grads_like(q, None, None, False)
        d_bias, d_sink = d_bias if d_bias is not None else empty_bias, d_sink if d_sink is not None else empty_sink
    return d_q, d_k, d_v, d_bias, d_sink


backward_op = torch.library.custom_op("fastattn::attention_backward", _backward, mutates_args=(),
                                      schema=BACKWARD_SCHEMA)


@backward_op.register_fake
def _(d_o, o, stats, q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, *options):
    return (torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device),
            torch.empty_strided(k.shape, k.stride(), dtype=k.dtype, device=k.device),
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device),
            *_extra_grads_like(q, bias, sink, DenseOptions(*options).bias_grad))


# -- autograd: gradients for (q, k, v, seq_len_q, seq_len_kv, bias, sink, rng) ----------------

def _grads(d_o, o, stats, tensors, options: DenseOptions):
    d_q, d_k, d_v, d_bias, d_sink = backward_impl(d_o, o, stats, *tensors, options)
    return d_q, d_k, d_v, None, None, d_bias, d_sink, None


def _grads_op(d_o, o, stats, tensors, options: DenseOptions):
    d_q, d_k, d_v, d_bias, d_sink = backward_op(d_o, o, stats, *tensors, *options)
    sink = tensors[6]
    # The op returns empty tensors for gradients it does not compute: autograd wants None.
    return d_q, d_k, d_v, None, None, d_bias if options.bias_grad else None, d_sink if sink is not None else None, None


RULE = _autograd.Rule(forward_impl, _grads, _grads_op, DenseOptions)
_native.PLAN_FOR["dense"] = lambda q, k, v, o, seq_len_q, seq_len_kv, bias, sink, options: plan_for(
    q, k, v, o, seq_len_q, seq_len_kv, bias, sink, DenseOptions(*options))  # the op library's misses
N_TENSORS = 8  # q, k, v, seq_len_q, seq_len_kv, bias, sink, rng
_autograd.register(forward_op, RULE, N_TENSORS)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, seq_len_q=None, seq_len_kv=None) -> None:
    check_qkv_tensors(q, k, v, 4, f"4 dimensions in {layout} order")
    check_shapes(q, k, v, layout, seq_len_q, seq_len_kv)


def _check_tensors(q, k, v, layout: str, seq_len_q, seq_len_kv, bias, sink) -> None:
    """The tensor checks plan_for makes on a miss (_check, _check_extras), for
    attention()'s body under dynamo, which sees fake tensors as plain CUDA ones (those the
    body leaves to plan_for). A check that fails in dynamo's trace of the body makes
    dynamo run the call eagerly, where it fails as eager does (fullgraph=True and
    torch.export name it in dynamo's error). The whole config is checked by the forward
    op's fake kernel (config_for), outside dynamo's trace of Python. A layout the body
    refuses itself is left to it."""
    if layout in AXES:
        _check(q, k, v, layout, seq_len_q, seq_len_kv if seq_len_kv is not None else seq_len_q)
        _check_extras(q, k, layout, bias, sink)


def _bias_shape(q: torch.Tensor, bias: torch.Tensor, layout: str) -> str:
    """The config's name for a (checked) bias's broadcast shape (config.bias_name)."""
    return bias_name(tuple(bias.shape[:3]), tuple(q.shape[a] for a in AXES[layout][:3]))


def _check_extras(q: torch.Tensor, k: torch.Tensor, layout: str, bias, sink) -> None:
    b, h, s_q = (q.shape[a] for a in AXES[layout][:3])
    s_kv = k.shape[AXES[layout][2]]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype != q.dtype or bias.device != q.device:
            raise InvalidArgumentError(f"bias: expected a {q.dtype} tensor on {q.device}, got "
                                       f"{getattr(bias, 'dtype', type(bias).__name__)} on "
                                       f"{getattr(bias, 'device', None)}")
        if (bias.dim() != 4 or bias.shape[0] not in (1, b) or bias.shape[1] not in (1, h)
                or bias.shape[2] not in (1, s_q) or bias.shape[3] != s_kv):
            raise InvalidArgumentError(f"bias has shape {tuple(bias.shape)}: expected (1 or {b}, 1 or {h}, 1 or {s_q}, "
                                       f"{s_kv})")
        if not bias.is_contiguous():
            raise InvalidArgumentError("bias must be contiguous")
    if sink is not None:
        check_sink(sink, q, h)


def check_sink(sink, q: torch.Tensor, heads_q: int) -> None:
    """sinks as attention() and attention_varlen() take them: float32 (heads_q,) on q's device."""
    if not isinstance(sink, torch.Tensor) or sink.dtype != torch.float32 or sink.device != q.device:
        raise InvalidArgumentError(f"sinks: expected a torch.float32 tensor on {q.device}, got "
                                   f"{getattr(sink, 'dtype', type(sink).__name__)} on "
                                   f"{getattr(sink, 'device', None)}")
    if sink.shape != (heads_q,) or not sink.is_contiguous():
        raise InvalidArgumentError(f"sinks has shape {tuple(sink.shape)}: expected ({heads_q},), one logit per query "
                                   "head, contiguous")
