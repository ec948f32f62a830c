"""Where does a plan cuDNN builds stop launching? PyTorch's
test_mem_eff_attention_fail_with_batch_size_geq_65536 found a plan for batch 65536 that the
probe called supported and whose execute failed (CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER):
a grid dimension past CUDA's 65535, most likely. This maps the bound on the loaded cuDNN and
GPU, across batch, heads and query length, forward and backward, bf16, tiny rows (s_q = s_kv
= 8 unless the case says, d = 64): for each case whether fastattn.probe builds it and whether
one forward (and backward) runs, each case in a child process of its own (a failed launch
can leave the CUDA context unusable). A case that builds and does not run is what fastattn
must never serve unrefused.

Needs a CUDA GPU; exits 2 with one line where there is none.

    python3 benchmarks/probe_launch_limits.py [--json FILE] [--quick]
    (tools/other_cudnn.sh run VERSION -- python3 benchmarks/probe_launch_limits.py: on another cuDNN)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _common import header, require_cuda, write_json  # (benchmarks/ on sys.path)

# (batch, heads_q, seqlen_q, seqlen_kv, training)
CASES = [
    (65535, 1, 8, 8, False), (65536, 1, 8, 8, False), (65537, 1, 8, 8, False), (131072, 1, 8, 8, False),
    (65535, 1, 8, 8, True), (65536, 1, 8, 8, True),
    (1, 65535, 8, 8, False), (1, 65536, 8, 8, False), (256, 256, 8, 8, False), (256, 257, 8, 8, False),
    (32768, 2, 8, 8, False), (32768, 4, 8, 8, False), (16384, 8, 8, 8, True),
    (1, 1, 65536 * 64, 64, False),  # query tiles past 65535 rows of 64 along one grid dimension
]
QUICK = CASES[:4] + CASES[6:8]


def run_case(case: tuple) -> dict:
    import torch

    import fastattn

    b, h, sq, skv, training = case
    cfg = fastattn.AttentionConfig(batch=b, heads_q=h, seqlen_q=sq, seqlen_kv=skv, head_dim_qk=64, dtype="bf16",
                                   layout="bshd", training=training)
    out = {"case": list(case)}
    r = fastattn.probe(cfg)
    out["supported"] = r.supported
    out["reason"] = None if r.supported else (r.reason or "").splitlines()[0][:200]
    if not r.supported:
        return out
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(b, sq, h, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=training)
    k = torch.randn(b, skv, h, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=training)
    v = torch.randn(b, skv, h, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=training)
    try:
        import fastattn.torch

        o = fastattn.torch.attention(q, k, v)
        torch.cuda.synchronize()
        out["forward"] = "ran"
        # Every row written and finite, and the last batch element right against PyTorch's math.
        ref = torch.nn.functional.scaled_dot_product_attention(*(t[-1:].transpose(1, 2).float() for t in (q, k, v)))
        out["forward_finite"] = bool(torch.isfinite(o).all())
        out["last_row_max_abs"] = float((o[-1:].transpose(1, 2).float() - ref).abs().max())
        if training:
            o.backward(torch.ones_like(o))
            torch.cuda.synchronize()
            out["backward"] = "ran"
            out["backward_finite"] = bool(all(torch.isfinite(t.grad).all() for t in (q, k, v)))
    except Exception as e:  # the finding: built, and did not run
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="the batch and heads bounds alone (6 cases)")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # (a child process's one case, as JSON)
    args = ap.parse_args()
    require_cuda("probe_launch_limits.py")
    if args.case:
        print(json.dumps(run_case(tuple(json.loads(args.case)))))
        return 0
    rows = []
    for case in QUICK if args.quick else CASES:
        p = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True, text=True,
                           timeout=600)
        try:
            row = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            row = {"case": list(case), "error": f"child exit {p.returncode}: {p.stderr.strip()[-300:]}"}
        rows.append(row)
        print(json.dumps(row))
    bad = [r for r in rows if r.get("supported") and "error" in r]
    print(f"summary: {len(rows)} cases; built but did not run: {[r['case'] for r in bad]}")
    write_json({**header(), "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
