"""Fused kernels where the layouts allow them: softmax and log-softmax, forward and backward,
and the embedding's backward.

Decomposed into reductions and pointwise ops, softmax shards along any dim (the
vocab-parallel loss splits log-softmax over the vocabulary, with two small all-reduces);
whole, it is one kernel, and the only way to compute exactly what eager computes (HF's eager
attention takes its softmax in float32, where any other order of the same sums rounds
differently). So capture records these ops whole, splits each into its decomposition and
remembers the group of nodes it became (`hpfun.capture.split_fused`), propagation chooses
layouts for the decomposed graph as before, and `rejoin` puts the fused op back wherever its
group runs with no collective inside: the normalized dim whole, every node of the group on
the layouts its producers have (or a block of them), and the op's own rule offering exactly
those layouts, or layouts they reach by a local move (a block cut from a replicated value).
The embedding's backward is a scatter-add into a zero table: its pieces follow what the update
needs (the table replicated, or split on the vocab), which a greedy walk offered the whole op
could not see.
"""

from __future__ import annotations

import torch

from hpfun.capture import FusedGroup
from hpfun.plan import redistribute_cost
from hpfun.propagate import op_call, tensor_inputs
from hpfun.rules import REGISTRY


def rejoin(gm: torch.fx.GraphModule, mesh, registry=REGISTRY) -> int:
    """Put each fused op back where its decomposed group needs no collective and the op's
    rule offers the group's layouts; how many were put back."""
    groups = list({id(g): g for n in gm.graph.nodes if (g := n.meta.get("hpfun_group")) is not None}.values())
    done = 0
    for group in groups:
        needs = _boundary_layouts(group)
        if needs is None:
            continue
        args = group.current_args()
        if args is None:
            continue
        out, layout = group.output, group.output.meta["hpfun_layout"]
        decomposed = (out.target, out.args, out.kwargs)
        out.target, out.args, out.kwargs = group.target, args, group.kwargs
        call = op_call(out, mesh)
        # an argument the pieces never read (nll_loss's total_weight under reduction="sum") is
        # taken as it is: no move is planned for it
        want = tuple(needs.get(p, p.meta.get("hpfun_layout")) for p in tensor_inputs(out))
        rule = registry.lookup(group.target)
        strategies = [] if rule is None or None in want else rule.strategies(call)
        match = next((s for s in strategies if s.inputs == want and s.outputs == (layout,)), None)
        inputs = tensor_inputs(out)
        if match is None and strategies and all(p.meta["val"].shape == out.meta["val"].shape for p in inputs) \
                and all(_local_move(p, w, layout) for p, w in zip(inputs, want, strict=True)):
            # or every input cut locally to the output's layout (a replicated score cut into the
            # heads its consumer splits), the fused kernel then run on the block
            cut = (layout,) * len(inputs)
            cut_call = op_call(out, mesh, cut)
            match = next((s for s in rule.strategies(cut_call) if s.inputs == cut and s.outputs == (layout,)), None)
            call = call if match is None else cut_call
        if match is None:
            out.target, out.args, out.kwargs = decomposed
            continue
        out.meta.update(hpfun_call=call, hpfun_rule=rule, hpfun_strategy=match)
        for n in reversed(group.nodes):
            if n is not out:
                gm.graph.erase_node(n)
        done += 1
    gm.recompile()
    return done


def _local_move(producer, src, dst) -> bool:
    val = producer.meta["val"]
    return src == dst or not redistribute_cost(src, dst, val.shape, val.dtype)[0]


def _boundary_layouts(group: FusedGroup) -> dict | None:
    """The layout each outside input is read in, if the group sends nothing between ranks
    inside (None if it does). A local move inside (a block cut from a replicated value the
    group made) is no reason to keep the pieces: the fused op's rule must offer the boundary
    layouts anyway, and computes the same values from them."""
    inside = set(group.nodes)
    needs: dict = {}
    for n in group.nodes:
        strategy = n.meta.get("hpfun_strategy")
        if strategy is None:
            return None
        for producer, layout in zip(tensor_inputs(n), strategy.inputs, strict=True):
            if producer in inside:
                val = producer.meta["val"]
                if redistribute_cost(producer.meta["hpfun_layout"], layout, val.shape, val.dtype)[0]:
                    return None
            elif needs.setdefault(producer, layout) != layout:
                # read in two layouts (max over the replicated scores, the rest on the heads'
                # block): both local moves from the producer's own, which the fused op then reads
                own = producer.meta["hpfun_layout"]
                if not (_local_move(producer, own, layout) and _local_move(producer, own, needs[producer])):
                    return None
                needs[producer] = own
    return needs

