"""hpfun.checkpoint: a region's activations are recomputed before the backward reads them, not
kept; the step computes what it computes without checkpoints (bitwise here), random ops included."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import hpfun
from hpfun import P
from hpfun.capture import trace
from hpfun.checkpoint import RECOMPUTES, redraws
from hpfun.rules import random
from hpfun.testing.models import (
    MEGATRON, _attention, _ln, adamw, adamw_init, gpt_data, gpt_init, gpt_loss, gpt_specs, gpt_step, mlp_data,
    mlp_init,
)
from hpfun.testing.oracle import assert_sharded_equal

aten = torch.ops.aten
MESH = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
# the reference GPT, small, with activations larger than its parameters (as in training)
GPT_SIZES = {"seq": 32, "vocab": 64, "d": 32, "heads": 2, "layers": 2}


# ---------------------------------------------------------------------------------------------
# Models: the reference GPT and an MLP, their layers as blocks that may be checkpointed
# ---------------------------------------------------------------------------------------------


def gpt_block(x, p, i, heads):
    """One layer of `hpfun.testing.models.gpt_loss`, op for op."""
    x = x + _attention(_ln(x, p, f"h{i}.ln1"), p, i, heads)
    h = F.gelu(_ln(x, p, f"h{i}.ln2") @ p[f"h{i}.w1"] + p[f"h{i}.b1"])
    return x + h @ p[f"h{i}.w2"] + p[f"h{i}.b2"]


def remat_gpt_loss(params, idx, targets, remat=None, heads=2):
    """gpt_loss with each layer a block: `remat` None (plain), "all" or "matmuls" (checkpointed)."""
    block = gpt_block if remat is None else hpfun.checkpoint(gpt_block, save=None if remat == "all" else remat)
    x = F.embedding(idx, params["wte"]) + params["wpe"]
    for i in range(sum(1 for k in params if k.endswith(".wq"))):
        x = block(x, params, i, heads)
    logits = _ln(x, params, "ln_f") @ params["wte"].t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def remat_gpt_step(params, state, idx, targets, remat=None):
    grads, loss = torch.func.grad_and_value(remat_gpt_loss)(params, idx, targets, remat)
    params, state = adamw(params, grads, state)
    return params, state, loss


def mlp_block(x, w1, b1, p=0.0):
    return F.dropout(torch.relu(x @ w1 + b1), p, training=p > 0)


def remat_mlp_loss(params, x, y, remat=None, p=0.0):
    block = mlp_block if remat is None else hpfun.checkpoint(mlp_block, save=None if remat == "all" else remat)
    h = block(x, params["w1"], params["b1"], p)
    return F.cross_entropy(torch.tanh(h) @ params["w2"] + params["b2"], y)


def remat_mlp_step(params, x, y, remat=None, p=0.0):
    grads, loss = torch.func.grad_and_value(remat_mlp_loss)(params, x, y, remat, p)
    return {k: v - 0.1 * grads[k] for k, v in params.items()}, loss


def _gpt():
    params = gpt_init(**GPT_SIZES)
    idx, targets = gpt_data(16, **GPT_SIZES)
    specs = gpt_specs(params, tp="tp")
    state_specs = {"m": specs, "v": specs, "step": P()}
    return (params, adamw_init(params), idx, targets), (specs, state_specs, P("dp"), P("dp"))


def _full(out):
    return pytree.tree_map(lambda x: x.full() if isinstance(x, hpfun.Sharded) else x, out,
                           is_leaf=lambda x: isinstance(x, hpfun.Sharded))


@functools.cache
def _gpt_results(remat):
    args, specs = _gpt()
    f = hpfun.shard(functools.partial(remat_gpt_step, remat=remat), mesh=MESH, in_specs=specs,
                    out_specs=(specs[0], specs[1], P()))
    return _full(f(*args)), f.lower(*args)


def _assert_bitwise(a, b):
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


def test_block_is_the_reference_gpt_layer():
    """The test's blocked GPT is gpt_loss, bitwise (so its results stand for the reference GPT)."""
    params, (idx, targets) = gpt_init(**GPT_SIZES), gpt_data(16, **GPT_SIZES)
    assert torch.equal(remat_gpt_loss(params, idx, targets), gpt_loss(params, idx, targets))
    assert torch.equal(remat_gpt_loss(params, idx, targets, "all"), gpt_loss(params, idx, targets))


