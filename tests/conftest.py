"""Test setup: an isolated cache directory per session, and the `gpu` marker.

tests/<area>/ holds an area's CPU tests (test_<topic>.py) and its GPU tests
(test_<topic>_gpu.py). Every test in a *_gpu.py file is marked `gpu` here, by its file's
name, and no test elsewhere may be: `pytest tests -m gpu` selects exactly those files.

A test marked `gpu` is skipped only when this machine has no usable NVIDIA GPU or
no cuDNN, with the loader's reason. FASTATTN_REQUIRE_GPU=1 (set by tools/gpu_run.sh
on the GPU machine) turns that skip into a failure, so a broken loader there cannot
pass as "no GPU".
"""

import os

import pytest

# The warm-up that importing fastattn.torch starts (fastattn/_warm_up.py) would load plans
# into the runtime beside the tests' own calls and counters: off, for this process and the
# processes the tests start; tests/runtime/test_warm_up.py turns it on where it is the subject.
os.environ["FASTATTN_WARM_UP"] = "off"


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    os.environ["FASTATTN_CACHE_DIR"] = str(tmp_path_factory.mktemp("fastattn-cache"))
    yield


@pytest.fixture(scope="session")
def op_library(tmp_path_factory):
    """fastattn.torch's op library as a deploy's image build makes it: `fastattn warm` of
    no config, in a process of its own, on this machine (with or without a GPU). Returns
    (its exit code, its --json report, the library's directory, whether that directory
    was fresh). The directory: FASTATTN_TORCH_OPS_DIR where it is set (a library kept
    for test sessions, tools/gpu_run.sh), else a new one, so that the suite builds the
    library once, here, and the `lib` fixture loads that build."""
    import json
    import subprocess
    import sys

    pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    from fastattn import env as _env

    given = _env.get("FASTATTN_TORCH_OPS_DIR")
    folder = given or str(tmp_path_factory.mktemp("torch-ops"))
    work = tmp_path_factory.mktemp("op-library-warm")
    (work / "none.json").write_text('{"configs": []}')
    r = subprocess.run([sys.executable, "-m", "fastattn", "warm", "none.json", "--torch-ops", "--json"],
                       cwd=work, env={**os.environ, "FASTATTN_TORCH_OPS_DIR": folder}, capture_output=True,
                       text=True, timeout=1200)
    try:
        body = json.loads(r.stdout)
    except ValueError:
        body = {"stdout": r.stdout, "stderr": r.stderr[-4000:]}
    return r.returncode, body, folder, not given


@pytest.fixture(scope="session")
def lib(op_library):
    """fastattn.torch's op library, built against this torch (by `fastattn warm`: the
    op_library fixture) and loaded (once: a process registers its operators once), for
    the CPU tests of the native path."""
    from fastattn.torch import _native

    if _native._state.get("lib", False) is None:
        _native.reset()  # an earlier test decided on the Python path (auto mode, not built): nothing is loaded
    saved = {name: os.environ.get(name) for name in (_native.ENV, "FASTATTN_TORCH_OPS_DIR")}
    os.environ.update({_native.ENV: "native", "FASTATTN_TORCH_OPS_DIR": op_library[2]})
    try:
        loaded = _native.library()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    assert loaded is not None
    return loaded


