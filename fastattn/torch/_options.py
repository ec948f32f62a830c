"""The scalar options of fastattn.torch's ops, and the entry points' own arguments,
declared once.

Each entry point (attention, attention_varlen, attention_paged; attention_fp8) passes its
tensors and then its op's options (OPS, PYTHON_OPS), in this order, to its custom ops and
to the op library's. What is derived from these declarations:
- Python: the options' NamedTuple (the plan key's options part, the miss handler's
  tuple), the custom ops' schemas, and the AttentionConfig fields the options give
  (config_fields);
- C++ (fastattn/torch/csrc), generated when the op library is built (_native.build) and
  part of its build tag (_opslib): `fastattn_options.h` (each op's parameter list,
  argument list, schema string, struct, key words and miss tuple; the layouts' table)
  and, from CALLS, `fastattn_calls.h` (the C entries' readers of attention()'s and
  attention_varlen()'s own arguments).
So an option is a line here, its keyword in the entry point, and its use in the graph.

Pure Python and no torch: _opslib hashes this file without importing torch.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from ..config import ALIGNMENTS, LAYOUTS, axes


class Option(NamedTuple):
    name: str
    kind: str  # "bool", "int", "float" or "str" (a str option has choices)
    doc: str
    choices: tuple[str, ...] = ()
    default: object = None  # the NamedTuple's default (None: none); an option added later has its "off" value
    off: object = None  # its value in a C++ struct made with {} (None: zero, false, an empty name)


# The types of each kind: in a schema, in C++ parameters and in the C++ struct.
_SCHEMA = {"bool": "bool", "int": "int", "float": "float", "str": "str"}
_CPP = {"bool": "bool", "int": "int64_t", "float": "double", "str": "c10::string_view"}
_PY = {"bool": bool, "int": int, "float": float, "str": str}

_WINDOW_AND_SCALE = (
    Option("causal", "bool", "a causal mask"),
    Option("bottom_right", "bool", "the diagonal of the mask and of the window at the bottom right"),
    Option("window_left", "int", "the window's left bound, -1 unbounded", off=-1),
    Option("window_right", "int", "the window's right bound, -1 unbounded", off=-1),
    Option("scale", "float", "the softmax scale; 0.0: the default, 1 / sqrt(head_dim_qk)"),
)
_SOFTCAP = Option("softcap", "float", "logit soft-capping: softcap * tanh(score / softcap); 0.0: none", default=0.0)
# Options more than one op has, each spelled once (the ops' orders differ: their ops came first).
_DETERMINISTIC = Option("deterministic", "bool", "cuDNN's deterministic backward")
_ALIBI = Option("alibi", "bool", "ALiBi position biases")
_TRAINING = Option("training", "bool", "the forward writes softmax stats; a backward plan exists")
_DROPOUT = Option("dropout", "float", "dropout probability on the attention weights")

_LAYOUT = Option("layout", "str", "the tensors' memory order", LAYOUTS)

# The op library's ops (its C++ kernels take these, fastattn_options.h), and their Python
# twins'.
OPS: dict[str, tuple[Option, ...]] = {
    "dense": (
        _LAYOUT,
        *_WINDOW_AND_SCALE, _DETERMINISTIC, _ALIBI, _TRAINING, _DROPOUT,
        Option("bias_grad", "bool", "backward also writes the bias's gradient"),
        _SOFTCAP,
    ),
    "varlen": (
        Option("max_q", "int", "the plan's longest query sequence: max_seqlen_q's bucket"),
        Option("max_kv", "int", "the plan's longest key sequence: max_seqlen_k's bucket"),
        *_WINDOW_AND_SCALE, _DETERMINISTIC, _TRAINING, _ALIBI, _DROPOUT, _SOFTCAP,
    ),
    "paged": (*_WINDOW_AND_SCALE, _SOFTCAP),
}
# Ops that are Python only (no kernel of the op library takes them).
PYTHON_OPS: dict[str, tuple[Option, ...]] = {
    "fp8": (
        _LAYOUT, *_WINDOW_AND_SCALE, _DETERMINISTIC, _TRAINING,
        Option("out_dtype", "str", "the config's name of o's dtype"),
        Option("grad_dtype", "str", "the config's name of d_o's, d_q's, d_k's and d_v's; the inputs' when not "
               "training"),
    ),
}


def mask_name(causal: bool, bottom_right: bool) -> str:
    """The config's mask for an op's options: causal, a causal mask; bottom_right, the
    diagonal (of the mask and the window) at the bottom right."""
    return ("causal_bottom_right" if bottom_right else "causal") if causal else "none"


def alignment_name(bottom_right: bool) -> str:
    """The config's alignment for an op's bottom_right option."""
    return "bottom_right" if bottom_right else "top_left"


# What an option is in AttentionConfig when it is not the field of the same name: the
# pairs that make one field, and the "none" values the ops spell as 0.
_SCALE_AND_CAP = {"scale": lambda v: None if v <= 0 else v, "softcap": lambda v: v or None}


def config_fields(options: tuple) -> dict:
    """The AttentionConfig fields an op's options (any NamedTuple of named_tuple's, or
    one with the same field names) give: the one place where an option becomes a
    config field. The layout is the tensors' strides (_plans.config_shape); max_q and
    max_kv are a packed plan's sequence lengths."""
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
        convert = _SCALE_AND_CAP.get(name)
        out[name] = value if convert is None else convert(value)
    return out


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
    (eager.cpp) reads it. An argument whose name is one of the op's options becomes that
    option; "window" fills window_left and window_right; causal, causal_bottom_right and
    alignment together give the options causal and bottom_right (fa_diagonal, the rule of
    _plans.options and _plans.bottom_right); tensors become the call's fields."""

    name: str
    read: str  # eager.cpp's reader: fa_read_<read>; "name" reads one of `choices`
    choices: tuple[str, ...] = ()
    option: str = ""  # the option it becomes, where its name differs


