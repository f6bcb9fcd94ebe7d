"""The strategy-choice solver against brute force: the MILP's choice is as cheap as the cheapest of
all choices, its price is `total_price` of its choice, a start is never beaten by something dearer,
and a problem without a finite choice names its node.
"""

import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpfun.errors import ShardingError
from hpfun.solve import (
    Candidate, InfeasibleError, Problem, ProblemError, Solution, brute_force, solve, total_price,
)

inf = math.inf
LAYOUTS = ("R", "S0", "S1", "P")


def table_move(table: dict, weights: dict | None = None):
    """A move price from a (src, dst) table, scaled per value by `weights` (1 when absent)."""
    return lambda value, src, dst: table[src, dst] * (weights or {}).get(value, 1)


def greedy_in_order(problem: Problem) -> dict:
    """Each node in turn takes the candidate cheapest given its producers' choices (the way a
    one-pass walk chooses): local price plus the moves of its inputs."""
    choice = {}
    for n in problem.nodes:
        def local(c, n=n):
            cand = problem.candidates[n][c]
            made = [problem.candidates[p][choice[p]].outputs[i] for p, i in problem.inputs(n)]
            return cand.price + sum(0 if s == d else problem.move(v, s, d)
                                    for v, s, d in zip(problem.inputs(n), made, cand.inputs, strict=True))
        choice[n] = min(range(len(problem.candidates[n])), key=local)
    return choice


def solve_unless_infeasible(problem: Problem) -> Solution | None:
    """`solve(problem)`; None where brute force finds no choice of finite price (and then
    solve must raise InfeasibleError too)."""
    try:
        brute_force(problem)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve(problem)
        return None
    return solve(problem)


def assert_cheapest(problem: Problem, solution: Solution) -> None:
    _, best = brute_force(problem)
    assert math.isclose(solution.price, best, rel_tol=1e-9, abs_tol=1e-12)
    assert solution.price == total_price(problem, solution.choice)


# ---------------------------------------------------------------------------------------------
# Random small problems
# ---------------------------------------------------------------------------------------------


@st.composite
def problems(draw):
    """A DAG of 2-7 nodes, 1-4 candidates each over 4 layouts, 0-3 inputs and 1-2 outputs per node,
    prices with a few inf, a move table with a few inf scaled per value, and some sinks."""
    count = draw(st.integers(2, 7))
    nodes = tuple(f"n{i}" for i in range(count))
    layout = st.sampled_from(LAYOUTS)
    n_outputs, candidates, edges = {}, {}, {}
    for i, n in enumerate(nodes):
        n_outputs[n] = draw(st.integers(1, 2))
        edges[n] = tuple(draw(st.lists(st.sampled_from([(p, k) for p in nodes[:i] for k in range(n_outputs[p])]),
                                       max_size=3))) if i else ()
        candidates[n] = tuple(
            Candidate(inputs=draw(st.lists(layout, min_size=len(edges[n]), max_size=len(edges[n]))),
                      outputs=draw(st.lists(layout, min_size=n_outputs[n], max_size=n_outputs[n])),
                      price=draw(st.sampled_from([0, 0.5, 1, 2, 3, 4.25, 7, inf])))
            for _ in range(draw(st.integers(1, 4))))
    values = [(n, k) for n in nodes for k in range(n_outputs[n])]
    table = {(s, d): draw(st.sampled_from([0, 1, 1.5, 2, 4, 6, 10, inf])) for s in LAYOUTS for d in LAYOUTS if s != d}
    weights = {v: draw(st.sampled_from([1, 2, 3])) for v in values}
    sinks = {v: frozenset(draw(st.lists(layout, min_size=1, max_size=2)))
             for v in values if draw(st.booleans())}
    return Problem(nodes, candidates, edges, table_move(table, weights), sinks)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(problems())
