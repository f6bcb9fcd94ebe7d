"""Ground-truth validation of every rule (`hpfun.validate`), and checks that the tool and the
`hpfun.testing` oracle report wrong, missing and crashing rules as such."""

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpfun
from hpfun import validate
from hpfun.rules.pointwise import Pointwise
from hpfun.rules.registry import Registry
from hpfun.testing import ShardedMismatch, assert_sharded_equal, layouts, meshes, on_grid, sharded_values

aten = torch.ops.aten

# Failures the validator finds in today's rules and library, each with its cause. They are
# tolerated here (and listed in the test output) until fixed; remove an entry with its fix.
KNOWN_FAILURES: dict[str, str] = {}  # op -> why it fails today; remove an entry once fixed


@pytest.fixture(scope="module")
def index(validation_index):
    """The OpInfo index (conftest builds it in a process of its own, beside the suite)."""
    return validation_index


def test_every_rule_matches_ground_truth(index):
    """Every registered op: no incorrect or crashing rule on a few drawn examples each."""
    report = validate.validate(index=index, max_examples=3, budget_s=10)
    print(report)
    checked = {r.op for r in report.results}
    assert set(hpfun.rules.REGISTRY.ops()) <= checked
    failed = [r for r in report.of("INCORRECT") + report.of("CRASH") if str(r.op) not in KNOWN_FAILURES]
    assert not failed, "\n".join(validate.line(r) + "\n" + r.detail for r in failed)
    assert report.count("ok") > len(hpfun.rules.REGISTRY.ops()) // 2


def test_wrong_rule_is_reported_incorrect(index):
    """A rule claiming exp is linear (Partial passes through) is INCORRECT, with mesh and layouts."""
    registry = Registry()
    registry.register(aten.exp.default, Pointwise(linear_joint=(0,)), replace=True)
    report = validate.validate(registry, [aten.exp.default, aten.neg.default], index=index, max_examples=20)
    assert [(str(r.op), r.status) for r in report.results] == [("aten.exp.default", "INCORRECT"),
                                                                ("aten.neg.default", "ok")]
    detail = report.results[0].detail
    assert "P(sum)" in detail or "P(avg)" in detail
    assert "mesh {" in detail and "global (" in detail and "reproduce: python -m hpfun.validate" in str(report)
    assert report.failed


@attrs.frozen(kw_only=True)
class _Crashing(Pointwise):
    def strategies(self, call):
        raise KeyError("boom")


def test_crashing_rule_is_reported_as_crash(index):
    """A rule raising something other than an hpfun error is CRASH, naming the exception."""
    registry = Registry()
    registry.register(aten.neg.default, _Crashing(), replace=True)
    [result] = validate.validate(registry, [aten.neg.default], index=index, max_examples=3).results
    assert result.status == "CRASH" and "KeyError" in result.note and "mesh {" in result.detail


class _Subset(Registry):
    """The built-in rules, but only `checked` are listed and `dropped` have none."""

    def __init__(self, checked, dropped):
        super().__init__()
        self.checked, self.dropped = checked, dropped

    def ops(self):
        return list(self.checked)

    def lookup(self, op):
        return None if op in self.dropped else super().lookup(op)


def test_missing_rule_is_reported_missing(index):
    """An op that OpInfo traces reach without a rule is MISSING, with the OpInfos reaching it."""
    registry = _Subset([aten.neg.default], {aten.exp.default})
    report = validate.validate(registry, index=index, max_examples=2)
    by_op = {r.op: r for r in report.results}
    assert by_op[aten.neg.default].status == "ok"
    assert by_op[aten.exp.default].status == "MISSING" and "exp" in by_op[aten.exp.default].note
    assert all(hpfun.rules.lookup(r.op) is None for r in report.of("MISSING") if r.op != aten.exp.default)
    assert not report.failed


def test_decomposed_and_random_ops_are_skipped(index):
    """Ops that capture decomposes, and random ops, are SKIPPED with the reason; an op tagged
    random whose cases draw nothing (fused attention without dropout) is checked."""
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    report = validate.validate(ops=[aten.native_batch_norm.default, aten.bernoulli.p, flash], index=index,
                               max_examples=3)
    found = {r.op: r for r in report.results}
    assert [found[op].status for op in (aten.native_batch_norm.default, aten.bernoulli.p, flash)] == [
        "SKIPPED", "SKIPPED", "ok"]
    assert "capture decomposes it" in found[aten.native_batch_norm.default].note
    assert "random" in found[aten.bernoulli.p].note


