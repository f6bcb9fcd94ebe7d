"""The distributed runtime: the per-shard program on each rank of a `torch.distributed` job.

The mesh value stays a plain value; `hpfun.runtime.groups` records the `DeviceMesh` of each
distributed mesh, and this module keeps the process groups its collectives run over. Binding a
program replaces each collective's mesh-axis tag with the name of the real process group, once
per program.
"""

from __future__ import annotations

import datetime
import hashlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.fx.graph import _BoxedCodeGen

from hpfun.errors import Problem, ShardingError
from hpfun.mesh import Mesh
from hpfun.runtime import failure, groups

_RUNTIMES: dict[Mesh, "DistributedRuntime"] = {}


def runtime_for(mesh: Mesh) -> "DistributedRuntime":
    """This rank's runtime for `mesh`, on the DeviceMesh `Mesh.distributed` or
    `Mesh.from_device_mesh` recorded (a mesh built again gets a fresh runtime)."""
    device_mesh, timeout = groups.device_mesh(mesh)
    runtime = _RUNTIMES.get(mesh)
    if runtime is None or runtime.device_mesh is not device_mesh or runtime.timeout != timeout:
        runtime = _RUNTIMES[mesh] = DistributedRuntime(mesh, device_mesh, timeout)
    return runtime


class DistributedRuntime:
    """This rank's view of a distributed mesh: coordinates, groups, bound programs."""

    def __init__(self, mesh: Mesh, device_mesh: DeviceMesh, timeout: datetime.timedelta | None = None):
        # With a timeout, hpfun makes its own groups with it (DeviceMesh's carry torch's 30-minute
        # default, which would turn a stuck peer into a long hang); without, the DeviceMesh's are used.
        self.mesh, self.device_mesh, self.timeout = mesh, device_mesh, timeout
        self.device = torch.device(device_mesh.device_type)
        self.coords = tuple(device_mesh.get_coordinate())
        self.index = mesh.rank(self.coords)  # this rank's position in the mesh (row-major)
        self.coords_tensor = torch.tensor(self.coords, dtype=torch.int64, device=self.device)
        self._groups: dict[str, str] = {}
        self._all = None
        self.broken: str | None = None  # why this rank's collectives may no longer pair with the others'

    def check_usable(self) -> None:
        """Refuse to start a call after one of this rank's programs failed while running: other
        ranks may have finished that call, so this rank's next collectives would pair with their
        next call's (each rank computing on the others' other batches, silently)."""
        if self.broken is not None:
            raise ShardingError(Problem(
                f"mesh rank {self.index} {self.coords}",
                f"an earlier call failed on this rank while its program ran ({self.broken}); other ranks may have "
                "finished that call, so the ranks' collectives no longer pair up, and this mesh runs nothing more",
                "end the job and start it again (a loop that catches the error and goes on cannot recover on a "
                "distributed mesh); errors raised before a program runs (while compiling) leave the job usable"),
                headline="the ranks are out of step")

    # -- groups ---------------------------------------------------------------------------------

    def group_name(self, axes: str) -> str:
        """The registered process-group name for a comma-separated list of mesh axes."""
        if axes not in self._groups:
            names = axes.split(",")
            if len(names) == 1 and self.timeout is None:
                self._groups[axes] = self.device_mesh.get_group(names[0]).group_name
            else:
                self._groups[axes] = self._new_group(self.mesh.groups(names)).group_name
        return self._groups[axes]

    def _new_group(self, groups: list[list[int]]):
        """Every rank creates every group (torch requires it), in the same order; keeps its own."""
        ranks = self.device_mesh.mesh.flatten().tolist()
        mine = None
        for members in groups:
            group = dist.new_group([ranks[i] for i in members], timeout=self.timeout)
            if self.index in members:
                mine = group
        return mine

    def all_ranks_group(self):
        """A group of the mesh's ranks with the mesh's timeout; without one (an adopted
        DeviceMesh), the default group when the mesh spans the job. (The default group carries
        the timeout of whoever started the job: torch's 30 minutes if the user's script did.)"""
        if self._all is None and self.timeout is None and self.mesh.size != dist.get_world_size():
            # an adopted sub-mesh (a tp row of a dp x tp DeviceMesh): its own groups, which every rank made
            # for every row (a group of this row's ranks alone would collide with the other rows')
            self._all = self.device_mesh.get_group(0) if self.device_mesh.ndim == 1 else \
                self.device_mesh._flatten().get_group(0)
        elif self._all is None and (self.mesh.size != dist.get_world_size() or self.timeout is not None):
            self._all = self._new_group([list(range(self.mesh.size))])
        return self._all

    # -- programs ---------------------------------------------------------------------------------

    def bind(self, module: torch.fx.GraphModule, compile: bool = False, boxed: bool = False):
        """A copy of the program with axis tags replaced by real group names (cached). `boxed`:
        its code takes one list of inputs and empties it, so that each input is freed after its
        last use (fx's boxed calling convention; not with `compile`)."""
        bound_here = module.__dict__.setdefault("_hpfun_bound", {})
        key = (self, compile, boxed)
        if key not in bound_here:
            graph = torch.fx.Graph()
            graph.output(graph.graph_copy(module.graph, {}))
            gloo = dist.get_backend() == "gloo"
            for node in list(graph.nodes):
                if node.op == "call_function" and node.target in _COLLECTIVES:
                    node.args = (*node.args[:-1], self.group_name(node.args[-1]))
                    if gloo:
                        _nans_kept(graph, node)
                        _through_gloo(graph, node)
            if boxed:
                graph.set_codegen(_BoxedCodeGen())
            bound = torch.fx.GraphModule(module, graph)
            bound_here[key] = torch.compile(bound, backend="inductor", dynamic=False) if compile else bound
        return bound_here[key]

    def run(self, module, local_inputs, seed: torch.Tensor, uses_seed: bool, compile: bool = False,
            boxed: bool = False) -> list[torch.Tensor]:
        """Run this rank's part of `module`. `boxed`: `local_inputs` is emptied as the program
        starts, which then holds the only references to them (donated state)."""
        boxed = boxed and not compile
        try:  # binding makes the program's process groups at its first run: every rank must take part
            bound = self.bind(module, compile, boxed)
        except RuntimeError as err:  # (a DistStoreError: a rank that never came)
            raise _peer_failure(self, err) from err
        try:
            if uses_seed:  # every rank draws with rank 0's seed, whatever its own generator says
                seed = seed.to(self.device)
                dist.broadcast(seed, self.device_mesh.mesh.flatten()[0].item(), group=self.all_ranks_group())
            # The program is already differentiated: run without autograd (lifted parameters come
            # in as themselves, and their blocks must come back as plain tensors, not graph nodes).
            with torch.no_grad():
                # forward, not __call__: fx's wrapper would drop the traceback that locates the op
                call = bound.forward if isinstance(bound, torch.fx.GraphModule) else bound
                if boxed:
                    args = [*local_inputs, self.coords_tensor, seed]
                    local_inputs.clear()
                    return list(call(args))
                return list(call(*local_inputs, self.coords_tensor, seed))
        except Exception as err:
            self.broken = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:120] if str(err).strip() else ''}"
            node = failure.from_traceback(bound, err) if isinstance(bound, torch.fx.GraphModule) else None
            if node is not None and node.target not in _COLLECTIVES and node.target is not _WAIT:
                raise failure.execution_error(node, f"mesh rank {self.index} {self.coords}", err) from err
            if isinstance(err, (RuntimeError, dist.DistBackendError)):
                raise _peer_failure(self, err) from err
            raise failure.execution_error(None, f"mesh rank {self.index} {self.coords}", err) from err

    def check_same_program(self, description: list[str]) -> None:
        """All ranks compare what they compile (one line per input: "path: dtype[shape] layout");
        a mismatch fails on every rank, naming the differing inputs and the ranks' values."""
        try:
            self._check_same_program(description)
        except (RuntimeError, dist.DistBackendError) as err:
            if isinstance(err, ShardingError):
                raise
            raise _peer_failure(self, err) from err

    def check_same_entry(self, fingerprint: int, description) -> None:
        """The ranks compare the hash of the cached program each is about to run; where they
        differ, every rank exchanges `description()` and fails as `check_same_program` does."""
        if len(self._hashes(fingerprint)) > 1:
            self.check_same_program(description())

    def agree_on_compile(self, digest: int | None, reads: list[str], plan=lambda: []) -> None:
        """After each compile, every rank, whether its compile succeeded (`digest`: a hash of the
        program it planned) or raised (None), exchanges 16 bytes: the plan's hash and a hash of
        the values its trace read from its inputs. Every rank sees the same exchange, so all
        take the same branch and the job's collectives stay paired:
        - a rank failed: the others raise too (the failed ones re-raise their own error);
        - the values read differ: every rank raises the differences (`check_same_program`);
        - the plans differ for the same call and the same reads: running them would pair different
          collectives (a silently wrong result), so every rank raises where they part (`plan()`:
          the lines of its program, exchanged only then)."""
        read = int.from_bytes(hashlib.blake2b("\n".join(reads).encode(), digest_size=7).digest())
        try:
            gathered = self._gathered([-1 if digest is None else digest, read])
        except ShardingError:
            if digest is None:
                return  # (raising its own error)
            raise
        failed = [i for i, t in enumerate(gathered) if t[0] == -1]
        if failed:
            if digest is None:
                return
            raise ShardingError(Problem(f"mesh rank{'s' * (len(failed) > 1)} {', '.join(map(str, failed))}",
                                        "raised an error while compiling this call (that rank's own error says why)",
                                        "make the call succeed on every rank: an error only some ranks' data give "
                                        "(a value read, a rank-dependent branch) fails them all"),
                                headline="another rank failed to compile the call")
        if len({t[1] for t in gathered}) > 1:
            self.check_same_program(reads)
        if len({t[0] for t in gathered}) > 1:
            plans = [None] * self.mesh.size  # (every rank is here: each saw the plans differ)
            try:
                dist.all_gather_object(plans, plan(), group=self.all_ranks_group())
            except (RuntimeError, dist.DistBackendError) as err:
                raise _peer_failure(self, err) from err
            self.check_same_plan(plans)

    def check_same_plan(self, plans: list[list[str]]) -> None:
        """The ranks' plans (`agree_on_compile`: one line per step of each program, its op and
        the user's line), which differ: where they first part, for each rank unlike rank 0. The
        same call and options plan the same program, so the cause is code that runs differently
        on some ranks (a branch on the rank, a module attribute or option set per rank) or hpfun."""
        where = []
        values = [[l[len(VALUE_LINE):] for l in lines if l.startswith(VALUE_LINE)] for lines in plans]
        steps = [[l for l in lines if not l.startswith(VALUE_LINE)] for lines in plans]
        for rank in range(1, len(plans)):
            mine = [v for v in values[0] if v not in values[rank]]
            theirs = [v for v in values[rank] if v not in values[0]]
            if mine or theirs:  # the Python values (and tensors made from data) deciding the programs, as they differ
                where.append(Problem(f"mesh rank {rank}", f"holds {'; '.join(theirs) or 'none of them'}, where mesh "
                                     f"rank 0 holds {'; '.join(mine) or 'none of them'}"))
            lines = steps[rank]
            if lines == steps[0]:
                continue
            i = next((i for i, (a, b) in enumerate(zip(steps[0], lines)) if a != b), min(len(steps[0]), len(lines)))
            mine = steps[0][i] if i < len(steps[0]) else "(the program ends)"
            theirs = lines[i] if i < len(lines) else "(the program ends)"
            where.append(Problem(f"mesh rank {rank}", f"step {i} of its program is {theirs}, where mesh rank 0's is {mine}"))
        distinct = len({tuple(lines) for lines in plans})
        raise ShardingError(where + [Problem(
            "the plans", f"the ranks planned {distinct} different per-shard programs for the same call, whose "
            "collectives would not pair up", "make the function run alike on every rank: no branch on the rank, the "
            "same module attributes and Python values, the same hpfun.shard options (out_specs, rng, bucket_bytes, "
            "cost_model, solver...); if all of that is the same, it is a bug in hpfun (a plan must depend on the call "
            "alone): report it, and export PYTHONHASHSEED=0 for every rank to work around it")],
            headline="ranks planned different programs")

    def same_everywhere(self, mine: int) -> bool:
        """Whether every rank passes the same `mine` (one 8-byte all_gather)."""
        return len(self._hashes(mine)) == 1

    def _hashes(self, mine: int) -> set[int]:
        """The distinct values of `mine` over every rank (one 8-byte all_gather)."""
        return {row[0] for row in self._gathered([mine])}

    def _gathered(self, mine: list[int]) -> list[tuple[int, ...]]:
        """Every rank's `mine` (int64s, one all_gather), in mesh order; a peer failure raised as one."""
        value = torch.tensor(mine, dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(value) for _ in range(self.mesh.size)]
        try:
            dist.all_gather(gathered, value, group=self.all_ranks_group())
        except (RuntimeError, dist.DistBackendError) as err:
            raise _peer_failure(self, err) from err
        return [tuple(int(v) for v in t) for t in gathered]

    def _check_same_program(self, description: list[str]) -> None:
        digest = hashlib.sha256("\n".join(description).encode()).hexdigest()
        gathered = [None] * self.mesh.size
        dist.all_gather_object(gathered, (digest, description), group=self.all_ranks_group())
        if len({d for d, _ in gathered}) > 1:
            raise ShardingError(_differences([desc for _, desc in gathered]),
                                headline="ranks called the sharded function with different arguments "
                                         "(every rank must pass the same shapes, dtypes and layouts)")


