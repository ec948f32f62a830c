"""The Redis tier: how fast a fresh machine becomes warm from it, and what it costs
when Redis is down.

(a) A private redis-server on loopback. Process A, with an empty disk cache, builds
    the 64 configs of bench_warm.py (publishing each to Redis); process B, with another
    empty disk cache, loads them: from Redis, with zero builds. Both time
    fastattn.preload(configs, threads=1) in a fresh process (GPU).
(b) The cost of a lookup that misses, in-process with synthetic entries (no GPU):
    no remote tier; Redis up; Redis refusing connections (the first lookup after a
    failure tries, the next ones rest for FASTATTN_REMOTE_RETRY).

    python benchmarks/bench_remote.py [--json out.json]      # redis-server on PATH
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

SECRET = "bench secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    import redis

    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def child() -> dict:
    import fastattn
    from _common import warm_configs  # (benchmarks/ is on sys.path: this runs as the script)

    todo = warm_configs()
    t0 = time.perf_counter()
    fastattn.preload(todo, threads=1)
    s = fastattn.stats()
    return {"seconds": time.perf_counter() - t0, "builds": s["builds"], "remote_hits": s["cache"].get("remote_hits", 0),
            "remote_published": s["cache"].get("remote_published", 0), "deserializations": s["deserializations"]}


def fresh_machine(url: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="fastattn-bench-remote-") as d:
        env = {**os.environ, "FASTATTN_CACHE_DIR": d, "FASTATTN_REMOTE_CACHE": url, "FASTATTN_CACHE_HMAC_KEY": SECRET}
        out = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, env=env,
                             check=False, timeout=600)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def miss_cost(url: str | None, n: int = 200) -> dict:
    """Microseconds per lookup of a key nobody has, through TieredCache.get."""
    from fastattn import store

    with tempfile.TemporaryDirectory() as d:
        env = {"FASTATTN_CACHE_DIR": d, "FASTATTN_CACHE_HMAC_KEY": SECRET, "FASTATTN_REMOTE_RETRY": "5"}
        if url:
            env["FASTATTN_REMOTE_CACHE"] = url
        cache = store.TieredCache(store.settings_from_env(env))
        times = []
        for i in range(n):
            key = f"{i:064x}"
            t0 = time.perf_counter()
            assert cache.get(key) is None
            times.append((time.perf_counter() - t0) * 1e6)
    return {"first_us": times[0], "median_us": statistics.median(times[1:]), "max_us": max(times[1:])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--no-gpu", action="store_true", help="only (b)")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child()))
        return 0
    if shutil.which("redis-server") is None:
        print("redis-server is not on PATH")
        return 1
    res: dict = {"date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as work:
        proc, url = start_redis(work)
        try:
            if not args.no_gpu:
                res["build"] = fresh_machine(url)
                res["from_redis"] = fresh_machine(url)
            res["miss_no_remote"] = miss_cost(None)
            res["miss_redis_up"] = miss_cost(url)
        finally:
            proc.terminate()
            proc.wait()
        res["miss_redis_down"] = miss_cost(url)  # the same port, nothing listening now
    from _common import emit

    emit(res, args.json)
    if "build" in res:
        b, r = res["build"], res["from_redis"]
        if "error" in b or "error" in r:
            print(f"  error: {b.get('error') or r.get('error')}")
        else:
            print(f"  64 configs: built {b['seconds']:.2f} s ({b['builds']} builds, {b['remote_published']} published); "
                  f"from Redis {r['seconds']:.2f} s ({r['builds']} builds, {r['remote_hits']} remote hits): "
                  f"{b['seconds'] / r['seconds']:.1f}x faster")
    for name in ("miss_no_remote", "miss_redis_up", "miss_redis_down"):
        m = res[name]
        print(f"  lookup miss, {name[5:]}: first {m['first_us']:.0f} us, then median {m['median_us']:.0f} us "
              f"(max {m['max_us']:.0f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
