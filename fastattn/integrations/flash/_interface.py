"""FlashAttention's functions, as flash_attn's flash_attn_interface keeps them: flash_attn_func
and its packed variants, flash_attn_varlen_func and its packed variants (with
block_table and seqused_k: the paged helpers), and flash_attn_with_kvcache, on
fastattn.torch's entry points. Their options (softcap, window_size, alibi_slopes, ...)
are spelled here, in the signatures, overloads and docstrings, and handed on; what the
functions share is in _common, _alibi, _packing and _rotary. "The module doc" in the
functions' docstrings is fastattn.flash's (the package's __init__)."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from ... import _fields
from ...errors import InvalidArgumentError, NotSupportedError
from . import _common, _rotary
from ._alibi import _alibi, _alibi_bias, _cudnn_alibi, _with_bias
from ._common import (_UNBOUNDED, _attend, _check_dropout, _cut_head_dim, _deterministic, _fa_lse, _full, _mask,
                      _needs_grad, _on_device, _one_query, _pad_head_dim, _pad_head_dims, _shape, _unpadded)
from ._packing import _bucket, _pack, _token_positions, _token_rows, _unpack


# -- flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func --------------------------
# On fastattn.torch.attention, with the rows that see no key cut before cuDNN sees them.

# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                    causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                    return_attn_probs: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                    causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                    return_attn_probs: Literal[True]) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                    causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                    return_attn_probs: bool = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_func.

    q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_k, headdim); v:
      (batch, seqlen_k, nheads_k, headdim_v); float16 or bfloat16 CUDA tensors, nheads a
      multiple of nheads_k (MQA/GQA), any strides cuDNN takes (last dimension contiguous).
      headdim and headdim_v up to 256: those that are not multiples of 8 (which cuDNN
      takes only) are padded with zeros to the next one, as FlashAttention pads them (a
      copy of each tensor padded; none otherwise), and out is cut back (a view).
    dropout_p: applied whenever > 0 (pass 0 in evaluation, as with FlashAttention).
    softmax_scale: default 1 / sqrt(headdim) (the real headdim's, also when padded).
    causal, window_size: bottom-right aligned (see the module doc).
    softcap: logit soft-capping, softcap * tanh(score / softcap), in cuDNN's graph (0.0:
      none; fastattn.torch.attention's).
    alibi_slopes: float32 (nheads,) or (batch, nheads), any values, causal or not:
      FlashAttention's bias -slope * |i + seqlen_k - seqlen_q - j|. cuDNN's own ALiBi runs
      where it is that bias: the ALiBi paper's slopes (standard_alibi_slopes; checking them
      reads the slopes, see the module doc), causal, as many queries as keys (after the rows
      without keys are cut), no softcap. Elsewhere the bias is built on the device
      ((1 or batch, nheads, seqlen_q, seqlen_k) in q's dtype) and passed as attention()'s
      bias, with a bottom-right mask folded into it (cuDNN refuses that mask beside a bias;
      the masked tiles are then computed, not skipped).
    deterministic: a deterministic backward.
    return_attn_probs: also return softmax_lse, float32 (batch, nheads, seqlen_q), and
      S_dmask (None: dropout_p must be 0).

    One query (seqlen_q = 1, or the one row left when the rows above the diagonal are
    cut), with gradients or the LSE: the query block is padded to two rows, the second a
    padding row (a copy of q; see the module doc): cuDNN refuses that training plan
    against one key, and against more its forward is not bitwise repeatable.

    Returns out (batch, seqlen_q, nheads, headdim_v), or (out, softmax_lse, None).
    Raises InvalidArgumentError, NotSupportedError (see the module doc).
    """
    sq = _shape(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")[1]
    sk = _shape(k, "k", 4, "(batch, seqlen_k, nheads_k, headdim)")[1]
    causal, window = _mask(causal, window_size, sk)
    dropout_p = _check_dropout(dropout_p, return_attn_probs)
    slopes = _alibi(alibi_slopes, q, q.shape[2], q.shape[0])
    deterministic = _deterministic(deterministic, return_attn_probs, q, k, v)
    q, k, v, softmax_scale, head_dim_v = _pad_head_dims(q, k, v, softmax_scale)
    right = 0 if causal else window[1] if window is not None else -1
    empty = sq - sk - right if right >= 0 else 0
    if empty > 0:
        return _cut_head_dim(_with_empty_rows(q, k, v, empty, causal, window, softmax_scale, deterministic, slopes,
                                              dropout_p, return_attn_probs, softcap), head_dim_v)
    out = _dense(q, k, v, causal, window, softmax_scale, deterministic, slopes, dropout_p, return_attn_probs, softcap)
    return _cut_head_dim((*out, None) if return_attn_probs else out, head_dim_v)


def _dense(q, k, v, causal, window, scale, deterministic, slopes, dropout_p, lse, softcap):
    """flash_attn_func on attention(), for a q whose every row sees a key (the rows that
    see none are cut before: _with_empty_rows)."""
    sq, sk = q.shape[1], k.shape[1]
    # Where seqlen_q == seqlen_k both diagonals are one: the top-left graph then (which
    # cuDNN also builds with dropout and ALiBi) is the same answer as FlashAttention's.
    bottom = sq != sk and (causal or window is not None)
    alibi, bias = False, None
    if slopes is not None and (sq, sk) != (1, 1):  # (one query and one key: the bias is 0)
        # cuDNN's ALiBi, slope * (j - i) under a top-left causal mask, is FlashAttention's
        # -slope * |i + sk - sq - j| with as many queries as keys, for the paper's slopes
        # (cuDNN computes those), and not beside softcap (cuDNN refuses the pair).
        if causal and not bottom and not softcap and _cudnn_alibi(slopes, q.shape[2]):
            alibi = True
        else:
            # A bias cuDNN takes beside a top-left mask, not a bottom-right one: that mask goes
            # into the bias (and its tiles are computed rather than skipped).
            bias = _alibi_bias(slopes, q, sq, sk, sk - sq, (causal, window) if bottom else None)
            if bottom:
                causal, window, bottom = False, None, False
    lens_q = lens_k = None
    if bottom and sq > sk and not softcap:
        # cudnn-frontend takes that diagonal only with per-sequence lengths. Beside softcap
        # its own masks are off and the score modifier applies the diagonal, which needs
        # none; lengths there would ask for a graph that cuDNN 9.24 and newer refuse on
        # SM90 (fastattn.defects' gap sm90-score-modifier-with-lengths).
        lens_q, lens_k = _full(q, q.shape[0], sq), _full(q, q.shape[0], sk)
    out = _attend(q, k, v, causal=causal, window=window, scale=scale, deterministic=deterministic,
                  seq_lens_q=lens_q, seq_lens_kv=lens_k, alibi=alibi, bias=None if bias is None else bias.bias,
                  dropout_p=dropout_p, alignment="bottom_right" if bottom else "top_left", return_lse=lse,
                  softcap=softcap)
    return _fa_lse(out if bias is None else _with_bias(out, bias, lse), lse)


def _with_empty_rows(q, k, v, empty, causal, window, scale, deterministic, slopes, dropout_p, lse, softcap):
    """The first `empty` queries see no key (the bottom-right diagonal passes above them:
    more queries than keys): FlashAttention writes 0 and an LSE of +inf there. The rest run
    alone, a slice of q whose bottom-right diagonal is the same (the shift grows with the
    rows cut), so cuDNN never sees a row without keys; a causal mask then has as many
    queries as keys, where the top-left graph (with dropout and ALiBi) is the same one."""
    b, _, h, _ = q.shape
    out = _dense(q[:, empty:], k, v, causal, window, scale, deterministic, slopes, dropout_p, lse, softcap)
    o, stats = out if lse else (out, None)
    o = torch.cat([o.new_zeros(b, empty, h, o.shape[3]), o], 1)
    if not lse:
        return o
    return o, torch.cat([stats.new_full((b, h, empty), float("inf")), stats], 2), None


# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                              causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                              alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                              return_attn_probs: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                              causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                              alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                              return_attn_probs: Literal[True]) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                              causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                              alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                              return_attn_probs: bool = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Tensor | None = None, deterministic: bool = False,
                              return_attn_probs: bool = False) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_qkvpacked_func: qkv (batch, seqlen, 3, nheads, headdim);
    q, k, v are views of it (no copy; a headdim that is not a multiple of 8 pads qkv once,
    one copy), and its gradient is dqkv. Otherwise flash_attn_func."""
    shape = _shape(qkv, "qkv", 5, "(batch, seqlen, 3, nheads, headdim)")
    if shape[2] != 3:
        raise InvalidArgumentError(f"qkv has shape {tuple(shape)}: expected (batch, seqlen, 3, nheads, headdim)")
    head_dim_v = None
    if not _unpadded(shape[4]):  # padded once, packed (one copy), rather than q, k and v apart
        head_dim_v, softmax_scale = shape[4], shape[4] ** -0.5 if softmax_scale is None else softmax_scale
        qkv = _pad_head_dim(qkv)
    q, k, v = qkv.unbind(2)
    return _cut_head_dim(flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                         alibi_slopes, deterministic, return_attn_probs), head_dim_v)


# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                             causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                             alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                             return_attn_probs: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                             causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                             alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                             return_attn_probs: Literal[True]) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                             causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                             alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                             return_attn_probs: bool = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                             causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Tensor | None = None, deterministic: bool = False,
                             return_attn_probs: bool = False) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_kvpacked_func: kv (batch, seqlen_k, 2, nheads_k, headdim);
    k, v are views of it (no copy; a headdim that is not a multiple of 8 pads q and kv
    once each). Otherwise flash_attn_func."""
    shape = _shape(kv, "kv", 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if shape[2] != 2:
        raise InvalidArgumentError(f"kv has shape {tuple(shape)}: expected (batch, seqlen_k, 2, nheads_k, headdim)")
    head_dim_v = None
    if not _unpadded(shape[4]) and isinstance(q, torch.Tensor) and q.shape[-1] == shape[4]:
        head_dim_v, softmax_scale = shape[4], shape[4] ** -0.5 if softmax_scale is None else softmax_scale
        q, kv = _pad_head_dim(q), _pad_head_dim(kv)  # kv padded once, packed
    k, v = kv.unbind(2)
    return _cut_head_dim(flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                         alibi_slopes, deterministic, return_attn_probs), head_dim_v)


