"""Matmuls on N-D tensors are folded into einsums, so head and sequence dims stay split."""

import pytest
import torch

import hpfun
from hpfun import P
from hpfun.capture import capture
from hpfun.fold import fold_contractions

MESH = hpfun.Mesh.simulated((2,), ("tp",))


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v


def test_attention_forward_and_backward_fold_to_einsums():
    """q @ k^T and p @ v, forward and backward, become einsums over (b, h, s, d); no bmm is left."""
    grad = torch.func.grad(lambda q, k, v: attention(q, k, v).sum(), argnums=(0, 1, 2))
    gm = capture(lambda *a: list(grad(*a)), [((2, 4, 8, 16), torch.float32)] * 3)
    assert fold_contractions(gm) == 6
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.bmm.default not in targets
    equations = {n.args[0] for n in gm.graph.nodes if n.target is torch.ops.aten.einsum.default}
    assert "abcd,abde->abce" in equations


def test_head_sharded_attention_needs_no_collective():
    """Attention with heads split runs locally, forward and backward, and equals the unsharded result."""
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    grad = torch.func.grad(lambda q, k, v: attention(q, k, v).pow(2).sum(), argnums=(0, 1, 2))
    f = hpfun.shard(grad, mesh=MESH, in_specs=(P(None, "tp"),) * 3, out_specs=(P(None, "tp"),) * 3)
    assert f.lower(q, k, v).collectives == []
    for got, want in zip(f(q, k, v), grad(q, k, v), strict=True):
        torch.testing.assert_close(got.full(), want)


def test_sequence_sharded_linear_keeps_the_sequence_split():
    """x (b, s, d) split along s times a replicated weight stays split along s, with no collective."""
    x, w = torch.randn(2, 8, 16), torch.randn(16, 6)
    f = hpfun.shard(lambda x, w: torch.relu(x @ w), mesh=MESH, in_specs=(P(None, "tp"), P()))
    out = f(x, w)
    assert out.layout.placements == (hpfun.Shard(1),) and f.lower(x, w).collectives == []
    torch.testing.assert_close(out.full(), torch.relu(x @ w))


def test_unflattened_matmul_is_left_alone():
    """A plain 2-D mm has nothing to fold."""
    gm = capture(lambda a, b: [a @ b], [((4, 8), torch.float32), ((8, 3), torch.float32)])
    assert fold_contractions(gm) == 0


def test_a_linear_layer_on_rows_merged_with_a_split_batch_keeps_the_batch_split():
    """nn.MultiheadAttention's out_proj reads (L, B, E) merged to (L*B, E) with the embedding
    from (heads, head_dim): under data parallelism B is split inside the merged dim, which no
    block layout expresses. Folded (the addmm with its bias, the heads merged back into the
    embedding its weight keeps whole, the bias gradient's sum over the merged rows summed over
    L and B), the batch stays split: no activation is gathered, forward or backward, and the
    step equals eager (float64, batch_first or not, and a TransformerEncoder)."""
    torch.manual_seed(0)

    class Attend(torch.nn.Module):
        def __init__(self, batch_first):
            super().__init__()
            self.batch_first = batch_first
            self.mha = torch.nn.MultiheadAttention(16, 4, batch_first=batch_first, dtype=torch.float64)
            self.out = torch.nn.Linear(16, 4, dtype=torch.float64)

        def forward(self, x):
            x = x if self.batch_first else x.transpose(0, 1)
            h, _ = self.mha(x, x, x, need_weights=False)
            return self.out(x + h).mean(1 if self.batch_first else 0)

    x, y = torch.randn(8, 6, 16, dtype=torch.float64), torch.randint(0, 4, (8,))
    for batch_first in (True, False):
        model = Attend(batch_first)
        grads = torch.func.grad(lambda p, x, y: torch.nn.functional.cross_entropy(
            torch.func.functional_call(model, p, (x,)), y))
        params = {k: v.detach() for k, v in model.named_parameters()}
        f = hpfun.shard(grads, mesh=hpfun.Mesh.simulated((4,), ("dp",)), in_specs=(P(), P("dp"), P("dp")),
                        out_specs=P())
        assert [c.kind for c in f.lower(params, x, y).collectives if c.kind != "all_reduce"] == [], batch_first
        want = grads(params, x, y)
        for k, got in f(params, x, y).items():
            torch.testing.assert_close(got.full(), want[k], rtol=1e-12, atol=1e-12, msg=k)


def test_recurrent_layers_under_data_parallelism_move_no_activations():
    """A recurrent layer's per-step outputs, joined by a cat and viewed as (t, b, h), become a
    stack: with the batch split, the forward and the weight gradients gather nothing (each
    gradient is one all-reduce). LSTM, GRU and RNN steps equal eager's."""
    import copy

    import torch.nn as nn
    import torch.nn.functional as F

    class Model(nn.Module):
        def __init__(self, cell):
            super().__init__()
            self.rnn, self.head = cell(4, 8, batch_first=True), nn.Linear(8, 3)

        def forward(self, x):
            out, h = self.rnn(x)  # (the final state too: one step's output, joined alone)
            h = h[0] if isinstance(h, tuple) else h
            return self.head(out[:, -1] + h[-1])

    for cell in (nn.LSTM, nn.GRU, nn.RNN):
        torch.manual_seed(0)
        model = Model(cell).double()
        ref = copy.deepcopy(model)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

        @hpfun.shard(mesh=hpfun.Mesh.simulated((4,), ("dp",)), in_specs=(P("dp"), P("dp")), out_specs=P())
        def step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
        loss = step(x, y).full()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        kinds = [c.kind for c in step.lower(x, y).collectives]
        assert set(kinds) == {"all_reduce"} and len(kinds) == len(list(model.parameters())) + 2, (cell, kinds)


