"""What capture keeps whole and what it decomposes, and that each choice shards correctly:
attention forward and backward, training-mode batch norm and var, layer norm, embedding."""

import collections

import pytest
import torch
import torch.nn.functional as F

import hpfun
from hpfun import P
from hpfun.capture import capture
from hpfun.rules.norm import group_norm_backward

aten = torch.ops.aten
_GEN = torch.Generator().manual_seed(0)  # inputs are the same on every run


def _ops(fn, *tensors) -> collections.Counter:
    gm = capture(lambda *ts: list(torch.utils._pytree.tree_leaves(fn(*ts))), [(t.shape, t.dtype) for t in tensors])
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def _check(fn, args, in_specs, mesh_shape, names, tol=1e-5):
    """fn sharded (outputs replicated) equals fn whole; returns the program's collectives."""
    mesh = hpfun.Mesh.simulated(mesh_shape, names)
    f = hpfun.shard(fn, mesh=mesh, in_specs=in_specs, out_specs=P())
    got, expected = f(*args), fn(*args)
    for g, e in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected), strict=True):
        torch.testing.assert_close(g.full(), e, rtol=tol, atol=tol)
    return f.lower(*args).collectives


# ---------------------------------------------------------------------------------------------
# Attention: the fused kernel kept whole, forward and backward
# ---------------------------------------------------------------------------------------------


def _attention_grads(**kwargs):
    def grads(q, k, v, *mask):
        def loss(q, k, v):
            out = F.scaled_dot_product_attention(q, k, v, *mask, **kwargs)
            return (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum()
        return torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return grads


ATTENTION = {  # name: (sdpa kwargs, k/v heads, mask)
    "causal": ({"is_causal": True}, 4, None),
    "scaled": ({"scale": 0.3}, 4, None),
    "float_mask": ({}, 4, torch.randn(8, 8, dtype=torch.float64, generator=_GEN)),
    "bool_mask": ({}, 4, torch.rand(8, 8, generator=_GEN) > 0.3),
    "grouped_query": ({"is_causal": True, "enable_gqa": True}, 2, None),
}


@pytest.mark.parametrize("name", sorted(ATTENTION))
@pytest.mark.parametrize("spec", [P(None, "tp"), P("tp")], ids=["heads", "batch"])
def test_attention_backward_is_exact_and_local(name, spec):
    """F.scaled_dot_product_attention forward and backward, split on heads or batch, equal the
    unsharded gradients with no collective."""
    kwargs, kv_heads, mask = ATTENTION[name]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 8, 4, generator=g, dtype=torch.float64) for _ in range(2))
    args = (q, k, v) + (() if mask is None else (mask,))
    collectives = _check(_attention_grads(**kwargs), args, (spec, spec, spec, P())[: len(args)], (2,), ("tp",), tol=1e-10)
    assert all(c.node.startswith("outputs") for c in collectives)  # only the out_specs' gathers


def test_attention_is_kept_whole():
    """Capture records the fused CPU kernels, forward and backward, not matmuls and a softmax."""
    q = torch.randn(2, 4, 8, 4, generator=_GEN)
    ops = _ops(_attention_grads(is_causal=True), q, q, q)
    assert ops[aten._scaled_dot_product_flash_attention_for_cpu.default] == 1
    assert ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] == 1
    assert not {aten._softmax.default, aten.bmm.default, aten.einsum.default} & set(ops)


