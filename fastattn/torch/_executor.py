"""The one executor of fastattn.torch's ops, made from their specs (_specs): the forward
and backward that run a plan, the custom ops with their fake kernels, and the one
autograd definition; and the choice of path a call takes (plain_eager).

`install(spec, module)` gives an op module (_dense, _varlen, _paged) what its spec
implies, next to the plan lookup and checks the module writes itself:
- forward_impl(*inputs, options) -> the outputs (stats None when not training) and
  backward_impl(d_o, o, stats, *inputs, options) -> a gradient or None per input: the
  plan's launch with its slots filled from the spec. They are Python source made from
  the spec and compiled once, at import (as dataclasses and namedtuple make their
  methods): a call runs straight-line code with no loop over the spec, no dict and no
  keyword expansion, so the generic executor costs what a hand-written one does.
  `source(spec)` returns that source, and tracebacks show its lines. The names it reads
  are the module's globals (plan_for, raw_stream, workspace, torch, an absent input's
  function), looked up at each call, so a test can replace one.
- forward_op / backward_op: the custom ops fastattn::<spec.forward_op> and
  <spec.backward_op> (schemas from the spec), their fake kernels (the module's
  check_traced, then the outputs' shape rules) and their autograd (register_autograd).

The autograd is one definition, `_save` and `_grads`, reached two ways. The custom ops
register it through torch.library.register_autograd; plain eager calls apply `Train`,
the autograd.Function register_autograd itself would make of it, without the dispatcher
in between: in PyTorch 2.11-2.13 a custom op's autograd wrapper made a training step cost
several times PyTorch's own SDPA step in host time (torch._library.utils.fill_defaults
rebuilds the schema's argument list once per argument; docs/history/benchmarks-log.md,
"PyTorch host time per call"). Both save the same tensors and differentiate through the
same function; only the backward's target differs: the backward op where the forward
went through the forward op (what tracing records), backward_impl where it ran directly.

Determinism: backward_impl opens with the check every launch of a cuDNN backward in
fastattn.torch makes (alert_not_deterministic): while torch.use_deterministic_algorithms(True)
is set, a backward whose plan lacks cuDNN's deterministic algorithm (options.deterministic
False) warns or raises as PyTorch's own non-deterministic kernels do. It sits in the
launch, not in the autograd definition, so that it runs when the backward runs, whichever
way it is reached: eager, the backward op of a compiled graph, the SDPA mode's kernel.

An op's custom ops take its tensors first, then its options in their order; the
backward op takes (d_o, o, stats, tensors..., options...). The op library's kernels
are written from the same specs (_kernels, at its build) and registered with the same
schemas under native_<name>.
"""

from __future__ import annotations

import linecache
import warnings
from typing import Callable, NamedTuple

import torch

from .._slots import ARG, KW, NO, OPT, SLOTS
from . import _specs

# -- the executor's source, from a spec ---------------------------------------------------------

_PARAMS = {"forward": {s.name: s.forward for s in SLOTS}, "backward": {s.name: s.backward for s in SLOTS}}
_ORDER = tuple(s.name for s in SLOTS)  # Plan.forward's and Plan.backward's parameters, in order


def _ptr(name: str, offset: int = 0, maybe: bool = False) -> str:
    p = f"{name}.data_ptr()" + (f" + {offset}" if offset else "")
    return f"({p} if {name} is not None else 0)" if maybe else p


def _launch(direction: str, slots: dict[str, str], indent: str) -> str:
    """plan.forward / plan.backward with these {slot: expression}: positional parameters
    in order (trailing ones left at their default 0), the rest by keyword."""
    params = _PARAMS[direction]
    for name in slots:
        assert params[name] is not NO, f"Plan.{direction} takes no {name}"
    positional = [n for n in _ORDER if params[n] in (ARG, OPT)]
    while positional and positional[-1] not in slots:
        positional.pop()
    args = [slots.get(n, "0") for n in positional]
    args += [f"{n}={slots[n]}" for n in _ORDER if params[n] == KW and n in slots]
    return f"{indent}c.plan.{direction}({', '.join(args)})"


def _shape_expr(spec: _specs.Spec, output: _specs.Output) -> str:
    """A packed op's output shape as an expression of the call's tensors (its axes fixed)."""
    at = _specs.axis_positions(spec, None)
    if output.like:
        dims = [f"{output.like}.shape[{i}]" for i in range(len(spec.axes))]
        for axis, source in output.replace:
            dims[at[axis]] = f"{source}.shape[{at[axis]}]"
    else:
        dims = [str(d) if isinstance(d, int) else f"{d[0]}.shape[{at[d[1]]}]" for d in output.dims]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def _dtype(dtype: str) -> str:
    return f", dtype=torch.{dtype}" if dtype else ""