def _rel(a, b) -> float:
    """Norm-wise relative error, as tests/test_models.py measures the GPT (a max-based one would
    amplify AdamW's division by tiny moments)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("remat", ["all", "matmuls"])
def test_gpt_step_equals_unsharded_and_uncheckpointed(remat):
    """Checkpointed GPT AdamW step (every layer a checkpointed block), dp x tp on 2x2, against
    the reference `gpt_step` run eagerly on whole tensors, norm-wise: the loss, and the optimizer
    state (the gradients' moments) within 1e-5 (measured 9e-7: the sharded matmuls sum in
    another order). The parameters within 2e-4: AdamW's first step is g / (|g| + 1e-8), which
    turns a rounding difference in a gradient element near 1e-8 into a visible one (measured
    1.7e-5 without checkpoints, 7e-5 with 'matmuls').

    Against the same sharded step without checkpoints: bitwise where propagation chose the same
    plan (whole blocks: the recompute runs the same ops on the same layouts as the forward);
    with 'matmuls' the kept matmul outputs have more consumers and the greedy plan differs (one
    more collective), so sums run in another order: the state within 1e-5 (measured 9e-7)."""
    args, _ = _gpt()
    got, plain, expected = _gpt_results(remat)[0], _gpt_results(None)[0], gpt_step(*args)
    assert _rel(got[2], expected[2]) <= 1e-5
    for a, b in zip(pytree.tree_leaves(got[1]), pytree.tree_leaves(expected[1]), strict=True):
        assert _rel(a, b) <= 1e-5
    for a, b in zip(pytree.tree_leaves(got[0]), pytree.tree_leaves(expected[0]), strict=True):
        assert _rel(a, b) <= 2e-4
    if remat == "all":
        _assert_bitwise(got, plain)
    for a, b in zip(pytree.tree_leaves(got[1:]), pytree.tree_leaves(plain[1:]), strict=True):
        assert _rel(a, b) <= 1e-5


@pytest.mark.parametrize("remat", ["all", "matmuls"])
def test_mlp_step_dp_tp(remat):
    params, (x, y) = mlp_init(), mlp_data()
    specs = (MEGATRON, P("dp"), P("dp"))
    step = functools.partial(remat_mlp_step, remat=remat)
    assert_sharded_equal(step, (params, x, y), MESH, specs, out_specs=(MEGATRON, P()), rtol=1e-5, atol=1e-6)
    plain = hpfun.shard(remat_mlp_step, mesh=MESH, in_specs=specs, out_specs=(MEGATRON, P()))
    checked = hpfun.shard(step, mesh=MESH, in_specs=specs, out_specs=(MEGATRON, P()))
    _assert_bitwise(_full(checked(params, x, y)), _full(plain(params, x, y)))


@pytest.mark.parametrize("rng", ["philox", "native"])
def test_dropout_recomputed_draws_the_same_numbers(rng):
    """Dropout inside a checkpointed block: the recompute draws the forward's mask again (the
    clone reuses its original's op number), so the step is bitwise the uncheckpointed one, on
    two layouts; and the program draws no more random op numbers than without checkpoints.
    rng="native" too, where the recompute has its original's layout (see the next test)."""
    params, (x, y) = mlp_init(), mlp_data()
    draws = (random._sample, random.sample, random.native_sample)
    for specs in [(MEGATRON, P("dp"), P("dp")), ({k: P() for k in params}, P(("dp", "tp")), P(("dp", "tp")))]:
        results, ops = {}, {}
        for remat in (None, "all"):
            f = hpfun.shard(functools.partial(remat_mlp_step, remat=remat, p=0.5), mesh=MESH, in_specs=specs,
                            out_specs=(specs[0], P()), rng=rng)
            with hpfun.random_seed(7):
                results[remat] = _full(f(params, x, y))
            program = f.lower(params, x, y).program.module
            ops[remat] = [n.args[3] for n in program.graph.nodes if n.target in draws]
        _assert_bitwise(results["all"], results[None])
        assert len(ops["all"]) == 2 * len(ops[None]) and set(ops["all"]) == set(ops[None])
    with hpfun.random_seed(8):  # and the draw does change with the seed: the test can fail
        other = _full(f(params, x, y))
    assert not torch.equal(other[1], results["all"][1])


