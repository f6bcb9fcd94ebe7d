"""What hpfun decided, at compile time: the `HPFUN_DEBUG` log and `explain_cache_miss`.

`HPFUN_DEBUG` (read at every compile, so it can change between calls) sets what each compile
logs, through `logging` at DEBUG level:

- 1: the layout chosen for every node of the traced program   (logger "hpfun.layouts")
- 2: also each collective, its bytes and the reason           (logger "hpfun.collectives")
- 3: also the whole per-shard program                         (logger "hpfun.program")

With the variable set, the "hpfun" logger is set to DEBUG; when no handler is configured
anywhere, a handler writing to stderr is added to it, so the records show in a plain script.
Configure `logging` yourself to send them elsewhere.
"""

from __future__ import annotations

import logging
import os

import attrs
import torch
from torch.utils import _pytree as pytree

from hpfun.explain import Lowered

LAYOUTS, COLLECTIVES, PROGRAM = (logging.getLogger(f"hpfun.{name}") for name in ("layouts", "collectives", "program"))


def level() -> int:
    """The `HPFUN_DEBUG` level, 0 (off) to 3; a value that is not a number means 1."""
    value = os.environ.get("HPFUN_DEBUG", "").strip()
    if not value:
        return 0
    try:
        return max(0, min(int(value), 3))
    except ValueError:
        logging.getLogger("hpfun").warning("HPFUN_DEBUG=%r is not a level 0-3; using 1", value)
        return 1


def log_compile(name: str, gm: torch.fx.GraphModule, lowered: Lowered, debug_level: int) -> None:
    """Log one compile of function `name` (the propagated global graph and its report)."""
    _make_visible()
    LAYOUTS.debug("%s: compiled for mesh %s, %d nodes", name, lowered.mesh, len(gm.graph.nodes))
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    paths = {node: x["path"] for node, x in zip(placeholders, lowered.inputs, strict=True)}
    for node in gm.graph.nodes:
        if "hpfun_layout" in node.meta:
            LAYOUTS.debug("%s: %s", name, _node_text(node, paths))
    if debug_level >= 2:
        for c in lowered.collectives:
            COLLECTIVES.debug("%s: %s", name, c)
        COLLECTIVES.debug("%s: %s", name, lowered.cost())
    if debug_level >= 3:
        PROGRAM.debug("%s:\n%s", name, lowered)


def _node_text(node: torch.fx.Node, paths: dict) -> str:
    """`%mm = aten.mm.default: [S(0), R], [R, S(1)] -> [S(0), S(1)] global [8, 32]`"""
    out = node.meta["hpfun_layout"]
    outs = ", ".join("-" if l is None else l.placements_str() for l in (out if isinstance(out, tuple) else (out,)))
    val = node.meta.get("val")
    shape = f" global {list(val.shape)}" if isinstance(val, torch.Tensor) else ""
    if node.op == "placeholder":
        return f"%{node.name} ({paths[node]}): {outs}{shape}"
    strategy = node.meta.get("hpfun_strategy")
    ins = ", ".join(l.placements_str() for l in strategy.inputs) + " " if strategy and strategy.inputs else ""
    return f"%{node.name} = {node.target}: {ins}-> {outs}{shape}"


def _make_visible() -> None:
    logger = logging.getLogger("hpfun")
    if logger.getEffectiveLevel() > logging.DEBUG:
        logger.setLevel(logging.DEBUG)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)


# ---------------------------------------------------------------------------------------------
# Why a call would compile again
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class Difference:
    """One way a call's signature differs from a cached one."""

    path: str  # the argument leaf ("args[1]", "args[0]['w1']")
    field: str  # "shape", "dtype", "layout", "kind", "value", "argument" or "state" (given or absent), "structure"
    cached: str
    given: str

    def __str__(self) -> str:
        return f"{self.path}: {self.field} {self.given}, cached {self.cached}"


@attrs.frozen
class CacheMiss:
    """What `explain_cache_miss` returns: `str()` says it in words; `hit`, `cached` (how many
    signatures the function has compiled) and `differences` (from the closest one) as data."""

    hit: bool
    cached: int
    differences: tuple[Difference, ...] = ()

    def __str__(self) -> str:
        if self.hit:
            return f"cache hit: these arguments reuse a compiled program ({self.cached} cached)"
        if not self.cached:
            return "nothing cached yet: the first call compiles"
        lines = [f"would compile again: none of the {self.cached} cached signature(s) matches; the closest differs in"]
        return "\n".join(lines + [f"  {d}" for d in self.differences])


