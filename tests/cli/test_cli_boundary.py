"""The CLI's one error boundary and its flag parsers: every outcome has its documented
exit code, no traceback reaches the user, --json output is JSON on every path, and
every numeric flag is range-checked with the flag's name."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import cli, runtime, config_files
from fastattn.cli import _common
from fastattn.warm import WarmItem, WarmReport
from helpers.cli import run  # noqa: E402
from helpers.paths import DOCS, README

PROBE = ["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "128", "--head-dim-qk", "64"]


def run_json(argv, capsys):
    code, out, err = run(argv + ["--json"], capsys)
    return code, json.loads(out)


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a command starts probing or warming: refusals must come first."""
    def refuse(*a, **k):
        raise AssertionError("the command started work before refusing its input")

    import fastattn.warm

    monkeypatch.setattr(fastattn.warm, "warm", refuse)
    monkeypatch.setattr(runtime, "probe", refuse)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "cache"))
    runtime.clear()
    yield tmp_path / "cache"
    runtime.clear()


# -- defect 2, 3, 8: numeric flags, range-checked by the same helpers, named ----------------


@pytest.mark.parametrize("argv,flag", [
    (["matrix", "--gqa", "0"], "--gqa"), (["matrix", "--gqa", "-2"], "--gqa"), (["matrix", "--heads", "-8"], "--heads"),
    (["matrix", "--head-dims", "-64"], "--head-dims"), (["matrix", "--batch", "0"], "--batch"),
    (["matrix", "--seqlens", "0"], "--seqlens"), (["matrix", "--seqlens", "64,0"], "--seqlens"),
    (["matrix", "--workers", "0"], "--workers"), (["matrix", "--head-dims", "2147483648"], "--head-dims"),
    (["warm", "--timeout", "-1"], "--timeout"), (["warm", "--timeout", "nan"], "--timeout"),
    (["warm", "--timeout", "inf"], "--timeout"), (["warm", "--timeout", "0"], "--timeout"),
    (["warm", "--workers", "-3"], "--workers"), (["warm", "--device", "-1"], "--device"),
    (["cache", "prune", "--max-bytes", "inf"], "--max-bytes"),
    (["cache", "prune", "--max-bytes", "1e400"], "--max-bytes"),
    (["cache", "prune", "--max-bytes", "nan"], "--max-bytes"), (["cache", "prune", "--max-bytes", "-1"], "--max-bytes"),
    (["cache", "prune", "--max-age", "nan"], "--max-age"), (["cache", "prune", "--max-age", "infd"], "--max-age"),
    (PROBE + ["--batch", "0"], "--batch"), (PROBE + ["--scale", "nan"], "--scale"),
    (PROBE + ["--scale", "-1"], "--scale"),
    (PROBE + ["--dropout", "1"], "--dropout"), (PROBE + ["--window", "-2", "0"], "--window"),
    (PROBE + ["--device", "-1"], "--device"), (PROBE + ["--page-size", "-64"], "--page-size"),
    (["info", "--device", "-1"], "--device"), (["warm", "--report", ""], "--report"),
])
def test_out_of_range_flags_are_bad_input_naming_the_flag(argv, flag, capsys, cache_dir, no_work):
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT and f"argument {flag}:" in err and not out
    code, body = run_json(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT and body["error"] == "UsageError" and flag in body["message"]


def test_size_and_age_parsers():
    assert _common.size("2G") == 2 << 30 and _common.size("500M") == 500 << 20 and _common.size("0") == 0
    age = _common.duration(_common.MAX_AGE)
    assert age("30d") == 30 * 86400 and age("90") == 90
    for bad in ("inf", "-inf", "nan", "1e400", "1e19", "-1", "x", ""):
        with pytest.raises(Exception, match="size|negative"):
            _common.size(bad)


# -- defect 8: --report into a missing directory is refused before the sweep ---------------


def test_warm_report_into_a_missing_directory_is_refused_first(tmp_path, capsys, no_work):
    code, _, err = run(["warm", "--report", str(tmp_path / "nope" / "r.json")], capsys)
    assert code == cli.EXIT_BAD_INPUT and "--report" in err and "does not exist" in err
    code, _, err = run(["warm", "--report", str(tmp_path)], capsys)
    assert code == cli.EXIT_BAD_INPUT and "is a directory" in err


# -- defect 7: matrix --------------------------------------------------------------------


@pytest.fixture
def gpu_here(monkeypatch):
    """This process sees tests/fake_core.py's GPU."""
    import fake_core

    monkeypatch.setattr(runtime, "_core", lambda: fake_core)
    runtime.clear()
    yield
    runtime.clear()


@pytest.fixture
def no_gpu_here(monkeypatch):
    """This process finds no usable GPU stack."""
    def no_core():
        raise fastattn.LibraryError("fastattn cannot use the GPU:\n  - fake: libcuda.so.1 is missing")

    monkeypatch.setattr(runtime, "_core", no_core)
    runtime.clear()
    yield
    runtime.clear()


def test_matrix_png_without_matplotlib_is_refused_before_probing(tmp_path, capsys, monkeypatch, no_work, gpu_here):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = run(["matrix", "--head-dims", "64", "--png", str(tmp_path / "g.png")], capsys)
    assert code == cli.EXIT_BAD_INPUT and "needs matplotlib" in err
    code, _, err = run(["matrix", "--png", str(tmp_path / "nope" / "g.png")], capsys)
    assert code == cli.EXIT_BAD_INPUT and "--png" in err


def test_matrix_png_without_a_gpu_is_exit_3_before_matplotlib_is_asked_for(tmp_path, capsys, monkeypatch, no_work,
                                                                           no_gpu_here):
    # Without a GPU and without matplotlib it asked for matplotlib (exit 2): installing it
    # would only have led to exit 3.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = run(["matrix", "--head-dims", "64", "--png", str(tmp_path / "g.png")], capsys)
    assert code == cli.EXIT_NO_GPU, (out, err)
    assert "libcuda" in err and "matplotlib" not in err and not (tmp_path / "g.png").exists()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 12), min_size=6, max_size=6), cap=st.integers(1, 3000))
