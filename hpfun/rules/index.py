"""Advanced indexing: index (x[i, :, j]) and index_put (x[i, :, j] = v, or += with accumulate).

Geometry: the index tensors broadcast to a shape B. The output of index is x's dims with the
indexed ones replaced by B: in place of the first indexed dim when the indexed dims are
adjacent, in front otherwise. A dim of x that is not indexed keeps its blocks, so it may be
split (x, the output and index_put's values split alike); a dim of B may be split when every
index tensor that has it at full size is split the same way.

An indexed dim of x that is split is looked up locally with masked indices, as in gather:
index gives Partial(sum) (each element is found on exactly one rank), index_put writes only
the indices in its block (the others go to a padding slot that is cut off).
"""

from __future__ import annotations

import attrs
import torch

from hpfun.layout import Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option
from hpfun.rules.gather import _masked_index, masked

aten = torch.ops.aten


@attrs.frozen
class _Geometry:
    indexed: tuple[int, ...]  # dims of x that are indexed
    index_shape: tuple[int, ...]  # B, the broadcast shape of the index tensors
    start: int  # the output dim where B begins
    kept: dict  # dim of x not indexed -> its dim in the output
    out_shape: tuple[int, ...]  # the shape of x[indices]

    def b_dim(self, t, dim: int) -> int:
        """The dim of B that dim `dim` of index tensor `t` broadcasts to."""
        return dim + len(self.index_shape) - t.ndim

    def t_dim(self, t, b: int) -> int | None:
        """The dim of index tensor `t` at full size along B's dim `b`, or None."""
        d = b - (len(self.index_shape) - t.ndim)
        return d if d >= 0 and t.shape[d] == self.index_shape[b] else None

    def x_dim(self, out_dim: int) -> int | None:
        """The dim of x kept as `out_dim` of x[indices], or None (a dim of B)."""
        return next((d for d, o in self.kept.items() if o == out_dim), None)

    def splits(self, indices, b: int) -> tuple:
        """Placements of the index tensors splitting B's dim `b`."""
        return tuple(R if self.t_dim(t, b) is None else Shard(self.t_dim(t, b)) for t in indices)


def _geometry(x, indices) -> _Geometry:
    indexed = tuple(d for d, t in enumerate(indices) if t is not None)
    shape = tuple(torch.broadcast_shapes(*(indices[d].shape for d in indexed)))
    adjacent = indexed[-1] - indexed[0] + 1 == len(indexed)
    start = indexed[0] if adjacent else 0
    others = [d for d in range(x.ndim) if d not in indexed]
    if adjacent:
        kept = {d: d if d < start else d - len(indexed) + len(shape) for d in others}
    else:
        kept = {d: len(shape) + i for i, d in enumerate(others)}
    out_shape = [0] * (len(others) + len(shape))
    out_shape[start : start + len(shape)] = shape
    for d, o in kept.items():
        out_shape[o] = x.shape[d]
    return _Geometry(indexed, shape, start, kept, tuple(out_shape))


def _seeded_b_dims(indices, geo: _Geometry, a: int) -> set[int]:
    """Dims of B that an index tensor splits (at full size) over mesh axis `a`."""
    out = set()
    for t in indices:
        q = t.layout.placements[a]
        if isinstance(q, Shard) and geo.t_dim(t, geo.b_dim(t, q.dim)) is not None:
            out.add(geo.b_dim(t, q.dim))
    return out


def _index_tensors(call: OpCall) -> list:
    return [t for t in call.arg(1) if t is not None]


def _bool_index(call: OpCall) -> bool:
    return any(t.dtype == torch.bool for t in _index_tensors(call))


def _replicated(call: OpCall) -> list[Strategy]:
    return combine_axes(call, [[replicated_option(call)]] * call.mesh.ndim)


