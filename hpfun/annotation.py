"""What propagation returns: one plan per node of the global graph, written into it once."""

from __future__ import annotations

import attrs
import torch
from torch.utils import _pytree as pytree

from hpfun.rules import OpCall, Strategy


@attrs.frozen(eq=False)
class NodePlan:
    """One node's part of the annotation: its layout (a tuple for a multi-output op, None where
    an element holds no tensor), and for an op the strategy chosen and the call its rule saw."""

    layout: object
    call: OpCall | None = None
    rule: object = None
    strategy: Strategy | None = None
    fallback: bool = False  # ran replicated for want of a rule (fallback="replicate")


_ANNOTATION = ("hpfun_layout", "hpfun_call", "hpfun_rule", "hpfun_strategy", "hpfun_fallback")


@attrs.frozen(eq=False)
class Annotation:
    """Every node's plan, and the plan's total price: seconds under the cost model
    (`hpfun.plan.CostModel`), communication plus local work."""

    plans: dict  # fx node -> NodePlan
    price: float

    def layout(self, node: torch.fx.Node):
        return self.plans[node].layout

    def write(self, gm: torch.fx.GraphModule) -> None:
        """Record the plan in the nodes' meta, replacing any earlier one."""
        for node in gm.graph.nodes:
            for key in _ANNOTATION:
                node.meta.pop(key, None)
            plan = self.plans[node]
            node.meta["hpfun_layout"] = plan.layout
            if plan.strategy is not None:
                node.meta.update(hpfun_call=plan.call, hpfun_rule=plan.rule, hpfun_strategy=plan.strategy)
            if plan.fallback:
                node.meta["hpfun_fallback"] = True


def placed(node: torch.fx.Node, layouts: tuple):
    """A node's layout: one Layout, or for a tuple output one per element (None where it holds
    no tensor, e.g. convolution_backward's skipped grad_input), so getitem indices line up."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return layouts[0]
    tensors = iter(layouts)

    def element(v):  # a list of tensors inside the tuple (_amp_foreach_non_finite_check's) nests
        if isinstance(v, (list, tuple)):
            return tuple(element(u) for u in v)
        return next(tensors) if isinstance(v, torch.Tensor) else None

    if not isinstance(val, (list, tuple)):
        return tuple(next(tensors) if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(val))
    return tuple(element(v) for v in val)
