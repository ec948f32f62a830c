"""ALiBi with any slopes, FlashAttention's -slope * |i + seqlen_k - seqlen_q - j|: the
slopes checked, whether cuDNN's own ALiBi computes them, and otherwise an additive bias
built on the device (with a bottom-right mask folded into it), and the LSE shifted back."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ...errors import InvalidArgumentError
from ...torch._plans import capturing
from ._common import _UNBOUNDED, _on_device

_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack  # FakeTensorMode, make_fx's proxy mode, ...


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


def _cudnn_alibi(slopes: Tensor, heads: int) -> bool:
    """Whether cuDNN's own ALiBi computes these slopes: the ALiBi paper's for this many
    heads (cuDNN computes those and takes no others). Asked only where its ALiBi is
    FlashAttention's otherwise (see _interface's _dense); where it is not, the slopes go into a bias."""
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
