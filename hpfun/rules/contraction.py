"""Einsum-style contractions: mm, bmm, addmm, baddbmm; and ops with the same index structure
that are not sums of products (cdist, grid_sampler), whose contracted dims must be whole.

Per mesh axis, with the equation "mk,kn->mn":
- a letter kept in the output (m, n, a batch b) may be sharded: every operand holding it is
  sharded the same way and so is the output;
- a contracted letter (k) sharded in both operands leaves `Partial(sum)`:
  a @ b = sum_i a[:, K_i] @ b[K_i, :];
- the op is linear in each operand: one operand `Partial` and the others replicated gives `Partial`.
An additive `bias` follows the output: sharded alongside it, or Partial with it.
`sums: false`: contracted letters are not summed over (cdist's p-norm), so they must be whole.
`linear`: the operands the op is linear in (default all); only those may be Partial.
"..." in a term stands for the leading (batch) dims, aligned from the right.
"""

from __future__ import annotations

import attrs

from hpfun.layout import Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option


_BATCH = "ABCDEFGH"


def _parse_equation(text: str):
    lhs, out = text.replace(" ", "").split("->")
    return tuple(lhs.split(",")), out


def _expand(term: str, ndim: int) -> str:
    """A term with "..." written out for a tensor of `ndim` dims (batch letters right-aligned)."""
    if "..." not in term:
        return term
    n = ndim - (len(term) - 3)
    return term.replace("...", _BATCH[len(_BATCH) - n :])


@attrs.frozen(kw_only=True)
class Contraction(Rule):
    equation: str = "mk,kn->mn"
    operands: tuple[int, ...] = attrs.field(default=(0, 1), converter=tuple)
    bias: int | None = None
    sums: bool = True
    linear: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))

    def strategies(self, call: OpCall) -> list[Strategy]:
        per_axis = []
        for a in range(call.mesh.ndim):
            options = [self._seed(call, t, t.layout.placements[a]) for t in call.tensors]
            per_axis.append([*options, replicated_option(call)])
        return combine_axes(call, per_axis)

    def _letters(self, call: OpCall, t) -> str | None:
        terms, _ = _parse_equation(self.equation)
        return _expand(terms[self.operands.index(t.index)], t.ndim) if t.index in self.operands else None

    def _out_letters(self, call: OpCall) -> str:
        return _expand(_parse_equation(self.equation)[1], call.outputs[0].ndim)

    def _seed(self, call: OpCall, seed, p):
        if isinstance(p, Partial) and p.reduce in ("sum", "avg"):
            return self._partial_option(call, seed, p)
        if not isinstance(p, Shard):
            return None
        letters = self._letters(call, seed)
        if letters is not None:
            return self._letter_option(call, letters[p.dim])
        out = self._out_letters(call)  # the bias: its dim aligns with the output's
        out_dim = p.dim + len(out) - seed.ndim
        if seed.shape[p.dim] != call.outputs[0].shape[out_dim]:
            return None
        return self._letter_option(call, out[out_dim])

    def _letter_option(self, call: OpCall, letter: str):
        out = self._out_letters(call)
        if letter not in out and not self.sums:
            return None
        out_p = Shard(out.index(letter)) if letter in out else Partial("sum")
        ins = []
        for t in call.tensors:
            letters = self._letters(call, t)
            if letters is not None:
                ins.append(Shard(letters.index(letter)) if letter in letters else R)
            else:
                ins.append(self._bias_placement(call, t, out_p))
        return tuple(ins), (out_p,)

    def _bias_placement(self, call: OpCall, bias, out_p):
        if isinstance(out_p, Partial):
            return out_p
        out = call.outputs[0]
        d = out_p.dim - (out.ndim - bias.ndim)
        return Shard(d) if d >= 0 and bias.shape[d] == out.shape[out_p.dim] else R

    def _partial_option(self, call: OpCall, seed, p):
        if self.linear is not None and seed.index not in self.linear:
            return None
        ins = []
        for t in call.tensors:
            is_bias = t.index == self.bias
            ins.append(p if (t is seed or is_bias) else R)
        if seed.index == self.bias:
            # a partial bias needs one partial operand too: pick the first
            first = next(t for t in call.tensors if t.index in self.operands)
            ins[call.tensors.index(first)] = p
        return tuple(ins), (p,)
