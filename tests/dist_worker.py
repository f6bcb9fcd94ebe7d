"""One rank of a multi-process test job (launched by tests/test_distributed.py).

    python tests/dist_worker.py SCENARIO OUT_DIR      # with RANK, WORLD_SIZE, MASTER_* set
"""

import collections
import copy
import os
import sys
import types
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import hpfun
from hpfun import P
from hpfun.testing.models import MLP_LAYOUTS, mlp_data, mlp_init, mlp_step

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
TIMEOUT = float(os.environ.get("HPFUN_TEST_TIMEOUT", "20"))


def mlp_layouts_for_world():
    if WORLD == 4:
        return [("dp_tp", (2, 2), ("dp", "tp")), ("dp_class", (2, 2), ("dp", "tp")), ("tp", (4,), ("tp",))]
    return [("dp", (2,), ("dp",)), ("tp", (2,), ("tp",)), ("class", (2,), ("tp",))]


def run_mlp(out: Path, compile: bool = False):
    """Two steps of every MLP layout; rank r saves its shards and the gathered results."""
    params, (x, y) = mlp_init(), mlp_data()
    for name, shape, axes in mlp_layouts_for_world():
        mesh = hpfun.Mesh.distributed(shape, axes, timeout=TIMEOUT)
        pspec, xspec, yspec = MLP_LAYOUTS[name]
        step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()), compile=compile)
        new, loss = step(params, x, y)
        new, loss = step(new, x, y)  # Sharded inputs: this rank's shards only
        shards = {k: v.local for k, v in new.items()} | {"loss": loss.local}
        full = {k: v.full() for k, v in new.items()} | {"loss": loss.full()}
        torch.save({"shards": shards, "full": full, "traces": step.trace_count}, out / f"{name}-rank{RANK}.pt")


def compile_small(out: Path):
    """compile=True on the tensor-parallel MLP step equals the uncompiled program."""
    params, (x, y) = mlp_init(), mlp_data()
    mesh = hpfun.Mesh.distributed((2,), ("tp",), timeout=120)
    pspec, xspec, yspec = MLP_LAYOUTS["tp"]
    results = {}
    for compile in (False, True):
        step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()), compile=compile)
        new, loss = step(params, x, y)
        results[compile] = {k: v.local for k, v in new.items()} | {"loss": loss.local}
    torch.save(results, out / f"compile-rank{RANK}.pt")


def adopt_and_local(out: Path):
    """A user-built DeviceMesh adopted, inputs given as this rank's shards: same as global inputs."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.distributed.init_process_group("gloo")
    mesh = hpfun.Mesh.from_device_mesh(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    params, (x, y) = mlp_init(), mlp_data()
    pspec, xspec, yspec = MLP_LAYOUTS["tp"]
    step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()))
    local = {}
    for k, v in params.items():
        layout = pspec[k].to_layout(mesh, v.ndim)
        block = hpfun.Sharded.from_global(v, layout).local  # what a rank would load from its checkpoint
        # its text, as a user writes it ("[S(0)] on {tp: 2}"): read on the mesh this process started
        local[k] = hpfun.Sharded.from_local(block.clone(), str(layout), v.shape)
    new_local, loss_local = step(local, x, y)
    new_global, loss_global = step(params, x, y)
    same = all(torch.equal(new_local[k].local, new_global[k].local) for k in params)
    torch.save({"same": same, "loss": loss_local.full(), "traces": step.trace_count}, out / f"adopt-rank{RANK}.pt")


def rank_raises(out: Path):
    """Rank 1 raises in user code before the step; rank 0 must fail, not hang."""
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT)
    step = hpfun.shard(lambda x: (x * 2).sum(0), mesh=mesh, in_specs=P("dp"), out_specs=P())
    if RANK == 1:
        raise RuntimeError("user code failed on rank 1")
    _record_error(out, lambda: step(torch.randn(8, 4)))


def own_collective(out: Path):
    """The step calls torch.distributed.all_reduce itself (DDP-style code): refused at its line,
    no collective run; the script catches the error and ends without destroying the process
    group, as most scripts do, and exits 0 (it aborted: gloo's threads at the interpreter's exit)."""
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT)

    def reduced(x):
        g = x.sum(0)
        torch.distributed.all_reduce(g)
        return g

    held = torch.distributed.all_reduce  # a library's own reference (vector-quantize-pytorch keeps one)

    def by_reference(x):
        g = x.sum(0)
        held(g)
        return g

    def functional(x):
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x.sum(0), "sum", torch.distributed.group.WORLD)

    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def training(x):  # (stepping an optimizer, the step is traced under another mode too: the reference's call
        loss = lin(x).pow(2).mean()  # was seen from hpfun's frame and let through, then said to be a random draw)
        held(x.sum(0).detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    works = hpfun.shard(lambda x: x.sum(0), mesh=mesh, in_specs=P("dp"), out_specs=P())(torch.ones(8, 4)).full()
    messages = []
    for fn in (reduced, by_reference, functional, training):
        try:
            hpfun.shard(fn, mesh=mesh, in_specs=P("dp"), out_specs=P())(torch.randn(8, 4))
            messages.append("NO ERROR")
        except hpfun.CaptureError as err:
            messages.append(str(err))
    torch.save({"error": messages[0], "by reference": messages[1], "functional": messages[2], "training": messages[3],
                "before": works},
               out / f"own_collective-rank{RANK}.pt")


def rank_dies(out: Path):
    """Rank 1 dies between two steps; rank 0's second step must fail, not hang."""
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT)
    step = hpfun.shard(lambda x: (x * 2).sum(0), mesh=mesh, in_specs=P("dp"), out_specs=P())
    step(torch.randn(8, 4))
    if RANK == 1:
        os._exit(3)
    _record_error(out, lambda: step(torch.randn(8, 4)))


def rank_stalls(out: Path):
    """Rank 1 stays alive but never joins the step; rank 0 must fail once the timeout passes."""
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT)
    step = hpfun.shard(lambda x: (x * 2).sum(0), mesh=mesh, in_specs=P("dp"), out_specs=P())
    step(torch.randn(8, 4))
    if RANK == 1:
        time.sleep(4 * TIMEOUT)
        os._exit(0)
    _record_error(out, lambda: step(torch.randn(8, 4)) and step(torch.randn(4, 4)))