# -- flash_attn_varlen_func and its packed variants ------------------------------------------------
# On fastattn.torch.attention_varlen, and varlen with an ALiBi bias as a zero-padded dense
# call (cuDNN's packed plans take no bias).

# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                           softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                           softcap: float = ..., alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                           return_attn_probs: Literal[False] = ..., block_table: Tensor | None = ...,
                           seqused_k: Tensor | None = ...) -> Tensor: ...
@overload
def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                           softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                           softcap: float = ..., alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                           return_attn_probs: Literal[True], block_table: Tensor | None = ...,
                           seqused_k: Tensor | None = ...) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                           softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                           softcap: float = ..., alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                           return_attn_probs: bool = ..., block_table: Tensor | None = ...,
                           seqused_k: Tensor | None = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Tensor | None = None,
                           seqused_k: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_varlen_func.

    q: (total_q, nheads, headdim), k: (total_k, nheads_k, headdim), v: (total_k, nheads_k,
      headdim_v): the batch's sequences one after another (copied if not contiguous, or
      padded as flash_attn_func's head dims, the padded copy contiguous).
    cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), cumulative lengths from 0.
    max_seqlen_q, max_seqlen_k: the longest sequences (plans are built for them rounded up
      to a power of two; a window bound >= max_seqlen_k is unbounded, as FlashAttention's).
    causal, window_size: bottom-right aligned per sequence (see the module doc); with one
      cu_seqlens tensor for q and k both diagonals are one (the top-left graph runs).
    dropout_p, softcap: as flash_attn_func; cuDNN takes dropout with a top-left diagonal
      only, so with causal or a window, pass the same cu_seqlens tensor for q and k.
    alibi_slopes: as flash_attn_func's, per sequence. cuDNN's ALiBi where it is
      FlashAttention's (the paper's slopes, causal, one cu_seqlens tensor for q and k, no
      softcap); otherwise a bias, which cuDNN's packed plans cannot take: the sequences are
      unpacked into a zero-padded dense batch at max_seqlen_q x max_seqlen_k rounded up to
      powers of two (copies of q, k, v; compute and a bias (batch, nheads, those lengths)
      at that size) and the output packed back.
    block_table: None, or int32 (batch, max_num_blocks_per_seq): k and v are then page pools
      (num_blocks, page_block_size, nheads_k, headdim), any page size, sequence b's keys
      its pages in order, and cu_seqlens_k gives each sequence's key length (its
      differences; FlashAttention's paged varlen). Forward on cuDNN's paged plan where it
      fits (no gradients, no LSE, no dropout, no ALiBi, head dims multiples of 8; q is
      unpacked into a padded batch, a copy); otherwise the pages each sequence uses are
      gathered into packed k, v (a copy) and the call runs as a varlen call, with
      gradients into the pools (FlashAttention has no paged backward). See _interface's
      paged helpers.
    seqused_k: None, or int32 (batch,): each sequence uses only its first seqused_k[b]
      keys (at most its cu_seqlens_k length), its masks at the bottom right of those
      (FlashAttention's varlen_fwd argument, which its Python function does not pass on;
      a fastattn.flash extension at the end of the signature). With a block table it
      is each sequence's length; without one, the used keys are gathered into packed
      k, v (a copy: cuDNN's packed plans take their lengths from one cumulative tensor).
    return_attn_probs: also return softmax_lse, float32 (nheads, total_q), and None.
    max_seqlen_q = max_seqlen_k = 1 with gradients or the LSE (cuDNN refuses that training
      plan): the plan is built for two queries, each sequence's length of 1 padding it (no
      copy).

    Returns out (total_q, nheads, headdim_v), or (out, softmax_lse, None).
    """
    dropout_p = _check_dropout(dropout_p, return_attn_probs)
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int):
        raise InvalidArgumentError(f"max_seqlen_k={max_seqlen_k!r}: must be an int >= 1")
    causal, window = _mask(causal, window_size, max_seqlen_k)
    batch = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1 else -1
    slopes = _alibi(alibi_slopes, q, _shape(q, "q", 3, "(total_q, nheads, headdim)")[1], batch)
    deterministic = _deterministic(deterministic, return_attn_probs, q, k, v)
    if block_table is not None or seqused_k is not None:
        lens_k = key_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k)
        if paged_plan_fits(q, k, v, block_table, return_attn_probs or _needs_grad(q, k, v), dropout_p, slopes):
            return attend_pages(q, k, v, block_table, cu_seqlens_q, lens_k, max_seqlen_q, causal, window,
                                softmax_scale, softcap)
        # (a new cu_seqlens_k: each sequence at its own bottom right, below)
        k, v, cu_seqlens_k = gather_keys(k, v, cu_seqlens_k, block_table, lens_k)
    _shape(k, "k", 3, "(total_k, nheads_k, headdim)")
    q, k, v, softmax_scale, head_dim_v = _pad_head_dims(q, k, v, softmax_scale)  # (padded: contiguous copies)
    q, k, v = (t if not isinstance(t, torch.Tensor) or t.is_contiguous() else t.contiguous() for t in (q, k, v))
    # The same cumulative lengths: each sequence's q and k lengths are equal, and the
    # top-left diagonal is the bottom-right one (the plans attention_varlen shares).
    bottom = cu_seqlens_q is not cu_seqlens_k and (causal or window is not None)
    if _one_query(max_seqlen_q, return_attn_probs or _needs_grad(q, k, v)):
        # Training sequences of one query (_one_query: why): a plan for two queries, which
        # each sequence's cu_seqlens_q length of 1 pads (the plan's longest is an upper
        # bound). No copy; the diagonal is each sequence's own.
        max_seqlen_q = 2
    # cuDNN's ALiBi where it is FlashAttention's (see _dense; each sequence's q and k
    # lengths equal); other slopes and masks take a bias, which a packed plan cannot.
    if slopes is not None and not (causal and not bottom and not softcap and _cudnn_alibi(slopes, q.shape[1])):
        out = _varlen_as_dense(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                               bottom, softmax_scale, deterministic, slopes, dropout_p, return_attn_probs, softcap)
    else:
        out = _common.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       causal=causal, window=window, scale=softmax_scale,
                                       deterministic=deterministic, alignment="bottom_right" if bottom else "top_left",
                                       alibi=slopes is not None, dropout_p=dropout_p, return_lse=return_attn_probs,
                                       softcap=softcap)
    out = _fa_lse(out, return_attn_probs)
    return _cut_head_dim((*out, None) if return_attn_probs else out, head_dim_v)


def _varlen_as_dense(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, bottom, scale, deterministic, slopes,
                     dropout_p, lse, softcap):
    """flash_attn_varlen_func with ALiBi as a bias, which is per sequence and which cuDNN's
    packed plans cannot take: the sequences unpacked into a zero-padded dense batch
    (batch, seqlen, ...) with seqlen max_seqlen rounded up to a power of two as
    attention_varlen's plans are (copies of q, k, v; compute and the bias, (1 or batch,
    nheads, seqlen_q, seqlen_k), at that padded size), attended with each sequence's
    lengths as seq_lens_q/kv, and o and the LSE packed back (gathers, no synchronization;
    the gradients flow back through them). The mask at each sequence's bottom right
    (different cu_seqlens tensors) goes into the bias, which cuDNN refuses beside a
    bottom-right mask; with one cu_seqlens tensor cuDNN applies it at the top left."""
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < 2:
            raise InvalidArgumentError(f"{name}: expected an int32 tensor of batch + 1 cumulative lengths, got "
                                       f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if cu_q.shape != cu_k.shape:
        raise InvalidArgumentError(f"cu_seqlens_q has {cu_q.shape[0]} entries, cu_seqlens_k {cu_k.shape[0]}")
    for name, n in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < 2**31:
            raise InvalidArgumentError(f"{name}={n!r}: must be an int >= 1 and < 2**31")
    _shape(v, "v", 3, "(total_k, nheads_k, headdim_v)")
    _on_device(q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    if k.shape[0] != v.shape[0]:
        raise InvalidArgumentError(f"k has {k.shape[0]} tokens, v {v.shape[0]}")
    b = cu_q.shape[0] - 1
    rows, cols = _bucket(max_q), _bucket(max_k)
    if _one_query(rows, lse or _needs_grad(q, k, v)):
        rows = 2  # (see flash_attn_varlen_func; the padded rows are the padding)
    lens_q, lens_k = cu_q.diff(), cu_k.diff()
    bias = _alibi_bias(slopes, q, rows, cols, lens_k - lens_q, (causal, window) if bottom else None, lens_k)
    if bottom:
        causal, window = False, None
    out = _attend(_unpack(q, cu_q, lens_q, rows), _unpack(k, cu_k, lens_k, cols), _unpack(v, cu_k, lens_k, cols),
                  causal=causal, window=window, scale=scale, deterministic=deterministic, seq_lens_q=lens_q,
                  seq_lens_kv=lens_k, bias=bias.bias, dropout_p=dropout_p, return_lse=lse, softcap=softcap)
    out = _with_bias(out, bias, lse)
    o: Tensor = out[0] if lse else out
    rows_of = _token_rows(cu_q, q.shape[0], rows)
    o = _pack(o.reshape(b * rows, *o.shape[2:]), rows_of, 0)
    if not lse:
        return o
    stats: Tensor = out[1]
    return o, _pack(stats.transpose(0, 1).reshape(stats.shape[1], b * rows), rows_of, 1, float("inf"))


# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = ...,
                                     softmax_scale: float | None = ..., causal: bool = ...,
                                     window_size: tuple[int, int] = ..., softcap: float = ...,
                                     alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                                     return_attn_probs: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = ...,
                                     softmax_scale: float | None = ..., causal: bool = ...,
                                     window_size: tuple[int, int] = ..., softcap: float = ...,
                                     alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                                     return_attn_probs: Literal[True]) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = ...,
                                     softmax_scale: float | None = ..., causal: bool = ...,
                                     window_size: tuple[int, int] = ..., softcap: float = ...,
                                     alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                                     return_attn_probs: bool = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: float | None = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Tensor | None = None, deterministic: bool = False,
                                     return_attn_probs: bool = False) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_varlen_qkvpacked_func: qkv (total, 3, nheads, headdim),
    one cu_seqlens and max_seqlen for q and k. Otherwise flash_attn_varlen_func."""
    shape = _shape(qkv, "qkv", 4, "(total, 3, nheads, headdim)")
    if shape[1] != 3:
        raise InvalidArgumentError(f"qkv has shape {tuple(shape)}: expected (total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                                    softmax_scale: float | None = ..., causal: bool = ...,
                                    window_size: tuple[int, int] = ..., softcap: float = ...,
                                    alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                                    return_attn_probs: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                                    softmax_scale: float | None = ..., causal: bool = ...,
                                    window_size: tuple[int, int] = ..., softcap: float = ...,
                                    alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                                    return_attn_probs: Literal[True]) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                                    softmax_scale: float | None = ..., causal: bool = ...,
                                    window_size: tuple[int, int] = ..., softcap: float = ...,
                                    alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                                    return_attn_probs: bool = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: float | None = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Tensor | None = None, deterministic: bool = False,
                                    return_attn_probs: bool = False) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_varlen_kvpacked_func: kv (total_k, 2, nheads_k, headdim).
    Otherwise flash_attn_varlen_func."""
    shape = _shape(kv, "kv", 4, "(total_k, 2, nheads_k, headdim)")
    if shape[1] != 2:
        raise InvalidArgumentError(f"kv has shape {tuple(shape)}: expected (total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


# -- flash_attn_varlen_func's block_table and seqused_k --------------------------------------------
# Packed queries against a paged KV cache, or against packed keys of which each sequence
# uses only its first seqused_k.
#
# FlashAttention's semantics (flash_api.cpp's mha_varlen_fwd, block_info.h): with a block
# table, k and v are page pools (num_blocks, page_block_size, nheads_k, headdim), sequence
# b's keys are its pages in block_table[b]'s order, and cu_seqlens_k gives only each
# sequence's key length (its differences); seqused_k, where given, is the length instead.
# Without a block table, cu_seqlens_k places each sequence in k and seqused_k says how many
# of its keys are used. The masks sit at each sequence's bottom right with that length.
#
# Two paths, chosen per call:
# - cuDNN's paged plan (fastattn.torch.attention_paged), forward only: q unpacked into a
#   zero-padded (batch, max_seqlen_q rounded up to a power of two, nheads, headdim) batch
#   with each sequence's query length (a copy of q), out packed back. It runs where the
#   plan has what the call asks: a block table, no gradients, no LSE, no dropout, no ALiBi,
#   head dims that are multiples of 8.
# - Otherwise the keys each sequence uses are gathered into packed k, v (copies:
#   batch * max_num_blocks_per_seq * page_block_size tokens with a block table, k's
#   token count without) with cumulative lengths of their own, and the call runs as a
#   plain varlen call (attention_varlen, with its backward; the gradients flow back through
#   the gather into the pool or k). cuDNN has no paged backward and its paged plans write
#   no softmax stats, so training, the LSE, dropout and ALiBi take this path, as does
#   seqused_k without a block table (cuDNN's packed plans take their lengths from one
#   cumulative tensor).

def _int32(name: str, t, shape: tuple[int, ...], what: str) -> Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != shape:
        raise InvalidArgumentError(f"{name}: expected an int32 tensor of shape {shape} ({what}), got "
                                   f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    return t


def key_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k) -> Tensor:
    """Checks what the paged and seqused_k calls add; returns each sequence's key length,
    int32 (batch,): seqused_k, else cu_seqlens_k's differences."""
    if (not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.dim() != 1
            or cu_seqlens_q.shape[0] < 2):
        raise InvalidArgumentError(f"cu_seqlens_q: expected an int32 tensor of batch + 1 cumulative lengths, got "
                                   f"{getattr(cu_seqlens_q, 'dtype', type(cu_seqlens_q).__name__)} "
                                   f"{tuple(getattr(cu_seqlens_q, 'shape', ()))}")
    batch = cu_seqlens_q.shape[0] - 1
    _shape(q, "q", 3, "(total_q, nheads, headdim)")
    if block_table is not None:
        pool = "(num_blocks, page_block_size, nheads_k, headdim) with block_table"
        _shape(k, "k", 4, pool)
        _shape(v, "v", 4, pool.replace("headdim)", "headdim_v)"))
        if k.shape[:3] != v.shape[:3]:
            raise InvalidArgumentError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in blocks, block size or "
                                       "heads")
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise InvalidArgumentError(f"block_table: expected an int32 tensor ({batch}, max_num_blocks_per_seq), got "
                                       f"{getattr(block_table, 'dtype', type(block_table).__name__)} "
                                       f"{tuple(getattr(block_table, 'shape', ()))}")
        _int32("block_table", block_table, (batch, block_table.shape[1]), "batch, max_num_blocks_per_seq")
    else:
        _shape(k, "k", 3, "(total_k, nheads_k, headdim)")
        _shape(v, "v", 3, "(total_k, nheads_k, headdim_v)")
    _int32("cu_seqlens_k", cu_seqlens_k, (batch + 1,), "batch + 1 cumulative lengths, like cu_seqlens_q")
    if seqused_k is not None:
        _int32("seqused_k", seqused_k, (batch,), "each sequence's number of keys used")
    _on_device(q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table,
               seqused_k=seqused_k)
    return seqused_k.contiguous() if seqused_k is not None else cu_seqlens_k.diff()


