"""Capture: trace a global-view function into one functional fx graph of core ATen ops.

`make_fx` runs the function on fake tensors of the global shapes (nothing is computed),
functionalized (no in-place ops) and decomposed to core ATen. On top of torch's core
decompositions, the NLL loss's forward is decomposed too: as reductions, pointwise ops and
gather/scatter, its general rules shard it along any dim (the vocab-parallel loss), where a
fused kernel would need its dim whole. Softmax and log-softmax (forward and backward), the NLL
loss's backward and the embedding's backward are recorded whole and then split the same way
(`split_fused`); `hpfun.fuse` puts the fused kernel back after propagation wherever the layouts
allow (the softmax dim whole; the loss's classes whole; the embedding gradient replicated, or
split on the vocab as its update needs).

Composites, decided one by one (each choice is tested in tests/test_composites.py):
- decomposed: training-mode batch norm (native_batch_norm, _native_batch_norm_legit*), and
  var / var_mean in two passes of reductions: over a split batch the statistics become
  per-channel Partial sums (a sync batch norm at the cost of all-reducing C values), where the
  whole op would gather the activations. Attention with dropout (torch takes its math path).
- kept whole (`KEPT_WHOLE`, and what torch's core table leaves whole): fused kernels whose
  rules split them where the kernel allows, so the per-shard program calls the same kernel
  the unsharded step does. Scaled-dot-product attention (the CPU flash op, forward and
  backward: no T x T scores on any rank; batch, heads and, not causal, query rows split);
  native_layer_norm and its backward (torch's decomposition is about 20x slower on CPU at
  (8, 512, 768); every leading dim may be split, which sequence parallelism needs);
  native_group_norm; embedding, whose rule looks a split vocab up locally;
  activations (SiLU, softplus, mish...) and their backwards (GELU's, ReLU's...), pointwise.
  A layout those rules do not offer moves the data first (a key-split attention gathers the
  keys, or trades the split for heads by an all-to-all), priced as such by propagation.
"""

from __future__ import annotations

import contextlib
import copy
import contextvars
import decimal
import functools
import gc
import importlib
import inspect
import io
import itertools
import logging
import math
import numbers
import operator
import os
import pickle
import sys
import threading
import tokenize
import traceback
import types
import warnings
import weakref
from unittest import mock

import attrs
import torch
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from hpfun.checkpoint import rematerialize, torch_checkpoints
from hpfun.errors import CaptureError, Problem
from hpfun.functionalize import _is_view, _writes_first, functionalize
from hpfun.optimizers import exact_step_scalars, traced_steps

aten = torch.ops.aten
# torch._assert_async(cond) without a message returns nothing, and fx counts only the form with one
# as a side effect: every dead-code pass (ours, torch.compile's) dropped the check, and a false
# condition ran on (silently). Both forms are checks.
torch.fx.node._side_effectful_functions.add(aten._assert_async.default)

# Fused kernels recorded whole (torch's core table would decompose them): their rules split
# them where the kernel allows; a layout that needs more moves the data first, and is priced so
KEPT_WHOLE = frozenset([
    # attention without dropout (with it, torch takes the math path, decomposed)
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    # activations and their backwards: one pass over memory instead of several (autograd's
    # backward calls silu_backward and mish_backward; under torch.func.grad, torch writes them
    # as elementwise ops to keep them differentiable)
    aten.gelu_backward.default, aten.silu_backward.default, aten.mish_backward.default,
    aten.threshold_backward.default, aten.silu.default,
    aten.sigmoid_backward.default, aten.tanh_backward.default, aten.hardtanh_backward.default,
    aten.leaky_relu_backward.default, aten.elu_backward.default, aten.softplus.default,
    aten.softplus_backward.default, aten.mish.default, aten.hardsigmoid.default,
    aten.hardsigmoid_backward.default,
    # layer and group norm's backwards (rules in rules/norm.yaml)
    aten.native_layer_norm_backward.default, aten.native_group_norm_backward.default,
    # lerp and addcmul (Adam's moment updates): torch's decompositions are ten and five ops, and
    # tracing them cost a third of capturing an HF Llama step with AdamW
    aten.lerp.Scalar, aten.lerp.Tensor, aten.lerp_.Scalar, aten.lerp_.Tensor,
    aten.addcmul.default, aten.addcmul_.default, aten.addcdiv.default, aten.addcdiv_.default,
    # linspace and logspace: torch's reference formula rounds otherwise than its kernel (the middle
    # of linspace(-1, 1, 13) is 5.55e-17, not 0.0): a comparison on one (`grid > 0`) flipped
    aten.linspace.default, aten.logspace.default,
])

_DECOMPOSE_TOO = [
    aten.dist,  # torch.dist(a, b, p): the p-norm of a - b, a reduction hpfun has rules for
    aten.narrow_copy,  # a narrow, copied: torch's decomposition, a slice and a clone
    aten.nll_loss_forward,
    aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
]


@functools.cache
def decompositions() -> dict:
    table = {op: fn for op, fn in core_aten_decompositions().items() if op not in FUSED and op not in KEPT_WHOLE}
    table.update(get_decompositions(_DECOMPOSE_TOO))
    table.update(_OWN)
    table.update(_foreach_decompositions())
    return table


# ---------------------------------------------------------------------------------------------
# Decompositions hpfun adds (torch's would reach prims, or mismatch autograd's backward)
# ---------------------------------------------------------------------------------------------


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    """Two passes of reductions: over a split dim, each is a Partial sum (a small all-reduce).
    A complex tensor's: its real and imaginary parts' variances summed, its mean made of theirs."""
    if x.is_complex():
        if x.ndim == 0:
            return NotImplemented
        dims = list(range(x.ndim)) if dim is None or len(dim) == 0 else [d % x.ndim for d in dim]
        var, mean = _var_mean(aten.view_as_real.default(x), dims, correction=correction, keepdim=keepdim)
        return aten.sum.dim_IntList(var, [-1]), aten.view_as_complex.default(mean)
    if x.dtype in (torch.float16, torch.bfloat16):  # as torch's kernel: computed in float32, rounded once
        var, mean = _var_mean(aten._to_copy.default(x, dtype=torch.float32), dim, correction=correction,
                              keepdim=keepdim)
        return aten._to_copy.default(var, dtype=x.dtype), aten._to_copy.default(mean, dtype=x.dtype)
    # (a 0-d value's dim 0 or -1 is the value itself: one element)
    dims = list(range(x.ndim)) if dim is None or len(dim) == 0 or x.ndim == 0 else [d % x.ndim for d in dim]
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


def _weight_norm_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    """weight_norm's backward (torch has no decomposition for it): w = g * v / |v|, the norm
    taken over every dim but `dim` (0 or the last), as torch's own formula writes it."""
    dims = [d for d in range(saved_v.ndim) if d != dim % saved_v.ndim]
    norms = aten._to_copy.default(saved_norms, dtype=saved_g.dtype)
    sums = aten.sum.dim_IntList(aten.mul.Tensor(grad_w, saved_v), dims, True)
    grad_v = aten.mul.Tensor(aten.div.Tensor(saved_g, norms), aten.sub.Tensor(
        grad_w, aten.mul.Tensor(saved_v, aten.div.Tensor(sums, aten.mul.Tensor(norms, norms)))))
    return grad_v, aten.div.Tensor(sums, norms)


def _loss_scale(grad_output, per_sample_shape, reduction: int, n: int):
    """The incoming gradient of a loss, per sample: `none` gives one per sample, `sum` one for
    all, `mean` one for all over the batch size."""
    if reduction == 0:
        return grad_output.reshape(per_sample_shape)
    return aten.div.Scalar(grad_output, n) if reduction == 1 else grad_output


def _as_rows(x):
    """A loss's input as [samples, classes]: one sample of one class for a 0-d one."""
    return x if x.ndim == 2 else x.reshape(1, -1) if x.ndim == 1 else x.reshape(1, 1)


def _multi_margin_loss_backward(grad_output, x, target, p, margin, weight=None, reduction=1):
    """multi_margin_loss's backward (torch has no decomposition for it): each class j != y with
    z = margin - x[y] + x[j] > 0 gets z's term's derivative (1, or 2z for p = 2), scaled by the
    target's weight over the class count, and the target class minus their sum."""
    x2, t = _as_rows(x), target.reshape(-1, 1)
    n, c = x2.shape
    z = aten.add.Tensor(aten.sub.Tensor(x2, aten.gather.default(x2, 1, t)), margin)
    other = aten.ne.Tensor(aten.arange.default(c, device=x.device).unsqueeze(0), t)
    g = aten._to_copy.default(aten.logical_and.default(aten.gt.Scalar(z, 0), other), dtype=x.dtype)
    if p == 2:
        g = aten.mul.Tensor(aten.mul.Scalar(z, 2), g)
    if weight is not None:
        g = aten.mul.Tensor(g, aten.index.Tensor(weight, [t.squeeze(1)]).unsqueeze(1))
    g = aten.div.Scalar(g, c)
    g = aten.scatter_add.default(g, 1, t, aten.neg.default(aten.sum.dim_IntList(g, [1], True)))
    scale = _loss_scale(grad_output, (n, 1), reduction, n)
    return aten.mul.Tensor(g, scale).reshape(x.shape)


def _multilabel_slots(x2, t2):
    """Per sample, which target slots count (those before the first -1), the input's value at
    each slot's class, and which classes are targets."""
    c = x2.shape[1]
    idx = aten.arange.default(c, device=x2.device)
    end = aten.amin.default(aten.where.self(aten.eq.Scalar(t2, -1), idx, aten.scalar_tensor.default(
        c, dtype=idx.dtype, device=idx.device)), [-1], True)
    valid = aten.lt.Tensor(idx, end)  # [n, k]
    classes = aten.where.self(valid, t2, aten.zeros_like.default(t2))
    at = aten.gather.default(x2, 1, classes)  # [n, k]
    hit = aten.eq.Tensor(aten.where.self(valid, t2, aten.full_like.default(t2, -1)).unsqueeze(-1), idx)  # [n, k, j]
    return valid, classes, at, aten.any.dim(hit, 1)


def _multilabel_terms(x2, t2):
    """The hinge terms of multilabel_margin_loss, [n, k, j]: slot k's class against non-target
    class j, and the mask of those that count."""
    valid, classes, at, is_target = _multilabel_slots(x2, t2)
    z = aten.add.Tensor(aten.sub.Tensor(x2.unsqueeze(1), at.unsqueeze(2)), 1.0)  # 1 - x[t_k] + x[j]
    counts = aten.logical_and.default(valid.unsqueeze(2), aten.logical_not.default(is_target).unsqueeze(1))
    return z, counts, classes, is_target


def _multilabel_margin_loss_forward(x, target, reduction):
    """multilabel_margin_loss as torch's kernel computes it: per sample, the sum over target
    slots k (up to the first -1) and non-target classes j of max(0, 1 - x[t_k] + x[j]), over
    the class count. (torch's own decomposition also counts the slots after the first -1.)"""
    x2, t2 = _as_rows(x), _as_rows(target)
    c = x2.shape[1]
    z, counts, _, is_target = _multilabel_terms(x2, t2)
    terms = aten.where.self(counts, aten.clamp_min.default(z, 0), aten.zeros_like.default(z))
    per = aten.div.Scalar(aten.sum.dim_IntList(terms, [1, 2]), c)
    loss = aten.mean.default(per) if reduction == 1 else aten.sum.default(per) if reduction == 2 else \
        per.reshape(x.shape[:-1])
    return loss, aten._to_copy.default(is_target, dtype=x.dtype).reshape(target.shape)


def _multilabel_margin_loss_backward(grad_output, x, target, reduction, is_target):
    """Its backward (torch has none): each counted term with z > 0 adds 1/C to class j and
    takes 1/C from slot k's class."""
    x2, t2 = _as_rows(x), _as_rows(target)
    n, c = x2.shape
    z, counts, classes, _ = _multilabel_terms(x2, t2)
    g = aten.div.Scalar(aten._to_copy.default(aten.logical_and.default(counts, aten.gt.Scalar(z, 0)),
                                              dtype=x.dtype), c)
    grad = aten.scatter_add.default(aten.sum.dim_IntList(g, [1]), 1, classes,
                                    aten.neg.default(aten.sum.dim_IntList(g, [2])))
    scale = _loss_scale(grad_output, (n, 1), reduction, n)
    return aten.mul.Tensor(grad, scale).reshape(x.shape)


def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """torch's `_trilinear` (nn.Bilinear) as the einsum it computes: each input lacks the dims
    its `expand` list names, the product is summed over `sumdim`, which leave the result."""
    ndim = i1.ndim + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"[:ndim]
    terms = ["".join(letters[d] for d in range(ndim) if d not in expand) for expand in (expand1, expand2, expand3)]
    out = "".join(letters[d] for d in range(ndim) if d not in sumdim)
    return torch.einsum(f"{','.join(terms)}->{out}", i1, i2, i3)


def _foreach_decompositions() -> dict:
    """Every `_foreach_*` overload (an optimizer's foreach implementation) as a loop of the
    per-tensor op: each element then gets its own layout, as its parameter has."""
    table = {}
    # every registered schema: dir(aten) lists only the ops some code has already looked up
    names = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::_foreach_")}
    for name in sorted(names):
        packet = getattr(aten, name)
        for overload in packet.overloads():
            table[getattr(packet, overload)] = functools.partial(_foreach_loop, name[len("_foreach_"):])
    return table


def _foreach_loop(name: str, *args, **kwargs):
    inplace = name.endswith("_")
    base = name.rstrip("_")
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))

    def pick(a, i):
        return a[i] if isinstance(a, (list, tuple)) else a

    results = []
    for i in range(n):
        a = [pick(x, i) for x in args]
        kw = {k: pick(v, i) for k, v in kwargs.items()}
        if base in ("addcmul", "addcdiv") and len(a) > 3 and not isinstance(a[3], torch.Tensor):
            kw["value"] = a.pop(3)  # positional in the foreach schema, keyword-only per tensor
        if base in ("addcmul", "addcdiv") and len(a) > 3:
            # the .Tensor overload: one scale per element, given as a 1-D tensor of them
            scale = a.pop(3)[i]  # x + (scale * t1) {*,/} t2, the order of torch's kernels
            op = getattr(aten, base + "_" if inplace else base).default
            results.append(op(a[0], aten.mul.Tensor(a[1], scale), a[2]))
            continue
        if base in ("maximum", "minimum") and not isinstance(a[1], torch.Tensor):  # a number (the .Scalar and
            # .ScalarList overloads): torch's kernels are clamp_min and clamp_max, which take one
            op = getattr(aten, ("clamp_min" if base == "maximum" else "clamp_max") + ("_" if inplace else ""))
            results.append(op(*a, **kw))
            continue
        if inplace and not hasattr(aten, base + "_"):  # no in-place form (maximum, minimum): out of place, copied in
            results.append(aten.copy_.default(a[0], getattr(aten, base)(*a, **kw)))
            continue
        op = getattr(aten, base + "_" if inplace else base)
        results.append(op(*a, **kw))
    return None if inplace else results


