"""Programs as data, for `hpfun.testing.fuzz` (which runs them) and `hpfun.testing.fuzz_menu`
(which draws them).

A `Program` is a mesh, its inputs (shape, dtype, layout), a list of op records (`Op`, and `Grad`
for `torch.func.grad` of a scalar loss over a sub-program), its outputs and out_specs. Its
`repr` is Python that rebuilds it, so a failing program pastes into a regression test;
`source()` is the plain torch function it runs.
"""

from __future__ import annotations

import linecache
import math
import zlib

import attrs
import torch
import torch.nn.functional as F

import hpfun
from hpfun.layout import P, parse
from hpfun.mesh import Mesh
from hpfun.sharded import Sharded
from hpfun.testing.strategies import _with_partial_terms


def _lit(value) -> str:
    """A parameter as Python source (inf and NaN spelled so they evaluate, a spec as P(...))."""
    if isinstance(value, float) and not math.isfinite(value):
        return "float('nan')" if math.isnan(value) else ("-" if value < 0 else "") + "float('inf')"
    return str(value) if isinstance(value, P) else repr(value)


def _slice_index(args, params) -> str:
    dims = [":"] * params["dim"]
    start, stop, step = params["start"], params["stop"], params["step"]
    part = f"{start}:{stop}" + (f":{step}" if step != 1 else "")
    return f"{args[0]}[{', '.join([*dims, part])}]"


def _select_index(args, params) -> str:
    return f"{args[0]}[{', '.join([':'] * params['dim'] + [str(params['index'])])}]"


