"""Placements, layouts and the `P` spec users write; one compact notation with one parser.

A layout gives one placement per mesh axis: `S(d)` (the tensor's dim d is split over that
axis), `R` (every rank holds the whole), `P(sum)` (every rank holds a term; the value is their
reduction). When several axes shard the same dim, an order says which is major: by default
the mesh's (`P(("dp", "tp"))` on a `{dp, tp}` mesh), else the one given (`P(("tp", "dp"))`:
tp major), which the notation writes as each axis's position in it, `[S(0)[1], S(0)[0]]`.
"""

from __future__ import annotations

import functools
import math
import operator
import re

import attrs

from hpfun.drawing import Visualization
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


def _to_order(value) -> tuple:
    if isinstance(value, dict) or not isinstance(value, (tuple, list)) or not all(
            isinstance(g, (tuple, list)) for g in value):
        raise LayoutError(f"a Layout's order is a tuple of tuples of mesh axes (one per dim, major first), got {value!r}")
    return tuple(tuple(g) for g in value)


def _canonical(mesh: Mesh, axes: tuple[int, ...]) -> tuple[int, ...]:
    """`axes` (major first) with the axes of size 1 merged in by mesh order: where they stand
    moves no block, so orders that differ only there are one order (and a mesh-ordered one stays so)."""
    big = [a for a in axes if mesh.shape[a] > 1]
    unit = sorted(a for a in axes if mesh.shape[a] == 1)
    out = []
    while big or unit:
        out.append(unit.pop(0) if unit and (not big or unit[0] < big[0]) else big.pop(0))
    return tuple(out)


def _normal_order(mesh: Mesh, placements: tuple, order: tuple) -> tuple:
    """`order` checked against the placements, as axis indices in canonical form, without the
    dims that follow mesh order, sorted: layouts that split alike compare equal."""
    groups, seen, problems = [], set(), []
    for group in order:
        axes = tuple(mesh.axis_index(a) for a in group)
        names = tuple(mesh.axis_names[a] for a in axes)
        split = {placements[a] for a in axes}
        dim = next(iter(split)) if len(split) == 1 else None
        if len(set(axes)) != len(axes) or seen & set(axes):
            problems.append(f"order {names} names a mesh axis twice")
        elif not isinstance(dim, Shard):
            problems.append(f"order {names} must list mesh axes that split one dim, but they hold {[str(p) for p in split]}")
        elif {a for a, p in enumerate(placements) if p == dim} != set(axes):
            every = tuple(mesh.axis_names[a] for a, p in enumerate(placements) if p == dim)
            problems.append(f"order {names} must list every mesh axis splitting dim {dim.dim}: {every}")
        seen |= set(axes)
        canonical = _canonical(mesh, axes)
        if list(canonical) != sorted(canonical):
            groups.append(canonical)
    if problems:
        raise LayoutError(problems)
    return tuple(sorted(groups))


def _placement_key(p) -> tuple:
    return ("S", p.dim) if isinstance(p, Shard) else ("P", p.reduce) if isinstance(p, Partial) else ("R",)