def _rrelu_eval(x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    """RReLU in eval mode draws nothing: it is the leaky ReLU of the mean slope, as torch's
    kernel computes it (training mode draws, and is refused as a random op hpfun has no draw for)."""
    if training:
        return NotImplemented
    return aten.leaky_relu.default(x, (lower + upper) / 2)


def _rrelu_eval_functional(x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    out = _rrelu_eval(x, noise, lower, upper, training, generator)
    return out if out is NotImplemented else (out, noise)


def _rrelu_eval_backward(grad, x, noise, lower, upper, training, self_is_result):
    if training:
        return NotImplemented
    return aten.leaky_relu_backward.default(grad, x, (lower + upper) / 2, self_is_result)


def _efficient_zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Forward-mode AD's zero tangent (`torch.func.hessian`, jvp of a function whose tangent is
    zero somewhere) as plain zeros: the ZeroTensor key is an eager shortcut, and whether torch
    makes one depends on what ran before in the process."""
    return torch.zeros(size, dtype=dtype, layout=layout, device=device)


@functools.cache
def _core_decomposition(op):
    return core_aten_decompositions()[op]


def _with_flat_index(op):
    """torch's decomposition of `op` (index_add, index_copy), given a 0-d index as the one-element
    index it is (the kernel takes it so: `index_select`'s backward by a 0-d index, what
    `mask.nonzero().squeeze()` gives for one hit; the decomposition wrote an index_put that fails)."""
    def run(x, dim, index, source, *args, **kwargs):
        if x.dtype == torch.bool and "alpha" in kwargs:  # (the kernel casts alpha to bool: the decomposition's
            kwargs = {**kwargs, "alpha": bool(kwargs["alpha"])}  # `source * 3` made a long source index_put refused)
        return _core_decomposition(op)(x, dim, index.reshape(1) if index.ndim == 0 else index, source, *args, **kwargs)

    return run


def _nan_to_num(x, nan=None, posinf=None, neginf=None):
    """nan_to_num; of a complex tensor, of its real and imaginary parts apart, as the kernel does
    (torch's decomposition asks isneginf of the complex tensor, which refuses it)."""
    if x.is_complex():
        parts = torch.view_as_real(x.resolve_conj())
        return torch.view_as_complex(aten.nan_to_num.default(parts, nan, posinf, neginf).contiguous())
    return _core_decomposition(aten.nan_to_num.default)(x, nan, posinf, neginf)


_OWN = {
    aten._efficientzerotensor.default: _efficient_zeros,
    aten.nan_to_num.default: _nan_to_num,
    aten.index_add.default: _with_flat_index(aten.index_add.default),
    aten.index_add_.default: _with_flat_index(aten.index_add_.default),
    aten.index_copy.default: _with_flat_index(aten.index_copy.default),
    aten.index_copy_.default: _with_flat_index(aten.index_copy_.default),
    aten.rrelu_with_noise.default: _rrelu_eval,
    aten.rrelu_with_noise_functional.default: _rrelu_eval_functional,
    aten.rrelu_with_noise_backward.default: _rrelu_eval_backward,
    aten.var_mean.correction: _var_mean,
    aten.var.correction: _var,
    aten._weight_norm_interface_backward.default: _weight_norm_backward,
    aten.multi_margin_loss_backward.default: _multi_margin_loss_backward,
    aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss_forward,
    aten.multilabel_margin_loss_backward.default: _multilabel_margin_loss_backward,
    aten._trilinear.default: _trilinear,
}


# with the separator: a path that merely starts alike (.../torchvision) is not torch's
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
HPFUN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
SITE_PACKAGES = os.sep + "site-packages" + os.sep  # an installed library's files are under it


def _called_by_torch() -> bool:
    """Whether the op being dispatched was called by one of torch's decompositions or references
    (`torch._refs._index_fill`, run by autograd), not by the user's code: such a frame comes
    before the user's innermost one."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_DECOMPOSITION_DIRS):
            return True
        if _is_user_frame(name):
            return False
        frame = frame.f_back
    return False


_DECOMPOSITION_DIRS = tuple(os.path.join(TORCH_DIR, d) + os.sep for d in ("_refs", "_decomp", "_prims"))


def _is_user_frame(filename: str) -> bool:
    """Not torch's, hpfun's, or code generated on the way (fx graph modules, attrs classes)."""
    return not filename.startswith((TORCH_DIR, HPFUN_DIR, "<frozen", "<eval_with_key", "<attrs generated"))


def _innermost_user_frame(_tracer, summary: traceback.StackSummary) -> traceback.StackSummary:
    if isinstance(summary, _OneFrame):  # `_UserFrame.summary`'s: already that frame alone
        return summary
    frames = [f for f in summary if _is_user_frame(f.filename)]
    return traceback.StackSummary.from_list(frames[-1:])


class _OneFrame(traceback.StackSummary):
    """The user's frame of a node, formatted as a traceback's two lines ('File "f", line n, in
    fn' and the code). Python's own formatting also parses the line to place carets under the
    expression: 15.5 us a node against 3.8 (measured 40 frames deep), 0.2 s of a 32-layer GPT
    step's capture."""

    def format(self) -> list[str]:
        return [f'  File "{f.filename}", line {f.lineno}, in {f.name}\n    {(f.line or "").strip()}\n' for f in self]


class _UserFrame:
    """Stands in for torch.fx's `CapturedTraceback` while tracing: fx asks it for the stack of
    every node it records and keeps only the innermost user frame (`_innermost_user_frame`), so
    this walks the live frames outward to that one and symbolizes it alone. Symbolizing the whole
    stack (a hundred frames deep under make_fx) for each node was about a sixth of capture."""

    @staticmethod
    def extract(*_args, **_kwargs) -> "_UserFrame":
        return _UserFrame()

    @staticmethod
    def summary() -> traceback.StackSummary:
        frame = sys._getframe(1)
        while frame is not None and not _is_user_frame(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:
            return _OneFrame()
        code = frame.f_code
        return _OneFrame([traceback.FrameSummary(code.co_filename, frame.f_lineno, code.co_name)])


def user_line(stack_trace: str | None) -> str:
    """'file:line in fn: code' of the user's source line recorded on a node, or ''."""
    if not stack_trace:
        return ""
    lines = [l.strip() for l in stack_trace.strip().splitlines()]
    head = lines[0].replace('File "', "").replace('", line ', ":").replace(", in ", " in ") if lines else ""
    return f"{head}: {lines[1]}" if len(lines) > 1 else head


def fake_inputs(metas, device=None, requires_grad=None) -> tuple[FakeTensorMode, list]:
    """Fake tensors of the given (shape, dtype) or (shape, dtype, strides) in one fake mode, on
    `device` (no memory, and no GPU needed: the device only ends up in the recorded factory ops'
    arguments); `requires_grad[i]` makes the i-th a leaf autograd fills the `.grad` of (a lifted
    parameter). Strides (None: contiguous) are the real input's: whether `x.contiguous()` or
    `x.reshape(...)` is a view or a copy decides whether a write into it reaches the input."""
    mode = FakeTensorMode()
    flags = requires_grad or [False] * len(metas)
    with mode:
        return mode, [_empty(*meta, device=device).requires_grad_(bool(rg))
                      for meta, rg in zip(metas, flags, strict=True)]


def _empty(shape, dtype, strides=None, *, device=None) -> torch.Tensor:
    if strides is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


@attrs.frozen(eq=False)
class Captured:
    """A traced program: its graph, and what the graph's inputs and outputs mean besides the
    function's own.

    The graph's inputs are the given tensors, then one per tensor the function created from
    data (`torch.tensor([...])`, kept by make_fx as a constant): `constants` holds their values.
    Its outputs are the function's, then one per input the function modified in place:
    `mutated[j]` is the index of the input the j-th of those is written back to.
    """

    gm: torch.fx.GraphModule
    constants: tuple[torch.Tensor, ...]
    mutated: tuple[int, ...]
    reads: tuple = ()  # InputReads: values the trace read from its inputs, which the program assumes
    seed: int | None = None  # `torch.manual_seed(s)` the function calls before drawing: every call draws from s


def capture(flat_fn, metas, device=None) -> torch.fx.GraphModule:
    """Trace `flat_fn(*tensors) -> list of tensors` on fake tensors with the given (shape, dtype),
    on the device the program will run on; the graph of `trace` (see there)."""
    return trace(flat_fn, metas, device).gm


_LRU_CACHES: list = []  # the functools.lru_cache wrappers in the process, found when its modules were so many
_LRU_SCANNED = [-1]


def _lru_caches() -> list:
    """The lru_cache wrappers of the process but torch's own (torch memoizes its dispatch tables;
    clearing them made every trace twice as slow): one heap scan at the first trace, again only
    when a module of the user's (not the standard library's nor an installed package's) has
    been imported since (libraries import theirs lazily, in a first trace: 50 ms a scan)."""
    if _LRU_SCANNED[0] != len(sys.modules):
        new = [(name, module) for name, module in list(sys.modules.items()) if name not in _LRU_MODULES]
        _LRU_MODULES.update(name for name, _ in new)
        first, _LRU_SCANNED[0] = _LRU_SCANNED[0] < 0, len(sys.modules)
        if first or any(_is_users_module(name, module) for name, module in new):
            _LRU_CACHES[:] = [o for o in gc.get_objects() if type(o) is functools._lru_cache_wrapper
                              and not str(getattr(o, "__module__", "")).startswith(_OWN_CACHES)]
    return _LRU_CACHES


_LRU_MODULES: set = set()
_OWN_CACHES = ("torch", "hpfun", "sympy", "functorch", "typing", "importlib", "re", "enum")
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _is_users_module(name: str, module) -> bool:
    filename = getattr(module, "__file__", None) or ""
    return bool(filename) and not name.startswith(_OWN_CACHES) and not filename.startswith((_STDLIB, TORCH_DIR)) \
        and SITE_PACKAGES not in filename


def clear_memoized() -> bool:
    """Clear every functools.lru_cache holding entries; whether one did. A trace that read a
    tensor a memoized helper made in an eager call (a real tensor, no input of the program) is
    run again once so: the helper then makes it inside the trace, a constant of the program."""
    filled = [w for w in _lru_caches() if w.cache_info().currsize]
    for w in filled:
        w.cache_clear()
    return bool(filled)


@contextlib.contextmanager
def _caches_filled_cleared():
    """functools.lru_cache entries the trace made are cleared after it: a helper memoizing a tensor
    (yet-another-retnet's decay mask) would otherwise hand the trace's placeholder to every later
    call, eager ones too (they failed inside torch). The wrappers are `_lru_caches`; each is asked
    its counts, before and after. A `functools.cached_property` not yet computed is computed at
    each use while tracing; one made from constants and Python values only is then computed again
    outside the trace and kept on its object, as eager keeps its first value (transformers' Emu3
    memoizes a lookup table so, on an object its model holds)."""
    caches = list(_lru_caches())
    before = [w.cache_info().misses for w in caches]
    get = functools.cached_property.__get__

    def uncached(prop, instance, owner=None):
        if instance is None or prop.attrname in getattr(instance, "__dict__", {prop.attrname: None}):
            return get(prop, instance, owner)
        value = prop.func(instance)  # (computed at each use while tracing, kept nowhere)
        leaves = torch.utils._pytree.tree_leaves(value)
        if not any(isinstance(t, torch.Tensor) for t in leaves) and isinstance(getattr(instance, "__dict__", None), dict):
            instance.__dict__[prop.attrname] = value  # (no tensor, no placeholder: kept, as eager keeps it)
            return value
        if any(_made_from_inputs(t, draws=True) for t in leaves if isinstance(t, torch.Tensor)):
            raise CaptureError(Problem(f"{type(instance).__name__}.{prop.attrname}{_at_user_line()}",
                                       "is a functools.cached_property first computed inside the sharded function, from "
                                       "its inputs, state or a random draw: eager keeps that first value for later calls, a program "
                                       "would compute it anew at every call", "read it once before the first call, or "
                                       "make it a plain property (computed at every call)"))
        if isinstance(getattr(instance, "__dict__", None), dict):  # (from constants and Python values: the
            with proxy_tensor.disable_proxy_modes_tracing(), unset_fake_temporarily():  # value eager keeps,
                try:  # computed as eager computes it)
                    first.append((instance, prop.attrname, prop.func(instance)))
                except Exception:  # (not computable outside the trace: computed at each call, as before)
                    pass
        return value

    first: list = []  # (instance, name, value): constant cached properties, kept once the trace succeeds
    try:
        with mock.patch.object(functools.cached_property, "__get__", uncached):
            yield
        for instance, name, value in first:
            instance.__dict__.setdefault(name, value)  # (a later call reads it as the object's state)
    finally:
        for w, misses in zip(caches, before):
            if w.cache_info().misses != misses:
                w.cache_clear()


def trace(flat_fn, metas, device=None, requires_grad=None, readable=None) -> Captured:
    """Trace `flat_fn(*tensors) -> list of tensors` on fake tensors with the given (shape, dtype),
    on the device the program will run on (tensors the function creates are made there).

    The first trace runs the function as written (torch.func transforms, autograd's
    `.backward()`, optimizers and autograd.Functions such as `hpfun.constrain` compose there),
    with `torch.compiler.is_compiling()` true, as torch.export does: libraries then take their
    traceable paths (an optimizer keeps its step count a tensor, not a Python number). In-place
    ops it recorded are rewritten out of place on the graph (`hpfun.functionalize`); only where a
    write could be seen through a view is the graph traced again through torch's
    functionalization, keeping each node's source line. What the function wrote into its inputs
    becomes extra outputs (`Captured.mutated`). `readable`: the real values of the inputs whose
    values the function may read into Python (`readable_inputs`)."""
    _, fakes = fake_inputs(metas, device, requires_grad)
    generator = torch.default_generator.get_state()
    try:
        with readable_inputs(readable or []) as reads, _seeded_inside() as seed, _quiet_fake_tensor_errors(), \
                _caches_filled_cleared():
            gm = _trace(flat_fn, fakes)
    finally:
        _ADDRESSES.clear()  # (a storage's _cdata may be another's after the trace)
    _refuse_generator_state(gm, seed[1], generator)
    mutated: list[int] = []
    _refuse_sparse(gm)
    _sets_as_aliases(gm)
    if _mutates(gm):
        _refuse_input_metadata_writes(gm, only_resize=True)  # (x.resize_(...) of an input: the rewrite takes it)
    if _mutates(gm) and (written := functionalize(gm)) is not None:
        mutated = written  # rewritten out of place where it is: no write is seen through a view
    elif _mutates(gm):
        _refuse_input_metadata_writes(gm)
        _refuse_writes_through_unfold(gm)
        _, plain = fake_inputs(metas, device)
        gm = _trace(torch.func.functionalize(_replaying(gm), remove="mutations"), plain)
        mutated = _mutations_as_outputs(gm)
    _refuse_reshaped_inputs(gm, mutated)
    _check_draws(gm)
    _drop_profiler_calls(gm)
    _drop_plain_copies(gm)
    _as_strided_as_views(gm)
    gm.graph.eliminate_dead_code()
    rematerialize(gm)  # hpfun.checkpoint's regions: recompute before the backward reads, not kept
    _refuse_integer_softmax(gm)
    split_fused(gm)
    _iota_indices_as_slices(gm)  # (after: the pad's backward is split into its indexing there)
    constants = _constants_as_inputs(gm)
    gm.recompile()
    return Captured(gm, tuple(constants), tuple(mutated), tuple(reads), seed[0])


@contextlib.contextmanager
def _quiet_fake_tensor_errors():
    """torch's fake tensors log the whole traceback of an op that fails on them (a shape that
    does not broadcast) before raising it; hpfun raises it as a CaptureError naming the user's
    line, so the log is only noise on stderr."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _seeded_inside():
    """`torch.manual_seed(s)` called by the function while traced: recorded, not run (tracing
    has no side effects), and yielded as `[s]` ([None] if not called). The program then draws
    from `s` at every call instead of a seed drawn from torch's generator, and seeds torch's
    generator with `s` after each call, so that every call draws the same numbers, as eager's
    do. A program's draws share one seed, so a call after the function has drawn is refused."""
    seed: list = [None, []]  # [s, the user lines that set torch's generator's state]
    original = torch.random.manual_seed
    original_set = torch.random.set_rng_state

    def set_rng_state(state):
        if proxy_tensor.get_proxy_mode() is None or _called_from(_CHECKPOINT_FILE):  # checkpoint's replay: hpfun's own
            return original_set(state)
        seed[1].append(user_line_past_stdlib())  # (fork_rng's exit runs in contextlib)
        return None  # not run: the program's draws are numbered by op, not by the generator's state

    def manual_seed(s):
        mode = proxy_tensor.get_proxy_mode()
        if mode is None:  # not while recording (a fake mode's own use): as torch does it
            return original(s)
        drawn = next((n for n in mode.tracer.graph.nodes if n.op == "call_function"
                      and isinstance(n.target, torch._ops.OpOverload)
                      and torch.Tag.nondeterministic_seeded in n.target.tags), None)
        if drawn is not None:
            raise CaptureError(Problem(f"torch.manual_seed({s!r}){_at_user_line()}",
                                       f"seeds torch's generator after the function drew random numbers ({drawn.target})",
                                       "a sharded program's draws share one seed: call torch.manual_seed before the "
                                       "first draw (or outside the function), or fix the seed of the whole call "
                                       "with `with hpfun.random_seed(s):`"))
        seed[0] = int(s) % 2**63
        return torch.default_generator

    with mock.patch.object(torch.random, "manual_seed", manual_seed), mock.patch.object(torch, "manual_seed", manual_seed), \
            mock.patch.object(torch.random, "set_rng_state", set_rng_state), \
            mock.patch.object(torch, "set_rng_state", set_rng_state):
        yield seed


_CHECKPOINT_FILE = os.path.join(TORCH_DIR, "utils", "checkpoint.py")


def user_line_past_stdlib() -> str:
    """' at file:line in fn' of the innermost user frame calling now, past torch's, hpfun's and
    the standard library's frames (a context manager's code runs in contextlib), or ''."""
    frame = sys._getframe(1)
    while frame is not None and not _is_user_code(frame.f_code.co_filename):
        frame = frame.f_back
    return f" at {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else ""


def _is_user_code(filename: str) -> bool:
    """A user's frame (`_is_user_frame`) that is not the standard library's (an installed
    library's is the user's)."""
    return _is_user_frame(filename) and not (filename.startswith(_STDLIB) and SITE_PACKAGES not in filename)


def _called_from(filename: str) -> bool:
    """Whether code in `filename` made this call (directly, or through torch: a checkpoint's
    `fork_rng`), before any user frame."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename != filename:
        if _is_user_code(frame.f_code.co_filename):
            return False
        frame = frame.f_back
    return frame is not None


def _refuse_generator_state(gm: torch.fx.GraphModule, lines: list, state_before: torch.Tensor) -> None:
    """A program that draws, from a function that sets torch's generator's state itself
    (`torch.set_rng_state`, which `torch.random.fork_rng` calls on leaving; the generator's
    `manual_seed` or `set_state` called directly): eager's draws after it depend on that state
    (a fork's draws repeat, or a replay equals the first draw), hpfun's are numbered by op and
    would not, silently. Refused, at each line it could name."""
    draws = next((n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                  and torch.Tag.nondeterministic_seeded in n.target.tags), None)
    moved = not torch.equal(torch.default_generator.get_state(), state_before)
    if moved:
        torch.default_generator.set_state(state_before)  # (the function is refused or runs as a program: as before)
    if draws is None or not (lines or moved):
        return
    fix = ("seed the whole call instead (`torch.manual_seed(s)` before the first draw, inside or before the call, or "
           "`with hpfun.random_seed(s):` around it), or draw outside the sharded function and pass the values in")
    why = "sets the state of torch's generator, which hpfun's draws (numbered by op, the same for every layout) do not follow"
    problems = [Problem(f"torch.set_rng_state{line} (torch.random.fork_rng calls it on leaving, and so does "
                        "torch.func.vmap with chunk_size for each chunk)", why,
                        fix + "; under vmap with chunk_size, drop chunk_size (the program runs the whole batch at once)")
                for line in dict.fromkeys(lines)]
    if moved:
        problems.append(Problem("torch.default_generator", "was seeded or set while the function was traced "
                                "(`torch.default_generator.manual_seed(s)` or `.set_state(...)`, or torch.manual_seed "
                                "imported under another name: `from torch import manual_seed`), and " + why,
                                "call it as `torch.manual_seed(s)` before the first draw (hpfun then draws from s at every "
                                "call), or " + fix))
    raise CaptureError(problems, headline="the function sets torch's random generator")


def _compiled_code_runs_as_written():
    """A `torch.compile`d module or function inside the sharded function is traced as the code
    it compiles (hpfun compiles the per-shard program itself, `compile=True`): Dynamo would
    otherwise run its compiled kernels on the stand-ins, reading the real parameters."""
    import torch._dynamo

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(torch._dynamo.config, "disable", True))
    # (one compiled before the call runs eagerly, as under torch's own `force_eager` stance: disabled alone, one
    # compiled with fullgraph=True raised that it found no compiled frames, and its code stayed marked as skipped,
    # so that compiling it again outside failed the same way)
    stack.enter_context(torch.compiler.set_stance("force_eager"))
    # (one compiled inside the step, torchao's 8-bit Adam's `torch.compile(step, fullgraph=True)`: the
    # function itself, never handed to Dynamo, whose refusal of a disabled fullgraph compile was an
    # error, and which then kept the function as one not to compile, failing eager compiles after)
    stack.enter_context(mock.patch.object(torch, "compile", _not_compiled))
    # (and Dynamo's entry, which torch.compile calls by its module's name: `from torch import compile`, a
    # `functools.partial(torch.compile, ...)` made at import, `torch._dynamo.optimize(...)` itself)
    stack.enter_context(mock.patch.object(torch._dynamo, "optimize", _not_optimized))
    return stack


def _not_compiled(model=None, **_options):
    """`torch.compile` while tracing: the function or module as it is (as a decorator too)."""
    return model if model is not None else (lambda m: m)


def _not_optimized(*_args, **_options):
    """`torch._dynamo.optimize(...)` while tracing: a decorator giving the function as it is."""
    return lambda m: m


@contextlib.contextmanager
def _library_checks_keep_their_messages():
    """transformers' `torch_compilable_check(cond, msg, error_type)` drops its message and error
    type while compiling (they only hint the compiler), and hpfun traces as if compiling: a false
    check (BART's `All examples must have the same number of <eos> tokens.`) said only `Expected
    cond to be True` at transformers' own file. It checks as it does in eager instead."""
    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_tracing", None)
    if original is None:
        yield
        return

    def is_tracing(tensor=None) -> bool:
        if tensor is None:
            return False
        if isinstance(tensor, torch.Tensor) and _constant_value(_as_made(tensor)) is not None:
            return False  # (a value hpfun reads, as eager does: below)
        return original(tensor)

    # Its mask helpers skip an all-ones attention mask in eager (SDPA's is_causal, or no mask for a
    # bidirectional model), but not while tracing, where reading the mask would break the graph; hpfun
    # reads a mask made from the arguments (`readable_inputs`), so it decides as eager does: PaliGemma's
    # bidirectional Gemma attended causally (silently another model). Each module holds its own name.
    holders = [m for name, m in list(sys.modules.items()) if name.startswith("transformers.") and m is not None
               and getattr(m, "is_tracing", None) is original]
    with contextlib.ExitStack() as stack:
        for module in holders:
            stack.enter_context(mock.patch.object(module, "is_tracing", is_tracing))
        yield


@contextlib.contextmanager
def _nested_encoder_as_eager():
    """`nn.TransformerEncoder` in eval mode with a key padding mask and no gradient runs in eager
    on nested tensors (torch's fast path), whose padded positions come out as zeros; while
    tracing it takes the dense path (its checks see a compiled trace), whose padded rows hold
    values. Where eager would nest, the encoder runs its layers densely with the padding mask
    and zeros the padded rows before its norm, as eager's result has them (they were nonzero,
    silently). Its check that the mask is left-aligned reads the mask, as eager does."""
    from torch.nn.modules import transformer

    original = torch.nn.TransformerEncoder.forward

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        keys = _eager_nests(self, src, mask, src_key_padding_mask)
        if keys is None:
            return original(self, src, mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=is_causal)
        is_causal = transformer._detect_is_causal_mask(None, is_causal, transformer._get_seq_len(src, True))
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=None, is_causal=is_causal, src_key_padding_mask=keys)
        output = output.masked_fill((keys != 0).unsqueeze(-1), 0.0)  # (the padded positions: -inf there)
        return self.norm(output) if self.norm is not None else output

    with mock.patch.object(torch.nn.TransformerEncoder, "forward", forward):
        yield


def _eager_nests(encoder, src, mask, key_padding_mask):
    """The key padding mask as eager's `TransformerEncoder.forward` makes it (a float mask, -inf
    where padded), where that forward would turn `src` into a nested tensor, as its checks
    decide it (but the trace's own: compiling, tensor subclasses); None where it would not."""
    first = encoder.layers[0]
    if not (torch.backends.mha.get_fastpath_enabled() and getattr(encoder, "use_nested_tensor", False)
            and not first.training and src.dim() == 3 and key_padding_mask is not None and mask is None
            and not torch.is_autocast_enabled() and src.device.type in ("cpu", "cuda", "xpu")):
        return None
    attention = first.self_attn
    weights = (src, attention.in_proj_weight, attention.in_proj_bias, attention.out_proj.weight,
               attention.out_proj.bias, first.norm1.weight, first.norm1.bias, first.norm2.weight, first.norm2.bias,
               first.linear1.weight, first.linear1.bias, first.linear2.weight, first.linear2.bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in weights):
        return None
    keys = torch.nn.functional._canonical_mask(mask=key_padding_mask, mask_name="src_key_padding_mask",
                                               other_type=None, other_name="mask", target_type=src.dtype)
    keep = keys.logical_not()
    if getattr(encoder, "mask_check", True):
        aligned = _read(torch.Tensor.__bool__, (keep[:, 1:].int() <= keep[:, :-1].int()).all())
        if aligned is _UNREADABLE:
            raise CaptureError(Problem(f"nn.TransformerEncoder{_at_user_line()}", "in eval mode, eager checks that "
                                       "the key padding mask is left-aligned (to run the encoder on nested tensors), "
                                       "a read of the mask's values, and this mask is made from values hpfun cannot "
                                       "read (parameters, random draws)", "build the encoder with mask_check=False "
                                       "(a left-aligned mask), or enable_nested_tensor=False"))
        if not aligned:
            return None
    return keys


@contextlib.contextmanager
def _linearize_refused():
    """`torch.func.linearize` under another torch.func transform (grad, jacrev) is refused at its
    line: it traces its function with a make_fx of its own, which there kept hpfun's fake tensors
    as its graph's constants (an internal error, or outputs whose blocks were fake tensors), and
    eager's gradients through it are zeros or garbage too. `torch.func.jvp` computes what the
    linearized function does. On its own it traces as written."""
    from torch._functorch import eager_transforms

    original = eager_transforms.linearize

    def linearize(func, *primals):
        if torch._C._functorch.maybe_current_level() is None:  # (on its own it traces as written)
            return original(func, *primals)
        raise CaptureError(Problem(f"torch.func.linearize{_at_user_line()}", "under another torch.func transform "
                                   "traces its function with a make_fx of its own, which cannot run inside hpfun's "
                                   "trace (eager's gradients through it are zeros there)",
                                   "call torch.func.jvp(func, primals, tangents) where the linearized function is "
                                   "called: it computes the same values"))

    with mock.patch.object(eager_transforms, "linearize", linearize), mock.patch.object(torch.func, "linearize", linearize):
        yield


@contextlib.contextmanager
def _lstm_as_matmuls():
    """`nn.LSTM` traced as torch's composite one-layer LSTM (a matmul and gates per step), which
    has rules: with oneDNN on, CPU LSTMs whose input needs no gradient (a model's first layer)
    are written as oneDNN's fused `mkldnn_rnn_layer`, an op no rule can split. GRU and plain
    RNNs are traced that way already. The program's other ops are the same either way. (Not
    torch.backends.mkldnn.flags: it sets, and warns about, TF32 too.)"""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)


@contextlib.contextmanager
def _module_conversions():
    """`module.to(...)` (and .float(), .double(), .cpu() ...) inside the function: one that
    changes no tensor (NLLB-MoE's router does `self.classifier = self.classifier.to(self.dtype)`
    at every forward) is the module itself, as eager's is in effect; one that would change the
    lifted parameters is refused with the fix (torch could not swap the trace's stand-ins, and
    said only that)."""
    original = torch.nn.Module._apply

    def _apply(self, fn, recurse=True):
        modules = self.modules() if recurse else (self,)
        held = [t for m in modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
        if all(fn(t) is t for t in held):
            return self
        try:
            return original(self, fn, recurse)
        except RuntimeError as err:
            if "Couldn't swap" not in str(err):
                raise
            raise CaptureError(Problem(f"{type(self).__name__}{_at_user_line()}", "is moved or cast (module.to(...), "
                                       ".float(), .half() ...) inside the sharded function: a module's parameters "
                                       "are lifted state, read as they are at every call (and one made inside "
                                       "would be made again by no later call)",
                                       "make and convert the module once before the first call (model.to(dtype)), "
                                       "or cast the values where they are used (F.linear(x, w.to(dtype)))"),
                               headline="cannot capture the function") from err

    with mock.patch.object(torch.nn.Module, "_apply", _apply):
        yield


@contextlib.contextmanager
def _cumulative_batch_norm():
    """BatchNorm with `momentum=None` (a cumulative average of the batch statistics, as
    `torch.optim.swa_utils.update_bn` sets it) traced as the update it makes: torch's forward
    reads the batch count into a Python float (`1.0 / float(self.num_batches_tracked)`), which a
    trace cannot; the same average is computed with the count as a tensor."""
    cls = torch.nn.modules.batchnorm._BatchNorm
    original = cls.forward

    def forward(self, input):  # noqa: A002 - torch's own name
        if self.momentum is not None or not (self.training and self.track_running_stats) \
                or self.num_batches_tracked is None or self.running_mean is None:
            return original(self, input)
        self._check_input_dim(input)
        self.num_batches_tracked.add_(1)
        out = torch.nn.functional.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        dims = [0, *range(2, input.dim())]
        with torch.no_grad():
            factor = 1.0 / self.num_batches_tracked.double()
            for stat, batch in ((self.running_mean, input.mean(dims)), (self.running_var, input.var(dims, correction=1))):
                stat.copy_(stat * (1 - factor) + batch * factor)
        return out

    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = original


_PY_RANDOM = ("random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample", "gauss",
              "normalvariate", "getrandbits", "betavariate", "expovariate", "triangular", "lognormvariate",
              "vonmisesvariate", "gammavariate", "paretovariate", "weibullvariate", "randbytes", "binomialvariate")
_STDLIB = os.path.dirname(os.__file__) + os.sep  # (logging reads the clock for its records: not the user's reading)
_CLOCKS = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time")
_NOT_DRAWS = frozenset({"seed", "get_state", "set_state", "RandomState", "Generator", "default_rng", "BitGenerator",
                        "SeedSequence", "MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64", "get_bit_generator",
                        "set_bit_generator", "bit_generator"})
_REFUSED = contextvars.ContextVar("hpfun_refused_reads", default=None)  # the trace's refused draws, while one runs
_DRAW_FIX = ("draw with torch instead (`torch.rand(()) < 0.5` with torch.where: hpfun draws anew at every call, the "
             "same values on every layout), or draw outside the function and pass the result in")
# torch.distributed's own collectives, called inside the function (DDP-style code, SyncBatchNorm):
# hpfun's program is global-view and makes its own; one run while tracing would be one rank's alone
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
                "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object",
                "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
                "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_reduce_coalesced", "send_object_list",
                "recv_object_list")
_COLLECTIVE_FIX = ("write the step on whole tensors and leave the communication to hpfun (a gradient's "
                   "`all_reduce` is what a data-parallel layout's Partial -> Replicate already does; "
                   "`nn.SyncBatchNorm` is `nn.BatchNorm`, its statistics over the whole batch), or call it outside "
                   "the sharded function")
_CLOCK_FIX = ("time the call outside the sharded function (`start = time.perf_counter(); loss = step(x); "
              "elapsed = time.perf_counter() - start`), or pass the value in as an argument")


def _refuse(problem: Problem) -> None:
    """Note a read the program could not repeat; the trace goes on, and all of them are
    reported together when it ends (`_python_random_refused`)."""
    found = _REFUSED.get()
    if found is None:
        raise CaptureError(problem)
    if problem not in found:
        found.append(problem)


def _guard_draw(module: str, name: str, original, thread: int):
    def draw(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if threading.get_ident() == thread and _is_user_frame(caller):
            _refuse(Problem(f"{module}.{name}{_at_user_line()}", "draws a Python random number while hpfun traces "
                            "the function: the program would repeat this one draw at every call", _DRAW_FIX))
        return original(*args, **kwargs)
    return draw


def _guard_collective(name: str, original, thread: int, caller_depth: int = 1):
    def collective(*args, **kwargs):
        frame = sys._getframe(caller_depth)
        while caller_depth > 1 and frame is not None and (frame.f_code.co_filename.startswith(TORCH_DIR) or (
                frame.f_code.co_name == "__torch_function__" and frame.f_code.co_filename.startswith(HPFUN_DIR))):
            frame = frame.f_back  # (torch's own frames between the call and the torch-function mode, and hpfun's
            # other modes: an optimizer's step is traced under lift.ScalarSigns too)
        caller = frame.f_code.co_filename if frame is not None else HPFUN_DIR
        if threading.get_ident() != thread or caller.startswith(HPFUN_DIR):
            return original(*args, **kwargs)
        _refuse(Problem(f"torch.distributed.{name}{_at_user_line()}", "is a collective the function calls itself, while "
                        "hpfun traces it: hpfun's program works on whole tensors and makes its own collectives, so "
                        "this one would run once, in the trace, on one rank's stand-ins", _COLLECTIVE_FIX))
        return _NoWork()  # (nothing run: the trace goes on, and every problem is said at its end)
    return collective


class _NoWork:
    """What a refused collective returns, for code that waits on it (`work.wait()`)."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _guard_clock(name: str, original, thread: int):
    def read(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if threading.get_ident() == thread and _is_user_frame(caller) and not caller.startswith(_STDLIB):
            _refuse(Problem(f"time.{name}{_at_user_line()}", "reads the clock while hpfun traces the function: the "
                            "program would repeat the trace's reading at every call", _CLOCK_FIX))
        return original(*args, **kwargs)
    return read


@contextlib.contextmanager
def _python_random_refused():
    """Python's and NumPy's random functions, called while traced by code other than torch's and
    hpfun's (the user's, or a model library's: a LayerDrop decided with `random.uniform`), are
    refused: the trace would draw once and the program repeat that draw at every call (an
    augmentation `if random.random() < 0.5` applied always or never), silently. Reading the
    clock likewise. Each is noted and the trace goes on, so that one error lists them all.
    Draws these patches cannot see (a name imported from `random`, a generator object) are
    found by their generators' states (`unguarded_draws`)."""
    import random
    import time

    thread = threading.get_ident()  # (another thread's draws are its own business)
    patches = [mock.patch.object(random, name, _guard_draw("random", name, getattr(random, name), thread))
               for name in _PY_RANDOM if hasattr(random, name)]
    patches += [mock.patch.object(time, name, _guard_clock(name, getattr(time, name), thread)) for name in _CLOCKS]
    if torch.distributed.is_available():
        patches += [mock.patch.object(torch.distributed, name, _guard_collective(name, getattr(torch.distributed, name),
                                                                                 thread))
                    for name in _COLLECTIVES if hasattr(torch.distributed, name)]
    np = sys.modules.get("numpy")
    if np is not None:
        patches += [mock.patch.object(np.random, name, _guard_draw("numpy.random", name, getattr(np.random, name), thread))
                    for name in getattr(np.random, "__all__", ()) if name not in _NOT_DRAWS
                    and callable(getattr(np.random, name, None)) and not isinstance(getattr(np.random, name), type)]
    found: list = []
    token = _REFUSED.set(found)
    try:
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            yield
    except Exception as err:
        if not found:
            raise
        raise CaptureError(found + list(getattr(err, "problems", ())),
                           headline="the function reads what a program cannot repeat") from err
    finally:
        _REFUSED.reset(token)
    if found:
        raise CaptureError(found, headline="the function reads what a program cannot repeat")


def _clock_name(obj) -> str | None:
    """The name of the `time` function `obj` is (`perf_counter` imported by name), or None."""
    import time

    if not isinstance(obj, types.BuiltinFunctionType):  # (before any getattr: a user's AttrDict raises KeyError)
        return None
    name = getattr(obj, "__name__", None)
    return name if name in _CLOCKS and getattr(obj, "__module__", None) == "time" else None


def _generator(obj):
    """The random generator `obj` is, or whose method it is (`rng.random`), or None."""
    import random

    if isinstance(obj, (types.BuiltinMethodType, types.MethodType)):  # (a bound `rng.random`; not a getattr
        obj = obj.__self__  # on any object: a user's AttrDict raises KeyError for a missing name)
    if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
        return obj
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, (np.random.Generator, np.random.RandomState, np.random.BitGenerator)):
        return obj
    return None


def _generator_state(gen):
    import random

    if isinstance(gen, random.Random):
        return gen.getstate()
    bits = gen if not hasattr(gen, "bit_generator") else gen.bit_generator
    bits = getattr(gen, "_bit_generator", bits)  # (a RandomState's)
    return pickle.dumps(bits.state)


def _set_generator_state(gen, state) -> None:
    import random

    if isinstance(gen, random.Random):
        gen.setstate(state)
        return
    bits = gen if not hasattr(gen, "bit_generator") else gen.bit_generator
    bits = getattr(gen, "_bit_generator", bits)
    bits.state = pickle.loads(state)


def cell_value(cell, empty=None):
    """A closure cell's value; `empty` for an empty one (a variable assigned only on another
    branch), whose `cell_contents` raises ValueError, not AttributeError."""
    try:
        return cell.cell_contents
    except ValueError:
        return empty


@contextlib.contextmanager
def unguarded_draws(fn, opaque=()):
    """Around the traced call of `fn`: random draws and clock reads `_python_random_refused`'s
    patches of the modules cannot see. Python's and NumPy's global generators and the generator
    objects the function reads (`opaque`, as lift found them: `rng = random.Random(0)`,
    `np.random.default_rng()`, a bound `rng.random`) are drawn from if their state moved: each is
    refused by name, and set back. A clock function the function's own globals or cells hold
    under another name (`from time import perf_counter`) is guarded there."""
    import random
    import time

    sources = {id(random._inst): ("random (Python's module-level generator, drawn from by your code or a library's "
                                  "under another name: `from random import random`, a layer-drop's `random()`)",
                                  random._inst)}
    np = sys.modules.get("numpy")
    if np is not None and hasattr(np.random, "mtrand"):
        glob = np.random.mtrand._rand
        sources[id(glob)] = ("numpy.random (NumPy's global generator)", glob)
    for name, obj in opaque:
        gen = _generator(obj)
        if gen is not None and id(gen) not in sources:
            sources[id(gen)] = (name, gen)
    before = {key: _generator_state(gen) for key, (_, gen) in sources.items()}
    thread = threading.get_ident()
    places = []
    target = getattr(fn, "__func__", fn)
    if isinstance(target, types.FunctionType):
        g = target.__globals__
        places += [(g, var) for var in target.__code__.co_names if _clock_name(g.get(var))]
        places += [(cell, None) for cell in target.__closure__ or () if _clock_name(cell_value(cell))]
    with contextlib.ExitStack() as stack:
        for holder, var in places:
            if var is not None:
                original = holder[var]
                stack.enter_context(mock.patch.dict(holder, {var: _guard_clock(_clock_name(original), original, thread)}))
            else:
                original = holder.cell_contents
                holder.cell_contents = _guard_clock(_clock_name(original), original, thread)
                stack.callback(setattr, holder, "cell_contents", original)
        try:
            yield
        finally:
            guarded = {p.where.split(".")[0] for p in _REFUSED.get() or ()}  # (a patched draw already named: once)
            for key, (name, gen) in sources.items():
                if _generator_state(gen) != before[key]:
                    _set_generator_state(gen, before[key])
                    if name.split(" ")[0].split(".")[0] not in guarded:
                        fix = _DRAW_FIX
                        if key == id(random._inst) and "beartype" in sys.modules:
                            fix += (" (beartype is loaded: its checks of a list's or dict's items pick one with "
                                    "`random.getrandbits`, a draw that changes no result; if that is the only draw, "
                                    "set PYTHONOPTIMIZE=1 before the library is imported, which turns @beartype off)")
                        _refuse(Problem(name, "was drawn from while hpfun traced the function: the program would "
                                        "repeat the trace's draws at every call", fix))


@contextlib.contextmanager
def _dispatch_keys_restored_on_error():
    """Put this thread's dispatch keys back as they were when tracing fails. The guards torch's
    `torch.func` transforms hold in the failed frames set keys as those frames are freed: after a
    failed trace of `vmap(jacfwd(f))` the functorch, ADInplaceOrView and Python-snapshot keys
    stayed excluded once the error was dropped, and a later trace of a transform in the process
    (`vmap` of `grad` over `functional_call`) failed, plain `make_fx`'s too: in a notebook, the
    next cells. So those frames are
    cleared first (their error's message is made by then), then the keys set back. A
    function's own exception keeps its frames, for the user's debugger."""
    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    try:
        yield
    except BaseException as err:
        seen, chained = set(), err
        while chained is not None and id(chained) not in seen and not getattr(chained, "hpfun_raised_by_the_code", False):
            seen.add(id(chained))
            traceback.clear_frames(chained.__traceback__)
            chained = chained.__cause__ or chained.__context__
        for key in torch._C.DispatchKey.__members__.values():
            if torch._C._dispatch_tls_is_dispatch_key_included(key) != include.has(key):
                torch._C._dispatch_tls_set_dispatch_key_included(key, include.has(key))
            if torch._C._dispatch_tls_is_dispatch_key_excluded(key) != exclude.has(key):
                torch._C._dispatch_tls_set_dispatch_key_excluded(key, exclude.has(key))
        raise


def _trace(fn, fakes) -> torch.fx.GraphModule:
    with _dispatch_keys_restored_on_error():  # (around the error's report too: making it can set keys)
        return _make_fx(fn, fakes)


# The torch-function modes a trace runs under (`_TensorScalars`, and `lift.ScalarSigns` while an
# optimizer's step may run), outermost first: the Python the autograd engine runs holds them too.
_BACKWARD_MODES: list = []


@contextlib.contextmanager
def in_backwards(mode):
    """`mode` also in the Python the autograd engine runs while a trace backpropagates: a custom
    autograd.Function's backward (torchdiffeq's adjoint checks its time points there), a
    tensor's or module's backward hook, and a parameter's post-accumulate-grad hook (an
    optimizer stepped per parameter as its gradient is ready: its hyperparameters are traced
    stand-ins). A mode handling `backward` is off the stack while it runs, so the engine ran
    that Python without any: a read of the arguments' values there was refused, and a stand-in
    learning rate given as an op's number was read with `.item()`."""
    _BACKWARD_MODES.append(mode)
    try:
        yield mode
    finally:
        _BACKWARD_MODES.remove(mode)


@contextlib.contextmanager
def _modes_in_backwards():
    """While tracing, the autograd engine runs under the modes of `_BACKWARD_MODES` not on the
    stack (see `in_backwards`)."""
    from torch.autograd import graph

    original = graph._engine_run_backward

    @functools.wraps(original)
    def run(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            active = torch.overrides._get_current_function_mode_stack()
            for mode in list(_BACKWARD_MODES):
                if not any(m is mode for m in active):
                    stack.enter_context(mode)
            return original(*args, **kwargs)

    with mock.patch.object(graph, "_engine_run_backward", run), \
            mock.patch.object(torch.autograd, "_engine_run_backward", run):
        yield


@contextlib.contextmanager
def _flex_attention_as_math():
    """torch's flex_attention traced as the math it computes on a CPU (its reference: scores,
    `score_mod` and `mask_mod` vectorized over them, softmax, times the values), plain ops whose
    rules hpfun has. Its operator takes the score and mask functions as graphs of their own,
    which hpfun's passes cannot read (an internal error)."""
    api = sys.modules.get("torch.nn.attention.flex_attention")
    if api is None or not hasattr(api, "flex_attention_hop"):
        yield
        return
    hop = importlib.import_module("torch._higher_order_ops.flex_attention")

    def math(query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers=(),
             mask_mod_other_buffers=()):
        out, lse, max_scores = hop.math_attention(query, key, value, score_mod, block_mask, scale, kernel_options,
                                                  score_mod_other_buffers, mask_mod_other_buffers)
        return hop._permute_strides(out, query.stride()), lse, max_scores

    with mock.patch.object(api, "flex_attention_hop", math):
        yield


def _control_flow_predicate(pred, op: str) -> bool:
    """A control-flow operator's predicate as a Python bool, where hpfun can read it (a number,
    or a value made from the arguments, checked at every call); refused otherwise."""
    if not isinstance(pred, torch.Tensor):
        return bool(pred)
    value = _read(bool, pred)
    if value is _UNREADABLE:
        raise CaptureError(Problem(f"{op}{_at_user_line()}", f"{op} branches on a tensor value hpfun cannot read "
                                   "(made from parameters or random draws): a program traced once takes one branch",
                                   "compute both branches and pick with torch.where(pred, a, b) (for a loop, a fixed "
                                   "number of steps), or make the predicate from the arguments, whose values hpfun "
                                   "reads"))
    return value


@contextlib.contextmanager
def _control_flow_as_python():
    """`torch.cond` and `while_loop` run as the Python control flow they stand for where hpfun can
    read their predicates (a Python number, a value made from the arguments: the program is
    right for those values, checked at every call), and are refused by name otherwise. Their
    operators take the branches as graphs of their own, which hpfun's passes cannot read."""
    cond_module = importlib.import_module("torch._higher_order_ops.cond")
    loop_module = importlib.import_module("torch._higher_order_ops.while_loop")

    def cond(pred, true_fn, false_fn, operands=()):  # (`cond_op`: what `torch.cond` calls while compiling)
        return (true_fn if _control_flow_predicate(pred, "torch.cond") else false_fn)(*operands)

    def while_loop(cond_fn, body_fn, carried_inputs, additional_inputs=()):  # (`while_loop_op`: on the flat
        carried = tuple(carried_inputs)  # inputs, as `while_loop` calls it while compiling)
        while _control_flow_predicate(cond_fn(*carried, *additional_inputs), "while_loop"):
            carried = tuple(body_fn(*carried, *additional_inputs))
        return carried

    with mock.patch.object(cond_module, "cond_op", cond), mock.patch.object(loop_module, "while_loop_op", while_loop):
        yield


def _make_fx(fn, fakes) -> torch.fx.GraphModule:
    # The tensors go in as one list, not one argument each. make_fx wraps the function in a
    # generated `lambda arg0, ..., argN: fn(arg0, ..., argN)`, whose frame holds two slots per
    # argument: at 32 GPT layers (1170 tensors) it filled most of a 16 KiB chunk of CPython's
    # frame stack, and every op traced above it crossed into the next chunk, which CPython maps
    # and unmaps at each crossing (324,000 mmap/munmap pairs; a third of the capture's time).
    traced = make_fx(lambda arg: fn(*arg), decomposition_table=decompositions(), tracing_mode="fake",
                     record_stack_traces=True)
    scalars = _TensorScalars()
    try:
        with mock.patch.object(proxy_tensor.PythonKeyTracer, "_filter_traceback_frames", _innermost_user_frame), \
                mock.patch.object(torch.fx.proxy, "CapturedTraceback", _UserFrame), \
                mock.patch.object(torch.compiler, "_is_compiling_flag", True), exact_step_scalars(), traced_steps(), \
                _compiled_code_runs_as_written(), torch_checkpoints(), scalars, in_backwards(scalars), _modes_in_backwards(), \
                _lstm_as_matmuls(), _cumulative_batch_norm(), _module_conversions(), _python_random_refused(), \
                _linearize_refused(), _nested_encoder_as_eager(), _flex_attention_as_math(), _control_flow_as_python(), \
                _library_checks_keep_their_messages():
            gm = traced(list(fakes))
    except CaptureError:
        raise
    except Exception as err:  # re-raised with the user's line: tracing errors come in many types
        if _raised_by_the_code(err):  # the function's own `raise ValueError(...)`: as eager raises it
            err.add_note("(raised while hpfun.shard traced the function)")
            err.hpfun_raised_by_the_code = True
            raise
        if "convert all Tensors to FakeTensors" in str(err):
            raise UnliftedTensor(_user_where(err), _real_tensor_in(err)) from err
        raise CaptureError(_describe(err)) from err
    if own := [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None)
               in ("_c10d_functional", "c10d_functional") and "wait_tensor" not in str(n.target)]:
        # torch.distributed._functional_collectives called by the function (the patch of torch.distributed's
        # own names covers the others): refused at their lines as those are, not left to the rules
        raise CaptureError([Problem(f"{n.target}" + (f" at {line}" if (line := user_line(n.meta.get("stack_trace")))
                                                     else ""),
                                    "is a collective the function calls itself (torch.distributed."
                                    "_functional_collectives), while hpfun traces it: hpfun's program works on whole "
                                    "tensors and makes its own collectives", _COLLECTIVE_FIX) for n in own],
                           headline="the function calls torch.distributed itself")
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):  # named as make_fx names a flat signature's
        node._rename(f"arg{i}_1")
        node.target = node.name
    gm.recompile()
    return gm


# ---------------------------------------------------------------------------------------------
# Fused ops: recorded whole, then split for propagation (hpfun.fuse puts them back)
# ---------------------------------------------------------------------------------------------

FUSED = (aten._softmax.default, aten._log_softmax.default,
         aten._softmax_backward_data.default, aten._log_softmax_backward_data.default,
         aten.embedding_dense_backward.default, aten.nll_loss_backward.default)


@attrs.define(eq=False)
class FusedGroup:
    """The nodes one fused op became, and how to call it again."""

    target: object
    args: tuple
    kwargs: dict
    meta: dict
    nodes: list = attrs.Factory(list)
    output: torch.fx.Node | None = None
    # per tensor argument, a group node reading it and the position of the argument among that
    # node's arguments: later passes (folding matmuls into einsums) may replace the argument's
    # node, never the probe
    probes: list = attrs.Factory(list)

    def current_args(self) -> tuple | None:
        originals = [a for a in self.args if _is_tensor_node(a)]
        found = []
        for probe, original in zip(self.probes, originals, strict=True):
            if probe is None:  # no piece reads it: the argument itself, if no pass replaced it
                if getattr(original, "_erased", False):
                    return None
                found.append(original)
                continue
            node, index = probe
            found.append(pytree.tree_leaves((node.args, node.kwargs))[index])
        it = iter(found)
        return tuple(next(it) if _is_tensor_node(a) else a for a in self.args)


def _is_tensor_node(x) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


_NON_NEGATIVE_INDEX = frozenset([torch.index_add, torch.Tensor.index_add, torch.Tensor.index_add_, torch.index_copy,
                                  torch.Tensor.index_copy, torch.Tensor.index_copy_])
_SOFTMAXES = frozenset([torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax,
                        torch.nn.functional.softmax, torch.nn.functional.log_softmax, torch.nn.functional.softmin])


def _refuse_integer_softmax(gm: torch.fx.GraphModule) -> None:
    """softmax / log_softmax of an integer or bool tensor (F.cross_entropy of integer logits):
    torch's kernels refuse it, its meta kernel does not, and once split into its decomposition
    (`split_fused`) it would compute truncated numbers. Refused as eager refuses it, at the line."""
    problems = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (aten._softmax.default, aten._log_softmax.default):
            val = node.args[0].meta.get("val")
            if isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex()):
                name = "log_softmax" if node.target is aten._log_softmax.default else "softmax"
                problems.append(Problem(user_line(node.meta.get("stack_trace")) or name,
                                        f"{name} of a {str(val.dtype).removeprefix('torch.')} tensor, which torch's "
                                        f"kernels refuse (they take floating point)",
                                        f"cast it first (x.float()), or pass dtype=torch.float32 to {name}"))
    if problems:
        raise CaptureError(problems)


def split_fused(gm: torch.fx.GraphModule) -> None:
    """Rewrite every fused op of `gm` into its decomposition, each group tagged for
    `hpfun.fuse.rejoin`. The op's own node becomes the decomposition's last op, so it keeps its
    name and users."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in FUSED:
            continue
        tensors = [a for a in node.args if _is_tensor_node(a)]
        sub = _fused_decomposition(node.target, tuple((tuple(t.meta["val"].shape), t.meta["val"].dtype) for t in tensors),
                                   tuple(_TENSOR if _is_tensor_node(a) else a for a in node.args))
        last = sub.graph.output_node().args[0][0]
        if last.op != "call_function":
            continue  # nothing to split (a decomposition that returns an input as it is)
        group = FusedGroup(node.target, node.args, dict(node.kwargs), dict(node.meta), output=node)
        env, feeds, placeholders = {}, iter(tensors), []
        with gm.graph.inserting_before(node):
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    env[n] = next(feeds)
                    placeholders.append(n)
                elif n is last:
                    node.target = n.target
                    node.args, node.kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                    node.meta["hpfun_group"] = group
                    env[n] = node
                elif n.op == "call_function":
                    new = gm.graph.node_copy(n, env.__getitem__)
                    for key in ("stack_trace", "nn_module_stack"):
                        if key in node.meta:
                            new.meta[key] = node.meta[key]
                    new.meta["hpfun_group"] = group
                    env[n] = new
        group.nodes = [env[n] for n in sub.graph.nodes if n.op == "call_function"]
        group.probes = [_probe(p, env) for p in placeholders]
    gm.recompile()


_TENSOR = object()  # a tensor argument's place among a fused op's static arguments (None is an argument)


def _probe(placeholder, env) -> tuple | None:
    for user in placeholder.users:
        if user.op == "call_function":
            leaves = pytree.tree_leaves((user.args, user.kwargs))
            return env[user], next(i for i, x in enumerate(leaves) if x is placeholder)
    return None


@functools.lru_cache(maxsize=256)
def _fused_decomposition(target, metas: tuple, static_args: tuple) -> torch.fx.GraphModule:
    """The fused op's decomposition into core ops, traced once per op, shapes and arguments."""
    decompose = get_decompositions([target])[target]

    def run(*tensors):
        it = iter(tensors)
        return [decompose(*[next(it) if a is _TENSOR else a for a in static_args])]

    return capture(run, list(metas))


_ALPHA = {torch.add, torch.sub, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.sub, torch.Tensor.sub_}
_LERP = {torch.lerp, torch.Tensor.lerp, torch.Tensor.lerp_}
_VALUE = {torch.addcdiv: torch.addcdiv, torch.addcmul: torch.addcmul, torch.Tensor.addcdiv: torch.addcdiv,
          torch.Tensor.addcmul: torch.addcmul, torch.Tensor.addcdiv_: torch.addcdiv, torch.Tensor.addcmul_: torch.addcmul}


def _at_user_line() -> str:
    """' at file:line: code' of the innermost user frame calling now, or ''."""
    frames = [f for f in traceback.extract_stack() if _is_user_frame(f.filename)]
    return f" at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else ""


_AS_STRIDED = (torch.Tensor.as_strided, torch.as_strided)
_DETERMINANTS = frozenset([torch.det, torch.Tensor.det, torch.linalg.det, torch.logdet, torch.Tensor.logdet,
                           torch.slogdet, torch.Tensor.slogdet, torch.linalg.slogdet])
_RESIZES = (torch.Tensor.resize_as_, torch.Tensor.resize_)
_DATA = torch._C.TensorBase.__dict__["data"]


def _set_data(target, value) -> None:
    """`p.data = new` (weight clipping after the step, an EMA swapped in) as the in-place copy it
    is for every later read: setting `.data` swaps a tensor's contents outside anything a trace
    records, so the write was lost. A lifted leaf takes the new values, and is written back."""
    if not isinstance(value, torch.Tensor) or value.shape != target.shape or value.dtype != target.dtype:
        what = f"a {type(value).__name__}" if not isinstance(value, torch.Tensor) else \
            f"{value.dtype} {list(value.shape)} (it is {target.dtype} {list(target.shape)})"
        raise CaptureError(f"`.data` of a tensor is set to {what}{_at_user_line()}: a lifted tensor keeps its shape "
                           "and dtype inside a sharded function; assign a new tensor to its place instead "
                           "(module.weight = torch.nn.Parameter(...)) outside it")
    rebinds = _REBINDS[-1] if _REBINDS else None
    mode = proxy_tensor.get_proxy_mode()
    if rebinds is None or mode is None or value is target or not isinstance(value, FakeTensor) \
            or value.device != target.device or value.layout != target.layout:
        with torch.no_grad():
            target.copy_(value)
        return
    # eager's `p.data = v` makes p share v's storage, and leaves p's old storage to what else holds it (a backup
    # taken with `b = p.data` before): p is traced as v from here on (its writes reach v, as eager's do), and
    # its lifted tensor takes p's last value at the end of the function (`data_rebinds`)
    if not any(t is target for t, _ in rebinds):
        with torch.no_grad():
            rebinds.append((target, target.detach()))  # (an alias of the lifted tensor's own storage, traced)
    proxy = proxy_tensor.get_proxy_slot(value, mode.tracer)
    with torch.no_grad():
        _DATA.__set__(target, value)
    mode.tracer.tensor_tracker[target] = proxy


def _same_place(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same elements of one storage."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset() \
        and a.stride() == b.stride() and a.shape == b.shape


_REBINDS: list = []  # per trace being run: [(a tensor whose `.data` was set, an alias of its storage before)]


@contextlib.contextmanager
def data_rebinds(inputs: frozenset = frozenset()):
    """While the function runs in a trace: each input (`inputs`: the ids of the stand-ins) given
    another's storage by `p.data = v` (an EMA's weights swapped in, a backup restored) takes,
    when the function returns, its last value into its own storage: the lifted tensor keeps its
    identity and is written back. A tensor the function made (an optimizer's first momentum) is
    written back as it ends, its storage shared or not."""
    _REBINDS.append([])
    try:
        yield
        moved = [(target, own) for target, own in _REBINDS[-1]  # (a backup put back: its own storage again)
                 if id(target) in inputs and not _same_place(target, own)]  # every last value read before any is
        with torch.no_grad():  # put: a swap, `a.data, b.data = b.data, a.data`, gives a the storage b's value is put into
            last = [target.clone() if len(moved) > 1 else target for target, _ in moved]
            for (_, own), value in zip(moved, last):
                own.copy_(value)
    finally:
        _REBINDS.pop()


def _as_strided(as_strided, x, size, stride, storage_offset=None):
    """`x.as_strided(size, stride)` (Longformer's overlapping chunks) as the gather it is: the
    elements of `x` it addresses, picked by index. Its sizes and strides address the storage of
    the tensor traced, which the per-shard program's tensor (a block, or a gathered copy laid out
    otherwise) does not share; indices address values, whatever their layout, and their
    gradient (an index_put that sums where windows overlap) is autograd's own. Addresses that are
    not all elements of `x` (storage beyond it, or overlapping elements) are left to torch."""
    base = x.storage_offset()
    offset = base if storage_offset is None else storage_offset
    size, stride = list(size), list(stride)
    if x.numel() == 0 or 0 in size or len(size) != len(stride) or min(stride, default=0) < 0 \
            or min(x.stride(), default=0) < 0 or not _distinct_elements(x):
        return as_strided(x, size, stride, storage_offset)
    span = sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1  # the storage x's elements lie in
    if offset < base or offset + sum((n - 1) * s for n, s in zip(size, stride)) >= base + span:
        return as_strided(x, size, stride, storage_offset)
    device = x.device
    if x.is_contiguous():
        at = torch.arange(span, device=device).as_strided(size, stride, offset - base)
        return _taken(_picked(x.reshape(-1), at))
    with proxy_tensor.disable_proxy_modes_tracing(), unset_fake_temporarily():  # every address one of x's
        where = torch.full((span,), -1, dtype=torch.int64)
        where[torch.arange(span).as_strided(tuple(x.shape), x.stride(), 0).reshape(-1)] = torch.arange(x.numel())
        if bool((where.as_strided(size, stride, offset - base) < 0).any()):
            return as_strided(x, size, stride, storage_offset)
    elements = torch.arange(span, device=device).as_strided(tuple(x.shape), x.stride(), 0).reshape(-1)
    where = torch.full((span,), -1, dtype=torch.int64, device=device).index_put(
        (elements,), torch.arange(x.numel(), device=device))
    return _taken(_picked(x.reshape(-1), where.as_strided(size, stride, offset - base)))


def _picked(flat: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """`flat[at]`, a gather by the index tensor `at`; a 0-d `at` (`as_strided(t, (), ())`,
    torchdiffeq's adjoint) as a one-element gather, since indexing by a 0-d tensor reads it
    as an integer, which a trace cannot."""
    return flat[at.reshape(1)].reshape(()) if at.ndim == 0 else flat[at]


_TAKEN: dict = {}  # id -> (weak reference, what it is, how to write it back) of each view eager makes that hpfun
# takes by index (a copy)


def _taken(out: torch.Tensor, what: str = "the result of as_strided", back=None) -> torch.Tensor:
    """`out`, a copy taken by index where eager makes a view, marked (its base too, which views
    of it share): an in-place write into it is written back by `back(base)` where given (the copy
    put at the place it was read from), and refused otherwise (`_refuse_overlapping_write`)."""
    if len(_TAKEN) > 4096:
        for k in [k for k, (r, *_) in _TAKEN.items() if r() is None]:
            del _TAKEN[k]
    for x in (out, out._base):
        if x is not None:
            _TAKEN[id(x)] = (weakref.ref(x), what, back)
    return out


def _taken_entry(t) -> tuple | None:
    """(the copy, what it stands for, how to write it back) where `t` is such a copy or views one."""
    for x in (t, getattr(t, "_base", None)):
        ref, what, back = _TAKEN.get(id(x), (None, None, None)) if x is not None else (None, None, None)
        if ref is not None and ref() is x:
            return x if back is None or x._base is None else x._base, what, back
    return None


def _distinct_elements(x) -> bool:
    """Whether no two elements of `x` share a storage place (true of every tensor but expanded
    ones and some as_strided views): each dim's stride passes the span of the dims strided finer."""
    reach = 0
    for s, n in sorted((s, n) for n, s in zip(x.shape, x.stride()) if n > 1):
        if s <= reach:
            return False
        reach += (n - 1) * s
    return True


# `checked(x, ok, message)`: x itself, where every element of `ok` (x's shape) is true; else the
# error eager's kernel raises. Elementwise, so each rank checks its own block of a split x and
# nothing is gathered: what a decomposition written without torch's checks (which read values)
# needs to fail as eager fails (F.one_hot of a class id out of range).
_LIB = torch.library.Library("hpfun", "FRAGMENT")
_LIB.define("checked(Tensor x, Tensor ok, str message) -> Tensor")


def _checked_impl(x, ok, message):
    if not bool(ok.all()):
        raise RuntimeError(message)
    return x.clone()


_LIB.impl("checked", _checked_impl, "CompositeExplicitAutograd")
torch.library.register_fake("hpfun::checked", lambda x, ok, message: torch.empty_like(x), lib=_LIB)
checked = torch.ops.hpfun.checked.default


def _one_hot(one_hot, input, num_classes=-1):  # noqa: A002 - F.one_hot's own name
    """F.one_hot as the comparison it computes. torch's kernel reads the values to check them
    (`.item()`, which a trace cannot do; under torch.func.grad its decomposition is skipped), and
    without num_classes it reads the number of classes from them: from the arguments' values,
    that is a read checked at every call (`InputRead`), as `labels.max()` is; from other values
    it is refused. Class ids out of range raise as torch's kernel does (`checked`, on each rank's
    own block)."""
    if input.dtype != torch.int64:
        return one_hot(input, num_classes)  # torch's own error: class ids are int64
    if num_classes == -1:
        largest = _read(torch.Tensor.__int__, input.max())
        if largest is _UNREADABLE:
            raise CaptureError(f"F.one_hot without num_classes{_at_user_line()}: the number of classes is the "
                               "largest value + 1, read from values the program computes, which a trace on shapes "
                               "cannot do; pass num_classes=")
        num_classes = largest + 1
    classes = torch.arange(num_classes, device=input.device)
    input = checked(input, (input >= 0) & (input < num_classes), "Class values must be non-negative and smaller "
                    f"than num_classes ({num_classes}).")
    return aten._to_copy.default(aten.eq.Tensor(input.unsqueeze(-1), classes), dtype=torch.int64)


def _bincount(bincount, input, weights=None, minlength=0):  # noqa: A002 - torch.bincount's own name
    """torch.bincount as the scatter-add it computes. Its length, max(minlength, largest + 1), is
    read from the values: from the arguments' values that is a read checked at every call (as
    F.one_hot's number of classes is), and labels within `minlength` always give the same length,
    so they compile once. From values the program computes it is refused."""
    if input.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8) or input.ndim != 1 \
            or (weights is not None and weights.dtype not in (torch.float32, torch.float64, torch.int64, torch.int32)):
        return bincount(input, weights, minlength)  # torch's own error, or its own kernel
    if input.numel() == 0:
        length = minlength
    else:
        length = _read(torch.Tensor.__int__, torch.clamp_min(input.max() + 1, minlength))
        if length is _UNREADABLE:
            raise CaptureError(f"torch.bincount{_at_user_line()}: its length is the largest value + 1, read from "
                               "values the program computes, which a trace on shapes cannot do; count into a fixed "
                               "length instead: F.one_hot(values, num_classes).sum(0), or torch.zeros(num_classes, "
                               "dtype=torch.int64).scatter_add_(0, values, torch.ones_like(values))")
    index = input.long()
    if weights is None:
        counts = torch.ones_like(index)
    else:
        counts = weights if weights.is_floating_point() else weights.double()  # torch counts integer weights in float64
    # (out of place: a count of readable values stays readable, for repeat_interleave or split by it)
    return torch.zeros(length, dtype=counts.dtype, device=input.device).scatter_add(0, index, counts)


def _cov(cov, input, correction=1, fweights=None, aweights=None):  # noqa: A002 - torch.cov's own names
    """torch.cov without weights, as the arithmetic it computes. torch's own kernel compares the
    weights' sum with the sample count through a read of values (`aten.equal`), which a trace
    cannot do; with weights it is still called, and refused as such a read."""
    if fweights is not None or aweights is not None or input.ndim > 2 or not input.is_floating_point():
        return cov(input, correction=correction, fweights=fweights, aweights=aweights)
    rows = input.reshape(1, -1) if input.ndim < 2 else input
    centered = rows - rows.mean(dim=1, keepdim=True)
    out = centered @ centered.transpose(0, 1) / max(rows.shape[1] - correction, 0)
    return out.squeeze() if input.ndim < 2 else out


def _corrcoef(corrcoef, input):  # noqa: A002
    """torch.corrcoef of real values through `_cov`: the covariance over the outer product of
    the standard deviations, clipped to [-1, 1] as torch clips it."""
    if input.ndim > 2 or not input.is_floating_point():
        return corrcoef(input)
    c = _cov(torch.cov, input)
    if c.ndim == 0:
        return c / c
    std = torch.sqrt(torch.diagonal(c))
    return torch.clip(c / std[:, None] / std[None, :], -1, 1)


_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                               "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


# in-place methods that change a tensor's flags or view, never its elements
_NOT_WRITES = frozenset({"requires_grad_", "detach_", "share_memory_", "rename_", "squeeze_", "unsqueeze_",
                         "transpose_", "t_", "swapdims_", "swapaxes_", "as_strided_"})


def _refuse_generator(func) -> None:
    """A random op given its own `torch.Generator`: the program draws hpfun's counter-based
    random numbers (the same for every layout), not the generator's, so its stream cannot be
    honoured; refused rather than silently ignored."""
    where = _at_user_line()
    name = getattr(func, "__name__", str(func))
    raise CaptureError(Problem(f"{name}{where}", "is given its own torch.Generator: inside a sharded function random "
                               "numbers come from hpfun's generator, the same for every layout, not from yours",
                               "drop generator= (hpfun.random_seed(seed) makes a call's draws reproducible), or draw "
                               "the numbers outside and pass them in"))


def _is_write(func) -> bool:
    """Whether `func` writes in place into its first argument (`add_`, `__setitem__`, `__iadd__`)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("_") or name in _IN_PLACE_DUNDERS) and name not in _NOT_WRITES


def _refuse_overlapping_write(func, args) -> None:
    """An in-place write into a tensor whose elements share memory (an `expand`ed one: the
    gradient of a sum is `ones.expand(n)`) sets the shared element once per alias in eager, but
    functionalization writes each alias back as if it were its own element, so the program would
    compute something else. torch deprecates such writes; hpfun refuses them before tracing on.
    Marking such a tensor as requiring a gradient (`torch.func.grad` of a function of it) or
    re-viewing it writes nothing."""
    if not _is_write(func):
        return
    name = getattr(func, "__name__", "")
    target = args[0] if args else None
    if isinstance(target, torch.Tensor) and _TAKEN and (taken := _taken_entry(target)) is not None \
            and taken[2] is None:
        raise CaptureError(Problem(f"{name}{_at_user_line()}", f"writes in place into {taken[1]}, which hpfun takes by "
                                   "index (a copy: the write would not reach the tensor it views)",
                                   "write into that tensor itself (`y[j] = y[j] * 2`, index_put_, index_copy_, "
                                   "scatter_), or clone the result first"))
    if isinstance(target, torch.Tensor) and _overlaps_itself(target):
        where = _at_user_line()
        raise CaptureError(
            Problem(f"{name}{where}", f"writes in place into a tensor whose elements share memory (strides "
                                      f"{tuple(target.stride())}, e.g. made by expand)",
                    "clone() it first (x = x.clone()), as torch's own deprecation warning asks"))


def _overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether some elements of `tensor` share memory. Under `torch.func` transforms (vmap,
    grad, jacrev) it is a wrapper the check has no batching rule for: the tensor it wraps, the
    batch dims' strides included, is checked instead."""
    while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        tensor = torch._C._functorch.get_unwrapped(tensor)
    return torch._debug_has_internal_overlap(tensor) == 1


def _as_eager(out: torch.Tensor, *tensors) -> torch.Tensor:
    """`out` in the dtype eager gives when the traced scalar is a Python number: a float64 0-d
    scalar promotes 0-d operands (a scalar parameter), a Python float does not."""
    want = torch.result_type(tensors[0], tensors[1])
    for t in tensors[2:]:
        want = torch.promote_types(want, t.dtype)
    return out if out.dtype == want else out.to(want)


# reads of a tensor's values into Python: a trace on fake tensors cannot make them, unless the
# value is a constant (`_constant_value`)
_ADDRESSES: dict = {}  # during a trace: a stand-in's storage (its _cdata) -> the address its tensor's would have


def stands_at(fake: torch.Tensor, real: torch.Tensor) -> None:
    """Let `fake`, a lifted tensor's stand-in, and every view of it answer `data_ptr()` with
    the address eager's tensor (and its view) has: distinct per tensor, one for tied ones, a
    view's base plus its offset (every stand-in had had the same). None for a tensor without
    storage (a torch.func wrapper)."""
    with contextlib.suppress(RuntimeError):
        _ADDRESSES[fake.untyped_storage()._cdata] = real.data_ptr() - fake.storage_offset() * fake.element_size()


def _address(t):
    """`t.data_ptr()` as eager's, for a view of a lifted tensor's stand-in; None for any other."""
    try:
        base = _ADDRESSES.get(t.untyped_storage()._cdata)
    except (RuntimeError, AttributeError):
        return None
    return None if base is None else base + t.storage_offset() * t.element_size()


_NARROWS = frozenset([torch.narrow, torch.Tensor.narrow, torch.narrow_copy, torch.Tensor.narrow_copy])
_NARROW_NAMES = ("dim", "start", "length")  # (their arguments after the tensor)


def _slice_bounds_read(index):
    """`index` with each traced 0-d integer tensor among its slices' bounds read (`__index__`),
    or `index` itself where none is, or one cannot be read."""
    def bound(b):
        if isinstance(b, torch.Tensor) and b.ndim == 0 and not b.is_floating_point() and _is_traced(b):
            value = _read(torch.Tensor.__index__, b)
            return b if value is _UNREADABLE else value
        return b

    def item(i):
        if type(i) is slice and any(isinstance(b, torch.Tensor) for b in (i.start, i.stop, i.step)):
            return slice(bound(i.start), bound(i.stop), bound(i.step))
        return i

    parts = index if type(index) is tuple else (index,)
    read = tuple(map(item, parts))
    if all(a is b for a, b in zip(read, parts)):
        return index
    return read if type(index) is tuple else read[0]


# functions taking sizes or counts, which torch reads from a 0-d tensor given for one in C++
# (Longformer's `torch.arange(max_num_global_attn_indices)`): a readable one is read first
# ops taking a tensor, then ints torch parses in C++ (split sizes, pad amounts, shifts, k)
_TENSOR_THEN_SIZES = (torch.split, torch.Tensor.split, torch.Tensor.split_with_sizes, torch.tensor_split,
                      torch.Tensor.tensor_split, torch.nn.functional.pad, torch.roll, torch.Tensor.roll, torch.topk,
                      torch.Tensor.topk, torch.kthvalue, torch.Tensor.kthvalue, torch.chunk, torch.Tensor.chunk)
_SIZE_TAKERS = frozenset([torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn,
                          torch.randint, torch.randperm, torch.eye, torch.linspace, torch.logspace, torch.tril_indices,
                          torch.triu_indices, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty,
                          torch.Tensor.new_full, torch.Tensor.view, torch.Tensor.reshape, torch.reshape,
                          torch.Tensor.expand, torch.Tensor.repeat, torch.Tensor.unflatten, torch.unflatten,
                          *_TENSOR_THEN_SIZES])
_SIZE_KEYWORDS = ("size", "steps", "start", "end", "n", "m", "high", "low", "row", "col", "offset", "sizes", "shape",
                  "k", "shifts", "split_size_or_sections", "split_size", "indices_or_sections", "pad", "chunks")


def _sizes_read(func, args: tuple, kwargs: dict) -> tuple | None:
    """`args` and `kwargs` with each traced 0-d integer tensor among them (or in a size list)
    read as `int(t)` does (a float one too, for arange's bounds, whose length depends on them);
    None where there is none or one cannot be read. A method's own tensor stays."""
    first = 1 if func in _TENSOR_METHOD_TAKERS else 0
    sizes = _SIZE_POSITIONS.get(func)  # (positions after the method's own tensor that are sizes; all if None)
    changed = False

    def size(v):
        nonlocal changed
        if isinstance(v, (list, tuple)):
            read = [size(u) for u in v]
            return type(v)(read) if any(a is not b for a, b in zip(read, v)) else v
        if isinstance(v, torch.Tensor) and v.ndim == 0 and _is_traced(v) and v.dtype != torch.bool and \
                (not v.is_floating_point() or func is torch.arange):
            value = _read(torch.Tensor.__index__ if not v.is_floating_point() else torch.Tensor.item, v)
            if value is not _UNREADABLE:
                changed = True
                return value
        return v

    new_args = (*args[:first], *(size(a) if sizes is None or i in sizes else a for i, a in enumerate(args[first:])))
    new_kwargs = {k: size(v) if k in _SIZE_KEYWORDS else v for k, v in kwargs.items()}
    return (new_args, new_kwargs) if changed else None


def _ints_read(args: tuple, kwargs: dict, masks: bool = False) -> tuple | None:
    """`args` and `kwargs` with each traced 0-d integer tensor after the first argument (in a list
    or tuple too) read as `int(t)` (a uint8 one too: an index takes it as a mask, `x.select(1, t)`
    as an int; a bool one torch refuses), and each 0-d float one as `float(t)` (`F.leaky_relu(x,
    slope)`, where torch parses a float); None where there is none or one cannot be read."""
    changed = False

    def number(v):
        nonlocal changed
        if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
            read = [number(u) for u in v]
            return type(v)(read) if any(a is not b for a, b in zip(read, v)) else v
        if (_is_traced_int_scalar(v) or not masks and isinstance(v, torch.Tensor) and v.ndim == 0
                and v.dtype == torch.uint8 and _is_traced(v)) and (value := _read(torch.Tensor.__index__, v)) is not _UNREADABLE:
            changed = True
            return value
        if isinstance(v, torch.Tensor) and v.ndim == 0 and v.is_floating_point() and _is_traced(v) \
                and (value := _read(torch.Tensor.item, v)) is not _UNREADABLE:
            changed = True
            return value
        return v

    new_args = (*args[:1], *map(number, args[1:]))
    new_kwargs = {k: number(v) for k, v in kwargs.items()}
    return (new_args, new_kwargs) if changed else None


# the parameters of torch's fills, by position or keyword
_FULLS = {torch.full: ("size", "fill_value"), torch.Tensor.new_full: ("self", "size", "fill_value"),
          torch.full_like: ("input", "fill_value")}


def _traced_fill(func, args: tuple, kwargs: dict):
    """`torch.full(size, fill)`, `x.new_full(size, fill)` or `torch.full_like(x, fill)` with a
    traced 0-d `fill`, which torch reads as a number: the tensor expanded (detached: a number
    has no gradient), in the dtype torch gives that number (a flag's bool, an integer's int64, a
    float's default dtype; new_full's and full_like's, their tensor's); None for any other call.
    Its arguments by position or keyword; `layout`, `pin_memory` and `memory_format` where they
    ask for what this gives (strided, unpinned, contiguous, or channels last: copied so)."""
    names, kwargs = _FULLS[func], dict(kwargs)
    if len(args) > len(names) or any(n not in kwargs for n in names[len(args):]):
        return None
    bound = dict(zip(names, args)) | {n: kwargs.pop(n) for n in names[len(args):]}
    like = bound.get("self", bound.get("input"))  # (new_full's own tensor; full_like's)
    laid = kwargs.get("memory_format")
    if laid in (torch.channels_last, torch.channels_last_3d):  # (cloned in that format last)
        kwargs.pop("memory_format")
    if kwargs.get("layout") in (None, torch.strided) and not kwargs.get("pin_memory") and \
            kwargs.get("memory_format") in (None, torch.contiguous_format, torch.preserve_format) and \
            (kwargs.get("memory_format") != torch.preserve_format or like is None or like.is_contiguous()):
        for k in ("layout", "pin_memory", "memory_format"):
            kwargs.pop(k, None)
    fill = bound["fill_value"]
    if kwargs.keys() - {"dtype", "device"} or not (isinstance(fill, torch.Tensor) and fill.ndim == 0 and
                                                    _is_traced(fill)):
        return None
    dtype = kwargs.get("dtype") or (like.dtype if like is not None else torch.bool if fill.dtype == torch.bool else
                                    torch.int64 if not (fill.is_floating_point() or fill.is_complex()) else
                                    torch.get_default_dtype() if fill.is_floating_point() else
                                    torch.promote_types(torch.get_default_dtype(), torch.complex64))
    device = kwargs.get("device") or (like.device if like is not None else None)
    first = bound.get("size")
    size = tuple(like.shape) if func is torch.full_like else tuple(first) if isinstance(first, (list, tuple, torch.Size)) \
        else (first,)
    made = _fits_dtype(fill.detach(), dtype).to(dtype=dtype, device=device).expand(size)
    return made.clone(memory_format=laid) if laid in (torch.channels_last, torch.channels_last_3d) else made.clone()


def _traced_tensor_of(func, args: tuple, kwargs: dict):
    """`torch.tensor(data)` (or `torch.as_tensor`, `x.new_tensor`) of a (nested) list or tuple
    holding traced one-element tensors, which torch reads as numbers (transformers' Qwen2-VL:
    `torch.tensor(mrope_position_deltas)`): the values stacked, detached (a copy has no gradient;
    a new leaf with `requires_grad=True`), in the dtype torch infers (the elements' dtypes
    promoted: a Python int as int64, a float as the default dtype, a NumPy scalar as its own) on
    the default device, or those given (new_tensor's: its tensor's). A float element asked for
    as an integer or bool raises as eager's does. None for any other call (no traced element, a
    ragged or empty list, an element of several values)."""
    names = ("self", "data") if func is torch.Tensor.new_tensor else ("data",)
    kwargs = dict(kwargs)
    if len(args) > len(names) or any(n not in kwargs for n in names[len(args):]):
        return None
    bound = dict(zip(names, args)) | {n: kwargs.pop(n) for n in names[len(args):]}
    data, like = bound["data"], bound.get("self")
    if kwargs.keys() - {"dtype", "device", "pin_memory", "requires_grad"} or kwargs.get("pin_memory") or \
            not isinstance(data, (list, tuple)):
        return None
    leaves: list = []

    def shape(x):
        if isinstance(x, (list, tuple)):
            inner = {shape(v) for v in x}
            return (len(x), *inner.pop()) if len(inner) == 1 else None if inner else ()
        leaves.append(x)
        return ()

    def numpy_scalar(v) -> bool:
        return type(v).__module__ == "numpy" and hasattr(v, "dtype") and getattr(v, "ndim", None) == 0

    if (size := shape(data)) is None or len(size) == 0 or not any(_is_traced(v) for v in leaves) or any(
            isinstance(v, torch.Tensor) and v.numel() != 1 or numpy_scalar(v) and v.dtype.kind not in "iuf"
            or not isinstance(v, (torch.Tensor, bool, int, float, complex)) and not numpy_scalar(v) for v in leaves):
        return None

    def kind(v) -> torch.dtype:
        if isinstance(v, torch.Tensor):
            return v.dtype
        if numpy_scalar(v):
            return torch.as_tensor(v).dtype
        return torch.bool if isinstance(v, bool) else torch.int64 if isinstance(v, int) else \
            torch.get_default_dtype() if isinstance(v, float) else \
            torch.promote_types(torch.get_default_dtype(), torch.complex64)

    dtype = kwargs.get("dtype") or (like.dtype if like is not None else functools.reduce(torch.promote_types,
                                                                                         map(kind, leaves)))
    if not (dtype.is_floating_point or dtype.is_complex) and any(
            isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in leaves):
        raise TypeError("only integer tensors of a single element can be converted to an index")  # (as eager)
    device = kwargs.get("device") or (like.device if like is not None else torch.get_default_device())
    values = [_fits_dtype(v.detach().reshape(()), dtype).to(dtype=dtype, device=device) if isinstance(v, torch.Tensor)
              else torch.tensor(v.item() if numpy_scalar(v) else v, dtype=dtype, device=device) for v in leaves]
    made = torch.stack(values).reshape(size)
    return made.requires_grad_() if kwargs.get("requires_grad") else made


def _fits_dtype(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`v`, checked in the program to fit an integer `dtype` narrower than its own, as torch
    checks a number it converts (`torch.tensor([n], dtype=torch.int8)` of n = 300 raises; an
    unsigned type takes a negative integer down to minus its maximum, wrapped: -32 is 224; a
    float is checked against the type's range, truncated after)."""
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool or v.dtype.is_complex or v.dtype == torch.bool:
        return v
    info = torch.iinfo(dtype)
    if v.dtype.is_floating_point:  # (a float in [min, max]; NaN is none)
        return checked(v, (v >= info.min) & (v <= info.max),
                       f"value cannot be converted to type {str(dtype).removeprefix('torch.')} without overflow")
    have = torch.iinfo(v.dtype)
    low = info.min if info.min < 0 else -info.max
    if have.min >= low and have.max <= info.max:
        return v
    return checked(v, (v >= low) & (v <= info.max),
                   f"value cannot be converted to type {str(dtype).removeprefix('torch.')} without overflow")


_TENSOR_OF = frozenset([torch.tensor, torch.as_tensor, torch.Tensor.new_tensor])
_VALUE_FILLS = {torch.index_fill: 3, torch.Tensor.index_fill: 3, torch.Tensor.index_fill_: 3,  # the value's position
                torch.masked_fill: 2, torch.Tensor.masked_fill: 2, torch.Tensor.masked_fill_: 2}

# where a taker's other arguments are values, not sizes: full's fill, linspace's start and end
_SIZE_POSITIONS = {torch.full: (0,), torch.Tensor.new_full: (0,), torch.linspace: (2,), torch.logspace: (2,),
                   torch.nn.functional.pad: (0,)}
_TENSOR_METHOD_TAKERS = frozenset([torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty,
                                   torch.Tensor.new_full, torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.expand,
                                   torch.Tensor.repeat, torch.Tensor.unflatten, torch.reshape, torch.unflatten,
                                   *_TENSOR_THEN_SIZES])


_READS = frozenset([torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__,
                    torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.__complex__])


def _equal(a, b):
    """torch.equal as the tensor it reads: the same shape and every element equal."""
    return (a == b).all() if a.shape == b.shape else torch.zeros((), dtype=torch.bool, device=a.device)


# comparisons answering a Python bool (`if torch.equal(mask, prev)`, `torch.allclose(y, ones)`):
# the tensor whose truth they read, read as `bool(...)` is (of constants or readable inputs)
_COMPARISONS = {torch.equal: _equal, torch.Tensor.equal: _equal,
                torch.allclose: lambda *a, **k: torch.isclose(*a, **k).all(),
                torch.Tensor.allclose: lambda *a, **k: torch.isclose(*a, **k).all()}


# Ops whose output's shape is its input's values (BART's `torch.unique_consecutive(eos_mask.sum(1))`,
# `(ids == eos).nonzero()`): of a value made from constants or readable inputs, read like `.item()`
# (an `InputRead`, the program right for the calls giving the same result), and made a constant.
_SHAPE_READS = frozenset([torch.unique, torch.Tensor.unique, torch.unique_consecutive, torch.Tensor.unique_consecutive,
                          torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere])


def _contains(value, element) -> bool:
    """`element in value`, run on the real value (its comparison makes tensors of its own)."""
    with proxy_tensor.disable_proxy_modes_tracing(), unset_fake_temporarily():
        return element in value


def _listed(op, value, *args, **kwargs):
    """`op`'s result as Python values (dtype, shape, elements per tensor), compared call to call."""
    with proxy_tensor.disable_proxy_modes_tracing(), unset_fake_temporarily():  # (on the real value)
        out = op(value, *args, **kwargs)
    if isinstance(out, torch.Tensor):
        return ("tensor", str(out.dtype).removeprefix("torch."), tuple(out.shape), out.tolist())
    return tuple(_listed(lambda v: v, t) for t in out)


def _repeat_index(repeats, size: int):
    return torch.repeat_interleave(torch.arange(size, device=repeats.device), repeats)


def _repeated(x, repeats=None, dim=None, *, output_size=None):
    """`torch.repeat_interleave(x, repeats)` with a tensor of repeats made from constants or
    readable inputs: the positions it repeats read like `nonzero` (an `InputRead`), so the
    result's shape is known, and the result taken with index_select; `repeat_interleave(counts)`
    as `repeat_interleave(arange(len(counts)), counts)`, which it is. None for any other form."""
    if isinstance(x, torch.Tensor) and repeats is None and dim is None and x.ndim == 1 \
            and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool:
        x, repeats = torch.arange(x.shape[0], dtype=x.dtype, device=x.device), x
    if not isinstance(x, torch.Tensor) or not isinstance(repeats, torch.Tensor):
        return None
    flat = x.reshape(-1) if dim is None else x
    axis = 0 if dim is None else dim % max(x.ndim, 1)
    where = _read(functools.partial(_listed, _repeat_index), repeats, (flat.shape[axis] if flat.ndim else 1,))
    if where is _UNREADABLE:
        return None
    return flat.index_select(axis, _unlisted(where).to(x.device))


_ISTFT = frozenset([torch.istft, torch.Tensor.istft])


def _istft(input, n_fft, hop_length=None, win_length=None, window=None, center=True, normalized=False,  # noqa: A002
           onesided=None, length=None, return_complex=False):
    """torch.istft as torch's reference computes it (its kernel reads the window's overlap-added
    envelope to check it has no zero, which a trace cannot): the check made here, from the
    envelope's value where it is readable (a window made from constants or the arguments), as
    eager's error; of a window made from parameters, by the program at every call."""
    out = torch._refs.istft(input, n_fft, hop_length, win_length, window, center, normalized, onesided, length,
                            return_complex)
    hop, width = hop_length or n_fft // 4, win_length or n_fft
    w = window if window is not None else torch.ones(width, dtype=out.real.dtype, device=out.device)
    left = (n_fft - width) // 2
    w = torch.nn.functional.pad(w, (left, n_fft - width - left)) if width < n_fft else w
    frames = input.shape[-1]
    total = n_fft + hop * (frames - 1)
    envelope = aten.unfold_backward(w.detach().pow(2).expand(1, frames, n_fft), (1, total), 1, n_fft, hop)
    start = n_fft // 2 if center else 0
    end = start + length if length is not None else total - n_fft // 2 if center else total
    nonzero = envelope[:, start:min(end, total)].abs().min() >= 1e-11
    ok = _read(torch.Tensor.__bool__, nonzero)
    message = (f"istft(n_fft={n_fft}, hop_length={hop}, win_length={width}): window overlap add min: 0 (the "
               "window's squares summed over the frames are zero somewhere)")
    if ok is False:
        raise RuntimeError(message)
    if ok is _UNREADABLE:  # (a learnable window: checked at every call; `out` itself keeps its gradient)
        checks = checked(nonzero, nonzero, message)
        out = torch.where(checks, out, out)
    return out
_INDEX_PUTS = frozenset([torch.index_put, torch.index_put_, torch.Tensor.index_put, torch.Tensor.index_put_])


def _mask_as_positions(index):
    """`x[mask]` (BART's `hidden_states[eos_mask, :]`) with a boolean mask made from constants or
    readable inputs: the same index as the positions of its True values, read like
    `mask.nonzero()` (an `InputRead`), so the result's shape is known. None where no element of
    the index is such a mask."""
    parts = index if isinstance(index, tuple) else (index,)
    out, changed = [], False
    for part in parts:
        if isinstance(part, torch.Tensor) and part.dtype == torch.bool:
            where = _read(functools.partial(_listed, functools.partial(torch.nonzero, as_tuple=True)), part)
            if where is _UNREADABLE:
                return None
            out += list(_unlisted(where))
            changed = True
        else:
            out.append(part)
    return tuple(out) if changed else None


def _bool_lists_as_masks(index):
    """`x[[True, False, ...]]` or `x[:, np_bools]`: each list or NumPy array of booleans as the
    boolean tensor torch makes of it in C++, where the trace cannot see a constant to read its
    positions from; a uint8 mask (torch's old mask dtype, which it still takes) as the boolean
    one it is. None where the index holds none."""
    parts = index if isinstance(index, tuple) else (index,)

    def is_bools(part) -> bool:
        if type(part) is list:
            return bool(part) and all(type(b) is bool for b in part)
        if isinstance(part, torch.Tensor):
            return part.dtype == torch.uint8 and part.ndim > 0
        np = sys.modules.get("numpy")
        return np is not None and isinstance(part, np.ndarray) and part.dtype == np.bool_

    if not any(map(is_bools, parts)):
        return None
    out = tuple((part.bool() if isinstance(part, torch.Tensor) else
                 torch.tensor(part.tolist() if not isinstance(part, list) else part, dtype=torch.bool))
                if is_bools(part) else part for part in parts)
    return out if isinstance(index, tuple) else out[0]


def _is_scalar_mask(part) -> bool:
    return isinstance(part, torch.Tensor) and part.ndim == 0 and part.dtype in (torch.bool, torch.uint8)


def _scalar_masks_unsqueezed(x: torch.Tensor, index):
    """`x[:, b]`, `x[..., b]`, `x[b, b]` with `b` a 0-d mask (bool, or uint8, torch's old mask
    dtype): torch puts a new dim of one there and indexes it by `b` (one row or none), as
    (x unsqueezed there, the index with `b` a 1-d mask of that dim), which the mask reads take
    (`_mask_as_positions`: read as the positions of b's True values). A 0-d mask had been read
    as a 1-d one of the dim it stood at (`x[:, b]` gave column 0). None where there is none."""
    parts = index if isinstance(index, tuple) else (index,)
    if not any(map(_is_scalar_mask, parts)):
        return None

    def width(part) -> int:  # the dims of x, a dim of one put at each 0-d mask, that `part` indexes
        if part is None or part is Ellipsis or isinstance(part, bool):
            return 0
        if isinstance(part, torch.Tensor) and part.dtype in (torch.bool, torch.uint8):
            return max(part.ndim, 1)
        return 1

    spread = x.ndim + sum(map(_is_scalar_mask, parts)) - sum(map(width, parts))  # (the dims `...` stands for)
    if spread < 0:
        return None  # (too many indices: torch's own error)
    out, dim = [], 0
    for part in parts:
        if _is_scalar_mask(part):
            x = x.unsqueeze(dim)
            out.append(part.reshape(1).bool())
        else:
            out.append(part)
        dim += spread if part is Ellipsis else width(part)
    return x, tuple(out)


def _masked_write(x, mask, value) -> bool:
    """`x[mask] = value` (torchmetrics' `out[cond] = 0.0`, `y[y < 0] = 0`) where the value does not
    depend on how many elements the mask selects (a number, one element, or one row of what it
    selects): written as `masked_fill_` / `torch.where`, which need no read of the mask, so one
    program serves every mask. torch counts the selection first (a read of values a trace cannot
    make). False where the write is another kind (left to torch)."""
    if not (isinstance(x, torch.Tensor) and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
        return False  # (torch refuses a uint8 mask here)
    if mask.ndim > x.ndim or tuple(mask.shape) != tuple(x.shape[:mask.ndim]):
        return False  # (torch's own shape error)
    rest = tuple(x.shape[mask.ndim:])  # the shape of each element the mask selects
    if isinstance(value, (bool, int, float)):
        filled = value
    elif isinstance(value, torch.Tensor) and value.ndim <= len(rest) + 1 and \
            (value.ndim <= len(rest) or value.shape[0] == 1):
        try:
            if torch.broadcast_shapes(tuple(value.shape[-len(rest):]) if rest else (), rest) != rest:
                return False
        except RuntimeError:
            return False
        if value.ndim > len(rest):
            value = value.reshape(value.shape[1:])  # (1, *rest): one row, the same for every selected one
        filled = value.to(x.dtype)
    else:
        return False
    where = mask.reshape(tuple(mask.shape) + (1,) * len(rest))
    if isinstance(filled, torch.Tensor) and filled.ndim:
        x.copy_(torch.where(where, filled, x))
    else:
        x.masked_fill_(where, filled)
    return True


def _base_name(func) -> str:
    """An op's name whatever way it is called (`torch.index_add`, `Tensor.index_add_`,
    `torch.ops.aten.index_add.default`): `index_add`."""
    name = getattr(func, "__name__", "")
    return name.split(".")[0].removesuffix("_").removeprefix("_").removesuffix("_impl")


def _bound(args, kwargs, names) -> list:
    """The arguments `names` (a schema's leading ones) from positions or keywords (None if absent)."""
    return [args[i] if i < len(args) else (kwargs or {}).get(n) for i, n in enumerate(names)]


_TARGET_KINDS = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
                 torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.bool: "Bool"}


def _target_fits(func, logits, target) -> None:
    """cross_entropy / nll_loss's target: class indices (int64 or uint8) or, for cross_entropy,
    probabilities of the input's shape, as eager checks (the trace's decomposition reached a
    gather of float indices, and said that instead; an int32 or bool one ran, where eager
    refuses it)."""
    if isinstance(target, torch.Tensor) and isinstance(logits, torch.Tensor) and target.dtype == torch.uint8 \
            and logits.dim() > 2:  # (eager's kernel over extra dims, nll_loss2d's, takes int64 only)
        raise RuntimeError("expected scalar type Long but found Byte")
    if not isinstance(target, torch.Tensor) or not isinstance(logits, torch.Tensor) or \
            target.dtype in (torch.int64, torch.uint8) or \
            func is torch.nn.functional.cross_entropy and target.is_floating_point() and \
            tuple(target.shape) == tuple(logits.shape):
        return
    kind = _TARGET_KINDS.get(target.dtype, str(target.dtype))
    raise RuntimeError(f"expected target dtype to be Long or Byte, but got {kind} (class indices; cross_entropy "
                       "also takes probabilities of the input's shape)")


def _long_target(args, kwargs):
    """cross_entropy / nll_loss's uint8 class indices (which eager takes) as int64: the trace's
    decomposition gathers by them, and gather takes int64 indices only."""
    if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.uint8:
        return (args[0], args[1].long(), *args[2:]), kwargs
    if isinstance(t := (kwargs or {}).get("target"), torch.Tensor) and t.dtype == torch.uint8:
        return args, {**kwargs, "target": t.long()}
    return args, kwargs


def _put_fits(x, indices, values, *_) -> None:
    if isinstance(indices, (list, tuple)):  # (a None: the whole dim)
        _value_fits(x, tuple(slice(None) if i is None else i for i in indices), values)


def _source_fits(x, dim, index, source, *_) -> None:
    """index_add / index_reduce(x, dim, index, source): as eager checks, source is x's shape with
    `dim` the index's length (torch's fake kernels check only that length: with x split on
    another dim, each rank added its block of a source of another shape, silently)."""
    if not all(isinstance(t, torch.Tensor) for t in (x, index, source)) or not isinstance(dim, int) or x.ndim == 0:
        return
    if source.ndim == 0:  # (a 0-d index too: one row, but a source of none of x's dims)
        raise RuntimeError(f"source tensor shape must match self tensor shape, excluding the specified dimension: "
                           f"a 0-d source for self of shape {list(x.shape)}")
    dim %= x.ndim
    want = [*x.shape[:dim], index.numel(), *x.shape[dim + 1:]]
    if list(source.shape) != want:
        raise RuntimeError(f"source of shape {list(source.shape)} does not match self of shape {list(x.shape)} "
                           f"with dim {dim} the index's length {index.numel()}: expected {want}")


def _taken_fits(x, index, source, *_) -> None:
    """put(x, index, source): one source value per index, as eager checks."""
    if all(isinstance(t, torch.Tensor) for t in (x, index, source)) and index.numel() != source.numel():
        raise RuntimeError(f"put: source has {source.numel()} elements and index {index.numel()}: "
                           "expected as many")


_INDEX_WRITES = {"index_put": _put_fits, "index_add": _source_fits, "index_reduce": _source_fits, "put": _taken_fits}
_WRITE_ARGS = {"index_put": ("self", "indices", "values"), "index_add": ("self", "dim", "index", "source"),
               "index_reduce": ("self", "dim", "index", "source"), "put": ("self", "index", "source")}


def _value_fits(x, index, value) -> None:
    """`x[index] = value` with integer index tensors raises as eager does where the value does not
    broadcast to what the index selects (torch's fake kernel of index_put does not check: each
    rank's write broadcast the value over its own block, silently)."""
    parts = index if isinstance(index, tuple) else (index,)
    if not isinstance(x, torch.Tensor) or not isinstance(value, torch.Tensor) or \
            not any(isinstance(p, torch.Tensor) for p in parts) or \
            any(isinstance(p, torch.Tensor) and (p.dtype in (torch.bool, torch.uint8) or p.is_floating_point()) for p in parts):
        return  # (masks and other indices: torch's own checks)
    with proxy_tensor.disable_proxy_modes_tracing(), unset_fake_temporarily():
        try:  # (integer indices select a shape their values do not change)
            picked = tuple(torch.empty(tuple(x.shape), device="meta")[tuple(
                torch.zeros(tuple(p.shape), dtype=torch.long, device="meta") if isinstance(p, torch.Tensor) else p
                for p in parts)].shape)
        except (IndexError, RuntimeError, TypeError):
            return  # (torch says what is wrong with the index itself)
    shape = list(value.shape)
    while shape and shape[0] == 1:  # (torch drops a value's leading size-1 dims)
        shape.pop(0)
    if len(shape) > len(picked) or any(v not in (1, n) for v, n in zip(reversed(shape), reversed(picked))):
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(value.shape)} cannot be broadcast to "
                           f"indexing result of shape {list(picked)}")


def _is_traced(t) -> bool:
    """A tensor of the trace: a fake tensor, or one torch.func.grad or jvp wraps (never a vmapped
    one, whose values differ per batch element: eager refuses to read them)."""
    if not isinstance(t, torch.Tensor):
        return False
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        if torch._C._functorch.is_batchedtensor(t):
            return False
        t = torch._C._functorch.get_unwrapped(t)
    return isinstance(t, FakeTensor)


def _is_traced_int_scalar(part) -> bool:
    """A 0-d integer tensor of the trace (under torch.func.grad, wrapped; never a vmapped one,
    whose index differs per batch element: eager refuses its read)."""
    if not isinstance(part, torch.Tensor) or part.ndim != 0 or part.is_floating_point() or part.is_complex() \
            or part.dtype in (torch.bool, torch.uint8):  # (torch takes a uint8 index as a mask)
        return False
    return _is_traced(part)


def _scalar_tensors_as_lists(index):
    """`table[t]` with `t` a traced 0-d integer tensor (`alphas_cumprod[t]` for `t` in a
    scheduler's timesteps; `cache[:, pos] = k`): torch takes it as the integer it holds, read in
    C++ (no trace can). The same index with each such `t` as a one-element index tensor (None
    where the index holds none): an index op, whose result differs only by a size-1 dim."""
    parts = index if isinstance(index, tuple) else (index,)
    if not any(_is_traced_int_scalar(p) for p in parts):
        return None
    if not all(_is_traced_int_scalar(p) or p is None or p is Ellipsis or isinstance(p, (int, slice)) for p in parts):
        return None  # (with other tensors or lists in the index, torch's own rules apply)
    out = tuple(p.reshape(1).long() if _is_traced_int_scalar(p) else p for p in parts)  # (an int8 index: as eager)
    return out if isinstance(index, tuple) else out[0]


def _scalar_tensors_beside_indices(index, ndim: int):
    """`h[i, :, j] = v` with `j` a traced 0-d integer tensor beside an index of one or more dims
    (`i`, a tensor or a list): torch selects by `j` first, as by an integer, read in C++ where
    the index is written (no trace can). Given as a one-element index among the others, it
    broadcasts with them alike, where their dims go to the same place of the result either way
    (`h[i, :, j]`, `h[j, i]`); `x[j, :, i]`, whose `i` keeps its place after a select and goes
    first beside an index `j` (its result transposed, silently), is left to the other rules.
    None where there is no such index."""
    parts = index if isinstance(index, tuple) else (index,)
    if not any(map(_is_traced_int_scalar, parts)) or not any(map(_is_advanced_index, parts)):
        return None
    listed = tuple(p.reshape(1).long() if _is_traced_int_scalar(p) else p for p in parts)
    if _advanced_dims_at(listed, ndim) != _advanced_dims_at(tuple(p for p in parts if not _is_traced_int_scalar(p))
                                                             + (0,) * sum(map(_is_traced_int_scalar, parts)), ndim):
        return None
    return listed


def _selected_by_scalar_tensors(x: torch.Tensor, index):
    """`x[j, :, i]` with `j` a traced 0-d integer tensor beside an index of one or more dims, as
    torch reads it: `x` selected by `j` first (a one-element `index_select`, then the integer 0
    in `j`'s place, which torch selects by); (x, index) again, or None where there is none."""
    parts = index if isinstance(index, tuple) else (index,)
    if not any(map(_is_traced_int_scalar, parts)) or not any(map(_is_advanced_index, parts)):
        return None
    parts = list(parts)
    for k, p in enumerate(parts):
        if _is_traced_int_scalar(p):
            dim = _dim_of(parts, k, x.ndim)
            x, parts[k] = x.index_select(dim, _as_position(p, x.shape[dim])), 0
    return x, tuple(parts)


def _written_by_scalar_tensor(x: torch.Tensor, index, value) -> bool:
    """`x[j, :, i] = v` as torch writes it, `j` one traced 0-d integer tensor beside an index of
    one or more dims (`_selected_by_scalar_tensors`): the one-element block `j` selects, written
    by the index with the integer 0 in `j`'s place, and put back by `index_copy_`. Whether it was."""
    parts = index if isinstance(index, tuple) else (index,)
    if sum(map(_is_traced_int_scalar, parts)) != 1 or not any(map(_is_advanced_index, parts)):
        return False
    k = next(k for k, p in enumerate(parts) if _is_traced_int_scalar(p))
    dim = _dim_of(list(parts), k, x.ndim)
    at = _as_position(parts[k], x.shape[dim])
    block = x.index_select(dim, at)
    block[(*parts[:k], 0, *parts[k + 1:])] = value
    x.index_copy_(dim, at, block)
    return True


def _as_position(index: torch.Tensor, size: int) -> torch.Tensor:
    """A 0-d integer index of a dim of `size` as a one-element index of its position (a negative
    one counted from the end, as torch's select counts it)."""
    return torch.where(index < 0, index + size, index).reshape(1).long()


def _dim_of(parts: list, k: int, ndim: int) -> int:
    """The dim of `x` that `parts[k]` of `x[parts]` indexes."""
    if any(p is Ellipsis for p in parts[:k]):  # (counted from the end)
        return ndim - sum(map(_dims_taken, parts[k:]))
    return sum(map(_dims_taken, parts[:k]))


def _dims_taken(part) -> int:
    """How many dims of `x` a part of an index of `x` indexes (a mask: its own)."""
    if part is None or isinstance(part, bool):
        return 0
    if isinstance(part, torch.Tensor) and part.dtype in (torch.bool, torch.uint8) or \
            type(part).__module__ == "numpy" and getattr(part, "dtype", None) == bool:
        return part.ndim
    return 1


def _is_advanced_index(part) -> bool:
    """An index of one or more dims: a tensor, a list, a NumPy array (not a 0-d one: torch takes
    that as the integer or mask it holds)."""
    return isinstance(part, torch.Tensor) and part.ndim >= 1 or isinstance(part, list) \
        or type(part).__module__ == "numpy" and getattr(part, "ndim", 0) >= 1


def _advanced_dims_at(parts: tuple, ndim: int) -> int:
    """Where torch puts the dims of the advanced indices of `x[parts]`, `x` of `ndim` dims: at
    the first one's place where they stand together (integers, selected first, stand nowhere),
    else first."""
    kept = [p for p in parts if _is_advanced_index(p) or p is None or p is Ellipsis or isinstance(p, (slice, bool))]
    at = [k for k, p in enumerate(kept) if _is_advanced_index(p)]
    if not at or at != list(range(at[0], at[0] + len(at))):
        return 0
    rest = ndim - sum(_dims_taken(p) for p in parts if p is not Ellipsis)
    return sum(rest if p is Ellipsis else 1 for p in kept[:at[0]])


def _index_by_scalar_tensors(func, x, index, as_lists, *value):
    """`x[index]` (or `x[index] = value`) where `index` holds traced 0-d integer tensors, as the
    indexing by their one-element lists (`_scalar_tensors_as_lists`) reshaped to what integer
    indices give (a select: the size-1 dim dropped)."""
    parts = index if isinstance(index, tuple) else (index,)

    def shape_with(stand_in):  # the result's shape with each 0-d index read as `stand_in`
        out = tuple(stand_in if _is_traced_int_scalar(p) else p for p in parts)
        return tuple(meta[out if isinstance(index, tuple) else out[0]].shape)

    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        meta = torch.empty(tuple(x.shape), device="meta")
        selected = shape_with(0)
        listed = shape_with(torch.zeros(1, dtype=torch.long, device="meta"))
    if func is torch.Tensor.__getitem__:
        return _taken(x[as_lists].reshape(selected), "a view indexed by a 0-d integer tensor (`y[j]`, j a tensor)",
                      back=functools.partial(_put_back, x, as_lists))
    v, = value
    if isinstance(v, torch.Tensor):
        v = torch.broadcast_to(v, selected).reshape(listed)
    x[as_lists] = v
    return None


def _put_back(x: torch.Tensor, index, copy: torch.Tensor) -> None:
    """The values of `copy`, read from `x[index]`, put there again (a write into it, as eager's
    into the view it stands for), and on to the tensor `x` was read from where it is such a copy too
    (`y[i][j] = v`)."""
    x[index] = copy
    if _TAKEN and (taken := _taken_entry(x)) is not None and taken[2] is not None:
        taken[2](taken[0])


def _unlisted(listed):
    """The tensors `_listed` described, made in the trace (constants of the program)."""
    if listed and listed[0] == "tensor":
        _, dtype, shape, values = listed
        return torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)
    return tuple(_unlisted(x) for x in listed)


_READABLE: list = [None]  # the real inputs a trace may read values of (`readable_inputs`), and its reads
ON_META = object()  # an argument given as a meta tensor: its values cannot be read


def tracing() -> bool:
    """Whether hpfun is tracing a function now (a sharded function called inside another is
    traced as its code, part of the outer program)."""
    return _READABLE[0] is not None


@contextlib.contextmanager
def readable_inputs(values: list):
    """While tracing, `values[i]` (a real tensor, or None) is the real value of the trace's i-th
    input: a value read into Python from those inputs only (`labels.max() >= vocab_size`, a
    check transformers models make) is computed from them, as eager would, and recorded as an
    `InputRead` the program holds for (`reads`). `ON_META` marks an argument given as a meta
    tensor (planning only), which a read then names in its error."""
    was = _READABLE[0]
    _READABLE[0] = (values, [], [])
    try:
        yield _READABLE[0][1]
    finally:
        _READABLE[0] = was


@attrs.frozen(eq=False)
class InputRead:
    """A Python value the trace read from its inputs' values: the ops that made it from the
    inputs (`steps`, each (op, args, kwargs) with `_Made(k)` for the k-th step's result and
    `_Input(i)` for the i-th input), how it was read, what it was, and the user's line. A program
    traced with it is right for another call only where the same read gives the same value."""

    steps: tuple
    read: object
    read_args: tuple
    value: object
    where: str
    # whether a step writes in place (`x.add_(1)` before `if x.sum() > 0`): then it runs on copies
    # of the inputs, never on the caller's tensors
    copies: bool = attrs.field(init=False)

    def __attrs_post_init__(self):
        object.__setattr__(self, "copies", any(writes(op) for op, *_ in self.steps))

    def holds(self, inputs: list) -> bool:
        """Whether the read gives its value on these inputs; not where its steps fail on them
        (a size an earlier read set, `torch.full((n,), ...)`, indexed at positions a later one
        reads: the traced steps of another call fail where the function's own code would take
        another path; a program is traced for them). Every input is read before any step runs:
        on a distributed mesh a read of a split one is a collective, made by every rank alike."""
        try:
            return same_value(self.evaluate(inputs), self.value)
        except (IndexError, RuntimeError, ValueError):
            return False

    def evaluate(self, inputs: list):
        made: list = []
        given: dict = {}  # (one copy of each input: a write through a view of it is seen by a later read of it)
        cpu = torch.device("cpu")

        def arg(a):
            if isinstance(a, _Made):
                return made[a.k]
            if isinstance(a, _Input):
                if a.i not in given:
                    value = _whole(inputs[a.i]).detach().to(cpu)
                    given[a.i] = value.clone() if self.copies else value
                return given[a.i]
            if isinstance(a, torch.Tensor) and self.copies:  # a constant of the trace, written by a step
                return a.clone()
            return cpu if isinstance(a, torch.device) else a

        for leaf in pytree.tree_leaves([(args, kwargs) for _, args, kwargs in self.steps]):
            if isinstance(leaf, _Input):
                arg(leaf)  # (each input read first: see `holds`)
        with torch.no_grad():
            for op, args, kwargs in self.steps:
                args, kwargs = pytree.tree_map(arg, (args, kwargs))
                made.append(op(*args, **kwargs))
        return self.read(made[-1], *self.read_args)


@functools.cache
def writes(op) -> bool:
    """Whether an ATen op writes into one of its arguments (`add_`, `copy_`, `index_put_`)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _whole(x) -> torch.Tensor:
    """A value read: a tensor, or a Sharded one's full value (on a distributed mesh a collective,
    which every rank makes alike: they trace, and check reads, in the same order)."""
    return x if isinstance(x, torch.Tensor) else x.full()


@attrs.frozen
class _Made:
    k: int


@attrs.frozen
class _Input:
    i: int


def exact_key(v, depth: int = 6):
    """A Python value as a cache key equal only to the same value of the same type: 1, 1.0 and
    True are three (an integer tensor times each is int64, float32 and int64), 0.0 and -0.0 two
    (`1 / (x * -0.0)`), and NaN equals NaN; a Fraction by its numerator and denominator, a
    Decimal by its sign, digits and exponent; lists, tuples, sets and dicts item by item."""
    kind = type(v)
    if kind is float:  # (the common cases first: the checks against numbers' abstract classes are slow)
        return kind, "nan" if v != v else v, math.copysign(1.0, v) if v == 0 else 0
    if kind is int or kind is bool or kind is str or v is None:
        return kind, v
    if isinstance(v, numbers.Rational) and not isinstance(v, numbers.Integral):  # (a Fraction: exact, where its
        return kind, v.numerator, v.denominator  # float is the same for two that differ beyond 2**-53)
    if isinstance(v, decimal.Decimal):  # its sign, digits and exponent: Decimal("-0") and Decimal("0.50") are
        return kind, v.as_tuple()  # their own values (float() gives -0.0, str() "0.50"), equal as numbers
    if isinstance(v, float) or isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral):
        # (NumPy's float64 and float32 and the user's subclasses too, by their own type)
        return kind, "nan" if v != v else float(v), math.copysign(1.0, float(v)) if v == 0 else 0
    if isinstance(v, complex):
        return kind, exact_key(v.real), exact_key(v.imag)
    if depth and (kind is tuple or kind is list):
        return kind, tuple(exact_key(x, depth - 1) for x in v)
    if depth and (kind is frozenset or kind is set):
        return kind, frozenset(exact_key(x, depth - 1) for x in v)
    if depth and kind is dict:
        return kind, tuple((exact_key(k, depth - 1), exact_key(x, depth - 1)) for k, x in v.items())
    return kind, v


def same_value(a, b) -> bool:
    """Whether two values read into Python are the same: by `exact_key` (a -0.0 read where the
    trace read 0.0 is another value: `1 / (x * t.item())`), NaN read twice the same."""
    return exact_key(a) == exact_key(b)


def _as_made(t):
    """`t`, or where it may have been written in place since made (`m |= ~m.any()`; made under
    torch.inference_mode, which keeps no count of writes) its copy, which the writes recorded
    before it make (made outside inference mode: its count starts at 0)."""
    if isinstance(t, torch.Tensor) and (t.is_inference() or t._version):
        with torch.inference_mode(False):
            return t.clone()
    return t


def _made_from_inputs(t, draws: bool = False) -> bool:
    """Whether a traced tensor is computed from the program's inputs (arguments or lifted state),
    not from constants only (`draws`: or from a random draw)."""
    mode = proxy_tensor.get_proxy_mode()
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    slot = proxy_tensor.get_proxy_slot(t, mode.tracer, None) if mode is not None else None
    if slot is None:
        return False
    todo, seen = [slot.proxy.node], set()
    while todo:
        node = todo.pop()
        if node.op == "placeholder" or draws and isinstance(node.target, torch._ops.OpOverload) \
                and torch.Tag.nondeterministic_seeded in node.target.tags:
            return True
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return False


def _constant_value(t):
    """The real value of a traced tensor computed from constants only (no input, no random op:
    `nn.Transformer.generate_square_subsequent_mask(n)`, which torch's transformer layers compare
    with a causal mask), by running the ops that made it; or from constants and inputs whose
    real values the trace was given (`readable_inputs`): then (value, steps), for an
    `InputRead`. None for any other tensor."""
    mode = proxy_tensor.get_proxy_mode()
    if mode is None or not isinstance(t, torch.Tensor) or t.is_inference() or t._version:  # written in place since
        return None  # made (an inference tensor keeps no count: `_as_made`)
    while torch._C._functorch.is_functorch_wrapped_tensor(t):  # under torch.func.grad: the traced value inside
        if torch._C._functorch.is_batchedtensor(t):
            return None  # (vmapped: a value per batch element, which eager refuses to read too)
        t = torch._C._functorch.get_unwrapped(t)
    slot = proxy_tensor.get_proxy_slot(t, mode.tracer, None)
    if slot is None:
        return None
    readable = _READABLE[0][0] if _READABLE[0] is not None else None
    made, stack, seen, inputs = [], [slot.proxy.node], set(), {}
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        writers = _writes_into(node)  # (GradScaler's found_inf: made by torch.full, set by a kernel reading
        if writers is None:  # the gradients, so not a constant)
            return None
        stack += writers  # run too, in the order recorded: their inputs must be constants or inputs as well
        if node.op == "get_attr":
            made.append(node)
            continue
        if node.op == "placeholder" and readable is not None:
            if not inputs:
                inputs.update((n, i) for i, n in enumerate(n for n in mode.tracer.graph.nodes if n.op == "placeholder"))
            i = inputs.get(node)
            if i is None or i >= len(readable) or readable[i] is None or readable[i] is ON_META:
                if i is not None and i < len(readable) and readable[i] is ON_META:
                    _READABLE[0][2].append(i)
                return None  # lifted state, or an input planned on shapes only
            made.append(node)
            continue
        target = node.target
        if node.op == "call_function" and target is operator.getitem:  # (an output of a multi-output op)
            made.append(node)
            stack += node.all_input_nodes
            continue
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
                or torch.Tag.nondeterministic_seeded in target.tags:
            return None  # an input, a random draw: not a constant
        made.append(node)
        if _fill_of(node) is not None:  # (`zeros_like(x @ w)`: its values are a number's, whatever x @ w holds)
            continue
        stack += node.all_input_nodes
        if len(seen) > 256:  # constants are small graphs; a long walk is a value made from the inputs
            return None
    order = {n: i for i, n in enumerate(mode.tracer.graph.nodes)}
    real: dict = {}
    steps: list = []
    ref: dict = {}
    cpu = torch.device("cpu")

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return real[a]
        return cpu if isinstance(a, torch.device) else a

    def step_arg(a):
        return ref[a] if isinstance(a, torch.fx.Node) else a

    copies = any(node.op == "call_function" and writes(node.target) for node in made)  # (on copies, then)
    with proxy_tensor.disable_proxy_modes_tracing(), unset_fake_temporarily():
        for node in sorted(made, key=order.__getitem__):
            if node.op == "get_attr":
                real[node] = getattr(mode.tracer.root, node.target).to(cpu)
                real[node] = real[node].clone() if copies else real[node]
                ref[node] = real[node]
                continue
            if node.op == "placeholder":
                real[node] = _whole(readable[inputs[node]]).detach().to(cpu)
                real[node] = real[node].clone() if copies else real[node]
                ref[node] = _Input(inputs[node])
                continue
            if (fill := _fill_of(node)) is not None:  # made from its input's shape only: made so
                val = node.meta["val"]
                made_args = (tuple(val.shape), tuple(val.stride()), val.dtype, fill)
                real[node] = _filled(*made_args)
                steps.append((_filled, made_args, {}))
                ref[node] = _Made(len(steps) - 1)
                continue
            args, kwargs = pytree.tree_map(arg, (node.args, node.kwargs))
            real[node] = node.target(*args, **kwargs)
            steps.append((node.target, *pytree.tree_map(step_arg, (node.args, node.kwargs))))
            ref[node] = _Made(len(steps) - 1)
    value = real[slot.proxy.node]
    if not any(n.op == "placeholder" for n in made):
        return value
    if slot.proxy.node.op == "placeholder":  # the input itself, read whole
        steps.append((torch.clone, (ref[slot.proxy.node],), {}))
    return value, tuple(steps)


_UNREADABLE = object()  # `_read` of a value made from neither constants nor readable inputs

# ops whose values are a number's, their tensor argument giving only a shape, dtype and device:
# ("at", the position of the number) or ("is", the number)
_FILLS = {aten.full_like.default: ("at", 1), aten.new_full.default: ("at", 2), aten.zeros_like.default: ("is", 0),
          aten.ones_like.default: ("is", 1), aten.new_zeros.default: ("is", 0), aten.new_ones.default: ("is", 1)}


def _fill_of(node: torch.fx.Node):
    """The number a `_FILLS` node fills with (a Python number, not a traced value), else None."""
    if node.target not in _FILLS or not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    how, n = _FILLS[node.target]
    fill = n if how == "is" else node.args[n] if len(node.args) > n else node.kwargs.get("fill_value")
    return fill if isinstance(fill, (bool, int, float, complex)) else None


def _filled(shape, stride, dtype, fill) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype).fill_(fill)


def _read(func, t, args=(), kwargs=None):
    """`func(value of t, *args)` (a read into Python: `.item()`, `bool`, `int`) of a traced tensor
    made from constants, or from inputs whose real values the trace was given: then recorded as
    an `InputRead`, for every call to check. `_UNREADABLE` for any other tensor."""
    kwargs = kwargs or {}
    value = _constant_value(_as_made(t))
    if value is None:
        return _UNREADABLE
    if not isinstance(value, tuple):
        return func(value, *args, **kwargs)
    value, steps = value
    result = func(value, *args, **kwargs)
    _READABLE[0][1].append(InputRead(steps, functools.partial(_read_with, func, kwargs), tuple(args), result,
                                     _at_user_line()))
    return result


def _read_with(func, kwargs, value, *args):
    return func(value, *args, **kwargs)


def _writes_into(node: torch.fx.Node) -> list | None:
    """The ops the trace recorded so far that write into `node`'s value or into a view of it
    (`shifted[:, 1:] = ids[:, :-1]`), with the views they write through; None where an op that
    is not ATen's reads it (what it does to its arguments is unknown)."""
    stack, seen, writers = [node], set(), []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            target = user.target
            if target is operator.getitem:  # one output of a multi-output op (`x.max(0).values`): none written,
                if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.returns \
                        and n.target._schema.returns[0].alias_info is not None:  # but one of a list of views
                    stack.append(user)  # (`x.split(2)[0].add_(1)`) is a view: its writes are ours
                continue
            if user.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
                return None
            schema = target._schema
            if writes(target) and _writes_node(user, schema, n):
                writers.append(user)
            if schema.returns and schema.returns[0].alias_info is not None:  # a view: its writes are ours
                stack.append(user)
    return writers


def _writes_node(user: torch.fx.Node, schema, n: torch.fx.Node) -> bool:
    """Whether the writing op `user` is given `n` where it writes (`index_put_`'s self), not only
    where it reads (its indices: `k[:, pos[:n]] = v` writes k, and pos stays readable)."""
    given = dict(zip((a.name for a in schema.arguments), user.args)) | dict(user.kwargs)
    return any(a.alias_info is not None and a.alias_info.is_write and n in pytree.tree_leaves(given.get(a.name))
               for a in schema.arguments)


class TracingWarning(UserWarning):
    """Something the function does runs once, while hpfun traces it, and not at every call: a
    tensor printed shows a stand-in (its shape and dtype) once."""


_PRINTS = frozenset([torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__])


def _warn_printed(tensor) -> None:
    """A traced tensor printed by the user's own code (not a library's): said at the trace, at its line."""
    here = os.path.abspath(__file__)
    f = next((f for f in reversed(traceback.extract_stack())  # the caller of the print: past torch and this mode
              if not f.filename.startswith(TORCH_DIR) and os.path.abspath(f.filename) != here), None)
    if f is None or not _is_user_frame(f.filename) or f.filename.startswith("<") or SITE_PACKAGES in f.filename:
        return  # (hpfun's own message, a library's, or generated code)
    warnings.warn_explicit(
        f"`{f.line}` prints a tensor while hpfun traces the function, which shows a stand-in "
        f"({tuple(tensor.shape)}, {tensor.dtype}) once, not its values at every call: return the tensor and print it "
        "after the call (`print(step(x, y).full())`)", TracingWarning, f.filename, f.lineno)


def _deepcopy_traced(x, memo=None):
    """`copy.deepcopy` of a tensor while tracing (torch-optimizer's AccSGD makes its state with
    `copy.deepcopy(p.data)`): a copy of its values, with its flag, gradient and attributes, as
    eager's; torch's own copies the storage, which a stand-in has none of (it failed as
    'Mixing fake modes NYI')."""
    memo = {} if memo is None else memo
    if id(x) in memo:
        return memo[id(x)]
    if not x.is_leaf:
        raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol "
                           "at the moment")
    with torch.no_grad():
        out = x.clone()
    out.requires_grad_(x.requires_grad)
    memo[id(x)] = out
    if x.grad is not None:
        out.grad = _deepcopy_traced(x.grad, memo)
    own = vars(out)  # (a stand-in's own bookkeeping, its fake mode, is the copy's already)
    for key, value in vars(x).items():
        if key not in own:  # the user's (`p.no_decay = True`)
            setattr(out, key, copy.deepcopy(value, memo))
    return out


_METHOD_WRAPPER = type(torch.Tensor.shape.__get__)  # (a tensor attribute's getter: `x.shape`, `x.dtype`)
# what a tensor's methods answer about its layout, never its values
_METADATA_QUERIES = frozenset([
    torch._C.TensorBase.stride, torch._C.TensorBase.storage_offset, torch._C.TensorBase._is_view,
    torch._C.TensorBase.numel, torch._C.TensorBase.nelement, torch._C.TensorBase.dim, torch._C.TensorBase.ndimension,
    torch._C.TensorBase.size, torch._C.TensorBase.is_inference, torch._C.TensorBase.is_conj,
    torch._C.TensorBase.is_neg, torch._C.TensorBase.untyped_storage, torch._C.TensorBase.element_size,
    torch._C.TensorBase.is_contiguous, torch._C.TensorBase.is_floating_point, torch._C.TensorBase.is_complex,
    torch._C.TensorBase.get_device])


_INDEX_FILLS = (torch.index_fill, torch.Tensor.index_fill, torch.Tensor.index_fill_)
# where a uint8 tensor is a mask, not an int (`x[:, t]`): never read as one
_MASK_INDEXING = frozenset([torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch._C.TensorBase.__getitem__,
                       torch._C.TensorBase.__setitem__, torch.Tensor.index_put, torch.Tensor.index_put_,
                       torch.index_put, torch.Tensor.masked_fill, torch.masked_fill])


def _index_fill_differentiable(func, x, dim, index, value):
    """`x.index_fill(dim, index, value)` with a value that takes a gradient, as `torch.where`
    over the positions `index` names: the same values, and gradients, without torch's backward
    for the value, which takes `_unique` of the index (a shape read from the data)."""
    dim = dim % max(x.ndim, 1)
    n = x.shape[dim] if x.ndim else 1
    picked = torch.zeros(n, dtype=torch.bool, device=x.device).index_fill(0, index.reshape(-1), True)
    shape = [1] * x.ndim
    if x.ndim:
        shape[dim] = n
    out = torch.where(picked.view(shape), value.to(x.dtype), x)
    return x.copy_(out) if func is torch.Tensor.index_fill_ else out


def _combinations(x, r=2, with_replacement=False):
    """torch.combinations: `x`'s elements at every r-combination of its positions, which its
    length alone decides (torch's kernel masks a grid of them: a shape read from the data)."""
    if r <= 0:  # (torch's own answer, or its error)
        return torch.combinations(x, r, with_replacement)
    pick = itertools.combinations_with_replacement if with_replacement else itertools.combinations
    index = [i for c in pick(range(x.shape[0]), r) for i in c]
    return x.index_select(0, torch.tensor(index, dtype=torch.long, device=x.device)).view(len(index) // r, r)


# the parameters a keyword call gives by position before the mode's checks read them: the tensors an
# op is about (those torch's signatures put first, in the same order in every overload)
_BY_POSITION = frozenset({"input", "other", "index", "source", "src", "mask", "condition", "tensor1", "tensor2"})
_SIGNATURES: dict | None = None  # torch's table of overridable functions' signatures, made once


@functools.lru_cache(maxsize=4096)
def _positional_names(func) -> tuple:
    """(name, movable) of each of `func`'s leading parameters that may be given by position
    (torch's signature table, `torch.overrides.get_testing_overrides`): movable, those among
    `_BY_POSITION` (and an index op's `dim`); () where none is movable."""
    global _SIGNATURES
    if _SIGNATURES is None:
        _SIGNATURES = torch.overrides.get_testing_overrides()
    dummy = _SIGNATURES.get(func)
    if dummy is None or func in (torch.polygamma, torch.special.polygamma):  # (listed as (input, n): it is (n, input))
        return ()
    try:
        params = list(inspect.signature(dummy).parameters.values())
    except (TypeError, ValueError):
        return ()
    names = []
    movable = _BY_POSITION | ({"dim"} if func in _NON_NEGATIVE_INDEX or func in _INDEX_FILLS or func in _VALUE_FILLS
                              else set())  # (the index ops' checks read the dim too: `index_add(dim=1, ...)`)
    for p in params:
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            break
        names.append((p.name, p.name in movable))
    return tuple(names) if any(m for _, m in names) else ()


def _by_position(names: tuple, args: tuple, kwargs: dict) -> tuple:
    """`args` and `kwargs` with the keywords that follow `args` in `names` ((name, movable) pairs)
    moved into it, up to the first absent or not movable (`torch.istft(input=x, n_fft=64)`: x by
    position)."""
    args = tuple(args)
    for name, movable in names[len(args):]:
        if not movable or name not in kwargs:
            break
        args += (kwargs.pop(name),)
    return args, kwargs


_SELECT_SCATTERS = frozenset([torch.select_scatter, torch.Tensor.select_scatter])


class _TensorScalars(TorchFunctionMode):
    """A tensor given where an op takes a Python number (`p.addcdiv_(m, v, value=-step_size)`
    with a traced step size, `p.add_(g, alpha=-lr)` with a tensor learning rate) would be read
    with `.item()`, which a trace cannot do: the op is written as the tensor arithmetic it
    performs, `p + (m / v) * step_size`, which the trace records. F.one_hot likewise (`_one_hot`)."""

    _into_copy = False  # while a write into a copy taken by index runs (then it is put back)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if type(func) is _METHOD_WRAPPER and func.__name__ == "__get__" or func in _METADATA_QUERIES:
            return func(*args, **(kwargs or {}))  # (no check below is about them: most calls the mode sees, from
        kwargs = dict(kwargs or {})  # torch's own tracing machinery, answered without walking the checks)
        if kwargs and (names := _positional_names(func)):  # (`x.index_add(1, index=i, source=s)`: as the
            args, kwargs = _by_position(names, args, kwargs)  # positional form, which the checks below read)
        if func is torch.Tensor.__deepcopy__ and args and isinstance(args[0], FakeTensor):
            return _deepcopy_traced(*args, **kwargs)
        if func in _SELECT_SCATTERS and isinstance(picked := _bound(args, kwargs, ("input", "src", "dim", "index")),
                                                   list) and isinstance(picked[0], torch.Tensor) \
                and isinstance(picked[2], int) and isinstance(picked[3], int):  # (its decomposition writes nowhere
            torch.Tensor.select(picked[0], picked[2], picked[3])  # for an index out of range: eager's check, its error)
        if func is torch.combinations and args and isinstance(args[0], torch.Tensor) and args[0].ndim == 1:
            return _combinations(*args, **kwargs)
        if func in _ISTFT and args and _is_traced(args[0]):  # (torch's kernel checks the window's
            return _istft(*args, **kwargs)  # envelope by reading it, which its reference divides by)
        _refuse_overlapping_write(func, args)
        if _TAKEN and args and isinstance(args[0], torch.Tensor) and _is_write(func) and not self._into_copy \
                and (taken := _taken_entry(args[0])) is not None:
            self._into_copy = True  # (`y[j].mul_(2)`, `y[j] += 1`, j a 0-d tensor: into the copy, as any write, `y[j][i] = v`
            try:  # too, then put back where it was read from, as eager's view writes into y)
                out = self.__torch_function__(func, types, args, kwargs)
            finally:
                self._into_copy = False
            taken[2](taken[0])
            return out
        if isinstance(kwargs.get("generator"), torch.Generator):
            _refuse_generator(func)
        if getattr(func, "__module__", "").startswith("torch.distributed") and getattr(func, "__name__", "") in _COLLECTIVES:
            # a collective a library holds its own reference to (vector-quantize-pytorch's `self.all_reduce_fn =
            # distributed.all_reduce`), which the patch of torch.distributed's names cannot see: refused alike
            return _guard_collective(func.__name__, func, threading.get_ident(), caller_depth=2)(*args, **kwargs)
        if func is torch.Tensor.__format__ and args[1:] == ("",) and isinstance(args[0], torch.Tensor) \
                and torch._C._functorch.is_functorch_wrapped_tensor(args[0]) and _is_traced(args[0]):
            inner = args[0]  # (`f"{n}"` under torch.func.grad: as outside it, the traced tensor printed, not read)
            while torch._C._functorch.is_functorch_wrapped_tensor(inner):
                inner = torch._C._functorch.get_unwrapped(inner)
            _warn_printed(inner)
            return func(inner, "")
        if func in _PRINTS and isinstance(args[0], FakeTensor) and not (func is torch.Tensor.__format__ and args[1:2] != ("",)):
            _warn_printed(args[0])  # (a format spec reads the value: `f"{loss:.3f}"` is a read, refused as such)
        if func in _COMPARISONS and len(args) >= 2 and all(isinstance(a, torch.Tensor) for a in args[:2]) \
                and any(map(_is_traced, args[:2])):
            result = _read(torch.Tensor.__bool__, _COMPARISONS[func](*args, **kwargs))
            if result is not _UNREADABLE:
                return result
        if func in _SOFTMAXES and args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.bool \
                and kwargs.get("dtype") is None and not any(isinstance(a, torch.dtype) for a in args[1:]):
            name = getattr(func, "__name__", "softmax")  # (a bool one fails in torch's decomposition, unclearly)
            raise CaptureError(Problem(f"{name}{_at_user_line()}", f"{name} of a bool tensor, which torch's kernels "
                                       "refuse (they take floating point)",
                                       f"cast it first (x.float()), or pass dtype=torch.float32 to {name}"))
        if func in _NON_NEGATIVE_INDEX and len(args) >= 3 and isinstance(args[2], torch.Tensor) and _is_traced(args[2]) \
                and not args[2].is_floating_point() and not _called_by_torch():  # (torch's own index_fill
            # decomposition calls index_copy with the user's index, which index_fill counts from the end)
            # index_add / index_copy refuse a negative index, where the index_put they are written as
            # counts it from the end: checked, as the kernel checks
            index, name = args[2], func.__name__.rstrip("_")
            args = (*args[:2], checked(index, index >= 0, f"{name}(): index out of bounds: a negative index "
                                       f"(index {name} takes 0 <= index < size)"), *args[3:])
        if func in _VALUE_FILLS and "value" in kwargs and len(args) == _VALUE_FILLS[func]:  # (`value=v`: by position)
            args, kwargs = (*args, kwargs["value"]), {k: v for k, v in kwargs.items() if k != "value"}
        if func in _VALUE_FILLS and len(args) > (at := _VALUE_FILLS[func]) and isinstance(args[0], torch.Tensor) \
                and isinstance(value := args[at], torch.Tensor) and value.ndim == 0 and value.dtype != args[0].dtype \
                and _is_traced(value) and not value.is_complex():  # (read as a number, checked and cast, by eager's
            # kernel; torch's decomposition takes it as it is, or casts it unchecked)
            args = (*args[:at], _fits_dtype(value, args[0].dtype).to(args[0].dtype), *args[at + 1:])
        if func in _INDEX_FILLS and len(args) == 4 and not kwargs and isinstance(args[0], torch.Tensor) \
                and isinstance(args[1], int) and isinstance(args[3], torch.Tensor) and args[3].requires_grad \
                and args[3].ndim == 0 and isinstance(args[2], torch.Tensor) and args[2].ndim <= 1:
            return _index_fill_differentiable(func, *args)
        if func is torch._C.TensorBase.data_ptr and args and _ADDRESSES and (ptr := _address(args[0])) is not None:
            return ptr  # a stand-in's: its tensor's (`{p.data_ptr(): p for p in model.parameters()}`, dedup of ties)
        if func is torch.Tensor.__contains__ and len(args) == 2 and _is_traced(args[0]) \
                and not isinstance(args[1], torch.Tensor):  # (`pad_token_id in ids[:, [-1, 0]]`: a read, as `bool` is)
            result = _read(_contains, args[0], args[1:])
            if result is not _UNREADABLE:
                return result
        if func in _READS and _is_traced(args[0]):  # (under torch.func.grad too: `if (x > 0).any()`)
            result = _read(func, args[0], args[1:], kwargs)  # (a step counter `c.step += 1`: its copy, `_read`)
            if result is not _UNREADABLE:
                return result
        if func in _NARROWS and 1 <= len(args) < 4 and kwargs.keys() >= set(_NARROW_NAMES[len(args) - 1:]):
            args = (*args, *(kwargs.pop(k) for k in _NARROW_NAMES[len(args) - 1:]))  # (`x.narrow(1, start=n,
            # length=3)`: as the positional form, whose bounds are read below)
        if func in _NARROWS and len(args) >= 4 and any(isinstance(a, torch.Tensor) for a in args[2:4]):
            read = _slice_bounds_read(slice(args[2], args[3]))
            args = (args[0], args[1], read.start, read.stop, *args[4:])  # (`x.narrow(1, n, 3)`, `narrow(1, 0, n)`:
            # n of an argument, read as int(n))
        if func in _FULLS and (filled := _traced_fill(func, args, kwargs)) is not None:
            return filled  # (`torch.full((3,), m.any())`, `x.new_full(size, n)`: the tensor, expanded)
        if func is torch.scalar_tensor and args and isinstance(args[0], torch.Tensor) and _is_traced(args[0]) \
                and args[0].numel() == 1:  # (its number, as a tensor of the dtype asked for: the default's if none)
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            return _fits_dtype(args[0].detach().reshape(()), dtype).to(dtype=dtype, device=kwargs.get("device") or args[0].device) \
                .clone().requires_grad_(bool(kwargs.get("requires_grad")))
        if func in _TENSOR_OF and (made := _traced_tensor_of(func, args, kwargs)) is not None:
            return made  # (`torch.tensor([row.max() + 1 for row in ids])`: the values, stacked)
        if func in _SIZE_TAKERS and (read := _sizes_read(func, args, kwargs)) is not None:
            args, kwargs = read  # (`torch.arange(n)`, n = mask.sum(1).max() of an argument: read, as int(n) is)
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) >= 2 \
                and (bounds := _slice_bounds_read(args[1])) is not args[1]:  # (`x[:, n - 1:]`, n a 0-d tensor of
            args = (args[0], bounds, *args[2:])  # an argument: read, as `int(n)` is; torch's indexing reads it in C++)
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) >= 2 \
                and (index := _bool_lists_as_masks(args[1])) is not None:
            args = (args[0], index, *args[2:])  # (`x[[True, False, ...]]`: the mask torch makes of it, a constant)
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) >= 2 \
                and isinstance(args[0], torch.Tensor) and (masked := _scalar_masks_unsqueezed(*args[:2])) is not None:
            args = (*masked, *args[2:])  # (`x[:, b]`, b a 0-d mask: x with a dim of one there, b a mask of it)
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) >= 2 \
                and isinstance(args[0], torch.Tensor) and (index := _scalar_tensors_beside_indices(args[1], args[0].ndim)) \
                is not None:
            args = (args[0], index, *args[2:])  # (`h[i, :, j] = v`, j a 0-d integer: one index among the others)
        elif func is torch.Tensor.__getitem__ and len(args) == 2 and isinstance(args[0], torch.Tensor) \
                and (selected := _selected_by_scalar_tensors(*args)) is not None:
            args = selected  # (`x[j, :, i]`: selected by j first, as torch does)
        elif func is torch.Tensor.__setitem__ and len(args) == 3 and not kwargs and isinstance(args[0], torch.Tensor) \
                and _written_by_scalar_tensor(*args):
            return None  # (`x[j, :, i] = v`: the block j selects, written and put back)
        if func is torch.Tensor.__setitem__ and len(args) == 3 and not kwargs and _masked_write(*args):
            return None
        if func is torch.Tensor.__setitem__ and len(args) == 3 and not kwargs and \
                (index := _mask_as_positions(args[1])) is not None:  # (`y[y > 0] += 1` of readable values: its
            _value_fits(args[0], index, args[2])  # write as its read, by positions; under torch.func.grad too)
            return func(args[0], index, args[2])
        if func is torch.Tensor.__setitem__ and len(args) == 3 and not kwargs:
            _value_fits(*args)
        if func in _INDEX_PUTS and len(args) >= 3 and isinstance(args[1], (tuple, list)) \
                and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]) \
                and (index := _mask_as_positions(tuple(args[1]))) is not None:
            args = (args[0], index, *args[2:])  # (a readable mask as its positions: its gradient, `grad[mask]`,
            # is then a gather by them, where torch's backward counts the mask, which a trace cannot)
        if func in (torch.nn.functional.cross_entropy, torch.nn.functional.nll_loss):
            _target_fits(func, *_bound(args, kwargs, ("input", "target")))
            args, kwargs = _long_target(args, kwargs)
        if (write_check := _INDEX_WRITES.get(written := _base_name(func))) is not None:
            write_check(*_bound(args, kwargs, _WRITE_ARGS[written]))
        if func is torch.Tensor.__getitem__ and len(args) == 2 and (index := _mask_as_positions(args[1])) is not None:
            return func(args[0], index)
        if func in (torch.masked_select, torch.Tensor.masked_select) and len(args) == 2 and not kwargs:
            x, mask = (t.reshape(-1) for t in torch.broadcast_tensors(*args))  # 1-D: x[mask] of the flattened two,
            if (index := _mask_as_positions(mask)) is not None:  # read as its positions where the mask is readable
                return x[index]
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) >= 2 \
                and (index := _scalar_tensors_as_lists(args[1])) is not None:
            return _index_by_scalar_tensors(func, args[0], args[1], index, *args[2:])
        if func is torch.where and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            func, kwargs = torch.nonzero, {"as_tuple": True}  # torch.where(mask): the positions of its True values
        if func in _SHAPE_READS and args and isinstance(args[0], torch.Tensor):
            result = _read(functools.partial(_listed, func), args[0], args[1:], kwargs)
            if result is not _UNREADABLE:
                return _unlisted(result)
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and (out := _repeated(*args, **kwargs)) \
                is not None:
            return out
        if func is torch.nn.functional.scaled_dot_product_attention and \
                (kwargs.get("dropout_p") or (len(args) > 4 and args[4])) and args[0].device.type != "cpu":
            # with dropout, CUDA's fused kernels draw from torch's generator, which no layout can
            # reproduce (each rank would draw its own mask): the math path, whose dropout hpfun
            # draws, as on the CPU (which takes it for dropout anyway)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.MATH):
                return func(*args, **kwargs)
        if func is torch.nn.functional.one_hot:
            if (read := _ints_read(args, kwargs)) is not None:  # (`num_classes=n`, n a 0-d tensor of an argument)
                args, kwargs = read
            return _one_hot(func, *args, **kwargs)
        if func in (torch.take, torch.Tensor.take) and len(args) == 2 and not kwargs \
                and isinstance(args[1], torch.Tensor) and args[1].ndim == 0:  # (by a 0-d index, which torch's
            return func(args[0], args[1].reshape(1)).reshape(())  # decomposition reads as a Python int)
        if func is torch.nn.functional.gaussian_nll_loss:
            return _gaussian_nll_loss(func, args, kwargs)
        if func in (torch.bincount, torch.Tensor.bincount) and isinstance(args[0], torch.Tensor):
            return _bincount(func, *args, **kwargs)
        if func in (torch.cov, torch.Tensor.cov) and isinstance(args[0], torch.Tensor):
            return _cov(func, *args, **kwargs)
        if func in (torch.corrcoef, torch.Tensor.corrcoef) and isinstance(args[0], torch.Tensor):
            return _corrcoef(func, *args, **kwargs)
        if func is torch.Tensor.view and isinstance(args[0], torch.Tensor):
            try:
                return func(*args, **kwargs)
            except ValueError as err:  # the trace's view check raises ValueError where eager raises
                raise RuntimeError(str(err)) from err  # RuntimeError (`except RuntimeError: x.reshape(...)`)
        if func in _RESIZES and isinstance(args[0], FakeTensor) and len(args) == 2 and not kwargs and \
                tuple(args[1].shape if isinstance(args[1], torch.Tensor) else args[1]) == tuple(args[0].shape):
            return args[0]  # (a resize to the shape it has: nothing, as in eager; a resize is no op a rule can split)
        if func in _DETERMINANTS and args and isinstance(args[0], FakeTensor):
            # det factors A or A.T by whether A is contiguous, and its backward was traced for the one it
            # factored: a block laid out otherwise at run time (a split matrix gathered, a step slice) got the
            # transposed gradient. Given a contiguous copy, it factors the same one whatever the layout
            return func(args[0].clone(memory_format=torch.contiguous_format), *args[1:], **kwargs)
        if func in _AS_STRIDED and isinstance(args[0], FakeTensor):
            return _as_strided(func, *args, **kwargs)
        if getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__" and isinstance(args[0], FakeTensor) \
                and args[0].is_leaf:
            return _set_data(*args)
        if func in _ALPHA and isinstance(kwargs.get("alpha"), torch.Tensor):
            alpha = kwargs.pop("alpha")
            x, y, *rest = args
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.is_floating_point() \
                    and y.is_floating_point() and not rest and not kwargs \
                    and (common := torch.result_type(x, y)) in (x.dtype, y.dtype) \
                    and (common == x.dtype or not func.__name__.endswith("_")):
                # torch's kernel computes x + alpha * y in one fused multiply-add, as addcmul does,
                # in the operands' common dtype (Muon adds a bfloat16 update to a float32 weight:
                # the update is cast up first, exactly, not rounded to bfloat16 times alpha)
                alpha = alpha if func.__name__ in ("add", "add_") else torch.neg(alpha)
                y = y if y.dtype == common else y.to(common)
                if func.__name__.endswith("_"):
                    return x.addcmul_(y, alpha)
                return _as_eager(torch.addcmul(x if x.dtype == common else x.to(common), y, alpha), x, y)
            return func(x, torch.mul(y, alpha), *rest, **kwargs)
        if func in _LERP and len(args) == 3 and isinstance(args[2], torch.Tensor) and args[2].dim() == 0 \
                and isinstance(args[0], torch.Tensor) and args[2].dtype != args[0].dtype:
            # a traced float weight (1 - beta1), where eager's float weight is taken in the input's
            # precision (for the 16-bit types, float: this rounds the weight once more)
            return func(args[0], args[1], args[2].to(args[0].dtype), **kwargs)
        if func in _VALUE and isinstance(kwargs.get("value"), torch.Tensor):
            value = kwargs.pop("value")
            x, t1, t2 = args
            # torch's kernels compute x + (value * t1) {*,/} t2 with value in the input's precision:
            # the same steps give the same bits as eager's float value (for the 16-bit types,
            # computed in float, value * t1 is rounded once more; float copies would cost memory)
            out = _VALUE[func](x, torch.mul(t1, value), t2)
            return x.copy_(out) if func.__name__.endswith("_") else _as_eager(out, x, t1, t2)
        try:
            return func(*args, **kwargs)
        except torch._subclasses.fake_tensor.DataDependentOutputException as err:
            if (read := _ints_read(args, kwargs, masks=func in _MASK_INDEXING)) is None:  # (`x.tile((1, n))`, `select(0, n)`:
                raise  # torch parses a 0-d integer tensor given for an int with `.item()`: read, as `int(n)` is)
            try:
                return func(*read[0], **read[1])
            except Exception:  # (it was a tensor operand after all)
                raise err from None


