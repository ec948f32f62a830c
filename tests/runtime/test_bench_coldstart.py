"""benchmarks/bench_coldstart.py on the CPU: its first-outputs summary (the run itself
needs a GPU; its chart, --plot, does not ask for one)."""

from __future__ import annotations

from helpers import benchmarks


def test_the_first_outputs_summary_gives_the_ratio_and_every_rounds_calls():
    bench = benchmarks.load("bench_coldstart")
    fo = {"fastattn_torch_warm": [{"fwd_ms": [40.0, 2.0]}, {"error": "Traceback\nRuntimeError: boom"}],
          "torch_flash": [{"fwd_ms": [100.0, 60.0]}, {"fwd_ms": [110.0, 58.0]}],
          "fastattn_torch_warm_ms": 110.0, "torch_flash_ms": 500.0}
    text = bench.first_outputs_summary(fo)
    assert "median of 2 rounds: fastattn.torch (warm cache, no preload call) 110.0 ms, SDPA flash 500.0 ms" in text
    assert "fastattn.torch / SDPA flash: 0.22 (target: <= 1.5)" in text
    assert "fastattn_torch_warm: fwd ms per shape [40.0, 2.0]" in text and "failed: Traceback\nRuntimeError: boom" in text
    assert "fastattn.torch / SDPA flash:" not in bench.first_outputs_summary({"torch_flash": [], "torch_flash_ms": None})


def test_the_chart_is_not_refused_for_want_of_a_gpu(tmp_path):
    r = benchmarks.run("bench_coldstart", "--plot", str(tmp_path / "none.json"), cuda=False)
    assert "needs a CUDA GPU" not in r.stderr  # (it fails on the missing file, not on the machine)
