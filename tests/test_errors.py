"""Bad input raises clear errors before anything runs: what was wrong, where, and the fix."""

import random
import sys
import time
import types
import weakref

import numpy as np
import math

import pytest

import torch
import torch.nn.functional as F

import hpfun
from hpfun import P
from hpfun.testing.models import MEGATRON, mlp_data, mlp_init, mlp_step

MESH = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))


def _raise(fn, *args, error=hpfun.HpfunError):
    with pytest.raises(error) as info:
        fn(*args)
    assert not isinstance(info.value, (KeyError, AssertionError))
    return info.value, str(info.value)


def test_bad_specs_are_reported_together_with_their_paths():
    """Unknown axis, axis used twice, too many dims and an axis twice on one dim: one report, every path."""
    specs = ({"w1": P("xx"), "b1": P("dp", "dp"), "w2": P(None, None, "tp"), "b2": P()}, P("dp"), P(("tp", "dp", "tp")))
    err, text = _raise(hpfun.shard(mlp_step, mesh=MESH, in_specs=specs), mlp_init(), *mlp_data(), error=hpfun.SpecError)
    assert len(err.problems) == 5
    assert "args[0]['w1']" in text and "'xx'" in text and "['dp', 'tp']" in text
    assert "args[0]['b1']" in text and "twice" in text
    assert "args[0]['w2']" in text and "has 3 entries but the tensor has only 2 dims" in text
    assert "args[2]" in text and "mesh axis 'tp' twice" in text
    assert all(p.fix for p in err.problems)


def test_non_divisible_dim_names_path_dim_size_and_axes():
    """A dim that does not divide names the argument path, dim, size and the axis sizes."""
    mesh = hpfun.Mesh.simulated((3,), ("dp",))
    f = hpfun.shard(mlp_step, mesh=mesh, in_specs=(P(), P("dp"), P("dp")))
    err, text = _raise(f, mlp_init(), *mlp_data(), error=hpfun.SpecError)
    assert "args[1]: dim 0 of size 8 is not divisible by the mesh axes sharding it (dp=3)" in text
    assert "args[2]" in text and len(err.problems) == 2


def test_spec_tree_mismatch_and_bad_leaf():
    """Specs that are not a prefix of the arguments, or not P/None, are named by path."""
    f = hpfun.shard(mlp_step, mesh=MESH, in_specs=({"w3": P()}, P("dp"), P("dp")))
    _, text = _raise(f, mlp_init(), *mlp_data(), error=hpfun.SpecError)
    assert "args[0]['w3']: matches no name; closest: w1, w2" in text
    f = hpfun.shard(mlp_step, mesh=MESH, in_specs=(P(), "dp", P("dp")))
    _, text = _raise(f, mlp_init(), *mlp_data(), error=hpfun.SpecError)
    assert "args[1]" in text


def test_bad_out_specs():
    """out_specs naming an unknown axis are reported against the output."""
    f = hpfun.shard(lambda x: x * 2, mesh=MESH, in_specs=P("dp"), out_specs=P("zz"))
    _, text = _raise(f, torch.randn(8, 4), error=hpfun.SpecError)
    assert "outputs[0]" in text and "'zz'" in text


def test_all_missing_rules_in_one_report_with_source_lines():
    """Every op without a rule is listed once, with its input layouts and the user's line."""

    def uses_unknown(x):
        a = torch.special.airy_ai(x)
        b = torch.special.spherical_bessel_j0(x)
        return a + b

    f = hpfun.shard(uses_unknown, mesh=MESH, in_specs=P("dp"))
    err, text = _raise(f, torch.randn(8, 4), error=hpfun.MissingRuleError)
    assert len(err.problems) == 2
    assert "aten.special_airy_ai.default" in text and "aten.special_spherical_bessel_j0.default" in text
    assert "inputs [S(0), R]" in text
    assert "test_errors.py" in text and "a = torch.special.airy_ai(x)" in text


def test_a_problem_repeated_in_every_layer_is_listed_once_with_its_count():
    """A loop over layers hitting one missing rule reads as one entry, not one per layer; every
    problem stays in `.problems`, and a long list of distinct ones is cut short in the message."""

    def layers(x):
        for _ in range(5):
            x = torch.special.airy_ai(x)
        return x

    f = hpfun.shard(layers, mesh=MESH, in_specs=P("dp"))
    err, text = _raise(f, torch.randn(8, 4), error=hpfun.MissingRuleError)
    assert len(err.problems) == 5
    # the first takes the split input; the others, after it, a replicated one
    assert text.count("aten.special_airy_ai.default") == 2 and "inputs [R, R]), from" in text
    assert "(4 times)" in text
    many = hpfun.MissingRuleError([hpfun.errors.Problem(f"op{i}", "no rule") for i in range(50)])
    assert "op39: no rule" in str(many) and "op40:" not in str(many) and "and 10 more" in str(many)


def test_data_dependent_control_flow_is_a_capture_error():
    """Reading values computed in the program (here from a parameter) in Python control flow
    names the user's line and the fix."""
    w = torch.randn(4, requires_grad=True)

    def branchy(x):
        if (x * w).sum() > 0:
            return x
        return -x

    _, text = _raise(hpfun.shard(branchy, mesh=MESH, in_specs=P("dp")), torch.randn(8, 4), error=hpfun.CaptureError)
    assert "if (x * w).sum() > 0" in text and "torch.where" in text


def test_a_lazy_module_not_yet_initialized_is_named_with_the_fix():
    """LazyLinear makes its weight at its first forward: named, not torch's bare RuntimeError;
    initialized eagerly once, the same step runs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU())
    f = hpfun.shard(lambda x: model(x).sum(), mesh=MESH, in_specs=P("dp"), out_specs=P())
    x = torch.randn(8, 4)
    _, text = _raise(f, x, error=hpfun.CaptureError)
    assert "model.0.weight: is not initialized yet (LazyLinear" in text and "run the model once eagerly" in text
    model(x)
    torch.testing.assert_close(f(x).full(), model(x).sum())


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_torchscript_module_is_named_with_the_fix():
    """A scripted submodule runs its compiled graph on its own parameters: named, not a TypeError."""
    model = torch.nn.Sequential(torch.jit.script(torch.nn.Linear(4, 4)), torch.nn.ReLU())
    f = hpfun.shard(lambda x: model(x).sum(), mesh=MESH, in_specs=P("dp"), out_specs=P())
    _, text = _raise(f, torch.randn(8, 4), error=hpfun.CaptureError)
    assert "model.0: is a TorchScript module" in text and "shard the nn.Module it was scripted from" in text


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_pattern_for_state_the_step_makes_at_its_first_call_says_when_it_has_a_name():
    """A state_specs pattern for a tensor the step itself puts in a dict at its first call matches
    nothing at that call: the error says so and how to name it (it spoke of optimizers only)."""
    model, mom = torch.nn.Linear(4, 4), {}

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * mom.setdefault(p, torch.zeros_like(p)).mul_(0.9).add_(p.grad))
                p.grad = None
        return loss

    f = hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P(), state_specs={"mom.*": P()})
    _, text = _raise(f, torch.randn(8, 4), error=hpfun.SpecError)
    assert "has no name before that call: make it before the first call to give it a spec" in text, text


def test_a_torchscript_function_that_fails_in_the_trace_is_named_with_the_fix():
    """A @torch.jit.script helper reading a value (`int(grid[0])`, as torchkbnufft's does) fails in
    TorchScript's interpreter, which the trace cannot enter: the error says so and names
    PYTORCH_JIT=0 (it gave TorchScript's bare 'operation failed')."""
    def pad_to(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, [0, int(grid[0]) - x.shape[-1]])

    scripted = torch.jit.script(pad_to)
    grid = torch.tensor([12])
    f = hpfun.shard(lambda x: scripted(x, grid).sum(), mesh=MESH, in_specs=P("dp"), out_specs=P())
    _, text = _raise(f, torch.randn(8, 4), error=hpfun.CaptureError)
    assert "@torch.jit.script function" in text and "PYTORCH_JIT=0" in text, text


def test_data_dependent_shape_is_a_capture_error():
    """Ops whose output shape depends on data hpfun cannot read (a mask of computed values, as
    loss code writes it) fail at capture with the user's line and the shape-keeping rewrite."""
    w = torch.randn(4, 4, requires_grad=True)
    f = hpfun.shard(lambda x: torch.nonzero(x @ w), mesh=MESH, in_specs=P("dp"))
    _, text = _raise(f, torch.randn(8, 4), error=hpfun.CaptureError)
    assert "nonzero" in text

    def masked_loss(logits, labels):
        keep = (logits @ w).argmax(-1) != labels  # (of a parameter's product: not read)
        return torch.nn.functional.cross_entropy(logits[keep], labels[keep])

    f = hpfun.shard(masked_loss, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P())
    _, text = _raise(f, torch.randn(8, 4), torch.tensor([1, 0, 2, 3, 0, 0, 1, 2]), error=hpfun.CaptureError)
    assert "logits[keep]" in text and "ignore_index=-100" in text


def test_repeat_interleave_by_counts_of_constants_or_inputs_is_read():
    """torch.repeat_interleave with a tensor of counts made from constants or from the arguments
    (a shape made from values) is read like a mask: traced for the positions it repeats, checked
    at every call, compiled again for other counts; its gradient flows back to the repeated
    values. Equal to eager."""
    x = torch.randn(4, 4, dtype=torch.float64)

    def by_argument(x, counts):
        return torch.func.grad(lambda x: (torch.repeat_interleave(x, counts, dim=0) ** 2).sum())(x)

    f = hpfun.shard(by_argument, mesh=MESH, in_specs=(P(None, "dp"), P()), out_specs=P(None, "dp"))
    for counts in (torch.tensor([1, 0, 2, 1]), torch.tensor([1, 0, 2, 1]), torch.tensor([3, 1, 0, 0])):
        torch.testing.assert_close(f(x, counts).full(), by_argument(x, counts))
    assert f.trace_count == 2
    flat = hpfun.shard(lambda x: torch.repeat_interleave(x, torch.tensor([2, 1, 0, 1]).repeat(4)), mesh=MESH,
                       in_specs=P("dp"), out_specs=P())  # (no dim: over the flattened values)
    torch.testing.assert_close(flat(x).full(), torch.repeat_interleave(x, torch.tensor([2, 1, 0, 1]).repeat(4)))
    # the one-argument form, `repeat_interleave(counts)` (torchani's neighbour lists): was refused as a value of the
    # parameters or random draws
    alone = hpfun.shard(lambda c: (torch.repeat_interleave(c), torch.repeat_interleave(c * 1)), mesh=MESH, in_specs=P(),
                        out_specs=P())
    for counts in (torch.tensor([1, 0, 2, 3]), torch.tensor([0, 4, 1])):
        assert [t.full().tolist() for t in alone(counts)] == [torch.repeat_interleave(counts).tolist()] * 2


def test_a_read_through_one_output_of_a_multi_output_op_is_read():
    """`int(ids.max(0).values.max())`, `torch.sort(ids).values[-1]`, `ids.topk(1).indices`: a read
    of the arguments' values through one output of an op that makes several (it was refused),
    checked at every call, compiled again where the answer changes; equal to eager."""
    def picked(x, ids):
        n = int(ids.max(0).values.max())
        return x[:n + 1].sum() + int(torch.sort(ids).values[-1]) + int(ids.topk(1).indices[0])

    x = torch.randn(8, 4, dtype=torch.float64)
    f = hpfun.shard(picked, mesh=MESH, in_specs=(P(None, "dp"), P()), out_specs=P())
    for ids in ([1, 5, 2, 3], [1, 5, 2, 3], [3, 1, 0, 2]):
        torch.testing.assert_close(f(x, torch.tensor(ids)).full(), picked(x, torch.tensor(ids)))
    assert f.trace_count == 2


def test_routing_counts_and_positions_of_the_inputs_are_read():
    """Token routing by the inputs' values (hash routing by token id): the counts of bincount
    feed repeat_interleave and split, and torch.where(mask) gives the positions, as nonzero
    does; each read like a mask, equal to eager (they were refused)."""
    x = torch.randn(8, 4, dtype=torch.float64)
    ids = torch.tensor([2, 0, 1, 2, 2, 0, 3, 1])

    def routed(x, ids):
        counts = torch.bincount(ids, minlength=4)
        order = ids.argsort(stable=True)
        per_expert = torch.stack([c.sum(0) for c in torch.split(x[order], counts.tolist())])
        return per_expert, torch.repeat_interleave(torch.arange(4), counts), x[torch.where(ids == 2)[0]]

    f = hpfun.shard(routed, mesh=MESH, in_specs=(P(None, "tp"), P()), out_specs=P())
    for got, want in zip(f(x, ids), routed(x, ids), strict=True):
        torch.testing.assert_close(got.full(), want)


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_masked_select_of_a_readable_mask_is_read_like_an_index_by_it(spec):
    """`torch.masked_select(x, mask)` (the mask broadcast to x) reads the mask's True positions
    as `x[mask]` does, where the mask is the arguments' own (it was refused, its message saying
    x[mask] could not be traced either)."""
    def picked(x, mask):
        return torch.masked_select(x, mask) * 2, x.masked_select(mask[0]).sum()

    x = torch.randn(8, 4, dtype=torch.float64)
    mask = torch.rand(8, 4, generator=torch.Generator().manual_seed(0)) > 0.5
    f = hpfun.shard(picked, mesh=MESH, in_specs=(spec, P()), out_specs=P())
    for got, want in zip(f(x, mask), picked(x, mask), strict=True):
        torch.testing.assert_close(got.full(), want)


def test_torch_func_linearize_under_grad_is_refused_at_its_line_with_jvp_as_the_fix():
    """linearize traces with a make_fx of its own: under torch.func.grad inside hpfun's trace it
    kept fake tensors as constants (an internal error, or outputs whose blocks were fake
    tensors). On its own it runs as written."""
    def under_grad(x):
        return torch.func.grad(lambda x: torch.func.linearize(torch.sin, x)[1](x).sum())(x)

    def alone(x):
        return torch.func.linearize(torch.sin, x)[1](x * 2)

    with pytest.raises(hpfun.CaptureError, match=r"(?s)torch.func.linearize at .*return torch.func.grad.*"
                                                 r"fix: call torch.func.jvp"):
        hpfun.shard(under_grad, mesh=MESH, in_specs=(P("dp"),), out_specs=P())(torch.randn(4, 2))
    x = torch.randn(4, 2, dtype=torch.float64)
    torch.testing.assert_close(hpfun.shard(alone, mesh=MESH, in_specs=(P("dp"),), out_specs=P())(x).full(), alone(x))


@pytest.mark.parametrize("inference", [False, True], ids=["", "inference_mode"])
def test_a_readable_mask_written_in_place_before_it_indexes_is_read_as_written(inference):
    """SmolVLM's `real[0] |= ~torch.any(real)` on a mask made from the argument, then `x[real]`:
    the mask is read as the writes left it (it was refused as a shape read from the data), and
    another argument at the next call gives its own positions. Under torch.inference_mode too,
    whose tensors keep no count of writes (reading it raised torch's "Inference tensors do not
    track version counter")."""
    def picked(x):
        with torch.inference_mode(inference):
            real = (x == 0.0).sum(-1) != x.shape[-1]
            head = real[:1]  # (a view the write below changes)
            real[0] |= ~torch.any(real)
            real |= real.roll(1)
            return x[real].sum(0) * (2.0 if head.all() else 1.0)

    f = hpfun.shard(picked, mesh=MESH, in_specs=(P("dp"),), out_specs=P())
    for rows in ([2], [0, 1, 2, 3, 4, 5, 6, 7], [1, 5]):
        x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(len(rows)))
        x[rows] = 0
        torch.testing.assert_close(f(x).full(), picked(x))


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_equal_and_allclose_of_the_arguments_are_read_as_bool_is(spec):
    """`torch.equal(y, prev)` and `torch.allclose(y, ones)` of the arguments (torchmetrics'
    checks, a cached-mask test) answer as eager does, read like `bool((y == prev).all())`:
    one program per answer, checked at every call (torch's kernel reads values no trace can,
    and was refused). Of a random draw (which nothing reads) the read is still refused."""
    def picked(x, y):
        if torch.equal(y, torch.zeros_like(y)) or y.equal(x[:0].new_zeros(2)):
            return x.sum() * 0
        if torch.allclose(y, torch.ones_like(y), atol=1e-3) and y.allclose(y + 1e-9):
            return x.sum() * 2
        return x.sum()

    x = torch.randn(8, 4, dtype=torch.float64)
    f = hpfun.shard(picked, mesh=MESH, in_specs=(spec, P()), out_specs=P())
    answers = (torch.zeros(4), torch.ones(4) + 1e-4, torch.randn(4), torch.zeros(4))
    for y in (a.double() for a in answers):
        torch.testing.assert_close(f(x, y).full(), picked(x, y))
    assert f.trace_count == 3

    drawn = hpfun.shard(lambda x: x * torch.equal(torch.rand(4), torch.rand(4)), mesh=MESH, in_specs=(spec,),
                        out_specs=spec)
    _raise(drawn, torch.randn(8, 4), error=hpfun.CaptureError)


def test_a_read_of_the_arguments_inside_torch_func_grad_is_read_as_outside_it():
    """`if (x > 0).any()` and `torch.equal` inside torch.func.grad read the arguments' values as
    they do outside it (they were refused: the tensor grad wraps was not taken for the trace's);
    one program per answer. Inside vmap (a value per batch element) the read stays refused, as
    eager refuses it."""
    def stepped(x):
        def loss(x):
            if (x > 0).any() and not torch.equal(x, torch.zeros_like(x)):
                return (x * 2).pow(2).sum()
            return x.sum()
        return torch.func.grad(loss)(x)

    f = hpfun.shard(stepped, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))
    for x in (torch.randn(8, 4, dtype=torch.float64), -torch.ones(8, 4, dtype=torch.float64)):
        torch.testing.assert_close(f(x).full(), stepped(x))
    assert f.trace_count == 2
    batched = hpfun.shard(lambda x: torch.vmap(lambda r: r * 2 if (r > 0).any() else r)(x), mesh=MESH,
                          in_specs=(P("dp"),), out_specs=P("dp"))
    _raise(batched, torch.randn(8, 4), error=hpfun.CaptureError)
    masked = hpfun.shard(lambda x: torch.vmap(lambda r: r[r > 0].sum())(x), mesh=MESH, in_specs=(P("dp"),),
                         out_specs=P("dp"))  # (the whole batch's mask was read, and indexed one row: IndexError)
    _, text = _raise(masked, torch.randn(8, 4), error=hpfun.CaptureError)
    assert "Attempting to batch over indexing with a boolean mask" in text, text


