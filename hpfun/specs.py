"""Specs: from what users write (`in_specs`, `out_specs`, `state_specs`) to one layout per leaf.

Specs are pytree prefixes of the arguments and outputs: a `P` (or None) covers a leaf or a
whole subtree. A dict of specs given for a dict argument with other keys than the argument's,
and `state_specs`, are read as *name patterns* instead: each key is a glob pattern
(`fnmatch`: `*` matches any text, dots included) over the dotted names of the leaves
(`layers.0.self_attn.q_proj.weight`), matching a whole name or a tail of it after a dot, so
`"layers.*.q_proj.weight"` matches `model.model.layers.3.q_proj.weight`. Unmatched leaves are
replicated. A name several patterns match takes the most specific one's spec (the one with the
most characters that are not wildcards: `attention.output.dense.weight` over `output.dense.weight`
in a BERT layer); two as specific as each other with different specs, and a pattern that
matches nothing, are errors.
Every problem is collected, then raised together with its path and fix.

`AUTO` may stand wherever a `P` may (in_specs, state_specs, out_specs): the leaf's layout is
chosen by the planner (`hpfun.auto`); until then it is an `Auto` marker naming whose choice
it takes (its own path, or the parameter a gradient or optimizer state follows).
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import difflib
import fnmatch
import functools
import re
import warnings

import attrs
import torch
from torch.utils import _pytree as pytree

from hpfun import lift
from hpfun.errors import Problem, SpecError, user_stacklevel
from hpfun.layout import Layout, P, Partial, Replicate, Shard
from hpfun.mesh import Mesh
from hpfun.sharded import Sharded


class _AutoSpec:
    """The spec `hpfun.AUTO`: the planner chooses this leaf's layout (one object, compared by identity)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "AUTO"

    def to_layout(self, mesh, ndim):
        raise SpecError("hpfun.AUTO has no layout of its own: it is a spec the planner decides, in hpfun.shard's "
                        "in_specs or state_specs (the choice is listed by f.lower(...))")

    def __reduce__(self):
        return (_AutoSpec, ())


AUTO = _AutoSpec()


@attrs.frozen
class Auto:
    """The layout of a leaf whose spec is AUTO, before the planner chooses it: `group` names
    the leaf whose choice it takes (its own path, or the parameter it follows)."""

    group: str
    mesh: Mesh

    def placements_str(self) -> str:
        return f"AUTO({self.group})"

    def __str__(self) -> str:
        return self.placements_str()


def is_spec_leaf(spec) -> bool:
    """A P, None or AUTO: a spec for one leaf or a whole subtree."""
    return spec is None or spec is AUTO or isinstance(spec, P)


def is_sharded(x) -> bool:
    return isinstance(x, Sharded)


def leaf_paths(tree, prefix: str = "args") -> list[str]:
    """The path of every leaf ("args[0]['w1']"), Sharded values as leaves."""
    return [prefix + pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(tree, is_leaf=is_sharded)[0]]


def dotted_names(tree) -> list[str]:
    """Every leaf's keys joined by dots ("layers.0.weight"): what name patterns match."""
    return [_dotted(path) for path, _ in pytree.tree_flatten_with_path(tree, is_leaf=is_sharded)[0]]


def _dotted(path) -> str:
    return ".".join(str(_key(k)) for k in path)


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
    if isinstance(tree, dict):
        keys = ", ".join(map(repr, list(tree)[:4])) + (", ..." if len(tree) > 4 else "")
        return f"a dict with keys {{{keys}}}"
    name = type(tree).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def n_leaves(tree) -> int:
    return len(pytree.tree_leaves(tree, is_leaf=is_sharded))


def register_container(kind: type) -> bool:
    """Whether an argument of this type is now a container whose values hpfun sees: a
    dataclass (a `Batch(x, y)`), or a mapping that is not a dict (transformers' BatchEncoding,
    what its tokenizers and data collators return, is a UserDict), registered with
    torch.utils._pytree once; the function is handed the same type back."""
    if kind in pytree.SUPPORTED_NODES:
        return True
    name = f"{kind.__module__}.{kind.__qualname__}"
    try:
        if dataclasses.is_dataclass(kind) and not issubclass(kind, collections.abc.Mapping):
            pytree.register_pytree_node(kind, _dataclass_flatten, functools.partial(_dataclass_unflatten, kind),
                                        serialized_type_name=name, flatten_with_keys_fn=_dataclass_flatten_with_keys)
            return True
        if dataclasses.is_dataclass(kind):
            pytree.register_dataclass(kind, serialized_type_name=name)
            return True
        if issubclass(kind, collections.abc.Mapping):
            pytree.register_pytree_node(kind, _mapping_flatten, functools.partial(_mapping_unflatten, kind),
                                        serialized_type_name=name, flatten_with_keys_fn=_mapping_flatten_with_keys)
            return True
        if issubclass(kind, collections.UserList):  # a list of the user's (its items, as a list's)
            pytree.register_pytree_node(kind, _user_list_flatten, functools.partial(_user_list_unflatten, kind),
                                        serialized_type_name=name, flatten_with_keys_fn=_user_list_flatten_with_keys)
            return True
    except (TypeError, ValueError):  # fields a dataclass's __init__ does not take: a leaf, as before
        return False
    return False


