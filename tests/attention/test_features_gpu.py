"""GPU: the features beyond the dense case, against float64 references.

Padding masks (config.padding): each sequence of the batch has its own lengths, given
at run time. Checked against a reference computed on each sequence alone, with its own
lengths. Every padded query row, key and value, and output gradient row holds large
finite garbage, so a kernel that lets one count changes the results where the test
looks. (Not NaN: cuDNN reads the padded rows of its last tile and multiplies them by
zero, so NaN there leaks into o and the gradients; measured on the H200, see
docs/API.md. The padded rows must hold finite values, as documented.)
The outputs start as NaN, and cuDNN writes zero to their padded rows.

ALiBi (config.alibi): slope[h] * (j - i) added to the scaled scores.

Packed sequences (ragged), bias and its gradient, dropout, sinks and a paged KV
cache: each against a float64 reference (helpers.gpu.reference_full) on fresh random
inputs."""

import itertools

import numpy as np
import pytest

import fastattn
from fastattn import AttentionConfig

from helpers.gpu import (DeviceBuffer, Tensor, alibi_slopes, from_raw, quantize, random_inputs, reference, reference_full,
                         rel_error, synchronize, to_raw)

FWD_TOL = {"fp16": 4e-3, "bf16": 2e-2}
BWD_TOL = {"fp16": 1e-2, "bf16": 4e-2}
SEQ_Q, SEQ_KV = (200, 77, 129), (257, 100, 129)  # not multiples of 64; kv >= q for bottom-right
CASES = list(itertools.product(("fp16", "bf16"), ("none", "causal", "causal_bottom_right"), ("bshd", "bhsd")))


def int32_buffer(values) -> DeviceBuffer:
    buf = DeviceBuffer(4 * len(values))
    buf.upload(np.asarray(values, dtype=np.int32))
    return buf


def with_garbage_padding(x: np.ndarray, lengths, axis_len: int, rng: np.random.Generator) -> np.ndarray:
    """Large finite values past each sequence's length (fp16 and bf16 hold them)."""
    x = x.copy()
    for b, n in enumerate(lengths):
        x[b, :, n:axis_len] = rng.uniform(-3e4, 3e4, size=x[b, :, n:axis_len].shape)
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
    rng = np.random.default_rng(8)
    t["q"].write(with_garbage_padding(q, SEQ_Q, cfg.seqlen_q, rng))
    t["k"].write(with_garbage_padding(k, SEQ_KV, cfg.seqlen_kv, rng))
    t["v"].write(with_garbage_padding(v, SEQ_KV, cfg.seqlen_kv, rng))
    t["d_o"].write(with_garbage_padding(d_o, SEQ_Q, cfg.seqlen_q, rng))
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
        for name, length in (("o", lq), ("d_q", lq), ("d_k", lk), ("d_v", lk)):
            assert np.all(out[name][b, :, length:] == 0), (b, name)  # written, and zero


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


# -- packed sequences (THD) ---------------------------------------------------------------

SLACK = 64  # garbage tokens after the packed ones: a kernel that reads or writes past them shows


def packed_buffer(seqs, dtype, rng) -> DeviceBuffer:
    """Sequences of (1, h, n, d) values packed token after token as (tokens, h, d), then
    SLACK tokens of finite garbage."""
    h, d = seqs[0].shape[1], seqs[0].shape[3]
    rows = [x[0].transpose(1, 0, 2) for x in seqs] + [rng.uniform(-3e4, 3e4, size=(SLACK, h, d))]
    raw = to_raw(np.concatenate(rows), dtype)
    buf = DeviceBuffer(raw.nbytes)
    buf.upload(raw)
    return buf


def unpack(buf: DeviceBuffer, lengths, h, d, dtype):
    """(per-sequence (1, h, n, d) values, the SLACK tokens after them) of a packed buffer."""
    total = sum(lengths) + SLACK
    flat = from_raw(buf.download(np.uint16, total * h * d), dtype).reshape(total, h, d)
    starts = np.cumsum([0] + list(lengths))
    seqs = [flat[a:b].transpose(1, 0, 2)[None] for a, b in zip(starts[:-1], starts[1:])]
    return seqs, flat[starts[-1]:]


