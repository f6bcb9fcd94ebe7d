"""gather/scatter along a dim, including a sharded one (masked local work).

gather(x, dim, index) with x split along `dim`: each rank looks up only the indices that fall
in its block (shifted by the block's offset) and writes 0 elsewhere; every index falls in
exactly one block, so the true result is the sum over ranks: `Partial(sum)`. This is what
makes the vocab-parallel cross-entropy fall out with no special context.

scatter(self, dim, index, src) with self split along `dim`: each rank writes the indices in its
block; the others are sent to a padding slot that is cut off. The output stays split.
"""

from __future__ import annotations

import attrs
import torch

from hpfun.layout import Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option

aten = torch.ops.aten


def _masked_index(ctx, layout, shape, dim: int, index, local_size: int, fill: int):
    """Index shifted into this rank's block along `dim`, and the mask of indices inside it."""
    local = ctx.call(aten.sub.Tensor, (index, ctx.shard_offset(layout, shape, dim)))
    inside = ctx.call(
        aten.logical_and.default,
        (ctx.call(aten.ge.Scalar, (local, 0)), ctx.call(aten.lt.Scalar, (local, local_size))),
    )
    return ctx.call(aten.where.ScalarOther, (inside, local, fill)), inside


@attrs.frozen(kw_only=True)
class Gather(Rule):
    """gather(x, dim, index): output has index's shape."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        x, index = call.tensors[0], call.tensors[1]
        gdim = call.arg(1, "dim") % x.ndim
        per_axis = []
        for a in range(call.mesh.ndim):
            p, q = x.layout.placements[a], index.layout.placements[a]
            options = [replicated_option(call)]
            if isinstance(p, Shard) and p.dim == gdim:
                options.insert(0, ((p, R), (Partial("sum"),)))
            elif isinstance(p, Shard) and index.shape[p.dim] == x.shape[p.dim]:
                options.insert(0, ((p, p), (p,)))
            elif isinstance(p, Partial) and p.reduce in ("sum", "avg"):
                options.insert(0, ((p, R), (p,)))
            if isinstance(q, Shard):
                options.insert(1, ((R, q), (q,)))
            per_axis.append(options)
        return combine_axes(call, per_axis)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        x_layout, x = strategy.inputs[0], call.tensors[0]
        gdim = call.arg(1, "dim") % x.ndim
        if not x_layout.shard_axes(gdim):
            return super().emit(ctx, call, strategy, args, kwargs)
        local_size = x_layout.local_shape(x.shape)[gdim]
        index, inside = _masked_index(ctx, x_layout, x.shape, gdim, args[2], local_size, 0)
        found = ctx.call(aten.gather.default, (args[0], gdim, index))
        return ctx.call(aten.where.ScalarOther, (inside, found, 0))


@attrs.frozen(kw_only=True)
class Scatter(Rule):
    """scatter(self, dim, index, src-or-value); `add`: accumulates (scatter_add), so linear."""

    add: bool = False

    def strategies(self, call: OpCall) -> list[Strategy]:
        tensors = call.tensors
        x, index = tensors[0], tensors[1]
        sdim = call.arg(1, "dim") % x.ndim
        n = len(tensors)
        per_axis = []
        for a in range(call.mesh.ndim):
            p = x.layout.placements[a]
            options = [replicated_option(call)]
            if isinstance(p, Shard) and p.dim == sdim:
                options.insert(0, ((p,) + (R,) * (n - 1), (p,)))
            elif isinstance(p, Shard) and all(t.shape[p.dim] == x.shape[p.dim] for t in tensors[1:]):
                options.insert(0, ((p,) * n, (p,)))
            elif isinstance(p, Partial) and p.reduce in ("sum", "avg") and self.add:
                options.insert(0, ((p, R) + (p,) * (n - 2), (p,)))
            q = index.layout.placements[a]
            if isinstance(q, Shard) and q.dim != sdim and all(t.shape[q.dim] == x.shape[q.dim] for t in tensors[1:]):
                options.insert(1, ((q,) * n, (q,)))
            per_axis.append(options)
        return combine_axes(call, per_axis)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        x_layout, x = strategy.inputs[0], call.tensors[0]
        sdim = call.arg(1, "dim") % x.ndim
        if not x_layout.shard_axes(sdim):
            return super().emit(ctx, call, strategy, args, kwargs)
        local_shape = list(x_layout.local_shape(x.shape))
        size = local_shape[sdim]
        index, _ = _masked_index(ctx, x_layout, x.shape, sdim, args[2], size, size)
        pad = ctx.call(aten.new_zeros.default, (args[0], local_shape[:sdim] + [1] + local_shape[sdim + 1 :]))
        padded = ctx.call(aten.cat.default, ([args[0], pad], sdim))
        out = ctx.call(call.op, (padded, sdim, index) + tuple(args[3:]), kwargs)
        return ctx.call(aten.slice.Tensor, (out, sdim, 0, size))