def test_a_grid_past_the_cap_is_a_usage_error_before_any_cell_is_made(capsys, monkeypatch, sizes, cap):
    # A 600,000-cell grid printed nothing for 400 s, at 1.7 GB, before it was killed.
    from fastattn.config import DTYPES, MASKS
    from fastattn.cli import matrix

    monkeypatch.setattr(config_files, "MAX_CONFIGS", cap)
    made = []

    def cell(**fields):  # each cell made is counted, and refused (as fastattn's rules refuse paged backward)
        made.append(fields)
        raise fastattn.InvalidArgumentError("refused by the test")

    monkeypatch.setattr(matrix, "AttentionConfig", cell)
    values = {"--head-dims": [str(64 + 8 * i) for i in range(sizes[0])], "--masks": list(MASKS)[:sizes[1]],
              "--dtypes": list(DTYPES)[:sizes[2]], "--gqa": ["1"] * sizes[3], "--seqlens": [str(i + 1) for i in
                                                                                            range(sizes[4])],
              "--features": ["dense"] * sizes[5]}
    cells = 1
    for v in values.values():
        cells *= len(v)
    argv = ["matrix"] + [a for flag, v in values.items() for a in (flag, ",".join(v))]
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT, err
    if cells > cap:
        assert f"the grid has {cells} cells" in err and f"more than {cap}" in err and not made, err
    else:  # under the cap, every cell is made (and refused)
        assert "no config of the grid with it is valid" in err and len(made) == cells, (cells, cap, err)


def test_a_600000_cell_grid_is_refused_at_once(capsys, no_work):
    argv = ["matrix", "--head-dims", ",".join(str(d) for d in range(8, 8 + 8 * 1250, 8)), "--seqlens",
            ",".join(str(s) for s in range(1, 21)), "--masks", "none,causal,causal_bottom_right", "--dtypes",
            "fp16,bf16,fp8_e4m3,fp8_e5m2"]
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_BAD_INPUT, err
    assert "the grid has 600000 cells (1250 --head-dims x 3 --masks x 4 --dtypes x 2 --gqa x 20 --seqlens x 1 " \
           "--features), more than 100000" in err


def _fake_warm(reason):
    def warm(configs, **kwargs):
        items = [WarmItem(c, status="built" if c.head_dim_qk == 64 else "unsupported",
                          reason="" if c.head_dim_qk == 64 else reason) for c in configs]
        counts = {"built": sum(i.status == "built" for i in items), "loaded": 0,
                  "unsupported": sum(i.status == "unsupported" for i in items), "failed": 0}
        return WarmReport(items, 0.0, 1, counts, 1)

    return warm


