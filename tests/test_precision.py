"""Low-precision partial sums: bfloat16/float16 sums across ranks are reduced in float32 by
default (`reduce_dtype="float32"`), in the compute dtype with `reduce_dtype="compute"`; the
report, the bytes, the planner's price, the results on both runtimes and the cache key show it.

Run as a script (`python tests/test_precision.py worker OUT_DIR`, with RANK, WORLD_SIZE and
MASTER_* set) this file is one rank of the gloo job of `test_distributed_runtime_reduces_alike`.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

import hpfun
from hpfun import P
from hpfun.api import Options
from hpfun.errors import SpecError
from hpfun.layout import parse
from hpfun.plan import redistribute_cost
from hpfun.testing import ranks

aten = torch.ops.aten
POLICIES = ("float32", "compute")


def _matmul(mesh, out=P(), **options):
    """x @ w with the contracted dim split over tp: each rank holds a Partial(sum) of the result."""
    return hpfun.shard(lambda x, w: x @ w, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=out, **options)


def _operands(dtype=torch.bfloat16, m=16, k=256, n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)


def _partials(x, w, ranks: int, wide: bool = False) -> list[torch.Tensor]:
    """Each rank's local product, as the per-shard program computes it: rounded to x's dtype,
    or (`wide`, the default policy) kept in float32 until the sum."""
    pairs = zip(x.chunk(ranks, 1), w.chunk(ranks, 0), strict=True)
    if wide:
        return [a.contiguous().float() @ b.contiguous().float() for a, b in pairs]
    return [a.contiguous() @ b.contiguous() for a, b in pairs]


def _casts(lowered) -> list[dict]:
    return [n for n in lowered.nodes if n["op"] in ("aten._to_copy.default", "aten.to.dtype")]


# ---------------------------------------------------------------------------------------------
# The report and the bytes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out, kind", [(P(), "all_reduce"), (P("tp"), "reduce_scatter"), (P(None, "tp"), "reduce_scatter")])
def test_report_shows_the_reduction_dtype(out, kind):
    """A bfloat16 partial product is computed from its operands cast up (exactly), reduced in
    float32 and cast back by default (twice the bytes); with reduce_dtype="compute" it is
    computed and reduced as bfloat16, with no cast."""
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    x, w = _operands()
    local_elements = 16 * 32
    for policy, dtype, itemsize, casts in [("float32", "float32", 4, 3), ("compute", "bfloat16", 2, 0)]:
        lowered = _matmul(mesh, out, reduce_dtype=policy).lower(x, w)
        (c,) = lowered.collectives
        assert (c.kind, c.dtype, c.bytes) == (kind, dtype, local_elements * itemsize)
        assert lowered.to_dict()["collectives"][0]["dtype"] == dtype
        assert f"{kind} over tp: {c.bytes} B {dtype} for outputs[0]" in str(lowered)
        assert len(_casts(lowered)) == casts
        assert hpfun.Lowered.from_json(lowered.to_json()) == lowered


def test_float32_programs_are_unchanged():
    """A float32 program gets no cast, and the same per-shard code under either option."""
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    x, w = _operands(torch.float32)
    default, compute = (_matmul(mesh, reduce_dtype=p).lower(x, w) for p in POLICIES)
    assert not _casts(default) and default.program.module.code == compute.program.module.code
    assert [c.dtype for c in default.collectives] == ["float32"]


def test_max_is_reduced_as_it_is():
    """A Partial(max) of bfloat16 is exact in any dtype: no cast, reduced as bfloat16."""
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    f = hpfun.shard(lambda x: x.amax(0), mesh=mesh, in_specs=P("tp"), out_specs=P())
    lowered = f.lower(torch.randn(8, 4).bfloat16())
    assert not _casts(lowered) and {c.dtype for c in lowered.collectives} == {"bfloat16"}


def test_planner_prices_what_is_emitted():
    """Resolving a bfloat16 sum costs twice the bytes under "float32"; float32 values cost the same."""
    src, dst = parse("[S(0), P(sum)] on {dp: 2, tp: 2}"), parse("[S(0), R] on {dp: 2, tp: 2}")
    wide, _ = redistribute_cost(src, dst, (8, 8), torch.bfloat16)
    assert wide == 2 * redistribute_cost(src, dst, (8, 8), torch.bfloat16, "compute")[0]
    assert wide == redistribute_cost(src, dst, (8, 8), torch.float32, "compute")[0]
    gather = parse("[S(0), S(1)] on {dp: 2, tp: 2}"), parse("[S(0), R] on {dp: 2, tp: 2}")
    assert redistribute_cost(*gather, (8, 8), torch.bfloat16) == redistribute_cost(*gather, (8, 8), torch.bfloat16, "compute")


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sum_is_rounded_once(dtype):
    """On 4 ranks, the default result is the float32 sum of the ranks' float32 partial products
    rounded once to the compute dtype, bitwise (as the unsharded product rounds its sum once);
    "compute" rounds each partial and then after every add. The default lies closer to the
    float32 product (x.float() @ w.float()), and equals its rounding more often."""
    mesh = hpfun.Mesh.simulated((4,), ("tp",))
    x, w = _operands(dtype)
    partials = _partials(x, w, 4)
    once = sum(_partials(x, w, 4, wide=True)).to(dtype)
    every_add = partials[0] + partials[1] + partials[2] + partials[3]
    default, compute = (_matmul(mesh, reduce_dtype=p)(x, w).full() for p in POLICIES)
    assert torch.equal(default, once) and torch.equal(compute, every_add)
    exact = x.float() @ w.float()
    assert (default.float() - exact).abs().mean() < (compute.float() - exact).abs().mean()
    assert (default == exact.to(dtype)).sum() > (compute == exact.to(dtype)).sum()


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_a_sum_asked_for_in_low_precision_is_rounded_once(op):
    """`x.sum(1, dtype=torch.bfloat16)` of a float32 (or integer) x split along the summed dim:
    each rank's sum is kept in float32 and the total rounded once, as eager's (each rank's was
    rounded to bfloat16 first: 129 + 128 gave 256 on one rank, -256 on the other, 0 in all where
    eager gives 1)."""
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    # (and as eager, a sum's elements are cast to the dtype before they are added, a mean's are not:
    # [257, 257, 1, 1] sums to 512 in bfloat16, its mean is 129)
    inputs = [torch.tensor([[129.0, 128.0, -128.0, -128.0]]), torch.tensor([[1001.0, 3.0, -1000.0, -3.0]]),
              torch.tensor([[257.0, 257.0, 1.0, 1.0]])]
    for x in inputs:
        for inp in (x, x.long()) if op == "sum" else (x,):
            for low in (torch.bfloat16, torch.float16):
                f = (lambda t: t.sum(1, dtype=low)) if op == "sum" else (lambda t: t.mean(1, dtype=low))
                got = hpfun.shard(f, mesh=mesh, in_specs=P(None, "tp"), out_specs=P())(inp).full()
                assert torch.equal(got, f(inp)) and got.dtype == low, (got, f(inp))
    if op == "sum":  # (a Partial element, a product over a split dim: its terms 257 and -256 are not cast,
        x, w = torch.tensor([[257.0, -256.0]]), torch.ones(2, 3)  # its whole value 1 is)
        f = lambda x, w: (x @ w).sum(1, dtype=torch.bfloat16)  # noqa: E731
        got = hpfun.shard(f, mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P())(x, w).full()
        assert torch.equal(got, f(x, w)), (got, f(x, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out", [P(), P("a"), P(("a", "b"))], ids=str)
def test_a_sum_over_two_axes_resolved_in_two_steps_is_rounded_once(dtype, out):
    """A sum partial over both axes of a 2 x 2 mesh, wanted split over one of them, is resolved
    by an all-reduce and then a reduce-scatter (or two reduce-scatters): it stays float32 between
    them, so the result is the float32 sum rounded once, whatever the out_specs. Blocks of
    products beyond float16's range that cancel (+-80,000) come back finite, as eager's."""
    mesh = hpfun.Mesh.simulated((2, 2), ("a", "b"))
    x = torch.zeros(8, 64)
    x[:, 0:16] = 5000.0 + torch.arange(8)[:, None]
    x[:, 32:48] = -5000.0
    x = (x + torch.randn(8, 64, generator=torch.Generator().manual_seed(0))).to(dtype)
    w = torch.ones(64, 4, dtype=dtype)
    f = hpfun.shard(lambda a, b: a @ b, mesh=mesh, in_specs=(P(None, ("a", "b")), P(("a", "b"), None)), out_specs=out)
    got = f(x, w).full()
    p = [x[:, 16 * i:16 * (i + 1)].float() @ w[16 * i:16 * (i + 1)].float() for i in range(4)]
    once = [(((p[0] + p[1]) + p[2]) + p[3]).to(dtype), ((p[0] + p[1]) + (p[2] + p[3])).to(dtype)]  # either order
    assert torch.isfinite(got).all()
    assert ((got == once[0]) | (got == once[1])).all(), (got, once)
    assert all(c.dtype == "float32" for c in f.lower(x, w).collectives)


def test_reduce_scatter_along_a_later_dim():
    """P(sum) -> S(1) in float32: each rank gets its columns of the once-rounded sum."""
    mesh = hpfun.Mesh.simulated((4,), ("tp",))
    x, w = _operands()
    got = _matmul(mesh, P(None, "tp"))(x, w)
    once = sum(_partials(x, w, 4, wide=True)).bfloat16()
    assert all(torch.equal(s, c) for s, c in zip(got.shards, once.chunk(4, 1), strict=True))


# ---------------------------------------------------------------------------------------------
# The option
# ---------------------------------------------------------------------------------------------


def test_option_is_in_the_cache_key():
    """The same call keys a different program under each reduce_dtype."""
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    x, w = _operands()
    keys = []
    for policy in POLICIES:
        f = _matmul(mesh, reduce_dtype=policy)
        assert f.options == Options(reduce_dtype=policy)
        keys.append(f._signature(f._prepare((x, w), {}))[1])
    assert keys[0][:-1] == keys[1][:-1] and keys[0] != keys[1]
    assert Options() == Options(reduce_dtype="float32")


@pytest.mark.parametrize("bad", ["bfloat16", "fp32", torch.float32, None])
def test_bad_option_is_a_clear_error(bad):
    with pytest.raises(SpecError, match="reduce_dtype must be 'float32' .* or 'compute'"):
        hpfun.shard(lambda x: x, mesh=hpfun.Mesh.simulated((2,), ("tp",)), in_specs=P(), reduce_dtype=bad)


# ---------------------------------------------------------------------------------------------
# The distributed runtime (gloo, 2 ranks)
# ---------------------------------------------------------------------------------------------

OUTS = {"all_reduce": P(), "reduce_scatter": P(None, "tp")}


def _worker(out: Path):
    """One rank: the bfloat16 matmul under both options, all-reduced and reduce-scattered."""
    mesh = hpfun.Mesh.distributed((2,), ("tp",), timeout=60)
    x, w = _operands()
    got = {(policy, kind): _matmul(mesh, spec, reduce_dtype=policy)(x, w).local
           for policy in POLICIES for kind, spec in OUTS.items()}
    torch.save(got, out / f"rank{os.environ['RANK']}.pt")


def test_distributed_runtime_reduces_alike(tmp_path):
    """On gloo, the same programs give the simulated runtime's shards, bitwise (two terms sum
    the same in any order), for both options."""
    codes = ranks.launch([sys.executable, __file__, "worker", str(tmp_path)], 2, tmp_path)
    assert codes == [0, 0], ranks.logs(tmp_path)
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    x, w = _operands()
    for policy in POLICIES:
        for kind, spec in OUTS.items():
            simulated = _matmul(mesh, spec, reduce_dtype=policy)(x, w)
            for rank in range(2):
                got = torch.load(tmp_path / f"rank{rank}.pt")[(policy, kind)]
                assert got.dtype == torch.bfloat16 and torch.equal(got, simulated.shards[rank]), (policy, kind, rank)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    torch.set_num_threads(1)
    _worker(Path(sys.argv[2]))
    torch.distributed.destroy_process_group()
