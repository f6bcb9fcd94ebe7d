"""Fold matmuls on N-D tensors back into einsums over their original dims.

`x @ w` on a (b, s, d) tensor reaches the graph as view(b*s, d) -> mm -> view(b, s, e), and
attention's q @ k^T as view(b*h, s, d) -> bmm -> view(b, h, s, s). Merging dims hides them: a
tensor split along h (heads) or s (sequence) cannot stay split once (b, h) is one dim, so the
rules would have to gather it. This pass rewrites such chains (transposes included, as the
backward pass produces them) into one `aten.einsum` whose letters are the original dims, where
the einsum rule can keep any of them split.
"""

from __future__ import annotations

import string

import torch

from hpfun.rules.shape import view_groups

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _shape(node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _is_call(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _unflatten(node, shape: tuple[int, ...]):
    """(base node, per dim of `shape` the base dims merged into it), looking through one view."""
    if not _is_call(node, *_VIEWS):
        return node, [[d] for d in range(len(shape))]
    base = node.args[0]
    while _is_call(base, aten.expand.default) and _shape(base.args[0]) == _shape(base):
        base = base.args[0]  # an expand to the same shape is a no-op
    groups = view_groups(_shape(base), shape)
    if any(len(dst) != 1 for _, dst in groups) or len(groups) != len(shape):
        return node, [[d] for d in range(len(shape))]
    return base, [src for src, _ in groups]


def _operand(node, swap: list[int]):
    """(base, dim groups in the matmul operand's dim order) through an optional transpose."""
    if _is_call(node, aten.permute.default) and list(node.args[1]) == swap:
        base, groups = _unflatten(node.args[0], _shape(node.args[0]))
        return base, [groups[i] for i in swap]
    return _unflatten(node, _shape(node))


def _output(node):
    """(nodes to replace, dim groups, shape) of the output: through its users' view when they
    all unflatten it the same way, else the output itself."""
    users = list(node.users)
    identity = [node], [[d] for d in range(len(_shape(node)))], _shape(node)
    if not users or not all(_is_call(u, *_VIEWS) for u in users) or len({_shape(u) for u in users}) != 1:
        return identity
    target = _shape(users[0])
    groups = view_groups(target, _shape(node))
    if any(len(dst) != 1 for _, dst in groups) or len(groups) != len(_shape(node)):
        return identity
    return users, [src for src, _ in groups], target


# role of each matmul dim, per tensor: batch p, rows m, contracted k, columns n
_ROLES = {True: {"a": "pmk", "b": "pkn", "o": "pmn"}, False: {"a": "mk", "b": "kn", "o": "mn"}}


def fold_contractions(gm: torch.fx.GraphModule) -> int:
    """Rewrite flattened mm/bmm chains of `gm` into einsums; returns how many were folded."""
    count = 0
    for node in list(gm.graph.nodes):
        if _is_call(node, aten.mm.default, aten.bmm.default) and _fold(gm.graph, node):
            count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def _fold(graph: torch.fx.Graph, node) -> bool:
    batched = node.target is aten.bmm.default
    swap = [0, 2, 1] if batched else [1, 0]
    (a, ga), (b, gb) = _operand(node.args[0], swap), _operand(node.args[1], swap)
    replaced, go, out_shape = _output(node)
    if all(len(g) == 1 for g in ga + gb + go):
        return False  # nothing was flattened: mm/bmm already say it all
    groups = {"a": (ga, _shape(a)), "b": (gb, _shape(b)), "o": (go, out_shape)}
    subscripts = _subscripts(_ROLES[batched], groups)
    if subscripts is None:
        return False
    equation = f"{subscripts['a']},{subscripts['b']}->{subscripts['o']}"
    with graph.inserting_after(node):
        einsum = graph.call_function(aten.einsum.default, (equation, [a, b]))
    einsum.meta.update(val=replaced[0].meta["val"], stack_trace=node.meta.get("stack_trace"))
    for old in replaced:
        old.replace_all_uses_with(einsum)
    return True


def _subscripts(roles: dict, groups: dict) -> dict | None:
    """Einsum subscripts of a, b and the output; None if a role unflattens differently somewhere."""
    letters = iter(string.ascii_letters)
    out = {name: [None] * len(shape) for name, (_, shape) in groups.items()}
    for role in dict.fromkeys("".join(roles.values())):
        places = [(name, i) for name, r in roles.items() for i, x in enumerate(r) if x == role]
        sizes = {tuple(groups[n][1][d] for d in groups[n][0][i]) for n, i in places}
        if len(sizes) != 1:
            return None
        fresh = [next(letters) for _ in next(iter(sizes))]
        for name, i in places:
            for d, letter in zip(groups[name][0][i], fresh, strict=True):
                out[name][d] = letter
    return {name: "".join(s) for name, s in out.items()}
