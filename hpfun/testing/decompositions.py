"""Audit capture's decompositions against torch's own kernels.

hpfun traces a function into core ATen ops through a table of decompositions (torch's core
table, less what capture keeps whole, plus hpfun's own: `hpfun.capture.decompositions`). A rule
is checked against the unsharded run of the *decomposed* op, so a decomposition that computes
something else than the kernel it replaces is invisible to `hpfun.validate`: both sides agree,
and both are wrong. torch 2.13's `multilabel_margin_loss_forward` was one (it also counted the
class slots after the first -1).

This audit runs every OpInfo of torch's test suite on CPU in float64, a few samples each: the
eager kernel against the function traced through capture's table and run, outputs and the
vector-Jacobian product with a fixed cotangent (so backward formulas and their decompositions
are covered too). Random ops are skipped (their draws differ by construction); a sample whose
trace raises (a value read into Python, an output shape read from the data) is listed as a
capture problem, not as wrong.

    python -m hpfun.testing.decompositions [OP_NAME ...]
"""

from __future__ import annotations

import math
import sys
import unittest.mock
import warnings
from typing import Iterable

import attrs
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

# OpInfos whose results depend on random draws or on the order the kernel visits elements
_SKIP = ("nn.functional.dropout", "bernoulli", "normal", "rand", "multinomial", "uniform", "cauchy", "exponential",
         "geometric", "log_normal", "empty", "new_empty", "nn.functional.rrelu", "nn.functional.feature_alpha",
         "nn.functional.alpha_dropout", "nn.functional.fractional", "sparse", "to_sparse", "nonzero_static",
         "nn.functional.scaled_dot_product_attention", "nn.functional.multi_head_attention_forward")


@attrs.frozen
class Finding:
    op: str  # the OpInfo's name
    sample: int
    kind: str  # "forward" or "vjp": wrong values; "capture": the trace raised
    detail: str

    def __str__(self) -> str:
        return f"{self.op} sample {self.sample}: {self.kind}: {self.detail}"


@attrs.frozen
class Report:
    findings: tuple
    forward: int  # samples compared
    vjp: int

    @property
    def wrong(self) -> list[Finding]:
        return [f for f in self.findings if f.kind in ("forward", "vjp")]


def _close(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            if a.element_size() == 1:
                a, b = a.float(), b.float()
            return torch.allclose(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)
        return torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def _difference(a, b) -> str:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.numel() \
            and (a.is_floating_point() or a.is_complex()):
        return f"{(a.double() - b.double()).abs().max().item():.3g}"
    return f"{a!r:.40} vs {b!r:.40}"


def audit(names: Iterable[str] | None = None, table: dict | None = None, samples: int = 3) -> Report:
    """Compare the eager kernels of the OpInfos named (all by default) with their traces
    through `table` (capture's decompositions by default)."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_methods_invocations import op_db

    from hpfun.capture import decompositions

    table = decompositions() if table is None else table
    names = set(names) if names else None
    findings, n_fwd, n_vjp = [], 0, 0
    # OpInfo's sample iterators look for the calling unittest method with inspect.stack(): none here
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]), \
            unittest.mock.patch.object(common_utils, "extract_test_fn", lambda: None):
        torch.manual_seed(0)
        warnings.simplefilter("ignore")
        for info in op_db:
            if names is not None and info.name not in names or names is None and info.name.startswith(_SKIP):
                continue
            try:
                drawn = list(info.sample_inputs("cpu", torch.float64, requires_grad=info.supports_autograd))[:samples]
            except Exception:  # noqa: BLE001 - an OpInfo without float64 samples
                continue
            for k, sample in enumerate(drawn):
                result = _one(info, sample, table)
                if result is None:
                    continue
                compared, found = result
                n_fwd += compared >= 1
                n_vjp += compared >= 2
                findings += [Finding(info.name, k, kind, detail) for kind, detail in found]
    return Report(tuple(findings), n_fwd, n_vjp)


def _one(info, sample, table):
    """(how many of forward and vjp were compared, [(kind, detail)]), or None when eager
    itself does not run the sample."""
    flat, spec = pytree.tree_flatten(((sample.input, *sample.args), sample.kwargs))
    where = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

    def fn(*tensors):
        leaves = list(flat)
        for i, t in zip(where, tensors, strict=True):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return info.op(*args, **kwargs)

    tensors = [flat[i].detach() for i in where]
    try:
        eager = fn(*tensors)
    except Exception:  # noqa: BLE001 - a sample meant to raise
        return None
    try:
        got = make_fx(fn, decomposition_table=table, tracing_mode="fake")(*tensors)(*tensors)
    except Exception as err:  # noqa: BLE001 - reported
        return 0, [("capture", f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")]
    want, have = pytree.tree_leaves(eager), pytree.tree_leaves(got)
    try:
        same = len(want) == len(have) and all(_close(a, b) for a, b in zip(want, have))
    except Exception:  # noqa: BLE001 - a dtype the comparison cannot take: not counted
        return None
    if not same:
        return 1, [("forward", ", ".join(_difference(a, b) for a, b in zip(want, have)))]
    outputs = [o for o in want if isinstance(o, torch.Tensor) and o.is_floating_point()]
    inputs = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    if not info.supports_autograd or not outputs or not inputs:
        return 1, []
    g = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in outputs]
    n = len(tensors)

    def vjp(*given):
        ts, cot = list(given[:n]), given[n:]

        def weighted(*xs):
            for i, x in zip(inputs, xs, strict=True):
                ts[i] = x
            outs = [o for o in pytree.tree_leaves(fn(*ts)) if isinstance(o, torch.Tensor) and o.is_floating_point()]
            return sum((o * c).sum() for o, c in zip(outs, cot, strict=True))

        return torch.func.grad(weighted, argnums=tuple(range(len(inputs))))(*[ts[i] for i in inputs])

    try:
        want = pytree.tree_leaves(vjp(*tensors, *cotangents))
    except Exception:  # noqa: BLE001 - not differentiable in eager either
        return 1, []
    try:
        have = pytree.tree_leaves(make_fx(vjp, decomposition_table=table, tracing_mode="fake")(*tensors, *cotangents)
                                  (*tensors, *cotangents))
    except Exception as err:  # noqa: BLE001 - reported
        return 1, [("capture", f"backward: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")]
    if len(want) != len(have) or not all(_close(a, b) for a, b in zip(want, have)):
        return 2, [("vjp", ", ".join(_difference(a, b) for a, b in zip(want, have)))]
    return 2, []


def main(argv=None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or None
    report = audit(names)
    for finding in report.findings:
        print(finding)
    print(f"{report.forward} forward and {report.vjp} vjp samples compared: {len(report.wrong)} wrong, "
          f"{len(report.findings) - len(report.wrong)} that capture cannot trace")
    return 1 if report.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
