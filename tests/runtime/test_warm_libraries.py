"""fastattn.runtime.warm_libraries (FASTATTN_WARM_LIBRARIES): the libraries a first call
loads, loaded in a background thread when fastattn.torch is imported, without a GPU:
the loader and ctypes recorded."""

import ctypes
import threading

import pytest

from fastattn import _loader, runtime


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """ensure_loaded answering a cuDNN in tmp_path (with two of its sub-libraries there),
    ctypes.CDLL recording the paths it is given; a fresh once-per-process flag."""
    calls = []
    for name in ("libcudnn_graph.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_cnn.so.9"):
        (tmp_path / name).write_bytes(b"")
    libs = _loader.Libraries(cudnn=str(tmp_path / "libcudnn.so.9"), cudart="cudart", nvrtc="nvrtc",
                             cublaslt="cublaslt", cudnn_version=91900)
    monkeypatch.setattr(_loader, "ensure_loaded", lambda: calls.append("ensure_loaded") or libs)
    monkeypatch.setattr(ctypes, "CDLL", lambda path, *a, **kw: calls.append(path))
    monkeypatch.setattr(runtime, "_libraries_started", None)
    return calls, tmp_path


def _wait():
    runtime._libraries_started.join(10)
    assert not runtime._libraries_started.is_alive()


def test_it_loads_cudnn_then_the_graph_sub_libraries_there_once(recorded):
    calls, folder = recorded
    assert runtime.warm_libraries() is True
    _wait()
    assert runtime.warm_libraries() is False  # once per process
    # The loader first; then the graph API's sub-libraries that exist, in order; not the legacy cnn.
    assert calls == ["ensure_loaded", str(folder / "libcudnn_graph.so.9"),
                     str(folder / "libcudnn_engines_precompiled.so.9")]


def test_a_missing_library_is_left_to_the_first_call(recorded, monkeypatch):
    calls, _ = recorded

    def missing():
        raise _loader.LibraryError("fastattn cannot use the GPU")

    monkeypatch.setattr(_loader, "ensure_loaded", missing)
    assert runtime.warm_libraries() is True
    _wait()  # the thread ends quietly: nothing loaded, nothing raised
    assert calls == []


def test_a_sub_library_that_will_not_load_does_not_stop_the_others(recorded, monkeypatch):
    calls, folder = recorded

    def cdll(path, *a, **kw):
        calls.append(path)
        if path.endswith("graph.so.9"):
            raise OSError("bad ELF")

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    runtime.warm_libraries()
    _wait()
    assert calls[-1] == str(folder / "libcudnn_engines_precompiled.so.9")


def test_threads_racing_start_one_loader(recorded):
    calls, _ = recorded
    barrier = threading.Barrier(8)
    started = []

    def race():
        barrier.wait()
        started.append(runtime.warm_libraries())

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _wait()
    assert sorted(started) == [False] * 7 + [True] and calls.count("ensure_loaded") == 1


@pytest.mark.parametrize("setting,gpu,started", [("1", True, True), ("0", True, False), (None, True, False),
                                                 ("1", False, False)])
def test_importing_fastattn_torch_starts_it_where_a_gpu_is_visible_when_turned_on(monkeypatch, setting, gpu,
                                                                                      started):
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    import fastattn.torch as fat

    seen = []
    monkeypatch.setattr(runtime, "warm_libraries", lambda: seen.append(True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    if setting is None:
        monkeypatch.delenv("FASTATTN_WARM_LIBRARIES", raising=False)
    else:
        monkeypatch.setenv("FASTATTN_WARM_LIBRARIES", setting)
    fat._warm_libraries()
    assert bool(seen) == started
