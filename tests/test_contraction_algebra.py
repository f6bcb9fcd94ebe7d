"""mm (the `contraction` family, its equation in the table) and einsum (its equation in the
call) derive their strategies and price their work with one letter algebra; einsum's strategies
are right against the op on whole tensors."""

import itertools

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import hpfun
from hpfun import Layout, Partial, Replicate, Shard
from hpfun.api import execute
from hpfun.lower import lower
from hpfun.propagate import propagate
from hpfun.rules import REGISTRY, OpCall, TensorArg, TensorMeta, lookup
from hpfun.rules.einsum import Einsum
from hpfun.testing import layouts, meshes, sharded_values

aten = torch.ops.aten
MESH = hpfun.Mesh.simulated((2, 2), ("a", "b"))
PLACEMENTS = [Replicate(), Partial("sum"), Partial("avg"), Partial("max"), Shard(0), Shard(1)]
LAYOUTS = [Layout(MESH, ps) for ps in itertools.product(PLACEMENTS, repeat=2)]


def _mm_calls(a_layout, b_layout, shapes=((8, 4), (4, 6))):
    """The same product asked of mm's rule and of einsum's, with these input layouts."""
    (m, k), (_, n) = shapes
    out = (TensorMeta((m, n), torch.float32),)
    pairs = list(zip(shapes, (a_layout, b_layout), strict=True))
    a, b = (TensorArg(s, torch.float32, layout, i) for i, (s, layout) in enumerate(pairs))
    ea, eb = (TensorArg(s, torch.float32, layout, 1) for s, layout in pairs)  # einsum's tensors share one list
    return OpCall(aten.mm.default, (a, b), {}, out, MESH), OpCall(aten.einsum.default, ("mk,kn->mn", [ea, eb]), {}, out, MESH)


def test_mm_and_einsum_offer_the_same_strategies_and_work():
    """For every pair of input layouts on a 2x2 mesh (split, replicated, each Partial), mm and
    einsum("mk,kn->mn") offer the same strategies, in the same order, each priced the same."""
    mm, einsum = lookup(aten.mm.default), lookup(aten.einsum.default)
    for a_layout, b_layout in itertools.product(LAYOUTS, repeat=2):
        mm_call, einsum_call = _mm_calls(a_layout, b_layout)
        ours, theirs = mm.strategies(mm_call), einsum.strategies(einsum_call)
        assert ours == theirs, (a_layout.placements_str(), b_layout.placements_str())
        assert [mm.work(mm_call, s) for s in ours] == [einsum.work(einsum_call, s) for s in theirs]


def test_work_is_multiply_adds_per_rank():
    """mm's work is m * k * n on each rank's blocks: (8 x 4) @ (4 x 6) with m split over both
    axes and k over none does 2 * 4 * 6 multiply-adds; with k split (Partial output), 8 * 1 * 6."""
    mm = lookup(aten.mm.default)
    rows = Layout(MESH, (Shard(0), Shard(0)))
    call, _ = _mm_calls(rows, Layout.replicated(MESH))
    [strategy] = [s for s in mm.strategies(call) if s.outputs[0] == rows]
    assert mm.work(call, strategy) == 2 * 4 * 6
    cols, inner = Layout(MESH, (Shard(1), Shard(1))), Layout(MESH, (Shard(0), Shard(0)))
    call, _ = _mm_calls(cols, inner)
    [strategy] = [s for s in mm.strategies(call) if s.outputs[0].placements == (Partial("sum"),) * 2]
    assert mm.work(call, strategy) == 8 * 1 * 6


def _call(op, args, out_shape):
    return OpCall(op, tuple(args), {}, (TensorMeta(out_shape, torch.float32),), MESH)


def _arg(shape, layout, index):
    return TensorArg(shape, torch.float32, layout, index)


def test_work_of_a_bias_cdist_and_grid_sampler():
    """addmm adds one per local output element to mm's multiply-adds; cdist loops over every
    letter (p * r * m per rank, as a product does); grid_sampler looks its input up, one per
    local output element."""
    r, rows = Layout.replicated(MESH), Layout(MESH, (Shard(0), Replicate()))
    addmm = _call(aten.addmm.default, [_arg((6,), r, 0), _arg((8, 4), rows, 1), _arg((4, 6), r, 2)], (8, 6))
    [strategy] = [s for s in lookup(aten.addmm.default).strategies(addmm) if s.outputs[0] == rows]
    assert lookup(aten.addmm.default).work(addmm, strategy) == 4 * 4 * 6 + 4 * 6
    cdist = _call(aten._cdist_forward.default, [_arg((8, 4), rows, 0), _arg((6, 4), r, 1), 2.0, None], (8, 6))
    [strategy] = [s for s in lookup(aten._cdist_forward.default).strategies(cdist) if s.outputs[0] == rows]
    assert lookup(aten._cdist_forward.default).work(cdist, strategy) == 4 * 6 * 4
    x, grid = _arg((2, 4, 8, 8), rows, 0), _arg((2, 4, 2, 2), rows, 1)
    sampler = _call(aten.grid_sampler_2d.default, [x, grid, 0, 0, False], (2, 4, 4, 2))
    [strategy] = [s for s in lookup(aten.grid_sampler_2d.default).strategies(sampler) if s.outputs[0] == rows]
    assert lookup(aten.grid_sampler_2d.default).work(sampler, strategy) == 1 * 4 * 4 * 2


