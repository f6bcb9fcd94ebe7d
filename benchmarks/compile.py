"""What a sharded function's first call costs, stage by stage, on a simulated mesh, CPU.

    python benchmarks/compile.py [--reps 5] [--out FILE]

For each workload, a fresh `hpfun.shard` is lowered `--reps` times (trace, fold, propagate,
lower; nothing runs) and the median time of each stage is reported: capture (make_fx on fake
tensors) plus folding, propagation (greedy passes, the minimum cut of Partial resolutions and
the look-ahead rounds), and lowering to the per-shard program.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import hpfun
import hpfun.api
from hpfun import P
from hpfun.testing.models import adamw_init, gpt_data, gpt_init, gpt_specs, gpt_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (the transformer block of the overhead benchmark)

STAGES = {"capture": ("capture", "fold_contractions"), "propagate": ("propagate",), "lower": ("lower",)}


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
            lambda: (overhead.hpfun_step(overhead.block_loss, overhead.BLOCK_SPECS, mesh), (pb, xb)),
        "GPT AdamW step, vocab-parallel (tp=2)": lambda: gpt({"vocab": "tp"}),
        "GPT AdamW step, TP + sequence parallel (tp=2)": lambda: gpt({"tp": "tp"}, P(None, "tp")),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None, help="append the table to this markdown file")
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
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
