"""The warm-up (fastattn/_warm_up.py, FASTATTN_WARM_UP): the cache's most recently used plans
loaded in a background thread once the process has a CUDA context, without a GPU: the
runtime on tests/fake_core.py, the context and the libraries stood in for."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import fake_core
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastattn import AttentionConfig, _warm_up, runtime
from fastattn import errors as fastattn_errors
from fastattn.errors import CorruptPlanError, InvalidArgumentError

_real_load_libraries = _warm_up._load_libraries  # before any fixture replaces it


def _cfg(seqlen: int, training: bool = False) -> AttentionConfig:
    return AttentionConfig(batch=1, heads_q=8, seqlen_q=seqlen, head_dim_qk=64, dtype="bf16", layout="bshd",
                           mask="causal", training=training)


@pytest.fixture
def warm(env, monkeypatch):
    """The fake runtime (env), no library loading, the warm-up stopped after the test;
    `fill(configs)` builds and stores configs, then forgets them (a later process's view):
    returns their entry files, in order."""
    monkeypatch.setattr(_warm_up, "_load_libraries", lambda: None)

    def fill(configs, base_time=1_000_000.0):
        paths = []
        for i, cfg in enumerate(configs):
            runtime.plan(cfg, device=0)
            cache = runtime.plan_cache()
            path = cache.store.main.path_for(cache.key(cfg, 0))
            os.utime(path, (base_time + i, base_time))  # last use: the later in the list, the more recent
            paths.append(path)
        runtime.clear()
        return paths

    yield fill
    _warm_up.stop(wait=10)
    runtime.clear()


def _run(contexts=lambda: [0], max_bytes=32 << 20, plans=True, libraries=None, kernels_max_bytes=0) -> dict:
    """Runs the warm-up to its end; its status."""
    assert _warm_up.start(plans=plans, contexts=contexts, libraries=libraries, max_bytes=max_bytes,
                          kernels_max_bytes=kernels_max_bytes)
    thread = _warm_up._run.thread
    thread.join(10)
    assert not thread.is_alive()
    return _warm_up.status()


def _held() -> list:
    with runtime._lock:
        return [(cfg.seqlen_q, dev) for (cfg, dev), e in runtime._entries.items() if e.done.is_set()]


def _builds(env) -> int:
    log = env / "builds.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_it_loads_the_most_recently_used_plans_first_and_builds_nothing(warm, env, monkeypatch):
    warm([_cfg(s) for s in (64, 128, 256, 512)])
    order = []
    real = fake_core.load_plan
    monkeypatch.setattr(fake_core, "load_plan", lambda cfg, *a: order.append(cfg.seqlen_q) or real(cfg, *a))
    monkeypatch.setattr(_warm_up, "LOADERS", 1)  # one loader: the order is the list's
    monkeypatch.setenv("FAKE_BUILD_LOG", str(env / "builds.log"))
    status = _run()
    assert order == [512, 256, 128, 64]
    assert status["state"] == "done" and status["plans"] == 4 and status["devices"] == [0]
    assert sorted(_held()) == [(64, 0), (128, 0), (256, 0), (512, 0)]
    assert _builds(env) == 0
    stats = runtime.stats()
    assert stats["deserializations"] == 4 and stats["builds"] == 0 and stats["warm_up"]["plans"] == 4
    # The first call is a memory hit on the loaded plan.
    runtime.plan(_cfg(256), device=0)
    assert runtime.stats()["memory_hits"] == 1 and _builds(env) == 0


def test_each_loader_passes_on_its_handle_for_the_device_when_done(warm, monkeypatch):
    warm([_cfg(64), _cfg(128, training=True), _cfg(256)])
    monkeypatch.setattr(fake_core, "PASSED_ON", [])
    status = _run(contexts=lambda: [1])
    assert status["plans"] == 3
    assert fake_core.PASSED_ON == [1] * _warm_up.LOADERS  # every loader, at its end, on its device


def test_a_handle_that_cannot_be_passed_on_changes_nothing(warm, env, monkeypatch):
    warm([_cfg(64), _cfg(128)])

    def fail(device):
        raise RuntimeError("fake: cudnnSetStream failed")

    monkeypatch.setattr(fake_core, "pass_on_handle", fail)
    monkeypatch.setenv("FAKE_BUILD_LOG", str(env / "builds.log"))
    status = _run()
    assert status["state"] == "done" and status["plans"] == 2 and status["error"] is None
    runtime.plan(_cfg(64), device=0)
    assert runtime.stats()["memory_hits"] == 1 and _builds(env) == 0


def test_the_byte_budget_and_the_plan_cap_bound_it(warm, monkeypatch):
    paths = warm([_cfg(64 * (i + 1)) for i in range(6)])
    size = max(os.path.getsize(p) for p in paths)
    status = _run(max_bytes=3 * size)
    assert status["plans"] == 3 and sorted(s for s, _ in _held()) == [256, 320, 384]  # the 3 most recent
    _warm_up.stop()
    runtime.clear()
    monkeypatch.setattr(_warm_up, "MAX_PLANS", 2)
    assert _run()["plans"] == 2


def _kernel_bytes(cfg: AttentionConfig) -> int:
    """What runtime.load_kernels holds a fake plan of cfg to: its larger graph's tensors
    and workspace (a fake plan's workspaces: 256 forward, 1024 backward)."""
    from fastattn._arrays import scratch_bytes

    forward = sum(scratch_bytes(cfg, fake_core.SLOT_NAMES, False)) + 256
    return max(forward, sum(scratch_bytes(cfg, fake_core.SLOT_NAMES, True)) + 1024) if cfg.training else forward


@pytest.mark.parametrize("training,need", [
    (False, 4 * (32 << 20) + 256),  # q, k, v, o of 32 MiB each and the forward's workspace: no gradient, no stats
    (True, 8 * (32 << 20) + 4096 * 32 * 4 + 1024),  # the backward's: those, d_o, d_q, d_k, d_v, stats
])
def test_a_plan_is_bounded_by_its_larger_graphs_tensors_and_workspace(warm, monkeypatch, training, need):
    monkeypatch.setattr(fake_core, "KERNELS_LOADED", [])
    cfg = AttentionConfig(batch=1, heads_q=32, seqlen_q=4096, head_dim_qk=128, dtype="bf16", training=training)
    runtime.plan(cfg, device=0)
    assert runtime.load_kernels(cfg, 0, need - 1) == "too large" and fake_core.KERNELS_LOADED == []
    assert runtime.load_kernels(cfg, 0, need) == "loaded" and fake_core.KERNELS_LOADED == [cfg]


def test_it_loads_the_kernels_of_every_plan_it_loaded_after_every_plan(warm, monkeypatch):
    configs = [_cfg(64), _cfg(128, training=True), _cfg(256), _cfg(512, training=True), _cfg(1024)]
    warm(configs)
    events, lock = [], threading.Lock()
    real = fake_core.load_plan

    def load(cfg, *a):
        time.sleep(0.01)
        with lock:
            events.append(("plan", cfg.seqlen_q))
        return real(cfg, *a)

    def kernels(self):
        with lock:
            events.append(("kernels", self.config.seqlen_q))

    monkeypatch.setattr(fake_core, "load_plan", load)
    monkeypatch.setattr(fake_core.FakePlan, "load_kernels", kernels)
    status = _run(kernels_max_bytes=1 << 40)
    assert status["state"] == "done" and status["plans"] == 5 and status["kernels"] == 5, status
    kinds = [kind for kind, _ in events]
    assert kinds == ["plan"] * 5 + ["kernels"] * 5  # no call waits for another plan's kernels
    assert sorted(n for kind, n in events if kind == "kernels") == [64, 128, 256, 512, 1024]
    assert runtime.stats()["builds"] == 0


def test_its_kernel_loads_are_bounded_by_their_bytes_and_off_at_zero(warm, monkeypatch):
    small, large = _cfg(64), _cfg(2048, training=True)
    warm([small, large])
    monkeypatch.setattr(fake_core, "KERNELS_LOADED", [])
    assert _run(kernels_max_bytes=0)["kernels"] == 0 and fake_core.KERNELS_LOADED == []
    for budget, loaded in ((_kernel_bytes(small) - 1, []), (_kernel_bytes(small), [small]),
                           (_kernel_bytes(large), [small, large])):
        _warm_up.stop(wait=10)
        runtime.clear()
        fake_core.KERNELS_LOADED.clear()
        status = _run(kernels_max_bytes=budget)
        assert status["plans"] == 2 and status["kernels"] == len(loaded), (budget, status)
        assert status["kernels_too_large"] == 2 - len(loaded), (budget, status)
        assert sorted(c.seqlen_q for c in fake_core.KERNELS_LOADED) == sorted(c.seqlen_q for c in loaded)


def test_a_kernel_load_that_fails_costs_the_plan_nothing(warm, env, monkeypatch):
    warm([_cfg(64), _cfg(128)])

    def fail(self):
        raise fastattn_errors.CudaError("load_kernels: cudaMallocAsync failed: out of memory (fake)")

    monkeypatch.setattr(fake_core.FakePlan, "load_kernels", fail)
    monkeypatch.setenv("FAKE_BUILD_LOG", str(env / "builds.log"))
    status = _run(kernels_max_bytes=1 << 40)
    assert status["state"] == "done" and status["plans"] == 2 and status["kernels"] == 0 and status["error"] is None
    assert status["kernels_failed"] == 2
    runtime.plan(_cfg(64), device=0)
    assert runtime.stats()["memory_hits"] == 1 and _builds(env) == 0


def test_a_loader_that_fails_leaves_no_other_waiting_for_the_kernels(warm, monkeypatch):
    warm([_cfg(64 * (i + 1)) for i in range(4)])
    real = runtime.load_ahead

    def load(cfg, *a):
        if cfg.seqlen_q == 128:
            raise RuntimeError("fake: a loader's own failure")
        return real(cfg, *a)

    monkeypatch.setattr(runtime, "load_ahead", load)
    status = _run(kernels_max_bytes=1 << 40)  # (_run fails if the thread is still alive after 10 s)
    assert status["state"] == "done" and status["plans"] >= 1
    assert status["error"] == "RuntimeError: fake: a loader's own failure"  # said, not raised in a thread


def test_load_kernels_launches_only_a_plan_held_and_loaded(warm, monkeypatch):
    monkeypatch.setattr(fake_core, "KERNELS_LOADED", [])
    cfg = _cfg(64)
    assert runtime.load_kernels(cfg, 0, 1 << 40) == "no plan"  # nothing held
    runtime.plan(cfg, device=0)
    assert runtime.load_kernels(cfg, 0, 1 << 40) == "loaded" and fake_core.KERNELS_LOADED == [cfg]
    assert runtime.load_kernels(cfg, 0, _kernel_bytes(cfg) - 1) == "too large"
    assert runtime.load_kernels(cfg, 1, 1 << 40) == "no plan"  # held for device 0 alone
    assert fake_core.KERNELS_LOADED == [cfg]


def test_at_most_LOADERS_plans_load_at_once(warm, monkeypatch):
    warm([_cfg(64 * (i + 1)) for i in range(8)])
    now, most, lock = [0], [0], threading.Lock()
    real = fake_core.load_plan

    def load(*a):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.02)
        with lock:
            now[0] -= 1
        return real(*a)

    monkeypatch.setattr(fake_core, "load_plan", load)
    assert _run()["plans"] == 8
    assert most[0] == _warm_up.LOADERS == 2


def test_an_empty_cache_is_harmless(warm, env):
    status = _run()
    assert status["state"] == "done" and status["plans"] == 0
    assert not (env / "cache").exists()  # nothing created on disk
    assert _held() == []


def test_it_waits_for_the_process_to_make_a_context_and_loads_on_that_device(warm):
    warm([_cfg(64), _cfg(128)])
    made = threading.Event()
    asked = []

    def contexts():
        asked.append(1)
        return [1] if made.is_set() else []

    assert _warm_up.start(plans=True, contexts=contexts, max_bytes=32 << 20)
    deadline = time.monotonic() + 10
    while len(asked) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _warm_up.status()["state"] == "waiting" and _held() == []  # no context: nothing touched
    made.set()
    _warm_up._run.thread.join(10)
    assert sorted(_held()) == [(64, 1), (128, 1)]  # the device that has the context, not 0
    assert _warm_up.status()["devices"] == [1]


def test_libraries_alone_touch_no_plan(warm):
    warm([_cfg(64)])
    loaded = []
    status = _run(plans=False, contexts=lambda: pytest.fail("asked for a context"), libraries=lambda: loaded.append(1))
    assert status["state"] == "done" and status["plans"] == 0 and loaded == [1] and _held() == []


def _gated(monkeypatch, which=lambda cfg: True):
    """Makes the fake core's loads of the configs `which` picks wait for `gate`; `entered`
    is set when the first of them starts. Returns (gate, entered)."""
    gate, entered = threading.Event(), threading.Event()
    real = fake_core.load_plan

    def load(cfg, *a):
        if which(cfg):
            entered.set()
            assert gate.wait(10)
        return real(cfg, *a)

    monkeypatch.setattr(fake_core, "load_plan", load)
    return gate, entered


def test_a_call_waits_for_its_own_plan_alone(warm, env, monkeypatch):
    warm([_cfg(64), _cfg(128)])  # 128 most recent: loaded first
    gate, entered = _gated(monkeypatch, lambda cfg: cfg.seqlen_q == 128)
    monkeypatch.setenv("FAKE_BUILD_LOG", str(env / "builds.log"))
    assert _warm_up.start(plans=True, contexts=lambda: [0], max_bytes=32 << 20)
    assert entered.wait(10)
    runtime.plan(_cfg(64), device=0)  # another plan: not held up by the load in flight
    got = []
    waiter = threading.Thread(target=lambda: got.append(runtime.plan(_cfg(128), device=0)))
    waiter.start()
    time.sleep(0.05)
    assert got == []  # waits for the load of its plan
    gate.set()
    waiter.join(10)
    assert len(got) == 1 and got[0].config == _cfg(128)
    assert _builds(env) == 0


def test_a_plan_the_warm_up_cannot_load_is_built_once_by_the_call_that_waited(warm, env, monkeypatch):
    warm([_cfg(64)])
    gate, entered = threading.Event(), threading.Event()

    def corrupt(cfg, *a):
        if threading.current_thread().name.startswith("fastattn-warm-up"):
            entered.set()
            assert gate.wait(10)
        raise CorruptPlanError("forward: fake cuDNN rejects this blob")

    monkeypatch.setattr(fake_core, "load_plan", corrupt)
    monkeypatch.setenv("FAKE_BUILD_LOG", str(env / "builds.log"))
    assert _warm_up.start(plans=True, contexts=lambda: [0], max_bytes=32 << 20)
    assert entered.wait(10)
    got = []
    waiter = threading.Thread(target=lambda: got.append(runtime.plan(_cfg(64), device=0)))
    waiter.start()
    time.sleep(0.05)
    gate.set()
    waiter.join(10)
    assert len(got) == 1 and got[0].config == _cfg(64)
    assert _builds(env) == 1  # the waiter's, once; the warm-up built nothing
    assert _warm_up.status()["plans"] == 0


def test_loading_ahead_leaves_the_record_and_the_last_use_to_the_first_call(warm, env, monkeypatch):
    paths = warm([_cfg(64), _cfg(128)])
    record = env / "record.jsonl"
    monkeypatch.setenv("FASTATTN_RECORD", str(record))
    before = [os.stat(p).st_atime for p in paths]
    assert _run()["plans"] == 2
    assert not record.exists() or record.read_text() == ""
    assert [os.stat(p).st_atime for p in paths] == before
    runtime.plan(_cfg(64), device=0)  # its first use
    assert record.read_text().splitlines() == [_cfg(64).to_json()]
    assert os.stat(paths[0]).st_atime > before[0] and os.stat(paths[1]).st_atime == before[1]


def test_the_first_use_touches_the_entry_it_was_loaded_from_without_computing_its_key(warm, env, monkeypatch):
    # The first call of a warmed plan is on the caller's path: the key load_ahead had is
    # kept with the plan, where computing it again described the GPU, versions and the
    # environment (~0.2 ms) on that call.
    paths = warm([_cfg(64), _cfg(128)])
    before = [os.stat(p).st_atime for p in paths]
    assert _run()["plans"] == 2
    described = []
    real = runtime.PlanCache.describe
    monkeypatch.setattr(runtime.PlanCache, "describe", lambda self, *a: described.append(a) or real(self, *a))
    runtime.plan(_cfg(64), device=0)
    assert described == []
    assert os.stat(paths[0]).st_atime > before[0] and os.stat(paths[1]).st_atime == before[1]
    runtime.plan(_cfg(256), device=0)  # a miss computes its key, as ever
    assert described


def test_clear_stops_it_and_keeps_nothing_it_was_loading(warm, monkeypatch):
    warm([_cfg(64), _cfg(128), _cfg(256)])
    gate, entered = _gated(monkeypatch)
    assert _warm_up.start(plans=True, contexts=lambda: [0], max_bytes=32 << 20)
    thread = _warm_up._run.thread
    assert entered.wait(10)
    runtime.clear()
    gate.set()
    thread.join(10)
    assert not thread.is_alive() and _held() == []
    assert _warm_up.status()["state"] == "stopped"


def test_a_capture_waits_for_a_plan_in_flight_and_never_starts_a_load(warm, monkeypatch):
    warm([_cfg(64)])
    gate, entered = _gated(monkeypatch)
    assert _warm_up.start(plans=True, contexts=lambda: [0], max_bytes=32 << 20)
    assert entered.wait(10)
    assert runtime.planned(_cfg(64), device=0) is None  # wait=False: answered at once
    threading.Timer(0.05, gate.set).start()
    assert runtime.planned(_cfg(64), device=0, wait=True).config == _cfg(64)
    assert runtime.planned(_cfg(128), device=0, wait=True) is None  # nothing held or in flight: no load
    assert (_cfg(128), 0) not in runtime._entries


def test_a_child_forked_during_a_load_plans_by_itself(fake_workers, tmp_path):
    # A fresh interpreter on the fake core, so that the fork happens in a process with only
    # the threads this script starts.
    script = textwrap.dedent("""
        import os, signal, sys, threading
        import fake_core
        from fastattn import AttentionConfig, _warm_up, runtime
        cfg = AttentionConfig(batch=1, heads_q=8, seqlen_q=64, head_dim_qk=64, dtype="bf16", layout="bshd",
                              mask="causal")
        runtime.plan(cfg, device=0)
        runtime.clear()
        parent, gate, entered = os.getpid(), threading.Event(), threading.Event()
        real = fake_core.load_plan
        def load(c, *a):
            if os.getpid() == parent:
                entered.set()
                gate.wait(10)
            return real(c, *a)
        fake_core.load_plan = load
        _warm_up._load_libraries = lambda: None
        _warm_up.start(plans=True, contexts=lambda: [0])
        assert entered.wait(10)
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)  # a hang fails the test, not the suite
            p = runtime.plan(cfg, device=0)
            os._exit(0 if p.config == cfg and _warm_up.status()["state"] == "forked" else 3)
        gate.set()
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FASTATTN_WARM_UP": "plans"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "child 0"


def test_a_process_exits_without_waiting_for_the_plans_still_to_load(fake_workers):
    # 16 plans of 0.5 s each on two loaders: 4 s to load them all. The exit waits for the
    # loads in progress alone (an executor's workers would drain the queue first).
    script = textwrap.dedent("""
        import time
        import fake_core
        from fastattn import AttentionConfig, _warm_up, runtime
        configs = [AttentionConfig(batch=1, heads_q=8, seqlen_q=64 * (i + 1), head_dim_qk=64) for i in range(16)]
        for cfg in configs:
            runtime.plan(cfg, device=0)
        runtime.clear()
        real = fake_core.load_plan
        fake_core.load_plan = lambda *a: time.sleep(0.5) or real(*a)
        _warm_up._load_libraries = lambda: None
        _warm_up.start(plans=True, contexts=lambda: [0])
        while _warm_up.status()["plans"] < 1:
            time.sleep(0.01)
        print(time.time(), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    ended = time.time()
    assert done.returncode == 0, done.stderr
    assert ended - float(done.stdout.strip()) < 2.0


@pytest.mark.parametrize("setting,cuda,started", [("plans", "13.0", "plans"), ("libraries", "13.0", "libraries"),
                                                  ("off", "13.0", None), ("plans", None, None)])
def test_importing_fastattn_torch_starts_it_as_set_without_initializing_cuda(monkeypatch, setting, cuda, started):
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    import fastattn.torch as fat

    seen = []
    monkeypatch.setattr(_warm_up, "start", lambda **kw: seen.append(kw))
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("is_available initializes the driver"))
    monkeypatch.setenv("FASTATTN_WARM_UP", setting)
    monkeypatch.setenv("FASTATTN_WARM_UP_MAX_BYTES", "5M")
    fat._warm_up()
    if started is None:
        assert seen == []
    else:
        assert len(seen) == 1 and seen[0]["plans"] == (started == "plans") and seen[0]["max_bytes"] == 5 << 20
        # Without a CUDA context made by PyTorch, no device is named (and none is asked about).
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        assert seen[0]["contexts"]() == []


@pytest.mark.parametrize("name,value", [("FASTATTN_WARM_UP", "sometimes"), ("FASTATTN_WARM_UP_MAX_BYTES", "-5"),
                                        ("FASTATTN_WARM_UP_MAX_BYTES", "1e400")])
def test_a_bad_setting_is_refused_by_name_whether_or_not_this_torch_has_cuda(monkeypatch, name, value):
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    import fastattn.torch as fat

    monkeypatch.setattr(_warm_up, "start", lambda **kw: pytest.fail("started with a bad setting"))
    monkeypatch.setenv(name, value)
    for cuda in (None, "13.0"):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        with pytest.raises(InvalidArgumentError, match=f"^{name}="):
            fat._warm_up()


def test_the_op_library_is_loaded_ahead_only_where_nothing_is_compiled(monkeypatch, tmp_path):
    pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    from fastattn.torch import _native

    decided = []
    monkeypatch.setattr(_native, "decide", lambda: decided.append(1))
    monkeypatch.setattr(_native, "build", lambda *a: pytest.fail("the warm-up compiled the op library"))
    missing = tmp_path / "none.so"
    monkeypatch.setattr(_native, "library_path", lambda root=None: missing)
    for mode, expected in (("native", 0), ("auto", 1), ("python", 1)):
        decided.clear()
        monkeypatch.setenv(_native.ENV, mode)
        _native.load_if_built()
        assert len(decided) == expected, mode
    missing.write_bytes(b"")
    decided.clear()
    monkeypatch.setenv(_native.ENV, "native")
    _native.load_if_built()
    assert decided == [1]


def test_a_machine_without_the_gpu_stack_ends_it_quietly(warm, monkeypatch):
    from fastattn import _loader
    from fastattn.errors import LibraryError

    def missing():
        raise LibraryError("fastattn cannot use the GPU: no libcuda")

    monkeypatch.setattr(_warm_up, "_load_libraries", _real_load_libraries)  # the real one, on a missing stack
    monkeypatch.setattr(_loader, "ensure_loaded", missing)
    status = _run(contexts=lambda: pytest.fail("asked for a context"))
    assert status["state"] == "failed" and "no libcuda" in status["error"]


def test_it_loads_cudnns_graph_sub_libraries_that_exist(monkeypatch, tmp_path):
    import ctypes

    from fastattn import _loader

    for name in ("libcudnn_graph.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_cnn.so.9"):
        (tmp_path / name).write_bytes(b"")
    libs = _loader.Libraries(cudnn=str(tmp_path / "libcudnn.so.9"), cudart="cudart", nvrtc="nvrtc",
                             cublaslt="cublaslt", cudnn_version=91900)
    opened = []
    monkeypatch.setattr(_loader, "ensure_loaded", lambda: libs)

    def cdll(path, *a, **kw):
        opened.append(path)
        if path.endswith("graph.so.9"):
            raise OSError("bad ELF")  # one that will not load does not stop the others

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    _real_load_libraries()
    # The graph API's sub-libraries that exist, in order; not the legacy cnn.
    assert opened == [str(tmp_path / "libcudnn_graph.so.9"), str(tmp_path / "libcudnn_engines_precompiled.so.9")]


def test_start_is_once_until_stopped(warm):
    assert _warm_up.start(plans=False, contexts=list)
    assert not _warm_up.start(plans=False, contexts=list)
    _warm_up.stop(wait=10)
    assert _warm_up.start(plans=False, contexts=list)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(st.tuples(st.integers(1, 40), st.booleans(), st.integers(0, 10**6)), min_size=0, max_size=12,
                        unique_by=lambda e: e[0]),
       garbage=st.lists(st.binary(max_size=300), max_size=3), budget=st.integers(0, 40_000),
       cap=st.integers(1, 12))
def test_recent_takes_this_gpus_entries_most_recent_first_within_its_bounds(warm, env, monkeypatch, entries, garbage,
                                                                             budget, cap):
    # Stored bytes: entries of this GPU and of another (a shared cache), files named like
    # entries that are not (damage, another program), any last uses, any bounds.
    import hashlib
    import shutil

    monkeypatch.setenv("FAKE_BUILD_SECONDS", "0")
    shutil.rmtree(env / "cache", ignore_errors=True)
    runtime.clear()
    ours = {}
    for seqlen, foreign, atime in entries:
        fake_core.GPU_NAME[0] = "Another GPU" if foreign else "NVIDIA H200"  # (env's list, restored after)
        cfg = _cfg(seqlen * 8)
        runtime.plan(cfg, device=0)
        cache = runtime.plan_cache()
        key = cache.key(cfg, 0)
        path = cache.store.main.path_for(key)
        os.utime(path, (atime, atime))
        if not foreign:
            ours[key] = (cfg, atime, os.path.getsize(path))
        runtime.clear()
    fake_core.GPU_NAME[0] = "NVIDIA H200"
    for i, data in enumerate(garbage):
        key = hashlib.sha256(b"garbage%d" % i).hexdigest()
        folder = env / "cache" / key[:2]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / (key + ".entry")).write_bytes(data)
    got = runtime.open_plan_cache().recent(0, budget, cap)
    assert all(key in ours and ours[key][0] == cfg for cfg, key in got)
    assert [ours[k][1] for _, k in got] == sorted((ours[k][1] for _, k in got), reverse=True)
    assert len(got) <= cap and sum(ours[k][2] for _, k in got) <= budget
    if len(entries) + len(garbage) <= 4 * cap:  # every header could be read: taken greedily, newest first
        # (ties in the listing's order: by key, one directory)
        want, spent = [], 0
        for key, (_, _, size) in sorted(ours.items(), key=lambda kv: (-kv[1][1], kv[0])):  # ties: listing order
            if len(want) < cap and spent + size <= budget:
                want.append(key)
                spent += size
        assert sorted(k for _, k in got) == sorted(want)


