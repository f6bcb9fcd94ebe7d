"""Several mesh axes on one dim in any order, as JAX allows: `P(None, ("b", "a"))` on a mesh
("a", "b") splits dim 1 b-major (rank coords (a, b) hold block b * n_a + a). The layout carries
the order; offsets, the planner, the collectives, lowering, RNG, rules, the notation and the
picture follow it.
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpfun
from hpfun import Layout, LayoutError, P, Partial, Replicate, Shard
from hpfun.plan import redistribute_plan
from hpfun.rules import OpCall, TensorArg, TensorMeta, keep_orders, lookup
from hpfun.sharded import local_block
from hpfun.testing import axis_orders, divisible_shapes, layouts, meshes

R = Replicate()
aten = torch.ops.aten
MESH = hpfun.Mesh.simulated((2, 2), ("a", "b"))
BA = P(None, ("b", "a"))  # the reproducer: dim 1 split b-major


def _rand(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# The reproducer: P(None, ("b", "a")) on a (2, 2) mesh
# ---------------------------------------------------------------------------------------------


def test_spec_splits_major_first_in_the_order_given():
    """P(None, ("b", "a")): rank (a, b) holds block b * 2 + a of dim 1; the layout says so."""
    layout = BA.to_layout(MESH, 2)
    assert layout.placements == (Shard(1), Shard(1)) and layout.shard_axes(1) == (1, 0)
    assert str(layout) == "[S(1)[1], S(1)[0]] on {a: 2, b: 2}"
    assert layout != P(None, ("a", "b")).to_layout(MESH, 2)
    x = _rand(2, 8)
    held = hpfun.Sharded.from_global(x, layout)
    for rank in range(4):
        a, b = MESH.coords(rank)
        block = b * 2 + a
        assert torch.equal(held.shards[rank], x[:, 2 * block : 2 * block + 2])
    assert torch.equal(held.full(), x)


def test_matmul_with_reordered_contraction_dim_matches_unsharded():
    """x @ w with the contracted dim split (b, a) in both: local products, one all-reduce, no reorder."""
    x, w = _rand(4, 8), _rand(8, 6, seed=1)
    f = hpfun.shard(lambda x, w: x @ w, mesh=MESH, in_specs=(BA, P(("b", "a"), None)), out_specs=P())
    torch.testing.assert_close(f(x, w).full(), x @ w, rtol=1e-12, atol=1e-12)
    assert [(c.kind, c.axes) for c in f.lower(x, w).collectives] == [("all_reduce", ("a", "b"))]


def test_matmul_with_reordered_output_dim_matches_unsharded():
    """w's output columns split (b, a): the product keeps that order, with no collective."""
    x, w = _rand(4, 8), _rand(8, 12, seed=1)
    f = hpfun.shard(lambda x, w: x @ w, mesh=MESH, in_specs=(P(), BA), out_specs=None)
    out = f(x, w)
    assert out.layout == BA.to_layout(MESH, 2) and f.lower(x, w).collectives == []
    torch.testing.assert_close(out.full(), x @ w, rtol=1e-12, atol=1e-12)
    g = hpfun.shard(lambda x, w: x @ w, mesh=MESH, in_specs=(P(), BA), out_specs=P(None, ("a", "b")))
    torch.testing.assert_close(g(x, w).full(), x @ w, rtol=1e-12, atol=1e-12)


def test_pointwise_keeps_the_order_and_matches_unsharded():
    """A pointwise chain on a (b, a)-split input runs locally and returns the same layout."""
    x, y = _rand(4, 8), _rand(4, 8, seed=2)
    f = hpfun.shard(lambda x, y: torch.sin(x) * y + 1, mesh=MESH, in_specs=(BA, BA), out_specs=None)
    out = f(x, y)
    assert out.layout == BA.to_layout(MESH, 2) and f.lower(x, y).collectives == []
    assert torch.equal(out.full(), torch.sin(x) * y + 1)


def test_mixed_orders_meet_and_match_unsharded():
    """x split (b, a), y split (a, b) on the same dim: one is moved, the sum is right."""
    x, y = _rand(4, 8), _rand(4, 8, seed=2)
    f = hpfun.shard(lambda x, y: x + y, mesh=MESH, in_specs=(BA, P(None, ("a", "b"))), out_specs=P())
    assert torch.equal(f(x, y).full(), x + y)


