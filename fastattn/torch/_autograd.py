"""The one autograd definition of fastattn.torch's differentiable entry points
(attention, attention_varlen), and the choice of path a call takes.

A call takes one of two paths to the same work. Plain eager calls run the entry point's
Python directly under `Eager`, an autograd.Function: in PyTorch 2.11-2.13 a custom op's
autograd wrapper made a training step cost several times PyTorch's own SDPA step in host
time (torch._library.utils.fill_defaults rebuilds the schema's argument list once per
argument; docs/history/benchmarks-log.md, "PyTorch host time per
call"). torch.compile, tracing and torch.func go through the custom ops, whose autograd
`register` wires from the same `Rule`. Both save the same tensors the same way (`_save`)
and differentiate through the same function (`_saved`, then the rule's backward), so
that the two paths cannot drift.

An entry point's custom ops take its tensors first, then its options in the order of
its options NamedTuple's fields; the backward op takes (d_o, o, stats, tensors...,
options...). A native op library can register the same schemas.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class Rule(NamedTuple):
    """How autograd runs one entry point.

    forward(*tensors, options) -> (o, stats): the work, on the tensor inputs in schema order;
      stats is None or an empty tensor when not training.
    backward(d_o, o, stats, tensors, options) -> a gradient or None per tensor input: the
      backward work, run directly (the eager path).
    backward_op: the same through the backward custom op (what tracing records).
    options: the options NamedTuple type; its fields follow the tensors in the ops' schemas.
    """

    forward: Callable
    backward: Callable
    backward_op: Callable
    options: type


def _save(ctx, tensors: tuple, options: tuple, o: torch.Tensor, stats: torch.Tensor | None) -> None:
    ctx.save_for_backward(*tensors, o, stats)
    ctx.options = options


def _saved(ctx) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(o, stats, tensor inputs) saved by _save; refuses a call made without gradients."""
    if not ctx.options.training:
        raise RuntimeError("fastattn: backward through a call made without gradients enabled")
    *tensors, o, stats = ctx.saved_tensors
    return o, stats, tensors


class Eager(torch.autograd.Function):
    """Plain eager training: Eager.apply(rule, options, *tensors) -> o."""

    @staticmethod
    def forward(ctx, rule: Rule, options: tuple, *tensors):
        o, stats = rule.forward(*tensors, options)
        ctx.rule = rule
        _save(ctx, tensors, options, o, stats)
        return o

    @staticmethod
    def backward(ctx, d_o):
        o, stats, tensors = _saved(ctx)
        return (None, None, *ctx.rule.backward(d_o, o, stats, tensors, ctx.options))


class EagerWithStats(torch.autograd.Function):
    """Eager, also returning the forward's stats (the log-sum-exp FlashAttention calls
    softmax_lse), which get no gradient: EagerWithStats.apply(rule, options, *tensors)
    -> (o, stats)."""

    @staticmethod
    def forward(ctx, rule: Rule, options: tuple, *tensors):
        o, stats = rule.forward(*tensors, options)
        ctx.rule = rule
        _save(ctx, tensors, options, o, stats)
        ctx.mark_non_differentiable(stats)
        ctx.set_materialize_grads(False)  # no zeros allocated for stats' gradient, which is unused
        return o, stats

    @staticmethod
    def backward(ctx, d_o, d_stats):
        o, stats, tensors = _saved(ctx)
        return (None, None, *ctx.rule.backward(d_o, o, stats, tensors, ctx.options))


def register(forward_op, rule: Rule, n_tensors: int) -> None:
    """forward_op's autograd: its first n_tensors inputs are tensors, the rest rule.options'
    fields; it returns (o, stats)."""
    no_grads = (None,) * len(rule.options._fields)

    def setup_context(ctx, inputs, output):
        _save(ctx, inputs[:n_tensors], rule.options._make(inputs[n_tensors:]), *output)

    def grad(ctx, d_o, d_stats):
        o, stats, tensors = _saved(ctx)
        return (*rule.backward_op(d_o, o, stats, tensors, ctx.options), *no_grads)

    forward_op.register_autograd(grad, setup_context=setup_context)


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