def paged_plan_fits(q, k, v, block_table, training: bool, dropout_p: float, slopes) -> bool:
    """Whether cuDNN's paged plan computes this call (see the paged section's comment)."""
    return (block_table is not None and not training and not dropout_p and slopes is None
            and _unpadded(q.shape[-1], v.shape[-1]))


def attend_pages(q, k, v, block_table, cu_q, lens_k, max_q, causal, window, scale, softcap) -> Tensor:
    """out (total_q, nheads, headdim_v) from attention_paged: each sequence's queries at the
    bottom right of its lens_k keys. Rows that see no key (more queries than keys under a
    right bound, or no keys at all) are FlashAttention's 0, written here."""
    if isinstance(max_q, bool) or not isinstance(max_q, int) or not 1 <= max_q < 2**31:
        raise InvalidArgumentError(f"max_seqlen_q={max_q!r}: must be an int >= 1 and < 2**31")
    b, rows = cu_q.shape[0] - 1, _bucket(max_q)
    lens_q = cu_q.diff()
    o = _common.attention_paged(_unpack(q, cu_q, lens_q, rows), k, v, block_table, lens_k, seq_lens_q=lens_q,
                                causal=causal, window=window, scale=scale, alignment="bottom_right", softcap=softcap)
    right = 0 if causal else window[1] if window is not None else -1
    keyless = (lens_k == 0).view(b, 1)
    if right >= 0:
        i = torch.arange(rows, device=q.device, dtype=lens_k.dtype).view(1, rows)
        keyless = keyless | (i + (lens_k - lens_q).view(b, 1) + right < 0)
    o = o.masked_fill(keyless.view(b, -1, 1, 1), 0)  # ((b, 1) without a right bound: broadcast over rows)
    return _pack(o.reshape(b * rows, *o.shape[2:]), _token_rows(cu_q, q.shape[0], rows), 0)


