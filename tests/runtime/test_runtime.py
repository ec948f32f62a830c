"""Errors, the loader and the in-memory registry, without a GPU.

The registry's single flight and verdict caching are tested with the build step
replaced by a fake, so they run everywhere; the GPU suite checks the same with real
cuDNN builds.
"""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import fastattn
from fastattn import AttentionConfig, bounded, errors, runtime

from helpers.paths import ROOT, TESTS

BASE = dict(batch=1, heads_q=4, seqlen_q=64, head_dim_qk=64)


# -- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code,cls,builtin",
    [
        (1, errors.InvalidArgumentError, ValueError),
        (2, errors.NotSupportedError, NotImplementedError),
        (3, errors.LibraryError, OSError),
        (4, errors.CudaError, RuntimeError),
        (5, errors.CudnnError, RuntimeError),
        (6, errors.CorruptPlanError, ValueError),
        (7, errors.InternalError, RuntimeError),
    ],
)
def test_status_codes_map_to_classes_that_inherit_builtins(code, cls, builtin):
    e = errors.error_for_code(code, "msg")
    assert type(e) is cls and isinstance(e, builtin) and isinstance(e, errors.FastAttnError)
    assert str(e) == "msg" and cls.code == code


def test_unknown_status_code_is_an_internal_error():
    e = errors.error_for_code(99, "boom")
    assert type(e) is errors.InternalError and "99" in str(e) and "boom" in str(e)


def test_error_codes_match_the_abi_headers_status_table():
    # fastattn_abi.h's table defines the codes (C++'s Code follows from it); errors.py's
    # classes carry the same ones. (_core reads the table too: tests/runtime/test_core.py.)
    import re

    header = (ROOT / "fastattn" / "include" / "fastattn_abi.h").read_text()
    table = dict(re.findall(r"X\(\w+, \w+, (\d+), (\w+)\)", header))
    assert {name: int(code) for code, name in table.items() if name != "None"} == {
        cls.__name__: code for code, cls in errors._BY_CODE.items()}


# -- import and the loader --------------------------------------------------------------


def _python(code: str, **env) -> subprocess.CompletedProcess:
    # Run from tests/, so `-c` puts no source checkout's unbuilt fastattn/ on sys.path.
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120, cwd=TESTS)


def test_import_loads_no_cuda_library():
    r = _python("""
        import sys, fastattn
        assert "fastattn._core" not in sys.modules, "import fastattn must not load the extension"
        maps = open("/proc/self/maps").read()
        for lib in ("libcudnn", "libcudart", "libcuda.so", "libcublas", "libnvrtc"):
            assert lib not in maps, lib
        print(fastattn.__version__, sorted(fastattn.__all__)[:3])
    """)
    assert r.returncode == 0, r.stderr


def test_versions_without_gpu_calls():
    v = fastattn.versions()
    assert v["fastattn"] == fastattn.__version__
    assert v["cudnn_frontend"].count(".") == 2 and v["cudnn_headers"] >= 90000


def test_wheel_libraries_load_without_cuda_pathfinder():
    # Importing cuda-pathfinder costs ~50 ms of cold start: the pip-wheel layout is
    # found without it. (On a machine without the driver the load stops there.)
    r = _python("""
        import sys, fastattn
        from fastattn import _loader
        for name in ("cublasLt", "nvrtc", "cudart", "cudnn"):
            assert _loader._from_wheels(name), name
        try:
            _loader.ensure_loaded()
        except fastattn.LibraryError:
            pass
        assert "cuda.pathfinder" not in sys.modules
        maps = open("/proc/self/maps").read()
        assert "libcublasLt.so.13" in maps and "libnvrtc.so.13" in maps and "libcudart.so.13" in maps
    """)
    assert r.returncode == 0, r.stderr


def test_missing_cudnn_is_a_clear_library_error():
    r = _python("""
        import fastattn
        try:
            fastattn.probe(dict(batch=1, heads_q=4, seqlen_q=64, head_dim_qk=64))
        except fastattn.LibraryError as e:
            assert isinstance(e, OSError)
            print(e)
        else:
            raise SystemExit("no error")
    """, FASTATTN_CUDNN_PATH="/nonexistent/libcudnn.so.9")
    assert r.returncode == 0, r.stderr
    assert "FASTATTN_CUDNN_PATH='/nonexistent/libcudnn.so.9'" in r.stdout


