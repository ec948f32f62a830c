"""benchmarks/bench_serving.py on the CPU: its requests, arguments, medians, ratios and summary,
and one child's measurement with a tiny model on "paged|eager" (the GPU run itself is the
benchmark)."""

from __future__ import annotations

import pytest

from helpers import benchmarks

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
pytest.importorskip("transformers", reason="transformers is an optional extra")


@pytest.fixture(scope="module")
def bench():
    return benchmarks.load("bench_serving")


def test_the_requests_are_seeded_lengths_in_range(bench):
    lengths = bench.requests(256)
    assert len(lengths) == 256 and all(16 <= n <= 1500 for n in lengths) and len(set(lengths)) > 100
    assert bench.requests(256) == lengths and bench.requests(32) == lengths[:32]


def test_arguments(bench):
    args = bench.parse_args([])
    assert args.requests == [32, 256] and args.models == ["llama", "qwen2"] and args.rounds == 3
    assert not args.cuda_graphs and bench.parse_args(["--cuda-graphs"]).cuda_graphs
    quick = bench.parse_args(["--quick"])
    assert (quick.rounds, quick.requests, quick.new_tokens) == (1, [8], 8)
    assert args.peers == list(bench.PEERS) and "gpt_oss" in bench.MODELS  # gpt_oss only when named
    assert bench.parse_args(["--peers", "fastattn,eager", "--models", "gpt_oss"]).peers == ["fastattn", "eager"]
    for bad in (["--rounds", "0"], ["--requests", "0"], ["--requests", "a,b"], ["--models", "gpt2"],
                ["--new-tokens", "0"], ["--child", "flash"], ["--peers", "eager"], ["--peers", "fastattn,flash"],
                ["--peers", ""]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_medians_the_best_pytorch_path_and_the_summary(bench):
    def row(tps, ttft=50.0):
        return {"tokens_per_s": tps, "ttft_ms_median": ttft, "ttft_ms_p90": 2 * ttft, "seconds": 1.0}

    runs = {"fastattn": [{**row(1300.0), "use_cuda_graph": [True, True]}, row(1500.0),
                         {"error": "Traceback\nRuntimeError: boom"}],
            "sdpa": [row(500.0)] * 3, "eager": [row(1000.0), row(1100.0), row(1200.0)]}
    s = bench.summarize(runs)
    assert s["best_pytorch"] == "eager" and s["fastattn"]["tokens_per_s"] == pytest.approx(1400.0)
    assert s["speedup"] == pytest.approx(1400.0 / 1100.0) and s["fastattn"]["errors"] == 1
    assert s["speedup_paired"] == pytest.approx((1300 / 1000 + 1500 / 1100) / 2)
    s.update(peers=["fastattn", "sdpa", "eager"], fallback_calls=0)
    text = "\n".join(bench.summary({"args": {"rounds": 3, "new_tokens": 48}, "cases": {"llama, 32 requests": s}}))
    assert "fastattn / eager (the best PyTorch paged path): 1.27 (1.33); claim >= 1.3; fallback calls 0" in text
    assert "1 of 3 failed: RuntimeError: boom" in text and "sdpa              500.0 tokens/s" in text
    assert "CUDA graphs (varlen, decode) [True, True]" in text


def test_a_child_measures_a_paged_path(bench, monkeypatch):
    # transformers sizes its paged cache from the GPU's free memory, which reads 0 on the CPU.
    from transformers.generation.continuous_batching import cache as cb_cache

    monkeypatch.setattr(cb_cache.PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 30)
    tiny = dict(bench.MODELS["qwen2"], hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=97, sliding_window=8)
    monkeypatch.setattr(bench, "LENGTHS", (3, 40))
    r = bench.child("eager", "qwen2", 5, 3, device="cpu", model=tiny)
    assert r["finished"] == 5 and r["tokens"] == 15 and r["tokens_per_s"] > 0
    assert r["attn_implementation"] == "paged|eager" and 0 < r["ttft_ms_median"] <= r["ttft_ms_p90"]
    assert r["use_cuda_graph"] == [False, False]  # transformers' choice as made: no CUDA graphs without a GPU


def test_a_child_whose_requests_did_not_all_finish_fails_and_names_the_error(bench, monkeypatch, capsys):
    # paged|eager with CUDA graphs returned 4 of 32 requests on the H200; a tokens/s over the
    # 4 would have been reported as that path's figure.
    from transformers.generation.continuous_batching import ContinuousMixin
    from transformers.generation.continuous_batching.requests import GenerationOutput

    def partial(self, prompts, warmup=False, **kw):
        out = {"r0": GenerationOutput("r0", generated_tokens=[5, 6, 7], timestamps=[0.0])}
        if not warmup:
            out["r1"] = GenerationOutput("r1", error="CUDA out of memory")
        return out

    monkeypatch.setattr(ContinuousMixin, "generate_batch", partial)
    tiny = dict(bench.MODELS["llama"], hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=97)
    monkeypatch.setattr(bench, "LENGTHS", (3, 40))
    with pytest.raises(SystemExit) as e:
        bench.child("eager", "llama", 3, 3, device="cpu", model=tiny)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "2 of 3 requests did not finish (2 results came back)" in err and "CUDA out of memory" in err


def test_each_process_is_said_and_written_as_it_ends(bench, monkeypatch, tmp_path, capsys):
    # A run cut short keeps what it measured: after each fresh process, its line on stdout
    # and the JSON with every run so far (the processes stood in; the GPU run is the benchmark).
    import json

    out = tmp_path / "serving.json"
    seen = []

    def spawned(peer, kind, n, new_tokens, env, cuda_graphs=False):
        if seen:  # the JSON already holds every process before this one
            res = json.loads(out.read_text())
            rows = sum(len(r) for case in res["runs"].values() for r in case.values())
            assert "fastattn_cold" in res["cases"]["llama, 8 requests"] and rows == len(seen) - 1
        seen.append(peer)
        if peer == "eager":
            return {"error": "Traceback (most recent call last):\nRuntimeError: CUDA out of memory"}
        return {"tokens_per_s": 100.0 + len(seen), "ttft_ms_median": 5.0, "ttft_ms_p90": 9.0, "seconds": 1.0,
                "process_seconds": 3.0}

    monkeypatch.setattr(bench, "_spawned", spawned)
    monkeypatch.setattr(bench, "require_cuda", lambda script: None)
    monkeypatch.setattr(bench, "header", lambda: {"date": "today"})
    assert bench.main(["--requests", "8", "--rounds", "2", "--models", "llama", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "llama, 8 requests: fastattn_cold 101.0 tokens/s (3.0 s)" in text
    assert "llama, 8 requests: eager failed: RuntimeError: CUDA out of memory (n/a s)" in text
    assert len(seen) == 1 + 2 * len(bench.PEERS if bench.importlib.util.find_spec("flash_attn") else
                                    [p for p in bench.PEERS if p != "flash_attention_2"])
    res = json.loads(out.read_text())
    case = res["cases"]["llama, 8 requests"]
    assert case["fastattn_cold"]["tokens_per_s"] == 101.0 and case["eager"]["errors"] == 2
    assert [len(rows) for rows in res["runs"]["llama, 8 requests"].values()] == [2] * len(case["peers"])


def test_a_model_runs_only_the_peers_transformers_loads_it_with(bench, monkeypatch, tmp_path):
    # gpt-oss has no sdpa path in transformers: its case leaves paged|sdpa out rather than
    # counting a refusal to load as a failed measurement; --peers leaves out what it is not given.
    seen = []

    def spawned(peer, kind, n, new_tokens, env, cuda_graphs=False):
        seen.append((kind, peer))
        return {"tokens_per_s": 100.0, "ttft_ms_median": 5.0, "ttft_ms_p90": 9.0, "seconds": 1.0}

    monkeypatch.setattr(bench, "_spawned", spawned)
    monkeypatch.setattr(bench, "require_cuda", lambda script: None)
    monkeypatch.setattr(bench, "header", lambda: {"date": "today"})
    assert bench.main(["--requests", "4", "--rounds", "1", "--models", "llama,gpt_oss", "--peers",
                       "fastattn,sdpa,eager", "--json", str(tmp_path / "s.json")]) == 0
    assert seen == [("llama", "fastattn_cold"), ("llama", "fastattn"), ("llama", "sdpa"), ("llama", "eager"),
                    ("gpt_oss", "fastattn_cold"), ("gpt_oss", "fastattn"), ("gpt_oss", "eager")]


@pytest.mark.parametrize("graphs", [False, True])
def test_a_child_measures_the_gpt_oss_like_model(bench, monkeypatch, graphs):
    # Sinks and experts on paged|eager, at a tiny size; with --cuda-graphs its experts on
    # batched_mm (grouped_mm's torch.histc cannot be captured, as seen on the H200).
    from transformers.generation.continuous_batching import cache as cb_cache

    monkeypatch.setattr(cb_cache.PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 30)
    tiny = dict(bench.MODELS["gpt_oss"], hidden_size=64, intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=97, sliding_window=8)
    monkeypatch.setattr(bench, "LENGTHS", (3, 40))
    r = bench.child("eager", "gpt_oss", 4, 3, device="cpu", model=tiny, cuda_graphs=graphs)
    assert r["finished"] == 4 and r["tokens"] == 12 and r["attn_implementation"] == "paged|eager"
    assert r["experts_implementation"] == ("batched_mm" if graphs else "grouped_mm")
