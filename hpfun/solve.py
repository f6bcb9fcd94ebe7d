"""The exact choice of one strategy per node: a small abstract problem and a MILP that solves it.

The problem
-----------
A program is a list of nodes in topological order. Each node has a few *candidates* (ways to run
it): a candidate says which layout it needs for each of its inputs, which layout each of its
outputs comes out in, and its local price. A *value* is one output of one node, named
`(producer, output index)`. A *choice* picks one candidate per node; its total price is

- the price of every chosen candidate;
- for every value, once per distinct layout its consumers' chosen candidates need that differs
  from the layout the producer's candidate gives it, the price of moving the value to that layout
  (`move`). A layout a value reaches serves every consumer that needs it, so two consumers that
  need the same gathered value pay for one gather;
- for every graph output (a *sink*), the price of moving it to the cheapest layout it accepts.

A move priced `math.inf` is impossible: no choice may need it. `total_price` is the reference
evaluation; `brute_force` tries every choice (small problems only, for tests); `solve` finds the
cheapest choice with a mixed-integer linear program solved by HiGHS (`scipy.optimize.milp`).

The formulation
---------------
- `x[n, c]` is 1 when node `n` runs candidate `c`; each node's `x` sum to 1. A candidate's cost
  is its price plus the price of delivering its sink outputs.
- `X[v, S]` (a sum of `x`, not a column) is 1 when value `v` is made in layout `S`; `D[v, L, r]`
  (likewise) is 1 when the reader slot `r` of `v` needs it in layout `L`.
- `mu[v, r, S, L]`, one per pair of finite move price, is 1 when `v` is made in `S` and `r` needs
  it in `L`: its sums over `L` are the `X[v, S]`, its sums over `S` the `D[v, L, r]` (the local
  marginal polytope, exact in the LP relaxation when the graph is a tree). An impossible move has
  no `mu`, so no choice can need it. When either side has one layout, `mu` is the other side's sum.
- `w[v, S, L] >= mu[v, r, S, L]` for every slot `r`, priced `move(v, S, L)`: a move wanted by
  several readers is paid once. (With a single reader the price goes on `mu` itself.)
- HiGHS proves optimality fast when the LP relaxation is tight (chains, trees, graphs whose
  candidates agree); on graphs with many cycles of conflicting preferences the proof can take
  long, hence `time_limit` and `start`. The relaxation is solved first, as a plain LP: when its
  `x` come out 0 or 1 (the common case: a repeated layer's step has this) it is the MILP's optimum
  and the branch and bound, twice the LP's time there, is skipped.

Side conditions (used by automatic sharding, `hpfun.auto`)
-----------------------------------------------------------
- `ties`: groups of nodes with the same candidates that must choose the same index (an
  argument's layout and the layout its update is returned in; the same weight of two identical
  layers): rows `x[a, c] = x[b, c]`.
- `memory` and `budget`: per program *point*, the bytes per rank each node's candidates hold
  there (a value live at that point, in the layout the candidate gives it), and for the nodes
  `readers_at` that point, the buffers of moving their inputs to the layouts they need
  (`moved(value, src, dst, reader)` bytes each, linear in the `mu` and `x` that say a move happens);
  every point's sum must be at most `budget`. `least_memory` finds the choice whose
  largest point is smallest (what budget would fit).
- `cuts`: partial choices (node -> candidate) no choice may take all at once: a runner-up is
  the cheapest choice with one more cut.

Before the MILP the problem shrinks: candidates of infinite price, or needing a layout no
remaining neighbour candidate can reach (or be reached from) at a finite price, are dropped until
nothing changes; a candidate equal to an earlier one in layouts and no cheaper is dropped; a node
left with one candidate is a constant. A node left with none is reported by name.
"""

from __future__ import annotations

import contextvars
import itertools
import math
import numbers
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping

import attrs
import numpy as np
import scipy.optimize
import scipy.sparse

from hpfun.errors import HpfunError, Problem as Issue, ShardingError
from hpfun.quiet import silenced

Node = Hashable
Value = tuple[Hashable, int]  # (producer node, output index)
Choice = Mapping[Hashable, int]  # node -> index of its candidate

# HiGHS stops when the proven gap is below 1e-6 in objective units (not settable through scipy).
# Prices are often seconds (~1e-6 for a small collective), so the objective is rescaled to make
# its largest coefficient this large: the gap is then 1e-12 of the largest price.
_OBJECTIVE_SCALE = 1e6


class ProblemError(HpfunError, ValueError):
    """A strategy problem is malformed (edges, candidates, sinks or a start choice)."""

    headline = "malformed strategy problem"


class InfeasibleError(ShardingError):
    """Every choice of strategies needs an impossible move or an infinite price."""

    headline = "no strategy choice of finite price"


def _price(value: float) -> float:
    value = float(value)
    if not value >= 0:
        raise ProblemError(f"a price must be >= 0 (math.inf forbids), got {value!r}")
    return value


@attrs.frozen
class Candidate:
    """One way to run a node: the layout each input slot needs, each output's layout, its price.

    >>> Candidate(inputs=("R",), outputs=("S0",), price=1.0).outputs
    ('S0',)
    """

    inputs: tuple = attrs.field(converter=tuple)
    outputs: tuple = attrs.field(converter=tuple)
    price: float = attrs.field(converter=_price, default=0.0)


