"""What more than one benchmark uses: the host-time loops (`time_us` and the interleaved
rounds of the profiles; `host_rounds`, bench_torch's and bench_sdpa_mode's per-call
host time with the GPU held), their common ending (the JSON, written strictly by
`write_json`, and the `summary:` block that tools/gpu_run.sh prints), FlashAttention 2's
varlen kernels as PyTorch ships them, and bench_warm's 64 configs, and the fresh-process
runs of the cold-start figures (`fresh`, `rotated`, `paired_ratio`, `require_cuda`).

The scripts run as `python benchmarks/NAME.py`, so this folder is on sys.path and they
import it as `_common`. torch and fastattn are imported by the functions that use
them: bench_warm.py and bench_remote.py run without torch.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastattn import AttentionConfig

# Every benchmark imports this module: their output goes out line by line even into a pipe
# or a file, so that a run cut short (a timeout, the device's time running out) keeps what
# it printed (three benchmarks cut by `timeout 60` once left empty logs: Python buffers a
# pipe's output).
if hasattr(sys.stdout, "reconfigure"):  # (a test's captured stdout may not have it)
    sys.stdout.reconfigure(line_buffering=True)


def time_us(fn, iters: int = 2000, samples: int = 15) -> float:
    """Microseconds per call of `fn`: the median of `samples` samples of `iters` calls
    each, after 200 warm-up calls; the GPU queue is drained between samples, so it
    never fills."""
    import torch

    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(out), 3)


def gpu_ms(fn, reps: int = 20, samples: int = 5, warmup: int = 1, lead_cycles: int = 0) -> float:
    """GPU milliseconds per call of `fn`: the median over `samples` of the mean over
    `reps` back-to-back calls, timed with CUDA events, after `warmup` calls.
    lead_cycles: the GPU first spins at least that many clock cycles (torch.cuda._sleep)
    while the host queues the calls, so that the events time the kernels back to back and
    not the launch gaps of calls whose kernels are shorter than their host time (decode
    steps); a sample whose calls were not all queued before the spin ended is taken again
    with a spin twice as long (as bench_shape_classes' timer)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    cycles = lead_cycles
    while len(out) < samples:
        gap, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        if cycles:
            gap.record()
            torch.cuda._sleep(cycles)
        start.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        if cycles and gap.elapsed_time(start) <= 1.2 * host_ms and cycles < 1 << 34:
            cycles *= 2  # the GPU ran out of queued work: not a kernel-only sample
            continue
        out.append(start.elapsed_time(end) / reps)
    return statistics.median(out)


def interleaved(res: dict, steps: dict, rounds: int = 3) -> None:
    """Times each of `steps` (name -> function) in `rounds` interleaved rounds (300
    calls, 5 samples each), so that drift hits every peer alike: res[name + "_rounds"]
    the rounds' numbers, res[name] their median."""
    for _ in range(rounds):
        for name, fn in steps.items():
            res.setdefault(name + "_rounds", []).append(time_us(fn, iters=300, samples=5))
    for name in steps:
        res[name] = statistics.median(res[name + "_rounds"])


def require_cuda(script: str) -> None:
    """Exits with status 2 and a message, not a traceback, where CUDA is not usable (a
    benchmark of GPU kernels has nothing to measure there)."""
    try:
        import torch

        usable = torch.cuda.is_available()
    except ImportError:
        usable = False
    if not usable:
        print(f"{script}: needs a CUDA GPU and a CUDA build of PyTorch; none is usable here", file=sys.stderr)
        sys.exit(2)


def fresh(script: str, args: list[str], env: dict | None = None, timeout: float = 600) -> dict:
    """Runs `python script *args` in a fresh process and returns the JSON object its last
    line of output prints, with process_seconds (the whole process, start to exit)
    added; {"error": the end of its stderr} where it fails or runs past `timeout` seconds."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    except subprocess.TimeoutExpired as e:
        return {"error": f"ran past {timeout} s; stderr ends: {(e.stderr or b'')[-2000:]!r}"}
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_seconds"] = time.perf_counter() - t0
    return res


def fresh_cache_env(cache_dir: str) -> dict:
    """The environment of fresh processes that must start from `cache_dir` as their
    fastattn cache, with the op library where this process's environment has it
    (FASTATTN_TORCH_OPS_DIR, else the default cache's torch-ops/), so that a fresh cache
    directory does not hide a library `fastattn warm` built."""
    from fastattn import _opslib

    return {"FASTATTN_CACHE_DIR": cache_dir, "FASTATTN_TORCH_OPS_DIR": str(_opslib.build_root())}


def error_line(e: BaseException, limit: int = 160) -> str:
    """An exception as one line for a probe's row: its type and its message's first line
    (none where the message is empty)."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:limit]}"


def first_error(rows) -> str | None:
    """The last line of the first failed row's error (a fresh process's stderr), for a summary."""
    for r in rows:
        if "error" in r:
            lines = r["error"].strip().splitlines()
            return lines[-1][:300] if lines else "(no stderr)"
    return None


def rotated(names, rounds: int) -> list[list]:
    """The order of each interleaved round: `names` rotated by one place a round, so that
    no peer always runs first (or after the same one)."""
    names = list(names)
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


def paired_ratio(a: list[float], b: list[float]) -> float | None:
    """The median of each round's own ratio a / b (rounds where both were measured):
    the host's speed drifts between rounds, and a ratio within one round compares the
    peers at one speed. None where no round has both."""
    pairs = [x / y for x, y in zip(a, b) if x is not None and y]
    return statistics.median(pairs) if pairs else None


def calls_since(before: dict, after: dict) -> dict:
    """The SDPA mode's counts (fastattn.stats()["sdpa"]) between two readings: each count
    (served, and those of them padded or with a mask's gradient), and the calls passed on by
    reason."""
    passed = {r: n - before["passed_on"].get(r, 0) for r, n in after["passed_on"].items()}
    counts = {name: n - before.get(name, 0) for name, n in after.items() if name != "passed_on"}
    return {**counts, "passed_on": {r: n for r, n in passed.items() if n}}


# The held host-time loop's length and the sleep kernel in front of it (~20 ms at the
# H200's 1.98 GHz): the loop's launches (2-3 a call at most) stay within CUDA's launch queue.
# A call of more launches needs a shorter loop (host_rounds' held_iters): once the queue is
# full, each launch waits for the GPU, and the loop times the sleep.
HELD_ITERS = 200
HELD_SLEEP_CYCLES = 40_000_000


def held_us(call, iters: int) -> tuple[float, bool]:
    """Host microseconds per call of `call` over `iters` calls queued behind a sleep
    kernel, so that the loop never waits for the GPU; and whether the sleep still ran
    when the loop ended (the sample is valid: the GPU held the calls all along)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(HELD_SLEEP_CYCLES)
    asleep = torch.cuda.Event()
    asleep.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    us = (time.perf_counter() - t0) / iters * 1e6
    return us, not asleep.query()


def host_rounds(calls: dict, iters: int, repeats: int, seed: int = 17, held_iters: int = HELD_ITERS) -> dict:
    """Per-call host time of each peer, in `repeats` interleaved rounds, each in a new
    seeded order (so that drift hits every peer alike and no peer always follows the same
    one). calls: name -> (enter, infer, train): enter() a context manager entered around
    each of the peer's loops (its backend, path or mode: chosen once, its cost not the
    peer's), infer() one inference call, train() one training step. Returns, per name,
    microseconds per call for each round:
      held: inference with the GPU held by a sleep kernel, so that the calls queue and the
        loop never waits for the GPU (a small call's GPU time is near its host time, and a
        loop the GPU holds back times the GPU); held_valid counts the rounds where the
        sleep still ran when the loop ended (min(iters, held_iters) calls);
      wall: the same inference loop with the GPU free (iters calls);
      train: training steps (iters)."""
    import torch

    for enter, infer, train in calls.values():
        with enter():
            for _ in range(20):
                infer()
                train()
    torch.cuda.synchronize()
    out = {name: {"held": [], "held_valid": 0, "wall": [], "train": []} for name in calls}
    held_iters = min(iters, held_iters)
    order, rng = list(calls), random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            enter, infer, train = calls[name]
            r = out[name]
            with enter():
                us, valid = held_us(infer, held_iters)
                r["held"].append(us)
                r["held_valid"] += valid
                for key, step in (("wall", infer), ("train", train)):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        step()
                    r[key].append((time.perf_counter() - t0) / iters * 1e6)
                    torch.cuda.synchronize()
    return out


def held_gpu_us(enter, infer, iters: int) -> float:
    """GPU time per call of infer(): the calls queue up behind a ~25 ms sleep kernel, so
    the GPU runs them back to back and events around them time the GPU, not the host. A
    host time per call above this is the host's own cost, not the GPU holding it back."""
    import torch

    with enter():
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            infer()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / iters * 1e3


class Steps(list):
    """A child process's stopwatch: (name, ms since the previous mark) rows, a list (so it
    goes into JSON as it is). `mark(name)` closes the step that ends now."""

    def __init__(self, digits: int = 2):
        super().__init__()
        self.digits = digits
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.append((name, round((now - self._t) * 1e3, self.digits)))
        self._t = now


def header() -> dict:
    """What every benchmark's JSON opens with: the date, the GPU, fastattn's and cuDNN's
    versions, torch's (None where it is not installed) and the kernel's (`uname -r`), as the benchmark notes record them. torch's version
    is read from its installed metadata, which is what torch.__version__ says, unimported."""
    from importlib import metadata

    import fastattn

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"date": time.strftime("%Y-%m-%d"), "device": fastattn.device_info(), "versions": fastattn.versions(),
            "torch": torch_version, "uname": os.uname().release}


def emit(res: dict, json_path: str | None, lines=()) -> None:
    """Writes `res` to json_path (if given), prints it, then the `summary:` line that
    tools/gpu_run.sh prints from and `lines` (a benchmark's summary; one that prints its
    own summary afterwards gives none), then res["seconds"] where it was timed."""
    res = write_json(res, json_path)
    print(json.dumps(res, indent=2, allow_nan=False))
    print("\nsummary:")
    for line in lines:
        print(line)
    if lines and "seconds" in res:
        print(f"  seconds: {res['seconds']:.1f}")


def write_json(res: dict | list, json_path: str | None) -> dict | list:
    """res as strict JSON (_strict), written to json_path where one is given, and returned:
    the one writer of benchmark results (emit and report write through it; a benchmark
    that prints only its own summary, not the JSON, calls it alone)."""
    res = _strict(res)
    if json_path:
        # Its folder made as needed: a run of minutes must not end in a FileNotFoundError
        # with its numbers lost.
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2, allow_nan=False)
    return res


