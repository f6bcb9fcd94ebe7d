"""`Sharded`: what crosses the boundary of a sharded function. A record, not a tensor subclass.

Also what moves one: `redistribute` (a Sharded value to another layout, by the planner's
collectives) and `rank_block` (a rank's block of a Sharded value or of a global tensor).
"""

from __future__ import annotations

import functools
import math

import attrs
import torch

from hpfun.drawing import Visualization
from hpfun.errors import LayoutError, Problem, SpecError
from hpfun.execute import run
from hpfun.layout import Layout, Partial
from hpfun.lower import LowerContext, Program
from hpfun.runtime import groups
from hpfun.runtime.distributed import runtime_for


SPENT_HEADLINE = "a donated value read again"


READ_HEADLINE = "cannot read this Sharded value that way"


def spent_error(values) -> SpecError | None:
    """One error naming every value in `values` a call consumed (`donate_argnums`), or None."""
    problems = [x.shards.problem() for x in values if type(x) is Sharded and isinstance(x.shards, _Spent)]
    return SpecError(problems, headline=SPENT_HEADLINE) if problems else None


class _Spent(tuple):
    """The shards of a value a call consumed (`donate_argnums`): any read raises."""

    def __new__(cls, path: str):
        out = super().__new__(cls)
        out.path = path
        return out

    def problem(self) -> Problem:
        return Problem(self.path, "was donated to a call (donate_argnums), which consumed its shards",
                       "use the value that call returned, or leave this argument out of donate_argnums")

    def _fail(self, *args):
        raise SpecError(self.problem(), headline=SPENT_HEADLINE)

    __getitem__ = __iter__ = __len__ = _fail


