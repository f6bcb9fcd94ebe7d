"""Capture: trace a global-view function into one functional fx graph of core ATen ops.

`make_fx` runs the function on fake tensors of the global shapes (nothing is computed),
functionalized (no in-place ops) and decomposed to core ATen. On top of torch's core
decompositions, softmax/log_softmax and the NLL loss are decomposed too: as reductions,
pointwise ops and gather/scatter, their general rules shard them along any dim (the
vocab-parallel loss), where a fused kernel would need its dim whole.

Composites, decided one by one (each choice is tested in tests/test_composites.py):
- decomposed: training-mode batch norm (native_batch_norm, _native_batch_norm_legit*), and
  var / var_mean in two passes of reductions: over a split batch the statistics become
  per-channel Partial sums (a sync batch norm at the cost of all-reducing C values), where the
  whole op would gather the activations. Scaled-dot-product attention: torch's core table
  decomposes the CPU flash forward, but autograd records the fused backward above it, which
  would then read the forward's attention weights as its logsumexp (measured: wrong
  gradients); the backward is decomposed too, from its math. Both directions are then
  matmuls (folded into einsums) and softmax pieces that stay split on batch and heads.
- kept whole: native_layer_norm (torch's decomposition is about 20x slower on CPU at
  (8, 512, 768); the rule splits every leading dim, which sequence parallelism needs; its
  backward is decomposed by the core table); native_group_norm (likewise); embedding, whose
  rule looks a split vocab up locally; its backward is torch's decomposition into index_put,
  whose rule does the same.
"""

from __future__ import annotations

import functools
import os
import traceback
from unittest import mock

import torch
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx

from hpfun.errors import CaptureError

aten = torch.ops.aten

_DECOMPOSE_TOO = [
    aten._log_softmax, aten._softmax, aten._log_softmax_backward_data, aten._softmax_backward_data,
    aten.nll_loss_forward, aten.nll_loss_backward,
    aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
]


@functools.cache
def decompositions() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(_DECOMPOSE_TOO))
    table.update(_OWN)
    return table


# ---------------------------------------------------------------------------------------------
# Decompositions hpfun adds (torch's would reach prims, or mismatch autograd's backward)
# ---------------------------------------------------------------------------------------------


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    """Two passes of reductions: over a split dim, each is a Partial sum (a small all-reduce)."""
    if x.is_complex():
        return NotImplemented
    dims = list(range(x.ndim)) if dim is None or len(dim) == 0 else [d % x.ndim for d in dim]
    count = 1
    for d in dims:
        count *= x.shape[d]
    mean = aten.mean.dim(x, dims, True)
    centered = aten.sub.Tensor(x, mean)
    squares = aten.sum.dim_IntList(aten.mul.Tensor(centered, centered), dims, keepdim)
    var = aten.div.Scalar(squares, max(count - (1 if correction is None else correction), 0))
    return var, mean if keepdim else aten.squeeze.dims(mean, dims)


def _var(x, dim=None, *, correction=None, keepdim=False):
    out = _var_mean(x, dim, correction=correction, keepdim=keepdim)
    return out if out is NotImplemented else out[0]


def _attention_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    """The CPU flash attention backward from its math, the softmax recomputed from q and k.

    Capture decomposes the forward (torch's core table), whose second output is then the
    attention weights where the fused op's is logsumexp; the fused backward, recorded by
    autograd above the decomposition, would read that tensor as logsumexp (wrong gradients).
    """
    if dropout_p:
        return NotImplemented
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: k and v heads serve `groups` q heads
    k_all, v_all = (aten.repeat_interleave.self_int(t, groups, 1) if groups > 1 else t for t in (k, v))
    scores = aten.mul.Scalar(torch.matmul(q, k_all.transpose(-2, -1)), scale)
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = aten.masked_fill.Scalar(scores, aten.logical_not.default(keep), float("-inf"))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = aten.masked_fill.Scalar(scores, aten.logical_not.default(attn_mask), float("-inf"))
    elif attn_mask is not None:
        scores = aten.add.Tensor(scores, attn_mask)
    p = aten._softmax.default(scores, -1, False)
    grad_v = torch.matmul(p.transpose(-2, -1), grad_out)
    grad_p = torch.matmul(grad_out, v_all.transpose(-2, -1))
    grad_scores = aten._softmax_backward_data.default(grad_p, p, -1, p.dtype)
    grad_q = aten.mul.Scalar(torch.matmul(grad_scores, k_all), scale)
    grad_k = aten.mul.Scalar(torch.matmul(grad_scores.transpose(-2, -1), q), scale)
    if groups > 1:
        grad_k, grad_v = (t.unflatten(1, (k.shape[1], groups)).sum(2) for t in (grad_k, grad_v))
    return grad_q, grad_k, grad_v


