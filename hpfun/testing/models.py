"""Reference models written functionally (parameters as dicts), with their standard layouts.

Used by the demo, the tests and the benchmarks, so all three check the same programs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hpfun.layout import P


def mlp_init(d_in: int = 16, d_hidden: int = 32, n_classes: int = 8, *, dtype=torch.float32, seed: int = 0) -> dict:
    """Parameters of a 2-layer MLP classifier."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return {
        "w1": normal(d_in, d_hidden, scale=d_in**-0.5),
        "b1": normal(d_hidden, scale=0.1),
        "w2": normal(d_hidden, n_classes, scale=d_hidden**-0.5),
        "b2": normal(n_classes, scale=0.1),
    }


def mlp_data(batch: int = 8, d_in: int = 16, n_classes: int = 8, *, dtype=torch.float32, seed: int = 1):
    """Synthetic inputs and integer labels that a linear-ish rule can learn."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_in, generator=g)
    y = (x[:, :n_classes].argmax(1) + (x[:, 0] > 1).long()) % n_classes
    return x.to(dtype), y


def mlp_loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return F.cross_entropy(logits, y)


def mlp_step(params: dict, x: torch.Tensor, y: torch.Tensor, lr: float = 0.1):
    """One SGD step: returns (new params, loss)."""
    grads, loss = torch.func.grad_and_value(mlp_loss)(params, x, y)
    return {k: p - lr * grads[k] for k, p in params.items()}, loss


REPLICATED = {"w1": P(), "b1": P(), "w2": P(), "b2": P()}
# Megatron: first weight split by columns, second by rows; the hidden layer stays split.
MEGATRON = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None), "b2": P()}
# Class (vocab) parallel head: the output layer split over classes.
CLASS_SHARDED = {"w1": P(), "b1": P(), "w2": P(None, "tp"), "b2": P("tp")}

# name -> (param specs, x spec, y spec, mesh axes used)
MLP_LAYOUTS = {
    "dp": (REPLICATED, P("dp"), P("dp")),
    "tp": (MEGATRON, P(), P()),
    "dp_tp": (MEGATRON, P("dp"), P("dp")),
    "class": (CLASS_SHARDED, P(), P()),
    "dp_class": (CLASS_SHARDED, P("dp"), P("dp")),
}


def mlp_dropout_loss(params: dict, x: torch.Tensor, y: torch.Tensor, p: float = 0.25):
    """The MLP with dropout on the hidden layer; returns (loss, dropout mask) for checking."""
    h = torch.relu(x @ params["w1"] + params["b1"])
    mask = F.dropout(torch.ones_like(h), p, training=True)  # 0 or 1/(1-p) per element
    logits = (h * mask) @ params["w2"] + params["b2"]
    return F.cross_entropy(logits, y), mask


def mlp_dropout_step(params: dict, x: torch.Tensor, y: torch.Tensor, lr: float = 0.1):
    """One SGD step with dropout: returns (new params, loss, mask)."""
    grads, (loss, mask) = torch.func.grad_and_value(mlp_dropout_loss, has_aux=True)(params, x, y)
    return {k: p - lr * grads[k] for k, p in params.items()}, loss, mask


# ---------------------------------------------------------------------------------------------
# A GPT-2-style decoder (token + position embeddings, pre-norm blocks with causal attention and
# a GELU MLP, tied output head) and a functional AdamW
# ---------------------------------------------------------------------------------------------

GPT = {"vocab": 128, "seq": 8, "d": 16, "heads": 2, "layers": 2}


def gpt_init(*, seed: int = 0, **sizes) -> dict:
    cfg = GPT | sizes
    g = torch.Generator().manual_seed(seed)
    d, v = cfg["d"], cfg["vocab"]

    def w(*shape, scale=0.02):
        return torch.randn(*shape, generator=g) * scale

    params = {"wte": w(v, d), "wpe": w(cfg["seq"], d), "ln_f.w": torch.ones(d), "ln_f.b": torch.zeros(d)}
    for i in range(cfg["layers"]):
        params |= {f"h{i}.ln1.w": torch.ones(d), f"h{i}.ln1.b": torch.zeros(d),
                   f"h{i}.wq": w(d, d), f"h{i}.wk": w(d, d), f"h{i}.wv": w(d, d), f"h{i}.wo": w(d, d),
                   f"h{i}.ln2.w": torch.ones(d), f"h{i}.ln2.b": torch.zeros(d),
                   f"h{i}.w1": w(d, 4 * d), f"h{i}.b1": torch.zeros(4 * d), f"h{i}.w2": w(4 * d, d), f"h{i}.b2": torch.zeros(d)}
    return params


def gpt_data(batch: int = 4, *, seed: int = 1, **sizes):
    cfg = GPT | sizes
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg["vocab"], (batch, cfg["seq"] + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _ln(x, p, name):
    return F.layer_norm(x, x.shape[-1:], p[f"{name}.w"], p[f"{name}.b"])


def _attention(x, p, i, heads):
    b, s, d = x.shape
    q, k, v = (t.view(b, s, heads, d // heads).transpose(1, 2) for t in (x @ p[f"h{i}.wq"], x @ p[f"h{i}.wk"], x @ p[f"h{i}.wv"]))
    scores = (q @ k.transpose(-1, -2)) / (d // heads) ** 0.5
    causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    att = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
    return att.transpose(1, 2).reshape(b, s, d) @ p[f"h{i}.wo"]


def gpt_loss(params: dict, idx: torch.Tensor, targets: torch.Tensor, *, heads: int = GPT["heads"], seq_split=None,
             pins: str = "all"):
    """Next-token cross-entropy. `seq_split` (a P spec, e.g. P(None, "tp")) lays the GPT out as
    Megatron's sequence parallelism: the residual stream and the norms split along the sequence;
    each norm's output gathered whole for the column-parallel matmuls, its gradient
    reduce-scattered back (Megatron's g); each block's row-parallel output reduce-scattered onto
    the stream, its gradient gathered whole (g's conjugate). With `pins="embedding"` only the
    embedding output is pinned, and propagation finds the rest."""
    pin = whole = scatter = (lambda x: x)
    if seq_split is not None:
        gathered = P(*seq_split.dims[:1])  # the batch stays as it was split
        pin = lambda x: _constrain(x, seq_split)  # noqa: E731
    if seq_split is not None and pins == "all":
        whole = lambda x: _constrain(x, gathered, grad=seq_split)  # noqa: E731
        scatter = lambda x: _constrain(x, seq_split, grad=gathered)  # noqa: E731
    x = pin(F.embedding(idx, params["wte"]) + params["wpe"])
    layers = sum(1 for k in params if k.endswith(".wq"))
    for i in range(layers):
        x = x + scatter(_attention(whole(_ln(x, params, f"h{i}.ln1")), params, i, heads))
        h = F.gelu(whole(_ln(x, params, f"h{i}.ln2")) @ params[f"h{i}.w1"] + params[f"h{i}.b1"])
        x = x + scatter(h @ params[f"h{i}.w2"]) + params[f"h{i}.b2"]
    logits = whole(_ln(x, params, "ln_f")) @ params["wte"].t()  # tied output head
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _constrain(x, spec, grad=None):
    from hpfun.constrain import constrain

    return constrain(x, spec, grad=grad)


def adamw(params: dict, grads: dict, state: dict, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01):
    """One AdamW update written with torch ops: returns (new params, new state)."""
    step = state["step"] + 1
    new_p, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        new_m[k] = betas[0] * state["m"][k] + (1 - betas[0]) * grads[k]
        new_v[k] = betas[1] * state["v"][k] + (1 - betas[1]) * grads[k] * grads[k]
        m_hat = new_m[k] / (1 - torch.pow(betas[0], step))
        v_hat = new_v[k] / (1 - torch.pow(betas[1], step))
        new_p[k] = p - lr * (m_hat / (torch.sqrt(v_hat) + eps) + weight_decay * p)
    return new_p, {"m": new_m, "v": new_v, "step": step}


def adamw_init(params: dict) -> dict:
    zeros = {k: torch.zeros_like(p) for k, p in params.items()}
    return {"m": zeros, "v": dict(zeros), "step": torch.zeros(())}


def gpt_step(params: dict, state: dict, idx: torch.Tensor, targets: torch.Tensor, seq_split=None, pins: str = "all"):
    """One AdamW training step of the GPT: returns (params, optimizer state, loss)."""
    grads, loss = torch.func.grad_and_value(gpt_loss)(params, idx, targets, seq_split=seq_split, pins=pins)
    params, state = adamw(params, grads, state)
    return params, state, loss


def gpt_specs(params: dict, *, tp: str | None = None, vocab: str | None = None) -> dict:
    """Megatron tensor parallel over `tp` (heads and MLP) and/or a vocab-split embedding over `vocab`."""
    specs = {k: P() for k in params}
    if tp:
        for k in params:
            if k.endswith((".wq", ".wk", ".wv", ".w1")):
                specs[k] = P(None, tp)
            elif k.endswith((".wo", ".w2")):
                specs[k] = P(tp, None)
            elif k.endswith(".b1"):
                specs[k] = P(tp)
    if vocab:
        specs["wte"] = P(vocab, None)
    return specs


# ---------------------------------------------------------------------------------------------
# A small CNN classifier: conv, group norm, pooling
# ---------------------------------------------------------------------------------------------


def cnn_init(*, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * (1.0 / math.prod(shape[1:])) ** 0.5

    return {"c1.w": w(8, 3, 3, 3), "c1.b": torch.zeros(8), "gn.w": torch.ones(8), "gn.b": torch.zeros(8),
            "c2.w": w(16, 8, 3, 3), "c2.b": torch.zeros(16), "fc.w": w(16, 10), "fc.b": torch.zeros(10)}


def cnn_data(batch: int = 8, *, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)


def cnn_loss(p: dict, x: torch.Tensor, y: torch.Tensor):
    h = F.conv2d(x, p["c1.w"], p["c1.b"], padding=1)
    h = F.max_pool2d(torch.relu(F.group_norm(h, 4, p["gn.w"], p["gn.b"])), 2)
    h = torch.relu(F.conv2d(h, p["c2.w"], p["c2.b"], padding=1)).mean((2, 3))
    return F.cross_entropy(h @ p["fc.w"] + p["fc.b"], y)


def cnn_step(params: dict, x: torch.Tensor, y: torch.Tensor, lr: float = 0.1):
    grads, loss = torch.func.grad_and_value(cnn_loss)(params, x, y)
    return {k: v - lr * grads[k] for k, v in params.items()}, loss


CNN_CHANNEL_SPLIT = {"c1.w": P("tp"), "c1.b": P("tp"), "gn.w": P("tp"), "gn.b": P("tp"),
                     "c2.w": P("tp"), "c2.b": P("tp"), "fc.w": P("tp", None), "fc.b": P()}


# Megatron tensor parallelism over "tp" for Hugging Face models, by parameter name patterns (the
# plans README gives): column-parallel q/k/v and MLP in, row-parallel attention and MLP out.
LLAMA_TP = {
    "layers.*.self_attn.q_proj.weight": P("tp", None),
    "layers.*.self_attn.k_proj.weight": P("tp", None),
    "layers.*.self_attn.v_proj.weight": P("tp", None),
    "layers.*.self_attn.o_proj.weight": P(None, "tp"),
    "layers.*.mlp.gate_proj.weight": P("tp", None),
    "layers.*.mlp.up_proj.weight": P("tp", None),
    "layers.*.mlp.down_proj.weight": P(None, "tp"),
}
# GPT-2's Conv1D weights are (in, out): column-parallel splits dim 1, row-parallel dim 0
GPT2_TP = {
    "h.*.attn.c_attn.weight": P(None, "tp"), "h.*.attn.c_attn.bias": P("tp"),
    "h.*.attn.c_proj.weight": P("tp", None),
    "h.*.mlp.c_fc.weight": P(None, "tp"), "h.*.mlp.c_fc.bias": P("tp"),
    "h.*.mlp.c_proj.weight": P("tp", None),
}


def llama3_8b(layers: int = 32):
    """A Llama-3-8B-sized `LlamaForCausalLM` (d 4096, GQA 32/8 heads, MLP 14336, vocab 128256,
    bfloat16) on the meta device, with `layers` layers: for planning at full scale, nothing
    allocated. Needs `transformers`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      attn_implementation="sdpa", use_cache=False)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)