def test_matrix_headers_are_whole_and_reasons_are_not_cut(capsys, monkeypatch):
    import fastattn.warm

    reason = "forward: " + " ".join(f"word{i:03d}" for i in range(60))  # ~490 characters
    monkeypatch.setattr(fastattn.warm, "warm", _fake_warm(reason))
    code, text, _ = run(["matrix", "--head-dims", "64,128", "--masks", "causal,causal_bottom_right", "--dtypes",
                         "bf16", "--gqa", "1", "--seqlens", "256"], capsys)
    assert code == cli.EXIT_OK
    header = text.splitlines()[0].split()
    assert header[1:] == ["causal/bf16/g1/s256", "causal_br/bf16/g1/s256"]  # two columns, two names
    body = text[text.index("reasons:"):]
    words = body.split()
    assert all(w in words for w in reason.split())  # every word, whole
    assert max(len(line) for line in body.splitlines()) <= 104


# -- defect 10: probe's input ------------------------------------------------------------


@pytest.mark.parametrize("config,message", [
    ("[1,2]", "holds 2 entries; probe takes one config"), ("[1]", "must be an object (TOML: a table) of "
                                                                 "AttentionConfig fields, not an integer"),
    ('"text"', "must be an object of AttentionConfig fields"), ("42", "must be an object of AttentionConfig"),
    ("{nope", "--config '{nope':1:2: not valid JSON"), ("nope.json", "no such file, and not JSON text"),
    ('{"batch": 1, "window": {"left": 16, "right": 0}}', "window="),
])
def test_probe_config_errors_say_what_is_wrong(config, message, capsys, no_work):
    code, _, err = run(PROBE + ["--config", config], capsys)
    assert code == cli.EXIT_BAD_INPUT and message in err


def test_probe_config_file_that_is_not_text(tmp_path, capsys, no_work):
    f = tmp_path / "c.json"
    f.write_bytes(b"\xff\xfe\x00binary")
    code, _, err = run(PROBE + ["--config", str(f)], capsys)
    assert code == cli.EXIT_BAD_INPUT and f"{f}: not UTF-8 text" in err


# -- defect 13: the boundary -------------------------------------------------------------


def _boom(*a, **k):
    raise ZeroDivisionError("an unexpected failure")


@pytest.mark.parametrize("as_json", [False, True])
def test_an_unexpected_exception_is_a_bug_with_its_own_code_and_a_traceback_file(as_json, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(runtime, "probe", _boom)
    code, out, err = run(PROBE + (["--json"] if as_json else []), capsys)
    assert code == cli.EXIT_BUG == 5
    if as_json:
        body = json.loads(out)
        assert body["error"] == "Bug" and "ZeroDivisionError" in body["message"]
        path = body["traceback_file"]
    else:
        assert len(err.strip().splitlines()) == 1 and "a bug in fastattn" in err
        path = err.split("the traceback is in ")[1].split(";")[0]
    assert os.path.dirname(path) == str(tmp_path)
    report = open(path).read()
    assert "Traceback (most recent call last)" in report and "_boom" in report and "probe" in report


def test_a_bug_with_no_writable_temp_dir_still_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    monkeypatch.setattr(runtime, "probe", _boom)
    code, _, err = run(PROBE, capsys)
    assert code == cli.EXIT_BUG and "could not be written" in err and len(err.strip().splitlines()) == 1


def test_interrupt_is_130(capsys, monkeypatch):
    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime, "probe", interrupt)
    assert run(PROBE, capsys)[0] == cli.EXIT_INTERRUPTED == 130


def test_expected_failures_keep_their_codes(capsys, monkeypatch):
    for error, code in ((fastattn.InvalidArgumentError("x"), 2), (fastattn.LibraryError("x"), 3),
                        (fastattn.CudaError("x"), 3), (ConnectionError("x"), 4)):
        def fail(*a, error=error, **k):
            raise error

        monkeypatch.setattr(runtime, "probe", fail)
        assert run(PROBE, capsys)[0] == code
        assert run_json(PROBE, capsys)[1]["error"] == type(error).__name__


