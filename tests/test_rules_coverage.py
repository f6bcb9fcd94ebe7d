"""Every core ATen op has a rule, and every strategy a rule offers is right.

Each case calls one ATen overload directly (traced without decompositions, so the op under
test is the op in the graph). For hypothesis-drawn meshes and input layouts (Partial where
the case allows it), EVERY strategy the rule offers is forced in turn, lowered (outputs
redistributed to replicated by the program itself), run on the simulated mesh and compared
with the op on whole tensors: a strategy the cost model would not pick today is checked as
well as the one it picks.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import hpfun
from hpfun import Layout, Partial, Replicate, Shard
from hpfun.api import execute
from hpfun.lower import lower
from hpfun.propagate import propagate
from hpfun.rules import REGISTRY

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2), (1, 2)]
EXAMPLES = 5  # hypothesis examples per op case (each checks every strategy the rule offers)


# ---------------------------------------------------------------------------------------------
# The harness: trace one op, force each strategy, compare with the unsharded op
# ---------------------------------------------------------------------------------------------


class _Forced:
    """A registry answering like the built-in one, except that `op` offers only `strategy`."""

    def __init__(self, op, strategy):
        self.op, self.strategy = op, strategy

    def lookup(self, target):
        rule = REGISTRY.lookup(target)
        return _Pick(rule, self.strategy) if target == self.op else rule


class _Pick:
    def __init__(self, rule, strategy):
        self.rule, self.strategy = rule, strategy

    def strategies(self, call):
        # (the op's inputs may come in other layouts once it offers one strategy, where the ops
        # before it choose by what it asks: the strategy is asked for all the same)
        return [s for s in self.rule.strategies(call) if s == self.strategy] or [self.strategy]

    def emit(self, *args):
        return self.rule.emit(*args)


def _layout(draw, mesh, x: torch.Tensor, partial: bool) -> Layout:
    """A placement per mesh axis that `x`'s shape divides."""
    out = []
    for a in range(mesh.ndim):
        choices = [Replicate()] + ([Partial("sum")] if partial else [])
        for d in range(x.ndim):
            layout = Layout(mesh, tuple(out) + (Shard(d),) + (Replicate(),) * (mesh.ndim - a - 1))
            if layout.fits(tuple(x.shape)):
                choices.append(Shard(d))
        out.append(draw(st.sampled_from(choices)))
    return Layout(mesh, tuple(out))


def _flat_outputs(value) -> list:
    return [value] if isinstance(value, torch.Tensor) else [v for v in value if isinstance(v, torch.Tensor)]


def _run(gm, mesh, op, strategy, tensors, layouts):
    propagate(gm, mesh, layouts, registry=_Forced(op, strategy))
    program = lower(gm, mesh, [Layout.replicated(mesh)] * len(_graph_outputs(gm)))
    sharded = [hpfun.Sharded.from_global(t, l) for t, l in zip(tensors, layouts, strict=True)]
    outs = execute(program, sharded)
    return [hpfun.Sharded(layout, shape, shards).full()
            for layout, shape, shards in zip(program.output_layouts, program.output_shapes, outs, strict=True)]


def _graph_outputs(gm) -> list:
    return list(next(n for n in gm.graph.nodes if n.op == "output").args[0])


def _strategies(gm, mesh, op, layouts) -> list:
    propagate(gm, mesh, layouts)
    node = next(n for n in gm.graph.nodes if n.target == op)
    return node.meta["hpfun_rule"].strategies(node.meta["hpfun_call"])


def check_op(draw, op, fn, inputs, partial=(), meshes=MESHES, tol=1e-5):
    """`fn(*inputs)` calls `op`; tensors at positions in `partial` may be drawn Partial(sum)."""
    mesh_shape = draw(st.sampled_from(meshes))
    mesh = hpfun.Mesh.simulated(mesh_shape, ("a", "b")[: len(mesh_shape)])
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    positions = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]

    def traced(*ts):
        args = list(inputs)
        for i, t in zip(positions, ts, strict=True):
            args[i] = t
        return _flat_outputs(fn(*args))

    layouts = [_layout(draw, mesh, t, i in partial and t.is_floating_point()) for i, t in zip(positions, tensors, strict=True)]
    gm = make_fx(traced, tracing_mode="fake", pre_dispatch=True)(*tensors)  # keeps composite ops whole
    gm.graph.eliminate_dead_code()
    expected = traced(*tensors)
    strategies = _strategies(gm, mesh, op, layouts)
    assert strategies, f"{op}: no strategy for {[l.placements_str() for l in layouts]}"
    for strategy in strategies:
        got = _run(gm, mesh, op, strategy, tensors, layouts)
        note = (f"{op} on {mesh}, inputs {[l.placements_str() for l in layouts]}, strategy "
                f"{[l.placements_str() for l in strategy.inputs]} -> {[l.placements_str() for l in strategy.outputs]}")
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{note}: {m}")


_GEN = torch.Generator().manual_seed(0)  # inputs are the same on every run


def _rand(*shape, low=-2.0, high=2.0):
    return torch.rand(*shape, dtype=torch.float64, generator=_GEN) * (high - low) + low


def _ints(*shape):
    """bfloat16 integers in [-2, 2]: products and sums of a few dozen are exact."""
    return _rand(*shape).round().to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Coverage
# ---------------------------------------------------------------------------------------------


def _core_ops() -> list:
    """Every ATen overload tagged core (from all schemas: torch.ops.aten fills in lazily)."""
    ops = set()
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("aten::"):
            op = getattr(getattr(aten, schema.name[len("aten::"):]), schema.overload_name or "default")
            if torch.Tag.core in op.tags:
                ops.add(op)
    return sorted(ops, key=str)


def test_every_core_op_has_a_rule():
    """Each ATen overload tagged core has a registered rule; replicate-only ones give a reason."""
    registered = set(REGISTRY.ops())
    core = _core_ops()
    assert len(core) >= 193
    assert [str(op) for op in core if op not in registered] == []
    unexplained = [str(op) for op in core if type(REGISTRY.lookup(op)).__name__ == "Replicated" and not REGISTRY.lookup(op).reason]
    assert unexplained == []


# ---------------------------------------------------------------------------------------------
# Pointwise
# ---------------------------------------------------------------------------------------------

UNARY = {  # op: (low, high) of its inputs' domain
    aten.acos.default: (-0.9, 0.9), aten.asin.default: (-0.9, 0.9), aten.atanh.default: (-0.9, 0.9),
    aten.acosh.default: (1.1, 3.0), aten.log2.default: (0.1, 3.0), aten.log10.default: (0.1, 3.0),
    aten.asinh.default: (-2, 2), aten.atan.default: (-2, 2), aten.cosh.default: (-2, 2),
    aten.sinh.default: (-2, 2), aten.tan.default: (-1, 1), aten.ceil.default: (-3, 3),
    aten.floor.default: (-3, 3), aten.round.default: (-3, 3), aten.trunc.default: (-3, 3),
    aten.elu.default: (-2, 2), aten.hardtanh.default: (-2, 2), aten.leaky_relu.default: (-2, 2),
    aten.isinf.default: (-2, 2), aten.isnan.default: (-2, 2), aten.erfinv.default: (-0.9, 0.9),
    aten.lift_fresh_copy.default: (-2, 2),
    # kept whole by capture (torch's core table would decompose them)
    aten.silu.default: (-3, 3), aten.softplus.default: (-3, 3), aten.mish.default: (-3, 3),
    aten.hardsigmoid.default: (-4, 4),
}


@pytest.mark.parametrize("op", sorted(UNARY, key=str), ids=str)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_unary_pointwise(data, op):
    """New unary pointwise ops keep any split of their input."""
    low, high = UNARY[op]
    check_op(data.draw, op, op, (_rand(4, 6, low=low, high=high),))


