"""attention() served by shape classes (fastattn/shape_classes.py): a call whose lengths
fall in a class runs the class's plan, declared for the class's longest lengths, with the
call's own lengths given at run time. A new length inside a known class builds and loads
nothing. A class plan is one of two kinds:

- OVERRIDE (cuDNN >= 9.21, classes up to shape_classes.OVERRIDE_MAX rows, where it
  measured faster than RAGGED): the dense bshd graph built with cuDNN's shape override; each
  call gives its lengths at execute (Plan.forward's at=), and no device arrays are made.
  cuDNN reads the call's tensors in the declared storage (cudnn-frontend#1148), so only
  calls whose q, k and v lie there are served (_in_declared_storage: a decode step from a
  KV cache at least as long as the class, or buffers of the class's rows). Inference only
  (the override is forward only), not for calls with per-sequence lengths (seq_len_q) or a
  bottom-right diagonal, and not where cuDNN or the registry refuses the override graph:
  those take the RAGGED plan.
- RAGGED (every cuDNN): cuDNN's ragged (THD) graph, lengths and offsets read from device
  arrays, as follows.

Why ragged: cuDNN before 9.21 fixes a graph's dimensions when it is built; its ragged tensors
take each sequence's element offset from a device array at execute time (so the batch
stride is the call's, not the graph's), and the padding mask takes each sequence's
length from another. A bshd tensor whose tokens are packed (token stride heads * dim, head
stride dim) is such a tensor for any batch stride: offsets i * stride(0). So one plan
declared for (batch, class_q, class_kv) serves every call of that batch size with
s_q <= class_q and s_kv <= class_kv, including a KV-cache slice (its batch stride is the
cache's) whose offsets stay within the plan's batch * class tokens; a slice of a longer
cache (batch > 1) takes the smallest class that covers its offsets, else its exact plan
(_upper).

What is served: layout "bshd" (with packed tokens, for RAGGED), no bias, no sinks, plain eager calls
(torch.compile, tracing and torch.func take exact plans: their ops are exact-shape), and
calls inside a caller's CUDA graph capture, with the class plan loaded beforehand (its
offset and length arrays held for the graph's life: _held_by_captures below).
The batch is exact (a class plan per batch size): both kinds of graph fix it. These
calls take the Python path, not the op library's C++ (whose table is keyed by exact
shapes): a call costs the Python body, the per-call checks (_dense._check) and the
arrays' lookups, several microseconds more than a native hit.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

from .. import bounded, env
from ..errors import InvalidArgumentError, NotSupportedError
from .. import shape_classes as sc
from . import _executor, _specs
from ._plans import (CLOCK, DTYPES, CachedPlan, capturing, check_qkv_tensors, check_shapes, plans,
                     raw_stream, remember, workspace)

# FASTATTN_SHAPE_CLASSES, read when fastattn.torch is imported (as FASTATTN_TORCH_PATH):
# a call's shape_classes= overrides it. OFF (falsy) keeps attention()'s hot path as it was.
SETTING: str | sc.Classes = env.get("FASTATTN_SHAPE_CLASSES")

_INT32 = 2**31


class ClassOptions(NamedTuple):
    """A class plan's options: the call's DenseOptions, the class's declared lengths, and
    which kind of class plan serves it (OVERRIDE or RAGGED)."""

    dense: tuple
    upper_q: int
    upper_kv: int
    kind: str = "ragged"

    @property
    def training(self) -> bool:  # what _executor's autograd reads
        return self.dense.training


# -- the policy: which classes a call's choice means on its device ----------------------------

_auto: dict[tuple[int, bool], sc.Classes] = {}


def resolve(choice, device: int, training: bool) -> sc.Classes:
    """The classes for a call: its shape_classes= (None: SETTING), "auto" read from the
    measured file for this GPU and the loaded cuDNN (OFF where nothing was measured)."""
    global SETTING
    if choice is None:
        choice = SETTING
    elif not isinstance(choice, sc.Classes):
        choice = sc.parse(choice, "shape_classes")
    if choice != "auto":
        return choice
    key = (device, training)
    hit = _auto.get(key)
    if hit is None:
        import fastattn

        fastattn.runtime.libraries()  # cuDNN loaded, so that its version is known
        cudnn = fastattn.runtime.versions()["cudnn_loaded"] or 0
        found = sc.measured(torch.cuda.get_device_name(device), int(cudnn), training=training)
        hit = _auto[key] = found or sc.OFF
        if found is None and SETTING == "auto" and torch.cuda.device_count() == 1:
            # Nothing measured for the one GPU: "auto" is "off" for this process, and calls
            # take the native path again (attention() skips it while classes are wanted).
            SETTING = sc.OFF
    return hit


# -- the run-time arrays: lengths and offsets, made once per (device, stream, value) ----------

# (at most FASTATTN_MEMORY_MAX_ENTRIES: decode makes a length array per step)
_arrays = bounded.Table("arrays")
# Arrays made inside a caller's CUDA graph capture: its graph fills and reads them at every
# replay, for as long as it lives, which nothing here can see; so they are never freed (a
# few hundred bytes per captured call). Freed at once, the caching allocator hands the next
# array of the same call the same block: in a capture the four offset arrays of one launch
# become one array, the last one's, and the replays give wrong outputs or fault with
# "misaligned address" (tests/pytorch/test_shape_classes_gpu.py's captures check it).
_held_by_captures: list[torch.Tensor] = []


def _array(q: torch.Tensor, kind: str, b: int, value: int, stream: int) -> torch.Tensor:
    """int32 on q's device: kind "len": (b,) all `value`; "off": (b + 1,) i * value.
    Made by a kernel on the current stream and kept per stream, so a later call on the
    same stream reads it after it is written (stream order); inside a CUDA graph capture
    made fresh (the capture replays its fill) and held for good (_held_by_captures)."""
    key = (kind, q.get_device(), stream, b, value)
    t = _arrays.get(key)
    if t is not None:
        return t
    if kind == "len":
        t = torch.full((b,), value, dtype=torch.int32, device=q.device)
    else:
        # (its end b * value + 1, not (b + 1) * value: the last offset fits int32, the end may not)
        t = torch.arange(0, b * value + 1, value, dtype=torch.int32, device=q.device) if value else \
            torch.zeros(b + 1, dtype=torch.int32, device=q.device)
    if capturing():
        _held_by_captures.append(t)
    else:
        _arrays.keep(key, t)
    return t


def _check(q, k, v, seq_len_q, seq_len_kv) -> None:
    """_dense._check for bshd (the same two checks, the same messages)."""
    check_qkv_tensors(q, k, v, 4, "4 dimensions in bshd order")
    check_shapes(q, k, v, "bshd", seq_len_q, seq_len_kv)


def _packed(t: torch.Tensor) -> bool:
    """bshd with packed tokens (any batch stride), its last offset within int32."""
    _, s, h, d = t.shape
    st = t.stride()
    return (st[3] == 1 or d == 1) and (st[2] == d or h == 1) and (st[1] == h * d or s == 1) \
        and t.shape[0] * max(st[0], 1) < _INT32


def _within(t: torch.Tensor, upper: int) -> bool:
    """The tokens t's offsets span fit the plan's max_tokens (batch * upper): the plan's
    ragged tensors are declared for that many tokens, and cuDNN sizes the backward's ragged
    workspace tensors (dQ's accumulator, GQA's full-head dK, dV) by it
    (cudnn-frontend's ragged_workspace_size) and indexes them by the same offsets."""
    b, s, h, d = t.shape
    hd = h * d
    return t.stride(0) % hd == 0 and (b - 1) * (t.stride(0) // hd) + s <= b * upper


def _upper(classes: sc.Classes, t: torch.Tensor) -> int | None:
    """The declared length of the plan serving t (bshd, packed tokens), or None (its
    exact plan). Its class's, unless t's offsets run past that class's tokens (a KV-cache
    slice keeps the cache's batch stride: with batch > 1 its last sequence starts
    (b - 1) * cache_len tokens in): then the smallest class whose tokens cover them, so
    that a decode step from a long cache still runs a class plan. A one-row query keeps
    its own class (1) or takes its exact plan."""
    n = t.shape[1]
    upper = classes.upper(n)
    if upper is None or _within(t, upper):
        return upper
    if n == 1:
        return None
    return next((hi for _, hi in classes.ranges if hi > upper and _within(t, hi)), None)


# -- the plan and the work ------------------------------------------------------------------

def _key(q, k, v, options: ClassOptions) -> tuple:
    return ("class", q.shape[0], q.shape[2:], k.shape[2:], v.shape[2:], q.dtype, k.dtype, v.dtype, q.get_device(),
            k.get_device(), v.get_device(), options)


# The two kinds of class plan. RAGGED: cuDNN's ragged graph with lengths and offsets from
# device arrays (every cuDNN; packed tokens only). OVERRIDE: a dense graph built with
# cuDNN's shape override, each call giving its lengths and strides at execute (cuDNN >=
# 9.21; any bshd strides, no arrays; no per-sequence lengths).
RAGGED, OVERRIDE = "ragged", "override"
_OVERRIDE_CUDNN = 92100
_override_ok: list[bool] = []  # [whether the loaded cuDNN has the shape override], once known


def _override_available() -> bool:
    if not _override_ok:
        import fastattn

        fastattn.runtime.libraries()
        _override_ok.append((fastattn.runtime.versions()["cudnn_loaded"] or 0) >= _OVERRIDE_CUDNN)
    return _override_ok[0]


# Class plans' keys cuDNN refused: those calls take exact plans (one dropped past the cap
# is refused again at its next call, from the runtime's memory or the cache).
_refused = bounded.Table("class_refusals")


def plan_for(q, k, v, options: ClassOptions) -> CachedPlan:
    key = _key(q, k, v, options)
    hit = plans.get(key)
    if hit is not None:
        hit.used = CLOCK[0]
        return hit
    cfg = sc.class_config(
        batch=q.shape[0], heads_q=q.shape[2], heads_kv=k.shape[2], head_dim_qk=q.shape[3], head_dim_v=v.shape[3],
        dtype=DTYPES[q.dtype], upper_q=options.upper_q, upper_kv=options.upper_kv, override=options.kind == OVERRIDE,
        **_specs.config_fields(options.dense))
    return remember(key, cfg, q, k, v, None)


def _bhsd(t: torch.Tensor) -> tuple:
    """A bshd tensor's strides in (batch, head, seq, dim) order (the core's)."""
    st = t.stride()
    return (st[0], st[2], st[1], st[3])


def _at(q, k, v, o) -> tuple:
    """An override plan's call shape (Plan.forward's at=): the call's lengths, and every
    tensor at its own strides (the stats contiguous, (b, hq, s_q))."""
    return (q.shape[1], k.shape[1], _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(o))


def _dropout(rng) -> dict:
    """Philox's seed at element 0, its offset at element 2 (see _dense)."""
    return {} if rng is None else {"seed": rng.data_ptr(), "offset": rng.data_ptr() + 16}


def _forward_override(c: CachedPlan, q, k, v, rng):
    """An inference call of an OVERRIDE plan (forward only): (o, None); o the first s_q rows
    of a buffer of the declared rows (cuDNN's storage for it), contiguous (serve takes a
    batch of one, or a call of the declared rows)."""
    b, s_q, hq, _ = q.shape
    o = q.new_empty((b, c.plan.config.seqlen_q, hq, v.shape[3]))[:, :s_q]
    stream = raw_stream(c.device)
    ws = workspace(q, c.forward_workspace, c.device, stream)
    c.plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), 0, ws.data_ptr() if ws is not None else 0,
                   stream, at=_at(q, k, v, o), **_dropout(rng))
    return o, None