def _block_step(params, x):
    """A causal attention block with projections, forward and backward."""
    def loss(params, x):
        b, t, d = x.shape
        q, k, v = (torch.matmul(x, params[w]).view(b, t, 4, d // 4).transpose(1, 2) for w in ("wq", "wk", "wv"))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        return (out @ params["wo"]).pow(2).mean()
    return torch.func.grad(loss)(params, x)


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Every shape an op produces while it is on."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes.update(tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("split", ["batch", "heads"])
def test_attention_program_holds_no_scores_matrix(split):
    """The per-shard program of a causal attention block split on batch or heads (Megatron)
    never makes a T x T tensor: attention runs as the fused kernel on each rank's block."""
    T, D = 24, 16  # T differs from every other size, so a trailing (T, T) can only be scores
    params = {w: torch.randn(D, D, generator=_GEN, dtype=torch.float64) / 4 for w in ("wq", "wk", "wv", "wo")}
    x = torch.randn(4, T, D, generator=_GEN, dtype=torch.float64)
    col, row = (P(None, "m"), P("m", None)) if split == "heads" else (P(), P())
    specs = ({"wq": col, "wk": col, "wv": col, "wo": row}, P("m") if split == "batch" else P())
    f = hpfun.shard(_block_step, mesh=hpfun.Mesh.simulated((2,), ("m",)), in_specs=specs, out_specs=specs[0])
    f(params, x)  # compiled outside the recording
    with _Shapes() as seen:
        grads = f(params, x)
    assert seen.shapes and not [s for s in seen.shapes if s[-2:] == (T, T)]
    expected = _block_step(params, x)
    for name, g in grads.items():
        torch.testing.assert_close(g.full(), expected[name], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["causal", "grouped_query"])
def test_causal_attention_split_along_the_sequence_keeps_the_queries_local(name):
    """Causal attention with its inputs split along the sequence (context parallelism): each
    rank attends its own query rows to the gathered keys and values under the causal mask of
    its rows, written out; the queries and the output stay split, the keys' and values'
    gradients are summed. Results equal the unsharded ones, and no rank holds a T x T tensor."""
    kwargs, kv_heads, _ = ATTENTION[name]
    T = 24
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, T, 4, generator=g, dtype=torch.float64) for _ in range(2))
    seq = P(None, None, "sp")
    mesh = hpfun.Mesh.simulated((4,), ("sp",))
    f = hpfun.shard(_attention_grads(**kwargs), mesh=mesh, in_specs=(seq, seq, seq), out_specs=(seq, seq, seq))
    f(q, k, v)  # compiled outside the recording
    with _Shapes() as seen:
        got = f(q, k, v)
    for g_, e in zip(got, _attention_grads(**kwargs)(q, k, v), strict=True):
        torch.testing.assert_close(g_.full(), e, rtol=1e-10, atol=1e-10)
    assert not [s for s in seen.shapes if s[-2:] == (T, T)]
    lowered = f.lower(q, k, v)
    kinds = collections.Counter(c.kind for c in lowered.collectives)
    assert kinds == {"all_gather": 2, "reduce_scatter": 2}, kinds  # k and v gathered; their gradients scattered
    attention = [n for n in lowered.program.module.graph.nodes
                 if n.target is aten._scaled_dot_product_flash_attention_for_cpu.default]
    assert attention and all(n.args[4] is False and "attn_mask" in n.kwargs for n in attention)


def _cuda_attention_grads(kernel):
    """Gradients through one of CUDA's fused attention kernels, called as torch's SDPA would."""
    def loss(q, k, v):
        if kernel == "flash":
            out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        elif kernel == "efficient":
            out = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0]
        else:
            out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)[0]
        return out.float().pow(2).sum()
    return lambda q, k, v: torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
