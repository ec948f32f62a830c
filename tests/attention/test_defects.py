"""fastattn.defects: the registry's predicates, version and capability gates, and the
decision's plumbing into the cache key, the probe's result and `fastattn probe` (on
tests/fake_core.py, whose plans make the decision as _core's do)."""

import json
import pathlib

import fake_core
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import defects, runtime, store
from fastattn.config import AttentionConfig
from fastattn.errors import InvalidArgumentError
from fastattn.plan_cache import PlanCache

VERIFICATION = (pathlib.Path(__file__).parents[2] / "docs" / "VERIFICATION.md").read_text()

H200 = (91900, (9, 0))
BASE = dict(batch=2, heads_q=4, seqlen_q=128, seqlen_kv=192, head_dim_qk=64, dtype="bf16", training=True)


def names(config, cudnn=H200[0], capability=H200[1]):
    return [d.name for d in defects.decide(config, cudnn, capability).avoided]


# -- predicates ---------------------------------------------------------------------------

@pytest.mark.parametrize("seqlen_kv,hit", [(64, True), (192, True), (1216, True), (128, False), (640, False),
                                           (1000, False), (1280, False), (63, False), (65, False), (127, False)])
def test_the_kv_tail_defect_is_s_kv_64_mod_128(seqlen_kv, hit):
    assert ("sm90-bwd-kv-tail" in names(AttentionConfig(**{**BASE, "seqlen_kv": seqlen_kv}))) == hit


@pytest.mark.parametrize("fields,hit", [
    (dict(mask="none"), True),
    (dict(mask="causal"), False),  # measured finite
    (dict(mask="causal", bias="1hss"), True),  # a bias brings it back (pytorch#196678's tril mask)
    (dict(mask="none", bias="bhss"), True),
    (dict(window=(32, 32)), True),  # a window without a causal mask is non-causal
    (dict(padding=True), False),  # already masked by lengths: the remedy is the graph itself
    (dict(dtype="fp16"), True),
    (dict(training=False), False),  # no backward graph
])
def test_the_kv_tail_defect_needs_a_backward_without_causal_mask_or_with_a_bias(fields, hit):
    assert ("sm90-bwd-kv-tail" in names(AttentionConfig(**{**BASE, **fields}))) == hit


def test_fp8_configs_are_not_matched():
    cfg = AttentionConfig(**{**BASE, "dtype": "fp8_e4m3", "head_dim_qk": 128, "training": False})
    assert names(cfg) == []


@pytest.mark.parametrize("seqlen_q,seqlen_kv,hit", [(1, 128, True), (1, 256, True), (1, 97, False), (2, 128, False),
                                                    (1, 64, False)])
def test_the_single_query_defect(seqlen_q, seqlen_kv, hit):
    cfg = AttentionConfig(**{**BASE, "seqlen_q": seqlen_q, "seqlen_kv": seqlen_kv})
    assert ("sm90-bwd-single-query" in names(cfg)) == hit


@pytest.mark.parametrize("version,capability,fields,refused_by", [
    (92100, (9, 0), dict(mask="causal"), {"sm90-sdpa-shape-override"}),
    (92400, (9, 0), dict(mask="causal"), {"sm90-sdpa-shape-override"}),  # not run at the declared strides
    (92400, (9, 0), dict(), {"sm90-sdpa-shape-override", "sdpa-shape-override-unmasked"}),
    (92801, (9, 0), dict(mask="causal"), set()),  # bitwise right at the declared strides (9.28.1, H100)
    (93000, (9, 0), dict(mask="causal"), set()),
    (92801, (9, 0), dict(), {"sdpa-shape-override-unmasked"}),  # wrong off the 64-row tile
    (92801, (9, 0), dict(mask="causal", window=(128, 0)), {"sdpa-shape-override-unmasked"}),  # unmeasured
    (92801, (9, 0), dict(mask="causal", softcap=30.0), {"sdpa-shape-override-unmasked"}),
    (92400, (10, 0), dict(), set()),
    (92600, (8, 9), dict(), {"sdpa-shape-override-unmasked"}),  # cudnn-frontend#1148's L20
    (92600, (8, 9), dict(mask="causal"), set()),
])
def test_which_shape_override_plans_are_refused_on_sm90(version, capability, fields, refused_by):
    cfg = AttentionConfig(batch=2, heads_q=4, seqlen_q=256, head_dim_qk=64, dtype="bf16", shape_override=True,
                          **fields)
    decision = defects.decide(cfg, version, capability)
    assert {d.name for d in decision.avoided} == refused_by
    assert all(name in decision.refusal for name in refused_by) and bool(decision.refusal) == bool(refused_by)
    assert not defects.decide(cfg.replace(shape_override=False), version, capability)  # the override's alone


