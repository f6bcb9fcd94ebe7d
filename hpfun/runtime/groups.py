"""The process groups of distributed meshes: which `DeviceMesh` (and collective timeout) each
mesh value runs on.

A `Mesh` stays a plain value; `Mesh.distributed` and `Mesh.from_device_mesh` record its
DeviceMesh here, and the distributed runtime looks it up when it binds a program. This module
knows torch.distributed and nothing of hpfun's programs, so the mesh module can reach it.
"""

from __future__ import annotations

import atexit
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpfun.errors import Problem, ShardingError

DEFAULT_TIMEOUT_S = float(os.environ.get("HPFUN_TIMEOUT", "300"))

# mesh value -> (its DeviceMesh, the timeout hpfun's own groups get; None: the DeviceMesh's groups)
_DEVICE_MESHES: dict = {}


def _destroy() -> None:
    """At exit, where the program has not done so: the process group hpfun started, destroyed.
    First the GIL is let go a moment: gloo's worker threads release the tensors of the last
    collective after the caller has returned (the release of a Python-held tensor needs the
    GIL), and one still doing so when the interpreter finalizes aborts the process ("terminate
    called without an active exception", exit code -6), typically after a step that raised."""
    time.sleep(0.05)
    if dist.is_initialized():
        dist.destroy_process_group()


def started() -> list:
    """The distributed meshes this process started (or adopted)."""
    return list(_DEVICE_MESHES)


def started_like(mesh):
    """The one distributed mesh this process started with `mesh`'s shape and axis names (a
    layout's text names only those), or None."""
    found = [m for m in _DEVICE_MESHES if m.shape == mesh.shape and m.axis_names == mesh.axis_names]
    return found[0] if len(found) == 1 else None


def start(mesh, timeout: float | None = None) -> None:
    """Join (or start) the default process group and build the DeviceMesh of `mesh` (an
    `hpfun.Mesh`); its collectives time out after `timeout` seconds (default `HPFUN_TIMEOUT`)."""
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    if not dist.is_initialized():
        _check_launcher_env()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        atexit.register(_destroy)  # (left to the interpreter's exit, gloo's threads abort the process
        # after a step that raised: "terminate called without an active exception", exit code -6)
    if mesh.size != dist.get_world_size():
        raise ShardingError(Problem(
            f"mesh {mesh}", f"needs {mesh.size} processes, but the job has {dist.get_world_size()}",
            f"launch it with torchrun --nproc-per-node {mesh.size} (or a world size of {mesh.size} across nodes), "
            f"or build a mesh of {dist.get_world_size()} ranks for this job"),
            headline="cannot build the mesh")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device_mesh = init_device_mesh(device, mesh.shape, mesh_dim_names=mesh.axis_names)
    _DEVICE_MESHES[mesh] = (device_mesh, datetime.timedelta(seconds=timeout))


def adopt(mesh, device_mesh: DeviceMesh, timeout: float | None = None) -> None:
    """Run `mesh` on an existing DeviceMesh: its groups, and their timeouts, are reused, unless
    `timeout` (seconds) is given, for which hpfun makes its own groups of the same ranks."""
    if timeout is not None and device_mesh.size() != dist.get_world_size():
        raise ShardingError(Problem(
            "Mesh.from_device_mesh(..., timeout=...)", f"adopts a DeviceMesh of {device_mesh.size()} of the job's "
            f"{dist.get_world_size()} ranks: hpfun's own groups with a timeout must be made by every rank for every "
            "such sub-mesh, which one rank cannot name", "leave timeout out (the DeviceMesh's groups and their "
            "timeouts are used), or adopt the whole DeviceMesh"), headline="cannot adopt the mesh")
    _DEVICE_MESHES[mesh] = (device_mesh, None if timeout is None else datetime.timedelta(seconds=timeout))


def device_mesh(mesh) -> tuple[DeviceMesh, datetime.timedelta | None]:
    """The DeviceMesh `mesh` runs on, and the timeout of the groups hpfun makes for it."""
    if mesh not in _DEVICE_MESHES:
        raise ShardingError(f"no process groups for mesh {mesh}: build it with hpfun.Mesh.distributed(...) "
                            "or hpfun.Mesh.from_device_mesh(...) on every rank")
    return _DEVICE_MESHES[mesh]


def _check_launcher_env():
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ShardingError(Problem("Mesh.distributed", f"needs a torch.distributed job, and {', '.join(missing)} "
                                    "are not set",
                                    "launch the script with torchrun (`torchrun --nproc-per-node 2 train.py`), or use "
                                    "hpfun.Mesh.simulated(shape, names) to run every rank in this process"),
                            headline="cannot build a distributed mesh")
