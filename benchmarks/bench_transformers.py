"""transformers models on fastattn (attn_implementation="fastattn") against the same models
on PyTorch's SDPA (attn_implementation="sdpa") with its cuDNN and its flash backend.
Tiny random-weight models built from configs (no downloads), bf16, on one GPU.

(a) Time to first logits in a fresh process: a small Llama (4 layers, hidden 1024, 16
    query heads, 4 key-value heads, head dim 64, vocab 4096), no_grad forwards of
    prompts of 256 and then 1024 tokens (batch 1), each synchronized with its last
    position's argmax (the first token a server would send). The figure is from just
    before the first forward (model built and on the GPU, inputs ready) until the last
    prompt's logits; the imports (torch, transformers, fastattn's integration) and the
    model's build are timed apart and reported, not in the figure. Peers, each in a
    fresh process of its own:
      fastattn_cold   attn_implementation="fastattn", an empty fastattn cache (run once,
                      first: it prepares the cache the next row reads; reported)
      fastattn_warm   the same, the cache fastattn_cold left (plans loaded, not built)
      sdpa_cudnn      attn_implementation="sdpa", sdpa_kernel(CUDNN_ATTENTION)
      sdpa_flash      attn_implementation="sdpa", sdpa_kernel(FLASH_ATTENTION)
    Interleaved: each round runs every peer but fastattn_cold once, in a rotated order
    (--rounds); medians, and the median of each round's own ratio. Claim checked:
    fastattn_warm sooner than sdpa_cudnn, and no later than sdpa_flash.
(b) Steady prefill and decode on a 4-layer Qwen2 (the same sizes, full attention), one
    process, the same weights for every peer: prefill ms (a no_grad forward of 4 prompts of
    256 tokens, CUDA events over back-to-back forwards) and decode ms per token (greedy
    generate of N tokens minus generate of 1, over N - 1, exactly N tokens each: EOS
    suppressed until then), after a warm-up generate that makes every plan the timed
    calls need. Peers: fastattn, sdpa_cudnn, sdpa_flash, and sdpa_mode (attn_implementation
    ="sdpa" with fastattn.torch.enable_sdpa(), the cuDNN backend selected); interleaved
    rounds (--steady-rounds) in a rotated order, medians; and the SDPA calls the mode served
    and passed on (with reasons) over sdpa_mode's calls. Baseline (H200, BASELINE below):
    prefill 3.41 ms against sdpa's 4.07, decode 4.15 ms per token against 4.79.

(c) A left-padded batch's greedy generate: 8 prompts of 16-512 tokens, padded at
    the left (transformers' default for batched generate), N new tokens each (--padded-new-
    tokens, default 128), on a 4-layer Llama (GQA) and the same Qwen2: tokens per second
    (batch x N over the generate's wall time, synchronized), fastattn against sdpa
    (PyTorch's own backend choice: the bool mask rules out its flash backend) and sdpa_mode
    ("sdpa" with fastattn.torch.enable_sdpa(), no backend chosen: the mode's masked calls
    against the mode off), same weights, interleaved rounds (--padded-rounds), medians; the
    attention calls fastattn's integration ran on its PyTorch fallback
    (fastattn.stats()["fallbacks"]), by reason, and the SDPA calls the mode served and passed
    on. Target: tokens/s >= sdpa's, 0 fallback calls.

A peer PyTorch cannot run (e.g. its cuDNN backend refusing a call: "No available kernel")
is reported as an error, and the others still run. fastattn's path (native op library or
Python) is recorded; children find the op library where this process would
(FASTATTN_TORCH_OPS_DIR, else the default cache's torch-ops/).

    python benchmarks/bench_transformers.py [--json out.json] [--quick] [--rounds N] [--steady-rounds N]
        [--padded-rounds N] [--padded-new-tokens N] [--skip-coldstart] [--skip-steady] [--skip-padded]

Prints the JSON, then a `summary:` block last. Needs a CUDA GPU (exit status 2 without).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time

from _common import calls_since, emit, first_error, fresh, fresh_cache_env, gpu_ms, header, paired_ratio, require_cuda, rotated  # (benchmarks/ on sys.path)

SIZES = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=False)
MODELS = {"llama": dict(model_type="llama"), "qwen2": dict(model_type="qwen2", use_sliding_window=False)}
COLD_PEERS = ("fastattn_warm", "sdpa_cudnn", "sdpa_flash")  # interleaved; fastattn_cold runs once, first
STEADY_PEERS = ("fastattn", "sdpa_cudnn", "sdpa_flash", "sdpa_mode")
BASELINE = {"prefill_ms": (3.41, 4.07), "decode_ms_per_token": (4.15, 4.79)}  # (fastattn, sdpa) ms on the H200, the SDPA mode's target


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: --rounds 1 --steady-rounds 2 --new-tokens 8")
    ap.add_argument("--rounds", type=int, default=3, help="(a) interleaved rounds of fresh processes")
    ap.add_argument("--steady-rounds", type=int, default=5, help="(b) interleaved rounds")
    ap.add_argument("--prompts", default="256,1024", help="(a) prompt lengths, in order, batch 1")
    ap.add_argument("--batch", type=int, default=4, help="(b) prompts per batch")
    ap.add_argument("--prompt", type=int, default=256, help="(b) prompt length")
    ap.add_argument("--new-tokens", type=int, default=32, help="(b) tokens per timed generate")
    ap.add_argument("--kv-heads", type=int, default=SIZES["num_key_value_heads"],
                    help="key-value heads of both models (16: no GQA)")
    ap.add_argument("--padded-rounds", type=int, default=3, help="(c) interleaved rounds")
    ap.add_argument("--padded-new-tokens", type=int, default=128, help="(c) tokens each prompt generates")
    ap.add_argument("--skip-coldstart", action="store_true", help="leave (a) out")
    ap.add_argument("--skip-steady", action="store_true", help="leave (b) out")
    ap.add_argument("--skip-padded", action="store_true", help="leave (c) out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steady_rounds, args.new_tokens, args.padded_rounds, args.padded_new_tokens = 1, 2, 8, 1, 8
    try:
        args.prompts = [int(p) for p in args.prompts.split(",")]
    except ValueError:
        ap.error(f"--prompts {args.prompts!r}: comma-separated token counts, e.g. 256,1024")
    for name in ("rounds", "steady_rounds", "batch", "prompt", "kv_heads", "padded_rounds", "padded_new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (decode per token is generate(N) - generate(1))")
    if min(args.prompts) < 1 or max(args.prompts) + args.new_tokens > SIZES["max_position_embeddings"]:
        ap.error(f"prompt lengths must be 1 ... {SIZES['max_position_embeddings'] - args.new_tokens}")
    if SIZES["num_attention_heads"] % args.kv_heads:
        ap.error(f"--kv-heads {args.kv_heads}: must divide {SIZES['num_attention_heads']} query heads")
    return args


def config(kind: str, kv_heads: int):
    from transformers import AutoConfig

    return AutoConfig.for_model(**{**SIZES, "num_key_value_heads": kv_heads, **MODELS[kind]})


def build(kind: str, attn: str, kv_heads: int):
    """The model, random weights (seeded: every peer's are the same), bf16, on the GPU, eval."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config(kind, kv_heads), attn_implementation=attn,
                                            dtype=torch.bfloat16).to("cuda").eval()


