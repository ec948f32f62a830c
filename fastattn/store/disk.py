"""A directory of entries: atomic publish, per-key locks, least-recently-used pruning.

Every failure here is a miss or a skipped write, never an exception for the caller:
the cache never makes real work fail. An unwritable directory (read-only filesystem,
disk full, no permission) gives one warning and the store stops writing.

Layout: <root>/<key[:2]>/<key>.entry, lock files in <root>/locks/. Last use is the
file's atime, set explicitly on every hit (mount options like noatime do not matter).
Every path comes from a key that is 64 hex digits (entry.KEY_PATTERN), so no key, from
a bundle or a remote store, can name a file outside the root.

Directories are made private (0700), or 2775 when shared, whatever the umask: the
README promises it, and a cache of native code readable by everyone is a leak.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from .entry import KEY_PATTERN, Entry, EntryError, decode, encode, read_header_from_file

__all__ = ["DiskStore", "EntryInfo"]

log = logging.getLogger("fastattn.store")

_SUFFIX = ".entry"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600.0


@dataclass(frozen=True)
class EntryInfo:
    key: str
    path: str
    size: int
    created: float
    last_used: float
    header: dict | None  # None when the header is unreadable or malformed
    problem: str = ""  # why the header is unusable ("" when it is fine); the blobs are not checked here


class DiskStore:
    """One cache directory: a tier (store.Tier) of kind "disk".

    writable: False for a read-only tier (an image's baked cache, a shared volume).
    shared: files 0664 and directories 2775 instead of 0600 and 0700.
    max_bytes: prune least-recently-used entries after a write that goes over it.
    """

    kind = "disk"  # a tier (store.Tier): what ProbeResult.source says for its entries

    def __init__(self, root: str, *, writable: bool = True, shared: bool = False, max_bytes: int | None = None):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.writable = writable
        self.shared = shared
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._total: int | None = None  # bytes in entries, known after the first scan
        self.counters = {"hits": 0, "misses": 0, "corrupt": 0, "writes": 0, "write_failures": 0, "pruned": 0}

    @property
    def name(self) -> str:
        """How messages name this tier: its directory."""
        return self.root

    # -- paths ------------------------------------------------------------------------

    def path_for(self, key: str) -> str:
        if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
            raise EntryError(f"not a cache key: {str(key)[:80]!r}")
        return os.path.join(self.root, key[:2], key + _SUFFIX)

    def _mkdir(self, path: str) -> None:
        """Makes `path` (the root or a folder in it) and any missing folder between it
        and the root with the cache's mode. os.makedirs applies its mode to the last
        folder only, and through the umask (0755 under the usual 022): each folder we
        make gets an explicit chmod instead. Folders above the root are made as
        makedirs makes them; existing folders are left as they are."""
        mode = 0o2775 if self.shared else 0o700
        todo = []
        while not os.path.isdir(path):
            todo.append(path)
            parent = os.path.dirname(path)
            if path == self.root or parent == path:
                break
            path = parent
        if todo and not os.path.isdir(os.path.dirname(todo[-1])):
            os.makedirs(os.path.dirname(todo[-1]), exist_ok=True)
        for folder in reversed(todo):
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                continue  # another process made it: it chose the mode
            os.chmod(folder, mode)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _warn_once(self, what: str, message: str, *args) -> None:
        with self._lock:
            if what in self._warned:
                return
            self._warned.add(what)
        log.warning(message, *args)

    # -- read -------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The entry for `key`, or None (absent, unreadable or invalid: all misses)."""
        try:
            path = self.path_for(key)
            with open(path, "rb") as f:
                data = f.read()
        except (FileNotFoundError, EntryError):
            self._count("misses")
            return None
        except OSError as e:
            self._count("misses")
            self._warn_once("read:" + path, "fastattn cache: cannot read %s (%s); treating it as a miss", path, e)
            return None
        try:
            entry = decode(data, expected_key=key)
        except EntryError as e:
            self._count("corrupt")
            self._count("misses")
            self._warn_once("corrupt:" + path, "fastattn cache: ignoring %s: %s", path, e)
            return None
        self._count("hits")
        self._touch(path)
        return entry

    def signature(self, key: str) -> tuple[int, int, int] | None:
        """(inode, mtime, size) of the entry file, or None: tells whether another
        process published the entry since we last looked, without reading it."""
        try:
            st = os.stat(self.path_for(key))
        except (OSError, EntryError):
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _touch(self, path: str) -> None:
        if not self.writable:
            return
        try:
            st = os.stat(path)
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))  # mtime kept exactly: see signature()
        except OSError:
            pass  # a file pruned or replaced since we read it: nothing to record

    # -- write ------------------------------------------------------------------------

    def put(self, entry: Entry) -> bool:
        """Publishes `entry` atomically: readers see the old file or the new one, never
        part of one. Returns whether it was written; a failure is one warning, and the
        store stops writing when the directory cannot be written at all."""
        try:
            return self.publish(entry)
        except OSError as e:
            self._warn_once(
                "write", "fastattn cache: cannot write to %s (%s); plans stay in memory only", self.root, e
            )
            return False
        except EntryError as e:
            self._warn_once("key:" + str(entry.key)[:80], "fastattn cache: not storing an entry: %s", e)
            return False

    def publish(self, entry: Entry) -> bool:
        """put() that raises: OSError when the entry cannot be written (for explicit
        requests, such as `fastattn cache import`, where a silent skip would be a lie),
        EntryError for a key that is not one. False, without writing, when the store is
        read-only."""
        if not self.writable:
            return False
        path = self.path_for(entry.key)
        data = encode(entry)
        folder = os.path.dirname(path)
        tmp = None
        try:
            self._mkdir(folder)
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=folder)
            try:
                if self.shared:
                    os.fchmod(fd, 0o664)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            old = os.path.getsize(path) if os.path.exists(path) else 0
            os.replace(tmp, path)  # atomic within one directory
            tmp = None
        except OSError as e:
            self._count("write_failures")
            if e.errno in (errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EDQUOT):
                self.writable = False
            raise
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        self._count("writes")
        self._after_write(len(data) - old)
        return True

    def holds(self, key: str) -> bool:
        """Whether the directory has a valid entry for `key` (counted nowhere: import
        reports it as already present, and replaces a damaged one). Another valid
        entry for the same key is as good as the bundle's: the key covers the config,
        the GPU and every version."""
        try:
            with open(self.path_for(key), "rb") as f:
                decode(f.read(), expected_key=key)
        except (OSError, EntryError):
            return False
        return True

    def _after_write(self, delta: int) -> None:
        if self.max_bytes is None:
            return
        with self._lock:
            if self._total is not None:
                self._total += delta
            total = self._total
        if total is None:
            total = sum(info.size for info in self.entries(with_headers=False))
            with self._lock:
                self._total = total
        if total > self.max_bytes:
            self.prune(max_bytes=self.max_bytes)

    # -- locks ------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float = 120.0) -> Iterator[bool]:
        """An exclusive per-key lock across processes, to avoid building one plan twice.
        Yields whether it was acquired: on timeout, or where no lock file can be made
        (a read-only store), the caller goes ahead without it. The kernel releases a
        flock when its process dies, so a killed builder blocks nobody."""
        if not self.writable or not KEY_PATTERN.fullmatch(key):
            yield False
            return
        folder = os.path.join(self.root, "locks")
        try:
            self._mkdir(folder)
            fd = os.open(os.path.join(folder, key + ".lock"), os.O_RDWR | os.O_CREAT, 0o664 if self.shared else 0o600)
        except OSError:
            yield False
            return
        acquired = False
        try:
            deadline = time.monotonic() + timeout
            delay = 0.002
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    acquired = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
            yield acquired
        finally:
            if acquired:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # -- listing, pruning -------------------------------------------------------------

    def entries(self, with_headers: bool = True) -> Iterator[EntryInfo]:
        """Every entry file (valid or not) with its size and last use."""
        try:
            folders = sorted(os.listdir(self.root))
        except OSError:
            return
        for sub in folders:
            folder = os.path.join(self.root, sub)
            if sub == "locks" or len(sub) != 2 or not os.path.isdir(folder):
                continue
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                continue
            for name in names:
                if not name.endswith(_SUFFIX):
                    continue
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                key, header, problem = name[: -len(_SUFFIX)], None, ""
                if with_headers:
                    try:
                        with open(path, "rb") as f:
                            header = read_header_from_file(f)
                        if header["key"] != key:
                            raise EntryError(f"the header is for key {header['key'][:16]}..., the file's name "
                                             f"is {key[:16]}...")
                    except (OSError, EntryError) as e:
                        header, problem = None, str(e) or type(e).__name__
                created = float(header["created"]) if header else st.st_mtime
                yield EntryInfo(key, path, st.st_size, created, st.st_atime, header, problem)

    def prune(self, max_bytes: int | None = None, max_age: float | None = None) -> int:
        """Removes least-recently-used entries until at most `max_bytes` remain, and
        entries unused for more than `max_age` seconds; also temporary files left by
        killed writers. Returns how many entries went."""
        infos = sorted(self.entries(with_headers=False), key=lambda i: i.last_used)
        now = time.time()
        removed = 0
        total = sum(i.size for i in infos)
        for info in infos:
            too_old = max_age is not None and now - info.last_used > max_age
            too_big = max_bytes is not None and total > max_bytes
            if not (too_old or too_big):
                continue
            try:
                os.unlink(info.path)
            except OSError:
                continue
            removed += 1
            total -= info.size
        self._remove_stale_temporaries(now)
        with self._lock:
            self._total = total
            self.counters["pruned"] += removed
        return removed

    def _remove_stale_temporaries(self, now: float) -> None:
        try:
            folders = os.listdir(self.root)
        except OSError:
            return
        for sub in folders:
            folder = os.path.join(self.root, sub)
            if not os.path.isdir(folder):
                continue
            with contextlib.suppress(OSError):
                for name in os.listdir(folder):
                    if name.startswith(_TMP_PREFIX):
                        path = os.path.join(folder, name)
                        with contextlib.suppress(OSError):
                            if now - os.stat(path).st_mtime > _STALE_TMP_SECONDS:
                                os.unlink(path)

    def clear(self) -> int:
        """Removes every entry; returns how many."""
        return self.prune(max_bytes=0)
