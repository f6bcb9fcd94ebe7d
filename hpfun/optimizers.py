"""torch.optim's step, traced: the numbers eager reads into Python become float64 tensors.

A trace runs on shapes only, so a step cannot read a tensor's value into Python as eager does.

- Every optimizer reads its step count (a float32 tensor) with `_get_value`: while hpfun
  traces, it reads a float64 copy instead (`exact_step_scalars`), the same integer, and the
  double-precision arithmetic eager does on the Python number is recorded on it. Such values
  (and the lifted hyperparameters standing in for floats) promote as Python floats do
  (`PythonFloats`, `mark_float`).
- `torch.optim.Adafactor` also reads, per parameter, its step count and the norms of the
  parameter and of its update with `.item()` (`max(eps2, param.norm().item() / ...)`). While
  hpfun traces, its per-parameter step is the one below (`traced_steps`): each read is a float64
  0-d tensor, `min`/`max` are `clamp`, the rest is torch's step op for op. Both of its
  implementations are traced as this loop (capture splits a foreach op per tensor anyway; the
  foreach path does the same arithmetic per tensor). `tests/test_modules.py` checks it against
  eager within 1e-12 on float64, data parallel and Megatron-split, and under a schedule.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.optim import sgd as _sgd_module


class PythonFloats:
    """The float64 0-d tensors a trace holds in place of Python floats: lifted hyperparameters'
    stand-ins, an optimizer's step count read as a number (`mark_float`), and what arithmetic
    on them alone gives. Eager's Python float does not promote a tensor (`lr / 0.9` keeps a
    float32 tensor learning rate float32, and an integer tensor times 0.5 is the default float
    dtype); a float64 0-d tensor promotes another 0-d one, and any integer tensor, to float64.
    `promoted` casts such a stand-in first, as torch casts the float. Stand-ins are kept alive
    while the trace runs, so their ids stay theirs."""

    active: "PythonFloats | None" = None

    def __init__(self, ids=()):
        self.ids = set(ids)
        self._kept: list = []

    def __contains__(self, x) -> bool:
        return id(x) in self.ids

    def add(self, x: torch.Tensor) -> None:
        self.ids.add(id(x))
        self._kept.append(x)

    def promoted(self, args: tuple) -> tuple:
        a, b = args
        if (a in self) == (b in self):
            return args
        w, other = (a, b) if a in self else (b, a)
        if other.is_floating_point() and other.dim() == 0 and other.dtype != w.dtype:
            w = w.to(other.dtype)
        elif not other.is_floating_point() and not other.is_complex():
            w = w.to(torch.get_default_dtype())
        else:
            return args
        return (w, other) if a in self else (other, w)


def mark_float(x: torch.Tensor) -> torch.Tensor:
    """`x` (a float64 0-d tensor traced where eager reads a Python number) joins the trace's
    `PythonFloats`, while an optimizer's step is traced (`lift.ScalarSigns` holds them)."""
    if PythonFloats.active is not None:
        PythonFloats.active.add(x)
    return x


def read_as_float(x: torch.Tensor) -> torch.Tensor:
    """A 0-d tensor where eager reads its value into a Python float (`.item()`, `_get_value`;
    float32 or lower is exact in a double): a float64 copy in the trace's `PythonFloats`."""
    return mark_float(x.to(torch.float64))


@contextlib.contextmanager
def exact_step_scalars():
    """While compiling, torch.optim reads its step count (a float32 tensor) as a tensor, not as
    the Python number eager reads, and computes its bias corrections in float32 (1e-7 away from
    eager's double-precision ones). Traced, it reads the count as a float64 tensor instead: the
    same integer, and the same double-precision arithmetic as eager, now recorded in the graph;
    it promotes as the Python number does (`PythonFloats`)."""
    from torch.optim import optimizer

    original = optimizer._get_value

    def exact(x):
        if isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point():
            return read_as_float(x)
        return original(x)

    modules = [m for name, m in list(sys.modules.items()) if name.startswith("torch.optim") and m is not None
               and getattr(m, "_get_value", None) is original]
    for m in modules:
        m._get_value = exact
    try:
        yield
    finally:
        for m in modules:
            m._get_value = original





