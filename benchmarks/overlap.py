"""Data parallel GPT step with bucketed and overlapped gradient all-reduces vs one synchronous
all-reduce per gradient, world size 2, gloo, CPU.

    python benchmarks/overlap.py [--reps 9] [--iters 3] [--layers 4] [--d 256]

Two processes, one compute thread each (gloo runs the collectives on its own threads). The
variants run in interleaved repetitions (a, b, c, a, b, c, ...), each timing `iters` steps
after a barrier; the table reports per-step medians. Every variant is checked to give bitwise
the parameters of the synchronous one.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hpfun
from hpfun import P
from hpfun.testing.models import adamw_init, gpt_data, gpt_init, gpt_specs, gpt_step

VARIANTS = {
    "sync: one all-reduce per gradient, waited at once": {"bucket_bytes": 0, "overlap": False},
    "buckets 25 MiB, not overlapped": {"overlap": False},
    "buckets 25 MiB, overlapped (default)": {},
    "buckets 4 MiB, overlapped": {"bucket_bytes": 4 * 2**20},
    "buckets 1 MiB, overlapped": {"bucket_bytes": 2**20},
}


def _worker(rank: int, port: int, args, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=600)
    sizes = {"layers": args.layers, "d": args.d, "heads": args.d // 64, "seq": args.seq, "vocab": args.vocab}
    params = gpt_init(**sizes)
    specs = gpt_specs(params)
    state = {"m": specs, "v": specs, "step": P()}
    data = gpt_data(args.batch, **sizes)
    steps, lowered = {}, {}
    for name, options in VARIANTS.items():
        steps[name] = hpfun.shard(gpt_step, mesh=mesh, in_specs=(specs, state, P("dp"), P("dp"), None),
                                  out_specs=(specs, state, P()), **options)
        lowered[name] = steps[name].lower(params, adamw_init(params), *data, None).to_dict()["buckets"]
    first = {name: step(params, adamw_init(params), *data, None)[0] for name, step in steps.items()}  # compiles
    ref = first[next(iter(VARIANTS))]
    same = {name: all(torch.equal(out[k].local, ref[k].local) for k in params) for name, out in first.items()}
    times = {name: [] for name in VARIANTS}
    for _ in range(args.reps):
        for name, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step(params, adamw_init(params), *data, None)
            times[name].append((time.perf_counter() - t0) / args.iters)
    if rank == 0:
        queue.put((times, same, lowered))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    times, same, lowered = queue.get(timeout=3600)
    for p in procs:
        p.join()
    base = statistics.median(times[next(iter(VARIANTS))])
    print(f"DP GPT step (layers {args.layers}, d {args.d}, seq {args.seq}, vocab {args.vocab}, batch {args.batch} "
          f"over 2 ranks), gloo, {args.reps} interleaved reps x {args.iters} steps")
    print("| variant | all-reduces issued | gradient bytes per rank | median step (ms) | vs sync | bitwise = sync |")
    print("|---|---|---|---|---|---|")
    for name in VARIANTS:
        issued = lowered[name]
        total = sum(b["bytes"] for b in issued)
        med = statistics.median(times[name])
        print(f"| {name} | {len(issued)} | {total} | {med * 1e3:.1f} | {med / base:.3f} | {same[name]} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
