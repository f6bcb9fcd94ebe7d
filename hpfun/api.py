"""`shard`: the user-facing transform, its spec checks and its program cache."""

from __future__ import annotations

import functools

import attrs
import torch
from torch.utils import _pytree as pytree

from hpfun import debug
from hpfun.capture import capture
from hpfun.errors import Problem, SpecError
from hpfun.explain import Lowered
from hpfun.fold import fold_contractions
from hpfun.layout import Layout, P
from hpfun.lower import LowerContext, Program, lower
from hpfun.mesh import Mesh
from hpfun.propagate import propagate
from hpfun.rng import draw_seed
from hpfun.runtime import simulated
from hpfun.runtime.distributed import runtime_for
from hpfun.sharded import Sharded, local_block


def shard(f=None, *, mesh: Mesh, in_specs, out_specs=None, compile: bool = False, rng: str = "philox",
          fallback: str | None = None):
    """Make a global-view function run sharded over `mesh`.

    `in_specs` is a pytree prefix of the argument tuple (a `P` or None per leaf or subtree; None
    means replicated); `out_specs` likewise for the outputs, or None to keep the layouts hpfun
    chose. Arguments may be global tensors (split by the specs) or `Sharded` values; outputs are
    `Sharded`. Python scalars among the arguments are baked into the program. `compile=True`
    hands the per-shard program to `torch.compile` (inductor). Random ops draw from a
    counter-based generator whose values do not depend on the mesh or layouts
    (`rng="philox"`); `rng="native"` uses torch's generator per block instead: faster, but
    the values change with the layout. Ops without a sharding rule are an error listing them all,
    unless `fallback="replicate"`: they then run on gathered inputs, with a warning naming each
    op and the bytes it costs.

    >>> import hpfun, torch
    >>> mesh = hpfun.Mesh.simulated((2,), ("dp",))
    >>> f = hpfun.shard(lambda x: (x * 2).sum(0), mesh=mesh, in_specs=(hpfun.P("dp"),), out_specs=hpfun.P())
    >>> f(torch.arange(4.0)).full()
    tensor(12.)
    """
    if f is None:
        return functools.partial(shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs, compile=compile, rng=rng,
                                 fallback=fallback)
    if not isinstance(mesh, Mesh):
        raise SpecError(f"mesh must be an hpfun.Mesh, got {type(mesh).__name__}", headline="bad mesh")
    if rng not in ("philox", "native"):
        raise SpecError(f"rng must be 'philox' or 'native', got {rng!r}", headline="bad option")
    if fallback not in (None, "replicate"):
        raise SpecError(f"fallback must be None or 'replicate', got {fallback!r}", headline="bad option")
    return ShardedFunction(f, mesh, in_specs, out_specs, Options(compile=bool(compile), rng=rng, fallback=fallback))


@attrs.frozen
class Options:
    """Compile options; part of the cache key."""

    compile: bool = False
    rng: str = "philox"
    fallback: str | None = None


@attrs.frozen
class _Leaf:
    """What the cache key records of one argument leaf."""

    kind: str  # "tensor" (a global tensor or a Sharded value: same program) or "static"
    shape: tuple | None = None
    dtype: torch.dtype | None = None
    layout: Layout | None = None
    value: object = None
    device: torch.device | None = None  # where the program runs; tensors it creates go there

    def describe(self) -> str:
        if self.kind == "static":
            return repr(self.value)
        return f"{str(self.dtype).replace('torch.', '')}{list(self.shape)} {self.layout.placements_str()}"


