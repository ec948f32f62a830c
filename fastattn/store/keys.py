"""Cache keys: the sha256 of a canonical description of everything that can change a plan.

This module is the one place that decides what "the same plan" means. A description
is a plain dict of JSON types; its canonical text (sorted keys, no spaces) is hashed.
Change the description's shape and FORMAT_VERSION moves with it, so old entries
become unreachable rather than wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

__all__ = ["FORMAT_VERSION", "describe", "environment_of", "key_of", "canonical_json", "build_env_vars"]

# Bump whenever the description, the key or the entry layout changes, or what a stored
# answer means. 2: a ragged plan's workspace holds its index arrays too (csrc/ragged.h),
# so version 1's recorded workspace sizes are too small for it.
FORMAT_VERSION = 2

# cuDNN and cudnn-frontend read CUDNN_* variables while they choose and build plans
# (CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT changes which backward engine is chosen, for
# one). Rather than list the knobs we know, every CUDNN_* variable is part of the key,
# except these, which only log or locate libraries.
_NOT_PLAN_CHANGING = frozenset(
    {
        "CUDNN_LOGLEVEL_DBG",
        "CUDNN_LOGDEST_DBG",
        "CUDNN_LOGINFO_DBG",
        "CUDNN_LOGWARN_DBG",
        "CUDNN_LOGERR_DBG",
        "CUDNN_FRONTEND_LOG_INFO",
        "CUDNN_FRONTEND_LOG_FILE",
        "CUDNN_FRONTEND_CUDART_LIB_NAME",
    }
)


def build_env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables that can change how cuDNN builds a graph."""
    environ = os.environ if environ is None else environ
    # The names first, the values of the few that count after: os.environ decodes each value it
    # yields, and a describe (every miss, every key) reads it.
    return {k: environ[k] for k in sorted(k for k in environ if k.startswith("CUDNN_") and k not in _NOT_PLAN_CHANGING)}


def describe(
    config: Mapping[str, Any],
    *,
    fastattn_version: str,
    frontend_version: str,
    cudnn_version: int,
    gpu_name: str,
    compute_capability: tuple[int, int] | list[int],
    sm_count: int,
    policy: str,
    env: Mapping[str, str],
    defects: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """The canonical description of one plan: identical GPUs (name, compute
    capability, SM count) share entries; any other difference is another key.

    defects: the known cuDNN defects the plan's graphs avoid, with their remedies
    (fastattn.defects.Decision.key_part()). Present only when there are some, so that
    every other config keeps the key it had before the registry existed."""
    description = {
        "format": FORMAT_VERSION,
        "fastattn": fastattn_version,
        "cudnn_frontend": frontend_version,
        "cudnn": int(cudnn_version),
        "gpu": {"name": gpu_name, "compute_capability": list(compute_capability), "sm_count": int(sm_count)},
        "config": dict(config),
        "policy": policy,
        "env": dict(sorted(env.items())),
    }
    if defects:
        description["defects"] = list(defects)
    return description


# What a description says of its config alone (the defects follow from the config and the
# environment), left out of the environment that entries for one GPU share.
_PER_CONFIG = frozenset({"config", "defects"})


def environment_of(description: Mapping[str, Any]) -> dict[str, Any]:
    """What must match between machines for an entry to be usable: the description
    without the config (and what follows from it, the defects it avoids)."""
    return {k: v for k, v in description.items() if k not in _PER_CONFIG}


def canonical_json(description: Mapping[str, Any]) -> str:
    return json.dumps(description, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def key_of(description: Mapping[str, Any]) -> str:
    """64 hex digits."""
    return hashlib.sha256(canonical_json(description).encode("ascii")).hexdigest()