def _absent(spec: _specs.Spec, indent: str) -> list[str]:
    return [f"{indent}if {i.name} is None:\n{indent}    {i.name} = {i.absent}({spec.inputs[0].name}, c.device)"
            for i in spec.inputs if i.absent]


def _kw_optional(spec: _specs.Spec, direction: str) -> list[_specs.Input]:
    """The optional inputs that fill keyword slots: none given is the common call, whose
    launch passes positional arguments only."""
    return [i for i in spec.inputs if i.optional and not i.absent
            and any(_PARAMS[direction][s] == KW for s, _ in i.slots)]


def _input_slots(spec: _specs.Spec, direction: str, skip=()) -> dict[str, str]:
    out = {}
    for i in spec.inputs:
        if i.name in skip:
            continue
        for slot, offset in i.slots:
            if _PARAMS[direction][slot] is not NO:
                out[slot] = _ptr(i.name, offset, maybe=i.optional and not i.absent)
    return out


def _lookup(spec: _specs.Spec, o: str) -> list[str]:
    """What both directions' bodies open with, after the docstring: whether the call is
    padded, its plan (`o`: the plan_for argument for the output), an absent input made."""
    lines = [f"    padded = {spec.padded_by} is not None"] if spec.padded_by else []
    lines.append(f"    c = plan_for({', '.join(i.name for i in spec.inputs)}, {o}, options)")
    return lines + _absent(spec, "    ")


def _forward_source(spec: _specs.Spec) -> str:
    names = [i.name for i in spec.inputs]
    q = names[0]
    args = ", ".join(names)
    lines = [f"def forward_impl({args}, options):",
             f'    """fastattn::{spec.forward_op}\'s work (made from _specs.{spec.name.upper()}): '
             f'{", ".join(o.name for o in spec.outputs)}."""']
    lines += _lookup(spec, "None")
    if any(o.training_only for o in spec.outputs):
        lines.append("    training = options.training")
    slots = {}
    for out in spec.outputs:
        name = out.name
        if spec.packed:
            alloc = f"{q}.new_empty({_shape_expr(spec, out)}{_dtype(out.dtype)})"
        else:  # the plan key fixes the shapes: the plan's entry holds them (_plans.CachedPlan)
            assert name in ("o", "stats"), f"{spec.name}: the plan's entry holds o's and stats' shapes only"
            shape = f"c.{'out' if name == 'o' else 'stats'}_shape"
            alloc = f"{q}.new_empty({shape}{_dtype(out.dtype)})"
            if name == "o" and not out.dtype:
                alloc = f"torch.empty_like({q}) if c.out_like_q else {alloc}"
        if out.training_only:
            lines.append(f"    {name} = {alloc} if training else None")
            slots[out.slot] = f"{name}.data_ptr() if training else 0"
            continue
        if spec.padded_by and out.like:
            # Rows past a sequence's length are zero, not whatever the allocator held: they
            # flow into the next layer (and its weight gradients) unless the caller masks them.
            shape = _shape_expr(spec, out) if spec.packed else "c.out_shape"
            lines += ["    if padded:", f"        {name} = {q}.new_zeros({shape}{_dtype(out.dtype)})",
                      "    else:", f"        {name} = {alloc}"]
        else:
            lines.append(f"    {name} = {alloc}")
        slots[out.slot] = f"{name}.data_ptr()"
    lines += ["    stream = raw_stream(c.device)",
              # the workspace from PyTorch's caching allocator, used on this stream only (_plans.workspace)
              f"    ws = workspace({q}, c.forward_workspace, c.device, stream)"]
    slots["workspace"] = "ws.data_ptr() if ws is not None else 0"
    slots["stream"] = "stream"
    lines += _branches(spec, "forward", slots)
    result = ", ".join(o.name for o in spec.outputs)
    lines.append(f"    return {result}")
    return "\n".join(lines) + "\n"


class _Grads(dict):
    """{gradient slot: expression}, with the input each belongs to."""

    def __init__(self):
        super().__init__()
        self.owner = {}

    def add(self, slot: str, expr: str, owner: str) -> None:
        self[slot], self.owner[slot] = expr, owner

    def without(self, inputs: set[str]) -> dict[str, str]:
        return {slot: e for slot, e in self.items() if self.owner[slot] not in inputs}