def selection(peer: str):
    """The context a peer's calls run in: PyTorch's SDPA backend, and the SDPA mode for
    sdpa_mode (fastattn's integration needs none)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if peer.startswith("fastattn"):
        return contextlib.nullcontext()
    backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION if peer == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION)
    if peer != "sdpa_mode":
        return backend
    stack = mode_on()
    stack.enter_context(backend)
    return stack


def mode_on() -> contextlib.ExitStack:
    """fastattn.torch.enable_sdpa() until the context's end."""
    import fastattn.torch as fat

    stack = contextlib.ExitStack()
    fat.enable_sdpa()
    stack.callback(fat.disable_sdpa)
    return stack


def _path() -> str:
    from fastattn.torch import _native

    return _native.status()["path"]


# -- (a) time to first logits, fresh processes -------------------------------------------------

def child(variant: str, prompts: list[int], kv_heads: int) -> dict:
    """Runs in the fresh process."""
    t_start = time.perf_counter()
    import torch
    import transformers  # noqa: F401

    if variant.startswith("fastattn"):
        import fastattn.integrations.transformers  # noqa: F401  (registers "fastattn")
    t_import = time.perf_counter()
    torch.cuda.init()
    selection(variant).__enter__()
    model = build("llama", "fastattn" if variant.startswith("fastattn") else "sdpa", kv_heads)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randint(3, SIZES["vocab_size"], (1, p), generator=g).to("cuda") for p in prompts]
    torch.cuda.synchronize()
    t_built = time.perf_counter()
    per_prompt_ms = []
    with torch.no_grad():
        for ids in inputs:
            t_a = time.perf_counter()
            model(ids).logits[:, -1].argmax(-1).item()  # .item(): the first token, on the host
            per_prompt_ms.append(round((time.perf_counter() - t_a) * 1e3, 2))
    res = {"seconds": time.perf_counter() - t_built, "per_prompt_ms": per_prompt_ms,
           "import_seconds": t_import - t_start, "build_seconds": t_built - t_import}
    if variant.startswith("fastattn"):
        import fastattn

        res["path"] = _path()
        res["stats"] = {k: v for k, v in fastattn.stats().items() if isinstance(v, (int, float))}
    return res


