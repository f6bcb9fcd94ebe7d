"""`aten.einsum`: a contraction whose equation is its first argument.

Capture folds matmuls on N-D tensors back into einsums over their original dims (see
hpfun/fold.py), so a batch dim such as attention heads or a sequence dim stays a letter of its
own and can be split. The algebra is mm's (`hpfun.rules.letters`): a letter kept in the output
may be split in every operand holding it, and so is the output; a summed letter split in every
operand holding it leaves `Partial(sum)`; einsum is linear in each operand.
"""

from __future__ import annotations

import math

import attrs
import torch

from hpfun.rules.base import OpCall, Strategy
from hpfun.rules.letters import Contracting, Letters, expand, parse

aten = torch.ops.aten


@attrs.frozen(kw_only=True)
class Einsum(Contracting):
    def letters(self, call: OpCall) -> Letters:
        equation = call.args[0]
        terms, out = parse(equation)
        return Letters(
            terms=tuple(expand(term, t.ndim, equation) for term, t in zip(terms, call.tensors, strict=True)),
            out=expand(out, call.outputs[0].ndim, equation),
            linear=(True,) * len(terms),
        )

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        """Lower a product of two operands to permute/reshape/bmm on the local shapes: no
        equation parsing at run time. Anything else runs as einsum on the local blocks."""
        letters = self.letters(call)
        shapes = [l.local_shape(t.shape) for l, t in zip(strategy.inputs, call.tensors, strict=True)]
        if not _is_product(letters, shapes):
            return super().emit(ctx, call, strategy, args, kwargs)
        (ta, tb), out = letters.terms, letters.out
        size = {l: n for term, shape in zip(letters.terms, shapes, strict=True) for l, n in zip(term, shape, strict=True)}
        a, b = args[1]
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


def _is_product(letters: Letters, shapes) -> bool:
    """Two operands whose every letter is kept or shared, none repeated in a term, none broadcast:
    what one (b)mm computes."""
    terms = letters.terms
    if len(terms) != 2 or any(len(set(t)) != len(t) for t in terms):
        return False
    sizes = {}
    for term, shape in zip(terms, shapes, strict=True):
        for letter, n in zip(term, shape, strict=True):
            if sizes.setdefault(letter, n) != n:
                return False
    return all(l in letters.out or sum(l in t for t in terms) == 2 for t in terms for l in t)


def _grouped(ctx, x, term: str, groups: list[list[str]], size: dict):
    """`x` permuted to the groups' letter order and reshaped to one dim per group."""
    perm = [term.index(l) for g in groups for l in g]
    if perm != sorted(perm):
        x = ctx.call(aten.permute.default, (x, perm))
    current = [size[term[i]] for i in perm]
    return _reshaped(ctx, x, current, [math.prod(size[l] for l in g) for g in groups])


def _reshaped(ctx, x, current: list[int], shape: list[int]):
    return x if list(current) == list(shape) else ctx.call(aten.reshape.default, (x, shape))
