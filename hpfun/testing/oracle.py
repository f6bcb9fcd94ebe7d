"""The equivalence oracle: a function run sharded equals the function run on whole tensors."""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from hpfun import api
from hpfun.mesh import Mesh
from hpfun.rules import REGISTRY
from hpfun.sharded import Sharded


class ShardedMismatch(AssertionError):
    """The gathered sharded result differs from the unsharded one.

    `mesh`, `inputs` (one line per tensor argument: path, layout, shape, dtype), `output` (which
    output differs) and `detail` (the comparison's message) are kept as fields.
    """

    def __init__(self, mesh: Mesh, inputs: list[str], output: str, detail: str):
        self.mesh, self.inputs, self.output, self.detail = mesh, inputs, output, detail
        lines = [f"sharded result differs from the unsharded one at {output}", f"  mesh {mesh}"]
        lines += [f"  {line}" for line in inputs] + [f"  {line}" for line in detail.splitlines() if line.strip()]
        super().__init__("\n".join(lines))


def assert_sharded_equal(f, args, mesh: Mesh, in_specs, *, out_specs=None, rtol=None, atol=None,
                         exact: bool = False, registry=None) -> None:
    """Run `f(*args)` unsharded and through `hpfun.shard` on `mesh`; the gathered outputs must
    match: bitwise with `exact=True` (for functions that only move data), else to `rtol`/`atol`
    (torch.testing's defaults for the dtype when None). NaNs compare equal.

    `args` may hold `hpfun.Sharded` values (their layout is used, and the unsharded run gets
    `.full()`), so Partial inputs can be checked. `registry` runs with another rule registry
    (a `hpfun.rules.registry.Registry`) instead of the built-in one. Raises `ShardedMismatch`
    naming the mesh, every input's layout and the output that differs.

    >>> import torch, hpfun
    >>> mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    >>> x, w = torch.randn(8, 4), torch.randn(4, 6)
    >>> assert_sharded_equal(torch.mm, (x, w), mesh, (hpfun.P("dp", "tp"), hpfun.P("tp")))
    >>> total = hpfun.Sharded.from_global(x, hpfun.parse("[P(sum), R] on {dp: 2, tp: 2}"))
    >>> assert_sharded_equal(lambda a: a.t() * 1, (total,), mesh, None, exact=True)
    """
    if isinstance(args, (torch.Tensor, Sharded)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"assert_sharded_equal takes the arguments as a tuple, got {type(args).__name__}: "
                        f"pass (x,) for a function of one argument")
    args = tuple(args)
    expected = f(*pytree.tree_map(_whole, args, is_leaf=_is_sharded))
    sharded = api.shard(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                        registry=REGISTRY if registry is None else registry)
    got = sharded(*args)
    lowered = sharded.lower(*args)
    # every input the program reads, by path: arguments, then state the function lifted
    inputs = [f"{x['path']}: {x['layout']} global {tuple(x['shape'])} {x['dtype']}" for x in lowered.inputs]
    expected_flat, expected_tree = pytree.tree_flatten(expected)
    got_flat, got_tree = pytree.tree_flatten(got, is_leaf=_is_sharded)
    if expected_tree != got_tree:
        raise ShardedMismatch(mesh, inputs, "outputs", f"output structure {got_tree} differs from {expected_tree}")
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": rtol, "atol": atol}
    for i, (want, have) in enumerate(zip(expected_flat, got_flat, strict=True)):
        if not isinstance(have, Sharded):  # a Python value the function returns (a number, None)
            if not (have == want or have != have and want != want):
                raise ShardedMismatch(mesh, inputs, f"outputs[{i}]", f"got {have!r}, expected {want!r}")
            continue
        where = f"outputs[{i}] " + _describe("", have.layout, have.global_shape, have.dtype)
        _compare(want, have.full(), tolerance, lambda detail, where=where: ShardedMismatch(mesh, inputs, where, detail))


def _compare(want, have: torch.Tensor, tolerance: dict, mismatch) -> None:
    if not isinstance(want, torch.Tensor):
        raise mismatch(f"the unsharded output is {type(want).__name__}, not a tensor")
    try:
        torch.testing.assert_close(have, want, equal_nan=True, **tolerance)
    except AssertionError as err:
        raise mismatch(f"{err}\n{_worst(want, have)}".strip()) from None


def _worst(want: torch.Tensor, have: torch.Tensor) -> str:
    """Both values at the element that differs most (NaN against a number counts as most)."""
    if want.shape != have.shape or not want.numel():
        return ""
    wide = torch.complex128 if want.is_complex() or have.is_complex() else torch.float64
    a, b = want.to(wide), have.to(wide)  # complex: the distance |a - b| in the complex plane
    diff = torch.where(a.isnan() & b.isnan(), 0.0, (a - b).abs().nan_to_num(nan=math.inf, posinf=math.inf))
    index = tuple(torch.unravel_index(diff.argmax(), diff.shape)) if diff.ndim else ()
    where = tuple(int(i) for i in index)
    return f"largest difference at index {where}: expected {want[where].item()}, got {have[where].item()}"


def _describe(path: str, layout, shape, dtype) -> str:
    head = f"{path}: " if path else ""
    return f"{head}{layout.placements_str()} global {tuple(shape)} {str(dtype).replace('torch.', '')}"


def _whole(x):
    return x.full() if isinstance(x, Sharded) else x


def _is_sharded(x) -> bool:
    return isinstance(x, Sharded)
