"""Pre-warming the persistent cache for many configs, in parallel worker processes.

Each worker is a fresh Python process (`python -m fastattn._warm_worker`) that loads or
builds one config at a time through fastattn.probe, which stores what it builds. A
crash inside cuDNN (reported for some backward plans) kills only its worker: that
config is reported failed with the signal, a new worker takes its place, and the run
goes on.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import math
import os
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from . import _fields
from .config import FIELDS, AttentionConfig
from .errors import FastAttnError, InvalidArgumentError

__all__ = ["WarmItem", "WarmReport", "warm"]

STATUSES = ("loaded", "built", "unsupported", "failed")
# With verify: a plan cuDNN built that failed verification (refused with the evidence:
# never served). Counted, as "rejected", in runs that verify or meet one.
REJECTED = "rejected"


@dataclass
class WarmItem:
    config: AttentionConfig
    status: str = "pending"  # loaded (found in the cache), built, unsupported, failed, rejected (failed verification)
    seconds: float = 0.0  # wall time from handing it to a worker to its answer
    build_seconds: float = 0.0  # the part the worker spent building or loading it
    reason: str = ""  # cuDNN's reason, or what failed
    forward_engine: str = ""
    backward_engine: str = ""
    error_type: str = ""  # the exception class or signal of a failure
    # Whether the answer a worker built now (a plan or a refusal) is in the main cache
    # directory at the end of the run; None for answers not built by this run.
    saved: bool | None = None
    key: str | None = field(default=None, repr=False)  # the cache key of an answer built now, as the worker saw it
    built_now: bool = field(default=False, repr=False)
    verdict: dict | None = None  # fastattn.verdict.Verdict.to_dict(): verified now or stored with the entry

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "status": self.status, "seconds": self.seconds,
                "build_seconds": self.build_seconds, "reason": self.reason,
                "forward_engine": self.forward_engine, "backward_engine": self.backward_engine,
                "error_type": self.error_type, "saved": self.saved, "verdict": self.verdict}


@dataclass
class WarmReport:
    items: list[WarmItem]
    seconds: float
    workers: int
    counts: dict[str, int] = field(default_factory=dict)
    processes: int = 0  # worker processes started (crashed ones replaced included)
    not_saved: int = 0  # answers built by this run that the cache directory does not hold at its end
    not_saved_reason: str = ""  # why, when not_saved
    warnings: list[str] = field(default_factory=list)  # what the workers logged (each message once)
    verify: bool = False  # every plan was verified (now, or by the run that stored its verdict)
    # Configs failed without being sent to a worker: an answer said no config can run here
    # (no usable GPU stack), so the rest were given its reason.
    not_tried: int = 0

    @property
    def verdicts(self) -> dict[str, int]:
        """How many items carry a verdict of each status (passed, failed, skipped)."""
        out = {"passed": 0, "failed": 0, "skipped": 0}
        for i in self.items:
            if i.verdict is not None:
                out[i.verdict["status"]] += 1
        return out

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "workers": self.workers, "processes": self.processes, "counts": self.counts,
                "not_saved": self.not_saved, "not_saved_reason": self.not_saved_reason, "warnings": self.warnings,
                "verify": self.verify, "verdicts": self.verdicts, "not_tried": self.not_tried,
                "items": [i.to_dict() for i in self.items]}


class _Worker:
    def __init__(self, device: int | None, log_dir: str, index: int, verify: bool = False,
                 gpu_file: str | None = None):
        self.index = index
        self.log_path = os.path.join(log_dir, f"worker-{index}.log")
        self.log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "fastattn._warm_worker"] + ([] if device is None else ["--device", str(device)])
        cmd += ["--verify"] if verify else []
        cmd += ["--for", gpu_file] if gpu_file is not None else []  # (absolute: the cwd is log_dir)
        # cwd: `python -m` puts it first on sys.path; from a source checkout that would
        # shadow the installed fastattn with an unbuilt one. FASTATTN_RECORD dropped: a
        # pre-warm is not the workload it records (fastattn._record).
        env = {k: v for k, v in os.environ.items() if k != "FASTATTN_RECORD"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, bufsize=0,
                                     cwd=log_dir, env=env)
        self.buffer = b""
        self.item: WarmItem | None = None
        self.started = 0.0
        self.timed_out = False

    def send(self, item: WarmItem) -> None:
        self.item, self.started = item, time.perf_counter()
        self.proc.stdin.write((item.config.to_json() + "\n").encode())

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def tail(self, lines: int = 5) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")
        except OSError:
            return ""


def kernel_family(config: AttentionConfig) -> tuple:
    """What a config's kernels likely depend on: the fields the field registry marks as
    selecting kernel variants (`family` in fastattn.config). cuDNN compiles each kernel
    variant once per process and reuses it for other shapes, so the first config of a
    head dim takes far longer to build than later sequence lengths, batch sizes and head
    counts (measured: docs/history/benchmarks-log.md, "The fastattn command").
    A guess used only to schedule: a wrong one costs time, never correctness."""
    return _fields.kernel_family(FIELDS, config)


class _Queue:
    """The configs left, by kernel family. A worker keeps to families it has compiled;
    a new worker takes a family nobody has, else helps with the family that has the
    most configs left per worker on it, when that is worth compiling its kernels again
    (STEAL_AT configs or more each)."""

    # A family's first config costs as much as many later ones (see kernel_family), and
    # processes compiling at once slow each other: sharing families early made warm
    # slower, not faster (measured on the H200 with 64 configs in 4 families: workers' CPU
    # time grew from 12 s on 1 worker to 57 s on 16 when every worker took any config;
    # docs/history/benchmarks-log.md, "The fastattn command").
    STEAL_AT = 16

    def __init__(self, items: list[WarmItem]):
        self.groups: dict[tuple, list[WarmItem]] = {}
        for item in reversed(items):  # pop() from the end keeps the given order
            self.groups.setdefault(kernel_family(item.config), []).append(item)
        self.owners: dict[tuple, set[int]] = {g: set() for g in self.groups}
        self.order = {g: i for i, g in enumerate(self.groups)}  # ties go to the family met first
        # Families nobody works on, the largest first: a heap, so that a take costs a
        # pop, not a scan of every family (a scan per take makes a run of
        # single-config families quadratic). Entries go stale when a family is taken; take skips those.
        self.fresh = [(-len(v), self.order[g], g) for g, v in self.groups.items()]
        heapq.heapify(self.fresh)
        self.current: dict[int, tuple] = {}  # worker -> the family it works on

    def __len__(self) -> int:
        return sum(len(v) for v in self.groups.values())

    def take(self, worker: int) -> WarmItem | None:
        g = self.current.get(worker)
        if g is None or not self.groups[g]:
            g = self._family_for(worker)
            if g is None:
                return None
            self.owners[g].add(worker)
            self.current[worker] = g
        return self.groups[g].pop()

    def _family_for(self, worker: int) -> tuple | None:
        """A family for a worker whose own are done: the largest nobody has, else the
        one with the most configs left per worker, if worth compiling again."""
        while self.fresh:
            size, _, g = heapq.heappop(self.fresh)
            if not self.owners[g] and len(self.groups[g]) == -size:
                return g
        left = [g for g in self.groups if self.groups[g]]
        if not left:
            return None
        g = max(left, key=lambda g: len(self.groups[g]) / len(self.owners[g]))
        return g if len(self.groups[g]) / len(self.owners[g]) >= self.STEAL_AT else None

    def drain(self) -> list[WarmItem]:
        """Every config left, taken off the queue."""
        out = [item for items in self.groups.values() for item in reversed(items)]
        for items in self.groups.values():
            items.clear()
        return out

    def forget(self, worker: int) -> None:
        """A worker is gone: its families are free for others."""
        self.current.pop(worker, None)
        for g, owners in self.owners.items():
            if worker in owners:
                owners.discard(worker)
                if not owners and self.groups[g]:
                    heapq.heappush(self.fresh, (-len(self.groups[g]), self.order[g], g))


def _apply(item: WarmItem, msg: dict, elapsed: float) -> None:
    item.seconds = elapsed
    if "key" in msg:  # built now by the worker, and stored if the cache took it
        item.built_now, item.key = True, msg["key"]
    if "error" in msg:
        item.status, item.error_type, item.reason = "failed", msg["error"], msg.get("message", "")
        return
    item.forward_engine, item.backward_engine = msg.get("forward_engine", ""), msg.get("backward_engine", "")
    item.build_seconds = float(msg.get("build_seconds", 0.0))
    item.verdict = msg.get("verdict")
    if not msg["supported"]:
        rejected = (item.verdict or {}).get("status") == "failed"
        item.status, item.reason = REJECTED if rejected else "unsupported", msg.get("reason", "")
    else:
        item.status = "loaded" if msg.get("source") in ("disk", "remote", "memory") else "built"


def _crashed(item: WarmItem, worker: _Worker, elapsed: float, timeout: float) -> None:
    rc = worker.proc.wait()
    item.seconds = elapsed
    item.status = "failed"
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else f"signal {-rc}"
        item.error_type, item.reason = name, f"the worker process was killed by {name}"
    else:
        item.error_type, item.reason = "exit", f"the worker process exited with code {rc}"
    if worker.timed_out:
        # The limit it broke, as given (--timeout 3 is "3 s"), not the moment its death was seen.
        item.error_type, item.reason = "timeout", f"no answer after {timeout:g} s: the worker was killed"
    tail = worker.tail()
    if tail:
        item.reason += f"; its last output: {tail}"


def _answer_from_cache(items: list[WarmItem], device: int | None, cache, verify: bool = False):
    """Settles, and yields, each item whose answer the persistent cache already holds
    (with verify, a plan only where its entry holds a verdict: the others go to a
    worker, which verifies them).
    `cache` is the one the workers use (the FASTATTN_CACHE_* variables now), and reading
    entries builds and deserializes nothing, so this is safe outside a worker. Where
    the GPU stack cannot even start here, the workers report why."""
    from . import runtime

    for item in items:
        t0 = time.perf_counter()
        try:
            known = runtime.stored_answer(item.config, device=device, cache=cache)
        except FastAttnError:
            return
        if known is None or (verify and known.supported and known.verdict is None):
            continue
        item.seconds = time.perf_counter() - t0
        item.forward_engine, item.backward_engine = known.forward_engine, known.backward_engine
        item.verdict = known.verdict.to_dict() if known.verdict is not None else None
        if known.supported:
            item.status = "loaded"
        else:
            rejected = known.verdict is not None and known.verdict.status == "failed"
            item.status, item.reason = REJECTED if rejected else "unsupported", known.reason
        yield item


class _Pool:
    """Worker processes working through a _Queue: at most `size` at once, started only
    while there is work for a new one, each fed its next config as it answers, replaced
    when it crashes or is killed for a timeout. run() drives it until the queue is
    empty and every worker has answered or died."""

    def __init__(self, queue: _Queue, size: int, device: int | None, timeout: float, log_dir: str,
                 settle: Callable[[WarmItem], None], verify: bool = False,
                 no_gpu: Callable[[WarmItem], bool] = lambda item: False, gpu_file: str | None = None):
        self.queue, self.size, self.device, self.timeout, self.log_dir = queue, size, device, timeout, log_dir
        self.verify, self.gpu_file = verify, gpu_file
        self.settle = settle  # called once per item answered or failed
        self.no_gpu = no_gpu  # whether an answer says no config can run here (then the rest are not sent)
        self.not_tried = 0  # configs settled without a worker, after such an answer
        self.workers: list[_Worker] = []
        self.spawned = 0
        self.sel = selectors.DefaultSelector()
        self.warnings: dict[str, None] = {}  # what the workers logged, each message once, in order

    # How long an interrupted run gives its workers to end on SIGTERM (between two Python
    # steps: an entry being written is removed) before SIGKILL (one inside a cuDNN build
    # runs no Python until the build returns).
    STOP_GRACE = 0.5

    def run(self) -> None:
        with self.sel:
            try:
                self._start_workers()
                while self.workers:
                    self._kill_overdue()
                    for key, _ in self.sel.select(timeout=self._until_next_deadline()):
                        self._read(key.data)
                    self._start_workers()  # a retired worker may have left a family for a new one
            except BaseException:  # interrupted (SIGINT, SIGTERM), or a bug: no worker goes on building
                self._stop_all()
                raise

    def _stop_all(self) -> None:
        for w in self.workers:
            with contextlib.suppress(OSError):
                w.proc.terminate()
        deadline = time.monotonic() + self.STOP_GRACE
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            for stream in (w.proc.stdin, w.proc.stdout):
                with contextlib.suppress(OSError):
                    stream.close()
            w.log.close()
        self.workers.clear()

    def _give_up(self, answer: WarmItem) -> None:
        """No config can run here (`answer` says why): each one left fails with the same
        reason, unsent; the workers already asked finish theirs."""
        for item in self.queue.drain():
            item.status, item.error_type, item.reason = "failed", answer.error_type, answer.reason
            self.not_tried += 1
            self.settle(item)

    def _start_workers(self) -> None:
        while len(self.workers) < self.size:
            item = self.queue.take(self.spawned)
            if item is None:
                return
            w = _Worker(self.device, self.log_dir, self.spawned, self.verify, self.gpu_file)
            self.spawned += 1
            self.workers.append(w)
            self.sel.register(w.proc.stdout, selectors.EVENT_READ, w)
            self._send(w, item)

    @staticmethod
    def _send(w: _Worker, item: WarmItem) -> None:
        try:
            w.send(item)
        except (BrokenPipeError, OSError):
            pass  # it died before reading: its EOF reports it

    def _retire(self, w: _Worker) -> None:
        self.sel.unregister(w.proc.stdout)
        self.workers.remove(w)
        self.queue.forget(w.index)
        w.close()

    def _until_next_deadline(self) -> float:
        """How long to wait for answers before a worker is due to be killed (at most 1 s)."""
        now = time.perf_counter()
        due = [w.started + self.timeout - now for w in self.workers if w.item is not None and not w.timed_out]
        return max(0.0, min(due + [1.0]))

    def _kill_overdue(self) -> None:
        now = time.perf_counter()
        for w in self.workers:
            if w.item is not None and not w.timed_out and now - w.started >= self.timeout:
                w.timed_out = True
                w.proc.kill()  # its EOF reports the config

    def _read(self, w: _Worker) -> None:
        chunk = os.read(w.proc.stdout.fileno(), 1 << 16)
        if not chunk:  # the worker died
            item = w.item
            self._retire(w)
            if item is not None:
                _crashed(item, w, time.perf_counter() - w.started, self.timeout)
                self.settle(item)
            self._start_workers()
            return
        w.buffer += chunk
        while b"\n" in w.buffer and w.item is not None:
            line, w.buffer = w.buffer.split(b"\n", 1)
            item = w.item
            msg = json.loads(line)
            self.warnings.update(dict.fromkeys(msg.get("warnings", ())))
            _apply(item, msg, time.perf_counter() - w.started)
            self.settle(item)
            if item.status == "failed" and self.no_gpu(item):
                self._give_up(item)
            nxt = self.queue.take(w.index)
            if nxt is None:
                w.item = None
                self._retire(w)
                return
            self._send(w, nxt)


def warm(
    configs: Sequence[AttentionConfig],
    *,
    workers: int | None = None,
    device: int | None = None,
    progress: Callable[[int, int, WarmItem], None] | None = None,
    timeout: float = 600.0,
    verify: bool = False,
    gpu_file: str | None = None,
) -> WarmReport:
    """Loads or builds every config in `workers` processes (default: up to 8, at most
    one per config), storing what is built in the persistent cache. Configs the cache
    already holds are answered here without a worker. What a worker built and the main
    cache directory does not hold at the end (it cannot be written, or keeps nothing)
    is counted in the report's not_saved, with the reason and the workers' warnings. Workers keep to configs of the
    same kernel family (kernel_family), whose compiled kernels a process reuses, so
    fewer workers than asked may start. A config that takes longer than `timeout`
    seconds has its worker killed and is reported failed. verify: each plan is also
    verified (fastattn.verify, in the workers; entries that hold a verdict need no
    second run); one that fails is refused with the evidence, status "rejected". Never
    raises for a config cuDNN refuses or a worker fails: refusals and failures are in
    the report. Where a worker answers that there is no usable GPU stack (LibraryError,
    CudaError) and this process finds none either, the configs left are not sent: each
    fails with that answer's reason (counted in the report's not_tried). Raises
    InvalidArgumentError, before any worker starts, for a bad argument (a config that
    is not one, workers, device, timeout, verify, progress, gpu_file).

    gpu_file: build for the GPU that file describes (fastattn.target: `fastattn info
    --export-gpu FILE` wrote it there), here, with or without a GPU: each plan is
    stored under the key that GPU's processes use. Refusals are reported, not stored
    (the GPU gives its own verdict); not with device or verify, which need a GPU here."""
    if workers is None:
        workers = min(8, os.cpu_count() or 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgumentError(f"workers={_fields.show(workers)}: must be an integer >= 1")
    # Every argument here, before a worker starts: a worker would report a bad one as a
    # failure of each config (timeout=-1 would "kill" them all; device="x" would be each one's usage error).
    seconds = _fields.number("timeout", timeout)
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidArgumentError(f"timeout={_fields.show(timeout)}: must be a finite number of seconds > 0")
    _fields.check("bool", "verify", verify)
    if progress is not None and not callable(progress):
        raise InvalidArgumentError(f"progress={_fields.show(progress)}: must be a function (done, total, item) or "
                                   "None")
    from . import runtime

    runtime.check_device(device)
    items = [WarmItem(c) for c in runtime.check_configs(configs)]
    gpu = None
    if gpu_file is not None:
        from . import target

        if device is not None or verify:
            raise InvalidArgumentError(f"gpu_file: builds for another GPU, so device={_fields.show(device)} and "
                                       f"verify={_fields.show(verify)} (which need a GPU here) must be left out")
        gpu = target.read(gpu_file)
        gpu_file = os.path.abspath(gpu_file)
    # bad FASTATTN_CACHE_* values raise here, once, naming the variable
    cache = runtime.open_plan_cache(gpu=gpu.key_fields() if gpu is not None else None)
    t0 = time.perf_counter()
    done = 0

    def settle(item: WarmItem) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, len(items), item)

    # What the cache already holds needs no worker: a second run costs one process's
    # GPU initialization and a read of each entry, not a worker start per config.
    # (For another GPU the workers look: the keys hold the cuDNN version a worker loads,
    # which this process may not, where no driver lets it.)
    for item in _answer_from_cache(items, device, cache, verify) if gpu is None else ():
        settle(item)
    queue = _Queue([i for i in items if i.status == "pending"])
    with _log_folder() as log_dir:
        # (building for another GPU needs none here: no answer means there is none)
        no_gpu = _NoGpu(device) if gpu is None else (lambda item: False)
        pool = _Pool(queue, workers, device, seconds, log_dir, settle, verify, no_gpu, gpu_file)
        pool.run()
    counts = {s: sum(1 for i in items if i.status == s) for s in STATUSES}
    rejected = sum(1 for i in items if i.status == REJECTED)
    if verify or rejected:
        counts[REJECTED] = rejected
    warnings = list(pool.warnings)
    not_saved, why = _check_saved(items, cache, warnings)
    return WarmReport(items, time.perf_counter() - t0, workers, counts, pool.spawned, not_saved, why, warnings,
                      verify, pool.not_tried)


# The workers' log folder, in the temporary directory: fastattn-warm-<random>/, with an
# owner.lock that its run holds (flock) while it lives.
_LOG_PREFIX, _OWNER = "fastattn-warm-", "owner.lock"
# A folder without its owner.lock (a run killed between making the folder and the lock),
# older than this, is no running warm's either.
_STALE_SECONDS = 3600.0


@contextlib.contextmanager
def _log_folder():
    """A private folder for the workers' logs, removed at the end of the run, however it
    ends but SIGKILL; what a killed run left, another removes (_remove_stale_log_folders)."""
    import fcntl
    import shutil

    _remove_stale_log_folders()
    folder = tempfile.mkdtemp(prefix=_LOG_PREFIX)
    try:
        # Locked before it has its name: another run never sees an owner.lock nobody holds.
        fresh = os.path.join(folder, "." + _OWNER)
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(fresh, os.path.join(folder, _OWNER))
            yield folder
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _remove_stale_log_folders() -> None:
    """Removes the log folders that warm runs killed by SIGKILL (or a crash) left in the
    temporary directory: folders of this user named as _log_folder names them whose
    owner.lock nobody holds (the kernel drops a flock with its holder), or that have
    none and are old. Anything else is left alone: a running warm's folder, a file or a
    link of that name, another user's folder."""
    import fcntl
    import shutil

    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(_LOG_PREFIX)]
    except OSError:
        return
    for name in names:
        folder = os.path.join(root, name)
        try:
            st = os.lstat(folder)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        try:
            fd = os.open(os.path.join(folder, _OWNER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if time.time() - st.st_mtime > _STALE_SECONDS:
                shutil.rmtree(folder, ignore_errors=True)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a running warm's
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)


class _NoGpu:
    """Whether a worker's failure says that no config can run here: a LibraryError or a
    CudaError (what a machine without a usable GPU stack answers), where this process
    cannot reach the GPU either (asked once, at the first such answer). Where it can,
    the failure is that config's own (a graph sub-library only it needs, a CUDA error
    it alone causes), and the other configs still go to workers."""

    ERRORS = ("LibraryError", "CudaError")

    def __init__(self, device: int | None):
        self.device = device
        self.here: bool | None = None

    def __call__(self, item: WarmItem) -> bool:
        if item.error_type not in self.ERRORS:
            return False
        if self.here is None:
            from . import runtime
            from .errors import CudaError, LibraryError

            try:
                runtime.device_info(self.device)
                self.here = False
            except (LibraryError, CudaError):
                self.here = True
            except FastAttnError:  # a device this process does not see: the workers' answers say so
                self.here = False
        return self.here


def _check_saved(items: list[WarmItem], cache, warnings: list[str]) -> tuple[int, str]:
    """Marks each answer a worker built as saved or not: whether the main cache directory
    holds its entry now, at the end of the run, where the next run will look (a write
    that failed is not, nor an entry pruned at once). Returns how many are not, and why.
    Reads no entry and needs no GPU: the workers named the keys."""
    built = [i for i in items if i.built_now]
    for item in built:
        item.saved = item.key is not None and cache.store.signature(item.key) is not None
    lost = sum(1 for i in built if not i.saved)
    if not lost:
        return 0, ""
    settings = cache.settings
    if settings.mode != "read-write":
        return lost, f"FASTATTN_CACHE_MODE={settings.mode}: nothing is stored"
    writes = [w for w in warnings if "cannot write" in w or "not storing" in w]
    if writes:
        return lost, writes[0]  # the workers' own words: the directory and the OS's error
    limit = (f"pruned at once by FASTATTN_CACHE_MAX_BYTES={settings.max_bytes}, or removed by another process"
             if settings.max_bytes is not None else "removed by another process")
    from .files import shown

    return lost, f"written, but not in {shown(settings.directory)} at the end of the run ({limit})"