@pytest.mark.parametrize("spec", [P(None, "tp"), P("tp")], ids=["heads", "batch"])
def test_cuda_attention_kernels_plan_split_on_heads_or_batch(kernel, spec):
    """CUDA's flash, memory-efficient and cuDNN kernels (forward and backward) keep their
    heads or batch split with no collective; planned on meta tensors (no GPU here to run them)."""
    q, k, v = (torch.empty(2, 4, 16, 8, device="meta", dtype=torch.bfloat16) for _ in range(3))
    f = hpfun.shard(_cuda_attention_grads(kernel), mesh=hpfun.Mesh.simulated((2,), ("tp",)),
                    in_specs=(spec,) * 3, out_specs=(spec,) * 3)
    lowered = f.lower(q, k, v)
    assert lowered.collectives == []
    kernels = [n for n in lowered.program.module.graph.nodes if "attention" in str(n.target)]
    assert len(kernels) == 2  # forward and backward, whole


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_backward_is_one_kernel_on_split_rows_and_pieces_on_split_classes(reduction):
    """F.cross_entropy's backward: with the batch split (data parallel) the per-shard program
    runs torch's nll_loss_backward kernel; with the classes split (vocab parallel) it runs the
    pieces that can place a target only in the rank's block. Both equal the unsharded step."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(16, 32, generator=g, dtype=torch.float64), torch.randn(8, 16, generator=g, dtype=torch.float64)
    t = torch.randint(0, 32, (8,), generator=g)
    t[3] = -100  # ignored

    def step(w, x, t):
        return torch.func.grad(lambda w: F.cross_entropy(x @ w, t, reduction=reduction).square().sum())(w)

    for axis, specs, fused in (("dp", (P(), P("dp"), P("dp")), 1), ("tp", (P(None, "tp"), P(), P()), 0)):
        f = hpfun.shard(step, mesh=hpfun.Mesh.simulated((2,), (axis,)), in_specs=specs, out_specs=specs[0])
        torch.testing.assert_close(f(w, x, t).full(), step(w, x, t), rtol=1e-10, atol=1e-10)
        ops = collections.Counter(n.target for n in f.lower(w, x, t).program.module.graph.nodes)
        assert ops[aten.nll_loss_backward.default] == fused, axis


# ---------------------------------------------------------------------------------------------
# Batch norm and var: decomposed into reductions (a split batch costs per-channel all-reduces)
# ---------------------------------------------------------------------------------------------


def _batch_norm_step(params, x):
    def loss(params, x):
        h = F.batch_norm(x, None, None, params["w"], params["b"], training=True)
        return (h * h.detach().sign()).mean()
    return torch.func.grad_and_value(loss)(params, x)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,)])
def test_training_batch_norm_on_a_split_batch_is_sync_batch_norm(mesh_shape):
    """Batch statistics over a split batch: every collective moves per-channel values or less."""
    C = 6
    params = {"w": torch.randn(C, generator=_GEN), "b": torch.randn(C, generator=_GEN)}
    x = torch.randn(8, C, 4, 4, generator=_GEN)
    collectives = _check(_batch_norm_step, (params, x), ({"w": P(), "b": P()}, P("dp")), mesh_shape, ("dp",))
    assert collectives and all(c.bytes <= C * 4 for c in collectives)
    ops = _ops(lambda w, b, x: _batch_norm_step({"w": w, "b": b}, x), params["w"], params["b"], x)
    assert aten.native_batch_norm.default not in ops


def test_var_over_a_split_dim_reduces_partial_sums():
    """x.var over a split dim (decomposed in two passes) moves only reduced-size values."""
    x = torch.randn(8, 6, dtype=torch.float64, generator=_GEN)
    collectives = _check(lambda x: torch.var_mean(x, 0, correction=1), (x,), (P("dp"),), (4,), ("dp",), tol=1e-10)
    assert collectives and all(c.bytes <= 6 * 8 for c in collectives)


# ---------------------------------------------------------------------------------------------
# Kept whole: layer norm and embedding, forward and backward
# ---------------------------------------------------------------------------------------------


def test_layer_norm_forward_is_kept_whole_and_shards_on_leading_dims():
    """native_layer_norm stays one op (about 20x faster than torch's decomposition on CPU); a
    sequence-split layer norm with its backward needs only the weight gradients' all-reduces."""
    x, w, b = torch.randn(4, 8, 16, generator=_GEN), torch.randn(16, generator=_GEN), torch.randn(16, generator=_GEN)

    def grads(x, w, b):
        return torch.func.grad(lambda x, w, b: F.layer_norm(x, (16,), w, b).pow(3).sum(), argnums=(0, 1, 2))(x, w, b)

    ops = _ops(grads, x, w, b)
    assert ops[aten.native_layer_norm.default] == 1 and ops[aten.native_layer_norm_backward.default] == 1
    collectives = _check(grads, (x, w, b), (P(None, "sp"), P(), P()), (2,), ("sp",), tol=1e-4)
    kinds = sorted((c.kind, c.bytes) for c in collectives)  # grad_x gathered for the out_spec; grad_w, grad_b summed
    assert kinds == [("all_gather", 4 * 4 * 16 * 4), ("all_reduce", 16 * 4), ("all_reduce", 16 * 4)]


def test_embedding_and_its_backward_are_kept_whole():
    """F.embedding captures as aten.embedding and its backward as embedding_dense_backward
    (one scatter-add kernel), put back whole after propagation (pieces laid out by their own
    rules); both look up a split vocab locally."""
    ids, w = torch.randint(0, 8, (4, 3), generator=_GEN), torch.randn(8, 4, generator=_GEN)
    step = lambda ids, w: torch.func.grad(lambda w: F.embedding(ids, w).pow(2).sum())(w)  # noqa: E731
    assert _ops(step, ids, w)[aten.embedding.default] == 1
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    for spec in (P("tp"), P()):
        f = hpfun.shard(step, mesh=mesh, in_specs=(P(), spec), out_specs=spec)
        torch.testing.assert_close(f(ids, w).full(), step(ids, w))
        lowered = f.lower(ids, w)
        ops = collections.Counter(n.target for n in lowered.program.module.graph.nodes if n.op == "call_function")
        assert ops[aten.embedding_dense_backward.default] == 1 and aten.index_put.default not in ops


# ---------------------------------------------------------------------------------------------
# Losses and layers whose backward torch does not decompose: hpfun's own decompositions
# ---------------------------------------------------------------------------------------------

_N, _C = 4, 6
_X = torch.randn(_N, _C, dtype=torch.float64, generator=_GEN)
_Y = torch.randint(0, _C, (_N,), generator=_GEN)
# class lists up to the first -1, one with a class listed twice (torch's kernel counts it twice)
_LABELS = torch.tensor([[2, 3, -1, 0, 0, 0], [5, 5, 0, -1, -1, -1], [1, -1, 2, 2, 2, 2], [0, 1, 2, 3, 4, 5]])
_SIGNS = torch.randint(0, 2, (_N, _C), generator=_GEN).double() * 2 - 1
_LOSSES = {
    "multi_margin": lambda o: F.multi_margin_loss(o, _Y),
    "multi_margin_p2_weighted_sum": lambda o: F.multi_margin_loss(
        o, _Y, p=2, margin=0.7, weight=torch.linspace(0.5, 1.5, _C, dtype=o.dtype), reduction="sum"),
    "multilabel_margin": lambda o: F.multilabel_margin_loss(o, _LABELS),
    "multilabel_margin_none": lambda o: F.multilabel_margin_loss(o, _LABELS, reduction="none").sum(),
    "hinge_embedding": lambda o: F.hinge_embedding_loss(o, _SIGNS),  # clamp_min
    "bilinear": lambda o: F.bilinear(o[:, :3], o[:, 3:], torch.ones(2, 3, 3, dtype=o.dtype)).square().mean(),
}


@pytest.mark.parametrize("name", list(_LOSSES))
def test_losses_without_torch_backward_decompositions_equal_eager_on_a_split_batch(name):
    """multi_margin_loss and multilabel_margin_loss backwards, nn.Bilinear's _trilinear (no
    decomposition in torch) and clamp_min, on a batch split over dp: loss and gradient equal
    eager. multilabel_margin_loss's forward is hpfun's too: torch's decomposition counts the
    class slots after the first -1 (4.5 instead of 1.8 on these labels, with the whole batch)."""
    w = torch.randn(_C, _C, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loss = _LOSSES[name]  # closed over: hpfun lifts the targets it reads

    def step(x, w):
        return torch.func.grad_and_value(lambda w: loss(x @ w))(w)

    _check(step, (_X, w), (P("dp"), P()), (2,), ("dp",), tol=1e-12)


def test_grid_sample_backward_splits_the_batch():
    """F.grid_sample's backward (no decomposition) runs per image on a split batch, its
    gradients for the input and the grid equal eager."""
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64, generator=_GEN)
    grid = torch.rand(4, 3, 3, 2, dtype=torch.float64, generator=_GEN) * 2 - 1

    def grads(x, grid):
        return torch.func.grad(lambda x, grid: F.grid_sample(x, grid, align_corners=False).square().sum(),
                               argnums=(0, 1))(x, grid)

    _check(grads, (x, grid), (P("dp"), P("dp")), (2,), ("dp",), tol=1e-12)
    split = hpfun.shard(grads, mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=(P("dp"), P("dp")), out_specs=P("dp"))
    assert not split.lower(x, grid).collectives  # each rank its images, nothing moved


# ---------------------------------------------------------------------------------------------
# Backwards of nn modules (`loss.backward()`): torch's fused kernels kept whole
# ---------------------------------------------------------------------------------------------


def _module_step(specs, x_spec):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(4, 8), torch.nn.SiLU(),
                                torch.nn.Conv2d(8, 4, 3), torch.nn.Mish()).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    return model, step, hpfun.shard(step, mesh=mesh, in_specs=(x_spec,), out_specs=P(), state_specs=specs)