MASKED_WRITES = {  # x[mask] = value, the value the same for every element the mask selects
    "0-d condition": lambda o, y: o.__setitem__(y.sum() > 0, 5.0),  # torchmetrics' `out[cond] = 0.0`
    "elementwise": lambda o, y: o.__setitem__(o > 0, 0.0),
    "rows, a number": lambda o, y: o.__setitem__(o[:, 0] > y[0], 2),
    "rows, a row": lambda o, y: o.__setitem__(o[:, 0] > 0, y),
    "rows, one row": lambda o, y: o.__setitem__(o[:, 0] > 0, y[None]),
    "rows, a 0-d tensor": lambda o, y: o.__setitem__(o[:, 0] > 0, y.sum()),
    "through a view": lambda o, y: o[:, 1:].__setitem__(o[:, 1] > 0, y[1:]),
}


@pytest.mark.parametrize("spec", [P(), P("dp"), P(None, "dp")], ids=str)
@pytest.mark.parametrize("name", sorted(MASKED_WRITES))
def test_a_write_through_a_mask_of_computed_values_is_one_program(name, spec):
    """`x[mask] = value` with a mask the program computes (nothing can read it) and a value that
    does not depend on how many elements it selects: written as masked_fill / where, one
    program for every mask, equal to eager forward and gradient (it was refused as a read)."""
    def written(x, y):
        o = x * 1
        MASKED_WRITES[name](o, y)
        return o

    def loss(x, y):
        return (written(x, y) ** 2).sum()

    f = hpfun.shard(written, mesh=MESH, in_specs=(spec, P()), out_specs=spec)
    g = hpfun.shard(torch.func.grad(loss, argnums=(0, 1)), mesh=MESH, in_specs=(spec, P()), out_specs=(spec, P()))
    for seed in range(3):
        x, y = torch.randn(8, 4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).unbind(-1)
        torch.testing.assert_close(f(x, y[0]).full(), written(x, y[0]), rtol=0, atol=0)
        for got, want in zip(g(x, y[0]), torch.func.grad(loss, argnums=(0, 1))(x, y[0]), strict=True):
            torch.testing.assert_close(got.full(), want)
    assert f.trace_count == 1 and g.trace_count == 1


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_a_write_by_a_mask_of_the_arguments_is_read_as_the_index_is_under_grad_too(spec):
    """`y[y > 0] += 1` (an index, an add, and a write back of as many values as the mask picks)
    with a mask of the arguments' values: the write is read by positions as its index is, also
    inside torch.func.grad (where the write was refused as a read of values)."""
    def f(x):
        y = x.clone()
        y[y > 0] += 1.0
        y[y < -1] = y[y < -1] * 2
        return (y * y).sum()

    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hpfun.shard(f, mesh=MESH, in_specs=(spec,), out_specs=P())(x).full(), f(x))
    g = hpfun.shard(torch.func.grad(f), mesh=MESH, in_specs=(spec,), out_specs=spec)
    torch.testing.assert_close(g(x).full(), torch.func.grad(f)(x))


@pytest.mark.parametrize("write", ["mask", "index", "index_put", "columns"])
def test_a_written_value_that_does_not_broadcast_to_what_an_index_picks_raises_as_eager(write):
    """`x[index] = v` with integer index tensors (or a readable mask, read as positions), v of a
    shape eager refuses ((3,) into rows of 6): raised as eager does. torch's fake kernel does not
    check, and with the rows split each rank broadcast v over its own block of 3, silently."""
    def f(x, v):
        y = x.clone()
        if write == "mask":
            y[y[:, 0] > 0] = v
        elif write == "index":
            y[torch.tensor([0])] = v
        elif write == "index_put":
            y.index_put_((torch.tensor([0]),), v)
        else:
            y[:, torch.tensor([0, 2])] = v
        return y

    x, v = torch.tensor([[1.0, 2, 3, 4, 5, 6], [-1, 2, 3, 4, 5, 6]]), torch.tensor([7.0, 8, 9])
    with pytest.raises(RuntimeError, match="shape mismatch"):
        f(x, v)
    g = hpfun.shard(f, mesh=MESH, in_specs=(P(None, "dp"), P()), out_specs=P(None, "dp"))
    with pytest.raises(hpfun.CaptureError, match=r"value tensor of shape \[3\] cannot be broadcast to indexing "
                                                 r"result of shape \[(1, 6|2, 2)\]"):
        g(x, v)
    fits = hpfun.shard(lambda x: f(x, torch.tensor([7.0])), mesh=MESH, in_specs=P(None, "dp"), out_specs=P(None, "dp"))
    torch.testing.assert_close(fits(x).full(), f(x, torch.tensor([7.0])))  # (one value broadcasts: as eager)


@pytest.mark.parametrize("write", ["index_put keywords", "aten.index_put", "index_add", "index_add_ keywords",
                                   "put"])
def test_index_writes_of_a_source_of_another_shape_raise_as_eager_however_called(write):
    """index_put with keywords or through torch.ops, index_add (in or out of place) and put of a
    source of a shape eager refuses: raised as eager does. torch's fake kernels check only part
    (index_add the source's length along dim), and with the columns split each rank wrote its
    block of a source of another shape, silently."""
    rows = torch.tensor([0, 1])
    f = {"index_put keywords": lambda x, v: x.clone().index_put_(indices=(rows,), values=v),
         "aten.index_put": lambda x, v: torch.ops.aten.index_put(x, [rows], v),
         "index_add": lambda x, v: torch.index_add(x, 0, rows, v),
         "index_add_ keywords": lambda x, v: x.clone().index_add_(dim=0, index=rows, source=v),
         "put": lambda x, v: x.put(rows, v)}[write]
    x = torch.tensor([[1.0, 2, 3, 4, 5, 6], [-1, 2, 3, 4, 5, 6]])
    bad, good = {"index_put keywords": ((3,), (6,)), "aten.index_put": ((3,), (1,)), "index_add": ((2, 3), (2, 6)),
                 "index_add_ keywords": ((2, 3), (2, 6)), "put": ((3,), None)}[write]
    with pytest.raises((RuntimeError, IndexError)):
        f(x, torch.ones(bad))
    g = hpfun.shard(f, mesh=MESH, in_specs=(P(None, "dp"), P()), out_specs=P(None, "dp"))
    with pytest.raises(hpfun.CaptureError, match=r"shape mismatch|does not match self|source has 3 elements"):
        g(x, torch.ones(bad))
    if good is not None:  # (a source of the right shape runs, as eager)
        v = torch.arange(float(math.prod(good))).reshape(good)
        torch.testing.assert_close(g(x, v).full(), f(x, v))


