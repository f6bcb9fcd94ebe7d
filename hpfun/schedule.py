"""Schedule: bucket small collectives and overlap them with compute, on a lowered program.

Lowering emits each collective where its first consumer needs it, followed at once by its
`wait_tensor`: every collective runs synchronously. Two passes over the per-shard graph change
that, in this order:

- `bucket` fuses collectives of one kind over the same mesh axes (same reduce op, dtype and group
  size) into one flat buffer, like DDP's gradient buckets: each member flattened, concatenated,
  one collective, split and viewed back. Members join in the order their inputs become ready,
  up to `bucket_bytes`; a bucket takes a member only if every member's input exists before any
  member's result is first used (so the fused collective creates no cycle: no member's input
  can depend on another member's output). Sums are elementwise, so a bucketed all-reduce gives
  the result of its members' all-reduces: bitwise on a simulated mesh and over 2 ranks (over
  more, torch.distributed may add an element's terms in another order at another offset).
- `overlap` moves each collective, with the glue that only feeds it (a cast to the reduce dtype,
  the bucket's flatten and cat), up to right after its inputs exist, and its wait, with the
  glue that only reads it (the split, a cast back), down to right before its first user. The
  runtime issues a functional collective asynchronously and blocks only in `wait_tensor`, so
  what lies between runs while it travels: gradient reduction overlaps the rest of backward.

FSDP's gathers (`shard(..., gather_params=...)`, `hpfun.fsdp`; their collectives carry
`meta["hpfun_fsdp"]`, the name of the op that uses the gathered parameter) are scheduled as
FSDP schedules them, not as soon as their input exists: that would be the program's start for
a parameter, gathering every layer up front and holding them all, and bucketing would fuse every
layer's gather into one. They bucket only with the gathers of the same use (a linear layer's
weight and bias), and each use's gathers are issued right before the previous use runs
(prefetch depth one, FSDP's forward and backward prefetch): at most two gathered uses are alive
at a time, the one computing and the one in flight. Where parameters are gathered, the
reduce-scatters of their gradients carry the key too (the op that made the gradient): issued
as soon as the gradient exists, as any collective, they bucket only with gradients of that op,
so each whole gradient is freed during the backward instead of waiting for a bucket to fill. A
whole gradient all-reduced there (an optimizer that reads it whole, as Adafactor's row and
column factors do) of `FSDP_ALONE` bytes or more is not bucketed either.

Both passes only reorder and fuse: one program for every rank, the same collectives in the same
order on all of them.
"""

from __future__ import annotations

import math
import operator

import attrs
import torch

from hpfun.foreach import _mutates, _pure

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket cap

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default
COLLECTIVES = (c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
               c10d.all_to_all_single.default)
_BUCKETABLE = COLLECTIVES[:3]  # all-to-all's splits do not concatenate
FSDP = "hpfun_fsdp"  # on FSDP's gathers (hpfun.fsdp.META): the name of the use they serve
FSDP_ALONE = 64 << 10  # under FSDP's schedule, a collective of no use's this large is not bucketed


@attrs.frozen(eq=False)
class Bucket:
    """Collectives fused into one: `members` (their `hpfun.lower.Collective` records) in buffer
    order, `bytes` per rank in all."""

    kind: str
    axes: tuple[str, ...]
    members: tuple
    bytes: int
    dtype: str | None

    def __str__(self) -> str:
        return f"bucket of {len(self.members)} {self.kind} over {', '.join(self.axes)}: {self.bytes} B {self.dtype}"


def schedule(graph: torch.fx.Graph, bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True) -> tuple[Bucket, ...]:
    """Bucket the collectives of a lowered program under `bucket_bytes` (0: none), then move
    issues and waits apart when `overlap`; the buckets made."""
    if overlap or bucket_bytes > 0:
        hoist(graph)
    buckets = bucket(graph, bucket_bytes) if bucket_bytes > 0 else ()
    if overlap:
        spread(graph)
    _items_next_to_their_op(graph)
    return buckets  # (that every node still follows what it reads is checked by hpfun.verify)


