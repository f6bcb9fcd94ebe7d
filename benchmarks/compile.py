"""What a sharded function's first call costs, stage by stage, on a simulated mesh, CPU.

    python benchmarks/compile.py [--reps 5] [--depths 2 4 8 16 32] [--out FILE]

For each workload, a fresh `hpfun.shard` is lowered `--reps` times (trace, fold, propagate,
lower; nothing runs) and the median time of each stage is reported: capture (make_fx on fake
tensors) plus folding, propagation (greedy passes, the minimum cut of Partial resolutions and
the look-ahead rounds), and lowering to the per-shard program. The depth sweep also times plain
`make_fx` of the same step (the floor capture is compared with) and, at `--exact-depths`,
propagation with `solver="exact"`.

Then the reference GPT's AdamW step (d 64, 4 heads, vocab 256, 16 tokens, Megatron TP on a 2x2
dp x tp mesh) at each of `--depths` layers, with the per-layer slope of each stage (least
squares); and a Llama-3-8B-sized step (32 layers, d 4096, GQA 32/8 heads, MLP 14336, vocab
128256, bfloat16, AdamW through `loss.backward(); opt.step()`) on meta tensors, dp x tp = 8 x 8,
Megatron TP: planned and priced without allocating its 8 billion parameters.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

import hpfun
import hpfun.api
from hpfun import P
from hpfun.testing.models import LLAMA_TP, adamw_init, gpt_data, gpt_init, gpt_specs, gpt_step, llama3_8b

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (the transformer block of the overhead benchmark)

STAGES = {"capture": ("trace", "fold_contractions"), "propagate": ("propagate",), "lower": ("lower",)}


def _timed_stages() -> dict:
    """Wrap hpfun.api's stage functions so each call adds its time to the returned dict."""
    spent = {stage: 0.0 for stage in STAGES}
    for stage, names in STAGES.items():
        for name in names:
            fn = getattr(hpfun.api, name)

            def timed(*args, _fn=fn, _stage=stage, **kwargs):
                start = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    spent[_stage] += time.perf_counter() - start

            setattr(hpfun.api, name, timed)
    return spent


def _workloads() -> dict:
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    xb, pb = torch.randn(8, 16, 64), overhead.block_params()
    params, (idx, targets) = gpt_init(), gpt_data(4)

    def gpt(which, seq_split=None):
        specs = gpt_specs(params, **which)
        state = {"m": specs, "v": specs, "step": P()}
        step = hpfun.shard(gpt_step, mesh=mesh, in_specs=(specs, state, P(), P(), None), out_specs=(specs, state, P()))
        return step, (params, adamw_init(params), idx, targets, seq_split)

    return {
        "transformer block fwd+bwd, Megatron TP (tp=2)":
            lambda: (overhead._grad_step(overhead.block_loss, overhead.BLOCK_SPECS, mesh, 1), (pb, xb)),
        "GPT AdamW step, vocab-parallel (tp=2)": lambda: gpt({"vocab": "tp"}),
        "GPT AdamW step, TP + sequence parallel (tp=2)": lambda: gpt({"tp": "tp"}, P(None, "tp")),
    }


def _make_fx_seconds(params, state, idx, targets) -> float:
    """Plain make_fx of the same step on fake tensors (no decompositions, no stack traces): the
    floor capture is compared with."""
    from torch.fx.experimental.proxy_tensor import make_fx

    start = time.perf_counter()
    make_fx(lambda p, s, i, t: gpt_step(p, s, i, t), tracing_mode="fake")(params, state, idx, targets)
    return time.perf_counter() - start


