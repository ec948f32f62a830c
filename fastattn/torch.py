"""fastattn for PyTorch: a drop-in attention function with autograd, torch.compile and
CUDA graphs. Imported on demand (`import fastattn.torch`); `import fastattn` never
imports PyTorch.

    from fastattn.torch import attention
    o = attention(q, k, v, causal=True)          # q: (batch, seq, heads, dim), like FlashAttention

The work is two custom ops, fastattn::attention_forward and fastattn::attention_backward,
with fake (meta) implementations and a registered autograd formula, so that
torch.compile(fullgraph=True) traces them without a graph break. They run on PyTorch's
current stream, take their workspace from PyTorch's caching allocator and never
synchronize, so a call can be captured in a CUDA graph after one warm-up call.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from . import _fields
from .config import AttentionConfig
from .errors import InvalidArgumentError

__all__ = ["attention", "attention_paged", "attention_varlen"]

# The dimension order of the tensors' shapes: layout name -> position of (batch, head, seq, dim).
_AXES = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

# What a call costs once its plan exists: one dict lookup on a tuple of shapes,
# strides and options. Building an AttentionConfig (validation, canonical form) happens
# only on a miss. Forward keys leave out o, which the forward allocates itself
# (contiguous in the layout, so its strides follow from the shapes); backward keys
# include the o and d_o they are given.
_plans: dict[tuple, _Cached] = {}
_plans_lock = threading.Lock()

try:  # the raw stream handle without a torch.cuda.Stream object (~2 us less per call)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - older or CPU-only builds
    def _raw_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream


class _Cached:
    """A plan and what each call needs from it, computed once."""

    __slots__ = ("backward_workspace", "device", "forward_workspace", "grads_like", "out_like_q", "out_shape",
                 "plan", "stats_shape")

    def __init__(self, plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str | None):
        """layout None: packed sequences, whose token count, so shapes, each call's tensors give."""
        self.plan = plan
        self.device = q.get_device()
        self.out_shape = _out_shape(q, v, layout) if layout else None
        self.stats_shape = _stats_shape(q, layout) if layout else None
        self.forward_workspace = plan.forward_workspace_size
        self.backward_workspace = plan.backward_workspace_size
        # torch.empty_like costs ~40% less than new_empty(shape) or empty_strided (it parses
        # no sizes): use it wherever it gives the strides the plan was built for. The key
        # fixes the inputs' shapes and strides, so this holds for every call of the plan.
        self.out_like_q = layout is not None and _like(q, self.out_shape)
        self.grads_like = tuple(layout is not None and _like(t, list(t.shape), t.stride()) for t in (q, k, v))


def _like(t: torch.Tensor, shape: list[int], stride: tuple[int, ...] | None = None) -> bool:
    """Whether torch.empty_like(t) has this shape and these strides (None: contiguous)."""
    if list(t.shape) != shape:
        return False
    like = torch.empty_like(t, device="meta")
    return like.stride() == (stride if stride is not None else t.new_empty(shape, device="meta").stride())


# Workspaces of up to _KEPT_WORKSPACE bytes are kept, one per (device, stream), and shared
# by every call on that stream: the stream orders those calls on the GPU, so one buffer
# serves them all, and a call saves an allocation (~4 us of a ~17 us small call on the
# H200, tools/profile_torch_call.py). Not while a CUDA graph is captured: a graph replays
# on any stream, so it takes its own buffer from the capture's pool. Larger workspaces
# are allocated per call: next to their kernels' time the allocation is noise, and a
# kept one would hold the memory.
_KEPT_WORKSPACE = 16 << 20
_KEPT_STREAMS = 64  # at most this many kept, so that short-lived streams cannot pile them up
try:  # without the Python wrapper around it (~0.25 us less per call)
    from torch._C import _cuda_isCurrentStreamCapturing as _capturing
except ImportError:  # pragma: no cover - CPU-only builds
    def _capturing() -> bool:
        return torch.cuda.is_current_stream_capturing()
_workspaces: dict[tuple[int, int], torch.Tensor] = {}


def _workspace(q: torch.Tensor, size: int, device: int, stream: int) -> torch.Tensor | None:
    """A workspace of at least size bytes for a call on this stream (None when size is 0)."""
    if not size:
        return None
    if size > _KEPT_WORKSPACE or _capturing():
        return q.new_empty(size, dtype=torch.uint8)
    ws = _workspaces.get((device, stream))
    if ws is None or ws.numel() < size:
        # The old buffer goes back to the caching allocator once the last call holding it
        # has queued its work: stream-ordered, like any tensor freed on this stream.
        if ws is None and len(_workspaces) >= _KEPT_STREAMS:
            _workspaces.clear()  # streams come and go (external ones, say): start the table afresh
        ws = _workspaces[(device, stream)] = q.new_empty(size, dtype=torch.uint8)
    return ws


def _logical(t: torch.Tensor, layout: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) in (batch, head, seq, dim) order."""
    axes = _AXES[layout]
    shape, stride = t.shape, t.stride()
    return tuple(shape[a] for a in axes), tuple(stride[a] for a in axes)


def _lengths_key(t):
    return None if t is None else (t.dtype, t.shape, t.stride(), t.get_device())


def _extras_key(bias, sink, dropout: float, bias_grad: bool):
    """What the optional features add to a plan's key."""
    return (None if bias is None else (bias.dtype, bias.shape, bias.stride(), bias.get_device()),
            None if sink is None else (sink.dtype, sink.shape, sink.stride(), sink.get_device()), dropout, bias_grad)


