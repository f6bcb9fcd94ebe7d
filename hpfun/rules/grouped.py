"""Grouped matmuls: one matmul per expert over the rows routed to it (mixture-of-experts layers).

grouped_mm(input (S, K), weight (E, K, N), offs (E,)) -> (S, N): the rows of `input` are sorted
by expert, `offs` holds the cumulative row count per expert, and row s is multiplied by the
weight of the expert it belongs to: out[s] = input[s] @ weight[e(s)]. Its backward,
grouped_mm_backward(input, weight, offs, grad) -> (grad_input (S, K), grad_weight (E, K, N)),
takes grad_input[s] = grad[s] @ weight[e(s)]^T and grad_weight[e] = input[rows of e]^T @ grad[rows of e].

What may be split, per mesh axis:
- N, the experts' output features (weight dim 2, the output's dim 1): each rank's block of
  columns is its own grouped matmul. In the backward, grad_input sums over N: Partial(sum).
- K, the input features (input dim 1, weight dim 1): each rank's block of K gives a term of
  the sum over K, Partial(sum). In the backward, grad_input and grad_weight keep K split.
- The op is linear in input and in weight (in the backward, in grad too), so one of them
  Partial with the others replicated gives Partial outputs: the outputs that depend on it.
Rows (S) and experts (E) stay whole: `offs` counts rows over the whole input and every expert,
so a block of rows or of experts would need offsets of its own.
"""

from __future__ import annotations

import math

import attrs
import torch

from hpfun.layout import Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option

aten = torch.ops.aten

_LINEAR = ("sum", "avg")


@attrs.frozen(kw_only=True)
class GroupedMm(Rule):
    def strategies(self, call: OpCall) -> list[Strategy]:
        x, w, offs = call.tensors[:3]
        per_axis = []
        for a in range(call.mesh.ndim):
            options = [
                ((R, Shard(2), R), (Shard(1),)),  # N
                ((Shard(1), Shard(1), R), (Partial("sum"),)),  # K
                replicated_option(call),
            ]
            for i, t in enumerate((x, w)):
                p = t.layout.placements[a]
                if isinstance(p, Partial) and p.reduce in _LINEAR:
                    options.append((tuple(p if j == i else R for j in range(3)), (p,)))
            per_axis.append(options)
        return combine_axes(call, per_axis)

    def work(self, call: OpCall, strategy: Strategy) -> float:
        s, k = strategy.inputs[0].local_shape(call.tensors[0].shape)
        n = strategy.outputs[0].local_shape(call.outputs[0].shape)[1]
        return float(s * k * n)


@attrs.frozen(kw_only=True)
class GroupedMmBackward(Rule):
    def strategies(self, call: OpCall) -> list[Strategy]:
        per_axis = []
        for a in range(call.mesh.ndim):
            options = [
                ((R, Shard(2), R, Shard(1)), (Partial("sum"), Shard(2))),  # N
                ((Shard(1), Shard(1), R, R), (Shard(1), Shard(1))),  # K
                replicated_option(call),
            ]
            # linear: grad_input in weight and grad, grad_weight in input and grad
            for i, outs in ((0, (R, None)), (1, (None, R)), (3, (None, None))):
                p = call.tensors[i].layout.placements[a]
                if isinstance(p, Partial) and p.reduce in _LINEAR:
                    options.append((tuple(p if j == i else R for j in range(4)), tuple(o or p for o in outs)))
            per_axis.append(options)
        return combine_axes(call, per_axis)

    def work(self, call: OpCall, strategy: Strategy) -> float:
        s, k = strategy.inputs[0].local_shape(call.tensors[0].shape)
        n = strategy.inputs[3].local_shape(call.tensors[3].shape)[1]
        return float(2 * s * k * n)


