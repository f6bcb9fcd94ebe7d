"""Capture: trace a global-view function into one functional fx graph of core ATen ops.

`make_fx` runs the function on fake tensors of the global shapes (nothing is computed),
functionalized (no in-place ops) and decomposed to core ATen. On top of torch's core
decompositions, softmax/log_softmax and the NLL loss are decomposed too: as reductions,
pointwise ops and gather/scatter, their general rules shard them along any dim (the
vocab-parallel loss), where a fused kernel would need its dim whole.
"""

from __future__ import annotations

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
]


def decompositions() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(_DECOMPOSE_TOO))
    return table


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


def fake_inputs(metas) -> tuple[FakeTensorMode, list]:
    """Fake tensors of the given (shape, dtype) pairs in one fake mode."""
    mode = FakeTensorMode()
    with mode:
        return mode, [torch.empty(shape, dtype=dtype) for shape, dtype in metas]


def capture(flat_fn, metas) -> torch.fx.GraphModule:
    """Trace `flat_fn(*tensors) -> list of tensors` on fake tensors with the given (shape, dtype)."""
    _, fakes = fake_inputs(metas)
    traced = make_fx(
        torch.func.functionalize(flat_fn, remove="mutations"),
        decomposition_table=decompositions(),
        tracing_mode="fake",
        record_stack_traces=True,
    )
    try:
        with mock.patch.object(proxy_tensor.PythonKeyTracer, "_filter_traceback_frames", _innermost_user_frame):
            gm = traced(*fakes)
    except CaptureError:
        raise
    except Exception as err:  # re-raised with the user's line: tracing errors come in many types
        raise CaptureError(_describe(err)) from err
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


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