@pytest.fixture(scope="session")
def readers(tmp_path_factory):
    """The op library's argument readers (fastattn/torch/csrc/readers.h and the readers
    generated from _specs.CALLS) in an extension of the tests' own,
    tests/pytorch/csrc/readers.cpp, compiled by the op library's compiler line against
    this build's generated headers: read_call, read_varlen_call, check_varlen_tensors."""
    import importlib.machinery
    import subprocess
    from pathlib import Path

    pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    from fastattn.torch import _native

    folder = tmp_path_factory.mktemp("readers")
    generated = _native.write_generated(folder / "generated")
    name = "fastattn_readers_for_tests"
    # readers.h's tensors come through python.h, whose functions python.cpp defines.
    sources = (Path(__file__).parent / "pytorch" / "csrc" / "readers.cpp", _native.CSRC / "python.cpp")
    objects = [folder / (source.stem + ".o") for source in sources]
    library = folder / (name + importlib.machinery.EXTENSION_SUFFIXES[0])
    for cmd in (*(_native.compile_command(s, o, name, generated) for s, o in zip(sources, objects)),
                _native.link_command(objects, library)):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, (done.stderr or done.stdout)[-4000:]
    return _native._import(library)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache directory under tmp_path, no remote tier, the runtime cleared: tmp_path."""
    from fastattn import runtime

    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FASTATTN_REMOTE_CACHE", raising=False)
    runtime.clear()
    yield tmp_path
    runtime.clear()


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a command starts probing, warming or looking for a GPU: a
    refusal of its input must come first."""
    import fastattn.warm
    from fastattn import runtime

    def refuse(*a, **k):
        raise AssertionError("the command started work before refusing its input")

    monkeypatch.setattr(fastattn.warm, "warm", refuse)
    monkeypatch.setattr(runtime, "probe", refuse)
    monkeypatch.setattr(runtime, "_core", refuse)


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
    monkeypatch.setattr(runtime, "_verify", fake_core.verify)
    monkeypatch.setattr(fake_core, "GPU_NAME", ["NVIDIA H200"])
    runtime.clear()
    yield tmp_path
    runtime.clear()


_gpu_state = None


def _gpu_unavailable_reason():
    global _gpu_state
    if _gpu_state is None:
        import fastattn
        from fastattn._loader import ensure_loaded, import_core

        try:
            # (import_core: a source tree without its extension, as a checkout run with
            # `python -m pytest` imports, is a LibraryError that says so, not an ImportError)
            _core = import_core()
            ensure_loaded()
            if _core.get_device_count() < 1:
                _gpu_state = "no CUDA device"
            else:
                _gpu_state = ""
        except (fastattn.LibraryError, fastattn.CudaError) as e:
            _gpu_state = str(e)
    return _gpu_state


def pytest_sessionstart(session):
    """Names the cuDNN this run tests, first thing in its output (also under -q, which hides
    pytest's header): where the GPU is usable, the library fastattn loaded (after PyTorch,
    where installed, loaded its own, as in a user's process), the one PyTorch reports, and
    whether the process holds one cuDNN. A run meant for another cuDNN than the machine's
    can never pass as a run of the machine's."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in _cudnn_lines():
            reporter.write_line(line)


def _cudnn_lines() -> list[str]:
    try:
        import torch
    except ImportError:
        torch = None
    reason = _gpu_unavailable_reason()
    if reason:
        return [f"fastattn: no usable GPU ({reason.splitlines()[-1].strip(' -')})"]
    from fastattn import _loader, runtime

    libs, v = _loader.ensure_loaded(), runtime.versions()
    line = (f"fastattn: cuDNN {_loader.version_text(v['cudnn_loaded'])} from {libs.cudnn} (built against cuDNN {v['cudnn_headers']} "
            f"headers, cudnn-frontend {v['cudnn_frontend']})")
    if torch is not None and torch.cuda.is_available():
        line += f"; torch {torch.__version__} on cuDNN {_loader.version_text(int(torch.backends.cudnn.version()))}"
    files = _loader.mapped_cudnn()
    return [line, f"fastattn: {_loader.cudnn_copies_problem(files) or 'one cuDNN in this process: ' + ' '.join(files)}"]


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        return
    reason = _gpu_unavailable_reason()
    if reason:
        from fastattn import env as _env

        if _env.get("FASTATTN_REQUIRE_GPU"):
            pytest.fail(f"FASTATTN_REQUIRE_GPU=1 but the GPU is unusable: {reason}")
        pytest.skip(f"no usable GPU: {reason}")


def _cuda_state_problem():
    """What is wrong with this process's CUDA state after a GPU test, or None: a capture
    left open, a sticky CUDA error, or PyTorch's CUDA generator stuck in capture state
    (then every later torch.randn fails with "Offset increment outside graph capture")."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        try:
            if torch.cuda.is_current_stream_capturing():
                return "a CUDA graph capture is still open on the current stream"
            torch.cuda.synchronize()
            torch.empty(1, device="cuda").normal_()  # advances the generator's Philox offset
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (any failure here is the finding)
            return f"{type(e).__name__}: {e}"
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return None
    err = rt.cudaDeviceSynchronize()[0]
    if int(err) != 0:
        return f"cudaDeviceSynchronize: {rt.cudaGetErrorName(err)[1].decode()}"
    return None


