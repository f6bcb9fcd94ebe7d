"""Memory per rank: what a lowered program holds, estimated from its liveness, and measured.

Every rank runs the same per-shard program on blocks of the same shapes, so one estimate holds
for every rank. It has two parts:

- **inputs**: what the call is handed and keeps for its whole length: the blocks of the
  arguments and of the lifted state, grouped by what they are (`parameters`, `gradients`,
  `optimizer state`, `buffers` for lifted module and optimizer state; the parameter's name,
  `params` or `batch`, for a plain argument).
- **transient**: what the program allocates while it runs. The program runs its nodes in order,
  and the generated code drops each value after its last use, so a buffer is live from the node
  that allocates it to the last use of any view of it (to the end, for a buffer the program
  returns). Views (`view`, `transpose`, `select`... every op whose schema says its result
  aliases an argument, and `wait_tensor`) allocate nothing and keep their base alive. The
  transient peak is the largest sum of live buffers at any node; at that node it is split into
  activations (forward values kept for backward, gradients, temporaries), collective buffers
  (results of collectives, and the flat buffers and casts that only feed one) and outputs
  (the new parameters and state the program returns, already made).

- **donated** (`shard(..., donate_state=True)`): lifted state the call updates is handed over
  to the program, which frees each block after its last use (the optimizer update that reads
  it), as an in-place step does. Those inputs still count in `inputs`; the transient figures
  are net of what has been freed by then, so the peak no longer holds the old and the new state
  side by side.

The peak per rank is inputs + transient peak. It counts what the program's values hold, not
what kernels allocate inside themselves (a matmul's packing buffers, a collective's staging
copies in the backend), nor the allocator's rounding.

`measure` checks the estimate: it runs one rank's program (its collectives replaced by local
ops that allocate what they return), after a warm-up run, under `torch.profiler` with
`profile_memory=True` on CPU, whose allocation events carry the allocator's running total, or
`torch.cuda.max_memory_allocated` on a GPU.
"""

from __future__ import annotations

import html
import operator

import attrs
import torch
from torch.utils import _pytree as pytree

from hpfun.layout import Layout
from hpfun.quiet import silenced

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_COLLECTIVES = (c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
                c10d.all_to_all_single.default)
_GROUPS = ("parameters", "gradients", "optimizer state", "buffers")


# ---------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------


def estimate(program, groups: list[str] | None = None) -> dict:
    """The memory section of a lowered report (see `hpfun.explain`): bytes per rank held by
    the inputs by group (`groups[i]` names input i's group; default: its input name), and the
    transient peak from the program's liveness."""
    from hpfun.verify import local_run  # it fills node.meta["val"] with local values

    module = program.module
    nodes = list(module.graph.nodes)
    if any(n.op == "call_function" and "val" not in n.meta for n in nodes):
        try:
            local_run(program)
        except Exception:  # a shape read from a value (a native generator's seed): sizes from the layouts only
            for node in nodes:
                if "val" not in node.meta and isinstance(node.meta.get("hpfun_layout"), Layout) and \
                        node.meta.get("hpfun_global") is not None:
                    shape, dtype = node.meta["hpfun_global"][:2]
                    node.meta["val"] = torch.empty(node.meta["hpfun_layout"].local_shape(shape), dtype=dtype,
                                                   device="meta")
    n_in = len(program.input_layouts)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    inputs: dict[str, int] = {}
    for i, (node, layout, shape) in enumerate(zip(placeholders[:n_in], program.input_layouts, program.input_shapes,
                                                  strict=True)):
        dtype = node.meta.get("hpfun_global", (None, torch.float32))[1]
        group = groups[i] if groups else node.name
        inputs[group] = inputs.get(group, 0) + _nbytes(layout.local_shape(shape), dtype)
    for node in nodes:
        if node.op == "get_attr":
            value = getattr(module, node.target, None)
            if isinstance(value, torch.Tensor):
                inputs["constants"] = inputs.get("constants", 0) + value.numel() * value.element_size()
    donated = {}  # placeholder -> bytes: inputs the call hands over, freed after their last use
    for i in getattr(program, "donated", ()):
        node = placeholders[i]
        donated[node] = _nbytes(program.input_layouts[i].local_shape(program.input_shapes[i]),
                                node.meta.get("hpfun_global", (None, torch.float32))[1])
    live = _liveness(nodes, donated)
    return {"inputs": inputs, "donated": sum(donated.values()), **live}


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * (torch.empty((), dtype=dtype).element_size() if dtype is not None else 4)