def _strict(value):
    """value with NaN and the infinities as null: Python writes them as NaN / Infinity,
    which strict JSON readers refuse (a probe's error of a NaN output was one)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def report(res: dict, json_path: str | None) -> int:
    """Writes `res` to json_path (if given) and prints the `summary:` block (numbers and
    strings) that tools/gpu_run.sh shows; the profiles' common ending. Returns 0."""
    import torch

    res["torch"] = torch.__version__
    write_json(res, json_path)
    print("summary:")
    for key, value in res.items():
        if isinstance(value, float):
            print(f"  {key:<34} {value:8.3f}")
        elif isinstance(value, str):
            print(f"  {key:<34} {value}")
    return 0


_FA2Varlen = None  # the autograd.Function below, defined at first use (torch is imported then)


def _define_fa2_varlen():
    global _FA2Varlen
    import torch

    class FA2Varlen(torch.autograd.Function):
        """FA2's varlen kernels as PyTorch ships them (aten._flash_attention_forward/backward)."""

        @staticmethod
        def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal):
            out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False)
            ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
            ctx.args = (max_q, max_k, causal)
            return out

        @staticmethod
        def backward(ctx, d_out):
            q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
            max_q, max_k, causal = ctx.args
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                d_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, seed, offset)
            return dq, dk, dv, None, None, None, None, None

    _FA2Varlen = FA2Varlen
    return FA2Varlen


