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
  ignored: rotary_cos / rotary_sin, cache_leftpad, block_table in varlen,
  return_attn_probs with dropout_p > 0 (FlashAttention then returns the dropout pattern,
  S_dmask, which cuDNN does not expose), return_softmax_lse with a paged cache, and in
  flash_attn_with_kvcache head dims that are not multiples of 8 (padding them would copy
  the whole cache on every call). cuDNN's own refusals (for example a causal mask at the
  bottom right together with dropout when seqlen_q < seqlen_k, or in a varlen call whose
  cu_seqlens_q and cu_seqlens_k are different tensors) are NotSupportedError too,
  carrying cuDNN's reason.
- Where cuDNN refuses what FlashAttention does, fastattn.flash composes it from what
  cuDNN takes (slower than a direct plan, the same answer):
  - Rows without keys: with more queries than keys the first rows see no key;
    fastattn.flash writes FlashAttention's 0 and +inf there itself and runs the rest (a
    causal mask then has as many queries as keys).
  - One query against one key with gradients or the LSE (cudnn-frontend refuses a
    training plan of s_q = s_kv = 1, its documented check; more keys train as they are):
    the query block is padded to two rows, the second a padding row (seq_lens_q 1; a
    copy of q), and o and the LSE are sliced back; varlen builds the plan for
    max_seqlen_q 2 instead (no copy).
  - Head dims up to 256 that are not multiples of 8: q, k, v padded with zeros to the
    next one, as FlashAttention pads them (a copy of each padded tensor, the packed
    tensor once in the packed functions; none when they are multiples of 8), softmax_scale
    from the real head dim, out cut back (a view).
  - ALiBi with any slopes, causal or not (FlashAttention's -slope * |i + seqlen_k -
    seqlen_q - j|): cuDNN's own ALiBi where that is it (the paper's slopes, causal, as
    many queries as keys, no softcap), else an additive bias built on the device from
    the slopes ((1 or batch, heads, seqlen_q, seqlen_k) in q's dtype: memory and
    bandwidth of that size), with a bottom-right mask folded into it (cuDNN refuses one
    beside a bias; its tiles are then computed). varlen runs it as a zero-padded dense
    call (copies of q, k, v, lengths rounded up to powers of two), a paged cache is
    gathered into a dense one (a copy of the sequences' pages).
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

from typing import Literal, NamedTuple, overload

import torch
from torch import Tensor

from .. import _fields
from ..errors import InvalidArgumentError, NotSupportedError
from ..torch import attention, attention_paged, attention_varlen
from ..torch._plans import capturing

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]

_UNBOUNDED = (-1, -1)
_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack  # FakeTensorMode, make_fx's proxy mode, ...


# -- FlashAttention's conventions -------------------------------------------------------------

def _mask(causal, window_size, seqlen_k: int) -> tuple[bool, tuple[int, int] | None]:
    """(causal, window or None) as FlashAttention normalizes them (flash_api.cpp): causal
    sets right to 0, a bound >= seqlen_k is unbounded, and a right bound of 0 is the causal
    mask (FlashAttention's kernels treat it as one; so does cuDNN's graph)."""
    if causal.__class__ is not bool:
        causal = _fields.check("bool", "causal", causal)
    if window_size == _UNBOUNDED or window_size is None:
        return causal, None
    left, right = _fields.pair("window_size", window_size)
    if causal:
        right = 0
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if right == 0:
        causal = True
    return causal, (None if (left, right) == _UNBOUNDED else (left, right))


def _alibi(alibi_slopes, q: Tensor, heads: int, batch: int) -> Tensor | None:
    """The slopes, checked: None, or float32 (heads,) or (batch, heads) on q's device (as
    FlashAttention checks them; the bias is computed from them there) or the CPU (copied
    there when a bias is computed)."""
    if alibi_slopes is None:
        return None
    if (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32
            or tuple(alibi_slopes.shape) not in ((heads,), (batch, heads))):
        raise InvalidArgumentError(f"alibi_slopes: expected a float32 tensor of shape ({heads},) or ({batch}, "
                                   f"{heads}), got {getattr(alibi_slopes, 'dtype', type(alibi_slopes).__name__)} "
                                   f"{tuple(getattr(alibi_slopes, 'shape', ()))}")
    if alibi_slopes.device.type != "cpu":
        _on_device(q, alibi_slopes=alibi_slopes)
    return alibi_slopes


def _on_device(q: Tensor, **tensors) -> None:
    """InvalidArgumentError unless each tensor is on q's device (checked before fastattn.flash
    computes with them itself; fastattn.torch checks what it is given)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, q on {q.device}: expected one device")


def _cudnn_alibi(slopes: Tensor, heads: int) -> bool:
    """Whether cuDNN's own ALiBi computes these slopes: the ALiBi paper's for this many
    heads (cuDNN computes those and takes no others). Asked only where its ALiBi is
    FlashAttention's otherwise (see _dense); where it is not, the slopes go into a bias."""
    return (_read_alibi_slopes_eagerly if _compiling() else _read_alibi_slopes)(slopes, heads)


def _read_alibi_slopes(alibi_slopes: torch.Tensor, heads: int) -> bool:
    """Whether the slopes are the ALiBi paper's for this many heads. Reads them (one
    synchronization for CUDA slopes), which only real tensors outside a trace and outside
    a CUDA-graph capture allow; there the answer is False: the bias, built on the device
    from the slopes, serves any slopes and reads nothing on the host."""
    if (alibi_slopes.device.type not in ("cpu", "cuda") or _dispatch_modes()  # fake or meta tensors: a trace
            or (alibi_slopes.is_cuda and capturing())):
        return False
    expected = torch.tensor(standard_alibi_slopes(heads), dtype=torch.float32, device=alibi_slopes.device)
    return bool(torch.allclose(alibi_slopes, expected.expand_as(alibi_slopes), rtol=1e-5, atol=0.0))  # one sync


# Under torch.compile the slopes are fake in dynamo's trace: dynamo does not trace this
# one (a graph break, fullgraph=True refuses it naming the function) and runs it on the
# real slopes between two graphs, so that a compiled call runs eager's plan. torch._disable_dynamo is
# torch.compiler.disable without importing dynamo (slow) before a call, which only a
# trace makes; without it (an older torch) torch.allclose breaks the graph instead.
_read_alibi_slopes_eagerly = getattr(torch, "_disable_dynamo", lambda fn: fn)(_read_alibi_slopes)


