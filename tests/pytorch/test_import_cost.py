"""What importing fastattn.torch costs a server's cold start: no module that PyTorch
itself imports lazily (torch._dynamo: 1-4 s; seen in profile_first_call.py when
torch.nn.attention.bias came in with fastattn.torch._sdpa)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
LAZY = ("torch._dynamo", "torch._inductor", "torch.nn.attention.bias", "sympy", "transformers")


def test_importing_fastattn_torch_and_flash_imports_none_of_torchs_lazy_modules():
    code = ("import sys, torch; before = set(sys.modules); import fastattn.torch, fastattn.flash; "
            f"print(sorted(m for m in {LAZY!r} if m in sys.modules and m not in before))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"imported with fastattn.torch: {r.stdout.strip()}"


def test_the_sdpa_modes_first_route_imports_none_of_torchs_lazy_modules():
    # (a Meta kernel call imports sympy: seconds of the mode's first call on the H200)
    code = ("import sys, torch, fastattn.torch; from fastattn.torch import _sdpa_mode; "
            "_sdpa_mode._dense.plan_for = lambda *a: None; before = set(sys.modules); "
            "q = torch.empty(1, 8, 16, 64, dtype=torch.bfloat16).transpose(1, 2); "
            "r = _sdpa_mode._route(q, q, q, None, 0.0, True, None, True); assert r.layout == 'bshd', r; "
            f"print(sorted(m for m in {LAZY!r} + ('torch.fx.experimental.symbolic_shapes',) "
            "if m in sys.modules and m not in before))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"imported by the first route: {r.stdout.strip()}"
