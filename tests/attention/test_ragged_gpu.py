"""GPU: ragged plans given cumulative lengths (csrc/ragged.h's index kernel).

A ragged plan takes FlashAttention's cu_seqlens in place of cuDNN's per-sequence
lengths and offsets, and computes those into its workspace as part of the launch. These
tests hold that path to the explicit one bit for bit (whose float64 agreement
test_features_gpu and test_torch_gpu check), read the arrays the kernel writes, make
repeated launches replay with new lengths behind the same pointers, and check the
refusals.
"""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402,F401
from fastattn import AttentionConfig  # noqa: E402

ROWS = 7  # seq_len_q, seq_len_kv, ragged_q, _k, _v, _o, _stats: the workspace's tail


def cumulative(lengths):
    return torch.tensor([0] + list(lengths), device="cuda").cumsum(0).to(torch.int32)


def case(lq, lkv, hq, hkv, dqk, dv, training=True, same=False, seed=0):
    """A ragged plan and fresh random packed inputs for sequences of lengths lq, lkv."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cfg = AttentionConfig(batch=len(lq), heads_q=hq, heads_kv=hkv, seqlen_q=128, seqlen_kv=128, head_dim_qk=dqk,
                          head_dim_v=dv, dtype="bf16", layout="bshd", padding=True, ragged=True, mask="causal",
                          training=training)
    plan = fastattn.plan(cfg)
    cu_q = cumulative(lq)
    cu_kv = cu_q if same else cumulative(lkv)
    tq, tk = 128 * len(lq), 128 * len(lkv)  # room past the last token: the counts are the lengths'
    q = torch.randn(tq, hq, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(tk, hkv, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(tk, hkv, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    return plan, cfg, cu_q, cu_kv, q, k, v


def explicit(cfg, cu_q, cu_kv):
    """cuDNN's lengths and offsets, computed here from the cumulative lengths."""
    hq, hkv, dqk, dv = cfg.heads_q, cfg.heads_kv, cfg.head_dim_qk, cfg.head_dim_v
    out = {"seq_len_q": (cu_q[1:] - cu_q[:-1]).contiguous(), "seq_len_kv": (cu_kv[1:] - cu_kv[:-1]).contiguous(),
           "ragged_q": cu_q * (hq * dqk), "ragged_k": cu_kv * (hkv * dqk), "ragged_v": cu_kv * (hkv * dv),
           "ragged_o": cu_q * (hq * dv)}
    if cfg.training:
        out["ragged_stats"] = cu_q * hq
    return out


def run(plan, cfg, q, k, v, index, d_o=None):
    """Forward (and backward given d_o) with `index`: cumulative lengths or explicit
    arrays, by name. Outputs poisoned first (NaN), so an unwritten element shows."""
    ptrs = {n: t.data_ptr() for n, t in index.items()}
    o = torch.full((q.shape[0], cfg.heads_q, cfg.head_dim_v), float("nan"), device="cuda", dtype=q.dtype)
    stats = torch.full((q.shape[0], cfg.heads_q), float("nan"), device="cuda") if cfg.training else None
    ws = torch.empty(max(plan.workspace_size, 1), device="cuda", dtype=torch.uint8)
    s = torch.cuda.current_stream().cuda_stream
    plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr() if cfg.training else 0,
                 ws.data_ptr(), s, **ptrs)
    out = {"o": o, "stats": stats}
    if d_o is not None:
        grads = {n: torch.full_like(t, float("nan")) for n, t in (("d_q", q), ("d_k", k), ("d_v", v))}
        plan.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(),
                      grads["d_q"].data_ptr(), grads["d_k"].data_ptr(), grads["d_v"].data_ptr(), ws.data_ptr(), s,
                      **ptrs)
        out.update(grads)
    torch.cuda.synchronize()
    return out


def valid_rows(out, cu_q, cu_kv):
    """The tokens the sequences cover (rows past them are not the plan's to write)."""
    nq, nkv = int(cu_q[-1]), int(cu_kv[-1])
    return {n: t[:nkv] if n in ("d_k", "d_v") else t[:nq] for n, t in out.items() if t is not None}