def _plan_for(q, k, v, o, seq_len_q, seq_len_kv, options: tuple, bias=None, sink=None, dropout: float = 0.0,
              bias_grad: bool = False) -> _Cached:
    """The plan for these tensors; o=None means the forward's own fresh output. options:
    (layout, causal, bottom_right, window_left, window_right, scale, deterministic,
    alibi, training), as _options makes it. The key holds everything _check looks at,
    so only a miss needs validating: a hit means these inputs were checked once already."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), None if o is None else o.stride(),
           q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(), v.get_device(), options,
           None if seq_len_q is None else (_lengths_key(seq_len_q), _lengths_key(seq_len_kv)),
           None if bias is None and sink is None and not dropout else _extras_key(bias, sink, dropout, bias_grad))
    hit = _plans.get(key)
    if hit is not None:
        return hit
    import fastattn

    layout, causal, bottom_right, window_left, window_right, scale, deterministic, alibi, training = options
    _check(q, k, v, layout, seq_len_q, seq_len_kv)
    _check_extras(q, k, layout, bias, sink)
    if o is None:
        o = q.new_empty(_out_shape(q, v, layout), device="meta")  # only its strides are needed
    (b, hq, sq, dqk), q_st = _logical(q, layout)
    (_, hkv, skv, _), k_st = _logical(k, layout)
    (_, _, _, dv), v_st = _logical(v, layout)
    _, o_st = _logical(o, layout)
    cfg = AttentionConfig(
        batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_kv=skv, head_dim_qk=dqk, head_dim_v=dv,
        dtype=_DTYPES[q.dtype], layout={"q": q_st, "k": k_st, "v": v_st, "o": o_st},
        mask="causal_bottom_right" if bottom_right else "causal" if causal else "none",
        window=(window_left, window_right), scale=None if scale <= 0 else scale, training=training,
        deterministic=deterministic, padding=seq_len_q is not None, alibi=alibi,
        bias="none" if bias is None else _bias_shape(q, bias, layout), bias_grad=bias_grad, dropout=dropout,
        sinks=sink is not None,
    )
    hit = _Cached(fastattn.plan(cfg, device=q.device.index), q, k, v, layout)
    with _plans_lock:
        _plans[key] = hit
    return hit


def _out_shape(q: torch.Tensor, v: torch.Tensor, layout: str) -> list[int]:
    """o has q's shape with v's head dim."""
    shape = list(q.shape)
    shape[_AXES[layout][3]] = v.shape[_AXES[layout][3]]
    return shape


def _stats_shape(q: torch.Tensor, layout: str) -> list[int]:
    axes = _AXES[layout]
    return [q.shape[axes[0]], q.shape[axes[1]], q.shape[axes[2]], 1]


def _stats_like(q: torch.Tensor, layout: str, training: bool) -> torch.Tensor:
    # Inference writes no stats: an empty tensor keeps the op's signature fixed.
    return q.new_empty(_stats_shape(q, layout) if training else [0], dtype=torch.float32)


def _options(layout: str, causal: bool, bottom_right: bool, window_left: int, window_right: int, scale: float,
             deterministic: bool, alibi: bool, training: bool) -> tuple:
    """The scalar options of a call as one tuple: part of the plan key as it is."""
    return (layout, causal, bottom_right, window_left, window_right, scale, deterministic, alibi, training)


def _forward_impl(q, k, v, seq_len_q, seq_len_kv, options: tuple, bias=None, sink=None, rng=None, dropout=0.0,
                  bias_grad=False):
    """(o, stats); stats is None when not training. options: see _plan_for."""
    c = _plan_for(q, k, v, None, seq_len_q, seq_len_kv, options, bias, sink, dropout, bias_grad)
    training = options[8]
    padded = seq_len_q is not None
    # Rows past a sequence's length are zero, not whatever the allocator held: they
    # flow into the next layer (and its weight gradients) unless the caller masks them.
    if padded:
        o = q.new_zeros(c.out_shape)
    else:
        o = torch.empty_like(q) if c.out_like_q else q.new_empty(c.out_shape)
    stats = q.new_empty(c.stats_shape, dtype=torch.float32) if training else None
    stream = _raw_stream(c.device)
    # Workspace from PyTorch's caching allocator, used on this stream only (_workspace).
    ws = _workspace(q, c.forward_workspace, c.device, stream)
    if bias is None and sink is None and rng is None:  # the common call: positional only, no keyword dict
        c.plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr() if training else 0,
                       ws.data_ptr() if ws is not None else 0, stream,
                       seq_len_q.data_ptr() if padded else 0, seq_len_kv.data_ptr() if padded else 0)
    else:
        c.plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr() if training else 0,
                       ws.data_ptr() if ws is not None else 0, stream,
                       seq_len_q.data_ptr() if padded else 0, seq_len_kv.data_ptr() if padded else 0,
                       **_extra_pointers(bias, sink, rng))
    return o, stats


def _extra_pointers(bias, sink, rng) -> dict[str, int]:
    """The features' tensors as plan.forward / plan.backward keywords. rng holds Philox's
    seed at element 0 and its offset at element 2 (16 bytes on: fastattn wants every
    device pointer 16-byte aligned)."""
    out = {}
    if bias is not None:
        out["bias"] = bias.data_ptr()
    if sink is not None:
        out["sink"] = sink.data_ptr()
    if rng is not None:
        out["seed"], out["offset"] = rng.data_ptr(), rng.data_ptr() + 16
    return out


@torch.library.custom_op("fastattn::attention_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len_q: torch.Tensor | None,
             seq_len_kv: torch.Tensor | None, layout: str, causal: bool, bottom_right: bool, window_left: int,
             window_right: int, scale: float, deterministic: bool, alibi: bool, training: bool,
             bias: torch.Tensor | None, sink: torch.Tensor | None, rng: torch.Tensor | None, dropout: float,
             bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    o, stats = _forward_impl(q, k, v, seq_len_q, seq_len_kv,
                             _options(layout, causal, bottom_right, window_left, window_right, scale, deterministic,
                                      alibi, training), bias, sink, rng, dropout, bias_grad)
    return o, stats if stats is not None else _stats_like(q, layout, False)


@_forward.register_fake
def _(q, k, v, seq_len_q, seq_len_kv, layout, causal, bottom_right, window_left, window_right, scale, deterministic,
      alibi, training, bias, sink, rng, dropout, bias_grad):
    return q.new_empty(_out_shape(q, v, layout)), _stats_like(q, layout, training)


@torch.library.custom_op("fastattn::attention_backward", mutates_args=())
def _backward(d_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              stats: torch.Tensor, seq_len_q: torch.Tensor | None, seq_len_kv: torch.Tensor | None, layout: str,
              causal: bool, bottom_right: bool, window_left: int, window_right: int, scale: float,
              deterministic: bool, alibi: bool, bias: torch.Tensor | None, sink: torch.Tensor | None,
              rng: torch.Tensor | None, dropout: float,
              bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_q, d_k, d_v, d_bias, d_sink); d_bias and d_sink are empty when not computed."""
    d_q, d_k, d_v, d_bias, d_sink = _backward_impl(
        d_o, q, k, v, o, stats, seq_len_q, seq_len_kv,
        _options(layout, causal, bottom_right, window_left, window_right, scale, deterministic, alibi, True), bias,
        sink, rng, dropout, bias_grad)
    if d_bias is None or d_sink is None:  # a custom op returns tensors
        empty_bias, empty_sink = _extra_grads_like(q, None, None, False)
        d_bias, d_sink = d_bias if d_bias is not None else empty_bias, d_sink if d_sink is not None else empty_sink
    return d_q, d_k, d_v, d_bias, d_sink


