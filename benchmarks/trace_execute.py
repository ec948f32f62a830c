"""Which CUDA calls one forward makes on the host, and what they cost.

Runs fastattn's plan.forward, fastattn.torch.attention and PyTorch SDPA's cuDNN backend
on the small shape of bench_torch (1x8x128x64 bf16 causal, inference) under PyTorch's
profiler (CUPTI sees every CUDA runtime and driver call in the process, cuDNN's
included) and prints, per call of each, the runtime and driver API calls made and
their mean host time. What is left of a call's time beyond them is CPU work in
cuDNN, cudnn-frontend, fastattn or PyTorch. Profiling slows every call: compare the
API calls' counts and relative costs, not the totals with bench_torch's.

    python benchmarks/trace_execute.py [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import fastattn.torch as fat
from fastattn.torch import _plans
from _common import require_cuda, write_json  # (benchmarks/ on sys.path)


def _trace(fn, calls: int) -> dict:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        wall = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if e.key.startswith(("cuda", "cu")) and e.count >= calls // 2:  # runtime (cuda*) and driver (cu*) calls
            rows[e.key] = {"per_call": round(e.count / calls, 2), "us_each": round(e.cpu_time_total / e.count, 3)}
    return {"wall_us_profiled": round(wall, 3), "api": rows,
            "api_us_per_call": round(sum(r["per_call"] * r["us_each"] for r in rows.values()), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    require_cuda("trace_execute.py")
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    o = fat.attention(q, k, v, causal=True)
    hit = next(iter(_plans.plans.values()))
    stream = _plans.raw_stream(0)
    ws = _plans.workspace(q, hit.forward_workspace, 0, stream)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), 0, ws.data_ptr() if ws is not None else 0, stream)
    res = {"plan_forward": _trace(lambda: hit.plan.forward(*ptrs), args.calls),
           "fastattn_torch_attention": _trace(lambda: fat.attention(q, k, v, causal=True), args.calls)}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        res["torch_sdpa_cudnn"] = _trace(
            lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True), args.calls)
    write_json(res, args.json)
    print("summary:")
    for name, r in res.items():
        print(f"  {name}: {r['wall_us_profiled']:.2f} us per call profiled, of it CUDA API calls "
              f"{r['api_us_per_call']:.2f} us:")
        for api, a in sorted(r["api"].items(), key=lambda kv: -kv[1]["per_call"] * kv[1]["us_each"]):
            print(f"    {api:<40} x{a['per_call']:<5} {a['us_each']:7.3f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