ACTIVATION_BACKWARD = {  # kept whole by capture: linear in the incoming gradient (arg 0)
    "gelu_backward": lambda g, x: aten.gelu_backward.default(g, x, approximate="tanh"),
    "silu_backward": lambda g, x: aten.silu_backward.default(g, x),
    "sigmoid_backward": lambda g, x: aten.sigmoid_backward.default(g, torch.sigmoid(x)),
    "tanh_backward": lambda g, x: aten.tanh_backward.default(g, torch.tanh(x)),
    "hardtanh_backward": lambda g, x: aten.hardtanh_backward.default(g, x, -1.0, 1.0),
    "leaky_relu_backward": lambda g, x: aten.leaky_relu_backward.default(g, x, 0.1, False),
    "elu_backward": lambda g, x: aten.elu_backward.default(g, 1.0, 1.0, 1.0, False, x),
    "softplus_backward": lambda g, x: aten.softplus_backward.default(g, x, 1.0, 20.0),
    "mish_backward": lambda g, x: aten.mish_backward.default(g, x),
    "hardsigmoid_backward": lambda g, x: aten.hardsigmoid_backward.default(g, x),
}


@pytest.mark.parametrize("name", sorted(ACTIVATION_BACKWARD))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_activations_kept_whole(data, name):
    """Activations and their backwards (capture no longer decomposes them) keep any split, and
    a Partial gradient passes the backwards."""
    op = getattr(aten, name).default
    check_op(data.draw, op, ACTIVATION_BACKWARD[name], (_rand(4, 6), _rand(4, 6)), partial=(0,))


BINARY = {
    "atan2": (aten.atan2.default, lambda a, b: aten.atan2.default(a, b), False),
    "pow_scalar": (aten.pow.Scalar, lambda a, b: aten.pow.Scalar(2.0, b), False),
    "clamp_tensor": (aten.clamp.Tensor, lambda a, b: aten.clamp.Tensor(a, b[0], b[1]), False),
    "div_floor": (aten.div.Tensor_mode, lambda a, b: aten.div.Tensor_mode(a, b.abs() + 0.5, rounding_mode="floor"), False),
    "div_trunc_scalar": (aten.div.Scalar_mode, lambda a, b: aten.div.Scalar_mode(a, 0.7, rounding_mode="trunc"), False),
    "fmod": (aten.fmod.Tensor, lambda a, b: aten.fmod.Tensor(a, b.abs() + 0.5), False),
    "fmod_scalar": (aten.fmod.Scalar, lambda a, b: aten.fmod.Scalar(a, 0.7), False),
    "remainder": (aten.remainder.Tensor, lambda a, b: aten.remainder.Tensor(a, b.abs() + 0.5), False),
    "remainder_scalar": (aten.remainder.Scalar, lambda a, b: aten.remainder.Scalar(a, 0.7), False),
    "copy": (aten.copy.default, lambda a, b: aten.copy.default(a, b[0]), True),
    "logical_xor": (aten.logical_xor.default, lambda a, b: aten.logical_xor.default(a > 0, b[0] > 0), False),
    "floor_divide": (aten.floor_divide.default, lambda a, b: aten.floor_divide.default(a, b.abs() + 0.5), False),
    "floor_divide_scalar": (aten.floor_divide.Scalar, lambda a, b: aten.floor_divide.Scalar(a, 0.7), False),
    "zeta": (aten.special_zeta.default, lambda a, b: aten.special_zeta.default(a.abs() + 1.5, b.abs() + 0.5), False),
    "zeta_other_scalar": (aten.special_zeta.other_scalar,
                          lambda a, b: aten.special_zeta.other_scalar(a.abs() + 1.5, 0.7), False),
    "zeta_self_scalar": (aten.special_zeta.self_scalar,
                         lambda a, b: aten.special_zeta.self_scalar(2.5, b.abs() + 0.5), False),
}


@pytest.mark.parametrize("name", sorted(BINARY))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_binary_pointwise(data, name):
    """Binary pointwise ops with broadcasting; copy passes a Partial source."""
    op, fn, linear = BINARY[name]
    check_op(data.draw, op, fn, (_rand(4, 6), _rand(4, 6)), partial=(1,) if linear else ())


BITWISE = [aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor,
           aten.bitwise_and.Scalar, aten.bitwise_or.Scalar, aten.bitwise_xor.Scalar, aten.bitwise_not.default]


@pytest.mark.parametrize("op", BITWISE, ids=str)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_bitwise(data, op):
    """Bitwise ops on integer tensors."""
    a, b = torch.randint(0, 64, (4, 6), generator=_GEN), torch.randint(0, 64, (6,), generator=_GEN)
    name = op._schema.overload_name
    fn = (lambda x, y: op(x)) if name == "" else (lambda x, y: op(x, 5)) if name == "Scalar" else op
    check_op(data.draw, op, fn, (a, b))


def test_atan2_out():
    """The out= overload of atan2 (never captured: functionalized) splits `out` like the result."""
    mesh = hpfun.Mesh.simulated((2,), ("a",))
    a, b = _rand(4, 6), _rand(4, 6)
    draw = iter([mesh.shape, Shard(0), Shard(0), Shard(0)])
    check_op(lambda _: next(draw), aten.atan2.out, lambda x, y, o: aten.atan2.out(x, y, out=o), (a, b, torch.empty(4, 6, dtype=torch.float64)))


# ---------------------------------------------------------------------------------------------
# Factories and random ops
# ---------------------------------------------------------------------------------------------


@settings(max_examples=10)
@given(data=st.data())
def test_factories(data):
    """arange gives a replicated output; fill takes its input's split; forward-mode AD's zeros
    take the splits of the shapes they are made from."""
    check_op(data.draw, aten.arange.start_step, lambda x: (aten.arange.start_step(2, 14, 3), x * 1), (_rand(4),))
    check_op(data.draw, aten.fill.Scalar, lambda x: aten.fill.Scalar(x, 1.5), (_rand(4, 6),), partial=(0,))
    # forward-mode AD's tangent maker: zeros of shape a.shape[:k] + b.shape (b added: its split shows)
    same = aten._new_zeros_with_same_feature_meta.default
    check_op(data.draw, same, lambda a, b: same(a, b) + b, (_rand(4, 2), _rand(4, 6)), partial=(0, 1))
    check_op(data.draw, same, lambda a, b: same(a, b, self_num_batch_dims=1) + b, (_rand(4, 8), _rand(2, 4)),
             partial=(0, 1))
    check_op(data.draw, same, lambda a, b: same(a, b, self_num_batch_dims=2) + b, (_rand(2, 4, 8), _rand(4)))
    # windows and 0-d tensors made from numbers alone: replicated (torch.xlogy(t, 2.0) makes one)
    for op, fn in ((aten.hamming_window.periodic_alpha_beta, lambda: aten.hamming_window.periodic_alpha_beta(
                        6, False, 0.5, 0.4, dtype=torch.float64)),
                   (aten.blackman_window.default, lambda: aten.blackman_window.default(6, dtype=torch.float64)),
                   (aten.bartlett_window.periodic, lambda: aten.bartlett_window.periodic(6, False, dtype=torch.float64)),
                   (aten.kaiser_window.beta, lambda: aten.kaiser_window.beta(6, True, 8.0, dtype=torch.float64)),
                   (torch.ops.prims.scalar_tensor.default, lambda: torch.ops.prims.scalar_tensor.default(
                        2.5, dtype=torch.float64, device=torch.device("cpu")).expand(6))):
        check_op(data.draw, op, lambda x, fn=fn: x * fn(), (_rand(4, 6),), partial=(0,))



