"""fastattn.torch.attention_varlen: packed variable-length sequences (FlashAttention's
varlen layout), forward and backward.

The sequences of a batch one after another, (tokens, heads, dim), with cumulative
lengths. cuDNN's graph fixes the number of sequences and the longest length, so a plan
is keyed by those (the longest rounded up to a power of two: batches of varying lengths
share plans, and the persistent cache keeps each one), never by the token count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch

from ..config import AttentionConfig
from ..errors import InvalidArgumentError
from . import _autograd, _classes, _native, _options
from .. import _fields
from ._plans import DTYPES, Cached, bottom_right, check_qkv_tensors, plans, raw_stream, remember, workspace
from ._plans import options as check_options


# attention_varlen()'s scalar options (_options.OPS["varlen"]; max_q and max_kv are the
# plan's longest sequences, max_seqlen_*'s buckets): part of the plan key as they are,
# and the custom ops' arguments after the tensors, in this order.
VarlenOptions = _options.named_tuple("varlen", "VarlenOptions")


_new = tuple.__new__  # VarlenOptions(...) without a NamedTuple's Python __new__ (see _dense)


def bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


MIN_TRAINING_Q = _options.VARLEN_MIN_TRAINING_Q  # (why: _options)


def plan_for(q, k, v, batch: int, options: VarlenOptions) -> Cached:
    key = ("varlen", q.shape[1:], k.shape[1:], v.shape[1:], q.dtype, k.dtype, v.dtype, q.get_device(),
           k.get_device(), v.get_device(), batch, options)
    hit = plans.get(key)
    if hit is not None:
        return hit
    return remember(key, config_for(q, k, v, batch, options), q, k, v, None)


def config_for(q, k, v, batch: int, options: VarlenOptions) -> AttentionConfig:
    """The call's AttentionConfig: a miss's (plan_for) and a trace's (the forward op's
    fake kernel), so that a traced call refuses what an eager one does."""
    (_, hq, dqk), (_, hkv, _), (_, _, dv) = q.shape, k.shape, v.shape
    return AttentionConfig(batch=batch, heads_q=hq, heads_kv=hkv, head_dim_qk=dqk, head_dim_v=dv, dtype=DTYPES[q.dtype],
                           layout="bshd", padding=True, ragged=True, **_options.config_fields(options))


def _run_args(cu_q, cu_kv, rng) -> dict[str, int]:
    """The launch's cumulative lengths (the plan derives cuDNN's lengths and offsets
    from them in its own kernel, csrc/ragged.h) and dropout's seed and offset."""
    ptrs = {"cu_seqlens_q": cu_q.data_ptr(), "cu_seqlens_kv": cu_kv.data_ptr()}
    if rng is not None:  # Philox's seed at element 0, its offset at element 2 (see _dense)
        ptrs["seed"], ptrs["offset"] = rng.data_ptr(), rng.data_ptr() + 16
    return ptrs


def forward_impl(q, k, v, cu_q, cu_kv, rng, options: VarlenOptions):
    """(o, stats); stats is empty when not training."""
    training = options.training
    c = plan_for(q, k, v, cu_q.shape[0] - 1, options)
    o = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    stats = q.new_empty((q.shape[0], q.shape[1]) if training else (0,), dtype=torch.float32)
    stream = raw_stream(c.device)
    ws = workspace(q, c.forward_workspace, c.device, stream)
    c.plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr() if training else 0,
                   ws.data_ptr() if ws is not None else 0, stream, **_run_args(cu_q, cu_kv, rng))
    return o, stats


def backward_impl(d_o, o, stats, q, k, v, cu_q, cu_kv, rng, options: VarlenOptions):
    """(d_q, d_k, d_v); options.training is True."""
    d_o = d_o.contiguous()  # the plan reads d_o at o's (packed) strides
    c = plan_for(q, k, v, cu_q.shape[0] - 1, options)
    d_q, d_k, d_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    stream = raw_stream(c.device)
    ws = workspace(q, c.backward_workspace, c.device, stream)
    c.plan.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(),
                    d_q.data_ptr(), d_k.data_ptr(), d_v.data_ptr(), ws.data_ptr() if ws is not None else 0,
                    stream, **_run_args(cu_q, cu_kv, rng))
    return d_q, d_k, d_v


# -- the custom ops: tensors, then VarlenOptions' fields in order (schemas from _options) ------

FORWARD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_kv, Tensor? rng, {_options.schema('varlen')})"
                  " -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor d_o, Tensor o, Tensor stats, Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_kv, "
                   f"Tensor? rng, {_options.schema('varlen')}) -> (Tensor, Tensor, Tensor)")


def _forward(q, k, v, cu_q, cu_kv, rng, *options):
    return forward_impl(q, k, v, cu_q, cu_kv, rng, VarlenOptions(*options))


