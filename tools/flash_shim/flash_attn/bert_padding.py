"""`flash_attn.bert_padding`: unpad_input and pad_input, moving between a padded batch
(batch, seqlen, ...) and the packed tokens (total, ...) that the varlen functions take.
Written from FlashAttention's docstrings, in plain PyTorch indexing (differentiable:
autograd's index and index_put stand for FlashAttention's own index functions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Packs the tokens a mask keeps.

    hidden_states: (batch, seqlen, ...); attention_mask: (batch, seqlen), bool or int,
    nonzero for a token that counts; unused_mask (optional, same shape): tokens that are
    allocated but unused, which are packed too but not counted as used.

    Returns (packed (total, ...), indices (total,) int64 into the flattened (batch *
    seqlen) tokens, cu_seqlens (batch + 1,) int32, max_seqlen (a Python int), seqused
    (batch,) int32: each sequence's tokens in attention_mask alone), where total and
    cu_seqlens count the tokens of attention_mask and unused_mask together.
    """
    kept = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max().item()), seqused


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: hidden_states (total, ...) put back at indices (into the
    flattened batch * seqlen tokens) of a zero-filled (batch, seqlen, ...) tensor."""
    rest = hidden_states.shape[1:]
    flat = hidden_states.new_zeros(batch * seqlen, *rest).index_put((indices,), hidden_states)
    return flat.view(batch, seqlen, *rest)
