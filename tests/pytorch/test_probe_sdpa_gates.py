"""benchmarks/probe_sdpa_gates.py on the CPU: its float64 reference is PyTorch's definition of
SDPA (causal at the top left, boolean and additive masks, GQA), and every pattern runs and
lands within the half-precision floor of it (the GPU run is the probe)."""

from __future__ import annotations

import pytest

from helpers import benchmarks

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")


@pytest.fixture(scope="module")
def probe():
    return benchmarks.load("probe_sdpa_gates")


def test_the_reference_is_pytorchs_definition_in_float64(probe):
    import torch.nn.functional as F

    torch.manual_seed(1)
    for name, q, k, v, mask, p, causal, gqa in probe.patterns(torch, "cpu"):
        q, k, v = q.double(), k.double(), v.double()
        m = mask if mask is None or mask.dtype == torch.bool else mask.double()
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, is_causal=causal, enable_gqa=gqa)
        got = probe.reference(torch, q, k, v, m, causal, gqa)
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), name


def test_every_pattern_runs_within_the_half_precision_floor(probe):
    torch.manual_seed(2)
    rows = [probe.one(torch, *case) for case in probe.patterns(torch, "cpu")]
    assert len({r["pattern"] for r in rows}) == len(rows) >= 16
    for r in rows:
        assert "failed" not in r and r["finite"], r
        assert r["error"] < 1e-2, r  # bf16 / fp16 inputs against float64
        assert r["cudnn_ok"] is False, r  # CPU tensors: never PyTorch's cuDNN backend


def test_as_a_command_it_describes_itself_and_refuses_a_machine_without_cuda():
    r = benchmarks.run("probe_sdpa_gates", "--help")
    assert r.returncode == 0 and "float32 additive mask" in r.stdout
    r = benchmarks.run("probe_sdpa_gates", cuda=False)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
