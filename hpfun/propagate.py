"""Propagate: choose a strategy for every node, in graph order, by communication bytes.

For each op the registry's rule lists candidate strategies given the inputs' current layouts;
each is priced by the redistributions it needs (a layout an input already reached for another
consumer is free) plus the local work it leaves each rank (WORK_BYTES per flop or element
touched: without it, a contraction would rather gather its small operand than resolve a Partial
one, and compute unsharded from there on), and the cheapest wins (ties: fewer steps, then the
rule's order). Keeping a
Partial costs nothing now; it is resolved where a consumer needs it, which for a gradient is
where the parameter update meets the replicated parameter (bytes of the parameter, not of the
activations: the cheaper side once tokens outnumber hidden units). Results go
into `node.meta`: "hpfun_layout" (a Layout, or a tuple for multi-output ops), "hpfun_call",
"hpfun_rule" and "hpfun_strategy". Partial values stay Partial until a consumer needs otherwise.
All ops without a rule are reported together.
"""

from __future__ import annotations

import math
import operator
import warnings

import torch
from torch.utils import _pytree as pytree

from hpfun.capture import user_line
from hpfun.errors import MissingRuleError, Problem, ShardingError
from hpfun.layout import Layout
from hpfun.mesh import Mesh
from hpfun.plan import redistribute_cost
from hpfun.rules import REGISTRY, OpCall, Replicated, Strategy, TensorArg, TensorMeta


def _is_tensor_node(x) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def _outputs(node: torch.fx.Node) -> tuple[TensorMeta, ...]:
    val = node.meta.get("val")
    vals = [val] if isinstance(val, torch.Tensor) else pytree.tree_leaves(val)
    return tuple(TensorMeta(tuple(v.shape), v.dtype) for v in vals if isinstance(v, torch.Tensor))


def op_call(node: torch.fx.Node, mesh: Mesh) -> OpCall:
    """The OpCall a rule sees for `node`, from the layouts already in `node.meta`."""

    def convert(index):
        def leaf(x):
            if _is_tensor_node(x):
                val = x.meta["val"]
                return TensorArg(tuple(val.shape), val.dtype, x.meta["hpfun_layout"], index)
            return x
        return leaf

    args = tuple(pytree.tree_map(convert(i), a) for i, a in enumerate(node.args))
    kwargs = {k: pytree.tree_map(convert(len(node.args) + j), v) for j, (k, v) in enumerate(node.kwargs.items())}
    return OpCall(node.target, args, kwargs, _outputs(node), mesh)


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensor-valued argument nodes in the order of `Strategy.inputs`."""
    return [x for x in pytree.tree_leaves((node.args, node.kwargs)) if _is_tensor_node(x)]


PASSES = 2


def propagate(gm: torch.fx.GraphModule, mesh: Mesh, input_layouts: list[Layout], registry=REGISTRY,
              fallback: str | None = None) -> None:
    """Annotate every node of `gm` with its chosen strategy and layouts.

    Ops without a rule are all reported in one MissingRuleError, unless `fallback="replicate"`:
    then each runs on gathered inputs, and one warning lists every such op and the bytes its
    gathering costs per rank.

    A pass chooses in graph order, so an early consumer cannot know that a later one will
    resolve a Partial value anyway (AdamW's first moment is linear in the gradient, its second
    is not). The next pass starts knowing every layout the previous one materialized, so the
    early consumer takes the resolved value too, for free.
    """
    hint: set = set()
    for _ in range(PASSES):
        hint = _pass(gm, mesh, input_layouts, registry, set(hint), fallback)
    if fallback == "replicate":
        _warn_fallbacks(gm)


def _pass(gm, mesh: Mesh, input_layouts: list[Layout], registry, reached: set, fallback=None) -> set:
    placeholders = iter(input_layouts)
    missing: list[Problem] = []
    replicated = Layout.replicated(mesh)
    materialized: set[tuple[torch.fx.Node, Layout]] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["hpfun_layout"] = next(placeholders)
        elif node.op == "get_attr":
            node.meta["hpfun_layout"] = replicated
        elif node.op == "call_function" and node.target is operator.getitem:
            node.meta["hpfun_layout"] = node.args[0].meta["hpfun_layout"][node.args[1]]
        elif node.op == "call_function":
            rule = registry.lookup(node.target)
            call = op_call(node, mesh)
            if rule is None and fallback == "replicate":
                rule = _FALLBACK
                node.meta["hpfun_fallback"] = True
            if rule is None:
                missing.append(_missing(node, call))
                outs = (replicated,) * max(len(call.outputs), 1)
                node.meta["hpfun_layout"] = _placed(node, outs)
                continue
            strategy = _choose(node, call, rule, reached)
            for producer, layout in zip(tensor_inputs(node), strategy.inputs, strict=True):
                reached.add((producer, layout))
                materialized.add((producer, layout))
            node.meta.update(hpfun_call=call, hpfun_rule=rule, hpfun_strategy=strategy)
            node.meta["hpfun_layout"] = _placed(node, strategy.outputs)
    if missing:
        raise MissingRuleError(missing)
    return materialized


def _placed(node: torch.fx.Node, layouts: tuple):
    """A node's layout: one Layout, or for a tuple output one per element (None where it holds
    no tensor, e.g. convolution_backward's skipped grad_input), so getitem indices line up."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return layouts[0]
    tensors = iter(layouts)
    return tuple(next(tensors) if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(val))


