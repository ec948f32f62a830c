"""`fastattn cache prune` and `clear` on a large cache: wall time per entry (no GPU).

Makes a cache of N small synthetic entries (the format of fastattn/store/entry.py,
spread over the shard folders as the store spreads them, random last uses), with a
lock file for each as builds leave them, and times the command in a fresh process,
each run on a fresh copy. --cold drops the page cache first (root only: writes
/proc/sys/vm/drop_caches), as on a machine where the cache was not read lately.

    python benchmarks/bench_cache_prune.py [-n 28536] [--runs 3] [--cold] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _common import write_json  # (benchmarks/ is on sys.path)

COMMANDS = {"prune --max-age 0s": ["cache", "prune", "--max-age", "0s"], "clear": ["cache", "clear"],
            "prune --max-bytes 0": ["cache", "prune", "--max-bytes", "0"],
            "prune --max-age 1000d (keeps all)": ["cache", "prune", "--max-age", "1000d"]}


def make_cache(root: str, n: int) -> None:
    from fastattn.store.entry import Entry, encode

    rng = random.Random(0)
    locks = os.path.join(root, "locks")
    os.makedirs(locks, mode=0o700)
    for i in range(n):
        key = hashlib.sha256(str(i).encode()).hexdigest()
        folder = os.path.join(root, key[:2])
        os.makedirs(folder, mode=0o700, exist_ok=True)
        path = os.path.join(folder, key + ".entry")
        with open(path, "wb") as f:
            f.write(encode(Entry(key, "plan", {"config": {"i": i}}, {"forward": b"x" * 2000}, {}, 1.7e9)))
        used = time.time() - rng.uniform(0, 30 * 86400)
        os.utime(path, (used, used))
        open(os.path.join(locks, key + ".lock"), "wb").close()


def run_once(template: str, argv: list[str], cold: bool) -> float:
    work = tempfile.mkdtemp(prefix="fastattn-prune-")
    try:
        cache = os.path.join(work, "cache")
        shutil.copytree(template, cache)
        if cold:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        env = {**os.environ, "FASTATTN_CACHE_DIR": cache}
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "fastattn", *argv, "--json"], env=env, capture_output=True,
                              text=True)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise SystemExit(f"{argv}: exit {proc.returncode}: {proc.stderr or proc.stdout}")
        return wall
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=28536, help="entries (default: the issue's 28,536)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    template = tempfile.mkdtemp(prefix="fastattn-prune-template-")
    try:
        make_cache(os.path.join(template, "cache"), args.n)
        results = {}
        for name, argv in COMMANDS.items():
            walls = [run_once(os.path.join(template, "cache"), argv, args.cold) for _ in range(args.runs)]
            results[name] = {"median_s": statistics.median(walls), "runs_s": walls,
                             "per_entry_ms": 1000 * statistics.median(walls) / args.n}
            print(f"{name:<36} {statistics.median(walls):7.2f} s  ({results[name]['per_entry_ms']:.3f} ms an entry; "
                  f"runs {', '.join(f'{w:.2f}' for w in walls)})")
    finally:
        shutil.rmtree(template, ignore_errors=True)
    write_json({"entries": args.n, "cold": args.cold, "results": results}, args.json)


if __name__ == "__main__":
    main()