SPECIAL = {  # name: (op, fn of a (4, 6) tensor and a (6,) one)
    "bessel_j0": (aten.special_bessel_j0.default, lambda a, b: aten.special_bessel_j0.default(a)),
    "bessel_y1": (aten.special_bessel_y1.default, lambda a, b: aten.special_bessel_y1.default(a.abs() + 0.5)),
    "modified_bessel_k0": (aten.special_modified_bessel_k0.default,
                           lambda a, b: aten.special_modified_bessel_k0.default(a.abs() + 0.5)),
    "scaled_modified_bessel_k1": (aten.special_scaled_modified_bessel_k1.default,
                                  lambda a, b: aten.special_scaled_modified_bessel_k1.default(a.abs() + 0.5)),
    "chebyshev_t": (aten.special_chebyshev_polynomial_t.default,
                    lambda a, b: aten.special_chebyshev_polynomial_t.default(a, (b.abs() * 3).round())),
    "hermite_h_n_scalar": (aten.special_hermite_polynomial_h.n_scalar,
                           lambda a, b: aten.special_hermite_polynomial_h.n_scalar(a, 3)),
    "legendre_p_x_scalar": (aten.special_legendre_polynomial_p.x_scalar,
                            lambda a, b: aten.special_legendre_polynomial_p.x_scalar(0.3, (b.abs() * 3).round())),
    "fftfreq": (aten.fft_fftfreq.default, lambda a, b: b * aten.fft_fftfreq.default(6, 0.5, dtype=torch.float64)),
    "rfftfreq": (aten.fft_rfftfreq.default, lambda a, b: a * aten.fft_rfftfreq.default(10, dtype=torch.float64)),
    "range_step": (aten.range.step, lambda a, b: b * aten.range.step(1, 6, dtype=torch.float64)),
}


@pytest.mark.parametrize("name", sorted(SPECIAL))
@settings(max_examples=3)
@given(data=st.data())
def test_special_functions_and_frequency_factories(data, name):
    """torch.special's Bessel functions and orthogonal polynomials keep any split (they
    had no rule); the FFT's sample frequencies and torch.range are replicated, made from numbers."""
    op, fn = SPECIAL[name]
    check_op(data.draw, op, fn, (_rand(4, 6), _rand(6)))

def test_empty_strided_is_replicated():
    """empty_strided's values are undefined: only its layout and shape are checked."""
    mesh = hpfun.Mesh.simulated((2,), ("a",))
    f = hpfun.shard(lambda x: aten.empty_strided.default([4, 2], [2, 1]), mesh=mesh, in_specs=None)
    out = f(_rand(2))
    assert out.layout.is_replicated and out.global_shape == (4, 2)


RANDOM = {  # op: a function drawing with it from a (4, 6) input
    aten.rand.default: lambda x: aten.rand.default([4, 6]) + 0 * x,
    aten.randn.default: lambda x: aten.randn.default([4, 6]) + 0 * x,
    aten.randperm.default: lambda x: aten.randperm.default(4),
    aten.randint.low: lambda x: aten.randint.low(2, 9, [4, 6]),
    aten.rand_like.default: aten.rand_like.default,
    aten.bernoulli.p: lambda x: aten.bernoulli.p(x, 0.3),
    aten.bernoulli.default: lambda x: aten.bernoulli.default(x.abs().clamp(max=1)),
    aten.native_dropout.default: lambda x: aten.native_dropout.default(x, 0.5, True),
}


@pytest.mark.parametrize("op", sorted(RANDOM, key=str), ids=str)
def test_random_ops_draw_the_same_values_on_every_layout(op):
    """The YAML wiring of random ops: with one seed, a split draw equals the draw on one rank."""
    x = _rand(4, 6)

    def draw(shape, spec):
        mesh = hpfun.Mesh.simulated(shape, ("a", "b")[: len(shape)])
        with hpfun.random_seed(5):
            out = hpfun.shard(RANDOM[op], mesh=mesh, in_specs=spec)(x)
        return [o.full() for o in (out if isinstance(out, (tuple, list)) else [out])]

    whole = draw((1,), hpfun.P())
    for shape, spec in [((2,), hpfun.P("a")), ((2, 2), hpfun.P("b", "a"))]:
        for got, expected in zip(draw(shape, spec), whole, strict=True):
            torch.testing.assert_close(got, expected)


# ---------------------------------------------------------------------------------------------
# Reductions, ops along dims, pads
# ---------------------------------------------------------------------------------------------

ALONG = {
    # a split reduced dim: each block's winner, gathered (ties: rounded values, the first index wins)
    "argmax": (aten.argmax.default, lambda x: aten.argmax.default(x, 1), ()),
    "argmax_ties": (aten.argmax.default, lambda x: aten.argmax.default(x.round(), 0, True), ()),
    "argmax_all": (aten.argmax.default, lambda x: aten.argmax.default(x), ()),
    "argmin_ties": (aten.argmin.default, lambda x: aten.argmin.default(x.round(), -1), ()),
    "max_dim": (aten.max.dim, lambda x: aten.max.dim(x.round(), 1), ()),
    "min_dim_keepdim": (aten.min.dim, lambda x: aten.min.dim(x, 2, True), ()),
    # p-norms over split dims: the blocks' norms to the p summed, the root taken; max/min/0: Partial
    "vector_norm": (aten.linalg_vector_norm.default, lambda x: aten.linalg_vector_norm.default(x), ()),
    "vector_norm_dims": (aten.linalg_vector_norm.default, lambda x: aten.linalg_vector_norm.default(x, 3, [0, 2], True), ()),
    "vector_norm_inf": (aten.linalg_vector_norm.default, lambda x: aten.linalg_vector_norm.default(x, -math.inf, [1]), ()),
    "vector_norm_0": (aten.linalg_vector_norm.default, lambda x: aten.linalg_vector_norm.default(x.round(), 0, [1, 2]), ()),
    "vector_norm_1_f64": (aten.linalg_vector_norm.default,
                          lambda x: aten.linalg_vector_norm.default(aten._to_copy.default(x, dtype=torch.float32), 1, [0],
                                                                            dtype=torch.float64), ()),
    "any": (aten.any.default, lambda x: aten.any.default(x > 0.5), ()),
    "any_dim": (aten.any.dim, lambda x: aten.any.dim(x > 0.5, 1), ()),
    "any_dims": (aten.any.dims, lambda x: aten.any.dims(x > 0.5, [0, 2], True), ()),
    "prod": (aten.prod.default, lambda x: aten.prod.default(x), ()),
    "var_dim": (aten.var.dim, lambda x: aten.var.dim(x, [1], True, True), ()),
    "sort": (aten.sort.default, lambda x: aten.sort.default(x, 1, True), ()),
    "sort_last": (aten.sort.default, lambda x: aten.sort.default(x), ()),
    "sort_stable": (aten.sort.stable, lambda x: aten.sort.stable(x, stable=True, dim=0, descending=True), ()),
    "topk": (aten.topk.default, lambda x: aten.topk.default(x, 2, 0), ()),
    "topk_last": (aten.topk.default, lambda x: aten.topk.default(x, 3), ()),
    "flip": (aten.flip.default, lambda x: aten.flip.default(x, [0, 2]), (0,)),
    "cumsum": (aten.cumsum.default, lambda x: aten.cumsum.default(x, 1), (0,)),
    "cumprod": (aten.cumprod.default, lambda x: aten.cumprod.default(x, 2), ()),
    "vector_norm": (aten.linalg_vector_norm.default, lambda x: aten.linalg_vector_norm.default(x, 2, [1], True), ()),
    "fft_r2c": (aten._fft_r2c.default, lambda x: aten._fft_r2c.default(x, [2], 0, True), (0,)),
    "pad_zero": (aten.constant_pad_nd.default, lambda x: aten.constant_pad_nd.default(x, [1, 2]), (0,)),
    "pad_value": (aten.constant_pad_nd.default, lambda x: aten.constant_pad_nd.default(x, [0, 0, 1, 0], 2.5), (0,)),
    "reflect1d": (aten.reflection_pad1d.default, lambda x: aten.reflection_pad1d.default(x, [1, 1]), (0,)),
    "reflect2d": (aten.reflection_pad2d.default, lambda x: aten.reflection_pad2d.default(x, [1, 1, 0, 1]), (0,)),
    "replicate2d": (aten.replication_pad2d.default, lambda x: aten.replication_pad2d.default(x, [2, 0, 1, 1]), (0,)),
}
ALONG_COMPLEX = {  # on a (4, 5, 4) complex input: the half spectrum of 8 points along dim 1
    "fft_c2r": (aten._fft_c2r.default, lambda x: aten._fft_c2r.default(x, [1], 2, 8), ()),
}
ALONG_4D = {
    "reflect3d": (aten.reflection_pad3d.default, lambda x: aten.reflection_pad3d.default(x, [1, 1, 0, 0, 1, 0]), (0,)),
    "replicate3d": (aten.replication_pad3d.default, lambda x: aten.replication_pad3d.default(x, [0, 1, 1, 0, 1, 1]), (0,)),
}