# while `with_sides` builds a problem: the graph parts (nodes, candidates, edges, sinks) of the
# checked problem it starts from, which the new one shares
_SHARED = contextvars.ContextVar("hpfun_solve_shared_parts", default=None)


@attrs.frozen(eq=False)
class Problem:
    """Nodes in topological order, their candidates, their input edges, a move price, sinks.

    `edges[n]` holds one `(producer, output index)` per input slot of `n` (a node without inputs
    may be left out); `sinks` maps a value to the layouts a graph output accepts. `move(value,
    src, dst)` is only asked about distinct layouts.

    >>> p = Problem(nodes=("a", "b"),
    ...             candidates={"a": (Candidate((), ("R",)),),
    ...                         "b": (Candidate(("R",), ("R",), 2.0), Candidate(("S",), ("S",), 1.0))},
    ...             edges={"b": (("a", 0),)}, move=lambda v, s, d: 5.0)
    >>> total_price(p, {"a": 0, "b": 1})
    6.0
    """

    nodes: tuple = attrs.field(converter=tuple)
    candidates: Mapping[Node, tuple[Candidate, ...]]
    edges: Mapping[Node, tuple[Value, ...]]
    move: Callable[[Value, Hashable, Hashable], float]
    sinks: Mapping[Value, frozenset] = attrs.field(factory=dict)
    ties: tuple = attrs.field(default=(), converter=lambda t: tuple(tuple(g) for g in t))
    memory: tuple = attrs.field(default=(), converter=tuple)  # per point: {node: bytes per candidate}
    readers_at: tuple = attrs.field(default=(), converter=lambda t: tuple(tuple(r) for r in t))  # per point
    moved: Callable[[Value, Hashable, Hashable, Hashable], float] | None = None  # bytes a move of a value to a reader needs
    # per memory point: (value, slots read before it, slots read after it, slots read there), each
    # slot a (reader, input index): a moved copy one reader made and a later one reads is kept between
    kept_at: tuple = ()
    budget: float | None = None
    # values of one kind (e.g. of one shape and dtype) move alike: `move` is asked once per kind
    kind: Callable[[Value], Hashable] | None = None
    cuts: tuple = attrs.field(default=(), converter=lambda t: tuple(dict(c) for c in t))

    def __attrs_post_init__(self):
        shared = _SHARED.get()
        parts = (self.nodes, self.candidates, self.edges, self.sinks)
        checked = shared is not None and all(a is b for a, b in zip(shared, parts, strict=True))
        structural = [] if checked else _node_issues(self) + _edge_issues(self) + _sink_issues(self)
        issues = structural + _side_issues(self)
        if issues:
            raise ProblemError(issues)

    def inputs(self, node: Node) -> tuple[Value, ...]:
        """The value read by each input slot of `node`."""
        return tuple(self.edges.get(node, ()))


def with_sides(problem: Problem, **changes) -> Problem:
    """`attrs.evolve(problem, **changes)` for other side conditions (ties, memory points, a
    budget, cuts): the graph's parts, shared and already checked, are not checked again (13,000
    nodes of a Llama step took 0.2 s a check, at every evolve)."""
    token = _SHARED.set((problem.nodes, problem.candidates, problem.edges, problem.sinks))
    try:
        return attrs.evolve(problem, **changes)
    finally:
        _SHARED.reset(token)


def _node_issues(p: Problem) -> list[Issue]:
    issues = []
    if len(set(p.nodes)) != len(p.nodes):
        issues.append(Issue("nodes", "repeat a node", "list each node once"))
    for n in p.nodes:
        cands = p.candidates.get(n, ())
        if not cands:
            issues.append(Issue(f"node {n!r}", "has no candidate", "give every node at least one"))
        elif len({len(c.outputs) for c in cands}) > 1 or len({len(c.inputs) for c in cands}) > 1:
            issues.append(Issue(f"node {n!r}", "has candidates with different numbers of inputs or outputs"))
    listed = set(p.nodes)
    issues += [Issue(f"node {n!r}", "has candidates but is not in nodes") for n in p.candidates if n not in listed]
    return issues


def _edge_issues(p: Problem) -> list[Issue]:
    issues, seen = [], set()
    for n in p.nodes:
        for slot, value in enumerate(p.inputs(n)):
            if not (isinstance(value, tuple) and len(value) == 2 and value[0] in seen):
                issues.append(Issue(f"node {n!r} input {slot}", f"reads {value!r}, not (earlier node, output index)",
                                    "list nodes in topological order and edges as (producer, output index)"))
            elif not 0 <= value[1] < len(p.candidates[value[0]][0].outputs):
                issues.append(Issue(f"node {n!r} input {slot}", f"reads output {value[1]} of {value[0]!r}, which has "
                                    f"{len(p.candidates[value[0]][0].outputs)} outputs"))
        if any(len(c.inputs) != len(p.inputs(n)) for c in p.candidates.get(n, ())):
            issues.append(Issue(f"node {n!r}", f"has {len(p.inputs(n))} input edges but candidates with another "
                                "number of inputs", "give each candidate one layout per input edge"))
        seen.add(n)
    return issues + [Issue(f"node {n!r}", "has edges but is not in nodes") for n in p.edges if n not in seen]


