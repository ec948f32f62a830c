"""GPU: the features beyond the dense case (issue 6), against float64 references.

Padding masks (config.padding): each sequence of the batch has its own lengths, given
at run time. Checked against a reference computed on each sequence alone, with its own
lengths; every padded query row, key and value, and output gradient row holds NaN, so a
kernel that reads one produces NaN where the test looks.

ALiBi (config.alibi): slope[h] * (j - i) added to the scaled scores."""

import itertools

import numpy as np
import pytest

import fastattn
from fastattn import AttentionConfig

from gpu_helpers import DeviceBuffer, Tensor, alibi_slopes, random_inputs, reference, rel_error, synchronize

pytestmark = pytest.mark.gpu

FWD_TOL = {"fp16": 4e-3, "bf16": 2e-2}
BWD_TOL = {"fp16": 1e-2, "bf16": 4e-2}
SEQ_Q, SEQ_KV = (200, 77, 129), (257, 100, 129)  # not multiples of 64; kv >= q for bottom-right
CASES = list(itertools.product(("fp16", "bf16"), ("none", "causal", "causal_bottom_right"), ("bshd", "bhsd")))


def int32_buffer(values) -> DeviceBuffer:
    buf = DeviceBuffer(4 * len(values))
    buf.upload(np.asarray(values, dtype=np.int32))
    return buf


def with_nan_padding(x: np.ndarray, lengths, axis_len: int) -> np.ndarray:
    x = x.copy()
    for b, n in enumerate(lengths):
        x[b, :, n:axis_len] = np.nan
    return x


@pytest.mark.parametrize("dtype,mask,layout", CASES, ids=["-".join(c) for c in CASES])
def test_each_sequence_matches_float64_on_its_own_lengths(dtype, mask, layout):
    cfg = AttentionConfig(batch=3, heads_q=4, heads_kv=2, seqlen_q=max(SEQ_Q), seqlen_kv=max(SEQ_KV), head_dim_qk=128,
                          dtype=dtype, layout=layout, mask=mask, padding=True, training=True)
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    plan = fastattn.plan(cfg)
    q, k, v, d_o = random_inputs(cfg, np.random.default_rng(7), backward=True)
    t = {n: Tensor(cfg, n) for n in ("q", "k", "v", "o", "stats", "d_o", "d_q", "d_k", "d_v")}
    t["q"].write(with_nan_padding(q, SEQ_Q, cfg.seqlen_q))
    t["k"].write(with_nan_padding(k, SEQ_KV, cfg.seqlen_kv))
    t["v"].write(with_nan_padding(v, SEQ_KV, cfg.seqlen_kv))
    t["d_o"].write(with_nan_padding(d_o, SEQ_Q, cfg.seqlen_q))
    seq_q, seq_kv = int32_buffer(SEQ_Q), int32_buffer(SEQ_KV)
    ws = DeviceBuffer(plan.workspace_size)
    plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=ws.ptr,
                 seq_len_q=seq_q.ptr, seq_len_kv=seq_kv.ptr)
    plan.backward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, t["d_o"].ptr, t["stats"].ptr, t["d_q"].ptr,
                  t["d_k"].ptr, t["d_v"].ptr, workspace=ws.ptr, seq_len_q=seq_q.ptr, seq_len_kv=seq_kv.ptr)
    synchronize()
    out = {n: t[n].read() for n in ("o", "stats", "d_q", "d_k", "d_v")}
    for b, (lq, lk) in enumerate(zip(SEQ_Q, SEQ_KV)):
        one = cfg.replace(batch=1, seqlen_q=lq, seqlen_kv=lk, padding=False, layout="bhsd")
        o_ref, stats_ref, (dq_ref, dk_ref, dv_ref) = reference(
            one, q[b:b + 1, :, :lq], k[b:b + 1, :, :lk], v[b:b + 1, :, :lk], d_o[b:b + 1, :, :lq])
        errors = {
            "o": rel_error(out["o"][b:b + 1, :, :lq], o_ref),
            "stats": rel_error(out["stats"][b:b + 1, :, :lq], stats_ref),
            "d_q": rel_error(out["d_q"][b:b + 1, :, :lq], dq_ref),
            "d_k": rel_error(out["d_k"][b:b + 1, :, :lk], dk_ref),
            "d_v": rel_error(out["d_v"][b:b + 1, :, :lk], dv_ref),
        }
        assert errors["o"] < FWD_TOL[dtype] and errors["stats"] < 1e-3, (b, errors)
        assert max(errors[n] for n in ("d_q", "d_k", "d_v")) < BWD_TOL[dtype], (b, errors)


