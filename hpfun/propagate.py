"""Propagate: choose a strategy for every node by communication bytes and local work.

`solve` is a pure function: it takes the graph, the mesh, the inputs' layouts and the outputs'
wanted layouts (out_specs; pins are ops of their own, see rules/constrain.yaml) and returns an
`Annotation`, one `NodePlan` per node (strategy, the call its rule saw, layouts). `propagate`
writes it into `node.meta` once, at the end: "hpfun_layout" (a Layout, or a tuple for
multi-output ops), "hpfun_call", "hpfun_rule" and "hpfun_strategy".

For each op the registry's rule lists candidate strategies given the inputs' layouts; each is
priced in seconds by the cost model (`hpfun.plan.CostModel`, the price `Lowered.cost()` reports
too): the redistributions it needs (a layout an input already reached for another consumer is
free) plus the local work it leaves each rank (flops, or elements touched: without it, a
contraction would rather gather its small operand than resolve a Partial one, and compute
unsharded from there on), and the cheapest wins (ties: fewer steps, then the rule's order).
With `exact=True` the greedy plan is then improved on by one integer program over every op's
candidates (`hpfun.exact`). Reaching each output's out_spec is priced too. Keeping a Partial costs nothing
at the op; where it is resolved is settled for the whole graph by a minimum cut, and a few
look-ahead rounds let producers see what their consumers asked for (see `solve`). All ops
without a rule are reported together.

A rule's answer depends only on the op, its arguments' shapes and dtypes and the inputs'
layouts, so it is asked once per distinct question: the identical layers of a deep model ask
the same questions, and propagation costs little more per layer than walking it.
"""

from __future__ import annotations

import math
import operator
import warnings

import attrs
import torch
from torch.utils import _pytree as pytree
from torch.fx.node import map_arg

from hpfun.annotation import Annotation, NodePlan, placed
from hpfun.capture import user_line
from hpfun.exact import refine
from hpfun.errors import MissingRuleError, Problem, ShardingError, user_stacklevel
from hpfun.layout import Layout, Partial, R
from hpfun.mesh import Mesh
from hpfun.plan import CostModel, redistribute_cost, redistribute_plan, redistribute_seconds
from hpfun.rules import REGISTRY, OpCall, Replicated, Strategy, TensorArg, TensorMeta, keep_orders


def _is_tensor_node(x) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def _outputs(node: torch.fx.Node) -> tuple[TensorMeta, ...]:
    val = node.meta.get("val")
    vals = [val] if isinstance(val, torch.Tensor) else pytree.tree_leaves(val)
    return tuple(TensorMeta(tuple(v.shape), v.dtype) for v in vals if isinstance(v, torch.Tensor))


def op_call(node: torch.fx.Node, mesh: Mesh, layouts: tuple | None = None) -> OpCall:
    """The OpCall a rule sees for `node`, from the layouts already in `node.meta` (or its
    inputs in `layouts`)."""
    site = _Site(node, None, mesh)
    return site.call(tuple(p.meta["hpfun_layout"] for p in site.producers) if layouts is None else layouts)


