"""fastattn.torch.attention_paged: attention against a paged KV cache, forward only.

FlashAttention's flash_attn_with_kvcache layout: k and v are pools of pages of
page_size tokens, (num_pages, page_size, heads_kv, dim), and an int32 block table lists
each sequence's pages. cuDNN has no paged backward, so there is no autograd here.
"""

from __future__ import annotations

import torch

from ..config import AttentionConfig
from ..errors import InvalidArgumentError
from . import _native, _options
from ._autograd import functorch_active, plain_eager
from ._plans import (DTYPES, Cached, bottom_right, capturing, check_qkv_tensors, logical, out_shape, plans, raw_stream,
                     remember, tensor_key, workspace)
from ._plans import options as check_options


# attention_paged()'s scalar options (_options.OPS["paged"]): part of the plan key as they
# are, and the custom op's arguments after the tensors, in this order.
PagedOptions = _options.named_tuple("paged", "PagedOptions")


_new = tuple.__new__  # PagedOptions(...) without a NamedTuple's Python __new__ (see _dense)


def plan_for(q, k_cache, v_cache, table, seq_lens_q, cache_seqlens, options: PagedOptions) -> Cached:
    key = ("paged", q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(),
           q.dtype, k_cache.dtype, v_cache.dtype, q.get_device(), k_cache.get_device(), v_cache.get_device(),
           tensor_key(table), tensor_key(cache_seqlens), tensor_key(seq_lens_q), options)
    hit = plans.get(key)
    if hit is not None:
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
        padding=True, page_size=page_size, num_pages=pages, **_options.config_fields(options))


# A batch's query lengths when the caller gives none (all seqlen_q): cuDNN's padding mask
# needs a tensor of them. Kept per (device, batch, seqlen_q), except while a CUDA graph
# is captured: a tensor made then is only filled when the graph replays.
_full_lengths: dict[tuple[int, int, int], torch.Tensor] = {}


def _query_lengths(q: torch.Tensor, device: int) -> torch.Tensor:
    b, sq = q.shape[0], q.shape[1]
    if capturing():
        return torch.full((b,), sq, dtype=torch.int32, device=q.device)
    lengths = _full_lengths.get((device, b, sq))
    if lengths is None:
        lengths = _full_lengths[(device, b, sq)] = torch.full((b,), sq, dtype=torch.int32, device=q.device)
    return lengths


def forward_impl(q, k_cache, v_cache, table, cache_seqlens, seq_lens_q, options: PagedOptions) -> torch.Tensor:
    c = plan_for(q, k_cache, v_cache, table, seq_lens_q, cache_seqlens, options)
    if seq_lens_q is None:
        seq_lens_q = _query_lengths(q, c.device)
        o = torch.empty_like(q) if c.out_like_q else q.new_empty(c.out_shape)
    else:
        o = q.new_zeros(c.out_shape)  # rows past a query length are zero (see _dense.forward_impl)
    stream = raw_stream(c.device)
    ws = workspace(q, c.forward_workspace, c.device, stream)
    c.plan.forward(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), o.data_ptr(), 0,
                   ws.data_ptr() if ws is not None else 0, stream, seq_lens_q.data_ptr(), cache_seqlens.data_ptr(),
                   page_table_k=table.data_ptr(), page_table_v=table.data_ptr())
    return o


# -- the custom op: tensors, then PagedOptions' fields in order (its schema from _options) ----

FORWARD_SCHEMA = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor cache_seqlens, "
                  f"Tensor? seq_lens_q, {_options.schema('paged')}) -> Tensor")


def _forward(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, *options):
    return forward_impl(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, PagedOptions(*options))


forward_op = torch.library.custom_op("fastattn::paged_forward", _forward, mutates_args=(), schema=FORWARD_SCHEMA)
_native.PLAN_FOR["paged"] = lambda q, k_cache, v_cache, table, seq_lens_q, cache_seqlens, options: plan_for(
    q, k_cache, v_cache, table, seq_lens_q, cache_seqlens, PagedOptions(*options))  # the op library's misses


@forward_op.register_fake
def _(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, *options):
    # A trace refuses what eager does.
    config_for(q, k_cache, v_cache, block_table, seq_lens_q, cache_seqlens, PagedOptions(*options))
    return q.new_empty(out_shape(q, v_cache, "bshd"))


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


