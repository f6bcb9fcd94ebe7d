"""Planning on meta tensors: `f.lower(*args)` with meta arguments and a model built on the meta
device gives the plan, report and price it gives on real tensors, allocating nothing."""

import pytest
import torch

import hpfun
from hpfun import P
from hpfun.testing.models import LLAMA_TP

MESH = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))


def _collectives(lowered):
    return [(c.kind, c.axes, c.bytes, c.dtype) for c in lowered.collectives]


def test_a_value_read_from_a_meta_argument_asks_for_a_real_one():
    """A check on an argument's values (`labels.max() >= 5`) cannot be read from a meta tensor:
    the error says so, and planning with that argument real (the others meta) works."""
    lin = torch.nn.Linear(8, 5)

    def loss(x, labels):
        if labels.max() >= 5:
            raise ValueError("a label out of range")
        return torch.nn.functional.cross_entropy(lin(x), labels)

    step = hpfun.shard(loss, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P())
    x = torch.empty(8, 8, device="meta")
    with pytest.raises(hpfun.CaptureError, match="reads values of its arguments here, and they are meta tensors"):
        step.lower(x, torch.empty(8, dtype=torch.long, device="meta"))
    assert step.lower(x, torch.zeros(8, dtype=torch.long)).collectives


def test_a_function_on_meta_arguments():
    def loss(x, w1, w2):
        return (torch.relu(x @ w1) @ w2).square().mean()

    step = hpfun.shard(torch.func.grad(loss, argnums=(1, 2)), mesh=MESH,
                       in_specs=(P("dp"), P(None, "tp"), P("tp", None)), out_specs=(P(None, "tp"), P("tp", None)))
    shapes = [(8, 16), (16, 32), (32, 16)]
    real = step.lower(*[torch.randn(s) for s in shapes])
    meta = step.lower(*[torch.empty(s, device="meta") for s in shapes])
    assert _collectives(meta) == _collectives(real) and meta.cost() == real.cost()




def _llama_step(device):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @hpfun.shard(mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P(), state_specs=LLAMA_TP)
    def train_step(ids, labels):
        loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ids = torch.zeros(4, 16, dtype=torch.long, device=device)
    return train_step, ids, model


def test_an_hf_training_step_on_the_meta_device():
    """A Llama built on the meta device (no weights), its AdamW step planned as the real one is."""
    meta_step, meta_ids, model = _llama_step("meta")
    lowered = meta_step.lower(meta_ids, meta_ids)
    assert all(p.is_meta for p in model.parameters())  # nothing was materialized
    real_step, real_ids, _ = _llama_step("cpu")
    real = real_step.lower(real_ids, real_ids)
    assert _collectives(lowered) == _collectives(real)
    assert lowered.cost() == real.cost()


def test_a_call_on_meta_tensors_runs_on_meta_as_eager_does():
    """Calling (not only lowering) on meta tensors gives meta results, as eager does: tensors the
    function makes (`torch.arange(n, device=x.device)`, a Llama's rotary positions) are made on
    meta too, though the program was traced as on the CPU."""
    f = hpfun.shard(lambda x: (x * torch.arange(16, device=x.device)).sum(-1), mesh=MESH, in_specs=(P("dp"),),
                    out_specs=P("dp"))
    out = f(torch.empty(4, 16, device="meta"))
    assert out.shape == (4,) and all(s.is_meta for s in out.shards)
    step, ids, model = _llama_step("meta")
    loss = step(ids, ids)
    assert loss.shape == () and all(s.is_meta for s in loss.shards)
    assert all(p.is_meta for p in model.parameters())


def test_a_meta_skeleton_called_with_real_parameters_runs_on_them():
    """functional_call on a module kept on the meta device, real parameters passed in (torch's
    ensembling recipe): the skeleton's own meta parameters are not read, so the program runs on
    the real ones and returns values, not meta tensors."""
    import torch.func as tf

    base = torch.nn.Linear(4, 2, dtype=torch.float64, device="meta")
    g = torch.Generator().manual_seed(0)
    params = {"weight": torch.randn(2, 4, generator=g, dtype=torch.float64),
              "bias": torch.randn(2, generator=g, dtype=torch.float64)}
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)

    def f(p, x):
        return tf.functional_call(base, p, (x,))

    out = hpfun.shard(f, mesh=hpfun.Mesh.simulated((2,), ("a",)), in_specs=(hpfun.P(), hpfun.P("a")),
                      out_specs=hpfun.P("a"))(params, x).full()
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, f(params, x), rtol=1e-12, atol=1e-12)
