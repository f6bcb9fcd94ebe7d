"""The letter algebra of contractions, written once for `Contraction` (mm, bmm, addmm, cdist...:
the equation in the YAML table) and `Einsum` (the equation in the call).

Per mesh axis, with the equation "mk,kn->mn":
- a letter kept in the output (m, n, a batch b) may be split: every operand holding it is
  split the same way and so is the output;
- a summed letter (k) split in every operand holding it leaves `Partial(sum)`:
  a @ b = sum_i a[:, K_i] @ b[K_i, :];
- the op is linear in each operand: one operand `Partial` and the others replicated gives
  `Partial`, a @ (b1 + b2) = a @ b1 + a @ b2 (the same for avg, a mean of terms).
A letter whose size differs between operands (a size-1 dim broadcast against a longer one)
cannot be split: the size-1 side has nothing to split alongside. A letter repeated in one term
(a diagonal) keeps the whole op replicated. An additive bias follows the output: split
alongside it where its dims line up (from the right), `Partial` with it.

Each candidate comes from an input's placement on that axis (a split letter, or a Partial
term), plus the replicated option; `combine_axes` takes the product over the axes.
"""

from __future__ import annotations

import functools
import math
import string

import attrs

from hpfun.layout import Partial, R, Shard
from hpfun.rules.base import AxisOption, OpCall, Rule, Strategy, combine_axes, replicated_option


@functools.cache
def parse(text: str) -> tuple[tuple[str, ...], str]:
    """(input terms, output term) of an einsum equation; without "->" the output is the letters
    used once, in alphabetical order (einsum's implicit form)."""
    text = text.replace(" ", "")
    lhs, arrow, out = text.partition("->")
    terms = tuple(lhs.split(","))
    if not arrow:
        letters = lhs.replace(",", "").replace(".", "")
        out = ("..." if "..." in lhs else "") + "".join(sorted(l for l in set(letters) if letters.count(l) == 1))
    return terms, out


def expand(term: str, ndim: int, equation: str) -> str:
    """`term` with "..." written out for a tensor of `ndim` dims: the leading (batch) dims, aligned
    from the right across terms, as capital letters the equation does not use."""
    if "..." not in term:
        return term
    batch = [c for c in string.ascii_uppercase if c not in equation]
    n = ndim - (len(term) - 3)
    return term.replace("...", "".join(batch[len(batch) - n :]))


@attrs.frozen
class Letters:
    """One call's contraction: the letters of each tensor argument (None: the bias) and of the output.

    `sums`: contracted letters are summed over (else, as in cdist's p-norm, they must be whole).
    `linear`: per tensor, whether the op is linear in it (only those may be Partial).
    `lookup`: contracted letters are positions looked up, not looped over (grid_sampler reads a
    few input points per output element), so the work is one per output element.
    """

    terms: tuple[str | None, ...]
    out: str
    linear: tuple[bool, ...]
    sums: bool = True
    lookup: bool = False

    def strategies(self, call: OpCall) -> list[Strategy]:
        if any(len(set(t)) != len(t) for t in self.terms if t is not None):
            # a diagonal: its letter would be split in two dims of one block, not in one block per rank
            return combine_axes(call, [[replicated_option(call)]] * call.mesh.ndim)
        per_axis = []
        for a in range(call.mesh.ndim):
            options = [self._seed(call, i, t.layout.placements[a]) for i, t in enumerate(call.tensors)]
            per_axis.append([*options, replicated_option(call)])
        return combine_axes(call, per_axis)

    def work(self, call: OpCall, strategy: Strategy) -> float:
        """Multiply-adds per rank (the product of every letter's local size; for `lookup`, of the
        output's), plus one add per local output element where there is a bias."""
        sizes: dict[str, int] = {}
        for term, t, layout in zip(self.terms, call.tensors, strategy.inputs, strict=True):
            if term is None:
                continue
            for letter, n in zip(term, layout.local_shape(t.shape), strict=True):
                sizes[letter] = max(n, sizes.get(letter, 1))  # a broadcast size-1 dim runs at full size
        looped = self.out if self.lookup else sizes
        bias = math.prod(strategy.outputs[0].local_shape(call.outputs[0].shape)) if None in self.terms else 0
        return float(math.prod(sizes[l] for l in looped) + bias)

    def _seed(self, call: OpCall, i: int, p) -> AxisOption | None:
        """The option an input's placement on one axis asks for, if the algebra has one."""
        if isinstance(p, Partial) and p.reduce in ("sum", "avg"):
            return self._partial_option(call, i, p)
        if not isinstance(p, Shard):
            return None
        term, t = self.terms[i], call.tensors[i]
        if term is not None:
            return self._letter_option(call, term[p.dim])
        out_dim = p.dim + len(self.out) - t.ndim  # the bias: its dims align with the output's
        if t.shape[p.dim] != call.outputs[0].shape[out_dim]:
            return None
        return self._letter_option(call, self.out[out_dim])

    def _letter_option(self, call: OpCall, letter: str) -> AxisOption | None:
        kept = letter in self.out
        if not kept and not self.sums:
            return None
        holders = [(t, term) for t, term in zip(call.tensors, self.terms, strict=True) if term and letter in term]
        if len({t.shape[term.index(letter)] for t, term in holders}) != 1:
            return None  # a broadcast (size-1) occurrence cannot be split alongside
        out_p = Shard(self.out.index(letter)) if kept else Partial("sum")
        ins = []
        for t, term in zip(call.tensors, self.terms, strict=True):
            if term is None:
                ins.append(self._bias_placement(call, t, out_p))
            else:
                ins.append(Shard(term.index(letter)) if letter in term else R)
        return tuple(ins), (out_p,)

    def _bias_placement(self, call: OpCall, bias, out_p):
        if isinstance(out_p, Partial):
            return out_p  # bias + sum_i a_i b_i = sum_i (bias_i + a_i b_i)
        out = call.outputs[0]
        d = out_p.dim - (out.ndim - bias.ndim)
        return Shard(d) if d >= 0 and bias.shape[d] == out.shape[out_p.dim] else R

    def _partial_option(self, call: OpCall, i: int, p) -> AxisOption | None:
        if not self.linear[i]:
            return None
        ins = [p if j == i or term is None else R for j, term in enumerate(self.terms)]
        if self.terms[i] is None:
            # a Partial bias needs one Partial operand too (each rank adds its term to its product)
            first = next((j for j, term in enumerate(self.terms) if term is not None and self.linear[j]), None)
            if first is None:
                return None
            ins[first] = p
        return tuple(ins), (p,)


@attrs.frozen(kw_only=True)
class Contracting(Rule):
    """A rule whose op is a contraction: its strategies and work come from `letters(call)`."""

    def letters(self, call: OpCall) -> Letters:
        raise NotImplementedError

    def strategies(self, call: OpCall) -> list[Strategy]:
        return self.letters(call).strategies(call)

    def work(self, call: OpCall, strategy: Strategy) -> float:
        """Multiply-adds per rank under `strategy` (see `Letters.work`)."""
        return self.letters(call).work(call, strategy)
