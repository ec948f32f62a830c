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

The package: one module per entry point (_dense: attention, _varlen: attention_varlen,
_paged: attention_paged, _fp8: the FP8 ops, _fp8_scaled: the scaling helper), _plans for what they share (the tensor-signature -> plan
table, workspaces per stream, the current stream), and _autograd, the one autograd
definition that plain eager calls and the custom ops both use.
"""

from __future__ import annotations

from ._dense import attention
from ._fp8 import Fp8Grads, Fp8Output, attention_fp8, attention_fp8_backward
from ._fp8_scaled import attention_fp8_scaled
from ._paged import attention_paged
from ._varlen import attention_varlen

__all__ = ["attention", "attention_paged", "attention_varlen", "attention_fp8", "attention_fp8_backward",
           "attention_fp8_scaled", "Fp8Output", "Fp8Grads"]
