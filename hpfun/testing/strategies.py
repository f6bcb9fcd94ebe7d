"""Hypothesis strategies for meshes, layouts, divisible shapes and sharded values.

Import them from `hpfun.testing`. Every strategy shrinks toward the simplest case: the
smallest mesh, replicated placements, the smallest multiples.
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from hpfun.layout import REDUCE_OPS, Layout, Partial, R, Shard
from hpfun.mesh import Mesh
from hpfun.sharded import Sharded

AXIS_NAMES = ("dp", "tp", "pp", "ep")

# Partial terms live on this grid (multiples of 2**-8, |x| <= 2**12), so any sum of up to 8 of
# them is exact in float32 and float64 whatever the order: a discontinuous op (eq, floor...)
# then sees the same input in the unsharded run and after an all-reduce.
_GRID = 2.0**8
_LIMIT = 2.0**12


@st.composite
def meshes(draw, max_ranks: int = 8, ndims=(1, 2), sizes=(1, 2, 3, 4, 8), names=None) -> Mesh:
    """A simulated mesh: its number of axes drawn from `ndims`, sizes from `sizes`, at most
    `max_ranks` ranks. `names` is a strategy for axis names; default `dp, tp, pp, ep`.

    >>> from hypothesis import given
    >>> @given(meshes(max_ranks=4))
    ... def check(mesh):
    ...     assert mesh.size <= 4 and mesh.ndim in (1, 2)
    >>> check()
    """
    ndim = draw(st.sampled_from(ndims))
    shape = []
    for _ in range(ndim):
        budget = max_ranks // math.prod(shape)
        shape.append(draw(st.sampled_from([n for n in sizes if n <= budget] or [1])))
    chosen = AXIS_NAMES[:ndim] if names is None else draw(st.lists(names, min_size=ndim, max_size=ndim, unique=True))
    return Mesh.simulated(tuple(shape), tuple(chosen))


def _reduces(allow_partial) -> tuple[str, ...]:
    if allow_partial is True:
        return REDUCE_OPS
    return tuple(allow_partial or ())


@st.composite
def layouts(draw, mesh: Mesh, shape, *, allow_partial=False) -> Layout:
    """A layout on `mesh` for a tensor of `shape` (a global shape: only layouts that divide it;
    or a number of dims: any layout, pair it with `divisible_shapes`). Several mesh axes may
    split one dim, in any order (shrinking toward mesh order). `allow_partial`: False, True
    (any reduce) or a tuple of reduces; a layout's Partial axes share one reduce, so the value
    can be gathered.

    >>> from hypothesis import given
    >>> mesh = Mesh.simulated((2, 2), AXIS_NAMES[:2])
    >>> @given(layouts(mesh, (4, 6), allow_partial=("sum",)))
    ... def check(layout):
    ...     assert layout.fits((4, 6))
    >>> check()
    """
    ndim = shape if isinstance(shape, int) else len(shape)

    def fits(placements) -> bool:
        return isinstance(shape, int) or Layout(mesh, placements).fits(shape)

    reduces = _reduces(allow_partial)
    extra = [Partial(draw(st.sampled_from(reduces)))] if reduces else []
    chosen: list = []
    for a in range(mesh.ndim):
        rest = (R,) * (mesh.ndim - a - 1)
        splits = [Shard(d) for d in range(ndim) if fits((*chosen, Shard(d), *rest))]
        chosen.append(draw(st.sampled_from([R, *extra, *splits])))
    stacked = _stack_shards(chosen)
    if stacked != chosen and fits(tuple(stacked)) and draw(st.booleans()):
        chosen = stacked
    return draw(axis_orders(Layout(mesh, tuple(chosen))))


@st.composite
def axis_orders(draw, layout: Layout) -> Layout:
    """`layout` with each dim split over several mesh axes split in a drawn order (major
    first; shrinks toward mesh order).

    >>> from hypothesis import given
    >>> layout = Layout(Mesh.simulated((2, 2), AXIS_NAMES[:2]), (Shard(0), Shard(0)))
    >>> @given(axis_orders(layout))
    ... def check(ordered):
    ...     assert ordered.placements == layout.placements and set(ordered.shard_axes(0)) == {0, 1}
    >>> check()
    """
    for dim in layout.sharded_dims():
        axes = layout.shard_axes(dim)
        if len(axes) > 1:
            layout = layout.with_order(dim, draw(st.permutations(axes)))
    return layout


def _stack_shards(placements: list) -> list:
    """Every Shard moved to the first Shard's dim (several axes on one dim)."""
    dims = [p.dim for p in placements if isinstance(p, Shard)]
    return [Shard(dims[0]) if isinstance(p, Shard) else p for p in placements] if dims else placements


