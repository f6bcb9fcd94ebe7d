"""Per-step time of hpfun vs a hand-written Megatron version vs DTensor, world size 2, gloo, CPU.

    python benchmarks/overhead.py [--reps 15] [--iters 20] [--out benchmarks/RESULTS.md]

Two processes, one thread each. Parameters are split once, as a training loop holds them
(hpfun gets `Sharded` values, the hand-written version its local shards). For each workload, the three versions run forward+backward in
interleaved repetitions (a, b, c, a, b, c, ...), each repetition timing `iters` steps after a
barrier; the table reports medians. Also measured: the cost of a cache-hit call of a sharded
function beyond running its program (us) and of a first call (trace + propagate + lower, ms).
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
import torch.nn.functional as F

import hpfun
from hpfun import P

# ---------------------------------------------------------------------------------------------
# Workloads, written once in the global view (hpfun) and once per rank (hand-written, DTensor)
# ---------------------------------------------------------------------------------------------


def mlp_params(d=256, ffn=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(d, ffn, generator=g) * d**-0.5, "w2": torch.randn(ffn, d, generator=g) * ffn**-0.5}


def mlp_loss(p, x):
    return (torch.relu(x @ p["w1"]) @ p["w2"]).pow(2).mean()


MLP_SPECS = {"w1": P(None, "tp"), "w2": P("tp", None)}


def block_params(d=64, heads=4, seed=0):
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[0] ** -0.5

    return {"ln1": torch.ones(d), "wq": w(d, d), "wk": w(d, d), "wv": w(d, d), "wo": w(d, d),
            "ln2": torch.ones(d), "w1": w(d, 4 * d), "w2": w(4 * d, d)}


BLOCK_SPECS = {"ln1": P(), "wq": P(None, "tp"), "wk": P(None, "tp"), "wv": P(None, "tp"), "wo": P("tp", None),
               "ln2": P(), "w1": P(None, "tp"), "w2": P("tp", None)}


def attention(x, wq, wk, wv, wo, heads):
    b, s, _ = x.shape
    q, k, v = (t.view(b, s, heads, -1).transpose(1, 2) for t in (x @ wq, x @ wk, x @ wv))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    out = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
    return out.transpose(1, 2).reshape(b, s, -1) @ wo


def block_loss(p, x, heads=4, reduce=lambda t: t, copy=lambda t: t):
    """`reduce` and `copy` are Megatron's g and f when written by hand; identities in the global view."""
    h = x + reduce(attention(copy(F.layer_norm(x, x.shape[-1:], p["ln1"])), p["wq"], p["wk"], p["wv"], p["wo"], heads))
    h = h + reduce(torch.relu(copy(F.layer_norm(h, h.shape[-1:], p["ln2"])) @ p["w1"]) @ p["w2"])
    return h.pow(2).mean()


# ---------------------------------------------------------------------------------------------
# The three versions of a step
# ---------------------------------------------------------------------------------------------


def hpfun_step(loss_fn, specs, mesh, compile=False):
    return hpfun.shard(torch.func.grad_and_value(loss_fn), mesh=mesh, in_specs=(specs, P()), out_specs=(specs, P()),
                       compile=compile)


