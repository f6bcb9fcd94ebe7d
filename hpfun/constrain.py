"""`hpfun.constrain(x, spec, grad=None)`: pin the layout of an intermediate value and of its gradient.

Propagation picks intermediate layouts by cost; sometimes the user knows better, e.g. sequence
parallelism keeps the activations around each norm split along the sequence. `constrain` is an
identity whose rule demands the given layout, so the producer's value is redistributed to it
right there (a Partial value to a split one is a reduce-scatter), and the backward pass gets
the same constraint on the gradient.
"""

from __future__ import annotations

import attrs
import torch

from hpfun.errors import SpecError
from hpfun.layout import P
from hpfun.rules.base import OpCall, Rule, Strategy


def _encode(spec: P) -> str:
    return ";".join("" if e is None else e if isinstance(e, str) else "+".join(e) for e in spec.dims)


def _decode(text: str) -> P:
    return P(*[None if not e else tuple(e.split("+")) if "+" in e else e for e in text.split(";")] if text else [])


# A plain op (no autograd wrapper of its own: `_Constrain` is its autograd, which composes with
# torch.func transforms where torch.library.custom_op's generated one does not).
_LIB = torch.library.Library("hpfun", "DEF")
_LIB.define("constrain(Tensor x, str spec) -> Tensor")
_LIB.impl("constrain", lambda x, spec: x.clone(), "CompositeExplicitAutograd")
torch.library.register_fake("hpfun::constrain", lambda x, spec: torch.empty_like(x), lib=_LIB)
_constrain = torch.ops.hpfun.constrain.default


class _Constrain(torch.autograd.Function):
    """The pin as an autograd function composing with every transform: its backward is a pin
    too (of the gradient, whose own gradient is pinned as the value: second derivatives, a
    gradient penalty), its forward-mode tangent is pinned as the value (jvp, jacfwd, hessian),
    and under vmap the batch dim is pinned whole."""

    @staticmethod
    def forward(x, spec, grad_spec):
        return _constrain(x, spec)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec, ctx.grad_spec = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        return _Constrain.apply(grad, ctx.grad_spec, ctx.spec), None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _Constrain.apply(tangent, ctx.spec, ctx.grad_spec)

    @staticmethod
    def vmap(info, in_dims, x, spec, grad_spec):
        if in_dims[0] is None:
            return _Constrain.apply(x, spec, grad_spec), None
        batched = [_encode(P(None, *_decode(s).dims)) for s in (spec, grad_spec)]
        return _Constrain.apply(x.movedim(in_dims[0], 0), *batched), 0


def constrain(x: torch.Tensor, spec: P, *, grad: P | None = None) -> torch.Tensor:
    """Inside a sharded function: `x`, laid out as `spec` on the function's mesh (an identity).
    Its gradient is laid out as `grad` (default: `spec` too).

    A different `grad` spells Megatron's sequence-parallel all-gather: the norm's output,
    split along the sequence, is pinned whole for the column-parallel matmuls
    (`constrain(y, P(), grad=P(None, "tp"))`), and its gradient, a Partial sum from their
    backward, arrives split along the sequence again: one reduce-scatter, not an all-reduce.

    >>> import hpfun, torch
    >>> mesh = hpfun.Mesh.simulated((2,), ("tp",))
    >>> f = hpfun.shard(lambda x: hpfun.constrain(x * 2, hpfun.P(None, "tp")), mesh=mesh, in_specs=hpfun.P())
    >>> f(torch.ones(2, 4)).layout.placements
    (Shard(dim=1),)
    """
    if not isinstance(spec, P):
        raise SpecError(f"constrain needs an hpfun.P spec, got {spec!r}")
    if grad is not None and not isinstance(grad, P):
        raise SpecError(f"constrain needs an hpfun.P grad (or None for the spec), got {grad!r}")
    return _Constrain.apply(x, _encode(spec), _encode(spec if grad is None else grad))


def check_pins(gm: torch.fx.GraphModule, mesh) -> None:
    """Every `constrain` of a traced function checked against the mesh and its value's shape
    before planning: all problems in one report, each at the user's line."""
    from hpfun.capture import user_line
    from hpfun.errors import Problem

    problems = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _constrain:
            continue
        val, spec = node.args[0].meta.get("val"), _decode(node.args[1])
        if not isinstance(val, torch.Tensor):
            continue
        line = user_line(node.meta.get("stack_trace"))
        where = f"hpfun.constrain({spec}) at {line}" if line else f"hpfun.constrain({spec}) ({node.name})"
        found = spec.problems(mesh, val.ndim)
        if not found:
            found = [f"{p} (shape {tuple(val.shape)})" for p in spec.to_layout(mesh, val.ndim).problems(tuple(val.shape))]
        problems += [Problem(where, p, "name the mesh's axes, on dims they divide (or pin another dim)")
                     for p in found]
    if problems:
        raise SpecError(problems, headline="bad hpfun.constrain specs")


@attrs.frozen(kw_only=True)
class Constrain(Rule):
    """The rule of `hpfun::constrain`: input and output take the spec's layout."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        x = call.tensors[0]
        spec = _decode(call.args[1])
        problems = spec.problems(call.mesh, x.ndim)
        if problems:
            raise SpecError(problems, headline="bad hpfun.constrain spec")
        layout = spec.to_layout(call.mesh, x.ndim)
        return [Strategy((layout,), (layout,))]

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        # a copy, as eager's constrain is: an alias of an input written back after the call (an
        # in-place op on it later in the function) would change with it
        return ctx.call(torch.ops.aten.clone.default, (args[0],))
