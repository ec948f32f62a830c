"""transformers' continuous batching on each paged attention path (the serving benchmark):
`model.generate_batch(...)`, the engine behind `transformers serve` (a paged KV cache, requests
of mixed lengths scheduled together), tokens/s and time to first token.

Models (random weights, bf16, built from configs on the GPU), each 4 layers, hidden 1024, 16
query heads, 4 key-value heads, head dim 64, vocab 32000:
  llama    a Llama-like GQA model
  qwen2    a Qwen2-like one with sliding windows (512) on every other layer
  gpt_oss  (only when named) a gpt-oss-like one: sinks, sliding windows (128) on every other
           layer, the top 2 of 4 experts of 1408 (the active MLP of the Llama-like one); no
           sdpa path (transformers has none for it), and with --cuda-graphs its experts on
           transformers' batched_mm kernel for every peer (the default, grouped_mm, cannot be
           captured: a host copy in torch.histc)
Requests: --requests (default 32 and 256) prompts of seeded lengths in 16 ... 1500, --new-tokens
(48) greedy tokens each, all submitted at once. Peers, a fresh process each per round,
interleaved (--rounds), medians:
  fastattn           attn_implementation="fastattn" ("paged|fastattn" in continuous batching),
                     the cache a first fastattn process (fastattn_cold, reported apart) left
  sdpa               "paged|sdpa"
  eager              "paged|eager"
  flash_attention_2  "paged|flash_attention_2", where flash_attn is installed
(--peers leaves some out; fastattn is always measured.)
In each process: the model built, then one generate_batch of 4 short requests with transformers'
warm-up (its CUDA-graph captures; a server pays them at start), then the measured generate_batch
(persistent manager, no second warm-up; record_timestamps for each request's first token).
Figures: generated tokens/s over the measured call, the median and p90 of time to first token
(from the call's start), the wall seconds; fastattn's fallback calls. Claim: fastattn's
tokens/s >= 1.3x the best PyTorch paged path's in the same run.

    python benchmarks/bench_serving.py [--json out.json] [--rounds N] [--requests 32,256] [--quick] [--cuda-graphs]
                                       [--models llama,qwen2,gpt_oss] [--peers fastattn,eager,...]

Prints the JSON, then a `summary:` block last. Needs a CUDA GPU (exit status 2 without).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time

from _common import (emit, first_error, fresh, fresh_cache_env, header, paired_ratio,  # (benchmarks/ on sys.path)
                     require_cuda, rotated, write_json)

COMMON = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)
MODELS = {
    "llama": dict(model_type="llama", **COMMON),
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=512, max_window_layers=0,
                  layer_types=["sliding_attention", "full_attention"] * 2,
                  **{k: v for k, v in COMMON.items() if k != "head_dim"}),
    "gpt_oss": dict(model_type="gpt_oss", sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2,
                    num_local_experts=4, num_experts_per_tok=2, **{**COMMON, "intermediate_size": 1408}),
}
DEFAULT_MODELS = ("llama", "qwen2")
PEERS = ("fastattn", "sdpa", "eager", "flash_attention_2")
UNSUPPORTED = {"gpt_oss": {"sdpa"}}  # peers transformers refuses to load a model with (it says so)
PYTORCH = ("sdpa", "eager", "flash_attention_2")  # the paths fastattn's tokens/s is held against
CLAIM = 1.3
LENGTHS = (16, 1500)


def requests(n: int, seed: int = 40) -> list[int]:
    """The prompt lengths of n requests, seeded: the same in every process."""
    rng = random.Random(seed)
    return [rng.randint(*LENGTHS) for _ in range(n)]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of fresh processes")
    ap.add_argument("--requests", default="32,256", help="request counts, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"some of {', '.join(MODELS)}")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="the paths measured, comma-separated (fastattn among them; flash_attention_2 only where "
                         "flash_attn is installed)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: --rounds 1 --requests 8 --new-tokens 8")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="every peer with ContinuousBatchingConfig(use_cuda_graph=True) (transformers turns CUDA "
                         "graphs on by default only for names with \"flash\" in them)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # the CPU tests run a child on the CPU
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.new_tokens = 1, "8", 8
    try:
        args.requests = [int(x) for x in args.requests.split(",") if x]
    except ValueError:
        ap.error(f"--requests {args.requests!r}: comma-separated integers")
    args.models = [m for m in args.models.split(",") if m]
    if args.rounds < 1 or not args.requests or any(not 1 <= n <= 4096 for n in args.requests):
        ap.error("--rounds must be at least 1 and each --requests count 1 ... 4096")
    if not 1 <= args.new_tokens <= 1024:
        ap.error("--new-tokens must be 1 ... 1024")
    if not args.models or set(args.models) - set(MODELS):
        ap.error(f"--models: some of {', '.join(MODELS)}")
    args.peers = [p for p in args.peers.split(",") if p]
    if set(args.peers) - set(PEERS) or "fastattn" not in args.peers:
        ap.error(f"--peers {','.join(args.peers)!r}: fastattn and any of {', '.join(PEERS[1:])}")
    if args.child is not None and args.child not in PEERS + ("fastattn_cold",):
        ap.error(f"--child {args.child!r}: one of {PEERS + ('fastattn_cold',)}")
    return args


def attn_implementation(peer: str) -> str:
    return "fastattn" if peer.startswith("fastattn") else f"paged|{peer}"


def child(peer: str, kind: str, n: int, new_tokens: int, device: str = "cuda", model: dict | None = None,
          cuda_graphs: bool = False) -> dict:
    """Runs in the fresh process: one peer's figures on one model and request count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    if peer.startswith("fastattn"):
        import fastattn.integrations.transformers  # noqa: F401  (registers "fastattn" and "paged|fastattn")
    torch.manual_seed(0)
    config = AutoConfig.for_model(**(model or MODELS[kind]))
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation(peer),
                                              dtype=torch.bfloat16 if device == "cuda" else torch.float32).eval()
    if cuda_graphs and config.model_type == "gpt_oss":
        lm.set_experts_implementation("batched_mm")  # capturable; grouped_mm's torch.histc copies from the host
    rng = random.Random(1)
    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(length)] for length in requests(n)]
    # eos -1: every request generates new_tokens (random weights would stop at random places).
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(use_cuda_graph=True) if cuda_graphs else ContinuousBatchingConfig()
    lm.generate_batch(prompts[:4], generation_config=gen, continuous_batching_config=cb, persistent_manager=True,
                      warmup=True)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = lm.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, persistent_manager=True,
                            warmup=False, record_timestamps=True)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    done = [o for o in out.values() if not o.error]
    if len(done) < n:
        # A run that lost requests is no measurement: its tokens/s would count only the
        # requests that finished (paged|eager with CUDA graphs returned 4 of 32 so).
        errors = [str(o.error) for o in out.values() if o.error]
        print(f"{n - len(done)} of {n} requests did not finish ({len(out)} results came back); the first "
              f"request's error: {errors[0] if errors else '(none: missing from the results)'}", file=sys.stderr)
        sys.exit(1)
    ttft = sorted((o.timestamps[0] - t0) * 1e3 for o in done if o.timestamps)
    res = {"seconds": seconds, "requests": n, "finished": len(done), "tokens": sum(len(o.generated_tokens) for o in done),
           "ttft_ms_median": statistics.median(ttft) if ttft else None,
           "ttft_ms_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else None,
           "attn_implementation": lm.config._attn_implementation,
           "experts_implementation": lm.config._experts_implementation if config.model_type == "gpt_oss" else None,
           "use_cuda_graph": _cuda_graphs_used(lm)}
    res["tokens_per_s"] = res["tokens"] / seconds
    if peer.startswith("fastattn"):
        import fastattn

        res["fallbacks"] = fastattn.stats()["fallbacks"]
    return res


