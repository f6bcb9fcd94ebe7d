"""`solver="exact"`: the whole graph's strategies chosen at once (an integer program over every
op's candidates, HiGHS), started from the greedy plan: never dearer than it by the cost model,
optimal over the candidates (checked by brute force on a real graph), and equal to the
unsharded run. The reference GPT's plans under it are in test_models.py."""

import pytest
import torch

import hpfun
from hpfun import P
from hpfun import solve as milp
from hpfun.capture import capture
from hpfun.exact import _problem
from hpfun.propagate import _Graph, solve
from hpfun.rules import REGISTRY

MESH = hpfun.Mesh.simulated((2,), ("tp",))


def mlp(x, w1, w2):
    return (torch.relu(x @ w1) @ w2).sum(0)


def _graph(fn, args, specs, outputs):
    gm = capture(fn, [(tuple(t.shape), t.dtype) for t in args], None)
    layouts = [spec.to_layout(MESH, t.ndim) for spec, t in zip(specs, args, strict=True)]
    return gm, layouts, [o.to_layout(MESH, 1) for o in outputs]


def test_the_exact_choice_is_the_brute_force_optimum_over_the_same_candidates():
    """On a small MLP, every combination of the candidates the exact stage poses is priced by
    `total_price`; the solver's choice is the cheapest of them, and no dearer than greedy."""
    args = [torch.randn(8, 6), torch.randn(6, 4), torch.randn(4, 2)]
    gm, layouts, outputs = _graph(mlp, args, (P(None, "tp"), P("tp"), P()), (P(),))
    graph = _Graph(gm, MESH, layouts, REGISTRY, None, "float32", outputs, hpfun.CostModel())
    greedy, _ = graph.greedy({}, {})
    problem, start, _ = _problem(graph, greedy)
    combinations = 1
    for c in problem.candidates.values():
        combinations *= len(c)
    assert 50 < combinations <= 200_000  # a real choice, and small enough to try every one
    _, best = milp.brute_force(problem)
    found = milp.solve(problem, start=start)
    assert found.price == pytest.approx(best, rel=1e-9)
    assert found.price <= milp.total_price(problem, start) * (1 + 1e-12)


def test_exact_is_never_dearer_than_greedy_and_runs_equal():
    args = [torch.randn(8, 6), torch.randn(6, 4), torch.randn(4, 2)]
    gm, layouts, outputs = _graph(mlp, args, (P(None, "tp"), P("tp"), P()), (P(),))
    greedy = solve(gm, MESH, layouts, outputs=outputs)
    exact = solve(gm, MESH, layouts, outputs=outputs, exact=True)
    assert exact.price <= greedy.price
    f = hpfun.shard(mlp, mesh=MESH, in_specs=(P(None, "tp"), P("tp"), P()), out_specs=P(), solver="exact")
    torch.testing.assert_close(f(*args).full(), mlp(*args))


def test_a_bad_solver_is_named():
    with pytest.raises(hpfun.SpecError, match="solver must be 'greedy' or 'exact'"):
        hpfun.shard(mlp, mesh=MESH, in_specs=(P(), P(), P()), solver="ilp")
    with pytest.raises(hpfun.SpecError, match="cost_model must be an hpfun.plan.CostModel"):
        hpfun.shard(mlp, mesh=MESH, in_specs=(P(), P(), P()), cost_model={"alpha": 1})


@pytest.mark.parametrize("bad", [{"beta": 0}, {"alpha": -1.0}, {"flops": 0}, {"per_axis": {"dp": 3}},
                                 {"per_axis": {"dp": (1e-6, 0.0)}}])
def test_a_bad_cost_model_is_named(bad):
    """A price that would divide by zero or go negative is refused where the model is made."""
    with pytest.raises(ValueError, match="CostModel"):
        hpfun.CostModel(**bad)


def test_exact_keeps_the_walks_plan_where_buckets_make_it_cheaper():
    """Both solvers price each collective with its own alpha. On a data-parallel GPT step the
    walk's plan is 2L+6 gradient all-reduces, which the scheduler fuses into a few buckets; the
    exact stage's cheaper-looking plan moves activations, which do not bucket. The two lowered
    plans are compared by their price less what their buckets save: the walk's is kept, so
    `cost()` is never worse than the default solver's. Without buckets (`bucket_bytes=0`) the
    exact stage's plan is the cheaper one and is kept."""
    from hpfun.testing import models as M

    sizes = dict(layers=1, d=32, seq=16, vocab=128)
    params = {k: v.double() for k, v in M.gpt_init(**sizes).items()}
    state = M.adamw_init(params)
    idx, tgt = M.gpt_data(batch=4, **sizes)
    ps = M.gpt_specs(params)
    specs = (ps, {"m": ps, "v": ps, "step": P()})
    mesh = hpfun.Mesh.simulated((2,), ("dp",))

    def lowered(**options):
        f = hpfun.shard(M.gpt_step, mesh=mesh, in_specs=(*specs, P("dp"), P("dp")), out_specs=(*specs, P()), **options)
        return f, f.lower(params, state, idx, tgt)

    _, walk = lowered()
    f, exact = lowered(solver="exact")
    assert exact.cost().seconds <= walk.cost().seconds * (1 + 1e-9)
    assert {c.kind for c in exact.collectives} == {"all_reduce"}
    new_params, _, loss = f(params, state, idx, tgt)
    ref_params, _, ref_loss = M.gpt_step(params, state, idx, tgt)
    torch.testing.assert_close(loss.full(), ref_loss, rtol=1e-9, atol=1e-12)
    for k in params:
        torch.testing.assert_close(new_params[k].full(), ref_params[k], rtol=1e-9, atol=1e-12)
    _, walk = lowered(bucket_bytes=0)
    _, exact = lowered(solver="exact", bucket_bytes=0)
    assert exact.cost().seconds < walk.cost().seconds
    assert {c.kind for c in exact.collectives} != {"all_reduce"}  # the exact stage's own plan


def test_a_partial_output_without_out_specs_is_not_paid_for_by_either_plan():
    """Both solvers charge for resolving a Partial output given no out_specs, which the program
    returns as it is: the walk's plan (the dot product left Partial, nothing moved) is not
    beaten by the exact stage's (resolved inside, an all-reduce) once that charge is taken off."""
    mesh = hpfun.Mesh.simulated((8,), ("dp",))
    args = (torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64))
    f = hpfun.shard(lambda a, b: torch.einsum("a,a->", -a, b), mesh=mesh, in_specs=(P("dp"), P()), out_specs=None,
                    solver="exact")
    assert f.lower(*args).collectives == []
    torch.testing.assert_close(f(*args).full(), torch.einsum("a,a->", -args[0], args[1]))