def _differences(descriptions: list[list[str]]) -> list[Problem]:
    """Per input that differs between ranks: its path, and which mesh ranks passed what."""
    per_rank = [dict(line.split(": ", 1) if ": " in line else (line, "") for line in lines) for lines in descriptions]
    paths = list(dict.fromkeys(p for d in per_rank for p in d))
    out = []
    for path in paths:
        values = [d.get(path, "(not given)") for d in per_rank]
        if len(set(values)) > 1:
            ranks = {v: [r for r, w in enumerate(values) if w == v] for v in dict.fromkeys(values)}
            shown = "; ".join(f"mesh rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: {v}" for v, rs in ranks.items())
            out.append(Problem(path, f"differs between ranks ({shown})"))
    return out or [Problem("the arguments", "have different structures on different ranks")]


def _peer_failure(runtime: DistributedRuntime, err: Exception) -> ShardingError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ShardingError(
        f"mesh rank {runtime.index} (coords {runtime.coords}) on {runtime.mesh}: {first}",
        headline="a collective failed: another rank raised, died, timed out or ran a different program",
    )


VALUE_LINE = "value: "  # a line of a plan naming a Python value it was made for, not a step (`check_same_plan`)
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_COLLECTIVES = {
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
}

_SUMS = {torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.reduce_scatter_tensor.default}
_F8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
            if hasattr(torch, n))
