"""fastattn.torch.scaled_dot_product_attention: torch.nn.functional.scaled_dot_product_attention's
signature and semantics, run by fastattn.torch.attention.

What this module adds to attention() is the translation of SDPA's arguments: tensors of
any batch rank to (batch, heads, seq, dim), SDPA's checks, and attn_mask to the cheapest
exact form attention() has (no mask, a causal mask at either corner, per-sequence
lengths, or an additive bias of one of cuDNN's broadcast shapes). It has no plans, no
custom op and no autograd of its own: the tensor operations around the call (views, the
bias a boolean mask becomes, the zeros of rows that see no key) are PyTorch's, and
autograd and torch.compile see through them.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch

from ..errors import InvalidArgumentError, NotSupportedError
from ._api import attention


class _Form(NamedTuple):
    """What a call's mask becomes: attention()'s mask arguments, and what the result needs
    after it. skip: the first `skip` queries see no key (a bottom-right causal mask with
    more queries than keys): they are left out of the call and their rows are zeros.
    empty: a boolean tensor broadcastable to the output, True on rows that see no key
    (set to zeros, as SDPA's), or None where there are none."""

    causal: bool = False
    bottom_right: bool = False
    seq_lens_q: torch.Tensor | None = None
    seq_lens_kv: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    skip: int = 0
    empty: torch.Tensor | None = None


_NONE = _Form()


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, *, scale: float | None = None, enable_gqa: bool = False,
                                 recognize_mask: bool = False) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention on fastattn: the same arguments,
    the same result (within the dtype's rounding), with autograd.

    query: (..., heads_q, seqlen_q, head_dim), SDPA's order: any number of leading batch
      dims (none, one, or several, flattened into one batch for the call); float16 or
      bfloat16 CUDA tensors, as fastattn.torch.attention takes. key: (..., heads_kv,
      seqlen_kv, head_dim), value: (..., heads_kv, seqlen_kv, head_dim_v), with the
      query's leading dims and dtype (fastattn does not broadcast batch dims:
      NotSupportedError). Returns (..., heads_q, seqlen_q, head_dim_v) in query's dtype.
    attn_mask: broadcastable to (..., heads_q, seqlen_q, seqlen_kv), on query's device:
      boolean (True: the key takes part) or additive float in query's dtype or float32
      (as SDPA takes; a float32 mask is rounded to query's dtype, in which cuDNN adds
      it: SDPA's math kernel rounds the scores plus the mask to that dtype too). A
      float mask that requires a gradient gets one. Also
      torch.nn.attention.bias.causal_upper_left / causal_lower_right (CausalBias): a
      causal mask at that corner, never materialized.
    dropout_p: dropout on the attention weights, applied whenever > 0 as SDPA's (pass 0
      in evaluation); in [0, 1). The mask comes from PyTorch's CUDA generator
      (torch.manual_seed) through cuDNN's Philox: SDPA's distribution, not its bits.
    is_causal: a causal mask at the top left (query i sees keys j <= i, SDPA's); not
      with attn_mask.
    scale: the softmax scale, > 0 (default 1/sqrt(head_dim)).
    enable_gqa: allow heads_q to be a multiple of heads_kv (grouped-query attention);
      without it the head counts must be equal, as in SDPA.
    recognize_mask: also read attn_mask's values to find a cheaper exact form (below);
      costs one synchronization with the GPU.

    How attn_mask runs (each form is exact; none is ever taken for a mask it is not):
    - Without reading its values (the default): a dim that the mask broadcasts, by an
      extent of 1 or a stride of 0 (an expanded view), stays broadcast where cuDNN's
      bias shapes allow (batch, heads and queries: (1|batch, 1|heads_q, 1|seqlen_q,
      seqlen_kv)); keys are always expanded, and a mask of one row is expanded over the
      queries when gradients are computed (fastattn has no correct backward for a
      one-row bias). A boolean mask becomes a bias of 0 (True) and -inf (False) in
      query's dtype, a new contiguous tensor; a float mask is passed as it is where it
      is contiguous in such a shape (else copied). A boolean mask that broadcasts over
      the keys (each row all True or all False) needs no bias at all.
    - recognize_mask=True: the mask's values are checked on the device, in a few passes
      over it, and one copy of a few flags and the per-sequence lengths brings the
      verdict to the host. That copy is a synchronization: the host waits for all the
      work queued before it, every call (a model passing one mask to each of its layers
      pays it per layer), which costs most where calls are short (decode). In exchange
      the masks models build take fastattn's mask-free kernels, which skip the masked
      blocks and read no bias: all True -> no mask; lower-triangular at the top left ->
      causal; at the bottom right -> causal, bottom right (with more queries than keys
      the first rows see no key: zeros, left out of the call); a key-padding mask, each (batch) row a prefix of
      True (b, 1, 1, seqlen_kv), or the same repeated over the queries -> per-sequence
      key lengths; a right-padded causal mask (causal and key padding, the padded query
      rows either masked entirely or not) -> lengths with the causal mask at the top
      left, or at the bottom right of each sequence where that is what it is. A mask that
      varies over heads, a left-padded one (fastattn's lengths count from the start of
      each sequence: its offsets are not expressible here) and any other pattern take the
      bias. Float masks are recognized when their values are only 0 and -inf and they
      need no gradient. While torch.compile traces the call or a CUDA graph is captured,
      the values are not read (a trace cannot branch on them, a capture cannot
      synchronize): the mask takes the bias, which is also exact.

    Rows that the mask leaves without any key are zeros in the output and in the
    gradients, as SDPA's math gives (checked with PyTorch 2.13; PyTorch's fused kernels
    have returned NaN there). fastattn gets this without reading the mask: the bias of such a
    row is 0 instead of -inf (so the kernel sees an ordinary row, finite forward and
    backward) and the output row is set to zeros afterwards, which costs one reduction
    over the mask and one pass over the output per call; a float mask is copied to do so
    only when gradients are computed (its -inf row would otherwise reach the backward).
    A float mask's row of finite large negative values (finfo.min, as some models build)
    is an ordinary row, as in SDPA: attention spread over its keys. As in attention(),
    positions that a recognized mask turns into lengths must hold finite values in key,
    value and query.

    Raises InvalidArgumentError (a ValueError) where SDPA raises: tensors of fewer than 2
    dims, mismatched dtypes, devices, head dims or key / value lengths, head counts that
    differ without enable_gqa (or that do not divide with it, or have no heads dim), a mask that does not
    broadcast or is not boolean, float32 or in query's dtype, attn_mask with is_causal, a CausalBias of
    other lengths, arguments of the wrong type, dropout_p outside [0, 1]; and what
    attention() raises (CPU tensors, dtypes other than float16 and bfloat16).
    NotSupportedError (a NotImplementedError) where SDPA computes something fastattn
    cannot exactly: key / value batch dims that differ from query's (broadcast), key and
    value head counts that differ, an extent of 0, scale <= 0, dropout_p 1; and
    cuDNN's refusals (for example dropout
    with a causal mask at the bottom right, or a bias's gradient of a shape cuDNN does
    not build).
    """
    _check_options(dropout_p, is_causal, scale, enable_gqa, recognize_mask)
    q, k, v = _batched(query, key, value, enable_gqa)
    if attn_mask is not None and is_causal:
        raise InvalidArgumentError("attn_mask and is_causal=True are exclusive (as in scaled_dot_product_attention): "
                                   "pass the causal mask in one of them")
    if is_causal:
        form = _Form(causal=True)
    elif attn_mask is None:
        form = _NONE
    elif _is_causal_bias(attn_mask):
        form = _causal_bias(attn_mask, q, k)
    else:
        mask = _mask_4d(attn_mask, query, key)
        found = _recognized(mask, q, k, v) if recognize_mask and _readable(mask) else None
        form = found if found is not None else _as_bias(mask, q, k, v)
    return _run(q, k, v, form, scale, dropout_p).reshape(*query.shape[:-1], value.shape[-1])


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, form: _Form, scale: float | None,
         dropout_p: float) -> torch.Tensor:
    skip = form.skip
    o = attention(q[:, :, skip:] if skip else q, k, v, layout="bhsd", causal=form.causal,
                  alignment="bottom_right" if form.bottom_right else "top_left", scale=scale,
                  seq_lens_q=form.seq_lens_q, seq_lens_kv=form.seq_lens_kv, bias=form.bias, dropout_p=dropout_p)
    if skip:
        o = torch.cat([o.new_zeros(o.shape[0], o.shape[1], skip, o.shape[3]), o], 2)
    if form.empty is not None:
        o = o.masked_fill(form.empty, 0.0)
    return o


# -- arguments ---------------------------------------------------------------------------------

def _check_options(dropout_p: object, is_causal: object, scale: object, enable_gqa: object,
                   recognize_mask: object) -> None:
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa), ("recognize_mask", recognize_mask)):
        # isinstance, not `__class__ is`: torch 2.11's dynamo misjudged the latter in this
        # loop and raised for is_causal=False (seen on the H200; bool has no subclasses).
        if not isinstance(flag, bool):
            raise InvalidArgumentError(f"{name}={flag!r}: expected a bool")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise InvalidArgumentError(f"dropout_p={dropout_p!r}: expected a float in [0, 1)")
    if not 0.0 <= dropout_p <= 1.0:
        raise InvalidArgumentError(f"dropout_p={dropout_p!r}: must be in [0, 1]")
    if dropout_p == 1.0:
        raise NotSupportedError("dropout_p=1.0: cuDNN's dropout takes a probability below 1 (every weight dropped "
                                "would make the output zeros)")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise InvalidArgumentError(f"scale={scale!r}: expected a float or None")
        if not scale > 0:
            raise NotSupportedError(f"scale={scale!r}: fastattn takes a softmax scale > 0")


def _batched(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key and value as (batch, heads, seq, dim) views (a copy only where leading
    dims cannot be merged in place), after SDPA's checks."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise InvalidArgumentError(f"{name} has shape {tuple(t.shape)}: expected (..., heads, seq, head_dim), "
                                       "at least 2 dims")
    if not (query.dtype == key.dtype == value.dtype):
        raise InvalidArgumentError(f"query, key and value have different dtypes: {query.dtype}, {key.dtype}, "
                                   f"{value.dtype}")
    if not query.dtype.is_floating_point:
        raise InvalidArgumentError(f"query: expected a floating dtype, got {query.dtype}")
    if not (query.device == key.device == value.device):
        raise InvalidArgumentError(f"query, key and value are on different devices: {query.device}, {key.device}, "
                                   f"{value.device}")
    if not (query.dim() == key.dim() == value.dim()) or not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        raise NotSupportedError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: "
                                "fastattn takes the same batch dims for the three (SDPA would broadcast them); "
                                "expand key and value to query's")
    if key.shape[-1] != query.shape[-1]:
        raise InvalidArgumentError(f"head dims differ: query {query.shape[-1]}, key {key.shape[-1]}")
    if key.shape[-2] != value.shape[-2]:
        raise InvalidArgumentError(f"key has {key.shape[-2]} keys but value has {value.shape[-2]}")
    if enable_gqa and query.dim() == 2:
        raise InvalidArgumentError(f"enable_gqa=True with query of shape {tuple(query.shape)}: grouped-query "
                                   "attention needs a heads dim, (..., heads, seq, head_dim)")
    hq, hk, hv = (t.shape[-3] if t.dim() > 2 else 1 for t in (query, key, value))
    if not enable_gqa and not hq == hk == hv:
        raise InvalidArgumentError(f"heads: query has {hq}, key {hk}, value {hv}: different head counts need "
                                   "enable_gqa=True")
    if hk != hv:
        raise NotSupportedError(f"heads: key has {hk}, value {hv}: fastattn's grouped-query attention shares one "
                                "head count between key and value")
    if hq % hk:
        raise InvalidArgumentError(f"heads: query has {hq}, key and value {hk}: enable_gqa needs query's head count "
                                   "to be a multiple of key's")
    if 0 in (*query.shape, *key.shape, value.shape[-1]):
        raise NotSupportedError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: "
                                "fastattn runs no attention with an extent of 0")
    return _4d(query), _4d(key), _4d(value)


def _4d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4:
        return t
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # a view
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


def _mask_4d(attn_mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """attn_mask as a (1|batch, 1|heads_q, 1|seqlen_q, 1|seqlen_kv) view (a copy only where
    several leading dims, some broadcast, are merged): every dim it broadcasts, by an
    extent of 1 or a stride of 0, has extent 1."""
    if not isinstance(attn_mask, torch.Tensor):
        raise InvalidArgumentError(f"attn_mask: expected a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise InvalidArgumentError(f"attn_mask: expected a boolean or floating mask, got {attn_mask.dtype}")
    if attn_mask.device != query.device:
        raise InvalidArgumentError(f"attn_mask is on {attn_mask.device}, query on {query.device}")
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise InvalidArgumentError(f"attn_mask: a {attn_mask.dtype} mask for {query.dtype} tensors: SDPA takes a "
                                   "boolean mask, a float32 one or one in query's dtype")
    weights = (*query.shape[:-1], key.shape[-2])
    try:
        m = attn_mask.expand(weights)
    except RuntimeError:
        raise InvalidArgumentError(f"attn_mask has shape {tuple(attn_mask.shape)}: it must broadcast to the "
                                   f"attention weights' {weights}") from None
    for dim in range(m.dim()):
        if m.stride(dim) == 0 and m.shape[dim] > 1:
            m = m.narrow(dim, 0, 1)
    if m.dtype not in (torch.bool, query.dtype):  # float32 (checked above), rounded once it is compact
        m = m.to(query.dtype)
    if m.dim() < 4:  # (seqlen_q, seqlen_kv) or (heads_q, seqlen_q, seqlen_kv)
        return m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
    if all(n == 1 for n in m.shape[:-3]):
        return m.reshape(1, *m.shape[-3:])
    return m.expand(*query.shape[:-3], *m.shape[-3:]).reshape(math.prod(query.shape[:-3]), *m.shape[-3:])


def _bias_module():
    """torch.nn.attention.bias where it is imported, else None. It imports torch._dynamo
    (1-4 s, most of fastattn.torch's import where it was imported with it), so it is
    read from sys.modules: a CausalBias can only exist once its caller imported it. Under
    dynamo (imported then) it is imported: dynamo cannot trace sys.modules (torch 2.11:
    "dictionary changed size during iteration", seen on the H200 under torch.compile)."""
    if torch.compiler.is_compiling():
        import torch.nn.attention.bias as bias

        return bias
    return sys.modules.get("torch.nn.attention.bias")


def _is_causal_bias(mask) -> bool:
    bias = _bias_module()
    return bias is not None and isinstance(mask, bias.CausalBias)


def _causal_bias(mask, q: torch.Tensor, k: torch.Tensor) -> _Form:
    sq, skv = q.shape[2], k.shape[2]
    if (mask.seq_len_q, mask.seq_len_kv) != (sq, skv):
        raise InvalidArgumentError(f"attn_mask is a causal mask of {mask.seq_len_q} queries and {mask.seq_len_kv} "
                                   f"keys, for {sq} queries and {skv} keys")
    if mask.variant == _bias_module().CausalVariant.UPPER_LEFT:
        return _Form(causal=True)
    return _bottom_right(sq, skv)


def _bottom_right(sq: int, skv: int) -> _Form:
    """A causal mask at the bottom right. With more queries than keys the first sq - skv
    see no key: left out of the call (zeros), so that cuDNN never sees a row without a
    key; the rest have as many queries as keys, where both corners are one (the top-left
    graph, which cuDNN also builds with dropout)."""
    if sq >= skv:
        return _Form(causal=True, skip=sq - skv)
    return _Form(causal=True, bottom_right=True)


# -- a mask as a bias -------------------------------------------------------------------------

def _grads(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _as_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             row_any: torch.Tensor | None = None) -> _Form:
    """Any mask (from _mask_4d) as an additive bias of a shape cuDNN takes, and the rows
    that see no key. row_any: the mask's rows that keep a key, where already known."""
    b, h, sq, skv = mask.shape
    grads = _grads(q, k, v, mask)
    if mask.dtype == torch.bool:
        if row_any is None:
            row_any = mask.any(-1)
        empty = ~row_any[..., None]
        if skv == 1:  # each row keeps all its keys or none: no bias, only the zeros
            return _Form(empty=empty)
        # A row without a key gets 0 everywhere, an ordinary row for the kernel (its output
        # is replaced by zeros, its gradient is zero); the others 0 and -inf.
        keep = mask | empty
        if sq == 1 and grads:
            keep = keep.expand(b, h, q.shape[2], skv)
        bias = torch.where(keep, q.new_zeros(()), q.new_full((), float("-inf")))
        return _Form(bias=bias.contiguous(), empty=empty)
    if row_any is None:
        row_any = (mask != float("-inf")).any(-1)
    empty = ~row_any[..., None]
    if grads:  # a row of -inf would reach the backward: 0 there (a copy, with its gradient)
        mask = mask.masked_fill(empty, 0.0)
    shape = (b, h, q.shape[2] if sq == 1 and grads else sq, k.shape[2])
    bias = mask.expand(shape).contiguous()  # (no copy where it is contiguous already)
    return _Form(bias=bias, empty=empty)


# -- recognition: a mask's values, read once --------------------------------------------------

def _readable(mask: torch.Tensor) -> bool:
    """Whether the mask's values can be read here: a plain tensor in an eager call, not
    while torch.compile traces (no branch on values) or a CUDA graph is captured (no
    synchronization). Fake and meta tensors (traces) have no values."""
    if mask.__class__ is not torch.Tensor or mask.is_meta or torch.compiler.is_compiling():
        return False
    if mask.requires_grad:  # its gradient needs the bias
        return False
    return not (mask.is_cuda and torch.cuda.is_current_stream_capturing())


def _recognized(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _Form | None:
    """The cheapest exact form of the mask (from _mask_4d), or None where it takes the
    bias. One device-to-host copy: the flags below and each batch row's lengths."""
    batch, sq, skv = q.shape[0], q.shape[2], k.shape[2]
    dev = mask.device
    kept = mask if mask.dtype == torch.bool else mask == 0
    values_ok = kept.new_ones(()) if mask.dtype == torch.bool else (kept | (mask == float("-inf"))).all()
    row_any = kept.any(-1)  # (b, h, sq | 1): rows that keep a key
    same_heads = (kept == kept[:, :1]).all() if kept.shape[1] > 1 else kept.new_ones(())
    m = kept[:, 0].expand(kept.shape[0], sq, skv)
    i = torch.arange(sq, device=dev)[:, None]
    j = torch.arange(skv, device=dev)[None, :]
    # Each row's lengths: one past its last query that keeps a key, one past its last
    # key that a query keeps (0 where none). A row of the families below is fixed by them.
    len_q = (m.any(2) * torch.arange(1, sq + 1, device=dev)).amax(1)
    len_kv = (m.any(1) * torch.arange(1, skv + 1, device=dev)).amax(1)
    lq, lk = len_q[:, None, None], len_kv[:, None, None]
    padded = (i < lq) & (j < lk)
    flags = torch.stack([
        values_ok, same_heads,
        m.all(),                                        # no mask
        (m == (j <= i)).all(),                          # causal, top left
        (m == (j <= i + (skv - sq))).all(),             # causal, bottom right
        (m == padded).all(),                            # lengths
        (m == (padded & (j <= i))).all(),               # lengths, causal at the top left
        # lengths, causal at each sequence's bottom right, no query without a key
        (m == (padded & (j <= i + (lk - lq)))).all() & (len_q <= len_kv).all(),
        row_any.all(),
    ])
    got = torch.cat([flags.long(), len_q, len_kv]).tolist()  # the one synchronization
    (values_ok, same_heads, none, top_left, bottom_right, lengths, lengths_tl, lengths_br, no_empty_row), lens = \
        got[:9], got[9:]
    if not values_ok:
        return None
    if same_heads:
        if none:
            return _NONE
        if top_left:
            return _Form(causal=True)
        if bottom_right:
            return _bottom_right(sq, skv)
        if lengths or lengths_tl or lengths_br:
            if len(lens) == 2 and batch > 1:  # one mask for every sequence
                len_q, len_kv = len_q.expand(batch), len_kv.expand(batch)
            return _Form(causal=not lengths, bottom_right=not lengths and not lengths_tl,
                         seq_lens_q=len_q.to(torch.int32).contiguous(),
                         seq_lens_kv=len_kv.to(torch.int32).contiguous())
        mask, row_any = mask[:, :1], row_any[:, :1]  # one head's bias serves all
    # (values 0 and -inf: the rows that keep a key are the same for a float mask)
    form = _as_bias(mask, q, k, v, row_any)
    return form._replace(empty=None) if no_empty_row else form
