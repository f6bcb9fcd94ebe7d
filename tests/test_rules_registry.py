"""The YAML rule registry: merging, strict keys, file:line errors, extra folders, register()."""

import sys
import textwrap

import pytest
import torch

import hpfun
from hpfun import P
from hpfun.rules.registry import REGISTRY, Registry, builtin_rules_dir
from hpfun.rules.pointwise import Pointwise

aten = torch.ops.aten


def _write(folder, name, text):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def _load_error(path) -> str:
    with pytest.raises(hpfun.RuleFileError) as info:
        Registry().load(path)
    return str(info.value)


def test_builtin_tables_load_and_default_is_merged():
    """Every built-in entry loads; __default__ gives an entry its family."""
    registry = Registry()
    assert len(registry.ops()) > 80
    assert isinstance(registry.lookup(aten.relu.default), Pointwise)
    assert registry.lookup(aten.add.Tensor).linear_joint == (0, 1)
    assert registry.source(aten.mm.default).startswith(str(builtin_rules_dir()))


def test_errors_name_file_and_line(tmp_path):
    """Unknown keys, families, classes and ops are all reported, each with file:line."""
    path = _write(tmp_path, "bad.yaml", """\
        __default__:
          family: pointwise
        aten.relu.default: {linear_sum: [0]}
        aten.exp.default: {family: nosuch}
        aten.log.default: {family: "nosuch_module_xyz:Rule"}
        aten.not_an_op.default: {}
        """)
    text = _load_error(path)
    assert f"{path}:3" in text and "unknown key(s) ['linear_sum']" in text
    assert f"{path}:4" in text and "unknown family 'nosuch'" in text
    assert f"{path}:5" in text and "cannot import rule class" in text
    assert f"{path}:6" in text and "unknown op 'aten.not_an_op.default'" in text


def test_duplicates_within_and_across_files(tmp_path):
    """An op listed twice, in one file or across files, is an error naming both places."""
    _write(tmp_path, "a.yaml", "aten.relu.default: {family: pointwise}\naten.relu.default: {family: pointwise}\n")
    text = _load_error(tmp_path / "a.yaml")
    assert "listed twice" in text and "a.yaml:2" in text
    (tmp_path / "a.yaml").unlink()
    _write(tmp_path, "a.yaml", "aten.special_airy_ai.default: {family: pointwise}\n")
    _write(tmp_path, "b.yaml", "aten.special_airy_ai.default: {family: pointwise}\n")
    text = _load_error(tmp_path)
    assert "a.yaml:1" in text and "b.yaml:1" in text


def test_extra_tables_never_replace_builtins(tmp_path):
    """A user table naming an op the built-ins cover is rejected, pointing at the built-in entry."""
    _write(tmp_path, "mine.yaml", "aten.mm.default: {family: replicated}\n")
    text = _load_error(tmp_path)
    assert "aten.mm.default already has a rule at" in text and "contraction.yaml" in text


def test_invalid_yaml_and_non_mapping(tmp_path):
    """Broken YAML reports its line; a table must be a mapping."""
    assert "invalid YAML" in _load_error(_write(tmp_path, "broken.yaml", "a: [1, 2\nb: 3\n"))
    assert "must be a mapping" in _load_error(_write(tmp_path, "list.yaml", "- 1\n- 2\n"))


def test_safe_load_only(tmp_path):
    """Python object tags are refused (safe loader)."""
    text = _load_error(_write(tmp_path, "evil.yaml", "aten.relu.default: !!python/object/apply:os.system ['true']\n"))
    assert "invalid YAML" in text


def test_rule_class_by_import_path(tmp_path, monkeypatch):
    """`family: module:Class` loads a user rule class (an attrs subclass of Rule)."""
    _write(tmp_path, "my_rules_mod.py", """\
        import attrs
        from hpfun.rules import Replicated

        @attrs.frozen(kw_only=True)
        class Mine(Replicated):
            note: str = ""
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    _write(tmp_path, "t.yaml", "aten.special_airy_ai.default: {family: 'my_rules_mod:Mine', note: hi}\n")
    registry = Registry()
    registry.load(tmp_path / "t.yaml")
    assert type(registry.lookup(aten.special_airy_ai.default)).__name__ == "Mine"
    sys.modules.pop("my_rules_mod", None)


def test_rules_path_environment_variable(tmp_path, monkeypatch):
    """Folders in HPFUN_RULES_PATH are loaded after the built-ins."""
    _write(tmp_path, "extra.yaml", "aten.special_airy_ai.default: {family: pointwise}\n")
    monkeypatch.setenv("HPFUN_RULES_PATH", f"/nonexistent-is-an-error-only-if-listed:{tmp_path}".split(":", 1)[1])
    registry = Registry()
    assert isinstance(registry.lookup(aten.special_airy_ai.default), Pointwise)
    assert registry.lookup(aten.mm.default) is not None


def test_register_makes_an_op_shardable():
    """hpfun.rules.register adds a rule in code; the op then shards like any other."""
    op = aten.special_airy_ai.default
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    f = hpfun.shard(torch.special.airy_ai, mesh=mesh, in_specs=P("dp"))
    x = torch.randn(8)
    with pytest.raises(hpfun.MissingRuleError):
        f(x)
    try:
        hpfun.rules.register("aten.special_airy_ai.default", Pointwise())
        with pytest.raises(hpfun.RuleFileError, match="already has a rule"):
            hpfun.rules.register(op, Pointwise())
        f = hpfun.shard(torch.special.airy_ai, mesh=mesh, in_specs=P("dp"))
        out = f(x)
        assert out.layout.placements == (hpfun.Shard(0),)
        torch.testing.assert_close(out.full(), torch.special.airy_ai(x))
    finally:
        REGISTRY._entries.pop(op, None)


def test_register_rejects_non_rules():
    """register() checks its arguments."""
    with pytest.raises(hpfun.RuleFileError):
        hpfun.rules.register("aten.nope.default", Pointwise())
    with pytest.raises(hpfun.RuleFileError):
        hpfun.rules.register(aten.special_airy_ai.default, lambda call: [])


def test_an_op_of_another_library_is_found_once_it_is_defined(tmp_path):
    """A table may name an op a library defines only when imported (transformers' grouped
    matmuls): it loads before the op exists, and the op's rule is found once the op is, in a
    lookup and among `ops()`; a second entry for it is still a duplicate. An unknown ATen op is
    still an error."""
    path = _write(tmp_path, "lib.yaml", "hpfun_test_lib.scale.default: {family: pointwise, linear_each: [0]}\n")
    registry = Registry()
    registry.load(path)
    assert not hasattr(torch.ops.hpfun_test_lib, "scale")

    @torch.library.custom_op("hpfun_test_lib::scale", mutates_args=())
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    scale.register_fake(lambda x: torch.empty_like(x))
    op = torch.ops.hpfun_test_lib.scale.default
    assert registry.lookup(op) == Pointwise(linear_each=(0,)) and registry.source(op) == f"{path}:1"
    assert op in registry.ops()
    mesh = hpfun.Mesh.simulated((2,), ("x",))
    x = torch.randn(4, 3)
    f = hpfun.shard(lambda x: torch.ops.hpfun_test_lib.scale(x), mesh=mesh, in_specs=(P("x"),), out_specs=P("x"),
                    registry=registry)
    assert torch.equal(f(x).full(), x * 2) and not f.lower(x).collectives
    _write(tmp_path, "again.yaml", "hpfun_test_lib.scale.default: {family: pointwise}\n")
    with pytest.raises(hpfun.RuleFileError, match="already has a rule"):
        registry.load(tmp_path / "again.yaml")
