"""`fastattn info`: versions, the GPU, the loaded libraries and the cache's state."""

from __future__ import annotations

from typing import Any

from ._common import EXIT_OK, add_json_flag, integer


def add_parser(sub) -> None:
    info = sub.add_parser("info", help="GPU, driver, cuDNN, cudnn-frontend and fastattn versions",
                          description="Report fastattn's versions, the cuDNN the first GPU call takes (also without a "
                          "GPU), the libraries loaded, the GPU, the cache directories and this process's counters. "
                          "Exit codes: 0 reported (without a usable GPU too: the report says why there is none), "
                          "2 bad flags or FASTATTN_* values, 3 fastattn's compiled extension does not load (a source "
                          "tree shadowing the installed package, an unbuilt checkout).")
    add_json_flag(info)
    info.add_argument("--device", type=integer(0), default=None, help="CUDA device (default: current)")


def run(args) -> tuple[int, dict[str, Any]]:
    from .. import runtime
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
    out["stats"] = runtime.stats()
    out["torch"] = _torch_path()
    if out["device"] is not None:
        out["cudnn_in_process"] = _cudnn_in_process()
    return EXIT_OK, out


def _cudnn_in_process() -> dict[str, Any]:
    """The cuDNN files this process holds once fastattn and PyTorch (where installed) have
    both loaded theirs, and the version each reports: one cuDNN, or the problem. A run on
    another cuDNN than the machine's names the one it really tested here."""
    from .._loader import cudnn_copies_problem, mapped_cudnn, version_text
    from ..runtime import versions

    torch_version = None
    try:
        import torch

        if torch.cuda.is_available() and torch.backends.cudnn.is_available():
            torch_version = version_text(int(torch.backends.cudnn.version()))
    except Exception as e:  # noqa: BLE001 (a report: PyTorch's own failure is what it says)
        torch_version = f"unknown ({type(e).__name__}: {e})"
    files = mapped_cudnn()
    loaded = versions()["cudnn_loaded"]
    return {"fastattn": version_text(loaded) if loaded else None, "torch": torch_version, "files": files,
            "problem": cudnn_copies_problem(files)}


def _torch_path() -> dict[str, Any]:
    """fastattn.torch's path (native op library or Python) and why, building nothing."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"path": "none", "reason": "PyTorch is not installed"}
    from ..torch import backend_info

    return backend_info()
