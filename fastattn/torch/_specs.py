"""One spec per fastattn.torch op: what a call of it is, declared once, as data.

A spec says, for one op (attention()'s dense op, attention_varlen()'s packed op,
attention_paged()'s op; the SDPA mode's kernels run the dense op):
- its input tensors in schema order, the plan slot each fills (_slots.SLOTS' names),
  which are optional, which get a gradient (into which slot, and when);
- its outputs, the slot each fills and its shape rule;
- what its backward reads (the inputs, o and stats, saved by autograd) and returns
  (a gradient per differentiable input);
- its scalar options, each named by the AttentionConfig field it gives, with its kind,
  doc and "off" value taken from the field registry (fastattn/config.py's spec(...)).
And CALLS: the arguments attention() and attention_varlen() hand the op library's C
entries as they are, in their order, and how each is read there.

What is made from a spec: the options' NamedTuple and the custom ops' schemas (here);
the executor, the fake kernels and the autograd (_executor); the op library's option
headers (_options.cpp_header) and its kernels, autograd nodes and registration
(_kernels.source): neither path's execution of an op is written by hand. The op modules
(_dense, _varlen, _paged) keep their plan lookup and their checks.

"Off": an option's value is the C++ core's Config member it becomes (the window's
window_left and window_right, an int each; softcap a float), and a field whose value
is None (softcap, scale) is the member's zero there, which is the rule
tools/gen_config.py writes into _c_config. So an option's off value is derived, never
typed: the field's off (or default), None spelled as the member's zero; config_fields
reads it back the other way. Causal and bottom_right are the one pair of options that
are not members (the mask's enum and the alignment's bool do not say "the diagonal of
the window"): mask_name and alignment_name turn them into their fields.

Pure Python and no torch: the op library's build hashes this file (_opslib) and
generates its sources from it without importing torch.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from .._fields import has_off, is_required
from ..config import ALIGNMENTS, FIELDS, LAYOUTS, axes


# -- options, from the field registry ---------------------------------------------------------

class Option(NamedTuple):
    name: str  # the schema's and the NamedTuple's name: the C++ member's, for a member
    field: str  # the AttentionConfig field it gives
    kind: str  # "bool", "int", "float" or "str" (a str option has choices)
    doc: str
    off: object  # the value that leaves the field at its off (or default) value
    choices: tuple[str, ...] = ()
    default: object = None  # the NamedTuple's and schema's default (None: none); an appended option's is `off`


# The registry's kinds as the ops' scalar types.
_KINDS = {"bool": "bool", "int": "int", "positive": "float", "probability": "float", "pair": "int",
          "layout": "str", "choice": "str", "dtype": "str"}
_ZERO = {"bool": False, "int": 0, "float": 0.0, "str": ""}
_FIELDS = {f.name: f for f in FIELDS}


def option(name: str, field: str | None = None, *, kind: str = "", doc: str = "", appended: bool = False) -> Option:
    """The option `name` of the config field `field` (default: the field of the same
    name), its kind, doc and off value from the registry. A "pair" field's options are
    its C++ members, by their Cxx names (window: window_left, window_right). kind and doc
    are given only for an option that is not the field's value (causal, bottom_right:
    off False). appended: the option came after its op's others, so it has a default
    (its off value), and code that names only the older ones keeps working."""
    f = _FIELDS[field or name]
    meta = f.metadata
    if kind:  # (a flag standing for a choice: its off is False, mapped by config_fields)
        off = _ZERO[kind]
    else:
        kind = _KINDS[meta["kind"]]
        value = meta["off"] if has_off(f) else None if is_required(f) else f.default
        if meta["kind"] == "pair":
            value = value[meta["cxx"].names.index(name)]
        off = _ZERO[kind] if value is None else value  # a field's None is the member's zero (gen_config)
    choices = tuple(meta["choices"]) if kind == "str" else ()
    return Option(name, f.name, kind, doc or meta["help"], off, choices, off if appended else None)


_LAYOUT = option("layout")
_WINDOW_AND_SCALE = (
    option("causal", "mask", kind="bool", doc="a causal mask"),
    option("bottom_right", "alignment", kind="bool",
           doc="the diagonal of the mask and of the window at the bottom right"),
    option("window_left", "window"),
    option("window_right", "window"),
    option("scale"),
)
_SOFTCAP = option("softcap", appended=True)
_DETERMINISTIC, _ALIBI, _TRAINING, _DROPOUT = option("deterministic"), option("alibi"), option("training"), \
    option("dropout")


# -- tensors -----------------------------------------------------------------------------------

class Input(NamedTuple):
    """An input tensor of an op, in its schema's order."""

    name: str  # its name in the ops' schemas
    slots: tuple[tuple[str, int], ...]  # the plan slots it fills: (slot, byte offset into the tensor)
    optional: bool = False  # Tensor? in the schemas (None: its slots stay 0)
    grad: str = ""  # the slot of its gradient ("": it gets none)
    grad_if: str = ""  # when it gets one: "" always, "given" when passed, else the option of that name
    dtype: str = ""  # its dtype: "" the inputs' (q's), else a config dtype name ("float32", "int32", "int64")
    absent: str = ""  # for an optional input: the op module's function (q, device) -> the tensor its slots
    #                   take when the call passes none, and the op library's of that name (q) ("": the slots stay 0)


