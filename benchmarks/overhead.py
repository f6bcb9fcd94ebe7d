"""Per-step time of hpfun vs hand-written Megatron code vs DTensor, world size 2, gloo, CPU.

    python benchmarks/overhead.py [--workloads mlp mlp_gelu block gpt llama] [--reps 15] [--iters 20]
                                  [--no-compile] [--no-compile-hf] [--device cpu|cuda] [--out benchmarks/RESULTS.md]

Two processes, one thread each, tensor parallel over both (Megatron's layout). Workloads: an MLP
with ReLU (fwd+bwd), the same MLP with GELU and an MSE loss (fwd+bwd), a transformer block
(fwd+bwd), the reference GPT AdamW step of `hpfun.testing.models` (fwd+bwd+update), and a
Hugging Face `LlamaForCausalLM` training step from a tiny config (fwd+bwd+AdamW, the model and
optimizer closed over). Each runs as hpfun eager, hpfun `compile=True`, a hand-written Megatron
version (local shards, explicit all-reduces: f and g) and DTensor (`parallelize_module` with
ColwiseParallel / RowwiseParallel). Parameters are split once, as a training loop holds them.
After a warm-up the versions' losses must agree to 1e-4. Then every workload's every version is
timed in interleaved repetitions (a, b, c, ..., a, b, c, ...), each timing `iters` steps between
barriers; the table reports medians. Also measured per workload: the cost of a cache-hit call
of the hpfun step beyond running its program (us) and of its first call (trace + propagate +
lower, ms). The whole run takes about 5 minutes on 2 cores (compiling: about 2 of them).

`--device cuda` runs the same on the GPUs there are, one rank per GPU (at most two) over NCCL:
every tensor is made on the rank's GPU, and each timing waits for the GPU. On one GPU the world
is one rank, so the collectives are trivial and the ratios measure the per-rank program and its
kernels against the hand-written ones; its table goes to a section of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import hpfun
from hpfun import P
from hpfun.api import ShardedFunction
from hpfun.runtime.distributed import runtime_for
from hpfun.testing import models

WORKLOADS = ("mlp", "mlp_gelu", "block", "gpt", "llama")
DEVICE = torch.device("cpu")  # the rank's device: set by `worker`


def _gen(seed: int) -> torch.Generator:
    """A generator on the rank's device, seeded."""
    return torch.Generator(DEVICE).manual_seed(seed)


def _made_on_cpu(fn, *args, **kwargs):
    """`fn`'s tensors (made with CPU generators, as hpfun.testing.models makes them), moved to the device."""
    with torch.device("cpu"):
        out = fn(*args, **kwargs)
    return torch.utils._pytree.tree_map(lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t, out)


def _same(x):
    return x


# ---------------------------------------------------------------------------------------------
# Megatron's f and g, for the hand-written versions
# ---------------------------------------------------------------------------------------------


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


MEGATRON = {"reduce": _AllReduce.apply, "copy": _Copy.apply}


def _local(params: dict, specs: dict, rank: int, world: int) -> dict:
    """This rank's shard of each parameter ("tp" names the split dim), a leaf requiring grad."""
    out = {}
    for k, v in params.items():
        dims = specs[k].dims
        block = v.chunk(world, dims.index("tp"))[rank] if "tp" in dims else v
        out[k] = block.clone().requires_grad_()
    return out


def _presharded(params: dict, specs: dict, mesh) -> dict:
    """Parameters as a training loop holds them: this rank's shard, split once."""
    return {k: hpfun.Sharded.from_global(v, specs[k].to_layout(mesh, v.ndim)) for k, v in params.items()}


def _linear(weight, bias=None):
    """An nn.Linear computing x @ weight (+ bias)."""
    layer = torch.nn.Linear(weight.shape[0], weight.shape[1], bias=bias is not None)
    layer.weight.data.copy_(weight.t())
    if bias is not None:
        layer.bias.data.copy_(bias)
    return layer


def _parallelized(module, device_mesh, colwise=(), rowwise=()):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {name: ColwiseParallel() for name in colwise} | {name: RowwiseParallel() for name in rowwise}
    return parallelize_module(module, device_mesh, plan)


