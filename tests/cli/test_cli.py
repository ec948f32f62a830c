"""The fastattn command: argument and config errors, exit codes, JSON output."""

import json
import os
import subprocess
import sys

import pytest

from fastattn import cli, runtime

from conftest import _gpu_unavailable_reason
from helpers.paths import ROOT, TESTS

PROBE = ["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "128", "--head-dim-qk", "64"]


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_missing_flags_are_named_as_flags_all_at_once(capsys):
    code, out, err = run(["probe", "--batch", "1"], capsys)
    assert code == cli.EXIT_BAD_INPUT and "missing --heads-q, --seqlen-q, --head-dim-qk (required" in err
    code, out, err = run(["probe"], capsys)
    assert code == cli.EXIT_BAD_INPUT and "missing --batch, --heads-q, --seqlen-q, --head-dim-qk (required" in err
    assert "Traceback" not in out + err


def _subcommands():
    from fastattn.cli._main import build_parser

    top = build_parser()._subparsers._group_actions[0]
    for name, parser in top.choices.items():
        subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        if subs:
            yield from ([name, sub] for sub in subs[0].choices)
        else:
            yield [name]


@pytest.mark.parametrize("argv", list(_subcommands()), ids=" ".join)
def test_every_subcommands_help_describes_it_and_its_exit_codes(capsys, argv):
    # `fastattn info --help` had neither: a usage line and its flags.
    code, out, _ = run(argv + ["--help"], capsys)
    assert code == cli.EXIT_OK
    body = out.split("\n\n", 1)[1]  # (after the usage lines)
    assert not body.startswith(("options:", "positional arguments:")), out
    description = " ".join(body.split("\n\n", 1)[0].split())
    assert "Exit code" in description, out


def test_help_marks_the_required_flags(capsys):
    code, out, _ = run(["probe", "--help"], capsys)
    assert code == cli.EXIT_OK
    section = out[out.index("required config fields"):]
    for flag in ("--batch", "--heads-q", "--seqlen-q", "--head-dim-qk"):
        assert f"{flag} N" in section.split("other config fields")[0]
    assert "--heads-kv" in section.split("other config fields")[1]


def test_invalid_value_names_the_field(capsys):
    code, out, err = run(PROBE + ["--heads-kv", "3", "--json"], capsys)
    assert code == cli.EXIT_BAD_INPUT
    body = json.loads(out)
    assert body["error"] == "InvalidArgumentError" and body["message"].startswith("heads_kv=3")


def test_unknown_choice_is_bad_input(capsys):
    code, out, err = run(PROBE + ["--mask", "diagonal"], capsys)
    assert code == cli.EXIT_BAD_INPUT and "invalid choice: 'diagonal'" in err and not out


def test_config_file_errors_point_at_the_file(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    code, _, err = run(["probe", "--config", str(missing)], capsys)
    assert code == cli.EXIT_BAD_INPUT and str(missing) in err and "no such file, and not JSON text" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"batch": 1,\n "heads_q": }')
    code, _, err = run(["probe", "--config", str(bad)], capsys)
    assert code == cli.EXIT_BAD_INPUT and f"{bad}:2:" in err and "not valid JSON" in err
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64, "seq_len": 3}')
    code, _, err = run(["probe", "--config", str(unknown)], capsys)
    assert code == cli.EXIT_BAD_INPUT and "seq_len=3: is not a field" in err


def test_flags_override_the_config_file(tmp_path, capsys, monkeypatch):
    seen = {}

    def fake_probe(cfg, device=None, verify=False):
        seen["cfg"] = cfg
        from fastattn.runtime import ProbeResult

        return ProbeResult(cfg, 0, False, "forward: no")

    monkeypatch.setattr(runtime, "probe", fake_probe)
    f = tmp_path / "c.json"
    f.write_text('{"batch": 4, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64, "mask": "causal"}')
    code, out, _ = run(["probe", "--config", str(f), "--batch", "2", "--window", "16", "0", "--training", "--padding",
                        "--json"], capsys)
    assert code == cli.EXIT_UNSUPPORTED
    assert seen["cfg"].batch == 2 and seen["cfg"].mask == "causal" and seen["cfg"].window == (16, -1)
    assert seen["cfg"].training is True and seen["cfg"].padding is True
    assert json.loads(out)["reason"] == "forward: no"


def test_probe_exit_code_matches_the_machine(capsys):
    code, out, err = run(PROBE + ["--json"], capsys)
    if _gpu_unavailable_reason():
        assert code == cli.EXIT_NO_GPU and json.loads(out)["error"] == "LibraryError"
    else:
        assert code == cli.EXIT_OK and json.loads(out)["supported"] is True