def _masked(dtype: torch.dtype) -> float:
    """The bias of a masked score: far below any real one, and finite, so that a row (or a
    tile of a row) that sees only masked scores stays finite through cuDNN's online softmax
    (exp(-inf - -inf) would be NaN) and its backward; cuDNN's float32 arithmetic adds it to
    the scaled scores. float16's lowest, else -2^100 (exact in bfloat16 and float32, with
    room below for cuDNN's log2(e) factor)."""
    return max(torch.finfo(dtype).min, -2.0 ** 100)


class _AlibiBias(NamedTuple):
    bias: Tensor  # attention()'s bias
    row_max: Tensor  # float32 (1 or batch, heads, rows): what each row of it is shifted by, for the LSE
    keyless: Tensor | None  # bool (1 or batch, 1, rows): the queries that see no key; None: all see one


def _alibi_bias(slopes: Tensor, q: Tensor, rows: int, cols: int, shift, mask=None, lens_k=None) -> _AlibiBias:
    """FlashAttention's ALiBi, -slope * |i + shift - j| for query i and key j, as
    attention()'s additive bias, shift each sequence's seqlen_k - seqlen_q (an int, or
    int32 (batch,) for each sequence's own); slopes float32 (heads,) or (batch, heads),
    read on the device (no synchronization; traceable). The bias: (1 or batch, heads,
    rows, cols), contiguous, q's dtype and device, attention()'s full-row shape, without a
    gradient (FlashAttention's slopes have none). Computed in float32 and rounded once;
    each row is shifted by its largest value over the keys it sees (the one nearest the
    diagonal), so that the values that weigh in the softmax are small and keep their
    precision in q's dtype (a row far from the diagonal would lose it: float16 and
    bfloat16 hold 11 and 8 bits); softmax does not change, and _with_bias adds the shift
    back to the LSE.
    mask: None, or (causal, window) to fold FlashAttention's mask at that diagonal into the
      bias (_masked() where masked), for a call that passes attention() no mask.
    lens_k: int32 (batch,), each sequence's key length (attention() masks the keys past
      it, the padding, itself)."""
    with torch.no_grad():
        # (view, not [:, None]; narrow, index_select, not [...]; no ~: Python's indexing and ~
        # make a tensor on the device, which fake CUDA tensors cannot where PyTorch has no CUDA)
        i = torch.arange(rows, device=q.device, dtype=torch.float32).view(rows, 1)
        j = torch.arange(cols, device=q.device, dtype=torch.float32).view(1, cols)
        if isinstance(shift, torch.Tensor):
            shift = shift.to(torch.float32).view(-1, 1, 1, 1)
        diagonal = i + shift  # each query's diagonal key: (rows, 1) or (batch, 1, rows, 1)
        rel = diagonal - j  # FlashAttention's mask lets -right <= rel <= left through
        left, right = _UNBOUNDED
        if mask is not None:
            causal, window = mask
            left, right = window or _UNBOUNDED
            if causal:
                right = 0
        # The keys each query sees, [first, last], and the distance from its diagonal to them.
        first = (diagonal - left).clamp(min=0) if left >= 0 else torch.zeros_like(diagonal)
        if lens_k is None:
            last = (diagonal + right).clamp(max=cols - 1) if right >= 0 else torch.full_like(diagonal, cols - 1)
        else:
            end = lens_k.to(torch.float32).view(-1, 1, 1, 1) - 1
            last = torch.minimum(diagonal + right, end) if right >= 0 else end + torch.zeros_like(diagonal)
        nearest = (first - diagonal).clamp(min=0) + (diagonal - last).clamp(min=0)
        s = slopes.detach().to(q.device)
        s = s.view(-1, s.shape[-1], 1, 1)
        bias = (s * (rel.abs() - nearest)).neg_()
        if left >= 0 or right >= 0:
            unseen = (rel < -right) if right >= 0 else torch.zeros_like(rel, dtype=torch.bool)
            if left >= 0:
                unseen |= rel > left
            bias.masked_fill_(unseen, _masked(q.dtype))
        keyless = (first > last).view(-1, 1, rows) if left >= 0 or right >= 0 or lens_k is not None else None
        return _AlibiBias(bias.to(q.dtype), (-s * nearest).squeeze(-1), keyless)


def _with_bias(out, alibi: _AlibiBias, lse: bool):
    """out (o, or (o, stats)) of a call with the bias: the LSE with each row's shift added
    back, and FlashAttention's 0 (and LSE +inf) in the rows that see no key (whose keys
    the bias masked: cuDNN's softmax of equal masked scores there)."""
    o: Tensor = out[0] if lse else out
    if alibi.keyless is not None:
        o = o.masked_fill(alibi.keyless.transpose(1, 2).unsqueeze(-1), 0)
    if not lse:
        return o
    stats: Tensor = out[1] + alibi.row_max
    return o, stats if alibi.keyless is None else stats.masked_fill(alibi.keyless, float("inf"))