# ---------------------------------------------------------------------------------------------
# Workloads: each written once in the global view (hpfun) and once per rank (hand, DTensor)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Workload:
    title: str
    versions: dict  # name -> () -> the step's loss (a tensor or a Sharded value)
    step: ShardedFunction  # the eager hpfun step, whose runtime the call cost subtracts
    call: Callable  # one cache-hit call of it
    fresh: Callable  # () -> a new eager hpfun step, and a call of it, for the first-call cost
    notes: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Env:
    rank: int
    world: int
    mesh: hpfun.Mesh
    device_mesh: object
    compile: bool
    compile_hf: bool


def _hpfun_versions(make, call, compiled: bool, notes: list, why_not: str = "") -> tuple[dict, ShardedFunction]:
    """hpfun's eager step (`make(False)`) and, if `compiled`, its compile=True one, each as `call(step)`."""
    step = make(False)
    versions = {"hpfun": call(step)}
    if compiled:
        versions["hpfun_compiled"] = call(make(True))
    else:
        notes.append(f"compile=True not measured{why_not}")
    return versions, step


# -- the MLPs ---------------------------------------------------------------------------------

MLP_SPECS = {"w1": P(None, "tp"), "w2": P("tp", None)}


def mlp_params(d=256, ffn=1024, seed=0):
    g = _gen(seed)
    return {"w1": torch.randn(d, ffn, generator=g) * d**-0.5, "w2": torch.randn(ffn, d, generator=g) * ffn**-0.5}


def mlp_loss(p, x, reduce=_same):
    return reduce(torch.relu(x @ p["w1"]) @ p["w2"]).pow(2).mean()


def mlp_gelu_loss(p, x, y, reduce=_same):
    return F.mse_loss(reduce(F.gelu(x @ p["w1"]) @ p["w2"]), y)


class MLPModule(torch.nn.Module):
    def __init__(self, p, act):
        super().__init__()
        self.fc1, self.fc2, self.act = _linear(p["w1"]), _linear(p["w2"]), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _grad_step(loss_fn, specs, mesh, n_data, compile=False):
    return hpfun.shard(torch.func.grad_and_value(loss_fn), mesh=mesh, in_specs=(specs,) + (P(),) * n_data,
                       out_specs=(specs, P()), compile=compile)


def _hand_grad_step(loss_fn, local: dict, data: tuple, **extra):
    def step():
        for v in local.values():
            v.grad = None
        loss = loss_fn(local, *data, **extra)
        loss.backward()
        return loss

    return step


def _dtensor_grad_step(model, loss_of):
    def step():
        model.zero_grad(set_to_none=True)
        loss = loss_of(model)
        loss.backward()
        return loss

    return step


def build_mlp(env: Env, gelu: bool) -> Workload:
    g = _gen(1)
    x = torch.randn(8, 256, generator=g)
    y = torch.randn(8, 256, generator=g)
    loss_fn, data = (mlp_gelu_loss, (x, y)) if gelu else (mlp_loss, (x,))
    params = mlp_params()
    held = _presharded(params, MLP_SPECS, env.mesh)
    notes = []
    versions, step = _hpfun_versions(lambda c: _grad_step(loss_fn, MLP_SPECS, env.mesh, len(data), c),
                                     lambda s: lambda: s(held, *data)[1], env.compile, notes)
    versions["hand"] = _hand_grad_step(loss_fn, _local(params, MLP_SPECS, env.rank, env.world), data,
                                       reduce=_AllReduce.apply)
    model = _parallelized(MLPModule(params, F.gelu if gelu else torch.relu), env.device_mesh, ["fc1"], ["fc2"])
    loss_of = (lambda m: F.mse_loss(m(x), y)) if gelu else (lambda m: m(x).pow(2).mean())
    versions["dtensor"] = _dtensor_grad_step(model, loss_of)

    def fresh():
        s = _grad_step(loss_fn, MLP_SPECS, env.mesh, len(data))
        return s, lambda: s(held, *data)

    title = ("MLP, GELU + MSE, fwd+bwd" if gelu else "MLP, ReLU, fwd+bwd") + " (batch 8, d 256, ffn 1024)"
    return Workload(title, versions, step, lambda: step(held, *data), fresh, notes)


