"""A server's stream of requests on shape classes (shape classes' acceptance benchmark).

The model shape is bench_shape_classes.py's default: batch 1, 32 query heads, 8 key/value
heads (GQA), head dim 128, bf16, causal. --masks says how fastattn is asked for it (the
same attention either way, SDPA's calls unchanged): bottom-right (default) causal bottom
right for prefill and decode (a decode step's one query sees the whole cache); top-left,
as SDPA's calls are, causal top left for prefill (s_q = s_kv) and no mask for decode, the
forms shape-override class plans take (prefill in the first rows of a buffer of the
longest prompt's rows: the class's declared storage up to MAX_PROMPT). The stream: --requests requests (default 200) with distinct prompt lengths
drawn from 1 .. 4096 (seeded); each request generates G tokens (G drawn so that its KV
cache ends at most at 8192 tokens) and runs its prefill (s_q = s_kv = prompt) and
--decode-steps of its G decode steps (q = 1 against the cache's first n tokens, evenly
spaced, the last one included): KV lengths up to 8192, almost all distinct. Each call is
synchronized, as a server returns each token. Steps, each in fresh processes:

1. warm: `fastattn warm --seqlens 1..8192` for the model, with the class bounds given
   (--classes; default "auto" where fastattn/_measured/shape_classes.json has a row for
   this GPU and cuDNN, else 128,256,...,8192), into an empty cache directory.
2. stream (--rounds interleaved rounds of fresh processes): fastattn.torch on the class
   plans, SDPA's cuDNN backend and SDPA's flash backend, the same requests. fastattn's
   process calls fastattn.preload() (every plan warm stored) at startup, then counts
   plans built or loaded during the stream (fastattn.stats(): builds, deserializations,
   misses; must be 0) and fastattn.torch's plan-table entries made. Times: from before
   the first call (torch imported, inputs allocated, CUDA ready; fastattn's import and
   preload inside the clock) to the last output, and per request.
3. kernels: per request (--kernel-requests of them), GPU time with CUDA events
   (_common.gpu_ms) of its prefill and of a decode step at its middle KV length, on the
   class plan and on the exact plan (shape_classes="off"; built in that process):
   the class-vs-exact table, by class.
4. first outputs of the 8 prefill shapes 1x32xSx128 (S = 256 ... 4096) in a fresh process
   with a warm cache, no separate preload, beside SDPA flash (bench_coldstart.first_outputs),
   in --first-output-rounds interleaved rounds (default 2).

    python benchmarks/bench_server.py [--json out.json] [--quick] [--requests N] [--classes 256,1024,4096]
                                      [--masks top-left]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import _common

HEADS, HEADS_KV, HEAD_DIM = 32, 8, 128
MAX_PROMPT, MAX_KV = 4096, 8192
DEFAULT_CLASSES = "128,256,512,1024,2048,4096,8192"
VARIANTS = ("fastattn_classes", "torch_cudnn", "torch_flash")
# --masks: fastattn.torch.attention()'s mask arguments for (prefill, decode), and warm's --mask.
MASKS = {"bottom-right": ({"causal_bottom_right": True}, {"causal_bottom_right": True}),
         "top-left": ({"causal": True}, {})}
WARM_MASK = {"bottom-right": "causal_bottom_right", "top-left": "causal"}


def requests(n: int, steps: int, seed: int) -> list[tuple[int, list[int]]]:
    """(prompt length, the KV lengths of its decode steps run) per request: distinct
    prompt lengths in 1 .. MAX_PROMPT, each request generating G tokens (its cache ends
    at most at MAX_KV), `steps` of its G steps run, evenly spaced, the last included."""
    rng = random.Random(seed)
    prompts = rng.sample(range(1, MAX_PROMPT + 1), n)
    out = []
    for s in prompts:
        g = rng.randint(1, MAX_KV - s)
        picked = sorted({s + max(1, round(g * (j + 1) / steps)) for j in range(min(steps, g))})
        out.append((s, picked))
    return out


def _inputs(torch, gqa_expanded: bool = False):
    """q for the longest prompt, one query, and the KV cache (b, MAX_KV, h_kv, d), bshd bf16."""
    hkv = HEADS if gqa_expanded else HEADS_KV
    q = torch.randn(1, MAX_PROMPT, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q1 = torch.randn(1, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, MAX_KV, hkv, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, q1, k, v


def _sdpa_call(torch, backend_name: str):
    """(prefill(q, k, v), decode(q1, k, v)) through SDPA with one backend forced, on bshd
    views; GQA through enable_gqa, or None where the backend refuses it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.CUDNN_ATTENTION if backend_name == "torch_cudnn" else SDPBackend.FLASH_ATTENTION
    sdpa_kernel(backend).__enter__()
    f = torch.nn.functional.scaled_dot_product_attention

    def prefill(q, k, v, gqa):
        return f(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa)

    def decode(q1, k, v, gqa):  # one query sees every key: no mask (SDPA's causal is top left)
        return f(q1.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=gqa)

    return prefill, decode


