"""A pytest plugin (`-p fa_subset`, with tools/flash_shim on PYTHONPATH) for running
FlashAttention's tests/test_flash_attn.py against fastattn.flash in bounded time
(tools/run_flash_tests.sh runs it; fa_report.py reads what it writes).

- A deterministic subset: FA_PER_FUNC cases of each test function (0: all), drawn by
  random.Random("FA_SEED:function") from its parametrization's product (in index space,
  so the draw costs nothing and pytest makes only the drawn cases): the same cases on
  any machine, in any collection order, for a given FA_SEED. The cases are then interleaved across the functions, so that a
  run stopped by its time budget has reached every function alike.
- A time budget: no case starts after FA_DEADLINE (epoch seconds; else FA_BUDGET_S after
  this process starts); those not started are skipped as "not reached". A case that runs
  longer than FA_CASE_S seconds is interrupted (SIGALRM) and fails, saying so.
- One refusal counted apart: fastattn.flash refuses return_attn_probs=True with dropout
  (FlashAttention then returns its dropout pattern, S_dmask, which cuDNN does not
  expose), and FlashAttention's tests ask for it in every dropout case. Exactly that
  NotSupportedError is reported as xfail "refused (S_dmask)"; every other refusal, and
  every other error, is a failure with its message.
- A record per case in FA_RESULTS (JSON lines, appended and flushed as each case starts
  and ends), so a crashed process leaves the case it died in, and a rerun with the same
  FA_RESULTS skips the cases already started (tools/run_flash_tests.sh reruns after a crash).
- Shards: FA_SHARD=i/n runs every n-th case of the run's order from the i-th (0-based):
  n processes at once split one sample (tools/run_flash_tests.sh's FA_SHARDS), each with
  its own FA_RESULTS; each records the whole selection, so fa_report reads their files
  concatenated as one run's.
- Without CUDA (collection checks on a CPU machine) the test module's import-time
  torch.cuda.get_device_capability() is answered (9, 0), an H200's, so that the same
  parametrization is collected as on the device; every case then fails on "cuda" tensors.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time

import pytest

# The start of fastattn.flash's one refusal that FlashAttention's tests may meet
# (fastattn/integrations/flash/_common.py, _check_dropout).
S_DMASK_REFUSAL = "return_attn_probs=True with dropout_p > 0"
CPU_CAPABILITY = (9, 0)


class CaseTimeout(Exception):
    """A case ran past FA_CASE_S seconds."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def _shard() -> tuple[int, int]:
    """FA_SHARD as (i, n); (0, 1) when unset."""
    value = os.environ.get("FA_SHARD", "").strip()
    if not value:
        return 0, 1
    i, _, n = value.partition("/")
    try:
        i, n = int(i), int(n)
    except ValueError:
        raise pytest.UsageError(f"FA_SHARD={value!r}: expected i/n, e.g. 0/4") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"FA_SHARD={value!r}: i must be in 0 .. n - 1")
    return i, n


