"""fastattn.torch's FP8 attention: cuDNN's FP8 kernels on torch.float8_e4m3fn /
torch.float8_e5m2 tensors, with the per-tensor float32 scales as tensors and the
amaxes returned.

Scaling convention (cuDNN's, TransformerEngine's): an FP8 tensor x8 stands for the
real tensor x = x8 * descale_x; an output is stored as x8 = x * scale_x, and its amax
is max |x| before the scale. s is the softmax probabilities and d_p their gradient,
both quantized inside the kernels.

Two custom ops, fastattn::attention_fp8_forward and fastattn::attention_fp8_backward,
with fake implementations; `attention_fp8` and `attention_fp8_backward` call them
(plain eager calls run the same work directly). Gradients through raw FP8 tensors are
not autograd's business (a gradient in FP8 means nothing without its scale), so
backward is its own function; `attention_fp8_scaled` (fastattn.torch._fp8_scaled)
wraps both in autograd for 16-bit tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import FP8_BACKWARD_SCALARS, FP8_FORWARD_SCALARS, AttentionConfig
from ..errors import InvalidArgumentError
from ._executor import alert_not_deterministic, deterministic_algorithms
from ._specs import config_fields, named_tuple, options_schema
from ._plans import (AXES, CLOCK, DTYPES, FP8, CachedPlan, check_shapes, config_shape, out_shape, plans, raw_stream, remember,
                     stats_shape, workspace)
from ._plans import options as check_options

OUT = {**FP8, **DTYPES}
TORCH = {name: dtype for dtype, name in OUT.items()}
# The ops' scalar inputs, the descales and scales, in the slot table's order, which is the
# order of the ops' (and attention_fp8's, attention_fp8_backward's) parameters: zipped with
# them. The amaxes are outputs, allocated here.
FORWARD_SCALARS = tuple(n for n in FP8_FORWARD_SCALARS if not n.startswith("amax_"))
BACKWARD_SCALARS = tuple(n for n in FP8_BACKWARD_SCALARS if not n.startswith("amax_"))
BACKWARD_AMAXES = tuple(n for n in FP8_BACKWARD_SCALARS if n.startswith("amax_"))  # Fp8Grads' order


# The FP8 ops' scalar options (_specs.FP8_OPTIONS): part of the plan key, and the
# ops' arguments after the tensors, in this order.
Fp8Options = named_tuple("fp8", "Fp8Options")


class Fp8Output(NamedTuple):
    o: torch.Tensor  # out_dtype; stored as real o * scale_o when FP8
    stats: torch.Tensor | None  # float32 softmax stats for backward (training=True), else None
    amax_s: torch.Tensor  # float32 (1,): max of the softmax probabilities
    amax_o: torch.Tensor  # float32 (1,): max |o| before scale_o


class Fp8Grads(NamedTuple):
    d_q: torch.Tensor
    d_k: torch.Tensor
    d_v: torch.Tensor
    amax_d_q: torch.Tensor  # float32 (1,) each: max |gradient| before its scale
    amax_d_k: torch.Tensor
    amax_d_v: torch.Tensor
    amax_d_p: torch.Tensor


def _key(q, k, v, o, scalars, seq_len_q, seq_len_kv, options) -> tuple:
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), None if o is None else o.stride(),
            q.dtype, k.dtype, v.dtype, q.get_device(), options,
            tuple((s.dtype, s.shape, s.get_device()) for s in scalars),
            None if seq_len_q is None else (seq_len_q.dtype, seq_len_q.shape, seq_len_kv.dtype, seq_len_kv.shape))


def plan_for(q, k, v, o, scalars, names, seq_len_q, seq_len_kv, options: Fp8Options) -> CachedPlan:
    """The plan for these tensors (o None: the forward's own output). A hit is one dict
    lookup; a miss checks the tensors and asks the runtime."""
    key = _key(q, k, v, o, scalars, seq_len_q, seq_len_kv, options)
    hit = plans.get(key)
    if hit is not None:
        hit.used = CLOCK[0]
        return hit
    layout = options.layout
    check(q, k, v, layout, seq_len_q, seq_len_kv)
    for name, s in zip(names, scalars):
        check_scalar(name, s, q.device)
    cfg = AttentionConfig(**config_shape(q, k, v, o, layout), dtype=FP8[q.dtype], **config_fields(options),
                          padding=seq_len_q is not None)
    return remember(key, cfg, q, k, v, layout)


def check(q, k, v, layout: str, seq_len_q=None, seq_len_kv=None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type not in ("cuda", "meta"):
            raise InvalidArgumentError(f"{name} is on {t.device}: fastattn runs on CUDA tensors")
        if t.dim() != 4:
            raise InvalidArgumentError(f"{name} has shape {tuple(t.shape)}: expected 4 dimensions in {layout} order")
        if t.dtype not in FP8:
            raise InvalidArgumentError(f"{name} has dtype {t.dtype}: FP8 attention takes {' or '.join(map(str, FP8))} "
                                       "(attention_fp8_scaled quantizes 16-bit tensors)")
    check_shapes(q, k, v, layout, seq_len_q, seq_len_kv)


def check_scalar(name: str, t, device) -> None:
    """A descale or scale: one float32 element on q's device. (Its address must be 16-byte
    aligned, as every tensor fastattn passes; the core says so naming it otherwise.)"""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1 or t.device != device:
        raise InvalidArgumentError(f"{name}: expected a torch.float32 tensor of one element on {device}, got "
                                   f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} on "
                                   f"{getattr(t, 'device', None)}")


def _amax(q: torch.Tensor) -> torch.Tensor:
    # One allocation each: the caching allocator's blocks are 512-byte aligned, and a
    # custom op's outputs may not alias one another.
    return q.new_empty(1, dtype=torch.float32)


def forward_impl(q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, seq_len_q, seq_len_kv,
                 options: Fp8Options):
    """(o, stats or None, amax_s, amax_o)."""
    scalars = (descale_q, descale_k, descale_v, descale_s, scale_s, scale_o)
    c = plan_for(q, k, v, None, scalars, FORWARD_SCALARS, seq_len_q, seq_len_kv, options)
    padded = seq_len_q is not None
    o = q.new_empty(c.out_shape, dtype=TORCH[options.out_dtype])
    stats = q.new_empty(c.stats_shape, dtype=torch.float32) if options.training else None
    amax_s, amax_o = _amax(q), _amax(q)
    stream = raw_stream(c.device)
    ws = workspace(q, c.forward_workspace, c.device, stream)
    c.plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr() if stats is not None
                   else 0, ws.data_ptr() if ws is not None else 0, stream, seq_len_q.data_ptr() if padded else 0,
                   seq_len_kv.data_ptr() if padded else 0,
                   **{name: s.data_ptr() for name, s in zip(FORWARD_SCALARS, scalars)},
                   amax_s=amax_s.data_ptr(), amax_o=amax_o.data_ptr())
    if padded:
        _zero_padded_rows(o, seq_len_q, options.layout)
    return o, stats, amax_s, amax_o


def _zero_padded_rows(o: torch.Tensor, seq_len_q: torch.Tensor, layout: str) -> None:
    """Padded rows of o are zero (as fastattn.torch.attention's) on every cuDNN: cuDNN 9.19 and
    9.24's FP8 forward leaves them unwritten, 9.28.1's computes them as rows of their own
    (measured on an H100; tests/fp8/test_fp8_gpu.py's test_padding). On the stream's order,
    capturable: a compare and a masked fill."""
    axis = 1 if layout == "bshd" else 2  # (b, s, h, d) or (b, h, s, d)
    s = o.shape[axis]
    past = torch.arange(s, device=o.device) >= seq_len_q.view(-1, 1)  # (b, s): the padded rows
    shape = (o.shape[0], s, 1, 1) if axis == 1 else (o.shape[0], 1, s, 1)
    # (an FP8 zero is the byte 0; masked_fill takes no float8 tensor)
    (o.view(torch.uint8) if o.element_size() == 1 else o).masked_fill_(past.view(shape), 0)


def backward_impl(d_o, o, stats, q, k, v, scalars, seq_len_q, seq_len_kv, options: Fp8Options):
    """Fp8Grads; `scalars` in BACKWARD_SCALARS order."""
    if deterministic_algorithms() and not options.deterministic:  # (as _executor's backward_impl)
        alert_not_deterministic()
    if d_o.stride() != o.stride():  # the plan reads d_o at o's strides
        d_o = torch.empty_strided(o.shape, o.stride(), dtype=d_o.dtype, device=d_o.device).copy_(d_o)
    c = plan_for(q, k, v, o, scalars, BACKWARD_SCALARS, seq_len_q, seq_len_kv, options)
    grad = TORCH[options.grad_dtype]
    padded = seq_len_q is not None
    d_q, d_k, d_v = ((torch.zeros_like if padded else torch.empty_like)(t, dtype=grad) for t in (q, k, v))
    amaxes = [_amax(q) for _ in BACKWARD_AMAXES]
    stream = raw_stream(c.device)
    ws = workspace(q, c.backward_workspace, c.device, stream)
    c.plan.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(),
                    d_q.data_ptr(), d_k.data_ptr(), d_v.data_ptr(), ws.data_ptr() if ws is not None else 0, stream,
                    seq_len_q.data_ptr() if padded else 0, seq_len_kv.data_ptr() if padded else 0,
                    **{name: s.data_ptr() for name, s in zip(BACKWARD_SCALARS, scalars)},
                    **{name: a.data_ptr() for name, a in zip(BACKWARD_AMAXES, amaxes)})
    return Fp8Grads(d_q, d_k, d_v, *amaxes)


# -- the custom ops: tensors, then Fp8Options' fields in order (schemas from _specs) ----------

def _schema(tensors: tuple[str, ...], scalars: tuple[str, ...], returns: int) -> str:
    listed = ", ".join(f"Tensor {n}" for n in (*tensors, *scalars))
    return f"({listed}, Tensor? seq_len_q, Tensor? seq_len_kv, {options_schema('fp8')}) -> ({', '.join(['Tensor'] * returns)})"


FORWARD_SCHEMA = _schema(("q", "k", "v"), FORWARD_SCALARS, 4)
BACKWARD_SCHEMA = _schema(("d_o", "o", "stats", "q", "k", "v"), BACKWARD_SCALARS, 3 + len(BACKWARD_AMAXES))
_N_FORWARD, _N_BACKWARD = len(FORWARD_SCALARS), len(BACKWARD_SCALARS)


def _forward(q, k, v, *rest):
    """(o, stats, amax_s, amax_o); stats is empty when not training. rest: FORWARD_SCALARS'
    tensors, seq_len_q, seq_len_kv, then Fp8Options' fields."""
    options = Fp8Options(*rest[_N_FORWARD + 2:])
    o, stats, amax_s, amax_o = forward_impl(q, k, v, *rest[:_N_FORWARD + 2], options)
    return o, stats if stats is not None else _stats_like(q, options.layout, False), amax_s, amax_o


forward_op = torch.library.custom_op("fastattn::attention_fp8_forward", _forward, mutates_args=(),
                                     schema=FORWARD_SCHEMA)


def _stats_like(q, layout: str, training: bool) -> torch.Tensor:
    return q.new_empty(stats_shape(q, layout) if training else [0], dtype=torch.float32)


@forward_op.register_fake
def _(q, k, v, *rest):
    scalars, (seq_len_q, seq_len_kv) = rest[:_N_FORWARD], rest[_N_FORWARD:_N_FORWARD + 2]
    options = Fp8Options(*rest[_N_FORWARD + 2:])
    check(q, k, v, options.layout, seq_len_q, seq_len_kv)  # a trace refuses what eager does
    for name, t in zip(FORWARD_SCALARS, scalars):
        check_scalar(name, t, q.device)
    return (q.new_empty(out_shape(q, v, options.layout), dtype=TORCH[options.out_dtype]),
            _stats_like(q, options.layout, options.training), _amax(q), _amax(q))


def _backward(d_o, o, stats, q, k, v, *rest):
    """(d_q, d_k, d_v, amax_d_q, amax_d_k, amax_d_v, amax_d_p). rest: BACKWARD_SCALARS'
    tensors, seq_len_q, seq_len_kv, then Fp8Options' fields."""
    scalars, (seq_len_q, seq_len_kv) = rest[:_N_BACKWARD], rest[_N_BACKWARD:_N_BACKWARD + 2]
    return tuple(backward_impl(d_o, o, stats, q, k, v, scalars, seq_len_q, seq_len_kv,
                               Fp8Options(*rest[_N_BACKWARD + 2:])))


backward_op = torch.library.custom_op("fastattn::attention_fp8_backward", _backward, mutates_args=(),
                                      schema=BACKWARD_SCHEMA)


@backward_op.register_fake
def _(d_o, o, stats, q, k, v, *rest):
    grad = TORCH[rest[-1]]
    return (*(torch.empty_strided(t.shape, t.stride(), dtype=grad, device=t.device) for t in (q, k, v)),
            *(_amax(q) for _ in range(4)))


def _options(q, layout, causal, causal_bottom_right, window, scale, deterministic, training, out_dtype,
             grad_dtype) -> Fp8Options:
    if layout not in AXES:
        raise InvalidArgumentError(f"layout={layout!r}: must be one of {tuple(AXES)}")
    left, right, scale = check_options(causal, causal_bottom_right, window, scale, deterministic)
    if not isinstance(training, bool):
        raise InvalidArgumentError(f"training={training!r}: must be True or False")
    dtype = FP8.get(getattr(q, "dtype", None), "fp8_e4m3")  # a wrong q dtype is reported by check()
    out = out_dtype if out_dtype is not None else TORCH[dtype]
    if out not in OUT:
        raise InvalidArgumentError(f"out_dtype={out_dtype!r}: must be one of {', '.join(map(str, OUT))}")
    grad = dtype
    if training and grad_dtype is not None:
        if grad_dtype not in FP8:
            raise InvalidArgumentError(f"grad_dtype={grad_dtype!r}: must be {' or '.join(map(str, FP8))}")
        grad = FP8[grad_dtype]
    # (causal, bottom_right) are (a causal mask, the diagonal's alignment), as in every
    # entry point's options: causal_bottom_right is a causal mask at the bottom right.
    return Fp8Options(layout, bool(causal or causal_bottom_right), bool(causal_bottom_right), left, right, scale,
                      bool(deterministic), training, OUT[out], grad)


def _eager(q) -> bool:
    from ._executor import plain_eager

    return plain_eager(q)


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale_q: torch.Tensor,
                  descale_k: torch.Tensor, descale_v: torch.Tensor, descale_s: torch.Tensor, scale_s: torch.Tensor,
                  scale_o: torch.Tensor, *, out_dtype: torch.dtype | None = None, causal: bool = False,
                  causal_bottom_right: bool = False, window: tuple[int, int] | None = None,
                  scale: float | None = None, layout: str = "bshd", seq_lens_q: torch.Tensor | None = None,
                  seq_lens_kv: torch.Tensor | None = None, training: bool = False,
                  grad_dtype: torch.dtype | None = None, deterministic: bool = False) -> Fp8Output:
    """FP8 attention forward on cuDNN's FP8 kernels.

    q, k, v: torch.float8_e4m3fn or torch.float8_e5m2 CUDA tensors, one dtype, shaped as
      fastattn.torch.attention's (layout "bshd": (batch, seq, heads, dim)).
    descale_q, descale_k, descale_v: float32 one-element tensors: the real q is
      q.float() * descale_q (and so on).
    descale_s, scale_s: the softmax probabilities' FP8 round trip inside the kernel
      (probabilities are <= 1: scale_s = 448, e4m3's max, which either FP8 type holds,
      and descale_s = 1 / 448 is the usual choice).
    scale_o: o is stored as real o * scale_o (out_dtype FP8; pass a tensor of 1.0 for a
      16-bit out_dtype, where cuDNN takes one).
    out_dtype: o's dtype (default q's): FP8, torch.float16 or torch.bfloat16, as cuDNN
      accepts on the GPU (Hopper: FP8 only; the error says cuDNN's reason).
    training: also write stats for attention_fp8_backward (with grad_dtype its gradients'
      FP8 dtype, default q's).
    Other options as fastattn.torch.attention's.

    Returns Fp8Output(o, stats or None, amax_s, amax_o), the amaxes float32 (1,).
    Raises InvalidArgumentError for bad tensors or options, NotSupportedError with
    cuDNN's reason for a combination it refuses.
    """
    options = _options(q, layout, causal, causal_bottom_right, window, scale, deterministic, training, out_dtype,
                       grad_dtype)
    if seq_lens_kv is None:
        seq_lens_kv = seq_lens_q
    if isinstance(q, torch.Tensor) and q.is_cuda and _eager(q):
        o, stats, amax_s, amax_o = forward_impl(q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s,
                                                scale_o, seq_lens_q, seq_lens_kv, options)
        return Fp8Output(o, stats, amax_s, amax_o)
    # Past the plain eager CUDA path (checked once per plan, in plan_for): meta and CPU
    # tensors, and traced calls, whose fake tensors look like CUDA ones: every call.
    check(q, k, v, layout, seq_lens_q, seq_lens_kv)
    for name, t in zip(FORWARD_SCALARS, (descale_q, descale_k, descale_v, descale_s, scale_s, scale_o)):
        check_scalar(name, t, q.device)
    o, stats, amax_s, amax_o = forward_op(q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o,
                                          seq_lens_q, seq_lens_kv, *options)
    return Fp8Output(o, stats if training else None, amax_s, amax_o)


def attention_fp8_backward(d_o: torch.Tensor, o: torch.Tensor, stats: torch.Tensor, q: torch.Tensor,
                           k: torch.Tensor, v: torch.Tensor, descale_q: torch.Tensor, descale_k: torch.Tensor,
                           descale_v: torch.Tensor, descale_o: torch.Tensor, descale_d_o: torch.Tensor,
                           descale_s: torch.Tensor, descale_d_p: torch.Tensor, scale_s: torch.Tensor,
                           scale_d_q: torch.Tensor, scale_d_k: torch.Tensor, scale_d_v: torch.Tensor,
                           scale_d_p: torch.Tensor, *, causal: bool = False, causal_bottom_right: bool = False,
                           window: tuple[int, int] | None = None, scale: float | None = None,
                           layout: str = "bshd", seq_lens_q: torch.Tensor | None = None,
                           seq_lens_kv: torch.Tensor | None = None, deterministic: bool = False) -> Fp8Grads:
    """FP8 attention backward: the gradients of q, k, v from the forward's o and stats
    (attention_fp8(..., training=True)) and the output gradient d_o.

    d_o: FP8 (its dtype is the gradients' dtype: e5m2 beside e4m3 inputs is TE's hybrid
      recipe), real d_o = d_o.float() * descale_d_o. descale_d_p, scale_d_p: the
      probabilities' gradient's FP8 round trip inside the kernel; scale_d_q, scale_d_k,
      scale_d_v: each gradient is stored as its real value times its scale. Options
      must be the forward's.

    Returns Fp8Grads(d_q, d_k, d_v in d_o's dtype, amax_d_q, amax_d_k, amax_d_v,
    amax_d_p). Raises as attention_fp8.
    """
    options = _options(q, layout, causal, causal_bottom_right, window, scale, deterministic, True,
                       getattr(o, "dtype", None), getattr(d_o, "dtype", None))
    if seq_lens_kv is None:
        seq_lens_kv = seq_lens_q
    scalars = (descale_q, descale_k, descale_v, descale_o, descale_d_o, descale_s, descale_d_p, scale_s, scale_d_q,
               scale_d_k, scale_d_v, scale_d_p)
    if isinstance(q, torch.Tensor) and q.is_cuda and _eager(q):
        return backward_impl(d_o, o, stats, q, k, v, scalars, seq_lens_q, seq_lens_kv, options)
    check(q, k, v, layout, seq_lens_q, seq_lens_kv)  # as attention_fp8: past the plain eager path, every call
    for name, t in zip(BACKWARD_SCALARS, scalars):
        check_scalar(name, t, q.device)
    return Fp8Grads(*backward_op(d_o, o, stats, q, k, v, *scalars, seq_lens_q, seq_lens_kv, *options))
