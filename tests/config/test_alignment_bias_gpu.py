"""GPU: the alignment field and the one-row bias shapes through the plain
config API (probe, plan, forward, backward on raw pointers), against float64
references (helpers.gpu.reference_full, whose mask follows the config's alignment), on
fresh random inputs, outputs poisoned (helpers.gpu.Tensor starts every buffer as NaN),
and an entry built from a config in its old spelling loading from disk.

Tolerances: relative Frobenius error, fp16 4e-3 / bf16 2e-2 forward, 1e-2 / 4e-2
backward (as test_features_gpu.py), stats 1e-3."""

import itertools

import numpy as np
import pytest

import fastattn
from fastattn import AttentionConfig

from helpers.gpu import DeviceBuffer, Tensor, quantize, random_inputs, reference_full, rel_error, synchronize

FWD_TOL = {"fp16": 4e-3, "bf16": 2e-2}
BWD_TOL = {"fp16": 1e-2, "bf16": 4e-2}
NAMES = ("q", "k", "v", "o", "stats", "d_o", "d_q", "d_k", "d_v")


def int32_buffer(values) -> DeviceBuffer:
    buf = DeviceBuffer(4 * len(values))
    buf.upload(np.asarray(values, dtype=np.int32))
    return buf


def run(cfg, q, k, v, d_o, lengths=None, bias=None):
    """Forward and backward on fresh poisoned buffers: {name: float64 array}."""
    plan = fastattn.plan(cfg)
    names = NAMES + (("bias",) if bias is not None else ()) + (("d_bias",) if cfg.bias_grad else ())
    t = {n: Tensor(cfg, n) for n in names}
    for n, x in (("q", q), ("k", k), ("v", v), ("d_o", d_o)) + ((("bias", bias),) if bias is not None else ()):
        t[n].write(x)
    extra = {}
    if lengths is not None:
        keep = [int32_buffer(lengths[0]), int32_buffer(lengths[1])]
        extra = dict(seq_len_q=keep[0].ptr, seq_len_kv=keep[1].ptr)
    if bias is not None:
        extra["bias"] = t["bias"].ptr
    ws = DeviceBuffer(plan.workspace_size)
    plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=ws.ptr, **extra)
    if cfg.bias_grad:
        extra["d_bias"] = t["d_bias"].ptr
    plan.backward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, t["d_o"].ptr, t["stats"].ptr, t["d_q"].ptr,
                  t["d_k"].ptr, t["d_v"].ptr, workspace=ws.ptr, **extra)
    synchronize()
    return {n: t[n].read() for n in names if n not in ("q", "k", "v", "d_o", "bias")}


def _error(out, ref) -> float:
    """Relative error; against an exactly zero reference (window (0, 0): each query sees
    one key, so d_q is 0), the largest absolute error instead."""
    if not np.any(ref):
        return float(np.max(np.abs(out))) if np.all(np.isfinite(out)) else float("inf")
    return rel_error(out, ref)


def check(out, ref, dtype, grads=("d_q", "d_k", "d_v")):
    errors = {n: _error(out[n], ref[n]) for n in ("o", "stats") + grads}
    assert errors["o"] < FWD_TOL[dtype] and errors["stats"] < 1e-3, errors
    assert max(errors[n] for n in grads) < BWD_TOL[dtype], errors


# -- a window at the bottom right, without a causal mask ---------------------------------------

WINDOWS = ((16, 8), (-1, 4), (32, -1), (0, 0), (40, 300))
SHAPES = ((100, 300), (200, 200), (300, 130))  # seqlen_q <, =, > seqlen_kv
CASES = list(itertools.product(("fp16", "bf16"), SHAPES, WINDOWS))


@pytest.mark.parametrize("dtype,shape,window", CASES, ids=[f"{c[0]}-{c[1][0]}x{c[1][1]}-{c[2][0]},{c[2][1]}"
                                                           for c in CASES])