def test_a_run_stopped_mid_load_leaves_a_new_run_alone(warm, monkeypatch):
    warm([_cfg(64), _cfg(128)])
    gate, entered = _gated(monkeypatch, lambda cfg: threading.current_thread().name != "MainThread" and not gate.is_set())
    assert _warm_up.start(plans=True, contexts=lambda: [0], max_bytes=32 << 20)
    old = _warm_up._run
    assert entered.wait(10)
    _warm_up.stop()  # the old run is inside a load: it ends after it
    assert _warm_up.status()["state"] == "stopped"
    runtime.clear()
    assert _warm_up.start(plans=False, contexts=list)  # a new run, while the old one still loads
    new = _warm_up._run
    gate.set()
    old.thread.join(10)
    new.thread.join(10)
    assert old.status["state"] == "stopped" and _warm_up.status()["state"] == "done"
    assert _warm_up.status()["plans"] == 0  # the old run's load is not counted in the new run


def test_a_nudge_makes_it_look_for_the_context_at_once(warm, monkeypatch):
    warm([_cfg(64)])
    monkeypatch.setattr(_warm_up, "_POLL_FIRST", 30.0)  # its own next look: far away
    monkeypatch.setattr(_warm_up, "_POLL_MAX", 30.0)
    made, asked = threading.Event(), threading.Event()

    def contexts():
        asked.set()
        return [0] if made.is_set() else []

    assert _warm_up.start(plans=True, contexts=contexts, max_bytes=32 << 20)
    assert asked.wait(10)
    made.set()
    t0 = time.monotonic()
    _warm_up.nudge()  # what fastattn.torch's first miss does
    _warm_up._run.thread.join(10)
    assert time.monotonic() - t0 < 5 and _warm_up.status()["plans"] == 1


