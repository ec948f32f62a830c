"""What every fastattn.torch entry point shares: the table from a call's tensor
signature to its plan (`CachedPlan`), the kept workspaces per (device, stream), the
current stream, and the tensor checks and layout arithmetic a plan is built from.

Each entry point builds its own key (a tuple of shapes, strides, dtypes, devices and
its options) and looks it up in `plans` itself, inline: a hit costs one dict lookup and
an int stored (`hit.used = CLOCK[0]`, its last use), and the key holds everything the
entry point's checks look at, so only a miss validates and builds (`remember`).
"""

from __future__ import annotations

import threading

import torch

from .. import _fields, bounded, dtypes
from ..config import LAYOUTS, AttentionConfig, axes
from ..errors import InvalidArgumentError

# The dimension order of the tensors' shapes: layout name -> position of (batch, head, seq, dim).
AXES = {layout: axes(layout) for layout in LAYOUTS}
# torch dtype -> the config's name (fastattn.dtypes's table): what the 16-bit entry points
# take, and FP8's (attention_fp8's).
DTYPES = dtypes.torch_dtypes(torch, dtypes.SIXTEEN_BIT)
FP8 = dtypes.torch_dtypes(torch, dtypes.FP8_DTYPES)

# key -> CachedPlan. Read without the lock (a dict lookup is atomic under the GIL); written
# under it. Two threads missing on one key at once both ask the runtime, which builds a
# (config, device) once while the other waits; the second insert replaces an equal entry.
# At most FASTATTN_MEMORY_MAX_ENTRIES (fastattn.bounded): past it remember() drops the
# least recently used eighth. A hit stamps its CachedPlan with CLOCK[0], which each insert
# advances (bounded.tick): the dropped are the entries unused since the oldest inserts,
# never one used between every two (a hot shape). Dropping only drops the table's
# reference: a CachedPlan a call holds, and the plan in it, stay valid (and a CUDA graph that
# captured the plan replays without it).
plans: dict[tuple, CachedPlan] = {}
CLOCK = [0]
_plans_lock = threading.Lock()
bounded.max_entries()  # checked at import: a bad value fails every path, not a first miss

try:  # the raw stream handle without a torch.cuda.Stream object (less host time per call)
    from torch._C import _cuda_getCurrentRawStream as raw_stream
except ImportError:  # pragma: no cover - older or CPU-only builds
    def raw_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream

try:  # without the Python wrapper around it (less host time per call)
    from torch._C import _cuda_isCurrentStreamCapturing as capturing
except ImportError:  # pragma: no cover - CPU-only builds
    def capturing() -> bool:
        return torch.cuda.is_current_stream_capturing()


class CachedPlan:
    """A plan and what each call needs from it, computed once."""

    __slots__ = ("backward_workspace", "device", "forward_workspace", "grads_like", "out_like_q", "out_shape",
                 "plan", "stats_shape", "used")

    def __init__(self, plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str | None):
        """layout None: packed sequences, whose token count, so shapes, each call's tensors give."""
        self.plan = plan
        self.device = q.get_device()
        self.out_shape = out_shape(q, v, layout) if layout else None
        self.stats_shape = stats_shape(q, layout) if layout else None
        self.forward_workspace = plan.forward_workspace_size
        self.backward_workspace = plan.backward_workspace_size
        # torch.empty_like costs less than new_empty(shape) or empty_strided (it parses no
        # sizes; docs/history/benchmarks-log.md, "PyTorch host time per call"): use it
        # wherever it gives the strides the plan was built for. The key fixes the inputs'
        # shapes and strides, so this holds for every call of the plan.
        self.out_like_q = layout is not None and like(q, self.out_shape)
        self.grads_like = tuple(layout is not None and like(t, list(t.shape), t.stride()) for t in (q, k, v))
        self.used = 0  # CLOCK[0] at its last use (see plans)


