"""Each rule family against unsharded ground truth: random meshes, input layouts (Partial
included) and shapes; the sharded op's gathered result equals the op on whole tensors."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hpfun
from hpfun import Layout, Partial, Shard
from hpfun.testing import assert_sharded_equal, layouts, meshes, sharded_values

MESHES = meshes(ndims=(1, 2, 3), sizes=(1, 2, 4, 8))


def _check(draw, fn, inputs, partial_ok):
    """fn on `inputs` laid out at random (Partial(sum) where `partial_ok`) equals fn unsharded."""
    mesh = draw(MESHES)
    args = []
    for x, ok in zip(inputs, partial_ok, strict=True):
        if isinstance(x, torch.Tensor):
            partial = ("sum",) if ok and x.is_floating_point() else False
            args.append(draw(sharded_values(x, draw(layouts(mesh, tuple(x.shape), allow_partial=partial)))))
        else:
            args.append(x)
    assert_sharded_equal(fn, args, mesh, None, rtol=1e-5, atol=1e-5)


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


SHAPES = st.sampled_from([(4, 8), (8, 4), (8, 8), (16, 2)])


@settings(max_examples=60)
@given(data=st.data(), shape=SHAPES, op=st.sampled_from(["add", "sub", "mul", "div", "where", "add_row", "exp", "relu_grad"]))
def test_pointwise(data, shape, op):
    """Pointwise ops with broadcasting and Partial inputs equal the unsharded op."""
    x, y, row = _rand(*shape), _rand(*shape), _rand(shape[1])
    cases = {
        "add": (torch.add, (x, y), (True, True)),
        "sub": (torch.sub, (x, y), (True, True)),
        "mul": (torch.mul, (x, y), (True, True)),
        "div": (lambda a, b: a / (b.abs() + 1), (x, y), (True, True)),
        "where": (lambda a, b: torch.where(a > 0, a, b), (x, y), (True, True)),
        "add_row": (lambda a, r: a + r * 2.0, (x, row), (True, True)),
        "exp": (torch.exp, (x,), (True,)),
        "relu_grad": (lambda g, a: torch.ops.aten.threshold_backward(g, torch.relu(a), 0.0), (x, y), (True, True)),
    }
    fn, inputs, partial_ok = cases[op]
    _check(data.draw, fn, inputs, partial_ok)


@settings(max_examples=60)
@given(data=st.data(), shape=st.sampled_from([(4, 8, 2), (8, 4, 4), (2, 2, 8)]),
       op=st.sampled_from(["sum0", "sum12", "sum_all", "mean1", "amax1", "amin0", "max_dim"]))
def test_reductions(data, shape, op):
    """Reductions over split, whole and Partial dims equal the unsharded reduction."""
    cases = {
        "sum0": lambda x: x.sum(0),
        "sum12": lambda x: x.sum((1, 2), keepdim=True),
        "sum_all": lambda x: x.sum(),
        "mean1": lambda x: x.mean(1),
        "amax1": lambda x: x.amax(1),
        "amin0": lambda x: x.amin(0, keepdim=True),
        "max_dim": lambda x: x.max(2).values,
    }
    _check(data.draw, cases[op], (_rand(*shape),), (True,))


@settings(max_examples=60)
@given(data=st.data(), op=st.sampled_from(["mm", "bmm", "addmm", "linear", "baddbmm"]))
def test_contractions(data, op):
    """mm, bmm, addmm, baddbmm under any operand layouts equal the unsharded contraction."""
    cases = {
        "mm": (torch.mm, (_rand(8, 4), _rand(4, 8))),
        "bmm": (torch.bmm, (_rand(2, 8, 4), _rand(2, 4, 8))),
        "addmm": (torch.addmm, (_rand(8), _rand(4, 8), _rand(8, 8))),
        "linear": (F.linear, (_rand(8, 4), _rand(8, 4), _rand(8))),
        "baddbmm": (lambda b, x, y: torch.baddbmm(b, x, y, beta=0.5, alpha=2.0), (_rand(2, 8, 4), _rand(2, 8, 4), _rand(2, 4, 4))),
    }
    fn, inputs = cases[op]
    _check(data.draw, fn, inputs, (True,) * len(inputs))


@settings(max_examples=60)
@given(data=st.data(), op=st.sampled_from(["view_merge", "view_split", "permute", "t", "expand", "unsqueeze",
                                          "squeeze", "slice", "select", "cat", "split", "narrow",
                                          "slice_step", "select_neg"]))
def test_shape_ops(data, op):
    """Dimension algebra moves shards correctly (or gathers) for every input layout."""
    x = _rand(4, 8, 2)
    cases = {
        "view_merge": (lambda a: a.reshape(32, 2) * 1, (x,)),
        "view_split": (lambda a: a.reshape(2, 2, 4, 4) * 1, (x,)),
        "permute": (lambda a: a.permute(2, 0, 1) * 1, (x,)),
        "t": (lambda a: a.t() * 1, (_rand(8, 4),)),
        "expand": (lambda a: a.expand(4, 8, 8) * 1, (_rand(4, 8, 1),)),
        "unsqueeze": (lambda a: a.unsqueeze(1) * 1, (x,)),
        "squeeze": (lambda a: a.squeeze(1) * 1, (_rand(8, 1, 4),)),
        "slice": (lambda a: a[:, 2:6] * 1, (x,)),
        "select": (lambda a: a[:, 3] * 1, (x,)),
        "narrow": (lambda a: a.narrow(1, 5, 2) * 1, (x,)),
        "slice_step": (lambda a: a[1::3, 2::5] * 1, (x,)),
        "select_neg": (lambda a: a[-1] * 1, (x,)),
        "cat": (lambda a, b: torch.cat([a, b], 1), (x, _rand(4, 8, 2))),
        "split": (lambda a: a.split([2, 6], 1)[1] * 1, (x,)),
    }
    fn, inputs = cases[op]
    _check(data.draw, fn, inputs, (True,) * len(inputs))


def _lookup_case(op):
    g = torch.Generator().manual_seed(0)
    x = _rand(8, 8)
    idx = torch.randint(0, 8, (8, 2), generator=g)
    labels = torch.randint(0, 8, (8,), generator=g)
    cases = {
        "gather": (lambda a, i: torch.gather(a, 1, i), (x, idx), (True, False)),
        "scatter": (lambda a, i: a.scatter(1, i[:, :1], 5.0), (x, idx), (False, False)),
        "scatter_add": (lambda a, i, s: a.scatter_add(1, i, s), (x, idx, _rand(8, 2)), (True, False, True)),
        "log_softmax": (lambda a: torch.log_softmax(a, 1), (x,), (False,)),
        "softmax": (lambda a: torch.softmax(a, 0), (x,), (False,)),
        "cross_entropy": (F.cross_entropy, (x, labels), (False, False)),
        "ce_grad": (torch.func.grad(lambda a, l: F.cross_entropy(a, l)), (x, labels), (False, False)),
    }
    return cases[op]


@settings(max_examples=60)
@given(data=st.data(), op=st.sampled_from(["gather", "scatter", "scatter_add", "log_softmax", "softmax",
                                          "cross_entropy", "ce_grad"]))
def test_lookups_and_softmax(data, op):
    """gather/scatter along split dims and softmax-family along a split dim equal ground truth."""
    _check(data.draw, *_lookup_case(op))


def test_rules_are_pure_functions_of_shapes_and_layouts():
    """A rule answers from shapes and layouts alone: no tensors involved."""
    from hpfun.rules import OpCall, TensorArg, TensorMeta, lookup

    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    aten = torch.ops.aten
    a = TensorArg((8, 4), torch.float32, Layout(mesh, (Shard(1),)), 0)
    b = TensorArg((4, 6), torch.float32, Layout(mesh, (Shard(0),)), 1)
    call = OpCall(aten.mm.default, (a, b), {}, (TensorMeta((8, 6), torch.float32),), mesh)
    strategies = lookup(aten.mm.default).strategies(call)
    assert strategies[0].outputs[0].placements == (Partial("sum"),)
    assert math.prod(mesh.shape) == 2


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_vocab_parallel_cross_entropy_needs_only_row_sized_collectives(mesh_shape):
    """Cross-entropy over class-sharded logits moves one number per row, never the logits."""
    mesh = hpfun.Mesh.simulated(mesh_shape, ("a", "b")[: len(mesh_shape)])
    axis = mesh.axis_names[-1]
    logits, labels = torch.randn(8, 16), torch.randint(0, 16, (8,))
    f = hpfun.shard(F.cross_entropy, mesh=mesh, in_specs=(hpfun.P(None, axis), hpfun.P()), out_specs=hpfun.P())
    torch.testing.assert_close(f(logits, labels).full(), F.cross_entropy(logits, labels))
    assert all(c.bytes <= 8 * 4 for c in f.lower(logits, labels).collectives)