def register_containers_in(tree, depth: int = 8) -> None:
    """`register_container` for every dataclass and mapping inside `tree` (a dataclass field
    holding another dataclass: each level is a container, or the inner one would be a leaf)."""
    if depth == 0 or isinstance(tree, (torch.Tensor, str, bytes, type)):
        return
    if dataclasses.is_dataclass(tree):
        if register_container(type(tree)):
            for f in dataclasses.fields(tree):
                register_containers_in(getattr(tree, f.name, None), depth - 1)
    elif isinstance(tree, collections.abc.Mapping):
        if type(tree) is dict or register_container(type(tree)):
            for v in list(tree.values()):
                register_containers_in(v, depth - 1)
    elif isinstance(tree, (list, tuple)) or isinstance(tree, collections.UserList) and register_container(type(tree)):
        for v in tree:
            register_containers_in(v, depth - 1)


def dataclass_items(x) -> dict:
    """A dataclass instance's values as hpfun hands it over: its fields, then the attributes set
    on it besides them (`batch.mask = ...` after it was made, or what __post_init__ computed and
    the caller changed since), so the function gets the object as it is, not one rebuilt by its
    __init__ (which runs __post_init__ again and drops the rest)."""
    items = {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if hasattr(x, f.name)}
    held = getattr(x, "__dict__", None)
    if isinstance(held, dict):
        items.update((k, v) for k, v in held.items() if k not in items)
    return items


def _dataclass_flatten(x):
    items = dataclass_items(x)
    return list(items.values()), tuple(items)


def _dataclass_flatten_with_keys(x):
    items = dataclass_items(x)
    return [(pytree.GetAttrKey(k), v) for k, v in items.items()], tuple(items)


def _dataclass_unflatten(kind, values, names):
    out = kind.__new__(kind)  # (as it was: not through __init__, which may check or compute)
    for name, value in zip(names, values, strict=True):
        object.__setattr__(out, name, value)  # (a frozen dataclass's too)
    return out


class _Attributes:
    """The attributes a UserDict or UserList argument holds besides its items (a subclass's
    `self.tag`), given to the one hpfun rebuilds for the function (its constructor's defaults
    had been read instead, silently). Their values key the program as a config's do; an object
    held by identity (transformers' BatchEncoding `_encodings`) is handed over without keying it,
    as a new batch's would otherwise compile again."""

    __slots__ = ("items", "_key")

    def __init__(self, items: dict):
        self.items = items
        self._key = tuple((k, key) for k, v in items.items()
                          if (key := lift.held_value_key(v)) is not None)

    def __eq__(self, other) -> bool:
        return type(other) is _Attributes and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"<attributes {', '.join(self.items)}>"

    @classmethod
    def of(cls, x) -> "_Attributes | None":
        held = container_attributes(x)
        return cls(held) if held else None

    def put(self, out) -> None:
        for k, v in (self.items if self is not None else {}).items():
            object.__setattr__(out, k, v)


def container_attributes(x) -> dict:
    """A UserDict's or UserList's own attributes, besides its items (`data`); a dict subclass's
    (`cfg.scale = 2.0` beside its items), read without its `__getattr__`."""
    return {k: v for k, v in (lift._own_dict(x) or {}).items() if k != "data" or type(x) is not dict
            and isinstance(x, dict)}


def _mapping_flatten(m):
    return list(m.values()), (list(m.keys()), _Attributes.of(m) if isinstance(m, (collections.UserDict, dict))
                              else None)


def _user_list_flatten(x):
    return list(x), _Attributes.of(x)


def _user_list_flatten_with_keys(x):
    return [(pytree.SequenceKey(i), v) for i, v in enumerate(x)], _Attributes.of(x)


def _user_list_unflatten(kind, values, held):
    out = kind.__new__(kind)
    out.data = list(values)
    _Attributes.put(held, out)
    return out


