"""The native path of fastattn.torch: finding, building and loading the C++ op library
(fastattn/torch/csrc/: ops.h lists its units), and the Python miss handler it calls.

Which path runs is chosen once per process, by FASTATTN_TORCH_PATH:
  auto (default): the native path where the library is built (by `fastattn warm`) and
    loads, else the Python path (a library that fails to load warns once, saying why);
  native: the native path or an error, building the library at the first call if
    needed (tests, deployments that must not fall back);
  python: the Python path, the library is never built.

The library is compiled against the torch that is imported, by the C++ compiler
(CXX, else c++; its units in parallel, one per core, then linked), into the cache directory under a tag of the fastattn version, the
torch version, its C++ ABI, the Python version and a hash of the sources (_opslib), so
an upgrade of any of them builds anew and never loads a stale library. Builds are
serialized by a flock (the kernel drops it when its holder dies, so a crashed build
blocks no one) and published by an atomic rename. `fastattn warm` builds it beside the
plans where torch is installed, so that a deployment pays nothing at its first call.
Why first use and not setup.py: pip builds in an isolated environment without torch,
so setup.py cannot see the torch the user has (docs/DECISIONS.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from pathlib import Path

from .. import _opslib, bounded, env as _env
from . import _kernels, _options
from .._opslib import CSRC, GENERATED, INCLUDE, SOURCES, build_root  # noqa: F401 - build_root, SOURCES: what tests and tools ask
from ..errors import InvalidArgumentError

ENV = "FASTATTN_TORCH_PATH"
MODES = _env.VARIABLES[ENV].choices
_env.get(ENV)  # a bad value fails the import: every path (eager, traced, meta), not only an eager CUDA call

_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded module or None, "reason": why this path, "mode"

# The forward ops of attention() (DENSE), attention_varlen() (VARLEN) and
# attention_paged() (PAGED) once the path is
# decided: (eager, traced) or None for the Python path; UNDECIDED before the first
# decision. eager is the operator's C++ entry point (past torch.ops' Python wrappers,
# which cost host time on every call; attention_paged's, eager.cpp's call_paged, past the
# dispatcher too), traced its OpOverload, which torch.compile records. Module globals, so that an entry point reads its op in one lookup.
UNDECIDED = object()
DENSE = VARLEN = PAGED = UNDECIDED
# attention()'s own 17 arguments, read in C (eager.cpp's call): the first thing a call
# outside torch.compile tries. None until the native path is decided (the Python body
# decides it), and on the Python path. CALL_VARLEN: attention_varlen()'s 18
# (eager.cpp's call_varlen), likewise.
CALL = CALL_VARLEN = None
# Sources a tool compiles into the op library beside its own, as one more translation unit
# (benchmarks/profile_native_step.py: its profile_eager, which times the library's own
# pieces), set before the path is decided. Part of the tag: such a library is built and
# kept apart from the one every other process loads, which has none of them.
EXTRA: tuple[Path, ...] = ()


def mode() -> str:
    """FASTATTN_TORCH_PATH, checked."""
    return _env.get(ENV)


def tag() -> str:
    """What the built library depends on (_opslib.tag) for the imported torch."""
    import torch

    return _opslib.tag(torch.__version__, int(torch._C._GLIBCXX_USE_CXX11_ABI), EXTRA)


def compile_command(source: Path, output: Path, name: str, generated: Path, optimize: str = "-O2") -> list[str]:
    """The compiler line of one translation unit: torch's include dirs, its C++ ABI, C++20
    (what torch's own extensions use); `generated` holds the sources generated for this
    build (write_generated), which include the hand-written headers (CSRC); `optimize`, the
    unit's optimization flag (_opslib.optimization)."""
    from torch.utils import cpp_extension

    cxx = shlex.split(os.environ.get("CXX", "c++"))
    # torch's and Python's headers as system headers (their warnings are theirs); ours with
    # the warnings that are bugs as errors (a reference to a temporary returned: s14's
    # sdpa.cpp, found by review, would have crashed at its first fallback).
    system = [*cpp_extension.include_paths(), _python_include()]
    return [*cxx, "-c", "-fPIC", optimize, "-std=c++20", "-fvisibility=hidden", *_bug_warnings(tuple(cxx)),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(_torch()._C._GLIBCXX_USE_CXX11_ABI)}",
            "-DTORCH_API_INCLUDE_EXTENSION_H", f"-DTORCH_EXTENSION_NAME={name}",
            *(f"-isystem{d}" for d in system), f"-I{INCLUDE}", f"-I{CSRC}", f"-I{generated}", str(source), "-o",
            str(output)]