@pytest.mark.parametrize("fields,name,hit", [
    (dict(batch=65536, training=True), "sm90-bwd-batch-past-grid", True),
    (dict(batch=65535, training=True), "sm90-bwd-batch-past-grid", False),
    (dict(batch=131072, training=False), "sm90-bwd-batch-past-grid", False),  # the forward launches
    (dict(batch=1, heads_q=65536, heads_kv=1, training=False), "sm90-fwd-heads-past-grid", True),
    (dict(batch=1, heads_q=65535, heads_kv=1, training=False), "sm90-fwd-heads-past-grid", False),
])
def test_a_plan_whose_kernel_cannot_launch_is_refused_naming_the_limit(fields, name, hit):
    decision = defects.decide(AttentionConfig(**{**BASE, "seqlen_q": 8, "seqlen_kv": 8, **fields}), *H200)
    assert (name in [d.name for d in decision.avoided]) == hit
    if hit:
        assert name in decision.refusal and "65535" in decision.refusal and "split" in decision.refusal


@pytest.mark.parametrize("fields,version,hit", [
    (dict(batch=1, heads_q=1, seqlen_q=1), 92801, True),
    (dict(batch=1, heads_q=1, seqlen_q=1, seqlen_kv=64, dtype="fp16"), 92600, True),
    (dict(batch=1, heads_q=1, seqlen_q=1), 92400, False),  # built on 9.24.0
    (dict(batch=1, heads_q=1, seqlen_q=1), 91900, False),
    (dict(batch=2, heads_q=1, seqlen_q=1), 92801, False),  # one more batch, head or row builds
    (dict(batch=1, heads_q=2, seqlen_q=1), 92801, False),
    (dict(batch=1, heads_q=1, seqlen_q=2), 92801, False),
    (dict(batch=1, heads_q=1, seqlen_q=1, training=False), 92801, False),  # the forward builds
])
def test_the_one_row_backward_crash_is_refused_from_9_26(fields, version, hit):
    cfg = AttentionConfig(**{**BASE, "seqlen_kv": 128, **fields})
    decision = defects.decide(cfg, version, (9, 0))
    assert ("sm90-bwd-one-row-crash" in [d.name for d in decision.avoided]) == hit
    assert bool(decision.refusal) == hit
    if hit:
        assert decision.refusal.startswith("backward: known cuDNN defect sm90-bwd-one-row-crash")


def test_s_q_1_with_s_kv_64_mod_128_avoids_both_through_one_remedy():
    d = defects.decide(AttentionConfig(**{**BASE, "seqlen_q": 1, "seqlen_kv": 64}), *H200)
    assert [x.name for x in d.avoided] == ["sm90-bwd-kv-tail"]  # 64 is not a multiple of 128
    d = defects.decide(AttentionConfig(**{**BASE, "seqlen_q": 1, "seqlen_kv": 128}), *H200)
    assert d.full_lengths == frozenset({"backward"}) and d.refusal == ""


# -- gates --------------------------------------------------------------------------------

@pytest.mark.parametrize("capability,hit", [((9, 0), True), ((8, 0), False), ((10, 0), False), ((12, 0), False)])
def test_only_sm90_is_matched(capability, hit):
    assert bool(names(AttentionConfig(**BASE), capability=capability)) == hit


@pytest.mark.parametrize("version,hit", [(0, False), (8900, False), (90000, True), (91900, True), (92600, True)])
def test_the_version_range_is_open_ended_until_a_fix_is_measured(version, hit):
    assert bool(names(AttentionConfig(**BASE), cudnn=version)) == hit


def test_a_measured_fix_closes_the_range():
    d = defects.DEFECTS[0]
    fixed = defects.Defect(**{**d.__dict__, "fixed": 92700})
    cfg = AttentionConfig(**BASE)
    assert defects.decide(cfg, 92600, (9, 0), (fixed,)).avoided == (fixed,)
    assert not defects.decide(cfg, 92700, (9, 0), (fixed,))
    assert "fixed in 9.27.0" in fixed.versions()