# -- the transformer block ----------------------------------------------------------------------

BLOCK_SPECS = {"ln1": P(), "wq": P(None, "tp"), "wk": P(None, "tp"), "wv": P(None, "tp"), "wo": P("tp", None),
               "ln2": P(), "w1": P(None, "tp"), "w2": P("tp", None)}


def block_params(d=64, seed=0):
    g = _gen(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[0] ** -0.5

    return {"ln1": torch.ones(d), "wq": w(d, d), "wk": w(d, d), "wv": w(d, d), "wo": w(d, d),
            "ln2": torch.ones(d), "w1": w(d, 4 * d), "w2": w(4 * d, d)}


def attention(x, wq, wk, wv, wo, heads):
    """Causal self-attention over `heads` heads (a rank's own heads when its weights are shards)."""
    b, s, _ = x.shape
    q, k, v = (t.view(b, s, heads, -1).transpose(1, 2) for t in (x @ wq, x @ wk, x @ wv))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    out = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
    return out.transpose(1, 2).reshape(b, s, -1) @ wo


def block_loss(p, x, heads=4, reduce=_same, copy=_same):
    """`reduce` and `copy` are Megatron's g and f when written by hand; identities in the global view."""
    h = x + reduce(attention(copy(F.layer_norm(x, x.shape[-1:], p["ln1"])), p["wq"], p["wk"], p["wv"], p["wo"], heads))
    h = h + reduce(torch.relu(copy(F.layer_norm(h, h.shape[-1:], p["ln2"])) @ p["w1"]) @ p["w2"])
    return h.pow(2).mean()


class BlockModule(torch.nn.Module):
    def __init__(self, p, head_dim):
        super().__init__()
        self.head_dim = head_dim
        for k in ("wq", "wk", "wv", "wo"):
            setattr(self, k, _linear(p[k]))
        self.fc1, self.fc2 = _linear(p["w1"]), _linear(p["w2"])
        self.ln1, self.ln2 = torch.nn.Parameter(p["ln1"].clone()), torch.nn.Parameter(p["ln2"].clone())

    def forward(self, x):
        b, s, d = x.shape
        y = F.layer_norm(x, (d,), self.ln1)
        q, k, v = (m(y).view(b, s, -1, self.head_dim).transpose(1, 2) for m in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
        h = x + self.wo(att.transpose(1, 2).reshape(b, s, -1))
        return h + self.fc2(torch.relu(self.fc1(F.layer_norm(h, (d,), self.ln2))))


def build_block(env: Env) -> Workload:
    x = torch.randn(8, 16, 64, generator=_gen(1))
    params = block_params()
    held = _presharded(params, BLOCK_SPECS, env.mesh)
    notes = []
    versions, step = _hpfun_versions(lambda c: _grad_step(block_loss, BLOCK_SPECS, env.mesh, 1, c),
                                     lambda s: lambda: s(held, x)[1], env.compile, notes)
    versions["hand"] = _hand_grad_step(block_loss, _local(params, BLOCK_SPECS, env.rank, env.world), (x,),
                                       heads=4 // env.world, **MEGATRON)
    model = _parallelized(BlockModule(params, head_dim=16), env.device_mesh, ["wq", "wk", "wv", "fc1"], ["wo", "fc2"])
    versions["dtensor"] = _dtensor_grad_step(model, lambda m: m(x).pow(2).mean())

    def fresh():
        s = _grad_step(block_loss, BLOCK_SPECS, env.mesh, 1)
        return s, lambda: s(held, x)

    return Workload("transformer block fwd+bwd (batch 8, seq 16, d 64, 4 heads)", versions, step,
                    lambda: step(held, x), fresh, notes)


# -- the reference GPT AdamW step -----------------------------------------------------------------

GPT = {"vocab": 256, "seq": 32, "d": 64, "heads": models.GPT["heads"], "layers": 2}  # gpt_step: the default heads
GPT_BATCH = 8


def gpt_loss_tp(p, idx, targets, heads, reduce=_same, copy=_same):
    """`models.gpt_loss` written for a rank's shards: its own `heads`, Megatron's f and g."""
    x = F.embedding(idx, p["wte"]) + p["wpe"]
    for i in range(GPT["layers"]):
        h = copy(models._ln(x, p, f"h{i}.ln1"))
        x = x + reduce(attention(h, p[f"h{i}.wq"], p[f"h{i}.wk"], p[f"h{i}.wv"], p[f"h{i}.wo"], heads))
        h = F.gelu(copy(models._ln(x, p, f"h{i}.ln2")) @ p[f"h{i}.w1"] + p[f"h{i}.b1"])
        x = x + reduce(h @ p[f"h{i}.w2"]) + p[f"h{i}.b2"]
    logits = models._ln(x, p, "ln_f") @ p["wte"].t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GPTModule(torch.nn.Module):
    """The reference GPT as an nn.Module (the same parameters), for DTensor's plan."""

    def __init__(self, p):
        super().__init__()
        self.params = torch.nn.ParameterDict({k.replace(".", "_"): p[k].clone() for k in p
                                              if not k.endswith((".wq", ".wk", ".wv", ".wo", ".w1", ".b1", ".w2"))})
        for i in range(GPT["layers"]):
            for k in ("wq", "wk", "wv", "wo"):
                self.add_module(f"h{i}_{k}", _linear(p[f"h{i}.{k}"]))
            self.add_module(f"h{i}_fc1", _linear(p[f"h{i}.w1"], p[f"h{i}.b1"]))
            self.add_module(f"h{i}_fc2", _linear(p[f"h{i}.w2"]))

    def _ln(self, x, name):
        return F.layer_norm(x, x.shape[-1:], self.params[f"{name}_w"], self.params[f"{name}_b"])

    def forward(self, idx):
        b, s = idx.shape
        hd = GPT["d"] // GPT["heads"]
        x = F.embedding(idx, self.params["wte"]) + self.params["wpe"]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        for i in range(GPT["layers"]):
            y = self._ln(x, f"h{i}_ln1")
            q, k, v = (getattr(self, f"h{i}_{n}")(y).view(b, s, -1, hd).transpose(1, 2) for n in ("wq", "wk", "wv"))
            att = torch.softmax((q @ k.transpose(-1, -2) / hd**0.5).masked_fill(~causal, float("-inf")), -1) @ v
            x = x + getattr(self, f"h{i}_wo")(att.transpose(1, 2).reshape(b, s, -1))
            h = F.gelu(getattr(self, f"h{i}_fc1")(self._ln(x, f"h{i}_ln2")))
            x = x + getattr(self, f"h{i}_fc2")(h) + self.params[f"h{i}_b2"]
        logits = self._ln(x, "ln_f") @ self.params["wte"].t()
        return logits


def _adamw_in_place(named: dict, state: dict) -> dict:
    """`models.adamw` applied to parameters in place (the hand-written and DTensor steps)."""
    with torch.no_grad():
        new, state = models.adamw({k: p.detach() for k, p in named.items()}, {k: p.grad for k, p in named.items()}, state)
        for k, p in named.items():
            p.copy_(new[k])
    return state


def build_gpt(env: Env) -> Workload:
    from torch.distributed.tensor.experimental import implicit_replication

    params = _made_on_cpu(models.gpt_init, seed=0, **GPT)
    idx, targets = _made_on_cpu(models.gpt_data, GPT_BATCH, seed=1, **GPT)
    specs = models.gpt_specs(params, tp="tp")
    state_specs = {"m": specs, "v": specs, "step": P()}
    zeros = models.adamw_init(params)
    init = (_presharded(params, specs, env.mesh),
            {"m": _presharded(zeros["m"], specs, env.mesh), "v": _presharded(zeros["v"], specs, env.mesh),
             "step": hpfun.Sharded.from_global(zeros["step"], P().to_layout(env.mesh, 0))})

    def make(compile):
        return hpfun.shard(models.gpt_step, mesh=env.mesh, in_specs=(specs, state_specs, P(), P()),
                           out_specs=(specs, state_specs, P()), compile=compile)

    def call(step):
        held = list(init)  # each step trains its own copy, from the same start

        def run():
            held[0], held[1], loss = step(held[0], held[1], idx, targets)
            return loss
        return run

    notes = []
    versions, step = _hpfun_versions(make, call, env.compile, notes)
    local = _local(params, specs, env.rank, env.world)
    hand_state = [models.adamw_init({k: v.detach() for k, v in local.items()})]

    def hand():
        for v in local.values():
            v.grad = None
        loss = gpt_loss_tp(local, idx, targets, GPT["heads"] // env.world, **MEGATRON)
        loss.backward()
        hand_state[0] = _adamw_in_place(local, hand_state[0])
        return loss

    versions["hand"] = hand
    layers = range(GPT["layers"])
    model = _parallelized(GPTModule(params), env.device_mesh,
                          [f"h{i}_{n}" for i in layers for n in ("wq", "wk", "wv", "fc1")],
                          [f"h{i}_{n}" for i in layers for n in ("wo", "fc2")])
    named = dict(model.named_parameters())
    with implicit_replication():
        dt_state = [models.adamw_init({k: v.detach() for k, v in named.items()})]

    def dtensor():
        model.zero_grad(set_to_none=True)
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        with implicit_replication():  # the optimizer's step count is a plain tensor
            dt_state[0] = _adamw_in_place(named, dt_state[0])
        return loss

    versions["dtensor"] = dtensor
    notes.append("hand-written and DTensor update their parameters in place with the same models.adamw")

    def fresh():
        s = make(False)
        return s, lambda: s(*init, idx, targets)

    title = (f"GPT AdamW step, {GPT['layers']} layers (batch {GPT_BATCH}, seq {GPT['seq']}, d {GPT['d']}, "
             f"{GPT['heads']} heads, vocab {GPT['vocab']})")
    return Workload(title, versions, step, call(step), fresh, notes)


# -- Hugging Face Llama, tensor parallel ----------------------------------------------------------

LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64}
LLAMA_BATCH, LLAMA_SEQ = 4, 32
LLAMA_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
LLAMA_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _llama(world: int = 1, rank: int = 0):
    """The tiny Llama (seed 0); with `world` > 1, this rank's Megatron shard of it: its heads,
    its slice of the MLP, and hooks for f (after each norm feeding attention or the MLP) and g
    (after o_proj and down_proj)."""
    import transformers

    torch.manual_seed(0)
    full = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, attn_implementation="sdpa"))
    if world == 1:
        return full
    local_config = LLAMA | {"num_attention_heads": LLAMA["num_attention_heads"] // world,
                            "num_key_value_heads": LLAMA["num_key_value_heads"] // world,
                            "intermediate_size": LLAMA["intermediate_size"] // world}
    local = transformers.LlamaForCausalLM(transformers.LlamaConfig(**local_config, attn_implementation="sdpa"))
    with torch.no_grad():
        for name, p in local.named_parameters():
            source = full.get_parameter(name)
            if name.endswith(tuple(f"{m}.weight" for m in LLAMA_COLWISE)):
                source = source.chunk(world, 0)[rank]
            elif name.endswith(tuple(f"{m}.weight" for m in LLAMA_ROWWISE)):
                source = source.chunk(world, 1)[rank]
            p.copy_(source)
    for layer in local.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.register_forward_hook(lambda m, i, out: _Copy.apply(out))
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.register_forward_hook(lambda m, i, out: _AllReduce.apply(out))
    return local


def _train_step(model, opt, ids):
    def step():
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def build_llama(env: Env) -> Workload:
    ids = torch.randint(0, LLAMA["vocab_size"], (LLAMA_BATCH, LLAMA_SEQ), generator=_gen(1))

    def make(compile):
        model = _llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def train_step(ids):  # as written for eager PyTorch (see _train_step)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return hpfun.shard(train_step, mesh=env.mesh, in_specs=(P(),), out_specs=P(), state_specs=models.LLAMA_TP,
                           compile=compile)

    notes = []
    versions, step = _hpfun_versions(make, lambda s: lambda: s(ids), env.compile and env.compile_hf, notes,
                                     "" if not env.compile else " (--no-compile-hf)")
    hand = _llama(env.world, env.rank)
    versions["hand"] = _train_step(hand, torch.optim.AdamW(hand.parameters(), lr=1e-3), ids)
    layers = range(LLAMA["num_hidden_layers"])
    model = _parallelized(_llama(), env.device_mesh, [f"model.layers.{i}.{m}" for i in layers for m in LLAMA_COLWISE],
                          [f"model.layers.{i}.{m}" for i in layers for m in LLAMA_ROWWISE])
    # its embedding and norms stay plain tensors beside the DTensor matrices: AdamW's foreach path
    # (the default on a GPU) refuses the mix, so DTensor's step takes the per-parameter loop there
    versions["dtensor"] = _train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False), ids)
    notes.append("the model and AdamW closed over (hpfun lifts and writes back their state), stock HF loss")
    if DEVICE.type == "cuda":
        notes.append("DTensor's AdamW runs its per-parameter loop (foreach refuses plain tensors beside DTensors)")

    def fresh():
        s = make(False)
        return s, lambda: s(ids)

    title = (f"HF LlamaForCausalLM AdamW step, {LLAMA['num_hidden_layers']} layers (batch {LLAMA_BATCH}, "
             f"seq {LLAMA_SEQ}, hidden {LLAMA['hidden_size']}, {LLAMA['num_attention_heads']} heads / "
             f"{LLAMA['num_key_value_heads']} kv, vocab {LLAMA['vocab_size']})")
    return Workload(title, versions, step, lambda: step(ids), fresh, notes)


