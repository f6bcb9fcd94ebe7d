"""Why a call would compile again: `explain_cache_miss`.

The `HPFUN_DEBUG` log of each compile is `hpfun.log` (its names are importable from here too).
"""

from __future__ import annotations

import attrs
from torch.utils import _pytree as pytree

from hpfun import lift
from hpfun.api import ShardedFunction, _chose, input_paths
from hpfun.log import COLLECTIVES, LAYOUTS, PROGRAM, level, log_compile  # the log, importable from here as before


@attrs.frozen
class Difference:
    """One way a call's signature differs from a cached one."""

    path: str  # the argument leaf ("args[1]", "args[0]['w1']")
    field: str  # "shape", "dtype", "layout", "kind", "value", "class" (a config's), "argument" or "state" (given or
    # absent), "structure"
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
    flag, an optimizer's momentum), or that nothing was cached yet. Nothing is compiled or run.

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
    if not isinstance(f, ShardedFunction):
        raise TypeError(f"explain_cache_miss takes a function made by hpfun.shard, got {type(f).__name__}")
    call = f._prepare(args, kwargs)
    leaves, key = f._signature(call)
    if key in f._cache or not f._cache or any(_chose(k, e, key) for k, e in f._auto):
        # (an AUTO program also serves the call handing its results back, in the layouts it chose)
        return CacheMiss(bool(f._cache), len(f._cache))
    given = dict(zip(call.paths(), leaves, strict=True))
    candidates = []
    for tree, cached, statics, *_ in f._cache:
        paths = input_paths(pytree.tree_unflatten([0] * tree.num_leaves, tree))
        found = _differences(dict(zip(paths, cached, strict=True)), given)
        found += _static_differences(lift.expand_statics(dict(statics)), lift.expand_statics(dict(key[2])))
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
        if cached == given:
            return []
        if repr(cached.value) == repr(given.value) and \
                (found := lift.class_difference(getattr(cached.value, "key", None), getattr(given.value, "key", None))):
            return [Difference(path, "class", *found)]  # (a config of one repr: its class's values differ)
        return [Difference(path, "value", repr(cached.value), repr(given.value))]
    shown = {"shape": lambda l: str(tuple(l.shape)), "dtype": lambda l: str(l.dtype).replace("torch.", ""),
             "layout": lambda l: l.layout.placements_str(), "requires_grad": lambda l: str(l.requires_grad),
             "strides": lambda l: "contiguous" if l.strides is None else str(l.strides),
             "device": lambda l: str(l.device)}
    return [Difference(path, field, show(cached), show(given)) for field, show in shown.items() if show(cached) != show(given)]


def _kind(leaf) -> str:
    return "a tensor" if leaf.kind == "tensor" else f"the Python value {leaf.value!r}"
