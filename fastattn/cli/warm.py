"""`fastattn warm`: load or build every config a file describes, and store them."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError
from ._common import add_json_flag, exit_code, integer, number, output_file, wrap

if TYPE_CHECKING:
    from ..warm import WarmItem


def add_parser(sub) -> None:
    warm = sub.add_parser("warm", help="load or build every config a file describes, and store them")
    warm.add_argument("file", nargs="?", help="JSON or TOML config file with sweeps (default: built-in model shapes)")
    warm.add_argument("--workers", type=integer(1), default=None, help="worker processes (default: min(8, CPUs))")
    warm.add_argument("--device", type=integer(0), default=None)
    warm.add_argument("--report", type=output_file, help="write the full report as JSON to this file")
    add_json_flag(warm, help="print the report as JSON")
    warm.add_argument("--no-progress", action="store_true", help="no progress bar")
    warm.add_argument("--torch-ops", action="store_true",
                      help="also build fastattn.torch's native op library for the installed torch (else built at "
                           "the first call)")
    warm.add_argument("--timeout", type=number(above=0), default=600.0,
                      help="seconds one config may take before its worker is killed (default 600)")


def _progress_bar():
    """A one-line bar on stderr, only on a terminal (logs and pipes get the table alone)."""
    if not sys.stderr.isatty():
        return None
    counts: dict[str, int] = {}

    def draw(done: int, total_: int, item: WarmItem) -> None:
        counts[item.status] = counts.get(item.status, 0) + 1
        width = 30
        filled = int(width * done / max(total_, 1))
        summary = " ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total_} {summary}   ")
        if done == total_:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return draw


def run(args) -> tuple[int, dict[str, Any]]:
    from .. import sweep
    from ..warm import warm

    configs = sweep.load_configs(args.file) if args.file else sweep.builtin_configs()
    report = warm(configs, workers=args.workers, device=args.device, timeout=args.timeout,
                  progress=None if args.no_progress or args.json else _progress_bar())
    out = report.to_dict()
    out["source"] = args.file or "built-in model shapes"
    if args.report:
        import json

        try:
            with open(args.report, "w") as f:
                json.dump(out, f, indent=2, sort_keys=True)
        except OSError as e:
            raise InvalidArgumentError(f"--report {args.report!r}: {e.strerror}") from None
    c = report.counts
    lines = [f"{'status':<12} {'seconds':>8}  config", "-" * 72]
    previous = None
    for item in report.items:
        lines.append(f"{item.status:<12} {item.seconds:8.3f}  {sweep.describe_config(item.config)}")
        if item.status in ("unsupported", "failed"):
            why = f"{item.error_type + ': ' if item.error_type else ''}{item.reason}"
            lines.extend(wrap("(the same as above)" if why == previous else why, indent=" " * 22))
            previous = why
    lines.append("-" * 72)
    lines.append(f"{len(report.items)} configs in {report.seconds:.1f} s, {report.processes} worker processes "
                 f"(at most {report.workers}): "
                 f"loaded {c['loaded']}, built {c['built']}, unsupported {c['unsupported']}, failed {c['failed']}")
    if args.torch_ops:
        out["torch_ops"] = _build_torch_ops()
        lines.append(f"torch op library: {out['torch_ops']['result']}")
    out["_text"] = "\n".join(lines)
    return exit_code(report), out


def _build_torch_ops() -> dict[str, Any]:
    """Builds the native op library ahead of the first call; a failure is reported (the
    Python path runs there), not fatal: the plans are what warm is for."""
    import time

    try:
        from ..torch import _native
    except ImportError as e:
        return {"ok": False, "result": f"not built: {e}"}
    t0 = time.perf_counter()
    try:
        path = _native.build()
    except Exception as e:  # the compiler's failure, reported as the Python path's cause
        return {"ok": False, "result": f"not built ({type(e).__name__}: {e})"}
    return {"ok": True, "path": str(path), "seconds": round(time.perf_counter() - t0, 1),
            "result": f"{path} ({time.perf_counter() - t0:.1f} s)"}
