"""`fastattn warm`: load or build every config a file describes, and store them."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import TYPE_CHECKING, Any

from .. import env
from ..config import MASKS
from ..dtypes import SIXTEEN_BIT
from ..errors import InvalidArgumentError
from ._common import (DURATION_HELP, EXIT_FAILED, EXIT_NO_GPU, EXIT_OK, EXIT_UNSUPPORTED, add_json_flag,
                      add_verify_flag, check_verify_possible, duration, echo, exit_code, input_path, integer,
                      length_range, output_file, say, shape_classes, to_stderr, wrap)

if TYPE_CHECKING:
    from ..warm import WarmItem


def add_parser(sub) -> None:
    warm = sub.add_parser("warm", help="load or build every config a file describes, and store them",
                          description="Load or build every config a file describes (default: built-in model "
                          "shapes) in parallel worker processes, and store them in the persistent cache. Exit codes: "
                          "0 every config stored, 1 some not supported by cuDNN (their refusals stored), 2 bad input, "
                          "3 no usable GPU: plans need one, so none was built (the configs left are not sent to "
                          "workers once one answers so), and what needs no GPU is done: fastattn.torch's op library "
                          "is built where asked for (see --torch-ops), 4 some "
                          "configs failed, or failed verification (--verify: status rejected, refused with the "
                          "evidence), or answers built now are not in the cache at the end (it cannot be written, or "
                          "keeps nothing: counted as not saved, with the reason), or, without a GPU, the op library "
                          "asked for could not be built (with a GPU that is reported, and the exit code is the "
                          "plans').")
    warm.add_argument("file", nargs="?", type=input_path,
                      help="JSON or TOML config file with sweeps, or the JSON Lines FASTATTN_RECORD writes "
                           "(default: built-in model shapes)")
    warm.add_argument("--workers", type=integer(1), default=None, help="worker processes (default: min(8, CPUs))")
    warm.add_argument("--device", type=integer(0), default=None, help="CUDA device (default: current)")
    warm.add_argument("--report", type=output_file, help="write the full report as JSON to this file")
    add_json_flag(warm, help="print the report as JSON")
    warm.add_argument("--no-progress", action="store_true", help="no progress bar")
    warm.add_argument("--torch-ops", action=argparse.BooleanOptionalAction, default=None,
                      help="build fastattn.torch's native op library for the installed torch, alongside the plans, "
                           "once per torch version; it needs a C++ compiler and torch's headers, not a GPU, so it is "
                           "built without one too, where a GPU process of the same environment loads it (default: "
                           "where PyTorch is installed, unless FASTATTN_TORCH_PATH=python; without it fastattn.torch "
                           "runs its Python path)")
    warm.add_argument("--timeout", type=duration(env.MAX_SECONDS, above=0), default=600.0,
                      help=f"how long one config may take before its worker is killed ({DURATION_HELP}; at most "
                           f"{env.MAX_SECONDS:.0f} s; default 600)")
    add_verify_flag(warm)
    warm.add_argument("--for", dest="gpu_file", metavar="FILE", type=input_path,
                      help="build the plans of the GPU this file describes (`fastattn info --export-gpu FILE` wrote "
                           "it there), here, with or without a GPU, with the same fastattn and cuDNN as that GPU's "
                           "processes will have (a deploy's image build): stored under that GPU's keys, so that "
                           "its processes load them and build nothing. cuDNN's refusals are reported, not stored. "
                           "Not with --device or --verify; exit 3 does not apply")
    cls = warm.add_argument_group(
        "warm by shape class", "with --seqlens, instead of a file: the class plans (fastattn.shape_classes) that "
        "serve a model's fastattn.torch.attention() calls (bshd, packed tokens) at every length in the range, "
        "prefill (s_q = s_kv) and decode (s_q = 1): a plan per class, not per length")
    cls.add_argument("--seqlens", type=length_range, help="LO..HI, the lengths to serve (e.g. 1..32768)")
    cls.add_argument("--heads", type=integer(1), help="query heads (needed with --seqlens)")
    cls.add_argument("--heads-kv", type=integer(1), help="key/value heads (default: --heads)")
    cls.add_argument("--head-dim", type=integer(1), help="head dim of q and k (needed with --seqlens)")
    cls.add_argument("--head-dim-v", type=integer(1), help="head dim of v (default: --head-dim)")
    # No argparse defaults in this group: a flag given (even at its default's value) is
    # told from one left out, so that each is refused alike without --seqlens
    # (_no_class_flags); class_configs applies the defaults, _CLASS_DEFAULTS.
    cls.add_argument("--dtype", choices=SIXTEEN_BIT, help="default bf16")  # fastattn.torch.attention's dtypes
    cls.add_argument("--mask", choices=MASKS,
                     help="default causal_bottom_right (FlashAttention's causal, what decode needs)")
    cls.add_argument("--batch", type=integer(1), help="batch size (a class plan per batch; default 1)")
    cls.add_argument("--training", action="store_true", help="plans with their backward (training calls)")
    cls.add_argument("--shape-classes", type=shape_classes, default=None,
                     help="auto, or ascending class bounds such as 256,1024,4096 (default: FASTATTN_SHAPE_CLASSES)")


def _progress_bar():
    """A one-line bar on stderr, only on a terminal (logs and pipes get the table alone;
    a closed stderr, none). A write that fails ends the bar, not the warm."""
    try:
        if sys.stderr is None or not sys.stderr.isatty():
            return None
    except (OSError, ValueError):  # a closed file object
        return None
    counts: dict[str, int] = {}
    drawing = [True]

    def draw(done: int, total_: int, item: WarmItem) -> None:
        counts[item.status] = counts.get(item.status, 0) + 1
        if not drawing[0]:
            return
        width = 30
        filled = int(width * done / max(total_, 1))
        summary = " ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        drawing[0] = to_stderr(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total_} {summary}   "
                               + ("\n" if done == total_ else ""))

    return draw


def run(args) -> tuple[int, dict[str, Any]]:
    from .. import config_files

    verify = getattr(args, "verify", False)
    if getattr(args, "gpu_file", None) is not None:
        given = [flag for flag, value in (("--device", args.device is not None), ("--verify", verify)) if value]
        if given:
            raise InvalidArgumentError(f"--for: builds for another GPU: not with {' or '.join(given)} "
                                       f"({'it needs' if len(given) == 1 else 'they need'} a GPU here)")
    if verify:
        check_verify_possible()
    if getattr(args, "seqlens", None) is not None:
        configs, skipped = class_configs(args)
    else:
        _no_class_flags(args)
        configs, skipped = (config_files.load_configs(args.file) if args.file is not None else config_files.builtin_configs()), None
    # The op library needs a compiler and torch's headers, no GPU: it builds beside the
    # plans' workers, also where there is no GPU (a deploy's image is built on such a
    # machine, and a GPU process of that environment then loads it without compiling).
    torch_ops = _TorchOpsBuild() if _wants_torch_ops(args.torch_ops) else None
    try:
        return _run(args, configs, skipped, torch_ops, verify)
    except BaseException:  # interrupted (SIGINT, SIGTERM), or failed: no compiler is left running
        if torch_ops is not None:
            torch_ops.cancel()
        raise


def _run(args, configs, skipped, torch_ops: _TorchOpsBuild | None, verify: bool) -> tuple[int, dict[str, Any]]:
    from ..warm import warm

    gpu_file = getattr(args, "gpu_file", None)
    report = warm(configs, workers=args.workers, device=args.device, timeout=args.timeout,
                  progress=None if args.no_progress or args.json else _progress_bar(),
                  **({"verify": True} if verify else {}), **({"gpu_file": gpu_file} if gpu_file else {}))
    out = report.to_dict()
    out["source"] = args.file or "built-in model shapes"
    if skipped is not None:
        out["source"] = f"shape classes for lengths {args.seqlens[0]}..{args.seqlens[1]}"
        out["lengths_without_a_class"] = skipped
    if args.report:
        import json

        from .. import files

        try:
            files.write_file(args.report, json.dumps(out, indent=2, sort_keys=True).encode())
        except OSError as e:
            raise InvalidArgumentError(f"--report {echo(args.report)}: {e.strerror}") from None
    code = exit_code(report)
    if report.not_saved and code in (EXIT_OK, EXIT_UNSUPPORTED):
        code = EXIT_FAILED  # a pre-warm that left the cache without its answers did not do its work
    out["no_gpu"] = _no_gpu_reason(report, code, args.device) if not gpu_file else None
    if gpu_file:
        out["for"] = gpu_file
    if out["no_gpu"] is not None:
        code = EXIT_NO_GPU
    for warning in report.warnings:  # the workers' own, which would otherwise end in their logs
        say(f"fastattn: warning: {warning}")
    library = []
    if torch_ops is not None:
        out["torch_ops"] = torch_ops.result()
        library = [f"torch op library: {out['torch_ops']['result']}"]
    if code == EXIT_NO_GPU:  # one reason for every config: said once (stderr), not once per config
        out["_text"] = "\n".join(library)
        out["_stderr"] = "\n".join(_no_gpu_text(report, out["no_gpu"]))
        if torch_ops is not None and not out["torch_ops"]["ok"]:
            # Without a GPU the op library is all that warm can build: exit 3 says it is
            # built (or not asked for), which a Dockerfile can rely on.
            code = EXIT_FAILED
    else:
        out["_text"] = "\n".join(_table(report) + library
                                  + ([f"lengths no class covers (exact plans at their first call): {skipped}"]
                                     if skipped else []))
    return code, out


_CLASS_FLAGS = ("heads", "heads_kv", "head_dim", "head_dim_v", "dtype", "mask", "batch", "training",
                "shape_classes")
_CLASS_DEFAULTS = {"dtype": "bf16", "mask": "causal_bottom_right", "batch": 1}


def _no_class_flags(args) -> None:
    """The model flags mean something only with --seqlens: each given is refused without
    it (whatever its value, its default's too), not ignored."""
    given = [f"--{n.replace('_', '-')}" for n in _CLASS_FLAGS if getattr(args, n, None) not in (None, False)]
    if given:
        raise InvalidArgumentError(f"{', '.join(given)}: only with --seqlens (warm by shape class)")


def class_configs(args) -> tuple[list, list[list[int]]]:
    """The class plans for --seqlens's range (prefill and decode), and the sub-ranges no
    class covers (their lengths get exact plans at their first call; not warmed: one
    plan per length is what classes are for)."""
    from .. import env
    from .. import shape_classes as sc

    if args.file is not None:
        raise InvalidArgumentError("--seqlens: warms the classes of the model the flags describe; not with a file")
    for flag, value in (("--heads", args.heads), ("--head-dim", args.head_dim)):
        if value is None:
            raise InvalidArgumentError(f"{flag}: needed with --seqlens")
    heads_kv = args.heads_kv or args.heads
    if args.heads % heads_kv:
        raise InvalidArgumentError(f"--heads-kv={heads_kv}: must divide --heads={args.heads}")
    choice = args.shape_classes if args.shape_classes is not None else env.get("FASTATTN_SHAPE_CLASSES")
    if choice == "auto":
        from ..runtime import device_info

        gpu_file = getattr(args, "gpu_file", None)
        if gpu_file is not None:
            from .. import target

            name = target.read(gpu_file).name  # the GPU the plans are for
        else:
            name = device_info(args.device)["name"]
        classes = sc.measured(name, _cudnn_version(gpu_file) or 0, training=args.training)
        if classes is None:
            raise InvalidArgumentError("--shape-classes=auto: nothing measured for this GPU and cuDNN "
                                       "(benchmarks/bench_shape_classes.py --write), so auto means exact plans: "
                                       "pass class bounds such as 256,1024,4096")
    else:
        classes = choice
    if not classes:
        raise InvalidArgumentError("--shape-classes: classes are off (FASTATTN_SHAPE_CLASSES): pass auto or class "
                                   "bounds such as 256,1024,4096")
    lo, hi = args.seqlens
    uppers, uncovered = sc.classes_in_range(lo, hi, classes)
    batch, dtype, mask = (_CLASS_DEFAULTS[n] if getattr(args, n) is None else getattr(args, n)
                          for n in ("batch", "dtype", "mask"))
    common = dict(batch=batch, heads_q=args.heads, heads_kv=heads_kv, head_dim_qk=args.head_dim,
                  head_dim_v=args.head_dim_v or args.head_dim, dtype=dtype, training=args.training,
                  mask=mask, alignment="bottom_right" if mask == "causal_bottom_right" else "top_left")
    configs = []
    # Both kinds of class plan for a class that override plans serve (up to
    # shape_classes.OVERRIDE_MAX rows) where the loaded cuDNN has the shape override (forward
    # only): inference calls without per-sequence lengths may take the override plan, the others
    # (and every call of a class whose override plan cuDNN refuses) the ragged one
    # (fastattn.torch's _shape_classes).
    # (not with a bottom-right diagonal, which the override would leave at the declared lengths)
    gpu_file = getattr(args, "gpu_file", None)
    version = _cudnn_version(gpu_file) or 0
    override = not args.training and mask != "causal_bottom_right" and version >= 92100
    refused = _refused_here(version, gpu_file, getattr(args, "device", None)) if override else (lambda cfg: False)
    # A decode step's one query sees every key: with a bottom-right diagonal that is the mask's
    # own form, and a model whose prefill is causal at the top left (where s_q == s_kv the
    # same attention) runs its decode steps without a mask.
    decode_mask = {"mask": "none"} if mask == "causal" else {}
    for u in uppers:
        kinds = (True, False) if override and u <= sc.OVERRIDE_MAX else (False,)
        # Prefill; and decode (one query, the class's keys), which is inference only.
        pairs = [(u, u, {})] + ([(1, u, decode_mask)] if u > 1 and not args.training else [])
        for u_q, u_kv, decode in pairs:
            for override_plan in kinds:
                cfg = sc.class_config(upper_q=u_q, upper_kv=u_kv, override=override_plan, **{**common, **decode})
                # (an override plan the defect registry refuses is not one a call takes: its
                # calls take the ragged plan, warmed beside it)
                if cfg not in configs and not (override_plan and refused(cfg)):
                    configs.append(cfg)
    return configs, [list(r) for r in uncovered]


def _refused_here(version: int, gpu_file: str | None, device: int | None):
    """Whether fastattn.defects refuses a config with the cuDNN of `version` on the GPU
    the plans are for (the file's, else the device's; where neither is known, nothing is
    refused here and the workers answer)."""
    from .. import defects
    from ..errors import FastAttnError
    from ..runtime import device_info

    try:
        if gpu_file is not None:
            from .. import target

            capability = target.read(gpu_file).compute_capability
        else:
            capability = tuple(device_info(device)["compute_capability"])
    except (OSError, FastAttnError):
        return lambda cfg: False
    return lambda cfg: bool(defects.decide(cfg, version, capability).refusal)


def _cudnn_version(gpu_file: str | None) -> int | None:
    """The version of the cuDNN the plans are built with (the shape override needs 9.21;
    `auto` classes are measured per cuDNN): the one this process loads, or None where none
    loads (the plans' workers then say why). For --for, where no driver lets this process
    load it, the installed wheel's: the workers, with the stand-in, load that one."""
    from ..runtime import installed_cudnn_version, libraries, versions

    try:
        libraries()
    except OSError:  # no cuDNN here (LibraryError)
        return installed_cudnn_version() if gpu_file is not None else None
    return int(versions()["cudnn_loaded"] or 0) or None


def _summary(report) -> str:
    return (f"{len(report.items)} configs in {report.seconds:.1f} s, {report.processes} worker processes "
            f"(at most {report.workers})")


def _table(report) -> list[str]:
    from .. import config_files

    c = report.counts
    verified = report.verify or any(i.verdict is not None for i in report.items)
    head = f"{'status':<12} {'seconds':>8}  " + (f"{'verified':<9} " if verified else "")
    lines = [head + "config", "-" * 72]
    previous = None
    for item in report.items:
        status = "not saved" if item.saved is False else item.status  # built, and lost: not "built"
        mark = f"{(item.verdict or {}).get('status', '-'):<9} " if verified else ""
        lines.append(f"{status:<12} {item.seconds:8.3f}  {mark}{config_files.describe_config(item.config)}")
        if item.verdict is not None and item.verdict["status"] == "skipped":
            lines.extend(wrap(f"not verified: {item.verdict['reason']}", indent=" " * 22))
        if item.status in ("unsupported", "failed", "rejected"):
            why = f"{item.error_type + ': ' if item.error_type else ''}{item.reason}"
            lines.extend(wrap("(the same as above)" if why == previous else why, indent=" " * 22))
            previous = why
    lines.append("-" * 72)
    lines.append(f"{_summary(report)}: loaded {c['loaded']}, built {c['built']}, unsupported {c['unsupported']}, "
                 f"failed {c['failed']}" + (f", rejected {c['rejected']}" if "rejected" in c else "")
                 + (f", not saved {report.not_saved}" if report.not_saved else ""))
    if verified:
        v = report.verdicts
        lines.append(f"verified: passed {v['passed']}, failed {v['failed']} (refused: never served), "
                     f"skipped {v['skipped']} (not covered by the reference)")
    if report.not_saved:
        lines.extend(wrap(f"not saved: {report.not_saved} answers built now are not in the cache, so the next run "
                          f"builds them again: {report.not_saved_reason}", indent=""))
    return lines


def _no_gpu_reason(report, code: int, device: int | None) -> str | None:
    """Why no config can be built here ("LibraryError: ..."), or None. Every config
    failed so (exit_code: EXIT_NO_GPU), each distinct reason once; or there was no
    config, so no worker was asked: this process asks the GPU stack itself, so that a
    warm without a GPU is exit 3 whatever its file holds."""
    if code == EXIT_NO_GPU:
        return "\n".join(dict.fromkeys(f"{i.error_type}: {i.reason}" for i in report.items))
    return None if report.items else _gpu_problem(device)


def _no_gpu_text(report, reason: str) -> list[str]:
    """No config could be built for want of a GPU stack: the reason (a LibraryError lists
    what is missing, a line each), and a closing line that says so."""
    lines = ["fastattn warm: no usable GPU here, and plans need the GPU, so no config was loaded or built:"]
    lines.extend(wrap(reason))
    lines.append(f"{_summary(report)}: no usable GPU" + (f", all {len(report.items)} failed" if report.items else "")
                 + (f" ({report.not_tried} not sent to a worker: the first answer said so)"
                    if report.not_tried else ""))
    return lines


def _wants_torch_ops(flag: bool | None) -> bool:
    """--torch-ops / --no-torch-ops, else: PyTorch is installed (found without importing
    it) and FASTATTN_TORCH_PATH does not choose the Python path."""
    if flag is not None:
        return flag
    import importlib.util

    from .. import env as _env

    return _env.get("FASTATTN_TORCH_PATH") != "python" and importlib.util.find_spec("torch") is not None


def _gpu_problem(device: int | None) -> str | None:
    """Why this machine has no usable GPU stack for `device` ("LibraryError: ..."), or
    None. A device it does not have is bad input (InvalidArgumentError, raised)."""
    from ..errors import CudaError, CudnnError, LibraryError
    from ..runtime import device_info

    try:
        device_info(device)
    except (LibraryError, CudaError, CudnnError) as e:
        return f"{type(e).__name__}: {e}"
    return None


class _TorchOpsBuild:
    """_build_torch_ops() in a thread, started at once; result() waits for it; cancel()
    stops it. A daemon: a warm that ends otherwise than through result() or cancel() (a
    bug) does not wait for the compiler (build() publishes only a whole library, so
    nothing half-built is ever loaded)."""

    # How long an interrupted warm waits for the build to remove what it wrote, once its
    # compilers are killed (a build still importing torch may take that long to get there;
    # what it has not removed by then, the next build removes).
    CANCEL_WAIT = 5.0

    def __init__(self):
        self._out: dict[str, Any] = {}
        # Waited on instead of Thread.join: a join that SIGINT interrupted can report the
        # thread ended while it still runs (CPython before 3.13).
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._build, name="fastattn-torch-ops", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            self._out.update(_build_torch_ops())
        finally:
            self._done.set()

    def result(self) -> dict[str, Any]:
        self._done.wait()
        return self._out or {"ok": False, "result": "not built (the build thread ended without a result)"}

    def cancel(self) -> None:
        """Kills the compilers now, and waits a moment for the build to remove its files."""
        from .. import _opslib

        _opslib.cancel_builds()
        if self._done.wait(self.CANCEL_WAIT):  # (a build still running must find builds cancelled)
            _opslib.resume_builds()


def _build_torch_ops() -> dict[str, Any]:
    """Builds the native op library ahead of the first call; a failure is reported (the
    Python path runs there), not fatal: the plans are what warm is for."""
    import time

    from .. import _opslib, _warm_up, files

    built = _opslib.find_built()
    if built is not None:  # a second warm imports no torch (seconds) to find it built
        return {"ok": True, "path": str(built), "seconds": 0.0, "result": f"{built} (built before)"}
    t0 = time.perf_counter()
    try:
        # This process only compiles the library: importing fastattn.torch must not start
        # the warm-up, whose first phase would decide the path before the build.
        with _warm_up.suppressed():
            from ..torch import backend_info

        info = backend_info(build=True)
    except ImportError as e:
        return {"ok": False, "result": f"not built: {e}"}
    except Exception as e:  # where the library goes cannot be said (a bad cache setting): reported too
        return {"ok": False, "result": f"not built ({type(e).__name__}: {e})"}
    if info["build_error"]:  # the compiler's failure, reported as the Python path's cause
        return {"ok": False, "result": f"not built ({info['build_error']})"}
    path = info["library"]
    return {"ok": True, "path": str(path), "seconds": round(time.perf_counter() - t0, 1),
            "result": f"{files.shown(path)} ({time.perf_counter() - t0:.1f} s)"}
