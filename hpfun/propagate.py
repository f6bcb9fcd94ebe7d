"""Propagate: choose a strategy for every node by communication bytes and local work.

For each op the registry's rule lists candidate strategies given the inputs' current layouts;
each is priced by the redistributions it needs (a layout an input already reached for another
consumer is free) plus the local work it leaves each rank (WORK_BYTES per flop or element
touched: without it, a contraction would rather gather its small operand than resolve a Partial
one, and compute unsharded from there on), and the cheapest wins (ties: fewer steps, then the
rule's order). Keeping a Partial costs nothing at the op; where it is resolved is settled for
the whole graph by a minimum cut, and a few look-ahead rounds let producers see what their
consumers asked for (see `propagate`). Results go into `node.meta`: "hpfun_layout" (a Layout,
or a tuple for multi-output ops), "hpfun_call", "hpfun_rule" and "hpfun_strategy". All ops
without a rule are reported together.
"""

from __future__ import annotations

import math
import operator
import warnings

import attrs
import torch
from torch.utils import _pytree as pytree

from hpfun.capture import user_line
from hpfun.errors import MissingRuleError, Problem, ShardingError
from hpfun.layout import Layout, Partial, R
from hpfun.mesh import Mesh
from hpfun.plan import redistribute_cost
from hpfun.rules import REGISTRY, OpCall, Replicated, Strategy, TensorArg, TensorMeta, keep_orders


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
LOOKAHEAD = 3


def propagate(gm: torch.fx.GraphModule, mesh: Mesh, input_layouts: list[Layout], registry=REGISTRY,
              fallback: str | None = None, reduce_dtype: str = "float32") -> None:
    """Annotate every node of `gm` with its chosen strategy and layouts.

    Communication is priced as it will be lowered: under `reduce_dtype="float32"` a sum of
    bfloat16/float16 partials moves in float32 (`hpfun.collectives.moved_dtype`).

    Ops without a rule are all reported in one MissingRuleError, unless `fallback="replicate"`:
    then each runs on gathered inputs, and one warning lists every such op and the bytes its
    gathering costs per rank.

    A pass chooses in graph order, so an early consumer cannot know that a later one will
    resolve a Partial value anyway (AdamW's first moment is linear in the gradient, its second
    is not). The next pass starts knowing every layout the previous one materialized, so the
    early consumer takes the resolved value too, for free.

    Choosing in graph order also keeps a Partial value lazy through every linear consumer, which
    is right for one hop and can be wrong for many: a vocab-parallel head's input gradient is
    linear all the way back, so kept lazy it reaches every weight's gradient, and each of those is
    resolved where the update needs it. Where to resolve is a minimum cut (`partial_cuts`): after
    the greedy passes, the values kept Partial on a mesh axis form a graph from where the sum was
    created to where a consumer needed it resolved, and the cheapest set of values to resolve
    instead is found per axis; the greedy passes then run again with those values resolved. The
    annotation with the lower total price is kept, so the cut can only help.

    Last, up to LOOKAHEAD rounds that look one step ahead: each strategy is also charged for
    moving its output to the layouts its consumers asked for in the previous annotation (a
    matmul whose consumer re-split its output by all-to-all would rather gather its other
    operand), and an op whose consumers asked for a split of a replicated output is offered
    the strategies of its rule for that input taken split (taking a block moves nothing), so
    an embedding's gradient is accumulated only for the rank's rows of a vocab-split table.
    Each round keeps the cheaper annotation by the true price (without the look-ahead charge).
    """
    memo: dict = {}  # (node, input layouts) -> the rule's strategies: rules are pure

    def greedy(resolve, wanted) -> tuple[float, dict]:
        hint: set = set()
        for _ in range(PASSES):
            hint, total, requested = _pass(gm, mesh, input_layouts, registry, set(hint), fallback, resolve, wanted, memo,
                                           reduce_dtype)
        return total, requested

    total, requested = greedy({}, {})
    best = (total, {}, {}, _snapshot(gm))  # price, values to resolve, layouts asked for, annotation
    resolve = partial_cuts(gm, mesh, reduce_dtype)
    if not _already_resolved(gm, resolve):
        total, cut_requested = greedy(resolve, {})
        if total < best[0]:  # the cut's model is per axis: keep it only where it helped
            best, requested = (total, resolve, {}, _snapshot(gm)), cut_requested
    for _ in range(LOOKAHEAD):  # each round moves a wanted layout one producer further back
        if not requested or requested == best[2]:  # nothing (new) asked for: the same annotation
            break
        total, next_requested = greedy(best[1], requested)
        if total >= best[0]:
            break
        best, merged = (total, best[1], requested, _snapshot(gm)), {v: set(asked) for v, asked in requested.items()}
        for v, asked in next_requested.items():  # what any round asked for
            merged.setdefault(v, set()).update(asked)
        requested = merged
    _restore(gm, best[3])
    if fallback == "replicate":
        _warn_fallbacks(gm)


