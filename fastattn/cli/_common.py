"""What every `fastattn` subcommand shares: the exit codes, the parser class and flag
parsers, the exit code of a warm report, and how results and failures are printed.

Handlers return (exit code, result dict); "_text" in the dict is the human form.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_OK, EXIT_UNSUPPORTED, EXIT_BAD_INPUT, EXIT_NO_GPU, EXIT_FAILED = 0, 1, 2, 3, 4


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default exit code is 2 too; keep one message format
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"fastattn: error: {message}\n")


def add_json_flag(parser: argparse.ArgumentParser, help: str = "print JSON") -> None:
    parser.add_argument("--json", action="store_true", help=help)


def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("an empty list")
    return values


def choices(allowed):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r} is not one of {', '.join(allowed)}")
        return values

    return parse


def size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 500M, 2G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return int(value)


def age(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an age (e.g. 90s, 12h, 30d)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def exit_code(report) -> int:
    """A warm report's exit code: no GPU stack at all, some configs failed, some refused, or all good."""
    failed = [i for i in report.items if i.status == "failed"]
    if failed and len(failed) == len(report.items) and all(i.error_type in ("LibraryError", "CudaError")
                                                           for i in failed):
        return EXIT_NO_GPU
    if failed:
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


def print_plain(out: dict[str, Any]) -> None:
    """A result without a handler-made human form: one `key: value` line each, dicts indented."""
    for key, value in out.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v}")
        else:
            print(f"{key}: {value}")


def fail(args, code: int, error: Exception) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"error": type(error).__name__, "message": str(error)}, indent=2))
    else:
        print(f"fastattn: {type(error).__name__}: {error}", file=sys.stderr)
    return code
