"""Verified plans, without a GPU: the verdict's rule and its storage in
the cache entry (a tampered or garbled verdict is a damaged entry, a miss, never a crash
nor a forged pass), the runtime's verify= (a verified entry needs no second run; a plan
that fails is refused with the evidence and remembered), and the CLI's --verify (exit
codes, table, JSON, `cache ls`). The verifier is tests/fake_core.py's `verify`: a pass,
except head_dim_qk=96, which stands for a plan that computes NaN gradients. The GPU half,
fastattn.verify against real plans: tests/attention/test_verify_gpu.py."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import cli, runtime, store, verify
from fastattn.store import entry as entry_mod
from fastattn.verdict import TOLERANCE, Check, Verdict, VerdictError, is_valid

import fake_core
from helpers.cli import run

CFG = fastattn.AttentionConfig(batch=1, heads_q=8, seqlen_q=128, head_dim_qk=64, training=True)
BAD = CFG.replace(head_dim_qk=96)  # the fake verifier's wrong plan


def fast(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture
def calls(monkeypatch):
    """The configs the (fake) verifier ran, in order."""
    seen = []

    def counting(plan, config, device):
        seen.append(config)
        return fake_core.verify(plan, config, device)

    monkeypatch.setattr(runtime, "_verify", counting)
    return seen


@pytest.fixture
def fake_reference(monkeypatch):
    """The CLI checks before any work that PyTorch, --verify's GPU reference, is installed;
    these tests' verifier is fake_core's, which needs none: the check passes without
    torch too (test_verify_without_pytorch_exits_2_naming_the_flag holds the check)."""
    from fastattn.cli import probe as cli_probe
    from fastattn.cli import warm as cli_warm

    for module in (cli_probe, cli_warm):
        monkeypatch.setattr(module, "check_verify_possible", lambda: None)


def _entry_files():
    return [info.path for _, info in runtime.plan_cache().store.entries()]


# -- the verdict ---------------------------------------------------------------------------


def test_the_rule_scales_the_tolerance_by_the_reference_and_counts_non_finite_elements():
    # The error judged is the one beyond each element's rounding floor (fastattn.verify.compare).
    assert Check("low_lse", "d_q", 20.0, 1.0, 0, excess=0.01).passed(TOLERANCE["bf16"])
    assert not Check("low_lse", "d_q", 20.0, 1.0, 0, excess=0.1).passed(TOLERANCE["bf16"])
    ok = Check("random", "o", 0.05, 1.0, 0)
    assert ok.passed(TOLERANCE["bf16"]) and not ok.passed(TOLERANCE["fp16"])
    assert Check("random", "o", 5e-4, 0.01, 0).passed(TOLERANCE["bf16"])  # relative to the scale
    assert not Check("random", "o", 0.0, 1.0, 1).passed(0.5)  # one NaN fails, whatever the errors
    v = Verdict.judge([ok, Check("low_lse", "d_q", 0.0, 1.0, 7)], 91900, TOLERANCE["bf16"], 0.5)
    assert v.status == "failed" and v.kinds == ("random", "low_lse")
    assert "d_q on low_lse data" in v.reason and "7 non-finite" in v.reason and "91900" in v.reason
    assert Verdict.from_dict(json.loads(json.dumps(v.to_dict()))) == v
    passed = Verdict.judge([ok], 91900, TOLERANCE["bf16"])
    assert passed.status == "passed" and passed.reason == "" and "passed (random" in passed.summary()


def test_a_stored_verdict_must_be_what_its_numbers_give():
    good = Verdict.judge([Check("random", "o", 1e-3, 1.0, 0)], 91900, 0.0625).to_dict()
    assert is_valid(good)
    for change in ({"status": "failed"}, {"kinds": ["low_lse"]}, {"tolerance": 2.0}, {"cudnn": True},
                   {"checks": [{"kind": "random", "output": "o", "max_abs_error": 0.9, "scale": 1.0, "nonfinite": 0,
                                "excess": 0.9}]},
                   {"checks": [{"kind": "random", "output": "o", "max_abs_error": 0.1, "scale": 1.0, "nonfinite": 0,
                                "excess": 0.2}]},
                   {"status": "skipped"}, {"extra": 1}):
        with pytest.raises(VerdictError):
            Verdict.from_dict({**good, **change})


# A verdict-shaped dict with any values, and any JSON at all.
_json = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False,
                                                                                        allow_infinity=False)
                     | st.text(max_size=8), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8),
                                                                                               c, max_size=4),
                     max_leaves=12)
_check = st.fixed_dictionaries({"kind": st.sampled_from(["random", "low_lse", 3]),
                                "output": st.sampled_from(["o", "d_q", "x"]),
                                "max_abs_error": st.floats(-1, 2) | st.integers(-1, 2),
                                "scale": st.floats(0, 2), "nonfinite": st.integers(-1, 3) | st.booleans(),
                                "excess": st.floats(-1, 2)})
_verdicts = st.fixed_dictionaries({"status": st.sampled_from(["passed", "failed", "skipped", "ok"]),
                                   "cudnn": st.integers(-1, 99999) | st.booleans(), "tolerance": st.floats(0, 1.5),
                                   "kinds": st.lists(st.sampled_from(["random", "low_lse"]), max_size=2),
                                   "checks": st.lists(_check, max_size=3), "reason": st.text(max_size=5) | st.none(),
                                   "seconds": st.floats(-1, 10)})


@fast(300)
@given(value=_verdicts | _json, kind=st.sampled_from(["plan", "unsupported"]))
def test_any_stored_verdict_decodes_to_a_valid_one_or_is_a_damaged_entry(value, kind):
    e = store.Entry("a" * 64, kind, {"config": CFG.to_dict()}, {"forward": b"x"} if kind == "plan" else {},
                    {"verdict": value}, created=1.0)
    try:
        data = entry_mod.encode(e)
    except ValueError:  # json.dumps refuses NaN-free floats never; a dict key that is not a str cannot arise
        return
    try:
        got = entry_mod.decode(data)
    except entry_mod.EntryError:
        return
    v = Verdict.from_dict(got.meta["verdict"])  # never raises here: the decoder checked it
    assert not (kind == "plan" and v.status == "failed") and not (kind == "unsupported" and v.status == "passed")


_STORED = entry_mod.encode(store.Entry(
    "b" * 64, "plan", {"config": CFG.to_dict()}, {"forward": b"blob"},
    {"verdict": Verdict.judge([Check("random", "o", 1e-3, 1.0, 0), Check("low_lse", "d_q", 2e-3, 0.5, 0)], 91900,
                              TOLERANCE["bf16"], 0.1).to_dict()}, created=1.0))
_AT = _STORED.index(b'"verdict"')


@fast(300)
@given(flips=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 255)), min_size=1, max_size=4,
                      unique_by=lambda f: f[0]))
def test_garbled_verdict_bytes_are_a_damaged_entry(flips):
    data = bytearray(_STORED)
    assert _AT + 200 < len(data)
    for offset, mask in flips:  # distinct bytes of the stored verdict (and what follows it)
        data[_AT + offset] ^= mask
    with pytest.raises(entry_mod.EntryError):
        entry_mod.decode(bytes(data))


# -- the runtime -------------------------------------------------------------------------


def test_a_verified_entry_needs_no_second_run(env, calls):
    r = fastattn.probe(CFG, verify=True)
    assert r.supported and r.verdict.status == "passed" and calls == [CFG]
    assert fastattn.probe(CFG, verify=True).verdict == r.verdict and calls == [CFG]  # memory
    runtime.clear()
    again = fastattn.probe(CFG, verify=True)  # a fresh process: from disk, its verdict with it
    assert again.source == "disk" and again.verdict == r.verdict and calls == [CFG]
    assert runtime.stats()["verifications"] == 0
    assert fastattn.plan(CFG, verify=True) is not None and calls == [CFG]
    assert runtime.stored_answer(CFG).verdict == r.verdict


def test_an_unverified_entry_is_verified_once_and_stored(env, calls):
    assert fastattn.probe(CFG).verdict is None and calls == []
    assert runtime.stored_answer(CFG).verdict is None
    assert fastattn.probe(CFG, verify=True).verdict.status == "passed" and calls == [CFG]
    assert runtime.stored_answer(CFG).verdict.status == "passed"  # stored with the entry
    runtime.clear()
    assert fastattn.preload([CFG], verify=True)[0].verdict.status == "passed" and calls == [CFG]


def test_a_plan_that_fails_is_refused_with_the_evidence_and_remembered(env, calls):
    r = fastattn.probe(BAD, verify=True)
    assert not r.supported and r.verdict.status == "failed" and "failed verification" in r.reason
    assert "4096 non-finite" in r.reason and runtime.stats()["verification_failures"] == 1
    with pytest.raises(fastattn.VerificationFailedError) as caught:
        fastattn.plan(BAD)  # refused without verify too: never served
    assert isinstance(caught.value, fastattn.NotSupportedError) and caught.value.verdict == r.verdict
    with pytest.raises(fastattn.VerificationFailedError):
        runtime.planned(BAD)
    runtime.clear()
    with pytest.raises(fastattn.VerificationFailedError):
        fastattn.plan(BAD)  # from disk, a refusal like cuDNN's
    assert runtime.stats()["negative_hits"] == 1 and runtime.stats()["builds"] == 0 and calls == [BAD]
    stored = runtime.stored_answer(BAD)
    assert not stored.supported and stored.verdict.status == "failed"


def test_a_tampered_verdict_is_a_damaged_entry_and_rebuilt(env, calls):
    fastattn.probe(BAD, verify=True)  # stored as a refusal with a failed verdict
    (path,) = _entry_files()
    with open(path, "rb") as f:
        e = entry_mod.decode(f.read())
    forged = dict(e.meta["verdict"], status="passed", reason="")  # a pass over failing numbers
    for meta, kind in (({**e.meta, "verdict": forged}, "unsupported"), ({"verdict": "garbage"}, "plan")):
        with open(path, "wb") as f:  # re-checksummed: only the decoder's shape check can see it
            f.write(entry_mod.encode(store.Entry(e.key, kind, e.description, {"forward": b"x"} if kind == "plan"
                                                 else {}, meta, e.created)))
        runtime.clear()
        assert runtime.stored_answer(BAD) is None  # a miss
        r = fastattn.probe(BAD, verify=True)  # rebuilt and verified again: refused again
        assert not r.supported and r.verdict.status == "failed" and r.source == "built"
    # And a flipped byte inside the verdict: the checksum's business.
    with open(path, "rb") as f:
        data = bytearray(f.read())
    at = data.index(b'"nonfinite":4096')
    data[at + 13] = ord("1")
    with open(path, "wb") as f:
        f.write(bytes(data))
    runtime.clear()
    assert runtime.stored_answer(BAD) is None


def test_verify_without_pytorch_says_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(fastattn.InvalidArgumentError, match="verify.*needs PyTorch"):
        verify._torch()


def test_verify_without_cuda_in_torch_says_so():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU")
    with pytest.raises(fastattn.InvalidArgumentError, match="no CUDA device"):
        verify._torch()


def test_the_reference_does_not_claim_what_it_does_not_model():
    assert verify.unverifiable(CFG) is None
    assert "FP8" in verify.unverifiable(CFG.replace(dtype="fp8_e4m3"))
    assert "dropout" in verify.unverifiable(CFG.replace(dropout=0.1))
    assert verify.data_kinds(CFG) == ("random", "low_lse")
    assert verify.data_kinds(CFG.replace(padding=True)) == ("random", "low_lse", "lengths")


# -- the CLI -------------------------------------------------------------------------------


PROBE = ["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "128", "--training"]


def test_probe_verify_prints_the_verdict_and_exits_4_on_a_failure(env, capsys, fake_reference):
    code, out, _ = run(PROBE + ["--head-dim-qk", "64", "--verify"], capsys)
    assert code == cli.EXIT_OK and "verified: passed (random+low_lse" in out and "ok   d_q on low_lse" in out
    code, out, _ = run(PROBE + ["--head-dim-qk", "96", "--verify", "--json"], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_FAILED and not body["supported"] and body["verdict"]["status"] == "failed"
    assert body["verdict"]["kinds"] == ["random", "low_lse"] and body["verdict"]["cudnn"] == 91900
    assert body["verdict"]["tolerance"] == TOLERANCE["bf16"]
    code, out, _ = run(PROBE + ["--head-dim-qk", "96"], capsys)  # remembered: refused without --verify too
    assert code == cli.EXIT_FAILED and "FAIL d_v on low_lse data" in out and "failed verification" in out


def test_verify_without_pytorch_exits_2_naming_the_flag(env, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    for argv in (PROBE + ["--head-dim-qk", "64", "--verify"], ["warm", "--verify", "--no-torch-ops"]):
        code, _, err = run(argv, capsys)
        assert code == cli.EXIT_BAD_INPUT and "--verify" in err and "PyTorch" in err, err


WARM = '[[configs]]\nbatch = 1\nheads_q = 8\nseqlen_q = 128\ntraining = true\nhead_dim_qk = [64, 96, 1024]\n'


def _verified(log) -> list[int]:
    """The head dims the workers verified (FAKE_VERIFY_LOG)."""
    return sorted(json.loads(line.split(" ", 1)[1])["head_dim_qk"] for line in log.read_text().splitlines()) \
        if log.exists() else []


def test_warm_verify_reports_a_rejected_plan_and_exits_4(fake_workers, capsys, monkeypatch, fake_reference):
    log = fake_workers / "verified.log"
    monkeypatch.setenv("FAKE_VERIFY_LOG", str(log))
    f = fake_workers / "w.toml"
    f.write_text(WARM)
    code, out, _ = run(["warm", str(f), "--verify", "--workers", "2", "--json", "--no-torch-ops"], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_FAILED, body
    assert body["counts"] == {"built": 1, "loaded": 0, "unsupported": 1, "failed": 0, "rejected": 1}
    assert body["verify"] and body["verdicts"] == {"passed": 1, "failed": 1, "skipped": 0}
    by_dim = {i["config"]["head_dim_qk"]: i for i in body["items"]}
    assert by_dim[64]["verdict"]["status"] == "passed" and by_dim[1024]["verdict"] is None
    assert by_dim[96]["status"] == "rejected" and "failed verification" in by_dim[96]["reason"]
    assert all(i["saved"] for i in body["items"])  # the refusal is an entry too
    assert _verified(log) == [64, 96]
    # The second run: every answer from the cache, verdicts included, no second verification.
    code, out, _ = run(["warm", str(f), "--verify", "--workers", "2", "--no-torch-ops"], capsys)
    assert code == cli.EXIT_FAILED
    assert "rejected" in out and "verified" in out and "passed   " in out and "rejected 1" in out
    assert "verified: passed 1, failed 1 (refused: never served), skipped 0" in out
    code, out, _ = run(["warm", str(f), "--verify", "--workers", "2", "--json", "--no-torch-ops"], capsys)
    body = json.loads(out)
    assert body["counts"]["loaded"] == 1 and body["counts"]["rejected"] == 1 and _verified(log) == [64, 96]
    code, out, _ = run(["cache", "ls", "--json"], capsys)
    entries = json.loads(out)["entries"]
    assert sorted((e["verdict"] or {}).get("status", "-") for e in entries) == ["-", "failed", "passed"]
    code, out, _ = run(["cache", "ls"], capsys)
    assert "verified passed (random+low_lse" in out and "verified failed" in out


def test_warm_without_verify_leaves_plans_unverified_and_verify_then_checks_them(fake_workers, capsys,
                                                                                  monkeypatch, fake_reference):
    log = fake_workers / "verified.log"
    monkeypatch.setenv("FAKE_VERIFY_LOG", str(log))
    f = fake_workers / "w.toml"
    f.write_text(WARM)
    code, out, _ = run(["warm", str(f), "--workers", "2", "--json", "--no-torch-ops"], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_UNSUPPORTED and "rejected" not in body["counts"]
    assert {i["verdict"] is None for i in body["items"]} == {True} and _verified(log) == []
    code, out, _ = run(["warm", str(f), "--verify", "--workers", "2", "--json", "--no-torch-ops"], capsys)
    body = json.loads(out)  # the two stored plans go to a worker to be verified; the refusal stays
    assert code == cli.EXIT_FAILED and body["counts"]["rejected"] == 1 and body["counts"]["loaded"] == 1
    assert _verified(log) == [64, 96]


# -- through Redis -----------------------------------------------------------------------


def test_a_verdict_travels_through_redis_and_needs_no_second_run(tmp_path, monkeypatch, calls):
    from helpers.redis import start_server

    server = start_server(tmp_path)  # skips without redis-server or its client
    try:
        monkeypatch.setenv("FASTATTN_REMOTE_CACHE", server.url)
        monkeypatch.setenv("FASTATTN_CACHE_HMAC_KEY", "correct horse battery staple")
        monkeypatch.setattr(runtime, "_core", lambda: fake_core)
        for machine in ("a", "b"):  # each with its own empty disk cache and memory
            monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / machine))
            runtime.clear()
            runtime.configure()
            good, bad = fastattn.probe(CFG, verify=True), fastattn.probe(BAD, verify=True)
            assert good.verdict.status == "passed" and bad.verdict.status == "failed" and not bad.supported
            if machine == "b":
                assert good.source == "remote" and bad.source == "remote"
        assert calls == [CFG, BAD]  # machine b ran nothing: both verdicts came with the entries
    finally:
        server.stop()
        runtime.clear()  # the settings are read again at the next use, after monkeypatch's undo
