"""Programs for values on a GPU, checked where no GPU is: planned on fake CUDA tensors, the
per-shard program makes its own tensors (element indices for random draws, masks) on
the function's device, and the runtime hands it its coordinates and seed there. The programs
themselves run on a GPU in `benchmarks/gpu.py`."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

import hpfun
from hpfun import P, api
from hpfun.capture import trace
from hpfun.lower import lower, program_device
from hpfun.propagate import propagate
from hpfun.testing import models as m

aten = torch.ops.aten
MADE = (aten.arange.default, aten.zeros.default)
MESH = hpfun.Mesh.simulated((2,), ("m",))


def _program(fn, metas, specs, device):
    gm = trace(lambda *xs: list(fn(*xs)), metas, device=device).gm
    layouts = [s.to_layout(MESH, len(shape)) for s, (shape, _) in zip(specs, metas, strict=True)]
    outputs = [specs[0].to_layout(MESH, len(metas[0][0]))] * sum(1 for n in gm.graph.output_node().args[0])
    propagate(gm, MESH, layouts, outputs=outputs)
    return lower(gm, MESH, outputs)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_random_draws_index_their_elements_on_the_functions_device(device):
    program = _program(lambda x: (F.dropout(x, 0.5),), [((8, 4), torch.float32)], [P("m")], device)
    assert program.device == torch.device(device, 0 if device == "cuda" else None)
    made = [n for n in program.module.graph.nodes if n.target in MADE]
    assert made, "the draw indexes its elements"
    if device == "cpu":  # CPU programs read as before: no device named
        assert all("device" not in n.kwargs for n in made)
    else:
        assert all(n.kwargs["device"] == program.device for n in made)


def test_program_device_is_the_first_off_the_cpu_and_cpu_scalars_do_not_count():
    gm = trace(lambda x, lr: [x * lr], [((4,), torch.float32), ((), torch.float64)], device="cuda").gm
    assert program_device(gm) == torch.device("cuda", 0)
    gm = trace(lambda x: [x * 2], [((4,), torch.float32)]).gm
    assert program_device(gm) == torch.device("cpu")


def test_a_sharded_value_is_assembled_on_its_shards_device():
    x = torch.empty(4, 6, device="meta")
    value = hpfun.Sharded.from_global(x, P("m").to_layout(MESH, 2))
    assert value.full().device.type == "meta"
    assert hpfun.redistribute(value, P(None, "m").to_layout(MESH, 2)).shards[0].device.type == "meta"


# Programs planned for a device other than the CPU, run where every op checks its devices: the
# function traced on meta tensors as it would be on a GPU (not as planning-only meta, which is
# traced on the CPU), its per-shard program run on fake meta tensors, which refuse a CPU tensor
# beside them as CUDA does (a CPU scalar excepted).

def _gpt_sharded():
    mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    params, (idx, tgt) = m.gpt_init(), m.gpt_data()
    specs = m.gpt_specs(params, tp="tp")
    state_specs = {"m": specs, "v": specs, "step": P()}
    f = hpfun.shard(m.gpt_step, mesh=mesh, in_specs=(specs, state_specs, P("dp"), P("dp")),
                    out_specs=(specs, state_specs, P()))
    return f, (params, m.adamw_init(params), idx, tgt)


def _context_parallel():
    seq = P(None, None, "m")

    def grads(q, k, v):
        loss = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()  # noqa: E731
        return torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)

    q = torch.randn(2, 4, 24, 4)
    return hpfun.shard(grads, mesh=MESH, in_specs=(seq,) * 3, out_specs=(seq,) * 3), (q, q, q)


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(ids):  # (the cache off: on meta tensors its empty start is not a constant, as on a device)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model.to("meta")
    f = hpfun.shard(step, mesh=hpfun.Mesh.simulated((2,), ("tp",)), in_specs=(P(),), out_specs=P(),
                    state_specs=m.LLAMA_TP)
    return f, (torch.zeros(4, 16, dtype=torch.long),)


SHARDED = {
    "gathered": lambda: (hpfun.shard(lambda x: x * 2, mesh=MESH, in_specs=(P("m"),), out_specs=P()),
                         (torch.randn(8, 4),)),
    "split": lambda: (hpfun.shard(lambda x: x * 2, mesh=MESH, in_specs=(P(),), out_specs=P("m")), (torch.randn(8, 4),)),
    "dropout": lambda: (hpfun.shard(m.mlp_dropout_step, mesh=hpfun.Mesh.simulated((2, 2), ("dp", "tp")),
                                    in_specs=(m.MEGATRON, P("dp"), P("dp"))), (m.mlp_init(), *m.mlp_data())),
    "gpt_step": _gpt_sharded,
    "context_parallel": _context_parallel,
    "hf_llama_step": _hf_llama,
}


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_a_program_for_another_device_makes_every_tensor_there(name, monkeypatch):
    monkeypatch.setattr(api, "_traced_on", lambda device: device)  # meta traced as a device of its own
    f, args = SHARDED[name]()
    args = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, args)
    assert f.lower(*args).program.device.type == "meta"
    with hpfun.random_seed(0), FakeTensorMode(allow_non_fake_inputs=True):
        out = f(*args)  # the program was made above: this call only runs it
    assert all(s.device.type == "meta" for v in tree_leaves(out, is_leaf=lambda v: isinstance(v, hpfun.Sharded))
               for s in (v.shards if isinstance(v, hpfun.Sharded) else [v]))


def test_the_gpu_check_runs_its_cpu_cases(tmp_path):
    """`benchmarks/gpu.py`, which a session lent a GPU runs as it is, stays runnable: its checks
    that need no CUDA kernel pass on the CPU (the attention kernels and the compiled draws are
    left to the GPU)."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu.py"), "--device", "cpu", "--only",
                          "attention_sdpa", "gpt", "llama", "memory", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    ran = ("attention_sdpa", "gpt", "llama", "memory")
    assert {k: v["status"] for k, v in checks.items()} == dict.fromkeys(ran, "ok")
