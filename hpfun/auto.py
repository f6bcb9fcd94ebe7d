"""Automatic sharding: the layouts of `AUTO` leaves chosen with every op's strategy, in one MILP.

A leaf whose spec is `hpfun.AUTO` (an argument's, a lifted tensor's through `state_specs`, an
output's) gets the layout that makes the step cheapest under the cost model the rest of the
planner uses (`hpfun.plan.CostModel`: alpha-beta communication per mesh axis plus each rank's
local work), subject to `memory_budget` bytes per rank:

1. **Candidates.** Each AUTO leaf may take every layout of its shape on the mesh: per mesh axis
   replicated or split along a dim it divides evenly (several axes on one dim in mesh order).
   Taking a layout at the input is free (the caller hands the data in that layout).
2. **Start.** The greedy planner runs with every AUTO leaf replicated.
3. **Exact stage.** `hpfun.exact` poses the whole graph's strategy choice as an `hpfun.solve`
   problem, with the AUTO inputs' candidates opened: each op's rule is asked again with each
   layout its producers could give, so the split layouts reach the rules. HiGHS solves it.
4. **Ties.** What must come back in the layout it went in is tied to it: the update of an AUTO
   lifted tensor (written back) and its gradient and optimizer state (which follow their
   parameter unless given their own spec), and an AUTO output that mirrors an AUTO argument
   (see `output_ties`): each is a reader of the new value that needs it in the input's chosen
   layout, so delivering it is priced like any other move. Repeated layers get the same plan:
   AUTO leaves whose names differ only in numbered parts (`layers.0.wq`, `layers.1.wq`;
   `args[0]['h'][3]`) and have the same shape and dtype choose the same layout.
5. **Memory.** A rank holds its inputs' blocks for the whole step, and each value of the
   program from the op that makes it to its last use (views hold nothing of their own; outputs
   to the end): at any point of the program the bytes held are a sum over live values, each
   linear in the choice of its producer's strategy; so are the copies an op's inputs are moved
   to where it runs. The budget is imposed at the points where the plan found peaks: solve
   without it, find the chosen plan's peak, add that point, solve again, until the plan fits
   everywhere (a few rounds). The points follow the order the lowered program holds memory in
   (`memory_order`: FSDP's pins where `hpfun.schedule` issues their collectives). The lowered
   program is then checked with `hpfun.memory`'s estimate (which also sees the collectives'
   buffers and temporaries): over the budget, the plan is made again with the excess taken off
   the planning budget, and where the MILP finds nothing, once more at the least memory any plan
   needs (`Fitting`). When none of those fits, the error names the least lowered peak found:
   the budget to give.
6. **gather_params.** With `shard(..., gather_params=axes)`, each AUTO input the step updates
   (a parameter, its optimizer state) gets FSDP's pins (`hpfun.fsdp`) relative to its layout:
   each gathering use reads `gather_use(p, axes)`, whose rule takes p in any layout L and
   demands L with `axes` replicated, and its gradient is pinned by `reduce_onto(g, p)` to p's
   layout. So every candidate layout is priced with per-use gathers (forward and backward, freed
   after each use) and a reduce-scatter per gradient as soon as it is made; a replicated choice
   makes the pins no-ops.
7. **Report.** `AutoPlan` lists every AUTO leaf's chosen spec, the plan's price and memory, and
   (`runner_ups()`, solved on demand) for each choice the cheapest plan choosing otherwise.

Each compile with AUTO leaves runs the exact stage, whatever `solver=` says.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import re
import time

import attrs
import torch

from hpfun import exact, solve as milp
from hpfun.annotation import Annotation, NodePlan, placed
from hpfun.errors import Problem, ShardingError, SpecError
from hpfun.layout import Layout, P, R, Shard
from hpfun.mesh import Mesh
from hpfun.rules.base import OpCall, Rule, Strategy
from hpfun.specs import AUTO, Auto

# seconds per MILP (wall clock). HiGHS proves the 4-layer GPT step on 2 x 2 optimal in about 20 s
# when alone; the 32-layer Llama-3-8B-sized step on 2 x 4 took 254 s on a loaded 2-core machine and
# found no choice at all within 60 s (benchmarks/plan.py)
TIME_LIMIT = 300.0
# seconds AUTO's MILPs may take per compile, all together (`shard(auto_time_limit=)`):
# under a tight memory budget each round of memory points makes the MILP harder, and a small
# model's took 13 minutes in all before this bound
AUTO_TIME_LIMIT = 120.0
MAX_ROUNDS = 12  # rounds of memory points added before giving up on fitting the budget
POINTS_PER_ROUND = 8
# Seconds per byte held per rank by an AUTO leaf's layout: a tie-break only (1 GB costs 1e-9 s),
# so that of two plans equally fast by the model the one holding less wins (an input split over
# dp rather than passed whole and sliced locally, which costs nothing by the model).
HELD_BYTE_SECONDS = 1e-18


# ---------------------------------------------------------------------------------------------
# Candidates, names
# ---------------------------------------------------------------------------------------------


def candidate_layouts(mesh: Mesh, shape: tuple) -> tuple[Layout, ...]:
    """Every layout of a tensor of `shape` on `mesh` a P spec can give: per mesh axis replicated
    or split along one dim, several axes on one dim in mesh order, dims divided evenly;
    replicated first.

    >>> [str(P.from_layout(l, 2)) for l in candidate_layouts(Mesh.simulated((2,), ("tp",)), (4, 3))]
    ['P()', "P('tp')"]
    """
    ndim = len(shape)
    out = []
    for assign in itertools.product([None, *range(ndim)], repeat=mesh.ndim):
        dims = [tuple(mesh.axis_names[a] for a in range(mesh.ndim) if assign[a] == d) or None for d in range(ndim)]
        layout = P(*dims).to_layout(mesh, ndim)
        if layout.fits(shape):
            out.append(layout)
    return tuple(dict.fromkeys(out))


def repeated_name(name: str) -> str:
    """`name` with the number of its first numbered part (`layers.3`, `h3`, `[3]`) as `#`: leaves
    of repeated layers share it. The argument's position and the leaf's own name (its last
    part: `w1`, `ln2`, a list index) are kept, so `h0.w1` and `h0.w2` stay apart.

    >>> repeated_name("args[0]['layers.3.wq']"), repeated_name("model.h.11.mlp.w1"), repeated_name("args[0]['h2.ln1.w']")
    ("args[0]['layers.#.wq']", 'model.h.#.mlp.w1', "args[0]['h#.ln1.w']")
    >>> repeated_name("args[0]['blocks'][2]['wq']"), repeated_name("args[1][2]"), repeated_name("w1")
    ("args[0]['blocks'][#]['wq']", 'args[1][2]', 'w1')
    """
    head = re.match(r"^(?:args|kwargs)\[[^\]]*\]", name)
    start = head.end() if head else 0
    rest = name[start:]
    for m in re.finditer(r"(?:(?<=[A-Za-z_.'\"\[])|^)\d+(?=[.'\"\]]|$)", rest):
        if re.fullmatch(r"['\"\]]*", rest[m.end():]):
            break  # the leaf's own name
        return name[:start] + rest[:m.start()] + "#" + rest[m.end():]
    return name


def spec_text(layout: Layout, ndim: int) -> str:
    return str(P.from_layout(layout, ndim))


# ---------------------------------------------------------------------------------------------
# Outputs that mirror arguments
# ---------------------------------------------------------------------------------------------


def output_ties(out_example, out_auto: list[bool], args: tuple, arg_layouts: list) -> list:
    """Per tensor output leaf whose out_spec is AUTO: `Auto(path)` of the AUTO argument leaf it
    mirrors, or None (hpfun keeps the layout it chose). An output mirrors an argument when a
    top-level output (an element of a returned tuple, or the value returned) has the same pytree
    structure, shapes and dtypes as exactly one positional argument: `return new_params, loss`
    for `step(params, x, y)` returns each new parameter in its parameter's chosen layout, so the
    next call reads them where they are.

    `out_auto` holds one flag per tensor output leaf; `arg_layouts` one layout (or `Auto`, or
    None) per leaf of `args`."""
    from torch.utils import _pytree as pytree

    from hpfun.specs import is_sharded

    outs = list(out_example) if isinstance(out_example, tuple) else [out_example]
    arg_leaves = iter(arg_layouts)
    per_arg = []
    for a in args:
        leaves, spec = pytree.tree_flatten(a, is_leaf=is_sharded)
        per_arg.append((spec, leaves, [next(arg_leaves) for _ in leaves]))
    flags = iter(out_auto)
    result = []
    for o in outs:
        leaves, spec = pytree.tree_flatten(o)
        signature = _signature(leaves)
        mirrors = [layouts for a_spec, a_leaves, layouts in per_arg
                   if a_spec == spec and _signature(a_leaves) == signature]
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            flag = next(flags)
            target = mirrors[0][i] if len(mirrors) == 1 else None
            result.append(target if flag and isinstance(target, Auto) else None)
    return result


def _signature(leaves) -> tuple:
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else
                 (tuple(x.global_shape), x.dtype) if hasattr(x, "global_shape") else type(x) for x in leaves)


# ---------------------------------------------------------------------------------------------
# The plan and its report
# ---------------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class AutoPlan:
    """What automatic sharding chose: per AUTO group (a leaf and the leaves taking its choice)
    the spec; the plan's price in seconds (communication and local work, as the planner prices
    it) beside the greedy plan's with every AUTO leaf replicated; the memory per rank the plan
    holds at its peak by the planner's liveness estimate; the budget; and how long it took."""

    chosen: tuple  # (group, members, shape, spec text, layout text, tied to), per group
    price: float
    replicated_price: float
    memory: float
    budget: int | None
    seconds: float
    stats: dict
    _runner_ups: object = attrs.field(default=None, repr=False)  # () -> list of dicts, computed once
    lowered_memory: int | None = None  # hpfun.memory's estimate of the lowered program's peak (with a budget)
    _cache: dict = attrs.field(factory=dict, repr=False)

    def specs(self) -> dict:
        """Leaf name -> the spec chosen (as text, e.g. "P(None, 'tp')"), for every AUTO leaf."""
        return {m: spec for _, members, _, spec, _, _ in self.chosen for m in members}

    def runner_ups(self, groups=None) -> list[dict]:
        """Per group of tied choices (those named in `groups`, default all): the cheapest plan
        that chooses another layout there (its spec and price), one MILP each, solved on demand."""
        key = None if groups is None else self._groups_named(groups)
        if key not in self._cache:
            self._cache[key] = self._runner_ups(key) if self._runner_ups else []
        return self._cache[key]

    def _groups_named(self, names) -> tuple:
        """The groups `names` pick: a group's name or one of its leaves', whole or as a tail
        (`"up.weight"` for `model.up.weight`) or a pattern with `*`, as state_specs reads them."""
        import fnmatch

        if isinstance(names, str):
            names = [names]
        picked, problems = [], []
        for name in names:
            hits = [g for g, members, *_ in self.chosen
                    if any(m == name or m.endswith("." + name) or fnmatch.fnmatchcase(m, name) for m in (g, *members))]
            if not hits:
                known = ", ".join(g for g, *_ in self.chosen[:8]) + (", ..." if len(self.chosen) > 8 else "")
                problems.append(Problem(repr(name), "names no AUTO leaf of this plan",
                                        f"name a leaf (whole, by its last parts, or with *) of those chosen: {known}"))
            picked += hits
        if problems:
            raise SpecError(problems, headline="explain: unknown names")
        return tuple(dict.fromkeys(picked))

    def to_dict(self) -> dict:
        return {"chosen": [{"group": g, "leaves": list(members), "shape": list(shape), "spec": spec, "layout": lay,
                            "same_as": tied} for g, members, shape, spec, lay, tied in self.chosen],
                "price": self.price, "replicated_price": self.replicated_price, "memory": self.memory,
                "budget": self.budget, "lowered_memory": self.lowered_memory, "seconds": self.seconds,
                "stats": dict(self.stats)}

    @classmethod
    def from_dict(cls, data: dict) -> "AutoPlan":
        """The plan `to_dict` wrote (a loaded report's): its choices and figures, no runner-ups."""
        chosen = tuple((c["group"], tuple(c["leaves"]), tuple(c["shape"]), c["spec"], c["layout"], c["same_as"])
                       for c in data["chosen"])
        return cls(chosen, data["price"], data["replicated_price"], data["memory"], data["budget"], data["seconds"],
                   dict(data.get("stats", {})), lowered_memory=data.get("lowered_memory"))

    def __str__(self) -> str:
        return auto_text(self.to_dict())

    def explain(self, groups=None) -> str:
        """The chosen specs, then per choice (those in `groups`, default all) its runner-up and
        what it would cost more."""
        lines = [str(self), "runner-ups (the cheapest plan choosing otherwise, per choice):"]
        if self._runner_ups is None:
            lines.append("  not known: a report loaded from JSON keeps the choices, not the planner's problem")
        for r in self.runner_ups(groups):
            if r["spec"] is None:
                lines.append(f"  {r['group']}: no other layout has a finite price{r['why']}")
            else:
                lines.append(f"  {r['group']}: {r['spec']} at {r['price'] * 1e6:.1f} us "
                             f"(+{(r['price'] - self.price) * 1e6:.1f} us){r['why']}")
        return "\n".join(lines)


