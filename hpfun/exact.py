"""The exact stage of propagation: the whole graph's choice of strategies as one `hpfun.solve`
problem, started from the greedy annotation and kept only where it is strictly cheaper.

Each op's candidates are the strategies its rule gave for every input layouts it was asked
about: those the greedy walks met, and probes with each input taken in each layout its producer
can give it, or (on a one-axis mesh) one placement away (a rule lists strategies seeded by its
inputs' layouts, so asking it with the layouts upstream could produce is what makes its list
independent of what upstream chose). The
price of a choice is the greedy walk's: local work, plus every distinct layout a value is moved
to, once, plus delivering the outputs. The solver (a MILP, HiGHS) sees every choice at once, so
a choice that only pays later (gathering a gradient once for two consumers) is found.
"""

from __future__ import annotations

import functools
import math
import operator

import torch
from torch.utils import _pytree as pytree

from hpfun.annotation import Annotation, NodePlan, placed
from hpfun.errors import ShardingError
from hpfun.layout import Layout, Partial, R, Shard
from hpfun.plan import redistribute_seconds
from hpfun import solve as milp

LAYER_HOPS = 4  # how far two ops' neighbourhoods must look alike for them to be tied as repeated layers


def refine(graph, best, time_limit: float = 10.0):
    """A cheaper annotation than `best` (an `Annotation` of `graph`, a propagate `_Graph`), or
    None when the exact choice over the candidates is no cheaper (or cannot be posed)."""
    built = _problem(graph, best)
    if built is None:
        return None
    problem, start, options = built
    start_price = milp.total_price(problem, start)
    # repeated layers choose alike: the program is as large at 32 layers as at 4 (the greedy
    # start need not keep the ties; the solution is kept only where cheaper than it)
    tied = milp.with_sides(problem, ties=layer_ties(graph, problem))
    try:
        solution = milp.solve(tied, start=start, time_limit=time_limit)
    except milp.InfeasibleError:  # nothing finite keeps the ties: the greedy plan stands
        return None
    if solution.price >= start_price * (1 - 1e-9) - 1e-9:
        return None
    plans = dict(best.plans)
    for node, index in solution.choice.items():
        if node in options:
            strategy, call, _ = options[node][index]
            plans[node] = NodePlan(placed(node, strategy.outputs), call, graph.sites[node].rule, strategy,
                                   graph.sites[node].fallback)
    for node in graph.nodes:  # a getitem takes its element of the chosen tuple
        if node.op == "call_function" and node.target is operator.getitem:
            plans[node] = NodePlan(plans[node.args[0]].layout[node.args[1]])
    return Annotation(plans, solution.price)


def _value(node: torch.fx.Node) -> tuple:
    """The solver's name of the value `node` holds: (producer, index among its tensor outputs)."""
    if node.op == "call_function" and node.target is operator.getitem:
        parent = node.args[0]
        leaves = pytree.tree_leaves(parent.meta.get("val"))
        return parent, sum(isinstance(v, torch.Tensor) for v in leaves[: node.args[1]])
    return node, 0