def _cuda_graphs_used(lm) -> list | None:
    """Whether transformers' manager used CUDA graphs for its (varlen, decode) paths, as it
    resolved its configuration (a copy of the one passed)."""
    manager = getattr(lm, "_cached_continuous_batching_manager", None)
    used = getattr(getattr(manager, "continuous_batching_config", None), "use_cuda_graph", None)
    return list(used) if isinstance(used, (tuple, list)) else used


def _spawned(peer: str, kind: str, n: int, new_tokens: int, env: dict, cuda_graphs: bool = False) -> dict:
    return fresh(__file__, ["--child", peer, "--models", kind, "--requests", str(n), "--new-tokens", str(new_tokens)]
                 + (["--cuda-graphs"] if cuda_graphs else []), env)


def summarize(runs: dict) -> dict:
    """Per peer: medians over its rounds; fastattn's tokens/s over each PyTorch path's and
    over the best of them (of medians, and the median of each round's own ratio)."""
    out: dict = {}
    for peer, rows in runs.items():
        ok = [r for r in rows if "error" not in r]
        out[peer] = {"rounds": len(rows), "errors": len(rows) - len(ok), "error": first_error(rows)}
        for key in ("tokens_per_s", "ttft_ms_median", "ttft_ms_p90", "seconds"):
            values = [r[key] for r in ok if r.get(key) is not None]
            out[peer][key] = statistics.median(values) if values else None
        out[peer]["use_cuda_graph"] = ok[0].get("use_cuda_graph") if ok else None
    best = max((p for p in PYTORCH if (out.get(p) or {}).get("tokens_per_s")), default=None,
               key=lambda p: out[p]["tokens_per_s"])
    out["best_pytorch"] = best
    if best is not None and (out.get("fastattn") or {}).get("tokens_per_s"):
        out["speedup"] = out["fastattn"]["tokens_per_s"] / out[best]["tokens_per_s"]
        out["speedup_paired"] = paired_ratio([r.get("tokens_per_s") for r in runs["fastattn"]],
                                             [r.get("tokens_per_s") for r in runs[best]])
    return out