class ShardedFunction:
    """A function traced once per input signature and run as one per-shard program."""

    def __init__(self, fn, mesh: Mesh, in_specs, out_specs, options: Options = Options()):
        self.fn, self.mesh, self.in_specs, self.out_specs, self.options = fn, mesh, in_specs, out_specs, options
        self._cache: dict = {}
        self._fast: dict = {}  # cheap signature -> cache entry: skips spec checks on repeated calls
        self.trace_count = 0
        functools.update_wrapper(self, fn)

    # -- public ---------------------------------------------------------------------------------

    def __call__(self, *args):
        flat, tree = pytree.tree_flatten(args, is_leaf=_is_sharded)
        entry = self._fast.get((tree, tuple(map(_fast_leaf, flat))))
        if entry is None:
            entry = self._program(args)[1]
        program = entry.program
        tensors = [x for x, leaf in zip(flat, entry.leaves, strict=True) if leaf.kind != "static"]
        shards = execute(program, tensors, self.options.compile)
        results = [Sharded(lay, shape, s) for lay, shape, s in
                   zip(program.output_layouts, program.output_shapes, shards, strict=True)]
        return pytree.tree_unflatten(results, entry.out_tree)

    def lower(self, *args) -> Lowered:
        """The per-shard program for these arguments, with layouts and collectives (nothing runs)."""
        return self._lowered(args, self._program(args)[1])

    def _lowered(self, args, entry: "_Entry") -> Lowered:
        tensors = [(path, leaf) for path, leaf in zip(_leaf_paths(args), entry.leaves, strict=True) if leaf.kind != "static"]
        return Lowered(entry.program, input_paths=[p for p, _ in tensors], input_dtypes=[l.dtype for _, l in tensors],
                       output_paths=_leaf_paths(pytree.tree_unflatten([0] * entry.out_tree.num_leaves, entry.out_tree), "outputs"))

    # -- compile and cache --------------------------------------------------------------------------

    def _program(self, args):
        leaves, key = self._signature(args)
        entry = self._cache.get(key)
        if entry is None:
            if self.mesh.runtime == "distributed":
                runtime_for(self.mesh).check_same_program(_describe(key))
            entry = self._compile(args, leaves)
            self._cache[key] = entry
        flat, tree = pytree.tree_flatten(args, is_leaf=_is_sharded)
        fast = (tree, tuple(map(_fast_leaf, flat)))
        if _hashable(fast):
            self._fast[fast] = entry
        return entry.program, entry

    def _signature(self, args):
        flat, tree = pytree.tree_flatten_with_path(args, is_leaf=_is_sharded)
        layouts = _input_layouts(self.mesh, self.in_specs, args)
        leaves = tuple(_leaf(x, layout) for (_, x), layout in zip(flat, layouts, strict=True))
        key = (tree, leaves, self.mesh, self.options)
        try:
            hash(key)
        except TypeError as err:
            raise SpecError(f"non-tensor arguments must be hashable (they are baked into the program): {err}") from None
        return leaves, key

    def _compile(self, args, leaves) -> "_Entry":
        self.trace_count += 1
        flat, in_tree = pytree.tree_flatten(args, is_leaf=_is_sharded)
        tensor_pos = [i for i, l in enumerate(leaves) if l.kind != "static"]
        out_tree_box = []

        def flat_fn(*tensors):
            full = list(flat)
            for i, t in zip(tensor_pos, tensors, strict=True):
                full[i] = t
            out = self.fn(*pytree.tree_unflatten(full, in_tree))
            out_flat, out_tree = pytree.tree_flatten(out)
            out_tree_box.append((out_tree, out))
            return out_flat

        device = next((leaves[i].device for i in tensor_pos), None)
        gm = capture(flat_fn, [(leaves[i].shape, leaves[i].dtype) for i in tensor_pos], device)
        fold_contractions(gm)
        out_tree, out_example = out_tree_box[-1]
        propagate(gm, self.mesh, [leaves[i].layout for i in tensor_pos], fallback=self.options.fallback)
        out_layouts = _output_layouts(self.mesh, self.out_specs, out_example, gm)
        out_names = ["outputs" + pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(out_example)[0]]
        in_names = [path for path, leaf in zip(_leaf_paths(args), leaves, strict=True) if leaf.kind != "static"]
        program = lower(gm, self.mesh, out_layouts, out_names, rng=self.options.rng, input_names=in_names)
        entry = _Entry(program, tuple(leaves), out_tree)
        if level := debug.level():  # HPFUN_DEBUG, read at each compile
            debug.log_compile(getattr(self.fn, "__qualname__", repr(self.fn)), gm, self._lowered(args, entry), level)
        return entry


