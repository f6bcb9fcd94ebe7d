"""Properties of the value classes: Mesh, placements, Layout, P, the notation's parser, Sharded.

Meshes, layouts and divisible shapes come from `hpfun.testing`: here small meshes (<= 8 ranks,
1-3 axes, size-1 axes included, any axis names), layouts on them (several axes may split one
dim) and global shapes those layouts divide.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hpfun
from hpfun import Layout, LayoutError, Mesh, P, Partial, Replicate, Shard, SpecError
from hpfun.testing import divisible_shapes, layouts, meshes

R = Replicate()
REDUCES = ("sum", "avg", "max", "min")

# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

axis_names = st.one_of(
    st.sampled_from(("dp", "tp", "pp", "sp", "ep", "cp")),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True),
)

MESHES = meshes(ndims=(1, 2, 3), sizes=(1, 2, 2, 3, 4, 8), names=axis_names)


@st.composite
def placements(draw, ndim, reduces=REDUCES):
    """One placement: Shard of an existing dim (about half the time), Replicate, or Partial with one of `reduces`."""
    kinds = ["S", "S"] * bool(ndim) + ["R"] + ["P"] * bool(reduces)
    kind = draw(st.sampled_from(kinds))
    if kind == "S":
        return Shard(draw(st.integers(0, ndim - 1)))
    return R if kind == "R" else Partial(draw(st.sampled_from(reduces)))


@st.composite
def cases(draw, reduces=REDUCES, min_ndim=0):
    """(mesh, layout, global shape) with the shape divisible by the layout."""
    mesh = draw(MESHES)
    ndim = draw(st.sampled_from([0, 1, 1, 2, 2, 3]).filter(lambda n: n >= min_ndim))
    layout = draw(layouts(mesh, ndim, allow_partial=reduces))
    return mesh, layout, draw(divisible_shapes(layout, ndim))


@st.composite
def specs(draw, mesh, ndim):
    """A canonical P spec for a `ndim`-dim tensor: disjoint axes per dim in mesh order, no trailing None."""
    owner = [draw(st.integers(-1, ndim - 1)) for _ in mesh.axis_names]  # -1: the axis splits nothing
    entries = []
    for d in range(ndim):
        names = tuple(n for n, o in zip(mesh.axis_names, owner, strict=True) if o == d)
        entries.append(None if not names else names[0] if len(names) == 1 else names)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def global_tensor(shape, seed=0):
    """Distinct float64 values, so a misplaced element is always visible."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(math.prod(shape), generator=g).reshape(shape).to(torch.float64) - 7.5


# ---------------------------------------------------------------------------------------------
# P <-> Layout
# ---------------------------------------------------------------------------------------------


@given(cases(reduces=()))
def test_layout_to_spec_and_back(case):
    """P.from_layout(layout, ndim).to_layout(mesh, ndim) == layout for Partial-free layouts."""
    mesh, layout, shape = case
    assert P.from_layout(layout, len(shape)).to_layout(mesh, len(shape)) == layout


@given(st.data())
def test_spec_to_layout_and_back(data):
    """P -> layout -> P is the identity on canonical specs (no trailing None)."""
    mesh = data.draw(MESHES)
    ndim = data.draw(st.integers(0, 3))
    spec = data.draw(specs(mesh, ndim))
    assert P.from_layout(spec.to_layout(mesh, ndim), ndim) == spec


@given(st.data())
def test_trailing_none_only_pads(data):
    """Appending None entries to a spec does not change its layout."""
    mesh = data.draw(MESHES)
    ndim = data.draw(st.integers(0, 3))
    spec = data.draw(specs(mesh, ndim))
    padded = P(*spec.dims, *[None] * (ndim - len(spec.dims)))
    assert padded.to_layout(mesh, ndim) == spec.to_layout(mesh, ndim)


def test_spec_examples():
    mesh = Mesh.simulated((2, 2), ("dp", "tp"))
    assert str(P("tp", None).to_layout(mesh, 2)) == "[R, S(0)] on {dp: 2, tp: 2}"
    assert P(("dp", "tp")).to_layout(mesh, 1).placements == (Shard(0), Shard(0))
    assert P(("dp",)) == P("dp") and P(()) == P(None)
    assert P.from_layout(hpfun.parse("[S(-1), R] on {dp: 2, tp: 2}"), 3) == P(None, None, "dp")


# ---------------------------------------------------------------------------------------------
# The notation: parse(str(x)) == x
# ---------------------------------------------------------------------------------------------


@given(placements(ndim=4) | st.builds(Shard, st.integers(-4, -1)))
def test_parse_placement_round_trip(placement):
    """parse(str(p)) == p for every placement, negative shard dims included."""
    assert hpfun.parse(str(placement)) == placement


