"""What in a cache directory is fastattn's: the only things its clear, prune and
publish may remove or replace.

A directory is fastattn's cache when it holds a CACHEDIR.TAG that names fastattn
(https://bford.info/cachedir/: backup tools skip such a directory). fastattn writes the
tag in a directory it makes, and in one an older fastattn made (no tag), recognised by
its contents: only what fastattn puts there (shard folders of two hex digits holding
<key>.entry files and temporary files, locks/ holding <key>.lock files, the tag), and at
least one entry that begins with fastattn's magic. A directory holding anything else is
a user's folder that also holds a cache: never tagged (the tag would hide the user's
files from backups), and its folders are removed only when a prune emptied them.

Wherever the directory is, a file is removed or replaced only when it is what
fastattn writes, checked on the file itself just before: an entry is a regular file
named after its key in its key's shard folder, and, in a directory that is not
fastattn's, begins with entry.MAGIC (in fastattn's own directory a damaged entry, its
magic included, is still fastattn's file, which a rebuild overwrites and a clear
removes); a temporary file has mkstemp's name shape (.tmp- and eight of [a-z0-9_]) and
holds the beginning of an entry, or nothing (a writer killed before its first write); a
lock file is empty (fastattn creates lock files and never writes to them).
"""

from __future__ import annotations

import errno
import os
import re
import stat

from .entry import MAGIC

__all__ = ["TAG", "TAG_TEXT", "begins_as_entry", "is_idle_lock_file", "is_tagged", "is_temp_name", "not_ours",
           "old_cache_shape", "write_tag"]

TAG = "CACHEDIR.TAG"
_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
TAG_TEXT = (f"{_SIGNATURE}\n# This file is a cache directory tag created by fastattn (its plan cache).\n"
            "# For information about cache directory tags, see https://bford.info/cachedir/\n")
_TEMP = re.compile(r"\.tmp-[a-z0-9_]{8}")  # tempfile.mkstemp(prefix=".tmp-"): what DiskStore.publish makes
_SHARD = re.compile(r"[0-9a-f]{2}")
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.entry")
_LOCK_NAME = re.compile(r"[0-9a-f]{64}\.lock")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC


def is_tagged(root: str) -> bool:
    """Whether `root` holds fastattn's CACHEDIR.TAG (a regular file, not a link, that
    begins with the signature and names fastattn)."""
    try:
        fd = os.open(os.path.join(root, TAG), _READ)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, 512).decode("ascii", "replace")
    except OSError:
        return False
    finally:
        os.close(fd)
    return head.startswith(_SIGNATURE) and "fastattn" in head


def write_tag(root: str, mode: int = 0o644) -> None:
    """Writes the tag in `root` unless something is there already (a tag of another
    program's, a user's file: left as it is). Raises OSError when it cannot be written."""
    try:
        fd = os.open(os.path.join(root, TAG), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, mode)
        f.write(TAG_TEXT.encode("ascii"))


def is_temp_name(name: str) -> bool:
    return _TEMP.fullmatch(name) is not None


def begins_as_entry(path: str, *, empty_ok: bool) -> bool:
    """Whether the regular file `path` (not a link, never waited on) begins with the
    entry magic, or, for a file shorter than the magic, with its first bytes (nothing at
    all only when `empty_ok`). False for anything else, or what cannot be read."""
    try:
        fd = os.open(path, _READ)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, len(MAGIC))
    except OSError:
        return False
    finally:
        os.close(fd)
    if len(head) == len(MAGIC):
        return head == MAGIC
    return MAGIC.startswith(head) and (empty_ok or bool(head))


def is_idle_lock_file(st: os.stat_result) -> bool:
    """Whether an lstat is of a lock file fastattn made: regular and empty."""
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


def old_cache_shape(root: str) -> bool:
    """Whether `root` (without a tag) is a directory an older fastattn made: nothing in it
    but what fastattn puts there (see the module's doc), and an entry of fastattn's
    among it. Names are listed; entries are read (their first bytes) until one is fastattn's."""
    try:
        names = os.listdir(root)
    except OSError:
        return False
    entries = []
    for name in names:
        path = os.path.join(root, name)
        if name == TAG:
            continue
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                return False
            inside = os.listdir(path)
        except OSError:
            return False
        if name == "locks":
            if not all(_LOCK_NAME.fullmatch(n) for n in inside):
                return False
            continue
        if not _SHARD.fullmatch(name):
            return False
        for n in inside:
            if _ENTRY_NAME.fullmatch(n) and n.startswith(name):
                entries.append(os.path.join(path, n))
            elif not is_temp_name(n):
                return False
    return any(begins_as_entry(path, empty_ok=False) for path in entries)


def not_ours(path: str, what: str) -> OSError:
    """The error for a file fastattn would remove or replace and did not write."""
    return OSError(errno.EEXIST, f"{what}, not fastattn's (it lacks their format): left alone",
                   path)