def _depth_sweep(depths, reps, spent, exact_depths=()) -> list[str]:
    mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    sizes = {"d": 64, "heads": 4, "vocab": 256, "seq": 16}
    lines = ["", "### By depth: the reference GPT AdamW step, Megatron TP on dp x tp = 2 x 2", "",
             "| layers | make_fx (s) | capture + fold (s) | propagate (s) | lower (s) | total (s) "
             "| (propagate + lower) / capture | capture / make_fx | propagate, solver=\"exact\" (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for layers in depths:
        params = gpt_init(layers=layers, **sizes)
        idx, targets = gpt_data(4, **sizes)
        specs = gpt_specs(params, tp="tp")
        state = {"m": specs, "v": specs, "step": P()}
        times = {stage: [] for stage in STAGES} | {"make_fx": [], "exact": []}
        for _ in range(reps):  # interleaved: plain make_fx, then hpfun's stages, then the exact solver
            times["make_fx"].append(_make_fx_seconds(params, adamw_init(params), idx, targets))
            for solver in ("greedy", "exact") if layers in exact_depths else ("greedy",):
                step = hpfun.shard(gpt_step, mesh=mesh, in_specs=(specs, state, P("dp"), P("dp"), None),
                                   out_specs=(specs, state, P()), solver=solver)
                for stage in spent:
                    spent[stage] = 0.0
                step.lower(params, adamw_init(params), idx, targets, None)
                if solver == "exact":
                    times["exact"].append(spent["propagate"])
                    continue
                for stage in STAGES:
                    times[stage].append(spent[stage])
        med = {stage: statistics.median(t) for stage, t in times.items() if t}
        rows.append((layers, med))
        exact = f"{med['exact']:.2f}" if "exact" in med else "-"
        lines.append(f"| {layers} | {med['make_fx']:.2f} | {med['capture']:.2f} | {med['propagate']:.2f} | "
                     f"{med['lower']:.2f} | {sum(med[s] for s in STAGES):.2f} | "
                     f"{(med['propagate'] + med['lower']) / med['capture']:.2f} | {med['capture'] / med['make_fx']:.2f} "
                     f"| {exact} |")
    if len(rows) > 1:
        xs = [layers for layers, _ in rows]
        slopes = {stage: _slope(xs, [med[stage] for _, med in rows]) for stage in (*STAGES, "make_fx")}
        lines += ["", "Per layer (least-squares slope): " + ", ".join(f"{stage} {slopes[stage] * 1e3:.0f} ms"
                                                                    for stage in (*STAGES, "make_fx"))
                  + f"; hpfun's total {sum(slopes[s] for s in STAGES) * 1e3:.0f} ms."]
    return lines


def _slope(xs, ys) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _llama_8b(spent, layers: int = 32) -> list[str]:
    """A Llama-3-8B-sized training step on meta tensors, planned on dp x tp = 8 x 8."""
    model = llama3_8b(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    mesh = hpfun.Mesh.simulated((8, 8), ("dp", "tp"))

    @hpfun.shard(mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P(), state_specs=LLAMA_TP)
    def train_step(ids, labels):
        loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ids = torch.zeros(8, 2048, dtype=torch.long, device="meta")  # 1 sequence of 2048 tokens per dp rank
    for stage in spent:
        spent[stage] = 0.0
    start = time.perf_counter()
    lowered = train_step.lower(ids, ids)
    total = time.perf_counter() - start
    cost = lowered.cost()
    kinds = collections.Counter(c.kind for c in lowered.collectives)
    per_axis = ", ".join(f"{axis} {c.bytes / 2**30:.2f} GiB" for axis, c in cost.per_axis.items())
    return ["", f"### Llama-3-8B-sized step on meta tensors ({layers} layers, dp x tp = 8 x 8, Megatron TP, AdamW)", "",
            f"Planned in {total:.1f} s (capture + fold {spent['capture']:.1f} s, propagate {spent['propagate']:.1f} s, "
            f"lower {spent['lower']:.1f} s), nothing allocated. {len(lowered.collectives)} collectives "
            f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}); bytes per rank: {per_axis}; "
            f"predicted communication time (alpha-beta model) {cost.seconds * 1e3:.0f} ms per step."]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None, help="append the table to this markdown file")
    parser.add_argument("--depths", type=int, nargs="*", default=[2, 4, 8, 16, 32])
    parser.add_argument("--llama-layers", type=int, default=32, help="0 skips the meta-tensor Llama-3-8B plan")
    parser.add_argument("--exact-depths", type=int, nargs="*", default=[2, 4, 8],
                        help="depths at which solver='exact' is timed too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spent = _timed_stages()
    rows = {}
    for name, make in _workloads().items():
        times = {stage: [] for stage in STAGES}
        for _ in range(args.reps):
            step, call_args = make()
            for stage in spent:
                spent[stage] = 0.0
            lowered = step.lower(*call_args)
            for stage in STAGES:
                times[stage].append(spent[stage])
        rows[name] = ({stage: statistics.median(t) for stage, t in times.items()}, len(lowered.graph.nodes))
    lines = ["", "## First call: trace, propagate, lower", "",
             f"Command: `python {' '.join(sys.argv)}` (simulated mesh, 1 thread, medians of {args.reps}).", "",
             "| workload | capture + fold (ms) | propagate (ms) | lower (ms) | total (ms) | per-shard nodes |",
             "|---|---|---|---|---|---|"]
    for name, (med, nodes) in rows.items():
        lines.append(f"| {name} | {med['capture'] * 1e3:.0f} | {med['propagate'] * 1e3:.0f} | {med['lower'] * 1e3:.0f} "
                     f"| {sum(med.values()) * 1e3:.0f} | {nodes} |")
    if args.depths:
        lines += _depth_sweep(args.depths, args.reps, spent, set(args.exact_depths))
    if args.llama_layers:
        lines += _llama_8b(spent, args.llama_layers)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
