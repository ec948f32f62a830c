"""Which SDPA call patterns PyTorch routes to its cuDNN backend, what ran, and whether the
answer is right, with the SDPA mode off and on (the patterns and the gates they meet:
docs/history/research-issue-40.md, "PyTorch 2.11's gates").

For each pattern (bf16 unless named, batch 2, fresh random inputs): PyTorch's backend choice
(torch._fused_sdp_choice: 0 math, 1 flash, 2 efficient, 3 cudnn), the reasons
can_use_cudnn_attention(debug=True) gives for refusing it, the aten attention operators that
ran (a TorchDispatchMode), and the output's largest error against a float64 reference
relative to the reference's largest magnitude; then the same call under
fastattn.torch.enable_sdpa(), with the mode's route for it (served, or its reason) and the
same error. A float32 additive mask with bf16 queries is among them: PyTorch sends it to
cuDNN, whose 2.11 kernel is said to read it as bf16 (pytorch/pytorch#191612).

    python benchmarks/probe_sdpa_gates.py [--json out.json]

Needs a CUDA GPU (exit status 2 without).
"""

from __future__ import annotations

import argparse
import warnings

from _common import emit, error_line, header, require_cuda  # (benchmarks/ on sys.path)


def patterns(torch, dev: str = "cuda"):
    """(name, q, k, v, mask, dropout_p, is_causal, enable_gqa) of each pattern: the shapes
    transformers' models pass, and the edges of PyTorch's cuDNN gates."""
    bf16 = torch.bfloat16

    def t(*shape, dtype=bf16):
        return torch.randn(*shape, device=dev, dtype=dtype)

    b, s, n = 2, 256, 300
    keep = torch.rand(b, 1, 1, n, device=dev) > 0.2
    keep[..., 0] = True  # no row without a key
    causal = torch.ones(s, s, device=dev, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s)
    return [
        ("gqa prefill, causal", t(b, 16, s, 64), t(b, 4, s, 64), t(b, 4, s, 64), None, 0.0, True, True),
        ("gqa decode, no mask", t(b, 16, 1, 128), t(b, 4, n, 128), t(b, 4, n, 128), None, 0.0, False, True),
        ("decode, bool mask, repeated kv", t(b, 16, 1, 128), t(b, 16, n, 128), t(b, 16, n, 128), keep, 0.0, False,
         False),
        ("head dim 256, bool mask", t(b, 8, s, 256), t(b, 8, s, 256), t(b, 8, s, 256), causal, 0.0, False, False),
        ("head dim 192, causal", t(b, 8, s, 192), t(b, 8, s, 192), t(b, 8, s, 192), None, 0.0, True, False),
        ("head dims 192 / 128, causal", t(b, 8, s, 192), t(b, 8, s, 192), t(b, 8, s, 128), None, 0.0, True, False),
        ("head dim 100, causal", t(b, 8, s, 100), t(b, 8, s, 100), t(b, 8, s, 100), None, 0.0, True, False),
        ("one key", t(b, 16, 1, 128), t(b, 4, 1, 128), t(b, 4, 1, 128), None, 0.0, False, True),
        ("float32 additive mask, bf16 queries", t(b, 8, s, 128), t(b, 8, s, 128), t(b, 8, s, 128),
         torch.randn(b, 1, s, s, device=dev), 0.0, False, False),
        ("bf16 additive mask", t(b, 8, s, 128), t(b, 8, s, 128), t(b, 8, s, 128), t(b, 1, s, s), 0.0, False, False),
        ("2-d mask", t(b, 8, s, 128), t(b, 8, s, 128), t(b, 8, s, 128), t(s, s), 0.0, False, False),
        ("3-d mask", t(b, 8, s, 128), t(b, 8, s, 128), t(b, 8, s, 128), t(1, s, s), 0.0, False, False),
        ("mask with a broadcast last dim", t(b, 8, s, 128), t(b, 8, s, 128), t(b, 8, s, 128),
         t(b, 1, s, 1).expand(b, 1, s, s), 0.0, False, False),
        ("bshd views, causal", *(t(b, s, 8, 128).transpose(1, 2) for _ in range(3)), None, 0.0, True, False),
        ("causal, 8 queries, 45 keys", t(b, 8, 8, 128), t(b, 8, 45, 128), t(b, 8, 45, 128), None, 0.0, True, False),
        ("float16, causal", *(t(b, 8, s, 128, dtype=torch.float16) for _ in range(3)), None, 0.0, True, False),
    ]


def reference(torch, q, k, v, mask, is_causal, enable_gqa):
    """float64 attention: PyTorch's math backend's definition."""
    q, k, v = q.double(), k.double(), v.double()
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if is_causal:
        scores = scores.masked_fill(~torch.ones(q.shape[2], k.shape[2], device=q.device, dtype=torch.bool).tril(),
                                    float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return scores.softmax(-1) @ v


def one(torch, name, q, k, v, mask, dropout_p, is_causal, enable_gqa) -> dict:
    import torch.nn.functional as F
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in str(func):
                self.names.add(str(func).split(".")[1])
            return func(*args, **(kwargs or {}))

    row: dict = {"pattern": name}
    try:
        row["pytorch_choice"] = int(torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, enable_gqa=enable_gqa))
    except Exception as e:
        row["pytorch_choice"] = error_line(e, 120)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            row["cudnn_ok"] = bool(can_use_cudnn_attention(
                SDPAParams(q, k, v, mask, dropout_p, is_causal, enable_gqa), True))
        except Exception as e:  # a CUDA build of PyTorch without a driver raises instead of saying no
            row["cudnn_ok"] = False
            warnings.warn(error_line(e, 160), stacklevel=1)
    row["cudnn_refusals"] = [str(w.message).splitlines()[0][:160] for w in caught]
    want = reference(torch, q, k, v, mask, is_causal, enable_gqa)
    ops = Ops()
    try:
        with ops:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                               enable_gqa=enable_gqa)
        if o.is_cuda:
            torch.cuda.synchronize()
        row["error"] = float((o.double() - want).abs().max() / want.abs().max())
        row["finite"] = bool(torch.isfinite(o).all())
    except Exception as e:
        row["failed"] = error_line(e)
    row["ops"] = sorted(ops.names)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    require_cuda("probe_sdpa_gates.py")
    import torch

    import fastattn
    import fastattn.torch as fat
    from fastattn.torch import _sdpa_mode

    torch.manual_seed(0)
    cases = patterns(torch)
    off = [one(torch, *c) for c in cases]
    fat.enable_sdpa()
    on = [one(torch, *c) for c in cases]
    routes = {str(key): route for key, route in _sdpa_mode.sdpa_routes().items()}
    fat.disable_sdpa()
    res = {**header(), "torch_git": torch.version.git_version, "mode_off": off, "mode_on": on, "routes": routes,
           "sdpa_counts": fastattn.stats().get("sdpa")}
    lines = [f"  {'pattern':<38} {'choice':>6} {'off: error, ops':<52} on: error, ops"]
    for a, b in zip(off, on):
        def cell(r):
            got = r.get("failed") or f"{r.get('error', float('nan')):.1e}{'' if r.get('finite') else ' (not finite)'}"
            return f"{got}, {','.join(r['ops'])}"

        lines.append(f"  {a['pattern']:<38} {str(a['pytorch_choice']):>6} {cell(a):<52} {cell(b)}")
    emit(res, args.json, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