def _mapping_flatten_with_keys(m):
    return [(pytree.MappingKey(k), v) for k, v in m.items()], _mapping_flatten(m)[1]


def _mapping_unflatten(kind, values, context):
    keys, held = context
    out = _mapping_made(kind, dict(zip(keys, values, strict=True)))
    if held is not None:
        _Attributes.put(held, out)
    return out


def _mapping_made(kind, data: dict):
    try:
        return kind(data)
    except Exception:  # noqa: BLE001 - a constructor that wants more: by keywords, or filled in place
        pass
    if all(isinstance(k, str) for k in data):  # (a Mapping of the user's made as `MyMap(w=...)`)
        try:
            return kind(**data)
        except Exception:  # noqa: BLE001
            pass
    out = kind.__new__(kind)
    if isinstance(out, collections.UserDict):
        out.data = data
        return out
    try:
        out.update(data)
    except Exception as err:  # noqa: BLE001 - a read-only Mapping, or one whose __init__ makes its storage
        raise TypeError(f"hpfun hands a mapping argument of type {kind.__name__} to the function as one of its own "
                        f"type, made with {kind.__name__}(dict) or {kind.__name__}(**dict), which it refused: give "
                        f"it a constructor taking the items, or pass a dict") from err
    return out


# ---------------------------------------------------------------------------------------------
# What a spec may be, and what users write instead
# ---------------------------------------------------------------------------------------------


def bad_spec(where: str, spec, mesh: Mesh | None = None) -> Problem | None:
    """Why `spec` is not a spec (a P, None or AUTO), with the spelling that was meant; None if it is one."""
    if is_spec_leaf(spec):
        return None
    if isinstance(spec, str) and (parsed := _parsed_notation(spec, mesh)) is not None:  # ('S(0)', what layouts print)
        placements = parsed.placements if isinstance(parsed, Layout) else parsed
        fix = _as_p(placements, mesh) if not isinstance(parsed, Layout) or \
            any(not _is_replicate(p) and _shard_dim(p) is None for p in placements) else f"write {_p_of_layout(parsed)}"
        return Problem(where, f"spec is the string {spec!r}, hpfun's layout notation (what a layout prints), not a "
                       "spec: a P names, per tensor dim, the mesh axes splitting it", fix)
    if isinstance(spec, str):
        return Problem(where, f"spec is the string {spec!r}, not a P", f"write P({spec!r})")
    if _is_dim_tuple(spec):
        return Problem(where, f"spec is the {type(spec).__name__} {spec!r}, not a P", f"write {P(*spec)}")
    placements = tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)
    if placements and all(_is_placement(p) for p in placements):
        return Problem(where, f"spec is {_placement_text(spec)}, {_notation(placements)}, not a spec: a P names, per "
                       "tensor dim, the mesh axes splitting it", _as_p(placements, mesh))
    return Problem(where, f"spec must be an hpfun.P or None, got {type(spec).__name__} {spec!r}", _WRITE_P)


_WRITE_P = "write P(...) with one entry per tensor dim: a mesh axis name, a tuple of them, or None"


def _is_dim_tuple(spec) -> bool:
    """("dp", None), ["dp", ("dp", "tp")]: a P's entries without the P (at least one axis name)."""
    return (isinstance(spec, (tuple, list)) and any(e is not None for e in spec)
            and all(e is None or isinstance(e, str) or _is_axes(e) for e in spec))


def _is_axes(e) -> bool:
    return isinstance(e, (tuple, list)) and bool(e) and all(isinstance(a, str) for a in e)


def _is_placement(x) -> bool:
    return isinstance(x, (Shard, Replicate, Partial)) or _is_dtensor_placement(x)


def _is_dtensor_placement(x) -> bool:
    try:
        from torch.distributed.tensor.placement_types import Placement
    except ImportError:  # torch built without distributed
        return False
    return isinstance(x, Placement)


def _placement_text(spec) -> str:
    return repr(tuple(spec)) if isinstance(spec, (tuple, list)) else repr(spec)


def _notation(placements) -> str:
    if any(_is_dtensor_placement(p) for p in placements):
        return "DTensor's placement per mesh axis"
    return "hpfun's placement per mesh axis (what a Layout holds)"


