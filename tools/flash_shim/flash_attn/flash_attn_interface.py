"""`flash_attn.flash_attn_interface`: the same seven functions (fastattn.flash's), and
_get_block_size_n, which FlashAttention's tests call only to read back its S_dmask."""

from . import (  # noqa: F401 - re-exported under FlashAttention's module name
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """FlashAttention's key-block width, which its tests need only to decode the S_dmask its
    kernels return with dropout (normalize_flash_attn_S). fastattn.flash returns no S_dmask
    with dropout (it refuses return_attn_probs=True with dropout_p > 0 first), so a call
    here means a test got past that refusal: say so rather than return a width that
    describes no fastattn kernel."""
    raise NotImplementedError("_get_block_size_n: fastattn.flash has no S_dmask with dropout (it refuses "
                              "return_attn_probs=True with dropout_p > 0), so FlashAttention's block width "
                              "describes nothing here")
