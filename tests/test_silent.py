"""Nothing silently wrong: regression tests for whole programs that once gave a wrong answer,
or failed inside the run, where every op's own rule check passed."""

import collections
import dataclasses
import functools
import importlib
import math
import subprocess
import sys
import types
import typing

import pytest
import torch
import torch.nn.functional as F

import hpfun
from hpfun import P, lift

MESH = hpfun.Mesh.simulated((2,), ("a",))
MESH2 = hpfun.Mesh.simulated((2, 2), ("a", "b"))


def test_down_cast_resolves_partial_sums_first():
    """A cast to a narrower dtype is not linear: each rank's partial sum must not be rounded
    (or overflow float16) before the sum."""
    f = hpfun.shard(lambda x, w: (x @ w).half(), mesh=MESH, in_specs=(P(None, "a"), P("a", None)), out_specs=P())
    x, w = torch.tensor([[70000.0, -69990.0]]), torch.ones(2, 1)
    assert torch.equal(f(x, w).full(), (x @ w).half())
    g = hpfun.shard(lambda x, w: (x @ w).float(), mesh=MESH, in_specs=(P(None, "a"), P("a", None)), out_specs=P())
    x64 = torch.tensor([[1.0, 1e-9]], dtype=torch.float64).repeat(1, 2)
    w64 = torch.tensor([[1.0], [1.0], [-1.0], [1.0]], dtype=torch.float64)
    assert torch.equal(g(x64, w64).full(), (x64 @ w64).float())