# -- lifted state: modules and optimizers the step reads without being given them ---------------

MEGATRON = {"0.weight": P("tp", None), "0.bias": P("tp"), "2.weight": P(None, "tp")}  # 2.bias replicated
BLOCK_SHAPES = {"0.weight": (8, 8), "0.bias": (8,), "2.weight": (4, 8), "2.bias": (4,)}  # a rank's, tp=2
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "sgd_foreach": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True),
    "sgd_loop": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False),
    "adamw_cosine": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),  # stepped by a scheduler
    "nested": lambda params: NestedMomentum(params),
}


class PerParameter(torch.optim.Optimizer):
    """An optimizer of the user's, lr 0.1, updating each parameter with its state (`update`)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                self.update(p, self.state[p], group["lr"])


class NestedMomentum(PerParameter):
    """Momentum kept in a dict and a list under each parameter, made by its first step."""

    def update(self, p, st, lr):
        if "bufs" not in st:
            st["bufs"] = {"fast": torch.zeros_like(p), "slow": torch.zeros_like(p)}
            st["log"] = [torch.zeros_like(p)]
        st["bufs"]["fast"].mul_(0.5).add_(p.grad)
        st["bufs"]["slow"].mul_(0.9).add_(p.grad)
        st["log"][0].add_(p.grad)
        p.sub_(lr * (st["bufs"]["fast"] + st["bufs"]["slow"] + 0.1 * st["log"][0]))


def state_tensors(entries: dict) -> dict:
    """A parameter's optimizer state by key, a dict's or list's tensors as `key.item`."""
    out = {}
    for key, v in entries.items():
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else [(None, v)]
        out |= {key if i is None else f"{key}.{i}": t for i, t in items}
    return out
STEPS = 3


def schedule(name: str, opt):
    """The learning-rate scheduler a run of OPTIMIZERS[name] steps after each of its STEPS, or None."""
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4) if name.endswith("_cosine") else None


