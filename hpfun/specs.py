"""Specs: from what users write (`in_specs`, `out_specs`, `state_specs`) to one layout per leaf.

Specs are pytree prefixes of the arguments and outputs: a `P` (or None) covers a leaf or a
whole subtree. A dict of specs given for a dict argument with other keys than the argument's,
and `state_specs`, are read as *name patterns* instead: each key is a glob pattern
(`fnmatch`: `*` matches any text, dots included) over the dotted names of the leaves
(`layers.0.self_attn.q_proj.weight`), matching a whole name or a tail of it after a dot, so
`"layers.*.q_proj.weight"` matches `model.model.layers.3.q_proj.weight`. Unmatched leaves are
replicated; a pattern that matches nothing and a name matched by two patterns are errors.
Every problem is collected, then raised together with its path and fix.
"""

from __future__ import annotations

import difflib
import fnmatch

import torch
from torch.utils import _pytree as pytree

from hpfun.errors import Problem, SpecError
from hpfun.layout import Layout, P, Partial, Replicate, Shard
from hpfun.mesh import Mesh
from hpfun.sharded import Sharded


def is_sharded(x) -> bool:
    return isinstance(x, Sharded)


def leaf_paths(tree, prefix: str = "args") -> list[str]:
    """The path of every leaf ("args[0]['w1']"), Sharded values as leaves."""
    return [prefix + pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(tree, is_leaf=is_sharded)[0]]


def dotted_names(tree) -> list[str]:
    """Every leaf's keys joined by dots ("layers.0.weight"): what name patterns match."""
    return [".".join(str(_key(k)) for k in path) for path, _ in pytree.tree_flatten_with_path(tree, is_leaf=is_sharded)[0]]


def _key(k):
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def _describe(tree) -> str:
    if isinstance(tree, (torch.Tensor, Sharded)):
        return "a tensor"
    if isinstance(tree, (list, tuple)):
        return f"a {type(tree).__name__} of length {len(tree)}"
    return f"a {type(tree).__name__}"


def n_leaves(tree) -> int:
    return len(pytree.tree_leaves(tree, is_leaf=is_sharded))


# ---------------------------------------------------------------------------------------------
# What a spec may be, and what users write instead
# ---------------------------------------------------------------------------------------------


def spec_problem(spec, mesh: Mesh | None = None) -> str | None:
    """Why `spec` is not a spec (a P or None), with the spelling that was meant; None if it is one."""
    if spec is None or isinstance(spec, P):
        return None
    if isinstance(spec, str):
        return f"is the string {spec!r}, not a spec: write P({spec!r})"
    if isinstance(spec, (tuple, list)) and spec and all(_is_dim_entry(e) for e in spec):
        inner = ", ".join(repr(tuple(e)) if isinstance(e, list) else repr(e) for e in spec)
        return f"is the {type(spec).__name__} {spec!r}, not a spec: write P({inner})"
    if _is_placement(spec) or (isinstance(spec, (tuple, list)) and spec and all(_is_placement(e) for e in spec)):
        placements = spec if isinstance(spec, (tuple, list)) else (spec,)
        return (f"is {_placement_text(spec)}, a placement per mesh axis (DTensor's notation), not a spec: a P names, "
                f"per tensor dim, the mesh axes splitting it{_as_p(placements, mesh)}")
    return f"must be an hpfun.P or None, got {type(spec).__name__} {spec!r}"


def _is_dim_entry(e) -> bool:
    return e is None or isinstance(e, str) or (isinstance(e, (tuple, list)) and e and all(isinstance(a, str) for a in e))


def _is_placement(x) -> bool:
    if isinstance(x, (Shard, Replicate, Partial)):
        return True
    try:
        from torch.distributed.tensor.placement_types import Placement
    except ImportError:  # torch built without distributed
        return False
    return isinstance(x, Placement)


def _placement_text(spec) -> str:
    return repr(tuple(spec)) if isinstance(spec, (tuple, list)) else repr(spec)


def _as_p(placements, mesh: Mesh | None) -> str:
    """`: write P(...)` when the placements translate (Shard and Replicate on a mesh of that many axes)."""
    if mesh is None or len(placements) != mesh.ndim:
        return ""
    dims: dict[int, list[str]] = {}
    for axis, p in zip(mesh.axis_names, placements, strict=True):
        dim = getattr(p, "dim", None)
        if dim is not None and not isinstance(p, Partial):
            dims.setdefault(dim, []).append(axis)
        elif not (isinstance(p, Replicate) or type(p).__name__ == "Replicate"):
            return ""
    entries = [None] * (max(dims) + 1 if dims else 0)
    for d, axes in dims.items():
        entries[d] = axes[0] if len(axes) == 1 else tuple(axes)
    return f": write P({', '.join(map(repr, entries))})"


# ---------------------------------------------------------------------------------------------
# Prefix trees of specs
# ---------------------------------------------------------------------------------------------


