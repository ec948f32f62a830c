"""The one table of the tensors a plan takes at execute (its slots), and which of them
Plan.forward and Plan.backward take, in what order, as which kind of parameter.

tools/gen_slots.py writes from it every other spelling of a slot: the X-macro table of
fastattn/include/fastattn_abi.h (which C, C++ and, through the core, _core.SLOT_NAMES
read), the kSlot* declaration, the keyword parameters and the slot filling of
Plan.forward and Plan.backward in fastattn/_core.pyx, and their stubs in
fastattn/_core.pyi. Change a slot here, then run `python tools/gen_slots.py`.

Rows are in the order of the parameters (forward's and backward's are both this order
with the ones they do not take left out). `index` is the slot's number in the core: its
cuDNN tensor uid minus one, the order of cuDNN's sorted variant pack and of the C ABI.
A new slot takes the next free number; a number is never changed or reused (and a change
to the slots bumps FASTATTN_ABI_VERSION in fastattn_abi.h). `workspace` and `stream`
are parameters without a slot (index None).

The C and C++ names follow from `name`: "d" joins the part after it (d_o: DO), one letter
and "kv" are upper case, other parts capitalized: seq_len_kv -> SEQ_LEN_KV, kSlotSeqLenKV.
"""

from __future__ import annotations

from typing import NamedTuple

ARG = "arg"  # positional, required
OPT = "opt"  # positional or keyword, default 0
KW = "kw"  # keyword-only, default 0
NO = None  # not a parameter of this direction

_FWD_ONLY_GRAD = "a forward graph takes no gradients"
_PADDING = "the plan was built with padding=False"
_RAGGED = "the plan was built with ragged=False"
_DROPOUT = "the plan was built with dropout=0"
_PAGED = "the plan was built with page_size=0 (dense k and v)"
_CU = "only a plan built with ragged=True takes cumulative lengths"


def _fp8(what: str, name: str = "", direction: str = "") -> str:
    if not name:
        return f"only a plan with an FP8 dtype takes {what}"
    return f"only the {direction} graph of a plan with an FP8 dtype {what} {name}"


class Slot(NamedTuple):
    name: str  # the keyword, the tensor's name in errors and cuDNN's
    index: int | None  # the core's slot number (None: a parameter with no slot)
    forward: str | None  # ARG, OPT, KW or NO: how Plan.forward takes it
    backward: str | None  # the same for Plan.backward
    absent: str = ""  # why a plan may not take it (execute's error)


SLOTS = (
    # the attention tensors and their gradients
    Slot("q", 0, ARG, ARG),
    Slot("k", 1, ARG, ARG),
    Slot("v", 2, ARG, ARG),
    Slot("o", 3, ARG, ARG),
    Slot("d_o", 5, NO, ARG, _FWD_ONLY_GRAD),
    Slot("stats", 4, OPT, ARG, "the plan was built with training=False and writes no softmax stats"),
    Slot("d_q", 6, NO, ARG, _FWD_ONLY_GRAD),
    Slot("d_k", 7, NO, ARG, _FWD_ONLY_GRAD),
    Slot("d_v", 8, NO, ARG, _FWD_ONLY_GRAD),
    Slot("workspace", None, OPT, OPT),
    Slot("stream", None, OPT, OPT),
    # the features' index tensors, extra inputs and gradients
    Slot("seq_len_q", 9, OPT, OPT, _PADDING),
    Slot("seq_len_kv", 10, OPT, OPT, _PADDING),
    Slot("ragged_q", 11, KW, KW, _RAGGED),
    Slot("ragged_k", 12, KW, KW, _RAGGED),
    Slot("ragged_v", 13, KW, KW, _RAGGED),
    Slot("ragged_o", 14, KW, KW, _RAGGED),
    Slot("ragged_stats", 23, KW, KW, "only a plan built with ragged=True and training=True has packed stats"),
    Slot("bias", 15, KW, KW, "the plan was built with bias='none'"),
    Slot("d_bias", 16, NO, KW, "only a backward graph built with bias_grad=True writes d_bias"),
    Slot("seed", 17, KW, KW, _DROPOUT),
    Slot("offset", 18, KW, KW, _DROPOUT),
    Slot("sink", 19, KW, KW, "the plan was built with sinks=False"),
    Slot("d_sink", 20, NO, KW, "only the backward graph of a plan built with sinks=True writes d_sink"),
    Slot("page_table_k", 21, KW, NO, _PAGED),
    Slot("page_table_v", 22, KW, NO, _PAGED),
    # FP8's float32 scalars (fastattn_abi.h says what each means)
    Slot("descale_q", 24, KW, KW, _fp8("descales")),
    Slot("descale_k", 25, KW, KW, _fp8("descales")),
    Slot("descale_v", 26, KW, KW, _fp8("descales")),
    Slot("descale_o", 32, NO, KW, _fp8("takes", "descale_o", "backward")),
    Slot("descale_d_o", 33, NO, KW, _fp8("takes", "descale_d_o", "backward")),
    Slot("descale_s", 27, KW, KW, _fp8("descales")),
    Slot("descale_d_p", 34, NO, KW, _fp8("takes", "descale_d_p", "backward")),
    Slot("scale_s", 28, KW, KW, _fp8("scales")),
    Slot("scale_o", 29, KW, NO, _fp8("takes", "scale_o", "forward")),
    Slot("scale_d_q", 35, NO, KW, _fp8("takes", "scale_d_q", "backward")),
    Slot("scale_d_k", 36, NO, KW, _fp8("takes", "scale_d_k", "backward")),
    Slot("scale_d_v", 37, NO, KW, _fp8("takes", "scale_d_v", "backward")),
    Slot("scale_d_p", 38, NO, KW, _fp8("takes", "scale_d_p", "backward")),
    Slot("amax_s", 30, KW, NO, _fp8("writes", "amax_s", "forward")),
    Slot("amax_o", 31, KW, NO, _fp8("writes", "amax_o", "forward")),
    Slot("amax_d_q", 39, NO, KW, _fp8("writes", "amax_d_q", "backward")),
    Slot("amax_d_k", 40, NO, KW, _fp8("writes", "amax_d_k", "backward")),
    Slot("amax_d_v", 41, NO, KW, _fp8("writes", "amax_d_v", "backward")),
    Slot("amax_d_p", 42, NO, KW, _fp8("writes", "amax_d_p", "backward")),
    # a ragged plan's cumulative lengths, in place of seq_len_* and ragged_*
    Slot("cu_seqlens_q", 43, KW, KW, _CU),
    Slot("cu_seqlens_kv", 44, KW, KW, _CU),
)


def _parts(name: str) -> list[str]:
    """A slot name's parts, "d" joined to the part after it: descale_d_o -> [descale, do]."""
    parts = []
    for p in name.split("_"):
        if parts and parts[-1] == "d":
            parts[-1] += p
        else:
            parts.append(p)
    return parts


def upper(name: str) -> str:
    """A slot's C name (its FASTATTN_SLOT_ macro's suffix): d_o -> DO, seq_len_kv -> SEQ_LEN_KV."""
    return "_".join(_parts(name)).upper()
