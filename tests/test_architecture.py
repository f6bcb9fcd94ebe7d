"""The package's structure: imports flow one way, and dependencies are passed in, not patched."""

import ast
from pathlib import Path

import pytest
import torch

import hpfun
from hpfun import P
from hpfun.api import Options
from hpfun.rules import REGISTRY
from hpfun.rules.registry import Registry

PACKAGE = Path(hpfun.__file__).parent
aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# Import cycles
# ---------------------------------------------------------------------------------------------


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _owner(name: str, modules: dict) -> str | None:
    """The module that `name` (a module, or a name inside one) is loaded from."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node, module: str, path: Path, modules: dict) -> list[str]:
    """What one import statement names: `from pkg import sub` names the submodule `pkg.sub`
    when there is one, else `pkg` itself."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parent + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line}, for every import statement anywhere in the file:
    at module level, inside functions, under conditions. (The implicit import of a module's
    parent package is not an edge: every package would then be in a cycle with its modules.)"""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, module, path, modules):
                target = _owner(name, modules)
                if target is not None and target != module:
                    graph[module].setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def shortest_cycle(graph: dict[str, dict[str, int]], start: str) -> list[str] | None:
    """The shortest import chain from `start` back to itself (breadth first), or None."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in graph[path[-1]]:
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    return None


def _describe(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One line per distinct shortest cycle through a module of the component, with the
    file:line of each import."""
    lines = []
    for chain in sorted({tuple(c) for m in component if (c := shortest_cycle(graph, m))}, key=len):
        if any(set(chain) == set(shown) for shown, _ in lines):
            continue
        where = ", ".join(f"{_modules()[a].relative_to(PACKAGE.parent)}:{graph[a][b]}" for a, b in zip(chain, chain[1:]))
        lines.append((chain, f"  {' -> '.join(chain)}  ({where})"))
    return [line for _, line in lines]


def test_the_package_has_no_import_cycles():
    """No two hpfun modules import each other, directly or through others, at any level."""
    graph = import_graph()
    report = sorted((line for component in cycles(graph) for line in _describe(graph, component)), key=len)
    report = report[:15] + ([f"  ... and {len(report) - 15} longer ones"] if len(report) > 15 else [])
    assert not report, ("import cycles (move the shared piece to the module that owns its data, or to a "
                        "small module below both; an import inside a function still counts):\n" + "\n".join(report))


def test_the_cycle_finder_sees_function_level_imports():
    """A cycle closed by an import inside a function is still found."""
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 9}, "d": {"a": 1}}
    assert cycles(graph) == [["a", "b", "c"]]
    source = "import os\n\ndef f():\n    from hpfun.api import shard\n"
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom))
    modules = _modules()
    assert [_owner(n, modules) for n in _imported(node, "hpfun.mesh", PACKAGE / "mesh.py", modules)] == ["hpfun.api"]
    assert "hpfun.runtime.groups" in import_graph()["hpfun.mesh"]


# ---------------------------------------------------------------------------------------------
# shard(registry=...)
# ---------------------------------------------------------------------------------------------


class RecordingRegistry:
    """The built-in rules, remembering which ops were looked up."""

    def __init__(self, without=()):
        self.asked, self.without = [], set(without)

    def lookup(self, op):
        self.asked.append(op)
        return None if op in self.without else REGISTRY.lookup(op)


MESH = hpfun.Mesh.simulated((2,), ("tp",))


def _mlp(x, w):
    return torch.log_softmax(torch.relu(x @ w), -1)


def test_shard_propagates_with_the_given_registry():
    """Every op of the program, the fused log-softmax put back after propagation included, is
    looked up in the registry passed to shard()."""
    registry = RecordingRegistry()
    x, w = torch.randn(4, 8), torch.randn(8, 6)
    f = hpfun.shard(_mlp, mesh=MESH, in_specs=(P("tp"), P()), out_specs=P("tp"), registry=registry)
    torch.testing.assert_close(f(x, w).full(), _mlp(x, w))
    assert {aten.mm.default, aten.relu.default, aten._log_softmax.default} <= set(registry.asked)


def test_an_op_the_registry_lacks_is_missing():
    """A registry without mm makes mm a missing rule for that function only."""
    x, w = torch.randn(4, 8), torch.randn(8, 6)
    without_mm = hpfun.shard(_mlp, mesh=MESH, in_specs=(P("tp"), P()), registry=RecordingRegistry([aten.mm.default]))
    with pytest.raises(hpfun.MissingRuleError, match="aten.mm.default"):
        without_mm(x, w)
    builtin = hpfun.shard(_mlp, mesh=MESH, in_specs=(P("tp"), P()))
    torch.testing.assert_close(builtin(x, w).full(), _mlp(x, w))


def test_the_registry_keys_the_cache_by_identity():
    """Options with two registries holding the same rules differ; with the same one they match."""
    a, b = Registry(), Registry()
    assert Options(registry=a) != Options(registry=b)
    assert Options(registry=a) == Options(registry=a) and hash(Options(registry=a)) == hash(Options(registry=a))
    assert Options().registry is REGISTRY


def test_a_registry_without_lookup_is_a_spec_error():
    """shard() checks the registry at the boundary, before tracing."""
    with pytest.raises(hpfun.SpecError, match="registry must be a rule registry"):
        hpfun.shard(_mlp, mesh=MESH, in_specs=(P("tp"), P()), registry={"aten.mm.default": None})
