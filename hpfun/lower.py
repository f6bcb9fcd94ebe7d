"""Lower: rewrite the annotated global graph into ONE per-shard graph for every rank.

Each op is emitted by its rule for the chosen strategy (local shapes in shape arguments,
masked lookups...), after redistributing any input whose layout differs from the one the
strategy needs. Rank-dependent values come from the graph's input `coords` (this rank's mesh
coordinates as an int64 tensor), so the program does not depend on the rank; random ops read
the call's seed from the last input, `seed`.

Program inputs: the tensor arguments, then `coords`, then `seed`.
"""

from __future__ import annotations

import functools
import operator

import attrs
import torch
from torch.fx._lazy_graph_module import _make_graph_module
from torch.fx.node import map_arg

from hpfun import foreach, peephole
from hpfun.checkpoint import redraws
from hpfun.collectives import COMMUNICATING, ReduceScatter
from hpfun.layout import Layout
from hpfun.mesh import Mesh
from hpfun.collectives import local_dtype, moved_dtype
from hpfun.plan import group_size, redistribute_plan, step_bytes
from hpfun.propagate import _is_tensor_node, same_value
from hpfun.schedule import DEFAULT_BUCKET_BYTES, schedule

aten = torch.ops.aten

# fx writes a complex constant as its repr, `(nan+nanj)`; `nan` and `inf` are known to its
# generated code, their imaginary spellings are not (a complex NaN fill value would not compile)
torch.fx.graph._register_custom_builtin("nanj", "nanj = complex(0, float('nan'))", complex(0, float("nan")))
torch.fx.graph._register_custom_builtin("infj", "infj = complex(0, float('inf'))", complex(0, float("inf")))


@attrs.frozen
class Collective:
    """One collective the program runs: what, over which mesh axes, bytes per rank (in the dtype
    it moves), and why."""

    kind: str
    axes: tuple[str, ...]
    bytes: int
    node: str  # the node of the global graph that needed it
    op: str
    reason: str
    dtype: str | None = None  # what it moves ("float32"); a reduction: the dtype it reduces in

    def __str__(self) -> str:
        return (f"{self.kind} over {', '.join(self.axes)}: {self.bytes} B {self.dtype} for {self.node} ({self.op}): "
                f"{self.reason}")


