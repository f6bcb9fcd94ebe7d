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


def _masked_index(ctx, layout, shape, dim: int, index, local_size: int, fill: int, checked: bool = False):
    """Index shifted into this rank's block along `dim`, and the mask of indices inside it. An
    index outside the whole dim raises, as eager's kernel does (masked, it would read zeros or
    write nowhere, silently), unless the caller `checked` it already."""
    if not checked:
        within = ctx.call(aten.logical_and.default, (ctx.call(aten.ge.Scalar, (index, 0)),
                                                     ctx.call(aten.lt.Scalar, (index, shape[dim]))))
        ctx.call(aten._assert_async.msg, (ctx.call(aten.all.default, (within,)),
                                          f"an index is out of range for dim {dim} of size {shape[dim]}"))
    local = ctx.call(aten.sub.Tensor, (index, ctx.shard_offset(layout, shape, dim)))
    inside = ctx.call(
        aten.logical_and.default,
        (ctx.call(aten.ge.Scalar, (local, 0)), ctx.call(aten.lt.Scalar, (local, local_size))),
    )
    return ctx.call(aten.where.ScalarOther, (inside, local, fill)), inside


def masked(ctx, inside, found, dtype: torch.dtype):
    """`found` where `inside`, else zero of its dtype (False for bool: a where with the integer 0
    would promote a bool lookup to int64). A float's zero is -0.0: the sum over ranks is then
    exactly the one rank's value, a -0.0 too (+0.0 would turn it into +0.0: `1 / x` gave inf
    where eager gives -inf)."""
    zero = False if dtype == torch.bool else -0.0 if dtype.is_floating_point or dtype.is_complex else 0
    return ctx.call(aten.where.ScalarOther, (inside, found, zero))


def _dim(call: OpCall, x) -> int:
    """The op's `dim` argument, made non-negative (a 0-d tensor takes dim 0 or -1)."""
    return call.arg(1) % max(x.ndim, 1)


def _masked_lookup(rule, ctx, call: OpCall, strategy: Strategy, args, kwargs, mask_shape):
    """gather/index_select of x split along the looked-up dim: each rank looks up the indices in
    its block and writes 0 elsewhere (the output is Partial(sum)); otherwise the op as is."""
    x_layout, x = strategy.inputs[0], call.tensors[0]
    dim = _dim(call, x)
    if not x_layout.shard_axes(dim):
        return Rule.emit(rule, ctx, call, strategy, args, kwargs)
    local_size = x_layout.local_shape(x.shape)[dim]
    index, inside = _masked_index(ctx, x_layout, x.shape, dim, args[2], local_size, 0)
    found = ctx.call(call.op, (args[0], dim, index))
    return masked(ctx, mask_shape(inside, x), found, call.outputs[0].dtype)


@attrs.frozen(kw_only=True)
class Gather(Rule):
    """gather(x, dim, index): output has index's shape."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        x, index = call.tensors[0], call.tensors[1]
        gdim = _dim(call, x)
        same_rank = len(index.shape) == len(x.shape)  # (an empty index may have another: torch takes it)
        per_axis = []
        for a in range(call.mesh.ndim):
            p, q = x.layout.placements[a], index.layout.placements[a]
            options = [replicated_option(call)]
            if isinstance(p, Shard) and p.dim == gdim:
                options.insert(0, ((p, R), (Partial("sum"),)))
            elif isinstance(p, Shard) and same_rank and index.shape[p.dim] == x.shape[p.dim]:
                options.insert(0, ((p, p), (p,)))
            elif isinstance(p, Partial) and p.reduce in ("sum", "avg"):
                options.insert(0, ((p, R), (p,)))
            # out[i, j] = x[i, index[i, j]] (gdim 1): a block of index along gdim reads all of x's
            # row, but a block along another dim reads the same block of x's rows
            if isinstance(q, Shard) and q.dim == gdim:
                options.insert(1, ((R, q), (q,)))
            elif isinstance(q, Shard) and same_rank and index.shape[q.dim] == x.shape[q.dim]:
                options.insert(1, ((q, q), (q,)))
            per_axis.append(options)
        return combine_axes(call, per_axis)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        return _masked_lookup(self, ctx, call, strategy, args, kwargs, lambda inside, x: inside)


@attrs.frozen(kw_only=True)
class Scatter(Rule):
    """scatter(self, dim, index, src-or-value); `add`: accumulates (scatter_add), so linear."""

    add: bool = False

    def strategies(self, call: OpCall) -> list[Strategy]:
        tensors = call.tensors
        x, index = tensors[0], tensors[1]
        sdim = _dim(call, x)
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
        sdim = _dim(call, x)
        if not x_layout.shard_axes(sdim):
            return super().emit(ctx, call, strategy, args, kwargs)
        local_shape = list(x_layout.local_shape(x.shape))
        size = local_shape[sdim]
        index, _ = _masked_index(ctx, x_layout, x.shape, sdim, args[2], size, size)
        pad = ctx.call(aten.new_zeros.default, (args[0], local_shape[:sdim] + [1] + local_shape[sdim + 1 :]))
        padded = ctx.call(aten.cat.default, ([args[0], pad], sdim))
        out = ctx.call(call.op, (padded, sdim, index) + tuple(args[3:]), kwargs)
        return ctx.call(aten.slice.Tensor, (out, sdim, 0, size))



@attrs.frozen(kw_only=True)
class ZerosAndScatter(Rule):
    """flex_lib.zeros_and_scatter(shape, indices, vals): zeros of `shape` with `vals` added at
    the indices (accumulated): the gradient of a tensor a flex_attention score_mod or mask_mod
    reads (a learned slope per head). Linear in `vals`: their Partial sum (or avg) passes, the
    indices replicated; otherwise every tensor whole."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        *indices, vals = call.tensors
        per_axis = []
        for a in range(call.mesh.ndim):
            options = [replicated_option(call)]
            p = vals.layout.placements[a]
            if isinstance(p, Partial) and p.reduce in ("sum", "avg"):
                options.insert(0, ((R,) * len(indices) + (p,), (p,)))
            per_axis.append(options)
        return combine_axes(call, per_axis)


