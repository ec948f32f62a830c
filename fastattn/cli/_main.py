"""The `fastattn` command's parser and its one entry point, `main`: the one place an
outcome becomes an exit code and the one error boundary (no traceback reaches the user;
with --json, stdout is one JSON document on every path), and the one place the
FASTATTN_* variables are checked (every runtime one, before any command runs)."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Sequence

from .. import env as _env
from ..files import shown
from ..errors import CudaError, CudnnError, InvalidArgumentError, LibraryError
from . import cache, info, matrix, probe, warm
from ._common import (EXIT_BAD_INPUT, EXIT_BUG, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NO_GPU, EXIT_TERMINATED, Parser,
                      UsageError, plain_text, printable_lines, say, settle_stderr, to_stderr)

# One module per command group; each adds its parser and runs its command.
_COMMANDS = {"info": info, "probe": probe, "warm": warm, "matrix": matrix, "cache": cache}

# Expected failures, by class: the exit code each means. Anything else is a bug.
_EXPECTED = (
    (InvalidArgumentError, EXIT_BAD_INPUT),
    ((LibraryError, CudaError, CudnnError), EXIT_NO_GPU),
    (ConnectionError, EXIT_FAILED),  # the remote tier, for push and pull
)


def build_parser() -> Parser:
    from .. import __version__

    p = Parser(prog="fastattn", description="cuDNN fused attention with plans built once. Exit codes: 0 success, "
               "1 not supported by cuDNN, 2 bad input (flags, files, FASTATTN_* values), 3 no usable GPU stack (or "
               "fastattn's compiled extension does not import), 4 some work failed, 5 a bug in "
               "fastattn (the traceback is written to a file), 130 interrupted (SIGINT), 143 terminated (SIGTERM).")
    p.add_argument("--version", action="version", version=f"fastattn {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in _COMMANDS.values():
        module.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command; its exit code. Whatever stderr is (closed, full), the code is the
    outcome's: every line for stderr goes through _common.to_stderr, which never raises."""
    with _terminate_cleanly():
        try:
            code = _main(argv)
            _flush()  # what is still buffered fails here, not at the interpreter's exit
        except _OutputFailed as e:
            code = _output_failed(e.error)
    settle_stderr()
    return code


class _Terminated(BaseException):
    """SIGTERM arrived: raised in the main thread, as SIGINT raises KeyboardInterrupt, so
    that what the command started is stopped and cleaned up on the way out (warm's
    workers and compilers, temporary files and folders) instead of left behind by the
    default action, which ends the process on the spot. A BaseException: no `except
    Exception` on the way swallows it."""


def _on_sigterm(signum, frame):
    raise _Terminated()


@contextlib.contextmanager
def _terminate_cleanly():
    """SIGTERM raises _Terminated while the command runs (in the main thread only, where
    Python runs signal handlers); the handler before it is put back after."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --json is one switch for the whole line, wherever it stands (`fastattn cache --json
    # ls`), and known before parsing, so that usage errors are JSON too.
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    try:
        try:
            args = _parse(argv, as_json)
        except _Exit as e:
            return e.code
        args.json = as_json or bool(getattr(args, "json", False))
        # Every FASTATTN_* variable fastattn reads at run time, checked once here, before
        # any command starts: a bad value is exit 2 naming it on every command, not only
        # on those whose path happens to read it (and a surprise later on the others').
        _env.check_all()
        code, out = _COMMANDS[args.command].run(args)
        _emit(out, args.json)
        return code
    except _OutputFailed:
        raise  # main's: whatever the outcome was, it cannot be told on stdout
    except UsageError as e:
        if as_json:
            _print_json({"error": "UsageError", "message": str(e)})
        else:
            to_stderr(printable_lines(f"{e.usage}fastattn: error: {e}") + "\n")  # argparse echoes values raw
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        say("fastattn: interrupted")
        return EXIT_INTERRUPTED
    except _Terminated:
        say("fastattn: terminated (SIGTERM)")
        return EXIT_TERMINATED
    except Exception as e:  # the boundary: every exception ends here, as an exit code and one line
        for classes, code in _EXPECTED:
            if isinstance(e, classes):
                return _fail(as_json, code, e)
        return _bug(as_json, e, argv)


class _OutputFailed(Exception):
    """A write to stdout failed (a full disk, a closed descriptor): raised by _write,
    whatever path the command took, and turned into exit 4 by `main`."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def _write(text: str) -> None:
    """Every byte `fastattn` prints on stdout goes through here, flushed at once, so
    that a failed write is known here and not lost (argparse ignores write errors) or
    met at the interpreter's exit.

    A reader that went away (EPIPE: `| true`, `| head -1`) is no failure: the rest of
    the output goes nowhere and the exit code stays the outcome's. Whether a reader
    took all, part or none of the output depends on when it left (a pipe holds 64 KiB
    before a write waits), so no other rule gives one exit code for one outcome."""
    if sys.stdout is None:  # started with descriptor 1 closed (`fastattn info >&-`)
        raise _OutputFailed(OSError(errno.EBADF, "it is closed"))
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
    except OSError as e:
        raise _OutputFailed(e) from None


