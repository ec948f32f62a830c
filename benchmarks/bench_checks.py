"""Host cost of checking array arguments, on any machine, no GPU needed.

    python benchmarks/bench_checks.py [--calibrate-us 40.84]

What plan.forward adds over the int path for each array argument, timed on the
functions forward calls (fastattn._arrays.address / workspace_address) with a
plan-like object, for the call benchmarks/bench_core.py times (q, k, v, o and the
workspace). Without a GPU there are no CUDA tensors, so PyTorch tensors are CPU
tensors with the device test (is_cuda, get_device) stood in for, that test being
timed on its own and added back; everything else (dtype, shape, strides, the kept
layouts, data_ptr) is the code that runs on a GPU.

On the GPU, plan.forward takes a torch tensor equal to the one last accepted for that
tensor in _core (compiled), not through _arrays.address: measured with the same code in a
standalone Cython module on this kind of CPU, ~0.65 us a tensor against ~0.85 us, so the
torch numbers here are an upper bound for repeated calls.

--calibrate-us: the checked-path extra that bench_core measured on the GPU machine for
the old path (4 torch tensors through torch's DLPack and cuda.core, an int workspace:
+40.84 us on the H200, 2026-11-30); the ratio of that to this machine's old-path cost
scales this machine's new costs into a rough prediction for that machine (rough: torch's
DLPack export of a CUDA tensor need not cost what a CPU tensor's does).
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastattn import AttentionConfig, _arrays  # noqa: E402
from _common import emit  # noqa: E402  (benchmarks/ is on sys.path)


def _us(fn, number: int, repeat: int) -> float:
    """The fastest of `repeat` samples of `number` calls: the CPU this runs on may be shared,
    and other load only adds time."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=31)
    ap.add_argument("--calibrate-us", type=float, default=None,
                    help="the old path's checked extra per forward on the GPU machine (bench_core), to predict")
    args = ap.parse_args(argv)
    import torch
    from cuda.core.utils import StridedMemoryView

    cfg = AttentionConfig(batch=1, heads_q=32, seqlen_q=4096, head_dim_qk=128, dtype="bf16", mask="causal")
    plan = SimpleNamespace(config=cfg, device=0, _layouts={}, forward_workspace_size=1 << 20,
                           backward_workspace_size=0)
    b, h, s, d = cfg.shape("q")
    names = ("q", "k", "v", "o")
    tensors = {n: torch.empty((b, s, h, d), dtype=torch.bfloat16) for n in names}  # bshd, as bench_core's
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    n, r = args.number, args.repeat
    res = {}

    real_device = _arrays._torch_device
    _arrays._torch_device = lambda plan, name, x: None  # CPU tensors as if on device 0 (timed below)
    try:
        def torch_call():
            for name in names:
                _arrays.address(plan, name, tensors[name])
            _arrays.workspace_address(plan, False, ws)

        torch_call()  # fills the plan's kept layouts, as the first forward does
        res["torch_5_args_without_device_test_us"] = _us(torch_call, n, r)
    finally:
        _arrays._torch_device = real_device
    x = tensors["q"]
    res["torch_device_test_us"] = _us(lambda: (x.is_cuda, x.get_device()), n, r)
    res["torch_5_args_us"] = res["torch_5_args_without_device_test_us"] + 5 * res["torch_device_test_us"]

    # plan.allocate's tensors: their own description, made for this tensor of this config.
    own = {name: _arrays.DeviceTensor(SimpleNamespace(size=0), _arrays.ArrayDesc(
        1 << 20, *_arrays.layout(cfg, name), "bfloat16", 0, True, "fastattn.DeviceTensor"), name, cfg)
        for name in names}
    own_ws = _arrays.DeviceTensor(SimpleNamespace(size=1 << 20), _arrays.ArrayDesc(
        1 << 20, (1 << 20,), (1,), "uint8", 0, True, "fastattn.DeviceTensor"), "workspace", cfg)

    def own_call():
        for name in names:
            _arrays.address(plan, name, own[name])
        _arrays.workspace_address(plan, False, own_ws)

    res["device_tensors_5_args_us"] = _us(own_call, n, r)
    # Any other framework: cuda.core's view (a numpy array stands in: its DLPack export is cheap,
    # as CuPy's is), then the same check on the description.
    a = __import__("numpy").empty((b, s, h, d), dtype="float16")
    res["cuda_core_view_numpy_per_arg_us"] = _us(lambda: StridedMemoryView.from_dlpack(a, stream_ptr=-1), n, r)
    desc = _arrays.ArrayDesc(1 << 20, (b, s, h, d), tuple(x.stride()), "bfloat16", 0, True, "x")
    res["check_of_a_description_per_arg_us"] = _us(lambda: _arrays.check(cfg, 0, "q", desc, plan), n, r)
    # The old path for torch (before this change): torch's DLPack export through cuda.core.
    res["old_torch_dlpack_view_per_arg_us"] = _us(lambda: StridedMemoryView.from_dlpack(x, stream_ptr=-1), n, r)
    # bench_core's old torch call passed 4 torch tensors and an int workspace.
    res["old_torch_4_args_us"] = 4 * res["old_torch_dlpack_view_per_arg_us"]
    if args.calibrate_us:
        scale = args.calibrate_us / res["old_torch_4_args_us"]
        res["gpu_machine_scale"] = scale
        res["predicted_gpu_torch_extra_us"] = res["torch_5_args_us"] * scale
        res["predicted_gpu_device_tensors_extra_us"] = res["device_tensors_5_args_us"] * scale
    emit(res, None)
    print(f"torch tensors, 5 args: {res['torch_5_args_us']:.2f} us (old path, 4 args: {res['old_torch_4_args_us']:.1f} us); "
          f"DeviceTensors, 5 args: {res['device_tensors_5_args_us']:.2f} us")
    if args.calibrate_us:
        print(f"predicted on the GPU machine: torch +{res['predicted_gpu_torch_extra_us']:.2f} us, "
              f"DeviceTensors +{res['predicted_gpu_device_tensors_extra_us']:.2f} us over ints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
