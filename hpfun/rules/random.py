"""Random ops: every element's value is a function of (seed, op number, global index).

So the layout is free: a value drawn split is the same tensor as drawn whole. Ops that take a
tensor only for its shape (`rand_like`, `uniform`, `bernoulli.p`) draw in that tensor's layout
where it stands (a Partial one gives a replicated draw); `bernoulli(probs)` and dropout read
their input, so it must not be Partial; factories (`rand(shape)`) draw replicated.
"""

from __future__ import annotations

import math

import attrs
import torch

from hpfun import rng
from hpfun.layout import Layout, Partial, R
from hpfun.rules.base import OpCall, Rule, Strategy

KINDS = ("rand", "randn", "uniform", "normal", "normal_float", "normal_tensor", "bernoulli_p", "bernoulli_tensor", "bernoulli", "randint", "randint_like", "randperm",
         "dropout", "exponential", "log_normal", "cauchy", "geometric")


def _check_kind(_, __, value):
    if value not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {value!r}")


def _without_partial(layout: Layout) -> Layout:
    """`layout` with R for its Partials (its splits and their order kept)."""
    return attrs.evolve(layout, placements=tuple(R if isinstance(p, Partial) else p for p in layout.placements))


@attrs.frozen(kw_only=True)
class Random(Rule):
    kind: str = attrs.field(validator=_check_kind)
    reads_input: bool = False  # bernoulli(probs), dropout: the input's values matter

    def strategies(self, call: OpCall) -> list[Strategy]:
        if not call.tensors or self.kind == "randperm":
            r = Layout.replicated(call.mesh)
            return [Strategy((r,) * len(call.tensors), (r,) * len(call.outputs))]
        src = call.tensors[0].layout
        out = _without_partial(src)
        if self.kind in ("normal_tensor", "bernoulli_tensor"):  # torch.normal(mean, std), x.bernoulli_(p): drawn where they are
            if all(t.shape == call.outputs[0].shape for t in call.tensors):
                return [Strategy((out,) * len(call.tensors), (out,))]
            r = Layout.replicated(call.mesh)  # broadcast against each other: drawn whole
            return [Strategy((r,) * len(call.tensors), (r,))]
        first = out if self.reads_input else src  # shape only: the input stays where it is
        return [Strategy((first,) + tuple(t.layout for t in call.tensors[1:]), (out,) * len(call.outputs))]

    def emit(self, ctx, call: OpCall, strategy: Strategy, args, kwargs):
        out = call.outputs[0]
        index = ctx.global_index(strategy.outputs[0], out.shape)
        params = _PARAMS[self.kind](args)
        large = math.prod(out.shape) >= rng.COMPILE_ABOVE  # by global size: the same path for every layout
        draw = native_sample if ctx.rng == "native" else sample if large else _sample
        return ctx.call(draw, (self.kind, index, ctx.seed, ctx.next_random_op(), out.dtype, *params))


def _arg(args, i, default):
    return args[i] if len(args) > i and args[i] is not None else default


_PARAMS = {
    "rand": lambda a: (0.0, 1.0),
    "randn": lambda a: (0.0, 1.0),
    "uniform": lambda a: (_arg(a, 1, 0.0), _arg(a, 2, 1.0)),
    "normal": lambda a: (_arg(a, 1, 0.0), _arg(a, 2, 1.0)),
    "normal_float": lambda a: (_arg(a, 0, 0.0), _arg(a, 1, 1.0)),  # torch.normal(mean, std, size)
    "normal_tensor": lambda a: (a[0], _arg(a, 1, 1.0)),  # torch.normal(mean, std): either may be a tensor
    "bernoulli_p": lambda a: (_arg(a, 1, 0.5),),
    "bernoulli": lambda a: (a[0],),
    "bernoulli_tensor": lambda a: (a[1],),  # x.bernoulli_(p): p a tensor
    "randint": lambda a: (a[0], a[1]) if len(a) > 2 and not isinstance(a[1], (list, tuple)) else (0, a[0]),
    "randint_like": lambda a: (a[1], a[2]) if len(a) > 2 else (0, a[1]),  # (x, [low,] high)
    "randperm": lambda a: (),
    "dropout": lambda a: (a[0], a[1], _arg(a, 2, True)),
    "exponential": lambda a: (_arg(a, 1, 1.0),),
    "log_normal": lambda a: (_arg(a, 1, 1.0), _arg(a, 2, 2.0)),
    "cauchy": lambda a: (_arg(a, 1, 0.0), _arg(a, 2, 1.0)),
    "geometric": lambda a: (a[1],),
}


