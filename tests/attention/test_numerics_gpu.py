"""GPU: adversarial numerics. Rows whose log-sum-exp is far below -ln(FLT_MAX)
~ -88.7 (every query anti-aligned with every key), across the s_kv residues mod 128 that
cuDNN's 128-key tiles care about, forward and backward against a float64 reference: no
non-finite output or gradient on finite inputs, and errors no worse than twice PyTorch's
efficient kernel's on the same inputs. fastattn.defects' remedies are what makes the
s_kv = 64 (mod 128) and s_q = 1 cases pass on cuDNN 9.19's SM90 kernels.

Through fastattn.torch (whichever path the machine takes), fastattn.flash (dense and
varlen) and the raw plans."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402,F401
from fastattn import AttentionConfig, defects  # noqa: E402

from helpers.gpu import DeviceBuffer, Tensor, quantize, synchronize  # noqa: E402

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# A floor under "twice the efficient kernel's error": the rounding of a 16-bit output alone
# (~2^-9 fp16, ~2^-6 bf16 relative, averaged over a tensor), so that two results that are
# both exact to rounding never fail on which one rounded luckier.
FLOOR = {"bf16": 8e-3, "fp16": 1e-3}
RESIDUES = (0, 1, 63, 64, 65, 127)
LOGIT = -120.0  # every score ~ -120 after scaling: each row's LSE ~ -120 + ln(s_kv) < -88.7


def adversarial(b, h, sq, skv, d, dtype, seed):
    """q, k, v, d_o (bhsd, CUDA, `dtype`): random small components, plus one coordinate
    where every query is anti-aligned with every key, so every logit is ~ LOGIT
    (the construction of huggingface/trl#7181's repro)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, sq, d, device="cuda", generator=g) * 0.1
    k = torch.randn(b, h, skv, d, device="cuda", generator=g) * 0.1
    v = torch.randn(b, h, skv, d, device="cuda", generator=g)
    d_o = torch.randn(b, h, sq, d, device="cuda", generator=g)
    q[..., 0] = 1.0
    k[..., 0] = LOGIT * math.sqrt(d)  # times the softmax scale 1/sqrt(d): LOGIT
    return tuple(t.to(dtype) for t in (q, k, v, d_o))


def additive_mask(sq, skv, causal, bias):
    """What the efficient kernel and the reference take: the bias plus a causal mask
    (top left) as -inf, float32 (b, h, sq, skv)-broadcastable, or None."""
    m = None if bias is None else bias.float()
    if causal:
        tri = torch.ones(sq, skv, dtype=torch.bool, device="cuda").tril()
        c = torch.zeros(sq, skv, device="cuda").masked_fill(~tri, float("-inf"))[None, None]
        m = c if m is None else m + c
    return m


def grads(fn, q, k, v, d_o):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    o.backward(d_o)
    return {"o": o.detach(), "d_q": q.grad, "d_k": k.grad, "d_v": v.grad}


def reference(q, k, v, d_o, mask):
    def f(q, k, v):
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if mask is not None:
            s = s + mask.double()
        return torch.softmax(s, dim=-1) @ v

    return grads(f, *(t.double() for t in (q, k, v, d_o)))


def efficient(q, k, v, d_o, mask):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def f(q, k, v):
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None if mask is None else mask.to(q.dtype))

    return grads(f, q, k, v, d_o)


def fastattn_torch(q, k, v, d_o, causal, bias):
    def f(q, k, v):  # bhsd in, bhsd out
        return fastattn.torch.attention(q, k, v, causal=causal, bias=bias, layout="bhsd")

    return grads(f, q, k, v, d_o)


def rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def check(ours, eff, ref, dtype, where):
    """Finite everywhere, and no worse than twice the efficient kernel (or its floor)."""
    errors = {}
    for name in ("o", "d_q", "d_k", "d_v"):
        bad = int((~torch.isfinite(ours[name])).sum())
        assert bad == 0, f"{where}: {name} has {bad} non-finite elements (finite inputs)"
        e_ours, e_eff = rel(ours[name], ref[name]), rel(eff[name], ref[name])
        errors[name] = (e_ours, e_eff)
        if math.isfinite(e_eff):
            assert e_ours <= max(2 * e_eff, FLOOR[dtype]), f"{where}: {name} error {e_ours:.3g} vs efficient {e_eff:.3g}"
        else:  # the efficient kernel failed itself: hold ours to the reference alone
            assert e_ours <= 4 * FLOOR[dtype], f"{where}: {name} error {e_ours:.3g}"
    return errors


GRID = list(itertools.product(RESIDUES, ("bf16", "fp16"), (64, 128), (False, True), (False, True)))