def fa2_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    """FlashAttention 2's varlen forward, with its backward under autograd (what
    flash_attn's own flash_attn_varlen_func is: kernels in a Python autograd.Function)."""
    return (_FA2Varlen or _define_fa2_varlen()).apply(q, k, v, cu_q, cu_k, max_q, max_k, causal)


def warm_configs(which: str = "default") -> list[AttentionConfig]:
    """bench_warm.py's 64 configs (bench_remote.py builds and loads the same). "default":
    GQA 32/8 and MHA 16/16, head dims 64 and 128, seqlen 256 ... 8192, causal bf16, half
    of them training (4 kernel families of 16). "families": 16 kernel families of 4
    (head dims 64 and 128, bf16 and fp16, causal or not, inference or training; seqlen
    512 ... 4096)."""
    from fastattn import AttentionConfig

    if which == "families":
        return [AttentionConfig(batch=1, heads_q=16, heads_kv=4, seqlen_q=s, head_dim_qk=d, dtype=t, mask=m,
                                training=training)
                for d, t, m, training, s in itertools.product((64, 128), ("bf16", "fp16"), ("none", "causal"),
                                                              (False, True), (512, 1024, 2048, 4096))]
    out = []
    for (hq, hkv), d, s, training in itertools.product(((32, 8), (16, 16)), (64, 128),
                                                       (256, 512, 1024, 2048, 4096, 8192, 384, 768), (False, True)):
        out.append(AttentionConfig(batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=s, head_dim_qk=d, dtype="bf16",
                                   mask="causal", training=training))
    return out
