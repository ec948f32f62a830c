"""What every tier of the cache is: a place that maps keys to entries.

DiskStore (a directory) and RemoteStore (Redis) both have this shape; TieredCache and
the plan adapter (fastattn.plan_cache) deal with tiers through it alone, so a new
tier (an object store, say) is one class, not an `isinstance` in every caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .disk import EntryInfo
    from .entry import Entry

__all__ = ["Tier"]


@runtime_checkable
class Tier(Protocol):
    kind: str  # "disk" or "remote": where a plan came from, as ProbeResult.source says it
    counters: dict[str, int]  # this tier's own counts (hits, misses, ...), summed in fastattn.stats()

    @property
    def name(self) -> str:
        """How messages name the tier (a directory; a URL without its password)."""
        ...

    def get(self, key: str) -> Entry | None:
        """The valid entry for `key`, or None: absent, damaged and unreachable are all
        misses, never exceptions."""
        ...

    def put(self, entry: Entry) -> bool:
        """Stores `entry` if the tier can; whether it did. Never raises for I/O: the
        cache never makes real work fail."""
        ...

    def entries(self) -> Iterator[EntryInfo]:
        """What the tier holds, for listing (a directory lists damaged files too, with
        EntryInfo.problem set)."""
        ...
