"""benchmarks/bench_bounded_tables.py on the CPU: its distinct shapes and the ratios its
summary reports (the run itself needs a GPU: tests/pytorch/test_torch_bounded_gpu.py's
checks are the ones asserted)."""

from helpers import benchmarks


def test_the_shapes_are_distinct_pairs_from_the_smallest_length_up():
    bench = benchmarks.load("bench_bounded_tables")
    for n, smallest in ((100_000, 1), (10, 8), (1, 1), (17, 16)):
        pairs = bench.shapes(n, smallest)
        assert len(pairs) == len(set(pairs)) == n
        assert min(min(p) for p in pairs) == smallest
    assert max(max(p) for p in bench.shapes(100_000, 1)) == 317  # (317 lengths: 100,489 pairs)
    assert bench.shapes(0, 1) == []


def test_the_summary_ratios():
    bench = benchmarks.load("bench_bounded_tables")
    samples = [{"shapes": s, "rss_mb": mb} for s, mb in ((0, 100.0), (1000, 150.0), (4000, 190.0), (5000, 200.0),
                                                         (10_000, 201.0), (20_000, 202.0))]
    got = bench.summarize(samples, 4096, 5.0, 5.5)
    assert got["rss_end_over_at_cap"] == 202.0 / 200.0  # (the first sample past 4096 shapes)
    assert abs(got["rss_mb_per_10k_shapes_second_half"] - 1.0) < 1e-9  # (10k .. 20k shapes: +1 MB)
    assert abs(got["hot_end_over_start"] - 1.1) < 1e-9
    assert bench.summarize(samples[:2], 4096, 0.0, 1.0) == {
        "hot_end_over_start": None, "rss_end_over_at_cap": None, "rss_mb_per_10k_shapes_second_half": None}
    assert bench.rss_mb() > 0
