"""The MLP training step sharded on simulated meshes equals the unsharded step, with the
minimum collectives."""

import pytest
import torch

import hpfun
from hpfun import P
from hpfun.testing.models import MLP_LAYOUTS, mlp_data, mlp_init, mlp_step

B, D, F, C = 8, 16, 32, 8
F32 = 4


def _mesh(shape, layout):
    if len(shape) == 2:
        return hpfun.Mesh.simulated(shape, ("dp", "tp"))
    return hpfun.Mesh.simulated(shape, ("dp",) if layout == "dp" else ("tp",))


CASES = [((1,), "dp"), ((1,), "tp"), ((1,), "class")]
CASES += [((n,), name) for n in (2, 4) for name in ("dp", "tp", "class")]
CASES += [((2, 2), name) for name in MLP_LAYOUTS]


# Planned by bytes alone (no per-collective latency): the analytic minimum these tests state is
# in bytes. At these tiny sizes the default model's alpha outweighs most transfers, and it may
# trade bytes for fewer collectives (test_the_default_model_trades_bytes_for_fewer_collectives).
BYTES = hpfun.CostModel(alpha=0.0)


def _sharded_step(shape, layout, cost_model=BYTES):
    mesh = _mesh(shape, layout)
    pspec, xspec, yspec = MLP_LAYOUTS[layout]
    return hpfun.shard(mlp_step, mesh=mesh, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()),
                       cost_model=cost_model)


def _rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape,layout", CASES, ids=[f"{'x'.join(map(str, s))}-{l}" for s, l in CASES])
def test_step_equals_unsharded(shape, layout):
    """Loss and every updated parameter equal the unsharded step (rel. error <= 1e-5, float32)."""
    params, (x, y) = mlp_init(D, F, C), mlp_data(B, D, C)
    ref_params, ref_loss = mlp_step(params, x, y)
    new_params, loss = _sharded_step(shape, layout)(params, x, y)
    assert isinstance(loss, hpfun.Sharded) and loss.layout.is_replicated
    assert _rel_err(loss.full(), ref_loss) <= 1e-5
    for k in params:
        assert _rel_err(new_params[k].full(), ref_params[k]) <= 1e-5, k