@functools.lru_cache(maxsize=None)
def _bug_warnings(cxx: tuple[str, ...]) -> tuple[str, ...]:
    """The compiler's names for warnings that are bugs, as errors: GCC's and Clang's differ."""
    try:
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ()  # the compile itself says what is wrong with the compiler
    # Only what is never right (not -Werror=return-type: compilers differ on whether a
    # TORCH_CHECK(false, ...) ends a function, and a build that fails on one of them would
    # leave the user without the native path).
    if "clang" in version.lower():
        return ("-Werror=return-stack-address",)
    return ("-Werror=return-local-addr",)


def _python_include() -> str:
    """The folder of this Python's headers (Python.h), which the units include."""
    return sysconfig.get_paths()["include"]


def build_problem() -> str | None:
    """Why the library cannot be built here, with what would fix it, or None: what a
    build needs (a C++ compiler, Python's headers; torch's come with its wheel), looked
    for without running anything. No GPU is needed."""
    import shutil

    cxx = shlex.split(os.environ.get("CXX", "c++"))[:1]
    if not cxx or shutil.which(cxx[0]) is None:
        return f"there is no C++ compiler (CXX={os.environ.get('CXX', 'c++')!r}): install one, or set CXX"
    include = _python_include()
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return (f"Python's headers (Python.h) are not in {include}: install them (Debian and Ubuntu: "
                f"python{sys.version_info.major}.{sys.version_info.minor}-dev)")
    return None


def link_command(objects: list[Path], output: Path) -> list[str]:
    """The linker line: the units' objects against torch's libraries, a shared libstdc++."""
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    lib_dir = os.path.join(os.path.dirname(_torch().__file__), "lib")
    return [*cxx, "-shared", "-fPIC", *(str(o) for o in objects),
            f"-L{lib_dir}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib_dir}",
            "-o", str(output)]


def _torch():
    import torch

    return torch


def _workers() -> int:
    """The cores this process may use: the units compile in parallel, at most one per core
    (each compiler takes ~0.5-1.5 GB)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _run(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """One compiler or linker run, which _opslib.cancel_builds() can stop."""
    t0 = time.perf_counter()
    try:
        proc = _opslib.start_compiler(cmd)
    except FileNotFoundError:
        raise RuntimeError(f"no C++ compiler: CXX={cmd[0]!r} not found") from None
    out, err = _opslib.finish_compiler(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.perf_counter() - t0


# What a build writes beside the library while it runs: its objects' folder and the
# library before its rename (tempfile's names, with these affixes).
_OBJECTS_PREFIX, _LIBRARY_TMP_SUFFIX = "objects.", ".so.tmp"


def _remove_leftovers(folder: Path) -> None:
    """What builds that were killed (SIGKILL, a crash: no `finally` ran) left in the
    build folder. Called under the build lock: every build that writes them holds it,
    so what is there then is no running build's."""
    import shutil

    for path in folder.iterdir():
        name = path.name
        if name.startswith(_OBJECTS_PREFIX) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif name.endswith(_LIBRARY_TMP_SUFFIX) and path.is_file() and not path.is_symlink():
            with contextlib.suppress(OSError):
                path.unlink()


def _failure(what: str, done: subprocess.CompletedProcess) -> RuntimeError:
    tail = (done.stderr or done.stdout).strip()[-2000:]
    return RuntimeError(f"{what} failed (exit {done.returncode}): {tail}")


