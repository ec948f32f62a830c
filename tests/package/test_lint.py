"""The code passes the linter as pyproject.toml configures it ([tool.ruff]): part of the
README's test command, so that CI, which runs only the README's commands, lints too.
ruff is pinned in tests/requirements.txt, so that a new release's rules cannot fail a
clean clone; skipped, with the reason, where it is not installed."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_checkout_passes_ruff_as_pyproject_configures_it():
    pytest.importorskip("ruff", reason="ruff is not installed (pip install -r tests/requirements.txt)")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