# kind -> how it prints: a format string ({0}, {1}: arguments; {name}: parameters) or a function
TEMPLATES = {
    # pointwise, one float argument
    "tanh": "torch.tanh({0})", "sigmoid": "torch.sigmoid({0})", "gelu": "F.gelu({0})", "relu": "torch.relu({0})",
    "abs": "{0}.abs()", "neg": "-{0}", "square": "{0} * {0}", "sin": "torch.sin({0})", "log": "torch.log({0})",
    "log_abs": "torch.log({0}.abs() + 0.5)", "exp": "torch.exp({0} * {scale})", "sqrt": "torch.sqrt({0})",
    "floor": "torch.floor({0})", "clamp": "{0}.clamp({low}, {high})", "silu": "F.silu({0})",
    "softplus": "F.softplus({0})", "erf": "torch.erf({0})", "reciprocal": "torch.reciprocal({0})",
    "sign": "torch.sign({0})", "cube": "{0} ** 3", "tril": "{0}.tril({diagonal})", "triu": "{0}.triu({diagonal})",
    "arange_add": "{0} + torch.arange({0}.shape[-1], dtype={0}.dtype)",
    # pointwise, broadcasting
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
    "div_safe": "{0} / ({1}.abs() + 1)", "maximum": "torch.maximum({0}, {1})",
    "scale": "{0} * {c}", "shift": "{0} + {c}", "rsub": "{c} - {0}",
    "gt": "{0} > {1}", "le": "{0} <= {1}", "gt_scalar": "{0} > {c}", "not": "~{0}", "and": "{0} & {1}",
    "where": "torch.where({0}, {1}, {2})", "where_scalar": "torch.where({0}, {1}, {c})",
    "masked_fill": "{0}.masked_fill({1}, {value})",
    # in place, on a value of the program (or an input: written back)
    "add_": "{0}.add_({1})", "mul_": "{0}.mul_({1})", "masked_fill_": "{0}.masked_fill_({1}, {value})",
    "clone_add_": "{0}.clone().add_({1})",
    # reductions
    "sum": "{0}.sum(dim={dim}, keepdim={keepdim})", "mean": "{0}.mean(dim={dim}, keepdim={keepdim})",
    "amax": "{0}.amax(dim={dim}, keepdim={keepdim})", "amin": "{0}.amin(dim={dim}, keepdim={keepdim})",
    "var": "{0}.var(dim={dim}, keepdim={keepdim})", "logsumexp": "torch.logsumexp({0}, dim={dim}, keepdim={keepdim})",
    "norm": "torch.linalg.vector_norm({0}, dim={dim}, keepdim={keepdim})", "any": "{0}.any(dim={dim})",
    "sum_all": "{0}.sum()", "mean_all": "{0}.mean()", "max_all": "{0}.max()", "min_all": "{0}.min()",
    "std": "{0}.std(dim={dim}, keepdim={keepdim})", "prod": "{0}.prod(dim={dim})", "argmax": "{0}.argmax(dim={dim})",
    "max_dim": "{0}.max(dim={dim}).values", "max_dim_indices": "{0}.max(dim={dim}).indices",
    # along a dim
    "softmax": "torch.softmax({0}, dim={dim})", "log_softmax": "torch.log_softmax({0}, dim={dim})",
    "cumsum": "torch.cumsum({0}, dim={dim})", "cummax": "torch.cummax({0}, dim={dim}).values",
    "sort": "torch.sort({0}, dim={dim}).values", "sort_indices": "torch.sort({0}, dim={dim}, stable=True).indices",
    "topk": "torch.topk({0}, {k}, dim={dim}).values", "flip": "torch.flip({0}, ({dim},))",
    "roll": "torch.roll({0}, {shift}, {dim})",
    "layer_norm": "F.layer_norm({0}, {shape})", "layer_norm_affine": "F.layer_norm({0}, {shape}, {1}, {2})",
    "rms_norm": "F.rms_norm({0}, {shape})", "rms_norm_affine": "F.rms_norm({0}, {shape}, {1})",
    "group_norm": "F.group_norm({0}, {groups})", "group_norm_affine": "F.group_norm({0}, {groups}, {1}, {2})",
    # contractions
    "matmul": "{0} @ {1}", "einsum": "torch.einsum({equation}, {0}, {1})", "linear": "F.linear({0}, {1}, {2})",
    "conv2d": "F.conv2d({0}, {1}, padding={padding})", "max_pool2d": "F.max_pool2d({0}, 2)",
    "avg_pool2d": "F.avg_pool2d({0}, 2)",
    # views
    "reshape": "{0}.reshape({shape})", "view": "{0}.view({shape})", "flatten": "{0}.flatten({start}, {end})",
    "unsqueeze": "{0}.unsqueeze({dim})", "squeeze": "{0}.squeeze({dim})", "permute": "{0}.permute({dims})",
    "transpose": "{0}.transpose({dim0}, {dim1})", "mT": "{0}.mT", "contiguous": "{0}.contiguous()",
    "expand": "{0}.expand({shape})", "repeat": "{0}.repeat({repeats})", "pad": "F.pad({0}, {pad}, value={value})",
    "unflatten": "{0}.unflatten({dim}, {sizes})",
    # joining and splitting
    "cat": "torch.cat([{0}, {1}], dim={dim})", "stack": "torch.stack([{0}, {1}], dim={dim})",
    "split": "{0}.split({size}, dim={dim})[{index}]", "chunk": "{0}.chunk({chunks}, dim={dim})[{index}]",
    # indexing
    "slice": _slice_index, "select": _select_index, "index_select": "{0}.index_select({dim}, {1})",
    "gather": "torch.gather({0}, {dim}, {1})", "index": "{0}[{1}]", "embedding": "F.embedding({1}, {0})",
    "scatter_add": "{0}.scatter_add({dim}, {1}, {2})", "index_add": "{0}.index_add({dim}, {1}, {2})",
    "slice_scatter": "torch.slice_scatter({0}, {1}, dim={dim}, start={start}, end={end})",
    "index_put": "{0}.index_put(({1},), {2}, accumulate=True)", "one_hot": "F.one_hot({0}, {classes})",
    "masked_select": "{0}[{1}]",
    # losses and attention
    "cross_entropy": "F.cross_entropy({0}, {1}, reduction={reduction}, label_smoothing={smoothing})",
    "sdpa": "F.scaled_dot_product_attention({0}, {1}, {2})",
    "sdpa_causal": "F.scaled_dot_product_attention({0}, {1}, {2}, is_causal=True)",
    "sdpa_mask": "F.scaled_dot_product_attention({0}, {1}, {2}, attn_mask={3})",
    "mse": "F.mse_loss({0}, {1})", "bce_logits": "F.binary_cross_entropy_with_logits({0}, {1})",
    # layouts pinned inside the program
    "constrain": "hpfun.constrain({0}, {spec})",
    # casts
    "float": "{0}.float()", "double": "{0}.double()", "bool": "{0}.bool()", "long": "{0}.long()",
    # random numbers
    "dropout": "F.dropout({0}, p={p})", "rand_like": "torch.rand_like({0})", "randn_like": "torch.randn_like({0})",
}
RANDOM_KINDS = frozenset({"dropout", "rand_like", "randn_like"})
NAMESPACE = {"torch": torch, "F": F, "hpfun": hpfun, "P": P}  # what a program's source may use


