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
import torch

from hpfun.layout import Layout, Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option

aten = torch.ops.aten


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

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        """Lower to permute/reshape/bmm on the local shapes: no equation parsing at run time."""
        terms, out = _terms(call)
        if len(terms) != 2 or any(l not in out and sum(l in t for t in terms) == 1 for t in terms for l in t):
            return super().emit(ctx, call, strategy, args, kwargs)
        shapes = [l.local_shape(t.shape) for l, t in zip(strategy.inputs, call.tensors, strict=True)]
        size = {l: n for term, shape in zip(terms, shapes, strict=True) for l, n in zip(term, shape, strict=True)}
        (ta, tb), (a, b) = terms, args[1]
        batch = [l for l in out if l in ta and l in tb]
        left, right = [l for l in out if l in ta and l not in tb], [l for l in out if l in tb and l not in ta]
        summed = [l for l in ta if l in tb and l not in out]
        keep = [batch] if batch else []  # no batch letters: a plain mm
        a = _grouped(ctx, a, ta, keep + [left, summed], size)
        b = _grouped(ctx, b, tb, keep + [summed, right], size)
        product = ctx.call(aten.bmm.default if batch else aten.mm.default, (a, b))
        order = batch + left + right
        grouped = [math.prod(size[l] for l in g) for g in keep + [left, right]]
        product = _reshaped(ctx, product, grouped, [size[l] for l in order])
        perm = [order.index(l) for l in out]
        return product if perm == sorted(perm) else ctx.call(aten.permute.default, (product, perm))

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


def _grouped(ctx, x, term: str, groups: list[list[str]], size: dict):
    """`x` permuted to the groups' letter order and reshaped to one dim per group."""
    perm = [term.index(l) for g in groups for l in g]
    if perm != sorted(perm):
        x = ctx.call(aten.permute.default, (x, perm))
    current = [size[term[i]] for i in perm]
    return _reshaped(ctx, x, current, [math.prod(size[l] for l in g) for g in groups])


def _reshaped(ctx, x, current: list[int], shape: list[int]):
    return x if list(current) == list(shape) else ctx.call(aten.reshape.default, (x, shape))


def _replicated(call: OpCall) -> Strategy:
    r = Layout.replicated(call.mesh)
    return Strategy((r,) * len(call.tensors), (r,) * len(call.outputs))