@st.composite
def divisible_shapes(draw, layout: Layout, ndim: int, max_multiple: int = 3) -> tuple[int, ...]:
    """A global shape of `ndim` dims that `layout` divides: each dim a multiple (1 to
    `max_multiple`) of its shard factor.

    >>> from hypothesis import given
    >>> layout = Layout(Mesh.simulated((2, 4), AXIS_NAMES[:2]), (Shard(0), Shard(0)))
    >>> @given(divisible_shapes(layout, 2))
    ... def check(shape):
    ...     assert shape[0] % 8 == 0 and layout.fits(shape)
    >>> check()
    """
    return tuple(layout.shard_factor(d) * draw(st.integers(1, max_multiple)) for d in range(ndim))


def sharded_values(tensor: torch.Tensor, layout: Layout):
    """`tensor` laid out by `layout` as a `Sharded` value. Partial axes hold random terms whose
    reduction is the value (not one rank holding it all), so a rule that wrongly lets Partial
    through a nonlinear op is caught; the value is first rounded onto a coarse grid
    (multiples of 1/256, |x| <= 4096) so the terms reduce exactly in any order.

    >>> from hypothesis import given
    >>> layout = Layout(Mesh.simulated((4,), ("dp",)), (Partial("sum"),))
    >>> @given(sharded_values(torch.arange(6.0), layout))
    ... def check(x):
    ...     assert torch.equal(x.full(), torch.arange(6.0))
    >>> check()
    """
    if not layout.partial_axes:
        return st.just(Sharded.from_global(tensor, layout))
    return st.integers(0, 2**31 - 1).map(lambda seed: _with_partial_terms(tensor, layout, seed))


def _with_partial_terms(tensor: torch.Tensor, layout: Layout, seed: int) -> Sharded:
    mesh, layout = layout.mesh, layout.normalized(tensor.ndim)
    reduces = {layout.placements[a].reduce for a in layout.partial_axes}
    if len(reduces) > 1:
        raise ValueError(f"{layout} mixes Partial reduces {sorted(reduces)}; a value cannot be split into such terms")
    reduce = reduces.pop()
    generator = torch.Generator().manual_seed(seed)
    value = on_grid(tensor)
    local = layout.local_shape(tensor.shape)
    shards: list = [None] * mesh.size
    terms_of: dict[tuple, list] = {}  # Replicate means identical local data: one set of terms per block
    for group in mesh.groups(layout.partial_axes):
        offsets = tuple(layout.offsets(tensor.shape, mesh.coords(group[0])))
        if offsets not in terms_of:
            block = value[tuple(slice(o, o + n) for o, n in zip(offsets, local, strict=True))]
            terms_of[offsets] = _terms(block, reduce, len(group), generator)
        for rank, term in zip(group, terms_of[offsets], strict=True):
            shards[rank] = term.contiguous()
    return Sharded(layout, tuple(tensor.shape), tuple(shards))


def on_grid(tensor: torch.Tensor) -> torch.Tensor:
    """A floating tensor rounded to multiples of 1/256 and clipped to |x| <= 4096 (others as they are)."""
    if not tensor.is_floating_point():
        return tensor
    return ((tensor.double() * _GRID).round().clamp(-_LIMIT * _GRID, _LIMIT * _GRID) / _GRID).to(tensor.dtype)


def _terms(block: torch.Tensor, reduce: str, n: int, generator: torch.Generator) -> list[torch.Tensor]:
    """`n` random terms on the grid whose `reduce` is `block`, in a random order."""
    noise = on_grid(torch.randn((n - 1, *block.shape), generator=generator, dtype=torch.float64) * 4).to(block.dtype)
    if reduce in ("sum", "avg"):
        total = block * n if reduce == "avg" else block
        terms = [total - noise.sum(0), *noise]
    else:
        sign = -1 if reduce == "max" else 1  # the others lie below the max (above the min)
        terms = [block, *(block + sign * noise.abs())]
    order = torch.randperm(n, generator=generator).tolist()
    return [terms[i] for i in order]
