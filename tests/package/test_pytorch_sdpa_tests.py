"""tools/pytorch_sdpa_tests.py and tools/sdpa_mode_plugin.py on the CPU: the comparison of
two runs' JUnit files (regressions with their failures' first lines, the documented
dropout-mask comparisons allowed, tests fixed, exit codes), the allowed list read from
docs/INTEGRATIONS.md, the refusals (a missing or changed PyTorch test file), the plugin's
stats file and sample with the mode on in a process without a GPU, and the whole tool over a
stand-in test file whose outcomes depend on the mode. (PyTorch's own tests against the mode
need the GPU machine: the device call in docs/INSTALL.md.)"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers.paths import DOCS, ROOT

TOOL = ROOT / "tools" / "pytorch_sdpa_tests.py"
pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("pytorch_sdpa_tests", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def junit(path, cases):
    """A JUnit file as pytest writes one: cases of (class, name, outcome, message)."""
    body = []
    for cls, name, outcome, message in cases:
        inner = {"passed": "",
                 "failed": f'<failure message="{message}">Traceback\n  line\n{message}</failure>',
                 "error": f'<error message="{message}">teardown</error>',
                 "skipped": '<skipped type="pytest.skip" message="skip">skip</skipped>'}[outcome]
        body.append(f'<testcase classname=".pytorch-tests.2.11.test_transformers.{cls}" name="{name}" '
                    f'time="0.1">{inner}</testcase>')
    path.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
                    + "".join(body) + "</testsuite></testsuites>")
    return path


def run_tool(*args, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env or dict(os.environ), timeout=300)


def test_a_test_that_passes_off_and_fails_on_is_a_regression_with_its_first_lines(tmp_path):
    off = junit(tmp_path / "off.xml", [("TestSDPACUDA", "test_a", "passed", ""),
                                       ("TestSDPACUDA", "test_b", "passed", ""),
                                       ("TestSDPACUDA", "test_c", "failed", "RuntimeError: theirs")])
    on = junit(tmp_path / "on.xml", [("TestSDPACUDA", "test_a", "passed", ""),
                                     ("TestSDPACUDA", "test_b", "failed", "AssertionError: not close"),
                                     ("TestSDPACUDA", "test_c", "passed", "")])
    r = run_tool("--compare", off, on, "--out", tmp_path / "out")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "REGRESSION TestSDPACUDA::test_b" in r.stdout
    assert "AssertionError: not close" in r.stdout
    assert "fail off, pass on: 1\n  TestSDPACUDA::test_c" in r.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [x["test"] for x in summary["regressions"]] == ["TestSDPACUDA::test_b"]
    assert summary["off"] == {"passed": 2, "failed": 1, "skipped": 0}
    assert summary["on"] == {"passed": 2, "failed": 1, "skipped": 0}
    assert r.stdout.rstrip().splitlines()[-1].startswith("verdict: 1 regressions (0 allowed), 1 fixed")


def test_no_regression_exits_0_and_an_error_or_a_skip_is_not_a_pass(tmp_path):
    off = junit(tmp_path / "off.xml", [("TestAttnBiasCUDA", "test_a", "error", "teardown failed"),
                                       ("TestAttnBiasCUDA", "test_b", "skipped", ""),
                                       ("TestAttnBiasCUDA", "test_c", "passed", "")])
    on = junit(tmp_path / "on.xml", [("TestAttnBiasCUDA", "test_a", "failed", "still"),
                                     ("TestAttnBiasCUDA", "test_b", "failed", "now runs"),
                                     ("TestAttnBiasCUDA", "test_c", "skipped", "")])
    r = run_tool("--compare", off, on, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pass off, skipped on: 1\n  TestAttnBiasCUDA::test_c" in r.stdout


def test_a_documented_dropout_mask_comparison_is_allowed(tool, tmp_path, monkeypatch):
    page = tmp_path / "INTEGRATIONS.md"
    page.write_text(f"text\n{tool.MARK_BEGIN}\n- `test_mem_eff*dropout_p_0_22*`: why\n"
                    f"- `TestSDPACudaOnlyCUDA::test_x`: why\n{tool.MARK_END}\n- `test_not_listed`\n")
    monkeypatch.setattr(tool, "INTEGRATIONS", page)
    assert tool.allowed_patterns() == ["test_mem_eff*dropout_p_0_22*", "TestSDPACudaOnlyCUDA::test_x"]
    name = "test_mem_eff_attention_vs_math_ref_grads_dropout_p_0_22_cuda"
    off = junit(tmp_path / "off.xml", [("TestSDPACudaOnlyCUDA", name, "passed", ""),
                                       ("TestSDPACudaOnlyCUDA", "test_x", "passed", ""),
                                       ("TestSDPACUDA", "test_x", "passed", "")])
    on = junit(tmp_path / "on.xml", [("TestSDPACudaOnlyCUDA", name, "failed", "mask"),
                                     ("TestSDPACudaOnlyCUDA", "test_x", "failed", "mask"),
                                     ("TestSDPACUDA", "test_x", "passed", "")])
    assert tool.report(off, on, None, None, []) == tool.OK
    on = junit(tmp_path / "on.xml", [("TestSDPACudaOnlyCUDA", name, "failed", "mask"),
                                     ("TestSDPACudaOnlyCUDA", "test_x", "passed", ""),
                                     ("TestSDPACUDA", "test_x", "failed", "another class: not allowed")])
    assert tool.report(off, on, None, None, []) == tool.REGRESSED


def test_the_allowed_list_is_read_from_integrations_md(tool, tmp_path, monkeypatch):
    """The page keeps its markers and every entry is a pattern line; a page without the
    markers is refused, so that an edit cannot silently allow nothing or everything."""
    page = (DOCS / "INTEGRATIONS.md").read_text()
    section = page[page.index(tool.MARK_BEGIN):page.index(tool.MARK_END)]
    assert tool.allowed_patterns() == [line[3:].split("`")[0] for line in section.splitlines()
                                       if line.startswith("- `")]
    bare = tmp_path / "bare.md"
    bare.write_text("- `test_everything*`\n")
    monkeypatch.setattr(tool, "INTEGRATIONS", bare)
    with pytest.raises(tool.Refused, match="dropout-mask-comparisons"):
        tool.allowed_patterns()


def test_a_missing_junit_file_exits_2(tmp_path):
    off = junit(tmp_path / "off.xml", [("TestSDPACUDA", "test_a", "passed", "")])
    r = run_tool("--compare", off, tmp_path / "on.xml", "--out", tmp_path / "out")
    assert r.returncode == 2
    assert "on.xml: no JUnit file" in r.stderr


def test_a_missing_test_file_is_refused_naming_where_it_goes(tmp_path):
    r = run_tool("--release", "2.11", "--test-dir", tmp_path / "pt", "--out", tmp_path / "out")
    assert r.returncode == 2
    assert f"{tmp_path / 'pt' / '2.11' / 'test_transformers.py'} is missing" in r.stderr
    assert "v2.11.0" in r.stderr and "70d99e998b4955e0049d13a98d77ae1b14db1f45" in r.stderr
    assert 'carry [".pytorch-tests"]' in r.stderr
    r = run_tool("--release", "9.99", "--test-dir", tmp_path / "pt")
    assert r.returncode == 2 and "no PyTorch test files are declared for torch 9.99" in r.stderr


def test_a_test_file_that_is_not_the_release_s_is_refused(tool, tmp_path, monkeypatch):
    (tmp_path / "2.11").mkdir()
    (tmp_path / "2.11" / "test_transformers.py").write_text("# edited\n")
    monkeypatch.setitem(tool.RELEASES, "2.11", {**tool.RELEASES["2.11"],
                                                "files": {"test/test_transformers.py": "0" * 64}})
    with pytest.raises(tool.Refused, match="is not v2.11.0's test/test_transformers.py"):
        tool.check_files("2.11", tmp_path)


STAND_IN = textwrap.dedent("""\
    import sys

    import pytest


    def mode_on():
        m = sys.modules.get("fastattn.torch")
        return m is not None and m.sdpa_enabled()


    class TestSDPACUDA:
        def test_same(self):
            pass

        def test_regresses(self):
            assert not mode_on(), "served where PyTorch's kernel ran"

        def test_fixed(self):
            assert mode_on()


    class TestSDPACudaOnlyCUDA:
        @pytest.mark.parametrize("i", range(200))
        def test_many(self, i):
            pass

        def test_cudnn_kept(self):
            pass
    """)


def _env(tmp_path, **extra):
    # expecttest (which PyTorch's test helpers import) stands in here: the stand-in needs none.
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "expecttest.py").write_text("")
    path = os.pathsep.join([str(tmp_path / "site"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, FASTATTN_TORCH_PATH="python", **extra)


def test_the_tool_runs_both_modes_and_compares_them(tmp_path):
    (tmp_path / "pt" / "2.11").mkdir(parents=True)
    (tmp_path / "pt" / "2.11" / "test_transformers.py").write_text(STAND_IN)
    out = tmp_path / "out"
    r = run_tool("--release", "2.11", "--test-dir", tmp_path / "pt", "--out", out, "--classes", "TestSDPACUDA",
                 "TestSDPACudaOnlyCUDA", "--sample", "0.1", "--timeout", "240", env=_env(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "REGRESSION TestSDPACUDA::test_regresses" in r.stdout
    assert "served where PyTorch's kernel ran" in r.stdout
    assert "fail off, pass on: 1\n  TestSDPACUDA::test_fixed" in r.stdout
    assert "test/test_transformers.py: sha256 " in r.stdout
    stats = json.loads((out / "stats-on.json").read_text())
    assert stats["mode"] == "on" and stats["kernels"] == "python"
    assert stats["sdpa"] == {"served": 0, "head_dim_padded": 0, "mask_grad": 0, "passed_on": {}}  # CPU tensors: the mode's kernels are CUDA's
    assert json.loads((out / "stats-off.json").read_text())["kernels"] is None
    summary = json.loads((out / "summary.json").read_text())
    # The same sample in both runs: about a tenth of 200, and the cuDNN test whatever the hash.
    assert summary["only_off"] == summary["only_on"] == []
    assert 5 < summary["off"]["passed"] - 2 < 45
    assert 'name="test_cudnn_kept"' in (out / "junit-on.xml").read_text()


def test_the_plugin_writes_the_mode_s_counts_without_a_gpu(tmp_path):
    """The mode on in a process without a GPU: it loads, the tests see it, and the stats
    file holds fastattn.stats()['sdpa'] (a CUDA call would be counted; CPU ones are not
    the mode's), whichever kernels it registered."""
    (tmp_path / "test_t.py").write_text(textwrap.dedent("""\
        import torch
        import fastattn.torch

        def test_mode_is_on():
            assert fastattn.torch.sdpa_enabled()
            q = torch.randn(1, 2, 4, 8)
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
        """))
    stats = tmp_path / "stats.json"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "sdpa_mode_plugin",
                        "--sdpa-mode", "on", "--sdpa-stats", str(stats), str(tmp_path / "test_t.py")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(_env(tmp_path), PYTHONPATH=os.pathsep.join([str(ROOT / "tools"), str(ROOT)])))
    assert r.returncode == 0, r.stdout + r.stderr
    body = json.loads(stats.read_text())
    assert body["mode"] == "on" and body["exitstatus"] == 0 and body["kernels"] == "python"
    assert body["sdpa"] == {"served": 0, "head_dim_padded": 0, "mask_grad": 0, "passed_on": {}}
    assert body["torch"] and body["fastattn"]