def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    cache_seqlens: torch.Tensor, *, seq_lens_q: torch.Tensor | None = None, causal: bool = False,
                    causal_bottom_right: bool = False, window: tuple[int, int] | None = None,
                    scale: float | None = None, alignment: str | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Attention against a paged KV cache (FlashAttention's flash_attn_with_kvcache
    layout), for decode and for prefill against a cache; forward only (cuDNN has no
    paged backward).

    q: (batch, seqlen_q, heads_q, head_dim_qk); seqlen_q 1 for decode.
    k_cache, v_cache: page pools, (num_pages, page_size, heads_kv, head_dim): float16
      or bfloat16 on q's device, heads_kv dividing heads_q.
    block_table: int32 (batch, pages per sequence), contiguous: each sequence's pages
      in order. The plan's longest KV sequence is pages per sequence * page_size.
    cache_seqlens: int32 (batch,): each sequence's KV length (at most pages per
      sequence * page_size; not checked, as that would synchronize). Rows of a page
      past them may hold anything finite.
    seq_lens_q: int32 (batch,): each sequence's query length (default: all seqlen_q);
      o is zero past it.
    alignment: where the diagonal of causal and window sits, with no default while
      either is used: the layout is flash_attn_with_kvcache's, whose causal is at the
      bottom right, while attention()'s is at the top left, so a port from either would
      silently change its answer under a default. "bottom_right" puts the diagonal at
      the end of each sequence, where the queries of a decode or a chunked prefill sit:
      query i of a sequence sees keys j <= i + cache_seqlens - seq_lens_q (causal);
      "top_left" at its start (j <= i). causal=True without an alignment raises
      InvalidArgumentError, and so does a window. causal_bottom_right=True is
      causal=True with alignment="bottom_right". (fastattn.flash.flash_attn_with_kvcache
      is FlashAttention's function, bottom right.) window, scale and softcap as attention().
      Returns o: (batch, seqlen_q, heads_q, head_dim_v).

    Not bitwise repeatable: cuDNN's paged kernels may sum a row's keys in another order
    from one call to the next (identical eager calls, and a CUDA-graph replay against
    an eager call, were seen an element apart on the H200 with cuDNN 9.19). What is
    promised is the output dtype's rounding: identical calls agree within one unit in
    the last place of o's dtype, element by element.

    Raises InvalidArgumentError for bad inputs (and for inputs that require
    gradients), NotSupportedError when cuDNN refuses the config.
    """
    options = options_for(causal, causal_bottom_right, window, scale, alignment, softcap)
    if torch.is_grad_enabled() and (getattr(q, "requires_grad", False) or getattr(k_cache, "requires_grad", False)
                                    or getattr(v_cache, "requires_grad", False)):
        raise InvalidArgumentError("attention_paged is forward only (cuDNN has no paged backward): call it under "
                                   "torch.no_grad() or on tensors that do not require gradients")
    return run(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, options)


def options_for(causal, causal_bottom_right, window, scale, alignment, softcap) -> PagedOptions:
    """attention_paged()'s scalar arguments, checked, as its plans' options (what a caller
    that makes many calls with the same arguments may keep: fastattn.flash's decode)."""
    left, right, scale = check_options(causal, causal_bottom_right, window, scale)
    if softcap.__class__ is not float or softcap != 0.0:
        softcap = _options.positive_or_zero("softcap", softcap)
    if alignment is None:
        if (causal or (left, right) != (-1, -1)) and not causal_bottom_right:
            raise InvalidArgumentError(
                f"attention_paged({'causal=True' if causal else f'window={window!r}'}) needs an explicit alignment: "
                "'bottom_right' (FlashAttention's flash_attn_with_kvcache: the queries at the end of each sequence) "
                "or 'top_left' (scaled_dot_product_attention's is_causal)")
        br = bool(causal_bottom_right)
    else:
        br = bottom_right(alignment, causal_bottom_right)
        if causal_bottom_right and alignment == "top_left":
            raise InvalidArgumentError("causal_bottom_right=True and alignment='top_left' contradict each other")
    return _new(PagedOptions, (bool(causal or causal_bottom_right), br, left, right, scale, softcap))


def run(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, options: PagedOptions) -> torch.Tensor:
    """attention_paged() once its options are checked (options_for) and no input needs a
    gradient: the native op where fastattn.torch runs on it, else the Python one."""
    # Plain CUDA tensors: checked once per plan, in plan_for; anything else (fake tensors
    # too) on every call (see _dense.attention).
    cuda = q.__class__ is torch.Tensor and q.is_cuda
    if not cuda:
        _check_paged(q, k_cache, v_cache, block_table, seq_lens_q, cache_seqlens)
    native = _native.PAGED
    if native is not None:  # the native path (see _dense.attention)
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