def test_a_broadcast_letter_is_never_split():
    """einsum("bij,bjk->bik") with b of size 1 in the first operand: b is not split alongside
    the second operand's b (the size-1 side has nothing to split), the other letters are."""
    batch = Layout(MESH, (Shard(0), Replicate()))
    call = OpCall(aten.einsum.default, ("bij,bjk->bik", [TensorArg((1, 4, 4), torch.float32, Layout.replicated(MESH), 1),
                                                          TensorArg((2, 4, 8), torch.float32, batch, 1)]), {},
                  (TensorMeta((2, 4, 8), torch.float32),), MESH)
    assert all(s.outputs[0].placements[0] != Shard(0) for s in lookup(aten.einsum.default).strategies(call))


@attrs.frozen(kw_only=True)
class _OnlyOne(Einsum):
    """einsum's rule offering only its strategy number `pick`."""

    pick: int = 0

    def strategies(self, call):
        return [super().strategies(call)[self.pick]]


class _Forced:
    def __init__(self, pick: int):
        self.rule = _OnlyOne(pick=pick)

    def lookup(self, op):
        return self.rule if op == aten.einsum.default else REGISTRY.lookup(op)


def _einsum_results(equation, values: list, mesh):
    """The whole output of einsum on `values` (Sharded), once per strategy its rule offers."""
    gm = make_fx(lambda *ts: [torch.einsum(equation, *ts)], tracing_mode="fake", pre_dispatch=True)(
        *(v.full() for v in values))
    layouts = [v.layout for v in values]
    propagate(gm, mesh, layouts)
    node = next(n for n in gm.graph.nodes if n.target == aten.einsum.default)  # kept whole by the trace
    strategies = node.meta["hpfun_rule"].strategies(node.meta["hpfun_call"])
    for pick, strategy in enumerate(strategies):
        propagate(gm, mesh, layouts, registry=_Forced(pick))
        program = lower(gm, mesh, [Layout.replicated(mesh)])
        [out] = execute(program, values)
        note = f"{[l.placements_str() for l in strategy.inputs]} -> {strategy.outputs[0].placements_str()}"
        yield note, hpfun.Sharded(program.output_layouts[0], program.output_shapes[0], out).full()


EINSUMS = {  # equation: operand shapes
    "mk,kn->mn": [(8, 4), (4, 8)],
    "abcd,abed->abce": [(2, 4, 4, 8), (2, 4, 2, 8)],  # attention scores, as capture folds them
    "bse,bsd->de": [(2, 4, 8), (2, 4, 4)],  # a weight's gradient: batch and sequence summed
    "ij,j->i": [(8, 4), (4,)],
    "...ij,jk->...ik": [(2, 4, 4), (4, 8)],
    "...ij,jk->ik": [(2, 4, 4), (4, 8)],  # the ellipsis dims are summed
    "ij,jk": [(4, 8), (8, 2)],  # implicit output: "ik"
    "bij,bjk->bik": [(1, 4, 4), (2, 4, 8)],  # b broadcast
    "ii,ij->j": [(4, 4), (4, 8)],  # a diagonal: replicated
    "abc,cd,de->abe": [(2, 4, 8), (8, 4), (4, 2)],
}


@pytest.mark.parametrize("equation", sorted(EINSUMS))
@settings(max_examples=6)
@given(data=st.data())
def test_every_einsum_strategy_equals_the_unsharded_einsum(data, equation):
    """Every strategy einsum's rule offers, forced for drawn meshes and input layouts (Partial
    ones holding random terms), equals torch.einsum on whole tensors (capture decomposes
    einsum, so `python -m hpfun.validate` does not reach it)."""
    mesh = data.draw(meshes(ndims=(1, 2), sizes=(1, 2, 4)))
    values = []
    for i, shape in enumerate(EINSUMS[equation]):
        x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        layout = data.draw(layouts(mesh, shape, allow_partial=("sum", "avg")))
        values.append(data.draw(sharded_values(x, layout)))
    expected = torch.einsum(equation, *(v.full() for v in values))
    for note, got in _einsum_results(equation, values, mesh):
        torch.testing.assert_close(got, expected, msg=lambda m, note=note: f"{equation} on {mesh}, {note}: {m}")
