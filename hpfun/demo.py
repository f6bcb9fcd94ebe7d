"""Train the demo MLP data x tensor parallel on a simulated (2, 2) mesh, beside the unsharded run.

    python -m hpfun.demo [--steps 20]
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
    args = parser.parse_args(argv)

    mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(MEGATRON, P("dp"), P("dp")), out_specs=(MEGATRON, P()))
    params = mlp_init(16, 64, 8)
    x, y = mlp_data(args.batch, 16, 8)

    start = time.perf_counter()
    lowered = step.lower(params, x, y)
    print(f"mesh {mesh}: data parallel over dp, Megatron tensor parallel over tp "
          f"(compiled in {time.perf_counter() - start:.2f} s)")
    print(f"collectives per step ({len(lowered.collectives)}):")
    for c in lowered.collectives:
        print(f"  {c.kind:<10} over {','.join(c.axes):<6} {c.bytes:>6} B  for {c.node}: {c.reason}")
    print(f"\n{'step':>4}  {'loss (sharded)':>15}  {'loss (unsharded)':>16}  {'|diff|':>9}")
    sharded, reference = params, params
    for i in range(args.steps):
        sharded, loss = step(sharded, x, y)
        reference, ref_loss = mlp_step(reference, x, y)
        diff = abs(loss.full().item() - ref_loss.item())
        print(f"{i:>4}  {loss.full().item():>15.6f}  {ref_loss.item():>16.6f}  {diff:>9.2e}")
    worst = max((sharded[k].full() - reference[k]).abs().max().item() for k in params)
    print(f"\nafter {args.steps} steps: max |param difference| = {worst:.2e}; traced {step.trace_count} time(s)")


if __name__ == "__main__":
    main()
