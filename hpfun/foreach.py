"""Horizontal fusion: independent elementwise ops of one kind run as one `_foreach_*` call.

A per-shard program runs each op as one dispatch from the graph's generated Python. Where the
same elementwise op is applied to many independent tensors (AdamW's update of every parameter:
a lerp, a mul, an addcmul, a sqrt, a div, an addcdiv and the scalar arithmetic of its bias
corrections, per parameter), one `torch._foreach_*` call does them all: one dispatch for the
group. On CPU (and on GPU wherever the tensors differ in shape, dtype or device) a foreach op
runs the same per-tensor kernel for each member, so the result is bitwise the one the members
compute one by one; CUDA's fast path (one kernel over tensors of one dtype) computes each
element in the same op-math type.

Which nodes can share a call: the same ATen op with the same non-tensor arguments (scalars,
alpha, value), none depending on another. Nodes at the same height (the longest path to the
program's end) never depend on each other, and grouping every such set at once keeps the graph
acyclic (each group sits at the height its members had); AdamW's per-parameter chains all end at
the program's outputs, so their steps share heights. (Grouping by depth, the longest path from
the inputs, as well found 3% more on an HF Llama step, for a second pass as long: not done.)
"Depends" counts the order of ops with a side of their own (draws from
torch's generator, collectives, calls to Python functions), which keep their relative order. A
group's results are held at once, so a group takes members, in program order, up to `cap` bytes
of results (by default 1/32 of what the program's inputs hold): small tensors and scalars fuse,
large ones gain little from it and stay apart. The members become `getitem`s of the group's
call, keeping their names and annotations, and the program is ordered again: every node keeps
its place (a group takes its first member's), and one whose inputs now come later runs as soon
as they exist, never earlier than its place, so nothing is computed ahead and held. A program
that writes a tensor in place is left as it is.
"""

from __future__ import annotations

import heapq
import math
import operator

import torch

aten = torch.ops.aten
MAX_CAP, MIN_CAP, CAP_SHARE = 16 << 20, 4 << 10, 32  # a group's results: at most 1/32 of the inputs, in these bounds

_UNARY = ("abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac",
          "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign", "sin",
          "sinh", "sqrt", "tan", "tanh", "trunc")


def _table() -> dict:
    """ATen op -> {argument kinds: (foreach op, the keyword names it takes)}; kinds: "T" a
    tensor, "S" a Python number, one letter per positional argument."""
    foreach = lambda name, overload: getattr(getattr(aten, f"_foreach_{name}"), overload)  # noqa: E731
    table: dict = {getattr(aten, name).default: {"T": (foreach(name, "default"), ())} for name in _UNARY}
    for name in ("add", "sub"):
        table[getattr(aten, name).Tensor] = {"TT": (foreach(name, "List"), ("alpha",)),
                                             "TS": (foreach(name, "Scalar"), ("alpha",))}
        table[getattr(aten, name).Scalar] = {"TS": (foreach(name, "Scalar"), ("alpha",))}
    # a scalar first (`1 - x`, `2 * x`): s + x and s * x are x + s and x * s, bitwise; s - x is
    # (-x) + s, bitwise (negation is exact, and a + (-b) is the subtraction a - b, +0 included)
    table[aten.add.Tensor]["ST"] = (_SWAP, ("alpha",))
    table[aten.sub.Tensor]["ST"] = (_RSUB, ("alpha",))
    for name in ("mul", "div"):
        table[getattr(aten, name).Tensor] = {"TT": (foreach(name, "List"), ()), "TS": (foreach(name, "Scalar"), ())}
        table[getattr(aten, name).Scalar] = {"TS": (foreach(name, "Scalar"), ())}
    table[aten.mul.Tensor]["ST"] = (_SWAP, ())
    for name in ("maximum", "minimum"):
        table[getattr(aten, name).default] = {"TT": (foreach(name, "List"), ())}
    for name in ("clamp_min", "clamp_max"):
        table[getattr(aten, name).Tensor] = {"TT": (foreach(name, "List"), ())}
        table[getattr(aten, name).default] = {"TS": (foreach(name, "Scalar"), ())}
    table[aten.pow.Tensor_Tensor] = {"TT": (foreach("pow", "List"), ())}
    table[aten.pow.Tensor_Scalar] = {"TS": (foreach("pow", "Scalar"), ())}
    table[aten.pow.Scalar] = {"ST": (foreach("pow", "ScalarAndTensor"), ())}
    table[aten.lerp.Tensor] = {"TTT": (foreach("lerp", "List"), ())}
    table[aten.lerp.Scalar] = {"TTS": (foreach("lerp", "Scalar"), ())}
    for name in ("addcmul", "addcdiv"):
        table[getattr(aten, name).default] = {"TTT": (foreach(name, "Scalar"), ("value",))}
    return table