def test_a_window_at_the_bottom_right_matches_float64(dtype, shape, window):
    sq, sk = shape
    # cuDNN takes a window with seqlen_q > seqlen_kv only with padding: full lengths then.
    padding = sq > sk
    cfg = AttentionConfig(batch=2, heads_q=4, heads_kv=2, seqlen_q=sq, seqlen_kv=sk, head_dim_qk=64, dtype=dtype,
                          window=window, alignment="bottom_right", padding=padding, training=True)
    assert cfg.alignment == "bottom_right" or cfg.mask == "causal_bottom_right"  # (left, 0): that mask's spelling
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    q, k, v, d_o = random_inputs(cfg, np.random.default_rng(hash((sq, sk, window)) % 2**32), backward=True)
    out = run(cfg, q, k, v, d_o, lengths=((sq,) * 2, (sk,) * 2) if padding else None)
    ref = reference_full(cfg.replace(padding=False), q, k, v, d_o)
    rows = reference_rows_with_keys(cfg)  # rows that see no key: checked by test_flash_gpu.py (FA writes 0)
    for n in ("o", "stats", "d_q"):
        out[n], ref[n] = out[n][:, :, rows], ref[n][:, :, rows]
    check(out, ref, dtype)


def reference_rows_with_keys(cfg) -> np.ndarray:
    from helpers.gpu import allowed
    return allowed(cfg).any(axis=1)


@pytest.mark.parametrize("dtype", ("fp16", "bf16"))
def test_a_bottom_right_window_applies_per_sequence_with_padding(dtype):
    lens_q, lens_k = (5, 64, 100), (90, 64, 120)  # each sequence's own shift: 85, 0, 20
    cfg = AttentionConfig(batch=3, heads_q=4, heads_kv=1, seqlen_q=100, seqlen_kv=128, head_dim_qk=128, dtype=dtype,
                          window=(24, 6), alignment="bottom_right", padding=True, training=True)
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    rng = np.random.default_rng(17)
    q, k, v, d_o = random_inputs(cfg, rng, backward=True)
    out = run(cfg, q, k, v, d_o, lengths=(lens_q, lens_k))
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        one = cfg.replace(batch=1, seqlen_q=lq, seqlen_kv=lk, padding=False)
        ref = reference_full(one, q[b:b + 1, :, :lq], k[b:b + 1, :, :lk], v[b:b + 1, :, :lk], d_o[b:b + 1, :, :lq])
        got = {"o": out["o"][b:b + 1, :, :lq], "stats": out["stats"][b:b + 1, :, :lq],
               "d_q": out["d_q"][b:b + 1, :, :lq], "d_k": out["d_k"][b:b + 1, :, :lk],
               "d_v": out["d_v"][b:b + 1, :, :lk]}
        check(got, ref, dtype)


# -- the one-row bias shapes --------------------------------------------------------------------

@pytest.mark.parametrize("shape", ("111s", "1h1s", "b11s", "bh1s"))
@pytest.mark.parametrize("mask", ("none", "causal"))
def test_one_row_bias_shapes_match_float64(shape, mask):
    """Forward against float64; a training plan is refused with the reason (cuDNN 9.19's
    backward got d_q and d_k wrong for these shapes on the H200, relative error 0.75-1.0)."""
    dtype = "fp16"
    cfg = AttentionConfig(batch=2, heads_q=4, heads_kv=2, seqlen_q=130, seqlen_kv=200, head_dim_qk=64, dtype=dtype,
                          mask=mask, bias=shape, training=True)
    refused = fastattn.probe(cfg)
    assert not refused.supported and "a bias of one row" in refused.reason, refused
    cfg = cfg.replace(training=False)
    result = fastattn.probe(cfg)
    assert result.supported, result.reason  # a key-padding bias must build forward
    rng = np.random.default_rng(41)
    q, k, v, _ = random_inputs(cfg, rng, backward=False)
    bias = quantize(rng.standard_normal(cfg.shape("bias")), dtype)
    assert bias.shape[2] == 1
    plan = fastattn.plan(cfg)
    t = {n: Tensor(cfg, n) for n in ("q", "k", "v", "o", "bias")}  # o stays poisoned until the kernel writes it
    for n, x in (("q", q), ("k", k), ("v", v), ("bias", bias)):
        t[n].write(x)
    ws = DeviceBuffer(max(plan.workspace_size, 1))
    plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=ws.ptr, bias=t["bias"].ptr)
    synchronize()
    ref = reference_full(cfg, q, k, v, bias=bias)
    assert rel_error(t["o"].read(), ref["o"]) < FWD_TOL[dtype]


# -- a bottom-right diagonal beside a bias (a left-padded batch's decode steps and chunks) -------

