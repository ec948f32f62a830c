"""benchmarks/_common.py's pieces that every benchmark's output goes through (CPU)."""

import json
import os
import subprocess
import sys

import pytest

from helpers import benchmarks


def test_the_benchmarks_common_ending_writes_the_json_and_the_summary_line(tmp_path, capsys):
    # benchmarks/_common.emit: what tools/gpu_run.sh reads (from "summary:" on) and the
    # JSON kept under benchmarks/results/, the same numbers.
    common = benchmarks.load("_common")
    path = tmp_path / "out.json"
    common.emit({"ratio": 0.25, "rows": [1, 2]}, str(path))
    printed = capsys.readouterr().out
    assert json.loads(path.read_text()) == {"ratio": 0.25, "rows": [1, 2]}
    body, _, rest = printed.partition("\nsummary:")
    assert json.loads(body) == {"ratio": 0.25, "rows": [1, 2]} and rest.strip() == ""
    common.emit({"a": 1}, None)  # no path: printed only
    assert not list(tmp_path.glob("*.json"))[1:]
    # NaN and the infinities as null (strict JSON), wherever they are; the caller's dict untouched
    res = {"error": float("nan"), "rows": [{"x": float("inf"), "y": (1.5, -float("inf"))}], "n": 3, "s": "NaN"}
    capsys.readouterr()
    common.emit(res, str(path))
    printed = capsys.readouterr().out.partition("\nsummary:")[0]
    want = {"error": None, "rows": [{"x": None, "y": [1.5, None]}], "n": 3, "s": "NaN"}

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))

    assert strict(path.read_text()) == want and strict(printed) == want
    assert res["error"] != res["error"]  # (still NaN)


def test_the_benchmarks_that_print_only_a_summary_write_their_json_strictly(tmp_path, capsys):
    # _common.write_json: the writer emit and report end with, called alone by the scripts
    # that print their own summary and not the JSON (a list, as profile_coldstart's, too).
    common = benchmarks.load("_common")
    path = tmp_path / "out.json"
    res = [{"mode": "fwd", "ms": float("nan")}, {"mode": "exec", "ms": 1.5}]
    want = [{"mode": "fwd", "ms": None}, {"mode": "exec", "ms": 1.5}]
    assert common.write_json(res, str(path)) == want
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON")) == want
    assert common.write_json({"a": 1}, None) == {"a": 1} and list(tmp_path.iterdir()) == [path]
    assert capsys.readouterr().out == ""  # nothing printed: the script's summary is its own


def test_a_result_goes_into_a_folder_not_there_yet(tmp_path):
    # A run of minutes ends in its write: a --json into a folder that does not exist yet
    # (tools/gpu_run.sh's ALSO output folder, once) must not lose its numbers.
    common = benchmarks.load("_common")
    path = tmp_path / "also" / "deeper" / "out.json"
    common.write_json({"a": 1.0}, str(path))
    assert json.loads(path.read_text()) == {"a": 1.0}


def test_every_recorded_result_is_strict_json():
    # The benchmark notes link these files; a reader's JSON parser (jq, JavaScript's) refuses
    # NaN and Infinity, which Python's json writes unless told not to.
    files = sorted((benchmarks.ROOT / "benchmarks" / "results").rglob("*.json"))
    assert files
    bad = []
    for f in files:
        try:
            json.loads(f.read_text(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except ValueError as e:
            bad.append(f"{f.relative_to(benchmarks.ROOT)}: {e}")
    assert not bad, bad


def test_every_benchmarks_json_opens_with_the_machine_and_versions(monkeypatch):
    # header(): what the benchmark notes record beside every figure (date, GPU, versions,
    # kernel); the GPU's description stubbed (benchmarks run where there is one).
    import fastattn

    monkeypatch.setattr(fastattn, "device_info", lambda: {"name": "stub"})
    common = benchmarks.load("_common")
    head = common.header()
    assert set(head) == {"date", "device", "versions", "torch", "uname"} and head["device"] == {"name": "stub"}


def test_the_childrens_stopwatch_marks_each_step_since_the_last():
    import json
    import time

    common = benchmarks.load("_common")
    steps = common.Steps(3)
    time.sleep(0.01)
    steps.mark("first")
    steps.mark("second")
    assert [n for n, _ in steps] == ["first", "second"] and steps[0][1] >= 10.0 and steps[1][1] < steps[0][1]
    assert json.loads(json.dumps(steps)) == [list(r) for r in steps]


def test_the_warm_verify_benchmark_reports_medians_over_its_rounds(tmp_path, monkeypatch, capsys):
    # bench_warm_verify: each round times plain warm, warm --verify, --verify over a plain
    # cache and over a verified one, in fresh cache directories; the medians are the
    # rounds' medians (an earlier version printed the upper one of two as "median").
    import types

    bench = benchmarks.load("bench_warm_verify")
    times = iter([5.0, 15.0, 1.0, 6.0, 14.0, 7.0, 17.0, 3.0, 2.0, 13.0, 6.5, 16.0, 2.0, 4.0, 15.0])
    clock = types.SimpleNamespace(t=0.0)

    def fake_warm(configs, workers, verify):
        clock.t += next(times)
        return types.SimpleNamespace(counts={"built": len(configs)}, verdicts={"passed": 0}, processes=workers, items=[])

    monkeypatch.setattr(bench, "warm", fake_warm)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock.t)
    monkeypatch.setattr(bench.config_files, "builtin_configs", lambda: ["a", "b"])
    monkeypatch.setattr(bench._common, "header", lambda: {"date": "d", "uname": "u"})
    monkeypatch.setattr(bench._common, "require_cuda", lambda script: None)  # the GPU stood in for too
    out = tmp_path / "out.json"
    assert bench.main(["--rounds", "3", "--workers", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    # per round, in order: plain, verify, verify_again, plain_before, verify_after
    assert [r["plain"]["seconds"] for r in res["rounds"]] == [5.0, 7.0, 6.5]
    assert res["median_seconds"] == {"plain": 6.5, "verify": 16.0, "verify_after": 14.0, "verify_again": 2.0}
    assert res["date"] == "d" and res["configs"] == 2
    assert "verify_after    14.00 s" in capsys.readouterr().out


# The benchmarks that measure nothing but the host (no GPU needed), and the module they share.
CPU_BENCHMARKS = {"_common", "bench_cache_prune", "bench_checks", "bench_executor", "bench_remote"}


def test_every_gpu_benchmark_refuses_a_machine_without_cuda_in_one_line():
    # Exit status 2 and require_cuda's message, never a traceback, from every script of
    # benchmarks/ that needs a GPU (all at once: each imports torch).
    pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    names = sorted(p.stem for p in benchmarks.BENCHMARKS.glob("*.py") if p.stem not in CPU_BENCHMARKS)
    assert len(names) >= 20
    env = {**os.environ, "PYTHONPATH": str(benchmarks.ROOT), "CUDA_VISIBLE_DEVICES": ""}
    runs = {n: subprocess.Popen([sys.executable, str(benchmarks.BENCHMARKS / f"{n}.py")], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env) for n in names}
    failed = {}
    for n, p in runs.items():
        out, err = p.communicate(timeout=300)
        if p.returncode != 2 or "needs a CUDA GPU" not in err or "Traceback" in out + err:
            failed[n] = (p.returncode, (out + err)[-300:])
    assert not failed, failed