def explain_cache_miss(f, *args, **kwargs) -> CacheMiss:
    """Why calling the sharded function `f` with `args` would compile again: which argument's
    or lifted tensor's shape, dtype or layout (by its path or name) differs from the closest
    cached signature, or which Python value deciding the trace changed (a module's training
    flag, a learning rate), or that nothing was cached yet. Nothing is compiled or run.

    >>> import torch, hpfun
    >>> mesh = hpfun.Mesh.simulated((2,), ("dp",))
    >>> f = hpfun.shard(lambda x, y: x + y, mesh=mesh, in_specs=(hpfun.P("dp"), hpfun.P()))
    >>> print(hpfun.explain_cache_miss(f, torch.ones(4), torch.ones(4)))
    nothing cached yet: the first call compiles
    >>> _ = f(torch.ones(4), torch.ones(4))
    >>> print(hpfun.explain_cache_miss(f, torch.ones(4), torch.ones(4, dtype=torch.float64)))
    would compile again: none of the 1 cached signature(s) matches; the closest differs in
      args[1]: dtype float64, cached float32
    """
    from hpfun.api import ShardedFunction, input_paths  # api imports this module for its compile log

    if not isinstance(f, ShardedFunction):
        raise TypeError(f"explain_cache_miss takes a function made by hpfun.shard, got {type(f).__name__}")
    call = f._prepare(args, kwargs)
    leaves, key = f._signature(call)
    if key in f._cache or not f._cache:
        return CacheMiss(key in f._cache, len(f._cache))
    given = dict(zip(call.paths(), leaves, strict=True))
    candidates = []
    for tree, cached, statics, *_ in f._cache:
        paths = input_paths(pytree.tree_unflatten([0] * tree.num_leaves, tree))
        found = _differences(dict(zip(paths, cached, strict=True)), given)
        found += _static_differences(dict(statics), dict(key[2]))
        if not found and tree != key[0]:  # same leaves, other containers (a list for a tuple...)
            found = [Difference("args", "structure", str(tree), str(key[0]))]
        candidates.append(found)
    return CacheMiss(False, len(f._cache), tuple(min(candidates, key=len)))


def _static_differences(cached: dict, given: dict) -> list[Difference]:
    return [Difference(name, "value", repr(cached.get(name)), repr(given.get(name)))
            for name in dict.fromkeys([*cached, *given]) if cached.get(name) != given.get(name)]


def _differences(cached: dict, given: dict) -> list[Difference]:
    out, state = [], {}
    for path in dict.fromkeys([*cached, *given]):
        if path in cached and path in given:
            out += _leaf_differences(path, cached[path], given[path])
        elif path.startswith(("args", "kwargs")):
            out.append(Difference(path, "argument", _presence(cached, path), _presence(given, path)))
        else:  # lifted state that appeared or went: one line per kind (an optimizer's first state...)
            key = (_state_group(path), _presence(cached, path), _presence(given, path))
            state.setdefault(key, []).append(path)
    for (group, was, now), paths in state.items():
        shown = paths[0] if len(paths) == 1 else f"{group} ({len(paths)} lifted tensors, e.g. {paths[0]})"
        out.append(Difference(shown, "state", was, now))
    return out


def _state_group(name: str) -> str:
    """`opt.state.model.0.weight.exp_avg` -> `opt.state.*`; `model.0.weight.grad` -> `*.grad`."""
    parts = name.split(".")
    if "state" in parts[:2]:
        return ".".join(parts[:parts.index("state") + 1]) + ".*"
    return "*." + parts[-1]


def _presence(leaves: dict, path: str) -> str:
    return "given" if path in leaves else "absent"


def _leaf_differences(path: str, cached, given) -> list[Difference]:
    if cached.kind != given.kind:
        return [Difference(path, "kind", _kind(cached), _kind(given))]
    if cached.kind == "static":
        return [Difference(path, "value", repr(cached.value), repr(given.value))] if cached != given else []
    shown = {"shape": lambda l: str(tuple(l.shape)), "dtype": lambda l: str(l.dtype).replace("torch.", ""),
             "layout": lambda l: l.layout.placements_str()}
    return [Difference(path, field, show(cached), show(given)) for field, show in shown.items() if show(cached) != show(given)]


def _kind(leaf) -> str:
    return "a tensor" if leaf.kind == "tensor" else f"the Python value {leaf.value!r}"