def test_the_sample_is_the_same_in_every_process(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import sdpa_mode_plugin as plugin
    finally:
        sys.path.remove(str(ROOT / "tools"))
    ids = [f"x.py::TestSDPACudaOnlyCUDA::test_{i}" for i in range(2000)]
    kept = [i for i in ids if plugin.kept(i, 0.05)]
    assert 50 < len(kept) < 150
    assert not any(plugin.kept(i, 0.0) for i in ids) and all(plugin.kept(i, 1.0) for i in ids)
    code = "import sys; sys.path.insert(0, sys.argv[1]); import sdpa_mode_plugin as p; " \
           "print(sum(p.kept(f'x.py::TestSDPACudaOnlyCUDA::test_{i}', 0.05) for i in range(2000)))"
    assert int(subprocess.check_output([sys.executable, "-c", code, str(ROOT / "tools")], text=True)) == len(kept)
    with pytest.raises(pytest.UsageError):
        plugin.parse_samples(["TestSDPACudaOnlyCUDA=2"])


def test_a_run_past_its_time_limit_stops_between_tests_and_exits_3(tmp_path):
    """Neither run starts a test after the limit, so each JUnit file holds only tests that
    ran to their end; the comparison covers the tests both finished."""
    (tmp_path / "pt" / "2.11").mkdir(parents=True)
    (tmp_path / "pt" / "2.11" / "test_transformers.py").write_text(textwrap.dedent("""\
        import time

        import pytest


        class TestSDPACUDA:
            @pytest.mark.parametrize("i", range(8))
            def test_slow(self, i):
                time.sleep(1.0)
        """))
    out = tmp_path / "out"
    r = run_tool("--release", "2.11", "--test-dir", tmp_path / "pt", "--out", out, "--classes", "TestSDPACUDA",
                 "--timeout", "2", env=_env(tmp_path))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "mode off: stopped at the time limit (2 s) with tests left" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert 1 <= summary["off"]["passed"] < 8 and summary["off"]["failed"] == 0