def _tensors(val) -> list:
    return [v for v in ([val] if isinstance(val, torch.Tensor) else pytree.tree_leaves(val))]


def _aliased_arg(node: torch.fx.Node):
    """The argument node whose buffer `node`'s result is a view of, or None for a new buffer."""
    target = node.target
    if target is c10d.wait_tensor.default or target is operator.getitem:
        return node.args[0]
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    want = schema.returns[0].alias_info.before_set
    for arg, value in zip(schema.arguments, node.args):
        info = arg.alias_info
        if info is not None and info.before_set & want and isinstance(value, torch.fx.Node):
            return value
    return next((a for a in node.args if isinstance(a, torch.fx.Node)), None)


def _liveness(nodes: list[torch.fx.Node], donated: dict | None = None) -> dict:
    """Transient buffers live at each node of the program, and what the peak holds. `donated`
    (placeholder -> bytes): inputs freed after their last use, counted as negative transient
    bytes from then on (the inputs' total stays what the call is handed)."""
    donated = donated or {}
    index = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    buffer: dict = {}  # node -> the node that allocated its buffer (itself, or a view's base)
    size: dict = {}  # allocating node -> bytes, for transient buffers only (not inputs)
    kind: dict = {}
    feeds = _collective_buffers(nodes)
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            buffer[node] = node
            if node in donated:
                size[node] = donated[node]
                kind[node] = "donated"
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and isinstance(node.args[0].meta.get("val"), (tuple, list)):
            parent = node.args[0]
            base = buffer.get(parent, parent)  # a view of one buffer (split) or one output of a multi-output op
            buffer[node] = base if base is not parent else (parent, node.args[1])
            continue
        base = _aliased_arg(node)
        if base is not None:
            buffer[node] = buffer.get(base, base)
            continue
        buffer[node] = node
        tensors = [t for t in _tensors(node.meta.get("val")) if isinstance(t, torch.Tensor)]
        if isinstance(node.meta.get("val"), (tuple, list)):
            for k, t in enumerate(_tensors(node.meta.get("val"))):
                if isinstance(t, torch.Tensor):
                    size[(node, k)] = t.numel() * t.element_size()
                    kind[(node, k)] = "activations"
        elif tensors:
            size[node] = sum(t.numel() * t.element_size() for t in tensors)
            kind[node] = "collective buffers" if node in feeds else "activations"
    born = {b: 0 if b in donated else index[b if isinstance(b, torch.fx.Node) else b[0]] for b in size}
    last = dict(born)
    for node in nodes:
        b = buffer.get(node)
        if b not in size:
            continue
        for user in node.users:
            if user.op == "output":
                last[b] = end
                kind[b] = "outputs"
            else:
                last[b] = max(last[b], index[user])
    handed = sum(donated.values())  # live from the start: the inputs' total already counts them
    timeline = [n - handed for n in _sweep(len(nodes), ((born[b], last[b], n) for b, n in size.items()))]
    peak_at = max(range(len(nodes)), key=timeline.__getitem__) if nodes else 0
    at_peak = {k: 0 for k in ("activations", "collective buffers", "outputs", "donated")}
    for b, n in size.items():
        if born[b] <= peak_at <= last[b]:
            at_peak[kind[b]] += n
    collective = _sweep(len(nodes), ((born[b], last[b], n) for b, n in size.items() if kind[b] == "collective buffers"))
    activations = _sweep(len(nodes), ((born[b], last[b], n) for b, n in size.items() if kind[b] == "activations"))
    return {"transient_peak": timeline[peak_at] if nodes else 0, "peak_node": nodes[peak_at].name if nodes else None,
            "at_peak": at_peak, "collective_peak": max(collective, default=0),
            "activation_peak": max(activations, default=0),
            "outputs": sum(n for b, n in size.items() if kind[b] == "outputs"), "timeline": timeline}


def _sweep(n: int, spans) -> list[int]:
    """Bytes live at each of `n` steps, given (first step, last step, bytes) spans."""
    delta = [0] * (n + 1)
    for first, last, nbytes in spans:
        delta[first] += nbytes
        delta[min(last, n - 1) + 1] -= nbytes
    out, total = [], 0
    for d in delta[:n]:
        total += d
        out.append(total)
    return out


# ops the lowering and the scheduler put around a collective: flattening, concatenating a bucket,
# casting to the reduce dtype (a computed value that only feeds a collective, a gradient, is not glue)
_GLUE = {aten.cat.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
         aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.permute.default,
         aten.flatten.using_ints,
         aten.transpose.int, aten.t.default, aten.split_with_sizes.default, aten.split.Tensor}


