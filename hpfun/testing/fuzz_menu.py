"""Drawing random programs for `hpfun.testing.fuzz`: the op menu and the whole-program strategy.

Each op is tried eagerly on the inputs' values as it is drawn (an op torch rejects is redrawn),
so shapes, dtypes and validity come from torch itself. Discontinuous ops (comparisons, casts to
int or bool, floor, sign, argmax, log and sqrt at 0, division by 0) and, inside a gradient, kinks
(relu, abs, max) only take *exact* values: ones computed without rounding, which are bitwise the
same whichever order a sharded program sums in, so a flipped comparison is a bug, not rounding.
A value's exactness is (g, m): multiples of 2**-g below 2**m in magnitude, exact while g + m
fits the dtype's mantissa; inputs are multiples of 1/16. Use it through `fuzz.programs()`.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import attrs
import torch
from hypothesis import strategies as st

from hpfun.layout import P
from hpfun.mesh import Mesh
from hpfun.testing.fuzz_program import NAMESPACE, Grad, Input, Op, Program
from hpfun.testing.strategies import AXIS_NAMES, layouts

# Meshes of up to 8 ranks, 1 to 3 axes; size-1 axes and 3 ranks among them.
MESH_SHAPES = ((2,), (4,), (2, 2), (2, 4), (4, 2), (8,), (2, 2, 2), (3,), (2, 1), (1, 2, 2), (2, 3), (1, 4),
               (2, 1, 2), (1,))
NONSMOOTH = frozenset({"relu", "abs", "maximum", "amax", "amin", "max_all", "min_all", "clamp", "floor", "norm",
                       "sqrt", "cummax", "max_dim", "max_pool2d", "topk", "sort"})
# A Partial value passes a product with a replicated factor, term by term: x * (a + b) = x*a + x*b
# holds for finite x only (inf * (2 - 1) = inf, but inf*2 + inf*(-1) is NaN), so a factor holding
# inf or NaN (or a divisor holding 0) may turn eager's +-inf into NaN, as in DTensor and JAX. The
# fuzzer keeps to the contract: a product is drawn only over factors that are finite (README,
# "When a Partial value passes an op"); tests/test_fuzz.py pins the case as a known limit.
PRODUCTS = frozenset({"mul", "div", "div_safe", "matmul", "einsum", "linear", "conv2d", "mul_"})
_MANTISSA = {torch.float64: 53, torch.float32: 24}
_MAX_NUMEL = 1024
FLOATS, ANY = ("float64", "float32"), ("float64", "float32", "int64", "bool")
_INF = math.inf

# ---------------------------------------------------------------------------------------------
# Exactness: (g, m) or None
# ---------------------------------------------------------------------------------------------


def _bits(n: int) -> int:
    return max(0, math.ceil(math.log2(max(n, 1))))


def _add(*exacts):
    """A sum of exact values: the finest grid, one bit more."""
    if any(e is None for e in exacts):
        return None
    return max(e[0] for e in exacts), max(e[1] for e in exacts) + 1


def _either(*exacts):
    """Values taken from several exact ones (where, cat, max): the finest grid, the largest size."""
    if any(e is None for e in exacts):
        return None
    return max(e[0] for e in exacts), max(e[1] for e in exacts)


def _mul(a, b):
    return None if a is None or b is None else (a[0] + b[0], a[1] + b[1])


def _summed(a, n: int):
    return None if a is None else (a[0], a[1] + _bits(n))


def _mean(a, n: int):
    return None if a is None or n & (n - 1) else (a[0] + _bits(n), a[1])


def _const(c: float):
    """The exactness of a constant (None unless it is a short binary fraction)."""
    for g in range(8):
        if float(c * 2**g).is_integer():
            return g, _bits(int(abs(c)) + 1)
    return None


def _finite_factor(t: torch.Tensor, divisor: bool = False) -> bool:
    if not (t.is_floating_point() or t.is_complex()):
        return True
    return bool(torch.isfinite(t).all()) and not (divisor and bool((t == 0).any()))


@contextlib.contextmanager
def _seeded(seed: int):
    """torch's generator fixed while a drawn op runs eagerly: the values it makes (rand_like,
    dropout) steer later draws, which must be the same each time hypothesis replays them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# The builder
# ---------------------------------------------------------------------------------------------


@attrs.define
class _Value:
    tensor: torch.Tensor
    exact: tuple | None
    finite: bool = True


