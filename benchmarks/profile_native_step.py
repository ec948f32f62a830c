"""Where the host time of fastattn.torch's native path goes, beside SDPA's cuDNN backend:
the pieces of an inference call and of a training step, each timed on its
own in one process (median of 15 samples; the GPU queue is drained between samples).

Inference: attention() whole; its C entry (call) called directly (no Python wrapper), and
its pieces looped in C++ (profile_eager, benchmarks/csrc/profile_eager.cpp, which this
script builds into its own copy of the op library: plan lookup, output allocation, stream,
capture check, workspace, execute, GIL release, wrapping); the
dispatcher's op (torch.ops) called directly; plan.forward with ints (the Cython
floor); SDPA cuDNN. Training: a whole step (forward, then backward through
torch.autograd.grad); the forward alone with gradients on (what the autograd node
costs); the backward alone (autograd.grad with retain_graph on one graph: the engine
plus the backward kernel's host work); the backward op called directly; and the
engine's own floor (autograd.grad through a multiplication). The same for SDPA where it
applies.

    python benchmarks/profile_native_step.py [--json out.json]   (builds its op library at the first run)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

# The op library with profile_eager beside its units (_native.EXTRA) is this process's: built
# at the first run (native mode), and decided here, not by the warm-up that importing
# fastattn.torch starts, which would load the plain library first.
os.environ["FASTATTN_TORCH_PATH"] = "native"
os.environ["FASTATTN_WARM_UP"] = "off"

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastattn.torch as fat  # noqa: E402
from fastattn._loader import import_core  # noqa: E402  (at use: a checkout without its extension still says it needs a GPU)
from fastattn.torch import _dense, _native, _plans  # noqa: E402
from _common import interleaved, report, require_cuda, time_us as _us  # noqa: E402  (benchmarks/ is on sys.path)

_native.EXTRA = (Path(__file__).resolve().parent / "csrc" / "profile_eager.cpp",)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    require_cuda("profile_native_step.py")
    if _native.decide() is None:
        print(f"the native path is not available: {_native.status()}")
        return 1
    call, dense = _native.CALL, _native.DENSE[0]
    # attention()'s own arguments in its order (causal, bshd), as its C entry takes them.
    call_args = (True, False, None, None, "bshd", False, None, None, False, None, 0.0, None, "top_left", False, 0.0)
    backward_op = torch.ops.fastattn.native_attention_backward.default
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    opts = ("bshd", True, False, -1, -1, 0.0, False, False)  # the op's options before training
    res = {}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        res["inference_sdpa_cudnn"] = _us(lambda: sdpa(qt, kt, vt, is_causal=True))
        res["inference_attention"] = _us(lambda: fat.attention(q, k, v, causal=True))
        res["inference_call_entry"] = _us(lambda: call(q, k, v, *call_args))
        fixed = call(q, k, v, *call_args)
        _native.CALL = lambda *_: fixed  # attention()'s Python alone (plus a lambda's call)
        try:
            res["inference_attention_python_only"] = _us(lambda: fat.attention(q, k, v, causal=True))
        finally:
            _native.CALL = call
        # attention()'s Python body (option checks, then the dispatcher's op), and the body alone.
        ops = _native.DENSE
        _native.CALL = None
        try:
            res["inference_attention_body"] = _us(lambda: fat.attention(q, k, v, causal=True))
            _native.DENSE = (lambda *a: (fixed,), ops[1])
            res["inference_attention_body_python_only"] = _us(lambda: fat.attention(q, k, v, causal=True))
        finally:
            _native.CALL, _native.DENSE = call, ops
        res["inference_dispatcher_op"] = _us(lambda: dense(q, k, v, None, None, None, None, None, *opts, False, 0.0,
                                                           False))
        res["empty_like"] = _us(lambda: torch.empty_like(q))
        # The eager entry's pieces, each looped in C++ (profile_eager): medians of 15 samples.
        pieces = [torch.ops.fastattn_bench.profile_eager(q, k, v, 2000) for _ in range(15)]
        for name in pieces[0]:
            res[f"eager_piece_{name}"] = statistics.median(p[name] for p in pieces)
        res["eager_piece_wrap_o"] = res["eager_piece_allocate_and_wrap_o"] - res["eager_piece_allocate_o"]
        # The floors under the eager entry: plan.forward with ints (Cython), and
        # cudnn-frontend's execute looped in C++ on the same plan and pointers.
        c = _dense.plan_for(q, k, v, None, None, None, None, None, None,
                            _dense.DenseOptions("bshd", True, False, -1, -1, 0.0, False, False, False, 0.0, False))
        o = torch.empty_like(q)
        stream = _plans.raw_stream(0)
        ws = _plans.workspace(q, c.forward_workspace, 0, stream)
        wp = ws.data_ptr() if ws is not None else 0
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())
        res["forward_workspace_bytes"] = float(c.forward_workspace)  # kept per stream by the op library
        res["backward_workspace_bytes"] = float(c.backward_workspace)
        res["plan_forward_ints"] = _us(lambda: c.plan.forward(*ptrs, 0, wp, stream))
        res["cpp_execute_floor"] = round(statistics.median(
            import_core().bench_raw_execute(c.plan, "forward", ptrs, wp, stream, 2000) / 2000 * 1e6 for _ in range(15)), 3)

        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        leaves_t = [t.clone().requires_grad_() for t in (qt, kt, vt)]
        d_o = torch.randn_like(q)
        d_ot = d_o.transpose(1, 2).contiguous()

        def step():
            out = fat.attention(*leaves, causal=True)
            torch.autograd.grad(out, leaves, d_o)

        def step_sdpa():
            out = sdpa(*leaves_t, is_causal=True)
            torch.autograd.grad(out, leaves_t, d_ot)

        interleaved(res, {"train_step": step, "train_step_sdpa_cudnn": step_sdpa})
        res["train_forward"] = _us(lambda: fat.attention(*leaves, causal=True), iters=300)
        res["train_forward_sdpa_cudnn"] = _us(lambda: sdpa(*leaves_t, is_causal=True), iters=300)
        res["train_forward_call_entry"] = _us(lambda: call(*leaves, *call_args), iters=300)
        graph_o = fat.attention(*leaves, causal=True)
        graph_ot = sdpa(*leaves_t, is_causal=True)
        res["backward_only"] = _us(lambda: torch.autograd.grad(graph_o, leaves, d_o, retain_graph=True), iters=300)
        res["backward_only_sdpa_cudnn"] = _us(lambda: torch.autograd.grad(graph_ot, leaves_t, d_ot, retain_graph=True),
                                              iters=300)
        o2, stats = dense(q, k, v, None, None, None, None, None, *opts, True, 0.0, False)
        res["backward_op_direct"] = _us(lambda: backward_op(d_o, o2, stats, q, k, v, None, None, None, None, None,
                                                            *opts, True, 0.0, False), iters=300)
        x = torch.randn(16, device="cuda", requires_grad=True)
        y = x * 2
        g = torch.ones_like(y)
        res["engine_floor_mul"] = _us(lambda: torch.autograd.grad(y, x, g, retain_graph=True), iters=300)
    res["ratio_inference_to_sdpa"] = res["inference_attention"] / res["inference_sdpa_cudnn"]
    res["ratio_train_to_sdpa"] = res["train_step"] / res["train_step_sdpa_cudnn"]
    return report(res, args.json)


if __name__ == "__main__":
    sys.exit(main())