@pytest.mark.parametrize("specs", [{}, {"0.weight": P("dp"), "1.weight": P("dp")}])
def test_module_backwards_keep_silu_mish_and_group_norm_kernels(specs):
    """Autograd's backward of SiLU, Mish and GroupNorm calls one kernel each (silu_backward,
    mish_backward, native_group_norm_backward), where torch's decompositions are 5 to 20
    elementwise ops and reductions: capture keeps them, and on a split batch, with or without
    split weights, two SGD steps equal eager."""
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    model, _, sharded = _module_step(specs, P("dp"))
    eager, eager_step, _ = _module_step({}, P())
    for _ in range(2):
        torch.testing.assert_close(sharded(x).full(), eager_step(x), rtol=1e-12, atol=1e-12)
    for got, want in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    ops = collections.Counter(n.target for n in sharded.lower(x).program.module.graph.nodes if n.op == "call_function")
    # (group norm's backward is called through the helper that gives the gradient its input's memory format)
    for kernel in (aten.silu_backward.default, aten.mish_backward.default, group_norm_backward):
        assert ops[kernel] == 1, kernel
    assert aten.sigmoid.default not in ops  # no piece of a decomposed SiLU or Mish backward


def test_in_place_update_written_as_a_copy_is_no_copy_in_the_program():
    """AdamW with a tensor learning rate writes `param.addcdiv_(m, d, value=-step_size)` with a
    traced step size, which capture records as `param.copy_(param + m / d * -step_size)`: the
    program computes the new value and uses it, with no second pass copying it (two per
    parameter before). Results equal eager's steps."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).double()
        return model, torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, dtype=torch.float64))

    (model, opt), (eager, eager_opt) = make(), make()
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def step_of(model, opt):
        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    sharded = hpfun.shard(step_of(model, opt), mesh=mesh, in_specs=(P("dp"),), out_specs=P())
    for _ in range(3):
        torch.testing.assert_close(sharded(x).full(), step_of(eager, eager_opt)(x), rtol=1e-12, atol=1e-12)
    for got, want in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    nodes = [n for n in sharded.lower(x).program.module.graph.nodes if n.op == "call_function"]
    ops = collections.Counter(n.target for n in nodes)
    grouped = sum(len(n.meta["hpfun_foreach"]) for n in nodes if n.target is aten._foreach_addcdiv.Scalar)
    assert ops[aten.addcdiv.default] + grouped == 2 and aten.copy.default not in ops


def test_rrelu_in_eval_mode_is_the_leaky_relu_of_its_mean_slope():
    """`nn.RReLU().eval()` draws nothing (torch computes the leaky ReLU of slope (lower + upper) / 2):
    its forward and backward shard as the leaky ReLU's, equal to eager. In training mode it draws,
    and is refused as a random op."""
    x = torch.randn(8, 6, dtype=torch.float64, generator=_GEN)

    def f(x):
        return torch.func.grad_and_value(lambda x: F.rrelu(x, 0.1, 0.3, training=False).square().sum())(x)

    _check(f, (x,), (P("dp"),), (2,), ("dp",), tol=1e-12)
    assert not any("rrelu" in str(op) for op in _ops(f, x))
    train = hpfun.shard(lambda x: F.rrelu(x, training=True), mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=P("dp"),
                        out_specs=P("dp"))
    with pytest.raises(hpfun.MissingRuleError, match="hpfun draws random numbers itself"):
        train(x)


def test_softmax_of_replicated_scores_feeding_a_head_split_value_runs_the_fused_kernel_on_a_block():
    """Scores replicated, V split by heads: the probabilities are wanted split by heads, so the
    planner cut the scores in the middle of softmax's pieces (after the max), and the float32
    pieces rounded differently from eager's fused kernel (2.4e-7). The scores are cut first now,
    and softmax and log-softmax, forward and backward, run fused on each rank's heads: the gradient is exact."""
    gen = torch.Generator().manual_seed(0)  # (its own: _GEN's state depends on the tests run before on a worker)
    s, v = (torch.randn(4, 4, 8, 8, generator=gen) * 3 for _ in range(2))

    def f(s, v):
        return torch.func.grad_and_value(lambda s: (F.softmax(s, -1) @ v).square().sum()
                                         + (F.log_softmax(s, -1) @ v).sum())(s)

    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    g = hpfun.shard(f, mesh=mesh, in_specs=(P(), P(None, "tp")), out_specs=P())
    (grad, loss), (want_grad, want_loss) = g(s, v), f(s, v)  # (the loss sums the split heads in another order:
    # float32 sums of a thousand terms of a few hundred, reordered, differ by up to 2e-6 relative)
    assert torch.equal(grad.full(), want_grad) and torch.allclose(loss.full(), want_loss, rtol=1e-5)
    program = str(g.lower(s, v))
    fused = ("_softmax.default", "_log_softmax.default", "_softmax_backward_data", "_log_softmax_backward_data")
    assert all(op in program for op in fused) and " exp.default(" not in program and " amax.default(" not in program