_T, _BOOL, _OPT = "tensor", "bool", "optional"
_DIAGONAL = ("causal", "causal_bottom_right", "alignment")
_SCALARS = (Arg("window", "window"), Arg("scale", "positive_or_none"))

# attention()'s and attention_varlen()'s parameters in their order (shape_classes, which
# the Python body reads before its C entry, aside), which each passes to its C entry as
# they are; a test holds the signatures to these. The readers take only values that
# need no conversion (plain bools, ints, floats and names, no dropout, no return_lse):
# anything else goes back to the Python body, which converts, checks and reports.
CALLS: dict[str, tuple[str, tuple[Arg, ...]]] = {
    "attention": ("dense", (
        Arg("q", _T), Arg("k", _T), Arg("v", _T), Arg("causal", _BOOL), Arg("causal_bottom_right", _BOOL),
        *_SCALARS, Arg("layout", "name", LAYOUTS), Arg("deterministic", _BOOL), Arg("seq_lens_q", _OPT),
        Arg("seq_lens_kv", _OPT), Arg("alibi", _BOOL), Arg("bias", _OPT), Arg("dropout_p", "zero"),
        Arg("sinks", _OPT), Arg("alignment", "name", ALIGNMENTS), Arg("return_lse", "false"),
        Arg("softcap", "positive_or_zero"),
    )),
    "attention_varlen": ("varlen", (
        Arg("q", _T), Arg("k", _T), Arg("v", _T), Arg("cu_seqlens_q", _T), Arg("cu_seqlens_kv", _T),
        Arg("max_seqlen_q", "max_length", option="max_q"), Arg("max_seqlen_kv", "max_length", option="max_kv"),
        Arg("causal", _BOOL), Arg("causal_bottom_right", _BOOL), *_SCALARS, Arg("deterministic", _BOOL),
        Arg("alignment", "name", ALIGNMENTS), Arg("alibi", _BOOL), Arg("dropout_p", "zero"),
        Arg("return_lse", "false"), Arg("softcap", "positive_or_zero"), Arg("sinks", _OPT),
    )),
}


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _names(values: tuple[str, ...]) -> str:
    return "{" + ", ".join(json.dumps(v) for v in values) + "}"