def _pointers(q, k, v, o_stride0: int, seq_len_q, seq_len_kv, rng, training: bool, stream: int) -> dict:
    b, s_q, hq, _ = q.shape
    ptrs = {"ragged_q": _array(q, "off", b, q.stride(0), stream).data_ptr(),
            "ragged_k": _array(q, "off", b, k.stride(0), stream).data_ptr(),
            "ragged_v": _array(q, "off", b, v.stride(0), stream).data_ptr(),
            "ragged_o": _array(q, "off", b, o_stride0, stream).data_ptr()}
    if training:  # stats packed as (b * s_q, hq): sequence i's at i * s_q * hq
        ptrs["ragged_stats"] = _array(q, "off", b, s_q * hq, stream).data_ptr()
    if seq_len_q is None:
        seq_len_q = _array(q, "len", b, s_q, stream)
        seq_len_kv = _array(q, "len", b, k.shape[1], stream)
    ptrs["seq_len_q"], ptrs["seq_len_kv"] = seq_len_q.data_ptr(), seq_len_kv.data_ptr()
    return {**ptrs, **_dropout(rng)}


def forward_impl(q, k, v, seq_len_q, seq_len_kv, rng, options: ClassOptions):
    """(o, stats): o (b, s_q, hq, dv) contiguous; stats float32 (b, s_q, hq), None when
    not training. With lengths, rows past them are zero (as _dense.forward_impl)."""
    c = plan_for(q, k, v, options)
    if options.kind == OVERRIDE:
        return _forward_override(c, q, k, v, rng)
    b, s_q, hq, _ = q.shape
    shape = (b, s_q, hq, v.shape[3])
    o = q.new_zeros(shape) if seq_len_q is not None else q.new_empty(shape)
    training = options.dense.training
    stats = q.new_empty((b, s_q, hq), dtype=torch.float32) if training else None
    stream = raw_stream(c.device)
    ws = workspace(q, c.forward_workspace, c.device, stream)
    c.plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr() if training else 0,
                   ws.data_ptr() if ws is not None else 0, stream,
                   **_pointers(q, k, v, o.stride(0), seq_len_q, seq_len_kv, rng, training, stream))
    return o, stats