@pytest.mark.parametrize("name", sorted(ALONG) + sorted(ALONG_COMPLEX) + sorted(ALONG_4D))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_reductions_sorts_and_pads(data, name):
    """Reductions, sort/topk/flip/cumsum/fft along dims and pads: the dims they work along are
    whole, the others split; linear ones pass a Partial input."""
    op, fn, partial = {**ALONG, **ALONG_COMPLEX, **ALONG_4D}[name]
    x = _rand(2, 4, 4, 4) if name in ALONG_4D else torch.fft.rfft(_rand(4, 8, 4), dim=1) if name in ALONG_COMPLEX else _rand(4, 8, 4)
    check_op(data.draw, op, fn, (x,), partial=partial)


@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_pinv_of_a_batch_of_matrices(data):
    """`torch.linalg.pinv` (pytorch-optimizer's LoRA-RITE) had no rule: each matrix whole, the
    batch dims split."""
    x = _rand(4, 2, 5, 3)
    check_op(data.draw, aten.linalg_pinv.atol_rtol_tensor, lambda x: torch.linalg.pinv(x), (x,))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, "there and back"], ids=str)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_view_as_another_dtype(data, dtype):
    """`x.view(dtype)`, the bits read as another dtype (a float's exponent bits as int32), had no rule:
    elementwise for the same element size; another size changes the last dim's length."""
    x = _rand(4, 2, 6)
    check_op(data.draw, aten.view.dtype, lambda x: x.view(torch.int32).view(torch.float32) if isinstance(dtype, str)
             else x.view(dtype), (x,))


# ---------------------------------------------------------------------------------------------
# Dimension algebra
# ---------------------------------------------------------------------------------------------

SHAPE = {
    "repeat": (aten.repeat.default, lambda x, s: aten.repeat.default(x, [2, 1, 1, 2]), (0,)),
    "diagonal": (aten.diagonal.default, lambda x, s: aten.diagonal.default(x, 1, 0, 2) * 1, (0,)),
    "diagonal_default": (aten.diagonal.default, lambda x, s: aten.diagonal.default(x) * 1, (0,)),
    "slice_scatter": (aten.slice_scatter.default, lambda x, s: aten.slice_scatter.default(x, s, 1, 2, 6), (0, 1)),
    "select_scatter": (aten.select_scatter.default, lambda x, s: aten.select_scatter.default(x, s[:, 0], 1, 3), (0, 1)),
    "as_strided": (aten.as_strided.default, lambda x, s: aten.as_strided.default(x, [4, 2], [1, 4], 1), (0,)),
    "as_strided_scatter": (aten.as_strided_scatter.default,
                           lambda x, s: aten.as_strided_scatter.default(x, s[0, :2], [2, 4], [4, 1], 3), (0, 1)),
}


@pytest.mark.parametrize("name", sorted(SHAPE))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_shape_ops(data, name):
    """repeat, diagonal, slice/select_scatter move splits (or gather); Partial passes."""
    op, fn, partial = SHAPE[name]
    check_op(data.draw, op, fn, (_rand(4, 8, 4), _rand(4, 4, 4)), partial=partial)


FUNCTIONALS = {  # what models call; each is captured with its gradient (input shape (2, 4, 8, 8) unless 3-D/5-D)
    "interpolate": lambda x: F.interpolate(x, scale_factor=2, mode="bilinear") + 0,
    "interpolate_bicubic": lambda x: F.interpolate(x, size=(5, 5), mode="bicubic"),
    "interpolate_bilinear_antialias": lambda x: F.interpolate(x, size=(5, 5), mode="bilinear", antialias=True),
    "interpolate_bicubic_antialias": lambda x: F.interpolate(x, size=(5, 5), mode="bicubic", antialias=True),
    "dist": lambda x: torch.dist(x, x.flip(-1) * 0.5, 3),
    "narrow_copy": lambda x: x.narrow_copy(2, 1, 5),
    "interpolate_nearest": lambda x: F.interpolate(x, scale_factor=2),
    "adaptive_max_pool": lambda x: F.adaptive_max_pool2d(x, 2), "avg_pool": lambda x: F.avg_pool2d(x, 2),
    "max_pool": lambda x: F.max_pool2d(x, 2), "conv_transpose": lambda x: F.conv_transpose2d(x, torch.ones(4, 3, 3, 3)),
    "pad_reflect": lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"), "pad_replicate": lambda x: F.pad(x, (1, 1, 1, 1), mode="replicate"),
    "pixel_shuffle": lambda x: F.pixel_shuffle(x, 2), "unfold": lambda x: F.unfold(x, 2), "normalize": lambda x: F.normalize(x, dim=1),
    "rms_norm": lambda x: F.rms_norm(x, (8,)), "instance_norm": F.instance_norm, "group_norm": lambda x: F.group_norm(x, 2),
    "layer_norm": lambda x: F.layer_norm(x, (8,)), "silu": F.silu, "mish": F.mish, "softplus": F.softplus,
    "hardswish": F.hardswish, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu6": F.relu6, "selu": F.selu,
    "logsigmoid": F.logsigmoid, "elu": F.elu, "leaky_relu": F.leaky_relu, "erfinv": lambda x: torch.erfinv(x.tanh() * 0.9),
    "mse": lambda x: F.mse_loss(x, x.detach() * 0.5), "smooth_l1": lambda x: F.smooth_l1_loss(x, x.detach() * 0.5),
    "bce_logits": lambda x: F.binary_cross_entropy_with_logits(x, x.detach().sigmoid()),
    "kl_div": lambda x: F.kl_div(x.log_softmax(1), x.detach().softmax(1), reduction="batchmean"),
    "cross_entropy": lambda x: F.cross_entropy(x, torch.zeros(2, 8, 8, dtype=torch.long), label_smoothing=0.1),
    "slice_assign": lambda x: _assign(x), "index_add": lambda x: x.index_add(1, torch.tensor([0, 1]), x[:, :2]),
    "cumprod": lambda x: x.cumprod(1), "logsumexp": lambda x: x.logsumexp(1), "std": lambda x: x.std(1),
    "lerp": lambda x: torch.lerp(x, x * 2, 0.3), "addcdiv": lambda x: torch.addcdiv(x, x, x.abs() + 1, value=0.5),
    "tril": lambda x: x.tril(), "roll": lambda x: x.roll(1, 2), "topk": lambda x: x.topk(2, 1).values,
    "embedding": lambda x: F.embedding(torch.tensor([[0, 2], [1, 3]]), x.reshape(16, 32)),
    "attention": lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True),
    "dropout": F.dropout,
}
FUNCTIONALS_3D = {"conv1d": lambda x: F.conv1d(x, torch.ones(3, 4, 3)), "interpolate_linear": lambda x: F.interpolate(x, scale_factor=2, mode="linear"),
                  "max_pool1d": lambda x: F.max_pool1d(x, 2)}
FUNCTIONALS_5D = {"conv3d": lambda x: F.conv3d(x, torch.ones(3, 4, 3, 3, 3)), "max_pool3d": lambda x: F.max_pool3d(x, 2),
                  "avg_pool3d": lambda x: F.avg_pool3d(x, 2), "adaptive_avg_pool3d": lambda x: F.adaptive_avg_pool3d(x, 2),
                  "interpolate_trilinear": lambda x: F.interpolate(x, scale_factor=2, mode="trilinear")}


def _with_gradient(fn):
    return lambda x: [fn(x), torch.func.grad(lambda x: fn(x).sum())(x)]


def _assign(x):
    y = x * 1
    y[:, 1:3] = 0.5
    return y


def test_common_functionals_capture_to_ops_with_rules():
    """Common torch.nn.functional calls and their gradients capture to ops that all have a rule."""
    from hpfun.capture import capture

    missing = {}
    shapes = {**dict.fromkeys(FUNCTIONALS, (2, 4, 8, 8)), **dict.fromkeys(FUNCTIONALS_3D, (2, 4, 8)),
              **dict.fromkeys(FUNCTIONALS_5D, (2, 4, 4, 4, 4))}
    for name, fn in {**FUNCTIONALS, **FUNCTIONALS_3D, **FUNCTIONALS_5D}.items():
        gm = capture(_with_gradient(fn), [(shapes[name], torch.float32)])
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target.__module__ != "_operator" and REGISTRY.lookup(node.target) is None:
                missing.setdefault(str(node.target), []).append(name)
    assert missing == {}


