"""The Python path's executor per call, on the CPU, without a GPU: each op's forward_impl
and backward_impl (fastattn/torch/_executor.py, made from the ops' specs) on small CPU
tensors against a plan that does nothing, so that what is timed is the executor's own
host work (the plan lookup, allocation, the workspace, the launch's argument list), and
a plain eager training step's autograd round (`_executor.Train`, then
torch.autograd.grad). Best of `--repeat` timeit runs of `--number` calls each.

    python benchmarks/bench_executor.py [--json FILE] [--root CHECKOUT]

--root measures another checkout's fastattn (another commit, say) with this same script:
its op modules must have forward_impl(*inputs, options) and backward_impl(d_o, o, stats,
*inputs, options). The CPU is shared with whatever else runs: compare runs made one after
the other, interleaved, and read differences under ~0.3 us as noise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import timeit

from _common import write_json  # noqa: E402  (benchmarks/ is on sys.path)


def _setup(root: str | None) -> dict:
    if root:
        sys.path.insert(0, os.path.abspath(root))
    import torch

    from fastattn.torch import _dense, _paged, _plans, _varlen

    class Stub:  # a plan's sizes and a launch that does nothing
        forward_workspace_size = backward_workspace_size = 256

        def forward(self, *args, **kwargs):
            pass

        def backward(self, *args, **kwargs):
            pass

    # CPU tensors: no stream, no capture; a miss keeps a stub plan under the real key.
    _plans.capturing = _paged.capturing = lambda: False
    for m in (_dense, _varlen, _paged):
        m.raw_stream = lambda device: 0
        m.remember = lambda key, cfg, q, k, v, layout: _plans.plans.setdefault(
            key, _plans.CachedPlan(Stub(), q, k, v, layout))
        m.config_for = lambda *args: None

    bf = torch.bfloat16
    q, k, v = (torch.zeros(2, 16, h, 8, dtype=bf, requires_grad=True) for h in (4, 2, 2))
    dense = _dense.DenseOptions("bshd", True, False, -1, -1, 0.0, False, False, True, 0.0, False)
    dense_inference = dense._replace(training=False)
    o, stats = _dense.forward_impl(q, k, v, None, None, None, None, None, dense)
    d_o = torch.zeros_like(o)
    lens = torch.full((2,), 10, dtype=torch.int32)
    bias, sink = torch.zeros(1, 4, 16, 16, dtype=bf), torch.zeros(4)
    qv, kv, vv = (torch.zeros(32, h, 8, dtype=bf, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 10, 32], dtype=torch.int32)
    varlen = _varlen.VarlenOptions(32, 32, True, False, -1, -1, 0.0, False, True, False, 0.0)
    varlen_inference = varlen._replace(training=False)
    ov, sv = _varlen.forward_impl(qv, kv, vv, cu, cu, None, None, varlen)
    d_ov = torch.zeros_like(ov)
    qp, kp = torch.zeros(4, 1, 8, 64, dtype=bf), torch.zeros(32, 16, 2, 64, dtype=bf)
    table, cache_lens = torch.zeros(4, 8, dtype=torch.int32), torch.full((4,), 100, dtype=torch.int32)
    paged = _paged.PagedOptions(True, True, -1, -1, 0.0)

    calls = {
        "dense_forward": lambda: _dense.forward_impl(q, k, v, None, None, None, None, None, dense_inference),
        "dense_forward_padded": lambda: _dense.forward_impl(q, k, v, lens, lens, None, None, None, dense_inference),
        "dense_forward_bias_sinks": lambda: _dense.forward_impl(q, k, v, None, None, bias, sink, None,
                                                                dense_inference),
        "dense_backward": lambda: _dense.backward_impl(d_o, o, stats, q, k, v, None, None, None, None, None, dense),
        "dense_backward_bias_sinks": lambda: _dense.backward_impl(d_o, o, stats, q, k, v, None, None, bias, sink,
                                                                  None, dense._replace(bias_grad=True)),
        "varlen_forward": lambda: _varlen.forward_impl(qv, kv, vv, cu, cu, None, None, varlen_inference),
        "varlen_backward": lambda: _varlen.backward_impl(d_ov, ov, sv, qv, kv, vv, cu, cu, None, None, varlen),
        "paged_forward": lambda: _paged.forward_impl(qp, kp, kp, table, cache_lens, None, paged),
    }
    try:
        from fastattn.torch._executor import Train
    except ImportError:  # a checkout without it: the training rounds are left out
        return calls

    def dense_step():
        torch.autograd.grad(Train.apply(_dense, dense, False, q, k, v, None, None, None, None, None), (q, k, v), d_o)

    def varlen_step():
        torch.autograd.grad(Train.apply(_varlen, varlen, False, qv, kv, vv, cu, cu, None, None), (qv, kv, vv), d_ov)

    calls["dense_train_forward"] = lambda: Train.apply(_dense, dense, False, q, k, v, None, None, None, None, None)
    calls["dense_train_step"] = dense_step
    calls["varlen_train_step"] = varlen_step
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--root", help="the checkout whose fastattn to measure (default: this one)")
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)
    calls = _setup(args.root)
    import platform

    import torch

    # (not _common.header(): that one asks the GPU)
    res = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
           "cpu": platform.processor() or platform.machine(), "uname": os.uname().release,
           "root": os.path.abspath(args.root or "."), "number": args.number, "repeat": args.repeat}
    for name, fn in calls.items():
        number = args.number // 10 if "step" in name or "train" in name else args.number
        best = min(timeit.repeat(fn, number=number, repeat=args.repeat)) / number * 1e6
        res[f"{name}_us"] = round(best, 3)
        print(f"{name:28s} {best:8.3f} us")
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