def lifted_model(batchnorm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    norm = [torch.nn.BatchNorm1d(16)] if batchnorm else []
    return torch.nn.Sequential(torch.nn.Linear(8, 16), *norm, torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()


def lifted_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, dtype=torch.float64, generator=g), torch.randint(0, 4, (8,), generator=g)


def eager_step(model, opt, x, y):
    """The stock step, unsharded: what every sharded run is compared with."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def sharded_step(mesh, model, opt, in_specs, state_specs):
    """The stock step, reading `model` and `opt` from its closure."""
    @hpfun.shard(mesh=mesh, in_specs=in_specs, out_specs=P(), state_specs=state_specs)
    def train_step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return train_step


def _held_shapes(model, opt) -> dict:
    """What each rank holds between calls: parameters' and optimizer state's shapes."""
    names = {id(p): k for k, p in model.named_parameters()}
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for p, entries in opt.state.items():
        shapes |= {f"{names[id(p)]}.{key}": tuple(v.shape) for key, v in state_tensors(entries).items() if v.ndim}
    shapes["grads"] = [p.grad for p in model.parameters()].count(None)
    shapes["same parameters"] = all(p is q for p, q in zip(model.parameters(), opt.param_groups[0]["params"], strict=True))
    return shapes


def lifted(out: Path):
    """The stock step on a (2, 2) dp x tp mesh, per optimizer: STEPS sharded steps, the state
    gathered, put back whole in place, one eager step on it, then one more sharded step."""
    mesh = hpfun.Mesh.distributed((2, 2), ("dp", "tp"), timeout=TIMEOUT)
    x, y = lifted_data()
    results = {}
    for name, make in OPTIMIZERS.items():
        model = lifted_model()
        opt = make(model.parameters())
        step = sharded_step(mesh, model, opt, (P("dp"), P("dp")), MEGATRON)
        scheduler = schedule(name, opt)
        losses, held = [], []
        for _ in range(STEPS):
            losses.append(step(x, y).full())
            held.append(_held_shapes(model, opt))
            if scheduler is not None:
                scheduler.step()
        got = {"losses": losses, "held": held, "traces": step.trace_count,
               "model": _snapshot(hpfun.gather_state(model)), "opt": _snapshot(hpfun.gather_state(opt)["state"])}
        hpfun.gather_state(model, inplace=True)
        hpfun.gather_state(opt, inplace=True)
        got["whole"] = _held_shapes(model, opt)
        losses.append(eager_step(model, opt, x, y))  # the module runs unsharded again
        losses.append(step(x, y).full())  # and sharded again, from whole state: no new trace
        got |= {"final": hpfun.gather_state(model), "final traces": step.trace_count}
        results[name] = got
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    row = device_mesh.get_coordinate()[0]  # each dp row sums its own data over its tp pair
    rows = hpfun.Mesh.from_device_mesh(device_mesh["tp"])
    data = torch.arange(32, dtype=torch.float64).reshape(8, 4) + 1000 * row
    summed = hpfun.shard(lambda x: x.sum(0), mesh=rows, in_specs=P("tp"), out_specs=P())
    results["sub-mesh"] = {"got": summed(data).full(), "want": data.sum(0),
                           "timeout": _error(lambda: hpfun.Mesh.from_device_mesh(device_mesh["tp"], timeout=5))}
    torch.save(results, out / f"lifted-rank{RANK}.pt")


class TupleMomentum(PerParameter):
    """Two momentum buffers per parameter kept as a tuple its step rebuilds (SPlus keeps a list)."""

    def update(self, p, st, lr):
        fast, slow = st.get("bufs", (torch.zeros_like(p), torch.zeros_like(p)))
        st["bufs"] = (fast * 0.5 + p.grad, slow * 0.9 + p.grad)
        p.sub_(lr * (st["bufs"][0] + st["bufs"][1]))


class SharedMomentum(PerParameter):
    """Keeps one buffer under two keys of each parameter's state (`st["m"] = st["m2"]`)."""

    def update(self, p, st, lr):
        if not st:
            st["m"] = st["m2"] = torch.zeros_like(p)
        st["m"].mul_(0.9).add_(p.grad)
        st["m2"].add_(0.01)
        p.sub_(lr * st["m"])


def lifted_dp(out: Path):
    """World 2: BatchNorm's running statistics under data parallel; ranks whose arguments and
    state differ; a mesh of the wrong size."""
    mesh = hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT)
    x, y = lifted_data()
    model = lifted_model(batchnorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = sharded_step(mesh, model, opt, (P("dp"), P("dp")), None)
    losses = [step(x, y).full() for _ in range(STEPS)]
    got = {"losses": losses, "model": _snapshot(hpfun.gather_state(model))}
    synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(lifted_model(batchnorm=True))  # (it refused a CPU
    synced_step = sharded_step(mesh, synced, torch.optim.SGD(synced.parameters(), lr=0.1, momentum=0.9),  # tensor)
                               (P("dp"), P("dp")), None)
    got["synced losses"] = [synced_step(x, y).full() for _ in range(STEPS)]
    got["synced"] = _snapshot(hpfun.gather_state(synced))

    other = torch.nn.Linear(8, 4 if RANK == 0 else 2).double()  # rank 1's module is narrower
    odd = hpfun.shard(lambda x: other(x).sum(), mesh=mesh, in_specs=P("dp"), out_specs=P())
    got["mismatch"] = _error(lambda: odd(x if RANK == 0 else x[:4]))
    got["after mismatch"] = step(x, y).full()  # the job goes on: the ranks failed together
    padded = hpfun.shard(lambda x: x.mean(), mesh=mesh, in_specs=(P("dp"),), out_specs=P())
    padded(x[:, :4]), padded(x[:, :6])  # both lengths compiled on every rank
    got["cached mismatch"] = _error(lambda: padded(x[:, :4] if RANK == 0 else x[:, :6]))
    got["wrong size"] = _error(lambda: hpfun.Mesh.distributed((2, 2), ("dp", "tp")))
    # three gradients, bucketed on rank 0 only (of three values: one value is all-reduced once)
    ws = [torch.full((8, 3), i + 1.0, dtype=torch.float64) for i in range(3)]
    grads = hpfun.shard(lambda x, ws: torch.func.grad(lambda ws: sum((x @ w).square().sum() for w in ws))(ws), mesh=mesh,
                        in_specs=(P("dp"), P()), out_specs=P(), bucket_bytes=0 if RANK else 1 << 20)
    got["plan mismatch"] = _error(lambda: grads(x, ws))

    def in_set_order(x, y):  # independent ops traced in an order of the rank's own (a loop over a set of strings,
        parts = {}  # in each process's hash order, as transformers' ModernBERT makes its rotary tables)
        for kind in ("a", "b") if RANK == 0 else ("b", "a"):
            parts[kind] = (x * 2.0).cos() if kind == "a" else (y * 3.0).sin()
        return (parts["a"] + parts["b"]).sum(0)

    got["traced in another order"] = hpfun.shard(in_set_order, mesh=mesh, in_specs=(P("dp"), P("dp")),
                                                  out_specs=P())(x, x + 1.0).full()

    # a tuple of tensors in each parameter's optimizer state, rebuilt by every step: gathered whole
    tupled = lifted_model()
    tuple_opt = TupleMomentum(tupled.parameters())
    tuple_step = sharded_step(mesh, tupled, tuple_opt, (P("dp"), P("dp")), {"*.weight": P("dp", None), "*.bias": P("dp")})
    for _ in range(2):
        tuple_step(x, y)
    got["tuple state"] = {i: [t.clone() for t in entries["bufs"]] for i, entries in
                          hpfun.gather_state(tuple_opt)["state"].items()}
    shared = lifted_model()  # one buffer under two keys, split with its parameter: gathered once, one tensor
    shared_opt = SharedMomentum(shared.parameters())
    shared_step = sharded_step(mesh, shared, shared_opt, (P("dp"), P("dp")), {"*.weight": P("dp", None), "*.bias": P("dp")})
    for _ in range(2):
        shared_step(x, y)
    got["shared state"] = {i: (entries["m"] is entries["m2"], entries["m"].clone()) for i, entries in
                           hpfun.gather_state(shared_opt)["state"].items()}

    def refused_on_rank_1(x):  # an error only one rank's trace meets (its own data, a rank-local check)
        if torch.distributed.get_rank() == 1:
            raise ValueError("rank 1 refuses")
        return x.sum()

    got["one rank raised"] = _error(lambda: hpfun.shard(refused_on_rank_1, mesh=mesh, in_specs=P("dp"), out_specs=P())(x))
    summed = hpfun.shard(lambda x: x.sum(0), mesh=mesh, in_specs=P("dp"), out_specs=P())
    got["after one rank raised"] = [summed(x * k).full() for k in (1.0, 10.0)]  # in step: each call pairs with its own

    def checked(x):  # a check of the data read by the trace: cached after the first call
        if torch.isnan(x).any():
            raise ValueError("NaN in the batch")
        return x.sum()

    checked = hpfun.shard(checked, mesh=mesh, in_specs=P("dp"), out_specs=P())
    bad = x.clone()
    if RANK == 1:  # only rank 1's data fails the check
        bad[0, 0] = float("nan")
    got["later check"] = [checked(x).full(), _error(lambda: checked(bad)), checked(2 * x).full()]
    picker = hpfun.shard(pick_columns, mesh=hpfun.Mesh.distributed((2,), ("picks",), timeout=TIMEOUT),
                         in_specs=(P("picks"), P()), out_specs=P())  # (its own mesh: a failed run retires it)
    got["op error"] = _error(lambda: picker(x, torch.tensor([0, 99])))  # out of range on every rank
    got["after op error"] = _error(lambda: picker(x, torch.tensor([0, 1])))
    got["accumulated"] = accumulate_then_step(hpfun.Mesh.distributed((2,), ("tp",), timeout=TIMEOUT), x, y)
    got["donated"] = donated_state(hpfun.Mesh.distributed((2,), ("tp",), timeout=TIMEOUT), mesh, x, y)
    got["kept"] = kept_by_the_forward(mesh)
    got["moved blocks"] = moved_blocks(hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT))
    got["frozen"] = freeze_then_unfreeze(hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT), x, y)
    got["frozen inside"] = frozen_inside(hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT), x, y)
    got["stepped outside"] = stepped_outside(hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT), x, y)
    got["hooks and attributes"] = hooks_and_attributes(hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT), x, y)
    got["keyed by id"] = stepped_by_id(hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT), x, y)
    got["stepped in backward"] = stepped_in_backward(hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT), x, y)
    got["gloo dtypes"] = dtypes_gloo_lacks(mesh)
    got["nan extremes"] = nan_extremes(mesh)
    got["complex moves"] = complex_moves(mesh)
    got["whole state shaped as a block"] = whole_state_shaped_as_a_block(mesh)
    got["per-process globals"] = per_process_globals(mesh, x)
    got["equal gradients"] = equal_gradients_momentum(hpfun.Mesh.distributed((2,), ("dp",), timeout=TIMEOUT))
    torch.save(got, out / f"lifted_dp-rank{RANK}.pt")


TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE", "y", "on"})  # iterates in a per-process order
SESSION_ID = f"session-{RANK}-{os.getpid()}"  # a library's per-process id, never read by the step
SCALE = 1.0 + RANK  # a value the step reads, different on each rank
WEIGHTS = [1.0, 2.0 + RANK]  # made into a tensor by the step: a program input, not its code


def _telemetry():
    return SESSION_ID


class _Inner:  # (a config's section: no repr of its own either)
    def __init__(self):
        self.beta = 1.0


class _Settings:  # a config object of the user's own class: no repr of its own (the default names its address)
    def __init__(self, alpha):
        self.alpha, self.inner, self.names = alpha, _Inner(), {"alpha", "beta", "gamma", "delta", "eps"}


def per_process_globals(mesh, x) -> dict:
    """A global set (each process orders it its own way) and a per-process string the reachable
    code names but the step never reads compile and run; a global the step reads, different
    on each rank, is refused on every rank where the programs part."""
    def flagged(x):
        if "ON" in TRUE_VALUES or not _telemetry:
            x = x * 2
        return x.sum()

    def scaled(x):
        return (x * SCALE).sum()

    fn = hpfun.shard(flagged, mesh=mesh, in_specs=P("dp"), out_specs=P())
    def weighted(x):
        return (x[:, :2] * torch.tensor(WEIGHTS, dtype=x.dtype)).sum()

    by_argument = hpfun.shard(lambda x, names: x.sum() * (2 if "beta" in names else 3), mesh=mesh,
                              in_specs=(P("dp"), None), out_specs=P())
    names = frozenset({"alpha", "beta", "gamma", "delta", "eps", "zeta"})  # (an argument: ordered per process)
    configured = hpfun.shard(lambda x, cfg: x.sum() * cfg.alpha, mesh=mesh, in_specs=(P("dp"), None), out_specs=P())
    return {"runs": [fn(x).full(), fn(x).full(), by_argument(x, names).full(), configured(x, _Settings(2.0)).full()],
            "want": 2 * x.sum(),
            "read and different": _error(lambda: hpfun.shard(scaled, mesh=mesh, in_specs=P("dp"), out_specs=P())(x)),
            "made into a tensor": _error(lambda: hpfun.shard(weighted, mesh=mesh, in_specs=P("dp"), out_specs=P())(x))}


def adafactor_model():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 2, bias=False, dtype=torch.float64)
    return lin, torch.optim.Adafactor(lin.parameters(), lr=0.01)


