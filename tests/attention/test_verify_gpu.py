"""GPU: verified plans. fastattn.verify against real plans: correct
plans pass on every data kind (random, low_lse, lengths) across dtypes, head dims, masks,
bias, GQA, padding and the s_kv residues mod 128; the tolerances are no stricter than
twice what PyTorch's efficient kernel achieves under the same measure; a plan whose
output is made wrong (monkeypatched) or the plain graph that cuDNN 9.19's SM90 backward
gets wrong (registry=()) fails, is refused through the runtime and stays refused; the
reference's memory stays bounded on a long sequence; `fastattn probe / warm --verify`."""

from __future__ import annotations

import itertools
import json

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
from fastattn import AttentionConfig, cli, defects, runtime, verify  # noqa: E402
from fastattn.verdict import TOLERANCE  # noqa: E402

GRID = list(itertools.product((0, 1, 64, 65, 127), ("bf16", "fp16"), (64, 128), ("none", "causal")))


def _verdict(cfg):
    return verify.verify_plan(fastattn.plan(cfg), cfg, torch.cuda.current_device())


@pytest.mark.parametrize("residue,dtype,head_dim,mask", GRID,
                         ids=[f"kv{128 + r}-{t}-d{d}-{m}" for r, t, d, m in GRID])
def test_correct_plans_pass(residue, dtype, head_dim, mask):
    cfg = AttentionConfig(batch=2, heads_q=4, seqlen_q=96, seqlen_kv=128 + residue, head_dim_qk=head_dim,
                          dtype=dtype, mask=mask, training=True)
    v = _verdict(cfg)
    print(v.summary())
    assert v.status == "passed", v.reason
    assert v.kinds == ("random", "low_lse") and {c.output for c in v.checks} == {"o", "d_q", "d_k", "d_v"}


FEATURES = [
    dict(heads_kv=2),  # GQA
    dict(layout="bhsd"),
    dict(layout="sbhd", seqlen_q=1, seqlen_kv=128),  # decode; cudnn-frontend#1072's shape with training
    dict(bias="1hss"),
    dict(bias="1hss", bias_grad=True),
    dict(padding=True),
    dict(padding=True, mask="causal_bottom_right"),  # random lengths: rows that see no key
    dict(window=(32, 0), mask="causal"),
    dict(softcap=30.0),
    dict(training=False, seqlen_kv=4096 + 64),
]


@pytest.mark.parametrize("extra", FEATURES, ids=[",".join(f"{k}={v}" for k, v in f.items()) for f in FEATURES])
def test_correct_plans_with_features_pass(extra):
    fields = dict(batch=2, heads_q=4, seqlen_q=128, seqlen_kv=192, head_dim_qk=64, dtype="bf16", training=True)
    cfg = AttentionConfig(**{**fields, **extra})
    result = fastattn.probe(cfg)
    if not result.supported:
        pytest.skip(f"cuDNN refuses it here: {result.reason}")
    v = _verdict(cfg)
    print(v.summary())
    assert v.status == "passed", v.reason
    if cfg.padding:
        assert "lengths" in v.kinds
    if cfg.bias_grad:
        assert "d_bias" in {c.output for c in v.checks}


def _judged(cfg, kind, inputs, out, ref):
    """verify.compare's measure, per output: the error beyond the rounding floor over the
    reference's scale (and the raw max error over the scale, for the log)."""
    return {c.output: (c.judged / c.scale, c.max_abs_error / c.scale, c.nonfinite)
            for c in verify.compare(cfg, kind, inputs, out, ref)}


TOL_GRID = list(itertools.product(("bf16", "fp16"), (64, 128), ("random", "low_lse"), (False, True)))


@pytest.mark.parametrize("dtype,head_dim,kind,causal", TOL_GRID,
                         ids=[f"{t}-d{d}-{k}-{'causal' if c else 'full'}" for t, d, k, c in TOL_GRID])
