"""The lowered report: the per-shard program with its layouts, its collectives and their cost.

A report is data first: `Lowered.to_dict()` is a plain dict with the schema below, and every
view (`str`, `_repr_html_`, `cost()`, `.collectives`) is computed from it, so a report read back
with `Lowered.from_json` shows exactly what the original showed. Two versions of a program can
be compared by diffing their `to_json()`.

Schema "hpfun.lowered", version 6 (layouts in the compact notation, on the report's mesh;
shapes are lists of ints; node names are the per-shard graph's, which reuse the global graph's
names for the ops it came from):

    schema: "hpfun.lowered"      version: 5
    mesh: {shape: [2, 2], axis_names: ["dp", "tp"]}
    inputs: [{name, path, shape, local_shape, dtype, layout}]          one per tensor argument
    outputs: [{path, node, shape, local_shape, dtype, layout}]         one per output leaf
    nodes: [{name, kind, op, args, inputs, outputs, shapes, collective}]   the program, in order
        kind: input | coords | seed | constant | op | collective | local | output
              op: the result of a global-graph op; local: glue the lowering added (masks,
              offsets, waits, reshapes around collectives)
        op: the target ("aten.mm.default"), or null; args: each argument as text
        inputs, outputs: layouts the node reads and writes (null where not recorded: local glue)
        shapes: global shape of each output (null where not recorded)
        collective: index into `collectives` (collective nodes only), else null; a bucket's
              collective node has none (its members are listed in `buckets`)
    collectives: [{kind, axes, bytes, dtype, group_size, node, op, reason}]   in the order lowering
        emitted them (`buckets` lists them as the program issues them)
        bytes: the local buffer each rank hands to it, in `dtype`; dtype: what it moves (a
        reduction: the dtype it reduces in, float32 for a bfloat16 sum under the default
        reduce_dtype); node/op: what needed it; reason: why
    buckets: [{node, kind, axes, members, bytes, dtype, group_size, issued_after, waited_before,
               overlapped}]   every collective op the program issues, in program order
        node: its node; members: indices into `collectives` (several: a bucket, their inputs
        fused into one flat buffer; one: a collective issued alone); bytes: the buffer per rank;
        issued_after / waited_before: the nodes it is issued after and waited on before
        ("output": at the end); overlapped: ops of the global graph that run in between
    cost_model: {alpha, beta, flops, per_axis: {axis name: [alpha, beta]}}   the model the plan
        was chosen by, and `cost()`'s default
    memory: {inputs: {group: bytes}, donated, transient_peak, peak_node, at_peak: {activations,
             collective buffers, outputs, donated}, collective_peak, activation_peak, outputs,
             timeline: [bytes per node]}
        bytes per rank (every rank alike; see `hpfun.memory`): what the inputs hold, by group
        (parameters, gradients, optimizer state, buffers, or an argument's parameter name), and
        how much of it is donated (`donate_state`: freed at its last use); the most the program
        allocates on top (transient_peak, net of donated inputs already freed, at node
        peak_node, split there into what it holds, donated inputs still live included); the
        most collective buffers and activations hold at once; the new outputs' bytes; and the
        bytes the program holds at each node, in program order (net likewise)
    auto: {chosen: [{group, leaves, shape, spec, layout, same_as}], price, replicated_price,
           memory, budget, lowered_memory, seconds, stats}   only for a program with AUTO specs
        (see `hpfun.auto.AutoPlan.to_dict`): each layout chosen, by the leaves taking it

Versions only grow fields; a field's meaning never changes within a version. Version 2 added
collectives[].dtype, version 3 cost_model, version 4 buckets, version 5 memory and auto, version 6
memory.donated (the transient figures net of donated inputs freed); older versions
are read (version 2 with the default cost model; before version 4 every collective is issued
alone, where it is waited; before version 5 `memory()` is not known).
"""

from __future__ import annotations

import json
import math
import operator
import re

import attrs
import torch

from hpfun import memory
from hpfun.collectives import wire_bytes
from hpfun.drawing import lowered_html
from hpfun.errors import HpfunError, Problem, SpecError, op_name
from hpfun.layout import Layout, parse
from hpfun.lower import Collective, Program
from hpfun.mesh import Mesh
from hpfun.plan import CostModel
from hpfun.schedule import points

SCHEMA, SCHEMA_VERSION = "hpfun.lowered", 6
_READS = (2, 3, 4, 5, 6)


# ---------------------------------------------------------------------------------------------
# From a Program to the report's dict
# ---------------------------------------------------------------------------------------------


