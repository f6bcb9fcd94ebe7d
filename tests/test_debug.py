"""HPFUN_DEBUG's log records per level, and explain_cache_miss naming what differs."""

import logging
import os
import subprocess
import sys

import pytest
import torch

import hpfun
from hpfun import P
from hpfun.testing.models import MLP_LAYOUTS, mlp_data, mlp_init, mlp_step

MESH = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))


def _step():
    pspec, xspec, yspec = MLP_LAYOUTS["dp_tp"]
    return hpfun.shard(mlp_step, mesh=MESH, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()))


def _compile(monkeypatch, caplog, level):
    if level is None:
        monkeypatch.delenv("HPFUN_DEBUG", raising=False)
    else:
        monkeypatch.setenv("HPFUN_DEBUG", level)
    step = _step()
    with caplog.at_level(logging.DEBUG):
        step.lower(mlp_init(), *mlp_data())
    by_logger: dict[str, list[str]] = {}
    for record in caplog.records:
        if record.name.startswith("hpfun"):
            by_logger.setdefault(record.name, []).append(record.getMessage())
    return by_logger


@pytest.mark.parametrize("level", [None, "0"])
def test_off(monkeypatch, caplog, level):
    """Unset or 0: hpfun logs nothing."""
    assert _compile(monkeypatch, caplog, level) == {}


def test_level_1_layouts(monkeypatch, caplog):
    """1: one record per node of the traced program with its layouts, and nothing else."""
    logs = _compile(monkeypatch, caplog, "1")
    assert set(logs) == {"hpfun.layouts"}
    layouts = logs["hpfun.layouts"]
    assert layouts[0] == "mlp_step: compiled for mesh {dp: 2, tp: 2}, " + layouts[0].split(", ")[-1]
    assert "mlp_step: %mm = aten.mm.default: [S(0), R], [R, S(1)] -> [S(0), S(1)] global [8, 32]" in layouts
    assert "mlp_step: %arg0_1 (args[0]['w1']): [R, S(1)] global [16, 32]" in layouts
    assert sum(" (args[" in m for m in layouts) == 6
    assert int(layouts[0].split(", ")[-1].split()[0]) >= len(layouts) - 1


def test_level_2_collectives(monkeypatch, caplog):
    """2: adds each collective with its bytes and reason, then the cost."""
    logs = _compile(monkeypatch, caplog, "2")
    assert set(logs) == {"hpfun.layouts", "hpfun.collectives"}
    collectives = logs["hpfun.collectives"]
    assert len(collectives) == 7 + 1
    # the log-softmax runs fused (its dim is whole), on the logits' Partial resolved first
    assert collectives[0].startswith("mlp_step: all_reduce over tp: 128 B float32 for _log_softmax "
                                     "(aten._log_softmax.default): aten._log_softmax.default needs [S(0), R]")
    assert collectives[-1] == ("mlp_step: communication per rank: tp 128 B in 1 collective, "
                               "dp 1640 B in 6 collectives (2 issued); about 15.2 us")  # 5 in one bucket


def test_level_3_program(monkeypatch, caplog):
    """3: adds the per-shard program, as str(lower()) shows it."""
    logs = _compile(monkeypatch, caplog, "3")
    assert set(logs) == {"hpfun.layouts", "hpfun.collectives", "hpfun.program"}
    (program,) = logs["hpfun.program"]
    assert program == "mlp_step:\n" + str(_step().lower(mlp_init(), *mlp_data()))


def test_read_at_each_compile_and_not_on_cache_hits(monkeypatch, caplog):
    """The variable is read when a signature compiles; a cache hit logs nothing."""
    step = _step()
    params, (x, y) = mlp_init(), mlp_data()
    monkeypatch.delenv("HPFUN_DEBUG", raising=False)
    with caplog.at_level(logging.DEBUG):
        step.lower(params, x, y)
        monkeypatch.setenv("HPFUN_DEBUG", "1")
        step.lower(params, x, y)  # cached
        assert not [r for r in caplog.records if r.name.startswith("hpfun")]
        step.lower(params, *mlp_data(batch=4))  # a new signature compiles
    assert any(r.name == "hpfun.layouts" for r in caplog.records)


def test_bad_value_warns_and_means_1(monkeypatch, caplog):
    """A value that is not a level warns and logs layouts."""
    logs = _compile(monkeypatch, caplog, "yes")
    assert logs["hpfun"] == ["HPFUN_DEBUG='yes' is not a level 0-3; using 1"] and "hpfun.layouts" in logs