def _backward_impl(d_o, q, k, v, o, stats, seq_len_q, seq_len_kv, options: tuple, bias=None, sink=None, rng=None,
                   dropout=0.0, bias_grad=False):
    """_backward's work: (d_q, d_k, d_v, d_bias or None, d_sink or None); options (see
    _plan_for) with training True."""
    if d_o.stride() != o.stride():
        # The backward graph reads d_o at o's strides (cuDNN's plan is built for them).
        d_o = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device).copy_(d_o)
    c = _plan_for(q, k, v, o, seq_len_q, seq_len_kv, options, bias, sink, dropout, bias_grad)
    padded = seq_len_q is not None
    d_q, d_k, d_v = (torch.empty_like(t) if like else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                           device=t.device)
                     for t, like in zip((q, k, v), c.grads_like))
    if padded:
        for g in (d_q, d_k, d_v):
            g.zero_()  # padded rows get zero gradients (see _forward_impl)
    stream = _raw_stream(c.device)
    ws = _workspace(q, c.backward_workspace, c.device, stream)
    d_bias = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else None
    d_sink = torch.empty_like(sink) if sink is not None else None
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(), d_q.data_ptr(),
            d_k.data_ptr(), d_v.data_ptr(), ws.data_ptr() if ws is not None else 0, stream,
            seq_len_q.data_ptr() if padded else 0, seq_len_kv.data_ptr() if padded else 0)
    if bias is None and sink is None and rng is None:  # the common call: positional only (see _forward_impl)
        c.plan.backward(*args)
    else:
        extras = _extra_pointers(bias, sink, rng)
        if bias_grad:
            extras["d_bias"] = d_bias.data_ptr()
        if sink is not None:
            extras["d_sink"] = d_sink.data_ptr()
        c.plan.backward(*args, **extras)
    return d_q, d_k, d_v, d_bias, d_sink


def _extra_grads_like(q, bias, sink, bias_grad: bool):
    """Buffers for d_bias and d_sink, or empty tensors (a custom op returns tensors)."""
    d_bias = torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else q.new_empty(0)
    d_sink = torch.empty_like(sink) if sink is not None else q.new_empty(0, dtype=torch.float32)
    return d_bias, d_sink


@_backward.register_fake
def _(d_o, q, k, v, o, stats, seq_len_q, seq_len_kv, layout, causal, bottom_right, window_left, window_right, scale,
      deterministic, alibi, bias, sink, rng, dropout, bias_grad):
    return (torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device),
            torch.empty_strided(k.shape, k.stride(), dtype=k.dtype, device=k.device),
            torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device),
            *_extra_grads_like(q, bias, sink, bias_grad))


def _setup_context(ctx, inputs, output):
    (q, k, v, seq_len_q, seq_len_kv, layout, causal, bottom_right, window_left, window_right, scale, deterministic,
     alibi, training, bias, sink, rng, dropout, bias_grad) = inputs
    o, stats = output
    ctx.save_for_backward(q, k, v, o, stats, seq_len_q, seq_len_kv, bias, sink, rng)
    ctx.options = (layout, causal, bottom_right, window_left, window_right, scale, deterministic, alibi)
    ctx.extras = (dropout, bias_grad)
    ctx.training = training


def _grad(ctx, d_o, d_stats):
    if not ctx.training:
        raise RuntimeError("fastattn: backward through a call made without gradients enabled")
    q, k, v, o, stats, seq_len_q, seq_len_kv, bias, sink, rng = ctx.saved_tensors
    dropout, bias_grad = ctx.extras
    d_q, d_k, d_v, d_bias, d_sink = _backward(d_o, q, k, v, o, stats, seq_len_q, seq_len_kv, *ctx.options, bias,
                                              sink, rng, dropout, bias_grad)
    # Inputs: q, k, v, seq_len_q, seq_len_kv, 8 options, training, bias, sink, rng, dropout, bias_grad.
    return ((d_q, d_k, d_v) + (None,) * 11 + (d_bias if bias_grad else None, d_sink if sink is not None else None)
            + (None,) * 3)


