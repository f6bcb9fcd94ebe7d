"""Check every sharding rule against unsharded ground truth: `python -m hpfun.validate`.

For each op in the registry, hypothesis draws a mesh (1-D or 2-D, at most 8 ranks), a layout
per tensor input (several axes on one dim, Partial for floating and complex inputs) and the op's arguments,
runs the op through `hpfun.shard` on the simulated mesh and whole, and compares. Arguments come
from torch's OpInfo samples: each sample is traced the way hpfun captures (functionalized,
decomposed) and every op call in the trace becomes a case with its real arguments. OpInfo
shapes (5, 10, 20) rarely divide a mesh, so for families whose integer arguments are dims,
never sizes (pointwise, reductions, normalizations, contractions), a case is also rescaled to
sizes the mesh divides. OpInfos that take complex numbers are traced a second time in
complex128, so rules see complex values (and complex Partial sums) too. Each op gets a time
budget.

Results, one line per op: `ok`; `INCORRECT` (wrong values, with the smallest failing mesh,
layouts and shapes found); `CRASH` (an exception other than a clean hpfun error); `MISSING` (an
op in an OpInfo trace without a rule); `NO INPUTS` (no sample reaches the op, or every example
was refused); `SKIPPED` (capture decomposes the op, so its rule never runs; random ops, except
their cases that draw nothing: fused attention without dropout is checked). The
exit code is 1 when any rule is incorrect or crashes.

    python -m hpfun.validate                      # every rule, 10 examples each
    python -m hpfun.validate --op aten.mm.default --max-examples 200 --seed 3
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import math
import os
import sys
import time
import traceback
import unittest.mock
import warnings

import attrs
import hypothesis
import torch
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from hpfun.capture import decompositions
from hpfun.errors import HpfunError, InternalError
from hpfun.layout import REDUCE_OPS, Layout, Partial
from hpfun.rules.base import OpCall, Rule, TensorArg, TensorMeta
from hpfun.rules.registry import FAMILIES, REGISTRY, resolve_op
from hpfun.sharded import Sharded
from hpfun.testing import ShardedMismatch, assert_sharded_equal
from hpfun.testing.strategies import layouts, meshes, sharded_values

# Families whose integer arguments are dims, never sizes or indices: their cases can take
# other sizes. Families that only move data must match bitwise.
RESCALABLE = tuple(FAMILIES[f] for f in ("pointwise", "like", "reduction", "normalize", "contraction"))
MOVES_DATA = tuple(FAMILIES[f] for f in ("reshape", "permute", "expand", "slice", "cat", "gather", "like"))
MAX_RANKS = 8
_SCANNED = 32  # samples of an OpInfo looked at for new kinds of arguments
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# capture's table, built once: building it takes about 20 ms, as long as tracing a sample
_decompositions = functools.cache(decompositions)


# ---------------------------------------------------------------------------------------------
# Cases: one op call with real arguments
# ---------------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class OpCase:
    """One call of `op` with real arguments, from the OpInfo named `source`."""

    op: object
    args: tuple
    kwargs: dict
    source: str

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [x for x in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(x, torch.Tensor)]

    def call(self, *tensors):
        """The op on `tensors` in place of this case's tensor arguments."""
        case = self.with_tensors(tensors)
        return self.op(*case.args, **case.kwargs)

    def with_tensors(self, tensors, source: str | None = None) -> "OpCase":
        """This case with `tensors` in place of its tensor arguments."""
        leaves, spec = pytree.tree_flatten((self.args, self.kwargs))
        fresh = iter(tensors)
        args, kwargs = pytree.tree_unflatten([next(fresh) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        return OpCase(self.op, args, kwargs, source or self.source)

    @property
    def is_complex(self) -> bool:
        return any(t.is_complex() for t in self.tensors)

    def signature(self) -> tuple:
        shapes = tuple((tuple(t.shape), t.dtype) for t in self.tensors)
        others = [x for x in pytree.tree_leaves((self.args, self.kwargs)) if not isinstance(x, torch.Tensor)]
        return shapes, repr(others)

    def __str__(self) -> str:
        def show(x):
            if isinstance(x, torch.Tensor):
                return f"<{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}>"
            return repr(x)

        args = [show(a) if not isinstance(a, (list, tuple)) else f"[{', '.join(map(show, a))}]" for a in self.args]
        args += [f"{k}={show(v)}" for k, v in self.kwargs.items()]
        return f"{self.op}({', '.join(args)}) from OpInfo {self.source}"


class _Recorder(torch.fx.Interpreter):
    """Runs a traced graph on real inputs and keeps every op call's real arguments."""

    def __init__(self, gm, source: str):
        super().__init__(gm)
        self.source, self.calls = source, []

    def run_node(self, n):
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            self.calls.append(OpCase(n.target, args, kwargs, self.source))
        return super().run_node(n)


def traced_calls(fn, tensors: list, source: str) -> list[OpCase]:
    """Every op call of `fn(*tensors)` as hpfun captures it (functionalized, decomposed)."""
    gm = make_fx(torch.func.functionalize(fn, remove="mutations"), decomposition_table=_decompositions(),
                 tracing_mode="fake")(*tensors)
    recorder = _Recorder(gm, source)
    recorder.run(*tensors)
    return recorder.calls


# ---------------------------------------------------------------------------------------------
# The OpInfo index: op overload -> cases, and which OpInfos reach each op
# ---------------------------------------------------------------------------------------------


@attrs.define
class Index:
    """Cases per op overload, and the OpInfos whose traces reach each op (rule or not)."""

    cases: dict = attrs.Factory(dict)  # op -> [OpCase]
    seen_by: dict = attrs.Factory(dict)  # op -> {OpInfo name}
    # (op, is complex) -> signatures of the cases kept: each case's is computed once, when it is
    # offered (recomputed over every kept case at each offer, it was a sixth of the index's time)
    _kept: dict = attrs.Factory(dict)

    def add(self, case: OpCase, limit: int) -> None:
        self.seen_by.setdefault(case.op, set()).add(case.source)
        known = self.cases.setdefault(case.op, [])
        # complex cases count apart, so the real ones of an OpInfo traced first leave them room
        kept = self._kept.setdefault((case.op, case.is_complex), set())
        if len(kept) < limit and (signature := case.signature()) not in kept:
            kept.add(signature)
            known.append(case)


def portable_index(samples: int = 3, cases_per_op: int = 8) -> list:
    """`opinfo_index`, with each op named by its qualified name: an OpOverload does not pickle,
    so this is what a fresh process builds and hands back (`from_portable`). A fresh process
    traces faster than a long-lived one: fx's tracer patches `torch.nn.Module` at every trace,
    and each patch walks every subclass defined so far (a test suite's, a model library's)."""
    return to_portable(opinfo_index(samples, cases_per_op))


def to_portable(index: Index) -> dict:
    """`index` with its ops by qualified name, and the modules loaded here (see `from_portable`)."""
    entries = [(op.name(), sorted(index.seen_by[op]), [(c.args, c.kwargs, c.source) for c in index.cases.get(op, [])])
               for op in index.seen_by]
    return {"modules": sorted(sys.modules), "entries": entries}


def write_portable_index(path: str, log: str | None = None) -> None:
    """`portable_index` pickled to `path` (the target of a process building the index), or an
    empty `path + ".failed"` if that raised; the process's output (torch's warnings about the
    ops sampled, a traceback) goes to `log`."""
    import pickle

    if log is not None:
        with open(log, "w") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
    try:
        data = portable_index()
        with open(path + ".part", "wb") as f:
            pickle.dump(data, f)
        os.replace(path + ".part", path)
    except BaseException:
        open(path + ".failed", "w").close()  # (for readers that are not this process's parent)
        raise


def read_portable_index(path: str) -> Index:
    """The Index `write_portable_index` wrote to `path`."""
    import pickle

    with warnings.catch_warnings(), open(path, "rb") as f:  # (sparse samples made again warn of their beta format)
        warnings.simplefilter("ignore")
        return from_portable(pickle.load(f))


def from_portable(data: dict, cases_per_op: int = 8) -> Index:
    """The Index `portable_index` described, its ops found again by name (the modules that
    defined them imported here too: torch registers some ops when a module is first imported)."""
    for module in data["modules"]:
        if module not in sys.modules and module.startswith(("torch.", "transformers.integrations")):
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001 - a module that imports only where it was: its ops are not needed
                pass
    index = Index()
    for name, sources, cases in data["entries"]:
        op = _op_named(name)
        index.seen_by[op] = set(sources)
        for args, kwargs, source in cases:
            index.add(OpCase(op, args, kwargs, source), cases_per_op)
    return index


def _op_named(qualified: str):
    """`aten::add.Tensor` -> torch.ops.aten.add.Tensor."""
    namespace, name = qualified.split("::", 1)
    packet, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def opinfo_db():
    """torch's OpInfo table (needs the `expecttest` package, in hpfun's dev extra)."""
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError as err:
        raise SystemExit(f"hpfun.validate needs torch's OpInfo tables: {err} (pip install expecttest)") from None
    return op_db


def opinfo_index(samples: int = 3, cases_per_op: int = 8) -> Index:
    """Trace up to 2 * `samples` samples of each OpInfo (the first `samples`, then new kinds of
    arguments among the first 32) and the backward of the first, and, for OpInfos taking
    complex128, the first complex sample and its backward; keep `cases_per_op` distinct real
    cases per op, and as many complex ones."""
    index = Index()
    # one seed for the whole pass (samples are drawn in a fixed order, so the index is the same
    # each run): OpInfo reseeds before every sample by default, at about 1 ms a time. OpInfo's
    # sample iterators look for the unittest method calling them with inspect.stack(), which
    # reads the source of every frame: half of the pass's time, a third more under pytest.
    from torch.testing._internal import common_utils

    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]), \
            unittest.mock.patch.object(common_utils, "extract_test_fn", lambda: None):
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        for info in opinfo_db():
            for case in _opinfo_calls(info, samples):
                index.add(case, cases_per_op)
        for case in library_calls() + decomposition_calls():
            index.add(case, cases_per_op)
    return index


