"""Verified plans: run a plan once on random and adversarial data against a float32
reference on the GPU, and judge it (fastattn.verdict's rule and tolerances).

`probe(verify=True)`, `plan(verify=True)`, `preload(verify=True)` and `fastattn warm /
probe --verify` reach this through the runtime; the verdict travels with the answer and
is stored in the cache entry, so a verified entry needs no second run.

The data kinds, each on the plan's own shape (the s_kv residues that cuDNN's tiles care
about are those of the shapes being verified):
  random   q, k, v, d_o ~ N(0, 1) (a bias ~ N(0, 0.5^2)); full lengths with padding.
  low_lse  every query anti-aligned with every key (one coordinate of q is 1, the same
           coordinate of every key -120 / scale), so each row's log-sum-exp is far below
           -ln(FLT_MAX) ~ -88.7: the rows where cuDNN 9.19's SM90 backward gives NaN
           (huggingface/trl#7181's construction, as tests/attention/
           test_numerics_gpu.py's `adversarial`).
  lengths  with padding: random per-sequence lengths in [1, s]; with a bottom-right
           diagonal, sequences whose s_q exceeds their s_kv have rows that see no key
           (fully masked: the reference's output and gradients there are 0). Only the
           rows within each sequence's lengths are compared.
Forward (o) always; backward (d_q, d_k, d_v, and d_bias with bias_grad, random and
low_lse kinds) where the plan has one. The softmax stats are not compared.

The reference: float32, on the plan's GPU, one (batch, kv head) at a time and in blocks
of queries, so that its memory stays below about CHUNK_ELEMENTS scores (times the few
copies it keeps) whatever the shape; the backward written out (ds = p (dp - delta)).

On low_lse data d_q is judged by its non-finite count alone (compare() says why); every
other output, and d_q on the other kinds, by the rule.

Rounding that is not an error: where an output element is a sum of large terms that
cancel (d_q's coordinate that every key shares, on low_lse data: terms ~120 times the
result), a kernel that rounds its 16-bit operands (cuDNN and PyTorch's efficient kernel
round ds to the input dtype before the ds @ k product) is off by up to the unit roundoff
times the sum of the terms' magnitudes. compare() forgives each element FLOOR times that
(the reference's "bound_X"), and judges only the error beyond it against the tolerance.

Needs PyTorch (the optional extra fastattn.torch uses): without it, verify_plan raises
InvalidArgumentError saying so. Configs the reference does not model (FP8, packed or
paged layouts, dropout, sinks, ALiBi) get a "skipped" verdict saying why.
"""

from __future__ import annotations

import math
import time
from typing import Any

from . import _fields, dtypes
from .config import FIELDS, AttentionConfig
from .errors import InvalidArgumentError
from .verdict import TOLERANCE, Check, Verdict

__all__ = ["verify_plan", "unverifiable", "data_kinds", "adversarial_inputs", "reference", "CHUNK_ELEMENTS", "LOGIT"]

CHUNK_ELEMENTS = 1 << 24  # scores held at once by the reference (64 MiB in float32; a few such tensors live at once)
LOGIT = -120.0  # every score of the low_lse kind: each row's LSE ~ -120 + ln(s_kv) < -88.7
_TORCH_DTYPES = dtypes.VERIFIED
UNIT_ROUNDOFF = {d.name: d.unit_roundoff for d in dtypes.ROWS if d.unit_roundoff is not None}
FLOOR = 2.0  # times the unit roundoff times an element's bound: rounding, not error


def _torch():
    try:
        import torch
    except ImportError as e:
        raise InvalidArgumentError(f"verify (--verify, verify=True) needs PyTorch for its GPU reference, and it "
                                   f"cannot be imported here ({e}): pip install torch") from None
    if not torch.cuda.is_available():
        raise InvalidArgumentError("verify (--verify, verify=True) needs PyTorch with CUDA for its GPU reference; "
                                   f"this torch ({torch.__version__}) sees no CUDA device")
    return torch


