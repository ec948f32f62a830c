"""fastattn: cuDNN's fused attention with its plans built once, probed honestly, run cheaply.

    import fastattn
    cfg = fastattn.AttentionConfig(batch=1, heads_q=32, seqlen_q=4096, head_dim_qk=128,
                                   mask="causal", dtype="bf16")
    result = fastattn.probe(cfg)          # supported? cuDNN's reason if not
    p = fastattn.plan(cfg)                # built once per process
    p.forward(q, k, v, o, workspace=ws, stream=s)   # device arrays (checked) or addresses (ints)

Importing fastattn loads no CUDA library; the first GPU call does (fastattn._loader).
"""

from ._arrays import DeviceTensor
from ._version import __version__
from .config import AttentionConfig
from .errors import (
    CorruptPlanError,
    CudaError,
    CudnnError,
    FastAttnError,
    InternalError,
    InvalidArgumentError,
    LibraryError,
    NotSupportedError,
    VerificationFailedError,
)
from .runtime import ProbeResult, clear, configure, device_info, plan, preload, probe, stats, versions

__all__ = [
    "AttentionConfig",
    "DeviceTensor",
    "ProbeResult",
    "probe",
    "plan",
    "preload",
    "configure",
    "stats",
    "clear",
    "device_info",
    "versions",
    "FastAttnError",
    "InvalidArgumentError",
    "NotSupportedError",
    "VerificationFailedError",
    "LibraryError",
    "CudaError",
    "CudnnError",
    "CorruptPlanError",
    "InternalError",
    "__version__",
]