def offsets_buffer(lengths, per_token) -> DeviceBuffer:
    return int32_buffer(np.cumsum([0] + list(lengths)) * per_token)


def empty_packed(lengths, h, d) -> DeviceBuffer:
    buf = DeviceBuffer((sum(lengths) + SLACK) * h * d * 2)
    buf.poison()
    return buf


@pytest.mark.parametrize("dtype,mask", list(itertools.product(("fp16", "bf16"), ("none", "causal"))))
def test_packed_sequences_match_float64_each_on_its_own(dtype, mask):
    hq, hkv, d = 4, 2, 128
    cfg = AttentionConfig(batch=3, heads_q=hq, heads_kv=hkv, seqlen_q=max(SEQ_Q), seqlen_kv=max(SEQ_KV), head_dim_qk=d,
                          dtype=dtype, mask=mask, padding=True, ragged=True, training=True,
                          max_tokens_q=sum(SEQ_Q), max_tokens_kv=sum(SEQ_KV))
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    plan = fastattn.plan(cfg)
    rng = np.random.default_rng(21)
    ins = {"q": [], "k": [], "v": [], "d_o": []}
    for lq, lk in zip(SEQ_Q, SEQ_KV):
        ins["q"].append(quantize(rng.standard_normal((1, hq, lq, d)), dtype))
        ins["d_o"].append(quantize(rng.standard_normal((1, hq, lq, d)), dtype))
        ins["k"].append(quantize(rng.standard_normal((1, hkv, lk, d)), dtype))
        ins["v"].append(quantize(rng.standard_normal((1, hkv, lk, d)), dtype))
    bufs = {n: packed_buffer(x, dtype, rng) for n, x in ins.items()}
    lens = {"q": SEQ_Q, "o": SEQ_Q, "d_q": SEQ_Q, "k": SEQ_KV, "v": SEQ_KV, "d_k": SEQ_KV, "d_v": SEQ_KV}
    heads = {"q": hq, "o": hq, "d_q": hq, "k": hkv, "v": hkv, "d_k": hkv, "d_v": hkv}
    for n in ("o", "d_q", "d_k", "d_v"):
        bufs[n] = empty_packed(lens[n], heads[n], d)
    offs = {n: offsets_buffer(lens[n], heads[n] * d) for n in ("q", "k", "v", "o")}
    offs["stats"] = offsets_buffer(SEQ_Q, hq)  # packed float32 stats: (tokens, heads_q)
    ragged = {f"ragged_{n}": offs[n].ptr for n in offs}
    stats = DeviceBuffer((sum(SEQ_Q) + SLACK) * hq * 4)
    stats.poison()
    seq_q, seq_kv = int32_buffer(SEQ_Q), int32_buffer(SEQ_KV)
    ws = DeviceBuffer(plan.workspace_size)
    plan.forward(bufs["q"].ptr, bufs["k"].ptr, bufs["v"].ptr, bufs["o"].ptr, stats=stats.ptr, workspace=ws.ptr,
                 seq_len_q=seq_q.ptr, seq_len_kv=seq_kv.ptr, **ragged)
    inference = fastattn.plan(cfg.replace(training=False))  # no stats: no ragged_stats
    with pytest.raises(fastattn.InvalidArgumentError, match="ragged_stats given"):
        inference.forward(bufs["q"].ptr, bufs["k"].ptr, bufs["v"].ptr, bufs["o"].ptr, workspace=ws.ptr,
                          seq_len_q=seq_q.ptr, seq_len_kv=seq_kv.ptr, **ragged)
    plan.backward(bufs["q"].ptr, bufs["k"].ptr, bufs["v"].ptr, bufs["o"].ptr, bufs["d_o"].ptr, stats.ptr,
                  bufs["d_q"].ptr, bufs["d_k"].ptr, bufs["d_v"].ptr, workspace=ws.ptr, seq_len_q=seq_q.ptr,
                  seq_len_kv=seq_kv.ptr, **ragged)
    synchronize()
    out, after = {}, {}
    for n in ("o", "d_q", "d_k", "d_v"):
        out[n], after[n] = unpack(bufs[n], lens[n], heads[n], d, dtype)
    flat_stats = stats.download(np.float32, (sum(SEQ_Q) + SLACK) * hq).astype(np.float64).reshape(-1, hq)
    starts = np.cumsum([0] + list(SEQ_Q))
    for b, (lq, lk) in enumerate(zip(SEQ_Q, SEQ_KV)):
        one = AttentionConfig(batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=lq, seqlen_kv=lk, head_dim_qk=d,
                              dtype=dtype, mask=mask)
        ref = reference_full(one, ins["q"][b], ins["k"][b], ins["v"][b], ins["d_o"][b])
        errors = {n: rel_error(out[n][b], ref[n]) for n in ("o", "d_q", "d_k", "d_v")}
        errors["stats"] = rel_error(flat_stats[starts[b]:starts[b + 1]].T[None, :, :, None], ref["stats"])
        assert errors["o"] < FWD_TOL[dtype] and errors["stats"] < 1e-3, (b, errors)
        assert max(errors[n] for n in ("d_q", "d_k", "d_v")) < BWD_TOL[dtype], (b, errors)
    after["stats"] = flat_stats[starts[-1]:]
    for n in after:  # nothing written past the packed tokens
        assert np.all(np.isnan(after[n])), f"{n}: cuDNN wrote past the last sequence's tokens"


