"""The op library's per-op C++, written from the ops' specs (_specs: DENSE, VARLEN, PAGED)
when the library is built (_native.write_generated), as _executor writes the Python
path's forward and backward from the same specs: neither path's execution of an op is
written by hand, so the two cannot drift apart.

`source()` is kernels.cpp: for each op, the plan lookup (<op>_plan: the table's key of
every tensor plan_for gets, a miss asks plan_for), the work (<op>_forward,
<op>_backward: outputs, gradients, the launch with its slots filled from the spec) and
the kernels of its ops by dispatch key (CUDA, Meta, CPU). `autograd()` is autograd.cpp:
each op's Autograd kernel and its autograd node (<Op>Backward, the op library's one
autograd style: a torch::autograd::Node with its saved tensors and options as members, as
PyTorch's generated ops have), a unit of its own: the library builds as long as its
slowest unit, and autograd's headers alone take longer to compile than ATen's with all of
kernels.cpp's code (on the CPU machine, one unit together 17-18 s, apart 12-13 s and 13-14
s: docs/BENCHMARKS.md, the op library's build). `registration()`
is registration.cpp, every op's schema and kernels registered (a unit of its own: the
library builds as long as its slowest unit). `header()` is fastattn_kernels.h, the
declarations the other units call (the C entries' run_<entry>, which _options writes into
fastattn_calls.h, sdpa.cpp's routes, benchmarks/csrc/profile_eager.cpp) and the kernels
registration.cpp registers.

The code is what a person would write for one op: straight-line, no loop over the spec
and no table lookup per call. The rules it follows are the executor's, in C++:
- an output is allocated past the dispatcher (empty_cuda) but where the spec's padded_by
  input is given, which zeroes it first (rows past a sequence's length flow into the
  next layer unless the caller masks them), and the gradients written always likewise;
- a training-only output is undefined on an inference call (the op's kernel returns an
  empty tensor in its place: a schema's Tensor is defined), a gradient computed only
  when given or when an option says so is undefined otherwise;
- a packed op's gradients are like its inputs (at::empty_like), a dense op's take their
  inputs' strides (the plan's);
- an absent input (Input.absent) fills its slots with the op library's function of
  that name (ops.h), as the Python path's with the op module's.

Pure Python and no torch: _opslib hashes this file without importing torch.
"""

from __future__ import annotations

from .._slots import NO, SLOTS, upper
from ._options import kind, struct
from ._specs import SPECS, Input, Output, Spec, backward_schema, forward_schema

# The op library's ops: their Kind order (fastattn_options.h's enum Kind).
NATIVE = tuple(s for s in SPECS.values() if s.native)

_TAKES = {"forward": {s.name: s.forward is not NO for s in SLOTS},
          "backward": {s.name: s.backward is not NO for s in SLOTS}}
_SCALAR = {"": "", "float32": "at::kFloat", "int32": "at::kInt", "int64": "at::kLong"}
_LAYOUT_AXES = ("batch", "head", "seq", "dim")  # config.axes' order: where each sits, ax[i]
_HEADER_LINE = "// Generated from fastattn/torch/_specs.py by fastattn/torch/_kernels.py at the op library's build: edit those."


def _split(text: str) -> tuple[list[str], int]:
    """The comma-separated pieces of text up to its closing bracket (brackets and string
    literals inside kept whole), and where that bracket is."""
    pieces, depth, quoted, piece = [], 0, False, ""
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in "([{":
            depth += 1
        elif not quoted and ch in ")]}":
            if depth == 0:
                return pieces + [piece.strip()], i
            depth -= 1
        elif not quoted and ch == "," and depth == 0:
            pieces.append(piece.strip())
            piece = ""
            continue
        piece += ch
    return pieces + [piece.strip()], len(text)


