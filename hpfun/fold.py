"""Fold matmuls on N-D tensors back into einsums over their original dims.

`x @ w` on a (b, s, d) tensor reaches the graph as view(b*s, d) -> mm -> view(b, s, e), and
attention's q @ k^T as view(b*h, s, d) -> bmm -> view(b, h, s, s). Merging dims hides them: a
tensor split along h (heads) or s (sequence) cannot stay split once (b, h) is one dim, so the
rules would have to gather it. This pass rewrites such chains (transposes included, as the
backward pass produces them) into one `aten.einsum` whose letters are the original dims, where
the einsum rule can keep any of them split.

The same for a linear layer's `addmm` (its bias added after), where one side keeps a dim whole
that the other splits (MultiheadAttention's out_proj reads heads x head_dim as its embedding:
the whole one is split by a view), for sums and means over merged dims (a bias gradient), and
for chains of views (merged and split back: the input itself).
"""

from __future__ import annotations

import math
import operator
import string

import torch

from hpfun.rules.shape import view_groups

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _shape(node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _is_call(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _merges(src: tuple[int, ...], dst: tuple[int, ...]) -> list[list[int]] | None:
    """Per dim of `dst`, the dims of `src` a view merges into it; None where it splits one.
    Size-1 dims are left out on both sides (a view adds or drops them anywhere: einsum's own
    lowering wraps a bmm in them), so a size-1 dim of `dst` merges none, and a size-1 dim of
    `src` is in no group."""
    keep_src, keep_dst = [d for d, n in enumerate(src) if n != 1], [d for d, n in enumerate(dst) if n != 1]
    out: list[list[int]] = [[] for _ in dst]
    for gs, gd in view_groups(tuple(src[d] for d in keep_src), tuple(dst[d] for d in keep_dst)):
        if len(gd) != 1:
            return None
        out[keep_dst[gd[0]]] = [keep_src[d] for d in gs]
    return out


def _unflatten(node, shape: tuple[int, ...]):
    """(base node, per dim of `shape` the base dims merged into it), looking through one view.
    Size-1 dims of the base may be in no group (see `_merges`)."""
    if not _is_call(node, *_VIEWS):
        return node, [[d] for d in range(len(shape))]
    base = node.args[0]
    while _is_call(base, aten.expand.default) and _shape(base.args[0]) == _shape(base):
        base = base.args[0]  # an expand to the same shape is a no-op
    groups = _merges(_shape(base), shape) if (strict := _strict(_shape(base), shape)) is None else strict
    if groups is None:
        return node, [[d] for d in range(len(shape))]
    return base, groups


def _strict(src: tuple[int, ...], dst: tuple[int, ...]) -> list[list[int]] | None:
    """Per dim of `dst` the dims of `src` merged into it, size-1 dims grouped as `view_groups`
    pairs them (a linear layer's one column stays a dim of its own); None where that does not
    give each dim of `dst` a group."""
    groups = view_groups(src, dst)
    if any(len(d) != 1 for _, d in groups) or len(groups) != len(dst):
        return None
    return [s for s, _ in groups]


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
    groups = _merges(target, _shape(node)) if (strict := _strict(target, _shape(node))) is None else strict
    return identity if groups is None else (users, groups, target)


# role of each matmul dim, per tensor: batch p, rows m, contracted k, columns n
_ROLES = {True: {"a": "pmk", "b": "pkn", "o": "pmn"}, False: {"a": "mk", "b": "kn", "o": "mn"}}


def fold_contractions(gm: torch.fx.GraphModule) -> int:
    """Rewrite flattened mm/bmm/addmm chains of `gm` into einsums; returns how many were folded."""
    count = 0
    stacked = _stack_cats(gm.graph)
    stacked = _unstack_slices(gm.graph) or stacked
    collapsed = _collapse_views(gm.graph) or stacked
    for node in list(gm.graph.nodes):
        if _is_call(node, aten.mm.default, aten.bmm.default) and _fold(gm.graph, node):
            count += 1
        elif _is_call(node, aten.addmm.default) and not node.kwargs and len(node.args) == 3 and \
                _bias_of_columns(node) and _fold(gm.graph, node, bias=node.args[0]):
            count += 1
        elif _is_call(node, aten.sum.dim_IntList, aten.mean.dim) and not node.kwargs and _fold_reduction(gm.graph, node):
            count += 1
    if count or collapsed:
        _collapse_views(gm.graph)  # (the folds' own views, and what they now read)
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def _stack_cats(graph: torch.fx.Graph) -> bool:
    """A cat of equal tensors only viewed back as their stack (a recurrent layer's per-step
    outputs, (b, h) each, joined to (t*b, h) and viewed as (t, b, h)) becomes that stack: a
    batch split stays split where the cat had to gather it. Whether any was."""
    stacked = False
    for node in list(graph.nodes):
        if not _is_call(node, aten.cat.default) or node.kwargs or not node.users or \
                not all(_is_call(u, *_VIEWS) for u in node.users):
            continue
        xs, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
        vals = [x.meta.get("val") if isinstance(x, torch.fx.Node) else None for x in xs]
        out = node.meta.get("val")
        if not xs or not isinstance(out, torch.Tensor) or out.ndim == 0 or \
                not all(isinstance(v, torch.Tensor) and v.shape == vals[0].shape and v.dtype == out.dtype for v in vals):
            continue
        dim %= out.ndim
        stacked_shape = [*vals[0].shape[:dim], len(xs), *vals[0].shape[dim:]]
        if not all(list(_shape(u)) == stacked_shape for u in node.users):
            continue  # (only a view back to the stack's shape spares a gather; any other keeps the cat)
        trace = node.meta.get("stack_trace")
        with graph.inserting_before(node):
            rows = []
            for x, v in zip(xs, vals):
                rows.append(graph.call_function(aten.unsqueeze.default, (x, dim)))
                rows[-1].meta.update(val=v.unsqueeze(dim), stack_trace=trace)
            joined = graph.call_function(aten.cat.default, (rows, dim))
            joined.meta.update(val=out.new_empty(stacked_shape), stack_trace=trace)
            merged = graph.call_function(aten.view.default, (joined, list(out.shape)))
            merged.meta.update(val=out, stack_trace=trace)
        node.replace_all_uses_with(merged)
        graph.erase_node(node)
        stacked = True
    return stacked


def _unstack_slices(graph: torch.fx.Graph) -> bool:
    """The other way (a cat's backward): a tensor (.., n, m, ..) viewed as (.., n*m, ..) and only
    cut back into its n rows of m (slices, or a split into equal parts) is read by `select`s of
    the tensor itself: the batch split inside the merged dim no longer has to be gathered to be
    cut. Whether any was."""
    changed = False
    for node in list(graph.nodes):
        if not _is_call(node, *_VIEWS) or not node.users or "val" not in node.meta:
            continue
        base = node.args[0]
        if not isinstance(base, torch.fx.Node) or not isinstance(base.meta.get("val"), torch.Tensor):
            continue
        src, dst = _shape(base), _shape(node)
        if len(src) != len(dst) + 1:
            continue
        d = next((i for i in range(len(dst)) if src[i] != dst[i]), len(dst))
        if d >= len(dst) or src[:d] + (src[d] * src[d + 1],) + src[d + 2:] != dst:
            continue
        n, m = src[d], src[d + 1]
        if n * m == 0:  # (no rows to cut: an empty tensor)
            continue
        picks = [_rows(u, d, n, m) for u in node.users]
        if any(p is None for p in picks):
            continue
        for user, rows in zip(list(node.users), picks):
            for reader, t in rows:
                with graph.inserting_before(reader):
                    pick = graph.call_function(aten.select.int, (base, d, t))
                pick.meta.update(val=base.meta["val"].select(d, t), stack_trace=reader.meta.get("stack_trace"))
                reader.replace_all_uses_with(pick)
        changed = True
    if changed:
        graph.eliminate_dead_code()
    return changed


def _rows(user, d: int, n: int, m: int):
    """[(node reading row t, t)] when `user` cuts dim `d` of an (n*m)-long view into whole rows
    of m (a slice of one row, or a split into n parts of m), else None."""
    if _is_call(user, aten.slice.Tensor) and not user.kwargs and user.args[0] is not None:
        args = list(user.args) + [None] * (5 - len(user.args))
        dim, start, end, step = (args[1] or 0), (args[2] or 0), args[3], (args[4] or 1)
        end = n * m if end is None else min(end, n * m)
        if dim == d and step == 1 and start % m == 0 and end - start == m:
            return [(user, start // m)]
        return None
    if _is_call(user, aten.split_with_sizes.default, aten.split.Tensor) and not user.kwargs and len(user.args) >= 3 \
            and user.args[2] == d:
        sizes = user.args[1]
        parts = [m] * n if sizes == m else list(sizes) if isinstance(sizes, (list, tuple)) else None
        if parts != [m] * n or not all(_is_call(g, operator.getitem) for g in user.users):
            return None
        return [(g, g.args[1]) for g in user.users]
    return None


def _collapse_views(graph: torch.fx.Graph) -> bool:
    """`_collapse` every view of a view; whether any was."""
    collapsed = False
    for node in list(graph.nodes):
        if _is_call(node, *_VIEWS) and _is_call(node.args[0], *_VIEWS):  # (asked as it stands: an earlier
            _collapse(node)  # collapse may have made its input the input of a view it replaced)
            collapsed = True
    return collapsed


def _collapse(node) -> None:
    """A view of a view is a view of the first one's input; one back to that input's shape is
    the input itself (a linear layer's output merged to (b*s, e) and split again: the batch
    split inside the merged dim no longer has to be gathered between)."""
    base = node.args[0].args[0]
    if not isinstance(base, torch.fx.Node) or "val" not in base.meta:
        return
    if _shape(base) == _shape(node) and node.meta["val"].dtype == base.meta["val"].dtype:
        node.replace_all_uses_with(base)
    else:
        node.args = (base, *node.args[1:])


def _fold_reduction(graph: torch.fx.Graph, node) -> bool:
    """A sum or mean over dims a view merged (a linear layer's bias gradient: the (b*s, e)
    gradient summed over its rows) taken over the dims they were: a batch split inside the merged
    dim no longer has to be gathered to be summed."""
    x, dims = node.args[0], node.args[1]
    keepdim = len(node.args) > 2 and node.args[2]
    if not _is_call(x, *_VIEWS) or dims is None or len(dims) == 0 or not _shape(x):  # (a 0-d view summed
        return False  # over its dim 0 or -1: nothing merged)
    base, groups = _unflatten(x, _shape(x))
    dims = [d % len(_shape(x)) for d in dims]
    if base is x or all(len(groups[d]) == 1 for d in dims):
        return False
    summed = sorted(b for d in dims for b in groups[d])
    if not summed:  # only size-1 dims the view added (`x.reshape(-1, 1).sum(1)`): aten reads [] as every dim
        return False
    with graph.inserting_after(node):
        folded = graph.call_function(node.target, (base, summed, keepdim))
    folded.meta.update(val=_fake_reduce(node, base, summed, keepdim), stack_trace=node.meta.get("stack_trace"))
    result = folded
    if tuple(folded.meta["val"].shape) != _shape(node):  # kept dims a view had merged: merged again
        with graph.inserting_after(folded):
            result = graph.call_function(aten.view.default, (folded, list(_shape(node))))
        result.meta.update(val=node.meta["val"], stack_trace=node.meta.get("stack_trace"))
    node.replace_all_uses_with(result)
    return True


def _fake_reduce(node, base, dims, keepdim):
    op = torch.sum if node.target is aten.sum.dim_IntList else torch.mean
    return _on_val(base.meta["val"], lambda v: op(v, dims, keepdim))


def _bias_of_columns(node) -> bool:
    """addmm's bias is one value per column (a linear layer's): added after the einsum, it
    broadcasts along the output's last dim as it did along the matrix's columns."""
    bias = node.args[0]
    return isinstance(bias, torch.fx.Node) and len(_shape(bias)) == 1 and _shape(bias)[0] == _shape(node)[1]


def _fold(graph: torch.fx.Graph, node, bias=None) -> bool:
    batched = node.target is aten.bmm.default
    swap = [0, 2, 1] if batched else [1, 0]
    first = 1 if bias is not None else 0  # addmm(bias, a, b)
    (a, ga), (b, gb) = _operand(node.args[first], swap), _operand(node.args[first + 1], swap)
    replaced, go, out_shape = _output(node)
    if all(len(g) == 1 for g in ga + gb + go):
        return False  # nothing was flattened: mm/bmm already say it all
    if bias is not None and len(go[-1]) != 1:
        return False  # the columns unflattened: the bias no longer lies along one dim
    roles = _ROLES[batched]
    planned = _plan(graph, roles, (a, ga), (b, gb), go, out_shape, bias)
    if planned is None:  # size-1 dims paired differently in two places: the plan without them
        planned = _plan(graph, roles, (a, _drop_ones(ga, _shape(a))), (b, _drop_ones(gb, _shape(b))),
                        _drop_ones(go, out_shape), out_shape, bias)
    if planned is None:
        return False
    a, b, einsum_shape, subscripts = planned
    equation = f"{subscripts['a']},{subscripts['b']}->{subscripts['o']}"
    with graph.inserting_after(node):
        einsum = graph.call_function(aten.einsum.default, (equation, [a, b]))
    result = einsum
    if bias is not None:
        with graph.inserting_after(einsum):
            result = graph.call_function(aten.add.Tensor, (einsum, bias))
    val = replaced[0].meta["val"]
    if tuple(einsum_shape) != tuple(out_shape):  # computed split finer than its users read it: viewed back
        with graph.inserting_after(result):
            shaped = graph.call_function(aten.view.default, (result, list(out_shape)))
        shaped.meta.update(val=val, stack_trace=node.meta.get("stack_trace"))
        val = _fake_view(val, einsum_shape)
    einsum.meta.update(val=val, stack_trace=node.meta.get("stack_trace"))
    result.meta.update(val=val, stack_trace=node.meta.get("stack_trace"))
    if tuple(einsum_shape) != tuple(out_shape):
        result = shaped
    for old in replaced:
        old.replace_all_uses_with(result)
    return True


def _drop_ones(groups: list[list[int]], shape) -> list[list[int]]:
    return [[d for d in g if shape[d] != 1] for g in groups]


def _plan(graph, roles: dict, a, b, go, out_shape, bias):
    """(a, b, the shape the einsum computes, its subscripts) from each operand's (base, groups)
    and the output's groups, or None where they do not agree on a role."""
    # a role one operand unflattens and the other keeps merged (MultiheadAttention's out_proj
    # reads heads x head_dim as the embedding, whole in its weight): merged in both
    merged = _merged(graph, roles, {"a": a[::-1], "b": b[::-1]}, go, out_shape)
    if merged is None:
        return None
    (ga, a), (gb, b), (einsum_shape, go) = merged
    if bias is not None and len(go[-1]) != 1:
        return None  # the columns computed split: the bias no longer lies along one dim
    (ga, a), (gb, b) = _squeezed(graph, ga, a), _squeezed(graph, gb, b)
    if (ones := sorted(set(range(len(einsum_shape))) - {d for g in go for d in g})):
        # size-1 dims the output's view adds: computed without them, viewed back
        einsum_shape = [n for d, n in enumerate(einsum_shape) if d not in ones]
        go = [[d - sum(o < d for o in ones) for d in g] for g in go]
    subscripts = _subscripts(roles, {"a": (ga, _shape(a)), "b": (gb, _shape(b)), "o": (go, tuple(einsum_shape))})
    return None if subscripts is None else (a, b, einsum_shape, subscripts)


def _merged(graph, roles: dict, operands: dict, go, out_shape):
    """Operands and output regrouped so that every role has the same dims everywhere: where one
    place keeps a role as one dim that another splits into several (MultiheadAttention's out_proj
    weight keeps the embedding whole, the attention output reads it as heads x head_dim; a
    gradient used by several ops keeps the rows merged that its input splits into length and
    batch), that place is split too, by a view of an operand's base, or for the output by
    computing it split and viewing it back. ((groups, base) of a, of b, (shape, groups) the
    einsum computes), or None where two places split a role differently."""
    places = {"a": (operands["a"][0], _shape(operands["a"][1])), "b": (operands["b"][0], _shape(operands["b"][1])),
              "o": (go, tuple(out_shape))}
    refine: dict = {name: {} for name in places}  # name -> {role position: sizes to split it into}
    for role in dict.fromkeys("".join(roles.values())):
        where = [(n, i) for n, r in roles.items() for i, x in enumerate(r) if x == role]
        sizes = {(n, i): tuple(places[n][1][d] for d in places[n][0][i]) for n, i in where}
        finest = max(sizes.values(), key=len)
        for (n, i), t in sizes.items():
            if t == finest:
                continue
            if len(t) != 1 or math.prod(finest) != t[0]:
                return None  # split differently in two places: no finer split they all share
            refine[n][i] = finest
    out = {}
    for name in ("a", "b"):
        groups, base = operands[name]
        out[name] = (groups, base) if not refine[name] else _split(graph, base, groups, refine[name])
    shape, groups = _split_shape(tuple(out_shape), go, refine["o"])
    return out["a"], out["b"], (shape, groups)


def _squeezed(graph, groups: list[list[int]], base):
    """(groups, base) where every dim of `base` is in a group: its size-1 dims in none (a view
    added them) dropped by a view."""
    kept = sorted(d for g in groups for d in g)
    if len(kept) == len(_shape(base)):
        return groups, base
    shape = [_shape(base)[d] for d in kept]
    with graph.inserting_after(base):
        view = graph.call_function(aten.view.default, (base, shape))
    view.meta.update(val=_fake_view(base.meta["val"], shape), stack_trace=base.meta.get("stack_trace"))
    return [[kept.index(d) for d in g] for g in groups], view


def _split_shape(shape, groups: list[list[int]], refine: dict):
    """(shape, groups) with each one-dim group i in `refine` split into the sizes refine[i]."""
    owner = {g[0]: i for i, g in enumerate(groups) if i in refine}
    new_shape, renumber = [], {}
    for d, size in enumerate(shape):
        renumber[d] = len(new_shape)
        new_shape.extend(refine[owner[d]] if d in owner else (size,))
    new_groups = [list(range(renumber[g[0]], renumber[g[0]] + len(refine[i]))) if i in refine
                  else [renumber[d] for d in g] for i, g in enumerate(groups)]
    return new_shape, new_groups


def _split(graph, base, groups: list[list[int]], refine: dict):
    """(groups, view): a view of `base` with each one-dim group i in `refine` split as it says."""
    shape, split = _split_shape(_shape(base), groups, refine)
    with graph.inserting_after(base):
        view = graph.call_function(aten.view.default, (base, shape))
    view.meta.update(val=_fake_view(base.meta["val"], shape), stack_trace=base.meta.get("stack_trace"))
    return split, view


def _fake_view(val, shape):
    return _on_val(val, lambda v: v.reshape(shape))


def _on_val(val, fn):
    """`fn(val)` for a node's meta value: in its fake mode where it is a fake tensor."""
    if getattr(val, "fake_mode", None) is None:
        return fn(val)
    with val.fake_mode:
        return fn(val)


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