class _Plugin:
    def __init__(self):
        self.per_func = _env_int("FA_PER_FUNC", 30)
        self.seed = os.environ.get("FA_SEED", "0")
        deadline = os.environ.get("FA_DEADLINE", "").strip()
        self.deadline = float(deadline) if deadline else time.time() + _env_int("FA_BUDGET_S", 180)
        self.case_s = _env_int("FA_CASE_S", 60)
        self.shard = _shard()
        self.results_path = os.environ.get("FA_RESULTS") or None
        self.started = self._already_started()
        self.collected: dict[str, int] = {}  # cases per function before the sample (pytest_generate_tests)
        # function -> (its markers' (argnames, value sets), {sampled index tuple: its place in the sample})
        self.samples: dict[str, tuple[list, dict[tuple, int]]] = {}
        self._out = open(self.results_path, "a", buffering=1) if self.results_path else None

    def _already_started(self) -> set[str]:
        done = set()
        if self.results_path and os.path.exists(self.results_path):
            with open(self.results_path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:  # a line cut off by a crash
                        continue
                    if rec.get("event") == "start":
                        done.add(rec["nodeid"])
        return done

    def write(self, **rec) -> None:
        if self._out is not None:
            self._out.write(json.dumps(rec) + "\n")
            os.fsync(self._out.fileno())  # a crash (an abort in cuDNN) must not lose the last lines

    # -- selection ------------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_generate_tests(self, metafunc):
        """Draws each function's sample in index space (one index into each parametrize
        marker's values), then trims pytest's product to it while pytest builds it, marker
        by marker: the file's full product is ~500k cases (~1.25M partial ones), which take
        pytest half a minute to make. The trim reads metafunc._calls and each call's
        indices (pytest's, private but long-lived); where they are missing nothing is
        trimmed here and pytest_collection_modifyitems selects the same cases."""
        markers = list(metafunc.definition.iter_markers(name="parametrize"))
        if not markers:
            return
        func = metafunc.function.__name__
        table = [_marker_values(m) for m in markers]
        sizes = [len(values) for _, values in table]
        total = math.prod(sizes)
        self.collected[func] = total
        if self.per_func <= 0 or self.per_func >= total:
            return
        picks = random.Random(f"{self.seed}:{func}").sample(range(total), self.per_func)
        order = {}
        for rank, flat in enumerate(picks):  # a flat index, in mixed radix: one digit per marker
            digits = []
            for size in reversed(sizes):
                flat, digit = divmod(flat, size)
                digits.append(digit)
            order[tuple(reversed(digits))] = rank
        self.samples[func] = (table, order)
        prefixes = [{t[:n + 1] for t in order} for n in range(len(markers))]
        parametrize, applied = metafunc.parametrize, [0]

        def trimming_parametrize(*args, **kwargs):
            parametrize(*args, **kwargs)
            n, applied[0] = applied[0], applied[0] + 1
            calls = getattr(metafunc, "_calls", None)
            if n < len(markers) and isinstance(calls, list) and all(hasattr(c, "params") for c in calls):
                calls[:] = [c for c in calls if _index_tuple(table[:n + 1], c.params) in prefixes[n]]

        metafunc.parametrize = trimming_parametrize

    def _rank(self, item) -> int | None:
        """The item's place in its function's sample, None where it is not in it (every item
        has place 0 in a function taken whole)."""
        sample = self.samples.get(getattr(item, "originalname", item.name))
        if sample is None:
            return 0
        table, order = sample
        return order.get(_index_tuple(table, getattr(getattr(item, "callspec", None), "params", {})))

    @pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs
    def pytest_collection_modifyitems(self, config, items):
        chosen: dict[str, list] = {}
        for item in items:
            rank = self._rank(item)
            if rank is not None:
                chosen.setdefault(getattr(item, "originalname", item.name), []).append((rank, item))
        chosen = {f: [i for _, i in sorted(c, key=lambda ri: ri[0])] for f, c in chosen.items()}
        if not self.started:  # the first process of a run says what the run selected
            self.write(event="selection", seed=self.seed, per_func=self.per_func,
                       collected={f: self.collected.get(f, len(c)) for f, c in chosen.items()},
                       selected={f: [i.nodeid for i in c] for f, c in chosen.items()})
        order = []
        for rnd in range(max((len(c) for c in chosen.values()), default=0)):  # round-robin over the functions
            for cases in chosen.values():
                if rnd < len(cases):
                    order.append(cases[rnd])
        i, n = self.shard
        keep = [item for item in order[i::n] if item.nodeid not in self.started]
        kept = {id(i) for i in keep}
        dropped = [i for i in items if id(i) not in kept]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep

    # -- running --------------------------------------------------------------------------------

    def pytest_runtest_logstart(self, nodeid, location):
        self.write(event="start", nodeid=nodeid, t=time.time())

    def pytest_runtest_setup(self, item):
        if time.time() > self.deadline:
            pytest.skip("not reached: the run's time budget (FA_BUDGET_S / FA_DEADLINE) was spent")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        def expire(signum, frame):
            raise CaseTimeout(f"the case ran past FA_CASE_S={self.case_s} s and was interrupted")

        previous = signal.signal(signal.SIGALRM, expire) if self.case_s > 0 else None
        if self.case_s > 0:
            signal.alarm(self.case_s)
        try:
            yield
        finally:
            if self.case_s > 0:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        rep = outcome.get_result()
        exc = call.excinfo
        if rep.when == "call" and exc is not None and _is_s_dmask_refusal(exc.value):
            rep.outcome = "skipped"
            rep.wasxfail = f"refused (S_dmask): {exc.value}"

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.write(event="report", nodeid=report.nodeid, when=report.when, outcome=_outcome(report),
                       reason=_reason(report), duration=round(report.duration, 4))

    def pytest_report_header(self, config):
        lines = [f"fa_subset: FA_PER_FUNC={self.per_func} FA_SEED={self.seed} FA_CASE_S={self.case_s} "
                 f"FA_SHARD={self.shard[0]}/{self.shard[1]}, "
                 f"{max(0.0, self.deadline - time.time()):.0f} s of budget left, results -> {self.results_path}"]
        if _faked_capability:
            lines.append(f"fa_subset: no CUDA here: torch.cuda.get_device_capability() answers {CPU_CAPABILITY} "
                         "for collection (every case will fail on its cuda tensors)")
        return lines


def _marker_values(marker) -> tuple[list[str], list[tuple]]:
    """A parametrize marker's argnames and its value sets, each a tuple of one value per
    argname (a pytest.param's values)."""
    names = marker.args[0] if marker.args else marker.kwargs["argnames"]
    values = marker.args[1] if len(marker.args) > 1 else marker.kwargs["argvalues"]
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    sets = []
    for v in values:
        if hasattr(v, "values") and hasattr(v, "marks"):  # a pytest.param
            sets.append(tuple(v.values))
        else:
            sets.append(tuple(v) if len(names) > 1 else (v,))
    return names, sets


def _index_tuple(table, params: dict) -> tuple:
    """Which value set of each marker a case's params are: (index per marker), -1 where none
    matches. (pytest's own per-case indices are renumbered after collection: matched by
    value, by identity first, as pytest keeps the marker's objects.)"""
    out = []
    for names, sets in table:
        got = tuple(params.get(n) for n in names)
        out.append(next((j for j, s in enumerate(sets)
                         if all(a is b or (type(a) is type(b) and a == b) for a, b in zip(got, s))), -1))
    return tuple(out)


def _is_s_dmask_refusal(err: BaseException) -> bool:
    try:
        from fastattn.errors import NotSupportedError
    except ImportError:
        return False
    return isinstance(err, NotSupportedError) and str(err).startswith(S_DMASK_REFUSAL)


def _outcome(report) -> str:
    if hasattr(report, "wasxfail"):
        return "refused" if report.wasxfail.startswith("refused (S_dmask)") else "xfail"
    if report.skipped:
        reason = _reason(report)
        return "not_reached" if reason.startswith("not reached") else "skipped"
    return report.outcome  # passed, failed


def _reason(report) -> str:
    """One line: a skip's reason, or a failure's exception (or assertion) and where it was
    raised (file:line), at most 400 characters."""
    if hasattr(report, "wasxfail"):
        return report.wasxfail[:400]
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (path, lineno, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")[:400]
    crash = getattr(longrepr, "reprcrash", None)
    if crash is None:
        text = str(longrepr).strip()
        return text.splitlines()[-1][:400] if text else ""
    first = crash.message.strip().splitlines()[0] if crash.message.strip() else ""
    where = f"{os.path.basename(crash.path)}:{crash.lineno}"
    # Also the test file's line that led there (which of the test's checks or calls), where
    # the error was raised deeper (in fastattn, torch).
    test_file = os.path.basename(report.location[0])
    entries = getattr(getattr(longrepr, "reprtraceback", None), "reprentries", [])
    for entry in reversed(entries):
        loc = getattr(entry, "reprfileloc", None)
        if loc is not None and os.path.basename(loc.path) == test_file:
            if not where.startswith(f"{test_file}:"):
                where = f"{test_file}:{loc.lineno} -> {where}"
            break
    return f"{first} [{where}]"[:400]


_faked_capability = False


def _answer_capability_without_cuda() -> None:
    global _faked_capability
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        torch.cuda.get_device_capability = lambda device=None: CPU_CAPABILITY
        _faked_capability = True


def pytest_configure(config):
    _answer_capability_without_cuda()
    config.pluginmanager.register(_Plugin(), "fa_subset_plugin")