def child_stream(variant: str, args) -> dict:
    import torch

    torch.cuda.init()
    reqs = requests(args.requests, args.decode_steps, args.seed)
    gqa, expanded = True, False
    if variant != "fastattn_classes":
        prefill, decode = _sdpa_call(torch, variant)
        q, q1, k, v = _inputs(torch)
        try:  # the backend's GQA, on a small call before the clock
            prefill(q[:, :8], k[:, :8], v[:, :8], True)
            torch.cuda.synchronize()
        except RuntimeError:
            gqa, expanded = False, True
            del k, v
            q, q1, k, v = _inputs(torch, gqa_expanded=True)
        try:  # and its decode (one query): said here, not as a traceback in the middle of the stream
            decode(q1, k[:, :8], v[:, :8], gqa)
            torch.cuda.synchronize()
        except RuntimeError as e:
            return {"variant": variant, "error": f"{variant} refuses a decode step (q = 1): {e}"[:1500]}
    else:
        q, q1, k, v = _inputs(torch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res: dict = {"variant": variant, "gqa": "expanded kv heads" if expanded else "native"}
    if variant == "fastattn_classes":
        import fastattn
        import fastattn.torch as fat
        from fastattn.torch import _plans

        classes = args.classes

        prefill_mask, decode_mask = MASKS[args.masks]

        def prefill(q, k, v, gqa):
            return fat.attention(q, k, v, **prefill_mask, shape_classes=classes)

        def decode(q1, k, v, gqa):
            return fat.attention(q1, k, v, **decode_mask, shape_classes=classes)

        t_import = time.perf_counter()
        loaded = fastattn.preload(threads=8)  # every plan `fastattn warm` stored for this GPU and stack
        t_preload = time.perf_counter()
        res.update(import_ms=(t_import - t0) * 1e3, preload_ms=(t_preload - t_import) * 1e3,
                   preloaded=len(loaded))
        before = fastattn.stats()
        table_before = len(_plans.plans)
    t_stream = time.perf_counter()
    per_request = []
    for s, kv_lengths in reqs:
        t_a = time.perf_counter()
        prefill(q[:, :s], k[:, :s], v[:, :s], gqa)
        torch.cuda.synchronize()
        for n in kv_lengths:
            decode(q1, k[:, :n], v[:, :n], gqa)
            torch.cuda.synchronize()
        per_request.append((time.perf_counter() - t_a) * 1e3)
    t_end = time.perf_counter()
    res.update(seconds=t_end - t0, stream_seconds=t_end - t_stream, calls=sum(1 + len(r[1]) for r in reqs),
               request_ms_p50=statistics.median(per_request),
               request_ms_p99=sorted(per_request)[max(0, round(0.99 * len(per_request)) - 1)],
               request_ms_max=max(per_request), first_request_ms=per_request[0])
    if variant == "fastattn_classes":
        after = fastattn.stats()
        res["after_warm"] = {key: after[key] - before[key] for key in ("builds", "deserializations", "misses",
                                                                       "disk_hits")}
        res["plans_built_or_loaded_after_warm"] = after["builds"] + after["deserializations"] - \
            before["builds"] - before["deserializations"]
        res["torch_plan_table_new_entries"] = len(_plans.plans) - table_before
        res["stats"] = {key: val for key, val in after.items() if isinstance(val, (int, float))}
    return res


def child_kernels(args) -> dict:
    """Class plan against exact plan, GPU time per call, per request (prefill; a decode
    step at the request's middle KV length)."""
    import torch

    import fastattn
    import fastattn.torch as fat
    from fastattn import shape_classes as sc
    from fastattn.torch import _shape_classes

    torch.cuda.init()
    q, q1, k, v = _inputs(torch)
    classes = _shape_classes.resolve(args.classes, torch.cuda.current_device(), False)
    reqs = requests(args.requests, args.decode_steps, args.seed)[:args.kernel_requests]
    rows = []
    with torch.no_grad():
        for s, kv_lengths in reqs:
            mid = kv_lengths[len(kv_lengths) // 2] if kv_lengths else s
            row = {"prompt": s, "decode_kv": mid, "steps": len(kv_lengths),
                   "prefill_class": sc.class_of(s, classes), "decode_class": sc.class_of(mid, classes)}
            for part, qq, n in (("prefill", None, s), ("decode", q1, mid)):
                for name, choice in (("class", classes), ("exact", "off")):
                    def call(qq=qq, n=n, choice=choice, mask=MASKS[args.masks][qq is not None]):
                        return fat.attention(q[:, :n] if qq is None else qq, k[:, :n], v[:, :n], **mask,
                                             shape_classes=choice)
                    row[f"{part}_{name}_ms"] = _common.gpu_ms(call, reps=args.reps, samples=3, warmup=2,
                                                              lead_cycles=5_000_000)
                row[f"{part}_ratio"] = row[f"{part}_class_ms"] / row[f"{part}_exact_ms"]
            rows.append(row)
    return {"classes": [list(r) for r in classes.ranges], "rows": rows, "stats": {
        key: val for key, val in fastattn.stats().items() if isinstance(val, (int, float))}}


def _kernel_table(rows: list[dict]) -> tuple[list[str], dict]:
    """By class: requests, median and worst class/exact ratio (prefill, decode), and the
    estimated kernel ms per request (prefill + steps x the middle decode step)."""
    lines = ["class     part     n  median  worst  within5%  class ms/request  exact ms/request"]
    out: dict = {}
    for part in ("prefill", "decode"):
        by: dict = {}
        for r in rows:
            by.setdefault(r[f"{part}_class"], []).append(r)
        for cls in sorted(by, key=lambda c: (c is None, c or 0)):
            rs = by[cls]
            ratios = [r[f"{part}_ratio"] for r in rs]
            per_req = [(r[f"{part}_class_ms"], r[f"{part}_exact_ms"]) for r in rs]
            if part == "decode":
                per_req = [(c * r["steps"], e * r["steps"]) for (c, e), r in zip(per_req, rs)]
            c_ms = statistics.mean(c for c, _ in per_req)
            e_ms = statistics.mean(e for _, e in per_req)
            within = sum(x <= 1.05 for x in ratios) / len(ratios)
            lines.append(f"{str(cls):<9} {part:<7} {len(rs):3d} {statistics.median(ratios):7.3f} {max(ratios):6.3f}"
                         f" {within:8.0%} {c_ms:17.4f} {e_ms:17.4f}")
            out[f"{part}_{cls}"] = {"n": len(rs), "median_ratio": statistics.median(ratios),
                                    "worst_ratio": max(ratios), "within_5pct": within}
    c_total = statistics.mean(r["prefill_class_ms"] + r["steps"] * r["decode_class_ms"] for r in rows)
    e_total = statistics.mean(r["prefill_exact_ms"] + r["steps"] * r["decode_exact_ms"] for r in rows)
    out["kernel_ms_per_request_class"], out["kernel_ms_per_request_exact"] = c_total, e_total
    out["kernel_ratio_per_request"] = c_total / e_total
    return lines, out


def warm(env: dict, classes: str, masks: str) -> dict:
    """`fastattn warm --seqlens 1..MAX_KV` for the model into env's cache directory."""
    cmd = [sys.executable, "-m", "fastattn", "warm", "--seqlens", f"1..{MAX_KV}", "--heads", str(HEADS),
           "--heads-kv", str(HEADS_KV), "--head-dim", str(HEAD_DIM), "--dtype", "bf16",
           "--mask", WARM_MASK[masks], "--shape-classes", classes, "--no-torch-ops", "--no-progress", "--json"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env})
    res = {"command": " ".join(cmd[1:]), "exit": out.returncode, "seconds": time.perf_counter() - t0}
    try:
        report = json.loads(out.stdout)
        res["configs"] = len(report.get("items", []))
        res["counts"] = report.get("counts")
        res["lengths_without_a_class"] = report.get("lengths_without_a_class")
    except ValueError:
        res["stderr"] = out.stderr[-2000:]
    return res


def _default_classes() -> str:
    """auto where the measured file has a row for this GPU and the loaded cuDNN, else the
    explicit powers of two."""
    from fastattn import shape_classes as sc

    if not os.path.exists(sc.PATH):
        return DEFAULT_CLASSES
    try:
        import torch

        import fastattn

        fastattn.runtime.libraries()
        found = sc.measured(torch.cuda.get_device_name(), int(fastattn.versions()["cudnn_loaded"] or 0))
        return "auto" if found else DEFAULT_CLASSES
    except Exception:  # no GPU or no file: the explicit bounds (the warm reports any problem)
        return DEFAULT_CLASSES


def _child_argv(args) -> list[str]:
    return ["--requests", str(args.requests), "--decode-steps", str(args.decode_steps), "--seed", str(args.seed),
            "--classes", args.classes, "--kernel-requests", str(args.kernel_requests), "--reps", str(args.reps),
            "--masks", args.masks]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=(*VARIANTS, "kernels"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--decode-steps", type=int, default=3, help="decode steps run per request (evenly spaced)")
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument("--classes", default=None,
                    help=f"auto or class bounds (default: auto where measured for this GPU, else {DEFAULT_CLASSES})")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the stream's fresh processes")
    ap.add_argument("--kernel-requests", type=int, default=100, help="requests in the class-vs-exact kernel table")
    ap.add_argument("--reps", type=int, default=10, help="calls per CUDA-event sample in the kernel table")
    ap.add_argument("--first-output-rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="40 requests, 2 decode steps, 1 round, 20 in the table")
    ap.add_argument("--masks", choices=tuple(MASKS), default="bottom-right",
                    help="how fastattn is asked for the causal model (top-left: the forms override plans take)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.decode_steps, args.rounds = min(args.requests, 40), 2, 1
        args.kernel_requests, args.first_output_rounds = 20, 1
    args.kernel_requests = min(args.kernel_requests, args.requests)
    if args.child:
        from fastattn import shape_classes as sc

        if args.classes != "auto":
            args.classes = sc.parse(args.classes, "--classes")
        print(json.dumps(child_kernels(args) if args.child == "kernels" else child_stream(args.child, args)))
        return 0
    _common.require_cuda("bench_server.py")
    if args.classes is None:
        args.classes = _default_classes()
    t0 = time.perf_counter()
    res: dict = {"date": time.strftime("%Y-%m-%d"), "uname": os.uname().release, "classes": args.classes,
                 "requests": args.requests, "decode_steps": args.decode_steps, "seed": args.seed,
                 "shape": f"1x{HEADS}(kv {HEADS_KV})xSx{HEAD_DIM} bf16 causal", "masks": args.masks}
    cache_dir = tempfile.mkdtemp(prefix="fastattn-server-")
    env = _common.fresh_cache_env(cache_dir)  # (the op library where `fastattn warm` built it)
    res["warm"] = warm(env, args.classes, args.masks)
    me = os.path.abspath(__file__)
    rounds: dict = {name: [] for name in VARIANTS}
    for order in _common.rotated(VARIANTS, args.rounds):
        for name in order:
            rounds[name].append(_common.fresh(me, ["--child", name, *_child_argv(args)], env))
    res["stream"] = rounds
    res["kernels"] = _common.fresh(me, ["--child", "kernels", *_child_argv(args)], env)
    sys.path.insert(0, os.path.dirname(me))
    import bench_coldstart

    res["first_outputs"] = bench_coldstart.first_outputs(tempfile.mkdtemp(prefix="fastattn-server-first-"),
                                                         args.first_output_rounds)
    res["seconds"] = time.perf_counter() - t0

    # The summary: numbers (floats) and strings, last.
    w = res["warm"]
    res["warm_summary"] = f"exit {w['exit']}, {w.get('configs')} class plans, {w['seconds']:.1f} s"
    for name in VARIANTS:
        ok = [r for r in rounds[name] if "seconds" in r]
        if ok:
            res[f"{name}_total_ms"] = statistics.median(r["seconds"] * 1e3 for r in ok)
            res[f"{name}_request_p50_ms"] = statistics.median(r["request_ms_p50"] for r in ok)
            res[f"{name}_request_p99_ms"] = statistics.median(r["request_ms_p99"] for r in ok)
        else:
            res[f"{name}_error"] = _common.first_error(rounds[name]) or "not run"
    fa = [r for r in rounds["fastattn_classes"] if "seconds" in r]
    if fa:
        res["plans_built_or_loaded_after_warm"] = str([r["plans_built_or_loaded_after_warm"] for r in fa])
        res["fastattn_preload_ms"] = statistics.median(r["preload_ms"] for r in fa)
        for peer in ("torch_cudnn", "torch_flash"):
            if f"{peer}_total_ms" in res:
                res[f"total_{peer}_over_fastattn"] = res[f"{peer}_total_ms"] / res["fastattn_classes_total_ms"]
    k = res["kernels"]
    table = []
    if "rows" in k and k["rows"]:
        table, by_class = _kernel_table(k["rows"])
        res["kernel_by_class"] = by_class
        for key in ("kernel_ms_per_request_class", "kernel_ms_per_request_exact", "kernel_ratio_per_request"):
            res[key] = by_class[key]
    elif "error" in k:
        res["kernels_error"] = _common.first_error([k])
    fo = res["first_outputs"]
    for name in ("fastattn_torch_warm", "torch_flash"):
        for suffix in ("_ms", "_first_call_ms"):
            if fo.get(name + suffix) is not None:
                res[f"first_outputs_{name}{suffix}"] = float(fo[name + suffix])
    for name in ("fastattn_torch_warm", "torch_flash"):
        row = (fo.get(name) or [{}])[0]
        if "stats" in row:
            res[f"first_outputs_{name}_plans"] = (f"builds {row['stats'].get('builds')}, loads "
                                                  f"{row['stats'].get('deserializations')}, {row.get('path')} path")
    for line in table:
        print(line)
    return _common.report(res, args.json)


if __name__ == "__main__":
    sys.exit(main())
