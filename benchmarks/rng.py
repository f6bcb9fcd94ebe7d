"""Throughput of hpfun's counter-based generator against torch's native one, CPU.

    python benchmarks/rng.py [--n 16777216] [--threads 1] [--reps 7] [--out FILE]

Times, side by side in one run (interleaved repetitions, medians): torch.rand, the Philox
kernel compiled once (the path large draws take), the same Philox code run eagerly, and a
whole sharded function drawing `torch.rand(n)` on a one-rank mesh.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import hpfun
from hpfun import rng
from hpfun.rules.random import sample


def _median_time(fn, reps: int) -> dict:
    return statistics.median(_once(fn) for _ in range(reps))


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None, help="append the table to this markdown file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.n
    index = torch.arange(n, dtype=torch.int64)
    seed = torch.tensor([1234], dtype=torch.int64)
    mesh = hpfun.Mesh.simulated((1,), ("dp",))
    draw = hpfun.shard(lambda: torch.rand(n), mesh=mesh, in_specs=())

    start = time.perf_counter()
    sample("rand", index, seed, 1, torch.float32, 0.0, 1.0)  # compiles the kernel once
    compile_s = time.perf_counter() - start
    eager = rng.words(index[: 1 << 20], seed, 1)  # eager: time on 1/16th, scaled below
    assert torch.equal(rng.uniform(eager, torch.float32), sample("rand", index, seed, 1, torch.float32, 0.0, 1.0)[: 1 << 20])
    draw()

    cases = {
        "torch.rand (native)": lambda: torch.rand(n),
        "hpfun Philox, compiled kernel": lambda: sample("rand", index, seed, 1, torch.float32, 0.0, 1.0),
        "hpfun sharded function drawing torch.rand(n)": lambda: draw(),
        "hpfun Philox, eager (timed on n/16, x16)": lambda: rng.uniform(rng.words(index[: n // 16], seed, 1), torch.float32),
    }
    times = {name: [] for name in cases}
    for _ in range(args.reps):
        for name, fn in cases.items():
            times[name].append(_once(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    med["hpfun Philox, eager (timed on n/16, x16)"] *= 16
    native = med["torch.rand (native)"]
    lines = ["", "## Random numbers: hpfun's Philox vs torch's native generator", "",
             f"Command: `python {' '.join(sys.argv)}` ({n:,} float32 values, {args.threads} thread(s), "
             f"medians of {args.reps} interleaved repetitions; kernel compiled once in {compile_s:.1f} s).", "",
             "| generator | time (ms) | values/s | x native |", "|---|---|---|---|"]
    for name, t in med.items():
        lines.append(f"| {name} | {t * 1e3:.1f} | {n / t / 1e6:.0f} M | {t / native:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