class Op:
    """One line of a program, `out = <TEMPLATES[kind] filled with args and params>`.

    >>> Op("v3", "softmax", "v2", dim=-1).line()
    'v3 = torch.softmax(v2, dim=-1)'
    """

    __slots__ = ("out", "kind", "args", "params")

    def __init__(self, out: str, kind: str, *args: str, **params):
        if kind not in TEMPLATES:
            raise ValueError(f"unknown op kind {kind!r}")
        self.out, self.kind, self.args, self.params = out, kind, tuple(args), dict(params)

    def expression(self) -> str:
        template = TEMPLATES[self.kind]
        if callable(template):
            return template(self.args, self.params)
        return template.format(*self.args, **{k: _lit(v) for k, v in self.params.items()})

    def line(self) -> str:
        return f"{self.out} = {self.expression()}"

    def lines(self, indent: str = "") -> list[str]:
        return [indent + self.line()]

    def kinds(self) -> set[str]:
        return {self.kind}

    def __repr__(self) -> str:
        items = [repr(self.out), repr(self.kind), *map(repr, self.args)]
        return f"Op({', '.join(items + [f'{k}={_lit(v)}' for k, v in self.params.items()])})"

    def _key(self):
        return (self.out, self.kind, self.args, tuple(sorted(self.params.items())))

    def __eq__(self, other):
        return isinstance(other, Op) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


@attrs.frozen(repr=False)
class Grad:
    """`torch.func.grad` of a scalar loss over a sub-program: `outs` are the gradients with
    respect to `args` (one each), the loss function runs `body` on them and returns `loss`.

    >>> grad = Grad(outs=("v3",), args=("x0",), body=(Op("v2", "sum_all", "x0"),), loss="v2")
    >>> print("\\n".join(grad.lines()))
    def loss_v3(x0):
        v2 = x0.sum()
        return v2
    v3 = torch.func.grad(loss_v3)(x0)
    """

    outs: tuple = attrs.field(converter=tuple)
    args: tuple = attrs.field(converter=tuple)
    body: tuple = attrs.field(converter=tuple)
    loss: str = ""

    @property
    def out(self) -> str:
        return self.outs[0]

    def lines(self, indent: str = "") -> list[str]:
        name = f"loss_{self.outs[0]}"
        lines = [f"{indent}def {name}({', '.join(self.args)}):"]
        lines += [line for op in self.body for line in op.lines(indent + "    ")]
        lines.append(f"{indent}    return {self.loss}")
        if len(self.args) == 1:
            return lines + [f"{indent}{self.outs[0]} = torch.func.grad({name})({self.args[0]})"]
        argnums = tuple(range(len(self.args)))
        return lines + [f"{indent}{', '.join(self.outs)} = torch.func.grad({name}, argnums={argnums})({', '.join(self.args)})"]

    def kinds(self) -> set[str]:
        return {"grad"}.union(*(op.kinds() for op in self.body))

    def __repr__(self) -> str:
        body = "".join(f"\n            {op!r}," for op in self.body)
        return f"Grad(outs={self.outs!r}, args={self.args!r}, body=({body}\n        ), loss={self.loss!r})"