def backward_impl(d_o, o, stats, q, k, v, seq_len_q, seq_len_kv, rng, options: ClassOptions):
    """A gradient or None per input (_executor.Train's backward): d_q, d_k, d_v at q's,
    k's and v's strides (the plan's offsets are shared)."""
    if _executor.deterministic_algorithms() and not options.dense.deterministic:  # (as _executor's backward_impl)
        _executor.alert_not_deterministic()
    d_o = d_o.contiguous()  # the plan reads d_o at o's (contiguous) offsets
    c = plan_for(q, k, v, options)
    d_q, d_k, d_v = (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in (q, k, v))
    if seq_len_q is not None:
        for g in (d_q, d_k, d_v):
            g.zero_()  # padded rows get zero gradients (as _dense.backward_impl)
    stream = raw_stream(c.device)
    ws = workspace(q, c.backward_workspace, c.device, stream)
    c.plan.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(),
                    d_q.data_ptr(), d_k.data_ptr(), d_v.data_ptr(), ws.data_ptr() if ws is not None else 0, stream,
                    **_pointers(q, k, v, o.stride(0), seq_len_q, seq_len_kv, rng, True, stream))
    return d_q, d_k, d_v, None, None, None


def serve(q, k, v, seq_len_q, seq_len_kv, rng, options, choice, grads: bool, return_lse: bool):
    """attention()'s result from a class plan, or None when this call is not one a class
    serves (attention() then runs it as before). options: the call's DenseOptions."""
    if options.layout != "bshd" or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return None
    classes = resolve(choice, q.get_device(), options.training)
    if not classes:
        return None
    copts = None
    # (a stride of 0, an expanded tensor's, is not one cuDNN's override takes: such calls take
    # the ragged plan's checks, which refuse it, and so their exact plan)
    # (a bottom-right diagonal neither: cudnn-frontend places it from the declared lengths, and
    # AttentionConfig refuses it beside shape_override)
    if seq_len_q is None and not options.training and not options.bottom_right \
            and min(*q.stride(), *k.stride(), *v.stride()) > 0 and _override_available():
        upper_q, upper_kv = classes.upper(q.shape[1]), classes.upper(k.shape[1])
        if upper_q is not None and upper_kv is not None and max(upper_q, upper_kv) <= sc.OVERRIDE_MAX \
                and _in_declared_storage(q, upper_q) \
                and _in_declared_storage(k, upper_kv) and _in_declared_storage(v, upper_kv) \
                and (q.shape[0] == 1 or q.shape[1] == upper_q):  # (o: the declared rows' first s_q, contiguous)
            _check(q, k, v, seq_len_q, seq_len_kv)
            copts = _class_plan(q, k, v, ClassOptions(options, upper_q, upper_kv, OVERRIDE))
    if copts is None:
        if not (_packed(q) and _packed(k) and _packed(v)):
            return None
        upper_q, upper_kv = _upper(classes, q), _upper(classes, k)
        if upper_q is None or upper_kv is None or not _within(v, upper_kv):
            return None
        if q.shape[0] * q.shape[1] * q.shape[2] * v.shape[3] >= _INT32:  # o's offsets, int32 too
            return None
        # The plan's key leaves out the lengths and batch strides, so the checks run on every call.
        _check(q, k, v, seq_len_q, seq_len_kv)
        copts = _class_plan(q, k, v, ClassOptions(options, upper_q, upper_kv, RAGGED))
        if copts is None:
            return None
    tensors = (q, k, v, seq_len_q, seq_len_kv, rng)
    if return_lse:
        if grads:
            o, stats = _executor.Train.apply(_module, copts, True, *tensors)
        else:
            o, stats = forward_impl(*tensors, copts)
        return o, stats.permute(0, 2, 1).contiguous()  # (b, s_q, hq) -> attention()'s (b, hq, s_q)
    if not options.training:
        return forward_impl(*tensors, copts)[0]
    return _executor.Train.apply(_module, copts, False, *tensors)