@attrs.frozen(eq=False)
class Layout:
    """How one tensor is laid out on a mesh: one placement per mesh axis, and for a dim split
    over several axes, which of them is major.

    `order` lists, for a dim split over several mesh axes in another order than the mesh's,
    those axes major first (indices or names); dims it does not list follow mesh order. It is
    kept normalized (axis indices; dims in mesh order left out; axes of size 1, which move no
    block, put where mesh order puts them), so a layout in mesh order has `order == ()` and
    equals `Layout(mesh, placements)`.

    >>> mesh = Mesh.simulated((2, 2), ("dp", "tp"))
    >>> lay = Layout(mesh, (Shard(0), Replicate()))
    >>> str(lay), lay.local_shape((8, 4)), lay.offsets((8, 4), mesh.coords(2))
    ('[S(0), R] on {dp: 2, tp: 2}', (4, 4), (4, 0))
    >>> tp_major = Layout(mesh, (Shard(0), Shard(0)), order=[("tp", "dp")])
    >>> str(tp_major), tp_major.shard_axes(0), tp_major.offsets((8,), (1, 0))
    ('[S(0)[1], S(0)[0]] on {dp: 2, tp: 2}', (1, 0), (2,))
    """

    mesh: Mesh
    placements: tuple = attrs.field(converter=_to_placements)
    order: tuple = attrs.field(default=(), converter=_to_order)
    # derived once (planning asks for them millions of times): the Partial axes, and what equality
    # and hashing compare, in plain tuples
    _partial: tuple = attrs.field(init=False, repr=False)
    _key: tuple = attrs.field(init=False, repr=False)
    _hash: int = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self):
        object.__setattr__(self, "_partial", tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial)))
        if not isinstance(self.mesh, Mesh):
            raise LayoutError(f"a Layout's first argument is an hpfun.Mesh, got {type(self.mesh).__name__} "
                              f"{self.mesh!r} (make one with hpfun.Mesh.simulated(shape, names))")
        if len(self.placements) != self.mesh.ndim:
            raise LayoutError(
                f"a layout on mesh {self.mesh} needs {self.mesh.ndim} placements, got {len(self.placements)}"
            )
        bad = [p for p in self.placements if not isinstance(p, (Shard, Replicate, Partial))]
        if bad:
            raise LayoutError(f"placements must be Shard, Replicate or Partial, got {bad!r}")
        if self.order:  # frozen: the normal form is set once, here
            object.__setattr__(self, "order", _normal_order(self.mesh, self.placements, self.order))
        mesh = self.mesh
        key = ((mesh.shape, mesh.axis_names, mesh.runtime), tuple(map(_placement_key, self.placements)), self.order)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if other.__class__ is not Layout:
            return NotImplemented
        return self._hash == other._hash and self._key == other._key

    def __ne__(self, other) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def replicated(cls, mesh: Mesh) -> "Layout":
        return cls(mesh, (R,) * mesh.ndim)

    # -- queries --------------------------------------------------------------------------------

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes splitting tensor dim `dim`, major first (in mesh order unless `order` says otherwise)."""
        axes = tuple(a for a, p in enumerate(self.placements) if p.__class__ is Shard and p.dim == dim)
        if len(axes) > 1:
            for group in self.order:
                if group[0] in axes:
                    return group
        return axes

    def shard_factor(self, dim: int) -> int:
        return math.prod(self.mesh.shape[a] for a in self.shard_axes(dim))

    @property
    def partial_axes(self) -> tuple[int, ...]:
        return self._partial

    @property
    def replicated_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Replicate))

    @property
    def is_replicated(self) -> bool:
        return all(p == R for p in self.placements)

    def sharded_dims(self) -> tuple[int, ...]:
        return tuple(sorted({p.dim for p in self.placements if isinstance(p, Shard)}))

    def with_placement(self, axis: int, placement) -> "Layout":
        """This layout with `placement` on mesh axis `axis`. An axis that starts splitting a dim
        becomes its most minor one (as taking a block of each local block does); the other axes
        keep their order."""
        if self.placements[axis] == placement:
            return self
        placements = list(self.placements)
        placements[axis] = placement
        order = [tuple(a for a in group if a != axis) for group in self.order]
        if isinstance(placement, Shard):
            joined = self.shard_axes(placement.dim) + (axis,)
            order = [group for group in order if not set(group) & set(joined)] + [joined]
        return Layout(self.mesh, tuple(placements), tuple(g for g in order if len(g) > 1))

    def with_order(self, dim: int, axes) -> "Layout":
        """This layout with dim `dim` split over `axes` (indices or names, major first): the
        mesh axes that split it, in any order."""
        current = set(self.shard_axes(dim))
        kept = tuple(group for group in self.order if group[0] not in current)
        return attrs.evolve(self, order=kept + (tuple(axes),))

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
        """Whether `problems` finds none (without writing them: rules ask this per strategy)."""
        return _fits(self, tuple(global_shape))

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
        """The placements in the compact notation; an axis of a dim split in another order than
        the mesh's carries its position in that order, major first: `[S(0)[1], S(0)[0]]`."""
        return _placements_str(self)  # (a report of a deep program asks it for every node)

    def __str__(self) -> str:
        return f"{self.placements_str()} on {self.mesh}"

    def _repr_html_(self) -> str:
        """Notebooks show which rank holds which block (blocks numbered: a layout has no shape)."""
        return Visualization(self, None)._repr_html_()


@functools.lru_cache(maxsize=4096)
def _placements_str(layout: Layout) -> str:
    position = {a: i for group in layout.order for i, a in enumerate(group)}
    return "[" + ", ".join(f"{p}[{position[a]}]" if a in position else str(p)
                           for a, p in enumerate(layout.placements)) + "]"


@functools.lru_cache(maxsize=65536)
def _fits(layout: Layout, global_shape: tuple) -> bool:
    ndim = len(global_shape)
    for p in layout.placements:
        if isinstance(p, Shard) and not 0 <= p.dim < ndim:
            return False
    return all(global_shape[d] % layout.shard_factor(d) == 0 for d in layout.sharded_dims())


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
    the order named, major first (as in JAX): `P(("tp", "dp"))` numbers the blocks
    `tp * n_dp + dp`. (Axes of size 1 split nothing: their place in that order is not kept.)

    >>> mesh = Mesh.simulated((2, 2), ("dp", "tp"))
    >>> str(P("tp", None).to_layout(mesh, ndim=2))
    '[R, S(0)] on {dp: 2, tp: 2}'
    >>> str(P(None, ("tp", "dp")).to_layout(mesh, ndim=2))
    '[S(1)[1], S(1)[0]] on {dp: 2, tp: 2}'
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
        return out

    def to_layout(self, mesh: Mesh, ndim: int) -> Layout:
        """The layout this spec gives a `ndim`-dim tensor on `mesh`."""
        if not isinstance(mesh, Mesh) or not isinstance(ndim, int) or isinstance(ndim, bool):
            raise SpecError(f"to_layout(mesh, ndim) takes an hpfun.Mesh and the tensor's number of dims, got "
                            f"{type(mesh).__name__} and {type(ndim).__name__}")
        problems = self.problems(mesh, ndim)
        if problems:
            raise SpecError(problems)
        placements, order = [R] * mesh.ndim, []
        for d in range(len(self.dims)):
            for axis in self.axes(d):
                placements[mesh.axis_index(axis)] = Shard(d)
            order.append(self.axes(d))
        return Layout(mesh, tuple(placements), tuple(o for o in order if len(o) > 1))

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
_PLACEMENT = re.compile(r"\s*(?:S\(\s*(-?\d{1,18})\s*\)(?:\s*\[\s*(\d{1,3})\s*\])?|(R)|P\(\s*(\w+)\s*\))\s*$")
_MESH_ENTRY = re.compile(r"\s*(\w+)\s*:\s*(\d{1,18})\s*$")


