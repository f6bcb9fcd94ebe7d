"""Programs for values on a GPU, checked where no GPU is: planned on fake CUDA tensors, the
per-shard program makes its own tensors (element indices for random draws, masks) on
the function's device, and the runtime hands it its coordinates and seed there. The programs
themselves run on a GPU in `benchmarks/gpu.py`."""

import pytest
import torch
import torch.nn.functional as F

import hpfun
from hpfun import P
from hpfun.capture import trace
from hpfun.lower import lower, program_device
from hpfun.propagate import propagate

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
