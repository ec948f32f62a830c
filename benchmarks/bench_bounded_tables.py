"""Bounded tables: one process calls fastattn.torch.attention on --shapes distinct shapes
(default 100,000) and stays bounded in host memory, while a hot shape keeps its per-call
host time.

The process sets FASTATTN_MEMORY_MAX_ENTRIES=--max-entries (default 4096, the default
cap) before it imports fastattn.torch, and calls attention(q, k, v, causal=True) on bf16
bshd tensors (1, s_q, 2, 64) for every pair (s_q, s_kv) of lengths from the smallest
length --plans allows upward, each pair once (317 lengths give 100,489 pairs); the hot
shape (1, --hot-len, 2, 64) is called between every two new shapes, as a server's common
shape is. On the path fastattn.torch takes (--path; the native op library where `fastattn
warm` built it).

Plans (--plans). A distinct shape is a distinct plan: cuDNN builds one in tens of
milliseconds, so 100,000 builds would take hours, and the cache would hold 100,000 entries.
- stand-in (default): the runtime's build step is replaced, in this process, by a fresh
  deserialization of one real plan, built once for the smallest shape (1 x 1 where cuDNN
  takes it). Everything else runs as for a real new shape: fastattn.torch's key and
  checks (config_for), its Python table, the runtime's entry (each holding its own
  deserialized cuDNN plan, so the host memory a plan holds is really held), the op
  library's C++ table, each table's trims and counts. Only the kernels differ: the plan
  computes the first query row against the first key of the call's larger tensors (batch
  1: memory-safe), so those outputs are not their shapes' attention; nothing reads them.
  The hot shape's plan is its own, built for real. (That the outputs are right past the
  cap, with real plans: tests/pytorch/test_torch_bounded_gpu.py.)
  A deserialization takes ~3-5 ms (docs/history/benchmarks-log.md), most of a new shape's
  time here.
- shared: the same, but every new config's entry holds the one stand-in plan itself (no
  deserialization): the tables' own memory and time alone, ~100,000 shapes in minutes.
- real: every shape built by cuDNN, into a fresh cache directory (use --shapes 2000 or so).
Each way the process stops adding shapes after --max-seconds (default 480, within a
device command's 10 minutes) and reports how many it saw.

Recorded: the host's resident memory (VmRSS of /proc/self/status) and the tables' sizes
every --every new shapes; the hot shape's per-call host time at the start (after the
first --every shapes) and at the end, each the median of 15 samples of 200 calls queued
behind a GPU sleep (the host's time, not the GPU's); fastattn.stats()["evictions"].
Reported as ratios, never asserted: RSS at the end over RSS when the tables first reached
their cap (a bounded process: about 1), RSS growth per 10,000 shapes over the second half
of the run (bounded: about 0 MB), and the hot call's host time end / start (steady: about 1).
For the unbounded picture, run it with --max-entries 2147483647 (and fewer --shapes: the
tables then keep every plan).

    python benchmarks/bench_bounded_tables.py [--json out.json] [--shapes N] [--max-entries N]
                                              [--plans stand-in|shared|real]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

from _common import emit, header, held_us, require_cuda  # (benchmarks/ is on sys.path)

HEADS, DIM = 2, 64
SMALLEST = (1, 8, 16, 64)  # the stand-in plan's length: the first cuDNN takes


def shapes(n: int, smallest: int) -> list[tuple[int, int]]:
    """n distinct (s_q, s_kv) pairs, every length >= smallest: the pairs of the
    ceil(sqrt(n)) lengths from smallest up, row by row."""
    side = max(1, math.isqrt(n - 1) + 1) if n else 0
    lengths = range(smallest, smallest + side)
    return [(a, b) for a in lengths for b in lengths][:n]


def rss_mb() -> float:
    """This process's resident set (VmRSS), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def summarize(samples: list[dict], max_entries: int, hot_start: float, hot_end: float) -> dict:
    """The ratios the summary reports, from the RSS samples ({"shapes", "rss_mb", ...},
    in order): RSS at the end / when the shapes seen first passed the cap (where they did),
    MB per 10,000 shapes over the second half, hot host time end / start."""
    out = {"hot_end_over_start": hot_end / hot_start if hot_start else None,
           "rss_end_over_at_cap": None, "rss_mb_per_10k_shapes_second_half": None}
    if not samples:
        return out
    at_cap = next((s for s in samples if s["shapes"] >= max_entries), None)
    if at_cap is not None:
        out["rss_end_over_at_cap"] = samples[-1]["rss_mb"] / at_cap["rss_mb"]
    half = [s for s in samples if s["shapes"] >= samples[-1]["shapes"] / 2]
    if len(half) >= 2 and half[-1]["shapes"] > half[0]["shapes"]:
        out["rss_mb_per_10k_shapes_second_half"] = (half[-1]["rss_mb"] - half[0]["rss_mb"]) / (
            half[-1]["shapes"] - half[0]["shapes"]) * 10_000
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--shapes", type=int, default=100_000, help="distinct shapes (default 100000)")
    ap.add_argument("--max-entries", type=int, default=4096, help="FASTATTN_MEMORY_MAX_ENTRIES (default 4096)")
    ap.add_argument("--plans", choices=("stand-in", "shared", "real"), default="stand-in",
                    help="see the doc (default stand-in)")
    ap.add_argument("--path", choices=("auto", "native", "python"), default="auto", help="FASTATTN_TORCH_PATH")
    ap.add_argument("--hot-len", type=int, default=128, help="the hot shape's length (default 128)")
    ap.add_argument("--every", type=int, default=1000, help="record RSS every this many shapes (default 1000)")
    ap.add_argument("--max-seconds", type=float, default=480.0, help="stop adding shapes after this (default 480)")
    return ap.parse_args(argv)


