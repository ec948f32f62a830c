"""The SDPA mode (fastattn.torch.enable_sdpa()) against PyTorch's own SDPA backends: what
torch.nn.functional.scaled_dot_product_attention costs with the mode on.

(a) Host time per call of F.scaled_dot_product_attention on (b, h, s, d) bf16 tensors,
    inference and a training step (forward and backward through autograd), on
    1x8x128x64 causal, on a decode shape (one query against 4096 keys, 8 heads, no
    mask), and on a left-padded batch's prefill, 2x8x128x64 with the mask transformers'
    sdpa path builds (causal and padding, the padding's query rows keeping no key), as a
    boolean mask and as an additive bfloat16 one (0 / -inf); measured as bench_torch.py
    measures it (_common.host_rounds: the GPU held by a sleep kernel for the inference
    loop, the wall time of the same loop with the GPU free beside it, interleaved rounds
    in a new order each, medians, and the median of each round's own ratio). Peers:
      mode_on          enable_sdpa(), PyTorch's cuDNN backend selected: fastattn's plans
      torch_cudnn      the mode off, the cuDNN backend selected: PyTorch's cuDNN kernels
      torch_flash      the mode off, the flash backend (FlashAttention 2; no masks)
      torch_efficient  the mode off, the memory-efficient backend (masked shapes only,
                       in flash's place)
    A peer whose first call raises (a backend refusing the call) is left out of that
    shape, its error recorded.
    The backend (sdpa_kernel) and the mode are entered once around each loop, outside
    the clock. Target: mode_on's inference host time at most 0.6x torch_cudnn's. How
    many calls the mode served and passed on (fastattn.stats()["sdpa"]) is recorded: a
    call it handed back to PyTorch would time PyTorch. The held loop is shorter for the
    masked shapes (MASKED_HELD_ITERS): the mode's masked call launches more.
(b) Cold start: a fresh process's time to the first outputs of bench_coldstart.py's 8
    prefill shapes (1x32xSx128 bf16 causal, S = 256 ... 4096), forward, and forward and
    backward (--forward-only leaves it out), from just before
    the first call (CUDA context and inputs ready) until all outputs are on the device,
    through F.scaled_dot_product_attention:
      mode_cold    the mode on, an empty fastattn cache (it fills the cache the rows below use;
                   run first, once, and reported)
      mode_warm    the mode on, the cache mode_cold left (plans deserialized, not built)
      torch_cudnn, torch_flash   the mode off
    Interleaved: each round runs every warm peer once, in a rotated order; medians over
    rounds and the median of each round's ratio. The import of fastattn.torch (with the
    mode's registration) is timed apart, inside the process and outside the figure.

    python benchmarks/bench_sdpa_mode.py [--json out.json] [--quick] [--rounds N] [--repeats N]

Prints the JSON, then a `summary:` block last. Needs a CUDA GPU (exit status 2 without).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time

from _common import HELD_ITERS, calls_since, emit, first_error, fresh, fresh_cache_env, header, held_gpu_us, host_rounds, paired_ratio, require_cuda, rotated  # (benchmarks/ on sys.path)
from bench_coldstart import HEAD_DIM, HEADS, SEQLENS

PEERS = ("mode_on", "torch_cudnn", "torch_flash")
MASKED_PEERS = ("mode_on", "torch_cudnn", "torch_efficient")  # (flash takes no mask)
COLD_PEERS = ("mode_warm", "torch_cudnn", "torch_flash")  # interleaved; mode_cold runs once, first
SHAPES = {  # name -> (q's (b, h, s, d) shape, k's and v's, is_causal, mask: None, "bool" or "float")
    "prefill_1x8x128x64_causal": ((1, 8, 128, 64), (1, 8, 128, 64), True, None),
    "decode_1x8x1x4096x64": ((1, 8, 1, 64), (1, 8, 4096, 64), False, None),
    "padded_prefill_2x8x128x64_bool_mask": ((2, 8, 128, 64), (2, 8, 128, 64), False, "bool"),
    "padded_prefill_2x8x128x64_float_mask": ((2, 8, 128, 64), (2, 8, 128, 64), False, "float"),
}
LEFT_PADDING = 48  # the second sequence's padding tokens in the masked shapes
# The held loop's calls for the masked shapes: a masked call of the mode launches ~8 kernels
# and copies (its mask's conversion, the attention, the output's fill), and 200 of them
# overflow CUDA's launch queue behind the sleep (_common.HELD_ITERS).
MASKED_HELD_ITERS = 64
TARGET = 0.6  # mode_on's inference host time at most this times torch_cudnn's (unmasked calls)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true",
                    help="fewer rounds and calls (a smoke run: --iters 100 --repeats 5 --rounds 2 --forward-only)")
    ap.add_argument("--iters", type=int, default=300, help="calls per host-time sample")
    ap.add_argument("--repeats", type=int, default=21, help="interleaved host-time rounds")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved cold-start rounds (fresh processes per peer)")
    ap.add_argument("--forward-only", action="store_true", help="cold start: leave out forward + backward")
    ap.add_argument("--skip-coldstart", action="store_true", help="only (a), the host time per call")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.iters, args.repeats, args.rounds, args.forward_only = 100, 5, 2, True
    for name in ("iters", "repeats", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    return args


# -- (a) host time per call --------------------------------------------------------------------

@contextlib.contextmanager
def peer(name: str):
    """The peer's selection, entered around its loops: the mode (on for mode_on only) and
    PyTorch's backend."""
    import fastattn.torch as fat
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"torch_flash": SDPBackend.FLASH_ATTENTION,
               "torch_efficient": SDPBackend.EFFICIENT_ATTENTION}.get(name, SDPBackend.CUDNN_ATTENTION)
    if name == "mode_on":
        fat.enable_sdpa()
    try:
        with sdpa_kernel(backend):
            yield
    finally:
        if name == "mode_on":
            fat.disable_sdpa()