def remember(key: tuple, cfg: AttentionConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             layout: str | None) -> CachedPlan:
    """On a miss: the plan for cfg on q's device (from the runtime: memory, disk,
    Redis or a build), kept under key (the least recently used dropped past the cap)."""
    import fastattn

    from .. import _warm_up

    _warm_up.nudge()  # a miss on CUDA tensors: the warm-up may load the other plans beside this one now
    if capturing():
        # A load or build inside the caller's capture would make cuDNN calls that
        # invalidate it (and leave PyTorch's generator in capture state): only a plan this
        # process already holds is taken (one that another thread, the warm-up say, is
        # loading now is waited for, on the host), else the call raises before touching
        # the capture.
        held = fastattn.runtime.planned(cfg, device=q.device.index, wait=True)
        if held is None:
            raise InvalidArgumentError(
                "a CUDA graph is being captured on the current stream and the plan for this call is not loaded "
                "yet: run the call once before capturing (a plan load or build inside a capture would invalidate "
                "it; with shape classes, a captured call takes its class plan if that was loaded, else its exact "
                f"plan); config: {cfg.to_json()}")
        hit = CachedPlan(held, q, k, v, layout)
    else:
        hit = CachedPlan(fastattn.plan(cfg, device=q.device.index), q, k, v, layout)
    keep(key, hit)
    if cfg.training and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        fastattn.runtime.warm_torch_backward()  # a backward is coming: PyTorch's own first-backward import, now
    return hit


def keep(key: tuple, hit: CachedPlan) -> None:
    """plans[key] = hit, used now; past the cap the least recently used eighth dropped
    (counted: stats()["evictions"]["torch_calls"]). Inside a CUDA-graph capture too: a
    drop makes no CUDA call."""
    with _plans_lock:
        hit.used = bounded.tick(CLOCK)
        plans[key] = hit
        drop = bounded.trim_to(len(plans))
        if drop:
            dropped = [plans.pop(k) for k in bounded.least_used(((k, c.used) for k, c in plans.items()), drop)]
            bounded.evicted("torch_calls", drop)
        else:
            dropped = None
    del dropped  # (released after the lock: a plan's last reference frees it)


def like(t: torch.Tensor, shape: list[int], stride: tuple[int, ...] | None = None) -> bool:
    """Whether torch.empty_like(t) has this shape and these strides (None: contiguous)."""
    if list(t.shape) != shape:
        return False
    meta = torch.empty_like(t, device="meta")
    return meta.stride() == (stride if stride is not None else t.new_empty(shape, device="meta").stride())


# Workspaces of up to KEPT_WORKSPACE bytes are kept, one per (device, stream, thread),
# and reused by that thread's calls on that stream: the stream orders them on the GPU, so
# one buffer serves them all, and a call saves an allocation, a good part of a small
# call's host time (benchmarks/profile_torch_call.py; docs/history/benchmarks-log.md,
# "PyTorch host time per call"). Per thread, not only per stream: a
# call's launches into its workspace are several (cudnn-frontend copies the plan's
# constants into it, then cuDNN's kernels run), and two threads' launches on one stream
# interleave, so one thread's constants would land under the other's kernels (seen on
# the H200: 16 threads, wrong outputs). cuBLAS's workspaces in PyTorch are per handle,
# hence per thread, for the same reason. Not while a CUDA graph is captured: a graph
# replays on any stream, so it takes its own buffer from the capture's pool. Larger
# workspaces are allocated per call: next to their kernels' time the allocation is
# noise, and a kept one would hold the memory.
KEPT_WORKSPACE = 16 << 20
KEPT_STREAMS = 64  # at most this many kept, so that short-lived streams and threads cannot pile them up
workspaces: dict[tuple[int, int, int], torch.Tensor] = {}
thread_id = threading.get_ident


def workspace(q: torch.Tensor, size: int, device: int, stream: int) -> torch.Tensor | None:
    """A workspace of at least size bytes for this thread's call on this stream (None
    when size is 0)."""
    if not size:
        return None
    if size > KEPT_WORKSPACE or capturing():
        return q.new_empty(size, dtype=torch.uint8)
    key = (device, stream, thread_id())
    ws = workspaces.get(key)
    if ws is None or ws.numel() < size:
        # The old buffer goes back to the caching allocator once the last call holding it
        # has queued its work: stream-ordered, like any tensor freed on this stream.
        if ws is None and len(workspaces) >= KEPT_STREAMS:
            workspaces.clear()  # streams and threads come and go: start the table afresh
        ws = workspaces[key] = q.new_empty(size, dtype=torch.uint8)
    return ws