def test_a_ragged_plan_needs_its_offsets():
    cfg = AttentionConfig(batch=2, heads_q=4, seqlen_q=64, head_dim_qk=64, padding=True, ragged=True)
    plan = fastattn.plan(cfg)
    t = {n: DeviceBuffer(cfg.storage_elements(n) * 2) for n in ("q", "k", "v", "o")}
    lengths = int32_buffer([64, 64])
    ws = DeviceBuffer(plan.workspace_size)
    with pytest.raises(fastattn.InvalidArgumentError, match="ragged_q is a null pointer"):
        plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=ws.ptr, seq_len_q=lengths.ptr,
                     seq_len_kv=lengths.ptr)


# -- bias and its gradient --------------------------------------------------------------------


@pytest.mark.parametrize("shape", ("11ss", "1hss", "b1ss", "bhss"))
def test_bias_and_its_gradient_match_float64(shape):
    dtype = "fp16"
    cfg = AttentionConfig(batch=2, heads_q=4, heads_kv=2, seqlen_q=130, seqlen_kv=200, head_dim_qk=64, dtype=dtype,
                          mask="causal", bias=shape, training=True, bias_grad=True)
    result = fastattn.probe(cfg)
    if not result.supported:  # cuDNN's d_bias covers fewer shapes than its bias: then the bias alone
        assert "bias" in result.reason.lower(), result.reason
        cfg = cfg.replace(bias_grad=False)
        result = fastattn.probe(cfg)
    assert result.supported, result.reason
    plan = fastattn.plan(cfg)
    rng = np.random.default_rng(31)
    q, k, v, d_o = random_inputs(cfg, rng, backward=True)
    bias = quantize(rng.standard_normal(cfg.shape("bias")), dtype)
    names = ("q", "k", "v", "o", "stats", "d_o", "d_q", "d_k", "d_v", "bias") + (("d_bias",) if cfg.bias_grad else ())
    t = {n: Tensor(cfg, n) for n in names}
    for n, x in (("q", q), ("k", k), ("v", v), ("d_o", d_o), ("bias", bias)):
        t[n].write(x)
    ws = DeviceBuffer(plan.workspace_size)
    plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=ws.ptr,
                 bias=t["bias"].ptr)
    plan.backward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, t["d_o"].ptr, t["stats"].ptr, t["d_q"].ptr,
                  t["d_k"].ptr, t["d_v"].ptr, workspace=ws.ptr, bias=t["bias"].ptr,
                  d_bias=t["d_bias"].ptr if cfg.bias_grad else 0)
    synchronize()
    ref = reference_full(cfg, q, k, v, d_o, bias=bias)
    grads = ("d_q", "d_k", "d_v") + (("d_bias",) if cfg.bias_grad else ())
    errors = {n: rel_error(t[n].read(), ref[n]) for n in ("o", "stats") + grads}
    assert errors["o"] < FWD_TOL[dtype] and errors["stats"] < 1e-3, errors
    assert max(errors[n] for n in grads) < BWD_TOL[dtype], errors
    if shape == "1hss":  # TransformerEngine's usual shape: its gradient must exist
        assert cfg.bias_grad