def decomposition_calls() -> list[OpCase]:
    """Cases for ops torch's decompositions write at dtypes OpInfo's samples do not trace
    (renorm in float16 casts with prims.convert_element_type)."""
    g = torch.Generator().manual_seed(0)
    calls = []
    for src, dst in ((torch.float16, torch.float32), (torch.float32, torch.float16), (torch.float64, torch.float32)):
        x = torch.randn(4, 6, generator=g).to(src)
        calls += _try_trace(torch.ops.prims.convert_element_type.default, [x, dst], "prims.convert_element_type")
    return calls


def library_calls() -> list[OpCase]:
    """Cases for the ops of other libraries that have rules and no OpInfo, where the library is
    installed: transformers' grouped matmuls (rows sorted by expert; an expert with no rows too)."""
    try:
        import transformers.integrations.moe  # noqa: F401 - defines torch.ops.transformers' grouped matmuls
        ops = torch.ops.transformers
        forward, backward = ops.grouped_mm_fallback.default, ops.grouped_mm_fallback_backward.default
    except Exception:  # noqa: BLE001 - not installed, or a version without them: no cases
        return []
    g = torch.Generator().manual_seed(0)
    calls = []
    for counts in ([2, 2, 2, 2], [0, 3, 5, 0]):
        x, w, grad = (torch.randn(*shape, dtype=torch.float64, generator=g) for shape in ((8, 8), (4, 8, 8), (8, 8)))
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        calls += _try_trace(forward, [x, w, offs], "transformers.grouped_mm_fallback")
        calls += _try_trace(backward, [x, w, offs, grad], "transformers.grouped_mm_fallback")
    return calls


