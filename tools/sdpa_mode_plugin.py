"""A pytest plugin that runs a session of someone else's tests (PyTorch's own
test/test_transformers.py) with the SDPA mode on or off, and keeps a deterministic sample
of the test classes too large to run whole. tools/pytorch_sdpa_tests.py loads it in both of
its runs (`-p sdpa_mode_plugin`, tools/ on PYTHONPATH), so the two runs collect and keep the
same tests.

  --sdpa-mode on|off       on: fastattn.torch.enable_sdpa() before any test is collected
                           (the test file's import-time checks already see the mode), for
                           the whole session; off: fastattn is not imported at all.
  --sdpa-stats PATH        at the session's end, a JSON file: the mode, which kernels it
                           registered (the op library's C++ ones or the Python ones) and
                           fastattn.stats()["sdpa"] (calls served, and passed on by reason).
  --sdpa-sample CLASS=F    keep a fraction F (0..1) of the tests collected in CLASS (a
                           class name, e.g. TestSDPACudaOnlyCUDA), chosen by a hash of each
                           test's name, so the same tests in every run and on every machine;
                           may be given once per class.
  --sdpa-always SUBSTR     keep every test of a sampled class whose name holds SUBSTR (may
                           be given more than once), whatever the hash says.
  --sdpa-deadline EPOCH    start no test after this time (seconds since the epoch, so that
                           two processes share it): the session ends between two tests, and
                           its JUnit file holds only tests that finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import pytest

# What enable_sdpa() registered, decided once in pytest_configure; None while the mode is off.
_kernels: str | None = None
# Whether the session ended at --sdpa-deadline, with tests left.
_stopped = False


def pytest_addoption(parser):
    group = parser.getgroup("sdpa_mode", "fastattn's SDPA mode over another suite")
    group.addoption("--sdpa-mode", choices=("on", "off"), default="off",
                    help="on: fastattn.torch.enable_sdpa() for the whole session")
    group.addoption("--sdpa-stats", default=None, metavar="PATH",
                    help="write the mode's call counts (fastattn.stats()['sdpa']) here as JSON")
    group.addoption("--sdpa-sample", action="append", default=[], metavar="CLASS=FRACTION",
                    help="keep this fraction of CLASS's tests, chosen by a hash of their names")
    group.addoption("--sdpa-always", action="append", default=[], metavar="SUBSTR",
                    help="keep every test of a sampled class whose name holds SUBSTR")
    group.addoption("--sdpa-deadline", type=float, default=None, metavar="EPOCH",
                    help="start no test after this time (seconds since the epoch)")


def parse_samples(values: list[str]) -> dict[str, float]:
    """{class name: fraction} from --sdpa-sample's CLASS=FRACTION values; a malformed one
    is a usage error (pytest.UsageError), not a silent full run."""
    samples = {}
    for value in values:
        name, sep, fraction = value.partition("=")
        try:
            f = float(fraction)
        except ValueError:
            f = -1.0
        if not sep or not name or not 0.0 <= f <= 1.0:
            raise pytest.UsageError(f"--sdpa-sample {value!r}: expected CLASS=FRACTION with FRACTION in [0, 1]")
        samples[name] = f
    return samples


def kept(nodeid: str, fraction: float) -> bool:
    """Whether a sampled test stays: its name's sha256 (not Python's hash, which changes
    per process) below the fraction, so both runs and every machine keep the same ones."""
    h = int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:8], "big")
    return h < fraction * 2**64


def pytest_configure(config):
    global _kernels
    if config.getoption("--sdpa-mode") != "on":
        return
    # Before collection: the test module reads backend flags and builds its parameters
    # at import, and each test must meet the mode from its first call.
    import fastattn.torch
    from fastattn.torch import _sdpa_mode

    fastattn.torch.enable_sdpa()
    _kernels = "native" if _sdpa_mode._native_kernels is not None else "python"
    print(f"sdpa_mode_plugin: the SDPA mode is on ({_kernels} kernels)", file=sys.stderr)


def pytest_collection_modifyitems(config, items):
    samples = parse_samples(config.getoption("--sdpa-sample"))
    if not samples:
        return
    always = config.getoption("--sdpa-always")
    keep, drop = [], []
    for item in items:
        cls = item.cls.__name__ if item.cls is not None else None
        if cls not in samples or any(s in item.name for s in always) or kept(item.nodeid, samples[cls]):
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    global _stopped
    deadline = item.config.getoption("--sdpa-deadline")
    if deadline is not None and nextitem is not None and time.time() > deadline:
        # Between two tests, so that every test reported ran to its end.
        _stopped = True
        item.session.shouldstop = "sdpa_mode_plugin: the deadline (--sdpa-deadline) has passed"


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--sdpa-stats")
    if not path:
        return
    body = {"mode": session.config.getoption("--sdpa-mode"), "kernels": _kernels, "exitstatus": int(exitstatus),
            "stopped_at_deadline": _stopped}
    if _kernels is not None:
        import fastattn
        import torch

        body["sdpa"] = fastattn.stats()["sdpa"]
        body["torch"] = torch.__version__
        body["fastattn"] = fastattn.__version__
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