# -- attention sinks ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,mask", list(itertools.product(("fp16", "bf16"), ("none", "causal"))))
def test_sinks_and_their_gradient_match_float64(dtype, mask):
    cfg = AttentionConfig(batch=2, heads_q=8, heads_kv=2, seqlen_q=150, seqlen_kv=150, head_dim_qk=64, dtype=dtype,
                          mask=mask, sinks=True, training=True)
    result = fastattn.probe(cfg)
    if fastattn.versions()["cudnn_loaded"] < 91300:  # the version gate is cudnn-frontend's: its reason names it
        assert not result.supported and "9.13" in result.reason, result.reason
        return
    assert result.supported, result.reason
    plan = fastattn.plan(cfg)
    rng = np.random.default_rng(41)
    q, k, v, d_o = random_inputs(cfg, rng, backward=True)
    sink = rng.standard_normal(cfg.heads_q).astype(np.float32).astype(np.float64) + 1.0
    t = {n: Tensor(cfg, n) for n in ("q", "k", "v", "o", "stats", "d_o", "d_q", "d_k", "d_v", "sink", "d_sink")}
    for n, x in (("q", q), ("k", k), ("v", v), ("d_o", d_o), ("sink", sink.reshape(1, -1, 1, 1))):
        t[n].write(x)
    ws = DeviceBuffer(plan.workspace_size)
    plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=ws.ptr,
                 sink=t["sink"].ptr)
    plan.backward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, t["d_o"].ptr, t["stats"].ptr, t["d_q"].ptr,
                  t["d_k"].ptr, t["d_v"].ptr, workspace=ws.ptr, sink=t["sink"].ptr, d_sink=t["d_sink"].ptr)
    synchronize()
    ref = reference_full(cfg, q, k, v, d_o, sink=sink)
    errors = {n: rel_error(t[n].read(), ref[n]) for n in ("o", "stats", "d_q", "d_k", "d_v")}
    errors["d_sink"] = rel_error(t["d_sink"].read().reshape(-1), ref["d_sink"])
    assert errors["o"] < FWD_TOL[dtype] and errors["stats"] < 1e-3, errors
    assert max(errors[n] for n in ("d_q", "d_k", "d_v", "d_sink")) < BWD_TOL[dtype], errors


# -- dropout ----------------------------------------------------------------------------------------


def int64_buffer(value: int) -> DeviceBuffer:
    buf = DeviceBuffer(16)
    buf.upload(np.array([value, 0], dtype=np.int64))
    return buf