def test_a_refusal_remedy_refuses_with_the_reason_and_reports():
    d = defects.DEFECTS[0]
    refuse = defects.Defect(**{**d.__dict__, "name": "test-refusal", "remedy": defects.REFUSE})
    decision = defects.decide(AttentionConfig(**BASE), *H200, (refuse,))
    assert decision.refusal.startswith("backward: known cuDNN defect test-refusal")
    assert d.reports[0] in decision.refusal and decision.full_lengths == frozenset()


@pytest.mark.parametrize("fields,word", [
    (dict(remedy="retry"), "remedy"), (dict(direction="both"), "direction"),
    (dict(fixed=80000), "fixed"), (dict(reports=()), "report"),
])
def test_a_malformed_entry_names_its_field(fields, word):
    with pytest.raises(InvalidArgumentError, match=word):
        defects.Defect(**{**defects.DEFECTS[0].__dict__, **fields})


@pytest.mark.parametrize("args,word", [
    (("not a config", 91900, (9, 0)), "config"), ((None, -1, (9, 0)), "cudnn_version"),
    ((None, True, (9, 0)), "cudnn_version"), ((None, 91900, (9,)), "capability"),
    ((None, 91900, ("9", "0")), "capability"),
])
def test_bad_arguments_name_the_argument(args, word):
    args = (AttentionConfig(**BASE) if args[0] is None else args[0],) + args[1:]
    with pytest.raises(InvalidArgumentError, match=word):
        defects.decide(*args)


def test_every_entry_is_well_formed():
    seen = set()
    for d in defects.DEFECTS:
        assert d.name not in seen and ":" not in d.name
        seen.add(d.name)
        # A public report: an issue, a test, or the CUDA documentation of the limit a plan hits.
        assert all(r.startswith(("https://github.com/", "https://docs.nvidia.com/")) for r in d.reports)
        if d.fixed is not None:  # a closed range is a measurement, and VERIFICATION.md says where
            bullet = VERIFICATION.split(f"- `{d.name}`", 1)[1].split("\n- ", 1)[0]
            assert defects.version_text(d.fixed) in bullet, (d.name, bullet)


def test_a_fixed_range_ends_where_it_was_measured():
    # sm90-bwd-kv-tail: NaN d_q with the plain backward on 9.19.0 and 9.24.0, finite on 9.28.1
    # (H100; test_numerics_gpu.py). 9.28.0 was not measured: it keeps the remedy.
    cfg = AttentionConfig(**{**BASE, "seqlen_kv": 192, "training": True})
    for version, remedied in ((91900, True), (92400, True), (92800, True), (92801, False), (93000, False)):
        decision = defects.decide(cfg, version, (9, 0))
        assert ("sm90-bwd-kv-tail:full_lengths" in decision.key_part()) == remedied, (version, decision)


# -- properties over configs --------------------------------------------------------------

@st.composite
def configs(draw):
    fields = dict(
        batch=draw(st.integers(1, 4)), heads_q=draw(st.sampled_from([1, 2, 8])),
        seqlen_q=draw(st.sampled_from([1, 2, 64, 127, 128, 192])),
        seqlen_kv=draw(st.sampled_from([1, 63, 64, 65, 97, 127, 128, 192, 256, 320, 1216])),
        head_dim_qk=draw(st.sampled_from([64, 128])), dtype=draw(st.sampled_from(["fp16", "bf16"])),
        mask=draw(st.sampled_from(["none", "causal", "causal_bottom_right"])),
        bias=draw(st.sampled_from(["none", "1hss", "b11s"])), training=draw(st.booleans()),
        padding=draw(st.booleans()),
    )
    if fields["bias"] == "b11s" and fields["training"]:
        fields["bias"] = "bhss"
    return AttentionConfig(**fields)


versions = st.sampled_from([0, 8907, 90000, 91900, 92600, 99999])
capabilities = st.sampled_from([(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)])