def standard_alibi_slopes(heads: int) -> list[float]:
    """The ALiBi paper's slopes for `heads` heads (its get_slopes, which FlashAttention's
    tests use too, and which cuDNN computes): 2^(-8 i / n) for a power of two n, else the
    nearest lower power's, then every other one of the next power's."""
    def power_of_2(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    n = 1 << (heads.bit_length() - 1)
    return power_of_2(n) + power_of_2(2 * n)[0::2][:heads - n]


def _common(dropout_p, return_attn_probs) -> float:
    if dropout_p:
        dropout_p = _fields.check("probability", "dropout_p", dropout_p)
    if return_attn_probs.__class__ is not bool:
        return_attn_probs = _fields.check("bool", "return_attn_probs", return_attn_probs)
    if return_attn_probs and dropout_p:
        raise NotSupportedError("return_attn_probs=True with dropout_p > 0: FlashAttention then returns the dropout "
                                "pattern (S_dmask), which cuDNN does not expose; pass dropout_p=0 to get the LSE")
    return dropout_p


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def _deterministic(deterministic, lse: bool, *tensors) -> bool:
    """fastattn takes deterministic only for a call with a backward (FlashAttention ignores it
    without one)."""
    if deterministic.__class__ is not bool:
        deterministic = _fields.check("bool", "deterministic", deterministic)
    return deterministic and (lse or _needs_grad(*tensors))


def _one_by_one(s_q: int, s_kv: int, training: bool) -> bool:
    """Whether cuDNN refuses this plan for its one query and one key: cudnn-frontend's
    backward graph does ("s_q = s_kv = 1 is not supported", its documented check), and a
    training plan (gradients, or the LSE: the training plan's forward writes it) builds
    its backward graph too. One query against more keys trains as it is."""
    return training and s_q == 1 and s_kv == 1


def _attend(q, k, v, *, return_lse: bool, seq_lens_q=None, seq_lens_kv=None, bias=None, **options):
    """fastattn.torch.attention, with a training plan of one query and one key (which cuDNN
    refuses, _one_by_one) run as a plan of two queries, the second a padding row: q padded
    with a row of zeros (a copy of q, one row of its size more), seq_lens_q 1 and
    seq_lens_kv the real key lengths (1 unless given), so the real query keeps its place
    against the keys at either alignment; o and the LSE are sliced back to the real row
    (views; the gradient flows through the slice and the padding, which get zero)."""
    b = q.shape[0]
    if not _one_by_one(q.shape[1], k.shape[1], return_lse or _needs_grad(q, k, v)):
        return attention(q, k, v, seq_lens_q=seq_lens_q, seq_lens_kv=seq_lens_kv, bias=bias, return_lse=return_lse,
                         **options)
    q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, 1))
    if seq_lens_q is None:
        seq_lens_q = seq_lens_kv = _full(q, b, 1)
    if bias is not None:
        bias = torch.nn.functional.pad(bias, (0, 0, 0, 1))  # (.., 2, 1): a row for the padding row too
    out = attention(q, k, v, seq_lens_q=seq_lens_q, seq_lens_kv=seq_lens_kv, bias=bias, return_lse=return_lse,
                    **options)
    return (out[0].narrow(1, 0, 1), out[1].narrow(-1, 0, 1)) if return_lse else out.narrow(1, 0, 1)


# Full-length tensors for a padding mask that masks nothing: cuDNN takes a bottom-right
# diagonal with seqlen_q > seqlen_k only with per-sequence lengths. Kept per (device,
# batch, length), except while a CUDA graph is captured (a tensor made then is only
# filled when the graph replays).
_full_lengths: dict[tuple, torch.Tensor] = {}


def _full(q: torch.Tensor, batch: int, n: int) -> torch.Tensor:
    if not q.is_cuda or type(q) is not torch.Tensor or capturing():  # meta, fake tensors, or a capture
        return torch.full((batch,), n, dtype=torch.int32, device=q.device)
    key = (q.device, batch, n)
    t = _full_lengths.get(key)
    if t is None:
        t = _full_lengths[key] = torch.full((batch,), n, dtype=torch.int32, device=q.device)
    return t


def _shape(t, name: str, dims: int, what: str) -> tuple[int, ...]:
    shape = getattr(t, "shape", None)
    if not isinstance(t, torch.Tensor) or len(shape) != dims:
        raise InvalidArgumentError(f"{name}: expected a torch.Tensor {what}, got "
                                   f"{tuple(shape) if shape is not None else type(t).__name__}")
    return shape


# -- head dims cuDNN does not take: padded to a multiple of 8, as FlashAttention pads them -------

def _unpadded(*dims: int) -> bool:
    """Whether cuDNN takes these head dims as they are: multiples of 8 (and above 256,
    which no padding helps: cuDNN's refusal says so)."""
    return all(d % 8 == 0 or d > 256 for d in dims)


def _pad_head_dim(t: Tensor) -> Tensor:
    """t with zeros after its last dimension up to a multiple of 8: a copy (the zeros are
    memory t does not hold, whatever its strides), or t itself when it needs none."""
    d = t.shape[-1]
    return t if _unpadded(d) else torch.nn.functional.pad(t, (0, -d % 8))


def _pad_head_dims(q, k, v, softmax_scale):
    """(q, k, v, softmax_scale, head_dim_v or None): FlashAttention's padding of head dims
    that are not multiples of 8 (its flash_attn_interface pads q, k, v with zeros and
    slices the output, whose gradient autograd pads back): zeros add nothing to q . k and
    give the output columns that are cut off. softmax_scale keeps its default from the
    real head dim. head_dim_v: v's real head dim to cut o back to, None where nothing is
    padded (no copy). Tensors whose head dims do not match are left to fastattn.torch's
    checks."""
    if (not isinstance(v, torch.Tensor) or v.dim() != q.dim() or q.shape[-1] != k.shape[-1]
            or _unpadded(q.shape[-1], v.shape[-1])):
        return q, k, v, softmax_scale, None
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v), scale, v.shape[-1]


def _cut_head_dim(out, head_dim_v: int | None):
    """out (or (out, lse, ...)) with o cut back to v's real head dim (a view)."""
    if head_dim_v is None:
        return out
    if isinstance(out, tuple):
        return (out[0].narrow(-1, 0, head_dim_v), *out[1:])
    return out.narrow(-1, 0, head_dim_v)


# -- dense ------------------------------------------------------------------------------------

# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                    causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                    return_attn_probs: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                    causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                    return_attn_probs: Literal[True]) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                    causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                    alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                    return_attn_probs: bool = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_func.

    q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_k, headdim); v:
      (batch, seqlen_k, nheads_k, headdim_v); float16 or bfloat16 CUDA tensors, nheads a
      multiple of nheads_k (MQA/GQA), any strides cuDNN takes (last dimension contiguous).
      headdim and headdim_v up to 256: those that are not multiples of 8 (which cuDNN
      takes only) are padded with zeros to the next one, as FlashAttention pads them (a
      copy of each tensor padded; none otherwise), and out is cut back (a view).
    dropout_p: applied whenever > 0 (pass 0 in evaluation, as with FlashAttention).
    softmax_scale: default 1 / sqrt(headdim) (the real headdim's, also when padded).
    causal, window_size: bottom-right aligned (see the module doc).
    softcap: logit soft-capping, softcap * tanh(score / softcap), in cuDNN's graph (0.0:
      none; fastattn.torch.attention's).
    alibi_slopes: float32 (nheads,) or (batch, nheads), any values, causal or not:
      FlashAttention's bias -slope * |i + seqlen_k - seqlen_q - j|. cuDNN's own ALiBi runs
      where it is that bias: the ALiBi paper's slopes (standard_alibi_slopes; checking them
      reads the slopes, see the module doc), causal, as many queries as keys (after the rows
      without keys are cut), no softcap. Elsewhere the bias is built on the device
      ((1 or batch, nheads, seqlen_q, seqlen_k) in q's dtype) and passed as attention()'s
      bias, with a bottom-right mask folded into it (cuDNN refuses that mask beside a bias;
      the masked tiles are then computed, not skipped).
    deterministic: a deterministic backward.
    return_attn_probs: also return softmax_lse, float32 (batch, nheads, seqlen_q), and
      S_dmask (None: dropout_p must be 0).

    One query against one key (seqlen_q = seqlen_k = 1, or the one row left when the rows
    above the diagonal are cut), with gradients or the LSE: cuDNN refuses that training
    plan, so the query block is padded to two rows, the second a padding row (a copy of
    q; see the module doc).

    Returns out (batch, seqlen_q, nheads, headdim_v), or (out, softmax_lse, None).
    Raises InvalidArgumentError, NotSupportedError (see the module doc).
    """
    sq = _shape(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")[1]
    sk = _shape(k, "k", 4, "(batch, seqlen_k, nheads_k, headdim)")[1]
    causal, window = _mask(causal, window_size, sk)
    dropout_p = _common(dropout_p, return_attn_probs)
    slopes = _alibi(alibi_slopes, q, q.shape[2], q.shape[0])
    deterministic = _deterministic(deterministic, return_attn_probs, q, k, v)
    q, k, v, softmax_scale, head_dim_v = _pad_head_dims(q, k, v, softmax_scale)
    right = 0 if causal else window[1] if window is not None else -1
    empty = sq - sk - right if right >= 0 else 0
    if empty > 0:
        return _cut_head_dim(_with_empty_rows(q, k, v, empty, causal, window, softmax_scale, deterministic, slopes,
                                              dropout_p, return_attn_probs, softcap), head_dim_v)
    out = _dense(q, k, v, causal, window, softmax_scale, deterministic, slopes, dropout_p, return_attn_probs, softcap)
    return _cut_head_dim((*out, None) if return_attn_probs else out, head_dim_v)


def _fa_lse(out, lse: bool):
    """(o, lse) with FlashAttention's LSE for a row that sees no key: +inf (so that its
    backward's exp(s - lse) is 0), where cuDNN's log of an empty sum is -inf. A new
    tensor: the stats autograd saved for backward stay cuDNN's."""
    if not lse:
        return out
    o, stats = out
    return o, stats.masked_fill(stats == float("-inf"), float("inf"))


def _dense(q, k, v, causal, window, scale, deterministic, slopes, dropout_p, lse, softcap):
    """flash_attn_func on attention(), for a q whose every row sees a key (the rows that
    see none are cut before: _with_empty_rows)."""
    sq, sk = q.shape[1], k.shape[1]
    # Where seqlen_q == seqlen_k both diagonals are one: the top-left graph then (which
    # cuDNN also builds with dropout and ALiBi) is the same answer as FlashAttention's.
    bottom = sq != sk and (causal or window is not None)
    alibi, bias = False, None
    if slopes is not None and (sq, sk) != (1, 1):  # (one query and one key: the bias is 0)
        # cuDNN's ALiBi, slope * (j - i) under a top-left causal mask, is FlashAttention's
        # -slope * |i + sk - sq - j| with as many queries as keys, for the paper's slopes
        # (cuDNN computes those), and not beside softcap (cuDNN refuses the pair).
        if causal and not bottom and not softcap and _cudnn_alibi(slopes, q.shape[2]):
            alibi = True
        else:
            # A bias cuDNN takes beside a top-left mask, not a bottom-right one: that mask goes
            # into the bias (and its tiles are computed rather than skipped).
            bias = _alibi_bias(slopes, q, sq, sk, sk - sq, (causal, window) if bottom else None)
            if bottom:
                causal, window, bottom = False, None, False
    lens_q = lens_k = None
    if bottom and sq > sk:  # cuDNN takes it only with per-sequence lengths
        lens_q, lens_k = _full(q, q.shape[0], sq), _full(q, q.shape[0], sk)
    out = _attend(q, k, v, causal=causal, window=window, scale=scale, deterministic=deterministic,
                  seq_lens_q=lens_q, seq_lens_kv=lens_k, alibi=alibi, bias=None if bias is None else bias.bias,
                  dropout_p=dropout_p, alignment="bottom_right" if bottom else "top_left", return_lse=lse,
                  softcap=softcap)
    return _fa_lse(out if bias is None else _with_bias(out, bias, lse), lse)


def _with_empty_rows(q, k, v, empty, causal, window, scale, deterministic, slopes, dropout_p, lse, softcap):
    """The first `empty` queries see no key (the bottom-right diagonal passes above them:
    more queries than keys): FlashAttention writes 0 and an LSE of +inf there. The rest run
    alone, a slice of q whose bottom-right diagonal is the same (the shift grows with the
    rows cut), so cuDNN never sees a row without keys; a causal mask then has as many
    queries as keys, where the top-left graph (with dropout and ALiBi) is the same one."""
    b, _, h, _ = q.shape
    out = _dense(q[:, empty:], k, v, causal, window, scale, deterministic, slopes, dropout_p, lse, softcap)
    o, stats = out if lse else (out, None)
    o = torch.cat([o.new_zeros(b, empty, h, o.shape[3]), o], 1)
    if not lse:
        return o
    return o, torch.cat([stats.new_full((b, h, empty), float("inf")), stats], 2), None


# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                              causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                              alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                              return_attn_probs: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                              causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                              alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                              return_attn_probs: Literal[True]) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                              causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                              alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                              return_attn_probs: bool = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Tensor | None = None, deterministic: bool = False,
                              return_attn_probs: bool = False) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_qkvpacked_func: qkv (batch, seqlen, 3, nheads, headdim);
    q, k, v are views of it (no copy; a headdim that is not a multiple of 8 pads qkv once,
    one copy), and its gradient is dqkv. Otherwise flash_attn_func."""
    shape = _shape(qkv, "qkv", 5, "(batch, seqlen, 3, nheads, headdim)")
    if shape[2] != 3:
        raise InvalidArgumentError(f"qkv has shape {tuple(shape)}: expected (batch, seqlen, 3, nheads, headdim)")
    head_dim_v = None
    if not _unpadded(shape[4]):  # padded once, packed (one copy), rather than q, k and v apart
        head_dim_v, softmax_scale = shape[4], shape[4] ** -0.5 if softmax_scale is None else softmax_scale
        qkv = _pad_head_dim(qkv)
    q, k, v = qkv.unbind(2)
    return _cut_head_dim(flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                         alibi_slopes, deterministic, return_attn_probs), head_dim_v)


# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                             causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                             alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                             return_attn_probs: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                             causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                             alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                             return_attn_probs: Literal[True]) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = ..., softmax_scale: float | None = ...,
                             causal: bool = ..., window_size: tuple[int, int] = ..., softcap: float = ...,
                             alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                             return_attn_probs: bool = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                             causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Tensor | None = None, deterministic: bool = False,
                             return_attn_probs: bool = False) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_kvpacked_func: kv (batch, seqlen_k, 2, nheads_k, headdim);
    k, v are views of it (no copy; a headdim that is not a multiple of 8 pads q and kv
    once each). Otherwise flash_attn_func."""
    shape = _shape(kv, "kv", 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if shape[2] != 2:
        raise InvalidArgumentError(f"kv has shape {tuple(shape)}: expected (batch, seqlen_k, 2, nheads_k, headdim)")
    head_dim_v = None
    if not _unpadded(shape[4]) and isinstance(q, torch.Tensor) and q.shape[-1] == shape[4]:
        head_dim_v, softmax_scale = shape[4], shape[4] ** -0.5 if softmax_scale is None else softmax_scale
        q, kv = _pad_head_dim(q), _pad_head_dim(kv)  # kv padded once, packed
    k, v = kv.unbind(2)
    return _cut_head_dim(flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                         alibi_slopes, deterministic, return_attn_probs), head_dim_v)


