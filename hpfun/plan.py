"""Redistribution planning and its cost: the short chain of steps from one layout to another.

Order of a plan, chosen so every step's precondition holds and data is smallest when it moves:
1. axes of size 1 are relabelled to R first and to their target last (nothing moves);
2. Partial axes that must end replicated (or differently Partial) are all-reduced first, while
   the tensor is still split;
3. per tensor dim, the axes splitting it beyond the prefix it shares with the target are undone,
   most minor first: all-to-all when the axis moves to another dim that accepts it, else all-gather;
4. per axis, in mesh order but after the axes before it in its dim's target order, the target
   placement is reached: take a block locally (R -> S), reduce-scatter (P -> S), or turn
   replicated into Partial locally (R -> P).

A dim's order (which of its axes is major: the layout's `order`, by default the mesh's) is part
of "the prefix it shares": a change of order alone gathers the axes from the first that differs
and splits again in the target's order.
"""

from __future__ import annotations

import math
from functools import lru_cache

import attrs
import torch

from hpfun.collectives import (
    COMMUNICATING, AllGather, AllReduce, AllToAll, Chunk, ReduceScatter, Relabel, ToPartial, moved_dtype, wire_bytes,
)
from hpfun.errors import ShardingError
from hpfun.layout import Layout, Partial, R, Shard


def _frozen_axes(per_axis) -> tuple:
    try:
        pairs = tuple(sorted((str(k), (float(v[0]), float(v[1]))) for k, v in dict(per_axis).items()))
    except (TypeError, ValueError, IndexError, KeyError):
        raise ValueError(f"CostModel per_axis must map axis names to (alpha, beta) pairs, got {per_axis!r}") from None
    for name, (alpha, beta) in pairs:
        _check_link(f"per_axis[{name!r}]", alpha, beta)
    return pairs


def _check_link(where: str, alpha: float, beta: float) -> None:
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, beta)) or \
            not (alpha >= 0 and beta > 0):  # also refuses nan
        raise ValueError(f"CostModel {where}: alpha must be >= 0 seconds and beta > 0 bytes per second, "
                         f"got alpha={alpha!r}, beta={beta!r}")


@attrs.frozen(cache_hash=True)
class CostModel:
    """The price of a plan in seconds: per collective alpha + wire bytes / beta (the slowest
    alpha and beta among its mesh axes, `per_axis` overriding them by axis name), and per unit
    of local work (a multiply-add, or an element touched) 1 / `flops`.

    One model prices both what propagation chooses and what `Lowered.cost()` reports."""

    alpha: float = 5e-6
    beta: float = 10e9
    flops: float = 10e9  # local work per second per rank: by default one unit of work costs a byte
    # axis name -> (alpha, beta), given as a dict; kept as sorted pairs so models compare by value
    per_axis: tuple = attrs.field(factory=tuple, converter=_frozen_axes)

    def __attrs_post_init__(self):
        _check_link("link", self.alpha, self.beta)
        if not isinstance(self.flops, (int, float)) or isinstance(self.flops, bool) or not self.flops > 0:
            raise ValueError(f"CostModel flops must be > 0 (local work per second per rank), got {self.flops!r}")

    def unknown_axes(self, mesh) -> list[str]:
        """The `per_axis` names `mesh` has no axis of (a typo: its link would silently not apply)."""
        return [name for name, _ in self.per_axis if name not in mesh.axis_names]

    def link(self, axis_names) -> tuple[float, float]:
        """(alpha, beta) of a collective over these mesh axes: the slowest of each."""
        overrides = dict(self.per_axis)
        params = [overrides.get(a, (self.alpha, self.beta)) for a in axis_names]
        return max(p[0] for p in params), min(p[1] for p in params)

    def collective(self, kind: str, axis_names, wire: float) -> float:
        """Seconds of one collective moving `wire` bytes per rank (0 for a local step)."""
        if kind not in COMMUNICATING_KINDS:
            return 0.0
        alpha, beta = self.link(axis_names)
        return alpha + wire / beta

    def work(self, units: float) -> float:
        return units / self.flops


