"""Complex numbers shard like real ones: rotary position embeddings written with complex numbers
(Meta's reference Llama code) split on batch, heads and sequence run with no collective and no
fallback (a missing rule would raise MissingRuleError), forward and backward, and equal the
unsharded run. Also: complex outputs gather with `.full()` (Partial ones too), and the complex
rules pass Partial(sum) exactly where the op is linear over the reals."""

import pytest
import torch

import hpfun
from hpfun import Layout, P, Partial, Replicate, Shard
from hpfun.rules import REGISTRY, OpCall, TensorArg, TensorMeta, lookup
from hpfun.testing import assert_sharded_equal

aten = torch.ops.aten
B, T, H, D = 4, 8, 4, 16  # batch, sequence, heads, head dim


# ---------------------------------------------------------------------------------------------
# Meta's reference code (llama/model.py), with the dtype made a parameter for float64
# ---------------------------------------------------------------------------------------------


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0, dtype=torch.float32):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].to(dtype) / dim))
    t = torch.arange(end, dtype=dtype)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64 (complex128 for float64)


REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def reshape_for_broadcast(freqs_cis, x):
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    real = REAL[freqs_cis.dtype]  # Meta: .float(), with complex64 freqs_cis
    xq_ = torch.view_as_complex(xq.to(real).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.to(real).reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def apply_rope(x, freqs_cis):  # the one-tensor form, indexing instead of view
    xc = torch.view_as_complex(x.to(REAL[freqs_cis.dtype]).reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3).type_as(x)


# ---------------------------------------------------------------------------------------------
# RoPE on batch, heads and sequence splits
# ---------------------------------------------------------------------------------------------

MESH_1D = hpfun.Mesh.simulated((2,), ("a",))
MESH_2D = hpfun.Mesh.simulated((2, 2), ("a", "b"))
SPLITS = {  # name: (mesh, spec of x (B, T, H, D), spec of freqs_cis (T, D // 2))
    "batch": (MESH_1D, P("a"), P()),
    "heads": (MESH_1D, P(None, None, "a"), P()),
    "seq": (MESH_1D, P(None, "a"), P("a")),
    "batch_heads": (MESH_2D, P("a", None, "b"), P()),
    "batch_seq": (MESH_2D, P("a", "b"), P("b")),
    "seq_heads": (MESH_2D, P(None, "a", "b"), P("a")),
    "seq_both_axes": (MESH_2D, P(None, ("a", "b")), P(("a", "b"))),
}
DTYPES = {  # name: (x's dtype, freqs' real dtype (complex64 for float32), tolerance)
    "float64": (torch.float64, torch.float64, 1e-12),
    "float32": (torch.float32, torch.float32, 1e-6),
    "float32_complex128": (torch.float32, torch.float64, 1e-6),
    "float64_complex64": (torch.float64, torch.float32, 1e-6),
}
CASES = [(split, dtype) for split in SPLITS for dtype in ("float64", "float32")]
CASES += [(split, dtype) for split in ("seq", "batch_seq") for dtype in ("float32_complex128", "float64_complex64")]


def _inputs(dtype, freqs_dtype):
    g = torch.Generator().manual_seed(0)
    xq, xk = (torch.randn(B, T, H, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    return xq, xk, precompute_freqs_cis(D, T, dtype=freqs_dtype)


def _loss(xq, xk, freqs_cis):
    q, k = apply_rotary_emb(xq, xk, freqs_cis)
    return (q * k).sum() + apply_rope(xq, freqs_cis).square().sum()


def _check_without_collectives(fn, args, mesh, in_specs, out_specs, tol):
    f = hpfun.shard(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)  # no fallback: every op has a rule
    got, expected = f(*args), fn(*args)
    for have, want in zip(got, expected, strict=True):
        assert have.dtype == want.dtype
        torch.testing.assert_close(have.full(), want, rtol=tol, atol=tol)
    assert list(f.lower(*args).collectives) == []


@pytest.mark.parametrize(("split", "dtype"), CASES)
def test_rope_forward_needs_no_collective(split, dtype):
    """q and k rotated by a freqs_cis argument (split along the sequence with them) and by one
    computed inside the function (replicated: each rank takes its rows locally)."""
    mesh, x_spec, f_spec = SPLITS[split]
    real, freqs_real, tol = DTYPES[dtype]
    xq, xk, freqs_cis = _inputs(real, freqs_real)
    _check_without_collectives(apply_rotary_emb, (xq, xk, freqs_cis), mesh, (x_spec, x_spec, f_spec),
                               (x_spec, x_spec), tol)

    def inside(xq, xk):
        return apply_rotary_emb(xq, xk, precompute_freqs_cis(D, T, dtype=freqs_real))

    _check_without_collectives(inside, (xq, xk), mesh, (x_spec, x_spec), (x_spec, x_spec), tol)


@pytest.mark.parametrize(("split", "dtype"), CASES)
def test_rope_gradient_needs_no_collective(split, dtype):
    """torch.func.grad through view_as_complex, complex mul, conj and view_as_real."""
    mesh, x_spec, f_spec = SPLITS[split]
    real, freqs_real, tol = DTYPES[dtype]
    xq, xk, freqs_cis = _inputs(real, freqs_real)
    grad = torch.func.grad(_loss, argnums=(0, 1))
    _check_without_collectives(grad, (xq, xk, freqs_cis), mesh, (x_spec, x_spec, f_spec), (x_spec, x_spec), tol)

    def grad_inside(xq, xk):
        return torch.func.grad(lambda q, k: _loss(q, k, precompute_freqs_cis(D, T, dtype=freqs_real)), argnums=(0, 1))(xq, xk)

    _check_without_collectives(grad_inside, (xq, xk), mesh, (x_spec, x_spec), (x_spec, x_spec), tol)


@pytest.mark.parametrize("split", ["batch", "seq_heads"])
def test_gradient_of_complex_freqs_is_a_complex_partial_sum(split):
    """The gradient of the complex freqs_cis sums over batch and heads: with those split it is a
    complex Partial(sum), all-reduced once to the replicated output, and nothing else moves."""
    mesh, x_spec, f_spec = SPLITS[split]
    xq, xk, freqs_cis = _inputs(torch.float64, torch.float64)
    fn = torch.func.grad(_loss, argnums=2)
    f = hpfun.shard(fn, mesh=mesh, in_specs=(x_spec, x_spec, f_spec), out_specs=f_spec)
    got = f(xq, xk, freqs_cis)
    assert got.dtype == torch.complex128
    torch.testing.assert_close(got.full(), fn(xq, xk, freqs_cis), rtol=1e-12, atol=1e-12)
    collectives = f.lower(xq, xk, freqs_cis).collectives
    assert [c.kind for c in collectives] == ["all_reduce"]
    assert collectives[0].bytes == got.shards[0].numel() * got.shards[0].element_size()  # the local gradient, once


# ---------------------------------------------------------------------------------------------
# Complex outputs and the rules' algebra
# ---------------------------------------------------------------------------------------------


def test_full_of_complex_outputs():
    """A split complex output and a Partial(sum) complex output both gather with .full()."""
    x = torch.randn(B, T, D // 2, 2, dtype=torch.float64)
    freqs_cis = precompute_freqs_cis(D, T, dtype=torch.float64)

    def rotate(x, f):
        z = torch.view_as_complex(x) * f
        return z, z.sum(0)

    f = hpfun.shard(rotate, mesh=MESH_2D, in_specs=(P("a", "b"), P("b")), out_specs=None)
    z, total = f(x, freqs_cis)
    want_z, want_total = rotate(x, freqs_cis)
    assert z.dtype == total.dtype == torch.complex128
    assert z.layout.placements == (Shard(0), Shard(1)) and total.layout.placements == (Partial("sum"), Shard(0))
    torch.testing.assert_close(z.full(), want_z, rtol=0, atol=0)
    torch.testing.assert_close(total.full(), want_total, rtol=1e-12, atol=1e-12)


def _call(op, shapes_dtypes, placements, outputs, mesh=MESH_1D, args=None):
    tensors = tuple(TensorArg(shape, dtype, Layout(mesh, (p,)), i)
                    for i, ((shape, dtype), p) in enumerate(zip(shapes_dtypes, placements, strict=True)))
    return OpCall(op, args if args is not None else tensors, {}, tuple(TensorMeta(*o) for o in outputs), mesh)


def _kept(op, shapes_dtypes, placements, outputs, args=None) -> list:
    """The output placement of each strategy that keeps the inputs as they are."""
    call = _call(op, shapes_dtypes, placements, outputs, args=args)
    given = tuple(t.layout for t in call.tensors)
    return [s.outputs[0].placements[0] for s in lookup(op).strategies(call) if s.inputs == given]


def test_view_as_complex_needs_the_pair_dim_whole():
    """view_as_complex keeps splits of the other dims and gathers the (real, imag) pair dim."""
    f64, c128 = torch.float64, torch.complex128
    assert _kept(aten.view_as_complex.default, [((4, 6, 2), f64)], [Shard(1)], [((4, 6), c128)]) == [Shard(1)]
    assert _kept(aten.view_as_complex.default, [((4, 6, 2), f64)], [Shard(2)], [((4, 6), c128)]) == []
    assert _kept(aten.view_as_real.default, [((4, 6), c128)], [Shard(1)], [((4, 6, 2), f64)]) == [Shard(1)]


F32, F64, C64, C128 = torch.float32, torch.float64, torch.complex64, torch.complex128
LINEAR = {  # name: (op, input shapes and dtypes, output shape and dtype, which inputs are Partial, linear?)
    "view_as_complex": (aten.view_as_complex.default, [((4, 2), F64)], ((4,), C128), [0], True),
    "view_as_real": (aten.view_as_real.default, [((4,), C128)], ((4, 2), F64), [0], True),
    "conj": (aten._conj.default, [((4,), C128)], ((4,), C128), [0], True),
    "conj_physical": (aten._conj_physical.default, [((4,), C128)], ((4,), C128), [0], True),
    "neg_view": (aten._neg_view.default, [((4,), C128)], ((4,), C128), [0], True),
    "complex": (aten.complex.default, [((4,), F64)] * 2, ((4,), C128), [0, 1], True),
    "complex_re_only": (aten.complex.default, [((4,), F64)] * 2, ((4,), C128), [0], False),
    "polar_r": (aten.polar.default, [((4,), F64)] * 2, ((4,), C128), [0], True),
    "polar_t": (aten.polar.default, [((4,), F64)] * 2, ((4,), C128), [1], False),
    "polar_both": (aten.polar.default, [((4,), F64)] * 2, ((4,), C128), [0, 1], False),
    "to_complex": (aten._to_copy.default, [((4,), F32)], ((4,), C64), [0], True),
    "complex64_to_complex128": (aten._to_copy.default, [((4,), C64)], ((4,), C128), [0], True),
    "complex128_to_complex64": (aten._to_copy.default, [((4,), C128)], ((4,), C64), [0], False),
    "abs": (aten.abs.default, [((4,), C128)], ((4,), F64), [0], False),
    "angle": (aten.angle.default, [((4,), C128)], ((4,), F64), [0], False),
    "exp": (aten.exp.default, [((4,), C128)], ((4,), C128), [0], False),
}


@pytest.mark.parametrize("name", list(LINEAR))
def test_partial_sum_passes_exactly_the_ops_linear_over_the_reals(name):
    """conj, the complex views, complex(re, im) (jointly), polar in r and widening casts keep
    Partial(sum) inputs as they are; abs, angle, exp, polar in t and narrowing casts do not
    (their strategies reduce first); Partial(max) never enters a complex value."""
    op, inputs, output, partial, linear = LINEAR[name]
    placements = [Partial("sum") if i in partial else Replicate() for i in range(len(inputs))]
    assert _kept(op, inputs, placements, [output]) == ([Partial("sum")] if linear else [])
    assert _kept(op, inputs, [Partial("max")] * len(inputs), [output]) == []


class _Forced:
    """The built-in rules, except that `op` offers only its strategy number `pick` (so each one
    the rule offers runs, not only the one the planner would pick)."""

    def __init__(self, op, pick: int):
        self.op, self.pick, self.used = op, pick, False

    def lookup(self, target):
        rule = REGISTRY.lookup(target)
        return _Pick(rule, self) if target == self.op else rule


class _Pick:
    def __init__(self, rule, forced: _Forced):
        self.rule, self.forced = rule, forced

    def strategies(self, call):
        self.forced.used = True
        return [self.rule.strategies(call)[self.forced.pick]]

    def emit(self, *args):
        return self.rule.emit(*args)


def _grid(shape, dtype, seed: int) -> torch.Tensor:
    """Random values on a grid coarse enough that any sum of two is exact (complex: both parts)."""
    g = torch.Generator().manual_seed(seed)
    parts = (torch.randn(*shape, 2, generator=g, dtype=torch.float64) * 1024).round() / 256
    return torch.view_as_complex(parts).to(dtype) if dtype.is_complex else parts[..., 0].contiguous().to(dtype)


def _laid_out(value: torch.Tensor, placement, seed: int) -> hpfun.Sharded:
    """`value` on MESH_1D: Partial terms that are both nonzero (below the value for max), or split."""
    layout = Layout(MESH_1D, (placement,))
    if not isinstance(placement, Partial):
        return hpfun.Sharded.from_global(value, layout)
    noise = _grid(value.shape, value.dtype, seed)
    terms = (noise, value - noise) if placement.reduce == "sum" else (value, value - noise.abs())
    return hpfun.Sharded(layout, tuple(value.shape), terms)


PSUM, PMAX = Partial("sum"), Partial("max")
FORCED = {  # name: (op, a function calling it, [(shape, dtype, placement) per input])
    "view_as_complex_partial": (aten.view_as_complex.default, lambda x: torch.view_as_complex(x) * 1, [((4, 6, 2), F64, PSUM)]),
    "view_as_complex_split": (aten.view_as_complex.default, lambda x: torch.view_as_complex(x) * 1, [((4, 6, 2), F64, Shard(1))]),
    "view_as_complex_pair_split": (aten.view_as_complex.default, lambda x: torch.view_as_complex(x) * 1, [((4, 6, 2), F64, Shard(2))]),
    "view_as_complex_max": (aten.view_as_complex.default, lambda x: torch.view_as_complex(x) * 1, [((4, 6, 2), F64, PMAX)]),
    "view_as_real_partial": (aten.view_as_real.default, lambda z: torch.view_as_real(z) * 1, [((4, 6), C128, PSUM)]),
    "view_as_real_split": (aten.view_as_real.default, lambda z: torch.view_as_real(z) * 1, [((4, 6), C128, Shard(1))]),
    "complex_re": (aten.complex.default, torch.complex, [((4, 6), F64, PSUM), ((4, 6), F64, Replicate())]),
    "complex_im": (aten.complex.default, torch.complex, [((4, 6), F64, Replicate()), ((6,), F64, PSUM)]),
    "complex_both": (aten.complex.default, torch.complex, [((4, 6), F64, PSUM), ((4, 6), F64, PSUM)]),
    "polar_r": (aten.polar.default, torch.polar, [((4, 6), F64, PSUM), ((4, 6), F64, Replicate())]),
    "polar_t": (aten.polar.default, torch.polar, [((4, 6), F64, Replicate()), ((4, 6), F64, PSUM)]),
    "polar_both": (aten.polar.default, torch.polar, [((4, 6), F64, PSUM), ((4, 6), F64, PSUM)]),
    "conj": (aten._conj.default, lambda z: torch.conj(z) * 1, [((4, 6), C128, PSUM)]),
    "conj_physical": (aten._conj_physical.default, torch.conj_physical, [((4, 6), C128, PSUM)]),
    "neg_view": (aten._neg_view.default, lambda z: z.conj().imag.resolve_neg(), [((4, 6), C128, PSUM)]),
    "abs": (aten.abs.default, torch.abs, [((4, 6), C128, PSUM)]),
    "angle": (aten.angle.default, torch.angle, [((4, 6), C128, PSUM)]),
    "exp": (aten.exp.default, torch.exp, [((4, 6), C128, PSUM)]),
    "mul": (aten.mul.Tensor, torch.mul, [((4, 6), C128, PSUM), ((6,), C128, Replicate())]),
    "to_complex64": (aten._to_copy.default, lambda z: z.to(torch.complex64), [((4, 6), C128, PSUM)]),
    "to_complex128": (aten._to_copy.default, lambda x: x.to(C128), [((4, 6), F64, PSUM)]),
    "to_bfloat16": (aten._to_copy.default, lambda x: x.to(torch.bfloat16), [((4, 6), torch.float32, PSUM)]),
}


@pytest.mark.parametrize("name", list(FORCED))
def test_every_strategy_of_the_complex_rules_is_right(name):
    """Each strategy a rule offers for these inputs (forced in turn) gives the unsharded values:
    Partial(sum) kept only through ops linear over the reals, the pair dim gathered, Partial(max)
    reduced before it could become complex."""
    op, fn, specs = FORCED[name]
    values = [_grid(shape, dtype, seed=i) for i, (shape, dtype, _) in enumerate(specs)]
    args = [_laid_out(v, p, seed=10 + i) for i, (v, (_, _, p)) in enumerate(zip(values, specs, strict=True))]
    calls = _call(op, [(s, d) for s, d, _ in specs], [p for _, _, p in specs], [(tuple(fn(*values).shape), fn(*values).dtype)])
    count = len(lookup(op).strategies(calls))
    assert count >= 1
    for pick in range(count):
        forced = _Forced(op, pick)
        assert_sharded_equal(fn, args, MESH_1D, None, rtol=1e-12, atol=1e-12, registry=forced)
        assert forced.used, f"{op} is not in the captured graph of {name}"


class _Spectral(torch.nn.Module):
    """A real layer and a complex weight, as neuralop's FNO keeps its spectral weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.w = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.complex128))

    def forward(self, x):
        return (self.lin(x).to(torch.complex128) @ self.w).abs().square().mean()


@pytest.mark.parametrize("w_spec", [None, P(None, "dp")], ids=["replicated", "split"])
def test_a_complex_parameter_is_trained_by_the_stock_step(w_spec):
    """A complex parameter gets its gradient and its Adam state as in eager (it was lifted without
    requires_grad: never updated, silently, while the real ones were)."""
    model, ref = _Spectral(), _Spectral()
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)

    def step(m, o, x):
        o.zero_grad()
        loss = m(x)
        loss.backward()
        o.step()
        return loss.detach()

    sharded = hpfun.shard(lambda x: step(model, opt, x), mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=P("dp"),
                          out_specs=P(), state_specs=None if w_spec is None else {"model.w": w_spec})
    for i in range(3):
        x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        assert abs(sharded(x).full().item() - step(ref, ref_opt, x).item()) < 1e-12
    assert (model.w - ref.w).abs().max().item() < 1e-12 and model.w.grad is not None
    assert (opt.state[model.w]["exp_avg"] - ref_opt.state[ref.w]["exp_avg"]).abs().max().item() < 1e-12


def test_a_complex_sum_over_the_mesh_with_an_infinite_part_is_eagers():
    """A complex sum over a split dim where one rank's partial sum is infinite in one part:
    eager's `[1+1j, inf+1j].sum(0)` is inf+2j; the simulated mesh added the ranks' terms as
    complex numbers (`a + b` is a + 1 * b, and 1 * (inf+1j) is inf+nanj) and gave inf+nanj."""
    x = torch.tensor([1 + 1j, 2 - 1j, complex(float("inf"), 1), 3 + 0j], dtype=torch.complex128)
    y = torch.tensor([1 + 1j, 2 - 1j, complex(1, float("-inf")), 3 + 0j], dtype=torch.complex128)
    f = hpfun.shard(lambda a: a.sum(0), mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=P("dp"), out_specs=P())
    for v in (x, y):
        torch.testing.assert_close(f(v).full(), v.sum(0), equal_nan=True, rtol=0, atol=0)