def _sink_issues(p: Problem) -> list[Issue]:
    issues = []
    for value, layouts in p.sinks.items():
        producer, index = value if isinstance(value, tuple) and len(value) == 2 else (None, -1)
        if producer not in p.candidates or not 0 <= index < len(p.candidates[producer][0].outputs):
            issues.append(Issue(f"sink {value!r}", "is not an output of a node", "name it (producer, output index)"))
        if not layouts:
            issues.append(Issue(f"sink {value!r}", "accepts no layout", "give at least one acceptable layout"))
    return issues


def _side_issues(p: Problem) -> list[Issue]:
    issues = []
    for group in p.ties:
        if any(n not in p.candidates for n in group):
            issues.append(Issue(f"tie {group!r}", "names a node that is not in nodes"))
        elif len({len(p.candidates[n]) for n in group}) > 1:
            issues.append(Issue(f"tie {group!r}", "ties nodes with different numbers of candidates",
                                "tie nodes whose candidates correspond one to one"))
    for i, point in enumerate(p.memory):
        for n, weights in point.items():
            if n not in p.candidates or len(weights) != len(p.candidates[n]):
                issues.append(Issue(f"memory point {i} node {n!r}", "needs one weight per candidate of a node"))
            elif not all(w >= 0 for w in weights):
                issues.append(Issue(f"memory point {i} node {n!r}", "has a negative or NaN weight"))
    if p.readers_at and (len(p.readers_at) != len(p.memory) or p.moved is None
                         or any(r not in p.candidates for rs in p.readers_at for r in rs)):
        issues.append(Issue("readers_at", "needs one tuple of nodes per memory point, and `moved`"))
    if p.budget is not None and not p.budget >= 0:
        issues.append(Issue("budget", f"is {p.budget!r}", "give bytes >= 0, or None"))
    for cut in p.cuts:
        if not cut or any(n not in p.candidates or not 0 <= c < len(p.candidates[n]) for n, c in cut.items()):
            issues.append(Issue(f"cut {cut!r}", "must map nodes to indices of their candidates"))
    return issues


def _tied(problem: Problem) -> dict:
    """Node -> the nodes it is tied to (itself included), ties merged."""
    group_of: dict = {}
    for group in problem.ties:
        merged = set(group).union(*(group_of.get(n, ()) for n in group))
        for n in merged:
            group_of[n] = merged
    order = {n: i for i, n in enumerate(problem.nodes)}
    ordered = {id(g): tuple(sorted(g, key=order.__getitem__)) for g in group_of.values()}
    return {n: ordered[id(g)] for n, g in group_of.items()}


def memory_of(problem: Problem, choice: Choice) -> float:
    """The largest sum over the `memory` points of the chosen candidates' bytes and the moved
    copies of the inputs of the nodes `readers_at` them (0: no point)."""
    return max((point_memory(problem, choice, i) for i in range(len(problem.memory))), default=0.0)


def point_memory(problem: Problem, choice: Choice, i: int) -> float:
    terms = [w[choice[n]] for n, w in problem.memory[i].items()]
    for reader in problem.readers_at[i] if problem.readers_at else ():
        needs = problem.candidates[reader][choice[reader]].inputs
        for value, need in zip(problem.inputs(reader), needs, strict=True):
            have = _layout(problem, choice, value)
            if have != need:
                terms.append(problem.moved(value, have, need, reader))
    for value, before, after, here in problem.kept_at[i] if problem.kept_at else ():
        have = _layout(problem, choice, value)

        def need(slots):
            return {problem.candidates[r][choice[r]].inputs[k] for r, k in slots}

        terms += [problem.moved(value, have, L, None) for L in (need(before) & need(after)) - need(here) - {have}]
    return math.fsum(terms)


def allowed(problem: Problem, choice: Choice) -> bool:
    """Whether a choice keeps the ties, avoids the cuts and fits the budget."""
    if any(len({choice[n] for n in group}) > 1 for group in problem.ties):
        return False
    if any(all(choice[n] == c for n, c in cut.items()) for cut in problem.cuts):
        return False
    return problem.budget is None or memory_of(problem, choice) <= problem.budget * (1 + 1e-9)


@attrs.frozen
class Solution:
    """A choice (node -> candidate index), its `total_price`, whether it is proven optimal, and
    how it was found: "optimal", "feasible" (the MILP stopped on its time limit with a solution
    not proven best) or "start" (the given start, as the MILP found nothing cheaper)."""

    choice: dict
    price: float
    optimal: bool
    status: str


# ---------------------------------------------------------------------------------------------
# Reference evaluation
# ---------------------------------------------------------------------------------------------


def _moved(problem: Problem, value: Value, src: Hashable, dst: Hashable) -> float:
    return 0.0 if src == dst else float(problem.move(value, src, dst))


def _sink_price(problem: Problem, value: Value, layout: Hashable) -> float:
    accepted = problem.sinks.get(value)
    if accepted is None or layout in accepted:
        return 0.0
    return min(_moved(problem, value, layout, target) for target in accepted)


def _layout(problem: Problem, choice: Choice, value: Value) -> Hashable:
    producer, index = value
    return problem.candidates[producer][choice[producer]].outputs[index]


