"""flash_attn_func, flash_attn_qkvpacked_func and flash_attn_kvpacked_func on
fastattn.torch.attention, with the rows that see no key cut before cuDNN sees them."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from ...errors import InvalidArgumentError
from ._alibi import _alibi, _alibi_bias, _cudnn_alibi, _with_bias
from ._common import (_attend, _check_dropout, _cut_head_dim, _deterministic, _fa_lse, _full, _mask, _pad_head_dim,
                      _pad_head_dims, _shape, _unpadded)


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
    if bottom and sq > sk:  # cuDNN takes it only with per-sequence lengths
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
