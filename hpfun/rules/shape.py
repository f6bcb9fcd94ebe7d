"""Dimension algebra: view/reshape/squeeze/unsqueeze, permute, expand/repeat, slicing, cat,
split, diagonal and diagonal_scatter, slice_scatter, and view_as_complex/view_as_real.

All of these move data without arithmetic, so every Partial passes through unchanged
(view(a1 + a2) = view(a1) + view(a2)); only where each sharded dim goes needs thought. The
complex views are the exception: a complex number has no order, so only Partial(sum) and
Partial(avg) cross them.
"""

from __future__ import annotations

import math

import attrs
import torch

from hpfun.layout import Layout, Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option
from hpfun.rules.gather import _masked_index, masked

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default)
_SQUEEZES = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dims of `src` and `dst` whose sizes multiply to the same number.

    >>> view_groups((2, 3, 4), (6, 4))
    [([0, 1], [0]), ([2], [1])]
    """
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        if i < len(src):
            gi.append(i)
            i += 1
        if j < len(dst):
            gj.append(j)
            j += 1
        while math.prod(src[d] for d in gi) != math.prod(dst[d] for d in gj):
            grow_src = math.prod(src[d] for d in gi) < math.prod(dst[d] for d in gj)
            if grow_src and i < len(src):
                gi.append(i)
                i += 1
            elif j < len(dst):
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def _major(dims: list[int], shape) -> int | None:
    return next((d for d in dims if shape[d] != 1), None)


@attrs.frozen(kw_only=True)
class Reshape(Rule):
    """view, _unsafe_view, reshape, squeeze, unsqueeze: any op fixed by input and output shapes.

    A sharded dim survives when it is the major (first non-1) dim of its group: splitting it in
    n contiguous blocks splits the group's flattened run, so the group's major output dim
    (if n divides it). Other sharded dims must be gathered first.
    """

    def strategies(self, call: OpCall) -> list[Strategy]:
        x, out = call.tensors[0], call.outputs[0]
        if 0 in x.shape or 0 in out.shape:
            return [_replicated(call)]
        where = {}
        for gi, gj in view_groups(x.shape, out.shape):
            src, dst = _major(gi, x.shape), _major(gj, out.shape)
            if src is not None and dst is not None:
                where[src] = dst
        ins, outs = [], []
        for p in x.layout.placements:
            if isinstance(p, Shard) and p.dim in where:
                ins.append(p), outs.append(Shard(where[p.dim]))
            elif isinstance(p, Shard):
                ins.append(R), outs.append(R)
            else:
                ins.append(p), outs.append(p)
        return _with_fallback(call, ins, outs)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args: tuple, kwargs: dict):
        """A view becomes a reshape in the per-shard program: a rank's block need not have the
        strides the global value had when it was traced (a block of a permuted value, or a
        kernel that lays its output out differently), and reshape is the same view wherever one
        is possible, a copy where not."""
        if call.op in _VIEWS:
            call = attrs.evolve(call, op=aten.reshape.default)
        elif call.op in _SQUEEZES:  # it drops the dims of size 1 in the rank's block: a dim split down to one
            # element per rank is not one of the global value's (it dropped it, and the block lost a dim)
            return ctx.call(aten.reshape.default, (args[0], list(strategy.outputs[0].local_shape(call.outputs[0].shape))))
        return super().emit(ctx, call, strategy, args, kwargs)


@attrs.frozen(kw_only=True)
class Permute(Rule):
    """permute(x, dims): the shard of input dim `dims[i]` becomes the shard of output dim i."""

    dims_arg: int = 1

    def strategies(self, call: OpCall) -> list[Strategy]:
        x = call.tensors[0]
        perm = [d % x.ndim for d in call.arg(self.dims_arg, "dims")]
        outs = [Shard(perm.index(p.dim)) if isinstance(p, Shard) else p for p in x.layout.placements]
        return _with_fallback(call, list(x.layout.placements), outs)


@attrs.frozen(kw_only=True)
class Expand(Rule):
    """expand(x, shape): dims of x align with the output's from the right; size-1 dims broadcast."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        x, out = call.tensors[0], call.outputs[0]
        off = out.ndim - x.ndim
        ins, outs = [], []
        for p in x.layout.placements:
            if isinstance(p, Shard) and x.shape[p.dim] == out.shape[p.dim + off]:
                ins.append(p), outs.append(Shard(p.dim + off))
            elif isinstance(p, Shard):
                ins.append(R), outs.append(R)
            else:
                ins.append(p), outs.append(p)
        return _with_fallback(call, ins, outs)


