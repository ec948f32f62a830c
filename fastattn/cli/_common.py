"""What every `fastattn` subcommand shares: the exit codes, the parser class and flag
parsers, the exit code of a warm report, and how results and failures are printed.

Handlers return (exit code, result dict); "_text" in the dict is the human form of the
result (stdout), "_stderr" the words on why the command could not do its work (stderr:
stdout holds results only, on every command).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import textwrap
from typing import Any

from .. import parsing
from ..files import printable  # noqa: F401  (the commands' one escape, re-exported)

# The exit codes, for every outcome (the README's table says the same).
EXIT_OK = 0           # success (probe: supported; matrix: the grid was made)
EXIT_UNSUPPORTED = 1  # cuDNN does not support the config (warm: some configs)
EXIT_BAD_INPUT = 2    # bad flags, files or values; a refused bundle
EXIT_NO_GPU = 3       # no usable GPU stack: driver, CUDA or cuDNN missing, a CUDA error
EXIT_FAILED = 4       # some work failed: a crashed config, damaged entries, Redis unreachable, a plan
                      # that failed verification (--verify: refused with the evidence, never served),
                      # stdout not written (a full disk; a reader that went away is no failure)
EXIT_BUG = 5          # an unexpected exception: a bug in fastattn (the traceback goes to a file)
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT
EXIT_TERMINATED = 143  # SIGTERM (a supervisor's stop), as shells report it: after cleaning up, as for SIGINT
EXIT_CODES = (EXIT_OK, EXIT_UNSUPPORTED, EXIT_BAD_INPUT, EXIT_NO_GPU, EXIT_FAILED, EXIT_BUG, EXIT_INTERRUPTED,
              EXIT_TERMINATED)
INT_MAX = 2**31 - 1  # the largest size cuDNN takes (its masks and windows are int32)


_NEGATIVE_LOOKING = re.compile(r"-\.?[0-9]")


class UsageError(Exception):
    """Bad flags, as argparse found them; `main` prints it as text or JSON."""

    def __init__(self, message: str, usage: str):
        super().__init__(message)
        self.usage = usage


class Parser(argparse.ArgumentParser):
    """Every parser of the command: usage errors raise, and flags are written in full
    (no abbreviations: `--jso` is an error everywhere, not --json in one place and a
    stray word in another, and a new flag cannot change what an old prefix meant)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # A word of a dash and a digit (or a point and a digit) is a value, not a flag: no
        # flag is spelled so, and argparse's own rule takes only plain numbers (-5, -.5),
        # so `--max-age -5d` would be "expected one argument" instead of naming -5d.
        self._negative_number_matcher = _NEGATIVE_LOOKING

    def add_subparsers(self, **kwargs):
        # A command group's command is checked here (parse_known_args), not by argparse,
        # whose message names the group's internal dest ("required: cache_command").
        # Its metavar is what argparse names it by in a refusal ("argument COMMAND: invalid
        # choice"), not the dest.
        kwargs["required"] = False
        kwargs.setdefault("metavar", "COMMAND")
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) is None:
                self.error(f"a command is needed: one of {', '.join(action.choices)} ({self.prog} --help)")
        return parsed, extras

    def error(self, message: str):  # raise, not exit: main reports it (as JSON with --json) with exit code 2
        # argparse quotes values itself too (an invalid choice, unrecognized arguments):
        # shortened here, as echo() shortens ours.
        raise UsageError(_LONG_WORD.sub(lambda m: _shortened(m.group()), message), self.format_usage())


def add_json_flag(parser: argparse.ArgumentParser, help: str = "print JSON") -> None:
    # `main` also takes --json anywhere on the line (`fastattn cache --json ls`); this
    # flag is what --help shows.
    parser.add_argument("--json", action="store_true", help=help)


VERIFY_HELP = ("also run each plan once on random and adversarial data (rows with log-sum-exp below -88.7; "
               "with padding, random lengths) against a float32 reference on the GPU, forward and backward, and "
               "store the verdict in its cache entry (entries verified before need no second run); a plan that "
               "fails is refused with the evidence and never served (exit 4). Needs PyTorch (exit 2 without it)")


def add_verify_flag(parser: argparse.ArgumentParser) -> None:
    """--verify, the one declaration `probe` and `warm` share (fastattn.verify)."""
    parser.add_argument("--verify", action="store_true", help=VERIFY_HELP)