def test_native_rng_refuses_a_recompute_laid_out_otherwise():
    """With rng="native" a draw depends on its block: a recomputed random op whose layout is not
    its original's would draw other numbers, and lowering says so instead."""
    params, (x, y) = mlp_init(), mlp_data()
    leaves, tree = pytree.tree_flatten((params, x, y))

    def flat(*xs):
        return pytree.tree_leaves(remat_mlp_step(*pytree.tree_unflatten(list(xs), tree), remat="all", p=0.5))

    gm = trace(flat, [(tuple(t.shape), t.dtype) for t in leaves]).gm
    clone = next(n for n in gm.graph.nodes
                 if getattr(n.target, "_nondeterministic_seeded", False) and RECOMPUTES in n.meta)
    original = next(n for n in gm.graph.nodes if n.name == clone.meta[RECOMPUTES])
    original.meta["hpfun_layout"] = hpfun.parse("[S(0), R] on {dp: 2, tp: 2}")
    clone.meta["hpfun_layout"] = hpfun.parse("[S(0), S(1)] on {dp: 2, tp: 2}")
    assert redraws(gm, "philox") == {n.name: n.meta[RECOMPUTES] for n in gm.graph.nodes if RECOMPUTES in n.meta}
    with pytest.raises(hpfun.ShardingError, match="rng='philox'"):
        redraws(gm, "native")
    clone.meta["hpfun_layout"] = original.meta["hpfun_layout"]
    assert clone.name in redraws(gm, "native")


# ---------------------------------------------------------------------------------------------
# Structure: what the captured graph keeps from the forward into the backward
# ---------------------------------------------------------------------------------------------


@functools.cache
def _captured_gpt(remat):
    args, _ = _gpt()
    leaves, tree = pytree.tree_flatten(args)

    def flat(*xs):
        out = remat_gpt_step(*pytree.tree_unflatten(list(xs), tree), remat=remat)
        return pytree.tree_leaves(out)

    return trace(flat, [(tuple(x.shape), x.dtype) for x in leaves]).gm