_ANNOTATION = ("hpfun_layout", "hpfun_call", "hpfun_rule", "hpfun_strategy", "hpfun_fallback")


def _snapshot(gm: torch.fx.GraphModule) -> dict:
    return {node: {k: node.meta[k] for k in _ANNOTATION if k in node.meta} for node in gm.graph.nodes}


def _restore(gm: torch.fx.GraphModule, snapshot: dict) -> None:
    for node in gm.graph.nodes:
        for k in _ANNOTATION:
            node.meta.pop(k, None)
        node.meta.update(snapshot[node])


def _pass(gm, mesh: Mesh, input_layouts: list[Layout], registry, reached: set, fallback=None,
          resolve=None, wanted=None, memo=None, reduce_dtype: str = "float32") -> tuple[set, float, dict]:
    """One greedy pass in graph order; returns the layouts it materialized, its total price
    (bytes moved, including resolving Partial outputs, plus weighted local work) and, per
    value, the other layouts its consumers asked for."""
    placeholders = iter(input_layouts)
    missing: list[Problem] = []
    replicated = Layout.replicated(mesh)
    materialized: set[tuple[torch.fx.Node, Layout]] = set()
    requested: dict[torch.fx.Node, set[Layout]] = {}
    total = 0.0
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
            strategy, call = _choose(node, call, rule, reached, resolve or {}, wanted or {}, {} if memo is None else memo,
                                     reduce_dtype)
            total += WORK_BYTES * local_work(rule, call, strategy)
            for producer, layout in zip(tensor_inputs(node), strategy.inputs, strict=True):
                reached.add((producer, layout))
                materialized.add((producer, layout))
                if layout != producer.meta["hpfun_layout"] and producer.op == "call_function":
                    requested.setdefault(producer, set()).add(layout)
            node.meta.update(hpfun_call=call, hpfun_rule=rule, hpfun_strategy=strategy)
            node.meta["hpfun_layout"] = _placed(node, strategy.outputs)
        elif node.op == "output":
            for value in tensor_inputs(node):
                for a in value.meta["hpfun_layout"].partial_axes:
                    total += _resolve_bytes(value, a, reduce_dtype)
    if missing:
        raise MissingRuleError(missing)
    for producer, layout in materialized:  # each layout a value reaches is paid for once
        val = producer.meta["val"]
        total += redistribute_cost(producer.meta["hpfun_layout"], layout, tuple(val.shape), val.dtype, reduce_dtype)[0]
    return materialized, total, requested


def _already_resolved(gm: torch.fx.GraphModule, resolve: dict) -> bool:
    """Whether every consumer of every value in `resolve` already takes it resolved."""
    for node in gm.graph.nodes:
        strategy = node.meta.get("hpfun_strategy")
        if strategy is None:
            continue
        for producer, layout in zip(tensor_inputs(node), strategy.inputs, strict=True):
            if any(isinstance(layout.placements[a], Partial) for a in resolve.get(producer, ())):
                return False
    return True


