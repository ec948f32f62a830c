"""The warm-up (FASTATTN_WARM_UP): what a process's first fastattn calls would load from
disk, loaded in a background thread before they come.

fastattn.torch starts it when it is imported, and so does every integration (each imports
fastattn.torch): a server loads its model for seconds before its first request, and
nothing of this needs to wait for that request. One daemon thread, "fastattn-warm-up", in
two phases:

1. Libraries: cuDNN and its dependencies (fastattn._loader), cuDNN's graph sub-libraries
   (CUDNN_SUBLIBRARIES: cuDNN opens them lazily inside a process's first plan
   load, the largest part of a first call) and what the caller adds (fastattn.torch: its
   op library, where it is built; never compiled here). No CUDA call.
2. Plans (FASTATTN_WARM_UP=plans): once the process itself has made a CUDA context (polled,
   or told at once by fastattn.torch's first miss: nudge()), for
   each device that has one, the entries of the persistent cache stored for that GPU and
   this process's versions, the most recently used first, up to FASTATTN_WARM_UP_MAX_BYTES
   of entry files and MAX_PLANS (PlanCache.recent), loaded by LOADERS threads through
   runtime.load_ahead: never a build, and never the entry's last use or FASTATTN_RECORD
   (the first call that uses a plan does both). A call that asks for a plan being loaded
   waits for that plan alone; a call for any other goes on as it would. Then, once every
   plan is loaded, one loader loads their kernels, a plan at a time (CUDA loads a kernel
   at its first launch: about a millisecond on a plan's first call otherwise). Each plan
   whose larger graph's tensors and workspace take at most
   FASTATTN_WARM_UP_KERNELS_MAX_BYTES is launched once on zeroed scratch on a stream of
   its own, in relaxed capture mode, and the scratch freed (runtime.load_kernels,
   Plan.load_kernels). Not a throwaway capture, as cudnn-frontend's own warm-up makes:
   an open capture of any mode makes the caller's other threads' synchronizations fail
   (docs/BENCHMARKS.md). Each loader hands its cuDNN handle on when it is done (a
   caller's first launch then makes none).

It never makes a CUDA context: a context made by fastattn on device 0 would cost every
rank of a one-process-per-GPU server memory on a GPU it does not use, and a thread's
current device is its own (a new thread's is 0, not the caller's). So phase 2 waits,
polling the caller's `contexts()` (fastattn.torch: the devices where PyTorch has made
one), until the process makes one itself.

Bounded: one thread, LOADERS loaders, at most MAX_PLANS plans and the byte budget. With
an empty cache it loads nothing and writes nothing. In a child forked meanwhile it is
not running (fork copies no thread), and the runtime drops the plans the parent was
loading (fastattn.runtime's fork handler). Inside another thread's CUDA-graph capture,
plan loads are made in relaxed capture mode (csrc/attention.cpp), so that they do not
invalidate it. runtime.clear() stops it; so does the interpreter's exit (waiting up to
EXIT_WAIT seconds for a load in progress). Its state is fastattn.stats()["warm_up"]; where
it is off, its "reason" says why (FASTATTN_WARM_UP=off, a torch built without CUDA).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator

from . import runtime

LOADERS = 2  # loaders of phase 2: two paid for training plans, more did not (runtime.preload's doc)
MAX_PLANS = 64
EXIT_WAIT = 2.0
_POLL_FIRST, _POLL_MAX = 0.005, 0.1  # seconds between looks for a CUDA context, doubling up to the max

# cuDNN's sub-libraries that its graph API opens at a process's first handle and first
# plan (the legacy cnn, ops and adv libraries are not needed by it).
CUDNN_SUBLIBRARIES = ("libcudnn_graph.so.9", "libcudnn_heuristic.so.9", "libcudnn_engines_precompiled.so.9",
                      "libcudnn_engines_runtime_compiled.so.9")

_log = logging.getLogger("fastattn")
_lock = threading.Lock()
# What phase 1 holds, and a fork waits for: a child must not be forked in the middle of a
# library load (the dynamic loader's state) or of the loader's own lock.
_phase_lock = threading.Lock()
_suppressed = 0  # suppressed() blocks open
_STATUS: dict[str, Any] = {
    "state": "off",  # off, libraries, waiting (for a CUDA context), loading, kernels, done, stopped, failed, forked
    "devices": [],  # the devices phase 2 loaded for
    "plans": 0,  # plans and refusals it loaded into memory
    "kernels": 0,  # of those plans, those whose kernels it loaded
    "kernels_too_large": 0,  # and those it did not launch: over FASTATTN_WARM_UP_KERNELS_MAX_BYTES
    "kernels_failed": 0,  # and those whose launch failed (out of memory: their first calls load them)
    "libraries_seconds": 0.0,
    "plans_seconds": 0.0,
    "error": None,  # why it ended early, in one line
    "reason": None,  # why it is off (state "off"), in one line
}


class _Run:
    """One warm-up, from start() to its end or stop(): its thread, its stop event and its
    status. A run that was stopped may still finish the load it was in; what it does then
    goes to its own status, never to a later run's."""

    def __init__(self, plans: bool, contexts: Callable[[], list[int]], libraries: Callable[[], None] | None,
                 max_bytes: int, kernels_max_bytes: int):
        self.plans, self.contexts, self.libraries, self.max_bytes = plans, contexts, libraries, max_bytes
        self.kernels_max_bytes = kernels_max_bytes
        self.stop = threading.Event()
        self.wake = threading.Event()  # nudge(): look for a CUDA context now
        self.status: dict[str, Any] = {**_STATUS, "devices": [], "state": "libraries"}
        self.thread = threading.Thread(target=self.run, name="fastattn-warm-up", daemon=True)

    def set(self, **values: Any) -> None:
        with _lock:
            if self.status["state"] != "stopped" or "state" not in values:
                self.status.update(values)

    def run(self) -> None:
        try:
            t0 = time.perf_counter()
            with _phase_lock:
                _load_libraries()  # raises LibraryError where the GPU stack is missing: nothing to warm
                if self.libraries is not None and not self.stop.is_set():
                    self.libraries()
            self.set(libraries_seconds=time.perf_counter() - t0)
            if not self.plans or self.stop.is_set():
                self.set(state="done")
                return
            self.set(state="waiting")
            devices = self.wait_for_context()
            if not devices:
                return  # stopped meanwhile
            self.set(state="loading", devices=devices)
            t0 = time.perf_counter()
            for device in devices:
                self.set(state="loading")
                self.load_plans(device)
            self.set(plans_seconds=time.perf_counter() - t0, state="done")
        except Exception as e:  # an optimization: the first call does whatever this could not, and reports
            self.set(state="failed", error=f"{type(e).__name__}: {e}")
            _log.debug("fastattn warm-up: stopped early (%s: %s)", type(e).__name__, e)

    def wait_for_context(self) -> list[int]:
        pause = _POLL_FIRST
        while not self.stop.is_set():
            devices = self.contexts()
            if devices:
                return devices
            self.wake.wait(pause)
            self.wake.clear()
            pause = min(2 * pause, _POLL_MAX)
        return []

    def load_plans(self, device: int) -> None:
        # A cache of the settings as they are now, not made the process's (runtime.plan_cache()
        # would fix FASTATTN_CACHE_* for the process at whatever they are when this runs).
        cache = runtime.open_plan_cache()
        todo = iter(cache.recent(device, self.max_bytes, MAX_PLANS))
        taking = threading.Lock()
        loaded: list[Any] = []  # the configs whose plans or refusals it loaded, in load order
        barrier = threading.Barrier(LOADERS)

        def take() -> Any:
            with taking:
                return next(todo, None)

        def loader() -> None:
            try:
                while not self.stop.is_set() and (item := take()) is not None:
                    if runtime.load_ahead(item[0], device, cache, item[1]):
                        with _lock:
                            self.status["plans"] += 1
                            loaded.append(item[0])
                # Kernels after every plan (a call waits for its plan's load, never for
                # another plan's kernels: its launch loads them as it would have), by one
                # loader, a plan at a time: at most kernels_max_bytes of scratch at once.
                if self.kernels_max_bytes > 0 and barrier.wait() == 0:
                    self.set(state="kernels")
                    for config in list(loaded):
                        if self.stop.is_set():
                            break
                        self.load_kernels(config, device)
            except threading.BrokenBarrierError:
                pass  # another loader ended early: the kernels are left to the first calls
            except Exception as e:  # an optimization: what it leaves, the first calls load
                # (Aborted here alone, never on a normal end, where a loader still waking
                # from the barrier would see it broken.)
                barrier.abort()
                self.set(error=f"{type(e).__name__}: {e}")
                _log.debug("fastattn warm-up: a loader stopped early (%s: %s)", type(e).__name__, e)
            finally:
                self.pass_on_handle(device)

        # Daemon threads of its own, not a ThreadPoolExecutor: the interpreter's exit joins
        # an executor's workers after they drain its queue (before atexit runs stop()), which
        # would hold a process's exit for every plan still to load.
        loaders = [threading.Thread(target=loader, name=f"fastattn-warm-up-{i}", daemon=True)
                   for i in range(LOADERS)]
        for t in loaders:
            t.start()
        for t in loaders:
            t.join()

    def load_kernels(self, config: Any, device: int) -> None:
        try:
            done = runtime.load_kernels(config, device, self.kernels_max_bytes)
            if done != "no plan":
                with _lock:
                    self.status["kernels" if done == "loaded" else "kernels_too_large"] += 1
        except Exception as e:  # an optimization: the plan's first launch loads them, as without it
            with _lock:
                self.status["kernels_failed"] += 1
            _log.debug("fastattn warm-up: a plan's kernels were not loaded (%s: %s)", type(e).__name__, e)

    @staticmethod
    def pass_on_handle(device: int) -> None:
        """The loader's cuDNN handle, made for its loads, kept for the caller's first
        launch (a thread's first cudnnCreate is 1.4 ms on the H200)."""
        try:
            runtime.pass_on_handle(device)
        except Exception as e:
            _log.debug("fastattn warm-up: its handle was not passed on (%s: %s)", type(e).__name__, e)


