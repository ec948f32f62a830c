"""The process-wide plan registry: probe(), plan(), preload(), the in-memory cache, stats.

Every request walks one path: memory, then the persistent cache's directories, then
a build through the one function that turns a config into a cuDNN graph
(_core.build_plan), published to the cache. In memory, exactly one thread works on a
(config, device) while the others wait for it; across processes, a per-key file lock
does the same. A refusal by cuDNN travels the same path as a plan, with its reason.
Anything wrong with a cache entry is a miss: the plan is rebuilt and the entry replaced.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from . import store
from .config import AttentionConfig
from .errors import CorruptPlanError, FastAttnError, InvalidArgumentError, NotSupportedError

__all__ = ["ProbeResult", "probe", "plan", "preload", "stats", "clear", "configure", "device_info", "versions"]

log = logging.getLogger("fastattn")


@dataclass(frozen=True)
class ProbeResult:
    """What cuDNN answered for one config on one device.

    supported: whether cuDNN built every graph the config needs (forward; backward too
      when training).
    reason: cuDNN's own message when not supported ("forward: ..." or "backward: ..."),
      else "".
    forward_workspace_size, backward_workspace_size: bytes (0 when not supported).
    forward_engine, backward_engine: cuDNN's plan names ("" when absent).
    build_seconds: wall time this call spent building or loading (0.0 from memory).
    source: "built" (cuDNN built it now), "disk" (loaded from a cache directory),
      "remote" (loaded from the Redis tier) or "memory" (this process already had it).
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
    source: str = "built"

    def __bool__(self) -> bool:
        return self.supported

    @property
    def cached(self) -> bool:
        """The answer came without a cuDNN build (from memory or disk)."""
        return self.source != "built"

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
            "source": self.source,
        }


@dataclass
class _Entry:
    done: threading.Event = field(default_factory=threading.Event)
    plan: Any = None  # _core.Plan when supported
    result: ProbeResult | None = None
    error: BaseException | None = None


_lock = threading.Lock()
_entries: dict[tuple[AttentionConfig, int], _Entry] = {}
_COUNTERS = {
    "memory_hits": 0,  # answered from this process's memory
    "disk_hits": 0,  # plans loaded from the persistent cache
    "negative_hits": 0,  # refusals answered from the persistent cache
    "misses": 0,  # not in memory nor on disk: built
    "builds": 0,  # cuDNN builds (forward and backward graphs of one config count once)
    "deserializations": 0,  # plans loaded from blobs
    "unsupported": 0,  # builds cuDNN refused
    "build_errors": 0,  # builds that raised (CUDA errors, missing libraries)
    "bad_entries": 0,  # entries that would not load (cuDNN rejected the blob): rebuilt
    "build_seconds": 0.0,
    "load_seconds": 0.0,
}
_counters = dict(_COUNTERS)
_cache: store.TieredCache | None = None
_device_descriptions: dict[int, dict[str, Any]] = {}


def _core():
    from . import _core as core
    from ._loader import ensure_loaded

    ensure_loaded()
    return core


def _count(**deltas: float) -> None:
    with _lock:
        for k, v in deltas.items():
            _counters[k] += v


def _resolve_device(device: int | None) -> int:
    core = _core()
    if device is None:
        return core.get_current_device()
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise InvalidArgumentError(f"device={device!r}: must be a CUDA device index >= 0")
    count = core.get_device_count()
    if device >= count:
        raise InvalidArgumentError(f"device={device}: this process sees {count} CUDA device(s)")
    return device


def configure(settings: store.CacheSettings | None = None) -> store.TieredCache:
    """Sets the persistent cache's settings (None: read FASTATTN_CACHE_* again).
    Plans already in memory stay."""
    global _cache
    with _lock:
        _cache = store.TieredCache(settings or store.settings_from_env())
        return _cache


def _the_cache() -> store.TieredCache:
    with _lock:
        cache = _cache
    return cache if cache is not None else configure()


