"""`flash_attn.layers.rotary.apply_rotary_emb`, in plain PyTorch, from FlashAttention's
documented semantics: the first rotary_dim = 2 * cos.shape[-1] features of each head are
rotated by pairs, the rest pass unchanged; GPT-NeoX pairs (i, i + rotary_dim / 2) unless
interleaved (GPT-J pairs (2i, 2i + 1)). A pair (x0, x1) at position p becomes
(x0 cos[p] - x1 sin[p], x0 sin[p] + x1 cos[p]), computed in float32 and rounded once to
x's dtype, as FlashAttention's kernel does. A position at or past seqlen_ro is left as it
is (FlashAttention's kernel reads cos 1, sin 0 there)."""

from __future__ import annotations

import torch


def _positions(x, seqlen_offsets, cu_seqlens):
    """Each token's position: (batch, seqlen) for x (batch, seqlen, heads, dim), (total,) for
    packed x (total, heads, dim) with cu_seqlens, where a token's position counts from its
    own sequence's start. seqlen_offsets (an int, or (batch,) ints) shifts each sequence."""
    device = x.device
    if cu_seqlens is None:
        pos = torch.arange(x.shape[1], device=device).view(1, -1)
        if isinstance(seqlen_offsets, torch.Tensor):
            return pos + seqlen_offsets.to(device=device, dtype=torch.int64).view(-1, 1)
        return (pos + seqlen_offsets).expand(x.shape[0], -1)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    token = torch.arange(x.shape[0], device=device)
    seq = torch.searchsorted(cu[1:], token, right=True)  # the sequence each token belongs to
    pos = token - cu[seq]
    if isinstance(seqlen_offsets, torch.Tensor):
        return pos + seqlen_offsets.to(device=device, dtype=torch.int64)[seq]
    return pos + seqlen_offsets


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """x (batch, seqlen, heads, headdim), or (total, heads, headdim) with cu_seqlens (batch +
    1,) int32 (max_seqlen is accepted for FlashAttention's signature; the positions do not
    need it); cos, sin: (seqlen_ro, rotary_dim / 2); seqlen_offsets: an int or a (batch,)
    int tensor, each sequence's first position. Returns the rotated tensor (x itself,
    written, with inplace=True)."""
    if cos.shape != sin.shape or cos.dim() != 2:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)}: expected one shape (seqlen_ro, "
                         "rotary_dim / 2)")
    seqlen_ro, half = cos.shape
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} > headdim {x.shape[-1]}")
    pos = _positions(x, seqlen_offsets, cu_seqlens)
    inside = ((pos >= 0) & (pos < seqlen_ro)).unsqueeze(-1)
    at = pos.clamp(0, seqlen_ro - 1)
    c = torch.where(inside, cos.float()[at], 1.0).unsqueeze(-2)  # (..., 1, half): every head alike
    s = torch.where(inside, sin.float()[at], 0.0).unsqueeze(-2)
    xr = x[..., :rotary_dim].float()
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
    y0, y1 = x0 * c - x1 * s, x0 * s + x1 * c
    rotated = torch.stack((y0, y1), dim=-1).flatten(-2) if interleaved else torch.cat((y0, y1), dim=-1)
    out = torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)
    if inplace:
        x.copy_(out)
        return x
    return out
