"""Every in-memory table keyed by shape holds at most max_entries() entries
(FASTATTN_MEMORY_MAX_ENTRIES, default 4096) and counts what it drops: a server that
sees ever new shapes (lengths, batch sizes) stays bounded in host memory instead of
growing an entry per shape until it is killed.

The tables, by their names in fastattn.stats()["evictions"]:
- "plans": the runtime's plans and refusals per (config, device) (fastattn.runtime);
- "torch_calls": fastattn.torch's plan per call signature (torch/_plans.py's `plans`);
- "native_calls": the op library's C++ table of the same (torch/csrc/table.cpp);
- "sdpa_routes": the SDPA mode's route per call signature (torch/_sdpa_mode.py's and
  torch/csrc/sdpa.cpp's);
- "arrays": length and offset arrays kept per shape (torch/_paged.py,
  torch/_shape_classes.py, integrations/flash/_common.py);
- "class_refusals": the shape-class plans cuDNN refused (torch/_shape_classes.py);
- "recorded": the configs FASTATTN_RECORD has written (fastattn._record);
- "warnings": the messages warn_once gave (fastattn.runtime).

Plans, calls and routes are dropped least recently used first, in batches of an eighth of
the cap, so that a table past its cap is trimmed once per cap / 8 new entries. A hit
stamps its entry with the table's clock, which only the table's inserts advance (tick: a
hit stores an int it reads, no lock, no hashing beyond the lookup's own), and a trim
drops the entries of the oldest stamps: entries not used since any of the newer inserts
go first, and a shape used between every two inserts (a hot shape) is never among them.
Dropping only drops the table's reference: a plan in use (by a thread, a kept CachedPlan, a
captured CUDA graph) stays valid, and a dropped one is asked of the runtime again at its
next call (memory, the persistent cache, a build). The other tables (arrays, refusals,
recorded configs, warnings) drop the oldest-added eighth: an entry of theirs is remade
at its next use for the cost of one small tensor fill or one line, so their hits stay
plain dict lookups. Counters keyed by a reason (which may quote a shape) are bounded as
well: past the cap, a new reason is counted under OTHER_REASONS.

Public, as fastattn.env is: fastattn.torch and the integrations (other packages) bound
their tables with it.
"""

from __future__ import annotations

import heapq
import os
import threading
import weakref
from typing import Any, Callable, Hashable, Iterable

from . import env

__all__ = ["NAMES", "OTHER_REASONS", "max_entries", "trim_to", "tick", "evicted", "evictions", "add_source",
           "reset", "least_used", "Table", "count_reason"]

NAMES = ("plans", "torch_calls", "native_calls", "sdpa_routes", "arrays", "class_refusals", "recorded", "warnings")
OTHER_REASONS = ("other reasons (more distinct reasons than FASTATTN_MEMORY_MAX_ENTRIES: each further one is "
                 "counted here)")

_lock = threading.Lock()
_max: int | None = None  # FASTATTN_MEMORY_MAX_ENTRIES, once read
_counts = dict.fromkeys(NAMES, 0)
# Counts kept elsewhere: who keeps them (the op library, for its C++ tables) -> (read:
# {name: count}, reset).
_sources: dict[str, tuple[Callable[[], dict[str, int]], Callable[[], None]]] = {}


def max_entries() -> int:
    """FASTATTN_MEMORY_MAX_ENTRIES, read once per process (its first use). Raises
    InvalidArgumentError naming the variable and the value."""
    global _max
    if _max is None:
        _max = env.get("FASTATTN_MEMORY_MAX_ENTRIES")
    return _max


def trim_to(size: int) -> int:
    """How many entries a table of `size` entries drops: none up to the cap; past it,
    down to the cap less an eighth (at least one)."""
    cap = max_entries()
    return 0 if size <= cap else size - (cap - cap // 8)


def tick(clock: list[int]) -> int:
    """An insert's stamp, the table's clock (clock[0]) advanced: by two, the stamp between,
    so that an entry hit after this insert (stamped clock[0]) is later than the entry
    inserted, and one hit before it earlier. Call under the table's write lock."""
    clock[0] += 2
    return clock[0] - 1


def evicted(name: str, n: int) -> None:
    """Counts n entries dropped from table `name` (one of NAMES)."""
    if n:
        with _lock:
            _counts[name] += n


def add_source(keeper: str, read: Callable[[], dict[str, int]], reset: Callable[[], None]) -> None:
    """Adds read()'s counts ({name: count}, names of NAMES) to evictions(); reset() zeroes
    them (reset()). One source per keeper: a second replaces the first."""
    _sources[keeper] = (read, reset)


def evictions() -> dict[str, int]:
    """Entries each table has dropped since the process started or clear() (fastattn.stats()["evictions"])."""
    with _lock:
        out = dict(_counts)
    for read, _ in list(_sources.values()):
        for name, n in read().items():
            out[name] += n
    return out


def reset() -> None:
    """Zeroes the counts (fastattn.clear()); the cap stays as read."""
    with _lock:
        for name in _counts:
            _counts[name] = 0
    for _, zero in list(_sources.values()):
        zero()


def least_used(stamps: Iterable[tuple[Hashable, Any]], n: int) -> list[Hashable]:
    """The keys of the n smallest stamps among (key, stamp) pairs."""
    return [key for key, _ in heapq.nsmallest(n, stamps, key=lambda kv: kv[1])]


class Table(dict):
    """A dict whose keep() drops the oldest-added eighth past the cap, counted under
    `name`: for values remade cheaply at their next use (see the module's doc). Read it
    as a dict (get, in), without a lock; write it only through keep() (or clear())."""

    __slots__ = ("__weakref__", "_lock", "name")

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self._lock = threading.Lock()  # (keeps are serialized: a trim iterates the dict)
        _tables[id(self)] = self

    def keep(self, key: Hashable, value: Any) -> Any:
        """Sets key to value, first dropping the oldest-added entries past the cap; returns value."""
        max_entries()  # (read before the lock: a bad value raises before anything changes)
        with self._lock:
            drop = trim_to(len(self) + (key not in self))
            if drop:
                # (the oldest first: a dict keeps its insertion order)
                dropped = [(k, self.pop(k)) for k in [k for k, _ in zip(self, range(drop))]]
                evicted(self.name, drop)
            else:
                dropped = None
            self[key] = value
        del dropped  # (released after the lock)
        return value


# Every Table (by id: a dict is not hashable), for the fork handler below.
_tables: weakref.WeakValueDictionary[int, Table] = weakref.WeakValueDictionary()


def _after_fork_in_child() -> None:
    # The child has only the forking thread: a lock another thread held at the fork would
    # never be released there.
    global _lock
    _lock = threading.Lock()
    for table in list(_tables.values()):
        table._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def count_reason(counts: dict[str, int], reason: str, n: int = 1) -> None:
    """counts[reason] += n, or counts[OTHER_REASONS] where the cap's worth of reasons is
    there already (call under the lock that guards counts)."""
    if reason not in counts and len(counts) >= max_entries():
        reason = OTHER_REASONS
    counts[reason] = counts.get(reason, 0) + n
