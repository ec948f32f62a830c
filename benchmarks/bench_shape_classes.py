"""Shape classes on the GPU: a class plan's kernel time (cuDNN's ragged graph declared for
the class's longest length, serving a shorter call) against the exact plan's, across
lengths, for the measured policy of `shape_classes="auto"` (fastattn/shape_classes.py).

For each candidate class (lo, hi] of fastattn.shape_classes.CANDIDATES up to --max, at
the lengths lo + 1 (the worst case: the most rows the plan declares and the call lacks),
the middle and hi, two calls of one model shape (--heads, --heads-kv, --head-dim,
--dtype, causal bottom-right, --batch):
- prefill: s_q = s_kv = n (forward; with --training also the backward);
- decode: s_q = 1, s_kv = n (forward), a KV cache's slice of a cache 2 * hi long.
Kernel time, not host time: `--reps` eager calls are queued behind a GPU sleep long enough
for the host to enqueue them all, and timed with CUDA events around them, in `--rounds`
interleaved rounds (class, exact, class, ...: drift hits both alike); the medians are
recorded. (Not CUDA graphs: a call inside a capture takes its exact plan.)

    python benchmarks/bench_shape_classes.py [--json out.json] [--write fastattn/_measured/shape_classes.json]

--write merges this GPU and cuDNN's row into the policy's file (other GPUs' rows kept):
the policy keeps a class where every measured length in it ran within
shape_classes.TOLERANCE of its exact plan, forward (and backward, for training calls,
only if measured with --training: without it training calls stay on exact plans).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import fastattn
import fastattn.torch
from fastattn import shape_classes as sc

from _common import header, require_cuda, write_json  # (benchmarks/ is on sys.path)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _queued_time_us(fn, reps: int) -> callable:
    """A timer of reps eager calls of fn queued behind a GPU sleep (after one call, so that
    its plan is held): the host enqueues them while the GPU waits, so the events time the
    kernels back to back, not the host. Not a CUDA graph: a call inside a capture takes its
    exact plan (fastattn/torch/_shape_classes.py), so a graph would time the exact plan twice."""
    fn()
    torch.cuda.synchronize()
    gap, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    cycles = [1 << 21]

    def timed() -> float:
        while True:
            gap.record()
            torch.cuda._sleep(cycles[0])
            start.record()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            host_ms = (time.perf_counter() - t0) * 1000.0
            end.record()
            end.synchronize()
            if gap.elapsed_time(start) > 1.2 * host_ms:  # every call was queued before the sleep ended
                return start.elapsed_time(end) * 1000.0 / reps
            cycles[0] *= 2

    return timed


def measure(make, classes: sc.Classes, reps: int, rounds: int) -> tuple[float, float]:
    """(class plan us, exact plan us) per call of make(shape_classes) -> a callable."""
    timers = {name: _queued_time_us(make(choice), reps) for name, choice in (("class", classes), ("exact", "off"))}
    samples = {"class": [], "exact": []}
    for name in timers:  # one warm run each
        timers[name]()
    for _ in range(rounds):
        for name in ("class", "exact"):
            samples[name].append(timers[name]())
    return statistics.median(samples["class"]), statistics.median(samples["exact"])


def run(args) -> dict:
    dtype = DTYPES[args.dtype]
    b, hq, hkv, d = args.batch, args.heads, args.heads_kv or args.heads, args.head_dim
    classes_out = []
    lo = 1
    for hi in (c for c in sc.CANDIDATES if c <= args.max):
        classes = sc.Classes(((lo, hi),))
        lengths = []
        for n in sorted({lo + 1, (lo + 1 + hi) // 2, hi}):
            m = {"n": n}
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dtype) for h in (hq, hkv, hkv))

            def prefill(choice, q=q, k=k, v=v):
                return lambda: fastattn.torch.attention(q, k, v, causal_bottom_right=True, shape_classes=choice)

            with torch.no_grad():
                m["forward_class_us"], m["forward_exact_us"] = measure(prefill, classes, args.reps, args.rounds)
                cache_k, cache_v = (torch.randn(b, 2 * hi, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
                q1 = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype)

                def decode(choice, n=n, q1=q1, ck=cache_k, cv=cache_v):
                    return lambda: fastattn.torch.attention(q1, ck[:, :n], cv[:, :n], causal_bottom_right=True,
                                                            shape_classes=choice)

                m["decode_class_us"], m["decode_exact_us"] = measure(decode, classes, args.reps, args.rounds)
            if args.training:
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

                def step(choice):
                    def fn():
                        o = fastattn.torch.attention(qg, kg, vg, causal_bottom_right=True, shape_classes=choice)
                        o.backward(torch.ones_like(o))
                    return fn

                # A training step less its forward: the backward's time.
                c_step, e_step = measure(step, classes, max(1, args.reps // 4), args.rounds)
                m["backward_class_us"] = max(c_step - m["forward_class_us"], 1e-3)
                m["backward_exact_us"] = max(e_step - m["forward_exact_us"], 1e-3)
            # The policy reads forward_* (and backward_*): the worse of prefill and decode.
            if m["decode_class_us"] / m["decode_exact_us"] > m["forward_class_us"] / m["forward_exact_us"]:
                m["prefill_class_us"], m["prefill_exact_us"] = m["forward_class_us"], m["forward_exact_us"]
                m["forward_class_us"], m["forward_exact_us"] = m["decode_class_us"], m["decode_exact_us"]
            lengths.append({key: round(val, 3) if isinstance(val, float) else val for key, val in m.items()})
            print(f"  ({lo}, {hi}] n={n}: " + ", ".join(f"{key} {val}" for key, val in lengths[-1].items()
                                                        if key != "n"), flush=True)
        classes_out.append({"lo": lo, "hi": hi, "lengths": lengths})
        lo = hi
    return {"classes": classes_out}


def row(res: dict) -> dict:
    return {"gpu": res["gpu"], "cudnn": res["versions"].get("cudnn_loaded"), "date": res["date"],
            "fastattn": res["versions"].get("fastattn"), "shape": res["shape"], "training": res["shape"]["training"],
            "classes": res["classes"]}


def write(path: str, new_row: dict) -> None:
    """Merges new_row into the policy's file (replacing the row of its GPU and cuDNN);
    published by rename, so that a reader sees the old file or the new one."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        if isinstance(old, dict) and old.get("format") == sc.FORMAT and isinstance(old.get("rows"), list):
            rows = [r for r in old["rows"] if isinstance(r, dict)
                    and (r.get("gpu"), r.get("cudnn")) != (new_row["gpu"], new_row["cudnn"])]
    except (OSError, ValueError):
        pass
    rows.append(new_row)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": sc.FORMAT, "rows": rows}, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--max", type=int, default=16384, help="the longest class measured (a candidate bound)")
    ap.add_argument("--training", action="store_true", help="also the backward (training calls' classes)")
    ap.add_argument("--reps", type=int, default=20, help="calls per timed sample")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median is recorded)")
    ap.add_argument("--json")
    ap.add_argument("--write", help="merge the policy's row into this file (fastattn/_measured/shape_classes.json)")
    args = ap.parse_args(argv)
    require_cuda("bench_shape_classes.py")
    t0 = time.perf_counter()
    res = {**header(),
           "gpu": torch.cuda.get_device_name(),  # the name the policy compares (fastattn.torch._shape_classes.resolve)
           "shape": {"batch": args.batch, "heads_q": args.heads, "heads_kv": args.heads_kv or args.heads,
                     "head_dim": args.head_dim, "dtype": args.dtype, "mask": "causal_bottom_right",
                     "training": args.training, "reps": args.reps, "rounds": args.rounds}}
    res.update(run(args))
    res["versions"] = fastattn.versions()  # cuDNN is loaded now
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(res, args.json)
    if args.write:
        write(args.write, row(res))
    kept = sc.measured(res["gpu"], res["versions"].get("cudnn_loaded"), args.write,
                       training=args.training) if args.write else None
    print("summary:")
    print(f"  {res['gpu']}, cuDNN {res['versions'].get('cudnn_loaded')}, {res['seconds']} s")
    for c in res["classes"]:
        worst = max(m["forward_class_us"] / m["forward_exact_us"] for m in c["lengths"])
        print(f"  class ({c['lo']}, {c['hi']}]: worst class/exact forward {worst:.3f}")
    if args.write:
        print(f"  auto keeps: {kept.ranges if kept else 'nothing'} (tolerance {sc.TOLERANCE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
