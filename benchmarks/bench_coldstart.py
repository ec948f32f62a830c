"""Cold start: how long a fresh process takes to the first outputs of 8 prefill shapes.

Shapes: batch 1, 32 heads, head dim 128, bf16, causal, bshd, seqlen 256 ... 4096.
Each variant runs in its own fresh process; the time is from just before the first
attention call (CUDA context and inputs ready) until the outputs of all 8 shapes are
on the device (synchronized):

  fastattn cold   empty cache directory: every plan is built
  fastattn warm   the cache the cold run left: every plan is deserialized, lazily
  fastattn warm + preload   the same, with fastattn.preload(configs, threads=8) first
  fastattn torch warm (+ preload)   the warm cache through fastattn.torch.attention and
                  o.backward(): autograd, like with like beside PyTorch's rows (the rows
                  above are the raw plans on pointers); the active path (native or Python)
                  is recorded
  torch cudnn     torch.nn.functional.scaled_dot_product_attention, cuDNN backend
  torch flash     the same, flash backend
  fastattn cold/warm padded   one padding plan (config.padding=True) built for the
                  longest shape serves all 8, each call given its sequence's length;
                  buffers have the longest shape; outputs checked against PyTorch SDPA
                  after the clock stops (see child_padded)

each forward only and forward+backward. The autograd rows record each call's host ms;
with --backward, fastattn.torch and flash also run once more with their first backward
under cProfile (COLDSTART_PROFILE_FIRST_BACKWARD=1), to see where that time goes. After the clock stops, fastattn warm and
fastattn warm padded (forward) also time 20 back-to-back calls per shape (steady ms per
call: what serving length s from the 4096-long padded plan costs vs a plan of length s).
Usage:

    python benchmarks/bench_coldstart.py [--json out.json]     # on the GPU
    python benchmarks/bench_coldstart.py --plot out.json --png chart.png   # anywhere, needs matplotlib
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from _common import emit, require_cuda  # (benchmarks/ on sys.path)

SEQLENS = (256, 512, 768, 1024, 1536, 2048, 3072, 4096)
HEADS, HEAD_DIM = 32, 128


def _forward_call(p, q, k, v, o, ws, stream: int, seq_len: int = 0):
    """One forward of plan p on the given buffers, as the timed call made it (seq_len: the
    int32 device length a padding plan takes; 0 for a dense plan)."""
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())
    wsp = ws.data_ptr()
    return lambda: p.forward(*ptrs, workspace=wsp, stream=stream, seq_len_q=seq_len, seq_len_kv=seq_len)


def _steady_ms(call, warmup: int = 3, iters: int = 20) -> float:
    """GPU ms per call of `call`, back to back on the current stream (the timed calls' stream)."""
    import torch

    for _ in range(warmup):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    # The GPU spins (~5 ms) while the host queues the calls: the events then time the
    # kernels back to back, not the launch gaps a short kernel would leave.
    torch.cuda._sleep(10_000_000)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / iters, 4)