@given(MESHES)
def test_parse_mesh_round_trip(mesh):
    """parse(str(mesh)) == mesh for simulated meshes."""
    assert hpfun.parse(str(mesh)) == mesh


@given(st.data())
def test_parse_layout_round_trip(data):
    """parse(str(layout)) == layout, and the placement list alone parses to the placements."""
    mesh = data.draw(MESHES)
    ndim = data.draw(st.integers(0, 3))
    layout = Layout(mesh, tuple(data.draw(placements(ndim)) for _ in mesh.shape))  # Partial reduces mixed
    assert hpfun.parse(str(layout)) == layout
    assert hpfun.parse(layout.placements_str()) == layout.placements


_TOKENS = st.sampled_from(["S(", "R", "P(", ")", "[", "]", ",", " on ", "{", "}", ":", "dp", "sum", "0", "-1", "2", " "])


@given(st.one_of(st.text(max_size=30), st.lists(_TOKENS, max_size=12).map("".join)))
def test_parse_fails_only_with_layout_error(text):
    """parse of any text returns a value or raises LayoutError, never another exception."""
    try:
        hpfun.parse(text)
    except LayoutError:
        pass


@pytest.mark.parametrize("text", [
    "", "Q", "S(x)", "S()", "P()", "P(prod)", "[S(0), R", "[S(0),, R]", "[S(0)] at {dp: 2}",
    "{dp 2}", "{dp: 2", "{dp: 0}", "{dp: 2, dp: 2}", "{1x: 2}", "[R] on {dp: 2, tp: 2}", "[R] on dp: 2",
    "S(" + "1" * 5000 + ")", "{dp: " + "1" * 5000 + "}",
])
def test_parse_garbage_raises_layout_error(text):
    with pytest.raises(LayoutError, match="."):
        hpfun.parse(text)


# ---------------------------------------------------------------------------------------------
# Shape arithmetic
# ---------------------------------------------------------------------------------------------


@given(cases())
def test_local_shape_times_factor_is_global(case):
    """local_shape[d] * shard_factor(d) == global_shape[d] for every dim."""
    _, layout, shape = case
    local = layout.local_shape(shape)
    assert [n * layout.shard_factor(d) for d, n in enumerate(local)] == list(shape)


@given(cases())
def test_shards_tile_the_global_tensor(case):
    """The blocks [offset, offset + local) of all ranks, one per distinct shard, cover each element once."""
    mesh, layout, shape = case
    local = layout.local_shape(shape)
    shard_axes = {a for a, p in enumerate(layout.placements) if isinstance(p, Shard)}
    blocks: dict[tuple, tuple] = {}
    for r in range(mesh.size):
        coords = mesh.coords(r)
        key = tuple(c for a, c in enumerate(coords) if a in shard_axes)  # replicas share a key
        offsets = layout.offsets(shape, coords)
        assert blocks.setdefault(key, offsets) == offsets, "ranks holding the same shard disagree on its offset"
    assert len(blocks) == math.prod(layout.shard_factor(d) for d in range(len(shape)))
    coverage = torch.zeros(shape, dtype=torch.int64)
    for offsets in blocks.values():
        coverage[tuple(slice(o, o + n) for o, n in zip(offsets, local, strict=True))] += 1
    assert torch.equal(coverage, torch.ones_like(coverage))


@given(cases(min_ndim=1))
def test_several_axes_on_one_dim_split_major_first(case):
    """The shard index on a dim is the row-major index of the rank's coords on the axes splitting it."""
    mesh, layout, shape = case
    for r in range(mesh.size):
        coords = mesh.coords(r)
        for d in range(len(shape)):
            axes = layout.shard_axes(d)
            expected = 0
            for a in axes:
                expected = expected * mesh.shape[a] + coords[a]
            assert layout.shard_index(d, coords) == expected


def test_offsets_example():
    layout = hpfun.parse("[S(0), S(0)] on {dp: 2, tp: 3}")
    mesh = layout.mesh
    assert [layout.offsets((12,), mesh.coords(r))[0] for r in range(6)] == [0, 2, 4, 6, 8, 10]
    layout = hpfun.parse("[S(1), S(0)] on {dp: 2, tp: 3}")
    assert layout.local_shape((6, 4)) == (2, 2)
    assert layout.offsets((6, 4), (1, 2)) == (4, 2)


# ---------------------------------------------------------------------------------------------
# Negative dims
# ---------------------------------------------------------------------------------------------


