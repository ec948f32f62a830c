"""`fastattn probe`: ask cuDNN whether it supports one attention config on this GPU."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..config import BIAS_SHAPES, DTYPES, LAYOUTS, MASKS, AttentionConfig
from ..errors import InvalidArgumentError
from ._common import EXIT_OK, EXIT_UNSUPPORTED, add_json_flag

# AttentionConfig fields given as plain integer flags (--heads-q for heads_q, ...)
_INT_FLAGS = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv", "head_dim_qk", "head_dim_v", "max_tokens_q",
              "max_tokens_kv", "page_size", "num_pages")
_OTHER_FLAGS = ("dtype", "layout", "mask", "scale", "training", "deterministic", "padding", "alibi", "ragged", "bias",
                "bias_grad", "dropout", "host_seed", "sinks")


def add_parser(sub) -> None:
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
    add_json_flag(probe)


def config_from_args(args: argparse.Namespace) -> AttentionConfig:
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


def run(args) -> tuple[int, dict[str, Any]]:
    from .. import runtime

    cfg = config_from_args(args)
    result = runtime.probe(cfg, device=args.device)
    out = result.to_dict()
    out["_text"] = _text(out)
    return (EXIT_OK if result.supported else EXIT_UNSUPPORTED), out


def _text(out: dict[str, Any]) -> str:
    verdict = "supported" if out["supported"] else "NOT supported"
    lines = [f"{verdict} on device {out['device']}", f"  config: {json.dumps(out['config'], sort_keys=True)}"]
    if out["supported"]:
        lines.append(f"  forward:  engine {out['forward_engine']}, workspace {out['forward_workspace_size']} bytes")
        if out["config"]["training"]:
            lines.append(f"  backward: engine {out['backward_engine']}, workspace {out['backward_workspace_size']} bytes")
    else:
        lines.append(f"  reason: {out['reason']}")
    lines.append(f"  build: {out['build_seconds'] * 1e3:.1f} ms")
    return "\n".join(lines)