class _CheckedAtRun:
    """`torch.any(var < 0)` in F.gaussian_nll_loss's `if ...: raise ValueError(...)`: as a
    condition, false, with the check recorded in the program (`_assert_async`), which raises
    at every call where a variance is negative."""

    def __init__(self, found: torch.Tensor, message: str):
        self.found, self.message = found, message

    def __bool__(self) -> bool:
        torch._assert_async(torch.logical_not(self.found), self.message)
        return False


def _gaussian_nll_loss(func, args, kwargs):
    """F.gaussian_nll_loss with its check that no variance is negative made at run time: it
    reads the variances' values (`if torch.any(var < 0)`), which a trace on shapes cannot, and
    the variances are mostly made from parameters (a network's softplus output)."""
    real_any = torch.any

    def any_checked(x, *rest, **kw):
        return _CheckedAtRun(real_any(x, *rest, **kw), "var has negative entry/entries")

    with mock.patch.object(torch, "any", any_checked):
        return func(*args, **kwargs)


class UnliftedTensor(Exception):
    """A real tensor reached the trace: the function reads state hpfun did not lift (the caller
    names the suspects). `tensor`: that tensor, where the error's frames held it."""

    def __init__(self, where: str, tensor: torch.Tensor | None = None):
        super().__init__(where)
        self.tensor = tensor


