"""attention_paged()'s op (the entry point is in _api): attention against a paged KV cache,
forward only.

FlashAttention's flash_attn_with_kvcache layout: k and v are pools of pages of
page_size tokens, (num_pages, page_size, heads_kv, dim), and an int32 block table lists
each sequence's pages. cuDNN has no paged backward, so there is no autograd here.

What a call is, is _specs.PAGED; its execution and its custom op fastattn::paged_forward
(with its fake kernel) are made from it (_executor.install). This module keeps the plan
lookup, the checks and the query lengths a call without seq_lens_q runs with.
"""

from __future__ import annotations

import sys

import torch

from .. import bounded
from ..config import AttentionConfig
from ..errors import InvalidArgumentError
from . import _executor, _native, _specs
from ._executor import functorch_active, plain_eager
# (raw_stream and workspace: the executor's, which runs in this module's namespace)
from ._plans import (CLOCK, DTYPES, CachedPlan, capturing, check_qkv_tensors, logical, out_shape, plans, raw_stream,  # noqa: F401
                     remember, tensor_key, workspace)

SPEC = _specs.PAGED
# attention_paged()'s scalar options (SPEC.options): part of the plan key as they are,
# and the custom op's arguments after the tensors, in this order.
PagedOptions = _specs.named_tuple("paged", "PagedOptions")


def plan_for(q, k_cache, v_cache, table, cache_seqlens, seq_lens_q, o, options: PagedOptions) -> CachedPlan:
    key = ("paged", q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(),
           q.dtype, k_cache.dtype, v_cache.dtype, q.get_device(), k_cache.get_device(), v_cache.get_device(),
           tensor_key(table), tensor_key(cache_seqlens), tensor_key(seq_lens_q), options)
    hit = plans.get(key)
    if hit is not None:
        hit.used = CLOCK[0]
        return hit
    cfg = config_for(q, k_cache, v_cache, table, seq_lens_q, cache_seqlens, options)
    return remember(key, cfg, q, k_cache, v_cache, "bshd")


def config_for(q, k_cache, v_cache, table, seq_lens_q, cache_seqlens, options: PagedOptions) -> AttentionConfig:
    """The call's AttentionConfig, every check made: a miss's (plan_for) and a trace's
    (the forward op's fake kernel), so that a traced call refuses what an eager one does."""
    _check_paged(q, k_cache, v_cache, table, seq_lens_q, cache_seqlens)
    (b, hq, sq, dqk), q_st = logical(q, "bshd")
    (pages, hkv, page_size, _), k_st = logical(k_cache, "bshd")  # a page is a "sequence" of page_size tokens
    (_, _, _, dv), v_st = logical(v_cache, "bshd")
    _, o_st = logical(q.new_empty(out_shape(q, v_cache, "bshd"), device="meta"), "bshd")
    return AttentionConfig(
        batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_kv=table.shape[1] * page_size, head_dim_qk=dqk,
        head_dim_v=dv, dtype=DTYPES[q.dtype], layout={"q": q_st, "k": k_st, "v": v_st, "o": o_st},
        padding=True, page_size=page_size, num_pages=pages, **_specs.config_fields(options))


def check_traced(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, options: PagedOptions) -> None:
    """The forward op's fake kernel's checks: a miss's."""
    config_for(q, k_cache, v_cache, block_table, seq_lens_q, cache_seqlens, options)


# A batch's query lengths when the caller gives none (all seqlen_q): cuDNN's padding mask
# needs a tensor of them. Kept per (device, stream, batch, seqlen_q), at most
# FASTATTN_MEMORY_MAX_ENTRIES (fastattn.bounded), except while a CUDA graph is captured:
# a tensor made then is only filled when the graph replays. Per stream: one is made on the
# stream that reads it, and when one is dropped, the caching allocator reuses its memory
# on that stream only after the reads queued there.
_full_lengths = bounded.Table("arrays")


