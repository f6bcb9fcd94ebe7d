"""Reductions over dims, and ops along some dims with the others passing through (softmax, sort...).

Reducing a sharded dim reduces each shard locally and leaves the cross-shard reduction pending:
sum(x) = sum_i sum(x_i) gives `Partial(sum)`; mean over equal shards gives `Partial(avg)`;
amax gives `Partial(max)`. A pending Partial input passes through a reduction of the same kind:
sum(x1 + x2) = sum(x1) + sum(x2), max(max(x1), max(x2)) = max over everything.
"""

from __future__ import annotations

import math
import operator

import attrs
import torch

from hpfun.layout import Layout, Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option
from hpfun.rules.pointwise import _widens

aten = torch.ops.aten


def _keeps_sums(x, call: OpCall) -> bool:
    """A Partial input passes a reduction only in its own dtype or cast exactly wider:
    `sum(dtype=torch.int64)` of terms truncates each term, and `dtype=torch.float16` rounds
    (or overflows) each one, where the whole value is cast once."""
    out = call.outputs[0].dtype
    return out == x.dtype or _widens(x.dtype, out)

_REDUCES = (None, "sum", "avg", "max", "min")


def _check_reduce(_, __, value):
    if value not in _REDUCES:
        raise ValueError(f"reduce must be one of {_REDUCES}, got {value!r}")


@attrs.frozen(kw_only=True)
class Reduction(Rule):
    """Reduction of `dim_arg`'s dims (all dims when absent, None or []).

    `reduce`: the Partial left by reducing a sharded dim (None: reduced dims must be replicated).
    `pass_partials`: Partial inputs that pass through unchanged.
    `dim_default`: the dim reduced when the argument is absent (kthvalue's -1), else all dims.
    """

    reduce: str | None = attrs.field(default=None, validator=_check_reduce)
    pass_partials: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    dim_arg: int | None = 1
    keepdim_arg: int | None = 2
    dim_default: int | None = None

    def reduced_dims(self, call: OpCall) -> set[int]:
        x = call.tensors[0]
        dims = call.arg(self.dim_arg, "dim", self.dim_default) if self.dim_arg is not None else None
        if dims is None or dims == []:
            return set(range(x.ndim))
        dims = [dims] if isinstance(dims, int) else dims
        return {d % max(x.ndim, 1) for d in dims}

    def out_dim(self, call: OpCall, dim: int, reduced: set[int]) -> int:
        keepdim = bool(call.arg(self.keepdim_arg, "keepdim", False)) if self.keepdim_arg is not None else False
        return dim if keepdim else dim - sum(1 for r in reduced if r < dim)

    def strategies(self, call: OpCall) -> list[Strategy]:
        x, reduced = call.tensors[0], self.reduced_dims(call)
        n_in, n_out = len(call.tensors), len(call.outputs)
        per_axis = []
        for p in x.layout.placements:
            option = None
            if isinstance(p, Shard) and p.dim not in reduced:
                option = ((p,) + (R,) * (n_in - 1), (Shard(self.out_dim(call, p.dim, reduced)),) * n_out)
            elif isinstance(p, Shard) and self.reduce is not None:
                option = ((p,) + (R,) * (n_in - 1), (Partial(self.reduce),) * n_out)
            elif isinstance(p, Partial) and p.reduce in self.pass_partials and _keeps_sums(x, call):
                option = ((p,) + (R,) * (n_in - 1), (p,) * n_out)
            per_axis.append([option, replicated_option(call)])
        return combine_axes(call, per_axis)