def _parsed_notation(text: str, mesh: Mesh | None):
    """What a string in hpfun's layout notation writes: a Layout (`'[S(0)] on {a: 2}'`; a list
    of placements on `mesh` whose order is not the mesh's, `'[S(0)[1], S(0)[0]]'`), or its
    placements (`'S(0)'`, `'[S(0), R]'`); None where it is not that notation (a mesh axis name)."""
    from hpfun.layout import parse

    for on in ((None, mesh) if mesh is not None else (None,)):
        try:
            parsed = parse(text, on)
        except Exception:  # (any text that is not the notation: parse says why in its own words)
            continue
        if isinstance(parsed, Layout):
            return parsed
        if isinstance(parsed, tuple) and parsed and all(_is_placement(p) for p in parsed):
            return parsed
        return (parsed,) if _is_placement(parsed) else None
    return None


def _p_of_layout(layout: Layout) -> P:
    """The P of a layout of Shards and Replicates: per tensor dim, the axes splitting it, in its order."""
    dims = {p.dim for p in layout.placements if isinstance(p, Shard)}
    names = layout.mesh.axis_names
    entries = [tuple(names[a] for a in layout.shard_axes(d)) or None for d in range(max(dims) + 1 if dims else 0)]
    return P(*[e[0] if e is not None and len(e) == 1 else e for e in entries])


def _as_p(placements, mesh: Mesh | None) -> str:
    """The P that the placements mean, where they translate (Shard and Replicate; one per mesh
    axis, or a single one on a mesh of one axis); the choices for a single Shard otherwise."""
    if any(not _is_replicate(p) and _shard_dim(p) is None for p in placements):
        return ("a P cannot ask for a pending sum (Partial): pass the summed tensor, or a Sharded value; "
                "out_specs=None keeps the Partial layouts hpfun chose")
    if mesh is None:
        return _WRITE_P
    if len(placements) == mesh.ndim:
        return f"write {_p_of(dict(zip(mesh.axis_names, placements, strict=True)))}"
    if len(placements) == 1 and _is_replicate(placements[0]):
        return "write P() (replicated over every mesh axis)"
    if len(placements) == 1:
        options = [str(_p_of({axis: placements[0]})) for axis in mesh.axis_names]
        return (f"write {' or '.join(options)} to split dim {_shard_dim(placements[0])} over one mesh axis, "
                f"{_p_of({axis: placements[0] for axis in mesh.axis_names})} over all {mesh.ndim}")
    return f"the mesh has {mesh.ndim} axes ({', '.join(mesh.axis_names)}), not {len(placements)}; {_WRITE_P}"


def _is_replicate(p) -> bool:
    return type(p).__name__ == "Replicate"


def _shard_dim(p) -> int | None:
    dim = getattr(p, "dim", None) if type(p).__name__ in ("Shard", "_StridedShard") else None
    return dim if isinstance(dim, int) and dim >= 0 else None


def _p_of(by_axis: dict) -> P:
    """The P of one placement per named axis (Shard or Replicate), axes in mesh order."""
    dims: dict[int, list[str]] = {}
    for axis, p in by_axis.items():
        if _shard_dim(p) is not None:
            dims.setdefault(_shard_dim(p), []).append(axis)
    entries = [tuple(dims.get(d, ())) or None for d in range(max(dims) + 1 if dims else 0)]
    return P(*entries)


def spec_text(tree) -> str:
    """A tree of specs as users write it: P('dp', None), not P(dims=('dp', None))."""
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {spec_text(v)}" for k, v in tree.items()) + "}"
    if isinstance(tree, (list, tuple)) and not _is_dim_tuple(tree):
        items = ", ".join(map(spec_text, tree)) + ("," if isinstance(tree, tuple) and len(tree) == 1 else "")
        return f"({items})" if isinstance(tree, tuple) else f"[{items}]"
    return str(tree) if isinstance(tree, P) else repr(tree)


def _dataclass_specs(specs) -> dict:
    """A dataclass of specs by field name; a field left at its default value that is no spec (a
    `steps: int = 0` beside the tensors: `St(P("dp"))`) specifies nothing, as None."""
    out = {}
    for f in dataclasses.fields(specs):
        if hasattr(specs, f.name):
            v = getattr(specs, f.name)
            out[f.name] = None if _left_at_default(v, f) else v
    return out


def _left_at_default(v, f: dataclasses.Field) -> bool:
    """Whether a spec dataclass's field holds its default (or its default factory's value), with
    no spec inside: `shape: tuple = (2, 3)`, `tags: list = field(default_factory=list)`, `eps = nan`."""
    if is_spec_leaf(v) and v is not None or any(isinstance(leaf, P) for leaf in pytree.tree_leaves(v)):
        return False
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        try:
            default = f.default_factory()
        except Exception:  # noqa: BLE001 - a factory that needs more than nothing: no default to compare
            return False
    else:
        return False
    if v is default:
        return True
    try:
        same = type(v) is type(default) and bool(v == default)
    except Exception:  # noqa: BLE001 - values whose == is not a truth value (arrays, tensors)
        return False
    return same or isinstance(v, float) and isinstance(default, float) and v != v and default != default


