"""attention()'s op (the entry point is in _api): dense (batch, head, seq, dim) tensors in
any of three layouts, with padding masks, ALiBi, a bias, dropout and sinks; forward and backward.

What a call is, its tensors, slots, outputs and options, is _specs.DENSE; its execution,
the custom ops fastattn::attention_forward and fastattn::attention_backward (with fake
kernels, so that torch.compile(fullgraph=True) traces them without a graph break) and
their autograd are made from it (_executor.install). This module keeps what is the op's
own: its plan lookup (plan_for) and its checks (config_for). The SDPA mode's kernels run
this op too (_sdpa_mode).
"""

from __future__ import annotations

import sys

import torch

from ..config import AttentionConfig, bias_name
from ..errors import InvalidArgumentError
from . import _executor, _native, _specs
from ._executor import alert_not_deterministic, deterministic_algorithms  # noqa: F401 (the backward's, as below)
from ._plans import check_shapes
# (raw_stream and workspace: the executor's, which runs in this module's namespace)
from ._plans import (AXES, CLOCK, DTYPES, CachedPlan, check_qkv_tensors, config_shape, plans, raw_stream, remember,  # noqa: F401
                     tensor_key, workspace)

SPEC = _specs.DENSE
# attention()'s scalar options (SPEC.options): part of the plan key as they are, and the
# custom ops' arguments after the tensors, in this order.
DenseOptions = _specs.named_tuple("dense", "DenseOptions")


def plan_for(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, o, options: DenseOptions) -> CachedPlan:
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
        hit.used = CLOCK[0]
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


def check_traced(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, options: DenseOptions) -> None:
    """The forward op's fake kernel's checks: config_for's, as a miss makes them."""
    if options.layout not in AXES:
        raise InvalidArgumentError(f"layout={options.layout!r}: must be one of {tuple(AXES)}")
    config_for(q, k, v, None, seq_len_q, seq_len_kv if seq_len_kv is not None else seq_len_q, bias, sink, options)


# The work, the custom ops (with fake kernels and autograd): made from SPEC.
forward_impl, backward_impl, forward_op, backward_op = _executor.install(SPEC, sys.modules[__name__], DenseOptions)
_native.PLAN_FOR[SPEC.name] = plan_for, DenseOptions  # the op library's misses


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
