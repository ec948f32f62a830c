"""Packed sequences (FlashAttention's varlen layout) and zero-padded dense batches, one into
the other, on the device (gathers; no synchronization, and gradients flow back through
them): what the varlen compositions share."""

from __future__ import annotations

import torch
from torch import Tensor


def _bucket(n: int) -> int:
    """attention_varlen's plan length for a longest sequence of n: the next power of two
    (so that batches of other lengths share the plan)."""
    return 1 << max(0, n - 1).bit_length()


def _unpack(t: Tensor, cu: Tensor, lens: Tensor, rows: int) -> Tensor:
    """Packed (total, heads, dim) as (batch, rows, heads, dim), zeros past each length."""
    b = cu.shape[0] - 1
    if t.shape[0] == 0:
        return t.new_zeros(b, rows, *t.shape[1:])
    pos = torch.arange(rows, device=t.device, dtype=cu.dtype)
    padding = pos.view(1, rows) >= lens.view(b, 1)  # (not ~: fake CUDA tensors without CUDA cannot)
    # Clamped: lengths past the tensor (cu_seqlens unchecked, as FlashAttention's) read its last token, never
    # past it.
    idx = (cu.narrow(0, 0, b).view(b, 1) + pos.view(1, rows)).clamp_(0, t.shape[0] - 1).masked_fill_(padding, 0)
    return t.index_select(0, idx.view(-1).long()).view(b, rows, *t.shape[1:]).masked_fill_(padding.view(b, rows, 1, 1),
                                                                                              0)


def _token_positions(cu: Tensor, total: int) -> tuple[Tensor, Tensor, Tensor]:
    """For each of `total` packed tokens: its sequence (clamped to the last), its position
    in it, and whether it lies inside the sequences (before cu_seqlens[-1])."""
    b = cu.shape[0] - 1
    tok = torch.arange(total, device=cu.device, dtype=cu.dtype)
    seq = torch.searchsorted(cu.narrow(0, 1, b), tok, right=True)
    inside = seq < b
    seq = seq.clamp_(max=b - 1)
    return seq, tok - cu.index_select(0, seq), inside


def _token_rows(cu: Tensor, total: int, rows: int) -> Tensor:
    """For each packed token, its row of the dense (batch * rows) block, or -1 for tokens past cu_seqlens[-1] or
    past rows."""
    seq, pos, inside = _token_positions(cu, total)
    return torch.where(inside & (pos < rows), seq * rows + pos, -1)


def _pack(dense: Tensor, rows_of: Tensor, dim: int, fill: float = 0.0) -> Tensor:
    """dense's rows (along dim) for each packed token (_token_rows), fill where it has none."""
    none = rows_of < 0
    out = dense.index_select(dim, rows_of.clamp(min=0))
    return out.masked_fill_(none.view(-1, *[1] * (out.dim() - 1 - dim)) if dim == 0 else none, fill)