def test_missing_cublaslt_is_reported_before_cudnn_can_abort():
    # cuDNN aborts the process when it cannot load cuBLASLt; fastattn must refuse first.
    r = _python("""
        import fastattn
        try:
            fastattn.plan(dict(batch=1, heads_q=4, seqlen_q=64, head_dim_qk=64))
        except fastattn.LibraryError as e:
            print(e)
    """, FASTATTN_CUBLASLT_PATH="/nonexistent/libcublasLt.so.13")
    assert r.returncode == 0, r.stderr
    assert "FASTATTN_CUBLASLT_PATH='/nonexistent/libcublasLt.so.13' could not be loaded" in r.stdout


def _driver_present() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(_driver_present(), reason="this machine has the NVIDIA driver; the test is for machines without")
def test_no_driver_is_a_clear_library_error():
    with pytest.raises(fastattn.LibraryError) as e:
        fastattn.probe(AttentionConfig(**BASE))
    msg = str(e.value)
    assert "libcuda.so.1" in msg and "install the NVIDIA driver" in msg
    with pytest.raises(fastattn.LibraryError):
        fastattn.device_info()


def test_invalid_config_raises_before_any_library_is_needed():
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^batch=0"):
        fastattn.probe({**BASE, "batch": 0})
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^batch=0"):
        fastattn.plan({**BASE, "batch": 0})


# -- the registry, with a fake build --------------------------------------------------


class FakePlan:
    forward_workspace_size = 128
    backward_workspace_size = 0
    forward_engine = "fake_engine"
    backward_engine = None


@pytest.fixture
def fake_build(monkeypatch):
    """Replaces the cuDNN build with a slow fake that refuses head_dim_qk=1024 and
    fails (like a CUDA error would) for batch=13."""
    calls = []
    lock = threading.Lock()

    def build(config, device, refresh=False, touch=True):
        with lock:
            calls.append(config)
        time.sleep(0.05)
        if config.batch == 13:
            raise fastattn.CudaError("simulated CUDA failure")
        runtime._count(builds=1)
        if config.head_dim_qk == 1024:
            runtime._count(unsupported=1)
            return None, runtime.ProbeResult(config, device, False, "forward: cuDNN says no"), None
        return FakePlan(), runtime.ProbeResult(config, device, True, "", 128, 0, "fake_engine", "", 0.05, "built"), None

    monkeypatch.setattr(runtime, "_build", build)
    monkeypatch.setattr(runtime, "_resolve_device", lambda d: 0 if d is None else d)
    runtime.clear()
    yield calls
    runtime.clear()


def test_concurrent_requests_for_one_config_build_once(fake_build):
    barrier = threading.Barrier(16)
    results = []

    def worker():
        barrier.wait()
        results.append(fastattn.plan(dict(BASE)))

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_build) == 1 and len(results) == 16 and all(r is results[0] for r in results)
    s = fastattn.stats()
    assert s["builds"] == 1 and s["memory_hits"] == 15 and s["plans"] == 1


def test_devices_are_separate_entries(fake_build):
    fastattn.plan(dict(BASE), device=0)
    fastattn.plan(dict(BASE), device=1)
    assert len(fake_build) == 2


def test_refusal_is_remembered_and_plan_raises_with_the_reason(fake_build):
    refused = {**BASE, "head_dim_qk": 1024}
    r = fastattn.probe(refused)
    assert not r.supported and r.reason == "forward: cuDNN says no" and not r.cached and not bool(r)
    with pytest.raises(fastattn.NotSupportedError, match="^forward: cuDNN says no$"):
        fastattn.plan(refused)
    again = fastattn.probe(refused)
    assert again.cached and again.build_seconds == 0.0 and again.reason == r.reason
    assert len(fake_build) == 1 and fastattn.stats()["unsupported"] == 1


