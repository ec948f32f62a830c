"""FASTATTN_RECORD: the configs a process asks plans for, appended to a file that
`fastattn warm FILE` reads back.

A deploy-time pre-warm has to know what the workload will ask for, and a model's calls
(through fastattn.torch, fastattn.flash, transformers or the SDPA mode) reach configs
that nobody writes down by hand: batch sizes, lengths, windows, paged layouts. Run the
workload once with FASTATTN_RECORD=FILE (in staging, or a test suite), then
`fastattn warm FILE` on each machine builds exactly that set, in parallel.

The file is JSON Lines: each distinct config this process asked for (runtime's first
request for it: a build, a load or a refusal, memory hits never), as its canonical
JSON, one a line. The configs written are remembered up to FASTATTN_MEMORY_MAX_ENTRIES
(fastattn.bounded): one asked for again after it was forgotten is written again, which
`fastattn warm FILE` reads as one. Appended with one write(2) each on a descriptor
opened O_APPEND, so processes recording into one file interleave whole lines. Recording never fails a
call: a file that cannot be written warns once (RuntimeWarning) and this process
records nothing more into it.
"""

from __future__ import annotations

import os
import threading
import warnings

from . import bounded, env
from .config import AttentionConfig
from .files import shown

_lock = threading.Lock()
_seen = bounded.Table("recorded")  # (path, config) -> True: written already
_files: dict[str, int | None] = {}  # path -> its descriptor; None: it failed, recording into it stopped


def note(config: AttentionConfig) -> None:
    """Appends `config` to FASTATTN_RECORD's file, the first time this process asks for
    it. A bad FASTATTN_RECORD raises InvalidArgumentError, as every variable does."""
    path = env.get("FASTATTN_RECORD")
    if not path:
        return
    bounded.max_entries()  # (read before the lock: a bad value raises before anything changes)
    with _lock:
        if (path, config) in _seen:
            return
        fd = _files.get(path, -1)
        if fd == -1:
            fd = _files[path] = _open(path)
        if fd is None:
            return
        _seen.keep((path, config), True)
        line = (config.to_json() + "\n").encode()
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(f"wrote {written} of {len(line)} bytes")
        except OSError as e:
            _stop(path, e)


def _open(path: str) -> int | None:
    # O_NONBLOCK: a FIFO nobody reads would block the first plan() for good (here it fails
    # with ENXIO and warns); a regular file ignores it.
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as e:
        _stop(path, e, opened=False)
        return None


def _stop(path: str, error: OSError, opened: bool = True) -> None:
    fd = _files.get(path)
    if opened and fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    _files[path] = None
    reason = error.strerror or str(error)
    warnings.warn(f"fastattn: FASTATTN_RECORD={shown(path)} cannot be written ({reason}); this process records nothing "
                  "more into it", RuntimeWarning, stacklevel=4)


def reset() -> None:
    """Forgets what was recorded and closes the files (tests; a process that changes
    FASTATTN_RECORD needs nothing of this: each path has its own descriptor)."""
    with _lock:
        for fd in _files.values():
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        _files.clear()
        _seen.clear()
