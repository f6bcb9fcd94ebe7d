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
        self.inputs = self.fetch_args_kwargs_from_env(n)
        return super().run_node(n)


def rerun(module: torch.fx.GraphModule, args) -> tuple:
    """(the node that raises when `module` (local work, no collective) runs again on `args`,
    the (args, kwargs) it raised on), or (None, None)."""
    finder = _Finder(getattr(module, "_orig_mod", module))
    finder.current = finder.inputs = None
    try:
        with torch.no_grad():
            finder.run(*args)
    except Exception:  # the failure we are locating; any exception type the op may raise
        return finder.current, finder.inputs
    return None, None


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


def execution_error(node: torch.fx.Node | None, where: str, err: BaseException, inputs=None) -> ExecutionError:
    """An hpfun error naming the failed op, the user's line, the layouts it ran with (`inputs`:
    the (args, kwargs) it raised on, where known)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if node is None:
        return ExecutionError(Problem(where, f"{type(err).__name__}: {first}", _FIX))
    origin, step_of = node.meta.get("hpfun_origin"), node.meta.get("hpfun_step_of")
    op = op_name(node.target).replace("torch.ops.", "") if node.op == "call_function" else node.op
    what = f"{op} ({'node ' + origin if origin else f'a step of node {step_of}' if step_of else 'a step redistributing a value'})"
    layouts = node.meta.get("hpfun_inputs")
    if layouts is not None:
        what += f" reading {_layouts_text(layouts)} -> {_layouts_text(node.meta.get('hpfun_layout'))}"
    line = user_line(node.meta.get("stack_trace"))
    place = f"{where}, {line}" if line else where
    checked = node.op == "call_function" and (node.target is torch.ops.aten._assert_async.msg or
                                              str(node.target) == "hpfun.checked.default") or \
        _out_of_range_of_whole(node, first)
    fix = ("hpfun checks here what torch checks (an index within its dim, a class id within num_classes): the "
           "unsharded function raises on these values too: fix the values" if checked else
           _mixed_dtypes(node, first) or _refused_alike(node, err, first, inputs) or _FIX)
    return ExecutionError(Problem(place, f"{what}: {type(err).__name__}: {first}", fix))


def _out_of_range_of_whole(node: torch.fx.Node, message: str) -> bool:
    """An index out of range, by the kernel's own check, of a tensor the op read whole
    (replicated: `gather` of an index past the table's end): the unsharded function raises it too."""
    if "out of bounds" not in message and "out of range" not in message:
        return False
    if "hpfun_inputs" not in node.meta and (match := _OUT_OF_BOUNDS.search(message)) is not None:
        return _whole_in_a_step(node, int(match.group(1)), int(match.group(2)))
    layouts = node.meta.get("hpfun_inputs") or ()
    if not layouts or not hasattr(layouts[0], "shard_axes"):
        return False
    if layouts[0].is_replicated:
        return True
    # a lookup along dims each rank holds whole (gather along dim 0 of a table split by columns)
    name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", "").rstrip("_")
    meta = node.args[0].meta.get("hpfun_global") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(meta, tuple) or len(node.args) < 2:
        return False
    if name == "embedding":  # (the table's rows)
        dims = [0]
    elif name in ("index", "index_put") and isinstance(node.args[1], (list, tuple)):  # (`t[i]`, `t[i] = v`: the
        # dims indexed)
        dims = [d for d, i in enumerate(node.args[1]) if i is not None]
    elif name in _LOOKUPS_ALONG_A_DIM and type(node.args[1]) is int:
        dims = [node.args[1] % max(len(meta[0]), 1)]
    else:
        return False
    return not any(layouts[0].shard_axes(d) for d in dims)


_OUT_OF_BOUNDS = re.compile(r"out of bounds for dimension (-?\d+) with size (\d+)")


def _whole_in_a_step(node: torch.fx.Node, dim: int, size: int) -> bool:
    """An index out of range in one of the steps a rule emits for an op (`t[rows, cols] = v` on a
    table split by columns): along a dim of the op's first input that each rank holds whole, at
    that dim's global size, the unsharded function raises it too."""
    layouts, meta = node.meta.get("hpfun_step_inputs") or (), node.meta.get("hpfun_step_global")
    if not layouts or not hasattr(layouts[0], "shard_axes") or not isinstance(meta, tuple):
        return False
    shape = meta[0]
    if not -len(shape) <= dim < len(shape):
        return False
    return shape[dim] == size and not layouts[0].shard_axes(dim % len(shape))


_LOOKUPS_ALONG_A_DIM = frozenset({"gather", "scatter", "scatter_add", "scatter_reduce", "index_select", "index_add",
                                  "index_copy", "index_fill", "index_reduce"})


def _refused_alike(node: torch.fx.Node, err: BaseException, first: str, inputs=None) -> str | None:
    """The fix where the op raises the same on zeros of its inputs' local shapes and dtypes
    (`bool_mask - 0.5`, `int ** -1`, `gcd` of floats): torch refuses the op for what it is given,
    whatever the values and layouts, so the unsharded function raises it too (the trace's fake
    kernels skip such checks), not hpfun."""
    if node.op != "call_function" or not callable(node.target):
        return None
    budget = [1 << 22]

    def zeros(a):
        if a.op == "get_attr" and a.graph.owning_module is not None:  # a constant of the program: itself
            value = getattr(a.graph.owning_module, a.target, None)
            if isinstance(value, torch.Tensor) and value.numel() <= budget[0]:
                return value
        meta = a.meta.get("hpfun_global")
        layout = a.meta.get("hpfun_layout")
        if not isinstance(meta, tuple) or not hasattr(layout, "local_shape"):
            raise LookupError
        shape = tuple(layout.local_shape(meta[0]))
        budget[0] -= max(1, torch.Size(shape).numel())
        if budget[0] < 0:
            raise LookupError
        return torch.zeros(shape, dtype=meta[1])

    try:
        if inputs is not None:  # the values it ran on: zeros of their shapes and dtypes, contiguous (a block's
            # strides are the per-shard program's, not the unsharded function's: a kernel refusing them is hpfun's)
            args, kwargs = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=t.device), inputs)
        else:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), zeros)
    except LookupError:
        return None
    try:
        with torch.no_grad():
            node.target(*args, **kwargs)
    except Exception as again:  # (the op's own exception type, whatever it is)
        again_first = str(again).strip().splitlines()[0] if str(again).strip() else ""
        if type(again) is type(err) and again_first == first:
            return ("torch refuses this op for the inputs it is given, whatever their values: the unsharded function "
                    "raises the same at this line (the trace does not run torch's checks); fix the function (a cast, "
                    "another op)")
    return None


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