def total_price(problem: Problem, choice: Choice) -> float:
    """The price of a choice: candidate prices, each distinct (value, needed layout) move once,
    and sinks; `math.inf` when it needs an impossible move. See the module docstring.

    >>> p = Problem(nodes=("a",), candidates={"a": (Candidate((), ("R",), 1.0),)}, edges={},
    ...             move=lambda v, s, d: 3.0, sinks={("a", 0): frozenset({"S"})})
    >>> total_price(p, {"a": 0})
    4.0
    """
    _check_choice(problem, choice)
    needed: dict[Value, dict] = {}
    for n in problem.nodes:
        for value, layout in zip(problem.inputs(n), problem.candidates[n][choice[n]].inputs, strict=True):
            needed.setdefault(value, {})[layout] = None
    terms = [problem.candidates[n][choice[n]].price for n in problem.nodes]
    for value, layouts in needed.items():
        terms += [_moved(problem, value, _layout(problem, choice, value), L) for L in layouts]
    terms += [_sink_price(problem, value, _layout(problem, choice, value)) for value in problem.sinks]
    return math.fsum(terms)


def _check_choice(problem: Problem, choice: Choice) -> None:
    issues = [Issue(f"node {n!r}", f"chooses {choice.get(n)!r}, not an index below {len(problem.candidates[n])}")
              for n in problem.nodes
              if not (isinstance(choice.get(n), numbers.Integral) and 0 <= choice[n] < len(problem.candidates[n]))]
    if issues:
        raise ProblemError(issues, headline="invalid choice")


def brute_force(problem: Problem, *, limit: int = 200_000) -> tuple[dict, float]:
    """The cheapest choice by trying every one (the first in product order among equals); for
    tests of `solve` on small problems. Refuses problems with more than `limit` choices.

    >>> p = Problem(nodes=("a",), candidates={"a": (Candidate((), (), 2.0), Candidate((), (), 1.0))},
    ...             edges={}, move=lambda v, s, d: 0.0)
    >>> brute_force(p)
    ({'a': 1}, 1.0)
    """
    sizes = [len(problem.candidates[n]) for n in problem.nodes]
    if math.prod(sizes) > limit:
        raise ValueError(f"brute_force: {math.prod(sizes)} choices exceed the limit of {limit}; use solve")
    best, best_price = None, math.inf
    for indices in itertools.product(*map(range, sizes)):
        choice = dict(zip(problem.nodes, indices, strict=True))
        if not allowed(problem, choice):
            continue
        price = total_price(problem, choice)
        if price < best_price:
            best, best_price = choice, price
    if best is None:
        raise InfeasibleError("every choice needs an impossible move or an infinite price")
    return best, best_price


# ---------------------------------------------------------------------------------------------
# Shrinking: drop candidates no finite choice can use
# ---------------------------------------------------------------------------------------------


class _Prices:
    """`move` and sink prices, each asked of the problem once."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._moves: dict = {}
        self._kinds: dict = {}

    def kind(self, value: Value) -> Hashable:
        """What a value's move prices depend on: its kind, or the value itself."""
        kind = self._kinds.get(value)
        if kind is None:
            kind = self._kinds[value] = ("kind", self.problem.kind(value)) if self.problem.kind else value
        return kind

    def move(self, value: Value, src: Hashable, dst: Hashable) -> float:
        # asked hundreds of thousands of times when the MILP is built: one lookup per ask (a
        # layout's hash is a Python call)
        kind = self._kinds.get(value)
        key = (self.kind(value) if kind is None else kind, src, dst)
        price = self._moves.get(key)
        if price is None:
            price = self._moves[key] = _moved(self.problem, value, src, dst)
            if not price >= 0:
                raise ProblemError(Issue(f"move of {value!r} from {src!r} to {dst!r}", f"is priced {price!r}",
                                         "price moves >= 0, and math.inf when impossible"))
        return price

    def own(self, node: Node, index: int) -> float:
        """The candidate's price plus the price of delivering its sink outputs."""
        outputs = self.problem.candidates[node][index].outputs
        sinks = [(node, i) for i in range(len(outputs)) if (node, i) in self.problem.sinks]
        return math.fsum([self.problem.candidates[node][index].price]
                         + [self._sink(v, outputs[v[1]]) for v in sinks])

    def _sink(self, value: Value, layout: Hashable) -> float:
        accepted = self.problem.sinks[value]
        return 0.0 if layout in accepted else min(self.move(value, layout, target) for target in accepted)


def _readers(problem: Problem) -> dict[Value, list[tuple[Node, int]]]:
    """Value -> the (consumer, slot) pairs reading it, in node order."""
    readers: dict[Value, list] = {}
    for n in problem.nodes:
        for slot, value in enumerate(problem.inputs(n)):
            readers.setdefault(value, []).append((n, slot))
    return readers


def _undominated(problem: Problem, prices: _Prices, node: Node) -> list[int]:
    """Candidates of finite price, less those with the layouts of an earlier one and no lower price
    (swapping one for the other changes no move)."""
    kept: dict[tuple, int] = {}
    for i, cand in enumerate(problem.candidates[node]):
        key = (cand.inputs, cand.outputs)
        if prices.own(node, i) < math.inf and (key not in kept or prices.own(node, i) < prices.own(node, kept[key])):
            kept[key] = i
    return sorted(kept.values())


