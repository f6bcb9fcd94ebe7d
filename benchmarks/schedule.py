"""A training loop with a learning-rate schedule: what the schedule costs a sharded step.

    python benchmarks/schedule.py [--steps 10] [--out FILE]

The tiny HF Llama step of `overhead.py` (LlamaForCausalLM, 2 layers, AdamW, the model and
optimizer closed over), Megatron TP on a simulated 2-rank mesh, CPU. Run side by side in one
process, each from a fresh model: `--steps` steps at a constant learning rate, the same steps
with `CosineAnnealingLR` stepped after each call (a float learning rate, as written), and with
the learning rate kept in a tensor. Reported per version: wall time of the whole loop (first
call included), programs compiled, and the largest parameter difference from the same loop run
eagerly. The float rate of SGD, Adam and AdamW is an input of the program, so a schedule
should cost no compile.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import hpfun
from hpfun import P
from hpfun.testing.models import LLAMA_TP

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (the tiny Llama and its batch)

SECTION = "## A learning-rate schedule in the training loop"
VERSIONS = {"constant float lr": (1e-3, False), "cosine schedule, float lr": (1e-3, True),
            "cosine schedule, lr in a tensor": (torch.tensor(1e-3, dtype=torch.float64), True)}


def _loop(lr, scheduled: bool, steps: int, ids, sharded: bool) -> tuple[float, int, list]:
    model = overhead._llama().double()
    opt = torch.optim.AdamW(model.parameters(), lr=lr.clone() if isinstance(lr, torch.Tensor) else lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps) if scheduled else None

    def train_step(ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    step = hpfun.shard(train_step, mesh=mesh, in_specs=(P(),), out_specs=P(), state_specs=LLAMA_TP) if sharded \
        else train_step
    start = time.perf_counter()
    for _ in range(steps):
        step(ids)
        if schedule is not None:
            schedule.step()
    seconds = time.perf_counter() - start
    return seconds, step.trace_count if sharded else 0, [p.detach().clone() for p in model.parameters()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="write the table into this markdown file (its section only)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(0, overhead.LLAMA["vocab_size"], (overhead.LLAMA_BATCH, overhead.LLAMA_SEQ),
                        generator=torch.Generator().manual_seed(1))
    lines = [SECTION, "",
             f"Command: `python {' '.join(sys.argv)}` (tiny HF Llama, AdamW, Megatron TP on a simulated 2-rank mesh, "
             f"float64, {args.steps} steps from a fresh model, first call included).", "",
             "| version | loop (s) | programs compiled | max parameter difference from eager |", "|---|---|---|---|"]
    _loop(1e-3, False, 2, ids, sharded=True)  # warm-up: imports and first-use costs of tracing, not timed
    for name, (lr, scheduled) in VERSIONS.items():
        seconds, compiles, params = _loop(lr, scheduled, args.steps, ids, sharded=True)
        _, _, eager = _loop(lr, scheduled, args.steps, ids, sharded=False)
        diff = max((a - b).abs().max().item() for a, b in zip(params, eager, strict=True))
        lines.append(f"| {name} | {seconds:.1f} | {compiles} | {diff:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        overhead.write_section(args.out, text, SECTION)


if __name__ == "__main__":
    main()
