"""Low-precision partial sums: how far a bfloat16 (or float16) GPT step lands from float64,
unsharded and sharded, with partial sums reduced in float32 (the default) or in the compute dtype.

    python benchmarks/precision.py [--seeds 5] [--dtypes bfloat16 float16] [--out FILE]

Per seed, a GPT of `hpfun.testing.models` (vocab 128, seq 16, d 64, 4 heads, 2 layers; batch 8)
is initialised in float32 and cast to float64 and to the low-precision dtype; one AdamW step
(`gpt_step`) runs in float64 unsharded (the reference) and, from the same parameters and batch,
in the low-precision dtype unsharded and sharded on a simulated mesh with
`reduce_dtype="float32"` and `reduce_dtype="compute"`. Each is compared with the reference:
relative error of the loss, of the gradient (the optimizer's first moment after one step is
0.1 x the gradient) and of the updated parameters (over all parameters, ||x - ref|| / ||ref||),
averaged over the seeds. "bytes" is what the step's collectives hand over per rank.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch.utils import _pytree as pytree

import hpfun
from hpfun import P
from hpfun.testing.models import adamw_init, gpt_data, gpt_init, gpt_specs, gpt_step

SIZES = {"vocab": 128, "seq": 16, "d": 64, "heads": 4, "layers": 2}
BATCH = 8
# name -> (mesh shape, axis names, Megatron TP axis or None, batch spec)
LAYOUTS = {
    "dp=2": ((2,), ("dp",), None, P("dp")),
    "tp=2 (Megatron)": ((2,), ("tp",), "tp", P()),
    "dp=2 x tp=2": ((2, 2), ("dp", "tp"), "tp", P("dp")),
    "dp=4": ((4,), ("dp",), None, P("dp")),
    "tp=4 (Megatron)": ((4,), ("tp",), "tp", P()),
}
POLICIES = ("float32", "compute")


def _cast(tree, dtype):
    return pytree.tree_map(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _inputs(seed: int, dtype):
    params = gpt_init(seed=seed, **SIZES)
    idx, targets = gpt_data(BATCH, seed=seed + 1000, **SIZES)
    return _cast(params, dtype), _cast(adamw_init(params), dtype), idx, targets


def _flat(tensors: dict) -> torch.Tensor:
    return torch.cat([t.double().flatten() for _, t in sorted(tensors.items())])


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def _errors(result, reference) -> tuple[float, float, float]:
    """(loss, gradient, updated parameters) relative errors of one step against the reference."""
    (params, m, loss), (ref_params, ref_m, ref_loss) = result, reference
    return _rel(loss, ref_loss), _rel(_flat(m), _flat(ref_m)), _rel(_flat(params), _flat(ref_params))


def _unsharded(seed: int, dtype):
    params, state, idx, targets = _inputs(seed, dtype)
    params, state, loss = gpt_step(params, state, idx, targets)
    return params, state["m"], loss


def _sharded_step(layout: str, policy: str):
    shape, axes, tp, batch = LAYOUTS[layout]
    mesh = hpfun.Mesh.simulated(shape, axes)
    specs = gpt_specs(gpt_init(**SIZES), tp=tp)
    state = {"m": specs, "v": specs, "step": P()}
    return hpfun.shard(gpt_step, mesh=mesh, in_specs=(specs, state, batch, batch), out_specs=(specs, state, P()),
                       reduce_dtype=policy)


def _run_sharded(step, seed: int, dtype):
    params, state, loss = step(*_inputs(seed, dtype))
    full = {k: v.full() for k, v in params.items()}
    return full, {k: v.full() for k, v in state["m"].items()}, loss.full()


def measure(dtypes, seeds: int) -> list[tuple]:
    """Rows of (dtype, layout, reduce_dtype, loss err, grad err, params err, bytes per rank)."""
    references = {s: _unsharded(s, torch.float64) for s in range(seeds)}
    steps = {(layout, policy): _sharded_step(layout, policy) for layout in LAYOUTS for policy in POLICIES}
    rows = []
    for dtype in dtypes:
        errs = [_errors(_unsharded(s, dtype), references[s]) for s in range(seeds)]
        rows.append((dtype, "unsharded", "-", *_means(errs), 0))
        for (layout, policy), step in steps.items():
            errs = [_errors(_run_sharded(step, s, dtype), references[s]) for s in range(seeds)]
            nbytes = step.lower(*_inputs(0, dtype)).cost().bytes
            rows.append((dtype, layout, policy, *_means(errs), nbytes))
            print(f"  {rows[-1]}", file=sys.stderr)
    return rows


def _means(errs: list[tuple]) -> tuple[float, float, float]:
    return tuple(statistics.fmean(column) for column in zip(*errs, strict=True))


def table(rows: list[tuple], seeds: int) -> str:
    head = ("| dtype | layout | reduce_dtype | loss rel. err | grad rel. err | params rel. err | grad err / unsharded "
            "| bytes per rank |\n|---|---|---|---|---|---|---|---|")
    lines, base = [head], {}
    for dtype, layout, policy, loss, grad, params, nbytes in rows:
        name = str(dtype).replace("torch.", "")
        base.setdefault(name, grad)
        lines.append(f"| {name} | {layout} | {policy} | {loss:.2e} | {grad:.3e} | {params:.3e} | {grad / base[name]:.3f} "
                     f"| {nbytes if nbytes else '-'} |")
    note = f"\n\n(means over {seeds} seeds of parameters and batch)\n"
    if any(row[5] != row[5] for row in rows):  # nan
        note += ("nan: AdamW in float16 divides by sqrt(v) + eps = 0 where the gradient's square underflows "
                 "(eps=1e-8 is 0 in float16), unsharded and sharded alike.\n")
    return "\n".join(lines) + note


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--out", default=None, help="append the table to this markdown file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtypes = [getattr(torch, name) for name in args.dtypes]
    text = table(measure(dtypes, args.seeds), args.seeds)
    print(text)
    if args.out:
        command = f"python benchmarks/precision.py --seeds {args.seeds} --dtypes {' '.join(args.dtypes)}"
        with open(args.out, "a") as f:
            f.write(f"\n## Low-precision partial sums: error against float64\n\nCommand: `{command}` "
                    f"(simulated meshes, CPU, one thread).\n\n{text}")


if __name__ == "__main__":
    main()