class _Builder:
    """Draws one program, or (as a child) the body of a gradient's loss, op by op."""

    def __init__(self, draw, mesh: Mesh, sizes: tuple, seed: int, budget: int, allow_random: bool,
                 grad_depth: int = 0, parent: "_Builder | None" = None):
        self.draw, self.mesh, self.sizes, self.seed, self.budget = draw, mesh, sizes, seed, budget
        self.allow_random, self.grad_depth = allow_random, grad_depth
        self.in_grad = parent is not None
        self.inputs: list[Input] = parent.inputs if parent else []
        self.count = parent.count if parent else [0, 0]  # [ops drawn, names given], shared with children
        self.pool: dict[str, _Value] = dict(parent.pool) if parent else {}
        self.ops: list = []

    def choose(self, options):
        return self.draw(st.sampled_from(list(options)))

    def coin(self, p: float = 0.5) -> bool:
        return self.draw(st.integers(0, 99)) < p * 100

    def integer(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def recent(self, names: list[str]) -> str:
        """One of `names` (newest first), the newest half the time: programs grow deep, not wide."""
        return names[0] if self.coin(0.5) else self.choose(names)

    def left(self) -> int:
        return self.budget - self.count[0]

    def name(self) -> str:
        self.count[1] += 1
        return f"v{self.count[1]}"

    def shape(self, min_rank: int = 1, max_rank: int = 4) -> tuple:
        rank = self.choose([r for r in (2, 3, 1, 4, 0) if min_rank <= r <= max_rank])
        dims = [self.choose(self.sizes) for _ in range(rank)]
        while math.prod(dims) > _MAX_NUMEL:
            largest = dims.index(max(dims))
            dims[largest] = min(self.sizes) if dims[largest] > min(self.sizes) else 1
        return tuple(dims)

    def fresh(self, shape, dtype: str = "float64", **kw) -> str:
        """A new input of `shape` (its layout is drawn once the program is complete); rank-2+
        floats are sometimes passed column-major, and sometimes 64 times larger."""
        if dtype == "float64" and "scale" not in kw and self.coin(0.1):
            kw["scale"] = 64.0
        if len(shape) >= 2 and self.coin(0.1):
            kw["contiguous"] = False
        spec = Input(f"x{len(self.inputs)}", tuple(shape), dtype, **kw)
        self.inputs.append(spec)
        tensor = spec.value(self.seed)
        tensor = tensor if spec.contiguous else tensor.mT.contiguous().mT
        exact = {"bool": (0, 1), "int64": (0, 7 + _bits(spec.high))}.get(dtype, (4, 3 + _bits(int(spec.scale))))
        self.pool[spec.name] = _Value(tensor, exact)
        return spec.name

    def operand(self, dtypes=FLOATS, min_rank: int = 0, max_rank: int = 4, pred=None, fresh: bool = True):
        """A value of the pool (recent ones first) or, sometimes, a new input of dtypes[0]. With
        `pred` (a test on the tensor) or `fresh=False`: None when no value fits."""
        def fits(t: torch.Tensor) -> bool:
            return _dtype(t) in dtypes and min_rank <= t.ndim <= max_rank and (pred is None or pred(t))

        names = [n for n, v in reversed(self.pool.items()) if fits(v.tensor)]
        if not fresh or pred is not None:
            return self.recent(names) if names else None
        if names and not self.coin(0.15):
            return self.recent(names)
        return self.fresh(self.shape(min_rank, max_rank), dtypes[0], **({"high": 4} if dtypes[0] == "int64" else {}))

    def t(self, name: str) -> torch.Tensor:
        return self.pool[name].tensor

    def v(self, name: str) -> _Value:
        return self.pool[name]

    def exact(self, *names: str) -> bool:
        return all(self.pool[n].exact is not None and self.pool[n].finite for n in names)

    def emit(self, kind: str, *args: str, exact=None, finite: bool | None = None, **params) -> bool:
        """Add `out = kind(args, params)` if torch runs it; its value joins the pool."""
        if kind in PRODUCTS and not all(_finite_factor(self.t(a), kind == "div" and i == 1) for i, a in enumerate(args)):
            return False  # outside hpfun's linearity contract (see PRODUCTS): the caller draws another op
        op = Op(self.name(), kind, *args, **params)
        try:
            with warnings.catch_warnings(), _seeded(self.seed + self.count[1]):
                warnings.simplefilter("ignore")
                result = eval(op.expression(), {**NAMESPACE, **{n: v.tensor for n, v in self.pool.items()}})
        except Exception:  # torch rejects this combination: the caller draws another op
            return False
        if not isinstance(result, torch.Tensor) or result.numel() > 4 * _MAX_NUMEL:
            return False
        finite = all(self.pool[a].finite for a in args) if finite is None else finite
        fits = exact is not None and exact[0] + exact[1] <= _MANTISSA.get(result.dtype, 62)
        if kind.endswith("_"):  # in place: what shares the written tensor's memory is no longer known exact
            storage = result.untyped_storage().data_ptr()
            for value in self.pool.values():
                if value.tensor.untyped_storage().data_ptr() == storage:
                    value.exact, value.finite = None, value.finite and finite
        self.pool[op.out] = _Value(result, exact if fits else None, finite)
        self.ops.append(op)
        self.count[0] += 1
        return True

    def step(self) -> bool:
        """Draw one op (or a gradient of a sub-program); False, with nothing added, if it did not fit."""
        generate = self.choose(_MENU)
        inputs, pool, ops, count = len(self.inputs), dict(self.pool), len(self.ops), list(self.count)
        if generate(self):
            return True
        del self.inputs[inputs:]
        self.pool, self.ops[ops:], self.count[:] = pool, [], count
        return False


# ---------------------------------------------------------------------------------------------
# The menu: each function draws one kind of op and emits it (False: it did not fit)
# ---------------------------------------------------------------------------------------------


def _unary(b: _Builder) -> bool:
    x = b.operand()
    v = b.v(x)
    kind = b.choose(["tanh", "sigmoid", "gelu", "relu", "abs", "neg", "square", "sin", "log_abs", "exp", "log",
                     "sqrt", "floor", "clamp", "silu", "softplus", "erf", "reciprocal", "sign", "cube", "tril",
                     "arange_add", "triu", "exp"])
    if kind in ("log", "sqrt", "floor", "reciprocal", "sign") and not b.exact(x):
        kind = "log_abs"
    if kind in NONSMOOTH and b.in_grad and not b.exact(x):
        kind = "tanh"
    ex = v.exact
    if kind in ("tril", "triu"):
        return b.emit(kind, x, exact=ex, diagonal=b.choose([0, 1, -1]))
    if kind == "exp":
        scale = b.choose([1.0, 100.0, 300.0, 1.0])
        return b.emit(kind, x, finite=v.finite and scale == 1.0, scale=scale)
    if kind == "clamp":
        low, high = b.choose([(-1.0, 1.0), (0.0, 2.5), (-0.5, 0.5)])
        return b.emit(kind, x, exact=_either(ex, (1, 2)), low=low, high=high)
    exact = {"relu": ex, "abs": ex, "neg": ex, "square": _mul(ex, ex), "cube": _mul(_mul(ex, ex), ex),
             "floor": ex and (min(ex[0], 0), ex[1]), "sign": (0, 1),
             "arange_add": _add(ex, (0, _bits(b.t(x).shape[-1] if b.t(x).ndim else 1)))}
    return b.emit(kind, x, exact=exact.get(kind), finite=v.finite and kind not in ("log", "sqrt", "reciprocal"))


def _broadcast_shape(b: _Builder, shape: tuple) -> tuple:
    """A shape that broadcasts against `shape` without growing it: leading dims dropped, some 1."""
    kept = shape[b.integer(0, len(shape)):] if shape else ()
    return tuple(1 if b.coin(0.3) else n for n in kept)


def _partner(b: _Builder, x: str, dtypes=FLOATS) -> str:
    """A value to combine with x: of its shape, or of one that broadcasts to it."""
    shape = tuple(b.t(x).shape)
    if b.coin(0.3):
        shape = _broadcast_shape(b, shape)
    y = b.operand(dtypes, pred=lambda t: tuple(t.shape) == shape, fresh=False)
    if y is None or b.coin(0.3):
        y = b.fresh(shape, dtypes[0])
    return y


def _binary(b: _Builder) -> bool:
    x = b.operand()
    if b.coin(0.3):
        kind, c = b.choose(["scale", "shift", "rsub"]), b.choose([2.0, 0.5, -1.5, 100.0, 0.1])
        exact = _mul(b.v(x).exact, _const(c)) if kind == "scale" else _add(b.v(x).exact, _const(c))
        return b.emit(kind, x, exact=exact, c=c)
    y = _partner(b, x)
    if b.coin(0.3):
        x, y = y, x
    kind = b.choose(["add", "sub", "mul", "div", "maximum", "add", "mul"])
    if kind == "div" and not b.exact(y):
        kind = "div_safe"
    if kind == "maximum" and b.in_grad and not b.exact(x, y):
        kind = "add"
    ex_x, ex_y = b.v(x).exact, b.v(y).exact
    exact = {"add": _add(ex_x, ex_y), "sub": _add(ex_x, ex_y), "mul": _mul(ex_x, ex_y), "maximum": _either(ex_x, ex_y)}
    return b.emit(kind, x, y, exact=exact.get(kind), finite=kind != "div" and b.v(x).finite and b.v(y).finite)


def _inplace(b: _Builder) -> bool:
    """An in-place update of a value of the program or of an input (which hpfun writes back)."""
    if b.in_grad:
        return False
    x = b.operand(("float64",), min_rank=1)
    kind = b.choose(["add_", "mul_", "masked_fill_", "clone_add_"])
    if kind == "masked_fill_":
        value = b.choose([0.0, -_INF, 2.0])
        return b.emit(kind, x, _mask_for(b, x), exact=_either(b.v(x).exact, (1, 2)), finite=b.v(x).finite
                      and math.isfinite(value), value=value)
    y = _partner(b, x, ("float64",))
    exact = _mul(b.v(x).exact, b.v(y).exact) if kind == "mul_" else _add(b.v(x).exact, b.v(y).exact)
    return b.emit(kind, x, y, exact=exact)


def _exact_value(b: _Builder) -> str:
    names = [n for n in reversed(b.pool) if b.exact(n) and _dtype(b.t(n)) in ("float64", "float32", "int64")]
    return b.recent(names) if names and not b.coin(0.2) else b.fresh(b.shape())


def _compare(b: _Builder) -> bool:
    bools = [n for n in reversed(b.pool) if b.t(n).dtype == torch.bool]
    if bools and b.coin(0.3):
        x = b.recent(bools)
        if b.coin(0.5):
            return b.emit("not", x, exact=(0, 1))
        return b.emit("and", x, _partner(b, x, ("bool",)), exact=(0, 1))
    x = _exact_value(b)
    if b.coin(0.5):
        return b.emit("gt_scalar", x, exact=(0, 1), c=b.choose([0.0, 0.5, -1.0, 1.0]))
    shape = tuple(b.t(x).shape)
    names = [n for n in b.pool if b.exact(n) and tuple(b.t(n).shape) == shape and n != x]
    y = b.choose(names) if names and b.coin(0.7) else b.fresh(shape)
    return b.emit(b.choose(["gt", "le"]), x, y, exact=(0, 1))


def _mask_for(b: _Builder, x: str) -> str:
    """A bool value that broadcasts to x's shape without growing it."""
    shape = tuple(b.t(x).shape)

    def broadcasts(mask: tuple) -> bool:
        return len(mask) <= len(shape) and all(m in (1, n) for m, n in zip(reversed(mask), reversed(shape)))

    fits = [n for n in reversed(b.pool) if b.t(n).dtype == torch.bool and broadcasts(tuple(b.t(n).shape))]
    if fits and b.coin(0.6):
        return b.recent(fits)
    return b.fresh(_broadcast_shape(b, shape) if b.coin(0.4) else shape, "bool")


def _masking(b: _Builder) -> bool:
    x = b.operand(min_rank=1)
    mask, v = _mask_for(b, x), b.v(x)
    if b.coin(0.5):
        value = b.choose([-_INF, 0.0, 1e9, -_INF, _INF, math.nan])
        return b.emit("masked_fill", x, mask, exact=_either(v.exact, (0, 30)), finite=v.finite and math.isfinite(value),
                      value=value)
    if b.coin(0.5):
        c = b.choose([0.0, -_INF, 1.0])
        return b.emit("where_scalar", mask, x, exact=_either(v.exact, (0, 1)), finite=v.finite and c != -_INF, c=c)
    y = _partner(b, x)
    return b.emit("where", mask, x, y, exact=_either(v.exact, b.v(y).exact))


def _dims(b: _Builder, ndim: int):
    """A dim, or a tuple of dims, of an ndim-dim value (negative ones sometimes)."""
    dims = sorted(set(b.draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim))))
    if len(dims) == 1:
        return dims[0] - ndim if b.coin(0.3) else dims[0]
    return tuple(dims)