def test_the_harness_catches_a_wrong_rule(monkeypatch):
    """A rule claiming exp is linear (Partial passes) fails the ground-truth check."""
    from hpfun.rules.pointwise import Pointwise
    from hpfun.rules.registry import Entry

    REGISTRY.ops()  # the built-ins load first
    monkeypatch.setitem(REGISTRY._entries, aten.exp.default, Entry(Pointwise(linear_joint=(0,)), "test"))
    draw = iter([(2,), Partial("sum")])
    with pytest.raises(AssertionError, match="aten.exp.default"):
        check_op(lambda _: next(draw), aten.exp.default, aten.exp.default, (_rand(4),), partial=(0,))


# ---------------------------------------------------------------------------------------------
# Lookups: embedding, index_select, index, index_put, scatter_reduce
# ---------------------------------------------------------------------------------------------


def _ids(high, *shape, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


LOOKUPS = {
    "gather": (aten.gather.default, lambda x, i: aten.gather.default(x, 1, i), (_rand(4, 8), _ids(8, 4, 4)), (0,)),
    "gather_rows": (aten.gather.default, lambda x, i: aten.gather.default(x, 0, i), (_rand(8, 4), _ids(8, 8, 4)), (0,)),
    "embedding": (aten.embedding.default, lambda w, i: aten.embedding.default(w, i), (_rand(8, 4), _ids(8, 4, 2)), (0,)),
    "embedding_padding": (aten.embedding.default, lambda w, i: aten.embedding.default(w, i, 3), (_rand(8, 4), _ids(8, 2, 4)), (0,)),
    "embedding_backward": (
        aten.embedding_dense_backward.default, lambda g, i: aten.embedding_dense_backward.default(g, i, 8, -1, False),
        (_rand(4, 2, 4), _ids(8, 4, 2)), (0,)),
    "embedding_backward_padding_freq": (
        aten.embedding_dense_backward.default, lambda g, i: aten.embedding_dense_backward.default(g, i, 8, 2, True),
        (_rand(4, 4), _ids(8, 4)), (0,)),
    "index_select": (aten.index_select.default, lambda x, i: aten.index_select.default(x, 1, i), (_rand(4, 8, 2), _ids(8, 4)), (0,)),
    "index_select_0": (aten.index_select.default, lambda x, i: aten.index_select.default(x, 0, i), (_rand(8, 4), _ids(8, 8)), (0,)),
    "scatter_reduce_sum": (aten.scatter_reduce.two, lambda x, i, s: aten.scatter_reduce.two(x, 1, i, s, "sum"),
                           (_rand(4, 8), _ids(8, 4, 4), _rand(4, 4)), ()),
    "scatter_reduce_amax": (aten.scatter_reduce.two, lambda x, i, s: aten.scatter_reduce.two(x, 0, i, s, "amax", include_self=False),
                            (_rand(8, 4), _ids(8, 4, 4), _rand(4, 4)), ()),
    "scatter_src_add": (aten.scatter.reduce, lambda x, i, s: aten.scatter.reduce(x, 1, i, s, reduce="add"),
                        (_rand(4, 8), _ids(8, 4, 4), _rand(4, 4)), ()),
    "scatter_value_multiply": (aten.scatter.value_reduce,
                               lambda x, i: aten.scatter.value_reduce(x, 0, i, 1.5, reduce="multiply"),
                               (_rand(8, 4), _ids(8, 4, 4)), ()),
    "index_reduce_prod": (aten.index_reduce.default, lambda x, i, s: aten.index_reduce.default(x, 0, i, s, "prod"),
                          (_rand(8, 4), _ids(8, 6), _rand(6, 4)), ()),
    "index_reduce_mean": (aten.index_reduce.default,
                          lambda x, i, s: aten.index_reduce.default(x, 1, i, s, "mean", include_self=False),
                          (_rand(4, 8), _ids(8, 6), _rand(4, 6)), ()),
}
INDEX = {  # name: (x[indices] with these index tensors at these dims, x's shape)
    "first": ([_ids(8, 4)], (8, 4, 2)),
    "middle": ([None, _ids(4, 2, 4, seed=1)], (8, 4, 2)),
    "adjacent_broadcast": ([None, _ids(4, 4, 1, seed=2), _ids(2, 2, seed=3)], (8, 4, 2)),
    "apart": ([_ids(8, 4, seed=4), None, _ids(2, 4, seed=5)], (8, 4, 2)),
    "negative": ([_ids(8, 4, seed=6) - 8], (8, 4, 2)),
}


@pytest.mark.parametrize("name", sorted(LOOKUPS))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_lookups(data, name):
    """Lookups along a split dim are masked local lookups (Partial(sum)); other splits follow."""
    op, fn, inputs, partial = LOOKUPS[name]
    check_op(data.draw, op, fn, inputs, partial=partial)


@pytest.mark.parametrize("name", sorted(INDEX))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_index(data, name):
    """x[indices] for adjacent, apart, broadcast and negative index tensors, any split."""
    indices, shape = INDEX[name]
    fn = lambda x, *ts: aten.index.Tensor(x, _fill(indices, ts))  # noqa: E731
    check_op(data.draw, aten.index.Tensor, fn, (_rand(*shape), *[t for t in indices if t is not None]), partial=(0,))


@pytest.mark.parametrize("name", sorted(INDEX))
@settings(max_examples=2 * EXAMPLES)
@given(data=st.data(), accumulate=st.booleans(), broadcast=st.booleans())
def test_index_put(data, name, accumulate, broadcast):
    """x[indices] = v (or += v): masked local writes on a split indexed dim; Partial x and v
    together; split index tensors and values give Partial(sum) when accumulating."""
    indices, shape = INDEX[name]
    x = _rand(*shape)
    out_shape = aten.index.Tensor(x, indices).shape
    values = _rand(*out_shape[-1:]) if broadcast else _rand(*out_shape)
    if not accumulate:  # distinct positions: which of two writes to one place wins is unspecified
        indices = [None if t is None else torch.arange(t.numel()).reshape(t.shape) % (shape[d] // 2) for d, t in enumerate(indices)]
    fn = lambda x, *ts: aten.index_put.default(x, _fill(indices, ts[:-1]), ts[-1], accumulate)  # noqa: E731
    tensors = [t for t in indices if t is not None]
    check_op(data.draw, aten.index_put.default, fn, (x, *tensors, values), partial=(0, len(tensors) + 1))


def _fill(template: list, tensors) -> list:
    """`template` with its tensors replaced, in order, by `tensors`."""
    it = iter(tensors)
    return [None if t is None else next(it) for t in template]


# ---------------------------------------------------------------------------------------------
# Contraction-shaped ops, convolution, pooling
# ---------------------------------------------------------------------------------------------

CONTRACTION = {
    "cdist": (aten._cdist_forward.default, lambda a, b: aten._cdist_forward.default(a, b, 2.0, None), (_rand(8, 4), _rand(4, 4)), ()),
    "cdist_batched": (aten._cdist_forward.default, lambda a, b: aten._cdist_forward.default(a, b, 1.0, None),
                      (_rand(2, 4, 4), _rand(2, 8, 4)), ()),
    "grid_sampler": (aten.grid_sampler_2d.default, lambda x, g: aten.grid_sampler_2d.default(x, g, 0, 0, False),
                     (_rand(2, 4, 4, 4), _rand(2, 4, 2, 2, low=-1, high=1)), (0,)),
    # torch's grouped matmul (bfloat16 only, as traced; small integers, whose sums bfloat16 holds
    # exactly): rows grouped by offs, the weight's gradient (contracted rows grouped), and batched
    "grouped_mm": (aten._grouped_mm.default, lambda a, b, offs: aten._grouped_mm.default(a, b, offs),
                   (_ints(8, 32), _ints(2, 32, 32), torch.tensor([3, 8], dtype=torch.int32)), ()),
    "grouped_mm_weight_grad": (aten._grouped_mm.default, lambda a, b, offs: aten._grouped_mm.default(aten.permute.default(a, [1, 0]), b, offs),
                               (_ints(8, 32), _ints(8, 32), torch.tensor([5, 8], dtype=torch.int32)), ()),
    "grouped_mm_batched": (aten._grouped_mm.default, lambda a, b: aten._grouped_mm.default(a, b),
                           (_ints(4, 8, 32), _ints(4, 32, 32)), ()),
}
POOL = {  # name: (op, fn of x [and grad], partial positions); backwards take a (2, 4, 2, 2) grad
    "avg_pool2d": (aten.avg_pool2d.default, lambda x: aten.avg_pool2d.default(x, [2, 2], [1, 2], [1, 0]), (0,)),
    "avg_pool2d_backward": (aten.avg_pool2d_backward.default,
                            lambda x, g: aten.avg_pool2d_backward.default(g, x, [2, 2], [2, 2], [0, 0], False, True, None), (1,)),
    "adaptive_avg_pool2d": (aten._adaptive_avg_pool2d.default, lambda x: aten._adaptive_avg_pool2d.default(x, [3, 2]), (0,)),
    "adaptive_avg_pool2d_backward": (aten._adaptive_avg_pool2d_backward.default,
                                     lambda x, g: aten._adaptive_avg_pool2d_backward.default(g, x), (1,)),
    "max_pool2d": (aten.max_pool2d_with_indices.default, lambda x: aten.max_pool2d_with_indices.default(x, [2, 2], [2, 1]), ()),
    "max_pool2d_backward": (
        aten.max_pool2d_with_indices_backward.default,
        lambda x, g: aten.max_pool2d_with_indices_backward.default(
            g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, aten.max_pool2d_with_indices.default(x, [2, 2])[1]), (1,)),
    "upsample_bilinear": (aten.upsample_bilinear2d.vec, lambda x: aten.upsample_bilinear2d.vec(x, None, False, [2.0, 1.5]), (0,)),
    "upsample_nearest": (aten.upsample_nearest2d.vec, lambda x: aten.upsample_nearest2d.vec(x, [6, 8], None), (0,)),
}
POOL_COL = {  # col2im((N, C * kh * kw, L)) with C = 4
    "col2im": (aten.col2im.default, lambda x: aten.col2im.default(x, [3, 3], [2, 2], [1, 1], [0, 0], [1, 1]), (0,)),
}
POOL_CAPTURED = {  # not core: what capture produces for F.interpolate and adaptive max pooling
    "upsample_bilinear2d": (aten.upsample_bilinear2d.default, lambda x: aten.upsample_bilinear2d.default(x, [6, 8], True), (0,)),
    "upsample_bicubic2d": (aten.upsample_bicubic2d.default, lambda x: aten.upsample_bicubic2d.default(x, [5, 5], False), (0,)),
    "upsample_bilinear2d_aa": (aten._upsample_bilinear2d_aa.default,
                               lambda x: aten._upsample_bilinear2d_aa.default(x, [3, 3], False), (0,)),
    "upsample_bicubic2d_aa": (aten._upsample_bicubic2d_aa.default,
                              lambda x: aten._upsample_bicubic2d_aa.default(x, [3, 5], True), (0,)),
    "upsample_bilinear2d_aa_backward": (aten._upsample_bilinear2d_aa_backward.default, lambda x, g:
                                        aten._upsample_bilinear2d_aa_backward.default(g, [2, 2], [2, 4, 4, 4], False), (1,)),
    "upsample_bicubic2d_aa_backward": (aten._upsample_bicubic2d_aa_backward.default, lambda x, g:
                                       aten._upsample_bicubic2d_aa_backward.default(g, [2, 2], [2, 4, 4, 4], False), (1,)),
    "upsample_nearest2d_backward": (aten.upsample_nearest2d_backward.default,
                                    lambda x, g: aten.upsample_nearest2d_backward.default(g, [2, 2], [2, 4, 4, 4]), (1,)),
    "upsample_bilinear2d_backward": (aten.upsample_bilinear2d_backward.default,
                                     lambda x, g: aten.upsample_bilinear2d_backward.default(g, [2, 2], [2, 4, 4, 4], False), (1,)),
    "upsample_nearest_exact2d": (aten._upsample_nearest_exact2d.default,
                                 lambda x: aten._upsample_nearest_exact2d.default(x, [6, 8]), (0,)),
    "upsample_nearest_exact2d_backward": (
        aten._upsample_nearest_exact2d_backward.default,
        lambda x, g: aten._upsample_nearest_exact2d_backward.default(g, [2, 2], [2, 4, 4, 4]), (1,)),
    "adaptive_max_pool2d": (aten.adaptive_max_pool2d.default, lambda x: aten.adaptive_max_pool2d.default(x, [2, 3]), ()),
    "adaptive_max_pool2d_backward": (
        aten.adaptive_max_pool2d_backward.default,
        lambda x, g: aten.adaptive_max_pool2d_backward.default(g, x, aten.adaptive_max_pool2d.default(x, [2, 2])[1]), (1,)),
    "replication_pad2d_backward": (aten.replication_pad2d_backward.default,
                                   lambda x, g: aten.replication_pad2d_backward.default(g, g[:, :, 1:, :], [0, 0, 1, 0]), (1,)),
}
POOL_1D = {
    "avg_pool1d": (aten.avg_pool1d.default, lambda x: aten.avg_pool1d.default(x, [2], [1]), (0,)),
    "adaptive_avg_pool1d": (aten.adaptive_avg_pool1d.default, lambda x: aten.adaptive_avg_pool1d.default(x, [3]), (0,)),
}
POOL_3D = {
    "avg_pool3d": (aten.avg_pool3d.default, lambda x: aten.avg_pool3d.default(x, [2, 2, 2]), (0,)),
    "adaptive_avg_pool3d": (aten._adaptive_avg_pool3d.default, lambda x: aten._adaptive_avg_pool3d.default(x, [1, 2, 1]), (0,)),
    "max_pool3d": (aten.max_pool3d_with_indices.default, lambda x: aten.max_pool3d_with_indices.default(x, [2, 2, 2]), ()),
}


@pytest.mark.parametrize("name", sorted(CONTRACTION))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_contraction_shaped(data, name):
    """cdist, grid_sampler and grouped matmuls: kept letters split, contracted (not summed) letters
    whole (a grouped matmul's summed letter split gives a Partial sum)."""
    op, fn, inputs, partial = CONTRACTION[name]
    check_op(data.draw, op, fn, inputs, partial=partial)


@pytest.mark.parametrize("name", sorted(POOL) + sorted(POOL_CAPTURED) + sorted(POOL_1D) + sorted(POOL_3D) + sorted(POOL_COL))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_pooling(data, name):
    """Pools, their backwards, upsampling and col2im split batch and channels; linear ones pass Partial."""
    op, fn, partial = {**POOL, **POOL_CAPTURED, **POOL_1D, **POOL_3D, **POOL_COL}[name]
    shapes = {**dict.fromkeys(POOL_1D, (2, 4, 4)), **dict.fromkeys(POOL_3D, (2, 4, 4, 4, 4)), **dict.fromkeys(POOL_COL, (2, 16, 4))}
    x = _rand(*shapes.get(name, (2, 4, 4, 4)))
    inputs = (x, _rand(2, 4, 2, 2)) if name.endswith("backward") else (x,)
    check_op(data.draw, op, fn, inputs, partial=partial)


CONV = {  # name: (x shape, w shape, bias?, stride, padding, transposed, groups)
    "plain": ((4, 4, 5, 5), (8, 4, 3, 3), True, [1, 1], [1, 1], False, 1),
    "no_bias_strided": ((2, 4, 6, 6), (4, 4, 2, 2), False, [2, 2], [0, 0], False, 1),
    "grouped": ((2, 4, 5, 5), (8, 2, 3, 3), True, [1, 1], [0, 0], False, 2),
    "depthwise": ((2, 4, 5), (4, 1, 3), True, [1], [1], False, 4),
    "transposed": ((2, 4, 4, 4), (4, 2, 3, 3), True, [2, 2], [1, 1], True, 1),
    "transposed_grouped": ((2, 4, 4, 4), (4, 2, 3, 3), False, [1, 1], [0, 0], True, 2),
}


def _conv_inputs(name):
    xs, ws, bias, *_ = CONV[name]
    transposed, groups = CONV[name][5], CONV[name][6]
    out_channels = ws[1] * groups if transposed else ws[0]
    return _rand(*xs), _rand(*ws), (_rand(out_channels) if bias else None)


def _conv(name):
    _, _, _, stride, padding, transposed, groups = CONV[name]
    dims = len(stride)
    return lambda x, w, b: aten.convolution.default(x, w, b, stride, padding, [1] * dims, transposed, [0] * dims, groups)


@pytest.mark.parametrize("name", sorted(CONV))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_convolution(data, name):
    """convolution: split batch, out-channels, in-channels (Partial), whole groups; Partial x or w."""
    x, w, b = _conv_inputs(name)
    check_op(data.draw, aten.convolution.default, _conv(name), (x, w, b), partial=(0, 1, 2))


@pytest.mark.parametrize("name", sorted(CONV))
@settings(max_examples=EXAMPLES)
@given(data=st.data(), mask=st.sampled_from([(True, True, True), (True, True, False)]))
def test_convolution_backward(data, name, mask):
    """convolution_backward: every split of the forward, read backwards; a Partial grad_out."""
    x, w, b = _conv_inputs(name)
    _, _, _, stride, padding, transposed, groups = CONV[name]
    dims = len(stride)
    grad = _conv(name)(x, w, b)
    mask = mask if b is not None else (True, True, False)

    def fn(g, x, w):
        return aten.convolution_backward.default(
            g, x, w, None if b is None else [b.shape[0]], stride, padding, [1] * dims, transposed, [0] * dims, groups, list(mask))

    check_op(data.draw, aten.convolution_backward.default, fn, (_rand(*grad.shape), x, w), partial=(0,))


def test_convolution_backward_without_grad_input():
    """convolution_backward with output_mask [False, True, True] (the input needs no gradient)."""
    x, w, b = _conv_inputs("plain")
    fn = lambda g, x, w: aten.convolution_backward.default(  # noqa: E731
        g, x, w, [8], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, True])
    draw = iter([(2,), Shard(0), Shard(0), Replicate()])
    check_op(lambda _: next(draw), aten.convolution_backward.default, fn, (_rand(4, 8, 5, 5), x, w))


# ---------------------------------------------------------------------------------------------
# Normalizations
# ---------------------------------------------------------------------------------------------


def _stats(x, dims):
    mean = x.mean(dims, keepdim=True)
    return mean, (x.var(dims, unbiased=False, keepdim=True) + 1e-5).rsqrt()


def _layer_norm_backward(g, x, w, b):
    mean, rstd = _stats(x, [2])
    return aten.native_layer_norm_backward.default(g, x, [4], mean, rstd, w, b, [True, True, True])


def _group_norm_backward(g, x, w):
    mean, rstd = (s.reshape(4, 2) for s in _stats(x.reshape(4, 2, -1), [2]))
    return aten.native_group_norm_backward.default(g, x, mean, rstd, w, 4, 4, 9, 2, [True, True, True])


NORM = {  # name: (op, fn, input shapes (None: no tensor), partial positions)
    "layer_norm": (aten.native_layer_norm.default, lambda x, w, b: aten.native_layer_norm.default(x, [4], w, b, 1e-5),
                   ((4, 2, 4), (4,), (4,)), ()),
    "layer_norm_2d": (aten.native_layer_norm.default, lambda x, w, b: aten.native_layer_norm.default(x, [2, 4], w, b, 1e-5),
                      ((4, 2, 4), (2, 4), (2, 4)), ()),
    "layer_norm_backward": (aten.native_layer_norm_backward.default, _layer_norm_backward,
                            ((4, 2, 4), (4, 2, 4), (4,), (4,)), (0,)),
    "group_norm": (aten.native_group_norm.default, lambda x, w, b: aten.native_group_norm.default(x, w, b, 4, 4, 9, 2, 1e-5),
                   ((4, 4, 3, 3), (4,), (4,)), ()),
    "group_norm_backward": (aten.native_group_norm_backward.default, _group_norm_backward,
                            ((4, 4, 3, 3), (4, 4, 3, 3), (4,)), (0,)),
    "batch_norm_train": (aten.native_batch_norm.default,
                         lambda x, w, b: aten.native_batch_norm.default(x, w, b, None, None, True, 0.1, 1e-5),
                         ((4, 4, 3), (4,), (4,)), ()),
    "batch_norm_eval": (aten.native_batch_norm.default,
                        lambda x, w, b, m, v: aten.native_batch_norm.default(x, w, b, m, v.abs(), False, 0.1, 1e-5),
                        ((4, 4, 3), (4,), (4,), (4,), (4,)), ()),
    "legit_no_stats": (aten._native_batch_norm_legit.no_stats,
                       lambda x, w, b: aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5),
                       ((4, 4, 2, 2), (4,), (4,)), ()),
    "legit_no_training": (aten._native_batch_norm_legit_no_training.default,
                          lambda x, w, b, m, v: aten._native_batch_norm_legit_no_training.default(x, w, b, m, v.abs(), 0.1, 1e-5),
                          ((4, 4, 2), (4,), (4,), (4,), (4,)), ()),
}


@pytest.mark.parametrize("name", sorted(NORM))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_normalizations(data, name):
    """Layer, group and batch norm (and backwards): groups of normalized elements stay whole."""
    op, fn, shapes, partial = NORM[name]
    check_op(data.draw, op, fn, tuple(_rand(*s) for s in shapes), partial=partial)


# ---------------------------------------------------------------------------------------------
# Fused attention (the CPU flash op), forward and backward
# ---------------------------------------------------------------------------------------------

_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _flash(causal, with_mask=False):
    def fn(q, k, v, *mask):
        return _FLASH(q, k, v, 0.0, causal, attn_mask=mask[0] if mask else None)
    return fn


def _flash_backward(causal):
    def fn(g, q, k, v, *mask):
        kw = {"attn_mask": mask[0]} if mask else {}
        out, lse = _FLASH(q, k, v, 0.0, causal, **kw)
        return _FLASH_BACKWARD(g, q, k, v, out, lse, 0.0, causal, **kw)
    return fn


ATTENTION = {  # name: (op, fn, input shapes, partial positions); q (B, H, T, E), k and v (B, Hkv, S, E)
    "forward": (_FLASH, _flash(False), ((4, 4, 8, 4), (4, 4, 8, 4), (4, 4, 8, 4)), (2,)),
    "forward_causal_gqa": (_FLASH, _flash(True), ((4, 4, 8, 4), (4, 2, 8, 4), (4, 2, 8, 4)), ()),
    "forward_mask": (_FLASH, _flash(False), ((4, 4, 8, 4), (4, 4, 8, 4), (4, 4, 8, 4), (4, 1, 8, 8)), ()),
    "forward_row_mask": (_FLASH, _flash(False), ((4, 4, 8, 4), (4, 4, 8, 4), (4, 4, 8, 4), (8, 8)), ()),
    "backward": (_FLASH_BACKWARD, _flash_backward(False), ((4, 4, 8, 4),) * 4, (0,)),
    "backward_causal_gqa": (_FLASH_BACKWARD, _flash_backward(True),
                            ((4, 4, 8, 4), (4, 4, 8, 4), (4, 2, 8, 4), (4, 2, 8, 4)), (0,)),
    "backward_mask": (_FLASH_BACKWARD, _flash_backward(False), ((4, 4, 8, 4),) * 4 + ((4, 4, 1, 8),), (0,)),
}


@pytest.mark.parametrize("name", sorted(ATTENTION))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_fused_attention(data, name):
    """The fused attention kernel split on batch, heads or query rows (causal: under the rows'
    own mask), and its backward from a Partial gradient, equal the kernel on whole tensors."""
    op, fn, shapes, partial = ATTENTION[name]
    check_op(data.draw, op, fn, tuple(_rand(*s) for s in shapes), partial=partial, tol=1e-8)


def test_fused_attention_keeps_its_inputs_local_splits():
    """Batch, heads and query rows split in the inputs are kept; keys split along the sequence
    are not (they are gathered first, or moved to another split)."""
    mesh = hpfun.Mesh.simulated((2,), ("a",))
    gm = make_fx(_flash(False), tracing_mode="fake", pre_dispatch=True)(*(_rand(4, 4, 8, 4) for _ in range(3)))
    r, split = Layout.replicated(mesh), lambda d: Layout(mesh, (Shard(d),))

    def offered(*layouts):
        return {tuple(l.placements_str().strip("[]") for l in s.inputs) for s in _strategies(gm, mesh, _FLASH, list(layouts))}

    assert {("S(0)",) * 3, ("R",) * 3} <= offered(split(0), split(0), r)
    assert {("S(1)",) * 3, ("R",) * 3} <= offered(r, split(1), split(1))
    assert ("S(2)", "R", "R") in offered(split(2), split(2), split(2))
    assert all(p[1] != "S(2)" for p in offered(split(2), split(2), split(2)))


# ---------------------------------------------------------------------------------------------
# The NLL loss's backward, whole (capture splits it for propagation; hpfun.fuse puts it back)
# ---------------------------------------------------------------------------------------------

_NLL_BACKWARD = aten.nll_loss_backward.default
_TARGETS = torch.tensor([3, 0, -100, 5, 1, 5, 2, 7])  # one row ignored


def _nll_backward(reduction, weighted):
    def fn(g, x, t, *w):
        weight = w[0] if weighted else None
        kept = aten._to_copy.default(t != -100, dtype=x.dtype)
        total = (weight[t.clamp(min=0)] * kept).sum() if weighted else kept.sum()
        return _NLL_BACKWARD(g, x, t, weight, reduction, -100, total)
    return fn


NLL = {  # name: (reduction, weighted); logits (8, 8)
    "mean": (1, False), "mean_weighted": (1, True), "sum": (2, False), "none_weighted": (0, True),
}


@pytest.mark.parametrize("name", sorted(NLL))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_nll_loss_backward(data, name):
    """nll_loss_backward split on the batch (with the global total weight) equals it whole."""
    reduction, weighted = NLL[name]
    g = _rand(8) if reduction == 0 else _rand(1)[0]
    inputs = (g, _rand(8, 8), _TARGETS) + ((_rand(8, low=0.5),) if weighted else ())
    check_op(data.draw, _NLL_BACKWARD, _nll_backward(reduction, weighted), inputs)


def test_batch_norm_legit_with_running_stats():
    """_native_batch_norm_legit (running stats updated in place) runs with the channels split."""
    x, w, b = _rand(4, 4, 3), _rand(4), _rand(4)
    fn = lambda x, w, b, m, v: aten._native_batch_norm_legit.default(x, w, b, m, v, True, 0.1, 1e-5)  # noqa: E731
    draw = iter([(2,), Shard(1), Shard(0), Shard(0), Shard(0), Shard(0)])
    check_op(lambda _: next(draw), aten._native_batch_norm_legit.default, fn, (x, w, b, _rand(4), _rand(4, low=0.5)))


# ---------------------------------------------------------------------------------------------
# Replicate-only and data-dependent ops
# ---------------------------------------------------------------------------------------------

REPLICATED = {
    "embedding_bag": (aten._embedding_bag.default, lambda w, i, o: aten._embedding_bag.default(w, i, o, False, 1),
                      (_rand(8, 4), _ids(8, 8), torch.tensor([0, 3, 5, 5]))),
    "masked_scatter": (aten.masked_scatter.default, lambda x, m, s: aten.masked_scatter.default(x, m > 0, s),
                       (_rand(4, 4), _rand(4, 4), _rand(16))),
    "masked_scatter_backward": (aten.masked_scatter_backward.default,
                                lambda g, m: aten.masked_scatter_backward.default(g, m > 0, [16]), (_rand(4, 4), _rand(4, 4))),
    "pdist": (aten._pdist_forward.default, lambda x: aten._pdist_forward.default(x, 2.0), (_rand(4, 4),)),
    "pdist_backward": (aten._pdist_backward.default,
                       lambda g, x: aten._pdist_backward.default(g, x, 2.0, aten._pdist_forward.default(x, 2.0)),
                       (_rand(6), _rand(4, 4))),
    "embedding_bag_forward_only": (aten._embedding_bag_forward_only.default,
                                   lambda w, i, o: aten._embedding_bag_forward_only.default(w, i, o, False, 0),
                                   (_rand(8, 4), _ids(8, 8), torch.tensor([0, 3, 5, 5]))),
    "bucketize": (aten.bucketize.Tensor, lambda x, b: aten.bucketize.Tensor(x, b.sort().values), (_rand(4, 4), _rand(4))),
    "searchsorted": (aten.searchsorted.Tensor, lambda s, x: aten.searchsorted.Tensor(s.sort().values, x),
                     (_rand(4), _rand(4, 4))),
    "unfold": (aten.unfold.default, lambda x: aten.unfold.default(x, 1, 2, 1), (_rand(4, 4),)),
    "put": (aten.put.default, lambda x, i, s: aten.put.default(x, i, s, True), (_rand(4, 4), _ids(16, 6), _rand(6))),
    # nn.Embedding(max_norm=1.5): rows named by an index scaled down to the norm (some are above it)
    "embedding_renorm": (aten.embedding_renorm.default,
                         lambda w, i: aten.embedding_renorm.default(w, i, 1.5, 2.0), (_rand(8, 4), _ids(4, 8))),
}


@pytest.mark.parametrize("name", sorted(REPLICATED))
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_replicate_only_ops(data, name):
    """Replicate-only ops gather their inputs and equal the op on whole tensors."""
    op, fn, inputs = REPLICATED[name]
    check_op(data.draw, op, fn, inputs, partial=(0,))


def _call(op, *tensors, mesh=None):
    from hpfun.rules import OpCall, TensorArg, TensorMeta

    mesh = mesh or hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    args = tuple(TensorArg(shape, torch.float32, Layout(mesh, placements), i) for i, (shape, placements) in enumerate(tensors))
    return OpCall(op, args, {}, (TensorMeta((3, 2), torch.int64),), mesh)


def test_data_dependent_op_with_a_split_input_names_the_op_and_dim():
    """nonzero of a split input: a ShardingError naming the op, the dim and the mesh axis."""
    rule = REGISTRY.lookup(aten.nonzero.default)
    with pytest.raises(hpfun.ShardingError, match=r"aten.nonzero.default.*dim 1 is split over mesh axis 'tp'"):
        rule.strategies(_call(aten.nonzero.default, ((4, 4), (Partial("sum"), Shard(1)))))
    (strategy,) = rule.strategies(_call(aten.nonzero.default, ((4, 4), (Partial("sum"), Replicate()))))
    assert strategy.inputs[0].is_replicated  # a Partial input is reduced first


def test_data_dependent_capture_names_the_op():
    """What users meet first: capture cannot trace a value-dependent shape, and says which op."""
    f = hpfun.shard(lambda x: torch.nonzero(torch.rand_like(x) > 0.5), mesh=hpfun.Mesh.simulated((2,), ("a",)),
                    in_specs=hpfun.P("a"))  # (a mask of a random draw: not read, unlike one of the inputs)
    with pytest.raises(hpfun.CaptureError, match="aten.nonzero.default.*a boolean mask picks"):
        f(_rand(4))


@pytest.mark.parametrize("op", [aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default,
                                aten.sym_is_contiguous.default, aten._local_scalar_dense.default, aten.resize_.default], ids=str)
def test_metadata_ops_read_the_whole_tensor(op):
    """Ops reading sizes or a scalar (never in a static-shape trace) run on the replicated tensor."""
    (strategy,) = REGISTRY.lookup(op).strategies(_call(op, ((4, 4), (Shard(0), Partial("sum")))))
    assert all(layout.is_replicated for layout in strategy.inputs)