def test_a_mask_of_the_inputs_is_read_and_a_changing_one_warns_with_the_fix():
    """A boolean mask, nonzero or unique of the arguments' values (BART's `torch.unique_consecutive(
    eos_mask.sum(1))` check and `hidden_states[eos_mask, :]`) is read like `.item()`: the program
    is traced for its True positions, a call with the same ones runs it, another compiles again,
    and the third compile warns with the shape-keeping rewrite."""
    def masked_loss(logits, labels):
        keep = labels != -100
        if torch.unique_consecutive(keep.sum(-1)).numel() > 8:
            raise ValueError("never")
        return torch.nn.functional.cross_entropy(logits[keep], labels[keep])

    f = hpfun.shard(masked_loss, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P())
    logits = torch.randn(8, 4)
    labels = [torch.tensor([1, -100, 2, 3, -100, 0, 1, 2]).roll(k) for k in range(4)]
    for y in (labels[0], labels[0].clone()):
        torch.testing.assert_close(f(logits, y).full(), masked_loss(logits, y))
    assert f.trace_count == 1
    with pytest.warns(hpfun.RetraceWarning, match="ignore_index=-100"):
        for y in labels[1:]:
            torch.testing.assert_close(f(logits, y).full(), masked_loss(logits, y))
    assert f.trace_count == 4

    def ctc(x):  # torch's CTC kernel sizes its work from the lengths' values: said plainly
        return torch.nn.functional.ctc_loss(x.log_softmax(-1).transpose(0, 1), torch.ones(8, 2, dtype=torch.long),
                                            torch.full((8,), 4), torch.full((8,), 2))

    f = hpfun.shard(ctc, mesh=MESH, in_specs=(P("dp"),), out_specs=P())
    _, text = _raise(f, torch.randn(8, 4, 5), error=hpfun.CaptureError)
    assert "CTC loss kernel sizes its work" in text and "cannot be sharded" in text

    def packed(x, lengths):  # a packed sequence is laid out by the lengths' values
        return torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False).data.sum()

    f = hpfun.shard(packed, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P())
    _, text = _raise(f, torch.randn(8, 6, 4), torch.tensor([6, 3, 5, 2, 1, 6, 4, 2]), error=hpfun.CaptureError)
    assert "run the RNN on the padded batch" in text


def test_grad_scaler_is_named_with_the_fix():
    """torch.amp.GradScaler's step branches on whether a gradient overflowed: the error says so
    and what to do instead."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step(x):
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    _, text = _raise(hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P()), torch.randn(8, 4),
                     error=hpfun.CaptureError)
    assert "scaler.step(opt)" in text and "GradScaler skips the optimizer's step" in text and "bfloat16" in text
    # the refused trace left the scaler as it was: the fix, stepping it eagerly, runs
    assert scaler._scale is None and not scaler._per_optimizer_states
    x = torch.randn(8, 4)
    scaler.scale(model(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()


def test_a_grad_scaler_scaling_the_loss_inside_names_the_form_that_works():
    """`scaler.scale(loss).backward()` inside, the scaler stepped outside (PyTorch's AMP recipe
    split at the call): the scaler's own scale tensor cannot be lifted, and the error gives the
    form that works, a scale passed as an argument; that form matches eager, inf steps skipped."""
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler, ref_scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    inside = hpfun.shard(lambda x: scaler.scale(model(x).square().mean()).backward(), mesh=MESH, in_specs=P("dp"))
    for _ in range(2):  # the scale made lazily by the trace, then the scale made before
        _, text = _raise(inside, torch.randn(8, 4), error=hpfun.CaptureError)
        assert "scaler._scale" in text and "`scale = scaler.scale(torch.ones(()))` before the call" in text
        scaler.scale(torch.ones(()))

    @hpfun.shard(mesh=MESH, in_specs=(P("dp"), P()), out_specs=P())
    def forward_backward(x, scale):
        loss = model(x).square().mean()
        (loss * scale).backward()
        return loss

    for i in range(3):
        x = torch.randn(8, 4)
        x[0, 0] = float("inf") if i == 1 else x[0, 0]  # an overflowing step: skipped, the scale halved
        forward_backward(x, scaler.scale(torch.ones(())))
        scaler.step(opt), scaler.update(), opt.zero_grad()
        ref_scaler.scale(ref(x).square().mean()).backward()
        ref_scaler.step(ref_opt), ref_scaler.update(), ref_opt.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_an_optimizer_that_reads_values_is_named_and_its_fix_works():
    """LBFGS decides in Python (from the loss and gradient norms) how far to search and when to
    stop: stepped inside the sharded function, the error names it and says to step it outside,
    with the sharded forward and backward as its closure; that fix equals eager."""
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = (torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4) for m in (model, ref))
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def fwd_bwd(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    def inside(x, y):
        return opt.step(lambda: (opt.zero_grad(), fwd_bwd(x, y))[1])

    _, text = _raise(hpfun.shard(inside, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P()), x, y,
                     error=hpfun.CaptureError)
    assert "LBFGS.step() reads tensor values into Python" in text and "outside the sharded function" in text
    assert "opt.step(lambda: (opt.zero_grad(), fwd_bwd(x, y).full())[1])" in text
    sharded = hpfun.shard(fwd_bwd, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P())

    def ref_closure():
        ref_opt.zero_grad()
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        return loss

    for _ in range(2):
        got = opt.step(lambda: (opt.zero_grad(), sharded(x, y).full())[1])
        want = ref_opt.step(ref_closure)
        assert abs(got.item() - want.detach().item()) < 1e-6
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(model.parameters(), ref.parameters()))
    assert sharded.trace_count == 1


def test_sparse_gradients_and_distribution_checks_are_named_with_the_fix():
    """Sparse embedding gradients, SparseAdam and torch.distributions' checks of their
    parameters each fail with what hpfun cannot do and what to write instead (F.gaussian_nll_loss's
    check of its variance runs: tests/test_rules_more.py)."""
    emb = torch.nn.Embedding(16, 4, sparse=True)
    sgd = torch.optim.SGD(emb.parameters(), lr=0.1)
    ids = torch.randint(0, 16, (8,))

    def sparse_step(i):
        loss = emb(i).square().mean()
        loss.backward()
        sgd.step()
        sgd.zero_grad()
        return loss

    _, text = _raise(hpfun.shard(sparse_step, mesh=MESH, in_specs=P("dp"), out_specs=P()), ids,
                     error=hpfun.CaptureError)
    assert "sparse=False" in text and "only available for these backends" not in text
    adam = torch.optim.SparseAdam(emb.parameters())

    def sparse_adam_step(i):
        emb(i).square().mean().backward()
        adam.step()

    _, text = _raise(hpfun.shard(sparse_adam_step, mesh=MESH, in_specs=P("dp"), out_specs=P()), ids,
                     error=hpfun.CaptureError)
    assert "adam: is a SparseAdam" in text and "torch.optim.Adam" in text
    x = torch.randn(8, 4)
    head = torch.nn.Linear(4, 2)  # a distribution checks its parameters' values, here made by a parameter
    # (validate_args given: torch.compile, once used in a process, turns the default off)
    _, text = _raise(hpfun.shard(lambda x: torch.distributions.Normal(head(x), 1.0, validate_args=True)
                                 .log_prob(x[:, :2]).mean(),
                                 mesh=MESH, in_specs=P("dp"), out_specs=P()), x, error=hpfun.CaptureError)
    assert "validate_args=False" in text
    # (ContinuousBernoulli checks probs whenever validate_args is given, False too: the fix leaves it out)
    _, text = _raise(hpfun.shard(lambda x: torch.distributions.ContinuousBernoulli(
        probs=torch.sigmoid(head(x)), validate_args=False).log_prob(torch.full_like(x[:, :2], 0.3)).mean(),
        mesh=MESH, in_specs=P("dp"), out_specs=P()), x, error=hpfun.CaptureError)
    assert "leave validate_args out" in text


def test_sharded_input_on_another_mesh():
    """A Sharded argument must live on the function's mesh."""
    other = hpfun.Mesh.simulated((2,), ("dp",))
    x = hpfun.Sharded.from_global(torch.randn(8, 4), P("dp").to_layout(other, 2))
    _, text = _raise(hpfun.shard(lambda x: x, mesh=MESH, in_specs=P("dp")), x, error=hpfun.SpecError)
    assert "{dp: 2}" in text


def test_bad_mesh_argument():
    """shard() wants an hpfun.Mesh."""
    _raise(lambda: hpfun.shard(lambda x: x, mesh=(2, 2), in_specs=P()), error=hpfun.SpecError)


