"""fastattn.flash against FlashAttention 2 as PyTorch ships it (the flash backend of
scaled_dot_product_attention, and its varlen kernel through aten._flash_attention_*), in
one process on one GPU (target: at least 1.6x FA2's TFLOP/s).

(a) Forward and forward+backward TFLOP/s on 2x16x8192x128 causal and not, 4x32x2048x64
    causal and not, and a varlen batch (16 sequences of 256-4096 tokens, 16 heads, dim
    128, causal), bf16, timed with CUDA events over rotating inputs; rounds interleave
    the peers, and each number is the median over rounds, each ratio the median of the
    rounds' ratios.
(b) Host time per call on a small shape (1x8x128x64 bf16 causal, inference; the
    varlen call on 4 sequences of 32 tokens; a paged decode of 4 sequences of 1000
    cached tokens, beside FA2 on the same KV laid out densely): fastattn.flash, fastattn.torch (what
    fastattn.flash adds on top) and FA2, interleaved rounds, medians.

(c) The composed paths (block tables, sinks, ...), TFLOP/s beside FA2 on the same shapes and beside fastattn's own
    call without the feature (what the composition costs): flash_attn_varlen_func with a
    block table (FA2 through PyTorch's varlen kernel with that block table where this
    PyTorch takes one, and on the same K/V packed), flash_attn_with_kvcache appending a
    chunk with the rotary embedding and with cache_leftpad (FA2 attends only: fastattn's
    time also holds the append and the rotation), ALiBi with random slopes not causal
    (the additive bias; FA2 with alibi_slopes, forward), a head dim of 111 (padded to 112;
    FA2 is SDPA's flash backend, which pads too), forward and where it applies backward.

    python benchmarks/bench_flash.py [--json out.json] [--rounds N] [--reps N] [--quick]

Prints the JSON, then a `summary:` block last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastattn.torch as fat
from fastattn import flash
from _common import emit, fa2_varlen, header, require_cuda  # (benchmarks/ is on sys.path)

BF16 = torch.bfloat16


def _fa2_dense(q, k, v, causal):
    """FA2 on bshd tensors through SDPA's flash backend (it takes (b, h, s, d) views)."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)


def _flops(pairs: float, h: int, d: int, backward: bool) -> float:
    """pairs: query-key pairs per head (s*s, halved by a causal mask)."""
    f = 4 * pairs * h * d
    return f * (3.5 if backward else 1.0)  # timed forward + backward (~2.5x the forward's matmul work)


def _time_ms(step, n_inputs: int, reps: int) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(reps):
        step(i % n_inputs)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _modes(call, inputs):
    """fwd: inference; bwd: forward and backward through autograd."""
    def fwd(i):
        with torch.no_grad():
            call(*inputs[i])

    def bwd(i):
        q, k, v = inputs[i][:3]
        o = call(*inputs[i])
        torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    return {"fwd": fwd, "bwd": bwd}


