"""fastattn.torch.attention: dense (batch, head, seq, dim) tensors in any of three
layouts, with padding masks, ALiBi, a bias, dropout and sinks; forward and backward.

Two custom ops, fastattn::attention_forward and fastattn::attention_backward, with fake
(meta) implementations and the shared autograd rule (_autograd), so that
torch.compile(fullgraph=True) traces them without a graph break; plain eager calls run
the same work under _autograd.Eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch

from .. import _fields
from .. import shape_classes as _shape_classes
from ..config import AttentionConfig, bias_name
from ..errors import InvalidArgumentError
from . import _autograd, _classes, _native, _options
from ._plans import check_shapes
from ._plans import options as check_options
from ._plans import (AXES, DTYPES, Cached, bottom_right, check_qkv_tensors, config_shape, out_shape, plans, raw_stream,
                     remember, stats_shape, tensor_key, workspace)


# attention()'s scalar options (_options.OPS["dense"]): part of the plan key as they are,
# and the custom ops' arguments after the tensors, in this order.
DenseOptions = _options.named_tuple("dense", "DenseOptions")


# DenseOptions(...) without the Python __new__ a NamedTuple has: tuple.__new__ costs
# less per call, so that named options cost little over a plain tuple.
_new = tuple.__new__


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
        **config_shape(q, k, v, o, layout), dtype=DTYPES[q.dtype], **_options.config_fields(options),
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


# -- the custom ops: tensors, then DenseOptions' fields in order (schemas from _options) ------

FORWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? seq_len_q, Tensor? seq_len_kv, Tensor? bias, Tensor? sink, "
                  f"Tensor? rng, {_options.schema('dense')}) -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor d_o, Tensor o, Tensor stats, Tensor q, Tensor k, Tensor v, Tensor? seq_len_q, "
                   f"Tensor? seq_len_kv, Tensor? bias, Tensor? sink, Tensor? rng, {_options.schema('dense')}) "
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
        if not isinstance(sink, torch.Tensor) or sink.dtype != torch.float32 or sink.device != q.device:
            raise InvalidArgumentError(f"sinks: expected a torch.float32 tensor on {q.device}, got "
                                       f"{getattr(sink, 'dtype', type(sink).__name__)} on "
                                       f"{getattr(sink, 'device', None)}")
        if sink.shape != (h,) or not sink.is_contiguous():
            raise InvalidArgumentError(f"sinks has shape {tuple(sink.shape)}: expected ({h},), one logit per query "
                                       "head, contiguous")


_NO_EXTRAS = (None, None, None)  # bias, sinks, rng


# The result's type follows return_lse (for type checkers).
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              causal_bottom_right: bool = ..., window: tuple[int, int] | None = ..., scale: float | None = ...,
              layout: str = ..., deterministic: bool = ..., seq_lens_q: torch.Tensor | None = ...,
              seq_lens_kv: torch.Tensor | None = ..., alibi: bool = ..., bias: torch.Tensor | None = ...,
              dropout_p: float = ..., sinks: torch.Tensor | None = ..., alignment: str = ...,
              return_lse: Literal[False] = ..., softcap: float = ...,
              shape_classes: str | Sequence[int] | None = ...) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              causal_bottom_right: bool = ..., window: tuple[int, int] | None = ..., scale: float | None = ...,
              layout: str = ..., deterministic: bool = ..., seq_lens_q: torch.Tensor | None = ...,
              seq_lens_kv: torch.Tensor | None = ..., alibi: bool = ..., bias: torch.Tensor | None = ...,
              dropout_p: float = ..., sinks: torch.Tensor | None = ..., alignment: str = ...,
              return_lse: Literal[True], softcap: float = ...,
              shape_classes: str | Sequence[int] | None = ...) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              causal_bottom_right: bool = ..., window: tuple[int, int] | None = ..., scale: float | None = ...,
              layout: str = ..., deterministic: bool = ..., seq_lens_q: torch.Tensor | None = ...,
              seq_lens_kv: torch.Tensor | None = ..., alibi: bool = ..., bias: torch.Tensor | None = ...,
              dropout_p: float = ..., sinks: torch.Tensor | None = ..., alignment: str = ...,
              return_lse: bool = ..., softcap: float = ...,
              shape_classes: str | Sequence[int] | None = ...
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              causal_bottom_right: bool = False, window: tuple[int, int] | None = None, scale: float | None = None,
              layout: str = "bshd", deterministic: bool = False, seq_lens_q: torch.Tensor | None = None,
              seq_lens_kv: torch.Tensor | None = None, alibi: bool = False, bias: torch.Tensor | None = None,
              dropout_p: float = 0.0, sinks: torch.Tensor | None = None, alignment: str = "top_left",
              return_lse: bool = False, softcap: float = 0.0, shape_classes: str | Sequence[int] | None = None
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention on cuDNN's fused kernels, with autograd.

    q: (batch, seqlen_q, heads_q, head_dim_qk) for layout="bshd" (FlashAttention's order;
      "bhsd" is scaled_dot_product_attention's, "sbhd" is sequence-first); k and v the
      same with seqlen_kv and heads_kv (heads_q a multiple of it: GQA, MQA); v's head
      dim may differ. float16 or bfloat16 CUDA tensors on one device, any strides cuDNN
      accepts. Returns o with q's shape and v's head dim, in the same order.
    causal: query i sees keys j <= i + shift, where shift is 0 at the default top-left
      alignment (scaled_dot_product_attention's is_causal) and seqlen_kv - seqlen_q at
      the bottom right (FlashAttention's causal; per sequence with seq_lens_q/kv).
      causal_bottom_right=True is causal=True with alignment="bottom_right".
    window: (left, right) sliding window: query i sees keys j with i + shift - left <= j
      <= i + shift + right (-1 unbounded; a causal mask fixes right at 0). For
      FlashAttention's windows pass alignment="bottom_right" (fastattn.flash does).
    scale: softmax scale (default 1/sqrt(head_dim_qk)).
    deterministic: a deterministic backward.
    seq_lens_q, seq_lens_kv: padding masks: int32 CUDA tensors of shape (batch,), each
      sequence's own query and key lengths (at most the tensors' sequence lengths; not
      checked, as that would synchronize); seq_lens_kv defaults to seq_lens_q. Queries
      and keys past them are masked out, and o (and in backward d_q, d_k, d_v) is zero
      there. The masks apply within each sequence's lengths. The padded rows of q, k,
      v and the output gradient must hold finite values (zeros, or anything finite):
      cuDNN multiplies them by zero, so NaN or Inf there (torch.empty can hold them)
      leaks into the results.
    alibi: ALiBi position biases (slope[h] * (key - query) added after scaling, the
      ALiBi paper's slopes); cuDNN needs a causal mask (or a window's right bound at 0)
      with it.
    bias: an additive bias after scaling, (1 or batch, 1 or heads_q, seqlen_q,
      seqlen_kv), q's dtype, contiguous; it gets a gradient when it requires one.
    dropout_p: dropout on the attention weights, as scaled_dot_product_attention's
      (applied whenever > 0; pass 0 in evaluation). The mask comes from PyTorch's CUDA
      generator (torch.manual_seed), and backward uses the same one.
    sinks: attention sinks, a float32 logit per query head, (heads_q,), in every
      softmax denominator; it gets a gradient when it requires one.
    alignment: "top_left" (default) or "bottom_right": where the diagonal of the causal
      mask and of the window sits (the shift above).
    return_lse: also return the log-sum-exp of each row of scaled, masked scores (natural
      log), float32 (batch, heads_q, seqlen_q), FlashAttention's softmax_lse: returns
      (o, lse), lse without a gradient. It makes the call a training one (the plan with
      its backward), whose forward writes these stats.
    softcap: logit soft-capping (Gemma 2): scores become softcap * tanh(score / softcap)
      after scaling, before masking, in cuDNN's graph (its score modifier); forward and
      backward. 0.0 (default): none. cuDNN decides what it combines with: a refusal is a
      NotSupportedError with its reason (cudnn-frontend 1.28 refuses it with ALiBi).
    shape_classes: "off", "auto" or ascending class bounds, e.g. (256, 1024, 4096)
      (fastattn.shape_classes); None (default): FASTATTN_SHAPE_CLASSES, read when
      fastattn.torch was imported ("off" unless set). With classes, a plain eager bshd
      call with packed tokens (token stride heads * dim), no bias and no sinks runs the
      plan of its lengths' class, so a new length in a known class builds and loads
      nothing; the same results (o's rows past seq_lens zero, gradients), o contiguous.
      Such calls take the Python path (fastattn/torch/_classes.py says what that costs).

    Raises InvalidArgumentError (a ValueError) for CPU tensors, mismatched devices,
    dtypes or shapes, NotSupportedError when cuDNN refuses the config.
    """
    # Classes wanted: "auto" or bounds (SETTING OFF: the hot path as it was). Read as fields,
    # not bool(SETTING): Classes.__bool__ is a Python call on every call of the hot path.
    if shape_classes is None:
        setting = _classes.SETTING
        classes = setting.__class__ is str or setting.ranges != ()
    else:  # parsed here, so that a bad choice is refused whatever the tensors (meta, traced, CPU)
        shape_classes = _parse_classes(shape_classes, "shape_classes")
        classes = shape_classes.__class__ is str or shape_classes.ranges != ()
    if not dynamo_compiling():  # (dynamo traces the body below instead)
        call = _native.CALL
        if call is not None and not classes:
            # The native path's C entry (eager.cpp's call): it takes these arguments as
            # they are when they need no conversion; NotImplemented hands the call to
            # the body below, which checks and reports.
            o = call(q, k, v, causal, causal_bottom_right, window, scale, layout, deterministic, seq_lens_q,
                     seq_lens_kv, alibi, bias, dropout_p, sinks, alignment, return_lse, softcap)
            if o is not NotImplemented:
                return o
    else:  # dynamo's fake tensors look like plain CUDA ones, checked below only in plan_for: check them here
        _check_tensors(q, k, v, layout, seq_lens_q, seq_lens_kv, bias, sinks)
    if layout not in AXES:
        raise InvalidArgumentError(f"layout={layout!r}: must be one of {tuple(AXES)}")
    if seq_lens_kv is None:
        seq_lens_kv = seq_lens_q
    elif seq_lens_q is None:
        raise InvalidArgumentError("seq_lens_kv given without seq_lens_q")
    # Plain CUDA tensors are checked once per plan, in plan_for (on a miss); anything else
    # on every call: meta and CPU tensors, subclasses and fake tensors (FakeTensorMode,
    # make_fx, non-strict torch.export), which outside torch.compile and torch.export
    # take the Python ops (the op library's Meta kernels check nothing).
    cuda = q.__class__ is Tensor and q.is_cuda
    if not cuda:
        _check(q, k, v, layout, seq_lens_q, seq_lens_kv)
    left, right, scale = check_options(causal, causal_bottom_right, window, scale, deterministic, alibi)
    br = bottom_right(alignment, causal_bottom_right)
    causal = bool(causal or causal_bottom_right)
    if return_lse.__class__ is not bool:
        _fields.check("bool", "return_lse", return_lse)
    if softcap.__class__ is not float or softcap != 0.0:  # (0.0, the common call, needs no check)
        softcap = _options.positive_or_zero("softcap", softcap)
    plain = bias is None and sinks is None and not dropout_p  # the common call
    if plain:
        extras = _NO_EXTRAS
    else:
        _fields.check("probability", "dropout_p", dropout_p)
        if not cuda:
            _check_extras(q, k, layout, bias, sinks)
        # Philox's seed at element 0 and offset at element 2, drawn from PyTorch's generator.
        rng = torch.randint(0, 2**62, (4,), device=q.device, dtype=torch.int64) if dropout_p else None
        extras = (bias, sinks, rng)
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or (bias is not None and bias.requires_grad)
                                         or (sinks is not None and sinks.requires_grad))
    training = grads or bool(return_lse)
    if plain:
        options = _new(DenseOptions, (layout, causal, br, left, right, scale, bool(deterministic), bool(alibi),
                                      training, 0.0, False, softcap))
    else:
        options = DenseOptions(layout, causal, br, left, right, scale, bool(deterministic), bool(alibi), training,
                               float(dropout_p), bool(grads and bias is not None and bias.requires_grad), softcap)
    if classes and bias is None and sinks is None and cuda and plain_eager(q):
        # A class plan where the call's lengths have one (_classes.serve; None: exact plans).
        served = _classes.serve(q, k, v, seq_lens_q, seq_lens_kv, extras[2], options, shape_classes, grads,
                                return_lse)
        if served is not None:
            return served
    if return_lse:
        if cuda and plain_eager(q):
            o, stats = (EagerWithStats.apply(RULE, options, q, k, v, seq_lens_q, seq_lens_kv, *extras) if grads
                        else forward_impl(q, k, v, seq_lens_q, seq_lens_kv, *extras, options))
        else:
            o, stats = forward_op(q, k, v, seq_lens_q, seq_lens_kv, *extras, *options)
        return o, stats.squeeze(-1)  # (batch, heads_q, seqlen_q): FlashAttention's softmax_lse
    native = _native.DENSE
    if native is not None:
        # The native path: the op library's C++ (plan table, allocation, autograd in C++).
        # An eager CUDA call decides the path if undecided; a trace records the native
        # op once decided, else the Python ops. torch.func transforms wrap tensors in
        # ways a C++ autograd Function does not handle: they take the Python ops.
        if compiling():
            if native is not _native.UNDECIDED:
                return native[1](q, k, v, seq_lens_q, seq_lens_kv, *extras, *options)[0]
        elif cuda and not functorch_active():
            if native is _native.UNDECIDED:
                native = _native.decide()
            if native is not None:
                return native[0](q, k, v, seq_lens_q, seq_lens_kv, *extras, *options)[0]
    if cuda and plain_eager(q):
        if not training:  # no autograd either: straight to the plan
            return forward_impl(q, k, v, seq_lens_q, seq_lens_kv, *extras, options)[0]
        return Eager.apply(RULE, options, q, k, v, seq_lens_q, seq_lens_kv, *extras)
    return forward_op(q, k, v, seq_lens_q, seq_lens_kv, *extras, *options)[0]


# Module globals: one lookup less per call.
_parse_classes = _shape_classes.parse
plain_eager, Eager, EagerWithStats = _autograd.plain_eager, _autograd.Eager, _autograd.EagerWithStats
compiling, functorch_active = torch.compiler.is_compiling, _autograd.functorch_active
# Dynamo's own flag (one call, cheaper than is_compiling): other tracers
# (make_fx, non-strict export) run the C entry, which sees their dispatch modes.
dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", compiling)
Tensor = torch.Tensor
