"""Overlapped collectives (hpfun.schedule): each is issued once its input exists and waited on
right before its first use; results stay bitwise those of the synchronous program, on the
simulated mesh and on two gloo processes.

Run as a script, this file is one rank of the gloo job (`python tests/test_overlap.py OUT_DIR`
with RANK, WORLD_SIZE, MASTER_* set)."""

import os
import sys
from pathlib import Path

import pytest
import torch

import hpfun
from hpfun import P
from hpfun.testing import ranks
from hpfun.testing.models import MLP_LAYOUTS, adamw_init, gpt_data, gpt_init, gpt_specs, gpt_step, mlp_data, mlp_init, mlp_step

VARIANTS = {"sync": {"bucket_bytes": 0, "overlap": False}, "overlapped": {"bucket_bytes": 2048, "overlap": True}}
SIZES = {"layers": 1}  # one block: quick to compile, still a dozen gradients to bucket


def _dp_gpt(mesh, **options):
    params = gpt_init(**SIZES)
    specs = gpt_specs(params)
    state = {"m": specs, "v": specs, "step": P()}
    step = hpfun.shard(gpt_step, mesh=mesh, in_specs=(specs, state, P("dp"), P("dp"), None), out_specs=(specs, state, P()),
                       **options)
    return step, (params, adamw_init(params), *gpt_data(4, **SIZES), None)


def _run(step, args, local: bool):
    new, _, loss = step(*args)
    pick = (lambda v: v.local) if local else (lambda v: v.full())
    return {k: pick(v) for k, v in new.items()} | {"loss": pick(loss)}


@pytest.fixture(scope="module")
def simulated():
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    out = {}
    for name, options in VARIANTS.items():
        step, args = _dp_gpt(mesh, **options)
        out[name] = (step.lower(*args), _run(step, args, local=False))
    return out


def test_gradient_buckets_are_issued_during_backward(simulated):
    """Overlapped, a gradient bucket is issued right after the last gradient it holds and waited
    before the optimizer first reads it: backward ops run in between. Synchronous, none do."""
    issued = simulated["overlapped"][0].to_dict()["buckets"]
    grads = [b for b in issued if len(b["members"]) > 1]
    assert len(grads) >= 3 and sum(b["overlapped"] > 0 for b in grads) >= len(grads) - 1
    assert max(b["overlapped"] for b in grads) > 50
    assert all(b["overlapped"] == 0 for b in simulated["sync"][0].to_dict()["buckets"])
    lowered = simulated["overlapped"][0]
    names = {n["name"]: n for n in lowered.nodes}
    for b in grads:  # issued after a node its buffer reads, waited before one that reads its result
        assert f"%{b['issued_after']}" in " ".join(_inputs_upstream(lowered, b["node"]))
    text = str(lowered)
    assert f"issued after %{grads[0]['issued_after']}, waited before %{grads[0]['waited_before']}" in text
    assert names[grads[0]["waited_before"]]["kind"] == "op"


def _inputs_upstream(lowered, name: str, depth: int = 4) -> list[str]:
    """The arguments of a node and of the glue before it, a few levels up."""
    graph = {n["name"]: n for n in lowered.nodes}
    seen, frontier = [], [name]
    for _ in range(depth):
        frontier = [a[1:] for f in frontier for a in graph[f]["args"] for a in a.strip("[]").split(", ") if a.startswith("%")]
        seen += [f"%{f}" for f in frontier]
    return seen


def test_overlap_is_bitwise_on_the_simulated_mesh(simulated):
    """The DP GPT step and the tensor parallel MLP (activation all-reduces moved) give bitwise the
    same values overlapped as synchronous, and the GPT within 1e-5 of the unsharded step."""
    got, sync = simulated["overlapped"][1], simulated["sync"][1]
    assert all(torch.equal(got[k], sync[k]) for k in sync)
    params = gpt_init(**SIZES)
    ref, _, loss = gpt_step(params, adamw_init(params), *gpt_data(4, **SIZES))
    # AdamW's first step divides each gradient by its own magnitude: rounding in a tiny one shows
    assert all(((got[k] - v).norm() / v.norm()).item() <= 1e-4 for k, v in ref.items())
    assert (got["loss"] - loss).abs().item() <= 1e-5
    mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    pspec, xspec, yspec = MLP_LAYOUTS["dp_tp"]
    results = []
    for options in VARIANTS.values():
        step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()), **options)
        new, loss = step(mlp_init(), *mlp_data())
        results.append({k: v.full() for k, v in new.items()} | {"loss": loss.full()})
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_overlap_is_bitwise_under_gloo(simulated, tmp_path):
    """Two gloo processes run the DP GPT step with gradient buckets issued during backward (the
    all-reduces run on gloo's threads until wait_tensor) and synchronously: each rank's shards
    are bitwise equal between the two, and equal the simulated run (to rounding: one thread per
    rank there, several here)."""
    codes = ranks.launch([sys.executable, __file__, str(tmp_path)], 2, tmp_path)
    assert codes == [0, 0], ranks.logs(tmp_path)
    for rank in range(2):
        got = torch.load(tmp_path / f"overlap-rank{rank}.pt")
        assert all(torch.equal(got["overlapped"][k], got["sync"][k]) for k in got["sync"])
        want = simulated["sync"][1]
        assert all(((got["overlapped"][k] - v).norm() / v.norm()).item() <= 1e-6 for k, v in want.items())


def _worker(out: Path) -> None:
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=60)
    results = {}
    for name, options in VARIANTS.items():
        step, args = _dp_gpt(mesh, **options)
        results[name] = _run(step, args, local=True)  # data parallel: every output is replicated
    torch.save(results, out / f"overlap-rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
    torch.distributed.destroy_process_group()  # gloo's threads joined before exit, not killed by it