def spec_tree_problems(specs, root: str, mesh: Mesh | None = None, path: str = "") -> list[Problem]:
    """Leaves of a spec tree that are no spec whatever the values they cover (a string, a tuple
    of axis names, a placement): found before tracing, so they are reported with the other
    problems of the call."""
    if is_spec_leaf(specs):
        return []
    if dataclasses.is_dataclass(specs) and not isinstance(specs, type):  # a Batch of specs for a Batch
        return [p for name, spec in _dataclass_specs(specs).items()
                for p in spec_tree_problems(spec, root, mesh, f"{path}.{name}")]
    if isinstance(specs, dict):
        return [p for k, v in specs.items() for p in spec_tree_problems(v, root, mesh, f"{path}[{k!r}]")]
    if _is_spec_tree(specs):
        return [p for i, v in enumerate(specs) for p in spec_tree_problems(v, root, mesh, f"{path}[{i}]")]
    return [bad_spec(root + path, specs, mesh)]


# ---------------------------------------------------------------------------------------------
# Prefix trees of specs
# ---------------------------------------------------------------------------------------------


def broadcast_prefix(specs, tree, problems: list, path=(), root: str = "args", mesh: Mesh | None = None,
                     kept: dict | None = None) -> list:
    """One spec per leaf of `tree` from a prefix tree of specs (P or None at any level); a dict
    of specs whose keys differ from a dict argument's is read as name patterns. A tensor only
    wildcards match whose dims their spec does not divide is kept whole: noted in `kept` (where
    -> {name: why}) for the caller's `WildcardWarning`."""
    where = root + pytree.keystr(path)
    if is_spec_leaf(specs):
        return [specs] * n_leaves(tree)
    if dataclasses.is_dataclass(specs) and not isinstance(specs, type) and isinstance(tree, type(specs)):
        specs = _dataclass_specs(specs)  # a Batch of specs for a Batch (or for a subclass: its own fields None)
        specs.update((k, None) for k in dataclass_items(tree) if k not in specs)
    if isinstance(specs, dict) and dataclasses.is_dataclass(tree) and not isinstance(tree, type) \
            and not isinstance(tree, collections.abc.Mapping):  # by field name
        fields = {f.name for f in dataclasses.fields(tree)}
        tree = dataclass_items(tree)
        if set(specs) <= fields:  # (an attribute set besides the fields: a value no spec names)
            specs = {**specs, **{k: None for k in tree if k not in fields}}
    if isinstance(specs, dict) and isinstance(tree, collections.abc.Mapping):
        if set(specs) == set(tree):
            return [s for k in tree for s in broadcast_prefix(specs[k], tree[k], problems,
                                                             path + (pytree.MappingKey(k),), root, mesh, kept)]
        flat = pytree.tree_flatten_with_path(tree, is_leaf=is_sharded)[0]
        names, leaves = [_dotted(path) for path, _ in flat], [x for _, x in flat]
        by_name = match_patterns(specs, names, problems, where, mesh)
        out = []
        for name, x in zip(names, leaves, strict=True):
            spec = by_name.get(name)
            if kept is not None and mesh is not None and spec is not None and only_wildcards(specs, name) and \
                    (why := misfit(mesh, x, spec)):  # never kept whole without the caller to say so
                spec = None
                kept.setdefault(where, {})[name] = f"{tuple(x.shape)}: {why}"
            out.append(spec)
        return out
    if isinstance(specs, (list, tuple)) and isinstance(tree, (list, tuple, collections.UserList)) and \
            len(specs) == len(tree):
        return [s for i, (sp, t) in enumerate(zip(specs, tree, strict=True))
                for s in broadcast_prefix(sp, t, problems, path + (pytree.SequenceKey(i),), root, mesh, kept)]
    if not _is_spec_tree(specs):  # a string, a tuple of axis names, a placement: meant as one spec
        problems.append(bad_spec(where, specs, mesh))
    elif isinstance(tree, (dict, list, tuple, torch.Tensor, Sharded)):
        problems.append(Problem(where, f"spec {spec_text(specs)} does not fit {_describe(tree)}",
                                "specs are a prefix of the values: a P (or None) per tensor, or one for a whole "
                                "subtree; a dict or tuple of specs only where the value is one"))
    elif dataclasses.is_dataclass(tree) or isinstance(tree, collections.abc.Mapping):
        problems.append(Problem(where, f"spec {spec_text(specs)} does not fit {_describe(tree)}",
                                f"give one P for the whole {type(tree).__name__}, a dict of specs by its "
                                f"{'field names' if dataclasses.is_dataclass(tree) else 'keys'}, or the same "
                                f"{type(tree).__name__} holding specs"))
    else:
        problems.append(Problem(where, f"spec {spec_text(specs)} does not fit {_describe(tree)}",
                                "give None (or P()) for a value that is not a tensor"))
    return [None] * n_leaves(tree)


