"""Reference models written functionally (parameters as dicts), with their standard layouts.

Used by the demo, the tests and the benchmarks, so all three check the same programs.
"""

from __future__ import annotations

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