def redistribute_plan(src: Layout, dst: Layout, shape) -> tuple:
    """Steps turning `src` into `dst` for a tensor of global `shape` (verified to arrive)."""
    return _plan(src, dst, tuple(shape))


@lru_cache(maxsize=65536)
def _plan(src: Layout, dst: Layout, shape: tuple) -> tuple:
    if src.mesh != dst.mesh:
        raise ShardingError(f"cannot redistribute between meshes {src.mesh} and {dst.mesh}")
    steps, cur = [], src
    for step in _steps(src, dst, shape):
        cur = step.apply(cur)
        steps.append(step)
    if cur != dst:
        raise ShardingError(f"internal: plan {src} -> {dst} arrived at {cur}")
    return tuple(steps)


def _steps(src: Layout, dst: Layout, shape):
    cur, mesh = src, src.mesh
    if src == dst:
        return
    unit = [a for a, size in enumerate(mesh.shape) if size == 1]
    for a in unit:  # 1. size-1 axes hold everything whatever they say: set aside as R, restored last
        if cur.placements[a] != R:
            step = Relabel(a, R)
            cur = step.apply(cur)
            yield step
    target = dst
    for a in unit:
        target = target.with_placement(a, R)
    for step in _steps_between(cur, target, shape):
        cur = step.apply(cur)
        yield step
    for a in unit:
        if dst.placements[a] != R:
            yield Relabel(a, dst.placements[a])


def _steps_between(cur: Layout, dst: Layout, shape):
    pending: dict[str, list[int]] = {}  # 2. all-reduce what must not stay Partial, axes of one op together
    for a, p in enumerate(cur.placements):
        q = dst.placements[a]
        if isinstance(p, Partial) and p != q and not (isinstance(q, Shard) and _can_reduce_scatter(cur, dst, a, q.dim)):
            pending.setdefault(p.reduce, []).append(a)
    for reduce, axes in pending.items():
        step = AllReduce(tuple(axes), reduce)
        cur = step.apply(cur)
        yield step
    for step in _undo_shards(cur, dst, len(shape)):  # 3. undo splits the target does not share
        cur = step.apply(cur)
        yield step
    for a in _reach_order(dst):  # 4. reach the target, major axis first
        p, q = cur.placements[a], dst.placements[a]
        if p == q:
            continue
        if isinstance(q, Shard):
            step = ReduceScatter(a, q.dim, p.reduce) if isinstance(p, Partial) else Chunk(a, q.dim)
        else:
            step = ToPartial(a, q.reduce)
        cur = step.apply(cur)
        yield step


def _kept_prefix(cur: Layout, dst: Layout, dim: int) -> tuple[int, ...]:
    """The leading axes splitting `dim` in both layouts (they can stay)."""
    out = []
    for a, b in zip(cur.shard_axes(dim), dst.shard_axes(dim)):
        if a != b:
            break
        out.append(a)
    return tuple(out)


def _reach_order(dst: Layout) -> list[int]:
    """Mesh axes in the order step 4 reaches them: mesh order, except that an axis splitting a
    dim comes after the axes before it in that dim's order (a new split is the most minor)."""
    out: list[int] = []
    for a, q in enumerate(dst.placements):
        axes = dst.shard_axes(q.dim) if isinstance(q, Shard) else (a,)
        out += [b for b in axes[: axes.index(a) + 1] if b not in out]
    return out


