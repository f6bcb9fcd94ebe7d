"""Einsum-style contractions: mm, bmm, addmm, baddbmm; and ops with the same index structure
that are not sums of products (cdist, grid_sampler), whose contracted dims must be whole.

The equation ("mk,kn->mn") comes from the YAML table, over the arguments at `operands`; the
algebra (which letters may be split, what is left Partial, the work per rank) is
`hpfun.rules.letters`, shared with `aten.einsum`.
`bias`: an added argument that follows the output (addmm(bias, a, b) = bias + a @ b).
`sums: false`: contracted letters are not summed over (cdist's p-norm), so they must be whole.
`linear`: the arguments the op is linear in (default all); only those may be Partial.
`lookup`: contracted letters are positions looked up (grid_sampler), not looped over.
"..." in a term stands for the leading (batch) dims, aligned from the right.
"""

from __future__ import annotations

import attrs

from hpfun.rules.base import OpCall
from hpfun.rules.letters import Contracting, Letters, expand, parse


@attrs.frozen(kw_only=True)
class Contraction(Contracting):
    equation: str = "mk,kn->mn"
    operands: tuple[int, ...] = attrs.field(default=(0, 1), converter=tuple)
    bias: int | None = None
    sums: bool = True
    linear: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    lookup: bool = False

    def letters(self, call: OpCall) -> Letters:
        terms, out = parse(self.equation)
        return Letters(
            terms=tuple(expand(terms[self.operands.index(t.index)], t.ndim, self.equation)
                        if t.index in self.operands else None for t in call.tensors),
            out=expand(out, call.outputs[0].ndim, self.equation),
            linear=tuple(self.linear is None or t.index in self.linear for t in call.tensors),
            sums=self.sums,
            lookup=self.lookup,
        )
