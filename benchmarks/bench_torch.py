"""fastattn.torch against PyTorch's SDPA backends, in one process on one GPU.

(a) Host time per call, inference and training step (forward and backward through
    autograd), on 1x8x128x64 bf16 causal and on a decode shape (one query against 4096
    keys, 8 heads, no mask): fastattn.torch.attention on its native path (the C++ op
    library) and on its Python path, vs scaled_dot_product_attention on (b, h, s, d)
    tensors with the cuDNN and flash backends, the backend (or path) selected once
    outside the timed loop. Interleaved rounds, medians, ratios to SDPA cuDNN (also the
    median of each round's own ratio, which the host's speed states affect less) (targets:
    inference at most 0.6x, a training step at most 0.9x) and native to Python. An
    inference call's host time is timed with the GPU held by a sleep kernel (its
    launches queue, so the loop never waits for the GPU); the wall time of the same
    loop with the GPU free is reported beside it. Also each peer's GPU time per call.
(b) Forward and backward TFLOP/s on large shapes, causal and not (target: at least
    0.98x PyTorch cuDNN's), timed with CUDA events over rotating inputs, in interleaved
    rounds (a new order each), medians.

    python benchmarks/bench_torch.py [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastattn.torch as fat
from fastattn.torch import _native
from _common import emit, header, held_gpu_us, HELD_ITERS, host_rounds, require_cuda  # (benchmarks/ is on sys.path)


def _sdpa(q, k, v, causal):
    """SDPA on bshd tensors: it takes (b, h, s, d), so transposed views of the same memory."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)