def _branches(spec: _specs.Spec, direction: str, slots: dict[str, str], grads: _Grads | None = None) -> list[str]:
    """The launch: with no optional keyword input given (the common call), positional
    arguments only; else every slot."""
    grads = grads if grads is not None else _Grads()
    optional = _kw_optional(spec, direction)
    full = {**slots, **_input_slots(spec, direction), **grads}
    if not optional:
        return [_launch(direction, full, "    ")]
    skip = {i.name for i in optional}
    common = {**slots, **_input_slots(spec, direction, skip), **grads.without(skip)}
    return [f"    if {' and '.join(f'{i.name} is None' for i in optional)}:  # the common call: positional only",
            _launch(direction, common, "        "),
            "    else:",
            _launch(direction, full, "        ")]


def _backward_source(spec: _specs.Spec) -> str:
    names = [i.name for i in spec.inputs]
    q = names[0]
    args = ", ".join(names)
    chosen = " and not options.deterministic" if any(o.name == "deterministic" for o in spec.options) else ""
    lines = [f"def backward_impl(d_o, o, stats, {args}, options):",
             f'    """fastattn::{spec.backward_op}\'s work (made from _specs.{spec.name.upper()}): a gradient '
             'or None per input, in their order."""',
             f"    if deterministic_algorithms(){chosen}:  # torch.use_deterministic_algorithms(True): before any work",
             "        alert_not_deterministic()",
             "    if d_o.stride() != o.stride():  # the backward graph reads d_o at o's strides (the plan's)",
             "        d_o = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device).copy_(d_o)"]
    lines += _lookup(spec, "o")
    grads = _Grads()
    rows = [i for i in spec.inputs if i.grad and not i.grad_if]
    for n, i in enumerate(rows):
        if spec.packed:  # (the op's checks make its inputs contiguous: empty_like keeps their strides)
            alloc = f"torch.empty_like({i.name})"
        else:
            assert spec.inputs[n] is i, f"{spec.name}: the plan's entry knows the first three inputs' strides only"
            alloc = (f"torch.empty_like({i.name}) if c.grads_like[{n}] else torch.empty_strided({i.name}.shape, "
                     f"{i.name}.stride(), dtype={i.name}.dtype, device={i.name}.device)")
        lines.append(f"    {i.grad} = {alloc}")
        grads.add(i.grad, f"{i.grad}.data_ptr()", i.name)
    if spec.padded_by and rows:
        lines.append("    if padded:  # padded rows get zero gradients (see forward_impl)")
        lines += [f"        {i.grad}.zero_()" for i in rows]
    for i in spec.inputs:
        if i.grad and i.grad_if:
            when = f"{i.name} is not None" if i.grad_if == "given" else f"options.{i.grad_if}"
            lines.append(f"    {i.grad} = torch.empty_like({i.name}, memory_format=torch.contiguous_format) "
                         f"if {when} else None")
            grads.add(i.grad, _ptr(i.grad, maybe=True), i.name)
    lines += ["    stream = raw_stream(c.device)",
              f"    ws = workspace({q}, c.backward_workspace, c.device, stream)"]
    slots = {"o": "o.data_ptr()", "d_o": "d_o.data_ptr()", "stats": "stats.data_ptr()",
             "workspace": "ws.data_ptr() if ws is not None else 0", "stream": "stream"}
    lines += _branches(spec, "backward", slots, grads)
    result = ", ".join(i.grad if i.grad else "None" for i in spec.inputs)
    lines.append(f"    return {result}")
    return "\n".join(lines) + "\n"


def source(spec: _specs.Spec) -> str:
    """The Python source of spec's forward_impl (and backward_impl): what install compiles."""
    text = _forward_source(spec)
    if spec.backward_op:
        text += "\n\n" + _backward_source(spec)
    return text


def _compile(spec: _specs.Spec, namespace: dict) -> None:
    text = source(spec)
    filename = f"<fastattn.torch executor: {spec.name}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)  # tracebacks show the lines
    exec(compile(text, filename, "exec"), namespace)  # noqa: S102 - source made from the spec above


# -- the custom ops ----------------------------------------------------------------------------

class Installed(NamedTuple):
    forward_impl: Callable
    backward_impl: Callable | None
    forward_op: Callable
    backward_op: Callable | None


def _empty(q: torch.Tensor, dtype: str) -> torch.Tensor:
    # What a custom op returns for an output or gradient the call does not write (its schema fixes a Tensor).
    return q.new_empty(0, dtype=getattr(torch, dtype) if dtype else q.dtype)