def padded_mask(b: int, s: int, kind: str, device: str = "cuda"):
    """The mask transformers' sdpa path gives a left-padded batch's prefill: causal, and
    the last sequence's first LEFT_PADDING keys masked (its padding queries keep no key),
    (b, 1, s, s), boolean or additive bfloat16 (0 where kept, -inf elsewhere)."""
    import torch

    keep = torch.ones(s, s, dtype=torch.bool, device=device).tril().expand(b, 1, s, s).clone()
    keep[-1, :, :, :LEFT_PADDING] = False
    if kind == "bool":
        return keep
    return torch.zeros(keep.shape, dtype=torch.bfloat16, device=device).masked_fill(~keep, float("-inf"))


def host_overhead(iters: int, repeats: int, shape: str) -> dict:
    import torch

    from fastattn.torch import _sdpa_mode

    q_shape, kv_shape, causal, mask_kind = SHAPES[shape]
    base = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in (q_shape, kv_shape, kv_shape)]
    mask = None if mask_kind is None else padded_mask(q_shape[0], q_shape[2], mask_kind)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def train_step(q, k, v):
        o = sdpa(q, k, v, attn_mask=mask, is_causal=causal)
        torch.autograd.grad(o, (q, k, v), o)  # o as its own gradient: no extra allocation in the loop

    steps, errors = {}, {}
    for name in (PEERS if mask is None else MASKED_PEERS):
        ts = [t.clone() for t in base]
        gs = [t.clone().requires_grad_() for t in base]
        # partial, not a lambda: the loops call SDPA with no Python frame of their own in between
        step = (functools.partial(peer, name), functools.partial(sdpa, *ts, attn_mask=mask, is_causal=causal),
                functools.partial(train_step, *gs))
        try:  # a backend that refuses the call is left out, its error said (host_rounds would stop at it)
            with step[0]():
                step[1]()
                step[2]()
            torch.cuda.synchronize()
        except RuntimeError as e:
            errors[name] = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            continue
        steps[name] = step
    held = min(iters, HELD_ITERS if mask is None else MASKED_HELD_ITERS)
    before = _sdpa_mode.sdpa_calls()  # (only mode_on's calls are counted: the mode is off for the others)
    rounds = host_rounds(steps, iters, repeats, held_iters=held)
    gpu = {f"{n}_gpu_us": held_gpu_us(enter, infer, held) for n, (enter, infer, _) in steps.items()}
    after = _sdpa_mode.sdpa_calls()
    res = {"shape": shape, "mask": mask_kind, "peers": list(steps), "errors": errors, "held_iters": held,
           "mode_calls": calls_since(before, after)}
    for name, r in rounds.items():
        res[f"{name}_held_us"] = statistics.median(r["held"])
        res[f"{name}_us"] = statistics.median(r["wall"])
        res[f"{name}_train_us"] = statistics.median(r["train"])
        res[f"{name}_held_valid_rounds"] = r["held_valid"]
        for key in ("held", "wall", "train"):
            res[f"{name}_{key}_us_rounds"] = r[key]
    res.update(gpu)
    res.update(host_ratios(rounds))
    return res


