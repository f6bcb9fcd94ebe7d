"""`aten.einsum`: a contraction whose equation is its first argument.

Capture folds matmuls on N-D tensors back into einsums over their original dims (see
hpfun/fold.py), so a batch dim such as attention heads or a sequence dim stays a letter of its
own and can be sharded. Per mesh axis, as for mm: a letter kept in the output may be sharded
in every operand holding it, and so is the output; a summed letter sharded in every operand
holding it leaves `Partial(sum)`; einsum is linear in each operand, so one `Partial` operand
with the others replicated gives `Partial`.
"""

from __future__ import annotations

import math

import attrs

from hpfun.layout import Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option


def _terms(call: OpCall):
    lhs, out = call.args[0].replace(" ", "").split("->")
    return lhs.split(","), out


@attrs.frozen(kw_only=True)
class Einsum(Rule):
    def strategies(self, call: OpCall) -> list[Strategy]:
        terms, out = _terms(call)
        if any(len(set(t)) != len(t) for t in terms) or "." in "".join(terms):
            return [_replicated(call)]  # diagonals and ellipses: not folded by capture, kept simple
        per_axis = []
        for a in range(call.mesh.ndim):
            options = [self._seed(call, i, t.layout.placements[a]) for i, t in enumerate(call.tensors)]
            per_axis.append([*options, replicated_option(call)])
        return combine_axes(call, per_axis)

    def work(self, call: OpCall, strategy: Strategy) -> float:
        """Multiply-adds per rank: the product of every letter's local size."""
        terms, _ = _terms(call)
        sizes = {}
        for term, t, layout in zip(terms, call.tensors, strategy.inputs, strict=True):
            for letter, size in zip(term, layout.local_shape(t.shape), strict=True):
                sizes[letter] = min(size, sizes.get(letter, size))
        return float(math.prod(sizes.values()))

    def _seed(self, call: OpCall, i: int, p):
        terms, out = _terms(call)
        if isinstance(p, Partial) and p.reduce in ("sum", "avg"):
            return tuple(p if j == i else R for j in range(len(terms))), (p,)
        if not isinstance(p, Shard):
            return None
        letter = terms[i][p.dim]
        sizes = {call.tensors[j].shape[t.index(letter)] for j, t in enumerate(terms) if letter in t}
        if len(sizes) != 1:
            return None  # a broadcast (size-1) occurrence cannot be split alongside
        ins = tuple(Shard(t.index(letter)) if letter in t else R for t in terms)
        return ins, (Shard(out.index(letter)) if letter in out else Partial("sum"),)


def _replicated(call: OpCall) -> Strategy:
    from hpfun.layout import Layout

    r = Layout.replicated(call.mesh)
    return Strategy((r,) * len(call.tensors), (r,) * len(call.outputs))