def coldstart(rounds: int, prompts: list[int], kv_heads: int) -> dict:
    env = fresh_cache_env(tempfile.mkdtemp(prefix="fastattn-transformers-coldstart-"))
    args = ["--prompts", ",".join(map(str, prompts)), "--kv-heads", str(kv_heads)]
    res: dict = {"prompts": prompts, "fastattn_cold": fresh(__file__, ["--child", "fastattn_cold", *args], env)}
    runs: dict = {name: [] for name in COLD_PEERS}
    for order in rotated(COLD_PEERS, rounds):
        for name in order:
            runs[name].append(fresh(__file__, ["--child", name, *args], env))
    res.update(medians(runs, "seconds", "fastattn_warm", ("sdpa_cudnn", "sdpa_flash")))
    for name in COLD_PEERS:  # the parts outside the figure, for context
        for part in ("import_seconds", "build_seconds"):
            vals = [r[part] for r in runs[name] if part in r]
            res[name][part] = statistics.median(vals) if vals else None
    return res


def medians(runs: dict, key: str, ours: str, others) -> dict:
    """Per peer: its rounds (rows), the median of `key` over the rows that have it and
    how many failed; then `ours`' ratio to each of `others` (of the medians, and the
    median of each round's own ratio)."""
    out: dict = {}
    vals = {}
    for name, rows in runs.items():
        vals[name] = [r.get(key) for r in rows]
        ok = [x for x in vals[name] if x is not None]
        out[name] = {"rounds": rows, key: statistics.median(ok) if ok else None, "errors": len(rows) - len(ok)}
    for name in others:
        a, b = out[ours][key], out[name][key]
        out[f"ratio_{ours}_to_{name}"] = a / b if a and b else None
        out[f"ratio_{ours}_to_{name}_paired"] = paired_ratio(vals[ours], vals[name])
    return out


# -- (b) steady prefill and decode, one process ------------------------------------------------

def steady(rounds: int, batch: int, prompt: int, new_tokens: int, kv_heads: int) -> dict:
    import torch

    import fastattn
    import fastattn.integrations.transformers  # noqa: F401  (registers "fastattn")

    before = fastattn.stats()["sdpa"]  # the SDPA mode counts sdpa_mode's calls alone (off for the others)
    models, errors = {}, {}
    for peer in STEADY_PEERS:
        models[peer] = build("qwen2", "fastattn" if peer == "fastattn" else "sdpa", kv_heads)
    state = models["fastattn"].state_dict()
    for m in models.values():
        m.load_state_dict(state)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, SIZES["vocab_size"], (batch, prompt), generator=g).to("cuda")
    mask = torch.ones_like(ids)

    def prefill(model):
        with torch.no_grad():
            model(ids, attention_mask=mask)

    def generate(model, n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=SIZES["pad_token_id"])
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for peer, model in models.items():  # warm-up: every plan and graph the timed calls need
        try:
            with selection(peer):
                prefill(model)
                generate(model, new_tokens)
        except RuntimeError as e:
            errors[peer] = f"{type(e).__name__}: {str(e)[:500]}"
    rows: dict = {peer: [] for peer in models if peer not in errors}
    for order in rotated(rows, rounds):
        for peer in order:
            if peer in errors:
                continue
            model = models[peer]
            try:
                with selection(peer):
                    p_ms = gpu_ms(lambda model=model: prefill(model), reps=10, samples=3, warmup=1)
                    t1, tn = generate(model, 1), generate(model, new_tokens)
            except RuntimeError as e:  # reported; the peer's earlier rounds stay
                errors[peer] = f"{type(e).__name__}: {str(e)[:500]}"
                continue
            rows[peer].append({"prefill_ms": p_ms, "generate_1_ms": t1 * 1e3, "generate_n_ms": tn * 1e3,
                               "decode_ms_per_token": (tn - t1) * 1e3 / (new_tokens - 1)})
    res: dict = {"batch": batch, "prompt": prompt, "new_tokens": new_tokens, "errors": errors, "path": _path(),
                 "sdpa_mode_calls": calls_since(before, fastattn.stats()["sdpa"])}
    for key in ("prefill_ms", "decode_ms_per_token"):
        res[key] = medians(rows, key, "fastattn", [p for p in rows if p != "fastattn"]) if "fastattn" in rows else {}
    return res


