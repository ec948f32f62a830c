"""FP8 attention on the GPU: fastattn's FP8 plans against cudnn-frontend's own Python FP8
graphs (the same cuDNN kernels, the frontend's own plumbing), beside fastattn bf16 and
PyTorch SDPA's cuDNN and flash backends in bf16, on SHAPES (below), in both memory
layouts (bshd, and (b, h, s, d) contiguous as SDPA takes it).

(a) Forward and backward TFLOP/s (backward timed alone, from a saved forward), with
    CUDA events over rotating inputs, in interleaved rounds (every peer once per round,
    so drift hits all alike); medians of the rounds. Target: fastattn FP8 at
    least 0.97x cudnn-frontend's FP8 graphs.
(b) End to end through fastattn.torch: attention_fp8_scaled (bf16 in and out, current
    scaling) against attention in bf16: time per inference call and per training step.

FP8 is e4m3 in and out (gradients too), as the issue's measurements. FLOPs: 4 b h s^2 d
forward (half of it causal), 2.5x that backward.

    python benchmarks/bench_fp8.py [--json out.json] [--notes fastattn/_measured/fp8_vs_bf16.json]

--notes writes, for `fastattn probe` (fastattn/perf_notes.py), each shape's FP8/bf16
ratio of fastattn's own forward and backward, with the date, GPU and versions.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastattn import AttentionConfig
from fastattn.torch import attention, attention_fp8, attention_fp8_backward, attention_fp8_scaled

from _common import emit, header, require_cuda, write_json  # (benchmarks/ is on sys.path)

E4M3 = torch.float8_e4m3fn
SHAPES = [((2, 16, 8192, 128), c) for c in (False, True)] + [((4, 32, 4096, 128), c) for c in (False, True)] + [
    ((1, 16, 16384, 128), c) for c in (False, True)]
LAYOUTS = ("bshd", "bhsd")


def _flops(b, h, s, d, causal, backward):
    f = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * (2.5 if backward else 1.0)


def _shape(layout, b, h, s, d):
    return (b, s, h, d) if layout == "bshd" else (b, h, s, d)


def _one(x):
    return torch.full((1,), float(x), dtype=torch.float32, device="cuda")


class FastattnFp8:
    """fastattn.torch.attention_fp8 / attention_fp8_backward, e4m3 throughout."""

    def __init__(self, b, h, s, d, causal, layout):
        self.causal, self.layout = causal, layout
        shape = _shape(layout, b, h, s, d)
        self.sets = [[(torch.randn(shape, device="cuda") * 0.5).to(E4M3) for _ in range(4)] for _ in range(3)]
        self.scalars = [_one(1.0) for _ in range(6)]
        self.scalars[3], self.scalars[4] = _one(1 / 448), _one(448)  # descale_s, scale_s
        self.saved = [attention_fp8(q, k, v, *self.scalars, causal=causal, layout=layout, training=True,
                                    grad_dtype=E4M3) for q, k, v, _ in self.sets]
        self.bwd_scalars = [_one(1.0) for _ in range(12)]

    def forward(self, i):
        q, k, v, _ = self.sets[i % 3]
        attention_fp8(q, k, v, *self.scalars, causal=self.causal, layout=self.layout)

    def backward(self, i):
        q, k, v, d_o = self.sets[i % 3]
        out = self.saved[i % 3]
        attention_fp8_backward(d_o, out.o, out.stats, q, k, v, *self.bwd_scalars, causal=self.causal,
                               layout=self.layout)


class FrontendFp8:
    """cudnn-frontend's Python FP8 graphs (sdpa_fp8, sdpa_fp8_backward) on the same tensors."""

    def __init__(self, b, h, s, d, causal, layout):
        import cudnn

        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        shape = _shape(layout, b, h, s, d)
        self.sets = [[(torch.randn(shape, device="cuda") * 0.5).to(E4M3) for _ in range(4)] for _ in range(3)]
        self.stats = [torch.empty(b, h, s, 1, device="cuda") for _ in range(3)]
        self.outs = [torch.empty(shape, device="cuda", dtype=E4M3) for _ in range(3)]
        self.grads = [[torch.empty(shape, device="cuda", dtype=E4M3) for _ in range(3)] for _ in range(3)]
        self.scal = {name: _one(448 if name == "scale_s" else 1 / 448 if name == "descale_s" else 1.0)
                     for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o",
                                  "descale_o", "descale_do", "descale_dp", "scale_dq", "scale_dk", "scale_dv",
                                  "scale_dp")}
        self.amax = {name: torch.empty(1, device="cuda") for name in ("s", "o", "dq", "dk", "dv", "dp")}
        to_bhsd = (lambda t: t.permute(0, 2, 1, 3)) if layout == "bshd" else (lambda t: t)
        self.view = to_bhsd
        # Timed forward: inference, as every forward peer here; the training one (stats)
        # only makes backward's inputs.
        self.fwd, self.fwd_t = self._forward_graph(b, h, s, d, causal, inference=True)
        self.train, self.train_t = self._forward_graph(b, h, s, d, causal, inference=False)
        self.bwd, self.bwd_t = self._backward_graph(b, h, s, d, causal)
        self.ws = torch.empty(max(g.get_workspace_size() for g in (self.fwd, self.train, self.bwd)) + 1,
                              dtype=torch.uint8, device="cuda")
        for i in range(3):  # stats and o for backward
            self._run_forward(i, self.train, self.train_t)

    def _graph(self):
        c = self.cudnn
        return c.pygraph(io_data_type=c.data_type.FP8_E4M3, intermediate_data_type=c.data_type.FLOAT,
                         compute_data_type=c.data_type.FLOAT, handle=self.handle)

    def _tensor(self, g, t):
        v = self.view(t)
        dt = self.cudnn.data_type.FP8_E4M3 if t.dtype == E4M3 else self.cudnn.data_type.FLOAT
        return g.tensor(dim=list(v.shape), stride=list(v.stride()), data_type=dt)

    def _build(self, g):
        c = self.cudnn
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([c.heur_mode.A, c.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()

    def _forward_graph(self, b, h, s, d, causal, inference):
        g = self._graph()
        q, k, v, _ = self.sets[0]
        t = {"q": self._tensor(g, q), "k": self._tensor(g, k), "v": self._tensor(g, v)}
        for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
            t[name] = self._tensor(g, self.scal[name].reshape(1, 1, 1, 1))
        o, stats, amax_s, amax_o = g.sdpa_fp8(q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"],
                                              descale_k=t["descale_k"], descale_v=t["descale_v"],
                                              descale_s=t["descale_s"], scale_s=t["scale_s"],
                                              scale_o=t["scale_o"], is_inference=inference,
                                              attn_scale=1 / math.sqrt(d), use_causal_mask=causal)
        ov = self.view(self.outs[0])
        o.set_output(True).set_dim(list(ov.shape)).set_stride(list(ov.stride())).set_data_type(
            self.cudnn.data_type.FP8_E4M3)
        if not inference:
            stats.set_output(True).set_data_type(self.cudnn.data_type.FLOAT)
        for a in (amax_s, amax_o):
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(self.cudnn.data_type.FLOAT)
        t.update(o=o, stats=stats, amax_s=amax_s, amax_o=amax_o)
        self._build(g)
        return g, t

    def _backward_graph(self, b, h, s, d, causal):
        g = self._graph()
        q, k, v, d_o = self.sets[0]
        t = {n: self._tensor(g, x) for n, x in (("q", q), ("k", k), ("v", v), ("o", self.outs[0]), ("d_o", d_o))}
        t["stats"] = g.tensor(dim=[b, h, s, 1], stride=[h * s, s, 1, 1], data_type=self.cudnn.data_type.FLOAT)
        for name in ("descale_q", "descale_k", "descale_v", "descale_o", "descale_do", "descale_s", "descale_dp",
                     "scale_s", "scale_dq", "scale_dk", "scale_dv", "scale_dp"):
            t[name] = self._tensor(g, self.scal[name].reshape(1, 1, 1, 1))
        dq, dk, dv, adq, adk, adv, adp = g.sdpa_fp8_backward(
            q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["d_o"], stats=t["stats"], descale_q=t["descale_q"],
            descale_k=t["descale_k"], descale_v=t["descale_v"], descale_o=t["descale_o"], descale_dO=t["descale_do"],
            descale_s=t["descale_s"], descale_dP=t["descale_dp"], scale_s=t["scale_s"], scale_dQ=t["scale_dq"],
            scale_dK=t["scale_dk"], scale_dV=t["scale_dv"], scale_dP=t["scale_dp"], attn_scale=1 / math.sqrt(d),
            use_causal_mask=causal)
        for out, like in ((dq, q), (dk, k), (dv, v)):
            lv = self.view(like)
            out.set_output(True).set_dim(list(lv.shape)).set_stride(list(lv.stride())).set_data_type(
                self.cudnn.data_type.FP8_E4M3)
        for a in (adq, adk, adv, adp):
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(self.cudnn.data_type.FLOAT)
        t.update(dq=dq, dk=dk, dv=dv, amax_dq=adq, amax_dk=adk, amax_dv=adv, amax_dp=adp)
        self._build(g)
        return g, t

    def _run_forward(self, i, graph, t):
        q, k, v, _ = self.sets[i % 3]
        pack = {t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: self.outs[i % 3], t["amax_s"]: self.amax["s"],
                t["amax_o"]: self.amax["o"]}
        if t["stats"] is not None:
            pack[t["stats"]] = self.stats[i % 3]
        pack.update({t[n]: self.scal[n] for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s",
                                                  "scale_o")})
        graph.execute(pack, self.ws, handle=self.handle)

    def forward(self, i):
        self._run_forward(i, self.fwd, self.fwd_t)

    def backward(self, i):
        q, k, v, d_o = self.sets[i % 3]
        t, (dq, dk, dv) = self.bwd_t, self.grads[i % 3]
        pack = {t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: self.outs[i % 3], t["d_o"]: d_o,
                t["stats"]: self.stats[i % 3], t["dq"]: dq, t["dk"]: dk, t["dv"]: dv}
        pack.update({t[f"amax_{n}"]: self.amax[n] for n in ("dq", "dk", "dv", "dp")})
        pack.update({t[n]: self.scal[n] for n in self.scal if n in t and n not in ("scale_o",)})
        self.bwd.execute(pack, self.ws, handle=self.handle)


class Bf16:
    """fastattn.torch.attention or SDPA (backend), bf16; backward alone through autograd."""

    def __init__(self, b, h, s, d, causal, layout, peer):
        self.causal, self.layout, self.peer = causal, layout, peer
        shape = _shape(layout, b, h, s, d)
        self.sets = [[torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
                     + [torch.randn(shape, device="cuda", dtype=torch.bfloat16)] for _ in range(3)]
        self.backend = {"torch_cudnn": SDPBackend.CUDNN_ATTENTION, "torch_flash": SDPBackend.FLASH_ATTENTION}.get(peer)
        self.saved = [self._call(q, k, v) for q, k, v, _ in self.sets]

    def _call(self, q, k, v):
        if self.peer == "fastattn_bf16":
            return attention(q, k, v, causal=self.causal, layout=self.layout)
        to = (lambda t: t.transpose(1, 2)) if self.layout == "bshd" else (lambda t: t)
        with sdpa_kernel(self.backend):
            return to(torch.nn.functional.scaled_dot_product_attention(to(q), to(k), to(v), is_causal=self.causal))

    def forward(self, i):
        q, k, v, _ = self.sets[i % 3]
        with torch.no_grad():
            self._call(q, k, v)

    def backward(self, i):
        q, k, v, d_o = self.sets[i % 3]
        with sdpa_kernel(self.backend) if self.backend else torch.enable_grad():
            torch.autograd.grad(self.saved[i % 3], (q, k, v), d_o, retain_graph=True)


def _time(fn, reps) -> float:
    """ms per call over `reps` calls after 2 warm ones, with CUDA events."""
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(reps):
        fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def throughput(reps: int, rounds: int) -> list[dict]:
    rows = []
    for (b, h, s, d), causal in SHAPES:
        for layout in LAYOUTS:
            peers = {"fastattn_fp8": FastattnFp8(b, h, s, d, causal, layout)}
            try:
                peers["cudnn_fp8"] = FrontendFp8(b, h, s, d, causal, layout)
            except Exception as e:  # the frontend refusing its own graph is a result, not a crash
                print(f"cudnn-frontend FP8 {b}x{h}x{s}x{d} causal={causal} {layout}: {type(e).__name__}: {e}")
            for name in ("fastattn_bf16", "torch_cudnn", "torch_flash"):
                peers[name] = Bf16(b, h, s, d, causal, layout, name)
            samples = {(n, m): [] for n in peers for m in ("fwd", "bwd")}
            for _ in range(rounds):
                for (name, mode), out in samples.items():
                    out.append(_time(getattr(peers[name], "forward" if mode == "fwd" else "backward"), reps))
            row = {"shape": f"{b}x{h}x{s}x{d}", "causal": causal, "layout": layout}
            for (name, mode), ms in samples.items():
                row[f"{name}_{mode}_tflops"] = _flops(b, h, s, d, causal, mode == "bwd") / statistics.median(ms) / 1e9
            for mode in ("fwd", "bwd"):
                fa = row[f"fastattn_fp8_{mode}_tflops"]
                if f"cudnn_fp8_{mode}_tflops" in row:
                    row[f"ratio_{mode}_fastattn_fp8_to_cudnn_fp8"] = fa / row[f"cudnn_fp8_{mode}_tflops"]
                row[f"ratio_{mode}_fp8_to_bf16"] = fa / row[f"fastattn_bf16_{mode}_tflops"]
            row["config"] = AttentionConfig(batch=b, heads_q=h, seqlen_q=s, head_dim_qk=d, dtype="fp8_e4m3",
                                            mask="causal" if causal else "none", layout=layout,
                                            training=True).to_dict()
            rows.append(row)
            del peers
            torch.cuda.empty_cache()
    return rows


def end_to_end(rounds: int, iters: int) -> list[dict]:
    """Time per call through fastattn.torch: the FP8 helper against bf16 attention."""
    rows = []
    for (b, h, s, d), causal in SHAPES[::2] + SHAPES[1::2]:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        calls = {"fp8_scaled": lambda *a: attention_fp8_scaled(*a, causal=causal),
                 "bf16": lambda *a: attention(*a, causal=causal)}
        samples = {(n, m): [] for n in calls for m in ("infer", "train")}
        for _ in range(rounds):
            for (name, mode), out in samples.items():
                fn = calls[name]

                def step(i, fn=fn, mode=mode):
                    if mode == "infer":
                        with torch.no_grad():
                            fn(q, k, v)
                    else:
                        o = fn(q, k, v)
                        torch.autograd.grad(o, (q, k, v), o)

                out.append(_time(step, iters))
        row = {"shape": f"{b}x{h}x{s}x{d}", "causal": causal}
        row.update({f"{n}_{m}_ms": statistics.median(x) for (n, m), x in samples.items()})
        row["ratio_infer_fp8_to_bf16"] = row["fp8_scaled_infer_ms"] / row["bf16_infer_ms"]
        row["ratio_train_fp8_to_bf16"] = row["fp8_scaled_train_ms"] / row["bf16_train_ms"]
        rows.append(row)
    return rows


def notes(res) -> dict:
    """fastattn/perf_notes.py's file: fastattn's own FP8/bf16 ratios per shape and layout."""
    return {"format": 1, "date": res["date"], "gpu": res["device"].get("name"),
            "cudnn": res["versions"].get("cudnn_loaded"), "fastattn": res["versions"].get("fastattn"),
            "rows": [{"config": r["config"], "forward_ratio": round(r["ratio_fwd_fp8_to_bf16"], 3),
                      "backward_ratio": round(r["ratio_bwd_fp8_to_bf16"], 3)} for r in res["throughput"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10, help="calls per timed sample")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median is reported)")
    ap.add_argument("--json")
    ap.add_argument("--notes", help="also write fastattn probe's measured notes to this file")
    args = ap.parse_args(argv)
    require_cuda("bench_fp8.py")
    res = header()
    try:
        import cudnn

        res["cudnn_frontend_python"] = getattr(cudnn, "__version__", "unknown")
    except ImportError as e:
        res["cudnn_frontend_python"] = f"not importable: {e}"
    res["throughput"] = throughput(args.reps, args.rounds)
    res["end_to_end"] = end_to_end(args.rounds, args.reps)
    res["notes"] = notes(res)
    write_json(res["notes"], args.notes)
    emit(res, args.json)
    print(f"  {res['device'].get('name')}, cuDNN {res['versions'].get('cudnn_loaded')}, frontend (Python) "
          f"{res['cudnn_frontend_python']}; TFLOP/s, medians of {args.rounds} interleaved rounds")
    for r in res["throughput"]:
        g = lambda k: r.get(k, float("nan"))  # noqa: E731
        print(f"  {r['shape']} causal={r['causal']} {r['layout']}: fwd fp8 {g('fastattn_fp8_fwd_tflops'):.0f} "
              f"(cudnn-fe {g('cudnn_fp8_fwd_tflops'):.0f}, x{g('ratio_fwd_fastattn_fp8_to_cudnn_fp8'):.3f}) bf16 "
              f"{g('fastattn_bf16_fwd_tflops'):.0f} sdpa-cudnn {g('torch_cudnn_fwd_tflops'):.0f} flash "
              f"{g('torch_flash_fwd_tflops'):.0f} | bwd fp8 {g('fastattn_fp8_bwd_tflops'):.0f} (cudnn-fe "
              f"{g('cudnn_fp8_bwd_tflops'):.0f}, x{g('ratio_bwd_fastattn_fp8_to_cudnn_fp8'):.3f}) bf16 "
              f"{g('fastattn_bf16_bwd_tflops'):.0f} sdpa-cudnn {g('torch_cudnn_bwd_tflops'):.0f} flash "
              f"{g('torch_flash_bwd_tflops'):.0f}; fp8/bf16 fwd {g('ratio_fwd_fp8_to_bf16'):.2f} bwd "
              f"{g('ratio_bwd_fp8_to_bf16'):.2f}")
    for r in res["end_to_end"]:
        print(f"  end to end {r['shape']} causal={r['causal']}: attention_fp8_scaled / bf16 attention: inference "
              f"{r['ratio_infer_fp8_to_bf16']:.2f}x the time, training step {r['ratio_train_fp8_to_bf16']:.2f}x")
    slower = [f"{r['shape']} causal={r['causal']} {r['layout']} {m}" for r in res["throughput"]
              for m in ("fwd", "bwd") if r[f"ratio_{m}_fp8_to_bf16"] < 1]
    print(f"  FP8 slower than bf16: {', '.join(slower) or 'nowhere'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
