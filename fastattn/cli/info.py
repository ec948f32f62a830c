"""`fastattn info`: versions, the GPU, the loaded libraries and the cache's state."""

from __future__ import annotations

from typing import Any

from ._common import EXIT_OK, add_json_flag, integer


def add_parser(sub) -> None:
    info = sub.add_parser("info", help="GPU, driver, cuDNN, cudnn-frontend and fastattn versions",
                          description="Report fastattn's versions, the cuDNN the first GPU call takes (also without a "
                          "GPU), the libraries loaded, the GPU, the cache directories, the cap of the in-memory tables "
                          "(FASTATTN_MEMORY_MAX_ENTRIES) and this process's counters (their evictions included). "
                          "Exit codes: 0 reported (without a usable GPU too: the report says why there is none), "
                          "2 bad flags or FASTATTN_* values, 3 fastattn's compiled extension does not load (a source "
                          "tree shadowing the installed package, an unbuilt checkout).")
    add_json_flag(info)
    info.add_argument("--device", type=integer(0), default=None, help="CUDA device (default: current)")


def run(args) -> tuple[int, dict[str, Any]]:
    from .. import bounded, runtime
    from ..errors import CudaError, LibraryError

    out: dict[str, Any] = {"versions": runtime.versions()}
    # Which cuDNN the first GPU call takes (the wheel, its version, the file), said
    # without a GPU too: after `pip install torch`, torch's pinned wheel.
    out["cudnn_library"] = runtime.cudnn_location()
    cache = runtime.plan_cache().store
    out["cache"] = {
        "directory": cache.settings.directory,
        "mode": cache.settings.mode,
        "extra_dirs": list(cache.settings.extra_dirs),
        "entries": [{"directory": t.root, "entries": len(infos), "bytes": sum(i.size for i in infos),
                     "problem": t.root_problem()}  # (a file, a FIFO: the `cache` commands refuse it)
                    for t in cache.tiers for infos in [list(t.entries(with_headers=False))]],
        "remote": cache.remote.status(check=True) if cache.remote else None,
    }
    try:
        out["libraries"] = runtime.libraries()
        out["versions"] = runtime.versions()
        out["device"] = runtime.device_info(args.device)
    except (LibraryError, CudaError) as e:  # a report of this machine: no GPU is what it says, not a failure
        out["device"] = None
        out["gpu_error"] = str(e)
    out["memory"] = {"max_entries": bounded.max_entries()}  # (each table keyed by shape; stats' "evictions")
    out["stats"] = runtime.stats()
    out["torch"] = _torch_path()
    if out["device"] is not None:
        out["cudnn_in_process"] = runtime.cudnn_in_process()
    return EXIT_OK, out


def _torch_path() -> dict[str, Any]:
    """fastattn.torch's path (native op library or Python) and why, building nothing."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"path": "none", "reason": "PyTorch is not installed"}
    from ..torch import backend_info

    return backend_info()