def calls_header() -> str:
    """fastattn_calls.h, for eager.cpp alone (it needs Python.h, and the fa_read_*
    readers and fa_diagonal that eager.cpp defines before including it): for each entry
    of CALLS, the struct <Entry>Call (its tensors, its op's options), k<Entry>Args and
    read_<entry>(args, call), true when every argument is one the C entry takes."""
    out = ["// Generated from fastattn/torch/_options.py (CALLS) by fastattn.torch._native at build time; "
           "change that file, not this one.",
           "#pragma once", "", "namespace fastattn::ops {", ""]
    choices = {a.name: a.choices for _, args in CALLS.values() for a in args if a.read == "name"}
    out.extend(f"inline constexpr c10::string_view kNames{_camel(n)}[] = {_names(c)};" for n, c in choices.items())
    for entry, (op, args) in CALLS.items():
        camel, fields = _camel(entry), {o.name for o in OPS[op]}
        reads = []
        for i, a in enumerate(args):
            if a.read in (_T, _OPT):
                into = [f"c.{a.name}"]
            elif a.name in _DIAGONAL:
                into = [a.name]
            elif a.read == "window":
                into = ["c.options.window_left", "c.options.window_right"]
            elif a.read in ("zero", "false"):
                into = []
            else:
                assert (a.option or a.name) in fields, f"{entry}'s {a.name} is no option of {op}"
                into = [f"c.options.{a.option or a.name}"]
            if a.read == "name":
                into.insert(0, f"kNames{_camel(a.name)}")
            reads.append(f"fa_read_{a.read}({', '.join([f'args[{i}]', *into])})")
        reads.append("fa_diagonal(causal, causal_bottom_right, alignment, c.options.causal, c.options.bottom_right)")
        out += ["", f"// {entry}({', '.join(a.name for a in args)})",
                f"struct {camel}Call {{",
                *(f"    PyObject *{a.name} = nullptr;" for a in args if a.read == _T),
                *(f"    OptTensor {a.name};" for a in args if a.read == _OPT),
                f"    {op.capitalize()}Options options{{}};",
                "};",
                f"inline constexpr Py_ssize_t k{camel}Args = {len(args)};",
                f"inline bool read_{entry}(PyObject *const *args, {camel}Call &c) {{",
                "    bool causal = false, causal_bottom_right = false;",
                "    c10::string_view alignment;",
                "    return " + " &&\n           ".join(reads) + ";",
                "}"]
    out += ["", "}  // namespace fastattn::ops"]
    return "\n".join(out) + "\n"


def positive_or_zero(name: str, value) -> float:
    """An argument read as eager.cpp's fa_read_positive_or_zero reads it (the
    "positive_or_zero" Args, a softcap): 0.0 (none: 0, 0.0 and -0.0 alike, FlashAttention's
    convention) or a positive finite float32 value. Raises InvalidArgumentError naming
    `name` otherwise."""
    from .._fields import check, number

    if number(name, value) == 0.0:
        return 0.0
    return check("positive", name, value)


def _of(op: str) -> tuple[Option, ...]:
    return OPS[op] if op in OPS else PYTHON_OPS[op]


def named_tuple(op: str, name: str) -> type:
    """The options of `op` as a NamedTuple class (its fields in declaration order)."""
    options = _of(op)
    cls = NamedTuple(name, [(o.name, _PY[o.kind]) for o in options])
    defaults = []  # the trailing options with defaults: code that names the older ones keeps working
    for o in reversed(options):
        if o.default is None:
            break
        defaults.insert(0, o.default)
    cls.__new__.__defaults__ = tuple(defaults) or None
    cls.__doc__ = f"The scalar options of fastattn.torch's {op} ops, in their order (fastattn/torch/_options.py)."
    return cls


def schema(op: str) -> str:
    """The options' part of the ops' schemas: "str layout, bool causal, ..."."""
    return ", ".join(f"{_SCHEMA[o.kind]} {o.name}" + ("" if o.default is None else f"={o.default!r}")
                     for o in _of(op))


def _word(o: Option) -> str:
    # One int64 key word per option: a choice's index, a float's bits, an int or bool as is.
    field = f"(o).{o.name}"
    if o.kind == "str":
        return f"fa_choice({field}, {{{', '.join(json.dumps(c) for c in o.choices)}}})"
    if o.kind == "float":
        return f"fa_bits({field})"
    return f"static_cast<int64_t>({field})"