def _real_tensor_in(err: Exception) -> torch.Tensor | None:
    """The real tensor torch's fake mode refused ('convert all Tensors to FakeTensors'), found
    among the locals of the frames it was raised through (an argument list of the op)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame if tb is not None else None
    for _ in range(8):
        if frame is None:
            break
        for v in list(frame.f_locals.values()):
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and \
                        not torch._C._functorch.is_functorch_wrapped_tensor(t) and t.device.type != "meta":
                    return t
        frame = frame.f_back
    return None


def _refuse_sparse(gm: torch.fx.GraphModule) -> None:
    """A value the trace made sparse (the gradient of nn.Embedding(sparse=True)'s weight, with
    no optimizer step in the call to refuse it): named at the user's line, before its ops are
    found to have no rule, or its write-back fails after the program ran."""
    problems, seen = [], set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "call_function" and isinstance(val, torch.Tensor) and val.layout != torch.strided:
            line = user_line(n.meta.get("stack_trace")) if n.meta.get("stack_trace") else ""
            if line not in seen:
                seen.add(line)
                problems.append(Problem(f"a {str(val.layout).removeprefix('torch.')} tensor{f' at {line}' if line else ''}",
                                        "is sparse (nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) make "
                                        "their weight's gradient sparse), and hpfun shards dense tensors only",
                                        "pass sparse=False: the same update, with a dense gradient"))
    if problems:
        raise CaptureError(problems, headline="cannot capture the function")


def _sets_as_aliases(gm: torch.fx.GraphModule) -> None:
    """`a.set_(b)`: from there on the tensor `a` is another view of `b`'s memory (b's shape and
    strides), so a later write to either is seen through the other, and setting either again
    re-points that one alone; views of `a` taken before keep its old memory. An input `a` (an
    argument, lifted state: `p.set_(new)`) ends holding the last values of the memory it points
    at, written back as eager leaves it; what the function returns is read before that. An
    input given another shape is left to `_refuse_input_metadata_writes` (set_ from a storage:
    an op with no rule)."""
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.set_.source_Tensor]
    if not found:
        return
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    copies, stands_for = {}, {}  # input -> the copy into it at the end; an alias -> the input it stands for
    for n in found:
        a, b = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs["source"]
        root = _written_root(a)
        base = stands_for.get(root, root if root.op == "placeholder" else None)
        have, want = a.meta.get("val"), b.meta.get("val") if isinstance(b, torch.fx.Node) else None
        if not isinstance(b, torch.fx.Node) or base is not None and not (
                isinstance(have, torch.Tensor) and isinstance(want, torch.Tensor)
                and (have.shape, have.dtype) == (want.shape, want.dtype)):
            continue
        with gm.graph.inserting_before(n):
            alias = gm.graph.call_function(aten.alias.default, (b,))
        alias.meta.update(val=want, stack_trace=n.meta.get("stack_trace"))
        n.replace_all_uses_with(alias)
        gm.graph.erase_node(n)
        if base is not None:
            stands_for[alias] = base
            if base in copies:  # (set again: the input ends holding what it points at now)
                copies[base].args = (base, alias)
            else:
                with gm.graph.inserting_before(output):
                    copies[base] = gm.graph.call_function(aten.copy_.default, (base, alias))
                copies[base].meta.update(val=base.meta["val"], stack_trace=n.meta.get("stack_trace"))
    if copies:  # (a returned view of an input's memory is read before the copies write the inputs)
        first = next(n for n in gm.graph.nodes if n in copies.values())
        results = []
        for leaf in torch.utils._pytree.tree_leaves(output.args):
            if isinstance(leaf, torch.fx.Node) and _viewed_root(leaf) in copies and leaf not in results:
                results.append(leaf)
        for leaf in results:
            with gm.graph.inserting_before(first):
                kept = gm.graph.call_function(aten.clone.default, (leaf,))
            kept.meta.update(val=leaf.meta["val"], stack_trace=leaf.meta.get("stack_trace"))
            output.replace_input_with(leaf, kept)


def _viewed_root(node):
    """The tensor whose memory `node` shows, through views and in-place ops."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and \
            isinstance(node.target, torch._ops.OpOverload) and node.args and \
            (_writes_first(node.target) or _is_view(node.target)):
        node = node.args[0]
    return node