# -- varlen -----------------------------------------------------------------------------------

# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                           softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                           softcap: float = ..., alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                           return_attn_probs: Literal[False] = ..., block_table: Tensor | None = ...) -> Tensor: ...
@overload
def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                           softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                           softcap: float = ..., alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                           return_attn_probs: Literal[True],
                           block_table: Tensor | None = ...) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                           softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                           softcap: float = ..., alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                           return_attn_probs: bool = ...,
                           block_table: Tensor | None = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False,
                           block_table: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_varlen_func.

    q: (total_q, nheads, headdim), k: (total_k, nheads_k, headdim), v: (total_k, nheads_k,
      headdim_v): the batch's sequences one after another (copied if not contiguous, or
      padded as flash_attn_func's head dims, the padded copy contiguous).
    cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), cumulative lengths from 0.
    max_seqlen_q, max_seqlen_k: the longest sequences (plans are built for them rounded up
      to a power of two; a window bound >= max_seqlen_k is unbounded, as FlashAttention's).
    causal, window_size: bottom-right aligned per sequence (see the module doc); with one
      cu_seqlens tensor for q and k both diagonals are one (the top-left graph runs).
    dropout_p, softcap: as flash_attn_func; cuDNN takes dropout with a top-left diagonal
      only, so with causal or a window, pass the same cu_seqlens tensor for q and k.
    alibi_slopes: as flash_attn_func's, per sequence. cuDNN's ALiBi where it is
      FlashAttention's (the paper's slopes, causal, one cu_seqlens tensor for q and k, no
      softcap); otherwise a bias, which cuDNN's packed plans cannot take: the sequences are
      unpacked into a zero-padded dense batch at max_seqlen_q x max_seqlen_k rounded up to
      powers of two (copies of q, k, v; compute and a bias (batch, nheads, those lengths)
      at that size) and the output packed back.
    block_table: only None (paged varlen: use flash_attn_with_kvcache).
    return_attn_probs: also return softmax_lse, float32 (nheads, total_q), and None.
    max_seqlen_q = max_seqlen_k = 1 with gradients or the LSE (cuDNN refuses that training
      plan): the plan is built for two queries, each sequence's length of 1 padding it (no
      copy).

    Returns out (total_q, nheads, headdim_v), or (out, softmax_lse, None).
    """
    if block_table is not None:
        raise NotSupportedError("block_table: fastattn.flash has no paged varlen attention (cuDNN's paged plans are "
                                "forward only and fixed-batch); flash_attn_with_kvcache takes a block table")
    dropout_p = _common(dropout_p, return_attn_probs)
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int):
        raise InvalidArgumentError(f"max_seqlen_k={max_seqlen_k!r}: must be an int >= 1")
    causal, window = _mask(causal, window_size, max_seqlen_k)
    batch = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1 else -1
    slopes = _alibi(alibi_slopes, q, _shape(q, "q", 3, "(total_q, nheads, headdim)")[1], batch)
    deterministic = _deterministic(deterministic, return_attn_probs, q, k, v)
    _shape(k, "k", 3, "(total_k, nheads_k, headdim)")
    q, k, v, softmax_scale, head_dim_v = _pad_head_dims(q, k, v, softmax_scale)  # (padded: contiguous copies)
    q, k, v = (t if not isinstance(t, torch.Tensor) or t.is_contiguous() else t.contiguous() for t in (q, k, v))
    # The same cumulative lengths: each sequence's q and k lengths are equal, and the
    # top-left diagonal is the bottom-right one (the plans attention_varlen shares).
    bottom = cu_seqlens_q is not cu_seqlens_k and (causal or window is not None)
    if _one_by_one(max_seqlen_q, max_seqlen_k, return_attn_probs or _needs_grad(q, k, v)):
        # Sequences of one query and one key (cuDNN refuses the training plan of 1 x 1): a
        # plan for two queries, which each sequence's cu_seqlens_q length of 1 pads (the
        # plan's longest is an upper bound). No copy; the diagonal is each sequence's own.
        max_seqlen_q = 2
    # cuDNN's ALiBi where it is FlashAttention's (see _dense; each sequence's q and k
    # lengths equal); other slopes and masks take a bias, which a packed plan cannot.
    if slopes is not None and not (causal and not bottom and not softcap and _cudnn_alibi(slopes, q.shape[1])):
        out = _varlen_as_dense(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window,
                               bottom, softmax_scale, deterministic, slopes, dropout_p, return_attn_probs, softcap)
    else:
        out = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                               window=window, scale=softmax_scale, deterministic=deterministic,
                               alignment="bottom_right" if bottom else "top_left", alibi=slopes is not None,
                               dropout_p=dropout_p, return_lse=return_attn_probs, softcap=softcap)
    out = _fa_lse(out, return_attn_probs)
    return _cut_head_dim((*out, None) if return_attn_probs else out, head_dim_v)


def _bucket(n: int) -> int:
    """attention_varlen's plan length for a longest sequence of n: the next power of two
    (so that batches of other lengths share the plan)."""
    return 1 << max(0, n - 1).bit_length()


def _varlen_as_dense(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, bottom, scale, deterministic, slopes,
                     dropout_p, lse, softcap):
    """flash_attn_varlen_func with ALiBi as a bias, which is per sequence and which cuDNN's
    packed plans cannot take: the sequences unpacked into a zero-padded dense batch
    (batch, seqlen, ...) with seqlen max_seqlen rounded up to a power of two as
    attention_varlen's plans are (copies of q, k, v; compute and the bias, (1 or batch,
    nheads, seqlen_q, seqlen_k), at that padded size), attended with each sequence's
    lengths as seq_lens_q/kv, and o and the LSE packed back (gathers, no synchronization;
    the gradients flow back through them). The mask at each sequence's bottom right
    (different cu_seqlens tensors) goes into the bias, which cuDNN refuses beside a
    bottom-right mask; with one cu_seqlens tensor cuDNN applies it at the top left."""
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < 2:
            raise InvalidArgumentError(f"{name}: expected an int32 tensor of batch + 1 cumulative lengths, got "
                                       f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if cu_q.shape != cu_k.shape:
        raise InvalidArgumentError(f"cu_seqlens_q has {cu_q.shape[0]} entries, cu_seqlens_k {cu_k.shape[0]}")
    for name, n in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < 2**31:
            raise InvalidArgumentError(f"{name}={n!r}: must be an int >= 1 and < 2**31")
    _shape(v, "v", 3, "(total_k, nheads_k, headdim_v)")
    _on_device(q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    if k.shape[0] != v.shape[0]:
        raise InvalidArgumentError(f"k has {k.shape[0]} tokens, v {v.shape[0]}")
    b = cu_q.shape[0] - 1
    rows, cols = _bucket(max_q), _bucket(max_k)
    if _one_by_one(rows, cols, lse or _needs_grad(q, k, v)):
        rows = 2  # (see flash_attn_varlen_func; the padded rows are the padding)
    lens_q, lens_k = cu_q.diff(), cu_k.diff()
    bias = _alibi_bias(slopes, q, rows, cols, lens_k - lens_q, (causal, window) if bottom else None, lens_k)
    if bottom:
        causal, window = False, None
    out = _attend(_unpack(q, cu_q, lens_q, rows), _unpack(k, cu_k, lens_k, cols), _unpack(v, cu_k, lens_k, cols),
                  causal=causal, window=window, scale=scale, deterministic=deterministic, seq_lens_q=lens_q,
                  seq_lens_kv=lens_k, bias=bias.bias, dropout_p=dropout_p, return_lse=lse, softcap=softcap)
    out = _with_bias(out, bias, lse)
    o: Tensor = out[0] if lse else out
    rows_of = _token_rows(cu_q, q.shape[0], rows)
    o = _pack(o.reshape(b * rows, *o.shape[2:]), rows_of, 0)
    if not lse:
        return o
    stats: Tensor = out[1]
    return o, _pack(stats.transpose(0, 1).reshape(stats.shape[1], b * rows), rows_of, 1, float("inf"))


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


def _token_rows(cu: Tensor, total: int, rows: int) -> Tensor:
    """For each packed token, its row of the dense (batch * rows) block, or -1 for tokens past cu_seqlens[-1] or
    past rows."""
    b = cu.shape[0] - 1
    tok = torch.arange(total, device=cu.device, dtype=cu.dtype)
    seq = torch.searchsorted(cu.narrow(0, 1, b), tok, right=True)
    inside = seq < b
    seq = seq.clamp_(max=b - 1)
    pos = tok - cu.index_select(0, seq)
    return torch.where(inside & (pos < rows), seq * rows + pos, -1)


def _pack(dense: Tensor, rows_of: Tensor, dim: int, fill: float = 0.0) -> Tensor:
    """dense's rows (along dim) for each packed token (_token_rows), fill where it has none."""
    none = rows_of < 0
    out = dense.index_select(dim, rows_of.clamp(min=0))
    return out.masked_fill_(none.view(-1, *[1] * (out.dim() - 1 - dim)) if dim == 0 else none, fill)


# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = ...,
                                     softmax_scale: float | None = ..., causal: bool = ...,
                                     window_size: tuple[int, int] = ..., softcap: float = ...,
                                     alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                                     return_attn_probs: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = ...,
                                     softmax_scale: float | None = ..., causal: bool = ...,
                                     window_size: tuple[int, int] = ..., softcap: float = ...,
                                     alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                                     return_attn_probs: Literal[True]) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = ...,
                                     softmax_scale: float | None = ..., causal: bool = ...,
                                     window_size: tuple[int, int] = ..., softcap: float = ...,
                                     alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                                     return_attn_probs: bool = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: float | None = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Tensor | None = None, deterministic: bool = False,
                                     return_attn_probs: bool = False) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_varlen_qkvpacked_func: qkv (total, 3, nheads, headdim),
    one cu_seqlens and max_seqlen for q and k. Otherwise flash_attn_varlen_func."""
    shape = _shape(qkv, "qkv", 4, "(total, 3, nheads, headdim)")
    if shape[1] != 3:
        raise InvalidArgumentError(f"qkv has shape {tuple(shape)}: expected (total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


# The result's type follows return_attn_probs (for type checkers).
@overload
def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                                    softmax_scale: float | None = ..., causal: bool = ...,
                                    window_size: tuple[int, int] = ..., softcap: float = ...,
                                    alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                                    return_attn_probs: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                                    softmax_scale: float | None = ..., causal: bool = ...,
                                    window_size: tuple[int, int] = ..., softcap: float = ...,
                                    alibi_slopes: Tensor | None = ..., deterministic: bool = ..., *,
                                    return_attn_probs: Literal[True]) -> tuple[Tensor, Tensor, None]: ...
@overload
def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = ...,
                                    softmax_scale: float | None = ..., causal: bool = ...,
                                    window_size: tuple[int, int] = ..., softcap: float = ...,
                                    alibi_slopes: Tensor | None = ..., deterministic: bool = ...,
                                    return_attn_probs: bool = ...) -> Tensor | tuple[Tensor, Tensor, None]: ...


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: float | None = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Tensor | None = None, deterministic: bool = False,
                                    return_attn_probs: bool = False) -> Tensor | tuple[Tensor, Tensor, None]:
    """FlashAttention's flash_attn_varlen_kvpacked_func: kv (total_k, 2, nheads_k, headdim).
    Otherwise flash_attn_varlen_func."""
    shape = _shape(kv, "kv", 4, "(total_k, 2, nheads_k, headdim)")
    if shape[1] != 2:
        raise InvalidArgumentError(f"kv has shape {tuple(shape)}: expected (total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


# -- KV cache ---------------------------------------------------------------------------------

def _cache_lengths(cache_seqlens, batch: int, full: int, q: torch.Tensor) -> torch.Tensor:
    if cache_seqlens is None:
        return _full(q, batch, full)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        return torch.full((batch,), _fields.check_int("cache_seqlens", cache_seqlens, 0), dtype=torch.int32,
                          device=q.device)
    if (not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32
            or tuple(cache_seqlens.shape) != (batch,)):
        raise InvalidArgumentError(f"cache_seqlens: expected an int or an int32 tensor of shape ({batch},), got "
                                   f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)} "
                                   f"{tuple(getattr(cache_seqlens, 'shape', ()))}")
    return cache_seqlens


def _append(k_cache, v_cache, k, v, lengths, block_table, batch_idx) -> None:
    """Writes the new keys and values of each sequence b at positions lengths[b] ... of its
    cache, in place, as FlashAttention does (its cache_seqlens stay the caller's to advance).
    Index arithmetic on the device: no synchronization."""
    b, s_new = k.shape[0], k.shape[1]
    pos = lengths.to(torch.int64)[:, None] + torch.arange(s_new, device=k.device)[None, :]  # (b, s_new)
    if block_table is not None:
        page_size = k_cache.shape[1]
        rows = block_table.to(torch.int64).gather(1, pos // page_size)
        cols = pos % page_size
    else:
        rows = (batch_idx.to(torch.int64) if batch_idx is not None else torch.arange(b, device=k.device))[:, None]
        rows, cols = rows.expand(b, s_new), pos
    k_cache.index_put_((rows, cols), k)
    v_cache.index_put_((rows, cols), v)


# The result's type follows return_softmax_lse (for type checkers).
@overload
def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = ...,
                            v: Tensor | None = ..., rotary_cos: Tensor | None = ..., rotary_sin: Tensor | None = ...,
                            cache_seqlens: int | Tensor | None = ..., cache_batch_idx: Tensor | None = ...,
                            cache_leftpad: Tensor | None = ..., block_table: Tensor | None = ...,
                            softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                            softcap: float = ..., rotary_interleaved: bool = ..., alibi_slopes: Tensor | None = ...,
                            num_splits: int = ..., return_softmax_lse: Literal[False] = ...) -> Tensor: ...
@overload
def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = ...,
                            v: Tensor | None = ..., rotary_cos: Tensor | None = ..., rotary_sin: Tensor | None = ...,
                            cache_seqlens: int | Tensor | None = ..., cache_batch_idx: Tensor | None = ...,
                            cache_leftpad: Tensor | None = ..., block_table: Tensor | None = ...,
                            softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                            softcap: float = ..., rotary_interleaved: bool = ..., alibi_slopes: Tensor | None = ...,
                            num_splits: int = ..., *, return_softmax_lse: Literal[True]) -> tuple[Tensor, Tensor]: ...
@overload
def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = ...,
                            v: Tensor | None = ..., rotary_cos: Tensor | None = ..., rotary_sin: Tensor | None = ...,
                            cache_seqlens: int | Tensor | None = ..., cache_batch_idx: Tensor | None = ...,
                            cache_leftpad: Tensor | None = ..., block_table: Tensor | None = ...,
                            softmax_scale: float | None = ..., causal: bool = ..., window_size: tuple[int, int] = ...,
                            softcap: float = ..., rotary_interleaved: bool = ..., alibi_slopes: Tensor | None = ...,
                            num_splits: int = ...,
                            return_softmax_lse: bool = ...) -> Tensor | tuple[Tensor, Tensor]: ...


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
                            v: Tensor | None = None, rotary_cos: Tensor | None = None,
                            rotary_sin: Tensor | None = None, cache_seqlens: int | Tensor | None = None,
                            cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
                            block_table: Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Tensor | None = None, num_splits: int = 0,
                            return_softmax_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """FlashAttention's flash_attn_with_kvcache (forward only, no gradients).

    q: (batch, seqlen_q, nheads, headdim), headdim a multiple of 8 (NotSupportedError
      otherwise: the caches would have to be padded, a copy of each whole cache per call).
    k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim) dense, or with
      block_table (num_blocks, page_block_size, nheads_k, headdim) pages (any page size).
    k, v: None, or (batch, seqlen_new, nheads_k, headdim): written into the caches in
      place at each sequence's cache_seqlens before attending (cache_seqlens is not
      advanced, as with FlashAttention).
    cache_seqlens: an int or int32 (batch,): each sequence's cached length before k, v
      (None: the whole cache; needed with k, v).
    cache_batch_idx: int32 (batch,): the cache rows of a dense cache (default 0 ... batch
      - 1); the rows are gathered (a copy). Not with block_table.
    block_table: int32 (batch, max_num_blocks_per_seq): each sequence's pages.
    causal, window_size: bottom-right aligned per sequence: query i sees keys up to
      cache_seqlens + seqlen_new - seqlen_q + i (see the module doc).
    softcap: as flash_attn_func.
    rotary_cos, rotary_sin, cache_leftpad: NotSupportedError.
    alibi_slopes: as flash_attn_func's, at each sequence's bottom right: a bias (batch,
      nheads, seqlen_q, seqlen_cache) holding the mask too; with block_table the
      sequences' pages are gathered into a dense cache first (a copy: attention_paged
      takes no bias).
    rotary_interleaved: checked; used only with rotary (as FlashAttention).
    num_splits: an int >= 0, no effect (cuDNN chooses).
    return_softmax_lse: also return softmax_lse, float32 (batch, nheads, seqlen_q); not
      with block_table.

    Returns out (batch, seqlen_q, nheads, headdim_v), or (out, softmax_lse).
    """
    for name, value, why in (("rotary_cos", rotary_cos, "rotary embedding inside the call"),
                             ("rotary_sin", rotary_sin, "rotary embedding inside the call"),
                             ("cache_leftpad", cache_leftpad, "left-padded caches")):
        if value is not None:
            raise NotSupportedError(f"{name}: cuDNN's fused attention has no {why}; pass None")
    _fields.check("bool", "rotary_interleaved", rotary_interleaved)
    _fields.check("int", "num_splits", num_splits)
    lse = _fields.check("bool", "return_softmax_lse", return_softmax_lse)
    batch, sq = _shape(q, "q", 4, "(batch, seqlen_q, nheads, headdim)")[:2]
    _shape(k_cache, "k_cache", 4, "(batch_size_cache or num_blocks, seqlen_cache or page_block_size, nheads_k, "
           "headdim)")
    if (k is None) != (v is None):
        raise InvalidArgumentError("k and v: give both (new keys and values to append) or neither")
    if isinstance(v_cache, torch.Tensor) and not _unpadded(q.shape[3], k_cache.shape[3], v_cache.shape[-1]):
        raise NotSupportedError(
            f"flash_attn_with_kvcache with head dims {q.shape[3]} (q, k_cache) and {v_cache.shape[-1]} (v_cache): "
            "cuDNN takes multiples of 8, and padding a cache's head dim copies the whole cache on every call "
            "(FlashAttention does, and copies it back after appending k, v). Allocate the caches with the head dim "
            "rounded up to a multiple of 8, zeros past it, pad q, k, v with zeros alike, pass softmax_scale=1/sqrt("
            "the real head dim), and cut the output")
    if block_table is not None:
        if cache_batch_idx is not None:
            raise NotSupportedError("cache_batch_idx with block_table: the block table already maps each sequence's "
                                    "pages (FlashAttention refuses this too)")
        if lse:
            raise NotSupportedError("return_softmax_lse=True with block_table: cuDNN's paged plans write no softmax "
                                    "stats (fastattn builds them forward only, without training)")
        _shape(block_table, "block_table", 2, "int32 (batch, max_num_blocks_per_seq)")
        seqlen_k = block_table.shape[1] * k_cache.shape[1]
    else:
        seqlen_k = k_cache.shape[1]
    lengths = _cache_lengths(cache_seqlens, batch, seqlen_k, q)
    causal, window = _mask(causal, window_size, seqlen_k)
    slopes = _alibi(alibi_slopes, q, q.shape[2], batch)
    with torch.no_grad():  # FlashAttention's kvcache call has no backward; neither does this one
        if k is not None:
            if cache_seqlens is None:
                raise InvalidArgumentError("k, v given without cache_seqlens: the positions to write them at")
            _shape(k, "k", 4, "(batch, seqlen_new, nheads_k, headdim)")
            _append(k_cache, v_cache, k, v, lengths, block_table, cache_batch_idx)
            lengths = lengths + k.shape[1]
        if slopes is not None:  # (computed with here: the bias, the gathers)
            _on_device(q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, cache_seqlens=lengths,
                       cache_batch_idx=cache_batch_idx)
        if block_table is not None:
            if slopes is None:
                return attention_paged(q, k_cache, v_cache, block_table, lengths, causal=causal, window=window,
                                       scale=softmax_scale, alignment="bottom_right", softcap=softcap)
            # attention_paged takes no bias: each sequence's pages gathered into a dense cache (a
            # copy of them, (batch, max_num_blocks_per_seq * page_block_size, nheads_k, headdim)).
            if block_table.shape[0] != batch:
                raise InvalidArgumentError(f"block_table has shape {tuple(block_table.shape)}: expected ({batch}, "
                                           "max_num_blocks_per_seq)")
            pages = block_table.reshape(-1).to(torch.int64)
            k_cache, v_cache = (c.index_select(0, pages).view(batch, seqlen_k, *c.shape[2:]) for c in (k_cache, v_cache))
        elif cache_batch_idx is not None:
            if (not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype not in (torch.int32, torch.int64)
                    or tuple(cache_batch_idx.shape) != (batch,)):
                raise InvalidArgumentError(f"cache_batch_idx: expected an int32 tensor of shape ({batch},)")
            k_cache, v_cache = k_cache.index_select(0, cache_batch_idx), v_cache.index_select(0, cache_batch_idx)
        if slopes is None:
            return _fa_lse(_attend(q, k_cache, v_cache, causal=causal, window=window, scale=softmax_scale,
                                   seq_lens_q=_full(q, batch, sq), seq_lens_kv=lengths, alignment="bottom_right",
                                   return_lse=lse, softcap=softcap), lse)
        # ALiBi as a bias, per sequence at its own bottom right (cuDNN's ALiBi is top-left), with
        # the mask in it (cuDNN refuses a bottom-right mask beside a bias).
        bias = _alibi_bias(slopes, q, sq, seqlen_k, lengths - sq, (causal, window), lengths)
        out = _attend(q, k_cache, v_cache, scale=softmax_scale, seq_lens_q=_full(q, batch, sq), seq_lens_kv=lengths,
                      bias=bias.bias, return_lse=lse, softcap=softcap)
        return _fa_lse(_with_bias(out, bias, lse), lse)
