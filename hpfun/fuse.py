"""Fused kernels where the layouts allow them: softmax and log-softmax, forward and backward.

Decomposed into reductions and pointwise ops, softmax shards along any dim (the
vocab-parallel loss splits log-softmax over the vocabulary, with two small all-reduces);
whole, it is one kernel, and the only way to compute exactly what eager computes (HF's eager
attention takes its softmax in float32, where any other order of the same sums rounds
differently). So capture records these ops whole, `split` rewrites each into its
decomposition and remembers the group of nodes it became, propagation chooses layouts for
the decomposed graph as before, and `rejoin` puts the fused op back wherever its group runs
with no collective inside: the normalized dim whole, every node of the group on the layouts
its producers have, and the op's own rule offering exactly those layouts.
"""

from __future__ import annotations

import functools

import attrs
import torch
from torch._decomp import get_decompositions

from hpfun.rules import REGISTRY

aten = torch.ops.aten

FUSED = (aten._softmax.default, aten._log_softmax.default,
         aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)


@attrs.define(eq=False)
class _Group:
    """The nodes one fused op became, and how to call it again."""

    target: object
    args: tuple
    kwargs: dict
    meta: dict
    nodes: list = attrs.Factory(list)
    output: torch.fx.Node | None = None
    # per tensor argument, a group node reading it and at which of its tensor inputs: later
    # passes (folding matmuls into einsums) may replace the argument's node, never the probe
    probes: list = attrs.Factory(list)

    def current_args(self, tensor_inputs) -> tuple | None:
        found = []
        for probe in self.probes:
            if probe is None:
                return None
            node, index = probe
            found.append(tensor_inputs(node)[index])
        it = iter(found)
        return tuple(next(it) if _is_tensor_node(a) else a for a in self.args)


def _is_tensor_node(x) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def split(gm: torch.fx.GraphModule) -> None:
    """Rewrite every fused op of `gm` into its decomposition, each group tagged for `rejoin`.
    The op's own node becomes the decomposition's last op, so it keeps its name and users."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in FUSED:
            continue
        tensors = [a for a in node.args if _is_tensor_node(a)]
        sub = _decomposition(node.target, tuple((tuple(t.meta["val"].shape), t.meta["val"].dtype) for t in tensors),
                             tuple(None if _is_tensor_node(a) else a for a in node.args))
        last = sub.graph.output_node().args[0][0]
        if last.op != "call_function":
            continue  # nothing to split (a decomposition that returns an input as it is)
        group = _Group(node.target, node.args, dict(node.kwargs), dict(node.meta), output=node)
        env, feeds, placeholders = {}, iter(tensors), []
        with gm.graph.inserting_before(node):
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    env[n] = next(feeds)
                    placeholders.append(n)
                elif n is last:
                    node.target = n.target
                    node.args, node.kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                    node.meta["hpfun_group"] = group
                    env[n] = node
                elif n.op == "call_function":
                    new = gm.graph.node_copy(n, env.__getitem__)
                    for key in ("stack_trace", "nn_module_stack"):
                        if key in node.meta:
                            new.meta[key] = node.meta[key]
                    new.meta["hpfun_group"] = group
                    env[n] = new
        group.nodes = [env[n] for n in sub.graph.nodes if n.op == "call_function"]
        group.probes = [_probe(p, env) for p in placeholders]
    gm.recompile()


def _probe(placeholder, env) -> tuple | None:
    from hpfun.propagate import tensor_inputs

    for user in placeholder.users:
        if user.op == "call_function":
            return env[user], [x for x in tensor_inputs(user)].index(placeholder)
    return None


@functools.lru_cache(maxsize=256)
def _decomposition(target, metas: tuple, static_args: tuple) -> torch.fx.GraphModule:
    """The fused op's decomposition into core ops, traced once per op, shapes and arguments."""
    from hpfun.capture import capture

    decompose = get_decompositions([target])[target]

    def run(*tensors):
        it = iter(tensors)
        return [decompose(*[next(it) if a is None else a for a in static_args])]

    return capture(run, list(metas))


def rejoin(gm: torch.fx.GraphModule, mesh, registry=REGISTRY) -> int:
    """Put each fused op back where its decomposed group needs no collective and the op's
    rule offers the group's layouts; how many were put back."""
    from hpfun.propagate import op_call, tensor_inputs

    groups = list({id(g): g for n in gm.graph.nodes if (g := n.meta.get("hpfun_group")) is not None}.values())
    done = 0
    for group in groups:
        needs = _boundary_layouts(group, tensor_inputs)
        if needs is None:
            continue
        args = group.current_args(tensor_inputs)
        if args is None:
            continue
        out, layout = group.output, group.output.meta["hpfun_layout"]
        decomposed = (out.target, out.args, out.kwargs)
        out.target, out.args, out.kwargs = group.target, args, group.kwargs
        call = op_call(out, mesh)
        want = tuple(needs.get(p) for p in tensor_inputs(out))
        rule = registry.lookup(group.target)
        match = None if rule is None or None in want else next(
            (s for s in rule.strategies(call) if s.inputs == want and s.outputs == (layout,)), None)
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


def _boundary_layouts(group: _Group, tensor_inputs) -> dict | None:
    """The layout each outside input is read in, if the group moves no data inside (None if it does)."""
    inside = set(group.nodes)
    needs: dict = {}
    for n in group.nodes:
        strategy = n.meta.get("hpfun_strategy")
        if strategy is None:
            return None
        for producer, layout in zip(tensor_inputs(n), strategy.inputs, strict=True):
            if producer in inside:
                if layout != producer.meta["hpfun_layout"]:
                    return None
            elif needs.setdefault(producer, layout) != layout:
                return None
    return needs