@pytest.mark.parametrize("residue,dtype,head_dim,with_bias,causal", GRID,
                         ids=[f"kv{128 + r}-{t}-d{d}-{'bias' if b else 'nobias'}-{'causal' if c else 'full'}"
                              for r, t, d, b, c in GRID])
def test_adversarial_rows_are_finite_and_as_accurate_as_the_efficient_kernel(residue, dtype, head_dim, with_bias,
                                                                            causal):
    b, h, sq, skv = 1, 2, 96, 128 + residue
    tdt = TORCH_DTYPES[dtype]
    q, k, v, d_o = adversarial(b, h, sq, skv, head_dim, tdt, seed=residue * 7 + head_dim)
    bias = (torch.randn(1, h, sq, skv, device="cuda") * 0.5).to(tdt) if with_bias else None
    mask = additive_mask(sq, skv, causal, bias)
    ref = reference(q, k, v, d_o, mask)
    assert float(torch.logsumexp(
        (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(head_dim), -1).max()) < -88.7
    ours = fastattn_torch(q, k, v, d_o, causal, bias)
    eff = efficient(q, k, v, d_o, mask)
    print(check(ours, eff, ref, dtype, f"s_kv={skv} {dtype} d={head_dim} bias={with_bias} causal={causal}"))


FLASH = list(itertools.product((0, 64, 65), ("bf16", "fp16"), (64, 128), (False, True)))


@pytest.mark.parametrize("residue,dtype,head_dim,causal", FLASH,
                         ids=[f"kv{128 + r}-{t}-d{d}-{'causal' if c else 'full'}" for r, t, d, c in FLASH])
def test_adversarial_rows_through_fastattn_flash(residue, dtype, head_dim, causal):
    # FlashAttention's causal mask is at the bottom right: every row sees a key here (s_q < s_kv).
    from fastattn.flash import flash_attn_func

    b, h, sq, skv = 1, 2, 96, 128 + residue
    q, k, v, d_o = adversarial(b, h, sq, skv, head_dim, TORCH_DTYPES[dtype], seed=residue * 5 + head_dim)
    mask = None
    if causal:
        keep = torch.ones(sq, skv, dtype=torch.bool, device="cuda").tril(diagonal=skv - sq)
        mask = torch.zeros(sq, skv, device="cuda").masked_fill(~keep, float("-inf"))[None, None]

    def f(q, k, v):  # bhsd in and out; FlashAttention's functions take bshd
        t = (x.transpose(1, 2) for x in (q, k, v))
        return flash_attn_func(*t, causal=causal).transpose(1, 2)

    ours = grads(f, q, k, v, d_o)
    print(check(ours, efficient(q, k, v, d_o, mask), reference(q, k, v, d_o, mask), dtype,
                f"flash s_kv={skv} {dtype} d={head_dim} causal={causal}"))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_adversarial_rows_through_fastattn_flash_varlen(dtype):
    # Two packed sequences of 96 queries and 192 keys (s_kv = 64 mod 128), non-causal.
    from fastattn.flash import flash_attn_varlen_func

    tdt = TORCH_DTYPES[dtype]
    parts = [adversarial(1, 2, 96, 192, 64, tdt, seed=11 + i) for i in range(2)]
    cu_q = torch.tensor([0, 96, 192], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 192, 384], dtype=torch.int32, device="cuda")
    packed = [torch.cat([p[i][0].transpose(0, 1) for p in parts]) for i in range(4)]  # (tokens, h, d) each

    def f(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 96, 192)

    ours = grads(f, *packed[:3], packed[3])
    for i, (q, k, v, d_o) in enumerate(parts):
        rows_q, rows_k = slice(96 * i, 96 * (i + 1)), slice(192 * i, 192 * (i + 1))
        mine = {name: ours[name][rows_k if name in ("d_k", "d_v") else rows_q].transpose(0, 1)[None]
                for name in ("o", "d_q", "d_k", "d_v")}
        print(check(mine, efficient(q, k, v, d_o, None), reference(q, k, v, d_o, None), dtype,
                    f"flash varlen sequence {i} {dtype}"))


SINGLE = list(itertools.product((97, 128, 256), ("bf16", "fp16")))


@pytest.mark.parametrize("skv,dtype", SINGLE, ids=[f"kv{s}-{t}" for s, t in SINGLE])
def test_one_query_row_with_shifted_logits_has_finite_gradients(skv, dtype):
    # cudnn-frontend#1072: s_q = 1, s_kv = 128, non-causal: NaN d_k and d_v without the remedy.
    tdt = TORCH_DTYPES[dtype]
    q, k, v, d_o = adversarial(1, 2, 1, skv, 64, tdt, seed=skv)
    ref = reference(q, k, v, d_o, None)
    ours = fastattn_torch(q, k, v, d_o, False, None)
    eff = efficient(q, k, v, d_o, None)
    print(check(ours, eff, ref, dtype, f"s_q=1 s_kv={skv} {dtype}"))