def test_info_reports_versions_everywhere(capsys):
    code, out, _ = run(["info", "--json"], capsys)
    body = json.loads(out)
    assert body["versions"]["fastattn"] and body["versions"]["cudnn_frontend"]
    if _gpu_unavailable_reason():  # a report of the machine: without a GPU it says why, and is done (exit 0)
        assert code == cli.EXIT_OK and body["device"] is None
        assert "libcuda" in body["gpu_error"] or "cudnn" in body["gpu_error"].lower()
    else:
        assert code == cli.EXIT_OK and body["device"]["sm_count"] > 0


@pytest.mark.parametrize("env,path,reason", [
    ({"FASTATTN_TORCH_PATH": "python"}, "python", "FASTATTN_TORCH_PATH=python"),
    ({"FASTATTN_TORCH_PATH": "auto", "CXX": "/nonexistent/c++"}, "python", "not built for this torch yet"),
    ({"FASTATTN_TORCH_PATH": "auto"}, "python", "`fastattn warm` builds it"),
    ({"FASTATTN_TORCH_PATH": "native", "CXX": "/nonexistent/c++"}, "none", "there is no C++ compiler"),
])  # a bad FASTATTN_TORCH_PATH is bad input for info, as every bad value is: tests/runtime/test_env.py
def test_info_says_which_torch_path_runs_and_why(capsys, monkeypatch, tmp_path, env, path, reason):
    pytest.importorskip("torch", reason="PyTorch is an optional extra")
    from fastattn.torch import _native

    monkeypatch.setattr(_native, "_state", {})  # undecided in this process, whatever ran before
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))  # no library built there
    monkeypatch.delenv("FASTATTN_TORCH_OPS_DIR", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _, out, _ = run(["info", "--json"], capsys)
    body = json.loads(out)["torch"]
    assert body["path"] == path and reason in body["reason"], body
    assert not (tmp_path / "torch-ops").exists()  # info builds nothing


@pytest.mark.parametrize("cxx,ok,result", [("false", False, "compiling ops.cpp"),
                                           ("/nonexistent/c++", False, "no C++ compiler")])
def test_warm_torch_ops_reports_a_failed_build_without_failing(capsys, monkeypatch, tmp_path, cxx, ok, result):
    # The plans are what warm is for: a library that cannot be built is reported (the
    # Python path runs there), and the exit code is the plans' own.
    pytest.importorskip("torch", reason="PyTorch is an optional extra")
    import fastattn.warm
    from fastattn.warm import WarmReport

    _fake_warm(monkeypatch, tmp_path)
    monkeypatch.setenv("CXX", cxx)
    code, out, _ = run(["warm", "--torch-ops", "--json"], capsys)
    body = json.loads(out)["torch_ops"]
    assert body["ok"] is ok and result in body["result"], body
    assert code == run(["warm", "--no-torch-ops", "--json"], capsys)[0]


def _fake_warm(monkeypatch, tmp_path):
    """warm() answering no configs, a GPU check that passes, an empty cache directory."""
    import fastattn.warm
    from fastattn.cli import warm as warm_cli
    from fastattn.warm import WarmReport

    monkeypatch.setattr(fastattn.warm, "warm", lambda *a, **k: WarmReport([], 0.0, 1, {
        "loaded": 0, "built": 0, "unsupported": 0, "failed": 0}, 0))
    monkeypatch.setattr(warm_cli, "_gpu_problem", lambda device: None)
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FASTATTN_TORCH_OPS_DIR", raising=False)


@pytest.mark.parametrize("argv,env,builds", [
    ([], {}, True),  # the README's `fastattn warm`: where torch is installed, the op library too
    (["--no-torch-ops"], {}, False),
    ([], {"FASTATTN_TORCH_PATH": "python"}, False),
    (["--torch-ops"], {"FASTATTN_TORCH_PATH": "python"}, True),
])
def test_warm_builds_the_torch_op_library_by_default(capsys, monkeypatch, tmp_path, argv, env, builds):
    pytest.importorskip("torch", reason="PyTorch is an optional extra")
    _fake_warm(monkeypatch, tmp_path)
    monkeypatch.setenv("CXX", "false")  # a failing compiler: fast, and reported, not fatal
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, _ = run(["warm", "--json", *argv], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_OK
    assert ("torch_ops" in body) is builds, body.get("torch_ops")
    if builds:
        assert "compiling ops.cpp" in body["torch_ops"]["result"]  # (+ eager.cpp, where it shares ops.cpp's unit)


_FIND_BUILT = """
import sys
from fastattn import _opslib
from fastattn.cli import warm
path = _opslib.library_path(_opslib.tag(sys.argv[1], int(sys.argv[2])))
assert _opslib.find_built() is None
path.parent.mkdir(parents=True)
path.write_bytes(b"")
result = warm._build_torch_ops()
assert result["ok"] and result["path"] == str(path) and "built before" in result["result"], result
assert "torch" not in sys.modules  # found without importing torch
print("ok")
"""


def test_a_second_warm_finds_the_op_library_without_importing_torch(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra")

    env = dict(os.environ, FASTATTN_TORCH_OPS_DIR=str(tmp_path / "ops"))
    r = subprocess.run([sys.executable, "-c", _FIND_BUILT, str(torch.__version__),  # what a build's tag holds
                        str(int(torch._C._GLIBCXX_USE_CXX11_ABI))], capture_output=True, text=True, timeout=120,
                       env=env, cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_torch_version_is_read_without_importing_torch_even_without_metadata(tmp_path):
    """A torch with no dist-info (built from source, copied into an image): its
    version.py still names it, as torch.__version__ would."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (fake / "version.py").write_text("__version__ = '9.9.9+fake'\ngit_version = 'x'\n")
    code = "import sys; from fastattn import _opslib; print(_opslib.torch_version(), 'torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.split() == ["9.9.9+fake", "False"], r.stderr[-2000:]


def test_python_dash_m_in_a_source_tree_says_it_shadows_the_installed_package(tmp_path):
    # `python -m fastattn info` in the cloned repository (after `pip install .`) imported
    # the checkout, which has no built extension: "a bug in fastattn (ImportError:
    # cannot import name '_core' ...)", exit 5.
    import shutil

    import fastattn

    installed = os.path.dirname(fastattn.__file__)
    checkout = tmp_path / "repo"
    shutil.copytree(installed, checkout / "fastattn", ignore=shutil.ignore_patterns("_core.*.so", "_core*.pyd",
                                                                                   "__pycache__"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(installed),
                                                                  os.environ.get("PYTHONPATH")) if p))
    for argv in (["info"], ["info", "--json"], PROBE):
        r = subprocess.run([sys.executable, "-m", "fastattn", *argv], capture_output=True, text=True, timeout=120,
                           cwd=checkout, env=env)
        assert r.returncode == cli.EXIT_NO_GPU, (argv, r.stdout, r.stderr)
        said = json.loads(r.stdout)["message"] if "--json" in argv else r.stderr
        assert len(said.strip().splitlines()) == 1 and "bug" not in said, said
        assert f"{checkout / 'fastattn'}, a source tree without its compiled extension, which shadows the " \
               f"fastattn installed in {installed}" in said, said


def test_a_checkout_without_an_installed_fastattn_says_to_build_it(monkeypatch, tmp_path):
    from fastattn import _loader

    monkeypatch.setattr(_loader, "_built_core", lambda folder: None)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    said = _loader.core_problem(ImportError("cannot import name '_core'"))
    assert "compiled extension (_core) is not built in" in said and "pip install" in said


def test_python_dash_m_runs():
    # From tests/, not the checkout root: its fastattn/ is unbuilt.
    r = subprocess.run([sys.executable, "-m", "fastattn", "--help"], capture_output=True, text=True, timeout=60, cwd=TESTS)
    assert r.returncode == 0 and "probe" in r.stdout and "info" in r.stdout


@pytest.mark.parametrize("version,names", [(91900, []), (92400, ["sm90-rebuild-bits"])])
def test_info_says_what_the_loaded_cudnn_is_known_to_do(capsys, env, monkeypatch, version, names):
    import fake_core
    from fastattn import runtime

    real = runtime.versions
    # (on a machine without a GPU the extension loads no cuDNN: the fake's libraries and version here)
    monkeypatch.setattr(runtime, "libraries", lambda: {"cudnn": "fake"})
    monkeypatch.setattr(runtime, "cudnn_in_process", lambda: {"problem": None})
    monkeypatch.setattr(runtime, "versions", lambda: {**real(), "cudnn_loaded": fake_core.CUDNN_VERSION[0]})
    monkeypatch.setattr(fake_core, "CUDNN_VERSION", [version])
    code, out, _ = run(["info", "--json"], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_OK and body["versions"]["cudnn_loaded"] == version, body["versions"]
    assert [n.split(":")[0].rsplit(" ", 1)[-1] for n in body["cudnn_notes"]] == names
    code, out, _ = run(["info"], capsys)
    assert code == cli.EXIT_OK and ("sm90-rebuild-bits" in out) == bool(names)