def _expected(shape, layout):
    """The analytic minimum: (kind, axes, bytes per rank) of each collective, in program order."""
    if all(s == 1 for s in shape):
        return []
    if layout == "tp":
        return [("all_reduce", ("tp",), B * C * F32)]  # the MLP output, once, in the forward
    if layout == "dp":
        # the global count of labels (cross-entropy's mean), then one all-reduce per parameter + loss
        return [("all_reduce", ("dp",), F32)] + [
            ("all_reduce", ("dp",), nbytes) for nbytes in (D * F * F32, F * F32, F * C * F32, C * F32, F32)
        ]
    if layout == "dp_tp":
        return [("all_reduce", ("tp",), B // 2 * C * F32), ("all_reduce", ("dp",), F32)] + [
            ("all_reduce", ("dp",), nbytes) for nbytes in (D * F // 2 * F32, F // 2 * F32, F // 2 * C * F32, C * F32, F32)
        ]
    rows = B * F32 if layout == "class" else B // 2 * F32
    # max, sum of exponentials, and the row sum of the log-softmax backward: one number per row
    head = [("all_reduce", ("tp",), rows)] * 2
    # the hidden layer's gradient, Partial over the class split, summed once (B x F is smaller
    # than w1 and b1, whose gradients it would otherwise reach)
    if layout == "class":
        return head + [("all_reduce", ("tp",), rows), ("all_reduce", ("tp",), B * F * F32), ("all_reduce", ("tp",), F32)]
    dp = ("dp",)
    return head + [("all_reduce", dp, 4), ("all_reduce", ("tp",), rows), ("all_reduce", ("tp",), B // 2 * F * F32)] + [
        ("all_reduce", dp, D * F * F32), ("all_reduce", dp, F * F32),
        ("all_reduce", dp, F * C // 2 * F32), ("all_reduce", dp, C // 2 * F32), ("all_reduce", ("dp", "tp"), F32),
    ]


@pytest.mark.parametrize("shape,layout", CASES, ids=[f"{'x'.join(map(str, s))}-{l}" for s, l in CASES])
def test_collectives_are_the_minimum(shape, layout):
    """lower() lists exactly the analytic minimum of collectives for each layout."""
    params, (x, y) = mlp_init(D, F, C), mlp_data(B, D, C)
    lowered = _sharded_step(shape, layout).lower(params, x, y)
    got = [(c.kind, c.axes, c.bytes) for c in lowered.collectives]
    assert got == _expected(shape, layout)
    assert all(c.node and c.reason for c in lowered.collectives)


def test_the_default_model_trades_bytes_for_fewer_collectives():
    """Under the default alpha-beta model, the 2x2 dp x class step resolves w1's and b1's
    gradients over both axes at once instead of summing the hidden gradient over tp first: one
    collective fewer, more bytes on the wire, and faster by that same model (what Lowered.cost() reports is
    the price propagation chose by). Results stay equal to the unsharded step."""
    params, (x, y) = mlp_init(D, F, C), mlp_data(B, D, C)
    default = _sharded_step((2, 2), "dp_class", hpfun.CostModel())
    by_bytes = _sharded_step((2, 2), "dp_class").lower(params, x, y)
    lowered = default.lower(params, x, y)
    assert len(lowered.collectives) == len(by_bytes.collectives) - 1
    assert lowered.cost().wire_bytes > by_bytes.cost().wire_bytes  # w1's gradient over 4 ranks
    assert lowered.cost().seconds < by_bytes.cost(hpfun.CostModel()).seconds
    ref_params, _ = mlp_step(params, x, y)
    new_params, _ = default(params, x, y)
    for k in params:
        assert _rel_err(new_params[k].full(), ref_params[k]) <= 1e-5, k


def test_lower_shows_layouts_and_collectives():
    """str(lower()) shows each input's layout, the per-shard ops and the collectives."""
    params, (x, y) = mlp_init(D, F, C), mlp_data(B, D, C)
    text = str(_sharded_step((2, 2), "dp_tp").lower(params, x, y))
    assert "global [16, 32] [R, S(1)]" in text
    assert "c10d.all_reduce.default" in text and "# all_reduce over tp" in text
    assert "collectives (7):" in text


def test_sharded_outputs_feed_the_next_step_and_hit_the_cache():
    """Sharded outputs are valid inputs; a repeated signature does not trace again."""
    params, (x, y) = mlp_init(D, F, C), mlp_data(B, D, C)
    step = _sharded_step((2, 2), "dp_tp")
    ref, sharded = params, params
    for _ in range(3):
        ref, ref_loss = mlp_step(ref, x, y)
        sharded, loss = step(sharded, x, y)
    assert step.trace_count == 1  # Sharded params with the specs' layouts: the same program
    assert _rel_err(loss.full(), ref_loss) <= 1e-5
    for k in params:
        assert _rel_err(sharded[k].full(), ref[k]) <= 1e-5


def test_cache_key_covers_shapes_and_dtypes():
    """A new shape or dtype compiles again; the same ones do not."""
    step = _sharded_step((2,), "dp")
    params = mlp_init(D, F, C)
    for batch in (8, 8, 4, 4):
        step(params, *mlp_data(batch, D, C))
    assert step.trace_count == 2
    step(mlp_init(D, F, C, dtype=torch.float64), *mlp_data(4, D, C, dtype=torch.float64))
    assert step.trace_count == 3


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
def test_other_float_dtypes(dtype, tol):
    """float64 and bfloat16 steps match the unsharded step in the same dtype."""
    params, (x, y) = mlp_init(D, F, C, dtype=dtype), mlp_data(B, D, C, dtype=dtype)
    ref_params, ref_loss = mlp_step(params, x, y)
    new_params, loss = _sharded_step((2, 2), "dp_tp")(params, x, y)
    assert loss.dtype == dtype
    assert _rel_err(loss.full(), ref_loss) <= tol
    for k in params:
        assert _rel_err(new_params[k].full(), ref_params[k]) <= tol