class Output(NamedTuple):
    """An output of the forward, in the op's return order."""

    name: str
    slot: str
    like: str = ""  # its shape is this input's (in its order), but for the axes in `replace`
    replace: tuple[tuple[str, str], ...] = ()  # with like: (axis name, input): that axis taken from that input
    dims: tuple = ()  # without like: its shape, each (input, axis name) or an int
    dtype: str = ""  # "" the inputs', else a config dtype name
    training_only: bool = False  # written only when options.training; else an empty (0,) tensor through the ops


class Spec(NamedTuple):
    """One op: its tensors, outputs, options and the ops they make."""

    name: str  # the op's kind: _native.KINDS, the op library's Kind and its generated macros (FA_<NAME>_...)
    inputs: tuple[Input, ...]
    outputs: tuple[Output, ...]
    options: tuple[Option, ...]
    axes: str | tuple[str, ...]  # the option giving the layout (config.axes), or the inputs' axis names in order
    forward_op: str  # the Python custom op (fastattn::...); the op library's is native_<name>
    backward_op: str = ""  # "": no backward (cuDNN has none)
    padded_by: str = ""  # the optional input whose presence zeroes first o and the gradients written always
    #                      (q's, k's, v's): their rows past a sequence's length
    packed: bool = False  # the plan serves any token count: shapes come from each call's tensors, never the plan's
    native: bool = True  # the op library has this op (fastattn_options.h declares its options)

    def differentiable(self) -> tuple[Input, ...]:
        """The inputs that get a gradient: the backward op's outputs, in order."""
        return tuple(i for i in self.inputs if i.grad)


# The tensors several ops take alike.
_Q = Input("q", (("q", 0),), grad="d_q")
_K = Input("k", (("k", 0),), grad="d_k")
_V = Input("v", (("v", 0),), grad="d_v")
_SINK = Input("sink", (("sink", 0),), optional=True, grad="d_sink", grad_if="given", dtype="float32")
# Philox's seed at element 0 and its offset at element 2 of one int64 tensor (16 bytes on:
# fastattn wants every device pointer 16-byte aligned).
_RNG = Input("rng", (("seed", 0), ("offset", 16)), optional=True, dtype="int64")
_O = Output("o", "o", like="q", replace=(("dim", "v"),))

