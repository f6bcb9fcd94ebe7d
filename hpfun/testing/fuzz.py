"""Whole-program differential fuzzing: random programs run whole and through `hpfun.shard`.

A `Program` is data: a mesh, its inputs (shape, dtype, layout), a list of op records (`Op`, and
`Grad` for `torch.func.grad` of a scalar loss over a sub-program), its outputs and out_specs.
Its `repr` is Python that rebuilds it, so a failing program pastes into a regression test;
`source()` is the plain torch function it runs. `programs()` is the hypothesis strategy that
draws them: DAGs of 3-12 ops from a menu of what training steps use (matmuls and einsums,
broadcasting pointwise ops including ones that make inf and NaN, reductions, softmax, views,
cat/split, gathers, norms, cross-entropy, attention, cumsum, casts, random ops, gradients), on
meshes of up to 8 ranks with 1 to 3 axes, inputs split, replicated or Partial.

`run_program` is the oracle: the program unsharded in float64 (or, when it draws random
numbers, through hpfun on one device with the same seed, since hpfun's generator is not
eager's) against the gathered sharded outputs, to 1e-9 (1e-5 where it computes in float32),
NaN and inf where they are. Its `Outcome` is `ok`, `user_error` (an `hpfun.HpfunError` raised
before anything runs: allowed), `wrong` (values differ) or `internal` (any other exception).

>>> import hpfun
>>> from hpfun import P
>>> program = Program(
...     mesh=((2,), ("dp",)),
...     inputs=(Input("x0", (4, 6), "float64", "[S(0)]"),),
...     ops=(Op("v1", "softmax", "x0", dim=1), Op("v2", "sum", "v1", dim=0, keepdim=False)),
...     outputs=("v2",),
...     out_specs=(P(),),
... )
>>> print(program.source())
def f(x0):
    v1 = torch.softmax(x0, dim=1)
    v2 = v1.sum(dim=0, keepdim=False)
    return (v2,)
>>> run_program(program).kind
'ok'
"""

from __future__ import annotations

import collections
import linecache
import math
import os
import sys
import traceback
import warnings
import zlib

import attrs
import torch
import torch.nn.functional as F

import hpfun
from hpfun.errors import HpfunError
from hpfun.layout import P, parse
from hpfun.mesh import Mesh
from hpfun.sharded import Sharded
from hpfun.testing.strategies import _with_partial_terms

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}

# ---------------------------------------------------------------------------------------------
# Programs as data
# ---------------------------------------------------------------------------------------------


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
_NAMESPACE = {"torch": torch, "F": F, "hpfun": hpfun, "P": P}  # what a program's source may use


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
        namespace = dict(_NAMESPACE)
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


# ---------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------

OUTCOMES = ("ok", "user_error", "wrong", "internal")


@attrs.frozen
class Outcome:
    """What running a program sharded gave: `kind` one of OUTCOMES; `stage` where it was decided
    (lower, run, full, compare, or harness: the unsharded reference or the comparison itself);
    `error` the exception's type; `detail` the message."""

    kind: str
    stage: str = ""
    error: str = ""
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.kind in ("ok", "user_error")

    def __str__(self) -> str:
        head = self.kind + (f" at {self.stage}" if self.stage else "") + (f": {self.error}" if self.error else "")
        return head + (f"\n{self.detail}" if self.detail else "")


class FuzzFailure(AssertionError):
    """A program whose sharded run was wrong or crashed; `program` and `outcome` are kept."""

    def __init__(self, program: Program, outcome: Outcome):
        self.program, self.outcome = program, outcome
        super().__init__(f"{outcome}\n\nprogram:\n{program!r}\n\nsource:\n{program.source()}")


def _failed(stage: str, err: BaseException) -> Outcome:
    kind = "user_error" if isinstance(err, HpfunError) and stage == "lower" else "internal"
    where = traceback.extract_tb(err.__traceback__)[-1:]
    at = f"\n  raised at {where[0].filename}:{where[0].lineno}" if where else ""
    return Outcome(kind, stage, type(err).__name__, str(err).strip()[:2000] + at)


