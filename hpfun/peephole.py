"""Peephole simplifications of a per-shard program, before `hpfun.foreach` groups its ops.

Autograd and functionalization leave chains a program runs op by op where eager runs them in
C++ at almost no cost: a weight's gradient transposed twice (`permute(permute(g, [1, 0]),
[1, 0])`), `alias` of a value read once, a reshape of a reshape, the same transpose of a weight
taken for the forward and again for the backward, and AdamW's `1 - beta1` or `lr *
weight_decay` computed anew for every parameter. Each of them is one dispatch from the
program's generated Python. The program is functional (a program that writes a tensor in place
is left as it is), so a value may be read through any chain that computes it:

- `alias(x)` is `x`; `permute(permute(x, p), q)` is one permute of `x` (or `x`);
  `reshape(reshape(x, a), b)` is `reshape(x, b)` when the inner one has no other reader.
- A node that repeats an earlier one (the same pure op on the same arguments) is replaced by
  it, where that holds no more memory: views (they allocate nothing), and results of at most
  `limit` bytes. A large repeated result is a recomputation chosen for memory
  (`hpfun.checkpoint`), and is kept.

The program's outputs are never made one tensor, nor an input: a value the output reads is
left as it is, and so is an FSDP use's gathered copy (`hpfun.schedule` places it).

`dedupe_collectives` runs on every program, compiled or not: a collective that moves the same
value as an earlier one (its input computed by the same pure ops from the same values: a
variance's backward takes the mean again, and both are all-reduced) is the earlier one's
result, and leaves the report, where it holds at most `limit` bytes. The ranks all run the
same program, so they all drop the same one. FSDP's gathers and larger values are kept: moving
them again is the memory plan (a gathered weight freed after its use, a recomputed activation),
and so are the moves of what `hpfun.checkpoint` recomputes.
"""

from __future__ import annotations

import operator

import torch

from hpfun.foreach import MIN_CAP, _constant, _mutates, _nbytes, _pure

aten = torch.ops.aten
_WAIT = torch.ops._c10d_functional.wait_tensor.default
# views that may copy (reshape) are not free to share: two readers would hold the copy longer
_MAY_COPY = {aten.reshape.default, aten._reshape_alias.default} if hasattr(aten, "_reshape_alias") else {aten.reshape.default}


def simplify(graph: torch.fx.Graph, limit: int = MIN_CAP) -> int:
    """Both simplifications on `graph` (see the module's doc); how many nodes went."""
    if any(_mutates(n) for n in graph.nodes):
        return 0
    return fold_views(graph) + dedupe(graph, limit)


def _output_reads(node: torch.fx.Node) -> bool:
    return any(u.op == "output" for u in node.users)


def fold_views(graph: torch.fx.Graph) -> int:
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or _output_reads(node) or "hpfun_gathered" in node.meta:
            continue
        source = node.args[0] if node.args else None
        if node.target is aten.alias.default:
            node.replace_all_uses_with(source)
        elif node.target is aten.permute.default and isinstance(source, torch.fx.Node) and \
                source.op == "call_function" and source.target is aten.permute.default:
            inner, outer = list(source.args[1]), list(node.args[1])
            if len(inner) != len(outer):
                continue
            rank = len(inner)
            composed = [inner[d] % rank for d in outer]  # dims counted from the end, as from the start
            if composed == list(range(rank)):
                node.replace_all_uses_with(source.args[0])
            else:
                node.args = (source.args[0], composed)
                removed += _drop_if_unread(graph, source)
                continue
        elif node.target is aten.reshape.default and isinstance(source, torch.fx.Node) and \
                source.op == "call_function" and source.target is aten.reshape.default and len(source.users) == 1:
            node.args = (source.args[0], *node.args[1:])
            removed += _drop_if_unread(graph, source)
            continue
        else:
            continue
        graph.erase_node(node)
        removed += 1 + (_drop_if_unread(graph, source) if isinstance(source, torch.fx.Node) else 0)
    return removed


def _drop_if_unread(graph: torch.fx.Graph, node: torch.fx.Node) -> int:
    if node.users or node.op != "call_function" or not _pure(node):
        return 0
    graph.erase_node(node)
    return 1


def _view(target) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or target in _MAY_COPY or len(schema.returns) != 1:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def dedupe(graph: torch.fx.Graph, limit: int = MIN_CAP) -> int:
    """Compute a value once: a node that repeats an earlier one (the same pure op on the same
    arguments) is replaced by it, if it is a view or holds at most `limit` bytes. How many nodes
    went."""
    seen: dict = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not _pure(node) or _output_reads(node) or "hpfun_gathered" in node.meta:
            continue
        if not _view(node.target):
            size = _nbytes(node)
            if size is None or size > limit:
                continue
        key = (node.target, _constant(tuple(node.args)), _constant(tuple(sorted(node.kwargs.items()))))
        try:
            first = seen.setdefault(key, node)
        except TypeError:  # an argument that cannot be a key: kept
            continue
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            removed += 1
    return removed


def dedupe_collectives(graph: torch.fx.Graph, records: list, limit: int = MIN_CAP, recomputed=frozenset()) -> int:
    """Run a collective once per value it moves (see the module's doc): a later one of the same
    kind, over the same axes, of the same value, holding at most `limit` bytes, reads the
    earlier one's result and leaves `records` (the program's report, matched by identity). One
    for a node `hpfun.checkpoint` recomputes (by name) is kept: the recompute repeats its
    forward's moves. How many went."""
    if any(_mutates(n) for n in graph.nodes):
        return 0
    same: dict = {}  # node -> the earlier node computing its value
    seen: dict = {}
    dropped = []
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        record = node.meta.get("hpfun_collective")
        if not (_pure(node) or record is not None or node.target is _WAIT):
            continue
        args = torch.fx.node.map_arg(node.args, lambda n: same.get(n, n))
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: same.get(n, n))
        key = (node.target, _constant(tuple(args)), _constant(tuple(sorted(kwargs.items()))))
        try:
            first = seen.setdefault(key, node)
        except TypeError:  # an argument that cannot be a key
            continue
        if first is node:
            continue
        if record is None:
            same[node] = first
        elif record.bytes <= limit and record.node not in recomputed and "hpfun_fsdp" not in node.meta and \
                "hpfun_fsdp" not in first.meta:
            same[node] = first
            dropped.append(node)
    removed = 0
    for node in dropped:
        for wait in [u for u in node.users if u.target is _WAIT]:
            wait.replace_all_uses_with(same[wait])
            graph.erase_node(wait)
            removed += 1
        if node.users:
            continue
        records[:] = [r for r in records if r is not node.meta["hpfun_collective"]]
        unread, gone = list(node.all_input_nodes), set()
        graph.erase_node(node)
        removed += 1
        while unread:  # what computed the dropped one's input, read by nothing else now
            n = unread.pop()
            if n in gone or n.users or n.op != "call_function" or not _pure(n):
                continue
            unread.extend(n.all_input_nodes)
            graph.erase_node(n)
            gone.add(n)
            removed += 1
    return removed
