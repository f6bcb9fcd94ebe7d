"""Equal pieces of a split dim stay split: `x.chunk(k)` of a data-parallel batch (gradient
accumulation over micro-batches) and a fused gate/up projection's `chunk(2, dim=-1)` split
over tp. The input's block is moved by one all-to-all so that each rank holds its block of
every piece (`hpfun.rules.shape.Split`). (The backward's `cat` of the pieces' gradients
gathers them: a cat keeping equal pieces split by the inverse all-to-all also took Llama's
rotary `cat((freqs, freqs), -1)`, whose consumers gather it anyway, for a dearer plan.) Each
case is compared with the unsharded run in float64, the pieces' layouts and the collectives
checked."""

import pytest
import torch
import torch.nn.functional as F

import hpfun
from hpfun import P

D = torch.float64


def _gen():
    return torch.Generator().manual_seed(0)


def _kinds(lowered) -> list[str]:
    return sorted(c.kind for c in lowered.collectives)


CASES = [  # mesh shape, axis names, x spec, pieces, dim
    ((2,), ("dp",), P("dp"), 4, 0),
    ((2,), ("dp",), P("dp"), 2, 0),
    ((4,), ("dp",), P("dp"), 4, 0),
    ((2,), ("tp",), P(None, None, "tp"), 2, -1),
    ((2, 2), ("dp", "tp"), P("dp", None, "tp"), 2, -1),  # another dim split too
    ((2, 2), ("dp", "tp"), P(("dp", "tp")), 4, 0),  # one dim over both axes
    ((2, 2), ("dp", "tp"), P(("tp", "dp")), 4, 0),  # ... tp major
    ((2, 2), ("a", "b"), P("b", "a"), 2, 0),
]


@pytest.mark.parametrize("mesh_shape, names, spec, pieces, dim", CASES, ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in CASES])
def test_equal_pieces_of_a_split_dim_stay_split(mesh_shape, names, spec, pieces, dim):
    """Every piece keeps the input's layout; the only collective is the split's all-to-all
    (over two axes on one dim, the redistribution plan takes a gather and an all-to-all)."""
    mesh = hpfun.Mesh.simulated(mesh_shape, names)
    x = torch.randn(16, 4, 8, dtype=D, generator=_gen())

    def f(x):
        return [t * (i + 1) for i, t in enumerate(x.chunk(pieces, dim))]

    g = hpfun.shard(f, mesh=mesh, in_specs=(spec,), out_specs=None)
    out, ref = g(x), f(x)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a.full(), b, rtol=0, atol=0)
        assert a.layout == spec.to_layout(mesh, 3)
    moves = g.lower(x).collectives
    assert all("into equal pieces" in c.reason for c in moves) and "all_to_all" in _kinds(g.lower(x))
    if len(spec.to_layout(mesh, 3).shard_axes(dim % 3)) == 1:
        assert _kinds(g.lower(x)) == ["all_to_all"]


def test_pieces_that_do_not_divide_are_gathered():
    """Two pieces over four ranks: no rank's block of the dim lies in one piece's block for
    every rank, so the dim is gathered (and the result still equals the unsharded run)."""
    mesh = hpfun.Mesh.simulated((4,), ("tp",))
    x = torch.randn(4, 8, dtype=D, generator=_gen())
    g = hpfun.shard(lambda x: [t + 0 for t in x.chunk(2, 1)], mesh=mesh, in_specs=(P(None, "tp"),), out_specs=None)
    for a, b in zip(g(x), x.chunk(2, 1), strict=True):
        torch.testing.assert_close(a.full(), b)
    assert "all_to_all" not in _kinds(g.lower(x))