def _sdpa_reference(q, k, v, d_o=None) -> list:
    """Float32 PyTorch SDPA (math backend, causal) on bshd bf16 slices: [o] or [o, dq, dk, dv], bshd."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # SDPA takes (b, h, s, d); leaves of their own so that backward fills .grad.
    q32, k32, v32 = (x.float().transpose(1, 2).detach().requires_grad_(d_o is not None) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    if d_o is None:
        return [o.transpose(1, 2)]
    o.backward(d_o.float().transpose(1, 2))
    return [o.detach().transpose(1, 2)] + [x.grad.transpose(1, 2) for x in (q32, k32, v32)]


def _rel_error(out, ref) -> float:
    """||out - ref|| / ||ref||, Frobenius, in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def child_padded(variant: str, backward: bool) -> dict:
    """One padding plan (config.padding) built for the longest shape serves all 8: each
    call passes its sequence's length. q, k, v and d_o are longest-shape buffers
    allocated before the clock starts, so that rows past a sequence's length are
    memory the plan may touch (finite values: cuDNN reads the padded rows of its last
    tile). After the clock stops, each shape's outputs are checked against PyTorch SDPA
    on the dense slices, and (warm, forward) the steady cost per call is timed."""
    import torch

    torch.cuda.init()
    smax = max(SEQLENS)

    q, k, v, d_o = (torch.randn(1, smax, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    lengths = {s: torch.tensor([s], dtype=torch.int32, device="cuda") for s in SEQLENS}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    import fastattn

    t_import = time.perf_counter()
    cfg = fastattn.AttentionConfig(batch=1, heads_q=HEADS, seqlen_q=smax, head_dim_qk=HEAD_DIM, dtype="bf16",
                                   layout="bshd", mask="causal", training=backward, padding=True)
    stream = torch.cuda.current_stream().cuda_stream
    plan_ms = []
    # A server's loop: each call's outputs are dropped (or reused) before the next, so
    # the caching allocator hands the same blocks back; the check after the clock
    # re-runs every shape into buffers of its own.
    for s in SEQLENS:
        t_a = time.perf_counter()
        p = fastattn.plan(cfg)
        plan_ms.append(round((time.perf_counter() - t_a) * 1e3, 2))
        o = torch.empty_like(q)
        ws = torch.empty(p.workspace_size, dtype=torch.uint8, device="cuda")
        n = lengths[s].data_ptr()
        if backward:
            stats = torch.empty(1, HEADS, smax, 1, dtype=torch.float32, device="cuda")
            p.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats=stats.data_ptr(),
                      workspace=ws.data_ptr(), stream=stream, seq_len_q=n, seq_len_kv=n)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            p.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(),
                       dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), workspace=ws.data_ptr(), stream=stream,
                       seq_len_q=n, seq_len_kv=n)
        else:
            p.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), workspace=ws.data_ptr(),
                      stream=stream, seq_len_q=n, seq_len_kv=n)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    st = fastattn.stats()
    res = {"seconds": elapsed, "builds": st["builds"], "disk_hits": st["disk_hits"],
           "import_seconds": t_import - t0, "plan_ms": plan_ms}

    # The clock has stopped. Correctness: each shape again, into NaN-filled outputs
    # (same plan, inputs, lengths, workspace, stream): rows [:, :s] against float32
    # SDPA on the dense slices, with the same d_o rows as upstream gradient; rows past
    # s must be exactly zero. (p and ws are the last shape's: one config, one plan.)
    names = ("o", "dq", "dk", "dv") if backward else ("o",)
    max_err, zero = 0.0, dict.fromkeys(names, True)
    outs = []
    for s in SEQLENS:
        n = lengths[s].data_ptr()
        again = [torch.full_like(q, float("nan")) for _ in names]
        if backward:
            stats = torch.empty(1, HEADS, smax, 1, dtype=torch.float32, device="cuda")
            p.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), again[0].data_ptr(), stats=stats.data_ptr(),
                      workspace=ws.data_ptr(), stream=stream, seq_len_q=n, seq_len_kv=n)
            p.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), again[0].data_ptr(), d_o.data_ptr(),
                       stats.data_ptr(), again[1].data_ptr(), again[2].data_ptr(), again[3].data_ptr(),
                       workspace=ws.data_ptr(), stream=stream, seq_len_q=n, seq_len_kv=n)
        else:
            _forward_call(p, q, k, v, again[0], ws, stream, n)()
        ref = _sdpa_reference(q[:, :s], k[:, :s], v[:, :s], d_o[:, :s] if backward else None)
        for name, out, r in zip(names, again, ref):
            max_err = max(max_err, _rel_error(out[:, :s], r))
            # != 0 so that NaN (an unwritten row) counts as not zero.
            zero[name] = zero[name] and not (out[:, s:] != 0).any().item()
        outs.append(again[0])
        del again, ref
    res.update({"max_rel_error": max_err, "padded_rows_zero": all(zero.values()),
                "padded_rows_zero_by_tensor": zero})

    if variant == "fastattn_warm_padded" and not backward:
        res["steady_ms"] = {str(s): _steady_ms(_forward_call(p, q, k, v, out, ws, stream, lengths[s].data_ptr()))
                            for s, out in zip(SEQLENS, outs)}
    return res