def test_lengths_are_required_by_a_padding_plan_and_refused_by_others():
    cfg = AttentionConfig(batch=2, heads_q=4, seqlen_q=128, head_dim_qk=64, padding=True)
    plan = fastattn.plan(cfg)
    t = {n: Tensor(cfg, n) for n in ("q", "k", "v", "o")}
    ws = DeviceBuffer(plan.workspace_size)
    with pytest.raises(fastattn.InvalidArgumentError, match="seq_len_q is a null pointer"):
        plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=ws.ptr)
    dense = fastattn.plan(cfg.replace(padding=False))
    lengths = int32_buffer([128, 64])
    with pytest.raises(fastattn.InvalidArgumentError, match="padding=False"):
        dense.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=ws.ptr, seq_len_q=lengths.ptr,
                      seq_len_kv=lengths.ptr)


def test_a_padding_plan_reloads_from_the_cache():
    cfg = AttentionConfig(batch=2, heads_q=4, seqlen_q=96, head_dim_qk=64, padding=True, training=True)
    p = fastattn.plan(cfg)
    fwd, bwd = p.serialize()
    from fastattn import _core

    again = _core.load_plan(cfg, p.device, fwd, bwd)
    assert again.workspace_size == p.workspace_size
    with pytest.raises(fastattn.CorruptPlanError):
        _core.load_plan(cfg.replace(padding=False), p.device, fwd, bwd)  # its tensors are not that config's


def test_alibi_slopes_are_the_papers():
    # The ALiBi paper's slopes for 8 heads: 1/2, 1/4, ..., 1/256.
    assert np.allclose(alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])
    assert len(alibi_slopes(12)) == 12


ALIBI_CASES = list(itertools.product(("fp16", "bf16"), (("causal", 200, 200), ("causal", 100, 300))))


@pytest.mark.parametrize("dtype,mask", ALIBI_CASES, ids=[f"{d}-{m[0]}-{m[1]}x{m[2]}" for d, m in ALIBI_CASES])
def test_alibi_matches_float64(dtype, mask):
    name, sq, skv = mask
    cfg = AttentionConfig(batch=2, heads_q=12, heads_kv=4, seqlen_q=sq, seqlen_kv=skv, head_dim_qk=128, dtype=dtype,
                          mask=name, alibi=True, training=True)
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    plan = fastattn.plan(cfg)
    q, k, v, d_o = random_inputs(cfg, np.random.default_rng(11), backward=True)
    t = {n: Tensor(cfg, n) for n in ("q", "k", "v", "o", "stats", "d_o", "d_q", "d_k", "d_v")}
    for n, x in (("q", q), ("k", k), ("v", v), ("d_o", d_o)):
        t[n].write(x)
    ws = DeviceBuffer(plan.workspace_size)
    plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=ws.ptr)
    plan.backward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, t["d_o"].ptr, t["stats"].ptr, t["d_q"].ptr,
                  t["d_k"].ptr, t["d_v"].ptr, workspace=ws.ptr)
    synchronize()
    o_ref, stats_ref, grads_ref = reference(cfg, q, k, v, d_o)
    errors = {"o": rel_error(t["o"].read(), o_ref), "stats": rel_error(t["stats"].read(), stats_ref)}
    errors.update({n: rel_error(t[n].read(), r) for n, r in zip(("d_q", "d_k", "d_v"), grads_ref)})
    assert errors["o"] < FWD_TOL[dtype] and errors["stats"] < 1e-3, errors
    assert max(errors[n] for n in ("d_q", "d_k", "d_v")) < BWD_TOL[dtype], errors


def test_alibi_with_a_bottom_right_diagonal_is_refused_with_cudnns_reason():
    # cudnn-frontend 1.28 allows the bottom-right diagonal with no bias, ALiBi or dropout.
    cfg = AttentionConfig(batch=1, heads_q=8, seqlen_q=100, seqlen_kv=300, head_dim_qk=64,
                          mask="causal_bottom_right", alibi=True)
    result = fastattn.probe(cfg)
    assert not result.supported and "alibi" in result.reason.lower()


def test_an_alibi_plan_reloaded_from_its_blob_gives_the_same_bits():
    # cuDNN writes the slopes into the workspace at each run; a deserialized plan must
    # still do so.
    from fastattn import _core

    cfg = AttentionConfig(batch=1, heads_q=8, seqlen_q=256, head_dim_qk=64, mask="causal", alibi=True)
    built = fastattn.plan(cfg)
    loaded = _core.load_plan(cfg, built.device, built.serialize()[0], None)
    q, k, v, _ = random_inputs(cfg, np.random.default_rng(3), backward=False)
    outs = []
    for p in (built, loaded):
        t = {n: Tensor(cfg, n) for n in ("q", "k", "v", "o")}
        for n, x in (("q", q), ("k", k), ("v", v)):
            t[n].write(x)
        ws = DeviceBuffer(p.workspace_size)
        ws.poison()
        p.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=ws.ptr)
        synchronize()
        outs.append(t["o"].raw())
    assert outs[0] == outs[1]
