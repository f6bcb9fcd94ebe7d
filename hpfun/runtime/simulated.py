"""The simulated runtime: every rank of the mesh in one process, in lockstep.

The per-shard program is cut at its collectives. The pieces in between run per rank; a
collective computes every rank's result from the values of the ranks in its group (the ranks
that differ only along the collective's mesh axes).
"""

from __future__ import annotations

import torch
from torch.fx.passes.split_module import split_module

from hpfun.mesh import Mesh
from hpfun.runtime import failure

c10d = torch.ops._c10d_functional


def _reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    if tensors[0].is_complex():  # as the pairs of floats they are, as gloo and NCCL sum them (a complex
        # `a + b` is a + 1 * b, and 1 * (inf + 1j) is inf + nanj: torch's 0 * inf)
        return torch.view_as_complex(_reduce([torch.view_as_real(t.resolve_conj()) for t in tensors], op).contiguous())
        # (a conjugate view, `x.sum(0).conj()` of a split x, is read as its values)
    if op in ("sum", "avg"):
        total = tensors[0].clone()
        for t in tensors[1:]:
            total = total + t
        return total / len(tensors) if op == "avg" else total
    stacked = torch.stack(tensors)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def _all_reduce(xs, op):
    total = _reduce(xs, op)
    return [total.clone() for _ in xs]


def _all_gather(xs):
    full = torch.cat(xs, 0)
    return [full.clone() for _ in xs]


def _reduce_scatter(xs, op):
    return [c.clone() for c in _reduce(xs, op).chunk(len(xs), 0)]


def _all_to_all(xs, out_splits, in_splits):
    pieces = [x.split(list(in_splits), 0) for x in xs]
    return [torch.cat([p[j] for p in pieces], 0) for j in range(len(xs))]


# target -> (function of the group's inputs and the op's extra args, position of the group name)
COLLECTIVES = {
    c10d.all_reduce.default: (lambda xs, op, group: _all_reduce(xs, op)),
    c10d.all_gather_into_tensor.default: (lambda xs, n, group: _all_gather(xs)),
    c10d.reduce_scatter_tensor.default: (lambda xs, op, n, group: _reduce_scatter(xs, op)),
    c10d.all_to_all_single.default: (lambda xs, o, i, group: _all_to_all(xs, o, i)),
}


def run(module: torch.fx.GraphModule, mesh: Mesh, inputs_per_rank: list[list[torch.Tensor]], seed: torch.Tensor,
        compile: bool = False, device: torch.device | None = None) -> list[list]:
    """Run the per-shard program on every rank; `inputs_per_rank[r]` excludes `coords` and `seed`
    (each rank's `coords` is made on `device`, the program's).

    The program is cut at its collectives; each piece between them runs per rank as generated
    code (compiled with inductor when `compile`), each collective in lockstep over its groups.
    """
    top = _segments(module, compile)
    ranks = range(mesh.size)
    envs: list[dict] = [{} for _ in ranks]
    coords = [torch.tensor(mesh.coords(r), dtype=torch.int64, device=device) for r in ranks]
    feeds = [iter(list(inputs_per_rank[r]) + [coords[r], seed]) for r in ranks]
    for node in top.graph.nodes:
        if node.op == "placeholder":
            for r in ranks:
                envs[r][node] = next(feeds[r])
        elif node.op == "call_module" and node.meta.get("hpfun_collective_piece"):
            _run_piece_in_lockstep(getattr(top, node.target), node, mesh, envs)
        elif node.op in ("call_module", "call_function"):
            target = getattr(top, node.target) if node.op == "call_module" else node.target
            # a piece's forward, not its __call__: the hooks torch runs for every module (a user's
            # `register_module_forward_hook`) are not the program's to run (a compiled piece as it is)
            fn = target.forward if isinstance(target, torch.fx.GraphModule) else target
            for r in ranks:
                env = envs[r]
                args = torch.fx.node.map_arg(node.args, env.__getitem__)
                try:
                    env[node] = fn(*args, **torch.fx.node.map_arg(node.kwargs, env.__getitem__))
                except Exception as err:  # any op's error: re-raised naming the op, the line, the layouts
                    failed, inputs = failure.rerun(target, args) if node.op == "call_module" else (None, None)
                    raise failure.execution_error(failed, f"mesh rank {r} {mesh.coords(r)}", err, inputs) from err
        elif node.op == "output":
            return [list(torch.fx.node.map_arg(node.args[0], envs[r].__getitem__)) for r in ranks]
    raise AssertionError("program without output")


def _segments(module: torch.fx.GraphModule, compile: bool) -> torch.fx.GraphModule:
    """The program split at collectives (cached on the module): pieces alternate compute/collective."""
    cache = module.__dict__.setdefault("_hpfun_segments", {})
    if compile not in cache:
        cache[compile] = _split(module, compile)
    return cache[compile]


def _split(module: torch.fx.GraphModule, compile: bool) -> torch.fx.GraphModule:
    """Each collective a piece of its own, the compute between them in pieces. Waits are dropped:
    a collective computed in lockstep is done when it returns, however far from it the program
    (`hpfun.schedule`) placed its `wait_tensor`."""
    module = _without_waits(module)
    piece, pieces = 0, {}
    for node in module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target in COLLECTIVES:
            pieces[node], piece = piece + 1, piece + 2
            continue
        pieces[node] = piece
    top = split_module(module, None, lambda n: pieces[n], keep_original_order=True)
    for node in top.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(top, node.target)
        if any(n.op == "call_function" and n.target in COLLECTIVES for n in sub.graph.nodes):
            node.meta["hpfun_collective_piece"] = True
        elif compile:
            setattr(top, node.target, torch.compile(sub, backend="inductor", dynamic=False))
    return top


def _without_waits(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is c10d.wait_tensor.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    return torch.fx.GraphModule(module, graph)


def _run_piece_in_lockstep(sub: torch.fx.GraphModule, call, mesh: Mesh, envs):
    """Interpret a small piece holding a collective node by node for all ranks."""
    ranks = range(mesh.size)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    local: list[dict] = []
    for r in ranks:
        args = torch.fx.node.map_arg(call.args, envs[r].__getitem__)
        local.append(dict(zip(placeholders, args, strict=True)))
    for node in sub.graph.nodes:
        if node.op == "call_function" and node.target in COLLECTIVES:
            _collective(node, mesh, local)
        elif node.op == "call_function":
            for r in ranks:
                env = local[r]
                inputs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                try:
                    env[node] = node.target(*inputs[0], **inputs[1])
                except Exception as err:  # any op's error: re-raised naming the op, the line, the layouts
                    raise failure.execution_error(node, f"mesh rank {r} {mesh.coords(r)}", err, inputs) from err
        elif node.op == "output":
            for r in ranks:
                envs[r][call] = torch.fx.node.map_arg(node.args[0], local[r].__getitem__)


def _collective(node, mesh: Mesh, envs):
    axis = node.args[-1]
    fn = COLLECTIVES[node.target]
    for group in mesh.groups(axis):
        xs = [envs[r][node.args[0]] for r in group]
        for r, y in zip(group, fn(xs, *node.args[1:]), strict=True):
            envs[r][node] = y