def _reduce(b: _Builder) -> bool:
    x = b.operand(ANY, min_rank=1)
    t, v = b.t(x), b.v(x)
    if t.dtype == torch.bool:
        kind = b.choose(["any", "sum", "sum_all"])
    elif t.dtype == torch.int64:
        kind = b.choose(["sum", "sum_all", "amax", "argmax"])
    else:
        kind = b.choose(["sum", "mean", "amax", "var", "sum_all", "mean_all", "logsumexp", "norm", "amin", "max_all",
                         "min_all", "sum", "mean", "std", "prod", "argmax", "max_dim", "max_dim_indices", "amax"])
    if (kind in NONSMOOTH and b.in_grad and not b.exact(x)) or (kind in ("argmax", "max_dim_indices") and not b.exact(x)):
        kind = "sum"
    if kind.endswith("_all"):
        n = t.numel()
        return b.emit(kind, x, exact={"sum_all": _summed(v.exact, n), "mean_all": _mean(v.exact, n)}.get(kind, v.exact))
    dim = _dims(b, t.ndim)
    if kind in ("any", "prod", "argmax", "max_dim", "max_dim_indices"):
        dim = dim if isinstance(dim, int) else dim[0]
        exact = {"any": (0, 1), "argmax": (0, 10), "max_dim": v.exact, "max_dim_indices": (0, 10)}.get(kind)
        return b.emit(kind, x, exact=exact, dim=dim)
    n = math.prod(t.shape[d] for d in (dim if isinstance(dim, tuple) else (dim,)))
    exact = {"sum": _summed(v.exact, n), "mean": _mean(v.exact, n), "amax": v.exact, "amin": v.exact}.get(kind)
    return b.emit(kind, x, exact=exact, dim=dim, keepdim=b.coin(0.4), finite=v.finite and kind not in ("var", "std"))