def query_lengths(q: torch.Tensor, device: int) -> torch.Tensor:
    """seq_lens_q's slot when the call passes none (SPEC's `absent`)."""
    b, sq = q.shape[0], q.shape[1]
    if capturing():
        return torch.full((b,), sq, dtype=torch.int32, device=q.device)
    stream = raw_stream(device)
    lengths = _full_lengths.get((device, stream, b, sq))
    if lengths is None:
        lengths = _full_lengths.keep((device, stream, b, sq),
                                     torch.full((b,), sq, dtype=torch.int32, device=q.device))
    return lengths


# The work and the custom op (with its fake kernel): made from SPEC (no backward: cuDNN has none).
forward_impl, backward_impl, forward_op, backward_op = _executor.install(SPEC, sys.modules[__name__], PagedOptions)
_native.PLAN_FOR[SPEC.name] = plan_for, PagedOptions  # the op library's misses


def _check_lengths(name: str, t, batch: int, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.shape != (batch,):
        raise InvalidArgumentError(f"{name}: expected an int32 tensor of shape ({batch},), one length per sequence, "
                                   f"got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device or not t.is_contiguous():
        raise InvalidArgumentError(f"{name} must be contiguous and on {device}, like q; it is on {t.device}")


def _check_paged(q, k_cache, v_cache, table, seq_lens_q, cache_seqlens) -> None:
    check_qkv_tensors(q, k_cache, v_cache, 4, "q: (batch, seqlen_q, heads_q, dim); k_cache, v_cache: "
                       "(num_pages, page_size, heads_kv, dim)")
    if not (q.device == k_cache.device == v_cache.device) or not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise InvalidArgumentError("q, k_cache, v_cache must share one device and one dtype")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise InvalidArgumentError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in "
                                   "pages, page size or heads")
    if q.shape[2] % k_cache.shape[2] or k_cache.shape[3] != q.shape[3]:
        raise InvalidArgumentError(f"q {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)}: heads_kv must "
                                   "divide heads_q, and the head dims must match")
    batch = q.shape[0]
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != batch:
        raise InvalidArgumentError(f"block_table: expected an int32 tensor (batch={batch}, pages per sequence), got "
                                   f"{getattr(table, 'dtype', type(table).__name__)} "
                                   f"{tuple(getattr(table, 'shape', ()))}")
    if table.device != q.device or not table.is_contiguous():
        raise InvalidArgumentError(f"block_table must be contiguous and on {q.device}, like q")
    _check_lengths("cache_seqlens", cache_seqlens, batch, q.device)
    if seq_lens_q is not None:
        _check_lengths("seq_lens_q", seq_lens_q, batch, q.device)


def run(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, options: PagedOptions) -> torch.Tensor:
    """attention_paged() once its options are checked (options_for) and no input needs a
    gradient: the native op where fastattn.torch runs on it, else the Python one."""
    # Plain CUDA tensors: checked once per plan, in plan_for; anything else (fake tensors
    # too) on every call (see _api.attention).
    cuda = q.__class__ is torch.Tensor and q.is_cuda
    if not cuda:
        _check_paged(q, k_cache, v_cache, block_table, seq_lens_q, cache_seqlens)
    native = _native.PAGED
    if native is not None:  # the native path (see _api.attention)
        if compiling():
            if native is not _native.UNDECIDED:
                _check_paged(q, k_cache, v_cache, block_table, seq_lens_q, cache_seqlens)  # its Meta kernel does not
                return native[1](q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, *options)
        elif cuda and not functorch_active():
            if native is _native.UNDECIDED:
                _native.decide()
                native = _native.PAGED
            if native is not None:
                return native[0](q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, *options)
    if cuda and plain_eager(q):
        return forward_impl(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, options)
    if cuda:  # dynamo's fake tensors look like plain CUDA ones, and its trace reaches no plan_for
        _check_paged(q, k_cache, v_cache, block_table, seq_lens_q, cache_seqlens)
    return forward_op(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, *options)


compiling = torch.compiler.is_compiling
