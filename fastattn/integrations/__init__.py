"""Adapters to other libraries' conventions, each over fastattn's public API (fastattn.torch's
entry points, fastattn.plan), never the store or _core: flash, FlashAttention 2's functions
(imported by its public name, `fastattn.flash`); transformers, attn_implementation="fastattn"
for HuggingFace transformers (importing it registers the name).

Each adapter is imported on demand: `import fastattn.integrations` imports none of them.
"""

__all__: list[str] = []
