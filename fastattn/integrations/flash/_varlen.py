"""flash_attn_varlen_func and its packed variants on fastattn.torch.attention_varlen, and
varlen with an ALiBi bias as a zero-padded dense call (cuDNN's packed plans take no bias)."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from ...errors import InvalidArgumentError
from . import _common, _paged
from ._alibi import _alibi, _alibi_bias, _cudnn_alibi, _with_bias
from ._common import (_attend, _check_dropout, _cut_head_dim, _deterministic, _fa_lse, _mask,
                      _needs_grad, _on_device, _one_query, _pad_head_dims, _shape)
from ._packing import _bucket, _pack, _token_rows, _unpack


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
      gradients into the pools (FlashAttention has no paged backward). See _paged.
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
        lens_k = _paged.key_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k)
        if _paged.paged_plan_fits(q, k, v, block_table, return_attn_probs or _needs_grad(q, k, v), dropout_p, slopes):
            return _paged.attend_pages(q, k, v, block_table, cu_seqlens_q, lens_k, max_seqlen_q, causal, window,
                                       softmax_scale, softcap)
        # (a new cu_seqlens_k: each sequence at its own bottom right, below)
        k, v, cu_seqlens_k = _paged.gather_keys(k, v, cu_seqlens_k, block_table, lens_k)
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
