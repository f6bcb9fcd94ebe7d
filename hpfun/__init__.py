"""hpfun: trace-once sharding for PyTorch.

Write a step function on whole tensors, say how its inputs lie on a device mesh, and hpfun
turns it into one per-shard program with explicit collectives.

>>> import torch, hpfun
>>> from hpfun import P
>>> mesh = hpfun.Mesh.simulated((2,), ("tp",))
>>> f = hpfun.shard(lambda x, w: x @ w, mesh=mesh, in_specs=(P(), P("tp", None)), out_specs=P())
>>> x, w = torch.randn(4, 8), torch.randn(8, 3)
>>> torch.allclose(f(x, w).full(), x @ w, atol=1e-6)
True
>>> [c.kind for c in f.lower(x, w).collectives]
['all_reduce']
"""

from hpfun import rules
from hpfun.api import RetraceWarning, ShardedFunction, WildcardWarning, redistribute, shard
from hpfun.capture import TracingWarning
from hpfun.checkpoint import checkpoint  # hpfun.checkpoint is the function
from hpfun.constrain import constrain
from hpfun.debug import explain_cache_miss
from hpfun.errors import (
    CaptureError, ExecutionError, HpfunError, InternalError, LayoutError, MissingRuleError, Problem, RuleFileError,
    ShardingError, SpecError,
)
from hpfun.explain import Lowered
from hpfun.hf import tp_plan
from hpfun.layout import Layout, P, Partial, Replicate, Shard, parse
from hpfun.lower import Collective
from hpfun.mesh import Mesh
from hpfun.plan import CostModel
from hpfun.propagate import FallbackWarning
from hpfun.rng import random_seed
from hpfun.sharded import Sharded
from hpfun.specs import AUTO
from hpfun.visualize import visualize  # after the submodule import: hpfun.visualize is the function
from hpfun.writeback import gather_state

__all__ = [
    "AUTO", "CaptureError", "Collective", "CostModel", "ExecutionError", "FallbackWarning", "checkpoint", "constrain", "HpfunError", "InternalError", "Layout", "LayoutError", "Lowered", "Mesh",
    "MissingRuleError", "P", "Partial", "Problem", "Replicate", "RetraceWarning", "TracingWarning", "WildcardWarning", "RuleFileError", "Shard", "Sharded",
    "ShardedFunction", "ShardingError", "SpecError", "explain_cache_miss", "gather_state", "parse", "random_seed",
    "redistribute", "rules", "shard", "tp_plan", "visualize",
]
