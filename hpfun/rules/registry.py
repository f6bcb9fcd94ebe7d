"""The op -> rule registry, filled from YAML tables and `register`.

A table maps op overloads (`aten.mm.default`) to a rule family and its parameters. The special
entry `__default__` is merged under every entry of its file. Keys are strict; an op named in two
places, an unknown family or class, or an unknown op is an error naming `file:line`. An op of
another library (`transformers.grouped_mm_fallback.default`), which exists only once that
library is imported, is kept by name and looked up by name when a graph holds it. Built-in
tables come first; folders in `HPFUN_RULES_PATH` (colon-separated) and `load(path)` add to
them, never replace them.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import attrs
import torch
import yaml

from hpfun.errors import Problem, RuleFileError
from hpfun.rules.attention import Attention
from hpfun.rules.base import DataDependent, Replicated, Rule
from hpfun.rules.contraction import Contraction
from hpfun.rules.conv import Convolution, ConvolutionBackward, Pool
from hpfun.rules.gather import Embedding, EmbeddingBackward, Gather, IndexSelect, Scatter, ZerosAndScatter
from hpfun.rules.grouped import AtenGroupedMm, GroupedMm, GroupedMmBackward
from hpfun.rules.linalg import Batched
from hpfun.rules.index import Index, IndexPut
from hpfun.rules.loss import NllLossBackward
from hpfun.rules.norm import BatchNorm, GroupNorm, GroupNormBackward, LayerNorm, LayerNormBackward
from hpfun.rules.pointwise import Factory, Like, Pointwise, SameFeatureMeta
from hpfun.rules.reduction import ArgReduction, Normalize, Pad, Reduction, VectorNorm
from hpfun.rules.shape import Cat, ComplexView, Diagonal, Expand, Permute, Reshape, Slice, SliceScatter, Split

FAMILIES: dict[str, type[Rule]] = {
    "pointwise": Pointwise,
    "like": Like,
    "same_feature_meta": SameFeatureMeta,
    "factory": Factory,
    "reduction": Reduction,
    "arg_reduction": ArgReduction,
    "vector_norm": VectorNorm,
    "normalize": Normalize,
    "pad": Pad,
    "contraction": Contraction,
    "reshape": Reshape,
    "permute": Permute,
    "expand": Expand,
    "slice": Slice,
    "split": Split,
    "cat": Cat,
    "diagonal": Diagonal,
    "slice_scatter": SliceScatter,
    "complex_view": ComplexView,
    "gather": Gather,
    "scatter": Scatter,
    "zeros_and_scatter": ZerosAndScatter,
    "embedding": Embedding,
    "embedding_backward": EmbeddingBackward,
    "index_select": IndexSelect,
    "index": Index,
    "index_put": IndexPut,
    "pool": Pool,
    "convolution": Convolution,
    "convolution_backward": ConvolutionBackward,
    "layer_norm": LayerNorm,
    "layer_norm_backward": LayerNormBackward,
    "group_norm": GroupNorm,
    "group_norm_backward": GroupNormBackward,
    "batch_norm": BatchNorm,
    "attention": Attention,
    "nll_loss_backward": NllLossBackward,
    "batched": Batched,
    "grouped_mm": GroupedMm,
    "grouped_mm_backward": GroupedMmBackward,
    "aten_grouped_mm": AtenGroupedMm,
    "replicated": Replicated,
    "data_dependent": DataDependent,
}


def builtin_rules_dir() -> Path:
    """The shipped tables: hpfun/_rules in a wheel, the top-level rules/ in a checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_rules", package.parent / "rules"):
        if candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    raise RuleFileError(f"the built-in rule tables are missing (looked in {package / '_rules'} and {package.parent / 'rules'})")


@attrs.define
class Entry:
    rule: Rule
    source: str  # "file:line" or "register()"


