"""Memory per rank: the liveness estimate in the lowered report against the allocator's peak
measured while one rank's program runs (`hpfun.memory.measure`), on the MLP, the reference GPT
and a Hugging Face Llama step; the report's memory section in text, JSON and HTML."""

import json

import pytest
import torch

import hpfun
from hpfun import P, memory
from hpfun.testing import models as m

MESH_2x2 = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))


def _close(f, *args, tol=0.10):
    est = f.lower(*args).memory()
    got = memory.measure(f, *args)
    assert got.held == pytest.approx(est.held, rel=1e-3), (got, est)
    assert est.peak == pytest.approx(got.peak, rel=tol), f"estimate {est.peak} B, measured {got.peak} B\n{est}"
    return est, got


def test_mlp_step_estimate_matches_the_allocator():
    mesh = hpfun.Mesh.simulated((4,), ("dp",))
    params = m.mlp_init(d_in=64, d_hidden=256, n_classes=16)
    x, y = m.mlp_data(batch=64, d_in=64, n_classes=16)
    f = hpfun.shard(m.mlp_step, mesh=mesh, in_specs=(None, P("dp"), P("dp")))
    est, got = _close(f, params, x, y)
    assert est.inputs["params"] == sum(p.numel() * 4 for p in params.values())  # replicated: every rank holds all
    assert est.inputs["x"] == x.numel() * 4 // 4


def test_gpt_step_estimate_matches_the_allocator():
    params = m.gpt_init()
    state = m.adamw_init(params)
    idx, tgt = m.gpt_data()
    specs = m.gpt_specs(params, tp="tp")
    f = hpfun.shard(m.gpt_step, mesh=MESH_2x2, in_specs=(specs, None, P("dp"), P("dp")))
    est, got = _close(f, params, state, idx, tgt, tol=0.05)
    assert set(est.inputs) == {"params", "state", "idx", "targets"}
    assert est.transient > 0 and est.peak == est.held + est.transient


def test_tensor_parallel_split_shows_in_the_held_bytes():
    params = m.gpt_init()
    idx, tgt = m.gpt_data()
    loss = lambda p, i, t: m.gpt_loss(p, i, t)  # noqa: E731
    replicated = hpfun.shard(loss, mesh=MESH_2x2, in_specs=(None, P("dp"), P("dp")), out_specs=P())
    split = hpfun.shard(loss, mesh=MESH_2x2, in_specs=(m.gpt_specs(params, tp="tp"), P("dp"), P("dp")), out_specs=P())
    whole = replicated.lower(params, idx, tgt).memory().inputs["p"]
    part = split.lower(params, idx, tgt).memory().inputs["p"]
    assert whole == sum(v.numel() * 4 for v in params.values())
    assert part < whole  # the matrices are halved, the norms and embeddings not