_run: _Run | None = None  # the current run (None: none started, or stopped)
# The status status() reports where no run is current.
_last: dict[str, Any] = {**_STATUS, "reason": "not started: importing fastattn.torch (or an integration) starts it"}


def status() -> dict[str, Any]:
    """The warm-up's state (fastattn.stats()["warm_up"]): the current run's, else the last's."""
    with _lock:
        current = _run.status if _run is not None else _last
        return {**current, "devices": list(current["devices"])}


def nudge() -> None:
    """A fastattn call is missing a plan, so the process has a CUDA context: the warm-up
    looks for it now instead of at its next poll (up to _POLL_MAX later), and loads the
    other plans beside that call."""
    run = _run
    if run is not None:
        run.wake.set()


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """Within the block, start() starts nothing (`fastattn warm`'s import of fastattn.torch,
    which only compiles its op library)."""
    global _suppressed
    with _lock:
        _suppressed += 1
    try:
        yield
    finally:
        with _lock:
            _suppressed -= 1


def off(reason: str) -> None:
    """The warm-up is not started in this process, for `reason` (FASTATTN_WARM_UP=off, a
    torch without CUDA): what status() says while no run is current."""
    global _last
    with _lock:
        if _run is None:
            _last = {**_STATUS, "devices": [], "reason": reason}


