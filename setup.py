"""Declares the one extension, fastattn._core, and finds the headers it compiles against.

Headers come from pip wheels so that a machine with no CUDA toolkit can build; each
location can be overridden by an environment variable, with CUDA_HOME as the last
resort for CUDA's headers. Nothing is linked but libdl: cuDNN and CUDA are loaded
at run time (fastattn/_loader.py).
"""

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


def _wheel_dir(dist: str, *parts: str) -> Path | None:
    try:
        path = Path(metadata.distribution(dist).locate_file(Path(*parts)))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_dir() else None


def _include(env: str, header: str, candidates, what: str) -> str:
    """The first directory holding `header`: $env if set, else the candidates."""
    override = os.environ.get(env)
    dirs = [Path(override)] if override else [c for c in candidates if c is not None]
    for d in dirs:
        if (d / header).exists():
            return str(d)
    looked = ", ".join(str(d) for d in dirs) or "nowhere (no candidate found)"
    sys.exit(
        f"fastattn build: {header} ({what}) not found; looked in {looked}. "
        f"Install the wheel named in pyproject.toml's build requirements or set {env}."
    )


def include_dirs():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cuda_home_inc = Path(cuda_home) / "include" if cuda_home else None
    cu13 = _wheel_dir("nvidia-cuda-runtime", "nvidia", "cu13", "include")
    dirs = [
        _include("FASTATTN_CUDNN_FRONTEND_INCLUDE", "cudnn_frontend.h",
                 [_wheel_dir("nvidia-cudnn-frontend", "include")], "cudnn-frontend, nvidia-cudnn-frontend"),
        _include("FASTATTN_CUDNN_INCLUDE", "cudnn.h",
                 [_wheel_dir("nvidia-cudnn-cu13", "nvidia", "cudnn", "include"), cuda_home_inc], "cuDNN, nvidia-cudnn-cu13"),
        _include("FASTATTN_CUDA_INCLUDE", "cuda_runtime.h", [cu13, cuda_home_inc], "CUDA runtime, nvidia-cuda-runtime"),
        _include("FASTATTN_CUDA_CRT_INCLUDE", "crt/host_config.h",
                 [_wheel_dir("nvidia-cuda-crt", "nvidia", "cu13", "include"), cu13, cuda_home_inc],
                 "CUDA crt headers, nvidia-cuda-crt"),
        # cuda_fp16.h includes <nv/target>, which is CCCL's.
        _include("FASTATTN_CCCL_INCLUDE", "nv/target",
                 [_wheel_dir("nvidia-cuda-cccl", "nvidia", "cu13", "include"), cu13, cuda_home_inc,
                  cuda_home_inc / "cccl" if cuda_home_inc else None],
                 "CUDA CCCL headers, nvidia-cuda-cccl"),
        # cudnn-frontend includes nvrtc.h unconditionally.
        _include("FASTATTN_NVRTC_INCLUDE", "nvrtc.h",
                 [_wheel_dir("nvidia-cuda-nvrtc", "nvidia", "cu13", "include"), cu13, cuda_home_inc],
                 "NVRTC, nvidia-cuda-nvrtc"),
    ]
    # fastattn/include: the C ABI header _core hands to the PyTorch op library (shipped in
    # the package, since that library is compiled on the user's machine).
    return [str(ROOT / "csrc"), str(ROOT / "fastattn" / "include")] + list(dict.fromkeys(dirs))


class ParallelBuildExt(build_ext):
    """Compiles the extension's sources in parallel: the cudnn-frontend translation
    unit alone takes ~70 s, and the others (Cython's, then the small ones that need no
    frontend) should not wait behind it."""

    def build_extension(self, ext):
        compiler = self.compiler
        original = compiler.compile

        def compile_parallel(sources, *args, **kwargs):
            with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
                results = list(pool.map(lambda s: original([s], *args, **kwargs), sources))
            return [obj for objs in results for obj in objs]

        compiler.compile = compile_parallel
        try:
            super().build_extension(ext)
        finally:
            compiler.compile = original


