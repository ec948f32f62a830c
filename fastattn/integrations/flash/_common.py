"""What fastattn.flash's functions share: FlashAttention's conventions (its mask
normalizations, argument checks, its LSE for rows without keys), the call of
fastattn.torch.attention with cuDNN's one-query, one-key training refusal composed
around, and head dims padded to multiples of 8 as FlashAttention pads them."""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _fields, bounded
from ...errors import InvalidArgumentError, NotSupportedError
# fastattn.torch's entry points, which every module of the package calls through this
# one (`_common.attention_varlen(...)`, looked up at each call), so that the CPU tests
# replace them in one place with their model.
from ...torch import attention, attention_paged, attention_varlen  # noqa: F401 - attention_paged, _varlen: see above
# attention_paged's two halves, for a paged decode step's options kept across calls
# (_interface._paged_decode): its option checks, and its run with checked options.
from ...torch._api import options_for as paged_options  # noqa: F401 - see above
from ...torch._paged import run as paged_run  # noqa: F401 - see above
from ...torch._plans import capturing, raw_stream

_UNBOUNDED = (-1, -1)


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


def _on_device(q: Tensor, **tensors) -> None:
    """InvalidArgumentError unless each tensor is on q's device (checked before fastattn.flash
    computes with them itself; fastattn.torch checks what it is given)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, q on {q.device}: expected one device")


def _check_dropout(dropout_p, return_attn_probs) -> float:
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


def _one_query(s_q: int, training: bool) -> bool:
    """Whether a training plan (gradients, or the LSE: the training plan's forward writes
    it) has one query per sequence, which fastattn.flash runs as a plan of two instead:
    cudnn-frontend refuses the backward graph of one query and one key ("s_q = s_kv = 1
    is not supported", its documented check), and with one query against more keys the
    forward that cuDNN 9.19 runs on the H200 is not bitwise repeatable (a few rows an ulp
    apart between identical calls at batch 60, 4 heads, 239 keys, as
    benchmarks/probe_decode.py shows), where FlashAttention's is (its test_flash_attn_race_condition
    asks it). A plan of two queries is repeatable there."""
    return training and s_q == 1


def _attend(q, k, v, *, return_lse: bool, seq_lens_q=None, seq_lens_kv=None, bias=None, **options):
    """fastattn.torch.attention, with a training plan of one query (_one_query) run as a
    plan of two queries, the second a padding row: q padded with a row of zeros (a copy
    of q, one row of its size more), seq_lens_q 1 and seq_lens_kv the real key lengths
    (all of k's unless given), so the real query keeps its place against the keys at
    either alignment; o and the LSE are sliced back to the real row (views; the gradient
    flows through the slice and the padding, which get zero)."""
    b = q.shape[0]
    if not _one_query(q.shape[1], return_lse or _needs_grad(q, k, v)):
        return attention(q, k, v, seq_lens_q=seq_lens_q, seq_lens_kv=seq_lens_kv, bias=bias, return_lse=return_lse,
                         **options)
    q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, 1))
    if seq_lens_q is None:
        seq_lens_q, seq_lens_kv = _full(q, b, 1), _full(q, b, k.shape[1])
    if bias is not None:
        bias = torch.nn.functional.pad(bias, (0, 0, 0, 1))  # (.., 2, s_kv): a row for the padding row too
    out = attention(q, k, v, seq_lens_q=seq_lens_q, seq_lens_kv=seq_lens_kv, bias=bias, return_lse=return_lse,
                    **options)
    return (out[0].narrow(1, 0, 1), out[1].narrow(-1, 0, 1)) if return_lse else out.narrow(1, 0, 1)


# Full-length tensors for a padding mask that masks nothing: cuDNN takes a bottom-right
# diagonal with seqlen_q > seqlen_k only with per-sequence lengths. Kept per (device,
# stream, batch, length), at most FASTATTN_MEMORY_MAX_ENTRIES (fastattn.bounded), except
# while a CUDA graph is captured (a tensor made then is only filled when the graph
# replays). Per stream: one is made on the stream that reads it, and when one is dropped,
# the caching allocator reuses its memory on that stream only after the reads queued there.
_full_lengths = bounded.Table("arrays")


def _full(q: torch.Tensor, batch: int, n: int) -> torch.Tensor:
    if not q.is_cuda or type(q) is not torch.Tensor or capturing():  # meta, fake tensors, or a capture
        return torch.full((batch,), n, dtype=torch.int32, device=q.device)
    key = (q.device, raw_stream(q.get_device()), batch, n)
    t = _full_lengths.get(key)
    if t is None:
        t = _full_lengths.keep(key, torch.full((batch,), n, dtype=torch.int32, device=q.device))
    return t


def _shape(t, name: str, dims: int, what: str) -> tuple[int, ...]:
    if t.__class__ is torch.Tensor and t.dim() == dims:  # the common case, first
        return t.shape
    shape = getattr(t, "shape", None)
    if not isinstance(t, torch.Tensor) or len(shape) != dims:
        raise InvalidArgumentError(f"{name}: expected a torch.Tensor {what}, got "
                                   f"{tuple(shape) if shape is not None else type(t).__name__}")
    return shape


def _fa_lse(out, lse: bool):
    """(o, lse) with FlashAttention's LSE for a row that sees no key: +inf (so that its
    backward's exp(s - lse) is 0), where cuDNN's log of an empty sum is -inf. A new
    tensor: the stats autograd saved for backward stay cuDNN's."""
    if not lse:
        return out
    o, stats = out
    return o, stats.masked_fill(stats == float("-inf"), float("inf"))


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