def _wrap(line: str, width: int = 120) -> str:
    """A line of code past `width` broken after the commas of its first parenthesis, each
    continuation aligned after it (as clang-format does), or, where that is far right,
    indented under the line."""
    if len(line) <= width or line.lstrip().startswith("//") or "(" not in line:
        return line
    start = line.index("(") + 1
    pieces, end = _split(line[start:])
    pieces = [p + "," for p in pieces[:-1]] + [pieces[-1] + line[start + end:]]
    if start <= 60:
        head, indent = line[:start] + pieces.pop(0), " " * start
    else:
        head, indent = line[:start], " " * (len(line) - len(line.lstrip()) + 8)
    lines = [head]
    for piece in pieces:
        if len(lines[-1]) + 1 + len(piece) <= width and (len(lines) > 1 or start <= 60):
            lines[-1] += " " + piece
        else:
            lines.append(indent + piece)
    return "\n".join(lines)


def _literal(text: str, indent: str, width: int = 120) -> list[str]:
    """A long string literal as adjacent literals, each broken after a comma."""
    out, current = [], ""
    for part in text.split(", "):
        if current and len(indent) + len(current) + len(part) + 6 > width:
            out.append(current + ", ")
            current = part
        else:
            current = f"{current}, {part}" if current else part
    return [f'{indent}"{piece}"' for piece in out + [current]]


def _opts(spec: Spec) -> str:
    return struct(spec.name)


def _macro(spec: Spec) -> str:
    return f"FA_{spec.name.upper()}"


def _slot(name: str) -> str:
    return f"FASTATTN_SLOT_{upper(name)}"


def _param(i: Input) -> str:
    return f"const {'OptTensor' if i.optional else 'Tensor'} &{i.name}"


def _params(spec: Spec) -> str:
    return ", ".join(_param(i) for i in spec.inputs)


def _args(spec: Spec, suffix: str = "") -> str:
    return ", ".join(i.name + suffix for i in spec.inputs)


def _dtype(dtype: str, like: str) -> str:
    """A tensor's dtype as ScalarType: "" the inputs' (like's)."""
    return _SCALAR[dtype] or f"{like}.scalar_type()"


def _options_of(dtype: str, like: str) -> str:
    """TensorOptions on like's device with the dtype ("" like's own)."""
    return f"{like}.options()" + (f".dtype({_SCALAR[dtype]})" if dtype else "")


def _returns(n: int) -> str:
    return "Tensor" if n == 1 else f"std::tuple<{', '.join(['Tensor'] * n)}>"


def _rank(spec: Spec) -> int:
    return 4 if isinstance(spec.axes, str) else len(spec.axes)


def _at(spec: Spec, axis: str) -> str:
    """Where an axis sits in the inputs' shapes: ax[i] for a layout option's, else a number."""
    if isinstance(spec.axes, str):
        return f"ax[{_LAYOUT_AXES.index(axis)}]"
    return str(spec.axes.index(axis))


def _shape(spec: Spec, out: Output, name: str, sym: bool) -> list[str]:
    """Lines declaring `name`, out's shape (SymInts for Meta: its sizes may be symbols)."""
    size = "sym_size" if sym else "size"
    element = "c10::SymInt" if sym else "int64_t"
    if out.like:
        dims = [f"{out.like}.{size}({d})" for d in range(_rank(spec))]
        fixups = []
        for axis, source in out.replace:
            at = _at(spec, axis)
            if at.isdigit():
                dims[int(at)] = f"{source}.{size}({at})"
            else:
                fixups.append(f"{name}[{at}] = {source}.{size}({at});")
        return [f"std::array<{element}, {len(dims)}> {name}{{{', '.join(dims)}}};", *fixups]
    dims = [str(d) if isinstance(d, int) else f"{d[0]}.{size}({_at(spec, d[1])})" for d in out.dims]
    return [f"const std::array<{element}, {len(dims)}> {name}{{{', '.join(dims)}}};"]


def _layout(spec: Spec) -> list[str]:
    # (axes() checks the layout: a bad one is named before anything else runs)
    return [f"const auto ax = axes(opt.{spec.axes});"] if isinstance(spec.axes, str) else []


def _input_slots(spec: Spec, direction: str, names: dict[str, str] | None = None) -> list[str]:
    """slots[...] = each input's address (an optional one's 0 when not given)."""
    names = names or {}
    lines = []
    for i in spec.inputs:
        name = names.get(i.name, i.name)
        for slot, offset in i.slots:
            if not _TAKES[direction][slot]:
                continue
            if offset and i.optional and i.name not in names:
                value = f"given({name}) ? ptr(*{name}) + {offset} : 0"
            else:
                value = f"ptr({name})" + (f" + {offset}" if offset else "")
            lines.append(f"slots[{_slot(slot)}] = {value};")
    return lines


