"""Whether cuDNN builds the same plan for the same attention graph every time, on this GPU
and cuDNN: each config built afresh several times, each build in a process of its own (the
disk cache off), deterministic backward or not, with the engines cuDNN chose and a hash of
the outputs and gradients on fixed inputs; then, in this one process, the training forward
of each config with and without deterministic (the same forward graph) at two sets of
addresses with a poisoned workspace: whether its bits depend on the plan, the addresses or
the workspace. Different engines or different bits for one graph mean that a plan built
elsewhere, or for a config that differs only in its backward, is not bitwise the plan built
here.

With --history: whether a build's bits depend on what the process built before it. Fresh
processes each build a sequence of plans (one causal training config at 512 after others, or
itself again), each plan a new build (fastattn.clear() between), each length on inputs of its
own seed; per sequence the hash of each plan's o and stats, and each result's largest difference from a
float64 reference.

    python benchmarks/probe_rebuilds.py [--rounds 3] [--json out.json]   (the disk cache and the warm-up off, by itself)
    python benchmarks/probe_rebuilds.py --history [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

# Every plan this process and its children use is built here and now: no disk cache, and no
# warm-up loading plans into memory when fastattn.torch is imported (below).
os.environ["FASTATTN_CACHE_MODE"] = "off"
os.environ["FASTATTN_WARM_UP"] = "off"

import torch  # noqa: E402

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402
from _common import fresh, require_cuda, write_json  # noqa: E402  (benchmarks/ on sys.path)

CONFIGS = ((2, 96, 128), (1, 256, 128), (1, 512, 128))  # (batch, seq, head dim): 8 heads, causal, bf16


def _hash(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def one(b: int, s: int, d: int, deterministic: bool) -> dict:
    """This process's build of the config: its engines and the hashes of o and of the
    gradients on fixed inputs."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v = (torch.randn(b, 8, s, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    g = torch.randn(b, 8, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    o = fastattn.torch.attention(q, k, v, causal=True, layout="bhsd", deterministic=deterministic)
    grads = torch.autograd.grad(o, (q, k, v), g)
    p = fastattn.plan(_config(b, s, d, deterministic))  # (the plan that call ran, from memory)
    return {"b": b, "s": s, "d": d, "deterministic": deterministic, "forward_engine": p.forward_engine,
            "backward_engine": p.backward_engine, "o": _hash(o), "grads": _hash(*grads),
            "builds": fastattn.stats()["builds"]}


def _config(b: int, s: int, d: int, deterministic: bool) -> fastattn.AttentionConfig:
    """The probed config: 8 heads, causal, bf16, training (bhsd: the tensors below)."""
    return fastattn.AttentionConfig(batch=b, heads_q=8, seqlen_q=s, head_dim_qk=d, layout="bhsd", dtype="bf16",
                                    mask="causal", training=True, deterministic=deterministic)