def build(root: Path | None = None) -> Path:
    """The library for this torch, built into root (default: the cache directory) unless
    it is there already: its translation units (_opslib.units) compiled in parallel, then linked. Raises
    RuntimeError with the compiler's output when it fails."""
    import fcntl
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    target = library_path(root)
    folder, name = target.parent, target.name.split(".")[0]
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a second waits, then finds it built
        if target.exists():
            return target
        _remove_leftovers(folder)
        if _opslib.cancelled():
            raise _opslib.BuildCancelled("the build was cancelled")
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=_LIBRARY_TMP_SUFFIX)
        os.close(fd)
        objects = Path(tempfile.mkdtemp(dir=folder, prefix=_OBJECTS_PREFIX))
        try:
            generated = write_generated(folder / "generated")
            cores = _workers()
            groups = _opslib.units(cores) + ((tuple(str(p) for p in EXTRA),) if EXTRA else ())
            units = [write_unit(objects, i, names, generated) for i, names in enumerate(groups)]
            commands = [compile_command(unit, unit.with_suffix(".o"), name, generated, _opslib.optimization(names))
                        for unit, names in zip(units, groups)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=max(1, min(len(units), cores))) as pool:
                results = list(pool.map(_run, commands))
            for names, (done, _) in zip(groups, results):
                if done.returncode != 0:
                    raise _failure(f"compiling {' + '.join(names)}", done)
            link = link_command([unit.with_suffix(".o") for unit in units], Path(tmp))
            done, link_s = _run(link)
            if done.returncode != 0:
                raise _failure(f"linking {target.name}", done)
            # Each unit's sources, flag and seconds, then its compiler line: what a slow build is read by.
            log = [f"{' + '.join(Path(n).name for n in names)} ({_opslib.optimization(names)}): {took:.1f} s\n"
                   f"  {shlex.join(cmd)}" for names, cmd, (_, took) in zip(groups, commands, results)]
            log.append(f"link: {link_s:.1f} s\n  {shlex.join(link)}")
            log.append(f"total {time.perf_counter() - t0:.1f} s: {len(units)} units on {cores} cores")
            (folder / "build.log").write_text("\n".join(log) + "\n")
            os.replace(tmp, target)  # atomic: a reader sees no library or a whole one
        finally:
            shutil.rmtree(objects, ignore_errors=True)
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def write_unit(folder: Path, index: int, names: tuple[str, ...], generated: Path) -> Path:
    """Translation unit `index`: its sources (`names`: hand-written ones from
    fastattn/torch/csrc/, GENERATED ones from `generated`, EXTRA's by their absolute
    paths) included one after the other, as CMake's unity builds batch them."""
    path = folder / f"unit{index}.cpp"
    path.write_text("// Generated by fastattn.torch._native: one translation unit of the op library.\n"
                    + "".join(f'#include "{(generated if n in GENERATED else CSRC) / n}"\n'
                              for n in names))
    return path