def _description(config: AttentionConfig, device: int) -> dict[str, Any]:
    """The cache key's description: this process's GPU, versions and policy."""
    with _lock:
        base = _device_descriptions.get(device)
    if base is None:
        from . import __version__

        core = _core()
        info = core.get_device_info(device)
        loaded, _, frontend = core.versions()
        base = {
            "fastattn_version": __version__,
            "frontend_version": _version_string(frontend),
            "cudnn_version": loaded,
            "gpu_name": info["name"],
            "compute_capability": info["compute_capability"],
            "sm_count": info["sm_count"],
            "policy": core.policy(),
        }
        with _lock:
            _device_descriptions[device] = base
    return store.describe(config.to_dict(), env=store.build_env_vars(), **base)


def _result_from_plan(config, device, p, seconds, source) -> ProbeResult:
    return ProbeResult(config, device, True, "", p.forward_workspace_size, p.backward_workspace_size,
                       p.forward_engine or "", p.backward_engine or "", seconds, source)


def _from_disk(config: AttentionConfig, device: int, key: str, cache: store.TieredCache):
    """(plan, result) from the persistent cache, or None on a miss."""
    found = cache.get(key)
    if found is None:
        return None
    return _from_entry(config, device, key, *found)


def _from_entry(config: AttentionConfig, device: int, key: str, entry: store.Entry, tier):
    """(plan, result) from a cache entry, or None when cuDNN refuses its blobs."""
    if entry.kind == "unsupported":
        _count(negative_hits=1)
        return None, ProbeResult(config, device, False, str(entry.meta.get("reason", "")),
                                 source=_source(tier))
    core = _core()
    t0 = time.perf_counter()
    try:
        p = core.load_plan(config, device, entry.blobs.get("forward", b""), entry.blobs.get("backward"),
                           str(entry.meta.get("forward_engine", "")), str(entry.meta.get("backward_engine", "")))
    except CorruptPlanError as e:
        # Checksummed but refused by cuDNN (another build of it, a driver change): a
        # miss. The rebuild overwrites the entry.
        _count(bad_entries=1)
        log.warning("fastattn cache: entry %s in %s does not load (%s); rebuilding", key[:16], tier.root, e)
        return None
    elapsed = time.perf_counter() - t0
    _count(disk_hits=1, deserializations=1, load_seconds=elapsed)
    return p, _result_from_plan(config, device, p, elapsed, _source(tier))


def _source(tier) -> str:
    return "disk" if isinstance(tier, store.DiskStore) else "remote"


def _build(config: AttentionConfig, device: int, refresh: bool = False):
    """(plan or None, result): from the cache, else built by this process and published."""
    cache = _the_cache()
    description = _description(config, device) if cache.tiers else None
    key = store.key_of(description) if description is not None else None
    seen = cache.signature(key) if key is not None else None
    if key is not None and not refresh:
        hit = _from_disk(config, device, key, cache)
        if hit is not None:
            return hit
    lock = cache.lock(key) if key is not None else contextlib.nullcontext(False)
    with lock:
        # Another process may have published the entry while we waited for the lock.
        if key is not None and not refresh and cache.signature(key) != seen:
            hit = _from_disk(config, device, key, cache)
            if hit is not None:
                return hit
        # Another machine may be building it: wait for its entry (fleet single flight).
        flight = cache.flight(key) if key is not None and not refresh else contextlib.nullcontext(None)
        with flight as found:
            if found is not None:
                hit = _from_entry(config, device, key, found, cache.remote)
                if hit is not None:
                    return hit
            _count(misses=1)
            p, result = _build_now(config, device)
            if key is not None:
                _publish(cache, key, description, p, result)
    return p, result


def _build_now(config: AttentionConfig, device: int):
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
    return p, _result_from_plan(config, device, p, elapsed, "built")


