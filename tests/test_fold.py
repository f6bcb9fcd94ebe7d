"""Matmuls on N-D tensors are folded into einsums, so head and sequence dims stay split."""

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