forward_op = torch.library.custom_op("fastattn::varlen_forward", _forward, mutates_args=(), schema=FORWARD_SCHEMA)


@forward_op.register_fake
def _(q, k, v, cu_q, cu_kv, rng, *options):
    _check_varlen(q, k, v, cu_q, cu_kv)  # a trace refuses what eager does
    config_for(q, k, v, cu_q.shape[0] - 1, VarlenOptions(*options))
    training = VarlenOptions(*options).training
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[2]),
            q.new_empty((q.shape[0], q.shape[1]) if training else (0,), dtype=torch.float32))


def _backward(d_o, o, stats, q, k, v, cu_q, cu_kv, rng, *options):
    return backward_impl(d_o, o, stats, q, k, v, cu_q, cu_kv, rng, VarlenOptions(*options))


backward_op = torch.library.custom_op("fastattn::varlen_backward", _backward, mutates_args=(), schema=BACKWARD_SCHEMA)


@backward_op.register_fake
def _(d_o, o, stats, q, k, v, cu_q, cu_kv, rng, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# -- autograd: gradients for (q, k, v, cu_q, cu_kv, rng) ---------------------------------------

def _grads(d_o, o, stats, tensors, options: VarlenOptions):
    return (*backward_impl(d_o, o, stats, *tensors, options), None, None, None)


def _grads_op(d_o, o, stats, tensors, options: VarlenOptions):
    return (*backward_op(d_o, o, stats, *tensors, *options), None, None, None)


RULE = _autograd.Rule(forward_impl, _grads, _grads_op, VarlenOptions)
_native.PLAN_FOR["varlen"] = lambda q, k, v, batch, options: plan_for(
    q, k, v, batch, VarlenOptions(*options))  # the op library's misses
N_TENSORS = 6  # q, k, v, cu_q, cu_kv, rng
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


# The result's type follows return_lse (for type checkers).
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, *, causal: bool = ...,
                     causal_bottom_right: bool = ..., window: tuple[int, int] | None = ...,
                     scale: float | None = ..., deterministic: bool = ..., alignment: str = ...,
                     alibi: bool = ..., dropout_p: float = ..., return_lse: Literal[False] = ...,
                     softcap: float = ..., shape_classes: str | Sequence[int] | None = ...) -> torch.Tensor: ...
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, *, causal: bool = ...,
                     causal_bottom_right: bool = ..., window: tuple[int, int] | None = ...,
                     scale: float | None = ..., deterministic: bool = ..., alignment: str = ...,
                     alibi: bool = ..., dropout_p: float = ..., return_lse: Literal[True],
                     softcap: float = ..., shape_classes: str | Sequence[int] | None = ...) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, *, causal: bool = ...,
                     causal_bottom_right: bool = ..., window: tuple[int, int] | None = ...,
                     scale: float | None = ..., deterministic: bool = ..., alignment: str = ...,
                     alibi: bool = ..., dropout_p: float = ..., return_lse: bool = ...,
                     softcap: float = ..., shape_classes: str | Sequence[int] | None = ...) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def _as_int(n):
    """A 0-d integer tensor (what transformers and FlashAttention's callers hand over) as
    its int: one read of its value, a synchronization where it is on the GPU. Anything
    else is left to the check that follows."""
    if isinstance(n, torch.Tensor) and n.dim() == 0 and not n.is_floating_point() and n.dtype != torch.bool:
        return int(n)
    return n


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, *, causal: bool = False,
                     causal_bottom_right: bool = False, window: tuple[int, int] | None = None,
                     scale: float | None = None, deterministic: bool = False, alignment: str = "top_left",
                     alibi: bool = False, dropout_p: float = 0.0, return_lse: bool = False, softcap: float = 0.0,
                     shape_classes: str | Sequence[int] | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences (FlashAttention's varlen layout),
    with autograd; cuDNN's THD kernels, one plan per batch size and length bucket.

    q: (total_q, heads_q, head_dim_qk), k: (total_kv, heads_kv, head_dim_qk), v:
      (total_kv, heads_kv, head_dim_v): each batch's sequences one after another,
      contiguous, float16 or bfloat16, on one CUDA device.
    cu_seqlens_q, cu_seqlens_kv: int32 (batch + 1,): 0, then cumulative lengths (the
      sequences' starts in q and k); the last is at most total_q / total_kv.
    max_seqlen_q, max_seqlen_kv: at least the longest sequence (not checked: that
      would synchronize). Plans are built for them rounded up to a power of two. A 0-d
      integer tensor is taken too (its value is read: a synchronization on a GPU).
    causal, causal_bottom_right, window, scale, deterministic, alignment, alibi,
      dropout_p: as attention(); the masks apply within each sequence, and the
      bottom-right diagonal is each sequence's own (shift = its kv length - its q
      length: FlashAttention's varlen convention). cuDNN takes ALiBi and dropout with a
      top-left diagonal only (NotSupportedError names its reason otherwise). Returns o:
      (total_q, heads_q, head_dim_v).
    return_lse: also return each row's log-sum-exp (natural log), float32 (heads_q,
      total_q), FlashAttention's varlen softmax_lse, without a gradient: returns (o, lse).
      It makes the call a training one (see attention()).
    softcap: logit soft-capping, as attention()'s (0.0: none).
    shape_classes: as attention()'s (None: FASTATTN_SHAPE_CLASSES). Plans are keyed by
      batch size and max lengths, never by token counts; with classes (eager calls), a
      max length inside a class takes the class's bound instead of its power of two, so
      that one plan serves the class (the native op too; the C entry is skipped).

    Raises InvalidArgumentError for bad inputs, NotSupportedError when cuDNN refuses.
    """
    # Classes wanted (SETTING OFF is falsy: then the hot path is as it was). A choice given
    # is parsed first, so that a bad one is refused whatever the tensors (meta, traced, CPU).
    if shape_classes is None:
        classes = _classes.SETTING
    else:
        shape_classes = _classes.sc.parse(shape_classes, "shape_classes")
        classes = shape_classes.__class__ is str or shape_classes.ranges != ()
    if not dynamo_compiling():  # (dynamo traces the body below instead)
        call = _native.CALL_VARLEN
        if call is not None and not classes:
            # The native path's C entry (eager.cpp's call_varlen): it makes this body's
            # checks and takes the call when they pass and no value needs converting;
            # NotImplemented hands the call to the body, which checks and reports.
            o = call(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, causal, causal_bottom_right,
                     window, scale, deterministic, alignment, alibi, dropout_p, return_lse, softcap)
            if o is not NotImplemented:
                return o
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv)
    left, right, scale = check_options(causal, causal_bottom_right, window, scale, deterministic, alibi)
    if dropout_p:
        _fields.check("probability", "dropout_p", dropout_p)
    if max_seqlen_q.__class__ is not int or max_seqlen_kv.__class__ is not int:
        max_seqlen_q, max_seqlen_kv = _as_int(max_seqlen_q), _as_int(max_seqlen_kv)
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < 2**31:  # the ops' int is int64; cuDNN's int32
            raise InvalidArgumentError(f"{name}={n!r}: must be an int >= 1 and < 2**31")
    br = bottom_right(alignment, causal_bottom_right)
    if return_lse.__class__ is not bool:
        _fields.check("bool", "return_lse", return_lse)
    if softcap.__class__ is not float or softcap != 0.0:
        softcap = _options.positive_or_zero("softcap", softcap)
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    training = grads or bool(return_lse)
    max_q, max_kv = bucket(max_seqlen_q), bucket(max_seqlen_kv)
    if classes and not compiling() and q.is_cuda:  # (traces keep the power-of-two buckets)
        c = _classes.resolve(shape_classes, q.get_device(), training)
        max_q, max_kv = c.upper(max_seqlen_q) or max_q, c.upper(max_seqlen_kv) or max_kv
    if training and max_q < MIN_TRAINING_Q:
        max_q = MIN_TRAINING_Q
    options = _new(VarlenOptions, (max_q, max_kv, bool(causal or causal_bottom_right),
                                   br, left, right, scale, bool(deterministic), training, bool(alibi),
                                   float(dropout_p), softcap))
    # Philox's seed and offset for dropout, drawn from PyTorch's generator (see attention()).
    rng = torch.randint(0, 2**62, (4,), device=q.device, dtype=torch.int64) if dropout_p else None
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_kv, rng)
    if return_lse:
        if plain_eager(q):
            o, stats = (EagerWithStats.apply(RULE, options, *tensors) if grads else forward_impl(*tensors, options))
        else:
            o, stats = forward_op(*tensors, *options)
        return o, stats.t().contiguous()  # (tokens, heads) -> FlashAttention's (heads, total_q)
    native = _native.VARLEN
    if native is not None:  # the native path (see _dense.attention)
        if compiling():
            if native is not _native.UNDECIDED:
                return native[1](*tensors, *options)[0]
        elif q.is_cuda and not functorch_active():
            if native is _native.UNDECIDED:
                _native.decide()
                native = _native.VARLEN
            if native is not None:
                return native[0](*tensors, *options)[0]
    if plain_eager(q):  # skip the custom ops' wrappers (see _autograd)
        if not training:
            return forward_impl(*tensors, options)[0]
        return Eager.apply(RULE, options, *tensors)
    return forward_op(*tensors, *options)[0]


# Module globals: one lookup less per call.
plain_eager, Eager, EagerWithStats = _autograd.plain_eager, _autograd.Eager, _autograd.EagerWithStats
compiling, functorch_active = torch.compiler.is_compiling, _autograd.functorch_active
dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", compiling)  # as _dense