def _along_dim(b: _Builder) -> bool:
    x = b.operand(min_rank=1)
    t, v = b.t(x), b.v(x)
    kind = b.choose(["softmax", "log_softmax", "cumsum", "layer_norm", "rms_norm", "group_norm", "softmax", "cummax",
                     "sort", "sort_indices", "topk", "flip", "roll", "log_softmax", "layer_norm"])
    if (kind in NONSMOOTH and b.in_grad and not b.exact(x)) or (kind == "sort_indices" and not b.exact(x)):
        kind = "cumsum"
    dim = b.integer(-t.ndim, t.ndim - 1)
    n = t.shape[dim]
    if kind in ("softmax", "log_softmax"):
        return b.emit(kind, x, dim=dim)
    if kind in ("cumsum", "cummax", "sort", "sort_indices", "flip"):
        exact = {"cumsum": _summed(v.exact, n), "sort_indices": (0, 10)}.get(kind, v.exact)
        return b.emit(kind, x, exact=exact, dim=dim)
    if kind == "topk":
        return b.emit(kind, x, exact=v.exact, dim=dim, k=b.integer(1, max(n, 1)))
    if kind == "roll":
        return b.emit(kind, x, exact=v.exact, dim=dim, shift=b.choose([1, -1, 2, n + 1]))
    if kind == "group_norm":
        if t.ndim < 2:
            return False
        c = t.shape[1]
        groups = b.choose([g for g in range(1, c + 1) if c % g == 0])
        if not (b.exact(x) or _conditioned(t.reshape(t.shape[0], groups, -1), 2, centred=True)):
            return False
        if b.coin(0.5):
            return b.emit(kind + "_affine", x, b.fresh((c,)), b.fresh((c,)), groups=groups)
        return b.emit(kind, x, groups=groups)
    shape = tuple(t.shape[-b.integer(1, min(2, t.ndim)):])
    if not (b.exact(x) or _conditioned(t.flatten(t.ndim - len(shape)) if shape else t, -1, kind == "layer_norm")):
        return False
    if b.coin(0.5):
        extra = (b.fresh(shape),) if kind == "rms_norm" else (b.fresh(shape), b.fresh(shape))
        return b.emit(kind + "_affine", x, *extra, shape=shape)
    return b.emit(kind, x, shape=shape)