def _forward(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fill: int = 0x00) -> tuple:
    """The plan's training forward, o and the stats poisoned (NaN) first and the workspace
    filled with `fill`: (o, stats), synchronized."""
    b, h, s, _ = q.shape
    o = torch.full_like(q, float("nan"))
    stats = torch.full((b, h, s, 1), float("nan"), device="cuda", dtype=torch.float32)
    ws = torch.full((max(plan.forward_workspace_size, 1),), fill, device="cuda", dtype=torch.uint8)
    plan.forward(q, k, v, o, stats=stats, workspace=ws, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    return o, stats


def in_one_process(b: int, s: int, d: int) -> dict:
    """In this one process: the training forward of the config built with and without
    deterministic (the forward graphs are the same), each run at two sets of addresses with
    a poisoned workspace (0x00 then 0xFF) and the output poisoned (NaN), then once more
    after plan.load_kernels() (the warm-up's kernel load): whether o and the stats depend
    on which plan, on where the tensors lie, on the workspace's bytes, or on that load."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v = (torch.randn(b, 8, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    out = {"b": b, "s": s, "d": d}
    for det in (False, True):
        plan = fastattn.plan(_config(b, s, d, det))
        hashes = []
        for shift, fill, load in ((0, 0x00, False), (4096, 0xFF, False), (0, 0x00, True)):
            if load:  # (what fastattn.torch's warm-up does to a plan it loads, before its first call)
                plan.load_kernels()
            pad = torch.empty(shift + 1, device="cuda", dtype=torch.uint8)  # (moves the allocations below)
            hashes.append(_hash(*_forward(plan, q, k, v, fill)))
            del pad
        out[f"deterministic={det}"] = {"forward_engine": plan.forward_engine, "o_and_stats": hashes}
    return out


# Each a fresh process's builds, in order: (seq, deterministic). The config at 512 is the one
# whose bits differed between two plans in one process on cuDNN 9.24 (docs/VERIFICATION.md).
SEQUENCES = (((512, False), (512, False), (512, False), (512, False)),
             ((256, False), (512, False), (512, False)),
             ((512, True), (512, False), (512, True)),
             ((96, False), (256, False), (512, False), (512, True)))


def history(sequence: list[tuple[int, bool]]) -> dict:
    """In this process: each (seq, deterministic) of `sequence` built afresh in turn (the
    runtime's plans forgotten between), its training forward run on its length's inputs: the
    hash of each plan's o and stats, and the largest |o - float64 reference|."""
    inputs = {}  # each length's own seed: its inputs are the same in every sequence, so hashes compare across them
    for s in {s for s, _ in sequence}:
        gen = torch.Generator(device="cuda").manual_seed(4321 + s)
        inputs[s] = [torch.randn(1, 8, s, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    rows = []
    for s, det in sequence:
        fastattn.clear()
        plan = fastattn.plan(_config(1, s, 128, det))
        assert fastattn.stats()["builds"] == 1, fastattn.stats()
        q, k, v = inputs[s]
        o, stats = _forward(plan, q, k, v)
        q64, k64, v64 = (t.double() for t in (q, k, v))
        logits = (q64 @ k64.transpose(-1, -2)) / 128 ** 0.5
        logits = logits.masked_fill(torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        ref = torch.softmax(logits, -1) @ v64
        rows.append({"seq": s, "deterministic": det, "forward_engine": plan.forward_engine,
                     "o_and_stats": _hash(o, stats), "max_error": float((o.double() - ref).abs().max())})
    return {"sequence": [list(x) for x in sequence], "plans": rows}


def main_history(args) -> None:
    jobs = [i for i in range(len(SEQUENCES)) for _ in range(args.rounds)]
    runs = [fresh(__file__, ["--sequence", str(i)], timeout=300) for i in jobs]  # one at a time: no load beside
    summary, seen = {}, {}
    for i, run in zip(jobs, runs):
        print(json.dumps(run))
        if "error" in run:
            summary.setdefault(f"sequence {i}", []).append(run["error"].strip().splitlines()[-1][:200])
            continue
        for row in run["plans"]:
            seen.setdefault((row["seq"], row["deterministic"]), {}).setdefault(row["o_and_stats"], row["max_error"])
        summary.setdefault(f"sequence {i} {SEQUENCES[i]}", []).append(
            " ".join(f"{r['o_and_stats'][:8]}({r['max_error']:.2e})" for r in run["plans"]))
    for (s, det), got in sorted(seen.items()):
        summary[f"s{s} deterministic={det}: distinct results"] = {h[:8]: e for h, e in got.items()}
    for key, verdict in summary.items():
        print(f"{key}: {verdict}")
    write_json({"versions": fastattn.versions(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                "runs": runs, "summary": summary}, args.json)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per config")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--one", nargs=4, type=int, metavar=("B", "S", "D", "DETERMINISTIC"), help=argparse.SUPPRESS)
    ap.add_argument("--history", action="store_true", help="whether a build's bits depend on earlier builds")
    ap.add_argument("--sequence", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    require_cuda("probe_rebuilds.py")
    if args.sequence is not None:
        print(json.dumps(history(SEQUENCES[args.sequence])))
        return
    if args.history:
        main_history(args)
        return
    if args.one:
        b, s, d, det = args.one
        print(json.dumps(one(b, s, d, bool(det))))
        return
    same_process = [in_one_process(b, s, d) for b, s, d in CONFIGS]
    jobs = [(b, s, d, det) for b, s, d in CONFIGS for det in (0, 1) for _ in range(args.rounds)]
    with ThreadPoolExecutor(6) as pool:
        runs = list(pool.map(lambda job: fresh(__file__, ["--one", *map(str, job)], timeout=300), jobs))
    same = {}
    for run in runs:
        print(json.dumps(run))
        if "error" not in run:
            key = f"b{run['b']} s{run['s']} d{run['d']} deterministic={run['deterministic']}"
            same.setdefault(key, set()).add((run["forward_engine"], run["backward_engine"], run["o"], run["grads"]))
    summary = {key: ("the same every build" if len(got) == 1 else f"{len(got)} different builds")
               for key, got in same.items()}
    forwards = {}  # the forward's output per config, deterministic or not (the same forward graph)
    for run in runs:
        if "error" not in run:
            forwards.setdefault(f"b{run['b']} s{run['s']} d{run['d']}", set()).add(run["o"])
    for key, got in forwards.items():
        summary[f"{key} o, fresh processes, with and without deterministic"] = (
            "the same" if len(got) == 1 else f"{len(got)} different")
    for run in same_process:  # one process: the plans with and without deterministic, two address sets each
        print(json.dumps(run))
        got = [run[f"deterministic={det}"] for det in (False, True)]
        forwards = {g["forward_engine"] for g in got}
        bits = {h for g in got for h in g["o_and_stats"]}
        summary[f"b{run['b']} s{run['s']} d{run['d']} in one process"] = (
            f"forward engines {sorted(forwards)}; o and stats "
            + ("the same at both address sets, after load_kernels, with and without deterministic" if len(bits) == 1 else
               f"{len(bits)} different results: {[g['o_and_stats'] for g in got]}"))
    for key, verdict in summary.items():
        print(f"{key}: {verdict}")
    write_json({"versions": fastattn.versions(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                "runs": runs, "summary": summary}, args.json)


if __name__ == "__main__":
    main()
