"""The op library's generated headers, written from the ops' specs (_specs: each op's
options, named by config field, their kinds, docs and off values from the field
registry; CALLS, the arguments attention() and attention_varlen() hand their C entries)
when the library is built (_native.build), part of its build tag (_opslib):
`fastattn_options.h` (each op's parameter list, argument list, struct, key words; the
layouts' table) and `fastattn_calls.h` (the C entries' argument counts and readers of
attention()'s and attention_varlen()'s own arguments, their calls of their ops' work, and
those ops' gradient decisions); _kernels writes the ops' kernels beside them. And
the reader of a positive-or-zero argument that the C entries' fa_read_positive_or_zero
mirrors.

Pure Python and no torch: _opslib hashes this file without importing torch.
"""

from __future__ import annotations

import json

from ..config import LAYOUTS, axes
from ._specs import (CALLS, DIAGONAL, OPTIONAL, SPECS, TENSOR, VARLEN_MIN_Q, Input, Option, cpp_initializer, describe,
                     options_schema)

# The types of each kind in C++ parameters and in the C++ struct.
_CPP = {"bool": "bool", "int": "int64_t", "float": "double", "str": "c10::string_view"}

# The op library's ops (its C++ kernels take these, fastattn_options.h), in its Kind order.
OPS: dict[str, tuple[Option, ...]] = {name: s.options for name, s in SPECS.items() if s.native}


def struct(op: str) -> str:
    """An op's options struct in C++ (DenseOptions), and, below, its Kind (kDense)."""
    return f"{op.capitalize()}Options"


def kind(op: str) -> str:
    return f"k{op.capitalize()}"


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _names(values: tuple[str, ...]) -> str:
    return "{" + ", ".join(json.dumps(v) for v in values) + "}"


def calls_header() -> str:
    """fastattn_calls.h, for readers.h alone (it needs the fa_read_* readers and
    fa_diagonal that readers.h defines before including it): for each entry
    of CALLS, the struct <Entry>Call (its tensors, its op's options), <entry>_args(fn,
    nargs), true when nargs is the entry point's argument count (else a TypeError naming
    the C entry fn is set), read_<entry>(args, call), true when every argument is one
    the C entry takes, and run_<entry>(call), its call of the op's work (_run); for each
    op of CALLS, decide_<op>_grads (_grads)."""
    out = ["// Generated from fastattn/torch/_specs.py (CALLS) by fastattn.torch._native at build time; "
           "change that file, not this one.",
           "#pragma once", "", "#include <ATen/core/grad_mode.h>", "#include <ATen/record_function.h>", "",
           "#include <optional>", "#include <tuple>", "#include <utility>", "", "namespace fastattn::ops {", ""]
    choices = {a.name: a.choices for _, args in CALLS.values() for a in args if a.read == "name"}
    out.extend(f"inline constexpr c10::string_view kNames{_camel(n)}[] = {_names(c)};" for n, c in choices.items())
    for entry, (op, args) in CALLS.items():
        camel, fields = _camel(entry), {o.name for o in OPS[op]}
        reads = []
        for i, a in enumerate(args):
            if a.read in (TENSOR, OPTIONAL):
                into = [f"c.{a.name}"]
            elif a.name in DIAGONAL:
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
                *(f"    PyObject *{a.name} = nullptr;" for a in args if a.read == TENSOR),
                *(f"    OptTensor {a.name};" for a in args if a.read == OPTIONAL),
                f"    {struct(op)} options{{}};",
                "};",
                f"// Whether nargs is {entry}()'s {len(args)} arguments; if not, a TypeError naming the C entry fn is set.",
                f"inline bool {entry}_args(const char *fn, Py_ssize_t nargs) {{",
                f"    if (nargs == {len(args)}) return true;",
                f'    PyErr_Format(PyExc_TypeError, "%s() takes {len(args)} positional arguments (%zd given)", fn, nargs);',
                "    return false;",
                "}",
                f"inline bool read_{entry}(PyObject *const *args, {camel}Call &c) {{",
                "    bool causal = false, causal_bottom_right = false;",
                "    c10::string_view alignment;",
                "    return " + " &&\n           ".join(reads) + ";",
                "}"]
    for op in dict.fromkeys(op for op, _ in CALLS.values()):
        out += ["", *_grads(op)]
    for entry, (op, args) in CALLS.items():
        out += ["", *_run(entry, op, args)]
    out += ["", "}  // namespace fastattn::ops"]
    return "\n".join(out) + "\n"