def _collective_buffers(nodes: list[torch.fx.Node]) -> set:
    """The results of collectives, and the glue values that only feed collectives (a flat
    bucket buffer, a cast to the reduce dtype), found in one walk from the end."""
    found: set = set()
    for node in reversed(nodes):
        if node.op != "call_function":
            continue
        if node.target in _COLLECTIVES or (node.target in _GLUE and node.users and
                                           all(u.target in _COLLECTIVES or u in found for u in node.users)):
            found.add(node)
    return found


# ---------------------------------------------------------------------------------------------
# The view
# ---------------------------------------------------------------------------------------------


def _mb(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@attrs.frozen
class Memory:
    """Estimated bytes per rank of a lowered program (`Lowered.memory()`): `inputs` by group,
    the `transient` peak the program allocates on top (split at that point into `activations`,
    `collective_buffers` and `new_outputs`), and the `peak` of the two together; the most
    activations (`activation_peak`) and collective buffers (`collective_peak`) live at once,
    wherever that is."""

    inputs: dict
    transient: int
    activations: int
    collective_buffers: int
    new_outputs: int
    collective_peak: int
    peak_node: str | None
    timeline: tuple = attrs.field(converter=tuple, repr=False)
    activation_peak: int = 0  # the most activations (not outputs, not collective buffers) live at once
    donated: int = 0  # bytes of the inputs handed over to the program (donate_state), freed at their last use

    @classmethod
    def from_dict(cls, d: dict) -> "Memory":
        at = d["at_peak"]
        return cls(dict(d["inputs"]), d["transient_peak"], at["activations"], at["collective buffers"], at["outputs"],
                   d["collective_peak"], d["peak_node"], d["timeline"], d["activation_peak"], d.get("donated", 0))

    @property
    def held(self) -> int:
        """Bytes the inputs hold for the whole call."""
        return sum(self.inputs.values())

    @property
    def peak(self) -> int:
        return self.held + self.transient

    def __str__(self) -> str:
        width = max([len(k) for k in self.inputs] + [18])
        lines = ["memory per rank (estimate, the same on every rank):"]
        lines += [f"  {name:<{width}}  {_mb(n):>11}  (input)" for name, n in self.inputs.items()]
        lines.append(f"  {'activations':<{width}}  {_mb(self.activations):>11}  (at the peak; "
                     f"{_mb(self.activation_peak)} at most)")
        lines.append(f"  {'collective buffers':<{width}}  {_mb(self.collective_buffers):>11}  (at the peak; "
                     f"{_mb(self.collective_peak)} at most)")
        lines.append(f"  {'new outputs':<{width}}  {_mb(self.new_outputs):>11}  (at the peak)")
        if self.donated:
            lines.append(f"  {'donated inputs':<{width}}  {_mb(self.donated):>11}  (of the inputs, each freed after its "
                         "last use: the program's figure is net of them)")
        where = f" at %{self.peak_node}" if self.peak_node else ""
        lines.append(f"  peak {_mb(self.peak)}{where}: {_mb(self.held)} held + {_mb(self.transient)} allocated by the program")
        lines.append(f"  live bytes over the program: {_sparkline(self.timeline)}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = [(k, _mb(v), "input") for k, v in self.inputs.items()]
        rows += [("activations", _mb(self.activations), "at the peak"),
                 ("collective buffers", _mb(self.collective_buffers), "at the peak"),
                 ("new outputs", _mb(self.new_outputs), "at the peak"), ("peak", _mb(self.peak), f"at %{self.peak_node}")]
        body = "".join(f"<tr><td>{html.escape(a)}</td><td style='text-align:right'>{b}</td><td>{html.escape(c)}</td></tr>"
                       for a, b, c in rows)
        return (f"<div class='hpfun-memory'><div style='font-weight:bold'>memory per rank (estimate)</div>"
                f"<table>{body}</table>{_svg(self.timeline, self.held)}</div>")


def _sparkline(timeline, width: int = 60) -> str:
    if not timeline:
        return ""
    bars, top, n = " ▁▂▃▄▅▆▇█", max(max(timeline), 1), len(timeline)
    cells = [max(timeline[i * n // width: max(i * n // width + 1, (i + 1) * n // width)]) for i in range(min(width, n))]
    return "".join(bars[max(round(c / top * 8), 0)] for c in cells)


def _svg(timeline, held: int, w: int = 480, h: int = 120) -> str:
    if not timeline:
        return ""
    top, n = max(timeline) + held or 1, len(timeline)
    pts = " ".join(f"{i * w / max(n - 1, 1):.1f},{h - (held + v) * h / top:.1f}" for i, v in enumerate(timeline))
    base = h - held * h / top
    return (f"<svg width='{w}' height='{h + 14}' style='border:1px solid #ccc'>"
            f"<rect x='0' y='{base:.1f}' width='{w}' height='{h - base:.1f}' fill='#dde'/>"
            f"<polyline points='{pts}' fill='none' stroke='#36c'/>"
            f"<text x='2' y='{h + 12}' font-size='10'>program order; shaded: inputs held ({_mb(held)}), "
            f"line: peak {_mb(top)}</text></svg>")


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class Measured:
    """One rank's measured memory during a call: `held` by its input blocks, `transient` the
    allocator's peak above that while the program ran, `peak` both."""

    held: int
    transient: int

    @property
    def peak(self) -> int:
        return self.held + self.transient


def _local_collective(target):
    if target is c10d.all_reduce.default:
        return lambda x, op, group: x.clone()
    if target is c10d.all_gather_into_tensor.default:
        return lambda x, n, group: x.repeat(n, *([1] * (x.dim() - 1)))
    if target is c10d.reduce_scatter_tensor.default:
        return lambda x, op, n, group: x[: x.shape[0] // n].clone()
    if target is c10d.all_to_all_single.default:
        return lambda x, out_splits, in_splits, group: x.clone()
    if target is c10d.wait_tensor.default:
        return lambda x: x
    return None


def local_module(program, boxed: bool = False) -> torch.fx.GraphModule:
    """One rank's program with every collective replaced by a local op allocating what the
    collective returns (values are not the collective's: for measuring memory only). `boxed`:
    called with one list of inputs, which it empties (as a call donating state runs it)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(program.module.graph, {})
    graph.output(out)
    for node in graph.nodes:
        if node.op == "call_function" and (stand_in := _local_collective(node.target)) is not None:
            node.target = stand_in
    if boxed:
        from torch.fx.graph import _BoxedCodeGen

        graph.set_codegen(_BoxedCodeGen())
    return torch.fx.GraphModule(program.module, graph)


def measure(f, *args, rank: int = 0, **kwargs) -> Measured:
    """Run rank `rank`'s part of `f(*args, **kwargs)` (`f` an `hpfun.shard` function) once to
    warm up, then again under the allocator's watch; what its input blocks hold and what the
    program allocated at most on top."""
    from hpfun.sharded import rank_block

    call = f._prepare(args, kwargs)
    entry = f._program(call)[1]
    program = entry.program
    coords = program.mesh.coords(rank)
    values = [call.flat[i] for i in entry.fed_flat] + list(entry.constants_list)
    blocks = []
    for value, layout in zip(values, program.input_layouts, strict=True):
        blocks.append(rank_block(value, layout, coords).clone())
    device = blocks[0].device if blocks else torch.device("cpu")
    donated = set(program.donated)
    module = local_module(program, boxed=bool(donated))
    coord_t = torch.tensor(coords, dtype=torch.int64, device=device)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    held = sum(b.untyped_storage().nbytes() for b in {b.untyped_storage().data_ptr(): b for b in blocks}.values())

    def handed():  # the inputs as a call hands them over: donated blocks as copies only the program holds
        return [b.clone() if i in donated else b for i, b in enumerate(blocks)] + [coord_t, seed]

    # donated blocks are copied as the measured run starts, so the allocator sees them made and
    # freed: what it counts above its starting level, less the copies, is what the program adds
    copies = sum(blocks[i].untyped_storage().nbytes() for i in donated)
    run = (lambda: module(handed())) if donated else (lambda: module(*blocks, coord_t, seed))
    with torch.no_grad():
        run()  # warm-up: compiled random-number kernels, lazy inits
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            result = run()
            torch.cuda.synchronize(device)
            transient = torch.cuda.max_memory_allocated(device) - base - copies
            del result
            return Measured(held, transient)
        return Measured(held, _cpu_peak(run) - copies)


def _cpu_peak(fn) -> int:
    """The CPU allocator's peak above its level when `fn` starts, while `fn` runs (its result
    is kept until the end, as a caller keeps a program's outputs)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with silenced(2):  # the profiler's backend logs its start and stop on fd 2
        prof.start()
    try:
        result = fn()
    finally:
        with silenced(2):
            prof.stop()
    del result
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    events.sort(key=lambda x: x[0])
    total = peak = 0
    for _, n in events:
        total += n
        peak = max(peak, total)
    return peak