@attrs.frozen(kw_only=True)
class Index(Rule):
    """index(x, indices): x[indices] with a list of index tensors (None: a whole dim)."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        if _bool_index(call):  # a mask's output shape depends on data: capture never gets here
            return _replicated(call)
        x, indices = call.tensors[0], _index_tensors(call)
        geo, n = _geometry(x, call.arg(1)), len(indices)
        per_axis = []
        for a in range(call.mesh.ndim):
            p, options = x.layout.placements[a], []
            if isinstance(p, Shard):
                out = Partial("sum") if p.dim in geo.indexed else Shard(geo.kept[p.dim])
                options.append(((p,) + (R,) * n, (out,)))
            elif isinstance(p, Partial) and p.reduce in ("sum", "avg"):
                options.append(((p,) + (R,) * n, (p,)))
            for b in _seeded_b_dims(indices, geo, a):
                options.append(((R,) + geo.splits(indices, b), (Shard(geo.start + b),)))
            per_axis.append(options + [replicated_option(call)])
        return combine_axes(call, per_axis)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        layout, x = strategy.inputs[0], call.tensors[0]
        geo = _geometry(x, call.arg(1))
        split = [d for d in geo.indexed if layout.shard_axes(d)]
        if not split:
            return super().emit(ctx, call, strategy, args, kwargs)
        indices, inside = _local_indices(ctx, layout, x.shape, list(args[1]), split, fill_outside=False)
        found = ctx.call(aten.index.Tensor, (args[0], indices))
        for _ in range(len(geo.out_shape) - geo.start - len(geo.index_shape)):
            inside = ctx.call(aten.unsqueeze.default, (inside, -1))  # B's dims are followed by kept dims
        return masked(ctx, inside, found, call.outputs[0].dtype)


@attrs.frozen(kw_only=True)
class IndexPut(Rule):
    """index_put(x, indices, values, accumulate): x with x[indices] set to (or, accumulating,
    increased by) values broadcast to x[indices]'s shape.

    Besides the geometry above: x and values may be Partial together (x[i] = v1 + v2 on
    x1 + x2 is the sum of x1[i] = v1 and x2[i] = v2); accumulating, index tensors and values
    split along B give Partial(sum) with x Partial(sum) too (x + sum of the rank's updates,
    summed over ranks, counts x once: a replicated x turns Partial locally).
    """

    def strategies(self, call: OpCall) -> list[Strategy]:
        if _bool_index(call):
            return _replicated(call)
        x, values, indices = call.tensors[0], call.tensors[-1], _index_tensors(call)
        geo = _geometry(x, call.arg(1))
        per_axis = []
        for a in range(call.mesh.ndim):
            options = _kept_options(geo, x, values, len(indices), a) + _partial_options(x, values, len(indices), a)
            if call.arg(3, default=False):
                options += _b_options(geo, indices, values, a)
            per_axis.append(options + [replicated_option(call)])
        return combine_axes(call, per_axis)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        layout, x = strategy.inputs[0], call.tensors[0]
        geo = _geometry(x, call.arg(1))
        split = [d for d in geo.indexed if layout.shard_axes(d)]
        if not split:
            return super().emit(ctx, call, strategy, args, kwargs)
        indices, _ = _local_indices(ctx, layout, x.shape, list(args[1]), split, fill_outside=True)
        local = list(layout.local_shape(x.shape))
        padded = args[0]
        for d in split:  # one padding slot per split dim receives the writes of other blocks
            pad = ctx.call(aten.new_zeros.default, (padded, local[:d] + [1] + local[d + 1 :]))
            padded = ctx.call(aten.cat.default, ([padded, pad], d))
            local[d] += 1
        out = ctx.call(aten.index_put.default, (padded, indices) + tuple(args[2:]), kwargs)
        for d in split:
            out = ctx.call(aten.slice.Tensor, (out, d, 0, local[d] - 1))
        return out


def _kept_options(geo: _Geometry, x, values, n: int, a: int) -> list:
    """index_put options of one mesh axis with x split: on any dim (values following the
    kept dims), or where values is split on a kept dim."""
    p, v, out = x.layout.placements[a], values.layout.placements[a], []
    if isinstance(p, Shard):
        vp = R if p.dim in geo.indexed else _value_split(geo, values, geo.kept[p.dim])
        out.append(((p,) + (R,) * n + (vp,), (p,)))
    d = geo.x_dim(_out_dim(geo, values, v.dim)) if isinstance(v, Shard) else None
    if d is not None:
        out.append(((Shard(d),) + (R,) * n + (v,), (Shard(d),)))
    return out


def _partial_options(x, values, n: int, a: int) -> list:
    """x and values Partial together (index tensors replicated)."""
    for q in (x.layout.placements[a], values.layout.placements[a]):
        if isinstance(q, Partial) and q.reduce in ("sum", "avg"):
            return [((q,) + (R,) * n + (q,), (q,))]
    return []


def _b_options(geo: _Geometry, indices, values, a: int) -> list:
    """Accumulating: index tensors (and values) split along B give Partial(sum), x Partial too."""
    v = values.layout.placements[a]
    b_dims = _seeded_b_dims(indices, geo, a)
    if isinstance(v, Shard) and 0 <= _out_dim(geo, values, v.dim) - geo.start < len(geo.index_shape):
        b_dims.add(_out_dim(geo, values, v.dim) - geo.start)
    psum = Partial("sum")
    return [((psum,) + geo.splits(indices, b) + (_value_split(geo, values, geo.start + b),), (psum,)) for b in b_dims]


def _out_dim(geo: _Geometry, values, dim: int) -> int:
    """The dim of x[indices] that dim `dim` of values broadcasts to."""
    return dim + len(geo.out_shape) - values.ndim


def _value_split(geo: _Geometry, values, out_dim: int):
    """Placement of values following x[indices]'s dim `out_dim`: split if values has it at full size."""
    d = out_dim - (len(geo.out_shape) - values.ndim)
    return Shard(d) if d >= 0 and values.shape[d] == geo.out_shape[out_dim] else R


def _local_indices(ctx, layout, shape, indices: list, split: list[int], fill_outside: bool):
    """Index tensors of the split dims shifted into this rank's block; `inside`: the AND of
    their masks. Outside indices go to slot 0 (index) or to the padding slot (index_put)."""
    local, inside = layout.local_shape(shape), None
    for d in split:
        # out of range, eager raises; wrapped here it would pick a row silently: checked (every
        # rank sees the whole index tensor it reads)
        within = ctx.call(aten.logical_and.default, (ctx.call(aten.ge.Scalar, (indices[d], -shape[d])),
                                                     ctx.call(aten.lt.Scalar, (indices[d], shape[d]))))
        ctx.call(aten._assert_async.msg, (ctx.call(aten.all.default, (within,)),
                                          f"an index is out of range for dim {d} of size {shape[d]}"))
        wrapped = ctx.call(aten.remainder.Scalar, (indices[d], shape[d]))  # negative indices count from the end
        fill = local[d] if fill_outside else 0
        indices[d], mask = _masked_index(ctx, layout, shape, d, wrapped, local[d], fill, checked=True)
        inside = mask if inside is None else ctx.call(aten.logical_and.default, (inside, mask))
    return indices, inside
