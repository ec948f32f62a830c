"""benchmarks/_common.py's pieces that every benchmark's output goes through (CPU)."""

import json

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