_OWN = {
    aten.var_mean.correction: _var_mean,
    aten.var.correction: _var,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _attention_backward,
}


_TORCH_DIR = os.path.dirname(torch.__file__)
_HPFUN_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_user_frame(filename: str) -> bool:
    return not filename.startswith((_TORCH_DIR, _HPFUN_DIR)) and not filename.startswith("<frozen")


def _innermost_user_frame(_tracer, summary: traceback.StackSummary) -> traceback.StackSummary:
    frames = [f for f in summary if _is_user_frame(f.filename)]
    return traceback.StackSummary.from_list(frames[-1:])


def user_line(stack_trace: str | None) -> str:
    """'file:line in fn: code' of the user's source line recorded on a node, or ''."""
    if not stack_trace:
        return ""
    lines = [l.strip() for l in stack_trace.strip().splitlines()]
    head = lines[0].replace('File "', "").replace('", line ', ":").replace(", in ", " in ") if lines else ""
    return f"{head}: {lines[1]}" if len(lines) > 1 else head


def fake_inputs(metas, device=None) -> tuple[FakeTensorMode, list]:
    """Fake tensors of the given (shape, dtype) pairs in one fake mode, on `device` (no memory,
    and no GPU needed: the device only ends up in the recorded factory ops' arguments)."""
    mode = FakeTensorMode()
    with mode:
        return mode, [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in metas]


def capture(flat_fn, metas, device=None) -> torch.fx.GraphModule:
    """Trace `flat_fn(*tensors) -> list of tensors` on fake tensors with the given (shape, dtype),
    on the device the program will run on (tensors the function creates are made there).

    The first trace runs the function as written (torch.func transforms and autograd.Functions
    such as `hpfun.constrain` compose there); only if it recorded in-place ops is the graph
    traced again through functionalization, keeping each node's source line.
    """
    _, fakes = fake_inputs(metas, device)
    gm = _trace(flat_fn, fakes)
    if _mutates(gm):
        gm = _trace(torch.func.functionalize(_replaying(gm), remove="mutations"), fakes)
        _reject_argument_mutation(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _trace(fn, fakes) -> torch.fx.GraphModule:
    traced = make_fx(fn, decomposition_table=decompositions(), tracing_mode="fake", record_stack_traces=True)
    try:
        with mock.patch.object(proxy_tensor.PythonKeyTracer, "_filter_traceback_frames", _innermost_user_frame):
            return traced(*fakes)
    except CaptureError:
        raise
    except Exception as err:  # re-raised with the user's line: tracing errors come in many types
        raise CaptureError(_describe(err)) from err


def _mutates(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in gm.graph.nodes)


def _reject_argument_mutation(gm: torch.fx.GraphModule) -> None:
    """Functionalization writes mutated arguments back with copy_: a sharded function may not."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    bad = [n for n in gm.graph.nodes if n.target is aten.copy_.default and n.args[0] in inputs]
    if bad:
        raise CaptureError([f"argument tensor {inputs.index(n.args[0])} is modified in place"
                            + (f" at {user_line(n.meta.get('stack_trace'))}" if n.meta.get("stack_trace") else "")
                            for n in bad] + ["a sharded function must be pure: return new values instead "
                                             "(e.g. y = x * 2, not x.mul_(2))"])


def _replaying(gm: torch.fx.GraphModule):
    """Run `gm` node by node so the re-trace inherits each node's metadata (its source line)."""

    def run(*args):
        with torch.fx.traceback.preserve_node_meta():
            return torch.fx.Interpreter(gm).run(*args)

    return run


def _describe(err: Exception) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if _is_user_frame(f.filename)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else ""
    kind = type(err).__name__
    hint = ""
    if "data-dependent" in str(err).lower() or "DataDependent" in kind or "DynamicOutputShape" in kind:
        hint = (" — the function reads tensor values to decide Python control flow or a shape "
                "(e.g. .item(), if x.sum() > 0, nonzero); hpfun traces once on shapes only, so "
                "compute such values outside the sharded function or use torch.where")
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{kind}{where}: {first}{hint}"