@attrs.frozen(kw_only=True)
class ArgReduction(Reduction):
    """`max.dim`, `min.dim` (values and indices), `argmax`, `argmin` over one dim. Besides the
    reduced dim whole, a split one: each rank reduces its block, its indices moved to global
    ones, and the blocks' (value, index) pairs, one per block and row, are all-gathered along
    the split (a tensor 1/block-size of the input's), where the winner is taken: the first
    block holding the extreme, as the op takes the first index (a NaN is the max, and the min,
    as in torch). Greedy decoding over a vocabulary-split head moves B x tp pairs, not B x V
    logits. The all-gathers are the strategy's `inner_moves`, priced with the rest."""

    def _split(self, call: OpCall):
        """(dim, the axes splitting it, keepdim) where the op reduces one split dim, else None."""
        x = call.tensors[0]
        dim = call.arg(self.dim_arg, "dim", None)
        if dim is None or x.ndim == 0 or x.dtype.is_complex:
            return None
        dim %= x.ndim
        axes = x.layout.shard_axes(dim)
        keepdim = bool(call.arg(self.keepdim_arg, "keepdim", False))
        return (dim, axes, keepdim) if axes else None

    def strategies(self, call: OpCall) -> list[Strategy]:
        out = super().strategies(call)
        split = self._split(call)
        if split is None:
            return out
        dim, axes, keepdim = split
        x = call.tensors[0].layout
        placements = [p if a in axes else R if isinstance(p, Partial) else p for a, p in enumerate(x.placements)]
        src = Layout(x.mesh, tuple(placements), x.order)
        result = [R if a in axes or not isinstance(p, Shard) else Shard(p.dim if keepdim or p.dim < dim else p.dim - 1)
                  for a, p in enumerate(placements)]
        order = tuple(g for g in x.order if not set(g) & set(axes))  # (groups name axes, not dims)
        outputs = (Layout(x.mesh, tuple(result), order),) * len(call.outputs)
        return [Strategy((src,), outputs, note="split"), *out]

    def inner_moves(self, call: OpCall, strategy: Strategy) -> list:
        """The all-gathers the split strategy makes: (from, to, global shape, dtype) each."""
        if strategy.note != "split":
            return []
        dim, axes, _ = self._split(call)
        src, x = strategy.inputs[0], call.tensors[0]
        pairs = list(x.shape)
        pairs[dim] = src.shard_factor(dim)
        dst = Layout(src.mesh, tuple(R if a in axes else p for a, p in enumerate(src.placements)),
                     tuple(g for g in src.order if not set(g) & set(axes)))
        return [(src, dst, tuple(pairs), x.dtype), (src, dst, tuple(pairs), torch.int64)]

    def emit(self, ctx, call: OpCall, strategy: Strategy, args: tuple, kwargs: dict):
        if strategy.note != "split":
            return super().emit(ctx, call, strategy, args, kwargs)
        dim, _, keepdim = self._split(call)
        largest = call.op in (aten.max.dim, aten.argmax.default)
        local = ctx.call(aten.max.dim if largest else aten.min.dim, (args[0], dim, True))
        values, index = ctx.call(operator.getitem, (local, 0)), ctx.call(operator.getitem, (local, 1))
        x = call.tensors[0]
        index = ctx.call(aten.add.Tensor, (index, ctx.shard_offset(strategy.inputs[0], x.shape, dim)))
        gathered = []
        ctx.consumer = (*ctx.consumer[:2], f"{call.op} over split dim {dim}: each block's winner, gathered")
        for value, (src, dst, shape, dtype) in zip((values, index), self.inner_moves(call, strategy), strict=True):
            ctx.annotate(value, src, shape, dtype)
            gathered.append(ctx.redistribute(value, src, dst, shape, dtype))
        values, index = gathered
        winner = ctx.call(aten.argmax.default if largest else aten.argmin.default, (values, dim, True))
        index = ctx.call(aten.gather.default, (index, dim, winner))
        values = ctx.call(aten.gather.default, (values, dim, winner))
        if not keepdim:
            index = ctx.call(aten.squeeze.dim, (index, dim))
            values = ctx.call(aten.squeeze.dim, (values, dim))
        if call.op in (aten.argmax.default, aten.argmin.default):
            return index
        return ctx.call(_pair, (values, index))


def _pair(values, indices):
    """max.dim's (values, indices) from two tensors: the node a split max.dim ends in."""
    return values, indices


@attrs.frozen(kw_only=True)
class VectorNorm(Reduction):
    """`linalg_vector_norm(x, ord, dim, keepdim)` (`x.norm()`, `clip_grad_norm_`'s per-gradient
    norms). Besides the reduced dims whole, split ones: the max norm is the max of the blocks'
    (Partial(max)), the min norm their min, the 0-norm (a count) their sum; a p-norm is the
    p-th root of the sum of the blocks' norms to the p (each rank's block norm raised to p,
    all-reduced over the splitting axes, the root taken: the strategy's `inner_moves`). A
    gradient split over dp or tp is normed where it lies, its norm moved, not itself."""

    dim_arg: int | None = 2
    keepdim_arg: int | None = 3

    def strategies(self, call: OpCall) -> list[Strategy]:
        out = super().strategies(call)
        x, reduced = call.tensors[0], self.reduced_dims(call)
        ord_ = call.arg(1, "ord", 2)
        axes = tuple(a for a, p in enumerate(x.layout.placements) if isinstance(p, Shard) and p.dim in reduced)
        if not axes or x.dtype.is_complex:
            return out
        kind = {math.inf: "max", -math.inf: "min", 0: "sum"}.get(ord_)
        src = [R if isinstance(p, Partial) else p for p in x.layout.placements]
        result = [Partial(kind) if a in axes and kind else R if a in axes or isinstance(p, Partial)
                  else Shard(self.out_dim(call, p.dim, reduced)) if isinstance(p, Shard) else p
                  for a, p in enumerate(x.layout.placements)]
        order = tuple(g for g in x.layout.order if not set(g) & set(axes))
        strategy = Strategy((Layout(x.layout.mesh, tuple(src), x.layout.order),),
                            (Layout(x.layout.mesh, tuple(result), order),), note=None if kind else axes)
        return [strategy, *out]

    def inner_moves(self, call: OpCall, strategy: Strategy) -> list:
        """A p-norm's all-reduce of the blocks' norms to the p: (from, to, global shape, dtype)."""
        if not strategy.note:
            return []
        dst = strategy.outputs[0]
        src = Layout(dst.mesh, tuple(Partial("sum") if a in strategy.note else p for a, p in enumerate(dst.placements)),
                     dst.order)
        dtype = call.outputs[0].dtype
        return [(src, dst, tuple(call.outputs[0].shape), torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype)]

    def emit(self, ctx, call: OpCall, strategy: Strategy, args: tuple, kwargs: dict):
        if not strategy.note:
            return super().emit(ctx, call, strategy, args, kwargs)
        p = float(call.arg(1, "ord", 2))
        (src, dst, shape, wide), = self.inner_moves(call, strategy)  # powers and sums kept wide (16-bit norms
        dtype = call.outputs[0].dtype  # in float32), as the whole op accumulates
        local = ctx.call(call.op, args, {**kwargs, "dtype": wide})
        powered = ctx.call(aten.pow.Tensor_Scalar, (local, p))
        ctx.annotate(powered, src, shape, wide)
        ctx.consumer = (*ctx.consumer[:2], f"{call.op} over split dims: the blocks' norms to the {p:g}, summed")
        summed = ctx.redistribute(powered, src, dst, shape, wide)
        norm = ctx.call(aten.pow.Tensor_Scalar, (summed, 1.0 / p))
        return norm if wide == dtype else ctx.call(aten._to_copy.default, (norm,), {"dtype": dtype})


