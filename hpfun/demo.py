"""Train a small model data x tensor parallel on a (2, 2) mesh, beside the unsharded run.

    python -m hpfun.demo [--steps 20]                                   # functional MLP, simulated mesh
    python -m hpfun.demo --module [--steps 20]                          # an nn.Module with AdamW
    torchrun --nproc-per-node 4 -m hpfun.demo --distributed             # 4 processes, gloo
    torchrun --nproc-per-node 4 -m hpfun.demo --module --distributed

The default trains a functional MLP: parameters in a dict, `torch.func.grad_and_value`, an SGD
update written out, parameters passed in and returned. `--module` trains an `nn.Module` with
`torch.optim.AdamW` through the stock step, `loss.backward(); opt.step(); opt.zero_grad()`:
hpfun lifts the state the step reads (the module's parameters, AdamW's moments and step counts)
into the program, split by name patterns, and writes the updates back into the module and the
optimizer after each call.
On a distributed mesh the lifted state stays sharded between calls; `hpfun.gather_state`
brings it back whole for the comparison.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F

import hpfun
from hpfun import P
from hpfun.testing.models import MEGATRON, mlp_data, mlp_init, mlp_step

MESH_SHAPE, MESH_AXES = (2, 2), ("dp", "tp")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpfun.demo", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--batch", type=int, default=32, help="examples per step, split over dp (default 32)")
    parser.add_argument("--module", action="store_true",
                        help="train an nn.Module with torch.optim.AdamW through the stock training step")
    parser.add_argument("--distributed", action="store_true", help="run under torchrun, one process per rank")
    args = parser.parse_args(argv)
    size = math.prod(MESH_SHAPE)
    if args.distributed and os.environ.get("WORLD_SIZE", str(size)) != str(size):
        parser.error(f"the demo's mesh is {MESH_SHAPE} {MESH_AXES}: launch it with torchrun --nproc-per-node {size} "
                     f"(this job has {os.environ['WORLD_SIZE']} processes)")

    if args.distributed:
        torch.set_num_threads(1)
        mesh = hpfun.Mesh.distributed(MESH_SHAPE, MESH_AXES)
        is_first = torch.distributed.get_rank() == 0
    else:
        mesh = hpfun.Mesh.simulated(MESH_SHAPE, MESH_AXES)
        is_first = True
    say = print if is_first else (lambda *a, **k: None)
    (module_demo if args.module else functional_demo)(mesh, args, say)
    if args.distributed:
        torch.distributed.destroy_process_group()


def _show_collectives(lowered, say) -> None:
    say(f"collectives per step ({len(lowered.collectives)}):")
    for c in lowered.collectives:
        say(f"  {c.kind:<10} over {','.join(c.axes):<6} {c.bytes:>6} B  for {c.node}: {c.reason}")


def _loss_header(say) -> None:
    say(f"\n{'step':>4}  {'loss (sharded)':>15}  {'loss (unsharded)':>16}  {'|diff|':>9}")


def _loss_row(say, i: int, value: float, ref: float) -> None:
    say(f"{i:>4}  {value:>15.6f}  {ref:>16.6f}  {abs(value - ref):>9.2e}")


# ---------------------------------------------------------------------------------------------
# The functional MLP: parameters in, parameters out
# ---------------------------------------------------------------------------------------------


def functional_demo(mesh: hpfun.Mesh, args, say) -> None:
    step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(MEGATRON, P("dp"), P("dp")), out_specs=(MEGATRON, P()))
    params = mlp_init(16, 64, 8)
    x, y = mlp_data(args.batch, 16, 8)

    start = time.perf_counter()
    lowered = step.lower(params, x, y)
    say(f"mesh {mesh} ({mesh.runtime}): data parallel over dp, Megatron tensor parallel over tp "
        f"(compiled in {time.perf_counter() - start:.2f} s)")
    _show_collectives(lowered, say)
    _loss_header(say)
    sharded, reference = params, params
    for i in range(args.steps):
        sharded, loss = step(sharded, x, y)
        reference, ref_loss = mlp_step(reference, x, y)
        _loss_row(say, i, loss.full().item(), ref_loss.item())
    worst = max((sharded[k].full() - reference[k]).abs().max().item() for k in params)
    say(f"\nafter {args.steps} steps: max |param difference| = {worst:.2e}; traced {step.trace_count} time(s)")


# ---------------------------------------------------------------------------------------------
# An nn.Module and torch.optim.AdamW: the stock training step, state lifted by name
# ---------------------------------------------------------------------------------------------


class MLP(torch.nn.Module):
    """A layer norm, then two linear layers with a GELU between them."""

    def __init__(self, d_in: int = 16, d_hidden: int = 64, n_classes: int = 8):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d_in)
        self.up = torch.nn.Linear(d_in, d_hidden)
        self.down = torch.nn.Linear(d_hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


# Megatron by parameter name: nn.Linear keeps its weight as (out, in), so the column-parallel
# `up` splits its weight's dim 0 (and its bias), the row-parallel `down` its weight's dim 1.
# Everything else (the norm, down.bias) is replicated; gradients and AdamW's state follow.
MLP_PLAN = {"up.weight": P("tp", None), "up.bias": P("tp"), "down.weight": P(None, "tp")}


def module_train_step(model: torch.nn.Module, opt: torch.optim.Optimizer):
    """The training step as PyTorch users write it; it reads `model` and `opt` from its closure."""

    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return train_step


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def module_demo(mesh: hpfun.Mesh, args, say) -> None:
    model, opt = _model_and_optimizer()
    ref_model, ref_opt = _model_and_optimizer()  # an identical copy, trained unsharded
    step = hpfun.shard(module_train_step(model, opt), mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P(),
                       state_specs=MLP_PLAN)
    ref_step = module_train_step(ref_model, ref_opt)
    x, y = mlp_data(args.batch, 16, 8)

    say(f"mesh {mesh} ({mesh.runtime}): an nn.Module trained with AdamW, data parallel over dp, "
        f"Megatron over tp by name: {', '.join(MLP_PLAN)}")
    _loss_header(say)
    for i in range(args.steps):
        start = time.perf_counter()
        value = step(x, y).full().item()
        _loss_row(say, i, value, ref_step(x, y).item())
        if i == 0:  # AdamW made its state in the first call; from here on one program serves every step
            _show_lifted(step.lower(x, y), say, time.perf_counter() - start)
            _loss_header(say)
    if mesh.runtime == "distributed":
        say(f"\nbetween calls this process's model.up.weight holds its block, {list(model.up.weight.shape)} of "
            f"{list(ref_model.up.weight.shape)}; hpfun.gather_state(model) gathers the whole")
    params = hpfun.gather_state(model)  # whole again on a distributed mesh (a collective)
    worst = max((params[k] - v).abs().max().item() for k, v in ref_model.state_dict().items())
    say(f"\nafter {args.steps} steps: max |param difference| = {worst:.2e}; traced {step.trace_count} time(s)")


def _show_lifted(lowered, say, seconds: float) -> None:
    say(f"\nstep 0 traced the step and ran it, and AdamW made its state; the program for the later steps reads "
        f"that state too (both traces: {seconds:.2f} s). Its inputs:")
    inputs = lowered.to_dict()["inputs"]
    width = max(len(i["path"]) for i in inputs)
    for i in inputs:
        say(f"  {i['path']:<{width}}  {i['dtype']:<7}  global {str(i['shape']):<8}  {i['layout']:<9}  "
            f"local {i['local_shape']}")
    _show_collectives(lowered, say)


if __name__ == "__main__":
    main()
