"""Placements, layouts and the `P` spec users write; one compact notation with one parser.

A layout gives one placement per mesh axis: `S(d)` (the tensor's dim d is split over that
axis), `R` (every rank holds the whole), `P(sum)` (every rank holds a term; the value is their
reduction). When several axes shard the same dim, the mesh's axis order decides the split: the
first axis is the major one, as in `P(("dp", "tp"))`.
"""

from __future__ import annotations

import functools
import math
import operator
import re

import attrs

from hpfun.errors import LayoutError, SpecError
from hpfun.mesh import Mesh

REDUCE_OPS = ("sum", "avg", "max", "min")


# ---------------------------------------------------------------------------------------------
# Placements
# ---------------------------------------------------------------------------------------------


def _as_int(value) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise LayoutError(f"Shard(dim) needs an integer dim, got {value!r}") from None


@attrs.frozen
class Shard:
    """The tensor's dim `dim` is split evenly over the mesh axis."""

    dim: int = attrs.field(converter=_as_int)

    def __str__(self) -> str:
        return f"S({self.dim})"


@attrs.frozen
class Replicate:
    """Every rank along the mesh axis holds the whole value."""

    def __str__(self) -> str:
        return "R"


def _check_reduce(_, __, value):
    if value not in REDUCE_OPS:
        raise LayoutError(f"Partial reduce must be one of {REDUCE_OPS}, got {value!r}")


@attrs.frozen
class Partial:
    """Ranks along the mesh axis hold terms; the value is their `reduce` (sum, avg, max, min)."""

    reduce: str = attrs.field(default="sum", validator=_check_reduce)

    def __str__(self) -> str:
        return f"P({self.reduce})"


Placement = Shard | Replicate | Partial
R = Replicate()


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


def _to_placements(value) -> tuple:
    if isinstance(value, (Shard, Replicate, Partial)) or not isinstance(value, (tuple, list)):
        raise LayoutError(f"Layout placements must be a tuple with one placement per mesh axis, got {value!r}")
    return tuple(value)


@attrs.frozen(cache_hash=True)
class Layout:
    """How one tensor is laid out on a mesh: one placement per mesh axis.

    >>> mesh = Mesh.simulated((2, 2), ("dp", "tp"))
    >>> lay = Layout(mesh, (Shard(0), Replicate()))
    >>> str(lay), lay.local_shape((8, 4)), lay.offsets((8, 4), mesh.coords(2))
    ('[S(0), R] on {dp: 2, tp: 2}', (4, 4), (4, 0))
    """

    mesh: Mesh
    placements: tuple = attrs.field(converter=_to_placements)

    def __attrs_post_init__(self):
        if len(self.placements) != self.mesh.ndim:
            raise LayoutError(
                f"a layout on mesh {self.mesh} needs {self.mesh.ndim} placements, got {len(self.placements)}"
            )
        bad = [p for p in self.placements if not isinstance(p, (Shard, Replicate, Partial))]
        if bad:
            raise LayoutError(f"placements must be Shard, Replicate or Partial, got {bad!r}")

    @classmethod
    def replicated(cls, mesh: Mesh) -> "Layout":
        return cls(mesh, (R,) * mesh.ndim)

    # -- queries --------------------------------------------------------------------------------

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes splitting tensor dim `dim`, major first."""
        return tuple(a for a, p in enumerate(self.placements) if p == Shard(dim))

    def shard_factor(self, dim: int) -> int:
        return math.prod(self.mesh.shape[a] for a in self.shard_axes(dim))

    @property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial))

    @property
    def is_replicated(self) -> bool:
        return all(p == R for p in self.placements)

    def sharded_dims(self) -> tuple[int, ...]:
        return tuple(sorted({p.dim for p in self.placements if isinstance(p, Shard)}))

    def with_placement(self, axis: int, placement) -> "Layout":
        placements = list(self.placements)
        placements[axis] = placement
        return attrs.evolve(self, placements=tuple(placements))

    def normalized(self, ndim: int) -> "Layout":
        """Negative shard dims made non-negative for a tensor with `ndim` dims (checked)."""
        out = []
        for p in self.placements:
            if isinstance(p, Shard):
                if not -ndim <= p.dim < ndim:
                    raise LayoutError(f"{p} does not exist on a tensor with {ndim} dims")
                p = Shard(p.dim % ndim)
            out.append(p)
        return attrs.evolve(self, placements=tuple(out))

    # -- shape arithmetic -----------------------------------------------------------------------

    def problems(self, global_shape) -> list[str]:
        """What stops this layout from holding a tensor of `global_shape` (empty if it fits)."""
        out = []
        for p in self.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < len(global_shape):
                out.append(f"{p} does not exist on a tensor of shape {tuple(global_shape)}")
        if out:
            return out
        for d in self.sharded_dims():
            n = self.shard_factor(d)
            if global_shape[d] % n:
                axes = ", ".join(f"{self.mesh.axis_names[a]}={self.mesh.shape[a]}" for a in self.shard_axes(d))
                out.append(f"dim {d} of size {global_shape[d]} is not divisible by the mesh axes sharding it ({axes})")
        return out

    def fits(self, global_shape) -> bool:
        return not self.problems(global_shape)

    def local_shape(self, global_shape) -> tuple[int, ...]:
        """Shape of every rank's shard (all shards have the same shape)."""
        return _local_shape(self, tuple(global_shape))

    def shard_index(self, dim: int, coords) -> int:
        """Which of the `shard_factor(dim)` blocks of dim `dim` the rank at `coords` holds."""
        if len(coords) != self.mesh.ndim or any(not 0 <= c < n for c, n in zip(coords, self.mesh.shape)):
            raise LayoutError(f"coordinates {tuple(coords)} are not on mesh {self.mesh}")
        index = 0
        for a in self.shard_axes(dim):
            index = index * self.mesh.shape[a] + coords[a]
        return index

    def offsets(self, global_shape, coords) -> tuple[int, ...]:
        """Global index of the first element of the shard held by the rank at `coords`."""
        local = self.local_shape(global_shape)
        return tuple(self.shard_index(d, coords) * local[d] for d in range(len(global_shape)))

    def placements_str(self) -> str:
        return "[" + ", ".join(str(p) for p in self.placements) + "]"

    def __str__(self) -> str:
        return f"{self.placements_str()} on {self.mesh}"

    def _repr_html_(self) -> str:
        """Notebooks show which rank holds which block (blocks numbered: a layout has no shape)."""
        from hpfun.visualize import visualize

        return visualize(self)._repr_html_()


