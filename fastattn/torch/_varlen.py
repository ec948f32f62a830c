"""attention_varlen()'s op (the entry point is in _api): packed variable-length
sequences (FlashAttention's varlen layout), forward and backward.

The sequences of a batch one after another, (tokens, heads, dim), with cumulative
lengths. cuDNN's graph fixes the number of sequences and the longest length, so a plan
is keyed by those (the longest rounded up to a power of two: batches of varying lengths
share plans, and the persistent cache keeps each one), never by the token count.
"""

from __future__ import annotations

import torch

from ..config import AttentionConfig
from ..errors import InvalidArgumentError
from . import _autograd, _dense, _native, _specs
from ._plans import DTYPES, Cached, check_qkv_tensors, plans, raw_stream, remember, tensor_key, workspace


# attention_varlen()'s scalar options (_specs.VARLEN.options; max_q and max_kv are the
# plan's longest sequences, max_seqlen_*'s buckets): part of the plan key as they are,
# and the custom ops' arguments after the tensors, in this order.
VarlenOptions = _specs.named_tuple("varlen", "VarlenOptions")


def bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def plan_for(q, k, v, batch: int, sink, options: VarlenOptions) -> Cached:
    key = ("varlen", q.shape[1:], k.shape[1:], v.shape[1:], q.dtype, k.dtype, v.dtype, q.get_device(),
           k.get_device(), v.get_device(), batch, options, None if sink is None else tensor_key(sink))
    hit = plans.get(key)
    if hit is not None:
        return hit
    return remember(key, config_for(q, k, v, batch, sink, options), q, k, v, None)


def config_for(q, k, v, batch: int, sink, options: VarlenOptions) -> AttentionConfig:
    """The call's AttentionConfig: a miss's (plan_for) and a trace's (the forward op's
    fake kernel), so that a traced call refuses what an eager one does."""
    (_, hq, dqk), (_, hkv, _), (_, _, dv) = q.shape, k.shape, v.shape
    if sink is not None:
        _dense.check_sink(sink, q, hq)
    return AttentionConfig(batch=batch, heads_q=hq, heads_kv=hkv, head_dim_qk=dqk, head_dim_v=dv, dtype=DTYPES[q.dtype],
                           layout="bshd", padding=True, ragged=True, sinks=sink is not None,
                           **_specs.config_fields(options))


def _run_args(cu_q, cu_kv, sink, rng) -> dict[str, int]:
    """The launch's cumulative lengths (the plan derives cuDNN's lengths and offsets
    from them in its own kernel, csrc/ragged.h), the sinks and dropout's seed and offset."""
    ptrs = {"cu_seqlens_q": cu_q.data_ptr(), "cu_seqlens_kv": cu_kv.data_ptr()}
    if sink is not None:
        ptrs["sink"] = sink.data_ptr()
    if rng is not None:  # Philox's seed at element 0, its offset at element 2 (see _dense)
        ptrs["seed"], ptrs["offset"] = rng.data_ptr(), rng.data_ptr() + 16
    return ptrs


def forward_impl(q, k, v, cu_q, cu_kv, sink, rng, options: VarlenOptions):
    """(o, stats); stats is empty when not training."""
    training = options.training
    c = plan_for(q, k, v, cu_q.shape[0] - 1, sink, options)
    o = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    stats = q.new_empty((q.shape[0], q.shape[1]) if training else (0,), dtype=torch.float32)
    stream = raw_stream(c.device)
    ws = workspace(q, c.forward_workspace, c.device, stream)
    c.plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr() if training else 0,
                   ws.data_ptr() if ws is not None else 0, stream, **_run_args(cu_q, cu_kv, sink, rng))
    return o, stats


def backward_impl(d_o, o, stats, q, k, v, cu_q, cu_kv, sink, rng, options: VarlenOptions):
    """(d_q, d_k, d_v, d_sink or None); options.training is True."""
    d_o = d_o.contiguous()  # the plan reads d_o at o's (packed) strides
    c = plan_for(q, k, v, cu_q.shape[0] - 1, sink, options)
    d_q, d_k, d_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    d_sink = torch.empty_like(sink) if sink is not None else None
    stream = raw_stream(c.device)
    ws = workspace(q, c.backward_workspace, c.device, stream)
    ptrs = _run_args(cu_q, cu_kv, sink, rng)
    if d_sink is not None:
        ptrs["d_sink"] = d_sink.data_ptr()
    c.plan.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(),
                    d_q.data_ptr(), d_k.data_ptr(), d_v.data_ptr(), ws.data_ptr() if ws is not None else 0,
                    stream, **ptrs)
    return d_q, d_k, d_v, d_sink


# -- the custom ops: tensors, then VarlenOptions' fields in order (schemas from _specs) --------

FORWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_kv, Tensor? sink, Tensor? rng, "
                  f"{_specs.options_schema('varlen')}) -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor d_o, Tensor o, Tensor stats, Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_kv, "
                   f"Tensor? sink, Tensor? rng, {_specs.options_schema('varlen')}) -> (Tensor, Tensor, Tensor, Tensor)")


def _forward(q, k, v, cu_q, cu_kv, sink, rng, *options):
    return forward_impl(q, k, v, cu_q, cu_kv, sink, rng, VarlenOptions(*options))


forward_op = torch.library.custom_op("fastattn::varlen_forward", _forward, mutates_args=(), schema=FORWARD_SCHEMA)


@forward_op.register_fake
def _(q, k, v, cu_q, cu_kv, sink, rng, *options):
    _check_varlen(q, k, v, cu_q, cu_kv)  # a trace refuses what eager does
    config_for(q, k, v, cu_q.shape[0] - 1, sink, VarlenOptions(*options))
    training = VarlenOptions(*options).training
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[2]),
            q.new_empty((q.shape[0], q.shape[1]) if training else (0,), dtype=torch.float32))


def _backward(d_o, o, stats, q, k, v, cu_q, cu_kv, sink, rng, *options):
    """(d_q, d_k, d_v, d_sink); d_sink is empty without sinks (a custom op returns tensors)."""
    d_q, d_k, d_v, d_sink = backward_impl(d_o, o, stats, q, k, v, cu_q, cu_kv, sink, rng, VarlenOptions(*options))
    return d_q, d_k, d_v, d_sink if d_sink is not None else q.new_empty(0, dtype=torch.float32)


backward_op = torch.library.custom_op("fastattn::varlen_backward", _backward, mutates_args=(), schema=BACKWARD_SCHEMA)


@backward_op.register_fake
def _(d_o, o, stats, q, k, v, cu_q, cu_kv, sink, rng, *options):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(sink) if sink is not None else q.new_empty(0, dtype=torch.float32))


# -- autograd: gradients for (q, k, v, cu_q, cu_kv, sink, rng) ---------------------------------

def _grads(d_o, o, stats, tensors, options: VarlenOptions):
    d_q, d_k, d_v, d_sink = backward_impl(d_o, o, stats, *tensors, options)
    return d_q, d_k, d_v, None, None, d_sink, None


def _grads_op(d_o, o, stats, tensors, options: VarlenOptions):
    d_q, d_k, d_v, d_sink = backward_op(d_o, o, stats, *tensors, *options)
    return d_q, d_k, d_v, None, None, d_sink if tensors[5] is not None else None, None


RULE = _autograd.Rule(forward_impl, _grads, _grads_op, VarlenOptions)
_native.PLAN_FOR["varlen"] = lambda q, k, v, batch, sink, options: plan_for(
    q, k, v, batch, sink, VarlenOptions(*options))  # the op library's misses
N_TENSORS = 7  # q, k, v, cu_q, cu_kv, sink, rng
_autograd.register(forward_op, RULE, N_TENSORS)


def _check_varlen(q, k, v, cu_q, cu_kv) -> None:
    check_qkv_tensors(q, k, v, 3, "(tokens, heads, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            raise InvalidArgumentError(f"{name} must be contiguous (tokens, heads, head_dim): call .contiguous()")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[1] < 1 or t.shape[2] < 1:
            raise InvalidArgumentError(f"{name} has shape {tuple(t.shape)}: heads and head_dim must be at least 1")
    if not (q.device == k.device == v.device) or not (q.dtype == k.dtype == v.dtype):
        raise InvalidArgumentError("q, k, v must share one device and one dtype")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1] or k.shape[2] != q.shape[2]:
        raise InvalidArgumentError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                                   "(k and v: the same tokens and heads, dividing q's heads; k: q's head dim)")
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < 2:
            raise InvalidArgumentError(f"{name}: expected an int32 tensor of batch + 1 cumulative lengths, got "
                                       f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if not t.is_contiguous():  # as FlashAttention: the plan's index kernel reads it as an array
            raise InvalidArgumentError(f"{name} must be contiguous (strides {t.stride()}): call .contiguous()")
        if t.device != q.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, q on {q.device}")
    if cu_q.shape != cu_kv.shape:
        raise InvalidArgumentError(f"cu_seqlens_q has {cu_q.shape[0]} entries, cu_seqlens_kv {cu_kv.shape[0]}")
    for name, t, h, d in (("q", q, q.shape[1], q.shape[2]), ("k", k, k.shape[1], k.shape[2]),
                          ("v", v, v.shape[1], v.shape[2])):
        if t.shape[0] * h * d >= 2**31:
            raise InvalidArgumentError(f"{name} holds {t.shape[0] * h * d} elements: cuDNN's offsets are int32")