def check_verify_possible() -> None:
    """--verify's reference runs on PyTorch: without it, a usage error (exit 2) naming
    the flag and what is missing, before any work starts."""
    import importlib.util

    from ..errors import InvalidArgumentError

    if importlib.util.find_spec("torch") is None:
        raise InvalidArgumentError("--verify: needs PyTorch for its float32 GPU reference (fastattn.torch's "
                                   "optional extra), and torch is not installed here: pip install torch, or run "
                                   "without --verify")


# -- flag parsers: each names the value and the rule; argparse adds the flag's name -----

_ECHO = 80  # the most characters of a value a message quotes
_LONG_WORD = re.compile(r"\S{%d,}" % (_ECHO + 20))


def _shortened(text: str) -> str:
    return f"{text[:_ECHO]}... ({len(text)} characters)"


def echo(value: str) -> str:
    """A flag's value as a message quotes it: its repr (quotes, escapes) when it has at
    most _ECHO characters; else its first _ECHO and its length, so that a 5000-digit
    value does not fill the screen (and the rule after it stays in sight)."""
    value = str(value)
    if len(value) <= _ECHO:
        return repr(value)
    quoted = repr(value[:_ECHO])
    return f"{quoted[:-1]}...{quoted[-1]} ({len(value)} characters)"



# What a flag takes as a number is read by fastattn.parsing, one parser per kind, as the
# FASTATTN_* variables of the same kind are: a count (integer, ints), a real number
# (number), a duration (duration: --timeout, --max-age), a size in bytes (size). Each
# argparse type carries its kind (`number_kind`), so that tests find every numeric flag.
_SPACES = parsing.SPACES
MAX_AGE = 36500 * 86400.0  # 100 years: an entry unused for longer than that cannot exist


def _typed(parse, kind: str, name: str):
    parse.number_kind = kind
    parse.__name__ = name  # argparse names the type in some messages
    return parse


def _read(read, text: str, *args, **kwargs):
    """read(text, ...) of fastattn.parsing, its ValueError said as a usage error quoting
    the value (argparse adds the flag's name)."""
    try:
        return read(text, *args, **kwargs)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{echo(text)} {e}") from None


def _integer(text: str, minimum: int | None, maximum: int | None) -> int:
    return _read(parsing.integer, text, minimum, maximum)


def integer(minimum: int | None = None, maximum: int | None = INT_MAX):
    """An argparse type: a count, an integer within [minimum, maximum], in ASCII digits."""
    return _typed(lambda text: _integer(text, minimum, maximum), "count", "integer")