def _dense_case(b, h, s, d, causal):
    inputs = [tuple(torch.randn(b, s, h, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
              + (causal,) for _ in range(3)]
    pairs = b * s * s * (0.5 if causal else 1.0)
    peers = {"fastattn": lambda q, k, v, c: flash.flash_attn_func(q, k, v, causal=c), "fa2": _fa2_dense}
    return f"{b}x{h}x{s}x{d}", inputs, pairs, h, d, peers


def _varlen_case(causal=True, h=16, d=128):
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(256, 4097, (16,), generator=g).tolist()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    total, longest = sum(lens), max(lens)
    inputs = [tuple(torch.randn(total, h, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
              + (cu, cu, longest, longest, causal) for _ in range(3)]
    pairs = sum(n * n * (0.5 if causal else 1.0) for n in lens)
    peers = {"fastattn": lambda q, k, v, cq, ck, mq, mk, c: flash.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk,
                                                                                          causal=c),
             "fa2": fa2_varlen}
    return f"varlen16x{h}x{total}x{d}", inputs, pairs, h, d, peers


def throughput(rounds: int, reps: int) -> list[dict]:
    cases = [_dense_case(2, 16, 8192, 128, c) for c in (False, True)]
    cases += [_dense_case(4, 32, 2048, 64, c) for c in (False, True)]
    cases.append(_varlen_case())
    rows = []
    for name, inputs, pairs, h, d, peers in cases:
        row = {"shape": name, "causal": bool(inputs[0][-1])}
        for mode in ("fwd", "bwd"):
            steps = {}
            for peer, call in peers.items():
                try:
                    step = _modes(call, inputs)[mode]
                    for i in range(3):  # warm-up: plans, kernels
                        step(i)
                    steps[peer] = step
                except Exception as e:  # a peer PyTorch lacks here: recorded, not fatal
                    row[f"{peer}_{mode}_error"] = f"{type(e).__name__}: {e}"[:300]
            samples = {peer: [] for peer in steps}
            for _ in range(rounds):  # interleaved: drift hits every peer alike
                for peer, step in steps.items():
                    samples[peer].append(_flops(pairs, h, d, mode == "bwd") / _time_ms(step, 3, reps) / 1e9)
            for peer, s in samples.items():
                row[f"{peer}_{mode}_tflops"] = statistics.median(s)
            if len(samples) == 2:
                row[f"ratio_{mode}_fastattn_to_fa2"] = statistics.median(
                    a / b for a, b in zip(samples["fastattn"], samples["fa2"]))
        rows.append(row)
    return rows


# -- the composed paths, each beside FA2 on the same shapes and beside fastattn's own call
# without the new feature ("direct": what the composition costs) -----------------------------

def _aten_fa2(q, k, v, cu_q, cu_k, max_q, max_k, causal, **kw):
    """FA2's varlen forward as PyTorch ships it (its bottom-right causal, GQA, and where this
    PyTorch has them alibi_slopes and block_table): the output."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, **kw)[0]


def _cu(lens) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _causal_pairs(n_q: int, n_k: int) -> float:
    """Query-key pairs of a bottom-right causal mask (query i sees keys up to i + n_k - n_q)."""
    return n_q * (n_k - n_q) + n_q * (n_q + 1) / 2 if n_q <= n_k else n_k * (n_k + 1) / 2


def _paged_varlen(h=16, d=128, page=256):
    """flash_attn_varlen_func with a block table: 8 causal prefills of 1024-4096 tokens whose
    K/V sit in shuffled 256-token pages (FA2's page size), forward. FA2: PyTorch's varlen
    kernel with that block table where it takes one, and on the same K/V packed."""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1024, 4097, (8,), generator=g).tolist()
    n_pages = [-(-n // page) for n in lens]
    width = max(n_pages)
    perm = torch.randperm(2 * sum(n_pages), generator=g)
    table = torch.zeros(8, width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = perm[at:at + n]
        table[b, n:] = perm[at]  # unused entries: any valid page
        at += n
    table = table.cuda()
    k_pool, v_pool = (torch.randn(len(perm), page, h, d, device="cuda", dtype=BF16) for _ in range(2))
    packed = [torch.cat([pool[table[b, :n_pages[b]].long()].reshape(-1, h, d)[:lens[b]] for b in range(8)])
              for pool in (k_pool, v_pool)]
    q = torch.randn(sum(lens), h, d, device="cuda", dtype=BF16)
    cu, longest = _cu(lens), max(lens)
    peers = {
        "fastattn": lambda: flash.flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, longest, longest, causal=True,
                                                         block_table=table),
        "fastattn_direct": lambda: flash.flash_attn_varlen_func(q, *packed, cu, cu, longest, longest, causal=True),
        "fa2": lambda: _aten_fa2(q, *packed, cu, cu, longest, longest, True),
        "fa2_paged": lambda: _aten_fa2(q, k_pool, v_pool, cu, cu, longest, longest, True, block_table=table),
    }
    pairs = sum(_causal_pairs(n, n) for n in lens)
    return {"path": "block_table varlen", "shape": f"8 seqs 1024-4096 x{h}x{d} page {page} causal",
            "modes": {"fwd": peers}, "flops": 4 * pairs * h * d}


def _kvcache_chunk(rotary: bool, leftpad: bool, b=8, new=256, cache=4096, h=32, h_kv=8, d=128):
    """flash_attn_with_kvcache appending a chunk of `new` tokens per sequence to a cache
    filled to cache - new (GQA 32/8, causal), with the rotary embedding (cos, sin over the
    whole head dim, not interleaved) or cache_leftpad (each sequence's first 0-1023 cache
    rows unused). fastattn also writes k, v into the cache (and rotates q and k); FA2 here
    only attends (PyTorch's varlen kernel on the same keys, packed): the append and the
    rotation are in fastattn's time alone."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, new, h, d, device="cuda", dtype=BF16)
    k_new, v_new = (torch.randn(b, new, h_kv, d, device="cuda", dtype=BF16) for _ in range(2))
    k_cache, v_cache = (torch.randn(b, cache, h_kv, d, device="cuda", dtype=BF16) for _ in range(2))
    seqlens = torch.full((b,), cache - new, dtype=torch.int32, device="cuda")
    pad = (torch.randint(0, 1024, (b,), generator=g) if leftpad else torch.zeros(b, dtype=torch.int64)).tolist()
    kw = {}
    if rotary:
        angle = torch.rand(cache, d // 2, generator=g) * 6.2832
        kw.update(rotary_cos=torch.cos(angle).to("cuda", BF16), rotary_sin=torch.sin(angle).to("cuda", BF16))
    if leftpad:
        kw["cache_leftpad"] = torch.tensor(pad, dtype=torch.int32, device="cuda")
    used = [cache - p for p in pad]
    k_packed, v_packed = (torch.cat([c[i, pad[i]:] for i in range(b)]) for c in (k_cache, v_cache))
    q_packed = q.reshape(b * new, h, d)
    cu_q, cu_k = _cu([new] * b), _cu(used)
    peers = {
        "fastattn": lambda: flash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                          causal=True, **kw),
        "fastattn_direct": lambda: flash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                                 cache_seqlens=seqlens, causal=True),
        "fa2": lambda: _aten_fa2(q_packed, k_packed, v_packed, cu_q, cu_k, new, max(used), True),
    }
    pairs = sum(_causal_pairs(new, n) for n in used)
    what = "rotary kvcache" if rotary else "cache_leftpad kvcache"
    return {"path": what, "shape": f"{b}x{h}/{h_kv}x{d}, {new} new tokens onto {cache - new} cached, causal",
            "modes": {"fwd": peers}, "flops": 4 * pairs * h * d}


def _alibi(b=2, h=16, s=4096, d=128):
    """ALiBi with random slopes, not causal: fastattn's additive bias (cuDNN's own ALiBi
    is causal with the paper's slopes only). FA2: PyTorch's varlen kernel with
    alibi_slopes, forward (its backward there takes no slopes); direct: no ALiBi."""
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
    slopes = torch.rand(b, h, device="cuda") * 0.3
    cu = _cu([s] * b)
    flat = [t.detach().reshape(b * s, h, d) for t in (q, k, v)]

    def fwd(fn):
        def step():
            with torch.no_grad():
                fn()
        return step

    def bwd(fn):
        def step():
            o = fn()
            torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        return step

    def ours():
        return flash.flash_attn_func(q, k, v, alibi_slopes=slopes)

    def direct():
        return flash.flash_attn_func(q, k, v)

    return {"path": "ALiBi as bias", "shape": f"{b}x{h}x{s}x{d} random slopes, not causal",
            "modes": {"fwd": {"fastattn": fwd(ours), "fastattn_direct": fwd(direct),
                              "fa2": lambda: _aten_fa2(*flat, cu, cu, s, s, False, alibi_slopes=slopes)},
                      "bwd": {"fastattn": bwd(ours), "fastattn_direct": bwd(direct)}},
            "flops": 4 * b * s * s * h * d}


def _padded_head_dim(b=2, h=16, s=4096, d=111):
    """A head dim that is not a multiple of 8 (fastattn pads q, k, v to the next one, a copy
    of each, and cuts o back), causal, forward and forward+backward. FA2: SDPA's flash
    backend (which pads too); direct: fastattn at the padded head dim (no copies)."""
    pad = d + (-d % 8)
    qkv = [torch.randn(b, s, h, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3)]
    qkv8 = [torch.randn(b, s, h, pad, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3)]
    calls = {"fastattn": lambda: flash.flash_attn_func(*qkv, causal=True),
             "fastattn_direct": lambda: flash.flash_attn_func(*qkv8, causal=True),
             "fa2": lambda: _fa2_dense(*qkv, True)}
    inputs = {"fastattn": qkv, "fastattn_direct": qkv8, "fa2": qkv}

    def step(peer, backward):
        fn, ts = calls[peer], inputs[peer]

        def run():
            if not backward:
                with torch.no_grad():
                    return fn()
            o = fn()
            torch.autograd.grad(o, ts, torch.ones_like(o))
        return run

    flops = 4 * b * s * s * 0.5 * h * d  # the real head dim's work
    return {"path": "head dim padded to a multiple of 8", "shape": f"{b}x{h}x{s}x{d} (to {pad}) causal",
            "modes": {"fwd": {p: step(p, False) for p in calls}, "bwd": {p: step(p, True) for p in calls}},
            "flops": flops, "bwd_flops": flops * 3.5}


def new_paths(rounds: int, reps: int) -> list[dict]:
    """TFLOP/s of each composed path, interleaved rounds, medians; the ratios are
    medians of the rounds' ratios: to FA2 and to fastattn's direct call."""
    rows = []
    for build in (_paged_varlen, lambda: _kvcache_chunk(True, False), lambda: _kvcache_chunk(False, True), _alibi,
                  _padded_head_dim):
        try:
            case = build()
        except Exception as e:  # a case this machine cannot set up: recorded, not fatal
            rows.append({"path": getattr(build, "__name__", "?"), "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        row = {"path": case["path"], "shape": case["shape"]}
        for mode, peers in case["modes"].items():
            flops = case["bwd_flops"] if mode == "bwd" and "bwd_flops" in case else case["flops"] * (
                3.5 if mode == "bwd" else 1.0)
            steps = {}
            for peer, fn in peers.items():
                try:
                    for _ in range(3):  # warm-up: plans, kernels
                        fn()
                    torch.cuda.synchronize()
                    steps[peer] = fn
                except Exception as e:  # a peer this PyTorch lacks (fa2_paged, ALiBi in FA2): recorded
                    row[f"{peer}_{mode}_error"] = f"{type(e).__name__}: {e}"[:300]
            samples = {peer: [] for peer in steps}
            for _ in range(rounds):
                for peer, fn in steps.items():
                    samples[peer].append(flops / _time_ms(lambda i, fn=fn: fn(), 1, reps) / 1e9)
            for peer, sm in samples.items():
                row[f"{peer}_{mode}_tflops"] = statistics.median(sm)
            for other in ("fa2", "fa2_paged", "fastattn_direct"):
                if "fastattn" in samples and other in samples:
                    row[f"ratio_{mode}_fastattn_to_{other}"] = statistics.median(
                        a / b for a, b in zip(samples["fastattn"], samples[other]))
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def host_overhead(iters: int, rounds: int) -> dict:
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=BF16) for _ in range(3))
    lens = [32] * 4
    cu = torch.tensor([0, 32, 64, 96, 128], dtype=torch.int32, device="cuda")
    qv, kv, vv = (torch.randn(128, 8, 64, device="cuda", dtype=BF16) for _ in range(3))
    # A paged decode: 4 sequences of 1000 cached tokens in 64-token pages (shuffled), one
    # query each; the peer is FA2 on a dense KV of the same size (PyTorch ships no paged FA2).
    pages = torch.randperm(64, device="cuda").to(torch.int32).view(4, 16)
    k_pool, v_pool = (torch.randn(64, 64, 8, 64, device="cuda", dtype=BF16) for _ in range(2))
    cache_lens = torch.full((4,), 1000, device="cuda", dtype=torch.int32)
    qd = torch.randn(4, 1, 8, 64, device="cuda", dtype=BF16)
    kd, vd = (torch.randn(4, 8, 1000, 64, device="cuda", dtype=BF16) for _ in range(2))
    calls = {
        "flash_attn_func": lambda: flash.flash_attn_func(q, k, v, causal=True),
        "fastattn_torch_attention": lambda: fat.attention(q, k, v, causal=True),
        "fa2_sdpa_flash": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True),
        "flash_attn_varlen_func": lambda: flash.flash_attn_varlen_func(qv, kv, vv, cu, cu, 32, 32, causal=True),
        "fastattn_torch_attention_varlen": lambda: fat.attention_varlen(qv, kv, vv, cu, cu, 32, 32, causal=True),
        "fa2_varlen": lambda: torch.ops.aten._flash_attention_forward(qv, kv, vv, cu, cu, max(lens), max(lens), 0.0,
                                                                      True, False),
        "flash_attn_with_kvcache_paged": lambda: flash.flash_attn_with_kvcache(
            qd, k_pool, v_pool, cache_seqlens=cache_lens, block_table=pages, causal=True),
        "fastattn_torch_attention_paged": lambda: fat.attention_paged(qd, k_pool, v_pool, pages, cache_lens,
                                                                      causal=True, alignment="bottom_right"),
        # FA2 (SDPA's flash backend, the loop's) on the same KV laid out densely: no paging.
        "fa2_sdpa_flash_dense_decode": lambda: torch.nn.functional.scaled_dot_product_attention(
            qd.transpose(1, 2), kd, vd),
    }
    samples = {name: [] for name in calls}
    errors = {}
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # the backend chosen once, outside the loop
        for name, call in list(calls.items()):
            try:
                for _ in range(20):
                    call()
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"[:300]
                del calls[name], samples[name]
        for _ in range(rounds):
            for name, call in calls.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                samples[name].append((time.perf_counter() - t0) / iters * 1e6)
                torch.cuda.synchronize()
    res = {f"{n}_us": statistics.median(s) for n, s in samples.items()}
    for ours, peer in (("flash_attn_func", "fa2_sdpa_flash"), ("flash_attn_varlen_func", "fa2_varlen"),
                       ("flash_attn_func", "fastattn_torch_attention"),
                       ("flash_attn_varlen_func", "fastattn_torch_attention_varlen"),
                       ("fastattn_torch_attention_varlen", "fa2_varlen"),
                       ("fastattn_torch_attention_paged", "fa2_sdpa_flash_dense_decode"),
                       ("flash_attn_with_kvcache_paged", "fa2_sdpa_flash_dense_decode")):
        if ours in samples and peer in samples:
            res[f"ratio_{ours}_to_{peer}"] = statistics.median(a / b for a, b in zip(samples[ours], samples[peer]))
    res["errors"] = errors
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=300, help="calls per host-time sample")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    ap.add_argument("--reps", type=int, default=10, help="calls per throughput sample")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 3 reps, 100 calls per host sample (a smoke run)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    require_cuda("bench_flash.py")
    if args.quick:
        args.rounds, args.reps, args.iters = 3, 3, 100
    t0 = time.perf_counter()
    res = {**header(), "quick": args.quick, "throughput": throughput(args.rounds, args.reps),
           "new_paths": new_paths(args.rounds, args.reps), "host_overhead": host_overhead(args.iters, args.rounds)}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(res, args.json)
    for r in res["throughput"]:
        parts = []
        for mode in ("fwd", "bwd"):
            ours, peer = r.get(f"fastattn_{mode}_tflops"), r.get(f"fa2_{mode}_tflops")
            ratio = r.get(f"ratio_{mode}_fastattn_to_fa2")
            parts.append(f"{mode} {ours or float('nan'):.0f} vs FA2 {peer or float('nan'):.0f} TFLOP/s "
                         f"(ratio {ratio or float('nan'):.2f}, target >= 1.6)")
        errs = [f"{k}: {v}" for k, v in r.items() if k.endswith("_error")]
        print(f"  {r['shape']} causal={r['causal']}: " + "; ".join(parts) + (f" [{'; '.join(errs)}]" if errs else ""))
    print("  composed paths (TFLOP/s; x FA2 and x fastattn without the feature, medians of round ratios):")
    for r in res["new_paths"]:
        parts = []
        for mode in ("fwd", "bwd"):
            if f"fastattn_{mode}_tflops" not in r:
                continue
            peers = ", ".join(f"{p} {r[f'{p}_{mode}_tflops']:.0f}" for p in ("fa2", "fa2_paged", "fastattn_direct")
                              if f"{p}_{mode}_tflops" in r)
            ratios = ", ".join(f"x{p} {r[f'ratio_{mode}_fastattn_to_{p}']:.2f}"
                               for p in ("fa2", "fa2_paged", "fastattn_direct")
                               if f"ratio_{mode}_fastattn_to_{p}" in r)
            parts.append(f"{mode} {r[f'fastattn_{mode}_tflops']:.0f} ({peers}; {ratios})")
        errs = [f"{k}: {v}" for k, v in r.items() if k.endswith("error")]
        print(f"    {r['path']} [{r.get('shape', '')}]: " + "; ".join(parts) + (f" [{'; '.join(errs)}]" if errs else ""))
    h = res["host_overhead"]
    print("  host us/call: " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in h.items() if k.endswith("_us")))
    print("  host ratios: " + ", ".join(f"{k[6:]} {v:.2f}" for k, v in h.items() if k.startswith("ratio_")))
    if h["errors"]:
        print(f"  host errors: {h['errors']}")
    print(f"  wall: {res['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