def test_solve_is_as_cheap_as_brute_force(problem):
    """The solver's price equals the brute-force minimum and is the total_price of its choice."""
    solution = solve_unless_infeasible(problem)
    if solution is None:
        return
    assert solution.optimal and solution.status == "optimal"
    assert_cheapest(problem, solution)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_a_start_is_never_beaten_by_a_dearer_choice(data):
    """Given any start choice, the result is never dearer than it (and still the optimum)."""
    problem = data.draw(problems())
    start = {n: data.draw(st.integers(0, len(problem.candidates[n]) - 1)) for n in problem.nodes}
    if total_price(problem, start) == inf:
        return
    solution = solve(problem, start=start)
    assert solution.price <= total_price(problem, start)
    assert_cheapest(problem, solution)


@st.composite
def repeated_layers(draw):
    """An input node, then 2-3 copies of one layer of 2 nodes (each reads the one before it; the
    second may also read the layer's input), the copies' nodes tied, as automatic sharding ties
    repeated layers. With `differ`, one copy's candidates are redrawn (the same count): a tie
    of nodes whose candidates differ."""
    layout = st.sampled_from(LAYOUTS)
    count = draw(st.integers(2, 3))
    shapes = [draw(st.integers(1, 3)) for _ in range(2)]  # candidates per layer node
    skip = draw(st.booleans())

    def layer_candidates():
        out = []
        for k, size in enumerate(shapes):
            reads = 2 if k == 1 and skip else 1
            out.append(tuple(Candidate(draw(st.lists(layout, min_size=reads, max_size=reads)), (draw(layout),),
                                       draw(st.sampled_from([0, 0.5, 1, 3, inf]))) for _ in range(size)))
        return out

    template = layer_candidates()
    differ = draw(st.sampled_from([None, *range(count)]))
    nodes, candidates, edges = ["in"], {"in": tuple(Candidate((), (draw(layout),)) for _ in range(2))}, {}
    ties = [[], []]
    previous = ("in", 0)
    for i in range(count):
        cands = layer_candidates() if i == differ else template
        a, b = f"a{i}", f"b{i}"
        nodes += [a, b]
        candidates[a], candidates[b] = cands
        edges[a] = (previous,)
        edges[b] = ((a, 0), previous) if skip else ((a, 0),)
        ties[0].append(a)
        ties[1].append(b)
        previous = (b, 0)
    table = {(s, d): draw(st.sampled_from([1, 2, 4, inf])) for s in LAYOUTS for d in LAYOUTS if s != d}
    sinks = {previous: frozenset({draw(layout)})}
    kinds = {("in", 0): "x", **{(n, 0): "a" if n[0] == "a" else "x" for n in nodes[1:]}}  # a layer's values alike
    return Problem(nodes, candidates, edges, table_move(table), sinks, ties=ties, kind=kinds.__getitem__)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(repeated_layers())
def test_tied_repeated_layers_solve_as_brute_force(problem):
    """Ties of repeated layers (tied nodes share their columns and, with equal candidates, how a
    value they make and read is delivered) keep the optimum brute force finds among the choices
    that keep the ties, also where the tied nodes' candidates differ."""
    solution = solve_unless_infeasible(problem)
    if solution is None:
        return
    assert all(len({solution.choice[n] for n in tie}) == 1 for tie in problem.ties)
    assert_cheapest(problem, solution)


# ---------------------------------------------------------------------------------------------
# Hand-written cases
# ---------------------------------------------------------------------------------------------

MOVE_10 = table_move({(s, d): 10.0 for s in LAYOUTS for d in LAYOUTS if s != d})


def test_an_early_choice_that_pays_later():
    """a is cheapest in R, but its reader needs S0: producing S0 at once beats moving it later."""
    problem = Problem(
        nodes=("a", "b"),
        candidates={"a": (Candidate((), ("R",), 0.0), Candidate((), ("S0",), 1.0)),
                    "b": (Candidate(("S0",), ("S0",), 0.0),)},
        edges={"b": (("a", 0),)}, move=MOVE_10)
    solution = solve(problem)
    assert solution.choice == {"a": 1, "b": 0} and solution.price == 1.0
    assert total_price(problem, greedy_in_order(problem)) == 10.0
    assert_cheapest(problem, solution)