@settings(max_examples=300, deadline=None)
@given(configs(), versions, capabilities)
def test_the_decision_is_a_function_of_config_version_and_capability(cfg, version, capability):
    a = defects.decide(cfg, version, capability)
    b = defects.decide(AttentionConfig.from_json(cfg.to_json()), version, list(capability))
    assert a == b and a.key_part() == b.key_part()
    if a:  # (the drawn configs reach the backward defects only: at most 8 heads, 4 sequences)
        assert capability == (9, 0) and version >= 90000 and cfg.training
        full = [d for d in a.avoided if d.remedy == defects.FULL_LENGTHS]
        refused = [d for d in a.avoided if d.remedy == defects.REFUSE]
        assert a.full_lengths == (frozenset({"backward"}) if full else frozenset())
        assert all(d.name in a.refusal for d in refused) and bool(a.refusal) == bool(refused)
        if full:
            assert not cfg.padding
            assert cfg.seqlen_kv % 128 == 64 or (cfg.seqlen_q == 1 and cfg.seqlen_kv % 128 == 0)
        if refused:  # sm90-bwd-one-row-crash, from 9.26
            assert version >= 92600 and cfg.batch == cfg.heads_q == cfg.seqlen_q == 1
    else:
        assert a.key_part() == [] and a.full_lengths == frozenset() and a.refusal == ""


BASE_ENV = dict(fastattn_version="0.1.0", frontend_version="1.28.0", cudnn_version=91900, gpu_name="NVIDIA H200",
                compute_capability=(9, 0), sm_count=132, policy="p")

# Keys that main (dc33200, before the registry) computed through PlanCache.key on the fake
# core with BASE_ENV and no CUDNN_* variables. The last config is an affected one: its key
# must move (a cached plain plan must never serve it).
GOLDEN = [
    (dict(mask="causal"), "f5c0f1446eef0f20f5667ed7fe201f6b6fbe1b3b1b5bd17b011f0046ee6f7a9c"),
    (dict(seqlen_kv=256), "a797af596d357c6771a147b50c56cf46b94784eb618ea6efbd670f232a22d838"),
    (dict(training=False), "7013e8da52693371f77720e90b410d5a214a83a3e8f93565e8017b40de3bdcfc"),
    (dict(mask="causal", padding=True), "2cceda281fdd37eef4c8c6cc69df8be26e027d3082929d89bb88b969637c6c44"),
]
AFFECTED_KEY_AT_MAIN = "eb002298aa45095f0ba277a042d761be8975afa164dc18cabb9a832e07d71b3c"  # BASE itself