def _is_view(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def kept_across(gm):
    """(count, bytes) of the buffers computed before the loss (the end of the forward) and read
    after it: what the forward leaves alive for the backward. A view read later keeps its base
    alive (counted once); the inputs are not counted."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    loss = gm.graph.output_node().args[0][-1]
    kept = set()
    for n in nodes[:order[loss] + 1]:
        if isinstance(n.meta.get("val"), torch.Tensor) and any(order[u] > order[loss] for u in n.users):
            while _is_view(n):
                n = n.args[0]
            if n.op == "call_function":
                kept.add(n)
    return len(kept), sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in kept)


def test_checkpoint_keeps_less_across_the_forward():
    """Whole-block checkpointing keeps only the blocks' inputs (the residual stream) and what
    the loss head saves; 'matmuls' keeps the matmul outputs too; both less than no checkpoint.
    Measured (global values): 39 buffers, 2.64 MB without; 23, 1.84 MB with 'matmuls'; 9,
    0.40 MB with whole blocks."""
    plain, matmuls, full = (kept_across(_captured_gpt(r)) for r in (None, "matmuls", "all"))
    assert full[0] < matmuls[0] < plain[0]
    assert full[1] < matmuls[1] < plain[1]


def test_estimated_peak_memory_is_lower():
    """hpfun.memory's estimate of the per-rank peak (liveness of the lowered dp x tp program):
    whole-block checkpoints hold least, 'matmuls' between, no checkpoint most; the inputs
    (parameters, optimizer state, batch: 195 kB) are the same. Measured peaks per rank: 1.19 MB
    without checkpoints, 0.92 MB with 'matmuls', 0.74 MB with whole blocks (0.62x); what the
    program allocates on top of its inputs: 995, 723 and 546 kB."""
    memories = {remat: _gpt_results(remat)[1].memory() for remat in (None, "matmuls", "all")}
    assert memories["all"].held == memories["matmuls"].held == memories[None].held
    assert memories["all"].transient < memories["matmuls"].transient < memories[None].transient
    assert memories["all"].peak < 0.75 * memories[None].peak  # measured 0.62


def test_graph_recomputes_each_block_once_before_its_backward():
    gm = _captured_gpt("all")
    nodes = list(gm.graph.nodes)
    assert not any("checkpoint_output" in str(n.target) for n in nodes)  # the markers are gone
    clones = [n for n in nodes if "hpfun_recomputes" in n.meta]
    loss = nodes.index(gm.graph.output_node().args[0][-1])
    assert clones and all(nodes.index(c) > loss for c in clones)  # all in the backward
    originals = {n.name: n for n in nodes}  # an original only the backward read is gone
    assert all(originals[c.meta["hpfun_recomputes"]].target == c.target for c in clones
               if c.meta["hpfun_recomputes"] in originals)
    # two layers: two recomputes, the last layer's first (backward runs the layers in reverse)
    names = [c.meta["hpfun_recomputes"] for c in clones]
    assert len(names) == len(set(names))
    plain = _captured_gpt(None)
    assert len(nodes) > len(list(plain.graph.nodes))


def test_save_matmuls_recomputes_no_matmul():
    clones = [n for n in _captured_gpt("matmuls").graph.nodes if "hpfun_recomputes" in n.meta]
    assert clones and not any(n.target in hpfun.checkpoint.MATMULS for n in clones)
    everything = [n for n in _captured_gpt("all").graph.nodes if "hpfun_recomputes" in n.meta]
    assert any(n.target in hpfun.checkpoint.MATMULS for n in everything)


def test_save_by_name_op_and_predicate():
    """save= as names, ops or a predicate: each keeps what it names (the block's matmuls here,
    as 'matmuls' does); None recomputes the first matmul and tanh the backward reads."""

    def block(x, w):
        return torch.tanh(torch.tanh(x @ w) @ w)

    def recomputed(save):
        def step(w, x):
            return torch.func.grad(lambda w, x: hpfun.checkpoint(block, save=save)(x, w).sum())(w, x)

        gm = trace(step, [((4, 4), torch.float32), ((8, 4), torch.float32)]).gm
        return sorted(str(n.target) for n in gm.graph.nodes if "hpfun_recomputes" in n.meta)

    assert recomputed(None) == ["aten.mm.default", "aten.tanh.default"]  # the second mm's input
    for save in ["matmuls", "mm", ("aten.mm",), [aten.mm], {aten.mm.default}, lambda op: op is aten.mm.default]:
        assert recomputed(save) == ["aten.tanh.default"], save
    assert recomputed(["tanh"]) == []  # the value the backward reads, kept


# ---------------------------------------------------------------------------------------------
# Use
# ---------------------------------------------------------------------------------------------


def test_eager_runs_the_function():
    """Outside a sharded function the wrapper calls the block: same values, gradients too."""
    x, w = torch.randn(8, 4), torch.randn(4, 4)

    def loss(w, x):
        return torch.tanh(x @ w).sum()

    assert torch.equal(hpfun.checkpoint(loss)(w, x), loss(w, x))
    assert torch.equal(torch.func.grad(hpfun.checkpoint(loss))(w, x), torch.func.grad(loss)(w, x))


def test_decorator_forms_nested_and_outputs():
    """@hpfun.checkpoint and @hpfun.checkpoint(save=...) both decorate; a checkpoint inside a
    checkpointed block belongs to the outer one; several outputs and non-tensor outputs pass."""

    @hpfun.checkpoint
    def inner(x):
        return torch.sin(x) * 2, "tag"

    @hpfun.checkpoint(save="matmuls")
    def outer(x, w):
        h, tag = inner(x @ w)
        return torch.cos(h), torch.exp(h), tag

    def loss(w, x):
        a, b, tag = outer(x, w)
        assert tag == "tag"
        return (a * b).sum()

    assert outer.__name__ == "outer"
    x, w = torch.randn(8, 4), torch.randn(4, 4)
    assert_sharded_equal(lambda w, x: torch.func.grad_and_value(loss)(w, x), (w, x), MESH, (P(), P("dp")),
                         rtol=1e-5, atol=1e-6)


def test_region_values_returned_by_the_step_are_kept():
    """A region's value the step itself returns (an aux output) is kept, not recomputed."""
    params, (x, y) = mlp_init(), mlp_data()

    def loss(p, x, y):
        h = hpfun.checkpoint(lambda x: torch.relu(x @ p["w1"] + p["b1"]))(x)
        return F.cross_entropy(h @ p["w2"] + p["b2"], y), h

    def step(p, x, y):
        return torch.func.grad_and_value(loss, has_aux=True)(p, x, y)

    assert_sharded_equal(step, (params, x, y), MESH, (MEGATRON, P("dp"), P("dp")), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [None, 3, torch.randn(2)])
def test_not_a_function(bad):
    with pytest.raises(hpfun.SpecError, match="needs a function"):
        hpfun.checkpoint(bad)
    with pytest.raises(hpfun.SpecError, match="needs a function"):
        hpfun.checkpoint(save="matmuls")(bad)


@pytest.mark.parametrize("save", [3, ["mm", 4], object(), "matmull", ["aten.mm.nosuch"]])
def test_bad_save(save):
    with pytest.raises(hpfun.SpecError, match="save="):
        hpfun.checkpoint(torch.sin, save=save)


def test_docstring_example():
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module("hpfun.checkpoint"))
    assert result.failed == 0 and result.attempted > 0


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.a, self.b = torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.b(F.dropout(F.gelu(self.a(self.ln(x))), 0.2, self.training))