@attrs.frozen(kw_only=True)
class Slice(Rule):
    """slice/select/narrow/split along `dim_arg`: that dim must be whole; other dims follow.

    `drops_dim`: the op removes the dim (select).
    """

    dim_arg: int = 1
    drops_dim: bool = False

    def strategies(self, call: OpCall) -> list[Strategy]:
        x = call.tensors[0]
        dim = call.arg(self.dim_arg, "dim", 0) % x.ndim
        # a slice of the whole dim (a cat's backward for its one input) copies each block; one of
        # none of it (`x[:0]`) is empty in any layout: the dim may stay split
        kept = call.op is aten.slice.Tensor and call.outputs[0].shape[dim] in (0, x.shape[dim]) and \
            call.arg(4, "step", 1) in (1, None) or self._one_piece(call, dim) or self._tiles(call, dim)
        ins, outs, picked = [], [], []
        for p in x.layout.placements:
            if isinstance(p, Shard) and (p.dim != dim or kept):
                ins.append(p), outs.append(Shard(p.dim - (self.drops_dim and p.dim > dim)))
                picked.append(outs[-1])
            elif isinstance(p, Shard):
                ins.append(R), outs.append(R), picked.append(Partial("sum"))
            else:
                ins.append(p), outs.append(p), picked.append(p)
        # x's order of the axes splitting each dim the slice keeps split alike (`P(("tp", "dp"))` on another
        # dim): the blocks each rank keeps are its own, in that order (a pick built in mesh order scrambled them)
        order = tuple(g for g in x.layout.order if all(ins[a] == x.layout.placements[a] for a in g))
        out = _with_fallback(call, ins, outs, order)
        if picked != outs and call.op in _PICKS and 4 * math.prod(call.outputs[0].shape) <= math.prod(x.shape):
            # the dim split: each rank picks the rows its block holds and writes -0.0 for the
            # others, so the slice is their sum, all-reduced at once (`inner_moves`): not a gather
            # of all of x. Summed at once it is exactly the picked value (x + -0.0 is x, -0.0 and
            # inf too); a Partial left pending would not be through a sign change or a factor of
            # inf (the other ranks' -0.0 made +0.0, or NaN). Only for a few rows (a CLS token): an
            # all-reduce moves twice its size, and a slice of most of the dim (a label shift,
            # `lg[:, :-1]`) is cheaper gathered
            layout = Layout(call.mesh, picked, order)
            if layout.fits(call.outputs[0].shape):
                rest = tuple(t.layout for t in call.tensors[1:])
                out.insert(0, Strategy((x.layout,) + rest, (Layout(call.mesh, tuple(outs), order),), note="picked"))
        return out

    def inner_moves(self, call: OpCall, strategy: Strategy) -> list:
        """A pick's all-reduce of the rows each block holds: (from, to, global shape, dtype)."""
        if strategy.note != "picked":
            return []
        dst = strategy.outputs[0]
        dim = call.arg(self.dim_arg, "dim", 0) % call.tensors[0].ndim
        axes = strategy.inputs[0].shard_axes(dim)
        src = Layout(dst.mesh, tuple(Partial("sum") if a in axes else p for a, p in enumerate(dst.placements)),
                     dst.order)
        return [(src, dst, tuple(call.outputs[0].shape), call.outputs[0].dtype)]

    def _tiles(self, call: OpCall, dim: int) -> bool:
        """`x[start::step]` along a split dim whose blocks the step tiles (`x[::2]`, `x[1::2]` of
        blocks of even length): each block holds its share of the rows at the same local
        offsets, so the slice of each block is the block of the slice."""
        x = call.tensors[0]
        if call.op is not aten.slice.Tensor or not x.layout.shard_axes(dim):
            return False
        return _tiling(_picked_rows(call, x.shape[dim]), x.shape[dim], x.layout.shard_factor(dim))

    def emit(self, ctx, call: OpCall, strategy: Strategy, args: tuple, kwargs: dict):
        x = call.tensors[0]
        if strategy.note != "picked" and call.op is aten.slice.Tensor and \
                strategy.inputs[0].shard_axes(dim := call.arg(self.dim_arg, "dim", 0) % x.ndim) and \
                (rows := _picked_rows(call, x.shape[dim])).step > 1:  # tiled: the block's own rows
            return ctx.call(aten.slice.Tensor, (args[0], dim, rows.start, None, rows.step))
        if strategy.note != "picked" and call.op is aten.slice.Tensor and strategy.inputs[0].shard_axes(dim) and \
                call.outputs[0].shape[dim] in (0, x.shape[dim]):  # (kept split: none of each block, or all of it;
            # the slice's own bounds mean other rows of a block, `x[-4:3]` of 8 rows is rows 0-2 of a block of 4)
            return ctx.call(aten.slice.Tensor, (args[0], dim, 0, 0 if call.outputs[0].shape[dim] == 0 else None))
        if strategy.note != "picked":
            return super().emit(ctx, call, strategy, args, kwargs)
        x_layout, x = strategy.inputs[0], call.tensors[0]
        dim = call.arg(self.dim_arg, "dim", 0) % x.ndim
        rows = _picked_rows(call, x.shape[dim])
        index = ctx.call(aten.arange.default, (len(rows),), ctx.made(torch.int64))
        if rows.step != 1:
            index = ctx.call(aten.mul.Tensor, (index, rows.step))
        if rows.start:
            index = ctx.call(aten.add.Tensor, (index, rows.start))
        local, inside = _masked_index(ctx, x_layout, x.shape, dim, index, x_layout.local_shape(x.shape)[dim], 0,
                                      checked=True)
        found = ctx.call(aten.index_select.default, (args[0], dim, local))
        shape = [1] * x.ndim
        shape[dim] = len(rows)
        out = masked(ctx, ctx.call(aten.view.default, (inside, shape)), found, call.outputs[0].dtype)
        if self.drops_dim:
            out = ctx.call(aten.squeeze.dim, (out, dim))
        (src, dst, shape, dtype), = self.inner_moves(call, strategy)
        ctx.annotate(out, src, shape, dtype)
        ctx.consumer = (*ctx.consumer[:2], f"{call.op} of rows of split dim {dim}: each block's rows, summed")
        return ctx.redistribute(out, src, dst, shape, dtype)

    def _one_piece(self, call: OpCall, dim: int) -> bool:
        """A split into one piece, the whole dim (einops.unpack of one tensor): a copy of each block."""
        return call.op in (aten.split.Tensor, aten.split_with_sizes.default) and len(call.outputs) == 1 and \
            call.outputs[0].shape[dim] == call.tensors[0].shape[dim]


