"""The cache-hit path of a sharded function: what it skips must not change what a call does.

A call that hits the cache flattens its arguments with a walk of its own (tuples, lists and
dicts), reuses the last walk of the function's closures while they hold the same objects, wraps
its outputs as `Sharded` values without checking them again and rebuilds the output structure
from one expression. Each test states the equivalence it checks; none times anything
(benchmarks/overhead.py measures the cost).
"""

import collections
import pickle

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

import hpfun
from hpfun import P
from hpfun import lift
from hpfun.api import _builder, _flatten
from hpfun.sharded import Sharded, signature

MESH = hpfun.Mesh.simulated((2,), ("tp",))
SPECS = {"w1": P(None, "tp"), "w2": P("tp", None)}


def _loss(p, x):
    return (torch.relu(x @ p["w1"]) @ p["w2"]).pow(2).mean()


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(8, 16, generator=g), "w2": torch.randn(16, 8, generator=g)}


def _step():
    return hpfun.shard(torch.func.grad_and_value(_loss), mesh=MESH, in_specs=(SPECS, P()), out_specs=(SPECS, P()))


def test_flatten_gives_pytree_leaves_in_pytree_order():
    """The fast walk's leaves are `pytree.tree_flatten`'s, for nested tuples, lists and dicts
    (insertion order), None and scalars among them, Sharded values as leaves."""
    s = Sharded.from_global(torch.ones(4), P("tp").to_layout(MESH, 1))
    tree = ({"b": torch.zeros(2), "a": [1, None, (s, 2.5)]}, [], {}, ("x", {"z": torch.ones(1)}))
    flat, key = [], []
    assert _flatten(tree, flat, key)
    expected = pytree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Sharded))
    assert len(flat) == len(expected) and all(a is b for a, b in zip(flat, expected, strict=True))
    hash(tuple(key))


def test_flatten_leaves_other_nodes_to_pytree():
    """A namedtuple, an OrderedDict or a NumPy array sends the call down the general path."""
    Pair = collections.namedtuple("Pair", "a b")
    for tree in ((Pair(1, 2),), [collections.OrderedDict(a=1)], {"x": np.zeros(2)}):
        assert not _flatten(tree, [], [])


def test_flatten_keys_tell_structures_apart():
    """A list and a tuple, a dict's keys and their order, shapes and dtypes key apart."""
    def key(tree):
        out = []
        _flatten(tree, [], out)
        return tuple(out)

    t = torch.zeros(2)
    trees = [(t,), [t], {"a": t}, {"b": t}, {"a": t, "b": 1}, {"b": 1, "a": t}, (torch.zeros(3),),
             (torch.zeros(2, dtype=torch.float64),), (1,), (1.0,), (True,)]
    assert len({key(tree) for tree in trees}) == len(trees)


def test_builder_rebuilds_what_pytree_rebuilds():
    """The output builder's value equals `pytree.tree_unflatten`'s for nested tuples, lists and dicts."""
    tree = ({"w1": 1, "w2": [2, (3,)]}, 4, [], {"a": {"b": 5}}, ())
    leaves, spec = pytree.tree_flatten(tree)
    assert _builder(spec)(leaves) == pytree.tree_unflatten(leaves, spec) == tree
    assert _builder(pytree.tree_flatten(7)[1])([7]) == 7
    assert _builder(pytree.tree_flatten(collections.OrderedDict(a=1))[1]) is None


def test_outputs_fed_back_hit_the_cache_and_match_eager():
    """Outputs (wrapped without checks) carry the signature their layout, shape and dtype give,
    and fed back as arguments reuse the program; the results equal eager ones."""
    step, params, x = _step(), _params(), torch.randn(4, 8)
    p = {k: Sharded.from_global(v, SPECS[k].to_layout(MESH, 2)) for k, v in params.items()}
    for _ in range(3):
        grads, loss = step(p, x)
        p = {k: Sharded(v.layout, v.global_shape, tuple(a - 0.1 * b for a, b in zip(p[k].shards, v.shards, strict=True)))
             for k, v in grads.items()}
    assert step.trace_count == 1
    for value in (*grads.values(), loss):
        assert value.signature() == signature(value.layout, value.global_shape, value.shards[0].dtype)
        assert all(tuple(s.shape) == value.layout.local_shape(value.global_shape) for s in value.shards)
    grads, loss = step(p, x)
    ref_grads, ref_loss = torch.func.grad_and_value(_loss)({k: v.full() for k, v in p.items()}, x)
    torch.testing.assert_close(loss.full(), ref_loss)
    for k in ref_grads:
        torch.testing.assert_close(grads[k].full(), ref_grads[k])


def test_defaults_and_keywords_bind_alike():
    """Left-out defaults, keywords and positions give the same program and the same result."""
    def f(x, scale=2.0, *, shift=0.0):
        return x * scale + shift

    g = hpfun.shard(f, mesh=MESH, in_specs=(P("tp"), None), out_specs=P("tp"))
    x = torch.arange(4.0)
    assert g(x).full().tolist() == g(x, 2.0).full().tolist() == g(x, scale=2.0).full().tolist() == (x * 2).tolist()
    assert g(x, 3.0).full().tolist() == (x * 3).tolist()
    assert g(x, shift=1.0).full().tolist() == (x * 2 + 1).tolist()


