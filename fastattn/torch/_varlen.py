"""attention_varlen()'s op (the entry point is in _api): packed variable-length
sequences (FlashAttention's varlen layout), forward and backward.

The sequences of a batch one after another, (tokens, heads, dim), with cumulative
lengths. cuDNN's graph fixes the number of sequences and the longest length, so a plan
is keyed by those (the longest rounded up to a power of two: batches of varying lengths
share plans, and the persistent cache keeps each one), never by the token count.

What a call is, is _specs.VARLEN; its execution, custom ops (fastattn::varlen_forward,
fastattn::varlen_backward), fake kernels and autograd are made from it
(_executor.install). This module keeps the plan lookup and the checks.
"""

from __future__ import annotations

import sys

import torch

from ..config import AttentionConfig
from ..errors import InvalidArgumentError
from . import _dense, _executor, _native, _specs
from ._executor import alert_not_deterministic, deterministic_algorithms  # noqa: F401 (the backward's, as below)
# (raw_stream and workspace: the executor's, which runs in this module's namespace)
from ._plans import CLOCK, DTYPES, CachedPlan, check_qkv_tensors, plans, raw_stream, remember, tensor_key, workspace  # noqa: F401

SPEC = _specs.VARLEN
# attention_varlen()'s scalar options (SPEC.options; max_q and max_kv are the plan's
# longest sequences, max_seqlen_*'s buckets): part of the plan key as they are, and the
# custom ops' arguments after the tensors, in this order.
VarlenOptions = _specs.named_tuple("varlen", "VarlenOptions")


def bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def plan_for(q, k, v, cu_q, cu_kv, sink, rng, o, options: VarlenOptions) -> CachedPlan:
    """The plan for these tensors (the executor's lookup): keyed by the batch size, not
    by the token counts."""
    return plan(q, k, v, cu_q.shape[0] - 1, sink, options)


def plan(q, k, v, batch: int, sink, options: VarlenOptions) -> CachedPlan:
    key = ("varlen", q.shape[1:], k.shape[1:], v.shape[1:], q.dtype, k.dtype, v.dtype, q.get_device(),
           k.get_device(), v.get_device(), batch, options, None if sink is None else tensor_key(sink))
    hit = plans.get(key)
    if hit is not None:
        hit.used = CLOCK[0]
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


def check_traced(q, k, v, cu_q, cu_kv, sink, rng, options: VarlenOptions) -> None:
    """The forward op's fake kernel's checks: attention_varlen()'s and a miss's."""
    _check_varlen(q, k, v, cu_q, cu_kv)
    config_for(q, k, v, cu_q.shape[0] - 1, sink, options)


# The work, the custom ops (with fake kernels and autograd): made from SPEC. The plan reads
# cu_q and cu_kv itself: it derives cuDNN's lengths and offsets from them in its own kernel
# (csrc/ragged.h).
forward_impl, backward_impl, forward_op, backward_op = _executor.install(SPEC, sys.modules[__name__], VarlenOptions)


def native_plan_for(q, k, v, cu_q, cu_kv, sink, rng, o, options: VarlenOptions) -> CachedPlan:
    """The op library's misses: plan_for, with the cumulative lengths checked as
    attention_varlen() checks them (the plan's index kernel reads them as int32 arrays of
    batch + 1 on q's device). Its table's key holds them whole, so every hit is a call
    checked here; the Python path's callers check them first (attention_varlen, the fake
    kernel)."""
    _check_cumulative(q, cu_q, cu_kv)
    return plan_for(q, k, v, cu_q, cu_kv, sink, rng, o, options)


_native.PLAN_FOR[SPEC.name] = native_plan_for, VarlenOptions


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
    _check_cumulative(q, cu_q, cu_kv)
    for name, t, h, d in (("q", q, q.shape[1], q.shape[2]), ("k", k, k.shape[1], k.shape[2]),
                          ("v", v, v.shape[1], v.shape[2])):
        if t.shape[0] * h * d >= 2**31:
            raise InvalidArgumentError(f"{name} holds {t.shape[0] * h * d} elements: cuDNN's offsets are int32")


def _check_cumulative(q, cu_q, cu_kv) -> None:
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