def execute(program: Program, tensors: list, compile: bool = False) -> list[tuple]:
    """Run a program on its mesh's runtime; per output, the shards this process holds."""
    mesh = program.mesh
    seed = draw_seed() if program.uses_seed else _NO_SEED
    if mesh.runtime == "simulated":
        per_rank = [[_local(x, lay, mesh.coords(r)) for x, lay in zip(tensors, program.input_layouts, strict=True)]
                    for r in range(mesh.size)]
        outs = simulated.run(program.module, mesh, per_rank, seed, compile=compile)
        return [tuple(outs[r][i] for r in range(mesh.size)) for i in range(len(program.output_layouts))]
    runtime = runtime_for(mesh)
    local = [_local(x, lay, runtime.coords, runtime.device) for x, lay in zip(tensors, program.input_layouts, strict=True)]
    return [(out,) for out in runtime.run(program.module, local, seed, program.uses_seed, compile=compile)]


_NO_SEED = torch.zeros(1, dtype=torch.int64)


def _describe(key) -> str:
    tree, leaves, mesh, options = key
    return f"args {tree} [{'; '.join(l.describe() for l in leaves)}] on {mesh} with {options}"


@attrs.frozen(eq=False)
class _Entry:
    program: Program
    leaves: tuple
    out_tree: object


def _fast_leaf(x):
    if isinstance(x, torch.Tensor):
        return (x.shape, x.dtype, x.device)
    if isinstance(x, Sharded):
        return (x.layout, x.global_shape, x.dtype)
    return ("static", type(x), x)


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _is_sharded(x) -> bool:
    return isinstance(x, Sharded)


def _leaf(x, layout) -> _Leaf:
    if isinstance(x, Sharded):
        return _Leaf("tensor", x.global_shape, x.dtype, x.layout, device=_run_device(x.layout.mesh, x.shards[0]))
    if isinstance(x, torch.Tensor):
        return _Leaf("tensor", tuple(x.shape), x.dtype, layout, device=_run_device(layout.mesh, x))
    return _Leaf("static", value=x)


def _run_device(mesh: Mesh, x: torch.Tensor) -> torch.device:
    """A distributed program runs on its ranks' device (inputs are moved there); a simulated
    one where its inputs are."""
    return runtime_for(mesh).device if mesh.runtime == "distributed" else x.device


def _local(x, layout: Layout, coords, device=None) -> torch.Tensor:
    """The rank's input: its shard of a Sharded value, or its block of a global tensor."""
    if isinstance(x, Sharded):
        return x.shards[layout.mesh.rank(coords)] if layout.mesh.runtime == "simulated" else x.shards[0]
    block = local_block(x, layout, coords)
    return block.to(device) if device is not None else block


# ---------------------------------------------------------------------------------------------
# Specs: pytree prefixes, checked all at once
# ---------------------------------------------------------------------------------------------


def _path_str(path) -> str:
    return "args" + pytree.keystr(path)


def _leaf_paths(tree, prefix: str = "args") -> list[str]:
    """The path of every leaf ("args[0]['w1']"), Sharded values as leaves."""
    return [prefix + pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(tree, is_leaf=_is_sharded)[0]]


def broadcast_prefix(specs, tree, problems: list, path=()) -> list:
    """One spec per leaf of `tree` from a prefix tree of specs (P or None at any level)."""
    if specs is None or isinstance(specs, P):
        return [specs] * len(pytree.tree_leaves(tree, is_leaf=_is_sharded))
    if isinstance(specs, dict) and isinstance(tree, dict):
        if set(specs) != set(tree):
            problems.append(Problem(_path_str(path), f"spec keys {sorted(specs)} do not match argument keys {sorted(tree)}",
                                    "give a spec for every key, or one P for the whole dict"))
            return [None] * len(pytree.tree_leaves(tree, is_leaf=_is_sharded))
        return [s for k in tree for s in broadcast_prefix(specs[k], tree[k], problems, path + (pytree.MappingKey(k),))]
    if isinstance(specs, (list, tuple)) and isinstance(tree, (list, tuple)) and len(specs) == len(tree):
        return [s for i, (sp, t) in enumerate(zip(specs, tree, strict=True))
                for s in broadcast_prefix(sp, t, problems, path + (pytree.SequenceKey(i),))]
    problems.append(Problem(_path_str(path), f"spec {specs!r} does not match the argument structure {type(tree).__name__}"
                            + (f" of length {len(tree)}" if isinstance(tree, (list, tuple)) else ""),
                            "specs are a prefix of the arguments: a P (or None) per leaf, or per subtree"))
    return [None] * len(pytree.tree_leaves(tree, is_leaf=_is_sharded))