class _Copy(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce of the input gradient in backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _AllReduce(torch.autograd.Function):
    """Megatron's g: all-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def hand_step(loss_fn, params, specs, heads=None):
    """Local shards of the parameters and explicit all-reduces: the ideal."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = {}
    for k, v in params.items():
        entries = specs[k].dims
        dim = entries.index("tp") if "tp" in entries else None
        local[k] = (v.chunk(world, dim)[rank] if dim is not None else v).clone().requires_grad_()
    extra = {} if heads is None else {"heads": heads // world, "reduce": _AllReduce.apply, "copy": _Copy.apply}

    def step(x):
        for v in local.values():
            v.grad = None
        if heads is None:
            loss = (_AllReduce.apply(torch.relu(x @ local["w1"]) @ local["w2"])).pow(2).mean()
        else:
            loss = loss_fn(local, x, **extra)
        loss.backward()
        return loss

    return step


def dtensor_step(kind, params, device_mesh, heads=None):
    """nn.Modules parallelized with ColwiseParallel / RowwiseParallel."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = MLPModule(params) if kind == "mlp" else BlockModule(params, heads // device_mesh.size())
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if kind == "block":
        plan |= {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()}
    parallelize_module(model, device_mesh, plan)

    def step(x):
        model.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    return step


def _linear(weight):
    layer = torch.nn.Linear(weight.shape[0], weight.shape[1], bias=False)
    layer.weight.data.copy_(weight.t())
    return layer


class MLPModule(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc1, self.fc2 = _linear(p["w1"]), _linear(p["w2"])

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class BlockModule(torch.nn.Module):
    def __init__(self, p, local_heads):
        super().__init__()
        self.local_heads = local_heads
        for k in ("wq", "wk", "wv", "wo"):
            setattr(self, k, _linear(p[k]))
        self.fc1, self.fc2 = _linear(p["w1"]), _linear(p["w2"])
        self.ln1, self.ln2 = torch.nn.Parameter(p["ln1"].clone()), torch.nn.Parameter(p["ln2"].clone())

    def forward(self, x):
        b, s, d = x.shape
        y = F.layer_norm(x, (d,), self.ln1)
        q, k, v = (m(y).view(b, s, self.local_heads, -1).transpose(1, 2) for m in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
        h = x + self.wo(att.transpose(1, 2).reshape(b, s, -1))
        return h + self.fc2(torch.relu(self.fc1(F.layer_norm(h, (d,), self.ln2))))


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _time(fn, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / iters


def measure(versions: dict, reps: int, iters: int) -> dict:
    losses = {}
    for name, fn in versions.items():  # warm up, and check the three compute the same loss
        for _ in range(3):
            out = fn()
        losses[name] = (out[1].local if isinstance(out, tuple) else out).item()
    assert max(losses.values()) - min(losses.values()) <= 1e-5 * abs(losses["hand"]), losses
    times = {name: [] for name in versions}
    for _ in range(reps):
        for name, fn in versions.items():
            times[name].append(_time(fn, iters))
    return {name: statistics.median(t) for name, t in times.items()}


def call_overheads(step, args, iters: int) -> tuple[float, float]:
    """(cache-hit cost per call beyond running the program, in us; first call, in ms).

    The program's own run is timed inside the same calls (the runtime's `run` wrapped), so the
    difference carries no run-to-run noise of the collectives."""
    from hpfun.runtime.distributed import runtime_for

    fresh = hpfun.shard(step.fn, mesh=step.mesh, in_specs=step.in_specs, out_specs=step.out_specs)
    start = time.perf_counter()
    fresh(*args)
    first = time.perf_counter() - start
    runtime = runtime_for(step.mesh)
    inner, run = [0.0], runtime.run

    def timed_run(*a, **k):
        t0 = time.perf_counter()
        out = run(*a, **k)
        inner[0] += time.perf_counter() - t0
        return out

    runtime.run = timed_run
    try:
        totals = []
        for _ in range(9):
            inner[0] = 0.0
            total = _time(lambda: fresh(*args), iters)
            totals.append(total - inner[0] / iters)
    finally:
        runtime.run = run
    steady = _time(lambda: fresh(*args), iters)
    return statistics.median(totals) * 1e6, (first - steady) * 1e3


def _bind(step, x):
    return lambda: step(x)


def _presharded(params: dict, specs: dict, mesh) -> dict:
    """Parameters as a training loop holds them: this rank's shard, split once."""
    return {k: hpfun.Sharded.from_global(v, specs[k].to_layout(mesh, v.ndim)) for k, v in params.items()}


def worker(rank: int, world: int, port: int, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    mesh = hpfun.Mesh.distributed((world,), ("tp",))
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    rows = {}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 256, generator=g)
    p = _presharded(mlp_params(), MLP_SPECS, mesh)
    h_step = hpfun_step(mlp_loss, MLP_SPECS, mesh)
    h_compiled = hpfun_step(mlp_loss, MLP_SPECS, mesh, compile=True)
    rows["MLP fwd+bwd (batch 8, d 256, ffn 1024)"] = measure({
        "hpfun": lambda: h_step(p, x), "hpfun_compiled": lambda: h_compiled(p, x),
        "hand": _bind(hand_step(mlp_loss, mlp_params(), MLP_SPECS), x),
        "dtensor": _bind(dtensor_step("mlp", mlp_params(), device_mesh), x),
    }, args.reps, args.iters)
    overhead = call_overheads(h_step, (p, x), args.iters)
    xb = torch.randn(8, 16, 64, generator=g)
    pb = _presharded(block_params(), BLOCK_SPECS, mesh)
    b_step = hpfun_step(block_loss, BLOCK_SPECS, mesh)
    b_compiled = hpfun_step(block_loss, BLOCK_SPECS, mesh, compile=True)
    rows["transformer block fwd+bwd (batch 8, seq 16, d 64, 4 heads)"] = measure({
        "hpfun": lambda: b_step(pb, xb), "hpfun_compiled": lambda: b_compiled(pb, xb), "hand": _bind(hand_step(block_loss, block_params(), BLOCK_SPECS, heads=4), xb),
        "dtensor": _bind(dtensor_step("block", block_params(), device_mesh, heads=4), xb),
    }, args.reps, args.iters)
    block_overhead = call_overheads(b_step, (pb, xb), args.iters)
    if rank == 0:
        queue.put((rows, overhead, block_overhead, len(b_step.lower(pb, xb).graph.nodes)))
    dist.destroy_process_group()


def report(rows, overhead, block_overhead, block_nodes, command) -> str:
    lines = ["# Benchmarks", "", "## Per-step overhead: hpfun vs hand-written vs DTensor", "",
             f"Command: `{command}` (world size 2, gloo, CPU, one thread per rank; medians of "
             "interleaved repetitions).", "",
             "| workload | hpfun (ms) | hpfun, compile=True (ms) | hand-written (ms) | DTensor (ms) "
             "| hpfun / hand | compiled / hand | DTensor / hpfun |",
             "|---|---|---|---|---|---|---|---|"]
    for name, t in rows.items():
        lines.append(f"| {name} | {t['hpfun'] * 1e3:.3f} | {t['hpfun_compiled'] * 1e3:.3f} | {t['hand'] * 1e3:.3f} "
                     f"| {t['dtensor'] * 1e3:.3f} | {t['hpfun'] / t['hand']:.3f} | {t['hpfun_compiled'] / t['hand']:.3f} "
                     f"| {t['dtensor'] / t['hpfun']:.2f} |")
    lines += ["", "| sharded-function call | MLP | transformer block |", "|---|---|---|",
              f"| cache hit, beyond running the program (us) | {overhead[0]:.1f} | {block_overhead[0]:.1f} |",
              f"| first call: trace + propagate + lower (ms) | {overhead[1]:.0f} | {block_overhead[1]:.0f} |",
              "", f"The block's per-shard program has {block_nodes} nodes."]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the table to this markdown file")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(2, port, args, queue), nprocs=2)
    text = report(*queue.get(), command="python " + " ".join(sys.argv))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
