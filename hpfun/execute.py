"""Running a per-shard program on its mesh's runtime: every rank inside this process
(simulated), or this rank of a `torch.distributed` job (distributed).

The caller says what each rank's inputs are (`blocks`), so this module needs to know nothing
of `Sharded` values: `Sharded.full()` and `shard()`'s calls both run programs through it.
"""

from __future__ import annotations

from typing import Callable

import torch

from hpfun.lower import Program
from hpfun.rng import draw_seed
from hpfun.runtime import simulated
from hpfun.runtime.distributed import runtime_for

NO_SEED = torch.zeros(1, dtype=torch.int64)  # the seed input of a program that draws no random numbers


def run(program: Program, blocks: Callable[[tuple, torch.device | None], list], compile: bool = False,
        boxed: bool = False) -> list[tuple]:
    """Run `program`; `blocks(coords, device)` gives the inputs of the rank at mesh `coords`
    (on `device`, None: where they are). Per output, the shards this process holds: one per
    rank of a simulated mesh, this rank's of a distributed one. `boxed` (distributed): the
    program empties the list of inputs it is given, and frees each after its last use."""
    mesh = program.mesh
    if program.seed is not None:  # the function seeds torch itself: every call draws the same numbers
        seed = torch.tensor([program.seed], dtype=torch.int64)
    else:
        seed = draw_seed() if program.uses_seed else NO_SEED
    if mesh.runtime == "simulated":
        per_rank = [blocks(mesh.coords(r), None) for r in range(mesh.size)]
        if program.device.type != "cpu":
            seed = seed.to(program.device)
        outs = simulated.run(program.module, mesh, per_rank, seed, compile=compile, device=program.device)
        out = [tuple(outs[r][i] for r in range(mesh.size)) for i in range(len(program.output_layouts))]
    else:
        runtime = runtime_for(mesh)
        local = blocks(runtime.coords, runtime.device)
        out = [(o,) for o in runtime.run(program.module, local, seed, program.uses_seed, compile=compile, boxed=boxed)]
    if program.seed is not None:  # and leaves torch's generator seeded, as its eager call would
        torch.manual_seed(program.seed)
    return out