BUILDERS = {"mlp": lambda env: build_mlp(env, gelu=False), "mlp_gelu": lambda env: build_mlp(env, gelu=True),
            "block": build_block, "gpt": build_gpt, "llama": build_llama}


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _time(fn, iters: int) -> float:
    _sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    dist.barrier()
    return (time.perf_counter() - start) / iters


def _loss(out) -> float:
    return float(out.local if isinstance(out, hpfun.Sharded) else out.detach())


def check_losses(name: str, workload: Workload) -> dict:
    """Warm every version up (3 steps) and check their last losses agree to 1e-4."""
    losses = {}
    for version, fn in workload.versions.items():
        for _ in range(3):
            out = fn()
        losses[version] = _loss(out)
    spread = max(losses.values()) - min(losses.values())
    if spread > 1e-4 * max(1.0, abs(losses["hand"])):
        raise AssertionError(f"{name}: the versions' losses differ: {losses}")
    return losses


def call_cost(workload: Workload, reps: int, iters: int) -> float:
    """The cost of a cache-hit call beyond running its program, in us: calls timed back to back
    (no barrier inside the timed stretch), less the time spent in the runtime's `run` inside
    them (the runtime's `run` wrapped), so the difference carries no noise of the collectives."""
    runtime = runtime_for(workload.step.mesh)
    inner, run = [0.0], runtime.run

    def timed_run(*a, **k):
        t0 = time.perf_counter()
        out = run(*a, **k)
        inner[0] += time.perf_counter() - t0
        return out

    runtime.run = timed_run
    try:
        costs = []
        for _ in range(reps):
            _sync()
            dist.barrier()
            inner[0] = 0.0
            start = time.perf_counter()
            for _ in range(iters):
                workload.call()
            costs.append((time.perf_counter() - start - inner[0]) / iters)
    finally:
        runtime.run = run
    return statistics.median(costs) * 1e6