def _choose(node, call: OpCall, rule, reached) -> Strategy:
    candidates = rule.strategies(call)
    if not candidates:
        layouts = ", ".join(t.layout.placements_str() for t in call.tensors)
        raise ShardingError(Problem(
            f"{node.target} ({node.name})", f"the rule offers no strategy for inputs {layouts}",
            "check the rule's shapes; a rule must at least offer the replicated strategy",
        ))
    producers = tensor_inputs(node)

    def price(item):
        index, strategy = item
        wire, steps = 0.0, 0
        for producer, arg, layout in zip(producers, call.tensors, strategy.inputs, strict=True):
            if (producer, layout) not in reached:
                w, s = redistribute_cost(arg.layout, layout, arg.shape, arg.dtype)
                wire, steps = wire + w, steps + s
        pending = sum(len(layout.partial_axes) for layout in strategy.outputs)  # ties: resolved outputs first
        return wire + WORK_BYTES * local_work(rule, call, strategy), steps, pending, index

    return min(enumerate(candidates), key=price)[1]


WORK_BYTES = 1.0  # cost of one flop (or element touched) per rank, in bytes of communication


def local_work(rule, call: OpCall, strategy: Strategy) -> float:
    """Work one rank does under `strategy`: the rule's estimate (flops), else elements touched."""
    if hasattr(rule, "work"):
        return rule.work(call, strategy)
    shapes = [(t.shape, l) for t, l in zip(call.tensors, strategy.inputs, strict=True)]
    shapes += [(o.shape, l) for o, l in zip(call.outputs, strategy.outputs, strict=True)]
    return float(sum(math.prod(l.local_shape(shape)) for shape, l in shapes))


_FALLBACK = Replicated(reason="no rule: fallback='replicate' runs it on gathered inputs")


def _warn_fallbacks(gm: torch.fx.GraphModule) -> None:
    lines = []
    for node in gm.graph.nodes:
        if node.meta.get("hpfun_fallback"):
            call, strategy = node.meta["hpfun_call"], node.meta["hpfun_strategy"]
            cost = sum(redistribute_cost(t.layout, l, t.shape, t.dtype)[0]
                       for t, l in zip(call.tensors, strategy.inputs, strict=True))
            line = user_line(node.meta.get("stack_trace"))
            lines.append(f"  {node.target}: gathers {cost:.0f} B per rank" + (f" ({line})" if line else ""))
    if lines:
        warnings.warn("ops without a sharding rule run replicated (fallback='replicate'):\n" + "\n".join(lines),
                      FallbackWarning, stacklevel=4)


class FallbackWarning(UserWarning):
    """Ops ran replicated because they have no sharding rule (fallback='replicate')."""


def _missing(node, call: OpCall) -> Problem:
    layouts = ", ".join(t.layout.placements_str() for t in call.tensors) or "no tensor inputs"
    line = user_line(node.meta.get("stack_trace"))
    return Problem(
        f"{node.target}",
        f"no sharding rule (inputs {layouts})" + (f", from {line}" if line else ""),
        "add a YAML entry (see rules/README.md) or hpfun.rules.register(op, rule)",
    )