@attrs.frozen(eq=False)
class Sharded:
    """A global tensor laid out on a mesh: `shards[r]` is rank r's local tensor.

    >>> import hpfun, torch
    >>> mesh = hpfun.Mesh.simulated((2,), ("dp",))
    >>> x = hpfun.Sharded.from_global(torch.arange(4.0), hpfun.P("dp").to_layout(mesh, 1))
    >>> [s.tolist() for s in x.shards], x.full().tolist()
    ([[0.0, 1.0], [2.0, 3.0]], [0.0, 1.0, 2.0, 3.0])
    """

    layout: Layout
    global_shape: tuple[int, ...] = attrs.field(converter=tuple)
    shards: tuple[torch.Tensor, ...] = attrs.field(converter=tuple)  # one per rank; this rank's only when distributed
    # what a program cache key records of this value, interned: `signature()`, set when first asked
    token: int | None = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self):
        if not isinstance(self.layout, Layout) or not all(isinstance(s, torch.Tensor) for s in self.shards):
            raise LayoutError(f"Sharded(layout, global_shape, shards) takes a Layout and one tensor per rank, got "
                              f"{type(self.layout).__name__} and {sorted({type(s).__name__ for s in self.shards})} "
                              "(Sharded.from_global(tensor, layout) splits a global tensor)")
        mesh = self.layout.mesh
        expected = mesh.size if mesh.runtime == "simulated" else 1
        if len(self.shards) != expected:
            raise LayoutError(f"a Sharded value on {mesh} ({mesh.runtime}) needs {expected} shard(s), got {len(self.shards)}")
        if len({s.dtype for s in self.shards}) > 1:
            raise LayoutError(f"shards of one Sharded value have different dtypes: {[s.dtype for s in self.shards]}")
        if any(isinstance(p, Partial) and p.reduce in ("max", "min") for p in self.layout.placements) and \
                self.shards and self.shards[0].is_complex():
            raise LayoutError(f"a Partial(max/min) placement of {self.shards[0].dtype} values: complex numbers have "
                              "no order; give them as Partial(sum) or replicated")
        if any(isinstance(p, Partial) and p.reduce == "avg" for p in self.layout.placements) and self.shards and \
                not (self.shards[0].is_floating_point() or self.shards[0].is_complex()):
            raise LayoutError(f"a Partial(avg) placement of {self.shards[0].dtype} values: their mean is no "
                              f"{self.shards[0].dtype} (programs would divide it out of the integers); give the "
                              "blocks as Partial(sum) of the values divided beforehand, or cast them to a float dtype")
        local = self.layout.local_shape(self.global_shape)
        bad = [r for r, s in enumerate(self.shards) if tuple(s.shape) != local]
        if bad and mesh.runtime == "distributed":  # the one shard is this rank's
            raise LayoutError(f"this rank's shard has shape {tuple(self.shards[0].shape)}, not the local shape {local} "
                              f"of {self.layout} for global shape {tuple(self.global_shape)} (rank "
                              f"{_this_rank(mesh)}, coords {mesh.coords(_this_rank(mesh))})")
        if bad:
            raise LayoutError(f"shards of ranks {bad} ({[tuple(self.shards[r].shape) for r in bad]}) do not have the "
                              f"local shape {local} of {self.layout}")

    @classmethod
    def from_global(cls, tensor: torch.Tensor, layout: Layout) -> "Sharded":
        """Split a global tensor by `layout` (Partial axes: rank 0 of the axis holds the value for sum).

        On a distributed mesh every rank passes the same global tensor and keeps its own block.
        """
        if not isinstance(tensor, torch.Tensor):
            raise SpecError(Problem("tensor", f"is {type(tensor).__name__}, not a torch.Tensor", "pass the global tensor"))
        layout = _a_layout(layout, tensor.ndim, "Sharded.from_global")
        mesh = layout.mesh
        ranks = range(mesh.size) if mesh.runtime == "simulated" else [_this_rank(mesh)]
        # copies: the value is its own, as a sharded function's result is (never the caller's tensor,
        # whatever the layout: writing one must not write the other)
        shards = [local_block(tensor, layout, mesh.coords(r), partial_zeros=True).clone(memory_format=torch.contiguous_format)
                  for r in ranks]
        return cls(layout, tuple(tensor.shape), tuple(shards))

    @classmethod
    def from_local(cls, tensor: torch.Tensor, layout: Layout, global_shape) -> "Sharded":
        """This rank's shard of a value laid out by `layout` on a distributed mesh.

        Ranks that differ only along Replicate axes must pass identical tensors, Partial terms
        included: rules rely on it (a product of values Partial over different axes is Partial
        over both only if each factor's terms repeat along the other's axis)."""
        if not isinstance(tensor, torch.Tensor):
            raise SpecError(Problem("tensor", f"is {type(tensor).__name__}, not a torch.Tensor", "pass this rank's block"))
        layout = _a_layout(layout, len(tuple(global_shape)), "Sharded.from_local")
        if layout.mesh.runtime != "distributed":
            raise LayoutError("from_local is for distributed meshes; in a simulation give all shards: "
                              "Sharded(layout, global_shape, shards) or Sharded.from_global")
        return cls(layout.normalized(len(global_shape)), tuple(global_shape), (tensor,))

    def _spend(self, path: str) -> None:
        """This value was consumed by a call that donated it (`donate_argnums`): its shards go
        with it, and reading them again is an error naming the argument."""
        if not isinstance(self.shards, _Spent):
            object.__setattr__(self, "shards", _Spent(path))

    @property
    def spent(self) -> bool:
        """Whether a call consumed this value (`hpfun.shard(..., donate_argnums=...)`)."""
        return isinstance(self.shards, _Spent)

    def signature(self) -> int:
        """(layout, global shape, dtype) as a small interned token: compared and hashed at C speed
        by the program cache of a sharded function, called with this value again and again."""
        if self.token is None:
            object.__setattr__(self, "token", signature(self.layout, self.global_shape, self.dtype))
        return self.token

    def __getstate__(self) -> dict:
        """Pickled without its token: tokens are this process's (another one interns anew)."""
        return {"layout": self.layout, "global_shape": self.global_shape, "shards": self.shards}

    def __setstate__(self, state: dict) -> None:
        for name, value in (state | {"token": None}).items():
            object.__setattr__(self, name, value)

    @property
    def local(self) -> torch.Tensor:
        """This rank's shard (distributed meshes)."""
        if self.layout.mesh.runtime != "distributed":
            raise LayoutError("a simulated Sharded value has one shard per rank: use .shards[rank]")
        return self.shards[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.shards[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.global_shape

    def full(self) -> torch.Tensor:
        """The global tensor: blocks placed at their offsets, Partial terms reduced.

        On a distributed mesh this is a collective: every rank must call it.
        """
        if not isinstance(self, Sharded):  # `Sharded.full(x)` called on the class with something else
            raise SpecError(Problem("Sharded.full", f"was called on {type(self).__name__}, not a Sharded value",
                                    "call it on a Sharded value: `value.full()`; a plain tensor is already whole"))
        mesh, layout = self.layout.mesh, self.layout
        if mesh.runtime == "distributed":
            return redistribute(self, Layout.replicated(mesh)).shards[0]
        partial = layout.partial_axes
        out = torch.empty(self.global_shape, dtype=self.dtype, device=self.shards[0].device)
        blocks: dict[tuple, list[torch.Tensor]] = {}
        for r, shard in enumerate(self.shards):
            coords = mesh.coords(r)
            key = tuple(0 if a in partial else c for a, c in enumerate(coords))
            blocks.setdefault(key, []).append(shard)
        for key, terms in blocks.items():
            value = _reduce_terms(terms, [layout.placements[a] for a in partial], [mesh.shape[a] for a in partial])
            index = tuple(slice(o, o + n) for o, n in zip(layout.offsets(self.global_shape, key), value.shape, strict=True))
            out[index] = value
        return out

    def item(self):
        """The value of a one-element Sharded value as a Python number (`loss.item()`): `full()`
        then `.item()`, so on a distributed mesh every rank calls it."""
        if math.prod(self.global_shape) != 1:
            raise SpecError(Problem("Sharded.item", f"needs one element, this value has shape {tuple(self.global_shape)}",
                                    "call .full() for the tensor"), headline=READ_HEADLINE)
        return self.full().item()

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:  # int(n_tokens), as of a one-element tensor (a float one truncated)
        return int(self.item())

    def __bool__(self) -> bool:  # `if stop:` reads the value, as a tensor's does (an object was always true)
        if math.prod(self.global_shape) != 1:
            raise SpecError(Problem("bool(Sharded)", f"the truth value of a value of shape {tuple(self.global_shape)} "
                                    "is ambiguous, as a tensor's is", "reduce it first (.any() or .all(), inside the "
                                    "sharded function), or test .full()"), headline=READ_HEADLINE)
        return bool(self.item())

    def __index__(self) -> int:  # range(n), as of a one-element integer tensor
        if self.dtype.is_floating_point or self.dtype.is_complex:
            raise TypeError(f"only integer Sharded values of one element can be an index, this one is {self.dtype}")
        return int(self.item())

    def __round__(self, ndigits=None):
        return round(self.item(), ndigits)

    def __format__(self, spec: str) -> str:  # f"{loss:.3f}" formats the number, f"{x}" the record
        return format(self.item(), spec) if spec else repr(self)

    def backward(self, *args, **kwargs):
        raise SpecError(Problem("Sharded.backward", "a sharded function's outputs are not connected to autograd "
                                "outside it", "compute gradients inside the function: loss.backward() there (on "
                                "lifted parameters), or torch.func.grad of the loss"), headline=READ_HEADLINE)

    def __repr__(self) -> str:
        return f"Sharded({self.layout}, global_shape={self.global_shape}, dtype={self.dtype})"

    def _repr_html_(self) -> str:
        """Notebooks show which rank holds which block of the global tensor."""
        return Visualization(self.layout, tuple(self.global_shape), self.dtype)._repr_html_()


_SIGNATURES: dict = {}  # (layout, global shape, dtype) -> its token


def signature(layout: Layout, global_shape: tuple, dtype: torch.dtype) -> int:
    """The interned token of a Sharded value's (layout, global shape, dtype)."""
    key = (layout, tuple(global_shape), dtype)
    token = _SIGNATURES.get(key)
    if token is None:
        token = _SIGNATURES[key] = len(_SIGNATURES)
    return token


_SET_LAYOUT, _SET_SHAPE, _SET_SHARDS, _SET_TOKEN = (
    Sharded.__dict__[name].__set__ for name in ("layout", "global_shape", "shards", "token"))


def unchecked(layout: Layout, global_shape: tuple, shards: tuple, token: int | None = None) -> Sharded:
    """A Sharded value whose layout, shape and shards are known to agree, with its signature
    token if known: a program's output, as its plan says (the constructor's checks cost more
    than a cache-hit call may). Fields are set through their slots, as attrs' own __init__ does."""
    value = object.__new__(Sharded)
    _SET_LAYOUT(value, layout)
    _SET_SHAPE(value, global_shape)
    _SET_SHARDS(value, shards)
    _SET_TOKEN(value, token)
    return value


def local_block(tensor: torch.Tensor, layout: Layout, coords, partial_zeros: bool = False) -> torch.Tensor:
    """The block of a global tensor held at mesh `coords` (a view where possible)."""
    local = layout.local_shape(tensor.shape)
    if local == tuple(tensor.shape) and not (partial_zeros and layout.partial_axes):
        return tensor  # no dim split: every rank's block is the whole tensor
    block = tensor
    for d, offset in enumerate(layout.offsets(tensor.shape, coords)):
        if local[d] != tensor.shape[d]:
            block = block.narrow(d, offset, local[d])
    if partial_zeros and any(layout.placements[a].reduce == "sum" and coords[a] for a in layout.partial_axes):
        block = torch.zeros_like(block)
    return block


def rank_block(x, layout: Layout, coords, device=None, order: tuple | None = None) -> torch.Tensor:
    """The input of the rank at mesh `coords`: its shard of a Sharded value, or its block of a
    global tensor laid out by `layout`; made contiguous, as programs are traced on contiguous
    stand-ins (a kernel such as group norm requires it, and a view's sizes are only valid for
    the strides it was traced with), or laid out in the dim `order` of the stand-in it was
    traced on where that was not contiguous (a transposed argument: `Program.input_orders`)."""
    if type(x) is Sharded or isinstance(x, Sharded):
        block = x.shards[layout.mesh.rank(coords)] if layout.mesh.runtime == "simulated" else x.shards[0]
    else:
        block = local_block(x, layout, coords)
    if device is not None and block.device != device:
        block = block.to(device)
    if block.requires_grad:
        block = block.detach()
    if order is not None and len(order) == block.dim():
        laid = torch.empty_permuted(block.shape, order, dtype=block.dtype, device=block.device)
        return laid.copy_(block)
    return block.contiguous()


def redistribute(x: Sharded, layout: Layout) -> Sharded:
    """Move a `Sharded` value to another layout on the same mesh with the planner's collectives.

    >>> import hpfun, torch
    >>> mesh = hpfun.Mesh.simulated((2,), ("dp",))
    >>> x = hpfun.Sharded.from_global(torch.arange(4.0), hpfun.parse("[S(0)] on {dp: 2}"))
    >>> hpfun.redistribute(x, hpfun.parse("[R] on {dp: 2}")).shards[1].tolist()
    [0.0, 1.0, 2.0, 3.0]
    """
    if not isinstance(x, Sharded):
        raise SpecError(Problem("x", f"is {type(x).__name__}, not a Sharded value",
                                "make one with hpfun.Sharded.from_global(tensor, layout), or pass an output of a "
                                "sharded function"))
    layout = _a_layout(layout, len(x.global_shape), "redistribute")
    if layout.mesh != x.layout.mesh:
        raise SpecError(f"cannot redistribute from mesh {x.layout.mesh} to mesh {layout.mesh}")
    found = layout.problems(x.global_shape)
    if found:
        raise LayoutError([Problem(f"hpfun.redistribute to {layout}", f"{p} (global shape {tuple(x.global_shape)})",
                                   "split dims the mesh axes divide, or pad the tensor") for p in found])
    program = _redistribute_program(x.layout, layout, tuple(x.global_shape), x.dtype, x.shards[0].device)
    (shards,) = run(program, lambda coords, device: [rank_block(x, x.layout, coords, device)])
    return Sharded(layout, x.global_shape, shards)


def _a_layout(layout, ndim: int, where: str) -> Layout:
    """`layout` for a value of `ndim` dims: a Layout, or its text (`hpfun.parse`). A spec names
    no mesh, and anything else is refused saying what to pass."""
    from hpfun.layout import P, parse

    if isinstance(layout, str):
        layout = parse(layout)
        if not isinstance(layout, Layout):  # a placement or a list of them: text without a mesh
            raise SpecError(Problem(where, "takes a Layout; its text names the mesh too, as in "
                                    "\"[S(0)] on {dp: 2}\"", "write the layout with ' on {...}', or pass a Layout"))
    if isinstance(layout, Layout):
        if layout.mesh.runtime == "simulated" and (started := groups.started_like(layout.mesh)) is not None:
            # (text, or hpfun.parse without a mesh, names the mesh's shape only: under torchrun, the one started)
            layout = attrs.evolve(layout, mesh=started)
        elif layout.mesh.runtime == "simulated" and where == "Sharded.from_local" and groups.started():
            meshes = ", ".join(str(m) for m in groups.started())
            raise LayoutError(f"{where}: the layout's mesh {layout.mesh} is not one this process started ({meshes}): "
                              "name one of those, as in \"[S(0)] on " + str(groups.started()[0]) + "\"")
        return layout.normalized(ndim)
    fix = "a Layout: `P(...).to_layout(mesh, ndim)`, or its text, e.g. hpfun.parse(\"[S(0)] on {dp: 2}\")"
    if isinstance(layout, P):
        raise SpecError(Problem(where, f"takes a Layout, got the spec {layout!r}, which names no mesh", f"pass {fix}"))
    raise SpecError(Problem(where, f"takes a Layout, got {type(layout).__name__}", f"pass {fix}"))


@functools.lru_cache(maxsize=256)
def _redistribute_program(src: Layout, dst: Layout, shape: tuple, dtype: torch.dtype,
                          device: torch.device = torch.device("cpu")) -> Program:
    ctx = LowerContext(src.mesh, device=device)
    (value,) = ctx.begin(1)
    ctx.consumer = ("redistribute", "redistribute", f"{src.placements_str()} -> {dst.placements_str()}")
    ctx.graph.output([ctx.redistribute(value, src, dst, shape, dtype)])
    module = torch.fx.GraphModule(torch.nn.Module(), ctx.graph)
    return Program(src.mesh, module, (src,), (shape,), (dst,), (shape,), (dtype,), tuple(ctx.collectives),
                   device=device)


def _this_rank(mesh) -> int:
    return runtime_for(mesh).index


def _reduce_terms(terms: list[torch.Tensor], partials: list[Partial], sizes: list[int]) -> torch.Tensor:
    """The value of Partial terms: sums and averages mix (both are linear: the sum of all terms
    over the product of the averaged axes' sizes); max and min only with their own kind."""
    if not partials:
        return terms[0]
    reduces = {p.reduce for p in partials}
    stacked = torch.stack(terms)
    if reduces <= {"sum", "avg"}:
        total = stacked.sum(0)
        averaged = math.prod(n for p, n in zip(partials, sizes, strict=True) if p.reduce == "avg")
        return (total / averaged if averaged > 1 else total).to(terms[0].dtype)
    if len(reduces) > 1:
        raise LayoutError(f"cannot reduce mixed Partial placements {partials}: redistribute first")
    return stacked.amax(0) if reduces == {"max"} else stacked.amin(0)