def whole_state_shaped_as_a_block(mesh) -> dict:
    """Adafactor on a (2, 8) weight split by rows over 2 ranks: its (1, 8) column statistics,
    kept whole, have the shape of the weight's block (gather_state stacked the two ranks' copies)."""
    lin, opt = adafactor_model()

    def step(x):
        lin(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    x = torch.linspace(-1.0, 1.0, 32, dtype=torch.float64).reshape(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the pattern's WildcardWarning: the statistics cannot be split)
        sharded = hpfun.shard(step, mesh=mesh, in_specs=P("dp"), out_specs=None, state_specs={"*": P("dp")})
        for _ in range(2):
            sharded(x)
    return hpfun.gather_state(opt)["state"][0]


def complex_moves(mesh) -> dict:
    """Complex values re-split from one dim to another (an all-to-all, which gloo refuses for
    complex dtypes) and summed over the split dim: (got, want) each."""
    results = {}
    for dtype in (torch.complex64, torch.complex128):
        x = torch.arange(16, dtype=torch.float64).reshape(4, 4).to(dtype) * (1 - 2j)
        moved = hpfun.shard(lambda a: a.cumsum(0), mesh=mesh, in_specs=(P(None, "dp"),), out_specs=P("dp", None))
        results[f"all_to_all {dtype}"] = (moved(x).full(), x.cumsum(0))
        summed = hpfun.shard(lambda a: a.sum(0), mesh=mesh, in_specs=(P("dp"),), out_specs=P())
        results[f"sum {dtype}"] = (summed(x).full(), x.sum(0))
    return results


def nan_extremes(mesh) -> dict:
    """Maxima and minima over the split dim of values with a NaN in one rank's block or the
    other's (gloo's max dropped one a later rank held): (got, want) each, all-reduced, and
    reduce-scattered where the result stays split."""
    nan = float("nan")
    x = torch.tensor([[nan, 1.0, 2.0, 0.5], [2.0, 3.0, 1.0, 0.0], [0.5, nan, nan, 1.0], [4.0, 5.0, 1.0, 2.0]],
                     dtype=torch.float64)
    results = {}
    for name, fn in {"amax": lambda a: a.amax(0), "amin": lambda a: a.amin(0), "max": lambda a: a.max(0).values,
                     "inf norm": lambda a: torch.linalg.vector_norm(a, float("inf"), dim=0)}.items():
        for out in (P(), P("dp")):
            got = hpfun.shard(fn, mesh=mesh, in_specs=(P("dp"),), out_specs=out)(x).full()
            results[f"{name} to {out}"] = (got, fn(x))
    return results


def dtypes_gloo_lacks(mesh) -> dict:
    """Gathers, all-to-alls and sums of dtypes gloo has no collective for: (got, want) each."""
    data = torch.arange(-32, 32).reshape(8, 8) * 997
    results = {}
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn):
        t = data.abs().to(dtype) if dtype.is_floating_point or not dtype.is_signed else data.to(dtype)
        gathered = hpfun.shard(lambda t: t.T.contiguous(), mesh=mesh, in_specs=(P(None, "dp"),), out_specs=P())
        results[f"gather {dtype}"] = (gathered(t).full(), t.T.contiguous())
        moved = hpfun.shard(lambda t: t.clone(), mesh=mesh, in_specs=(P("dp"),), out_specs=P(None, "dp"))
        results[f"all_to_all {dtype}"] = (moved(t).full(), t)
        if dtype is torch.int16:  # (torch sums no unsigned or float8 tensor on the CPU)
            summed = hpfun.shard(lambda t: t.sum(0, dtype=dtype), mesh=mesh, in_specs=(P("dp"),), out_specs=P())
            results[f"sum {dtype}"] = (summed(t).full(), t.sum(0, dtype=dtype))  # wraps alike
    return results


Moments = collections.namedtuple("Moments", "avg sq")


class Box:
    """An object of the user's holding something."""

    def __init__(self, held):
        self.held = held


def nest_state(opt) -> None:
    """State kept in a dict and a list under its parameter (torch-optimizer's AggMo keeps
    `{beta: buffer}`), in the standard library's other containers, and six levels deep, made
    from the parameter's block as the optimizer's own entries are."""
    for state in opt.state.values():
        avg, sq = state["exp_avg"], state["exp_avg_sq"]
        state["nested"] = {0.9: avg * 2, "pair": [sq * 3]}
        state["kinds"] = {"ordered": collections.OrderedDict(m=avg * 4), "default": collections.defaultdict(int, m=avg * 5),
                          "named": Moments(avg * 6, sq * 7), "deep": {"a": [{"b": ({"c": [avg * 8]},)}]}}


def plain(x):
    """`x` with its containers as plain dicts, lists and tuples (what `torch.load` reads back),
    each named by its kind: `{"OrderedDict": {...}}`."""
    if isinstance(x, dict):
        inner = {k: plain(v) for k, v in x.items()}
        return inner if type(x) is dict else {type(x).__name__: inner}
    if isinstance(x, (list, tuple)):
        inner = [plain(v) for v in x]
        return inner if type(x) is list else tuple(inner) if type(x) is tuple else {type(x).__name__: inner}
    return x


def stepped_outside(mesh, x, y) -> dict:
    """The README's way for an optimizer stepped outside the sharded function, on parameters
    split over dp: AdamW makes its state from the blocks; gather_state gathers it with theirs."""
    model = lifted_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @hpfun.shard(mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P(), state_specs={"*": P("dp")})
    def forward_backward(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for _ in range(2):
        forward_backward(x, y)
        opt.step()
        opt.zero_grad()
    nest_state(opt)
    other = hpfun.Mesh.distributed((2,), ("tp",), timeout=TIMEOUT)  # the same ranks, another mesh
    evaluate = hpfun.shard(lambda x: model(x).sum(), mesh=other, in_specs=P(), out_specs=P())
    refused = _error(lambda: evaluate(x))
    inner = torch.nn.Linear(x.shape[1], 4).to(x.dtype)  # a module nine deep in a module's attribute, through
    nest = [{"k": [Box([[[[[inner]]]]])]}]  # containers and an object, the function reading it so (closed over)
    holder = torch.nn.Module()
    holder.deep = nest
    deep_opt = torch.optim.SGD(inner.parameters(), lr=0.1)

    @hpfun.shard(mesh=mesh, in_specs=P("dp"), out_specs=P(), state_specs={"*": P("dp")})
    def deep(x):  # (stepped: its parameters are held as blocks between calls)
        loss = nest[0]["k"][0].held[0][0][0][0][0](x).sum()
        loss.backward()
        deep_opt.step()
        deep_opt.zero_grad()
        return loss

    deep(x)
    between = tuple(inner.weight.shape)
    hpfun.gather_state(holder, inplace=True)  # (it was left holding its block)
    return {"model": _snapshot(hpfun.gather_state(model)), "opt": plain(hpfun.gather_state(opt)["state"]),
            "other mesh": refused, "deep module": (between, tuple(inner.weight.shape))}


def scaled_update(model, x, y):
    """A hand update reading a per-parameter attribute, after gradient hooks ran."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * getattr(p, "lr_scale", 1.0) * p.grad)
            p.grad = None
    return loss


def halved(g):
    return g * 0.5


def hooks_and_attributes(mesh, x, y) -> list:
    """A split weight's attribute changed and a gradient hook registered on it between calls,
    once its rank holds a block of it: each call sees them. The state after each call."""
    model = lifted_model()
    step = hpfun.shard(lambda x, y: scaled_update(model, x, y), mesh=mesh, in_specs=(P("dp"), P("dp")),
                       out_specs=P(), state_specs={"0.weight": P("dp")})
    states = []
    for call in range(3):
        if call == 1:
            model[0].weight.lr_scale = 3.0
        if call == 2:
            model[0].weight.register_hook(halved)
        step(x, y)
        states.append(_snapshot(hpfun.gather_state(model)))
    return states


def optimizers_in_backward(model) -> dict:
    """One AdamW per parameter in a dict keyed by it, stepped by the parameter's post-accumulate-grad
    hook (torchtune's optimizer in the backward)."""
    opts = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return opts


def backward_only(model, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def stepped_in_backward(mesh, x, y) -> list:
    """The optimizers of `optimizers_in_backward` on a weight each rank holds a block of: the
    losses, then the gathered state."""
    model = lifted_model()
    optimizers_in_backward(model)
    step = hpfun.shard(lambda x, y: backward_only(model, x, y), mesh=mesh, in_specs=(P("dp"), P("dp")),
                       out_specs=P(), state_specs={"0.weight": P("dp")})
    return [step(x, y).full() for _ in range(STEPS)] + [_snapshot(hpfun.gather_state(model))]


def scaled_by_id(model, scales, x, y):
    """A hand update scaled per parameter from a dict keyed by id(p) (each process's own ids)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * scales[id(p)] * p.grad)
            p.grad = None
    return loss


def stepped_by_id(mesh, x, y) -> list:
    """`scaled_by_id` sharded: the losses, then the gathered state."""
    model = lifted_model()
    scales = {id(p): 0.5 + i for i, p in enumerate(model.parameters())}
    step = hpfun.shard(lambda x, y: scaled_by_id(model, scales, x, y), mesh=mesh, in_specs=(P("dp"), P("dp")),
                       out_specs=P())
    return [step(x, y).full() for _ in range(STEPS)] + [_snapshot(hpfun.gather_state(model))]


FREEZES = (False, True, True, False, False)  # the first layer's weight frozen at each call


INSIDE = (True, False, True, None, None)  # the step itself freezes the first weight, unfreezes it, or leaves it


def frozen_inside(mesh, x, y) -> list:
    """The step flips requires_grad of a weight each rank holds a block of, by a flag argument:
    (the flag after each call, the model's state gathered)."""
    model = lifted_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def step(x, y, freeze):
        if freeze is not None:
            model[0].weight.requires_grad_(not freeze)
        return eager_step(model, opt, x, y)

    f = hpfun.shard(step, mesh=mesh, in_specs=(P("dp"), P("dp"), None), out_specs=P(),
                    state_specs={"0.weight": P("dp")})
    out = []
    for freeze in INSIDE:
        f(x, y, freeze)
        out.append((model[0].weight.requires_grad, _snapshot(hpfun.gather_state(model))))
    return out


def freeze_then_unfreeze(mesh, x, y) -> list:
    """A weight split by state_specs (each rank holds its block between calls) frozen after one
    step and unfrozen two later: the model's state after each call, gathered."""
    model = lifted_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = sharded_step(mesh, model, opt, (P("dp"), P("dp")), {"0.weight": P("dp")})
    states = []
    for frozen in FREEZES:
        model[0].weight.requires_grad_(not frozen)
        step(x, y)
        states.append(_snapshot(hpfun.gather_state(model)))
    base = lifted_model()  # frozen from the start (a LoRA base): each rank keeps its block of the split weight
    base[0].requires_grad_(False)
    step = sharded_step(mesh, base, torch.optim.SGD(base[2].parameters(), lr=0.1), (P("dp"), P("dp")),
                        {"0.weight": P("dp")})
    step(x, y)
    step(x, y)
    table = types.SimpleNamespace(scale=torch.linspace(1.0, 2.0, 16, dtype=torch.float64))  # not a module's
    scaled = hpfun.shard(lambda x: (x * table.scale[:8].unsqueeze(1)).sum(), mesh=mesh, in_specs=P("dp"),
                         out_specs=P(), state_specs={"*": P("dp")})  # (ZeRO-3's wildcard matches it too)
    scaled(x)
    counts = types.SimpleNamespace(seen=torch.zeros(8, dtype=torch.float64))  # a plain object's tensor, written

    def counted(x):
        counts.seen.add_(x.sum(1))
        return x.sum()

    hpfun.shard(counted, mesh=mesh, in_specs=P("dp"), out_specs=P(), state_specs={"*": P("dp")})(x)
    kept_outside = {"t": torch.linspace(1.0, 2.0, 8, dtype=torch.float64)}  # and ones assigned anew
    counts.tab = torch.zeros(8, dtype=torch.float64)

    def reassigned(x):
        counts.tab = counts.seen * 1.5
        kept_outside["t"] = kept_outside["t"] * 1.5
        return (x * kept_outside["t"].unsqueeze(1)).sum()

    run = hpfun.shard(reassigned, mesh=mesh, in_specs=P("dp"), out_specs=P(), state_specs={"*": P("dp")})
    run(x), run(x)
    keeps = torch.nn.Linear(8, 16, dtype=torch.float64)  # a non-persistent buffer and a tensor attribute, split
    keeps.register_buffer("scale", torch.linspace(1.0, 2.0, 16, dtype=torch.float64), persistent=False)
    keeps.acc = torch.zeros(16, dtype=torch.float64)
    keeps.targets = [torch.nn.Linear(8, 16, dtype=torch.float64).requires_grad_(False)]  # (a DQN's target network:
    # a module in a plain list, lifted with it)
    keeps.targets[0].acc = torch.zeros(16, dtype=torch.float64)  # (its own tensor attribute, and one a list in a
    keeps.nested = {"a": [torch.nn.Linear(8, 16, dtype=torch.float64).requires_grad_(False)]}  # dict keeps)

    def forward(x):
        z = keeps(x) * keeps.scale + keeps.targets[0](x) + keeps.nested["a"][0](x)
        keeps.acc = keeps.acc + z.detach().sum(0)
        keeps.targets[0].acc = keeps.targets[0].acc + z.detach().sum(0)
        return z.pow(2).mean()

    kept = hpfun.shard(forward, mesh=mesh, in_specs=P("dp"), out_specs=P(), state_specs={"*": P("dp")})
    kept(x), kept(x)
    hpfun.gather_state(keeps, inplace=True)  # (the README: the module runs unsharded again)
    return {"states": states, "frozen block": tuple(base[0].weight.shape), "frozen": _snapshot(hpfun.gather_state(base)),
            "table": tuple(table.scale.shape), "outside state_dict": (tuple(keeps.scale.shape), keeps.acc.clone()),
            "listed target": (tuple(keeps.targets[0].weight.shape), tuple(keeps.targets[0].acc.shape),
                              tuple(keeps.nested["a"][0].weight.shape)),
            "written": counts.seen.clone(), "assigned": (counts.tab.clone(), kept_outside["t"].clone())}


class _Keeps(torch.nn.Module):
    """A forward that keeps things: a cache dict, a buffer registered on a longer sequence with
    its length in a Python int, a flag flipped per call, the last output's mean, a tensor kept at
    an attribute and in the cache dict, updated through one; and a check of its input's values."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8).double()
        self.cache, self.cached_len, self.flips = {}, 0, False
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("acc", torch.zeros(8, dtype=torch.float64))  # split over dp: a block between calls

    def forward(self, x):
        if x.max() > 100:
            raise ValueError("out of range")
        first = bool(self.calls == 0)  # reads of state (AveragedModel's n_averaged == 0), of a split buffer too
        scale = 1.0 if first else 1.0 + float(self.acc.abs().sum() > 1e9)
        self.calls += 1
        n = x.shape[1]
        if "w" not in self.cache:
            self.cache["w"] = self.lin.weight * 2
            self.hits = self.cache["hits"] = torch.zeros(8, dtype=torch.float64)
        if n > self.cached_len:
            self.register_buffer("cos", torch.cos(torch.arange(n, dtype=torch.float64))[:, None], persistent=False)
            self.cached_len = n
        self.flips = not self.flips
        y = (x @ self.cache["w"]) * self.cos[:n] * scale
        self.acc += y.detach().mean((0, 1))
        self.cache["hits"].add_(y.detach().mean((0, 1)))
        self.last = y.detach().mean()
        return y


def kept_by_the_forward(mesh) -> dict:
    """What a forward keeps in its module (and a hook appends to a list), on gloo: each call
    against eager, and the module's state after it."""
    torch.manual_seed(3)
    model, ref = _Keeps(), _Keeps()
    ref.load_state_dict(model.state_dict())
    acts, ref_acts = [], []
    model.lin.register_forward_hook(lambda m, i, o: None)
    model.register_forward_hook(lambda m, i, o: acts.append(o.detach().norm()))
    ref.register_forward_hook(lambda m, i, o: ref_acts.append(o.detach().norm()))
    step = hpfun.shard(lambda x: model(x).square().mean(), mesh=mesh, in_specs=P("dp"), out_specs=P(),
                       state_specs={"model.acc": P("dp")})
    diffs = []
    g = torch.Generator().manual_seed(5)
    for shape in [(4, 4, 8), (4, 4, 8), (4, 6, 8), (4, 6, 8)]:
        x = torch.randn(shape, dtype=torch.float64, generator=g)
        diffs.append(abs(step(x).full().item() - ref(x).square().mean().item()))
        diffs.append(abs(model.last.item() - ref.last.item()))
    same = (model.cached_len, model.flips, sorted(model.cache), len(acts)) == (ref.cached_len, ref.flips, sorted(ref.cache), len(ref_acts))
    diffs.append((torch.stack(acts) - torch.stack(ref_acts)).abs().max().item())
    diffs.append((model.cos - ref.cos).abs().max().item())
    diffs.append((hpfun.gather_state(model)["acc"] - ref.acc).abs().max().item())
    diffs.append((model.hits - ref.hits).abs().max().item())
    same = same and model.calls.item() == ref.calls.item() == 4 and model.hits is model.cache["hits"]
    return {"diff": max(diffs), "same": same, "raised": _error(lambda: step(torch.full((4, 4, 8), 1e3, dtype=torch.float64)))}


class _RepointsKeep(PerParameter):
    """Keeps `m`'s tensor under a second key, re-pointed between `m` and `v` at every step."""

    def update(self, p, st, lr):
        if "m" not in st:
            st["m"], st["v"] = torch.zeros_like(p), torch.ones_like(p)
            st["keep"] = st["m"]
        else:
            st["keep"] = st["v"] if st["keep"] is st["m"] else st["m"]
        st["m"].mul_(0.9).add_(p.grad)
        p.sub_(lr * (st["m"] + 0.1 * st["keep"]))


class _SwapsWeights(torch.nn.Module):
    """Two weights in a ParameterDict that every step swaps."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.pd = torch.nn.ParameterDict({k: torch.randn(4, 3, generator=g, dtype=torch.float64) for k in "ab"})

    def forward(self, x):
        return ((x @ self.pd["a"].T) ** 2).mean() + 3 * (x @ self.pd["b"].T).sum() ** 2


def moved_blocks(mesh) -> dict:
    """Held blocks the step puts at another place: an optimizer state key re-pointed between two
    of its parameter's tensors (SGD-like, the weights split), and two split weights a
    ParameterDict swaps (Adam): against eager over four calls."""
    def repoint_step(model, opt, x):
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def swap_step(model, opt, x):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.pd["a"], model.pd["b"] = model.pd["b"], model.pd["a"]
        return loss.detach()

    cases = {
        "repoint": (repoint_step, lambda: torch.nn.Linear(4, 4, dtype=torch.float64), _RepointsKeep,
                    {"weight": P("dp", None), "bias": P("dp")}),
        "swap": (swap_step, _SwapsWeights, lambda ps: torch.optim.Adam(ps, lr=0.1),
                 {"pd.a": P("dp", None), "pd.b": P("dp", None)}),
    }
    got = {}
    for name, (step, make_model, make_opt, specs) in cases.items():
        torch.manual_seed(0)
        model = make_model()
        ref = copy.deepcopy(model)
        opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
        sharded = hpfun.shard(lambda x: step(model, opt, x), mesh=mesh, in_specs=(P(),), out_specs=P(), state_specs=specs)

        def run():
            diffs = []
            for i in range(4):
                x = torch.randn(4, 4 if name == "repoint" else 3, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(i))
                diffs.append(abs(sharded(x).full().item() - step(ref, ref_opt, x).item()))
                whole = hpfun.gather_state(model)
                diffs.append(max((whole[k] - v).abs().max().item() for k, v in ref.state_dict().items()))
            return max(diffs)
        got[name] = _error(lambda: got.setdefault(f"{name} diff", run()))
    return got


def donated_state(tp_mesh, dp_mesh, x, y) -> dict:
    """donate_state=True: STEPS AdamW steps on a Megatron split (blocks held between calls) and
    on data parallel (replicated state), each against the same steps without donation; then a
    call that fails once started, the next call, and a call after the state is loaded again."""
    from hpfun.runtime.distributed import DistributedRuntime

    got = {}
    for name, mesh, in_specs, specs in (("tp", tp_mesh, (P(), P()), MEGATRON), ("dp", dp_mesh, (P("dp"), P("dp")), None)):
        for donate in (False, True):
            model = lifted_model()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            step = hpfun.shard(lambda x, y: eager_step(model, opt, x, y), mesh=mesh, in_specs=in_specs, out_specs=P(),
                               state_specs=specs, donate_state=donate)
            moved = []  # per call: the parameter left the storage it had (a view of it kept: no reuse)
            losses = []
            for _ in range(STEPS):
                before = model[0].weight.detach()
                losses.append(step(x, y).full())
                moved.append(before.data_ptr() != model[0].weight.data_ptr())
            got[name, donate] = {"losses": losses, "model": _snapshot(hpfun.gather_state(model)),
                                 "opt": _snapshot(hpfun.gather_state(opt)["state"]),
                                 "moved": moved,
                                 "donated": step.lower(x, y).memory().donated}
    # dp, donating: a call that fails once the program has its inputs loses the state it was handed
    saved_model, saved_opt = _snapshot(model.state_dict()), copy.deepcopy(opt.state_dict())
    run = DistributedRuntime.run

    def failing(self, module, local_inputs, *args, **kwargs):
        local_inputs.clear()  # as the program does when it starts
        raise RuntimeError("injected failure")

    DistributedRuntime.run = failing
    try:
        try:
            step(x, y)
        except RuntimeError as err:
            got["failed notes"] = list(getattr(err, "__notes__", []))
    finally:
        DistributedRuntime.run = run
    got["next call"] = _error(lambda: step(x, y))
    got["gathered"] = _error(lambda: hpfun.gather_state(model)), _error(lambda: hpfun.gather_state(opt))
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    got["after loading"] = step(x, y).full()
    # donate_argnums: the functional MLP step on the Megatron split, its new parameters handed back
    pspec, xspec, yspec = MLP_LAYOUTS["tp"]
    params, (mx, my) = mlp_init(), mlp_data()
    for donate in ((), (0,)):
        step = hpfun.shard(mlp_step, mesh=tp_mesh, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()),
                           donate_argnums=donate)
        new, loss = step(params, mx, my)  # global tensors: the caller's, left alone
        old = new
        for _ in range(2):
            new, loss = step(new, mx, my)
        got["argnums", donate] = {"params": {k: v.full() for k, v in new.items()}, "loss": loss.full(),
                                  "old read": _error(lambda: old["w1"].full()), "spent": old["w1"].spent,
                                  "global kept": all(torch.equal(v, mlp_init()[k]) for k, v in params.items())}
    return got


def pick_columns(x, i):
    return (x * 2)[:, i]


def accumulate_then_step(mesh, x, y) -> dict:
    """Gradients accumulated by two backward-only calls on a Megatron split, then one step: a
    whole parameter meets its gradient's block, which the next call accumulates into."""
    model = lifted_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)

    @hpfun.shard(mesh=mesh, in_specs=(P(), P()), out_specs=P(), state_specs=MEGATRON)
    def accumulate(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    accumulate(x, y)
    accumulate(x, y)
    grads = {k: tuple(p.grad.shape) for k, p in model.named_parameters()}
    sharded_step(mesh, model, opt, (P(), P()), MEGATRON)(x, y)
    return {"grad shapes": grads, "model": hpfun.gather_state(model)}


def equal_gradients_residual(model, x, c):
    h = model["lin"](x)
    h += model["ctx"](c)  # (the two biases get equal gradients: one value in the program)
    return h.tanh().pow(2).mean()


def equal_gradients_model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"lin": torch.nn.Linear(3, 4), "ctx": torch.nn.Linear(2, 4)}).double()


def equal_gradients_momentum(mesh) -> dict:
    """SGD with momentum on two biases whose gradients are one value in the program: each
    momentum buffer its own block (they shared storage, and later steps updated it twice)."""
    model = equal_gradients_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @hpfun.shard(mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P())
    def step(x, c):
        loss = equal_gradients_residual(model, x, c)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    data = torch.randn(3, 8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    losses = [step(d[:, :3], d[:, 3:]).full() for d in data]
    bufs = [opt.state[model[k].bias]["momentum_buffer"] for k in ("lin", "ctx")]
    return {"losses": losses, "model": _snapshot(hpfun.gather_state(model)),
            "shared": bufs[0].untyped_storage().data_ptr() == bufs[1].untyped_storage().data_ptr()}


def _snapshot(state: dict) -> dict:
    """Gathered values are new tensors, whole ones the live state (as state_dict): copy them."""
    return torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, state)


def _error(fn) -> str:
    try:
        fn()
    except Exception as err:  # the test inspects whatever the rank saw
        return f"{type(err).__name__}: {err}"
    return "NO ERROR"


def _record_error(out: Path, fn):
    start = time.monotonic()
    try:
        fn()
        message = "NO ERROR"
    except Exception as err:  # the test inspects whatever the rank saw
        message = f"{type(err).__name__}: {err}"
    (out / f"err-rank{RANK}.txt").write_text(f"{time.monotonic() - start:.1f}\n{message}")
    if message != "NO ERROR":
        os._exit(1)  # a broken process group cannot be torn down cleanly


SCENARIOS = {
    "mlp": run_mlp, "compile": compile_small, "adopt": adopt_and_local,
    "lifted": lifted, "lifted_dp": lifted_dp, "rank_raises": rank_raises, "rank_dies": rank_dies, "rank_stalls": rank_stalls,
    "own_collective": own_collective,
}

if __name__ == "__main__":
    torch.set_num_threads(1)
    SCENARIOS[sys.argv[1]](Path(sys.argv[2]))
    if sys.argv[1] != "own_collective":  # (which leaves it to hpfun's exit handler)
        torch.distributed.destroy_process_group()
