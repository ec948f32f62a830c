"""A server's first tokens (the cold-start acceptance benchmark): fresh processes, each building
a model from a config on the GPU (random weights, bf16: the load a server does) and then
serving the first token of 16 requests of distinct prompt lengths (97 ... 3001, seeded),
one after another, batch 1, no_grad, each synchronized on its token (`.item()` of the last
position's argmax); then the same 16 prompts again (the steady time of each length).

The model: a 12-layer Llama (hidden 2048, 16 query heads, 4 key-value heads, head dim 128,
vocab 32000). Peers, each a fresh process per round, interleaved (--rounds), medians:
  fastattn     attn_implementation="fastattn", the cache fastattn_cold left (no preload or
               warm-up call in the benchmark's code: what fastattn does unasked is measured)
  sdpa_mode    attn_implementation="sdpa" with fastattn.torch.enable_sdpa(), the same cache
  sdpa_flash   attn_implementation="sdpa" in sdpa_kernel(FLASH_ATTENTION)
  sdpa_cudnn   attn_implementation="sdpa" in sdpa_kernel(CUDNN_ATTENTION)
  eager        attn_implementation="eager"
fastattn_cold (an empty cache, run once first: it prepares the cache fastattn reads) and
sdpa_mode_cold (once after it: the SDPA mode's own plans) are reported apart.

Figures per process: serving seconds (model ready, i.e. built on the GPU and synchronized,
to the last first token), seconds from the process's start (its spawn) to the last first
token, the import and build seconds, and per request first_ms and steady_ms. Claims:
fastattn's serving time <= 0.6x the best PyTorch peer's (sdpa_flash,
sdpa_cudnn, eager) in the same run; a new length's first token within 1.3x of its steady
time (the median over requests of first_ms / steady_ms).

    python benchmarks/bench_first_tokens.py [--json out.json] [--rounds N] [--quick] [--peers fastattn,eager]

Prints the JSON, then a `summary:` block last. Needs a CUDA GPU (exit status 2 without).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time

from _common import emit, first_error, fresh, fresh_cache_env, header, paired_ratio, require_cuda, rotated  # (benchmarks/ on sys.path)

MODEL = dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
PEERS = ("fastattn", "sdpa_mode", "sdpa_flash", "sdpa_cudnn", "eager")
PYTORCH = ("sdpa_flash", "sdpa_cudnn", "eager")  # the peers fastattn's serving time is held against
CLAIMS = {"serving_ratio": 0.6, "first_over_steady": 1.3}


def prompts(n: int = 16, seed: int = 41) -> list[int]:
    """n distinct prompt lengths in 97 ... 3001, in the order they are served."""
    return random.Random(seed).sample(range(97, 3002), n)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of fresh processes")
    ap.add_argument("--requests", type=int, default=16, help="requests of distinct prompt lengths")
    ap.add_argument("--quick", action="store_true", help="a smoke run: --rounds 1 --requests 4")
    ap.add_argument("--peers", nargs="+", default=[",".join(PEERS)],
                    help="the peers to run, comma- or space-separated (default: all)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.requests = 1, 4
    if args.rounds < 1 or not 1 <= args.requests <= 2905:
        ap.error("--rounds must be at least 1 and --requests 1 ... 2905")
    if args.child is not None and args.child not in PEERS + ("fastattn_cold",):
        ap.error(f"--child {args.child!r}: one of {PEERS + ('fastattn_cold',)}")
    args.peers = tuple(p for item in args.peers for p in item.split(",") if p)
    if not args.peers or not set(args.peers) <= set(PEERS):
        ap.error(f"--peers {','.join(args.peers)!r}: some of {','.join(PEERS)}")
    return args


def _attn(peer: str) -> str:
    return "fastattn" if peer.startswith("fastattn") else "eager" if peer == "eager" else "sdpa"


def child(peer: str, lengths: list[int]) -> dict:
    """Runs in the fresh process: the figures of one peer."""
    t_start = time.time()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    attention_s = [0.0]  # host seconds inside the attention layers' calls (fastattn peers)
    if peer.startswith("fastattn"):
        from fastattn.integrations.transformers import attention_forward  # (registers "fastattn")
        from transformers import AttentionInterface

        registered = attention_forward

        def timed(*args, **kwargs):  # ~1 us a call, 12 calls a request: not seen in the serving time
            t = time.perf_counter()
            try:
                return registered(*args, **kwargs)
            finally:
                attention_s[0] += time.perf_counter() - t

        AttentionInterface.register("fastattn", timed)
    if peer == "sdpa_mode":
        import fastattn.torch

        fastattn.torch.enable_sdpa()
    if peer in ("sdpa_flash", "sdpa_cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa_kernel(SDPBackend.FLASH_ATTENTION if peer == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION).__enter__()
    t_import = time.time()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODEL), attn_implementation=_attn(peer),
                                                 dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randint(3, MODEL["vocab_size"], (1, n), generator=g).to("cuda") for n in lengths]
    torch.cuda.synchronize()
    t_ready = time.time()
    warm_up = None
    if peer.startswith("fastattn") or peer == "sdpa_mode":
        import fastattn

        warm_up = fastattn.stats()["warm_up"]  # what the warm-up had done by the time the model was ready
    served, in_attention = [], []
    with torch.no_grad():
        for ids in inputs:  # each request's first token, then each length again (steady)
            t_a, attention_s[0] = time.perf_counter(), 0.0
            model(ids).logits[:, -1].argmax(-1).item()  # .item(): the token on the host
            served.append((time.perf_counter() - t_a) * 1e3)
            in_attention.append(attention_s[0] * 1e3)
            if len(served) == len(inputs):
                t_last = time.time()
        for ids in inputs:
            t_a, attention_s[0] = time.perf_counter(), 0.0
            model(ids).logits[:, -1].argmax(-1).item()
            served.append((time.perf_counter() - t_a) * 1e3)
            in_attention.append(attention_s[0] * 1e3)
    n = len(inputs)
    res = {"t_start": t_start, "t_ready": t_ready, "t_last": t_last, "import_seconds": t_import - t_start,
           "build_seconds": t_ready - t_import, "serving_seconds": t_last - t_ready,
           "first_ms": [round(x, 3) for x in served[:n]], "steady_ms": [round(x, 3) for x in served[n:]]}
    if peer.startswith("fastattn") or peer == "sdpa_mode":
        import fastattn

        stats = fastattn.stats()
        res["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        res["fallbacks"] = stats["fallbacks"]
        res["sdpa"] = stats.get("sdpa")
        res["warm_up_at_ready"] = warm_up
    if peer.startswith("fastattn"):
        # Host ms inside the 12 attention calls of each request (the calls return once
        # launched): what fastattn itself adds to a new length's first token.
        res["attention_first_ms"] = [round(x, 3) for x in in_attention[:n]]
        res["attention_steady_ms"] = [round(x, 3) for x in in_attention[n:]]
    return res


def _spawned(lengths: list[int], peer: str, env: dict) -> dict:
    t_spawn = time.time()
    r = fresh(__file__, ["--child", peer, "--requests", str(len(lengths))], env)
    if "error" not in r:
        r["from_start_seconds"] = r["t_last"] - t_spawn
        r.update(extras(r))
    return r


def extras(r: dict) -> dict:
    """A process's first / steady (the median over requests of each one's ratio) and what
    a new length costs beyond its steady time, in ms: the median over the requests after
    the first (whose first token also pays the process's own first CUDA work, every peer
    alike) of first - steady, for the whole request and for its attention calls alone."""
    out = {"first_over_steady": statistics.median(a / b for a, b in zip(r["first_ms"], r["steady_ms"]) if b > 0)}
    for key, first, steady in (("new_length_extra_ms", "first_ms", "steady_ms"),
                               ("attention_extra_ms", "attention_first_ms", "attention_steady_ms")):
        if len(r.get(first) or ()) > 1:
            out[key] = statistics.median(a - b for a, b in zip(r[first][1:], r[steady][1:]))
    return out


def summarize(runs: dict) -> dict:
    """Per peer: medians over its rounds; fastattn's serving time against each PyTorch peer's
    and against the best of them (of medians, and the median of each round's own ratio)."""
    out: dict = {}
    for peer, rows in runs.items():
        ok = [r for r in rows if "error" not in r]
        out[peer] = {"rounds": len(rows), "errors": len(rows) - len(ok), "error": first_error(rows)}
        for key in ("serving_seconds", "from_start_seconds", "import_seconds", "build_seconds", "first_over_steady",
                    "new_length_extra_ms", "attention_extra_ms"):
            have = [r[key] for r in ok if r.get(key) is not None]
            out[peer][key] = statistics.median(have) if have else None
    best = min((p for p in PYTORCH if out.get(p, {}).get("serving_seconds")), default=None,
               key=lambda p: out[p]["serving_seconds"])
    out["best_pytorch"] = best
    for ours in ("fastattn", "sdpa_mode"):
        if best is None or not out.get(ours, {}).get("serving_seconds"):
            continue
        out[f"{ours}_serving_ratio"] = out[ours]["serving_seconds"] / out[best]["serving_seconds"]
        out[f"{ours}_serving_ratio_paired"] = paired_ratio([r.get("serving_seconds") for r in runs[ours]],
                                                           [r.get("serving_seconds") for r in runs[best]])
    return out


def _fmt(x, spec=".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def summary(res: dict) -> list[str]:
    s = res["summary"]
    lines = [f"  prompts {res['prompts']}; medians of {res['args']['rounds']} interleaved rounds of fresh processes"]
    for name in ("fastattn_cold", "sdpa_mode_cold"):
        cold = res[name]
        lines.append(f"  {name} (its plans first built, once): serving {_fmt(cold.get('serving_seconds'))} s"
                     + (f" (failed: {first_error([cold])})" if "error" in cold else ""))
    for peer in PEERS:
        p = s[peer]
        lines.append(f"  {peer:<10} serving {_fmt(p['serving_seconds'])} s, from start {_fmt(p['from_start_seconds'])}"
                     f" s (import {_fmt(p['import_seconds'], '.2f')}, build {_fmt(p['build_seconds'], '.2f')}); "
                     f"first / steady {_fmt(p['first_over_steady'], '.2f')}"
                     + (f"; {p['errors']} of {p['rounds']} failed: {p['error']}" if p["errors"] else ""))
    for ours in ("fastattn", "sdpa_mode"):
        if f"{ours}_serving_ratio" in s:
            lines.append(f"  {ours} / {s['best_pytorch']} (the best PyTorch peer) serving: "
                         f"{_fmt(s[f'{ours}_serving_ratio'], '.2f')} ({_fmt(s[f'{ours}_serving_ratio_paired'], '.2f')});"
                         f" claim <= {CLAIMS['serving_ratio']}")
    lines.append(f"  fastattn first / steady: {_fmt(s['fastattn']['first_over_steady'], '.2f')}; "
                 f"claim <= {CLAIMS['first_over_steady']}")
    lines.append("  a new length's first token beyond its steady time, ms (median, requests 2 on): "
                 + ", ".join(f"{peer} {_fmt(s[peer].get('new_length_extra_ms'), '.1f')}" for peer in PEERS)
                 + f"; of fastattn's, in its attention calls: {_fmt(s['fastattn'].get('attention_extra_ms'), '.2f')}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    lengths = prompts(args.requests)
    if args.child:
        print(json.dumps(child(args.child, lengths)))
        return 0
    require_cuda("bench_first_tokens.py")
    import transformers

    t0 = time.perf_counter()
    env = fresh_cache_env(tempfile.mkdtemp(prefix="fastattn-first-tokens-"))
    res = {**header(), "transformers": transformers.__version__, "model": MODEL, "prompts": lengths,
           "args": {k: v for k, v in vars(args).items() if k != "child"},
           "fastattn_cold": _spawned(lengths, "fastattn_cold", env),
           "sdpa_mode_cold": _spawned(lengths, "sdpa_mode", env) if "sdpa_mode" in args.peers
           else {"error": "not run (--peers)"}}
    runs: dict = {peer: [] for peer in PEERS}
    for order in rotated(args.peers, args.rounds):
        for peer in order:
            runs[peer].append(_spawned(lengths, peer, env))
    res["runs"] = runs
    res["summary"] = summarize(runs)
    res["seconds"] = time.perf_counter() - t0
    emit(res, args.json, summary(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