def _is_spec_tree(specs) -> bool:
    """A dict, list or tuple of specs (not the entries of one P, nor a placement per axis)."""
    if isinstance(specs, dict):
        return True
    return (isinstance(specs, (list, tuple)) and not _is_dim_tuple(specs)
            and not (specs and all(map(_is_placement, specs))))


# ---------------------------------------------------------------------------------------------
# Name patterns
# ---------------------------------------------------------------------------------------------


def pattern_matches(pattern: str, name: str) -> bool:
    """A glob pattern matches a whole dotted name, or its tail after a dot."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def match_patterns(patterns: dict, names: list[str], problems: list, where: str, mesh: Mesh | None = None,
                   may_miss=(), matched_by: dict | None = None, aliases: dict | None = None,
                   hint: str = "") -> dict:
    """name -> spec from a dict of glob patterns; every typo and overlap becomes a problem.
    Patterns in `may_miss` may match nothing (they matched names an earlier call had).
    `matched_by`, if given, is filled with name -> the pattern that decided its spec.
    `aliases` (another name of a tensor -> the name it is lifted under: a tied weight's second
    place) lets a pattern name it either way; `hint` is added where a pattern matches nothing."""
    aliases = aliases or {}
    out: dict[str, P | None] = {}
    reached: dict[str, dict] = {}  # a tied tensor's name -> pattern -> (its spec, the names it matched it by)
    matched_by = {} if matched_by is None else matched_by
    for pattern, spec in patterns.items():
        at = f"{where}[{pattern!r}]"
        if not isinstance(pattern, str):
            problems.append(Problem(at, f"pattern keys are strings, got {type(pattern).__name__}"))
            continue
        if (bad := bad_spec(at, spec, mesh)) is not None:
            problems.append(bad)
            continue
        hits = [n for n in names if pattern_matches(pattern, n)]
        hits += [n for a, n in aliases.items() if n not in hits and pattern_matches(pattern, a)]
        if not hits and pattern not in may_miss:
            if not names:
                problems.append(Problem(at, "matches no name: there is nothing to match (no tensor was lifted)",
                                        "close over (or read as a global) the module, optimizer or tensors to lay "
                                        "out, or pass them as arguments and give in_specs"))
                continue
            close = _closest(pattern, names) or _close_tails(pattern, names)
            problems.append(Problem(at, "matches no name" + (f"; closest: {', '.join(close)}" if close else ""),
                                    "fix the pattern (`*` matches any text; a pattern may match a name's tail after a "
                                    "dot)" + ("" if close else f"; names are like {', '.join(names[:3])}") +
                                    (hint if not close or _unknown_head(pattern, names) else "")))
        for n in hits:
            by = {m for m in (n, *(a for a, b in aliases.items() if b == n)) if pattern_matches(pattern, m)}
            if (clash := next((q for q, (s, b) in reached.get(n, {}).items() if s != spec and not b & by), None)):
                # two patterns reach one tensor by different names (a tied weight's two places) with
                # different specs: each was meant for its own tensor, and neither is more right
                problems.append(Problem(where, f"{clash!r} and {pattern!r} name one tensor (tied: lifted as {n!r}, "
                                               f"also named {', '.join(sorted(a for a, b in aliases.items() if b == n))})"
                                               f" by different names, given different specs, "
                                               f"{reached[n][clash][0]} and {spec}",
                                        "give it one spec, under either name (a pattern that matches both names "
                                        "decides for both)"))
                continue
            if any(b == n for b in aliases.values()):
                reached.setdefault(n, {})[pattern] = (spec, by)
            if n in matched_by:
                before, now = specificity(matched_by[n]), specificity(pattern)
                if before > now or before == now and out[n] == spec:
                    continue  # the more specific pattern decides (or both say the same)
                if before == now:
                    problems.append(Problem(where, f"{n!r} is matched by two patterns as specific as each other, "
                                                   f"{matched_by[n]!r} and {pattern!r}, with different specs",
                                            "make one more specific (the pattern with more characters that are not "
                                            "wildcards decides) or make them disjoint"))
            matched_by[n] = pattern
            out[n] = spec
    return out


def is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def only_wildcards(patterns: dict, name: str) -> bool:
    """No pattern without wildcards matches `name`: a plan for many tensors decides its spec."""
    return not any(isinstance(p, str) and not is_glob(p) and pattern_matches(p, name) for p in patterns)


class WildcardWarning(UserWarning):
    """A tensor only wildcard patterns match (in state_specs, or a dict of patterns in in_specs
    or out_specs) could not take their spec (a dim the mesh axes do not divide, too few dims) and
    is kept whole; named by a specific pattern, the same spec is an error."""


def misfit(mesh: Mesh, x, spec) -> str | None:
    """Why a tensor cannot take a well-formed spec, or None when it can (or the spec itself is
    malformed, which stays an error)."""
    if not isinstance(x, torch.Tensor) or not isinstance(spec, P) or bad_spec("", spec, mesh) is not None:
        return None
    if any(axis not in mesh.axis_names for d in range(len(spec.dims)) for axis in spec.axes(d)):
        return None
    if len(spec.dims) > x.ndim:
        return f"{spec} has more entries than its {x.ndim} dims"
    problems = spec.to_layout(mesh, x.ndim).problems(tuple(x.shape))
    return f"{problems[0]} (spec {spec})" if problems else None


def warn_kept_whole(where: str, kept: dict, state: bool = False) -> None:
    """One WildcardWarning listing the tensors (name -> shape and why) a wildcard left whole,
    attributed to the user's call."""
    first = next(iter(kept)).split(".")  # (the name's last two parts after `*.`; a name of two parts as it is:
    example = ".".join(first) if len(first) <= 2 else "*." + ".".join(first[-2:])  # `*.` would need a third)
    level = user_stacklevel()
    warnings.warn(f"{where}: {len(kept)} tensor(s) matched only by wildcard patterns cannot take their spec and are "
                  "kept whole (replicated) on every rank" + (", with their gradients and optimizer state" * state) +
                  ":\n" + "\n".join(f"  {n} {why}" for n, why in kept.items()) +
                  f"\nname them with a more specific pattern to choose their layout (e.g. '{example}': P() beside "
                  "the wildcard keeps that one whole and silences this), or pad them", WildcardWarning, stacklevel=level)


