"""Can a plan's kernels be loaded off the caller's path by launching the plan once, in a
thread of fastattn's own, on a private stream, with that thread's stream-capture mode
relaxed? (A candidate way for the warm-up to load kernels: CUDA's lazy loading loads a
kernel at its first launch, most of a warmed plan's first call (docs/BENCHMARKS.md); a
throwaway capture cannot load it without disturbing the caller's other threads,
benchmarks/probe_first_launch_capture.py.)

Each case runs in a child process of its own (a kernel once loaded stays loaded in a
process) on a cache a first child filled, so that its plans are loaded from the cache
(deserialized, as the warm-up loads them; a build may have launched them), then:
  lazy                 its first launch on the caller's stream, then a second: host time of
                       each (plan.forward's return, before the GPU ran it)
  preloaded            the same after a thread launched it once on a private stream with
                       scratch buffers (its capture mode relaxed, CU_STREAM_CAPTURE_MODE_RELAXED)
                       and waited for that stream alone
  preload-beside-capture  that thread's launch while the caller's thread captures and replays
                       CUDA graphs of another plan (global mode, PyTorch's default) again and
                       again: does every capture stay valid, every replay equal to eager?
  preload-beside-sync  that thread's launch while the caller's thread loops on
                       torch.cuda.synchronize(): does the caller see an error?
  load-kernels         the warm-up's own way, Plan.load_kernels() in a thread (scratch of
                       its own, zeroed, on a stream of its own)
After its first three launches each case launches twice more with another output tensor
(a launch's pointers are the key of fastattn's cached variant pack): what a new pointer
set costs a plan whose kernels ran already (new_pointers_ms), against the first launch.
The launch takes a memory allocation of the plan's tensors' size while it runs (made by
PyTorch's allocator on the private stream). Needs a CUDA GPU; exits 2 with one line where
there is none.

    python3 benchmarks/probe_first_launch_preload.py [--json FILE] [--rounds 5]
    (tools/other_cudnn.sh run VERSION -- python3 benchmarks/probe_first_launch_preload.py)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import header, require_cuda, write_json  # (benchmarks/ on sys.path)

CASES = ("lazy", "preloaded", "load-kernels", "preload-beside-capture", "preload-beside-sync")
FILL = "fill"  # the child that builds the plans into the cache the cases load from
_RELAXED = 2  # CUstreamCaptureMode: GLOBAL 0, THREAD_LOCAL 1, RELAXED 2


def _relax_this_thread() -> int:
    """This thread's stream-capture mode set to relaxed (the driver's
    cuThreadExchangeStreamCaptureMode): its calls are not refused, and refuse no other
    thread's capture, while another thread captures in global mode."""
    mode = ctypes.c_int(_RELAXED)
    return ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))