def _problem(graph, best, open_inputs=None, skip_sinks=()):
    """(Problem, the greedy choice, per op node its candidates as (strategy, call, work)).

    `open_inputs` (placeholder -> layouts, `best`'s among them) lets those inputs take any of
    the layouts (automatic sharding, `hpfun.auto`); the graph outputs at positions `skip_sinks`
    get no sink (the caller prices them)."""
    nodes, candidates, edges, options, start = [], {}, {}, {}, {}
    outputs_of: dict = {}  # value -> layouts its candidates give it
    found_for: dict = {}  # what `_candidates` found for a question: a repeated layer's ops ask the same
    open_inputs = open_inputs or {}
    for node in graph.nodes:
        if node in open_inputs:
            layouts = tuple(open_inputs[node])
            nodes.append(node)
            candidates[node] = tuple(milp.Candidate((), (layout,)) for layout in layouts)
            start[node] = layouts.index(best.plans[node].layout)
            outputs_of[(node, 0)] = frozenset(layouts)
        elif node.op in ("placeholder", "get_attr"):
            layout = best.plans[node].layout
            nodes.append(node)
            candidates[node] = (milp.Candidate((), (layout,)),)
            start[node] = 0
            outputs_of[(node, 0)] = frozenset({layout})
        elif node.op == "call_function" and node.target is not operator.getitem:
            site = graph.sites[node]
            if site.rule is None:
                return None
            found = _candidates(graph, site, best, outputs_of, found_for)
            chosen = best.plans[node].strategy
            index = next((i for i, (s, _, _) in enumerate(found) if (s.inputs, s.outputs) == (chosen.inputs, chosen.outputs)),
                         None)
            if index is None:
                return None
            nodes.append(node)
            options[node] = found
            candidates[node] = tuple(milp.Candidate(s.inputs, s.outputs, work) for s, _, work in found)
            edges[node] = tuple(_value(p) for p in site.producers)
            start[node] = index
            for k in range(len(site.outputs)):
                outputs_of[(node, k)] = frozenset(s.outputs[k] for s, _, _ in found)
    sinks: dict = {}
    for k, (value, want) in enumerate(graph.sinks):
        if k in skip_sinks:
            continue
        name = _value(value)
        accepts = frozenset({want}) if want is not None else frozenset(_resolved(l) for l in outputs_of[name])
        if sinks.setdefault(name, accepts) != accepts:
            return None  # one value returned twice in different layouts: left to the greedy plan
    shapes = {_value(n): (tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor)}

    priced: dict = {}  # (shape, dtype, src, dst) -> seconds: identical layers move alike

    def move(value, src, dst) -> float:
        key = (*shapes[value], src, dst)
        if key not in priced:
            try:
                priced[key] = redistribute_seconds(src, dst, key[0], key[1], graph.model, graph.reduce_dtype)[0]
            except ShardingError:
                priced[key] = math.inf
        return priced[key]

    problem = milp.Problem(nodes=nodes, candidates=candidates, edges=edges, move=move, sinks=sinks,
                           kind=shapes.__getitem__)
    return problem, start, options


def _resolved(layout: Layout) -> Layout:
    for a in layout.partial_axes:
        layout = layout.with_placement(a, R)
    return layout


_order = functools.lru_cache(maxsize=4096)(repr)  # a layout's sort key, made once (attrs' repr of a Layout is slow)


def _candidates(graph, site, best, outputs_of, found_for: dict | None = None) -> list:
    """Every strategy the rule offers `site` for the input layouts the greedy walks asked about,
    and for each input taken in each layout its producer can give it (the others as `best` has
    them); deduplicated by layouts, each with the call the rule saw and its work price.
    `found_for` keeps the answers by what decides them (the rule's question without the node,
    the layouts in `best`, those asked, those the producers can give): the same op of another
    layer is answered from it."""
    have = tuple(best.plans[p].layout for p in site.producers)
    if found_for is not None:
        key = (site.kind, have, tuple(graph.asked.get(site.node, ())),
               tuple(outputs_of.get(_value(p), frozenset()) for p in site.producers))
        found = found_for.get(key)
        if found is None:
            found = found_for[key] = _candidates(graph, site, best, outputs_of)
        return found
    asked = [have, *graph.asked.get(site.node, ())]
    probe_axes = site.mesh.ndim == 1  # see _neighbours
    for i, producer in enumerate(site.producers):
        near = _neighbours(have[i], producer) if probe_axes else []
        for layout in sorted(outputs_of.get(_value(producer), ()), key=_order) + near:
            asked.append(have[:i] + (layout,) + have[i + 1:])
    found, seen = [], set()
    for layouts in dict.fromkeys(asked):
        try:
            answer = graph.options(site, layouts)
        except ShardingError:
            continue
        for strategy, work, *_ in answer.strategies:
            key = (strategy.inputs, strategy.outputs)
            if key not in seen:
                seen.add(key)
                found.append((strategy, answer.call, work))
    return found