def _written_root(node):
    """The tensor `node` is, through the in-place ops that wrote it (each returns its target)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and \
            isinstance(node.target, torch._ops.OpOverload) and node.args and _writes_first(node.target):
        node = node.args[0]
    return node


def _mutates(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               and n.target.namespace != "profiler" for n in gm.graph.nodes)


_RESHAPE_FIX = "make a new tensor instead (`y = x.t()`, `y = x.unsqueeze(0)`: not x.t_(), x.unsqueeze_(0), x.resize_(...))"


def _refuse_input_metadata_writes(gm: torch.fx.GraphModule, only_resize: bool = False) -> None:
    """An op changing an input's shape or strides in place (`x.t_()`, `x.unsqueeze_(0)` on an
    argument or a parameter), named at the user's line: the program's results are new tensors,
    and what is written back into an input is its values, never a new shape. (On a tensor the
    function made, such an op is rewritten like any other.)"""
    problems = []
    for n in gm.graph.nodes:
        resized = n.op == "call_function" and n.target in (aten.resize.default, aten.resize_.default) and \
            isinstance(n.args[0], torch.fx.Node) and "val" in n.args[0].meta and \
            tuple(n.args[0].meta["val"].shape) != tuple(n.args[1])  # (functionalized x.resize_(...))
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and \
                (torch.Tag.inplace_view in n.target.tags and not only_resize or resized) and \
                _base(n.args[0]).op == "placeholder":
            line = user_line(n.meta.get("stack_trace")) if n.meta.get("stack_trace") else ""
            problems.append(Problem(f"{n.target.__name__.split('.')[0]}{f' at {line}' if line else ''}",
                                    "changes the shape or strides of an input (an argument or lifted state) in place, "
                                    "which hpfun cannot write back into it", _RESHAPE_FIX))
    if problems:
        raise CaptureError(problems, headline="cannot capture the function")


def _refuse_writes_through_unfold(gm: torch.fx.GraphModule) -> None:
    """A write through a view `unfold` made whose windows do not tile its dim exactly (they
    overlap, or leave elements out: `y.unfold(0, 2, 3)[0] = v`), named at the user's line.
    torch's functionalization writes such a view back through `unfold_backward`, which zeroes
    the elements no window reaches (silently wrong) and refuses overlapping windows with a
    message about torch.compile; windows that tile the dim are written back exactly."""
    problems = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) or not writes(n.target) \
                or not n.args or not isinstance(n.args[0], torch.fx.Node):
            continue
        view = n.args[0]
        while view.op == "call_function" and isinstance(view.target, torch._ops.OpOverload) and view.target.is_view \
                and view.args:
            if view.target is aten.unfold.default:
                source, dim, size, step = view.args[:4]
                length = source.meta["val"].shape[dim] if "val" in source.meta else None
                windows = (length - size) // step + 1 if length is not None else None
                if length is not None and (step < size or windows > 1 and step != size
                                           or (windows - 1) * step + size != length):
                    # (one window over the whole dim tiles it, with any step as large as its size)
                    line = user_line(n.meta.get("stack_trace")) if n.meta.get("stack_trace") else ""
                    where = f"{n.target.__name__.split('.')[0]}{f' at {line}' if line else ''}"
                    if windows == 1 and (windows - 1) * step + size == length:  # (its step is smaller than its size)
                        problems.append(Problem(where, f"writes in place through a view unfold made of one window of "
                                                f"all {length} elements with a step of {step}, smaller than its size, "
                                                "which torch's functionalization refuses as overlapping windows",
                                                f"give unfold a step of {size} (the same one window)"))
                        break
                    how = "overlap" if step < size else "leave elements out"
                    problems.append(Problem(
                        where,
                        f"writes in place through a view unfold made whose windows {how} (size {size}, step {step} "
                        f"over {length} elements), which torch's functionalization cannot write back exactly",
                        "write into the tensor itself by index (`y[i * step:i * step + size] = v`), or clone the "
                        "unfolded windows first (a copy, written on its own)"))
                    break
            view = view.args[0]
            if not isinstance(view, torch.fx.Node):
                break
    if problems:
        raise CaptureError(problems, headline="cannot capture the function")


def _draw_problem(target, args: dict, dtype) -> str | None:
    """What torch's CPU kernel would refuse in a random op's arguments (its meta kernel, which
    the trace runs, checks none of them), in torch's words, or None."""
    name = target._schema.name.split("::")[-1]
    real = dtype.to_real() if dtype is not None and dtype.is_complex else dtype
    if name in ("rand", "randn", "rand_like", "randn_like", "uniform", "normal_functional", "normal") and \
            dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        return f"{name} draws floating-point numbers, but the tensor is {dtype}"
    if name in ("exponential", "cauchy", "log_normal", "geometric") and dtype is not None and dtype.is_complex:
        return f"{name} draws real numbers, but the tensor is {dtype}"
    if name == "bernoulli" and "p" in args and not isinstance(args["p"], torch.fx.Node) and not 0 <= args["p"] <= 1:
        return f"bernoulli expects p to be in [0, 1], but got p={args['p']}"
    if name == "uniform":
        low, high = args.get("from", 0.0), args.get("to", 1.0)
        if not low <= high:
            return f"uniform_ expects a [from, to) range, but got from={low} > to={high}"
        if real is not None and real.is_floating_point and not high - low <= torch.finfo(real).max:
            return f"uniform_'s range [{low}, {high}) is out of bounds for {dtype}"
    if name in ("normal_functional", "normal") and not isinstance(args.get("std"), torch.fx.Node) and \
            not args.get("std", 1.0) >= 0:
        return f"normal expects std >= 0.0, but got std={args['std']}"
    if name == "log_normal" and not args.get("std", 2.0) > 0:
        return f"log_normal_ expects std > 0.0, but got std={args['std']}"
    if name == "exponential" and not args.get("lambd", 1.0) > 0:
        return f"exponential_ expects lambda > 0.0, but got lambda={args['lambd']}"
    if name == "cauchy" and not args.get("sigma", 1.0) > 0:
        return f"cauchy_ expects sigma > 0.0, but got sigma={args['sigma']}"
    if name == "geometric" and not 0 < args["p"] < 1:
        return f"geometric_ expects p to be in (0, 1), but got p={args['p']}"
    if name in ("randint", "randint_like") and dtype is not None:
        low, high = args.get("low", 0), args["high"]
        if not low < high:
            return f"randint expects low < high, but got low={low}, high={high}"
        if high - low >= 2**63:
            return f"hpfun draws integers from ranges narrower than 2^63, and [{low}, {high}) is not"
        if dtype is torch.bool:
            bounds = (0, 1)
        elif dtype.is_floating_point:
            digits = 1 - round(math.log2(torch.finfo(dtype).eps))  # 11 for float16: whole numbers to 2^11 exact
            bounds = (-2**digits, 2**digits)
        else:
            bounds = (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
        if low < bounds[0] or high - 1 > bounds[1]:
            return (f"randint's range [{low}, {high}) does not fit {dtype}"
                    + (" exactly (whole numbers beyond 2^(mantissa bits + 1) round)" if dtype.is_floating_point else ""))
    if name == "randperm" and dtype is not None and dtype is not torch.bool:
        top = 2 ** (1 - round(math.log2(torch.finfo(dtype).eps))) + 1 if dtype.is_floating_point \
            else torch.iinfo(dtype).max + 1
        if args["n"] > top:
            return f"randperm's n={args['n']} is more than {dtype} holds exactly ({top})"
    return None


def _check_draws(gm: torch.fx.GraphModule) -> None:
    """Random ops' arguments checked as torch's kernels check them (a probability above 1, an
    empty uniform range...), every problem at its source line in one error: the trace's meta
    kernels check none of them, and hpfun's own draws would give numbers from them silently."""
    problems = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) or \
                torch.Tag.nondeterministic_seeded not in n.target.tags:
            continue
        schema = n.target._schema
        args = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
        args.update({a.name: v for a, v in zip(schema.arguments, n.args)})
        args.update(n.kwargs)
        val = n.meta.get("val")
        why = _draw_problem(n.target, args, val.dtype if isinstance(val, torch.Tensor) else None)
        if why is not None:
            line = user_line(n.meta.get("stack_trace")) if n.meta.get("stack_trace") else ""
            problems.append(Problem(f"{schema.name.split('::')[-1]}{f' at {line}' if line else ''}", why,
                                    "give the draw arguments torch accepts (eager PyTorch raises here too)"))
    if problems:
        raise CaptureError(problems, headline="invalid arguments to random ops")