def first_call(workload: Workload) -> float:
    """A new step's first call (trace, propagate, lower) less a cache-hit call, in ms."""
    step, call = workload.fresh()
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    steady = _time(call, 3)
    return (first - steady) * 1e3


def worker(rank: int, world: int, port: int, args, queue):
    global DEVICE
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if getattr(args, "device", "cpu") == "cuda":
        DEVICE = torch.device("cuda", rank)
        torch.cuda.set_device(DEVICE)
        torch.set_default_device(DEVICE)  # the workloads', models' and hpfun's tensors on the rank's GPU
    mesh = hpfun.Mesh.distributed((world,), ("tp",))
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh(DEVICE.type, (world,), mesh_dim_names=("tp",))
    env = Env(rank, world, mesh, device_mesh, compile=not args.no_compile, compile_hf=not args.no_compile_hf)
    workloads, setup = {}, {}
    for name in args.workloads:
        start = time.perf_counter()
        workloads[name] = BUILDERS[name](env)
        check_losses(name, workloads[name])  # also the first calls: tracing, compiling
        setup[name] = time.perf_counter() - start
    times = {name: {v: [] for v in w.versions} for name, w in workloads.items()}
    for _ in range(args.reps):  # interleaved: every workload's every version once per repetition
        for name, workload in workloads.items():
            for version, fn in workload.versions.items():
                times[name][version].append(_time(fn, args.iters))
    rows = {}
    for name, workload in workloads.items():
        rows[name] = {"title": workload.title, "notes": workload.notes, "setup_s": setup[name],
                      "ms": {v: statistics.median(t) * 1e3 for v, t in times[name].items()},
                      "call_us": call_cost(workload, reps=9, iters=max(args.iters, 20)),
                      "first_ms": first_call(workload)}
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