def test_modules_with_backward_and_optimizer():
    """Checkpointed nn.Modules in the stock training step (loss.backward(), the optimizer's step,
    state lifted and written back), tensor parallel by state_specs: two steps, bitwise the step
    without checkpoints, dropout included; the second call reuses the first's program."""
    x = torch.randn(8, 8)
    results = {}
    for ck in (False, True):
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList([_Block() for _ in range(2)])
        opt = torch.optim.SGD(blocks.parameters(), lr=0.1)

        def step(x):
            for block in blocks:
                x = (hpfun.checkpoint(block) if ck else block)(x)  # noqa: B023 - ck is this loop's
            loss = x.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        f = hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P(),
                        state_specs={"*.a.weight": P("tp", None), "*.a.bias": P("tp"), "*.b.weight": P(None, "tp")})
        with hpfun.random_seed(1):
            losses = [f(x).full() for _ in range(2)]
        results[ck] = losses, [p.detach().clone() for p in blocks.parameters()], f.trace_count
    _assert_bitwise(results[True][:2], results[False][:2])
    assert results[True][2] == results[False][2] == 1


def test_torch_checkpoint_under_grad_points_here():
    """torch.utils.checkpoint cannot run under torch.func.grad (saved tensor hooks): the capture
    error says what to use instead."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def loss(w, x):
        return torch_checkpoint(torch.tanh, x @ w, use_reentrant=False).sum()

    f = hpfun.shard(lambda w, x: torch.func.grad(loss)(w, x), mesh=MESH, in_specs=(P(), P("dp")), out_specs=P())
    with pytest.raises(hpfun.CaptureError, match=r"use hpfun\.checkpoint\(block\)\(x\)"):
        f(torch.randn(4, 4), torch.randn(8, 4))


@pytest.mark.parametrize("reentrant", [False, True])
def test_torch_checkpoint_in_the_stock_step_redraws_the_forward_numbers(reentrant):
    """torch.utils.checkpoint in the stock training step (loss.backward()) traces its recompute
    into the backward; its recomputed dropout draws the forward's numbers again (as torch's
    preserve_rng_state does), so the gradients are bitwise those without checkpoints."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    x = torch.randn(8, 8)
    results = {}
    for ck in (False, True):
        torch.manual_seed(0)
        first, blocks = torch.nn.Linear(8, 8), torch.nn.ModuleList([_Block() for _ in range(2)])

        def step(x):
            h = first(x)  # requires grad: the reentrant checkpoint needs an input that does
            for block in blocks:
                h = torch_checkpoint(block, h, use_reentrant=reentrant) if ck else block(h)  # noqa: B023
            h.pow(2).mean().backward()
            grads = [p.grad.clone() for p in blocks.parameters()]
            blocks.zero_grad()
            first.zero_grad()
            return grads

        f = hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P())
        with hpfun.random_seed(1):
            results[ck] = _full(f(x))
        draws = [n.args[3] for n in f.lower(x).graph.nodes if n.target in (random._sample, random.sample)]
        assert len(draws) == (4 if ck else 2) and len(set(draws)) == 2
    _assert_bitwise(results[True], results[False])