def test_dropout_drops_at_its_rate_with_one_mask_for_forward_and_backward():
    # With v[j] the one-hot vector e_j (seqlen_kv <= head_dim_v), o[i, j] is the dropped
    # and rescaled weight p[i, j] * keep[i, j] / (1 - p): the forward shows its mask.
    dtype, rate = "fp16", 0.25
    cfg = AttentionConfig(batch=2, heads_q=4, heads_kv=2, seqlen_q=128, seqlen_kv=64, head_dim_qk=64, dtype=dtype,
                          dropout=rate, training=True)
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    plan = fastattn.plan(cfg)
    rng = np.random.default_rng(51)
    q, k, v, d_o = random_inputs(cfg, rng, backward=True)
    t = {n: Tensor(cfg, n) for n in ("q", "k", "v", "o", "stats", "d_o", "d_q", "d_k", "d_v")}
    for n, x in (("q", q), ("k", k), ("d_o", d_o)):
        t[n].write(x)
    ws = DeviceBuffer(plan.workspace_size)
    seed, offset = int64_buffer(1234), int64_buffer(7)

    def forward(values, seed_buf):
        t["v"].write(values)
        plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=ws.ptr,
                     seed=seed_buf.ptr, offset=offset.ptr)
        synchronize()
        return t["o"].read()

    one_hot = np.broadcast_to(np.eye(cfg.seqlen_kv, cfg.head_dim_v), cfg.shape("v")).copy()
    keep = (forward(one_hot, seed)[..., :cfg.seqlen_kv] != 0).astype(np.float64)
    n = keep.size
    dropped = 1.0 - keep.mean()
    assert abs(dropped - rate) < 5 * np.sqrt(rate * (1 - rate) / n), dropped
    ref = reference_full(cfg, q, k, one_hot, keep=keep)
    assert rel_error(t["o"].read(), ref["o"]) < FWD_TOL[dtype]
    assert not np.array_equal(keep, forward(one_hot, int64_buffer(99))[..., :cfg.seqlen_kv] != 0)  # the seed counts

    o = forward(v, seed)  # the same seed and offset: the same mask, whatever v holds
    plan.backward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, t["d_o"].ptr, t["stats"].ptr, t["d_q"].ptr,
                  t["d_k"].ptr, t["d_v"].ptr, workspace=ws.ptr, seed=seed.ptr, offset=offset.ptr)
    synchronize()
    ref = reference_full(cfg, q, k, v, d_o, keep=keep)
    errors = {"o": rel_error(o, ref["o"])}
    errors.update({n: rel_error(t[n].read(), ref[n]) for n in ("d_q", "d_k", "d_v")})
    assert errors["o"] < FWD_TOL[dtype], errors
    assert max(errors[n] for n in ("d_q", "d_k", "d_v")) < BWD_TOL[dtype], errors


# -- paged KV cache -------------------------------------------------------------------------------

KV_LENS = (100, 257, 33)


@pytest.mark.parametrize("q_lens,mask", [((1, 1, 1), "none"), ((32, 20, 32), "causal_bottom_right")],
                         ids=["decode", "prefill"])