def _items(text: str) -> list[str]:
    """A comma-separated list's items (fastattn.parsing.items: an empty one is refused)."""
    try:
        return parsing.items(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{echo(text)}: {e}") from None


def _ints(text: str, minimum: int | None = 1, maximum: int | None = INT_MAX) -> list[int]:
    """A comma-separated list of integers within [minimum, maximum]."""
    return [_integer(v, minimum, maximum) for v in _items(text)]


ints = _typed(_ints, "count", "ints")


def number(minimum: float | None = None, maximum: float | None = None, *, above: float | None = None,
           below: float | None = None):
    """An argparse type: a finite real number within the bounds (above/below: exclusive)."""
    return _typed(lambda text: _read(parsing.real, text, minimum, maximum, above=above, below=below), "real",
                  "number")


def duration(maximum: float, *, above: float | None = None):
    """An argparse type: a duration in seconds (90s, 12h, 30d; a bare number is seconds),
    at most `maximum` seconds (above: more than it)."""
    return _typed(lambda text: _read(parsing.duration, text, maximum, above=above), "duration", "duration")


DURATION_HELP = "a number with s, m, h, d or w; a bare number is seconds"


def _size(text: str) -> int:
    """An argparse type: a size in bytes (500M, 1.5G), below 8 EiB."""
    return _read(parsing.size, text)


size = _typed(_size, "bytes", "size")


def checked_by(parse, check):
    """`parse`, its value then passed through check(value) (a config field's own
    validator): an InvalidArgumentError from it is a usage error with its reason, so a
    flag's range is the field's, by construction."""
    from ..errors import InvalidArgumentError

    def parse_checked(text: str):
        value = parse(text)
        try:
            return check(value)
        except InvalidArgumentError as e:  # "scale=1e+300: is out of float32 range ...": the reason
            raise argparse.ArgumentTypeError(f"{echo(text)} {str(e).split(': ', 1)[-1]}") from None

    return _typed(parse_checked, parse.number_kind, parse.__name__)


def not_zero(parse, why: str):
    """`parse`, refusing a value of 0 with `why`: where zero would do what another
    command does (a prune to 0 bytes is a clear), it is not read as "no limit" either."""

    def parse_not_zero(text: str):
        value = parse(text)
        if value == 0:
            raise argparse.ArgumentTypeError(f"{echo(text)} {why}")
        return value

    return _typed(parse_not_zero, parse.number_kind, parse.__name__)


def choices(allowed):
    def parse(text: str) -> list[str]:
        values = _items(text)
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{echo(bad[0])} is not one of {', '.join(allowed)}")
        return values

    parse.__name__ = "choices"
    return parse


def _ascii_lengths(text: str, form: str, largest: str) -> None:
    """What the length parsers (fastattn.shape_classes) take from a flag: ASCII digits
    (their \\d takes any script's), of at most the digits of the largest length; else
    the rule, `form` (what is written) or `largest` (the range)."""
    if not text.isascii():
        raise argparse.ArgumentTypeError(f"{echo(text)}: {form}, in ASCII digits 0-9")
    if any(len(run) > len(str(INT_MAX)) for run in re.findall(r"[0-9]+", text)):
        raise argparse.ArgumentTypeError(f"{echo(text)}: {largest}")


def length_range(text: str) -> tuple[int, int]:
    """An argparse type: sequence lengths LO..HI (inclusive) or one length
    (fastattn.shape_classes.parse_range)."""
    from ..shape_classes import parse_range

    _ascii_lengths(text, "expected LO..HI (e.g. 1..32768) or one length", f"expected 1 <= LO <= HI <= {INT_MAX}")
    try:
        return parse_range(text)
    except ValueError as e:  # (its message quotes the value whole: quoted here by echo)
        raise argparse.ArgumentTypeError(f"{echo(text)}: {str(e).split(': ', 1)[-1]}") from None


length_range.__name__ = "length range"


def shape_classes(text: str):
    """An argparse type: auto, off or ascending class bounds (fastattn.shape_classes.parse)."""
    from ..shape_classes import parse

    _ascii_lengths(text, 'expected "auto", "off" or comma-separated lengths (e.g. "256,1024,4096")',
                   f"a boundary must be an int in 2..{INT_MAX}")
    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{echo(text)}: {str(e).split(': ', 1)[-1]}") from None


def input_path(text: str) -> str:
    """A file (or text) the command reads: never empty (which would otherwise mean "none
    given") nor `-` (fastattn reads no stdin: a file named `-` is ./-), and, where the
    path names something, a regular file: a FIFO would block the command forever, a
    device such as /dev/zero never end, a folder is no file."""
    from .. import files

    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    if text == "-":
        raise argparse.ArgumentTypeError("'-' (stdin) is not read here: name a file (./- for a file named -)")
    problem = files.not_readable(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{echo(text)}: {problem}")
    return text


def output_file(text: str) -> str:
    """A file the command will write at its end (through fastattn.files.write_file):
    checked now, so that a long run is not lost to a typo in the path. Never `-`:
    fastattn's stdout is its report. Only a new path or a regular file: a device node,
    a FIFO, a socket or a link there would be replaced by the write, and is refused."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path")
    if text == "-":
        raise argparse.ArgumentTypeError("'-' (stdout) is not written here: name a file (./- for a file named -)")
    from .. import files

    path = os.path.abspath(text)
    parent = os.path.dirname(path)
    if os.path.isdir(path) and not os.path.islink(path):
        raise argparse.ArgumentTypeError(f"{echo(text)} is a directory, not a file")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{echo(text)}: the directory {echo(parent)} does not exist")
    problem = files.not_replaceable(path)  # the write would replace a device node, a FIFO, a link
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{echo(text)}: {problem}")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{echo(text)}: not writable here")
    return text


def printable_lines(text: str) -> str:
    """printable() on each line of `text`, its line breaks kept: what `main` does to
    every text it prints, whatever made it."""
    return "\n".join(printable(line) for line in text.split("\n"))


def to_stderr(text: str) -> bool:
    """Writes `text` to stderr, flushed; whether it was. Never raises: stderr may be
    closed (`2>&-`: sys.stderr is None), on a full disk (ENOSPC) or a pipe nobody reads,
    and the exit code is the outcome whatever it is. Every line the command writes to
    stderr goes through here. After a failed write stderr is pointed at os.devnull, so
    that what stays in its buffer does not fail again at the interpreter's exit (which
    would make the exit code 120)."""
    stream = sys.stderr
    if stream is None:
        return False
    try:
        stream.write(text)
        stream.flush()
        return True
    except (OSError, ValueError):  # ValueError: a closed file object
        with contextlib.suppress(OSError, ValueError, AttributeError):
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, stream.fileno())
            finally:
                os.close(null)
        return False


def say(line: str) -> None:
    """One line on stderr (a failure, a warning; a message's own lines kept, their
    controls escaped: printable_lines), through to_stderr."""
    to_stderr(printable_lines(line) + "\n")


def settle_stderr() -> None:
    """What is still buffered on stderr (logging's lines, a warning's) written now, or
    dropped: `main`'s last step, so that the interpreter's own flush at exit cannot fail."""
    to_stderr("")


def wrap(text: str, indent: str = "  ", width: int = 100) -> list[str]:
    """A reason over lines, whole: never cut mid-word (or at all). Each of its own lines
    starts a line, with its own indentation, so that a list (a LibraryError's missing
    libraries, "  - ..." each) stays a list; a long line continues two columns in."""
    out: list[str] = []
    for line in text.splitlines():
        body = line.lstrip()
        if not body:
            continue
        own = indent + line[: len(line) - len(body)]
        out.extend(textwrap.wrap(body, width=width, initial_indent=own, subsequent_indent=own + "  ",
                                 break_long_words=False, break_on_hyphens=False))
    return out or [indent]


def exit_code(report) -> int:
    """A warm report's exit code: no GPU stack at all, some configs failed (or failed
    verification), some refused, or all good."""
    failed = [i for i in report.items if i.status == "failed"]
    if failed and len(failed) == len(report.items) and all(i.error_type in ("LibraryError", "CudaError")
                                                           for i in failed):
        return EXIT_NO_GPU
    if failed or any(i.status == "rejected" for i in report.items):
        return EXIT_FAILED
    return EXIT_UNSUPPORTED if report.counts["unsupported"] else EXIT_OK


def this_environment() -> dict[str, Any] | None:
    """This machine's GPU and versions, or None when there is no usable GPU."""
    from .. import runtime
    from ..errors import CudaError, LibraryError

    try:
        return runtime.cache_environment()
    except (LibraryError, CudaError):
        return None


