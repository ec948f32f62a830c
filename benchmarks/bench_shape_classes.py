"""Shape classes on the GPU: a class plan's kernel time (a graph declared for the class's
longest length, serving a shorter call) against the exact plan's, across lengths, for the
measured policy of `shape_classes="auto"` (fastattn/shape_classes.py). Each kind of class
plan that the loaded cuDNN has is timed beside the exact plan in the same rounds (--kinds):
the shape-override graph (cuDNN >= 9.21) and the ragged graph (every cuDNN); the first kind
is the one that serves, which the policy's row records as the class plan's time.

For each candidate class (lo, hi] of fastattn.shape_classes.CANDIDATES up to --max, at
the lengths lo + 1 (the worst case: the most rows the plan declares and the call lacks),
the middle and hi, two calls of one model shape (--heads, --heads-kv, --head-dim,
--dtype, --batch):
- prefill: s_q = s_kv = n, causal (forward; with --training also the backward), the first n
  rows of buffers of hi rows;
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
from fastattn.torch import _plans, _shape_classes as _classes

from _common import header, require_cuda, write_json  # (benchmarks/ is on sys.path)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OVERRIDE_MAX = sc.OVERRIDE_MAX  # the library's bound, before _as() changes it for each kind's timing


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


def _as(kind: str | None, fn):
    """fn with the class plans of `kind` preferred (None: exact plans, classes off)."""
    if kind is None:
        return fn

    def call():
        sc.OVERRIDE_MAX = sys.maxsize if kind == _classes.OVERRIDE else 0
        return fn()
    return call


def measure(make, classes: sc.Classes, kinds: tuple[str, ...], reps: int, rounds: int) -> dict[str, float]:
    """{kind: us per call, ..., "exact": us} of make(shape_classes) -> a callable, each
    kind's class plan (fastattn/torch/_shape_classes.py: RAGGED, OVERRIDE) beside the exact
    plan, in interleaved rounds."""
    variants = {**{kind: (kind, classes) for kind in kinds}, "exact": (None, "off")}
    timers = {name: _queued_time_us(_as(kind, make(choice)), reps) for name, (kind, choice) in variants.items()}
    samples = {name: [] for name in timers}
    for name in timers:  # one warm run each
        timers[name]()
    for _ in range(rounds):
        for name in timers:
            samples[name].append(timers[name]())
    return {name: statistics.median(v) for name, v in samples.items()}


def _served_by(kind: str, upper_q: int) -> bool:
    """Whether calls ran a class plan of `kind` declared for upper_q query rows (one cuDNN
    refused serves its calls by another kind or exact plans, which its timing then is)."""
    return any(key[0] == "class" and key[-1].kind == kind and key[-1].upper_q == upper_q for key in list(_plans.plans))


def _named(call: str, times: dict[str, float], upper_q: int) -> dict[str, float]:
    """measure()'s times as the result's keys ({call}_{kind}_us), leaving out a kind
    whose class plan did not serve (cuDNN refused it)."""
    return {f"{call}_{name}_us": t for name, t in times.items() if name == "exact" or _served_by(name, upper_q)}


def run(args) -> dict:
    dtype = DTYPES[args.dtype]
    # The kinds this cuDNN has, the one that serves first (shape_classes.OVERRIDE_MAX set for it while
    # timing it: every class's, or none).
    kinds = tuple(k for k in args.kinds if k != _classes.OVERRIDE or _classes._override_available())
    args.kinds = kinds
    b, hq, hkv, d = args.batch, args.heads, args.heads_kv or args.heads, args.head_dim
    classes_out = []
    lo = 1
    for hi in (c for c in sc.CANDIDATES if c <= args.max):
        classes = sc.Classes(((lo, hi),))
        lengths = []
        for n in sorted({lo + 1, (lo + 1 + hi) // 2, hi}):
            m = {"n": n}
            # The first n rows of buffers of the class's hi rows: where an override plan reads a
            # call's tensors (cudnn-frontend#1148), as a server's preallocated buffers hold them.
            # Causal top-left: at s_q = s_kv the bottom-right diagonal, which an override plan
            # cannot take (cudnn-frontend places it from the declared lengths).
            q, k, v = (torch.randn(b, hi, h, d, device="cuda", dtype=dtype)[:, :n] for h in (hq, hkv, hkv))

            def prefill(choice, q=q, k=k, v=v):
                return lambda: fastattn.torch.attention(q, k, v, causal=True, shape_classes=choice)

            with torch.no_grad():
                m.update(_named("prefill", measure(prefill, classes, kinds, args.reps, args.rounds), hi))
                cache_k, cache_v = (torch.randn(b, 2 * hi, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
                q1 = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype)

                # (no mask: one query at the bottom-right diagonal sees every key)
                def decode(choice, n=n, q1=q1, ck=cache_k, cv=cache_v):
                    return lambda: fastattn.torch.attention(q1, ck[:, :n], cv[:, :n], shape_classes=choice)

                m.update(_named("decode", measure(decode, classes, kinds, args.reps, args.rounds), 1))
            if args.training:
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

                def step(choice):
                    def fn():
                        o = fastattn.torch.attention(qg, kg, vg, causal=True, shape_classes=choice)
                        o.backward(torch.ones_like(o))
                    return fn

                # A training step less its forward: the backward's time.
                steps = _named("step", measure(step, classes, kinds, max(1, args.reps // 4), args.rounds), hi)
                for name in (*kinds, "exact"):
                    if f"step_{name}_us" in steps:
                        m[f"backward_{name}_us"] = max(steps[f"step_{name}_us"] - m[f"prefill_{name}_us"], 1e-3)
            # The policy reads forward_class_us and forward_exact_us (and backward_*): the worse
            # of prefill and decode, each on the kind of class plan that serves it here (an
            # override plan in a class up to shape_classes.OVERRIDE_MAX where cuDNN built it, else
            # the ragged plan).
            serving = [k for k in args.kinds if k != _classes.OVERRIDE or hi <= OVERRIDE_MAX]
            for direction in ("forward", "backward") if args.training else ("forward",):
                calls = ("prefill", "decode") if direction == "forward" else ("backward",)
                pairs = [next(((m[f"{call}_{k}_us"], m[f"{call}_exact_us"]) for k in serving
                               if f"{call}_{k}_us" in m), (None, None)) for call in calls]
                pairs = [p for p in pairs if p[0] is not None]
                if pairs:
                    m[f"{direction}_class_us"], m[f"{direction}_exact_us"] = max(pairs, key=lambda p: p[0] / p[1])
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
    ap.add_argument("--kinds", type=lambda t: tuple(t.split(",")), default=("override", "ragged"),
                    help="the kinds of class plan to time, the one that serves first (override: cuDNN >= 9.21)")
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
    res["shape"]["kinds"] = list(args.kinds)
    res["versions"] = fastattn.versions()  # cuDNN is loaded now
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(res, args.json)
    if args.write:
        write(args.write, row(res))
    kept = sc.measured(res["gpu"], res["versions"].get("cudnn_loaded"), args.write,
                       training=args.training) if args.write else None
    print("summary:")
    print(f"  {res['gpu']}, cuDNN {res['versions'].get('cudnn_loaded')}, {res['seconds']} s")
    print(f"  kinds timed: {', '.join(res['shape']['kinds']) or 'none'} (the first serves)")
    for c in res["classes"]:
        for kind in res["shape"]["kinds"]:
            ratios = [m[f"{call}_{kind}_us"] / m[f"{call}_exact_us"] for m in c["lengths"]
                      for call in ("prefill", "decode") if f"{call}_{kind}_us" in m]
            worst = f"{max(ratios):.3f}" if ratios else "refused"
            print(f"  class ({c['lo']}, {c['hi']}] {kind}: worst class/exact forward {worst}")
    if args.write:
        print(f"  auto keeps: {kept.ranges if kept else 'nothing'} (tolerance {sc.TOLERANCE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
