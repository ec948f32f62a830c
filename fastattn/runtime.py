"""The process-wide plan registry: probe(), plan(), the in-memory cache and its stats.

probe() and plan() walk the same path: a config (with the device) is looked up in
memory; on a miss exactly one thread builds it, through the one function that turns
a config into a cuDNN graph (_core.build_plan), while any other thread asking for the
same config waits for that build. A refusal by cuDNN is remembered like a plan, with
cuDNN's reason, so asking again costs nothing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .config import AttentionConfig
from .errors import NotSupportedError

__all__ = ["ProbeResult", "probe", "plan", "stats", "clear", "device_info", "versions"]


@dataclass(frozen=True)
class ProbeResult:
    """What cuDNN answered for one config on one device.

    supported: whether cuDNN built every graph the config needs (forward; backward too
      when training).
    reason: cuDNN's own message when not supported ("forward: ..." or "backward: ..."),
      else "".
    forward_workspace_size, backward_workspace_size: bytes (0 when not supported).
    forward_engine, backward_engine: cuDNN's plan names ("" when absent).
    build_seconds: wall time this process spent building for this config (0.0 when
      the answer came from memory).
    cached: the answer came from this process's memory, not a build.
    """

    config: AttentionConfig
    device: int
    supported: bool
    reason: str = ""
    forward_workspace_size: int = 0
    backward_workspace_size: int = 0
    forward_engine: str = ""
    backward_engine: str = ""
    build_seconds: float = 0.0
    cached: bool = False

    def __bool__(self) -> bool:
        return self.supported

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "device": self.device,
            "supported": self.supported,
            "reason": self.reason,
            "forward_workspace_size": self.forward_workspace_size,
            "backward_workspace_size": self.backward_workspace_size,
            "forward_engine": self.forward_engine,
            "backward_engine": self.backward_engine,
            "build_seconds": self.build_seconds,
            "cached": self.cached,
        }


@dataclass
class _Entry:
    done: threading.Event = field(default_factory=threading.Event)
    plan: Any = None  # _core.Plan when supported
    result: ProbeResult | None = None
    error: BaseException | None = None


_lock = threading.Lock()
_entries: dict[tuple[AttentionConfig, int], _Entry] = {}
_counters = {"memory_hits": 0, "builds": 0, "build_seconds": 0.0, "unsupported": 0, "build_errors": 0}


def _core():
    from . import _core as core
    from ._loader import ensure_loaded

    ensure_loaded()
    return core


def _resolve_device(device: int | None) -> int:
    core = _core()
    if device is None:
        return core.get_current_device()
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"device={device!r}: must be a CUDA device index >= 0")
    return device


def _build(config: AttentionConfig, device: int) -> tuple[Any, ProbeResult]:
    core = _core()
    t0 = time.perf_counter()
    try:
        p = core.build_plan(config, device)
    except NotSupportedError as e:
        elapsed = time.perf_counter() - t0
        _count(builds=1, build_seconds=elapsed, unsupported=1)
        return None, ProbeResult(config, device, False, str(e), build_seconds=elapsed)
    elapsed = time.perf_counter() - t0
    _count(builds=1, build_seconds=elapsed)
    return p, ProbeResult(
        config,
        device,
        True,
        "",
        p.forward_workspace_size,
        p.backward_workspace_size,
        p.forward_engine or "",
        p.backward_engine or "",
        elapsed,
    )


def _count(**deltas: float) -> None:
    with _lock:
        for k, v in deltas.items():
            _counters[k] += v


def _lookup(config: Any, device: int | None) -> tuple[_Entry, bool]:
    """The entry for (config, device), building it if this thread is the first to ask.
    Returns (entry, came_from_memory)."""
    config = AttentionConfig.coerce(config)
    device = _resolve_device(device)
    key = (config, device)
    with _lock:
        entry = _entries.get(key)
        owner = entry is None
        if owner:
            entry = _entries[key] = _Entry()
        else:
            _counters["memory_hits"] += 1
    if owner:
        try:
            entry.plan, entry.result = _build(config, device)
        except BaseException as e:
            # Not a verdict on the config (a CUDA error, a missing library, an interrupt):
            # forget the entry so that a later call tries again.
            entry.error = e
            with _lock:
                _entries.pop(key, None)
                _counters["build_errors"] += 1
            raise
        finally:
            entry.done.set()
        return entry, False
    entry.done.wait()
    if entry.error is not None:
        raise entry.error
    return entry, True


def probe(config: Any, *, device: int | None = None) -> ProbeResult:
    """Does cuDNN support `config` on `device` (default: the current CUDA device)?

    Builds the forward graph, and the backward graph when config.training, exactly as
    plan() and execution do, and remembers the answer (and the plan) for the process.
    `config` is an AttentionConfig, a mapping of its fields, or its JSON.

    Never raises for a config cuDNN refuses: the result says supported=False with
    cuDNN's reason. Raises InvalidArgumentError for invalid input, LibraryError when
    cuDNN, CUDA or the driver is missing, CudaError when the device is unusable.
    """
    entry, cached = _lookup(config, device)
    if cached:
        return _replace(entry.result, cached=True, build_seconds=0.0)
    return entry.result


def plan(config: Any, *, device: int | None = None):
    """The built plan for `config` on `device` (default: the current CUDA device),
    built at most once per process. Thread-safe: concurrent first requests for the
    same config cause one build.

    Raises NotSupportedError with cuDNN's reason when cuDNN refuses the config, and
    the errors probe() raises for invalid input or a missing GPU stack.
    """
    entry, _ = _lookup(config, device)
    if entry.plan is None:
        raise NotSupportedError(entry.result.reason)
    return entry.plan


def _replace(result: ProbeResult, **changes: Any) -> ProbeResult:
    from dataclasses import replace

    return replace(result, **changes)


def stats() -> dict[str, float]:
    """Counters of this process: memory_hits, builds, build_seconds, unsupported
    (builds cuDNN refused), build_errors (builds that raised), plans (in memory)."""
    with _lock:
        out = dict(_counters)
        out["plans"] = sum(1 for e in _entries.values() if e.plan is not None)
    return out


def clear() -> None:
    """Forgets every plan and verdict in memory (plans in use stay valid) and zeroes the counters."""
    with _lock:
        _entries.clear()
        for k in _counters:
            _counters[k] = 0.0 if isinstance(_counters[k], float) else 0


def device_info(device: int | None = None) -> dict[str, Any]:
    """Name, compute capability, SM count and driver/runtime versions of a CUDA device."""
    return _core().get_device_info(_resolve_device(device))


def versions() -> dict[str, Any]:
    """fastattn's version, the cudnn-frontend and cuDNN headers it was built against,
    and the cuDNN loaded at run time (None before the first GPU call)."""
    from . import __version__, _core as core

    loaded, header, frontend = core.versions()
    return {
        "fastattn": __version__,
        "cudnn_frontend": f"{frontend // 10000}.{frontend // 100 % 100}.{frontend % 100}",
        "cudnn_headers": header,
        "cudnn_loaded": loaded or None,
    }
