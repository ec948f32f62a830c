"""Probes of one query against many keys (seqlen_q = 1), on the cases of FlashAttention's own
tests that catch one-query defects in fastattn.flash: are repeated calls bitwise equal (their
test_flash_attn_race_condition: seqlen_k 239, head dims 111 and 256), and are the
gradients right with softcap, MQA and a window in a varlen call (their
test_flash_attn_varlen_output: dq off by 7e19)? Each variant against float64, so that
the defect is narrowed to the feature that brings it.

    python benchmarks/probe_decode.py [--json out.json]
"""

from __future__ import annotations

import argparse
import math

import torch

from fastattn import flash
from fastattn.torch import attention
from _common import require_cuda, write_json  # (benchmarks/ on sys.path)

DEV = "cuda"


def repeats(b, sq, sk, h, d, dtype, lse: bool, via: str, n: int = 12) -> dict:
    """Whether n calls on the same inputs give bitwise equal outputs (and LSE)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device=DEV, dtype=dtype, generator=g) for s in (sq, sk, sk))

    def call():
        if via == "flash":
            o, m, _ = flash.flash_attn_func(q, k, v, 0.0, return_attn_probs=True)
            return o, m
        if via == "kvcache":  # a decode step against a dense cache (a padded plan of one query)
            return flash.flash_attn_with_kvcache(q, k, v, cache_seqlens=sk, return_softmax_lse=lse), None
        r = attention(q, k, v, return_lse=lse)
        return r if lse else (r, None)

    first = [t.clone() if t is not None else None for t in call()]
    torch.cuda.synchronize()
    bad = []
    for i in range(1, n):
        got = call()
        for name, a, b_ in zip(("o", "lse"), first, got):
            if a is not None and not torch.equal(a, b_):
                bad.append({"call": i, "tensor": name, "max_diff": (a.float() - b_.float()).abs().max().item(),
                            "rows_differing": int((a != b_).reshape(a.shape[0], -1).any(-1).sum().item())})
    return {"b": b, "sq": sq, "sk": sk, "h": h, "d": d, "dtype": str(dtype), "lse": lse, "via": via,
            "equal": not bad, "first_mismatches": bad[:4], "mismatching_calls": len({m["call"] for m in bad})}


def reference(q, k, v, cap, window, scale):
    """FlashAttention's semantics in float64 for one sequence (s, h, d): bottom-right
    window, softcap before the mask."""
    rep = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double() for t in (q, k, v))
    k64, v64 = k64.repeat_interleave(rep, 1), v64.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q64, k64) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    sq, sk = q.shape[0], k.shape[0]
    i = torch.arange(sq, device=q.device)[:, None] + sk - sq
    j = torch.arange(sk, device=q.device)[None, :]
    left, right = window
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v64)


def gradients(cap, hk, window, varlen: bool, deterministic: bool, sq=1, d=64, dtype=torch.bfloat16) -> dict:
    """Relative errors of o, dq, dk, dv against float64 for 4 sequences of sq queries and
    127..147 keys, 4 query heads."""
    torch.manual_seed(0)
    h, lens_k = 4, [147, 131, 140, 127]
    b = len(lens_k)
    scale = 1 / math.sqrt(d)
    qs = [(torch.randn(sq, h, d, device=DEV, dtype=dtype) * (cap or 1)) for _ in lens_k]
    ks = [torch.randn(n, hk, d, device=DEV, dtype=dtype) for n in lens_k]
    vs = [torch.randn(n, hk, d, device=DEV, dtype=dtype) for n in lens_k]
    gs = [torch.randn(sq, h, d, device=DEV, dtype=dtype) for _ in lens_k]
    if varlen:
        q, k, v = (torch.cat(t).requires_grad_() for t in (qs, ks, vs))
        cu_q = torch.tensor([i * sq for i in range(b + 1)], dtype=torch.int32, device=DEV)
        cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=DEV)
        o = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, sq, max(lens_k), 0.0, softcap=cap,
                                         window_size=window, deterministic=deterministic)
        os_ = list(o.split([sq] * b))
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.cat(gs))
        dqs, dks, dvs = dq.split([sq] * b), dk.split(lens_k), dv.split(lens_k)
    else:  # same key length for all: the first's
        n = lens_k[0]
        q = torch.stack(qs).requires_grad_()
        k = torch.stack([t[:n] if t.shape[0] >= n else torch.cat([t, t])[:n] for t in ks]).requires_grad_()
        v = torch.stack([t[:n] if t.shape[0] >= n else torch.cat([t, t])[:n] for t in vs]).requires_grad_()
        ks, vs = list(k.detach()), list(v.detach())
        o = flash.flash_attn_func(q, k, v, 0.0, softcap=cap, window_size=window, deterministic=deterministic)
        os_ = list(o)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.stack(gs))
        dqs, dks, dvs = list(dq), list(dk), list(dv)
    worst = {"o": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    finite = all(torch.isfinite(t).all().item() for t in (o, dq, dk, dv))
    for i in range(b):
        qi, ki, vi = (t.detach().double().requires_grad_() for t in (qs[i], ks[i], vs[i]))
        ref = reference(qi, ki, vi, cap, window, scale)
        rq, rk, rv = torch.autograd.grad(ref, (qi, ki, vi), gs[i].double())
        for name, got, want in (("o", os_[i], ref), ("dq", dqs[i], rq), ("dk", dks[i], rk), ("dv", dvs[i], rv)):
            err = (got.double() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
            worst[name] = max(worst[name], err)
    return {"softcap": cap, "heads_k": hk, "window": list(window), "varlen": varlen, "deterministic": deterministic,
            "sq": sq, "finite": finite, **{f"rel_err_{k_}": round(v_, 5) for k_, v_ in worst.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    require_cuda("probe_decode.py")
    out = {"repeats": [], "gradients": []}
    for d in (64, 111, 128, 256):
        for via, lse in (("flash", True), ("torch", True), ("torch", False)):
            if d % 8 and via == "torch":
                continue
            out["repeats"].append(repeats(60, 1, 239, 4, d, torch.float16, lse, via))
    out["repeats"].append(repeats(60, 1, 239, 4, 128, torch.float16, False, "kvcache"))
    out["repeats"].append(repeats(60, 2, 239, 4, 256, torch.float16, True, "torch"))
    out["repeats"].append(repeats(4, 1, 239, 4, 256, torch.float16, True, "torch"))
    for cap in (0.0, 50.0):
        for hk in (1, 4):
            for window in ((-1, -1), (40, 7)):
                for varlen in (True, False):
                    for det in (False, True):
                        try:
                            out["gradients"].append(gradients(cap, hk, window, varlen, det))
                        except Exception as e:  # noqa: BLE001 - a probe reports what refused
                            out["gradients"].append({"softcap": cap, "heads_k": hk, "window": list(window),
                                                     "varlen": varlen, "deterministic": det,
                                                     "error": f"{type(e).__name__}: {e}"[:300]})
    out["gradients"].append(gradients(50.0, 1, (40, 7), True, False, sq=2))
    write_json(out, args.json)
    print("summary:")
    for r in out["repeats"]:
        print(f"repeats d={r['d']} sq={r['sq']} b={r['b']} via={r['via']} lse={r['lse']}: "
              f"{'equal' if r['equal'] else 'DIFFER'} {r['first_mismatches'][:2]}")
    for r in out["gradients"]:
        print("grads", {k: v for k, v in r.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
