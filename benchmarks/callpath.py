"""What a cache-hit call costs hpfun itself: the call path (arguments flattened, the program
looked up, inputs sliced, outputs wrapped, state written back) with the program's run stubbed out.

`benchmarks/overhead.py`'s "cache hit beyond the program" column times calls back to back and
subtracts the time inside the runtime's `run`: on a shared 2-core machine with two gloo ranks
that figure also carries what running the program leaves behind (cold caches, the other rank
and gloo's threads competing for the cores). Here each rank runs the program once, keeps its
outputs, and the runtime's `run` returns them from then on: rank 0 then times the call path
alone while rank 1 waits, with warm caches (calls back to back) and with cold ones (8 MB
touched before each call, more than the 2 MB of L2 a core has here, as a program's run does).

    python benchmarks/callpath.py --out benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # noqa: E402 - the workloads, built as that benchmark builds them

import hpfun  # noqa: E402
from hpfun.runtime.distributed import runtime_for  # noqa: E402

SECTION = "## Cache-hit call path: hpfun's own cost per call"
COLD_BYTES = 8 * 1024 * 1024


def _stubbed(runtime):
    """The runtime's `run`, answering each program with the outputs of its first run."""
    real, kept = runtime.run, {}

    def run(module, local_inputs, seed, uses_seed, compile=False, boxed=False):
        if id(module) not in kept:
            kept[id(module)] = real(module, local_inputs, seed, uses_seed, compile, boxed)
        return kept[id(module)]

    return real, run


def measure(call, reps: int, iters: int) -> tuple[float, float]:
    """Median per-call microseconds of `call`: back to back, and each after touching COLD_BYTES."""
    buffer = torch.zeros(COLD_BYTES // 4)
    warm, cold = [], []
    for _ in range(reps):  # interleaved
        start = time.perf_counter()
        for _ in range(iters):
            call()
        warm.append((time.perf_counter() - start) / iters)
        total = 0.0
        for _ in range(iters):
            buffer.add_(1.0)
            start = time.perf_counter()
            call()
            total += time.perf_counter() - start
        cold.append(total / iters)
    return statistics.median(warm) * 1e6, statistics.median(cold) * 1e6


def worker(rank: int, world: int, port: int, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    mesh = hpfun.Mesh.distributed((world,), ("tp",))
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    env = overhead.Env(rank, world, mesh, device_mesh, compile=False, compile_hf=False)
    runtime = runtime_for(mesh)
    rows = {}
    for name in args.workloads:
        workload = overhead.BUILDERS[name](env)
        for _ in range(3):
            workload.call()
        real, runtime.run = _stubbed(runtime)
        try:
            workload.call()  # on both ranks: the stub keeps this run's outputs
            dist.barrier()
            if rank == 0:
                rows[name] = (workload.title, *measure(workload.call, args.reps, args.iters))
            dist.barrier()
        finally:
            runtime.run = real
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def report(rows: dict, command: str) -> str:
    lines = [SECTION, "",
             f"Command: `{command}` (world size 2, gloo, CPU, one thread per rank; the workloads of "
             "`benchmarks/overhead.py`, their programs' runs stubbed out; medians of interleaved repetitions, "
             "rank 0 timing while rank 1 waits).", "",
             "| workload | call path, warm caches (us) | call path, 8 MB touched before each call (us) |",
             "|---|---|---|"]
    lines += [f"| {title} | {warm:.1f} | {cold:.1f} |" for title, warm, cold in rows.values()]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=overhead.WORKLOADS, default=list(overhead.WORKLOADS))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--out", default=None, help="write the table into this markdown file (its section only)")
    args = parser.parse_args()
    text = report(overhead.on_two_ranks(worker, args), command="python " + " ".join(sys.argv))
    print(text)
    if args.out:
        overhead.write_section(args.out, text, SECTION)


if __name__ == "__main__":
    main()