def _progress(res: dict, json_path: str | None, case: str, peer: str, row: dict) -> None:
    """One process's result, said as it comes, and res (the runs so far) written: a run cut
    short (a device call's time limit) keeps what it measured (a 256-request run without
    CUDA graphs once outlasted its session's device time with nothing written)."""
    if row.get("tokens_per_s") is not None:
        said = f"{row['tokens_per_s']:.1f} tokens/s"
    else:
        lines = str(row.get("error") or "?").strip().splitlines() or ["?"]
        said = f"failed: {lines[-1]}"
    print(f"{case}: {peer} {said} ({_fmt(row.get('process_seconds'))} s)", flush=True)
    write_json(res, json_path)


def _fmt(x, spec=".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def summary(res: dict) -> list[str]:
    lines = [f"  medians of {res['args']['rounds']} interleaved rounds of fresh processes; "
             f"{res['args']['new_tokens']} new tokens a request"]
    for case, s in res["cases"].items():
        lines.append(f"  {case}:")
        for peer in s["peers"]:
            p = s[peer]
            lines.append(f"    {peer:<17} {_fmt(p['tokens_per_s'])} tokens/s, TTFT median {_fmt(p['ttft_ms_median'])} ms"
                         f" p90 {_fmt(p['ttft_ms_p90'])} ms"
                         + (f", CUDA graphs (varlen, decode) {p['use_cuda_graph']}" if p.get("use_cuda_graph") else "")
                         + (f"; {p['errors']} of {p['rounds']} failed: {p['error']}" if p["errors"] else ""))
        if "speedup" in s:
            lines.append(f"    fastattn / {s['best_pytorch']} (the best PyTorch paged path): {_fmt(s['speedup'], '.2f')}"
                         f" ({_fmt(s['speedup_paired'], '.2f')}); claim >= {CLAIM}; fallback calls "
                         f"{s.get('fallback_calls', 0)}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.models[0], args.requests[0], args.new_tokens, args.device,
                               cuda_graphs=args.cuda_graphs)))
        return 0
    require_cuda("bench_serving.py")
    import transformers

    t0 = time.perf_counter()
    env = fresh_cache_env(tempfile.mkdtemp(prefix="fastattn-serving-"))
    peers = [p for p in args.peers if p != "flash_attention_2" or importlib.util.find_spec("flash_attn") is not None]
    res = {**header(), "transformers": transformers.__version__, "models": {m: MODELS[m] for m in args.models},
           "args": {k: v for k, v in vars(args).items() if k not in ("child", "device")}, "peers": peers, "cases": {},
           "runs": {}}
    for kind in args.models:
        for n in args.requests:
            case = f"{kind}, {n} requests"
            case_peers = [p for p in peers if p not in UNSUPPORTED.get(kind, ())]
            cold = _spawned("fastattn_cold", kind, n, args.new_tokens, env, args.cuda_graphs)
            res["cases"][case] = {"fastattn_cold": cold}  # the case's summary replaces it below
            _progress(res, args.json, case, "fastattn_cold", cold)
            runs: dict = {peer: [] for peer in case_peers}
            res["runs"][case] = runs
            for order in rotated(case_peers, args.rounds):
                for peer in order:
                    runs[peer].append(_spawned(peer, kind, n, args.new_tokens, env, args.cuda_graphs))
                    _progress(res, args.json, case, peer, runs[peer][-1])
            s = summarize(runs)
            s["peers"] = case_peers
            s["fastattn_cold"] = cold
            s["fallback_calls"] = sum(sum(r.get("fallbacks", {}).get("transformers", {}).values())
                                      for r in runs["fastattn"] if "error" not in r)
            res["cases"][case] = s
    res["seconds"] = time.perf_counter() - t0
    emit(res, args.json, summary(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