def unverifiable(config: AttentionConfig) -> str | None:
    """Why the reference cannot check `config`, or None."""
    if config.dtype not in _TORCH_DTYPES:
        return f"{config.dtype} plans (FP8 scales and amaxes) are not covered by the reference"
    for on, what in ((config.ragged, "packed sequences"), (config.page_size > 0, "a paged KV cache"),
                     (config.dropout > 0, "dropout (its random mask)"), (config.sinks, "attention sinks"),
                     (config.alibi, "ALiBi")):
        if on:
            return f"{what} not covered by the reference"
    return None


def data_kinds(config: AttentionConfig) -> tuple[str, ...]:
    """The kinds of data a plan of `config` is verified on (this module's docstring)."""
    return ("random", "low_lse") + (("lengths",) if config.padding else ())


def verify_plan(plan: Any, config: AttentionConfig, device: int) -> Verdict:
    """Runs `plan` (a _core.Plan of `config`, on CUDA device `device`) once on each data
    kind and judges its outputs against the float32 reference. Raises
    InvalidArgumentError without PyTorch (or CUDA in it); CUDA and cuDNN errors of the
    plan's run propagate as the plan's execute raises them."""
    from . import _core  # loaded already: `plan` is one of its plans

    t0 = time.perf_counter()
    cudnn = int(_core.versions()[0] or 0)  # the cuDNN loaded at run time
    tolerance = TOLERANCE.get(config.dtype, TOLERANCE["bf16"])
    torch = _torch()  # asked first: verify means the same on every config, FP8 ones included
    why = unverifiable(config)
    if why is not None:
        return Verdict("skipped", cudnn, tolerance, (), why, time.perf_counter() - t0)
    checks: list[Check] = []
    with torch.cuda.device(device):
        for n, kind in enumerate(data_kinds(config)):
            inputs = make_inputs(config, kind, seed=1234 + n)
            ours = run_plan(plan, config, inputs)
            ref = reference(config, inputs)
            checks.extend(compare(config, kind, inputs, ours, ref))
            del inputs, ours, ref
        torch.cuda.synchronize()
    return Verdict.judge(checks, cudnn, tolerance, time.perf_counter() - t0)


# -- data --------------------------------------------------------------------------------


def adversarial_inputs(q, k, scale: float, logit: float = LOGIT):
    """q, k (float, (b, h, s, d)) changed in place so that every score is ~ `logit`:
    coordinate 0 of every query is 1 and of every key logit / scale (the rest small)."""
    q.mul_(0.1)
    k.mul_(0.1)
    q[..., 0] = 1.0
    k[..., 0] = logit / scale
    return q, k


def make_inputs(config: AttentionConfig, kind: str, seed: int) -> dict[str, Any]:
    """Logical (b, h, s, d) tensors on the current CUDA device, rounded to the config's
    dtype: q, k, v (and d_o with training; bias with one), and with padding the int32
    lengths seq_len_q, seq_len_kv."""
    torch = _torch()
    dt = getattr(torch, dtypes.BY_NAME[config.dtype].torch)
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(name, factor=1.0):
        return torch.randn(config.shape(name), device="cuda", generator=g) * factor

    q, k, v = randn("q"), randn("k"), randn("v")
    if kind == "low_lse":
        adversarial_inputs(q, k, config.scale)
    out = {"q": q.to(dt), "k": k.to(dt), "v": v.to(dt)}
    if config.training:
        out["d_o"] = randn("o").to(dt)
    if config.bias != "none":
        out["bias"] = randn("bias", 0.5).to(dt)
    if config.padding:
        b = config.batch
        if kind == "lengths":
            out["seq_len_q"] = torch.randint(1, config.seqlen_q + 1, (b,), device="cuda", generator=g,
                                             dtype=torch.int32)
            out["seq_len_kv"] = torch.randint(1, config.seqlen_kv + 1, (b,), device="cuda", generator=g,
                                              dtype=torch.int32)
        else:
            out["seq_len_q"] = torch.full((b,), config.seqlen_q, device="cuda", dtype=torch.int32)
            out["seq_len_kv"] = torch.full((b,), config.seqlen_kv, device="cuda", dtype=torch.int32)
    return out


