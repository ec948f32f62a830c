"""fastattn.flash: FlashAttention 2's functions, on cuDNN's fused attention.

    from fastattn.flash import flash_attn_func      # was: from flash_attn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)     # q: (batch, seqlen_q, heads, head_dim)

The names, argument order, defaults, return values and conventions of flash_attn 2.6-2.8
(`flash_attn_interface`): `causal` and `window_size` are aligned at the bottom right
(query i of a sequence sees keys j in [i + seqlen_k - seqlen_q - left, i + seqlen_k -
seqlen_q + right], with each sequence's own lengths in varlen and KV-cache calls),
`softmax_scale` defaults to 1/sqrt(head_dim), `return_attn_probs` returns (out,
softmax_lse, S_dmask) with softmax_lse float32 in FlashAttention's layout and natural
log ((batch, heads, seqlen_q); varlen (heads, total_q)), and gradients flow where
FlashAttention has them (not through flash_attn_with_kvcache). FlashAttention's own
normalizations are kept: causal sets the window's right bound to 0, and a bound of at
least seqlen_k (max_seqlen_k in varlen) is unbounded.

Built on fastattn.torch's entry points (attention, attention_varlen, attention_paged),
whose plans, caches and per-call costs they share. What differs from FlashAttention:

- Arguments cuDNN cannot honour raise NotSupportedError naming them, never silently
  ignored: return_attn_probs with dropout_p > 0 (FlashAttention then returns the dropout
  pattern, S_dmask, which cuDNN does not expose). What FlashAttention refuses is refused too (cache_batch_idx or cache_leftpad
  with a block table; rotary without new keys). cuDNN's own refusals (for example a causal mask at the
  bottom right beside dropout in a varlen call, whose sequences each have their own diagonal)
  are NotSupportedError too, carrying cuDNN's reason.
- Where cuDNN refuses what FlashAttention does, fastattn.flash composes it from what
  cuDNN takes (slower than a direct plan, the same answer):
  - Rows without keys: with more queries than keys the first rows see no key;
    fastattn.flash writes FlashAttention's 0 and +inf there itself and runs the rest (a
    causal mask then has as many queries as keys).
  - One query with gradients or the LSE (cudnn-frontend refuses a training plan of
    s_q = s_kv = 1, its documented check; against more keys cuDNN 9.19's forward is
    not bitwise repeatable, where FlashAttention's is): the query block is padded to
    two rows, the second a padding row (seq_lens_q 1; a copy of q), and o and the LSE
    are sliced back; varlen builds the plan for max_seqlen_q 2 instead (no copy).
    Inference calls of one query run as they are (their last bits may differ between
    identical calls, as in PyTorch's cuDNN backend).
  - Head dims up to 256 that are not multiples of 8: q, k, v padded with zeros to the
    next one, as FlashAttention pads them (a copy of each padded tensor, the packed
    tensor once in the packed functions, each whole cache in flash_attn_with_kvcache after
    the append; none when they are multiples of 8), softmax_scale
    from the real head dim, out cut back (a view).
  - ALiBi with any slopes, causal or not (FlashAttention's -slope * |i + seqlen_k -
    seqlen_q - j|): cuDNN's own ALiBi where that is it (the paper's slopes, causal, as
    many queries as keys, and the other conditions flash_attn_func's alibi_slopes
    lists), else an additive bias built on the device from the slopes ((1 or batch,
    heads, seqlen_q, seqlen_k) in q's dtype: memory and bandwidth of that size), with a
    bottom-right mask folded into it (cuDNN refuses one beside a bias; its tiles are
    then computed). varlen runs it as a zero-padded dense call (copies of q, k, v,
    lengths rounded up to powers of two), a paged cache is gathered into a dense one (a
    copy of the sequences' pages).
  - flash_attn_varlen_func with a block table (paged K/V, FlashAttention's paged
    varlen) runs on cuDNN's paged plan, forward only: q unpacked into a padded batch (a
    copy of q), out packed back. Gradients, the LSE, dropout, ALiBi and head dims that
    are not multiples of 8, which that plan has not, gather the pages each sequence uses
    into packed keys (a copy) and run a varlen call, with its backward into the pools
    (FlashAttention has no paged backward). seqused_k (each sequence's used keys;
    FlashAttention's C++ argument, at the end of the signature here) is the length with
    a block table, and gathers the used keys without one.
  - flash_attn_with_kvcache's rotary embedding (rotary_cos, rotary_sin, interleaved or
    not, any rotary_dim up to the head dim) is applied in PyTorch ops before attending,
    at FlashAttention's positions (a copy of q and of the new keys, which are written
    into the cache rotated). cache_leftpad gathers each sequence's keys to start at 0
    (a copy of the rows, with those of cache_batch_idx), and return_softmax_lse with a
    block table gathers the pages into a dense cache (a copy: cuDNN's paged plans write
    no softmax stats).
- Dropout draws its mask from PyTorch's CUDA generator with cuDNN's Philox: the same
  distribution as FlashAttention's, not the same bits.
- num_splits is a FlashAttention tuning knob that cannot change the answer; it is
  checked (an int >= 0) and cuDNN chooses its own split.
- Asking for the LSE runs the training plan (its forward writes the stats).
- Choosing cuDNN's ALiBi reads the slopes to compare them with the paper's (one
  synchronization), asked only where that ALiBi would otherwise fit: torch.compile does
  it between two graphs (a graph break; fullgraph=True refuses it). A trace of fake or
  meta tensors (make_fx, torch.export) and a CUDA-graph capture read nothing and take
  the bias; a capture needs that plan held already, which an eager call with the
  paper's slopes where cuDNN's ALiBi fits does not build (fastattn.torch then raises
  InvalidArgumentError asking for a warm-up call).
- The packed varlen functions copy q, k, v out of the packed tensor (attention_varlen
  takes contiguous tensors); the dense packed functions take strided views, no copy.

Raises InvalidArgumentError (a ValueError) for bad arguments, naming them, and
NotSupportedError (a NotImplementedError) as above.
"""

from __future__ import annotations

from ._alibi import standard_alibi_slopes  # noqa: F401 - public: the slopes cuDNN computes (fastattn.flash names them)
from ._interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                         flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
