"""The benchmark scripts of benchmarks/ as modules, for CPU tests of their argument
parsing and pure helpers, and as commands (their --help, their refusal without CUDA)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from helpers.paths import ROOT

BENCHMARKS = ROOT / "benchmarks"


def load(name: str):
    """benchmarks/<name>.py as a module; benchmarks/ is on sys.path while it imports, as
    when it runs as a script (it imports _common and its sibling scripts by name)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def run(name: str, *args: str, cuda: bool = True) -> subprocess.CompletedProcess:
    """`python benchmarks/<name>.py *args` with this checkout on PYTHONPATH; cuda=False
    hides every GPU (CUDA_VISIBLE_DEVICES="")."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], capture_output=True, text=True,
                          env=env, timeout=120)