def test_a_cat_viewed_as_its_stack_keeps_the_batch_split_in_its_backward_too():
    """A hand-written recurrence joining its steps with cat and viewing them as (t, b, h): the
    forward is a stack, and the backward, which views the gradient flat and cuts it per step,
    reads rows of the gradient itself: no all-gather either way; gradients equal eager's."""

    def f(x, w):
        h, outs = torch.zeros(x.shape[1], w.shape[1], dtype=x.dtype), []
        for t in range(x.shape[0]):
            h = torch.tanh(x[t] @ w + h)
            outs.append(h)
        return (torch.cat(outs, 0).view(len(outs), *h.shape) ** 3).sum()

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g, dtype=torch.float64)
    grad = hpfun.shard(torch.func.grad(f, argnums=(0, 1)), mesh=hpfun.Mesh.simulated((2,), ("dp",)),
                       in_specs=(P(None, "dp"), P()), out_specs=(P(None, "dp"), P()))
    for got, want in zip(grad(x, w), torch.func.grad(f, argnums=(0, 1))(x, w)):
        torch.testing.assert_close(got.full(), want, rtol=1e-12, atol=1e-12)
    assert {c.kind for c in grad.lower(x, w).collectives} == {"all_reduce"}


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_a_sum_over_a_size_1_dim_a_view_added_is_left_as_it_is(spec):
    """`x.reshape(-1, 1).sum(1)` and group_norm's backward with one element per group: a sum over
    dims a view only added has no dims of its base to be taken over (an empty list, which aten
    reads as every dim: the program failed at run time). Equal to eager, forward and gradient."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))

    def f(x):
        return x.reshape(-1, 1).sum(1) + x.reshape(-1, 1, 1).mean((1, 2))

    def norm_loss(x):
        return torch.nn.functional.group_norm(x.reshape(4, 2, 1), 2).pow(2).sum() + x.reshape(-1, 1).sum(1).pow(3).sum()

    x = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(hpfun.shard(f, mesh=mesh, in_specs=(spec,), out_specs=spec)(x).full(), f(x))
    g = hpfun.shard(torch.func.grad(norm_loss), mesh=mesh, in_specs=(spec,), out_specs=spec)
    torch.testing.assert_close(g(x).full(), torch.func.grad(norm_loss)(x))


@pytest.mark.parametrize("spec", [P("dp"), P(None, "dp")], ids=str)
@pytest.mark.parametrize("pad", [(1, 2), (1, 2, 2, 1), (1, 1, 2, 1, 1, 2)], ids=["1d", "2d", "3d"])
def test_a_reflect_pads_gradient_keeps_the_batch_and_channels_split(pad, spec):
    """torch's decomposition of a reflect pad's backward indexes every dim, the batch and the
    channels by `arange(n).view(n, 1, ...)`: each rank took its rows by position and summed
    them, a Partial of the whole gradient on every rank, reduce-scattered (4x the bytes of the
    gradient at 2 ranks). Such indices are whole-dim slices: nothing moves, equal to eager."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    x = torch.randn(4, 2, *[6] * (len(pad) // 2), dtype=torch.float64)

    def loss(x):
        return torch.nn.functional.pad(x, pad, mode="reflect").sin().sum()

    f = hpfun.shard(torch.func.grad(loss), mesh=mesh, in_specs=(spec,), out_specs=spec)
    torch.testing.assert_close(f(x).full(), torch.func.grad(loss)(x))
    assert not f.lower(x).collectives


@pytest.mark.parametrize("equation, shapes, specs", [
    ("td,edh->teh", [(16, 8), (4, 8, 6)], (P(), P(None, None, "tp"))),  # column-parallel experts
    ("td,edh->teh", [(16, 8), (4, 8, 6)], (P(), P("tp"))),  # experts split
    ("bd,edh->beh", [(1, 8), (4, 8, 6)], (P(), P(None, None, "tp"))),  # one token
])
def test_an_einsum_torch_lowers_with_size_1_dims_keeps_its_splits(equation, shapes, specs):
    """torch lowers an einsum as a bmm wrapped in size-1 dims it adds and drops ("td,edh->teh"
    as a (1, t, d) @ (1, d, e*h) bmm): folded with those left out, the weight split along h
    (or e) stays split, forward and backward, with no collective (it was gathered whole), and the
    results equal eager (float64)."""
    x, w = (torch.randn(s, dtype=torch.float64) for s in shapes)
    out_spec = P(*[None] * 2, *specs[1].dims[2:]) if len(specs[1].dims) == 3 else P(None, "tp")

    def loss(x, w):
        return torch.einsum(equation, x, w).pow(2).sum()

    forward = hpfun.shard(lambda x, w: torch.einsum(equation, x, w), mesh=MESH, in_specs=specs, out_specs=out_spec)
    assert forward.lower(x, w).collectives == []
    torch.testing.assert_close(forward(x, w).full(), torch.einsum(equation, x, w))
    grad = torch.func.grad(loss, argnums=(0, 1))
    step = hpfun.shard(grad, mesh=MESH, in_specs=specs, out_specs=(P(), specs[1]))
    assert [c.kind for c in step.lower(x, w).collectives] == ["all_reduce"]  # (x's gradient, summed over h or e)
    for got, want in zip(step(x, w), grad(x, w), strict=True):
        torch.testing.assert_close(got.full() if hasattr(got, "full") else got, want)