def _exchange_layouts(layout: Layout, dim: int, pieces: int, size: int):
    """For `pieces` equal pieces of `size` along `dim` of a value in `layout`, split over some
    axes along `dim` (and nothing Partial): the layouts of the value viewed as (pieces, size) at
    `dim`, split along the pieces (as the whole value is) and along each piece, between which
    one all-to-all per axis moves; None where the split does not divide both."""
    axes = layout.shard_axes(dim)
    factor = layout.shard_factor(dim)
    if not axes or pieces % factor or size % factor or any(isinstance(p, Partial) for p in layout.placements):
        return None

    def viewed(at: int) -> Layout:
        placements = [Shard(at) if a in axes else Shard(p.dim + (p.dim > dim)) if isinstance(p, Shard) else p
                      for a, p in enumerate(layout.placements)]
        return Layout(layout.mesh, tuple(placements), layout.order)

    return viewed(dim), viewed(dim + 1)


def _equal_pieces(sizes: list[int]):
    """(how many, size) where every piece has the same size, else None."""
    return (len(sizes), sizes[0]) if sizes and len(set(sizes)) == 1 and len(sizes) > 1 else None


@attrs.frozen(kw_only=True)
class Split(Slice):
    """split / split_with_sizes along `dim_arg`. Besides the dim whole, a dim split over some
    axes into equal pieces (`x.chunk(k)` of a data-parallel batch for gradient accumulation; a
    fused gate/up projection's `chunk(2, dim=-1)` split over tp): each piece stays split as the
    input was, the rank's block of every piece brought to it by one all-to-all of its block
    (the value viewed as (pieces, piece size) moved from split along the pieces to split along
    each): the strategy's `inner_moves`, priced with the rest. Where it needs one, a split dim
    gathered whole costs (axes - 1) times the block, and every piece's work is then replicated."""

    def _exchange(self, call: OpCall):
        x = call.tensors[0]
        dim = call.arg(self.dim_arg, "dim", 0) % x.ndim
        pieces = _equal_pieces([o.shape[dim] for o in call.outputs])
        moves = pieces and _exchange_layouts(x.layout, dim, *pieces)
        return (dim, pieces, moves) if moves else None

    def strategies(self, call: OpCall) -> list[Strategy]:
        out = super().strategies(call)
        if self._exchange(call) is None:
            return out
        x = call.tensors[0].layout
        return [Strategy((x,), (x,) * len(call.outputs), note="exchange"), *out]

    def inner_moves(self, call: OpCall, strategy: Strategy) -> list:
        """The all-to-all: (from, to, global shape of the viewed value, dtype)."""
        if strategy.note != "exchange":
            return []
        dim, (pieces, size), (src, dst) = self._exchange(call)
        x = call.tensors[0]
        return [(src, dst, (*x.shape[:dim], pieces, size, *x.shape[dim + 1:]), x.dtype)]

    def emit(self, ctx, call: OpCall, strategy: Strategy, args: tuple, kwargs: dict):
        x = call.tensors[0]
        dim = call.arg(self.dim_arg, "dim", 0) % x.ndim
        if strategy.note != "exchange" and self._one_piece(call, dim):  # (the one piece is the block: its size)
            size = strategy.inputs[0].local_shape(tuple(x.shape))[dim]
            return ctx.call(aten.split_with_sizes.default, (args[0], [size], dim))
        if strategy.note != "exchange":
            return super().emit(ctx, call, strategy, args, kwargs)
        dim = self._exchange(call)[0]
        (src, dst, shape, dtype), = self.inner_moves(call, strategy)
        viewed = ctx.call(aten.reshape.default, (args[0], list(src.local_shape(shape))))
        ctx.annotate(viewed, src, shape, dtype)
        ctx.consumer = (*ctx.consumer[:2], f"{call.op} of split dim {dim} into equal pieces: each kept split")
        moved = ctx.redistribute(viewed, src, dst, shape, dtype)
        return ctx.call(aten.unbind.int, (moved, dim))


