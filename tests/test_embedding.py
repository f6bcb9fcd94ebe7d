"""A step with a vocab-parallel input embedding equals the unsharded step, with the minimum
collectives: the lookup is masked and local (Partial(sum) out), its gradient stays split."""

import pytest
import torch
import torch.nn.functional as F

import hpfun
from hpfun import P

V, D, C, B, S = 64, 8, 4, 4, 6  # vocab, embedding width, classes, batch, sequence (tokens < vocab, as in practice)
F32 = 4


def loss_fn(params, ids, y):
    h = torch.tanh(F.embedding(ids, params["emb"]))
    return F.cross_entropy(h.sum(1) @ params["w"], y)


def step(params, ids, y):
    grads, loss = torch.func.grad_and_value(loss_fn)(params, ids, y)
    return {k: p - 0.1 * grads[k] for k, p in params.items()}, loss


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    params = {"emb": torch.randn(V, D, generator=g, dtype=dtype), "w": torch.randn(D, C, generator=g, dtype=dtype)}
    return params, torch.randint(0, V, (B, S), generator=g), torch.randint(0, C, (B,), generator=g)


VOCAB = {"emb": P("tp", None), "w": P()}
LAYOUTS = {  # name: mesh axes, (param specs, ids spec, labels spec)
    "vocab": (("tp",), (VOCAB, P(), P())),
    "dp": (("dp",), ({"emb": P(), "w": P()}, P("dp"), P("dp"))),
    "dp_vocab": (("dp", "tp"), (VOCAB, P("dp"), P("dp"))),
}
CASES = [((1,), "vocab"), ((2,), "vocab"), ((4,), "vocab"), ((2,), "dp"), ((4,), "dp"), ((2, 2), "dp_vocab")]
IDS = [f"{'x'.join(map(str, s))}-{name}" for s, name in CASES]


def _sharded_step(shape, name):
    axes, specs = LAYOUTS[name]
    mesh = hpfun.Mesh.simulated(shape, axes)
    return hpfun.shard(step, mesh=mesh, in_specs=specs, out_specs=(specs[0], P()))


def _rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape,name", CASES, ids=IDS)
def test_step_equals_unsharded(shape, name):
    """Loss and both updated parameters equal the unsharded step (rel. error <= 1e-5, float32)."""
    params, ids, y = _data()
    ref_params, ref_loss = step(params, ids, y)
    new_params, loss = _sharded_step(shape, name)(params, ids, y)
    assert _rel_err(loss.full(), ref_loss) <= 1e-5
    for k in params:
        assert _rel_err(new_params[k].full(), ref_params[k]) <= 1e-5, k


def _expected(shape, name):
    """The analytic minimum: (kind, axes, bytes per rank) of each collective, in program order."""
    n = shape[-1]
    if n == 1:
        return []
    if name == "vocab":  # the looked-up rows, summed once in the forward; the gradient stays split
        return [("all_reduce", ("tp",), B * S * D * F32)]
    if name == "dp":  # the global label count, then the gradient of each parameter, then the loss
        dp = ("dp",)
        return [("all_reduce", dp, F32), ("all_reduce", dp, V * D * F32), ("all_reduce", dp, D * C * F32),
                ("all_reduce", dp, F32)]
    dp = ("dp",)  # dp_vocab: each rank's rows of its batch half; the vocab-split gradient over dp
    return [("all_reduce", ("tp",), B // 2 * S * D * F32), ("all_reduce", dp, F32),
            ("all_reduce", dp, V // 2 * D * F32), ("all_reduce", dp, D * C * F32), ("all_reduce", dp, F32)]


@pytest.mark.parametrize("shape,name", CASES, ids=IDS)
def test_collectives_are_the_minimum(shape, name):
    """lower() lists exactly the analytic minimum of collectives for each layout."""
    lowered = _sharded_step(shape, name).lower(*_data())
    assert [(c.kind, c.axes, c.bytes) for c in lowered.collectives] == _expected(shape, name)


def _layouts(lowered) -> dict:
    return {n.meta["hpfun_origin"]: n.meta["hpfun_layout"] for n in lowered.graph.nodes if "hpfun_origin" in n.meta}


@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_lookup_is_masked_and_local(shape):
    """The embedding of a vocab-split table gives Partial(sum) on the vocab axis: no gather."""
    lowered = _sharded_step(shape, "vocab" if len(shape) == 1 else "dp_vocab").lower(*_data())
    tp = lowered.program.mesh.axis_names.index("tp")
    assert _layouts(lowered)["embedding"].placements[tp] == hpfun.Partial("sum")


def test_gradient_is_computed_vocab_split():
    """The embedding's gradient is accumulated only for the rank's vocab block."""
    lowered = _sharded_step((2,), "vocab").lower(*_data())
    assert _layouts(lowered)["embedding_dense_backward"].placements[0] == hpfun.Shard(0)


@pytest.mark.parametrize("mode, weighted", [("mean", False), ("sum", True), ("max", False)])
def test_embedding_bag_trains_data_parallel(mode, weighted):
    """nn.EmbeddingBag (and its backward) runs whole on every rank: bags are given by offsets,
    which are data. A data-parallel AdamW step equals eager's, per_sample_weights included."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"bag": torch.nn.EmbeddingBag(V, D, mode=mode), "head": torch.nn.Linear(D, C)}).double()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))

    def train(m, o, ids, w, y):
        loss = F.cross_entropy(m["head"](m["bag"](ids, per_sample_weights=w if weighted else None)), y)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.detach()

    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    f = hpfun.shard(lambda ids, w, y: train(model, opt, ids, w, y), mesh=mesh, in_specs=(P("dp"), P("dp"), P("dp")),
                    out_specs=P())
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids, y = torch.randint(0, V, (B, S), generator=g), torch.randint(0, C, (B,), generator=g)
        w = torch.rand(B, S, generator=g, dtype=torch.float64)
        assert abs(f(ids, w, y).full().item() - train(ref, ref_opt, ids, w, y).item()) < 1e-12
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) < 1e-12
