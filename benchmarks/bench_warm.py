"""How `fastattn warm` scales with worker processes, and what a second run costs.

64 configs (GQA and MHA, head dims 64 and 128, seqlen 256 ... 8192, causal bf16, half
of them training) are warmed into an empty cache with 1, 4, 8 and 16 workers (target:
speed-up of at least 0.6 x workers over one), then warmed again from the cache. For
comparison, the same configs are also built on 1 and 16 threads of one process
(fastattn.preload), which has no crash isolation. It reports the worker processes'
CPU time, the processes `warm` started, and how much of each config's time its worker
spent building.

--set families: another 64 configs, in 16 kernel families of 4 (head dims 64 and 128,
bf16 and fp16, causal or not, inference or training; seqlen 512 ... 4096), where the
default set has 4 families of 16: how warm scales when a deploy covers many kernels.

    python benchmarks/bench_warm.py [--set default|families] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from fastattn.warm import warm
from _common import emit, require_cuda, warm_configs  # (benchmarks/ is on sys.path)


def _children_cpu() -> float:
    """CPU seconds (user + system) of the finished worker processes so far."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 16],
                    help="also build the same configs in one process with this many threads (no crash isolation)")
    ap.add_argument("--set", choices=("default", "families"), default="default", dest="which",
                    help="which 64 configs (see above)")
    ap.add_argument("--child-threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.child_threads:
        import fastattn

        t0 = time.perf_counter()
        results = fastattn.preload(warm_configs(args.which), threads=args.child_threads)
        print(json.dumps({"seconds": time.perf_counter() - t0, "builds": fastattn.stats()["builds"],
                          "build_seconds_sum": sum(r.build_seconds for r in results)}))
        return 0
    require_cuda("bench_warm.py")
    todo = warm_configs(args.which)
    assert len(todo) == 64
    rows = []
    for n in args.workers:
        with tempfile.TemporaryDirectory(prefix="fastattn-bench-warm-") as d:
            os.environ["FASTATTN_CACHE_DIR"] = d
            t0, cpu0 = time.perf_counter(), _children_cpu()
            first = warm(todo, workers=n)
            cold, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
            t0 = time.perf_counter()
            second = warm(todo, workers=n)
            rows.append({"workers": n, "processes": first.processes, "cold_seconds": cold, "cold_cpu_seconds": cpu, "second_run_seconds": time.perf_counter() - t0,
                         "first_counts": first.counts, "second_counts": second.counts,
                         "first_item_seconds": sorted(round(i.seconds, 3) for i in first.items),
                         "first_build_seconds": [round(i.build_seconds, 3) for i in first.items],
                         "first_item_seconds_in_order": [round(i.seconds, 3) for i in first.items],
                         "second_item_seconds": sorted(round(i.seconds, 3) for i in second.items)})
    thread_rows = []
    for n in args.threads:
        # For comparison: the same builds on threads of one fresh process.
        import subprocess

        with tempfile.TemporaryDirectory(prefix="fastattn-bench-warm-") as d:
            t0, cpu0 = time.perf_counter(), _children_cpu()
            out = subprocess.run([sys.executable, __file__, "--child-threads", str(n), "--set", args.which],
                                 capture_output=True, text=True,
                                 env={**os.environ, "FASTATTN_CACHE_DIR": d}, check=False)
            wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
        row = {"threads": n, "process_seconds": wall, "cpu_seconds": cpu}
        if out.returncode == 0:
            row.update(json.loads(out.stdout.strip().splitlines()[-1]))
        else:
            row["error"] = out.stderr[-1500:]
        thread_rows.append(row)
    base = rows[0]["cold_seconds"] if rows[0]["workers"] == 1 else None
    for r in rows:
        if base:
            r["speedup"] = base / r["cold_seconds"]
            r["speedup_per_worker"] = r["speedup"] / r["workers"]
        r["second_over_first"] = r["second_run_seconds"] / r["cold_seconds"]
    res = {"date": time.strftime("%Y-%m-%d"), "set": args.which, "configs": len(todo), "cpus": os.cpu_count(),
           "rows": rows,
           "thread_rows": thread_rows}
    emit(res, args.json)
    for r in rows:
        print(f"  {r['workers']:>2} workers ({r['processes']} started): cold {r['cold_seconds']:.1f} s"
              + (f" (speed-up {r['speedup']:.1f}x, {r['speedup_per_worker']:.2f} per worker)" if base else "")
              + f", second run {r['second_run_seconds']:.1f} s ({r['second_over_first']:.2f} of the first)"
              + f"; workers' CPU {r['cold_cpu_seconds']:.1f} s = {r['cold_cpu_seconds'] / r['cold_seconds']:.1f} cores")
        for run in ("first", "second"):
            t = r[f"{run}_item_seconds"]
            print(f"      {run} run, seconds per config: median {t[len(t) // 2]:.3f}, max {t[-1]:.3f}, "
                  f"sum {sum(t):.1f}" + (f" (of it building in the workers: {sum(r['first_build_seconds']):.1f})"
                                         if run == "first" else ""))
    for r in thread_rows:
        print(f"  one process, {r['threads']:>2} threads: " + (f"error {r['error'][-200:]}" if "error" in r else
              f"builds {r['seconds']:.1f} s ({r['builds']} builds, sum {r['build_seconds_sum']:.1f} s), process {r['process_seconds']:.1f} s, "
              f"CPU {r['cpu_seconds']:.1f} s = {r['cpu_seconds'] / r['process_seconds']:.1f} cores"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