def test_fastattn_torchs_miss_nudges_it(warm, monkeypatch):
    pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    from fastattn.torch import _plans

    nudged = []
    monkeypatch.setattr(_warm_up, "nudge", lambda: nudged.append(1))
    monkeypatch.setattr(_plans, "capturing", lambda: True)  # (then it asks planned(), which holds nothing)
    with pytest.raises(InvalidArgumentError, match="not loaded yet"):
        _plans.remember(("k",), _cfg(64), *[_Tensor()] * 3, "bshd")
    assert nudged == [1]


class _Tensor:
    class device:
        index = 0


def test_the_devices_named_are_those_where_pytorch_made_a_context(monkeypatch):
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    import fastattn.torch as fat

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("counted devices before CUDA was initialized"))
    assert fat._cuda_contexts() == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: i == 1, raising=False)
    assert fat._cuda_contexts() == [1]


@pytest.mark.parametrize("setting,cuda,reason", [
    ("off", "13.0", "FASTATTN_WARM_UP=off"),
    ("plans", None, "built without CUDA"),
    ("libraries", None, "built without CUDA"),
])
def test_a_warm_up_that_is_off_says_why(monkeypatch, setting, cuda, reason):
    # stats()["warm_up"] said {"state": "off"} and nothing else on a CPU-only torch.
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
    import fastattn
    import fastattn.torch as fat

    monkeypatch.setattr(_warm_up, "_run", None)
    monkeypatch.setattr(_warm_up, "_last", dict(_warm_up._STATUS))
    monkeypatch.setattr(_warm_up, "start", lambda **kw: pytest.fail("started"))
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setenv("FASTATTN_WARM_UP", setting)
    fat._warm_up()
    status = fastattn.stats()["warm_up"]
    assert status["state"] == "off" and reason in (status["reason"] or ""), status


def test_a_warm_up_that_runs_has_no_reason_to_give(warm):
    assert _run()["reason"] is None