def _publish(cache: store.TieredCache, key: str, description: dict[str, Any], p, result: ProbeResult) -> None:
    """Stores what was just built. A plan that cannot be serialized stays in memory:
    the cache never makes real work fail."""
    if p is None:
        entry = store.Entry(key, "unsupported", description, meta={"reason": result.reason}, created=time.time())
    else:
        try:
            forward, backward = p.serialize()
        except FastAttnError as e:
            log.warning("fastattn cache: cannot serialize plan %s (%s); it stays in memory only", key[:16], e)
            return
        blobs = {"forward": forward}
        if backward is not None:
            blobs["backward"] = backward
        meta = {
            "forward_engine": result.forward_engine,
            "backward_engine": result.backward_engine,
            "forward_workspace_size": result.forward_workspace_size,
            "backward_workspace_size": result.backward_workspace_size,
            "build_seconds": result.build_seconds,
        }
        entry = store.Entry(key, "plan", description, blobs, meta, created=time.time())
    cache.put(entry)


def _lookup(config: Any, device: int | None, refresh: bool = False) -> tuple[_Entry, bool]:
    """The entry for (config, device), resolving it if this thread is the first to ask.
    Returns (entry, came_from_memory)."""
    config = AttentionConfig.coerce(config)
    device = _resolve_device(device)
    key = (config, device)
    with _lock:
        entry = _entries.get(key)
        if entry is not None and refresh and entry.done.is_set():
            entry = None  # a fresh answer was asked for: replace the settled one
        owner = entry is None
        if owner:
            entry = _entries[key] = _Entry()
        else:
            _counters["memory_hits"] += 1
    if owner:
        try:
            entry.plan, entry.result = _build(config, device, refresh)
        except BaseException as e:
            # Not a verdict on the config (a CUDA error, a missing library, an interrupt):
            # forget the entry so that a later call tries again.
            entry.error = e
            with _lock:
                if _entries.get(key) is entry:
                    del _entries[key]
                _counters["build_errors"] += 1
            raise
        finally:
            entry.done.set()
        return entry, False
    entry.done.wait()
    if entry.error is not None:
        raise entry.error
    return entry, True


def probe(config: Any, *, device: int | None = None, refresh: bool = False) -> ProbeResult:
    """Does cuDNN support `config` on `device` (default: the current CUDA device)?

    Answers from memory, then the persistent cache, else builds the forward graph (and
    the backward graph when config.training) exactly as plan() and execution do, and
    remembers the answer, a refusal included. refresh=True ignores remembered answers
    and builds again (and replaces them). `config` is an AttentionConfig, a mapping of
    its fields, or its JSON.

    Never raises for a config cuDNN refuses: the result says supported=False with
    cuDNN's reason. Raises InvalidArgumentError for invalid input, LibraryError when
    cuDNN, CUDA or the driver is missing, CudaError when the device is unusable.
    """
    entry, from_memory = _lookup(config, device, refresh)
    if from_memory:
        return replace(entry.result, source="memory", build_seconds=0.0)
    return entry.result


def plan(config: Any, *, device: int | None = None):
    """The plan for `config` on `device` (default: the current CUDA device): from
    memory, else loaded from the persistent cache, else built (and stored). At most
    one build per process and config; concurrent first requests wait for it, and
    processes sharing a cache directory wait for one another.

    Raises NotSupportedError with cuDNN's reason when cuDNN refuses the config, and
    the errors probe() raises for invalid input or a missing GPU stack.
    """
    entry, _ = _lookup(config, device)
    if entry.plan is None:
        raise NotSupportedError(entry.result.reason)
    return entry.plan


def stored_answer(config: Any, *, device: int | None = None,
                  cache: store.TieredCache | None = None) -> ProbeResult | None:
    """The answer the persistent cache holds for `config` (source "disk" or
    "remote"), read without building or deserializing anything, or None. `cache`: the directories to
    look in (default: this process's). An entry found here has a valid checksum but
    is not proven to deserialize: cuDNN only says so when loading it (`fastattn cache
    verify` does)."""
    config = AttentionConfig.coerce(config)
    device = _resolve_device(device)
    cache = cache or _the_cache()
    if not cache.tiers:
        return None
    found = cache.get(store.key_of(_description(config, device)))
    if found is None:
        return None
    e, tier = found
    if e.kind == "unsupported":
        return ProbeResult(config, device, False, str(e.meta.get("reason", "")), source=_source(tier))
    m = e.meta
    try:
        sizes = int(m.get("forward_workspace_size", 0)), int(m.get("backward_workspace_size", 0))
    except (TypeError, ValueError):
        return None  # not what this version writes: let a real load decide
    return ProbeResult(config, device, True, "", *sizes, str(m.get("forward_engine", "")),
                       str(m.get("backward_engine", "")), 0.0, _source(tier))