def _parse_placement(text: str) -> tuple:
    """(placement, its position in its dim's order or None) from `S(0)`, `S(0)[1]`, `R`, `P(sum)`."""
    m = _PLACEMENT.match(text)
    if not m:
        raise LayoutError(f"cannot parse placement {text.strip()!r}; write S(0), R or P(sum) (S(0)[1]: position in the dim's order)")
    dim, position, rep, reduce = m.groups()
    placement = Shard(int(dim)) if dim is not None else R if rep else Partial(reduce)
    return placement, None if position is None else int(position)


def _parse_order(placements: tuple, positions: tuple, text: str) -> tuple:
    """Per dim whose axes carry positions, its axes major first (checked: 0, 1, ... once each)."""
    order = []
    for split in dict.fromkeys(p for p in placements if isinstance(p, Shard)):
        axes = [a for a, p in enumerate(placements) if p == split]
        given = [positions[a] for a in axes]
        if all(g is None for g in given):
            continue
        if sorted(g for g in given if g is not None) != list(range(len(axes))):
            raise LayoutError(f"cannot parse {text!r}: the {len(axes)} axes with {split} need positions "
                              f"{list(range(len(axes)))} in its order, one each, got {given}")
        order.append(tuple(sorted(axes, key=lambda a: positions[a])))
    return tuple(order)


def _parse_placements(inner: str, text: str) -> tuple[tuple, tuple]:
    """(placements, order) from `inner`, the inside of `[S(0)[1], S(0)[0]]` (of `text`)."""
    parsed = [_parse_placement(p) for p in inner.split(",")] if inner.strip() else []
    placements = tuple(p for p, _ in parsed)
    return placements, _parse_order(placements, tuple(i for _, i in parsed), text)


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


def parse(text: str, mesh: Mesh | None = None):
    """Parse the compact notation: a placement, a placement list, a mesh, or a layout. With
    `mesh`, a placement list is read as a layout on it (as `placements_str()` writes it).

    >>> parse("S(1)"), parse("[S(0), R]")
    (Shard(dim=1), (Shard(dim=0), Replicate()))
    >>> str(parse("[S(0), P(sum)] on {dp: 2, tp: 4}"))
    '[S(0), P(sum)] on {dp: 2, tp: 4}'
    >>> parse("[S(0)[1], S(0)[0]] on {dp: 2, tp: 2}").shard_axes(0)
    (1, 0)
    """
    if not isinstance(text, str):
        raise LayoutError(f"hpfun.parse reads a string in the notation layouts print in, such as '[S(0), R] on "
                          f"{{dp: 2, tp: 2}}', got {type(text).__name__} {text!r}")
    text = text.strip()
    if text.startswith("{"):
        return _parse_mesh(text)
    if not text.startswith("["):
        placement, position = _parse_placement(text)
        if position is not None:
            raise LayoutError(f"cannot parse {text!r}: a position in a dim's order belongs in a layout, "
                              "as in '[S(0)[1], S(0)[0]] on {dp: 2, tp: 2}'")
        return placement
    close = _closing_bracket(text)
    placements, order = _parse_placements(text[1:close], text)
    rest = text[close + 1 :].strip()
    if rest and not rest.startswith("on "):
        raise LayoutError(f"cannot parse {text!r}: expected 'on {{mesh}}' after the placements")
    if rest:
        mesh = _parse_mesh(rest[3:])
    if mesh is not None:
        return Layout(mesh, placements, order)
    if any(list(axes) != sorted(axes) for axes in order):
        raise LayoutError(f"cannot parse {text!r} without its mesh: an order other than the mesh's makes a layout; "
                          "write '... on {dp: 2, tp: 2}' or pass the mesh")
    return placements


def _closing_bracket(text: str) -> int:
    """Index of the `]` closing the placement list that `text` starts with (positions nest)."""
    depth = 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if depth == 0:
            return i
    raise LayoutError(f"cannot parse {text!r}: missing ']'")