@attrs.frozen(repr=False)
class Input:
    """An argument: `layout` in the compact notation (`"[S(0), P(sum)]"`, one placement per mesh
    axis). Passed as an `hpfun.Sharded` value when `sharded` (always, with Partial placements),
    else as a tensor with the layout's `P` spec. Values are fixed by the program's seed: floats
    on a grid of 1/16 in [-4, 4] times `scale`; ints in [0, high) (a fifth -100 when `ignore`);
    bools about 3/4 True. `contiguous=False` passes the tensor column-major."""

    name: str
    shape: tuple = attrs.field(converter=tuple)
    dtype: str = "float64"
    layout: str = ""
    sharded: bool = False
    scale: float = 1.0
    high: int = 2
    ignore: bool = False
    contiguous: bool = True

    def value(self, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(self.name.encode()))
        if self.dtype == "bool":
            return torch.rand(self.shape, generator=generator) < 0.75
        if self.dtype == "int64":
            ids = torch.randint(0, self.high, self.shape, generator=generator)
            if self.ignore:
                ids = ids.masked_fill(torch.rand(self.shape, generator=generator) < 0.2, -100)
            return ids
        grid = torch.randint(-64, 65, self.shape, generator=generator, dtype=torch.float64) / 16
        return (grid * self.scale).to(getattr(torch, self.dtype))

    def __repr__(self) -> str:
        defaults = attrs.fields_dict(Input)
        extra = "".join(f", {k}={getattr(self, k)!r}" for k in ("sharded", "scale", "high", "ignore", "contiguous")
                        if getattr(self, k) != defaults[k].default)
        return f"Input({self.name!r}, {self.shape!r}, {self.dtype!r}, {self.layout!r}{extra})"


@attrs.frozen(repr=False)
class Program:
    """A whole program: run it with `run_program`, read it with `source()`; `repr` rebuilds it.

    `mesh` is (shape, axis names); `out_specs` is None (keep hpfun's layouts) or one `P` per
    output; `seed` fixes the input values and the random seed of the call."""

    mesh: tuple = attrs.field(converter=lambda m: (tuple(m[0]), tuple(m[1])))
    inputs: tuple = attrs.field(converter=tuple)
    ops: tuple = attrs.field(converter=tuple)
    outputs: tuple = attrs.field(converter=tuple)
    out_specs: tuple | None = attrs.field(default=None, converter=lambda s: None if s is None else tuple(s))
    seed: int = 0

    def source(self) -> str:
        lines = [f"def f({', '.join(i.name for i in self.inputs)}):"]
        lines += [line for op in self.ops for line in op.lines("    ")]
        return "\n".join(lines + [f"    return ({', '.join(self.outputs)},)"])

    def kinds(self) -> set[str]:
        return set().union(*(op.kinds() for op in self.ops))

    @property
    def random(self) -> bool:
        return bool(self.kinds() & RANDOM_KINDS)

    @property
    def float32(self) -> bool:
        return "float" in self.kinds() or any(i.dtype == "float32" for i in self.inputs)

    def mesh_value(self) -> Mesh:
        return Mesh.simulated(*self.mesh)

    def function(self):
        """The program as a Python function (its source registered, so tracebacks show it)."""
        source = self.source()
        filename = f"<hpfun-fuzz-{zlib.crc32(source.encode()):08x}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = dict(NAMESPACE)
        exec(compile(source, filename, "exec"), namespace)
        return namespace["f"]

    def arguments(self) -> tuple[list, tuple]:
        """The arguments (tensors or `Sharded` values) and the in_specs to pass with them."""
        mesh, args, specs = self.mesh_value(), [], []
        for i in self.inputs:
            layout = parse(i.layout, mesh)
            value = i.value(self.seed)
            if layout.partial_axes:
                args.append(_with_partial_terms(value, layout, self.seed + zlib.crc32(i.name.encode())))
                specs.append(None)
            elif i.sharded:
                args.append(Sharded.from_global(value, layout))
                specs.append(None)
            else:
                args.append(value if i.contiguous else value.mT.contiguous().mT)
                specs.append(P.from_layout(layout, len(i.shape)))
        return args, tuple(specs)

    def script(self) -> str:
        """A standalone script that runs the program through hpfun and compares."""
        return "\n".join([
            "import torch, torch.nn.functional as F, hpfun",
            "from hpfun import P",
            "from hpfun.testing.fuzz import *",
            f"program = {self!r}",
            "print(run_program(program))",
        ])

    def __repr__(self) -> str:
        def block(items):
            return "".join(f"\n        {item!r}," for item in items)

        specs = "None" if self.out_specs is None else "(" + "".join(f"{s}, " for s in self.out_specs).rstrip() + ")"
        return (f"Program(\n    mesh={self.mesh!r},\n    inputs=({block(self.inputs)}\n    ),\n"
                f"    ops=({block(self.ops)}\n    ),\n    outputs={self.outputs!r},\n    out_specs={specs},\n"
                f"    seed={self.seed!r},\n)")