def test_paged_kv_equals_the_same_kv_laid_out_densely(q_lens, mask):
    dtype, hq, hkv, d, page = "bf16", 8, 2, 128, 64
    cfg = AttentionConfig(batch=3, heads_q=hq, heads_kv=hkv, seqlen_q=max(q_lens), seqlen_kv=max(KV_LENS),
                          head_dim_qk=d, dtype=dtype, mask=mask, padding=True, page_size=page, num_pages=20)
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    plan = fastattn.plan(cfg)
    rng = np.random.default_rng(61)
    q = quantize(rng.standard_normal(cfg.shape("q")), dtype)
    # The pool's pages in a random order, and finite garbage in the ones no sequence uses.
    pool_k = quantize(rng.uniform(-3e4, 3e4, size=cfg.shape("k")), dtype)
    pool_v = quantize(rng.uniform(-3e4, 3e4, size=cfg.shape("v")), dtype)
    order = rng.permutation(cfg.num_pages)
    table = np.zeros((cfg.batch, cfg.pages_per_sequence), dtype=np.int32)
    dense_k, dense_v = [], []
    for b, n in enumerate(KV_LENS):
        k_b = quantize(rng.standard_normal((1, hkv, n, d)), dtype)
        v_b = quantize(rng.standard_normal((1, hkv, n, d)), dtype)
        dense_k.append(k_b)
        dense_v.append(v_b)
        for i in range(-(-n // page)):
            p = order[b * cfg.pages_per_sequence + i]
            table[b, i] = p
            rows = slice(i * page, min(n, (i + 1) * page))
            pool_k[p, :, :rows.stop - rows.start] = k_b[0, :, rows]
            pool_v[p, :, :rows.stop - rows.start] = v_b[0, :, rows]
    t = {n: Tensor(cfg, n) for n in ("q", "k", "v", "o")}
    for n, x in (("q", q), ("k", pool_k), ("v", pool_v)):
        t[n].write(x)
    tables = int32_buffer(table.reshape(-1))
    seq_q, seq_kv = int32_buffer(q_lens), int32_buffer(KV_LENS)
    ws = DeviceBuffer(plan.workspace_size)
    plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=ws.ptr, seq_len_q=seq_q.ptr,
                 seq_len_kv=seq_kv.ptr, page_table_k=tables.ptr, page_table_v=tables.ptr)
    synchronize()
    o = t["o"].read()
    for b, (lq, lk) in enumerate(zip(q_lens, KV_LENS)):
        one = AttentionConfig(batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=lq, seqlen_kv=lk, head_dim_qk=d, dtype=dtype,
                              mask=mask)
        ref = reference_full(one, q[b:b + 1, :, :lq], dense_k[b], dense_v[b])
        assert rel_error(o[b:b + 1, :, :lq], ref["o"]) < FWD_TOL[dtype], b


def test_a_host_seed_draws_the_mask_of_the_same_device_seed():
    # host_seed passes seed and offset by value; Philox must not care where they came from.
    cfg = AttentionConfig(batch=1, heads_q=2, seqlen_q=64, seqlen_kv=64, head_dim_qk=64, dtype="fp16", dropout=0.5,
                          training=True)
    rng = np.random.default_rng(52)
    q, k, _, d_o = random_inputs(cfg, rng, backward=True)
    one_hot = np.broadcast_to(np.eye(64), cfg.shape("v")).copy()
    keeps = []
    for c in (cfg, cfg.replace(host_seed=True)):
        plan = fastattn.plan(c)
        t = {n: Tensor(c, n) for n in ("q", "k", "v", "o", "stats")}
        for n, x in (("q", q), ("k", k), ("v", one_hot)):
            t[n].write(x)
        ws = DeviceBuffer(plan.workspace_size)
        seed, offset = (int64_buffer(1234), int64_buffer(7)) if not c.host_seed else (1234, 7)
        plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=ws.ptr,
                     seed=seed if c.host_seed else seed.ptr, offset=offset if c.host_seed else offset.ptr)
        synchronize()
        keeps.append(t["o"].read() != 0)
    assert 0.4 < 1 - keeps[0].mean() < 0.6 and np.array_equal(keeps[0], keeps[1])


# -- every feature's plan survives the persistent cache ---------------------------------------

RELOAD_CASES = {
    "padding": dict(padding=True, training=True),
    "ragged": dict(padding=True, ragged=True, training=True),
    "bias_grad": dict(bias="1hss", bias_grad=True, training=True, mask="causal"),
    "alibi": dict(alibi=True, training=True, mask="causal"),
    "dropout": dict(dropout=0.2, training=True),
    "dropout_host_seed": dict(dropout=0.2, host_seed=True, training=True),
    "sinks": dict(sinks=True, training=True, mask="causal"),
    "paged": dict(padding=True, page_size=32, seqlen_q=1),
}