def _base(node):
    """The tensor a chain of views starts from (a placeholder, for a view of an input)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and node.target.is_view and node.args:
        node = node.args[0]
    return node


def _mutations_as_outputs(gm: torch.fx.GraphModule) -> list[int]:
    """Functionalization writes mutated inputs back with copy_ at the end: those values become
    outputs instead, and the caller writes them back after each call."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    written: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is aten.copy_.default and n.args[0] in inputs:
            written[n.args[0]] = n.args[1]
            n.replace_all_uses_with(n.args[1])
            gm.graph.erase_node(n)
    bad = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
           and n.target._schema.is_mutable and n.target.namespace != "profiler"]
    if bad:
        raise CaptureError([Problem(f"{n.target}" + (f" at {user_line(n.meta.get('stack_trace'))}"
                                                     if n.meta.get("stack_trace") else ""),
                                    "changes a tensor's shape or strides in place", _RESHAPE_FIX) for n in bad],
                           headline="cannot capture the function")
    outs = list(output.args[0])
    output.args = (outs + list(written.values()),)
    return [inputs.index(node) for node in written]


def _refuse_reshaped_inputs(gm: torch.fx.GraphModule, mutated: list[int]) -> None:
    """An input written in place with a value of another shape (`buf.set_(t)`, torch.ao's
    FakeQuantize growing a per-channel scale from [1] to [16]): the caller's tensor keeps its
    shape, so no write-back can give it the new value."""
    if not mutated:
        return
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    written = list(output.args[0])[-len(mutated):]
    bad = [(inputs[i], new) for i, new in zip(mutated, written, strict=True)
           if isinstance(new, torch.fx.Node) and isinstance(new.meta.get("val"), torch.Tensor)
           and tuple(new.meta["val"].shape) != tuple(inputs[i].meta["val"].shape)]
    if bad:
        raise CaptureError([Problem(f"{new.target}" + (f" at {line}" if (line := user_line(new.meta.get("stack_trace")))
                                                       else ""),
                                    f"gives a tensor of shape {tuple(old.meta['val'].shape)} a value of shape "
                                    f"{tuple(new.meta['val'].shape)} in place (`set_`, `resize_`), which hpfun "
                                    "cannot write back into the caller's tensor", _RESHAPE_FIX) for old, new in bad],
                           headline="cannot capture the function")


