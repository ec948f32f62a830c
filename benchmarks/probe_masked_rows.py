"""What cuDNN's attention gives for a query row whose bias is -inf at every key (a row that
keeps no key), through aten::_scaled_dot_product_cudnn_attention: PyTorch's own kernel (the
SDPA mode off) and fastattn's (the mode on, which serves that operator). The SDPA mode's
composite finds such rows on every masked call (its bias conversion's extra kernels, measured
by bench_sdpa_mode.py) to give PyTorch's answer for them, zeros, and to keep the backward
from reading their -inf logsumexp; this probe says which of those steps cuDNN already makes
unnecessary.

bf16, batch 2, 8 heads, 128 queries, 160 keys, head dim 64, a bias of shape (2, 1, 128, 160)
with fresh random values and 5 rows of each batch -inf throughout. For each kernel and with
the logsumexp asked for or not: the empty rows' output (all zeros, not finite, or the
largest magnitude), the other rows' largest error against float64 relative to the
reference's largest magnitude, the empty rows' logsumexp; and, with the logsumexp, a
backward through the operator: whether the gradients are finite, and the empty rows' dq.

    python benchmarks/probe_masked_rows.py [--json out.json]

Needs a CUDA GPU (exit status 2 without).
"""

from __future__ import annotations

import argparse

from _common import calls_since, emit, error_line, header, require_cuda  # (benchmarks/ on sys.path)

B, H, SQ, SKV, D = 2, 8, 128, 160, 64
EMPTY_ROWS = (0, 1, 63, 64, 127)


def inputs(torch, dev: str = "cuda"):
    bf16 = torch.bfloat16
    q, k, v = (torch.randn(B, H, n, D, device=dev, dtype=bf16) for n in (SQ, SKV, SKV))
    bias = torch.randn(B, 1, SQ, SKV, device=dev, dtype=bf16)
    bias[:, :, list(EMPTY_ROWS)] = float("-inf")
    return q, k, v, bias


def reference(torch, q, k, v, bias):
    """float64, the rows that keep a key (the empty rows' reference is zeros: PyTorch's math kernel)."""
    scores = q.double() @ k.double().transpose(-1, -2) / D ** 0.5 + bias.double()
    out = scores.softmax(-1) @ v.double()
    out[:, :, list(EMPTY_ROWS)] = 0
    return out


def describe(torch, t) -> str:
    if not torch.isfinite(t).all():
        return f"not finite ({int((~torch.isfinite(t)).sum())} of {t.numel()})"
    peak = float(t.abs().max()) if t.numel() else 0.0
    return "zeros" if peak == 0 else f"largest |x| {peak:.3g}"


def one(torch, lse: bool, dev: str = "cuda") -> dict:
    q, k, v, bias = inputs(torch, dev)
    rows = list(EMPTY_ROWS)
    others = [i for i in range(SQ) if i not in EMPTY_ROWS]
    want = reference(torch, q, k, v, bias)
    leaves = [t.clone().requires_grad_(lse) for t in (q, k, v)]
    row: dict = {"lse": lse}
    try:
        got = torch.ops.aten._scaled_dot_product_cudnn_attention(*leaves, bias, lse, 0.0, False, False)
        o, stats = got[0], got[1]
        torch.cuda.synchronize(dev)
    except Exception as e:
        return {**row, "failed": error_line(e)}
    out = o.detach()
    row["empty_rows_out"] = describe(torch, out[:, :, rows])
    row["other_rows_error"] = float((out[:, :, others].double() - want[:, :, others]).abs().max() / want.abs().max())
    if lse and stats.numel():
        lse_rows = stats.detach().reshape(B, H, SQ)[:, :, rows]
        row["empty_rows_lse"] = sorted({str(x) for x in lse_rows.flatten().tolist()})
    if lse:
        try:
            torch.autograd.backward(o, torch.randn_like(o))
            torch.cuda.synchronize(dev)
            row["grads_finite"] = all(bool(torch.isfinite(t.grad).all()) for t in leaves)
            row["empty_rows_dq"] = describe(torch, leaves[0].grad[:, :, rows])
        except Exception as e:
            row["backward_failed"] = error_line(e)
    return row


def summary(res: dict) -> list[str]:
    lines = []
    for kernel in ("pytorch", "fastattn"):
        for r in res[kernel]:
            what = r.get("failed") or (
                f"empty rows {r['empty_rows_out']}, other rows' error {r['other_rows_error']:.1e}"
                + (f", empty rows' lse {r.get('empty_rows_lse')}" if r["lse"] else "")
                + (f", backward: {r.get('backward_failed') or ('finite' if r['grads_finite'] else 'NOT finite')}"
                   f", empty rows' dq {r.get('empty_rows_dq')}" if r["lse"] else ""))
            lines.append(f"  {kernel:<9} lse={r['lse']!s:<5} {what}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    require_cuda("probe_masked_rows.py")
    import torch

    import fastattn
    import fastattn.torch as fat

    torch.manual_seed(0)
    res: dict = {**header(), "shape": [B, H, SQ, SKV, D], "empty_rows": list(EMPTY_ROWS), "pytorch": [],
                 "fastattn": []}
    for lse in (False, True):
        res["pytorch"].append(one(torch, lse))
    before = fastattn.stats()["sdpa"]
    fat.enable_sdpa()
    try:
        for lse in (False, True):
            res["fastattn"].append(one(torch, lse))
    finally:
        fat.disable_sdpa()
    # (a call passed on ran PyTorch's kernel: its rows say nothing of fastattn's)
    calls = res["fastattn_calls"] = calls_since(before, fastattn.stats()["sdpa"])
    emit(res, args.json, summary(res) + [f"  fastattn served {calls['served']} calls, passed on "
                                         f"{calls['passed_on'] or 'none'}"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