_forward.register_autograd(_grad, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Eager training: the custom ops' own work under a plain autograd.Function. In
    PyTorch 2.11-2.13 a custom op's autograd wrapper costs ~150 us of host time per
    training step (torch._library.utils.fill_defaults rebuilds the schema's argument
    list once per argument), 4x what PyTorch's own SDPA step costs. torch.compile and
    tracing (_plain_eager false) still go through the custom ops."""

    @staticmethod
    def forward(ctx, q, k, v, seq_len_q, seq_len_kv, options, bias, sink, rng, dropout, bias_grad):
        o, stats = _forward_impl(q, k, v, seq_len_q, seq_len_kv, options, bias, sink, rng, dropout, bias_grad)
        ctx.save_for_backward(q, k, v, o, stats, seq_len_q, seq_len_kv, bias, sink, rng)
        ctx.options, ctx.extras = options, (dropout, bias_grad)
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, o, stats, seq_len_q, seq_len_kv, bias, sink, rng = ctx.saved_tensors
        dropout, bias_grad = ctx.extras
        d_q, d_k, d_v, d_bias, d_sink = _backward_impl(d_o, q, k, v, o, stats, seq_len_q, seq_len_kv, ctx.options,
                                                       bias, sink, rng, dropout, bias_grad)
        return (d_q, d_k, d_v, None, None, None, d_bias if bias_grad else None, d_sink if sink is not None else None,
                None, None, None)


def _plain_eager(q: torch.Tensor) -> bool:
    """A plain tensor on a CUDA device, outside torch.compile, any tracing mode and any
    torch.func transform: the call may skip the custom ops (whose wrappers cost host
    time) and run directly."""
    return (type(q) is torch.Tensor and q.is_cuda and not torch.compiler.is_compiling()
            and not _dispatch_modes() and not _functorch_active())


_dispatch_modes = torch._C._len_torch_dispatch_stack  # FakeTensorMode, make_fx's proxy mode, ...
_functorch_active = torch._C._are_functorch_transforms_active  # torch.func.grad, vmap: tensors are wrappers


def _check_qkv_tensors(q, k, v, dims: int, expected: str) -> None:
    """Each of q, k, v: a CUDA (or meta) tensor of `dims` dimensions in fp16 or bf16."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type not in ("cuda", "meta"):
            raise InvalidArgumentError(f"{name} is on {t.device}: fastattn runs on CUDA tensors")
        if t.dim() != dims:
            raise InvalidArgumentError(f"{name} has shape {tuple(t.shape)}: expected {expected}")
        if t.dtype not in _DTYPES:
            raise InvalidArgumentError(f"{name} has dtype {t.dtype}: expected torch.float16 or torch.bfloat16")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, seq_len_q=None, seq_len_kv=None) -> None:
    _check_qkv_tensors(q, k, v, 4, f"4 dimensions in {layout} order")
    if not (q.device == k.device == v.device):
        raise InvalidArgumentError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise InvalidArgumentError(f"q, k, v have different dtypes: {q.dtype}, {k.dtype}, {v.dtype}")
    b, h, s, d = _AXES[layout]
    if k.shape[b] != q.shape[b] or v.shape[b] != q.shape[b]:
        raise InvalidArgumentError(f"batch sizes differ: q {q.shape[b]}, k {k.shape[b]}, v {v.shape[b]}")
    if k.shape[h] != v.shape[h] or q.shape[h] % k.shape[h]:
        raise InvalidArgumentError(f"heads: q has {q.shape[h]}, k {k.shape[h]}, v {v.shape[h]}; k and v must match "
                                   "and divide q's")
    if k.shape[s] != v.shape[s]:
        raise InvalidArgumentError(f"k has {k.shape[s]} keys but v has {v.shape[s]}")
    if k.shape[d] != q.shape[d]:
        raise InvalidArgumentError(f"head dims differ: q {q.shape[d]}, k {k.shape[d]}")
    for name, t in (("seq_lens_q", seq_len_q), ("seq_lens_kv", seq_len_kv)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            raise InvalidArgumentError(f"{name} has dtype {getattr(t, 'dtype', type(t).__name__)}: expected a "
                                       "torch.int32 tensor")
        if t.dim() != 1 or t.shape[0] != q.shape[b]:
            raise InvalidArgumentError(f"{name} has shape {tuple(t.shape)}: expected ({q.shape[b]},), one length "
                                       "per sequence")
        if t.device != q.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, q on {q.device}")
        if not t.is_contiguous():
            raise InvalidArgumentError(f"{name} must be contiguous")


def _bias_shape(q: torch.Tensor, bias: torch.Tensor, layout: str) -> str:
    """The config's name for a bias's broadcast shape: "11ss", "1hss", "b1ss" or "bhss"."""
    b, h = q.shape[_AXES[layout][0]], q.shape[_AXES[layout][1]]
    return ("b" if bias.shape[0] == b and b > 1 else "1") + ("h" if bias.shape[1] == h and h > 1 else "1") + "ss"


def _check_extras(q: torch.Tensor, k: torch.Tensor, layout: str, bias, sink) -> None:
    b, h, s_q = (q.shape[a] for a in _AXES[layout][:3])
    s_kv = k.shape[_AXES[layout][2]]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype != q.dtype or bias.device != q.device:
            raise InvalidArgumentError(f"bias: expected a {q.dtype} tensor on {q.device}, got "
                                       f"{getattr(bias, 'dtype', type(bias).__name__)} on "
                                       f"{getattr(bias, 'device', None)}")
        if (bias.dim() != 4 or bias.shape[0] not in (1, b) or bias.shape[1] not in (1, h) or bias.shape[2] != s_q
                or bias.shape[3] != s_kv):
            raise InvalidArgumentError(f"bias has shape {tuple(bias.shape)}: expected (1 or {b}, 1 or {h}, {s_q}, "
                                       f"{s_kv})")
        if not bias.is_contiguous():
            raise InvalidArgumentError("bias must be contiguous")
    if sink is not None:
        if not isinstance(sink, torch.Tensor) or sink.dtype != torch.float32 or sink.device != q.device:
            raise InvalidArgumentError(f"sinks: expected a torch.float32 tensor on {q.device}, got "
                                       f"{getattr(sink, 'dtype', type(sink).__name__)} on "
                                       f"{getattr(sink, 'device', None)}")
        if sink.shape != (h,) or not sink.is_contiguous():
            raise InvalidArgumentError(f"sinks has shape {tuple(sink.shape)}: expected ({h},), one logit per query "
                                       "head, contiguous")


def _check_options(causal: Any, causal_bottom_right: Any, scale: Any, deterministic: Any = False) -> None:
    """The call's options, through the config's validators (fastattn._fields): the same
    values pass here as in an AttentionConfig ("0.1" is no scale, "false" no bool)."""
    for name, value in (("causal", causal), ("causal_bottom_right", causal_bottom_right),
                        ("deterministic", deterministic)):
        _fields.check("bool", name, value)
    if causal and causal_bottom_right:
        raise InvalidArgumentError("causal and causal_bottom_right are exclusive")
    if scale is not None:
        _fields.check("positive", "scale", scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              causal_bottom_right: bool = False, window: tuple[int, int] | None = None, scale: float | None = None,
              layout: str = "bshd", deterministic: bool = False, seq_lens_q: torch.Tensor | None = None,
              seq_lens_kv: torch.Tensor | None = None, alibi: bool = False, bias: torch.Tensor | None = None,
              dropout_p: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention on cuDNN's fused kernels, with autograd.

    q: (batch, seqlen_q, heads_q, head_dim_qk) for layout="bshd" (FlashAttention's order;
      "bhsd" is scaled_dot_product_attention's, "sbhd" is sequence-first); k and v the
      same with seqlen_kv and heads_kv (heads_q a multiple of it: GQA, MQA); v's head
      dim may differ. float16 or bfloat16 CUDA tensors on one device, any strides cuDNN
      accepts. Returns o with q's shape and v's head dim, in the same order.
    causal: query i sees keys j <= i (top-left diagonal); causal_bottom_right: the
      diagonal at the bottom right (j <= i + seqlen_kv - seqlen_q).
    window: (left, right) sliding window, FlashAttention's convention (-1 unbounded).
    scale: softmax scale (default 1/sqrt(head_dim_qk)).
    deterministic: a deterministic backward.
    seq_lens_q, seq_lens_kv: padding masks: int32 CUDA tensors of shape (batch,), each
      sequence's own query and key lengths (at most the tensors' sequence lengths; not
      checked, as that would synchronize); seq_lens_kv defaults to seq_lens_q. Queries
      and keys past them are masked out, and o (and in backward d_q, d_k, d_v) is zero
      there. The masks apply within each sequence's lengths. The padded rows of q, k,
      v and the output gradient must hold finite values (zeros, or anything finite):
      cuDNN multiplies them by zero, so NaN or Inf there (torch.empty can hold them)
      leaks into the results.
    alibi: ALiBi position biases (slope[h] * (key - query) added after scaling, the
      ALiBi paper's slopes); cuDNN needs a causal mask (or a window's right bound at 0)
      with it.
    bias: an additive bias after scaling, (1 or batch, 1 or heads_q, seqlen_q,
      seqlen_kv), q's dtype, contiguous; it gets a gradient when it requires one.
    dropout_p: dropout on the attention weights, as scaled_dot_product_attention's
      (applied whenever > 0; pass 0 in evaluation). The mask comes from PyTorch's CUDA
      generator (torch.manual_seed), and backward uses the same one.
    sinks: attention sinks, a float32 logit per query head, (heads_q,), in every
      softmax denominator; it gets a gradient when it requires one.

    Raises InvalidArgumentError (a ValueError) for CPU tensors, mismatched devices,
    dtypes or shapes, NotSupportedError when cuDNN refuses the config.
    """
    if layout not in _AXES:
        raise InvalidArgumentError(f"layout={layout!r}: must be one of {tuple(_AXES)}")
    if seq_lens_kv is None:
        seq_lens_kv = seq_lens_q
    elif seq_lens_q is None:
        raise InvalidArgumentError("seq_lens_kv given without seq_lens_q")
    cuda = isinstance(q, torch.Tensor) and q.is_cuda
    if not cuda:
        _check(q, k, v, layout, seq_lens_q, seq_lens_kv)  # CUDA inputs are checked once per plan, in _plan_for
    _check_options(causal, causal_bottom_right, scale, deterministic)
    _fields.check("bool", "alibi", alibi)
    left, right = _fields.pair("window", window)
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                            or (bias is not None and bias.requires_grad)
                                            or (sinks is not None and sinks.requires_grad))
    options = (layout, bool(causal), bool(causal_bottom_right), left, right, 0.0 if scale is None else float(scale),
               bool(deterministic), bool(alibi), training)  # as _options makes it
    if bias is None and sinks is None and not dropout_p:
        extras = (None, None, None, 0.0, False)
    else:
        _fields.check("probability", "dropout_p", dropout_p)
        if not cuda:
            _check_extras(q, k, layout, bias, sinks)
        # Philox's seed at element 0 and offset at element 2, drawn from PyTorch's generator.
        rng = torch.randint(0, 2**62, (4,), device=q.device, dtype=torch.int64) if dropout_p else None
        extras = (bias, sinks, rng, float(dropout_p), bool(training and bias is not None and bias.requires_grad))
    if cuda and _plain_eager(q):
        if not training:  # no autograd either: straight to the plan
            return _forward_impl(q, k, v, seq_lens_q, seq_lens_kv, options, *extras)[0]
        return _EagerAttention.apply(q, k, v, seq_lens_q, seq_lens_kv, options, *extras)
    return _forward(q, k, v, seq_lens_q, seq_lens_kv, *options, *extras)[0]


# -- packed variable-length sequences ----------------------------------------------------------
#
# FlashAttention's varlen layout: the sequences of a batch one after another, (tokens,
# heads, dim), with cumulative lengths. cuDNN's graph fixes the number of sequences and
# the longest length, so a plan is keyed by those (the longest rounded up to a power of
# two: batches of varying lengths share plans, and the persistent cache keeps each one),
# never by the token count.

def _bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _varlen_plan(q, k, v, batch: int, max_q: int, max_kv: int, causal: bool, bottom_right: bool, window_left: int,
                 window_right: int, scale: float, deterministic: bool, training: bool) -> _Cached:
    key = ("varlen", q.shape[1:], k.shape[1:], v.shape[1:], q.dtype, k.dtype, v.dtype, q.get_device(),
           k.get_device(), v.get_device(), batch, max_q, max_kv, causal, bottom_right, window_left, window_right,
           scale, deterministic, training)
    hit = _plans.get(key)
    if hit is not None:
        return hit
    import fastattn

    (_, hq, dqk), (_, hkv, _), (_, _, dv) = q.shape, k.shape, v.shape
    cfg = AttentionConfig(
        batch=batch, heads_q=hq, heads_kv=hkv, seqlen_q=max_q, seqlen_kv=max_kv, head_dim_qk=dqk, head_dim_v=dv,
        dtype=_DTYPES[q.dtype], layout="bshd", padding=True, ragged=True,
        mask="causal_bottom_right" if bottom_right else "causal" if causal else "none",
        window=(window_left, window_right), scale=None if scale <= 0 else scale, training=training,
        deterministic=deterministic,
    )
    hit = _Cached(fastattn.plan(cfg, device=q.device.index), q, k, v, None)
    with _plans_lock:
        _plans[key] = hit
    return hit


def _varlen_indices(q, k, v, cu_q, cu_kv) -> dict[str, torch.Tensor]:
    """Per-sequence lengths and cuDNN's element offsets, from cumulative lengths: a few
    tiny kernels on the current stream, no synchronization."""
    (hq, dqk), (hkv, dv) = q.shape[1:], (k.shape[1], v.shape[2])
    return {"seq_len_q": (cu_q[1:] - cu_q[:-1]).contiguous(), "seq_len_kv": (cu_kv[1:] - cu_kv[:-1]).contiguous(),
            "ragged_q": cu_q * (hq * dqk), "ragged_k": cu_kv * (hkv * dqk), "ragged_v": cu_kv * (hkv * dv),
            "ragged_o": cu_q * (hq * dv), "ragged_stats": cu_q * hq}


def _varlen_run_args(ix: dict[str, torch.Tensor], training: bool) -> tuple[int, int, dict[str, int]]:
    ptrs = {n: t.data_ptr() for n, t in ix.items() if n.startswith("ragged_") and (training or n != "ragged_stats")}
    return ix["seq_len_q"].data_ptr(), ix["seq_len_kv"].data_ptr(), ptrs


@torch.library.custom_op("fastattn::varlen_forward", mutates_args=())
def _varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_kv: torch.Tensor,
                    max_q: int, max_kv: int, causal: bool, bottom_right: bool, window_left: int, window_right: int,
                    scale: float, deterministic: bool, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _varlen_forward_impl(q, k, v, cu_q, cu_kv, (max_q, max_kv, causal, bottom_right, window_left, window_right,
                                                       scale, deterministic, training))


def _varlen_forward_impl(q, k, v, cu_q, cu_kv, options: tuple):
    """_varlen_forward's work. options: (max_q, max_kv, causal, bottom_right, window_left,
    window_right, scale, deterministic, training), _varlen_forward's scalars in order."""
    training = options[8]
    c = _varlen_plan(q, k, v, cu_q.shape[0] - 1, *options)
    o = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    stats = q.new_empty((q.shape[0], q.shape[1]) if training else (0,), dtype=torch.float32)
    stream = _raw_stream(c.device)
    ws = _workspace(q, c.forward_workspace, c.device, stream)
    seq_q, seq_kv, ragged = _varlen_run_args(_varlen_indices(q, k, v, cu_q, cu_kv), training)
    c.plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr() if training else 0,
                   ws.data_ptr() if ws is not None else 0, stream, seq_q, seq_kv, **ragged)
    return o, stats


