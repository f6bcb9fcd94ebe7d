"""The redistribution planner against ground truth: plans land on the target layout, and running
them on the simulated mesh (`hpfun.redistribute`) moves the values without changing them.
"""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import hpfun
from hpfun import Layout, Mesh, Partial, Replicate, Shard
from hpfun.plan import redistribute_cost, redistribute_plan
from hpfun.testing import axis_orders

R = Replicate()
LOCAL_KINDS = {"chunk", "to_partial", "relabel"}

# ---------------------------------------------------------------------------------------------
# Strategies: a mesh, two layouts of one tensor on it, a shape both divide
# ---------------------------------------------------------------------------------------------


@st.composite
def meshes(draw, max_ranks=8):
    """1-3 axes of size >= 1 (size 1 included), at most `max_ranks` ranks."""
    ndim = draw(st.integers(1, 3))
    shape = []
    for _ in range(ndim):
        budget = max_ranks // math.prod(shape)
        shape.append(draw(st.sampled_from([n for n in (1, 2, 2, 3, 4, 8) if n <= budget])))
    return Mesh.simulated(tuple(shape), ("dp", "tp", "pp")[:ndim])


@st.composite
def layouts(draw, mesh, ndim):
    """Shard (about half the time), Replicate or Partial per axis; one reduce op per layout, mostly
    sum; several axes on one dim in any order."""
    reduce = draw(st.sampled_from(["sum", "sum", "sum", "avg", "max", "min"]))
    kinds = ["S", "S"] * bool(ndim) + ["R", "P"]
    chosen = []
    for _ in mesh.shape:
        kind = draw(st.sampled_from(kinds))
        chosen.append(Shard(draw(st.integers(0, ndim - 1))) if kind == "S" else R if kind == "R" else Partial(reduce))
    if ndim and draw(st.booleans()):  # all Shard axes on one dim
        dim = draw(st.integers(0, ndim - 1))
        chosen = [Shard(dim) if isinstance(p, Shard) else p for p in chosen]
    return draw(axis_orders(Layout(mesh, tuple(chosen))))


@st.composite
def transitions(draw):
    """(src, dst, shape): two different layouts on one mesh and a global shape both divide (numel <= 512)."""
    mesh = draw(meshes())
    ndim = draw(st.sampled_from([0, 1, 1, 2, 2, 3]))
    src = draw(layouts(mesh, ndim))
    dst = draw(layouts(mesh, ndim).filter(lambda layout: layout != src))
    shape = tuple(math.lcm(src.shard_factor(d), dst.shard_factor(d)) * draw(st.integers(1, 2)) for d in range(ndim))
    return src, dst, shape


# ---------------------------------------------------------------------------------------------
# Ground truth
# ---------------------------------------------------------------------------------------------

_REDUCE = {"sum": lambda s: s.sum(0), "avg": lambda s: s.mean(0), "max": lambda s: s.amax(0), "min": lambda s: s.amin(0)}


def assert_holds(x: hpfun.Sharded, t: torch.Tensor, exact: bool):
    """Every rank has the local shape, and every set of ranks holding one block (Partial terms
    reduced; each replica checked on its own) holds t's block there."""
    layout, mesh = x.layout, x.layout.mesh
    local = layout.local_shape(t.shape)
    assert all(tuple(s.shape) == local for s in x.shards)
    groups: dict[tuple, list] = {}
    for r, shard in enumerate(x.shards):
        coords = mesh.coords(r)
        groups.setdefault(tuple(0 if a in layout.partial_axes else c for a, c in enumerate(coords)), []).append(shard)
    reduces = {layout.placements[a].reduce for a in layout.partial_axes}
    reduce = _REDUCE[reduces.pop()] if reduces else (lambda s: s[0])
    for key, terms in groups.items():
        value = reduce(torch.stack(terms))
        expected = t[tuple(slice(o, o + n) for o, n in zip(layout.offsets(t.shape, key), local, strict=True))]
        assert torch.equal(value, expected) if exact else torch.allclose(value, expected, rtol=1e-12, atol=1e-12)


