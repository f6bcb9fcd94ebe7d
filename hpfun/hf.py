"""A Hugging Face model's own tensor-parallel plan, as hpfun `state_specs`.

`transformers` models carry a plan naming, per module or parameter pattern, how tensor
parallelism splits it (`model.tp_plan`, built from `config.base_model_tp_plan` and the head's
`_tp_plan`): "colwise" (a Linear's output features split), "rowwise" (its input features),
"embedding_rowwise" (the vocabulary)... `tp_plan(model)` reads those styles as the parameter
layouts they stand for. The rest of what transformers does for a style (redistributing the
module's input and output DTensors, all-reducing a replicated norm's gradient) is not needed:
hpfun computes the unsharded step exactly from any layouts, and plans the communication itself.
"""

from __future__ import annotations

import fnmatch
import re

import torch

from hpfun.errors import Problem, SpecError
from hpfun.layout import P

# style -> which dim of a weight is split, counted from the end (-2: a Linear's output features,
# or an expert's; -1: its input features); a 1-D bias follows a column split, stays whole in a row split
_COLUMN = frozenset({"colwise", "colwise_rep", "colwise_gather_output", "packed_colwise"})
_ROW = frozenset({"rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise"})
_EMBEDDING = {"embedding_rowwise": 0, "embedding_colwise": 1}
# styles that only move activations or gradients around a module in transformers' DTensor
# implementation (or split experts across ranks, which hpfun does not do): no layout of their own
_NO_LAYOUT = frozenset({"replicated_with_grad_allreduce", "all_reduce", "sequence_parallel", "moe_tp_experts",
                        "moe_identity_expert", "local_params", "mla_kv_a_proj", "replicate", "local",
                        "ep_dispatch_experts", "grouped_gemm"})


def tp_plan(model: torch.nn.Module, axis: str = "tp") -> dict:
    """`state_specs` splitting `model`'s parameters over mesh axis `axis` as its own
    transformers tensor-parallel plan does, for `hpfun.shard(..., state_specs=...)`.

    Column-parallel Linears ("colwise" and its variants) split their weight's output features
    and their bias; row-parallel ones ("rowwise") split the weight's input features; embeddings
    split the vocabulary ("embedding_rowwise") or the hidden size ("embedding_colwise"); 3-D
    expert weights split the same features per expert. A packed weight ("packed_colwise": gate
    and up projections one after the other) is split contiguously, so `lower()` shows a gather
    of its output before the halves are taken apart. Styles that only move activations
    ("replicated_with_grad_allreduce", "sequence_parallel", "moe_tp_experts"...) add no layout.

    >>> import transformers, hpfun
    >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    >>> plan = hpfun.tp_plan(transformers.LlamaForCausalLM(config))
    >>> plan["model.layers.*.self_attn.q_proj.weight"], plan["model.layers.*.self_attn.o_proj.weight"]
    (P(dims=('tp', None)), P(dims=(None, 'tp')))
    """
    prefix, model = _planned(model)
    styles = _plan_of(model)
    if not styles:
        raise SpecError(Problem(type(model).__name__, "has no tensor-parallel plan (model.tp_plan and "
                                "config.base_model_tp_plan are empty)",
                                "write state_specs by hand: a dict of parameter name patterns to P specs"),
                        headline="no tensor-parallel plan")
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    specs, problems = {}, []
    for pattern, style in styles.items():
        if style in _NO_LAYOUT:
            continue
        if style not in _COLUMN | _ROW | set(_EMBEDDING):
            problems.append(Problem(pattern, f"has the style {style!r}, which hpfun does not read",
                                    "give its parameters' specs in state_specs yourself"))
            continue
        found = _matching(pattern, params)
        if found:  # the pattern names parameters themselves (an MoE layer's expert weights)
            targets = [(pattern, found[0][1])]
        else:
            owners = _matching(pattern, modules)
            if not owners:  # a plan covers variants of the model (an MoE's dense layers): as transformers, skip
                continue
            owner_name, owner = owners[0]
            inner = ""
            while not owner._parameters and isinstance(getattr(owner, "base_layer", None), torch.nn.Module):
                # a PEFT adapter around the layer (LoRA's `q_proj.base_layer`): its frozen weight is split,
                # the small adapter matrices stay whole
                inner, owner_name, owner = f"{inner}.base_layer", f"{owner_name}.base_layer", owner.base_layer
            if (child := _wrapped_layer(owner, style)) is not None:  # a wrapper of the user's around the layer (a
                # hand-written LoRA's `self.base` beside its own A and B): the layer is split, the wrapper's own
                inner, owner_name, owner = f"{inner}.{child}", f"{owner_name}.{child}", owner.get_submodule(child)
            # a tied weight (the head's, the embedding's) goes by the name torch lists first
            targets = [(f"{pattern}{inner}.{name}", p) for name, p in owner.named_parameters(recurse=False)
                       if f"{owner_name}.{name}" in params]
        for name, param in targets:
            spec = _spec(style, param, axis)
            if spec is not None:
                specs[f"{prefix}{name}"] = spec
    if problems:
        raise SpecError(problems, headline="unreadable tensor-parallel plan")
    return specs


def _planned(model) -> tuple[str, torch.nn.Module]:
    """(name prefix, the transformers model whose plan applies): `model` itself, or the one a
    wrapper holds (PEFT's `base_model.model.`, whose attribute lookups reach the inner model's
    plan while its parameters' names start with the wrapper's path)."""
    if type(model).__module__.startswith("transformers."):
        return "", model
    for name, module in model.named_modules():
        if name and type(module).__module__.startswith("transformers.") and _plan_of(module):
            return f"{name}.", module
    return "", model


def _plan_of(model) -> dict:
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    plan = dict(getattr(model, "_tp_plan", None) or {})  # older transformers: the head's plan and the base's
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and getattr(model, prefix, None) is not None and getattr(model, prefix) is not model
    plan.update({f"{prefix}.{k}" if inner else k: v for k, v in base.items()})
    return plan


def _matching(pattern: str, named: dict) -> list:
    """(name, object) of the entries whose name the plan pattern matches (`*`: a layer number)."""
    regex = re.compile(fnmatch.translate(pattern).replace(".*", r"[^.]*"))
    return [(name, obj) for name, obj in named.items() if regex.fullmatch(name)]


def _wrapped_layer(owner: torch.nn.Module, style: str) -> str | None:
    """The name of the one layer a module of the user's that the plan names wraps, where the
    module is not that kind of layer itself (a Linear for the column and row styles, an Embedding for the embedding
    ones) but holds exactly one directly; None otherwise."""
    kind = torch.nn.Embedding if style in _EMBEDDING else torch.nn.Linear
    if isinstance(owner, kind) or type(owner).__module__.startswith(("torch.", "transformers.")):
        return None  # (a layer of torch's or the model's own is planned as it is)
    children = [name for name, child in owner.named_children() if isinstance(child, kind)]
    return children[0] if len(children) == 1 else None


def _spec(style: str, param: torch.Tensor, axis: str) -> P | None:
    ndim = param.ndim
    dims = [None] * ndim
    if style in _EMBEDDING:
        dims[_EMBEDDING[style]] = axis
    elif ndim == 1:
        if style in _ROW:
            return None  # a row-parallel bias is added once, after the sum: whole
        dims[0] = axis
    elif style in _COLUMN:
        dims[ndim - 2] = axis
    else:
        dims[ndim - 1] = axis
    return P(*dims)