def install(spec: _specs.Spec, module, options: type) -> Installed:
    """Makes spec's forward_impl, backward_impl, forward_op and backward_op (with fake
    kernels and autograd) in `module` (an op module, while it is imported; it also gets
    backward_through_op, which the autograd reads) and returns them (the backward ones
    None without a backward), for the module to bind by name. `options` is the NamedTuple
    of spec's options. The module defines, before it calls this: plan_for(*inputs, o,
    options) (o None for the forward's own output), raw_stream, workspace,
    check_traced(*inputs, options) (a fake kernel's checks: what a miss checks), each
    absent input's function and, where spec has a backward, deterministic_algorithms and
    alert_not_deterministic (this module's)."""
    namespace = vars(module)
    _compile(spec, namespace)
    n = len(spec.inputs)
    single = len(spec.outputs) == 1

    def forward(*args):
        inputs = args[:n]
        out = module.forward_impl(*inputs, options(*args[n:]))
        if single:
            return out
        return tuple(o if o is not None else _empty(inputs[0], spec.outputs[i].dtype) for i, o in enumerate(out))

    forward_op = torch.library.custom_op(f"fastattn::{spec.forward_op}", forward, mutates_args=(),
                                         schema=_specs.forward_schema(spec))

    @forward_op.register_fake
    def _(*args):
        inputs, opts = args[:n], options(*args[n:])
        module.check_traced(*inputs, opts)  # a trace refuses what eager does
        tensors = dict(zip((i.name for i in spec.inputs), inputs))
        q, out = inputs[0], []  # (outputs are on the first input's device)
        for o in spec.outputs:
            if o.training_only and not opts.training:
                out.append(_empty(q, o.dtype))
            else:
                shape = _specs.output_shape(spec, o, tensors, opts)
                out.append(q.new_empty(shape, dtype=getattr(torch, o.dtype) if o.dtype else q.dtype))
        return out[0] if single else tuple(out)

    if not spec.backward_op:
        return Installed(namespace["forward_impl"], None, forward_op, None)
    differentiable = [(k, i) for k, i in enumerate(spec.inputs) if i.grad]

    def backward(d_o, o, stats, *args):
        inputs = args[:n]
        grads = module.backward_impl(d_o, o, stats, *inputs, options(*args[n:]))
        return tuple(grads[k] if grads[k] is not None else _empty(inputs[0], i.dtype) for k, i in differentiable)

    backward_op = torch.library.custom_op(f"fastattn::{spec.backward_op}", backward, mutates_args=(),
                                          schema=_specs.backward_schema(spec))

    @backward_op.register_fake
    def _(d_o, o, stats, *args):
        inputs, opts = args[:n], options(*args[n:])
        out = []
        for k, i in differentiable:
            t = inputs[k]
            if not i.grad_if:
                out.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device))
            elif t is not None and (i.grad_if == "given" or getattr(opts, i.grad_if)):
                out.append(torch.empty_like(t, memory_format=torch.contiguous_format))
            else:
                out.append(_empty(inputs[0], i.dtype))
        return tuple(out)

    def backward_through_op(d_o, o, stats, inputs, opts):
        """backward_impl's result (a gradient or None per input) through the backward op."""
        got = backward_op(d_o, o, stats, *inputs, *opts)
        grads = [None] * n
        for g, (k, i) in zip(got, differentiable):
            if not i.grad_if or (inputs[k] is not None and (i.grad_if == "given" or getattr(opts, i.grad_if))):
                grads[k] = g  # (the op's empty tensors for gradients it does not compute: autograd wants None)
        return grads

    no_grads = (None,) * len(options._fields)

    def setup_context(ctx, inputs, output):
        ctx.op, ctx.direct = module, False
        _save(ctx, inputs[:n], options._make(inputs[n:]), *output)

    def grad(ctx, d_o, d_stats):
        return (*_grads(ctx, d_o), *no_grads)

    forward_op.register_autograd(grad, setup_context=setup_context)
    module.backward_through_op = backward_through_op
    return Installed(namespace["forward_impl"], namespace["backward_impl"], forward_op, backward_op)


# -- autograd ----------------------------------------------------------------------------------

def _save(ctx, inputs: tuple, options: tuple, o: torch.Tensor, stats: torch.Tensor | None) -> None:
    ctx.save_for_backward(*inputs, o, stats)
    ctx.options = options