def _passed(src: Layout, dst: Layout, producer: torch.fx.Node) -> list[Layout]:
    """The layouts a value passes on its way from `src` to `dst` (lowering keeps each: a later
    consumer wanting one starts there, `LowerContext.redistribute`'s `passed`)."""
    val = producer.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return []
    out, layout = [], src
    for step in redistribute_plan(src, dst, tuple(val.shape))[:-1]:
        layout = step.apply(layout)
        out.append(layout)
    return out


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensor-valued argument nodes in the order of `Strategy.inputs` (argument order, nested
    containers depth first: fx's own walk, in C++, cheaper than a pytree one)."""
    found: list = []
    map_arg((node.args, node.kwargs), found.append)
    return [x for x in found if isinstance(x.meta.get("val"), torch.Tensor)]


PASSES = 2
LOOKAHEAD = 3


def propagate(gm: torch.fx.GraphModule, mesh: Mesh, input_layouts: list[Layout], registry=REGISTRY,
              fallback: str | None = None, reduce_dtype: str = "float32",
              outputs: list[Layout | None] | None = None, cost_model: CostModel | None = None,
              exact: bool | None = None, refine_with=None) -> Annotation:
    """Solve (`solve`) and write the annotation into `gm`'s nodes; returns it."""
    annotation = solve(gm, mesh, input_layouts, registry, fallback, reduce_dtype, outputs, cost_model, exact,
                       refine_with)
    annotation.write(gm)
    if fallback == "replicate":
        _warn_fallbacks(gm)
    return annotation


def solve(gm: torch.fx.GraphModule, mesh: Mesh, input_layouts: list[Layout], registry=REGISTRY,
          fallback: str | None = None, reduce_dtype: str = "float32",
          outputs: list[Layout | None] | None = None, cost_model: CostModel | None = None,
          exact: bool | None = None, refine_with=None) -> Annotation:
    """Choose every node's strategy; `gm` is not modified.

    `refine_with(graph, greedy annotation)`, when given, replaces the exact stage (automatic
    sharding, `hpfun.auto`, opens the inputs' layouts there); it returns an annotation or None.

    `outputs`: the layout each graph output must be delivered in (None: as computed, with any
    Partial resolved), priced like any other redistribution. Communication is priced as it will
    be lowered: under `reduce_dtype="float32"` a sum of bfloat16/float16 partials moves in
    float32 (`hpfun.collectives.moved_dtype`).

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
    graph = _Graph(gm, mesh, input_layouts, registry, fallback, reduce_dtype, outputs, cost_model or CostModel())
    best, requested = graph.greedy({}, {})
    resolve: dict = {}
    cut = partial_cuts(gm, mesh, best, reduce_dtype, outputs, graph.model)
    if not _already_resolved(best, cut):
        annotation, cut_requested = graph.greedy(cut, {})
        if annotation.price < best.price:  # the cut's model is per axis: keep it only where it helped
            best, resolve, requested = annotation, cut, cut_requested
    asked: dict = {}
    for _ in range(LOOKAHEAD):  # each round moves a wanted layout one producer further back
        if not requested or requested == asked:  # nothing (new) asked for: the same annotation
            break
        annotation, next_requested = graph.greedy(resolve, requested)
        if annotation.price >= best.price:
            break
        best, asked = annotation, requested
        merged = {v: set(layouts) for v, layouts in requested.items()}
        for v, layouts in next_requested.items():  # what any round asked for
            merged.setdefault(v, set()).update(layouts)
        requested = merged
    if refine_with is not None:
        best = refine_with(graph, best) or best
    elif exact:
        best = refine(graph, best) or best
    return best


# ---------------------------------------------------------------------------------------------
# The greedy walk
# ---------------------------------------------------------------------------------------------


class _Site:
    """What a node's rule is asked, built once: its tensor inputs, and the call for any input
    layouts. `key` names the question without the node, so identical layers share answers."""

    __slots__ = ("node", "rule", "fallback", "producers", "mesh", "_leaves", "_shape", "_slots", "outputs", "key",
                 "values", "kind", "single", "same", "asked")

    def __init__(self, node: torch.fx.Node, rule, mesh: Mesh, fallback: bool = False):
        self.node, self.rule, self.fallback, self.mesh = node, rule, fallback, mesh
        leaves, owners = [], []
        self._shape = (tuple(_flatten(a, leaves, owners, i) for i, a in enumerate(node.args)), tuple(node.kwargs),
                       tuple(_flatten(v, leaves, owners, len(node.args) + j) for j, v in enumerate(node.kwargs.values())))
        self._leaves, self._slots, self.producers = leaves, [], []
        for pos, x in enumerate(leaves):
            if _is_tensor_node(x):
                val = x.meta["val"]
                self._slots.append((pos, tuple(val.shape), val.dtype, owners[pos]))
                self.producers.append(x)
        self.outputs = _outputs(node)
        self.single = isinstance(node.meta.get("val"), torch.Tensor)  # one tensor out: its layout is the first
        self.values = _output_values(node)
        tensors = {pos: slot for pos, *slot in self._slots}
        key = (node.target, self._shape, self.outputs,  # a Python scalar's type too: True, 1 and 1.0 hash alike
               tuple(("tensor", *tensors[i]) if i in tensors else (type(x), x) for i, x in enumerate(leaves)))
        try:
            hash(key)
        except TypeError:  # an unhashable argument (a slice): this node asks alone
            key = (node,)
        self.key = key
        self.kind = None  # the key's number in its graph (`_Graph`)
        self.same = any(node.target is op for op in SAME_VALUE)  # (by identity: an op's hash is Python code)
        self.asked = None  # in a `_Graph`: every input layouts the rule was asked about

    def call(self, layouts: tuple) -> OpCall:
        leaves = list(self._leaves)
        for (pos, shape, dtype, index), layout in zip(self._slots, layouts, strict=True):
            leaves[pos] = TensorArg(shape, dtype, layout, index)
        it, (positional, names, keywords) = iter(leaves), self._shape
        args = tuple(_unflatten(a, it) for a in positional)
        kwargs = {name: _unflatten(v, it) for name, v in zip(names, keywords, strict=True)}
        return OpCall(self.node.target, args, kwargs, self.outputs, self.mesh)


def _flatten(x, leaves: list, owners: list, owner: int):
    """`x`'s leaves appended to `leaves` (and `owner`, the top-level argument holding them, to
    `owners`); returns its structure. Node arguments nest only tuples, lists and dicts: this is
    cheaper than a pytree walk, and the structure is a plain hashable tuple."""
    if isinstance(x, (tuple, list)):
        return ("list" if isinstance(x, list) else "tuple", tuple(_flatten(v, leaves, owners, owner) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple(x), tuple(_flatten(v, leaves, owners, owner) for v in x.values()))
    leaves.append(x)
    owners.append(owner)
    return None


def _unflatten(shape, it):
    if shape is None:
        return next(it)
    if shape[0] == "dict":
        return {k: _unflatten(s, it) for k, s in zip(shape[1], shape[2], strict=True)}
    items = [_unflatten(s, it) for s in shape[1]]
    return items if shape[0] == "list" else tuple(items)


@attrs.frozen(eq=False)
class _Options:
    """A rule's answer for one call: the call and its strategies, each as (strategy, its work
    price, the moves it needs of its inputs as (input, layout, seconds, steps), how many Partial
    outputs it leaves): all a walk needs to price it, computed once."""

    call: OpCall
    strategies: tuple[tuple[Strategy, float, tuple, int], ...]
    # the same, as the walk weighs them: (strategy, call, work, moves, pending)
    options: list = attrs.field(init=False)
    # the option a walk chooses whatever layouts were reached, if one is:
    # a strategy moving nothing that is cheaper than every other's work alone (a walk's price of
    # an option is its work plus its moves not yet reached; `_Graph._choose`)
    settled: tuple | None = attrs.field(init=False)

    def __attrs_post_init__(self):
        options = [(s, self.call, w, moves, pending) for s, w, moves, pending in self.strategies]
        object.__setattr__(self, "options", options)
        settled = None
        if len(options) > 1:
            still = [(w, 0, pending, i) for i, (_, _, w, moves, pending) in enumerate(options) if not moves]
            if still:
                best = min(still)
                if all(best < (w, 0, pending, i) for i, (_, _, w, moves, pending) in enumerate(options) if moves):
                    settled = options[best[3]]
        object.__setattr__(self, "settled", settled)


_PLACEHOLDER, _GET_ATTR, _GETITEM, _OP, _OUTPUT, _OTHER = range(6)


def _step(node: torch.fx.Node) -> int:
    """What a walk does at `node`."""
    if node.op == "call_function":
        return _GETITEM if node.target is operator.getitem else _OP
    return {"placeholder": _PLACEHOLDER, "get_attr": _GET_ATTR, "output": _OUTPUT}.get(node.op, _OTHER)


class _Graph:
    """The graph prepared for greedy passes: one site per op, and the rules' answers, asked once."""

    def __init__(self, gm, mesh: Mesh, input_layouts, registry, fallback, reduce_dtype, outputs, model: CostModel):
        self.mesh, self.reduce_dtype, self.model = mesh, reduce_dtype, model
        self.nodes = list(gm.graph.nodes)
        self.input_layouts = list(input_layouts)
        self.sites: dict = {}
        self._answers: dict = {}
        # (id(strategy), id(call)) of an answer -> its NodePlan (both held by `_answers`: ids stay theirs)
        self._nodeplans: dict = {}
        self.asked: dict = {}  # per op node, every input layouts its rule was asked about
        kinds: dict = {}
        rules: dict = {}  # id(op) -> its rule, looked up once per op (an op's own hash is Python code)
        for node in self.nodes:
            if node.op == "call_function" and node.target is not operator.getitem:
                key = id(node.target)
                rule = rules[key] if key in rules else rules.setdefault(key, registry.lookup(node.target))
                # (not a random op: each rank would draw its own numbers where the layout says one value)
                fell = rule is None and fallback == "replicate" and \
                    torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())
                site = self.sites[node] = _Site(node, _FALLBACK if fell else rule, mesh, fell)
                site.kind = kinds.setdefault(site.key, len(kinds))  # hashing the key once, not per question
                site.asked = self.asked.setdefault(node, {})
        # what a walk does at each node, decided once: (node, step, its site)
        self.steps = [(node, _step(node), self.sites.get(node)) for node in self.nodes]
        out = next(n for n in reversed(self.nodes) if n.op == "output")
        results = tensor_inputs(out)
        wanted = outputs if outputs is not None else [None] * len(results)
        self.sinks = list(zip(results, wanted, strict=True))

    def greedy(self, resolve: dict, wanted: dict) -> tuple[Annotation, dict]:
        reached: set = set()
        for _ in range(PASSES):
            reached, annotation, requested, final = self.walk(set(reached), resolve, wanted)
            if final:  # the next pass would choose the same
                break
        return annotation, requested

    def move(self, value: torch.fx.Node, src: Layout, dst: Layout) -> tuple[float, int]:
        """(seconds, steps) of moving `value` from `src` to `dst` under the cost model."""
        val = value.meta["val"]
        return redistribute_seconds(src, dst, tuple(val.shape), val.dtype, self.model, self.reduce_dtype)

    def options(self, site: _Site, layouts: tuple) -> _Options:
        """The rule's strategies for `site` with inputs in `layouts` (in the inputs' axis orders too)."""
        site.asked[layouts] = None  # what the exact stage starts from
        key = (site.kind, layouts)
        found = self._answers.get(key)
        if found is None:
            call = site.call(layouts)
            strategies = keep_orders(call, site.rule.strategies(call))  # rules list mesh order; inputs keep theirs
            found = _Options(call, tuple((s, self.model.work(local_work(site.rule, call, s)) + self._inner(site.rule, call, s),
                                          self._moves(call, s),
                                          sum(len(layout.partial_axes) for layout in s.outputs))
                                         for s in strategies))
            self._answers[key] = found
        return found

    def _inner(self, rule, call: OpCall, strategy: Strategy) -> float:
        """Seconds of the collectives a strategy makes inside its op (`inner_moves`: a split
        argmax's all-gather of the blocks' winners), priced as any redistribution."""
        if not hasattr(rule, "inner_moves"):
            return 0.0
        return math.fsum(redistribute_seconds(src, dst, shape, dtype, self.model, self.reduce_dtype)[0]
                         for src, dst, shape, dtype in rule.inner_moves(call, strategy))

    def _moves(self, call: OpCall, strategy: Strategy) -> tuple:
        """What `strategy` moves of `call`'s inputs: (input, layout, seconds, steps) each."""
        return tuple((i, layout, *redistribute_seconds(t.layout, layout, t.shape, t.dtype, self.model, self.reduce_dtype))
                     for i, (t, layout) in enumerate(zip(call.tensors, strategy.inputs, strict=True))
                     if layout != t.layout)

    def walk(self, reached: set, resolve: dict, wanted: dict) -> tuple[set, Annotation, dict, bool]:
        """One greedy pass in graph order: the layouts it materialized, its annotation (priced:
        bytes moved, including resolving Partial outputs and reaching out_specs, plus weighted
        local work), per value the other layouts its consumers asked for, and whether a pass
        starting from the layouts this one materialized would choose as it did (`_final`)."""
        placeholders = iter(self.input_layouts)
        missing: list[Problem] = []
        replicated = Layout.replicated(self.mesh)
        layouts: dict = {}
        plans: dict = {}
        materialized: dict = {}  # (value, layout) -> the step that first needed it
        weighed: list = []  # (step, options, the one chosen, site) where prices were compared
        passed: dict = {}  # (value, layout) passed on the way to another -> the first step that did
        fresh = not reached
        requested: dict = {}
        same: dict = {}  # an alias (or detach) in its input's layout -> that input: one value to move
        costs: list[float] = []  # summed with fsum: the same total in any order, so every rank plans alike
        reach, materialize, note, nodeplans = reached.add, materialized.setdefault, costs.append, self._nodeplans
        for at, (node, step, site) in enumerate(self.steps):
            plan = None
            if step == _OP:
                have = tuple([layouts[p] for p in site.producers])
                if site.rule is None:
                    missing.append(_missing(node, site.call(have)))
                    layout = placed(node, (replicated,) * max(len(site.outputs), 1))
                else:
                    option, compared = self._choose(site, have, reached, resolve, wanted, same)
                    strategy, call, work = option[:3]
                    if compared is not None:
                        weighed.append((at, compared, option, site))
                    note(work)
                    for producer, need, current in zip(site.producers, strategy.inputs, have, strict=True):
                        pair = (same.get(producer, producer), need)
                        reach(pair)
                        materialize(pair, at)
                        if need is not current and need != current:  # (`is`: most take the layout they have)
                            # the layouts passed on the way serve a later consumer too, as lowered
                            for layout in _passed(current, need, producer):
                                reach((pair[0], layout))
                                passed.setdefault((pair[0], layout), at)
                            if producer.op == "call_function":
                                requested.setdefault(producer, set()).add(need)
                    if site.single:  # one plan per answer and strategy, shared by the nodes that asked alike
                        plan = nodeplans.get((id(strategy), id(call)))
                        if plan is None:
                            plan = nodeplans[id(strategy), id(call)] = NodePlan(strategy.outputs[0], call, site.rule,
                                                                                strategy, site.fallback)
                        layout = plan.layout
                    else:
                        layout = placed(node, strategy.outputs)
                        plan = NodePlan(layout, call, site.rule, strategy, site.fallback)
                    if site.same and have and have[0] == layout == strategy.inputs[0]:
                        same[node] = same.get(site.producers[0], site.producers[0])
            elif step == _GETITEM:
                layout = layouts[node.args[0]][node.args[1]]
            elif step == _PLACEHOLDER:
                layout = next(placeholders)
            elif step == _GET_ATTR:
                layout = replicated
            else:
                layout = None
                if step == _OUTPUT:
                    costs += self._sinks(layouts, reached, materialized, requested)
            layouts[node] = layout
            plans[node] = plan or NodePlan(layout)
        if missing:
            raise MissingRuleError(missing)
        for producer, layout in materialized:  # each layout a value reaches is paid for once
            if layout != layouts[producer]:
                costs.append(self.move(producer, layouts[producer], layout)[0])
        final = fresh and self._final(weighed, materialized, passed, same, wanted)
        return set(materialized), Annotation(plans, math.fsum(costs)), requested, final

    def _sinks(self, layouts, reached, materialized, requested) -> list[float]:
        """Price of delivering the outputs: their out_specs reached (with the other layouts,
        once per value and layout), or their Partial sums resolved where no spec is given."""
        costs = []
        for value, want in self.sinks:
            have = layouts[value]
            if want is None:
                costs += [self.move(value, have, have.with_placement(a, R))[0] for a in have.partial_axes]
            elif want != have:
                materialized.setdefault((value, want), len(self.steps))
                reached.add((value, want))
                if value.op == "call_function":
                    requested.setdefault(value, set()).add(want)
        return costs

    def _choose(self, site: _Site, have: tuple, reached, resolve, wanted, same=None) -> tuple[tuple, list | None]:
        """The cheapest option (strategy, the call its rule saw, its work price, its moves, its
        Partial outputs), and the options whose prices were compared, if they were. Inputs in
        `resolve` must arrive without Partial on the axes listed there, when the rule offers such
        a strategy. With `wanted` (layouts the consumers asked for, per value), a strategy is also
        charged for reaching those from its outputs, and `_hinted` strategies are offered too."""
        asked = self._answers.get((site.kind, have))
        if asked is None:
            asked = self.options(site, have)
        else:  # (what `options` does for a question asked before, inline: most are)
            site.asked[have] = None
        if not asked.strategies:
            layouts = ", ".join(layout.placements_str() for layout in have)
            raise ShardingError(Problem(
                f"{site.node.target} ({site.node.name})", f"the rule offers no strategy for inputs {layouts}",
                "check the rule's shapes; a rule must at least offer the replicated strategy",
            ))
        options, producers = asked.options, site.producers
        if len(options) == 1 and not wanted:  # nothing to weigh (most pointwise ops on their inputs' layouts)
            return options[0], None
        if asked.settled is not None and not (resolve and any(p in resolve for p in producers)) and \
                not (wanted and any(v in wanted for v in site.values)):  # (nothing here filters or adds options)
            return asked.settled, None
        if wanted:
            options = options + self._hinted(site, asked.call, have, wanted)
        if len(options) == 1:
            return options[0], None
        if resolve:
            def resolves(option):
                return not any(isinstance(layout.placements[a], Partial)
                               for producer, layout in zip(producers, option[0].inputs, strict=True)
                               for a in resolve.get(producer, ()))
            options = [o for o in options if resolves(o)] or options
        return self._cheapest(site, options, reached, wanted, same), options

    def _cheapest(self, site: _Site, options: list, reached, wanted, same) -> tuple:
        """The option of least price: work plus the moves not in `reached` (a set of (value,
        layout), or anything that answers `in` alike), plus, with `wanted`, what reaching the
        layouts the consumers asked for would cost from its outputs."""
        model, reduce_dtype, producers = self.model, self.reduce_dtype, site.producers
        alias = (same or {}).get

        def price(item):
            index, (_, _, work, moves, pending) = item
            seconds, steps = work, 0
            for i, layout, s, n in moves:
                if (alias(producers[i], producers[i]), layout) not in reached:
                    seconds, steps = seconds + s, steps + n
            return seconds, steps, pending, index  # ties: fewer steps, then resolved outputs first

        values = site.values if wanted else []

        def ahead(item):
            own = price(item)
            onward = math.fsum(redistribute_seconds(layout, want, out.shape, out.dtype, model, reduce_dtype)[0]
                               for value, layout, out in zip(values, item[1][0].outputs, site.outputs)
                               if value is not None for want in wanted.get(value, ()) if want != layout)
            return (own[0] + onward,) + own[1:]

        return min(enumerate(options), key=ahead if values else price)[1]

    def _final(self, weighed: list, materialized: dict, passed: dict, same: dict, wanted: dict) -> bool:
        """Whether a walk starting from the layouts this one (started from none) materialized
        would choose as this one did. It would know, at each step, what this one knew (what was
        materialized or passed on the way before it) and all it materialized: where an option
        weighed here moves a value to a layout first materialized there or later, the choice is
        priced again, as that walk would; if every choice stands, so does everything after it."""
        for at, options, chosen, site in weighed:
            producers = site.producers
            if any(materialized.get(pair, -1) >= at and passed.get(pair, at) >= at
                   for option in options for i, layout, _, _ in option[3]
                   for pair in [(same.get(producers[i], producers[i]), layout)]):
                if self._cheapest(site, options, _Known(materialized, passed, at), wanted, same) is not chosen:
                    return False
        return True

    def _hinted(self, site: _Site, call: OpCall, have: tuple, wanted) -> list:
        """Strategies giving an output layout the consumers asked for, from the rule's view of an
        input of the output's shape taken in that layout, where taking it moves nothing (a block of
        a replicated input); each with the call the rule saw, which is what reaches `emit`, since
        the strategy takes that input in that layout."""
        values = site.values
        if len(values) != 1 or values[0] not in wanted:
            return []
        out, found = call.outputs[0], []
        for want in wanted[values[0]]:
            if want.partial_axes:
                continue
            for i, t in enumerate(call.tensors):
                if t.shape != out.shape or t.layout == want or redistribute_cost(t.layout, want, t.shape, t.dtype)[0]:
                    continue
                try:
                    asked = self.options(site, have[:i] + (want,) + have[i + 1:])
                except ShardingError:
                    continue
                found += [(s, asked.call, w, self._moves(call, s), pending) for s, w, _, pending in asked.strategies
                          if s.outputs[0] == want and s.inputs[i] == want]
        return found


