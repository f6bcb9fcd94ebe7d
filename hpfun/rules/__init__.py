"""Sharding rules: YAML tables naming rule families, plus code registrations.

>>> import hpfun, torch
>>> hpfun.rules.lookup(torch.ops.aten.mm.default)
Contraction(shape_arg=None, reason=None, equation='mk,kn->mn', operands=(0, 1), bias=None, sums=True, linear=None, lookup=False)
"""

from hpfun.rules.base import OpCall, Replicated, Rule, Strategy, TensorArg, TensorMeta, combine_axes, keep_orders
from hpfun.rules.registry import FAMILIES, REGISTRY, builtin_rules_dir, resolve_op


def lookup(op):
    """The rule for an op overload, or None."""
    return REGISTRY.lookup(op)


def register(op, rule: Rule, *, replace: bool = False) -> None:
    """Register `rule` for `op` (an overload or its name, e.g. "aten.mm.default")."""
    REGISTRY.register(op, rule, replace=replace)


def load(path) -> int:
    """Load a YAML table or a folder of them; returns the number of entries added."""
    return REGISTRY.load(path)


__all__ = [
    "FAMILIES", "OpCall", "Replicated", "Rule", "Strategy", "TensorArg", "TensorMeta",
    "builtin_rules_dir", "combine_axes", "keep_orders", "load", "lookup", "register", "resolve_op",
]
