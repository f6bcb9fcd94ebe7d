"""The NLL loss's backward, kept whole where it needs nothing from other ranks.

nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)
writes -weight[target] * grad_output (over total_weight with mean reduction) into each row's
target class and zero elsewhere. A split batch (self's dim 0, target's, and grad_output's where
it is per row) is local: each row reads only its own target, and total_weight, the sum over
the whole batch, comes in replicated. A split class dim is not: a rank's kernel cannot place a
target outside its block. Capture records the op whole, splits it into gather/scatter pieces
(`hpfun.capture.FUSED`) whose rules also shard the classes (the vocab-parallel loss), and
`hpfun.fuse` puts the kernel back where this rule offers the layouts the pieces ran in.
"""

from __future__ import annotations

import attrs

from hpfun.layout import R, Shard
from hpfun.rules.base import OpCall, Rule, Strategy, combine_axes


@attrs.frozen(kw_only=True)
class NllLossBackward(Rule):
    def strategies(self, call: OpCall) -> list[Strategy]:
        grad, logits, target, total = call.tensors[0], call.tensors[1], call.tensors[2], call.tensors[-1]
        mean = call.arg(4) == 1  # only the mean reads total_weight; otherwise it may be anything
        per_axis = []
        for a in range(call.mesh.ndim):
            unread = {} if mean else {id(total): total.layout.placements[a]}
            options = [(tuple(unread.get(id(t), R) for t in call.tensors), (R,))]
            if logits.ndim == 2:  # (N, C); an unbatched (C,) input has no rows to split
                rows = {id(logits), id(target)} | ({id(grad)} if grad.ndim == 1 else set())  # "none": per row
                ins = tuple(Shard(0) if id(t) in rows else unread.get(id(t), R) for t in call.tensors)
                options.insert(0, (ins, (Shard(0),)))
            per_axis.append(options)
        return combine_axes(call, per_axis)