class _Known:
    """The layouts a walk starting from `materialized` knows at step `at` (`_Graph._final`)."""

    __slots__ = ("materialized", "passed", "at")

    def __init__(self, materialized: dict, passed: dict, at: int):
        self.materialized, self.passed, self.at = materialized, passed, at

    def __contains__(self, pair) -> bool:
        return pair in self.materialized or self.passed.get(pair, self.at) < self.at


# Ops whose output is their input's value: an alias (a gradient read through `p.grad`) or a
# detach in its input's layout is that value, and a layout either reached serves both.
SAME_VALUE = frozenset({torch.ops.aten.alias.default, torch.ops.aten.detach.default})


def same_value(node: torch.fx.Node) -> torch.fx.Node:
    """The value `node` is (its input, through aliases and detaches kept in their input's
    layout, as propagation chose them), or `node` itself."""
    while node.op == "call_function" and any(node.target is op for op in SAME_VALUE) and node.args \
            and isinstance(node.args[0], torch.fx.Node) and "hpfun_layout" in node.args[0].meta \
            and node.meta.get("hpfun_layout") == node.args[0].meta["hpfun_layout"]:
        node = node.args[0]
    return node


def _already_resolved(annotation: Annotation, resolve: dict) -> bool:
    """Whether every consumer of every value in `resolve` already takes it resolved."""
    for node, plan in annotation.plans.items():
        if plan.strategy is None:
            continue
        for producer, layout in zip(tensor_inputs(node), plan.strategy.inputs, strict=True):
            if any(isinstance(layout.placements[a], Partial) for a in resolve.get(producer, ())):
                return False
    return True