def preload(configs: Iterable[Any] | None = None, *, device: int | None = None, threads: int = 4,
            background: bool = False):
    """Loads (or builds) plans ahead of first use, in `threads` parallel threads, each
    with its own cuDNN handle. Threads pay for training plans and not for inference
    ones: on an H200, 8 training plans (forward and backward graphs) loaded in 54 ms on
    8 threads against 93 ms one after another, while 8 inference plans took 58 ms on 8
    threads against ~51 ms on one (docs/BENCHMARKS.md). In the background
    (background=True) it overlaps whatever else the process does at startup.

    configs: the configs to load; None means every entry in the cache directories that
    was stored for this GPU, cuDNN, cudnn-frontend, fastattn and policy.
    background: return a concurrent.futures.Future at once instead of the results.
    Returns the ProbeResults (refusals included), in order. Errors of one config (a
    CUDA error) are raised from the call, or from the Future's result().
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"threads={threads!r}: must be an integer >= 1")
    device = _resolve_device(device)
    todo = [AttentionConfig.coerce(c) for c in configs] if configs is not None else _configs_in_cache(device)

    def run() -> list[ProbeResult]:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastattn-preload") as pool:
            return list(pool.map(lambda c: probe(c, device=device), todo))

    if not background:
        return run()
    future: Future = Future()

    def worker():
        try:
            future.set_result(run())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=worker, name="fastattn-preload", daemon=True).start()
    return future


def cache_environment(device: int | None = None) -> dict[str, Any]:
    """What a cache entry must have been made for to be used on `device` by this
    process: GPU, versions, policy and build variables (a key's description minus
    the config)."""
    any_config = AttentionConfig(batch=1, heads_q=1, seqlen_q=1, head_dim_qk=8)
    return store.environment_of(_description(any_config, _resolve_device(device)))


def _configs_in_cache(device: int) -> list[AttentionConfig]:
    """The configs of every cache entry stored for this device's GPU and this
    process's versions."""
    want = cache_environment(device)
    seen, out = set(), []
    for _, info in _the_cache().entries():
        desc = (info.header or {}).get("description")
        if not isinstance(desc, dict) or "config" not in desc:
            continue
        if store.environment_of(desc) != want:
            continue
        try:
            cfg = AttentionConfig.from_dict(desc["config"])
        except InvalidArgumentError:
            continue
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


def stats() -> dict[str, float]:
    """Counters of this process: memory_hits, disk_hits, negative_hits, misses,
    builds, deserializations, unsupported, build_errors, bad_entries, build_seconds,
    load_seconds, plans (in memory), and the cache directories' own counters under
    "cache" (hits, misses, corrupt, writes, write_failures, pruned)."""
    with _lock:
        out: dict[str, Any] = dict(_counters)
        out["plans"] = sum(1 for e in _entries.values() if e.plan is not None)
        cache = _cache
    out["cache"] = cache.counters() if cache is not None else {}
    return out


def clear() -> None:
    """Forgets every plan and verdict in memory (plans in use stay valid), zeroes the
    counters, and reads the cache settings again at the next use. The disk is untouched."""
    global _cache
    with _lock:
        _entries.clear()
        _counters.clear()
        _counters.update(_COUNTERS)
        _cache = None


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
        "cudnn_frontend": _version_string(frontend),
        "cudnn_headers": header,
        "cudnn_loaded": loaded or None,
    }


def _version_string(frontend: int) -> str:
    """CUDNN_FRONTEND_VERSION (major * 10000 + minor * 100 + patch) as "1.28.0"."""
    return f"{frontend // 10000}.{frontend // 100 % 100}.{frontend % 100}"
