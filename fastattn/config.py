"""AttentionConfig: one description of an attention call, for the probe, the plan and the cache.

The config is validated in full when it is made (an error names the field and the
value), is canonical (two configs that describe the same cuDNN graph compare equal,
hash equal and serialize to the same JSON), and round-trips through JSON. cuDNN's own
limits (head dims, sequence lengths per GPU and version) are deliberately not checked
here: the probe asks cuDNN by building the graph.

Tensors, in the logical (batch, head, seq, dim) order that strides use here:

=======  ==============================================  =======
tensor   logical shape                                   dtype
=======  ==============================================  =======
q        (batch, heads_q, seqlen_q, head_dim_qk)          dtype
k        (batch, heads_kv, seqlen_kv, head_dim_qk)        dtype
v        (batch, heads_kv, seqlen_kv, head_dim_v)         dtype
o        (batch, heads_q, seqlen_q, head_dim_v)           out_dtype
d_*      the shape of its tensor                          grad_dtype
stats    (batch, heads_q, seqlen_q, 1), contiguous        float32
=======  ==============================================  =======

out_dtype and grad_dtype follow dtype unless an FP8 config names others.

``stats`` is the log-sum-exp of each row of scaled scores (natural log), written by a
training forward and read by backward.

The features add tensors (``config.shape(name)``, ``config.strides(name)``):

==========================  ==============================================  =======
tensor                      shape                                           dtype
==========================  ==============================================  =======
seq_len_q, seq_len_kv       (batch,)                      padding            int32
ragged_q, _k, _v, _o        (batch + 1,)                  ragged             int32
ragged_stats                (batch + 1,)                  ragged, training   int32
cu_seqlens_q, _kv           (batch + 1,)                  ragged (instead)   int32
bias, d_bias                (1|batch, 1|heads_q, 1|seqlen_q, seqlen_kv)     dtype
seed, offset                (1,)                          dropout            int64
sink, d_sink                (1, heads_q, 1, 1)            sinks              float32
page_table_k, page_table_v  (batch, 1, ceil(seqlen_kv / page_size), 1)      int32
descale_*, scale_*, amax_*  (1, 1, 1, 1)                  FP8 dtype          float32
==========================  ==============================================  =======

With page_size, k and v are page pools: (num_pages, heads_kv, page_size, head_dim).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping

from . import _fields, _slots, dtypes
from ._fields import bad as _bad
from ._fields import check_int as _int
from ._fields import Cxx, spec

__all__ = ["AttentionConfig", "LAYOUTS", "MASKS", "DTYPES", "FP8_DTYPES", "ALIGNMENTS", "BIAS_SHAPES"]

# The dtypes' names and facts: fastattn.dtypes's one table.
DTYPES = dtypes.DTYPES
FP8_DTYPES = dtypes.FP8_DTYPES
# The FP8 graphs' per-tensor float32 scalars, (1, 1, 1, 1) each: what forward and
# backward take (descales, scales) and write (amaxes) with an FP8 dtype. The slots of
# that name that each direction takes, in the slot table's order (fastattn/_slots.py).
_FP8_PREFIXES = ("descale_", "scale_", "amax_")
FP8_FORWARD_SCALARS = tuple(s.name for s in _slots.SLOTS if s.forward is not None and s.name.startswith(_FP8_PREFIXES))
FP8_BACKWARD_SCALARS = tuple(s.name for s in _slots.SLOTS
                             if s.backward is not None and s.name.startswith(_FP8_PREFIXES))
FP8_SCALARS = tuple(dict.fromkeys(FP8_FORWARD_SCALARS + FP8_BACKWARD_SCALARS))
_ITEMSIZE = dtypes.ITEMSIZE
MASKS = ("none", "causal", "causal_bottom_right")
LAYOUTS = ("bshd", "sbhd", "bhsd")  # each its memory order, outermost first: batch, seq, head, dim
TENSORS = ("q", "k", "v", "o")
ALIGNMENTS = ("top_left", "bottom_right")
# (1 or batch, 1 or heads_q, 1 or seqlen_q, seqlen_kv), a letter each: "b", "h", "s" for
# the full extent, "1" for one broadcast. The last is always "s" (seqlen_kv).
BIAS_SHAPES = ("none", "11ss", "1hss", "b1ss", "bhss", "111s", "1h1s", "b11s", "bh1s")
# Index tensors of the features, by name: (shape as a function of the config, dtype).
_INDEX_TENSORS = {
    "seq_len_q": (lambda c: (c.batch,), "int32"),
    "seq_len_kv": (lambda c: (c.batch,), "int32"),
    "ragged_q": (lambda c: (c.batch + 1,), "int32"),
    "ragged_k": (lambda c: (c.batch + 1,), "int32"),
    "ragged_v": (lambda c: (c.batch + 1,), "int32"),
    "ragged_o": (lambda c: (c.batch + 1,), "int32"),
    "ragged_stats": (lambda c: (c.batch + 1,), "int32"),
    "cu_seqlens_q": (lambda c: (c.batch + 1,), "int32"),
    "cu_seqlens_kv": (lambda c: (c.batch + 1,), "int32"),
    "seed": (lambda c: (1,), "int64"),
    "offset": (lambda c: (1,), "int64"),
    "page_table_k": (lambda c: (c.batch, 1, c.pages_per_sequence, 1), "int32"),
    "page_table_v": (lambda c: (c.batch, 1, c.pages_per_sequence, 1), "int32"),
}
_CORE_TENSORS = frozenset(("q", "k", "v", "o", "d_q", "d_k", "d_v", "d_o", "stats"))
_TENSOR_NAMES = "must be one of q, k, v, o, d_q, d_k, d_v, d_o, stats or a feature's tensor"
# A feature's tensors, and which configs have them: shape(), strides() and dtype_of()
# of any other config refuse them, naming the feature.
_FEATURE_OF: dict[str, tuple[str, Any]] = {
    **dict.fromkeys(("bias", "d_bias"), ("a config with a bias (bias != 'none')", lambda c: c.bias != "none")),
    **dict.fromkeys(("sink", "d_sink"), ("sinks=True", lambda c: c.sinks)),
    **dict.fromkeys(("seq_len_q", "seq_len_kv"), ("padding=True", lambda c: c.padding)),
    **dict.fromkeys(("ragged_q", "ragged_k", "ragged_v", "ragged_o", "ragged_stats", "cu_seqlens_q", "cu_seqlens_kv"),
                    ("ragged=True", lambda c: c.ragged)),
    **dict.fromkeys(("seed", "offset"), ("dropout > 0", lambda c: c.dropout > 0)),
    **dict.fromkeys(("page_table_k", "page_table_v"), ("a paged KV cache (page_size > 0)", lambda c: c.page_size > 0)),
    **dict.fromkeys(FP8_SCALARS, ("an FP8 dtype", lambda c: c.fp8)),
}
assert set(_INDEX_TENSORS) <= set(_FEATURE_OF), "a feature's index tensor without its feature"


def _check_name(tensor: Any) -> str:
    """`tensor` if it names a tensor of some config, else InvalidArgumentError naming it."""
    if not isinstance(tensor, str) or (tensor not in _CORE_TENSORS and tensor not in _FEATURE_OF):
        raise _bad("tensor", tensor, _TENSOR_NAMES)
    return tensor


def bias_name(extents: tuple[int, int, int], sizes: tuple[int, int, int]) -> str:
    """The BIAS_SHAPES name of a bias whose (batch, heads, rows) extents, each 1 or the
    call's own, are `extents`, in a call whose (batch, heads_q, seqlen_q) are `sizes` (its
    last extent is always seqlen_kv): the inverse of AttentionConfig.shape("bias"). Where
    an extent is both 1 and the call's, one name stands for the one graph: "1" for the batch
    and the heads, "s" for the rows (the one-row names came later)."""
    (eb, eh, es), (b, h, s) = extents, sizes
    return (("b" if eb == b and b > 1 else "1") + ("h" if eh == h and h > 1 else "1")
            + ("1" if es == 1 and s > 1 else "s") + "s")


def axes(layout: str) -> tuple[int, int, int, int]:
    """Where (batch, head, seq, dim) sit in the shape of a tensor in a named layout (each
    name spells its dimensions outermost first)."""
    return tuple(layout.index(d) for d in "bhsd")


def named_strides(layout: str, batch: int, heads: int, seqlen: int, head_dim: int) -> tuple[int, int, int, int]:
    """Element strides, in (batch, head, seq, dim) order, of a densely packed tensor
    whose memory order is the named layout."""
    if layout not in LAYOUTS:
        raise _bad("layout", layout, f"must be one of {LAYOUTS} or explicit strides")
    size, stride, step = {"b": batch, "h": heads, "s": seqlen, "d": head_dim}, {}, 1
    for d in reversed(layout):  # innermost first
        stride[d], step = step, step * size[d]
    return tuple(stride[d] for d in "bhsd")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """One attention call: shapes, dtype, memory layout, masking and mode.

    Fields (all keyword-only):
      batch, heads_q, seqlen_q, head_dim_qk: sizes, >= 1.
      heads_kv: key/value heads (default heads_q); heads_q must be a multiple of it
        (GQA; heads_kv=1 is MQA).
      seqlen_kv: key/value sequence length (default seqlen_q).
      head_dim_v: value head dim (default head_dim_qk).
      dtype: of q, k, v: "fp16", "bf16", "fp8_e4m3" or "fp8_e5m2" (aliases:
        "float16", "half", "bfloat16", "float8_e4m3fn", "float8_e5m2", torch dtypes).
        An FP8 dtype selects cuDNN's FP8 graphs, which take per-tensor float32 scales
        (see FP8_FORWARD_SCALARS, FP8_BACKWARD_SCALARS); what else combines with FP8
        (masks, GQA, padding, head dims, output types) is cuDNN's to say: probe it.
      out_dtype: of o (default dtype); another only with an FP8 dtype.
      grad_dtype: of d_o, d_q, d_k, d_v (default dtype); another only with an FP8
        dtype and training (fp8_e5m2 gradients beside fp8_e4m3 inputs, for example).
      layout: memory order of q, k, v, o and their gradients: "bshd" (default),
        "sbhd", "bhsd", or explicit element strides given in (batch, head, seq, dim)
        order as a mapping {"q": (4 ints), "k": ..., "v": ..., "o": ...}. Explicit
        strides equal to a named layout's are stored as that name.
      mask: "none", "causal" (diagonal at the top left: query i sees keys j <= i), or
        "causal_bottom_right" (diagonal at the bottom right: j <= i + seqlen_kv - seqlen_q).
      window: (left, right): query i sees keys j with i + shift - left <= j <= i +
        shift + right, where shift is 0 at the top-left alignment and seqlen_kv -
        seqlen_q at the bottom right (FlashAttention's); -1 is unbounded. A causal mask
        fixes right at 0.
      alignment: where the diagonal of the causal mask and the window sits: "top_left"
        (default; shift 0, scaled_dot_product_attention's is_causal) or "bottom_right"
        (shift seqlen_kv - seqlen_q, FlashAttention's causal and windows), per sequence
        with padding (each sequence's own lengths). mask="causal" with "bottom_right", or
        mask="none" with a window's right bound 0 there, is stored as
        mask="causal_bottom_right" (which implies it; the same graph); where no bound
        uses the diagonal (no mask, window (-1, -1)) it is stored as "top_left".
        Default: not given (top_left, or what the mask implies); mask="causal_bottom_right"
        with alignment="top_left" contradicts itself and is refused. With a bias or
        dropout and no padding, a bottom-right diagonal with a right bound is stored as
        the top-left band it equals (window (left - shift, right + shift), mask "none"),
        or without that right bound where it excludes no key (one query against its
        whole cache): cuDNN takes a bottom-right one only without them.
      scale: softmax scale (default 1/sqrt(head_dim_qk)); stored as the float32 cuDNN uses.
      training: forward also writes softmax stats, and the plan has a backward graph.
      deterministic: backward uses cuDNN's deterministic algorithm (needs training).
      padding: each sequence has its own length, given at run time as int32 device
        arrays seq_len_q and seq_len_kv of `batch` entries (at most seqlen_q and
        seqlen_kv). Queries and keys past them are masked out, and the masks and
        window apply within each sequence's lengths. cuDNN still reads the padded rows
        of its last tile and multiplies them by zero, so they must hold finite values
        (NaN there leaks into the results); it writes zero to the padded rows of o,
        d_q, d_k and d_v, and leaves the padded rows of stats unspecified. FP8: the
        padded rows of o are unspecified (cuDNN 9.19 and 9.24 leave them unwritten,
        9.28.1 computes them as rows of their own); fastattn.torch zeroes them.
      alibi: ALiBi: each score gets slope[h] * (j - i) after scaling, with the slopes
        of the ALiBi paper for heads_q heads (cuDNN computes them; it needs the right
        bound of the mask at the diagonal, as a causal mask has).
      ragged: packed variable-length sequences (THD; needs padding and layout "bshd"):
        the sequences of q, k, v, o (and gradients) lie one after another, each
        starting at the element offset given at run time in int32 arrays ragged_q,
        ragged_k, ragged_v, ragged_o of batch + 1 entries (for tokens packed densely,
        cumulative token counts times heads * head_dim). Training packs stats too:
        float32 (tokens, heads_q), with offsets ragged_stats (cumulative token counts
        times heads_q). seqlen_q and seqlen_kv are the longest sequences.
      max_tokens_q, max_tokens_kv: with ragged, the most tokens the packed q (and o)
        and k (and v) hold (default batch * seqlen); cuDNN sizes workspace by them.
      bias: an additive bias after scaling, before masking and softmax, of shape
        "11ss", "1hss", "b1ss" or "bhss" (TransformerEngine's names: 1 or batch, 1 or
        heads_q, seqlen_q, seqlen_kv), or "111s", "1h1s", "b11s", "bh1s" (one row,
        broadcast over the queries: a key-padding bias is "b11s"), contiguous, in
        dtype; "none" (default). cuDNN decides which it builds (and with d_bias): the
        probe says.
      bias_grad: backward also writes d_bias (needs training and a bias).
      dropout: probability of dropping each attention weight (kept ones scale by
        1 / (1 - p)), in [0, 1); Philox seed and offset are int64 device scalars given
        at run time, the same to backward (the same mask).
      host_seed: seed and offset are host integers, passed by value at run time,
        instead of device scalars (a CUDA graph captures their values).
      sinks: attention sinks: a float32 logit per query head, sink (1, heads_q, 1, 1),
        joins every row's softmax denominator; backward also writes d_sink.
      page_size: a paged KV cache (forward only): k and v are pools of num_pages
        pages of page_size tokens each, laid out as (num_pages, heads_kv, page_size,
        head_dim) in the layout's order, and int32 page tables page_table_k and
        page_table_v (batch, 1, ceil(seqlen_kv / page_size), 1) list each sequence's
        pages; seqlen_kv is the longest KV sequence. Needs padding. 0 (default): dense.
      num_pages: pages in each pool (default batch * ceil(seqlen_kv / page_size)).
      softcap: logit soft-capping (Gemma 2, Grok): scores become softcap *
        tanh(score / softcap) after scaling, before masking; forward and backward.
        None (default): none. cuDNN decides what it combines with (the probe says).

    Names (dtype and its aliases, layout, mask, alignment, bias) are taken exactly as
    written, lowercase, as the CLI's flags and fastattn.torch take them: "Causal" and
    "BF16" are refused, naming the spelling that is taken.

    Raises InvalidArgumentError (a ValueError) naming the field and value.
    """

    # The field registry (fastattn._fields): each field once, with its kind, default and
    # what is derived from it. A default of None follows from other fields; `off` marks
    # a feature added after the first release, left out of the canonical form (and so of
    # every other config's cache key) when not used.
    batch: int = spec("int", minimum=1, help="sequences in the batch", cxx=Cxx("int64_t", "0"))
    heads_q: int = spec("int", minimum=1, help="query heads", cxx=Cxx("int64_t", "0"))
    heads_kv: int | None = spec("int", None, minimum=1, follows="heads_q", help="key/value heads (default: heads_q)",
                                cxx=Cxx("int64_t", "0"))
    seqlen_q: int = spec("int", minimum=1, help="query sequence length", cxx=Cxx("int64_t", "0"))
    seqlen_kv: int | None = spec("int", None, minimum=1, follows="seqlen_q",
                                 help="key/value sequence length (default: seqlen_q)", cxx=Cxx("int64_t", "0"))
    head_dim_qk: int = spec("int", minimum=1, help="query/key head dim", family=True, cxx=Cxx("int64_t", "0"))
    head_dim_v: int | None = spec("int", None, minimum=1, follows="head_dim_qk",
                                  help="value head dim (default: head_dim_qk)", family=True, cxx=Cxx("int64_t", "0"))
    dtype: str = spec("dtype", "bf16", choices=DTYPES, help="element type of q, k, v (and of o and gradients "
                      "unless --out-dtype / --grad-dtype)",
                      family=lambda c: (c.dtype, c.out_dtype, c.grad_dtype) if c.fp8 else c.dtype,
                      describe=lambda c: c.dtype + ("" if c.out_dtype == c.dtype else f">{c.out_dtype}")
                      + ("" if c.grad_dtype == c.dtype else f"/grad:{c.grad_dtype}"),
                      cxx=Cxx("DType", "DType::kFp16", note="q, k, v. The FP8 types select cudnn-frontend's FP8 "
                              "graphs (sdpa_fp8, sdpa_fp8_backward) with their per-tensor float32 scale, descale "
                              "and amax tensors."))
    # out_dtype and grad_dtype follow num_pages in the struct: the core took them last.
    out_dtype: str | None = spec("dtype", None, choices=DTYPES, follows="dtype",
                                 help="element type of o (default: dtype; another only with FP8)",
                                 cxx=Cxx("DType", "DType::kFp16", after="num_pages",
                                         note="o; Python sets it to dtype unless an FP8 config names another."))
    grad_dtype: str | None = spec("dtype", None, choices=DTYPES, follows="dtype",
                                  help="element type of d_o, d_q, d_k, d_v (default: dtype; another only with "
                                  "FP8 and --training)",
                                  cxx=Cxx("DType", "DType::kFp16", after="out_dtype",
                                          note="d_o, d_q, d_k, d_v; Python sets it to dtype unless an FP8 config "
                                          "names another."))
    layout: Any = spec("layout", "bshd", choices=LAYOUTS, help="memory order of q, k, v, o (default bshd)",
                       describe=lambda c: None if c.layout == "bshd" else c.layout if isinstance(c.layout, str)
                       else "strided",
                       cxx=Cxx("int64_t[4]", "{}", names=("q_stride", "k_stride", "v_stride", "o_stride"),
                               value="(cfg.strides('q'), cfg.strides('k'), cfg.strides('v'), cfg.strides('o'))",
                               note="The layout as element strides of q, k, v, o in (batch, head, seq, dim) order. "
                               "The gradients share the strides of their tensors: d_q of q, d_k of k, d_v of v, "
                               "d_o of o."))
    mask: str = spec("choice", "none", choices=MASKS, help="causal mask (default none)", family=True,
                     describe=lambda c: c.mask,
                     cxx=Cxx("Mask", "Mask::kNone", note="kCausal: the top-left diagonal, query i sees keys j <= i; "
                             "kCausalBottomRight: shifted by seqlen_kv - seqlen_q."))
    window: tuple[int, int] = spec("pair", (-1, -1), help="sliding window (left, right); -1 is unbounded",
                                   family=True, describe=lambda c: None if c.window == (-1, -1)
                                   else f"win{c.window[0]},{c.window[1]}",
                                   cxx=Cxx("int64_t", "-1", names=("window_left", "window_right"), value="cfg.window",
                                           note="FlashAttention's convention: query i sees keys j with i - left <= j "
                                           "<= i + right (shifted by seqlen_kv - seqlen_q for the bottom-right "
                                           "diagonal); -1 is unbounded."))
    # Default None: "not given" (top_left unless the mask says bottom_right), so that an
    # alignment given against the mask can be told from the default and refused.
    alignment: str = spec("choice", None, off="top_left", choices=ALIGNMENTS,
                          help="the diagonal of the mask and window: top_left (SDPA) or bottom_right "
                          "(FlashAttention)", family=True,
                          describe=lambda c: "br" if c.alignment == "bottom_right" else None,
                          feature=("window_br", {"alignment": "bottom_right", "window": (64, 64)},
                                   "window (64, 64) at the bottom right"),
                          cxx=Cxx("bool", "false", names=("bottom_right",), value="cfg.alignment == 'bottom_right'",
                                  note="The window's diagonal at the bottom right (shifted by each sequence's "
                                  "seqlen_kv - seqlen_q), without a causal mask; kCausalBottomRight implies it."))
    scale: float | None = spec("positive", None, help="softmax scale (default 1/sqrt(head_dim_qk))",
                               cxx=Cxx("float", "1.0f"))
    training: bool = spec("bool", False, help="also build the backward graph", family=True,
                          describe=lambda c: ("train/det" if c.deterministic else "train") if c.training else None,
                          cxx=Cxx("bool", "false", note="forward writes softmax stats; a backward graph exists"))
    deterministic: bool = spec("bool", False, help="deterministic backward (needs --training)", family=True,
                               cxx=Cxx("bool", "false", note="backward uses cuDNN's deterministic algorithm"))
    padding: bool = spec("bool", False, off=False, help="per-sequence lengths given at run time (seq_len_q, "
                         "seq_len_kv)", family=True, describe=lambda c: "padded" if c.padding else None,
                         feature=("padding", {"padding": True}, "per-sequence lengths"),
                         cxx=Cxx("bool", "false", note="Per-sequence lengths: int32 device arrays seq_len_q and "
                                 "seq_len_kv of `batch` entries, given at execute; queries and keys past them are "
                                 "ignored."))
    alibi: bool = spec("bool", False, off=False, help="ALiBi position biases", family=True,
                       describe=lambda c: "alibi" if c.alibi else None, feature=("alibi", {"alibi": True}, "ALiBi"),
                       cxx=Cxx("bool", "false", note="ALiBi: scores get slope[h] * (j - i) after scaling, with cuDNN's "
                               "slopes for heads_q heads (copied from host memory into the workspace at each "
                               "execute)."))
    ragged: bool = spec("bool", False, off=False, help="packed variable-length sequences (THD; with --padding and "
                        "bshd)", family=True, describe=lambda c: "packed" if c.ragged else None,
                        feature=("ragged", {"padding": True, "ragged": True}, "packed sequences"),
                        cxx=Cxx("bool", "false", note="Packed variable-length sequences (THD): q, k, v, o, their "
                                "gradients and stats start each sequence at an element offset given at execute "
                                "(int32, batch + 1 entries each); stats are then packed too, (tokens, heads_q). "
                                "Needs padding."))
    max_tokens_q: int | None = spec("int", None, help="with ragged: tokens the packed q holds (default batch * "
                                    "seqlen_q)", cxx=Cxx("int64_t", "0", note="with ragged, bounds the packed "
                                                         "tokens of q (cuDNN sizes its workspace by it)"))
    max_tokens_kv: int | None = spec("int", None, help="with ragged: tokens the packed k, v hold (default batch "
                                     "* seqlen_kv)", cxx=Cxx("int64_t", "0", note="with ragged, bounds the packed "
                                                             "tokens of k and v"))
    shape_override: bool = spec(
        "bool", False, off=False, help="one plan serves every length up to seqlen_q and seqlen_kv, each call giving "
        "its own at execute (cuDNN's shape override, cuDNN >= 9.21)", family=True,
        describe=lambda c: "override" if c.shape_override else None,
        cxx=Cxx("bool", "false", note="cuDNN's shape override, forward only: seqlen_q and seqlen_kv are the most "
                "a call may have; execute_at takes the call's own lengths and strides of q, k, v, o. No lengths, "
                "offsets, pages, bias, FP8 or backward."))
    # Bias and dropout: their sizes (bias batch, rate) select no other kernel than their presence.
    bias: str = spec("choice", "none", off="none", choices=BIAS_SHAPES, help="additive bias of this broadcast "
                     "shape", family=lambda c: c.bias.replace("b", "1", 1),
                     describe=lambda c: None if c.bias == "none" else f"bias{c.bias}" + ("/grad" if c.bias_grad
                                                                                         else ""),
                     feature=("bias", {"bias": "1hss"}, "a 1hss bias"),
                     cxx=Cxx("int64_t", "0", names=("bias_batch", "bias_heads", "bias_seq_q"),
                             value="cfg.shape('bias')[:3] if cfg.bias != 'none' else (0, 0, 0)",
                             note="Additive bias after scaling, (bias_batch, bias_heads, bias_seq_q, seqlen_kv): "
                             "the shape's extents, contiguous, in dtype; bias_batch is 1 or batch, bias_heads 1 or "
                             "heads_q, bias_seq_q 1 (one row broadcast over the queries: a key-padding bias) or "
                             "seqlen_q; 0: none."))
    bias_grad: bool = spec("bool", False, off=False, help="backward also writes d_bias", family=True,
                           feature=("bias_grad", {"bias": "1hss", "bias_grad": True},
                                    "with its gradient; needs --training"),
                           cxx=Cxx("bool", "false", note="backward also writes d_bias, of the bias's shape"))
    dropout: float = spec("probability", 0.0, off=0.0, help="dropout probability", family=lambda c: c.dropout > 0,
                          describe=lambda c: f"drop{c.dropout:.3g}" if c.dropout else None,
                          feature=("dropout", {"dropout": 0.1}, "dropout 0.1"),
                          cxx=Cxx("float", "0.0f", note="Dropout probability on the softmax; Philox seed and offset "
                                  "are int64 device scalars given at execute (the same ones to backward: the same "
                                  "mask)."))
    host_seed: bool = spec("bool", False, off=False, help="dropout's seed and offset are host values",
                           cxx=Cxx("bool", "false", note="Seed and offset are host int64 values passed by value "
                                   "(read at each execute on the host, so fixed inside a captured CUDA graph) "
                                   "instead of device scalars."))
    sinks: bool = spec("bool", False, off=False, help="attention sinks (a logit per head)", family=True,
                       describe=lambda c: "sinks" if c.sinks else None,
                       feature=("sinks", {"sinks": True}, "attention sinks"),
                       cxx=Cxx("bool", "false", note="Attention sinks: a learnable float32 logit per query head, "
                               "(1, heads_q, 1, 1), in every softmax denominator; backward also writes its gradient "
                               "d_sink."))
    page_size: int = spec("int", 0, off=0, help="a paged KV cache of pages of this many tokens (forward only; "
                          "with --padding)", family=lambda c: c.page_size > 0,
                          describe=lambda c: f"paged{c.page_size}x{c.num_pages}" if c.page_size else None,
                          feature=("paged", {"padding": True, "page_size": 64}, "paged KV, 64-token pages"),
                          cxx=Cxx("int64_t", "0", note="Paged KV cache (forward only): k and v are pools of "
                                  "num_pages pages of page_size tokens, (num_pages, heads_kv, page_size, dim) at "
                                  "k_stride / v_stride; int32 page tables (batch, 1, ceil(seqlen_kv / page_size), 1) "
                                  "map each sequence's pages; needs padding. 0: k and v are dense."))
    num_pages: int | None = spec("int", None, help="with a paged KV cache: pages in each pool (default batch * "
                                 "ceil(seqlen_kv / page_size))", cxx=Cxx("int64_t", "0"))
    softcap: float | None = spec("positive", None, off=None, help="logit soft-capping: scores become softcap * "
                                 "tanh(score / softcap) after scaling, before masking (Gemma 2)",
                                 family=lambda c: c.softcap is not None,
                                 describe=lambda c: f"softcap{c.softcap:g}" if c.softcap else None,
                                 feature=("softcap", {"softcap": 50.0}, "logit soft-capping at 50"),
                                 score=lambda cap, s: _capped(cap, (s / cap).tanh()),
                                 cxx=Cxx("float", "0.0f", note="Logit soft-capping: scores become softcap * "
                                         "tanh(score / softcap) after scaling, before any mask (Gemma 2, Grok); "
                                         "0: none."))

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        given = {f.name: getattr(self, f.name) for f in FIELDS}  # as given, for messages
        for f in FIELDS:  # each value on its own; what depends on other fields follows
            set_(f.name, _fields.validate(f, given[f.name]))
        for f in FIELDS:
            if f.metadata["follows"] and getattr(self, f.name) is None:
                set_(f.name, getattr(self, f.metadata["follows"]))
        if self.heads_q % self.heads_kv:
            raise _bad("heads_kv", self.heads_kv, f"heads_q={self.heads_q} must be a multiple of heads_kv")

        left, right = self.window
        if self.mask == "causal_bottom_right" and self.alignment == "top_left":
            raise _bad("alignment", given["alignment"], "mask='causal_bottom_right' puts the diagonal at the bottom "
                       "right: give alignment='bottom_right' or leave it out (mask='causal' is the top-left one)")
        if self.alignment is None:
            set_("alignment", "top_left")
        if self.alignment == "bottom_right" and (self.mask == "causal" or (self.mask == "none" and right == 0)):
            # One spelling per graph, the one that existed first: a right bound of 0 at the
            # bottom right is the bottom-right causal mask (cuDNN gets the same attributes).
            set_("mask", "causal_bottom_right")
        if self.mask == "causal_bottom_right" or (self.mask == "none" and self.window == (-1, -1)):
            set_("alignment", "top_left")  # implied by the mask, or no bound uses the diagonal
        if self.mask != "none":
            if right > 0:
                raise _bad("window", given["window"], f"mask={self.mask!r} fixes the right bound at 0")
            right = -1  # the mask already bounds the right side at the diagonal
        set_("window", (left, right))
        self._band_beside_a_bias(set_)

        scale = 1.0 / math.sqrt(self.head_dim_qk) if self.scale is None else self.scale
        set_("scale", _fields.float32(scale))

        self._check_dtypes(given)
        if self.deterministic and not self.training:
            raise _bad("deterministic", True, "selects the backward algorithm and needs training=True")
        self._canonical_features(set_)

        set_("layout", self._canonical_layout())
        if self.ragged and self.layout != "bshd":
            raise _bad("layout", self.layout, "ragged (packed) sequences need layout='bshd' (tokens, heads, dim)")
        strides = self._strides_for(self.layout) if isinstance(self.layout, str) else self.layout
        for t, s in [*zip(TENSORS, strides), *([("bias", None)] if self.bias != "none" else [])]:
            _fields.check_extent(t, self.shape(t), s)  # (stats, and packed tokens, lie within q's)

    def _band_beside_a_bias(self, set_) -> None:
        # cuDNN takes a bottom-right diagonal with a right bound (a causal mask's, a
        # window's) only without a bias and dropout (cudnn-frontend: "Bottom right causal
        # mask is only supported with is_bias=False, is_alibi=False, is_dropout=False"):
        # a left-padded batch's decode step and chunked prefill ask for exactly that. With
        # no padding every sequence has the shift seqlen_kv - seqlen_q, and the band is the
        # top-left one shifted by it (or, where that right bound excludes no key, the band
        # without it): stored so, the graph cuDNN is asked for computes the same attention.
        # ALiBi needs its right bound at the diagonal: left as given (cuDNN says why not).
        bottom = self.mask == "causal_bottom_right" or self.alignment == "bottom_right"
        if not bottom or self.padding or self.alibi or (self.bias == "none" and not self.dropout):
            return
        if self.shape_override:
            return  # refused in _check (the diagonal would stay at the declared lengths)
        shift = self.seqlen_kv - self.seqlen_q
        left, right = self.window
        if self.mask != "none":
            right = 0
        if right < 0 or shift < 0:
            return  # no right bound (cuDNN takes a left one alone there), or one cuDNN refuses: its reason
        right += shift
        if right >= self.seqlen_kv - 1:  # it excludes no key (a decode step): the left bound alone stays
            set_("mask", "none")
            set_("window", (left, -1))
            set_("alignment", "bottom_right" if left >= 0 else "top_left")
            return
        if left >= 0:
            if left < shift:
                return  # no top-left window has this band: as given, with cuDNN's reason
            left -= shift
        set_("mask", "none")
        set_("window", (left, right))
        set_("alignment", "top_left")

    def _check_dtypes(self, given) -> None:
        # Only the FP8 graphs take an output or gradient type of their own; which
        # pairs cuDNN runs (e4m3 in, bf16 out; e5m2 gradients) is for the probe to say.
        for name in ("out_dtype", "grad_dtype"):
            if getattr(self, name) != self.dtype and not self.fp8:
                raise _bad(name, given[name], f"differs from dtype={self.dtype!r}: only an FP8 dtype "
                           f"({', '.join(FP8_DTYPES)}) takes another {name}")
        if self.grad_dtype != self.dtype and not self.training:
            raise _bad("grad_dtype", given["grad_dtype"], "applies only to training=True (gradients)")

    @property
    def fp8(self) -> bool:
        """Whether q, k, v are FP8 (cuDNN's FP8 graphs, with per-tensor scales)."""
        return self.dtype in FP8_DTYPES

    def _canonical_features(self, set_) -> None:
        if self.ragged and not self.padding:
            raise _bad("ragged", True, "needs padding=True: cuDNN takes each sequence's length with its offsets")
        for name, seqlen in (("max_tokens_q", "seqlen_q"), ("max_tokens_kv", "seqlen_kv")):
            value = getattr(self, name)
            if not self.ragged:
                if value not in (None, 0):
                    raise _bad(name, value, "applies only to ragged=True")
                set_(name, 0)
                continue
            most = self.batch * getattr(self, seqlen)
            value = _fields.derived(name, most, f"batch * {seqlen}") if value is None else _int(name, value, 1)
            if value > most:
                raise _bad(name, value, f"exceeds batch * seqlen = {most}: no sequence is longer than seqlen")
            set_(name, value)

        if self.shape_override:
            for what, on in (("padding (per-sequence lengths)", self.padding), ("a paged KV cache", self.page_size),
                             ("a bias", self.bias != "none"), (f"dtype={self.dtype!r}", self.fp8)):
                if on:
                    raise _bad("shape_override", True, f"cannot be combined with {what}: each call gives its own "
                               "lengths at execute, and those tensors are declared at seqlen_q and seqlen_kv")
            if self.mask == "causal_bottom_right" or self.alignment == "bottom_right":
                # Without per-sequence lengths cudnn-frontend places a bottom-right diagonal from
                # the declared seqlen_q and seqlen_kv, as constants in the graph
                # (utils/attn_score_modifiers.h, 1.28): a call's override would not move it.
                which = (f"mask={self.mask!r}" if self.mask == "causal_bottom_right"
                         else f"alignment={self.alignment!r}")
                raise _bad("shape_override", True, f"cannot be combined with a bottom-right diagonal ({which}): "
                           "cudnn-frontend places it from the declared seqlen_q and seqlen_kv, which a call's own "
                           "lengths would not move")
            if self.training:
                # The backward graph keeps tensors of its own in the workspace (softmax sums,
                # d_q's float32 accumulator), declared at the plan's lengths; cudnn-frontend's
                # execute overrides only the caller's tensors.
                raise _bad("shape_override", True, "is forward only (training=False): the backward graph's "
                           "workspace tensors are declared at seqlen_q and seqlen_kv, and the override does not "
                           "reach them")
        if self.bias_grad and (self.bias == "none" or not self.training):
            raise _bad("bias_grad", True, "needs a bias and training=True")
        if self.host_seed and not self.dropout:
            raise _bad("host_seed", True, "applies only to dropout > 0")

        if self.page_size and not self.padding:
            raise _bad("page_size", self.page_size, "a paged KV cache needs padding=True: cuDNN takes each "
                       "sequence's KV length (seq_len_kv) with its page table")
        if self.page_size == 0:
            if self.num_pages not in (None, 0):
                raise _bad("num_pages", self.num_pages, "applies only to a paged KV cache (page_size > 0)")
            set_("num_pages", 0)
            return
        if self.training:
            raise _bad("page_size", self.page_size, "a paged KV cache is forward only (training=False): "
                       "cuDNN has no paged backward")
        set_("num_pages", _int("num_pages", self.num_pages, 1) if self.num_pages is not None else _fields.derived(
            "num_pages", self.batch * self.pages_per_sequence, "batch * ceil(seqlen_kv / page_size)"))

    def _canonical_layout(self) -> str | tuple[tuple[int, ...], ...]:
        layout = self.layout
        if isinstance(layout, str):
            if layout not in LAYOUTS:
                raise _bad("layout", layout, f"must be one of {LAYOUTS} or explicit strides")
            return layout
        if isinstance(layout, Mapping):
            unknown = set(layout) - set(TENSORS)
            missing = [t for t in TENSORS if t not in layout]
            if unknown or missing:
                raise _bad("layout", layout, f"explicit strides need exactly the keys {TENSORS}")
            given = [layout[t] for t in TENSORS]
        elif isinstance(layout, (list, tuple)) and len(layout) == 4:
            given = list(layout)
        else:
            raise _bad("layout", layout, f"must be one of {LAYOUTS} or explicit strides {{'q': (b, h, s, d), ...}}")
        strides = []
        for name, s in zip(TENSORS, given):
            if isinstance(s, (str, bytes)) or not hasattr(s, "__len__") or len(s) != 4:
                raise _bad(f"layout[{name!r}]", s, "must be 4 strides in (batch, head, seq, dim) order")
            strides.append(tuple(_int(f"layout[{name!r}]", x, 1) for x in s))
        strides = tuple(strides)
        for name, s in zip(TENSORS, strides):
            self._check_no_overlap(name, s)
        for named in LAYOUTS:
            if strides == self._strides_for(named):
                return named
        return strides

    def _check_no_overlap(self, name: str, strides: tuple[int, ...]) -> None:
        # Dense or with gaps is fine; two elements at one address is a silent wrong answer.
        dims = sorted((s, n) for s, n in zip(strides, self.shape(name)) if n > 1)
        span = 1
        for stride, extent in dims:
            if stride < span:
                raise _bad(f"layout[{name!r}]", strides, f"strides make elements of {name} overlap")
            span = stride * extent

    # -- tensors ----------------------------------------------------------------------

    @property
    def pages_per_sequence(self) -> int:
        """Entries per sequence in a page table (0 without a paged KV cache)."""
        return -(-self.seqlen_kv // self.page_size) if self.page_size else 0

    def shape(self, tensor: str) -> tuple[int, ...]:
        """Logical (batch, head, seq, dim) shape of "q", "k", "v", "o" (and their
        gradients) or "stats"; the shape of a feature's tensor (see the module doc).
        With page_size, "k" and "v" are the page pools. A feature's tensor of a config
        without the feature (bias without a bias, ...) is an InvalidArgumentError."""
        self._check_tensor(tensor)
        kv_batch, kv_seq = (self.num_pages, self.page_size) if self.page_size else (self.batch, self.seqlen_kv)
        if tensor in ("q", "d_q"):
            return (self.batch, self.heads_q, self.seqlen_q, self.head_dim_qk)
        if tensor in ("k", "d_k"):
            return (kv_batch, self.heads_kv, kv_seq, self.head_dim_qk)
        if tensor in ("v", "d_v"):
            return (kv_batch, self.heads_kv, kv_seq, self.head_dim_v)
        if tensor in ("o", "d_o"):
            return (self.batch, self.heads_q, self.seqlen_q, self.head_dim_v)
        if tensor == "stats":
            return (self.batch, self.heads_q, self.seqlen_q, 1)
        if tensor in ("bias", "d_bias"):
            return (self.batch if self.bias[0] == "b" else 1, self.heads_q if self.bias[1] == "h" else 1,
                    self.seqlen_q if self.bias[2] == "s" else 1, self.seqlen_kv)
        if tensor in ("sink", "d_sink"):
            return (1, self.heads_q, 1, 1)
        if tensor in FP8_SCALARS:
            return (1, 1, 1, 1)
        if tensor in _INDEX_TENSORS:
            return _INDEX_TENSORS[tensor][0](self)
        raise _bad("tensor", tensor, _TENSOR_NAMES)

    def _check_tensor(self, tensor: str) -> None:
        """Raises InvalidArgumentError naming `tensor` unless this config has it."""
        if _check_name(tensor) in _CORE_TENSORS:
            return
        what, has = _FEATURE_OF[tensor]
        if not has(self):
            raise _bad("tensor", tensor, f"this config has no {tensor}: only {what} has it")

    @staticmethod
    def tensor_dtype(tensor: str, dtype: str = "bf16") -> str:
        """A tensor's element type where q, k, v, o and gradients are all `dtype`: that
        dtype, "float32", "int32" or "int64". A config's own: dtype_of."""
        _check_name(tensor)
        if dtype not in DTYPES:
            raise _bad("dtype", dtype, f"must be one of {DTYPES}")
        if tensor in ("stats", "sink", "d_sink") or tensor in FP8_SCALARS:
            return "float32"
        if tensor in _INDEX_TENSORS:
            return _INDEX_TENSORS[tensor][1]
        return dtype

    def dtype_of(self, tensor: str) -> str:
        """This config's element type of a tensor: dtype (q, k, v, bias), out_dtype (o),
        grad_dtype (d_o, d_q, d_k, d_v, d_bias), "float32", "int32" or "int64"."""
        self._check_tensor(tensor)
        if tensor == "o":
            return self.out_dtype
        if tensor in ("d_o", "d_q", "d_k", "d_v", "d_bias"):
            return self.grad_dtype
        return self.tensor_dtype(tensor, self.dtype)

    def tensor_itemsize(self, tensor: str) -> int:
        """Bytes per element of a tensor of this config (FP8: 1)."""
        return _ITEMSIZE[self.dtype_of(tensor)]

    def _strides_for(self, layout: str) -> tuple[tuple[int, ...], ...]:
        out = []
        for t in TENSORS:
            b, h, s, d = self.shape(t)
            out.append(named_strides(layout, b, h, s, d))
        return tuple(out)

    def strides(self, tensor: str) -> tuple[int, int, int, int]:
        """Element strides of a tensor in (batch, head, seq, dim) order."""
        self._check_tensor(tensor)
        if tensor == "stats" and self.ragged:  # packed with the tokens: (tokens, heads_q)
            return (self.heads_q * self.seqlen_q, 1, self.heads_q, 1)
        if tensor in ("stats", "bias", "d_bias", "sink", "d_sink") or tensor in _INDEX_TENSORS or \
                tensor in FP8_SCALARS:
            shape = self.shape(tensor)  # contiguous
            out, step = [], 1
            for n in reversed(shape):
                out.append(step)
                step *= n
            return tuple(reversed(out))
        base = tensor[2:] if tensor.startswith("d_") else tensor  # (q, k, v, o: checked above)
        table = self._strides_for(self.layout) if isinstance(self.layout, str) else self.layout
        return table[TENSORS.index(base)]

    def storage_elements(self, tensor: str) -> int:
        """Elements a buffer for the tensor must hold: 1 + the largest offset (with
        ragged, the packed tokens: max_tokens * heads * head_dim)."""
        if self.ragged and tensor in ("q", "k", "v", "o", "d_q", "d_k", "d_v", "d_o", "stats"):
            _, heads, _, dim = self.shape(tensor)
            tokens = self.max_tokens_kv if tensor in ("k", "v", "d_k", "d_v") else self.max_tokens_q
            return tokens * heads * dim
        return 1 + sum((n - 1) * s for n, s in zip(self.shape(tensor), self.strides(tensor)))

    @property
    def itemsize(self) -> int:
        """Bytes per element of q, k, v (o and gradients: tensor_itemsize)."""
        return _ITEMSIZE[self.dtype]

    # -- canonical form -------------------------------------------------------------

    def _derived_defaults(self) -> dict[str, Any]:
        """The fields whose default follows from others, with that default (0: off); an
        alignment left at top_left follows the mask again (replace)."""
        return {"alignment": "top_left",
                "max_tokens_q": self.batch * self.seqlen_q if self.ragged else 0,
                "max_tokens_kv": self.batch * self.seqlen_kv if self.ragged else 0,
                "num_pages": self.batch * self.pages_per_sequence,
                "out_dtype": self.dtype, "grad_dtype": self.dtype}

    def to_dict(self) -> dict[str, Any]:
        """The canonical form, as plain JSON types."""
        d: dict[str, Any] = {f: getattr(self, f) for f in FIELD_NAMES}
        for name, off in _OPTIONAL_FEATURES.items():
            if d[name] == off:
                del d[name]
        for name, default in self._derived_defaults().items():  # a default is implied, not stated
            if d.get(name) == default:
                d.pop(name, None)
        d["window"] = list(self.window)
        if not isinstance(self.layout, str):
            d["layout"] = {t: list(s) for t, s in zip(TENSORS, self.layout)}
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AttentionConfig":
        _fields.check_mapping(data, FIELDS)
        return cls(**data)

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no spaces. Equal configs give equal strings."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "AttentionConfig":
        return cls.from_dict(_fields.read_json(text))

    def replace(self, **changes: Any) -> "AttentionConfig":
        """A copy with some fields changed (and validated again). Fields left at a
        default that follows from others (max_tokens_*, num_pages) follow them again. A
        bottom-right band stored in its top-left form beside a bias or dropout (see
        alignment) is a top-left band here: changing seqlen_q or seqlen_kv keeps its
        bounds, so give the mask and window again with them."""
        for name, default in self._derived_defaults().items():
            if name not in changes and getattr(self, name) == default:
                changes[name] = None
        return dataclasses.replace(self, **changes)

    @classmethod
    def coerce(cls, value: Any) -> "AttentionConfig":
        """An AttentionConfig from a config, a mapping or a JSON string."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if isinstance(value, str):
            return cls.from_json(value)
        raise _bad("config", value, "must be an AttentionConfig, a mapping or a JSON string")


FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(AttentionConfig)  # the registry, in canonical order
FIELD_NAMES = tuple(f.name for f in FIELDS)
# Features added after the first release, with their off values: a config shows them
# only when on, so that the configs (and cache keys) of everything else stay the same.
# (max_tokens_* and num_pages default to values other fields imply: see _derived_defaults.)
_OPTIONAL_FEATURES = _fields.optional_features(FIELDS)


def _capped(cap: float, t):
    """Soft-capped scores cap * t and their derivative 1 - t^2, from t = tanh(s / cap)."""
    return cap * t, 1 - t * t
