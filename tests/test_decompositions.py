"""Capture's decompositions against torch's kernels (`hpfun.testing.decompositions`)."""

import torch
from torch._decomp import core_aten_decompositions

import hpfun
from hpfun import capture
from hpfun.testing.decompositions import audit

aten = torch.ops.aten
MARGIN_LOSSES = ["nn.functional.multilabel_margin_loss", "nn.functional.multi_margin_loss"]


def test_capture_replaces_torchs_multilabel_margin_loss_which_counts_slots_after_the_end():
    """torch's core table decomposes multilabel_margin_loss_forward also counting the class
    slots after the first -1 (OpInfo's samples have no -1, so torch's own tests miss it):
    capture's table has its own, equal to the kernel, the backward too."""
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[2, 3, -1, 0, 0, 0], [5, 5, 0, -1, -1, -1], [1, -1, 2, 2, 2, 2], [0, 1, 2, 3, 4, 5]])
    op = aten.multilabel_margin_loss_forward.default
    kernel = op(x, labels, 1)
    assert not torch.allclose(core_aten_decompositions()[op](x, labels, 1)[0], kernel[0])
    ours = capture.decompositions()[op](x, labels, 1)
    torch.testing.assert_close(ours[0], kernel[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(ours[1], kernel[1], rtol=0, atol=0)
    backward = aten.multilabel_margin_loss_backward.default
    grad = torch.tensor(1.5, dtype=torch.float64)
    torch.testing.assert_close(capture.decompositions()[backward](grad, x, labels, 1, kernel[1]),
                               backward(grad, x, labels, 1, kernel[1]), rtol=0, atol=1e-15)


def test_the_audit_compares_forward_and_vjp_against_the_kernels():
    """The audit over the margin losses' OpInfo samples (0-d, 1-d and 2-d inputs): forward and
    vector-Jacobian product equal the kernels, nothing refused. With a deliberately wrong
    decomposition in the table, it reports that op's forward."""
    ours = audit(MARGIN_LOSSES)
    assert not ours.findings and ours.forward == 6 and ours.vjp == 6, ours
    broken = dict(capture.decompositions())
    decompose = broken[aten.multi_margin_loss.default]
    broken[aten.multi_margin_loss.default] = lambda x, *args, **kwargs: decompose(x * 2, *args, **kwargs)
    found = audit(["nn.functional.multi_margin_loss"], table=broken)
    assert {(f.op, f.kind) for f in found.wrong} == {("nn.functional.multi_margin_loss", "forward")}, found


def test_a_hessian_after_another_sharded_gradient_runs_as_eager():
    """torch.func.hessian of a product, after a sharded gradient of a cumprod ran in the same
    process: forward-mode AD then makes its zero tangents as torch's `_efficientzerotensor`,
    which had no rule (MissingRuleError, only in that order); it is plain zeros now."""
    mesh = hpfun.Mesh.simulated((2,), ("a",))
    first = torch.func.grad(lambda z: torch.cumprod(z * 0.1 + 1.0, dim=1).sum())
    hpfun.shard(first, mesh=mesh, in_specs=(hpfun.P("a"),), out_specs=None)(torch.randn(8, 4, dtype=torch.float64))

    def hess(a, w):
        return torch.func.hessian(lambda z: (z * z.prod(-1, keepdim=True) * w).sum())(a)

    a, w = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    got = hpfun.shard(hess, mesh=mesh, in_specs=(hpfun.P("a"), hpfun.P()), out_specs=None)(a, w).full()
    torch.testing.assert_close(got, hess(a, w), rtol=0, atol=1e-12)
