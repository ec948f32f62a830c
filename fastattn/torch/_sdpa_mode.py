"""The SDPA mode: torch.nn.functional.scaled_dot_product_attention served by fastattn.

`enable_sdpa()` registers kernels of fastattn's through the dispatcher (the op library's
C++ kernels, csrc/sdpa.cpp, where fastattn.torch runs on its native path; else the Python
ones below through `torch.library.Library("aten", "IMPL")`) over three of PyTorch's
operators:
- `aten::scaled_dot_product_attention` itself, for CUDA and AutogradCUDA (`_composite`):
  every SDPA call while PyTorch's cuDNN backend is enabled, whichever backend PyTorch
  would pick among those enabled. A call fastattn takes (its route, below) runs as a call
  of PyTorch's cuDNN operator through the dispatcher, so PyTorch's autograd formula and
  Meta kernel hold for it; a boolean mask becomes the additive bias that operator takes
  (`_composite_bias`). Any other call runs PyTorch's own composite unchanged: its backend
  choice, its errors. So does every call while the cuDNN backend is disabled
  (torch.backends.cuda.cudnn_sdp_enabled() False: an `sdpa_kernel` context without
  CUDNN_ATTENTION, or `enable_cudnn_sdp(False)`), as PyTorch would not run cuDNN for it:
  a user who restricts the backends gets those backends' kernels and numerics.
- `aten::_scaled_dot_product_cudnn_attention` and its backward (`_forward`, `_backward`):
  what the composite's served calls run, and what PyTorch's composite, torch.compile's
  graphs or a direct caller give the cuDNN operator. A call fastattn cannot take exactly
  runs PyTorch's own cuDNN kernels (`aten::_cudnn_attention_forward` / `_backward`).
Each asks `_route` once per call signature; every call while the mode is off is PyTorch's.

Why the dispatcher (docs/DECISIONS.md): torch.compile traces through these kernels (the
composite's runs on fake tensors while AOTAutograd traces, and puts the cuDNN operator in
the graph, whose Meta kernel, PyTorch's, gives the shapes), so compiled graphs and their
CUDA-graph captures are served without a graph break; a TorchFunctionMode would be per
thread and cost host time on every torch call.

Determinism: while torch.use_deterministic_algorithms(True) is set without warn_only, a
call with a backward (and any backward, whenever its forward ran) takes cuDNN's
deterministic backward, a plan of its own (DenseOptions.deterministic); where cuDNN builds
none for it, PyTorch's choice runs it (NO_DETERMINISTIC), which leaves its own cuDNN
backend out and gives a deterministic backend, or its error where none is enabled. With
warn_only the mode serves as PyTorch's cuDNN backend does: cuDNN's default backward,
which warns (fastattn.torch._executor.alert_not_deterministic).

What fastattn takes: float16 / bfloat16 CUDA tensors of 4 dims, heads_q a multiple of
heads_kv (enable_gqa), a boolean mask or an additive one in the query's dtype or float32
(copied into a contiguous bias of cuDNN's broadcast shapes in the query's dtype where it
is not one), dropout, is_causal (top left), scale. A float mask that requires grad runs on
fastattn's dense op with its bias gradient instead (_trainable_mask). Head dims that are
not multiples of 8, which cuDNN does not take, are padded with zeros as PyTorch's flash
backend pads them (the scale kept at the real head dim's, the output cut back; autograd
pads its gradient), and counted (fastattn.stats()["sdpa"]["head_dim_padded"]). The
verdict is kept per call signature (shapes, strides, dtypes, options), so the forward and
the backward of one call always take the same side.
"""

from __future__ import annotations

import threading
import warnings
from typing import NamedTuple

import torch

from .. import bounded, runtime
from ..config import LAYOUTS, axes
from ..errors import FastAttnError, InvalidArgumentError, NotSupportedError
from . import _dense, _native
from ._executor import deterministic_algorithms, deterministic_warn_only
from ._plans import DTYPES, capturing

_COMPOSITE = "scaled_dot_product_attention"
_FORWARD = "_scaled_dot_product_cudnn_attention"
_BACKWARD = "_scaled_dot_product_cudnn_attention_backward"
# The arguments the kernels below take, by name and in order, as PyTorch 2.5-2.14 declare
# them; enable_sdpa() checks the installed torch's schemas against these. The operator a
# call is passed on to (FALLBACK_FORWARD_ARGS) may have more after them, each with a
# default, which a pass-on leaves at it (2.14 added seqused_k and block_table, for paged
# KV caches, which the SDPA operators never give it).
COMPOSITE_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
FORWARD_ARGS = ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
                "return_debug_mask", "scale")
BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
                 "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale")
FALLBACK_FORWARD_ARGS = ("query", "key", "value", "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
                         "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask", "scale")