def test_megatron_specs_on_a_mesh_without_tp():
    """Specs naming an axis the mesh lacks are caught before tracing."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    f = hpfun.shard(mlp_step, mesh=mesh, in_specs=(MEGATRON, P("dp"), P("dp")))
    err, _ = _raise(f, mlp_init(), *mlp_data(), error=hpfun.SpecError)
    assert len(err.problems) == 3  # w1, b1, w2 name tp


def test_capture_records_the_run_device_in_created_tensors():
    """Tensors the function creates are made on the device the program runs on (checked on a
    fake CUDA trace: no GPU needed), and on the CPU for CPU inputs."""
    from hpfun.capture import capture

    def f(x):  # cross-entropy's decomposition creates scalar tensors of its own
        labels = torch.zeros(4, dtype=torch.int64, device=x.device)
        return [torch.nn.functional.cross_entropy(x + torch.rand(4, 3, device=x.device), labels)]

    for device in ("cpu", "cuda"):
        gm = capture(f, [((4, 3), torch.float32)], torch.device(device))
        devices = {n.kwargs["device"].type for n in gm.graph.nodes if "device" in n.kwargs}
        assert devices == {device}


def test_an_op_returning_a_list_inside_a_tuple_without_a_rule_is_named():
    """torch._amp_foreach_non_finite_check_and_unscale_ returns (list of tensors, tensor): with
    no rule it is named in the missing-rules report (it crashed propagation with a TypeError),
    and fallback="replicate" runs it, equal to eager."""
    def check(x):
        found = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_([x], found, torch.ones(()))
        return x * 2, found

    x = torch.randn(4, 4)
    x[0, 0] = float("inf")
    _, text = _raise(hpfun.shard(check, mesh=MESH, in_specs=(P("dp"),), out_specs=(P("dp"), P())), x,
                     error=hpfun.MissingRuleError)
    assert "aten._amp_foreach_non_finite_check_and_unscale.default: no sharding rule" in text, text
    with pytest.warns(UserWarning):
        got = hpfun.shard(check, mesh=MESH, in_specs=(P("dp"),), out_specs=(P("dp"), P()), fallback="replicate")(x)
    want = check(x.clone())
    torch.testing.assert_close(got[0].full(), want[0])
    assert got[1].full().item() == want[1].item() == 1.0


def test_a_failure_inside_hpfun_is_an_internal_error_with_its_cause(monkeypatch):
    """An exception no stage meant to raise (here a KeyError planted in folding) is not passed
    on bare: it is an InternalError naming the function, the stage and the original error,
    which stays the cause."""
    import hpfun.api

    def broken(gm):
        raise KeyError("planted")

    monkeypatch.setattr(hpfun.api, "fold_contractions", broken)
    err, text = _raise(hpfun.shard(lambda x: x.sum(), mesh=MESH, in_specs=P("dp"), out_specs=P()), torch.randn(8, 4),
                       error=hpfun.InternalError)
    assert "KeyError while planning the layouts: 'planted'" in text and "bug in hpfun" in text and "<lambda>" in text
    assert isinstance(err.__cause__, KeyError)


def test_a_random_op_given_its_own_generator_is_refused_with_the_fix():
    """torch.rand(..., generator=g) inside a sharded function: the program draws hpfun's random
    numbers, not g's, so it is refused (it failed inside hpfun before), naming the line."""
    g = torch.Generator().manual_seed(0)
    f = hpfun.shard(lambda x: x + torch.rand(4, generator=g), mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    _, text = _raise(f, torch.randn(4), error=hpfun.CaptureError)
    assert "rand at" in text and "test_errors.py" in text and "its own torch.Generator" in text
    assert "hpfun.random_seed" in text
    assert torch.equal(hpfun.shard(lambda x: x + 0 * torch.rand(4), mesh=MESH, in_specs=P("dp"),
                                   out_specs=P("dp"))(torch.ones(4)).full(), torch.ones(4))  # without one: fine


def test_logging_a_traced_value_says_what_to_do():
    """`return loss.item()` and `f"{loss:.3f}"` read a value the program computes: refused,
    with the fix (return the tensor, read it after the call). A print: see test_front_door."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    w = torch.ones(4, requires_grad=True)  # (values made from the arguments alone are read: see test_modules)
    for logged in (lambda x: (x * w).sum().item(), lambda x: f"{(x * w).sum():.3f}"):
        _, text = _raise(hpfun.shard(logged, mesh=mesh, in_specs=P("dp"), out_specs=P()), torch.ones(4),
                         error=hpfun.CaptureError)
        assert "return the tensor" in text and ".full().item()" in text


def test_a_data_loader_iterated_inside_names_the_loop_outside():
    """A DataLoader iterated inside the sharded function reads its indices from tensors: refused,
    with the loop outside as the fix."""
    from torch.utils.data import DataLoader, TensorDataset

    lin = torch.nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4, shuffle=True)

    def epoch():
        return sum(lin(x).square().mean() for (x,) in loader)

    _, text = _raise(hpfun.shard(epoch, mesh=MESH, in_specs=(), out_specs=P()), error=hpfun.CaptureError)
    assert "iterate the loader outside and pass each batch" in text


def test_python_random_numbers_drawn_inside_are_refused():
    """`if random.random() < 0.5: x = x.flip(-1)` would be decided once, at the trace, and the
    program apply it always or never: Python's and NumPy's draws in the user's code are refused,
    naming the line and the torch spelling."""
    import random

    np = pytest.importorskip("numpy")

    def augmented(x):
        return x.flip(-1) if random.random() < 0.5 else x

    def scaled(x):
        return x * float(np.random.rand())

    for f, name in ((augmented, "random.random"), (scaled, "numpy.random.rand")):
        _, text = _raise(hpfun.shard(f, mesh=MESH, in_specs=P("dp"), out_specs=P("dp")), torch.randn(8, 4),
                         error=hpfun.CaptureError)
        assert f"{name} at " in text and "torch.rand(())" in text


RNG = random.Random(0)
RNG_NP = np.random.default_rng(0)
from random import random as uniform01  # noqa: E402 - the names a user imports the draws under
from time import perf_counter  # noqa: E402


def test_draws_and_clock_reads_under_other_names_are_refused_all_in_one_report():
    """Draws the module patches cannot see: a name imported from `random`, a `random.Random`
    or NumPy generator the function reads, NumPy's global generator, a clock imported by name.
    Each is refused by name, and a generator's state is set back. Several in one function are
    listed in one report; a generator the function makes itself with a seed is its own constant."""
    cases = {"random (Python's module-level generator": lambda a: a * uniform01(),
             "RNG: was drawn from": lambda a: a * RNG.uniform(0, 1),
             "RNG_NP: was drawn from": lambda a: a * float(RNG_NP.random()),
             "numpy.random.standard_normal at": lambda a: a * np.random.standard_normal(),
             "random.vonmisesvariate at": lambda a: a * random.vonmisesvariate(0, 1),
             "time.perf_counter at": lambda a: a * perf_counter()}
    for said, fn in cases.items():
        before = (random.getstate(), RNG.getstate(), RNG_NP.bit_generator.state)
        _, text = _raise(hpfun.shard(fn, mesh=MESH, in_specs=P("dp"), out_specs=P("dp")), torch.ones(4, 2),
                         error=hpfun.CaptureError)
        assert said in text and ("torch.rand(())" in text or "outside the sharded function" in text), said
        assert (random.getstate(), RNG.getstate(), RNG_NP.bit_generator.state) == before, said

    def two(a):
        return a * random.random() * time.time()

    _, text = _raise(hpfun.shard(two, mesh=MESH, in_specs=P("dp"), out_specs=P("dp")), torch.ones(4, 2),
                     error=hpfun.CaptureError)
    assert "(2 problems)" in text and "random.random at" in text and "time.time at" in text
    seeded = hpfun.shard(lambda a: a * random.Random(3).random(), mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    torch.testing.assert_close(seeded(torch.ones(4, 2)).full(), torch.full((4, 2), random.Random(3).random()))


def test_a_draw_with_beartype_loaded_names_its_checks_and_how_to_turn_them_off(monkeypatch):
    """beartype's checks pick a list's item to check with `random.getrandbits` (lucidrains'
    packages decorate their forwards with @beartype): with beartype loaded, the refusal says so
    and names the switch that turns it off."""
    import types

    monkeypatch.setitem(sys.modules, "beartype", types.ModuleType("beartype"))
    _, text = _raise(hpfun.shard(lambda a: a * uniform01(), mesh=MESH, in_specs=P("dp"), out_specs=P("dp")),
                     torch.ones(4, 2), error=hpfun.CaptureError)
    assert "beartype is loaded" in text and "PYTHONOPTIMIZE=1" in text, text


MESH_TP = hpfun.Mesh.simulated((2,), ("tp",))


def test_an_argument_written_in_place_that_shares_memory_with_another_is_refused():
    """`f(x, x)` (or `f(x, x[0])`) where the function writes `x` in place: eager's second argument
    sees the write, the program's inputs are read as they were at the call. Refused, naming both;
    the same tensor twice with no write runs."""
    def scale_then_add(x, y):
        x.mul_(2)
        return x + y

    f = hpfun.shard(scale_then_add, mesh=MESH_TP, in_specs=(P(), P()), out_specs=P())
    x = torch.ones(4, 8)
    for other in (x, x[0]):
        _, text = _raise(f, x, other, error=hpfun.SpecError)
        assert "args[0] and args[1]: share memory, and the function writes args[0] in place" in text
        assert "x.clone()" in text
    assert torch.equal(x, torch.ones(4, 8))  # refused before anything ran
    held = hpfun.Sharded.from_global(torch.ones(4, 8), P().to_layout(MESH_TP, 2))  # the same Sharded value twice
    _, text = _raise(f, held, held, error=hpfun.SpecError)
    assert "args[0] and args[1]: share memory" in text
    y = torch.ones(4, 8)
    torch.testing.assert_close(f(y, torch.ones(4, 8)).full(), torch.full((4, 8), 3.0))
    add = hpfun.shard(lambda a, b: a + b, mesh=MESH_TP, in_specs=(P(), P()), out_specs=P())
    torch.testing.assert_close(add(x, x).full(), 2 * x)


def test_arguments_hpfun_cannot_bake_in_name_the_fix():
    """A module or optimizer passed as an argument (hpfun lifts the ones the function reaches
    itself), and an iterator (the trace would consume it)."""
    model = torch.nn.Linear(4, 4)
    f = hpfun.shard(lambda m, x: m(x), mesh=MESH_TP, in_specs=(None, P()), out_specs=P())
    _, text = _raise(f, model, torch.ones(2, 4), error=hpfun.SpecError)
    assert "args[0]: is an nn.Module (Linear) passed as an argument" in text and "close over it" in text
    g = hpfun.shard(lambda xs, y: sum(xs) + y, mesh=MESH_TP, in_specs=(None, P()), out_specs=P())
    _, text = _raise(g, iter([torch.ones(2)]), torch.ones(2), error=hpfun.SpecError)
    assert "args[0]: is an iterator (list_iterator)" in text and "pass a list or a tuple" in text


def test_layout_and_cost_model_arguments_of_the_wrong_type_say_what_to_pass():
    x = torch.ones(4, 8)
    for bad, said in ((P("tp"), "got the spec P(dims=('tp',)), which names no mesh"), (3, "got int")):
        _, text = _raise(hpfun.Sharded.from_global, x, bad, error=hpfun.SpecError)
        assert f"Sharded.from_global: takes a Layout, {said}" in text and "to_layout(mesh, ndim)" in text
    value = hpfun.Sharded.from_global(x, "[S(0)] on {tp: 2}")  # a layout's text is read
    _, text = _raise(hpfun.redistribute, value, P(None, "tp"), error=hpfun.SpecError)
    assert "redistribute: takes a Layout, got the spec" in text
    _, text = _raise(hpfun.redistribute, x, P(None, "tp").to_layout(MESH_TP, 2), error=hpfun.SpecError)
    assert "x: is Tensor, not a Sharded value" in text
    _, text = _raise(hpfun.Sharded.full, x, error=hpfun.SpecError)  # called on the class with a tensor
    assert "Sharded.full: was called on Tensor, not a Sharded value" in text
    lowered = hpfun.shard(lambda a: a * 2, mesh=MESH_TP, in_specs=(P("tp"),), out_specs=P()).lower(x)
    _, text = _raise(lowered.cost, "fast", error=hpfun.SpecError)
    assert "cost: takes an hpfun.plan.CostModel, got str 'fast'" in text
    _, text = _raise(lambda: hpfun.shard(lambda a: a, mesh=MESH_TP, in_specs=(P(),), compile="no"), error=hpfun.SpecError)
    assert "compile must be True or False, got 'no'" in text


def test_numpy_and_collective_calls_inside_the_function_are_explained():
    f = hpfun.shard(lambda x: torch.from_numpy(x.numpy() * 2), mesh=MESH_TP, in_specs=(P("tp"),), out_specs=P())
    _, text = _raise(f, torch.ones(4, 2), error=hpfun.CaptureError)
    assert "call .numpy() on the result after the call" in text

    def reduced(x):
        torch.distributed.all_reduce(x)
        return x

    g = hpfun.shard(reduced, mesh=MESH_TP, in_specs=(P("tp"),), out_specs=P())
    _, text = _raise(g, torch.ones(4, 2), error=hpfun.CaptureError)
    assert "torch.distributed.all_reduce at" in text and "torch.distributed.all_reduce(x)" in text, text
    assert "leave the communication to hpfun" in text, text


def test_an_op_refusing_its_inputs_mixed_dtypes_says_to_cast_not_to_report_a_bug():
    """`int64 @ float32` passes the trace (fake kernels do not check dtypes) and fails as the
    program runs: the error names the dtypes and the cast, as the unsharded call would fail."""
    f = hpfun.shard(lambda x, w: x @ w, mesh=MESH_TP, in_specs=(P("tp"), P()), out_specs=P())
    _, text = _raise(f, torch.ones(4, 3, dtype=torch.int64), torch.ones(3, 2), error=hpfun.ExecutionError)
    assert "its inputs are int64 and float32, a mix torch refuses for this op, unsharded too" in text
    assert "bug in hpfun" not in text


def test_arguments_requiring_grad_warn_that_outputs_are_not_differentiable_outside():
    """The warning says so, and what the function sees; the caller's tensors keep their flag (a
    call turned requires_grad off on every argument that had it: the README's
    `dict(model.named_parameters())` argument froze the model)."""
    f = hpfun.shard(lambda x, w: (x * w).sum(), mesh=MESH_TP, in_specs=(P("tp"), P()), out_specs=P())
    model = torch.nn.Linear(2, 1)
    params = dict(model.named_parameters())
    x = torch.ones(4, 2, requires_grad=True)
    with pytest.warns(UserWarning, match=r"(?s)args\[0\] require grad, but a sharded function's outputs are not "
                      r"connected.*inside it they are plain inputs \(requires_grad False"):
        f(x, params["weight"][0].detach())
    g = hpfun.shard(lambda p, x: torch.func.functional_call(model, p, (x,)).sum(), mesh=MESH_TP,
                    in_specs=({"*": P()}, P("tp")), out_specs=P())
    with pytest.warns(UserWarning, match="require grad"):
        g(params, x)
    assert x.requires_grad and all(p.requires_grad for p in model.parameters())


def test_bad_constrain_specs_are_reported_together_at_their_lines():
    """Two bad pins in one function (an axis the mesh lacks, too many dims) and a pin on a dim
    its axis does not divide: one report per trace, each at the user's line."""
    def pinned(x):
        y = hpfun.constrain(x * 2, P(None, "dp"))
        return hpfun.constrain(y + 1, P(None, None, "tp"))

    _, text = _raise(hpfun.shard(pinned, mesh=MESH_TP, in_specs=(P(),), out_specs=P()), torch.ones(4, 8),
                     error=hpfun.SpecError)
    assert "bad hpfun.constrain specs (2 problems)" in text
    assert """y = hpfun.constrain(x * 2, P(None, "dp")): P(None, 'dp') names mesh axis 'dp'""" in text
    assert "P(None, None, 'tp') has 3 entries but the tensor has only 2 dims" in text
    odd = hpfun.shard(lambda x: hpfun.constrain(x * 2, P(None, "tp")).sum(), mesh=MESH_TP, in_specs=(P(),),
                      out_specs=P())
    _, text = _raise(odd, torch.ones(4, 7), error=hpfun.SpecError)
    assert "dim 1 of size 7 is not divisible by the mesh axes sharding it (tp=2) (shape (4, 7))" in text
    assert "test_errors.py" in text  # the user's line


def test_backward_to_an_argument_names_torch_func_grad():
    """`loss.backward()` through an argument that requires grad, then `x.grad`: arguments are
    traced as values, and the error says how to differentiate with respect to one."""
    x = torch.ones(4, 2, requires_grad=True)

    def f(x):
        (x ** 2).sum().backward()
        return x.grad

    with pytest.warns(UserWarning, match="require grad"):
        _, text = _raise(hpfun.shard(f, mesh=MESH, in_specs=P("dp"), out_specs=P("dp")), x, error=hpfun.CaptureError)
    assert "does not require grad" in text and "torch.func.grad(loss_fn)(x)" in text
    got = hpfun.shard(torch.func.grad(lambda x: (x ** 2).sum()), mesh=MESH, in_specs=P("dp"),
                      out_specs=P("dp"))(x.detach())
    assert torch.equal(got.full(), 2 * x.detach())