def _affected(defect_name):
    # The registry's own range for the defect (its fixed version included), on this GPU
    # and the cuDNN loaded: a test says what the range claims, not a range of its own.
    fastattn.probe(AttentionConfig(batch=1, heads_q=1, seqlen_q=64, head_dim_qk=64))  # loads cuDNN
    d = next(d for d in defects.DEFECTS if d.name == defect_name)
    return (tuple(torch.cuda.get_device_capability()) in d.capabilities
            and d.affects_version(fastattn.versions()["cudnn_loaded"] or 0))


def _sm90_with_an_affected_cudnn():
    return _affected("sm90-bwd-kv-tail")


def test_the_probe_reports_the_remedy_where_the_registry_applies():
    cfg = AttentionConfig(batch=1, heads_q=2, seqlen_q=96, seqlen_kv=192, head_dim_qk=64, dtype="bf16",
                          training=True)
    fastattn.probe(cfg)  # loads cuDNN: versions() names it afterwards
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    if _sm90_with_an_affected_cudnn():
        assert result.avoided == ("sm90-bwd-kv-tail:full_lengths",)
        assert fastattn.plan(cfg).defects.full_lengths == frozenset({"backward"})
    plain = cfg.replace(mask="causal")
    assert fastattn.probe(plain).avoided == ()
    assert not fastattn.plan(plain).defects


RAW = list(itertools.product((192, 200), ("bf16", "fp16")))


@pytest.mark.parametrize("skv,dtype", RAW, ids=[f"kv{s}-{t}" for s, t in RAW])
def test_raw_plans_supply_the_lengths_themselves(skv, dtype):
    # Plan.forward / backward with the pointers of a plain config, no seq_len arrays: a
    # remedied plan passes its own (csrc: Layout::owned); the caller's call is unchanged.
    cfg = AttentionConfig(batch=2, heads_q=2, seqlen_q=96, seqlen_kv=skv, head_dim_qk=64, dtype=dtype,
                          layout="bhsd", training=True)
    p = fastattn.plan(cfg)
    assert bool(p.defects) == (skv % 128 == 64 and _sm90_with_an_affected_cudnn())
    tdt = TORCH_DTYPES[dtype]
    q, k, v, d_o = (quantize(t.float().cpu().numpy().astype(np.float64), dtype)
                    for t in adversarial(2, 2, 96, skv, 64, tdt, seed=skv + 1))
    t = {name: Tensor(cfg, name) for name in ("q", "k", "v", "o", "stats", "d_o", "d_q", "d_k", "d_v")}
    for name, x in (("q", q), ("k", k), ("v", v), ("d_o", d_o)):
        t[name].write(x)
    ws = DeviceBuffer(p.workspace_size)
    p.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=ws.ptr)
    p.backward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, t["d_o"].ptr, t["stats"].ptr, t["d_q"].ptr,
               t["d_k"].ptr, t["d_v"].ptr, workspace=ws.ptr)
    synchronize()
    # Adversarial rows cancel large terms in d_q (every key shares coordinate 0): held,
    # as the grid above, to twice PyTorch's efficient kernel on the same inputs.
    tq, tk, tv, tdo = (torch.from_numpy(x).to("cuda", tdt) for x in (q, k, v, d_o))
    ours = {name: torch.from_numpy(np.ascontiguousarray(t[name].read())).cuda() for name in ("o", "d_q", "d_k", "d_v")}
    check(ours, efficient(tq, tk, tv, tdo, None), reference(tq, tk, tv, tdo, None), dtype, f"raw kv{skv}")


def test_a_plain_plan_given_seq_len_still_refuses_it():
    # The remedy's lengths are the plan's own: a caller's seq_len is still an error naming it.
    cfg = AttentionConfig(batch=1, heads_q=2, seqlen_q=96, seqlen_kv=192, head_dim_qk=64, dtype="bf16",
                          layout="bhsd", training=True)
    p = fastattn.plan(cfg)
    bufs = {name: Tensor(cfg, name) for name in ("q", "k", "v", "o", "stats", "d_o", "d_q", "d_k", "d_v")}
    lens = DeviceBuffer(64)
    ws = DeviceBuffer(p.workspace_size)
    with pytest.raises(fastattn.InvalidArgumentError, match="seq_len_q"):
        p.backward(*(bufs[n].ptr for n in ("q", "k", "v", "o", "d_o", "stats", "d_q", "d_k", "d_v")),
                   workspace=ws.ptr, seq_len_q=lens.ptr, seq_len_kv=lens.ptr)
    assert defects.decide(cfg, 91900, (9, 0))  # the config this test is about is an affected one