def _grad_given(i: Input, suffix: str = "") -> str:
    """When a conditional gradient is computed, as a C++ condition (suffix: the input's local's)."""
    return f"given({i.name}{suffix})" if i.grad_if == "given" else f"opt.{i.grad_if}"


def _directions(spec: Spec) -> tuple[str, ...]:
    return ("forward", "backward") if spec.backward_op else ("forward",)


def _kernels_of(spec: Spec) -> list[tuple[str, str]]:
    """(direction, key) of each kernel an op has: CUDA, Meta and CPU for each direction, and Autograd for
    the forward of an op with a backward (a backward is not differentiable, and an op without one has
    no autograd: _registration)."""
    return [(d, k) for d in _directions(spec) for k in ("cuda", "meta", "cpu")] + [("forward", "autograd")] * bool(
        spec.backward_op)


def _kernel(spec: Spec, direction: str, key: str) -> str:
    """The signature of an op's kernel for a dispatch key (cuda, meta, cpu, autograd), which
    kernels.cpp defines and registration.cpp registers."""
    params = f"{_params(spec)}, {_macro(spec)}_PARAMS"
    if direction == "forward":
        return f"{_returns(len(spec.outputs))} {spec.name}_forward_{key}({params})"
    return (f"{_returns(len(spec.differentiable()))} {spec.name}_backward_{key}(const Tensor &d_o, const Tensor &o, "
            f"const Tensor &stats, {params})")


# -- each op's section of kernels.cpp ----------------------------------------------------------

def _plan(spec: Spec) -> list[str]:
    keyed = []
    for i in spec.inputs:
        if spec.packed and not i.dtype:  # the call's tensors: the plan serves any token count
            keyed.append(f"put_packed(key, {i.name});")
        else:
            keyed.append(f"put_{'optional' if i.optional else 'tensor'}(key, {i.name});")
    if spec.backward_op and not spec.packed:  # the backward's o: its strides are the plan's
        keyed.append("if (o != nullptr) put_tensor(key, *o);")
    if spec.packed:
        doc = ["// The plan for a call: the key holds every tensor the miss hands to plan_for, whole (but the call's own",
               "// tensors' token count, which plan_for's key leaves out too), and the options' key words, so a hit",
               "// returns what plan_for returned for the same inputs. o: the backward's forward output, null for the",
               "// forward."]
    else:
        doc = ["// The plan for a call: the key holds every tensor the miss hands to plan_for, whole, and the options'",
               "// key words, so a hit returns what plan_for returned for the same inputs. o: the backward's forward",
               "// output, null for the forward."]
    return [
        *doc,
        f"const Entry &{spec.name}_plan(int direction, {_params(spec)}, const Tensor *o, const {_opts(spec)} &opt) {{",
        "    thread_local std::vector<int64_t> key;  // reused: no allocation per call once grown",
        "    key.clear();",
        f"    key.push_back({kind(spec.name)});",
        "    key.push_back(direction);",
        *(f"    {line}" for line in keyed),
        f"    {_macro(spec)}_WORDS(key, opt);",
        "    return lookup(key, [&] {",
        f"        return miss(direction, {{{_args(spec)}}}, o, opt);",
        "    });",
        "}",
    ]