def run_case(name: str) -> dict:
    import threading

    import torch

    import fastattn

    def config(s):
        return fastattn.AttentionConfig(batch=2, heads_q=4, seqlen_q=s, seqlen_kv=s, head_dim_qk=64, dtype="bf16",
                                        mask="causal")

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    out: dict = {"case": name}
    if name == FILL:
        for s in (256, 128):
            fastattn.plan(config(s))
        return {**out, "builds": fastattn.stats()["builds"], "cudnn": fastattn.versions()["cudnn_loaded"]}
    plan = fastattn.plan(config(256))
    ws = torch.empty(max(plan.workspace_size, 1), device="cuda", dtype=torch.uint8)

    def launch(p, o, stream, workspace):
        p.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), 0, workspace.data_ptr(), stream)

    errors: list[str] = []

    def preload():
        try:
            out["relax_status"] = _relax_this_thread()
            private = torch.cuda.Stream()
            with torch.cuda.stream(private):
                scratch = torch.empty_like(q)
                scratch_ws = torch.empty_like(ws)
                t0 = time.perf_counter()
                launch(plan, scratch, private.cuda_stream, scratch_ws)
                out["preload_launch_ms"] = (time.perf_counter() - t0) * 1e3
                private.synchronize()
                del scratch, scratch_ws
        except Exception as e:  # what the warm-up would see
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")

    other_errors: list[str] = []
    if name == "load-kernels":
        def load_kernels():
            try:
                t0 = time.perf_counter()
                plan.load_kernels()
                out["preload_launch_ms"] = (time.perf_counter() - t0) * 1e3
            except Exception as e:
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")

        t = threading.Thread(target=load_kernels)
        t.start()
        t.join()
    elif name == "preloaded":
        t = threading.Thread(target=preload)
        t.start()
        t.join()
    elif name in ("preload-beside-capture", "preload-beside-sync"):
        other = fastattn.plan(config(128))  # the caller's own plan, launched once before its captures
        o_other = torch.empty(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
        q2, k2, v2 = (t[:, :128].contiguous() for t in (q, k, v))
        ws_other = torch.empty(max(other.workspace_size, 1), device="cuda", dtype=torch.uint8)

        def launch_other(o, stream):
            other.forward(q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), o.data_ptr(), 0, ws_other.data_ptr(), stream)

        launch_other(o_other, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        eager = o_other.clone()
        t = threading.Thread(target=preload)
        rounds = 0
        t.start()
        while t.is_alive() or rounds == 0:
            rounds += 1
            try:
                if name == "preload-beside-sync":
                    torch.cuda.synchronize()
                    continue
                graph = torch.cuda.CUDAGraph()
                o = torch.empty_like(o_other)
                with torch.cuda.graph(graph):
                    launch_other(o, torch.cuda.current_stream().cuda_stream)
                graph.replay()
                torch.cuda.synchronize()
                if not torch.equal(o, eager):
                    other_errors.append("a replay differs from the eager call")
            except Exception as e:  # what the caller would see
                other_errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                break
        t.join()
        out["caller_rounds"] = rounds
    out["preload_errors"] = errors
    out["caller_errors"] = other_errors
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream().cuda_stream
    times = []
    for _ in range(3):  # the first launch, then steady ones
        o = torch.empty_like(q)
        t0 = time.perf_counter()
        launch(plan, o, stream, ws)
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    out["first_launch_ms"], out["second_launch_ms"], out["third_launch_ms"] = times
    o_first, o_new = torch.empty_like(q), torch.empty_like(q)  # both held: o_new's address is not o's
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        launch(plan, o_new, stream, ws)
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    del o_first
    out["new_pointers_ms"], out["new_pointers_again_ms"] = times
    out["builds"] = fastattn.stats()["builds"]  # 0: every plan came from the cache
    out["cudnn"] = fastattn.versions()["cudnn_loaded"]  # (after the first plan: loaded by then)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--rounds", type=int, default=5, help="child processes per case, interleaved")
    ap.add_argument("--case", choices=(FILL, *CASES), help=argparse.SUPPRESS)  # (a child process's one case)
    args = ap.parse_args()
    require_cuda("probe_first_launch_preload.py")
    if args.case:
        print(json.dumps(run_case(args.case)))
        return 0
    env = {**os.environ, "FASTATTN_CACHE_DIR": tempfile.mkdtemp(prefix="fastattn-preload-probe-"),
           "FASTATTN_WARM_UP": "off"}

    def child(name: str) -> dict:
        p = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True, timeout=300,
                           env=env)
        try:
            return json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            return {"case": name, "caller_errors": [f"child exit {p.returncode}: {p.stderr.strip()[-300:]}"]}

    filled = child(FILL)
    print(f"fill: {filled}")
    rows = []
    for r in range(args.rounds):
        for name in CASES:
            rows.append({**child(name), "round": r})
    summary = {}
    for name in CASES:
        mine = [x for x in rows if x["case"] == name and "first_launch_ms" in x and x.get("builds") == 0]
        if not mine:
            summary[name] = "no result"
            continue
        first = statistics.median(x["first_launch_ms"] for x in mine)
        steady = statistics.median(x["third_launch_ms"] for x in mine)
        fresh = statistics.median(x["new_pointers_ms"] for x in mine)
        summary[name] = {"first_launch_ms": round(first, 3), "steady_launch_ms": round(steady, 3),
                         "first_over_steady": round(first / steady, 2), "new_pointers_ms": round(fresh, 3),
                         "first_over_new_pointers": round(first / fresh, 2),
                         "errors": sorted({e for x in mine for e in x["preload_errors"] + x["caller_errors"]})}
        print(f"{name}: {summary[name]}")
    print(f"cuDNN {sorted({r.get('cudnn') for r in rows}, key=str)} (each case's child process)")
    write_json({**header(), "fill": filled, "rows": rows, "summary": summary}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