def hot_host_us(call, samples: int = 15, iters: int = 200) -> tuple[float, int]:
    """(median microseconds of host time per call, samples whose GPU sleep outlasted the
    loop): each sample's calls queue behind a sleep kernel, so the loop never waits for
    the GPU (bench_torch's held loop, _common.host_rounds)."""
    import torch

    for _ in range(50):
        call()
    out, valid = [], 0
    for _ in range(samples):
        us, held = held_us(call, iters)
        out.append(us)
        valid += held
    torch.cuda.synchronize()
    return statistics.median(out), valid


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda("bench_bounded_tables.py")
    cache = tempfile.mkdtemp(prefix="fastattn-bounded-")
    # Before fastattn.torch is imported: the cap is read once per process, at its first use.
    os.environ.update({"FASTATTN_MEMORY_MAX_ENTRIES": str(args.max_entries), "FASTATTN_CACHE_DIR": cache,
                       "FASTATTN_TORCH_PATH": args.path, "FASTATTN_WARM_UP": "off"})
    import torch

    import fastattn
    import fastattn.torch
    from fastattn import AttentionConfig, bounded, runtime
    from fastattn.torch import _native, _plans

    if bounded.max_entries() != args.max_entries:  # (read before this process set it)
        print(f"bench_bounded_tables.py: the tables' cap is {bounded.max_entries()}, not --max-entries "
              f"{args.max_entries}: fastattn read FASTATTN_MEMORY_MAX_ENTRIES before", file=sys.stderr)
        return 1

    res = {**header(), "shapes_asked": args.shapes, "max_entries": args.max_entries, "plans": args.plans,
           "torch_path": fastattn.torch.backend_info()["path"], "heads": HEADS, "head_dim": DIM,
           "hot_len": args.hot_len}

    def tensors(s_q: int, s_kv: int):
        q = torch.randn(1, s_q, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(1, s_kv, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        return q, kv, kv

    def config(s_q: int, s_kv: int) -> AttentionConfig:
        return AttentionConfig(batch=1, heads_q=HEADS, seqlen_q=s_q, seqlen_kv=s_kv, head_dim_qk=DIM, dtype="bf16",
                               layout="bshd", mask="causal")

    hot = tensors(args.hot_len, args.hot_len)
    hot_config = config(args.hot_len, args.hot_len)
    smallest = SMALLEST[0]
    loads = [0]
    if args.plans in ("stand-in", "shared"):
        smallest = next((s for s in SMALLEST if fastattn.probe(config(s, s)).supported), None)
        if smallest is None:
            print(f"bench_bounded_tables.py: cuDNN takes none of the lengths {SMALLEST} for the stand-in plan",
                  file=sys.stderr)
            return 1
        stand_in = fastattn.plan(config(smallest, smallest))
        blobs = stand_in.serialize()
        core, real_build = runtime._core(), runtime._build

        def build(cfg, device, refresh=False, touch=True):
            if cfg.layout == hot_config.layout and cfg.seqlen_q == cfg.seqlen_kv == args.hot_len:
                return real_build(cfg, device, refresh, touch)  # the hot shape's own plan
            if args.plans == "shared":
                return stand_in, runtime.result_from_plan(cfg, device, stand_in, 0.0, "built")
            loads[0] += 1
            p = core.load_plan(stand_in.config, device, blobs[0], blobs[1])
            return p, runtime.result_from_plan(cfg, device, p, 0.0, "built")

        runtime._build = build
    res["smallest_len"] = smallest
    pairs = shapes(args.shapes, smallest)
    # Inputs are made once per length and sliced (a view of the first s tokens: the same
    # strides for every s, so that only the shape is new).
    longest = smallest + (math.isqrt(max(args.shapes, 1) - 1) + 1)
    q_all, kv_all, _ = tensors(longest, longest)

    def call_hot():
        fastattn.torch.attention(*hot, causal=True)

    samples = []

    def sample(seen: int, t0: float) -> None:
        lib = _native.library()
        samples.append({"shapes": seen, "seconds": round(time.perf_counter() - t0, 2), "rss_mb": round(rss_mb(), 1),
                        "torch_calls": len(_plans.plans), "runtime_entries": len(runtime._entries),
                        "native_calls": lib.table_size() if lib is not None else None})

    call_hot()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sample(0, t0)
    hot_start = hot_valid_start = None
    seen = 0
    for s_q, s_kv in pairs:
        if time.perf_counter() - t0 > args.max_seconds:
            break
        fastattn.torch.attention(q_all[:, :s_q], kv_all[:, :s_kv], kv_all[:, :s_kv], causal=True)
        call_hot()
        seen += 1
        if seen % args.every == 0:
            torch.cuda.synchronize()
            sample(seen, t0)
            if hot_start is None:
                hot_start, hot_valid_start = hot_host_us(call_hot)
    torch.cuda.synchronize()
    if samples[-1]["shapes"] != seen:
        sample(seen, t0)
    hot_end, hot_valid_end = hot_host_us(call_hot)
    if hot_start is None:
        hot_start, hot_valid_start = hot_end, hot_valid_end
    stats = fastattn.stats()
    res.update({"shapes_seen": seen, "seconds": round(time.perf_counter() - t0, 1), "stand_in_loads": loads[0],
                "builds": stats["builds"], "evictions": stats["evictions"], "samples": samples,
                "hot_host_us_start": round(hot_start, 3), "hot_host_us_end": round(hot_end, 3),
                "hot_held_valid": [hot_valid_start, hot_valid_end]})
    res.update(summarize(samples, args.max_entries, hot_start, hot_end))
    at_cap = next((s["rss_mb"] for s in samples if s["shapes"] >= args.max_entries), None)
    stopped = "; stopped by --max-seconds" if seen < len(pairs) else ""
    lines = [f"  {seen} distinct shapes in {res['seconds']} s ({args.plans} plans, {res['torch_path']} path, "
             f"cap {args.max_entries}{stopped})",
             f"  host RSS: {samples[0]['rss_mb']} MB at the start, {at_cap} MB when the shapes passed the cap, "
             f"{samples[-1]['rss_mb']} MB at the end",
             f"  rss_end_over_at_cap               {res['rss_end_over_at_cap']}",
             f"  rss_mb_per_10k_shapes_second_half {res['rss_mb_per_10k_shapes_second_half']}",
             f"  hot call host time: {hot_start:.2f} us at the start, {hot_end:.2f} us at the end "
             f"(held samples {hot_valid_start}/15, {hot_valid_end}/15)",
             f"  hot_end_over_start                {res['hot_end_over_start']}",
             f"  tables at the end: torch_calls {samples[-1]['torch_calls']}, native_calls "
             f"{samples[-1]['native_calls']}, runtime {samples[-1]['runtime_entries']}; evictions {stats['evictions']}"]
    emit(res, args.json, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
