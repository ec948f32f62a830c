"""attention_fp8_scaled: FP8 attention in one line for 16-bit tensors, with autograd.

Current scaling, with no host synchronization (so CUDA graphs and torch.compile work):
each input (q, k, v and, in backward, d_o) is quantized with the per-tensor scale
FP8_MAX / amax(input), computed on the GPU. Outputs need their scale before they
exist, so each output's scale comes from a bound on its values that holds for every
input, computed from the inputs' amaxes and row norms (B = max_i |d_o_i| * max_j |v_j|,
Euclidean norms over the head dim; group = heads_q / heads_kv; s_q the query length):

  o    <= amax(v)                       each row of o is a convex combination of v's rows
  s    <= 1                             softmax probabilities
  d_p  <= B                             d_p = d_o v^T, Cauchy-Schwarz
  d_q  <= scale * 2B * amax(k)          |d_s_ij| <= p_ij (|d_p_ij| + |d_o_i . o_i|) <= 2B p_ij,
                                        and each row of p sums to 1
  d_k  <= scale * 2B * amax(q) * s_q * group   the same, summed over the queries of a key
  d_v  <= amax(d_o) * s_q * group       d_v = p^T d_o, p <= 1

The bounds never overflow FP8; the loose ones (d_k, d_v) cost dynamic range, which is
why gradients default to e5m2 (TransformerEngine's hybrid recipe: 30 binades against
e4m3's 18). Outputs come back in the inputs' 16-bit dtype.
"""

from __future__ import annotations

import math

import torch

from .. import dtypes
from ..errors import InvalidArgumentError
from . import _fp8
from ._plans import AXES, DTYPES, FP8

FP8_MAX = {t: dtypes.BY_NAME[name].fp8_max for t, name in FP8.items()}
_TINY = 2.0 ** -60  # an all-zero tensor gets a finite scale (its FP8 values are zero whatever the scale)


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax().float().reshape(1)


def _max_row_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.detach().float(), dim=-1).amax().reshape(1)


def _quantize(x: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype, like: torch.Tensor | None = None):
    """(x in FP8 as x * scale, scale, descale) with scale = FP8_MAX / bound; `like`: the
    FP8 tensor whose strides the result takes (d_o must have o's)."""
    top = FP8_MAX[dtype]
    scale = top / bound.clamp_min(_TINY)
    # Clamped: amax * (top / amax) can round one ulp above top in float32, and e4m3fn
    # has no infinity (above its max is NaN).
    values = (x.detach().float() * scale).clamp_(-top, top)
    if like is None:
        return values.to(dtype), scale, scale.reciprocal()
    out = torch.empty_strided(like.shape, like.stride(), dtype=dtype, device=like.device)
    return out.copy_(values), scale, scale.reciprocal()