def test_mistakes_that_ran_without_a_word_are_named():
    """A state_specs typo while the optimizer has no state yet (SGD without momentum never makes
    any), a split spec given for a Python number (argument or output), a cost model's per_axis
    naming no mesh axis, shards of mixed dtypes, a key that is not a string: each is an error;
    a memory_budget with no AUTO spec warns that nothing holds the plan to it."""
    mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    data = (torch.randn(8, 16), torch.randint(0, 8, (8,)))
    typo = hpfun.shard(step, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P(),
                       state_specs={"0.weihgt": P("tp", None), "*.momentum_buffer": P()})
    _, text = _raise(typo, *data, error=hpfun.SpecError)
    assert "state_specs['0.weihgt']: matches no name; closest: model.0.weight" in text
    assert "momentum_buffer" not in text  # a pattern for state not made yet is checked once it is
    only_opt = hpfun.shard(lambda: opt.step(), mesh=mesh, in_specs=(), out_specs=None,
                           state_specs={"0.weight": P("dp")})  # (its parameters are named opt.params.0.*)
    F.cross_entropy(model(data[0]), data[1]).backward()
    _, text = _raise(only_opt, error=hpfun.SpecError)  # plain SGD makes no state: it never matched, and the
    assert "state_specs['0.weight']: matches no name" in text  # cached program ran without the plan, silently
    dotless = hpfun.shard(step, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P(), state_specs={"wieght": P()})
    _, text = _raise(dotless, *data, error=hpfun.SpecError)  # (a name without a dot was taken for a state key
    assert "state_specs['wieght']: matches no name" in text  # SGD might make, and never checked: ignored, silently)
    grads = hpfun.shard(lambda x, y: F.cross_entropy(model(x), y).backward(), mesh=mesh, in_specs=(P("dp"), P("dp")),
                        state_specs={"*.grad": P("dp")})  # ZeRO-2 accumulation: no gradient before the first call
    grads(*data)
    grads(*data)
    assert "global [64, 16] [S(0), R], local [32, 16] float32  (model.0.weight.grad)" in str(grads.lower(*data))
    zero1 = hpfun.shard(lambda x, y: F.cross_entropy(model(x), y).backward(), mesh=mesh, in_specs=(P("dp"), P("dp")),
                        state_specs={"*.exp_avg": P("dp")})  # (ZeRO-1's plan given to a function stepping nothing:
    _, text = _raise(zero1, *data, error=hpfun.SpecError)  # the fix said only "fix the pattern")
    assert "this function reaches no optimizer, so a pattern for optimizer state" in text
    typo = hpfun.shard(lambda x, y: F.cross_entropy(model(x), y).backward(), mesh=mesh, in_specs=(P("dp"), P("dp")),
                       state_specs={"model.0.wieght": P("dp")})  # (a misspelled parameter: its closest names say
    _, text = _raise(typo, *data, error=hpfun.SpecError)  # it all, where optimizer state is no matter)
    assert "closest: model.0.weight" in text and "reaches no optimizer" not in text
    lazy = hpfun.shard(lambda x, y: F.cross_entropy(model(x), y).backward(), mesh=mesh, in_specs=(P("dp"), P("dp")),
                       state_specs={"mom.0.weight": P("dp")})  # (a name no lifted tensor's starts like: the hint
    _, text = _raise(lazy, *data, error=hpfun.SpecError)  # for state the step makes is said beside the closest)
    assert "closest: model.0.weight" in text and "has no name before that call" in text
    _, text = _raise(hpfun.shard(step, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P(), state_specs={0: P()}),
                     *data, error=hpfun.SpecError)
    assert "state_specs[0]: pattern keys are strings, got int" in text
    x = torch.randn(8, 4)
    scaled = hpfun.shard(lambda a, s: (a * s, 3), mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=(P("dp"), P("tp")))
    _, text = _raise(scaled, x, 2.0, error=hpfun.SpecError)
    assert "args[1]: is a Python float, not a tensor, but its in_specs entry P('dp') splits it" in text
    scaled = hpfun.shard(lambda a, s: (a * s, 3), mesh=mesh, in_specs=(P("dp"), None), out_specs=(P("dp"), P("tp")))
    _, text = _raise(scaled, x, 2.0, error=hpfun.SpecError)
    assert "outputs[1]: is a Python int, not a tensor, but its out_specs entry P('tp') splits it" in text
    square = hpfun.shard(lambda a: (a @ a.T).sum(), mesh=mesh, in_specs=(P(),), out_specs=P(), memory_budget=16)
    with pytest.warns(UserWarning, match="no spec of this call is AUTO"):
        square(x)
    slow = hpfun.CostModel(1e-5, 1e9, per_axis={"zz": (1e-2, 1e3)})
    _, text = _raise(square.lower(x).cost, slow, error=hpfun.SpecError)
    assert "per_axis names 'zz', which the mesh {dp: 2, tp: 2} has no axis of" in text
    with pytest.raises(hpfun.SpecError, match="per_axis names 'zz'"):
        hpfun.shard(lambda a: a, mesh=mesh, in_specs=P(), cost_model=slow)
    with pytest.raises(hpfun.LayoutError, match="different dtypes"):
        hpfun.Sharded(P("dp", "tp").to_layout(mesh, 2), (8, 4), [torch.randn(4, 2), torch.randn(4, 2).double()] * 2)
    with pytest.raises(hpfun.HpfunError, match="is not JSON"):
        hpfun.Lowered.from_json("hello")
    with pytest.raises(hpfun.SpecError, match="takes an integer seed, got str"):
        hpfun.random_seed("abc").__enter__()


def test_every_donated_value_read_again_is_named_and_nothing_is_lost():
    mesh = hpfun.Mesh.simulated((2,), ("dp",))

    def sgd(params, x):
        g = torch.func.grad(lambda p: (x @ p["w"] + p["b"]).pow(2).sum())(params)
        return {k: v - 0.1 * g[k] for k, v in params.items()}

    f = hpfun.shard(sgd, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P(), donate_argnums=(0,))
    x = torch.randn(8, 4)
    first = f({"w": torch.randn(4, 2), "b": torch.zeros(2)}, x)
    second = f(first, x)
    _, text = _raise(f, first, x, error=hpfun.SpecError)
    assert "args[0]['w']: was donated" in text and "args[0]['b']: was donated" in text
    f(second, x)  # the value the last call returned still runs


def test_writes_that_cannot_be_handed_back_are_named_at_the_users_line():
    """An argument whose elements share memory (an expanded view) written in place is refused
    before anything runs; an input's shape changed in place (`a.t_()`) is refused at its line
    (on a tensor the function made, it runs)."""
    mesh = hpfun.Mesh.simulated((2,), ("x",))

    def scale(a, b):
        b.add_(1.0)
        a.mul_(2.0)
        return a.sum()

    f = hpfun.shard(scale, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
    a, b = torch.arange(4.0).unsqueeze(1).expand(4, 2), torch.zeros(4)
    _, text = _raise(f, a, b)  # (at the trace, at the write's line)
    assert "a.mul_(2.0): writes in place into a tensor whose elements share memory" in text
    assert torch.equal(b, torch.zeros(4))  # refused before anything ran or was written back
    expand = hpfun.shard(lambda x: x.unsqueeze(1).expand(4, 2), mesh=mesh, in_specs=(P("x"),), out_specs=None)
    _, text = _raise(f, expand(torch.arange(4.0)), b, error=hpfun.SpecError)  # (a Sharded value's expanded shards)
    assert "args[0]: has elements that share memory (an expand()" in text and "x.clone()" in text
    assert torch.equal(b, torch.zeros(4))

    def transposed(a):
        a.t_()
        return a * 2

    _, text = _raise(hpfun.shard(transposed, mesh=mesh, in_specs=(P("x"),)), torch.randn(4, 6),
                     error=hpfun.CaptureError)
    assert "t_ at " in text and "a.t_()" in text and "changes the shape or strides of an input" in text

    def resized(a):
        a.resize_(2, 12)
        return a.sum(0)

    for fallback in (None, "replicate"):  # (a missing rule, and with the fallback torch failed writing it back)
        _, text = _raise(hpfun.shard(resized, mesh=mesh, in_specs=(P("x"),), out_specs=P(), fallback=fallback),
                         torch.randn(4, 6), error=hpfun.CaptureError)
        assert "resize_ at " in text and "changes the shape or strides of an input" in text, text

    def made(a):
        b = a * 2
        b.t_()
        return b

    x = torch.randn(4, 6)
    torch.testing.assert_close(hpfun.shard(made, mesh=mesh, in_specs=(P("x"),))(x).full(), made(x))


def test_a_sharded_function_under_an_outer_transform_says_to_put_it_inside():
    """torch.func.grad or vmap applied around a sharded function is a SpecError with the fix
    (the transform goes inside), not an internal error."""
    import torch.func as tf

    f = hpfun.shard(lambda w, x: (x @ w).sum(), mesh=MESH, in_specs=(P(), P("dp")), out_specs=P())
    w, x = torch.randn(4, 4), torch.randn(8, 4)
    for outer in (lambda: tf.grad(lambda w: f(w, x).full())(w), lambda: tf.vmap(lambda w: f(w, x).full())(w[None])):
        with pytest.raises(hpfun.SpecError, match="inside a torch.func transform"):
            outer()


def test_clip_grad_norm_error_if_nonfinite_names_the_argument():
    """clip_grad_norm_(error_if_nonfinite=True) reads the norm in Python: the error names the
    argument and says to check the returned norm after the call."""
    model = torch.nn.Linear(4, 2)

    def step(x):
        model(x).square().mean().backward()
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)

    _, text = _raise(hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P()), torch.randn(8, 4),
                     error=hpfun.CaptureError)
    assert "error_if_nonfinite=False" in text and "torch.isfinite(norm.full())" in text


def test_a_hook_registered_on_a_parameter_inside_the_step_is_refused():
    """A gradient hook registered on a lifted parameter inside the step cannot be kept on it (eager
    adds one per call): refused, naming the parameter and saying to register it once, outside."""
    model = torch.nn.Linear(4, 2)

    def step(x):
        model.weight.register_hook(lambda g: g * 3)
        model(x).square().mean().backward()
        return model.weight.grad

    _, text = _raise(hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P()), torch.randn(8, 4),
                     error=hpfun.CaptureError)
    assert "model.weight" in text and "register the hook once, outside" in text


def _attribute_step(what):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4, bias=False, dtype=torch.float64)
    model.register_buffer("b", torch.ones(4, dtype=torch.float64))
    model.weight.seen, model.weight.snap, model.b.tag = 0, torch.zeros(4, 4), "x"

    def step(x):
        model(x).square().mean().backward()
        with torch.no_grad():
            if what == "counter":
                model.weight.seen += 1
            elif what == "tensor":
                model.weight.snap = model.weight.detach().clone()
            elif what == "new on a buffer":
                model.b.marked = True
            elif hasattr(model.b, "tag"):
                del model.b.tag
            model.weight.sub_(0.1 / (1 + model.weight.seen) * model.weight.grad)
            model.weight.grad = None
        return model.weight.sum()
    return model, step


@pytest.mark.parametrize("what", ["counter", "new on a buffer", "deleted"])
def test_a_number_or_flag_the_step_sets_on_a_parameter_or_buffer_is_set_by_every_call(what):
    """`p.seen += 1` (a 1/t step size kept on the parameter), a flag set on a buffer, an attribute
    deleted: the trace set them on the tensor's stand-in, so the caller's tensor kept its old
    value and every cached call ran with the trace's (weights 0.02 off at the third step,
    silently). Each call sets them again, as eager's does; the attribute keys the program, so a
    counter compiles at each call."""
    (model, step), (ref, eager) = _attribute_step(what), _attribute_step(what)
    f = hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P())
    for i in range(3):
        x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(f(x).full(), eager(x), rtol=1e-12, atol=1e-12)
        assert (model.weight.seen, getattr(model.b, "marked", None), getattr(model.b, "tag", None)) == \
            (ref.weight.seen, getattr(ref.b, "marked", None), getattr(ref.b, "tag", None))
    torch.testing.assert_close(model.weight, ref.weight, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["_n", "_init"])
def test_a_private_attribute_the_step_sets_on_a_parameter_is_refused(name):
    """`p._n += 1`, or a first-call flag `p._init = True` read to skip a first update: private
    attributes key nothing, so setting the traced value again at every call ran every call with
    the first call's (the counter stayed 1; the flag froze training). Refused, saying to use a
    public name, which keys the program."""
    model = torch.nn.Linear(4, 4, dtype=torch.float64)

    def step(x):
        model(x).square().mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                if name == "_n":
                    p._n = getattr(p, "_n", 0) + 1
                    p.sub_(0.1 / p._n * p.grad)
                elif getattr(p, "_init", False):
                    p.sub_(0.1 * p.grad)
                else:
                    p._init = True
                p.grad = None
        return model.weight.sum()

    _, text = _raise(hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P()), torch.randn(8, 4, dtype=torch.float64),
                     error=hpfun.CaptureError)
    assert f"model.weight.{name}" in text and "under a private name" in text and "public name" in text, text
    assert not hasattr(model.weight, name)


def _sgd_stepped(model, lr: float):
    """A step of SGD on the loss `model(x)` returns."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(x):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


class _WeaklyTagged(torch.nn.Module):
    """Tags its parameter with a weak reference to itself at every read, as pyro's PyroParam tags
    a constrained value with its unconstrained parameter."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4, dtype=torch.float64))

    def forward(self, x):
        self.w.unconstrained = weakref.ref(self.w)
        return (x * self.w.unconstrained()).sum()


def test_a_weak_reference_to_a_lifted_tensor_set_on_it_is_set_by_every_call():
    """`p.unconstrained = weakref.ref(p)` (pyro's PyroParam): refused as an object a program
    cannot put there; each call now sets a weak reference to the parameter itself, as eager's."""
    model, ref = _WeaklyTagged(), _WeaklyTagged()
    f, eager = hpfun.shard(_sgd_stepped(model, 0.1), mesh=MESH, in_specs=P("dp"), out_specs=P()), _sgd_stepped(ref, 0.1)
    for i in range(3):
        x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(f(x).full(), eager(x), rtol=1e-12, atol=1e-12)
        assert model.w.unconstrained() is model.w
    torch.testing.assert_close(model.w, ref.w, rtol=1e-12, atol=1e-12)
    assert f.trace_count == 1