def test_one_gather_serves_two_readers():
    """Two readers that each would rather not gather alone share one gather of the same value."""
    reader = (Candidate(("R",), ("R",), 1.0), Candidate(("S0",), ("S0",), 7.0))
    problem = Problem(
        nodes=("a", "b", "c"),
        candidates={"a": (Candidate((), ("S0",), 0.0),), "b": reader, "c": reader},
        edges={"b": (("a", 0),), "c": (("a", 0),)}, move=MOVE_10)
    assert total_price(problem, {"a": 0, "b": 0, "c": 0}) == 12.0  # 1 + 1 + one gather of 10
    assert total_price(problem, greedy_in_order(problem)) == 14.0
    solution = solve(problem)
    assert solution.choice == {"a": 0, "b": 0, "c": 0} and solution.price == 12.0


def test_a_sink_is_priced_to_its_cheapest_accepted_layout():
    """A graph output pays the cheapest move to a layout it accepts, nothing when already in one."""
    table = {(s, d): 10.0 for s in LAYOUTS for d in LAYOUTS if s != d} | {("S0", "P"): 2.0}
    problem = Problem(
        nodes=("a",), candidates={"a": (Candidate((), ("S0",), 0.0), Candidate((), ("S1",), 3.0))},
        edges={}, move=table_move(table), sinks={("a", 0): frozenset({"R", "P"})})
    assert [total_price(problem, {"a": c}) for c in (0, 1)] == [2.0, 13.0]
    assert solve(problem).choice == {"a": 0}


def test_the_same_problem_gives_the_same_choice():
    """Ties (here all prices equal) are broken the same way on every run."""
    problem = ladder(200, seed=3, back=(1,), flat=True)
    assert len({tuple(solve(problem).choice.values()) for _ in range(3)}) == 1


# ---------------------------------------------------------------------------------------------
# start, infeasible problems, malformed problems
# ---------------------------------------------------------------------------------------------


def test_a_tiny_time_limit_keeps_the_start():
    """With no time to search, the result is the start or something no dearer."""
    problem = ladder(400, seed=1, impossible=False)
    start = greedy_in_order(problem)
    solution = solve(problem, start=start, time_limit=1e-3)
    assert solution.price <= total_price(problem, start)
    assert solution.status in {"start", "feasible", "optimal"}
    if solution.status == "start":
        assert solution.choice == start and not solution.optimal


def test_an_optimal_start_is_kept_when_the_milp_cannot_beat_it():
    """The optimum as start: whatever the MILP finds in its time, the price stays optimal."""
    problem = ladder(6, seed=2)
    best, price = brute_force(problem)
    assert solve(problem, start=best, time_limit=1e-3).price == price


def test_no_time_and_no_start_is_a_clear_error_or_a_choice():
    """Without a start, a MILP that finds nothing in time says how to fix it."""
    problem = ladder(400, seed=1)
    try:
        solution = solve(problem, time_limit=1e-3)
    except ShardingError as e:
        assert "raise time_limit, or pass a start" in str(e)
    else:
        assert solution.price == total_price(problem, solution.choice)


def test_all_moves_impossible_names_the_node():
    """A reader that needs a layout its producer can only reach by impossible moves is named."""
    impossible = table_move({(s, d): inf for s in LAYOUTS for d in LAYOUTS if s != d})
    problem = Problem(
        nodes=("a", "b"),
        candidates={"a": (Candidate((), ("R",)), Candidate((), ("P",))),
                    "b": (Candidate(("S0",), ("S0",)), Candidate(("S1",), ("S1",)))},
        edges={"b": (("a", 0),)}, move=impossible)
    with pytest.raises(InfeasibleError, match=r"node '[ab]': has no usable candidate"):
        solve(problem)
    with pytest.raises(InfeasibleError):
        brute_force(problem)


