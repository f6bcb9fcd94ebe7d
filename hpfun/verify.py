"""The verifier: hpfun's own invariants, checked on an annotation and on a per-shard program.

`verify_annotation` runs after propagation: every tensor value has a layout of the mesh that
fits its shape; every op's strategy takes as many inputs as the op has tensors, each one a
layout its producer's can be redistributed to; the op's layouts are its strategy's outputs.

`verify_program` runs after lowering: every op of the per-shard program runs on the layouts
its strategy was chosen for (following the redistributions lowering inserted); every
collective's precondition holds on the layout of the value it is applied to, and leaves the
layout recorded after it; and every value's local shape, computed by running the program on
fake tensors of the inputs' local shapes, is its layout's block of its global shape.

A violation is a bug in hpfun, never the user's: `VerificationError` lists every one found,
each naming the node and the user's source line it came from. The suite runs both checks on
every compile, and `HPFUN_DEBUG` (any level) or `HPFUN_VERIFY=1` turns them on for a user.
"""

from __future__ import annotations

import operator
import os

import torch
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from hpfun.capture import user_line, writes as _writes
from hpfun.errors import HpfunError, LayoutError, Problem
from hpfun.layout import Layout, Shard
from hpfun.mesh import Mesh
from hpfun.plan import redistribute_plan
from hpfun.propagate import tensor_inputs


class VerificationError(HpfunError, AssertionError):
    """hpfun built an inconsistent plan or program: a bug in hpfun, to be reported."""

    headline = "hpfun's plan or program is inconsistent (a bug in hpfun: please report it with this message)"


def enabled() -> bool:
    """Whether compiles verify what they build: `HPFUN_VERIFY=1`, or any `HPFUN_DEBUG` level."""
    verify = os.environ.get("HPFUN_VERIFY", "").strip()
    if verify:
        return verify not in ("0", "false", "no", "off")
    debug = os.environ.get("HPFUN_DEBUG", "").strip()
    return bool(debug) and debug != "0"


def _where(node: torch.fx.Node) -> str:
    line = user_line(node.meta.get("stack_trace"))
    origin = node.meta.get("hpfun_origin", node.name)
    return f"{origin} ({node.target})" + (f", from {line}" if line else "")


def _tensor(val) -> bool:
    return isinstance(val, torch.Tensor)


def _layout_problems(layout, shape, mesh: Mesh) -> str:
    """'' if `layout` is a layout of `mesh` that fits `shape`, else why not."""
    if not isinstance(layout, Layout):
        return f"has no layout (meta holds {type(layout).__name__})"
    if layout.mesh != mesh:
        return f"layout {layout} is on another mesh than {mesh}"
    for a, p in enumerate(layout.placements):
        if isinstance(p, Shard) and not 0 <= p.dim < max(len(shape), 0):
            return f"layout {layout.placements_str()} splits dim {p.dim} of a {len(shape)}-dim value"
    try:
        layout.local_shape(shape)
    except (LayoutError, ValueError) as err:
        return f"layout {layout.placements_str()} does not fit shape {tuple(shape)}: {err}"
    return ""


def _values(node: torch.fx.Node) -> list:
    """(val, layout) of each tensor a node makes: one pair, or one per tensor of a tuple (its
    layout a tuple with an entry per element, None where the element is no tensor)."""
    val, layout = node.meta.get("val"), node.meta.get("hpfun_layout")
    if _tensor(val):
        return [(val, layout)]
    leaves = pytree.tree_leaves(val)
    if not any(_tensor(v) for v in leaves):
        return []
    if isinstance(layout, tuple):  # nested like the value (a list of tensors inside the tuple)
        layout = tuple(pytree.tree_leaves(layout, is_leaf=lambda x: x is None or isinstance(x, Layout)))
    layouts = layout if isinstance(layout, tuple) and len(layout) == len(leaves) else [layout] * len(leaves)
    return [(v, l) for v, l in zip(leaves, layouts) if _tensor(v)]


# ---------------------------------------------------------------------------------------------
# After propagation
# ---------------------------------------------------------------------------------------------