# -- the plan's run ----------------------------------------------------------------------


def _placed(config: AttentionConfig, name: str, fill: Any = None):
    """A logical view of `name` at the config's strides over its own storage, poisoned
    with NaN (an element the plan leaves unwritten shows) or holding `fill`."""
    torch = _torch()
    dtype_name = config.dtype_of(name)
    dt = getattr(torch, dtypes.BY_NAME[dtype_name].torch)
    storage = torch.full((max(config.storage_elements(name), 1),), float("nan"), device="cuda", dtype=dt)
    view = storage.as_strided(config.shape(name), config.strides(name))
    if fill is not None:
        view.copy_(fill)
    return view


def run_plan(plan: Any, config: AttentionConfig, inputs: dict[str, Any]) -> dict[str, Any]:
    """The plan's outputs (logical views) for `inputs`, after its forward (and backward)."""
    torch = _torch()
    t = {name: _placed(config, name, inputs[name]) for name in ("q", "k", "v")}
    t["o"] = _placed(config, "o")
    extra: dict[str, int] = {}
    if "bias" in inputs:
        t["bias"] = _placed(config, "bias", inputs["bias"])
        extra["bias"] = t["bias"].data_ptr()
    lengths: dict[str, int] = {}
    if config.padding:
        lengths = {"seq_len_q": inputs["seq_len_q"].data_ptr(), "seq_len_kv": inputs["seq_len_kv"].data_ptr()}
    stats = _placed(config, "stats") if config.training else None
    ws = torch.empty(max(plan.workspace_size, 1), device="cuda", dtype=torch.uint8)
    stream = torch.cuda.current_stream().cuda_stream
    plan.forward(t["q"].data_ptr(), t["k"].data_ptr(), t["v"].data_ptr(), t["o"].data_ptr(),
                 stats=stats.data_ptr() if stats is not None else 0, workspace=ws.data_ptr(), stream=stream,
                 **lengths, **extra)
    out = {"o": t["o"]}
    if config.training:
        d_o = _placed(config, "d_o", inputs["d_o"])
        grads = {name: _placed(config, name) for name in ("d_q", "d_k", "d_v")}
        if config.bias_grad:
            grads["d_bias"] = _placed(config, "d_bias")
            extra["d_bias"] = grads["d_bias"].data_ptr()
        plan.backward(t["q"].data_ptr(), t["k"].data_ptr(), t["v"].data_ptr(), t["o"].data_ptr(), d_o.data_ptr(),
                      stats.data_ptr(), grads["d_q"].data_ptr(), grads["d_k"].data_ptr(), grads["d_v"].data_ptr(),
                      workspace=ws.data_ptr(), stream=stream, **lengths, **extra)
        out.update(grads)
    torch.cuda.synchronize()
    return out


# -- the reference -----------------------------------------------------------------------


def _allowed(torch, config: AttentionConfig, rows, lq: int, lkv: int):
    """(len(rows), lkv) bool: the keys each query row sees, within one sequence's
    lengths (the diagonal at the bottom right of those lengths where aligned there)."""
    bottom_right = config.mask == "causal_bottom_right" or config.alignment == "bottom_right"
    shift = lkv - lq if bottom_right else 0
    left, right = config.window
    if config.mask != "none":
        right = 0
    i = rows[:, None]
    j = torch.arange(lkv, device="cuda")[None, :]
    ok = torch.ones((len(rows), lkv), dtype=torch.bool, device="cuda")
    if right >= 0:
        ok &= j <= i + shift + right
    if left >= 0:
        ok &= j >= i + shift - left
    return ok


