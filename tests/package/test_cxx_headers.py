"""The C++ sources are modules, not fragments: each header compiles alone, the ones that
need no cudnn-frontend never reach it (so their translation units compile in seconds,
beside the one that includes it), only csrc/attention.cpp includes the headers that do,
and every header and source is one the builds know of (setup.py's depends, the op
library's tag). Skipped only where there is no C++ compiler, or no headers to compile
against (CUDA's, torch's), with the reason."""

import os
import re
import runpy
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers.paths import ROOT

CSRC = ROOT / "csrc"
# Need no cudnn-frontend: compiled alone here, and their dependencies checked.
FRONTEND_FREE = ["fastattn.h", "config_gen.h", "bench.h", "status.h", "device.h", "slots.h", "ragged.h", "ragged_ptx.h"]
FRONTEND_FREE_SOURCES = ["device.cpp", "slots.cpp", "ragged.cpp"]
# Include cudnn-frontend: for attention.cpp alone. Not compiled alone here: each would
# parse the frontend for ~20 s; every build of the extension compiles them.
FRONTEND = ["graph_state.h", "handles.h", "packs.h", "graphs.h", "graphs_fp8.h"]


def _setup():
    return runpy.run_path(str(ROOT / "setup.py"), run_name="fastattn_setup")


def _compiler() -> list[str]:
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    if shutil.which(cxx[0]) is None:
        pytest.skip(f"no C++ compiler: CXX={cxx[0]!r} not found")
    return cxx


def _include_flags() -> list[str]:
    try:
        dirs = _setup()["include_dirs"]()
    except SystemExit as e:  # setup.py names the header it did not find
        pytest.skip(str(e))
    return [f"-I{d}" for d in dirs]


def _includes(path: Path) -> list[str]:
    return re.findall(r'^#include "([^"]+)"', path.read_text(), re.M)


def test_every_header_and_source_of_the_extension_is_one_the_build_knows():
    setup = _setup()
    headers = sorted(p.name for p in CSRC.glob("*.h"))
    assert sorted(setup["HEADERS"]) == headers, "setup.py's HEADERS (the extension's depends) misses or adds headers"
    assert sorted(FRONTEND_FREE + FRONTEND) == headers, "a new header: say here whether it includes cudnn-frontend"
    # setup.py's sources, read from its text: extensions() needs Cython to run.
    listed = re.search(r"sources=\[([^\]]*)\]", (ROOT / "setup.py").read_text()).group(1)
    assert sorted(re.findall(r'"csrc/([^"]+\.cpp)"', listed)) == sorted(p.name for p in CSRC.glob("*.cpp"))


def test_only_attention_cpp_includes_cudnn_frontend():
    for path in sorted(CSRC.glob("*.h")) + sorted(CSRC.glob("*.cpp")):
        uses_frontend = "cudnn_frontend.h" in re.findall(r"^#include <([^>]+)>", path.read_text(), re.M)
        if path.name in FRONTEND or path.name == "attention.cpp":
            assert uses_frontend, f"{path.name} uses cudnn-frontend: it includes it itself"
        else:
            assert not uses_frontend, f"{path.name} includes cudnn-frontend"
            assert not set(_includes(path)) & set(FRONTEND), f"{path.name} includes a header that includes it"
    assert set(FRONTEND) <= set(_includes(CSRC / "attention.cpp"))


def test_the_headers_that_need_no_cudnn_frontend_compile_alone_and_never_reach_it(tmp_path):
    cxx, flags = _compiler(), _include_flags()
    # One compiler process, one translation unit per file (a header through a file that
    # includes only it); -M lists every header a file reads.
    files = []
    for h in FRONTEND_FREE:
        files.append(tmp_path / f"alone_{h}.cpp")
        files[-1].write_text(f'#include "{CSRC / h}"\n')
    files += [CSRC / s for s in FRONTEND_FREE_SOURCES]
    cmd = [*cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING",
           *flags, *(str(f) for f in files)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    for name in FRONTEND_FREE + FRONTEND_FREE_SOURCES:
        deps = subprocess.run([*cxx, "-std=c++17", "-M", *flags, "-x", "c++", str(CSRC / name)],
                              capture_output=True, text=True, cwd=tmp_path)
        assert deps.returncode == 0, deps.stderr[-2000:]
        assert "cudnn_frontend" not in deps.stdout, f"{name} reaches cudnn-frontend"


def test_the_abi_header_compiles_as_c(tmp_path):
    cc = shlex.split(os.environ.get("CC", "cc"))
    if shutil.which(cc[0]) is None:
        pytest.skip(f"no C compiler: CC={cc[0]!r} not found")
    unit = tmp_path / "abi.c"
    unit.write_text(f'#include "{ROOT / "fastattn" / "include" / "fastattn_abi.h"}"\n')
    done = subprocess.run([*cc, "-std=c99", "-fsyntax-only", "-Wall", "-Werror", str(unit)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]


def test_every_source_and_header_of_the_op_library_is_in_its_build_and_its_tag():
    from fastattn import _opslib

    csrc = ROOT / "fastattn" / "torch" / "csrc"
    assert sorted(s.name for s in _opslib.SOURCES) == sorted(p.name for p in csrc.glob("*.cpp"))
    assert len(set(_opslib.SOURCES)) == len(_opslib.SOURCES)  # each in one unit
    # By name: under CI the tests import the installed package, whose files live elsewhere.
    assert {p.name for p in csrc.glob("*.h")} <= {h.name for h in _opslib.HEADERS}
    assert not list(csrc.glob("*.inc")), "fragments are headers or sources now"


def test_the_op_librarys_shared_header_compiles_alone(tmp_path):
    pytest.importorskip("torch")
    from fastattn.torch import _native

    _compiler()
    unit = tmp_path / "ops_h.cpp"
    unit.write_text(f'#include "{ROOT / "fastattn" / "torch" / "csrc" / "ops.h"}"\n')
    generated = _native.write_generated(tmp_path / "generated")
    cmd = _native.compile_command(unit, tmp_path / "ops_h.o", "fastattn_ops_header_test", generated)
    cmd = ["-fsyntax-only" if part == "-c" else part for part in cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