def test_command_line(index, monkeypatch, capsys):
    """`python -m hpfun.validate --op NAME` prints one line per op and a summary; exit 0 when clean."""
    monkeypatch.setattr(validate, "opinfo_index", lambda: index)
    assert validate.main(["--op", "neg", "--op", "aten.mm.default", "--max-examples", "2", "--seed", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["ok", "aten.mm.default"] and out[1].split()[:2] == ["ok", "aten.neg.default"]
    assert out[-1].startswith("summary: 2 ok, 0 incorrect, 0 crash")


# ---------------------------------------------------------------------------------------------
# hpfun.testing: the strategies and the oracle
# ---------------------------------------------------------------------------------------------


@settings(max_examples=40)
@given(st.data())
def test_sharded_values_hold_the_value_exactly(data):
    """sharded_values(t, layout).full() equals t bitwise (rounded to the grid if Partial)."""
    mesh = data.draw(meshes())
    t = torch.randn(4, 6, dtype=data.draw(st.sampled_from([torch.float32, torch.float64]))) * 100
    layout = data.draw(layouts(mesh, (4, 6), allow_partial=True))
    assert layout.fits((4, 6))
    x = data.draw(sharded_values(t, layout))
    assert x.layout == layout and torch.equal(x.full(), on_grid(t) if layout.partial_axes else t)


def test_partial_terms_are_not_all_on_one_rank():
    """Partial(sum) terms are spread out, so a nonlinear op on them is caught."""
    mesh = hpfun.Mesh.simulated((4,), ("dp",))

    @given(sharded_values(torch.ones(8, dtype=torch.float64), hpfun.parse("[P(sum)] on {dp: 4}")))
    def check(x):
        assert x.layout.mesh == mesh and sum(bool(s.any()) for s in x.shards) > 1

    check()


@settings(max_examples=5)
@given(sharded_values(torch.randn(4, 4, dtype=torch.float64), hpfun.parse("[P(sum), S(1)] on {dp: 2, tp: 2}")))
def test_oracle_names_mesh_and_layouts_of_a_wrong_result(x):
    """assert_sharded_equal raises ShardedMismatch naming the mesh, input layouts and the output."""
    registry = Registry()
    registry.register(aten.exp.default, Pointwise(linear_joint=(0,)), replace=True)
    mesh = x.layout.mesh
    with pytest.raises(ShardedMismatch) as info:
        assert_sharded_equal(torch.exp, (x,), mesh, None, registry=registry)
    text = str(info.value)
    assert "mesh {dp: 2, tp: 2}" in text and "args[0]: [P(sum), S(1)] global (4, 4) float64" in text
    assert info.value.output.startswith("outputs[0] [P(sum), S(1)]")
    assert_sharded_equal(torch.exp, (x,), mesh, None)


@attrs.frozen(kw_only=True)
class _Nudged(Pointwise):
    """The op, then a change in the last bits."""

    def emit(self, ctx, call, strategy, args, kwargs):
        return ctx.call(aten.mul.Tensor, (super().emit(ctx, call, strategy, args, kwargs), 1.0 + 2.0**-50))


def test_oracle_exact_mode_is_bitwise():
    """exact=True rejects a last-bits difference that the default tolerance accepts."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    x = torch.rand(8, dtype=torch.float64) + 1
    registry = Registry()
    registry.register(aten.neg.default, _Nudged(), replace=True)
    assert_sharded_equal(torch.neg, (x,), mesh, hpfun.P("dp"), registry=registry)
    with pytest.raises(ShardedMismatch, match="largest difference at index"):
        assert_sharded_equal(torch.neg, (x,), mesh, hpfun.P("dp"), exact=True, registry=registry)


def test_the_index_crosses_processes_as_it_is():
    """The index conftest builds in a process of its own comes back with the same ops, sources
    and cases (ops by qualified name: an OpOverload does not pickle)."""
    import pickle

    index = validate.Index()
    x = torch.randn(4, 3, dtype=torch.float64)
    for case in validate.traced_calls(lambda a: torch.nn.functional.softmax(a * 2, dim=-1).sum(0), [x], "softmax"):
        index.add(case, 8)
    again = validate.from_portable(pickle.loads(pickle.dumps(validate.to_portable(index))))
    assert list(again.cases) == list(index.cases) and again.seen_by == index.seen_by
    for op, cases in index.cases.items():
        assert [(c.signature(), c.source) for c in again.cases[op]] == [(c.signature(), c.source) for c in cases]
        assert all(torch.equal(a, b) for c, d in zip(cases, again.cases[op]) for a, b in zip(c.tensors, d.tensors))


def test_oracle_compares_python_outputs_and_names_a_bare_argument():
    """Numbers and None a function returns are compared as values; a bare tensor for `args` is
    a TypeError saying to pass a tuple."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    x = torch.randn(4, 3)
    P = hpfun.P
    assert_sharded_equal(lambda x: (x * 2, 3, None), (x,), mesh, (P("dp"),))
    with pytest.raises(ShardedMismatch, match="got 4, expected 3"):
        calls = iter([3, 4])
        assert_sharded_equal(lambda x: (x, next(calls)), (x,), mesh, (P("dp"),))
    with pytest.raises(TypeError, match=r"pass \(x,\)"):
        assert_sharded_equal(lambda x: x, x, mesh, (P("dp"),))
