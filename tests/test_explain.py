"""The lowered report on the reference MLP: every field against hand-computed values, the cost
model, the JSON export's round trip and schema, and the text and HTML views."""

import doctest
import json

import pytest
import torch

import hpfun
from hpfun import P, explain
from hpfun.plan import CostModel
from hpfun.testing.models import MLP_LAYOUTS, mlp_data, mlp_init, mlp_step

B, D, F, C = 8, 16, 32, 8
F32 = 4
KINDS = {"input", "coords", "seed", "constant", "op", "collective", "local", "output"}


def _lowered(layout, shape=(2, 2)):
    mesh = hpfun.Mesh.simulated(shape, ("dp", "tp"))
    pspec, xspec, yspec = MLP_LAYOUTS[layout]
    # planned by bytes alone: the collectives below are the byte-minimal plan's (test_mlp.py);
    # each issued alone, where it is needed (buckets and overlap: tests/test_bucket.py, test_overlap.py)
    step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()),
                       cost_model=CostModel(alpha=0.0), bucket_bytes=0, overlap=False)
    return step.lower(mlp_init(D, F, C), *mlp_data(B, D, C))


@pytest.fixture(scope="module")
def dp_tp():
    return _lowered("dp_tp")


@pytest.fixture(scope="module")
def dp_class():
    return _lowered("dp_class")