def feature_buffers(cfg: AttentionConfig, rng: np.random.Generator) -> tuple[dict, dict]:
    """(inputs, outputs): device buffers for every tensor a plan of cfg takes, inputs
    filled deterministically from rng, outputs poisoned. Host seeds are plain ints."""
    b = cfg.batch
    lens_q = [max(1, cfg.seqlen_q - 7 * i) for i in range(b)]
    lens_kv = [max(1, cfg.seqlen_kv - 5 * i) for i in range(b)]

    def filled(name, values=None):
        n = cfg.storage_elements(name)
        kind = AttentionConfig.tensor_dtype(name, cfg.dtype)
        if values is None:
            values = rng.standard_normal(n)
        raw = np.asarray(values, dtype=np.float32) if kind == "float32" else to_raw(np.asarray(values), cfg.dtype)
        buf = DeviceBuffer(raw.nbytes)
        buf.upload(raw)
        return buf

    def empty(name):
        itemsize = 4 if AttentionConfig.tensor_dtype(name, cfg.dtype) == "float32" else 2
        buf = DeviceBuffer(cfg.storage_elements(name) * itemsize)
        buf.poison()
        return buf

    ins = {n: filled(n) for n in ("q", "k", "v")}
    outs = {"o": empty("o")}
    if cfg.training:
        ins["d_o"] = filled("d_o")
        outs.update({n: empty(n) for n in ("stats", "d_q", "d_k", "d_v")})
    if cfg.padding:
        ins["seq_len_q"], ins["seq_len_kv"] = int32_buffer(lens_q), int32_buffer(lens_kv)
    if cfg.ragged:
        for n, lens, heads, dim in (("q", lens_q, cfg.heads_q, cfg.head_dim_qk), ("k", lens_kv, cfg.heads_kv,
                                    cfg.head_dim_qk), ("v", lens_kv, cfg.heads_kv, cfg.head_dim_v),
                                    ("o", lens_q, cfg.heads_q, cfg.head_dim_v)):
            ins[f"ragged_{n}"] = offsets_buffer(lens, heads * dim)
        if cfg.training:
            ins["ragged_stats"] = offsets_buffer(lens_q, cfg.heads_q)
    if cfg.bias != "none":
        ins["bias"] = filled("bias")
        if cfg.bias_grad:
            outs["d_bias"] = empty("d_bias")
    if cfg.dropout:
        ins["seed"], ins["offset"] = (1234, 5) if cfg.host_seed else (int64_buffer(1234), int64_buffer(5))
    if cfg.sinks:
        ins["sink"] = filled("sink")
        if cfg.training:
            outs["d_sink"] = empty("d_sink")
    if cfg.page_size:
        table = np.arange(b * cfg.pages_per_sequence, dtype=np.int32) % cfg.num_pages
        ins["page_table_k"] = ins["page_table_v"] = int32_buffer(table)
    return ins, outs


def run_features(plan, cfg: AttentionConfig, ins: dict, outs: dict) -> dict:
    """Runs forward (and backward when training); returns every output's bytes."""
    ptr = {n: (x if isinstance(x, int) else x.ptr) for n, x in {**ins, **outs}.items()}
    extra = {n: ptr[n] for n in ("seq_len_q", "seq_len_kv") if n in ptr}
    keywords = {n: ptr[n] for n in ("ragged_q", "ragged_k", "ragged_v", "ragged_o", "ragged_stats", "bias", "seed",
                                    "offset", "sink", "page_table_k", "page_table_v") if n in ptr}
    ws = DeviceBuffer(plan.workspace_size)
    plan.forward(ptr["q"], ptr["k"], ptr["v"], ptr["o"], stats=ptr.get("stats", 0), workspace=ws.ptr, **extra,
                 **keywords)
    if cfg.training:  # (a paged plan has no backward)
        grads = {n: ptr[n] for n in ("d_bias", "d_sink") if n in ptr}
        plan.backward(ptr["q"], ptr["k"], ptr["v"], ptr["o"], ptr["d_o"], ptr["stats"], ptr["d_q"], ptr["d_k"],
                      ptr["d_v"], workspace=ws.ptr, **extra, **keywords, **grads)
    synchronize()
    return {n: b.download(np.uint8, b.nbytes).tobytes() for n, b in outs.items()}


