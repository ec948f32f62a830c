"""Where a fresh process's first fastattn.torch call spends its time, with a warm cache.

Fills a cache directory once (profile_coldstart.fill: the 8 prefill shapes of
bench_coldstart.py, 1x32xSx128 bf16 causal, inference and training plans), then runs
fresh processes on it, --rounds interleaved rounds of each mode, and reports each step's
median (ms):

  call          what a user's process does: import fastattn, import fastattn.torch, the
                first attention() call (S = 256) to its synchronized output, a second
                shape's first call (a load), the first shape again (a hit);
                FASTATTN_WARM_UP=off
  call_warm     the same with the warm-up's first phase alone (FASTATTN_WARM_UP=libraries:
                cuDNN, its sub-libraries and the op library loaded in the background from
                the import on), the first call right away
  call_warm_idle  the same, the first call --idle-ms after the import (a server loading
                its model meanwhile; that wait is not counted)
  call_warm_up, call_warm_up_idle  the same two with the whole warm-up (FASTATTN_WARM_UP=
                plans: the cache's most recently used plans loaded too, once the
                process has a CUDA context, which here it has before the import); the _idle
                modes also record the host RSS and GPU memory the import and the warm-up
                added by the end of the idle (call_warm_up_idle less call_warm_idle: the
                plans')
  steps         the first call taken apart, each step alone and in the order the call
                meets them: the extension (_core), the op library, cuDNN's
                dependencies, libcuda, libcudnn, init_cudnn, cuDNN's graph sub-libraries
                (dlopen each), a first and a second cudnnCreate (ctypes; fastattn's own
                handle is made inside the plan load), the plan from the cache (read and
                deserialize; of which deserialization per fastattn.stats()), then
                attention()'s first and second call (synchronized)
  steps_natural the same without the sub-libraries' dlopen: cuDNN opens them itself at the
                first cudnnCreate, so that step shows what they cost in the natural order
  call_warm_up_idle_parts  call_warm_up_idle with the first call's parts done first, each
                timed alone: fastattn.plan() (the warm-up's plan claimed), PyTorch's
                allocations of the output and workspace, the plan's first raw launch on this
                thread; the first attention() call after them is fastattn.torch's own first
                call (not in the default --modes)
  call_warm_up_idle_eager  call_warm_up_idle with CUDA_MODULE_LOADING=EAGER: whether a plan's
                first launch (~2 ms after the warm-up loaded it) is the driver's lazy kernel
                loading (not in the default --modes: every module loads at the process's
                start, torch's included, before the clock)

    python benchmarks/profile_first_call.py [--json out.json] [--rounds 3] [--idle-ms 300] [--modes ...]

Needs a CUDA GPU (exit status 2 without).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time

import _common

DEFAULT_MODES = ("call", "call_warm", "call_warm_idle", "call_warm_up", "call_warm_up_idle", "steps", "steps_natural")
MODES = DEFAULT_MODES + ("call_warm_up_idle_eager", "call_warm_up_idle_parts")
# What each mode sets FASTATTN_WARM_UP to.
WARM_UP = {"call_warm": "libraries", "call_warm_idle": "libraries", "call_warm_up": "plans",
           "call_warm_up_idle": "plans", "call_warm_up_idle_eager": "plans", "call_warm_up_idle_parts": "plans"}
HEADS, HEAD_DIM = 32, 128
FIRST, SECOND = 256, 512


def child(mode: str, idle_ms: float) -> dict:
    steps = _common.Steps(3)
    mark = steps.mark

    import torch  # what a server has loaded already: not part of fastattn's cost

    torch.cuda.init()
    q, k, v = (torch.randn(1, FIRST, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q2, k2, v2 = (torch.randn(1, SECOND, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()
    before = _memory(torch)
    t_all = time.perf_counter()
    mark("torch import, CUDA context, inputs (not counted)")
    import fastattn

    mark("import fastattn")
    import fastattn.torch as fat

    mark("import fastattn.torch")
    res: dict = {"mode": mode}
    if "_idle" in mode:
        time.sleep(idle_ms / 1e3)
        mark(f"idle {idle_ms:g} ms (not counted)")
        # What the import and the warm-up's work meanwhile hold (the libraries; the plans
        # loaded), against the same process before the import: MB of host RSS and of GPU memory in use.
        after = _memory(torch)
        res["memory_after_idle_mb"] = {k: round(after[k] - before[k], 1) for k in after}
    if mode.startswith("steps"):
        from fastattn import _core, _loader  # noqa: F401 - the extension's load is the step
        from fastattn.torch import _native

        mark("import fastattn._core (the extension)")
        _native.library()
        res["op_library"] = _native.status()
        mark(f"op library ({_native.status().get('path')})")
        cudnn_path = _loader.ensure_loaded(on_step=mark).cudnn  # each loading step marked
        if mode == "steps":
            folder = os.path.dirname(cudnn_path)
            for name in fastattn._warm_up.CUDNN_SUBLIBRARIES:
                if os.path.exists(os.path.join(folder, name)):
                    ctypes.CDLL(os.path.join(folder, name))
                    mark(f"dlopen {name} ({os.path.getsize(os.path.join(folder, name)) >> 20} MiB)")
        lib = ctypes.CDLL(cudnn_path)
        h = ctypes.c_void_p()
        st = lib.cudnnCreate(ctypes.byref(h))
        mark(f"first cudnnCreate (status {st})")
        st = lib.cudnnCreate(ctypes.byref(h))
        mark(f"second cudnnCreate (status {st})")
        before = fastattn.stats()
        cfg = fastattn.AttentionConfig(batch=1, heads_q=HEADS, seqlen_q=FIRST, head_dim_qk=HEAD_DIM, dtype="bf16",
                                       layout="bshd", mask="causal")
        fastattn.plan(cfg)
        after = fastattn.stats()
        mark("plan from the cache (read, deserialize, fastattn's handle)")
        steps.append(("  of which deserialization (stats load_seconds)",
                      round((after["load_seconds"] - before["load_seconds"]) * 1e3, 3)))
    if mode.endswith("_parts"):
        # The warmed first call's parts, each alone, in the order the call meets them, so
        # that the call after them shows what is left: fastattn.torch's own first call.
        cfg = fastattn.AttentionConfig(batch=1, heads_q=HEADS, seqlen_q=FIRST, head_dim_qk=HEAD_DIM, dtype="bf16",
                                       layout="bshd", mask="causal")
        plan = fastattn.plan(cfg)
        mark("fastattn.plan(): the warm-up's plan, claimed (its record, its entry's last use)")
        o = torch.empty_like(q)
        ws = torch.empty(max(plan.workspace_size, 1), device="cuda", dtype=torch.uint8)
        mark("PyTorch's allocator: the output and the workspace")
        stream = torch.cuda.current_stream().cuda_stream
        plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), workspace=ws.data_ptr(), stream=stream)
        mark("plan.forward: the plan's first launch on this thread (host)")
        torch.cuda.synchronize()
        mark("its synchronize")
        plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), workspace=ws.data_ptr(), stream=stream)
        mark("plan.forward again (host)")
        torch.cuda.synchronize()
        del o, ws
    fat.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    mark(f"first attention() call, S={FIRST}, synchronized")
    fat.attention(q2, k2, v2, causal=True)
    torch.cuda.synchronize()
    mark(f"a second shape's first call, S={SECOND}")
    fat.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    mark(f"S={FIRST} again")
    counted = [ms for name, ms in steps if "not counted" not in name and not name.startswith("  ")]
    res.update(steps=steps, total_ms=round(sum(counted), 3),
               wall_ms=round((time.perf_counter() - t_all) * 1e3, 3),
               stats={key: val for key, val in fastattn.stats().items() if isinstance(val, (int, float))},
               path=_path(), warm_up=fastattn.stats().get("warm_up"))
    return res


def _memory(torch) -> dict:
    free, total = torch.cuda.mem_get_info()
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {"rss": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, "gpu": (total - free) / 2**20}


def _path() -> str | None:
    from fastattn.torch import _native

    return _native.status().get("path")


def table(results: dict[str, list[dict]]) -> list[str]:
    """One column per mode, one row per step name: the median over the rounds (ms)."""
    names: list[str] = []
    med: dict[str, dict[str, float]] = {}
    for mode, rows in results.items():
        per: dict[str, list[float]] = {}
        for r in rows:
            for name, ms in r.get("steps", []):
                if name not in names:
                    names.append(name)
                per.setdefault(name, []).append(ms)
            if "total_ms" in r:
                per.setdefault("total (counted steps)", []).append(r["total_ms"])
        med[mode] = {name: statistics.median(v) for name, v in per.items()}
    names.append("total (counted steps)")
    width = max(len(n) for n in names)
    lines = [f"{'step':<{width}} " + " ".join(f"{m:>15}" for m in results)]
    for name in names:
        cells = [med[m].get(name) for m in results]
        lines.append(f"{name:<{width}} " + " ".join(f"{c:15.2f}" if c is not None else f"{'':>15}" for c in cells))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=MODES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-ms", type=float, default=300.0)
    ap.add_argument("--modes", nargs="+", default=[",".join(DEFAULT_MODES)],
                    help=f"comma- or space-separated, of {','.join(MODES)}")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.idle_ms)))
        return 0
    modes = [m for item in args.modes for m in item.split(",") if m]
    if not modes or not set(modes) <= set(MODES):
        ap.error(f"--modes {' '.join(args.modes)!r}: some of {','.join(MODES)}")
    _common.require_cuda("profile_first_call.py")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import profile_coldstart

    cache_dir = tempfile.mkdtemp(prefix="fastattn-first-call-")
    t0 = time.perf_counter()
    profile_coldstart.fill(cache_dir)
    results: dict[str, list[dict]] = {m: [] for m in modes}
    errors = {}
    for order in _common.rotated(modes, args.rounds):
        for mode in order:
            env = _common.fresh_cache_env(cache_dir)
            env["FASTATTN_WARM_UP"] = WARM_UP.get(mode, "off")
            if mode.endswith("_eager"):
                env["CUDA_MODULE_LOADING"] = "EAGER"
            r = _common.fresh(os.path.abspath(__file__), ["--child", mode, "--idle-ms", str(args.idle_ms)], env)
            if "error" in r:
                errors[mode] = _common.first_error([r])
            else:
                results[mode].append(r)
    ok = {m: rows for m, rows in results.items() if rows}
    lines = table(ok) if ok else []
    for line in lines:
        print(line)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "uname": os.uname().release, "rounds": args.rounds,
                 "idle_ms": args.idle_ms, "seconds": time.perf_counter() - t0, "results": results,
                 "table": "\n" + "\n".join(lines)}
    for mode, rows in ok.items():
        res[f"{mode}_total_ms"] = statistics.median(r["total_ms"] for r in rows)
        firsts = [ms for r in rows for name, ms in r["steps"] if name.startswith("first attention()")]
        res[f"{mode}_first_call_ms"] = statistics.median(firsts)
        res[f"{mode}_plans"] = (f"builds {rows[0]['stats'].get('builds')}, loads "
                                f"{rows[0]['stats'].get('deserializations')}, {rows[0].get('path')} path")
        mems = [r["memory_after_idle_mb"] for r in rows if "memory_after_idle_mb" in r]
        if mems:
            res[f"{mode}_memory_after_idle_mb"] = {k: statistics.median(m[k] for m in mems) for k in mems[0]}
        warm = rows[0].get("warm_up") or {}
        if warm.get("state") not in (None, "off"):
            res[f"{mode}_warm_up"] = f"plans {warm.get('plans')}, state {warm.get('state')}"
    for mode, why in errors.items():
        res[f"{mode}_error"] = why
    return _common.report(res, args.json)


if __name__ == "__main__":
    sys.exit(main())