def test_plain_script_shows_records_on_stderr_and_prints_nothing():
    """Without logging configured, the records go to stderr through a handler; stdout stays empty."""
    code = ("import torch, hpfun\nmesh = hpfun.Mesh.simulated((2,), ('tp',))\n"
            "f = hpfun.shard(lambda x: x.sum(0), mesh=mesh, in_specs=hpfun.P('tp'))\nf(torch.ones(4))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HPFUN_DEBUG": "2"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "hpfun.layouts: <lambda>: %sum_1 = aten.sum.dim_IntList: [S(0)] -> [P(sum)] global []" in done.stderr
    assert "hpfun.collectives: <lambda>: communication per rank: none" in done.stderr


# ---------------------------------------------------------------------------------------------
# explain_cache_miss
# ---------------------------------------------------------------------------------------------


def test_nothing_cached_then_hit():
    """Before the first call: nothing cached; after it, the same arguments hit."""
    step, params, (x, y) = _step(), mlp_init(), mlp_data()
    miss = hpfun.explain_cache_miss(step, params, x, y)
    assert (miss.hit, miss.cached, str(miss)) == (False, 0, "nothing cached yet: the first call compiles")
    step.lower(params, x, y)
    hit = hpfun.explain_cache_miss(step, params, x, y)
    assert hit.hit and str(hit) == "cache hit: these arguments reuse a compiled program (1 cached)"
    assert step.trace_count == 1  # explaining compiles nothing


def test_names_the_argument_whose_shape_or_dtype_differs():
    """A new batch size names args[1] and args[2]; a new dtype names the parameter by its path."""
    step, params, (x, y) = _step(), mlp_init(), mlp_data()
    step.lower(params, x, y)
    miss = hpfun.explain_cache_miss(step, params, *mlp_data(batch=4))
    assert [(d.path, d.field, d.cached, d.given) for d in miss.differences] == [
        ("args[1]", "shape", "(8, 16)", "(4, 16)"), ("args[2]", "shape", "(8,)", "(4,)")]
    assert str(miss).splitlines()[1:] == ["  args[1]: shape (4, 16), cached (8, 16)", "  args[2]: shape (4,), cached (8,)"]
    params64 = dict(params, b2=params["b2"].double())
    (difference,) = hpfun.explain_cache_miss(step, params64, x, y).differences
    assert str(difference) == "args[0]['b2']: dtype float64, cached float32"


def test_names_the_argument_whose_layout_differs():
    """A Sharded argument in another layout than the cached one is named with both layouts."""
    step, params, (x, y) = _step(), mlp_init(), mlp_data()
    step.lower(params, x, y)
    w1 = hpfun.Sharded.from_global(params["w1"], P("tp", None).to_layout(MESH, 2))
    (difference,) = hpfun.explain_cache_miss(step, dict(params, w1=w1), x, y).differences
    got = (difference.path, difference.field, difference.cached, difference.given)
    assert got == ("args[0]['w1']", "layout", "[R, S(1)]", "[R, S(0)]")


def test_structure_values_and_closest_entry():
    """Missing keys, baked-in Python values and containers are named; the closest entry is used."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    f = hpfun.shard(lambda d, s: d["a"] * s, mesh=mesh, in_specs=None)
    f({"a": torch.ones(2)}, 3)
    f({"a": torch.ones(4)}, 3)
    assert [str(d) for d in hpfun.explain_cache_miss(f, {"a": torch.ones(4)}, 5).differences] == ["args[1]: value 5, cached 3"]
    assert [str(d) for d in hpfun.explain_cache_miss(f, {"a": torch.ones(2), "b": torch.ones(2)}, 3).differences] == [
        "args[0]['b']: argument given, cached absent"]
    assert [d.field for d in hpfun.explain_cache_miss(f, {"a": torch.ones(2)}, torch.ones(())).differences] == ["kind"]
    g = hpfun.shard(lambda xs: xs[0] + 1, mesh=mesh, in_specs=None)
    g((torch.ones(2),))
    assert [d.field for d in hpfun.explain_cache_miss(g, [torch.ones(2)]).differences] == ["structure"]
    assert hpfun.explain_cache_miss(f, {"a": torch.ones(4)}, 5).cached == 2
    w = torch.ones(2, requires_grad=True)  # lifted: a parameter frozen after the first call compiles again
    h = hpfun.shard(lambda x: x * w, mesh=mesh, in_specs=P("dp"))
    h(torch.ones(2))
    w.requires_grad_(False)
    assert [str(d) for d in hpfun.explain_cache_miss(h, torch.ones(2)).differences] == ["w: requires_grad False, cached True"]
    with pytest.raises(TypeError, match="made by hpfun.shard"):
        hpfun.explain_cache_miss(lambda x: x, torch.ones(2))
