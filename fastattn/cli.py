"""The `fastattn` command (also `python -m fastattn`).

    fastattn info [--json]
    fastattn probe --batch 1 --heads-q 32 --seqlen-q 4096 --head-dim-qk 128 --mask causal [--json]
    fastattn probe --config cfg.json [--json]
    fastattn warm [FILE] [--workers N] [--report report.json] [--json]
    fastattn matrix [--head-dims 64,128,256] [--masks none,causal] [--gqa 1,4] [--features dense,bias,...]
                    [--png grid.png]
    fastattn cache ls | show KEY | verify [--load] | prune [--max-bytes N] [--max-age 30d] | clear
    fastattn cache export BUNDLE [--all] | import BUNDLE [--force] | push [--all] | pull [--all]

Every subcommand takes --json. Exit codes: 0 success (probe: supported), 1 not
supported by cuDNN (warm: some configs), 2 bad input (flags, files, a refused bundle),
3 no usable GPU stack (driver, CUDA or cuDNN missing, CUDA error), 4 some work failed
(warm: a config crashed or errored; verify: damaged entries; push, pull: Redis unreachable).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from . import runtime
from .config import BIAS_SHAPES, DTYPES, LAYOUTS, MASKS, AttentionConfig

# fastattn matrix --features: name -> (config fields it sets, what it means).
MATRIX_FEATURES = {
    "dense": ({}, "no feature"),
    "padding": ({"padding": True}, "per-sequence lengths"),
    "ragged": ({"padding": True, "ragged": True}, "packed sequences"),
    "paged": ({"padding": True, "page_size": 64}, "paged KV, 64-token pages"),
    "bias": ({"bias": "1hss"}, "a 1hss bias"),
    "bias_grad": ({"bias": "1hss", "bias_grad": True}, "with its gradient; needs --training"),
    "alibi": ({"alibi": True}, "ALiBi"),
    "dropout": ({"dropout": 0.1}, "dropout 0.1"),
    "sinks": ({"sinks": True}, "attention sinks"),
}
from .errors import CudaError, CudnnError, FastAttnError, InvalidArgumentError, LibraryError

EXIT_OK, EXIT_UNSUPPORTED, EXIT_BAD_INPUT, EXIT_NO_GPU, EXIT_FAILED = 0, 1, 2, 3, 4

# AttentionConfig fields given as plain integer flags (--heads-q for heads_q, ...)
_INT_FLAGS = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv", "head_dim_qk", "head_dim_v", "max_tokens_q",
              "max_tokens_kv", "page_size", "num_pages")
_OTHER_FLAGS = ("dtype", "layout", "mask", "scale", "training", "deterministic", "padding", "alibi", "ragged", "bias",
                "bias_grad", "dropout", "host_seed", "sinks")


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
    probe.add_argument("--padding", action="store_true", default=None,
                       help="per-sequence lengths given at run time (seq_len_q, seq_len_kv)")
    probe.add_argument("--alibi", action="store_true", default=None, help="ALiBi position biases")
    probe.add_argument("--ragged", action="store_true", default=None,
                       help="packed variable-length sequences (THD; with --padding and bshd)")
    probe.add_argument("--bias", choices=BIAS_SHAPES, help="additive bias of this broadcast shape")
    probe.add_argument("--bias-grad", action="store_true", default=None, dest="bias_grad",
                       help="backward also writes d_bias")
    probe.add_argument("--dropout", type=float, help="dropout probability")
    probe.add_argument("--host-seed", action="store_true", default=None, dest="host_seed",
                       help="dropout's seed and offset are host values")
    probe.add_argument("--sinks", action="store_true", default=None, help="attention sinks (a logit per head)")
    probe.add_argument("--device", type=int, default=None, help="CUDA device (default: current)")
    probe.add_argument("--json", action="store_true", help="print JSON")

    warm = sub.add_parser("warm", help="load or build every config a file describes, and store them")
    warm.add_argument("file", nargs="?", help="JSON or TOML config file with sweeps (default: built-in model shapes)")
    warm.add_argument("--workers", type=int, default=None, help="worker processes (default: min(8, CPUs))")
    warm.add_argument("--device", type=int, default=None)
    warm.add_argument("--report", help="write the full report as JSON to this file")
    warm.add_argument("--json", action="store_true", help="print the report as JSON")
    warm.add_argument("--no-progress", action="store_true", help="no progress bar")
    warm.add_argument("--timeout", type=float, default=600.0,
                      help="seconds one config may take before its worker is killed (default 600)")

    matrix = sub.add_parser("matrix", help="probe a grid of configs and show which cuDNN supports on this GPU")
    matrix.add_argument("--head-dims", type=_ints, default=[64, 96, 128, 192, 256], metavar="D,D,...",
                        help="head_dim_qk values (head_dim_v the same)")
    matrix.add_argument("--masks", type=_choices(MASKS), default=list(MASKS), metavar="M,M,...")
    matrix.add_argument("--dtypes", type=_choices(DTYPES), default=list(DTYPES), metavar="T,T,...")
    matrix.add_argument("--gqa", type=_ints, default=[1, 4], metavar="R,R,...",
                        help="heads_q / heads_kv ratios (1: MHA)")
    matrix.add_argument("--seqlens", type=_ints, default=[1024], metavar="S,S,...")
    matrix.add_argument("--features", type=_choices(tuple(MATRIX_FEATURES)), default=["dense"], metavar="F,F,...",
                        help="what each column adds: " + ", ".join(f"{n} ({d})" for n, (_, d) in
                                                                    MATRIX_FEATURES.items()))
    matrix.add_argument("--heads", type=int, default=8, help="heads_q")
    matrix.add_argument("--batch", type=int, default=1)
    matrix.add_argument("--training", action="store_true", help="also build backward graphs")
    matrix.add_argument("--workers", type=int, default=None)
    matrix.add_argument("--device", type=int, default=None)
    matrix.add_argument("--png", help="also draw a heatmap to this PNG file (needs matplotlib)")
    matrix.add_argument("--json", action="store_true")

    cache = sub.add_parser("cache", help="inspect and manage the persistent plan cache")
    csub = cache.add_subparsers(dest="cache_command", required=True, parser_class=_Parser)
    for name, text in (("ls", "list entries"), ("show", "print one entry's header"),
                       ("verify", "check every entry's checksum (and, with --load, that it deserializes here)"),
                       ("prune", "remove least-recently-used or old entries"), ("clear", "remove every entry"),
                       ("export", "write entries to a bundle"), ("import", "add a bundle's entries"),
                       ("push", "publish the local entries to the Redis tier (FASTATTN_REMOTE_CACHE)"),
                       ("pull", "fetch the Redis tier's entries for this GPU and cuDNN into the local cache")):
        c = csub.add_parser(name, help=text)
        c.add_argument("--json", action="store_true", help="print JSON")
        if name == "show":
            c.add_argument("key", help="an entry's key or a unique prefix of it")
        if name == "verify":
            c.add_argument("--load", action="store_true", help="also deserialize plans made for this GPU")
        if name == "prune":
            c.add_argument("--max-bytes", type=_size, help="keep at most this much (e.g. 500M, 2G)")
            c.add_argument("--max-age", type=_age, help="remove entries unused for this long (e.g. 12h, 30d)")
        if name == "export":
            c.add_argument("bundle")
            c.add_argument("--all", action="store_true", help="every entry, not only this GPU's and cuDNN's")
        if name == "import":
            c.add_argument("bundle")
            c.add_argument("--force", action="store_true", help="import entries made for another GPU or cuDNN")
        if name in ("push", "pull"):
            c.add_argument("--all", action="store_true", help="every entry, not only this GPU's and cuDNN's")
    return p


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("an empty list")
    return values


def _choices(allowed):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r} is not one of {', '.join(allowed)}")
        return values

    return parse


def _size(text: str) -> int:
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


def _age(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an age (e.g. 90s, 12h, 30d)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


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
    for name in _INT_FLAGS + _OTHER_FLAGS:
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
        "remote": cache.remote.status(check=True) if cache.remote else None,
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
    from .cli_cache import cache_command, matrix_command, warm_command

    handler = {"info": _info, "probe": _probe, "warm": warm_command, "cache": cache_command,
               "matrix": matrix_command}[args.command]
    try:
        code, out = handler(args)
    except InvalidArgumentError as e:
        return _fail(args, EXIT_BAD_INPUT, e)
    except (LibraryError, CudaError, CudnnError) as e:
        return _fail(args, EXIT_NO_GPU, e)
    except ConnectionError as e:  # the remote tier, for push and pull
        return _fail(args, EXIT_FAILED, e)
    except FastAttnError as e:  # pragma: no cover - a bug; still report it as data
        return _fail(args, EXIT_NO_GPU, e)
    text = out.pop("_text", None)  # the human form, when a handler made one
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    elif text is not None:
        print(text)
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