def write_generated(folder: Path) -> Path:
    """The op library's generated sources, from the ops' specs (_specs.py), in `folder`,
    which is returned: fastattn_options.h and fastattn_calls.h (by _options.py), and
    kernels.cpp, autograd.cpp and registration.cpp with their declarations,
    fastattn_kernels.h (by _kernels.py). They stay
    beside the library, where a person debugging it reads them (the compiler's messages
    name them)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    (folder / "fastattn_options.h").write_text(_options.cpp_header())
    (folder / "fastattn_calls.h").write_text(_options.calls_header())
    (folder / "fastattn_kernels.h").write_text(_kernels.header())
    (folder / "kernels.cpp").write_text(_kernels.source())
    (folder / "autograd.cpp").write_text(_kernels.autograd())
    (folder / "registration.cpp").write_text(_kernels.registration())
    return folder


def _import(path: Path):
    name = path.name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The op library's kinds of call (its Kind: _options.OPS's order) -> (the op's plan_for,
# as the executor calls it: the op's inputs in its spec's order, o or None, the options;
# the options' NamedTuple). Each op's module registers its own when imported, so that
# this module imports none of them.
KINDS = tuple(_options.OPS)
PLAN_FOR: dict = {}


def _miss(kind, direction, *args):
    """The C++ table's miss handler (under the GIL), with (the op's inputs, o or None, its
    options as a plain tuple): validates the call as the Python path does and gets the
    plan from the runtime through the op's own plan_for (PLAN_FOR); returns (plan,
    forward graph, backward graph, forward workspace bytes, backward workspace bytes,
    whether its backward runs cuDNN's deterministic algorithm: a backward without it
    alerts under torch.use_deterministic_algorithms(True))."""
    from .. import _core

    plan_for, options = PLAN_FOR[KINDS[kind]]
    c = plan_for(*args[:-1], options._make(args[-1]))
    forward, backward = _core.abi_graphs(c.plan)
    return c.plan, forward, backward, c.forward_workspace, c.backward_workspace, c.plan.config.deterministic


def _load():
    import torch  # noqa: F401 - the library links against torch's libraries

    from .. import _core
    from ..errors import error_for_code

    path = build()
    lib = _import(path)
    # cuDNN is loaded by the first miss (the runtime's plan()), before any execute.
    lib.init(_core.abi_capsule(), _miss, error_for_code, bounded.max_entries())
    bounded.add_source("op library", lib.evictions, lib.zero_evictions)
    return lib, f"native: {path}"


def library():
    """The loaded op library, or None when the Python path runs. Decided once per
    process; in auto mode a failure warns once, naming the cause."""
    state = _state
    if "lib" in state:
        return state["lib"]
    with _lock:
        if "lib" in state:
            return state["lib"]
        m = mode()
        state["mode"] = m
        if m == "python":
            state["lib"], state["reason"] = None, f"python: {ENV}=python"
            return None
        if m == "auto" and not library_path().exists():
            # Compiling it here would make this first call wait for the whole compile
            # (docs/BENCHMARKS.md, "The fastattn command"), the very cold start fastattn
            # exists to avoid: auto mode uses a library built ahead of time.
            state["lib"], state["reason"] = None, (
                "python: the native op library is not built for this torch yet (`fastattn warm` builds "
                f"it ahead of time, once per torch version; {ENV}=native builds it at the first call)")
            return None
        try:
            state["lib"], state["reason"] = _load()
            _publish_ops()
        except Exception as e:  # the library is an optimization: any failure falls back (auto)
            cause = f"{type(e).__name__}: {e}"
            if m == "native":
                raise RuntimeError(f"fastattn: {ENV}=native, but the native op library is unavailable: {cause}") from e
            state["lib"], state["reason"] = None, f"python: the native op library is unavailable ({cause})"
            warnings.warn(f"fastattn.torch runs on its Python path: the native op library is unavailable ({cause}); "
                          f"set {ENV}=python to choose that path and silence this warning", RuntimeWarning,
                          stacklevel=3)
        return state["lib"]


def load_if_built() -> None:
    """Decides the path ahead of the first call (the warm-up), where that compiles
    nothing: the op library is loaded if it is built (auto and native modes), the Python
    path chosen where auto mode has none. Native mode without a library is left to the
    first call, which builds it."""
    if mode() != "native" or library_path().exists():
        decide()


def _publish_ops() -> None:
    global DENSE, VARLEN, PAGED, CALL, CALL_VARLEN
    import torch

    dense = torch.ops.fastattn.native_attention_forward.default
    varlen = torch.ops.fastattn.native_varlen_forward.default
    paged = torch.ops.fastattn.native_paged_forward.default
    DENSE = (getattr(dense, "_op", dense), dense)
    VARLEN = (getattr(varlen, "_op", varlen), varlen)
    PAGED = (_state["lib"].call_paged, paged)  # the eager callable: the op's kernel past torch.ops (eager.cpp)
    CALL, CALL_VARLEN = _state["lib"].call, _state["lib"].call_varlen


def decide():
    """Decides the path if not yet (what an entry point calls while UNDECIDED); returns
    DENSE (None: the Python path)."""
    global DENSE, VARLEN, PAGED, CALL, CALL_VARLEN
    if library() is None:
        DENSE = VARLEN = PAGED = CALL = CALL_VARLEN = None
    return DENSE


def status() -> dict:
    """Which path fastattn.torch takes and why (for `fastattn info`); decides it if not yet."""
    try:
        lib = library()
    except Exception as e:  # native mode's error: reported, not raised
        return {"path": "none", "reason": str(e)}
    return {"path": "native" if lib is not None else "python", "reason": _state.get("reason", "")}


def describe() -> dict:
    """Which path fastattn.torch takes in this process, and why, without building or
    loading anything (`fastattn info`): the path taken if already decided, else the one
    a first call would take."""
    if "lib" in _state:
        return status()
    try:
        m = mode()
    except InvalidArgumentError as e:
        return {"path": "none", "reason": str(e)}
    if m == "python":
        return {"path": "python", "reason": f"{ENV}=python"}
    target = library_path()
    problem = _opslib.problem(target)
    if problem:  # what a call meets: nothing to load, and no build (auto: the Python path)
        return {"path": "python" if m == "auto" else "none",
                "reason": f"{ENV}={m}; the op library's directory {target.parent} {problem}"}
    if target.exists():
        return {"path": "native", "reason": f"{ENV}={m}; built for this torch: {target}"}
    # The advice is what works on this machine: warm builds the library where a compiler
    # and Python's headers are (with or without a GPU); elsewhere, what is missing, or a
    # library built for this torch on another machine, copied in.
    problem = build_problem()
    if problem is not None:
        return {"path": "python" if m == "auto" else "none",
                "reason": f"{ENV}={m}; the native op library is not built for this torch yet, and cannot be built "
                          f"here: {problem}; then run `fastattn warm`. Or copy a library built for this torch "
                          f"({target.parent.name}) into {target.parent.parent} (or the folder "
                          "FASTATTN_TORCH_OPS_DIR names)"}
    if m == "auto":  # never compiled at a call (library())
        return {"path": "python", "reason": f"{ENV}=auto; the native op library is not built for this torch yet: "
                                            f"`fastattn warm` builds it (a C++ compiler is here; no GPU is needed) "
                                            f"into {target}"}
    return {"path": "native", "reason": f"{ENV}={m}; built at the first call (or by `fastattn warm`) "
                                        f"into {target}"}


def library_path(root: Path | None = None) -> Path:
    """Where build() puts the library for this torch."""
    return _opslib.library_path(tag(), root)


def reset() -> None:
    """Forgets the decision (tests): the next call decides again."""
    global DENSE, VARLEN, PAGED, CALL, CALL_VARLEN
    with _lock:
        _state.clear()
        DENSE = VARLEN = PAGED = UNDECIDED
        CALL = CALL_VARLEN = None