def _prune(problem: Problem, prices: _Prices) -> dict[Node, list[int]]:
    """Node -> the candidates some finite choice may use, by dropping, until nothing changes, any
    candidate that needs a layout no remaining candidate of a neighbour can meet at a finite price
    (and, for tied nodes, any index a node of the tie has dropped)."""
    tied = _tied(problem)
    forbidden = {(n, c) for cut in problem.cuts if len(cut) == 1 for n, c in cut.items()}
    alive = {n: [c for c in (_undominated(problem, prices, n) if n not in tied else  # keep indices aligned
                             [c for c in range(len(problem.candidates[n])) if prices.own(n, c) < math.inf])
                 if (n, c) not in forbidden] for n in problem.nodes}
    for group in dict.fromkeys(map(tuple, tied.values())):
        common = sorted(set.intersection(*(set(alive[n]) for n in group)))
        for n in group:
            alive[n] = common
    _raise_if_empty(problem, [n for n in problem.nodes if not alive[n]], "has an infinite price, is cut or is "
                    "tied to a node whose candidate of that index is")
    readers = _readers(problem)
    queue, queued = deque(problem.nodes), set(problem.nodes)
    while queue:
        n = queue.popleft()
        queued.discard(n)
        kept = [c for c in alive[n] if _supported(problem, prices, alive, readers, n, c)]
        if not kept:
            _raise_if_empty(problem, [n], "has an infinite price or needs a layout that the remaining "
                            "candidates of its neighbours reach only by impossible moves")
        if kept != alive[n]:
            for m in tied.get(n, (n,)):
                alive[m] = [c for c in alive[m] if c in kept]
                outputs = range(len(problem.candidates[m][0].outputs))
                neighbours = [p for p, _ in problem.inputs(m)] + [q for i in outputs for q, _ in readers.get((m, i), ())]
                neighbours += [o for o in tied.get(m, ()) if o != n]
                queue.extend(o for o in dict.fromkeys(neighbours) if o not in queued)
                queued.update(neighbours)
    return alive


def _supported(problem: Problem, prices: _Prices, alive, readers, node: Node, index: int) -> bool:
    """Whether each input and each reader of each output of the candidate can be met by some
    remaining candidate of the neighbour at a finite move price."""
    cand = problem.candidates[node][index]
    for value, need in zip(problem.inputs(node), cand.inputs, strict=True):
        producer, i = value
        if all(prices.move(value, problem.candidates[producer][c].outputs[i], need) == math.inf
               for c in alive[producer]):
            return False
    for i, layout in enumerate(cand.outputs):
        for reader, slot in readers.get((node, i), ()):
            if all(prices.move((node, i), layout, problem.candidates[reader][c].inputs[slot]) == math.inf
                   for c in alive[reader]):
                return False
    return True


def _raise_if_empty(problem: Problem, nodes: list, why: str) -> None:
    if nodes:
        raise InfeasibleError([Issue(f"node {n!r}", f"has no usable candidate: each of its "
                                     f"{len(problem.candidates[n])} {why}", "give the node a candidate whose layouts "
                                     "its neighbours can meet at a finite price") for n in nodes])


# ---------------------------------------------------------------------------------------------
# The MILP
# ---------------------------------------------------------------------------------------------


@attrs.define
class _Model:
    """Columns (cost, integrality) and sparse rows `lo <= sum coef * column <= hi` of the MILP,
    plus the constant part of the objective."""

    costs: list = attrs.field(factory=list)
    integral: list = attrs.field(factory=list)
    entries: list = attrs.field(factory=list)  # (row, column, coefficient)
    needs: dict = attrs.field(factory=dict)  # (reader, slot) -> (value, {(S, L): joint indicator})
    paid: dict = attrs.field(factory=dict)  # the joints a `w` column is at least -> that column
    lower: list = attrs.field(factory=list)
    upper: list = attrs.field(factory=list)
    offset: list = attrs.field(factory=list)

    def column(self, cost: float, integral: bool) -> int:
        self.costs.append(cost)
        self.integral.append(int(integral))
        return len(self.costs) - 1

    def row(self, terms: dict[int, float], lower: float, upper: float) -> None:
        self.entries += [(len(self.lower), col, coef) for col, coef in terms.items()]
        self.lower.append(lower)
        self.upper.append(upper)


@attrs.frozen(cache_hash=True)  # a key of the joints and payments: hashed often
class _Sum:
    """A sum of `x` columns plus a constant: the indicator that a node's candidate has a property
    (a constant node contributes 0 or 1, not a column)."""

    columns: tuple
    constant: int


def _by_layout(candidates: list[int], layout_of: Callable[[int], Hashable]) -> dict[Hashable, list[int]]:
    """The candidates grouped by a layout they give or need, in candidate order."""
    groups: dict[Hashable, list[int]] = {}
    for c in candidates:
        groups.setdefault(layout_of(c), []).append(c)
    return groups


def _indicator(x: dict, node: Node, group: list[int], always: bool) -> _Sum:
    """1 when the node runs one of `group` (a part of its remaining candidates): a constant when
    that is `always` so, else the sum of their `x` columns."""
    return _Sum((), 1) if always else _Sum(tuple(x[node, c] for c in group), 0)