@_varlen_forward.register_fake
def _(q, k, v, cu_q, cu_kv, max_q, max_kv, causal, bottom_right, window_left, window_right, scale, deterministic,
      training):
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[2]),
            q.new_empty((q.shape[0], q.shape[1]) if training else (0,), dtype=torch.float32))


@torch.library.custom_op("fastattn::varlen_backward", mutates_args=())
def _varlen_backward(d_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     stats: torch.Tensor, cu_q: torch.Tensor, cu_kv: torch.Tensor, max_q: int, max_kv: int,
                     causal: bool, bottom_right: bool, window_left: int, window_right: int, scale: float,
                     deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _varlen_backward_impl(d_o, q, k, v, o, stats, cu_q, cu_kv, (max_q, max_kv, causal, bottom_right,
                                                                       window_left, window_right, scale,
                                                                       deterministic, True))


def _varlen_backward_impl(d_o, q, k, v, o, stats, cu_q, cu_kv, options: tuple):
    """_varlen_backward's work; options as _varlen_forward_impl's, training True."""
    d_o = d_o.contiguous()  # the plan reads d_o at o's (packed) strides
    c = _varlen_plan(q, k, v, cu_q.shape[0] - 1, *options)
    d_q, d_k, d_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    stream = _raw_stream(c.device)
    ws = _workspace(q, c.backward_workspace, c.device, stream)
    seq_q, seq_kv, ragged = _varlen_run_args(_varlen_indices(q, k, v, cu_q, cu_kv), True)
    c.plan.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(),
                    d_q.data_ptr(), d_k.data_ptr(), d_v.data_ptr(), ws.data_ptr() if ws is not None else 0,
                    stream, seq_q, seq_kv, **ragged)
    return d_q, d_k, d_v


