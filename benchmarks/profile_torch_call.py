"""Where the host time of one fastattn.torch.attention call goes.

On the small shape of bench_torch (1x8x128x64 bf16 causal, bshd, inference), times
each piece of the eager path on its own, in one process, as the median of 15 samples
of 2000 calls: the whole call, PyTorch SDPA's cuDNN backend on the same data
((b, h, s, d) tensors, the backend selected once), and the pieces fastattn.torch does
around plan.forward (the plan-cache key, the output allocation, the stream lookup,
the checks in attention()) plus plan.forward itself with its arguments ready. The GPU
work is tiny and asynchronous; every few thousand calls the queue is drained so it
never fills.

    python benchmarks/profile_torch_call.py [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastattn
import fastattn.torch as fat
from fastattn.torch import _dense, _plans
from fastattn._loader import import_core  # (at use: a checkout without its extension still says it needs a GPU)
from _common import emit, require_cuda, time_us as _us  # (benchmarks/ is on sys.path)


def _options(training: bool) -> _dense.DenseOptions:
    """attention(q, k, v, causal=True)'s options."""
    return _dense.DenseOptions(layout="bshd", causal=True, bottom_right=False, window_left=-1, window_right=-1,
                               scale=0.0, deterministic=False, alibi=False, training=training, dropout=0.0,
                               bias_grad=False)


def _training(q, k, v, qt, kt, vt) -> dict:
    """The same shape with gradients: a whole step (forward, then backward through
    autograd, on autograd's device thread), and backward's pieces run directly."""
    res = {}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves_t = [t.clone().requires_grad_() for t in (qt, kt, vt)]

    def step():
        o = fat.attention(*leaves, causal=True)
        torch.autograd.grad(o, leaves, o)

    def step_sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(*leaves_t, is_causal=True)
        torch.autograd.grad(o, leaves_t, o)

    res["train_step"] = _us(step, iters=300)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        res["train_step_sdpa_cudnn"] = _us(step_sdpa, iters=300)
    res["train_forward"] = _us(lambda: fat.attention(*leaves, causal=True), iters=300)
    options = _options(training=True)
    o, stats = _dense.forward_impl(q, k, v, None, None, None, None, None, options)
    d_o = torch.randn_like(o)
    bwd_args = (d_o, o, stats, q, k, v, None, None, None, None, None, options)  # backward_impl's
    res["backward_impl"] = _us(lambda: _dense.backward_impl(*bwd_args), iters=300)
    hit = _dense.plan_for(q, k, v, None, None, None, None, None, o, options)
    plan = hit.plan

    class Stub:
        forward_workspace_size, backward_workspace_size = plan.forward_workspace_size, plan.backward_workspace_size

        @staticmethod
        def backward(*args, **kwargs):
            return None

    hit.plan = Stub()
    res["backward_impl_python_only"] = _us(lambda: _dense.backward_impl(*bwd_args), iters=300)
    hit.plan = plan
    grads = [torch.empty_like(t) for t in (q, k, v)]
    ws = _plans.workspace(q, plan.backward_workspace_size, 0, _plans.raw_stream(0))
    ptrs = [t.data_ptr() for t in (q, k, v, o, d_o, stats, *grads)]
    res["plan_backward_positional"] = _us(lambda: plan.backward(*ptrs, ws.data_ptr() if ws is not None else 0,
                                                                _plans.raw_stream(0)), iters=300)
    res["backward_workspace_bytes"] = plan.backward_workspace_size
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    require_cuda("profile_torch_call.py")
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    o = fat.attention(q, k, v, causal=True)
    hit = next(iter(_plans.plans.values()))
    plan, shape = hit.plan, hit.out_shape
    stream = _plans.raw_stream(0)
    ws = hit.forward_workspace
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())
    options = _options(training=False)  # as attention(q, k, v, causal=True) makes them
    fwd_args = (q, k, v, None, None, None, None, None, options)  # forward_impl(q, k, v, lengths, extras, options)
    key_args = (q, k, v, None, None, None, None, None, None, options)  # plan_for(q, k, v, lengths, extras, o, options)
    res = {}
    res["attention_total"] = _us(lambda: fat.attention(q, k, v, causal=True))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        res["sdpa_cudnn_total"] = _us(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt,
                                                                                             is_causal=True))
    res["forward_impl"] = _us(lambda: _dense.forward_impl(*fwd_args))

    class Stub:  # the plan's sizes, a forward that does nothing: forward_impl's own Python
        forward_workspace_size, backward_workspace_size = plan.forward_workspace_size, plan.backward_workspace_size

        @staticmethod
        def forward(*args, **kwargs):
            return None

    hit.plan = Stub()
    res["forward_impl_python_only"] = _us(lambda: _dense.forward_impl(*fwd_args))
    hit.plan = plan
    res["plan_for_lookup"] = _us(lambda: _dense.plan_for(*key_args))
    res["new_empty_output"] = _us(lambda: q.new_empty(shape))
    res["empty_like_output"] = _us(lambda: torch.empty_like(q))
    res["new_empty_workspace"] = _us(lambda: q.new_empty(max(ws, 1), dtype=torch.uint8))
    res["kept_workspace"] = _us(lambda: _plans.workspace(q, max(ws, 1), 0, stream))
    res["is_capturing"] = _us(_plans.capturing)
    res["raw_stream"] = _us(lambda: _plans.raw_stream(0))
    res["data_ptr_x4"] = _us(lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()))
    res["is_compiling"] = _us(torch.compiler.is_compiling)
    res["grad_checks"] = _us(lambda: torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                 or v.requires_grad))
    w = _plans.workspace(q, ws, 0, stream)
    wp = w.data_ptr() if w is not None else 0
    res["plan_forward_positional"] = _us(lambda: plan.forward(*ptrs, 0, wp, stream))
    res["plan_forward_keywords"] = _us(lambda: plan.forward(*ptrs, stats=0, workspace=wp, stream=stream,
                                                            seq_len_q=0, seq_len_kv=0))
    # The least a Python wrapper can do: a fresh output and one positional call.
    res["floor_empty_like_and_forward"] = _us(
        lambda: plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), torch.empty_like(q).data_ptr(), 0, wp,
                             stream))
    # cudnn-frontend's own execute looped in C++ on the same plan and pointers (bench_core's floor).
    res["cpp_floor"] = round(statistics.median(
        import_core().bench_raw_execute(plan, "forward", ptrs, wp, stream, 2000) / 2000 * 1e6 for _ in range(15)), 3)
    res["forward_workspace_bytes"] = ws
    res.update(_training(q, k, v, qt, kt, vt))
    res["ratio_attention_to_sdpa_cudnn"] = res["attention_total"] / res["sdpa_cudnn_total"]
    res["device"] = fastattn.device_info()
    res["torch"] = torch.__version__
    emit(res, args.json)
    for key, value in res.items():
        if isinstance(value, float):
            print(f"  {key:<30} {value:8.3f}" + ("" if key.startswith("ratio") else " us"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