def host_ratios(rounds: dict) -> dict:
    """Every other peer's host times over torch_cudnn's: ratios of the medians and (paired)
    the median of each round's own ratio (none where torch_cudnn did not run)."""
    out = {}
    ref = rounds.get("torch_cudnn")
    for name in [n for n in rounds if n != "torch_cudnn"] if ref else []:
        r = rounds[name]
        for key, label in (("held", "held"), ("wall", "wall"), ("train", "train")):
            out[f"ratio_{label}_{name}_to_torch_cudnn"] = statistics.median(r[key]) / statistics.median(ref[key])
            out[f"ratio_{label}_{name}_to_torch_cudnn_paired"] = paired_ratio(r[key], ref[key])
    return out


# -- (b) cold start in fresh processes ---------------------------------------------------------

def child(variant: str, backward: bool) -> dict:
    """Runs in the fresh process: the 8 shapes through F.scaled_dot_product_attention on
    (b, h, s, d) transposed views of bshd tensors (as bench_coldstart.py's SDPA rows)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.cuda.init()
    t_a = time.perf_counter()
    if variant.startswith("mode"):
        import fastattn.torch as fat

        fat.enable_sdpa()
    t_import = time.perf_counter() - t_a
    inputs = [tuple(torch.randn(1, s, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
                    for _ in range(3)) for s in SEQLENS]
    backend = SDPBackend.FLASH_ATTENTION if variant == "torch_flash" else SDPBackend.CUDNN_ATTENTION
    sdpa_kernel(backend).__enter__()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwd_ms, bwd_ms = [], []
    for q, k, v in inputs:
        t_a = time.perf_counter()
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        t_b = time.perf_counter()
        if backward:
            o.backward(torch.ones_like(o))
        fwd_ms.append(round((t_b - t_a) * 1e3, 2))
        bwd_ms.append(round((time.perf_counter() - t_b) * 1e3, 2))
    torch.cuda.synchronize()
    res = {"seconds": time.perf_counter() - t0, "import_seconds": t_import, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms}
    if variant.startswith("mode"):
        import fastattn
        from fastattn.torch import _sdpa_mode

        res["routes"] = sorted(set(_sdpa_mode.sdpa_routes().values()))
        res["stats"] = {k: v for k, v in fastattn.stats().items() if isinstance(v, (int, float))}
    return res


def coldstart(rounds: int, backward: bool) -> dict:
    env = fresh_cache_env(tempfile.mkdtemp(prefix="fastattn-sdpa-coldstart-"))
    args = ["--backward"] if backward else []
    res: dict = {"mode_cold": fresh(__file__, ["--child", "mode_cold", *args], env)}
    runs: dict = {name: [] for name in COLD_PEERS}
    for order in rotated(COLD_PEERS, rounds):
        for name in order:
            runs[name].append(fresh(__file__, ["--child", name, *args], env))
    res.update(coldstart_medians(runs))
    return res


def coldstart_medians(runs: dict) -> dict:
    """Per peer: its rounds, the median seconds over those that ran; mode_warm's ratios to
    each torch peer (of the medians, and the median of each round's own ratio)."""
    out: dict = {}
    secs = {}
    for name, rows in runs.items():
        secs[name] = [r.get("seconds") for r in rows]
        ok = [s for s in secs[name] if s is not None]
        out[name] = {"rounds": rows, "seconds": statistics.median(ok) if ok else None,
                     "errors": len(rows) - len(ok)}
    for name in ("torch_cudnn", "torch_flash"):
        a, b = out["mode_warm"]["seconds"], out[name]["seconds"]
        out[f"ratio_mode_warm_to_{name}"] = a / b if a and b else None
        out[f"ratio_mode_warm_to_{name}_paired"] = paired_ratio(secs["mode_warm"], secs[name])
    return out


# -- output ------------------------------------------------------------------------------------

def _fmt(x, spec=".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def summary(res: dict) -> list[str]:
    lines = ["  (medians of interleaved rounds; ratios to torch_cudnn: of medians, per round in parentheses)"]
    for h in res.get("host_overhead", []):
        peers = h.get("peers", PEERS)
        calls = h.get("mode_calls", {})
        lines.append(f"  {h['shape']}: the mode served {calls.get('served')} calls, passed on {calls.get('passed_on')}"
                     + "".join(f"; {p} left out: {e}" for p, e in h.get("errors", {}).items()))
        lines.append("    host us/call (GPU held): " + ", ".join(f"{p} {h[p + '_held_us']:.2f}" for p in peers)
                     + f"; valid rounds {[h[p + '_held_valid_rounds'] for p in peers]}")
        lines.append("    wall us/call (GPU free): " + ", ".join(f"{p} {h[p + '_us']:.2f}" for p in peers))
        lines.append("    GPU us/call:             " + ", ".join(f"{p} {h[p + '_gpu_us']:.2f}" for p in peers))
        lines.append("    host us/train step:      " + ", ".join(f"{p} {h[p + '_train_us']:.2f}" for p in peers))
        for p in [p for p in peers if p != "torch_cudnn" and f"ratio_held_{p}_to_torch_cudnn" in h]:
            lines.append(f"    {p} / torch_cudnn: inference host {_fmt(h[f'ratio_held_{p}_to_torch_cudnn'])} "
                         f"({_fmt(h[f'ratio_held_{p}_to_torch_cudnn_paired'])})"
                         + (f" target <= {TARGET}" if p == "mode_on" and not h.get("mask") else "")
                         + f", wall {_fmt(h[f'ratio_wall_{p}_to_torch_cudnn'])}, training step "
                         f"{_fmt(h[f'ratio_train_{p}_to_torch_cudnn'])} "
                         f"({_fmt(h[f'ratio_train_{p}_to_torch_cudnn_paired'])})")
    for mode in ("fwd", "fwd_bwd"):
        c = res.get("coldstart", {}).get(mode)
        if not c:
            continue
        cold = c["mode_cold"]
        cells = [f"mode_cold {_fmt(cold.get('seconds') and cold['seconds'] * 1e3, '.1f')}"]
        cells += [f"{p} {_fmt(c[p]['seconds'] and c[p]['seconds'] * 1e3, '.1f')}"
                  + (f" ({c[p]['errors']} failed: {first_error(c[p]['rounds'])})" if c[p]["errors"] else "")
                  for p in COLD_PEERS]
        lines.append(f"  cold start {mode}, ms to first outputs of {len(SEQLENS)} shapes: " + ", ".join(cells))
        lines.append(f"    mode_warm / torch_cudnn {_fmt(c['ratio_mode_warm_to_torch_cudnn'])} "
                     f"({_fmt(c['ratio_mode_warm_to_torch_cudnn_paired'])}), mode_warm / torch_flash "
                     f"{_fmt(c['ratio_mode_warm_to_torch_flash'])} ({_fmt(c['ratio_mode_warm_to_torch_flash_paired'])})")
        routes = next((r.get("routes") for r in c["mode_warm"]["rounds"] if "routes" in r), None)
        lines.append(f"    mode_warm routes {routes}; mode_cold error: {first_error([cold])}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.backward)))
        return 0
    require_cuda("bench_sdpa_mode.py")


    t0 = time.perf_counter()
    res = {**header(),
           "args": {k: v for k, v in vars(args).items() if k not in ("child", "backward")},
           "host_overhead": [host_overhead(args.iters, args.repeats, s) for s in SHAPES]}
    if not args.skip_coldstart:
        res["coldstart"] = {"fwd": coldstart(args.rounds, False)}
        if not args.forward_only:
            res["coldstart"]["fwd_bwd"] = coldstart(args.rounds, True)
    res["seconds"] = time.perf_counter() - t0
    emit(res, args.json, summary(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