def test_views_reductions_and_lookups_follow_the_order():
    """Transpose, reshape, a reduction and a vocab-split embedding under (b, a) orders."""
    x = _rand(8, 12)

    def fn(x, table, ids):
        h = x.t().reshape(12, 2, 4).sum(1)
        return h, torch.nn.functional.embedding(ids, table)

    table, ids = _rand(16, 3, seed=3), torch.randint(0, 16, (5,), generator=torch.Generator().manual_seed(4))
    f = hpfun.shard(fn, mesh=MESH, in_specs=(BA, P(("b", "a"), None), P()), out_specs=None)
    h, e = f(x, table, ids)
    want_h, want_e = fn(x, table, ids)
    torch.testing.assert_close(h.full(), want_h, rtol=1e-12, atol=1e-12)
    assert torch.equal(e.full(), want_e)


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 2, 1)])
@pytest.mark.parametrize("pick", [lambda x: x[:, 0], lambda x: x.select(1, -1), lambda x: x.unbind(1)[2],
                                  lambda x: x.narrow(1, 1, 1), lambda x: x[:, :1]],
                         ids=["index", "select", "unbind", "narrow", "slice"])
def test_a_pick_along_one_split_dim_keeps_the_order_of_another(shape, pick):
    """A few rows picked along a split dim (summed across its blocks) keep the tp-major blocks
    of the other dim, forward and backward (they came out in mesh order: rows 0, 8, 4, 12)."""
    mesh = hpfun.Mesh.simulated(shape, ("dp", "tp", "pp"))
    x = torch.arange(64, dtype=torch.float64).reshape(8, 8)
    spec = P(("tp", "dp"), "pp")
    got = hpfun.shard(pick, mesh=mesh, in_specs=(spec,), out_specs=P())(x)
    assert torch.equal(got.full(), pick(x))
    grad = hpfun.shard(torch.func.grad(lambda x: pick(x).sin().mul(torch.arange(8.0, dtype=x.dtype)).sum()),
                       mesh=mesh, in_specs=(spec,), out_specs=spec)
    torch.testing.assert_close(grad(x).full(), torch.func.grad(
        lambda x: pick(x).sin().mul(torch.arange(8.0, dtype=x.dtype)).sum())(x), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Redistribution between every pair of orders and placements
# ---------------------------------------------------------------------------------------------


def _every_layout(mesh, ndim, partial):
    """Every layout of a `ndim`-dim tensor on `mesh`, each dim's axes in every order."""
    options = [R, *(Shard(d) for d in range(ndim)), *([Partial("sum")] if partial else [])]
    out = []
    for placements in itertools.product(options, repeat=mesh.ndim):
        found = [Layout(mesh, placements)]
        for d in found[0].sharded_dims():
            axes = found[0].shard_axes(d)
            found = [lay.with_order(d, perm) for lay in found for perm in itertools.permutations(axes)]
        out += [lay for lay in dict.fromkeys(found) if lay not in out]
    return out


def _check_every_pair(mesh, layouts, t):
    wrong = []
    for src in layouts:
        x = hpfun.Sharded.from_global(t, src)
        for dst in layouts:
            y = hpfun.redistribute(x, dst)
            exact = not (src.partial_axes or dst.partial_axes)
            ok = y.layout == dst and (torch.equal(y.full(), t) if exact else torch.allclose(y.full(), t, atol=1e-12))
            if not dst.partial_axes:
                ok = ok and all(torch.equal(y.shards[r], local_block(t, dst, mesh.coords(r))) for r in range(mesh.size))
            if not ok:
                wrong.append(f"{src} -> {dst}: {[str(s) for s in redistribute_plan(src, dst, t.shape)]}")
    assert not wrong, "\n".join(wrong)


def test_every_pair_on_2x2_with_partial():
    """Every (placements, order) to every other on {a: 2, b: 2}: .full() and every block exact."""
    layouts = _every_layout(MESH, 2, partial=True)
    assert len(layouts) == 18  # 16 placements, and [S(0), S(0)] and [S(1), S(1)] both ways
    _check_every_pair(MESH, layouts, torch.arange(64.0, dtype=torch.float64).reshape(8, 8))


def test_every_order_of_three_axes_on_one_dim():
    """Three axes on one dim (six orders) and two of them (with the third elsewhere or not)."""
    mesh = hpfun.Mesh.simulated((2, 2, 2), ("a", "b", "c"))
    layouts = [lay for lay in _every_layout(mesh, 2, partial=False)
               if max(len(lay.shard_axes(d)) for d in range(2)) > 1]
    _check_every_pair(mesh, layouts[::3] + [lay for lay in layouts if len(lay.shard_axes(0)) == 3],
                      torch.arange(16.0 * 8, dtype=torch.float64).reshape(16, 8))


def test_axes_of_size_one_do_not_make_an_order():
    """An axis of size 1 moves no block: orders that differ only in its place are one layout."""
    mesh = hpfun.Mesh.simulated((2, 1, 2), ("a", "c", "b"))
    ba = P(("b", "a", "c")).to_layout(mesh, 1)
    assert ba == P(("c", "b", "a")).to_layout(mesh, 1) == P(("b", "c", "a")).to_layout(mesh, 1)
    assert P(("a", "b", "c")).to_layout(mesh, 1) == P(("c", "a", "b")).to_layout(mesh, 1) == Layout(mesh, (Shard(0),) * 3)
    _check_every_pair(mesh, _every_layout(mesh, 1, partial=True), torch.arange(8.0, dtype=torch.float64))


def test_order_change_alone_is_planned_and_priced():
    """(a, b) -> (b, a) on one dim gathers and splits again: it communicates, and lands."""
    src, dst = P(("a", "b")).to_layout(MESH, 1), P(("b", "a")).to_layout(MESH, 1)
    plan = redistribute_plan(src, dst, (8,))
    assert [s.kind for s in plan] == ["all_gather", "all_gather", "chunk", "chunk"]
    assert hpfun.plan.redistribute_cost(src, dst, (8,), torch.float32)[0] > 0
    cur = src
    for step in plan:
        cur = step.apply(cur)
    assert cur == dst


def test_partial_reduce_scatters_into_a_reordered_split():
    """P(sum) on a, b already splitting the dim: a reduce-scatter puts a after b, no all-reduce."""
    src = Layout(MESH, (Partial(), Shard(0)))
    dst = P(("b", "a")).to_layout(MESH, 1)
    assert [s.kind for s in redistribute_plan(src, dst, (8,))] == ["reduce_scatter"]
    t = _rand(8)
    y = hpfun.redistribute(hpfun.Sharded.from_global(t, src), dst)
    torch.testing.assert_close(y.full(), t, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# RNG: the same values whatever the order
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [P(), P(("a", "b")), P(("b", "a")), P(None, ("b", "a")), P("b", "a"), P(("b", "a"), None)])
def test_random_values_do_not_depend_on_the_order(spec):
    """rand_like, randn and dropout give the one-device values for every order of the axes."""
    def draw(x):
        return torch.rand_like(x), torch.randn(x.shape) + x, torch.nn.functional.dropout(x, 0.5)

    x = _rand(8, 4)
    one = hpfun.shard(draw, mesh=hpfun.Mesh.simulated((1,), ("a",)), in_specs=P())
    sharded = hpfun.shard(draw, mesh=MESH, in_specs=spec)
    with hpfun.random_seed(11):
        expected = [v.full() for v in one(x)]
    with hpfun.random_seed(11):
        got = sharded(x)
    assert all(torch.equal(g.full(), e) for g, e in zip(got, expected, strict=True))
    assert got[0].layout == spec.to_layout(MESH, 2)  # drawn where the input stands, order included


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_random_values_on_three_axes_in_any_order(data):
    """On a {2, 2, 2} mesh, any dims and orders: rand_like is the one-device draw."""
    mesh = hpfun.Mesh.simulated((2, 2, 2), ("a", "b", "c"))
    layout = data.draw(layouts(mesh, (8, 8)))
    f = hpfun.shard(torch.rand_like, mesh=mesh, in_specs=P.from_layout(layout, 2))
    one = hpfun.shard(torch.rand_like, mesh=hpfun.Mesh.simulated((1,), ("a",)), in_specs=P())
    x = torch.empty(8, 8)
    with hpfun.random_seed(5):
        got = f(x)
    with hpfun.random_seed(5):
        assert torch.equal(got.full(), one(x).full()) and got.layout == layout


# ---------------------------------------------------------------------------------------------
# Rules keep an input's order where it can serve
# ---------------------------------------------------------------------------------------------


def _call(op, *args, outputs):
    return OpCall(op, args, {}, tuple(TensorMeta(s, torch.float32) for s in outputs), MESH)


def test_keep_orders_offers_the_input_order_to_every_tensor():
    """add(x, y) with x split (b, a): the rule's strategies come again with (b, a) in x, y and out."""
    ordered, default = BA.to_layout(MESH, 2), P(None, ("a", "b")).to_layout(MESH, 2)
    x, y = TensorArg((4, 8), torch.float32, ordered, 0), TensorArg((4, 8), torch.float32, default, 1)
    call = _call(aten.add.Tensor, x, y, outputs=[(4, 8)])
    strategies = keep_orders(call, lookup(aten.add.Tensor).strategies(call))
    assert any(s.inputs == (ordered, ordered) and s.outputs == (ordered,) for s in strategies)
    assert any(s.inputs == (default, default) and s.outputs == (default,) for s in strategies)
    assert all(len({lay.order for lay in s.inputs + s.outputs if lay.shard_axes(1)}) <= 1 for s in strategies)


def test_keep_orders_skips_a_strategy_the_order_cannot_serve():
    """A tensor split over some of the group's axes only would see renumbered ranks: no variant."""
    ordered = BA.to_layout(MESH, 2)
    split_a = Layout(MESH, (Shard(1), R))
    x = TensorArg((4, 8), torch.float32, ordered, 0)
    call = _call(aten.add.Tensor, x, outputs=[(4, 8)])
    base = hpfun.rules.Strategy((Layout(MESH, (Shard(1), Shard(1))),), (split_a,))
    assert keep_orders(call, [base]) == [base]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_sharded_ops_match_unsharded_for_drawn_orders(data):
    """A small program (matmul, pointwise, reduction, transpose) on drawn layouts with orders."""
    mesh = data.draw(meshes(max_ranks=8, ndims=(2, 3), sizes=(1, 2)))
    x_layout = data.draw(layouts(mesh, 2))
    w_layout = data.draw(layouts(mesh, 2))
    x_shape = data.draw(divisible_shapes(x_layout, 2))
    w_shape = (x_shape[1], 4 * data.draw(st.integers(1, 2)))
    if not w_layout.fits(w_shape):
        w_layout = Layout.replicated(mesh)
    x, w = _rand(*x_shape), _rand(*w_shape, seed=1)

    def fn(x, w):
        h = torch.tanh(x @ w)
        return h.sum(0), (h * 2).t()

    f = hpfun.shard(fn, mesh=mesh, in_specs=(P.from_layout(x_layout, 2), P.from_layout(w_layout, 2)), out_specs=None)
    for got, want in zip(f(x, w), fn(x, w), strict=True):
        torch.testing.assert_close(got.full(), want, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# Notation, specs, errors, picture
# ---------------------------------------------------------------------------------------------


@given(st.data())
def test_parse_and_spec_round_trip_with_orders(data):
    """parse(str(layout)), parse(placements_str(), mesh) and P.from_layout give the layout back."""
    mesh = data.draw(meshes(max_ranks=8, ndims=(1, 2, 3), sizes=(1, 2, 3)))
    ndim = data.draw(st.integers(1, 3))
    layout = data.draw(layouts(mesh, ndim, allow_partial=("sum",)))
    assert hpfun.parse(str(layout)) == layout
    assert hpfun.parse(layout.placements_str(), mesh) == layout
    if not layout.partial_axes:
        assert P.from_layout(layout, ndim).to_layout(mesh, ndim) == layout


@given(st.data())
def test_drawn_orders_keep_placements(data):
    """axis_orders only permutes the axes of a dim: placements, local shapes and the set of axes stay."""
    mesh = data.draw(meshes(max_ranks=8, ndims=(2, 3), sizes=(2,)))
    base = Layout(mesh, (Shard(0),) * mesh.ndim)
    ordered = data.draw(axis_orders(base))
    assert ordered.placements == base.placements and sorted(ordered.shard_axes(0)) == list(range(mesh.ndim))
    assert ordered.local_shape((16,)) == base.local_shape((16,))


def test_spec_order_shows_in_p_and_notation():
    layout = P(("b", "a"), "c").to_layout(hpfun.Mesh.simulated((2, 2, 2), ("a", "b", "c")), 2)
    assert str(layout) == "[S(0)[1], S(0)[0], S(1)] on {a: 2, b: 2, c: 2}"
    assert P.from_layout(layout, 2) == P(("b", "a"), "c")
    assert hpfun.parse("[S(0)[1], S(0)[0], S(1)] on {a: 2, b: 2, c: 2}") == layout
    assert hpfun.parse("[S(0)[0], S(0)[1]] on {a: 2, b: 2}") == Layout(MESH, (Shard(0), Shard(0)))
    assert hpfun.parse("[S(0)[0], S(0)[1]]") == (Shard(0), Shard(0))


@pytest.mark.parametrize(("text", "needle"), [
    ("[S(0)[1], S(0)[0]]", "without its mesh"),
    ("[S(0)[0], S(0)[0]] on {a: 2, b: 2}", r"positions \[0, 1\]"),
    ("[S(0)[1], S(0)] on {a: 2, b: 2}", r"positions \[0, 1\]"),
    ("[S(0)[2], S(1)] on {a: 2, b: 2}", r"positions \[0\]"),
    ("S(0)[1]", "belongs in a layout"),
    ("[R[0], R] on {a: 2, b: 2}", "cannot parse placement"),
])
def test_bad_order_notation_is_layout_error(text, needle):
    with pytest.raises(LayoutError, match=needle):
        hpfun.parse(text)


@pytest.mark.parametrize(("order", "needle"), [
    ([("b", "a")], "split one dim"),
    ([(0, 0)], "twice"),
    ([("a",)], "every mesh axis splitting dim 0"),
    ([("x", "a")], "no axis 'x'"),
    ("ba", "tuple of tuples"),
])
def test_bad_layout_order_is_layout_error(order, needle):
    placements = (Shard(0), R) if order == [("b", "a")] else (Shard(0), Shard(0))
    with pytest.raises(LayoutError, match=needle):
        Layout(MESH, placements, order)


def test_with_placement_adds_a_new_split_as_the_most_minor_axis():
    """A chunk over b of a dim a splits, or over a of a dim b splits: b-then-a needs no mesh order."""
    assert Layout(MESH, (R, Shard(0))).with_placement(0, Shard(0)) == P(("b", "a")).to_layout(MESH, 1)
    assert Layout(MESH, (Shard(0), R)).with_placement(1, Shard(0)) == P(("a", "b")).to_layout(MESH, 1)
    assert P(("b", "a")).to_layout(MESH, 1).with_placement(0, R) == Layout(MESH, (R, Shard(0)))


def test_visualize_shows_the_order():
    text = str(hpfun.visualize(BA.to_layout(MESH, 2), (2, 8)))
    assert text == """\
[S(1)[1], S(1)[0]] on {a: 2, b: 2}: global (2, 8), each rank holds (2, 2)
rows: dim 0, columns: dim 1; a cell lists the ranks holding that block; dim 1 split over b, a, major first
      0:2   2:4   4:6   6:8
    ┌─────┬─────┬─────┬─────┐
0:2 │  0  │  2  │  1  │  3  │
    └─────┴─────┴─────┴─────┘
rank 0 (a=0, b=0): [0:2, 0:2]
rank 1 (a=0, b=1): [0:2, 4:6]
rank 2 (a=1, b=0): [0:2, 2:4]
rank 3 (a=1, b=1): [0:2, 6:8]"""
    assert "dim 1 split over b, a, major first" in hpfun.visualize(BA.to_layout(MESH, 2), (2, 8))._repr_html_()


def test_lowered_report_reads_ordered_layouts_back():
    """The report's layout strings carry the order and read back on its mesh."""
    x = _rand(4, 8)
    lowered = hpfun.shard(lambda x: x * 2, mesh=MESH, in_specs=BA, out_specs=None).lower(x)
    assert "[S(1)[1], S(1)[0]]" in str(lowered)
    assert lowered.layout("[S(1)[1], S(1)[0]]") == BA.to_layout(MESH, 2)