def _kept_lengths_problem():
    """fastattn's kept full-length tensors (each key's last word is the length every element
    holds) that no longer hold it, or None: a stray write into one changes only the calls
    that read it (an intermittent failure of a paged decode under CUDA-graph capture, seen once
    on the H200 in a shuffled order, had this as a suspect)."""
    import sys

    found = []
    for name in ("fastattn.torch._paged", "fastattn.integrations.flash._common"):
        module = sys.modules.get(name)
        for key, t in list(getattr(module, "_full_lengths", {}).items()):
            try:
                values = t.tolist()
            except Exception:  # noqa: BLE001 - a broken CUDA state: _cuda_state_stays_healthy reports it
                return None
            if any(v != key[-1] for v in values):
                found.append(f"{name}._full_lengths[{key}] = {values}")
    return "; ".join(found) or None


@pytest.fixture(autouse=True)
def _kept_lengths_stay_whole(request):
    """After each GPU test: fastattn's kept length tensors still hold their lengths, or
    this test fails naming them (the test that wrote into one is this one or, if it ran on
    another stream's time, the one before)."""
    yield
    if request.node.get_closest_marker("gpu") is None or _gpu_state != "":
        return
    problem = _kept_lengths_problem()
    if problem:
        import sys

        for name in ("fastattn.torch._paged", "fastattn.integrations.flash._common"):
            getattr(sys.modules.get(name), "_full_lengths", {}).clear()  # reported once: the next tests start whole
        pytest.fail(f"a kept length tensor changed during this test: {problem}", pytrace=False)


@pytest.fixture(autouse=True)
def _cuda_state_stays_healthy(request):
    """After each GPU test: the CUDA context and PyTorch's generator are healthy, or that
    test fails with the reason and the run stops (one broken test must not turn into
    hundreds of unrelated failures after it)."""
    yield
    if request.node.get_closest_marker("gpu") is None or _gpu_state != "":
        return
    problem = _cuda_state_problem()
    if problem:
        request.session.shouldstop = f"CUDA state broken by {request.node.nodeid}: {problem}"
        pytest.fail(f"this test left the process's CUDA state broken: {problem}", pytrace=False)


GPU_FILES = "_gpu.py"  # tests/<area>/test_<topic>_gpu.py


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker (pytest's own hook)
def pytest_collection_modifyitems(config, items):
    """Marks every test in a test_<topic>_gpu.py file `gpu`, and refuses a `gpu` marker
    on a test anywhere else (a GPU test in a CPU file would hide from the file names).
    Then FASTATTN_TEST_ORDER=reverse, shuffle:SEED or list:FILE runs the collected tests in that order
    (one process, as ever): a suite that passes in file order can still depend on it."""
    for item in items:
        if item.path.name.endswith(GPU_FILES):
            item.add_marker(pytest.mark.gpu)
        elif item.get_closest_marker("gpu") is not None:
            raise pytest.UsageError(f"{item.nodeid}: marked gpu in a CPU test file; GPU tests go in a "
                                    f"test_<topic>_gpu.py file, which marks them")

    from fastattn import env as _env

    order = _env.get("FASTATTN_TEST_ORDER")
    if order == "reverse":
        items.reverse()
    elif order.startswith("shuffle:"):
        import random

        random.Random(order.partition(":")[2]).shuffle(items)
    elif order.startswith("list:"):
        # A failure seen in one order, bisected: the node ids of a file, one a line, run
        # in that order (the rest deselected), e.g. a prefix of `--collect-only -q`'s list.
        path = order.partition(":")[2]
        try:
            wanted = [line.strip() for line in open(path) if line.strip()]
        except OSError as e:
            raise pytest.UsageError(f"FASTATTN_TEST_ORDER={order!r}: {e.strerror}") from None
        by_id = {item.nodeid: item for item in items}
        missing = [n for n in wanted if n not in by_id]
        if missing:
            raise pytest.UsageError(f"FASTATTN_TEST_ORDER={order!r}: {len(missing)} node ids not collected, "
                                    f"the first {missing[0]!r}")
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in set(wanted)])
        items[:] = [by_id[n] for n in wanted]
    elif order:
        raise pytest.UsageError(f"FASTATTN_TEST_ORDER={order!r}: must be 'reverse', 'shuffle:SEED' or 'list:FILE'")