def test_the_plain_graph_still_shows_the_defect_the_registry_names():
    # The registry's reason to exist, seen failing: the plain graph (registry=()) on the
    # adversarial rows gives non-finite d_q where fastattn.defects says cuDNN is affected.
    # When this fails, the loaded cuDNN may have fixed the defect: measure it with this
    # file and close the range (Defect.fixed) in fastattn/defects.py. Outside the range (past
    # its end, or another GPU) the same plain graph is finite: what the range claims, seen.
    affected = _sm90_with_an_affected_cudnn()
    from fastattn import _core

    cfg = AttentionConfig(batch=1, heads_q=2, seqlen_q=192, seqlen_kv=192, head_dim_qk=64, dtype="bf16",
                          layout="bhsd", training=True)
    plain = _core.build_plan(cfg, torch.cuda.current_device(), registry=())
    assert not plain.defects
    q, k, v, d_o = adversarial(1, 2, 192, 192, 64, torch.bfloat16, seed=3)
    o, d_q, d_k, d_v = (torch.empty_like(x) for x in (q, q, k, v))
    stats = torch.empty(1, 2, 192, 1, device="cuda", dtype=torch.float32)
    ws = torch.empty(max(plain.workspace_size, 1), device="cuda", dtype=torch.uint8)
    stream = torch.cuda.current_stream().cuda_stream
    plain.forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), stats=stats.data_ptr(),
                  workspace=ws.data_ptr(), stream=stream)
    plain.backward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), d_o.data_ptr(), stats.data_ptr(),
                   d_q.data_ptr(), d_k.data_ptr(), d_v.data_ptr(), workspace=ws.data_ptr(), stream=stream)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(o).all()), "the forward is not where the defect is"
    loaded = fastattn.versions()["cudnn_loaded"]
    if affected:
        assert not bool(torch.isfinite(d_q).all()), (
            f"cuDNN {loaded}'s plain backward is finite here: the defect sm90-bwd-kv-tail may be fixed in it; "
            "measure and set Defect.fixed in fastattn/defects.py")
    else:
        assert all(bool(torch.isfinite(t).all()) for t in (d_q, d_k, d_v)), (
            f"cuDNN {loaded} on this GPU is outside sm90-bwd-kv-tail's range and its plain backward is not finite")


def test_a_one_row_training_config_is_refused_where_cudnn_crashes_building_it():
    # cudnn-frontend#1071: on 9.28.1 (H100) the plain backward plan for batch = heads = s_q = 1
    # crashed the process while it was created; 9.19.0 and 9.24.0 built it. Where the registry
    # says so the probe refuses it, naming the defect, and this process lives; elsewhere the
    # plan builds and trains (a range that is wrong either way fails here).
    cfg = AttentionConfig(batch=1, heads_q=1, seqlen_q=1, seqlen_kv=128, head_dim_qk=64, dtype="bf16",
                          layout="bhsd", training=True)
    affected = _affected("sm90-bwd-one-row-crash")
    result = fastattn.probe(cfg)
    assert result.supported != affected, result.reason
    if affected:
        assert "sm90-bwd-one-row-crash" in result.reason and "cudnn-frontend/issues/1071" in result.reason
        assert fastattn.probe(cfg.replace(heads_q=2)).supported  # one more head builds
    else:
        q, k, v, d_o = adversarial(1, 1, 1, 128, 64, torch.bfloat16, seed=11)
        ours = fastattn_torch(q, k, v, d_o, False, None)
        check(ours, efficient(q, k, v, d_o, None), reference(q, k, v, d_o, None), "bf16", "one row")


def test_a_training_batch_past_the_grid_is_refused_and_the_largest_that_launches_trains():
    # benchmarks/probe_launch_limits.py: on SM90 (cuDNN 9.19, 9.24) the backward of batch 65536
    # builds and fails at execute; 65535 runs. The probe refuses the first naming the limit, the
    # second trains, and its last sequence's gradients are right (the grid's far end).
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        pytest.skip("the limit was measured on SM90 only (fastattn.defects: sm90-bwd-batch-past-grid)")
    cfg = AttentionConfig(batch=65536, heads_q=1, seqlen_q=8, head_dim_qk=64, dtype="bf16", training=True)
    result = fastattn.probe(cfg)
    assert not result.supported and "sm90-bwd-batch-past-grid" in result.reason and "65535" in result.reason
    assert fastattn.probe(cfg.replace(training=False)).supported  # the forward launches
    q, k, v, d_o = adversarial(65535, 1, 8, 8, 64, torch.bfloat16, seed=5)
    ours = fastattn_torch(q, k, v, d_o, False, None)
    last = [t[-1:] for t in (q, k, v, d_o)]
    mine = {name: t[-1:] for name, t in ours.items()}
    check(mine, efficient(*last, None), reference(*last, None), "bf16", "the last of 65535 sequences")
