"""benchmarks/probe_masked_rows.py on the CPU: its float64 reference is PyTorch's answer for
rows that keep no key (zeros) and for the others, and its description of a tensor says zeros,
not finite or the largest magnitude (the GPU run is the probe)."""

from __future__ import annotations

import pytest

from helpers import benchmarks

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")


@pytest.fixture(scope="module")
def probe():
    return benchmarks.load("probe_masked_rows")


def test_the_reference_is_pytorchs_answer_in_float64(probe):
    import torch.nn.functional as F

    torch.manual_seed(3)
    q, k, v, bias = probe.inputs(torch, "cpu")
    assert bool(torch.isinf(bias[:, :, list(probe.EMPTY_ROWS)]).all())
    assert bool(torch.isfinite(bias[:, :, [2, 3, 100]]).all())
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double())
    got = probe.reference(torch, q, k, v, bias)
    assert bool((got[:, :, list(probe.EMPTY_ROWS)] == 0).all())
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_a_tensor_is_described_as_zeros_not_finite_or_its_largest_magnitude(probe):
    assert probe.describe(torch, torch.zeros(3)) == "zeros"
    assert probe.describe(torch, torch.tensor([0.0, float("nan"), float("-inf")])) == "not finite (2 of 3)"
    assert probe.describe(torch, torch.tensor([0.5, -2.0])) == "largest |x| 2"


def test_as_a_command_it_describes_itself_and_refuses_a_machine_without_cuda():
    r = benchmarks.run("probe_masked_rows", "--help")
    assert r.returncode == 0 and "keeps no key" in r.stdout
    r = benchmarks.run("probe_masked_rows", cuda=False)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


class _StandIn:
    """torch with a plain-softmax stand-in for the cuDNN operator (NaN on a row of -inf, as an
    unguarded kernel gives) and no device to synchronize: the probe's steps on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    class cuda:  # noqa: N801  (torch.cuda's place)
        @staticmethod
        def synchronize(device=None):
            pass

    class ops:  # noqa: N801
        class aten:  # noqa: N801
            @staticmethod
            def _scaled_dot_product_cudnn_attention(q, k, v, bias, lse, dropout_p, is_causal, debug):
                scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5 + bias.float()
                out = (scores.softmax(-1) @ v.float()).to(q.dtype)
                return out, scores.logsumexp(-1)


def test_its_steps_and_summary_on_a_stand_in_kernel(probe):
    torch.manual_seed(4)
    rows = [probe.one(_StandIn(), lse, "cpu") for lse in (False, True)]
    for r in rows:
        assert "failed" not in r and r["empty_rows_out"].startswith("not finite"), r
        assert r["other_rows_error"] < 1e-2, r
    assert rows[1]["empty_rows_lse"] == ["-inf"] and rows[1]["grads_finite"] is False
    assert "empty_rows_lse" not in rows[0] and "grads_finite" not in rows[0]
    text = "\n".join(probe.summary({"pytorch": rows, "fastattn": [{"lse": False, "failed": "RuntimeError: x"}]}))
    assert "pytorch   lse=True  empty rows not finite" in text and "backward: NOT finite" in text
    assert "fastattn  lse=False RuntimeError: x" in text