# csrc/'s headers. The ones that include cudnn-frontend (graph_state.h, handles.h, packs.h,
# graphs.h, graphs_fp8.h) are included by csrc/attention.cpp alone.
HEADERS = ["fastattn.h", "config_gen.h", "bench.h", "status.h", "device.h", "slots.h", "ragged.h", "ragged_ptx.h", "graph_state.h",
           "handles.h", "packs.h", "graphs.h", "graphs_fp8.h"]


def nodriver_source(cuda_include: str) -> str:
    """csrc/nodriver.c, the stand-in libcuda, completed with an entry point for every
    other driver function that the CUDA headers the build uses declare (cuDNN links
    some and looks others up; each returns CUDA_ERROR_STUB_LIBRARY, 34), written to
    build/ and returned as a path relative to the repository."""
    import re

    headers = "".join((Path(cuda_include) / h).read_text(errors="replace")
                      for h in ("cuda.h", "cudaProfiler.h") if (Path(cuda_include) / h).exists())
    names = set(re.findall(r"\bCUresult\s+CUDAAPI\s+(cu[A-Z]\w*)\s*\(", headers))
    names |= set(re.findall(r"#\s*define\s+cu[A-Z]\w*\s+(cu[A-Z]\w*)\b", headers))  # the _v2, _v3 names
    # The per-thread default stream's names (__CUDA_API_PTDS(cuX) is cuX_ptds)
    names |= {f"{n}_{kind.lower()}" for kind, n in re.findall(r"__CUDA_API_(PTDS|PTSZ)\((cu\w+)\)", headers)}
    own = (ROOT / "csrc" / "nodriver.c").read_text()
    names -= set(re.findall(r"^int (cu\w+)\(", own, re.M))
    out = Path("build") / "gen" / "nodriver.c"
    (ROOT / out).parent.mkdir(parents=True, exist_ok=True)
    stubs = "".join(f"int {n}(void) {{ return kStubLibrary; }}\n" for n in sorted(names))
    (ROOT / out).write_text(f'#include "{ROOT / "csrc" / "nodriver.c"}"\n\n// from {cuda_include}\n{stubs}')
    return str(out)


def extensions():
    from Cython.Build import cythonize

    ext = Extension(
        "fastattn._core",
        # The cudnn-frontend translation unit first: it takes the longest (~70 s), and the
        # pool starts the sources in this order, the small ones after the Cython one.
        sources=["csrc/attention.cpp", "fastattn/_core.pyx", "csrc/device.cpp", "csrc/slots.cpp", "csrc/ragged.cpp"],
        # Included by the sources: a change to any of them rebuilds the extension.
        depends=[*(f"csrc/{h}" for h in HEADERS), "fastattn/include/fastattn_abi.h", "fastattn/_core_bench.pxi",
                 "fastattn/_core_abi.pxi", "fastattn/_core_config.pxi"],
        include_dirs=include_dirs(),
        language="c++",
        define_macros=[("NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING", None)],
        extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-Wno-deprecated-declarations"],
        libraries=["dl"],
    )
    # The stand-in libcuda (fastattn/target.py), named by its soname when it is loaded.
    nodriver = Extension(
        "fastattn._nodriver",
        sources=[nodriver_source(_include("FASTATTN_CUDA_INCLUDE", "cuda.h", [
            _wheel_dir("nvidia-cuda-runtime", "nvidia", "cu13", "include"),
            Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/nonexistent") / "include"],
            "the CUDA driver API's declarations, nvidia-cuda-runtime"))],
        depends=["csrc/nodriver.c"],
        extra_link_args=["-Wl,-soname,libcuda.so.1"],
        language="c",
    )
    return cythonize([ext], compiler_directives={"language_level": "3"}) + [nodriver]


# Only when run as the build script (setuptools' build backend runs it as __main__): the
# tests import include_dirs() and HEADERS from here.
if __name__ == "__main__":
    setup(ext_modules=extensions(), cmdclass={"build_ext": ParallelBuildExt})