def gather_keys(k, v, cu_k, block_table, lens_k) -> tuple[Tensor, Tensor, Tensor]:
    """(k, v, cu_seqlens_k): the keys and values each sequence uses, packed one sequence
    after another (copies, on the device; gradients flow back through them), and their
    cumulative lengths. With a block table, sequence b's position j is page
    block_table[b, j // page_block_size], row j % page_block_size; without one, k's token
    cu_seqlens_k[b] + j. The packed tensors hold as many tokens as the sequences could:
    batch * max_num_blocks_per_seq * page_block_size, or k's token count (the tokens past
    the used ones are zeros, which the call masks)."""
    b = lens_k.shape[0]
    cu = torch.cat([lens_k.new_zeros(1), torch.cumsum(lens_k, 0, dtype=torch.int32)])
    if block_table is not None:
        page, width = k.shape[1], block_table.shape[1]
        seq, pos, inside = _token_positions(cu, b * width * page)
        col = (pos // page).clamp_(0, width - 1)
        src = block_table.reshape(-1).index_select(0, seq * width + col) * page + pos % page
        k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])  # (views of contiguous pools)
    else:
        seq, pos, inside = _token_positions(cu, k.shape[0])
        src = cu_k.index_select(0, seq) + pos
    outside = (inside == 0).view(-1, 1, 1)  # (not ~: see _unpack)
    # Clamped: a length past the pool or k (not checked: that would synchronize) reads its
    # last token, never past it; tokens outside the sequences read token 0 and are zeroed,
    # so that their gradients (which cuDNN need not write) never reach the pool.
    src = src.clamp_(0, k.shape[0] - 1).masked_fill_(outside.view(-1), 0).long()
    return k.index_select(0, src).masked_fill(outside, 0), v.index_select(0, src).masked_fill(outside, 0), cu