def test_probe_then_plan_is_one_build(fake_build):
    r = fastattn.probe(dict(BASE))
    assert r.supported and r.forward_workspace_size == 128 and r.forward_engine == "fake_engine"
    assert isinstance(fastattn.plan(dict(BASE)), FakePlan)
    assert len(fake_build) == 1
    d = r.to_dict()
    assert d["config"] == AttentionConfig(**BASE).to_dict() and d["supported"] is True


def test_a_failed_build_is_not_remembered_and_reaches_every_waiter(fake_build):
    barrier = threading.Barrier(4)
    errors_seen = []

    def worker():
        barrier.wait()
        try:
            fastattn.plan({**BASE, "batch": 13})
        except fastattn.CudaError as e:
            errors_seen.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors_seen) == 4
    assert fastattn.stats()["build_errors"] >= 1
    with pytest.raises(fastattn.CudaError):  # tried again, not served from memory
        fastattn.plan({**BASE, "batch": 13})
    assert len(fake_build) >= 2


def test_clear_forgets_plans(fake_build):
    fastattn.plan(dict(BASE))
    fastattn.clear()
    assert fastattn.stats()["plans"] == 0 and fastattn.stats()["builds"] == 0
    fastattn.plan(dict(BASE))
    assert len(fake_build) == 2


def test_fallbacks_are_counted_by_reason_and_each_message_logged_once_until_clear(monkeypatch, caplog):
    monkeypatch.setattr(runtime, "_fallbacks", {})
    monkeypatch.setattr(runtime, "_warned", bounded.Table("warnings"))
    with caplog.at_level("WARNING", logger="fastattn"):
        for reason in ("a", "b", "a", "a"):
            runtime.count_fallback("transformers", reason)
        runtime.warn_once("something else")
        runtime.warn_once("something else")
    assert fastattn.stats()["fallbacks"] == {"transformers": {"a": 3, "b": 1}}
    said = [r.getMessage() for r in caplog.records]
    assert said == ["fastattn.integrations.transformers: a call runs outside fastattn's kernels (counted in "
                    "fastattn.stats()['fallbacks']): a", said[0][:-1] + "b", "something else"]
    caplog.clear()
    fastattn.clear()  # counts and what was said are forgotten together
    with caplog.at_level("WARNING", logger="fastattn"):
        runtime.count_fallback("transformers", "a")
    assert fastattn.stats()["fallbacks"] == {"transformers": {"a": 1}} and len(caplog.records) == 1


# PyTorch's first backward with a gradient tensor imports sympy (torch.autograd's
# _make_grads): fastattn starts that import in the background when a training plan is
# looked up or preloaded. A fresh process: other tests may have imported it already.
_WARM = textwrap.dedent("""
    import sys, threading
    import fastattn
    from fastattn import runtime
    name = runtime.TORCH_BACKWARD_IMPORT
    assert runtime.warm_torch_backward() is False  # torch not imported: nothing to warm
    import torch
    assert name not in sys.modules, "importing torch now imports it: the warm-up is moot"
    assert runtime.warm_torch_backward() is True
    assert runtime.warm_torch_backward() is False  # once per process
    [t.join() for t in threading.enumerate() if t.name == "fastattn-torch-backward-import"]
    assert name in sys.modules
    print("ok")
""")


def test_torch_backward_import_is_started_once_in_the_background():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", _WARM], capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_preload_of_training_configs_warms_torch_backward_for_fastattn_torch_users(fake_build, monkeypatch):
    started = []
    monkeypatch.setattr(runtime, "warm_torch_backward", lambda: started.append(1))
    inference = AttentionConfig(batch=1, heads_q=2, seqlen_q=64, head_dim_qk=64)
    training = [inference, inference.replace(training=True)]
    monkeypatch.delitem(sys.modules, "fastattn.torch", raising=False)
    fastattn.preload(training)
    assert started == []  # raw plans only: no autograd, no import
    monkeypatch.setitem(sys.modules, "fastattn.torch", object())
    fastattn.preload([inference])
    assert started == []
    fastattn.preload(training)
    assert started == [1]