@attrs.frozen(kw_only=True)
class Cat(Rule):
    """cat(tensors, dim): inputs agree on every placement; the cat dim must be whole, unless one
    input holds every element (the cat is its copy).

    A 1-D empty input (torch.cat skips these "legacy" empties whatever the other inputs' rank,
    as a KV cache starts out) holds no element: it is taken replicated under any strategy."""

    dim_arg: int = 1

    def strategies(self, call: OpCall) -> list[Strategy]:
        tensors, out = call.tensors, call.outputs[0]
        dim = call.arg(self.dim_arg, "dim", 0) % out.ndim
        # one input holds every element (the others are empty: einops.pack of one tensor, a cache
        # that starts out empty): the cat is a copy of it, split along the cat dim too
        alone = sum(not (_legacy_empty(t, out) or t.ndim == out.ndim and t.shape[dim] == 0) for t in tensors) == 1
        per_axis = []
        for a in range(call.mesh.ndim):
            options = [replicated_option(call)]
            for t in tensors:
                p = t.layout.placements[a]
                if (isinstance(p, Shard) and (p.dim != dim or alone and t.shape[dim] != 0) and t.ndim == out.ndim) \
                        or isinstance(p, Partial):
                    options.insert(0, (tuple(R if _legacy_empty(u, out) else p for u in tensors), (p,)))
            per_axis.append(options)
        return combine_axes(call, per_axis)


_PICKS = (aten.select.int, aten.slice.Tensor, aten.narrow.default)


