"""Where a warm-cache cold start spends its time, step by step, in fresh processes.

Fills a cache directory once (a cold process builds the 8 prefill shapes of
bench_coldstart.py, inference and training plans), then runs fresh processes on it,
one per mode, and times each step: importing fastattn, loading each library, cuDNN's
sub-libraries by hand (sublibs), a first cudnnCreate (create_first), each plan's
lookup and deserialization, all plans on threads (parallel_*), and the first and
second run of each plan (exec). A diagnostic for the cold-start work, not a benchmark:

    python benchmarks/profile_coldstart.py [--json out.json]      # on the GPU
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

import _common  # (benchmarks/ is on sys.path)

SEQLENS = (256, 512, 768, 1024, 1536, 2048, 3072, 4096)


def _configs(training: bool):
    import fastattn

    return [fastattn.AttentionConfig(batch=1, heads_q=32, seqlen_q=s, head_dim_qk=128, dtype="bf16", layout="bshd",
                                     mask="causal", training=training) for s in SEQLENS]


def child(mode: str) -> dict:
    steps = _common.Steps(2)
    mark = steps.mark

    import torch  # what a server has loaded already; not part of fastattn's cost

    torch.cuda.init()
    torch.empty(1, device="cuda")
    mark("torch import + CUDA context (not counted)")
    import fastattn
    from fastattn import _loader

    mark("import fastattn")
    cudnn_path = _loader.ensure_loaded(on_step=mark).cudnn
    if mode == "sublibs":
        lib_dir = os.path.dirname(cudnn_path)
        for name in sorted(os.listdir(lib_dir)):
            if name.startswith("libcudnn_") and name.endswith(".so.9"):
                ctypes.CDLL(os.path.join(lib_dir, name), mode=ctypes.RTLD_GLOBAL)
                mark(f"dlopen {name} ({os.path.getsize(os.path.join(lib_dir, name)) >> 20} MiB)")
    if mode == "create_first":
        lib = ctypes.CDLL(cudnn_path)
        h = ctypes.c_void_p()
        st = lib.cudnnCreate(ctypes.byref(h))
        mark(f"first cudnnCreate via ctypes (status {st})")
        st = lib.cudnnCreate(ctypes.byref(h))
        mark(f"second cudnnCreate via ctypes (status {st})")
    fastattn.device_info()
    mark("device_info")
    configs = _configs(training=mode == "train")
    if mode.startswith("parallel"):
        from concurrent.futures import ThreadPoolExecutor

        rest = configs
        if mode == "parallel_after_first":
            fastattn.plan(configs[0])
            mark("plan (first, alone)")
            rest = configs[1:]
        with ThreadPoolExecutor(len(rest)) as pool:
            list(pool.map(fastattn.plan, rest))
        mark(f"{len(rest)} plans on {len(rest)} threads")
    else:
        for cfg in configs:
            fastattn.plan(cfg)
            mark(f"plan seqlen {cfg.seqlen_q}")
    s = fastattn.stats()
    if mode == "exec":
        # The first run of a freshly loaded plan (kernel loading) against later ones.
        for cfg in configs:
            p = fastattn.plan(cfg)
            q = torch.randn(1, cfg.seqlen_q, 32, 128, device="cuda", dtype=torch.bfloat16)
            o = torch.empty_like(q)
            ws = torch.empty(max(p.workspace_size, 1), dtype=torch.uint8, device="cuda")
            stream = torch.cuda.current_stream().cuda_stream
            torch.cuda.synchronize()
            mark(f"allocate seqlen {cfg.seqlen_q}")
            for i in range(2):
                p.forward(q.data_ptr(), q.data_ptr(), q.data_ptr(), o.data_ptr(), workspace=ws.data_ptr(),
                          stream=stream)
                mark(f"  forward #{i + 1} call")
                torch.cuda.synchronize()
                mark(f"  forward #{i + 1} synchronize")
    return {"mode": mode, "steps": steps, "builds": s["builds"], "disk_hits": s["disk_hits"],
            "load_ms": round(s["load_seconds"] * 1e3, 2)}


def fill(cache_dir: str) -> None:
    code = (f"import fastattn, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
            "from profile_coldstart import _configs\n"
            "for t in (False, True):\n    for c in _configs(t): fastattn.plan(c)\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "FASTATTN_CACHE_DIR": cache_dir})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    _common.require_cuda("profile_coldstart.py")
    cache_dir = tempfile.mkdtemp(prefix="fastattn-profile-")
    fill(cache_dir)
    results = []
    for mode in ("fwd", "fwd", "train", "create_first", "sublibs", "parallel_all", "parallel_after_first", "exec"):
        out = subprocess.run([sys.executable, __file__, "--child", mode], capture_output=True, text=True,
                             env={**os.environ, "FASTATTN_CACHE_DIR": cache_dir}, timeout=300)
        if out.returncode != 0:
            results.append({"mode": mode, "error": out.stderr[-2000:]})
            continue
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    _common.write_json(results, args.json)
    print("summary:")
    for r in results:
        print(f"--- {r['mode']}: " + ("error: " + r["error"][-300:] if "error" in r else
                                     f"builds {r['builds']}, disk hits {r['disk_hits']}, load {r['load_ms']} ms"))
        for name, ms in r.get("steps", []):
            print(f"  {ms:9.2f} ms  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
