"""The process-wide plan registry: probe(), plan(), preload(), the in-memory cache, stats.

Every request walks one path: memory, then the persistent cache's directories, then
a build through the one function that turns a config into a cuDNN graph
(_core.build_plan), published to the cache. In memory, exactly one thread works on a
(config, device) while the others wait for it; across processes, a per-key file lock
does the same. A refusal by cuDNN travels the same path as a plan, with its reason.
Anything wrong with a cache entry is a miss: the plan is rebuilt and the entry replaced.

This module keeps the registry only: what a config is called in the cache, how an entry
becomes a plan and a plan an entry, is fastattn.plan_cache (the process's PlanCache is
plan_cache()).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Mapping, Union, overload

from . import _record, bounded, defects, store
from ._version import __version__
from ._fields import check, show
from .config import AttentionConfig
from .errors import InvalidArgumentError, NotSupportedError, VerificationFailedError
from .plan_cache import PlanCache, version_string
from .result import ProbeResult, result_from_plan

if TYPE_CHECKING:
    from ._core import Plan

# What probe(), plan() and preload() take as a config: an AttentionConfig, a mapping of
# its fields or its JSON (AttentionConfig.coerce).
ConfigLike = Union[AttentionConfig, Mapping[str, Any], str]

__all__ = ["ProbeResult", "probe", "plan", "preload", "stats", "clear", "configure", "device_info", "versions",
           "libraries", "plan_cache", "open_plan_cache", "stored_answer", "cache_environment"]


@dataclass
class _Entry:
    done: threading.Event = field(default_factory=threading.Event)
    plan: Any = None  # _core.Plan when supported
    result: ProbeResult | None = None
    error: BaseException | None = None
    verifying: threading.Lock = field(default_factory=threading.Lock)  # one verification at a time
    # Loaded ahead of use (preload) and not asked for since: its first use is the one
    # that goes into FASTATTN_RECORD and the entry's last use (_claim), so that loading
    # everything ahead neither records it all nor makes it all look just used.
    ahead: bool = False
    # The cache key it was loaded from ahead of use (load_ahead, preload), which its first use
    # touches: that use then computes no key (a description of the GPU, versions and environment).
    key: str | None = None
    # A load ahead of use (load_ahead) that found nothing to load: never an answer. Whoever
    # waited for it asks again, as the first asker (builds it, or finds it built meanwhile).
    abandoned: bool = False
    used: int = 0  # _clock at its last use: the least used go first past the cap (_keep)


_lock = threading.Lock()
# At most FASTATTN_MEMORY_MAX_ENTRIES (fastattn.bounded): _keep adds an entry and trims.
_entries: dict[tuple[AttentionConfig, int], _Entry] = {}
_clock = [0]  # advanced by every entry _keep adds (bounded.tick); a use stamps its entry with _clock[0]
# Bumped by clear(): a load ahead of use that began before it keeps nothing it loads.
_generation = 0
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
    "verifications": 0,  # plans run against the reference (verify=True) by this process
    "verification_failures": 0,  # of those, plans refused on the evidence
    "verify_seconds": 0.0,
    "build_seconds": 0.0,
    "load_seconds": 0.0,
}
_counters = dict(_COUNTERS)
# Calls an integration ran outside fastattn's kernels (its PyTorch fallback), by integration
# and reason: what stats() reports under "fallbacks".
_fallbacks: dict[str, dict[str, int]] = {}
_warned = bounded.Table("warnings")  # the messages warn_once gave
_log = logging.getLogger("fastattn")
_cache: PlanCache | None = None
# What runs a plan against the reference: fastattn.verify.verify_plan(plan, config,
# device) -> Verdict, looked up at each use (tests replace it, as they replace _core).
_verify: Any = None


def _core():
    from ._loader import ensure_loaded, import_core

    core = import_core()  # (first: a checkout without its extension says so, not what libraries are missing)
    ensure_loaded()
    return core


def _count(**deltas: float) -> None:
    with _lock:
        for k, v in deltas.items():
            _counters[k] += v


# Counters other parts of fastattn keep and stats() reports under their name (the SDPA
# mode's "sdpa", registered when fastattn.torch is imported): name -> (read, reset).
_sources: dict[str, tuple[Callable[[], Any], Callable[[], None]]] = {}


def register_stats(name: str, read: Callable[[], Any], reset: Callable[[], None]) -> None:
    """Report read() under `name` in stats(), and call reset() in clear()."""
    _sources[name] = (read, reset)


def warn_once(message: str) -> None:
    """A warning of the "fastattn" logger, the first time this message is given (until
    clear()): for what happens call after call (a fallback, a reason the SDPA mode stands
    aside), which must never be silent and must never flood a log."""
    bounded.max_entries()  # (read outside the lock: a bad value raises before anything changes)
    with _lock:
        first = message not in _warned
        if first:
            _warned.keep(message, True)
    if first:
        _log.warning("%s", message)


def count_fallback(integration: str, reason: str) -> None:
    """One call an integration (its name, e.g. "transformers") ran outside fastattn's
    kernels, and why (cuDNN's reason, or the integration's; a refusal's whole message).
    Counted in stats()'s "fallbacks" under the reason's first line, with the names of
    the known cuDNN gaps it notes (fastattn.defects.GAPS); the first call of each
    reason is logged (warn_once)."""
    bounded.max_entries()  # (as warn_once)
    lines = reason.split("\n")
    gaps = [ln.split(":", 1)[0].removeprefix("known cuDNN gap ") for ln in lines[1:]
            if ln.startswith("known cuDNN gap ")]
    reason = lines[0].rstrip() + "".join(f" (known cuDNN gap {g})" for g in gaps)
    with _lock:
        bounded.count_reason(_fallbacks.setdefault(integration, {}), reason)
    warn_once(f"fastattn.integrations.{integration}: a call runs outside fastattn's kernels (counted in "
              f"fastattn.stats()['fallbacks']): {reason}")


def check_device(device: Any) -> int | None:
    """`device` as every entry point takes it, checked before anything is loaded (so that
    a bad one is an InvalidArgumentError naming it even where the GPU stack is missing):
    None (the current device) or a CUDA device index. Its range: _resolve_device."""
    if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
        raise InvalidArgumentError(f"device={show(device)}: must be a CUDA device index >= 0 (an int) or None")
    return device


def check_configs(configs: Any, name: str = "configs") -> list[AttentionConfig]:
    """A list of configs as preload() and fastattn.warm.warm() take it: an iterable of
    ConfigLike (never one config: a str, a mapping or an AttentionConfig iterates as
    something else), each coerced; an error names the one that is not a config."""
    if isinstance(configs, (str, bytes, bytearray, Mapping, AttentionConfig)) or not hasattr(configs, "__iter__"):
        raise InvalidArgumentError(f"{name}={show(configs)}: must be an iterable of configs (one config: [config])")
    out = []
    for i, c in enumerate(configs):
        try:
            out.append(AttentionConfig.coerce(c))
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"{name}[{i}]: {e}") from None
    return out


def _resolve_device(device: int | None) -> int:
    check_device(device)
    core = _core()
    if device is None:
        return core.get_current_device()
    count = core.get_device_count()
    if device >= count:
        raise InvalidArgumentError(f"device={device}: this process sees {count} CUDA device(s)")
    return device


def open_plan_cache(settings: store.CacheSettings | None = None, gpu: Mapping[str, Any] | None = None) -> PlanCache:
    """A PlanCache over `settings` (None: the FASTATTN_CACHE_* variables now) that loads
    and describes plans with this process's GPU stack and counts into stats(). Not made
    the process's cache (configure() does that). gpu: PlanCache's, for keys of a GPU
    that is not this process's (fastattn.target)."""
    if settings is not None and not isinstance(settings, store.CacheSettings):
        raise InvalidArgumentError(f"settings={show(settings)}: must be a fastattn.store.CacheSettings "
                                   "(fastattn.store.settings_from_env() makes one) or None")
    # The lambda looks _core up at each use: tests replace it with a fake.
    return PlanCache(settings or store.settings_from_env(), core=lambda: _core(), count=_count, gpu=gpu)


def configure(settings: store.CacheSettings | None = None) -> PlanCache:
    """Sets the persistent cache's settings (None: read FASTATTN_CACHE_* again).
    Plans already in memory stay."""
    global _cache
    cache = open_plan_cache(settings)
    with _lock:
        _cache = cache
    return cache


def plan_cache() -> PlanCache:
    """This process's persistent plan cache (made from FASTATTN_CACHE_* at first use):
    its tiers are plan_cache().store."""
    with _lock:
        cache = _cache
    return cache if cache is not None else configure()


def _build(config: AttentionConfig, device: int, refresh: bool = False, touch: bool = True):
    """(plan or None, result, the cache key or None where there is no cache): from the cache
    (touch=False: leaving the entry's last use as it was), else built by this process and
    published."""
    cache = plan_cache()
    tiers = cache.store
    description = cache.describe(config, device) if tiers.tiers else None
    key = store.key_of(description) if description is not None else None
    seen = tiers.signature(key) if key is not None else None
    if key is not None and not refresh:
        hit = cache.lookup(config, device, key, touch)
        if hit is not None:
            return (*hit, key)
    lock = tiers.lock(key) if key is not None else contextlib.nullcontext(False)
    with lock:
        # Another process may have published the entry while we waited for the lock.
        if key is not None and not refresh and tiers.signature(key) != seen:
            hit = cache.lookup(config, device, key, touch)
            if hit is not None:
                return (*hit, key)
        # Another machine may be building it: wait for its entry (fleet single flight).
        flight = tiers.flight(key) if key is not None and not refresh else contextlib.nullcontext(None)
        with flight as found:
            if found is not None:
                hit = cache.load(config, device, key, found, tiers.remote)
                if hit is not None:
                    return (*hit, key)
            _count(misses=1)
            p, result = _build_now(config, device)
            if key is not None:
                cache.publish(key, description, p, result)
    return p, result, key


def _build_now(config: AttentionConfig, device: int):
    core = _core()
    t0 = time.perf_counter()
    try:
        p = core.build_plan(config, device)
    except NotSupportedError as e:
        elapsed = time.perf_counter() - t0
        _count(builds=1, build_seconds=elapsed, unsupported=1)
        return None, ProbeResult(config, device, False, _with_gap_notes(str(e), config, device), build_seconds=elapsed)
    elapsed = time.perf_counter() - t0
    _count(builds=1, build_seconds=elapsed)
    return p, result_from_plan(config, device, p, elapsed, "built")


def _with_gap_notes(reason: str, config: AttentionConfig, device: int) -> str:
    """cuDNN's reason, with the notes of the known gaps (fastattn.defects.GAPS) that
    explain it on this cuDNN and GPU: the verdict stays cuDNN's."""
    core = _core()
    notes = defects.refusal_notes(config, core.versions()[0], tuple(core.get_device_info(device)["compute_capability"]))
    return "\n".join([reason, *notes])


def _lookup(config: Any, device: int | None, refresh: bool = False, ahead: bool = False) -> tuple[_Entry, bool]:
    """The entry for (config, device), resolving it if this thread is the first to ask.
    Returns (entry, came_from_memory). ahead=True: a load ahead of use (preload), which
    leaves the record and the entry's last use to the first call that uses it."""
    config = AttentionConfig.coerce(config)
    bounded.max_entries()  # (read first: a bad value raises before any library loads or anything changes)
    device = _resolve_device(device)
    key = (config, device)
    dropped: list[_Entry] = []
    while True:
        with _lock:
            entry = _entries.get(key)
            if entry is not None and refresh and entry.done.is_set():
                entry = None  # a fresh answer was asked for: replace the settled one
            owner = entry is None
            if owner:
                entry = _Entry()
                dropped = _keep(key, entry)
            else:
                entry.used = _clock[0]
        if owner or not _waited_in_vain(entry):
            break
    del dropped  # (their plans released outside the lock)
    if owner:
        entry.ahead = ahead
        try:
            if not ahead:
                _record.note(config)
            entry.plan, entry.result, key_found = _build(config, device, refresh, touch=not ahead)
            if ahead:
                entry.key = key_found  # (its first use touches it: _claim computes no key)
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
    _count(memory_hits=1)
    if entry.error is not None:
        raise entry.error
    if entry.ahead and not ahead:
        _claim(entry, config, device)
    return entry, True


def _keep(key: tuple[AttentionConfig, int], entry: _Entry) -> list[_Entry]:
    """Under _lock: entry kept under key, used now; past the cap (fastattn.bounded) the
    least recently used settled entries are dropped (one in flight is some thread's work,
    which others may be waiting for) and returned, for the caller to release after the
    lock. A dropped plan stays valid where it is held (a thread, fastattn.torch's
    tables, a captured CUDA graph); its next request loads it again."""
    entry.used = bounded.tick(_clock)
    _entries[key] = entry
    drop = bounded.trim_to(len(_entries))
    if not drop:
        return []
    victims = bounded.least_used(((k, e.used) for k, e in _entries.items() if e.done.is_set()), drop)
    bounded.evicted("plans", len(victims))
    return [_entries.pop(k) for k in victims]


def _waited_in_vain(entry: _Entry) -> bool:
    """Waits for another thread's work on `entry`; True when that was a load ahead of
    use that found nothing (the caller then asks again)."""
    entry.done.wait()
    return entry.abandoned


def load_ahead(config: AttentionConfig, device: int, cache: PlanCache, key: str) -> bool:
    """Loads the plan stored under `key` in `cache` into memory ahead of use (the
    warm-up): never builds, never waits for a build, never touches the entry's last use
    or FASTATTN_RECORD (the first call that uses it does: _claim). A call that asks for
    the same plan meanwhile waits for this load alone; when it finds nothing (a miss, an
    entry cuDNN will not load, an error), that call goes on as if it had asked first.
    Returns whether a plan or a refusal is now held for it; False also where one was
    already held or asked for, or clear() ran meanwhile."""
    bounded.max_entries()  # (as _lookup)
    with _lock:
        if (config, device) in _entries:
            return False
        entry = _Entry(ahead=True, key=key)
        dropped = _keep((config, device), entry)
        generation = _generation
    del dropped
    found = None
    try:
        found = cache.lookup(config, device, key, touch=False)
    except Exception as e:  # an optimization: the call that needs it loads it and reports
        _log.debug("fastattn warm-up: %s was not loaded (%s: %s)", key[:16], type(e).__name__, e)
    with _lock:
        kept = found is not None and _generation == generation and _entries.get((config, device)) is entry
        if kept:
            entry.plan, entry.result = found
        else:
            entry.abandoned = True
            if _entries.get((config, device)) is entry:
                del _entries[(config, device)]
    entry.done.set()
    return kept


def load_kernels(config: AttentionConfig, device: int, max_bytes: int) -> Literal["loaded", "too large", "no plan"]:
    """Loads the kernels of the plan held in memory for (config, device) (Plan.load_kernels:
    one launch of each graph on scratch, on a stream of its own), where the larger of its
    graphs takes at most `max_bytes` of tensors and workspace: for the warm-up, after
    load_ahead, so that the plan's first launch on the caller's path loads none. Never
    builds or loads a plan.
    Returns "loaded", "too large" (over max_bytes: not launched) or "no plan" (none held: a
    refusal, one dropped meanwhile, or none loaded); raises what the launch raised."""
    with _lock:
        entry = _entries.get((config, device))
        plan = entry.plan if entry is not None and entry.done.is_set() else None
    if plan is None:
        return "no plan"
    from ._arrays import scratch_bytes

    names = _core().SLOT_NAMES
    need = sum(scratch_bytes(config, names, False)) + plan.forward_workspace_size
    if config.training:  # the graphs run one after the other, each on scratch of its own
        need = max(need, sum(scratch_bytes(config, names, True)) + plan.backward_workspace_size)
    if need > max_bytes:
        return "too large"
    plan.load_kernels()
    return "loaded"


def pass_on_handle(device: int) -> None:
    """Hands the calling thread's cuDNN handle for `device` to the next thread that needs
    one (its first launch then skips cudnnCreate): for a thread done with cuDNN there."""
    _core().pass_on_handle(device)


def _claim(entry: _Entry, config: AttentionConfig, device: int) -> None:
    """The first use of a plan loaded ahead of use: what its load left undone (the
    record, the entry's last use), once."""
    with _lock:
        first, entry.ahead = entry.ahead, False
    if not first:
        return
    _record.note(config)
    cache = plan_cache()
    if cache.store.tiers:
        cache.store.touch(entry.key or store.key_of(cache.describe(config, device)))


def _verifier():
    if _verify is not None:
        return _verify
    from .verify import verify_plan

    return verify_plan


def _answer(config: Any, device: int | None, refresh: bool = False, verify: bool = False,
            ahead: bool = False) -> tuple[_Entry, bool]:
    """_lookup, then (verify=True) the plan verified unless its answer carries a
    verdict already (from this process, or stored with the cache entry)."""
    check("bool", "refresh", refresh)
    check("bool", "verify", verify)
    entry, from_memory = _lookup(config, device, refresh, ahead)
    if verify and entry.plan is not None and entry.result.verdict is None:
        _ensure_verified(entry, AttentionConfig.coerce(config), _resolve_device(device))
    return entry, from_memory


def _ensure_verified(entry: _Entry, config: AttentionConfig, device: int) -> None:
    """Runs the plan once against the reference and keeps the verdict with the answer,
    in memory and in the cache entry. A failed plan becomes a refusal carrying the
    evidence: never served again by this process, nor by any that reads the entry.
    Errors of the verifier itself (no PyTorch, a CUDA error) leave the answer as it was."""
    with entry.verifying:
        p, result = entry.plan, entry.result
        if p is None or result.verdict is not None:  # another thread verified it meanwhile
            return
        t0 = time.perf_counter()
        verdict = _verifier()(p, config, device)
        failed = verdict.status == "failed"
        _count(verifications=1, verification_failures=int(failed), verify_seconds=time.perf_counter() - t0)
        if failed:
            result = ProbeResult(config, device, False, verdict.reason, build_seconds=result.build_seconds,
                                 source=result.source, avoided=result.avoided, verdict=verdict)
        else:
            result = replace(result, verdict=verdict)
        cache = plan_cache()
        if cache.store.tiers:
            description = cache.describe(config, device)
            cache.publish(store.key_of(description), description, None if failed else p, result)
        with _lock:
            entry.result = result
            if failed:
                entry.plan = None


def _refusal(result: ProbeResult) -> NotSupportedError:
    if result.verdict is not None and result.verdict.status == "failed":
        return VerificationFailedError(result.reason, result.verdict)
    return NotSupportedError(result.reason)


def probe(config: ConfigLike, *, device: int | None = None, refresh: bool = False,
          verify: bool = False) -> ProbeResult:
    """Does cuDNN support `config` on `device` (default: the current CUDA device)?

    Answers from memory, then the persistent cache, else builds the forward graph (and
    the backward graph when config.training) exactly as plan() and execution do, and
    remembers the answer, a refusal included. refresh=True ignores remembered answers
    and builds again (and replaces them). `config` is an AttentionConfig, a mapping of
    its fields, or its JSON.

    verify=True: also run the plan once on random and adversarial data against a
    float32 reference on the GPU (fastattn.verify; needs PyTorch), unless its answer
    carries a verdict already; the verdict is stored with the cache entry
    (result.verdict). A plan that fails is refused: supported=False, the evidence as
    the reason, remembered like cuDNN's refusals (and refused to later calls without
    verify too).

    Never raises for a config cuDNN refuses: the result says supported=False with
    cuDNN's reason. Raises InvalidArgumentError for invalid input (and for verify=True
    without PyTorch), LibraryError when cuDNN, CUDA or the driver is missing,
    CudaError when the device is unusable.
    """
    return _result(*_answer(config, device, refresh, verify))


def _result(entry: _Entry, from_memory: bool) -> ProbeResult:
    """probe's answer: the entry's, said to come from memory when it did."""
    return replace(entry.result, source="memory", build_seconds=0.0) if from_memory else entry.result


def plan(config: ConfigLike, *, device: int | None = None, verify: bool = False) -> Plan:
    """The plan for `config` on `device` (default: the current CUDA device): from
    memory, else loaded from the persistent cache, else built (and stored). At most
    one build per process and config; concurrent first requests wait for it, and
    processes sharing a cache directory wait for one another.

    verify=True: the plan is verified first, as probe(verify=True) does.

    Raises NotSupportedError with cuDNN's reason when cuDNN refuses the config
    (VerificationFailedError, a subclass carrying `verdict`, when the plan failed
    verification, now or when its entry was stored), and the errors probe() raises
    for invalid input or a missing GPU stack.
    """
    entry, _ = _answer(config, device, verify=verify)
    if entry.plan is None:
        raise _refusal(entry.result)
    return entry.plan


def planned(config: ConfigLike, *, device: int | None = None, wait: bool = False) -> Plan | None:
    """The plan for `config` on `device` if this process already holds it, else None:
    never loads or builds (what a caller that must not touch cuDNN now can ask, inside a
    CUDA-graph capture say). wait=True: a plan another thread is loading or building is
    waited for (a wait on the host, no CUDA call on this thread), else None is answered
    at once. Raises NotSupportedError with cuDNN's reason when the answer held is a
    refusal."""
    check("bool", "wait", wait)
    config = AttentionConfig.coerce(config)
    with _lock:
        entry = _entries.get((config, _resolve_device(device)))
        if entry is not None:
            entry.used = _clock[0]
    if entry is not None and wait:
        entry.done.wait()
    if entry is None or not entry.done.is_set() or entry.error is not None or entry.abandoned:
        return None
    if entry.ahead:
        _claim(entry, config, _resolve_device(device))
    if entry.plan is None:
        raise _refusal(entry.result)
    return entry.plan


def stored_answer(config: ConfigLike, *, device: int | None = None, cache: PlanCache | None = None) -> ProbeResult | None:
    """The answer the persistent cache holds for `config` (source "disk" or
    "remote"), read without building or deserializing anything, or None. `cache`: the
    cache to look in (default: this process's); see PlanCache.stored_answer."""
    config = AttentionConfig.coerce(config)
    return (cache or plan_cache()).stored_answer(config, _resolve_device(device))


# What PyTorch imports at a process's first backward given a gradient tensor
# (torch.autograd._make_grads): sympy, with symbolic shapes. Measured with
# benchmarks/bench_coldstart.py under cProfile: nearly all of a first backward, for
# every peer alike, most of it compiling sympy's .py files where pip installed them
# without .pyc, much less where the .pyc files exist (docs/BENCHMARKS.md, "Cold start";
# the profile: docs/history/benchmarks-log.md, "Cold start with autograd").
TORCH_BACKWARD_IMPORT = "torch.fx.experimental.symbolic_shapes"
_torch_import_started = False


def warm_torch_backward() -> bool:
    """Starts PyTorch's first-backward import (TORCH_BACKWARD_IMPORT) in a daemon thread,
    once per process, where torch is imported and that module is not: called when
    fastattn.torch looks up a plan for tensors that require gradients, or preloads
    training configs, so that the import overlaps what the process does meanwhile
    (loading a model or data; an import holds the GIL while it compiles, so Python-bound
    work gains nothing) instead of stalling the first backward. Returns whether it
    started one."""
    global _torch_import_started
    if _torch_import_started or "torch" not in sys.modules or TORCH_BACKWARD_IMPORT in sys.modules:
        return False
    _torch_import_started = True

    def work():
        try:
            importlib.import_module(TORCH_BACKWARD_IMPORT)
        except Exception:  # an optimization: the first backward imports it anyway, and reports
            pass

    threading.Thread(target=work, name="fastattn-torch-backward-import", daemon=True).start()
    return True


# The result's type follows background (for type checkers).
@overload
def preload(configs: Iterable[ConfigLike] | None = ..., *, device: int | None = ..., threads: int = ...,
            background: Literal[False] = ..., verify: bool = ...) -> list[ProbeResult]: ...
@overload
def preload(configs: Iterable[ConfigLike] | None = ..., *, device: int | None = ..., threads: int = ...,
            background: Literal[True], verify: bool = ...) -> Future[list[ProbeResult]]: ...
@overload
def preload(configs: Iterable[ConfigLike] | None = ..., *, device: int | None = ..., threads: int = ...,
            background: bool = ..., verify: bool = ...) -> list[ProbeResult] | Future[list[ProbeResult]]: ...


def preload(configs: Iterable[ConfigLike] | None = None, *, device: int | None = None, threads: int = 4,
            background: bool = False, verify: bool = False) -> list[ProbeResult] | Future[list[ProbeResult]]:
    """Loads (or builds) plans ahead of first use, in `threads` parallel threads, each
    with its own cuDNN handle. Threads pay for training plans (forward and backward
    graphs) and not for inference ones (docs/history/benchmarks-log.md, "Persistent
    cache"). In the background (background=True) it overlaps whatever else
    the process does at startup.

    configs: the configs to load; None means every entry in the cache directories that
    was stored for this GPU, cuDNN, cudnn-frontend, fastattn and policy, the most
    recently used first.
    background: return a concurrent.futures.Future at once instead of the results.
    verify: verify each plan first, as probe(verify=True) does (a plan that fails is
      refused: its result says so, with the evidence).
    Returns the ProbeResults (refusals included), in order. Errors of one config (a
    CUDA error) are raised from the call, or from the Future's result().
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"threads={show(threads)}: must be an integer >= 1")
    check("bool", "background", background)
    check("bool", "verify", verify)
    given = check_configs(configs) if configs is not None else None  # all arguments before any library loads
    device = _resolve_device(device)  # the caller's current device (a thread's own)
    cache = plan_cache() if given is None else None  # its settings read (and refused) here

    def one(config: AttentionConfig) -> ProbeResult:  # probe(), as a load ahead of use
        return _result(*_answer(config, device, verify=verify, ahead=True))

    def run() -> list[ProbeResult]:
        # Listing the cache reads every entry's header: in the background, the worker's.
        todo = given if cache is None else cache.configs(device)
        if "fastattn.torch" in sys.modules and any(c.training for c in todo):
            # A user of the autograd path: its first backward will import sympy. Not for raw
            # plan users: measured, the import's GIL contention slowed a raw warm+preload
            # start several times over (benchmarks/bench_coldstart.py on the H200;
            # docs/history/benchmarks-log.md, "Cold start with autograd").
            warm_torch_backward()
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastattn-preload") as pool:
            return list(pool.map(one, todo))

    if not background:
        return run()
    future: Future[list[ProbeResult]] = Future()

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
    return plan_cache().environment(_resolve_device(device))


def stats() -> dict[str, float]:
    """Counters of this process: memory_hits, disk_hits, negative_hits, misses,
    builds, deserializations, unsupported, build_errors, bad_entries, verifications,
    verification_failures, verify_seconds, build_seconds, load_seconds, plans (in memory), and the cache directories' own counters under
    "cache" (hits, misses, corrupt, writes, write_failures, pruned). "fallbacks": the calls
    each integration ran outside fastattn's kernels, by reason ({"transformers": {reason:
    calls}}; empty when none did). "sdpa" (once fastattn.torch is imported): the SDPA mode's
    calls on CUDA while it is on, {"served": calls fastattn ran, "head_dim_padded": those of
    them whose head dims it padded to multiples of 8, "mask_grad": those whose mask
    required grad, "passed_on": {reason: calls PyTorch's kernels ran}}, whichever backend
    PyTorch would have picked. (Reasons may quote shapes: past FASTATTN_MEMORY_MAX_ENTRIES of them, each further one is counted
    under fastattn.bounded.OTHER_REASONS.) "warm_up" (once
    fastattn.torch is imported): the background warm-up's state, devices, plans loaded
    and seconds, and where it is off, the reason (fastattn/_warm_up.py). "evictions": the
    entries each in-memory table keyed by shape dropped past FASTATTN_MEMORY_MAX_ENTRIES
    (fastattn.bounded): {"plans": this registry's plans and refusals, "torch_calls":
    fastattn.torch's Python table of plans per call signature, "native_calls": the op
    library's C++ one, "sdpa_routes": the SDPA mode's routes per call signature, "arrays":
    length and offset arrays kept per shape, "class_refusals": shape-class plans cuDNN
    refused, "recorded": configs FASTATTN_RECORD wrote, "warnings": messages warn_once
    gave}; a dropped plan is loaded again when asked for."""
    with _lock:
        out: dict[str, Any] = dict(_counters)
        out["plans"] = sum(1 for e in _entries.values() if e.plan is not None)
        out["fallbacks"] = {name: dict(reasons) for name, reasons in _fallbacks.items()}
        cache = _cache
    for name, (read, _) in list(_sources.items()):
        out[name] = read()
    out["cache"] = cache.store.counters() if cache is not None else {}
    out["evictions"] = bounded.evictions()
    return out


def clear() -> None:
    """Forgets every plan and verdict in memory (plans in use stay valid), zeroes the
    counters, and reads the cache settings again at the next use. The disk is untouched."""
    global _cache, _generation
    with _lock:
        _generation += 1
        _entries.clear()
        _counters.clear()
        _counters.update(_COUNTERS)
        _fallbacks.clear()
        _warned.clear()
        _cache = None
    for _, reset in list(_sources.values()):
        reset()
    bounded.reset()


def _after_fork_in_child() -> None:
    # The child has only the forking thread: a plan another thread was loading or building
    # will never be finished here, and the lock may have been copied held. (CUDA itself is
    # unusable in a child forked after the parent made a context: this keeps the rest sound.)
    global _lock
    _lock = threading.Lock()
    for key in [k for k, e in _entries.items() if not e.done.is_set()]:
        del _entries[key]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=lambda: _lock.acquire(), after_in_parent=lambda: _lock.release(),
                        after_in_child=_after_fork_in_child)


def device_info(device: int | None = None) -> dict[str, Any]:
    """Name, compute capability, SM count and driver/runtime versions of a CUDA device."""
    device = _resolve_device(device)  # (first: it checks the argument before loading anything)
    return _core().get_device_info(device)


def libraries() -> dict[str, str]:
    """Where cuDNN ("cudnn") and what it needs ("cudart", "nvrtc", "cublasLt") were
    loaded from, loading them first where no GPU call has yet (once per process).
    Raises LibraryError (an OSError) naming each missing piece, or a cuDNN too old."""
    from ._loader import ensure_loaded

    libs = ensure_loaded()
    return {"cudnn": libs.cudnn, "cudart": libs.cudart, "nvrtc": libs.nvrtc, "cublasLt": libs.cublaslt}


def cudnn_location() -> dict[str, str | None]:
    """Which libcudnn the first GPU call would load and why, loading nothing (the wheel,
    its version, the file): what `fastattn info` says on a machine without a GPU too."""
    from ._loader import cudnn_location as find

    return find()


def installed_cudnn_version() -> int | None:
    """cuDNN's version number (92400 for 9.24.0) of the wheel the first GPU call would load
    (cudnn_location's), loading nothing; None where no wheel says (FASTATTN_CUDNN_PATH, a
    system cuDNN): what a process without a driver knows of the cuDNN its build workers load."""
    from ._loader import version_number

    return version_number(cudnn_location().get("wheel_version"))


def cudnn_in_process() -> dict[str, Any]:
    """The cuDNN files this process holds (once fastattn, and PyTorch where it is imported,
    have loaded theirs) and the version each reports, as text: one cuDNN, or the problem
    ("problem": None when one). `fastattn info` says it, so that a run on another cuDNN than
    the machine's names the one it really tested. Loads cuDNN where no GPU call has yet."""
    import sys

    from ._loader import cudnn_copies_problem, mapped_cudnn, version_text

    libraries()
    loaded = versions()["cudnn_loaded"]
    torch_version = None
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.backends.cudnn.is_available():
                torch_version = version_text(int(torch.backends.cudnn.version()))
        except Exception as e:  # noqa: BLE001 (a report: PyTorch's own failure is what it says)
            torch_version = f"unknown ({type(e).__name__}: {e})"
    files = mapped_cudnn()
    return {"fastattn": version_text(loaded), "torch": torch_version, "files": files,
            "problem": cudnn_copies_problem(files)}


def versions() -> dict[str, Any]:
    """fastattn's version, the cudnn-frontend and cuDNN headers it was built against,
    and the cuDNN loaded at run time (None before the first GPU call)."""
    from ._loader import import_core

    loaded, header, frontend = import_core().versions()
    return {
        "fastattn": __version__,
        "cudnn_frontend": version_string(frontend),
        "cudnn_headers": header,
        "cudnn_loaded": loaded or None,
    }

