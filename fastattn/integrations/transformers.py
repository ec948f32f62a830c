"""fastattn.integrations.transformers: every attention layer of a HuggingFace transformers
model on fastattn, by name.

    import fastattn.integrations.transformers        # registers "fastattn"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="fastattn")
    model.set_attn_implementation("fastattn")         # or switch a loaded model

Importing the module registers an attention function and a mask function under the name
"fastattn" with transformers' `AttentionInterface` and `AttentionMaskInterface`, through
the classes (`register()`: a function written into one instance's mapping is not seen by
the models, whose masks would all become None). Written against transformers 5.17.

The mask function runs once per forward pass and mask type (transformers shares its
result between the layers) and hands the layers a `FastattnMask`: what fastattn runs the
mask as, decided there once:
- the pattern, from transformers' own mask functions (causal, a causal sliding window,
  bidirectional, packed sequences from restarting position_ids): causal masks at the top
  left (prefill) or bottom right (a KV cache: the queries are the last of the keys), the
  window (transformers' `kv_idx > q_idx - sliding_window`: window (sliding_window - 1, 0));
- the 2-D padding mask: none (all kept), a right-padded prefill as per-sequence lengths
  (fastattn's padding mask: no bias), and any other padding, left padding included, as an
  additive key bias (batch, 1, 1, seq_kv): 0 where a key is kept, the dtype's finfo.min
  where not (a row that sees no key, a padding row of a left-padded prefill, stays finite:
  its output is never used, as in transformers' sdpa path). No token is gathered or copied:
  fastattn's ragged entry takes per-sequence starts only as cumulative lengths, which
  cannot skip the padding at the start of each row, so the zero-copy form for left padding
  is this bias, b * seq_kv elements built once per forward; what it costs is the kernel
  reading it (and with gradients, one row expanded over the queries per layer).
  Telling these apart reads the mask's values (one synchronization per forward, as
  transformers' own sdpa and flash masks do); while torch.compile traces or a CUDA graph
  is captured nothing is read and a padding mask is always the bias (exact);
- anything else (chunked attention, bidirectional overlays, static caches whose queries
  sit before the end of the keys, packed sequences traced by torch.compile): transformers'
  own boolean mask (its `sdpa_mask`), materialized, run as a bias (exact, slower).

The attention function then calls fastattn.torch.attention on (batch, seq, heads, dim)
views of transformers' tensors (no copy; GQA as it is), or attention_varlen for packed
sequences (transformers' `cu_seq_lens_q/k` and `max_length_q/k` keywords, as its flash
path takes them, or the mask's), with `scaling`, `dropout`, `softcap` and `s_aux` sinks
(cast to float32, fastattn's sinks dtype: a tiny copy whose gradient reaches the model's
parameter). A decode step with sinks (one query) runs as two copies of the query, the
second kept, since cuDNN refuses sinks with one query. A left-padded batch's decode steps
and chunked prefill (the key bias beside the cache's bottom-right diagonal) run on cuDNN in
the form it takes (fastattn.AttentionConfig's alignment). Where cuDNN refuses a combination
(for example sinks with one query at the top left of several keys) the layer runs an exact
float32 computation in PyTorch instead, never a wrong answer: counted by reason in
fastattn.stats()["fallbacks"]["transformers"], and logged the first time for each reason.

"paged|fastattn" (paged_attention_forward, registered beside it): transformers' continuous
batching (generate_batch, transformers serve), which switches a "fastattn" model to it.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from fastattn import NotSupportedError
from fastattn.runtime import count_fallback
from fastattn.torch import attention, attention_varlen, scaled_dot_product_attention

NAME = "fastattn"
__all__ = ["NAME", "FastattnMask", "register", "attention_forward", "attention_mask", "paged_attention_forward"]


class FastattnMask(NamedTuple):
    """What one mask type of one forward pass runs as (the mask function's result).

    causal: a causal mask; bottom_right: its diagonal (and the window's) at the bottom
      right (a KV cache), else the top left.
    window_left: keys further back than this are masked (-1: none).
    seq_lens: int32 (batch,) per-sequence lengths of a right-padded prefill, or None.
    bias: (batch, 1, 1, seq_kv) additive key bias in the model's dtype, or None.
    cu_seqlens, max_seqlen: packed sequences (int32 (n + 1,), a Python int), or None, 0.
    full: transformers' own boolean mask (batch, 1, seq_q, seq_kv), or None; when set it
      is the whole mask and the fields above are unused.
    empty: (batch, seq_q) boolean, True on the query rows that see no key (the padding
      rows of a left-padded prefill), or None: their outputs are zeros, as in
      transformers' sdpa path (a left-padded batch's last padding row predicts the first
      token, so the loss sees it)."""

    causal: bool = True
    bottom_right: bool = False
    window_left: int = -1
    seq_lens: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    full: torch.Tensor | None = None
    empty: torch.Tensor | None = None


def register(name: str = NAME) -> None:
    """Register the attention and mask functions under `name` with transformers' classes
    (AttentionInterface.register, AttentionMaskInterface.register), for every model.
    Raises ImportError where transformers is not installed (pip install fastattn[transformers])."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    AttentionInterface.register(f"paged|{name}", paged_attention_forward)


# -- the mask function ------------------------------------------------------------------------

def _codes():
    from transformers import masking_utils as mu

    return {"and": mu.and_masks(mu.causal_mask_function).__code__,
            "window": mu.sliding_window_overlay(1).__code__,
            "packed": mu.packed_sequence_mask_function(torch.zeros(1, 1)).__code__}


def _pattern(fn, codes) -> dict | None:
    """transformers' mask function as {"causal", "window", "packed"}, or None where it is
    anything else (read from the closures transformers builds them with)."""
    from transformers import masking_utils as mu

    if fn is mu.causal_mask_function:
        return {"causal": True, "window": None, "packed": None}
    if fn is mu.bidirectional_mask_function:
        return {"causal": False, "window": None, "packed": None}
    code = getattr(fn, "__code__", None)
    if code is codes["window"]:
        return {"causal": None, "window": inspect.getclosurevars(fn).nonlocals["sliding_window"], "packed": None}
    if code is codes["packed"]:
        return {"causal": None, "window": None, "packed": inspect.getclosurevars(fn).nonlocals["packed_sequence_mask"]}
    if code is not codes["and"]:
        return None
    out = {"causal": None, "window": None, "packed": None}
    for part in inspect.getclosurevars(fn).nonlocals["mask_functions"]:
        p = _pattern(part, codes)
        if p is None:
            return None
        for name, value in p.items():
            if value is not None:
                if out[name] is not None and out[name] != value:
                    return None
                out[name] = value
    return out


def _readable(t: torch.Tensor | None) -> bool:
    """Whether values can be read here: not while torch.compile traces (no branch on
    values), nor while a CUDA graph is captured (no synchronization)."""
    if t is None:
        return True
    if torch.compiler.is_compiling() or t.__class__ is not torch.Tensor or t.is_meta:
        return False
    return not _capturing(t)


def _capturing(t: torch.Tensor) -> bool:
    """Whether t's device is capturing a CUDA graph on this thread's stream."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask: torch.Tensor | None = None, local_size: int | None = None, dtype=torch.float32,
                   device="cpu", use_vmap: bool = False, **kwargs) -> FastattnMask:
    """transformers' mask interface ("fastattn"): the 2-D padding mask (batch, seen + new
    tokens) and mask function of one mask type, as a FastattnMask (see the module)."""
    from transformers import masking_utils as mu

    if mask_function is None:
        mask_function = mu.causal_mask_function
    pattern = _pattern(mask_function, _codes())
    padding = None
    if attention_mask is not None:
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + kv_length]
    shift = None  # where the diagonal is: query i sees key j <= i + shift
    if isinstance(q_offset, int) and isinstance(kv_offset, int):
        shift = q_offset - kv_offset
    aligned = shift in (0, kv_length - q_length)
    if pattern is not None and pattern["packed"] is not None and not _readable(pattern["packed"]):
        pattern = None
    if pattern is None or not aligned or (pattern["packed"] is not None and padding is not None):
        full = _full(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, local_size,
                     device, use_vmap)
        return FastattnMask(full=full, empty=~full.any(-1).reshape(full.shape[0], -1))
    causal = pattern["causal"] is not False
    window = pattern["window"]
    form = FastattnMask(causal=causal, bottom_right=shift != 0, window_left=-1 if window is None else window - 1)
    if pattern["packed"] is not None:
        cu, longest = _packed(pattern["packed"])
        return form._replace(cu_seqlens=cu, max_seqlen=longest)
    if padding is None:
        return form
    if not _readable(padding):
        return form._replace(bias=_key_bias(padding, dtype), empty=_empty_rows(padding, form, q_length))
    lens = padding.sum(-1, dtype=torch.int32)
    checks = [(lens == kv_length).all()]
    prefill = q_length == kv_length and shift == 0
    if prefill:  # right padding: each row's kept keys first
        checks.append((padding == (torch.arange(kv_length, device=padding.device) < lens[:, None])).all())
    elif q_length == 1 and shift == kv_length - 1:  # a decode step: its query sees the last key, window or not
        checks.append(padding[:, -1].all())
    all_kept, *flag = torch.stack(checks).tolist()  # the one synchronization
    if all_kept:
        return form
    if prefill and flag[0]:
        return form._replace(seq_lens=lens.contiguous())
    # A decode step whose last key is kept everywhere has no row that sees no key: nothing to
    # count (the left-padded batch's every step; its key bias is all that is built).
    empty = None if flag and not prefill and flag[0] else _empty_rows(padding, form, q_length)
    return form._replace(bias=_key_bias(padding, dtype), empty=empty)


def _empty_rows(padding: torch.Tensor, form: FastattnMask, q_length: int) -> torch.Tensor:
    """(batch, seq_q): the query rows whose keys (causal mask, window, padding) are all
    masked, from counts of kept keys (batch x keys work, no (seq_q, seq_kv) mask)."""
    b, skv = padding.shape
    counts = torch.nn.functional.pad(padding.int().cumsum(-1), (1, 0))  # kept keys before each position
    i = torch.arange(q_length, device=padding.device)
    diag = i + (skv - q_length if form.bottom_right else 0)
    hi = diag.clamp(max=skv - 1) if form.causal else torch.full_like(i, skv - 1)
    lo = (diag - form.window_left).clamp(min=0) if form.window_left >= 0 else torch.zeros_like(i)
    kept = counts[:, (hi + 1).clamp(min=0)] - counts[:, lo.clamp(max=skv)]
    return (kept <= 0) | (hi < lo)[None]


def _key_bias(padding: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not dtype.is_floating_point or dtype == torch.float32:
        dtype = torch.bfloat16  # fastattn runs float16 and bfloat16 (the layers' inputs decide: _bias_for)
    low = torch.finfo(dtype).min
    return torch.where(padding, 0.0, low).to(dtype)[:, None, None, :]


def _full(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, local_size, device,
          use_vmap) -> torch.Tensor:
    from transformers import masking_utils as mu

    m = mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=False, use_vmap=use_vmap, device=device)
    return m


def _packed(seq_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative lengths of packed sequences from transformers' per-token sequence index
    (batch, seq); rows are concatenated, each row's sequences its own. One synchronization."""
    b, s = seq_ids.shape
    ids = (seq_ids + torch.arange(b, device=seq_ids.device)[:, None] * (s + 1)).reshape(-1)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    cu = torch.cat([starts.nonzero().reshape(-1), ids.new_tensor([ids.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


# -- the attention function -------------------------------------------------------------------

def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface ("fastattn"). query (batch, heads_q, seq_q, dim),
    key / value (batch, heads_kv, seq_kv, dim / dim_v), float16 or bfloat16 CUDA tensors;
    attention_mask: a FastattnMask (the mask function's), None, or a mask of the caller's
    own (boolean or additive, broadcastable to (batch, heads_q, seq_q, seq_kv)). Returns
    ((batch, seq_q, heads_q, dim_v), None), as transformers' sdpa path."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seq, heads, dim) views
    scale = scaling
    sinks = None if s_aux is None else s_aux.float()
    cap = float(softcap) if softcap else 0.0
    dropout = float(dropout)
    if isinstance(attention_mask, torch.Tensor):  # the caller's own mask, as sdpa takes it
        if sinks is None and not cap:
            o = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scale, enable_gqa=query.shape[1] != key.shape[1])
            return o.transpose(1, 2).contiguous(), None
        attention_mask = FastattnMask(full=attention_mask)
    if attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        window = -1 if sliding_window is None else sliding_window - 1
        form = FastattnMask(causal=causal, bottom_right=q.shape[1] != k.shape[1], window_left=window)
    else:
        form = attention_mask
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None:
        form = form._replace(cu_seqlens=cu_q, max_seqlen=0, full=None)
    try:
        if form.cu_seqlens is not None:
            return _varlen(q, k, v, form, cu_k, kwargs, scale, dropout, cap, sinks), None
        return _dense_call(q, k, v, form, scale, dropout, cap, sinks), None
    except NotSupportedError as e:
        # Counted and, the first time for its reason, logged (fastattn.stats()["fallbacks"]).
        count_fallback("transformers", str(e))
        return _eager(q, k, v, form, scale, dropout, cap, sinks, module), None


def paged_attention_forward(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            attention_mask, cache, cu_seq_lens_q: torch.Tensor, cu_seq_lens_k, max_seqlen_q: int,
                            max_seqlen_k, block_table: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' continuous batching ("paged|fastattn": `generate_batch`, `transformers
    serve`; a model loaded with attn_implementation="fastattn" is switched to it). q (1,
    heads_q, total_q, dim), k / v (1, heads_kv, total_q, dim): the new tokens of every
    sequence of the batch, packed. Their keys and values are written into the paged cache
    and every sequence's keys read back packed (`cache.update`, as transformers' paged flash
    path does), then fastattn.torch.attention_varlen runs each sequence's queries against
    its keys, causal at the bottom right (the queries are the last of the keys), with the
    layer's sliding window, scaling and softcap. attention_mask is not read (transformers
    5.17 builds one for paged|eager and paged|sdpa only): the cumulative lengths say it.
    Sinks (`s_aux`) too, as float32 (cuDNN takes them with packed sequences; a decode
    step's plan is declared for two queries, see attention_varlen). What cuDNN refuses
    runs on the exact float32 fallback, counted as every fallback is; inside a CUDA-graph
    capture, which that fallback's host reads would break, NotSupportedError says so
    instead. Returns ((total_q, heads_q, dim_v), None)."""
    if block_table is not None:  # transformers takes its decode fast path for flash_attention_2/3 names only
        raise NotImplementedError("paged|fastattn: a block table (transformers' flash decode fast path) is not taken")
    window = getattr(module, "sliding_window", None) or kwargs.get("sliding_window")
    if isinstance(cu_seq_lens_k, dict):  # per layer type, in models with sliding and full layers
        kind = "sliding_attention" if window else "full_attention"
        cu_seq_lens_k, max_seqlen_k = cu_seq_lens_k[kind], max_seqlen_k[kind]
    k, v = cache.update(key_states=k, value_states=v, layer_idx=module.layer_idx, read_index=kwargs["read_index"],
                        write_index=kwargs["write_index"])  # (total_k, heads_kv, dim): the cache's keys, packed
    # (total_q, heads_q, dim). A view of transformers' (1, heads, total, dim) layout is
    # contiguous for most models, but not where the rotary embedding builds q anew (gpt-oss):
    # attention_varlen takes packed tensors contiguous, and .contiguous() copies only then.
    q = q[0].transpose(0, 1).contiguous()
    k, v = k.contiguous(), v.contiguous()  # (the cache's reads: not always contiguous either)
    scale = kwargs.get("scaling", getattr(module, "scaling", None))
    cap = float(kwargs.get("softcap") or 0.0)
    sinks = kwargs.get("s_aux")
    sinks = None if sinks is None else sinks.float()  # fastattn's sinks dtype (see attention_forward)
    cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
    left = window - 1 if window else -1
    try:
        o = attention_varlen(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), causal=True,
                             alignment="bottom_right", window=None if left < 0 else (left, 0), scale=scale,
                             softcap=cap, sinks=sinks)
    except NotSupportedError as e:
        if _capturing(q):
            reason = str(e).split("\n")[0]
            # The fallback reads each sequence's bounds on the host: a synchronization, which
            # would invalidate transformers' capture with CUDA's own terse error.
            raise NotSupportedError(f"paged|fastattn inside a CUDA-graph capture: {reason}; the exact fallback that "
                                    "runs it reads the sequences' lengths on the host, which a capture cannot hold. "
                                    "Turn transformers' graphs off for this model "
                                    "(ContinuousBatchingConfig(use_cuda_graph=False))") from None
        count_fallback("transformers", str(e))
        o = _eager_packed(q, k, v, cu_q, cu_k, left, scale, cap, sinks)
    return o, None


def _eager_packed(q, k, v, cu_q, cu_k, left: int, scale, cap: float, sinks) -> torch.Tensor:
    """paged_attention_forward's attention in PyTorch, float32, sequence by sequence: each
    sequence's queries are the last of its keys (causal at the bottom right)."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    form = FastattnMask(causal=True, bottom_right=True, window_left=left)
    for n in range(len(bounds_q) - 1):
        a, e, ak, ek = bounds_q[n], bounds_q[n + 1], bounds_k[n], bounds_k[n + 1]
        if e == a:
            continue
        out[a:e] = _eager(q[None, a:e], k[None, ak:ek], v[None, ak:ek], form, scale, 0.0, cap, sinks, None)[0]
    return out


def _grads(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _bias_for(form: FastattnMask, q: torch.Tensor, k: torch.Tensor, training: bool) -> torch.Tensor | None:
    """The form's bias in q's dtype and a shape fastattn takes: the full mask as 0 /
    finfo.min, a key bias with one row expanded over the queries for a backward.

    For a backward, the rows that see no key (a left-padded batch's padding rows) see
    every key instead: their outputs are zeroed after (_zero_empty), so their output
    gradient is zero and what they attend to changes no other row's gradient, while a
    row whose every score is finfo.min has a log-sum-exp far below -88.7, where cuDNN
    9.19's SM90 backward turns zero-filled tail keys into NaN (s_kv = 64 mod 128;
    cudnn-frontend#628): every gradient of the batch is NaN on the H200."""
    if form.full is not None:
        m = form.full
        if m.dtype == torch.bool:
            m = torch.where(m, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
        m = m.to(q.dtype)
        b, _, sq, skv = m.shape
        if sq == 1 and q.shape[1] > 1:
            m = m.expand(b, m.shape[1], q.shape[1], skv)
        return _open_empty_rows(m, form, training).contiguous()
    if form.bias is None:
        return None
    bias = form.bias.to(q.dtype)
    if training and q.shape[1] > 1:
        bias = bias.expand(bias.shape[0], 1, q.shape[1], bias.shape[3])
    # (also with one query: a sequence of padding alone has a row that sees no key)
    return _open_empty_rows(bias, form, training).contiguous()


def _open_empty_rows(bias: torch.Tensor, form: FastattnMask, training: bool) -> torch.Tensor:
    sq = bias.shape[2]
    if not training or form.empty is None or form.empty.shape[-1] % sq:
        return bias
    # empty: (batch, seq_q), or (batch, heads * seq_q) from a materialized mask
    return bias.masked_fill(form.empty.reshape(form.empty.shape[0], -1, sq, 1), 0.0)


def _dense_call(q, k, v, form: FastattnMask, scale, dropout, cap, sinks) -> torch.Tensor:
    training = _grads(q, k, v, sinks)
    bias = _bias_for(form, q, k, training)
    causal = form.causal and form.full is None
    window = None if form.window_left < 0 or form.full is not None else (form.window_left, 0 if causal else -1)
    bottom_right = form.bottom_right
    lens = form.seq_lens
    sq, skv = q.shape[1], k.shape[1]
    one_query = sinks is not None and sq == 1
    if one_query:
        # cuDNN refuses sinks with one query: two copies of it, the second kept. Both see
        # every key (with one query a causal mask at the bottom right masks nothing), the
        # window's left bound is the real query's at the bottom right.
        if not (bottom_right or skv == 1) or lens is not None:
            raise NotSupportedError("sinks with one query at the top left of several keys")
        q = torch.cat([q, q], 1)
        if bias is not None and bias.shape[2] == 1 and training:
            bias = bias.expand(bias.shape[0], 1, 2, skv).contiguous()
        elif bias is not None and bias.shape[2] == 1 and form.full is not None:
            bias = bias.expand(bias.shape[0], bias.shape[1], 2, skv).contiguous()
        causal, bottom_right = False, True
        window = None if window is None else (window[0], -1)
    o = attention(q, k, v, layout="bshd", causal=causal, alignment="bottom_right" if bottom_right else "top_left",
                  window=window, scale=scale, seq_lens_q=lens, seq_lens_kv=lens, bias=bias, dropout_p=dropout,
                  sinks=sinks, softcap=cap)
    return _zero_empty(o[:, 1:] if one_query else o, form)


def _zero_empty(o: torch.Tensor, form: FastattnMask) -> torch.Tensor:
    return o if form.empty is None else o.masked_fill(form.empty[:, :, None, None], 0.0)


def _varlen(q, k, v, form: FastattnMask, cu_k, kwargs, scale, dropout, cap, sinks) -> torch.Tensor:
    b, sq, h, d = q.shape
    cu_q = form.cu_seqlens.to(torch.int32)
    cu_k = cu_q if cu_k is None else cu_k.to(torch.int32)
    max_q = kwargs.get("max_length_q") or form.max_seqlen
    max_k = kwargs.get("max_length_k") or max_q
    if not max_q:
        max_q = max_k = int((cu_q[1:] - cu_q[:-1]).max())
    window = None if form.window_left < 0 else (form.window_left, 0 if form.causal else -1)
    # Packed (tokens, heads, dim), contiguous as attention_varlen takes them: with one row
    # (the usual packed batch) flattening a (batch, seq, heads, dim) view of a model's
    # (batch, heads, seq, dim) tensor is a view, contiguous only where the model made q in
    # the token-major order (gpt-oss's rotary embedding makes it anew, head-major).
    o = attention_varlen(q.flatten(0, 1).contiguous(), k.flatten(0, 1).contiguous(), v.flatten(0, 1).contiguous(),
                         cu_q, cu_k, max_q, max_k, causal=form.causal,
                         alignment="bottom_right" if form.bottom_right else "top_left", window=window, scale=scale,
                         dropout_p=dropout, softcap=cap, sinks=sinks)
    return o.reshape(b, sq, h, v.shape[3])


def _eager(q, k, v, form: FastattnMask, scale, dropout, cap, sinks, module) -> torch.Tensor:
    """The same attention in PyTorch, float32 (what cuDNN refuses): transformers' eager
    order (scale, softcap, mask, sinks in the denominator, softmax, dropout)."""
    b, sq, hq, d = q.shape
    skv, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))
    kf, vf = kf.repeat_interleave(hq // hk, 1), vf.repeat_interleave(hq // hk, 1)
    s = qf @ kf.transpose(-1, -2) * (scale if scale is not None else d ** -0.5)
    if cap:
        s = torch.tanh(s / cap) * cap
    keep = _keep(form, b, sq, skv, q.device)
    s = s.masked_fill(~keep, torch.finfo(torch.float32).min)
    if form.full is None and form.bias is not None:
        s = s + form.bias.float()
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(b, hq, sq, 1)], -1)
    p = s.softmax(-1)
    if sinks is not None:
        p = p[..., :-1]
    p = torch.nn.functional.dropout(p, dropout, training=dropout > 0)
    return _zero_empty((p @ vf).to(q.dtype).transpose(1, 2).contiguous(), form)


def _keep(form: FastattnMask, b, sq, skv, device) -> torch.Tensor:
    """Which (query, key) pairs the form keeps, (b | 1, 1, sq, skv) boolean."""
    if form.full is not None:
        return form.full if form.full.dtype == torch.bool else form.full > torch.finfo(form.full.dtype).min
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(skv, device=device)[None, :]
    if form.cu_seqlens is not None:
        # Packed rows: a query sees its own sequence only. cu_seqlens counts over the batch's
        # rows laid end to end (each row starts a sequence), so sequence ids are taken over
        # all b * sq tokens and then split back into rows.
        seq = torch.zeros(b * sq, dtype=torch.long, device=device)
        seq[form.cu_seqlens[1:-1].long()] = 1
        seq = seq.cumsum(0).reshape(b, sq)
        keep = (seq[:, :, None] == seq[:, None, :])[:, None]
    else:
        keep = torch.ones(1, 1, sq, skv, dtype=torch.bool, device=device)
    shift = skv - sq if form.bottom_right else 0
    if form.causal:
        keep = keep & (j <= i + shift)
    if form.window_left >= 0:
        keep = keep & (j >= i + shift - form.window_left)
    if form.seq_lens is not None:
        inside = (torch.arange(skv, device=device) < form.seq_lens[:, None])[:, None, None, :]
        keep = keep & inside
    return keep


register()