def cpp_header() -> str:
    """fastattn_options.h: for each op (DENSE, VARLEN, PAGED), FA_<OP>_PARAMS (the C++
    parameters), _ARGS (passing them on), _SCHEMA (the schema's options), _OF(o) (a
    struct's fields as arguments), _WORDS(key, o) (push each option's key word),
    _TUPLE(o) (the miss handler's Python tuple), _FROM(t) (the struct from a Python
    sequence of the options, as a NamedTuple of _dense holds them), _COUNT, for ops without str options
    _SAVE(map, o) and _LOAD(map) (an autograd Function's saved_data), and the struct
    <Op>Options, in namespace fastattn::ops. The macros expect fa_choice and fa_bits
    (ops.h) where they are expanded."""
    out = ["// Generated from fastattn/torch/_options.py by fastattn.torch._native at build time; "
           "change that file, not this one.",
           "#pragma once", "", "#include <c10/util/string_view.h>", "", "#include <array>", "#include <cstdint>", "",
           "namespace fastattn::ops {", "",
           "// The layouts (fastattn/config.py's LAYOUTS; a layout's number is its index) and where",
           "// (batch, head, seq, dim) sit in a tensor's shape in each (config.axes).",
           f"inline constexpr c10::string_view kLayouts[] = {_names(LAYOUTS)};",
           "inline constexpr std::array<int, 4> kAxes[] = {"
           + ", ".join("{" + ", ".join(map(str, axes(layout))) + "}" for layout in LAYOUTS) + "};",
           f"inline constexpr const char *kLayoutChoices = {json.dumps(str(LAYOUTS))};",
           "// attention_varlen's training plans and plans with sinks are declared for at least this many "
           "queries (_options says why).",
           f"inline constexpr int64_t kVarlenMinQ = {VARLEN_MIN_Q};", "",
           "// The kinds of call (OPS's order): the miss handler's first argument, a table key's first word.",
           "enum Kind : int64_t { " + ", ".join(f"k{op.capitalize()} = {i}" for i, op in enumerate(OPS)) + " };", ""]
    for op, options in OPS.items():
        up, camel = op.upper(), op.capitalize()
        names = [o.name for o in options]
        out.append(f"// {op}: {schema(op)}")
        out.append(f"#define FA_{up}_PARAMS " + ", ".join(f"{_CPP[o.kind]} {o.name}" for o in options))
        out.append(f"#define FA_{up}_ARGS " + ", ".join(names))
        out.append(f'#define FA_{up}_SCHEMA "{schema(op)}"')
        out.append(f"#define FA_{up}_OF(o) " + ", ".join(f"(o).{n}" for n in names))
        out.append(f"#define FA_{up}_WORDS(key, o) " + " ".join(f"(key).push_back({_word(o)});" for o in options))
        out.append(f"#define FA_{up}_TUPLE(o) pybind11::make_tuple(" + ", ".join(
            f"std::string((o).{o.name})" if o.kind == "str" else f"(o).{o.name}" for o in options) + ")")
        out.append(f"#define FA_{up}_FROM(t) {camel}Options{{" + ", ".join(
            f"fa_named((t)[{i}].cast<std::string>(), {{{', '.join(json.dumps(c) for c in o.choices)}}})"
            if o.kind == "str" else f"(t)[{i}].cast<{_CPP[o.kind]}>()" for i, o in enumerate(options)) + "}")
        out.append(f"#define FA_{up}_COUNT {len(options)}")
        if not any(o.kind == "str" for o in options):
            # An autograd Function's saved_data (IValues by name), for ops without str options.
            to = {"bool": "toBool", "int": "toInt", "float": "toDouble"}
            out.append(f"#define FA_{up}_SAVE(map, o) " + " ".join(f'(map)["{n}"] = (o).{n};' for n in names))
            out.append(f"#define FA_{up}_LOAD(map) {camel}Options{{" + ", ".join(
                f'(map).at("{o.name}").{to[o.kind]}()' for o in options) + "}")
        out.append(f"struct {camel}Options {{")
        out.extend(f"    {_CPP[o.kind]} {o.name}{'{}' if o.off is None else f' = {o.off}'};  // {o.doc}"
                   for o in options)
        out.append("};")
        out.append("")
    out.append("}  // namespace fastattn::ops")
    return "\n".join(out) + "\n"