def _build(problem: Problem, prices: _Prices, alive: dict) -> tuple[_Model, dict]:
    """The MILP of the module docstring over the remaining candidates, and its `x` columns."""
    model, x = _Model(), {}
    tied = _tied(problem)
    for n in problem.nodes:
        if len(alive[n]) == 1:
            model.offset.append(prices.own(n, alive[n][0]))
            continue
        first = tied.get(n, (n,))[0]  # tied nodes share the first one's columns (its candidates' prices summed)
        for c in alive[n]:
            if first == n:
                x[n, c] = model.column(prices.own(n, c), integral=True)
            else:
                x[n, c] = x[first, c]
                model.costs[x[n, c]] += prices.own(n, c)
        if first == n:
            model.row({x[n, c]: 1.0 for c in alive[n]}, 1.0, 1.0)
    joints: dict = {}  # the mu columns of each pair of (made, needed) indicators: tied edges share them
    alike = _alike(problem, tied)
    for value, readers in _readers(problem).items():
        _add_value(problem, prices, alive, model, x, value, readers, joints, alike)
    for cut in problem.cuts:
        if all(c in alive[n] for n, c in cut.items()):
            terms = {x[n, c]: 1.0 for n, c in cut.items() if len(alive[n]) > 1}
            if not terms:
                raise InfeasibleError(f"the cut {cut!r} forbids the only choice left")
            model.row(terms, -math.inf, len(terms) - 1.0)
    return model, x


def _memory_rows(problem: Problem, alive: dict, x: dict, model: _Model) -> list[tuple[dict, float]]:
    """Per memory point: the terms over the `x` columns, and the bytes of the constant nodes."""
    rows = []
    for i, point in enumerate(problem.memory):
        terms, constant = {}, []
        for n, weights in point.items():
            if len(alive[n]) == 1:
                constant.append(weights[alive[n][0]])
            else:
                for c in alive[n]:
                    if weights[c]:  # tied nodes share a column: their weights add up
                        terms[x[n, c]] = terms.get(x[n, c], 0.0) + float(weights[c])
        for reader in problem.readers_at[i] if problem.readers_at else ():
            for slot in range(len(problem.inputs(reader))):
                value, joints = model.needs[reader, slot]
                for (S, L), joint in joints.items():
                    if S != L:
                        w = float(problem.moved(value, S, L, reader))
                        constant += [w] * joint.constant
                        for col in joint.columns:
                            terms[col] = terms.get(col, 0.0) + w
        for value, before, after, here in problem.kept_at[i] if problem.kept_at else ():
            joints = {slot: model.needs[slot][1] for slot in (*before, *after, *here) if slot in model.needs}
            # (in the joints' order: a set of layout pairs iterates in the string-hash seed's order, which
            # differs between processes, and so would the columns, and the plan HiGHS picks among equals)
            for S, L in dict.fromkeys(pair for slot in (*before, *after) if slot in joints for pair in joints[slot]):
                if S == L:
                    continue
                z = None  # 1 when a reader before and one after need the copy, and none here made it
                for b in before:
                    for a in after:
                        jb, ja = joints.get(b, {}).get((S, L)), joints.get(a, {}).get((S, L))
                        if jb is None or ja is None:
                            continue
                        if z is None:
                            z = model.column(0.0, integral=False)
                        row = {z: 1.0}
                        for col in (*jb.columns, *ja.columns):
                            row[col] = row.get(col, 0.0) - 1.0
                        low = jb.constant + ja.constant - 1.0
                        for h in here:
                            jh = joints.get(h, {}).get((S, L))
                            if jh is not None:
                                for col in jh.columns:
                                    row[col] = row.get(col, 0.0) + 1.0
                                low -= jh.constant
                        model.row(row, low, math.inf)
                if z is not None:
                    terms[z] = terms.get(z, 0.0) + float(problem.moved(value, S, L, None))
        rows.append((terms, math.fsum(constant)))
    return rows


def _alike(problem: Problem, tied: dict) -> dict:
    """Node -> the first node of its tie when the tie's nodes have equal candidates (then they
    share their `x` columns and their candidates' layouts: a value they make and read is delivered
    as the first ones' is), else the node itself."""
    first: dict = {}
    for group in dict.fromkeys(tied.values()):
        lead = problem.candidates[group[0]]
        same = all(problem.candidates[n] is lead or problem.candidates[n] == lead for n in group[1:])
        for n in group:
            first[n] = group[0] if same else n
    return first


def _add_value(problem, prices, alive, model: _Model, x: dict, value: Value, readers, joints: dict,
               alike: dict | None = None) -> None:
    """The columns and rows that deliver `value` to the layouts its readers need, each distinct
    move paid once. A value like one already added (of the same kind, made and needed by the same
    indicators: a repeated layer's, its nodes tied) shares its columns: only its prices are added.
    `alike` (see `_alike`) finds most such values before their indicators are made: at 32 Llama
    layers, four in five values are made and read by tied nodes only."""
    producer, index = value
    if alike is not None:
        def who(n, side, slot):  # the same columns and layouts: the tie's first node, or a constant's layout
            if len(alive[n]) == 1:
                cand = problem.candidates[n][alive[n][0]]
                return "constant", cand.outputs[slot] if side else cand.inputs[slot]
            return alike.get(n, n), len(alive[n])
        early = ("alike", prices.kind(value), who(producer, True, index),
                 tuple((who(r, False, s), s) for r, s in readers))
        known = joints.get(early)
        if known is not None:
            charges, all_pairs = known
            _charge(model, value, readers, all_pairs, charges)
            return
    gives = _by_layout(alive[producer], lambda c: problem.candidates[producer][c].outputs[index])
    made = {S: _indicator(x, producer, group, len(gives) == 1) for S, group in gives.items()}
    wanted = []
    for reader, slot in readers:
        wants = _by_layout(alive[reader], lambda c, r=reader, s=slot: problem.candidates[r][c].inputs[s])
        wanted.append({L: _indicator(x, reader, group, len(wants) == 1) for L, group in wants.items()})
    key = ("value", prices.kind(value), tuple(made.items()), tuple(tuple(needed.items()) for needed in wanted))
    known = joints.get(key)
    if known is not None:
        charges, all_pairs = known
    else:
        moves: dict[tuple, dict[_Sum, None]] = {}
        all_pairs = []
        for needed in wanted:
            pairs = _joint(prices, model, value, made, needed, joints)
            all_pairs.append(pairs)
            for (S, L), joint in pairs.items():
                if S != L:
                    moves.setdefault((S, L), {})[joint] = None
        charges = [_pay(model, prices.move(value, S, L), list(js)) for (S, L), js in moves.items()]
        joints[key] = charges, all_pairs
    if alike is not None:
        joints[early] = charges, all_pairs
    _charge(model, value, readers, all_pairs, charges)