def test_pins_inside_a_region():
    """hpfun.constrain inside a checkpointed block: the recompute is pinned as the forward is
    (its redistributions repeated), the step bitwise the one without checkpoints. (The sequence
    parallel GPT, every layer checkpointed, is too: measured bitwise, peak 1.10 -> 0.65 MB.)"""
    params, (x, y) = mlp_init(), mlp_data()

    def block(x, w1, b1):
        h = hpfun.constrain(torch.relu(x @ w1 + b1), P("dp", "tp"), grad=P("dp"))
        return torch.sin(hpfun.constrain(h, P("dp")))  # sin's backward reads the gathered value

    def step(p, x, y, ck):
        def loss(p):
            h = (hpfun.checkpoint(block) if ck else block)(x, p["w1"], p["b1"])
            return F.cross_entropy(h @ p["w2"] + p["b2"], y)

        return torch.func.grad_and_value(loss)(p)

    out, gathers = {}, {}
    for ck in (False, True):
        f = hpfun.shard(functools.partial(step, ck=ck), mesh=MESH, in_specs=(MEGATRON, P("dp"), P("dp")),
                        out_specs=(MEGATRON, P()))
        out[ck] = _full(f(params, x, y))
        gathers[ck] = sum(c.kind == "all_gather" for c in f.lower(params, x, y).collectives)
    _assert_bitwise(out[True], out[False])
    assert gathers[True] == gathers[False] + 1  # the forward's pinned gather, once more in the recompute


def test_a_checkpointed_block_composes_with_vmap_and_forward_mode():
    """Per-example gradients of a checkpointed block (vmap of grad), jvp and hessian equal
    eager's (the output marker has a vmap rule and a jvp)."""
    import torch.func as tf

    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    block = hpfun.checkpoint(lambda x, w: torch.tanh(x @ w))
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)
    cases = {
        "per-example grads": lambda w, x: tf.vmap(tf.grad(lambda w, xi: block(xi, w).pow(2).sum()), (None, 0))(w, x),
        "jvp": lambda w, x: tf.jvp(lambda w: block(x, w), (w,), (torch.ones_like(w),))[1],
        "hessian": lambda w, x: tf.hessian(lambda w: block(x, w).pow(2).sum())(w),
    }
    for name, f in cases.items():
        got = hpfun.shard(f, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())(w, x).full()
        torch.testing.assert_close(got, f(w, x), rtol=1e-10, atol=1e-12, msg=name)


def test_a_checkpointed_module_kept_in_a_global_is_lifted():
    """`ck = hpfun.checkpoint(block)` made once, outside the step, and called inside it: the
    module it wraps is the step's state (it was not walked: its weights were a tensor hpfun
    could not lift). Equal to the uncheckpointed step, gradients included."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).double()
    ck = hpfun.checkpoint(block)

    def step(x):
        loss = ck(x).pow(2).mean()
        loss.backward()
        return loss

    f = hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P())
    x = torch.randn(4, 8, dtype=torch.float64)
    loss = f(x).full()
    grads = [p.grad.clone() for p in block.parameters()]
    for p in block.parameters():
        p.grad = None
    torch.testing.assert_close(loss, step(x))
    for got, p in zip(grads, block.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad)
