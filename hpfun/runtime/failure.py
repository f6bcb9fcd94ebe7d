"""When the per-shard program raises: which op of the user's program failed, where, on which
layouts. The op's error is attached as the cause; the user sees an hpfun error first."""

from __future__ import annotations

import linecache
import re
import traceback

import torch

from hpfun.capture import user_line
from hpfun.errors import ExecutionError, Problem, op_name

_ASSIGNED = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=")


class _Finder(torch.fx.Interpreter):
    def run_node(self, n):
        self.current = n
        return super().run_node(n)


def rerun(module: torch.fx.GraphModule, args) -> torch.fx.Node | None:
    """The node that raises when `module` (local work, no collective) runs again on `args`."""
    finder = _Finder(getattr(module, "_orig_mod", module))
    finder.current = None
    try:
        with torch.no_grad():
            finder.run(*args)
    except Exception:  # the failure we are locating; any exception type the op may raise
        return finder.current
    return None


def from_traceback(module: torch.fx.GraphModule, err: BaseException) -> torch.fx.Node | None:
    """The node whose line of `module`'s generated code raised (found without running again,
    which on a distributed mesh would start collectives the other ranks do not join)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "eval_with_key" in f.filename]
    if not frames:
        return None
    match = _ASSIGNED.match(linecache.getline(frames[-1].filename, frames[-1].lineno or 0))
    if match is None:
        return None
    return next((n for n in module.graph.nodes if n.name == match.group(1)), None)


def execution_error(node: torch.fx.Node | None, where: str, err: BaseException) -> ExecutionError:
    """An hpfun error naming the failed op, the user's line, the layouts it ran with."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if node is None:
        return ExecutionError(Problem(where, f"{type(err).__name__}: {first}", _FIX))
    origin = node.meta.get("hpfun_origin")
    op = op_name(node.target).replace("torch.ops.", "") if node.op == "call_function" else node.op
    what = f"{op} ({'node ' + origin if origin else 'a step redistributing a value'})"
    layouts = node.meta.get("hpfun_inputs")
    if layouts is not None:
        what += f" reading {_layouts_text(layouts)} -> {_layouts_text(node.meta.get('hpfun_layout'))}"
    line = user_line(node.meta.get("stack_trace"))
    place = f"{where}, {line}" if line else where
    return ExecutionError(Problem(place, f"{what}: {type(err).__name__}: {first}", _mixed_dtypes(node, first) or _FIX))


def _mixed_dtypes(node: torch.fx.Node, message: str) -> str | None:
    """The fix for an op torch refused for its inputs' mixed dtypes (`int64 @ float32`): a mix
    the unsharded function has too (the trace's fake kernels let it through), not hpfun's."""
    if "dtype" not in message.lower() and "scalar type" not in message.lower():
        return None
    dtypes = [a.meta["hpfun_global"][1] for a in node.args
              if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("hpfun_global"), tuple)]
    if len(set(dtypes)) < 2:
        return None
    names = [str(d).replace("torch.", "") for d in dict.fromkeys(dtypes)]
    return (f"its inputs are {', '.join(names[:-1])} and {names[-1]}, a mix torch refuses for this op, unsharded too: "
            "cast them to one dtype in the function (e.g. `x.to(w.dtype)`, or `.float()` on an integer tensor)")


_FIX = ("if the function runs unsharded on these inputs, this is a bug in hpfun: please report it with "
        "print(f.lower(*args)); the op's own error is attached as the cause")


def _layouts_text(x) -> str:
    """Layouts as the report writes them, through the tuples and lists of a multi-output op
    (a foreach op's list of outputs: `[[R], [R]]`); `-` for an output that is not a tensor."""
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_layouts_text(v) for v in x)
        return f"[{inner}]" if isinstance(x, list) else inner
    return "-" if x is None else x.placements_str()