def random_tensor(shape, seed):
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------


@settings(max_examples=150)
@given(transitions(), st.integers(0, 2**16))
def test_redistribute_preserves_the_value(case, seed):
    """redistribute(from_global(t, src), dst) holds t in dst: full() == t and every replica's block is t's."""
    src, dst, shape = case
    t = random_tensor(shape, seed)
    y = hpfun.redistribute(hpfun.Sharded.from_global(t, src), dst)
    exact = not (src.partial_axes or dst.partial_axes)
    assert y.layout == dst and y.global_shape == shape
    assert_holds(y, t, exact)
    assert torch.equal(y.full(), t) if exact else torch.allclose(y.full(), t, rtol=1e-12, atol=1e-12)


@settings(max_examples=150)
@given(transitions())
def test_plan_steps_land_on_dst(case):
    """Applying the plan's steps to src in order gives dst."""
    src, dst, shape = case
    cur = src
    for step in redistribute_plan(src, dst, shape):
        cur = step.apply(cur)
    assert cur == dst


@settings(max_examples=150)
@example((hpfun.parse("[S(0), R] on {dp: 2, tp: 1}"), hpfun.parse("[R, S(0)] on {dp: 2, tp: 1}"), (2,)))
@example((hpfun.parse("[R, S(0)] on {dp: 2, tp: 1}"), hpfun.parse("[S(0), S(0)] on {dp: 2, tp: 1}"), (2,)))
@given(transitions())
def test_no_collective_over_a_size_one_axis(case):
    """Communicating steps (all-reduce, all-gather, reduce-scatter, all-to-all) only run over axes of size > 1."""
    src, dst, shape = case
    for step in redistribute_plan(src, dst, shape):
        if step.kind not in LOCAL_KINDS:
            assert all(src.mesh.shape[a] > 1 for a in step.axes), step


@settings(max_examples=100)
@given(transitions())
def test_plan_between_equal_layouts_is_empty(case):
    """A plan from a layout to itself has no steps and costs nothing."""
    src, _, shape = case
    assert redistribute_plan(src, src, shape) == ()
    assert redistribute_cost(src, src, shape, torch.float64) == (0.0, 0)