def broadcast_prefix(specs, tree, problems: list, path=(), root: str = "args", mesh: Mesh | None = None) -> list:
    """One spec per leaf of `tree` from a prefix tree of specs (P or None at any level); a dict
    of specs whose keys differ from a dict argument's is read as name patterns."""
    where = root + pytree.keystr(path)
    if specs is None or isinstance(specs, P):
        return [specs] * n_leaves(tree)
    if isinstance(tree, (torch.Tensor, Sharded)):  # a leaf given something that is not a spec
        problems.append(Problem(where, f"spec {spec_problem(specs, mesh)}"))
        return [None]
    if not isinstance(tree, (dict, list, tuple)):
        problems.append(Problem(where, f"spec {specs!r} does not fit {_describe(tree)}",
                                "give None (or P()) for a value that is not a tensor"))
        return [None] * n_leaves(tree)
    if isinstance(specs, dict) and isinstance(tree, dict):
        if set(specs) == set(tree):
            return [s for k in tree for s in broadcast_prefix(specs[k], tree[k], problems,
                                                             path + (pytree.MappingKey(k),), root, mesh)]
        names = dotted_names(tree)
        by_name = match_patterns(specs, names, problems, where, mesh)
        return [by_name.get(n) for n in names]
    if isinstance(specs, (list, tuple)) and isinstance(tree, (list, tuple)) and len(specs) == len(tree):
        return [s for i, (sp, t) in enumerate(zip(specs, tree, strict=True))
                for s in broadcast_prefix(sp, t, problems, path + (pytree.SequenceKey(i),), root, mesh)]
    problems.append(Problem(where, f"spec {specs!r} does not fit {_describe(tree)}",
                            "specs are a prefix of the tree: a P (or None) per leaf, or per subtree"))
    return [None] * n_leaves(tree)


# ---------------------------------------------------------------------------------------------
# Name patterns
# ---------------------------------------------------------------------------------------------


def pattern_matches(pattern: str, name: str) -> bool:
    """A glob pattern matches a whole dotted name, or its tail after a dot."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def match_patterns(patterns: dict, names: list[str], problems: list, where: str, mesh: Mesh | None = None,
                   may_miss=()) -> dict:
    """name -> spec from a dict of glob patterns; every typo and overlap becomes a problem.
    Patterns in `may_miss` may match nothing (they matched names an earlier call had)."""
    out: dict[str, P | None] = {}
    matched_by: dict[str, str] = {}
    for pattern, spec in patterns.items():
        at = f"{where}[{pattern!r}]"
        if not isinstance(pattern, str):
            problems.append(Problem(at, f"pattern keys are strings, got {type(pattern).__name__}"))
            continue
        if (bad := spec_problem(spec, mesh)) is not None:
            problems.append(Problem(at, f"spec {bad}"))
            continue
        hits = [n for n in names if pattern_matches(pattern, n)]
        if not hits and pattern not in may_miss:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5) or _close_tails(pattern, names)
            problems.append(Problem(at, "matches no name" + (f"; closest: {', '.join(close)}" if close else ""),
                                    "fix the pattern (`*` matches any text; a pattern may match a name's tail after a "
                                    "dot)" + ("" if close else f"; names are like {', '.join(names[:3])}")))
        for n in hits:
            if n in matched_by:
                problems.append(Problem(n, f"is matched by two patterns, {matched_by[n]!r} and {pattern!r}",
                                        "make the patterns disjoint"))
            matched_by[n] = pattern
            out[n] = spec
    return out


def _close_tails(pattern: str, names: list[str]) -> list[str]:
    """Closest names compared by their last parts (a pattern is usually a name's tail)."""
    depth = pattern.count(".") + 1
    tails = {".".join(n.split(".")[-depth:]): n for n in names}
    return [tails[t] for t in difflib.get_close_matches(pattern, list(tails), n=3, cutoff=0.5)]


# ---------------------------------------------------------------------------------------------
# Layouts of leaves
# ---------------------------------------------------------------------------------------------


def leaf_layout(mesh: Mesh, where: str, x, spec, problems: list) -> Layout | None:
    """The layout of one input leaf (a Sharded value keeps its own); problems appended."""
    if isinstance(x, Sharded):
        if x.layout.mesh != mesh:
            problems.append(Problem(where, f"is a Sharded value on mesh {x.layout.mesh}, not {mesh}"))
        return x.layout
    if not isinstance(x, torch.Tensor):
        return None
    if (bad := spec_problem(spec, mesh)) is not None:
        problems.append(Problem(where, f"spec {bad}"))
        return None
    return tensor_layout(mesh, where, tuple(x.shape), spec or P(), problems,
                         "pad the tensor, pick a size divisible by the axes, or shard another dim")


def tensor_layout(mesh: Mesh, where: str, shape: tuple, spec: P, problems: list, fix: str) -> Layout | None:
    spec_problems = spec.problems(mesh, len(shape))
    if spec_problems:
        problems += [Problem(where, p, "name existing mesh axes, each once, at most one entry per tensor dim")
                     for p in spec_problems]
        return None
    layout = spec.to_layout(mesh, len(shape))
    problems += [Problem(where, f"{p} (shape {shape}, spec {spec})", fix) for p in layout.problems(shape)]
    return layout


def input_layouts(mesh: Mesh, in_specs, args: tuple, problems: list) -> list[Layout | None]:
    """A layout per leaf of the positional arguments (None for non-tensor leaves)."""
    specs = in_specs if isinstance(in_specs, tuple) else (in_specs,) if len(args) == 1 else in_specs
    if (isinstance(in_specs, tuple) and len(in_specs) != len(args) and in_specs
            and all(_is_dim_entry(e) for e in in_specs)):
        problems.append(Problem("in_specs", f"is the tuple {in_specs!r}: a spec is written P(...), and in_specs "
                                f"holds one per argument ({len(args)} given)",
                                f"write in_specs=(P{in_specs!r},)" if len(args) == 1 else "write one P per argument"))
        return [None] * n_leaves(args)
    per_leaf = broadcast_prefix(specs, args, problems, mesh=mesh)
    flat, _ = pytree.tree_flatten_with_path(args, is_leaf=is_sharded)
    return [leaf_layout(mesh, "args" + pytree.keystr(path), x, spec, problems)
            for (path, x), spec in zip(flat, per_leaf, strict=True)]