def _opinfo_calls(info, samples: int) -> list[OpCase]:
    calls = []
    for dtype in _dtypes(info):
        # complex samples: the first only (with its backward), the rest would double the index's time
        n = samples if not dtype.is_complex else 1
        try:
            scanned = itertools.islice(info.sample_inputs("cpu", dtype, set_seed=False), _SCANNED)
            chosen = itertools.islice(_chosen_samples(scanned, n), n if dtype.is_complex else 2 * n)
            for i, sample in enumerate(chosen):
                backward = i == 0 and info.supports_autograd and (dtype.is_floating_point or dtype.is_complex)
                calls += _sample_calls(info, sample, backward=backward)
        except Exception:  # a sample generator that fails here only means fewer cases
            pass
    return calls


def _chosen_samples(samples, first: int):
    """The first `first` samples, then the first of each new kind of arguments (a Python
    scalar where a tensor was, another keyword...), which often reaches another overload."""
    kinds = set()
    for i, sample in enumerate(samples):
        leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        kind = (str(spec), tuple(type(x).__name__ for x in leaves))
        if i < first or kind not in kinds:
            yield sample
        kinds.add(kind)


def _dtypes(info) -> list:
    """The dtype an OpInfo's samples are drawn in (the first of float64, float32, int64, bool
    it supports), and complex128 when it supports that too."""
    dtypes = info.dtypes
    first = next((d for d in (torch.float64, torch.float32, torch.int64, torch.bool) if d in dtypes), None)
    return [d for d in (first, torch.complex128) if d is not None and d in dtypes]


