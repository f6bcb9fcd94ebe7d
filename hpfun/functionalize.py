"""In-place ops rewritten as their out-of-place forms, on the captured graph itself.

A training step written the PyTorch way (`loss.backward(); opt.step()`) records in-place ops:
the optimizer's `mul_`, `add_`, `copy_` on parameters and its state. hpfun's program is
functional, so each becomes its out-of-place op and every later read of the tensor reads the
new value; what was written into an input becomes an extra output the caller writes back.

torch's functionalization does this in general (views of a mutated tensor, writes through a
view) but only by tracing the program a second time, which costs as much as the first trace.
This pass does it in one walk over the graph: a write through a chain of views is scattered
back into the tensor they view, and a view read after its tensor was written is read again from
the new value. It declines (returns None, the graph untouched) where it cannot: a write through
a split's piece or an unfold window, an in-place op with no out-of-place form, or a tensor whose
out-of-place op lays it out otherwise, seen through a view. `hpfun.capture` then traces again
through `torch.func.functionalize`.
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
    final values appended to the outputs, in that order), or None, `gm` untouched, where the walk
    cannot (the caller then functionalizes by re-tracing): an in-place op with no out-of-place
    form, a write through a view torch cannot scatter back (a split's piece, an unfold window),
    or one whose out-of-place form lays its tensor out otherwise, seen through a view."""
    graph = gm.graph
    nodes = list(graph.nodes)
    if not isinstance(nodes[-1].args[0], (list, tuple)):
        return None  # capture's graphs return a list, which the written inputs join
    if not any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               and n.target.namespace != "profiler" for n in nodes):
        return []
    saved = [(n, n.args, n.kwargs) for n in nodes]
    walk = _Walk(graph)
    try:
        written = walk.run(nodes)
    except Exception:  # (declined, or an op of the rewrite failed on the traced values: nothing is kept)
        for n, args, kwargs in saved:
            n.args, n.kwargs = args, kwargs
        for n in reversed(walk.made):
            graph.erase_node(n)
        return None
    for n in reversed(walk.written):
        graph.erase_node(n)
    return written


class _Declined(Exception):
    pass


# a view op -> how its base's new value is made from the base and the view's new value (a write
# through the view), given the view's other arguments
_SCATTER_BACK = {
    aten.slice.Tensor: lambda base, new, *rest: (aten.slice_scatter.default, (base, new, *rest)),
    aten.select.int: lambda base, new, *rest: (aten.select_scatter.default, (base, new, *rest)),
    aten.diagonal.default: lambda base, new, *rest: (aten.diagonal_scatter.default, (base, new, *rest)),
    aten.as_strided.default: lambda base, new, *rest: (aten.as_strided_scatter.default, (base, new, *rest)),
    aten.unsqueeze.default: lambda base, new, dim: (aten.squeeze.dim, (new, dim)),
    aten.transpose.int: lambda base, new, a, b: (aten.transpose.int, (new, a, b)),
    aten.t.default: lambda base, new: (aten.t.default, (new,)),
    aten.permute.default: lambda base, new, dims: (aten.permute.default, (new, _inverse(dims))),
    **{op: (lambda base, new, *_: (aten.view.default, (new, list(base.meta["val"].shape))))
       for op in (aten.view.default, aten._unsafe_view.default, aten.squeeze.dim, aten.squeeze.dims,
                  aten.squeeze.default)},
    **{op: (lambda base, new, *_: (None, (new,))) for op in (aten.alias.default, aten.detach.default)},
}


def _check_addresses(target, of, base) -> None:
    """as_strided addresses the storage of what it views (autograd's views under torch.func
    transforms are as_strided): read again or scattered back from `base`, `of`'s value now, only
    where both lay their elements out plainly from the storage's start."""
    if target is aten.as_strided.default:
        for t in (of.meta["val"], base.meta["val"]):
            if not t.is_contiguous() or t.storage_offset() != 0:
                raise _Declined


def _inverse(dims) -> list:
    n = len(dims)
    out = [0] * n
    for i, d in enumerate(dims):
        out[d % n] = i
    return out


