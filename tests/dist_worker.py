"""One rank of a multi-process test job (launched by tests/test_distributed.py).

    python tests/dist_worker.py SCENARIO OUT_DIR      # with RANK, WORLD_SIZE, MASTER_* set
"""

import os
import sys
import time
from pathlib import Path

import torch

import hpfun
from hpfun import P
from hpfun.testing.models import MLP_LAYOUTS, mlp_data, mlp_init, mlp_step

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
TIMEOUT = float(os.environ.get("HPFUN_TEST_TIMEOUT", "20"))


def mlp_layouts_for_world():
    if WORLD == 4:
        return [("dp_tp", (2, 2), ("dp", "tp")), ("dp_class", (2, 2), ("dp", "tp")), ("tp", (4,), ("tp",))]
    return [("dp", (2,), ("dp",)), ("tp", (2,), ("tp",)), ("class", (2,), ("tp",))]


def run_mlp(out: Path, compile: bool = False):
    """Two steps of every MLP layout; rank r saves its shards and the gathered results."""
    params, (x, y) = mlp_init(), mlp_data()
    for name, shape, axes in mlp_layouts_for_world():
        mesh = hpfun.Mesh.distributed(shape, axes, timeout=TIMEOUT)
        pspec, xspec, yspec = MLP_LAYOUTS[name]
        step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()), compile=compile)
        new, loss = step(params, x, y)
        new, loss = step(new, x, y)  # Sharded inputs: this rank's shards only
        shards = {k: v.local for k, v in new.items()} | {"loss": loss.local}
        full = {k: v.full() for k, v in new.items()} | {"loss": loss.full()}
        torch.save({"shards": shards, "full": full, "traces": step.trace_count}, out / f"{name}-rank{RANK}.pt")


def compile_small(out: Path):
    """compile=True on the tensor-parallel MLP step equals the uncompiled program."""
    params, (x, y) = mlp_init(), mlp_data()
    mesh = hpfun.Mesh.distributed((2,), ("tp",), timeout=120)
    pspec, xspec, yspec = MLP_LAYOUTS["tp"]
    results = {}
    for compile in (False, True):
        step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()), compile=compile)
        new, loss = step(params, x, y)
        results[compile] = {k: v.local for k, v in new.items()} | {"loss": loss.local}
    torch.save(results, out / f"compile-rank{RANK}.pt")


def adopt_and_local(out: Path):
    """A user-built DeviceMesh adopted, inputs given as this rank's shards: same as global inputs."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.distributed.init_process_group("gloo")
    mesh = hpfun.Mesh.from_device_mesh(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    params, (x, y) = mlp_init(), mlp_data()
    pspec, xspec, yspec = MLP_LAYOUTS["tp"]
    step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()))
    local = {}
    for k, v in params.items():
        layout = pspec[k].to_layout(mesh, v.ndim)
        block = hpfun.Sharded.from_global(v, layout).local  # what a rank would load from its checkpoint
        local[k] = hpfun.Sharded.from_local(block.clone(), layout, v.shape)
    new_local, loss_local = step(local, x, y)
    new_global, loss_global = step(params, x, y)
    same = all(torch.equal(new_local[k].local, new_global[k].local) for k in params)
    torch.save({"same": same, "loss": loss_local.full(), "traces": step.trace_count}, out / f"adopt-rank{RANK}.pt")


def mismatch(out: Path):
    """Rank 1 passes a different batch size: every rank must fail, naming the difference."""
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT)
    x = torch.randn(8 if RANK == 0 else 4, 16)
    step = hpfun.shard(lambda x: (x * 2).sum(0), mesh=mesh, in_specs=P("dp"), out_specs=P())
    _record_error(out, lambda: step(x))


def rank_raises(out: Path):
    """Rank 1 raises in user code before the step; rank 0 must fail, not hang."""
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT)
    step = hpfun.shard(lambda x: (x * 2).sum(0), mesh=mesh, in_specs=P("dp"), out_specs=P())
    if RANK == 1:
        raise RuntimeError("user code failed on rank 1")
    _record_error(out, lambda: step(torch.randn(8, 4)))


def rank_dies(out: Path):
    """Rank 1 dies between two steps; rank 0's second step must fail, not hang."""
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT)
    step = hpfun.shard(lambda x: (x * 2).sum(0), mesh=mesh, in_specs=P("dp"), out_specs=P())
    step(torch.randn(8, 4))
    if RANK == 1:
        os._exit(3)
    _record_error(out, lambda: step(torch.randn(8, 4)))


def rank_stalls(out: Path):
    """Rank 1 stays alive but never joins the step; rank 0 must fail once the timeout passes."""
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT)
    step = hpfun.shard(lambda x: (x * 2).sum(0), mesh=mesh, in_specs=P("dp"), out_specs=P())
    step(torch.randn(8, 4))
    if RANK == 1:
        time.sleep(4 * TIMEOUT)
        os._exit(0)
    _record_error(out, lambda: step(torch.randn(8, 4)) and step(torch.randn(4, 4)))


def _record_error(out: Path, fn):
    start = time.monotonic()
    try:
        fn()
        message = "NO ERROR"
    except Exception as err:  # the test inspects whatever the rank saw
        message = f"{type(err).__name__}: {err}"
    (out / f"err-rank{RANK}.txt").write_text(f"{time.monotonic() - start:.1f}\n{message}")
    if message != "NO ERROR":
        os._exit(1)  # a broken process group cannot be torn down cleanly


SCENARIOS = {
    "mlp": run_mlp, "compile": compile_small, "mismatch": mismatch, "adopt": adopt_and_local,
    "rank_raises": rank_raises, "rank_dies": rank_dies, "rank_stalls": rank_stalls,
}

if __name__ == "__main__":
    torch.set_num_threads(1)
    SCENARIOS[sys.argv[1]](Path(sys.argv[2]))
    torch.distributed.destroy_process_group()
