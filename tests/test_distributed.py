"""The distributed runtime on real gloo process groups (127.0.0.1, world sizes 2 and 4).

Each test launches one process per rank running tests/dist_worker.py, waits with a bound, and
always kills what is left."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hpfun
from hpfun import P
from hpfun.testing import ranks
from hpfun.testing.models import MLP_LAYOUTS, mlp_data, mlp_init, mlp_step

WORKER = Path(__file__).with_name("dist_worker.py")


def launch(scenario: str, world: int, out: Path, timeout: float = 240) -> list[int]:
    """Run one job; returns the ranks' exit codes. Never leaves a process behind."""
    return ranks.launch([sys.executable, str(WORKER), scenario, str(out)], world, out, timeout)


def _simulated(name, shape, axes):
    mesh = hpfun.Mesh.simulated(shape, axes)
    pspec, xspec, yspec = MLP_LAYOUTS[name]
    step = hpfun.shard(mlp_step, mesh=mesh, in_specs=(pspec, xspec, yspec), out_specs=(pspec, P()))
    params, (x, y) = mlp_init(), mlp_data()
    new, loss = step(*step(params, x, y)[:1], x, y)
    return new | {"loss": loss}


def _unsharded():
    params, (x, y) = mlp_init(), mlp_data()
    new, loss = mlp_step(*mlp_step(params, x, y)[:1], x, y)
    return new | {"loss": loss}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("world", [2, 4])
def test_mlp_steps_match_simulated_and_unsharded(world, tmp_path):
    """Two MLP steps per layout on gloo equal the simulated runtime shard by shard and the unsharded step."""
    codes = launch("mlp", world, tmp_path)
    assert codes == [0] * world, ranks.logs(tmp_path)
    sys.path.insert(0, str(WORKER.parent))
    try:
        import dist_worker
        dist_worker.WORLD = world
        layouts = dist_worker.mlp_layouts_for_world()
    finally:
        sys.path.pop(0)
    reference = _unsharded()
    for name, shape, axes in layouts:
        simulated = _simulated(name, shape, axes)
        for rank in range(world):
            got = torch.load(tmp_path / f"{name}-rank{rank}.pt")
            assert got["traces"] == 1, name  # Sharded inputs reuse the program
            for key, value in got["shards"].items():
                expected = simulated[key].shards[rank]
                if world == 2:  # two terms sum the same in any order: bitwise
                    assert torch.equal(value, expected), (name, key, rank)
                else:
                    assert _rel(value, expected) <= 1e-6, (name, key, rank)
            for key, value in got["full"].items():
                assert _rel(value, reference[key]) <= 1e-5, (name, key)


def test_adopted_device_mesh_and_local_shards(tmp_path):
    """Mesh.from_device_mesh adopts a user's DeviceMesh; Sharded.from_local inputs (their layouts
    given as text, which names the mesh's shape only) give the same results as global inputs,
    with one program for both."""
    codes = launch("adopt", 2, tmp_path)
    assert codes == [0, 0], ranks.logs(tmp_path)
    for rank in range(2):
        got = torch.load(tmp_path / f"adopt-rank{rank}.pt")
        assert got["same"] and got["traces"] == 1
        assert _rel(got["loss"], _unsharded_one_step_loss()) <= 1e-6


def _unsharded_one_step_loss():
    params, (x, y) = mlp_init(), mlp_data()
    return mlp_step(params, x, y)[1]


def test_compile_option_on_gloo(tmp_path):
    """compile=True runs the per-shard program through inductor with the same results."""
    codes = launch("compile", 2, tmp_path, timeout=400)
    assert codes == [0, 0], ranks.logs(tmp_path)
    for rank in range(2):
        got = torch.load(tmp_path / f"compile-rank{rank}.pt")
        for key in got[False]:
            assert _rel(got[True][key], got[False][key]) <= 1e-6, key


def test_compile_option_in_simulation():
    """compile=True in the simulated runtime compiles the pieces between collectives, same results."""
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    f = lambda x, w: torch.relu(x @ w).sum(1)  # noqa: E731
    x, w = torch.randn(4, 8), torch.randn(8, 6)
    plain = hpfun.shard(f, mesh=mesh, in_specs=(P(), P("tp")), out_specs=P())
    compiled = hpfun.shard(f, mesh=mesh, in_specs=(P(), P("tp")), out_specs=P(), compile=True)
    torch.testing.assert_close(compiled(x, w).full(), plain(x, w).full())
    torch.testing.assert_close(compiled(x, w).full(), f(x, w))


# -- lifted state: the stock step reading a module and an optimizer it was not given -----------