def _run_sharded(program: Program, f, mesh: Mesh, args, in_specs, out_specs):
    """(outputs gathered, None) or (None, the Outcome of a failure)."""
    sharded = hpfun.shard(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    try:
        sharded.lower(*args)
    except Exception as err:  # every exception is classified
        return None, _failed("lower", err)
    try:
        with hpfun.random_seed(program.seed):
            outputs = sharded(*args)
    except Exception as err:
        return None, _failed("run", err)
    try:
        return [o.full() for o in outputs], None
    except Exception as err:
        return None, _failed("full", err)


def _reference(program: Program, f, whole: list):
    """The expected outputs: eager, or hpfun on one device (a mesh of the same axes, all of size
    1) for programs drawing random numbers."""
    if not program.random:
        return list(f(*whole)), None
    names = program.mesh[1]  # hpfun.constrain in the program names them
    one = Mesh.simulated((1,) * len(names), names)
    expected, failure = _run_sharded(program, f, one, whole, tuple(P() for _ in whole), None)
    if failure is not None:
        failure = attrs.evolve(failure, stage="one-device " + failure.stage)
    return expected, failure


def _whole(x):
    return x.full() if isinstance(x, Sharded) else x


def run_program(program: Program) -> Outcome:
    """Run `program` unsharded and through `hpfun.shard` on its mesh and classify the result:
    every output, and every input after the call (ops in place write back), must match.

    Random programs are compared with hpfun's own one-device run with the same seed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # std of one element, fallbacks...: the outcome is what counts
        try:
            return _run(program)
        except Exception as err:  # the reference itself, or the comparison, failed: never lose the program
            return _failed("harness", err)


def _run(program: Program) -> Outcome:
    f = program.function()
    args, in_specs = program.arguments()
    whole = [_whole(a).clone() for a in args]  # clone: in-place ops must not touch the sharded run's inputs
    expected, failure = _reference(program, f, whole)
    if failure is not None:
        return failure
    got, failure = _run_sharded(program, f, program.mesh_value(), args, in_specs, program.out_specs)
    if failure is not None:
        return failure
    tolerance = TOLERANCE[torch.float32 if program.float32 else torch.float64]
    pairs = [(f"outputs[{i}] ({name})", want, have)
             for i, (name, want, have) in enumerate(zip(program.outputs, expected, got, strict=True))]
    pairs += [(f"input {i.name} after the call", want, _whole(have))
              for i, want, have in zip(program.inputs, whole, args, strict=True)]
    for where, want, have in pairs:
        problem = compare(want, have, tolerance)
        if problem:
            return Outcome("wrong", "compare", "", f"{where}: {problem}")
    return Outcome("ok")


def check_program(program: Program, allow_user_error: bool = True) -> Outcome:
    """`run_program`, raising `FuzzFailure` unless the outcome is ok (or a clear user error)."""
    outcome = run_program(program)
    if outcome.kind != "ok" and not (allow_user_error and outcome.kind == "user_error"):
        raise FuzzFailure(program, outcome)
    return outcome


@attrs.define
class FuzzReport:
    """The outcomes of a fuzzing run, one `(program, outcome)` per program run."""

    results: list = attrs.Factory(list)
    progress: object = None  # a stream: each failure as it happens, and counts every 100 programs

    def add(self, program: Program, outcome: Outcome) -> None:
        self.results.append((program, outcome))
        if self.progress is not None and not outcome.passed:  # seen at once, not after hours
            print(f"{'=' * 100}\n{FuzzFailure(program, outcome)}\n{'=' * 100}", file=self.progress, flush=True)
        if self.progress is not None and len(self.results) % 100 == 0:
            counts = self.counts()
            print(f"{len(self.results)} programs: " + ", ".join(f"{k} {counts[k]}" for k in OUTCOMES),
                  file=self.progress, flush=True)

    def counts(self) -> collections.Counter:
        return collections.Counter(outcome.kind for _, outcome in self.results)

    def failures(self) -> list:
        return [(p, o) for p, o in self.results if not o.passed]

    def summary(self) -> str:
        """Counts per outcome, the user errors by kind, then every failure in full."""
        counts = self.counts()
        lines = [f"{len(self.results)} programs: " + ", ".join(f"{k} {counts[k]}" for k in OUTCOMES)]
        errors = collections.Counter(_gist(o) for _, o in self.results if o.kind == "user_error")
        lines += [f"  user error x{n}: {what}" for what, n in errors.most_common()]
        for program, outcome in self.failures():
            lines += ["", "=" * 100, str(FuzzFailure(program, outcome))]
        return "\n".join(lines)


def _gist(outcome: Outcome) -> str:
    """A user error in one line: its type and its first problem, without the program's line."""
    lines = [line.strip() for line in outcome.detail.splitlines() if line.strip()] or [""]
    first = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]
    return f"{outcome.error}: {first.split(', from <hpfun-fuzz')[0].split(' at <hpfun-fuzz')[0][:150]}"