@given(st.data())
def test_normalized_makes_shard_dims_non_negative(data):
    """Layout.normalized(ndim) maps Shard(d - ndim) to Shard(d), keeps the rest, and is idempotent."""
    mesh = data.draw(MESHES)
    ndim = data.draw(st.integers(1, 3))
    layout = data.draw(layouts(mesh, ndim, allow_partial=True))
    flips = data.draw(st.lists(st.booleans(), min_size=ndim, max_size=ndim))  # per dim: its axes name it alike
    negative = Layout(mesh, tuple(
        Shard(p.dim - ndim) if isinstance(p, Shard) and flips[p.dim] else p for p in layout.placements
    ), layout.order)
    assert negative.normalized(ndim) == layout
    assert layout.normalized(ndim) == layout


@given(st.data())
def test_from_global_normalizes_negative_dims(data):
    """Sharded.from_global with negative shard dims gives the shards of the normalized layout."""
    mesh, layout, shape = data.draw(cases(reduces=(), min_ndim=1))
    ndim = len(shape)
    negative = Layout(mesh, tuple(Shard(p.dim - ndim) if isinstance(p, Shard) else p for p in layout.placements),
                      layout.order)
    t = global_tensor(shape)
    x = hpfun.Sharded.from_global(t, negative)
    assert x.layout == layout
    assert all(torch.equal(a, b) for a, b in zip(x.shards, hpfun.Sharded.from_global(t, layout).shards, strict=True))


@pytest.mark.parametrize("dim", [2, -3, 7])
def test_normalized_rejects_missing_dims(dim):
    layout = Layout(Mesh.simulated((2,), ("dp",)), (Shard(dim),))
    with pytest.raises(LayoutError, match=rf"S\({dim}\).*2 dims"):
        layout.normalized(2)


# ---------------------------------------------------------------------------------------------
# Sharded.from_global / full
# ---------------------------------------------------------------------------------------------


def _blocks(x: hpfun.Sharded, reduce):
    """Every (offsets, value) one set of ranks holds: its Partial terms reduced, replicas kept apart."""
    layout, mesh = x.layout, x.layout.mesh
    groups: dict[tuple, list] = {}
    for r, shard in enumerate(x.shards):
        coords = mesh.coords(r)
        groups.setdefault(tuple(0 if a in layout.partial_axes else c for a, c in enumerate(coords)), []).append(shard)
    for key, terms in groups.items():
        yield layout.offsets(x.global_shape, key), reduce(torch.stack(terms))


@given(cases(reduces=("sum",)), st.integers(0, 2**16))
def test_from_global_full_is_exact(case, seed):
    """Sharded.from_global(t, layout).full() == t bitwise for Partial-free and Partial(sum) layouts."""
    _, layout, shape = case
    t = global_tensor(shape, seed)
    x = hpfun.Sharded.from_global(t, layout)
    assert x.global_shape == shape and all(tuple(s.shape) == layout.local_shape(shape) for s in x.shards)
    assert torch.equal(x.full(), t)


@given(st.data())
def test_from_global_every_replica_holds_its_block(data):
    """Every set of ranks holding one block (Partial terms reduced, each replica on its own) holds t's block there."""
    reduce = data.draw(st.sampled_from(REDUCES))
    mesh, layout, shape = data.draw(cases(reduces=(reduce,)))
    t = global_tensor(shape, data.draw(st.integers(0, 2**16)))
    x = hpfun.Sharded.from_global(t, layout)
    local = layout.local_shape(shape)
    op = {"sum": lambda s: s.sum(0), "avg": lambda s: s.mean(0), "max": lambda s: s.amax(0), "min": lambda s: s.amin(0)}
    for offsets, value in _blocks(x, op[reduce]):
        expected = t[tuple(slice(o, o + n) for o, n in zip(offsets, local, strict=True))]
        assert torch.allclose(value, expected, rtol=1e-12, atol=1e-12)
    assert torch.allclose(x.full(), t, rtol=1e-12, atol=1e-12)


def test_from_global_partial_examples():
    t = torch.arange(4.0)
    x = hpfun.Sharded.from_global(t, hpfun.parse("[P(sum)] on {dp: 2}"))
    assert [s.tolist() for s in x.shards] == [[0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0]]
    y = hpfun.Sharded.from_global(t, hpfun.parse("[P(max)] on {dp: 2}"))
    assert [s.tolist() for s in y.shards] == [t.tolist(), t.tolist()]