def _worker():
    sys.path.insert(0, str(WORKER.parent))
    try:
        import dist_worker
    finally:
        sys.path.pop(0)
    return dist_worker


def _job(tmp_path_factory, scenario: str, world: int) -> list[dict]:
    out = tmp_path_factory.mktemp(scenario)
    codes = launch(scenario, world, out)
    assert codes == [0] * world, ranks.logs(out)
    return [torch.load(out / f"{scenario}-rank{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module")
def lifted_job(tmp_path_factory):
    """One world-4 job: the stock step on a (2, 2) dp x tp mesh with each optimizer."""
    return _job(tmp_path_factory, "lifted", 4)


@pytest.fixture(scope="module")
def lifted_dp_job(tmp_path_factory):
    """One world-2 job: BatchNorm under data parallel, ranks that differ, a mesh of the wrong size."""
    return _job(tmp_path_factory, "lifted_dp", 2)


def _close(got, expected, what):
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_foreach", "sgd_loop", "adamw_cosine", "nested"])
def test_lifted_module_and_optimizer_on_dp_x_tp(lifted_job, optimizer):
    """The stock step (backward, opt.step, zero_grad on a closed-over module and optimizer),
    Megatron-split on (2, 2): each rank holds its blocks between calls, gathered state equals
    the eager run's, and gathered in place the module and optimizer run eagerly, then sharded, again.
    With a cosine schedule stepping the learning rate between calls, no call traces again."""
    w = _worker()
    x, y = w.lifted_data()
    model = w.lifted_model()
    opt = w.OPTIMIZERS[optimizer](model.parameters())
    scheduler = w.schedule(optimizer, opt)
    losses = []
    for _ in range(w.STEPS):
        losses.append(w.eager_step(model, opt, x, y))
        if scheduler is not None:
            scheduler.step()
    names = {id(p): k for k, p in model.named_parameters()}
    state = {(names[id(p)], key): v for p, entries in opt.state.items()
             for key, v in w.state_tensors(entries).items() if v.ndim}
    blocks = dict(w.BLOCK_SHAPES) | {f"{p}.{key}": w.BLOCK_SHAPES[p] for p, key in state}
    whole = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    whole |= {f"{p}.{key}": whole[p] for p, key in state}
    model_after, opt_after = w._snapshot(model.state_dict()), w._snapshot(opt.state_dict()["state"])
    losses += [w.eager_step(model, opt, x, y) for _ in range(2)]
    for rank, results in enumerate(lifted_job):
        got = results[optimizer]
        assert got["traces"] == 2, "a fresh optimizer's first call creates its state: one retrace, no more"
        for held in got["held"]:
            assert held == blocks | {"grads": 4, "same parameters": True}, rank
        assert got["whole"] == whole | {"grads": 4, "same parameters": True}, rank
        _close(got["model"], model_after, f"rank {rank}: gather_state(model)")
        _close(got["opt"], opt_after, f"rank {rank}: gather_state(opt)")
        _close(torch.stack(got["losses"]), torch.stack(losses), f"rank {rank}: losses")
        _close(got["final"], model.state_dict(), f"rank {rank}: after an eager and a sharded step on gathered state")
        assert got["final traces"] == 2, "whole state reads into the same program"


def test_an_adopted_sub_mesh_runs_on_its_own_rows_groups(lifted_job):
    """Mesh.from_device_mesh of one dim of a 2 x 2 DeviceMesh (a tp pair per dp row): each row
    computes on its own data over the DeviceMesh's groups (a group of one row's ranks made by that
    row alone collided with the other row's, and hung); hpfun's own groups with a timeout cannot
    be made for a sub-mesh, which is said."""
    for got in lifted_job:
        sub = got["sub-mesh"]
        assert torch.equal(sub["got"], sub["want"]), sub
        assert "cannot adopt the mesh" in sub["timeout"] and "leave timeout out" in sub["timeout"], sub["timeout"]


def test_batchnorm_running_statistics_under_data_parallel(lifted_dp_job):
    """BatchNorm in train mode, batch split over dp: running statistics, the batch count and
    parameters equal eager's (the batch statistics are the global batch's); SyncBatchNorm's too."""
    w = _worker()
    x, y = w.lifted_data()
    model = w.lifted_model(batchnorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = torch.stack([w.eager_step(model, opt, x, y) for _ in range(w.STEPS)])
    state = w._snapshot(model.state_dict())
    next_loss = w.eager_step(model, opt, x, y)
    for rank, got in enumerate(lifted_dp_job):
        _close(got["model"], state, f"rank {rank}")
        _close(torch.stack(got["losses"]), losses, f"rank {rank}: losses")
        _close(got["synced"], state, f"rank {rank}: SyncBatchNorm")  # (its forward refused a CPU tensor)
        _close(torch.stack(got["synced losses"]), losses, f"rank {rank}: SyncBatchNorm's losses")
        _close(got["after mismatch"], next_loss, f"rank {rank}: the step after the ranks' failed call")


def test_momentum_of_parameters_with_equal_gradients_is_a_block_each(lifted_dp_job):
    """Two biases whose gradients are one value of the program (`h = lin(x); h += ctx(c)`):
    each momentum buffer gets its own block, and three steps equal eager's (they shared
    storage, and every later step updated it twice, silently)."""
    w = _worker()
    model = w.equal_gradients_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(3, 8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    losses = []
    for d in data:
        losses.append(w.equal_gradients_residual(model, d[:, :3], d[:, 3:]))
        losses[-1].backward()
        opt.step()
        opt.zero_grad()
    for rank, results in enumerate(lifted_dp_job):
        got = results["equal gradients"]
        assert not got["shared"], rank
        _close(torch.stack(got["losses"]), torch.stack(losses).detach(), f"rank {rank}: losses")
        _close(got["model"], model.state_dict(), f"rank {rank}")


def test_gradients_accumulated_without_a_step_then_a_step(lifted_dp_job):
    """Backward-only calls on a tp split leave each rank its parameters' and gradients' blocks
    (a gradient may not differ from its parameter in shape); the step after them equals eager's."""
    w = _worker()
    x, y = w.lifted_data()
    model = w.lifted_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    w.eager_step(model, opt, x, y)  # its backward adds a third gradient
    for rank, results in enumerate(lifted_dp_job):
        got = results["accumulated"]
        assert got["grad shapes"] == w.BLOCK_SHAPES, rank
        _close(got["model"], model.state_dict(), f"rank {rank}")


def test_freezing_a_held_block_between_calls_compiles_the_frozen_step(lifted_dp_job):
    """requires_grad flipped on a weight each rank holds a block of: the call after each flip
    runs the program for the new flag (it reused the other one, updating a frozen weight and
    never training an unfrozen one), equal to eager after every call."""
    w = _worker()
    x, y = w.lifted_data()
    model = w.lifted_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for call, frozen in enumerate(w.FREEZES):
        model[0].weight.requires_grad_(not frozen)
        w.eager_step(model, opt, x, y)
        for rank, results in enumerate(lifted_dp_job):
            _close(results["frozen"]["states"][call], model.state_dict(), f"rank {rank}, call {call} (frozen: {frozen})")
    # a weight frozen from the start, split by state_specs: each rank holds its block between calls
    # (it kept the whole tensor, which the memory estimate did not count), results as eager's
    base = w.lifted_model()
    base[0].requires_grad_(False)
    opt = torch.optim.SGD(base[2].parameters(), lr=0.1)
    for _ in range(2):
        w.eager_step(base, opt, x, y)
    for rank, results in enumerate(lifted_dp_job):
        assert results["frozen"]["frozen block"] == (8, 8), results["frozen"]["frozen block"]
        # a plain object's tensor read split stays whole: eager code outside reads all of it (each rank
        # kept its block, and a scheduler's add_noise outside the step read other rows)
        assert results["frozen"]["table"] == (16,), results["frozen"]["table"]
        torch.testing.assert_close(results["frozen"]["written"], x.sum(1))  # (written in place: whole, as eager's)
        tab, t = results["frozen"]["assigned"]  # (assigned anew: whole too, each rank kept its block)
        torch.testing.assert_close(tab, x.sum(1) * 1.5)
        torch.testing.assert_close(t, torch.linspace(1.0, 2.0, 8, dtype=torch.float64) * 2.25)
        # gather_state(inplace=True) makes what state_dict leaves out whole too (a non-persistent buffer,
        # a tensor attribute the forward reassigns): each rank kept its block, and eager code then failed
        scale, acc = results["frozen"]["outside state_dict"]
        assert scale == (16,) and acc.shape == (16,), (scale, acc.shape)
        assert results["frozen"]["listed target"] == ((16, 8), (16,), (16, 8)), results["frozen"]["listed target"]
        # (a module in a plain list the module holds, its own tensor attribute, one in a list in a dict: each rank
        # kept its block)
        torch.testing.assert_close(acc, lifted_dp_job[0]["frozen"]["outside state_dict"][1])  # (the same on each rank)
        _close(results["frozen"]["frozen"], base.state_dict(), f"rank {rank}: frozen from the start")


def test_a_held_block_the_step_freezes_and_unfreezes_is_flipped_at_every_call(lifted_dp_job):
    """requires_grad_ called inside the step on a weight each rank holds a block of: the flag is
    set by every call of the program, as on a whole tensor (it was recorded only for a tensor
    not yet held split: the flag stayed as the first call left it, and frozen weights trained)."""
    w = _worker()
    x, y = w.lifted_data()
    model = w.lifted_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for call, freeze in enumerate(w.INSIDE):
        if freeze is not None:
            model[0].weight.requires_grad_(not freeze)
        w.eager_step(model, opt, x, y)
        for rank, results in enumerate(lifted_dp_job):
            flag, state = results["frozen inside"][call]
            assert flag == model[0].weight.requires_grad, (rank, call, flag)
            _close(state, model.state_dict(), f"rank {rank}, call {call} (freeze: {freeze})")


def test_gather_state_of_an_optimizer_stepped_outside_gathers_its_blocks(lifted_dp_job):
    """AdamW stepped outside the sharded function makes its moments from the blocks the split
    parameters hold: gather_state(opt) gathers them with their parameter's layout (it returned
    each rank's half as the whole), equal to eager's state."""
    w = _worker()
    x, y = w.lifted_data()
    model = w.lifted_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        w.eager_step(model, opt, x, y)
    w.nest_state(opt)  # (state in a dict and a list under the parameter, an OrderedDict, a defaultdict, a
    # namedtuple, six levels deep: each rank's block was returned)
    for rank, results in enumerate(lifted_dp_job):
        got = results["stepped outside"]
        _close(got["model"], model.state_dict(), f"rank {rank}: model")
        _close(got["opt"], w.plain(opt.state_dict()["state"]), f"rank {rank}: optimizer state")
        # a module nine deep (containers, an object), held as blocks between calls: gather_state(inplace=True)
        # makes it whole
        assert got["deep module"] == ((2, x.shape[1]), (4, x.shape[1])), got["deep module"]
        # a function on another mesh of the same ranks reading the split state: named, with the fix
        assert "0.weight: holds this rank's block" in got["other mesh"] and "gather_state(model, inplace=True)" \
            in got["other mesh"], got["other mesh"]


def test_hooks_and_attributes_of_a_held_block_are_read(lifted_dp_job):
    """An attribute set and a gradient hook registered between calls on a weight each rank
    holds a block of: the trace read the block, which has neither (the parameter holds them),
    and ran the old value silently. Equal to eager after each call."""
    w = _worker()
    x, y = w.lifted_data()
    model = w.lifted_model()
    for call in range(3):
        if call == 1:
            model[0].weight.lr_scale = 3.0
        if call == 2:
            model[0].weight.register_hook(w.halved)
        w.scaled_update(model, x, y)
        for rank, results in enumerate(lifted_dp_job):
            _close(results["hooks and attributes"][call], model.state_dict(), f"rank {rank}, call {call}")


def test_an_optimizer_per_parameter_stepped_in_its_gradient_hook_runs_as_eager(lifted_dp_job):
    """torchtune's optimizer in the backward on a weight each rank holds a block of: the dict
    keyed by parameters is keyed by their stand-ins in the trace, and the hooks run under
    hpfun's modes (the step read its traced hyperparameters with .item()). Losses and state
    equal eager's on every rank."""
    w = _worker()
    x, y = w.lifted_data()
    model = w.lifted_model()
    w.optimizers_in_backward(model)
    losses = [w.backward_only(model, x, y).detach() for _ in range(w.STEPS)]
    for rank, results in enumerate(lifted_dp_job):
        *got, state = results["stepped in backward"]
        torch.testing.assert_close(torch.stack(got), torch.stack(losses), rtol=1e-12, atol=0)
        _close(state, model.state_dict(), f"rank {rank}")


def test_a_dict_keyed_by_parameter_ids_runs_on_every_rank(lifted_dp_job):
    """A dict keyed by id(p): its entries are named by position, not by each process's own ids
    (the ranks were said to have been called with different arguments)."""
    w = _worker()
    x, y = w.lifted_data()
    model = w.lifted_model()
    scales = {id(p): 0.5 + i for i, p in enumerate(model.parameters())}
    losses = [w.scaled_by_id(model, scales, x, y).detach() for _ in range(w.STEPS)]
    for rank, results in enumerate(lifted_dp_job):
        *got, state = results["keyed by id"]
        torch.testing.assert_close(torch.stack(got), torch.stack(losses), rtol=1e-12, atol=0)
        _close(state, model.state_dict(), f"rank {rank}")


def test_donated_state_equals_kept_state_and_a_failed_call_loses_it(lifted_dp_job):
    """donate_state=True hands parameters and AdamW's state over to the program (each rank's
    tensors give up their storage at every call, where without it new values are copied into
    it): results bitwise equal to the same steps without
    it, on a Megatron split and on data parallel, and equal to eager. A call failing once
    started says the state is lost; the next call refuses to run on it, and runs again once
    the state is loaded."""
    w = _worker()
    x, y = w.lifted_data()
    model = w.lifted_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = torch.stack([w.eager_step(model, opt, x, y) for _ in range(w.STEPS)])
    state = w._snapshot(model.state_dict())
    next_loss = w.eager_step(model, opt, x, y)
    for rank, results in enumerate(lifted_dp_job):
        got = results["donated"]
        for name in ("tp", "dp"):
            kept, donated = got[name, False], got[name, True]
            for key in ("losses", "model", "opt"):
                torch.testing.assert_close(donated[key], kept[key], rtol=0, atol=0, msg=lambda m: f"{name} {key}: {m}")
            _close(torch.stack(donated["losses"]), losses, f"rank {rank} {name}: losses")
            _close(donated["model"], state, f"rank {rank} {name}: model")
            assert all(donated["moved"]) and not kept["moved"][-1], (rank, name)  # kept: written into in place
            assert donated["donated"] > 0 and kept["donated"] == 0, (rank, name)
        assert len(got["failed notes"]) == 1 and "their values are lost" in got["failed notes"][0], got["failed notes"]
        text = got["next call"]
        assert text.startswith("ExecutionError: donated state lost"), text
        assert "0.weight" in text and "exp_avg" in text and "load the values again" in text, text
        for text in got["gathered"]:  # gathering the lost values is refused too (they held undefined memory)
            assert text.startswith("ExecutionError: donated state lost") and "last checkpoint" in text, text
        _close(got["after loading"], next_loss, f"rank {rank}: the call after loading the state again")
        # donate_argnums: the same results; the value handed in is spent, a global tensor left alone
        kept, donated = got["argnums", ()], got["argnums", (0,)]
        torch.testing.assert_close(donated["params"], kept["params"], rtol=0, atol=0)
        torch.testing.assert_close(donated["loss"], kept["loss"], rtol=0, atol=0)
        assert donated["spent"] and not kept["spent"], rank
        assert "was donated to a call (donate_argnums)" in donated["old read"] and kept["old read"] == "NO ERROR"
        assert donated["global kept"] and kept["global kept"], rank


def test_what_a_forward_keeps_is_kept_on_every_rank(lifted_dp_job):
    """A cache dict, a buffer registered in the forward, a Python flag it flips, the last
    output kept in an attribute, a forward hook's list, a check of the input's values: on gloo
    as in eager, on both ranks; the check's own ValueError reaches the caller."""
    for rank in lifted_dp_job:
        kept = rank["kept"]
        assert kept["diff"] < 1e-12 and kept["same"], kept
        assert kept["raised"].startswith("ValueError: out of range"), kept["raised"]


def test_held_blocks_the_step_puts_at_another_place_move_themselves(lifted_dp_job):
    """An optimizer state key re-pointed between two split tensors, and two split weights a
    ParameterDict swaps: the place got a new tensor with the block's values, not the block, so
    the key stopped holding the tensor it points to (the fourth step drifted, silently), and a
    swapped weight became a plain tensor (the second call failed on a size)."""
    for rank in lifted_dp_job:
        moved = rank["moved blocks"]
        for name in ("repoint", "swap"):
            assert moved[name] == "NO ERROR", moved[name]
            assert moved[f"{name} diff"] < 1e-12, moved


def test_ranks_with_different_arguments_fail_naming_each_input(lifted_dp_job):
    """Rank 1 passes a smaller batch and closes over a narrower module: every rank fails, with
    one line per differing input naming its path and each rank's value."""
    for rank, got in enumerate(lifted_dp_job):
        text = got["mismatch"]
        assert text.startswith("ShardingError") and "different arguments" in text, text
        assert "args[0]: differs between ranks (mesh rank 0: float64[8, 8] [S(0)]; mesh rank 1: float64[4, 8] [S(0)])" in text, text
        assert "other.weight: differs between ranks (mesh rank 0: float64[4, 8] [R]; mesh rank 1: float64[2, 8] [R])" in text, text
        assert "other.bias" in text and "TreeSpec" not in text, text


def test_ranks_running_different_cached_programs_fail_naming_the_input(lifted_dp_job):
    """A function compiled for two lengths on every rank, then called with one on rank 0 and the
    other on rank 1: no rank compiles, so the ranks compare what they run at each call (the
    function has programs for several argument shapes), and fail as at a first call."""
    for got in lifted_dp_job:
        text = got["cached mismatch"]
        assert text.startswith("ShardingError") and "different arguments" in text, text
        assert "args[0]: differs between ranks (mesh rank 0: float64[8, 4] [S(0)]; mesh rank 1: float64[8, 6] [S(0)])" \
            in text, text


def test_ranks_that_plan_different_programs_fail_before_running_them(lifted_dp_job):
    """Ranks given different options (bucketing on one only) plan different programs for the
    same call, whose collectives would pair wrongly: compared after compiling, they fail
    together, naming the cause, before anything runs (and the job goes on)."""
    for got in lifted_dp_job:
        text = got["plan mismatch"]
        assert text.startswith("ShardingError") and "planned 2 different per-shard programs" in text, text
        assert "mesh rank 1: step" in text and "where mesh rank 0's is" in text, text  # where they part
        assert "the same hpfun.shard options" in text and "PYTHONHASHSEED=0" in text, text


def test_ranks_that_trace_independent_ops_in_another_order_run_one_program(lifted_dp_job):
    """Ranks whose traces meet two independent computations in another order (a loop over a set
    of strings, in each process's hash order: transformers' ModernBERT and Gemma-3) compute the
    same values with the same collectives: they run (they had been refused as different plans)."""
    x, _ = _worker().lifted_data()
    for rank, got in enumerate(lifted_dp_job):
        _close(got["traced in another order"], ((x * 2.0).cos() + ((x + 1.0) * 3.0).sin()).sum(0), f"rank {rank}")


def _eager_state(optimizer: str) -> list:
    """Each parameter's state after two eager steps of the worker's model with its `optimizer`."""
    worker = _worker()
    x, y = worker.lifted_data()
    model = worker.lifted_model()
    opt = getattr(worker, optimizer)(model.parameters())
    for _ in range(2):
        worker.eager_step(model, opt, x, y)
    return [opt.state[p] for p in model.parameters()]


def test_gather_state_gathers_a_tuple_of_tensors_in_optimizer_state(lifted_dp_job):
    """A tuple of tensors a step rebuilds in each parameter's state, split with its parameter:
    gather_state gives the full tensors, equal to eager's (each rank's block had come back)."""
    want = {i: list(st["bufs"]) for i, st in enumerate(_eager_state("TupleMomentum"))}
    for rank, got in enumerate(lifted_dp_job):
        for i, bufs in want.items():
            for a, b in zip(got["tuple state"][i], bufs, strict=True):
                _close(a, b, f"rank {rank}, parameter {i}")


def test_gather_state_keeps_one_tensor_an_optimizer_holds_under_two_keys_one(lifted_dp_job):
    """`st["m"] = st["m2"]` of a split parameter: gather_state gathered each key on its own and
    gave two tensors (state_dict() gives one), so a checkpoint of it loaded back trained
    otherwise; the full values equal eager's."""
    want = _eager_state("SharedMomentum")
    for rank, got in enumerate(lifted_dp_job):
        for i, st in enumerate(want):
            one, m = got["shared state"][i]
            assert one, f"rank {rank}, parameter {i}: gather_state gave two tensors"
            _close(m, st["m"], f"rank {rank}, parameter {i}")


def test_a_compile_failing_on_one_rank_fails_every_rank_and_keeps_them_in_step(lifted_dp_job):
    """The function raises while traced on rank 1 only, and the job catches it and goes on: rank
    1 gets its own error, rank 0 an error naming rank 1, and the next calls pair each rank's
    collectives with the same call's (rank 0 had gone on to compare a plan rank 1 never sent,
    and every later call then mixed one rank's batch with the other's next one)."""
    x, _ = _worker().lifted_data()
    for rank, got in enumerate(lifted_dp_job):
        text = got["one rank raised"]
        if rank == 1:
            assert text.startswith("ValueError: rank 1 refuses"), text
        else:
            assert text.startswith("ShardingError") and "another rank failed to compile" in text, text
            assert "mesh rank 1: raised an error while compiling this call" in text, text
        for k, value in zip((1.0, 10.0), got["after one rank raised"], strict=True):
            _close(value, (x * k).sum(0), f"rank {rank}, batch x {k}")
        # the same at a later call, the program cached: a check of the data it reads fails on rank 1
        # only (rank 0 ran the cached program and rank 1 compiled, each waiting on the other)
        first, text, after = got["later check"]
        _close(first, x.sum(), f"rank {rank}: before")
        if rank == 1:
            assert text.startswith("ValueError: NaN in the batch"), text
        else:
            assert text.startswith("ShardingError") and "another rank failed to compile" in text, text
        _close(after, 2 * x.sum(), f"rank {rank}: the call after")


def test_a_rank_whose_program_failed_runs_nothing_more_on_that_mesh(lifted_dp_job):
    """After a program failed while running on a rank (other ranks may have finished that call),
    the rank refuses every later call on that mesh before any collective, saying why and to end
    the job: going on would pair its collectives with the other ranks' next call."""
    for got in lifted_dp_job:
        text = got["after op error"]
        assert text.startswith("ShardingError") and "the ranks are out of step" in text, text
        assert "an earlier call failed on this rank while its program ran (IndexError" in text, text
        assert "end the job" in text, text


def test_an_op_that_fails_while_running_is_named(lifted_dp_job):
    """An op raising inside the per-shard program (an index out of range) is an hpfun error
    naming the op, the user's line and the layouts, with the op's own error as its cause."""
    for rank, got in enumerate(lifted_dp_job):
        text = got["op error"]
        assert text.startswith("ExecutionError: the per-shard program failed"), text
        assert f"mesh rank {rank} ({rank},)" in text and "dist_worker.py" in text and "return (x * 2)[:, i]" in text, text
        assert "aten.index.Tensor" in text and "reading [S(0)], [R] -> [S(0)]" in text and "IndexError" in text, text


def test_a_max_or_min_over_the_mesh_keeps_a_nan_of_any_rank(lifted_dp_job):
    """amax, amin, max and an inf-norm over the split dim are NaN wherever a rank's block has a
    NaN, all-reduced or reduce-scattered, as eager's are (gloo's max dropped one rank 1 held)."""
    for got in lifted_dp_job:
        assert len(got["nan extremes"]) == 8
        for what, (value, want) in got["nan extremes"].items():
            torch.testing.assert_close(value, want, equal_nan=True, rtol=0, atol=0, msg=what)


def test_gather_state_keeps_whole_state_shaped_as_its_parameters_block(lifted_dp_job):
    """Adafactor's (1, 8) column statistics of a (2, 8) weight split by rows are kept whole and
    have the shape of the weight's block: gathered as they are, equal to eager's (they came
    back as (2, 8), the ranks' copies stacked)."""
    w = _worker()
    lin, opt = w.adafactor_model()
    x = torch.linspace(-1.0, 1.0, 32, dtype=torch.float64).reshape(4, 8)
    for _ in range(2):
        lin(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for rank, got in enumerate(lifted_dp_job):
        _close(got["whole state shaped as a block"], opt.state_dict()["state"][0], f"rank {rank}")


def test_complex_values_move_between_splits_on_gloo(lifted_dp_job):
    """A complex value re-split from one dim to another (an all-to-all) failed on gloo, which has
    no complex all-to-all ('Invalid scalar type'), and left the mesh out of step: its pairs of
    floats move instead. Sums were right already."""
    for got in lifted_dp_job:
        assert len(got["complex moves"]) == 4
        for what, (value, want) in got["complex moves"].items():
            assert value.dtype == want.dtype and torch.equal(value, want), what


def test_dtypes_gloo_lacks_move_and_sum_exactly(lifted_dp_job):
    """int16, uint16/32/64 and float8 values, which gloo has no collective for, are gathered and
    all-to-all'd bit for bit (viewed as a same-size dtype), and an int16 sum is exact (summed in
    int32 and narrowed back, wrapping as the unsharded sum does)."""
    for got in lifted_dp_job:
        assert len(got["gloo dtypes"]) == 11
        for what, (value, want) in got["gloo dtypes"].items():
            assert value.dtype == want.dtype and torch.equal(value.view(torch.uint8), want.view(torch.uint8)), what


def test_python_values_of_each_process_compare_by_the_programs_they_make(lifted_dp_job):
    """A global frozenset of strings (ordered per process), one passed as an argument, a config
    object of the user's class passed as one (its default repr names its address, which ranks
    compared: ShardingError; so did a section of it, and a set it holds is ordered per process), and a per-process id the step's code names but never reads
    (diffusers' session id) do not fail the ranks' comparison; a global
    the step reads, different on each rank, fails every rank where the programs part, naming it,
    and so does one it makes into a tensor (`torch.tensor(WEIGHTS)`, fed as an input)."""
    for got in lifted_dp_job:
        case = got["per-process globals"]
        for run in case["runs"]:
            _close(run, case["want"], "a global set and a per-process id")
        text = case["read and different"]
        assert text.startswith("ShardingError") and "ranks planned different programs" in text, text
        assert "holds SCALE: 2.0, where mesh rank 0 holds SCALE: 1.0" in text, text
        text = case["made into a tensor"]  # (a tensor made from data is fed to the program: its values compared)
        assert text.startswith("ShardingError") and "the tensor the function made from data" in text, text
        assert "holds the tensor the function made from data" in text and "WEIGHTS" in text, text


def test_mesh_of_another_size_than_the_job_names_the_count_that_works(lifted_dp_job):
    """Mesh.distributed((2, 2)) in a job of 2 processes says what to launch, or what to build."""
    for got in lifted_dp_job:
        text = got["wrong size"]
        assert text.startswith("ShardingError") and "needs 4 processes, but the job has 2" in text, text
        assert "--nproc-per-node 4" in text and "a mesh of 2 ranks" in text, text


def test_a_collective_the_step_calls_itself_is_refused_and_the_job_exits_cleanly(tmp_path_factory):
    """`torch.distributed.all_reduce` inside the step is refused at its line with the fix (it
    was reported as a draw from Python's random generator), and a script
    that ends without destroying the process group exits 0 on every rank."""
    for got in _job(tmp_path_factory, "own_collective", 2):
        assert "torch.distributed.all_reduce at" in got["error"] and "torch.distributed.all_reduce(g)" in got["error"]
        assert "leave the communication to hpfun" in got["error"] and "random" not in got["error"], got["error"]
        # through a reference a library keeps (it ran on the trace's stand-ins, said to be a random draw), and
        # torch's functional collectives (left to the rules: no rule, and fallback failed): refused alike
        assert "torch.distributed.all_reduce at" in got["by reference"] and "held(g)" in got["by reference"], \
            got["by reference"]
        assert "_c10d_functional.all_reduce" in got["functional"] and "funcol.all_reduce" in got["functional"] and \
            "leave the communication to hpfun" in got["functional"], got["functional"]
        assert "torch.distributed.all_reduce at" in got["training"] and "held(x.sum(0).detach())" in got["training"] \
            and "random" not in got["training"], got["training"]
        torch.testing.assert_close(got["before"], torch.full((4,), 8.0))


@pytest.mark.parametrize("scenario", ["rank_raises", "rank_dies"])
def test_failed_rank_makes_the_others_fail_not_hang(scenario, tmp_path):
    """When a rank raises or dies, the surviving rank gets an error within the timeout."""
    codes = launch(scenario, 2, tmp_path, timeout=120)
    assert codes[1] != 0 and codes[0] == 1, ranks.logs(tmp_path)
    elapsed, message = (tmp_path / "err-rank0.txt").read_text().split("\n", 1)
    assert float(elapsed) < 20 + 10, message  # the worker's timeout, plus slack
    assert message != "NO ERROR"


def test_stalled_rank_makes_the_others_fail_after_the_timeout(tmp_path, monkeypatch):
    """A rank that stays alive but never joins: the others fail once the mesh's timeout passes."""
    monkeypatch.setenv("HPFUN_TEST_TIMEOUT", "5")
    codes = launch("rank_stalls", 2, tmp_path, timeout=120)
    assert codes[0] == 1, ranks.logs(tmp_path)
    elapsed, message = (tmp_path / "err-rank0.txt").read_text().split("\n", 1)
    assert 4 <= float(elapsed) < 5 + 15, message
    assert message != "NO ERROR"


def test_distributed_mesh_needs_a_job(monkeypatch):
    """Mesh.distributed outside torchrun says so instead of hanging."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(hpfun.ShardingError, match="RANK(?s:.*)fix: launch the script with torchrun.*Mesh.simulated"):
        hpfun.Mesh.distributed((2,), ("dp",))


def test_a_from_local_layout_naming_a_mesh_this_process_did_not_start_says_which_it_did(monkeypatch):
    """Under torchrun, a text layout naming another mesh (`{tp: 2}` where `{dp: 2}` was started)
    names the meshes started (it was told from_local is for distributed meshes)."""
    from hpfun.runtime import groups

    monkeypatch.setattr(groups, "_DEVICE_MESHES", {hpfun.Mesh((2,), ("dp",), runtime="distributed"): (None, None)})
    with pytest.raises(hpfun.LayoutError, match=r"mesh \{tp: 2\} is not one this process started \(\{dp: 2\}\)"):
        hpfun.Sharded.from_local(torch.zeros(4, 3), "[S(0)] on {tp: 2}", (8, 3))