def _sample_calls(info, sample, backward: bool) -> list[OpCase]:
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def forward(*tensors):
        full = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            full[i] = t
        x, args, kwargs = pytree.tree_unflatten(full, spec)
        return info.op(x, *args, **kwargs)

    tensors = [leaves[i] for i in where]
    calls = _try_trace(forward, tensors, info.name)
    if backward and calls:
        calls += _try_trace(_vjp(forward), tensors, info.name)
    return calls


def _vjp(forward):
    def backward(*tensors):
        out, pull = torch.func.vjp(forward, *tensors)
        return pull(pytree.tree_map_only(torch.Tensor, torch.ones_like, out))
    return backward


def _try_trace(fn, tensors, source) -> list[OpCase]:
    try:
        return traced_calls(fn, tensors, source)
    except Exception:  # samples hpfun cannot capture (data-dependent shapes...) give no cases
        return []


# ---------------------------------------------------------------------------------------------
# Drawing examples
# ---------------------------------------------------------------------------------------------


def _divisors(case: OpCase) -> list[int]:
    """Axis sizes that split some dim of the case (2 always: Partial needs no split)."""
    dims = {n for t in case.tensors for n in t.shape}
    return sorted({2} | {d for d in range(2, MAX_RANKS + 1) for n in dims if n % d == 0})


def _factors(mesh) -> list[int]:
    subsets = itertools.chain.from_iterable(itertools.combinations(mesh.shape, k) for k in range(1, mesh.ndim + 1))
    return sorted({math.prod(s) for s in subsets} - {1}) or [2]


@st.composite
def _rescaled(draw, case: OpCase, mesh) -> OpCase:
    """The case with every size other than 0 and 1 mapped to a multiple of the mesh's axes
    (equal sizes to equal sizes, so contractions stay consistent), fresh values of each dtype."""
    sizes = sorted({n for t in case.tensors for n in t.shape} - {0, 1})
    choices = sorted({f * k for f in _factors(mesh) for k in (1, 2, 3)})
    new = {n: draw(st.sampled_from(choices)) for n in sizes}
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    tensors = [_like(t, tuple(new.get(n, n) for n in t.shape), generator) for t in case.tensors]
    return case.with_tensors(tensors, f"{case.source}, rescaled")


def _like(template: torch.Tensor, shape, generator) -> torch.Tensor:
    """Random values of the template's dtype (non-negative where the template is)."""
    if template.is_complex():
        return torch.randn(shape, generator=generator, dtype=torch.complex128).to(template.dtype)
    if template.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if not template.is_floating_point():
        return torch.randint(-3, 4, shape, generator=generator).to(template.dtype)
    values = torch.randn(shape, generator=generator, dtype=torch.float64)
    nonnegative = template.numel() and bool((template >= 0).all())
    return (values.abs() if nonnegative else values).to(template.dtype)


@st.composite
def examples(draw, rule: Rule, cases: list[OpCase]):
    """(mesh, case): an OpInfo case on a mesh fitted to its sizes, or a rescaled one."""
    case = draw(st.sampled_from(cases))
    if isinstance(rule, RESCALABLE) and draw(st.booleans()):
        mesh = draw(meshes(MAX_RANKS, ndims=(1, 2), sizes=(1, 2, 3, 4, 8)))
        return mesh, draw(_rescaled(case, mesh))
    return draw(meshes(MAX_RANKS, ndims=(1, 2), sizes=_divisors(case))), case


