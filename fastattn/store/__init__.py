"""The persistent plan cache: keys, the entry format, directories of entries, tiers.

The store deals in opaque bytes and knows nothing of cuDNN: it is tested without a
GPU. Bundles (store.bundle) are imported on demand: tarfile is slow to import.
Lookups go through the main directory, then any extra read-only directories; writes
go to the main directory only. Every tier (a directory, Redis) has one shape,
store.Tier.

Configuration: the FASTATTN_CACHE_* variables, read when the cache is first used or on
configure(), and FASTATTN_REMOTE_* for the Redis tier behind the directories
(store.remote); their kinds, defaults and meanings are fastattn.env's table (docs/ENVIRONMENT.md
shows it).

With a remote tier, lookups go memory, main directory, extra directories, then Redis;
what Redis has is copied into the main directory, and what this process builds is
published to Redis (mode read-write only).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Mapping

from .. import env as _env
from .disk import DiskStore, EntryInfo, Pruned, Stray
from .entry import Entry, EntryError
from .tier import Tier
from .keys import FORMAT_VERSION, build_env_vars, canonical_json, describe, environment_of, key_of

if TYPE_CHECKING:
    from .remote import RemoteSettings, RemoteStore

# The Redis tier and signing are imported only when configured: most processes never
# use them, and every millisecond of `import fastattn` is a millisecond of cold start.
_LAZY = {"RemoteSettings": "remote", "RemoteStore": "remote"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CacheSettings",
    "TieredCache",
    "DiskStore",
    "Entry",
    "EntryError",
    "EntryInfo",
    "Pruned",
    "Stray",
    "Tier",
    "RemoteSettings",
    "RemoteStore",
    "environment_of",
    "FORMAT_VERSION",
    "build_env_vars",
    "canonical_json",
    "describe",
    "key_of",
    "settings_from_env",
]

MODES = _env.VARIABLES["FASTATTN_CACHE_MODE"].choices
DEFAULT_MAX_BYTES = _env.VARIABLES["FASTATTN_CACHE_MAX_BYTES"].default


@dataclass(frozen=True)
class CacheSettings:
    directory: str
    mode: str = "read-write"
    extra_dirs: tuple[str, ...] = field(default_factory=tuple)
    shared: bool = False
    max_bytes: int | None = DEFAULT_MAX_BYTES
    remote: RemoteSettings | None = None
    secret: bytes | None = field(default=None, repr=False)  # never printed
    trusted: bool = False  # FASTATTN_CACHE_TRUSTED: with `secret`, store.signing.Policy


def settings_from_env(environ: Mapping[str, str] | None = None) -> CacheSettings:
    """Cache settings from the FASTATTN_CACHE_* and FASTATTN_REMOTE_* variables (read
    through fastattn.env); a bad value is an InvalidArgumentError naming the variable."""
    env = os.environ if environ is None else environ
    max_bytes = _env.get("FASTATTN_CACHE_MAX_BYTES", env)
    remote = secret = None
    if _env.is_set("FASTATTN_REMOTE_CACHE", env):
        from .remote import remote_settings_from_env

        remote = remote_settings_from_env(env)
    if _env.is_set("FASTATTN_CACHE_HMAC_KEY", env) or _env.is_set("FASTATTN_CACHE_HMAC_KEY_FILE", env):
        from .signing import load_secret

        secret = load_secret(env)
    return CacheSettings(_env.get("FASTATTN_CACHE_DIR", env), _env.get("FASTATTN_CACHE_MODE", env),
                         _env.get("FASTATTN_CACHE_EXTRA_DIRS", env), _env.get("FASTATTN_CACHE_SHARED", env),
                         max_bytes or None, remote, secret, _env.get("FASTATTN_CACHE_TRUSTED", env))


class TieredCache:
    """The main directory, then extra read-only directories, then the remote tier."""

    def __init__(self, settings: CacheSettings):
        self.settings = settings
        self.main: DiskStore | None = None
        self.extras: list[DiskStore] = []
        self.remote: RemoteStore | None = None
        if settings.mode != "off":
            self.main = DiskStore(settings.directory, writable=settings.mode == "read-write", shared=settings.shared,
                                  max_bytes=settings.max_bytes)
            self.extras = [DiskStore(d, writable=False) for d in settings.extra_dirs]
            if settings.remote is not None:
                from .remote import RemoteStore

                self.remote = RemoteStore(settings.remote, settings.secret)

    @property
    def tiers(self) -> list[DiskStore]:
        """The directories (the remote tier is self.remote)."""
        return ([self.main] if self.main else []) + self.extras

    def get(self, key: str, touch: bool = True) -> tuple[Entry, Tier] | None:
        """The entry for `key` and the tier it came from (tier.kind: "disk" or
        "remote"), or None. touch=False leaves its last use as it was (DiskStore.get)."""
        for store in self.tiers:
            entry = store.get(key, touch)
            if entry is not None:
                return entry, store
        if self.remote is not None:
            entry = self.remote.get(key)
            if entry is not None:
                self._keep(entry)
                return entry, self.remote
        return None

    def touch(self, key: str) -> None:
        """Records a use of `key`'s entry in the first directory that holds it (the one
        get() reads it from)."""
        for store in self.tiers:
            if store.touch(key):
                return

    def _keep(self, entry: Entry) -> None:
        """A copy of a remote entry in the main directory: the next process finds it
        without the network."""
        if self.main is not None and self.main.writable:
            self.main.put(entry)

    def put(self, entry: Entry) -> bool:
        """Stores an entry this process made: in the main directory, and in Redis."""
        stored = self.main.put(entry) if self.main else False
        if self.remote is not None and self.settings.mode == "read-write":
            self.remote.put(entry)
        return stored

    @contextlib.contextmanager
    def flight(self, key: str) -> Iterator[Entry | None]:
        """Across machines, what DiskStore.lock is across processes: yields an entry
        another machine published meanwhile (kept locally too), or None: build it and
        put() it inside the block."""
        if self.remote is None or self.settings.mode != "read-write":
            yield None
            return
        with self.remote.flight(key) as found:
            if found is not None:
                self._keep(found)
            yield found

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

    def strays(self) -> Iterator[tuple[DiskStore, Stray]]:
        """What the directories hold that is named like an entry and is not one."""
        for store in self.tiers:
            for stray in store.strays():
                yield store, stray

    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for store in self.tiers + ([self.remote] if self.remote else []):
            for k, v in store.counters.items():
                total[k] = total.get(k, 0) + v
        return total