SECTION = "## Per-step overhead: hpfun vs hand-written vs DTensor"
GPU_SECTION = "## Per-step overhead on a GPU: hpfun vs hand-written vs DTensor"


def report(rows: dict, command: str, where: str = "world size 2, gloo, CPU, one thread per rank",
           section: str = SECTION) -> str:
    def cell(t, v, fmt="{:.3f}"):
        return fmt.format(t[v]) if v in t else "-"

    def ratio(t, a, b, fmt="{:.2f}"):
        return fmt.format(t[a] / t[b]) if a in t and b in t else "-"

    lines = [section, "",
             f"Command: `{command}` ({where}, tensor parallel; medians of "
             "repetitions interleaved over every workload and version).", "",
             "| workload | hpfun (ms) | hpfun, compile=True (ms) | hand-written (ms) | DTensor (ms) | hpfun / hand "
             "| compiled / hand | DTensor / hpfun | cache hit beyond the program (us) | first call (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows.values():
        t = row["ms"]
        lines.append(f"| {row['title']} | {cell(t, 'hpfun')} | {cell(t, 'hpfun_compiled')} | {cell(t, 'hand')} "
                     f"| {cell(t, 'dtensor')} | {ratio(t, 'hpfun', 'hand')} | {ratio(t, 'hpfun_compiled', 'hand')} "
                     f"| {ratio(t, 'dtensor', 'hpfun')} | {row['call_us']:.1f} | {row['first_ms']:.0f} |")
    notes = [f"- {row['title'].split(' (')[0]}: {'; '.join(row['notes'])}." for row in rows.values() if row["notes"]]
    setup = ", ".join(f"{name} {row['setup_s']:.0f} s" for name, row in rows.items())
    lines += ["", *notes, f"- Set-up per workload (building, first calls, compiling, warm-up): {setup}."]
    return "\n".join(lines) + "\n"


def write_section(path: str, text: str, section: str = SECTION) -> None:
    """Replace a benchmark's section of a markdown file (or add it after the title)."""
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(old):
        new = pattern.sub(lambda _: text + "\n", old, count=1)
    else:
        head, _, rest = old.partition("\n")
        new = f"{head}\n\n{text}\n{rest.lstrip()}"
    with open(path, "w") as f:
        f.write(new)


def on_two_ranks(worker, args, world: int = 2):
    """`worker(rank, world, port, args, queue)` on `world` ranks (two gloo ranks, unless GPUs
    are the ranks; a free local port); what rank 0 puts in the queue."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, port, args, queue), nprocs=world)
    return queue.get()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="leave out hpfun's compile=True versions")
    parser.add_argument("--no-compile-hf", action="store_true",
                        help="leave out the HF Llama step's compile=True version (inductor takes 1-2 minutes on it)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one rank per GPU (at most two), NCCL")
    parser.add_argument("--out", default=None, help="write the table into this markdown file (its section only)")
    args = parser.parse_args()
    command = "python " + " ".join(sys.argv)
    if args.device == "cuda":
        world = min(2, torch.cuda.device_count())
        if world == 0:
            parser.error("--device cuda: torch sees no GPU here")
        where = (f"world size {world}, NCCL, {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
                 "each timing waits for the GPU")
        text = report(on_two_ranks(worker, args, world), command, where, GPU_SECTION)
    else:
        text = report(on_two_ranks(worker, args), command)
    print(text)
    if args.out:
        write_section(args.out, text, GPU_SECTION if args.device == "cuda" else SECTION)


if __name__ == "__main__":
    main()