def _grads(ctx, d_o) -> tuple:
    """A gradient or None per input of the forward that ctx saved."""
    options = ctx.options
    if not options.training:
        raise RuntimeError("fastattn: backward through a call made without gradients enabled")
    *inputs, o, stats = ctx.saved_tensors
    if ctx.direct:
        return ctx.op.backward_impl(d_o, o, stats, *inputs, options)
    return ctx.op.backward_through_op(d_o, o, stats, inputs, options)


class Train(torch.autograd.Function):
    """A plain eager training call: Train.apply(op, options, with_stats, *inputs) -> o,
    or (o, stats) with with_stats (the log-sum-exp FlashAttention calls softmax_lse,
    without a gradient). op: any object with forward_impl and backward_impl, as install
    gives an op module (the shape classes' module has its own)."""

    @staticmethod
    def forward(ctx, op, options: tuple, with_stats: bool, *inputs):
        o, stats = op.forward_impl(*inputs, options)
        ctx.op, ctx.direct = op, True
        _save(ctx, inputs, options, o, stats)
        if not with_stats:
            return o
        ctx.mark_non_differentiable(stats)
        ctx.set_materialize_grads(False)  # no zeros allocated for stats' gradient, which is unused
        return o, stats

    @staticmethod
    def backward(ctx, d_o, d_stats=None):
        return (None, None, None, *_grads(ctx, d_o))


# -- determinism ---------------------------------------------------------------------------------

# torch.are_deterministic_algorithms_enabled() and is_deterministic_algorithms_warn_only_enabled()
# without their Python wrappers: the process-wide flags torch.use_deterministic_algorithms sets.
deterministic_algorithms = torch._C._get_deterministic_algorithms
deterministic_warn_only = torch._C._get_deterministic_algorithms_warn_only

# The start of what alert_not_deterministic says: PyTorch's cuDNN SDPA backward's own words
# (which PyTorch's tests match), then what fastattn ran and how to get a deterministic backward.
NOT_DETERMINISTIC = "cuDNN Attention defaults to a non-deterministic algorithm."
_HOW = ("fastattn.torch.attention and attention_varlen, and fastattn.flash's functions, take deterministic=True for "
        "cuDNN's deterministic backward where cuDNN has one for the call; the SDPA mode gives each call that needs a "
        "backward to PyTorch's kernels while torch.use_deterministic_algorithms(True) without warn_only is set at its "
        "forward.")


def alert_not_deterministic() -> None:
    """What a backward that runs cuDNN without its deterministic algorithm does while
    torch.use_deterministic_algorithms(True) is set, as PyTorch's kernels that have no
    deterministic implementation do (at::Context::alertNotDeterministic): with
    warn_only=True a UserWarning, else RuntimeError, worded as PyTorch's cuDNN SDPA
    backward words it (NOT_DETERMINISTIC). Nothing while the flag is not set. Called by
    every launch of such a backward before its work: the Python path's (the executor's
    backward_impl, the shape classes' and FP8's), and the op library's (csrc/table.cpp
    run, through ops.cpp), where the plan's config has deterministic=False."""
    if not deterministic_algorithms():
        return
    if deterministic_warn_only():
        warnings.warn(f"{NOT_DETERMINISTIC} fastattn ran a backward without cuDNN's deterministic algorithm, but you "
                      f"set 'torch.use_deterministic_algorithms(True, warn_only=True)'. {_HOW}", UserWarning,
                      stacklevel=2)
        return
    raise RuntimeError(f"{NOT_DETERMINISTIC} fastattn has no deterministic algorithm for this backward (its forward "
                       f"was made without deterministic=True), but you set 'torch.use_deterministic_algorithms(True)'. "
                       f"{_HOW} You can also use the 'warn_only=True' option, if that's acceptable for your "
                       "application.")


# -- the path a call takes -----------------------------------------------------------------------

def plain_eager(q: torch.Tensor) -> bool:
    """A plain tensor on a CUDA device, outside torch.compile, any tracing mode, any
    torch.func transform and torch.jit.trace (which records only calls that reach the
    dispatcher): the call may skip the custom ops (whose wrappers cost host time) and
    run directly."""
    return (type(q) is torch.Tensor and q.is_cuda and not torch.compiler.is_compiling()
            and not dispatch_modes() and not functorch_active() and not jit_tracing())


dispatch_modes = torch._C._len_torch_dispatch_stack  # FakeTensorMode, make_fx's proxy mode, ...
functorch_active = torch._C._are_functorch_transforms_active  # torch.func.grad, vmap: tensors are wrappers
jit_tracing = torch._C._is_tracing
