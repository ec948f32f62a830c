"""`fastattn warm` and `fastattn cache ...` on synthetic entries (tests/fake_core.py
stands in for cuDNN), bundles included."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import cli, runtime, store

import fake_core
from helpers.cli import BASE, fill

def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_json(argv, capsys):
    code, out, err = run(argv + ["--json"], capsys)
    return code, json.loads(out)


def test_ls_and_show(env, capsys):
    fill()
    code, body = run_json(["cache", "ls"], capsys)
    assert code == 0 and len(body["entries"]) == 4
    assert sorted(e["kind"] for e in body["entries"]) == ["plan"] * 3 + ["unsupported"]
    assert {e["config"]["seqlen_q"] for e in body["entries"]} == {128, 256, 384}
    code, text, _ = run(["cache", "ls"], capsys)
    assert "b1 8h s256 d64 bf16 causal" in text and "4 entries" in text
    key = body["entries"][0]["key"]
    code, shown = run_json(["cache", "show", key[:10]], capsys)
    assert code == 0 and shown["key"] == key and shown["header"]["description"]["gpu"]["name"] == "NVIDIA H200"
    code, out, err = run(["cache", "show", "zz"], capsys)
    assert code == cli.EXIT_BAD_INPUT and "no entry" in err
    code, out, err = run(["cache", "show", ""], capsys)
    assert code == cli.EXIT_BAD_INPUT


@settings(max_examples=200, deadline=None)
@given(seconds=st.floats(min_value=-1e12, max_value=1e12))
def test_an_age_is_never_negative(seconds):
    # An entry's times come from its file (another machine's clock, a `touch -d`): a
    # time after now reads "ahead", never a negative age.
    from fastattn.cli.cache import _age

    text = _age(seconds)
    assert not text.startswith("-") and (text == "ahead") == (seconds < 0)


def test_ls_says_ahead_for_a_last_use_after_now(env, capsys):
    fill()
    info = next(i for _, i in runtime.plan_cache().store.entries())
    os.utime(info.path, (info.last_used + 10 * 365 * 86400, os.stat(info.path).st_mtime))
    code, text, _ = run(["cache", "ls"], capsys)
    assert code == 0 and " ahead " in text and " -" not in text


def test_verify_finds_damage(env, capsys):
    fill()
    assert run_json(["cache", "verify"], capsys)[0] == 0
    victim = next(store.DiskStore(str(env / "cache")).entries())
    with open(victim.path, "r+b") as f:
        f.seek(victim.size - 3)
        f.write(b"zzz")
    code, body = run_json(["cache", "verify"], capsys)
    assert code == cli.EXIT_FAILED and body["bad"] == 1
    assert [e["status"] for e in body["entries"] if e["key"] == victim.key] == ["damaged"]


def test_verify_load_uses_the_core(env, capsys):
    fill()
    code, body = run_json(["cache", "verify", "--load"], capsys)
    assert code == 0 and {e["status"] for e in body["entries"]} == {"ok", "ok (loads)"}


def test_prune_and_clear(env, capsys):
    fill()
    code, body = run_json(["cache", "prune", "--max-bytes", "1"], capsys)
    assert code == 0 and body["removed"] == 4
    runtime.clear()  # a new process: the plans are rebuilt and stored again
    fill()
    nothing = {"removed": 0, "not_removed": 0, "not_removed_because": [], "left_alone": 0, "also_removed": []}
    assert run_json(["cache", "prune", "--max-age", "1d"], capsys) == (0, nothing)
    assert run(["cache", "prune"], capsys)[0] == cli.EXIT_BAD_INPUT
    code, _, err = run(["cache", "prune", "--max-age", "soon"], capsys)
    assert code == cli.EXIT_BAD_INPUT and "must be a duration" in err
    code, body = run_json(["cache", "clear"], capsys)
    assert code == 0 and {**body, "also_removed": []} == {**nothing, "removed": 4}
    assert {a["what"] for a in body["also_removed"]} <= {"an idle lock file", "an empty shard folder",
                                                          "an empty lock folder"}
    assert run_json(["cache", "ls"], capsys)[1]["entries"] == []


def _new_process(cache_dir, monkeypatch):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")  # the bundles here are unsigned: trust is stated
    runtime.clear()


def test_bundle_round_trip_then_zero_builds(env, capsys, monkeypatch):
    fill()
    bundle = str(env / "b.tar.gz")
    assert run_json(["cache", "export", bundle], capsys) == (0, {"exported": 4, "bundle": bundle, "signed": False})
    _new_process(env / "other", monkeypatch)
    code, body = run_json(["cache", "import", bundle], capsys)
    assert code == 0 and body["imported"] == 4
    _new_process(env / "other", monkeypatch)
    for s in range(3):
        fastattn.plan({**BASE, "seqlen_q": 128 * (s + 1)})
    assert not fastattn.probe({**BASE, "seqlen_q": 128, "head_dim_qk": 1024}).supported
    assert fastattn.stats()["builds"] == 0 and fastattn.stats()["disk_hits"] == 3


def test_export_only_this_gpus_entries_unless_all(env, capsys, monkeypatch):
    fill(2)
    monkeypatch.setattr(fake_core, "GPU_NAME", ["Another GPU"])
    _new_process(env / "cache", monkeypatch)
    fastattn.plan({**BASE, "seqlen_q": 999})
    bundle = str(env / "b.tar.gz")
    assert run_json(["cache", "export", bundle], capsys)[1]["exported"] == 1
    assert run_json(["cache", "export", bundle, "--all", "--force"], capsys)[1]["exported"] == 4


def test_import_refuses_another_gpu_unless_forced(env, capsys, monkeypatch):
    fill()
    bundle = str(env / "b.tar.gz")
    run_json(["cache", "export", bundle], capsys)
    monkeypatch.setattr(fake_core, "GPU_NAME", ["NVIDIA H100 80GB HBM3"])
    _new_process(env / "other", monkeypatch)
    code, out, err = run(["cache", "import", bundle], capsys)
    assert code == cli.EXIT_BAD_INPUT and "another GPU or cuDNN" in err and "NVIDIA H100" in err
    assert not os.path.exists(env / "other")
    code, body = run_json(["cache", "import", bundle, "--force"], capsys)
    assert code == 0 and body["imported"] == 4 and body["mismatched_forced"] == 4


def _tar(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, data.decode()
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _valid_members(env, capsys):
    fill(1)
    bundle = str(env / "good.tar.gz")
    run_json(["cache", "export", bundle], capsys)
    with tarfile.open(bundle) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar}


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlink", "entry_dotdot", "unlisted", "bad_checksum",
                                  "missing", "no_manifest", "bad_manifest"])
def test_hostile_or_broken_bundles_are_refused_whole(env, capsys, monkeypatch, case):
    members = _valid_members(env, capsys)
    manifest = json.loads(members["manifest.json"])
    entry_name = sorted(n for n in members if n.startswith("entries/"))[0]
    evil = env / "evil.entry"
    rows = [(n, d, "file") for n, d in members.items()]
    if case == "dotdot":
        rows.append(("../evil.entry", b"x", "file"))
    elif case == "absolute":
        rows.append((str(evil), b"x", "file"))
    elif case == "symlink":
        rows.append(("entries/" + "a" * 64 + ".entry", str(evil).encode(), "symlink"))
    elif case == "entry_dotdot":
        rows.append(("entries/../../evil.entry", b"x", "file"))
    elif case == "unlisted":
        rows.append(("entries/" + "b" * 64 + ".entry", members[entry_name], "file"))
    elif case == "bad_checksum":
        manifest["entries"][0]["sha256"] = "0" * 64
        rows = [(n, json.dumps(manifest).encode() if n == "manifest.json" else d, k) for n, d, k in rows]
    elif case == "missing":
        rows = [r for r in rows if r[0] != entry_name]
    elif case == "no_manifest":
        rows = [r for r in rows if r[0] != "manifest.json"]
    elif case == "bad_manifest":
        rows = [(n, b"{not json" if n == "manifest.json" else d, k) for n, d, k in rows]
    bundle = str(env / "bad.tar.gz")
    _tar(bundle, rows)
    _new_process(env / "target", monkeypatch)
    code, out, err = run(["cache", "import", bundle, "--force"], capsys)
    assert code == cli.EXIT_BAD_INPUT and "bundle" in err
    expected = {"dotdot": "unexpected member '../evil.entry'", "absolute": "unexpected member",
                "symlink": "is not a regular file", "entry_dotdot": "unexpected member 'entries/../../evil.entry'",
                "unlisted": "is not in the manifest", "bad_checksum": "does not match its checksum",
                "missing": "is listed but missing", "no_manifest": "no manifest.json", "bad_manifest": "bad manifest"}
    assert expected[case] in err, err
    assert not evil.exists()
    assert not os.path.exists(env / "target") or list(store.DiskStore(str(env / "target")).entries()) == []


def test_import_of_a_non_bundle(env, capsys, tmp_path):
    p = tmp_path / "x.tar.gz"
    p.write_bytes(b"not an archive")
    code, out, err = run(["cache", "import", str(p)], capsys)
    assert code == cli.EXIT_BAD_INPUT and "not a readable bundle" in err


# -- warm through the command ------------------------------------------------------------



def test_warm_command_report_and_second_run(fake_workers, capsys):
    f = fake_workers / "w.toml"
    f.write_text('[[configs]]\nbatch = 1\nheads_q = 8\nhead_dim_qk = [64, 1024]\nseqlen_q = [128, 256]\n')
    report = fake_workers / "r.json"
    code, text, _ = run(["warm", str(f), "--workers", "2", "--report", str(report)], capsys)
    assert code == cli.EXIT_UNSUPPORTED  # two configs are refused
    assert "4 configs" in text and "built 2" in text and "unsupported 2" in text
    body = json.loads(report.read_text())
    assert body["counts"] == {"built": 2, "loaded": 0, "unsupported": 2, "failed": 0}
    code, body = run_json(["warm", str(f), "--workers", "2"], capsys)
    assert body["counts"]["loaded"] == 2 and body["counts"]["built"] == 0


def test_warm_command_bad_file(fake_workers, capsys):
    f = fake_workers / "w.json"
    f.write_text('{"configs": [\n {"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64, "mask": "diag"}]}')
    code, out, err = run(["warm", str(f)], capsys)
    assert code == cli.EXIT_BAD_INPUT and "w.json:2: configs[0]: mask='diag'" in err


def test_warm_command_crash_is_exit_4(fake_workers, capsys):
    f = fake_workers / "w.json"
    f.write_text(json.dumps({"configs": [{"batch": 1, "heads_q": 8, "seqlen_q": [64, 128], "head_dim_qk": [64, 72]}]}))
    code, body = run_json(["warm", str(f), "--workers", "2"], capsys)
    assert code == cli.EXIT_FAILED and body["counts"] == {"built": 2, "loaded": 0, "unsupported": 0, "failed": 2}
    assert {i["error_type"] for i in body["items"] if i["status"] == "failed"} == {"SIGSEGV"}


# -- matrix ----------------------------------------------------------------------------------


def test_matrix_grid_and_reasons(fake_workers, capsys):
    argv = ["matrix", "--head-dims", "64,1024", "--masks", "none,causal", "--dtypes", "bf16", "--gqa", "1,2",
            "--seqlens", "256", "--workers", "2"]
    code, body = run_json(argv, capsys)
    assert code == 0 and len(body["configs"]) == 8
    assert {(r["head_dim"], r["status"]) for r in body["configs"]} == {(64, "built"), (1024, "unsupported")}
    code, text, _ = run(argv, capsys)
    rows = text.splitlines()
    assert rows[1].split() == ["64"] + ["yes"] * 4 and rows[2].split() == ["1024"] + ["no"] * 4
    assert "fake cuDNN refuses head_dim_qk=1024" in text


def test_matrix_feature_columns(fake_workers, capsys):
    argv = ["matrix", "--head-dims", "64,1024", "--masks", "none,causal", "--dtypes", "bf16", "--gqa", "1",
            "--seqlens", "256", "--features", "dense,bias_grad,window_br", "--training", "--workers", "2"]
    code, body = run_json(argv, capsys)
    assert code == 0 and len(body["configs"]) == 12
    by = {(r["head_dim"], r["mask"], r["feature"]): r for r in body["configs"]}
    assert by[(64, "causal", "bias_grad")]["status"] == "built"
    assert by[(1024, "causal", "bias_grad")]["status"] == "unsupported"
    # fastattn's own rule, not cuDNN's answer: no worker asked. A value valid somewhere
    # (window_br with no mask) leaves n/a where it does not combine (with causal).
    assert by[(64, "causal", "window_br")]["status"] == "invalid"
    assert "fixes the right bound" in by[(64, "causal", "window_br")]["reason"]
    assert by[(64, "none", "window_br")]["status"] == "built"
    code, text, _ = run(argv, capsys)
    rows = text.splitlines()
    assert rows[0].split()[1:] == ["none/bf16/g1/s256", "none/bf16/g1/s256/bias_grad", "none/bf16/g1/s256/window_br",
                                   "causal/bf16/g1/s256", "causal/bf16/g1/s256/bias_grad",
                                   "causal/bf16/g1/s256/window_br"]
    assert rows[1].split() == ["64", "yes", "yes", "yes", "yes", "yes", "n/a"]
    assert rows[2].split() == ["1024", "no", "no", "no", "no", "no", "n/a"]
    code, _, err = run(["matrix", "--features", "dense,flash"], capsys)
    assert code == cli.EXIT_BAD_INPUT and "'flash' is not one of" in err


def test_matrix_png(fake_workers, capsys, monkeypatch):
    monkeypatch.setattr(runtime, "_core", lambda: fake_core)  # --png asks this process for a GPU first
    runtime.clear()
    png = fake_workers / "grid.png"
    argv = ["matrix", "--head-dims", "64", "--masks", "causal", "--dtypes", "bf16", "--gqa", "1", "--png", str(png)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        code, out, err = run(argv, capsys)
        assert code == cli.EXIT_BAD_INPUT and "needs matplotlib" in err
        return
    code, out, err = run(argv, capsys)
    assert code == 0 and png.read_bytes().startswith(b"\x89PNG")


def test_matrix_bad_arguments(capsys):
    for argv, msg in ((["matrix", "--head-dims", "64,x"], "must be an integer"),
                      (["matrix", "--masks", "causal,diag"], "'diag' is not one of")):
        code, _, err = run(argv, capsys)
        assert code == cli.EXIT_BAD_INPUT and msg in err
    code, out, err = run(["matrix", "--heads", "6", "--gqa", "4"], capsys)
    assert code == cli.EXIT_BAD_INPUT and "--gqa 4: --heads 6" in err


# -- FP8 plans are plans like any other -------------------------------------------------------


def test_fp8_plans_travel_in_bundles(env, capsys, monkeypatch):
    fp8 = {**BASE, "seqlen_q": 256, "dtype": "fp8_e4m3", "out_dtype": "bf16", "grad_dtype": "fp8_e5m2",
           "training": True}
    fastattn.plan(fp8)
    fastattn.plan({**fp8, "dtype": "bf16", "out_dtype": None, "grad_dtype": None})
    bundle = str(env / "fp8.tar.gz")
    assert run_json(["cache", "export", bundle], capsys) == (0, {"exported": 2, "bundle": bundle, "signed": False})
    _new_process(env / "other", monkeypatch)
    assert run_json(["cache", "import", bundle], capsys)[1]["imported"] == 2
    _new_process(env / "other", monkeypatch)
    plan = fastattn.plan(fp8)
    assert plan.config.out_dtype == "bf16" and fastattn.stats()["builds"] == 0


def test_matrix_fp8_columns(fake_workers, capsys):
    argv = ["matrix", "--head-dims", "64", "--masks", "causal", "--dtypes", "bf16,fp8_e4m3", "--gqa", "1",
            "--seqlens", "256", "--workers", "2"]
    code, body = run_json(argv, capsys)
    assert code == 0 and {r["dtype"] for r in body["configs"]} == {"bf16", "fp8_e4m3"}
    assert all(r["status"] == "built" for r in body["configs"])


def test_probe_prints_the_recorded_fp8_note(env, capsys, monkeypatch):
    from fastattn import perf_notes

    argv = ["probe", "--batch", "4", "--heads-q", "32", "--seqlen-q", "4096", "--head-dim-qk", "128", "--mask",
            "causal", "--dtype", "fp8_e4m3", "--training"]
    shipped = perf_notes.PATH
    monkeypatch.setattr(perf_notes, "PATH", str(env / "no-notes.json"))
    code, text, _ = run(argv, capsys)
    assert code == 0 and "note:" not in text  # nothing recorded: nothing said
    monkeypatch.setattr(perf_notes, "PATH", shipped)
    code, text, _ = run(argv, capsys)  # the notes the package ships (benchmarks/bench_fp8.py on the H200)
    assert code == 0 and "note: FP8 backward ran at 0.67x bf16's speed for this shape on NVIDIA H200" in text
    cfg = fastattn.AttentionConfig(batch=4, heads_q=32, seqlen_q=4096, head_dim_qk=128, mask="causal",
                                   dtype="fp8_e4m3", training=True)
    notes = env / "notes.json"
    notes.write_text(json.dumps({"format": 1, "gpu": "NVIDIA H200", "date": "2026-12-01", "cudnn": 91900,
                                 "rows": [{"config": cfg.to_dict(), "forward_ratio": 1.2, "backward_ratio": 0.7}]}))
    monkeypatch.setattr(perf_notes, "PATH", str(notes))
    code, text, _ = run(argv, capsys)
    assert code == 0 and "note: FP8 backward ran at 0.70x bf16's speed" in text
    code, body = run_json(argv, capsys)
    assert len(body["notes"]) == 1


def test_show_with_no_match_does_not_ask_for_more_of_the_key(env, capsys):
    fill()
    code, out, err = run(["cache", "show", "abc" if not any(
        i.key.startswith("abc") for _, i in runtime.plan_cache().store.entries()) else "fff0"], capsys)
    assert code == cli.EXIT_BAD_INPUT and "no entry matches" in err and "give more" not in err, err
    keys = sorted(i.key for _, i in runtime.plan_cache().store.entries())
    common = os.path.commonprefix(keys[:2])
    if common:  # several match: then more of the key is the advice
        code, out, err = run(["cache", "show", common], capsys)
        assert code == cli.EXIT_BAD_INPUT and "give more of the key" in err


@pytest.mark.parametrize("command", ["push", "pull"])
@pytest.mark.parametrize("as_json", [False, True])
def test_push_and_pull_without_a_secret_say_their_refusal_once(tmp_path, command, as_json):
    # In a process of its own: pytest's log capture would hide a warning printed beside the error.
    import subprocess
    import sys

    from helpers.paths import ROOT

    environ = {k: v for k, v in os.environ.items() if k not in ("FASTATTN_CACHE_HMAC_KEY", "FASTATTN_CACHE_TRUSTED",
                                                                 "FASTATTN_CACHE_HMAC_KEY_FILE")}
    environ.update(FASTATTN_REMOTE_CACHE="redis://127.0.0.1:1/0", FASTATTN_CACHE_DIR=str(tmp_path / "cache"),
                   PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "fastattn", "cache", command, "--all"]
                          + (["--json"] if as_json else []), capture_output=True, text=True, env=environ, timeout=120)
    assert proc.returncode == cli.EXIT_BAD_INPUT
    assert (proc.stdout + proc.stderr).count("no signing secret") == 1, (proc.stdout, proc.stderr)
