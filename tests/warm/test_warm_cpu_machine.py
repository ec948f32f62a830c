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