def _neighbours(layout: Layout, value: torch.fx.Node) -> list:
    """The layouts one mesh axis away from `layout` (that axis replicated, split along any dim
    that divides, or a Partial sum): probes that show a rule what its input could be. Asked on
    one-axis meshes only: on a mesh of several axes they triple the candidates (the 2-layer GPT
    on 2 x 2: 10346 instead of 3390), beyond what HiGHS proves optimal in seconds, and the plan
    found within the time limit was dearer than the optimum over the smaller set."""
    shape = tuple(value.meta["val"].shape)
    out = []
    for a in range(layout.mesh.ndim):
        for q in (R, Partial("sum"), *(Shard(d) for d in range(len(shape)))):
            if q != layout.placements[a]:
                candidate = _try(layout, a, q)
                if candidate is not None and candidate.fits(shape):
                    out.append(candidate)
    return out


def _try(layout: Layout, axis: int, placement):
    try:
        return layout.with_placement(axis, placement)
    except Exception:  # a placement the layout cannot take on that axis (an order it cannot keep)
        return None


def layer_ties(graph, problem: milp.Problem, tie_of: dict | None = None, rounds: int = LAYER_HOPS) -> list[tuple]:
    """Ops of repeated layers, tied to choose alike: ops with the same candidates whose
    neighbourhoods `rounds` edges deep look the same (the same ops on the same shapes, the AUTO
    inputs of one tie class), so the MILP solves the layers once (HiGHS's presolve merges tied
    columns). Ops near what differs (the first layer's input, the last one's output) see it
    and stay apart. `tie_of`: input placeholder -> the name of its tie class (AUTO's specs)."""
    tie_of = tie_of or {}
    fx_nodes = [n for n in problem.nodes if isinstance(n, torch.fx.Node)]
    label: dict = {}
    for n in problem.nodes:
        if not isinstance(n, torch.fx.Node):
            label[n] = hash(("sink",))
        elif n.op == "placeholder" and n not in tie_of and len(problem.candidates[n]) == 1:
            val = n.meta["val"]  # an input of a given layout: any of its shape and dtype looks alike
            label[n] = hash(("fixed input", problem.candidates[n], tuple(val.shape), val.dtype))
        elif n.op == "placeholder":
            label[n] = hash(("input", tie_of.get(n, n.name), problem.candidates[n]))
        elif n.op == "get_attr":
            label[n] = hash(("constant", n.name))
        elif _picks_a_scalar(n):  # the i-th parameter's step size in a foreach optimizer: alike whatever i
            label[n] = hash(("scalar of", tuple(n.args[0].meta["val"].shape), n.meta["val"].dtype))
        else:
            label[n] = hash(graph.sites[n].key)
    producers = {n: [p for p, _ in problem.inputs(n)] for n in problem.nodes}
    consumers: dict = {n: [] for n in problem.nodes}
    for n, ps in producers.items():
        for p in ps:
            consumers[p].append(n)
    for _ in range(rounds):
        label = {n: hash((label[n], tuple(label[p] for p in producers[n]), tuple(sorted(label[c] for c in consumers[n]))))
                 for n in problem.nodes}
    alike: dict = {}
    for n in fx_nodes:
        if n.op == "call_function" and len(problem.candidates[n]) > 1:
            alike.setdefault((label[n], problem.candidates[n]), []).append(n)
    return [tuple(group) for group in alike.values() if len(group) > 1]


def _picks_a_scalar(node: torch.fx.Node) -> bool:
    """`select` of one element of a vector: foreach optimizers stack one scalar per parameter
    (step sizes, bias corrections) and pick each parameter's by its index."""
    return (node.op == "call_function" and node.target is torch.ops.aten.select.int
            and isinstance(node.args[0], torch.fx.Node) and node.args[0].meta["val"].ndim == 1)