def _grads(op: str) -> list[str]:
    """decide_<op>_grads: the options that say which gradients a C entry's call of the op
    computes, as autograd decides (the spec's differentiable inputs, and when each gets
    one): training, where the grad mode is on and one of them wants a gradient; an option
    that gates an input's gradient (Input.grad_if), where that input wants one too."""
    grads = SPECS[op].differentiable()

    def wants(i: Input) -> str:
        return f"given({i.name}) && {i.name}->requires_grad()" if i.optional else f"{i.name}.requires_grad()"

    gated = [i for i in grads if i.grad_if not in ("", "given")]
    head = f"inline void decide_{op}_grads("
    params = [f"const {'OptTensor' if i.optional else 'Tensor'} &{i.name}" for i in grads] + [f"{struct(op)} &opt"]
    return [f"// The gradients a call of {op}'s work computes, as autograd decides: training where the grad mode is on",
            f"// and an input that takes one ({', '.join(i.name for i in grads)}) wants one"
            + "".join(f"; {i.grad_if} where {i.name} does" for i in gated) + ".",
            *_packed(head, params, ", ", ") {"),
            "    opt.training = at::GradMode::is_enabled() &&",
            *_packed(" " * 19 + "(", [f"({wants(i)})" if i.optional else wants(i) for i in grads], " || ", ");"),
            *(f"    opt.{i.grad_if} = opt.training && {wants(i)};" for i in gated),
            "}"]


def _run(entry: str, op: str, args) -> list[str]:
    """run_<entry>: the C entry's call of its op's work with what it read, once it has
    checked the call and decided its gradients (decide_<op>_grads): o, the op's autograd
    node recorded where training. An op's input no argument gives (rng: a dropout draws
    its seed in Python, so the Python body takes those calls) is none."""
    spec, tensors = SPECS[op], [a for a in args if a.read in (TENSOR, OPTIONAL)]
    by_input = {a.input or a.name: a for a in tensors}
    assert set(by_input) <= {i.name for i in spec.inputs}, f"{entry}: {set(by_input)} are not all inputs of {op}"
    inputs = []
    for i in spec.inputs:
        a = by_input.get(i.name)
        assert a or i.optional, f"{entry} gives no {i.name}, which {op} needs"
        inputs.append("std::nullopt" if a is None else a.name if a.read == TENSOR else f"c.{a.name}")
    inputs.append("c.options")
    plain = [a.name for a in tensors if a.read == TENSOR]
    return [f"// {entry}()'s call of {op}'s work, once its C entry has checked it and decided its gradients",
            f"// (decide_{op}_grads): o, {op}'s node recorded where training. The GIL is released, as torch's own ops",
            "// release it: other Python threads run while this one is in cuDNN (a miss takes it back).",
            f"inline PyObject *run_{entry}(const {_camel(entry)}Call &c) {{",
            *_packed("    const Tensor ", [f"&{n} = unpack(c.{n})" for n in plain], ", ", ";"),
            "    Tensor o;",
            "    {",
            "        GilReleased no_gil;",
            f'        RECORD_FUNCTION("fastattn::{entry}", c10::ArrayRef<const c10::IValue>{{}});',
            "        o = std::get<0>(c.options.training",
            *_packed(f"                            ? {op}_recorded(", ["true", *inputs], ", ", ")"),
            *_packed(f"                            : {op}_forward(", inputs, ", ", "));"),
            "    }",
            "    return wrap(std::move(o));",
            "}"]


def _packed(head: str, pieces: list[str], sep: str, tail: str, width: int = 120) -> list[str]:
    """head, the pieces joined by sep and tail, in lines of at most width, each continuation
    aligned after head."""
    lines, line = [], head + pieces[0]
    for piece in pieces[1:]:
        if len(line) + len(sep) + len(piece) + len(tail) > width:
            lines.append(line + sep.rstrip())
            line = " " * len(head) + piece
        else:
            line += sep + piece
    return [*lines, line + tail]