DENSE = Spec(
    "dense",
    inputs=(_Q, _K, _V,
            Input("seq_len_q", (("seq_len_q", 0),), optional=True, dtype="int32"),
            Input("seq_len_kv", (("seq_len_kv", 0),), optional=True, dtype="int32"),
            Input("bias", (("bias", 0),), optional=True, grad="d_bias", grad_if="bias_grad"),
            _SINK, _RNG),
    outputs=(_O, Output("stats", "stats", dims=(("q", "batch"), ("q", "head"), ("q", "seq"), 1), dtype="float32",
                        training_only=True)),
    options=(_LAYOUT, *_WINDOW_AND_SCALE, _DETERMINISTIC, _ALIBI, _TRAINING, _DROPOUT, option("bias_grad"),
             _SOFTCAP),
    axes="layout", forward_op="attention_forward", backward_op="attention_backward", padded_by="seq_len_q",
)

VARLEN = Spec(
    "varlen",
    inputs=(_Q, _K, _V,
            Input("cu_q", (("cu_seqlens_q", 0),), dtype="int32"),
            Input("cu_kv", (("cu_seqlens_kv", 0),), dtype="int32"),
            _SINK, _RNG),
    outputs=(_O, Output("stats", "stats", dims=(("q", "token"), ("q", "head")), dtype="float32",
                        training_only=True)),
    options=(option("max_q", "seqlen_q", doc="the plan's longest query sequence: max_seqlen_q's bucket"),
             option("max_kv", "seqlen_kv", doc="the plan's longest key sequence: max_seqlen_k's bucket"),
             *_WINDOW_AND_SCALE, _DETERMINISTIC, _TRAINING, _ALIBI, _DROPOUT, _SOFTCAP),
    axes=("token", "head", "dim"), forward_op="varlen_forward", backward_op="varlen_backward", packed=True,
)

PAGED = Spec(
    "paged",
    inputs=(Input("q", (("q", 0),)), Input("k_cache", (("k", 0),)), Input("v_cache", (("v", 0),)),
            Input("block_table", (("page_table_k", 0), ("page_table_v", 0)), dtype="int32"),
            Input("cache_seqlens", (("seq_len_kv", 0),), dtype="int32"),
            Input("seq_lens_q", (("seq_len_q", 0),), optional=True, dtype="int32", absent="query_lengths")),
    outputs=(Output("o", "o", like="q", replace=(("dim", "v_cache"),)),),
    options=(*_WINDOW_AND_SCALE, _SOFTCAP),
    axes=("batch", "seq", "head", "dim"), forward_op="paged_forward", padded_by="seq_lens_q",
)

SPECS: dict[str, Spec] = {s.name: s for s in (DENSE, VARLEN, PAGED)}

# attention_varlen: a training plan, and a plan with sinks, is declared for at least two
# queries per sequence (the lengths from cu_seqlens_q still mask the rest: no copy).
# Training: with one, cuDNN 9.19's ragged backward is wrong whenever there are fewer key
# heads than query heads: d_q, d_k and d_v hundreds of times off (with softcap 1e22) on the
# H200, while the same plan declared for two is right (benchmarks/probe_decode.py shows
# both); and it refuses one query against one key outright. Sinks: cuDNN 9.19 refuses them
# in a graph of one query ("decode only mode, i.e. s_q == 1, not supported with
# sink_token") and builds the graph of two, whose lengths of one serve decode steps
# (`fastattn probe ... --sinks` on the H200: docs/history/benchmarks-log.md, "verdicts on
# sinks"). Both paths read it from here (the op library as kVarlenMinQ).
VARLEN_MIN_Q = 2


# -- the entry points' own arguments, as their C entries read them ------------------------------

class Arg(NamedTuple):
    """One parameter of an entry point, in its order, and how the op library's C entry
    (eager.cpp, through readers.h's readers) reads it. An argument whose name is one of the op's options becomes that
    option; "window" fills window_left and window_right; causal, causal_bottom_right and
    alignment together give the options causal and bottom_right (fa_diagonal, the rule of
    _plans.options and _plans.bottom_right); tensors become the call's fields, each the op's
    input of its name (or `input`); an op's input that no argument gives is passed none."""

    name: str
    read: str  # readers.h's reader: fa_read_<read>; "name" reads one of `choices`
    choices: tuple[str, ...] = ()
    option: str = ""  # the option it becomes, where its name differs
    input: str = ""  # a tensor's: the op's input it becomes, where its name differs