def test_inputs_and_outputs(dp_tp):
    """Inputs and outputs carry their path, global and local shapes, dtype and layout."""
    got = [(x["name"], x["path"], x["shape"], x["local_shape"], x["dtype"], x["layout"]) for x in dp_tp.inputs]
    assert got == [
        ("in0", "args[0]['w1']", [D, F], [D, F // 2], "float32", "[R, S(1)]"),
        ("in1", "args[0]['b1']", [F], [F // 2], "float32", "[R, S(0)]"),
        ("in2", "args[0]['w2']", [F, C], [F // 2, C], "float32", "[R, S(0)]"),
        ("in3", "args[0]['b2']", [C], [C], "float32", "[R, R]"),
        ("in4", "args[1]", [B, D], [B // 2, D], "float32", "[S(0), R]"),
        ("in5", "args[2]", [B], [B // 2], "int64", "[S(0), R]"),
    ]
    got = [(x["path"], x["shape"], x["local_shape"], x["dtype"], x["layout"]) for x in dp_tp.outputs]
    assert got == [
        ("outputs[0]['w1']", [D, F], [D, F // 2], "float32", "[R, S(1)]"),
        ("outputs[0]['b1']", [F], [F // 2], "float32", "[R, S(0)]"),
        ("outputs[0]['w2']", [F, C], [F // 2, C], "float32", "[R, S(0)]"),
        ("outputs[0]['b2']", [C], [C], "float32", "[R, R]"),
        ("outputs[1]", [], [], "float32", "[R, R]"),
    ]
    names = [n["name"] for n in dp_tp.nodes]
    assert all(o["node"] in names for o in dp_tp.outputs)


def test_collectives_against_hand_computed(dp_tp):
    """Kind, axes, bytes per rank, group size, the node and op that needed each, and why."""
    got = [(c["kind"], c["axes"], c["bytes"], c["group_size"], c["node"], c["op"]) for c in dp_tp.to_dict()["collectives"]]
    params = [("w1", D * F // 2), ("b1", F // 2), ("w2", F // 2 * C), ("b2", C)]
    assert got == [
        # Megatron's forward all-reduce, before the log-softmax (fused: its dim is whole)
        ("all_reduce", ["tp"], B // 2 * C * F32, 2, "_log_softmax", "aten._log_softmax.default"),
        ("all_reduce", ["dp"], F32, 2, "div", "aten.div.Tensor"),  # the global count of labels
    ] + [("all_reduce", ["dp"], n * F32, 2, f"outputs[0]['{k}']", "output") for k, n in params] + [
        ("all_reduce", ["dp"], F32, 2, "outputs[1]", "output"),
    ]
    reasons = [c.reason for c in dp_tp.collectives]
    assert reasons[0].startswith("aten._log_softmax.default needs [S(0), R], ") and reasons[0].endswith(" is [S(0), P(sum)]")
    assert reasons[2].startswith("out_specs of outputs[0]['w1'] needs [R, S(1)], ") and reasons[2].endswith("[P(sum), S(1)]")


def test_every_node_has_its_layouts(dp_tp):
    """Ops show the layouts they read and write and their global shapes; collectives their step."""
    nodes = dp_tp.nodes
    assert {n["kind"] for n in nodes} <= KINDS
    assert [n["kind"] for n in nodes[:8]] == ["input"] * 6 + ["coords", "seed"] and nodes[-1]["kind"] == "output"
    for n in nodes:
        if n["kind"] == "op":
            assert n["outputs"] and n["inputs"] is not None and len(n["shapes"]) == len(n["outputs"]), n
    mm = dp_tp.node("mm")
    assert (mm["op"], mm["args"], mm["inputs"], mm["outputs"], mm["shapes"]) == (
        "aten.mm.default", ["%in4", "%in0"], ["[S(0), R]", "[R, S(1)]"], ["[S(0), S(1)]"], [[B, F]])
    assert dp_tp.node("in0")["outputs"] == ["[R, S(1)]"] and dp_tp.node("in0")["shapes"] == [[D, F]]
    collective_nodes = [n for n in nodes if n["kind"] == "collective"]
    assert [n["collective"] for n in collective_nodes] == list(range(7))
    assert (collective_nodes[0]["inputs"], collective_nodes[0]["outputs"]) == (["[S(0), P(sum)]"], ["[S(0), R]"])
    assert nodes[-1]["inputs"] == [x["layout"] for x in dp_tp.outputs]
    with pytest.raises(hpfun.HpfunError, match="no node"):
        dp_tp.node("nope")


def test_cost_per_axis(dp_tp):
    """Bytes per mesh axis, wire bytes of ring algorithms, and alpha-beta seconds, per-axis settable."""
    cost = dp_tp.cost(CostModel())
    assert dp_tp.cost().seconds == pytest.approx(cost.wire_bytes / 1e10)  # by default, the model it was planned by
    tp_bytes, dp_bytes = B // 2 * C * F32, F32 + (D * F // 2 + F // 2 + F // 2 * C + C) * F32 + F32
    assert {k: (a.collectives, a.bytes) for k, a in cost.per_axis.items()} == {"tp": (1, tp_bytes), "dp": (6, dp_bytes)}
    assert cost.per_axis["tp"].wire_bytes == 2 * (1 / 2) * tp_bytes  # all-reduce over 2 ranks
    default = CostModel()
    assert cost.per_axis["dp"].seconds == pytest.approx(6 * default.alpha + dp_bytes / default.beta)
    assert cost.bytes == tp_bytes + dp_bytes and cost.seconds == pytest.approx(sum(a.seconds for a in cost.per_axis.values()))
    slow_dp = dp_tp.cost(CostModel(alpha=1e-6, beta=1e11, per_axis={"dp": (1e-5, 1e9)}))
    assert slow_dp.per_axis["dp"].seconds == pytest.approx(6e-5 + dp_bytes / 1e9)
    assert slow_dp.per_axis["tp"].seconds == pytest.approx(1e-6 + tp_bytes / 1e11)
    assert str(cost).startswith(f"communication per rank: tp {tp_bytes} B in 1 collective, dp {dp_bytes} B in 6 collectives")


def test_cost_of_collectives_over_two_axes(dp_class):
    """A collective over dp and tp at once counts under "dp,tp", priced by its slower axis."""
    cost = dp_class.cost(CostModel(alpha=0.0, beta=1e9, per_axis={"tp": (0.0, 1e10)}))
    both = F32  # the loss: Partial over both axes
    assert (cost.per_axis["dp,tp"].collectives, cost.per_axis["dp,tp"].bytes) == (1, both)
    assert cost.per_axis["dp,tp"].wire_bytes == pytest.approx(2 * 3 / 4 * both)
    assert cost.per_axis["dp,tp"].seconds == pytest.approx(2 * 3 / 4 * both / 1e9)


def test_no_collectives():
    """A program without communication reports none and costs nothing."""
    lowered = _lowered("dp", shape=(1, 1))
    assert lowered.collectives == [] and lowered.cost().per_axis == {} and lowered.cost().seconds == 0
    assert "collectives (0):\n  none\ncommunication per rank: none" in str(lowered)


def test_json_round_trip(dp_tp):
    """from_json(to_json()) gives an equal report: same fields, text, cost and collectives."""
    text = dp_tp.to_json()
    back = hpfun.Lowered.from_json(text)
    assert back == dp_tp and back.to_dict() == dp_tp.to_dict() == json.loads(text)
    assert str(back) == str(dp_tp) and back.cost() == dp_tp.cost() and back.collectives == dp_tp.collectives
    assert back.mesh == hpfun.Mesh.simulated((2, 2), ("dp", "tp")) and back.to_json() == text
    assert back._repr_html_() == dp_tp._repr_html_()
    assert back.program is None
    with pytest.raises(hpfun.HpfunError, match="no graph"):
        _ = back.graph


def test_json_schema_is_versioned_and_diffable(dp_tp):
    """The export names its schema and version; one line per input, output, node and collective."""
    data = dp_tp.to_dict()
    assert (data["schema"], data["version"]) == ("hpfun.lowered", explain.SCHEMA_VERSION) == ("hpfun.lowered", 6)
    assert list(data) == ["schema", "version", "mesh", "inputs", "outputs", "nodes", "collectives", "buckets",
                          "cost_model", "memory"]
    assert data["cost_model"] == {"alpha": 0.0, "beta": 1e10, "flops": 1e10, "per_axis": {}}  # the plan's
    assert set(data["nodes"][0]) == {"name", "kind", "op", "args", "inputs", "outputs", "shapes", "collective"}
    assert set(data["collectives"][0]) == {"kind", "axes", "bytes", "dtype", "group_size", "node", "op", "reason"}
    lines = dp_tp.to_json().splitlines()
    items = sum(len(data[k]) for k in ("inputs", "outputs", "nodes", "collectives", "buckets"))
    assert len(lines) == 2 + 5 + 5 * 2 + items  # braces, 5 one-line fields, 5 lists opened and closed
    del data["memory"]
    data["version"] = 4  # a version 4 report (no memory) reads back; memory() says to lower again
    assert hpfun.Lowered.from_dict(data).cost() == dp_tp.cost()
    del data["buckets"]
    data["version"] = 3  # a version 3 report (no buckets): each collective issued alone
    assert hpfun.Lowered.from_dict(data).cost() == dp_tp.cost()
    del data["cost_model"]
    data["version"] = 2  # a version 2 report (no cost_model) reads back with the default model
    assert hpfun.Lowered.from_dict(data).cost() == dp_tp.cost(CostModel())
    data["version"] = 99
    with pytest.raises(hpfun.HpfunError, match="schema version 99"):
        hpfun.Lowered.from_dict(data)
    with pytest.raises(hpfun.HpfunError, match="not an hpfun.lowered report"):
        hpfun.Lowered.from_json("{}")


def test_text_view(dp_tp):
    """str() shows inputs with their paths, every op's layouts in and out, collectives and cost."""
    text = str(dp_tp)
    assert "  %in0: global [16, 32] [R, S(1)], local [16, 16] float32  (args[0]['w1'])" in text
    assert "  %mm = mm.default(%in4, %in0)    # [S(0), R], [R, S(1)] -> [S(0), S(1)] local [4, 16]" in text
    assert "# all_reduce over tp, 128 B float32: [S(0), P(sum)] -> [S(0), R]" in text
    assert "collectives (7):" in text and text.endswith(str(dp_tp.memory()))
    assert f"\n{dp_tp.cost()}\nmemory per rank" in text
    assert repr(dp_tp) == "<Lowered: 7 collectives on {dp: 2, tp: 2}>"


def test_html_view(dp_tp):
    """The notebook view has the cost, every collective with its reason, and the program."""
    page = dp_tp._repr_html_()
    assert page.startswith('<div class="hpfun-lowered">')
    for c in dp_tp.collectives:
        assert c.reason.replace("'", "&#x27;") in page
    assert "args[0][&#x27;w1&#x27;]" in page and "per-shard program" in page and "wire bytes" in page


def test_layout_helper_and_graph(dp_tp):
    """Report layouts parse back to Layouts on the mesh; a live report keeps its fx graph."""
    assert dp_tp.layout("[S(0), R]") == P("dp", None).to_layout(dp_tp.mesh, 2)
    assert len(dp_tp.graph.nodes) == len(dp_tp.nodes)


def test_random_programs_report_their_seed():
    """A program drawing random numbers uses its seed input; others say it is unused."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    lowered = hpfun.shard(lambda x: x * torch.rand_like(x), mesh=mesh, in_specs=P("dp")).lower(torch.ones(4))
    assert "%seed: this call's random seed\n" in str(lowered)
    assert "(unused)" in str(hpfun.shard(lambda x: x * 2, mesh=mesh, in_specs=P("dp")).lower(torch.ones(4)))


@pytest.mark.parametrize("module", ["hpfun.explain", "hpfun.visualize", "hpfun.debug"])
def test_docstring_examples(module):
    """The runnable examples in the report, visualize and debug modules' docstrings pass."""
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


def test_reasons_name_inputs_by_their_path():
    """A collective on an argument names it by its path, not the traced graph's placeholder."""
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    f = hpfun.shard(lambda d: torch.cumsum(d["x"], 0), mesh=mesh, in_specs=({"x": P("tp")},), out_specs=P())
    (c,) = f.lower({"x": torch.ones(4)}).collectives
    assert (c.kind, c.reason) == ("all_gather", "aten.cumsum.default needs [R], args[0]['x'] is [S(0)]")


def test_ops_with_outputs_that_hold_no_tensor():
    """convolution_backward without grad_input: its missing outputs show as "-" with no shape."""
    import torch.nn.functional as F

    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    grad_w = hpfun.shard(lambda x, w: torch.func.grad(lambda w: F.conv2d(x, w).sum())(w), mesh=mesh, in_specs=(P("dp"), P()))
    lowered = grad_w.lower(torch.randn(4, 3, 6, 6), torch.randn(5, 3, 3, 3))
    (node,) = [n for n in lowered.nodes if n["op"] == "aten.convolution_backward.default"]
    assert (node["outputs"], node["shapes"]) == (["-", "[P(sum)]", "-"], [None, [5, 3, 3, 3], None])
    assert "-> -, [P(sum)] local [5, 3, 3, 3], -" in str(lowered)
    assert hpfun.Lowered.from_json(lowered.to_json()) == lowered
