"""`flash_attn.layers`: only `rotary` (apply_rotary_emb), which FlashAttention's tests use
as the reference for flash_attn_with_kvcache's rotary embedding."""