def hoist(graph: torch.fx.Graph) -> int:
    """Compute what a collective moves as soon as it can be: the pure ops that feed only it (an
    update's `lr * g` of a gradient whose sum, a linear op, waits for it: lowering places them at
    the update, one by one, each followed by its parameter's `sub`) move up to right after their
    own inputs. Their collectives are then ready together, where the backward made the
    gradients: they bucket and overlap (each was waited on right after it was issued). Only a
    node that is the last reader of the values it reads moves (those are freed as it is made, so
    the memory held stays the same); FSDP's gathers keep their place. How many nodes moved."""
    if any(_mutates(n) for n in graph.nodes):
        return 0
    moved = 0

    def lift(node: torch.fx.Node, reader: torch.fx.Node) -> None:
        nonlocal moved
        if node.op != "call_function" or not _pure(node) or is_collective(node) or node.target is WAIT or \
                any(u is not reader for u in node.users) or \
                any(a.op == "call_function" and len(a.users) > 1 for a in node.all_input_nodes):
            return  # (moved up, a node whose inputs live on for other readers would hold both: more memory)
        for source in node.all_input_nodes:
            lift(source, node)
        latest = max(node.all_input_nodes, key=_LIVE.__getitem__, default=None)
        if latest is not None and latest.next is not node and _LIVE[latest] < _LIVE[node]:
            latest.append(node)
            moved += 1

    for collective in [n for n in graph.nodes if is_collective(n) and FSDP not in n.meta]:
        group = issue_group(collective)
        inside = set(group)
        for source in {a for n in group for a in n.all_input_nodes if a not in inside}:
            if all(u in inside for u in source.users):
                lift(source, next(u for u in source.users))
    return moved