# Why the composite kernel hands a call to PyTorch's composite before a route is asked:
# its tensors are not ones a route is kept for, or PyTorch raises its own error for them,
# or the user's choice of backends leaves cuDNN out (the op library's kernel is given
# these, by index: csrc/sdpa.cpp early() and composite()).
EARLY = ("query, key, value or attn_mask: not a plain strided tensor of static shape on the query's device, "
         "or query, key, value not of 4 dims",
         "attn_mask: neither boolean nor floating, or fewer than 2 dims (PyTorch 2.11's SDPA raises an "
         "IndexError for it), or does not broadcast to (batch, heads, seq_q, seq_kv)",
         "heads: key and value have fewer heads than query and enable_gqa is False (PyTorch's error)",
         "PyTorch's cuDNN SDPA backend is disabled (torch.backends.cuda.cudnn_sdp_enabled() is False: an "
         "sdpa_kernel context without CUDNN_ATTENTION, or enable_cudnn_sdp(False)): the backends enabled run it")
# A route's refusal of a call with a backward while torch.use_deterministic_algorithms(True)
# is set without warn_only (the route then asks for cuDNN's deterministic backward, and
# this is its answer where cuDNN builds none for the call): PyTorch's own choice, which
# leaves its cuDNN backend out there, runs it on a deterministic backend (or raises).
NO_DETERMINISTIC = ("torch.use_deterministic_algorithms(True) and a call with a backward: cuDNN builds no "
                    "deterministic backward for it here; PyTorch's deterministic backends run it")
# _early's answer for a call whose mask requires grad (a learned bias: relative positions,
# trained slopes), where nothing else hands it on: PyTorch's cuDNN operator returns no
# gradient for its attn_bias, so fastattn's own dense op runs it, with cuDNN's bias
# gradient (bias_grad), through the dense custom op's autograd (_trainable_mask).
# The op library's composite hands such a call to _composite (csrc/sdpa.cpp kPython).
TRAINABLE_MASK = "the mask requires grad: fastattn's dense op with its bias gradient"
# torch.backends.cuda.cudnn_sdp_enabled() without its Python wrapper: the process-wide flag
# that sdpa_kernel(...), torch.backends.cuda.enable_cudnn_sdp(...) and the deprecated
# sdp_kernel(enable_cudnn=...) set, and PyTorch's own backend choice reads per call.
_cudnn_sdp_enabled = torch._C._get_cudnn_sdp_enabled


class _Route(NamedTuple):
    """How fastattn runs one call signature: the layout its tensors are read in (the
    query's memory order), the options of fastattn's dense plan, and the output's and
    logsumexp's shapes and strides as the installed torch's Meta kernel gives them
    (what torch.compile's graphs were traced with)."""

    layout: str
    options: tuple
    out_stride: tuple
    lse_shape: tuple
    grad_strides: tuple  # d_query's, d_key's and d_value's (the backward's Meta kernel: empty_like)


class _State(NamedTuple):
    library: object  # the op library (its C++ kernels), or the torch.library.Library holding the Python ones


_lock = threading.Lock()
_state: _State | None = None
# signature -> [_Route, or the reason fastattn does not take it (a str); _clock at its last
# use]: at most FASTATTN_MEMORY_MAX_ENTRIES, the least recently used eighth dropped past
# it (fastattn.bounded). Read without a lock, written under _routes_lock.
_routes: dict[tuple, list] = {}
_routes_lock = threading.Lock()
_clock = [0]  # advanced by each route kept (bounded.tick); a hit stamps its route with _clock[0]
# The Python kernels' forward calls (fastattn.stats()["sdpa"]): None counts the served
# ones, a reason the ones PyTorch's kernels ran; and the op library whose C++ kernels the
# mode registered, which counts its own (csrc/sdpa.cpp).
_calls: dict[str | None, int] = {}
_calls_lock = threading.Lock()
# .counted: the composite kernel counted the call the cuDNN operator's kernel runs below
# it on this thread (csrc/sdpa.cpp t_counted)
_local = threading.local()
_native_kernels = None
_DEBUG = "return_debug_mask: PyTorch's kernels give the dropout mask"
# The served calls whose head dims the composite padded (_padded): their count's key in
# _calls, and the op library's (csrc/sdpa.cpp kPadded: a served count under this name).
PADDED = "head_dim_padded"
# The served calls whose mask required grad (_trainable_mask; counted by Python alone, as the
# op library's composite hands them to _composite), counted besides their served count.
MASK_GRAD = "mask_grad"