def _forward(spec: Spec) -> list[str]:
    q = spec.inputs[0].name
    body = [*_layout(spec),
            f"const Entry &e = {spec.name}_plan(FASTATTN_FORWARD, {_args(spec)}, nullptr, opt);"]
    names = {}
    for i in spec.inputs:
        if i.absent:
            names[i.name] = f"{i.name}_slot"
            body += [f"// Without {i.name}, its slot takes {i.absent} (ops.h).",
                     f"const Tensor {i.name}_slot = given({i.name}) ? *{i.name} : {i.absent}({q});"]
    slots = _input_slots(spec, "forward", names)
    for out in spec.outputs:
        shape = f"{out.name}_shape"
        alloc = f"empty_cuda({shape}, {{}}, {_dtype(out.dtype, q)}, {q})"
        if out.training_only:
            body += [f"Tensor {out.name};  // undefined: not training", "if (opt.training) {",
                     *(f"    {line}" for line in _shape(spec, out, shape, sym=False)),
                     f"    {out.name} = {alloc};", "}"]
            slots.append(f"slots[{_slot(out.slot)}] = opt.training ? ptr({out.name}) : 0;")
            continue
        body += _shape(spec, out, shape, sym=False)
        if spec.padded_by and out.like:
            body += ["// Rows past a sequence's length are zero, not whatever the allocator held: they flow into",
                     "// the next layer (and its weight gradients) unless the caller masks them.",
                     f"const Tensor {out.name} = given({spec.padded_by}) ? at::zeros({shape}, "
                     f"{_options_of(out.dtype, q)}) : {alloc};"]
        else:
            body.append(f"const Tensor {out.name} = {alloc};")
        slots.append(f"slots[{_slot(out.slot)}] = ptr({out.name});")
    body += ["intptr_t slots[FASTATTN_NUM_SLOTS] = {};", *slots, f"run(e, FASTATTN_FORWARD, {q}, slots);",
             f"return {{{', '.join(o.name for o in spec.outputs)}}};"
             if len(spec.outputs) > 1 else f"return {spec.outputs[0].name};"]
    undefined = [o.name for o in spec.outputs if o.training_only]
    return [f"// The forward's work: {', '.join(o.name for o in spec.outputs)}"
            + (f" ({', '.join(undefined)} undefined where not training)." if undefined else "."),
            f"{_returns(len(spec.outputs))} {spec.name}_forward({_params(spec)}, const {_opts(spec)} &opt) {{",
            *(f"    {line}" for line in body), "}"]


def _backward(spec: Spec) -> list[str]:
    q = spec.inputs[0].name
    grads = spec.differentiable()
    body = ["// The backward graph reads d_o at o's strides (the plan's).",
            "const Tensor d_o = d_o_in.strides() == o.strides() ? d_o_in : empty_like_cuda(o).copy_(d_o_in);",
            f"const Entry &e = {spec.name}_plan(FASTATTN_BACKWARD, {_args(spec)}, &o, opt);"]
    always = [i for i in grads if not i.grad_if]
    like = "at::empty_like" if spec.packed else "empty_like_cuda"
    body.append(f"Tensor {', '.join(f'{i.grad} = {like}({i.name})' for i in always)};")
    if spec.padded_by and always:
        body.append(f"if (given({spec.padded_by})) {{  // padded rows get zero gradients (see {spec.name}_forward)")
        body += [f"    {i.grad}.zero_();" for i in always]
        body.append("}")
    slots = [*_input_slots(spec, "backward"), "slots[FASTATTN_SLOT_O] = ptr(o);", "slots[FASTATTN_SLOT_DO] = ptr(d_o);",
             "slots[FASTATTN_SLOT_STATS] = ptr(stats);"]
    slots += [f"slots[{_slot(i.grad)}] = ptr({i.grad});" for i in always]
    for i in grads:
        if i.grad_if:
            body += [f"Tensor {i.grad};  // undefined where not computed",
                     f"if ({_grad_given(i)}) {i.grad} = at::empty_like(*{i.name}, at::MemoryFormat::Contiguous);"]
            slots.append(f"if ({i.grad}.defined()) slots[{_slot(i.grad)}] = ptr({i.grad});")
    body += ["intptr_t slots[FASTATTN_NUM_SLOTS] = {};", *slots, f"run(e, FASTATTN_BACKWARD, {q}, slots);",
             f"return {{{', '.join(i.grad for i in grads)}}};"]
    undefined = [i.grad for i in grads if i.grad_if]
    return [f"// The backward's work: {', '.join(i.grad for i in grads)}"
            + (f" ({', '.join(undefined)} undefined where not computed)." if undefined else "."),
            f"{_returns(len(grads))} {spec.name}_backward(const Tensor &d_o_in, const Tensor &o, const Tensor &stats, "
            f"{_params(spec)}, const {_opts(spec)} &opt) {{",
            *(f"    {line}" for line in body), "}"]


def _op_name(spec: Spec, direction: str) -> str:
    return "native_" + (spec.forward_op if direction == "forward" else spec.backward_op)


