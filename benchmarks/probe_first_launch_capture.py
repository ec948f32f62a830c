"""Does a plan's first launch inside a caller's CUDA-graph capture break that capture, on
the cuDNN this process loads? And does a throwaway capture of fastattn's own, on a
private stream, load the plan's kernels first without disturbing another thread?

cuDNN 9.24 on an H100 (tests/attention/test_capture_gpu.py, the whole GPU suite in
reverse order) saw a freshly built plan's first launch inside torch.cuda.graph fail
with CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER and the capture invalidated, where 9.19
and 9.28 passed the same test: CUDA's lazy module loading loads a kernel at its first
launch, and loading inside a global-mode capture is not allowed. Each case runs in a
child process of its own (a kernel once loaded stays loaded in a process):
  first-launch-in-capture  build a plan, launch it first inside torch.cuda.graph (global mode)
  launched-once-first      the same after one ordinary launch
  preloaded-by-capture     the same after a throwaway capture of one launch on a private
                           stream in thread-local mode (discarded, never replayed)
  preload-beside-sync      that throwaway capture while another thread loops on
                           torch.cuda.synchronize(): does the other thread see an error?
Each prints whether the capture succeeded and whether its replay matched an eager run
bitwise. Needs a CUDA GPU; exits 2 with one line where there is none.

    python3 benchmarks/probe_first_launch_capture.py [--json FILE]
    (tools/other_cudnn.sh run VERSION -- python3 benchmarks/probe_first_launch_capture.py)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _common import header, require_cuda, write_json  # (benchmarks/ on sys.path)

CASES = ("first-launch-in-capture", "launched-once-first", "preloaded-by-capture", "preload-beside-sync")


def run_case(name: str) -> dict:
    import threading

    import torch

    import fastattn

    cfg = fastattn.AttentionConfig(batch=2, heads_q=4, seqlen_q=256, seqlen_kv=256, head_dim_qk=64, dtype="bf16",
                                   mask="causal")
    plan = fastattn.plan(cfg)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    o = torch.full_like(q, float("nan"))
    ws = torch.empty(max(plan.workspace_size, 1), device="cuda", dtype=torch.uint8)

    def launch(out, stream):
        plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0, ws.data_ptr(), stream)

    out: dict = {"case": name, "cudnn": fastattn.versions()["cudnn_loaded"]}
    sync_errors: list[str] = []
    if name == "launched-once-first":
        launch(torch.empty_like(q), torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
    elif name in ("preloaded-by-capture", "preload-beside-sync"):
        stop = threading.Event()

        def syncer():
            while not stop.is_set():
                try:
                    torch.cuda.synchronize()
                except Exception as e:  # what a user's thread would see
                    sync_errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    return

        t = threading.Thread(target=syncer) if name == "preload-beside-sync" else None
        if t:
            t.start()
        private = torch.cuda.Stream()
        scratch = torch.empty_like(q)
        throwaway = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(throwaway, stream=private, capture_error_mode="thread_local"):
                launch(scratch, private.cuda_stream)
            out["preload"] = "ok"
        except Exception as e:
            out["preload"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        del throwaway
        if t:
            stop.set()
            t.join()
        out["other_thread_sync_errors"] = sync_errors
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            launch(o, torch.cuda.current_stream().cuda_stream)
        graph.replay()
        torch.cuda.synchronize()
        eager = torch.empty_like(q)
        launch(eager, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        out["capture"] = "ok"
        out["replay_equals_eager"] = bool(torch.equal(o, eager))
    except Exception as e:
        out["capture"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # (a child process's one case)
    args = ap.parse_args()
    require_cuda("probe_first_launch_capture.py")
    if args.case:
        print(json.dumps(run_case(args.case)))
        return 0
    rows = []
    for name in CASES:
        p = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True, timeout=300)
        lines = p.stdout.strip().splitlines()
        try:
            row = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            row = {"case": name, "capture": f"child exit {p.returncode}: {p.stderr.strip()[-300:]}"}
        rows.append(row)
        print(f"{name}: {row}")
    print(f"cuDNN {sorted({r.get('cudnn') for r in rows}, key=str)} (each case's child process)")
    write_json({**header(), "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