def child(variant: str, backward: bool) -> dict:
    """Runs in the fresh process."""
    if variant.endswith("_padded"):
        return child_padded(variant, backward)
    import torch

    torch.cuda.init()
    inputs = []
    for s in SEQLENS:
        q, k, v = (torch.randn(1, s, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                               requires_grad=backward) for _ in range(3))
        inputs.append((q, k, v))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if variant.startswith("fastattn") and not variant.startswith("fastattn_torch"):  # the raw plans
        import fastattn
        from fastattn._loader import ensure_loaded

        t_import = time.perf_counter()
        ensure_loaded()  # timed apart: loading cuDNN and its dependencies
        t_libs = time.perf_counter()
        configs = [fastattn.AttentionConfig(batch=1, heads_q=HEADS, seqlen_q=s, head_dim_qk=HEAD_DIM, dtype="bf16",
                                            layout="bshd", mask="causal", training=backward) for s in SEQLENS]
        if variant == "fastattn_warm_preload":
            fastattn.preload(configs, threads=len(configs))
        t_plans = time.perf_counter()
        plan_ms = []  # per shape: fastattn.plan() (lookup, load or build), then its first run
        run_ms = []
        steady = variant == "fastattn_warm" and not backward
        kept = []  # per shape when steady: the timed call's plan and buffers, timed again after the clock
        for (q, k, v), s, cfg in zip(inputs, SEQLENS, configs):
            t_a = time.perf_counter()
            p = fastattn.plan(cfg)
            t_b = time.perf_counter()
            plan_ms.append(round((t_b - t_a) * 1e3, 2))
            o = torch.empty_like(q)
            ws = torch.empty(p.workspace_size, dtype=torch.uint8, device="cuda")
            stream = torch.cuda.current_stream().cuda_stream
            if backward:
                stats = torch.empty(1, HEADS, s, 1, dtype=torch.float32, device="cuda")
                p.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats=stats.data_ptr(),
                          workspace=ws.data_ptr(), stream=stream)
                d_o = torch.ones_like(o)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                p.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(),
                           dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), workspace=ws.data_ptr(), stream=stream)
            else:
                p.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), workspace=ws.data_ptr(),
                          stream=stream)
                if steady:
                    kept.append((p, q, k, v, o, ws, stream))
            run_ms.append(round((time.perf_counter() - t_b) * 1e3, 2))
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        s = fastattn.stats()
        res = {"seconds": elapsed, "builds": s["builds"], "disk_hits": s["disk_hits"],
               "import_seconds": t_import - t0, "libraries_seconds": t_libs - t_import,
               "preload_seconds": t_plans - t_libs, "plan_ms": plan_ms, "run_ms": run_ms,
               "load_seconds": s["load_seconds"], "build_seconds": s["build_seconds"]}
        if steady:  # after the clock: the dense plans' cost per call, to set against the padded plan's
            res["steady_ms"] = {str(seqlen): _steady_ms(_forward_call(*args))
                                for seqlen, args in zip(SEQLENS, kept)}
        return res
    if variant.startswith("fastattn_torch"):
        # Through fastattn.torch (autograd, the path a training loop takes), like with like
        # beside PyTorch's rows: the same calls, o.backward(ones).
        import fastattn
        import fastattn.torch as fat
        from fastattn.torch import _native

        if variant == "fastattn_torch_warm_preload":
            fastattn.preload([fastattn.AttentionConfig(batch=1, heads_q=HEADS, seqlen_q=s, head_dim_qk=HEAD_DIM,
                                                       dtype="bf16", layout="bshd", mask="causal", training=backward)
                              for s in SEQLENS], threads=len(SEQLENS))

        def call(q, k, v):
            return fat.attention(q, k, v, causal=True)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.CUDNN_ATTENTION if variant == "torch_cudnn" else SDPBackend.FLASH_ATTENTION
        sdpa_kernel(backend).__enter__()

        def call(q, k, v):
            # SDPA takes (b, h, s, d): transposed views of the same bshd memory.
            return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                    v.transpose(1, 2), is_causal=True)
    # Host time of each call (no synchronization in between: a cost shows where the host
    # pays it, as in an application); the first backward optionally under cProfile.
    fwd_ms, bwd_ms, profile = [], [], None
    for i, (q, k, v) in enumerate(inputs):
        t_a = time.perf_counter()
        o = call(q, k, v)
        t_b = time.perf_counter()
        if backward:
            if i == 0 and os.environ.get("COLDSTART_PROFILE_FIRST_BACKWARD"):
                profile = _profiled(lambda: o.backward(torch.ones_like(o)))
            else:
                o.backward(torch.ones_like(o))
        fwd_ms.append(round((t_b - t_a) * 1e3, 2))
        bwd_ms.append(round((time.perf_counter() - t_b) * 1e3, 2))
    torch.cuda.synchronize()
    res = {"seconds": time.perf_counter() - t0, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms}
    if variant.startswith("fastattn_torch"):
        res["path"] = _native.status()["path"]
        res["stats"] = {k: v for k, v in fastattn.stats().items() if isinstance(v, (int, float))}
    if profile:
        res["first_backward_profile"] = profile
    return res