@settings(max_examples=150)
@given(transitions(), st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
def test_cost_is_zero_exactly_when_nothing_moves(case, dtype):
    """redistribute_cost counts the steps and is 0 bytes iff no step communicates over an axis of size > 1."""
    src, dst, shape = case
    plan = redistribute_plan(src, dst, shape)
    wire, n = redistribute_cost(src, dst, shape, dtype)
    assert n == len(plan)
    moves = [s for s in plan if s.kind not in LOCAL_KINDS and math.prod(src.mesh.shape[a] for a in s.axes) > 1]
    assert (wire == 0) == (not moves)
    assert wire >= 0


# ---------------------------------------------------------------------------------------------
# Minimal plans on {dp: 2, tp: 2}
# ---------------------------------------------------------------------------------------------

MESH = "{dp: 2, tp: 2}"


def _layout(placements: str) -> Layout:
    return hpfun.parse(f"{placements} on {MESH}")


def _kinds(src: str, dst: str, shape=(4, 4)):
    return [(step.kind, step.axes) for step in redistribute_plan(_layout(src), _layout(dst), shape)]


@pytest.mark.parametrize(("src", "dst", "plan"), [
    ("[P(sum), R]", "[R, R]", [("all_reduce", (0,))]),
    ("[S(0), R]", "[R, R]", [("all_gather", (0,))]),
    ("[P(sum), R]", "[S(0), R]", [("reduce_scatter", (0,))]),
    ("[S(0), R]", "[S(1), R]", [("all_to_all", (0,))]),
    ("[R, R]", "[S(0), S(0)]", [("chunk", (0,)), ("chunk", (1,))]),
    ("[R, R]", "[P(sum), R]", [("to_partial", (0,))]),
    ("[S(0), S(0)]", "[S(0), R]", [("all_gather", (1,))]),
    ("[P(sum), P(sum)]", "[R, R]", [("all_reduce", (0, 1))]),
])
def test_minimal_plans(src, dst, plan):
    assert _kinds(src, dst) == plan


def test_minimal_plan_steps_and_cost():
    src, dst = _layout("[P(sum), R]"), _layout("[R, R]")
    (step,) = redistribute_plan(src, dst, (4, 4))
    assert isinstance(step, hpfun.plan.AllReduce) and step.reduce == "sum" and step.axes == (0,)
    assert redistribute_cost(src, dst, (4, 4), torch.float64) == (128.0, 1)  # ring: 2 (n-1)/n of 128 B
    assert redistribute_cost(_layout("[R, R]"), _layout("[S(0), S(0)]"), (4, 4), torch.float64) == (0.0, 2)


@pytest.mark.parametrize(("src", "dst"), [
    ("[S(0), S(0)]", "[R, S(0)]"),
    ("[S(0), S(1)]", "[S(1), S(0)]"),
    ("[P(sum), S(1)]", "[S(1), P(sum)]"),
    ("[P(sum), P(sum)]", "[S(0), S(0)]"),
    ("[S(0), S(0)]", "[S(1), S(1)]"),
])
def test_examples_keep_values(src, dst):
    t = random_tensor((4, 8), seed=0)
    y = hpfun.redistribute(hpfun.Sharded.from_global(t, _layout(src)), _layout(dst))
    assert_holds(y, t, exact="P" not in src + dst)
    assert torch.allclose(y.full(), t, rtol=1e-12, atol=1e-12)


def test_every_transition_on_2x2_keeps_values():
    every = [f"[{a}, {b}]" for a in ("R", "S(0)", "S(1)", "P(sum)") for b in ("R", "S(0)", "S(1)", "P(sum)")]
    t = random_tensor((4, 8), seed=2)
    wrong = []
    for src in every:
        x = hpfun.Sharded.from_global(t, _layout(src))
        for dst in every:
            y = hpfun.redistribute(x, _layout(dst))
            try:
                assert_holds(y, t, exact="P" not in src + dst)
            except AssertionError:
                wrong.append(f"{src} -> {dst}")
    assert not wrong


def test_zero_size_dims_redistribute():
    t = torch.zeros(0, 4, dtype=torch.float64)
    for src, dst in [("[S(0), R]", "[S(1), R]"), ("[P(sum), S(1)]", "[R, R]"), ("[R, R]", "[S(0), S(1)]")]:
        y = hpfun.redistribute(hpfun.Sharded.from_global(t, _layout(src)), _layout(dst))
        assert y.full().shape == (0, 4) and all(s.shape == _layout(dst).local_shape((0, 4)) for s in y.shards)


def test_redistribute_normalizes_negative_dims():
    t = random_tensor((4, 8), seed=1)
    y = hpfun.redistribute(hpfun.Sharded.from_global(t, _layout("[S(0), R]")), _layout("[S(-1), R]"))
    assert y.layout == _layout("[S(1), R]")
    assert_holds(y, t, exact=True)


def test_redistribute_to_another_mesh_is_an_error():
    x = hpfun.Sharded.from_global(torch.zeros(4), hpfun.parse("[S(0)] on {dp: 2}"))
    with pytest.raises(hpfun.HpfunError, match="mesh"):
        hpfun.redistribute(x, hpfun.parse("[R] on {tp: 2}"))


def test_all_gather_is_priced_by_the_buffer_it_produces():
    """A ring all-gather moves (n-1)/n of its output (n inputs): on 4 ranks, 3 local blocks."""
    src = hpfun.parse("[S(0)] on {dp: 4}")
    dst = hpfun.parse("[R] on {dp: 4}")
    wire, steps = redistribute_cost(src, dst, (8, 4), torch.float32)
    assert (wire, steps) == (3 * 2 * 4 * 4, 1)  # each rank receives three (2, 4) float32 blocks
