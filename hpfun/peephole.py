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
"""

from __future__ import annotations

import operator

import torch

from hpfun.foreach import MIN_CAP, _constant, _mutates, _nbytes, _pure

aten = torch.ops.aten
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