def specificity(pattern: str) -> int:
    """How specific a glob pattern is: its characters that are not wildcards (a `[...]` set counts one)."""
    return len(re.sub(r"\[[^\]]*\]", "x", pattern).replace("*", "").replace("?", ""))


def _close_tails(pattern: str, names: list[str]) -> list[str]:
    """Closest names compared by their last parts (a pattern is usually a name's tail)."""
    depth = pattern.count(".") + 1
    tails = {".".join(n.split(".")[-depth:]): n for n in names}
    return [tails[t] for t in _closest(pattern, list(tails))]


def _unknown_head(pattern: str, names) -> bool:
    """Whether a pattern's first part is no name's (`mom.0.weight` where names start `model.`):
    then it is not a typo of a name that its closest names would say all about."""
    head = pattern.split(".", 1)[0]
    return "*" not in head and not any(n.split(".", 1)[0] == head for n in names)


def _closest(text: str, candidates: list[str], n: int = 3) -> list[str]:
    """The `n` candidates most like `text` (similarity at least 0.5), ties in name order."""
    scored = [(-difflib.SequenceMatcher(None, text, c).ratio(), c) for c in candidates]
    return [c for score, c in sorted(scored)[:n] if -score >= 0.5]


# ---------------------------------------------------------------------------------------------
# Layouts of leaves
# ---------------------------------------------------------------------------------------------