_SWAP, _RSUB = "swap", "rsub"  # forms computed from the scalar-second op (see _table)
TABLE = _table()


def _kind(arg) -> str | None:
    if isinstance(arg, torch.fx.Node):
        return "T"
    if isinstance(arg, (bool, int, float)):
        return "S"
    return None


def _nbytes(node: torch.fx.Node) -> int | None:
    """Bytes of `node`'s local result, from the layout lowering recorded (None: unknown)."""
    layout, known = node.meta.get("hpfun_layout"), node.meta.get("hpfun_global")
    if layout is None or known is None or not hasattr(layout, "local_shape"):
        return None
    shape, dtype = known[:2]
    n = 1
    for s in layout.local_shape(shape):
        n *= int(s)
    return n * dtype.itemsize


def _signature(node: torch.fx.Node):
    """What the members of one group share, for a node a foreach op can compute (else None):
    the op, the foreach op (or _SWAP / _RSUB), the argument kinds, the scalar arguments (key,
    value) and the keywords (name, key, value)."""
    forms = TABLE.get(node.target) if node.op == "call_function" else None
    if forms is None or "val" in node.meta and not isinstance(node.meta["val"], torch.Tensor):
        return None
    kinds = "".join(k or "?" for k in map(_kind, node.args))
    form = forms.get(kinds)
    if form is None:
        return None
    target, keywords = form
    kwargs = dict(node.kwargs)
    if set(kwargs) - set(keywords) or any(not isinstance(v, (bool, int, float)) for v in kwargs.values()):
        return None
    if kinds in ("TS", "ST") and kwargs.pop("alpha", 1) != 1:  # alpha scales the scalar: no foreach form
        return None
    scalars = tuple((_constant(a), a) for a in node.args if not isinstance(a, torch.fx.Node))
    if any(v != v for _, v in scalars):  # NaN never equals itself: such a node stays alone
        return None
    return (node.target, target, kinds, scalars, tuple(sorted((k, _constant(v), v) for k, v in kwargs.items())))


def _constant(value):
    """A key equal for equal constants only: 1, 1.0 and True differ (they promote differently),
    and so do 0.0 and -0.0."""
    if isinstance(value, float):
        return float, value, math.copysign(1.0, value)
    if isinstance(value, (list, tuple)):
        return type(value), tuple(map(_constant, value))
    if isinstance(value, torch.fx.Node):
        return value
    return type(value), value


def _pure(node: torch.fx.Node) -> bool:
    """Whether `node` may move relative to the program's other ops with a side of their own."""
    try:
        return _PURE[node.target]
    except KeyError:
        pass
    except TypeError:  # an unhashable target
        return False
    target = node.target
    pure = target is operator.getitem or isinstance(target, torch._ops.OpOverload) and not (
        target.namespace == "_c10d_functional" or torch.Tag.nondeterministic_seeded in target.tags)
    _PURE[target] = pure
    return pure


_PURE: dict = {}  # target -> _pure's answer (a few hundred ATen ops at most)