def enable_sdpa() -> None:
    """Make torch.nn.functional.scaled_dot_product_attention run on fastattn wherever
    fastattn supports the call (CUDA, float16 / bfloat16, GQA through enable_gqa, causal,
    boolean and additive masks, inference and training), whichever of its enabled backends
    PyTorch would pick, while PyTorch's cuDNN backend is enabled, in this process and every
    thread; PyTorch's own choice runs everything else, without an error. While the cuDNN
    backend is disabled (torch.backends.cuda.cudnn_sdp_enabled() False: inside
    `sdpa_kernel(...)` without SDPBackend.CUDNN_ATTENTION, or after
    `enable_cudnn_sdp(False)`, which a library may call process-wide), every call is
    PyTorch's, on the backends enabled. While torch.use_deterministic_algorithms(True) is
    set without warn_only, a call with a backward takes cuDNN's deterministic backward, or
    is PyTorch's where cuDNN builds none for it; with warn_only the mode serves it with
    cuDNN's default backward, which warns, as PyTorch's cuDNN backward does. A mask's rows that keep no key (False, or -inf,
    throughout) give zeros, as PyTorch's math kernel. Works under torch.compile
    (fullgraph: the cuDNN operator, not fastattn's Python, is what the graph holds) and
    CUDA-graph capture (after one call of each shape outside the capture, as
    fastattn.torch's entry points).
    Served and passed-on calls, with the reasons, are counted in fastattn.stats()["sdpa"];
    where fastattn cannot run at all (cuDNN not loadable, a CUDA failure) the calls are
    PyTorch's too, and the reason is also logged once (the "fastattn" logger). Calling
    it again changes nothing; `disable_sdpa()` undoes it. Also done when fastattn.torch
    is imported with FASTATTN_SDPA=1 (never otherwise).

    The kernels are the op library's C++ ones where fastattn.torch runs on its native
    path, else Python ones (FASTATTN_TORCH_PATH=python, or no op library built); with
    FASTATTN_TORCH_PATH=native and no usable op library, a RuntimeWarning says why and the
    Python ones serve (attention() itself raises then).

    Raises NotSupportedError where the installed torch's SDPA operators do not have the
    arguments these kernels are written for (see COMPOSITE_ARGS, FORWARD_ARGS)."""
    global _state
    with _lock:
        if _state is not None:
            return
        _check_schemas()
        # The path fastattn.torch's entry points take (FASTATTN_TORCH_PATH): the op library's
        # kernels where they run on it.
        try:
            native = _native.library() if _native.decide() is not None else None
        except RuntimeError as e:  # FASTATTN_TORCH_PATH=native without a usable op library (attention() raises it)
            warnings.warn(f"enable_sdpa: the SDPA mode runs its Python kernels: {e}", RuntimeWarning, stacklevel=2)
            native = None
        if native is not None:
            # The op library's kernels (csrc/sdpa.cpp): these below in C++, a new signature's
            # route asked of _route once.
            native.sdpa_kernels(True, _route, "CUDA", list(EARLY), composite=_composite)
            library = native
            global _native_kernels
            _native_kernels = native
        else:
            library = python_kernels("CUDA")
        _state = _State(library)