def logical(t: torch.Tensor, layout: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) in (batch, head, seq, dim) order."""
    axes = AXES[layout]
    shape, stride = t.shape, t.stride()
    return tuple(shape[a] for a in axes), tuple(stride[a] for a in axes)


def config_shape(q, k, v, o, layout: str) -> dict:
    """The AttentionConfig fields that q, k, v and o give: sizes in (batch, head, seq,
    dim) order and each tensor's strides (o None: the forward's own output, contiguous
    in the layout)."""
    if o is None:
        o = q.new_empty(out_shape(q, v, layout), device="meta")  # only its strides are needed
    (b, hq, sq, dqk), q_st = logical(q, layout)
    (_, hkv, skv, _), k_st = logical(k, layout)
    (_, _, _, dv), v_st = logical(v, layout)
    _, o_st = logical(o, layout)
    return dict(batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_kv=skv, head_dim_qk=dqk, head_dim_v=dv,
                layout={"q": q_st, "k": k_st, "v": v_st, "o": o_st})


def out_shape(q: torch.Tensor, v: torch.Tensor, layout: str) -> list[int]:
    """o has q's shape with v's head dim."""
    shape = list(q.shape)
    shape[AXES[layout][3]] = v.shape[AXES[layout][3]]
    return shape


def stats_shape(q: torch.Tensor, layout: str) -> list[int]:
    axes = AXES[layout]
    return [q.shape[axes[0]], q.shape[axes[1]], q.shape[axes[2]], 1]


def bottom_right(alignment, causal_bottom_right=False) -> bool:
    """Whether a call's diagonal sits at the bottom right: alignment="bottom_right", or
    causal_bottom_right=True (a causal mask there). The common call ("top_left", False)
    costs one comparison."""
    if alignment == "top_left":
        return bool(causal_bottom_right)
    if alignment == "bottom_right":
        return True
    raise InvalidArgumentError(f"alignment={alignment!r}: must be 'top_left' or 'bottom_right'")


def tensor_key(t):
    """An optional tensor's part of a plan key: what a plan depends on, never its data."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.get_device())


def check_qkv_tensors(q, k, v, dims: int, expected: str) -> None:
    """Each of q, k, v: a CUDA (or meta) tensor of `dims` dimensions in fp16 or bf16."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type not in ("cuda", "meta"):
            raise InvalidArgumentError(f"{name} is on {t.device}: fastattn runs on CUDA tensors")
        if t.dim() != dims:
            raise InvalidArgumentError(f"{name} has shape {tuple(t.shape)}: expected {expected}")
        if t.dtype not in DTYPES:
            hint = " (FP8: fastattn.torch.attention_fp8)" if t.dtype in FP8 else ""
            raise InvalidArgumentError(f"{name} has dtype {t.dtype}: expected {' or '.join(map(str, DTYPES))}{hint}")



def options(causal, bottom_right, window, scale, deterministic=False, alibi=False) -> tuple[int, int, float]:
    """Checks a call's scalar options through the config's validators (fastattn._fields),
    so that the same values pass here as in an AttentionConfig ("0.1" is no scale,
    "false" no bool, a window no mapping); returns (left, right, scale), scale 0.0 for
    the default. Plain bools, a None window and a None or float scale, the common call,
    cost a few type checks."""
    if not (causal.__class__ is bool and bottom_right.__class__ is bool and deterministic.__class__ is bool
            and alibi.__class__ is bool):
        for name, value in (("causal", causal), ("causal_bottom_right", bottom_right),
                            ("deterministic", deterministic), ("alibi", alibi)):
            _fields.check("bool", name, value)
    if causal and bottom_right:
        raise InvalidArgumentError("causal and causal_bottom_right are exclusive")
    left, right = (-1, -1) if window is None else _fields.pair("window", window)
    if scale is None:
        return left, right, 0.0
    _fields.check("positive", "scale", scale)
    return left, right, float(scale)


def check_shapes(q, k, v, layout: str, seq_len_q=None, seq_len_kv=None) -> None:
    """q, k, v (each already a 4-d tensor of an accepted dtype) agree with each other in
    the layout's order, and the per-sequence lengths fit them: what attention() and
    attention_fp8() check on a miss."""
    if not (q.device == k.device == v.device):
        raise InvalidArgumentError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise InvalidArgumentError(f"q, k, v have different dtypes: {q.dtype}, {k.dtype}, {v.dtype}")
    b, h, s, d = AXES[layout]
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