def _drop_profiler_calls(gm: torch.fx.GraphModule) -> None:
    """`record_function` markers (an optimizer's step wraps itself in one) do nothing in the program."""
    for n in reversed(list(gm.graph.nodes)):
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "profiler" and not n.users:
            gm.graph.erase_node(n)


def _box_of(shape, strides, base_offset: int, size, stride, offset) -> list | None:
    """How `as_strided(size, stride, offset)` of a tensor of `shape` and `strides` (at
    `base_offset` in its storage) picks a box of it: per input dim, (start, the output dim it
    becomes, or None where it is indexed away at start); None where it is no box (windows,
    gaps, strides no input dim has)."""
    rel = offset - base_offset
    if rel < 0 or len(size) != len(stride) or any(n == 0 for n in shape):
        return None
    order = sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: -strides[d])
    start = [0] * len(shape)
    for d in order:
        start[d], rel = divmod(rel, strides[d]) if strides[d] > 0 else (0, rel)
        if start[d] >= shape[d]:
            return None
    if rel:
        return None
    target = [None] * len(shape)
    for t, (n, st) in enumerate(zip(size, stride)):
        if n == 1:
            continue
        d = next((d for d in order if strides[d] == st and target[d] is None), None)
        if d is None or start[d] + n > shape[d]:
            return None
        target[d] = t
    return list(zip(start, target))


def _as_strided_as_views(gm: torch.fx.GraphModule) -> None:
    """`as_strided` that picks a box of its input (autograd's backward of a write into a slice,
    `y.narrow(2, 1, 2).mul_(3)`: the gradient's view at the slice) written as the slices,
    selects and permutation it is: views with layout rules of their own, where as_strided is
    taken whole (a data-parallel gradient was gathered for it)."""
    graph = gm.graph

    def call(op, args, value, like):
        node = graph.call_function(op, args)
        node.meta.update(val=value, stack_trace=like.meta.get("stack_trace"))
        return node

    for n in list(graph.nodes):
        scatter = n.target is aten.as_strided_scatter.default
        if n.op != "call_function" or n.target not in (aten.as_strided.default, aten.as_strided_scatter.default) \
                or not isinstance(n.args[0], torch.fx.Node):
            continue
        val = n.args[0].meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        at = 2 if scatter else 1
        size, stride = list(n.args[at]), list(n.args[at + 1])
        offset = n.args[at + 2] if len(n.args) > at + 2 and n.args[at + 2] is not None else val.storage_offset()
        box = _box_of(tuple(val.shape), val.stride(), val.storage_offset(), size, stride, offset)
        if box is None and _reshapes_whole(val, size, stride, offset):  # every element, in order, in another
            src = n.args[1] if scatter else n.args[0]  # shape (adaptive pooling's backward writes a batch's
            src_val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None  # gradient so): a view,
            if isinstance(src_val, torch.Tensor) and src_val.is_contiguous():  # which keeps its split
                shape = list(val.shape) if scatter else size
                with graph.inserting_before(n):
                    x = call(aten.view.default, (src, shape), aten.view.default(src_val, shape), n)
                    if scatter:  # (a tensor of its own, as the scatter's is)
                        x = call(aten.clone.default, (x,), aten.clone.default(x.meta["val"]), n)
                n.replace_all_uses_with(x)
                graph.erase_node(n)
            continue
        if box is None:
            continue
        steps = [(aten.slice.Tensor, (d, start, start + size[t])) for d, (start, t) in enumerate(box)
                 if t is not None and (start, size[t]) != (0, val.shape[d])]
        steps += [(aten.select.int, (d, start)) for d, (start, t) in reversed(list(enumerate(box))) if t is None]
        kept = [t for _, t in box if t is not None]  # the output dims left, in input order
        order = sorted(range(len(kept)), key=kept.__getitem__)
        with graph.inserting_before(n):
            views, values, x, value = [], [], n.args[0], val
            for op, rest in steps:  # the box, a view of the input at a time
                views.append((x, value))
                value = op(value, *rest)
                x = call(op, (x, *rest), value, n)
            if not scatter:
                if order != list(range(len(kept))):
                    value = aten.permute.default(value, order)
                    x = call(aten.permute.default, (x, order), value, n)
                if list(value.shape) != size:  # size-1 dims of the result
                    x = call(aten.view.default, (x, size), aten.view.default(value, size), n)
            else:  # the source laid back into the box's dims, then written into each view out to the input
                src, src_val = n.args[1], n.args[1].meta.get("val")
                if not isinstance(src_val, torch.Tensor):
                    continue
                permuted = [size[t] for t in sorted(kept)]
                if list(src_val.shape) != permuted:
                    src_val = aten.view.default(src_val, permuted)
                    src = call(aten.view.default, (src, permuted), src_val, n)
                back = sorted(range(len(kept)), key=order.__getitem__)
                if order != list(range(len(kept))):
                    src_val = aten.permute.default(src_val, back)
                    src = call(aten.permute.default, (src, back), src_val, n)
                for (op, rest), (base, base_val) in reversed(list(zip(steps, views))):
                    if op is aten.slice.Tensor:
                        write, args = aten.slice_scatter.default, (base, src, *rest)
                    else:
                        write, args = aten.select_scatter.default, (base, src, *rest)
                    src_val = write(base_val, src_val, *rest)
                    src = call(write, args, src_val, n)
                x = src if steps else call(aten.clone.default, (src,), src_val, n)
        n.replace_all_uses_with(x)
        graph.erase_node(n)


