"""A stand-in `flash_attn` package whose attention functions are fastattn.flash's: it lets
FlashAttention's own test file (tests/test_flash_attn.py, kept outside this repository in
the git-ignored .peer/) run unchanged against fastattn (tools/run_flash_tests.sh).

Only what that file imports is here: the seven functions, `bert_padding`'s pad_input and
unpad_input, `layers.rotary.apply_rotary_emb` and `flash_attn_interface._get_block_size_n`.
The helpers are ours, written from FlashAttention's documented semantics (their
docstrings), in plain PyTorch; nothing of fastattn is used by them, so a test's reference
does not share code with what it checks. Errors are not caught here: a NotSupportedError
from fastattn reaches the test as it is.

Not for use outside that run: put it on PYTHONPATH only there.
"""

from fastattn.flash import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

# The FlashAttention release whose API (and test file) this stands in for, marked as ours.
__version__ = "2.8.3+fastattn.shim"

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