# -- (c) a left-padded batch's generate, one process -----------------------------------------

PADDED_LENGTHS = (512, 37, 300, 129, 64, 451, 200, 16)  # prompt lengths of the batch, padded at the left
PADDED_PEERS = ("fastattn", "sdpa", "sdpa_mode")  # sdpa_mode: "sdpa" with the SDPA mode on, no backend chosen


def padded_mode(peer: str):
    """The SDPA mode on for sdpa_mode's calls alone; PyTorch's own backend choice for every peer."""
    return mode_on() if peer == "sdpa_mode" else contextlib.nullcontext()


def _fallback_calls() -> dict:
    import fastattn

    return dict(fastattn.stats()["fallbacks"].get("transformers", {}))


def padded_medians(rows: dict) -> dict:
    """Each peer's median tokens/s, fastattn's ratio to the others, and sdpa_mode's to sdpa
    (the SDPA mode on against off)."""
    out = medians(rows, "tokens_per_s", "fastattn", [p for p in rows if p != "fastattn"]) if "fastattn" in rows else {}
    if "sdpa_mode" in rows and "sdpa" in rows:
        mode = medians({p: rows[p] for p in ("sdpa_mode", "sdpa")}, "tokens_per_s", "sdpa_mode", ["sdpa"])
        out.update({k: v for k, v in mode.items() if k.startswith("ratio_")})
    return out


def padded(rounds: int, new_tokens: int, kv_heads: int) -> dict:
    import torch

    import fastattn
    import fastattn.integrations.transformers  # noqa: F401  (registers "fastattn")

    total = max(PADDED_LENGTHS)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, SIZES["vocab_size"], (len(PADDED_LENGTHS), total), generator=g)
    mask = torch.zeros_like(ids)
    for n, length in enumerate(PADDED_LENGTHS):
        mask[n, total - length:] = 1
    ids, mask = ids.to("cuda"), mask.to("cuda")
    out: dict = {"lengths": PADDED_LENGTHS, "new_tokens": new_tokens, "path": _path()}
    for kind in MODELS:
        models = {peer: build(kind, "fastattn" if peer == "fastattn" else "sdpa", kv_heads) for peer in PADDED_PEERS}
        for peer in PADDED_PEERS[1:]:
            models[peer].load_state_dict(models["fastattn"].state_dict())

        def generate(peer, model):
            with padded_mode(peer):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=SIZES["pad_token_id"])
                torch.cuda.synchronize()
                return time.perf_counter() - t0

        before, mode_before = _fallback_calls(), fastattn.stats()["sdpa"]
        errors = {}
        for peer, model in models.items():  # warm-up: every plan the timed calls need
            try:
                generate(peer, model)
            except RuntimeError as e:
                errors[peer] = f"{type(e).__name__}: {str(e)[:500]}"
        after = _fallback_calls()
        fallbacks = {r: n - before.get(r, 0) for r, n in after.items() if n != before.get(r, 0)}
        rows: dict = {peer: [] for peer in models if peer not in errors}
        for order in rotated(rows, rounds):
            for peer in order:
                try:
                    rows[peer].append({"tokens_per_s": len(PADDED_LENGTHS) * new_tokens / generate(peer, models[peer])})
                except RuntimeError as e:
                    errors[peer] = f"{type(e).__name__}: {str(e)[:500]}"
        res = {"errors": errors, "fallback_calls": sum(fallbacks.values()), "fallback_reasons": fallbacks,
               "sdpa_mode_calls": calls_since(mode_before, fastattn.stats()["sdpa"])}
        out[kind] = {**res, **padded_medians(rows)}
        del models
        torch.cuda.empty_cache()
    return out


# -- output ------------------------------------------------------------------------------------