def _reshapes_whole(val, size, stride, offset) -> bool:
    """Whether `as_strided(val, size, stride, offset)` takes every element of a contiguous `val`
    in its order: a reshape of it."""
    if not val.is_contiguous() or offset != val.storage_offset() or math.prod(size) != val.numel():
        return False
    expected, step = [], 1
    for n in reversed(size):
        expected.append(step)
        step *= n
    return all(n == 1 or s == e for n, s, e in zip(size, stride, reversed(expected), strict=True))


_INDEXING = {aten.index.Tensor: 1, aten._unsafe_index.Tensor: 1, aten.index_put.default: 1,
             aten._unsafe_index_put.default: 1}


def _iota_length(node) -> tuple[int, int] | None:
    """(n, where) of a node holding 0, 1, ..., n-1 along one dim `where` and size 1 elsewhere
    (`torch.arange(n).view(n, 1, 1)`, clamped to [0, n-1]: torch's decompositions index every
    dim so, the pad's and upsample's backward), else None."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype not in (torch.int64, torch.int32):
        return None
    big = [d for d, k in enumerate(val.shape) if k > 1]
    if len(big) > 1:
        return None
    n = val.shape[big[0]] if big else 1
    while node.op == "call_function":
        if node.target is aten.clamp.default and len(node.args) >= 3 and (node.args[1] is None or node.args[1] <= 0) \
                and (node.args[2] is None or node.args[2] >= n - 1):
            node = node.args[0]
        elif node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default):
            node = node.args[0]
        else:
            break
    if node.op != "call_function" or node.target not in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        return None
    args = list(node.args) + [None] * 3
    start, end, step = (0, args[0], 1) if node.target is aten.arange.default else \
        (args[0], args[1], 1 if node.target is aten.arange.start else args[2] or node.kwargs.get("step", 1))
    return (n, big[0] if big else len(val.shape) - 1) if (start, end, step) == (0, n, 1) else None


def _iota_indices_as_slices(gm: torch.fx.GraphModule) -> None:
    """`x[arange(b).view(b, 1, 1), i, j]` (an index tensor that counts along the very dim it
    indexes, as torch's decompositions write the batch dims of a pad's or upsample's backward)
    is `x[:, i', j']`: the leading such indices become whole-dim slices, the others lose that
    (size-1) dim. A batch split then stays split, where the index rule took each rank's rows by
    position and summed them (a Partial of the whole gradient on every rank)."""
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in _INDEXING or not isinstance(n.args[1], (list, tuple)):
            continue
        indices = list(n.args[1])
        x = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
        if x is None or not indices or any(i is None for i in indices):
            continue
        shapes = [tuple(i.meta["val"].shape) if isinstance(i, torch.fx.Node) and "val" in i.meta else None for i in indices]
        if None in shapes or len({len(sh) for sh in shapes}) != 1:
            continue
        dropped = 0
        while dropped < len(indices) - 1:  # (one index left at least: x[:, :, idx] stays an index)
            d = dropped
            iota = _iota_length(indices[d])
            if iota is None or iota != (x.shape[d], d) or \
                    any(sh[d] != 1 for k, sh in enumerate(shapes) if k != d and len(sh) > d):
                break
            dropped += 1
        if not dropped:
            continue
        with graph.inserting_before(n):
            rest = []
            for i, sh in zip(indices[dropped:], shapes[dropped:]):
                want = list(sh[dropped:])
                node = graph.call_function(aten.view.default, (i, want))
                node.meta.update(val=aten.view.default(i.meta["val"], want), stack_trace=n.meta.get("stack_trace"))
                rest.append(node)
        n.args = (n.args[0], [None] * dropped + rest, *n.args[2:])


def _drop_plain_copies(gm: torch.fx.GraphModule) -> None:
    """`copy(dst, src)` where `src` is a new tensor of `dst`'s shape, dtype, device and strides
    that nothing else reads is `src` itself. An in-place update written as `x.copy_(f(x, ...))`
    (an optimizer's `addcdiv_` with a traced step size, `param.copy_(new)`) functionalizes to such
    a copy: one more pass over the tensor, and a second buffer of it, per step. A `src` that is
    a view, an input or read elsewhere keeps its copy, so no two results share memory."""
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.copy.default or len(n.args) != 2 or n.kwargs:
            continue
        src = n.args[1]
        if not isinstance(src, torch.fx.Node) or src.op != "call_function" or len(src.users) != 1 \
                or not isinstance(src.target, torch._ops.OpOverload) or src.target._schema.is_mutable:
            continue
        returns = src.target._schema.returns
        if len(returns) != 1 or returns[0].alias_info is not None:
            continue
        have, want = src.meta.get("val"), n.meta.get("val")
        if not isinstance(have, torch.Tensor) or not isinstance(want, torch.Tensor) or \
                (have.shape, have.dtype, have.device, have.stride()) != (want.shape, want.dtype, want.device, want.stride()):
            continue
        n.replace_all_uses_with(src)
        gm.graph.erase_node(n)


def _constants_as_inputs(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Tensors the function made from data (`torch.tensor([...])`) become inputs at the end of the
    placeholders, fed their values: the program then holds no state of its own, and every
    runtime feeds them as it feeds arguments. An empty one (a KV cache's `torch.tensor([])`)
    holds no data: it is made in the program instead."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = []
    for n in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        value = getattr(gm, n.target)
        if value.numel() == 0:
            with gm.graph.inserting_before(n):
                made = gm.graph.call_function(aten.empty.memory_format, (list(value.shape),),
                                              {"dtype": value.dtype, "device": value.device})
            made.meta.update(n.meta)
            made.meta.setdefault("val", _fake_like(value))
            n.replace_all_uses_with(made)
            gm.graph.erase_node(n)
            delattr(gm, n.target)
            continue
        where = gm.graph.inserting_after(placeholders[-1]) if placeholders else gm.graph.inserting_before(None)
        with where:
            placeholder = gm.graph.placeholder(f"constant_{len(values)}")
        placeholder.meta.update(n.meta)
        if "val" not in placeholder.meta:
            placeholder.meta["val"] = _fake_like(value)
        n.replace_all_uses_with(placeholder)
        gm.graph.erase_node(n)
        delattr(gm, n.target)
        placeholders.append(placeholder)
        values.append(value)
    return values


def _fake_like(value: torch.Tensor) -> torch.Tensor:
    with FakeTensorMode():
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


def _replaying(gm: torch.fx.GraphModule):
    """Run `gm` node by node so the re-trace inherits each node's metadata (its source line)."""

    def run(*args):
        with torch.fx.traceback.preserve_node_meta():
            return _Replay(gm).run(*args)

    return run


class _Replay(torch.fx.Interpreter):
    """The first trace's graph run again, under torch's functionalization.

    An in-place op's out-of-place form may lay its result out otherwise (`x.clone().scatter_(...)`
    keeps the clone's strides; functionalized, `scatter` returns a contiguous tensor), so a
    `.view(shape)` the first trace took as a view of a later value may not be one here: it is
    then a reshape, which copies, where nothing writes the tensors that share its memory (a copy
    reads the same then). An error carries the line of the node that raised it."""

    def run_node(self, n):
        try:
            return super().run_node(n)
        except Exception as err:
            if n.op == "call_function" and n.target is aten.view.default and "view" in str(err) \
                    and not _aliases_written(n):
                with self._set_current_node(n):
                    args, kwargs = self.fetch_args_kwargs_from_env(n)
                    return aten.reshape.default(*args, **kwargs)
            if not hasattr(err, "hpfun_line"):
                err.hpfun_line = user_line(n.meta.get("stack_trace"))
            raise


def _aliases_written(node: torch.fx.Node) -> bool:
    """Whether an op after `node` writes a tensor sharing memory with `node`'s input: its base
    (through the views and in-place ops it was made by) or any view of that base, taken before
    or after (`row = c[0]; c.scatter_(...); flat = c.t().view(-1); row.mul_(5)`). A write
    before `node` is read by a copy as by the view."""

    def source(n):  # the node whose memory `n` is: a view's base, an in-place or out= op's written argument
        if n.op != "call_function":
            return None
        if n.target is operator.getitem:  # (a piece of a split or chunk, as the view it is)
            return source(n.args[0]) and n.args[0] if isinstance(n.args[0], torch.fx.Node) else None
        if not isinstance(n.target, torch._ops.OpOverload):
            return None
        if _is_view(n.target):
            return n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        schema = n.target._schema
        out = schema.returns[0].alias_info if schema.returns else None
        if out is None or not out.is_write:
            return None
        for i, arg in enumerate(schema.arguments):  # (`scatter_(self, ...)`, `scatter(..., out=c)`)
            if arg.alias_info is not None and arg.alias_info.is_write and arg.alias_info.before_set == out.before_set:
                value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
                return value if isinstance(value, torch.fx.Node) else None
        return None

    root = node.args[0]
    while (up := source(root)) is not None:
        root = up
    family, todo = {root}, [root]
    while todo:
        member = todo.pop()
        for user in member.users:
            if user not in family and source(user) is member:
                family.add(user)
                todo.append(user)
    later = set()
    for n in reversed(node.graph.nodes):
        if n is node:
            break
        later.add(n)
    for member in family:
        for user in member.users:
            if user not in later or not isinstance(user.target, torch._ops.OpOverload):
                continue
            for arg, value in zip(user.target._schema.arguments, user.args):
                if value is member and arg.alias_info is not None and arg.alias_info.is_write:
                    return True
            for arg in user.target._schema.arguments:
                if user.kwargs.get(arg.name) is member and arg.alias_info is not None and arg.alias_info.is_write:
                    return True
    return False


def _raised_by_the_code(err: Exception) -> bool:
    """Whether `err` is one the traced code raised itself, by a `raise` or an `assert` in its own
    (or a library's, not torch's) source: a check of its arguments (transformers' "You have to
    specify either input_ids or inputs_embeds") is the caller's to catch, as in eager."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames or not (_is_user_frame(frames[-1].filename) or frames[-1].filename.startswith(_ARGUMENT_CHECKS)) \
            or isinstance(err, torch._subclasses.fake_tensor.UnsupportedFakeTensorException):
        return False
    return _raises_or_asserts(frames[-1].line or "") and type(err).__module__ == "builtins"


# torch's own code that checks its caller's arguments in Python, as a library does (a distribution's
# `validate_args`: "Expected value argument ... to be within the support"): raised as in eager
_ARGUMENT_CHECKS = (os.path.join(TORCH_DIR, "distributions") + os.sep,)


def _raises_or_asserts(line: str) -> bool:
    """Whether a source line holds a `raise` or an `assert` statement, also after a colon
    (`if x.max() > 100: raise ValueError(...)`); the words inside strings and comments do not count."""
    names = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(line.strip()).readline):
            if token.type == tokenize.NAME:
                names.append(token.string)
    except (tokenize.TokenError, SyntaxError, IndentationError):  # the first line of a statement over several
        pass
    return "raise" in names or "assert" in names


def _user_where(err: Exception) -> str:
    """'file:line: code' of the innermost user frame in the error's traceback, or ''. Where that
    frame is an installed library's (transformers), the innermost of the user's own code comes
    first, the library's line after it."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if _is_user_frame(f.filename)]
    if not frames:
        return getattr(err, "hpfun_line", "")  # (raised in the re-trace through functionalization: `_Replay`)
    where = f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}"
    own = [f for f in frames if SITE_PACKAGES not in f.filename]
    if own and SITE_PACKAGES in frames[-1].filename:
        library = frames[-1].filename.rpartition(SITE_PACKAGES)[2]
        return f"{own[-1].filename}:{own[-1].lineno}: {own[-1].line} (in {library}:{frames[-1].lineno})"
    return where


@functools.lru_cache(maxsize=64)
def _has_grouped_experts(filename: str) -> bool:
    """Whether a transformers modeling file offers its experts as grouped matrix multiplies
    (`@use_experts_implementation`), besides the eager loop."""
    try:
        with open(filename, encoding="utf-8") as source:
            return "use_experts_implementation" in source.read()
    except OSError:
        return False


def _public_torch_file(filename: str) -> bool:
    """A file of torch's public modules (torch/nn/..., torch/optim/...), not its machinery
    (dispatch, fake tensors, fx, utils)."""
    if not filename.startswith(TORCH_DIR):
        return False
    rel = filename[len(TORCH_DIR):]
    return not rel.startswith(("_", "fx/", "utils/", "overrides", "autograd/")) and "/_" not in rel


_PACKED = (" — a packed sequence is laid out by the lengths' values, which a trace on shapes cannot read: run the "
           "RNN on the padded batch instead (a unidirectional RNN's outputs at the valid steps are the same; mask the "
           "rest with torch.where(arange(T) < lengths[:, None], ...) and take each sequence's last valid output "
           "rather than h_n)")
# torch functions that read their arguments' values, by name: what to write instead
_READER_HINTS = {
    "pack_padded_sequence": _PACKED,
    "pack_sequence": _PACKED,
    "ctc_loss": (" — torch's CTC loss kernel sizes its work from the target lengths' values, so it cannot be traced "
                 "on shapes, and hpfun has no decomposition of it yet: a step with a CTC loss cannot be sharded (a "
                 "forward-only function returning the log-probabilities can)"),
}


def _optimizer_stepping(err: Exception) -> str | None:
    """The class name of the `torch.optim.Optimizer` whose method (its step) raised the error, or
    None."""
    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.optim.Optimizer):
            return type(owner).__name__
        tb = tb.tb_next
    return None


def _describe(err: Exception) -> str:
    where = _user_where(err)
    where = f" at {where}" if where else ""
    kind = type(err).__name__
    hint = ""
    if "data-dependent" in str(err).lower() or "DataDependent" in kind or "DynamicOutputShape" in kind:
        hint = (" — the function reads tensor values to decide Python control flow or a shape "
                "(e.g. .item(), if x.sum() > 0, nonzero, torch.equal). hpfun reads values made from the "
                "arguments, buffers and constants, but not from parameters, optimizer state (they change at "
                "every step: reading them would run the step's arithmetic twice) or random numbers drawn "
                "inside, nor what torch's own backward reads (a prod's zeros), and this is such a value: "
                "compute it outside the sharded function and pass it in, or use torch.where")
        stack = traceback.extract_tb(err.__traceback__)
        frames = {os.path.basename(f.filename) for f in stack}
        outside = [i for i, f in enumerate(stack) if not f.filename.startswith((TORCH_DIR, HPFUN_DIR))]
        below = stack[outside[-1] + 1:] if outside else stack  # (torch's frames under the innermost other code's:
        reader = next((f for f in reversed(below) if _public_torch_file(f.filename)), None)  # not the module call
        # that ran a model whose own line reads the value, `expert_size.tolist()`)
        if _READABLE[0] is not None and _READABLE[0][2]:
            hint = (" — the function reads values of its arguments here, and they are meta tensors (planning "
                    "only): give real tensors for the arguments it reads (the others may stay meta)")
        elif any(f.name == "_detect_is_causal_mask" for f in stack):
            hint = (" — torch's transformer layers compare the attention mask with a causal mask to decide "
                    "is_causal (a read of its values): pass is_causal=True with a causal mask (tgt_is_causal=True "
                    "for nn.Transformer's decoder), or make the mask inside the function "
                    "(nn.Transformer.generate_square_subsequent_mask), whose constant values hpfun reads")
        elif reader is not None and reader.name in _READER_HINTS:
            hint = _READER_HINTS[reader.name]
        elif reader is None and ("aten.nonzero" in str(err) or "aten.masked_select" in str(err)):
            hint = (" — a boolean mask picks as many elements as it has True values (x[mask], masked_select, "
                    "nonzero), a shape read from the data. hpfun reads a mask made from the arguments, buffers and "
                    "constants (a program per mask), but not one made from parameters, optimizer state or random "
                    "draws inside, as this one is: keep the shape and mask the values instead "
                    "(F.cross_entropy(..., ignore_index=-100), torch.where(mask, x, 0), or a weighted sum divided "
                    "by mask.sum()), or compute the mask outside the sharded function and pass it in")
        elif reader is not None:
            hint += f" (the read is in {os.path.relpath(reader.filename, TORCH_DIR)}:{reader.lineno}, {reader.name})"
        elif any(read in where for read in (".item()", ".tolist()", "float(", "print(")):
            hint += ("; to log a value (`return loss.item()`), return the tensor and read it after the call "
                     "(`step(x, y).full().item()`)")
        if any(f.name in ("__init__", "_validate_sample") and os.sep + "distributions" + os.sep in f.filename
               for f in stack):
            hint = (" — torch.distributions checks its parameters' and samples' values (validate_args), a read of "
                    "values computed in the step: pass validate_args=False to the distribution, or call "
                    "torch.distributions.Distribution.set_default_validate_args(False) once")
            if any(f.filename.endswith("continuous_bernoulli.py") and f.name == "__init__" for f in stack):
                hint = (" — torch.distributions.ContinuousBernoulli checks `probs` whenever validate_args is given, "
                        "False too, a read of values computed in the step: leave validate_args out and call "
                        "torch.distributions.Distribution.set_default_validate_args(False) once, or give it logits")
        if any(f.filename.endswith(os.path.join("optim", "lr_scheduler.py")) for f in stack):
            hint = (" — a learning-rate scheduler's step(metric) (ReduceLROnPlateau) compares the metric in Python, "
                    "a read of a value computed in the step: step the scheduler after the call with the returned "
                    "loss (`loss = train_step(x, y); scheduler.step(loss.full())`); the learning rate it sets is an "
                    "input hpfun reads at every call")
        if any(os.sep + os.path.join("torch", "utils", "data") + os.sep in f.filename for f in stack):
            hint = (" — a DataLoader iterated inside the sharded function: its sampler and indices are Python "
                    "values read from tensors, and a program repeats one trace; iterate the loader outside and "
                    "pass each batch: `for x, y in loader: loss = train_step(x, y)`")
        if any(f.filename.endswith(os.path.join("transformers", "generation", "utils.py")) for f in stack):
            hint = (" — transformers' generate() decides in Python when every sequence has finished, from the "
                    "tokens the model chose (a read of computed values): shard the model's forward, one decoding "
                    "step, and run the generation loop outside the sharded function")
        moe = next((f for f in stack if os.sep + "transformers" + os.sep in f.filename and "expert" in (f.line or "")
                    and "nonzero" in (f.line or "")), None)
        if moe is not None and _has_grouped_experts(moe.filename):
            hint = (" — transformers' eager mixture-of-experts loop finds the experts that have tokens with "
                    "nonzero(), a shape read from the routing: build the model with its default experts "
                    "implementation (grouped matrix multiplies: leave experts_implementation unset), which hpfun "
                    "traces and shards")
        elif moe is not None:
            hint = (" — this model's mixture-of-experts layer finds the experts that have tokens with nonzero(), a "
                    "shape read from the routing, and transformers gives it no other implementation (models with "
                    "experts_implementation have grouped matrix multiplies, which hpfun traces): shard the rest of "
                    "the model and run this layer outside the sharded function, or write its expert loop with a "
                    "dense dispatch (every expert on every token, weighted by the router's one-hot choice)")
        if "aten.linalg_lstsq" in str(err):
            hint = (" — torch.linalg.lstsq's outputs (its rank and singular values) have shapes torch decides from "
                    "the driver at run time, which a trace on shapes cannot: solve with torch.linalg.solve (a square, "
                    "full-rank A), torch.linalg.pinv(A) @ B (the least-squares solution of least norm), or "
                    "torch.linalg.solve(A.mT @ A, A.mT @ B) (a tall A of full column rank)")
        if any(f.filename.endswith(os.path.join("nn", "utils", "clip_grad.py")) for f in stack):
            hint = (" — clip_grad_norm_(..., error_if_nonfinite=True) raises in Python when the norm is inf or NaN, "
                    "a read of the gradients' values: pass error_if_nonfinite=False (the default; the clipping runs "
                    "in the step as written), return the norm it gives, and check it after the call "
                    "(`torch.isfinite(norm.full())`)")
        stepping = _optimizer_stepping(err)
        if stepping is not None:
            hint = (f" — {stepping}.step() reads tensor values into Python (a norm, the loss), which a trace "
                    "cannot record: step that optimizer outside the sharded function: shard the forward and backward "
                    "(`loss = fwd_bwd(x, y)`, which writes the gradients back to the parameters), then call "
                    "`opt.step(); opt.zero_grad()` after it" + ("; LBFGS takes it as its closure: `opt.step(lambda: "
                                                                "(opt.zero_grad(), fwd_bwd(x, y).full())[1])`"
                                                                if stepping == "LBFGS" else ""))
        if "grad_scaler.py" in frames:
            hint = (" — torch.amp.GradScaler skips the optimizer's step when a gradient is inf or NaN, a Python "
                    "branch on tensor values; inside a sharded function train in bfloat16 (torch.autocast(..., "
                    "dtype=torch.bfloat16) needs no scaler), or scale the loss by a constant instead")
    if "Cannot view a tensor" in str(err) and getattr(err, "hpfun_line", None) is not None:  # (see `_Replay`)
        hint = (" — hpfun runs the function's in-place ops out of place, and an out-of-place op may lay its result "
                "out otherwise (x.clone().scatter_(...) keeps the clone's strides, x.scatter(...) is contiguous), so "
                "this view is not one there, and a later write (through it, or to the tensor it views or another "
                "view of that) must reach both: write the in-place op before it out of place (`c = c.scatter(...)`), "
                "which lays its result out alike in eager and in hpfun")
    if "format string passed to FakeTensor" in str(err):  # f"{loss:.3f}": a read of the value
        hint = (" — formatting a tensor's value reads it, and hpfun traces on shapes only: to log a value, return the "
                "tensor and format it after the call (`f\"{step(x, y).full().item():.3f}\"`)")
    if "UntypedStorage" in str(err) and ".set_(" in str(getattr(err, "hpfun_line", "")) + _user_where(err):
        hint = (" — set_ from a storage, or with an offset, a size and strides, points a tensor at memory as a "
                "layout hpfun cannot follow: pass the tensor itself (`a.set_(b)`), take a view (`b.as_strided(size, "
                "stride, offset)`), or copy the values (`a.copy_(b)`)")
    if "'Sparse" in str(err) or "Sparse" in kind:
        hint = (" — a sparse tensor: nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) make their weight's "
                "gradient sparse, and hpfun shards dense tensors only; pass sparse=False (the same update, with a "
                "dense gradient)")
    if isinstance(err, KeyError) and err.args and isinstance(err.args[0], torch.Tensor):
        hint = (" — a dict keyed by tensors (a parameter's learning-rate scale, one optimizer per parameter) is "
                "looked up with a parameter inside the function, and the trace runs on stand-ins for the parameters, "
                "which are not its keys: key it by the parameter's name (`scales[name]` over "
                "`model.named_parameters()`), or keep the number on the parameter (`p.lr_scale = 0.5`, read as "
                "`p.lr_scale`), which hpfun reads at every call")
    if "saved tensor hooks" in str(err):  # torch.utils.checkpoint under torch.func.grad
        hint = " — for activation checkpointing inside a sharded function use hpfun.checkpoint(block)(x)"
    if ".numpy() is not supported" in str(err):
        hint = (" — hpfun traces on shapes only, so a tensor's values are not there to copy into NumPy: compute with "
                "torch ops inside the function, or return the tensor and call .numpy() on the result after the call")
    if "process group" in str(err).lower() and any(os.sep + "distributed" + os.sep in f.filename for f in
                                                    traceback.extract_tb(err.__traceback__)):
        hint = (" — a sharded function is written on whole tensors, and hpfun inserts the collectives its layouts "
                "need: leave torch.distributed calls (all_reduce, broadcast...) out of it, and say where a value "
                "should be split or summed with in_specs, out_specs or hpfun.constrain")
    if "does not require grad and does not have a grad_fn" in str(err):
        hint = (" — nothing it was computed from requires grad here. Arguments are traced as values, without "
                "requires_grad (their .grad would be a write to the caller's tensor): to differentiate with respect "
                "to one, use torch.func.grad "
                "(`torch.func.grad(loss_fn)(x)`), or hold the tensor in a module as a parameter, whose gradient "
                "hpfun writes back")
    if "failed in the TorchScript interpreter" in str(err):
        hint = (" — a @torch.jit.script function runs in TorchScript's interpreter, which hpfun cannot "
                "trace into (reading a value, `int(t)`, fails there): run with PYTORCH_JIT=0 in the environment "
                "(scripted functions then run as Python), or call the Python function it was made from")
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if isinstance(err, KeyError) and err.args and isinstance(err.args[0], torch.Tensor):  # (not the stand-in's repr)
        key = err.args[0]
        first = f"a tensor of shape {tuple(key.shape)}"
    if first.startswith("Could not run") and ". " in first:  # not the dispatcher's list of every backend
        first = first[:first.index(". ") + 1]
    return f"{kind}{where}: {first}{hint}"
