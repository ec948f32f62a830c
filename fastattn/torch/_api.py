"""fastattn.torch's entry points as users call them: attention(), attention_varlen() and
attention_paged(), their signatures, documentation and argument checks, and the options
each call's plan is keyed by. What runs a call once its options are made is its op's
module (_dense, _varlen, _paged: the plan key and config; the custom ops and the Python
path's execution, made from the op's spec by _executor) or the op library's C entry
(eager.cpp), which reads these same arguments (_specs.CALLS).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch

from .. import _fields
from .. import shape_classes as _class_bounds
from ..errors import InvalidArgumentError
from . import _dense, _executor, _native, _options, _paged, _shape_classes, _specs, _varlen
from ._plans import AXES, bottom_right
from ._plans import options as check_options


# Options made with tuple.__new__: a NamedTuple's Python __new__ costs more per call,
# and named options should cost little over a plain tuple.
_new = tuple.__new__


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
      Such calls take the Python path (fastattn/torch/_shape_classes.py says what that costs).

    Raises InvalidArgumentError (a ValueError) for CPU tensors, mismatched devices,
    dtypes or shapes, NotSupportedError when cuDNN refuses the config.
    """
    # Classes wanted: "auto" or bounds (SETTING OFF: the hot path as it was). Read as fields,
    # not bool(SETTING): Classes.__bool__ is a Python call on every call of the hot path.
    if shape_classes is None:
        setting = _shape_classes.SETTING
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
        _dense._check_tensors(q, k, v, layout, seq_lens_q, seq_lens_kv, bias, sinks)
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
        _dense._check(q, k, v, layout, seq_lens_q, seq_lens_kv)
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
            _dense._check_extras(q, k, layout, bias, sinks)
        # Philox's seed at element 0 and offset at element 2, drawn from PyTorch's generator.
        rng = torch.randint(0, 2**62, (4,), device=q.device, dtype=torch.int64) if dropout_p else None
        extras = (bias, sinks, rng)
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or (bias is not None and bias.requires_grad)
                                         or (sinks is not None and sinks.requires_grad))
    training = grads or bool(return_lse)
    if plain:
        options = _new(_dense.DenseOptions, (layout, causal, br, left, right, scale, bool(deterministic), bool(alibi),
                                      training, 0.0, False, softcap))
    else:
        options = _dense.DenseOptions(layout, causal, br, left, right, scale, bool(deterministic), bool(alibi), training,
                               float(dropout_p), bool(grads and bias is not None and bias.requires_grad), softcap)
    if classes and bias is None and sinks is None and cuda and plain_eager(q):
        # A class plan where the call's lengths have one (_shape_classes.serve; None: exact plans).
        served = _shape_classes.serve(q, k, v, seq_lens_q, seq_lens_kv, extras[2], options, shape_classes, grads,
                                return_lse)
        if served is not None:
            return served
    if return_lse:
        if cuda and plain_eager(q):
            o, stats = (Train.apply(_dense, options, True, q, k, v, seq_lens_q, seq_lens_kv, *extras) if grads
                        else _dense.forward_impl(q, k, v, seq_lens_q, seq_lens_kv, *extras, options))
        else:
            o, stats = _dense.forward_op(q, k, v, seq_lens_q, seq_lens_kv, *extras, *options)
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
            return _dense.forward_impl(q, k, v, seq_lens_q, seq_lens_kv, *extras, options)[0]
        return Train.apply(_dense, options, False, q, k, v, seq_lens_q, seq_lens_kv, *extras)
    return _dense.forward_op(q, k, v, seq_lens_q, seq_lens_kv, *extras, *options)[0]