# ---------------------------------------------------------------------------------------------
# Errors: a LayoutError or SpecError naming the problem, never a bare KeyError/AssertionError
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "names", "needle"), [
    ((2, 2), ("dp", "dp"), "distinct"),
    ((2, 2), ("dp",), "2 axes but 1 names"),
    ((2,), ("dp", "tp"), "1 axes but 2 names"),
    ((2, 0), ("dp", "tp"), ">= 1"),
    ((-1,), ("dp",), ">= 1"),
    ((), (), "at least one axis"),
    ((2,), ("1x",), "identifiers"),
])
def test_bad_mesh_raises_layout_error(shape, names, needle):
    with pytest.raises(LayoutError, match=needle):
        Mesh.simulated(shape, names)


def test_bad_mesh_reports_all_problems():
    with pytest.raises(LayoutError) as info:
        Mesh.simulated((0, 2), ("dp", "dp"))
    assert len(info.value.problems) == 2


def test_unknown_mesh_axis_is_layout_error():
    mesh = Mesh.simulated((2, 2), ("dp", "tp"))
    with pytest.raises(LayoutError, match="no axis 'ep'.*'dp', 'tp'"):
        mesh.axis_index("ep")
    with pytest.raises(LayoutError):
        mesh.axis_size(5)


@pytest.mark.parametrize(("spec", "ndim", "needle"), [
    (P("ep"), 1, r"axis 'ep'.*axes \['dp', 'tp'\]"),
    (P("dp", "dp"), 2, "'dp' twice"),
    (P(("dp", "dp")), 1, "'dp' twice"),
    (P("dp", None, "tp"), 2, "3 entries.*only 2 dims"),
    (P("dp"), 0, "1 entries.*only 0 dims"),
])
def test_bad_spec_raises_spec_error(spec, ndim, needle):
    mesh = Mesh.simulated((2, 2), ("dp", "tp"))
    with pytest.raises(SpecError, match=needle):
        spec.to_layout(mesh, ndim)


def test_bad_spec_reports_all_problems():
    mesh = Mesh.simulated((2, 2), ("dp", "tp"))
    with pytest.raises(SpecError) as info:
        P("ep", ("tp", "tp"), None).to_layout(mesh, 2)
    assert len(info.value.problems) == 3


@given(st.data())
def test_any_spec_gives_layout_or_spec_error(data):
    """to_layout of any spec (unknown, repeated, unordered axes, too many entries) returns a layout or raises SpecError."""
    mesh = data.draw(MESHES)
    entry = st.none() | axis_names | st.sampled_from(mesh.axis_names) | st.lists(
        st.sampled_from(mesh.axis_names) | axis_names, max_size=3).map(tuple)
    spec = P(*data.draw(st.lists(entry, max_size=4)))
    ndim = data.draw(st.integers(0, 3))
    try:
        layout = spec.to_layout(mesh, ndim)
    except SpecError:
        return
    assert layout.normalized(ndim) == layout


def test_bad_spec_entry_is_spec_error():
    with pytest.raises(SpecError, match="a P entry"):
        P(0)


def test_non_divisible_local_shape_names_dim_and_axes():
    layout = hpfun.parse("[S(1), S(1)] on {dp: 2, tp: 3}")
    with pytest.raises(LayoutError, match=r"dim 1 of size 4 .*\(dp=2, tp=3\)"):
        layout.local_shape((5, 4))
    with pytest.raises(LayoutError, match="dim 1 of size 4"):
        hpfun.Sharded.from_global(torch.zeros(5, 4), layout)


def test_shard_dim_beyond_tensor_is_layout_error():
    layout = hpfun.parse("[S(2)] on {dp: 2}")
    with pytest.raises(LayoutError, match=r"S\(2\) does not exist"):
        layout.local_shape((4, 4))


@pytest.mark.parametrize(("make", "needle"), [
    (lambda m: Layout(m, (R,)), "needs 2 placements, got 1"),
    (lambda m: Layout(m, (R, "R")), "Shard, Replicate or Partial"),
    (lambda m: Partial("prod"), "reduce must be one of"),
    (lambda m: hpfun.Sharded(Layout.replicated(m), (2,), (torch.zeros(2),)), "needs 4 shard"),
    (lambda m: hpfun.Sharded(Layout.replicated(m), (2,), (torch.zeros(3),) * 4), "local shape"),
])
def test_bad_values_raise_layout_error(make, needle):
    with pytest.raises(LayoutError, match=needle):
        make(Mesh.simulated((2, 2), ("dp", "tp")))


def test_errors_are_value_errors_with_problems():
    with pytest.raises(ValueError) as info:
        P("ep").to_layout(Mesh.simulated((2,), ("dp",)), 1)
    assert isinstance(info.value, hpfun.HpfunError) and info.value.problems