def leaf_layout(mesh: Mesh, where: str, x, spec, problems: list) -> Layout | None:
    """The layout of one input leaf (a Sharded value keeps its own); problems appended."""
    if isinstance(x, Sharded):
        if x.layout.mesh != mesh and not where.startswith(("args", "kwargs")) and x.layout.mesh.runtime == "distributed":
            problems.append(Problem(where, f"holds this rank's block of a value a sharded function on mesh "
                                    f"{x.layout.mesh} left split, and this function runs on {mesh}",
                                    "put the full values back between the two: hpfun.gather_state(model, inplace=True) "
                                    "(and the optimizer's), every rank calling it; or run both functions on one mesh"))
        elif x.layout.mesh != mesh:
            other = x.layout.mesh
            alike = str(other) == str(mesh) and other.runtime != mesh.runtime
            problems.append(Problem(where, f"is a Sharded value on mesh {other}{f' ({other.runtime})' if alike else ''}, "
                                    f"not {mesh}{f' ({mesh.runtime})' if alike else ''}",
                                    "make it on this mesh (hpfun.parse(text, mesh=...), or P(...).to_layout(mesh, ndim))"
                                    if alike else "pass its global value (.full()), which this function's in_specs "
                                    "split, or run both functions on one mesh"))
        return x.layout
    if not isinstance(x, torch.Tensor):
        return None
    if (bad := bad_spec(where, spec, mesh)) is not None:
        problems.append(bad)
        return None
    if spec is AUTO:
        return Auto(where, mesh)
    return tensor_layout(mesh, where, tuple(x.shape), spec or P(), problems,
                         "pad the tensor, pick a size divisible by the axes (for a data loader's last, smaller batch: "
                         "drop_last=True), or shard another dim")


def tensor_layout(mesh: Mesh, where: str, shape: tuple, spec: P, problems: list, fix: str) -> Layout | None:
    spec_problems = spec.problems(mesh, len(shape))
    if spec_problems:
        problems += [Problem(where, p, "name existing mesh axes, each once, at most one entry per tensor dim")
                     for p in spec_problems]
        return None
    layout = spec.to_layout(mesh, len(shape))
    problems += [Problem(where, f"{p} (shape {shape}, spec {spec})", fix) for p in layout.problems(shape)]
    return layout


_ONE_PER_ARGUMENT = ("give one spec per positional argument, None for one that is not a tensor (keyword arguments "
                     "count at their positions; keyword-only ones are replicated)")


def input_layouts(mesh: Mesh, in_specs, args: tuple, problems: list) -> list[Layout | None]:
    """A layout per leaf of the positional arguments (None for non-tensor leaves)."""
    specs = in_specs if isinstance(in_specs, tuple) else (in_specs,) if len(args) == 1 else in_specs
    if isinstance(in_specs, tuple) and len(in_specs) != len(args) and _is_dim_tuple(in_specs):
        problems.append(Problem("in_specs", f"is the tuple {in_specs!r}: a spec is written P(...), and in_specs "
                                f"holds one per argument ({len(args)} given)",
                                f"write in_specs=({P(*in_specs)},)" if len(args) == 1 else "write one P per argument"))
        return [None] * n_leaves(args)
    if isinstance(specs, (tuple, list)) and len(specs) != len(args) and _is_spec_tree(specs):
        problems.append(Problem("in_specs", f"has {len(specs)} entries, one per positional argument, but the call "
                                f"passes {len(args)}", _ONE_PER_ARGUMENT))
        return [None] * n_leaves(args)
    kept: dict = {}
    if isinstance(specs, (tuple, list)):
        problems += split_scalars(specs, args, "args", "in_specs")
    per_leaf = broadcast_prefix(specs, args, problems, mesh=mesh, kept=kept)
    flat, _ = pytree.tree_flatten_with_path(args, is_leaf=is_sharded)
    layouts = [leaf_layout(mesh, "args" + pytree.keystr(path), x, spec, problems)
               for (path, x), spec in zip(flat, per_leaf, strict=True)]
    warn_kept_whole_unless(kept, problems)
    return layouts


def split_scalars(specs, values, root: str, what: str) -> list[Problem]:
    """A spec that splits, given for a Python number or string itself (`in_specs=(P("dp"), P("dp"))`
    for `f(x, 0.5)`): a value that is not a tensor is baked into the program, whole on every rank,
    so the split would be ignored. (A spec covering a container of tensors and numbers is not one.)"""
    if not isinstance(values, (tuple, list)) or len(specs) != len(values):
        return []
    return [Problem(f"{root}[{i}]", f"is a Python {type(v).__name__}, not a tensor, but its {what} entry {spec} splits "
                    "it: a value that is not a tensor is the same on every rank",
                    f"give None (or P()) for it in {what}, or {'pass' if what == 'in_specs' else 'return'} it as a "
                    "tensor (torch.tensor(...)) to split it")
            for i, (spec, v) in enumerate(zip(specs, values)) if isinstance(spec, P) and
            any(d is not None for d in spec.dims) and isinstance(v, (bool, int, float, complex, str))]


def warn_kept_whole_unless(kept: dict, problems: list) -> None:
    """A WildcardWarning per dict of patterns that kept tensors whole, unless the call has
    problems (it raises: no warning beside the error)."""
    for where, names in kept.items() if not problems else ():
        warn_kept_whole(where, names)