def _tiling(rows: range, size: int, factor: int) -> bool:
    """Whether `rows` are `start::step` of a dim of `size` split into `factor` blocks that the
    step tiles: each block holds its share of them at the same local offsets."""
    return rows.step > 1 and len(rows) > 0 and rows.start < rows.step and (size // factor) % rows.step == 0 and \
        rows == range(rows.start, size, rows.step)


def _picked_rows(call: OpCall, size: int) -> range:
    """The global rows along the dim that select, slice or narrow takes."""
    if call.op is aten.select.int:
        i = call.arg(2, "index") % size
        return range(i, i + 1)
    if call.op is aten.narrow.default:
        start = call.arg(2, "start") % size if size else 0
        return range(start, start + call.arg(3, "length"))
    start, end, step = call.arg(2, "start", None), call.arg(3, "end", None), call.arg(4, "step", 1)
    return range(size)[slice(start, end, step)]


def _legacy_empty(t, out) -> bool:
    return t.ndim == 1 and t.shape[0] == 0 and out.ndim != 1


@attrs.frozen(kw_only=True)
class Diagonal(Rule):
    """diagonal(x, offset, dim1, dim2): dim1 and dim2 must be whole; the other dims keep their
    order in front of the diagonal, which becomes the last dim."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        x = call.tensors[0]
        pair = {call.arg(2, default=0) % x.ndim, call.arg(3, default=1) % x.ndim}
        rest = [d for d in range(x.ndim) if d not in pair]
        ins, outs = [], []
        for p in x.layout.placements:
            if isinstance(p, Shard) and p.dim in pair:
                ins.append(R), outs.append(R)
            else:
                ins.append(p), outs.append(Shard(rest.index(p.dim)) if isinstance(p, Shard) else p)
        return _with_fallback(call, ins, outs)


@attrs.frozen(kw_only=True)
class Unfold(Rule):
    """Tensor.unfold(dim, size, step): overlapping windows along `dim`, a view with a new last
    dim. Windows that cross the blocks of a split `dim` need it whole; windows that tile each
    block (step == size, the block a multiple of it: patches) keep it split. Every other dim
    keeps its split, and Partial passes (a view of a sum is the sum of views)."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        x = call.tensors[0]
        dim = call.arg(1, "dimension", 0) % max(x.ndim, 1)
        size, step = call.arg(2, "size"), call.arg(3, "step")
        tiles = x.ndim > 0 and size == step and (x.shape[dim] // x.layout.shard_factor(dim)) % size == 0
        ins, outs = [], []
        for p in x.layout.placements:
            keep = isinstance(p, Partial) or isinstance(p, Shard) and (p.dim != dim or tiles)
            ins.append(p if keep else R), outs.append(p if keep else R)
        return _with_fallback(call, ins, outs)


@attrs.frozen(kw_only=True)
class SliceScatter(Rule):
    """slice_scatter / select_scatter(x, src, dim, ...): x with a slice along `dim` replaced by
    src. `dim` must be whole; every other dim of x is split like src's matching dim. The op
    moves data, so x and src may be Partial together: the slice of a sum is the sum of slices.

    `drops_dim`: src lacks `dim` (select_scatter).
    """

    dim_arg: int = 2
    drops_dim: bool = False

    def strategies(self, call: OpCall) -> list[Strategy]:
        x, src = call.tensors[0], call.tensors[1]
        dim = call.arg(self.dim_arg, default=0) % x.ndim
        # src covering the whole dim (a whole slice's backward): the output is src, block for block;
        # or the rows `x[start::step]` whose step tiles each block (`x[::2]`'s backward): each block's own
        copies = not self.drops_dim and src.shape[dim] == x.shape[dim] and call.arg(5, "step", 1) in (1, None)
        tiles = not copies and self._tiles(call, dim)
        whole = copies or tiles
        per_axis = []
        for a in range(call.mesh.ndim):
            p, q = x.layout.placements[a], src.layout.placements[a]
            options = [replicated_option(call)]
            for d in (p.dim if isinstance(p, Shard) else None, self._x_dim(q, dim)):
                if d is not None and (d != dim or whole):
                    options.insert(0, ((Shard(d), Shard(d - (self.drops_dim and d > dim))), (Shard(d),)))
            partial = p if isinstance(p, Partial) else q if isinstance(q, Partial) else None
            if partial is not None:
                options.insert(0, ((partial, partial), (partial,)))
            per_axis.append(options)
        out = combine_axes(call, per_axis)
        if tiles:  # (each layout's own blocks along dim: the step must tile them)
            step = self._rows(call, dim).step
            out = [st for st in out if (factor := st.outputs[0].shard_factor(dim)) == 1  # (whole: any step)
                   or (x.shape[dim] // factor) % step == 0]
        return out

    def _x_dim(self, q, dim: int) -> int | None:
        if not isinstance(q, Shard):
            return None
        return q.dim + (self.drops_dim and q.dim >= dim)

    def _rows(self, call: OpCall, dim: int) -> range:
        x = call.tensors[0]
        start, end, step = call.arg(3, "start", None), call.arg(4, "end", None), call.arg(5, "step", 1)
        return range(x.shape[dim])[slice(start, end, step)]

    def _tiles(self, call: OpCall, dim: int) -> bool:
        """src holds the rows `x[start::step]`, a step that tiles every block of a split dim (see
        `Slice._tiles`), src split along it alike."""
        x, src = call.tensors[0], call.tensors[1]
        factor = max(x.layout.shard_factor(dim), src.layout.shard_factor(dim))
        return call.op is aten.slice_scatter.default and factor > 1 and \
            _tiling(self._rows(call, dim), x.shape[dim], factor)

    def emit(self, ctx, call: OpCall, strategy: Strategy, args: tuple, kwargs: dict):
        x = call.tensors[0]
        dim = call.arg(self.dim_arg, default=0) % x.ndim
        rows = self._rows(call, dim) if call.op is aten.slice_scatter.default else None
        if rows is not None and rows.step > 1 and strategy.inputs[0].shard_axes(dim):  # tiled: each block's rows
            return ctx.call(aten.slice_scatter.default, (args[0], args[1], dim, rows.start, None, rows.step))
        return super().emit(ctx, call, strategy, args, kwargs)


@attrs.frozen(kw_only=True)
class DiagonalScatter(Rule):
    """diagonal_scatter(x, src, offset, dim1, dim2): x with its diagonal over (dim1, dim2)
    replaced by src, the backward of `diagonal`. src is laid out as `diagonal(x)` is: x's other
    dims in order, then the diagonal. dim1 and dim2 (and so src's last dim) must be whole; each
    other dim of x is split like src's matching dim, since element (..., i, j) of the output reads
    only x's or src's element with the same other indices. The op moves data, so x and src may be
    Partial together with any reduce: diagonal_scatter(a1 + a2, s1 + s2) = diagonal_scatter(a1, s1)
    + diagonal_scatter(a2, s2), and likewise elementwise max(a1, a2) for max and min."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        x, src = call.tensors[0], call.tensors[1]
        pair = {call.arg(3, default=0) % x.ndim, call.arg(4, default=1) % x.ndim}
        rest = [d for d in range(x.ndim) if d not in pair]  # src's dims, but its last
        per_axis = []
        for a in range(call.mesh.ndim):
            p, q = x.layout.placements[a], src.layout.placements[a]
            options = [replicated_option(call)]
            seeds = {p.dim if isinstance(p, Shard) else None,
                     rest[q.dim] if isinstance(q, Shard) and q.dim < len(rest) else None}
            for d in sorted(d for d in seeds if d is not None and d not in pair):
                options.insert(0, ((Shard(d), Shard(rest.index(d))), (Shard(d),)))
            partial = p if isinstance(p, Partial) else q if isinstance(q, Partial) else None
            if partial is not None:
                options.insert(0, ((partial, partial), (partial,)))
            per_axis.append(options)
        return combine_axes(call, per_axis)


@attrs.frozen(kw_only=True)
class ComplexView(Rule):
    """view_as_complex (real (..., 2) -> complex (...)) and view_as_real (the inverse): the same
    memory read as complex numbers or as (real, imaginary) pairs; which one is told by the
    input's dtype.

    The real side's trailing dim of size 2 holds each pair, so it must be whole (split, a rank
    would hold real parts without their imaginary parts); every other dim is the same dim on
    both sides and keeps its split. Both views are linear over the reals, componentwise:
    view_as_complex(a1 + a2) = view_as_complex(a1) + view_as_complex(a2), and likewise for
    view_as_real, so Partial(sum) and Partial(avg) pass. Partial(max)/(min) do not: complex
    numbers have no order, so a complex Partial(max) could never be reduced (it is resolved on
    the real side first).
    """

    def strategies(self, call: OpCall) -> list[Strategy]:
        x = call.tensors[0]
        pair = None if x.dtype.is_complex else x.ndim - 1  # view_as_complex consumes x's last dim
        ins, outs = [], []
        for p in x.layout.placements:
            keep = (isinstance(p, Shard) and p.dim != pair) or (isinstance(p, Partial) and p.reduce in ("sum", "avg"))
            ins.append(p if keep else R), outs.append(p if keep else R)
        return _with_fallback(call, ins, outs)


def _replicated(call: OpCall) -> Strategy:
    r = Layout.replicated(call.mesh)
    return Strategy((r,) * len(call.tensors), (r,) * len(call.outputs))


def _with_fallback(call: OpCall, ins: list, outs: list, order: tuple = ()) -> list[Strategy]:
    """The follow strategy of a one-input op (if its shapes divide), then the replicated one;
    `order`: of axes splitting one dim of the input that split one dim of the outputs alike."""
    mesh, x = call.mesh, call.tensors[0]
    rest = tuple(t.layout for t in call.tensors[1:])
    strategy = Strategy((Layout(mesh, ins, order),) + rest, (Layout(mesh, outs, order),) * len(call.outputs))
    ok = strategy.inputs[0].fits(x.shape) and all(
        l.fits(o.shape) for l, o in zip(strategy.outputs, call.outputs, strict=True)
    )
    r = _replicated(call)
    return [strategy, r] if ok and strategy != r else [r]

