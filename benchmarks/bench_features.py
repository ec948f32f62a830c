"""Measured: decode with a paged KV cache, prefill of packed variable-length
sequences, each against PyTorch SDPA on the same data where PyTorch can express it.

(a) Decode: 64 sequences, one query token each, KV lengths drawn from 512 ... 8192,
    32 query heads, 8 KV heads, head dim 128, bf16. fastattn reads K and V from a paged
    pool (pages of 64 tokens, shuffled) through page tables; also fastattn on the same
    KV laid out densely (padding=True); PyTorch SDPA on the dense KV with a boolean
    mask for each sequence's length (SDPA has no paged or per-sequence-length input;
    it picks its own backend for a masked call); and fastattn.torch.attention_paged on
    the paged pool. Reported: us per call and the KV
    bytes actually attended over time (GB/s).
(b) Prefill: 8 sequences of 256 ... 4096 tokens packed one after another (THD), causal,
    the same heads and dims. fastattn runs one ragged plan over the packed batch;
    PyTorch SDPA (cuDNN, then flash backend) runs once per sequence, which is what
    PyTorch users do without a variable-length entry point. Reported: ms per batch
    and TFLOP/s on the real (causal) work.

Outputs are compared with PyTorch's (relative error) before timing. Times are CUDA
events around 20 back-to-back repetitions, median of 5.

    python benchmarks/bench_features.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastattn
import fastattn.torch as fat
from _common import emit, gpu_ms, require_cuda

HQ, HKV, D, PAGE = 32, 8, 128, 64
DT = torch.bfloat16


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def decode(batch: int = 64, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(512, 8193, (batch,), generator=g).tolist()
    smax = max(lens)
    stream = torch.cuda.current_stream().cuda_stream
    q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=DT)
    # The dense KV: (b, smax, hkv, d), zeros past each length (finite, as cuDNN needs).
    k = torch.zeros(batch, smax, HKV, D, device="cuda", dtype=DT)
    v = torch.zeros_like(k)
    for b, n in enumerate(lens):
        k[b, :n].normal_()
        v[b, :n].normal_()
    seq_q, seq_kv = _i32([1] * batch), _i32(lens)

    # The paged pool: each sequence's pages, shuffled.
    per_seq = -(-smax // PAGE)
    used = [-(-n // PAGE) for n in lens]
    num_pages = sum(used)
    order = torch.randperm(num_pages, generator=g).tolist()
    pool_k = torch.zeros(num_pages, PAGE, HKV, D, device="cuda", dtype=DT)
    pool_v = torch.zeros_like(pool_k)
    table = torch.zeros(batch, 1, per_seq, 1, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(lens):
        for i in range(used[b]):
            p = order[nxt]
            nxt += 1
            table[b, 0, i, 0] = p
            rows = slice(i * PAGE, min(n, (i + 1) * PAGE))
            pool_k[p, :rows.stop - rows.start] = k[b, rows]
            pool_v[p, :rows.stop - rows.start] = v[b, rows]
    table = table.cuda()

    base = dict(batch=batch, heads_q=HQ, heads_kv=HKV, seqlen_q=1, seqlen_kv=smax, head_dim_qk=D, dtype="bf16",
                padding=True)
    paged = fastattn.plan(fastattn.AttentionConfig(**base, page_size=PAGE, num_pages=num_pages))
    dense = fastattn.plan(fastattn.AttentionConfig(**base))
    o_paged, o_dense = torch.empty_like(q), torch.empty_like(q)
    ws_p = torch.empty(max(paged.workspace_size, 1), dtype=torch.uint8, device="cuda")
    ws_d = torch.empty(max(dense.workspace_size, 1), dtype=torch.uint8, device="cuda")

    def run_paged():
        paged.forward(q.data_ptr(), pool_k.data_ptr(), pool_v.data_ptr(), o_paged.data_ptr(), workspace=ws_p.data_ptr(),
                      stream=stream, seq_len_q=seq_q.data_ptr(), seq_len_kv=seq_kv.data_ptr(),
                      page_table_k=table.data_ptr(), page_table_v=table.data_ptr())

    table_2d, torch_paged = table.view(batch, per_seq), [None]

    def run_torch_paged():  # fastattn.torch.attention_paged on the same pool: the PyTorch entry point
        with torch.no_grad():
            torch_paged[0] = fat.attention_paged(q, pool_k, pool_v, table_2d, seq_kv)

    def run_dense():
        dense.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o_dense.data_ptr(), workspace=ws_d.data_ptr(),
                      stream=stream, seq_len_q=seq_q.data_ptr(), seq_len_kv=seq_kv.data_ptr())

    # SDPA: (b, h, s, d) views, GQA by enable_gqa, each sequence's length as a mask.
    mask = (torch.arange(smax, device="cuda")[None, :] < seq_kv[:, None].long())[:, None, None, :]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def run_torch():
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)

    run_paged()
    run_dense()
    run_torch_paged()
    ref = run_torch().transpose(1, 2)
    torch.cuda.synchronize()
    kv_bytes = sum(lens) * HKV * D * 2 * 2  # k and v, bf16
    res = {"batch": batch, "kv_tokens": sum(lens), "max_kv": smax, "num_pages": num_pages,
           "rel_error_paged_vs_torch": _rel(o_paged, ref), "rel_error_dense_vs_torch": _rel(o_dense, ref),
           "rel_error_torch_paged_vs_torch": _rel(torch_paged[0], ref)}
    for name, fn in (("fastattn_paged", run_paged), ("fastattn_torch_paged", run_torch_paged),
                     ("fastattn_dense", run_dense), ("torch_sdpa_masked", run_torch)):
        ms = gpu_ms(fn)
        res[name] = {"us": round(ms * 1e3, 2), "kv_GBps": round(kv_bytes / (ms * 1e-3) / 1e9, 1)}
    res["ratio_torch_to_paged"] = res["torch_sdpa_masked"]["us"] / res["fastattn_paged"]["us"]
    return res


def prefill(count: int = 8, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(256, 4097, (count,), generator=g).tolist()
    smax, total = max(lens), sum(lens)
    stream = torch.cuda.current_stream().cuda_stream
    q = torch.randn(total, HQ, D, device="cuda", dtype=DT)
    k = torch.randn(total, HKV, D, device="cuda", dtype=DT)
    v = torch.randn(total, HKV, D, device="cuda", dtype=DT)
    o = torch.empty_like(q)
    cu = torch.tensor([0] + lens).cumsum(0)
    offs_q = (cu * HQ * D).to(torch.int32).cuda()
    offs_kv = (cu * HKV * D).to(torch.int32).cuda()
    seq = _i32(lens)
    cfg = fastattn.AttentionConfig(batch=count, heads_q=HQ, heads_kv=HKV, seqlen_q=smax, head_dim_qk=D, dtype="bf16",
                                   mask="causal", padding=True, ragged=True, max_tokens_q=total, max_tokens_kv=total)
    plan = fastattn.plan(cfg)
    ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")

    def run_fastattn():
        plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), workspace=ws.data_ptr(), stream=stream,
                     seq_len_q=seq.data_ptr(), seq_len_kv=seq.data_ptr(), ragged_q=offs_q.data_ptr(),
                     ragged_k=offs_kv.data_ptr(), ragged_v=offs_kv.data_ptr(), ragged_o=offs_q.data_ptr())

    # PyTorch: one SDPA per sequence on (1, h, n, d) views of the packed tensors.
    views = [(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None])
             for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]

    def run_torch():
        return [torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
                for a, b, c in views]

    run_fastattn()
    with sdpa_kernel(SDPBackend.MATH):
        refs = run_torch()
    torch.cuda.synchronize()
    err = max(_rel(o[a:b], r[0].transpose(0, 1)) for a, b, r in zip(cu[:-1].tolist(), cu[1:].tolist(), refs))
    flops = sum(4 * n * n * HQ * D / 2 for n in lens)  # causal: half the square
    res = {"lengths": lens, "tokens": total, "max_rel_error_vs_torch_math": err}
    res["fastattn_packed"] = _timed(run_fastattn, flops)
    for name, backend in (("torch_cudnn_per_sequence", SDPBackend.CUDNN_ATTENTION),
                          ("torch_flash_per_sequence", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                res[name] = _timed(run_torch, flops)
        except RuntimeError as e:  # a backend that refuses these inputs
            res[name] = {"error": str(e)[:300]}
    for name in ("torch_cudnn_per_sequence", "torch_flash_per_sequence"):
        if "ms" in res[name]:
            res[f"ratio_{name}_to_fastattn"] = res[name]["ms"] / res["fastattn_packed"]["ms"]
    return res


def support() -> list[dict]:
    """What cuDNN accepts on this GPU for feature combinations the tests do not all cover:
    each probed (forward and, when training, backward built), with cuDNN's reason when not."""
    base = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=256, head_dim_qk=128, dtype="bf16")
    cases = [dict(bias=s, training=True, bias_grad=g) for s in ("11ss", "1hss", "b1ss", "bhss") for g in (False, True)]
    cases += [dict(dropout=0.1, training=True, mask="causal"), dict(dropout=0.1, mask="causal_bottom_right"),
              dict(sinks=True, training=True, mask="causal"), dict(sinks=True, seqlen_q=1, seqlen_kv=256),
              dict(alibi=True, bias="1hss", mask="causal"), dict(padding=True, ragged=True, training=True,
                                                                  deterministic=True),
              dict(padding=True, ragged=True, bias="1hss", training=True),
              dict(padding=True, seqlen_q=1, page_size=16), dict(padding=True, seqlen_q=1, page_size=64,
                                                                 head_dim_qk=256),
              dict(padding=True, ragged=True, page_size=64, seqlen_q=16)]
    out = []
    for extra in cases:
        cfg = fastattn.AttentionConfig(**{**base, **extra})
        r = fastattn.probe(cfg)
        out.append({"features": extra, "supported": r.supported, "reason": r.reason})
    return out