class _WeaklyHolding(torch.nn.Module):
    """Keeps weak references to its weight, in an attribute and in a dict, at every forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.refs = {}

    def forward(self, x):
        self.wref = weakref.ref(self.lin.weight)
        self.refs["w"] = weakref.ref(self.lin.weight)
        return self.lin(x).sum()


def test_a_weak_reference_a_forward_keeps_in_its_module_is_to_the_lifted_tensor():
    """`self.wref = weakref.ref(self.lin.weight)` in a forward: it was a reference to the trace's
    stand-in, which died with the trace, so `model.wref()` was None after the call."""
    model = _WeaklyHolding()
    f = hpfun.shard(model, mesh=MESH, in_specs=P("dp"), out_specs=P())
    for i in range(2):
        f(torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i)))
        assert model.wref() is model.lin.weight and model.refs["w"]() is model.lin.weight, i



class _ProxyHolding(torch.nn.Module):
    """Keeps weak proxies to its weight (one made at construction, one in a dict at every
    forward) and reads the weight through them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.__dict__["kept"] = weakref.proxy(self.lin.weight)  # (as a plain attribute: not a parameter)
        self.refs = {}

    def forward(self, x):
        self.refs["w"] = weakref.proxy(self.lin.weight)
        return (self.lin(x) * self.kept.sum() + self.refs["w"].square().sum()).sum()


def test_a_weak_proxy_a_module_keeps_to_its_weight_refers_to_the_lifted_tensor():
    """A weak proxy passes for the tensor it refers to (`isinstance` is True, `hash` fails):
    kept by a module, the walk tried to take a weak reference to it (a bare TypeError), and
    one a forward made was read as a tensor the step made (an internal error)."""
    (model, ref) = _ProxyHolding(), _ProxyHolding()
    step, eager = _sgd_stepped(model, 0.01), _sgd_stepped(ref, 0.01)
    f = hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P())
    for i in range(3):
        x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(f(x).full(), eager(x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(model.lin.weight, ref.lin.weight, rtol=1e-12, atol=1e-12)
        for proxy in (model.refs["w"], model.kept):  # (torch.equal takes no proxy: its arithmetic does)
            assert torch.equal(proxy * 1, model.lin.weight), i
    assert f.trace_count == 2  # (the dict the first call filled: traced again once, then kept)


class _WeakInNewContainers(torch.nn.Module):
    """Puts weak references to its state into a list and a dict it makes at every forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.register_buffer("c", torch.ones((), dtype=torch.float64))

    def forward(self, x):
        self.proxies = [weakref.proxy(self.c)]
        self.refs = {"w": weakref.ref(self.lin.weight)}
        return (self.lin(x) * self.c).sum()


def test_weak_references_in_a_list_or_dict_a_forward_makes_refer_to_the_lifted_tensors():
    """They referred to the trace's stand-ins, which die with it: the dict's `ref()` was None
    after every call (and each call traced again), and the list's dead proxy crashed the next
    call's walk with a bare ReferenceError."""
    model = _WeakInNewContainers()
    f = hpfun.shard(model, mesh=MESH, in_specs=P("dp"), out_specs=P())
    for i in range(3):
        f(torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i)))
        assert model.refs["w"]() is model.lin.weight, i
        assert torch.equal(model.proxies[0] * 1, model.c), i
    assert f.trace_count <= 2

class _IdentityCached(torch.nn.Module):
    """Recomputes a value made from its weight only when the weight is another tensor, known by
    a weak reference to the one it was made from."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)
        self._made_from = None
        self.register_buffer("cache", torch.zeros(4, 4, dtype=torch.float64), persistent=False)

    def forward(self, x):
        w = self.lin.weight
        if self._made_from is None or self._made_from() is not w:
            with torch.no_grad():
                self.cache.copy_(w * 2)
            self._made_from = weakref.ref(w)
        return (x @ (self.cache + w).T).square().sum()


def test_a_cache_known_by_a_weak_reference_to_its_weight_is_kept_as_eager_keeps_it():
    """The weak reference pointed at the tensor while the trace read its stand-in, so the cache
    was rebuilt from the updated weight at every call (loss 3767 against eager's 245)."""
    def make():
        torch.manual_seed(0)
        model = _IdentityCached()
        return model, _sgd_stepped(model, 0.01)

    (model, step), (ref, eager) = make(), make()
    f = hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P())
    for i in range(3):
        x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(f(x).full(), eager(x), rtol=1e-12, atol=1e-12)
        assert torch.equal(model.cache, ref.cache) and model._made_from() is model.lin.weight, i


def test_a_tensor_the_step_sets_as_an_attribute_of_a_parameter_is_refused():
    """`p.snap = p.detach().clone()`: left on the stand-in, the caller's parameter kept its old
    snapshot (0.47 off); a program cannot put a tensor there at every call. Refused, naming it;
    the parameter is left as it was."""
    model, step = _attribute_step("tensor")
    _, text = _raise(hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P()), torch.randn(8, 4),
                     error=hpfun.CaptureError)
    assert "model.weight.snap" in text and "a Python attribute of a lifted tensor" in text, text
    assert "module attribute or buffer" in text and model.weight.snap.abs().sum() == 0


def test_a_parameter_registered_inside_the_step_is_named_as_one():
    """Lazy initialization (`m.extra = nn.Parameter(...)` at the first call): refused, saying it is
    a parameter the function registered and to register it before the first call (the message
    spoke of objects a module holds and lists inside lists); the module is left without it."""
    model = torch.nn.Linear(4, 4)

    def step(x):
        if not hasattr(model, "extra"):
            model.extra = torch.nn.Parameter(torch.zeros(4))
        return (model(x) + model.extra).pow(2).mean()

    _, text = _raise(hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P()), torch.randn(8, 4),
                     error=hpfun.CaptureError)
    assert "model.extra (a parameter the function registered: register it before the first call" in text, text
    assert not hasattr(model, "extra")


def test_a_librarys_batch_object_passed_as_an_argument_names_the_ways_to_pass_its_tensors():
    """A graph library's batch (`step(data)` with torch_geometric's Data, unhashable, holding its
    tensors in a store of its own) was refused as not hashable, with the fix to pass a hashable
    value; it now says it holds tensors and how to pass them."""
    store = type("Store", (), {"__module__": "collections"})()
    store.x, store.edge_index = torch.randn(4, 3), torch.zeros(2, 4, dtype=torch.long)
    batch = type("DataBatch", (), {"__module__": "collections", "__eq__": lambda self, other: self is other})()
    batch._store = store
    f = hpfun.shard(lambda data: data._store.x.sum(), mesh=MESH, in_specs=(P(),), out_specs=P())
    _, text = _raise(f, batch, error=hpfun.SpecError)
    assert "args[0]: is a DataBatch holding tensors" in text and "pass its tensors as arguments" in text, text


def test_a_tensor_inside_an_argument_object_names_it_and_the_ways_out():
    """A config object of the user's class passed as an argument is read for its numbers, strings
    and flags; a tensor it holds is not flattened. The error names the object's tensors and the
    three ways out (a dataclass, the tensor as an argument, closing over the object); closed
    over, it runs."""
    class Cfg:
        def __init__(self):
            self.alpha, self.bias = 2.0, torch.ones(3)

    def f(c, x):
        return x * c.alpha + c.bias

    x = torch.randn(4, 3)
    _, text = _raise(hpfun.shard(f, mesh=MESH, in_specs=(None, P("dp")), out_specs=P()), Cfg(), x,
                     error=hpfun.CaptureError)
    assert "args[0]" in text and "args[0].bias" in text and "make Cfg a dataclass" in text
    assert "test_errors.py" in text  # the line that read it
    cfg = Cfg()
    closed = hpfun.shard(lambda x: f(cfg, x), mesh=MESH, in_specs=P("dp"), out_specs=P())
    assert torch.equal(closed(x).full(), x * 2 + 1)



@pytest.mark.parametrize("cls", [torch.nn.Embedding, torch.nn.EmbeddingBag])
def test_a_sparse_gradient_made_without_an_optimizer_step_is_refused_at_its_line(cls):
    """nn.Embedding(sparse=True) in a step of forward and backward only (the optimizer stepped
    outside): its sparse gradient's ops had no rule (Embedding), or its write-back failed with
    torch's error after the program ran (EmbeddingBag). Refused at the trace, naming the line."""
    torch.manual_seed(0)
    model = cls(10, 4, sparse=True)

    def step(i):
        loss = model(i).sum()
        loss.backward()
        return loss

    ids = torch.randint(0, 10, (8, 3), generator=torch.Generator().manual_seed(1))
    _, text = _raise(hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P()), ids, error=hpfun.CaptureError)
    assert "a sparse_coo tensor at" in text and "test_errors.py" in text and "pass sparse=False" in text, text
    assert model.weight.grad is None

@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")  # torch's, eager too
def test_sparse_and_nested_tensors_are_refused_by_path():
    """Sparse (COO, CSR) and nested tensors, as arguments or as a module's buffer, are refused by
    path with the dense form to use, also after a dense call of the same shape compiled (a sparse
    COO tensor keys apart from a dense one); before, torch failed inside hpfun's slicing."""
    f = hpfun.shard(lambda x: x * 2, mesh=MESH, in_specs=P(), out_specs=P())
    f(torch.randn(4, 3))
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(3, 3)], layout=torch.jagged)
    for x, kind in [(torch.randn(4, 3).to_sparse(), "sparse_coo"), (torch.randn(4, 3).to_sparse_csr(), "sparse_csr"),
                    (nested, "nested")]:
        _, text = _raise(f, x, error=hpfun.SpecError)
        assert f"args[0]: is a {kind} tensor" in text and ("to_dense()" in text or "to_padded_tensor" in text)
    quantized = torch.quantize_per_tensor(torch.randn(4, 3), 0.1, 0, torch.qint8)
    _, text = _raise(f, quantized, error=hpfun.SpecError)
    assert "args[0]: is a quantized tensor" in text and ".dequantize()" in text
    holder = torch.nn.Module()
    holder.register_buffer("adj", torch.eye(4).to_sparse())
    g = hpfun.shard(lambda x: torch.sparse.mm(holder.adj, x), mesh=MESH, in_specs=P(), out_specs=P())
    _, text = _raise(g, torch.randn(4, 3), error=hpfun.SpecError)
    assert "holder.adj: is a sparse_coo tensor" in text


_MESH2 = hpfun.Mesh.simulated((2,), ("dp",))
_WRONG_TYPES = {
    "to_layout": (lambda: P("dp").to_layout("mesh", 2), "takes an hpfun.Mesh"),
    "Layout": (lambda: hpfun.Layout("m", (hpfun.Replicate(),)), "first argument is an hpfun.Mesh"),
    "parse": (lambda: hpfun.parse(3), "reads a string"),
    "Sharded layout": (lambda: hpfun.Sharded("x", (8,), (torch.zeros(4), torch.zeros(4))), "takes a Layout"),
    "Sharded shards": (lambda: hpfun.Sharded(P("dp").to_layout(_MESH2, 1), (2,), ([1], [2])), "one tensor per rank"),
    "visualize shape": (lambda: hpfun.visualize(P("dp").to_layout(_MESH2, 2), 4), "a tuple of ints"),
    "from_device_mesh": (lambda: hpfun.Mesh.from_device_mesh(_MESH2), "it is a mesh already"),
    "AUTO.to_layout": (lambda: hpfun.AUTO.to_layout(_MESH2, 2), "the planner decides"),
    "complex max": (lambda: hpfun.Sharded(hpfun.Layout(_MESH2, (hpfun.Partial("max"),)), (3,),
                                          (torch.zeros(3, dtype=torch.complex128),) * 2), "no order"),
}


@pytest.mark.parametrize("case", _WRONG_TYPES)
def test_public_constructors_given_a_wrong_type_say_what_to_pass(case):
    """The public constructors and helpers given a value of the wrong type raise hpfun's errors
    saying what they take, where they raised AttributeError or TypeError from inside."""
    fn, phrase = _WRONG_TYPES[case]
    _, text = _raise(fn)
    assert phrase in text


def test_a_dict_keyed_by_parameters_names_the_ways_to_key_it():
    """A dict keyed by parameters where hpfun does not look (in a dict a module holds), looked up
    inside the step (per-parameter scales): the trace's stand-ins are not its keys (one the
    function reaches is keyed by them: tests/test_modules.py). The KeyError names the line and
    the two ways that work (the attribute way: tests/test_modules.py), not the stand-in."""
    model = torch.nn.Linear(4, 2)
    model.config = {"scales": {p: 0.5 for p in model.parameters()}}

    def step(x):
        model(x).square().mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * model.config["scales"][p] * p.grad)
                p.grad = None
        return model.weight

    _, text = _raise(hpfun.shard(step, mesh=MESH, in_specs=P("dp"), out_specs=P()), torch.randn(8, 4),
                     error=hpfun.CaptureError)
    assert "KeyError at" in text and 'model.config["scales"][p]' in text and "p.lr_scale = 0.5" in text
    assert "FakeTensor" not in text


