"""`fastattn info`: versions, the GPU, the loaded libraries and the cache's state."""

from __future__ import annotations

from typing import Any

from ._common import EXIT_FAILED, EXIT_NO_GPU, EXIT_OK, add_json_flag, integer, output_file, say


def add_parser(sub) -> None:
    info = sub.add_parser("info", help="GPU, driver, cuDNN, cudnn-frontend and fastattn versions",
                          description="Report fastattn's versions, the cuDNN the first GPU call takes (also without a "
                          "GPU), the libraries loaded, the GPU, what the loaded cuDNN is known to do there that is no wrong "
                          "answer (cudnn_notes), the cache directories, the cap of the in-memory tables "
                          "(FASTATTN_MEMORY_MAX_ENTRIES) and this process's counters (their evictions included). "
                          "Exit codes: 0 reported (without a usable GPU too: the report says why there is none), "
                          "2 bad flags or FASTATTN_* values, 3 fastattn's compiled extension does not load (a source "
                          "tree shadowing the installed package, an unbuilt checkout). With --export-gpu: 0 written, "
                          "3 no usable GPU here (nothing written), 4 the file could not be written.")
    add_json_flag(info)
    info.add_argument("--device", type=integer(0), default=None, help="CUDA device (default: current)")
    info.add_argument("--export-gpu", metavar="FILE", type=output_file,
                      help="also write this GPU's description (its name, capability, SM count and cuDNN's device "
                           "properties) to FILE, for `fastattn warm --for FILE` to build its plans on another "
                           "machine, without this GPU; export it with the cuDNN the plans will be built with")


def run(args) -> tuple[int, dict[str, Any]]:
    from .. import bounded, defects, runtime
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
        # What the loaded cuDNN is known to do on this GPU that is no wrong answer (fastattn.defects)
        loaded = out["versions"]["cudnn_loaded"]
        out["cudnn_notes"] = [] if loaded is None else defects.variance_notes(loaded,
                                                                              out["device"]["compute_capability"])
    if args.export_gpu is not None:
        return _export_gpu(args.export_gpu, args.device, out)
    return EXIT_OK, out


def _export_gpu(path: str, device: int | None, out: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    from .. import files, target
    from ..errors import CudaError, LibraryError

    if out["device"] is None:
        say(f"fastattn: --export-gpu: no usable GPU here ({out['gpu_error']}); nothing was written")
        return EXIT_NO_GPU, {**out, "exported_gpu": None}
    try:
        gpu = target.export(device)
    except (LibraryError, CudaError) as e:  # cuDNN cannot describe it (older than 9.8, ...)
        say(f"fastattn: --export-gpu: cuDNN cannot describe this GPU ({e}); nothing was written")
        return EXIT_NO_GPU, {**out, "exported_gpu": None}
    try:
        target.write(path, gpu)
    except OSError as e:  # the path was checked before the work: what fails now is the writing (ENOSPC, EFBIG, EIO)
        say(f"fastattn: --export-gpu: cannot write {files.shown(path)} ({e.strerror or e}); nothing was written")
        return EXIT_FAILED, {**out, "exported_gpu": None}
    return EXIT_OK, {**out, "exported_gpu": path}


def _torch_path() -> dict[str, Any]:
    """fastattn.torch's path (native op library or Python) and why, building nothing."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"path": "none", "reason": "PyTorch is not installed"}
    from ..torch import backend_info

    return backend_info()