def _resolve_bytes(value: torch.fx.Node, axis: int, reduce_dtype: str = "float32") -> float:
    """Bytes one rank sends to all-reduce `value`'s Partial on mesh axis `axis`."""
    layout, val = value.meta["hpfun_layout"], value.meta["val"]
    return redistribute_cost(layout, layout.with_placement(axis, R), tuple(val.shape), val.dtype, reduce_dtype)[0]


def _partial_on(value, axis: int) -> bool:
    layout = value.meta.get("hpfun_layout")
    return isinstance(layout, Layout) and isinstance(layout.placements[axis], Partial)


def partial_cuts(gm: torch.fx.GraphModule, mesh: Mesh, reduce_dtype: str = "float32") -> dict[torch.fx.Node, frozenset[int]]:
    """Per value, the mesh axes on which its Partial should be resolved where it is produced.

    For each mesh axis, from the current annotation: a value kept Partial flows from its source
    (an op that created the sum, or an input) through consumers that keep it Partial, to consumers
    (or outputs) that need it resolved. Each value is a node with capacity the bytes of
    resolving it; a minimum S-T vertex cut is the cheapest set of values to resolve so that no
    unresolved sum reaches a consumer that needs it resolved.
    """
    import networkx as nx  # a dependency of torch: max-flow/min-cut, well tested

    resolve: dict[torch.fx.Node, set[int]] = {}
    for a, size in enumerate(mesh.shape):
        if size == 1:
            continue
        g = nx.DiGraph()
        for node in gm.graph.nodes:
            if node.op == "placeholder" and _partial_on(node, a):
                g.add_edge("S", ("in", node))
                g.add_edge(("in", node), ("out", node), capacity=_resolve_bytes(node, a, reduce_dtype) + 1)
            elif node.op == "output":
                for value in tensor_inputs(node):
                    if _partial_on(value, a):
                        g.add_edge(("out", value), "T")
            elif node.op == "call_function" and "hpfun_strategy" in node.meta:
                kept, needs = [], []
                for producer, layout in zip(tensor_inputs(node), node.meta["hpfun_strategy"].inputs, strict=True):
                    if _partial_on(producer, a):
                        (kept if isinstance(layout.placements[a], Partial) else needs).append(producer)
                for producer in needs:
                    g.add_edge(("out", producer), "T")
                for value in _output_values(node):
                    if value is None or not _partial_on(value, a):
                        continue
                    capacity = _resolve_bytes(value, a, reduce_dtype) + 1  # +1: fewer collectives on ties
                    g.add_edge(("in", value), ("out", value), capacity=capacity)
                    for producer in kept or ["S"]:
                        g.add_edge(producer if producer == "S" else ("out", producer), ("in", value))
        if "S" not in g or "T" not in g or not nx.has_path(g, "S", "T"):
            continue
        _, (source_side, _) = nx.minimum_cut(g, "S", "T")
        for key in source_side:
            if key != "S" and key[0] == "in" and ("out", key[1]) not in source_side:
                resolve.setdefault(key[1], set()).add(a)
    return {value: frozenset(axes) for value, axes in resolve.items()}