def fuzz(examples: int = 50, seed: int | None = None, report: FuzzReport | None = None, **strategy) -> FuzzReport:
    """Run `examples` distinct random programs (`programs(**strategy)`) through `run_program`.

    `seed=None` draws the same programs every time (hypothesis derandomized); an int draws
    others. Nothing stops at a failure: every outcome is in the report (pass one in to see
    the outcomes of a run that is interrupted).

    >>> fuzz(examples=2, max_ops=3).counts()["wrong"]
    0
    """
    from hypothesis import HealthCheck, Phase, assume, given, settings
    from hypothesis import seed as seeded

    report = FuzzReport() if report is None else report
    seen: set = set()

    @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate], derandomize=seed is None,
              suppress_health_check=list(HealthCheck))
    @given(programs(**strategy))
    def run(program):
        # hypothesis spends most calls on small mutations of earlier programs: run each program once
        key = (program.mesh, program.source())
        assume(key not in seen)
        seen.add(key)
        report.add(program, run_program(program))

    (run if seed is None else seeded(seed)(run))()
    return report


def compare(want: torch.Tensor, have: torch.Tensor, tolerance: float) -> str:
    """Why `have` is not `want` ("" when it is): shape, dtype, the NaN and inf pattern, then the
    finite values, close norm-wise (relative) or elementwise (|a - b| <= tol * (1 + |b|))."""
    if tuple(want.shape) != tuple(have.shape) or want.dtype != have.dtype:
        return f"expected {want.dtype} {tuple(want.shape)}, got {have.dtype} {tuple(have.shape)}"
    if not (want.is_floating_point() or want.is_complex()):
        bad = (want != have).nonzero()
        return f"{len(bad)} elements differ, first at {tuple(bad[0].tolist())}" if len(bad) else ""
    a, b = have.double(), want.double()
    for name, mask in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        if not torch.equal(mask(a), mask(b)):
            where = tuple((mask(a) != mask(b)).nonzero()[0].tolist())
            return f"{name} pattern differs, first at {where}: expected {b[where].item()}, got {a[where].item()}"
    finite = torch.isfinite(b)
    a, b = a[finite], b[finite]
    if not b.numel():
        return ""
    err, norm = (a - b).abs(), torch.linalg.vector_norm(b)
    relative = float(torch.linalg.vector_norm(a - b) / norm.clamp_min(1e-300))
    if relative <= tolerance or bool((err <= tolerance * (1 + b.abs())).all()):
        return ""
    worst = int(err.argmax())
    return (f"values differ: norm-wise relative error {relative:.3g}, largest at finite element {worst}: "
            f"expected {b[worst].item()}, got {a[worst].item()}")


# ---------------------------------------------------------------------------------------------
# The strategy
# ---------------------------------------------------------------------------------------------


def programs(min_ops: int = 3, max_ops: int = 12, max_ranks: int = 8, random_ops: bool = True, grad: bool = True):
    """A hypothesis strategy for random `Program`s of `min_ops` to `max_ops` ops (a gradient
    counts one plus its loss's ops) on simulated meshes of 1 to 3 axes and at most `max_ranks`
    ranks; `random_ops` and `grad` allow random ops and gradients. Drawn by
    `hpfun.testing.fuzz_menu`.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=3, deadline=None, database=None)
    ... @given(programs(max_ops=4))
    ... def check(program):
    ...     assert run_program(program).passed, program
    >>> check()
    """
    from hpfun.testing.fuzz_menu import draw_program

    return draw_program(min_ops=min_ops, max_ops=max_ops, max_ranks=max_ranks, random_ops=random_ops, grad=grad)


def main(argv=None) -> int:
    """`python -m hpfun.testing.fuzz --examples 2000 --seed 1`: fuzz, print the report, exit 1 on failures."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hpfun.testing.fuzz", description=main.__doc__)
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=None, help="default: the derandomized programs the suite runs")
    parser.add_argument("--max-ops", type=int, default=12)
    parser.add_argument("--out", default=None, help="also write the report to this file")
    options = parser.parse_args(argv)
    report = FuzzReport(progress=sys.stderr)
    try:
        fuzz(options.examples, options.seed, report, max_ops=options.max_ops)
    finally:
        summary = report.summary()
        print(summary, flush=True)
        if options.out:
            os.makedirs(os.path.dirname(options.out) or ".", exist_ok=True)
            with open(options.out, "w") as out:
                command = " ".join(argv if argv is not None else sys.argv[1:])
                out.write(f"python -m hpfun.testing.fuzz {command}\n{summary}\n")
    return 1 if report.failures() else 0


if __name__ == "__main__":
    raise SystemExit(main())