def start(*, plans: bool, contexts: Callable[[], list[int]], libraries: Callable[[], None] | None = None,
          max_bytes: int = 32 << 20, kernels_max_bytes: int = 0) -> bool:
    """Starts the warm-up thread, once per process (until stop()). plans: run phase 2.
    contexts(): the CUDA devices on which the process has made a context (polled by the
    thread until it names one). libraries(): more of phase 1 (fastattn.torch's op
    library). kernels_max_bytes: phase 2's kernel loads (0: none). Returns whether it
    started one."""
    global _run
    global _last
    with _lock:
        if _run is not None:
            return False
        if _suppressed:
            _last = {**_STATUS, "devices": [], "reason": "not started: this process only builds fastattn.torch's "
                                                        "op library (fastattn warm)"}
            return False
        run = _run = _Run(plans, contexts, libraries, max_bytes, kernels_max_bytes)
    run.thread.start()
    return True


def stop(wait: float = 0.0) -> None:
    """Stops the warm-up after the load in progress (waiting up to `wait` seconds for
    it); a later start() starts it anew."""
    global _run, _last
    with _lock:
        run, _run = _run, None
        if run is None:
            return
        if run.status["state"] not in ("done", "failed"):
            run.status["state"] = "stopped"
        _last = run.status
    run.stop.set()
    run.wake.set()
    if wait > 0 and run.thread is not threading.current_thread():
        run.thread.join(wait)


def _load_libraries() -> None:
    import ctypes

    from . import _loader

    folder = os.path.dirname(_loader.ensure_loaded().cudnn)
    for name in CUDNN_SUBLIBRARIES:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            try:
                ctypes.CDLL(path)  # kept open: cuDNN's own dlopen of it later finds it loaded
            except OSError:
                pass  # cuDNN's own load of it reports, at the call that needs it


def _before_fork() -> None:
    _phase_lock.acquire()
    _lock.acquire()


def _after_fork_in_parent() -> None:
    _lock.release()
    _phase_lock.release()


def _after_fork_in_child() -> None:
    global _lock, _phase_lock, _run, _last
    _lock, _phase_lock = threading.Lock(), threading.Lock()
    if _run is not None:  # fork copies no thread: this process's warm-up is not running
        run, _run = _run, None
        if run.status["state"] not in ("done", "failed", "stopped"):
            run.status["state"] = "forked"
        _last = run.status


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
atexit.register(stop, EXIT_WAIT)
runtime.register_stats("warm_up", status, stop)
