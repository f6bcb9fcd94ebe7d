"""Reference models trained a few steps sharded on simulated meshes equal the unsharded steps,
with the collectives each layout needs."""

import functools
from collections import Counter

import pytest
import torch

import hpfun
from hpfun import P
from hpfun.testing.models import (
    CNN_CHANNEL_SPLIT, GPT, adamw_init, cnn_data, cnn_init, cnn_step, gpt_data, gpt_init, gpt_specs, gpt_step,
)

F32 = 4
B = 4
ACTIVATION = B * GPT["seq"] * GPT["d"] * F32  # one (batch, seq, d) float32 tensor


def _rel(a, b) -> float:
    """Norm-wise relative error (max-based error would amplify AdamW's division by tiny moments)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _gpt(shape, axes, specs, data_spec, seq_split=None, steps=1, dtype=torch.float32, tol=1e-5, solver="greedy",
         pins="all", **sizes):
    params, (idx, targets) = {k: v.to(dtype) for k, v in gpt_init(**sizes).items()}, gpt_data(B, **sizes)
    state_specs = {"m": specs, "v": specs, "step": P()}
    step = hpfun.shard(functools.partial(gpt_step, pins=pins), mesh=hpfun.Mesh.simulated(shape, axes),
                       in_specs=(specs, state_specs, data_spec, data_spec, None), out_specs=(specs, state_specs, P()),
                       solver=solver)
    ref_p, ref_s = params, adamw_init(params)
    ref_s["step"] = ref_s["step"].to(dtype)
    got_p, got_s = ref_p, ref_s
    for _ in range(steps):
        ref_p, ref_s, ref_loss = gpt_step(ref_p, ref_s, idx, targets)
        got_p, got_s, loss = step(got_p, got_s, idx, targets, seq_split)
        assert _rel(loss.full(), ref_loss) <= tol
    for k in params:
        assert _rel(got_p[k].full(), ref_p[k]) <= tol, k
    assert step.trace_count == 1  # later steps take Sharded state in the same layouts: one program
    return step.lower(got_p, got_s, idx, targets, seq_split).collectives, params


GPT_CASES = {
    "dp": ((2,), ("dp",), {}, P("dp")),
    "tp": ((2,), ("tp",), {"tp": "tp"}, P()),
    "vocab": ((2,), ("tp",), {"vocab": "tp"}, P()),
    "dp_tp_vocab": ((2, 2), ("dp", "tp"), {"tp": "tp", "vocab": "tp"}, P("dp")),
}


@pytest.mark.parametrize("name", GPT_CASES)
def test_gpt_three_adamw_steps_equal_unsharded(name):
    """Three AdamW steps of the GPT under each layout: the loss of each step and every parameter
    after the last within 1e-5 (float32)."""
    shape, axes, which, data = GPT_CASES[name]
    _gpt(shape, axes, gpt_specs(gpt_init(), **which), data, steps=3)


@pytest.mark.parametrize("name", ["tp", "dp_tp_vocab"])
def test_gpt_three_adamw_steps_equal_unsharded_in_float64(name):
    """In float64 the same three steps agree to 1e-10: what is left in float32 is rounding."""
    shape, axes, which, data = GPT_CASES[name]
    _gpt(shape, axes, gpt_specs(gpt_init(), **which), data, steps=3, dtype=torch.float64, tol=1e-10)


def test_gpt_data_parallel_all_reduces_each_gradient_once():
    """DP: one all-reduce per parameter gradient (its size), the label count and the loss; nothing else."""
    collectives, params = _gpt((2,), ("dp",), gpt_specs(gpt_init()), P("dp"), steps=1)
    got = Counter((c.kind, c.axes, c.bytes) for c in collectives)
    expected = Counter(("all_reduce", ("dp",), p.numel() * F32) for p in params.values())
    expected[("all_reduce", ("dp",), F32)] += 2  # cross-entropy's label count, and the loss
    assert got == expected


def test_gpt_tensor_parallel_is_megatron():
    """TP: exactly Megatron's collectives, two activation all-reduces per layer in the forward
    and two in the backward; the replicated parameters' gradients are computed whole from
    resolved values, so they need none."""
    collectives, _ = _gpt((2,), ("tp",), gpt_specs(gpt_init(), tp="tp"), P(), steps=1)
    assert Counter((c.kind, c.bytes) for c in collectives) == {("all_reduce", ACTIVATION): 4 * GPT["layers"]}


def test_gpt_vocab_parallel_embedding_and_loss_never_move_logits():
    """Vocab-split embedding table and tied head, the analytic minimum: the looked-up rows
    summed once; the loss's three per-row all-reduces (max, sum of exponentials, the softmax
    backward's row sum); the head's input gradient summed once (it is linear all the way back,
    so kept lazy it would reach every weight's gradient); the loss. The logits never move, and
    both halves of the tied table's gradient stay split."""
    params = gpt_init()
    collectives, _ = _gpt((2,), ("tp",), gpt_specs(params, vocab="tp"), P(), steps=1)
    rows = B * GPT["seq"] * F32
    assert [(c.kind, c.bytes) for c in collectives] == [
        ("all_reduce", ACTIVATION), ("all_reduce", rows), ("all_reduce", rows), ("all_reduce", rows),
        ("all_reduce", ACTIVATION), ("all_reduce", F32)]
    assert "is [P(sum)]" in collectives[0].reason  # the masked lookup's sum (with or after the positions')


@pytest.mark.parametrize("sizes", [{}, {"seq": 16, "d": 32, "layers": 3}], ids=["test-size", "3-layers-d32"])
def test_gpt_sequence_parallel_is_megatron_sp(sizes):
    """Sequence parallel (Megatron-SP), pinned as Megatron spells it and planned by the exact
    solver, equal to the unsharded steps: the residual stream split along the sequence, each
    block's row-parallel output reduce-scattered onto it and its gradient gathered whole. Per
    layer, four reduce-scatters of the activations (two each way) and four all-gathers of the
    split ones. The solver gathers each norm's input rather than its output (the norms then run
    on whole activations: their weights' gradients need no all-reduce, one collective fewer per
    norm than Megatron's schedule, which the alpha-beta model prefers at any size where a norm's
    work is cheap).

    At the test size that is all there is, besides the head's and the norms' backward gathers:
    4 per layer + 3 all-gathers, 4 per layer reduce-scatters. At the larger size (float64 there:
    float32 rounding, amplified by AdamW, passes 1e-5 in the unsharded run itself) the solver
    also keeps a few small collectives around the embedding, cheaper by the model; the per-layer
    schedule is the same."""
    cfg = GPT | sizes
    dtype, tol, item = (torch.float32, 1e-5, F32) if not sizes else (torch.float64, 1e-10, 8)
    params = gpt_init(**sizes)
    collectives, _ = _gpt((2,), ("tp",), gpt_specs(params, tp="tp"), P(), seq_split=P(None, "tp"), steps=3,
                          dtype=dtype, tol=tol, solver="exact", **sizes)
    layers, d, seq = cfg["layers"], cfg["d"], cfg["seq"]
    activation = B * seq * d * item
    found = Counter((c.kind, c.bytes) for c in collectives)
    assert found[("reduce_scatter", activation)] == 4 * layers
    assert found[("all_gather", activation // 2)] >= 4 * layers
    if not sizes:
        assert found == {("all_gather", activation // 2): 4 * layers + 3, ("reduce_scatter", activation): 4 * layers}


def test_gpt_sequence_parallel_from_the_embedding_pin_alone():
    """Only the embedding output pinned along the sequence: the exact solver gathers it once
    (and its gradient once) and runs Megatron TP from there, two all-reduces per layer each way.
    Sequence parallelism moves the same bytes as that (an all-gather and a reduce-scatter are
    one all-reduce) in twice the collectives, so by communication time it never wins: what it
    buys is activation memory, which this model does not price. The greedy walk alone moves
    about three times the bytes. Equal to the unsharded step (float64: see above)."""
    params = gpt_init()
    plans = {}
    for solver in ("greedy", "exact"):
        plans[solver], _ = _gpt((2,), ("tp",), gpt_specs(params, tp="tp"), P(), seq_split=P(None, "tp"),
                                dtype=torch.float64, tol=1e-10, solver=solver, pins="embedding")
    activation = B * GPT["seq"] * GPT["d"] * 8
    assert Counter((c.kind, c.bytes) for c in plans["exact"]) == {
        ("all_gather", activation // 2): 2, ("all_reduce", activation): 4 * GPT["layers"]}
    assert sum(c.bytes for c in plans["greedy"]) > 2 * sum(c.bytes for c in plans["exact"])


def test_gpt_data_tensor_vocab_parallel_is_the_sum_of_its_parts():
    """2-D dp x tp with Megatron TP and the vocab split: over tp, the TP and vocab collectives
    on half the batch; over dp, one all-reduce per parameter gradient (its shard) and the label
    count; the loss over both."""
    params = gpt_init()
    specs = gpt_specs(params, tp="tp", vocab="tp")
    collectives, _ = _gpt((2, 2), ("dp", "tp"), specs, P("dp"), steps=1)
    rows = B // 2 * GPT["seq"] * F32
    expected = Counter({("all_reduce", ("tp",), ACTIVATION // 2): 1 + 1 + 4 * GPT["layers"],  # lookup, head grad, blocks
                        ("all_reduce", ("tp",), rows): 3, ("all_reduce", ("dp", "tp"), F32): 1})
    expected += Counter(("all_reduce", ("dp",), p.numel() * F32 // (2 if "tp" in str(specs[k]) else 1))
                        for k, p in params.items())
    expected[("all_reduce", ("dp",), F32)] += 1  # the label count
    assert Counter((c.kind, c.axes, c.bytes) for c in collectives) == expected


# ---------------------------------------------------------------------------------------------
# CNN
# ---------------------------------------------------------------------------------------------


def _cnn(shape, axes, specs, data_spec):
    params, (x, y) = cnn_init(), cnn_data()
    step = hpfun.shard(cnn_step, mesh=hpfun.Mesh.simulated(shape, axes), in_specs=(specs, data_spec, data_spec),
                       out_specs=(specs, P()))
    ref_p, got_p = params, params
    for _ in range(2):
        ref_p, ref_loss = cnn_step(ref_p, x, y)
        got_p, loss = step(got_p, x, y)
        assert _rel(loss.full(), ref_loss) <= 1e-5
    for k in params:
        assert _rel(got_p[k].full(), ref_p[k]) <= 1e-5, k
    return step.lower(got_p, x, y).collectives, params


def test_cnn_data_parallel():
    """DP CNN (conv, group norm, max pool): one all-reduce per parameter, the count and the loss."""
    collectives, params = _cnn((2,), ("dp",), {k: P() for k in cnn_init()}, P("dp"))
    expected = Counter(("all_reduce", p.numel() * F32) for p in params.values()) + Counter({("all_reduce", F32): 2})
    assert Counter((c.kind, c.bytes) for c in collectives) == expected


def test_cnn_channel_split():
    """Channel-split weights: the second conv reads every input channel (one all-gather of the
    pooled activations), the classifier leaves partial logits (one all-reduce, before the softmax's
    max), and the backward reduce-scatters the pooled activations' gradient back to channel blocks."""
    collectives, _ = _cnn((2,), ("tp",), CNN_CHANNEL_SPLIT, P())
    pooled = 8 * 8 * 4 * 4 * F32 // 2  # (batch, channels / 2, 4, 4)
    assert [(c.kind, c.bytes) for c in collectives] == [
        ("all_gather", pooled), ("all_reduce", 8 * 10 * F32), ("reduce_scatter", 2 * pooled)]


def test_cnn_data_and_channel_parallel_2d():
    """DP x channel split on a 2x2 mesh: over tp, the channel split's three collectives on half
    the batch; over dp, one all-reduce per parameter gradient (its shard), the count and the loss."""
    collectives, params = _cnn((2, 2), ("dp", "tp"), CNN_CHANNEL_SPLIT, P("dp"))
    pooled = 8 // 2 * 8 * 4 * 4 * F32 // 2  # (batch / 2, channels / 2, 4, 4)
    expected = Counter({("all_gather", ("tp",), pooled): 1, ("all_reduce", ("tp",), 8 // 2 * 10 * F32): 1,
                        ("reduce_scatter", ("tp",), 2 * pooled): 1, ("all_reduce", ("dp",), F32): 2})
    expected += Counter(("all_reduce", ("dp",), p.numel() * F32 // (2 if "tp" in str(CNN_CHANNEL_SPLIT[k]) else 1))
                        for k, p in params.items())
    assert Counter((c.kind, c.axes, c.bytes) for c in collectives) == expected