def _flush() -> None:
    if sys.stdout is not None:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _discard_stdout()
        except OSError as e:
            raise _OutputFailed(e) from None


def _discard_stdout() -> None:
    """What is still buffered for stdout, and what is written after, goes to the null
    device, so that no later write or the interpreter's flush at exit fails again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, sys.stdout.fileno())
        finally:
            os.close(null)


def _output_failed(error: OSError) -> int:
    """Exit 4 (the work was done, its outcome not delivered) and one line on stderr."""
    _discard_stdout()
    say(f"fastattn: cannot write the output to stdout: {error.strerror or error}")
    return EXIT_FAILED


class _Exit(Exception):
    def __init__(self, code: int):
        self.code = code


def _parse(argv: list[str], as_json: bool):
    # What argparse prints (--help, --version) is captured and printed by _write: argparse
    # itself ignores a failed write.
    parser = build_parser()
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            return parser.parse_args(argv)
    except SystemExit as e:  # --help, --version: printed, done
        if as_json:  # what they print becomes a JSON document
            _print_json({"output": text.getvalue()})
        else:
            _write(text.getvalue())
        raise _Exit(e.code if isinstance(e.code, int) else 0) from None


def _emit(out: dict[str, Any], as_json: bool) -> None:
    text = out.pop("_text", None)  # the human form, when a handler made one ("": nothing for stdout)
    # Why the command could not do its work, in words: stderr, as every failure's message
    # is, so that stdout holds results only. With --json the document says it.
    diagnostics = out.pop("_stderr", None)
    if as_json:
        _print_json(out)
        return
    # Whatever the text holds (a stored header's strings, a path, cuDNN's reason), no
    # terminal control reaches the terminal; JSON escapes them itself.
    if text is None or text:
        _write(printable_lines(plain_text(out) if text is None else text) + "\n")
    if diagnostics:
        say(diagnostics)


def _print_json(value: Any) -> None:
    _write(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _fail(as_json: bool, code: int, error: BaseException) -> int:
    message = _words(error)
    if as_json:
        _print_json({"error": type(error).__name__, "message": message})
    else:
        say(f"fastattn: {type(error).__name__}: {message}")
    return code


def _words(error: BaseException) -> str:
    """An expected failure's message. An OSError made by the system (a connection's
    ConnectionResetError, BrokenPipeError) prints as "[Errno 32] Broken pipe": said here
    as the system's reason and the file it names, without Python's errno prefix."""
    if isinstance(error, OSError) and error.strerror and str(error).startswith("[Errno"):
        where = f": {error.filename}" if error.filename is not None else ""
        return f"{error.strerror}{where}"
    return str(error)


def _bug(as_json: bool, error: BaseException, argv: list[str]) -> int:
    """One line that says it is a bug, and where the traceback is; never the traceback
    itself on the terminal."""
    report = "".join(traceback.format_exception(error))
    try:
        fd, path = tempfile.mkstemp(prefix=f"fastattn-bug-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"fastattn {' '.join(argv)}{' --json' if as_json else ''}\n\n{report}")
    except OSError:
        path = None
    where = f"the traceback is in {shown(path)}" if path else "the traceback could not be written to a file"
    message = f"{type(error).__name__}: {error}"
    if as_json:
        _print_json({"error": "Bug", "message": message, "traceback_file": path})
    else:
        say(f"fastattn: a bug in fastattn ({message}); {where}; please report it")
    return EXIT_BUG


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
