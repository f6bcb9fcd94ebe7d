"""Train the demo MLP data x tensor parallel on a (2, 2) mesh, beside the unsharded run.

    python -m hpfun.demo [--steps 20]                                   # simulated mesh
    torchrun --nproc-per-node 4 -m hpfun.demo --distributed             # 4 processes, gloo
"""

from __future__ import annotations

import argparse
import time

import torch

import hpfun
from hpfun import P
from hpfun.testing.models import MEGATRON, mlp_data, mlp_init, mlp_step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--distributed", action="store_true", help="run under torchrun, one process per rank")
    args = parser.parse_args(argv)

    if args.distributed:
        torch.set_num_threads(1)
        mesh = hpfun.Mesh.distributed((2, 2), ("dp", "tp"))
        is_first = torch.distributed.get_rank() == 0
    else:
        mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
        is_first = True
    say = print if is_first else (lambda *a, **k: None)
    step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(MEGATRON, P("dp"), P("dp")), out_specs=(MEGATRON, P()))
    params = mlp_init(16, 64, 8)
    x, y = mlp_data(args.batch, 16, 8)

    start = time.perf_counter()
    lowered = step.lower(params, x, y)
    say(f"mesh {mesh} ({mesh.runtime}): data parallel over dp, Megatron tensor parallel over tp "
        f"(compiled in {time.perf_counter() - start:.2f} s)")
    say(f"collectives per step ({len(lowered.collectives)}):")
    for c in lowered.collectives:
        say(f"  {c.kind:<10} over {','.join(c.axes):<6} {c.bytes:>6} B  for {c.node}: {c.reason}")
    say(f"\n{'step':>4}  {'loss (sharded)':>15}  {'loss (unsharded)':>16}  {'|diff|':>9}")
    sharded, reference = params, params
    for i in range(args.steps):
        sharded, loss = step(sharded, x, y)
        reference, ref_loss = mlp_step(reference, x, y)
        value = loss.full().item()
        say(f"{i:>4}  {value:>15.6f}  {ref_loss.item():>16.6f}  {abs(value - ref_loss.item()):>9.2e}")
    worst = max((sharded[k].full() - reference[k]).abs().max().item() for k in params)
    say(f"\nafter {args.steps} steps: max |param difference| = {worst:.2e}; traced {step.trace_count} time(s)")
    if args.distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
