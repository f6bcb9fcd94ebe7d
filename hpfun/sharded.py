"""`Sharded`: what crosses the boundary of a sharded function. A record, not a tensor subclass."""

from __future__ import annotations

import attrs
import torch

from hpfun.errors import LayoutError
from hpfun.layout import Layout, Partial


@attrs.frozen(eq=False)
class Sharded:
    """A global tensor laid out on a mesh: `shards[r]` is rank r's local tensor.

    >>> import hpfun, torch
    >>> mesh = hpfun.Mesh.simulated((2,), ("dp",))
    >>> x = hpfun.Sharded.from_global(torch.arange(4.0), hpfun.P("dp").to_layout(mesh, 1))
    >>> [s.tolist() for s in x.shards], x.full().tolist()
    ([[0.0, 1.0], [2.0, 3.0]], [0.0, 1.0, 2.0, 3.0])
    """

    layout: Layout
    global_shape: tuple[int, ...] = attrs.field(converter=tuple)
    shards: tuple[torch.Tensor, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self):
        mesh = self.layout.mesh
        if len(self.shards) != mesh.size:
            raise LayoutError(f"a Sharded value on {mesh} needs {mesh.size} shards, got {len(self.shards)}")
        local = self.layout.local_shape(self.global_shape)
        bad = [r for r, s in enumerate(self.shards) if tuple(s.shape) != local]
        if bad:
            raise LayoutError(f"shards of ranks {bad} do not have the local shape {local} of {self.layout}")

    @classmethod
    def from_global(cls, tensor: torch.Tensor, layout: Layout) -> "Sharded":
        """Split a global tensor by `layout` (Partial axes: rank 0 of the axis holds the value for sum)."""
        layout = layout.normalized(tensor.ndim)
        local = layout.local_shape(tensor.shape)
        shards = []
        for r in range(layout.mesh.size):
            coords = layout.mesh.coords(r)
            block = tensor
            for d, offset in enumerate(layout.offsets(tensor.shape, coords)):
                block = block.narrow(d, offset, local[d])
            for a in layout.partial_axes:
                if layout.placements[a].reduce == "sum" and coords[a] != 0:
                    block = torch.zeros_like(block)
            shards.append(block.contiguous())
        return cls(layout, tuple(tensor.shape), tuple(shards))

    @property
    def dtype(self) -> torch.dtype:
        return self.shards[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.global_shape

    def full(self) -> torch.Tensor:
        """The global tensor: blocks placed at their offsets, Partial terms reduced."""
        mesh, layout = self.layout.mesh, self.layout
        partial = layout.partial_axes
        out = torch.empty(self.global_shape, dtype=self.dtype)
        blocks: dict[tuple, list[torch.Tensor]] = {}
        for r, shard in enumerate(self.shards):
            coords = mesh.coords(r)
            key = tuple(0 if a in partial else c for a, c in enumerate(coords))
            blocks.setdefault(key, []).append(shard)
        for key, terms in blocks.items():
            value = _reduce_terms(terms, [layout.placements[a] for a in partial])
            index = tuple(slice(o, o + n) for o, n in zip(layout.offsets(self.global_shape, key), value.shape, strict=True))
            out[index] = value
        return out

    def __repr__(self) -> str:
        return f"Sharded({self.layout}, global_shape={self.global_shape}, dtype={self.dtype})"


def _reduce_terms(terms: list[torch.Tensor], partials: list[Partial]) -> torch.Tensor:
    if not partials:
        return terms[0]
    if len({p.reduce for p in partials}) > 1:
        raise LayoutError(f"cannot reduce mixed Partial placements {partials}: redistribute first")
    reduce = partials[0].reduce
    stacked = torch.stack(terms)
    return {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[reduce].to(terms[0].dtype)