def test_gradient_accumulation_over_micro_batches_keeps_data_parallelism():
    """The micro-batches of a batch split over dp are each split over dp, the work stays split
    and each gradient is summed over the micro-batches locally and all-reduced once."""
    torch.manual_seed(0)
    p = {"w1": torch.randn(16, 32, dtype=D) * .1, "w2": torch.randn(32, 8, dtype=D) * .1}
    x, y = torch.randn(32, 16, dtype=D), torch.randint(0, 8, (32,))

    def loss(p, x, y):
        return F.cross_entropy(torch.tanh(x @ p["w1"]) @ p["w2"], y)

    def step(p, x, y):
        total, grads = 0, None
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            g, l = torch.func.grad_and_value(loss)(p, xs, ys)
            grads = g if grads is None else {k: grads[k] + g[k] for k in g}
            total = total + l
        return {k: v - 0.1 * grads[k] / 4 for k, v in p.items()}, total / 4

    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    f = hpfun.shard(step, mesh=mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=(P(), P()))
    new, total = f(p, x, y)
    ref_new, ref_total = step(p, x, y)
    torch.testing.assert_close(total.full(), ref_total, rtol=1e-12, atol=1e-12)
    for k in p:
        torch.testing.assert_close(new[k].full(), ref_new[k], rtol=1e-12, atol=1e-12)
    moved = {c.kind: 0 for c in f.lower(p, x, y).collectives}
    for c in f.lower(p, x, y).collectives:
        moved[c.kind] += c.bytes
    assert "all_gather" not in moved  # neither the batch gathered nor the work replicated
    assert moved["all_to_all"] == (32 * 16 * 8 + 32 * 8) // 2  # each rank's block of x and y, once


@pytest.mark.parametrize("mesh_shape, names, specs", [
    ((2,), ("tp",), {"wi": P(None, "tp"), "wo": P("tp", None)}),
    ((2, 2), ("dp", "tp"), {"wi": P(None, "tp"), "wo": P("tp", None)}),
])
def test_a_fused_gate_up_projection_chunked_over_tp(mesh_shape, names, specs):
    """SwiGLU with one fused projection (Phi-3's `gate_up_proj`): its output is split over tp
    along the chunked dim. Each half stays split (an all-to-all, not a gather of the activation),
    and a step equals the unsharded one."""
    torch.manual_seed(0)
    p = {"wi": torch.randn(16, 64, dtype=D) * .3, "wo": torch.randn(32, 16, dtype=D) * .3}
    x = torch.randn(8, 4, 16, dtype=D)

    def loss(p, x):
        gate, up = (x @ p["wi"]).chunk(2, dim=-1)
        return ((F.silu(gate) * up) @ p["wo"]).pow(2).mean()

    def step(p, x):
        g, l = torch.func.grad_and_value(loss)(p, x)
        return {k: v - 0.1 * g[k] for k, v in p.items()}, l

    mesh = hpfun.Mesh.simulated(mesh_shape, names)
    batch = P("dp") if "dp" in names else P()
    f = hpfun.shard(step, mesh=mesh, in_specs=(specs, batch), out_specs=(specs, P()))
    new, l = f(p, x)
    ref_new, ref_l = step(p, x)
    torch.testing.assert_close(l.full(), ref_l, rtol=1e-12, atol=1e-12)
    for k in p:
        torch.testing.assert_close(new[k].full(), ref_new[k], rtol=1e-12, atol=1e-12)
    moves = f.lower(p, x).collectives
    assert any(c.kind == "all_to_all" and "split_with_sizes" in c.reason for c in moves)
    assert not any(c.kind == "all_gather" and "split_with_sizes" in c.reason for c in moves)


def test_a_cat_of_one_value_twice_is_gathered_once():
    """Llama's rotary table, `cat((freqs, freqs), -1)` with `inv_freq` split (ZeRO-3 over every
    buffer): its consumers need it whole, so the split input is gathered once (16 B), the cat
    and cos/sin computed whole."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))

    def rope(inv_freq, pos, q, k):
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        return q * cos + k * sin, k * cos - q * sin

    args = (torch.rand(4, dtype=D), torch.arange(8, dtype=D), torch.randn(4, 8, 8, dtype=D), torch.randn(4, 8, 8, dtype=D))
    f = hpfun.shard(rope, mesh=mesh, in_specs=(P("dp"), P(), P("dp"), P("dp")), out_specs=P("dp"))
    assert [(c.kind, c.bytes) for c in f.lower(*args).collectives] == [("all_gather", 16)]
    for got, want in zip(f(*args), rope(*args), strict=True):
        torch.testing.assert_close(got.full(), want, rtol=1e-14, atol=1e-14)