@pytest.mark.parametrize("hq,hkv,dqk,dv", ((8, 8, 64, 64), (8, 2, 128, 128), (4, 1, 64, 32)),
                         ids=("mha", "gqa", "mqa_dv32"))
@pytest.mark.parametrize("same", (True, False), ids=("self", "cross"))
def test_cumulative_lengths_give_the_bits_of_explicit_lengths_and_offsets(hq, hkv, dqk, dv, same):
    lq = [100, 1, 77, 128]
    lkv = lq if same else [128, 33, 90, 5]
    plan, cfg, cu_q, cu_kv, q, k, v = case(lq, lkv, hq, hkv, dqk, dv, same=same)
    d_o = torch.randn(q.shape[0], hq, dv, device="cuda", dtype=torch.bfloat16)
    got = run(plan, cfg, q, k, v, {"cu_seqlens_q": cu_q, "cu_seqlens_kv": cu_kv}, d_o)
    want = run(plan, cfg, q, k, v, explicit(cfg, cu_q, cu_kv), d_o)
    got, want = valid_rows(got, cu_q, cu_kv), valid_rows(want, cu_q, cu_kv)
    for name in want:
        assert not got[name].isnan().any(), f"{name}: elements left unwritten"
        assert torch.equal(got[name], want[name]), name
    # And inference plans, whose graphs take no packed stats (the kernel's last row).
    plan_i, cfg_i = fastattn.plan(cfg.replace(training=False)), cfg.replace(training=False)
    got = run(plan_i, cfg_i, q, k, v, {"cu_seqlens_q": cu_q, "cu_seqlens_kv": cu_kv})
    want = run(plan_i, cfg_i, q, k, v, explicit(cfg_i, cu_q, cu_kv))
    assert torch.equal(valid_rows(got, cu_q, cu_kv)["o"], valid_rows(want, cu_q, cu_kv)["o"])


@pytest.mark.parametrize("training", (False, True), ids=("inference", "training"))
def test_the_kernel_writes_every_length_and_offset_into_the_workspace_tail(training):
    lq, lkv = [5, 64, 1, 128, 17], [9, 128, 3, 1, 60]
    plan, cfg, cu_q, cu_kv, q, k, v = case(lq, lkv, 8, 2, 128, 64, training=training)
    n = len(lq) + 1
    stride = (n + 3) // 4 * 4
    size = plan.forward_workspace_size
    tail = size - ROWS * stride * 4
    assert tail > 0 and tail % 16 == 0
    ws = torch.full((size,), 0x7F, device="cuda", dtype=torch.uint8)  # poison: 0x7F7F7F7F per int32
    o = torch.empty(q.shape[0], 8, 64, device="cuda", dtype=q.dtype)
    stats = torch.empty(q.shape[0], 8, device="cuda") if training else None
    # Cumulative lengths as arrays (checked by name against the config), the rest as addresses.
    plan.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats.data_ptr() if training else 0,
                 ws.data_ptr(), torch.cuda.current_stream().cuda_stream, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    torch.cuda.synchronize()
    rows = ws[tail:].view(torch.int32).view(ROWS, stride).cpu()
    want = explicit(cfg, cu_q, cu_kv)
    names = ("seq_len_q", "seq_len_kv", "ragged_q", "ragged_k", "ragged_v", "ragged_o", "ragged_stats")
    for row, name in enumerate(names):
        width = n - 1 if name.startswith("seq_len") else n
        if name in want:
            assert torch.equal(rows[row, :width], want[name].cpu()), name
        else:
            assert (rows[row] == 0x7F7F7F7F).all(), f"{name}: written, but the graph does not read it"