@pytest.mark.parametrize("spec", [P(), P(None, "dp")], ids=str)
def test_softmax_of_integers_is_refused_as_eager_refuses_it(spec):
    """softmax, log_softmax and cross_entropy of integer logits, which torch's kernels refuse:
    refused at the line, whatever the layout (with the classes split, the decomposition had
    computed truncated numbers)."""
    x, y = torch.randint(0, 5, (4, 8)), torch.randint(0, 8, (4,))
    for fn in (lambda x, y: x.softmax(-1), lambda x, y: torch.log_softmax(x, 1),
               lambda x, y: torch.nn.functional.cross_entropy(x, y)):
        with pytest.raises(RuntimeError):
            fn(x, y)
        f = hpfun.shard(fn, mesh=MESH, in_specs=(spec, P()), out_specs=P())
        _, text = _raise(f, x, y, error=hpfun.CaptureError)
        assert "softmax of a int64 tensor" in text and "test_errors.py" in text and "x.float()" in text, text
    ok = hpfun.shard(lambda x: x.softmax(-1, dtype=torch.float64), mesh=MESH, in_specs=(spec,), out_specs=P())
    torch.testing.assert_close(ok(x).full(), x.softmax(-1, dtype=torch.float64))
    flags = x > 2  # (a bool one failed inside torch's decomposition, naming a subtraction the user never wrote)
    for fn in (lambda x: x.log_softmax(0), lambda x: torch.softmax(x, 1), lambda x: torch.nn.functional.softmin(x, 1)):
        with pytest.raises((RuntimeError, NotImplementedError)):
            fn(flags)
        _, text = _raise(hpfun.shard(fn, mesh=MESH, in_specs=(spec,), out_specs=P()), flags, error=hpfun.CaptureError)
        assert "of a bool tensor" in text and "test_errors.py" in text and "x.float()" in text, text
    ok = hpfun.shard(lambda x: torch.softmax(x, 1, torch.float64), mesh=MESH, in_specs=(spec,), out_specs=P())
    torch.testing.assert_close(ok(flags).full(), torch.softmax(flags, 1, torch.float64))


@pytest.mark.parametrize("fn, x", [
    (lambda x: x - 0.5, torch.rand(4, 8) > 0.5),  # a bool tensor minus a number
    (lambda x: x ** -1, torch.arange(1, 33).reshape(4, 8)),  # an integer to a negative power
    (lambda x: x & 1, torch.randn(4, 8)),  # a bitwise op on floats
    (lambda x: torch.lerp(x, x, 0.5), torch.arange(32).reshape(4, 8)),
], ids=["bool-minus", "int-pow-neg", "float-and", "int-lerp"])
def test_an_op_torch_refuses_for_its_dtypes_is_said_to_be_the_functions(fn, x):
    """Dtype checks live in torch's kernels, which the trace does not run: the op fails while the
    program runs. Where it fails on zeros of its inputs alike, whatever the values and layouts,
    the error says the unsharded function raises the same (not "a bug in hpfun")."""
    with pytest.raises(RuntimeError):
        fn(x)
    f = hpfun.shard(fn, mesh=MESH, in_specs=(P("dp"),), out_specs=P())
    _, text = _raise(f, x, error=hpfun.ExecutionError)
    assert "the unsharded function raises the same" in text and "bug in hpfun" not in text, text


def test_an_op_failing_for_its_blocks_strides_is_not_said_to_be_the_functions():
    """A kernel refusing the strides of a rank's block (group norm's contiguity check failed so at
    one sample per rank) is the per-shard program's, not the unsharded function's: zeros like
    the block (its strides too) failed alike, and the error said the unsharded function raises
    the same. Zeros of its shape and dtype run, so no such claim is made."""
    from hpfun.runtime import failure

    graph = torch.fx.Graph()
    node = graph.call_function(torch.ops.aten.view.default, (graph.placeholder("x"), [8]))
    block = torch.zeros(2, 4).t()  # (not contiguous: a view cannot flatten it)
    with pytest.raises(RuntimeError) as err:
        torch.ops.aten.view.default(block, [8])
    first = str(err.value).splitlines()[0]
    assert failure._refused_alike(node, err.value, first, inputs=((block, [8]), {})) is None
    bools = torch.zeros(4, 2, dtype=torch.bool)
    node = graph.call_function(torch.ops.aten.sub.Tensor, (graph.placeholder("b"), 0.5))
    with pytest.raises(RuntimeError) as err:
        torch.ops.aten.sub.Tensor(bools, 0.5)
    first = str(err.value).splitlines()[0]
    assert "raises the same" in failure._refused_alike(node, err.value, first, inputs=((bools, 0.5), {}))


def test_an_op_failing_for_its_values_along_a_whole_dim_names_the_values():
    """An index out of range fails for its values (zeros would not): along a dim every rank
    holds whole, torch's own check raised it as on the unsharded tensor, so the fix names the
    values (it asked for a bug report)."""
    f = hpfun.shard(lambda x: x[:, torch.tensor([0, 99])], mesh=MESH, in_specs=(P("dp"),), out_specs=P())
    _, text = _raise(f, torch.randn(4, 8), error=hpfun.ExecutionError)
    assert "the unsharded function raises on these values too: fix the values" in text, text
    assert "bug in hpfun" not in text, text


def test_a_tensor_read_from_an_object_a_module_holds_names_the_object():
    """kornia's augmentations hold a `torch.distributions.Uniform(low, high)`: a tensor read from
    it is not lifted, and the error names the object and the tensors it holds, with the fix
    (it named only the line reading them)."""
    class Jitter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sampler = torch.distributions.Uniform(torch.tensor(0.8), torch.tensor(1.2))

        def forward(self, x):
            return x * self.sampler.low

    aug = Jitter()
    f = hpfun.shard(lambda x: aug(x), mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))
    _, text = _raise(f, torch.randn(4, 3), error=hpfun.CaptureError)
    assert "aug.sampler (a Uniform): holds tensors (aug.sampler.low, aug.sampler.high)" in text, text
    assert "register_buffer" in text and "test_errors.py" in text, text

    class Priors(torch.nn.Module):  # (in a dict, as pyro's priors are: the error named no holder)
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))
            self.priors = {"w": torch.distributions.Normal(torch.zeros(3), 1.0, validate_args=False)}

        def forward(self, x):
            return (x * self.w).sum() - self.priors["w"].log_prob(self.w).sum()

    def make():
        model = Priors()
        return hpfun.shard(lambda x: model(x), mesh=MESH, in_specs=(P("dp"),), out_specs=P())

    _, text = _raise(make(), torch.randn(4, 3), error=hpfun.CaptureError)
    assert "model.priors (a dict of objects): holds tensors inside model.priors['w']" in text, text


def test_a_read_in_an_autograd_functions_backward_is_read_as_in_its_forward():
    """torchdiffeq's adjoint checks its time points in its backward (`_assert_increasing`): a
    read of values made from constants or the arguments there is read as in the forward (the
    autograd engine ran the backward without hpfun's torch-function mode, and it was refused)."""
    t = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, t):
            ctx.save_for_backward(t)
            return x * t[-1]

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            if not (t[1:] > t[:-1]).all():
                raise ValueError("t must increase")
            return g * (t[-1] + 1), None

    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))

    def step(x):
        loss = Scale.apply(x * w, t).sum()
        loss.backward()
        return loss

    f = hpfun.shard(step, mesh=MESH, in_specs=(P("dp"),), out_specs=P())
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(f(x).full(), step(x))  # (eager's backward writes w.grad too)
    got = w.grad.clone()
    w.grad = None
    step(x)
    torch.testing.assert_close(got / 2, w.grad)  # (two backwards: the sharded one, then eager's)


def test_a_read_of_a_value_made_from_a_parameter_says_why_it_is_not_read():
    """torch.equal of values made from a parameter (gpytorch's covar_dist compares x / lengthscale
    with itself): refused at its line, saying that values made from parameters, optimizer state or
    random numbers are not read where the arguments' are (it said hpfun reads no values at all, which
    the same read of an argument's values contradicts)."""
    w = torch.nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def kernel(x):
        a = x / w
        return torch.cdist(a, a).pow(2).sum() if torch.equal(a, x / w) else x.sum()

    _, text = _raise(hpfun.shard(kernel, mesh=MESH, in_specs=P("dp"), out_specs=P()),
                     torch.rand(8, 2, dtype=torch.float64), error=hpfun.CaptureError)
    assert "torch.equal(a, x / w)" in text and "but not from parameters, optimizer state" in text, text
    prod = torch.func.grad(lambda x: x.scatter_reduce(0, torch.zeros(2, 2, dtype=torch.long), x, "prod").sum())
    _, text = _raise(hpfun.shard(prod, mesh=MESH, in_specs=P(), out_specs=P()), torch.rand(2, 2, dtype=torch.float64),
                     error=hpfun.CaptureError)  # (read by torch's backward of a prod: not said to be a parameter's)
    assert "nor what torch's own backward reads" in text, text
    args_only = hpfun.shard(lambda x: x.sum() * (2.0 if torch.equal(x, x.clone()) else 1.0), mesh=MESH,
                            in_specs=P("dp"), out_specs=P())
    x = torch.rand(8, 2, dtype=torch.float64)
    torch.testing.assert_close(args_only(x).full(), x.sum() * 2.0)


def test_float_class_labels_are_refused_as_eager_refuses_them():
    """F.cross_entropy and F.nll_loss with float class labels: eager's message (hpfun said gather()
    wanted integer indices, from its decomposition), and with int32, int8 or bool ones too (they
    ran, where eager refuses them); uint8 ones run as eager (refused as gather() indices), but
    not over extra dims (eager refuses them there), and probabilities of the input's shape still run."""
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 8, (8,))
    for loss in (F.cross_entropy, lambda a, t: F.nll_loss(a.log_softmax(-1), t)):
        f = hpfun.shard(loss, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P())
        for target, kind in ((y.double(), "Double"), (y.int(), "Int"), (y.to(torch.int8), "Char"), (y > 3, "Bool")):
            _, text = _raise(f, x, target, error=hpfun.CaptureError)
            assert f"expected target dtype to be Long or Byte, but got {kind}" in text, text
        torch.testing.assert_close(f(x, y.to(torch.uint8)).full(), loss(x, y))
    keyword = hpfun.shard(lambda a, t: F.cross_entropy(a, target=t), mesh=MESH, in_specs=(P("dp"), P("dp")),
                          out_specs=P())
    torch.testing.assert_close(keyword(x, y.to(torch.uint8)).full(), F.cross_entropy(x, y))
    spatial = torch.randn(8, 8, 3, dtype=torch.float64)  # (over extra dims eager takes int64 only: uint8 ran)
    for loss in (F.cross_entropy, lambda a, t: F.nll_loss(a.log_softmax(1), t)):
        with pytest.raises(RuntimeError, match="expected scalar type Long but found Byte"):
            loss(spatial, torch.randint(0, 8, (8, 3), dtype=torch.uint8))
        f = hpfun.shard(loss, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P())
        _, text = _raise(f, spatial, torch.randint(0, 8, (8, 3), dtype=torch.uint8), error=hpfun.CaptureError)
        assert "expected scalar type Long but found Byte" in text, text
    probs = torch.softmax(torch.randn(8, 8, dtype=torch.float64), -1)
    f = hpfun.shard(F.cross_entropy, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P())
    torch.testing.assert_close(f(x, probs).full(), F.cross_entropy(x, probs))


def test_lstsq_says_its_outputs_have_no_traceable_shape_and_what_solves_instead():
    """torch.linalg.lstsq's rank and singular values have shapes torch decides at run time: the
    error says so and names the solves that trace (it said the function reads tensor values)."""
    a = torch.randn(6, 6, dtype=torch.float64) + 6 * torch.eye(6, dtype=torch.float64)
    f = hpfun.shard(lambda a, x: torch.linalg.lstsq(a, x).solution, mesh=MESH_TP, in_specs=(P(), P()), out_specs=P())
    _, text = _raise(f, a, torch.ones(6, 1, dtype=torch.float64), error=hpfun.CaptureError)
    assert "torch.linalg.lstsq's outputs" in text and "torch.linalg.pinv(A) @ B" in text


