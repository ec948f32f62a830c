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

The package: one module per entry point (_dense: attention, _varlen: attention_varlen,
_paged: attention_paged), _plans for what they share (the tensor-signature -> plan
table, workspaces per stream, the current stream), and _autograd, the one autograd
definition that plain eager calls and the custom ops both use.
"""

from __future__ import annotations

from ._dense import attention
from ._paged import attention_paged
from ._varlen import attention_varlen

__all__ = ["attention", "attention_paged", "attention_varlen"]
