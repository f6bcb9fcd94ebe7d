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

import attrs

from hpfun.layout import Partial, R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes, replicated_option

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
