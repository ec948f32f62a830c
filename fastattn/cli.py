"""The `fastattn` command (also `python -m fastattn`).

    fastattn info [--json]
    fastattn probe --batch 1 --heads-q 32 --seqlen-q 4096 --head-dim-qk 128 --mask causal [--json]
    fastattn probe --config cfg.json [--json]

Exit codes: 0 success (probe: supported), 1 not supported by cuDNN, 2 bad input,
3 no usable GPU stack (driver, CUDA or cuDNN missing, CUDA error).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from . import runtime
from .config import DTYPES, LAYOUTS, MASKS, AttentionConfig
from .errors import CudaError, CudnnError, FastAttnError, InvalidArgumentError, LibraryError

EXIT_OK, EXIT_UNSUPPORTED, EXIT_BAD_INPUT, EXIT_NO_GPU = 0, 1, 2, 3

# flag name -> AttentionConfig field, for the fields given as plain integers
_INT_FLAGS = {
    "batch": "batch",
    "heads_q": "heads_q",
    "heads_kv": "heads_kv",
    "seqlen_q": "seqlen_q",
    "seqlen_kv": "seqlen_kv",
    "head_dim_qk": "head_dim_qk",
    "head_dim_v": "head_dim_v",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default exit code is 2 too; keep one message format
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"fastattn: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fastattn", description="cuDNN fused attention with plans built once.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    info = sub.add_parser("info", help="GPU, driver, cuDNN, cudnn-frontend and fastattn versions")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--device", type=int, default=None, help="CUDA device (default: current)")

    probe = sub.add_parser("probe", help="ask cuDNN whether it supports one attention config on this GPU")
    probe.add_argument("--config", help="a JSON file or JSON text with AttentionConfig fields; flags override it")
    for flag in _INT_FLAGS:
        probe.add_argument("--" + flag.replace("_", "-"), type=int, dest=flag)
    probe.add_argument("--dtype", choices=DTYPES)
    probe.add_argument("--layout", choices=LAYOUTS)
    probe.add_argument("--mask", choices=MASKS)
    probe.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), help="-1 is unbounded")
    probe.add_argument("--scale", type=float)
    probe.add_argument("--training", action="store_true", default=None, help="also build the backward graph")
    probe.add_argument("--deterministic", action="store_true", default=None)
    probe.add_argument("--device", type=int, default=None, help="CUDA device (default: current)")
    probe.add_argument("--json", action="store_true", help="print JSON")
    return p


def _config_from_args(args: argparse.Namespace) -> AttentionConfig:
    fields: dict[str, Any] = {}
    if args.config:
        text = args.config
        if not text.lstrip().startswith("{"):
            try:
                with open(text) as f:
                    text = f.read()
            except OSError as e:
                raise InvalidArgumentError(f"--config {args.config!r}: {e.strerror}") from None
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(f"--config {args.config!r}: not valid JSON: line {e.lineno}, column {e.colno}: {e.msg}") from None
        if not isinstance(loaded, dict):
            raise InvalidArgumentError(f"--config {args.config!r}: must be a JSON object of AttentionConfig fields")
        fields.update(loaded)
    for name in list(_INT_FLAGS) + ["dtype", "layout", "mask", "scale", "training", "deterministic"]:
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    if args.window is not None:
        fields["window"] = tuple(args.window)
    return AttentionConfig.from_dict(fields)


def _info(args) -> tuple[int, dict[str, Any]]:
    from . import _loader

    out: dict[str, Any] = {"versions": runtime.versions()}
    cache = runtime._the_cache()
    out["cache"] = {
        "directory": cache.settings.directory,
        "mode": cache.settings.mode,
        "extra_dirs": list(cache.settings.extra_dirs),
        "entries": [{"directory": t.root, "entries": len(infos), "bytes": sum(i.size for i in infos)}
                    for t in cache.tiers for infos in [list(t.entries(with_headers=False))]],
    }
    try:
        libs = _loader.ensure_loaded()
        out["libraries"] = {"cudnn": libs.cudnn, "cudart": libs.cudart, "nvrtc": libs.nvrtc, "cublasLt": libs.cublaslt}
        out["versions"] = runtime.versions()
        out["device"] = runtime.device_info(args.device)
        code = EXIT_OK
    except (LibraryError, CudaError) as e:
        out["gpu_error"] = str(e)
        code = EXIT_NO_GPU
    out["stats"] = runtime.stats()
    return code, out


def _probe(args) -> tuple[int, dict[str, Any]]:
    cfg = _config_from_args(args)
    result = runtime.probe(cfg, device=args.device)
    return (EXIT_OK if result.supported else EXIT_UNSUPPORTED), result.to_dict()


def _print_human(command: str, out: dict[str, Any]) -> None:
    if command == "probe":
        verdict = "supported" if out["supported"] else "NOT supported"
        print(f"{verdict} on device {out['device']}")
        print(f"  config: {json.dumps(out['config'], sort_keys=True)}")
        if out["supported"]:
            print(f"  forward:  engine {out['forward_engine']}, workspace {out['forward_workspace_size']} bytes")
            if out["config"]["training"]:
                print(f"  backward: engine {out['backward_engine']}, workspace {out['backward_workspace_size']} bytes")
        else:
            print(f"  reason: {out['reason']}")
        print(f"  build: {out['build_seconds'] * 1e3:.1f} ms")
        return
    for key, value in out.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v}")
        else:
            print(f"{key}: {value}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code, out = (_info if args.command == "info" else _probe)(args)
    except InvalidArgumentError as e:
        return _fail(args, EXIT_BAD_INPUT, e)
    except (LibraryError, CudaError, CudnnError) as e:
        return _fail(args, EXIT_NO_GPU, e)
    except FastAttnError as e:  # pragma: no cover - a bug; still report it as data
        return _fail(args, EXIT_NO_GPU, e)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        _print_human(args.command, out)
    return code


def _fail(args, code: int, error: Exception) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"error": type(error).__name__, "message": str(error)}, indent=2))
    else:
        print(f"fastattn: {type(error).__name__}: {error}", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
