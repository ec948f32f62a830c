"""flash_attn_varlen_func's block_table and seqused_k: packed queries against a paged KV
cache, or against packed keys of which each sequence uses only its first seqused_k.

FlashAttention's semantics (flash_api.cpp's mha_varlen_fwd, block_info.h): with a block
table, k and v are page pools (num_blocks, page_block_size, nheads_k, headdim), sequence
b's keys are its pages in block_table[b]'s order, and cu_seqlens_k gives only each
sequence's key length (its differences); seqused_k, where given, is the length instead.
Without a block table, cu_seqlens_k places each sequence in k and seqused_k says how many
of its keys are used. The masks sit at each sequence's bottom right with that length.

Two paths, chosen per call:
- cuDNN's paged plan (fastattn.torch.attention_paged), forward only: q unpacked into a
  zero-padded (batch, max_seqlen_q rounded up to a power of two, nheads, headdim) batch
  with each sequence's query length (a copy of q), out packed back. It runs where the
  plan has what the call asks: a block table, no gradients, no LSE, no dropout, no ALiBi,
  head dims that are multiples of 8.
- Otherwise the keys each sequence uses are gathered into packed k, v (copies:
  batch * max_num_blocks_per_seq * page_block_size tokens with a block table, k's
  token count without) with cumulative lengths of their own, and the call runs as a
  plain varlen call (attention_varlen, with its backward; the gradients flow back through
  the gather into the pool or k). cuDNN has no paged backward and its paged plans write
  no softmax stats, so training, the LSE, dropout and ALiBi take this path, as does
  seqused_k without a block table (cuDNN's packed plans take their lengths from one
  cumulative tensor).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import InvalidArgumentError
from . import _common
from ._common import _on_device, _shape, _unpadded
from ._packing import _bucket, _pack, _token_positions, _token_rows, _unpack


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
    """Whether cuDNN's paged plan computes this call (see the module doc)."""
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