def verify_annotation(gm: torch.fx.GraphModule, mesh: Mesh) -> None:
    """Check the annotation `propagate` wrote into `gm`'s nodes; raise VerificationError."""
    problems: list[Problem] = []
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        for val, layout in _values(node):
            if why := _layout_problems(layout, tuple(val.shape), mesh):
                problems.append(Problem(_where(node), why))
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if "hpfun_strategy" not in node.meta:
            if _values(node):
                problems.append(Problem(_where(node), "has no strategy"))
            continue
        strategy = node.meta["hpfun_strategy"]
        producers = tensor_inputs(node)
        if len(strategy.inputs) != len(producers):
            problems.append(Problem(_where(node), f"strategy takes {len(strategy.inputs)} inputs, the op has "
                                                  f"{len(producers)} tensors"))
            continue
        for i, (producer, want) in enumerate(zip(producers, strategy.inputs)):
            have, shape = producer.meta.get("hpfun_layout"), tuple(producer.meta["val"].shape)
            if why := _layout_problems(want, shape, mesh):
                problems.append(Problem(_where(node), f"input {i} ({producer.name}): the strategy's {why}"))
            elif isinstance(have, Layout) and (why := _reaches(have, want, shape)):
                problems.append(Problem(_where(node), f"input {i} ({producer.name}): {why}"))
        chosen = list(strategy.outputs)
        placed = [layout for _, layout in _values(node)]
        if placed != chosen:
            problems.append(Problem(_where(node), f"layouts {[str(p) for p in placed]} are not its strategy's "
                                                  f"outputs {[str(c) for c in chosen]}"))
    if problems:
        raise VerificationError(problems)


def _reaches(src: Layout, dst: Layout, shape) -> str:
    """'' if the planned redistribution from `src` ends at `dst`, else why not."""
    try:
        cur = src
        for step in redistribute_plan(src, dst, shape):
            cur = step.apply(cur)
    except Exception as err:  # a plan that cannot be applied is what this looks for
        return f"no redistribution from {src.placements_str()} to {dst.placements_str()}: {err}"
    if not _same(cur, dst):
        return f"the redistribution from {src.placements_str()} ends at {cur.placements_str()}, not {dst.placements_str()}"
    return ""


# ---------------------------------------------------------------------------------------------
# After lowering
# ---------------------------------------------------------------------------------------------


def _same(a: Layout, b: Layout) -> bool:
    """The same blocks on every rank: equal but for placements on axes of size 1 (a split over
    one rank, a sum of one term and a copy are all the whole value)."""
    if a == b:
        return True
    if a.mesh != b.mesh or len(a.placements) != len(b.placements):
        return False
    big = [i for i, n in enumerate(a.mesh.shape) if n > 1]
    if any(a.placements[i] != b.placements[i] for i in big):
        return False
    dims = {p.dim for p in (*a.placements, *b.placements) if isinstance(p, Shard)}
    return all([x for x in a.shard_axes(d) if x in big] == [x for x in b.shard_axes(d) if x in big] for d in dims)


def _layouts_of(node) -> list[Layout]:
    """The layouts a value of the per-shard program holds (more than one where a step moved
    nothing), through casts and the copies redistribution steps use to prepare a buffer (which
    lowering leaves unannotated); [] where unknown."""
    for _ in range(8):
        if not isinstance(node, torch.fx.Node):
            return []
        if "hpfun_layout" in node.meta:
            return [node.meta["hpfun_layout"], *node.meta.get("hpfun_also", ())]
        if node.target not in _LAYOUT_PRESERVING or not node.args:
            return []
        node = node.args[0]
    return []


def _holds(node, layout: Layout) -> bool:
    """Whether `node` is known to hold `layout` (True when its layouts are unknown)."""
    layouts = _layouts_of(node)
    return not layouts or any(isinstance(have, Layout) and _same(have, layout) for have in layouts)


def _shown(node) -> str:
    return " or ".join(l.placements_str() for l in _layouts_of(node) if isinstance(l, Layout))