def test_the_tolerance_is_no_stricter_than_twice_the_efficient_kernel(dtype, head_dim, kind, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = AttentionConfig(batch=2, heads_q=4, seqlen_q=256, seqlen_kv=320, head_dim_qk=head_dim, dtype=dtype,
                          mask="causal" if causal else "none", layout="bhsd", training=True)
    inputs = verify.make_inputs(cfg, kind, seed=7)
    ref = verify.reference(cfg, inputs)
    q, k, v = (inputs[n].detach().clone().requires_grad_() for n in ("q", "k", "v"))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.backward(inputs["d_o"])
    eff = _judged(cfg, kind, inputs, {"o": o.detach(), "d_q": q.grad, "d_k": k.grad, "d_v": v.grad}, ref)
    ours = _judged(cfg, kind, inputs, verify.run_plan(fastattn.plan(cfg), cfg, inputs), ref)
    print({n: (ours[n], eff[n]) for n in eff})
    for name, (e, raw, bad) in eff.items():
        assert bad == 0, f"{name}: the efficient kernel's output has {bad} non-finite elements"
        assert TOLERANCE[dtype] >= 2 * e, (f"{name}: the efficient kernel's error beyond rounding, {e:.3g} of scale "
                                           f"(raw {raw:.3g}), is over half the tolerance")
        assert ours[name][0] <= TOLERANCE[dtype] and ours[name][2] == 0, f"{name}: {ours[name]}"


CFG = AttentionConfig(batch=1, heads_q=4, seqlen_q=128, seqlen_kv=192, head_dim_qk=64, dtype="bf16", training=True)
BREAKS = {
    "nan": lambda t: t.__setitem__((0,) * t.dim(), float("nan")),  # t: a logical (permuted) view
    "scaled": lambda t: t.mul_(1.2),
    "zeros": lambda t: t.zero_(),
}


@pytest.mark.parametrize("output", ("o", "d_q", "d_k", "d_v"))
@pytest.mark.parametrize("how", sorted(BREAKS))
def test_a_wrong_output_fails_verification(output, how, monkeypatch):
    real = verify.run_plan

    def broken(plan, config, inputs):
        out = real(plan, config, inputs)
        BREAKS[how](out[output])
        return out

    monkeypatch.setattr(verify, "run_plan", broken)
    v = _verdict(CFG)
    assert v.status == "failed" and {c.output for c in v.failures} == {output}, v.summary()
    assert output in v.reason


def test_a_failed_plan_is_refused_through_the_runtime_and_stays_refused(cache_dir, monkeypatch):
    runtime.clear()
    real = verify.run_plan
    monkeypatch.setattr(verify, "run_plan", lambda p, c, i: {**(out := real(p, c, i)), "d_q": out["d_q"] * 2})
    r = fastattn.probe(CFG, verify=True)
    assert not r.supported and r.verdict.status == "failed" and "d_q" in r.reason
    with pytest.raises(fastattn.VerificationFailedError):
        fastattn.plan(CFG)
    monkeypatch.setattr(verify, "run_plan", real)
    runtime.clear()  # a fresh process: the refusal is on disk, with its evidence
    with pytest.raises(fastattn.VerificationFailedError) as caught:
        fastattn.plan(CFG, verify=True)
    assert caught.value.verdict.status == "failed" and runtime.stats()["verifications"] == 0
    ok = fastattn.probe(CFG, verify=True, refresh=True)  # rebuilt and verified with the real outputs
    assert ok.supported and ok.verdict.status == "passed"
    runtime.clear()


def test_the_plain_graph_with_the_sm90_defect_fails_verification():
    # The reason verification exists: the graph without fastattn.defects' remedy, where
    # the registry says cuDNN is affected, computes NaN d_q on the low_lse rows; outside
    # the registry's range (another GPU, or a cuDNN past Defect.fixed) it passes.
    from fastattn import _core

    cfg = AttentionConfig(batch=1, heads_q=2, seqlen_q=192, seqlen_kv=192, head_dim_qk=64, dtype="bf16",
                          layout="bhsd", training=True)
    plain = _core.build_plan(cfg, torch.cuda.current_device(), registry=())
    kv_tail = next(d for d in defects.DEFECTS if d.name == "sm90-bwd-kv-tail")
    affected = kv_tail.matches(cfg, fastattn.versions()["cudnn_loaded"] or 0, torch.cuda.get_device_capability())
    v = verify.verify_plan(plain, cfg, torch.cuda.current_device())
    if affected:
        assert v.status == "failed", v.summary()
        assert any(c.kind == "low_lse" and c.output == "d_q" and c.nonfinite for c in v.failures), v.reason
    else:
        assert v.status == "passed", v.summary()
    assert _verdict(cfg).status == "passed"  # the remedied plan of the same config


def test_the_reference_stays_within_its_memory_bound_on_a_long_sequence():
    cfg = AttentionConfig(batch=1, heads_q=8, heads_kv=2, seqlen_q=16384, head_dim_qk=128, dtype="bf16",
                          mask="causal", training=True)
    p = fastattn.plan(cfg)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    v = verify.verify_plan(p, cfg, torch.cuda.current_device())
    peak = torch.cuda.max_memory_allocated() - base
    print(v.summary(), f"peak {peak / 2**20:.0f} MiB")
    assert v.status == "passed", v.reason
    # Inputs, outputs, float32 copies and bounds (~1 GiB here), plus one block's few
    # score-sized tensors; one (s_q, s_kv) float32 score matrix per head would be 8 GiB.
    assert peak < 4 * 2**30, f"{peak / 2**30:.1f} GiB"


def test_probe_and_warm_verify_on_the_device(cache_dir, capsys, tmp_path):
    runtime.clear()
    code = cli.main(["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "256", "--head-dim-qk", "128",
                     "--training", "--verify", "--json"])
    body = json.loads(capsys.readouterr().out)
    assert code == cli.EXIT_OK and body["verdict"]["status"] == "passed", body
    f = tmp_path / "w.toml"
    f.write_text('[[configs]]\nbatch = 1\nheads_q = 8\nseqlen_q = [128, 192]\nhead_dim_qk = [64, 128]\n'
                 'training = true\nmask = "causal"\n')
    code = cli.main(["warm", str(f), "--verify", "--json", "--no-torch-ops", "--workers", "2"])
    body = json.loads(capsys.readouterr().out)
    assert code == cli.EXIT_OK and body["verdicts"] == {"passed": 4, "failed": 0, "skipped": 0}, body
    code = cli.main(["warm", str(f), "--verify", "--json", "--no-torch-ops"])
    again = json.loads(capsys.readouterr().out)
    assert code == cli.EXIT_OK and again["counts"]["loaded"] == 4 and again["processes"] == 0, again
    runtime.clear()
