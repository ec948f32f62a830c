"""Finding and loading libcudnn and what it needs, at first GPU use.

fastattn links against no CUDA library, so ``import fastattn`` works on a machine
with no GPU, driver or cuDNN. The first call that needs the GPU comes here, which:

1. loads cuBLASLt and NVRTC before cuDNN: cuDNN dlopens cuBLASLt by itself and, when
   it cannot find it, prints "Cannot load symbol cublasLtGetVersion" and aborts the
   whole process; runtime-compiled engines need NVRTC, and without it cuDNN only
   says "No execution plans support the graph";
2. loads the CUDA runtime and tells cudnn-frontend to use that one (it would
   otherwise pick whichever libcudart.so.12/13 the system loader finds first);
3. checks that the NVIDIA driver (libcuda.so.1) loads;
4. loads libcudnn.so.9 and hands it to the C++ core.

Libraries come from the installed NVIDIA wheels first, then wherever cuda-pathfinder
finds them (conda, CUDA_HOME, the system loader), unless a FASTATTN_*_PATH variable
names a file. Every missing piece is reported in one LibraryError that says how to
install it.

One process holds one cuDNN. A libcudnn.so.9 already loaded (PyTorch loads its own when
it is imported) is the one fastattn takes, wherever the wheels are: a second copy loaded
by path would give PyTorch and fastattn two cuDNN versions, with two sets of handles and
defects, in one process. When fastattn loads first, the system loader hands the same file
to PyTorch, which asks for it by its name (libcudnn.so.9). mapped_cudnn() lists every
cuDNN file in the process, so that a report or a test can show there is one.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from . import env as _env
from .errors import LibraryError

__all__ = ["Libraries", "ensure_loaded", "MIN_CUDNN", "check_cudnn_version", "cudnn_location", "import_core",
           "mapped_cudnn", "cudnn_copies_problem"]

# The oldest cuDNN fastattn supports: the oldest on which its whole GPU suite has run
# (9.19.0, on the H200 machine). The extension is usually built against newer headers
# than the cuDNN it meets at run time (pip builds against the newest 9.x wheel, while
# PyTorch may pin an older one); that combination is tested too (tools/gpu_run.sh with
# an extension built against the newest headers), and features newer than the loaded
# cuDNN are gated on its run-time version, never on the headers'.
MIN_CUDNN = 91900

# (pathfinder name, override variable, how to install it)
_DEPENDENCIES = (
    ("cublasLt", "FASTATTN_CUBLASLT_PATH", "pip install nvidia-cublas (a dependency of nvidia-cudnn-cu13)"),
    ("nvrtc", "FASTATTN_NVRTC_PATH", "pip install nvidia-cuda-nvrtc"),
    ("cudart", "FASTATTN_CUDART_PATH", "pip install nvidia-cuda-runtime"),
)
_CUDNN = ("cudnn", "FASTATTN_CUDNN_PATH", "pip install nvidia-cudnn-cu13")
_CUDNN_SONAME = "libcudnn.so.9"
_DRIVER_HINT = "install the NVIDIA driver; fastattn needs an NVIDIA GPU (compute capability 8.0 or newer for most configs)"


@dataclass(frozen=True)
class Libraries:
    """Where each library was loaded from, and the cuDNN version found at run time."""

    cudnn: str
    cudart: str
    nvrtc: str
    cublaslt: str
    cudnn_version: int


_lock = threading.Lock()
_loaded: Libraries | None = None


# Where pip's NVIDIA wheels put each library, relative to a site-packages directory.
_WHEEL_PATHS = {
    "cublasLt": os.path.join("nvidia", "cu13", "lib", "libcublasLt.so.13"),
    "nvrtc": os.path.join("nvidia", "cu13", "lib", "libnvrtc.so.13"),
    "cudart": os.path.join("nvidia", "cu13", "lib", "libcudart.so.13"),
    "cudnn": os.path.join("nvidia", "cudnn", "lib", "libcudnn.so.9"),
}


def _from_wheels(name: str) -> str | None:
    """The library from an installed NVIDIA wheel on sys.path, loaded, or None. The
    common case, checked first because importing cuda-pathfinder, which knows every
    other layout, costs a noticeable part of a process's cold start."""
    rel = _WHEEL_PATHS.get(name)
    for entry in sys.path if rel else ():
        path = os.path.join(entry or ".", rel)
        if os.path.isfile(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            return path
    return None


# The pip wheels that ship nvidia/cudnn/lib/libcudnn.so.9: fastattn's own requirement,
# and the CUDA 12 one an older PyTorch brings.
_CUDNN_WHEELS = ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")


def cudnn_location() -> dict[str, str | None]:
    """Which libcudnn the first GPU call would load, found the way ensure_loaded looks
    (FASTATTN_CUDNN_PATH, then the first wheel on sys.path, then cuda-pathfinder)
    without loading anything, so that `fastattn info` can say it on a machine without a
    GPU. path: the file, or None where only cuda-pathfinder can tell; chosen_by: why
    that one; wheel, wheel_version: the pip distribution that installed it (the one in
    the same sys.path entry) and its version, or None."""
    override = os.environ.get(_CUDNN[1])
    if override:
        return {"path": override, "chosen_by": _CUDNN[1], "wheel": None, "wheel_version": None}
    held = _already_loaded(_CUDNN_SONAME)
    if held:
        wheel, version = _wheel_in(_site_of(held)) if held.endswith(_WHEEL_PATHS["cudnn"]) else (None, None)
        return {"path": held, "chosen_by": "already loaded in this process (by PyTorch or another library)",
                "wheel": wheel, "wheel_version": version}
    for entry in sys.path:
        path = os.path.join(entry or ".", _WHEEL_PATHS["cudnn"])
        if os.path.isfile(path):
            wheel, version = _wheel_in(entry or ".")
            return {"path": path, "chosen_by": "the first NVIDIA cuDNN wheel on sys.path", "wheel": wheel,
                    "wheel_version": version}
    return {"path": None, "chosen_by": "cuda-pathfinder, at the first GPU call (conda, CUDA_HOME, the system "
                                       "loader): no cuDNN wheel is installed", "wheel": None, "wheel_version": None}


def _site_of(path: str) -> str:
    """The sys.path entry that holds a wheel's nvidia/cudnn/lib/libcudnn.so.9."""
    return path[: -len(_WHEEL_PATHS["cudnn"])].rstrip(os.sep) or os.sep


def _already_loaded(soname: str) -> str | None:
    """The file of a library this process already holds under soname, resolved, or None.
    Asks the system loader (RTLD_NOLOAD loads nothing), then where a symbol of it lives."""
    try:
        handle = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    try:
        symbol = ctypes.cast(handle.cudnnGetVersion, ctypes.c_void_p)
        info = _DlInfo()
        if ctypes.CDLL(None).dladdr(symbol, ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(os.fsdecode(info.dli_fname))
    except (AttributeError, OSError):  # no dladdr, or not cuDNN: the maps still say where it is
        pass
    return next((p for p in mapped_cudnn() if os.path.basename(p).startswith("libcudnn.so")), None)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def mapped_cudnn(maps: str = "/proc/self/maps") -> list[str]:
    """Every cuDNN library file mapped into this process (libcudnn.so.9 and the sub-libraries
    it opens: graph, engines, heuristic, ...), resolved and sorted: one directory when the
    process holds one cuDNN. [] where the maps cannot be read (not Linux)."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = set()
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and os.path.basename(parts[5]).startswith("libcudnn"):
            found.add(os.path.realpath(parts[5].removesuffix(" (deleted)")))
    return sorted(found)


def cudnn_copies_problem(files: list[str]) -> str | None:
    """Why the mapped cuDNN files are not one cuDNN (two directories, or one library twice),
    or None."""
    folders = sorted({os.path.dirname(p) for p in files})
    names = [os.path.basename(p).split(".so")[0] for p in files]
    if len(folders) > 1 or len(names) != len(set(names)):
        return f"this process holds more than one cuDNN: {', '.join(files)}"
    return None


def _wheel_in(entry: str) -> tuple[str | None, str | None]:
    from importlib import metadata

    for name in _CUDNN_WHEELS:
        try:
            found = next(iter(metadata.distributions(name=name, path=[entry])), None)
        except Exception:  # unreadable metadata: the path is still the answer
            found = None
        if found is not None:
            return name, found.version
    return None, None


def _load_one(name: str, env: str, hint: str) -> tuple[str | None, str | None]:
    """(path, None) when loaded, (None, why) when not."""
    override = _env.get(env)
    held = _already_loaded(_CUDNN_SONAME) if name == _CUDNN[0] else None
    if held:
        if override and os.path.realpath(override) != held:
            return None, (f"{env}={override!r}, but this process already holds cuDNN {held} (loaded by PyTorch or "
                          f"another library before fastattn's first GPU call), and one process can use one cuDNN: "
                          f"unset {env}, or make {held} the cuDNN that library loads")
        return held, None
    if override:
        try:
            ctypes.CDLL(override, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            return None, f"{env}={override!r} could not be loaded: {e}"
        return override, None
    found = _from_wheels(name)
    if found:
        return found, None
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as e:  # pragma: no cover - cuda-python is a dependency
        return None, f"cuda-pathfinder is not importable ({e}); pip install cuda-python"
    try:
        return load_nvidia_dynamic_lib(name).abs_path, None
    except Exception as e:  # pathfinder raises its own DynamicLibNotFoundError and OSErrors
        return None, f"lib{name} was not found ({type(e).__name__}: {e}); {hint}, or set {env}"


def _check_driver() -> str | None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"the NVIDIA driver library libcuda.so.1 could not be loaded ({e}); {_DRIVER_HINT}"
    return None


def ensure_loaded(on_step: Callable[[str], None] | None = None) -> Libraries:
    """Loads everything the GPU path needs, once per process. Raises LibraryError
    (an OSError) listing each missing piece. A failure is not remembered: a later
    call tries again (after the user installs what was missing, or sets a variable).
    on_step(label) is called after each step of a first load ("load cudart", ...,
    "check libcuda", "load cudnn", "init_cudnn"): the profiles' breakdown of it."""
    global _loaded
    if _loaded is not None:
        return _loaded
    step = on_step or (lambda label: None)
    with _lock:
        if _loaded is not None:
            return _loaded
        paths: dict[str, str] = {}
        problems: list[str] = []
        for name, env, hint in _DEPENDENCIES:
            path, why = _load_one(name, env, hint)
            step(f"load {name}")
            if why:
                problems.append(why)
            else:
                paths[name] = path
        driver_problem = _check_driver()
        step("check libcuda")
        if driver_problem:
            problems.append(driver_problem)
        # cuDNN last: its dependencies must be loadable before it looks for them.
        if not problems:
            path, why = _load_one(*_CUDNN)
            step("load cudnn")
            if why:
                problems.append(why)
            else:
                paths["cudnn"] = path
        else:
            problems.extend(_locate_cudnn_problem())
        if problems:
            raise LibraryError("fastattn cannot use the GPU:\n  - " + "\n  - ".join(problems))

        # cudnn-frontend dlopens libcudart by name; make it take the one loaded above.
        os.environ.setdefault("CUDNN_FRONTEND_CUDART_LIB_NAME", paths["cudart"])
        _core = import_core()

        version = _core.init_cudnn(paths["cudnn"])
        step("init_cudnn")
        check_cudnn_version(version, paths["cudnn"])
        _loaded = Libraries(
            cudnn=paths["cudnn"],
            cudart=paths["cudart"],
            nvrtc=paths["nvrtc"],
            cublaslt=paths["cublasLt"],
            cudnn_version=version,
        )
        return _loaded


def import_core():
    """fastattn._core, the compiled extension (it loads no CUDA library by itself).
    Raises LibraryError (exit 3 from the command), in one line, where it does not
    import: above all a source checkout that Python imports instead of the installed
    package (`python -m fastattn` in the cloned repository: the current directory comes
    first on sys.path, and a checkout has _core.pyx, not the built module)."""
    try:
        from . import _core
    except ImportError as e:
        raise LibraryError(core_problem(e)) from None
    return _core


def _built_core(folder: str) -> str | None:
    """The built extension module in a fastattn folder, or None."""
    import importlib.machinery

    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_core" + suffix)
        if os.path.isfile(path):
            return path
    return None


def core_problem(error: ImportError) -> str:
    """Why fastattn._core does not import, and what to do: import_core's message."""
    here = os.path.dirname(os.path.abspath(__file__))
    built = _built_core(here)
    if built is not None:
        return f"fastattn's compiled extension {built} does not load: {error}"
    for entry in sys.path:
        folder = os.path.join(os.path.abspath(entry or os.curdir), "fastattn")
        if os.path.realpath(folder) != os.path.realpath(here) and _built_core(folder) is not None:
            return (f"fastattn was imported from {here}, a source tree without its compiled extension, which "
                    f"shadows the fastattn installed in {folder} (Python puts the current directory first on "
                    "sys.path for `python -m` and `python -c`): run the `fastattn` command, or run Python from "
                    "another directory")
    return (f"fastattn's compiled extension (_core) is not built in {here}: install fastattn (pip install .), or "
            "build it in place (pip install -e .)")


def version_text(version: int) -> str:
    """cuDNN 9's version number (major * 10000 + minor * 100 + patch) as "9.19.0"."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def version_number(text: str | None) -> int | None:
    """version_text's inverse, for a wheel's version ("9.24.0.43" is 92400: its fourth
    part is the build), or None where `text` is no such version."""
    parts = str(text or "").split(".")
    if len(parts) < 3 or not all(p.isascii() and p.isdigit() for p in parts[:3]):
        return None
    return int(parts[0]) * 10000 + int(parts[1]) * 100 + int(parts[2])


def check_cudnn_version(version: int, path: str) -> None:
    """Raises LibraryError, saying what to do, when the loaded cuDNN is older than
    MIN_CUDNN (or not cuDNN 9)."""
    if MIN_CUDNN <= version < 100000:
        return
    need = version_text(MIN_CUDNN)
    found = version_text(version) if version >= 10000 else str(version)
    raise LibraryError(
        f"fastattn cannot use the GPU: cuDNN {found} at {path} is not supported: fastattn needs cuDNN 9, "
        f"{need} or newer (the oldest its GPU tests run on). Upgrade it with "
        f"pip install 'nvidia-cudnn-cu13>={need},<10' (if PyTorch pins an older cuDNN, a newer PyTorch brings a "
        f"newer one), or set FASTATTN_CUDNN_PATH to a libcudnn.so.9 of version {need} or newer.")


def _locate_cudnn_problem() -> list[str]:
    """Without loading cuDNN (its dependencies are missing), whether an override names
    a file that does not exist: worth saying in the same error."""
    env = _CUDNN[1]
    override = _env.get(env)
    if override and not os.path.isfile(override):
        return [f"{env}={override!r} is not a file"]
    return []