def _mutates(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def fuse(graph: torch.fx.Graph, cap: int | None = None) -> int:
    """Group `graph`'s independent same elementwise ops into `_foreach_*` calls (see the module's
    doc); how many nodes were folded into groups. `cap`: bytes of results a group holds at most
    (default: 1/32 of what the program's inputs hold, within 4 KiB and 16 MiB)."""
    nodes = list(graph.nodes)
    if any(_mutates(n) for n in nodes):
        return 0
    if cap is None:
        held = sum(_nbytes(n) or 0 for n in nodes if n.op == "placeholder")
        cap = min(MAX_CAP, max(MIN_CAP, held // CAP_SHARE))
    return _round(graph, _heights(nodes), cap)


def _sides(nodes: list) -> dict:
    """Each node with a side of its own (`_pure` false) -> the next one: an edge of the order."""
    sided = [n for n in nodes if n.op == "call_function" and not _pure(n)]
    return dict(zip(sided, sided[1:]))


def _heights(nodes: list) -> dict:
    height: dict = {}
    after = _sides(nodes)
    for node in reversed(nodes):
        later = [*node.users, *([after[node]] if node in after else [])]
        height[node] = 1 + max((height[u] for u in later), default=-1)
    return height


def _round(graph: torch.fx.Graph, level: dict, cap: int) -> int:
    groups: dict = {}
    for node in graph.nodes:
        shared = _signature(node)
        if shared is not None and (size := _nbytes(node)) is not None:
            groups.setdefault((level[node], shared), []).append((node, size))
    made = []
    for (_, (_, target, kinds, scalars, kwargs)), members in groups.items():
        chunk, held = [], 0
        for node, size in [*members, (None, 0)]:
            if node is None or (chunk and held + size > cap):
                if len(chunk) > 1:
                    made.append((target, kinds, scalars, kwargs, chunk))
                chunk, held = [], 0
            if node is not None:
                chunk.append(node)
                held += size
    if not made:
        return 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    priority = dict(order)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for target, kinds, scalars, kwargs, chunk in made:
        first = min(order[m] for m in chunk)
        tensors = [[m.args[position] for m in chunk] for position, kind in enumerate(kinds) if kind == "T"]
        values = [value for _, value in scalars]
        with graph.inserting_before(output):
            if target is _RSUB:  # s - x as (-x) + s
                negated = graph.call_function(aten._foreach_neg.default, (tensors[0],))
                items = [graph.call_function(operator.getitem, (negated, i)) for i in range(len(chunk))]
                priority.update(dict.fromkeys([negated, *items], first))
                _as_op(negated, chunk)
                for item, member in zip(items, chunk):  # -x holds x's layout, the member's
                    _as_op(item, [member])
                    item.meta.update({k: member.meta[k] for k in ("hpfun_layout", "hpfun_global", "hpfun_outputs")
                                      if k in member.meta})
                    item.meta["hpfun_inputs"] = (member.meta.get("hpfun_layout"),)
                target, tensors = aten._foreach_add.Scalar, [items]
            elif target is _SWAP:
                target = aten._foreach_add.Scalar if chunk[0].target is aten.add.Tensor else aten._foreach_mul.Scalar
            if target is aten._foreach_pow.ScalarAndTensor:  # pow(scalar, tensor): the scalar leads
                args = (*values, *tensors)
            else:
                args = (*tensors, *values)
            call = graph.call_function(target, args, {k: v for k, _, v in kwargs})
        _as_op(call, chunk)
        call.meta["hpfun_foreach"] = tuple(m.name for m in chunk)
        for i, member in enumerate(chunk):
            member.target, member.args, member.kwargs = operator.getitem, (call, i), {}
        priority[call] = first
    _reorder(graph, priority)
    return sum(len(chunk) for *_, chunk in made)


def _as_op(node: torch.fx.Node, chunk: list) -> None:
    """Mark a node a group added as an op of the user's program (not lowering's glue, which
    `hpfun.schedule` moves with the collectives), traced where its first member was."""
    node.meta["hpfun_origin"] = chunk[0].meta.get("hpfun_origin", chunk[0].name)
    if "stack_trace" in chunk[0].meta:
        node.meta["stack_trace"] = chunk[0].meta["stack_trace"]
    if len(chunk) > 1 or node.target is not operator.getitem:  # the group's call: its members' layouts
        node.meta["hpfun_layout"] = tuple(m.meta.get("hpfun_layout") for m in chunk)
        node.meta["hpfun_inputs"] = tuple(layout for m in chunk for layout in m.meta.get("hpfun_inputs", ()))
        node.meta["hpfun_outputs"] = tuple(o for m in chunk for o in m.meta.get("hpfun_outputs", ()))


def _reorder(graph: torch.fx.Graph, priority: dict) -> None:
    """Order `graph` again after grouping: nodes in the order of `priority` (the old order; a
    group's call where its first member was), a node whose inputs are not computed yet where
    they are (never earlier than its place: a node pulled ahead would hold its result longer);
    nodes with a side (`_pure` false) keep their relative order."""
    nodes = sorted(graph.nodes, key=priority.__getitem__)
    waiting = {n: len(n.all_input_nodes) for n in nodes}
    after = _sides(nodes)
    for node in after.values():
        waiting[node] += 1
    reached, ready, ordered = set(), [], []
    for node in nodes:
        reached.add(node)
        if waiting[node] == 0:
            heapq.heappush(ready, (priority[node], node.name, node))
        while ready:
            _, _, done = heapq.heappop(ready)
            ordered.append(done)
            for user in [*done.users, *([after[done]] if done in after else [])]:
                waiting[user] -= 1
                if waiting[user] == 0 and user in reached:
                    heapq.heappush(ready, (priority[user], user.name, user))
    if len(ordered) != len(nodes):  # a cycle: a bug in the grouping, never expected
        raise AssertionError("hpfun.foreach: grouping made the program cyclic")
    anchor = ordered[0]
    for node in ordered[1:]:
        if anchor.next is not node:  # (most nodes are in place already: moving one costs fx a relink)
            anchor.append(node)
        anchor = node
