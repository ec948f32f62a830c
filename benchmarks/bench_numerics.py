"""What fastattn.defects' remedies cost. On the shapes a known cuDNN
defect affects, the backward kernel time of the remedied graph (a padding mask over the
full lengths, which the plan supplies) against the plain graph cuDNN would otherwise run
(built with `fastattn._core.build_plan(..., registry=())`), on the same random data (not the
adversarial data: the plain graph's NaN would not change its time, but finite data keeps
the comparison about the same work).

Times are CUDA events around `reps` back-to-back backward calls through Plan.backward
(raw pointers, the zero-overhead path), the median over `samples`; the two graphs run in
interleaved rounds so that clock drift hits both alike; each shape's result is the median
of its rounds, and `overhead_pct` is (remedied - plain) / plain. The forward is not
remedied (the defects are in the backward), so it is not timed.

    python benchmarks/bench_numerics.py [--json out.json] [--rounds 5] [--quick]

Prints each shape's line, then the `summary:` block (tools/gpu_run.sh shows it):
`<shape>_plain_us`, `<shape>_remedied_us`, `<shape>_overhead_pct`, and
`max_overhead_pct` over all shapes. Needs an SM90 GPU and a cuDNN the registry names
(else every plan is plain and the script says so and exits 1).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import fastattn
from fastattn import defects
from fastattn._loader import import_core  # (at use: a checkout without its extension still says it needs a GPU)

from _common import gpu_ms, report, require_cuda

# name: AttentionConfig fields. Affected by sm90-bwd-kv-tail (s_kv = 64 mod 128, non-causal
# or with a bias) or sm90-bwd-single-query (s_q = 1, s_kv a multiple of 128).
SHAPES = {
    "kv192_d128": dict(batch=8, heads_q=16, seqlen_q=192, seqlen_kv=192, head_dim_qk=128),
    "kv1216_d128": dict(batch=4, heads_q=16, seqlen_q=1216, seqlen_kv=1216, head_dim_qk=128),
    "kv4160_d128": dict(batch=1, heads_q=16, seqlen_q=4160, seqlen_kv=4160, head_dim_qk=128),
    "kv1216_d64": dict(batch=4, heads_q=16, seqlen_q=1216, seqlen_kv=1216, head_dim_qk=64),
    "kv1216_d128_causal_bias": dict(batch=4, heads_q=16, seqlen_q=1216, seqlen_kv=1216, head_dim_qk=128,
                                    mask="causal", bias="1hss"),
    "q1_kv128_d128": dict(batch=64, heads_q=16, seqlen_q=1, seqlen_kv=128, head_dim_qk=128),
}
QUICK = ("kv192_d128", "kv1216_d128", "q1_kv128_d128")


class Case:
    """One shape: its plain and remedied plans and the tensors both run on."""

    def __init__(self, fields: dict, dtype: str):
        self.cfg = fastattn.AttentionConfig(**fields, dtype=dtype, training=True)
        dev = torch.cuda.current_device()
        self.remedied = import_core().build_plan(self.cfg, dev)
        self.plain = import_core().build_plan(self.cfg, dev, registry=())
        if not self.remedied.defects or self.plain.defects:
            raise SystemExit(f"{self.cfg.to_json()}: no defect applies on this GPU and cuDNN "
                             f"({fastattn.versions()['cudnn_loaded']}); nothing to measure")
        td = torch.bfloat16 if dtype == "bf16" else torch.float16
        c = self.cfg

        def rnd(name):  # the config's layout (bshd), contiguous
            b, h, s, d = c.shape(name)
            return torch.randn(b, s, h, d, device="cuda", dtype=td)

        self.t = {n: rnd(n) for n in ("q", "k", "v", "o", "d_o", "d_q", "d_k", "d_v")}
        self.t["stats"] = torch.empty(c.batch, c.heads_q, c.seqlen_q, 1, device="cuda", dtype=torch.float32)
        self.bias = torch.randn(c.shape("bias"), device="cuda", dtype=td) if c.bias != "none" else None
        ws = max(self.remedied.workspace_size, self.plain.workspace_size)
        self.ws = torch.empty(max(ws, 1), device="cuda", dtype=torch.uint8)
        p = lambda n: self.t[n].data_ptr()  # noqa: E731
        extra = {"bias": self.bias.data_ptr()} if self.bias is not None else {}
        stream = torch.cuda.current_stream().cuda_stream
        self.plain.forward(p("q"), p("k"), p("v"), p("o"), stats=p("stats"), workspace=self.ws.data_ptr(),
                           stream=stream, **extra)
        args = (p("q"), p("k"), p("v"), p("o"), p("d_o"), p("stats"), p("d_q"), p("d_k"), p("d_v"))
        self.steps = {
            name: (lambda plan=plan: plan.backward(*args, workspace=self.ws.data_ptr(), stream=stream, **extra))
            for name, plan in (("plain", self.plain), ("remedied", self.remedied))
        }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per shape (default 5)")
    ap.add_argument("--reps", type=int, default=20, help="back-to-back calls per sample (default 20)")
    ap.add_argument("--samples", type=int, default=5, help="samples per round (default 5)")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    args = ap.parse_args(argv)
    if min(args.rounds, args.reps, args.samples) < 1:
        ap.error("--rounds, --reps and --samples must be at least 1")
    require_cuda("bench_numerics.py")
    fastattn.probe(fastattn.AttentionConfig(batch=1, heads_q=1, seqlen_q=8, head_dim_qk=64))  # loads cuDNN
    res: dict = {"gpu": torch.cuda.get_device_name(), "cudnn": str(fastattn.versions()["cudnn_loaded"]),
                 "dtype": args.dtype}
    overheads = []
    for name, fields in SHAPES.items():
        if args.quick and name not in QUICK:
            continue
        case = Case(fields, args.dtype)
        rounds: dict[str, list[float]] = {"plain": [], "remedied": []}
        for _ in range(args.rounds):
            for step, fn in case.steps.items():
                rounds[step].append(gpu_ms(fn, args.reps, args.samples, warmup=3))
        plain, remedied = (statistics.median(rounds[s]) * 1e3 for s in ("plain", "remedied"))
        pct = (remedied - plain) / plain * 100
        overheads.append(pct)
        res[f"{name}_plain_us"], res[f"{name}_remedied_us"] = round(plain, 2), round(remedied, 2)
        res[f"{name}_overhead_pct"] = round(pct, 2)
        res[f"{name}_rounds"] = rounds
        res[f"{name}_avoided"] = ", ".join(case.remedied.defects.key_part())
        print(f"{name}: plain {plain:9.1f} us  remedied {remedied:9.1f} us  ({pct:+.1f}%)  "
              f"[{res[name + '_avoided']}]", flush=True)
        del case
        torch.cuda.empty_cache()
    res["max_overhead_pct"] = round(max(overheads), 2)
    res["registry"] = ", ".join(d.name for d in defects.DEFECTS)
    return report(res, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
