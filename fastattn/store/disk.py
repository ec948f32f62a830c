"""A directory of entries: atomic publish, per-key locks, least-recently-used pruning.

Every failure here is a miss or a skipped write, never an exception for the caller:
the cache never makes real work fail. An unwritable directory (read-only filesystem,
disk full, no permission) gives one warning and the store stops writing.

Layout: <root>/<key[:2]>/<key>.entry, lock files in <root>/locks/. Last use is the
file's atime, set explicitly on every hit (mount options like noatime do not matter).
Every path comes from a key that is 64 hex digits (entry.KEY_PATTERN), so no key, from
a bundle or a remote store, can name a file outside the root.

Directories are made private (0700), or 2775 when shared, whatever the umask: the
docs promise it (FASTATTN_CACHE_SHARED), and a cache of native code readable by everyone is a leak.

What lies in the directory is untrusted, whoever put it there. fastattn's own is only
(store.ownership, which checks each file before it is removed or replaced): regular
files named <key>.entry in the shard folder named after the key's first two hex digits
(a real folder, not a link) that begin with the entry magic, temporary files there named
and filled as publish makes them, empty <key>.lock files in locks/, and the directory's
CACHEDIR.TAG. Entries are opened without following a link and without blocking
(O_NOFOLLOW | O_NONBLOCK, then fstat: a regular file or nothing), so a FIFO or a link
named like an entry is never read, nor waited on. Anything else named like an entry
(a FIFO, a link, a folder, a file in the wrong folder, under another name or without
the magic) is a stray: listed (strays()), never read, replaced or deleted. Pruning
removes entries, temporary files left by killed writers, lock files nobody holds but
those of the entries that stay, and, in a directory that is fastattn's (tagged, or an
older fastattn's: store.ownership), empty shard folders; it names what it removed
besides entries, and says which entries it could not remove, and why. A file gone
between a listing and its read (another process's clear) is gone, not damaged.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Union

from .. import files as _files
from ..files import kind as _kind
from . import entry as _entry
from . import ownership
from .entry import KEY_PATTERN, Entry, EntryError, decode, encode, read_header_from_file

__all__ = ["DiskStore", "EntryInfo", "Pruned", "Stray"]

log = logging.getLogger("fastattn.store")

_SUFFIX = ".entry"
_TMP_PREFIX = ".tmp-"
_LOCK_SUFFIX = ".lock"
_STALE_TMP_SECONDS = 3600.0
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# An entry is read through these: never a link's target, never a wait on a FIFO.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
# An entry's access time is its last use, set by _touch on a hit: a read must not set it
# (relatime does for a file unused for a day, so a listing, `cache ls`, a prune's scan or
# preload made every old entry look just used to LRU pruning). O_NOATIME is the owner's
# (or CAP_FOWNER's) to ask: anyone else's read falls back to the plain flags (EPERM).
_NOATIME = getattr(os, "O_NOATIME", 0)
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_HEX = frozenset("0123456789abcdef")
_NO_MAGIC = "a file named like an entry, without fastattn's format: not fastattn's"


@dataclass(frozen=True)
class EntryInfo:
    key: str
    path: str
    size: int
    created: float
    last_used: float
    header: dict | None  # None when the header is unreadable or malformed
    problem: str = ""  # why the header is unusable ("" when it is fine); the blobs are not checked here


@dataclass(frozen=True)
class Stray:
    """Something in the directory named like fastattn's that is not (a FIFO, a link, a
    folder, a misplaced or misnamed file): listed, never read or deleted."""

    path: str
    why: str


@dataclass
class Pruned:
    """What prune() or clear() did: the entries it removed, those it could not remove
    (their paths by reason: an OSError's text, such as "Read-only file system"), what it
    left alone as not fastattn's, and what else it removed, (path, what it was) each: a
    killed writer's temporary file, an idle lock file, an empty folder."""

    removed: int = 0
    failed: dict[str, list[str]] = field(default_factory=dict)
    strays: list[Stray] = field(default_factory=list)
    also_removed: list[tuple[str, str]] = field(default_factory=list)

    @property
    def not_removed(self) -> int:
        return sum(len(paths) for paths in self.failed.values())


def _is_shard(name: str) -> bool:
    return len(name) == 2 and set(name) <= _HEX


def _open_regular(path: str) -> int:
    """A read-only descriptor of `path` when it is a regular file reached without
    following a link (neither the file nor its folder may be one) and without blocking;
    EntryError when it is something else, OSError when it cannot be opened."""
    folder, name = os.path.split(path)
    try:
        dfd = os.open(folder, _FOLDER_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise EntryError(f"{_files.shown(folder)} is not a folder of fastattn's (a link or a file): not followed") from None
        raise
    try:
        try:
            fd = os.open(name, _READ_FLAGS | _NOATIME, dir_fd=dfd)
        except PermissionError:
            if not _NOATIME:
                raise
            fd = os.open(name, _READ_FLAGS, dir_fd=dfd)  # not the file's owner: O_NOATIME is refused
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise EntryError("a symbolic link, not an entry: not followed") from None
        raise
    finally:
        os.close(dfd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise EntryError(f"{_kind(mode)}, not an entry: not read")
    return fd


class _TooLarge(EntryError):
    """An entry file over entry.MAX_ENTRY_BYTES: damage, never read."""


def read_regular(path: str) -> bytes:
    """The bytes of the regular file `path` (see _open_regular); _TooLarge (an
    EntryError) when it holds more than an entry may, read no further than that."""
    with os.fdopen(_open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        error = _entry.too_large(size)
        # A read asks for what fstat says, and one byte to see growth: a read of the cap
        # itself would allocate the cap for every entry. A file that grows after fstat is
        # still read no further than the cap allows.
        data = f.read(size + 1) if error is None else b""
        if len(data) > size:
            data += f.read(_entry.MAX_ENTRY_BYTES + 1 - len(data))
        error = error or _entry.too_large(len(data))
        if error is not None:
            raise _TooLarge(f"{error}: not read")
        return data


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
        self._fastattns: bool | None = None  # whether the root is a fastattn cache directory, once known
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
            if folder == self.root:  # made here: fastattn's, and tagged so that it stays known as such
                self._tag()

    def _tag(self) -> None:
        ownership.write_tag(self.root, 0o664 if self.shared else 0o644)
        self._fastattns = True

    def _entry_is_ours(self, path: str) -> bool:
        """Whether the file named like an entry at `path` is fastattn's (store.ownership)."""
        return self.is_fastattns() or ownership.begins_as_entry(path, empty_ok=False)

    def is_fastattns(self) -> bool:
        """Whether the root is a fastattn cache directory (store.ownership): tagged, or
        made by an older fastattn, which is tagged here when the store is writable."""
        if self._fastattns:
            return True
        if ownership.is_tagged(self.root):
            self._fastattns = True
        elif ownership.old_cache_shape(self.root):
            self._fastattns = True
            if self.writable:
                with contextlib.suppress(OSError):
                    self._tag()
        else:
            self._fastattns = False
        return self._fastattns

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

    def get(self, key: str, touch: bool = True) -> Entry | None:
        """The entry for `key`, or None (absent, unreadable or invalid: all misses).
        touch=False leaves its last use as it was (a load ahead of use: preload)."""
        try:
            path = self.path_for(key)
        except EntryError:
            self._count("misses")
            return None
        try:
            data = read_regular(path)
        except FileNotFoundError:
            self._count("misses")
            return None
        except EntryError as e:  # a FIFO, a link, a folder: not ours; or too large to be an entry
            if isinstance(e, _TooLarge):
                self._count("corrupt")
            self._count("misses")
            self._warn_once("stray:" + path, "fastattn cache: ignoring %s: %s", path, e)
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
        if touch:
            self._touch(path)
        return entry

    def touch(self, key: str) -> bool:
        """Records a use of `key`'s entry now (its access time) if this directory holds
        it; whether it does."""
        try:
            path = self.path_for(key)
        except EntryError:
            return False
        if not os.path.lexists(path):
            return False
        self._touch(path)
        return True

    def signature(self, key: str) -> tuple[int, int, int] | None:
        """(inode, mtime, size) of the entry file, or None: tells whether another
        process published the entry since we last looked, without reading it."""
        try:
            st = os.lstat(self.path_for(key))
        except (OSError, EntryError):
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def read(self, path: str) -> bytes:
        """An entry file's bytes, read without following a link or blocking; EntryError
        when it is not a regular file, OSError when it cannot be read."""
        return read_regular(path)

    def _touch(self, path: str) -> None:
        if not self.writable:
            return
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):  # mtime kept exactly: see signature()
                os.utime(path, ns=(time.time_ns(), st.st_mtime_ns), follow_symlinks=False)
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
        error = _entry.too_large(len(data))
        if error is not None:  # written, it would be a miss for every reader
            raise EntryError(f"entry {entry.key[:16]}...: {error}")
        folder = os.path.dirname(path)
        tmp = None
        try:
            self._mkdir(folder)
            self._check_ours(folder, stat.S_ISDIR, "a shard folder")  # a link there: nothing written elsewhere
            try:
                fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=folder)
            except FileNotFoundError:  # a prune removed the folder, empty, just now
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
            old = self._check_ours(path, stat.S_ISREG, "an entry")
            if old is not None and not self._entry_is_ours(path):
                raise ownership.not_ours(path, "a file where an entry would be")
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
        if not self._fastattns:  # an empty folder made for the cache becomes fastattn's with its first entry
            self._fastattns = None
            self.is_fastattns()
        self._after_write(len(data) - (old or 0))
        return True

    @staticmethod
    def _check_ours(path: str, is_kind, what: str) -> int | None:
        """The size of `path` where it is of the kind fastattn makes there, None where
        nothing is there; an OSError naming it where something else is (left alone)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not is_kind(st.st_mode):
            raise OSError(errno.EEXIST, f"{_kind(st.st_mode)} where {what} would be, not fastattn's: left alone",
                          path)
        return st.st_size

    def holds(self, key: str) -> bool:
        """Whether the directory has a valid entry for `key` (counted nowhere: import
        reports it as already present, and replaces a damaged one). Another valid
        entry for the same key is as good as the bundle's: the key covers the config,
        the GPU and every version."""
        try:
            decode(read_regular(self.path_for(key)), expected_key=key)
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
            pruned = self.prune(max_bytes=self.max_bytes)
            for reason, paths in pruned.failed.items():
                self._warn_once("prune:" + reason, "fastattn cache: cannot remove %d entries over "
                                "FASTATTN_CACHE_MAX_BYTES from %s (%s), e.g. %s", len(paths), self.root, reason,
                                paths[0])

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
            dfd = os.open(folder, _FOLDER_FLAGS)  # a link there is not followed: no lock files made elsewhere
            try:
                fd = os.open(key + _LOCK_SUFFIX, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC,
                             0o664 if self.shared else 0o600, dir_fd=dfd)
            finally:
                os.close(dfd)
        except OSError:
            yield False
            return
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO named like a lock: not ours, go ahead without
            os.close(fd)
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

    def root_problem(self) -> str | None:
        """Why the directory cannot be a cache directory (it is a file, a FIFO, a broken
        link, unreadable), or None: a directory, or not made yet (an empty cache)."""
        try:
            st = os.stat(self.root)  # a root that is a link to a directory is fine: the user chose it
        except FileNotFoundError:
            return "not a directory (a symbolic link to a missing path)" if os.path.islink(self.root) else None
        except OSError as e:
            return f"cannot be read ({e.strerror})"
        if not stat.S_ISDIR(st.st_mode):
            return f"not a directory ({_kind(st.st_mode)})"
        if not os.access(self.root, os.R_OK | os.X_OK):
            return "cannot be read (permission denied)"
        return None

    def scan(self, with_headers: bool = True) -> Iterator[Union[EntryInfo, Stray]]:
        """Every entry file (valid or not), with its size and last use, and every stray
        (see the module's doc): from lstat and listings alone, but for the headers. A
        file removed after the listing (another process's clear) is not listed."""
        try:
            folders = sorted(os.listdir(self.root))
        except OSError:
            return
        for sub in folders:
            folder = os.path.join(self.root, sub)
            if sub == "locks" or len(sub) != 2:
                if sub.endswith(_SUFFIX):
                    yield Stray(folder, "named like an entry, outside any shard folder: not fastattn's")
                continue
            try:
                st = os.lstat(folder)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                if _is_shard(sub):
                    yield Stray(folder, f"{_kind(st.st_mode)} where a shard folder would be: not followed")
                continue
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                continue
            for name in names:
                if name.endswith(_SUFFIX):
                    item = self._scan_one(sub, os.path.join(folder, name), name[: -len(_SUFFIX)], with_headers)
                    if item is not None:
                        yield item

    def _scan_one(self, sub: str, path: str, key: str, with_headers: bool) -> Union[EntryInfo, Stray, None]:
        """What `path` is; None when it is gone: removed between the listing and here
        (by a clear or a prune in another process), which is no damage."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            return Stray(path, f"cannot be examined ({e.strerror or e}): left alone")
        if not KEY_PATTERN.fullmatch(key) or key[:2] != sub:
            return Stray(path, f"{_kind(st.st_mode)} not named after a cache key of its folder: not fastattn's")
        if not stat.S_ISREG(st.st_mode):
            return Stray(path, f"{_kind(st.st_mode)} named like an entry, not a regular file: not fastattn's")
        header, problem = None, ""
        if with_headers:
            try:
                error = _entry.too_large(st.st_size)
                if error is not None:  # what the header says cannot make it an entry
                    raise error
                with os.fdopen(_open_regular(path), "rb") as f:
                    header = read_header_from_file(f)
                if header["key"] != key:
                    raise EntryError(f"the header is for key {header['key'][:16]}..., the file's name "
                                     f"is {key[:16]}...")
            except FileNotFoundError:
                return None  # removed since its lstat
            except (OSError, EntryError) as e:
                if not self._entry_is_ours(path):
                    return Stray(path, _NO_MAGIC)
                header, problem = None, str(e) or type(e).__name__
        created = float(header["created"]) if header else st.st_mtime
        return EntryInfo(key, path, st.st_size, created, st.st_atime, header, problem)

    def read_header(self, info: EntryInfo) -> EntryInfo | None:
        """`info` (listed without headers) with its header read, as scan() reads it;
        None when the file is gone or is no longer an entry."""
        item = self._scan_one(info.key[:2], info.path, info.key, True)
        return item if isinstance(item, EntryInfo) else None

    def entries(self, with_headers: bool = True) -> Iterator[EntryInfo]:
        """Every entry file (valid or not) with its size and last use."""
        for item in self.scan(with_headers):
            if isinstance(item, EntryInfo):
                yield item

    def strays(self) -> Iterator[Stray]:
        """What is named like fastattn's and is not (never read or deleted): as scan()
        finds them, and files named like entries without the entry magic (a prune
        leaves them too)."""
        for item in self.scan(with_headers=False):
            if isinstance(item, Stray):
                yield item
            elif not self._entry_is_ours(item.path) and os.path.lexists(item.path):
                yield Stray(item.path, _NO_MAGIC)

    def prune(self, max_bytes: int | None = None, max_age: float | None = None, *,
              everything: bool = False) -> Pruned:
        """Removes entries unused for more than `max_age` seconds, then least-recently-used
        ones until at most `max_bytes` remain; then what fastattn left behind: temporary
        files of killed writers, lock files nobody holds (but those of the entries that
        stay), and in a directory that is fastattn's, shard folders left empty. Never a
        stray, nor a file fastattn did not write (store.ownership checks each before it
        goes). everything: every entry (clear).

        One pass over the directory, one lstat an entry: an entry old enough (or every
        one) is removed as it is listed; by size, the least recently used of the rest
        after the listing, each looked at again first (a stray put there since is left
        alone). An entry that cannot be removed (a read-only filesystem, an immutable
        folder; every one on a store that is not writable) is counted in the result with
        the reason; one that another process removed meanwhile is neither removed here
        nor a failure."""
        now = time.time()
        result = Pruned()
        if self.writable:
            self.is_fastattns()  # known before anything goes: an older fastattn's directory is known by its entries
        candidates: list[EntryInfo] = []  # listed, kept so far: what the size limit may remove
        staying: set[str] = set()  # the keys of the entries left: their lock files stay too
        total = 0
        for item in self.scan(with_headers=False):
            if isinstance(item, Stray):
                result.strays.append(item)
                continue
            if everything or (max_age is not None and now - item.last_used > max_age):
                gone = self._remove(item.path, result, look_again=False)  # its lstat was just now
                if gone is False:
                    total += item.size
                    staying.add(item.key)
                continue  # (None: a stray put there since, not counted as an entry)
            candidates.append(item)
            staying.add(item.key)
            total += item.size
        if max_bytes is not None and total > max_bytes:
            for info in sorted(candidates, key=lambda i: i.last_used):
                if total <= max_bytes:
                    break
                if self._remove(info.path, result, look_again=True) is not False:
                    total -= info.size
                    staying.discard(info.key)
        self._remove_debris(now, staying, result)
        with self._lock:
            self._total = total
            self.counters["pruned"] += result.removed
        return result

    def _remove(self, path: str, result: Pruned, *, look_again: bool) -> bool | None:
        """Unlinks the entry file `path`, counting it in `result`: True when it is gone
        (removed here, or by another process meanwhile), False when it could not be
        removed (the reason counted), None when it is no longer a regular file or lacks
        the entry magic (not fastattn's: left alone, listed in result.strays)."""
        try:
            if look_again and not stat.S_ISREG(os.lstat(path).st_mode):
                return None
            if not self.writable:
                raise OSError(errno.EROFS, "the cache is read-only (a store that is not writable)")
            if not self._entry_is_ours(path):
                if not os.path.lexists(path):
                    return True
                result.strays.append(Stray(path, _NO_MAGIC))
                return None
            os.unlink(path)
        except FileNotFoundError:
            return True
        except IsADirectoryError:
            return None  # a folder put there since, named like the entry
        except OSError as e:
            result.failed.setdefault(e.strerror or str(e), []).append(path)
            return False
        result.removed += 1
        return True

    def _remove_debris(self, now: float, staying: set[str], result: Pruned) -> None:
        """Temporary files older than _STALE_TMP_SECONDS (a writer has them for
        milliseconds), idle lock files but those of the entries `staying` (a build
        leaves one a key; a prune that keeps an entry does not rewrite the directory for
        its lock file), each checked as fastattn's (store.ownership); and, in a
        directory that is fastattn's, empty shard folders and an empty locks/: in a
        user's folder that also holds a cache, an empty folder may be the user's.
        Each one removed is named in `result`."""
        if not self.writable:
            return
        try:
            folders = os.listdir(self.root)
        except OSError:
            return
        fastattns = self.is_fastattns()
        for sub in sorted(folders):
            folder = os.path.join(self.root, sub)
            if not _is_shard(sub) or not os.path.isdir(folder) or os.path.islink(folder):
                continue
            with contextlib.suppress(OSError):
                for name in sorted(os.listdir(folder)):
                    if ownership.is_temp_name(name):
                        self._remove_temp(os.path.join(folder, name), now, result)
            if fastattns:
                self._remove_folder(folder, "an empty shard folder", result)
        locks = os.path.join(self.root, "locks")
        if os.path.isdir(locks) and not os.path.islink(locks):
            with contextlib.suppress(OSError):
                for name in sorted(os.listdir(locks)):
                    key = name[: -len(_LOCK_SUFFIX)]
                    if name.endswith(_LOCK_SUFFIX) and key not in staying and KEY_PATTERN.fullmatch(key):
                        if self._remove_idle_lock(os.path.join(locks, name)):
                            result.also_removed.append((os.path.join(locks, name), "an idle lock file"))
            if fastattns:
                self._remove_folder(locks, "an empty lock folder", result)

    @staticmethod
    def _remove_temp(path: str, now: float, result: Pruned) -> None:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if (stat.S_ISREG(st.st_mode) and now - st.st_mtime > _STALE_TMP_SECONDS
                    and ownership.begins_as_entry(path, empty_ok=True)):
                os.unlink(path)
                result.also_removed.append((path, "a temporary file left by a killed writer"))

    @staticmethod
    def _remove_folder(folder: str, what: str, result: Pruned) -> None:
        try:
            os.rmdir(folder)  # only when empty; a writer that finds it gone makes it again
        except OSError:
            return
        result.also_removed.append((folder, what))

    @staticmethod
    def _remove_idle_lock(path: str) -> bool:
        """Unlinks a lock file that nobody holds, holding it meanwhile; whether it did.
        A process that opened it just before gets its lock on the unlinked file: at
        worst one plan is built twice, which is all a lock here prevents."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not ownership.is_idle_lock_file(st):
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # held: a build is under way
            now = os.lstat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
                return True
        except OSError:
            pass
        finally:
            os.close(fd)
        return False

    def clear(self) -> Pruned:
        """Removes every entry (and fastattn's debris, as prune does): see prune()."""
        return self.prune(everything=True)