def _through_ops(spec: Spec) -> list[str]:
    """The op's forward and backward through the dispatcher (below Autograd: the caller's guard)."""
    out = []
    for direction in ("forward", "backward") if spec.backward_op else ("forward",):
        if direction == "forward":
            params, args, n = _params(spec), _args(spec), len(spec.outputs)
        else:
            params = f"const Tensor &d_o, const Tensor &o, const Tensor &stats, {_params(spec)}"
            args, n = f"d_o, o, stats, {_args(spec)}", len(spec.differentiable())
        out += [f"{_returns(n)} {spec.name}_{direction}_op({params}, const {_opts(spec)} &opt) {{",
                "    static const auto op = c10::Dispatcher::singleton()",
                f'                               .findSchemaOrThrow("fastattn::{_op_name(spec, direction)}", "")',
                f"                               .typed<decltype({spec.name}_{direction}_cuda)>();",
                f"    return op.call({args}, {_macro(spec)}_OF(opt));",
                "}", ""]
    return out[:-1]


def _cuda_kernels(spec: Spec) -> list[str]:
    q, m, o = spec.inputs[0].name, _macro(spec), _opts(spec)
    out = [f"// fastattn::{_op_name(spec, 'forward')}'s CUDA kernel.", f"{_kernel(spec, 'forward', 'cuda')} {{"]
    if len(spec.outputs) == 1:
        out.append(f"    return {spec.name}_forward({_args(spec)}, {o}{{{m}_ARGS}});")
    else:
        names = ", ".join(x.name for x in spec.outputs)
        out.append(f"    auto [{names}] = {spec.name}_forward({_args(spec)}, {o}{{{m}_ARGS}});")
        for x in spec.outputs:
            if x.training_only:  # (a schema's Tensor is defined)
                out.append(f"    if (!{x.name}.defined()) {x.name} = at::empty({{0}}, {_options_of(x.dtype, q)});"
                           "  // not training")
        out.append(f"    return {{{names}}};")
    out.append("}")
    if not spec.backward_op:
        return out
    grads = spec.differentiable()
    names = ", ".join(i.grad for i in grads)
    out += ["", f"// fastattn::{_op_name(spec, 'backward')}'s CUDA kernel: an empty tensor for a gradient not computed.",
            f"{_kernel(spec, 'backward', 'cuda')} {{",
            f"    auto [{names}] = {spec.name}_backward(d_o, o, stats, {_args(spec)}, {o}{{{m}_ARGS}});"]
    for i in grads:
        if i.grad_if:
            out.append(f"    if (!{i.grad}.defined()) {i.grad} = at::empty({{0}}, {_options_of(i.dtype, q)});")
    out += [f"    return {{{names}}};", "}"]
    return out


def _meta_kernels(spec: Spec) -> list[str]:
    q, m, o = spec.inputs[0].name, _macro(spec), _opts(spec)
    reads = isinstance(spec.axes, str) or any(x.training_only for x in spec.outputs)
    body = [f"const {o} opt{{{m}_ARGS}};"] * reads + _layout(spec)
    for x in spec.outputs:
        shape = f"{x.name}_shape"
        make = f"at::empty_symint({shape}, {_options_of(x.dtype, q)})"
        if x.training_only:
            body += [f"Tensor {x.name} = at::empty({{0}}, {_options_of(x.dtype, q)});  // not training",
                     "if (opt.training) {", *(f"    {line}" for line in _shape(spec, x, shape, sym=True)),
                     f"    {x.name} = {make};", "}"]
        else:
            body += [*_shape(spec, x, shape, sym=True), f"const Tensor {x.name} = {make};"]
    body.append(f"return {{{', '.join(x.name for x in spec.outputs)}}};" if len(spec.outputs) > 1
                else f"return {spec.outputs[0].name};")
    out = ["// fastattn::" + _op_name(spec, "forward") + "'s Meta kernel (fake tensors: torch.compile), in SymInt "
           "arithmetic: under",
           "// dynamic shapes the sizes are symbols, and sizes() would throw.",
           f"{_kernel(spec, 'forward', 'meta')} {{",
           *(f"    {line}" for line in body), "}"]
    if not spec.backward_op:
        return out
    grads = spec.differentiable()
    values = []
    for i in grads:
        if not i.grad_if:
            values.append(f"at::empty_strided_symint({i.name}.sym_sizes(), {i.name}.sym_strides(), {i.name}.options())")
        else:
            values.append(f"{_grad_given(i)} ? at::empty_like(*{i.name}, at::MemoryFormat::Contiguous)\n"
                          f"            {' ' * len(_grad_given(i))} : at::empty({{0}}, {_options_of(i.dtype, q)})")
    reads = any(i.grad_if not in ("", "given") for i in grads)
    out += ["", f"{_kernel(spec, 'backward', 'meta')} {{",
            *[f"    const {o} opt{{{m}_ARGS}};"] * reads,
            "    return {" + (",\n            ".join(values)) + "};", "}"]
    return out


