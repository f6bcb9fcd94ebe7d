"""What a program run op by op costs against eager PyTorch, with and without hpfun's dispatch
passes (`hpfun.peephole`, `hpfun.foreach`).

An HF `LlamaForCausalLM` AdamW step as written for eager PyTorch (forward, `loss.backward()`,
`opt.step()`, `opt.zero_grad()`) on a one-rank mesh: no communication, so what is left is the
program itself against eager's autograd and optimizer. Three versions of the same step, each
on its own copy of the model and optimizer (the same seed): eager, hpfun with the two passes
turned off while it compiles (the program as lowering made it), and hpfun as shipped.
Medians of interleaved repetitions; the parameters of all three are compared at the end.

    python benchmarks/opbyop.py --layers 2 8 24
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead  # noqa: E402 - the tiny Llama's configuration

import hpfun  # noqa: E402
from hpfun import P, foreach, peephole  # noqa: E402


def _build(layers: int):
    import transformers

    torch.manual_seed(0)
    config = overhead.LLAMA | {"num_hidden_layers": layers}  # the overhead benchmark's tiny Llama, deeper
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="sdpa"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt):
    def step(ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _ops(f, ids) -> int:
    return sum(n.op == "call_function" and getattr(n.target, "__name__", "") != "getitem"
               for n in f.lower(ids).program.module.graph.nodes)


def measure(layers: int, reps: int) -> dict:
    ids = torch.randint(0, overhead.LLAMA["vocab_size"], (overhead.LLAMA_BATCH, overhead.LLAMA_SEQ),
                        generator=torch.Generator().manual_seed(1))
    mesh = hpfun.Mesh((1,), ("dp",))
    models = {name: _build(layers) for name in ("eager", "before", "after")}
    steps = {"eager": _step(*models["eager"])}
    steps.update({name: hpfun.shard(_step(*models[name]), mesh=mesh, in_specs=(P(),), out_specs=P())
                  for name in ("before", "after")})
    fuse, simplify = foreach.fuse, peephole.simplify
    foreach.fuse, peephole.simplify = (lambda graph, cap=None: 0), (lambda graph, limit=0: 0)
    try:
        for _ in range(3):
            steps["before"](ids)  # compiled (and cached) without the passes
        ops_before = _ops(steps["before"], ids)
    finally:
        foreach.fuse, peephole.simplify = fuse, simplify
    for _ in range(3):
        steps["eager"](ids)
        steps["after"](ids)
    times: dict = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step(ids)
            times[name].append(time.perf_counter() - start)
    eager_params = list(models["eager"][0].parameters())
    differs = max((a - b).abs().max().item() for name in ("before", "after")
                  for a, b in zip(eager_params, models[name][0].parameters(), strict=True))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"layers": layers, "ops_before": ops_before, "ops_after": _ops(steps["after"], ids), **ms,
            "differs": differs}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 24])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| layers | ops before | ops after | eager (ms) | hpfun before (ms) | hpfun after (ms) | before / eager "
          "| after / eager | max param difference |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layers in args.layers:
        r = measure(layers, args.reps)
        print(f"| {layers} | {r['ops_before']} | {r['ops_after']} | {r['eager']:.1f} | {r['before']:.1f} | "
              f"{r['after']:.1f} | {r['before'] / r['eager']:.2f} | {r['after'] / r['eager']:.2f} | {r['differs']:.1e} |",
              flush=True)


if __name__ == "__main__":
    main()