@st.composite
def inputs(draw, rule: Rule, case: OpCase, mesh) -> list[Sharded]:
    """A Sharded value per tensor of the case. A floating or complex input is Partial at times,
    with the reduces the rule lets through without a collective when it has some (the algebra
    to check), else any reduce (which checks the redistribution in front of the op); complex
    inputs are only ever Partial(sum) or Partial(avg), since complex numbers have no order."""
    values, outputs = [], _output_metas(case)
    for i, t in enumerate(case.tensors):
        partial = False
        if t.dtype in (torch.float32, torch.float64):  # Partial terms are exact on their grid
            partial = _passed_partials(rule, case, outputs, mesh, i) or True
        elif t.dtype in (torch.complex64, torch.complex128):
            passed = _passed_partials(rule, case, outputs, mesh, i)
            partial = tuple(r for r in passed if r in _COMPLEX_REDUCES) or _COMPLEX_REDUCES
        layout = draw(layouts(mesh, tuple(t.shape), allow_partial=partial))
        values.append(draw(_sharded_values(t, layout)))
    return values


_COMPLEX_REDUCES = ("sum", "avg")


def _sharded_values(t: torch.Tensor, layout: Layout):
    """`sharded_values`, for a complex Partial value through its (real, imag) pairs: the terms
    then lie on the grid in both parts and spread over the ranks in both."""
    if not (t.is_complex() and layout.partial_axes):
        return sharded_values(t, layout)
    layout = layout.normalized(t.ndim)  # the pairs' extra trailing dim is never split
    pairs = torch.view_as_real(t).contiguous()
    return sharded_values(pairs, layout).map(lambda v: Sharded(
        layout, tuple(t.shape), tuple(torch.view_as_complex(s.contiguous()) for s in v.shards)))


def _passed_partials(rule: Rule, case: OpCase, outputs: tuple, mesh, i: int) -> tuple[str, ...]:
    """Reduces r such that some strategy of the rule keeps tensor `i` Partial(r) on axis 0."""
    replicated = Layout.replicated(mesh)
    passed = []
    for reduce in REDUCE_OPS:
        given = replicated.with_placement(0, Partial(reduce))
        layouts_in = [given if j == i else replicated for j in range(len(case.tensors))]
        if any(s.inputs[i] == given for s in rule.strategies(_op_call(case, outputs, mesh, layouts_in))):
            passed.append(reduce)
    return tuple(passed)


def _output_metas(case: OpCase) -> tuple[TensorMeta, ...]:
    outputs = pytree.tree_leaves(case.call(*case.tensors))
    return tuple(TensorMeta(tuple(o.shape), o.dtype) for o in outputs if isinstance(o, torch.Tensor))


def _op_call(case: OpCase, outputs: tuple, mesh, layouts_in: list) -> OpCall:
    """The OpCall the rule sees for this case with these input layouts (as propagate builds it)."""
    given = iter(layouts_in)

    def convert(index):
        return lambda x: TensorArg(tuple(x.shape), x.dtype, next(given), index) if isinstance(x, torch.Tensor) else x

    args = tuple(pytree.tree_map(convert(i), a) for i, a in enumerate(case.args))
    kwargs = {k: pytree.tree_map(convert(len(case.args) + j), v) for j, (k, v) in enumerate(case.kwargs.items())}
    return OpCall(case.op, args, kwargs, outputs, mesh)


# ---------------------------------------------------------------------------------------------
# Checking one op
# ---------------------------------------------------------------------------------------------

STATUSES = ("ok", "INCORRECT", "CRASH", "MISSING", "NO INPUTS", "SKIPPED")


@attrs.define
class OpResult:
    """What validation found for one op; `detail` is the reproducer or the reason."""

    op: object
    status: str
    note: str = ""
    detail: str = ""
    seconds: float = 0.0


@attrs.define
class _Run:
    """State of one op's hypothesis run (what hypothesis's final error cannot carry)."""

    deadline: float
    valid: int = 0
    refused: list = attrs.Factory(list)
    mismatch: str | None = None
    crash: str | None = None
    context: str = ""


def check_op(op, rule: Rule, cases: list[OpCase], *, registry, max_examples: int, seed: int,
             budget_s: float) -> OpResult:
    """Run `max_examples` drawn examples of `op` (within `budget_s` seconds) and classify."""
    start = time.monotonic()
    run = _Run(deadline=start + budget_s)

    @hypothesis.seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=False,
              report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
              verbosity=Verbosity.quiet, phases=(Phase.generate, Phase.shrink))
    @hypothesis.given(st.data())
    def explore(data):
        _example(data, rule, cases, registry, run)

    try:
        explore()
    except Exception:  # noqa: BLE001 - the run's own record says what failed
        pass
    return _classify(op, run, time.monotonic() - start)