def _items_next_to_their_op(graph: torch.fx.Graph) -> None:
    """Each `getitem` of a multi-output op (a layer norm's backward: the input's gradient and the
    weight's) right after the op. The program holds the op's result tuple, every output in it,
    until its last getitem; moved with a collective it feeds (a weight gradient's bucket, many
    ops on), that one getitem kept the input's gradient alive through the rest of the backward."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        anchor = node
        for item in sorted((u for u in node.users if u.target is operator.getitem), key=pos.__getitem__):
            anchor.append(item)
            anchor = item


# ---------------------------------------------------------------------------------------------
# What belongs to a collective: the glue that only feeds it, the glue that only reads its wait
# ---------------------------------------------------------------------------------------------


def is_collective(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in COLLECTIVES


def _glue(node: torch.fx.Node) -> bool:
    """Lowering's own nodes (casts, reshapes, flattening): not an op of the global graph, not a
    collective or a wait, not an input."""
    return (node.op == "call_function" and "hpfun_origin" not in node.meta and not is_collective(node)
            and node.target is not WAIT)


def issue_group(collective: torch.fx.Node) -> list[torch.fx.Node]:
    """The collective and the glue nodes that exist only to feed it, in program order."""
    return _grown(collective, lambda n: n.all_input_nodes, lambda n: n.users)


def wait_of(collective: torch.fx.Node) -> torch.fx.Node:
    (wait,) = collective.users
    assert wait.target is WAIT, f"{collective} is not followed by its wait_tensor"
    return wait


def wait_group(collective: torch.fx.Node) -> list[torch.fx.Node]:
    """The wait and the glue that reads only it (a split, views, a cast back), in program order."""
    return _grown(wait_of(collective), lambda n: n.users, lambda n: n.all_input_nodes)


def _grown(seed: torch.fx.Node, onward, back) -> list[torch.fx.Node]:
    """`seed` and the glue reached from it through `onward` whose `back` neighbours are all in
    the group already (glue that exists only for the group), in program order."""
    group, frontier = {seed}, list(onward(seed))
    while frontier:
        node = frontier.pop()
        if node not in group and _glue(node) and all(x in group for x in back(node)):
            group.add(node)
            frontier += onward(node)
    return sorted(group, key=_LIVE.__getitem__)  # in program order


class _LiveOrder:
    """A node's place in its graph, kept current by fx as nodes move (`Node._sort_key`), where
    `_positions` is a numbering of the moment: what `spread` asks once per collective as it moves
    them (a fresh numbering each time was quadratic: 1.2 s at 8 Llama layers)."""

    @staticmethod
    def __getitem__(node: torch.fx.Node):
        return node._sort_key


_LIVE = _LiveOrder()


def _positions(graph: torch.fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def _ready(group: list[torch.fx.Node], pos: dict) -> torch.fx.Node | None:
    """The last node the group reads from outside it (None: only constants)."""
    inside = set(group)
    outside = [a for n in group for a in n.all_input_nodes if a not in inside]
    return max(outside, key=pos.__getitem__, default=None)


def _first_use(group: list[torch.fx.Node], pos: dict) -> torch.fx.Node | None:
    """The first node outside the group that reads from it (None: the result is never used)."""
    inside = set(group)
    return min((u for n in group for u in n.users if u not in inside), key=pos.__getitem__, default=None)


@attrs.frozen
class Points:
    """Where a collective runs in the program: issued after node `issued_after`, waited on
    before node `waited_before` (the nearest nodes that are not another collective's glue), with
    `overlapped` ops of the global graph in between."""

    issued_after: str
    waited_before: str
    overlapped: int


def points(graph: torch.fx.Graph) -> dict[torch.fx.Node, Points]:
    """Every collective's issue and wait points."""
    collectives = [n for n in graph.nodes if is_collective(n)]
    issues = {c: issue_group(c) for c in collectives}
    waits = {c: wait_group(c) for c in collectives}
    issuing = {n for g in issues.values() for n in g}
    waiting = {n for g in waits.values() for n in g}
    # the ops of the user's program before each node: a collective overlaps those between it and
    # its wait (counted once, not walked per collective: a 32-layer step has hundreds in flight)
    computed_before, count = {}, 0
    for node in graph.nodes:
        computed_before[node] = count
        count += "hpfun_origin" in node.meta
    out = {}
    for c in collectives:
        after = issues[c][0].prev
        while after in issuing or after.target is operator.getitem:  # (an output taken from a tuple: its op)
            after = after.prev
        before = waits[c][-1].next
        while before in waiting:
            before = before.next
        overlapped = computed_before[wait_of(c)] - computed_before[c] - ("hpfun_origin" in c.meta)
        out[c] = Points(after.name, before.name if before.op != "output" else "output", overlapped)
    return out


# ---------------------------------------------------------------------------------------------
# Overlap
# ---------------------------------------------------------------------------------------------


def spread(graph: torch.fx.Graph) -> None:
    """Issue every collective right after its inputs exist, wait right before the first use;
    FSDP's gathers one use ahead (`_prefetch`)."""
    collectives = [n for n in graph.nodes if is_collective(n)]
    for collective in reversed(collectives):  # last first: two issued after one node keep their order
        if _prefetched(collective):
            continue
        group = issue_group(collective)
        anchor = _ready(group, _LIVE)
        if anchor is None or anchor.op == "placeholder":
            anchor = _last_placeholder(graph)
        for node in reversed(group):
            anchor.append(node)
    _prefetch(graph, [c for c in collectives if _prefetched(c)])
    for collective in collectives:
        group = wait_group(collective)
        before = _first_use(group, _LIVE)
        for node in group if before is not None else ():
            before.prepend(node)


def _prefetched(collective: torch.fx.Node) -> bool:
    """An FSDP gather of a parameter (its gradient's reduce-scatter is issued as any other)."""
    return FSDP in collective.meta and collective.target is c10d.all_gather_into_tensor.default


def _prefetch(graph: torch.fx.Graph, gathers: list[torch.fx.Node]) -> None:
    """FSDP's gathers, grouped by the use they serve and taken in the order of their uses: the
    first issued once its input exists, each next one right before the previous use (once its
    input exists, if later). Only issue groups move, and the nodes compared (inputs, first
    readers) are never among them, so one numbering of the nodes serves throughout."""
    uses: dict = {}
    for collective in gathers:
        uses.setdefault(collective.meta[FSDP], []).append(collective)
    pos = _positions(graph)
    end = _output(graph)
    reader = {key: min((_first_use(wait_group(c), pos) or end for c in group), key=pos.__getitem__)
              for key, group in uses.items()}
    previous = None  # the previous use's first reader
    start = _last_placeholder(graph)
    for key in sorted(uses, key=lambda k: pos[reader[k]]):
        for collective in uses[key]:
            group = issue_group(collective)
            ready = _ready(group, pos)
            if ready is None or ready.op == "placeholder":
                ready = start
            if previous is not None and pos[previous] > pos[ready]:
                for node in group:  # right before the previous use...
                    previous.prepend(node)
            else:
                for node in reversed(group):  # ...or right after its input exists, if later
                    ready.append(node)
        previous = reader[key]


def _last_placeholder(graph: torch.fx.Graph) -> torch.fx.Node:
    return [n for n in graph.nodes if n.op == "placeholder"][-1]


# ---------------------------------------------------------------------------------------------
# Buckets
# ---------------------------------------------------------------------------------------------


@attrs.define
class _Candidate:
    collective: torch.fx.Node
    ready: int  # position of the last input it reads
    first_use: int  # position of the first user of its result
    record: object  # its hpfun.lower.Collective

    @property
    def key(self):
        """What must agree to share a buffer: the op, its arguments (reduce op, group size, mesh
        axes) and the dtype moved."""
        return self.collective.target, tuple(self.collective.args[1:]), self.record.dtype, self.collective.meta.get(FSDP)


@attrs.define
class _Open:
    members: list
    bytes: int = 0

    def takes(self, c: _Candidate, cap: int) -> bool:
        ready = max([m.ready for m in self.members] + [c.ready])
        first_use = min([m.first_use for m in self.members] + [c.first_use])
        return self.bytes + c.record.bytes <= cap and ready < first_use


def bucket(graph: torch.fx.Graph, cap: int) -> tuple[Bucket, ...]:
    """Fuse collectives of one key, in the order their inputs are ready, into buckets of at most
    `cap` bytes per rank (a collective alone over the cap stays alone)."""
    pos = _positions(graph)
    candidates = [_candidate(n, pos) for n in graph.nodes
                  if n.op == "call_function" and n.target in _BUCKETABLE and "hpfun_collective" in n.meta]
    if any(FSDP in c.collective.meta for c in candidates):  # FSDP's schedule: a whole gradient all-reduced (an
        candidates = [c for c in candidates if FSDP in c.collective.meta  # optimizer reading it whole: Adafactor's
                      or c.record.bytes < FSDP_ALONE]  # factors) goes alone, freed at once, not held for a bucket
    candidates.sort(key=lambda c: (c.ready, pos[c.collective]))
    open_: dict = {}
    closed: list[list[_Candidate]] = []
    for c in candidates:
        current = open_.get(c.key)
        if current is not None and current.takes(c, cap):
            current.members.append(c)
            current.bytes += c.record.bytes
            continue
        if current is not None:
            closed.append(current.members)
        open_[c.key] = _Open([c], c.record.bytes)
    closed += [o.members for o in open_.values()]
    # Each fusion moves glue (and the results of earlier buckets) next to its first use, so the
    # members of a later bucket are checked again where they stand now: one whose input now comes
    # after another's first use is left to a bucket of its own (else its wait would precede it).
    fused, pending = [], [members for members in closed if len(members) > 1]
    while pending:
        members = sorted((_live_candidate(m.collective) for m in pending.pop(0)), key=lambda c: c.ready)
        group, rest = _Open([members[0]], members[0].record.bytes), []
        for c in members[1:]:
            if group.takes(c, cap):
                group.members.append(c)
                group.bytes += c.record.bytes
            else:
                rest.append(c)
        if len(group.members) > 1:
            fused.append(_fuse(graph, group.members))
        if len(rest) > 1:
            pending.insert(0, rest)
    return tuple(fused)


_FIRST, _NEVER = (), (math.inf,)  # sort keys before every node and after every node


def _live_candidate(collective: torch.fx.Node) -> _Candidate:
    """`_candidate` with each position as the node's place in the graph now (`_LIVE`)."""
    ready = _ready(issue_group(collective), _LIVE)
    first_use = _first_use(wait_group(collective), _LIVE)
    return _Candidate(collective, _FIRST if ready is None else _LIVE[ready],
                      _NEVER if first_use is None else _LIVE[first_use], collective.meta["hpfun_collective"])


def _candidate(collective: torch.fx.Node, pos: dict) -> _Candidate:
    ready = _ready(issue_group(collective), pos)
    first_use = _first_use(wait_group(collective), pos)
    return _Candidate(collective, -1 if ready is None else pos[ready], len(pos) if first_use is None else pos[first_use],
                      collective.meta["hpfun_collective"])


def _fuse(graph: torch.fx.Graph, members: list[_Candidate]) -> Bucket:
    """Replace the members by one collective on their concatenated inputs, placed right before
    the first use of any member's result (every member's input exists by then); the glue that
    feeds each member and the glue that reads its result move there with it."""
    pos = _positions(graph)
    uses = [_first_use(wait_group(m.collective), pos) for m in members]
    before = min((u for u in uses if u is not None), key=pos.__getitem__, default=_output(graph))
    first = members[0].collective
    after = [wait_group(m.collective)[1:] for m in members]
    for m in members:
        for node in issue_group(m.collective)[:-1]:
            before.prepend(node)
    n = _group_size(first)
    with graph.inserting_before(before):
        inputs = [m.collective.args[0] for m in members]
        shapes = [list(m.collective.meta["hpfun_in_shape"]) for m in members]
        fused = graph.call_function(first.target, (_flat(graph, first.target, inputs, shapes, n), *first.args[1:]))
        waited = graph.call_function(WAIT, (fused,))
        outs = _unflat(graph, first.target, waited, shapes, n)
    record = Bucket(members[0].record.kind, members[0].record.axes, tuple(m.record for m in members),
                    sum(m.record.bytes for m in members), members[0].record.dtype)
    fused.meta.update(hpfun_axes=first.meta["hpfun_axes"], hpfun_bucket=record)
    if FSDP in first.meta:  # FSDP's gathers bucket only with those of the same use
        fused.meta[FSDP] = first.meta[FSDP]
    for glue in after:
        for node in glue:
            before.prepend(node)
    for m, out in zip(members, outs, strict=True):
        _replace(m.collective, out)
    return record


def _group_size(collective: torch.fx.Node) -> int:
    """Ranks in the collective's group (its `n` argument; 1 for an all-reduce, which needs none)."""
    if collective.target is c10d.all_reduce.default:
        return 1
    return collective.args[1] if collective.target is c10d.all_gather_into_tensor.default else collective.args[2]


def _flat(graph, target, inputs, shapes, n: int) -> torch.fx.Node:
    """One 1-D buffer of the members' inputs. A reduce-scatter hands rank r the r-th of n equal
    parts of the buffer: each member is cut in n rows and the rows laid side by side, so part r
    holds every member's r-th block."""
    if target is c10d.reduce_scatter_tensor.default:
        rows = [graph.call_function(aten.reshape.default, (x, [n, math.prod(s) // n])) for x, s in zip(inputs, shapes)]
        return graph.call_function(aten.view.default, (graph.call_function(aten.cat.default, (rows, 1)), [-1]))
    flat = [graph.call_function(aten.reshape.default, (x, [-1])) for x in inputs]
    return graph.call_function(aten.cat.default, (flat,))


def _unflat(graph, target, buffer, shapes, n: int) -> list[torch.fx.Node]:
    """Each member's result, cut from the collective's output buffer."""
    if target is c10d.all_gather_into_tensor.default:  # n rows, each the buffer of one rank
        rows = graph.call_function(aten.view.default, (buffer, [n, -1]))
        parts = graph.call_function(aten.split_with_sizes.default, (rows, [math.prod(s) for s in shapes], 1))
        outs = []
        for i, s in enumerate(shapes):
            part = graph.call_function(aten.clone.default, (graph.call_function(operator.getitem, (parts, i)),),
                                       {"memory_format": torch.contiguous_format})
            outs.append(graph.call_function(aten.view.default, (part, [n * s[0], *s[1:]])))
        return outs
    if target is c10d.reduce_scatter_tensor.default:  # each member's r-th block, side by side
        shapes = [[s[0] // n, *s[1:]] for s in shapes]
    parts = graph.call_function(aten.split_with_sizes.default, (buffer, [math.prod(s) for s in shapes]))
    return [graph.call_function(aten.view.default, (graph.call_function(operator.getitem, (parts, i)), s))
            for i, s in enumerate(shapes)]


def _output(graph: torch.fx.Graph) -> torch.fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def _replace(collective: torch.fx.Node, out: torch.fx.Node) -> None:
    """`out` takes the member's place: its users, and what its wait and collective recorded (the
    value's layout for the verifier and the report, the step that made it)."""
    wait = wait_of(collective)
    out.meta.update({k: v for k, v in wait.meta.items() if k != "val"})
    out.meta.update({k: v for k, v in collective.meta.items() if k.startswith("hpfun_step")})
    out.meta["hpfun_member"] = collective.meta["hpfun_collective"]
    wait.replace_all_uses_with(out)
    collective.graph.erase_node(wait)
    collective.graph.erase_node(collective)