@attrs.frozen(kw_only=True)
class IndexReduce(Scatter):
    """index_reduce(self, dim, index, source, reduce, include_self): each row of `self` along
    `dim` that `index` names reduced (prod, mean, amax, amin) with the rows of `source` naming
    it. `self` split along `dim`: each rank reduces the rows its block holds, the others sent to
    a padding row that is cut off (as scatter); split along another dim: `source` split alike
    (its other dims are self's), rows independent. No Partial passes: none of the four
    reductions is a sum of the terms' results."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        x, index, source = call.tensors[:3]
        sdim = _dim(call, x)
        per_axis = []
        for a in range(call.mesh.ndim):
            p = x.layout.placements[a]
            options = [replicated_option(call)]
            if isinstance(p, Shard) and p.dim == sdim:
                options.insert(0, ((p, R, R), (p,)))
            elif isinstance(p, Shard) and source.ndim == x.ndim and source.shape[p.dim] == x.shape[p.dim]:
                options.insert(0, ((p, R, p), (p,)))
            per_axis.append(options)
        return combine_axes(call, per_axis)


@attrs.frozen(kw_only=True)
class Embedding(Rule):
    """embedding(weight, ids): rows of weight (V, D) picked by ids; output ids.shape + (D,).

    Per mesh axis: weight split on V (the vocab) is a masked local lookup giving Partial(sum),
    as in gather; weight split on D gives the output split on its last dim; ids split on a dim
    give the output split on it; a Partial weight gives a Partial output (a lookup is linear).
    """

    def strategies(self, call: OpCall) -> list[Strategy]:
        w, ids = call.tensors[0], call.tensors[1]
        per_axis = []
        for a in range(call.mesh.ndim):
            p, q = w.layout.placements[a], ids.layout.placements[a]
            options = [replicated_option(call)]
            if p == Shard(0):
                options.insert(0, ((p, R), (Partial("sum"),)))
            elif p == Shard(1):
                options.insert(0, ((p, R), (Shard(ids.ndim),)))
            elif isinstance(p, Partial) and p.reduce in ("sum", "avg"):
                options.insert(0, ((p, R), (p,)))
            if isinstance(q, Shard):
                options.insert(1, ((R, q), (q,)))
            per_axis.append(options)
        return combine_axes(call, per_axis)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        w_layout, w = strategy.inputs[0], call.tensors[0]
        if not w_layout.shard_axes(0):
            return super().emit(ctx, call, strategy, args, kwargs)
        local_size = w_layout.local_shape(w.shape)[0]
        ids, inside = _masked_index(ctx, w_layout, w.shape, 0, args[1], local_size, 0)
        found = ctx.call(aten.embedding.default, (args[0], ids))
        return masked(ctx, ctx.call(aten.unsqueeze.default, (inside, -1)), found, call.outputs[0].dtype)


@attrs.frozen(kw_only=True)
class EmbeddingBackward(Rule):
    """embedding_dense_backward(grad, ids, num_weights, padding_idx, scale_grad_by_freq) -> (V, D).

    The gradient adds each grad row into the row its id names: linear in grad. Per mesh axis:
    grad split on D gives the output split on D; grad and ids split alike on a token dim give
    Partial(sum) (each rank adds its tokens; needs global counts, so not with scale_grad_by_freq);
    a Partial grad gives a Partial output; replicated inputs may also give the output split on
    V, each rank adding only the ids in its block (the others go to a padding row, cut off).

    Capture records the op whole and splits it into torch's decomposition (`FUSED` in
    hpfun.capture), which propagation lays out; `hpfun.fuse` puts the op back where this rule
    offers the layouts the pieces ran in. (Offered to a greedy walk directly, the vocab split
    from replicated inputs would look cheaper and be carried through the whole update, to be
    gathered at the end, where the pieces' own rules follow what the update needs.)
    """

    def strategies(self, call: OpCall) -> list[Strategy]:
        grad, ids = call.tensors[0], call.tensors[1]
        per_axis = []
        for a in range(call.mesh.ndim):
            g, q = grad.layout.placements[a], ids.layout.placements[a]
            options = [replicated_option(call), ((R, R), (Shard(0),))]
            if g == Shard(grad.ndim - 1):
                options.insert(0, ((g, R), (Shard(1),)))
            elif isinstance(g, Partial) and g.reduce in ("sum", "avg"):
                options.insert(0, ((g, R), (g,)))
            token_dims = {p.dim for p in (g, q) if isinstance(p, Shard) and p.dim < ids.ndim}
            for d in () if call.arg(4, default=False) else token_dims:
                options.insert(0, ((Shard(d), Shard(d)), (Partial("sum"),)))
            per_axis.append(options)
        return combine_axes(call, per_axis)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        out_layout, shape = strategy.outputs[0], call.outputs[0].shape
        if not out_layout.shard_axes(0):
            return super().emit(ctx, call, strategy, args, kwargs)
        grad, ids = args[0], args[1]
        padding_idx = call.arg(3, default=-1)
        if padding_idx >= 0:  # rows of the padding id get no gradient; its local index varies by rank
            keep = ctx.call(aten.ne.Scalar, (ids, padding_idx))
            grad = ctx.call(aten.where.ScalarOther, (ctx.call(aten.unsqueeze.default, (keep, -1)), grad, 0))
        size = out_layout.local_shape(shape)[0]
        local, _ = _masked_index(ctx, out_layout, shape, 0, ids, size, size)
        out = ctx.call(aten.embedding_dense_backward.default, (grad, local, size + 1, -1, call.arg(4, default=False)))
        return ctx.call(aten.slice.Tensor, (out, 0, 0, size))


@attrs.frozen(kw_only=True)
class IndexSelect(Rule):
    """index_select(x, dim, index): x along `dim` picked by a 1-D index.

    x split along `dim` is a masked local lookup giving Partial(sum) (as gather); x split on
    another dim keeps it; index split gives the output split along `dim`; a Partial x passes.
    """

    def strategies(self, call: OpCall) -> list[Strategy]:
        x, index = call.tensors[0], call.tensors[1]
        dim = _dim(call, x)
        per_axis = []
        for a in range(call.mesh.ndim):
            p, q = x.layout.placements[a], index.layout.placements[a]
            options = [replicated_option(call)]
            if isinstance(p, Shard):
                options.insert(0, ((p, R), (Partial("sum") if p.dim == dim else p,)))
            elif isinstance(p, Partial) and p.reduce in ("sum", "avg"):
                options.insert(0, ((p, R), (p,)))
            if isinstance(q, Shard):
                options.insert(1, ((R, q), (Shard(dim),)))
            per_axis.append(options)
        return combine_axes(call, per_axis)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        def along_dim(inside, x):  # a 1-D mask over `dim`, broadcast over the dims after it
            return ctx.call(aten.view.default, (inside, [-1] + [1] * (x.ndim - _dim(call, x) - 1)))

        return _masked_lookup(self, ctx, call, strategy, args, kwargs, along_dim)


@attrs.frozen(kw_only=True)
class SortedLookup(Rule):
    """bucketize(input, boundaries) and searchsorted(sorted_sequence, input): each element of
    input looked up in a sorted table, elementwise in input. The table is read whole along its
    last dim; input's split dims pass to the output. A batched table (searchsorted's N-D
    sequence: one sorted row per leading index) is split along a leading dim with input.
    `table`: the table's position among the tensors (1 for bucketize, 0 for searchsorted); a
    `sorter` (a third tensor) runs replicated."""

    table: int = 1

    def strategies(self, call: OpCall) -> list[Strategy]:
        if len(call.tensors) != 2:
            return combine_axes(call, [[replicated_option(call)] for _ in range(call.mesh.ndim)])
        table, x = call.tensors[self.table], call.tensors[1 - self.table]
        per_axis = []
        for a in range(call.mesh.ndim):
            p = x.layout.placements[a]
            options = [replicated_option(call)]
            if isinstance(p, Shard):
                batched = table.ndim > 1 and p.dim < x.ndim - 1  # (a leading dim: the table's rows follow)
                pair = [p, p if batched else R]
                options.insert(0, (tuple(pair[1] if i == self.table else pair[0] for i in range(2)), (p,)))
            per_axis.append(options)
        return combine_axes(call, per_axis)