def partial_cuts(gm: torch.fx.GraphModule, mesh: Mesh, annotation: Annotation, reduce_dtype: str = "float32",
                 outputs: list[Layout | None] | None = None,
                 model: CostModel | None = None) -> dict[torch.fx.Node, frozenset[int]]:
    """Per value, the mesh axes on which its Partial should be resolved where it is produced.

    For each mesh axis, from `annotation`: a value kept Partial flows from its source (an op
    that created the sum, or an input) through consumers that keep it Partial, to consumers (or
    outputs) that need it resolved. Each value is a node with capacity the bytes of resolving
    it; a minimum S-T vertex cut is the cheapest set of values to resolve so that no unresolved
    sum reaches a consumer that needs it resolved.
    """
    import networkx as nx  # a dependency of torch: max-flow/min-cut, well tested

    model = model or CostModel()

    def capacity(value, axis: int) -> float:  # in microseconds, +1: fewer collectives on ties
        layout = layout_of(value)
        val = value.meta["val"]
        seconds = redistribute_seconds(layout, layout.with_placement(axis, R), tuple(val.shape), val.dtype, model,
                                       reduce_dtype)[0]
        return seconds * model.beta + 1  # in bytes at beta

    def layout_of(value):
        return annotation.plans[value].layout

    def partial_on(value, axis: int) -> bool:
        layout = layout_of(value)
        return isinstance(layout, Layout) and isinstance(layout.placements[axis], Partial)

    # only what touches a Partial value can be in a cut's graph: found once, for every axis
    partial = {value for value, plan in annotation.plans.items()
               if isinstance(plan.layout, Layout) and plan.layout.partial_axes}
    touching = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node in partial:
                touching.append((node, None, None))
        elif node.op == "output":
            touching.append((node, tensor_inputs(node), None))
        elif node.op == "call_function" and annotation.plans[node].strategy is not None:
            if node in partial or any(p in partial for p in node.all_input_nodes) or \
                    any(u in partial for u in node.users if u.target is operator.getitem):  # (a tuple's Partial element)
                touching.append((node, tensor_inputs(node), _output_values(node)))
    resolve: dict[torch.fx.Node, set[int]] = {}
    for a, size in enumerate(mesh.shape):
        if size == 1:
            continue
        g = nx.DiGraph()
        for node, producers, values in touching:
            plan = annotation.plans[node]
            if node.op == "placeholder":
                if partial_on(node, a):
                    g.add_edge("S", ("in", node))
                    g.add_edge(("in", node), ("out", node), capacity=capacity(node, a))
            elif node.op == "output":
                wants = outputs if outputs is not None else [None] * len(producers)
                for value, want in zip(producers, wants, strict=True):
                    if partial_on(value, a) and (want is None or want.placements[a] != layout_of(value).placements[a]):
                        g.add_edge(("out", value), "T")
            else:
                kept, needs = [], []
                for producer, layout in zip(producers, plan.strategy.inputs, strict=True):
                    if partial_on(producer, a):
                        (kept if isinstance(layout.placements[a], Partial) else needs).append(producer)
                for producer in needs:
                    g.add_edge(("out", producer), "T")
                for value in values:
                    if value is None or not partial_on(value, a):
                        continue
                    g.add_edge(("in", value), ("out", value), capacity=capacity(value, a))
                    for producer in kept or ["S"]:
                        g.add_edge(producer if producer == "S" else ("out", producer), ("in", value))
        if "S" not in g or "T" not in g or not nx.has_path(g, "S", "T"):
            continue
        _, (source_side, _) = nx.minimum_cut(g, "S", "T")
        for key in source_side:
            if key != "S" and key[0] == "in" and ("out", key[1]) not in source_side:
                resolve.setdefault(key[1], set()).add(a)
    return {value: frozenset(axes) for value, axes in resolve.items()}


def _output_values(node: torch.fx.Node) -> list:
    """Per tensor output of `node`, the node that holds it (None for an unused tuple element)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [node]
    by_index = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    leaves = pytree.tree_leaves(val)
    return [by_index.get(i) for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]


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
                      FallbackWarning, stacklevel=user_stacklevel())


class FallbackWarning(UserWarning):
    """Ops ran replicated because they have no sharding rule (fallback='replicate')."""


def _missing(node, call: OpCall) -> Problem:
    layouts = ", ".join(t.layout.placements_str() for t in call.tensors) or "no tensor inputs"
    line = user_line(node.meta.get("stack_trace"))
    fix = ("run it on gathered inputs with hpfun.shard(..., fallback=\"replicate\") (a warning names what it costs), "
           "or give it a rule: a YAML entry (see rules/README.md) or hpfun.rules.register(op, rule)")
    if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):  # multinomial, poisson, gamma
        fix = ("hpfun draws random numbers itself, the same for every layout, and has no such draw for this op yet "
               "(nor can fallback=\"replicate\" run it: each rank would draw other numbers): "
               "draw the values outside the sharded function and pass them in")
    return Problem(f"{node.target}", f"no sharding rule (inputs {layouts})" + (f", from {line}" if line else ""), fix)
