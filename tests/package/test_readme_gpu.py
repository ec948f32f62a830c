"""The README's first example and docs/API.md's run as written on a GPU, each where its
framework is installed (test_readme.py compiles them and checks their arrays without a GPU)."""

import os

import pytest

from helpers.paths import README
from test_readme import API, _block, _python_blocks


def test_readme_example_runs(capsys):
    exec(compile(_python_blocks()[0], str(README), "exec"), {})
    assert capsys.readouterr().out.startswith("True ")


def test_readme_cupy_example_runs(capsys):
    pytest.importorskip("cupy", reason="cupy is not installed")
    exec(compile(_block("CuPy"), f"{API}:CuPy", "exec"), {})
    assert capsys.readouterr().out == "True\n"


def test_readme_jax_example_runs(capsys, monkeypatch):
    # Before jax starts its backend: by default it takes 75% of the GPU's memory, which
    # the tests after this one would miss.
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false"))
    jax = pytest.importorskip("jax", reason="jax is not installed")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip(f"jax sees no GPU (devices: {jax.devices()})")
    exec(compile(_block("JAX"), f"{API}:JAX", "exec"), {})
    assert capsys.readouterr().out == "True\n"