def _conditioned(t: torch.Tensor, dim: int, centred: bool) -> bool:
    """Whether a norm over `dim` is well conditioned on these values: x / sqrt(mean(x^2) + eps)
    (centred: of x - mean) turns a rounding-sized difference near 0 into one of order 1, so a
    sharded sum's last bits would show. The fuzzer draws a norm of a computed value only where
    every group is well away from 0 (exact values take any norm: they do not round)."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    x = t.double()
    x = x - x.mean(dim, keepdim=True) if centred else x
    return bool(torch.isfinite(x).all()) and bool(((x * x).mean(dim) > 1e-3).all())


def _matmul(b: _Builder) -> bool:
    x = b.operand(min_rank=1)
    t = b.t(x)
    k, dtype = t.shape[-1], _dtype(t)
    mode = b.choose(["weight", "pool", "batched", "vector", "linear", "weight"])
    if mode == "linear":
        n = b.choose(b.sizes)
        w, bias = b.fresh((n, k), dtype), b.fresh((n,), dtype)
        exact = _add(_summed(_mul(b.v(x).exact, b.v(w).exact), k), b.v(bias).exact)
        return b.emit("linear", x, w, bias, exact=exact)
    if mode == "pool":
        y = b.operand((dtype,), min_rank=2, pred=lambda u: u.shape[-2] == k, fresh=False)
    elif mode == "batched" and t.ndim >= 3:
        y = b.fresh((*t.shape[:-2], k, b.choose(b.sizes)), dtype)
    elif mode == "vector":
        y = b.fresh((k,), dtype)
    else:
        y = b.fresh((k, b.choose(b.sizes)), dtype)
    if y is None:
        return False
    return b.emit("matmul", x, y, exact=_summed(_mul(b.v(x).exact, b.v(y).exact), k))


def _einsum(b: _Builder) -> bool:
    """An einsum with a new operand: some of x's dims contracted, some batch, new ones free."""
    x = b.operand(min_rank=1)
    t = b.t(x)
    letters = "abcdefgh"[: t.ndim]
    size = dict(zip(letters, t.shape, strict=True))
    roles = {c: b.choose(["contract", "batch", "free", "free"]) for c in letters}
    if "contract" not in roles.values():
        roles[b.choose(letters)] = "contract"
    new = "ijk"[: b.integer(0, 2)]
    size.update({c: b.choose(b.sizes) for c in new})
    y_letters = b.draw(st.permutations([c for c in letters if roles[c] in ("contract", "batch")] + list(new)))
    out = b.draw(st.permutations([c for c in letters if roles[c] != "contract"] + list(new)))
    if math.prod(size[c] for c in y_letters) > _MAX_NUMEL:
        return False
    y = b.fresh(tuple(size[c] for c in y_letters), _dtype(t))
    k = math.prod(size[c] for c in letters if roles[c] == "contract")
    return b.emit("einsum", x, y, exact=_summed(_mul(b.v(x).exact, b.v(y).exact), k),
                  equation=f"{letters},{''.join(y_letters)}->{''.join(out)}")


