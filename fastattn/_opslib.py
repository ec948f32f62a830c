"""Where fastattn.torch's op library (fastattn/torch/csrc/) is built, computed
without importing torch: `fastattn warm` asks whether it is built already before it
decides to import torch (seconds) and run a compiler. fastattn.torch._native builds and
loads it; both name it through this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import os
import subprocess
import sys
import threading
from pathlib import Path

from ._version import __version__

_TORCH_DIR = Path(__file__).resolve().parent / "torch"
CSRC = _TORCH_DIR / "csrc"  # the hand-written sources and headers
# The library's sources (fastattn/torch/csrc/ops.h says what each holds), each with its
# own includes, in link order (the order of their static initializers), and how they are
# batched into translation units where there are fewer cores than sources (units()).
# GENERATED are written at the build from the ops' specs (_native.write_generated), beside
# the library; SOURCES are the hand-written ones, in fastattn/torch/csrc/.
BATCHES = (("ops.cpp", "python.cpp", "eager.cpp"),
           ("kernels.cpp", "autograd.cpp", "registration.cpp", "table.cpp", "sdpa.cpp"))
GENERATED = ("kernels.cpp", "autograd.cpp", "registration.cpp")
NAMES = tuple(name for unit in BATCHES for name in unit)
SOURCES = tuple(CSRC / name for name in NAMES if name not in GENERATED)


# Sources compiled at -O1 in a unit of their own: each includes pybind11, whose headers put the same
# code (its function dispatcher, its internals) into every unit that includes them, which -O2 takes
# seconds longer to optimize than the unit's own code; neither holds per-call work (python.cpp's
# functions are a call each; ops.cpp's run on a miss, at init and on an error).
LIGHT = ("ops.cpp", "python.cpp")


def optimization(names: tuple[str, ...]) -> str:
    """The optimization flag of a unit of these sources: -O1 where every one is LIGHT, else -O2."""
    return "-O1" if set(names) <= set(LIGHT) else "-O2"


def units(cores: int) -> tuple[tuple[str, ...], ...]:
    """The translation units for a machine with `cores` cores, which compile in
    parallel (one per core) and are then linked. torch's headers dominate: parsing them
    costs a source more than its own lines. With a core per source, each is a unit of
    its own, and the build takes as long as the slowest one; with fewer,
    BATCHES, the sources batched by the headers they share (Python's and pybind11's;
    autograd's), which parses them once per batch: on two cores two batches beat one
    unit and six (docs/history/benchmarks-log.md, "The op library's build")."""
    if cores >= len(NAMES):
        return tuple((name,) for name in NAMES)
    return BATCHES
INCLUDE = Path(__file__).resolve().parent / "include"
# The sources' included files: every header beside them, so that a new one is part of the
# tag unasked, and what the generated sources come from (their generators, _options.py and
# _kernels.py; the ops' specs; the field registry their options take kinds, docs and off
# values from; the slot table their launches fill), and how they are compiled (this module's
# units and flags, _native's compiler lines).
HEADERS = (INCLUDE / "fastattn_abi.h", *sorted(CSRC.glob("*.h")), _TORCH_DIR / "_options.py",
           _TORCH_DIR / "_kernels.py", _TORCH_DIR / "_specs.py", _TORCH_DIR.parent / "config.py",
           _TORCH_DIR.parent / "_fields.py", _TORCH_DIR.parent / "_slots.py", Path(__file__).resolve(),
           _TORCH_DIR / "_native.py")


def tag(torch_version: str, cxx11_abi: int, extra: tuple[Path, ...] = ()) -> str:
    """What the built library depends on: a change to any of these builds anew. extra:
    sources a tool builds into it beside its own (fastattn.torch._native.EXTRA), which
    make it another library, under another tag."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS + tuple(extra):
        digest.update(path.read_bytes())
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    return f"fastattn{__version__}-torch{torch_version}-cxx11abi{cxx11_abi}-py{py}-{digest.hexdigest()[:12]}"


def build_root() -> Path:
    """FASTATTN_TORCH_OPS_DIR (a directory baked into an image, shared by test sessions),
    else the cache directory's torch-ops/."""
    from . import env as _env

    override = _env.get("FASTATTN_TORCH_OPS_DIR")
    if override:
        return Path(override)
    from .store import settings_from_env

    return Path(settings_from_env().directory) / "torch-ops"


class LibraryPath(type(Path())):  # type: ignore[misc]  # PosixPath or WindowsPath, as Path() makes
    """Where the op library is (library_path()): a Path whose exists() is False, not an
    OSError, where the path cannot be looked up. Path.exists() raises for a directory
    named by the user (FASTATTN_CACHE_DIR, FASTATTN_TORCH_OPS_DIR) with a component past
    the file system's name limit (ENAMETOOLONG) or one that cannot be searched (EACCES),
    and every check of whether the library is built (here, fastattn.torch's
    backend_info, describe, library, build) goes through this path. problem() says why."""

    def exists(self, *args, **kwargs) -> bool:
        try:
            return super().exists(*args, **kwargs)
        except OSError:  # no library can be loaded from a path that cannot be looked up
            return False


def problem(path: Path) -> str | None:
    """Why `path` cannot be looked up, as `fastattn cache ls` says it of a cache directory
    ("cannot be read (File name too long)"), or None: it is there, or simply missing."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # (ValueError, a NUL: not from the environment, which cannot hold one)
        return f"cannot be read ({e.strerror})"
    return None


def library_path(build_tag: str, root: Path | None = None) -> LibraryPath:
    name = "fastattn_ops_" + hashlib.sha256(build_tag.encode()).hexdigest()[:16]
    return LibraryPath(root or build_root(), build_tag, name + importlib.machinery.EXTENSION_SUFFIXES[0])


def version_in(folder: Path) -> str | None:
    """The __version__ a torch package folder's version.py assigns; None where that
    file is missing, unreadable or says nothing usable (any bytes: never raises)."""
    import re

    try:
        text = (Path(folder) / "version.py").read_text(encoding="utf-8", errors="replace")
    except (OSError, ValueError):
        return None
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"\n]+)['\"]", text, re.M)
    return found.group(1) if found else None


def torch_version() -> str | None:
    """The installed torch's version as torch.__version__ gives it, read from its
    torch/version.py without importing torch; package metadata where that file is not
    there. None: torch is not installed. (Metadata alone can miss: a torch installed
    without a dist-info, or one whose metadata spells the version differently.)"""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        found = version_in(folder)
        if found:
            return found
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def find_built() -> Path | None:
    """The library built for the installed torch, if there is one, found without
    importing torch; either C++ ABI, which one version string never has two of. None:
    not built, or torch not installed."""
    version = torch_version()
    if version is None:
        return None
    for abi in (1, 0):
        path = library_path(tag(version, abi))
        if path.exists():
            return path
    return None


# The op library's compiler processes running in this process, and whether its builds
# are cancelled: here, not in fastattn.torch._native, so that an interrupted `fastattn
# warm` stops a build without importing torch (seconds) on its way out.
_compilers: set[subprocess.Popen] = set()
_compilers_lock = threading.Lock()
_cancelled = threading.Event()


class BuildCancelled(RuntimeError):
    """cancel_builds() stopped the build."""


def start_compiler(cmd: list[str]) -> subprocess.Popen:
    """A compiler process (stdout and stderr piped, as text), counted among the running
    ones until finish_compiler(); BuildCancelled once builds are cancelled (none starts
    after), FileNotFoundError where there is no such program."""
    with _compilers_lock:
        if _cancelled.is_set():
            raise BuildCancelled("the build was cancelled")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _compilers.add(proc)
    return proc


def finish_compiler(proc: subprocess.Popen) -> tuple[str, str]:
    """Waits for a compiler start_compiler() started: its (stdout, stderr).
    BuildCancelled where builds were cancelled meanwhile (it was killed)."""
    try:
        out, err = proc.communicate()
    finally:
        with _compilers_lock:
            _compilers.discard(proc)
    if _cancelled.is_set():
        raise BuildCancelled("the build was cancelled")
    return out, err


def cancel_builds() -> None:
    """Stops this process's op library builds at once (an interrupted `fastattn warm`):
    the running compilers are killed and none starts until resume_builds(); each build
    then removes what it wrote (fastattn.torch._native.build)."""
    with _compilers_lock:
        _cancelled.set()
        for proc in _compilers:
            with contextlib.suppress(OSError):
                proc.kill()


def resume_builds() -> None:
    """Builds may run again, once every cancelled one has ended (`fastattn warm` run in
    a process that goes on: tests, a caller of cli.main)."""
    _cancelled.clear()


def cancelled() -> bool:
    return _cancelled.is_set()
