"""Test setup: an isolated cache directory per session, and the `gpu` marker.

A test marked `gpu` is skipped only when this machine has no usable NVIDIA GPU or
no cuDNN, with the loader's reason. FASTATTN_REQUIRE_GPU=1 (set by tools/gpu_run.sh
on the GPU machine) turns that skip into a failure, so a broken loader there cannot
pass as "no GPU".
"""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    os.environ["FASTATTN_CACHE_DIR"] = str(tmp_path_factory.mktemp("fastattn-cache"))
    yield


@pytest.fixture(scope="session")
def lib():
    """fastattn.torch's op library, built against this torch and loaded (once: a process
    registers its operators once), for the CPU tests of the native path."""
    pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    from fastattn.torch import _native

    os.environ[_native.ENV] = "native"
    try:
        loaded = _native.library()
    finally:
        del os.environ[_native.ENV]
    assert loaded is not None
    return loaded


@pytest.fixture
def fake_workers(tmp_path, monkeypatch):
    """Worker processes (fastattn warm, matrix) that use tests/fake_core.py instead of
    cuDNN, through tests/fake_site/sitecustomize.py; a fresh cache directory."""
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("FASTATTN_TEST_FAKE_CORE", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (os.path.join(here, "fake_site"), here, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


@pytest.fixture
def env(tmp_path, monkeypatch):
    """The runtime on tests/fake_core.py (an H200 that builds everything) with a fresh
    cache directory, in this process: tmp_path."""
    import fake_core
    from fastattn import runtime

    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(runtime, "_core", lambda: fake_core)
    monkeypatch.setattr(fake_core, "GPU_NAME", ["NVIDIA H200"])
    runtime.clear()
    yield tmp_path
    runtime.clear()


_gpu_state = None


def _gpu_unavailable_reason():
    global _gpu_state
    if _gpu_state is None:
        import fastattn
        from fastattn import _core
        from fastattn._loader import ensure_loaded

        try:
            ensure_loaded()
            if _core.get_device_count() < 1:
                _gpu_state = "no CUDA device"
            else:
                _gpu_state = ""
        except (fastattn.LibraryError, fastattn.CudaError) as e:
            _gpu_state = str(e)
    return _gpu_state


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        return
    reason = _gpu_unavailable_reason()
    if reason:
        if os.environ.get("FASTATTN_REQUIRE_GPU") == "1":
            pytest.fail(f"FASTATTN_REQUIRE_GPU=1 but the GPU is unusable: {reason}")
        pytest.skip(f"no usable GPU: {reason}")