def reference(config: AttentionConfig, inputs: dict[str, Any]) -> dict[str, Any]:
    """Float32 attention of `inputs` (make_inputs' tensors) as `config` defines it:
    o, and with d_o the gradients d_q, d_k, d_v (and d_bias with bias_grad), logical
    (b, h, s, d) float32; zero outside each sequence's lengths and on rows that see no
    key. Beside each output X, "bound_X": the sum of the magnitudes of the terms each of
    its elements adds (o: p @ |v|; d_q: scale |ds| @ |k|; ...), what the rounding of a
    16-bit operand costs at most in proportion to (compare's floor). Computed per
    (batch, kv head) in blocks of queries (CHUNK_ELEMENTS), the backward written out."""
    torch = _torch()
    b, hq, hkv = config.batch, config.heads_q, config.heads_kv
    group = hq // hkv
    backward = "d_o" in inputs
    f32 = {name: inputs[name].float() for name in ("q", "k", "v", "d_o", "bias") if name in inputs}
    q, k, v = f32["q"], f32["k"], f32["v"]
    bias = f32.get("bias")
    out = {"o": torch.zeros(config.shape("o"), device="cuda"), "bound_o": torch.zeros(config.shape("o"), device="cuda")}
    if backward:
        for name, like in (("d_q", q), ("d_k", k), ("d_v", v)) + ((("d_bias", bias),) if config.bias_grad else ()):
            out[name], out["bound_" + name] = torch.zeros_like(like), torch.zeros_like(like)
    lq_all = inputs["seq_len_q"].tolist() if config.padding else [config.seqlen_q] * b
    lkv_all = inputs["seq_len_kv"].tolist() if config.padding else [config.seqlen_kv] * b
    block = max(1, CHUNK_ELEMENTS // (group * max(config.seqlen_kv, 1)))
    modifiers = _fields.score_modifiers(FIELDS, config)  # (what each field's `score` in the registry computes)
    for n in range(b):
        lq, lkv = int(lq_all[n]), int(lkv_all[n])
        for g in range(hkv):
            heads = slice(g * group, (g + 1) * group)
            ks, vs = k[n, g, :lkv], v[n, g, :lkv]
            for i0 in range(0, lq, block):
                i1 = min(lq, i0 + block)
                rows = slice(i0, i1)
                qs = q[n, heads, rows]
                s = torch.matmul(qs, ks.T) * config.scale
                derivatives = []  # each score modifier's derivative, for the backward's chain rule
                for score, value in modifiers:
                    s, derivative = score(value, s)
                    derivatives.append(derivative)
                if bias is not None:
                    bb = bias[n if bias.shape[0] > 1 else 0]
                    bb = bb[heads] if bb.shape[0] > 1 else bb
                    s = s + (bb[:, rows, :lkv] if bb.shape[1] > 1 else bb[:, :, :lkv])
                ok = _allowed(torch, config, torch.arange(i0, i1, device="cuda"), lq, lkv)
                s = torch.where(ok, s, float("-inf"))
                m = s.amax(dim=-1, keepdim=True)
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row that sees no key: p = 0
                e = torch.exp(s - m)
                den = e.sum(dim=-1, keepdim=True)
                p = e / torch.where(den > 0, den, torch.ones_like(den))
                del s, e
                o = torch.matmul(p, vs)
                out["o"][n, heads, rows] = o
                out["bound_o"][n, heads, rows] = torch.matmul(p, vs.abs())
                if not backward:
                    continue
                do = f32["d_o"][n, heads, rows]
                ds = p * (torch.matmul(do, vs.T) - (do * o).sum(dim=-1, keepdim=True))  # d score (after the cap)
                if config.bias_grad:
                    _add_bias_grad(out, n, heads, rows, lkv, ds)
                for derivative in reversed(derivatives):
                    ds = ds * derivative
                ads = ds.abs()
                out["d_q"][n, heads, rows] = config.scale * torch.matmul(ds, ks)
                out["bound_d_q"][n, heads, rows] = config.scale * torch.matmul(ads, ks.abs())
                # GQA: the group's query heads all add to their kv head
                out["d_k"][n, g, :lkv] += config.scale * torch.einsum("hqk,hqd->kd", ds, qs)
                out["bound_d_k"][n, g, :lkv] += config.scale * torch.einsum("hqk,hqd->kd", ads, qs.abs())
                out["d_v"][n, g, :lkv] += torch.einsum("hqk,hqd->kd", p, do)
                out["bound_d_v"][n, g, :lkv] += torch.einsum("hqk,hqd->kd", p, do.abs())
                del p, ds, ads
    return out


def _add_bias_grad(out: dict[str, Any], n: int, heads: slice, rows: slice, lkv: int, ds) -> None:
    """d_bias += ds summed over the bias's broadcast dimensions (batch, heads, rows)."""
    d, bound = out["d_bias"], out["bound_d_bias"]
    nb = n if d.shape[0] > 1 else 0
    for target, x in ((d, ds), (bound, ds.abs())):
        x = x if d.shape[1] > 1 else x.sum(dim=0, keepdim=True)
        x = x if d.shape[2] > 1 else x.sum(dim=1, keepdim=True)
        hs = heads if d.shape[1] > 1 else slice(0, 1)
        rs = rows if d.shape[2] > 1 else slice(0, 1)
        target[nb, hs, rs, :lkv] += x


# -- the judgement -----------------------------------------------------------------------


def _valid_rows(torch, config: AttentionConfig, inputs: dict[str, Any], name: str):
    """(b, 1, s, 1) bool over the rows of `name` within each sequence's lengths, or None
    where every row counts."""
    if not config.padding or name == "d_bias":
        return None
    lengths = inputs["seq_len_kv" if name in ("d_k", "d_v") else "seq_len_q"]
    s = config.shape(name)[2]
    return (torch.arange(s, device="cuda")[None, :] < lengths[:, None].long())[:, None, :, None]


def compare(config: AttentionConfig, kind: str, inputs: dict[str, Any], ours: dict[str, Any],
            ref: dict[str, Any]) -> list[Check]:
    """One Check per output: the largest absolute error where both are finite, the
    largest beyond each element's rounding floor (FLOOR x UNIT_ROUNDOFF x its bound),
    the reference's largest magnitude, the plan's non-finite elements where the
    reference is finite (within each sequence's lengths)."""
    torch = _torch()
    unit = FLOOR * UNIT_ROUNDOFF.get(config.dtype, UNIT_ROUNDOFF["bf16"])
    checks = []
    for name in ("o", "d_q", "d_k", "d_v", "d_bias"):
        if name not in ours or name not in ref or (name == "d_bias" and kind == "lengths"):
            continue
        x, r = ours[name].float(), ref[name].float()
        rows = _valid_rows(torch, config, inputs, name)
        keep = torch.isfinite(r) if rows is None else torch.isfinite(r) & rows
        finite = torch.isfinite(x)
        nonfinite = int((keep & ~finite).sum())
        zero = torch.zeros_like(r)
        diff = torch.where(keep & finite, (x - r).abs(), zero)
        floor = unit * ref["bound_" + name].float() if "bound_" + name in ref else zero
        if kind == "low_lse" and name == "d_q":
            # Finiteness only: its shared coordinate is ill-conditioned past any tolerance
            # a float32 reference could justify. Measured on the H200 (cuDNN 9.19), cuDNN's correct
            # plans and PyTorch's efficient kernel alike were 0.4-6.8x the scale beyond
            # the rounding floor there on causal plans; what this kind exists to catch,
            # cuDNN 9.19's NaN in such rows, is the non-finite count, still judged.
            floor = torch.full_like(r, math.inf)
        numbers = [float(t.max()) if r.numel() else 0.0
                   for t in (diff, (diff - floor).clamp_min(0), torch.where(keep, r.abs(), zero))]
        big = 3.4e38  # past float32's range (an overflow in x - r): stored as the largest float32
        err, excess, scale = (v if math.isfinite(v) else big for v in numbers)
        checks.append(Check(kind, name, err, scale, nonfinite, excess))
    return checks
