"""Errors users see. Each carries structured problems as well as a readable message.

Every error lists *all* problems found in one pass, each with what was wrong and how to fix it.
"""

from __future__ import annotations

import operator
import os
import sys
import types

import attrs
import torch


@attrs.frozen
class Problem:
    """One thing that is wrong: where it is, what is wrong, how to fix it."""

    where: str
    what: str
    fix: str = ""

    def __str__(self) -> str:
        text = f"{self.where}: {self.what}"
        return f"{text}\n      fix: {self.fix}" if self.fix else text


class HpfunError(Exception):
    """Base of every error hpfun raises on purpose."""

    headline = "hpfun error"

    def __init__(self, problems, headline: str | None = None):
        if isinstance(problems, (str, Problem)):
            problems = [problems]
        self.problems = tuple(p if isinstance(p, Problem) else Problem("", str(p)) for p in problems)
        if headline is not None:
            self.headline = headline
        super().__init__(self._message())

    def _message(self) -> str:
        if len(self.problems) == 1 and not self.problems[0].where:
            return f"{self.headline}: {self.problems[0].what}" + (
                f"\n  fix: {self.problems[0].fix}" if self.problems[0].fix else ""
            )
        lines = [f"{self.headline} ({len(self.problems)} problem{'s' * (len(self.problems) != 1)}):"]
        counts: dict = {}
        for p in self.problems:  # a problem repeated in every layer of a model is listed once
            counts[p] = counts.get(p, 0) + 1
        for p, n in list(counts.items())[:MAX_LISTED]:
            lines.append(f"  - {attrs.evolve(p, what=f'{p.what} ({n} times)') if n > 1 else p}")
        if len(counts) > MAX_LISTED:
            lines.append(f"  ... and {len(counts) - MAX_LISTED} more (all of them in the error's .problems)")
        return "\n".join(lines)


MAX_LISTED = 40  # distinct problems an error's message lists


class LayoutError(HpfunError, ValueError):
    """A placement, layout, mesh or spec is invalid, or a shape does not divide."""

    headline = "invalid layout"


class SpecError(HpfunError, ValueError):
    """The in_specs/out_specs given to `shard` do not fit the arguments or the mesh."""

    headline = "bad sharding spec"


class RuleFileError(HpfunError, ValueError):
    """A YAML rule table is malformed (reported with file:line)."""

    headline = "bad rule table"


class MissingRuleError(HpfunError, NotImplementedError):
    """Ops in the traced program have no sharding rule (all of them listed)."""

    headline = "ops without a sharding rule"


class CaptureError(HpfunError, RuntimeError):
    """The function could not be traced (data-dependent control flow, unsupported input...)."""

    headline = "cannot capture the function"


class ShardingError(HpfunError, RuntimeError):
    """An op cannot run with the layouts it is given (e.g. a data-dependent shape on a sharded dim)."""

    headline = "cannot shard the program"


class ExecutionError(HpfunError, RuntimeError):
    """An op of the per-shard program raised while it ran (the op's own error is the cause)."""

    headline = "the per-shard program failed"


class InternalError(HpfunError, RuntimeError):
    """hpfun itself failed while compiling a function it accepted: a bug in hpfun (the original
    exception is the cause, with its traceback)."""

    headline = "hpfun internal error"


def op_name(target) -> str:
    """An op's name in reports and errors."""
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, types.FunctionType):  # a helper of hpfun's rules (rules.norm.group_norm_backward)
        return f"{target.__module__.removeprefix('hpfun.rules.')}.{target.__qualname__}"
    return str(target)


_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def user_stacklevel() -> int:
    """The `stacklevel` that makes a warning raised by the calling function name the user's
    line: the first frame up the stack outside hpfun and torch (torch.compile's wrapper around
    a sharded function's call, for one, sits between)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        level, frame = level + 1, frame.f_back
    return level