def test_a_tensor_a_librarys_globals_hold_is_named_where_it_is_held(monkeypatch):
    """A library keeping tensors in its own global store (pyro's param store) read inside the
    step: the refusal says where the library's globals hold the tensor read (it named only the
    library's line)."""
    import os
    import sys
    import types

    name = "hpfun_test_param_store"
    lib = types.ModuleType(name)
    lib.__file__ = os.path.join(os.sep, "lib", "site-packages", f"{name}.py")  # (a library's: not walked)
    code = ("class Store:\n    def __init__(self):\n        self._params = {}\n"
            "STORE = Store()\n"
            "def param(key):\n    return STORE._params[key]\n"
            "class Tableau:\n    def __init__(self):\n        self.c = __import__('torch').ones(3)\n"
            "class Solver:\n    TABLEAU = Tableau()\n    def step(self, x):\n        return x * self.TABLEAU.c\n")
    exec(compile(code, lib.__file__, "exec"), vars(lib))
    monkeypatch.setitem(sys.modules, name, lib)
    monkeypatch.setattr(hpfun.lift.held_at, "__defaults__", (6, 120.0))  # (the heap of a whole suite on a loaded
    # machine took more than the 2 s the search gives itself, and the place went unnamed)
    lib.STORE._params["loc"] = torch.zeros(3)
    f = hpfun.shard(lambda x: x @ lib.param("loc"), mesh=MESH_TP, in_specs=P("tp"), out_specs=P("tp"))
    _, text = _raise(f, torch.ones(4, 3), error=hpfun.CaptureError)
    assert f"it is a (3,) tensor that {name}.STORE._params['loc'] holds" in text, text
    solver = lib.Solver()  # (torchode's Dopri5.TABLEAU.c: an instance a library's class holds as a class attribute)
    g = hpfun.shard(lambda x: solver.step(x), mesh=MESH_TP, in_specs=P("tp"), out_specs=P("tp"))
    _, text = _raise(g, torch.ones(4, 3), error=hpfun.CaptureError)
    assert f"it is a (3,) tensor that {name}.Solver.TABLEAU.c holds" in text, text


def test_a_read_value_that_differs_between_ranks_is_named_by_its_place_then_its_values():
    """The line ranks compare for a value the trace read: its place and code, then ': ' and the
    value (it said 'the value read at at file:line: code: 4', split at the code's colon)."""
    from hpfun.api import _read_place
    from hpfun.runtime.distributed import _differences

    place = _read_place(' at /tmp/step.py:22: k = torch.arange(m.sum())[{"a": 1}]')
    assert place == 'the value read at /tmp/step.py:22 (k = torch.arange(m.sum())[{"a":1}])'
    (problem,) = _differences([[f"{place}: 4"], [f"{place}: 7"]])
    assert problem.where == place and "mesh rank 0: 4; mesh rank 1: 7" in problem.what
    from types import SimpleNamespace

    from hpfun.api import _read_places
    reads = [SimpleNamespace(where=" at /tmp/step.py:22: k = m.sum() + n.sum()")] * 2  # (two reads on one line: the
    first, second = _read_places(reads)  # second, equal on every rank, hid the first, which differed)
    (problem,) = _differences([[f"{first}: 4", f"{second}: 1"], [f"{first}: 7", f"{second}: 1"]])
    assert problem.where == f"{place.split(' (')[0]} (k = m.sum() + n.sum()) (read 1)", problem.where


def test_lifted_state_read_through_a_weakref_is_named_with_its_place():
    """A parameter read through a reference of its own (`weakref.ref(lin.weight)()`) reaches the
    trace as the real tensor: the error names the parameter and says to read it at its place
    (it said the tensor was neither an argument nor state, and to hold it in a module)."""
    import weakref

    lin = torch.nn.Linear(4, 2, dtype=torch.float64)
    ref = weakref.ref(lin.weight)
    f = hpfun.shard(lambda x: lin(x).sum() + ref().sum(), mesh=MESH, in_specs=P("dp"), out_specs=P())
    with pytest.raises(hpfun.CaptureError, match=r"(?s)reads lin.weight, state hpfun lifts, through a reference hpfun does "
                                                 r"not replace \(a weakref.*fix: read it at its place inside the "
                                                 r"function \(lin.weight"):
        f(torch.ones(4, 4, dtype=torch.float64))


def test_lifted_state_deleted_inside_is_refused_naming_it_and_kept():
    """`del c.t` of a tensor hpfun lifts from a closed-over object: refused naming it, with the
    fix, and the object keeps its tensor (the write-back failed inside hpfun with an
    AttributeError); set to None inside, it is None after every call, as eager leaves it."""
    c = types.SimpleNamespace(t=torch.ones(3, dtype=torch.float64))

    def deletes(x):
        y = x.sum(0) + c.t
        del c.t
        return y

    with pytest.raises(hpfun.CaptureError, match=r"(?s)c.t: is deleted by the function .*fix: delete it outside"):
        hpfun.shard(deletes, mesh=MESH, in_specs=P("dp"), out_specs=P())(torch.ones(4, 3, dtype=torch.float64))
    assert torch.equal(c.t, torch.ones(3, dtype=torch.float64))

    def empties(x):
        y = x.sum(0) + c.t
        c.t = None
        return y

    out = hpfun.shard(empties, mesh=MESH, in_specs=P("dp"), out_specs=P())(torch.ones(4, 3, dtype=torch.float64))
    assert torch.equal(out.full(), torch.full((3,), 5.0, dtype=torch.float64)) and c.t is None


class _CountsPositiveWeights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        n = (self.lin.weight > 0).sum().tolist()  # (a read of a parameter's values)
        return self.lin(x) * n


def test_a_read_in_a_models_own_line_is_not_said_to_be_in_torchs_module_call():
    """A value read by a module's own forward (JetMoE's `expert_size.tolist()`) is named at that
    line; the hint no longer adds '(the read is in nn/modules/module.py:..., _call_impl)', the
    torch frame that called the forward."""
    m = _CountsPositiveWeights()
    f = hpfun.shard(lambda x: m(x).sum(), mesh=MESH, in_specs=P("dp"), out_specs=P())
    with pytest.raises(hpfun.CaptureError) as err:
        f(torch.ones(4, 4, dtype=torch.float64))
    assert "n = (self.lin.weight > 0).sum().tolist()" in str(err.value) and "the read is in" not in str(err.value)


def test_torch_cond_and_while_loop_run_as_python_where_their_predicates_are_read():
    """`torch.cond` and `while_loop` on values made from the arguments take the branch (run the
    steps) eager takes, and a call whose values choose otherwise compiles again; on a value
    hpfun cannot read (a parameter's), refused by name with the fix (both failed inside hpfun:
    their operators hold the branches as graphs of their own)."""
    from torch._higher_order_ops import while_loop

    def branch(x):
        return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos() * 2, (x,))

    def loop(x, n):
        return while_loop(lambda i, t: i < n.sum(), lambda i, t: (i + 1, t * 2 + 1), (torch.tensor(0), x))[1]

    f = hpfun.shard(branch, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))
    g = hpfun.shard(loop, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for sign, steps in ((1, 3), (-1, 3), (1, 5)):
        x = x.abs() * sign
        n = torch.tensor([steps - 1, 1])
        torch.testing.assert_close(f(x).full(), branch(x), rtol=0, atol=0)
        torch.testing.assert_close(g(x, n).full(), loop(x, n), rtol=0, atol=0)
    assert (f.trace_count, g.trace_count) == (2, 2)
    lin = torch.nn.Linear(4, 4).double()
    h = hpfun.shard(lambda x: torch.cond(lin(x).sum() > 0, torch.sin, torch.cos, (x,)), mesh=MESH,
                    in_specs=(P("dp"),), out_specs=P("dp"))
    with pytest.raises(hpfun.CaptureError, match=r"(?s)torch.cond at .*branches on a tensor value hpfun cannot read.*"
                                                 r"torch.where"):
        h(x)


def test_flex_attention_runs_as_the_math_it_computes():
    """torch's flex_attention with a score_mod and a block mask (causal), the batch or the heads
    split: equal to eager's (it failed inside hpfun, its operator holding the score and mask
    functions as graphs of their own)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def attend(q, k, v):
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, q.shape[2], k.shape[2], device="cpu")
        return flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + 0.1 * (i - j), block_mask=mask)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 8, dtype=torch.float64, generator=g) for _ in range(3))
    want = attend(q, k, v)
    for spec in (P("dp"), P(None, "dp")):
        f = hpfun.shard(attend, mesh=MESH, in_specs=(spec,) * 3, out_specs=P())
        torch.testing.assert_close(f(q, k, v).full(), want, rtol=1e-12, atol=1e-12)


def test_a_parameter_a_flex_attention_score_mod_reads_takes_its_gradient():
    """A learned slope per head read by the score_mod (ALiBi's), trained by SGD: its gradient is
    flex's zeros_and_scatter, which had no rule (refused, even with every input replicated)."""
    from torch.nn.attention.flex_attention import flex_attention

    def make():
        slope = torch.nn.Parameter(torch.tensor([0.3, -0.2, 0.1, 0.5], dtype=torch.float64))
        opt = torch.optim.SGD([slope], lr=0.1)

        def step(x):
            out = flex_attention(x, x, x, score_mod=lambda s, b, h, i, j: s + slope[h] * (i - j))
            loss = (out ** 2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return slope, step

    x = torch.randn(4, 4, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for spec in (P("dp"), P(), P(None, "dp")):
        (slope, step), (ref_slope, ref_step) = make(), make()
        f = hpfun.shard(step, mesh=MESH, in_specs=(spec,), out_specs=P())
        for _ in range(2):
            torch.testing.assert_close(f(x).full(), ref_step(x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(slope, ref_slope, rtol=1e-12, atol=1e-12)


_DOCUMENTS = torch.tensor([0] * 50 + [1] * 70 + [2] * 8)


def _same_document(b, h, i, j):
    return (_DOCUMENTS[i] == _DOCUMENTS[j]) & (i >= j)


def test_a_block_mask_made_outside_the_step_reads_its_global_tensor_at_every_call():
    """The document mask as torch's docs write it: a mask_mod reading a global table of document
    ids, its BlockMask made once outside the step. Its mask_mod's reads are lifted as the
    function's own (refused: 'reads a tensor that is neither an argument nor state'), the table
    read at every call (edited in place between calls); given as an argument instead, the
    refusal says to close over it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(_same_document, None, None, 128, 128, device="cpu")
    attend = lambda q, k, v: flex_attention(q, k, v, block_mask=mask)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 8, dtype=torch.float64, generator=g) for _ in range(3))
    f = hpfun.shard(attend, mesh=MESH, in_specs=(P("dp"),) * 3, out_specs=P("dp"))
    saved = _DOCUMENTS.clone()
    try:
        for documents in (saved, torch.arange(128) // 32):
            _DOCUMENTS.copy_(documents)
            torch.testing.assert_close(f(q, k, v).full(), attend(q, k, v), rtol=1e-12, atol=1e-12)
    finally:
        _DOCUMENTS.copy_(saved)
    assert f.trace_count == 1
    given = hpfun.shard(lambda q, k, v, m: flex_attention(q, k, v, block_mask=m), mesh=MESH,
                        in_specs=(P("dp"),) * 3 + (None,), out_specs=P("dp"))
    with pytest.raises(hpfun.CaptureError, match=r"(?s)args\[3\].*a BlockMask.*close over the BlockMask"):
        given(q, k, v, mask)


_WINDOW = 2


def _within_window(b, h, i, j):
    return (i - j) <= _WINDOW


def _causal(b, h, i, j):
    return i >= j


def test_mask_functions_torch_combines_are_read_as_the_functions_own():
    """`and_masks(causal, window)` and `or_masks(same_document, ...)` made outside the step: torch's
    closure over the user's mask functions was not walked, so a global window changed between
    calls ran the first program, and a global document table was refused as a tensor neither
    argument nor state."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention, or_masks

    global _WINDOW
    windowed = and_masks(_causal, _within_window)
    either = create_block_mask(or_masks(_same_document, _within_window), None, None, 128, 128, device="cpu")
    fns = [lambda q, k, v: flex_attention(q, k, v, block_mask=create_block_mask(windowed, None, None, 128, 128,
                                                                                 device="cpu")),
           lambda q, k, v: flex_attention(q, k, v, block_mask=either)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 128, 8, dtype=torch.float64, generator=g) for _ in range(3))
    sharded = [hpfun.shard(fn, mesh=MESH, in_specs=(P("dp"),) * 3, out_specs=P("dp")) for fn in fns]
    try:
        for window in (2, 40):
            _WINDOW = window
            for fn, f in zip(fns, sharded, strict=True):
                torch.testing.assert_close(f(q, k, v).full(), fn(q, k, v), rtol=1e-12, atol=1e-12)
    finally:
        _WINDOW = 2
    assert [f.trace_count for f in sharded] == [2, 2]


def test_a_mask_made_from_parameters_is_refused_saying_it_is_made_from_them():
    """`torch.nonzero(lin(x) > 0)` (BLT's entropy patcher): the message said only that hpfun traces
    on shapes, where a mask made from the arguments is read, and this one is refused for being
    made from parameters."""
    lin = torch.nn.Linear(4, 1)
    f = hpfun.shard(lambda x: torch.nonzero(lin(x).squeeze(-1) > 0).shape[0] * x.sum(), mesh=MESH,
                    in_specs=(P("dp"),), out_specs=P())
    _, text = _raise(f, torch.randn(8, 4), error=hpfun.CaptureError)
    assert "not one made from parameters, optimizer state or random draws" in text and "torch.where" in text, text