def _sdpa_bhsd(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


# What the op library publishes to the entry points (fastattn/torch/_native.py; tests/helpers/
# torch.py's NATIVE_ENTRIES): with all of them None, every call takes the Python body.
NATIVE_ENTRIES = ("DENSE", "VARLEN", "PAGED", "CALL", "CALL_VARLEN")


@contextlib.contextmanager
def _python_path():
    """fastattn.torch's Python path for the block (the native path's entries unpublished)."""
    saved = {name: getattr(_native, name) for name in NATIVE_ENTRIES}  # AttributeError: the list is stale
    for name in NATIVE_ENTRIES:
        setattr(_native, name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(_native, name, value)


def _fastattn(q, k, v, causal):
    return fat.attention(q, k, v, causal=causal)


# name -> (the call, the backend or path to select around it)
PEERS = {
    "fastattn_native": (_fastattn, "native"),
    "fastattn_python": (_fastattn, "python"),
    "torch_cudnn": (_sdpa, SDPBackend.CUDNN_ATTENTION),
    "torch_flash": (_sdpa, SDPBackend.FLASH_ATTENTION),
}


def _backend(backend):
    """The backend (or fastattn path) selection, entered once around a timed loop (not
    per call: its cost is not the peer's)."""
    if backend == "python":
        return _python_path()
    if backend == "native":
        return contextlib.nullcontext()
    return sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()


SHAPES = {  # name -> (q's bshd shape, k's and v's, causal)
    "prefill_1x8x128x64_causal": ((1, 128, 8, 64), (1, 128, 8, 64), True),
    "decode_1x8x1x4096x64": ((1, 1, 8, 64), (1, 4096, 8, 64), False),
}


def host_overhead(iters: int, repeats: int, shape: str) -> dict:
    """Each peer on its own natural layout, so that no peer pays for views: fastattn on
    bshd tensors, SDPA on (b, h, s, d) tensors. Inference (the target), and a training
    step (forward and backward through autograd)."""
    q_shape, kv_shape, causal = SHAPES[shape]
    bshd = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in (q_shape, kv_shape, kv_shape)]
    bhsd = [t.transpose(1, 2).contiguous() for t in bshd]
    calls = {"fastattn_native": (_fastattn, "native", bshd), "fastattn_python": (_fastattn, "python", bshd),
             "torch_cudnn": (_sdpa_bhsd, SDPBackend.CUDNN_ATTENTION, bhsd),
             "torch_flash": (_sdpa_bhsd, SDPBackend.FLASH_ATTENTION, bhsd)}
    if _native.decide() is None:  # reported, and the native row left out
        calls.pop("fastattn_native")
    grads = {name: [t.detach().clone().requires_grad_() for t in ts] for name, (_, _, ts) in calls.items()}

    def train_step(fn, q, k, v, causal):
        o = fn(q, k, v, causal)
        torch.autograd.grad(o, (q, k, v), o)  # o as its own gradient: no extra allocation in the loop

    # partial, not a lambda: the loops call the peer with no Python frame of their own in between
    steps = {name: (functools.partial(_backend, backend), functools.partial(fn, *ts, causal),
                    functools.partial(train_step, fn, *grads[name], causal))
             for name, (fn, backend, ts) in calls.items()}
    rounds = host_rounds(steps, iters, repeats)
    samples = {name: r["wall"] for name, r in rounds.items()}
    held = {name: r["held"] for name, r in rounds.items()}
    held_valid = {name: r["held_valid"] for name, r in rounds.items()}
    train = {name: r["train"] for name, r in rounds.items()}
    held_iters = min(iters, HELD_ITERS)
    res = {"shape": shape, "native_path": _native.status(), "held_iters": held_iters}
    res.update({f"{n}_us": statistics.median(s) for n, s in samples.items()})
    res.update({f"{n}_held_us": statistics.median(s) for n, s in held.items()})
    res.update({f"{n}_held_us_rounds": s for n, s in held.items()})
    res.update({f"{n}_held_valid_rounds": c for n, c in held_valid.items()})
    res.update({f"{n}_gpu_us": held_gpu_us(enter, infer, iters) for n, (enter, infer, _) in steps.items()})
    res.update({f"{n}_train_us": statistics.median(s) for n, s in train.items()})
    res.update({f"{n}_us_rounds": s for n, s in samples.items()})
    res.update({f"{n}_train_us_rounds": s for n, s in train.items()})
    for path in ("fastattn_native", "fastattn_python"):
        if path in calls:
            res[f"ratio_{path}_to_torch_cudnn"] = res[f"{path}_us"] / res["torch_cudnn_us"]
            res[f"ratio_held_{path}_to_torch_cudnn"] = res[f"{path}_held_us"] / res["torch_cudnn_held_us"]
            res[f"ratio_train_{path}_to_torch_cudnn"] = res[f"{path}_train_us"] / res["torch_cudnn_train_us"]
            # The host's speed switches between states that last several rounds (on the
            # H200 machine: SDPA cuDNN's prefill call ~19 us in one, ~28 in the other), so
            # a ratio of medians depends on which state each peer's median fell in. The
            # median of each round's own ratio compares the peers in the same state.
            res[f"ratio_held_{path}_to_torch_cudnn_paired"] = statistics.median(
                a / b for a, b in zip(held[path], held["torch_cudnn"]))
            res[f"ratio_train_{path}_to_torch_cudnn_paired"] = statistics.median(
                a / b for a, b in zip(train[path], train["torch_cudnn"]))
    if "fastattn_native" in calls:
        res["ratio_native_to_python"] = res["fastattn_native_us"] / res["fastattn_python_us"]
        res["ratio_train_native_to_python"] = res["fastattn_native_train_us"] / res["fastattn_python_train_us"]
    return res


def _flops(b, h, s, d, causal, backward):
    f = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * (2.5 if backward else 1.0)  # backward is ~2.5x the forward's matmul work


def throughput(shapes, reps: int, rounds: int) -> list[dict]:
    """TFLOP/s of each peer, forward and forward + backward: `rounds` interleaved rounds,
    each timing `reps` calls of every (peer, mode) in a new seeded order; medians. Large
    shapes vary a few percent with clocks and heat between samples, so one block per peer
    would compare moments, not peers."""
    rows, rng = [], random.Random(29)
    for (b, h, s, d), causal in shapes:
        inputs = [[torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3)] for _ in range(3)]  # rotate inputs: no cache effects
        row = {"shape": f"{b}x{h}x{s}x{d}", "causal": causal, "rounds": rounds, "reps_per_sample": reps}

        def once(i, fn, mode, causal=causal, inputs=inputs):
            q, k, v = inputs[i % 3]
            if mode == "fwd":
                with torch.no_grad():
                    fn(q, k, v, causal)
            else:
                o = fn(q, k, v, causal)
                torch.autograd.grad(o, (q, k, v), torch.ones_like(o))

        def sample(name, mode):
            fn, backend = PEERS[name]
            with _backend(backend):
                once(0, fn, mode)  # the backend's (or path's) switch settles outside the clock
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for i in range(reps):
                    once(i, fn, mode)
                end.record()
                torch.cuda.synchronize()
            ms = start.elapsed_time(end) / reps
            flops = _flops(b, h, s, d, causal, mode == "bwd")
            if mode == "bwd":  # the timed region ran forward + backward
                flops += _flops(b, h, s, d, causal, False)
            return flops / ms / 1e9

        variants = [(name, mode) for name in PEERS for mode in ("fwd", "bwd")]
        for name, mode in variants:  # warm-up: plans, autotuning, clocks
            for i in range(3):
                with _backend(PEERS[name][1]):
                    once(i, PEERS[name][0], mode)
        samples = {v: [] for v in variants}
        for _ in range(rounds):
            rng.shuffle(variants)
            for v in variants:
                samples[v].append(sample(*v))
        for (name, mode), vals in samples.items():
            row[f"{name}_{mode}_tflops"] = statistics.median(vals)
            row[f"{name}_{mode}_tflops_rounds"] = vals
        for mode in ("fwd", "bwd"):
            for path in ("fastattn_native", "fastattn_python"):
                row[f"ratio_{mode}_{path}_to_torch_cudnn"] = row[f"{path}_{mode}_tflops"] / row[f"torch_cudnn_{mode}_tflops"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--reps", type=int, default=4, help="calls per throughput sample")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved throughput rounds")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    require_cuda("bench_torch.py")
    shapes = [((2, 16, 8192, 128), c) for c in (False, True)] + [((4, 32, 4096, 128), c) for c in (False, True)]
    res = {**header(), "host_overhead": [host_overhead(args.iters, args.repeats, s) for s in SHAPES],
           "throughput": throughput(shapes, args.reps, args.rounds)}
    emit(res, args.json)
    print("  (medians of interleaved rounds)")
    print(f"  fastattn.torch path: {res['host_overhead'][0]['native_path']}")
    for h in res["host_overhead"]:
        peers = [p for p in ("fastattn_native", "fastattn_python", "torch_cudnn", "torch_flash") if f"{p}_us" in h]
        print(f"  {h['shape']}:")
        print("    host us/call (GPU held, host alone): " + ", ".join(f"{p} {h[p + '_held_us']:.2f}" for p in peers)
              + f"; valid rounds {[h[p + '_held_valid_rounds'] for p in peers]} of {len(h[peers[0] + '_held_us_rounds'])}")
        print("    wall us/call (loop, GPU free): " + ", ".join(f"{p} {h[p + '_us']:.2f}" for p in peers))
        print("    GPU us/call:   " + ", ".join(f"{p} {h[p + '_gpu_us']:.2f}" for p in peers)
              + " (host numbers must exceed these)")
        print("    host us/train: " + ", ".join(f"{p} {h[p + '_train_us']:.2f}" for p in peers))
        for p in ("fastattn_native", "fastattn_python"):
            if f"ratio_{p}_to_torch_cudnn" in h:
                print(f"    {p} / torch_cudnn: inference host {h[f'ratio_held_{p}_to_torch_cudnn']:.2f} "
                      f"(per round {h[f'ratio_held_{p}_to_torch_cudnn_paired']:.2f}; target <= 0.6), "
                      f"wall {h[f'ratio_{p}_to_torch_cudnn']:.2f}; training step "
                      f"{h[f'ratio_train_{p}_to_torch_cudnn']:.2f} (per round "
                      f"{h[f'ratio_train_{p}_to_torch_cudnn_paired']:.2f}; target <= 0.9)")
        if "ratio_native_to_python" in h:
            print(f"    native / python: inference {h['ratio_native_to_python']:.2f}, "
                  f"training step {h['ratio_train_native_to_python']:.2f}")
    for r in res["throughput"]:
        print(f"  {r['shape']} causal={r['causal']}: fwd native {r['fastattn_native_fwd_tflops']:.0f} python "
              f"{r['fastattn_python_fwd_tflops']:.0f} vs cudnn {r['torch_cudnn_fwd_tflops']:.0f} "
              f"({r['ratio_fwd_fastattn_native_to_torch_cudnn']:.3f}), fwd+bwd native "
              f"{r['fastattn_native_bwd_tflops']:.0f} vs {r['torch_cudnn_bwd_tflops']:.0f} "
              f"({r['ratio_bwd_fastattn_native_to_torch_cudnn']:.3f}); flash fwd {r['torch_flash_fwd_tflops']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