def _cpu_kernels(spec: Spec) -> list[str]:
    q = spec.inputs[0].name
    return [f"{_kernel(spec, direction, 'cpu')} {{ cpu_error({q}); }}" for direction in _directions(spec)]


def _node(spec: Spec) -> list[str]:
    assert [o.name for o in spec.outputs] == ["o", "stats"], f"{spec.name}: a backward reads o and stats"
    node, o = f"{spec.name.capitalize()}Backward", _opts(spec)
    grads = spec.differentiable()
    saved = [i.name for i in spec.inputs] + ["o", "stats"]
    unpack = [f"const {'OptTensor' if i.optional else 'Tensor'} {i.name}_ = "
              + (f"saved({i.name}.unpack());" if i.optional else f"{i.name}.unpack();") for i in spec.inputs]
    unpack += ["const Tensor o_ = o.unpack(getptr()), stats_ = stats.unpack();"]
    assign = []
    for n, i in enumerate(grads):
        line = f"out[{n}] = {i.grad};"
        if i.grad_if:
            line = f"if ({_grad_given(i, '_')}) {line}"
        assign.append(line)
    statics = [f"node->opt.{x.name} = fa_named(opt.{x.name}, {{{', '.join(chr(34) + c + chr(34) for c in x.choices)}}});"
               for x in spec.options if x.kind == "str"]
    return [
        f"// {spec.name}'s autograd node: its next edges are the differentiable inputs "
        f"({', '.join(i.name for i in grads)}); o's gradient in,",
        "// a gradient (or undefined) per edge out. SavedVariable keeps what torch's generated nodes get from it: the",
        "// \"modified by an inplace operation\" check, saved-tensor hooks, a second backward refused once the graph",
        "// is freed.",
        f"struct {node} final : torch::autograd::Node {{",
        f'    std::string name() const override {{ return "fastattn::{node}"; }}',
        "",
        "    void release_variables() override {",
        "        std::lock_guard<std::mutex> lock(mutex_);",
        f"        for (SavedVariable *s : {{{', '.join('&' + n for n in saved)}}}) s->reset_data();",
        "    }",
        "",
        "    variable_list apply(variable_list &&grads) override {",
        "        std::lock_guard<std::mutex> lock(mutex_);  // as torch's generated nodes: saved tensors are shared state",
        f"        variable_list out({len(grads)});",
        "        if (!grads[0].defined()) return out;  // o unused: no gradient flows",
        *(f"        {line}" for line in unpack),
        "        at::AutoDispatchBelowADInplaceOrView below;",
        f"        auto [{', '.join(i.grad for i in grads)}] = (direct ? {spec.name}_backward : {spec.name}_backward_op)(",
        f"            grads[0], o_, stats_, {_args(spec, '_')}, opt);",
        *(f"        {line}" for line in assign),
        "        return out;",
        "    }",
        "",
        f"    SavedVariable {', '.join(saved)};",
        f"    {o} opt{{}};" + ("  // its names point at string literals, unlike the caller's" if statics else ""),
        "    bool direct = false;  // the work itself (the eager entries' calls), else the op through the dispatcher",
        "};",
        "",
        "// The forward with its node recorded (direct: the eager entries' plain CUDA tensors, the work itself; else",
        "// the op below Autograd, which fake tensors under torch.compile take to Meta), o's history, what backward",
        "// needs.",
        f"std::tuple<Tensor, Tensor> {spec.name}_recorded(bool direct, {_params(spec)}, const {o} &opt) {{",
        f"    auto node = new_node<{node}>();",
        f"    node->set_next_edges(torch::autograd::collect_next_edges({', '.join(i.name for i in grads)}));",
        "    Tensor o, stats;",
        "    {",
        "        at::AutoDispatchBelowADInplaceOrView below;",
        "        std::tie(o, stats) =",
        f"            (direct ? {spec.name}_forward : {spec.name}_forward_op)({_args(spec)}, opt);",
        "    }",
        "    const NodePtr base = node;",
        "    torch::autograd::set_history(o, base);  // stats: not differentiable, no history",
        *(f"    node->{i.name} = SavedVariable({i.name}{'.value_or(Tensor())' if i.optional else ''}, false);"
          for i in spec.inputs),
        "    node->o = SavedVariable(o, true);",
        "    node->stats = SavedVariable(stats, false);",
        "    node->opt = opt;",
        *(f"    {line}" for line in statics),
        "    node->direct = direct;",
        "    return {o, stats};",
        "}",
        "",
        f"// fastattn::{_op_name(spec, 'forward')}'s Autograd kernel: a node where a training call has an input",
        "// that wants a gradient.",
        f"{_kernel(spec, 'forward', 'autograd')} {{",
        f"    const {o} opt{{{_macro(spec)}_ARGS}};",
        f"    if (opt.training && torch::autograd::compute_requires_grad({', '.join(i.name for i in grads)})) {{",
        f"        return {spec.name}_recorded(false, {_args(spec)}, opt);",
        "    }",
        "    // No node: inference, or no input wants a gradient. Nothing saved; straight to the kernel.",
        "    at::AutoDispatchBelowADInplaceOrView below;",
        f"    return {spec.name}_forward_op({_args(spec)}, opt);",
        "}",
    ]


