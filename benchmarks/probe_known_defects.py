"""The publicly reported cuDNN attention defects, each tried on the cuDNN this process loads:
does the plain graph (fastattn.defects' remedies off) show it, and is fastattn's graph (the
registry's decision) right? docs/VERIFICATION.md lists the outcome per cuDNN version.

Cases (bf16 unless named; inputs where it matters are the adversarial rows of
tests/attention/test_numerics_gpu.py, every logit ~ -120, so each row's log-sum-exp is far
below -88.7):
  kv-tail        cudnn-frontend#628: SM90 backward, s_kv = 192 (64 mod 128), no mask: NaN d_q
  single-query   cudnn-frontend#1072: B=1, Hq=Hkv=2, s_q=1, s_kv=128, D=64: NaN d_k and d_v
  tiny-bwd-plan  cudnn-frontend#1071: B=Hq=Hkv=s_q=1, s_kv=128, D=64: building the backward
                 plan crashes the process (each case runs in a child process: a crash is a finding)
  kv-length-1    cuDNN 9.18.1's release notes: no backward for s_kv = 1 (refused, or how wrong)
  gqa-causal-decode  the same notes: s_q=1, causal (top left and bottom right), Hq=8, Hkv=2: wrong output
  stats-layout   cudnn-frontend#304: softmax stats in a non-BHSD layout give wrong gradients
                 before 9.26: fastattn's stats are always (batch, heads, seqlen_q, 1)
                 contiguous (fastattn/config.py), so it cannot reach it: recorded, not run.

Each run case gives: whether cuDNN supports it, whether every output is finite, the largest
relative error against a float64 reference (forward output and each gradient), plain and
remedied. Needs a CUDA GPU and PyTorch; exits 2 with one line where there is none.

    python3 benchmarks/probe_known_defects.py [--json FILE]
    (tools/other_cudnn.sh run VERSION -- python3 benchmarks/probe_known_defects.py: on another cuDNN)
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

from _common import header, require_cuda, write_json  # (benchmarks/ on sys.path)

CASES = {
    # name: (batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim, mask, training, adversarial)
    "kv-tail": (1, 2, 2, 192, 192, 64, "none", True, True),
    "single-query": (1, 2, 2, 1, 128, 64, "none", True, True),
    "tiny-bwd-plan": (1, 1, 1, 1, 128, 64, "none", True, False),
    "kv-length-1": (2, 4, 4, 16, 1, 64, "none", True, False),
    "gqa-causal-decode": (2, 8, 2, 1, 256, 128, "causal", False, False),
    "gqa-causal-decode-br": (2, 8, 2, 1, 256, 128, "causal_bottom_right", False, False),
}


def run_case(name: str, which: str) -> dict:
    import torch

    import fastattn
    from fastattn import AttentionConfig, _core, _loader

    _loader.ensure_loaded()
    b, hq, hkv, sq, skv, d, mask, training, adversarial = CASES[name]
    cfg = AttentionConfig(batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_kv=skv, head_dim_qk=d,
                          dtype="bf16", layout="bhsd", mask=mask, training=training)
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, hq, sq, d, device="cuda", generator=g) * (0.1 if adversarial else 1.0)
    k = torch.randn(b, hkv, skv, d, device="cuda", generator=g) * (0.1 if adversarial else 1.0)
    v = torch.randn(b, hkv, skv, d, device="cuda", generator=g)
    d_o = torch.randn(b, hq, sq, d, device="cuda", generator=g)
    if adversarial:
        q[..., 0] = 1.0
        k[..., 0] = -120.0 * math.sqrt(d)
    q, k, v, d_o = (t.to(torch.bfloat16) for t in (q, k, v, d_o))
    ref = _reference(q, k, v, d_o, mask, training)
    out: dict = {"case": name, "cudnn": fastattn.versions()["cudnn_loaded"], "config": cfg.to_dict()}
    for label, registry in (("plain", ()), ("fastattn", None)):
        if label != which:
            continue
        try:
            plan = _core.build_plan(cfg, torch.cuda.current_device(), registry=registry)
        except fastattn.NotSupportedError as e:
            out[label] = {"supported": False, "reason": str(e).splitlines()[0][:300]}
            continue
        got = _execute(plan, q, k, v, d_o, training)
        row = {"supported": True, "avoided": [x.name for x in plan.defects.avoided]}
        for key, x in got.items():
            # Both errors: a gradient that is zero in exact arithmetic (one key: softmax's is)
            # makes a relative error meaningless.
            # (None for a non-finite error: the results are strict JSON)
            row[key] = {"finite": bool(torch.isfinite(x).all()),
                        "rel_error": _finite(float((x.double() - ref[key]).norm() / ref[key].norm().clamp_min(1e-30))),
                        "max_abs_error": _finite(float((x.double() - ref[key]).abs().max())),
                        "max_abs_reference": float(ref[key].abs().max())}
        out[label] = row
    return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _reference(q, k, v, d_o, mask, training):
    import torch

    q, k, v, d_o = (t.double().detach().requires_grad_(t is not d_o) for t in (q, k, v, d_o))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    sq, skv = s.shape[-2:]
    if mask != "none":
        shift = skv - sq if mask == "causal_bottom_right" else 0
        keep = torch.ones(sq, skv, dtype=torch.bool, device=s.device).tril(shift)
        s = s.masked_fill(~keep, float("-inf"))
    o = torch.softmax(s, -1) @ vv
    out = {"o": o.detach()}
    if training:
        o.backward(d_o)
        out.update(d_q=q.grad, d_k=k.grad, d_v=v.grad)
    return out


def _execute(plan, q, k, v, d_o, training):
    import torch

    o = torch.full_like(q, float("nan"))
    stats = torch.full(q.shape[:3] + (1,), float("nan"), device="cuda", dtype=torch.float32)
    ws = torch.empty(max(plan.workspace_size, 1), device="cuda", dtype=torch.uint8)
    stream = torch.cuda.current_stream().cuda_stream
    plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                 stats=stats.data_ptr() if training else 0, workspace=ws.data_ptr(), stream=stream)
    got = {"o": o}
    if training:
        d_q, d_k, d_v = (torch.full_like(x, float("nan")) for x in (q, k, v))
        plan.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(),
                      d_q.data_ptr(), d_k.data_ptr(), d_v.data_ptr(), workspace=ws.data_ptr(), stream=stream)
        got.update(d_q=d_q, d_k=d_k, d_v=d_v)
    torch.cuda.synchronize()
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    # One case and graph, in a child process: a crash takes that one alone.
    ap.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)
    ap.add_argument("--graph", choices=("plain", "fastattn"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.graph)))
        return 0
    require_cuda("probe_known_defects.py")
    results = []
    for name in CASES:
        row: dict = {"case": name}
        for graph in ("plain", "fastattn"):
            r = subprocess.run([sys.executable, __file__, "--case", name, "--graph", graph], capture_output=True,
                               text=True, timeout=300)
            if r.returncode == 0:
                got = json.loads(r.stdout.strip().splitlines()[-1])
                row.update({k: v for k, v in got.items() if k != graph}, **{graph: got[graph]})
            else:  # a crash (negative: the signal) is what a case may find
                row[graph] = {"exit": r.returncode, "stderr": r.stderr.strip()[-400:]}
        results.append(row)
    results.append({"case": "stats-layout", "run": False,
                    "why": "fastattn's stats are (batch, heads, seqlen_q, 1) contiguous in every layout"})
    for r in results:
        line = {k: r[k] for k in r if k not in ("config",)}
        print(json.dumps(line))
    write_json({**header(), "results": results}, args.json)
    print("summary:", "; ".join(_summary(r) for r in results))
    return 0


def _summary(r: dict) -> str:
    if not r.get("run", True):
        return f"{r['case']}: not run"
    parts = []
    for label in ("plain", "fastattn"):
        x = r.get(label, {})
        if "exit" in x:
            parts.append(f"{label}: process exit {x['exit']}")
            continue
        if not x.get("supported"):
            parts.append(f"{label} refused")
            continue
        keys = [k for k in ("o", "d_q", "d_k", "d_v") if k in x]
        bad = [k for k in keys if not x[k]["finite"]]
        worst = max(x[k]["rel_error"] if x[k]["rel_error"] is not None else math.inf for k in keys)
        worst_abs = max(x[k]["max_abs_error"] if x[k]["max_abs_error"] is not None else math.inf for k in keys)
        parts.append(f"{label} {'NaN in ' + ','.join(bad) if bad else 'finite'} (max rel err {worst:.2g}, "
                     f"abs {worst_abs:.2g})")
    return f"{r['case']} (cuDNN {r.get('cudnn')}): " + ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