# -- flash_attn_with_kvcache -----------------------------------------------------------------------
# On fastattn.torch.attention (a dense cache) and attention_paged (a paged one): the
# in-place append of new keys and values, per-sequence lengths at each sequence's bottom
# right, ALiBi as a bias.

def _cache_lengths(cache_seqlens, batch: int, full: int, q: torch.Tensor) -> torch.Tensor:
    if cache_seqlens is None:
        return _full(q, batch, full)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        return torch.full((batch,), _fields.check_int("cache_seqlens", cache_seqlens, 0), dtype=torch.int32,
                          device=q.device)
    if (not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32
            or tuple(cache_seqlens.shape) != (batch,)):
        raise InvalidArgumentError(f"cache_seqlens: expected an int or an int32 tensor of shape ({batch},), got "
                                   f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)} "
                                   f"{tuple(getattr(cache_seqlens, 'shape', ()))}")
    return cache_seqlens


def _append(k_cache, v_cache, k, v, lengths, block_table, batch_idx) -> None:
    """Writes the new keys and values of each sequence b at positions lengths[b] ... of its
    cache, in place, as FlashAttention does (its cache_seqlens stay the caller's to advance).
    Index arithmetic on the device: no synchronization."""
    b, s_new = k.shape[0], k.shape[1]
    pos = lengths.to(torch.int64)[:, None] + torch.arange(s_new, device=k.device)[None, :]  # (b, s_new)
    if block_table is not None:
        page_size = k_cache.shape[1]
        rows = block_table.to(torch.int64).gather(1, pos // page_size)
        cols = pos % page_size
    else:
        rows = (batch_idx.to(torch.int64) if batch_idx is not None else torch.arange(b, device=k.device))[:, None]
        rows, cols = rows.expand(b, s_new), pos
    k_cache.index_put_((rows, cols), k)
    v_cache.index_put_((rows, cols), v)


# The result's type follows return_softmax_lse (for type checkers).
@overload
def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = ...,
                            v: Tensor | None = ..., rotary_cos: Tensor | None = ..., rotary_sin: Tensor | None = ...,
                            cache_seqlens: int | Tensor | None = ..., cache_batch_idx: Tensor | None = ...,
                            cache_leftpad: Tensor | None = ..., block_table: Tensor | None = ...,
                            softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                            softcap: float = ..., rotary_interleaved: bool = ..., alibi_slopes: Tensor | None = ...,
                            num_splits: int = ..., return_softmax_lse: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = ...,
                            v: Tensor | None = ..., rotary_cos: Tensor | None = ..., rotary_sin: Tensor | None = ...,
                            cache_seqlens: int | Tensor | None = ..., cache_batch_idx: Tensor | None = ...,
                            cache_leftpad: Tensor | None = ..., block_table: Tensor | None = ...,
                            softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                            softcap: float = ..., rotary_interleaved: bool = ..., alibi_slopes: Tensor | None = ...,
                            num_splits: int = ..., *, return_softmax_lse: Literal[True]) -> tuple[Tensor, Tensor]: ...
