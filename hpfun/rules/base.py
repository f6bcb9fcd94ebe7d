"""What a rule sees (`OpCall`), what it returns (`Strategy`), and the `Rule` base class.

A rule is a pure function of shapes and layouts: `strategies(call)` lists the layouts the op
can run with; `emit(ctx, ...)` writes the op's local computation into the per-shard graph for
the chosen strategy (by default the same op, with shape arguments made local).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from hpfun.errors import Problem, ShardingError
from hpfun.layout import Layout, R, Shard
from hpfun.mesh import Mesh


@attrs.frozen
class TensorArg:
    """A tensor argument of an op: its global shape, dtype, current layout and argument slot."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout
    index: int  # position of the top-level argument holding it (a list of tensors shares one)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@attrs.frozen
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@attrs.frozen(eq=False)
class OpCall:
    """One op application as rules see it: tensors replaced by `TensorArg`, outputs by `TensorMeta`."""

    op: Any
    args: tuple
    kwargs: dict
    outputs: tuple[TensorMeta, ...]
    mesh: Mesh

    @functools.cached_property
    def tensors(self) -> list[TensorArg]:
        """Tensor arguments in flattening order (the order of `Strategy.inputs`); computed once
        (rules ask for them many times per call)."""
        leaves = pytree.tree_leaves((self.args, self.kwargs))
        return [x for x in leaves if isinstance(x, TensorArg)]

    def arg(self, index: int, name: str | None = None, default=None):
        """Positional argument `index`, or keyword `name` (by default the schema's name for
        position `index`), or `default`."""
        if index is not None and index < len(self.args):
            return self.args[index]
        name = name or _schema_name(self.op, index)
        return self.kwargs.get(name, default) if name else default


def _schema_name(op, index: int | None) -> str | None:
    arguments = op._schema.arguments if hasattr(op, "_schema") else ()
    return arguments[index].name if index is not None and index < len(arguments) else None


@attrs.frozen
class Strategy:
    """Layouts an op can run with: one required layout per tensor input, one per output."""

    inputs: tuple[Layout, ...]
    outputs: tuple[Layout, ...]
    note: Any = None  # family-specific data for `emit` (e.g. which dims are masked)


# ---------------------------------------------------------------------------------------------
# Per-axis strategy building: most rules reason one mesh axis at a time.
# ---------------------------------------------------------------------------------------------

AxisOption = tuple[tuple, tuple]  # (placement per tensor input, placement per output)


def combine_axes(call: OpCall, per_axis: list[list[AxisOption]]) -> list[Strategy]:
    """Strategies from per-mesh-axis options (cartesian product), keeping those whose shapes divide."""
    tensors, outputs = call.tensors, call.outputs
    seen, out, mesh = set(), [], call.mesh
    for combo in itertools.product(*(_dedupe(opts) for opts in per_axis)):
        ins = tuple(_layout(mesh, tuple(c[0][i] for c in combo)) for i in range(len(tensors)))
        outs = tuple(_layout(mesh, tuple(c[1][o] for c in combo)) for o in range(len(outputs)))
        key = (ins, outs)
        if key in seen:
            continue
        seen.add(key)
        if all(l.fits(t.shape) for l, t in zip(ins, tensors, strict=True)) and all(
            l.fits(o.shape) for l, o in zip(outs, outputs, strict=True)
        ):
            out.append(Strategy(ins, outs))
    return out


@functools.lru_cache(maxsize=4096)
def _layout(mesh, placements: tuple) -> Layout:
    """One Layout per (mesh, placements): layouts are immutable, and rules build the same few
    thousands of times per program."""
    return Layout(mesh, placements)


def _dedupe(options):
    return list(dict.fromkeys(o for o in options if o is not None))


def replicated_option(call: OpCall) -> AxisOption:
    return (R,) * len(call.tensors), (R,) * len(call.outputs)


# ---------------------------------------------------------------------------------------------
# Axis orders: rules reason one mesh axis at a time, so the layouts they list split a dim over
# several axes in mesh order. An input split in another order keeps it where it can.
# ---------------------------------------------------------------------------------------------


