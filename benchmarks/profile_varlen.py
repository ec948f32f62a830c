"""Where the host time of fastattn.torch.attention_varlen goes, beside FlashAttention 2's
varlen kernels as PyTorch ships them (aten._flash_attention_forward/backward): 4
sequences of 32 tokens, 8 heads, dim 64, bf16, causal, one cumulative-length tensor
for q and k (self-attention), each piece timed on its own in one process (median of 15
samples; the GPU queue is drained between samples).

Inference: attention_varlen() whole; its C entry (call_varlen) called directly; the
native op called directly (torch.ops, the dispatcher); the Python body's checks alone
(_check_varlen); what deriving cuDNN's lengths and offsets from cu_seqlens with
PyTorch kernels costs (what the ragged index kernel replaces); fastattn.flash's
varlen entry; FA2.
Training: a whole step (forward, then torch.autograd.grad) for fastattn and FA2, in
interleaved rounds.

    python benchmarks/profile_varlen.py [--json out.json]
"""

from __future__ import annotations

import argparse
import sys

import torch

import fastattn.torch as fat
from fastattn import flash
from fastattn.torch import _native, _varlen
from _common import fa2_varlen, interleaved, report, require_cuda, time_us as _us  # (benchmarks/ is on sys.path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    require_cuda("profile_varlen.py")
    path = "native" if _native.decide() is not None else "python"
    h, d, lens = 8, 64, [32] * 4
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
    total, mx = sum(lens), max(lens)
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    res: dict = {"path": path}
    with torch.no_grad():
        res["inference_attention_varlen"] = _us(lambda: fat.attention_varlen(q, k, v, cu, cu, mx, mx, causal=True))
        res["inference_flash_attn_varlen_func"] = _us(lambda: flash.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx,
                                                                                          causal=True))
        res["inference_fa2_varlen"] = _us(lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0,
                                                                                         True, False))
        if path == "native":
            opts = _varlen.VarlenOptions(_varlen.bucket(mx), _varlen.bucket(mx), True, False, -1, -1, 0.0, False,
                                         False, False, 0.0)
            op = _native.VARLEN[0]
            res["inference_native_op"] = _us(lambda: op(q, k, v, cu, cu, None, *opts))
            call = _native.library().call_varlen  # the C entry attention_varlen() tries first
            res["inference_call_varlen"] = _us(lambda: call(q, k, v, cu, cu, mx, mx, True, False, None, None, False,
                                                            "top_left", False, 0.0, False))
        res["python_checks"] = _us(lambda: _varlen._check_varlen(q, k, v, cu, cu))
        res["index_kernels_inference"] = _us(lambda: (cu[1:] - cu[:-1], cu * (h * d)))
        res["index_kernels_training"] = _us(lambda: (cu[1:] - cu[:-1], cu * (h * d), cu * h))
        res["empty_like"] = _us(lambda: torch.empty_like(q))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    d_o = torch.randn_like(q)

    def step():
        out = fat.attention_varlen(*leaves, cu, cu, mx, mx, causal=True)
        torch.autograd.grad(out, leaves, d_o)

    def step_fa2():
        out = fa2_varlen(*leaves, cu, cu, mx, mx, True)
        torch.autograd.grad(out, leaves, d_o)

    interleaved(res, {"train_step": step, "train_step_fa2": step_fa2})
    res["ratio_inference_to_fa2"] = res["inference_attention_varlen"] / res["inference_fa2_varlen"]
    res["ratio_train_to_fa2"] = res["train_step"] / res["train_step_fa2"]
    return report(res, args.json)


if __name__ == "__main__":
    sys.exit(main())
