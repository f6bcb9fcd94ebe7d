"""What donation saves, measured in a real two-process gloo job on this machine.

Each rank runs a stock training step (`loss.backward()`, `torch.optim.AdamW.step()`,
`zero_grad()`) on a module hpfun lifts, with and without `donate_state=True`, and a functional
AdamW step (parameters and state in, new ones out, handed back at the next call), with and
without `donate_argnums=(0, 1)`, data parallel over 2 ranks, and samples its own resident
memory (`/proc/self/statm`) every 0.5 ms during the third call: the rise over the level before
the call is what the call added. It prints that beside hpfun's estimate of what the program
allocates on top of its inputs (`lower().memory().transient`), with and without donation,
interleaved, `--repeats` times. The ranks start with glibc's mmap threshold lowered, so that
freed tensors go back to the system and the resident size follows the live tensors.

    python benchmarks/donate.py [--width 2048] [--layers 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _functional(mesh, model, donate: bool):
    """The functional step: parameters and AdamW's state in, new ones out (hpfun's reference
    AdamW written in torch ops), the caller handing them back."""
    import hpfun
    from hpfun import P
    from hpfun.testing.models import adamw

    def loss_fn(params, x, y):
        return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    @hpfun.shard(mesh=mesh, in_specs=(None, None, P("dp"), P("dp")), out_specs=(None, None, P()),
                 donate_argnums=(0, 1) if donate else ())
    def step(params, state, x, y):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        return *adamw(params, grads, state), loss

    return step


def _rank(rank: int, port: int, donate: bool, width: int, layers: int, queue, kind: str = "module") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import hpfun
    from hpfun import P

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=120)
    x, y = torch.randn(16, width), torch.randn(16, width)
    if kind == "functional":
        from hpfun.testing.models import adamw_init

        fstep = _functional(mesh, model, donate)
        params = {k: p.detach() for k, p in model.named_parameters()}
        carry = list(fstep(params, adamw_init(params), x, y)[:2])
        carry[:] = fstep(*carry, x, y)[:2]
        del params
        estimate = fstep.lower(*carry, x, y).memory()

        def step(x, y):
            carry[:] = fstep(*carry, x, y)[:2]  # the call's results replace what it consumed
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

        @hpfun.shard(mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P(), donate_state=donate)
        def step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        step(x, y)
        step(x, y)  # AdamW's state exists from the first call, the second reads it like every later one
        estimate = step.lower(x, y).memory()
    before = _rss()
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    step(x, y)
    done.set()
    sampler.join()
    queue.put((rank, peak[0] - before, estimate.transient, estimate.held, estimate.donated))
    torch.distributed.destroy_process_group()


def run(donate: bool, width: int, layers: int, kind: str = "module") -> list[tuple]:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, donate, width, layers, queue, kind)) for r in range(2)]
    for p in procs:
        p.start()
    out = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    # read by glibc when each rank's process starts: tensors freed go back to the system at once
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    print(f"`python benchmarks/donate.py --width {args.width} --layers {args.layers} --repeats {args.repeats}`\n")
    print("| run | step | donated | rank | held by the inputs (MB, estimate) | resident memory added by the call "
          "(MB, measured) | allocated by the program (MB, estimate) |")
    print("|---|---|---|---|---|---|---|")
    for i in range(args.repeats):
        for kind, option in (("module + AdamW", "donate_state"), ("functional AdamW", "donate_argnums")):
            for donate in (False, True):
                for rank, rise, transient, held, _ in run(donate, args.width, args.layers, kind.split()[0]):
                    print(f"| {i + 1} | {kind} | {option + '=' + ('yes' if donate else 'no')} | {rank} | "
                          f"{held / 1e6:.0f} | {rise / 1e6:.0f} | {transient / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