# (seqlen_q, seqlen_kv, window): a decode step, a chunk against its cache, a sliding layer's
# chunk (transformers keeps window - 1 keys before it), a sliding decode step.
BANDS = ((1, 200, (-1, 0)), (16, 200, (-1, 0)), (16, 39, (23, 0)), (1, 200, (23, 0)), (64, 200, (-1, 0)))


@pytest.mark.parametrize("seqlen_q,seqlen_kv,window", BANDS, ids=[f"{b[0]}x{b[1]}-{b[2][0]}" for b in BANDS])
def test_a_bottom_right_diagonal_beside_a_bias_matches_float64(seqlen_q, seqlen_kv, window):
    """The given spelling (mask="causal_bottom_right" beside a full bias, training) is
    built in the form cuDNN takes (AttentionConfig's alignment: the top-left band it
    equals); forward and backward against float64 with the mask of the spelling given,
    from a reference config without the bias (which keeps that spelling)."""
    dtype = "bf16"
    fields = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=seqlen_q, seqlen_kv=seqlen_kv, head_dim_qk=64,
                  dtype=dtype, mask="causal_bottom_right", window=window, training=True)
    cfg = AttentionConfig(**fields, bias="bhss")
    as_given = AttentionConfig(**fields)
    assert as_given.mask == "causal_bottom_right" and cfg.mask == "none"
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    rng = np.random.default_rng(seqlen_q * 1000 + seqlen_kv)
    q, k, v, d_o = random_inputs(cfg, rng, backward=True)
    bias = quantize(rng.standard_normal(cfg.shape("bias")), dtype)
    out = run(cfg, q, k, v, d_o, bias=bias)
    check(out, reference_full(as_given, q, k, v, d_o, bias=bias), dtype)


@pytest.mark.parametrize("seqlen_q,seqlen_kv,window", BANDS, ids=[f"{b[0]}x{b[1]}-{b[2][0]}" for b in BANDS])
def test_a_bottom_right_diagonal_beside_a_key_padding_bias_matches_float64(seqlen_q, seqlen_kv, window):
    """transformers' left padding: a one-row key bias (0 or the dtype's lowest) of shape
    b11s beside the bottom-right diagonal, forward (inference plans), against float64."""
    dtype = "bf16"
    fields = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=seqlen_q, seqlen_kv=seqlen_kv, head_dim_qk=64,
                  dtype=dtype, mask="causal_bottom_right", window=window)
    cfg = AttentionConfig(**fields, bias="b11s")
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    rng = np.random.default_rng(7 + seqlen_q + seqlen_kv)
    q, k, v, _ = random_inputs(cfg, rng, backward=False)
    bias = np.zeros(cfg.shape("bias"))
    bias[1, ..., :5] = -3.3895313892515355e38  # the second sequence's 5 leading keys are padding (bf16's lowest)
    plan = fastattn.plan(cfg)
    t = {n: Tensor(cfg, n) for n in ("q", "k", "v", "o", "bias")}
    for n, x in (("q", q), ("k", k), ("v", v), ("bias", quantize(bias, dtype))):
        t[n].write(x)
    ws = DeviceBuffer(max(plan.workspace_size, 1))
    plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=ws.ptr, bias=t["bias"].ptr)
    synchronize()
    ref = reference_full(AttentionConfig(**fields), q, k, v, bias=quantize(bias, dtype))
    assert rel_error(t["o"].read(), ref["o"]) < FWD_TOL[dtype]


# -- old entries --------------------------------------------------------------------------------

OLD = ('{"batch":2,"deterministic":false,"dtype":"bf16","head_dim_qk":64,"head_dim_v":64,"heads_kv":2,"heads_q":8,'
       '"layout":"bshd","mask":"causal_bottom_right","scale":0.125,"seqlen_kv":256,"seqlen_q":128,"training":true,'
       '"window":[32,-1]}')


def test_an_entry_of_an_old_spelling_loads_and_serves_the_new_one():
    old = AttentionConfig.from_json(OLD)
    new = AttentionConfig(batch=2, heads_q=8, heads_kv=2, seqlen_q=128, seqlen_kv=256, head_dim_qk=64,
                          mask="causal", alignment="bottom_right", window=(32, 0), training=True)
    assert new == old and new.to_json() == OLD
    fastattn.plan(old)  # built (or found) and published under the old key
    fastattn.clear()
    fastattn.plan(new)
    stats = fastattn.stats()
    assert stats["disk_hits"] == 1 and stats["builds"] == 0, stats