# The result's type follows return_lse (for type checkers).
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, *, causal: bool = ...,
                     causal_bottom_right: bool = ..., window: tuple[int, int] | None = ...,
                     scale: float | None = ..., deterministic: bool = ..., alignment: str = ...,
                     alibi: bool = ..., dropout_p: float = ..., return_lse: Literal[False] = ...,
                     softcap: float = ..., sinks: torch.Tensor | None = ...,
                     shape_classes: str | Sequence[int] | None = ...) -> torch.Tensor: ...
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, *, causal: bool = ...,
                     causal_bottom_right: bool = ..., window: tuple[int, int] | None = ...,
                     scale: float | None = ..., deterministic: bool = ..., alignment: str = ...,
                     alibi: bool = ..., dropout_p: float = ..., return_lse: Literal[True],
                     softcap: float = ..., sinks: torch.Tensor | None = ...,
                     shape_classes: str | Sequence[int] | None = ...) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, *, causal: bool = ...,
                     causal_bottom_right: bool = ..., window: tuple[int, int] | None = ...,
                     scale: float | None = ..., deterministic: bool = ..., alignment: str = ...,
                     alibi: bool = ..., dropout_p: float = ..., return_lse: bool = ...,
                     softcap: float = ..., sinks: torch.Tensor | None = ...,
                     shape_classes: str | Sequence[int] | None = ...) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


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
                     sinks: torch.Tensor | None = None, shape_classes: str | Sequence[int] | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences (FlashAttention's varlen layout),
    with autograd; cuDNN's THD kernels, one plan per batch size and length _varlen.bucket.

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
    sinks: attention sinks, as attention()'s: float32 (heads_q,), a logit per query head
      in every softmax denominator, with its gradient. cuDNN takes no sinks in a graph of
      one query, so such a plan is declared for two (lengths of one run in it).
    shape_classes: as attention()'s (None: FASTATTN_SHAPE_CLASSES). Plans are keyed by
      batch size and max lengths, never by token counts; with classes (eager calls), a
      max length inside a class takes the class's bound instead of its power of two, so
      that one plan serves the class (the native op too; the C entry is skipped).

    Raises InvalidArgumentError for bad inputs, NotSupportedError when cuDNN refuses.
    """
    # Classes wanted (SETTING OFF is falsy: then the hot path is as it was). A choice given
    # is parsed first, so that a bad one is refused whatever the tensors (meta, traced, CPU).
    if shape_classes is None:
        classes = _shape_classes.SETTING
    else:
        shape_classes = _shape_classes.sc.parse(shape_classes, "shape_classes")
        classes = shape_classes.__class__ is str or shape_classes.ranges != ()
    if not dynamo_compiling():  # (dynamo traces the body below instead)
        call = _native.CALL_VARLEN
        if call is not None and not classes:
            # The native path's C entry (eager.cpp's call_varlen): it makes this body's
            # checks and takes the call when they pass and no value needs converting;
            # NotImplemented hands the call to the body, which checks and reports.
            o = call(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, causal, causal_bottom_right,
                     window, scale, deterministic, alignment, alibi, dropout_p, return_lse, softcap, sinks)
            if o is not NotImplemented:
                return o
    _varlen._check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv)
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
    if sinks is not None:
        _dense.check_sink(sinks, q, q.shape[1])
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                         or (sinks is not None and sinks.requires_grad))
    training = grads or bool(return_lse)
    max_q, max_kv = _varlen.bucket(max_seqlen_q), _varlen.bucket(max_seqlen_kv)
    if classes and not compiling() and q.is_cuda:  # (traces keep the power-of-two buckets)
        c = _shape_classes.resolve(shape_classes, q.get_device(), training)
        max_q, max_kv = c.upper(max_seqlen_q) or max_q, c.upper(max_seqlen_kv) or max_kv
    if (training or sinks is not None) and max_q < VARLEN_MIN_Q:
        max_q = VARLEN_MIN_Q
    options = _new(_varlen.VarlenOptions, (max_q, max_kv, bool(causal or causal_bottom_right),
                                   br, left, right, scale, bool(deterministic), training, bool(alibi),
                                   float(dropout_p), softcap))
    # Philox's seed and offset for dropout, drawn from PyTorch's generator (see attention()).
    rng = torch.randint(0, 2**62, (4,), device=q.device, dtype=torch.int64) if dropout_p else None
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_kv, sinks, rng)
    if return_lse:
        if plain_eager(q):
            o, stats = (Train.apply(_varlen, options, True, *tensors) if grads else _varlen.forward_impl(*tensors, options))
        else:
            o, stats = _varlen.forward_op(*tensors, *options)
        return o, stats.t().contiguous()  # (tokens, heads) -> FlashAttention's (heads, total_q)
    native = _native.VARLEN
    if native is not None:  # the native path (see attention())
        if compiling():
            if native is not _native.UNDECIDED:
                return native[1](*tensors, *options)[0]
        elif q.is_cuda and not functorch_active():
            if native is _native.UNDECIDED:
                _native.decide()
                native = _native.VARLEN
            if native is not None:
                return native[0](*tensors, *options)[0]
    if plain_eager(q):  # skip the custom ops' wrappers (see _executor)
        if not training:
            return _varlen.forward_impl(*tensors, options)[0]
        return Train.apply(_varlen, options, False, *tensors)
    return _varlen.forward_op(*tensors, *options)[0]


def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    cache_seqlens: torch.Tensor, *, seq_lens_q: torch.Tensor | None = None, causal: bool = False,
                    causal_bottom_right: bool = False, window: tuple[int, int] | None = None,
                    scale: float | None = None, alignment: str | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Attention against a paged KV cache (FlashAttention's flash_attn_with_kvcache
    layout), for decode and for prefill against a cache; forward only (cuDNN has no
    paged backward).

    q: (batch, seqlen_q, heads_q, head_dim_qk); seqlen_q 1 for decode.
    k_cache, v_cache: page pools, (num_pages, page_size, heads_kv, head_dim): float16
      or bfloat16 on q's device, heads_kv dividing heads_q.
    block_table: int32 (batch, pages per sequence), contiguous: each sequence's pages
      in order. The plan's longest KV sequence is pages per sequence * page_size.
    cache_seqlens: int32 (batch,): each sequence's KV length (at most pages per
      sequence * page_size; not checked, as that would synchronize). Rows of a page
      past them may hold anything finite.
    seq_lens_q: int32 (batch,): each sequence's query length (default: all seqlen_q);
      o is zero past it.
    alignment: where the diagonal of causal and window sits, with no default while
      either is used: the layout is flash_attn_with_kvcache's, whose causal is at the
      bottom right, while attention()'s is at the top left, so a port from either would
      silently change its answer under a default. "bottom_right" puts the diagonal at
      the end of each sequence, where the queries of a decode or a chunked prefill sit:
      query i of a sequence sees keys j <= i + cache_seqlens - seq_lens_q (causal);
      "top_left" at its start (j <= i). causal=True without an alignment raises
      InvalidArgumentError, and so does a window. causal_bottom_right=True is
      causal=True with alignment="bottom_right". (fastattn.flash.flash_attn_with_kvcache
      is FlashAttention's function, bottom right.) window, scale and softcap as attention().
      Returns o: (batch, seqlen_q, heads_q, head_dim_v).

    Not bitwise repeatable: cuDNN's paged kernels may sum a row's keys in another order
    from one call to the next (identical eager calls, and a CUDA-graph replay against
    an eager call, were seen an element apart on the H200 with cuDNN 9.19). What is
    promised is the output dtype's rounding: identical calls agree within one unit in
    the last place of o's dtype, element by element.

    Raises InvalidArgumentError for bad inputs (and for inputs that require
    gradients), NotSupportedError when cuDNN refuses the config.
    """
    options = options_for(causal, causal_bottom_right, window, scale, alignment, softcap)
    if torch.is_grad_enabled() and (getattr(q, "requires_grad", False) or getattr(k_cache, "requires_grad", False)
                                    or getattr(v_cache, "requires_grad", False)):
        raise InvalidArgumentError("attention_paged is forward only (cuDNN has no paged backward): call it under "
                                   "torch.no_grad() or on tensors that do not require gradients")
    return _paged.run(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, options)


def options_for(causal, causal_bottom_right, window, scale, alignment, softcap) -> _paged.PagedOptions:
    """attention_paged()'s scalar arguments, checked, as its plans' options (what a caller
    that makes many calls with the same arguments may keep: fastattn.flash's decode)."""
    left, right, scale = check_options(causal, causal_bottom_right, window, scale)
    if softcap.__class__ is not float or softcap != 0.0:
        softcap = _options.positive_or_zero("softcap", softcap)
    if alignment is None:
        if (causal or (left, right) != (-1, -1)) and not causal_bottom_right:
            raise InvalidArgumentError(
                f"attention_paged({'causal=True' if causal else f'window={window!r}'}) needs an explicit alignment: "
                "'bottom_right' (FlashAttention's flash_attn_with_kvcache: the queries at the end of each sequence) "
                "or 'top_left' (scaled_dot_product_attention's is_causal)")
        br = bool(causal_bottom_right)
    else:
        br = bottom_right(alignment, causal_bottom_right)
        if causal_bottom_right and alignment == "top_left":
            raise InvalidArgumentError("causal_bottom_right=True and alignment='top_left' contradict each other")
    return _new(_paged.PagedOptions, (bool(causal or causal_bottom_right), br, left, right, scale, softcap))


# Module globals: one lookup less per call.
_parse_classes = _class_bounds.parse
plain_eager, Train = _executor.plain_eager, _executor.Train
compiling, functorch_active = torch.compiler.is_compiling, _executor.functorch_active
# Dynamo's own flag (one call, cheaper than is_compiling): other tracers
# (make_fx, non-strict export) run the C entry, which sees their dispatch modes.
dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", compiling)
Tensor = torch.Tensor
VARLEN_MIN_Q = _specs.VARLEN_MIN_Q  # (why: _specs)
