"""fastattn for PyTorch: drop-in attention functions with autograd, torch.compile and
CUDA graphs. Imported on demand (`import fastattn.torch`); `import fastattn` never
imports PyTorch.

    from fastattn.torch import attention
    o = attention(q, k, v, causal=True)          # q: (batch, seq, heads, dim), like FlashAttention

Each entry point is a pair of custom ops (forward and backward; paged: forward only)
with fake (meta) implementations and a registered autograd formula, so that
torch.compile(fullgraph=True) traces them without a graph break. They run on PyTorch's
current stream, take their workspace from PyTorch's caching allocator and never
synchronize, so a call can be captured in a CUDA graph after one warm-up call.

FP8: `attention_fp8` / `attention_fp8_backward` take torch.float8_e4m3fn or
float8_e5m2 tensors with their scales as tensors and return the amaxes;
`attention_fp8_scaled(q, k, v)` quantizes 16-bit tensors itself (current scaling) and
has autograd.

`scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, *,
scale, enable_gqa)` takes torch.nn.functional.scaled_dot_product_attention's arguments
and gives its result, running attention() with the cheapest exact form of the mask.
`enable_sdpa()` / `disable_sdpa()` make torch.nn.functional.scaled_dot_product_attention
itself run on fastattn where PyTorch would run its cuDNN backend (the SDPA mode,
_sdpa_mode); FASTATTN_SDPA=1 enables it when this package is imported. Importing
fastattn.torch changes nothing in PyTorch otherwise.

Importing it starts the warm-up (fastattn/_warm_up.py; FASTATTN_WARM_UP=off turns it off):
a background thread loads cuDNN and the op library, then, once the process has made a
CUDA context, the plans this GPU's cache used most recently, so that the first calls find
them in memory. It makes no CUDA call before the process does and builds nothing.

The package: _api, the entry points attention, attention_varlen and attention_paged as users
call them (signatures, checks, options); _specs, one spec per op (its tensors and the plan
slots they fill, its outputs, what backward returns, its options by config field);
_executor, the one executor made from a spec (the Python path's work, the custom ops and
their fake kernels, the one autograd definition that plain eager calls and the custom ops
both use); one module per op (_dense, _varlen, _paged: plan keys, configs, checks);
_fp8: the FP8 ops, _fp8_scaled: the scaling helper, _sdpa: scaled_dot_product_attention,
on attention(); _plans for what they share (the tensor-signature -> plan table,
workspaces per stream, the current stream). `backend_info()` says
which path the entry points take (the native C++ op library or the Python path) and why.
"""

from __future__ import annotations

from typing import Any

from ._api import attention, attention_paged, attention_varlen
from ._fp8 import Fp8Grads, Fp8Output, attention_fp8, attention_fp8_backward
from ._fp8_scaled import attention_fp8_scaled
from ._sdpa import scaled_dot_product_attention
from ._sdpa_mode import disable_sdpa, enable_sdpa, sdpa_enabled

__all__ = ["attention", "attention_paged", "attention_varlen", "attention_fp8", "attention_fp8_backward",
           "attention_fp8_scaled", "Fp8Output", "Fp8Grads", "scaled_dot_product_attention", "enable_sdpa", "disable_sdpa", "sdpa_enabled", "backend_info"]


def backend_info(build: bool = False) -> dict[str, Any]:
    """Which path the entry points take in this process, and why (`fastattn info`,
    `fastattn warm`): the one taken, where a call has decided it, else the one the first
    call would take. Builds and loads nothing unless asked to.

    build: first compile the native op library for the imported torch where it is not
      built yet, whatever FASTATTN_TORCH_PATH says (`fastattn warm`, ahead of the first
      call). A failed build is reported in "build_error", not raised: without the
      library the Python path runs.

    Returns a dict (JSON-ready):
      path: "native" (the C++ op library), "python" (the Python path) or "none" (a call
        raises, e.g. FASTATTN_TORCH_PATH=native without a C++ compiler);
      reason: why, in one line;
      torch: the imported torch's version;
      library: where the op library for this torch is built, or would be (the folder's
        name holds what it depends on: fastattn, torch, C++ ABI and Python versions, a
        hash of its sources);
      built: whether it is there;
      build_error: with build, why it could not be built ("RuntimeError: ..."); else None.

    Raises InvalidArgumentError where the cache directory's settings are invalid (the
    library is built under it)."""
    import torch

    from . import _native

    error = None
    if build:
        try:
            _native.build()
        except Exception as e:  # the compiler's failure, or none to run: the Python path runs
            error = f"{type(e).__name__}: {e}"
    library = _native.library_path()
    return {**_native.describe(), "torch": torch.__version__, "library": str(library), "built": library.exists(),
            "build_error": error}


def _enable_from_environment() -> None:
    # Only where the user asked (FASTATTN_SDPA=1): importing fastattn.torch never changes
    # what PyTorch's SDPA runs by itself.
    from .. import env

    if env.get("FASTATTN_SDPA"):
        enable_sdpa()


def _cuda_contexts() -> list[int]:
    # The devices on which this process has made a CUDA context (the warm-up's phase 2
    # waits for one). Asked only once PyTorch has initialized CUDA itself: before that, even
    # counting devices would initialize the driver (and break CUDA in children forked later).
    import torch

    if not torch.cuda.is_initialized():
        return []
    return [i for i in range(torch.cuda.device_count()) if torch._C._cuda_hasPrimaryContext(i)]


def _warm_up() -> None:
    # The warm-up (fastattn._warm_up), unless FASTATTN_WARM_UP=off or this torch has no
    # CUDA. torch.cuda.is_available() is not asked: it would initialize the driver here.
    import torch

    from .. import _warm_up, env
    from . import _native

    setting, max_bytes = env.get("FASTATTN_WARM_UP"), env.get("FASTATTN_WARM_UP_MAX_BYTES")  # all checked here
    kernels_max_bytes = env.get("FASTATTN_WARM_UP_KERNELS_MAX_BYTES")
    if setting == "off":
        _warm_up.off("FASTATTN_WARM_UP=off")
    elif torch.version.cuda is None:
        _warm_up.off(f"this torch ({torch.__version__}) is built without CUDA: fastattn.torch runs nothing on it "
                     "to warm up for (a CUDA build of torch runs it)")
    else:
        _warm_up.start(plans=setting == "plans", contexts=_cuda_contexts, libraries=_native.load_if_built,
                       max_bytes=max_bytes, kernels_max_bytes=kernels_max_bytes)


_enable_from_environment()
_warm_up()  # last: its thread imports from this package