def test_hf_llama_step_estimate_matches_the_allocator_and_names_lifted_state():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @hpfun.shard(mesh=hpfun.Mesh.simulated((2,), ("tp",)), in_specs=(P(),), out_specs=P(), state_specs=m.LLAMA_TP)
    def step(ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    step(ids)  # the optimizer's state exists from the first step on
    est, _ = _close(step, ids)
    assert {"parameters", "optimizer state", "ids"} <= set(est.inputs)
    n_params = sum(p.numel() for p in model.parameters())
    assert est.inputs["parameters"] < n_params * 4  # tensor parallel: split matrices
    assert est.inputs["optimizer state"] > est.inputs["parameters"]  # two moments per parameter, and steps


def test_donated_state_is_freed_at_its_last_use_in_the_estimate_and_the_allocator():
    """donate_state=True: the parameters and AdamW's moments the step updates are freed after
    the update reads them, so the peak no longer holds old and new state side by side. The
    estimate says so, and the allocator agrees (one rank's program run with the donated blocks
    handed over in a list it empties, as a distributed call runs it)."""
    torch.manual_seed(0)
    peaks = {}
    for donate in (False, True):
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        @hpfun.shard(mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=(P("dp"), P("dp")), out_specs=P(),
                     donate_state=donate)
        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        x, y = torch.randn(32, 64), torch.randn(32, 64)
        step(x, y)  # AdamW's state exists from the first step on
        est, got = _close(step, x, y)
        peaks[donate] = est
    kept, donated = peaks[False], peaks[True]
    hyper = 3 * 8  # AdamW's lr and betas, read as float64 tensors: its state in the report, never donated
    assert kept.donated == 0 and donated.donated == kept.inputs["parameters"] + kept.inputs["optimizer state"] - hyper
    assert "buffers" not in kept.inputs  # (they were reported as the buffers of a model that has none)
    assert donated.held == kept.held  # the call is handed the same blocks
    assert kept.peak - donated.peak >= donated.donated // 2, (kept, donated)
    assert "donated inputs" in str(donated)
    with pytest.raises(hpfun.SpecError, match="donate_state must be True or False"):
        hpfun.shard(lambda x: x, mesh=MESH_2x2, in_specs=(P(),), donate_state="yes")


def test_donated_arguments_are_spent_and_counted_as_freed():
    """donate_argnums: a Sharded argument is consumed by the call (reading it again names it),
    a global tensor is the caller's and stays as it was; the estimate frees the donated blocks
    at their last use, and bad positions or an argument both donated and updated in place are
    errors naming them."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    params, (x, y) = m.mlp_init(), m.mlp_data()
    before = {k: v.clone() for k, v in params.items()}
    step = hpfun.shard(m.mlp_step, mesh=mesh, in_specs=(None, P("dp"), P("dp")), out_specs=(None, P()),
                       donate_argnums=0)
    new, _ = step(params, x, y)
    assert all(torch.equal(params[k], before[k]) for k in params)
    newer, loss = step(new, x, y)
    ref, ref_loss = m.mlp_step(m.mlp_step(before, x, y)[0], x, y)
    torch.testing.assert_close(loss.full(), ref_loss)
    assert new["w1"].spent and not newer["w1"].spent
    with pytest.raises(hpfun.SpecError, match=r"args\[0\]\['w1'\]: was donated to a call"):
        new["w1"].full()
    with pytest.raises(hpfun.SpecError, match="was donated to a call"):
        step(new, x, y)
    kept = hpfun.shard(m.mlp_step, mesh=mesh, in_specs=(None, P("dp"), P("dp")), out_specs=(None, P()))
    est, plain = step.lower(newer, x, y).memory(), kept.lower(newer, x, y).memory()
    assert est.donated == est.inputs["params"] and plain.donated == 0 and est.peak <= plain.peak
    assert est.timeline[-1] == plain.timeline[-1] - est.donated  # at the end: the old parameters are gone
    with pytest.raises(hpfun.SpecError, match="donate_argnums=3: the call has 3 positional arguments"):
        hpfun.shard(m.mlp_step, mesh=mesh, in_specs=(None, P("dp"), P("dp")), donate_argnums=(0, 3))(params, x, y)

    def bump(p, x):
        x.add_(1)
        return p * x

    with pytest.raises(hpfun.SpecError, match=r"args\[1\]: is donated and modified in place"):
        hpfun.shard(bump, mesh=mesh, in_specs=(P(), P()), donate_argnums=1)(torch.ones(2), torch.ones(2))
    with pytest.raises(hpfun.SpecError, match="donate_argnums must be an int"):
        hpfun.shard(bump, mesh=mesh, in_specs=(P(), P()), donate_argnums="x")


def test_a_view_keeps_its_buffer_alive():
    """A value read only through a view (a bucket's gradient, a transposed matrix) holds its
    whole buffer until the view's last use."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))

    def f(x):
        y = x * 2  # 4 KiB
        v = y[:1]  # a view: y lives as long as v does
        z = x + 1  # 4 KiB, while y still lives
        return (z * v).sum()

    x = torch.randn(32, 64)
    est = hpfun.shard(f, mesh=mesh, in_specs=(P(),), out_specs=P()).lower(x).memory()
    assert est.transient >= 2 * 32 * 64 * 4


def test_report_carries_memory_through_json_text_and_html():
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    f = hpfun.shard(m.mlp_step, mesh=mesh, in_specs=(None, P("dp"), P("dp")))
    params = m.mlp_init()
    x, y = m.mlp_data()
    lowered = f.lower(params, x, y)
    first = lowered.memory()  # asked first: the estimate alone, the report's node list not made for it
    assert lowered._data["nodes"] is None
    back = hpfun.Lowered.from_json(lowered.to_json())
    assert back.memory() == lowered.memory() == first
    assert "memory per rank" in str(lowered) and "peak" in str(lowered.memory())
    assert "<svg" in lowered._repr_html_()
    assert hpfun.visualize(lowered.memory()) is not None
    old = lowered.to_dict()
    old["version"] = 4
    del old["memory"]
    with pytest.raises(hpfun.HpfunError, match="lower the function again"):
        hpfun.Lowered.from_dict(old).memory()
    assert json.loads(lowered.to_json())["memory"]["transient_peak"] == lowered.memory().transient


def test_zero1_patterns_for_optimizer_state_before_its_first_step():
    """AdamW makes its state at the first step: a state_specs pattern for it matches nothing at
    the first call, and is checked from the second on (a typo is still reported then)."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def make(specs):
        @hpfun.shard(mesh=mesh, in_specs=(P("dp"),), out_specs=P(), state_specs=specs)
        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    x = torch.randn(4, 8)
    step = make({"*.exp_avg": P("dp"), "*.exp_avg_sq": P("dp")})
    step(x)
    lowered = step.lower(x)
    assert lowered.memory().inputs["optimizer state"] < 2 * sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(hpfun.SpecError, match="matches no name"):
        make({"*.exp_avg_typo": P("dp")})(x)  # the state exists now



def _gpt_program(specs, **options):
    params, (idx, tgt) = m.gpt_init(), m.gpt_data()
    opt_specs = {"m": specs, "v": specs, "step": P()}
    f = hpfun.shard(m.gpt_step, mesh=MESH_2x2, in_specs=(specs, opt_specs, P("dp"), P("dp")),
                    out_specs=(specs, opt_specs, P()), **options)
    return f.lower(params, m.adamw_init(params), idx, tgt).program


def _dropout_program():
    f = hpfun.shard(lambda x, w: torch.nn.functional.dropout(x @ w, 0.1).sum(), mesh=MESH_2x2,
                    in_specs=(P("dp"), P(None, "tp")), out_specs=P())
    return f.lower(torch.randn(8, 16), torch.randn(16, 8)).program


@pytest.mark.parametrize("case", ["gpt tp", "gpt zero-3 gathered", "dropout"])
def test_the_meta_run_gives_the_fake_runs_estimate(case, monkeypatch):
    """The estimate runs the program on meta tensors (`verify.meta_run`), falling back to fake
    tensors (`verify.fake_run`): both give every node a value, and the same figures."""
    from hpfun import verify

    params = m.gpt_init()
    program = {
        "gpt tp": lambda: _gpt_program(m.gpt_specs(params, tp="tp")),
        "gpt zero-3 gathered": lambda: _gpt_program({k: P("dp") if v.shape[0] % 2 == 0 else P()
                                                     for k, v in params.items()}, gather_params="dp"),
        "dropout": _dropout_program,
    }[case]()
    nodes = list(program.module.graph.nodes)

    def estimate_by(run):
        for node in nodes:
            node.meta.pop("val", None)
        monkeypatch.setattr(verify, "fake_run", run)  # what verify.local_run falls back to
        monkeypatch.setattr(verify, "meta_run", run)  # and what it tries first
        out = memory.estimate(program)
        assert all(n.meta.get("val") is not None for n in nodes if n.op == "call_function"), run.__name__
        return out

    meta_run, fake_run = verify.meta_run, verify.fake_run
    assert estimate_by(meta_run) == estimate_by(fake_run)


def test_tensor_hyperparameters_an_optimizer_holds_are_its_state_in_the_report():
    """AdamW given tensor lr and betas: the tensors its param group holds are its state in the
    memory report, not the buffers of a model that has none."""
    model = torch.nn.Linear(4, 4).double()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3),
                            betas=(torch.tensor(0.9), torch.tensor(0.999)))

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    f = hpfun.shard(step, mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=P("dp"), out_specs=P())
    x = torch.randn(8, 4, dtype=torch.float64)
    f(x), f(x)
    memory = f.lower(x).memory()
    assert "buffers" not in memory.inputs, memory
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert memory.inputs["optimizer state"] == state + 3 * 4, memory  # (lr and the betas: float32 0-d tensors)