def gpu_environment(needed_for: str) -> dict[str, Any]:
    """This machine's GPU and versions, or the LibraryError or CudaError (exit 3, as on
    every command) that says why there is none, after what needed one."""
    from .. import runtime
    from ..errors import CudaError, LibraryError

    try:
        return runtime.cache_environment()
    except (LibraryError, CudaError) as e:
        raise type(e)(f"{needed_for}: {e}") from None


def plain_text(value: Any, indent: str = "") -> str:
    """A result as readable lines (`key: value`, nested blocks indented, lists of
    records as `- ` items), never Python's reprs."""
    return "\n".join(_lines(value, indent))


def _scalar(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)) and all(not isinstance(v, (dict, list, tuple)) for v in value):
        return ", ".join(_scalar(v) for v in value) if value else "none"
    if isinstance(value, dict) and not value:
        return "none"
    return str(value)


def _is_block(value: Any) -> bool:
    return (isinstance(value, dict) and bool(value)) or (
        isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value))


def _lines(value: Any, indent: str) -> list[str]:
    out: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if _is_block(v):
                out.append(f"{indent}{k}:")
                out.extend(_lines(v, indent + "  "))
            else:
                text = _scalar(v).replace("\n", "\n" + indent + "  ")  # a multi-line message stays in its block
                out.append(f"{indent}{k}: {text}")
    elif isinstance(value, (list, tuple)):
        for item in value:
            inner = _lines(item, indent + "  ") if _is_block(item) else [indent + "  " + _scalar(item)]
            out.append(indent + "- " + inner[0][len(indent) + 2:])
            out.extend(inner[1:])
    else:
        out.append(indent + _scalar(value))
    return out