@overload
def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = ...,
                            v: Tensor | None = ..., rotary_cos: Tensor | None = ..., rotary_sin: Tensor | None = ...,
                            cache_seqlens: int | Tensor | None = ..., cache_batch_idx: Tensor | None = ...,
                            cache_leftpad: Tensor | None = ..., block_table: Tensor | None = ...,
                            softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                            softcap: float = ..., rotary_interleaved: bool = ..., alibi_slopes: Tensor | None = ...,
                            num_splits: int = ...,
                            return_softmax_lse: bool = ...) -> Tensor | tuple[Tensor, Tensor]: ...


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
                            v: Tensor | None = None, rotary_cos: Tensor | None = None,
                            rotary_sin: Tensor | None = None, cache_seqlens: int | Tensor | None = None,
                            cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
                            block_table: Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Tensor | None = None, num_splits: int = 0,
                            return_softmax_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """FlashAttention's flash_attn_with_kvcache (forward only, no gradients).

    q: (batch, seqlen_q, nheads, headdim), any headdim up to 256: one not a multiple of 8
      is padded with zeros as FlashAttention pads it, q and each whole cache copied per
      call after k, v are appended (with block_table, the sequences' pages gathered).
    k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim) dense, or with
      block_table (num_blocks, page_block_size, nheads_k, headdim) pages (any page size).
    k, v: None, or (batch, seqlen_new, nheads_k, headdim): written into the caches in
      place at each sequence's cache_seqlens before attending (cache_seqlens is not
      advanced, as with FlashAttention); k rotated first where rotary_cos is given.
    rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2), floating point on q's
      device, seqlen_ro at least seqlen_cache (max_num_blocks_per_seq * page_block_size
      when paged), rotary_dim <= headdim; only with k, v. FlashAttention's rotary
      embedding of the first rotary_dim features (see _rotary; rotary_interleaved picks
      the pairs), applied here in PyTorch ops (a copy of q and of k; cuDNN's graph has no
      rotary): k's row i at position cache_seqlens + i, and q's row i at cache_seqlens + i
      with causal or a window, else every row of q at cache_seqlens. Positions are the
      cache's own indices, as FlashAttention's (with cache_leftpad too: cache_seqlens is
      where the sequence ends, not its length).
    cache_seqlens: an int or int32 (batch,): where each sequence's cached keys end before
      k, v (its length, less cache_leftpad; None: the whole cache; needed with k, v).
    cache_batch_idx: int32 (batch,): the cache rows of a dense cache (default 0 ... batch
      - 1); the rows are gathered (a copy). Not with block_table (FlashAttention refuses
      the pair too).
    cache_leftpad: None, or int32 (batch,): sequence b's cache starts at cache_leftpad[b]
      of its row; the keys before it are not attended, and the masks and ALiBi count
      positions from it (FlashAttention's). Each sequence's keys are gathered to start at
      0 (a copy of the rows, as with cache_batch_idx, in the same gather). Not with
      block_table (FlashAttention refuses the pair too).
    block_table: int32 (batch, max_num_blocks_per_seq): each sequence's pages.
    causal, window_size: bottom-right aligned per sequence: query i sees keys up to
      cache_seqlens + seqlen_new - seqlen_q + i (see the module doc).
    softcap: as flash_attn_func.
    alibi_slopes: as flash_attn_func's, at each sequence's bottom right: a bias (batch,
      nheads, seqlen_q, seqlen_cache) holding the mask too; with block_table the
      sequences' pages are gathered into a dense cache first (a copy: attention_paged
      takes no bias).
    rotary_interleaved: checked; used only with rotary (as FlashAttention).
    num_splits: an int >= 0, no effect (cuDNN chooses).
    return_softmax_lse: also return softmax_lse, float32 (batch, nheads, seqlen_q). With
      block_table the sequences' pages are gathered into a dense cache first (a copy:
      cuDNN's paged plans write no softmax stats).

    Paths: attention_paged (cuDNN's paged plan) for a block table without ALiBi or the
    LSE; otherwise attention on a dense cache (the caller's, or the rows gathered for
    cache_batch_idx and cache_leftpad, or the pages gathered for a block table).

    Returns out (batch, seqlen_q, nheads, headdim_v), or (out, softmax_lse).
    """
    if (block_table is not None and k is None and v is None and rotary_cos is None and rotary_sin is None
            and cache_batch_idx is None and cache_leftpad is None and alibi_slopes is None
            and return_softmax_lse is False and causal.__class__ is bool and window_size.__class__ is tuple
            and window_size == _UNBOUNDED and softcap.__class__ is float and softcap == 0.0
            and (softmax_scale is None or softmax_scale.__class__ is float) and rotary_interleaved.__class__ is bool
            and num_splits.__class__ is int and 0 <= num_splits < _fields.INT_LIMIT):
        return _paged_decode(q, k_cache, v_cache, block_table, cache_seqlens, causal, softmax_scale)
    # The checks' common cases inline (a decode step's host time is mostly this body's):
    # plain bools and a small non-negative int pass as they are; the rest are checked.
    interleaved = (rotary_interleaved if rotary_interleaved.__class__ is bool
                   else _fields.check("bool", "rotary_interleaved", rotary_interleaved))
    if num_splits.__class__ is not int or not 0 <= num_splits < _fields.INT_LIMIT:
        _fields.check("int", "num_splits", num_splits)
    lse = (return_softmax_lse if return_softmax_lse.__class__ is bool
           else _fields.check("bool", "return_softmax_lse", return_softmax_lse))
    batch, sq = _shape(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")[:2]
    _shape(k_cache, "k_cache", 4, "(batch_size_cache or num_blocks, seqlen_cache or page_block_size, nheads_k, "
           "headdim)")
    if (k is None) != (v is None):
        raise InvalidArgumentError("k and v: give both (new keys and values to append) or neither")
    # Head dims cuDNN does not take: the caches are appended to as they are, then copied
    # padded to a multiple of 8 for the attention (a copy of each whole cache per call;
    # FlashAttention pads and copies back after appending, the same traffic).
    pad = isinstance(v_cache, torch.Tensor) and not _unpadded(q.shape[3], k_cache.shape[3], v_cache.shape[-1])
    if block_table is not None:
        if cache_batch_idx is not None:
            raise NotSupportedError("cache_batch_idx with block_table: the block table already maps each sequence's "
                                    "pages (FlashAttention refuses this too)")
        if cache_leftpad is not None:
            raise NotSupportedError("cache_leftpad with block_table: a paged sequence starts at its first page "
                                    "(FlashAttention refuses this too: 'Paged KV and leftpad_k')")
        _shape(block_table, "block_table", 2, "int32 (batch, max_num_blocks_per_seq)")
        seqlen_k = block_table.shape[1] * k_cache.shape[1]
    else:
        seqlen_k = k_cache.shape[1]
    lengths = _cache_lengths(cache_seqlens, batch, seqlen_k, q)
    if cache_leftpad is not None:
        _int32_lengths("cache_leftpad", cache_leftpad, batch)
    causal, window = _mask(causal, window_size, seqlen_k)
    slopes = _alibi(alibi_slopes, q, q.shape[2], batch)
    rotary = _rotary.check(rotary_cos, rotary_sin, q, k, seqlen_k)
    # FlashAttention's kvcache call has no backward; neither does this one. The grad mode
    # set by hand: torch.no_grad() as a context costs a decode step ~2 us of host time.
    grad = torch.is_grad_enabled()
    if grad:
        torch._C._set_grad_enabled(False)
    try:
        if k is not None:
            if cache_seqlens is None:
                raise InvalidArgumentError("k, v given without cache_seqlens: the positions to write them at")
            _shape(k, "k", 4, "(batch, seqlen_new, nheads_k, headdim)")
            if rotary is not None:
                # FlashAttention's positions: the new keys at cache_seqlens + i; the queries there
                # too with causal or a window (each query is the new token of its row), else all at
                # cache_seqlens.
                _on_device(q, k=k, cache_seqlens=lengths)
                q = _rotary.rotate(q, *rotary, lengths, causal or window is not None, interleaved)
                k = _rotary.rotate(k, *rotary, lengths, True, interleaved)
            _append(k_cache, v_cache, k, v, lengths, block_table, cache_batch_idx)
            lengths = lengths + k.shape[1]
        if slopes is not None or cache_leftpad is not None or (block_table is not None and lse):
            # (computed with here: the bias, the gathers)
            _on_device(q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, cache_seqlens=lengths,
                       cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad)
        if block_table is not None:
            if slopes is None and not lse and not pad:
                return _common.attention_paged(q, k_cache, v_cache, block_table, lengths, causal=causal,
                                               window=window, scale=softmax_scale, alignment="bottom_right",
                                               softcap=softcap)
            # attention_paged takes no bias and writes no stats (and a padded head dim would copy
            # the whole pool): each sequence's pages gathered into a dense cache (a copy,
            # (batch, max_num_blocks_per_seq * page_block_size, nheads_k, headdim)).
            if block_table.shape[0] != batch:
                raise InvalidArgumentError(f"block_table has shape {tuple(block_table.shape)}: expected ({batch}, "
                                           "max_num_blocks_per_seq)")
            pages = block_table.reshape(-1).to(torch.int64)
            k_cache, v_cache = (c.index_select(0, pages).view(batch, seqlen_k, *c.shape[2:]) for c in (k_cache, v_cache))
        elif cache_batch_idx is not None or cache_leftpad is not None:
            k_cache, v_cache = _cache_rows(k_cache, v_cache, cache_batch_idx, cache_leftpad, batch)
            if cache_leftpad is not None:
                lengths = lengths - cache_leftpad  # (each sequence's keys now start at 0)
        head_dim_v = None
        if pad:
            q, k_cache, v_cache, softmax_scale, head_dim_v = _pad_head_dims(q, k_cache, v_cache, softmax_scale)
        if slopes is None:
            return _cut_head_dim(_fa_lse(_attend(
                q, k_cache, v_cache, causal=causal, window=window, scale=softmax_scale, seq_lens_q=_full(q, batch, sq),
                seq_lens_kv=lengths, alignment="bottom_right", return_lse=lse, softcap=softcap), lse), head_dim_v)
        # ALiBi as a bias, per sequence at its own bottom right (cuDNN's ALiBi is top-left), with
        # the mask in it (cuDNN refuses a bottom-right mask beside a bias).
        bias = _alibi_bias(slopes, q, sq, seqlen_k, lengths - sq, (causal, window), lengths)
        out = _attend(q, k_cache, v_cache, scale=softmax_scale, seq_lens_q=_full(q, batch, sq), seq_lens_kv=lengths,
                      bias=bias.bias, return_lse=lse, softcap=softcap)
        return _cut_head_dim(_fa_lse(_with_bias(out, bias, lse), lse), head_dim_v)
    finally:
        if grad:
            torch._C._set_grad_enabled(True)


# A paged decode step's options, per (causal, softmax_scale): fastattn.torch's checks of
# them made once, not per step (a decode loop repeats one pair). Bounded: a caller varying
# the scale per call starts it afresh now and then.
_decode_options: dict[tuple[bool, float | None], object] = {}


def _paged_decode(q, k_cache, v_cache, block_table, cache_seqlens, causal: bool, scale: float | None) -> Tensor:
    """flash_attn_with_kvcache's plain paged step (a block table; no new keys, rotary,
    ALiBi, softcap, window or LSE) straight to attention_paged's run with kept options:
    the serving loop's call, without either body's per-call option checks. Anything but
    plain tensors of the usual ranks and head dims that are multiples of 8 takes the full
    body, which checks and reports."""
    # Only what decides between this and the full body is looked at: the ranks and head
    # dims (a head dim not a multiple of 8 is padded there). The rest (dtypes, devices,
    # the table's and the lengths' shapes) enter the plan's key, so a tensor unlike the
    # plan's misses, and the miss checks it and names what is wrong (fastattn.torch._paged._check_paged).
    if not (q.__class__ is Tensor and k_cache.__class__ is Tensor and v_cache.__class__ is Tensor
            and block_table.__class__ is Tensor):
        return _full_body(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale)
    qs, ks, vs = q.shape, k_cache.shape, v_cache.shape
    if not (len(qs) == len(ks) == len(vs) == 4) or qs[3] % 8 or ks[3] % 8 or vs[3] % 8:
        return _full_body(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale)
    if cache_seqlens.__class__ is not Tensor:  # an int or None: FlashAttention's other forms
        table = _shape(block_table, "block_table", 2, "int32 (batch, max_num_blocks_per_seq)")
        cache_seqlens = _cache_lengths(cache_seqlens, qs[0], table[1] * ks[1], q)
    options = _decode_options.get((causal, scale))
    if options is None:
        if len(_decode_options) >= 64:
            _decode_options.clear()
        options = _decode_options[(causal, scale)] = _common.paged_options(causal, False, None, scale,
                                                                            "bottom_right", 0.0)
    if not torch.is_grad_enabled():
        return _common.paged_run(q, k_cache, v_cache, block_table, cache_seqlens, None, options)
    torch._C._set_grad_enabled(False)  # (no backward: see flash_attn_with_kvcache)
    try:
        return _common.paged_run(q, k_cache, v_cache, block_table, cache_seqlens, None, options)
    finally:
        torch._C._set_grad_enabled(True)


def _full_body(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale) -> Tensor:
    # (window_size=None: the same window, and it keeps the call from the fast path)
    return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                                   softmax_scale=scale, causal=causal, window_size=None)