def _adafactor_step(params, grads, row_vars, col_vars, variances, state_steps, grad_scale, found_inf, *, d, lr,
                    beta2_decay, weight_decay, eps1, eps2, maximize, has_complex) -> None:
    """`torch.optim._adafactor._single_tensor_adafactor` with its Python reads traced."""
    if grad_scale is not None or found_inf is not None:
        raise AssertionError("Grad scaling should occur outside of optimizer.step()")
    if isinstance(lr, torch.Tensor) and lr.dim() != 0:
        lr = lr.squeeze()
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        step_t = state_steps[i]
        row_var, col_var, variance = row_vars[i], col_vars[i], variances[i]
        if eps1 is None:
            eps1 = torch.finfo(param.dtype).eps
        step_t += 1
        step = read_as_float(step_t)
        one_minus_beta2_t = step**beta2_decay
        rho_t = torch.clamp(1 / step**0.5, max=lr)  # min(lr, 1 / sqrt(step))
        alpha = torch.clamp(read_as_float(param.norm(2)) / (param.numel() ** 0.5), min=eps2) * rho_t
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        if grad.dim() > 1:
            if row_var is None or col_var is None:
                raise AssertionError("row_var and col_var should be defined when grad is multidimensional")
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            row_var.lerp_(row_mean, one_minus_beta2_t)
            col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
            col_var.lerp_(col_mean, one_minus_beta2_t)
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            if variance is None:
                raise AssertionError("variance should be defined when grad is a vector")
            variance.lerp_(grad * grad, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        denom = torch.clamp(read_as_float(update.norm(2)) / ((update.numel() ** 0.5) * d), min=1.0)
        param.add_(update, alpha=-alpha / denom)


# ids of the stand-ins of parameters whose SGD group eager steps by its foreach path, which a
# trace takes the for-loop path of (a lifted learning rate): filled by `lift.Substitution`
FOREACH_SGD: set = set()
_SINGLE_TENSOR_SGD = _sgd_module._single_tensor_sgd


def _sgd_step(params, grads, momentum_buffer_list, grad_scale, found_inf, *, weight_decay, momentum, lr, dampening,
              nesterov, maximize, has_sparse_grad) -> None:
    """`torch.optim.sgd._single_tensor_sgd`, then what the foreach path eager takes also does to
    the gradients of the parameters in `FOREACH_SGD`: with Nesterov momentum (no weight decay,
    not maximizing) it adds `momentum * buf` into each `p.grad` in place, which code reading the
    gradients after the step sees."""
    _SINGLE_TENSOR_SGD(params, grads, momentum_buffer_list, grad_scale, found_inf, weight_decay=weight_decay,
                       momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov, maximize=maximize,
                       has_sparse_grad=has_sparse_grad)
    if not FOREACH_SGD or not nesterov or maximize or weight_decay != 0 or momentum == 0:
        return
    with torch.no_grad():
        for param, grad, buf in zip(params, grads, momentum_buffer_list, strict=True):
            if id(param) in FOREACH_SGD and buf is not None:
                grad.add_(buf, alpha=momentum)


_TRACED = {"torch.optim._adafactor": {"_single_tensor_adafactor": _adafactor_step,
                                       "_multi_tensor_adafactor": _adafactor_step},
           "torch.optim.sgd": {"_single_tensor_sgd": _sgd_step}}


@contextlib.contextmanager
def traced_steps():
    """While a trace runs: the optimizer steps above in place of torch's (modules not imported
    yet are left alone: no step of theirs can run)."""
    swapped = []
    for module_name, functions in _TRACED.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name, replacement in functions.items():
            swapped.append((module, name, getattr(module, name)))
            setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in reversed(swapped):
            setattr(module, name, original)