@attrs.frozen(kw_only=True)
class Histogram(Reduction):
    """`histc(x, bins, min, max)`: the histogram of every element. Over a fixed range the
    histogram of a split input is the sum of its blocks' histograms (Partial(sum)); with
    min == max the range is the data's own, which each block would take differently, so the
    input must be whole."""

    reduce: str | None = "sum"
    dim_arg: int | None = None
    keepdim_arg: int | None = None

    def strategies(self, call: OpCall) -> list[Strategy]:
        if call.arg(2, "min", 0) == call.arg(3, "max", 0):
            return combine_axes(call, [[replicated_option(call)] for _ in call.tensors[0].layout.placements])
        return super().strategies(call)


@attrs.frozen(kw_only=True)
class Normalize(Rule):
    """Op along some dims whose other dims pass through with their index (softmax and its
    backward, cumsum, sort, topk, flip, fft): the dims it works along must be whole on every
    rank, every other dim may be split (all tensors and outputs split alike).

    `dim_arg`: the argument naming the dim or dims (`dim_default` when absent; None: all dims).
    `pass_partials`: Partial inputs that pass through, for ops linear in their inputs jointly
    (cumsum(a1 + a2) = cumsum(a1) + cumsum(a2); flip moves data, so any Partial passes).
    """

    dim_arg: int | None = 1
    dim_default: int | None = None
    pass_partials: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def whole_dims(self, call: OpCall) -> set[int]:
        ndim = max(call.outputs[0].ndim, 1)
        dims = call.arg(self.dim_arg, default=self.dim_default) if self.dim_arg is not None else None
        if dims is None:
            return set(range(ndim))
        return {d % ndim for d in ([dims] if isinstance(dims, int) else dims)}

    def strategies(self, call: OpCall) -> list[Strategy]:
        whole, n_in, n_out = self.whole_dims(call), len(call.tensors), len(call.outputs)
        per_axis = []
        for a in range(call.mesh.ndim):
            options = [replicated_option(call)]
            for t in call.tensors:
                p = t.layout.placements[a]
                passes = isinstance(p, Partial) and p.reduce in self.pass_partials and _keeps_sums(t, call)
                if (isinstance(p, Shard) and p.dim not in whole) or passes:
                    options.insert(0, ((p,) * n_in, (p,) * n_out))
            per_axis.append(options)
        return combine_axes(call, per_axis)


@attrs.frozen(kw_only=True)
class Pad(Normalize):
    """constant_pad_nd, reflection_pad*, replication_pad*: `pad_arg` lists (before, after) pairs
    from the last dim backwards; a padded (or cropped) dim must be whole, the others pass.

    Reflection and replication pads move data, so a Partial passes (`pass_partials`); a
    constant pad is linear only with fill 0: pad(a1 + a2, 0) = pad(a1, 0) + pad(a2, 0).
    """

    dim_arg: int | None = None
    pad_arg: int = 1
    fill_arg: int | None = None

    def whole_dims(self, call: OpCall) -> set[int]:
        pad, ndim = call.arg(self.pad_arg), call.outputs[0].ndim
        return {ndim - 1 - i // 2 for i, amount in enumerate(pad) if amount != 0}

    def strategies(self, call: OpCall) -> list[Strategy]:
        linear = self.fill_arg is None or call.arg(self.fill_arg, default=0) == 0
        return Normalize.strategies(self if linear else attrs.evolve(self, pass_partials=()), call)
