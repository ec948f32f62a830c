"""fastattn.flash: FlashAttention 2's functions on cuDNN's fused attention, under the name
users import (`from fastattn.flash import flash_attn_func`). The adapter is
fastattn.integrations.flash (its docstring says what it does and what differs from
FlashAttention); this module re-exports its public names.
"""

from ..integrations.flash import *  # noqa: F403 - its __all__, which type checkers read too
from ..integrations.flash import __all__, standard_alibi_slopes  # noqa: F401 - the slopes: named in its errors