def test_replays_read_the_lengths_behind_the_same_pointers_at_every_launch():
    # The same pointers every call, as a training loop's: from the third call the launch
    # (index kernel and attention) replays as a CUDA graph, which must read each call's
    # lengths, never the captured call's.
    plan, cfg, cu_q, cu_kv, q, k, v = case([64] * 4, [64] * 4, 8, 8, 64, 64, training=False, same=True)
    torch.manual_seed(1)
    index = {"cu_seqlens_q": cu_q, "cu_seqlens_kv": cu_q}
    before = fastattn.stats()
    for call in range(8):
        lengths = torch.randint(0, 129, (4,)).tolist()
        cu_q.copy_(cumulative(lengths))
        got = valid_rows(run(plan, cfg, q, k, v, index), cu_q, cu_q)["o"]
        want = valid_rows(run(plan, cfg, q, k, v, explicit(cfg, cu_q, cu_q)), cu_q, cu_q)["o"]
        assert torch.equal(got, want), f"call {call}, lengths {lengths}"
    assert fastattn.stats()["builds"] == before["builds"]


def test_a_captured_varlen_call_replays_new_lengths_and_inputs():
    lq = [30, 100, 2]
    cu = cumulative(lq)
    q, k, v = (torch.randn(256, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        fastattn.torch.attention_varlen(q, k, v, cu, cu, 128, 128, causal=True)  # plan made outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o = fastattn.torch.attention_varlen(q, k, v, cu, cu, 128, 128, causal=True)
        for lengths in ([128, 1, 127], [5, 6, 7], [100, 100, 56]):
            cu.copy_(cumulative(lengths))
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            graph.replay()
            want = fastattn.torch.attention_varlen(q, k, v, cu, cu, 128, 128, causal=True)
            n = sum(lengths)
            assert torch.equal(o[:n], want[:n]), lengths


def test_cumulative_lengths_are_refused_where_they_do_not_belong():
    plan, cfg, cu_q, cu_kv, q, k, v = case([10, 20], [10, 20], 8, 8, 64, 64, training=False)
    o = torch.empty(q.shape[0], 8, 64, device="cuda", dtype=q.dtype)
    ws = torch.empty(plan.workspace_size, device="cuda", dtype=torch.uint8)
    base = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), 0, ws.data_ptr(), 0)
    cu = {"cu_seqlens_q": cu_q.data_ptr(), "cu_seqlens_kv": cu_kv.data_ptr()}
    with pytest.raises(fastattn.InvalidArgumentError, match="seq_len_q given with cu_seqlens_q and cu_seqlens_kv"):
        plan.forward(*base, seq_len_q=cu_q.data_ptr(), **cu)
    with pytest.raises(fastattn.InvalidArgumentError, match="cu_seqlens_kv is null: give both"):
        plan.forward(*base, cu_seqlens_q=cu_q.data_ptr())
    with pytest.raises(fastattn.InvalidArgumentError, match="cu_seqlens_q=0x[0-9a-f]+ is not 4-byte aligned"):
        plan.forward(*base, cu_seqlens_q=cu_q.data_ptr() + 2, cu_seqlens_kv=cu_kv.data_ptr())
    with pytest.raises(fastattn.InvalidArgumentError, match="cu_seqlens_q"):  # an array is checked as such
        plan.forward(*base, cu_seqlens_q=cu_q.long(), cu_seqlens_kv=cu_kv)
    dense = fastattn.plan(AttentionConfig(batch=2, heads_q=8, seqlen_q=64, head_dim_qk=64, dtype="bf16"))
    x = torch.empty(2, 64, 8, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(fastattn.InvalidArgumentError, match="cu_seqlens_q given, but only a plan built with ragged"):
        dense.forward(x.data_ptr(), x.data_ptr(), x.data_ptr(), x.data_ptr(), 0,
                      torch.empty(max(dense.workspace_size, 16), device="cuda", dtype=torch.uint8).data_ptr(), 0,
                      **cu)
    # attention_varlen: its cumulative lengths are read as arrays, so strided ones are refused.
    strided = torch.zeros(6, device="cuda", dtype=torch.int32)[::2]
    with pytest.raises(fastattn.InvalidArgumentError, match="cu_seqlens_q must be contiguous"):
        fastattn.torch.attention_varlen(q, k, v, strided, strided, 64, 64)
