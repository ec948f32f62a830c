"""Core runtime benchmarks, fastattn side by side with its peers in one process.

(a) Host time per forward call on a small shape (default 1x8x128x64 bf16 causal):
    fastattn plan.forward on ints, on plan.allocate's DeviceTensors and on torch
    tensors (the checked path), and PyTorch scaled_dot_product_attention with its cuDNN
    and flash backends (when torch is installed). Then the C++ floor, forward and
    backward, each looped in C++ on the same plan (fastattn._core.bench_execute): fastattn's
    C++ execute (checks, device, stream, launch: a CUDA graph replay once a launch
    repeats; "packs only" with replays off) against cudnn-frontend's cheapest
    execute (sorted pointers, nothing around it) and its uid-map execute (the map
    built per call, as its samples and PyTorch's cuDNN attention do).
(b) Build time per new config, forward and backward, after the process's first
    build: fastattn against cudnn-frontend's Python API building the same graph
    (when the `cudnn` module is importable) and PyTorch's first call on a new shape.

Reported as ratios; nothing is asserted. Usage:
    python benchmarks/bench_core.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


import fastattn
from fastattn import AttentionConfig
from fastattn._loader import import_core  # (at use: a checkout without its extension still says it needs a GPU)
from _common import emit, require_cuda  # (benchmarks/ on sys.path)


def _cuda():
    from cuda.bindings import runtime as rt

    return rt


def _check(res):
    if int(res[0]) != 0:
        raise RuntimeError(f"CUDA error {res[0]}")
    return res[1] if len(res) > 1 else None


def _sync():
    _check(_cuda().cudaDeviceSynchronize())


def _alloc(nbytes):
    ptr = int(_check(_cuda().cudaMalloc(max(nbytes, 16))))
    _check(_cuda().cudaMemset(ptr, 0, max(nbytes, 16)))
    return ptr


# The held C++ loops: this many calls, queued behind a sleep kernel of this many cycles
# (~20 ms at the H200's 1.98 GHz), within CUDA's launch queue (a backward is 3-4 launches).
HELD_ITERS = 100
LAYERS = 32  # the layered C++ loops: a 32-layer model's calls, each layer its own tensors
HELD_SLEEP_CYCLES = 40_000_000


def _loop_us(fn, iters: int) -> float:
    """Wall time of `iters` back-to-back calls / iters, in microseconds. Where the GPU
    runs a call in about the host's time (1x8x128x64: ~6.6 us on the H200), this is
    the slower of the two; the held C++ loops below time the host alone."""
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    us = (time.perf_counter() - t0) / iters * 1e6
    _sync()
    return us


def bench_host_overhead(args) -> dict:
    cfg = AttentionConfig(batch=args.batch, heads_q=args.heads, seqlen_q=args.seqlen, head_dim_qk=args.head_dim,
                          dtype="bf16", mask="causal")
    p = fastattn.plan(cfg)
    tp = fastattn.plan(cfg.replace(training=True))  # backward's floor
    q = _alloc(cfg.storage_elements("q") * 2)
    k = _alloc(cfg.storage_elements("k") * 2)
    v = _alloc(cfg.storage_elements("v") * 2)
    o = _alloc(cfg.storage_elements("o") * 2)
    ws = _alloc(max(p.workspace_size, tp.workspace_size))
    grads = {n: _alloc(cfg.storage_elements(n) * 2) for n in ("d_o", "d_q", "d_k", "d_v")}
    stats = _alloc(cfg.storage_elements("stats") * 4)
    stream = int(_check(_cuda().cudaStreamCreate()))
    iters = args.iters
    fwd = dict(q=q, k=k, v=v, o=o)
    bwd = dict(fwd, stats=stats, **grads)

    def cpp(plan, direction, mode, tensors):
        def run():
            _sync()
            return import_core().bench_execute(plan, direction, mode, iters, ws, stream, **tensors) / iters * 1e6
        return run

    held_valid = {}  # variant -> rounds whose loop ended with the GPU still held

    # A model's worth of layers, each with its own tensors (one buffer per tensor, a layer
    # every layer_bytes): a cache keyed by pointers must earn its keep here, not only on
    # one pointer set called again and again.
    layer_bytes = (max(cfg.storage_elements(n) * (4 if n == "stats" else 2) for n in bwd) + 255) // 256 * 256
    layered = {n: _alloc(layer_bytes * LAYERS) for n in bwd}
    layered_fwd = {n: layered[n] for n in fwd}

    def cpp_held(name, plan, direction, mode, tensors, layers=1):
        """The C++ loop's host time alone: its launches queue behind a sleep kernel on the
        same stream (torch's, where torch is installed), so the loop never waits for the
        GPU; valid while the sleep still runs when the loop ends. With `layers`, call i
        runs layer i % layers of the layered tensors."""
        import torch

        held = torch.cuda.ExternalStream(stream)
        held_valid[name] = 0

        def run():
            _sync()
            with torch.cuda.stream(held):
                torch.cuda._sleep(HELD_SLEEP_CYCLES)
                asleep = torch.cuda.Event()
                asleep.record()
            us = import_core().bench_execute(plan, direction, mode, HELD_ITERS, ws, stream, layers=layers,
                                     layer_bytes=layer_bytes if layers > 1 else 0, **tensors) / HELD_ITERS * 1e6
            held_valid[name] += not asleep.query()
            _sync()
            return us
        return run

    # The checked path: the same call on plan.allocate's DeviceTensors.
    arr = {n: p.allocate(n) for n in ("q", "k", "v", "o")}
    arr_ws = p.allocate("workspace")
    variants = {
        "fastattn_plan_forward_us": lambda: _loop_us(lambda: p.forward(q, k, v, o, 0, ws, stream), iters),
        "fastattn_plan_forward_device_tensors_us": lambda: _loop_us(
            lambda: p.forward(arr["q"], arr["k"], arr["v"], arr["o"], 0, arr_ws, stream), iters),
        # The C++ floor, each looped in C++ on the same plan.
        "fastattn_cpp_execute_us": cpp(p, "forward", "fastattn", fwd),
        "cudnn_frontend_cpp_execute_us": cpp(p, "forward", "frontend_sorted", fwd),
        "cudnn_frontend_uid_map_execute_us": cpp(p, "forward", "frontend_uid_map", fwd),
        "cudnn_frontend_preamble_execute_us": cpp(p, "forward", "frontend_sorted_preamble", fwd),
        "fastattn_cpp_execute_bwd_us": cpp(tp, "backward", "fastattn", bwd),
        "cudnn_frontend_cpp_execute_bwd_us": cpp(tp, "backward", "frontend_sorted", bwd),
        "cudnn_frontend_uid_map_execute_bwd_us": cpp(tp, "backward", "frontend_uid_map", bwd),
        "cudnn_frontend_preamble_execute_bwd_us": cpp(tp, "backward", "frontend_sorted_preamble", bwd),
    }
    res = {"shape": f"{args.batch}x{args.heads}x{args.seqlen}x{args.head_dim} bf16 causal", "engine": p.forward_engine,
           "iters_per_sample": iters, "samples": args.repeats}
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    if torch is not None:
        shape = (args.batch, args.heads, args.seqlen, args.head_dim)
        tq, tk, tv = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def torch_variant(backend):
            def run():
                with sdpa_kernel(backend):
                    return _loop_us(lambda: sdpa(tq, tk, tv, is_causal=True), iters)
            return run

        # The checked path on torch tensors (read through their attributes), bshd memory as the
        # config's, passed as (batch, head, seq, dim) views: the order taken for every shape (the
        # (batch, seq, head, dim) tensors themselves are refused where seqlen == heads). The
        # workspace a torch tensor too, as a torch caller's would be.
        xq, xk, xv, xo = (torch.empty((args.batch, args.seqlen, args.heads, args.head_dim), device="cuda",
                                      dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
        xws = torch.empty(max(p.workspace_size, 1), dtype=torch.uint8, device="cuda")
        variants["fastattn_plan_forward_torch_tensors_us"] = lambda: _loop_us(
            lambda: p.forward(xq, xk, xv, xo, 0, xws, stream), iters)
        for mode in ("fastattn", "fastattn_packs_only", "frontend_sorted", "frontend_uid_map",
                     "frontend_sorted_preamble"):
            for direction, plan, tensors in (("forward", p, fwd), ("backward", tp, bwd)):
                name = f"held_{mode}_{direction}_us"
                variants[name] = cpp_held(name, plan, direction, mode, tensors)
        for mode in ("fastattn", "fastattn_packs_only", "frontend_sorted", "frontend_sorted_preamble"):
            for direction, plan, tensors in (("forward", p, layered_fwd), ("backward", tp, layered)):
                name = f"held_{mode}_{direction}_{LAYERS}layers_us"
                variants[name] = cpp_held(name, plan, direction, mode, tensors, LAYERS)
        variants["torch_sdpa_cudnn_us"] = torch_variant(SDPBackend.CUDNN_ATTENTION)
        variants["torch_sdpa_flash_us"] = torch_variant(SDPBackend.FLASH_ATTENTION)
        res["torch"] = torch.__version__
    for fn in variants.values():  # warm-up: first calls, lazy loads, clocks
        fn()
    held_valid.update(dict.fromkeys(held_valid, 0))  # the warm-up's rounds do not count
    # Interleaved, so that drift (clocks, other load) hits every variant alike.
    samples = {name: [] for name in variants}
    # Each round in a new order (seeded): a fixed order gives each variant the same
    # neighbour every round, and one variant's leftovers (caches, clocks) bias the next.
    order, rng = list(variants.items()), random.Random(17)
    for _ in range(args.repeats):
        rng.shuffle(order)
        for name, fn in order:
            samples[name].append(fn())
    for name, vals in samples.items():
        res[name] = statistics.median(vals)
        res[name.replace("_us", "_spread_us")] = [min(vals), max(vals)]
    floor_us = res["cudnn_frontend_cpp_execute_us"]
    res["ratio_fastattn_to_cpp_floor"] = res["fastattn_plan_forward_us"] / floor_us
    # The bar: the C++ execute at most 1.0x cudnn-frontend's own on the same plan.
    for sfx in ("", "_bwd"):
        ours = res[f"fastattn_cpp_execute{sfx}_us"]
        res[f"ratio_cpp_execute_to_frontend_sorted{sfx}"] = ours / res[f"cudnn_frontend_cpp_execute{sfx}_us"]
        res[f"ratio_cpp_execute_to_frontend_uid_map{sfx}"] = ours / res[f"cudnn_frontend_uid_map_execute{sfx}_us"]
        # The same launches with the device, handle and stream set per call, as a caller
        # of cudnn-frontend sets them: what fastattn's pointer checks cost on their own.
        res[f"ratio_cpp_execute_to_frontend_preamble{sfx}"] = ours / res[f"cudnn_frontend_preamble_execute{sfx}_us"]
    if held_valid:  # the same bar on host time alone (the GPU held)
        res["held_valid_rounds"] = dict(held_valid)
        for direction in ("forward", "backward"):
            ours = res[f"held_fastattn_{direction}_us"]
            for mode in ("fastattn_packs_only", "frontend_sorted", "frontend_uid_map", "frontend_sorted_preamble"):
                res[f"ratio_held_{direction}_fastattn_to_{mode}"] = ours / res[f"held_{mode}_{direction}_us"]
            ours = res[f"held_fastattn_{direction}_{LAYERS}layers_us"]
            for mode in ("fastattn_packs_only", "frontend_sorted", "frontend_sorted_preamble"):
                res[f"ratio_held_{direction}_{LAYERS}layers_fastattn_to_{mode}"] = (
                    ours / res[f"held_{mode}_{direction}_{LAYERS}layers_us"])
    # The bar: the checked path at most a few microseconds over the int path.
    for k in ("device_tensors", "torch_tensors"):
        if f"fastattn_plan_forward_{k}_us" in res:
            res[f"checked_{k}_extra_us"] = res[f"fastattn_plan_forward_{k}_us"] - res["fastattn_plan_forward_us"]
    if "torch_sdpa_cudnn_us" in res:
        res["ratio_fastattn_to_torch_cudnn"] = res["fastattn_plan_forward_us"] / res["torch_sdpa_cudnn_us"]
    return res


def _frontend_build_ms(cfg: AttentionConfig, backward: bool) -> float | None:
    """cudnn-frontend's Python API building the same graph (bhsd layout, causal)."""
    try:
        import cudnn
    except ImportError:
        return None
    handle = _frontend_build_ms.handle = getattr(_frontend_build_ms, "handle", None) or cudnn.create_handle()
    b, h, s, d = cfg.batch, cfg.heads_q, cfg.seqlen_q, cfg.head_dim_qk
    dims, strides = [b, h, s, d], [h * s * d, s * d, d, 1]
    t0 = time.perf_counter()
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    q = g.tensor(dim=dims, stride=strides, data_type=cudnn.data_type.BFLOAT16)
    k = g.tensor(dim=dims, stride=strides, data_type=cudnn.data_type.BFLOAT16)
    v = g.tensor(dim=dims, stride=strides, data_type=cudnn.data_type.BFLOAT16)
    if not backward:
        o, stats = g.sdpa(q=q, k=k, v=v, generate_stats=False, attn_scale=cfg.scale,
                          diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT)
        o.set_output(True).set_dim(dims).set_stride(strides)
    else:
        o = g.tensor(dim=dims, stride=strides, data_type=cudnn.data_type.BFLOAT16)
        d_o = g.tensor(dim=dims, stride=strides, data_type=cudnn.data_type.BFLOAT16)
        st = g.tensor(dim=[b, h, s, 1], stride=[h * s, s, 1, 1], data_type=cudnn.data_type.FLOAT)
        dq, dk, dv = g.sdpa_backward(q=q, k=k, v=v, o=o, dO=d_o, stats=st, attn_scale=cfg.scale,
                                     diagonal_band_right_bound=0,
                                     diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT)
        for t in (dq, dk, dv):
            t.set_output(True).set_dim(dims).set_stride(strides)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return (time.perf_counter() - t0) * 1e3


def bench_build(args) -> dict:
    # The first build in a process pays cuDNN's one-time initialization (~1.6 s): do it
    # first, for each peer, and time later builds of new shapes only.
    warm = AttentionConfig(batch=1, heads_q=32, seqlen_q=64, head_dim_qk=128, dtype="bf16", mask="causal",
                           layout="bhsd", training=True)
    # refresh=True: a build, never a load from a cache an earlier run on this machine
    # left (a run once timed 1.9 ms "builds" that were loads).
    t0 = time.perf_counter()
    fastattn.probe(warm, refresh=True)
    first = time.perf_counter() - t0
    fe_error = None
    try:
        have_fe = _frontend_build_ms(warm, False) is not None
        if have_fe:
            _frontend_build_ms(warm, True)
    except Exception as e:  # the peer's API differs between versions: report, don't abort
        have_fe, fe_error = False, f"{type(e).__name__}: {e}"
    rows = []
    for s in args.build_seqlens:
        cfg = warm.replace(seqlen_q=s)
        fastattn.probe(cfg, refresh=True)
        p = fastattn.plan(cfg)  # the plan that build made, from memory
        row = {"seqlen": s, "fastattn_fwd_ms": p.forward_ms, "fastattn_bwd_ms": p.backward_ms}
        if have_fe:
            row["frontend_fwd_ms"] = _frontend_build_ms(cfg, False)
            row["frontend_bwd_ms"] = _frontend_build_ms(cfg, True)
        rows.append(row)
    out = {"first_build_in_process_s": first, "rows": rows, "frontend_error": fe_error}
    keys = [k for k in rows[0] if k != "seqlen"]
    out["median"] = {k: statistics.median(r[k] for r in rows) for k in keys}
    if have_fe:
        m = out["median"]
        out["ratio_fwd_fastattn_to_frontend"] = m["fastattn_fwd_ms"] / m["frontend_fwd_ms"]
        out["ratio_bwd_fastattn_to_frontend"] = m["fastattn_bwd_ms"] / m["frontend_bwd_ms"]
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return out
    first_call = []
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for s in [64] + list(args.build_seqlens):
            x = [torch.randn(1, 32, s + 1, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                 for _ in range(3)]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True)
            y.sum().backward()
            torch.cuda.synchronize()
            first_call.append((time.perf_counter() - t0) * 1e3)
    out["torch_cudnn_first_fwd_bwd_call_ms_median"] = statistics.median(first_call[1:])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--build-seqlens", type=int, nargs="+", default=[192, 320, 448, 576, 704, 832, 960, 1088])
    ap.add_argument("--json", help="write the full results here")
    args = ap.parse_args(argv)
    require_cuda("bench_core.py")

    results = {
        "date": time.strftime("%Y-%m-%d"),
        "device": fastattn.device_info(),
        "versions": fastattn.versions(),
        "build": bench_build(args),
        "host_overhead": bench_host_overhead(args),
    }
    emit(results, args.json)
    h, b = results["host_overhead"], results["build"]
    print(f"  host us/call: fastattn {h['fastattn_plan_forward_us']:.2f},"
          f" C++ floor {h['cudnn_frontend_cpp_execute_us']:.2f}, ratio {h['ratio_fastattn_to_cpp_floor']:.3f}")
    for k in ("device_tensors", "torch_tensors"):
        if f"checked_{k}_extra_us" in h:
            print(f"  checked path ({k.replace('_', ' ')}): {h[f'fastattn_plan_forward_{k}_us']:.2f} us,"
                  f" +{h[f'checked_{k}_extra_us']:.2f} us over ints")
    for sfx, what in (("", "forward"), ("_bwd", "backward")):
        print(f"  C++ execute {what} us: fastattn {h[f'fastattn_cpp_execute{sfx}_us']:.2f},"
              f" frontend sorted {h[f'cudnn_frontend_cpp_execute{sfx}_us']:.2f}"
              f" (ratio {h[f'ratio_cpp_execute_to_frontend_sorted{sfx}']:.3f}),"
              f" frontend uid map {h[f'cudnn_frontend_uid_map_execute{sfx}_us']:.2f}"
              f" (ratio {h[f'ratio_cpp_execute_to_frontend_uid_map{sfx}']:.3f}),"
              f" frontend sorted + preamble per call {h[f'cudnn_frontend_preamble_execute{sfx}_us']:.2f}"
              f" (ratio {h[f'ratio_cpp_execute_to_frontend_preamble{sfx}']:.3f})")
    for direction in ("forward", "backward") if "held_valid_rounds" in h else ():
        print(f"  C++ execute {direction}, host alone (GPU held) us: "
              + ", ".join(f"{m} {h[f'held_{m}_{direction}_us']:.2f}" for m in
                          ("fastattn", "fastattn_packs_only", "frontend_sorted", "frontend_uid_map",
                           "frontend_sorted_preamble"))
              + "; fastattn / " + ", ".join(f"{m} {h[f'ratio_held_{direction}_fastattn_to_{m}']:.3f}" for m in
                                             ("fastattn_packs_only", "frontend_sorted", "frontend_uid_map",
                                              "frontend_sorted_preamble")))
    for direction in ("forward", "backward") if "held_valid_rounds" in h else ():
        print(f"  C++ execute {direction}, {LAYERS} layers, host alone us: "
              + ", ".join(f"{m} {h[f'held_{m}_{direction}_{LAYERS}layers_us']:.2f}" for m in
                          ("fastattn", "fastattn_packs_only", "frontend_sorted", "frontend_sorted_preamble"))
              + "; fastattn / " + ", ".join(
                  f"{m} {h[f'ratio_held_{direction}_{LAYERS}layers_fastattn_to_{m}']:.3f}" for m in
                  ("fastattn_packs_only", "frontend_sorted", "frontend_sorted_preamble")))
    if "held_valid_rounds" in h:
        print(f"  held rounds valid: {h['held_valid_rounds']} of {h['samples']}")
    if "torch_sdpa_cudnn_us" in h:
        print(f"  torch sdpa cudnn {h['torch_sdpa_cudnn_us']:.2f} us, flash {h['torch_sdpa_flash_us']:.2f} us;"
              f" fastattn/torch-cudnn {h['ratio_fastattn_to_torch_cudnn']:.3f}")
    print(f"  build ms (median): {json.dumps({k: round(v, 1) for k, v in b['median'].items()})};"
          f" first build in process {b['first_build_in_process_s']:.2f} s")
    for k in ("ratio_fwd_fastattn_to_frontend", "ratio_bwd_fastattn_to_frontend"):
        if k in b:
            print(f"  {k}: {b[k]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