def _can_reduce_scatter(cur: Layout, dst: Layout, axis: int, dim: int) -> bool:
    """P -> S(dim) on `axis` in step 4 works if the axes before it on `dim` are already there,
    or are replicated or Partial now and so split `dim` earlier in step 4 (P, P -> S(0), S(0),
    a parameter's gradient split over both axes of a mesh: a reduce-scatter over each, not an
    all-reduce over the minor one); and, as mesh-ordered plans always had it, no later axis of the
    mesh splits `dim` besides."""
    want = dst.shard_axes(dim)
    before = want[: want.index(axis)]
    kept = _kept_prefix(cur, dst, dim)
    ready = before[: len(kept)] == kept and not any(isinstance(cur.placements[b], Shard) for b in before[len(kept):])
    return ready and all(a in before or a < axis for a in cur.shard_axes(dim))


def _undo_shards(cur: Layout, dst: Layout, ndim: int):
    for dim in range(ndim):
        keep = _kept_prefix(cur, dst, dim)
        for a in reversed(cur.shard_axes(dim)[len(keep) :]):
            q = dst.placements[a]
            if isinstance(q, Shard) and q.dim != dim and _accepts(cur, dst, a, q.dim):
                step = AllToAll(a, dim, q.dim)
            else:
                step = AllGather(a, dim)
            cur = step.apply(cur)
            yield step


def _accepts(cur: Layout, dst: Layout, axis: int, dim: int) -> bool:
    """Can `axis` start splitting `dim` now (as its most minor axis), consistent with the
    target's order on `dim`?"""
    have = cur.shard_axes(dim)
    return dst.shard_axes(dim)[: len(have) + 1] == have + (axis,)


# ---------------------------------------------------------------------------------------------
# Cost
# ---------------------------------------------------------------------------------------------

COMMUNICATING_KINDS = frozenset(step.kind for step in COMMUNICATING)


def group_size(mesh, step) -> int:
    return math.prod(mesh.shape[a] for a in step.axes)


def step_bytes(step, layout_before: Layout, shape, dtype: torch.dtype, reduce_dtype: str = "float32") -> int:
    """Bytes of the local buffer handed to a step (per rank), in the dtype the step moves: a
    bfloat16 sum reduced in float32 (`reduce_dtype="float32"`, the default) hands twice the bytes."""
    return math.prod(layout_before.local_shape(shape)) * moved_dtype(step, dtype, reduce_dtype).itemsize


def redistribute_cost(src: Layout, dst: Layout, shape, dtype: torch.dtype,
                      reduce_dtype: str = "float32") -> tuple[float, int]:
    """(wire bytes per rank, number of steps) of the plan from `src` to `dst`, reductions of
    low-precision sums priced in the dtype the `reduce_dtype` option reduces them in."""
    if src == dst:
        return 0.0, 0
    return _cost(src, dst, tuple(shape), dtype, reduce_dtype)


@lru_cache(maxsize=65536)
def _cost(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype, reduce_dtype: str) -> tuple[float, int]:
    wire, cur = 0.0, src
    steps = redistribute_plan(src, dst, shape)
    for step in steps:
        n = group_size(src.mesh, step)
        wire += wire_bytes(step.kind, step_bytes(step, cur, shape, dtype, reduce_dtype), n)
        cur = step.apply(cur)
    return wire, len(steps)


def redistribute_seconds(src: Layout, dst: Layout, shape, dtype: torch.dtype, model: CostModel,
                         reduce_dtype: str = "float32") -> tuple[float, int]:
    """(seconds under `model`, number of steps) of the plan from `src` to `dst`."""
    if src == dst:
        return 0.0, 0
    return _seconds(src, dst, tuple(shape), dtype, reduce_dtype, model)


@lru_cache(maxsize=65536)
def _seconds(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype, reduce_dtype: str,
             model: CostModel) -> tuple[float, int]:
    total, cur = 0.0, src
    steps = redistribute_plan(src, dst, shape)
    names = src.mesh.axis_names
    for step in steps:
        n = group_size(src.mesh, step)
        wire = wire_bytes(step.kind, step_bytes(step, cur, shape, dtype, reduce_dtype), n)
        total += model.collective(step.kind, [names[a] for a in step.axes], wire)
        cur = step.apply(cur)
    return total, len(steps)