def _example(data, rule: Rule, cases: list[OpCase], registry, run: _Run) -> None:
    hypothesis.assume(time.monotonic() < run.deadline or run.mismatch or run.crash)
    mesh, case = data.draw(examples(rule, cases))
    try:
        case.call(*case.tensors)
    except Exception:  # the op rejects these arguments (a rescaled case): not a case
        hypothesis.reject()
    run.context = f"mesh {mesh}, case {case}"
    try:
        _compare(data, rule, case, mesh, registry, run)
    except ShardedMismatch as err:
        run.mismatch = f"{err}\n  case: {case}"
        raise
    except HpfunError as err:
        if isinstance(err, InternalError):  # the rule (or hpfun) crashed: reported as the cause, not a refusal
            cause = err.__cause__ or err
            run.crash = f"{type(cause).__name__}: {_first_line(cause)}\n  raised at {_where(cause)}\n  {run.context}"
            raise
        run.refused.append(_first_line(err))
        hypothesis.reject()
    except Exception as err:
        run.crash = f"{type(err).__name__}: {_first_line(err)}\n  raised at {_where(err)}\n  {run.context}"
        raise
    run.valid += 1


def _compare(data, rule: Rule, case: OpCase, mesh, registry, run: _Run) -> None:
    values = data.draw(inputs(rule, case, mesh))
    run.context = _context(case, mesh, values)
    exact = isinstance(rule, MOVES_DATA) and not any(v.layout.partial_axes for v in values)
    assert_sharded_equal(_present_outputs(case.call), values, mesh, None, exact=exact, registry=registry)


def _present_outputs(call):
    """`call` returning only the outputs the op computed. A backward with an output_mask
    returns None for the gradients it was not asked for; no rule lays those out, and a
    sharded function returning None is the API's concern (lower() does not take it today),
    not the rule's."""

    def run(*tensors):
        out = call(*tensors)
        if isinstance(out, (tuple, list)) and any(o is None for o in out):
            return tuple(o for o in out if o is not None)
        return out

    return run


def _context(case: OpCase, mesh, values) -> str:
    inputs = "; ".join(f"{v.layout.placements_str()} {tuple(v.global_shape)}" for v in values)
    return f"mesh {mesh}, inputs {inputs}, case {case}"


def _where(err: Exception) -> str:
    """The innermost hpfun frame of the traceback (where a fix likely goes), else the innermost."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = [f for f in frames if f.filename.startswith(_PACKAGE_DIR) and not f.filename.endswith("validate.py")]
    frame = (ours or frames)[-1]
    return f"{os.path.relpath(frame.filename, os.path.dirname(_PACKAGE_DIR))}:{frame.lineno} in {frame.name}"


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _classify(op, run: _Run, seconds: float) -> OpResult:
    if run.mismatch:
        return OpResult(op, "INCORRECT", run.mismatch.splitlines()[0], run.mismatch, seconds)
    if run.crash:
        return OpResult(op, "CRASH", _first_line(Exception(run.crash)), run.crash, seconds)
    if not run.valid:
        why = f"every example refused: {run.refused[0]}" if run.refused else "no example had valid arguments"
        return OpResult(op, "NO INPUTS", why, seconds=seconds)
    refused = f", {len(run.refused)} refused" if run.refused else ""
    return OpResult(op, "ok", f"{run.valid} examples{refused}", seconds=seconds)


def _untestable(op, cases: list[OpCase]) -> OpResult | None:
    if torch.Tag.nondeterministic_seeded in op.tags and not cases:
        return OpResult(op, "SKIPPED", "random op: its values depend on the generator")
    if not op._schema.returns:
        return OpResult(op, "SKIPPED", "it returns nothing (a check that raises): no values to compare")
    if op.__name__.startswith(("empty", "new_empty")):
        return OpResult(op, "SKIPPED", "its values are uninitialized memory")
    if cases:
        return None
    if op in _decompositions():
        return OpResult(op, "SKIPPED", "capture decomposes it into other ops, so its rule never runs")
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return OpResult(op, "SKIPPED", "a composite the dispatcher expands before capture: its rule never runs")
    return OpResult(op, "NO INPUTS", "no OpInfo sample reaches it")


# ---------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------


@attrs.define
class Report:
    results: list[OpResult]
    seconds: float
    seed: int = 0
    max_examples: int = 10

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    def of(self, status: str) -> list[OpResult]:
        return [r for r in self.results if r.status == status]

    @property
    def failed(self) -> bool:
        return bool(self.count("INCORRECT") or self.count("CRASH"))

    def details(self) -> list[str]:
        """The reproducer of every incorrect or crashing rule."""
        lines = []
        for r in self.of("INCORRECT") + self.of("CRASH"):
            lines += ["", f"{r.status} {r.op}:", *(f"  {line}" for line in r.detail.splitlines()),
                      f"  reproduce: python -m hpfun.validate --op {r.op} --seed {self.seed} "
                      f"--max-examples {self.max_examples}"]
        return lines

    def summary(self) -> str:
        counts = ", ".join(f"{self.count(s)} {s.lower()}" for s in STATUSES)
        return f"summary: {counts} ({self.seconds:.0f} s)"

    def __str__(self) -> str:
        return "\n".join([*map(line, self.results), *self.details(), "", self.summary()])


def line(result: OpResult, width: int = 100) -> str:
    """One op's line: status, op, what was found (cut to `width` characters)."""
    note = result.note if len(result.note) <= width else result.note[: width - 3] + "..."
    return f"{result.status:<10} {str(result.op):<44} {note}"