def _sample(kind: str, index: torch.Tensor, seed: torch.Tensor, op: int, dtype: torch.dtype, *params):
    """The local block of one random op's output (a pure function of seed, op and global index)."""
    return _from_words(kind, rng.words(index, seed, op), dtype, *params)


def _from_words(kind: str, w, dtype: torch.dtype, *params):
    if dtype.is_complex and kind == "normal_tensor" and isinstance(params[0], torch.Tensor) and params[0].is_complex():
        part = dtype.to_real()  # a complex mean: noise in both parts, the variance split evenly
        mean, std = params
        z = torch.complex(rng.normal(w[:2], part), rng.normal(w[2:], part))
        return z * (std * math.sqrt(0.5)) + mean
    if dtype.is_complex and kind in ("rand", "uniform", "randn", "normal", "normal_float", "normal_tensor"):
        # as torch draws them: real and imaginary parts independent, each from two of the four
        # words; a normal's variance split evenly between them, its mean added to both
        part = dtype.to_real()
        if kind in ("randn", "normal", "normal_float", "normal_tensor"):
            mean, std = params
            params = (mean, std * math.sqrt(0.5))
        return torch.complex(_from_words(kind, w[:2], part, *params), _from_words(kind, w[2:], part, *params))
    if kind in ("rand", "uniform"):
        low, high = params
        u = rng.uniform(w, dtype)
        return u if (low, high) == (0.0, 1.0) else u * (high - low) + low
    if kind in ("randn", "normal", "normal_float", "normal_tensor"):
        mean, std = params
        z = rng.normal(w, dtype)
        if not isinstance(mean, torch.Tensor) and not isinstance(std, torch.Tensor) and (mean, std) == (0.0, 1.0):
            return z
        return z * std + mean
    if kind in ("bernoulli_p", "bernoulli", "bernoulli_tensor"):
        p = params[0]
        return (rng.uniform(w, torch.float64 if _is_double(p) else torch.float32) < p).to(dtype)
    if kind in ("randint", "randint_like"):
        low, high = params
        return (rng.below(w, high - low) + low).to(dtype)
    if kind in ("exponential", "cauchy", "geometric"):  # by inversion of one uniform in [0, 1)
        u = rng.uniform(w, torch.float64 if dtype == torch.float64 else torch.float32)
        if kind == "exponential":  # F.gumbel_softmax's -log(Exp(1))
            return (-torch.log1p(-u) / params[0]).to(dtype)
        if kind == "cauchy":
            median, sigma = params
            return (median + sigma * torch.tan(math.pi * (u - 0.5))).to(dtype)
        return (torch.floor(torch.log1p(-u) / math.log1p(-params[0])) + 1).to(dtype)
    if kind == "log_normal":
        mean, std = params
        return torch.exp(rng.normal(w, dtype) * std + mean)
    if kind == "randperm":
        return torch.argsort(rng.sort_keys(w)).to(dtype)
    x, p, train = params
    if not train or p == 0:
        return x, torch.ones_like(x, dtype=torch.bool)
    keep = rng.uniform(w, torch.float32) >= p
    return x * keep * (1.0 / (1.0 - p)), keep


sample = rng.compiled(_sample)


def native_sample(kind: str, index: torch.Tensor, seed: torch.Tensor, op: int, dtype: torch.dtype, *params):
    """rng="native": torch's generator, one stream per (seed, op, block): fast, disjoint across
    blocks, identical where a block is replicated, but the values depend on the layout."""
    first = int(index.reshape(-1)[0]) if index.numel() else 0
    g = torch.Generator(device=index.device).manual_seed(hash((int(seed[0]), op, first)) & (2**63 - 1))
    shape = (params[0].shape if kind in ("bernoulli", "dropout") else index.shape)
    w = [torch.randint(0, 2**32, shape, generator=g, dtype=torch.int64, device=index.device)
         for _ in range(4 if dtype.is_complex else 2)]
    return _from_words(kind, w, dtype, *params)


def _is_double(p) -> bool:
    return isinstance(p, torch.Tensor) and p.dtype == torch.float64
