"""flash_attn_with_kvcache's rotary embedding, in PyTorch ops (it is elementwise; cuDNN's
graph has none): FlashAttention's semantics (its kernel, flash_fwd_kernel.h, and its
reference, flash_attn.layers.rotary.apply_rotary_emb).

rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2); the first rotary_dim features of each
head are rotated, the rest pass unchanged. Interleaved (GPT-J): pairs (0, 1), (2, 3), ...;
not interleaved (GPT-NeoX): pairs (i, i + rotary_dim / 2). A pair (x0, x1) at position p
becomes (x0 cos - x1 sin, x0 sin + x1 cos) with cos, sin = rotary_cos[p], rotary_sin[p],
computed in float32 and rounded once to x's dtype. A position past seqlen_ro is not
rotated (cos 1, sin 0), as apply_rotary_emb does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import InvalidArgumentError
from ._common import _on_device


def check(rotary_cos, rotary_sin, q: Tensor, k, seqlen_cache: int) -> tuple[Tensor, Tensor] | None:
    """(cos, sin) checked, or None without rotary. FlashAttention's rules: both or neither,
    only with new keys to append, rotary_dim <= headdim, and at least seqlen_cache
    positions (flash_api.cpp). Any floating dtype (FlashAttention takes q's only)."""
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        raise InvalidArgumentError("rotary_cos and rotary_sin: give both (the rotary embedding's tables) or neither")
    if k is None:
        raise InvalidArgumentError("rotary_cos, rotary_sin without k, v: FlashAttention applies the rotary embedding "
                                   "to q and to the new keys it appends, and needs them (pass k and v)")
    d = q.shape[-1]
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise InvalidArgumentError(f"{name}: expected a floating-point tensor (seqlen_ro, rotary_dim / 2), got "
                                       f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if rotary_cos.shape != rotary_sin.shape:
        raise InvalidArgumentError(f"rotary_cos has shape {tuple(rotary_cos.shape)}, rotary_sin "
                                   f"{tuple(rotary_sin.shape)}: expected one shape")
    seqlen_ro, half = rotary_cos.shape
    if not 1 <= 2 * half <= d:
        raise InvalidArgumentError(f"rotary_cos has shape {tuple(rotary_cos.shape)}: rotary_dim = 2 * {half} must be "
                                   f"in [2, headdim = {d}]")
    if seqlen_ro < seqlen_cache:
        raise InvalidArgumentError(f"rotary_cos has {seqlen_ro} positions: expected at least the cache's "
                                   f"{seqlen_cache} (FlashAttention's check)")
    _on_device(q, rotary_cos=rotary_cos, rotary_sin=rotary_sin)
    return rotary_cos, rotary_sin


def rotate(x: Tensor, cos: Tensor, sin: Tensor, start: Tensor, per_row: bool, interleaved: bool) -> Tensor:
    """x (batch, seqlen, heads, headdim) rotated, a new tensor: row i of sequence b at
    position start[b] + i (per_row), else every row at start[b]."""
    b, s = x.shape[0], x.shape[1]
    seqlen_ro, half = cos.shape
    pos = start.to(torch.int64).view(b, 1)
    if per_row:
        pos = pos + torch.arange(s, device=x.device).view(1, s)
    inside = ((pos >= 0) & (pos < seqlen_ro)).unsqueeze(-1).unsqueeze(-1)  # (b, s or 1, 1, 1)
    idx = pos.clamp(0, seqlen_ro - 1).view(-1)
    c, sn = (t.index_select(0, idx).view(b, pos.shape[1], 1, half).float() for t in (cos, sin))
    c = torch.where(inside, c, torch.ones_like(c))
    sn = torch.where(inside, sn, torch.zeros_like(sn))
    r = 2 * half
    xr = x[..., :r].float()
    x0, x1 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :half], xr[..., half:])
    o0, o1 = x0 * c - x1 * sn, x0 * sn + x1 * c
    rotated = (torch.stack((o0, o1), -1).flatten(-2) if interleaved else torch.cat((o0, o1), -1)).to(x.dtype)
    return rotated if r == x.shape[-1] else torch.cat((rotated, x[..., r:]), -1)