class _Walk:
    """One walk over the graph in order, rewriting each in-place op out of place as it goes.

    Every node is a root (a tensor with memory of its own) or a view of one. `latest[r]` is the
    node holding r's current value; `at[v]` is (r's version, the node holding view v's value
    then). A write into r, directly or through a chain of views (scattered back up the chain),
    makes a new version; a view read after a write to its root reads it again from r's latest
    value, as eager's view sees the write."""

    def __init__(self, graph):
        self.graph = graph
        self.root: dict = {}
        self.how: dict = {}  # view -> (what it views, its op, the op's other arguments, kwargs)
        self.version: dict = {}
        self.at: dict = {}
        self.latest: dict = {}
        self.relaid: set = set()  # roots an out-of-place op laid out otherwise than the in-place one
        self.made: list = []  # nodes this walk added
        self.written: list = []  # the in-place nodes, replaced

    def run(self, nodes) -> list[int]:
        for n in nodes:
            original_args = n.args
            n.args = torch.fx.node.map_arg(n.args, lambda a: self.current(a, n))
            n.kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: self.current(a, n))
            first = original_args[0] if original_args and isinstance(original_args[0], torch.fx.Node) else None
            if n.op != "call_function":
                self.root[n] = n
            elif not isinstance(n.target, torch._ops.OpOverload):
                if first in self.how:  # a piece of a view's result (getitem of split): a view too
                    self._view(n, first, original_args[1:], {})
                else:
                    self.root[n] = n
            elif n.target._schema.is_mutable and n.target.namespace != "profiler":
                self._write(n, first)
            elif _is_view(n.target) and first is not None:
                self._view(n, first, original_args[1:], n.kwargs)
            else:
                self.root[n] = n
        placeholders = [n for n in nodes if n.op == "placeholder"]
        written = [i for i, p in enumerate(placeholders) if p in self.latest]
        output = next(n for n in reversed(nodes) if n.op == "output")
        output.args = (list(output.args[0]) + [self.latest[placeholders[i]] for i in written],)
        return written

    def _view(self, n, of, rest, kwargs) -> None:
        r = self.root[n] = self.root[of]
        self.how[n] = (of, n.target, rest, kwargs)
        self.at[n] = (self.version.get(r, 0), n)

    def current(self, a, before):
        """The node holding `a`'s value where `before` reads it."""
        if a not in self.how:
            return self.latest.get(self.root.get(a), a)
        r = self.root[a]
        version, node = self.at[a]
        if version == self.version.get(r, 0):
            return node
        if r in self.relaid:
            raise _Declined
        of, target, rest, kwargs = self.how[a]  # read again from its base's value now
        base = self.current(of, before)
        _check_addresses(target, of, base)
        rest = torch.fx.node.map_arg(rest, lambda x: self.current(x, before))
        node = self._add(before, target, (base, *rest), kwargs, a.meta)
        self.at[a] = (self.version.get(r, 0), node)
        return node

    def _add(self, before, target, args, kwargs, meta):
        vals = torch.fx.node.map_arg((args, kwargs), lambda x: x.meta["val"])
        value = target(*vals[0], **vals[1])
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args, kwargs)
        self.made.append(node)
        node.meta.update(meta)
        node.meta["val"] = value
        return node

    def _write(self, n, first) -> None:
        target = _out_of_place(n.target) if _writes_first(n.target) else None
        if target is None or _is_view(target) or first is None:
            raise _Declined
        new = self._add(n, target, n.args, n.kwargs, n.meta)
        if new.meta["val"].shape != n.meta["val"].shape:
            raise _Declined
        if new.meta["val"].dtype != n.meta["val"].dtype:  # in place keeps self's dtype: cast as the write does
            new = self._add(n, aten.copy.default, (n.args[0], new), {}, n.meta)
        self.written.append(n)
        r = self.root[first]
        if first not in self.how:  # the root itself
            if new.meta["val"].stride() != n.meta["val"].stride():
                self.relaid.add(r)
            self.version[r] = self.version.get(r, 0) + 1
            self.root[n] = r
            self.latest[r] = new
            return
        if r in self.relaid:
            raise _Declined
        chain, value = [], new  # the views from `first` up to the root, each one's new value
        v = first
        while v in self.how:
            of, target, rest, kwargs = self.how[v]
            back = _SCATTER_BACK.get(target)
            if back is None or kwargs:
                raise _Declined
            chain.append((v, value))
            base = self.current(of, n)
            _check_addresses(target, of, base)
            op, args = back(base, value, *rest)
            if op is aten.view.default and not args[0].meta["val"].is_contiguous():  # (the inverse of a view is a
                args = (self._add(n, aten.clone.default, (args[0],),  # reshape in the elements' logical order)
                                  {"memory_format": torch.contiguous_format}, args[0].meta), *args[1:])
            value = self._add(n, op, args, {}, base.meta) if op is not None else args[0]
            v = of
        root_value = self.current(r, n)
        if value.meta["val"].shape != root_value.meta["val"].shape:
            raise _Declined
        if value.meta["val"].stride() != root_value.meta["val"].stride():  # (a write through a transpose: a later
            if not root_value.meta["val"].is_contiguous():  # view of the root must find its memory laid out as before)
                raise _Declined
            value = self._add(n, aten.clone.default, (value,), {"memory_format": torch.contiguous_format},
                              root_value.meta)
        version = self.version[r] = self.version.get(r, 0) + 1
        self.latest[r] = value
        for view, view_value in chain:
            self.at[view] = (version, view_value)
        self.root[n] = r
        self.how[n] = self.how[first]
        self.at[n] = (version, new)