def keep_orders(call: OpCall, strategies: list[Strategy]) -> list[Strategy]:
    """`strategies`, each followed by its variant in the axis orders of an input's layout,
    where the same order can serve every tensor of it.

    Why a variant is correct: renumbering the ranks along the axes of one group (the mesh
    axes splitting one dim) turns a layout splitting a dim over exactly those axes in one
    order into the same layout in another order, and leaves a layout that holds one same
    placement on all of them (R, or one Partial) as it is. So a strategy in which every tensor
    is one or the other stays correct with the group's order changed in all of them alike (its
    local op sees renumbered ranks; what it reads of the rank's position, offsets and random
    counters, comes from the layouts). A tensor split over some of the axes but not all, or
    over them in another order than the others, would see the renumbering: no variant then.
    """
    orders = list(dict.fromkeys(t.layout.order for t in call.tensors if t.layout.order))
    if not orders:
        return strategies
    out: list[Strategy] = []
    for strategy in strategies:
        for candidate in [strategy] + [_in_order(strategy, order) for order in orders]:
            if candidate not in out:
                out.append(candidate)
    return out


def _in_order(strategy: Strategy, order: tuple) -> Strategy:
    """`strategy` with each group of `order` (mesh axes, major first) applied where it can serve."""
    for group in order:
        layouts = strategy.inputs + strategy.outputs
        dims = [_dim_split_by(layout, group) for layout in layouts]
        now = {layout.shard_axes(d) for layout, d in zip(layouts, dims, strict=True) if d is not None and d is not False}
        if any(d is False for d in dims) or len(now) > 1:
            continue
        ordered = [layout if d is None else layout.with_order(d, group) for layout, d in zip(layouts, dims, strict=True)]
        n = len(strategy.inputs)
        strategy = attrs.evolve(strategy, inputs=tuple(ordered[:n]), outputs=tuple(ordered[n:]))
    return strategy


def _dim_split_by(layout: Layout, axes: tuple[int, ...]):
    """The dim that exactly `axes` split in `layout`; None if they all hold one same placement
    that is not a split; False otherwise (the order cannot serve this layout)."""
    held = {layout.placements[a] for a in axes}
    if len(held) != 1:
        return False
    placement = held.pop()
    if not isinstance(placement, Shard):
        return None
    return placement.dim if set(layout.shard_axes(placement.dim)) == set(axes) else False




# ---------------------------------------------------------------------------------------------
# The Rule base class
# ---------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Rule:
    """Base of every rule family. Subclasses add YAML parameters as attrs fields.

    `shape_arg`: position of an argument holding the output's shape (view, expand, full...),
    rewritten to the local shape when lowering.
    """

    shape_arg: int | None = None
    reason: str | None = None  # why a rule is replicate-only, shown in reports

    def strategies(self, call: OpCall) -> list[Strategy]:
        raise NotImplementedError

    def emit(self, ctx, call: OpCall, strategy: Strategy, args: tuple, kwargs: dict):
        """Write the local op into the per-shard graph; returns the new node."""
        if self.shape_arg is not None:
            args = list(args)
            args[self.shape_arg] = list(strategy.outputs[0].local_shape(call.outputs[0].shape))
        return ctx.call(call.op, tuple(args), kwargs)


@attrs.frozen(kw_only=True)
class Replicated(Rule):
    """Runs only on replicated inputs (with `reason` saying why); output replicated."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        r = Layout.replicated(call.mesh)
        return [Strategy((r,) * len(call.tensors), (r,) * len(call.outputs))]


@attrs.frozen(kw_only=True)
class DataDependent(Replicated):
    """Ops whose output shape depends on the input's values (nonzero): no block of the input
    determines a block of the output, so a split input is an error naming the dim; a
    replicated or Partial input runs whole (after its reduction)."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        problems = [
            Problem(str(call.op), f"its output shape depends on the values of input {i}, whose dim {p.dim} "
                    f"is split over mesh axis {call.mesh.axis_names[a]!r}",
                    "compute it outside the sharded function, or keep that input replicated")
            for i, t in enumerate(call.tensors) for a, p in enumerate(t.layout.placements) if isinstance(p, Shard)
        ]
        if problems:
            raise ShardingError(problems)
        return super().strategies(call)
