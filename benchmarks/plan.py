"""Plan a Llama-3-8B-sized training step at full scale, on meta tensors, under hand layouts and
under `hpfun.AUTO`: planning time, predicted communication time per step (alpha-beta model) and
memory per rank (hpfun's liveness estimate), against a per-rank budget.

The step is Hugging Face `LlamaForCausalLM` as written (`model(ids, labels=ids).loss`,
`loss.backward()`, `torch.optim.AdamW.step()`), bfloat16, 32 layers, d 4096, GQA 32/8 heads,
MLP 14336, vocab 128256, one sequence of 2048 tokens per rank of the mesh (the global batch is the
mesh size), on dp x tp = 2 x 4 (8 ranks) and 8 x 8 (64 ranks). Nothing is allocated: the model
lives on the meta device and hpfun only plans.

Layouts:
- pure DP: the batch split over every rank, parameters and optimizer state replicated;
- ZeRO-3: the batch split over every rank; parameters, gradients and optimizer state split over
  every rank along dim 0, each parameter gathered at each use (`gather_params`);
- Megatron TP + DP: Megatron's column/row split of attention and MLP over tp, the batch over dp;
- Megatron TP + SP + ZeRO-1: the same, the embedding's output pinned split along the sequence
  over tp (sequence parallelism; propagation places the rest), the optimizer state further split
  over dp;
- AUTO: every weight's spec `hpfun.AUTO` under `memory_budget` (optimizer state follows), the
  batch over dp; and the same with `gather_params` over both axes, so that FSDP's per-use
  gathers are among the plans priced.

    python benchmarks/plan.py [--layers 32] [--meshes 2x4 8x8] [--budget-gb 80] [--donate-state] [--stages] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import gc
import re
import time

import torch

import hpfun
from hpfun import P
from hpfun.testing.models import LLAMA_TP, llama3_8b

GIB = 2**30


def _model(layers: int):
    model = llama3_8b(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    with torch.no_grad():  # AdamW's state exists from the first step on: plan the steady-state step
        for p in model.parameters():
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}
    return model, opt


def _zero1(tp_specs: dict) -> dict:
    """Optimizer state of each Megatron-split weight further split over dp, on its other dim;
    of every other weight, split over dp along dim 0."""
    out = {}
    for pattern, spec in tp_specs.items():
        dims = list(spec.dims)
        dims[dims.index(None)] = "dp"
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"state.*{pattern.removeprefix('layers.*')}.{key}"] = P(*dims)
    for key in ("exp_avg", "exp_avg_sq"):
        out[f"*norm.weight.{key}"] = P("dp")
        out[f"*embed_tokens.weight.{key}"] = P("dp", None)
        out[f"*lm_head.weight.{key}"] = P("dp", None)
    return out


def layouts(budget: int) -> dict:
    every = ("dp", "tp")
    return {
        "pure DP": dict(batch=P(every), state_specs=None, options={}),
        "ZeRO-3": dict(batch=P(every), state_specs={"*.weight": P(every)}, options={"gather_params": every}),
        "Megatron TP + DP": dict(batch=P("dp"), state_specs=LLAMA_TP, options={}),
        "Megatron TP + SP + ZeRO-1": dict(batch=P("dp"), state_specs={**LLAMA_TP, **_zero1(LLAMA_TP)}, options={},
                                          sequence_parallel=True),
        "AUTO": dict(batch=P("dp"), state_specs={"*.weight": hpfun.AUTO}, options={"memory_budget": budget}),
        "AUTO + gather_params": dict(batch=P("dp"), state_specs={"*.weight": hpfun.AUTO},
                                     options={"memory_budget": budget, "gather_params": every}),
    }


def plan(name: str, layout: dict, mesh_shape: tuple, layers: int, donate: bool = False) -> dict:
    mesh = hpfun.Mesh.simulated(mesh_shape, ("dp", "tp"))
    model, opt = _model(layers)
    if layout.get("sequence_parallel"):
        model.model.embed_tokens.register_forward_hook(lambda m, i, out: hpfun.constrain(out, P("dp", "tp", None)))

    @hpfun.shard(mesh=mesh, in_specs=(layout["batch"], layout["batch"]), out_specs=P(),
                 state_specs=layout["state_specs"], donate_state=donate, **layout["options"])
    def train_step(ids, labels):
        loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ids = torch.zeros(mesh.size, 2048, dtype=torch.long, device="meta")
    start = time.perf_counter()
    try:
        lowered = train_step.lower(ids, ids)
    except hpfun.HpfunError as err:
        print(err, flush=True)
        return {"name": name, "error": " ".join(str(err).split())[:300], "seconds": time.perf_counter() - start}
    planned = time.perf_counter() - start
    start = time.perf_counter()
    memory = lowered.memory()
    estimated = time.perf_counter() - start
    cost = lowered.cost()
    row = {"name": name, "seconds": planned, "memory_seconds": estimated, "comm_ms": cost.seconds * 1e3,
           "collectives": len(lowered.collectives), "peak": memory.peak, "held": memory.held,
           "transient": memory.transient, "wire": {a: c.wire_bytes for a, c in cost.per_axis.items()}}
    auto = getattr(lowered, "auto", None)
    if auto is not None and auto.chosen:  # one line per weight role: repeated layers get the same spec
        roles = {}
        for name, _, _, spec, *_ in auto.chosen:
            roles.setdefault(re.sub(r"\.\d+\.", ".*.", name), set()).add(spec)
        row["auto"] = "; ".join(f"{role.removeprefix('model.')}: {' / '.join(sorted(specs))}" for role, specs in roles.items())
        row["auto_solve"] = auto.seconds
    del lowered, train_step, model, opt
    gc.collect()
    return row


def table(rows: list[dict], budget: int) -> list[str]:
    lines = ["| layout | plan (s) | collectives | comm. per step (ms) | memory per rank (GiB): held + program = peak | "
             f"fits {budget / 1e9:.0f} GB |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['seconds']:.1f} | - | - | {r['error']} | - |")
            continue
        lines.append(f"| {r['name']} | {r['seconds']:.1f} (+{r['memory_seconds']:.1f} memory) | {r['collectives']} | "
                     f"{r['comm_ms']:.0f} | {r['held'] / GIB:.1f} + {r['transient'] / GIB:.1f} = {r['peak'] / GIB:.1f} | "
                     f"{'yes' if r['peak'] <= budget else 'no'} |")
    return lines


def _timed_stages() -> dict:
    """Wrap the planning stages so each call adds its seconds to the returned dict (by stage)."""
    import hpfun.api
    import hpfun.auto
    import hpfun.exact
    import hpfun.propagate
    import hpfun.solve

    spent: dict = {}
    stages = {"trace": (hpfun.api, "trace"), "greedy passes": (hpfun.propagate._Graph, "greedy"),
              "exact candidates": (hpfun.exact, "_problem"), "MILP shrink": (hpfun.solve, "_prune"),
              "MILP build": (hpfun.solve, "_build"), "HiGHS": (hpfun.solve, "_run"),
              "AUTO choose (all)": (hpfun.auto, "choose"), "lower": (hpfun.api, "lower")}
    for stage, (owner, name) in stages.items():
        fn = getattr(owner, name)

        def timed(*args, _fn=fn, _stage=stage, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_stage] = spent.get(_stage, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)
    return spent


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--meshes", nargs="+", default=["2x4", "8x8"])
    parser.add_argument("--budget-gb", type=float, default=80.0)
    parser.add_argument("--only", nargs="+", default=None,
                        help="layouts to plan, by their names in the table (default: all)")
    parser.add_argument("--donate-state", action="store_true",
                        help="plan with donate_state=True: the updated state is freed at its last use")
    parser.add_argument("--out", default=None, help="append the tables to this markdown file")
    parser.add_argument("--stages", action="store_true",
                        help="also print where each plan's time went: tracing, the greedy passes, the exact "
                             "stage's candidates, the MILP (shrinking, building, HiGHS), lowering")
    args = parser.parse_args()
    spent = _timed_stages() if args.stages else None
    budget = int(args.budget_gb * 1e9)
    if args.only and (unknown := [name for name in args.only if name not in layouts(budget)]):
        parser.error(f"--only: no layout named {', '.join(map(repr, unknown))}; the layouts are "
                     f"{', '.join(map(repr, layouts(budget)))}")
    donating = " --donate-state" if args.donate_state else ""
    out = [f"## Planning a Llama-3-8B-sized step at full scale ({args.layers} layers, meta tensors)", "",
           f"`python benchmarks/plan.py --layers {args.layers} --meshes {' '.join(args.meshes)} "
           f"--budget-gb {args.budget_gb:g}{donating}`", ""]
    for text in args.meshes:
        shape = tuple(int(n) for n in text.split("x"))
        rows = []
        for name, layout in layouts(budget).items():
            if args.only and name not in args.only:
                continue
            if spent is not None:
                spent.clear()
            row = plan(name, layout, shape, args.layers, donate=args.donate_state)
            print({k: v for k, v in row.items() if k != "auto"}, flush=True)
            if spent is not None:
                print(f"  stages of {name} on {text} (s):", ", ".join(f"{k} {v:.2f}" for k, v in spent.items()),
                      flush=True)
            rows.append(row)
        out += [f"### dp x tp = {shape[0]} x {shape[1]} ({shape[0] * shape[1]} ranks)", "", *table(rows, budget), ""]
        for r in rows:
            if r.get("auto"):
                out.append(f"AUTO chose (solver {r['auto_solve']:.1f} s of the plan): {r['auto']}.")
        out.append("")
    text = "\n".join(out)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