@functools.lru_cache(maxsize=65536)
def _local_shape(layout: Layout, global_shape: tuple) -> tuple[int, ...]:
    problems = layout.problems(global_shape)
    if problems:
        raise LayoutError(problems)
    return tuple(s // layout.shard_factor(d) for d, s in enumerate(global_shape))


# ---------------------------------------------------------------------------------------------
# P: the per-tensor-dim spec users write
# ---------------------------------------------------------------------------------------------


def _spec_entry(entry):
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)) and all(isinstance(e, str) for e in entry):
        entry = tuple(entry)
        return entry[0] if len(entry) == 1 else (entry or None)
    raise SpecError(f"a P entry must be None, a mesh axis name or a tuple of names, got {entry!r}")


@attrs.frozen(init=False)
class P:
    """Per tensor dim, the mesh axes that split it: `P("dp", None)`, `P(("dp", "tp"))`, `P()`.

    Dims beyond the entries given are not split. Axes named together on one dim split it in
    mesh-axis order (major first).

    >>> mesh = Mesh.simulated((2, 2), ("dp", "tp"))
    >>> str(P("tp", None).to_layout(mesh, ndim=2))
    '[R, S(0)] on {dp: 2, tp: 2}'
    """

    dims: tuple

    def __init__(self, *dims):
        self.__attrs_init__(tuple(_spec_entry(d) for d in dims))

    def axes(self, dim: int) -> tuple[str, ...]:
        entry = self.dims[dim] if dim < len(self.dims) else None
        return () if entry is None else (entry,) if isinstance(entry, str) else entry

    def problems(self, mesh: Mesh, ndim: int) -> list[str]:
        """Everything wrong with using this spec for a `ndim`-dim tensor on `mesh`."""
        out = []
        if len(self.dims) > ndim:
            out.append(f"{self} has {len(self.dims)} entries but the tensor has only {ndim} dims")
        seen: dict[str, int] = {}
        for d in range(len(self.dims)):
            axes = self.axes(d)
            for axis in axes:
                if axis not in mesh.axis_names:
                    out.append(f"{self} names mesh axis {axis!r}, but the mesh {mesh} has axes {list(mesh.axis_names)}")
                elif axis in seen:
                    out.append(f"{self} uses mesh axis {axis!r} twice (dims {seen[axis]} and {d}); an axis can split one dim only")
                seen.setdefault(axis, d)
            known = [a for a in axes if a in mesh.axis_names]
            if known != sorted(known, key=mesh.axis_names.index):
                order = tuple(sorted(known, key=mesh.axis_names.index))
                out.append(f"{self} splits dim {d} over {tuple(known)}; axes on one dim must follow the mesh order {order}")
        return out

    def to_layout(self, mesh: Mesh, ndim: int) -> Layout:
        """The layout this spec gives a `ndim`-dim tensor on `mesh`."""
        problems = self.problems(mesh, ndim)
        if problems:
            raise SpecError(problems)
        placements = [R] * mesh.ndim
        for d in range(len(self.dims)):
            for axis in self.axes(d):
                placements[mesh.axis_index(axis)] = Shard(d)
        return Layout(mesh, tuple(placements))

    @classmethod
    def from_layout(cls, layout: Layout, ndim: int) -> "P":
        """The spec of a layout without Partial placements."""
        if layout.partial_axes:
            raise LayoutError(f"{layout} has Partial placements, which a P spec cannot express")
        layout = layout.normalized(ndim)
        entries = []
        for d in range(ndim):
            names = tuple(layout.mesh.axis_names[a] for a in layout.shard_axes(d))
            entries.append(names[0] if len(names) == 1 else (names or None))
        while entries and entries[-1] is None:
            entries.pop()
        return cls(*entries)

    def __str__(self) -> str:
        def show(e):
            return "None" if e is None else repr(e) if isinstance(e, str) else "(" + ", ".join(map(repr, e)) + ")"

        return "P(" + ", ".join(show(e) for e in self.dims) + ")"