def _section(spec: Spec) -> list[str]:
    title = f"// ---- {spec.name}: fastattn::{_op_name(spec, 'forward')}"
    if spec.backward_op:
        title += f" and {_op_name(spec, 'backward')}"
    lines = [title + " " + "-" * max(4, 116 - len(title)), ""]
    pieces = [_plan(spec), _forward(spec)]
    if spec.backward_op:
        pieces.append(_backward(spec))
    pieces += [_cuda_kernels(spec), _through_ops(spec), _meta_kernels(spec), _cpu_kernels(spec)]
    for piece in pieces:
        lines += piece + [""]
    return lines


def _registration() -> list[str]:
    lines = ["// ---- registration " + "-" * 98, "",
             "// The Python custom ops' schemas (_specs.forward_schema, backward_schema), under other names, so that",
             "// both can be loaded at once.",
             "TORCH_LIBRARY_FRAGMENT(fastattn, m) {"]
    for s in NATIVE:
        schemas = [_op_name(s, "forward") + forward_schema(s)]
        if s.backward_op:
            schemas.append(_op_name(s, "backward") + backward_schema(s))
        for schema in schemas:
            literal = _literal(schema, " " * 10)
            lines += [f"    m.def({literal[0].lstrip()}", *literal[1:-1], f"{literal[-1]});"] if len(literal) > 1 \
                else [f"    m.def({literal[0].lstrip()});"]
    lines.append("}")
    for key in ("CUDA", "Meta", "CPU"):
        lines += ["", f"TORCH_LIBRARY_IMPL(fastattn, {key}, m) {{"]
        for s in NATIVE:
            lines += [f'    m.impl("{_op_name(s, d)}", &{s.name}_{d}_{key.lower()});' for d in _directions(s)]
        lines.append("}")
    lines += ["", "// A backward is not differentiable (no double backward), and an op without a backward has no",
              "// autograd: their outputs are plain tensors, with no \"autograd kernel not registered\" warning.",
              "TORCH_LIBRARY_IMPL(fastattn, Autograd, m) {"]
    for s in NATIVE:
        if s.backward_op:
            lines += [f'    m.impl("{_op_name(s, "forward")}", &{s.name}_forward_autograd);',
                      f'    m.impl("{_op_name(s, "backward")}", torch::CppFunction::makeFallthrough());']
        else:
            lines.append(f'    m.impl("{_op_name(s, "forward")}", torch::CppFunction::makeFallthrough());')
    lines.append("}")
    return lines


