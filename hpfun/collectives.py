"""The steps of a redistribution, each defined once: precondition and effect on the layout,
lowering into the per-shard graph, and bytes moved.

Collectives lower to torch's traceable functional collectives (`_c10d_functional`) with the mesh
axis name as group name; runtimes bind axis names to process groups. Local steps (taking a
block of a replicated value, turning a replicated value into a Partial one) need no
communication; they read this rank's mesh coordinates from the graph's `coords` input, so
one program serves every rank.
"""

from __future__ import annotations

import attrs
import torch

from hpfun.errors import ShardingError
from hpfun.layout import Layout, Partial, R, Shard

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _require(ok: bool, step, layout: Layout):
    if not ok:
        raise ShardingError(f"internal: {step} cannot apply to {layout}")


def _is_last_shard_axis(layout: Layout, axis: int, dim: int) -> bool:
    """`axis` is the most minor one splitting `dim` in the layout's order: its blocks are the
    innermost, so gathering them restores the blocks of the axes before it."""
    axes = layout.shard_axes(dim)
    return bool(axes) and axes[-1] == axis


def _split_dim(ctx, x, shape, dim: int, n: int):
    """View `x` with dim `dim` split into (n, size/n) and the n moved to the front, contiguous."""
    shape = list(shape)
    split = shape[:dim] + [n, shape[dim] // n] + shape[dim + 1 :]
    x = ctx.call(aten.view.default, (x, split))
    order = [dim] + [d for d in range(len(split)) if d != dim]
    return ctx.call(aten.clone.default, (ctx.call(aten.permute.default, (x, order)),), {"memory_format": torch.contiguous_format})


def _merge_front(ctx, x, shape, dim: int, n: int):
    """Inverse of a gather along the front: (n, *shape) -> shape with dim `dim` n times larger."""
    shape = list(shape)
    x = ctx.call(aten.view.default, (x, [n] + shape))
    order = list(range(1, dim + 1)) + [0] + list(range(dim + 1, len(shape) + 1))
    x = ctx.call(aten.clone.default, (ctx.call(aten.permute.default, (x, order)),), {"memory_format": torch.contiguous_format})
    return ctx.call(aten.view.default, (x, shape[:dim] + [n * shape[dim]] + shape[dim + 1 :]))


# Low-precision partial sums. A Partial(sum) or Partial(avg) value of bfloat16 or float16 is
# reduced in float32 by default: each rank's partial is cast up, reduced, and the result cast back
# to the compute dtype, as FSDP's `reduce_dtype` does. Summed in the compute dtype, every add of
# the reduction rounds to 8 (bfloat16) or 11 (float16) significant bits; in float32 the sum is
# rounded to the compute dtype once. (Each rank's partial was rounded when it was computed: the
# cast cannot undo that.) The option `reduce_dtype="compute"` reduces in the compute dtype
# instead, half the bytes on the wire. max and min are exact in any dtype: never cast.
# `moved_dtype` decides for the emitted casts, the bytes a collective's record counts and the
# planner's price alike.
REDUCE_DTYPES = ("float32", "compute")
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def moved_dtype(step, dtype: torch.dtype, reduce_dtype: str = "float32") -> torch.dtype:
    """The dtype `step` moves a value of `dtype` in under the `reduce_dtype` option: float32 for
    a sum or average of bfloat16/float16 partials under "float32", else `dtype` itself."""
    widen = reduce_dtype == "float32" and dtype in _LOW_PRECISION
    if widen and isinstance(step, (AllReduce, ReduceScatter)) and step.reduce in ("sum", "avg"):
        return torch.float32
    return dtype


def _cast(ctx, x, dtype: torch.dtype, to: torch.dtype):
    """`x` (of `dtype`, unless lowering kept it in float32: `local_dtype`) as `to`; nothing is
    emitted when it already is."""
    return x if local_dtype(x, dtype) == to else ctx.call(aten.to.dtype, (x, to))


def local_dtype(value, traced: torch.dtype) -> torch.dtype:
    """The dtype a lowered value holds: its traced dtype, or float32 where lowering keeps a
    low-precision partial sum wide (its node's meta "hpfun_local_dtype")."""
    meta = getattr(value, "meta", None)
    return meta.get("hpfun_local_dtype", traced) if meta is not None else traced


@attrs.frozen
class AllReduce:
    """P(reduce) -> R over one or more axes at once (one collective over their combined group)."""

    axes: tuple[int, ...]
    reduce: str
    kind = "all_reduce"
    factor = 2.0  # ring all-reduce moves 2(n-1)/n of the buffer

    def apply(self, layout: Layout) -> Layout:
        for a in self.axes:
            _require(layout.placements[a] == Partial(self.reduce), self, layout)
            layout = layout.with_placement(a, R)
        return layout

    def emit(self, ctx, x, local_shape, n):
        dtype, wide = ctx.reduce_in(self)  # bfloat16/float16 sums: reduced in float32 by default
        out = ctx.collective(self, c10d.all_reduce.default, (_cast(ctx, x, dtype, wide), self.reduce), local_shape)
        return out if ctx.keeps_wide else _cast(ctx, out, wide, dtype)  # (a sum still partial on another axis)


@attrs.frozen
class AllGather:
    """S(dim) -> R over one axis; the axis must be the most minor one splitting `dim`."""

    axis: int
    dim: int
    kind = "all_gather"
    axes = property(lambda self: (self.axis,))
    factor = 1.0

    def apply(self, layout: Layout) -> Layout:
        _require(_is_last_shard_axis(layout, self.axis, self.dim), self, layout)
        return layout.with_placement(self.axis, R)

    def emit(self, ctx, x, local_shape, n):
        if self.dim == 0:
            return ctx.collective(self, c10d.all_gather_into_tensor.default, (x, n), local_shape)
        x = ctx.call(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
        gathered = ctx.collective(self, c10d.all_gather_into_tensor.default, (x, n), local_shape)
        return _merge_front(ctx, gathered, local_shape, self.dim, n)


@attrs.frozen
class ReduceScatter:
    """P(reduce) -> S(dim) over one axis, which becomes the most minor one splitting `dim` (in
    the layout's order, whatever its place in the mesh)."""

    axis: int
    dim: int
    reduce: str
    kind = "reduce_scatter"
    axes = property(lambda self: (self.axis,))
    factor = 1.0

    def apply(self, layout: Layout) -> Layout:
        _require(layout.placements[self.axis] == Partial(self.reduce), self, layout)
        return layout.with_placement(self.axis, Shard(self.dim))  # the most minor on dim

    def emit(self, ctx, x, local_shape, n):
        dtype, wide = ctx.reduce_in(self)  # as AllReduce: cast up before, back after
        x = _cast(ctx, x, dtype, wide)
        front = _split_dim(ctx, x, local_shape, self.dim, n) if self.dim else x
        out = ctx.collective(self, c10d.reduce_scatter_tensor.default, (front, self.reduce, n), local_shape)
        out = out if ctx.keeps_wide else _cast(ctx, out, wide, dtype)
        if not self.dim:
            return out
        shape = list(local_shape)
        shape[self.dim] //= n
        return ctx.call(aten.view.default, (out, shape))


@attrs.frozen
class AllToAll:
    """S(src) -> S(dst) over one axis: most minor on `src` before, most minor on `dst` after."""

    axis: int
    src: int
    dst: int
    kind = "all_to_all"
    axes = property(lambda self: (self.axis,))
    factor = 1.0

    def apply(self, layout: Layout) -> Layout:
        _require(self.src != self.dst and _is_last_shard_axis(layout, self.axis, self.src), self, layout)
        return layout.with_placement(self.axis, Shard(self.dst))  # the most minor on dst

    def emit(self, ctx, x, local_shape, n):
        front = _split_dim(ctx, x, local_shape, self.dst, n)
        flat = ctx.call(aten.view.default, (front, [n, -1]))
        out = ctx.collective(self, c10d.all_to_all_single.default, (flat, [1] * n, [1] * n), local_shape)
        received = list(local_shape)
        received[self.dst] //= n
        return _merge_front(ctx, ctx.call(aten.view.default, (out, [n] + received)), received, self.src, n)


@attrs.frozen
class Chunk:
    """R -> S(dim) over one axis, locally: keep this rank's block (no communication)."""

    axis: int
    dim: int
    kind = "chunk"
    axes = property(lambda self: (self.axis,))
    factor = 0.0

    def apply(self, layout: Layout) -> Layout:
        _require(layout.placements[self.axis] == R, self, layout)
        return layout.with_placement(self.axis, Shard(self.dim))  # the most minor on dim

    def emit(self, ctx, x, local_shape, n):
        shape = list(local_shape)
        split = shape[: self.dim] + [n, shape[self.dim] // n] + shape[self.dim + 1 :]
        x = ctx.call(aten.view.default, (x, split))
        picked = ctx.call(aten.index_select.default, (x, self.dim, ctx.coord_index(self.axis)))
        shape[self.dim] //= n
        return ctx.call(aten.view.default, (picked, shape))


@attrs.frozen
class ToPartial:
    """R -> P(reduce) over one axis, locally: for sum, rank 0 of the axis keeps the value, others 0;
    for avg, max and min every rank keeps it."""

    axis: int
    reduce: str
    kind = "to_partial"
    axes = property(lambda self: (self.axis,))
    factor = 0.0

    def apply(self, layout: Layout) -> Layout:
        _require(layout.placements[self.axis] == R, self, layout)
        return layout.with_placement(self.axis, Partial(self.reduce))

    def emit(self, ctx, x, local_shape, n):
        if self.reduce != "sum":
            return x
        # where, not x * (coord == 0): an inf or nan kept on rank 0 must be exactly 0 elsewhere
        # (inf * 0 is nan)
        keep = ctx.call(aten.eq.Scalar, (ctx.coord(self.axis), 0))
        return ctx.call(aten.where.self, (keep, x, ctx.call(aten.zeros_like.default, (x,))))


@attrs.frozen
class Relabel:
    """Any placement change over an axis of size 1: nothing moves."""

    axis: int
    placement: object
    kind = "relabel"
    axes = property(lambda self: (self.axis,))
    factor = 0.0

    def apply(self, layout: Layout) -> Layout:
        return layout.with_placement(self.axis, self.placement)

    def emit(self, ctx, x, local_shape, n):
        return x


COMMUNICATING = (AllReduce, AllGather, ReduceScatter, AllToAll)
_FACTORS = {step.kind: step.factor for step in COMMUNICATING}


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank moves for a collective handed `nbytes` per rank over `n` ranks (ring
    algorithms: (n-1)/n of the larger buffer, an all-gather's output being n inputs)."""
    if kind not in _FACTORS:
        return 0.0  # local steps
    buffer = nbytes * (n if kind == "all_gather" else 1)
    return _FACTORS[kind] * (n - 1) / n * buffer