def _placed(node: torch.fx.Node, layouts: tuple):
    """A node's layout: one Layout, or for a tuple output one per element (None where it holds
    no tensor, e.g. convolution_backward's skipped grad_input), so getitem indices line up."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return layouts[0]
    tensors = iter(layouts)
    return tuple(next(tensors) if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(val))


def _choose(node, call: OpCall, rule, reached, resolve, wanted, memo, reduce_dtype="float32") -> tuple[Strategy, OpCall]:
    """The cheapest strategy, and the call its rule saw. Inputs in `resolve` must arrive
    without Partial on the axes listed there, when the rule offers such a strategy. With
    `wanted` (layouts the consumers asked for, per value), a strategy is also charged for
    reaching those from its outputs, and `_hinted` strategies are offered too."""
    producers = memo.get(("inputs", node))
    if producers is None:
        producers = memo[("inputs", node)] = tensor_inputs(node)
    candidates = _strategies(node, call, rule, memo, tuple(p.meta["hpfun_layout"] for p in producers))
    if not candidates:
        layouts = ", ".join(t.layout.placements_str() for t in call.tensors)
        raise ShardingError(Problem(
            f"{node.target} ({node.name})", f"the rule offers no strategy for inputs {layouts}",
            "check the rule's shapes; a rule must at least offer the replicated strategy",
        ))
    options = [(strategy, call) for strategy in candidates]
    if wanted:
        options += _hinted(node, call, rule, wanted, memo)
    if resolve:
        def resolves(option):
            return not any(isinstance(layout.placements[a], Partial)
                           for producer, layout in zip(producers, option[0].inputs, strict=True)
                           for a in resolve.get(producer, ()))
        options = [o for o in options if resolves(o)] or options

    def price(item):
        index, (strategy, _) = item
        wire, steps = 0.0, 0
        for producer, arg, layout in zip(producers, call.tensors, strategy.inputs, strict=True):
            if (producer, layout) not in reached:
                w, s = redistribute_cost(arg.layout, layout, arg.shape, arg.dtype, reduce_dtype)
                wire, steps = wire + w, steps + s
        pending = sum(len(layout.partial_axes) for layout in strategy.outputs)  # ties: resolved outputs first
        return wire + WORK_BYTES * local_work(rule, call, strategy), steps, pending, index

    values = _output_values(node) if wanted else []

    def ahead(item):
        own = price(item)
        onward = sum(redistribute_cost(layout, want, out.shape, out.dtype, reduce_dtype)[0]
                     for value, layout, out in zip(values, item[1][0].outputs, call.outputs)
                     if value is not None for want in wanted.get(value, ()) if want != layout)
        return (own[0] + onward,) + own[1:]

    return min(enumerate(options), key=ahead if values else price)[1]


def _strategies(node, call: OpCall, rule, memo: dict, layouts=None) -> list[Strategy]:
    """`rule.strategies(call)` with their variants in the inputs' axis orders (`keep_orders`),
    remembered per node and input `layouts` (those of `call`)."""
    key = (node, layouts if layouts is not None else tuple(t.layout for t in call.tensors))
    if key not in memo:
        memo[key] = keep_orders(call, rule.strategies(call))  # rules list mesh order; inputs keep theirs
    return memo[key]


def _hinted(node, call: OpCall, rule, wanted, memo) -> list[tuple[Strategy, OpCall]]:
    """Strategies giving an output layout the consumers asked for, from the rule's view of an
    input of the output's shape taken in that layout, where taking it moves nothing (a block of
    a replicated input); each with the call the rule saw, which is what reaches `emit`, since
    the strategy takes that input in that layout."""
    values = _output_values(node)
    if len(values) != 1 or values[0] not in wanted:
        return []
    out, found = call.outputs[0], []
    for want in wanted[values[0]]:
        if want.partial_axes:
            continue
        for i, t in enumerate(call.tensors):
            if t.shape != out.shape or t.layout == want or redistribute_cost(t.layout, want, t.shape, t.dtype)[0]:
                continue
            hypothetical = _with_layout(call, i, want)
            try:
                options = _strategies(node, hypothetical, rule, memo)
            except ShardingError:
                continue
            found += [(s, hypothetical) for s in options if s.outputs[0] == want and s.inputs[i] == want]
    return found


def _with_layout(call: OpCall, position: int, layout: Layout) -> OpCall:
    """`call` with its tensor argument number `position` (flattening order) in `layout`."""
    count = iter(range(1 << 30))

    def swap(x):
        if isinstance(x, TensorArg) and next(count) == position:
            return attrs.evolve(x, layout=layout)
        return x

    args, kwargs = pytree.tree_map(swap, (call.args, call.kwargs))
    return attrs.evolve(call, args=args, kwargs=kwargs)


def _output_values(node: torch.fx.Node) -> list:
    """Per tensor output of `node`, the node that holds it (None for an unused tuple element)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [node]
    by_index = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    leaves = pytree.tree_leaves(val)
    return [by_index.get(i) for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]


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
