"""The verifier (`hpfun.verify`): it passes what hpfun builds, and catches a broken annotation
or program, naming the node and the user's line. The whole suite runs with it on (conftest)."""

import pytest
import torch

import hpfun
import hpfun.api
from hpfun import P, Partial, Replicate, Shard
from hpfun.layout import Layout
from hpfun.verify import VerificationError, enabled, verify_annotation, verify_program

MESH = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))


def mlp(x, w1, w2):
    h = torch.relu(x @ w1)  # the line a violation names
    return h @ w2


def _sharded():
    return hpfun.shard(mlp, mesh=MESH, in_specs=(P("dp"), P(None, "tp"), P("tp", None)), out_specs=P("dp"))


ARGS = (torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16))


def test_the_suite_verifies_every_compile():
    assert enabled()


def test_hpfun_output_passes():
    lowered = _sharded().lower(*ARGS)
    verify_program(lowered.program)


def _corrupting(monkeypatch, corrupt):
    """Make propagation's annotation broken by `corrupt(gm)` before the verifier sees it."""
    real = hpfun.api.propagate

    def broken(gm, *args, **kwargs):
        real(gm, *args, **kwargs)
        corrupt(gm)

    monkeypatch.setattr(hpfun.api, "propagate", broken)


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def test_a_layout_that_is_not_the_strategys(monkeypatch):
    def corrupt(gm):
        relu = next(n for n in gm.graph.nodes if "relu" in n.name)
        relu.meta["hpfun_layout"] = Layout(MESH, (Replicate(), Replicate()))

    _corrupting(monkeypatch, corrupt)
    with pytest.raises(VerificationError, match=r"relu.*from .*test_verify.py:\d+ in mlp.*not its strategy's outputs"):
        _sharded().lower(*ARGS)


def test_a_split_of_a_dim_the_value_lacks(monkeypatch):
    def corrupt(gm):
        mm = next(n for n in gm.graph.nodes if n.op == "call_function" and "mm" in n.name)
        mm.meta["hpfun_layout"] = Layout(MESH, (Shard(5), Replicate()))

    _corrupting(monkeypatch, corrupt)
    with pytest.raises(VerificationError, match="splits dim 5 of a 2-dim value"):
        _sharded().lower(*ARGS)


def test_a_strategy_with_the_wrong_inputs(monkeypatch):
    def corrupt(gm):
        relu = next(n for n in gm.graph.nodes if "relu" in n.name)
        strategy = relu.meta["hpfun_strategy"]
        relu.meta["hpfun_strategy"] = type(strategy)(strategy.inputs * 2, strategy.outputs)

    _corrupting(monkeypatch, corrupt)
    with pytest.raises(VerificationError, match="strategy takes 2 inputs, the op has 1 tensors"):
        _sharded().lower(*ARGS)


def test_every_problem_in_one_report(monkeypatch):
    def corrupt(gm):
        for n in gm.graph.nodes:
            if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor):
                n.meta["hpfun_layout"] = Layout(MESH, (Shard(7), Replicate()))

    _corrupting(monkeypatch, corrupt)
    with pytest.raises(VerificationError) as info:
        _sharded().lower(*ARGS)
    assert len(info.value.problems) >= 3


def test_a_collective_on_the_wrong_layout():
    """A collective whose input is not in the layout its step starts from."""
    program = _sharded().lower(*ARGS).program
    collective = next(n for n in program.module.graph.nodes if "hpfun_step" in n.meta)
    before, after = collective.meta["hpfun_step_layouts"]
    collective.meta["hpfun_step_layouts"] = (Layout(MESH, (Replicate(), Replicate())), after)
    with pytest.raises(VerificationError, match="precondition fails|expects"):
        verify_program(program)


def test_an_op_run_on_other_layouts_than_its_strategys():
    program = _sharded().lower(*ARGS).program
    op = next(n for n in program.module.graph.nodes if "hpfun_args" in n.meta and n.meta["hpfun_inputs"])
    op.meta["hpfun_inputs"] = tuple(Layout(MESH, (Partial("sum"), Shard(0))) for _ in op.meta["hpfun_inputs"])
    with pytest.raises(VerificationError, match="its strategy needs"):
        verify_program(program)


def test_a_local_shape_that_is_not_the_layouts_block():
    """A view in the per-shard program with the wrong local shape is caught by running the
    program on fake tensors of the inputs' local shapes."""
    program = _sharded().lower(*ARGS).program
    mm = next(n for n in program.module.graph.nodes if n.meta.get("hpfun_origin", "").startswith("mm"))
    mm.meta["hpfun_layout"] = Layout(MESH, (Replicate(), Replicate()))
    with pytest.raises(VerificationError, match=r"(?s)its strategy needs.*local shape \(4, 16\), but \[R, R\] of \(8, 32\) is \(8, 32\)"):
        verify_program(program)


def test_verify_annotation_directly():
    """The annotation check on a graph hpfun propagated (what `shard` runs after propagation)."""
    from hpfun.capture import trace
    from hpfun.propagate import propagate

    gm = trace(mlp, [(tuple(a.shape), a.dtype) for a in ARGS]).gm
    layouts = [Layout(MESH, (Shard(0), Replicate())), Layout(MESH, (Replicate(), Shard(1))),
               Layout(MESH, (Replicate(), Shard(0)))]
    propagate(gm, MESH, layouts)
    verify_annotation(gm, MESH)
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    placeholder.meta["hpfun_layout"] = None
    with pytest.raises(VerificationError, match="has no layout"):
        verify_annotation(gm, MESH)


def _local_values(program, share: bool, monkeypatch) -> dict:
    from hpfun import verify

    for node in program.module.graph.nodes:
        node.meta.pop("val", None)
    with monkeypatch.context() as m:
        if not share:
            real = verify._OnMeta.__init__

            def unshared(self, *args, **kwargs):
                real(self, *args, **kwargs)
                self._seen = None

            m.setattr(verify._OnMeta, "__init__", unshared)
        verify.meta_run(program)
    return {n.name: [(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
                     for t in torch.utils._pytree.tree_leaves(n.meta.get("val")) if isinstance(t, torch.Tensor)]
            for n in program.module.graph.nodes}


@pytest.mark.parametrize("seq_split", [None, P(None, "tp")], ids=["tp", "tp+sp"])
def test_a_meta_run_that_shares_results_gives_every_node_the_same_metadata(seq_split, monkeypatch):
    """The meta run reuses an op's result for inputs of the same metadata (repeated layers):
    every node's local shape, strides, offset and dtype are what running each op gives."""
    from hpfun.testing.models import adamw_init, gpt_data, gpt_init, gpt_specs, gpt_step

    params, (idx, targets) = gpt_init(layers=3), gpt_data(4)
    specs = gpt_specs(params, tp="tp")
    state = {"m": specs, "v": specs, "step": P()}
    step = hpfun.shard(gpt_step, mesh=MESH, in_specs=(specs, state, P("dp"), P("dp"), None),
                       out_specs=(specs, state, P()))
    program = step.lower(params, adamw_init(params), idx, targets, seq_split).program
    shared, alone = _local_values(program, True, monkeypatch), _local_values(program, False, monkeypatch)
    assert sum(bool(v) for v in alone.values()) > 1000
    assert shared == alone


def test_a_program_that_restrides_in_place_shares_no_results():
    from hpfun import verify

    gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten.t_.default(torch.ops.aten.clone.default(x)))
    assert verify._OnMeta(gm)._seen is None
    gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten.add_.Tensor(torch.ops.aten.clone.default(x), 1))
    assert verify._OnMeta(gm)._seen == {}