def _timed(fn, flops: float) -> dict:
    ms = gpu_ms(fn)
    return {"ms": round(ms, 4), "tflops": round(flops / (ms * 1e-3) / 1e12, 1)}


def summary(res: dict) -> str:
    d, p = res["decode"], res["prefill"]
    lines = ["support (probe of feature combinations):"]
    for c in res["support"]:
        lines.append(f"  {json.dumps(c['features'], separators=(',', ':'))}: "
                     + ("yes" if c["supported"] else f"no: {c['reason'][:160]}"))
    lines += [f"decode: {d['batch']} sequences, {d['kv_tokens']} KV tokens (max {d['max_kv']}), "
             f"errors vs torch: paged {d['rel_error_paged_vs_torch']:.1e}, dense {d['rel_error_dense_vs_torch']:.1e}, "
             f"fastattn.torch paged {d['rel_error_torch_paged_vs_torch']:.1e}"]
    for name in ("fastattn_paged", "fastattn_torch_paged", "fastattn_dense", "torch_sdpa_masked"):
        lines.append(f"  {name:<22} {d[name]['us']:9.1f} us  {d[name]['kv_GBps']:8.1f} GB/s")
    lines.append(f"  torch / fastattn paged: {d['ratio_torch_to_paged']:.2f}x")
    lines.append(f"prefill: {len(p['lengths'])} packed sequences, {p['tokens']} tokens, causal, "
                 f"max error vs torch math {p['max_rel_error_vs_torch_math']:.1e}")
    for name in ("fastattn_packed", "torch_cudnn_per_sequence", "torch_flash_per_sequence"):
        r = p[name]
        lines.append(f"  {name:<26} " + (f"{r['ms']:8.3f} ms  {r['tflops']:6.1f} TFLOP/s" if "ms" in r
                                          else f"error: {r['error'][:80]}"))
    for key in ("ratio_torch_cudnn_per_sequence_to_fastattn", "ratio_torch_flash_per_sequence_to_fastattn"):
        if key in p:
            lines.append(f"  {key}: {p[key]:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    require_cuda("bench_features.py")
    res = {"support": support(), "decode": decode(), "prefill": prefill(), "device": fastattn.device_info(), "versions": fastattn.versions(),
           "torch": torch.__version__}
    emit(res, args.json, summary(res).splitlines())
    return 0


if __name__ == "__main__":
    sys.exit(main())