def _in_declared_storage(t: torch.Tensor, upper: int) -> bool:
    """t (bshd) lies where an override plan declared for `upper` rows reads it: cuDNN reads a
    call's tensors in the declared storage (cudnn-frontend#1148), so t's strides are the
    declared ones (bshd at `upper`) along every dimension of more than one element, and its
    storage holds the declared rows (cuDNN may read past the call's). A decode step's one
    query, and a batch of one's keys from a KV cache at least `upper` long, are so; a fresh
    tensor shorter than its class is not (its calls take the ragged plan)."""
    b, _, h, d = t.shape
    declared = (upper * h * d, h * d, d, 1)
    if any(n > 1 and st != want for n, st, want in zip(t.shape, t.stride(), declared)):
        return False
    span = (b - 1) * t.stride(0) + upper * h * d  # elements from t's first to the declared end
    return t.storage_offset() + span <= t.untyped_storage().nbytes() // t.element_size()


def _class_plan(q, k, v, copts: ClassOptions) -> ClassOptions | None:
    """copts where its class plan is held or loads now; None where cuDNN refused it (the
    call then takes another kind, or its exact plan)."""
    if _refused and _key(q, k, v, copts) in _refused:
        return None
    try:
        plan_for(q, k, v, copts)
    except NotSupportedError:
        # cuDNN refuses the class graph for what it builds for the exact shape (a feature it
        # does not combine with packed sequences or the shape override, or a known defect
        # whose remedy needs fixed lengths): later calls of this key skip it, for a set lookup.
        _refused.keep(_key(q, k, v, copts), True)
        return None
    except InvalidArgumentError:
        if not capturing():
            raise
        return None  # inside a capture, a class plan not loaded beforehand: the exact plan, if that was
    return copts


# What _executor.Train runs: this module's forward_impl and backward_impl (class plans run
# only in plain eager calls: there is no custom op to trace).
_module = sys.modules[__name__]