def _charge(model: _Model, value: Value, readers, all_pairs, charges) -> None:
    for (reader, slot), pairs in zip(readers, all_pairs, strict=True):
        model.needs[reader, slot] = (value, pairs)
    for columns, price in charges:
        if columns is None:
            model.offset.append(price)
        else:
            for col in columns:
                model.costs[col] += price


def _joint(prices: _Prices, model: _Model, value: Value, made: dict, needed: dict, joints: dict) -> dict[tuple, _Sum]:
    """(S, L) -> 1 when the value is made in S and one reader slot needs it in L. A product of two
    indicators when one is constant, else a column `mu` tied to both by its marginals (the
    producer's layout is S, the slot's is L), over the pairs of finite move price only. Edges
    with the same indicators (between tied nodes: repeated layers) share their `mu`: in an
    integral choice they are the same products."""
    if len(made) == 1 or len(needed) == 1:
        return {(S, L): need if produced.constant else produced
                for S, produced in made.items() for L, need in needed.items()}
    key = (tuple(made.items()), tuple(needed.items()), prices.kind(value))  # the pairs follow from it
    known = joints.get(key)
    if known is not None:
        return known
    pairs = tuple((S, L) for S in made for L in needed if prices.move(value, S, L) < math.inf)
    same = (key[0], key[1], pairs)  # values of other kinds with the same indicators and finite moves
    known = joints.get(same)
    if known is not None:
        joints[key] = known
        return known
    mu = joints[key] = joints[same] = {pair: _Sum((model.column(0.0, integral=False),), 0) for pair in pairs}
    rows: tuple[dict, dict] = ({}, {})  # per side, per layout: the mu columns with it (one pass: layouts compare slowly)
    for pair, joint in mu.items():
        for side in (0, 1):
            rows[side].setdefault(pair[side], {})[joint.columns[0]] = 1.0
    for layout, side, indicator in [(S, 0, X) for S, X in made.items()] + [(L, 1, D) for L, D in needed.items()]:
        model.row({**rows[side].get(layout, {}), **{col: -1.0 for col in indicator.columns}}, 0.0, 0.0)
    return mu


def _pay(model: _Model, price: float, joints: list[_Sum]) -> tuple[tuple | None, float]:
    """Where `price` is paid once when any of `joints` is 1: (None, price) when one is always 1
    (a constant), (the joint's columns, price) when it is the only one, else (a column `w` at
    least each of them, price); the caller adds the price there."""
    assert price < math.inf, "shrinking left a candidate that needs an impossible move"
    if price == 0:
        return (), 0.0
    if any(joint.constant for joint in joints):
        return None, price
    if len(joints) == 1:
        return joints[0].columns, price
    key = tuple(joints)
    if key not in model.paid:  # the same move of a tied value (a repeated layer's) shares it
        w = model.paid[key] = model.column(0.0, integral=False)
        for joint in joints:
            model.row({w: -1.0, **{col: 1.0 for col in joint.columns}}, -math.inf, 0.0)
    return (model.paid[key],), price


def _run(model: _Model, time_limit: float):
    """HiGHS on the model, with the objective rescaled (see `_OBJECTIVE_SCALE`)."""
    costs = np.array(model.costs, dtype=float)
    scale = _OBJECTIVE_SCALE / costs.max() if costs.size and costs.max() > 0 else 1.0
    rows, cols, coefs = zip(*model.entries, strict=True) if model.entries else ((), (), ())
    matrix = scipy.sparse.csr_array((coefs, (rows, cols)), shape=(len(model.lower), len(costs)))
    integral = np.array(model.integral)

    def milp(integrality, limit):
        return scipy.optimize.milp(
            costs * scale, integrality=integrality, bounds=scipy.optimize.Bounds(0.0, 1.0),
            constraints=scipy.optimize.LinearConstraint(matrix, model.lower, model.upper),
            options={"time_limit": limit, "mip_rel_gap": 0.0},
        )

    start = time.perf_counter()
    result = milp(np.zeros_like(integral), time_limit)  # the LP relaxation first: often integral (see docstring)
    if not (result.status == 0 and _integral(result.x, integral)):
        with silenced(1):  # HiGHS's branch and bound prints a debug line of its own now and then
            result = milp(integral, max(time_limit - (time.perf_counter() - start), 1.0))
    objective = None if result.x is None else math.fsum(model.offset) + float(costs @ result.x)
    return result, objective