def _arg(a) -> str:
    if isinstance(a, torch.fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    return repr(a)


def _dtype(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _layouts(value) -> list[str]:
    return ["-" if l is None else l.placements_str() for l in (value if isinstance(value, tuple) else (value,))]


def _kind(node: torch.fx.Node, inputs: dict) -> str:
    if node.op == "placeholder":
        return "input" if node in inputs else node.name
    if node.op in ("output", "get_attr"):
        return {"output": "output", "get_attr": "constant"}[node.op]
    if "hpfun_collective" in node.meta or "hpfun_bucket" in node.meta:
        return "collective"
    return "op" if "hpfun_origin" in node.meta else "local"


def _node_layouts(node: torch.fx.Node, program: Program, inputs: dict):
    """(input layouts, output layouts) a node was lowered with, or (None, None) for glue."""
    if node in inputs:
        return [], [program.input_layouts[inputs[node]].placements_str()]
    if node.op == "output":
        return [l.placements_str() for l in program.output_layouts], []
    if "hpfun_step_layouts" in node.meta:
        before, after = node.meta["hpfun_step_layouts"]
        return [before.placements_str()], [after.placements_str()]
    if "hpfun_inputs" in node.meta:
        return _layouts(tuple(node.meta["hpfun_inputs"])), _layouts(node.meta["hpfun_layout"])
    if node.target is operator.getitem and isinstance(node.args[0].meta.get("hpfun_layout"), tuple):
        parent = node.args[0].meta["hpfun_layout"]
        return _layouts(parent), [parent[node.args[1]].placements_str()]
    return None, None


def _node_shapes(node: torch.fx.Node, program: Program, inputs: dict):
    """Global shape per output, aligned with its layouts (None where an output holds no tensor)."""
    if node in inputs:
        return [list(program.input_shapes[inputs[node]])]
    metas = node.meta.get("hpfun_outputs")
    if metas is None:
        return None
    shapes, layout = iter(metas), node.meta["hpfun_layout"]
    layouts = layout if isinstance(layout, tuple) else (layout,)
    return [None if l is None else list(next(shapes).shape) for l in layouts]


def _node_dict(node: torch.fx.Node, program: Program, given: dict, index: dict) -> dict:
    """`given`: the program's input placeholders -> their position; `index`: collective -> position."""
    inputs, outputs = _node_layouts(node, program, given)
    args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
    record = node.meta.get("hpfun_collective")
    return {
        "name": node.name, "kind": _kind(node, given),
        "op": None if node.op in ("placeholder", "output") else op_name(node.target),
        "args": args if node.op != "placeholder" else [],
        "inputs": inputs, "outputs": outputs,
        "shapes": _node_shapes(node, program, given),
        "collective": index[id(record)] if record is not None else None,
    }


def _tensor_dict(layout: Layout, shape, dtype) -> dict:
    return {"shape": list(shape), "local_shape": list(layout.local_shape(shape)), "dtype": _dtype(dtype),
            "layout": layout.placements_str()}


def _collective_dict(c: Collective, mesh: Mesh) -> dict:
    group = math.prod(mesh.axis_size(a) for a in c.axes)
    return {"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes, "dtype": c.dtype, "group_size": group,
            "node": c.node, "op": c.op, "reason": c.reason}


def report(program: Program, input_paths=None, input_dtypes=None, output_paths=None,
           cost_model: CostModel | None = None, input_groups=None, with_memory: bool = True,
           with_nodes: bool = True) -> dict:
    """The report's dict (schema in the module docstring) of a lowered program; argument and
    output paths ("args[0]['w1']", "outputs[1]") and input dtypes where the caller knows them.
    Without `with_nodes`, "nodes" is None (`node_dicts` makes it)."""
    n, n_out = len(program.input_layouts), len(program.output_layouts)
    nodes = list(program.module.graph.nodes)
    index = {id(c): i for i, c in enumerate(program.collectives)}
    data = {
        "schema": SCHEMA, "version": SCHEMA_VERSION,
        "mesh": {"shape": list(program.mesh.shape), "axis_names": list(program.mesh.axis_names)},
        "inputs": _inputs(program, input_paths or [f"in{i}" for i in range(n)], input_dtypes or [None] * n),
        "outputs": _outputs(program, nodes[-1].args[0], output_paths or [f"outputs[{i}]" for i in range(n_out)]),
        "nodes": node_dicts(program) if with_nodes else None,
        "collectives": [_collective_dict(c, program.mesh) for c in program.collectives],
        "buckets": _buckets(program, index),
        "cost_model": _model_dict(cost_model or CostModel()),
    }
    if with_memory:
        data["memory"] = memory.estimate(program, input_groups)
    return data


def node_dicts(program: Program) -> list[dict]:
    """The report's "nodes": every node of the per-shard program, with its layouts and shapes."""
    nodes = list(program.module.graph.nodes)
    given = {node: i for i, node in enumerate([x for x in nodes if x.op == "placeholder"][:len(program.input_layouts)])}
    index = {id(c): i for i, c in enumerate(program.collectives)}
    return [_node_dict(node, program, given, index) for node in nodes]


def _buckets(program: Program, index: dict) -> list[dict]:
    """Each collective op the program issues: alone or a bucket, where it is issued and waited."""
    out = []
    for node, at in points(program.module.graph).items():
        record = node.meta.get("hpfun_bucket") or node.meta.get("hpfun_collective")
        if record is None:
            continue
        members = getattr(record, "members", (record,))
        group = math.prod(program.mesh.axis_size(a) for a in record.axes)
        out.append({"node": node.name, "kind": record.kind, "axes": list(record.axes),
                    "members": [index[id(m)] for m in members], "bytes": record.bytes, "dtype": record.dtype,
                    "group_size": group, "issued_after": at.issued_after, "waited_before": at.waited_before,
                    "overlapped": at.overlapped})
    return out


def _model_dict(model: CostModel) -> dict:
    return {"alpha": model.alpha, "beta": model.beta, "flops": model.flops,
            "per_axis": {name: list(link) for name, link in model.per_axis}}


def _model(data: dict) -> CostModel:
    d = data.get("cost_model")
    if d is None:
        return CostModel()
    return CostModel(alpha=d["alpha"], beta=d["beta"], flops=d["flops"], per_axis=d["per_axis"])


def _inputs(program: Program, paths, dtypes) -> list[dict]:
    rows = zip(paths, program.input_layouts, program.input_shapes, dtypes, strict=True)
    return [{"name": f"in{i}", "path": path, **_tensor_dict(layout, shape, dtype)}
            for i, (path, layout, shape, dtype) in enumerate(rows)]


def _outputs(program: Program, nodes, paths) -> list[dict]:
    rows = zip(paths, nodes, program.output_layouts, program.output_shapes, program.output_dtypes, strict=True)
    return [{"path": path, "node": node.name, **_tensor_dict(layout, shape, dtype)}
            for path, node, layout, shape, dtype in rows]


def _json_value(value) -> str:
    if not isinstance(value, list) or not value:
        return json.dumps(value)
    return "[\n" + ",\n".join(f"  {json.dumps(item)}" for item in value) + "\n ]"


def _check_schema(data) -> None:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise HpfunError(Problem("report", f"not an {SCHEMA} report", "pass what Lowered.to_json() wrote"),
                         headline="cannot read the lowered report")
    if data.get("version") not in _READS:
        what = f"schema version {data.get('version')!r}; this hpfun reads versions {', '.join(map(str, _READS))}"
        raise HpfunError(Problem("report", what, "read it with the hpfun version that wrote it"),
                         headline="cannot read the lowered report")


# ---------------------------------------------------------------------------------------------
# Cost under the alpha-beta model
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class AxisCost:
    """Communication per rank over one group of mesh axes ("tp", or "dp,tp" for a collective
    over both at once)."""

    collectives: int
    bytes: int  # the buffers handed to the collectives
    wire_bytes: float  # what ring algorithms send: factor * (n - 1) / n * bytes (2x for all-reduce)
    seconds: float  # alpha per collective issued (a bucket: one) + wire bytes / beta
    issued: int | None = None  # collective ops issued: fewer than `collectives` where buckets fuse them


@attrs.frozen
class Cost:
    """What `Lowered.cost()` returns: per axis group, and totals, under `model`."""

    per_axis: dict
    model: CostModel

    @property
    def bytes(self) -> int:
        return sum(a.bytes for a in self.per_axis.values())

    @property
    def wire_bytes(self) -> float:
        return sum(a.wire_bytes for a in self.per_axis.values())

    @property
    def seconds(self) -> float:
        return sum(a.seconds for a in self.per_axis.values())

    def __str__(self) -> str:
        if not self.per_axis:
            return "communication per rank: none"
        parts = [f"{axes} {a.bytes} B in {a.collectives} collective{'s' * (a.collectives != 1)}"
                 + (f" ({a.issued} issued)" if a.issued not in (None, a.collectives) else "")
                 for axes, a in self.per_axis.items()]
        return f"communication per rank: {', '.join(parts)}; about {self.seconds * 1e6:.1f} us"


def _wire_bytes(c: dict) -> float:
    return wire_bytes(c["kind"], c["bytes"], c["group_size"])


def _seconds(c: dict, model: CostModel) -> float:
    """alpha + wire bytes / beta, with the slowest parameters among the collective's axes: the
    price propagation chose the plan by (`CostModel.collective`)."""
    return model.collective(c["kind"], c["axes"], _wire_bytes(c))


def price(collectives: list[dict], model: CostModel, buckets: list[dict] = ()) -> Cost:
    """Sum the report's collectives per axis group under `model`; the members of a bucket pay
    one alpha between them."""
    groups: dict[str, list[dict]] = {}
    for c in collectives:
        groups.setdefault(",".join(c["axes"]), []).append(c)
    fused: dict[str, int] = {}  # per axis group: collectives that ride in another's launch
    for b in buckets:
        fused[",".join(b["axes"])] = fused.get(",".join(b["axes"]), 0) + len(b["members"]) - 1
    per_axis = {}
    for axes, cs in groups.items():
        saved = fused.get(axes, 0) * model.link(cs[0]["axes"])[0]
        per_axis[axes] = AxisCost(len(cs), sum(c["bytes"] for c in cs), sum(map(_wire_bytes, cs)),
                                  sum(_seconds(c, model) for c in cs) - saved, len(cs) - fused.get(axes, 0))
    return Cost(per_axis, model)


# ---------------------------------------------------------------------------------------------
# Lowered
# ---------------------------------------------------------------------------------------------


class Lowered:
    """What `f.lower(*args)` returns: the per-shard program with every node's layouts, every
    collective with its mesh axes, bytes per rank, the op that needed it and why, and `cost()`.

    `str()` is the readable report, `to_json()` the same as data (schema in `hpfun.explain`),
    `_repr_html_` the notebook view. `program` is the runnable `Program` (None for a report
    read back with `from_json`).

    >>> import torch, hpfun
    >>> mesh = hpfun.Mesh.simulated((2,), ("tp",))
    >>> f = hpfun.shard(lambda x, w: x @ w, mesh=mesh, in_specs=(hpfun.P(), hpfun.P("tp", None)), out_specs=hpfun.P())
    >>> lowered = f.lower(torch.randn(4, 8), torch.randn(8, 3))
    >>> c = lowered.collectives[0]
    >>> c.kind, c.axes, c.bytes, c.node
    ('all_reduce', ('tp',), 48, 'outputs[0]')
    >>> lowered.cost().per_axis["tp"].bytes
    48
    >>> hpfun.Lowered.from_json(lowered.to_json()) == lowered
    True
    """

    def __init__(self, program: Program, *, input_paths=None, input_dtypes=None, output_paths=None,
                 cost_model: CostModel | None = None, input_groups=None, auto=None):
        self.program = program
        self.auto = auto  # what AUTO specs chose: an hpfun.auto.AutoPlan (runner_ups(), explain()), or None
        # the memory estimate (a run of the program on meta tensors) and the per-node listing (a
        # second or so for a 32-layer Llama step's 25,000 nodes) are made at their first use, not
        # by lower(): planning, collectives and cost() need neither
        self._data = report(program, input_paths, input_dtypes, output_paths, cost_model, with_memory=False,
                            with_nodes=False)
        self._groups, self._memory_pending = input_groups, True
        if auto is not None:
            self._data["auto"] = auto.to_dict()

    @classmethod
    def from_dict(cls, data: dict) -> "Lowered":
        """A report from `to_dict()`'s output (no runnable program)."""
        _check_schema(data)
        lowered = cls.__new__(cls)
        lowered.program, lowered._data = None, json.loads(json.dumps(data))
        lowered._memory_pending = False
        lowered.auto = None
        if "auto" in lowered._data:  # what AUTO chose (its runner-ups need the planner's problem: not kept)
            from hpfun.auto import AutoPlan

            lowered.auto = AutoPlan.from_dict(lowered._data["auto"])
        return lowered

    @classmethod
    def from_json(cls, text: str) -> "Lowered":
        """A report from `to_json()`'s output (no runnable program)."""
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as err:
            raise HpfunError(Problem("report", f"is not JSON ({err})", "pass the text Lowered.to_json() wrote"),
                             headline="cannot read the lowered report") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        """The report as plain data (a copy), in the documented schema."""
        return json.loads(json.dumps(self._full()))

    def to_json(self) -> str:
        """The report as JSON, keys in a fixed order and one line per input, output, node and
        collective: diff two versions of a program with it."""
        fields = [f" {json.dumps(k)}: {_json_value(v)}" for k, v in self._full().items()]
        return "{\n" + ",\n".join(fields) + "\n}\n"

    # -- views ----------------------------------------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        return _mesh(self._data)

    @property
    def collectives(self) -> list[Collective]:
        return [Collective(c["kind"], tuple(c["axes"]), c["bytes"], c["node"], c["op"], c["reason"], c["dtype"])
                for c in self._data["collectives"]]

    @property
    def nodes(self) -> list[dict]:
        """Every node of the per-shard program: name, kind, op, args, inputs, outputs, shapes."""
        return self.to_dict()["nodes"]

    @property
    def inputs(self) -> list[dict]:
        return self.to_dict()["inputs"]

    @property
    def outputs(self) -> list[dict]:
        return self.to_dict()["outputs"]

    def node(self, name: str) -> dict:
        """The node called `name` (as in `str(lowered)`, without the %)."""
        found = [n for n in self.nodes if n["name"] == name]
        if not found:
            raise HpfunError(f"the program has no node {name!r}", headline="no such node")
        return found[0]

    def layout(self, layout: str) -> Layout:
        """A layout string of the report as a `Layout` on its mesh."""
        return parse(layout, self.mesh)

    @property
    def graph(self) -> torch.fx.Graph:
        if self.program is None:
            raise HpfunError("a report read from JSON has no graph; lower the function again", headline="no program")
        return self.program.module.graph

    def cost(self, model: CostModel | None = None) -> Cost:
        """Bytes per mesh axis group and estimated seconds under the alpha-beta `model`
        (`hpfun.plan.CostModel(alpha, beta, per_axis={"dp": (alpha, beta)})`); by default the
        model the plan was chosen by (`shard(cost_model=...)`)."""
        if model is not None and not isinstance(model, CostModel):
            raise SpecError(Problem("cost", f"takes an hpfun.plan.CostModel, got {type(model).__name__} {model!r}",
                                    "pass CostModel(alpha, beta, per_axis={...}), or nothing for the plan's own model"))
        if model is not None and (unknown := model.unknown_axes(self.mesh)):
            raise SpecError(Problem("cost", f"the model's per_axis names {', '.join(map(repr, unknown))}, which the "
                                    f"mesh {self.mesh} has no axis of", f"name its axes {self.mesh.axis_names}"))
        return price(self._data["collectives"], model or _model(self._data), self._data.get("buckets", []))

    def _full(self) -> dict:
        """The report's dict with its nodes and memory section (made at the first call)."""
        if self._data["nodes"] is None:
            self._data["nodes"] = node_dicts(self.program)
        return self._with_memory()

    def _with_memory(self) -> dict:
        """The report's dict with its memory section (its nodes may still be to make: listing a
        deep program's nodes takes longer than the estimate)."""
        if self._memory_pending:
            self._data["memory"] = memory.estimate(self.program, self._groups)
            self._memory_pending = False
        return self._data

    def memory(self) -> memory.Memory:
        """Estimated bytes per rank: what the inputs hold, by group, and the peak the program
        allocates on top, from its liveness (`hpfun.memory`); `print()` it, or show it in a
        notebook for a plot of live bytes over the program."""
        if "memory" not in self._with_memory():
            raise HpfunError(Problem("report", f"is schema version {self._data['version']}, written before reports "
                                     "carried memory", "lower the function again"), headline="no memory estimate")
        return memory.Memory.from_dict(self._data["memory"])

    def __eq__(self, other) -> bool:
        return isinstance(other, Lowered) and self._full() == other._full()

    __hash__ = None

    def __str__(self) -> str:
        return _render_text(self._full(), self.cost())

    def __repr__(self) -> str:
        return f"<Lowered: {len(self._data['collectives'])} collectives on {self.mesh}>"

    def _repr_html_(self) -> str:
        total = self.cost()
        page = lowered_html(self._full(), total, _render_text(self._full(), total))
        return page + (self.memory()._repr_html_() if "memory" in self._data else "")


# ---------------------------------------------------------------------------------------------
# The text view
# ---------------------------------------------------------------------------------------------


def _mesh(data: dict) -> Mesh:
    return Mesh.simulated(tuple(data["mesh"]["shape"]), tuple(data["mesh"]["axis_names"]))


def _short_op(op: str) -> str:
    return op.replace("aten.", "").replace("_c10d_functional.", "c10d.")


def _render_text(data: dict, total: Cost) -> str:
    mesh = _mesh(data)
    inputs = iter(data["inputs"])
    seed_used = any(re.search(r"%seed\b", a) for n in data["nodes"] for a in n["args"])
    lines = [f"per-shard program on mesh {mesh} ({mesh.size} ranks)"]
    lines += [f"  {_node_line(node, mesh, inputs, seed_used, data)}" for node in data["nodes"]]
    lines.append(f"collectives ({len(data['collectives'])}):")
    lines += [f"  {c['kind']} over {', '.join(c['axes'])}: {c['bytes']} B {c['dtype']} for {c['node']} ({c['op']}): "
              f"{c['reason']}" for c in data["collectives"]] or ["  none"]
    if data.get("buckets"):
        fused = sum(len(b["members"]) > 1 for b in data["buckets"])
        lines.append(f"issued ({len(data['buckets'])} collective ops, {fused} of them bucket{'s' * (fused != 1)}):")
        lines += [f"  {_bucket_text(b)}" for b in data["buckets"]]
    lines.append(str(total))
    if "memory" in data:
        lines.append(str(memory.Memory.from_dict(data["memory"])))
    if "auto" in data:
        from hpfun.auto import auto_text

        lines.append(auto_text(data["auto"]))
    return "\n".join(lines)


def _bucket_text(b: dict) -> str:
    what = f"{b['kind']} over {', '.join(b['axes'])}, {b['bytes']} B {b['dtype']}"
    if len(b["members"]) > 1:
        what = f"bucket of {len(b['members'])} {what} (collectives {', '.join(map(str, b['members']))})"
    else:
        what = f"{what} (collective {b['members'][0]})"
    waited = "at the end" if b["waited_before"] == "output" else f"before %{b['waited_before']}"
    return (f"%{b['node']}: {what}; issued after %{b['issued_after']}, waited {waited}, "
            f"{b['overlapped']} op{'s' * (b['overlapped'] != 1)} in between")


def _node_line(node: dict, mesh: Mesh, inputs, seed_used: bool, data: dict) -> str:
    kind, name = node["kind"], node["name"]
    if kind == "input":
        x = next(inputs)
        dtype = f" {x['dtype']}" if x["dtype"] else ""
        return f"%{name}: global {x['shape']} {x['layout']}, local {x['local_shape']}{dtype}  ({x['path']})"
    if kind == "coords":
        return "%coords: this rank's mesh coordinates"
    if kind == "seed":
        return "%seed: this call's random seed" + ("" if seed_used else " (unused)")
    if kind == "output":
        back = " (written back)"
        returned = [f"%{o['node']} {o['layout']}" for o in data["outputs"] if not o["path"].endswith(back)]
        written = [f"{o['path'][:-len(back)]} <- %{o['node']} {o['layout']}" for o in data["outputs"]
                   if o["path"].endswith(back)]
        return "return " + ", ".join(returned) + (f"; written back: {', '.join(written)}" if written else "")
    text = f"%{name} = {_short_op(node['op'])}({', '.join(node['args'])})"
    if kind == "collective" and node["collective"] is None:  # a bucket
        b = next(b for b in data.get("buckets", []) if b["node"] == name)
        return f"{text}    # {_bucket_text(b).split(': ', 1)[1].split(';')[0]}"
    if kind == "collective":
        c = data["collectives"][node["collective"]]
        step = f"{node['inputs'][0]} -> {node['outputs'][0]}"
        return f"{text}    # {c['kind']} over {', '.join(c['axes'])}, {c['bytes']} B {c['dtype']}: {step}"
    if node["outputs"] is not None:
        reads = ", ".join(node["inputs"])
        return f"{text}    # {reads + ' ' if reads else ''}-> {_outputs_text(node, mesh)}"
    return text


def _outputs_text(node: dict, mesh: Mesh) -> str:
    if node["shapes"] is None:
        return ", ".join(node["outputs"])
    def local(lay, shape):
        return lay if shape is None else f"{lay} local {list(parse(lay, mesh).local_shape(shape))}"

    return ", ".join(local(lay, shape) for lay, shape in zip(node["outputs"], node["shapes"], strict=True))