@attrs.frozen(eq=False)
class Program:
    """The lowered per-shard program and what describes it."""

    mesh: Mesh
    module: torch.fx.GraphModule
    input_layouts: tuple[Layout, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output_layouts: tuple[Layout, ...]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[torch.dtype, ...]
    collectives: tuple[Collective, ...]
    uses_seed: bool = False  # the program draws random numbers: each call needs a seed
    buckets: tuple = ()  # the hpfun.schedule.Bucket of each fused collective, in program order
    donated: tuple = ()  # inputs whose buffers a call hands over, freed after their last use (donate_state)
    seed: int | None = None  # the function's own torch.manual_seed(s): every call draws from s, and seeds torch with it
    device: torch.device = torch.device("cpu")  # where its values live: the runtime puts `coords` and `seed` there
    # per input, None, or the order of its dims in memory (outermost first) where it was traced on a stand-in
    # that is not contiguous (a transposed argument): each rank's block is laid out in that order, as some ops
    # decide by their input's strides (`det` factors A or A.T, and its backward was traced for one of them)
    input_orders: tuple = ()


def memory_order(x) -> tuple | None:
    """The order of a tensor's dims in memory, outermost first (`torch.empty_permuted`'s), where
    it is not contiguous; None where it is (or has no strides)."""
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.is_contiguous():
        return None
    strides = x.stride()
    return tuple(sorted(range(x.dim()), key=lambda d: (-strides[d], d)))


_NAMES: dict = {}  # op -> the name fx gives its nodes (numbered apart by the graph)


class _ProgramGraph(torch.fx.Graph):
    """The per-shard program's graph. fx scans every new node's arguments for symbolic sizes
    (torch.SymInt), to warn about them; a program's sizes are concrete numbers, and the scan is
    about a seventh of lowering, so its nodes are made without arguments and given them after
    (the same node: `Node.args` and `Node.kwargs` are assignable, users accounted for)."""

    def create_node(self, op, target, args=None, kwargs=None, name=None, type_expr=None) -> torch.fx.Node:
        node = super().create_node(op, target, None, None, name, type_expr)
        if args:
            node.args = args
        if kwargs:
            node.kwargs = kwargs
        return node


class LowerContext:
    """What rules and redistribution steps use to write into the per-shard graph."""

    def __init__(self, mesh: Mesh, rng: str = "philox", reduce_dtype: str = "float32",
                 device: torch.device = torch.device("cpu")):
        self.mesh, self.rng = mesh, rng
        self.device = device  # where the program's values live: the tensors it makes are made there
        self.reduce_dtype = reduce_dtype  # "float32": low-precision sums reduced in float32; "compute": as they are
        self.graph = _ProgramGraph()
        self.collectives: list[Collective] = []
        self.consumer: tuple[str, str, str] = ("", "", "")  # node, op, reason for records
        self.gather_for: str | None = None  # an FSDP gather's use (hpfun.fsdp): tags its collectives
        self.keeps_wide = False  # the step being emitted leaves a low-precision sum partial: kept float32
        self._coords = self.seed = None
        self._cache: dict = {}
        self._random_ops = 0
        self.redraws: dict[str, str] = {}  # an op recomputed by hpfun.checkpoint -> the op it recomputes
        self._drawn: dict[str, list[int]] = {}  # per node, the op numbers its random draws took

    def begin(self, n_inputs: int) -> list[torch.fx.Node]:
        """The program's inputs: `n_inputs` tensors, then `coords` and `seed`."""
        inputs = [self.placeholder(f"in{i}") for i in range(n_inputs)]
        self._coords, self.seed = self.placeholder("coords"), self.placeholder("seed")
        return inputs

    def next_random_op(self) -> int:
        """A number for each random op, in program order (the same for every layout). An op that
        `hpfun.checkpoint` recomputes takes its original's numbers again: it draws the same values."""
        node = self.consumer[0]
        drawn = self._drawn.setdefault(node, [])
        original = self._drawn.get(self.redraws.get(node), [])
        if len(drawn) < len(original):
            drawn.append(original[len(drawn)])
        else:
            self._random_ops += 1
            drawn.append(self._random_ops)
        return drawn[-1]

    def made(self, dtype: torch.dtype) -> dict:
        """The keyword arguments of a tensor the program makes (an index, a mask): `dtype`, on
        the program's device (named only off the CPU, so CPU programs read as they always did)."""
        return {"dtype": dtype} if self.device.type == "cpu" else {"dtype": dtype, "device": self.device}

    def global_index(self, layout: Layout, shape) -> torch.fx.Node:
        """Global row-major index of each element of this rank's block (int64, local shape)."""

        def make():
            local, total, stride = layout.local_shape(shape), None, 1
            for d in reversed(range(len(shape))):
                idx = self.call(aten.arange.default, (local[d],), self.made(torch.int64))
                if layout.shard_axes(d):
                    idx = self.call(aten.add.Tensor, (idx, self.shard_offset(layout, shape, d)))
                if stride != 1:
                    idx = self.call(aten.mul.Tensor, (idx, stride))
                view = [1] * len(shape)
                view[d] = local[d]
                idx = self.call(aten.view.default, (idx, view))
                total = idx if total is None else self.call(aten.add.Tensor, (idx, total))
                stride *= shape[d]
            return total if total is not None else self.call(aten.zeros.default, ([],), self.made(torch.int64))

        return self._memo(("index", layout, tuple(shape)), make)

    def call(self, op, args, kwargs=None) -> torch.fx.Node:
        name = _NAMES.get(op)
        if name is None:  # fx derives a node's name from its target's at every node: once per target here
            name = _NAMES[op] = self.graph._target_to_str(op)
        return self.graph.call_function(op, tuple(args), dict(kwargs or {}), name=name)

    def placeholder(self, name: str) -> torch.fx.Node:
        return self.graph.placeholder(name)

    def _memo(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def coord(self, axis: int) -> torch.fx.Node:
        """This rank's coordinate on `axis` (0-d int64)."""
        return self._memo(("coord", axis), lambda: self.call(aten.select.int, (self._coords, 0, axis)))

    def coord_index(self, axis: int) -> torch.fx.Node:
        """This rank's coordinate on `axis` as a 1-element int64 tensor (for index_select)."""
        return self._memo(("coord_index", axis), lambda: self.call(aten.slice.Tensor, (self._coords, 0, axis, axis + 1)))

    def shard_offset(self, layout: Layout, shape, dim: int) -> torch.fx.Node:
        """Global index of this rank's first element along `dim` under `layout` (0-d int64): the
        mixed-radix index of its coordinates on the axes splitting `dim`, major first in the
        layout's order (`Layout.shard_axes`), times the local size."""
        local = layout.local_shape(shape)[dim]

        def make():
            offset, stride = None, local
            for a in reversed(layout.shard_axes(dim)):
                term = self.call(aten.mul.Tensor, (self.coord(a), stride))
                offset = term if offset is None else self.call(aten.add.Tensor, (offset, term))
                stride *= self.mesh.shape[a]
            return offset if offset is not None else self.call(aten.mul.Tensor, (self.coord(0), 0))

        return self._memo(("offset", layout, tuple(shape), dim), make)

    def collective(self, step, op, args, local_shape) -> torch.fx.Node:
        axes = tuple(self.mesh.axis_names[a] for a in step.axes)
        node = self.call(op, (*args, ",".join(axes)))
        node.meta["hpfun_axes"] = axes
        node.meta["hpfun_in_shape"] = _collective_input_shape(step, local_shape, group_size(self.mesh, step))
        waited = self.call(torch.ops._c10d_functional.wait_tensor.default, (node,))
        nbytes = step_bytes(step, self._step_layout, self._step_shape, self._step_dtype, self.reduce_dtype)
        name, op_name, reason = self.consumer
        traced, moved = self.reduce_in(step)
        wide = local_dtype(self._step_input, traced)
        if moved == traced and wide != traced:  # a partial sum kept wide moves wide (and buckets so)
            moved, nbytes = wide, nbytes // traced.itemsize * wide.itemsize
        moved = str(moved).removeprefix("torch.")
        record = Collective(step.kind, axes, nbytes, name, op_name, reason, moved)
        node.meta["hpfun_collective"] = record
        if self.gather_for is not None:
            node.meta["hpfun_fsdp"] = self.gather_for
        node.meta["hpfun_step_layouts"] = (self._step_layout, step.apply(self._step_layout))  # for reports
        node.meta["hpfun_step"], node.meta["hpfun_step_input"] = step, self._step_input  # for the verifier
        self.collectives.append(record)
        return waited

    def annotate(self, value: torch.fx.Node, layout: Layout, shape, dtype) -> None:
        """`annotate`, for rules that emit a value of their own a collective then moves (a split
        argmax's winners): which global value, in which layout, it holds."""
        annotate(value, layout, shape, dtype)

    def reduce_in(self, step) -> tuple[torch.dtype, torch.dtype]:
        """(the dtype of the value `step` is emitted on, the dtype it moves it in) under this
        program's `reduce_dtype` option (`hpfun.collectives.moved_dtype`)."""
        return self._step_dtype, moved_dtype(step, self._step_dtype, self.reduce_dtype)

    def redistribute(self, value, src: Layout, dst: Layout, shape, dtype, passed=None):
        """Emit the plan from `src` to `dst` on the local value `value`; `passed(layout, value)`
        hears of every layout reached on the way (a later consumer may start from one)."""
        cur = src
        for step in redistribute_plan(src, dst, shape):
            self._step_layout, self._step_shape, self._step_dtype, self._step_input = cur, shape, dtype, value
            wide = local_dtype(value, dtype)
            moved = moved_dtype(step, dtype, self.reduce_dtype)
            # a low-precision sum resolved in two steps (an all-reduce over one axis, then a
            # reduce-scatter over the other) stays wide between them: rounded, each rank's
            # remaining partial would be rounded on its own, and the sum twice
            self.keeps_wide = moved != dtype and _sums_left(step.apply(cur))
            value = step.emit(self, value, list(cur.local_shape(shape)), group_size(self.mesh, step))
            annotate(value, step.apply(cur), shape, dtype)
            if self.keeps_wide:
                value.meta["hpfun_local_dtype"] = moved
            elif wide != dtype and moved == dtype:
                value.meta["hpfun_local_dtype"] = wide  # a step that sums gives the traced dtype back
            cur = step.apply(cur)
            if passed is not None:
                passed(cur, value)
        return value


def _sums_left(layout: Layout) -> bool:
    return any(layout.placements[a].reduce in ("sum", "avg") for a in layout.partial_axes)


def _collective_input_shape(step, local_shape, n: int) -> list[int]:
    """The local shape of the tensor `step.emit` hands its collective (for `hpfun.schedule`'s
    buckets): the value's own, but for a reduce-scatter off dim 0, which scatters the value with
    that dim cut in n and the n moved to the front."""
    shape = list(local_shape)
    if isinstance(step, ReduceScatter) and step.dim:
        shape[step.dim] //= n
        return [n, *shape]
    return shape


def annotate(value: torch.fx.Node, layout: Layout, shape, dtype) -> None:
    """Record on a node of the per-shard program which global value, in which layout, it holds
    (for the verifier, `hpfun.verify`). A step that moves nothing (R -> P(avg), a relabel over an
    axis of size 1) leaves the same local value in a second layout: it keeps its first, and the
    others are listed as `hpfun_also`."""
    if "hpfun_global" not in value.meta:
        value.meta["hpfun_layout"], value.meta["hpfun_global"] = layout, (tuple(shape), dtype)
    elif layout != value.meta.get("hpfun_layout"):
        value.meta.setdefault("hpfun_also", []).append(layout)


def lower(gm: torch.fx.GraphModule, mesh: Mesh, output_layouts: list[Layout | None], output_names=None,
          rng: str = "philox", input_names=None, reduce_dtype: str = "float32",
          bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True, op_by_op: bool = True) -> Program:
    """Build the per-shard program of a propagated graph; `None` keeps an output's layout.

    `output_names` (e.g. "outputs[0]['w1']") label the collectives that outputs need;
    `input_names` (e.g. "args[0]['wo']") name the inputs in the collectives' reasons;
    `reduce_dtype` ("float32" or "compute") is the dtype bfloat16/float16 sums are reduced in;
    `bucket_bytes` caps fused collectives (0: none) and `overlap` moves issues and waits apart
    (`hpfun.schedule`). `op_by_op` (the program runs op by op, not under torch.compile, which
    does its own) simplifies it and runs independent same elementwise ops as one `_foreach_*`
    call (`hpfun.peephole`, `hpfun.foreach`)."""
    ctx = LowerContext(mesh, rng, reduce_dtype, program_device(gm))
    ctx.redraws = redraws(gm, rng)  # hpfun.checkpoint's recomputed ops: which draws they repeat
    values: dict[torch.fx.Node, torch.fx.Node] = {}
    reached: dict[torch.fx.Node, dict[Layout, torch.fx.Node]] = {}  # per value: each layout it reached, locally
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values.update(zip(inputs, ctx.begin(len(inputs)), strict=True))
    for node in inputs:
        annotate(values[node], node.meta["hpfun_layout"], node.meta["val"].shape, node.meta["val"].dtype)
    labels = dict(zip(inputs, input_names, strict=True)) if input_names else {}

    def local(producer, dst: Layout, reason_for):
        if ctx.gather_for is not None:  # an FSDP gather (hpfun.fsdp): each use its own copy, shared with none
            src, val = producer.meta["hpfun_layout"], producer.meta["val"]
            ctx.consumer = (*ctx.consumer[:2], f"{reason_for} needs {dst.placements_str()}, "
                            f"{labels.get(producer, producer.name)} is {src.placements_str()} (gather_params)")
            return ctx.redistribute(values[producer], src, dst, tuple(val.shape), val.dtype)
        producer = same_value(producer)  # a gradient and its alias: moved once for both
        known = reached.setdefault(producer, {})
        if dst not in known:
            src = producer.meta["hpfun_layout"]
            if dst is src or dst == src:  # (most inputs: taken as they are)
                known[dst] = values[producer]
                return known[dst]
            val = producer.meta["val"]
            shape = tuple(val.shape)
            passed = functools.partial(_remember, known)
            start = _reused(src, dst, shape, list(known))
            if start != src:  # another consumer's redistribution already passed a layout local steps away
                return ctx.redistribute(known[start], start, dst, shape, val.dtype, passed)
            if src != dst:
                ctx.consumer = (*ctx.consumer[:2], f"{reason_for} needs {dst.placements_str()}, "
                                f"{labels.get(producer, producer.name)} is {src.placements_str()}")
            known[dst] = ctx.redistribute(values[producer], src, dst, shape, val.dtype, passed)
        return known[dst]

    for node in gm.graph.nodes:
        if node.op == "get_attr":
            values[node] = ctx.graph.get_attr(node.target)
        elif node.op == "call_function" and node.target is operator.getitem:
            values[node] = ctx.call(operator.getitem, (values[node.args[0]], node.args[1]))
            if isinstance(node.meta.get("val"), torch.Tensor):
                annotate(values[node], node.meta["hpfun_layout"], node.meta["val"].shape, node.meta["val"].dtype)
        elif node.op == "call_function":
            values[node] = _emit(ctx, node, local)
        elif node.op == "output":
            names = output_names or [f"outputs[{i}]" for i in range(len(node.args[0]))]
            return _finish(ctx, gm, node, inputs, output_layouts, names, local, bucket_bytes, overlap, op_by_op)
    raise AssertionError("graph without output")


def program_device(gm: torch.fx.GraphModule) -> torch.device:
    """The device a captured function computes on: the first one other than the CPU that its
    values live on (a GPU; meta when it is only planned), else the CPU. CPU scalars (a lifted
    learning rate) may sit beside GPU values, as in eager PyTorch; what the program makes
    itself (indices, masks, the rank's coordinates, the seed) is made on this device."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type != "cpu":
            return val.device
    return torch.device("cpu")


def _remember(known: dict, layout: Layout, value) -> None:
    known.setdefault(layout, value)


def _reused(src: Layout, dst: Layout, shape, reached: list[Layout]) -> Layout:
    """Where to redistribute a value from: a layout it already reached for another consumer,
    if `dst` follows from it with no communication and not from `src`; else `src`."""
    if not _communicates(src, dst, shape):
        return src
    return next((lay for lay in reached if not _communicates(lay, dst, shape)), src)


def _communicates(src: Layout, dst: Layout, shape) -> bool:
    return any(isinstance(step, COMMUNICATING) for step in redistribute_plan(src, dst, shape))


_ADDRESSES_STORAGE = {torch.ops.aten.as_strided.default: 3, torch.ops.aten.as_strided_scatter.default: 4}


def _on_traced_storage(ctx: LowerContext, node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`as_strided` and `as_strided_scatter` (autograd's backward of a write into a view of a
    value laid out transposed, `v = x.t() * 1.0; v[:, :1].copy_(...)`) address their input's
    storage as it was traced. A rank's whole value (gathered, or computed from contiguous blocks)
    can be laid out otherwise, and the addresses would pick other elements: it is first copied
    into the strides traced, and the storage offset taken from there. Only for an input whose
    elements fill their storage span (no gaps, no overlap): every address then names one of them."""
    val = node.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_contiguous() and val.storage_offset() == 0:
        return args, kwargs
    span = sum((n - 1) * st for n, st in zip(val.shape, val.stride(), strict=True)) + 1
    if val.numel() == 0 or span != val.numel() or min(val.stride(), default=1) < 0:
        return args, kwargs
    whole = Layout.replicated(ctx.mesh)
    empty = ctx.call(torch.ops.aten.empty_strided.default, (list(val.shape), list(val.stride())),
                     {"dtype": val.dtype, "device": ctx.device})
    annotate(empty, whole, val.shape, val.dtype)
    laid_out = ctx.call(torch.ops.aten.copy.default, (empty, args[0]))
    annotate(laid_out, whole, val.shape, val.dtype)
    at = _ADDRESSES_STORAGE[node.target]
    args, kwargs = list(args), dict(kwargs)
    offset = args[at] if len(args) > at else kwargs.pop("storage_offset", None)
    args += [None] * (at + 1 - len(args))
    args[0], args[at] = laid_out, (val.storage_offset() if offset is None else offset) - val.storage_offset()
    return tuple(args), kwargs


def _emit(ctx: LowerContext, node, local) -> torch.fx.Node:
    strategy, call = node.meta["hpfun_strategy"], node.meta["hpfun_call"]
    ctx.consumer = (node.name, str(node.target), "")
    required = iter(strategy.inputs)
    widen = _keeps_wide(ctx, node)
    ctx.gather_for = node.meta.get("hpfun_fsdp")
    taken: list = []
    reason = node.target  # made text only where a redistribution names it

    def take(x):  # fx's walk (C++) visits arguments in `strategy.inputs`' order
        if not _is_tensor_node(x):
            return x
        taken.append(_in_dtype(ctx, x, local(x, next(required), reason), widen))
        return taken[-1]

    args, kwargs = map_arg((node.args, node.kwargs), take)
    if widen and (low := kwargs.get("dtype")) in _LOW_PRECISION:  # (`x.sum(0, dtype=torch.bfloat16)` of a split
        kwargs = {**kwargs, "dtype": torch.float32}  # dim: each rank's sum kept in float32 too, rounded once when
        if node.target in _SUMS_OF_CAST and not strategy.inputs[0].partial_axes:  # reduced; a sum's elements
            args = (ctx.call(aten.to.dtype, (args[0], low)), *args[1:])  # are cast first, as eager casts them; a
            # Partial element's terms are not: its cast is of the whole sum, which no rank holds)
    taken = tuple(taken)
    if node.target in _ADDRESSES_STORAGE:
        args, kwargs = _on_traced_storage(ctx, node, args, kwargs)
    before = ctx.graph._root.prev  # the last node so far: what the rule emits comes after it
    out = node.meta["hpfun_rule"].emit(ctx, call, strategy, args, kwargs)
    if node.target in _REORDERS and _made_contiguous(node):
        out = ctx.call(aten.contiguous.default, (out,))
    if "stack_trace" in node.meta:  # a rule's own steps (a bounds check) fail at the user's line too
        step = before.next
        while step is not out and step is not ctx.graph._root:
            if step.op == "call_function" and "hpfun_collective" not in step.meta:
                step.meta.setdefault("stack_trace", node.meta["stack_trace"])
                step.meta.setdefault("hpfun_step_of", node.name)  # (not hpfun_origin: that names an op's result)
                step.meta.setdefault("hpfun_step_inputs", strategy.inputs)  # (for errors: the op's first input,
                if taken:  # its layout and global shape)
                    step.meta.setdefault("hpfun_step_global", taken[0].meta.get("hpfun_global"))
            step = step.next
    if ctx.gather_for is not None and out.target is aten.clone.default:
        out.target, out.kwargs = aten.alias.default, {}  # a pin on a fresh gathered buffer: no copy needed
        out.meta["hpfun_gathered"] = True  # the use's own copy, which hpfun.schedule places (kept by hpfun.peephole)
    ctx.gather_for = None
    if widen:
        out.meta["hpfun_local_dtype"] = torch.float32
    out._rename(node.name)  # the report and the collectives' reasons use the global graph's names
    out.meta["hpfun_layout"] = node.meta["hpfun_layout"]
    out.meta["hpfun_origin"] = node.name
    if "stack_trace" in node.meta:  # the user's line, for errors raised while the program runs
        out.meta["stack_trace"] = node.meta["stack_trace"]
    out.meta["hpfun_inputs"] = strategy.inputs  # for reports: the layouts the op ran with
    out.meta["hpfun_args"] = taken  # for the verifier: the local values it ran on, in that order
    if isinstance(node.meta.get("val"), torch.Tensor):
        annotate(out, node.meta["hpfun_layout"], node.meta["val"].shape, node.meta["val"].dtype)
    out.meta["hpfun_outputs"] = call.outputs  # for reports: global shapes and dtypes
    return out


_LOW_PRECISION = (torch.bfloat16, torch.float16)
# reductions whose `dtype=` casts the input's elements before they are added (a mean's divides
# the float sum of the uncast elements, and rounds once)
_SUMS_OF_CAST = frozenset([aten.sum.dim_IntList, aten.sum.default, aten.nansum.default])
_REORDERS = (aten.permute.default, aten.transpose.int, aten.t.default)


def _made_contiguous(node) -> bool:
    """A transpose whose traced result is contiguous: its input's strides were transposed
    (`(a + b).transpose(1, 2)` of an `a` transposed before), and the ops after it may need that
    (group norm's kernel refuses another layout). A rank's block need not have those strides (a
    gathered value is laid out in order), so the program makes it contiguous, a copy only where
    it is not."""
    val, source = node.meta.get("val"), node.args[0] if node.args else None
    before = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and isinstance(before, torch.Tensor) and val.is_contiguous() and \
        not before.is_contiguous()


def _keeps_wide(ctx: LowerContext, node) -> bool:
    """Whether `node`'s local value is kept in float32: a bfloat16/float16 partial sum, reduced
    in float32 (the default). Rounding each rank's partial product to bfloat16 before the sum
    would round more often than the unsharded op, which rounds its whole sum once."""
    val, layout = node.meta.get("val"), node.meta.get("hpfun_layout")
    if ctx.reduce_dtype != "float32" or not isinstance(val, torch.Tensor) or val.dtype not in _LOW_PRECISION:
        return False
    return isinstance(layout, Layout) and any(layout.placements[a].reduce in ("sum", "avg") for a in layout.partial_axes)


def _in_dtype(ctx: LowerContext, producer, value, widen: bool):
    """An input as the op wants it: cast up (exactly) for an op kept in float32, back to its
    traced dtype for an op that is not (a value that went through an all-reduce already is)."""
    dtype = producer.meta["val"].dtype
    has = local_dtype(value, dtype)
    if widen and dtype in _LOW_PRECISION and has != torch.float32:
        value = ctx.call(aten.to.dtype, (value, torch.float32))
        value.meta["hpfun_local_dtype"] = torch.float32
    elif not widen and has != dtype:
        value = ctx.call(aten.to.dtype, (value, dtype))
    return value


def _finish(ctx: LowerContext, gm, node, inputs, output_layouts, names, local, bucket_bytes: int,
            overlap: bool, op_by_op: bool) -> Program:
    outs, layouts = [], []
    for producer, want, name in zip(node.args[0], output_layouts, names, strict=True):
        ctx.consumer = (name, "output", "")
        dst = want if want is not None else producer.meta["hpfun_layout"]
        outs.append(_in_dtype(ctx, producer, local(producer, dst, f"out_specs of {name}"), False))
        layouts.append(dst)
    ctx.graph.output(outs)
    peephole.dedupe_collectives(ctx.graph, ctx.collectives, recomputed=frozenset(ctx.redraws))
    if op_by_op:
        peephole.simplify(ctx.graph)
        foreach.fuse(ctx.graph)
    buckets = schedule(ctx.graph, bucket_bytes, overlap)
    module = _make_graph_module(gm, ctx.graph)  # lazy under hpfun's compile: its code is written at first run
    vals = [p.meta["val"] for p in node.args[0]]
    return Program(
        mesh=ctx.mesh,
        module=module,
        input_layouts=tuple(n.meta["hpfun_layout"] for n in inputs),
        input_shapes=tuple(tuple(n.meta["val"].shape) for n in inputs),
        input_orders=tuple(memory_order(n.meta["val"]) for n in inputs),
        output_layouts=tuple(layouts),
        output_shapes=tuple(tuple(v.shape) for v in vals),
        output_dtypes=tuple(v.dtype for v in vals),
        collectives=tuple(ctx.collectives),
        uses_seed=bool(ctx.seed.users),
        buckets=buckets,
        device=ctx.device,
    )