@attrs.frozen(kw_only=True)
class AtenGroupedMm(Rule):
    """torch's `_grouped_mm(self, mat2, offs=None, bias=None)` (what transformers' MoE layers call
    in bfloat16 while compiled, and its autograd backward), in its three shapes:
    - (S, K) x (E, K, N), rows grouped by `offs` -> (S, N): N or K split, as `grouped_mm` above;
    - (K, S) x (S, N), the contracted rows grouped by `offs` -> (E, K, N) (the weight's gradient):
      K or N split (S, which `offs` counts, whole);
    - (E, M, K) x (E, K, N), no offs -> (E, M, N): a batched matmul, E, M, N or K split.
    Linear in `self` and in `mat2`: one Partial with the other replicated gives a Partial output.
    `offs` stays whole; with a bias every tensor is whole."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        a, b = call.tensors[0], call.tensors[1]
        rest = len(call.tensors) - 2  # offs, bias
        has_offs = call.arg(2, "offs") is not None
        has_bias = call.arg(3, "bias") is not None
        if has_bias:
            splits = []
        elif a.ndim == 2 and b.ndim == 3 and has_offs:
            splits = [((R, Shard(2)), Shard(1)), ((Shard(1), Shard(1)), Partial("sum"))]
        elif a.ndim == 2 and b.ndim == 2 and has_offs:
            splits = [((Shard(0), R), Shard(1)), ((R, Shard(1)), Shard(2))]
        elif a.ndim == 3 and b.ndim == 3 and not has_offs:
            splits = [((Shard(0), Shard(0)), Shard(0)), ((Shard(1), R), Shard(1)), ((R, Shard(2)), Shard(2)),
                      ((Shard(2), Shard(1)), Partial("sum"))]
        else:
            splits = []
        per_axis = []
        for axis in range(call.mesh.ndim):
            options = [((*ins, *(R,) * rest), (out,)) for ins, out in splits]
            if not has_bias:
                for i, t in enumerate((a, b)):
                    p = t.layout.placements[axis]
                    if isinstance(p, Partial) and p.reduce in _LINEAR:
                        options.append((tuple(p if j == i else R for j in range(2 + rest)), (p,)))
            options.append(replicated_option(call))
            per_axis.append(options)
        return [s for s in combine_axes(call, per_axis) if self._aligned(call, s)]

    @staticmethod
    def _aligned(call: OpCall, strategy: Strategy) -> bool:
        """torch's kernel needs every stride a multiple of 16 bytes: a split dim's block must keep
        its length so (the whole dims passed in eager)."""
        pairs = [*zip(call.tensors[:2], strategy.inputs[:2]), (call.outputs[0], strategy.outputs[0])]
        for t, layout in pairs:
            local = layout.local_shape(t.shape)
            if any(n != g and n * t.dtype.itemsize % 16 for n, g in zip(local, t.shape, strict=True)):
                return False
        return True

    def emit(self, ctx, call: OpCall, strategy: Strategy, args: tuple, kwargs: dict):
        """A partial sum of 16-bit values is kept in float32 (its inputs cast up exactly), where
        torch's kernel takes only its inputs' dtype: it runs in that dtype and its output is
        cast up (each rank's product rounded once, as with reduce_dtype="compute")."""
        dtype = call.tensors[0].dtype
        wide = [isinstance(a, torch.fx.Node) and a.meta.get("hpfun_local_dtype") == torch.float32 for a in args[:2]]
        if not any(wide):
            return super().emit(ctx, call, strategy, args, kwargs)
        args = tuple(ctx.call(aten.to.dtype, (a, dtype)) if w else a for a, w in zip(args, [*wide, False, False, False]))
        return ctx.call(aten.to.dtype, (super().emit(ctx, call, strategy, args, kwargs), torch.float32))

    def work(self, call: OpCall, strategy: Strategy) -> float:
        """Multiply-adds per rank: every element of `self` meets a row of `mat2`'s columns."""
        a, b = (l.local_shape(t.shape) for l, t in zip(strategy.inputs[:2], call.tensors[:2], strict=True))
        return float(math.prod(a) * b[-1])