def _scalar(x: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=x.device)


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_lens_q, seq_lens_kv, opts):
        layout, causal, bottom_right, window, scale, dtype, grad_dtype, deterministic, training = opts
        amax_q, amax_k, amax_v = _amax(q), _amax(k), _amax(v)
        q8, _, descale_q = _quantize(q, amax_q, dtype)
        k8, _, descale_k = _quantize(k, amax_k, dtype)
        v8, _, descale_v = _quantize(v, amax_v, dtype)
        top = FP8_MAX[dtype]
        # Probabilities are <= 1: e4m3's max (448) fits either FP8 type inside the kernel.
        scale_s, descale_s = _scalar(q, FP8_MAX[torch.float8_e4m3fn]), _scalar(q, 1.0 / FP8_MAX[torch.float8_e4m3fn])
        scale_o = top / amax_v.clamp_min(_TINY)
        descale_o = scale_o.reciprocal()
        out = _fp8.attention_fp8(q8, k8, v8, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o,
                                 causal=causal, causal_bottom_right=bottom_right, window=window, scale=scale,
                                 layout=layout, seq_lens_q=seq_lens_q, seq_lens_kv=seq_lens_kv, training=training,
                                 grad_dtype=grad_dtype, deterministic=deterministic)
        o = (out.o.float() * descale_o).to(q.dtype)
        if training:
            ctx.opts = opts
            ctx.save_for_backward(q8, k8, v8, out.o, out.stats, descale_q, descale_k, descale_v, descale_o,
                                  descale_s, scale_s, amax_q, amax_k, _max_row_norm(v), seq_lens_q, seq_lens_kv)
        return o

    @staticmethod
    def backward(ctx, d_o):
        layout, causal, bottom_right, window, scale, dtype, grad_dtype, deterministic, _ = ctx.opts
        (q8, k8, v8, o8, stats, descale_q, descale_k, descale_v, descale_o, descale_s, scale_s, amax_q, amax_k,
         norm_v, seq_lens_q, seq_lens_kv) = ctx.saved_tensors
        axes = AXES[layout]
        s_q, group = q8.shape[axes[2]], q8.shape[axes[1]] // k8.shape[axes[1]]
        attn = scale if scale is not None else 1.0 / math.sqrt(q8.shape[axes[3]])
        top = FP8_MAX[grad_dtype]
        amax_do = _amax(d_o)
        d_o8, _, descale_do = _quantize(d_o, amax_do, grad_dtype, like=o8)
        b = _max_row_norm(d_o) * norm_v
        scale_dp = top / b.clamp_min(_TINY)
        bounds = (attn * 2 * b * amax_k, attn * 2 * b * amax_q * (s_q * group), amax_do * (s_q * group))
        scale_dq, scale_dk, scale_dv = (top / x.clamp_min(_TINY) for x in bounds)
        g = _fp8.attention_fp8_backward(d_o8, o8, stats, q8, k8, v8, descale_q, descale_k, descale_v, descale_o,
                                        descale_do, descale_s, scale_dp.reciprocal(), scale_s, scale_dq, scale_dk,
                                        scale_dv, scale_dp, causal=causal, causal_bottom_right=bottom_right,
                                        window=window, scale=scale, layout=layout, seq_lens_q=seq_lens_q,
                                        seq_lens_kv=seq_lens_kv, deterministic=deterministic)
        dt = d_o.dtype
        return ((g.d_q.float() / scale_dq).to(dt), (g.d_k.float() / scale_dk).to(dt),
                (g.d_v.float() / scale_dv).to(dt), None, None, None)


def attention_fp8_scaled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                         causal_bottom_right: bool = False, window: tuple[int, int] | None = None,
                         scale: float | None = None, layout: str = "bshd", seq_lens_q: torch.Tensor | None = None,
                         seq_lens_kv: torch.Tensor | None = None, deterministic: bool = False,
                         fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                         grad_fp8_dtype: torch.dtype = torch.float8_e5m2) -> torch.Tensor:
    """fastattn.torch.attention on cuDNN's FP8 kernels: q, k, v float16 or bfloat16 (as
    attention's), quantized to fp8_dtype with per-tensor current scaling (see the module
    doc for how each scale is chosen); returns o in q's dtype, with autograd (gradients
    through grad_fp8_dtype). Expect FP8's error: about 2**-4 relative per element of
    each quantized tensor (e4m3), far above bf16's.

    Raises InvalidArgumentError for bad tensors or options, NotSupportedError with
    cuDNN's reason when it refuses the FP8 graph on this GPU.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype not in DTYPES:
            raise InvalidArgumentError(f"{name}: attention_fp8_scaled takes {' or '.join(map(str, DTYPES))} tensors, "
                                       f"got {getattr(t, 'dtype', type(t).__name__)} (attention_fp8 takes FP8)")
    for name, t in (("fp8_dtype", fp8_dtype), ("grad_fp8_dtype", grad_fp8_dtype)):
        if t not in FP8_MAX:
            raise InvalidArgumentError(f"{name}={t!r}: must be {' or '.join(map(str, FP8))}")
    if layout not in AXES:
        raise InvalidArgumentError(f"layout={layout!r}: must be one of {tuple(AXES)}")
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    opts = (layout, causal, causal_bottom_right, window, scale, fp8_dtype, grad_fp8_dtype, deterministic, training)
    if seq_lens_kv is None:
        seq_lens_kv = seq_lens_q
    return _Scaled.apply(q, k, v, seq_lens_q, seq_lens_kv, opts)
