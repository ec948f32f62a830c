"""`fastattn warm --seqlens`: the class plans a model's length range needs, and its flags'
errors (exit 2, naming the flag)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn import shape_classes as sc
from fastattn.cli import _common
from helpers.cli import run


@pytest.fixture
def warmed(monkeypatch, tmp_path):
    """warm() recording the configs it is given, answering none; the GPU check passing."""
    import fastattn.warm
    from fastattn.cli import warm as warm_cli
    from fastattn.warm import WarmReport

    seen = []

    def fake(configs, **kw):
        seen.extend(configs)
        return WarmReport([], 0.0, 1, {"loaded": 0, "built": 0, "unsupported": 0, "failed": 0}, 0, [], 0, "")

    monkeypatch.setattr(fastattn.warm, "warm", fake)
    monkeypatch.setattr(warm_cli, "_gpu_problem", lambda device: None)
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
    return seen


MODEL = ["--heads", "32", "--heads-kv", "8", "--head-dim", "128", "--no-torch-ops", "--json"]


def test_a_range_warms_a_handful_of_class_plans(warmed, capsys):
    code, out, _ = run(["warm", "--seqlens", "1..32768", "--shape-classes", "1024,4096,16384,32768", *MODEL], capsys)
    assert code == 0, out
    got = {(c.seqlen_q, c.seqlen_kv) for c in warmed}
    assert got == {(1, 1), (1024, 1024), (1, 1024), (4096, 4096), (1, 4096), (16384, 16384), (1, 16384),
                   (32768, 32768), (1, 32768)}
    assert all(c.ragged and c.padding and c.mask == "causal_bottom_right" and c.heads_kv == 8 for c in warmed)
    assert json.loads(out)["lengths_without_a_class"] == []


def test_the_configs_are_the_ones_attention_asks_for(warmed, capsys):
    run(["warm", "--seqlens", "300", "--shape-classes", "512", "--training", *MODEL], capsys)
    want = sc.class_config(batch=1, heads_q=32, heads_kv=8, head_dim_qk=128, head_dim_v=128, dtype="bf16",
                           upper_q=512, upper_kv=512, mask="causal_bottom_right", alignment="bottom_right",
                           training=True)
    assert warmed == [want]


def test_an_override_plan_the_defect_registry_refuses_for_the_gpu_is_not_warmed(warmed, capsys, monkeypatch):
    # An H100 (the GPU file's capability; fastattn.defects' sdpa-shape-override-unmasked): the
    # decode plans without a mask take the ragged plan alone, as their calls do.
    import os

    from fastattn.cli import warm as warm_cli

    monkeypatch.setattr(warm_cli, "_cudnn_version", lambda gpu_file: 92801)
    h100 = os.path.join(os.path.dirname(__file__), "..", "warm", "data", "h100.json")
    run(["warm", "--for", h100, "--seqlens", "300", "--shape-classes", "512", "--mask", "causal", *MODEL], capsys)
    assert [(c.seqlen_q, c.mask, c.shape_override) for c in warmed] == [
        (512, "causal", True), (512, "causal", False), (1, "none", False)]


def test_with_the_shape_override_both_kinds_of_class_plan_are_warmed(warmed, capsys, monkeypatch):
    from fastattn.cli import warm as warm_cli

    monkeypatch.setattr(warm_cli, "_cudnn_version", lambda gpu_file: 92801)  # a cuDNN of 9.21 or newer
    run(["warm", "--seqlens", "300", "--shape-classes", "512", "--mask", "causal", *MODEL], capsys)
    common = dict(batch=1, heads_q=32, heads_kv=8, head_dim_qk=128, head_dim_v=128, dtype="bf16",
                  mask="causal", alignment="top_left")
    # (decode: one query seeing every key, the model's decode step without a mask)
    assert warmed == [sc.class_config(upper_q=q, upper_kv=512, override=o, **{**common, "mask": mask})
                      for q, mask in ((512, "causal"), (1, "none")) for o in (True, False)]
    assert [(c.shape_override, c.ragged) for c in warmed[:2]] == [(True, False), (False, True)]
    warmed.clear()
    run(["warm", "--seqlens", "300", "--shape-classes", "512", "--mask", "causal", "--training", *MODEL], capsys)
    assert [c.shape_override for c in warmed] == [False]  # the override is forward only
    warmed.clear()
    # A bottom-right diagonal (the default mask) is not the override's: cudnn-frontend places it
    # from the declared lengths. Ragged class plans alone.
    run(["warm", "--seqlens", "300", "--shape-classes", "512", *MODEL], capsys)
    assert warmed and [c.shape_override for c in warmed] == [False] * len(warmed)
    warmed.clear()
    # A class longer than shape_classes.OVERRIDE_MAX takes ragged plans alone (as fastattn.torch
    # serves it); the class at the bound both kinds.
    bound = sc.OVERRIDE_MAX
    run(["warm", "--seqlens", f"{bound - 5}..{2 * bound - 5}", "--shape-classes", f"{bound},{2 * bound}",
         "--mask", "causal", *MODEL], capsys)
    assert sorted({(c.seqlen_kv, c.shape_override) for c in warmed}) == \
        [(bound, False), (bound, True), (2 * bound, False)]


def test_lengths_past_the_classes_are_reported_not_warmed(warmed, capsys):
    code, out, _ = run(["warm", "--seqlens", "100..9000", "--shape-classes", "4096", *MODEL], capsys)
    assert code == 0 and json.loads(out)["lengths_without_a_class"] == [[4097, 9000]]
    assert {c.seqlen_kv for c in warmed} == {4096}


@pytest.mark.parametrize("argv,flag", [
    (["--seqlens", "0..4"], "--seqlens"),
    (["--seqlens", "9..4"], "--seqlens"),
    (["--seqlens", "1-4"], "--seqlens"),
    (["--seqlens", "1..4", "--shape-classes", "8,4"], "--shape-classes"),
    (["--seqlens", "1..4", "--shape-classes", "sometimes"], "--shape-classes"),
    (["--seqlens", "1..4", "--heads", "0"], "--heads"),
    (["--seqlens", "1..4", "--dtype", "fp32"], "--dtype"),
    (["--seqlens", "1..4", "--mask", "sliding"], "--mask"),
    (["--seqlens", "1..4", "--shape-classes", "64"], "--heads"),  # needed
    (["--seqlens", "1..4", "--shape-classes", "64", "--heads", "8"], "--head-dim"),
    (["--seqlens", "1..4", "--heads", "32", "--head-dim", "64", "--heads-kv", "5", "--shape-classes", "64"],
     "--heads-kv"),
    (["--seqlens", "1..4", "--heads", "32", "--head-dim", "64", "--shape-classes", "off"], "--shape-classes"),
    (["--heads", "32"], "--heads"),  # a model flag without --seqlens
])
def test_bad_flags_exit_2_naming_the_flag(warmed, capsys, argv, flag):
    code, out, err = run(["warm", *argv, "--no-torch-ops"], capsys)
    assert code == 2 and flag in out + err, out + err
    assert warmed == []


# Every flag of the class group means something only with --seqlens: each is refused
# without it, whatever its value, the default's included (`--batch 1` as `--batch 2`).
CLASS_ONLY = [["--heads", "32"], ["--heads-kv", "8"], ["--head-dim", "128"], ["--head-dim-v", "128"],
              ["--dtype", "bf16"], ["--dtype", "fp16"], ["--mask", "causal_bottom_right"], ["--mask", "causal"],
              ["--batch", "1"], ["--batch", "2"], ["--training"], ["--shape-classes", "auto"],
              ["--shape-classes", "256,1024"]]


@pytest.mark.parametrize("flags", CLASS_ONLY, ids=" ".join)
def test_a_class_flag_without_seqlens_is_refused_whatever_its_value(warmed, capsys, tmp_path, flags):
    code, out, err = run(["warm", *flags, "--no-torch-ops"], capsys)
    assert code == 2 and flags[0] in err and "only with --seqlens" in err, err
    (tmp_path / "w.json").write_text(json.dumps({"batch": 1, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}))
    code, out, err = run(["warm", str(tmp_path / "w.json"), *flags, "--no-torch-ops"], capsys)
    assert code == 2 and flags[0] in err, err
    assert warmed == []


def test_the_class_flags_defaults_are_what_their_help_says(warmed, capsys):
    code, _, err = run(["warm", "--seqlens", "300", "--shape-classes", "512", "--heads", "8", "--head-dim", "64",
                        "--no-torch-ops"], capsys)
    assert code == 0, err
    assert {(c.batch, c.dtype, c.mask, c.training, c.heads_kv, c.head_dim_v) for c in warmed} == {
        (1, "bf16", "causal_bottom_right", False, 8, 64)}


def test_classes_off_by_default_is_an_error_naming_the_flag(warmed, capsys, monkeypatch):
    monkeypatch.delenv("FASTATTN_SHAPE_CLASSES", raising=False)
    code, out, err = run(["warm", "--seqlens", "1..4096", *MODEL], capsys)
    assert code == 2 and "--shape-classes" in out + err


def test_the_environment_variable_gives_the_classes(warmed, capsys, monkeypatch):
    monkeypatch.setenv("FASTATTN_SHAPE_CLASSES", "2048")
    code, _, _ = run(["warm", "--seqlens", "1000..2000", *MODEL], capsys)
    assert code == 0 and {c.seqlen_kv for c in warmed} == {2048}


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text(max_size=20))
def test_the_range_parser_takes_ranges_or_names_the_rule(text):
    import argparse

    try:
        lo, hi = _common.length_range(text)
    except argparse.ArgumentTypeError as e:
        assert "LO..HI" in str(e) or "1 <= LO <= HI" in str(e)
        return
    assert 1 <= lo <= hi < 2**31


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 10**6), st.integers(0, 10**6), st.sampled_from(["{}..{}", " {} .. {} "]))
def test_the_range_parser_round_trips(lo, width, form):
    assert _common.length_range(form.format(lo, lo + width)) == (lo, lo + width)