TENSOR, OPTIONAL, _BOOL = "tensor", "optional", "bool"
# The arguments that together give the options causal and bottom_right.
DIAGONAL = ("causal", "causal_bottom_right", "alignment")
_SCALARS = (Arg("window", "window"), Arg("scale", "positive_or_none"))

# attention()'s and attention_varlen()'s parameters in their order (shape_classes, which
# the Python body reads before its C entry, aside), which each passes to its C entry as
# they are; a test holds the signatures to these. The readers take only values that
# need no conversion (plain bools, ints, floats and names, no dropout, no return_lse):
# anything else goes back to the Python body, which converts, checks and reports.
CALLS: dict[str, tuple[str, tuple[Arg, ...]]] = {
    "attention": ("dense", (
        Arg("q", TENSOR), Arg("k", TENSOR), Arg("v", TENSOR), Arg("causal", _BOOL), Arg("causal_bottom_right", _BOOL),
        *_SCALARS, Arg("layout", "name", LAYOUTS), Arg("deterministic", _BOOL),
        Arg("seq_lens_q", OPTIONAL, input="seq_len_q"), Arg("seq_lens_kv", OPTIONAL, input="seq_len_kv"),
        Arg("alibi", _BOOL), Arg("bias", OPTIONAL), Arg("dropout_p", "zero"), Arg("sinks", OPTIONAL, input="sink"),
        Arg("alignment", "name", ALIGNMENTS), Arg("return_lse", "false"), Arg("softcap", "positive_or_zero"),
    )),
    "attention_varlen": ("varlen", (
        Arg("q", TENSOR), Arg("k", TENSOR), Arg("v", TENSOR), Arg("cu_seqlens_q", TENSOR, input="cu_q"),
        Arg("cu_seqlens_kv", TENSOR, input="cu_kv"),
        Arg("max_seqlen_q", "max_length", option="max_q"), Arg("max_seqlen_kv", "max_length", option="max_kv"),
        Arg("causal", _BOOL), Arg("causal_bottom_right", _BOOL), *_SCALARS, Arg("deterministic", _BOOL),
        Arg("alignment", "name", ALIGNMENTS), Arg("alibi", _BOOL), Arg("dropout_p", "zero"),
        Arg("return_lse", "false"), Arg("softcap", "positive_or_zero"), Arg("sinks", OPTIONAL, input="sink"),
    )),
}


# attention_fp8's options (its ops are Python only, with an execution of their own: _fp8).
FP8_OPTIONS: tuple[Option, ...] = (
    _LAYOUT, *_WINDOW_AND_SCALE, _DETERMINISTIC, _TRAINING,
    option("out_dtype"), option("grad_dtype"),
)


def options_of(op: str) -> tuple[Option, ...]:
    return FP8_OPTIONS if op == "fp8" else SPECS[op].options


# -- what is made from a spec -------------------------------------------------------------------

_PY = {"bool": bool, "int": int, "float": float, "str": str}
_SCHEMA = {"bool": "bool", "int": "int", "float": "float", "str": "str"}


def named_tuple(op: str, name: str) -> type:
    """The options of `op` as a NamedTuple class (its fields in declaration order)."""
    options = options_of(op)
    cls = NamedTuple(name, [(o.name, _PY[o.kind]) for o in options])
    defaults = []  # the trailing options with defaults
    for o in reversed(options):
        if o.default is None:
            break
        defaults.insert(0, o.default)
    cls.__new__.__defaults__ = tuple(defaults) or None
    cls.__doc__ = f"The scalar options of fastattn.torch's {op} ops, in their order (fastattn/torch/_specs.py)."
    return cls


def options_schema(op: str) -> str:
    """The options' part of the ops' schemas: "str layout, bool causal, ..."."""
    return ", ".join(f"{_SCHEMA[o.kind]} {o.name}" + ("" if o.default is None else f"={o.default!r}")
                     for o in options_of(op))


def _inputs_schema(spec: Spec) -> str:
    return ", ".join(f"Tensor{'?' if i.optional else ''} {i.name}" for i in spec.inputs)