@pytest.mark.parametrize("make", [
    lambda: hpfun.Mesh.simulated(("a",), ("x",)),
    lambda: hpfun.Mesh.simulated(None, ("x",)),
    lambda: hpfun.Mesh.simulated((2,), None),
    lambda: Shard("x"),
    lambda: Layout(hpfun.Mesh.simulated((2,), ("x",)), Shard(0)),
    lambda: Layout(hpfun.Mesh.simulated((2,), ("x",)), (Shard(0),)).offsets((4,), (5,)),
], ids=["mesh-str-size", "mesh-none", "names-none", "shard-str", "layout-bare-placement", "coords-off-mesh"])
def test_bad_constructor_arguments_raise_layout_error(make):
    """Wrong argument types and off-mesh coordinates raise LayoutError naming the value."""
    with pytest.raises(LayoutError, match="."):
        make()


def test_from_global_copies_and_redistribute_checks_the_target():
    """A Sharded value never shares memory with the tensor it was made from, whatever the
    layout (writing one does not write the other); redistributing to a split the shape does not
    divide is a LayoutError naming the dim."""
    mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    for spec in (hpfun.P(), hpfun.P("dp"), hpfun.P(None, "tp"), hpfun.P("dp", "tp")):
        x = torch.arange(16.0).reshape(4, 4)
        value = hpfun.Sharded.from_global(x, spec.to_layout(mesh, 2))
        x.zero_()
        assert value.full().sum() == 120, spec
        assert len({s.data_ptr() for s in value.shards}) == 4, spec
    value = hpfun.Sharded.from_global(torch.randn(8, 3), hpfun.parse("[S(0), R] on {dp: 2, tp: 2}"))
    with pytest.raises(hpfun.LayoutError, match="dim 1 of size 3 is not divisible"):
        hpfun.redistribute(value, hpfun.parse("[S(1), R] on {dp: 2, tp: 2}"))


def test_mesh_coords_and_rank_refuse_what_is_off_the_mesh():
    """A rank past the mesh or negative, and coordinates of the wrong length or off an axis, are
    LayoutErrors (they wrapped around silently)."""
    mesh = Mesh.simulated((2, 2), ("a", "b"))
    assert mesh.coords(3) == (1, 1) and mesh.rank((1, 0)) == 2
    for bad in (lambda: mesh.coords(4), lambda: mesh.coords(-1), lambda: mesh.rank((2, 0)), lambda: mesh.rank((0,))):
        with pytest.raises(LayoutError, match="mesh {a: 2, b: 2} has"):
            bad()


def test_a_one_element_sharded_value_reads_as_a_number():
    """`loss.item()`, `float(loss)`, `int(count)`, `bool(stop)`, `range(count)` and `f"{loss:.3f}"` read the
    full value; a larger value's
    `.item()` and any `.backward()` are SpecErrors saying what to do."""
    mesh = Mesh.simulated((2,), ("dp",))
    f = hpfun.shard(lambda x: (x * 2).sum(), mesh=mesh, in_specs=(P("dp"),), out_specs=P())
    loss = f(torch.ones(4))
    assert loss.item() == 8.0 and float(loss) == 8.0 and f"{loss:.1f}" == "8.0" and f"{loss}".startswith("Sharded(")
    count = hpfun.shard(lambda x: (x > 0).sum(), mesh=mesh, in_specs=(P("dp"),), out_specs=P())(torch.ones(4))
    assert int(count) == 4 and type(int(count)) is int and int(loss) == 8
    assert list(range(count)) == [0, 1, 2, 3] and round(loss) == 8 and bool(loss)
    zero = hpfun.shard(lambda x: (x < 0).any(), mesh=mesh, in_specs=(P("dp"),), out_specs=P())(torch.ones(4))
    assert not zero and (True if not zero else False)  # `if stop:` reads the value (it was always true)
    with pytest.raises(SpecError, match="(?s)cannot read this Sharded value that way.*needs one element"):
        hpfun.Sharded.from_global(torch.ones(4), P("dp").to_layout(mesh, 1)).item()
    with pytest.raises(SpecError, match=r"shape \(4,\) is ambiguous, as a tensor's is\n.*fix: reduce it first"):
        bool(hpfun.Sharded.from_global(torch.ones(4), P("dp").to_layout(mesh, 1)))  # (it said: bad sharding spec)
    other = hpfun.Sharded.from_global(torch.ones(4), P("dp").to_layout(Mesh.simulated((4,), ("dp",)), 1))
    with pytest.raises(SpecError, match=r"not \{dp: 2\}\n.*fix: pass its global value \(\.full\(\)\)"):
        f(other)  # (a value of another mesh: the refusal had no fix)
    with pytest.raises(SpecError, match="not connected to autograd"):
        loss.backward()