_INCLUDES = """#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <c10/core/SymInt.h>

#include <array>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"
"""

_AUTOGRAD_INCLUDES = """#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <mutex>
#include <string>
#include <tuple>

#include "node.h"
#include "ops.h"
"""


def source() -> str:
    """kernels.cpp: every native op's plan lookup, work and kernels but the Autograd one."""
    lines = [_HEADER_LINE,
             "//",
             "// Each op's section: its plan lookup, its work (outputs, gradients, the launch) and its kernels by",
             "// dispatch key (autograd.cpp holds the Autograd ones and the nodes); registration.cpp registers them.",
             "// ops.h says what the hand-written units give them (lookup, miss, run, empty_cuda, ...).",
             _INCLUDES,
             "namespace fastattn::ops {", ""]
    for spec in NATIVE:
        lines += _section(spec)
    lines.append("}  // namespace fastattn::ops")
    return "\n".join(_wrap(line) for line in "\n".join(lines).split("\n")) + "\n"


def autograd() -> str:
    """autograd.cpp: every native op's autograd node and Autograd kernel (a unit apart from kernels.cpp:
    the module's docstring says why)."""
    lines = [_HEADER_LINE,
             "//",
             "// Each op with a backward: its autograd node and its forward's Autograd kernel, which records the",
             "// node around kernels.cpp's work; registration.cpp registers the kernel.",
             _AUTOGRAD_INCLUDES,
             "namespace fastattn::ops {", "",
             "using torch::autograd::SavedVariable;",
             "using torch::autograd::variable_list;", ""]
    for spec in NATIVE:
        if spec.backward_op:
            lines += [f"// ---- {spec.name} " + "-" * (111 - len(spec.name)), "", *_node(spec), ""]
    lines.append("}  // namespace fastattn::ops")
    return "\n".join(_wrap(line) for line in "\n".join(lines).split("\n")) + "\n"


def registration() -> str:
    """registration.cpp: every native op's schema and its kernels (kernels.cpp's) by dispatch key. A unit
    of its own: torch::library's templates take about as long to compile as the ops' work, and the
    library builds as long as its slowest unit."""
    lines = [_HEADER_LINE, "", "#include <torch/library.h>", "", '#include "ops.h"', "",
             "using namespace fastattn::ops;", "", *_registration()]
    return "\n".join(_wrap(line) for line in "\n".join(lines).split("\n")) + "\n"


def header() -> str:
    """fastattn_kernels.h: what the hand-written units call of kernels.cpp, and the kernels registration.cpp
    registers."""
    lines = [_HEADER_LINE, "#pragma once", "", "namespace fastattn::ops {", ""]
    for spec in NATIVE:
        o = _opts(spec)
        grads = spec.differentiable()
        lines += [f"// {spec.name} (kernels.cpp; {spec.name}_recorded and the Autograd kernel: autograd.cpp)",
                  f"const Entry &{spec.name}_plan(int direction, {_params(spec)}, const Tensor *o, const {o} &opt);",
                  f"{_returns(len(spec.outputs))} {spec.name}_forward({_params(spec)}, const {o} &opt);"]
        if spec.backward_op:
            lines += [f"{_returns(len(grads))} {spec.name}_backward(const Tensor &d_o_in, const Tensor &o, "
                      f"const Tensor &stats, {_params(spec)}, const {o} &opt);",
                      f"std::tuple<Tensor, Tensor> {spec.name}_recorded(bool direct, {_params(spec)}, const {o} &opt);"]
        lines.append(f"{_returns(len(spec.outputs))} {spec.name}_forward_op({_params(spec)}, const {o} &opt);")
        if spec.backward_op:
            lines.append(f"{_returns(len(grads))} {spec.name}_backward_op(const Tensor &d_o, const Tensor &o, "
                         f"const Tensor &stats, {_params(spec)}, const {o} &opt);")
        lines += [f"{_kernel(spec, d, key)};" for d, key in _kernels_of(spec)]
        lines.append("")
    lines.append("}  // namespace fastattn::ops")
    return "\n".join(_wrap(line) for line in lines) + "\n"
