"""What `fastattn warm --verify` costs beside plain `fastattn warm`.

The built-in model shapes (fastattn.config_files.builtin_configs(), what `fastattn warm` warms
without a file), each row in a fresh empty cache directory, rounds interleaved:
  plain          warm into an empty cache
  verify         warm --verify into an empty cache (build + verify)
  verify_after   warm --verify over a cache plain warm just filled (the verification alone)
  verify_again   warm --verify over a verified cache (no second run: the entries' verdicts)
Each row records wall seconds, the report's counts and verdict counts, and the sum and
largest of the verifications' own seconds (from the verdicts).

    python benchmarks/bench_warm_verify.py [--workers 8] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import _common

from fastattn import config_files
from fastattn.warm import warm


def _timed(configs, workers: int, verify: bool) -> dict:
    t0 = time.perf_counter()
    report = warm(configs, workers=workers, verify=verify)
    seconds = time.perf_counter() - t0
    verify_s = [i.verdict["seconds"] for i in report.items if i.verdict]
    return {"seconds": round(seconds, 2), "counts": report.counts, "verdicts": report.verdicts,
            "processes": report.processes, "verify_seconds_sum": round(sum(verify_s), 2),
            "verify_seconds_max": round(max(verify_s, default=0.0), 3),
            "failures": [{"config": i.config.to_dict(), "status": i.status, "reason": i.reason[:300]}
                         for i in report.items if i.status in ("failed", "rejected")]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    _common.require_cuda("bench_warm_verify.py")
    configs = config_files.builtin_configs()
    rounds = []
    for r in range(args.rounds):
        row = {}
        for name in ("plain", "verify", "verify_after"):  # interleaved: each round runs all three
            with tempfile.TemporaryDirectory(prefix="fastattn-bench-verify-") as d:
                os.environ["FASTATTN_CACHE_DIR"] = d
                if name == "verify_after":
                    row["plain_before"] = _timed(configs, args.workers, False)
                row[name] = _timed(configs, args.workers, name != "plain")
                if name == "verify":
                    row["verify_again"] = _timed(configs, args.workers, True)
        rounds.append(row)
        print(f"round {r}: " + ", ".join(f"{k} {v['seconds']:.1f} s" for k, v in row.items()), file=sys.stderr)
    res = {**_common.header(), "configs": len(configs), "workers": args.workers, "cpus": os.cpu_count(),
           "rounds": rounds,
           "median_seconds": {name: statistics.median(row[name]["seconds"] for row in rounds)
                              for name in ("plain", "verify", "verify_after", "verify_again")}}
    _common.emit(res, args.json)
    print("  (median seconds over rounds)")
    for name, median in res["median_seconds"].items():
        last = rounds[-1][name]
        print(f"  {name:<13} {median:7.2f} s  counts {last['counts']}  verdicts {last['verdicts']}  "
              f"verification sum {last['verify_seconds_sum']:.1f} s, max {last['verify_seconds_max']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