def python_kernels(key: str):
    """The Python kernels registered for `key` ("CUDA"; "CPU" in tests) and its autograd
    key: the torch.library.Library holding them (its _destroy() removes them). The
    composite's kernel goes on both keys: the autograd key's alone would be passed over
    in inference mode, and the device key's alone would leave the autograd key without a
    kernel (PyTorch's composite fills it only where the device has none)."""
    library = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (an override of aten's own kernels)
    with warnings.catch_warnings():
        # PyTorch warns that a kernel replaces another for the same key: that is the point.
        warnings.simplefilter("ignore", UserWarning)
        library.impl(_FORWARD, _forward, key)
        library.impl(_BACKWARD, _backward, key)
        library.impl(_COMPOSITE, _composite, key)
        library.impl(_COMPOSITE, _composite, "Autograd" + key)
    return library


def disable_sdpa() -> None:
    """Undo enable_sdpa(): PyTorch's own kernels again. Calling it while the mode is off
    changes nothing."""
    global _state
    with _lock:
        if _state is None:
            return
        # Removing the kernels, the dispatcher falls back to the ones they replaced, PyTorch's.
        if isinstance(_state.library, torch.library.Library):
            _state.library._destroy()
        else:
            _state.library.sdpa_kernels(False)
        _state = None


def sdpa_enabled() -> bool:
    """Whether enable_sdpa() is in effect."""
    return _state is not None


def sdpa_routes() -> dict[tuple, str]:
    """What the mode decided per call signature so far: "fastattn (<layout>)" or the
    reason PyTorch's kernels run it (for `fastattn info`-style introspection and tests)."""
    return {key: (f"fastattn ({r.layout})" if isinstance(r, _Route) else r)
            for key, (r, _) in list(_routes.items())}


def sdpa_calls() -> dict:
    """The mode's calls so far, one per SDPA call while the mode was on (and per direct
    call of PyTorch's cuDNN operator): {"served": calls fastattn ran, "head_dim_padded":
    those of them whose head dims it padded to multiples of 8, "mask_grad": those of them
    whose mask required grad (and got it), "passed_on": {reason: calls PyTorch's kernels
    ran}} (fastattn.stats()["sdpa"])."""
    with _calls_lock:
        padded = _calls.get(PADDED, 0)
        served = _calls.get(None, 0) + padded
        mask_grad = _calls.get(MASK_GRAD, 0)
        passed = {reason: n for reason, n in _calls.items() if reason not in (None, PADDED, MASK_GRAD)}
    if _native_kernels is not None:
        for ours, reason, n in _native_kernels.sdpa_calls():
            if ours and reason == PADDED:  # (of the served ones its routes counted)
                padded += n
            elif ours:
                served += n
            elif n:  # ("": the calls of dropped routes whose reasons were past the cap)
                bounded.count_reason(passed, reason or bounded.OTHER_REASONS, n)
    return {"served": served, "head_dim_padded": padded, "mask_grad": mask_grad, "passed_on": passed}


def _zero_calls() -> None:
    with _calls_lock:
        _calls.clear()
    if _native_kernels is not None:
        _native_kernels.zero_sdpa_calls()


def _count(reason: str | None) -> None:
    with _calls_lock:
        if reason in (None, PADDED, MASK_GRAD):
            _calls[reason] = _calls.get(reason, 0) + 1
        else:  # (a reason may quote shapes: bounded)
            bounded.count_reason(_calls, reason)


runtime.register_stats("sdpa", sdpa_calls, _zero_calls)


def _check_schemas() -> None:
    for name, expected in ((_COMPOSITE, COMPOSITE_ARGS), (_FORWARD, FORWARD_ARGS), (_BACKWARD, BACKWARD_ARGS),
                           ("_cudnn_attention_forward", FALLBACK_FORWARD_ARGS),
                           ("_cudnn_attention_backward", BACKWARD_ARGS)):  # its stack is the backward's
        try:
            schema = getattr(torch.ops.aten, name).default._schema
        except (AttributeError, RuntimeError):
            raise NotSupportedError(f"enable_sdpa: torch {torch.__version__} has no aten::{name}") from None
        if schema_problem(name, expected, schema.arguments):
            got = tuple(a.name for a in schema.arguments)
            raise NotSupportedError(f"enable_sdpa: torch {torch.__version__}'s aten::{name} takes {got}; the SDPA "
                                    f"mode is written for {expected}")


def schema_problem(name: str, expected: tuple[str, ...], arguments) -> bool:
    """Whether an operator's declared arguments (objects with .name and
    .has_default_value(), as torch's FunctionSchema gives them) differ from what the mode
    is written for: `expected` exactly, or, for the operator a call is passed on to,
    `expected` followed by arguments that each have a default."""
    got = tuple(a.name for a in arguments)
    extra = list(arguments)[len(expected):]
    appended = name == "_cudnn_attention_forward" and all(a.has_default_value() for a in extra)
    return got[:len(expected)] != expected or bool(extra and not appended)


# -- the route of a call ----------------------------------------------------------------------

def _order(layout: str) -> tuple[int, ...]:
    """A layout's dims in SDPA's (batch, heads, seq, dim) numbering, outermost first: the
    permutation of a bhsd tensor that views it in the layout's order."""
    return tuple("bhsd".index(d) for d in layout)


# The layouts in the order layout_of tries them (SDPA's own first), by their orders.
_LAYOUT_ORDERS = {_order(name): name for name in sorted(LAYOUTS, key=lambda name: name != "bhsd")}


def layout_of(t: torch.Tensor) -> str | None:
    """The fastattn layout whose memory order t's (batch, heads, seq, dim) strides follow
    (dims of extent 1 fit anywhere), or None where none does."""
    dims = [d for d in range(4) if t.shape[d] > 1]
    for order, name in _LAYOUT_ORDERS.items():
        placed = [d for d in order if d in dims]
        if all(t.stride(a) >= t.stride(b) for a, b in zip(placed, placed[1:])):
            return name
    return None


def _views(layout: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """bhsd tensors as views in the layout's order (what attention()'s plans read)."""
    perm = _order(layout)
    if perm == _BHSD:
        return list(tensors)
    return [t.permute(perm) for t in tensors]


def _to_bhsd(layout: str, t: torch.Tensor) -> torch.Tensor:
    perm = axes(layout)
    return t if perm == _BHSD else t.permute(perm)


_BHSD = (0, 1, 2, 3)


def _bias(attn_bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, training: bool) -> torch.Tensor | None:
    """attn_bias (broadcastable to (b, heads_q, seq_q, seq_kv)) as fastattn's bias: each
    broadcast dim of extent 1, contiguous (a copy only where it is not already); one row
    is expanded over the queries when training (fastattn has no correct backward for a
    one-row bias). A float32 bias beside float16 / bfloat16 queries (SDPA allows it) is
    rounded to the query's dtype, in the same copy: PyTorch 2.11's own cuDNN kernel reads
    its bytes as the query's dtype and returns NaN (measured by
    benchmarks/probe_sdpa_gates.py), and its math kernel rounds the scores plus the mask
    to that dtype too."""
    if attn_bias is None:
        return None
    b, h, sq, skv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    m = attn_bias.expand(b, h, sq, skv)
    for dim in range(3):
        if m.stride(dim) == 0 and m.shape[dim] > 1 and not (dim == 2 and training):
            m = m.narrow(dim, 0, 1)
    if m.dtype != q.dtype:
        return m.to(q.dtype, memory_format=torch.contiguous_format)
    return m if m.is_contiguous() else m.contiguous()


def _signature(q, k, v, attn_bias, dropout_p, is_causal, scale, training, deterministic, bias_grad) -> tuple:
    bias = None if attn_bias is None else (attn_bias.shape, attn_bias.stride(), attn_bias.dtype)
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            q.get_device(), bias, float(dropout_p), bool(is_causal), scale, bool(training), bool(deterministic),
            bias_grad)


def _strict() -> bool:
    """torch.use_deterministic_algorithms(True) without warn_only: a call with a backward
    then takes cuDNN's deterministic backward, or PyTorch's kernels (NO_DETERMINISTIC).
    With warn_only the mode serves as PyTorch's cuDNN backend does: its default backward,
    which warns (PyTorch's test_fused_backwards_throws_determinism_warning)."""
    return deterministic_algorithms() and not deterministic_warn_only()


def _route(q, k, v, attn_bias, dropout_p, is_causal, scale, training, deterministic=False,
           bias_grad=False) -> _Route | str:
    """fastattn's way to run this call, or why PyTorch's kernels run it. One dict lookup
    once the signature has been seen. deterministic: a training call's route takes cuDNN's
    deterministic backward (_strict). bias_grad: the backward also gives attn_bias's
    gradient (a training call of _trainable_mask's; the cuDNN operator's kernels never ask)."""
    deterministic = bool(deterministic and training)
    bias_grad = bool(bias_grad and training and attn_bias is not None)
    key = _signature(q, k, v, attn_bias, dropout_p, is_causal, scale, training, deterministic, bias_grad)
    hit = _routes.get(key)
    if hit is not None:
        hit[1] = _clock[0]
        return hit[0]
    route = _decide(q, k, v, attn_bias, dropout_p, is_causal, scale, training, deterministic, bias_grad)
    if isinstance(route, _Route) or not (q.is_cuda and capturing()):
        # (a refusal inside a capture, for a plan not loaded yet, is not kept: the same call
        # outside a capture can load it)
        _keep(key, route)
    return route


def _keep(key: tuple, route: _Route | str) -> None:
    """Keeps a signature's route; past the cap, the least recently used eighth is dropped.
    A dropped signature is decided again at its next call, with the same answer: a
    backward whose route was dropped after its forward finds the forward's plan in
    fastattn.torch's table or the runtime (inside a capture too), unless both dropped it
    as well, past the cap's worth of other shapes since."""
    bounded.max_entries()  # (read before the lock: a bad value raises before anything changes)
    with _routes_lock:
        _routes[key] = [route, bounded.tick(_clock)]
        drop = bounded.trim_to(len(_routes))
        if drop:
            for old in bounded.least_used(((k, kept[1]) for k, kept in _routes.items()), drop):
                del _routes[old]
            bounded.evicted("sdpa_routes", drop)


def _decide(q, k, v, attn_bias, dropout_p, is_causal, scale, training, deterministic=False,
            bias_grad=False) -> _Route | str:
    if q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype):
        return f"dtype {q.dtype}: fastattn takes float16 and bfloat16"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "fastattn takes 4-d (batch, heads, seq, dim) tensors here"
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        return f"heads: query {q.shape[1]}, key {k.shape[1]}, value {v.shape[1]}"
    if attn_bias is not None and attn_bias.dtype not in (q.dtype, torch.float32):
        return f"attn_bias is {attn_bias.dtype}, query {q.dtype}"
    if scale is not None and not scale > 0:
        return f"scale={scale}: fastattn takes a scale > 0"
    layout = layout_of(q)
    if layout is None:
        return f"query strides {q.stride()}: in no memory order fastattn reads (bhsd, bshd, sbhd)"
    options = _dense.DenseOptions(layout, bool(is_causal), False, -1, -1, 0.0 if scale is None else float(scale),
                                  bool(deterministic), False, bool(training), float(dropout_p), bool(bias_grad), 0.0)
    ql, kl, vl = _views(layout, q, k, v)
    try:
        _dense.plan_for(ql, kl, vl, None, None, _bias(attn_bias, q, k, training), None, None, None, options)
    except (NotSupportedError, InvalidArgumentError) as e:  # cuDNN's refusal, or a plan not loadable now
        if deterministic and isinstance(e, NotSupportedError):
            return NO_DETERMINISTIC
        return f"{type(e).__name__}: {e}"
    except FastAttnError as e:
        # fastattn cannot run here (cuDNN not loadable, a CUDA or cuDNN failure): the mode
        # stands aside, PyTorch's kernels answer; said once a reason, as it is not a refusal.
        reason = f"{type(e).__name__}: {e}"
        runtime.warn_once(f"the SDPA mode hands calls to PyTorch's kernels (counted in fastattn.stats()['sdpa']): "
                          f"{reason}")
        return reason
    # The output's strides and logsumexp's shape PyTorch's Meta kernel gives (what
    # torch.compile's graphs were traced with), and the backward's (empty_like of each
    # input), by their rules below: asking the Meta kernel itself would import sympy and
    # torch.fx's symbolic shapes in the first call (any meta op does; seconds on the
    # H200). CPU tests hold these rules to the installed torch's Meta kernels.
    b, h, s_q, d_v = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    out_shape = (b, h, s_q, d_v)
    if tuple(q.shape) == out_shape:
        out_stride = empty_like_strides(q.shape, q.stride())
    else:
        out_stride = _dense_strides(out_shape, sorted(range(4), key=lambda d: q.stride(d), reverse=True))
    grads = tuple(empty_like_strides(t.shape, t.stride()) for t in (q, k, v))
    return _Route(layout, options, out_stride, (b, h, s_q, 1), grads)