def built_and_loaded(name: str):
    """(config, its built plan, that plan loaded from its blob) for RELOAD_CASES[name], or
    None where the loaded cuDNN refuses it by design (sinks before 9.13, asserted here)."""
    from fastattn import _core

    base = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=96, seqlen_kv=80, head_dim_qk=64, dtype="bf16")
    cfg = AttentionConfig(**{**base, **RELOAD_CASES[name]})
    result = fastattn.probe(cfg)
    if name == "sinks" and fastattn.versions()["cudnn_loaded"] < 91300:
        assert not result.supported
        return None
    assert result.supported, result.reason
    built = fastattn.plan(cfg)
    return cfg, built, _core.load_plan(cfg, built.device, *built.serialize())


def assert_same_computation(cfg: AttentionConfig, plans, seed: int) -> None:
    """Each plan run on the same inputs (feature_buffers of `seed`) gives the same outputs:
    the forward's bit for bit, the backward's to rounding."""
    ins, _ = feature_buffers(cfg, np.random.default_rng(seed))
    runs = []
    for plan in plans:
        _, outs = feature_buffers(cfg, np.random.default_rng(seed))
        runs.append(run_features(plan, cfg, ins, outs))
    assert runs[0]["o"] == runs[1]["o"]  # forward: the same kernel on the same data, bit for bit
    for n in runs[0]:  # backward may accumulate in another order (atomics): equal to rounding
        if n == "stats" and cfg.padding:
            continue  # what cuDNN leaves in padded rows of stats is unspecified
        a, b = (np.frombuffer(r[n], dtype=np.float32 if n in ("stats", "d_sink") else np.uint16) for r in runs)
        if n not in ("stats", "d_sink"):
            a, b = from_raw(a.copy(), cfg.dtype), from_raw(b.copy(), cfg.dtype)
        finite = np.isfinite(a) & np.isfinite(b)
        assert np.array_equal(np.isfinite(a), np.isfinite(b)), n
        assert np.abs(a[finite] - b[finite]).max(initial=0) <= 2e-2 * max(1.0, np.abs(a[finite]).max(initial=0)), n


@pytest.mark.parametrize("name", list(RELOAD_CASES))
def test_every_features_plan_reloads_from_its_blob_and_computes_the_same(name):
    made = built_and_loaded(name)
    if made is None:
        return
    cfg, built, loaded = made
    assert loaded.workspace_size == built.workspace_size
    assert_same_computation(cfg, (built, loaded), 71)


@pytest.mark.parametrize("name", list(RELOAD_CASES))
def test_every_features_plan_loads_its_kernels_on_scratch_and_then_computes_the_same(name):
    """Plan.load_kernels (the warm-up's, run ahead of a plan's first call) launches each
    graph on zeroed scratch of the config's sizes: every tensor the plan takes, a host
    seed as a host value. A plan loaded from its blob and so warmed first computes what
    the built plan computes."""
    made = built_and_loaded(name)
    if made is None:
        return
    cfg, built, loaded = made
    loaded.load_kernels()
    loaded.load_kernels()  # again: nothing held from the first
    synchronize()
    assert_same_computation(cfg, (built, loaded), 72)


def test_load_kernels_refuses_scratch_over_half_the_devices_free_memory():
    """Its scratch is taken beside the caller's allocations: never more than half of the
    device's free memory. A plan whose forward tensors alone exceed half of the whole
    device is refused, with a CudaError that says so, whatever else runs there."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    per_batch = 4 * 32 * 8192 * 128 * 2  # q, k, v, o of one sequence: 32 heads, 8192 rows, 128 dims, bf16
    cfg = AttentionConfig(batch=total // 2 // per_batch + 1, heads_q=32, seqlen_q=8192, head_dim_qk=128, dtype="bf16",
                          mask="causal")
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    with pytest.raises(fastattn.errors.CudaError, match=r"^load_kernels: its scratch \(\d+ bytes\) would take more "
                                                        r"than half of device 0's free memory"):
        fastattn.plan(cfg).load_kernels()