_LAYOUT_PRESERVING = {torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default, torch.ops.aten.clone.default}


def verify_program(program) -> None:
    """Check a lowered per-shard program (`hpfun.lower.Program`); raise VerificationError."""
    problems: list[Problem] = []
    try:  # well formed: every node after the nodes it reads (what hpfun.schedule and hpfun.foreach move)
        program.module.graph.lint()
    except Exception as err:  # noqa: BLE001 - fx raises RuntimeError and others
        problems.append(Problem("the per-shard program", f"is malformed: {err}"))
    for node in program.module.graph.nodes:
        step = node.meta.get("hpfun_step")
        if step is not None:
            before, after = node.meta["hpfun_step_layouts"]
            given = node.meta.get("hpfun_step_input")
            if not _holds(given, before):
                problems.append(Problem(_where(node), f"{step.kind} expects {before.placements_str()}, "
                                                      f"its input is {_shown(given)}"))
            try:
                reached = step.apply(before)
            except Exception as err:  # the precondition does not hold
                problems.append(Problem(_where(node), f"{step.kind}'s precondition fails on "
                                                      f"{before.placements_str()}: {err}"))
            else:
                if not _same(reached, after):
                    problems.append(Problem(_where(node), f"{step.kind} gives {reached.placements_str()}, "
                                                          f"recorded {after.placements_str()}"))
        args = node.meta.get("hpfun_args")
        if args is not None:
            for i, (arg, want) in enumerate(zip(args, node.meta["hpfun_inputs"])):
                if not _holds(arg, want):
                    problems.append(Problem(_where(node), f"input {i} is {_shown(arg)}, "
                                                          f"its strategy needs {want.placements_str()}"))
    problems += _shape_problems(program)
    if problems:
        raise VerificationError(problems)


def fake_run(program) -> None:
    """Run the program on fake tensors of the inputs' local shapes, leaving each node's local
    value in `node.meta["val"]`. Raises DataDependentOutputException where a value is read to
    decide a shape (a native generator's seed), or the error of a shape the program cannot run with."""
    module, mesh = program.module, program.mesh
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    inputs = placeholders[: len(program.input_layouts)]
    device = program.device  # where its values are: coords and seed are handed over there
    rank = [torch.zeros(mesh.ndim, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device)]  # coords, seed: real
    with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [torch.empty(layout.local_shape(shape), dtype=n.meta["hpfun_global"][1], device=device)
                 for n, layout, shape in zip(inputs, program.input_layouts, program.input_shapes)]
        with torch.compiler.set_stance("force_eager"):  # compiled helpers (random-number kernels) run as Python
            FakeTensorProp(module, mode).propagate_dont_convert_inputs(*fakes, *rank)


