"""Check sharded programs against unsharded ground truth, the way hpfun checks its own rules.

`assert_sharded_equal` runs a function whole and through `hpfun.shard` on a simulated mesh and
compares the gathered outputs. The hypothesis strategies `meshes`, `layouts`,
`divisible_shapes` and `sharded_values` draw the cases to run it on (several mesh axes on one
dim, in any order, and Partial inputs included; `axis_orders` draws an order alone).
`python -m hpfun.validate` applies both to every rule.

>>> import torch, hpfun
>>> from hypothesis import given, settings, strategies as st
>>> from hpfun.testing import assert_sharded_equal, layouts, meshes, sharded_values
>>> x = torch.randn(8, 4, dtype=torch.float64)
>>> @settings(max_examples=10, deadline=None)
... @given(st.data())
... def check_scaled_sum(data):
...     mesh = data.draw(meshes())
...     layout = data.draw(layouts(mesh, tuple(x.shape), allow_partial=("sum",)))
...     assert_sharded_equal(lambda a: (a * 3).sum(0), (data.draw(sharded_values(x, layout)),), mesh, None)
>>> check_scaled_sum()

The strategies need `hypothesis` (a test dependency); they load on first use.
"""

from hpfun.testing.oracle import ShardedMismatch, assert_sharded_equal

_STRATEGIES = ("axis_orders", "divisible_shapes", "layouts", "meshes", "on_grid", "sharded_values")

__all__ = ["ShardedMismatch", "assert_sharded_equal", *_STRATEGIES]


def __getattr__(name):
    # hypothesis is not an install dependency of hpfun: import the strategies only when asked
    # for, so `hpfun.testing.models` (used by the demo) works without it.
    if name in _STRATEGIES:
        from hpfun.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'hpfun.testing' has no attribute {name!r}")