def _int32_lengths(name: str, t, batch: int) -> Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (batch,):
        raise InvalidArgumentError(f"{name}: expected an int32 tensor of shape ({batch},), got "
                                   f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    return t


def _cache_rows(k_cache, v_cache, batch_idx, leftpad, batch: int) -> tuple[Tensor, Tensor]:
    """The dense cache rows of the batch's sequences (cache_batch_idx's, else 0 ... batch -
    1), each shifted left by its cache_leftpad so that its keys start at 0 (one gather: a
    copy of the rows; positions past the row read its last key, past every length)."""
    if batch_idx is not None and (not isinstance(batch_idx, torch.Tensor)
                                  or batch_idx.dtype not in (torch.int32, torch.int64)
                                  or tuple(batch_idx.shape) != (batch,)):
        raise InvalidArgumentError(f"cache_batch_idx: expected an int32 tensor of shape ({batch},), got "
                                   f"{getattr(batch_idx, 'dtype', type(batch_idx).__name__)} "
                                   f"{tuple(getattr(batch_idx, 'shape', ()))}")
    if leftpad is None:
        return k_cache.index_select(0, batch_idx), v_cache.index_select(0, batch_idx)
    s = k_cache.shape[1]
    rows = (batch_idx.to(torch.int64) if batch_idx is not None
            else torch.arange(batch, device=k_cache.device)).view(batch, 1)
    cols = (leftpad.to(torch.int64).view(batch, 1) + torch.arange(s, device=k_cache.device).view(1, s)).clamp_(0, s - 1)
    flat = rows * s + cols  # (batch, s) into the rows flattened: one index_select per cache
    return tuple(c.reshape(-1, *c.shape[2:]).index_select(0, flat.view(-1)).view(batch, s, *c.shape[2:])
                 for c in (k_cache, v_cache))