def _input_layouts(mesh: Mesh, in_specs, args) -> list[Layout | None]:
    problems: list[Problem] = []
    specs = in_specs if isinstance(in_specs, tuple) else (in_specs,) if len(args) == 1 else in_specs
    per_leaf = broadcast_prefix(specs, args, problems)
    flat, _ = pytree.tree_flatten_with_path(args, is_leaf=_is_sharded)
    layouts = []
    for (path, x), spec in zip(flat, per_leaf, strict=True):
        layouts.append(_leaf_layout(mesh, path, x, spec, problems))
    if problems:
        raise SpecError(problems)
    return layouts


def _leaf_layout(mesh: Mesh, path, x, spec, problems: list) -> Layout | None:
    where = _path_str(path)
    if isinstance(x, Sharded):
        if x.layout.mesh != mesh:
            problems.append(Problem(where, f"is a Sharded value on mesh {x.layout.mesh}, not {mesh}"))
        return x.layout
    if not isinstance(x, torch.Tensor):
        return None
    if spec is not None and not isinstance(spec, P):
        problems.append(Problem(where, f"spec must be an hpfun.P or None, got {spec!r}"))
        return None
    spec = spec or P()
    spec_problems = spec.problems(mesh, x.ndim)
    if spec_problems:
        problems += [Problem(where, p, "name existing mesh axes, each once, at most one entry per tensor dim")
                     for p in spec_problems]
        return None
    layout = spec.to_layout(mesh, x.ndim)
    for p in layout.problems(tuple(x.shape)):
        problems.append(Problem(where, f"{p} (shape {tuple(x.shape)}, spec {spec})",
                                "pad the tensor, pick a size divisible by the axes, or shard another dim"))
    return layout


def _output_layouts(mesh: Mesh, out_specs, out_example, gm) -> list[Layout | None]:
    problems: list[Problem] = []
    out_nodes = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if out_specs is None:
        return [None] * len(out_nodes)
    per_leaf = broadcast_prefix(out_specs, out_example, problems, ())
    layouts = []
    for i, (node, spec) in enumerate(zip(out_nodes, per_leaf, strict=True)):
        val = node.meta["val"]
        if spec is not None and not isinstance(spec, P):
            problems.append(Problem(f"outputs[{i}]", f"spec must be an hpfun.P or None, got {spec!r}"))
            continue
        spec = spec or P()
        found = spec.problems(mesh, val.ndim)
        layout = None if found else spec.to_layout(mesh, val.ndim)
        found += layout.problems(tuple(val.shape)) if layout else []
        problems += [Problem(f"outputs[{i}]", p) for p in found]
        layouts.append(layout)
    if problems:
        raise SpecError([attrs.evolve(p, where=p.where.replace("args", "outputs", 1)) for p in problems])
    return layouts


def redistribute(x: Sharded, layout: Layout) -> Sharded:
    """Move a `Sharded` value to another layout on the same mesh with the planner's collectives.

    >>> import hpfun, torch
    >>> mesh = hpfun.Mesh.simulated((2,), ("dp",))
    >>> x = hpfun.Sharded.from_global(torch.arange(4.0), hpfun.parse("[S(0)] on {dp: 2}"))
    >>> hpfun.redistribute(x, hpfun.parse("[R] on {dp: 2}")).shards[1].tolist()
    [0.0, 1.0, 2.0, 3.0]
    """
    layout = layout.normalized(len(x.global_shape))
    if layout.mesh != x.layout.mesh:
        raise SpecError(f"cannot redistribute from mesh {x.layout.mesh} to mesh {layout.mesh}")
    program = _redistribute_program(x.layout, layout, tuple(x.global_shape), x.dtype)
    return Sharded(layout, x.global_shape, execute(program, [x])[0])


@functools.lru_cache(maxsize=256)
def _redistribute_program(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype) -> Program:
    ctx = LowerContext(src.mesh)
    (value,) = ctx.begin(1)
    ctx.consumer = ("redistribute", "redistribute", f"{src.placements_str()} -> {dst.placements_str()}")
    ctx.graph.output([ctx.redistribute(value, src, dst, shape, dtype)])
    module = torch.fx.GraphModule(torch.nn.Module(), ctx.graph)
    return Program(src.mesh, module, (src,), (shape,), (dst,), (shape,), (dtype,), tuple(ctx.collectives))