def _fmt(x, spec=".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def summary(res: dict) -> list[str]:
    lines = ["  (medians of interleaved rounds; ratios: of medians, per round in parentheses)"]
    c = res.get("coldstart")
    if c:
        cold = c["fastattn_cold"]
        lines.append(f"  (a) ms to first logits, llama, prompts {c['prompts']} (import and model build apart): "
                     f"fastattn_cold {_fmt(cold.get('seconds') and cold['seconds'] * 1e3, '.1f')}"
                     + (f" (failed: {first_error([cold])})" if "error" in cold else f" ({cold.get('path')} path)"))
        for name in COLD_PEERS:
            r = c[name]
            lines.append(f"    {name:<14} {_fmt(r['seconds'] and r['seconds'] * 1e3, '.1f')} ms"
                         f"  (import {_fmt(r.get('import_seconds'))} s, build {_fmt(r.get('build_seconds'))} s)"
                         + (f"  {r['errors']} of {len(r['rounds'])} failed: {first_error(r['rounds'])}"
                            if r["errors"] else ""))
        for name, claim in (("sdpa_cudnn", "< 1"), ("sdpa_flash", "<= 1")):
            lines.append(f"    fastattn_warm / {name}: {_fmt(c[f'ratio_fastattn_warm_to_{name}'])} "
                         f"({_fmt(c[f'ratio_fastattn_warm_to_{name}_paired'])}); claim {claim}")
    s = res.get("steady")
    if s:
        lines.append(f"  (b) qwen2, batch {s['batch']} x {s['prompt']} tokens, {s['new_tokens']} new, "
                     f"fastattn {s['path']} path" + (f"; failed: {s['errors']}" if s["errors"] else ""))
        for key, label in (("prefill_ms", "prefill ms"), ("decode_ms_per_token", "decode ms/token")):
            m = s[key]
            peers = [p for p in STEADY_PEERS if p in m]
            ours, base = BASELINE[key]
            lines.append(f"    {label}: " + ", ".join(f"{p} {_fmt(m[p][key], '.3f')}" for p in peers)
                         + f"  (baseline: {ours} vs {base})")
            lines.append("      fastattn / " + ", ".join(f"{p} {_fmt(m[f'ratio_fastattn_to_{p}'])} "
                                                       f"({_fmt(m[f'ratio_fastattn_to_{p}_paired'])})"
                                                       for p in peers if p != "fastattn"))
        calls = s.get("sdpa_mode_calls")
        if calls is not None:
            lines.append(f"    sdpa_mode's SDPA calls: served {calls['served']}, passed on "
                         f"{sum(calls['passed_on'].values())} {calls['passed_on'] or ''}".rstrip()
                         + " (target: every call fastattn supports)")
    p = res.get("padded")
    if p:
        lines.append(f"  (c) left-padded generate, prompts {list(p['lengths'])}, {p['new_tokens']} new tokens, "
                     f"fastattn {p['path']} path: tokens/s")
        for kind in MODELS:
            r = p[kind]
            rates = ", ".join(f"{peer} {_fmt(r[peer]['tokens_per_s'], '.0f')}" for peer in PADDED_PEERS if peer in r)
            lines.append(f"    {kind}: {rates}; fastattn / sdpa {_fmt(r.get('ratio_fastattn_to_sdpa'))} "
                         f"({_fmt(r.get('ratio_fastattn_to_sdpa_paired'))}), target >= 1; fallback calls "
                         f"{r['fallback_calls']} (target 0)" + (f" {r['fallback_reasons']}" if r["fallback_calls"]
                                                               else "")
                         + (f"; failed: {r['errors']}" if r["errors"] else ""))
            calls = r.get("sdpa_mode_calls")
            if calls is not None:
                lines.append(f"      sdpa_mode / sdpa {_fmt(r.get('ratio_sdpa_mode_to_sdpa'))} "
                             f"({_fmt(r.get('ratio_sdpa_mode_to_sdpa_paired'))}); the mode served {calls['served']}, "
                             f"passed on {sum(calls['passed_on'].values())} {calls['passed_on'] or ''}".rstrip())
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.prompts, args.kv_heads)))
        return 0
    require_cuda("bench_transformers.py")
    import transformers


    t0 = time.perf_counter()
    res = {**header(), "transformers": transformers.__version__,
           "args": {k: v for k, v in vars(args).items() if k != "child"}, "sizes": SIZES}
    if not args.skip_coldstart:
        res["coldstart"] = coldstart(args.rounds, args.prompts, args.kv_heads)
    if not args.skip_steady:
        res["steady"] = steady(args.steady_rounds, args.batch, args.prompt, args.new_tokens, args.kv_heads)
    if not args.skip_padded:
        res["padded"] = padded(args.padded_rounds, args.padded_new_tokens, args.kv_heads)
    res["seconds"] = time.perf_counter() - t0
    emit(res, args.json, summary(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
