"""hpfun.constrain pins an intermediate value's layout and, separately if asked, its gradient's."""

import pytest
import torch

import hpfun
from hpfun import P

MESH = hpfun.Mesh.simulated((2,), ("tp",))
F32 = 4


def test_pins_an_intermediate_layout():
    f = hpfun.shard(lambda x: hpfun.constrain(x * 2, P(None, "tp")) + 1, mesh=MESH, in_specs=P())
    x = torch.randn(4, 6)
    out = f(x)
    assert out.layout.placements == (hpfun.Shard(1),)
    torch.testing.assert_close(out.full(), x * 2 + 1)


def _grads(grad_spec):
    """Gradient of a column-parallel matmul's input, the input pinned whole: the gradient is a
    Partial sum over the split columns."""
    def loss(x, w):
        y = hpfun.constrain(x, P(), grad=grad_spec) if grad_spec is not None else hpfun.constrain(x, P())
        return torch.tanh(y @ w).sum()

    def step(x, w):
        return torch.func.grad(loss)(x, w)

    x, w = torch.randn(8, 4), torch.randn(4, 6)
    f = hpfun.shard(step, mesh=MESH, in_specs=(P("tp"), P(None, "tp")), out_specs=P("tp"))
    torch.testing.assert_close(f(x, w).full(), step(x, w))
    return [(c.kind, c.bytes) for c in f.lower(x, w).collectives]


def test_gradient_takes_the_value_spec_by_default():
    """Pinned whole, the Partial gradient is all-reduced to whole too, then split for x."""
    assert _grads(None) == [("all_gather", 4 * 4 * F32), ("all_reduce", 8 * 4 * F32)]


def test_gradient_spec_of_its_own_is_megatron_sequence_parallel():
    """grad=P("tp"): gathered forward, reduce-scattered backward: half the all-reduce's traffic."""
    assert _grads(P("tp")) == [("all_gather", 4 * 4 * F32), ("reduce_scatter", 8 * 4 * F32)]


@pytest.mark.parametrize("kwargs", [{"spec": "tp"}, {"spec": None}, {"spec": P(), "grad": ("tp",)}])
def test_bad_specs_are_named(kwargs):
    with pytest.raises(hpfun.SpecError, match="constrain needs an hpfun.P"):
        hpfun.constrain(torch.ones(2), **kwargs)


def test_a_pin_composes_with_every_transform():
    """The pin is an identity to every transform: second derivatives through it (a gradient
    penalty, grad of grad, a Hessian), per-example gradients under vmap, jvp and hessian equal
    the same function without the pin, eagerly and sharded."""
    import torch.func as tf

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)

    def block(pin):
        def f(xi, w):
            h = torch.tanh(xi @ w)
            grad = P(*[None] * (h.ndim - 1), "tp")  # the last dim split (a per-example h has one dim)
            return torch.sin((hpfun.constrain(h, P(), grad=grad) if pin else h) @ w)
        return f

    def penalty(f):
        def loss(w, x):
            (gw,) = torch.autograd.grad(f(x, w).pow(2).sum(), w, create_graph=True)
            return gw.pow(2).sum()
        return lambda w, x: torch.autograd.grad(loss(w.requires_grad_(), x), w)[0]

    cases = {
        "penalty": penalty,
        "grad of grad": lambda f: lambda w, x: tf.grad(lambda w: tf.grad(lambda v: f(x, v).pow(3).sum())(w).sum())(w),
        "per-example grads": lambda f: lambda w, x: tf.vmap(tf.grad(lambda w, xi: f(xi, w).pow(2).sum()), (None, 0))(w, x),
        "jvp": lambda f: lambda w, x: tf.jvp(lambda w: f(x, w), (w,), (torch.ones_like(w),))[1],
        "hessian": lambda f: lambda w, x: tf.hessian(lambda w: f(x, w).pow(2).sum())(w),
    }
    for name, make in cases.items():
        truth = make(block(False))(w.clone(), x)
        torch.testing.assert_close(make(block(True))(w.clone(), x), truth, rtol=1e-10, atol=1e-10, msg=name)
        sharded = hpfun.shard(make(block(True)), mesh=MESH, in_specs=(P(), P("tp")), out_specs=P())
        torch.testing.assert_close(sharded(w.clone(), x).full(), truth, rtol=1e-10, atol=1e-10, msg=name)
