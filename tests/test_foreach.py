"""Programs run op by op are simplified (hpfun.peephole) and their independent same elementwise
ops run as one `_foreach_*` call (hpfun.foreach): results bitwise those of the ops one by one,
the program acyclic, draws and collectives in their order, and the outputs distinct tensors."""

import operator

import pytest
import torch

import hpfun
from hpfun import P, foreach, peephole
from hpfun.testing.models import adamw_init, gpt_data, gpt_init, gpt_specs, gpt_step

aten = torch.ops.aten
ONE = hpfun.Mesh.simulated((1,), ("dp",))
TWO = hpfun.Mesh.simulated((2,), ("dp",))


def _calls(program) -> list:
    return [n for n in program.module.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def _groups(program) -> list:
    return [n for n in program.module.graph.nodes if "hpfun_foreach" in n.meta]


@pytest.fixture
def unfused(monkeypatch):
    """Lowering with neither pass: the program as it was before them."""
    monkeypatch.setattr(foreach, "fuse", lambda graph, cap=None: 0)
    monkeypatch.setattr(peephole, "simplify", lambda graph, limit=peephole.MIN_CAP: 0)


def _arguments(kinds: str, shapes, dtypes, seed: int) -> list:
    """Positive tensors (every op in the table is defined there) of mixed shapes and dtypes,
    and scalars of both Python kinds."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, kind in enumerate(kinds):
        if kind == "T":
            out.append([torch.rand(s, generator=g, dtype=torch.float64).add(0.5).to(d) for s, d in zip(shapes, dtypes)])
        else:
            out.append(0.75 if i % 2 else 2)
    return out


SHAPES = [(3, 4), (4,), (), (2, 3, 4)]
DTYPES = [torch.float32, torch.float64, torch.float32, torch.float16]


@pytest.mark.parametrize("op", sorted(foreach.TABLE, key=str), ids=str)
def test_every_foreach_form_equals_its_op_bitwise(op):
    """Each form of the table, on tensors of different shapes (broadcast against each other),
    dtypes and 0-d ones, gives bitwise what the op gives member by member."""
    for kinds, (target, keywords) in foreach.TABLE[op].items():
        args = _arguments(kinds, SHAPES, DTYPES, seed=len(kinds))
        if kinds.count("T") > 1:  # a second tensor argument broadcasts against the first
            args[1] = [t.flip(-1) if t.dim() else t for t in args[1]]
        members = [[a[i] if isinstance(a, list) else a for a in args] for i in range(len(SHAPES))]
        kwargs = {"alpha": 2} if kinds == "TT" and "alpha" in keywords else {"value": 0.5} if "value" in keywords else {}
        want = [op(*m, **kwargs) for m in members]
        tensors = [a for a in args if isinstance(a, list)]
        scalars = [a for a in args if not isinstance(a, list)]
        if target is foreach._RSUB:
            got = aten._foreach_add.Scalar(aten._foreach_neg.default(tensors[0]), *scalars)
        elif target is foreach._SWAP:
            swapped = aten._foreach_add.Scalar if op is aten.add.Tensor else aten._foreach_mul.Scalar
            got = swapped(*tensors, *scalars)
        elif target is aten._foreach_pow.ScalarAndTensor:
            got = target(*scalars, *tensors)
        else:
            got = target(*tensors, *scalars, **kwargs)
        for w, h in zip(want, got, strict=True):
            assert w.dtype == h.dtype and w.shape == h.shape, (op, kinds)
            assert torch.equal(w.nan_to_num(7.0), h.nan_to_num(7.0)), (op, kinds)


def test_rsub_is_negation_then_add_with_the_sign_of_zero():
    """`s - x` run as `(-x) + s`: +0 where x == s, as subtraction gives."""
    x = torch.tensor([1.0, -0.0, 0.0, 3.5])
    for s in (1.0, 0.0, -0.0):
        want, got = aten.sub.Tensor(s, x), aten.add.Tensor(aten.neg.default(x), s)
        assert torch.equal(want, got) and torch.equal(torch.signbit(want), torch.signbit(got))


def _adamw_gpt(mesh, specs_of=gpt_specs, layers=2):
    params = gpt_init(layers=layers)
    specs = specs_of(params)
    state = {"m": specs, "v": specs, "step": P()}
    step = hpfun.shard(gpt_step, mesh=mesh, in_specs=(specs, state, P("dp"), P("dp"), None), out_specs=(specs, state, P()))
    return step, (params, adamw_init(params), *gpt_data(4, layers=layers), None)


@pytest.mark.parametrize("mesh", [ONE, TWO], ids=["1 rank", "dp 2"])
def test_adamw_step_is_bitwise_the_unfused_program(mesh, monkeypatch):
    """The reference GPT AdamW step: the optimizer's per-parameter arithmetic runs as foreach
    calls, and parameters, moments and loss are bitwise those of the program without them."""
    step, args = _adamw_gpt(mesh)
    fused = step.lower(*args).program
    new = step(*args)
    monkeypatch.setattr(foreach, "fuse", lambda graph, cap=None: 0)
    monkeypatch.setattr(peephole, "simplify", lambda graph, limit=peephole.MIN_CAP: 0)
    plain, args2 = _adamw_gpt(mesh)
    old = plain(*args2)
    assert len(_calls(fused)) < 0.75 * len(_calls(plain.lower(*args2).program))
    targets = {str(n.target) for n in _groups(fused)}
    assert {"aten._foreach_lerp.List", "aten._foreach_sqrt.default", "aten._foreach_mul.List"} <= targets or \
        {"aten._foreach_sqrt.default", "aten._foreach_mul.Scalar"} <= targets, targets
    flat_new, flat_old = torch.utils._pytree.tree_leaves(new), torch.utils._pytree.tree_leaves(old)
    for a, b in zip(flat_new, flat_old, strict=True):
        assert torch.equal(a.full(), b.full())


def test_torch_adamw_on_a_module_is_bitwise_eager():
    """`torch.optim.AdamW` stepping an `nn.Module` inside the function: the program's foreach
    calls give bitwise eager's parameters and moments."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def stepper(model, opt):
        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    eager_model, eager_opt = build()
    model, opt = build()
    eager, sharded = stepper(eager_model, eager_opt), hpfun.shard(stepper(model, opt), mesh=ONE, in_specs=(P(),), out_specs=P())
    for _ in range(3):
        assert torch.equal(eager(x), sharded(x).full())
    assert _groups(sharded.lower(x).program)
    for a, b in zip(eager_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(eager_opt.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])


def test_groups_never_reorder_draws_or_collectives(unfused, monkeypatch):
    """Ops that draw from the generator (rng="native") and collectives keep their relative order
    when grouping moves the rest; results equal the unfused program's."""
    def f(xs, w):
        outs = []
        for x in xs:
            h = torch.nn.functional.dropout(x @ w, 0.5) * 2.0 + 1.0
            outs.append((h.sqrt() * torch.rand_like(h)).sum())
        return torch.stack(outs).sum()

    xs = [torch.rand(4, 3, generator=torch.Generator().manual_seed(i)) + 0.1 for i in range(4)]
    w = torch.rand(3, 5, generator=torch.Generator().manual_seed(9))

    def run(fused: bool):
        if fused:
            monkeypatch.undo()
        torch.manual_seed(0)
        g = hpfun.shard(f, mesh=TWO, in_specs=([P("dp")] * 4, P()), out_specs=P(), rng="native")
        program = g.lower(xs, w).program
        sides = [str(n.target) for n in program.module.graph.nodes if n.op == "call_function" and not foreach._pure(n)]
        torch.manual_seed(0)
        return g(xs, w).full(), sides, program

    plain, plain_sides, _ = run(False)
    fused, fused_sides, program = run(True)
    assert _groups(program) and fused_sides == plain_sides
    assert torch.equal(plain, fused)


def test_a_group_holds_at_most_the_cap():
    """A group's results fit in `cap` bytes (whole members, in program order); a member larger
    than the cap stays alone."""
    def f(xs):
        return [x.sqrt() * 3.0 for x in xs]

    xs = [torch.rand(n) for n in (256, 256, 256, 4096, 256, 256)]  # 1 KiB each, one of 16 KiB
    g = hpfun.shard(f, mesh=ONE, in_specs=([P()] * 6,), out_specs=[P()] * 6)
    program = g.lower(xs).program
    assert _groups(program)
    for group in _groups(program):
        sizes = [foreach._nbytes(n) for n in group.users]
        assert len(sizes) > 1 and sum(sizes) <= max(foreach.MIN_CAP, sum(x.numel() * 4 for x in xs) // foreach.CAP_SHARE)
        assert 16384 not in sizes
    assert all(torch.equal(t.full(), x.sqrt() * 3.0) for t, x in zip(g(xs), xs, strict=True))


def test_peephole_folds_view_chains_and_repeats(unfused, monkeypatch):
    """A gradient transposed twice and aliased, and a weight transposed for the forward and
    again for the backward, read through one node each; repeated scalar arithmetic once."""
    def f(w, x, lr):
        def loss(w):
            return (x @ w.t()).tanh().sum()
        g = torch.func.grad(loss)(w)
        return w - (lr * 0.1) * g - (lr * 0.1) * g.sign()

    w, x, lr = torch.randn(8, 4), torch.randn(5, 4), torch.tensor(0.5, dtype=torch.float64)
    g = hpfun.shard(f, mesh=ONE, in_specs=(P(), P(), P()), out_specs=P())
    before = _calls(g.lower(w, x, lr).program)
    monkeypatch.undo()
    g2 = hpfun.shard(f, mesh=ONE, in_specs=(P(), P(), P()), out_specs=P())
    after = _calls(g2.lower(w, x, lr).program)
    count = lambda nodes, t: sum(n.target is t for n in nodes)  # noqa: E731
    assert count(after, aten.alias.default) == 0
    assert count(after, aten.permute.default) < count(before, aten.permute.default)
    assert count(after, aten.mul.Tensor) < count(before, aten.mul.Tensor)  # lr * 0.1 once
    assert torch.equal(g2(w, x, lr).full(), f(w, x, lr))


def test_outputs_stay_distinct_tensors():
    """Two outputs computed alike are two tensors, as eagerly: writing one leaves the other."""
    def f(x):
        return x * 2.0, x * 2.0, x.t().t()

    x = torch.randn(3, 3)
    a, b, c = (o.full() for o in hpfun.shard(f, mesh=ONE, in_specs=(P(),), out_specs=(P(), P(), P()))(x))
    a.add_(1.0)
    assert torch.equal(b, x * 2.0) and torch.equal(c, x)


def test_a_large_recomputation_is_kept(unfused, monkeypatch):
    """hpfun.checkpoint's recomputed activations are not merged back into the forward's (they
    are large): the memory saving stays."""
    def f(w, x):
        def loss(w):
            return hpfun.checkpoint(lambda h: (h @ w).tanh() @ w.t())(x).square().sum()
        return torch.func.grad(loss)(w)

    w, x = torch.randn(64, 64), torch.randn(128, 64)
    plain = hpfun.shard(f, mesh=ONE, in_specs=(P(), P()), out_specs=P()).lower(w, x)
    monkeypatch.undo()
    simplified = hpfun.shard(f, mesh=ONE, in_specs=(P(), P()), out_specs=P()).lower(w, x)
    count = lambda low: sum(n.target is aten.tanh.default for n in _calls(low.program))  # noqa: E731
    assert count(simplified) == count(plain) == 2
    assert simplified.memory().peak <= plain.memory().peak


def test_composed_permutes_count_dims_from_either_end():
    """`permute(permute(x, [-1, 0, 1]), [0, 1, 2])` is `permute(x, [2, 0, 1])`, not x."""
    def f(x):
        return x.permute(2, 0, 1).permute(-1, 0, 1) * 2.0, x.permute(-1, 0, 1).permute(0, 1, 2) + 1.0

    x = torch.randn(2, 3, 4)
    a, b = hpfun.shard(f, mesh=ONE, in_specs=(P(),), out_specs=(P(), P()))(x)
    want_a, want_b = f(x)
    assert torch.equal(a.full(), want_a) and torch.equal(b.full(), want_b)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_value_is_all_reduced_once(compiled):
    """The variance's backward takes the mean again: with the rows split, both means were
    all-reduced (one bucket twice as large). The second reads the first's result, compiled or
    not, and leaves the report; results equal eager."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    fn = torch.func.grad(lambda x: x.var(0).sum())
    x = torch.randn(8, 6, dtype=torch.float64)
    f = hpfun.shard(fn, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"), compile=compiled)
    moved = f.lower(x).collectives
    assert [c.kind for c in moved] == ["all_reduce"] and moved[0].bytes == 6 * 8
    calls = [n.target for n in f.lower(x).program.module.graph.nodes]
    assert calls.count(torch.ops._c10d_functional.all_reduce.default) == 1
    torch.testing.assert_close(f(x).full(), fn(x), rtol=1e-12, atol=1e-12)


def test_a_large_value_moved_again_is_kept():
    """An all-gather of a weight that a checkpointed block gathers again in its backward holds
    more than the limit: kept, as recomputing it is the memory plan."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    c10d = torch.ops._c10d_functional
    records = []
    for _ in range(2):
        node = g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "dp"))
        node.meta["hpfun_collective"] = hpfun.lower.Collective("all_gather", ("dp",), 1 << 20, "w", "mm", "")
        records.append(node.meta["hpfun_collective"])
        g.output(g.call_function(c10d.wait_tensor.default, (node,))) if _ else g.call_function(
            c10d.wait_tensor.default, (node,))
    assert peephole.dedupe_collectives(g, records) == 0 and len(records) == 2