@pytest.fixture
def golden_cache(tmp_path, monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("CUDNN_"):
            monkeypatch.delenv(name)
    cache = PlanCache(store.CacheSettings(directory=str(tmp_path)), core=lambda: fake_core)
    cache._bases[0] = dict(BASE_ENV)
    return cache


@pytest.mark.parametrize("fields,key", GOLDEN)
def test_an_unaffected_configs_key_is_mains(golden_cache, fields, key):
    cfg = AttentionConfig(**{**BASE, **fields})
    assert not defects.decide(cfg, 91900, (9, 0))
    assert golden_cache.key(cfg, 0) == key


def test_an_affected_configs_key_is_not_mains(golden_cache):
    cfg = AttentionConfig(**BASE)
    assert golden_cache.describe(cfg, 0)["defects"] == ["sm90-bwd-kv-tail:full_lengths"]
    assert golden_cache.key(cfg, 0) != AFFECTED_KEY_AT_MAIN
    golden_cache._bases[0] = {**BASE_ENV, "compute_capability": (10, 0)}  # not SM90: the plain graph
    assert "defects" not in golden_cache.describe(cfg, 0)


def test_describe_without_defects_writes_no_field():
    assert "defects" not in store.describe(AttentionConfig(**BASE).to_dict(), env={}, **BASE_ENV)
    assert "defects" not in store.describe(AttentionConfig(**BASE).to_dict(), env={}, defects=[], **BASE_ENV)


# -- plumbing: key, probe, CLI (the fake core) ----------------------------------------------

def _plain_key(cache, cfg):
    """The key as it was computed before the registry: describe without the defects."""
    base = cache._base(0)
    return store.key_of(store.describe(cfg.to_dict(), env=store.build_env_vars(), **base))


@pytest.fixture(scope="module")
def fake_cache(tmp_path_factory):
    return PlanCache(store.CacheSettings(directory=str(tmp_path_factory.mktemp("cache"))), core=lambda: fake_core)


@settings(max_examples=150, deadline=None)
@given(cfg=configs())
def test_an_unaffected_configs_key_is_unchanged_and_an_affected_ones_moves(fake_cache, cfg):
    cache = fake_cache
    decision = defects.decide(cfg, fake_core.CUDNN_VERSION[0], (9, 0))
    description = cache.describe(cfg, 0)
    if decision:
        assert description["defects"] == decision.key_part()
        assert cache.key(cfg, 0) != _plain_key(cache, cfg)
        assert store.environment_of(description) == cache.environment(0)  # listed with its GPU's entries
    else:
        assert "defects" not in description
        assert cache.key(cfg, 0) == _plain_key(cache, cfg)


def test_the_probe_says_which_defect_was_avoided_from_a_build_memory_and_disk(env):
    cfg = AttentionConfig(**BASE)
    built = runtime.probe(cfg)
    assert built.source == "built" and built.avoided == ("sm90-bwd-kv-tail:full_lengths",)
    assert built.to_dict()["avoided"] == ["sm90-bwd-kv-tail:full_lengths"]
    assert runtime.probe(cfg).avoided == built.avoided  # memory
    runtime.clear()
    loaded = runtime.probe(cfg)
    assert loaded.source == "disk" and loaded.avoided == built.avoided
    assert runtime.stored_answer(cfg).avoided == built.avoided
    assert runtime.probe(AttentionConfig(**{**BASE, "mask": "causal"})).avoided == ()


def test_a_plain_entry_is_never_served_where_the_remedy_applies(env):
    cfg = AttentionConfig(**BASE)
    cache = runtime.plan_cache()
    plain = _plain_key(cache, cfg)
    runtime.probe(cfg)
    assert cache.store.get(plain) is None and cache.store.get(cache.key(cfg)) is not None


def test_fastattn_probe_prints_the_avoided_defect(env, capsys):
    from fastattn.cli import main

    argv = ["probe", "--batch", "2", "--heads-q", "4", "--seqlen-q", "128", "--seqlen-kv", "192",
            "--head-dim-qk", "64", "--dtype", "bf16", "--training"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "avoided cuDNN defect sm90-bwd-kv-tail: backward built with a padding mask" in text
    assert "https://github.com/NVIDIA/cudnn-frontend/pull/628" in text
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [a["defect"] for a in out["avoided"]] == ["sm90-bwd-kv-tail"]
    assert out["avoided"][0]["remedy"] == "full_lengths"


def test_explain_keeps_an_unknown_defect_by_name():
    assert defects.explain(["from-the-future:refuse"]) == [{"defect": "from-the-future", "remedy": "refuse"}]


def test_cache_ls_shows_the_remedy_an_entry_carries(env, capsys):
    from fastattn.cli import main

    runtime.probe(AttentionConfig(**BASE))
    runtime.probe(AttentionConfig(**{**BASE, "mask": "causal"}))
    assert main(["cache", "ls"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.strip().endswith("]") or "avoids" in x]
    assert sum("avoids sm90-bwd-kv-tail:full_lengths" in x for x in lines) == 1
    assert main(["cache", "ls", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert sorted(r["defects"] for r in rows) == [[], ["sm90-bwd-kv-tail:full_lengths"]]


# -- known gaps: refusals explained, never decided ---------------------------------------

SOFTCAP = dict(batch=2, heads_q=4, seqlen_q=128, seqlen_kv=128, head_dim_qk=64, dtype="bf16", softcap=30.0)


def gap_names(config, cudnn, capability=(9, 0)):
    return [n.split(":", 1)[0] for n in defects.refusal_notes(config, cudnn, capability)]


@pytest.mark.parametrize("cudnn,hit", [(91900, False), (92300, False), (92400, True), (92801, True), (93000, True)])
def test_the_softcap_gap_covers_the_releases_seen_refusing_and_what_follows(cudnn, hit):
    cfg = AttentionConfig(**SOFTCAP, padding=True)
    assert gap_names(cfg, cudnn) == (["known cuDNN gap sm90-score-modifier-with-lengths"] if hit else [])


@pytest.mark.parametrize("fields,hit", [
    ({}, False),                                          # softcap without lengths: built with every mask
    ({"padding": True}, True),
    ({"padding": True, "mask": "causal"}, True),
    ({"padding": True, "ragged": True}, True),
    ({"softcap": None, "padding": True}, False),          # lengths without softcap: built
    ({"seqlen_kv": 192, "training": True}, True),         # the kv-tail remedy's full lengths are lengths too
    ({"seqlen_kv": 192, "training": False}, False),       # (forward alone: no remedy)
])
def test_the_softcap_gap_is_softcap_with_lengths_in_the_graph(fields, hit):
    cfg = AttentionConfig(**{**SOFTCAP, **fields})
    assert bool(gap_names(cfg, 92400)) == hit


def test_a_gap_is_sm90s_alone():
    assert gap_names(AttentionConfig(**SOFTCAP, padding=True), 92400, (10, 0)) == []


def test_a_gap_between_two_releases_seen_building_ends_at_the_newer():
    gap = defects.Gap(name="t", summary="s", seen_refusing=(92400,), seen_building=(91900, 93000),
                      capabilities=frozenset({(9, 0)}), predicate=lambda c, lengths: True, advice="a", evidence="e")
    cfg = AttentionConfig(**SOFTCAP)
    assert [gap.matches(cfg, v, (9, 0), False) for v in (91900, 92400, 92900, 93000)] == [False, True, True, False]
    with pytest.raises(InvalidArgumentError, match="seen_refusing"):
        defects.Gap(name="t", summary="s", seen_refusing=(), seen_building=(), capabilities=frozenset(),
                    predicate=lambda c, lengths: True, advice="a", evidence="e")


def test_a_refusal_carries_the_gaps_note_and_the_fallback_count_names_it(env, monkeypatch):
    # cuDNN's reason stays first (the verdict is cuDNN's); the note follows it, in the probe,
    # in the error a call raises, and in an integration's fallback count.
    monkeypatch.setattr(fake_core, "CUDNN_VERSION", [92400])
    cfg = AttentionConfig(**{**SOFTCAP, "head_dim_qk": 1024}, padding=True)  # the fake core refuses it
    r = runtime.probe(cfg)
    lines = r.reason.split("\n")
    assert not r.supported and lines[0] == "forward: fake cuDNN refuses head_dim_qk=1024"
    assert lines[1].startswith("known cuDNN gap sm90-score-modifier-with-lengths: ") and "9.19.0" in lines[1]
    with pytest.raises(fastattn.NotSupportedError, match="known cuDNN gap sm90-score-modifier-with-lengths"):
        fastattn.plan(cfg)
    runtime.count_fallback("transformers", r.reason)
    assert fastattn.stats()["fallbacks"] == {"transformers": {
        "forward: fake cuDNN refuses head_dim_qk=1024 (known cuDNN gap sm90-score-modifier-with-lengths)": 1}}
    monkeypatch.setattr(fake_core, "CUDNN_VERSION", [91900])
    runtime.clear()
    assert runtime.probe(cfg).reason == "forward: fake cuDNN refuses head_dim_qk=1024"  # no gap on 9.19


def test_a_variance_holds_from_the_release_seen_to_the_next_seen_without_it():
    var = defects.Variance(name="t", summary="s", seen=(92400,), seen_not=(91900, 92801),
                           capabilities=frozenset({(9, 0)}), advice="a", evidence="e")
    assert [var.matches(v, (9, 0)) for v in (91900, 92399, 92400, 92800, 92801, 93000)] == [
        False, False, True, True, False, False]
    assert not var.matches(92400, (10, 0)) and var.matches(92400, [9, 0])
    assert var.note() == "known cuDNN variance t: s (seen: cuDNN 9.24.0; seen not: cuDNN 9.19.0, 9.28.1; e); a"
    with pytest.raises(InvalidArgumentError, match="seen"):
        defects.Variance(name="t", summary="s", seen=(), seen_not=(), capabilities=frozenset(), advice="a",
                         evidence="e")


def test_the_rebuild_variance_is_what_the_gpu_runs_saw():
    # docs/VERIFICATION.md, "Builds of one graph": 9.24.0 varied; 9.19.0 and 9.28.1 did not.
    notes = {v: defects.variance_notes(v, (9, 0)) for v in (91900, 92400, 92801)}
    assert notes[91900] == notes[92801] == []
    assert len(notes[92400]) == 1 and notes[92400][0].startswith("known cuDNN variance sm90-rebuild-bits: ")
    assert defects.variance_notes(92400, (8, 0)) == []  # seen on SM90 only
