"""The simulated runtime: every rank of the mesh in one process, in lockstep.

The per-shard program is interpreted node by node for all ranks; a collective node computes
every rank's result from the values of the ranks in its group (the group is the set of ranks
that differ only along the collective's mesh axis).
"""

from __future__ import annotations

import torch

from hpfun.mesh import Mesh

c10d = torch.ops._c10d_functional


def _reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
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


def run(module: torch.fx.GraphModule, mesh: Mesh, inputs_per_rank: list[list[torch.Tensor]]) -> list[list]:
    """Run the per-shard program on every rank; `inputs_per_rank[r]` excludes `coords`."""
    ranks = range(mesh.size)
    envs: list[dict] = [{} for _ in ranks]
    coords = [torch.tensor(mesh.coords(r), dtype=torch.int64) for r in ranks]
    feeds = [iter(list(inputs_per_rank[r]) + [coords[r]]) for r in ranks]
    for node in module.graph.nodes:
        if node.op == "placeholder":
            for r in ranks:
                envs[r][node] = next(feeds[r])
        elif node.op == "get_attr":
            value = getattr(module, node.target)
            for r in ranks:
                envs[r][node] = value
        elif node.op == "call_function" and node.target in COLLECTIVES:
            _collective(node, mesh, envs)
        elif node.op == "call_function":
            for r in ranks:
                env = envs[r]
                args = torch.fx.node.map_arg(node.args, env.__getitem__)
                kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
                env[node] = node.target(*args, **kwargs)
        elif node.op == "output":
            return [list(torch.fx.node.map_arg(node.args[0], envs[r].__getitem__)) for r in ranks]
    raise AssertionError("program without output")


def _collective(node, mesh: Mesh, envs):
    axis = node.args[-1]
    fn = COLLECTIVES[node.target]
    for group in mesh.groups(axis):
        xs = [envs[r][node.args[0]] for r in group]
        for r, y in zip(group, fn(xs, *node.args[1:]), strict=True):
            envs[r][node] = y
