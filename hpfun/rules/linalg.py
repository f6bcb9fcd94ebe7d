"""Linear algebra on batches of matrices: inverse, determinants, decompositions, solves.

Each matrix is the trailing `core` dims of the first input (2 for a matrix); every dim before
them is a batch dim, the same in every tensor and output (a solve's right-hand side, a
decomposition's factors, the determinant), and each batch element is computed on its own. So
a batch dim may be split when every tensor and output has it at the same size (no broadcast),
split alike everywhere; the matrices themselves stay whole. `linear`: the inputs the op is
linear in (a solve in its right-hand side): one of them Partial with the others replicated
gives Partial outputs, those at `linear_outputs` (default all; the others, a solve's factors
of the matrix, do not depend on it and come out replicated).
"""

from __future__ import annotations

import attrs

from hpfun.layout import Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option

_LINEAR = ("sum", "avg")


@attrs.frozen(kw_only=True)
class Batched(Rule):
    core: int = 2
    linear: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    linear_outputs: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    # a dim the op works on each slice of alike (grid_sample's channels), per tensor input (None: it
    # has none, it reads the same for every slice) and per output (None: a sum over the slices,
    # Partial when they are split)
    sliced: tuple = attrs.field(default=(), converter=tuple)
    sliced_outputs: tuple = attrs.field(default=(), converter=tuple)

    def strategies(self, call: OpCall) -> list[Strategy]:
        tensors, outputs = call.tensors, call.outputs
        batch = tensors[0].ndim - self.core
        shapes = [t.shape for t in tensors] + [o.shape for o in outputs]
        splittable = {d for d in range(max(batch, 0)) if all(len(s) > d for s in shapes)
                      and len({s[d] for s in shapes}) == 1}
        per_axis = []
        for a in range(call.mesh.ndim):
            options = [replicated_option(call)]
            for i, t in enumerate(tensors):
                p = t.layout.placements[a]
                if isinstance(p, Shard) and p.dim in splittable:
                    options.insert(0, ((p,) * len(tensors), (p,) * len(outputs)))
                elif isinstance(p, Shard) and i < len(self.sliced) and p.dim == self.sliced[i]:
                    options.insert(0, (tuple(R if d is None else Shard(d) for d in self.sliced),
                                       tuple(Partial("sum") if d is None else Shard(d) for d in self.sliced_outputs)))
                elif isinstance(p, Partial) and p.reduce in _LINEAR and t.index in self.linear:
                    outs = tuple(p if self.linear_outputs is None or o in self.linear_outputs else R
                                 for o in range(len(outputs)))
                    options.insert(0, (tuple(p if j == i else R for j in range(len(tensors))), outs))
            per_axis.append(options)
        return combine_axes(call, per_axis)
