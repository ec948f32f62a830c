"""A stand-in for fastattn._core on machines without a GPU: builds "plans" whose blobs
are derived from the config, so the runtime and the persistent cache can be tested
for real (keys, entries, locks, counters) without cuDNN.

FAKE_BUILD_LOG: a file that gets one line per build (to count builds across processes).
FAKE_BUILD_SECONDS: how long a build takes (default 0.01).
FAKE_VERIFY_LOG: a file that gets one line per verification (`verify`, the stand-in for
fastattn.verify.verify_plan).
FAKE_NO_GPU: set, the process has no usable GPU stack: every device query raises the
LibraryError a machine without one gives.
"""

import hashlib
import os
import signal
import time

from fastattn import _slots, defects
from fastattn.errors import CorruptPlanError, LibraryError, NotSupportedError

CUDNN_VERSION = [91900]
PASSED_ON = []  # the device of each pass_on_handle() call
KERNELS_LOADED = []  # the config of each FakePlan.load_kernels() call
SLOT_NAMES = tuple(s.name for s in sorted((s for s in _slots.SLOTS if s.index is not None), key=lambda s: s.index))
GPU_NAME = ["Fake GPU (tests/fake_core.py)"]  # never a real GPU's: fake entries must not match real ones


class FakePlan:
    def __init__(self, cfg, device, forward, backward, engines=("fake_fwd", "fake_bwd")):
        self.config, self.device = cfg, device
        self._blobs = (forward, backward)
        self.forward_workspace_size = 256
        self.backward_workspace_size = 1024 if cfg.training else 0
        self.forward_engine = engines[0]
        self.backward_engine = engines[1] if cfg.training else None
        self.workspace_size = max(self.forward_workspace_size, self.backward_workspace_size)
        # As _core's plans: the defect registry's decision for this cuDNN and GPU.
        self.defects = defects.decide(cfg, CUDNN_VERSION[0], get_device_info(device)["compute_capability"])

    def serialize(self):
        return self._blobs

    def load_kernels(self):
        KERNELS_LOADED.append(self.config)

    def output(self):
        """What running the plan would give: a function of the blobs alone."""
        return hashlib.sha256(b"|".join(b or b"" for b in self._blobs)).hexdigest()


def _blob(cfg, direction):
    return f"{direction}:{cfg.to_json()}:{CUDNN_VERSION[0]}".encode() * 20


def build_plan(cfg, device):
    with open(os.environ.get("FAKE_BUILD_LOG", os.devnull), "a") as f:
        f.write(f"{os.getpid()} {cfg.to_json()}\n")
    time.sleep(float(os.environ.get("FAKE_BUILD_SECONDS", "0.01")))
    if cfg.head_dim_qk == 72:  # stands for a config that crashes cuDNN
        os.kill(os.getpid(), signal.SIGSEGV)
    if cfg.head_dim_qk == 80:  # stands for a config that hangs
        time.sleep(3600)
    if cfg.head_dim_qk == 1024:
        raise NotSupportedError("forward: fake cuDNN refuses head_dim_qk=1024")
    return FakePlan(cfg, device, _blob(cfg, "forward"), _blob(cfg, "backward") if cfg.training else None)


def load_plan(cfg, device, forward, backward=None, forward_engine="", backward_engine=""):
    if forward != _blob(cfg, "forward") or (cfg.training and backward != _blob(cfg, "backward")):
        raise CorruptPlanError("forward: fake cuDNN rejects this blob")
    return FakePlan(cfg, device, forward, backward, (forward_engine, backward_engine))


def pass_on_handle(device):
    PASSED_ON.append(device)


def get_device_info(device):
    return {"name": GPU_NAME[0], "compute_capability": (9, 0), "sm_count": 132, "driver_version": 13000,
            "runtime_version": 13000}


def _no_gpu():
    if os.environ.get("FAKE_NO_GPU"):
        raise LibraryError("fastattn cannot use the GPU:\n  - fake: libcuda.so.1 is missing (FAKE_NO_GPU)")


def get_device_count():
    _no_gpu()
    return 2


def get_current_device():
    _no_gpu()
    return 0


def versions():
    return CUDNN_VERSION[0], 91900, 12800


def policy():
    return "heuristics=A,FALLBACK;build=HEURISTICS_CHOICE"


def install(runtime):
    """Makes `runtime` use this module instead of the extension."""
    runtime._core = lambda: __import__("fake_core")
    runtime._verify = verify


def verify(plan, config, device):
    """What fastattn.verify.verify_plan answers, without a GPU: a pass, except for
    head_dim_qk=96, which stands for a plan that computes wrong answers (NaN d_q on the
    low_lse data, as cuDNN 9.19's SM90 backward did)."""
    from fastattn.verdict import TOLERANCE, Check, Verdict

    with open(os.environ.get("FAKE_VERIFY_LOG", os.devnull), "a") as f:
        f.write(f"{os.getpid()} {config.to_json()}\n")
    tol = TOLERANCE.get(config.dtype, TOLERANCE["bf16"])
    outputs = ("o", "d_q", "d_k", "d_v") if config.training else ("o",)
    checks = [Check(kind, name, 1e-3, 1.0, 0) for kind in ("random", "low_lse") for name in outputs]
    if config.head_dim_qk == 96:
        checks[-1] = Check("low_lse", outputs[-1], 0.75, 1.0, 4096)
    return Verdict.judge(checks, CUDNN_VERSION[0], tol, 0.02)