def _returns(n: int) -> str:
    return "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"


def forward_schema(spec: Spec) -> str:
    """The forward op's schema, without its name: (inputs, options) -> outputs."""
    return f"({_inputs_schema(spec)}, {options_schema(spec.name)}) -> {_returns(len(spec.outputs))}"


def backward_schema(spec: Spec) -> str:
    """The backward op's: (d_o, o, stats, inputs, options) -> a gradient per differentiable input."""
    return (f"(Tensor d_o, Tensor o, Tensor stats, {_inputs_schema(spec)}, {options_schema(spec.name)}) -> "
            f"{_returns(len(spec.differentiable()))}")


def axis_positions(spec: Spec, options) -> dict[str, int]:
    """{axis name: its position in the inputs' shapes} for a call with these options."""
    if isinstance(spec.axes, str):
        return dict(zip(("batch", "head", "seq", "dim"), axes(getattr(options, spec.axes))))
    return {name: i for i, name in enumerate(spec.axes)}


def output_shape(spec: Spec, output: Output, tensors: dict, options) -> list:
    """An output's shape for these input tensors (anything with .shape: real, meta or
    fake tensors, whose sizes may be symbols) and options, by its rule."""
    at = axis_positions(spec, options)
    if output.like:
        shape = list(tensors[output.like].shape)
        for axis, source in output.replace:
            shape[at[axis]] = tensors[source].shape[at[axis]]
        return shape
    return [d if isinstance(d, int) else tensors[d[0]].shape[at[d[1]]] for d in output.dims]


# -- options -> config fields -------------------------------------------------------------------

def mask_name(causal: bool, bottom_right: bool) -> str:
    """The config's mask for an op's options: causal, a causal mask; bottom_right, the
    diagonal (of the mask and the window) at the bottom right."""
    return ("causal_bottom_right" if bottom_right else "causal") if causal else "none"


def alignment_name(bottom_right: bool) -> str:
    """The config's alignment for an op's bottom_right option."""
    return "bottom_right" if bottom_right else "top_left"


def _nullable(f) -> bool:
    return f.default is None or (has_off(f) and f.metadata["off"] is None)


# The options that are their field's value where that can be None (scale, softcap): {name:
# the member's zero, which stands for None}.
_NONE_AT = {o.name: o.off for o in (*FP8_OPTIONS, *(o for s in SPECS.values() for o in s.options))
            if o.name == o.field and o.kind in ("int", "float") and _nullable(_FIELDS[o.field])}


def config_fields(options: tuple) -> dict:
    """The AttentionConfig fields an op's options (any NamedTuple of named_tuple's, or
    one with the same field names) give: the one place where an option becomes a config
    field. The layout is the tensors' strides (_plans.config_shape); max_q and max_kv
    are a packed plan's sequence lengths."""
    o = options._asdict()
    out = {}
    if "causal" in o:
        bottom = o.pop("bottom_right")
        out["mask"], out["alignment"] = mask_name(o.pop("causal"), bottom), alignment_name(bottom)
    if "window_left" in o:
        out["window"] = (o.pop("window_left"), o.pop("window_right"))
    if "max_q" in o:
        out["seqlen_q"], out["seqlen_kv"] = o.pop("max_q"), o.pop("max_kv")
    if "deterministic" in o:  # it selects the backward: none without one
        out["deterministic"] = o.pop("deterministic") and o.get("training", False)
    o.pop("layout", None)
    for name, value in o.items():
        out[name] = None if name in _NONE_AT and value == _NONE_AT[name] else value
    return out


def describe(o: Option) -> str:
    """An option's doc, with the value that stands for the field's None where it has one."""
    return o.doc + (f"; {o.off!r}: none" if o.name in _NONE_AT else "")


def cpp_initializer(o: Option) -> str:
    """An option's initializer in the op library's C++ struct: its off value ({}: zero)."""
    if o.kind == "str" or o.off == _ZERO[o.kind]:
        return "{}"
    return f" = {json.dumps(o.off)}"