class Registry:
    """Op overload -> rule. Built-ins and `HPFUN_RULES_PATH` load on first use.

    A table that fails to load stays pending: every later use tries it again and raises again,
    until it loads (a fixed file). Marking it loaded before it had loaded would let the calls
    after the first run silently without it.
    """

    def __init__(self):
        self._entries: dict[object, Entry] = {}
        self._pending: list[Path] | None = None  # tables not loaded yet; None: built-ins not queued yet
        self._loaded: set[Path] = set()  # files, resolved: a table named twice loads once
        self._by_name: dict[str, Entry] = {}  # other libraries' ops not defined yet, by name

    def _ensure_builtins(self):
        if self._pending is None:
            folders = filter(None, os.environ.get("HPFUN_RULES_PATH", "").split(":"))
            self._pending = [builtin_rules_dir(), *map(Path, folders)]
        while self._pending:  # in order; each table is all-or-nothing, so a retry never duplicates
            self._load(self._pending[0])
            self._pending.pop(0)

    def lookup(self, op) -> Rule | None:
        entry = self._entry(op)
        return entry.rule if entry else None

    def source(self, op) -> str | None:
        entry = self._entry(op)
        return entry.source if entry else None

    def _entry(self, op) -> Entry | None:
        self._ensure_builtins()
        entry = self._entries.get(op)
        if entry is None and self._by_name and isinstance(op, torch._ops.OpOverload):
            entry = self._by_name.pop(str(op), None)  # another library's op, defined since its table loaded
            if entry is not None:
                self._entries[op] = entry
        return entry

    def ops(self) -> list:
        """The ops with a rule (another library's only once it is imported)."""
        self._ensure_builtins()
        for name in list(self._by_name):
            if (op := resolve_op(name)) is not None:
                self._entry(op)
        return list(self._entries)

    def register(self, op, rule: Rule, *, replace: bool = False, source: str = "register()"):
        op = resolve_op(op) if isinstance(op, str) else op
        if op is None or not isinstance(rule, Rule):
            raise RuleFileError(f"register(op, rule) needs an op overload and a Rule instance, got {op!r}, {rule!r}")
        self._ensure_builtins()
        if op in self._entries and not replace:
            raise RuleFileError(
                f"{op} already has a rule from {self._entries[op].source}",
                headline="duplicate rule",
            )
        self._entries[op] = Entry(rule, source)

    def load(self, path) -> int:
        """Load a YAML table or a folder of them (after the built-ins); all problems raised together.
        A table that exists but fails to load raises again at every use until it is fixed; a
        file already loaded is not loaded twice."""
        self._ensure_builtins()
        path = Path(path)
        if not path.exists():
            raise RuleFileError(f"rule path {path} does not exist")
        before = len(self._entries)
        self._pending.append(path)
        self._ensure_builtins()
        return len(self._entries) - before

    def _load(self, path) -> int:
        path = Path(path)
        if not path.exists():
            raise RuleFileError(f"rule path {path} does not exist")
        files = [f for f in (sorted(path.glob("*.yaml")) if path.is_dir() else [path]) if f.resolve() not in self._loaded]
        problems, parsed = [], []
        for file in files:
            parsed += _parse_file(file, problems)
        seen: dict[object, str] = {}
        for op, rule, where in parsed:
            known = self._by_name if isinstance(op, str) else self._entries
            previous = known[op].source if op in known else seen.get(op)
            if previous:
                problems.append(Problem(where, f"{op} already has a rule at {previous}", "keep one entry per op"))
            seen[op] = where
        if problems:
            raise RuleFileError(problems)
        for op, rule, where in parsed:
            (self._by_name if isinstance(op, str) else self._entries)[op] = Entry(rule, where)
        self._loaded.update(f.resolve() for f in files)
        return len(parsed)


_TORCH_NAMESPACES = frozenset({"aten", "prims", "quantized", "_c10d_functional", "c10d_functional", "c10d",
                               "profiler", "higher_order", "inductor", "rngprims", "mkldnn", "_quantized"})


def resolve_op(name: str):
    """`aten.mm.default` -> torch.ops.aten.mm.default, or None."""
    parts = name.split(".")
    if len(parts) != 3:
        return None
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None


_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _read_entries(file: Path, problems: list):
    """(key, line, value) for each top-level entry, via PyYAML's safe loader (no arbitrary objects;
    libyaml's where PyYAML has it: a tenth of the time, a first call's 50 ms)."""
    loader = _SAFE_LOADER(file.read_text())
    try:
        root = loader.get_single_node()
        if root is None:
            return []
        if not isinstance(root, yaml.MappingNode):
            problems.append(Problem(f"{file}:1", "a rule table must be a mapping of op name to entry"))
            return []
        return [(k.value, k.start_mark.line + 1, loader.construct_object(v, deep=True)) for k, v in root.value]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problems.append(Problem(f"{file}:{mark.line + 1 if mark else 1}", f"invalid YAML: {getattr(err, 'problem', err)}"))
        return []
    finally:
        loader.dispose()


def _parse_file(file: Path, problems: list) -> list:
    entries = _read_entries(file, problems)
    default = next((v for k, _, v in entries if k == "__default__"), None) or {}
    out, seen = [], {}
    for key, line, value in entries:
        where = f"{file}:{line}"
        if key == "__default__":
            continue
        if key in seen:
            problems.append(Problem(where, f"{key} is listed twice in this file (first at line {seen[key]})"))
            continue
        seen[key] = line
        op = resolve_op(key)
        if op is None and len(key.split(".")) == 3 and key.split(".")[0] not in _TORCH_NAMESPACES:
            op = key  # another library's op: defined when that library is imported, looked up by name
        if op is None:
            problems.append(Problem(where, f"unknown op {key!r}", "write an op overload such as aten.mm.default"))
            continue
        rule = _make_rule({**default, **(value or {})}, where, problems)
        if rule is not None:
            out.append((op, rule, where))
    return out


def _make_rule(spec, where: str, problems: list) -> Rule | None:
    if not isinstance(spec, dict):
        problems.append(Problem(where, f"an entry must be a mapping, got {spec!r}"))
        return None
    spec = dict(spec)
    family = spec.pop("family", None)
    cls = _rule_class(family, where, problems)
    if cls is None:
        return None
    known = {f.name for f in attrs.fields(cls)}
    unknown = sorted(set(spec) - known)
    if unknown:
        problems.append(Problem(where, f"unknown key(s) {unknown} for family {family!r}", f"allowed: {sorted(known | {'family'})}"))
        return None
    try:
        return cls(**spec)
    except (TypeError, ValueError) as err:
        problems.append(Problem(where, f"bad parameters for {family!r}: {err}"))
        return None


def _rule_class(family, where: str, problems: list):
    if family in FAMILIES:
        return FAMILIES[family]
    if isinstance(family, str) and ":" in family:
        module, _, name = family.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            problems.append(Problem(where, f"cannot import rule class {family!r}: {err}"))
            return None
        if isinstance(cls, type) and issubclass(cls, Rule) and attrs.has(cls):
            return cls
        problems.append(Problem(where, f"{family!r} is not an attrs subclass of hpfun.rules.Rule"))
        return None
    problems.append(Problem(where, f"unknown family {family!r}", f"use one of {sorted(FAMILIES)} or 'module:Class'"))
    return None


REGISTRY = Registry()
