"""`fastattn probe`: ask cuDNN whether it supports one attention config on this GPU."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from .. import _fields, defects, perf_notes, config_files
from ..config import FIELDS, AttentionConfig
from ..errors import InvalidArgumentError
from ._common import (EXIT_FAILED, EXIT_OK, EXIT_UNSUPPORTED, add_json_flag, add_verify_flag, check_verify_possible,
                      checked_by, echo, input_path, integer, number)


def flag(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def add_parser(sub) -> None:
    probe = sub.add_parser("probe", help="ask cuDNN whether it supports one attention config on this GPU",
                           description="Ask cuDNN whether it supports one attention config on this GPU. Exit code "
                           "0: supported, 1: not supported (with cuDNN's reason), 2: bad input, 3: no usable GPU, 4: the plan "
                           "failed verification (--verify now, or when its cache entry was stored).")
    probe.add_argument("--config", type=input_path,
                       help="a config file as `fastattn warm` reads it (JSON or TOML) holding one config, or JSON "
                            "text of its fields; flags override it")
    # One flag per config field, from the field registry: its kind says how the flag parses.
    required = probe.add_argument_group("required config fields (unless --config gives them)")
    optional = probe.add_argument_group("other config fields")
    for f in FIELDS:
        meta, name = f.metadata, f.name
        group = required if _fields.is_required(f) else optional
        help_ = f"{meta['help']} (required)" if _fields.is_required(f) else meta["help"]
        kind = meta["kind"]
        if kind == "bool":
            group.add_argument(flag(f), dest=name, action="store_true", default=None, help=help_)
        elif kind == "int":
            group.add_argument(flag(f), dest=name, type=checked_by(integer(meta["minimum"]), _field_check(f)),
                               metavar="N", help=help_)
        elif kind in ("choice", "dtype", "layout"):
            group.add_argument(flag(f), dest=name, choices=meta["choices"], help=help_)
        elif kind == "positive":
            group.add_argument(flag(f), dest=name, type=checked_by(number(above=0), _field_check(f)), metavar="X",
                               help=help_)
        elif kind == "probability":
            group.add_argument(flag(f), dest=name, type=checked_by(number(minimum=0, below=1), _field_check(f)),
                               metavar="P", help=help_)
        elif kind == "pair":
            group.add_argument(flag(f), dest=name, type=integer(-1), nargs=2, metavar=("LEFT", "RIGHT"), help=help_)
        else:  # pragma: no cover - a new kind needs its flag here
            raise AssertionError(f"no flag for field kind {kind!r}")
    probe.add_argument("--device", type=integer(0), default=None, help="CUDA device (default: current)")
    add_verify_flag(probe)
    add_json_flag(probe)


def _field_check(field: dataclasses.Field):
    """The field's own validator (its range: float32's for a scale, int32's for a size)."""
    return lambda value: _fields.validate(field, value)


def config_from_args(args: argparse.Namespace) -> AttentionConfig:
    fields, where = _config_option(args.config) if args.config is not None else ({}, None)
    if where is not None:  # a misspelt field of the file, not the field it stands for, is what to report
        try:
            _fields.check_names(fields, FIELDS)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"{where}: {e}") from None
    for f in FIELDS:
        value = getattr(args, f.name)
        if value is not None:
            fields[f.name] = value
    missing = [flag(f) for f in FIELDS if _fields.is_required(f) and f.name not in fields]
    if missing:
        raise InvalidArgumentError(f"missing {', '.join(missing)} (required, unless --config gives them)")
    if where is None:  # flags alone: nothing sweeps
        return AttentionConfig.from_dict(fields)
    configs = config_files.expand_entry(fields, where)
    if len(configs) != 1:
        raise InvalidArgumentError(f"--config {echo(args.config)}: sweeps {len(configs)} configs; probe takes one "
                                   "(fastattn warm takes sweeps)")
    return configs[0]


def _config_option(option: str) -> tuple[dict[str, Any], str]:
    """--config: a config file as `fastattn warm` reads it (JSON or TOML: one config's
    fields, or a "configs" list of one), else JSON text; the fields of its one entry,
    and where they came from (for messages)."""
    if os.path.exists(option):
        entries, where = config_files.read_entries(option)
    elif option.lstrip().startswith(("{", "[", '"')) or _looks_like_json(option):
        entries, where = config_files.entries_in_text(option, f"--config {echo(option)}")
    else:
        raise InvalidArgumentError(f"--config {echo(option)}: no such file, and not JSON text")
    if len(entries) != 1:
        raise InvalidArgumentError(f"--config {echo(option)}: holds {len(entries)} entries; probe takes one config "
                                   "(fastattn warm takes many)")
    if not isinstance(entries[0], dict):
        raise InvalidArgumentError(f"{where[0]}: must be an object (TOML: a table) of AttentionConfig fields, "
                                   f"not {_fields.json_kind(entries[0])}")
    return dict(entries[0]), where[0]


def _looks_like_json(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def run(args) -> tuple[int, dict[str, Any]]:
    from .. import runtime

    cfg = config_from_args(args)
    if args.verify:
        check_verify_possible()
    # verify passed only when asked: the call without it is the one it always was
    result = runtime.probe(cfg, device=args.device, **({"verify": True} if args.verify else {}))
    out = result.to_dict()
    out["notes"] = perf_notes.notes(cfg) if result.supported else []
    out["avoided"] = defects.explain(result.avoided)
    out["_text"] = _text(out)
    if result.verdict is not None and result.verdict.status == "failed":
        return EXIT_FAILED, out
    return (EXIT_OK if result.supported else EXIT_UNSUPPORTED), out


def _text(out: dict[str, Any]) -> str:
    verdict = "supported" if out["supported"] else "NOT supported"
    lines = [f"{verdict} on device {out['device']}", f"  config: {json.dumps(out['config'], sort_keys=True)}"]
    if out["supported"]:
        lines.append(f"  forward:  engine {out['forward_engine']}, workspace {out['forward_workspace_size']} bytes")
        if out["config"]["training"]:
            lines.append(f"  backward: engine {out['backward_engine']}, "
                         f"workspace {out['backward_workspace_size']} bytes")
    else:
        lines.append(f"  reason: {out['reason']}")
    lines.append(f"  build: {out['build_seconds'] * 1e3:.1f} ms")
    for a in out.get("avoided", ()):  # known cuDNN defects this plan's graphs avoid (fastattn.defects)
        how = f": {a['how']}" if "how" in a else f" (remedy {a['remedy']})"
        lines.append(f"  avoided cuDNN defect {a['defect']}{how}")
        if "summary" in a:
            lines.append(f"    {a['summary']}; {a['cudnn']}; see {', '.join(a['reports'])}")
    lines.extend(f"  note: {note}" for note in out.get("notes", ()))
    if out.get("verdict") is not None:
        lines.extend(verdict_lines(out["verdict"]))
    return "\n".join(lines)


def verdict_lines(data: dict[str, Any], indent: str = "  ") -> list[str]:
    """A verdict (Verdict.to_dict()) as lines: its summary, then a line per check."""
    from ..verdict import Verdict

    v = Verdict.from_dict(data)
    lines = [f"{indent}verified: {v.summary()} in {v.seconds:.2f} s, cuDNN {v.cudnn_version}"]
    lines.extend(f"{indent}  {'ok  ' if c.passed(v.tolerance) else 'FAIL'} {c.describe()}" for c in v.checks)
    return lines