def test_a_broken_pipe_inside_the_work_is_a_failed_connection_in_fastattns_words(capsys, monkeypatch):
    # Only stdout's reader leaving is quiet (tests/cli/test_cli_output.py); a pipe or
    # socket the work itself writes to (Redis) that breaks is a failure, said in one line.
    def closed(*a, **k):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(runtime, "probe", closed)
    code, out, err = run(PROBE, capsys)
    assert code == cli.EXIT_FAILED and not out and err.count("\n") == 1, err
    assert "Broken pipe" in err and "[Errno" not in err, err


def test_exit_codes_are_distinct_and_documented():
    assert len(set(_common.EXIT_CODES)) == len(_common.EXIT_CODES)
    readme = README.read_text()
    table = readme[readme.index("| exit code |"):]
    cli_page = (DOCS / "CLI.md").read_text()
    cases = cli_page[cli_page.index("\n## Exit codes\n"):]
    for code in _common.EXIT_CODES:
        assert f"\n| {code} |" in table  # the README's short table
        assert f"\n- **{code}**: " in cases  # each code's cases, in docs/CLI.md


# -- --json on every path, --version ------------------------------------------------------


@pytest.mark.parametrize("argv", [["matrix", "--gqa", "zero"], ["nope"], [], ["probe", "--mask"], ["cache"],
                                  ["--help"], ["probe", "--help"], ["--version"], ["cache", "ls", "extra"]])
def test_json_output_is_json_on_every_path(argv, capsys, cache_dir):
    code = cli.main(argv + ["--json"])
    out, err = capsys.readouterr()
    body = json.loads(out)
    assert code in (0, 2) and isinstance(body, dict) and "Traceback" not in err
    if code == 2:
        assert body["error"] == "UsageError"


def test_json_flag_anywhere_on_the_line(capsys, cache_dir):
    for argv in (["cache", "--json", "ls"], ["cache", "ls", "--json"], ["--json", "cache", "ls"]):
        code, out, _ = run(argv, capsys)
        assert code == 0 and json.loads(out)["entries"] == []


def test_version(capsys):
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out.strip() == f"fastattn {fastattn.__version__}"
    code, out, _ = run(["--version", "--json"], capsys)
    assert code == 0 and fastattn.__version__ in json.loads(out)["output"]


# -- defect 14: readable output, config files by content -----------------------------------


def test_info_prints_text_not_python_reprs(capsys, cache_dir):
    code, out, _ = run(["info"], capsys)
    assert code in (cli.EXIT_OK, cli.EXIT_NO_GPU)
    assert "{'" not in out and "[{" not in out and "': " not in out and "None" not in out
    assert f"directory: {cache_dir}" in out and "versions:" in out


def test_plain_text_of_nested_results():
    text = _common.plain_text({"a": [{"x": 1, "y": None}, {"x": 2, "y": True}], "b": {}, "c": [1, 2], "d": 0.5,
                               "e": "two\nlines"})
    assert text == "a:\n  - x: 1\n    y: none\n  - x: 2\n    y: yes\nb: none\nc: 1, 2\nd: 0.5\ne: two\n  lines"


TOML = "[[configs]]\nbatch = 1\nheads_q = 8\nseqlen_q = 128\nhead_dim_qk = 64\n"


def test_warm_files_by_content_when_not_named_toml_or_json(tmp_path):
    for name, text in (("w.conf", TOML), ("w", TOML), ("w.txt", json.dumps({"configs": [
            {"batch": 1, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}]}))):
        (tmp_path / name).write_text(text)
        assert len(config_files.load_configs(str(tmp_path / name))) == 1
    (tmp_path / "bad.conf").write_text("batch = \n")
    with pytest.raises(fastattn.InvalidArgumentError) as e:
        config_files.load_configs(str(tmp_path / "bad.conf"))
    assert "bad.conf:1:1: not valid JSON" in str(e.value) and "bad.conf:1:9: not valid TOML" in str(e.value)


def test_toml_errors_carry_the_line(tmp_path, capsys, no_work):
    (tmp_path / "w.toml").write_text(TOML + "mask = \n")
    code, _, err = run(["warm", str(tmp_path / "w.toml")], capsys)
    assert code == cli.EXIT_BAD_INPUT and "w.toml:6:8: not valid TOML" in err