# ---------------------------------------------------------------------------------------------
# The notation's one parser
# ---------------------------------------------------------------------------------------------

# digit counts are capped so int() never sees a number Python refuses to convert
_PLACEMENT = re.compile(r"\s*(?:S\(\s*(-?\d{1,18})\s*\)|(R)|P\(\s*(\w+)\s*\))\s*$")
_MESH_ENTRY = re.compile(r"\s*(\w+)\s*:\s*(\d{1,18})\s*$")


def _parse_placement(text: str):
    m = _PLACEMENT.match(text)
    if not m:
        raise LayoutError(f"cannot parse placement {text.strip()!r}; write S(0), R or P(sum)")
    dim, rep, reduce = m.groups()
    return Shard(int(dim)) if dim is not None else R if rep else Partial(reduce)


def _parse_mesh(text: str) -> Mesh:
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise LayoutError(f"cannot parse mesh {text.strip()!r}; write {{dp: 2, tp: 2}}")
    names, sizes = [], []
    for part in filter(str.strip, body[1:-1].split(",")):
        m = _MESH_ENTRY.match(part)
        if not m:
            raise LayoutError(f"cannot parse mesh entry {part.strip()!r}; write name: size")
        names.append(m.group(1))
        sizes.append(int(m.group(2)))
    return Mesh.simulated(tuple(sizes), tuple(names))


def parse(text: str):
    """Parse the compact notation: a placement, a placement list, a mesh, or a layout.

    >>> parse("S(1)"), parse("[S(0), R]")
    (Shard(dim=1), (Shard(dim=0), Replicate()))
    >>> str(parse("[S(0), P(sum)] on {dp: 2, tp: 4}"))
    '[S(0), P(sum)] on {dp: 2, tp: 4}'
    """
    text = text.strip()
    if text.startswith("{"):
        return _parse_mesh(text)
    if not text.startswith("["):
        return _parse_placement(text)
    close = text.find("]")
    if close < 0:
        raise LayoutError(f"cannot parse {text!r}: missing ']'")
    inner = text[1:close]
    placements = tuple(_parse_placement(p) for p in inner.split(",")) if inner.strip() else ()
    rest = text[close + 1 :].strip()
    if not rest:
        return placements
    if not rest.startswith("on "):
        raise LayoutError(f"cannot parse {text!r}: expected 'on {{mesh}}' after the placements")
    return Layout(_parse_mesh(rest[3:]), placements)