def positive_or_zero(name: str, value) -> float:
    """An argument read as readers.h's fa_read_positive_or_zero reads it (the
    "positive_or_zero" Args, a logit cap): 0.0 (none: 0, 0.0 and -0.0 alike, FlashAttention's
    convention) or a positive finite float32 value. Raises InvalidArgumentError naming
    `name` otherwise."""
    from .._fields import check, number

    if number(name, value) == 0.0:
        return 0.0
    return check("positive", name, value)


def _word(o: Option) -> str:
    # One int64 key word per option: a choice's index, a float's bits, an int or bool as is.
    field = f"(o).{o.name}"
    if o.kind == "str":
        return f"fa_choice({field}, {{{', '.join(json.dumps(c) for c in o.choices)}}})"
    if o.kind == "float":
        return f"fa_bits({field})"
    return f"static_cast<int64_t>({field})"


def cpp_header() -> str:
    """fastattn_options.h: for each op (DENSE, VARLEN, PAGED), FA_<OP>_TENSORS and
    _TENSOR_ARGS (its input tensors as C++ parameters, and passing them on), FA_<OP>_PARAMS
    (its options as C++ parameters), _ARGS (passing them on), _OF(o) (a struct's fields as arguments),
    _WORDS(key, o) (push each option's key word), _FROM(t) (the struct from a Python
    sequence of the options, as a NamedTuple of _dense holds them), and the struct
    <Op>Options (its Kind, its fields, each() to visit them in order); FA_OPTIONS(X), X
    of each struct; in namespace fastattn::ops. The macros expect fa_choice, fa_bits and
    fa_named (ops.h) where they are expanded."""
    out = ["// Generated from fastattn/torch/_specs.py by fastattn.torch._native at build time; "
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
           "queries (_specs says why).",
           f"inline constexpr int64_t kVarlenMinQ = {VARLEN_MIN_Q};", "",
           "// The kinds of call (OPS's order): the miss handler's first argument, a table key's first word.",
           "enum Kind : int64_t { " + ", ".join(f"{kind(op)} = {i}" for i, op in enumerate(OPS)) + " };",
           f"inline constexpr int64_t kNumKinds = {len(OPS)};", "",
           "// X(the options' struct) for each op (ops.cpp instantiates its templates with each).",
           "#define FA_OPTIONS(X) " + " ".join(f"X({struct(op)})" for op in OPS), ""]
    for op, options in OPS.items():
        up = op.upper()
        names = [o.name for o in options]
        tensors = SPECS[op].inputs
        out.append(f"// {op}: {options_schema(op)}")
        out.append(f"#define FA_{up}_TENSORS " + ", ".join(
            f"const {'OptTensor' if i.optional else 'Tensor'} &{i.name}" for i in tensors))
        out.append(f"#define FA_{up}_TENSOR_ARGS " + ", ".join(i.name for i in tensors))
        out.append(f"#define FA_{up}_PARAMS " + ", ".join(f"{_CPP[o.kind]} {o.name}" for o in options))
        out.append(f"#define FA_{up}_ARGS " + ", ".join(names))
        out.append(f"#define FA_{up}_OF(o) " + ", ".join(f"(o).{n}" for n in names))
        out.append(f"#define FA_{up}_WORDS(key, o) " + " ".join(f"(key).push_back({_word(o)});" for o in options))
        out.append(f"#define FA_{up}_FROM(t) {struct(op)}{{" + ", ".join(
            f"fa_named((t)[{i}].cast<std::string>(), {{{', '.join(json.dumps(c) for c in o.choices)}}})"
            if o.kind == "str" else f"(t)[{i}].cast<{_CPP[o.kind]}>()" for i, o in enumerate(options)) + "}")
        out.append(f"struct {struct(op)} {{")
        out.append(f"    static constexpr Kind kind = {kind(op)};")
        out.extend(f"    {_CPP[o.kind]} {o.name}{cpp_initializer(o)};  // {describe(o)}"
                   for o in options)
        out += ["", "    // Calls f with each option, in their order (the NamedTuple's).",
                "    template <class F>",
                "    void each(F &&f) const {",
                *(f"        f({n});" for n in names),
                "    }",
                "};", ""]
    out.append("}  // namespace fastattn::ops")
    return "\n".join(out) + "\n"
