"""flash_attn_with_kvcache on fastattn.torch.attention (a dense cache) and
attention_paged (a paged one): the in-place append of new keys and values, per-sequence
lengths at each sequence's bottom right, ALiBi as a bias."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from ... import _fields
from ...errors import InvalidArgumentError, NotSupportedError
from . import _common, _rotary
from ._alibi import _alibi, _alibi_bias, _with_bias
from ._common import (_UNBOUNDED, _attend, _cut_head_dim, _fa_lse, _full, _mask, _on_device, _shape,
                      _unpadded)


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
            q, k_cache, v_cache, softmax_scale, head_dim_v = _common._pad_head_dims(q, k_cache, v_cache, softmax_scale)
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
