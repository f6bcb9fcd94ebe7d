"""Pointwise ops (with broadcasting), `*_like` ops and factories.

Algebra behind the Partial rows: a pointwise op f passes `Partial(sum)` through exactly when it
is linear. Jointly linear ops (add, sub, neg, where in its two values) take every listed tensor
partial: (a1 + a2) + (b1 + b2) = (a1 + b1) + (a2 + b2). Ops linear in each argument separately
(mul, div's numerator) take one partial argument, the others replicated: (a1 + a2) * b = a1*b + a2*b.
"""

from __future__ import annotations

import attrs
import torch

from hpfun.layout import Layout, Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option


@attrs.frozen(kw_only=True)
class Pointwise(Rule):
    """Elementwise op; inputs broadcast against the output from the right."""

    linear_joint: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    linear_each: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    partial_reduces: tuple[str, ...] = attrs.field(default=("sum", "avg"), converter=tuple)
    # a cast is linear only into a floating or complex type that holds every value of the
    # input's type: int(a1) + int(a2) != int(a1 + a2), and rounding each term to a narrower
    # type (float32 -> bfloat16) is not rounding their sum (the error scales with the terms,
    # not the sum); real -> complex, complex -> complex and complex -> real (the real part)
    # are linear
    linear_to_float_only: bool = False

    def strategies(self, call: OpCall) -> list[Strategy]:
        per_axis = []
        for a in range(call.mesh.ndim):
            options = [self._follow(call, t, t.layout.placements[a]) for t in call.tensors]
            per_axis.append([*options, replicated_option(call)])
        return combine_axes(call, per_axis)

    def _follow(self, call: OpCall, seed, placement):
        if isinstance(placement, Shard):
            return _follow_shard(call, seed, placement.dim)
        if isinstance(placement, Partial) and placement.reduce in self.partial_reduces:
            return self._follow_partial(call, seed, placement)
        return None

    def _follow_partial(self, call: OpCall, seed, placement):
        tensors = call.tensors
        out = call.outputs[0].dtype
        if (self.linear_to_float_only or out != seed.dtype) and not _widens(seed.dtype, out):
            return None  # (a type promotion that changes the arithmetic: int8 terms summed as floats do not wrap)

        if not _finite_scalars(call):
            return None
        if seed.index in self.linear_each:
            partial = {id(seed)}
        elif seed.index in self.linear_joint and self._joint_args_are_tensors(call):
            partial = {id(t) for t in tensors if t.index in self.linear_joint}
        else:
            return None
        ins = tuple(placement if id(t) in partial else R for t in tensors)
        return ins, (placement,) * len(call.outputs)

    def _joint_args_are_tensors(self, call: OpCall) -> bool:
        # A scalar operand of add/sub would be added once per rank: not linear.
        indices = {t.index for t in call.tensors}
        return all(i in indices for i in self.linear_joint if i < len(call.args))


def _finite_scalars(call: OpCall) -> bool:
    """Linearity holds over finite numbers: scaling each term by inf (or dividing it by 0) makes
    inf - inf = nan where the whole value was one infinity, or 0 * inf = nan on a rank whose
    term is 0. A Python number among the arguments must be finite (and not a divisor of 0)."""
    dividing = "div" in str(call.op)
    for i, a in [*enumerate(call.args), *((None, v) for v in call.kwargs.values())]:  # addcmul's value=
        if isinstance(a, bool) or not isinstance(a, (int, float, complex)):
            continue
        if not torch.isfinite(torch.tensor(a)).item() or (dividing and i is not None and i > 0 and a == 0):
            return False
    return True


def _widens(src, dst) -> bool:
    """A cast from `src` to `dst` is linear on sums: dst is floating or complex, and its
    components hold every value of src's. A sum of narrow integers is not: it wraps around in
    its type (int8 terms 100 + 100 sum to -56), so such terms are summed in their own type first.
    int64 terms (counts: `(labels != -100).sum()`) are cast as they are: exact below 2**24 in
    float32, and beyond that rounded as a float sum's terms are."""
    if not (dst.is_floating_point or dst.is_complex):
        return False
    if not (src.is_floating_point or src.is_complex):
        return src == torch.int64
    a, b = torch.finfo(src), torch.finfo(dst)
    return b.eps <= a.eps and b.max >= a.max and b.smallest_normal <= a.smallest_normal


def _follow_shard(call: OpCall, seed, dim: int):
    """Shard every input along the output dim that `seed`'s dim `dim` broadcasts to."""
    out = call.outputs[0]
    out_dim = dim + out.ndim - seed.ndim
    if seed.shape[dim] != out.shape[out_dim]:
        return None  # a broadcast dim of the seed cannot lead
    ins = []
    for t in call.tensors:
        d = out_dim - (out.ndim - t.ndim)
        ins.append(Shard(d) if d >= 0 and t.shape[d] == out.shape[out_dim] else R)
    return tuple(ins), (Shard(out_dim),) * len(call.outputs)


@attrs.frozen(kw_only=True)
class Like(Rule):
    """`zeros_like`, `full_like`...: only the input's shape matters, so it stays where it is.

    The output takes the input's shards; a Partial input gives a replicated output.
    """

    def strategies(self, call: OpCall) -> list[Strategy]:
        src = call.tensors[0].layout
        out = attrs.evolve(src, placements=tuple(R if isinstance(p, Partial) else p for p in src.placements))
        return [Strategy((src,) + tuple(t.layout for t in call.tensors[1:]), (out,) * len(call.outputs))]


@attrs.frozen(kw_only=True)
class SameFeatureMeta(Rule):
    """`_new_zeros_with_same_feature_meta(self, other, self_num_batch_dims=k)` (how forward-mode
    AD makes a tangent: `linearize`, `jvp` under `vmap`): zeros of shape `self.shape[:k] +
    other.shape`, so only shapes matter. The output takes the splits of `other`'s dims (moved
    by k) and of `self`'s first k dims; a mesh axis that splits both keeps `other`'s split, and
    `self` is gathered on it. Partial inputs give a replicated output."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        k = call.arg(None, "self_num_batch_dims", 0) or 0
        a, b = call.tensors[0].layout, call.tensors[1].layout
        need, out = [], []
        for pa, pb in zip(a.placements, b.placements):
            batch = isinstance(pa, Shard) and pa.dim < k
            if isinstance(pb, Shard):
                out.append(Shard(pb.dim + k))
                need.append(R if batch else pa)
            else:
                out.append(pa if batch else R)
                need.append(pa)
        kept = {i for i, p in enumerate(out) if isinstance(p, Shard) and p.dim < k}

        def within(groups, axes):  # an order's groups, less the axes no longer splitting their dim
            return tuple(g for g in (tuple(i for i in group if i in axes) for group in groups) if len(g) > 1)

        a_need = Layout(a.mesh, tuple(need), within(a.order, {i for i, p in enumerate(need) if isinstance(p, Shard)}))
        order = within(a.order, kept) + tuple(b.order)
        return [Strategy((a_need, b), (Layout(a.mesh, tuple(out), order),))]


@attrs.frozen(kw_only=True)
class Factory(Rule):
    """Ops that make a tensor from a shape (`full`, `zeros`, `new_empty_strided`): replicated
    output. A tensor input gives only dtype and device, so it stays where it is."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        r = Layout.replicated(call.mesh)
        return [Strategy(tuple(t.layout for t in call.tensors), (r,) * len(call.outputs))]