def test_masked_minus_inf_on_a_partial_value():
    """masked_fill(-inf) of a Partial value, and causal attention split on the head dim, give
    -inf where eager does, never NaN (-inf * 0 once made the fill Partial)."""
    mask = ~torch.ones(2, 2, dtype=torch.bool).tril()

    def scores(q, k):
        return (q @ k.T).masked_fill(mask, float("-inf"))

    f = hpfun.shard(scores, mesh=MESH, in_specs=(P(None, "a"), P(None, "a")), out_specs=P())
    q, k = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    got = f(q, k).full()
    assert torch.equal(got.isinf(), mask) and torch.allclose(got, scores(q, k), rtol=0, atol=1e-12)

    def attend(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    g = hpfun.shard(attend, mesh=MESH, in_specs=P(None, None, None, "a"), out_specs=P())
    q = torch.randn(2, 4, 8, 6, dtype=torch.float64)
    out = g(q).full()
    assert not out.isnan().any() and torch.allclose(out, attend(q), rtol=0, atol=1e-12)


def test_mixed_sum_and_avg_partials_read_back():
    """out_specs=None may keep an output Partial(sum) on one axis and Partial(avg) on another;
    .full() reads it."""

    def fn(x):
        return torch.var_mean(x @ x.mT / 8, [-3, -1], keepdim=True)[1]

    f = hpfun.shard(fn, mesh=MESH2, in_specs=P("b", None, "a"), out_specs=None)
    x = torch.randn(4, 4, 6, dtype=torch.float64)
    out = f(x)
    assert {p.reduce for p in out.layout.placements} == {"sum", "avg"}
    assert torch.allclose(out.full(), fn(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", ["group_norm", "flatten", "chunk", "own_output"])
def test_inputs_of_any_strides(case):
    """The program runs on views (hpfun's own blocks of an input, a transposed argument, a
    previous call's transposed output) all the same. It is traced on stand-ins with the
    arguments' strides, so `.view` of a transposed argument fails as it does in eager."""
    if case == "group_norm":
        x = torch.randn(2, 4, 3)
        f = hpfun.shard(lambda x: F.group_norm(x, 2), mesh=MESH, in_specs=P(None, "a"), out_specs=P())
        assert torch.allclose(f(x).full(), F.group_norm(x, 2), atol=1e-6)
    elif case == "flatten":
        t = torch.randn(4, 6).T
        f = hpfun.shard(lambda t: t.flatten() * 2, mesh=MESH, in_specs=P(), out_specs=P())
        assert torch.equal(f(t).full(), t.flatten() * 2)
    elif case == "chunk":
        x = torch.randn(4, 5, 8)
        f = hpfun.shard(lambda x: x.chunk(5, 1)[3].flatten() * 3, mesh=MESH, in_specs=P(), out_specs=P())
        assert torch.equal(f(x).full(), x.chunk(5, 1)[3].flatten() * 3)
    else:
        step = hpfun.shard(lambda w: (w * 2).T.reshape(w.shape), mesh=MESH, in_specs=P("a"), out_specs=None)
        w = torch.randn(4, 6)
        out = step(w)
        again = hpfun.shard(lambda w: w.reshape(-1) * 2, mesh=MESH, in_specs=P(), out_specs=P())(out.full().T)
        assert torch.equal(again.full(), out.full().T.reshape(-1) * 2)
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            out.full().T.view(-1)  # eager
        with pytest.raises(hpfun.CaptureError, match="Cannot view a tensor with shape"):
            hpfun.shard(lambda w: w.view(-1) * 2, mesh=MESH, in_specs=P(), out_specs=P())(out.full().T)
        assert torch.equal(step(out).full(), (out.full() * 2).T.reshape(4, 6))


@pytest.mark.parametrize("copy", ["contiguous", "reshape"])
def test_a_write_into_a_copy_of_a_transposed_argument_leaves_it_as_eager_does(copy):
    """`x.contiguous()` and `x.reshape(-1)` are views of a contiguous argument and copies of a
    transposed one: an in-place write into the result reaches the argument in the first case
    only. The trace sees the argument's strides (it saw contiguous stand-ins and wrote into a
    transposed argument, which eager leaves alone), and they key the cache: each kind of
    argument gets its own program, and the caller's tensor ends as eager leaves it."""
    def f(x, s):
        v = x.contiguous() if copy == "contiguous" else x.reshape(-1)
        v.mul_(s)
        return v.sum(0)

    step = hpfun.shard(f, mesh=MESH, in_specs=(P(None, "a"), P()), out_specs=P())
    for x in (torch.randn(6, 4, dtype=torch.float64).T, torch.randn(4, 6, dtype=torch.float64)):
        mine, theirs = (x.T.clone().T, x.T.clone().T) if not x.is_contiguous() else (x.clone(), x.clone())
        assert torch.allclose(step(mine, torch.tensor(3.0, dtype=torch.float64)).full(),
                              f(theirs, torch.tensor(3.0, dtype=torch.float64)), rtol=0, atol=1e-12)
        assert torch.equal(mine, theirs) and mine.is_contiguous() == x.is_contiguous()
    assert step.trace_count == 2


@pytest.mark.parametrize("layout", ["replicated", "rows_split", "cols_split", "step_slice"])
@pytest.mark.parametrize("op", ["det", "slogdet"])
def test_a_column_major_parameters_det_gradient_is_eagers(op, layout):
    """`det` factors A or A.T by whether A is contiguous, and its backward solves with the
    factors as they were traced: a column-major parameter (the Q of a QR, Glow's invertible 1x1
    convolution) was traced column-major but fed to the program contiguous (or gathered
    contiguous from its split blocks; a step slice likewise), and its gradient came back
    transposed. Each rank's block is now laid out in the order it was traced in, and det's
    input is made contiguous where it is traced."""
    base = torch.randn(6, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    base[:, :6] += 3 * torch.eye(6, dtype=torch.float64)
    loss_of = (lambda w: torch.det(w)) if op == "det" else (lambda w: torch.linalg.slogdet(w).logabsdet)
    cut = (lambda w: w[:, ::2]) if layout == "step_slice" else (lambda w: w)

    def make(w):
        opt = torch.optim.SGD([w], lr=0.01)

        def step(x):
            loss = loss_of(cut(w)) + (x @ cut(w)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    made = (lambda: base.clone()) if layout == "step_slice" else (lambda: base[:, :6].T.contiguous().T.clone())
    mine, theirs = torch.nn.Parameter(made()), torch.nn.Parameter(made())
    spec = {"rows_split": P("b", None), "cols_split": P(None, "b")}.get(layout, P())
    sharded = hpfun.shard(make(mine), mesh=MESH2, in_specs=(P("a"),), out_specs=P(), state_specs={"w": spec})
    eager = make(theirs)
    for i in range(3):
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        assert torch.allclose(sharded(x).full(), eager(x), rtol=0, atol=1e-10)
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-10), i


def test_gathered_bool_stays_bool():
    """Looking up a split bool tensor gives bool, usable as a mask."""
    m = torch.tensor([True, False, True, True, False, False, True, False])
    i = torch.tensor([0, 5, 6, 3])
    f = hpfun.shard(lambda m, i: m[i], mesh=MESH, in_specs=(P("a"), P()), out_specs=P())
    assert f(m, i).dtype == torch.bool and torch.equal(f(m, i).full(), m[i])
    x = torch.randn(4)
    g = hpfun.shard(lambda m, i, x: torch.where(m[i], x, -x), mesh=MESH, in_specs=(P("a"), P(), P()), out_specs=P())
    assert torch.equal(g(m, i, x).full(), torch.where(m[i], x, -x))
    h = hpfun.shard(lambda m, i: torch.gather(m, 0, i), mesh=MESH, in_specs=(P("a"), P()), out_specs=P())
    assert torch.equal(h(m, i).full(), torch.gather(m, 0, i))


LR = 0.1


def test_python_scalars_read_by_the_function_key_the_cache():
    """A global or closed-over Python number the function reads is part of the cache key: a
    change retraces (explain_cache_miss names it), never a stale program."""
    global LR
    f = hpfun.shard(lambda w, g: w - LR * g, mesh=MESH, in_specs=(P("a"), P("a")), out_specs=P("a"))
    w, g = torch.ones(4), torch.ones(4)
    assert torch.allclose(f(w, g).full(), w - 0.1 * g)
    LR = 10.0
    try:
        assert "LR: value 10.0, cached 0.1" in str(hpfun.explain_cache_miss(f, w, g))
        assert torch.allclose(f(w, g).full(), w - 10.0 * g) and f.trace_count == 2
    finally:
        LR = 0.1
    scale = 2.0

    def times(x):
        return x * scale

    h = hpfun.shard(times, mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    assert torch.equal(h(w).full(), w * 2)
    scale = 3.0
    assert torch.equal(h(w).full(), w * 3)


DTYPE = torch.float64
ACT = torch.relu


class Config:  # a class used as a namespace of settings
    scale = 2.0
    names = {"a"}
    act = staticmethod(torch.relu)  # (a builtin it holds: patched between calls, compiled again)


def _act(x):
    return ACT(x) + 1


def test_dtypes_classes_sets_functions_and_grad_mode_key_the_cache():
    """What else a trace reads from Python and bakes in keys the cache too, each change compiling
    again (explain_cache_miss names it): a global dtype, a class attribute (a builtin it holds
    too), a set's members,
    which function a global name holds (one a helper calls too), and the caller's grad mode.
    A lambda made anew by the same code is the same function: no compile."""
    global DTYPE, ACT
    x = torch.linspace(-1, 1, 8, dtype=torch.float64)
    def fn(x):
        return x.to(DTYPE) * Config.scale * (2.0 if "b" in Config.names else 1.0)

    f = hpfun.shard(fn, mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    g = hpfun.shard(lambda x: _act(x) * 2 if torch.is_grad_enabled() else _act(x) * 3, mesh=MESH, in_specs=P("a"),
                    out_specs=P("a"))
    try:
        assert torch.equal(f(x).full(), x * 2.0) and torch.equal(g(x).full(), (torch.relu(x) + 1) * 2)
        DTYPE = torch.float32
        assert "DTYPE: value torch.float32, cached torch.float64" in str(hpfun.explain_cache_miss(f, x))
        assert f(x).full().dtype == torch.float32
        Config.scale = 3.0
        assert "Config.scale: value 3.0, cached 2.0" in str(hpfun.explain_cache_miss(f, x))
        assert torch.equal(f(x).full(), fn(x))
        Config.names.add("b")
        assert torch.equal(f(x).full(), fn(x)) and f.trace_count == 4
        k = hpfun.shard(lambda x: Config.act(x), mesh=MESH, in_specs=P("a"), out_specs=P("a"))
        assert torch.equal(k(x).full(), torch.relu(x))
        Config.act = staticmethod(torch.tanh)  # (the first program ran relu, silently)
        assert torch.equal(k(x).full(), torch.tanh(x)) and k.trace_count == 2
        Config.act = functools.partial(torch.clamp, min=-0.5)  # (a partial's arguments too)
        assert torch.equal(k(x).full(), x.clamp(min=-0.5))
        Config.act = functools.partial(torch.clamp, min=0.25)
        assert torch.equal(k(x).full(), x.clamp(min=0.25)) and k.trace_count == 4
        ACT = torch.tanh
        assert "ACT: value torch.tanh, cached torch.relu" in str(hpfun.explain_cache_miss(g, x))
        assert torch.equal(g(x).full(), (torch.tanh(x) + 1) * 2)
        with torch.no_grad():
            assert "torch.is_grad_enabled(): value False, cached True" in str(hpfun.explain_cache_miss(g, x))
            assert torch.equal(g(x).full(), (torch.tanh(x) + 1) * 3)
        assert g.trace_count == 3
        for _ in range(2):
            scale = lambda x: x * 2  # noqa: E731 - made anew each time
            h = hpfun.shard(lambda x: scale(x), mesh=MESH, in_specs=P("a"), out_specs=P("a"))
            break
        for _ in range(3):
            scale = lambda x: x * 2  # noqa: E731
            assert torch.equal(h(x).full(), x * 2)
        assert h.trace_count == 1
    finally:
        DTYPE, ACT, Config.scale, Config.names = torch.float64, torch.relu, 2.0, {"a"}
        Config.act = staticmethod(torch.relu)


class _Scaler:
    def __init__(self, s):
        self.s = s

    def __call__(self, x):
        return x * self.s


class _Wrap:
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, x):
        return self.inner(x) + 1


class _Settings:
    act = _Scaler(2.0)  # (an object of the user's that is called, held by a class)


class _Power:
    def __init__(self, s):
        self.s = s


def _each_change_compiles_once(cases, x):
    """Each (fn, change): sharded fn equals eager, then after the change too, by one new program."""
    for fn, change in cases:
        f = hpfun.shard(fn, mesh=MESH, in_specs=P("a"), out_specs=P("a"))
        assert torch.equal(f(x).full(), fn(x))
        change()
        assert torch.equal(f(x).full(), fn(x)) and f.trace_count == 2
        assert torch.equal(f(x).full(), fn(x)) and f.trace_count == 2


def test_what_objects_held_inside_a_modules_containers_hold_keys_the_cache():
    """A number changed in place on an object a module reaches through a container or a
    callable runs a new program (each ran the first, silently): a partial's keyword edited in
    place, a called object in a list, dict or tuple a module holds, an object in a set in a dict
    it holds, a bound method's object, and an object among a partial's arguments."""
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) - 0.3
    m = torch.nn.Module()
    m.act = functools.partial(F.leaky_relu, negative_slope=0.1)
    m.acts, m.cfg2, m.tup = [_Scaler(2.0)], {"act": _Scaler(2.0)}, (_Scaler(2.0),)
    power, bound, held = _Power(1.0), _Scaler(2.0), _Scaler(2.0)
    m.cfg, m.fn, m.papp = {"powers": {power}}, bound.__call__, functools.partial(lambda o, x: o(x), held)
    cases = [(lambda x: m.act(x), lambda: m.act.keywords.__setitem__("negative_slope", 0.6)),
             (lambda x: m.acts[0](x), lambda: setattr(m.acts[0], "s", 4.0)),
             (lambda x: m.cfg2["act"](x), lambda: setattr(m.cfg2["act"], "s", 5.0)),
             (lambda x: m.tup[0](x), lambda: setattr(m.tup[0], "s", 5.0)),
             (lambda x: x * sum(q.s for q in m.cfg["powers"]), lambda: setattr(power, "s", 4.0)),
             (lambda x: m.fn(x), lambda: setattr(bound, "s", 5.0)),
             (lambda x: m.papp(x), lambda: setattr(held, "s", 5.0))]
    # inside containers too (each ran the first program): a set of called objects, a partial or a
    # bound method in a list, an object among the keywords of a partial in a dict, objects five
    # levels down, a frozenset in a tuple
    m.called, m.partials, m.methods = {_Scaler(2.0)}, [functools.partial(F.leaky_relu, negative_slope=0.1)], \
        [_Scaler(2.0).__call__]
    m.kw = {"f": functools.partial(lambda x, o: o(x) + 1, o=_Scaler(2.0))}
    m.deep, m.frozen = {"l": [_Wrap(_Wrap(_Scaler(2.0)))]}, (frozenset({_Scaler(2.0)}),)
    cases += [(lambda x: x * sum(q.s for q in m.called), lambda: setattr(next(iter(m.called)), "s", 5.0)),
              (lambda x: m.partials[0](x), lambda: m.partials[0].keywords.__setitem__("negative_slope", 0.5)),
              (lambda x: m.methods[0](x), lambda: setattr(m.methods[0].__self__, "s", 5.0)),
              (lambda x: m.kw["f"](x), lambda: setattr(m.kw["f"].keywords["o"], "s", 5.0)),
              (lambda x: m.deep["l"][0](x), lambda: setattr(m.deep["l"][0].inner.inner, "s", 5.0)),
              (lambda x: x * sum(q.s for q in m.frozen[0]), lambda: setattr(next(iter(m.frozen[0])), "s", 5.0))]
    # a library's config in a list or dict, a module in a plain dict (no submodule), a deque, an object
    # referring to itself, objects seven levels down (each ran the first program)
    import transformers
    config = functools.partial(transformers.LlamaConfig, hidden_size=8, num_attention_heads=2, num_hidden_layers=1,
                               intermediate_size=16, vocab_size=10)
    selfish = _Scaler(2.0)
    selfish.me, selfish.all = selfish, [selfish]
    m.cfgs, m.cfgd, m.mods = [config()], {"c": config()}, {"act": torch.nn.LeakyReLU(0.1)}
    m.dq, m.selfish = collections.deque([_Scaler(2.0)]), [selfish]
    m.deeper = {"l": [_Wrap(_Wrap(_Wrap(_Wrap(_Scaler(2.0)))))]}
    cases += [(lambda x: x * m.cfgs[0].rms_norm_eps, lambda: setattr(m.cfgs[0], "rms_norm_eps", 2e-6)),
              (lambda x: x * m.cfgd["c"].rms_norm_eps, lambda: setattr(m.cfgd["c"], "rms_norm_eps", 2e-6)),
              (lambda x: m.mods["act"](x), lambda: setattr(m.mods["act"], "negative_slope", 0.5)),
              (lambda x: m.dq[0](x), lambda: setattr(m.dq[0], "s", 3.0)),
              (lambda x: m.selfish[0](x), lambda: setattr(selfish, "s", 3.0)),
              (lambda x: m.deeper["l"][0](x), lambda: setattr(m.deeper["l"][0].inner.inner.inner.inner, "s", 3.0))]
    _each_change_compiles_once(cases, x)


class _SlotScale:
    __slots__ = ("s",)

    def __init__(self, s):
        self.s = s


class _SlotCall(_SlotScale):
    __slots__ = ()

    def __call__(self, x):
        return x * self.s


@dataclasses.dataclass(slots=True)
class _SlotConfig:
    s: float
    inner: list


def test_a_fraction_or_decimal_on_a_config_keys_the_cache():
    """`fractions.Fraction` and `decimal.Decimal` are numbers a config holds: changed in place,
    a new program (the first ran, silently: they were held by identity)."""
    import decimal
    import fractions

    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cfg = types.SimpleNamespace(p=fractions.Fraction(1, 2), d=decimal.Decimal("0.5"))
    _each_change_compiles_once([(lambda x: x * float(cfg.p), lambda: setattr(cfg, "p", fractions.Fraction(2, 3))),
                                (lambda x: x * float(cfg.d), lambda: setattr(cfg, "d", decimal.Decimal("0.25")))], x)


def test_an_object_of_a_class_made_at_run_time_keys_the_cache():
    """An instance of a class made by `dataclasses.make_dataclass` (or `types.new_class`), which
    Python names after the `types` module: the user's, its numbers keyed (it was taken for the
    standard library's, and a changed value ran the first program, silently)."""
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cfg = dataclasses.make_dataclass("Cfg", [("lr", float, 0.5)])()
    cls = dataclasses.make_dataclass("Scaled", [("lr", float, 0.5)])  # (and a number set on such a class)
    cls.scale = 1.0
    _each_change_compiles_once([(lambda x: x * cfg.lr, lambda: setattr(cfg, "lr", 2.0)),
                                (lambda x: x * cls.scale, lambda: setattr(cls, "scale", 4.0))], x)


def test_a_config_arguments_class_keys_the_cache():
    """A config object passed as an argument is keyed by its class too, not its class's name:
    two classes of one name (made by `type()`, or a class statement run twice) with different
    class attributes, and a class attribute changed between calls, read through the instance,
    are other programs (the first ran, silently)."""
    x = torch.ones(4, 2, dtype=torch.float64)
    f = hpfun.shard(lambda x, c: x * c.v, mesh=MESH, in_specs=(P("a"), None), out_specs=P())
    a, b = type("N", (), {"v": 1.5}), type("N", (), {"v": 2.5})
    for cls in (a, b, a):
        torch.testing.assert_close(f(x, cls()).full(), x * cls.v, rtol=0, atol=0)

    class Cfg:
        v = 1.5

    c = Cfg()
    g = hpfun.shard(lambda x, c: x * type(c).v, mesh=MESH, in_specs=(P("a"), None), out_specs=P())
    for v in (1.5, 4.0):
        Cfg.v = v
        torch.testing.assert_close(g(x, c).full(), x * v, rtol=0, atol=0)
    assert (f.trace_count, g.trace_count) == (2, 2)


class _Scaled(typing.NamedTuple):
    a: float

    def scale(self):
        return 2.0


@dataclasses.dataclass
class _WithClassVar:
    a: float = 1.0
    SCALE: typing.ClassVar[float] = 2.0


def test_a_container_arguments_class_keys_the_cache():
    """A dataclass or NamedTuple argument (flattened as a container) is keyed by what its class
    holds too: a ClassVar changed between calls, a method patched on the class, are other
    programs (the first ran, silently)."""
    x = torch.ones(4, 2, dtype=torch.float64)
    f = hpfun.shard(lambda x, c: x * c.a * c.SCALE, mesh=MESH, in_specs=(P("a"), None), out_specs=P())
    g = hpfun.shard(lambda x, c: x * c.a * c.scale(), mesh=MESH, in_specs=(P("a"), None), out_specs=P())
    scale = _Scaled.scale
    try:
        for v in (2.0, 6.0):
            _WithClassVar.SCALE = v
            _Scaled.scale = lambda self, v=v: v
            torch.testing.assert_close(f(x, _WithClassVar()).full(), x * v, rtol=0, atol=0)
            torch.testing.assert_close(g(x, _Scaled(1.0)).full(), x * v, rtol=0, atol=0)
    finally:
        _WithClassVar.SCALE, _Scaled.scale = 2.0, scale
    assert (f.trace_count, g.trace_count) == (2, 2)


def test_a_config_class_counting_its_instances_names_the_count_when_it_compiles_again():
    """A config whose class counts its instances (`Cfg.created += 1` in `__init__`) keys a new
    program at every call; the warning names the class's value that changed, not the config's
    repr (which had read `Cfg(a=2.0) -> Cfg(a=2.0)`), and says where such a counter belongs."""
    class Cfg:
        created = 0

        def __init__(self):
            Cfg.created += 1
            self.a = 2.0

        def __repr__(self):
            return f"Cfg(a={self.a})"

    f = hpfun.shard(lambda x, c: x * c.a, mesh=MESH, in_specs=(P("a"), None), out_specs=P())
    x = torch.ones(4, 2, dtype=torch.float64)
    with pytest.warns(hpfun.RetraceWarning, match=r"(?s)the class of args\[1\] changed \(last .*Cfg\.created = \d+ -> "
                      r".*Cfg\.created = \d+\).*itertools\.count"):
        for _ in range(6):
            f(x, Cfg())


def test_a_called_object_argument_keys_the_cache_by_its_values():
    """An object of the user's passed as an argument and called (`act(x)`, `act = Scale()`) is
    keyed by its values and its class, as a config is: a value set on it between calls, or its
    class's `__call__` patched, is another program (it was keyed by identity: the first ran,
    silently)."""
    class Scale:
        def __init__(self):
            self.a = 1.0

        def __call__(self, x):
            return x * self.a * 2

    f = hpfun.shard(lambda x, act: act(x), mesh=MESH, in_specs=(P("a"), None), out_specs=P())
    x, act = torch.ones(4, 2, dtype=torch.float64), Scale()
    torch.testing.assert_close(f(x, act).full(), x * 2, rtol=0, atol=0)
    act.a = 5.0
    torch.testing.assert_close(f(x, act).full(), x * 10, rtol=0, atol=0)
    Scale.__call__ = lambda self, x: x * self.a * 3
    torch.testing.assert_close(f(x, act).full(), x * 15, rtol=0, atol=0)
    assert f.trace_count == 3
    torch.testing.assert_close(f(x, act).full(), x * 15, rtol=0, atol=0)
    assert f.trace_count == 3


_FN_SCALE = 1.0  # read by _scaled_by_global, a function passed as an argument


def _scaled_by_global(x):
    return x * _FN_SCALE


class _Namespace:
    lr = 1.0

    @classmethod
    def scaled(cls, t):
        return t * cls.lr


def test_a_class_or_function_argument_keys_the_cache_by_what_it_reads(monkeypatch):
    """A class passed as a namespace (`f(x, Hyper)`, read as `ns.lr`), a function of the user's
    (the globals it loads, its closure's values), a partial (what it binds, edited in place) and a
    method of a config object (its object's values), each changed between calls: another program
    (each was keyed by identity, and the first ran, silently)."""
    x = torch.ones(4, 2, dtype=torch.float64)
    cell = [1.0]
    part = functools.partial(torch.mul, other=1.0)

    class Holder:
        def __init__(self):
            self.k = 1.0

        def go(self, t):
            return t * self.k

    held = Holder()
    cases = {"a class": (_Namespace, lambda fn, x: x * fn.lr, lambda v: setattr(_Namespace, "lr", v)),
             "a global": (_scaled_by_global, lambda fn, x: fn(x),
                          lambda v: monkeypatch.setattr(sys.modules[__name__], "_FN_SCALE", v)),
             "a closure": (lambda t: t * cell[0], lambda fn, x: fn(x), lambda v: cell.__setitem__(0, v)),
             "a partial": (part, lambda fn, x: fn(x), lambda v: part.keywords.__setitem__("other", v)),
             "a method": (held.go, lambda fn, x: fn(x), lambda v: setattr(held, "k", v)),
             "a classmethod": (_Namespace.scaled, lambda fn, x: fn(x), lambda v: setattr(_Namespace, "lr", v))}
    try:
        for name, (arg, body, set_value) in cases.items():
            f = hpfun.shard(body, mesh=MESH, in_specs=(None, P("a")), out_specs=P())
            for v in (1.0, 3.0, 3.0, 5.0):
                set_value(v)
                torch.testing.assert_close(f(arg, x).full(), x * v, rtol=0, atol=0, msg=name)
            assert f.trace_count == 3, name
    finally:
        _Namespace.lr = 1.0


class _HeldConfig:
    s = 1.0


class _HeldScaler:
    """Held by a module only through its classmethod."""

    c = 1.0

    @classmethod
    def apply(cls, t):
        return t * cls.c


class _HoldsCode(torch.nn.Module):
    """A module holding code of the user's: a function, a partial of one, a class, a config
    object whose class holds a value its forward reads, and a classmethod."""

    def __init__(self):
        super().__init__()
        self.fn, self.part = _scaled_by_global, functools.partial(_scaled_by_global)
        self.cls, self.cfg, self.act = _Namespace, _HeldConfig(), _HeldScaler.apply

    def forward(self, x):
        return self.fn(x) + self.part(x) + x * self.cls.lr * self.cfg.s + self.act(x)


def test_what_a_closed_over_module_holds_of_the_users_code_keys_the_cache(monkeypatch):
    """A global read by a function a module holds (`self.fn = helper`, or in a partial), a class
    attribute of a class it holds (`self.cls.lr`), of its config object's class (`self.cfg.s`
    where `s` is `_HeldConfig.s`) or of a classmethod's class (`self.act = _HeldScaler.apply`),
    changed between calls: another program (the first ran, silently)."""
    try:
        _each_change_compiles_again(_HoldsCode(), [
            lambda: monkeypatch.setattr(sys.modules[__name__], "_FN_SCALE", 2.0), lambda: setattr(_Namespace, "lr", 3.0),
            lambda: setattr(_HeldConfig, "s", 5.0), lambda: setattr(_HeldScaler, "c", 7.0)])
    finally:
        _Namespace.lr, _HeldConfig.s, _HeldScaler.c = 1.0, 1.0, 1.0


def _each_change_compiles_again(m, changes) -> None:
    """A closed-over module's step called before and after each change (and once more unchanged):
    equal to eager's every time, one program per change."""
    f = hpfun.shard(lambda x: m(x), mesh=MESH, in_specs=(P("a"),), out_specs=P())
    x = torch.ones(4, 2, dtype=torch.float64)
    for change in [lambda: None, *changes, lambda: None]:
        change()
        torch.testing.assert_close(f(x).full(), m(x), rtol=0, atol=0)
    assert f.trace_count == 1 + len(changes)


@dataclasses.dataclass
class _CodeBox:
    fn: object


_METHOD_SCALE = 1.0  # read only by _CodeHolder.scaled


class _CodeHolder:
    def __init__(self):
        self.fn = _scaled_by_global

    def scaled(self, x):
        return x * _METHOD_SCALE


class _HoldsCodeInContainers(torch.nn.Module):
    """The same code held in a list, a dict (a partial), a tuple (a classmethod), a dataclass, a
    plain object, a list of classes and a SimpleNamespace; a method of an object of the user's in
    a list, and in a partial."""

    def __init__(self):
        super().__init__()
        self.acts, self.parts, self.cms = [_scaled_by_global], {"a": functools.partial(_scaled_by_global)}, \
            (_HeldScaler.apply,)
        self.box, self.holder, self.classes = _CodeBox(_scaled_by_global), _CodeHolder(), [_Namespace]
        self.ns = types.SimpleNamespace(fn=_scaled_by_global)
        self.methods = [_CodeHolder().scaled, functools.partial(_CodeHolder().scaled)]

    def forward(self, x):
        return self.acts[0](x) + 2 * self.parts["a"](x) + 4 * self.cms[0](x) + 8 * self.box.fn(x) \
            + 16 * self.holder.fn(x) + 32 * x * self.classes[0].lr + 64 * self.ns.fn(x) + 128 * self.methods[0](x) \
            + 256 * self.methods[1](x)


def test_code_a_closed_over_module_holds_in_containers_and_objects_keys_the_cache(monkeypatch):
    """What `test_what_a_closed_over_module_holds_of_the_users_code_keys_the_cache` checks, with
    the code in the module's lists, dicts, tuples, dataclasses and objects (each was keyed only
    held directly: a global it read changed between calls ran the first program)."""
    try:
        _each_change_compiles_again(_HoldsCodeInContainers(), [
            lambda: monkeypatch.setattr(sys.modules[__name__], "_FN_SCALE", 2.0), lambda: setattr(_Namespace, "lr", 3.0),
            lambda: setattr(_HeldScaler, "c", 7.0),
            lambda: monkeypatch.setattr(sys.modules[__name__], "_METHOD_SCALE", 5.0)])
    finally:
        _Namespace.lr, _HeldScaler.c = 1.0, 1.0


class _Overrides:
    """A class used as a namespace, a setting added to it between calls (`setattr(cls, k, v)`
    from command-line overrides)."""

    lr = 1.0


_SETTING = "LR"  # the name of a config module's setting, read with getattr


def _setting_reader(key):
    return lambda x: x * getattr(hpfun_test_settings, key)  # noqa: F821


class _Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2

    def scaled(self, x):
        return self.forward(x) * 3


def test_settings_added_to_a_class_or_named_by_a_variable_or_a_config_module_argument_key_the_cache():
    """Each changed between calls is another program (the first ran, silently): a class attribute
    added and read with a default (`getattr(_Overrides, "smoothing", 0.0)`), directly or through a
    module holding the class; a config module's setting read by a name in a global
    (`getattr(settings, _SETTING)`), in a tuple of names, in a closure or an argument (every
    setting of a module so read keys it), or a global read through `globals()`;
    a config module given as an argument, made at run time; a module's bound method given as an
    argument (`crit.forward`, `crit.label_smoothing` changed; `m.__call__` with a hook added;
    `m.scaled` with its class's forward patched)."""
    settings = types.ModuleType("hpfun_test_settings")
    settings.LR, settings.WD = 1.0, 0.0
    settings.train, settings.SCHED = types.ModuleType("hpfun_test_settings.train"), {"a": {"b": {"c": {"d": 1.0}}}}
    settings.train.LR = 1.0
    holder = torch.nn.Module()
    holder.cls = _Overrides
    crit = torch.nn.CrossEntropyLoss()
    hooked, patched, plain, forward = _Doubler(), _Doubler(), _Doubler(), _Doubler.forward
    module = sys.modules[__name__]
    module.hpfun_test_settings, module._GLOBAL_READ = settings, 1.0
    x = torch.ones(4, 2, dtype=torch.float64)
    y = torch.randint(0, 2, (4,), generator=torch.Generator().manual_seed(0))
    cases = {
        "class attribute added": (lambda x: x * (1.0 - getattr(_Overrides, "smoothing", 0.0)), (),
                                  lambda: setattr(_Overrides, "smoothing", 0.5)),
        "through a module": (lambda x: x * getattr(holder.cls, "scale", 1.0), (),
                             lambda: setattr(_Overrides, "scale", 3.0)),
        "name in a global": (lambda x: x * getattr(hpfun_test_settings, _SETTING), (),  # noqa: F821
                             lambda: setattr(settings, "LR", 2.0)),
        "names in a tuple": (lambda x: x * {k: getattr(hpfun_test_settings, k) for k in ("LR", "WD")}["LR"],  # noqa: F821
                             (), lambda: setattr(settings, "LR", 4.0)),
        "globals()": (lambda x: x * globals()["_GLOBAL_READ"], (), lambda: setattr(module, "_GLOBAL_READ", 5.0)),
        "name in a closure": (_setting_reader("LR"), (), lambda: setattr(settings, "LR", 7.0)),
        "name as an argument": (lambda x, k: x * getattr(hpfun_test_settings, k), ("LR",),  # noqa: F821
                                lambda: setattr(settings, "LR", 8.0)),
        "module argument": (lambda x, cfg: x * cfg.LR, (settings,), lambda: setattr(settings, "LR", 6.0)),
        "module argument's module": (lambda x, cfg: x * cfg.train.LR, (settings,),
                                     lambda: setattr(settings.train, "LR", 9.0)),
        "deep in a module argument": (lambda x, cfg: x * cfg.SCHED["a"]["b"]["c"]["d"], (settings,),
                                      lambda: settings.SCHED["a"]["b"]["c"].__setitem__("d", 3.0)),
        "bound method argument": (lambda x, loss: loss(x, y), (crit.forward,),
                                  lambda: setattr(crit, "label_smoothing", 0.3)),
        "bound method argument, a hook added": (lambda x, f: f(x), (hooked.__call__,), lambda: hooked.register_forward_hook(
            lambda m, i, out: out * 5)),
        "bound method argument, its class patched": (lambda x, f: f(x), (patched.scaled,), lambda: setattr(
            _Doubler, "forward", lambda self, x: x * 9)),
        "bound method argument, a hook for every module added": (lambda x, f: f(x), (plain.__call__,), lambda: (
            global_hooks.append(torch.nn.modules.module.register_module_forward_hook(
                lambda m, i, out: out * 7 if isinstance(m, _Doubler) else None)))),
    }
    global_hooks: list = []
    try:
        for name, (fn, extra, change) in cases.items():
            settings.LR, module._GLOBAL_READ, crit.label_smoothing = 1.0, 1.0, 0.0
            for k in ("smoothing", "scale"):
                if k in vars(_Overrides):
                    delattr(_Overrides, k)
            f = hpfun.shard(fn, mesh=MESH, in_specs=(P("a"), *[None] * len(extra)), out_specs=P())
            for step in (lambda: None, change, lambda: None):
                step()
                torch.testing.assert_close(f(x, *extra).full(), fn(x, *extra), rtol=0, atol=1e-15, msg=name)
            assert f.trace_count == 2, name
    finally:
        _Doubler.forward = forward
        for handle in global_hooks:
            handle.remove()
        for k in ("smoothing", "scale"):
            if k in vars(_Overrides):
                delattr(_Overrides, k)
        del module.hpfun_test_settings, module._GLOBAL_READ


def test_a_library_outside_site_packages_whose_classes_name_each_other_is_keyed_once_per_class(tmp_path, monkeypatch):
    """A library on PYTHONPATH (a clone, `pip install --target`) is the user's code: its classes
    are keyed by what their methods read, and each method names the other classes. The walk
    went down every path (classes times methods, to the power of the depth): a first call of
    minutes with torchrl's classes. Each class is now walked once per depth, and the key
    hashes and compares in linear time; a class value changed between calls still keys."""
    n = 6
    (tmp_path / "hpfun_test_dense_lib.py").write_text("".join(
        f"class C{i}:\n    scale = 1.0\n" + "".join(
            f"    def f{m}(self):\n        return [{', '.join(f'C{j}' for j in range(n) if j != i)}]\n"
            for m in range(6)) for i in range(n)))
    monkeypatch.syspath_prepend(str(tmp_path))
    lib = importlib.import_module("hpfun_test_dense_lib")
    members = []
    walked = lift._walked_member
    monkeypatch.setattr(lift, "_walked_member", lambda k, v: members.append(k) or walked(k, v))
    helper = lib.C0()
    f = hpfun.shard(lambda x, h: x * h.scale, mesh=MESH, in_specs=(P("a"), None), out_specs=P("a"))
    x = torch.ones(4, 2, dtype=torch.float64)
    torch.testing.assert_close(f(x, helper).full(), x)
    assert len(members) < 2000, len(members)  # (it was 719,763)
    lib.C3.scale = 2.0  # (read by no one: another program all the same, as every class value keys)
    torch.testing.assert_close(f(x, helper).full(), x)
    lib.C0.scale = 3.0
    torch.testing.assert_close(f(x, helper).full(), x * 3.0)
    assert f.trace_count == 3


def test_a_package_outside_site_packages_whose_modules_name_each_other_is_walked_once(tmp_path, monkeypatch):
    """`import pkg.sig as sig` inside pkg.sig.classical.jax, reading `sig.classical.jax.SCALE`
    (einx's tracer does): the walk of the user's modules went round the cycle until a
    RecursionError, x-transformers' first call from a `pip install --target` folder; the value
    read still keys the program."""
    jax = tmp_path / "hpfun_test_cycle" / "sig" / "classical"
    jax.mkdir(parents=True)
    (tmp_path / "hpfun_test_cycle" / "__init__.py").write_text("from . import sig\n")
    (jax.parent / "__init__.py").write_text("from . import classical\n")
    (jax / "__init__.py").write_text("from . import jax\n")
    (jax / "jax.py").write_text("import hpfun_test_cycle.sig as sig\nSCALE = 2.0\n\n\n"
                                "def double(x):\n    return x * sig.classical.jax.SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = importlib.import_module("hpfun_test_cycle")
    fn = pkg.sig.classical.jax.double
    f = hpfun.shard(lambda x: fn(x), mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    x = torch.ones(4, 2, dtype=torch.float64)
    for scale in (2.0, 3.0):
        pkg.sig.classical.jax.SCALE = scale
        torch.testing.assert_close(f(x).full(), x * scale, rtol=0, atol=0)
    assert f.trace_count == 2


def test_an_attribute_dict_config_a_module_holds_keys_the_cache_by_its_items():
    """`model.cfg = AttrDict(scale=2.0, opt=AttrDict(lr=0.5))` (EasyDict, addict alike), an item
    changed in place between calls, at the top or nested: a dict subclass was neither watched
    nor keyed, so the first program ran on, silently."""
    model = torch.nn.Linear(3, 3, dtype=torch.float64)
    model.cfg = _AttrDict(scale=2.0, opt=_AttrDict(lr=0.5))

    def fn(x):
        return model(x) * model.cfg.scale + model.cfg.opt.lr

    f = hpfun.shard(fn, mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for change in (lambda: None, lambda: model.cfg.__setitem__("scale", 4.0),
                   lambda: model.cfg.opt.__setitem__("lr", 0.1)):
        change()
        torch.testing.assert_close(f(x).full(), fn(x), rtol=1e-12, atol=1e-12)
    assert f.trace_count == 3


class _AttributeSettings(dict):
    """A dict subclass holding its settings as attributes (`cfg.scale = 2.0`), beside its items."""


_SETTINGS = _AttributeSettings(offset=1.0)
_SETTINGS.scale = 2.0


def test_a_dict_subclass_config_a_module_holds_keys_the_cache_by_its_attributes_too():
    """The same config held by a module (`self.cfg = Cfg(); self.cfg.scale = 2.0`): its items
    keyed the program, its attributes not."""
    model = torch.nn.Linear(3, 3, dtype=torch.float64)
    model.cfg = _AttributeSettings(offset=1.0)

    def fn(x):
        return model(x) * getattr(model.cfg, "scale", 1.0) + model.cfg["offset"]

    f = hpfun.shard(fn, mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for change in (lambda: None, lambda: setattr(model.cfg, "scale", 2.0), lambda: setattr(model.cfg, "scale", 5.0)):
        change()
        torch.testing.assert_close(f(x).full(), fn(x), rtol=1e-12, atol=1e-12)
    assert f.trace_count == 3


def test_a_dict_subclass_argument_is_handed_over_with_its_attributes_which_key_the_cache():
    """`f(x, cfg)` with `cfg.scale` set on a dict subclass: the function was handed a rebuilt one
    without it (AttributeError where eager runs); a changed attribute compiles again, and one the
    function sets reaches the caller's (it was left out, silently)."""
    def fn(x, cfg):
        cfg.calls = "seen"
        return x * cfg.scale + cfg["offset"]

    f = hpfun.shard(fn, mesh=MESH, in_specs=(P("a"), None), out_specs=P("a"))
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cfg = _AttributeSettings(offset=1.0)
    for scale in (2.0, 2.0, 5.0):
        cfg.scale = scale
        torch.testing.assert_close(f(x, cfg).full(), fn(x, cfg), rtol=1e-12, atol=1e-12)
    assert f.trace_count == 3  # (the first call's `calls`, new to the second, and the new scale)
    given = _AttributeSettings(offset=0.0)
    given.scale = 1.0
    f(x, given)
    assert given.calls == "seen"


def test_a_dict_subclass_config_keys_the_cache_by_its_attributes_too():
    """`CFG.scale = 4.0` between calls, on a global dict subclass: its items were read, its
    attributes not, so the first program ran on, silently."""
    def fn(x):
        return x * _SETTINGS.scale + _SETTINGS["offset"]

    f = hpfun.shard(fn, mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    try:
        for change in (lambda: None, lambda: setattr(_SETTINGS, "scale", 4.0), lambda: setattr(_SETTINGS, "new", 1)):
            change()
            torch.testing.assert_close(f(x).full(), fn(x), rtol=1e-12, atol=1e-12)
    finally:
        _SETTINGS.scale = 2.0
        vars(_SETTINGS).pop("new", None)
    assert f.trace_count == 3  # (an attribute added: walked again, and its value keys the program)


class _FieldsConfig:
    """A hand-made ConfigDict: a missing name raises KeyError from its `__getattr__`."""

    def __init__(self, fields):
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, k):
        return self._fields[k]


_FIELDS_CFG = _FieldsConfig({"scale": 2.0, "opt": _FieldsConfig({"lr": 1.0})})


class _AttrDict(dict):
    """A quick attribute dict: a missing name raises KeyError, not AttributeError."""

    def __getattr__(self, k):
        return self[k]


_ATTR_CFG = _AttrDict(scale=2.0, inner=_AttrDict(b=3.0))


def test_an_attribute_dict_raising_key_error_for_missing_names_is_read_and_keys_the_cache():
    """A global or closed-over config whose `__getattr__` raises KeyError: capture's probe of it
    for a random generator's or a clock's name raised it, and the call failed at the config's
    line; read, and a value changed between calls compiles again."""
    closed = _AttrDict(scale=7.0)
    x = torch.ones(4, 2, dtype=torch.float64)
    for fn in (lambda x: x * _ATTR_CFG.scale * _ATTR_CFG.inner.b, lambda x: x * closed.scale,
               lambda x: x * _FIELDS_CFG.scale * _FIELDS_CFG.opt.lr):  # (an object: its `__wrapped__` raised)
        f = hpfun.shard(fn, mesh=MESH, in_specs=P("a"), out_specs=P("a"))
        for scale in (2.0, 5.0):
            _ATTR_CFG["scale"] = closed["scale"] = _FIELDS_CFG._fields["scale"] = scale
            torch.testing.assert_close(f(x).full(), fn(x), rtol=0, atol=0)
        assert f.trace_count == 2


class _Reads:
    """A config whose code reads a global: a property, a method, `__call__`."""

    def __init__(self):
        self.a = 1.0

    @property
    def lr(self):
        return _FN_SCALE

    def scale(self):
        return _FN_SCALE * _Namespace.lr

    def __call__(self, x):
        return x * _FN_SCALE


class _Outer:
    class Optim:
        lr = 1.0

    ns = types.SimpleNamespace(lr=1.0)


def test_what_an_arguments_code_or_a_namespaces_inner_values_read_keys_the_cache(monkeypatch, tmp_path):
    """A global (or a class's value) read by a config argument's property, method or `__call__`; an
    attribute of the user's config module read through its package (`pkg.settings.LR`); a value
    of a class or namespace held by a closed-over class (`_Outer.Optim.lr`, `_Outer.ns.lr`): each
    changed between calls is another program (the first ran, silently)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "hpfun_test_pkg").mkdir()
    (tmp_path / "hpfun_test_pkg" / "__init__.py").write_text("")
    (tmp_path / "hpfun_test_pkg" / "settings.py").write_text("LR = 1.0\n")
    import hpfun_test_pkg.settings

    def through_package(t):
        return t * hpfun_test_pkg.settings.LR

    x, cfg = torch.ones(4, 2, dtype=torch.float64), _Reads()
    bodies = [lambda c, x: x * c.lr, lambda c, x: x * c.scale(), lambda c, x: c(x), lambda c, x: c(x),
              lambda c, x: x * _Outer.Optim.lr * _Outer.ns.lr]
    args = [cfg, cfg, cfg, through_package, None]
    sharded = [hpfun.shard(body, mesh=MESH, in_specs=(None, P("a")), out_specs=P()) for body in bodies]
    changes = [lambda: None, lambda: monkeypatch.setattr(sys.modules[__name__], "_FN_SCALE", 2.0),
               lambda: setattr(_Namespace, "lr", 3.0), lambda: setattr(hpfun_test_pkg.settings, "LR", 4.0),
               lambda: setattr(_Outer.Optim, "lr", 5.0), lambda: setattr(_Outer.ns, "lr", 6.0)]
    try:
        for change in changes:
            change()
            for body, arg, f in zip(bodies, args, sharded, strict=True):
                torch.testing.assert_close(f(arg, x).full(), body(arg, x), rtol=0, atol=0)
        # (a config is keyed by what all its class's methods read: `scale` reads `_Namespace.lr`)
        assert [f.trace_count for f in sharded] == [3, 3, 3, 2, 3]
    finally:
        _Namespace.lr, _Outer.Optim.lr, _Outer.ns.lr = 1.0, 1.0, 1.0


def _scaled_by_own_attribute(t):
    return t * _scaled_by_own_attribute.scale


_scaled_by_own_attribute.scale = 1.0


def test_a_functions_own_attribute_and_a_config_module_read_by_getattr_key_the_cache(monkeypatch, tmp_path):
    """`helper.scale` read by the helper itself and `getattr(settings, "LR")` of the user's config
    module, changed between calls: another program (the first ran, silently)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "hpfun_test_getattr_settings.py").write_text("LR = 1.0\n")
    import hpfun_test_getattr_settings as settings

    x = torch.ones(4, 2, dtype=torch.float64)
    fns = [lambda x: _scaled_by_own_attribute(x), lambda x: x * getattr(settings, "LR")]
    sharded = [hpfun.shard(fn, mesh=MESH, in_specs=(P("a"),), out_specs=P()) for fn in fns]
    try:
        for change in (lambda: None, lambda: setattr(_scaled_by_own_attribute, "scale", 2.0),
                       lambda: setattr(settings, "LR", 3.0)):
            change()
            for fn, f in zip(fns, sharded, strict=True):
                torch.testing.assert_close(f(x).full(), fn(x), rtol=0, atol=0)
        assert [f.trace_count for f in sharded] == [2, 2]
    finally:
        _scaled_by_own_attribute.scale = 1.0


def test_a_library_module_class_patched_between_calls_compiles_again():
    """`torch.nn.Linear.forward` patched after a call (as kernel libraries patch a model's norms):
    another program (the first ran, silently; a class of the user's compiled again already)."""
    lin = torch.nn.Linear(2, 2, dtype=torch.float64)
    f = hpfun.shard(lambda x: lin(x), mesh=MESH, in_specs=(P("a"),), out_specs=P())
    x, forward = torch.ones(4, 2, dtype=torch.float64), torch.nn.Linear.forward
    torch.testing.assert_close(f(x).full(), lin(x), rtol=0, atol=0)
    try:
        torch.nn.Linear.forward = lambda self, t: forward(self, t) + 5
        torch.testing.assert_close(f(x).full(), lin(x), rtol=0, atol=0)
    finally:
        torch.nn.Linear.forward = forward
    torch.testing.assert_close(f(x).full(), lin(x), rtol=0, atol=0)
    assert f.trace_count == 2


def test_a_config_arguments_class_value_changed_by_the_function_is_named_and_set_back():
    class Counted:
        n = 0

    f = hpfun.shard(lambda x, c: (setattr(type(c), "n", type(c).n + 1), x * type(c).n)[1], mesh=MESH,
                    in_specs=(P("a"), None), out_specs=P())
    with pytest.raises(hpfun.CaptureError, match=r"args\[1\]: .*Counted\.n: changed from 0 to 1 while the function"):
        f(torch.ones(4, 2), Counted())
    assert Counted.n == 0

    class Sub(Counted):  # (`type(c).n += 1` sets n on Sub, where it was inherited: taken away again)
        pass

    with pytest.raises(hpfun.CaptureError, match=r"args\[1\]: .*Sub\.n: changed from nothing \(not set\) to 1 while"):
        f(torch.ones(4, 2), Sub())
    assert "n" not in vars(Sub) and Sub.n == 0

    g = hpfun.shard(lambda x, c: (setattr(type(c), "last", x.sum()), x * 2)[1], mesh=MESH, in_specs=(P("a"), None),
                    out_specs=P())  # (a tensor: named so, not by the id hpfun keys it by)
    with pytest.raises(hpfun.CaptureError, match=r"args\[1\]: .*Counted\.last: changed from nothing \(not set\) to a "
                       r"tensor while"):
        g(torch.ones(4, 2), Counted())
    assert "last" not in vars(Counted)


def test_a_lambda_made_anew_at_every_call_compiles_once_for_the_same_values():
    """`f(x, lambda t: t * k)` made at every call (a closure of a loop's variable): one program
    while `k` is the same, another for another `k` (each new lambda compiled again)."""
    def made(k):
        return lambda t: t * k

    f = hpfun.shard(lambda x, fn: fn(x), mesh=MESH, in_specs=(P("a"), None), out_specs=P())
    x = torch.ones(4, 2, dtype=torch.float64)
    for k in (2.0, 2.0, 2.0, 3.0, 3.0):
        torch.testing.assert_close(f(x, made(k)).full(), x * k, rtol=0, atol=0)
    assert f.trace_count == 2


def test_a_function_argument_that_changes_what_it_reads_is_refused():
    """A function argument whose call changes a value it reads (a counter in a global list) would
    change it once, at the trace: refused, as a changed global is (it was baked in silently)."""
    count = [0]

    def bump(t):
        count[0] += 1
        return t * count[0]

    f = hpfun.shard(lambda x, fn: fn(x), mesh=MESH, in_specs=(P("a"), None), out_specs=P())
    with pytest.raises(hpfun.CaptureError, match=r"args\[1\]: changed while the function was traced"):
        f(torch.ones(4, 2), bump)


def test_a_read_only_view_of_a_dict_keys_the_cache():
    """`types.MappingProxyType(cfg)` closed over, the dict it shows changed between calls: a new
    program (the first ran, silently: the view was held opaque)."""
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    src = {"lr": 0.5}
    view = types.MappingProxyType(src)
    _each_change_compiles_once([(lambda x: x * view["lr"], lambda: src.__setitem__("lr", 9.0))], x)


def test_fractions_and_decimals_key_by_their_exact_value():
    """A Fraction is keyed by its numerator and denominator, not its float (two a float cannot
    tell apart gave one program); a Decimal by its sign, digits and exponent, not `==`
    (Decimal("-0") is -0.0 as a float, Decimal("0.50") prints "0.50")."""
    import decimal
    import fractions

    x = torch.ones(4, 3, dtype=torch.float64)
    cfg = types.SimpleNamespace(p=fractions.Fraction(1), d=decimal.Decimal("0"), e=decimal.Decimal("0.5"))
    _each_change_compiles_once(
        [(lambda x: x * 0 + float(cfg.p - 1) * 1e20,
          lambda: setattr(cfg, "p", fractions.Fraction(10**20 + 1, 10**20))),
         (lambda x: torch.copysign(x, torch.tensor(float(cfg.d), dtype=torch.float64)),
          lambda: setattr(cfg, "d", decimal.Decimal("-0"))),
         (lambda x: x * len(str(cfg.e)), lambda: setattr(cfg, "e", decimal.Decimal("0.50")))], x)


def test_objects_keeping_their_numbers_in_slots_key_the_cache():
    """An object of the user's whose class declares `__slots__` (or `@dataclass(slots=True)`)
    has no `__dict__` to watch: a number changed on one a module holds directly, in a list, as a
    called activation or inside a slotted config ran the first program, silently."""
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    m = torch.nn.Module()
    m.one, m.cfgs, m.acts = _SlotScale(2.0), [_SlotScale(2.0)], [_SlotCall(3.0)]
    m.cfg = _SlotConfig(2.0, [_SlotScale(3.0)])
    cases = [(lambda x: x * m.one.s, lambda: setattr(m.one, "s", 5.0)),
             (lambda x: x * m.cfgs[0].s, lambda: setattr(m.cfgs[0], "s", 5.0)),
             (lambda x: m.acts[0](x), lambda: setattr(m.acts[0], "s", 5.0)),
             (lambda x: x * m.cfg.s, lambda: setattr(m.cfg, "s", 5.0)),
             (lambda x: x * m.cfg.inner[0].s, lambda: setattr(m.cfg.inner[0], "s", 5.0))]
    _each_change_compiles_once(cases, x)


class _Temperature:
    def __init__(self, t):
        self._t = t

    @property
    def t(self):
        return self._t


class _Node:
    def __init__(self, s):
        self.s = s


def test_what_configs_a_module_holds_hold_keys_the_cache_at_any_depth():
    """A number changed in place on an object a module holds ran the first program, silently,
    where it sat three objects down (`m.cfg.model.act.s`), behind a property (`self._t`: a
    private value a property of the class reads; other private ones are bookkeeping and key
    nothing, below), on a module in a user's object, on the config or list of a module in a plain dict, or where a
    back-reference was repointed (`c.back = a`, then `c.back = c`: both were one mark)."""
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    m = torch.nn.Module()
    m.cfg = types.SimpleNamespace(model=types.SimpleNamespace(act=types.SimpleNamespace(s=2.0)))
    m.temp, m.helper = _Temperature(2.0), types.SimpleNamespace(act=torch.nn.LeakyReLU(0.1))
    head = torch.nn.Module()
    head.cfg, head.ls = _Node(2.0), [1.0]
    m.heads = {"a": head}
    a, c = _Node(2.0), _Node(3.0)
    a.child, c.back = c, a
    m.nodes = [a]
    m.seqs = {"act": torch.nn.Sequential(torch.nn.LeakyReLU(0.1))}  # (a number on a dict-held module's submodule)
    cases = [(lambda x: x * m.cfg.model.act.s, lambda: setattr(m.cfg.model.act, "s", 5.0)),
             (lambda x: x / m.temp.t, lambda: setattr(m.temp, "_t", 5.0)),
             (lambda x: m.helper.act(x), lambda: setattr(m.helper.act, "negative_slope", 0.5)),
             (lambda x: x * m.heads["a"].cfg.s, lambda: setattr(head.cfg, "s", 5.0)),
             (lambda x: x + m.heads["a"].ls[0], lambda: head.ls.__setitem__(0, 5.0)),
             (lambda x: x * m.nodes[0].child.back.s, lambda: setattr(c, "back", c)),
             (lambda x: m.seqs["act"](x), lambda: setattr(m.seqs["act"][0], "negative_slope", 0.5))]
    _each_change_compiles_once(cases, x)
    m.helper._calls = 0  # a private counter of an object a module holds, which the function never reads: one
    f = hpfun.shard(lambda x: m.helper.act(x), mesh=MESH, in_specs=P("a"), out_specs=P("a"))  # program for
    for _ in range(3):  # every value (it compiled at every call, and ranks whose counters differed hung)
        m.helper._calls += 1
        assert torch.equal(f(x).full(), m.helper.act(x))
    assert f.trace_count == 1


def test_what_partials_objects_and_sets_held_by_classes_and_modules_hold_keys_the_cache():
    """Values a trace bakes in, reached through a class or a module, key the cache as a global's
    do (each ran the first program, silently): a called object a class holds (its number changed,
    or another put there), a partial a module holds (rebound with another keyword), objects in a
    set a module holds or in tuples in a global set (a number changed), and which keys of a dict a
    module holds keyed by its parameters are those parameters (one replaced: eager's lookup misses)."""
    x = torch.ones(4, 3, dtype=torch.float64)
    k = hpfun.shard(lambda x: _Settings.act(x), mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    try:
        for change in (None, lambda: setattr(_Settings.act, "s", 3.0), lambda: setattr(_Settings, "act", _Scaler(5.0))):
            if change:
                change()
            assert torch.equal(k(x).full(), _Settings.act(x))
    finally:
        _Settings.act = _Scaler(2.0)

    m = torch.nn.Linear(3, 1, bias=False).double()
    torch.nn.init.constant_(m.weight, 0.5)  # (-m(x) < 0: the slope counts)
    m.act = functools.partial(F.leaky_relu, negative_slope=0.1)
    m.scale = {m.weight: 3.0}
    m.powers = {_Power(1.0)}
    held = {(_Power(1.0), "x")}

    def fn(x):
        y = m.act(-m(x)) * m.scale.get(m.weight, 1.0)
        return y * sum(p.s for p in m.powers) * sum(p.s for p, _ in held)

    f = hpfun.shard(fn, mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    changes = (None, lambda: setattr(m, "act", functools.partial(F.leaky_relu, negative_slope=0.7)),
               lambda: setattr(next(iter(m.powers)), "s", 4.0), lambda: setattr(next(iter(held))[0], "s", 6.0),
               lambda: setattr(m, "weight", torch.nn.Parameter(m.weight.detach() * 2)),
               lambda: m.scale.__setitem__(m.weight, 7.0))
    for change in changes:
        if change:
            change()
        torch.testing.assert_close(f(x).full(), fn(x).detach(), rtol=1e-12, atol=1e-12)
    assert f.trace_count == len(changes)


def test_a_value_redistributed_once_serves_every_consumer():
    """Two consumers of one argument in layouts one local step apart share one all-gather."""

    def fn(b, x, w):
        return x @ w + b, b.chunk(4)[1]

    f = hpfun.shard(fn, mesh=hpfun.Mesh.simulated((2, 2), ("dp", "tp")), in_specs=(P("dp"), P(), P(None, "tp")))
    b, x, w = torch.randn(8), torch.randn(4, 6), torch.randn(6, 8)
    assert [c.kind for c in f.lower(b, x, w).collectives] == ["all_gather"]
    for got, want in zip(f(b, x, w), fn(b, x, w), strict=True):
        assert torch.allclose(got.full(), want)


def test_an_op_failing_while_the_program_runs_is_named():
    """An op raising inside the per-shard program is an hpfun error naming the op, the user's
    line, the rank and the layouts, the op's error attached as the cause."""

    def pick(x, i):
        y = x * 2
        return y[:, i]

    f = hpfun.shard(pick, mesh=MESH, in_specs=(P("a"), P()), out_specs=P())
    with pytest.raises(hpfun.ExecutionError) as info:
        f(torch.randn(4, 3), torch.tensor([0, 7]))
    text = str(info.value)
    assert "mesh rank 0 (0,)" in text and "test_silent.py" in text and "return y[:, i]" in text, text
    assert "aten.index.Tensor (node index) reading [S(0)], [R] -> [S(0)]: IndexError" in text, text
    assert isinstance(info.value.__cause__, IndexError)

    def unscale(g):  # an op of list outputs failing (a float64 scale): its layouts written as lists
        found = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_([g], found, torch.tensor(0.5, dtype=torch.float64))
        return g

    f = hpfun.shard(unscale, mesh=MESH, in_specs=P("a"), out_specs=P(), fallback="replicate")
    with pytest.raises(hpfun.ExecutionError, match=r"reading \[R\], \[R\], \[R\] -> .*inv_scale must be a float"), \
            pytest.warns(hpfun.FallbackWarning):
        f(torch.randn(8))


# ---------------------------------------------------------------------------------------------
# Partial sums through linear ops, with infinities, NaN, huge magnitudes and cancellation
# ---------------------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_MASK = torch.tensor([[True, False, True], [False, False, True], [True, True, False], [False, True, False]])
_W = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.0, 0.25]], dtype=torch.float64)
LINEAR = {  # ops a Partial(sum) value may pass through (or that must resolve it first), finite co-arguments
    "neg": lambda x: -x,
    "scale": lambda x: x * 3.0,
    "divide": lambda x: x / 4.0,
    "scale by inf": lambda x: x * float("inf"),
    "add itself": lambda x: x + x,
    "where": lambda x: torch.where(_MASK, x, x * 2),
    "sum": lambda x: x.sum(0),
    "mean": lambda x: x.mean(1),
    "transpose": lambda x: x.T,
    "flatten": lambda x: x.reshape(-1),
    "slice": lambda x: x[1:],
    "cat": lambda x: torch.cat([x, x]),
    "matmul": lambda x: x @ _W,
    "down-cast": lambda x: x.float(),
    "masked -inf": lambda x: x.masked_fill(_MASK, float("-inf")),
    "cumsum": lambda x: torch.cumsum(x, 0),
    "times replicated": lambda x: x * _W.sum(1, keepdim=True).T.repeat(4, 1),
    "lerp with itself": lambda x: torch.lerp(x, x * 2, 0.3),
    "addcmul": lambda x: torch.addcmul(x, x, _W.sum(1, keepdim=True).T.repeat(4, 1), value=0.5),
    "addcmul by inf": lambda x: torch.addcmul(x, x, _W.sum(1, keepdim=True).T.repeat(4, 1), value=float("inf")),
}
_SPECIAL = [0.0, 1.0, -2.5, 1e300, -1e300, float("inf"), float("-inf"), float("nan")]


@st.composite
def _special_terms(draw, n: int):
    """Partial(sum) terms of a (4, 3) float64 value: per element, the value on one rank and 0
    on the others, or a cancelling pair (v + c, -c, 0...) with c huge, or specials anywhere."""
    terms = torch.zeros(n, 4, 3, dtype=torch.float64)
    for i in range(4):
        for j in range(3):
            kind = draw(st.sampled_from(["one", "cancel", "any"]))
            v = draw(st.sampled_from(_SPECIAL))
            if kind == "one":
                terms[draw(st.integers(0, n - 1)), i, j] = v
            elif kind == "cancel":
                c = draw(st.sampled_from([1e15, 1e300]))
                terms[0, i, j], terms[1, i, j] = v + c, -c
            else:
                for r in range(n):
                    terms[r, i, j] = draw(st.sampled_from(_SPECIAL))
    return terms


class _PartialFirst:
    """The built-in rules, each offering only the strategies that keep a Partial input Partial
    when it has any: every claim of linearity is exercised, not only those the planner picks."""

    def lookup(self, target):
        from hpfun.rules import REGISTRY

        rule = REGISTRY.lookup(target)
        return None if rule is None else _KeepPartial(rule)


class _KeepPartial:
    def __init__(self, rule):
        self.rule = rule

    def strategies(self, call):
        offered = self.rule.strategies(call)
        keeping = [s for s in offered if any(l.partial_axes for l in s.outputs if l is not None)]
        return keeping or offered

    def emit(self, *args):
        return self.rule.emit(*args)

    def __getattr__(self, name):  # local_work and the like
        return getattr(self.rule, name)


@pytest.mark.parametrize("name", sorted(LINEAR))
@settings(max_examples=10)
@given(n=st.sampled_from([2, 4]), data=st.data())
def test_partial_sums_through_linear_ops_with_special_values(name, n, data):
    """A Partial(sum) value passes an op only where the op is linear in it for the values at
    hand (every rule's claim forced): the result equals the op on the summed value, with the
    same infinities and NaN, and finite values within the rounding the terms' magnitudes allow."""
    from hpfun.testing import assert_sharded_equal

    fn = LINEAR[name]
    terms = data.draw(_special_terms(n))
    x = hpfun.Sharded(hpfun.parse(f"[P(sum)] on {{a: {n}}}"), (4, 3), tuple(terms))
    scale = terms.abs().nan_to_num(posinf=0.0).amax(0).max().clamp(min=1.0).item() * 8
    eps = torch.finfo(torch.float32 if name == "down-cast" else torch.float64).eps
    assert_sharded_equal(fn, (x,), hpfun.Mesh.simulated((n,), ("a",)), None, out_specs=P(), rtol=0,
                         atol=scale * eps, registry=_PartialFirst())


def test_in_place_write_into_an_expanded_tensor_is_refused():
    """The gradient of a sum is ones.expand(n): one element, n aliases. A masked_fill_ into it
    sets that element in eager; a traced program would write each alias back on its own and
    compute something else, so hpfun refuses with the fix."""

    def f(x, mask):
        g = torch.func.grad(lambda t: t.sum())(x)
        return g.unsqueeze(1).masked_fill_(mask, 2.0)

    step = hpfun.shard(f, mesh=MESH, in_specs=(P("a"), P()), out_specs=P())
    x, mask = torch.arange(4.0), torch.tensor([[True], [False], [True], [False]])
    with pytest.raises(hpfun.CaptureError, match=r"masked_fill_ at .*test_silent.py:\d+.*share memory(?s:.*)clone\(\)"):
        step(x, mask)
    g = hpfun.shard(lambda x: torch.func.grad(lambda t: t.sum())(x).clone().mul_(2.0), mesh=MESH, in_specs=P("a"),
                    out_specs=P())
    assert torch.equal(g(x).full(), torch.full((4,), 2.0))  # a clone owns its memory: allowed


_TRANSFORMS = {
    "vmap(grad)": lambda x: torch.func.vmap(torch.func.grad(lambda t: (t.sin() * t).sum()))(x),
    "vmap(jacrev)": lambda x: torch.func.vmap(torch.func.jacrev(lambda t: t.tanh() * t.sum()))(x),
    "vmap(jacrev(jacrev))": lambda x: torch.func.vmap(torch.func.jacrev(torch.func.jacrev(
        lambda t: (t.sin() * t.cumsum(0)).sum())))(x),
    "vmap(jvp)": lambda x: torch.func.vmap(lambda t: torch.func.jvp(torch.sin, (t,), (torch.ones_like(t),))[1])(x),
    "hessian": lambda x: torch.func.hessian(lambda t: (t.sin() * t.cumsum(0)).sum())(x[0]),
    "linearize": lambda x: (lambda out, jfn: out + jfn(x.cos()))(*torch.func.linearize(lambda t: t.tanh() * t, x)),
}


@pytest.mark.filterwarnings("ignore:.torch.jit.script. is deprecated:DeprecationWarning")  # torch's jvp, eager too
@pytest.mark.parametrize("name", _TRANSFORMS)
def test_torch_func_transforms_over_a_split_batch_equal_eager(name):
    """The transforms the README lists as traced through, on a batch split over the mesh."""
    f = _TRANSFORMS[name]
    x = torch.randn(8, 6, dtype=torch.float64)
    got = hpfun.shard(f, mesh=MESH, in_specs=P("a"), out_specs=P())(x)
    assert torch.allclose(got.full(), f(x), rtol=0, atol=1e-12)


def test_the_overlap_check_sees_through_vmap():
    """Under vmap the written tensor is functorch's wrapper, which torch's overlap check has no
    batching rule for: jacrev batched by vmap (it fills a diagonal of zeros in place) failed to
    capture. The wrapped tensor is checked instead: the Jacobians equal eager's, and a write into
    an expanded tensor inside vmap is still refused."""

    def jacobians(x):
        return torch.func.vmap(torch.func.jacrev(lambda t: torch.tanh(t) * t.sum()))(x)

    x = torch.randn(8, 6, dtype=torch.float64)
    got = hpfun.shard(jacobians, mesh=MESH, in_specs=P("a"), out_specs=P("a"))(x)
    assert torch.equal(got.full(), jacobians(x))

    def expanded(x):
        return torch.func.vmap(lambda t: t.expand(3, 6).mul_(2.0).sum(0))(x)

    with pytest.raises(hpfun.CaptureError, match=r"mul_ at .*test_silent.py:\d+.*share memory"):
        hpfun.shard(expanded, mesh=MESH, in_specs=P("a"), out_specs=P("a"))(x)


_AFTER_A_FAILED_TRANSFORM = r"""
import torch, hpfun
from hpfun import P
mesh = hpfun.Mesh.simulated((2,), ("a",))
x = torch.randn(8, 6)
try:  # a refused op inside the nesting (a softmax of a bool tensor): a CaptureError
    hpfun.shard(lambda x: torch.func.vmap(torch.func.jacfwd(lambda t: t * torch.softmax(t > 0, 0).sum()))(x),
                mesh=mesh, in_specs=P("a"), out_specs=P("a"))(x)
except hpfun.CaptureError:
    print("refused")
jac = lambda x: torch.func.vmap(torch.func.jacfwd(lambda t: torch.sin(t) * 2))(x)  # (traced since forward-mode
print("jacobians", torch.equal(hpfun.shard(jac, mesh=mesh, in_specs=P("a"), out_specs=P("a"))(x).full(), jac(x)))
# AD's zero tangents are plain zeros: it was refused, then the keys leaked)
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
params = {k: v.detach() for k, v in model.named_parameters()}
def norms(p, x):
    g = torch.func.vmap(torch.func.grad(lambda p, xi: torch.func.functional_call(model, p, (xi,)).sum()),
                        in_dims=(None, 0))(p, x)
    return sum(v.flatten(1).norm(dim=1) ** 2 for v in g.values())
got = hpfun.shard(norms, mesh=mesh, in_specs=(P(), P("a")), out_specs=P("a"))(params, x).full()
print("equal", torch.equal(got, norms(params, x)))
"""


def test_a_failed_trace_of_a_transform_leaves_the_next_one_working():
    """A failed trace of vmap(jacfwd(f)) left torch's functorch dispatch keys excluded in the
    thread, so every later torch.func trace in the process failed. hpfun clears the failed
    frames and sets the keys back: vmap(jacfwd(sin)) (which failed so, until forward-mode AD's
    zero tangents were traced as zeros) and per-example gradient norms (vmap of grad of
    functional_call) traced after a refused nesting equal eager. In its own process: a leak
    would reach other tests."""
    out = subprocess.run([sys.executable, "-c", _AFTER_A_FAILED_TRANSFORM], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["refused", "jacobians", "True", "equal", "True"], out.stdout + out.stderr[-2000:]


def test_a_gradient_taken_of_an_expanded_tensor_is_no_write():
    """torch.func.grad of a function of the gradient of a sum (an expanded tensor) marks it as
    requiring a gradient, `requires_grad_`: in place, but no element written, so it is not
    refused (the fuzzer's nightly run found two such programs refused); results equal eager."""

    def f(x, w):
        g = torch.func.grad(lambda t: t.sum())(x)  # ones, expanded: every element one alias
        gg = torch.func.grad(lambda t: (t * w).sum() + (t ** 2).sum())(g)
        return gg, torch.func.grad(lambda t: t.sum(dim=1).mean())(g)

    x, w = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    for spec in (P("a"), P(None, "a")):
        out = hpfun.shard(f, mesh=MESH, in_specs=(spec, P()), out_specs=(P(), P()))(x, w)
        for got, want in zip(out, f(x, w), strict=True):
            assert torch.equal(got.full(), want)


@pytest.mark.parametrize("batch", [2, 4], ids=["one sample per rank", "two"])
def test_group_norm_backward_of_a_channels_last_input(batch):
    """Tokens turned back into an image (`h.transpose(1, 2).reshape(B, C, H, W)`, as diffusers'
    attention blocks do) are channels-last; a group norm of them, with the projection before it
    split on its output features, gets its gradient through a collective, contiguous. torch's
    CPU group norm backward reads the gradient with the input's strides, so the two must agree
    (the gradient was garbage, 4.2 off). With one sample per rank the block's strides look
    channels-last to `is_contiguous(channels_last)` but not to the kernel, which failed."""
    torch.manual_seed(0)
    proj, norm = torch.nn.Linear(16, 16).double(), torch.nn.GroupNorm(4, 16).double()
    qkv = torch.nn.Linear(16, 48).double()

    def block(x, w):
        x = x.requires_grad_(True)
        b, c, height, width = x.shape
        h = x.view(b, c, height * width).transpose(1, 2)
        q, k, v = qkv(h).view(b, -1, 3, 4, 4).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, c)
        h = proj(h).transpose(-1, -2).reshape(b, c, height, width) + x
        grad, = torch.autograd.grad((F.silu(norm(h)) * w).sum(), x)
        return grad

    f = hpfun.shard(block, mesh=MESH, in_specs=(P("a"), P("a")), out_specs=P("a"), state_specs={"proj.*": P("a")})
    x, w = torch.randn(batch, 16, 4, 4, dtype=torch.float64), torch.randn(batch, 16, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(f(x, w).full(), block(x.clone(), w), rtol=0, atol=1e-12)


def test_a_read_after_an_in_place_write_never_writes_the_callers_tensors():
    """`x.add_(1)` then `if x.sum() > 0`: the read is computed by replaying the ops that made it,
    the write among them, on copies of the inputs (it ran on the caller's tensors, at the trace
    and at every call's check: an argument ended at 3 where eager leaves 1, a global counter
    went up by 4 a call)."""

    def f(x):
        x.add_(1)
        return x * 2 if x.sum() > 0 else x - 1

    xe, xs = torch.zeros(4), torch.zeros(4)
    out = hpfun.shard(f, mesh=MESH, in_specs=P("a"), out_specs=P("a"))(xs)
    assert torch.equal(out.full(), f(xe)) and torch.equal(xs, xe)
    counter = torch.tensor(0.0)

    def g(x):
        counter.add_(1)
        return x * 2 if counter > 1 else x

    gs = hpfun.shard(g, mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    for i in range(3):
        assert torch.equal(gs(torch.ones(4)).full(), torch.full((4,), 2.0 if i else 1.0))
        assert counter.item() == i + 1


def test_autocast_and_the_default_dtype_around_the_call_key_the_cache():
    """A program traced under the caller's `torch.autocast` (matmuls in bfloat16) or another
    default dtype (`torch.ones(3)` in float64) is not reused outside it: each is traced anew."""
    x = torch.ones(4, 4)
    f = hpfun.shard(lambda x: x @ x, mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert f(x).full().dtype == torch.bfloat16
    assert f(x).full().dtype == torch.float32 and f.trace_count == 2
    g = hpfun.shard(lambda x: x + torch.ones(4), mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    assert g(torch.ones(4, 4, dtype=torch.float16)).full().dtype == torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert g(torch.ones(4, 4, dtype=torch.float16)).full().dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert g.trace_count == 2


VIEWED = torch.zeros(4)
VIEW = VIEWED[:2]


def test_state_written_in_place_that_another_input_views_is_refused():
    """A global written in place while another global (or an argument) is a view of it: the
    program would read the view as it was at the call. Refused at the first call, naming both;
    parameters side by side in one buffer do not overlap, and run."""

    def step(x):
        VIEWED.add_(1)
        return x + VIEW.sum()

    with pytest.raises(hpfun.SpecError, match=r"VIEWED and VIEW: share memory, and the function writes VIEWED"):
        hpfun.shard(step, mesh=MESH, in_specs=P("a"), out_specs=P("a"))(torch.zeros(4))
    flat = torch.zeros(8)
    first, second = flat[:4], flat[4:]  # one buffer, two tensors that do not overlap

    def update(x):
        first.add_(x)
        return second + 1

    out = hpfun.shard(update, mesh=MESH, in_specs=P("a"), out_specs=P("a"))(torch.ones(4))
    assert torch.equal(out.full(), torch.ones(4)) and torch.equal(flat, torch.tensor([1.0] * 4 + [0.0] * 4))


def test_narrow_integer_and_narrowing_dtype_partial_sums_are_summed_first():
    """A Partial sum of int8/int32 terms wraps around in its own type, so it is summed before a
    cast to float (or a float op promoting it); a Partial passes sum/cumsum with `dtype=` only
    into a type that holds its values exactly, and `copy_` only into its own dtype: each term
    truncated to an integer, or overflowing float16, is not the whole value cast once."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 127, (2, 64), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 127, (64, 2), generator=g, dtype=torch.int8)
    k_split = (P(None, "a"), P("a", None))
    x = torch.full((4, 2), 0.5)
    cases = [
        (lambda a, b: (a @ b).float(), (a, b), k_split),
        (lambda a, b: (a.int() @ b.int()) * 0.5, (a, b), k_split),
        (lambda x: x.sum(0).sum(dtype=torch.int64), (x,), (P("a"),)),
        (lambda x: x.sum(0).cumsum(0, dtype=torch.int64), (x,), (P("a"),)),
        (lambda x: torch.zeros(2, dtype=torch.int64).copy_(x.sum(0)), (x,), (P("a"),)),
        (lambda a, b: (a @ b).sum(dtype=torch.float16), (torch.tensor([[1e3, 1e3, -1e3, -1e3]]), torch.full((4, 1), 40.0)),
         k_split),  # each rank's term, 80000, overflows float16; the whole value is 0
    ]
    for fn, args, specs in cases:
        got = hpfun.shard(fn, mesh=MESH, in_specs=specs, out_specs=P())(*args).full()
        want = fn(*args)
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_variance_is_computed_in_float32_as_torch_does(dtype):
    """var and var_mean of float16/bfloat16 values (hpfun's own decomposition) compute in float32
    and round once, as torch's kernel does: float16 squares overflowed to inf, bfloat16 ones lost
    15x more; a 0-d value's variance is nan, not a ZeroDivisionError."""
    x = (torch.arange(16, dtype=torch.float32).reshape(2, 8) * 40 + 100).to(dtype)
    for spec in (P(), P(None, "a")):
        f = hpfun.shard(lambda x: torch.var_mean(x, 1), mesh=MESH, in_specs=spec, out_specs=P())
        for got, want in zip(f(x), torch.var_mean(x, 1), strict=True):
            assert got.full().dtype == dtype and torch.equal(got.full(), want)
    zero_d = hpfun.shard(lambda x: x.sum().var(0), mesh=MESH, in_specs=P("a"), out_specs=P())(torch.ones(4))
    assert zero_d.full().isnan()


SCALE = 2.0


class _Block(torch.nn.Module):
    scale = 1.0  # a class-level constant read as self.scale

    def __init__(self):
        super().__init__()
        self.act, self.ks, self.opts = torch.relu, [1.0], {"k": {"j": 1.0}}

    def forward(self, x):
        return self.act(x) * SCALE * self.scale * self.ks[0] * self.opts["k"]["j"]


class _Helper:
    def apply(self, x):
        return x * SCALE


@dataclasses.dataclass(slots=True)
class _Slots:
    alpha: float = 2.0


def test_what_modules_objects_and_their_classes_hold_keys_the_cache(tmp_path, monkeypatch):
    """Changed between calls, each of these compiles again (it was reused, stale): a global read
    by a closed-over module's forward or an object's method; a module's function attribute, a
    list or nested dict it holds edited in place, its class's constant; a hook added or removed;
    a method patched on the class; a slots dataclass's field; an attribute of the user's own
    config module. Every call equals eager."""
    global SCALE
    x = torch.linspace(-1, 1, 8)
    block, helper, cfg, apply = _Block(), _Helper(), _Slots(), _Helper.apply
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "hpfun_test_settings.py").write_text("LR = 0.1\n")
    import hpfun_test_settings as settings

    fns = [lambda x: block(x), lambda x: helper.apply(x), lambda x: x * cfg.alpha, lambda x: x * settings.LR]
    sharded = [hpfun.shard(fn, mesh=MESH, in_specs=P("a"), out_specs=P("a")) for fn in fns]

    def check():
        for fn, f in zip(fns, sharded, strict=True):
            torch.testing.assert_close(f(x).full(), fn(x), rtol=1e-6, atol=0)

    changes = [lambda: globals().__setitem__("SCALE", 3.0), lambda: setattr(block, "act", torch.tanh),
               lambda: block.ks.__setitem__(0, 2.0), lambda: block.opts["k"].__setitem__("j", 4.0),
               lambda: setattr(_Block, "scale", 5.0), lambda: setattr(cfg, "alpha", 7.0),
               lambda: setattr(settings, "LR", 0.5), lambda: setattr(_Helper, "apply", lambda self, x: x - SCALE)]
    try:
        check()
        for change in changes:
            change()
            check()
        handle = block.register_forward_hook(lambda m, i, o: o * 10)
        check()
        handle.remove()
        check()
    finally:
        SCALE, _Block.scale, _Helper.apply = 2.0, 1.0, apply
    assert sharded[0].trace_count == 7  # the first, a compile per change it sees; the hook removed: the first again


def test_reading_the_clock_while_traced_is_refused():
    """`time.time()` in the function would be the trace's reading, repeated at every call:
    refused at the user's line (the logging module's own readings are not the user's)."""
    import time

    f = hpfun.shard(lambda x: x * (time.time() % 7), mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    with pytest.raises(hpfun.CaptureError, match=r"time.time at .*test_silent.py:\d+.*reads the clock"):
        f(torch.ones(4))


def test_a_view_that_fails_raises_what_eager_raises():
    """`x.view(-1)` of a transposed tensor raises RuntimeError in eager, and code falls back on
    it (`except RuntimeError: x.reshape(-1)`); the trace raises the same type."""

    def flat(x):
        try:
            return x.view(-1) * 2
        except RuntimeError:
            return x.reshape(-1) * 2

    x = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(hpfun.shard(flat, mesh=MESH, in_specs=P(), out_specs=P())(x).full(), flat(x))


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_a_write_into_a_view_of_a_transposed_value_has_eagers_gradient(mesh_shape):
    """`v = x.t() * 1.0` keeps the transposed strides; writing a column of it makes autograd's
    backward address v's storage with as_strided, as traced. A rank's whole copy of that value
    (gathered when another input is split) is laid out contiguously: it is laid out as traced
    first, so the addresses pick the same elements (the gradient was off by 6.8)."""
    axes = ("x", "y")[:len(mesh_shape)]
    mesh = hpfun.Mesh.simulated(mesh_shape, axes)
    torch.manual_seed(0)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)

    def fwd(x, y):
        v = x.t() * 1.0
        v[:, :1].copy_(v[:, 1:2] * 3.0)
        return v * y

    def grad(x, y):
        return torch.func.grad(lambda x: fwd(x, y).sum())(x)

    for f in (fwd, grad):
        for spec in (P(), P(axes[0])) + ((P("y", "x"),) if len(axes) == 2 else ()):
            out = hpfun.shard(f, mesh=mesh, in_specs=(P(), spec), out_specs=P())(x, y).full()
            torch.testing.assert_close(out, f(x, y), rtol=0, atol=1e-12)


def test_squeeze_keeps_a_dim_split_down_to_one_element_per_rank():
    """squeeze drops the dims of size 1 it sees: a rank's block of a dim split to one element
    per rank has size 1 there, though the global dim does not. It is a reshape to the block's
    shape instead (a stock HF regression head, `logits.squeeze()` over a batch of 4 on 4 ranks,
    lost the batch dim in its backward; `(x.squeeze() * v).mean(0)` was off by 3x)."""
    mesh = hpfun.Mesh.simulated((4,), ("dp",))
    torch.manual_seed(0)
    x, v = torch.randn(4, 1, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    programs = {"squeeze()": lambda x: (x.squeeze() * v).mean(0).sum(),
                "squeeze(1)": lambda x: (x.squeeze(1) * v).mean(0).sum(),
                "squeeze((0, 1))": lambda x: (x[:, :, :1].squeeze((0, 1, 2)) * 2).sum(),
                "grad": lambda x: torch.func.grad(lambda x: ((x.squeeze() - 1) ** 2).mean())(x).sum()}
    for name, f in programs.items():
        out = hpfun.shard(f, mesh=mesh, in_specs=(P("dp"),), out_specs=P())(x).full()
        torch.testing.assert_close(out, f(x), rtol=0, atol=1e-12, msg=name)
    kept = hpfun.shard(lambda x: x.squeeze(), mesh=mesh, in_specs=(P("dp"),), out_specs=None)(x[:, :, :1])
    assert [tuple(s.shape) for s in kept.shards] == [(1,)] * 4 and torch.equal(kept.full(), x[:, 0, 0])


def test_an_integer_partial_sum_is_summed_before_an_average_pool():
    """An integer average pool rounds each rank's term: a Partial sum of int64 values is summed
    first (a float one passes through the pool, which is linear in it)."""
    x = torch.tensor([[[1, 0, 1, 1]], [[0, 1, 0, 1]]]).reshape(1, 2, 4)
    f = hpfun.shard(lambda x: F.avg_pool1d(x.sum(1, keepdim=True), 2), mesh=MESH, in_specs=P(None, "a"),
                    out_specs=P())
    assert torch.equal(f(x).full(), F.avg_pool1d(x.sum(1, keepdim=True), 2))


def test_an_integer_partial_average_is_refused():
    """Partial(avg) of integers has no integer mean to sum back to: refused when made."""
    with pytest.raises(hpfun.LayoutError, match="Partial\\(avg\\) placement of torch.int64"):
        hpfun.Sharded(hpfun.Layout(MESH, (hpfun.Partial("avg"),)), (4,), (torch.ones(4, dtype=torch.int64),) * 2)


def test_a_tensor_attribute_the_function_sets_to_a_number_is_set_by_every_call():
    """A module attribute holding a tensor that the forward sets to a Python number (HF's dynamic
    rotary embedding resets max_seq_len_cached to an int after a long batch) is set so after the
    call, as eager sets it; it was left holding the tensor, and the next calls read it."""
    class Resets(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))
            self.cached = torch.tensor(16)

        def forward(self, x):
            self.cached = 8
            return x * self.w

    model = Resets()
    f = hpfun.shard(lambda x: model(x), mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    f(torch.ones(4, 4))
    assert model.cached == 8 and type(model.cached) is int


def test_tensors_stored_deep_inside_an_object_are_named():
    """A tensor the function stores inside an object hpfun does not lift, below its attributes (a
    transformers cache's list of layers, each holding its keys), passed in or closed over: an
    error naming the object and the places. They held the trace's placeholders silently, and the
    next eager use of the object failed far from the cause."""
    class Slot:
        def __init__(self):
            self.keys = None

    class Holder:
        def __init__(self):
            self.layers = [Slot(), Slot()]

    def store(x, holder):
        holder.layers[1].keys = x * 2
        return x + 1

    f = hpfun.shard(store, mesh=MESH, in_specs=(P("a"), None), out_specs=P("a"))
    with pytest.raises(hpfun.CaptureError, match=r"args\[1\] \(a Holder\): .*\(\.layers\[1\]\.keys\)"):
        f(torch.ones(4), Holder())
    closed = Holder()
    g = hpfun.shard(lambda x: store(x, closed), mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    with pytest.raises(hpfun.CaptureError, match=r"closed"):
        g(torch.ones(4))


_NO_CLIP = float("nan")  # a sentinel a function reads


def test_a_nan_python_value_read_by_the_function_is_no_change():
    """A NaN global read by the function was refused as 'changed from nan to nan' (NaN is not
    equal to itself); it is the same value before and after the trace."""
    f = hpfun.shard(lambda x: x.sum() * (1.0 if math.isnan(_NO_CLIP) else _NO_CLIP), mesh=MESH, in_specs=P("a"),
                    out_specs=P())
    x = torch.randn(4, 3)
    assert torch.allclose(f(x).full(), x.sum())


def test_a_lifted_tensors_data_ptr_is_its_own_in_the_trace():
    """`p.data_ptr()` of lifted tensors reads as eager's: distinct per parameter, one for a tied
    pair (every stand-in had the same address: a dedup by address kept one parameter of four,
    silently, and momentum kept under `p.data_ptr()` was one buffer for all)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).double()
    model[1].weight = model[0].weight  # tied: one address

    def unique(x):
        found = {p.data_ptr(): p for _, p in model.named_parameters(remove_duplicate=False)}
        w = model[0].weight  # (a view's address is its base's plus its offset, as eager's)
        views = (w.data.data_ptr() == w.data_ptr()) + (w[1].data_ptr() - w.data_ptr() == 4 * 8) + \
            (w.t().data_ptr() == w.data_ptr())
        return model(x).sum() * len(found) * views

    x = torch.randn(4, 4, dtype=torch.float64)
    f = hpfun.shard(unique, mesh=MESH, in_specs=P("a"), out_specs=P())
    assert abs(f(x).full().item() - unique(x).item()) < 1e-12

    def momentum_step(m, bufs, x):
        loss = m(x).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                buf = bufs.setdefault(p.data_ptr(), torch.zeros_like(p)).mul_(0.9).add_(p.grad)
                p.sub_(0.1 * buf)
                p.grad = None
        return loss

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2).double()
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 2).double()
    bufs, ref_bufs = {}, {}
    g = hpfun.shard(lambda x: momentum_step(m, bufs, x), mesh=MESH, in_specs=P("a"), out_specs=P())
    for i in range(3):
        assert abs(g(x * (i + 1)).full().item() - momentum_step(ref, ref_bufs, x * (i + 1)).item()) < 1e-12
    assert (m.weight - ref.weight).abs().max().item() < 1e-12 and len(bufs) == 2


def test_a_method_of_a_users_object_a_module_holds_keys_the_cache_by_the_globals_it_reads(monkeypatch):
    """`m.fns = [obj.scaled]` (or a partial of it, or `m.fn = obj.scaled`) on a plain nn.Module:
    a global the method reads, changed between calls, is another program (the first ran)."""
    x = torch.ones(4, 2, dtype=torch.float64)
    for hold in (lambda m, f: setattr(m, "fns", [f]), lambda m, f: setattr(m, "fns", [functools.partial(f)]),
                 lambda m, f: setattr(m, "fn", f)):
        monkeypatch.setattr(sys.modules[__name__], "_METHOD_SCALE", 1.0)
        m = torch.nn.Module()
        hold(m, _CodeHolder().scaled)
        def fn(x, m=m):
            return m.fn(x) if hasattr(m, "fn") else m.fns[0](x)
        f = hpfun.shard(fn, mesh=MESH, in_specs=(P("a"),), out_specs=P())
        f(x)
        monkeypatch.setattr(sys.modules[__name__], "_METHOD_SCALE", 4.0)
        torch.testing.assert_close(f(x).full(), fn(x), rtol=0, atol=0)
        assert f.trace_count == 2


def test_getattr_of_one_object_keys_no_other_config_modules_settings():
    """Code that calls `getattr` on one object keys every setting only of what it gives getattr:
    a counter another config module holds, changed between calls, compiles nothing again."""
    module = sys.modules[__name__]
    counters = types.ModuleType("hpfun_test_counters")
    counters.LR, counters.STEPS = 2.0, 0
    module.hpfun_test_counters = counters
    holder = types.SimpleNamespace(s=3.0)

    def fn(x):
        return x * hpfun_test_counters.LR * getattr(holder, "s")  # noqa: F821

    try:
        f = hpfun.shard(fn, mesh=MESH, in_specs=(P("a"),), out_specs=P())
        x = torch.ones(4, 2, dtype=torch.float64)
        for steps in range(3):
            counters.STEPS = steps
            torch.testing.assert_close(f(x).full(), fn(x), rtol=0, atol=0)
        assert f.trace_count == 1
        counters.LR = 5.0
        torch.testing.assert_close(f(x).full(), fn(x), rtol=0, atol=0)
        assert f.trace_count == 2
    finally:
        del module.hpfun_test_counters


_INIT_SCALE = 1.0


class _MadeInside:
    def __init__(self):
        self.scale = _INIT_SCALE

    def __call__(self, x):
        return x * self.scale


class _MadeInsideChild(_MadeInside):  # (its base's constructor reads the global)
    pass


class _ModuleMadeInside(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = _INIT_SCALE + 1

    def forward(self, x):
        return x * self.scale


@dataclasses.dataclass
class _Defaults:
    scale: float = dataclasses.field(default_factory=lambda: _INIT_SCALE * 3)


def _retraced_when_the_global_changes(fns):
    """Each of `fns` sharded equals eager with `_INIT_SCALE` at 1.0, then at 5.0: two programs each."""
    global _INIT_SCALE
    x = torch.ones(4, 2, dtype=torch.float64)
    sharded = [hpfun.shard(fn, mesh=MESH, in_specs=(P("a"),), out_specs=P()) for fn in fns]
    try:
        for value in (1.0, 5.0):
            _INIT_SCALE = value
            for fn, f in zip(fns, sharded, strict=True):
                torch.testing.assert_close(f(x).full(), fn(x), rtol=0, atol=0)
    finally:
        _INIT_SCALE = 1.0
    assert [f.trace_count for f in sharded] == [2] * len(fns)


def test_a_global_a_constructor_reads_keys_the_program_of_a_step_that_makes_the_object():
    """`Smooth()(x)` inside the step, `Smooth.__init__` reading a global (directly, through a base
    class, an nn.Module's, a dataclass's default_factory): the global changed between calls is
    another program (the first ran, silently)."""
    fns = [lambda x: _MadeInside()(x), lambda x: _MadeInsideChild()(x), lambda x: _ModuleMadeInside()(x),
           lambda x: x * _Defaults().scale]
    _retraced_when_the_global_changes(fns)


class _Table:
    def __getitem__(self, i):
        return _INIT_SCALE * i

    def __rmul__(self, x):
        return x * _INIT_SCALE

    def __enter__(self):
        return _INIT_SCALE

    def __exit__(self, *exc):
        return False


def test_a_global_a_special_method_reads_keys_the_program():
    """`table[2]`, `x * table`, `with table as s` reading a global in `__getitem__`, `__rmul__`,
    `__enter__` (of an object closed over or made inside): another program when it changes (the
    first ran, silently: only `__call__` among a class's special methods was walked)."""
    table = _Table()

    def entered(x):
        with table as s:
            return x * s

    fns = [lambda x: x * table[2], lambda x: x * _Table()[2], lambda x: x * table, entered]
    _retraced_when_the_global_changes(fns)



_SQUASH = torch.distributions.transforms.AffineTransform(0.0, 2.0)


def test_the_values_of_a_library_object_the_function_reaches_key_the_program():
    """Numbers read from a distribution's transform held in a global, a closure or a module's
    list (an inverse one, one inside a composed one too) were baked into the first program:
    changed between calls, the next call ran it (an affine transform's scale of 3.0 ran as
    2.0). They key the program now, and the warning after several compiles names the attribute
    that changed. A logger the step reaches, whose values hpfun's own trace changes, does not."""
    import logging
    import warnings

    Affine, Power = torch.distributions.transforms.AffineTransform, torch.distributions.transforms.PowerTransform
    power = Power(2.0)
    model = torch.nn.Module()
    model.tr = [Affine(1.0, 1.0)]  # (a plain list: not a submodule)
    inverse = Affine(0.5, 1.0).inv
    composed = torch.distributions.transforms.ComposeTransform([torch.distributions.transforms.ComposeTransform(
        [Affine(0.0, 1.0)])])
    log = logging.getLogger("hpfun.tests.library_values")

    def f(x):
        log.debug("step")
        return _SQUASH(x) + model.tr[0](x) * power(x.abs()) + inverse(x) + composed(x)

    g = hpfun.shard(f, mesh=MESH, in_specs=P("a"), out_specs=P("a"))
    x = torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, v in enumerate([2.0, 3.0, 3.0, 4.0, 5.0, 6.0]):
            _SQUASH.scale, model.tr[0].loc, power.exponent, inverse._inv.scale = v, v, v / 2, v
            composed.parts[0].parts[0].scale = v
            torch.testing.assert_close(g(x).full(), f(x), rtol=1e-12, atol=1e-12)
    assert g.trace_count == 5  # (the third call: the same values)
    assert any("_SQUASH.scale changed (last" in str(w.message) for w in caught), [str(w.message) for w in caught]


_KEYWORD_FORMS = {  # name: (positional form, keyword form)
    "istft": (lambda x: torch.istft(torch.stft(x, 16, return_complex=True, window=torch.ones(16)), 16,
                                    window=torch.ones(16)),
              lambda x: torch.istft(input=torch.stft(x, 16, return_complex=True, window=torch.ones(16)), n_fft=16,
                                    window=torch.ones(16))),
    "index_fill_traced_value": (lambda x: x.long().index_fill(1, torch.tensor([0, 2]), x.double().mean() / 3),
                                lambda x: x.long().index_fill(1, index=torch.tensor([0, 2]), value=x.double().mean() / 3)),
    "where": (lambda x: torch.where(x > 0, x, -x), lambda x: torch.where(condition=x > 0, input=x, other=-x)),
    "bincount": (lambda x: torch.bincount(x.abs().long().flatten()), lambda x: torch.bincount(input=x.abs().long().flatten())),
    "cov": (lambda x: torch.cov(x.T), lambda x: torch.cov(input=x.T)),
    "equal": (lambda x: x * int(torch.equal(x, x.clone())), lambda x: x * int(torch.equal(input=x, other=x.clone()))),
    "polygamma": (lambda x: torch.polygamma(1, x.abs() + 1), lambda x: torch.polygamma(n=1, input=x.abs() + 1)),
    "addcmul_traced_value": (lambda x: x.addcmul(x, x, value=x.mean()),
                             lambda x: x.addcmul(tensor1=x, tensor2=x, value=x.mean())),
    "index_fill_dim": (lambda x: x.long().index_fill(1, torch.tensor([0, 2]), x.double().mean() / 3),
                       lambda x: x.long().index_fill(dim=1, index=torch.tensor([0, 2]), value=x.double().mean() / 3)),
}


@pytest.mark.parametrize("name", sorted(_KEYWORD_FORMS))
def test_an_op_called_with_its_tensors_by_keyword_is_checked_and_run_as_its_positional_form(name):
    """The mode that checks what eager's kernels check (an index's bounds, a value's range) and
    runs some ops as their math read their tensors by position: given by keyword (`torch.istft(
    input=...)`, as torchaudio calls it), they crashed (an IndexError, a data-dependent read) or
    went unchecked, silently (`index_add(1, index=...)` with index -1 counted from the end, where
    eager refuses it). They are moved into position first."""
    positional, keyword = _KEYWORD_FORMS[name]
    x = torch.randn(4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    want = positional(x)
    for fn in (positional, keyword):
        torch.testing.assert_close(hpfun.shard(fn, mesh=MESH, in_specs=(P("a"),), out_specs=None)(x).full(), want,
                                   rtol=1e-12, atol=1e-12)


def test_select_scatter_with_an_index_out_of_range_is_refused_as_eager_refuses_it():
    """Its decomposition wrote nowhere for index 6 of a dim of 6, and returned x unchanged."""
    x, y = torch.zeros(4, 6, dtype=torch.float64), torch.ones(4, 6, dtype=torch.float64)
    for fn in (lambda x, y: torch.select_scatter(x, y[:, 0], 1, 6), lambda x, y: x.select_scatter(y[:, 0], dim=1, index=-7)):
        with pytest.raises(IndexError, match="out of range"):
            fn(x, y)
        with pytest.raises(hpfun.CaptureError, match="IndexError.*out of range"):
            hpfun.shard(fn, mesh=MESH, in_specs=(P("a"), P("a")), out_specs=P("a"))(x, y)


def test_an_out_of_bounds_index_given_by_keyword_is_refused_as_eager_refuses_it():
    x = torch.randn(8, 4, dtype=torch.float64)
    for fn in (lambda x: torch.zeros(8, 4, dtype=torch.float64).index_add(1, index=torch.tensor([0, -1, 2, 3]), source=x),
               lambda x: torch.zeros(8, 4, dtype=torch.float64).index_copy(1, index=torch.tensor([0, -1, 2, 3]), source=x),
               lambda x: torch.index_add(input=torch.zeros(8, 4, dtype=torch.float64), dim=1,
                                         index=torch.tensor([0, -1, 2, 3]), source=x)):
        with pytest.raises(Exception, match="out of bounds"):
            fn(x)
        with pytest.raises(hpfun.ExecutionError, match="index out of bounds"):
            hpfun.shard(fn, mesh=MESH, in_specs=(P("a"),), out_specs=P("a"))(x)

def _empty_cut(v):
    w = v.flatten(0, 1)
    return torch.cat([w, w.narrow(1, 0, 0) * 2], 1)


def _empty_gather(x, y):
    return x.reshape(-1).gather(0, torch.argsort(y, 0))


def _written_empty(x, y):
    x.mul_(2)
    return x + y


def _bool_index_add(v):
    return v.index_add(1, torch.arange(4) // 2, v, alpha=3)


def _complex_nan_to_num(x):
    return torch.nan_to_num(torch.complex(x, x * 2), nan=1.0, posinf=2.0, neginf=-2.0)


def _resized_to_itself(x):
    t = x.clone()
    t.resize_as_(x)
    t.resize_(x.shape)
    return t + 1



def _set_then_written(x, state):
    """`set_` on lifted state twice, a write through it after (and one into its first source,
    which it shares memory with), and a temporary given another shape."""
    first = x * 2
    state["w"].set_(first)
    state["w"].add_(1)
    first.mul_(10)
    state["w"].set_(state["w"] * 3)
    t = torch.zeros(2, dtype=torch.float64)
    t.set_(x.sum(0))
    t.add_(state["w"].sum(0))
    return t + first.sum()



def _set_twice(x, state):
    b = x * 1
    a = torch.zeros_like(x)
    a.set_(b)
    a.set_(x * 2)  # (re-points a alone: b keeps its memory)
    state["w"].set_(state["v"])
    state["w"].set_(x * 3)  # (lifted: ends holding x * 3; v untouched)
    return a + b


def _set_source_reset(x, state):
    t = x * 1
    a = torch.zeros_like(x)
    a.set_(t)
    t.set_(x * 2)  # (a keeps t's old memory)
    state["w"].set_(state["t"])
    state["t"].set_(x * 5)
    return a * 10 + t


def _set_swap(x, state):
    tmp = state["front"].clone()
    state["front"].set_(state["back"])
    state["back"].set_(tmp)
    state["front"].add_(x)
    return state["front"] * 1


def _set_cursor(x, state):
    cursor = torch.zeros_like(x)
    for key in ("a", "b"):
        cursor.set_(state[key])
        cursor.mul_(2)
    return cursor + x


def _set_old_view(x, state):
    keep = state["w"].view(-1)
    state["w"].set_(x * 2)
    return keep  # (eager's: w's old memory, which the program writes w's new values into after it)


@pytest.mark.parametrize("fn", [_set_twice, _set_source_reset, _set_swap, _set_cursor, _set_old_view],
                         ids=lambda f: f.__name__)
def test_set_re_points_one_tensor_and_leaves_the_others_as_eager_does(fn):
    """A tensor set twice, a source set after it was taken, two buffers swapped by set_, one
    temporary pointed at each state tensor in turn, a view of state taken before its set_:
    each re-points the tensor it is called on alone (a first version merged the tensors, and
    answered each case otherwise than eager)."""
    def make():
        return {k: torch.arange(4, dtype=torch.float64) + i for i, k in enumerate(("w", "v", "t", "front", "back", "a", "b"))}

    state, ref = make(), make()
    f = hpfun.shard(lambda x: fn(x, state), mesh=MESH, in_specs=(P("a"),), out_specs=P("a"))
    for i in range(3):
        x = torch.arange(4, dtype=torch.float64) * (i + 1)
        torch.testing.assert_close(f(x).full(), fn(x, ref), rtol=0, atol=0)
        for k in state:
            assert torch.equal(state[k], ref[k]), (i, k, state[k], ref[k])

def test_set_points_a_tensor_at_another_and_the_program_does_what_eager_does():
    """`a.set_(b)` had no rule; it is now `b` from there on (later reads and writes of `a` are of
    `b`), and lifted state set so ends holding b's last values, as eager leaves it. An input
    given another shape is still refused at the user's line."""
    def make():
        return {"w": torch.arange(12, dtype=torch.float64).reshape(4, 3)}

    state, ref = make(), make()
    f = hpfun.shard(lambda x: _set_then_written(x, state), mesh=MESH, in_specs=(P("a"),), out_specs=P())
    for i in range(3):
        x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        want = _set_then_written(x, ref)
        torch.testing.assert_close(f(x).full(), want, rtol=1e-12, atol=1e-12)
        assert torch.equal(state["w"], ref["w"]), i

    def reshaped(x):
        state["w"].set_(x.sum(0))
        return x

    with pytest.raises(hpfun.CaptureError, match=r"aten.set.source_Tensor at .*test_silent.py:\d+ in reshaped: .*gives a tensor of shape \(4, 3\) "
                                                 r"a value of shape \(3,\) in place"):
        hpfun.shard(reshaped, mesh=MESH, in_specs=(P("a"),), out_specs=P("a"))(torch.randn(4, 3, dtype=torch.float64))


def _summed_scalar_view(a, b):
    return torch.einsum("i,i->", a, b).mean(-1) + a.sum().reshape(()).sum(0)



def _complex_var_mean(z):
    var, mean = torch.var_mean(z, 0)
    return var + mean.abs() + torch.std_mean(z, 1)[0].sum()

_EDGE_CASES = {  # name: (function, inputs, in_specs, mesh)
    "resize_to_its_shape": (_resized_to_itself, (torch.randn(4, 4),), (P("a"),), MESH),
    "empty_rows_cut": (_empty_cut, (torch.randn(5, 1, 0),), (P(),), MESH2),
    "empty_index_of_another_rank": (_empty_gather, (torch.zeros(0, 0), torch.zeros(0, 0)), (P("a", "b"), P("a", "b")), MESH2),
    "empty_arguments_written": (_written_empty, (torch.zeros(0, 4), torch.zeros(0, 4)), (P(), P()), MESH),
    "bool_index_add_alpha": (_bool_index_add, (torch.tensor([[True, False, False, False], [False, False, True, False]]),),
                             (P("a"),), MESH),
    "complex_nan_to_num": (_complex_nan_to_num, (torch.tensor([1.0, float("nan"), float("inf"), -float("inf")]),),
                           (P("a"),), MESH),
    "summed_0d_view": (_summed_scalar_view, (torch.arange(6.0), torch.arange(6.0) / 7), (P(), P()), MESH),
    "complex_var_mean": (_complex_var_mean, (torch.arange(8.0).reshape(4, 2) * (1 - 0.5j),), (P("a"),), MESH),
}


def test_the_conjugate_of_a_complex_partial_sum_is_reduced_as_its_values():
    """`a.sum(0).conj()` of a split `a` reached the simulated all-reduce as a lazy conjugate
    view, whose storage torch refused to read as pairs of floats (a raw RuntimeError)."""
    a = torch.arange(8.0, dtype=torch.float64).reshape(4, 2) * (1 + 2j)
    for fn in (lambda a: a.sum(0).conj(), lambda a: torch.conj(a.mean(0)) * 2):
        got = hpfun.shard(fn, mesh=MESH, in_specs=(P("a"),), out_specs=P())(a).full()
        assert torch.equal(got.resolve_conj(), fn(a).resolve_conj())


def test_a_triangular_solve_with_a_zero_pivot_gives_eagers_inf_for_a_partial_right_hand_side():
    """A row-split product solved against a triangular matrix with a zero on its diagonal: each
    rank's term solved to +inf or -inf, which summed to nan where eager's solution is inf."""
    x, w = torch.tensor([[3.0, -2.0], [1.0, 1.0]], dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64)
    A = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)

    def solve(x, w, A):
        return torch.linalg.solve_triangular(A, x @ w, upper=False)

    got = hpfun.shard(solve, mesh=MESH, in_specs=(P(None, "a"), P("a"), P()), out_specs=P())(x, w, A).full()
    want = solve(x, w, A)
    assert torch.equal(got.nan_to_num(7.0, 8.0, 9.0), want.nan_to_num(7.0, 8.0, 9.0)), (got, want)


def test_istft_checks_a_learnable_windows_envelope_at_every_call_and_keeps_its_gradient():
    """A window that is a parameter: its overlap-added envelope cannot be read at the trace, and
    a zero in it was divided by (nan, silently, where eager raises "window overlap add min").
    The program checks it at every call; the window's gradient is eager's."""
    x = torch.randn(4, 640, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    window = torch.nn.Parameter(torch.hann_window(64, dtype=torch.float64) + 0.1)

    def step(x):
        y = torch.istft(torch.stft(x, 64, 16, window=window, return_complex=True), 64, 16, window=window)
        loss = (y - x).square().sum() + y.sum()
        loss.backward()
        return loss

    f = hpfun.shard(step, mesh=MESH, in_specs=P("a"), out_specs=P())
    got = f(x).full()
    grad, window.grad = window.grad, None
    torch.testing.assert_close(got, step(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, window.grad, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        window.zero_()  # (the same program: the check fails at the call)
    with pytest.raises(hpfun.ExecutionError, match="window overlap add min"):
        f(x)


def test_istft_under_torch_func_grad_runs_as_eager():
    """Under torch.func.grad istft's input is grad's wrapper, not a fake tensor: torch's kernel
    ran, whose check of the window reads it (refused as a data-dependent read)."""
    window = torch.hann_window(16, dtype=torch.float64)

    def loss(x):
        z = torch.stft(x, 16, hop_length=4, window=window, return_complex=True)
        return torch.istft(z * 0.5, 16, hop_length=4, window=window, length=64).pow(2).sum()

    x = torch.randn(4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = hpfun.shard(torch.func.grad(loss), mesh=MESH, in_specs=(P("a"),), out_specs=P("a"))(x).full()
    torch.testing.assert_close(got, torch.func.grad(loss)(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(_EDGE_CASES))
def test_edge_cases_a_generator_found_equal_eager(name):
    """Valid programs that were refused or crashed: an empty tensor cut into rows (a division by
    zero while folding), gather of an empty index of another rank (an index out of range in its
    rule), two distinct empty arguments taken for one memory (both at address 0), index_add of
    bools with alpha (its decomposition made a long source), nan_to_num of a complex tensor
    (torch's decomposition refuses complex), a resize to the shape a tensor has (no rule), a sum
    over dim 0 of a 0-d view (a division by zero while folding), a complex var_mean (no rule)."""
    fn, inputs, specs, mesh = _EDGE_CASES[name]
    want = fn(*(t.clone() for t in inputs))
    got = hpfun.shard(fn, mesh=mesh, in_specs=specs, out_specs=None)(*(t.clone() for t in inputs)).full()
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (got, want)

