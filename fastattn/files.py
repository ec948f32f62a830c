"""Files a user names for fastattn to write (a bundle, `warm --report`, `matrix --png`):
published whole or not at all, and only where nothing but a regular file stands; and
files it reads (a bundle, a config file, a key file): regular files only (not_readable,
and again on the opened descriptor: open_regular, read_regular).

A temporary file in the same folder is written, flushed and fsynced, then renamed over
the path: a reader sees the old file or the new one, never part of one. A rename
replaces whatever the path names, so a device node (a copy of /dev/null), a FIFO, a
socket or a symbolic link there would become a regular file and be lost: such a path
is refused (NotRegularFileError), when the command checks its flags
(fastattn.cli._common.output_file, through not_replaceable) and again just before the
rename. A node made in the instant between that last look and the rename would still
be replaced; no rename of Linux's refuses a target by its kind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from typing import BinaryIO, Iterator

__all__ = ["FileTooLargeError", "NotRegularFileError", "kind", "not_readable", "not_replaceable", "open_regular",
           "printable", "read_regular", "replacing", "shown", "write_file"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class NotRegularFileError(OSError):
    """The path names something other than a regular file (strerror says what): not
    replaced."""


class FileTooLargeError(OSError):
    """The file holds more than its reader takes (strerror says how much it takes): read
    no further than that."""


def printable(text: str) -> str:
    """`text` with each character that is not printable escaped as Python writes it
    (an ANSI escape as \\x1b, a newline as \\n, a NUL as \\x00, a surrogate from an
    undecodable file name as \\udcff); printable ones, accents and CJK included, as
    they are. For what a message shows from elsewhere (a stored header's strings, a
    file name, a flag's value): it cannot paint the terminal, move its cursor or forge
    a line of the output."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def shown(path: str | os.PathLike) -> str:
    """A path as every message shows it: one line, whatever its name holds (a newline
    in a file name would otherwise start a line of the message's choosing)."""
    return printable(os.fsdecode(path))


def kind(mode: int) -> str:
    """What an lstat's st_mode is, in words ("a FIFO")."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def not_replaceable(path: str) -> str | None:
    """Why writing `path` would destroy what is there ("a FIFO, not a regular file: not
    replaced") or cannot be done (it cannot be looked up: a name too long, a file where
    a folder should be), or None: nothing there, or a regular file. Links are not
    followed: a link is what would be replaced."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # a name too long, a file where a folder should be: nothing can be written there
        return f"cannot be looked up ({e.strerror})"
    if stat.S_ISREG(st.st_mode):
        return None
    return f"{kind(st.st_mode)}, not a regular file: not replaced"


def not_readable(path: str) -> str | None:
    """Why reading `path` as a file would block or never end ("a FIFO, not a regular
    file: not read": a FIFO waits for a writer, /dev/zero never ends, a folder is not a
    file), or None: a regular file (links followed: the file they name is what is
    read), or nothing there (the reader says so)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # no such file, a name too long, a NUL in it
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    return f"{kind(st.st_mode)}, not a regular file: not read"


def open_regular(path: str) -> BinaryIO:
    """`path` open for reading, when it is a regular file (a link is followed: the file
    it names is what is read). Opened without blocking (O_NONBLOCK) and checked on the
    descriptor (fstat), so that what the path names at the moment it is opened is what
    is judged: a FIFO is never waited on, a device such as /dev/zero never read, a
    folder never taken for a file. Raises NotRegularFileError (strerror: "a FIFO, not a
    regular file: not read") for anything else, OSError when it cannot be opened,
    ValueError for a name holding a NUL."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, f"{kind(mode)}, not a regular file: not read", path)
        os.set_blocking(fd, True)  # (a regular file's reads never block; this keeps them plain)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str, limit: int) -> bytes:
    """The bytes of the regular file `path` (see open_regular), when it holds at most
    `limit` bytes: FileTooLargeError when it holds more, read no further than limit + 1
    bytes (a file that grows while it is read included)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise FileTooLargeError(errno.EFBIG, f"over {limit} bytes: not read", path)
        return data


def _refuse_unless_replaceable(path: str) -> None:
    problem = not_replaceable(path)
    if problem is not None:
        raise NotRegularFileError(errno.EEXIST, problem, path)


def write_file(path: str, data: bytes, *, private: bool = False) -> None:
    """Writes `data` to `path` atomically: see replacing()."""
    with replacing(path, private=private) as f:
        f.write(data)


@contextlib.contextmanager
def replacing(path: str, *, private: bool = False) -> Iterator[BinaryIO]:
    """A file to write what `path` will hold, written as it is made (never whole in
    memory); at the end of the block it is flushed, fsynced and renamed over `path`,
    atomically. private: mode 0600 whatever the umask (a bundle: native code, and a
    credential's work when signed); else the mode open() would give (0666 less the
    umask). Raises NotRegularFileError where the path names anything but a regular file
    (before writing, and again before the rename), OSError where it cannot be written;
    on any failure, the block's own included, the path is left as it was and no
    temporary file remains."""
    _refuse_unless_replaceable(path)
    folder = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    while True:  # mkstemp's exclusive create, with the mode chosen here, not mkstemp's 0600
        tmp = os.path.join(folder, f".{base}.tmp-{secrets.token_hex(6)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC,
                         0o600 if private else 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            if private:
                os.fchmod(f.fileno(), 0o600)  # the umask may have taken bits of 0600 away too
            yield f
            f.flush()
            os.fsync(f.fileno())
        _refuse_unless_replaceable(path)  # what was put there while the file was written
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