# dtypes gloo has no collective for -> (a dtype of the same size its values move in, bit for
# bit, by gathers and all-to-alls; the dtype a reduction computes in, exactly: integer sums
# wrap alike when narrowed back; or None where none is exact)
_GLOO_WIRE = {
    torch.int16: (torch.float16, torch.int32),
    torch.uint16: (torch.float16, torch.int32),
    torch.uint32: (torch.int32, torch.int64),
    torch.uint64: (torch.int64, None),
    **{f8: (torch.uint8, torch.float32) for f8 in _F8},
}


def _record_dtype(node: torch.fx.Node) -> tuple:
    """A collective's planned record (its bucket's, if bucketed) and the dtype it moves."""
    record = node.meta.get("hpfun_bucket") or node.meta.get("hpfun_collective")
    return record, getattr(torch, str(getattr(record, "dtype", None)), None)


def _nans_kept(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """A max or min of floating values over the mesh keeping a NaN wherever a rank has one, as
    eager's amax does: gloo's drops one a later rank holds. Each element travels with a flag of
    whether it is NaN (stacked on a last dim, so a reduce-scatter splits both alike), reduced
    by the same op, and the result is NaN where any rank's flag was set."""
    _, dtype = _record_dtype(node)
    if node.target not in _SUMS or node.args[1] not in ("max", "min") or not isinstance(dtype, torch.dtype) \
            or not dtype.is_floating_point:
        return
    aten = torch.ops.aten
    with graph.inserting_before(node):
        flag = graph.call_function(aten._to_copy.default, (graph.call_function(aten.isnan.default, (node.args[0],)),),
                                   {"dtype": dtype})
        if node.args[1] == "min":  # (set flags are -1, which a min keeps)
            flag = graph.call_function(aten.neg.default, (flag,))
        moved = graph.call_function(aten.stack.default, ([node.args[0], flag], -1))
    node.args = (moved, *node.args[1:])
    wait = next(iter(node.users))
    with graph.inserting_after(wait):
        value = graph.call_function(aten.select.int, (wait, -1, 0))
    with graph.inserting_after(value):
        flags = graph.call_function(aten.select.int, (wait, -1, 1))
    with graph.inserting_after(flags):
        found = graph.call_function(aten.ne.Scalar, (flags, 0))
    with graph.inserting_after(found):
        kept = graph.call_function(aten.masked_fill.Scalar, (value, found, float("nan")))
    wait.replace_all_uses_with(kept, delete_user_cb=lambda user: user not in (value, flags))


def _through_gloo(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Move a collective's value of a dtype gloo lacks (int16, unsigned, float8) in one it has:
    its bits viewed as a same-size dtype where the values only move, or cast to a wider dtype
    where they are reduced, and back after the wait. A uint64 sum is the int64 sum of the same
    bits (two's complement adds alike); its max or min has no exact stand-in and is refused."""
    record, dtype = _record_dtype(node)
    if isinstance(dtype, torch.dtype) and dtype.is_complex and node.target not in _SUMS:
        # (gloo's all-to-all refuses complex values: moved as their pairs of floats, a trailing dim of 2,
        # which leaves the dim 0 a gather or all-to-all splits and joins as it is)
        there, back = (torch.ops.aten.view_as_real.default,), (torch.ops.aten.view_as_complex.default,)
    elif dtype not in _GLOO_WIRE:
        return
    else:
        there, back = _gloo_stand_in(node, record, dtype)
    with graph.inserting_before(node):
        moved = graph.call_function(there[0], (node.args[0], *there[1:]))
    node.args = (moved, *node.args[1:])
    wait = next(iter(node.users))
    with graph.inserting_after(wait):
        restored = graph.call_function(back[0], (wait, *back[1:]))
    wait.replace_all_uses_with(restored, delete_user_cb=lambda user: user is not restored)


def _gloo_stand_in(node: torch.fx.Node, record, dtype: torch.dtype) -> tuple:
    """The ops moving a value of a dtype gloo lacks there and back (`_GLOO_WIRE`)."""
    moves, reduces = _GLOO_WIRE[dtype]
    reduce = node.args[1] if node.target in _SUMS else None
    if reduce is None or dtype is torch.uint64 and reduce == "sum":
        return (torch.ops.aten.view.dtype, moves), (torch.ops.aten.view.dtype, dtype)
    if reduces is not None:
        return (torch.ops.aten.to.dtype, reduces), (torch.ops.aten.to.dtype, dtype)
    raise ShardingError(Problem(
        "torch.distributed (gloo)", f"a {reduce} of {dtype} values over the mesh ({record})",
        "gloo has no collective for this dtype and no exact stand-in for this reduction: compute it in int64"))