def _profiled(fn) -> list[str]:
    """fn() under cProfile: the 25 entries with the most cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    return out.getvalue().splitlines()


def run_fresh(variant: str, backward: bool, cache_dir: str, **extra_env) -> dict:
    """One variant in a fresh process on cache_dir (see child)."""
    from _common import fresh  # (benchmarks/ is on sys.path)

    return fresh(__file__, ["--child", variant] + (["--backward"] if backward else []),
                 {"FASTATTN_CACHE_DIR": cache_dir, **extra_env})


def first_outputs(cache_dir: str, rounds: int = 3) -> dict:
    """The issue's first criterion: time to the first outputs of the 8 prefill shapes
    (forward) in a fresh process whose cache is warm, through fastattn.torch without a
    separate preload, beside SDPA's flash backend, in `rounds` interleaved rounds of fresh
    processes. Fills cache_dir first (a cold raw-plan process builds the 8 plans) where
    it has none. Returns the rows of each round and the medians (ms)."""
    import statistics

    out: dict = {"fill": run_fresh("fastattn_cold", False, cache_dir)}
    for _ in range(rounds):
        for name in ("fastattn_torch_warm", "torch_flash"):
            out.setdefault(name, []).append(run_fresh(name, False, cache_dir))
    for name in ("fastattn_torch_warm", "torch_flash"):
        ms = [r["seconds"] * 1e3 for r in out[name] if "seconds" in r]
        out[name + "_ms"] = statistics.median(ms) if ms else None
        firsts = [r["fwd_ms"][0] for r in out[name] if r.get("fwd_ms")]
        out[name + "_first_call_ms"] = statistics.median(firsts) if firsts else None
    return out


def first_outputs_summary(fo: dict) -> str:
    ours, flash = fo.get("fastattn_torch_warm_ms"), fo.get("torch_flash_ms")
    lines = [f"first outputs of the 8 shapes, median of {len(fo.get('torch_flash', []))} rounds: fastattn.torch "
             f"(warm cache, no preload call) {ours if ours is None else round(ours, 1)} ms, SDPA flash "
             f"{flash if flash is None else round(flash, 1)} ms"]
    if ours and flash:
        lines.append(f"fastattn.torch / SDPA flash: {ours / flash:.2f} (target: <= 1.5)")
    for name in ("fastattn_torch_warm", "torch_flash"):
        for r in fo.get(name, []):
            lines.append(f"  {name}: " + (f"fwd ms per shape {r['fwd_ms']}" if "fwd_ms" in r
                                           else f"failed: {str(r.get('error'))[-200:]}"))
    return "\n".join(lines)


def measure() -> dict:
    results: dict = {"date": time.strftime("%Y-%m-%d"), "seqlens": SEQLENS, "heads": HEADS, "head_dim": HEAD_DIM}
    for backward in (False, True):
        mode = "fwd_bwd" if backward else "fwd"
        cache_dir = tempfile.mkdtemp(prefix="fastattn-coldstart-")
        results[mode] = {
            "fastattn_cold": run_fresh("fastattn_cold", backward, cache_dir),
            "fastattn_warm": run_fresh("fastattn_warm", backward, cache_dir),
            "fastattn_warm_preload": run_fresh("fastattn_warm_preload", backward, cache_dir),
            "fastattn_torch_warm": run_fresh("fastattn_torch_warm", backward, cache_dir),
            "fastattn_torch_warm_preload": run_fresh("fastattn_torch_warm_preload", backward, cache_dir),
            "torch_cudnn": run_fresh("torch_cudnn", backward, cache_dir),
            "torch_flash": run_fresh("torch_flash", backward, cache_dir),
            "fastattn_cold_padded": run_fresh("fastattn_cold_padded", backward, cache_dir),
            "fastattn_warm_padded": run_fresh("fastattn_warm_padded", backward, cache_dir),
        }
        if backward:  # diagnosis only (not charted): where a first backward's time goes
            for name in ("fastattn_torch_warm", "torch_flash"):
                results[mode][name + "_profiled"] = run_fresh(name, backward, cache_dir,
                                                              COLDSTART_PROFILE_FIRST_BACKWARD="1")
        r = results[mode]
        for warm in ("fastattn_warm", "fastattn_warm_preload", "fastattn_warm_padded", "fastattn_torch_warm",
                     "fastattn_torch_warm_preload"):
            if all("seconds" in r[k] for k in (warm, "torch_cudnn")):
                results[f"{mode}_speedup_{warm}_vs_torch_cudnn"] = r["torch_cudnn"]["seconds"] / r[warm]["seconds"]
    import fastattn

    results["device"] = fastattn.device_info()
    results["versions"] = fastattn.versions()
    return results


def summary(results: dict) -> str:
    lines = ["variant                    fwd ms   fwd+bwd ms"]
    for name in ("fastattn_cold", "fastattn_warm", "fastattn_warm_preload", "fastattn_torch_warm",
                 "fastattn_torch_warm_preload", "torch_cudnn", "torch_flash", "fastattn_cold_padded",
                 "fastattn_warm_padded"):
        cells = []
        for mode in ("fwd", "fwd_bwd"):
            r = results[mode].get(name, {})
            cells.append(f"{r['seconds'] * 1e3:10.1f}" if "seconds" in r else ("     error" if r else "       n/a"))
        lines.append(f"{name:<21} {cells[0]} {cells[1]}")
    for key, value in results.items():
        if "_speedup_" in key:
            lines.append(f"{key}: {value:.1f}x")
    for name in ("fastattn_torch_warm", "fastattn_torch_warm_preload", "torch_cudnn", "torch_flash"):
        r = results.get("fwd_bwd", {}).get(name, {})
        if "bwd_ms" in r:
            lines.append(f"{name} fwd+bwd per shape: fwd ms {r['fwd_ms']}, bwd ms {r['bwd_ms']}"
                         + (f" ({r['path']} path)" if "path" in r else ""))
    for name in ("fastattn_cold_padded", "fastattn_warm_padded"):
        for mode in ("fwd", "fwd_bwd"):
            r = results.get(mode, {}).get(name, {})
            if "max_rel_error" in r:
                bad = [n for n, ok in r.get("padded_rows_zero_by_tensor", {}).items() if not ok]
                lines.append(f"{name} {mode}: max_rel_error {r['max_rel_error']:.2e} vs SDPA, padded_rows_zero "
                             f"{r['padded_rows_zero']}" + (f" (not: {', '.join(bad)})" if bad else ""))
    dense = results.get("fwd", {}).get("fastattn_warm", {}).get("steady_ms")
    padded = results.get("fwd", {}).get("fastattn_warm_padded", {}).get("steady_ms")
    if dense or padded:
        dense, padded = dense or {}, padded or {}
        lines += ["steady ms per call, dense vs padded (forward)", "  seqlen     dense    padded  padded/dense"]
        for s in SEQLENS:
            d, p = dense.get(str(s)), padded.get(str(s))
            ratio = f"{p / d:10.2f}x" if d and p else "       n/a"
            lines.append(f"  {s:6d} {d if d is not None else float('nan'):9.3f} "
                         f"{p if p is not None else float('nan'):9.3f}  {ratio}")
    return "\n".join(lines)


def _first_backward_extra_ms(row: dict) -> float:
    """How much longer the first backward took than the median later one (0 without per-call times)."""
    bwd = row.get("bwd_ms") or []
    if len(bwd) < 2:
        return 0.0
    later = sorted(bwd[1:])
    return max(0.0, bwd[0] - later[len(later) // 2])


def plot(results: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("fastattn_cold", "fastattn_warm", "fastattn_warm_preload", "fastattn_warm_padded",
                         "fastattn_torch_warm", "fastattn_torch_warm_preload", "torch_cudnn", "torch_flash")
             if n in results["fwd"]]
    # Raw: plan.forward / plan.backward on pointers; autograd: fastattn.torch.attention
    # and o.backward(), as PyTorch's rows are.
    labels = {"fastattn_cold": "raw plans\ncold cache", "fastattn_warm": "raw plans\nwarm cache",
              "fastattn_warm_preload": "raw plans\nwarm+preload", "fastattn_warm_padded": "raw plans\n1 padded",
              "fastattn_torch_warm": "fastattn.torch\nautograd, warm",
              "fastattn_torch_warm_preload": "fastattn.torch\nwarm+preload",
              "torch_cudnn": "PyTorch\ncuDNN", "torch_flash": "PyTorch\nflash"}
    fig, ax = plt.subplots(figsize=(11, 4.8))
    width = 0.38
    for i, mode in enumerate(("fwd", "fwd_bwd")):
        vals = [results[mode][n].get("seconds", 0) * 1e3 for n in names]
        xs = [x + (i - 0.5) * width for x in range(len(names))]
        bars = ax.bar(xs, vals, width, label="forward" if mode == "fwd" else "forward + backward")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        if mode == "fwd_bwd":
            # The autograd rows' first backward beyond a later one's: PyTorch's own
            # first-backward cost (its sympy import), hatched.
            extra = [_first_backward_extra_ms(results[mode][n]) for n in names]
            ax.bar(xs, extra, width, fill=False, hatch="//", edgecolor="black", linewidth=0,
                   label="of which PyTorch's first backward (its sympy import)")
    ax.set_xticks(range(len(names)), [labels[n] for n in names])
    ax.set_ylabel("ms to first outputs of 8 shapes")
    dev = results.get("device", {}).get("name", "GPU")
    ax.set_title(f"Cold start, 8 prefill shapes (1x32xSx128 bf16 causal), {dev}, {results['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--plot", help="draw the chart from this JSON instead of measuring")
    ap.add_argument("--png", default="docs/coldstart.png")
    ap.add_argument("--first-outputs", action="store_true",
                    help="only the 8 shapes' first outputs through fastattn.torch (warm cache, no preload call) "
                         "beside SDPA flash, --rounds interleaved rounds (the cold-start target)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.child:
        print(json.dumps(child(args.child, args.backward)))
        return 0
    if args.plot:  # (anywhere: no GPU needed)
        with open(args.plot) as f:
            plot(json.load(f), args.png)
        return 0
    require_cuda("bench_coldstart.py")
    if args.first_outputs:
        fo = first_outputs(tempfile.mkdtemp(prefix="fastattn-first-outputs-"), args.rounds)
        emit({"date": time.strftime("%Y-%m-%d"), "seqlens": SEQLENS, "first_outputs": fo}, args.json,
             first_outputs_summary(fo).splitlines())
        return 0
    results = measure()
    emit(results, args.json, summary(results).splitlines())
    return 0


if __name__ == "__main__":
    sys.exit(main())