def _dense_strides(shape, order) -> tuple:
    """Dense strides of shape with its dims in memory in order (outermost first)."""
    strides = [0] * len(shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def empty_like_strides(shape, stride) -> tuple:
    """The strides torch.empty_like gives a meta tensor of this shape and these strides
    (PyTorch's Meta kernels call it; on meta tensors it is torch._refs.empty_like): dense,
    in the dims' order as compute_elementwise_output_logical_to_physical_perm sorts them
    (contiguous, or channels-last for 4 dims, where the tensor already is one)."""
    shape, stride = tuple(shape), tuple(stride)
    n = len(shape)
    if n < 2:
        return _dense_strides(shape, range(n))
    is_contiguous = 0 in shape or _follows(shape, stride, range(n))  # (an empty tensor is contiguous)
    is_channels_last = n == 4 and _follows(shape, stride, (0, 2, 3, 1))
    if is_contiguous and not is_channels_last:
        return _dense_strides(shape, range(n))
    if is_channels_last and not is_contiguous:
        return _dense_strides(shape, (0, 2, 3, 1))

    def should_swap(a, b):  # 1 where dim a belongs inside dim b, -1 where outside, 0 unknown
        if stride[a] == 0 or stride[b] == 0:
            return 0
        if stride[a] == stride[b]:
            return 0 if shape[b] >= shape[a] else 1
        return -1 if stride[b] > stride[a] else 1

    perm = list(range(n))[::-1]  # innermost first, insertion-sorted as PyTorch's
    for i in range(1, n):
        j = i
        for k in range(i - 1, -1, -1):
            c = should_swap(perm[k], perm[j])
            if c > 0:
                perm[k], perm[j] = perm[j], perm[k]
                j = k
            elif c < 0:
                break
    return _dense_strides(shape, perm[::-1])


def _follows(shape, stride, order) -> bool:
    """Whether the strides are dense in this dim order (outermost first; dims of extent 1
    ignored): PyTorch's contiguity checks."""
    expected = 1
    for d in reversed(tuple(order)):
        if shape[d] != 1:
            if stride[d] != expected:
                return False
            expected *= shape[d]
    return True


def _matched(o: torch.Tensor, stride: tuple) -> torch.Tensor:
    """o with the strides PyTorch's Meta kernel gave: a view where they differ only on
    dims of extent 1 (the same memory), else a copy."""
    if o.stride() == stride:
        return o
    if all(a == b or n == 1 for a, b, n in zip(o.stride(), stride, o.shape)):
        return o.as_strided(o.shape, stride)
    return torch.empty_strided(o.shape, stride, dtype=o.dtype, device=o.device).copy_(o)


# -- the kernels ------------------------------------------------------------------------------

def _forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
             return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_cudnn_attention's CUDA kernel: the outputs PyTorch's
    gives (output in the query's memory order, logsumexp (b, h, seq_q, 1) float32, the
    lengths, Philox's seed and offset as 0-d int64 tensors; cum_seq and the debug mask
    undefined, as PyTorch's Meta kernel returns them)."""
    route = _route(query, key, value, attn_bias, dropout_p, is_causal, scale, compute_log_sumexp,
                   compute_log_sumexp and _strict())
    counted = getattr(_local, "counted", False)  # (the composite's call, counted there)
    if not isinstance(route, _Route) or return_debug_mask:
        if not counted:
            _count(_DEBUG if isinstance(route, _Route) else route)
        return torch.ops.aten._cudnn_attention_forward(
            query, key, value, attn_bias, None, None, query.shape[2], key.shape[2], compute_log_sumexp, dropout_p,
            is_causal, return_debug_mask, scale=scale)
    if not counted:
        _count(None)
    layout, options, out_stride, lse_shape = route[:4]
    q, k, v = _views(layout, query, key, value)
    bias = _bias(attn_bias, query, key, compute_log_sumexp)
    # Philox's seed at element 0 and offset at element 2 (fastattn's rng tensor)
    rng = torch.randint(0, 2**62, (4,), device=query.device, dtype=torch.int64) if dropout_p else None
    o, stats = _dense.forward_impl(q, k, v, None, None, bias, None, rng, options)
    if stats is None:  # inference writes no stats; the operator still returns the tensor, in its own shape
        stats = query.new_empty(lse_shape, dtype=torch.float32)
    elif stats.shape != lse_shape:  # (a view costs more host time than the comparison)
        stats = stats.view(lse_shape)
    if rng is None:
        seed = offset = query.new_zeros((), dtype=torch.int64)
    else:
        seed, offset = rng[0], rng[2]
    return (_matched(_to_bhsd(layout, o), out_stride), stats, None, None, query.shape[2], key.shape[2], seed, offset,
            None)


def _backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
              cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
    """aten::_scaled_dot_product_cudnn_attention_backward's CUDA kernel: (d_query, d_key,
    d_value), from the side (fastattn or PyTorch's) that ran the forward."""
    bias = attn_bias if attn_bias is not None and attn_bias.numel() else None
    # (determinism as required now, at the backward: a forward run before it was required
    # takes the deterministic backward too, the forward graph being the same)
    route = _route(query, key, value, bias, dropout_p, is_causal, scale, True, _strict())
    if not isinstance(route, _Route):
        return torch.ops.aten._cudnn_attention_backward(
            grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k,
            max_q, max_k, dropout_p, is_causal, scale=scale)
    layout, options = route.layout, route.options
    q, k, v, o, d_o = _views(layout, query, key, value, out, grad_out)
    stats = logsumexp.reshape(query.shape[0], query.shape[1], query.shape[2], 1)
    rng = None
    if dropout_p:
        rng = torch.stack([philox_seed, philox_seed, philox_offset, philox_offset]).reshape(4)
    grads = _dense.backward_impl(d_o, o, stats, q, k, v, None, None, _bias(bias, query, key, True), None, rng,
                                 options)[:3]  # (d_q, d_k, d_v: what the operator returns)
    return tuple(_matched(_to_bhsd(layout, g), stride) for g, stride in zip(grads, route.grad_strides))



# -- the composite ----------------------------------------------------------------------------

def _plain(t: torch.Tensor, device) -> bool:
    return (t.layout == torch.strided and not t.is_nested and t.device == device
            and all(isinstance(n, int) for n in (*t.shape, *t.stride())))


def _early(q, k, v, attn_mask, enable_gqa) -> str | None:
    """Which of EARLY hands this call on before a route is asked, TRAINABLE_MASK where
    _trainable_mask takes it, or None where the route decides."""
    if not _cudnn_sdp_enabled():  # (first: one flag read, and the user's choice outranks the rest)
        return EARLY[3]
    if not all(_plain(t, q.device) for t in (q, k, v)) or not q.dim() == k.dim() == v.dim() == 4 or (
            attn_mask is not None and not _plain(attn_mask, q.device)):
        return EARLY[0]
    trainable = False
    if attn_mask is not None:
        m = attn_mask
        if not 2 <= m.dim() <= 4 or not (m.dtype == torch.bool or m.dtype.is_floating_point):
            return EARLY[1]
        out = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if any(m.shape[-d] not in (1, out[4 - d]) for d in range(1, m.dim() + 1)):
            return EARLY[1]
        trainable = m.requires_grad and torch.is_grad_enabled()
    if not enable_gqa and k.shape[1] != q.shape[1]:
        return EARLY[2]
    return TRAINABLE_MASK if trainable else None


def _composite_bias(attn_mask, q, lse: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """attn_mask as the cuDNN operator's attn_bias, and `empty`: a view of 4 dims; a
    boolean mask as SDPA reads one (0 where True, -inf where False). empty (True on the
    rows that keep no key, else None) sets their output to zeros after, as PyTorch's math
    kernel gives it (fastattn.torch.scaled_dot_product_attention's rule, _sdpa._as_bias);
    where the backward runs (lse), such a row is 0 throughout in the bias, an ordinary row
    for the kernel, since the backward would read its -inf logsumexp. A float mask's rows
    of -inf alike. Every step is a kernel on the mask's device (_zero_and_minus_inf)."""
    if attn_mask is None:
        return None, None
    m = attn_mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if m.dtype != torch.bool:
        # (amax: one pass over the mask; it refuses a dim of no keys, where every row keeps none)
        empty = (m.amax(-1, keepdim=True) == float("-inf") if m.shape[-1] else
                 (m != float("-inf")).any(-1, keepdim=True).logical_not_())
        return (m.masked_fill(empty, 0.0) if lse else m), empty
    kept = m.any(-1, keepdim=True)
    zero, minus_inf = _zero_and_minus_inf(q)
    # (for the backward, the inner where over one column: the rows keeping no key 0 throughout)
    return torch.where(m, zero, torch.where(kept, minus_inf, zero) if lse else minus_inf), kept.logical_not()


# (device, dtype) -> 0 and -inf, 0-d tensors there
_constants: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _zero_and_minus_inf(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """0 and -inf as 0-d tensors of like's dtype on its device, for torch.where (a
    boolean mask's bias) without a copy from the host on each call: kept per device and
    dtype, made once for a plain tensor outside a capture (copied with a wait, so that
    any stream may read them); made for the call for torch.compile's fake and functional
    tensors, and inside a capture before any is kept. Why each: csrc/sdpa.cpp
    zero_and_minus_inf, the op library's twin."""
    plain = type(like) is torch.Tensor
    key = (like.device, like.dtype)
    hit = _constants.get(key) if plain else None
    if hit is not None:
        return hit
    if not plain or (like.is_cuda and capturing()):
        return (torch.zeros((), dtype=like.dtype, device=like.device),
                torch.full((), float("-inf"), dtype=like.dtype, device=like.device))
    with torch.inference_mode(False):  # (kept, so usable outside inference mode too)
        hit = _constants[key] = (torch.zeros((), dtype=like.dtype).to(like.device),
                                 torch.full((), float("-inf"), dtype=like.dtype).to(like.device))
    return hit


def _padded(q, k, v, scale):
    """(q, k, v, scale, head_dim_v): the head dims padded with zeros to multiples of 8, the
    scale at the real head dim's (zeros add nothing to q . k and give output columns that
    are cut off), and v's real head dim to cut the output back to; head_dim_v None where
    nothing is padded (no copy). PyTorch's flash backend pads so (sdp_utils'
    pad_last_dim), and cuDNN takes head dims of multiples of 8 only."""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if d_qk % 8 == 0 and d_v % 8 == 0:
        return q, k, v, scale, None
    if scale is None:
        scale = d_qk ** -0.5
    if d_qk % 8:
        q, k = (torch.nn.functional.pad(t, (0, -d_qk % 8)) for t in (q, k))
    if d_v % 8:
        v = torch.nn.functional.pad(v, (0, -d_v % 8))
    return q, k, v, scale, d_v


def _composite(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """aten::scaled_dot_product_attention, every backend's entry (registered for the
    device's key and its autograd key): a call fastattn takes runs as the cuDNN
    operator's call through the dispatcher (PyTorch's autograd formula for it; the
    kernels above), any other as PyTorch's own composite (its backend choice, its
    errors)."""
    reason = _early(query, key, value, attn_mask, enable_gqa)
    if reason is TRAINABLE_MASK:
        reason = _trainable_mask(query, key, value, attn_mask, dropout_p, is_causal, scale)
        if reason.__class__ is not str:  # (served: the output)
            return reason
    # PyTorch's composite asks its kernels for the logsumexp only where autograd needs it.
    lse = reason is None and torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                                          or value.requires_grad)
    if reason is None:
        q, k, v, s, head_dim_v = _padded(query, key, value, scale)
        bias, empty = _composite_bias(attn_mask, q, lse)
        route = _route(q, k, v, bias, dropout_p, is_causal, s, lse, lse and _strict())
        if isinstance(route, _Route):
            _count(None if head_dim_v is None else PADDED)
            _local.counted = True
            try:
                o = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, lse, dropout_p, is_causal,
                                                                       False, scale=s)[0]
            finally:
                _local.counted = False
            if head_dim_v is not None:
                o = o.narrow(-1, 0, head_dim_v)
            if empty is None:
                return o
            # In place where autograd saves nothing (a copy kernel fewer); out of place where
            # the cuDNN operator's backward saves o.
            return o.masked_fill(empty, 0.0) if lse else o.masked_fill_(empty, 0.0)
        reason = route
    _count(reason)
    _local.counted = True
    try:
        return torch.ops.aten.scaled_dot_product_attention.default.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    finally:
        _local.counted = False


def _trainable_mask(query, key, value, attn_mask, dropout_p, is_causal, scale) -> torch.Tensor | str:
    """A call whose float mask requires grad (TRAINABLE_MASK), run by fastattn's dense op
    with bias_grad (its custom op, whose autograd gives the bias its gradient), counted;
    or the reason PyTorch's composite runs it (counted by the caller). The mask becomes a
    bias of cuDNN's shapes through differentiable steps (_composite_bias's -inf rows, a view of 4 dims, expanded over the queries and keys,
    rounded to the query's dtype), so autograd sums the bias's gradient back to the
    mask's own shape and dtype. Its broadcast over batch and heads is kept where cuDNN
    builds the bias gradient for it, else expanded to (batch, heads_q) (the gradient
    summed back alike); head dims padded as _padded pads them."""
    if attn_mask.dtype not in (query.dtype, torch.float32):  # (as _decide refuses one for the cuDNN operator)
        return f"attn_bias is {attn_mask.dtype}, query {query.dtype}"
    q, k, v, s, head_dim_v = _padded(query, key, value, scale)
    m, empty = _composite_bias(attn_mask, q, True)
    deterministic = _strict()
    route = None
    for lead in dict.fromkeys((tuple(m.shape[:2]), (q.shape[0], q.shape[1]))):
        bias = m.expand(*lead, q.shape[2], k.shape[2])
        bias = (bias.to(q.dtype, memory_format=torch.contiguous_format) if bias.dtype != q.dtype
                else bias.contiguous())
        route = _route(q, k, v, bias, dropout_p, is_causal, s, True, deterministic, bias_grad=True)
        if isinstance(route, _Route):
            break
    if not isinstance(route, _Route):
        return route
    _count(None if head_dim_v is None else PADDED)
    _count(MASK_GRAD)
    layout = route.layout
    ql, kl, vl = _views(layout, q, k, v)
    # Philox's seed at element 0 and offset at element 2 (fastattn's rng tensor)
    rng = torch.randint(0, 2**62, (4,), device=q.device, dtype=torch.int64) if dropout_p else None
    # The dense custom op (its autograd gives bias its gradient; its fake kernel serves a trace),
    # with the route's options: the plan the route was decided for.
    o = _to_bhsd(layout, _dense.forward_op(ql, kl, vl, None, None, bias, None, rng, *route.options)[0])
    if head_dim_v is not None:
        o = o.narrow(-1, 0, head_dim_v)
    return o.masked_fill(empty, 0.0)
