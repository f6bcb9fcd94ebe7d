"""Whole-program differential fuzzing: random programs run whole and through `hpfun.shard`.

A `Program` (defined in `hpfun.testing.fuzz_program`) is data: a mesh, its inputs (shape,
dtype, layout), a list of op records (`Op`, and `Grad` for `torch.func.grad` of a scalar loss
over a sub-program), its outputs and out_specs. Its `repr` is Python that rebuilds it, so a
failing program pastes into a regression test; `source()` is the plain torch function it runs.
`programs()` is the hypothesis strategy that draws them: DAGs of 3-12 ops from a menu of what
training steps use (matmuls and einsums, broadcasting pointwise ops including ones that make inf
and NaN, reductions, softmax, views, cat/split, gathers, norms, cross-entropy, attention, cumsum,
casts, random ops, gradients), on meshes of up to 8 ranks with 1 to 3 axes, inputs split,
replicated or Partial.

`run_program` is the oracle: the program unsharded in float64 (or, when it draws random
numbers, through hpfun on one device with the same seed, since hpfun's generator is not
eager's) against the gathered sharded outputs, to 1e-9 (1e-5 where it computes in float32),
NaN and inf where they are. Its `Outcome` is `ok`, `user_error` (an `hpfun.HpfunError` raised
before anything runs: allowed), `wrong` (values differ) or `internal` (any other exception, an
`hpfun.InternalError` among them).

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
import os
import sys
import traceback
import warnings

import attrs
import torch

import hpfun
from hpfun.errors import HpfunError, InternalError
from hpfun.layout import P
from hpfun.mesh import Mesh
from hpfun.sharded import Sharded
from hpfun.verify import VerificationError
from hpfun.testing.fuzz_program import Grad, Input, Op, Program  # noqa: F401 (Grad, Input, Op: importable from here)

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}

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
    # a broken invariant of hpfun's own (hpfun.verify) is never the user's error, nor is an
    # exception hpfun's passes did not mean to raise (an InternalError: reported as its cause)
    if isinstance(err, InternalError) and err.__cause__ is not None:
        err = err.__cause__
    refused = isinstance(err, HpfunError) and not isinstance(err, (VerificationError, InternalError))
    kind = "user_error" if refused and stage == "lower" else "internal"
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


def run_program(program: Program, auto: bool = False) -> Outcome:
    """Run `program` unsharded and through `hpfun.shard` on its mesh and classify the result:
    every output, and every input after the call (ops in place write back), must match.

    Random programs are compared with hpfun's own one-device run with the same seed. With
    `auto`, the sharded run is given every input whole with the spec `hpfun.AUTO` and no
    out_specs: automatic sharding chooses every layout."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # std of one element, fallbacks...: the outcome is what counts
        try:
            return _run(program, auto)
        except Exception as err:  # the reference itself, or the comparison, failed: never lose the program
            return _failed("harness", err)


def _run(program: Program, auto: bool = False) -> Outcome:
    f = program.function()
    args, in_specs = program.arguments()
    whole = [_whole(a).clone() for a in args]  # clone: in-place ops must not touch the sharded run's inputs
    expected, failure = _reference(program, f, whole)
    if failure is not None:
        return failure
    out_specs = program.out_specs
    if auto:  # the inputs whole (a Partial one as its sum), every layout AUTO's to choose
        args, in_specs, out_specs = [_whole(a).clone() for a in args], tuple(hpfun.AUTO for _ in args), None
    got, failure = _run_sharded(program, f, program.mesh_value(), args, in_specs, out_specs)
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


# The programs `fuzz(seed=None)` (the suite's bounded run) draws. A fixed seed, not hypothesis's
# `derandomize`: that one hashes the test function's source, so any edit to `fuzz` drew another
# set of programs (and once dropped a family from the suite's run).
SUITE_SEED = 20261204


def fuzz(examples: int = 50, seed: int | None = None, report: FuzzReport | None = None, auto: bool = False,
         **strategy) -> FuzzReport:
    """Run `examples` distinct random programs (`programs(**strategy)`) through `run_program`
    (`auto`: with every input's layout `hpfun.AUTO`).

    `seed=None` draws the same programs every time (those of `SUITE_SEED`); an int draws
    others. Nothing stops at a failure: every outcome is in the report (pass one in to see
    the outcomes of a run that is interrupted).

    >>> fuzz(examples=2, max_ops=3).counts()["wrong"]
    0
    """
    from hypothesis import HealthCheck, Phase, assume, given, settings
    from hypothesis import seed as seeded

    report = FuzzReport() if report is None else report
    seen: set = set()

    @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate], derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(programs(**strategy))
    def run(program):
        # hypothesis spends most calls on small mutations of earlier programs: run each program once
        key = (program.mesh, program.source())
        assume(key not in seen)
        seen.add(key)
        report.add(program, run_program(program, auto))

    seeded(SUITE_SEED if seed is None else seed)(run)()
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
    parser.add_argument("--seed", type=int, default=None, help="default: the programs the suite runs (SUITE_SEED)")
    parser.add_argument("--max-ops", type=int, default=12)
    parser.add_argument("--auto", action="store_true",
                        help="give every input whole with the spec hpfun.AUTO (automatic sharding picks the layouts)")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    options = parser.parse_args(argv)
    report = FuzzReport(progress=sys.stderr)
    try:
        fuzz(options.examples, options.seed, report, auto=options.auto, max_ops=options.max_ops)
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