BIAS = torch.zeros(4)


def _add_bias(x):
    return x + BIAS


def test_a_rebound_global_is_read_anew():
    """The walk of the function's globals is reused only while they hold the same objects."""
    global BIAS
    f = hpfun.shard(_add_bias, mesh=MESH, in_specs=(P("tp"),), out_specs=P("tp"))
    x = torch.arange(4.0)
    assert f(x).full().tolist() == x.tolist()
    walk = f._roots._last
    f(x)
    assert f._roots._last is walk  # nothing changed: the walk is reused
    BIAS = torch.ones(4)
    try:
        assert f(x).full().tolist() == (x + 1).tolist()
    finally:
        BIAS = torch.zeros(4)


def test_a_changed_closure_and_a_grown_dict_are_read_anew():
    """A closure cell given another tensor, and a closed-over dict given a new tensor, are seen."""
    scale = torch.tensor(2.0)
    state = {"a": torch.ones(4)}

    def f(x):
        return x * scale + sum(state.values())

    g = hpfun.shard(f, mesh=MESH, in_specs=(P("tp"),), out_specs=P("tp"))
    x = torch.arange(4.0)
    assert g(x).full().tolist() == (x * 2 + 1).tolist()
    scale = torch.tensor(3.0)  # noqa: F841 (read by f through its closure)
    assert g(x).full().tolist() == (x * 3 + 1).tolist()
    state["b"] = torch.ones(4)
    assert g(x).full().tolist() == (x * 3 + 2).tolist()


def test_a_pickled_value_interns_its_signature_anew():
    """A Sharded value's token is this process's: pickling leaves it out, the copy computes its own."""
    x = Sharded.from_global(torch.arange(4.0), P("tp").to_layout(MESH, 1))
    token = x.signature()
    copy = pickle.loads(pickle.dumps(x))
    assert copy.token is None and copy.signature() == token
    assert copy.full().tolist() == x.full().tolist()


@pytest.mark.parametrize("tags", [True, False], ids=["version-tags", "entries"])
def test_the_lifted_state_walk_sees_every_write_and_keeps_what_holds(tags, monkeypatch):
    """A module's state is walked again only when a dict the walk read holds other objects: a
    parameter replaced or an optimizer's state entry reassigned is seen at the next call (with
    the values eager would use); an attribute set and deleted again, or the training flag set
    to what it was, leaves the walk as it was (no retrace, no new walk). The same with dicts'
    version tags and without (every entry compared, where the helper is missing)."""
    if not tags:
        monkeypatch.setattr(lift, "_dict_version", None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    f = hpfun.shard(step, mesh=MESH, in_specs=(P("tp"),), out_specs=P())
    x = torch.randn(6, 4)
    for _ in range(3):  # momentum buffers made at the first step: the second call walks again
        f(x)
    state, traces = f._roots._state[1], f.trace_count
    model.extra = 1
    del model.extra
    model.train()
    f(x)
    assert f._roots._state[1] is state and f.trace_count == traces

    with torch.no_grad():
        model[0].weight = torch.nn.Parameter(torch.zeros(8, 4))  # replaced: the optimizer still holds the old one
    ref = model(x).pow(2).mean()
    assert f(x).full().item() == ref.item()
    assert f._roots._state[1] is not state

    buf = opt.state[model[2].weight]["momentum_buffer"]
    opt.state[model[2].weight]["momentum_buffer"] = torch.zeros_like(buf)  # reassigned in its dict
    state = f._roots._state[1]
    f(x)
    assert f._roots._state[1] is not state
    assert not opt.state[model[2].weight]["momentum_buffer"].equal(torch.zeros_like(buf))  # updated from zero


class _Helper:
    """An object of the user's whose class holds a staticmethod, as library classes do."""

    def __init__(self):
        self.scale = 2.0

    @staticmethod
    def shift(x):
        return x + 1.0

    def __call__(self, x):
        return self.shift(x) * self.scale


class _SlottedHelper:
    __slots__ = ("inner", "offset")

    def __init__(self, inner):
        self.inner, self.offset = inner, 0.5

    def __call__(self, x):
        return self.inner(x) + self.offset


def test_the_walk_of_objects_and_their_classes_is_kept_while_it_holds():
    """A walk through an object of the user's (its class holding a staticmethod, or its values in
    `__slots__`) was done again at every call: a staticmethod read through getattr is another
    object than its class holds, and an object's attributes were guarded by nothing (a package
    outside site-packages, walked as the user's code: seconds per cached call). Kept while
    they hold; an attribute rebound or added, or a slot set, walks again and is read."""
    helper = _SlottedHelper(_Helper())
    f = hpfun.shard(lambda x: helper(x), mesh=MESH, in_specs=(P("tp"),), out_specs=P("tp"))
    x = torch.randn(6, 4)
    f(x)
    walk = f._roots._last
    assert walk is not None
    f(x)
    assert f._roots._last is walk
    for change in (lambda: setattr(helper.inner, "scale", 3.0), lambda: setattr(helper, "offset", -1.0),
                   lambda: setattr(helper, "inner", _Helper())):
        change()
        torch.testing.assert_close(f(x).full(), helper(x))
        assert f._roots._last is not walk
        walk = f._roots._last