def validate(registry=REGISTRY, ops=None, *, index: Index | None = None, max_examples: int = 10, seed: int = 0,
             budget_s: float = 20.0, progress=None) -> Report:
    """Check the rules of `ops` (default: every op in `registry`, and list the ops that OpInfo
    traces reach without a rule). `index`: the OpInfo index, traced here when None (about 20 s).

    >>> import torch
    >>> report = validate(ops=[torch.ops.aten.neg.default], max_examples=3)
    >>> [(str(r.op), r.status) for r in report.results]
    [('aten.neg.default', 'ok')]
    """
    start = time.monotonic()
    targets = list(registry.ops()) if ops is None else list(ops)
    index = index or opinfo_index()
    missing = sorted((op for op in index.seen_by if registry.lookup(op) is None and op not in targets), key=str)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in sorted(targets, key=str) + (missing if ops is None else []):
            results.append(_check(op, registry, index, max_examples=max_examples, seed=seed, budget_s=budget_s))
            if progress:
                progress(results[-1])
    return Report(results, time.monotonic() - start, seed, max_examples)


def _check(op, registry, index: Index, **options) -> OpResult:
    rule = registry.lookup(op)
    if rule is None:
        sources = ", ".join(sorted(index.seen_by.get(op, ()))[:4])
        core = "core op, " if torch.Tag.core in op.tags else ""
        return OpResult(op, "MISSING", f"{core}no rule; reached from OpInfo {sources}" if sources else f"{core}no rule")
    cases = index.cases.get(op, [])
    if torch.Tag.nondeterministic_seeded in op.tags:  # tagged random for some arguments (dropout)
        cases = [case for case in cases if _draws_nothing(case)]
    return _untestable(op, cases) or check_op(op, rule, cases, registry=registry, **options)


def _draws_nothing(case: OpCase) -> bool:
    """The case gives the same values under two seeds (fused attention without dropout)."""
    outs = []
    for seed in (1, 2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            outs.append([t for t in pytree.tree_leaves(case.call(*case.tensors)) if isinstance(t, torch.Tensor)])
    return all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def resolve(name: str, registry=REGISTRY) -> list:
    """Overloads named by `name`: `aten.mm.default`, or all registered overloads of `mm` / `aten.mm`."""
    op = resolve_op(name)
    if op is not None:
        return [op]
    packet = name.split(".")[-1]
    found = [op for op in registry.ops() if str(op).split(".")[1] == packet]
    if not found:
        raise SystemExit(f"hpfun.validate: no registered op named {name!r}; write e.g. aten.mm.default or mm")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpfun.validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", action="append",
                        help="an op (aten.mm.default, or mm for all its overloads); repeatable")
    parser.add_argument("--max-examples", type=int, default=10, help="examples per op (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--budget", type=float, default=20.0,
                        help="seconds per op before it stops drawing examples (default 20)")
    args = parser.parse_args(argv)
    ops = [op for name in args.op for op in resolve(name)] if args.op else None
    report = validate(ops=ops, max_examples=args.max_examples, seed=args.seed, budget_s=args.budget,
                      progress=lambda r: print(line(r), flush=True))
    print("\n".join([*report.details(), "", report.summary()]))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