class _OnMeta(torch.fx.Interpreter):
    """Runs a program on meta tensors, leaving each node's value in `node.meta["val"]`: factory
    ops and constants are made on the meta device too.

    An op called again on inputs of the same shapes, strides and dtypes with the same other
    arguments (the next layer's) takes the first call's result object: a meta tensor holds
    nothing but that metadata, and what reads these values (sizes for the memory estimate, local
    shapes for the verifier) reads only it. A 32-layer Llama step's program repeats most of its
    25,000 ops; torch's meta kernels are Python for many of them. Ops that write their arguments
    are run each time, and a program with an op that changes a tensor's metadata in place
    (`resize_`, `t_`, ...) shares nothing, since a shared result would change for every node."""

    def __init__(self, module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        self._seen: dict | None = {} if not any(_restrides(n.target) for n in module.graph.nodes) else None

    def call_function(self, target, args, kwargs):
        if "device" in kwargs or _makes_on_a_device(target):  # given or defaulted (CPU)
            kwargs = {**kwargs, "device": torch.device("meta")}
        if self._seen is None or not isinstance(target, torch._ops.OpOverload) or _writes(target):
            return super().call_function(target, args, kwargs)
        try:
            key = (target, _meta_key(args), _meta_key(tuple(kwargs.items())))
            hash(key)
        except TypeError:  # an unhashable argument: run it
            return super().call_function(target, args, kwargs)
        found = self._seen.get(key)
        if found is None:
            found = self._seen[key] = super().call_function(target, args, kwargs)
        return found

    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    def run_node(self, n):
        value = super().run_node(n)
        n.meta["val"] = value
        return value


def _meta_key(x):
    """A hashable stand-in for an op's arguments: tensors by their metadata."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device)
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_meta_key(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _meta_key(v)) for k, v in x.items()))
    return (type(x), x)  # True, 1 and 1.0 hash alike: the type keeps them apart


# in-place ops that change a tensor's shape or strides
_RESTRIDING = {"resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_",
               "swapaxes_", "swapdims_"}


def _restrides(target) -> bool:
    name = getattr(target, "__name__", "")  # an OpOverload's: "resize_.default"
    return isinstance(target, torch._ops.OpOverload) and name.split(".")[0] in _RESTRIDING


def _makes_on_a_device(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(a.name == "device" and a.kwarg_only for a in schema.arguments)


def meta_run(program) -> None:
    """What `fake_run` does, on meta tensors: 3-7x faster on a Llama step's program, as meta
    tensors skip fake tensors' dispatch. Raises where a value is read (`.item()` on a seed), or an
    op has no meta kernel; the caller then runs `fake_run`."""
    module, mesh = program.module, program.mesh
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    inputs = placeholders[: len(program.input_layouts)]
    rank = [torch.zeros(mesh.ndim, dtype=torch.int64, device="meta"), torch.zeros(1, dtype=torch.int64, device="meta")]
    metas = [torch.empty(layout.local_shape(shape), dtype=n.meta["hpfun_global"][1], device="meta")
             for n, layout, shape in zip(inputs, program.input_layouts, program.input_shapes)]
    with torch.compiler.set_stance("force_eager"):
        _OnMeta(module).run(*metas, *rank)


def local_run(program) -> None:
    """Every node's local value in `node.meta["val"]`: by `meta_run`, or where that cannot run
    (a value read, an op without a meta kernel) by `fake_run`, whose error is raised if it fails too."""
    nodes = list(program.module.graph.nodes)
    saved = {n: n.meta["val"] for n in nodes if "val" in n.meta}
    try:
        return meta_run(program)
    except Exception:  # fake tensors decide: the values as the meta run found them
        for n in nodes:
            n.meta.pop("val", None)
            if n in saved:
                n.meta["val"] = saved[n]
    fake_run(program)


def _shape_problems(program) -> list[Problem]:
    """Run the program on meta or fake tensors of the inputs' local shapes (`local_run`); every
    value with a layout and a global shape must come out its layout's block."""
    module = program.module
    try:
        local_run(program)
    except torch._subclasses.fake_tensor.DataDependentOutputException:
        return []  # a value read to decide a shape (a native generator's seed): no shapes to check
    except Exception as err:  # a shape the program cannot even run with
        return [Problem("the per-shard program", f"does not run on its inputs' local shapes: "
                                                 f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")]
    problems = _mismatched_shapes(module)
    if problems:  # a meta kernel may shape an output unlike the kernel the trace ran (embedding_bag's
        try:      # max_indices outside max mode): fake tensors, as in the trace, decide
            fake_run(program)
        except torch._subclasses.fake_tensor.DataDependentOutputException:
            return []
        problems = _mismatched_shapes(module)
    return problems


def _mismatched_shapes(module) -> list[Problem]:
    problems = []
    for node in module.graph.nodes:
        layout, meta = node.meta.get("hpfun_layout"), node.meta.get("hpfun_global")
        val = node.meta.get("val")
        if not isinstance(layout, Layout) or meta is None or not _tensor(val):
            continue
        want = layout.local_shape(meta[0])
        if tuple(val.shape) != tuple(want):
            problems.append(Problem(_where(node), f"local shape {tuple(val.shape)}, but {layout.placements_str()} of "
                                                  f"{tuple(meta[0])} is {tuple(want)}"))
    return problems