def _conv(b: _Builder) -> bool:
    x = b.operand(("float64",), min_rank=4, max_rank=4, fresh=False)
    if x is None or b.coin(0.3):
        x = b.fresh((b.choose(b.sizes), b.choose(b.sizes), *sorted([b.choose(b.sizes), 4])))
    t = b.t(x)
    kind = b.choose(["conv2d", "conv2d", "max_pool2d", "avg_pool2d"])
    if kind == "conv2d":
        size = b.choose([1, 3])
        w = b.fresh((b.choose(b.sizes), t.shape[1], size, size))
        return b.emit(kind, x, w, exact=_summed(_mul(b.v(x).exact, b.v(w).exact), t.shape[1] * size * size),
                      padding=b.choose([0, size // 2]))
    if kind == "max_pool2d" and b.in_grad and not b.exact(x):
        return False
    return b.emit(kind, x, exact=b.v(x).exact if kind == "max_pool2d" else _mean(b.v(x).exact, 4))


def _reshaped(b: _Builder, shape: tuple) -> tuple:
    """A new shape for the same elements: two dims merged, one split, all flattened, or a 1 added."""
    how = b.choose(["merge", "split", "flatten", "unit", "merge", "split"])
    if how == "merge" and len(shape) >= 2:
        i = b.integer(0, len(shape) - 2)
        return (*shape[:i], shape[i] * shape[i + 1], *shape[i + 2:])
    splittable = [(i, p) for i, n in enumerate(shape) for p in range(2, n) if n % p == 0]
    if how == "split" and splittable:
        i, p = b.choose(splittable)
        new = (*shape[:i], p, shape[i] // p, *shape[i + 1:])
        return tuple(-1 if j == i + 1 and b.coin(0.3) else n for j, n in enumerate(new))
    if how == "flatten":
        return (-1,)
    i = b.integer(0, len(shape))
    return (*shape[:i], 1, *shape[i:])


def _view(b: _Builder) -> bool:
    x = b.operand(ANY, min_rank=1)
    t, ex = b.t(x), b.v(x).exact
    shape = tuple(t.shape)
    kind = b.choose(["reshape", "view", "flatten", "unsqueeze", "squeeze", "permute", "transpose", "mT", "contiguous",
                     "expand", "reshape", "permute", "repeat", "pad", "unflatten", "view"])
    if kind in ("reshape", "view"):
        return b.emit(kind, x, exact=ex, shape=_reshaped(b, shape))
    if kind == "flatten" and t.ndim >= 2:
        start = b.integer(0, t.ndim - 2)
        return b.emit(kind, x, exact=ex, start=start, end=b.integer(start + 1, t.ndim - 1))
    if kind == "squeeze" and 1 in shape:
        return b.emit(kind, x, exact=ex, dim=b.choose([d for d, n in enumerate(shape) if n == 1]))
    if kind == "expand" and 1 in shape:
        d = b.choose([d for d, n in enumerate(shape) if n == 1])
        return b.emit(kind, x, exact=ex, shape=(*shape[:d], b.choose(b.sizes), *shape[d + 1:]))
    if kind == "permute" and t.ndim >= 2:
        return b.emit(kind, x, exact=ex, dims=tuple(b.draw(st.permutations(range(t.ndim)))))
    if kind == "transpose" and t.ndim >= 2:
        d0, d1 = b.draw(st.lists(st.integers(0, t.ndim - 1), min_size=2, max_size=2, unique=True))
        return b.emit(kind, x, exact=ex, dim0=d0, dim1=d1)
    if kind in ("mT", "contiguous") and t.ndim >= 2:
        return b.emit(kind, x, exact=ex)
    if kind == "repeat":
        return b.emit(kind, x, exact=ex, repeats=tuple(b.choose([1, 1, 2]) for _ in range(t.ndim + b.integer(0, 1))))
    if kind == "pad" and t.is_floating_point():
        value = b.choose([0.0, 0.0, -_INF, 1.5])
        pad = b.choose([(1, 0), (0, 2), (1, 1), (1, 0, 0, 1)])
        return b.emit(kind, x, exact=_either(ex, (1, 1)), finite=b.v(x).finite and value != -_INF, pad=pad, value=value)
    splittable = [(d, p) for d, n in enumerate(shape) for p in range(2, n) if n % p == 0]
    if kind == "unflatten" and splittable:
        d, p = b.choose(splittable)
        return b.emit(kind, x, exact=ex, dim=d, sizes=(p, shape[d] // p))
    return b.emit("unsqueeze", x, exact=ex, dim=b.integer(-t.ndim - 1, t.ndim))


def _join_split(b: _Builder) -> bool:
    x = b.operand(ANY, min_rank=1)
    t, ex = b.t(x), b.v(x).exact
    dtype = _dtype(t)
    kind = b.choose(["cat", "stack", "split", "chunk", "cat"])
    dim = b.integer(0, t.ndim - 1)
    if kind in ("cat", "stack"):
        shape = list(t.shape)
        if kind == "cat" and b.coin(0.5):
            shape[dim] = b.choose(b.sizes)
        same = b.operand((dtype,), pred=lambda u: list(u.shape) == shape, fresh=False)
        other = same if same is not None and b.coin(0.6) else b.fresh(shape, dtype, **({"high": 4} if dtype == "int64" else {}))
        return b.emit(kind, x, other, exact=_either(ex, b.v(other).exact), dim=dim if kind == "cat" else b.integer(0, t.ndim))
    n = t.shape[dim]
    if n < 2:
        return False
    if kind == "split":
        size = b.integer(1, n - 1)
        return b.emit(kind, x, exact=ex, size=size, dim=dim, index=b.integer(0, -(-n // size) - 1))
    chunks = b.integer(2, n)
    return b.emit(kind, x, exact=ex, chunks=chunks, dim=dim, index=b.integer(0, len(t.chunk(chunks, dim)) - 1))


def _indexing(b: _Builder) -> bool:
    kind = b.choose(["slice", "select", "index_select", "gather", "index", "embedding", "scatter_add", "gather",
                     "index_add", "slice_scatter", "index_put", "one_hot", "slice", "embedding"]
                    + ["masked_select"] * b.coin(0.05))
    floats_only = kind in ("scatter_add", "index_add", "slice_scatter", "index_put")
    x = b.operand(("float64",) if floats_only else ANY, min_rank=1)
    t, ex = b.t(x), b.v(x).exact
    dim = b.integer(0, t.ndim - 1)
    n = t.shape[dim]
    if kind == "slice":
        start = b.integer(0, n - 1)
        return b.emit(kind, x, exact=ex, dim=dim, start=start, stop=b.integer(start + 1, n), step=b.choose([1, 1, 2]))
    if kind == "select":
        return b.emit(kind, x, exact=ex, dim=dim, index=b.integer(0, n - 1))
    if kind == "index_select":
        return b.emit(kind, x, b.fresh((b.choose(b.sizes),), "int64", high=n), exact=ex, dim=dim)
    if kind == "index":
        return b.emit(kind, x, b.fresh(b.shape(1, 2), "int64", high=t.shape[0]), exact=ex)
    if kind == "masked_select":  # a data-dependent shape: a mask given as an input is read (traced for its values)
        return b.emit(kind, x, b.fresh(tuple(t.shape), "bool"), exact=ex)
    if kind == "one_hot":
        ids = b.fresh(b.shape(1, 2), "int64", high=b.choose(b.sizes))
        return b.emit(kind, ids, exact=(0, 1), classes=b.pool[ids].tensor.max().item() + 1 + b.integer(0, 2))
    if kind == "embedding":
        if t.ndim != 2 or not t.is_floating_point():
            x = b.fresh((b.choose(b.sizes), b.choose(b.sizes)))
        return b.emit(kind, x, b.fresh(b.shape(1, 2), "int64", high=b.t(x).shape[0]), exact=b.v(x).exact)
    if kind == "slice_scatter":
        start = b.integer(0, n - 1)
        end = b.integer(start + 1, n)
        src = b.fresh((*t.shape[:dim], end - start, *t.shape[dim + 1:]))
        return b.emit(kind, x, src, exact=_either(ex, b.v(src).exact), dim=dim, start=start, end=end)
    if kind in ("index_put", "index_add"):
        k = b.choose(b.sizes)
        ids = b.fresh((k,), "int64", high=t.shape[0] if kind == "index_put" else n)
        along = 0 if kind == "index_put" else dim
        src = b.fresh((*t.shape[:along], k, *t.shape[along + 1:]))
        exact = _add(ex, _summed(b.v(src).exact, k))
        return b.emit(kind, x, ids, src, exact=exact, **({} if kind == "index_put" else {"dim": dim}))
    shape = tuple(b.choose(b.sizes) if d == dim else (m if b.coin(0.8) else b.integer(1, m)) for d, m in enumerate(t.shape))
    if kind == "gather":
        return b.emit(kind, x, b.fresh(shape, "int64", high=n), exact=ex, dim=dim)
    shape = tuple(m if d != dim else s for d, (m, s) in enumerate(zip(t.shape, shape, strict=True)))
    src, ids = b.fresh(shape), b.fresh(shape, "int64", high=n)
    return b.emit(kind, x, ids, src, exact=_add(ex, _summed(b.v(src).exact, shape[dim])), dim=dim)


def _loss(b: _Builder) -> bool:
    kind = b.choose(["cross_entropy", "cross_entropy", "mse", "bce_logits"])
    if kind != "cross_entropy":
        x = b.operand(("float64",))
        return b.emit(kind, x, _partner(b, x, ("float64",)) if kind == "mse" else b.fresh(tuple(b.t(x).shape)))
    x = b.operand(("float64",), min_rank=2, max_rank=3)
    shape = tuple(b.t(x).shape)
    labels = b.fresh((shape[0], *shape[2:]), "int64", high=shape[1], ignore=b.coin(0.3))
    return b.emit("cross_entropy", x, labels, reduction=b.choose(["mean", "sum", "none"]),
                  smoothing=b.choose([0.0, 0.0, 0.1]))


def _attention(b: _Builder) -> bool:
    q = b.operand(("float64",), min_rank=4, max_rank=4, fresh=False)
    if q is None or b.coin(0.3):
        q = b.fresh(b.shape(4, 4))
    batch, heads, length, width = b.t(q).shape
    if b.coin(0.4):
        k = v = q
        keys = length
    else:
        keys = length if b.coin(0.5) else b.choose(b.sizes)
        k, v = b.fresh((batch, heads, keys, width)), b.fresh((batch, heads, keys, b.choose(b.sizes)))
    how = b.choose(["causal", "mask", "none", "mask"])
    if how == "mask":
        shape = b.choose([(length, keys), (batch, 1, length, keys), (1, heads, length, keys)])
        mask = b.operand(("bool",), pred=lambda u: tuple(u.shape) == shape, fresh=False) or b.fresh(shape, "bool")
        return b.emit("sdpa_mask", q, k, v, mask)
    return b.emit("sdpa_causal" if how == "causal" else "sdpa", q, k, v)


def _cast(b: _Builder) -> bool:
    x = b.operand(ANY)
    t, v = b.t(x), b.v(x)
    if t.dtype == torch.float32 or not t.is_floating_point():
        return b.emit("double", x, exact=v.exact)
    if b.exact(x) and b.coin(0.5):
        kind = b.choose(["long", "bool"])
        return b.emit(kind, x, exact=(0, v.exact[1]) if kind == "long" else (0, 1))
    # float32 rounds each value, but the same way wherever it runs: still exact if it was
    return b.emit("float", x, exact=v.exact and (min(v.exact[0], 24 - v.exact[1]), v.exact[1]))


def _random(b: _Builder) -> bool:
    if not b.allow_random:
        return False
    x = b.operand()
    kind = b.choose(["dropout", "rand_like", "randn_like", "dropout"])
    bits = _MANTISSA[b.t(x).dtype]
    if kind == "dropout":
        p = b.choose([0.5, 0.25])
        return b.emit(kind, x, exact=_mul(b.v(x).exact, (0, 1)) if p == 0.5 else None, p=p)
    return b.emit(kind, x, exact=(bits, 0) if kind == "rand_like" else (bits - 3, 3))


def _constrain(b: _Builder) -> bool:
    """hpfun.constrain: a value's layout pinned inside the program (the identity when eager)."""
    x = b.operand(ANY)
    shape = tuple(b.t(x).shape)
    spec = P.from_layout(b.draw(layouts(b.mesh, shape)), len(shape)) if shape else P()
    return b.emit("constrain", x, exact=b.v(x).exact, spec=spec)


def _grad(b: _Builder) -> bool:
    """torch.func.grad of a scalar loss over a sub-program, with respect to one or two values."""
    if b.grad_depth >= 2 or b.left() < 3 or (b.in_grad and not b.coin(0.3)):
        return False
    args = list(dict.fromkeys(b.operand(("float64",), min_rank=1) for _ in range(b.choose([1, 1, 2]))))
    body = _Builder(b.draw, b.mesh, b.sizes, b.seed, b.budget - 1, b.allow_random, b.grad_depth + 1, parent=b)
    for _ in range(b.integer(1, min(4, b.left() - 2))):
        body.step()
    last = next(n for n in reversed(body.pool) if body.t(n).dtype == torch.float64 or n == args[0])
    if body.t(last).ndim and not body.emit(b.choose(["sum_all", "mean_all"]), last):
        return False
    loss = body.ops[-1].out if body.t(last).ndim else last
    grad = Grad(outs=tuple(b.name() for _ in args), args=tuple(args), body=tuple(body.ops), loss=loss)
    env = {**NAMESPACE, **{n: v.tensor for n, v in b.pool.items()}}
    try:
        with warnings.catch_warnings(), _seeded(b.seed + b.count[1]):
            warnings.simplefilter("ignore")
            exec("\n".join(grad.lines()), env)
    except Exception:  # not differentiable as drawn: the caller draws another op
        return False
    for out in grad.outs:
        b.pool[out] = _Value(env[out], None, all(v.finite for v in body.pool.values()))
    b.ops.append(grad)
    b.count[0] += 1
    return True


_MENU = (
    [_binary] * 5 + [_unary] * 4 + [_reduce] * 4 + [_along_dim] * 3 + [_matmul] * 2 + [_einsum] + [_view] * 4
    + [_join_split] * 2 + [_indexing] * 3 + [_masking] * 2 + [_compare] + [_loss] + [_attention] + [_conv]
    + [_cast] * 2 + [_random] + [_grad] * 2 + [_inplace] + [_constrain]
)


# ---------------------------------------------------------------------------------------------
# Whole programs
# ---------------------------------------------------------------------------------------------


@st.composite
def _sizes(draw, mesh: Mesh) -> tuple:
    """Dim sizes for the program's tensors: products of mesh axis sizes times 1 to 3."""
    sizes = []
    for _ in range(4):
        factor = math.prod(n for n in mesh.shape if draw(st.booleans()))
        size = factor * draw(st.sampled_from((1, 2, 3)))
        sizes.append(size if size <= 24 else factor)
    return tuple(sizes) if max(sizes) > 1 else (*sizes[:-1], 2)


@st.composite
def _placed(draw, mesh: Mesh, spec: Input) -> Input:
    """The input with its layout drawn: split, replicated, or (floats) Partial."""
    floating = spec.dtype.startswith("float")
    layout = draw(layouts(mesh, spec.shape, allow_partial=floating and draw(st.integers(0, 9)) < 4))
    sharded = bool(layout.partial_axes) or draw(st.integers(0, 9)) < 3
    return attrs.evolve(spec, layout=layout.placements_str(), sharded=sharded, contiguous=spec.contiguous or sharded)


@st.composite
def _out_spec(draw, mesh: Mesh, shape: tuple):
    if not shape or draw(st.booleans()):
        return P()
    return P.from_layout(draw(layouts(mesh, shape)), len(shape))


@st.composite
def draw_program(draw, min_ops: int = 3, max_ops: int = 12, max_ranks: int = 8, random_ops: bool = True,
                 grad: bool = True) -> Program:
    """See `hpfun.testing.fuzz.programs`."""
    mesh_shape = draw(st.sampled_from([m for m in MESH_SHAPES if math.prod(m) <= max_ranks]))
    mesh = Mesh.simulated(mesh_shape, AXIS_NAMES[: len(mesh_shape)])
    b = _Builder(draw, mesh, draw(_sizes(mesh)), draw(st.integers(0, 2**16)), draw(st.integers(min_ops, max_ops)),
                 random_ops, 0 if grad else 2)
    b.fresh(b.shape(2, 3))
    for _ in range(8 * b.budget):
        if b.left() <= 0:
            break
        b.step()
    if not b.ops:
        b.emit("sum_all", "x0")
    used = {a for op in b.ops for a in _reads(op)}
    sinks = [op.out for op in b.ops if op.out not in used]  # what nothing reads is returned
    outputs = list(dict.fromkeys([*sinks[-4:], *draw(st.lists(st.sampled_from([op.out for op in b.ops]), max_size=1))]))
    inputs = tuple(draw(_placed(mesh, i)) for i in b.inputs)
    out_specs = None
    if draw(st.booleans()):
        out_specs = tuple(draw(_out_spec(mesh, tuple(b.t(o).shape))) for o in outputs)
    return Program((mesh.shape, mesh.axis_names), inputs, tuple(b.ops), tuple(outputs), out_specs, b.seed)


def _reads(op) -> set[str]:
    if isinstance(op, Grad):
        return set(op.args).union(*(_reads(o) for o in op.body))
    return set(op.args)
