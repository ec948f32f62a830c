"""benchmarks/bench_first_tokens.py on the CPU: its requests, arguments, medians, ratios and
summary (the run itself needs a GPU)."""

from __future__ import annotations

import pytest

from helpers import benchmarks


@pytest.fixture(scope="module")
def bench():
    return benchmarks.load("bench_first_tokens")


def test_the_requests_are_distinct_lengths_in_range_the_same_in_every_process(bench):
    lengths = bench.prompts()
    assert len(lengths) == len(set(lengths)) == 16 and all(97 <= n <= 3001 for n in lengths)
    assert bench.prompts() == lengths and bench.prompts(4) == bench.prompts(4)


def test_arguments(bench):
    assert bench.parse_args(["--quick"]).requests == 4
    assert bench.parse_args(["--peers", "fastattn,eager"]).peers == ("fastattn", "eager")
    assert bench.parse_args(["--peers", "fastattn", "eager"]).peers == ("fastattn", "eager")  # gpu_run.sh's BENCH
    assert bench.parse_args([]).peers == bench.PEERS
    for bad in (["--rounds", "0"], ["--requests", "0"], ["--child", "flash"], ["--peers", "fastattn,flash"],
                ["--peers", ","]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def _row(serving, first=(10.0, 30.0), steady=(10.0, 10.0)):
    row = {"serving_seconds": serving, "from_start_seconds": serving + 5, "import_seconds": 2.0,
           "build_seconds": 3.0, "first_ms": list(first), "steady_ms": list(steady)}
    return {**row, **benchmarks.load("bench_first_tokens").extras(row)}


def test_medians_ratios_against_the_best_pytorch_peer_and_the_summary(bench):
    runs = {"fastattn": [_row(0.5), _row(0.7), {"error": "Traceback\nRuntimeError: boom"}],
            "sdpa_mode": [_row(0.8), _row(0.8), _row(0.8)],
            "sdpa_flash": [_row(1.0), _row(1.4), _row(1.2)],
            "sdpa_cudnn": [_row(2.0)] * 3, "eager": [{"error": "x"}] * 3}
    s = bench.summarize(runs)
    assert s["best_pytorch"] == "sdpa_flash"  # the fastest peer that ran; eager failed every round
    assert s["fastattn"]["serving_seconds"] == pytest.approx(0.6) and s["fastattn"]["errors"] == 1
    assert s["fastattn_serving_ratio"] == pytest.approx(0.6 / 1.2)
    assert s["fastattn_serving_ratio_paired"] == pytest.approx(sorted([0.5 / 1.0, 0.7 / 1.4])[1] / 2
                                                               + sorted([0.5 / 1.0, 0.7 / 1.4])[0] / 2)
    assert s["eager"]["serving_seconds"] is None and s["eager"]["error"] == "x"
    res = {"summary": s, "prompts": [97, 200], "args": {"rounds": 3},
           "fastattn_cold": _row(3.0), "sdpa_mode_cold": {"error": "no GPU"}}
    text = "\n".join(bench.summary(res))
    assert "fastattn / sdpa_flash (the best PyTorch peer) serving: 0.50 (0.50); claim <= 0.6" in text
    assert "sdpa_mode_cold (its plans first built, once): serving n/a s (failed: no GPU)" in text
    assert "eager      serving n/a s" in text and "3 of 3 failed: x" in text
    assert "fastattn first / steady: 2.00; claim <= 1.3" in text  # the median of 10/10 and 30/10
    assert "a new length's first token beyond its steady time, ms (median, requests 2 on): fastattn 20.0," in text


def test_a_new_lengths_extra_time_leaves_out_the_processs_first_request(bench):
    row = {"first_ms": [300.0, 20.0, 14.0, 30.0], "steady_ms": [10.0, 10.0, 10.0, 10.0],
           "attention_first_ms": [90.0, 1.5, 1.0, 2.5], "attention_steady_ms": [0.5, 0.5, 0.5, 0.5]}
    out = bench.extras(row)
    assert out["new_length_extra_ms"] == 10.0  # median of 10, 4, 20: the 290 of the first request left out
    assert out["attention_extra_ms"] == 1.0
    assert out["first_over_steady"] == pytest.approx((2.0 + 3.0) / 2)  # median of 30, 2, 1.4, 3
    assert "attention_extra_ms" not in bench.extras({"first_ms": [1.0, 2.0], "steady_ms": [1.0, 1.0]})
