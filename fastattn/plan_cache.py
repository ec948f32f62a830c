"""The persistent cache seen as plans: the adapter between cache entries and plans.

The store (fastattn.store) deals in keys and opaque bytes; the runtime (fastattn.runtime)
keeps the registry of plans in memory. Between them, this module says what a config on
a device is called in the cache (its description and key), turns an entry back into a
plan or a refusal, turns a plan just built into an entry, and reads what the cache
holds for a GPU without loading anything. The `fastattn` command and `fastattn.warm`
use it through PlanCache's public methods; the process's own PlanCache is
fastattn.runtime.plan_cache().

Everything read here comes from stored bytes, so a description whose config is not a
valid AttentionConfig is skipped (listed as unknown), never raised.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Mapping

from . import defects, store, verdict
from ._version import __version__
from .config import AttentionConfig
from .errors import CorruptPlanError, FastAttnError, InvalidArgumentError
from .result import ProbeResult, result_from_plan

__all__ = ["PlanCache", "config_of", "version_string"]

log = logging.getLogger("fastattn")


def version_string(frontend: int) -> str:
    """CUDNN_FRONTEND_VERSION (major * 10000 + minor * 100 + patch) as "1.28.0"."""
    return f"{frontend // 10000}.{frontend // 100 % 100}.{frontend % 100}"


def config_of(description: Any) -> AttentionConfig | None:
    """The config a stored description names, or None when it names none that this
    fastattn accepts (another version's field, damage the checksum cannot see)."""
    raw = description.get("config") if isinstance(description, dict) else None
    if not isinstance(raw, dict):
        return None
    try:
        return AttentionConfig.from_dict(raw)
    except (InvalidArgumentError, TypeError, ValueError, KeyError):
        # Stored bytes, not a caller's argument: whatever from_dict makes of them,
        # the answer is "no config" (config.py validates; this only must not crash).
        return None


class PlanCache:
    """A persistent plan cache: the tiers of `settings` (self.store, a
    store.TieredCache) seen through configs and plans.

    core: returns the module that builds and loads plans (fastattn._core, or a fake in
      tests); called at each use, never at construction, so that a PlanCache can be
      made, listed and pruned on a machine without a GPU.
    count: receives the runtime's counters (disk_hits=1, ...) as keyword arguments.
    gpu: the GPU the keys describe where it is not this process's (name,
      compute_capability, sm_count: fastattn.target.Gpu.key_fields(), for `fastattn warm
      --for`); None: the device's own.

    Methods that take `device` take a CUDA device index, or None for the current one.
    """

    def __init__(self, settings: store.CacheSettings, *, core: Callable[[], Any],
                 count: Callable[..., None] | None = None, gpu: Mapping[str, Any] | None = None):
        self.settings = settings
        self.gpu = gpu
        self.store = store.TieredCache(settings)
        self._core = core
        self._count = count or (lambda **deltas: None)
        self._lock = threading.Lock()
        self._bases: dict[int, dict[str, Any]] = {}  # device -> what describe() adds to a config

    # -- keys ---------------------------------------------------------------------------

    def _device(self, device: int | None) -> int:
        return self._core().get_current_device() if device is None else device

    def _base(self, device: int) -> dict[str, Any]:
        """This process's GPU, versions and policy: asked of the core once per device."""
        with self._lock:
            base = self._bases.get(device)
        if base is None:
            core = self._core()
            info = self.gpu or core.get_device_info(device)
            loaded, _, frontend = core.versions()
            base = {
                "fastattn_version": __version__,
                "frontend_version": version_string(frontend),
                "cudnn_version": loaded,
                "gpu_name": info["name"],
                "compute_capability": info["compute_capability"],
                "sm_count": info["sm_count"],
                "policy": core.policy(),
            }
            with self._lock:
                self._bases[device] = base
        return base

    def describe(self, config: AttentionConfig, device: int | None = None) -> dict[str, Any]:
        """The cache key's description of `config` on `device`: the config, this
        process's GPU, versions, policy and plan-changing CUDNN_* variables, and the
        known cuDNN defects its graphs avoid (fastattn.defects: the decision the graph
        builder makes, from the same cuDNN version and compute capability)."""
        base = self._base(self._device(device))
        avoided = defects.decide(config, base["cudnn_version"], base["compute_capability"])
        return store.describe(config.to_dict(), env=store.build_env_vars(), defects=avoided.key_part(), **base)

    def key(self, config: AttentionConfig, device: int | None = None) -> str:
        return store.key_of(self.describe(config, device))

    def environment(self, device: int | None = None) -> dict[str, Any]:
        """What an entry must have been made for to be used on `device` by this process
        (a description minus its config)."""
        any_config = AttentionConfig(batch=1, heads_q=1, seqlen_q=1, head_dim_qk=8)
        return store.environment_of(self.describe(any_config, device))

    # -- entries -> plans -----------------------------------------------------------------

    def lookup(self, config: AttentionConfig, device: int, key: str, touch: bool = True):
        """(plan or None, ProbeResult) from the tiers, or None on a miss (or an entry
        cuDNN will not load). touch=False: a load ahead of use, which leaves the entry's
        last use as it was."""
        found = self._get(key, touch)
        if found is None:
            return None
        return self.load(config, device, key, *found)

    def _get(self, key: str, touch: bool = True):
        """(entry, tier) for `key` from the tiers, or None; an entry whose header
        describes another plan than `key` (store.entry.key_problem) is a bad entry and a
        miss, never handed to the core: its blobs are another config's plan. The
        rebuild overwrites it."""
        found = self.store.get(key, touch)
        if found is None:
            return None
        problem = store.entry.key_problem(key, found[0].description)
        if problem:
            self._count(bad_entries=1)
            log.warning("fastattn cache: entry %s in %s: %s; rebuilding", key[:16], found[1].name, problem)
            return None
        return found

    def load(self, config: AttentionConfig, device: int, key: str, entry: store.Entry, tier: store.Tier):
        """(plan or None, ProbeResult) from an entry of `tier`; None when cuDNN refuses
        its blobs (counted as bad_entries: the caller rebuilds and overwrites it)."""
        stored = verdict.parse(entry.meta.get("verdict"))  # its shape checked by the entry decoder
        if entry.kind == "unsupported":
            self._count(negative_hits=1)
            return None, ProbeResult(config, device, False, entry.meta.get("reason", ""), source=tier.kind,
                                     verdict=stored)
        t0 = time.perf_counter()
        try:
            p = self.load_entry(entry, device, config)
        except CorruptPlanError as e:
            # Checksummed but refused by cuDNN (another build of it, a driver change): a
            # miss. The rebuild overwrites the entry.
            self._count(bad_entries=1)
            log.warning("fastattn cache: entry %s in %s does not load (%s); rebuilding", key[:16], tier.name, e)
            return None
        elapsed = time.perf_counter() - t0
        self._count(disk_hits=1, deserializations=1, load_seconds=elapsed)
        return p, replace(result_from_plan(config, device, p, elapsed, tier.kind), verdict=stored)

    def load_entry(self, entry: store.Entry, device: int | None = None, config: AttentionConfig | None = None):
        """The plan in a "plan" entry (what `fastattn cache verify --load` checks).
        Raises CorruptPlanError when cuDNN refuses the blobs, InvalidArgumentError when
        the entry names no valid config, and the core's errors for a missing GPU stack."""
        if config is None:
            config = config_of(entry.description)
            if config is None:
                raise InvalidArgumentError(f"entry {entry.key[:16]}... names no valid config")
        return self._core().load_plan(config, self._device(device), entry.blobs.get("forward", b""),
                                      entry.blobs.get("backward"), entry.meta.get("forward_engine", ""),
                                      entry.meta.get("backward_engine") or "")

    def stored_answer(self, config: AttentionConfig, device: int | None = None) -> ProbeResult | None:
        """The answer the tiers hold for `config` (source "disk" or "remote"), read
        without building or deserializing anything, or None. An entry found here has a
        valid checksum but is not proven to deserialize: cuDNN only says so when loading
        it (`fastattn cache verify --load` does)."""
        device = self._device(device)
        if not self.store.tiers:
            return None
        found = self._get(self.key(config, device))
        if found is None:
            return None
        e, tier = found
        stored = verdict.parse(e.meta.get("verdict"))
        if e.kind == "unsupported":
            return ProbeResult(config, device, False, e.meta.get("reason", ""), source=tier.kind, verdict=stored)
        m = e.meta  # shapes checked by the entry decoder
        return ProbeResult(config, device, True, "", m.get("forward_workspace_size", 0),
                           m.get("backward_workspace_size", 0), m.get("forward_engine", ""),
                           m.get("backward_engine") or "", 0.0, tier.kind, tuple(e.description.get("defects", ())),
                           stored)

    def configs(self, device: int | None = None) -> list[AttentionConfig]:
        """The configs of every entry in the directories stored for `device`'s GPU and
        this process's versions, each once, most recently used first (the store keeps
        an entry's last use as its access time): the order in which a process is
        likeliest to ask for them, which preload follows. Ties keep the directories'
        order (the main one first) and the listing's."""
        return [cfg for cfg, _ in self.recent(device, max_bytes=None, max_plans=None)]

    def recent(self, device: int | None, max_bytes: int | None,
               max_plans: int | None) -> list[tuple[AttentionConfig, str]]:
        """(config, key) of the entries stored for `device`'s GPU and this process's
        versions, each once, most recently used first, as many as fit in max_bytes of
        entry files and max_plans (None: no bound): what the warm-up loads. The
        directories are listed (sizes and last uses, from lstat); headers are read only
        for the entries taken, and for at most 4 * max_plans in all, so that a large or
        foreign cache costs a listing, not a read of every entry. Ties keep the
        directories' order (the main one first) and the listing's."""
        max_bytes = float("inf") if max_bytes is None else max_bytes
        max_plans = float("inf") if max_plans is None else max_plans
        want = self.environment(device)
        listed = [(-info.last_used, i, tier, info)
                  for i, (tier, info) in enumerate((t, e) for t in self.store.tiers for e in t.entries(with_headers=False))]
        listed.sort(key=lambda f: f[:2])
        out: list[tuple[AttentionConfig, str]] = []
        spent, reads, seen = 0, 0, set()
        for _, _, tier, info in listed:
            if len(out) >= max_plans or reads >= 4 * max_plans:
                break
            if info.key in seen or spent + info.size > max_bytes:
                continue
            reads += 1
            read = tier.read_header(info)
            desc = (read.header or {}).get("description") if read is not None else None
            if desc is None or store.environment_of(desc) != want:
                continue
            cfg = config_of(desc)
            if cfg is not None:
                seen.add(info.key)
                spent += info.size
                out.append((cfg, info.key))
        return out

    # -- plans -> entries -----------------------------------------------------------------

    def publish(self, key: str, description: dict[str, Any], p: Any, result: ProbeResult) -> None:
        """Stores what was just built (p None: cuDNN's refusal, with its reason, or a plan
        that failed verification, with the evidence), and result.verdict where it has one
        (a verified entry loaded later needs no second run). A plan that cannot be
        serialized stays in memory: the cache never makes real work fail."""
        extra = {"verdict": result.verdict.to_dict()} if result.verdict is not None else {}
        if p is None:
            entry = store.Entry(key, "unsupported", description, meta={"reason": result.reason, **extra},
                                created=time.time())
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
                **extra,
            }
            entry = store.Entry(key, "plan", description, blobs, meta, created=time.time())
        self.store.put(entry)