@_varlen_backward.register_fake
def _(d_o, q, k, v, o, stats, cu_q, cu_kv, max_q, max_kv, causal, bottom_right, window_left, window_right, scale,
      deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_kv, *options, training = inputs
    o, stats = output
    ctx.save_for_backward(q, k, v, o, stats, cu_q, cu_kv)
    ctx.options = tuple(options)
    ctx.training = training


def _varlen_grad(ctx, d_o, d_stats):
    if not ctx.training:
        raise RuntimeError("fastattn: backward through a call made without gradients enabled")
    q, k, v, o, stats, cu_q, cu_kv = ctx.saved_tensors
    d_q, d_k, d_v = _varlen_backward(d_o, q, k, v, o, stats, cu_q, cu_kv, *ctx.options)
    return (d_q, d_k, d_v) + (None,) * 11  # cu_q, cu_kv, 8 options, training


_varlen_forward.register_autograd(_varlen_grad, setup_context=_varlen_setup_context)


class _EagerVarlen(torch.autograd.Function):
    """Eager training for attention_varlen, as _EagerAttention is for attention."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_kv, options):
        o, stats = _varlen_forward_impl(q, k, v, cu_q, cu_kv, options)
        ctx.save_for_backward(q, k, v, o, stats, cu_q, cu_kv)
        ctx.options = options
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, o, stats, cu_q, cu_kv = ctx.saved_tensors
        return _varlen_backward_impl(d_o, q, k, v, o, stats, cu_q, cu_kv, ctx.options) + (None, None, None)


def _check_varlen(q, k, v, cu_q, cu_kv) -> None:
    _check_qkv_tensors(q, k, v, 3, "(tokens, heads, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            raise InvalidArgumentError(f"{name} must be contiguous (tokens, heads, head_dim): call .contiguous()")
    if not (q.device == k.device == v.device) or not (q.dtype == k.dtype == v.dtype):
        raise InvalidArgumentError("q, k, v must share one device and one dtype")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1] or k.shape[2] != q.shape[2]:
        raise InvalidArgumentError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                                   "(k and v: the same tokens and heads, dividing q's heads; k: q's head dim)")
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < 2:
            raise InvalidArgumentError(f"{name}: expected an int32 tensor of batch + 1 cumulative lengths, got "
                                       f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if t.device != q.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, q on {q.device}")
    if cu_q.shape != cu_kv.shape:
        raise InvalidArgumentError(f"cu_seqlens_q has {cu_q.shape[0]} entries, cu_seqlens_kv {cu_kv.shape[0]}")
    for name, t, h, d in (("q", q, q.shape[1], q.shape[2]), ("k", k, k.shape[1], k.shape[2]),
                          ("v", v, v.shape[1], v.shape[2])):
        if t.shape[0] * h * d >= 2**31:
            raise InvalidArgumentError(f"{name} holds {t.shape[0] * h * d} elements: cuDNN's offsets are int32")


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, *, causal: bool = False,
                     causal_bottom_right: bool = False, window: tuple[int, int] | None = None,
                     scale: float | None = None, deterministic: bool = False) -> torch.Tensor:
    """Attention over packed variable-length sequences (FlashAttention's varlen layout),
    with autograd; cuDNN's THD kernels, one plan per batch size and length bucket.

    q: (total_q, heads_q, head_dim_qk), k: (total_kv, heads_kv, head_dim_qk), v:
      (total_kv, heads_kv, head_dim_v): each batch's sequences one after another,
      contiguous, float16 or bfloat16, on one CUDA device.
    cu_seqlens_q, cu_seqlens_kv: int32 (batch + 1,): 0, then cumulative lengths (the
      sequences' starts in q and k); the last is at most total_q / total_kv.
    max_seqlen_q, max_seqlen_kv: at least the longest sequence (not checked: that
      would synchronize). Plans are built for them rounded up to a power of two.
    causal, causal_bottom_right, window, scale, deterministic: as attention(); the
      masks apply within each sequence. Returns o: (total_q, heads_q, head_dim_v).

    Raises InvalidArgumentError for bad inputs, NotSupportedError when cuDNN refuses.
    """
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv)
    _check_options(causal, causal_bottom_right, scale, deterministic)
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgumentError(f"{name}={n!r}: must be an int >= 1")
    left, right = _fields.pair("window", window)
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    options = (_bucket(max_seqlen_q), _bucket(max_seqlen_kv), bool(causal), bool(causal_bottom_right), left, right,
               0.0 if scale is None else float(scale), bool(deterministic), training)
    if _plain_eager(q):  # skip the custom ops' wrappers (see _EagerAttention)
        if not training:
            return _varlen_forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_kv, options)[0]
        return _EagerVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_kv, options)
    return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_kv, *options)[0]


# -- paged KV cache ----------------------------------------------------------------------------
#
# FlashAttention's flash_attn_with_kvcache layout: k and v are pools of pages of
# page_size tokens, (num_pages, page_size, heads_kv, dim), and an int32 block table lists
# each sequence's pages. cuDNN has no paged backward: forward only.

def _paged_plan(q, k_cache, v_cache, table, seq_lens_q, cache_seqlens, options: tuple) -> _Cached:
    """options: (causal, bottom_right, window_left, window_right, scale)."""
    key = ("paged", q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(),
           q.dtype, k_cache.dtype, v_cache.dtype, q.get_device(), k_cache.get_device(), v_cache.get_device(),
           _lengths_key(table), _lengths_key(cache_seqlens), _lengths_key(seq_lens_q), options)
    hit = _plans.get(key)
    if hit is not None:
        return hit
    import fastattn

    _check_paged(q, k_cache, v_cache, table, seq_lens_q, cache_seqlens)
    causal, bottom_right, window_left, window_right, scale = options
    (b, hq, sq, dqk), q_st = _logical(q, "bshd")
    (pages, hkv, page_size, _), k_st = _logical(k_cache, "bshd")  # a page is a "sequence" of page_size tokens
    (_, _, _, dv), v_st = _logical(v_cache, "bshd")
    _, o_st = _logical(q.new_empty(_out_shape(q, v_cache, "bshd"), device="meta"), "bshd")
    cfg = AttentionConfig(
        batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_kv=table.shape[1] * page_size, head_dim_qk=dqk,
        head_dim_v=dv, dtype=_DTYPES[q.dtype], layout={"q": q_st, "k": k_st, "v": v_st, "o": o_st},
        mask="causal_bottom_right" if bottom_right else "causal" if causal else "none",
        window=(window_left, window_right), scale=None if scale <= 0 else scale, padding=True,
        page_size=page_size, num_pages=pages,
    )
    hit = _Cached(fastattn.plan(cfg, device=q.device.index), q, k_cache, v_cache, "bshd")
    with _plans_lock:
        _plans[key] = hit
    return hit


# A batch's query lengths when the caller gives none (all seqlen_q): cuDNN's padding mask
# needs a tensor of them. Kept per (device, batch, seqlen_q), except while a CUDA graph
# is captured: a tensor made then is only filled when the graph replays.
_full_lengths: dict[tuple[int, int, int], torch.Tensor] = {}


def _query_lengths(q: torch.Tensor, device: int) -> torch.Tensor:
    b, sq = q.shape[0], q.shape[1]
    if _capturing():
        return torch.full((b,), sq, dtype=torch.int32, device=q.device)
    lengths = _full_lengths.get((device, b, sq))
    if lengths is None:
        lengths = _full_lengths[(device, b, sq)] = torch.full((b,), sq, dtype=torch.int32, device=q.device)
    return lengths


def _paged_forward_impl(q, k_cache, v_cache, table, cache_seqlens, seq_lens_q, options: tuple) -> torch.Tensor:
    c = _paged_plan(q, k_cache, v_cache, table, seq_lens_q, cache_seqlens, options)
    if seq_lens_q is None:
        seq_lens_q = _query_lengths(q, c.device)
        o = torch.empty_like(q) if c.out_like_q else q.new_empty(c.out_shape)
    else:
        o = q.new_zeros(c.out_shape)  # rows past a query length are zero (see _forward_impl)
    stream = _raw_stream(c.device)
    ws = _workspace(q, c.forward_workspace, c.device, stream)
    c.plan.forward(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), o.data_ptr(), 0,
                   ws.data_ptr() if ws is not None else 0, stream, seq_lens_q.data_ptr(), cache_seqlens.data_ptr(),
                   page_table_k=table.data_ptr(), page_table_v=table.data_ptr())
    return o


@torch.library.custom_op("fastattn::paged_forward", mutates_args=())
def _paged_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   cache_seqlens: torch.Tensor, seq_lens_q: torch.Tensor | None, causal: bool, bottom_right: bool,
                   window_left: int, window_right: int, scale: float) -> torch.Tensor:
    return _paged_forward_impl(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q,
                               (causal, bottom_right, window_left, window_right, scale))


@_paged_forward.register_fake
def _(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, causal, bottom_right, window_left, window_right,
      scale):
    return q.new_empty(_out_shape(q, v_cache, "bshd"))


def _check_lengths(name: str, t, batch: int, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.shape != (batch,):
        raise InvalidArgumentError(f"{name}: expected an int32 tensor of shape ({batch},), one length per sequence, "
                                   f"got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device or not t.is_contiguous():
        raise InvalidArgumentError(f"{name} must be contiguous and on {device}, like q; it is on {t.device}")


def _check_paged(q, k_cache, v_cache, table, seq_lens_q, cache_seqlens) -> None:
    _check_qkv_tensors(q, k_cache, v_cache, 4, "q: (batch, seqlen_q, heads_q, dim); k_cache, v_cache: "
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
                    scale: float | None = None) -> torch.Tensor:
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
    causal_bottom_right: the causal diagonal at the end of each sequence, where the
      queries of a decode or a chunked prefill sit: query i of a sequence sees keys j
      <= i + cache_seqlens - seq_lens_q. causal is the top-left diagonal. window and
      scale as attention(). Returns o: (batch, seqlen_q, heads_q, head_dim_v).

    Raises InvalidArgumentError for bad inputs (and for inputs that require
    gradients), NotSupportedError when cuDNN refuses the config.
    """
    _check_options(causal, causal_bottom_right, scale)
    if torch.is_grad_enabled() and (getattr(q, "requires_grad", False) or getattr(k_cache, "requires_grad", False)
                                    or getattr(v_cache, "requires_grad", False)):
        raise InvalidArgumentError("attention_paged is forward only (cuDNN has no paged backward): call it under "
                                   "torch.no_grad() or on tensors that do not require gradients")
    cuda = isinstance(q, torch.Tensor) and q.is_cuda
    if not cuda:
        _check_paged(q, k_cache, v_cache, block_table, seq_lens_q, cache_seqlens)  # CUDA: once per plan
    left, right = _fields.pair("window", window)
    options = (bool(causal), bool(causal_bottom_right), left, right, 0.0 if scale is None else float(scale))
    if cuda and _plain_eager(q):
        return _paged_forward_impl(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, options)
    return _paged_forward(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, *options)