def _integral(values, integral, tolerance: float = 1e-9) -> bool:
    """Whether the integer columns of an LP solution are all 0 or 1: then it is the MILP's optimum
    too (the relaxation's optimum is a lower bound that this solution attains)."""
    chosen = values[integral.astype(bool)]
    return bool(np.all(np.minimum(np.abs(chosen), np.abs(chosen - 1.0)) <= tolerance))


def _decode(x: dict, alive: dict, values) -> dict:
    """The candidate of each node, in node order: its only one, or the one whose `x` rounds to 1."""
    return {n: kept[0] if len(kept) == 1 else next(c for c in kept if values[x[n, c]] > 0.5)
            for n, kept in alive.items()}


# ---------------------------------------------------------------------------------------------
# solve
# ---------------------------------------------------------------------------------------------


def solve(problem: Problem, *, start: Choice | None = None, time_limit: float = 10.0) -> Solution:
    """The cheapest choice by `total_price`, found by a MILP (HiGHS) within `time_limit` seconds.

    `start`, a choice to fall back on (e.g. a greedy one), is returned when the MILP finds nothing
    cheaper in time; the result is never dearer than `start` (a start of infinite price is no
    fallback). `time_limit` bounds the MILP alone, not the shrinking and building before it.
    Raises `InfeasibleError` when no choice has a finite price, naming the node when the
    shrinking finds one left without candidates.

    >>> p = Problem(nodes=("a", "b"),
    ...             candidates={"a": (Candidate((), ("R",)), Candidate((), ("S",), 1.0)),
    ...                         "b": (Candidate(("S",), ("S",)),)},
    ...             edges={"b": (("a", 0),)}, move=lambda v, s, d: 5.0)
    >>> solve(p)
    Solution(choice={'a': 1, 'b': 0}, price=1.0, optimal=True, status='optimal')
    """
    start_price = math.inf if start is None or not allowed(problem, start) else total_price(problem, start)
    prices = _Prices(problem)
    alive = _prune(problem, prices)
    model, x = _build(problem, prices, alive)
    if problem.budget is not None:
        scale = max(problem.budget, 1.0)  # rows in units of the budget: coefficients near 1 for HiGHS
        for terms, constant in _memory_rows(problem, alive, x, model):
            if terms:
                model.row({col: w / scale for col, w in terms.items()}, -math.inf, (problem.budget - constant) / scale)
            elif constant > problem.budget * (1 + 1e-9):
                raise InfeasibleError(f"{constant:.0f} bytes are held whatever the choice, over the budget of "
                                      f"{problem.budget:.0f}")
    if not model.costs:
        choice = _decode(x, alive, ())
        if not allowed(problem, choice):
            raise InfeasibleError("the only choice left breaks a tie, a cut or the memory budget")
        return Solution(choice, total_price(problem, choice), optimal=True, status="optimal")
    result, objective = _run(model, time_limit)
    found = None if result.x is None else _decode(x, alive, result.x)
    price = math.inf if found is None else total_price(problem, found)
    if result.status == 0:
        assert math.isclose(price, objective, rel_tol=1e-9, abs_tol=1e-12), (
            f"the MILP's objective {objective!r} differs from the total_price {price!r} of its choice")
    if price <= start_price and price < math.inf:
        optimal = result.status == 0
        return Solution(found, price, optimal=optimal, status="optimal" if optimal else "feasible")
    if start_price < math.inf:
        return Solution(dict(start), start_price, optimal=False, status="start")
    if result.status == 2:
        raise InfeasibleError("the layouts the nodes need cannot all be met at once without an impossible move"
                              + (", within the memory budget" if problem.budget is not None else ""))
    raise ShardingError(Issue("solve", f"the MILP found no choice in {time_limit} s ({result.message})",
                              "raise time_limit, or pass a start choice to fall back on"))


def least_memory(problem: Problem, *, time_limit: float = 10.0) -> tuple[dict, float]:
    """The choice of finite price (keeping ties and cuts, ignoring `budget`) whose largest memory
    point is smallest, and that memory (`memory_of`): the least budget any choice fits.

    >>> p = Problem(nodes=("a",), candidates={"a": (Candidate((), ("R",)), Candidate((), ("S",), 1.0))},
    ...             edges={}, move=lambda v, s, d: 0.0, memory=({"a": (8.0, 4.0)},))
    >>> least_memory(p)
    ({'a': 1}, 4.0)
    """
    problem = with_sides(problem, budget=None)
    prices = _Prices(problem)
    alive = _prune(problem, prices)
    model, x = _build(problem, prices, alive)
    model.costs = [0.0] * len(model.costs)
    model.offset = []
    rows = _memory_rows(problem, alive, x, model)
    scale = max([1.0] + [c + math.fsum(terms.values()) for terms, c in rows])  # no point exceeds it: top <= 1
    top = model.column(1.0, integral=False)
    for terms, constant in rows:
        model.row({**{col: w / scale for col, w in terms.items()}, top: -1.0}, -math.inf, -constant / scale)
    model.costs[top] = 1.0
    result, _ = _run(model, time_limit)
    if result.x is None:
        raise ShardingError(Issue("least_memory", f"the MILP found no choice in {time_limit} s ({result.message})"))
    choice = _decode(x, alive, result.x)
    return choice, memory_of(problem, choice)
