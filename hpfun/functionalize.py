"""In-place ops rewritten as their out-of-place forms, on the captured graph itself.

A training step written the PyTorch way (`loss.backward(); opt.step()`) records in-place ops:
the optimizer's `mul_`, `add_`, `copy_` on parameters and its state. hpfun's program is
functional, so each becomes its out-of-place op and every later read of the tensor reads the
new value; what was written into an input becomes an extra output the caller writes back.

torch's functionalization does this in general (views of a mutated tensor, writes through a
view) but only by tracing the program a second time, which costs as much as the first trace.
This pass does the common case in one walk over the graph and declines (returns None) whenever
a write could be seen through a view: a write into a view, or a view of a tensor read after the
tensor was written. `hpfun.capture` then traces again through `torch.func.functionalize`.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _is_view(target) -> bool:
    """An op whose result shares its first argument's memory (view, t, select, expand...)."""
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _writes_first(target) -> bool:
    """`op_(self, ...) -> self`: writes its first argument only and returns it."""
    args, returns = target._schema.arguments, target._schema.returns
    written = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    return (written == [0] and len(returns) == 1 and returns[0].alias_info is not None
            and returns[0].alias_info.is_write and not args[0].kwarg_only)


def _out_of_place(target):
    """`aten.add_.Tensor` -> `aten.add.Tensor`, or None where there is no such op: the overload
    of the same arguments, whatever its name (`pow_.Scalar` takes a tensor and a number, as
    `pow.Tensor_Scalar` does; `pow.Scalar` takes a number and a tensor)."""
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    if packet is None:
        return None
    want = _signature(target._schema)
    named = target._overloadname
    for overload in sorted(packet.overloads(), key=lambda o: o != named):  # the same name first
        op = getattr(packet, overload)
        if _signature(op._schema) == want:
            return op
    return None


def _signature(schema) -> tuple:
    """What a call of the op may pass: names, types, keyword-only-ness and defaults (a call of
    `bernoulli_(x)` leans on `p=0.5`, which `bernoulli.p` does not have)."""
    return tuple((a.name, str(a.type), a.kwarg_only, a.has_default_value() and repr(a.default_value))
                 for a in schema.arguments)


def _vals(args):
    """`args` with each node replaced by its traced value."""
    return torch.fx.node.map_arg(args, lambda node: node.meta["val"])


def functionalize(gm: torch.fx.GraphModule) -> list[int] | None:
    """Rewrite `gm`'s in-place ops out of place; return the indices of the inputs written (their
    final values appended to the outputs, in that order), or None, `gm` untouched, where a write
    could be seen through a view (the caller then functionalizes by re-tracing)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    if not isinstance(nodes[-1].args[0], (list, tuple)):
        return None  # capture's graphs return a list, which the written inputs join
    root: dict[torch.fx.Node, torch.fx.Node] = {}  # a node -> the tensor whose memory it is
    is_view: set[torch.fx.Node] = set()  # nodes that are views (of their root), not the root itself
    version: dict[torch.fx.Node, int] = {}  # root -> writes so far
    seen: dict[torch.fx.Node, int] = {}  # view -> its root's version when the view was made
    plan = {}  # in-place node -> (out-of-place target, its fake value)
    for n in nodes:
        for a in n.all_input_nodes:  # reading a view made before its tensor was written: it sees the write
            if a in is_view and seen[a] != version.get(root[a], 0):
                return None
        first = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        if n.op != "call_function":
            root[n] = n
        elif not isinstance(n.target, torch._ops.OpOverload):
            if first in is_view:  # a piece of a view's result (getitem of split): a view too
                root[n], seen[n] = root[first], seen[first]
                is_view.add(n)
            else:
                root[n] = n
        elif n.target._schema.is_mutable and n.target.namespace != "profiler":
            target = _out_of_place(n.target) if _writes_first(n.target) else None
            if target is None or _is_view(target) or first is None or first in is_view:
                return None
            value = target(*_vals(n.args), **_vals(n.kwargs))
            if not isinstance(value, torch.Tensor) or value.shape != n.meta["val"].shape:
                return None
            r = root[first]
            version[r] = version.get(r, 0) + 1
            root[n] = r
            plan[n] = (target, value)
        elif _is_view(n.target) and first is not None:
            root[n], seen[n] = root[first], version.get(root[first], 0)
            is_view.add(n)
        else:
            root[n] = n
    if not plan:
        return []
    # every check passed: rewrite. `latest[r]` is r's current value; a read of any node of r after a
    # write reads it (no view of r is read after a write, checked above)
    latest: dict[torch.fx.Node, torch.fx.Node] = {}

    def current(a):  # a view is never remapped: it was made after the last write it may see
        return a if a in is_view else latest.get(root.get(a), a)

    for n in nodes:
        n.args = torch.fx.node.map_arg(n.args, current)
        n.kwargs = torch.fx.node.map_arg(n.kwargs, current)
        if n not in plan:
            continue
        target, value = plan[n]
        with graph.inserting_before(n):
            new = graph.call_function(target, n.args, n.kwargs)
        new.meta.update(n.meta)
        new.meta["val"] = value
        if value.dtype != n.meta["val"].dtype:  # in place keeps self's dtype: cast as the write does
            with graph.inserting_before(n):
                cast = graph.call_function(aten.copy.default, (n.args[0], new))
            cast.meta.update(n.meta)
            new = cast
        latest[root[n]] = new
    placeholders = [n for n in nodes if n.op == "placeholder"]
    written = [i for i, p in enumerate(placeholders) if p in latest]
    output = next(n for n in reversed(nodes) if n.op == "output")
    output.args = (list(output.args[0]) + [latest[placeholders[i]] for i in written],)
    for n in reversed(list(plan)):
        graph.erase_node(n)
    return written
