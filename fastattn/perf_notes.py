"""Measured notes for `fastattn probe`: where a recorded benchmark found a config's FP8
kernels slower than its bf16 ones, so that nobody picks FP8 to be slower.

The numbers are never typed in here: benchmarks/bench_fp8.py measures FP8 against bf16 on
its shapes and writes them (`--notes PATH`, the file below), with the date, the GPU and
the versions it ran on. No file, no notes. A note matches a config by shape, mask and
layout (what selects the kernels), not by the GPU it is asked on: it says which GPU it
was measured on.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Any

from .config import AttentionConfig

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_measured", "fp8_vs_bf16.json")
FORMAT = 1
# What selects the kernels a measurement applies to (dtype aside).
SHAPE_FIELDS = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv", "head_dim_qk", "head_dim_v", "mask",
                "window", "layout")


def shape_key(config: AttentionConfig) -> tuple:
    d = config.to_dict()
    return tuple(json.dumps(d.get(f), sort_keys=True) for f in SHAPE_FIELDS)


def read_measured(path: str, fmt: int) -> dict[str, Any] | None:
    """A measurements file of fastattn/_measured/ (a dict with "format" == fmt and a list
    of "rows"), read once per version of the file; missing or malformed is None (no
    measurement), never an error at a call. Shared with shape_classes."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _read(path, st.st_mtime_ns, st.st_size, fmt)


@lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int, fmt: int) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != fmt or not isinstance(data.get("rows"), list):
        return None
    return data


def notes(config: AttentionConfig, path: str | None = None) -> list[str]:
    """One line per direction in which the recorded benchmark (the file at `path`,
    default PATH) found this FP8 config's shape slower than bf16 (forward always;
    backward for a training config)."""
    if not config.fp8:
        return []
    data = read_measured(path or PATH, FORMAT)
    if data is None:
        return []
    key, out = shape_key(config), []
    for row in data["rows"]:
        try:
            if shape_key(AttentionConfig.from_dict(row["config"])) != key:
                continue
        except Exception:  # a damaged row: no note rather than a failed probe
            continue
        for direction in ("forward", "backward") if config.training else ("forward",):
            ratio = row.get(f"{direction}_ratio")
            if isinstance(ratio, (int, float)) and ratio < 1.0:
                out.append(f"FP8 {direction} ran at {ratio:.2f}x bf16's speed for this shape on {data.get('gpu')} "
                           f"({data.get('date')}, cuDNN {data.get('cudnn')}, benchmarks/bench_fp8.py): bf16 is faster")
    return out