def test_infinite_prices_name_every_such_node():
    """Nodes whose every candidate has an infinite price are all listed."""
    problem = Problem(
        nodes=("a", "b", "c"),
        candidates={"a": (Candidate((), ("R",), inf),), "b": (Candidate((), ("R",), 1.0),),
                    "c": (Candidate((), ("R",), inf), Candidate((), ("R",), inf))},
        edges={}, move=MOVE_10)
    with pytest.raises(InfeasibleError, match=r"(?s)node 'a'.*node 'c'"):
        solve(problem)


def test_a_conflict_no_single_edge_shows_is_infeasible():
    """Each candidate is compatible with some candidate of each neighbour, but no choice fits all
    three nodes at once: the MILP proves it."""
    impossible = table_move({(s, d): inf for s in LAYOUTS for d in LAYOUTS if s != d})
    problem = Problem(
        nodes=("a", "b", "c"),
        candidates={"a": (Candidate((), ("R",)), Candidate((), ("P",))),
                    "b": (Candidate(("R",), ("S0",)), Candidate(("P",), ("S1",))),
                    "c": (Candidate(("R", "S1"), ()), Candidate(("P", "S0"), ()))},
        edges={"b": (("a", 0),), "c": (("a", 0), ("b", 0))}, move=impossible)
    with pytest.raises(InfeasibleError, match="cannot all be met"):
        solve(problem)
    with pytest.raises(InfeasibleError):
        brute_force(problem)


def test_a_malformed_problem_lists_every_problem():
    """Edges to later nodes and slot counts that differ from the candidates' are all reported."""
    with pytest.raises(ProblemError) as e:
        Problem(nodes=("a", "b"),
                candidates={"a": (Candidate(("R",), ("R",)),), "b": (Candidate(("R",), ("R",)),)},
                edges={"a": (("b", 0),)}, move=MOVE_10, sinks={("z", 0): frozenset({"R"})})
    assert len(e.value.problems) == 3
    with pytest.raises(ProblemError, match="price must be >= 0"):
        Candidate((), (), -1.0)


def test_brute_force_refuses_large_problems():
    with pytest.raises(ValueError, match="exceed the limit"):
        brute_force(ladder(20, seed=0))


# ---------------------------------------------------------------------------------------------
# Scale
# ---------------------------------------------------------------------------------------------


def ladder(count: int, seed: int, back: tuple = (1, 2), flat: bool = False, impossible: bool = True) -> Problem:
    """Node i reads nodes i-1, i-2 (by default; a chain for `back=(1,)`); 4 candidates each, with
    random input layouts and prices, random move prices, P -> S1 impossible when `impossible`
    (all prices 1 when `flat`), and the last node's output wanted in R."""
    rng = random.Random(seed)
    nodes = tuple(range(count))
    edges = {i: tuple((i - b, 0) for b in back if i - b >= 0) for i in nodes}
    candidates = {i: tuple(Candidate([rng.choice(LAYOUTS) for _ in edges[i]], [LAYOUTS[c]],
                                     1.0 if flat else rng.choice([0.5, 1, 2, 3, 5]))
                           for c in range(4)) for i in nodes}
    table = {(s, d): 1.0 if flat else rng.choice([1, 2, 4, 8]) for s in LAYOUTS for d in LAYOUTS if s != d}
    if impossible:
        table["P", "S1"] = inf
    return Problem(nodes, candidates, edges, table_move(table), {(count - 1, 0): frozenset({"R"})})


def test_a_chain_of_2000_nodes_solves_in_seconds():
    """2000 nodes of 4 candidates with random layouts and prices: optimal, well within a minute."""
    problem = ladder(2000, seed=0, back=(1,))
    start = greedy_in_order(problem)
    began = time.perf_counter()
    solution = solve(problem, start=start, time_limit=60)
    elapsed = time.perf_counter() - began
    print(f"2000-node chain: {elapsed:.2f} s, price {solution.price} (greedy {total_price(problem, start)})")
    assert solution.optimal and elapsed < 60
    assert solution.price <= total_price(problem, start)
