"""The persistent plan cache: keys, the entry format, directories of entries, tiers.

The store deals in opaque bytes and knows nothing of cuDNN: it is tested without a
GPU. Bundles (store.bundle) are imported on demand: tarfile is slow to import. Lookups go through the main directory, then any extra read-only directories;
writes go to the main directory only.

Configuration (environment, read when the cache is first used or on configure()):

=============================  ========================================================
FASTATTN_CACHE_DIR             main directory (default: the platform's user cache dir)
FASTATTN_CACHE_MODE            read-write (default), read-only, or off
FASTATTN_CACHE_EXTRA_DIRS      read-only directories searched after the main one,
                               separated by os.pathsep (":")
FASTATTN_CACHE_SHARED          1: group-writable files (0664) and directories (2775)
                               for a directory shared between users; default private
                               (0600 / 0700)
FASTATTN_CACHE_MAX_BYTES       prune least-recently-used entries above this size
                               (default 4 GiB; 0 means no limit)
=============================  ========================================================
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from ..errors import InvalidArgumentError
from .disk import DiskStore, EntryInfo
from .entry import Entry, EntryError
from .keys import FORMAT_VERSION, build_env_vars, canonical_json, describe, environment_of, key_of

__all__ = [
    "CacheSettings",
    "TieredCache",
    "DiskStore",
    "Entry",
    "EntryError",
    "EntryInfo",
    "environment_of",
    "FORMAT_VERSION",
    "build_env_vars",
    "canonical_json",
    "describe",
    "key_of",
    "settings_from_env",
]

MODES = ("read-write", "read-only", "off")
DEFAULT_MAX_BYTES = 4 << 30


@dataclass(frozen=True)
class CacheSettings:
    directory: str
    mode: str = "read-write"
    extra_dirs: tuple[str, ...] = field(default_factory=tuple)
    shared: bool = False
    max_bytes: int | None = DEFAULT_MAX_BYTES


def _default_dir() -> str:
    import platformdirs

    return platformdirs.user_cache_dir("fastattn", appauthor=False)


def settings_from_env(environ: Mapping[str, str] | None = None) -> CacheSettings:
    """Cache settings from FASTATTN_CACHE_* variables; a bad value is an
    InvalidArgumentError naming the variable."""
    env = os.environ if environ is None else environ
    directory = env.get("FASTATTN_CACHE_DIR") or _default_dir()
    mode = env.get("FASTATTN_CACHE_MODE", "read-write").strip().lower() or "read-write"
    if mode not in MODES:
        raise InvalidArgumentError(f"FASTATTN_CACHE_MODE={env['FASTATTN_CACHE_MODE']!r}: must be one of {MODES}")
    extras = tuple(d for d in env.get("FASTATTN_CACHE_EXTRA_DIRS", "").split(os.pathsep) if d)
    shared_raw = env.get("FASTATTN_CACHE_SHARED", "0").strip().lower()
    if shared_raw not in ("0", "1", "true", "false", "yes", "no", ""):
        raise InvalidArgumentError(f"FASTATTN_CACHE_SHARED={shared_raw!r}: must be 0 or 1")
    raw_max = env.get("FASTATTN_CACHE_MAX_BYTES")
    max_bytes: int | None = DEFAULT_MAX_BYTES
    if raw_max is not None and raw_max.strip():
        try:
            max_bytes = int(raw_max)
        except ValueError:
            raise InvalidArgumentError(f"FASTATTN_CACHE_MAX_BYTES={raw_max!r}: must be an integer") from None
        if max_bytes < 0:
            raise InvalidArgumentError(f"FASTATTN_CACHE_MAX_BYTES={raw_max!r}: must be >= 0")
        max_bytes = max_bytes or None
    return CacheSettings(directory, mode, extras, shared_raw in ("1", "true", "yes"), max_bytes)


class TieredCache:
    """The main directory, then extra read-only directories."""

    def __init__(self, settings: CacheSettings):
        self.settings = settings
        self.main: DiskStore | None = None
        self.extras: list[DiskStore] = []
        if settings.mode != "off":
            self.main = DiskStore(settings.directory, writable=settings.mode == "read-write", shared=settings.shared,
                                  max_bytes=settings.max_bytes)
            self.extras = [DiskStore(d, writable=False) for d in settings.extra_dirs]

    @property
    def tiers(self) -> list[DiskStore]:
        return ([self.main] if self.main else []) + self.extras

    def get(self, key: str) -> tuple[Entry, DiskStore] | None:
        for store in self.tiers:
            entry = store.get(key)
            if entry is not None:
                return entry, store
        return None

    def put(self, entry: Entry) -> bool:
        return self.main.put(entry) if self.main else False

    def signature(self, key: str):
        """Changes when the main directory's entry for `key` is published or replaced
        (only the main directory is ever written)."""
        return self.main.signature(key) if self.main else None

    def lock(self, key: str, timeout: float = 120.0):
        if self.main is None:
            return contextlib.nullcontext(False)
        return self.main.lock(key, timeout)

    def entries(self) -> Iterator[tuple[DiskStore, EntryInfo]]:
        for store in self.tiers:
            for info in store.entries():
                yield store, info

    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for store in self.tiers:
            for k, v in store.counters.items():
                total[k] = total.get(k, 0) + v
        return total