def auto_text(data: dict) -> str:
    """The text section of a report's `auto` field: one line per AUTO leaf that chose (the
    others take a choice: an update returned or written back, a repeated layer's leaf)."""
    budget = "no memory budget" if data["budget"] is None else f"memory_budget {data['budget']} B"
    lines = [f"auto: {len(data['chosen'])} AUTO layout{'s' * (len(data['chosen']) != 1)} chosen in "
             f"{data['seconds']:.2f} s; plan {data['price'] * 1e6:.1f} us (all AUTO replicated: "
             f"{data['replicated_price'] * 1e6:.1f} us); peak about {data['memory']:.0f} B per rank"
             + (f", {data['lowered_memory']} B lowered" if data.get("lowered_memory") is not None else "")
             + f" ({budget})"
             + ("; not proven the cheapest (its MILP ran out of time)"
                if data.get("stats", {}).get("optimal") is False else "")]
    for c in data["chosen"]:
        first, *others = c["leaves"] or [c["group"]]
        notes = ([f"as {c['same_as']}"] if c["same_as"] else []) + ([f"also {', '.join(others)}"] if others else [])
        lines.append(f"  {first} -> {c['spec']}" + (f"  ({'; '.join(notes)})" if notes else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Memory: bytes held at each point of the global program, linear in the choice
# ---------------------------------------------------------------------------------------------


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def _nbytes(layout: Layout, shape: tuple, dtype: torch.dtype) -> float:
    return float(math.prod(layout.local_shape(shape)) * torch.empty((), dtype=dtype).element_size())


_FSDP = "hpfun_fsdp"  # hpfun.fsdp.META: on a pin of FSDP's (a use's gather, a gradient's reduce-scatter)


def memory_order(nodes: list) -> list:
    """The global graph's nodes in the order the lowered program holds their memory in, which
    `hpfun.schedule` changes for FSDP's pins: a gradient's pin ("gradients of ...") right after
    the gradient is made (its reduce-scatter is issued then, and the whole gradient freed), and
    each use's gathers right before the previous use (prefetch depth one; the first use's as
    soon as its input exists). Other nodes keep their order."""
    pos = {n: i for i, n in enumerate(nodes)}
    last_input = max((i for n, i in pos.items() if n.op == "placeholder"), default=-1)

    def ready(node) -> float:
        return max((pos[a] if a.op != "placeholder" else last_input for a in node.all_input_nodes), default=-1) + 0.5

    at = {n: float(i) for n, i in pos.items()}
    uses: dict = {}
    for node in nodes:
        key = node.meta.get(_FSDP)
        if node.op != "call_function" or key is None:
            continue
        if str(key).startswith("gradients of "):
            at[node] = ready(node)
        elif node.users:
            uses.setdefault(key, []).append(node)
    first_reader = {key: min(pos[u] for n in pins for u in n.users) for key, pins in uses.items()}
    previous = None
    for key in sorted(uses, key=first_reader.__getitem__):
        for node in uses[key]:
            at[node] = max(ready(node), previous - 0.5) if previous is not None else ready(node)
        previous = first_reader[key]
    return sorted(nodes, key=lambda n: (at[n], pos[n]))


class _Memory:
    """The values of the global program with the interval of points each is held, and their
    bytes per rank under each candidate of their producer."""

    def __init__(self, graph_nodes: list, problem: milp.Problem):
        self.problem = problem
        order = {n: i for i, n in enumerate(graph_nodes)}
        self.n_points = len(graph_nodes)
        base: dict = {}
        spans: dict = {}  # value -> [first, last, shape, dtype]
        self.shapes: dict = {}  # every value (views too) -> (shape, dtype)
        for node in graph_nodes:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or node.op in ("output",):
                continue
            self.shapes[exact._value(node)] = (tuple(val.shape), val.dtype)
            if node.op == "call_function" and _is_view(node):
                src = next((a for a in node.args if isinstance(a, torch.fx.Node) and a in base), None)
                if src is not None:
                    base[node] = base[src]
                    continue
            value = exact._value(node)
            base[node] = value
            spans.setdefault(value, [order[node], order[node], tuple(val.shape), val.dtype])
        for node in graph_nodes:
            for user in node.users:
                if node in base:
                    span = spans[base[node]]
                    span[1] = max(span[1], self.n_points - 1 if user.op == "output" else order[user])
        for node in graph_nodes:
            if node.op == "placeholder" and node in base:
                spans[base[node]][0], spans[base[node]][1] = 0, self.n_points - 1
        self.spans = {v: s for v, s in spans.items() if v[0] in problem.candidates}
        self.weights = {v: tuple(_nbytes(c.outputs[v[1]], shape, dtype) for c in problem.candidates[v[0]])
                        for v, (_, _, shape, dtype) in self.spans.items()}
        # the op run at each point reads its inputs there, moved copies too; outputs are delivered at the end
        self.readers = [(n,) if n in problem.candidates and problem.inputs(n) else () for n in graph_nodes]
        self.readers[-1] += tuple(n for n in problem.nodes if not isinstance(n, torch.fx.Node))
        self._moved: dict = {}
        # per value, its reader slots and the points they read at: a copy a reader moves the value
        # to is kept for a later reader needing the same layout (lowering reuses it), so it is held
        # in between (FSDP's pins gather per use: theirs are not kept)
        self.slots: dict = {}
        for t, readers in enumerate(self.readers):
            for reader in readers:
                if isinstance(reader, torch.fx.Node) and _FSDP in reader.meta:
                    continue
                for k, value in enumerate(problem.inputs(reader)):
                    self.slots.setdefault(value, []).append((t, (reader, k)))
        self.slots = {v: s for v, s in self.slots.items() if len({t for t, _ in s}) > 1}

    def moved(self, value, src: Layout, dst: Layout, reader=None) -> float:
        """Bytes per rank the move of `value` from `src` to `dst` holds while its reader runs: the
        copy in `dst`, and unless the move only takes a block of a replicated value, a
        contiguous copy of the source for the collective (the lowering permutes and clones
        what it sends, `hpfun.memory` counts both). An FSDP pin's output is the moved copy
        itself (lowering makes it an alias of the collective's result), so there only the
        source's copy is extra."""
        in_place = isinstance(reader, torch.fx.Node) and _FSDP in reader.meta
        key = (value, src, dst, in_place)
        if key not in self._moved:
            shape, dtype = self.shapes[value]
            split_only = all(a == b or isinstance(a, type(R)) and isinstance(b, Shard)
                             for a, b in zip(src.placements, dst.placements, strict=True))
            self._moved[key] = ((0.0 if in_place else _nbytes(dst, shape, dtype))
                                + (0.0 if split_only else _nbytes(src, shape, dtype)))
        return self._moved[key]

    def posed(self, problem: milp.Problem, points: list, budget) -> milp.Problem:
        """`problem` with the memory held at `points` bounded by `budget`."""
        return milp.with_sides(problem, memory=tuple(self.at(t) for t in points),
                            readers_at=tuple(self.readers[t] for t in points), moved=self.moved, budget=budget,
                            kept_at=tuple(self.kept(t) for t in points))

    def kept(self, point: int) -> tuple:
        """(value, slots read before `point`, after it, at it) of the values read on both sides."""
        out = []
        for value, slots in self.slots.items():
            before = tuple(s for t, s in slots if t < point)
            after = tuple(s for t, s in slots if t > point)
            if before and after:
                out.append((value, before, after, tuple(s for t, s in slots if t == point)))
        return tuple(out)

    def at(self, point: int) -> dict:
        """{node: bytes per candidate} of the values held at `point`."""
        out: dict = {}
        for value, (first, last, _, _) in self.spans.items():
            if first <= point <= last:
                w = self.weights[value]
                prev = out.get(value[0])
                out[value[0]] = w if prev is None else tuple(a + b for a, b in zip(prev, w, strict=True))
        return out

    def profile(self, choice: dict) -> list[float]:
        """Bytes held at every point under `choice`: live values, and the moved copies of the
        inputs of the op run there."""
        delta = [0.0] * (self.n_points + 1)
        for value, (first, last, _, _) in self.spans.items():
            b = self.weights[value][choice[value[0]]]
            delta[first] += b
            delta[last + 1] -= b
        out, total = [], 0.0
        p = self.problem
        for t, d in enumerate(delta[:-1]):
            total += d
            copies = 0.0
            for reader in self.readers[t]:
                for value, need in zip(p.inputs(reader), p.candidates[reader][choice[reader]].inputs, strict=True):
                    producer, k = value
                    have = p.candidates[producer][choice[producer]].outputs[k]
                    if have != need:
                        copies += self.moved(value, have, need, reader)
            out.append(total + copies)
        for value, slots in self.slots.items():  # copies kept from one reader to a later one
            producer, k = value
            have = p.candidates[producer][choice[producer]].outputs[k]
            points: dict = {}
            for t, (reader, slot) in slots:
                need = p.candidates[reader][choice[reader]].inputs[slot]
                if need != have:
                    points.setdefault(need, set()).add(t)
            for need, ts in points.items():
                b = self.moved(value, have, need)
                for t in range(min(ts) + 1, max(ts)):
                    if t not in ts:
                        out[t] += b
        return out


def lowered_peak(program) -> int:
    """`hpfun.memory`'s estimate of a lowered program's peak bytes per rank."""
    from hpfun import memory

    return memory.Memory.from_dict(memory.estimate(program)).peak


MAX_PLANS = 4  # plans lowered per compile while looking for one whose lowered program fits the budget


@attrs.define
class Fitting:
    """The search for a plan whose lowered program fits `budget` bytes per rank (one per compile).

    The planner's estimate and `hpfun.memory`'s of the lowered program can differ (collective
    buffers, temporaries, the schedule's order), so each plan is lowered and checked: over the
    budget, the next is planned leaving room for what that plan's lowered program held beyond
    its estimate (and below the last planning budget by the excess at least); where the MILP
    finds nothing under a planning budget, the last is planned at the least memory any plan
    needs (by the estimate), the cheapest such. After `MAX_PLANS` plans, or that last one, or
    when AUTO's time (`deadline`) is spent, the error names the least lowered peak seen: the
    budget to give. Without a budget (None) it only carries the deadline."""

    budget: int | None
    hint: str = ""  # what else the error's fix may suggest
    deadline: "Deadline | None" = None  # AUTO's time for the whole compile
    planning: int = attrs.field(default=None)
    peaks: list = attrs.field(factory=list)  # the lowered peak of each plan made
    least: float | None = None  # the least-memory plan's estimate, once the MILP has found it
    last: bool = False  # the plan being made is the last

    def __attrs_post_init__(self):
        if self.planning is None:
            self.planning = self.budget

    def check(self, program, plan: AutoPlan) -> AutoPlan | None:
        """The plan, with its lowered peak recorded, when that fits; else None, with `planning`
        set for the next plan (or the error raised when there is none to make)."""
        peak = lowered_peak(program)
        self.peaks.append(peak)
        if peak <= self.budget:  # (the report names the budget given, not the last planning one)
            return attrs.evolve(plan, lowered_memory=peak, budget=self.budget)
        # the lowered program holds `peak - plan.memory` more than the plan's estimate: plan the
        # next to leave that much room (and at least below this one's planning budget)
        tighter = math.floor(min(self.planning - (peak - self.budget), self.budget - (peak - plan.memory)))
        if self.deadline is not None and self.deadline.passed():
            raise self.error(out_of_time=True)
        if self.last or len(self.peaks) >= MAX_PLANS or tighter <= 0 and self.least is None:
            raise self.error()
        if self.least is not None and tighter < self.least:
            self.planning, self.last = math.ceil(self.least), True
        else:
            self.planning = tighter
        return None

    def infeasible(self, err: ShardingError) -> None:
        """The MILP found no plan under the planning budget: the next plan is made at the least
        memory any plan needs (`err.least`), or the error is raised."""
        least = getattr(err, "least", None)
        if least is None or self.last or self.deadline is not None and self.deadline.passed():
            raise self.error(least) from None
        self.least, self.planning, self.last = least, math.ceil(least), True

    def error(self, least: float | None = None, out_of_time: bool = False) -> ShardingError:
        if self.peaks:
            need = min(self.peaks)
            what = (f"no plan fits {self.budget} B per rank: the least memory of the {len(self.peaks)} plan"
                    f"{'s' * (len(self.peaks) != 1)} hpfun found and lowered is {need} B per rank")
        else:
            need = math.ceil(least if least is not None else self.least or 0)
            what = (f"no plan fits {self.budget} B per rank: the plan of least memory the search found needs about "
                    f"{need} B per rank (a search in limited time, by an estimate: not a bound)")
        fix = (f"give memory_budget >= {need}, with some headroom, which that plan fits (a smaller budget may fit a "
               f"plan the search did not reach: it plans by an estimate and then checks the lowered program, so under "
               f"exactly {need} B it may take another path and miss that plan){self.hint}") if self.peaks \
            else f"give memory_budget >= {need} (a smaller one may fit a plan the search did not reach){self.hint}"
        if out_of_time:
            what += f" (the search stopped when AUTO's {self.deadline.seconds:g} s ran out)"
            fix += ", or more time (auto_time_limit=...)"
        return ShardingError(Problem("memory_budget", what, fix), headline="no AUTO layout fits the memory budget")


@attrs.define
class Deadline:
    """AUTO's solver time for one compile (`shard(auto_time_limit=)`), its integer programs'
    wall time summed: each gets what is left (at most TIME_LIMIT, at least a second), and the
    search for a plan within the budget stops once it is spent. Tracing and lowering again
    between plans do not count."""

    seconds: float
    used: float = 0.0

    def left(self) -> float:
        return max(min(TIME_LIMIT, self.seconds - self.used), 1.0)

    def passed(self) -> bool:
        return self.used >= self.seconds

    @contextlib.contextmanager
    def timing(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.used += time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# gather_params with AUTO: FSDP's per-use gathers, relative to the layout chosen
# ---------------------------------------------------------------------------------------------

# `hpfun.fsdp` pins each gathering use of a parameter to its spec minus the gather axes, and its
# gradient to its spec. An AUTO parameter has no spec yet, so its pins here are relative: the
# rule of `gather_use(x, axes)` takes x in whatever layout L it has and demands L with `axes`
# replicated (one strategy per candidate layout of the parameter, so the MILP prices a per-use
# gather for each); `reduce_onto(grad, param)` demands the gradient in the parameter's layout
# (a reduce-scatter onto the chosen shard, or an all-reduce when it is replicated). Both carry
# `hpfun.fsdp.META`, so lowering gives each use its own gather, and `hpfun.schedule` prefetches
# them one use ahead and buckets a gradient's reduce-scatter only with its op's.
_LIB = torch.library.Library("hpfun", "FRAGMENT")
_LIB.define("gather_use(Tensor x, str axes) -> Tensor")
_LIB.define("reduce_onto(Tensor grad, Tensor param) -> Tensor")
_LIB.impl("gather_use", lambda x, axes: x.clone(), "CompositeExplicitAutograd")
_LIB.impl("reduce_onto", lambda grad, param: grad.clone(), "CompositeExplicitAutograd")
torch.library.register_fake("hpfun::gather_use", lambda x, axes: torch.empty_like(x), lib=_LIB)
torch.library.register_fake("hpfun::reduce_onto", lambda grad, param: torch.empty_like(grad), lib=_LIB)
gather_use = torch.ops.hpfun.gather_use.default
reduce_onto = torch.ops.hpfun.reduce_onto.default


@attrs.frozen(kw_only=True)
class GatherUse(Rule):
    """`gather_use(x, axes)`: x in its layout with the mesh axes `axes` replicated."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        layout = call.tensors[0].layout
        for name in call.args[1].split(","):
            layout = layout.with_placement(call.mesh.axis_index(name), R)
        return [Strategy((layout,), (layout,))]

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        return ctx.call(torch.ops.aten.clone.default, (args[0],))  # lowering makes it an alias of the gathered copy


@attrs.frozen(kw_only=True)
class ReduceOnto(Rule):
    """`reduce_onto(grad, param)`: the gradient in the parameter's layout."""

    def strategies(self, call: OpCall) -> list[Strategy]:
        layout = exact._resolved(call.tensors[1].layout)
        return [Strategy((layout, layout), (layout,))]

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        return ctx.call(torch.ops.aten.clone.default, (args[0],))


_RULES = {gather_use: GatherUse(), reduce_onto: ReduceOnto()}


@attrs.frozen
class _WithPins:
    """A rule registry with the rules of the relative pins added (the user's own stays as it is)."""

    registry: object

    def lookup(self, op):
        return _RULES.get(op) or self.registry.lookup(op)


def gather_parameters(gm: torch.fx.GraphModule, mesh: Mesh, in_layouts: list, axes: tuple[str, ...]) -> int:
    """`hpfun.fsdp.gather_parameters` for a step with AUTO leaves: inputs of explicit layout as
    it does them; each AUTO input the program updates (a parameter, its optimizer state) gets
    the relative pins (`gather_use` at each gathering use, `reduce_onto` on its gradient), so
    whatever layout the MILP gives it, it is gathered per use over `axes` and its gradient
    reduced onto it, FSDP's way. Returns how many pins were inserted."""
    from hpfun import fsdp
    from hpfun.constrain import _constrain, _encode

    if not axes:
        return 0
    count = fsdp.gather_parameters(gm, mesh, [None if isinstance(l, Auto) else l for l in in_layouts], axes)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    updated: dict = {}  # AUTO input -> a spec naming it (a token no mesh has), which fsdp's pins will carry
    for i, (node, layout) in enumerate(zip(placeholders, in_layouts, strict=True)):
        val = node.meta.get("val")
        if isinstance(layout, Auto) and isinstance(val, torch.Tensor) and val.ndim and fsdp._updated(node, val.numel()):
            updated[node] = P(f"@auto{i}", *[None] * (val.ndim - 1))
    if not updated:
        return count
    tokens = {_encode(spec): node for node, spec in updated.items()}
    before = set(graph.nodes)
    fsdp.rewrite_uses(graph, updated)  # fsdp's rewrite, with a token spec: its pins are made relative below
    gathers = [n for n in graph.nodes if n not in before and n.target is _constrain]
    fsdp._pin_gradients(graph, updated, per_op=True)
    joined = ",".join(axes)
    for node in [n for n in graph.nodes if n not in before and n.target is _constrain]:
        param = tokens.get(node.args[1])
        if param is None:
            continue
        if node in gathers:
            node.target, node.args = gather_use, (node.args[0], joined)
        else:
            node.target, node.args = reduce_onto, (node.args[0], param)
        count += 1
    graph.lint()
    gm.recompile()
    return count


# ---------------------------------------------------------------------------------------------
# Choosing
# ---------------------------------------------------------------------------------------------


@attrs.define
class _Group:
    shape: tuple
    dtype: torch.dtype
    candidates: tuple
    inputs: list = attrs.field(factory=list)  # placeholder nodes
    sinks: list = attrs.field(factory=list)  # positions of outputs tied to it
    members: list = attrs.field(factory=list)  # names of the leaves taking its choice


def choose(gm: torch.fx.GraphModule, mesh: Mesh, in_layouts: list, out_layouts: list, in_names: list,
           out_names: list, *, registry, fallback, reduce_dtype: str, cost_model, budget: int | None,
           deadline: Deadline | None = None):
    """Choose the AUTO layouts (`Auto` markers among `in_layouts` and `out_layouts`; an output
    marked `Auto(group)` comes back in that group's layout), annotate `gm` with the plan, and
    return (input layouts, output layouts, AutoPlan)."""
    from hpfun.propagate import propagate, tensor_inputs

    began = time.perf_counter()
    deadline = deadline or Deadline(AUTO_TIME_LIMIT)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    results = tensor_inputs(next(n for n in reversed(gm.graph.nodes) if n.op == "output"))
    groups: dict[str, _Group] = {}
    problems: list[Problem] = []

    def group(name: str, val, where: str) -> _Group | None:
        shape, dtype = tuple(val.shape), val.dtype
        g = groups.get(name)
        if g is None:
            g = groups[name] = _Group(shape, dtype, candidate_layouts(mesh, shape))
        elif (g.shape, g.dtype) != (shape, dtype):
            problems.append(Problem(where, f"is AUTO tied to {name} but has shape {list(shape)} {dtype}, not "
                                    f"{list(g.shape)} {g.dtype}", "give it its own spec"))
            return None
        return g

    for node, layout, name in zip(placeholders, in_layouts, in_names, strict=True):
        if isinstance(layout, Auto) and (g := group(layout.group, node.meta["val"], name)) is not None:
            g.inputs.append(node)
            g.members.append(name)
    for k, (layout, value) in enumerate(zip(out_layouts, results, strict=True)):
        if isinstance(layout, Auto) and (g := group(layout.group, value.meta["val"], out_names[k])) is not None:
            g.sinks.append(k)
            g.members.append(out_names[k])
    if problems:
        raise SpecError(problems, headline="bad AUTO specs")
    replicated = Layout.replicated(mesh)
    start_in = [replicated if isinstance(l, Auto) else l for l in in_layouts]
    start_out = [replicated if isinstance(l, Auto) else l for l in out_layouts]
    found: dict = {}

    def refine_with(graph, best):
        found["replicated_price"] = best.price
        return _solve(graph, best, groups, budget, deadline, found, dict(zip(placeholders, in_names, strict=True)))

    annotation = propagate(gm, mesh, start_in, registry=_WithPins(registry), fallback=fallback, reduce_dtype=reduce_dtype,
                           outputs=start_out, cost_model=cost_model, refine_with=refine_with)
    layout_of = found["layouts"]
    ins = [layout_of[l.group] if isinstance(l, Auto) else l for l in in_layouts]
    outs = [layout_of[l.group] if isinstance(l, Auto) else l for l in out_layouts]
    classes = found["classes"]
    chosen = []
    for name, g in groups.items():
        lay = layout_of[name]
        rep = classes[name]
        chosen.append((name, tuple(dict.fromkeys(g.members)), g.shape, spec_text(lay, len(g.shape)),
                       lay.placements_str(), rep if rep != name else None))
    plan = AutoPlan(tuple(chosen), annotation.price, found["replicated_price"], found["memory"], budget,
                    time.perf_counter() - began, found["stats"], found["runner_ups"])
    return ins, outs, plan


def _solve(graph, best, groups: dict, budget, deadline: Deadline, found: dict, names: dict) -> Annotation:
    open_inputs = {node: g.candidates for g in groups.values() for node in g.inputs}
    tied = {k for g in groups.values() for k in g.sinks}
    built = exact._problem(graph, best, open_inputs, skip_sinks=tied)
    if built is None:
        raise ShardingError(Problem("AUTO", "the plan cannot be posed as one strategy problem (an op without a rule, "
                                    "or a value returned twice in different layouts)",
                                    "give those leaves explicit specs"), headline="automatic sharding failed")
    base, start, options = built
    nodes, candidates, edges = list(base.nodes), dict(base.candidates), dict(base.edges)
    for node in open_inputs:
        val = node.meta["val"]
        candidates[node] = tuple(attrs.evolve(c, price=HELD_BYTE_SECONDS * _nbytes(c.outputs[0], tuple(val.shape), val.dtype))
                                 for c in candidates[node])
    members: dict = {name: list(g.inputs) for name, g in groups.items()}
    for name, g in groups.items():
        for k in g.sinks:
            key = ("auto sink", k)
            nodes.append(key)
            candidates[key] = tuple(milp.Candidate((layout,), ()) for layout in g.candidates)
            edges[key] = (exact._value(graph.sinks[k][0]),)
            start[key] = 0
            members[name].append(key)
    # repeated layers: groups whose names differ only in numbered parts, same shape and dtype
    classes: dict = {}
    by_key: dict = {}
    for name, g in groups.items():
        classes[name] = by_key.setdefault((repeated_name(name), g.shape, g.dtype), name)
    ties = []
    for rep in dict.fromkeys(classes.values()):
        tied_nodes = [n for name in groups if classes[name] == rep for n in members[name]]
        if len(tied_nodes) > 1:
            ties.append(tuple(tied_nodes))
    problem = milp.Problem(nodes=nodes, candidates=candidates, edges=edges, move=base.move, sinks=base.sinks,
                           ties=ties, kind=base.kind)
    # an input is known by its repeated name (a layer's optimizer step count, a buffer: the same in
    # every layer), and an AUTO one by its tie class
    tie_of = {node: ("fixed", repeated_name(name)) for node, name in names.items()}
    tie_of.update({node: classes[name] for name, g in groups.items() for node in g.inputs})
    layer_ties = exact.layer_ties(graph, problem, tie_of)
    problem = milp.with_sides(problem, ties=ties + layer_ties)
    memory = _Memory(memory_order(list(graph.nodes)), problem)
    points: list[int] = []  # none at first: the fastest plan often fits, and rows of memory slow HiGHS down
    solution, rounds, last_peak = None, 0, None
    while True:
        rounds += 1
        posed = memory.posed(problem, points, budget)
        try:
            with deadline.timing():
                solution = milp.solve(posed, start=start, time_limit=deadline.left())
        except milp.InfeasibleError:
            if budget is None:
                raise
            raise _over_budget(problem, memory, points, budget, groups, members, deadline) from None
        except ShardingError as err:  # nothing found in the time left (no start to fall back on)
            raise _out_of_time(deadline, budget, last_peak) from err
        profile = memory.profile(solution.choice)
        peak = max(range(len(profile)), key=profile.__getitem__)
        last_peak = profile[peak]
        if budget is None or profile[peak] <= budget * (1 + 1e-9) or peak in points:
            break
        if deadline.passed():
            raise _out_of_time(deadline, budget, profile[peak])
        if rounds >= MAX_ROUNDS:
            raise ShardingError(Problem("memory_budget", f"the plan still peaks at {profile[peak]:.0f} B per rank after "
                                        f"{rounds} rounds of adding memory points", "raise memory_budget"),
                                headline="automatic sharding failed")
        points += _over(profile, budget, points)
    choice = solution.choice
    found["layouts"] = {name: g.candidates[choice[members[name][0]]] if members[name] else g.candidates[0]
                        for name, g in groups.items()}
    found["classes"] = classes
    found["memory"] = max(memory.profile(choice), default=0.0)
    found["stats"] = {"nodes": len(nodes), "candidates": sum(len(c) for c in candidates.values()),
                      "tied_ops": sum(len(t) for t in layer_ties),
                      "rounds": rounds, "memory_points": len(points), "optimal": solution.optimal}
    final = memory.posed(problem, points, budget)
    found["runner_ups"] = lambda only: _runner_ups(final, choice, groups, classes, members, TIME_LIMIT, only)
    plans = dict(best.plans)
    for node, index in choice.items():
        if node in options:
            strategy, call, _ = options[node][index]
            site = graph.sites[node]
            plans[node] = NodePlan(placed(node, strategy.outputs), call, site.rule, strategy, site.fallback)
        elif node in open_inputs:
            plans[node] = NodePlan(open_inputs[node][index])
    for node in graph.nodes:  # a getitem takes its element of the chosen tuple
        if node.op == "call_function" and node.target is operator.getitem:
            plans[node] = NodePlan(plans[node.args[0]].layout[node.args[1]])
    return Annotation(plans, solution.price)


def _out_of_time(deadline: Deadline, budget, peak: float | None) -> ShardingError:
    """The error for a search that used AUTO's time before finding a plan within the budget."""
    last = (f": the last plan it found peaks at about {math.ceil(peak)} B per rank, over memory_budget={budget}"
            if peak is not None else " (its MILP found no plan in that time)")
    fix = "give more time (auto_time_limit=...)"
    if peak is not None:
        fix += f", or a memory_budget of at least {math.ceil(peak)} (that plan's peak)"
    err = ShardingError(Problem("auto_time_limit", f"AUTO's solver used its {deadline.seconds:g} s before finding a "
                                f"plan{' within the memory budget' if budget is not None else ''}{last}", fix),
                        headline="automatic sharding ran out of time")
    err.out_of_time = True  # (`Fitting`, whose budget may be below the one given, says it with the user's)
    return err


def _over(profile: list[float], limit: float, points: list, most: int = POINTS_PER_ROUND) -> list[int]:
    """The points to bound next: the `most` highest over `limit` not bounded yet. A plan kept
    under the bound at its peak tends to peak at a neighbouring point next (where the same
    values are live, a moved copy more or less): one point per round took nine rounds of the
    least-memory MILP on a Llama step. The answer is the same (each round's optimum is a lower
    bound, and the loop stops when the plan's own peak meets it)."""
    over = [t for t in range(len(profile)) if profile[t] > limit * (1 + 1e-9) and t not in points]
    return sorted(over, key=profile.__getitem__, reverse=True)[:most]


def _over_budget(problem, memory: _Memory, points: list, budget, groups, members, deadline: Deadline) -> ShardingError:
    """The error for a budget no plan fits, naming the peak of the least-memory plan found (the
    least found when AUTO's time runs out first)."""
    points = list(points)
    for _ in range(MAX_ROUNDS):
        with deadline.timing():
            choice, least = milp.least_memory(memory.posed(problem, points, None), time_limit=deadline.left())
        profile = memory.profile(choice)
        peak = max(range(len(profile)), key=profile.__getitem__)
        if profile[peak] <= least * (1 + 1e-9) or peak in points or deadline.passed():
            break
        points += _over(profile, least, points)
    need = math.ceil(profile[peak])
    specs = ", ".join(f"{name} -> {spec_text(g.candidates[choice[members[name][0]]], len(g.shape))}"
                      for name, g in groups.items() if members[name])
    err = ShardingError(Problem("memory_budget", f"no plan fits {budget} B per rank: the plan of least memory found "
                                f"peaks at about {need} B per rank ({specs})",
                                f"give memory_budget >= {need}, a bigger mesh, or a smaller step"),
                        headline="no AUTO layout fits the memory budget")
    err.least = need  # the least memory a plan needs, by the estimate (hpfun.auto.Fitting plans there)
    return err


def _runner_ups(problem, choice: dict, groups, classes, members, time_limit, only=None) -> list[dict]:
    out = []
    for rep in dict.fromkeys(classes.values()):
        node = next((n for name in groups if classes[name] == rep for n in members[name]), None)
        if node is None or only is not None and rep not in only:
            continue
        g = groups[rep]
        cut = milp.with_sides(problem, cuts=({node: choice[node]},))
        try:
            other = milp.solve(cut, time_limit=time_limit)
        except (milp.InfeasibleError, ShardingError):
            out.append({"group": rep, "spec": None, "price": math.inf,
                        "why": "" if problem.budget is None else " within the memory budget"})
            continue
        out.append({"group": rep, "spec": spec_text(g.candidates[other.choice[node]], len(g.shape)),
                    "price": other.price, "why": "" if other.optimal else " (not proven the cheapest)"})
    return out
