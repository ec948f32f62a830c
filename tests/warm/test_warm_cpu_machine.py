"""`fastattn warm` (and the other commands) on a machine without a usable GPU: one exit
code whatever the file describes, the reason on stderr (stdout holds results only)."""

from __future__ import annotations

import json

import pytest

import fastattn
from fastattn import cli, runtime
from fastattn.errors import LibraryError

from helpers.cli import run

NO_GPU = "fastattn cannot use the GPU:\n  - fake: no GPU in this process"
ENTRY = {"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64}


@pytest.fixture
def no_gpu_here(fake_workers, monkeypatch):
    """No usable GPU stack, in this process and in warm's workers (tests/fake_core.py)."""
    def no_core():
        raise LibraryError(NO_GPU)

    monkeypatch.setenv("FAKE_NO_GPU", "1")
    monkeypatch.setattr(runtime, "_core", no_core)
    runtime.clear()
    yield fake_workers
    runtime.clear()


def _file(folder, configs) -> str:
    path = folder / "w.json"
    path.write_text(json.dumps({"configs": configs}))
    return str(path)


# -- one exit code for every warm without a GPU ---------------------------------------------------


@pytest.mark.parametrize("configs", [[], [ENTRY]], ids=["no config", "one config"])
def test_warm_without_a_gpu_is_exit_3_whatever_the_file_holds(no_gpu_here, capsys, configs):
    # An empty `configs` list was exit 0 without a GPU (no worker was asked, so nothing
    # said there was none), where every other warm there is exit 3.
    code, out, err = run(["warm", _file(no_gpu_here, configs), "--no-torch-ops"], capsys)
    assert code == cli.EXIT_NO_GPU, (out, err)
    assert "no usable GPU" in err and "LibraryError: fastattn cannot use the GPU" in err and "fake: " in err, err
    code, out, _ = run(["warm", _file(no_gpu_here, configs), "--no-torch-ops", "--json"], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_NO_GPU and body["no_gpu"].startswith("LibraryError: fastattn cannot use the GPU"), body


def test_warm_of_no_config_with_a_gpu_is_exit_0(fake_workers, capsys, monkeypatch):
    import fake_core

    monkeypatch.setattr(runtime, "_core", lambda: fake_core)  # this process's GPU: tests/fake_core.py's
    runtime.clear()
    code, out, err = run(["warm", _file(fake_workers, []), "--no-torch-ops", "--json"], capsys)
    assert code == cli.EXIT_OK and json.loads(out)["no_gpu"] is None, (out, err)
    runtime.clear()


# -- diagnostics on stderr, on every command --------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["warm", "--no-torch-ops"],
    ["matrix", "--head-dims", "64", "--masks", "none"],
    ["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "64", "--head-dim-qk", "64"],
    ["cache", "verify", "--load"],
    ["cache", "push"],
], ids=lambda argv: " ".join(argv[:2]))
def test_no_usable_gpu_is_said_on_stderr_by_every_command(no_gpu_here, capsys, monkeypatch, argv):
    # matrix and warm printed "no usable GPU" on stdout, probe on stderr.
    monkeypatch.setenv("FASTATTN_REMOTE_CACHE", "redis://127.0.0.1:1")  # (push: a remote tier to push to,
    monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")  # taken without a signing secret)
    code, out, err = run(argv, capsys)
    assert code == cli.EXIT_NO_GPU, (out, err)
    assert "GPU" in err and "GPU" not in out, (out, err)


def test_a_command_that_could_not_do_its_work_prints_nothing_on_stdout(cache_dir, capsys, monkeypatch):
    # `cache import` into a directory that cannot be written said why on stderr and
    # "failed: the cache cannot be written" on stdout.
    from fastattn.store import bundle

    def cannot_write(*a, **k):
        raise bundle.BundleWriteError("the cache directory cannot be written (a test's stand-in)")

    monkeypatch.setattr(bundle, "import_bundle", cannot_write)
    path = cache_dir / "b.tgz"
    path.write_bytes(b"")
    code, out, err = run(["cache", "import", str(path), "--force"], capsys)
    assert code == cli.EXIT_FAILED and out == "" and "cannot be written" in err, (out, err)


# -- what needs no GPU is built without one: fastattn.torch's op library ------------------------------


def _op_library_build(monkeypatch, result):
    """warm's op library step answering `result`; the calls it got."""
    from fastattn.cli import warm as warm_cli

    started = []
    monkeypatch.setattr(warm_cli, "_build_torch_ops", lambda: started.append(1) or dict(result))
    return started


def test_warm_without_a_gpu_builds_the_op_library_and_says_plans_need_the_gpu(no_gpu_here, capsys, monkeypatch):
    # It was "torch op library: not built: no usable GPU": the library needs a compiler
    # and torch's headers, no GPU, and a deploy's image is built on a machine without one.
    started = _op_library_build(monkeypatch, {"ok": True, "path": "/x/ops.so", "result": "/x/ops.so (1.0 s)"})
    code, out, err = run(["warm", _file(no_gpu_here, [ENTRY]), "--torch-ops"], capsys)
    assert code == cli.EXIT_NO_GPU and started == [1], (out, err)
    assert out.strip() == "torch op library: /x/ops.so (1.0 s)", out  # the result: stdout
    assert "plans need the GPU" in err and "no usable GPU" in err, err
    code, out, _ = run(["warm", _file(no_gpu_here, []), "--torch-ops", "--json"], capsys)
    assert code == cli.EXIT_NO_GPU and started == [1, 1] and json.loads(out)["torch_ops"]["ok"] is True


def test_warm_without_a_gpu_whose_op_library_fails_is_exit_4(no_gpu_here, capsys, monkeypatch):
    # Without a GPU the op library is all warm can build: exit 3 says it is built (or not
    # asked for), so that a Dockerfile can rely on it; its failure is exit 4.
    _op_library_build(monkeypatch, {"ok": False, "result": "not built (RuntimeError: no C++ compiler)"})
    code, out, err = run(["warm", _file(no_gpu_here, [ENTRY]), "--torch-ops"], capsys)
    assert code == cli.EXIT_FAILED, (out, err)
    assert "torch op library: not built (RuntimeError: no C++ compiler)" in out and "no usable GPU" in err
    code, _, _ = run(["warm", _file(no_gpu_here, [ENTRY]), "--no-torch-ops"], capsys)
    assert code == cli.EXIT_NO_GPU


def test_warm_builds_the_op_library_that_a_process_of_this_environment_then_loads_without_compiling(
        op_library, tmp_path):
    # The real build (tests/conftest.py's op_library: `fastattn warm` of no config in a
    # process of its own), on this machine: in CI one without a GPU. The suite builds the
    # library once, there; the native path's CPU tests (the `lib` fixture) load that build.
    import os
    import subprocess
    import sys

    from conftest import _gpu_unavailable_reason

    code, body, folder, fresh = op_library
    assert body.get("torch_ops", {}).get("ok") is True, body
    assert code == (cli.EXIT_NO_GPU if _gpu_unavailable_reason() else cli.EXIT_OK), (code, body)
    if fresh:
        assert "built before" not in body["torch_ops"]["result"], body
    # A process of the same environment (on a GPU machine, the deployment) takes the
    # native path with nothing to compile: there is no compiler at all in it.
    script = ("from fastattn.torch import _native\n"
              "assert _native.library() is not None, _native._state\n"
              "print(_native._state['reason'])\n")
    env = {**os.environ, "FASTATTN_TORCH_OPS_DIR": folder, "FASTATTN_TORCH_PATH": "auto", "CXX": "/nonexistent/c++"}
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.startswith(f"native: {folder}"), (r.stdout, r.stderr[-2000:])


# -- `fastattn info`'s advice works on the machine it runs on -------------------------------------------


@pytest.mark.parametrize("missing", ["compiler", "python headers", None])
def test_info_advises_what_works_here_to_get_the_op_library(capsys, monkeypatch, tmp_path, missing):
    # It advised `fastattn warm` to build the library where that could not (no GPU:
    # warm skipped it; no compiler: warm fails to build it).
    pytest.importorskip("torch", reason="PyTorch is an optional extra")
    from fastattn.torch import _native

    monkeypatch.setattr(_native, "_state", {})  # undecided in this process, whatever ran before
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FASTATTN_TORCH_OPS_DIR", raising=False)
    monkeypatch.setenv("FASTATTN_TORCH_PATH", "auto")
    if missing == "compiler":
        monkeypatch.setenv("CXX", "/nonexistent/c++")
    elif missing == "python headers":
        monkeypatch.setattr(_native, "_python_include", lambda: str(tmp_path / "no-headers"))
    code, out, _ = run(["info", "--json"], capsys)
    reason = json.loads(out)["torch"]["reason"]
    assert code == cli.EXIT_OK and "not built for this torch yet" in reason, reason
    if missing is None:  # a compiler and the headers: warm builds it, here, with or without a GPU
        assert "`fastattn warm` builds it" in reason and "no GPU" in reason, reason
    else:
        assert "`fastattn warm` builds it" not in reason and "cannot be built here" in reason, reason
        assert {"compiler": "no C++ compiler (CXX='/nonexistent/c++')",
                "python headers": "Python's headers"}[missing] in reason, reason
        assert "FASTATTN_TORCH_OPS_DIR" in reason, reason  # or a library built elsewhere, copied in


# -- the op library's build: a unit per core ------------------------------------------------------------


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_only_units_without_per_call_work_compile_at_O1(cores):
    # -O1 saves seconds on pybind11's header code in ops.cpp and python.cpp alone; a unit that
    # batches them with eager.cpp (fewer cores) holds the per-call path and keeps -O2.
    from fastattn import _opslib

    flags = {unit: _opslib.optimization(unit) for unit in _opslib.units(cores)}
    assert set(flags.values()) <= {"-O1", "-O2"}
    for unit, flag in flags.items():
        assert flag == ("-O1" if set(unit) <= set(_opslib.LIGHT) else "-O2"), unit
    assert ("-O1" in flags.values()) == (cores >= len(_opslib.NAMES))
    assert _opslib.optimization(("/abs/path/profile_eager.cpp",)) == "-O2"  # (a tool's EXTRA source)


@pytest.mark.parametrize("cores", [1, 2, 3, 5, 6, 16, 128])
def test_the_op_librarys_sources_compile_in_as_many_units_as_help_on_the_cores_there_are(cores):
    # Two units whatever the machine: a 16-core one waited for the slower batch where its
    # slowest source alone takes less (docs/history/benchmarks-log.md, "The op library's build").
    from fastattn import _opslib

    units = _opslib.units(cores)
    sources = [p.name for p in _opslib.SOURCES] + list(_opslib.GENERATED)
    assert sorted(n for unit in units for n in unit) == sorted(sources)
    assert [n for unit in units for n in unit] == list(_opslib.NAMES)  # the link order stays
    if cores >= len(sources):
        assert len(units) == len(sources)
    else:  # sources batched by the headers they share: parsed once per unit
        assert units == _opslib.BATCHES and len(units) <= max(2, cores)
