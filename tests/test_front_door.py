"""The front door, tried as a new user would: keyword arguments, non-tensor and NumPy values,
spec mistakes with their paths and fixes, and rule tables that fail to load."""

import collections.abc
import dataclasses
import functools
import math
import textwrap
import types

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

import hpfun
from hpfun import P
from hpfun.rules.pointwise import Pointwise
from hpfun.rules.registry import REGISTRY, Registry

MESH = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
aten = torch.ops.aten


def _params():
    return {"w1": torch.randn(4, 4), "w2": torch.randn(4, 4)}


def _step(params, x, y):
    return {k: p * 2 for k, p in params.items()}, (x * y).sum()


STEP_SPECS = dict(in_specs=({"w1": P(None, "tp"), "w2": P()}, P("dp"), P("dp")),
                  out_specs=({"w1": P(None, "tp"), "w2": P()}, P()))


def _error(f, *args, error=hpfun.HpfunError, **kwargs) -> tuple[hpfun.HpfunError, str]:
    with pytest.raises(error) as info:
        f(*args, **kwargs)
    return info.value, str(info.value)


# -- arguments --------------------------------------------------------------------------------


def test_keyword_arguments_take_the_positional_specs():
    """f(params, x=x, y=y) and f(params=..., y=y, x=x) run the program f(params, x, y) compiled."""
    f = hpfun.shard(_step, mesh=MESH, **STEP_SPECS)
    params, x, y = _params(), torch.randn(8, 4), torch.randn(8, 4)
    expected = f(params, x, y)[1].full()
    for out in (f(params, x=x, y=y), f(params=params, y=y, x=x)):
        torch.testing.assert_close(out[1].full(), expected)
        assert out[0]["w1"].layout == P(None, "tp").to_layout(MESH, 2)
    assert f.trace_count == 1
    report = str(f.lower(params, y=y, x=x))
    assert "global [8, 4] [S(0), R], local [4, 4] float32  (args[1])" in report and "(args[2])" in report


def test_keyword_only_parameters_are_replicated_unless_sharded():
    """A tensor given to a keyword-only parameter (or **kwargs) is replicated; a Sharded one keeps its layout."""

    def scaled(x, *, mask, **extra):
        return x * mask + extra["bias"]

    f = hpfun.shard(scaled, mesh=MESH, in_specs=(P("dp"),))
    x, mask, bias = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4)
    torch.testing.assert_close(f(x, mask=mask, bias=bias).full(), x * mask + bias)
    report = str(f.lower(x, mask=mask, bias=bias))
    assert "global [8, 4] [R, R], local [8, 4] float32  (kwargs['mask'])" in report
    assert "global [4] [R, R], local [4] float32  (kwargs['bias'])" in report
    split = hpfun.Sharded.from_global(mask, P("dp").to_layout(MESH, 2))
    assert "global [8, 4] [S(0), R], local [4, 4] float32  (kwargs['mask'])" in str(f.lower(x, mask=split, bias=bias))


def test_defaults_fill_the_positions_in_specs_cover_and_bad_calls_name_the_signature():
    """A left-out parameter with a default takes its spec's place; a call the signature refuses says so."""

    def masked(x, mask=None):
        return x if mask is None else x * mask

    f = hpfun.shard(masked, mesh=MESH, in_specs=(P("dp"), P("dp")))
    x = torch.randn(8, 4)
    torch.testing.assert_close(f(x).full(), x)
    torch.testing.assert_close(f(mask=x, x=x).full(), x * x)
    _, text = _error(f, error=hpfun.SpecError)
    assert "masked(x, mask=None)" in text and "missing a required argument: 'x'" in text
    _, text = _error(f, x, typo=x, error=hpfun.SpecError)
    assert "unexpected keyword argument 'typo'" in text
    _, text = _error(f, xx=x, error=hpfun.SpecError)  # (a misspelled keyword: said so, not the argument it missed)
    assert "unexpected keyword argument 'xx' (did you mean 'x'?)" in text, text


def test_in_specs_of_the_wrong_length_say_so():
    """in_specs with more entries than the call's positional arguments is named as such."""
    f = hpfun.shard(lambda a: a, mesh=MESH, in_specs=(P("dp"), P("dp")))
    _, text = _error(f, torch.randn(8), error=hpfun.SpecError)
    assert "in_specs: has 2 entries, one per positional argument, but the call passes 1" in text


def test_non_tensor_outputs_come_back_as_they_are():
    """Ints, floats, strings and None, at the top or inside tuples and dicts, are returned untouched."""

    def f(x):
        return x * 2, 3, 1.5, "hi", None, {"a": (x.sum(), 7, None), "s": "str"}

    x = torch.randn(8, 4)
    for out_specs in (None, (P("dp"), None, None, None, None, {"a": (P(), None, None), "s": None})):
        out = hpfun.shard(f, mesh=MESH, in_specs=P("dp"), out_specs=out_specs)(x)
        assert out[1:5] == (3, 1.5, "hi", None)
        assert out[5]["a"][1:] == (7, None) and out[5]["s"] == "str"
        torch.testing.assert_close(out[5]["a"][0].full(), x.sum())


def test_dataclasses_and_mappings_in_and_out_are_containers():
    """A dataclass batch (`Batch(x, y)`) and a mapping that is not a dict (transformers'
    BatchEncoding, what its tokenizers and collators return) are seen into, given a prefix spec
    or one of their own shape, and handed to the function as themselves; a dataclass of results
    comes back as one, holding Sharded values."""
    import collections

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor

    @dataclasses.dataclass
    class Out:
        total: torch.Tensor
        n: int

    class Encoding(collections.UserDict):  # what BatchEncoding is
        def __getattr__(self, name):
            return self.data[name]

    def step(batch):
        assert isinstance(batch, (Batch, Encoding))
        return Out((batch.x * batch.y).sum(), 1)

    x, y = torch.randn(8, 4), torch.randn(8, 4)
    for batch, spec in [(Batch(x, y), P("dp")), (Batch(x, y), Batch(P("dp"), P())), (Encoding(x=x, y=y), P("dp")),
                        (Encoding(x=x, y=y), {"x": P("dp"), "y": P("dp")}), (Batch(x, y), {"y": P("dp"), "x": P()})]:
        f = hpfun.shard(step, mesh=MESH, in_specs=(spec,), out_specs=Out(P(), None))
        out = f(batch)
        assert isinstance(out, Out) and out.n == 1
        torch.testing.assert_close(out.total.full(), (x * y).sum())
        if isinstance(spec, dict) and isinstance(batch, Batch):  # a dataclass's specs by field name
            assert "[S(0), R], local [4, 4] float32  (args[0].y)" in str(f.lower(batch))
    @dataclasses.dataclass
    class Outer:  # a dataclass in a dataclass, a list of tensors in it: each level seen into
        inner: Batch
        extra: list
        name: str = "x"

    nested = Outer(Batch(x, y), [x[:, :2]])

    def total(o):
        return o.inner.x.sum() + o.extra[0].sum() * 2

    for spec in ({"inner": {"x": P("dp"), "y": P()}, "extra": P(), "name": None}, Outer(Batch(P("dp"), P()), P(), None),
                 Outer(Batch(P("dp"), P()), P())):  # (a field left at its default specifies nothing: it was refused)
        torch.testing.assert_close(hpfun.shard(total, mesh=MESH, in_specs=(spec,), out_specs=P())(nested).full(),
                                   total(nested))
    err, text = _error(hpfun.shard(step, mesh=MESH, in_specs=([P("dp"), P()],)), Batch(x, y))
    assert "a dict of specs by its field names" in text and "the same Batch holding specs" in text


@dataclasses.dataclass
class _Run:
    buf: torch.Tensor
    shape: tuple = (2, 3)
    tags: list = dataclasses.field(default_factory=lambda: ["a"])
    eps: float = math.nan


@dataclasses.dataclass
class _LongRun(_Run):
    more: int = 7


def test_a_dataclass_of_specs_may_leave_fields_holding_no_tensor_at_their_defaults():
    """`_Run(P("dp"))` for a `_Run` argument: fields left at a default, a default factory's value
    or NaN specify nothing (each was refused as a bad spec: 'got int 2', 'write P('a')')."""
    run = _Run(torch.randn(8, 3))
    f = hpfun.shard(lambda r: r.buf * 2, mesh=MESH, in_specs=(_Run(P("dp")),), out_specs=P("dp"))
    torch.testing.assert_close(f(run).full(), run.buf * 2)
    err, text = _error(hpfun.shard(lambda r: r.buf * 2, mesh=MESH, in_specs=(_Run(P("dp"), (4, 4)),)), run)
    assert "args[0]['shape']" in text, text
    sub = _LongRun(torch.randn(8, 3))  # a spec of its base class: the subclass's own fields specify nothing
    torch.testing.assert_close(f(sub).full(), sub.buf * 2)


class _KeywordMap(collections.abc.MutableMapping):
    """A mapping of the user's, made from keywords, keeping its items in an attribute."""

    def __init__(self, **items):
        self._items = dict(items)

    def __getitem__(self, k):
        return self._items[k]

    def __setitem__(self, k, v):
        self._items[k] = v

    def __delitem__(self, k):
        del self._items[k]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def test_a_mapping_of_the_users_made_from_keywords_is_handed_over_as_itself():
    """A collections.abc mapping whose constructor takes keywords reaches the function as one of
    its type, and what the function puts in it reaches the caller's (it failed: the rebuilt one
    had no storage, 'object has no attribute _items')."""

    def step(x, m):
        assert type(m) is _KeywordMap
        m["total"] = (x * m["w"]).sum()
        return x * m["w"]

    x, m = torch.randn(8, 3), _KeywordMap(w=torch.arange(3.0))
    out = hpfun.shard(step, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))(x, m)
    torch.testing.assert_close(out.full(), x * torch.arange(3.0))
    total = m["total"]
    torch.testing.assert_close(total.full() if isinstance(total, hpfun.Sharded) else total, (x * torch.arange(3.0)).sum())


class _Batches(collections.UserList):
    """A list of the user's."""


def test_a_user_list_argument_is_a_list_handed_over_as_itself():
    """A UserList of tensors is seen into as a list, given one spec or one per item, and reaches
    the function as itself (it was refused as a value that is not hashable)."""

    def f(x, batches):
        assert type(batches) is _Batches
        return x * batches[0] + batches[1].sum()

    x, batches = torch.randn(8, 3), _Batches([torch.ones(3), torch.arange(8.0)])
    for spec in (P(), [P(), P("dp")]):
        g = hpfun.shard(f, mesh=MESH, in_specs=(P("dp"), spec), out_specs=P("dp"))
        torch.testing.assert_close(g(x, batches).full(), f(x, batches))


class _TaggedBatches(collections.UserList):
    """A list of the user's holding attributes of its own."""

    def __init__(self, items, scale=1.0):
        super().__init__(items)
        self.scale, self.handle = scale, object()  # (an object by identity: handed over, keying nothing)


class _TaggedDict(collections.UserDict):
    def __init__(self, data=None, tag="t"):
        super().__init__(data or {})
        self.tag = tag


def test_a_user_list_or_dicts_own_attributes_reach_the_function_and_what_it_appends_reaches_the_caller():
    """A UserList or UserDict subclass reaches the function with the attributes the caller's
    holds (the UserDict was rebuilt with its constructor's defaults, silently; the UserList
    without them: AttributeError), their values keying the program; and what the function
    appends to a UserList is put in the caller's, as in a list (it was left out, silently)."""
    x = torch.randn(8, 3, dtype=torch.float64)
    f = hpfun.shard(lambda b: b[0] * b.scale, mesh=MESH, in_specs=([P("dp")],), out_specs=P("dp"))
    for scale in (2.0, 2.0, 3.0):
        torch.testing.assert_close(f(_TaggedBatches([x], scale)).full(), x * scale)
    assert f.trace_count == 2  # (the new `handle` of every batch keys nothing)

    g = hpfun.shard(lambda d: d["a"] * (2 if d.tag == "t" else 3), mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    for tag, mult in (("u", 3), ("t", 2), ("u", 3)):
        torch.testing.assert_close(g(_TaggedDict({"a": x}, tag=tag)).full(), x * mult)
    assert g.trace_count == 2

    def grow(b):
        b.append(b[0] * 3)
        return b[0].sum()

    batches = _Batches([x])
    hpfun.shard(grow, mesh=MESH, in_specs=P("dp"), out_specs=P())(batches)
    assert len(batches) == 2
    torch.testing.assert_close(batches[1].full(), x * 3)

    def mark(d):  # attributes set on it reach the caller's, as a dataclass argument's do; a tensor does not
        d.extra, d.tag = d["a"] * 2, d.tag + "!"  # (it would be handed to the next call as a constant): warned
        return d["a"].sum()

    tagged = _TaggedDict({"a": x}, tag="u")
    with pytest.warns(hpfun.TracingWarning, match=r"puts a tensor in args\[0\].extra, an attribute of a _TaggedDict"):
        hpfun.shard(mark, mesh=MESH, in_specs=P("dp"), out_specs=P())(tagged)
    assert tagged.tag == "u!" and not hasattr(tagged, "extra")

    # a list of configs, a called object and a NumPy array among its attributes, changed in place
    # between calls, key the program by their values (each ran the first program, silently)
    h = hpfun.shard(lambda d: d["a"] * d.cfgs[0].s * d.act(1.0) * float(d.arr[0]), mesh=MESH, in_specs=P("dp"),
                    out_specs=P("dp"))
    tagged = _TaggedDict({"a": x})
    tagged.cfgs, tagged.act, tagged.arr = [_Power(2.0)], _Times(3.0), np.array([5.0])
    for change in (lambda: None, lambda: setattr(tagged.cfgs[0], "s", 7.0), lambda: setattr(tagged.act, "s", 11.0),
                   lambda: tagged.arr.__setitem__(0, 13.0)):
        change()
        want = x * tagged.cfgs[0].s * tagged.act.s * float(tagged.arr[0])
        torch.testing.assert_close(h(tagged).full(), want, rtol=0, atol=0)
    assert h.trace_count == 4

    scaled = _TaggedDict({"a": x})  # a tensor among its attributes is no input: named, with the fix (it was "a
    scaled.scale = torch.tensor(2.0, dtype=torch.float64)  # tensor that is neither an argument nor state")
    with pytest.raises(hpfun.CaptureError, match=r"args\[0\]\.scale: is a tensor attribute of a UserDict or "
                                                 r"UserList argument(.|\n)*batch\['scale'\] = t"):
        hpfun.shard(lambda d: d["a"] * d.scale, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))(scaled)
    listed = _TaggedBatches([x], 1.0)  # (a UserList's: appended, not put under a key)
    listed.scale = torch.tensor(2.0, dtype=torch.float64)
    with pytest.raises(hpfun.CaptureError, match=r"args\[0\]\.scale: (.|\n)*batch\.append\(t\)"):
        hpfun.shard(lambda b: b[0] * b.scale, mesh=MESH, in_specs=([P("dp")],), out_specs=P("dp"))(listed)


class _Power:
    def __init__(self, s):
        self.s = s


class _Times(_Power):
    def __call__(self, v):
        return v * self.s


def test_tensors_hidden_in_an_output_object_are_an_error_not_fake_tensors():
    """An object holding tensors that is not a container hpfun can see into would hand back the
    trace's stand-ins: an error naming its path."""

    class Layers:  # tensors a few levels down, as a transformers cache holds them
        def __init__(self, x):
            self.layers = [{"keys": x}]

    g = hpfun.shard(lambda x: (x, Layers(x)), mesh=MESH, in_specs=P("dp"))
    _, text = _error(g, torch.randn(8), error=hpfun.CaptureError)
    assert "outputs[1]: is a value of type Layers holding tensors (layers[0]['keys'])" in text


def test_numpy_arguments_are_tensors():
    """A NumPy array is read as a tensor (the fast cache keys it like one); one torch cannot hold is named."""
    f = hpfun.shard(lambda x, s: x * s, mesh=MESH, in_specs=(P("dp"), None))
    a = np.arange(8.0, dtype=np.float32).reshape(8, 1)
    for _ in range(2):
        torch.testing.assert_close(f(a, np.float32(2.0)).full(), torch.from_numpy(a) * 2)
    assert f.trace_count == 1
    err, text = _error(f, np.array(["a", "b"]), 2.0, error=hpfun.SpecError)
    assert "args[0]: is a NumPy array of dtype <U1" in text and not isinstance(err, TypeError)


def test_unhashable_python_arguments_are_named_not_unhashable_type():
    """A set or bytearray argument (baked into the program) is a SpecError naming its path, at every call."""
    f = hpfun.shard(lambda x, s: x * len(s), mesh=MESH, in_specs=(P("dp"), None))
    for _ in range(2):
        _, text = _error(f, torch.randn(8), {"a": {1, 2}}, error=hpfun.SpecError)
        assert "args[1]['a']: is {1, 2}, which is not hashable" in text and "frozenset" in text


_FACTOR = 1.0


def test_python_values_key_the_cache_by_type_and_sign_not_by_equality():
    """1.0, 1 and True are equal in Python but not to torch (an int64 tensor times each is
    float32, int64, int64), nor 0.0 and -0.0 (`1 / (x * -0.0)`): each is its own program, as an
    argument, inside a list argument and as a global the function reads (each ran the program
    of the first, silently); a NaN is itself (one program)."""
    global _FACTOR
    x = torch.arange(8).reshape(4, 2)
    nan = float("nan")
    def times(x, n):
        return x * n, 1 / (x * n)

    arg = hpfun.shard(times, mesh=MESH, in_specs=(P("dp"), None), out_specs=P("dp"))
    listed = hpfun.shard(lambda x, c: times(x, c[0]), mesh=MESH, in_specs=(P("dp"), None), out_specs=P("dp"))
    glob = hpfun.shard(lambda x: times(x, _FACTOR), mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    values = (1.0, 1, True, -0.0, 0.0, nan, float("nan"))
    for n in values:
        _FACTOR = n
        for outs in (arg(x, n), listed(x, [n]), glob(x)):
            for got, want in zip(outs, times(x, n), strict=True):
                got = got.full()
                assert got.dtype == want.dtype and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), (n, got, want)
    assert arg.trace_count == listed.trace_count == glob.trace_count == len(values) - 1
    config = hpfun.shard(lambda x, c: times(x, c.alpha), mesh=MESH, in_specs=(P("dp"), None), out_specs=P("dp"))
    read = hpfun.shard(lambda x, t: times(x, t.item()), mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))
    for n in (0.0, -0.0, np.float32(0.0), np.float32(-0.0), np.float64(-0.0), 1, 1.0):
        # (a config object's values, NumPy's floats, a value read from an argument with .item())
        for outs in (config(x, types.SimpleNamespace(alpha=n)), read(x, torch.tensor(float(n), dtype=torch.float64))):
            want = times(x, n)
            for got, w in zip(outs, want, strict=True):
                got = got.full()
                assert torch.equal(got.nan_to_num(7.0), w.to(got.dtype).nan_to_num(7.0)), (n, got, w)
    held = torch.nn.Module()  # (a module's number, and a dict argument's key: they ran the first program)
    held.n = 1
    module = hpfun.shard(lambda x: times(x, held.n), mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    keyed = hpfun.shard(lambda x, d: times(x, next(iter(d))), mesh=MESH, in_specs=(P("dp"), None), out_specs=P("dp"))
    for n in (1, 1.0, True, 0.0, -0.0):
        held.n = n
        for outs in (module(x), keyed(x, {n: "n"})):
            for got, want in zip(outs, times(x, n), strict=True):
                got = got.full()
                assert got.dtype == want.dtype and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), (n, got, want)
    assert module.trace_count == keyed.trace_count == 5


def test_a_print_inside_runs_once_at_the_trace(capsys):
    """What the README says: a print shows a fake tensor, once, at the trace, and a
    TracingWarning at the user's line says so."""

    def f(x):
        print("x is", x)
        return x

    g = hpfun.shard(f, mesh=MESH, in_specs=P("dp"))
    with pytest.warns(hpfun.TracingWarning, match=r'`print\("x is", x\)` prints a tensor while hpfun traces'):
        g(torch.randn(8))
    g(torch.randn(8))
    printed = capsys.readouterr().out
    assert printed.count("x is") == 1 and "FakeTensor" in printed


def test_a_count_formatted_into_a_message_under_torch_func_grad_is_printed_as_outside_it():
    """`f"tokens: {n}"` of a 0-d count made from the arguments (transformers' vision-language
    models build such a message before checking it) under torch.func.grad: formatted as outside
    it, a fake tensor printed (it was refused as a read of parameters' values)."""
    def loss(w, x, ids):
        message = f"tokens: {(ids == 3).sum()}"
        return (x @ w).pow(2).mean() + 0 * len(message)

    def step(w, x, ids):
        return torch.func.grad(loss)(w, x, ids)

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 3, dtype=torch.float64, generator=g), torch.randn(8, 4, dtype=torch.float64, generator=g)
    ids = torch.randint(0, 5, (8, 3), generator=g)
    f = hpfun.shard(step, mesh=MESH, in_specs=(P(), P("dp"), P("dp")), out_specs=P())
    with pytest.warns(hpfun.TracingWarning):
        torch.testing.assert_close(f(w, x, ids).full(), step(w, x, ids), rtol=1e-12, atol=1e-12)


# -- spec mistakes ----------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "what", "fix"), [
    ("dp", "the string 'dp', not a P", "write P('dp')"),
    (("dp", None), "the tuple ('dp', None), not a P", "write P('dp', None)"),
    (["dp", ("dp", "tp")], "the list", "write P('dp', ('dp', 'tp'))"),
    (DShard(0), "DTensor's placement", "write P('dp') or P('tp') to split dim 0 over one mesh axis, P(('dp', 'tp')) "
     "over all 2"),
    (DReplicate(), "DTensor's placement", "write P() (replicated over every mesh axis)"),
    ((DShard(1), DReplicate()), "DTensor's placement", "write P(None, 'dp')"),
    ((DReplicate(), DShard(0)), "DTensor's placement", "write P('tp')"),
    ((hpfun.Shard(0), hpfun.Shard(0)), "hpfun's placement", "write P(('dp', 'tp'))"),
    (hpfun.Shard(1), "hpfun's placement", "write P(None, 'dp') or P(None, 'tp')"),
    ((hpfun.Partial(), hpfun.Replicate()), "hpfun's placement", "a P cannot ask for a pending sum"),
    (0, "must be an hpfun.P or None, got int 0", "write P(...) with one entry per tensor dim"),
    ("[S(1), R] on {dp: 2, tp: 2}", "hpfun's layout notation", "write P(None, 'dp')"),  # (what a layout prints)
    ("[S(0), S(0)]", "hpfun's layout notation", "write P(('dp', 'tp'))"),
    ("[S(0)[1], S(0)[0]] on {dp: 2, tp: 2}", "hpfun's layout notation", "write P(('tp', 'dp'))"),  # (P(('tp', 'dp'))
    ("[S(0)[1], S(0)[0]]", "hpfun's layout notation", "write P(('tp', 'dp'))"),  # prints so; without its mesh)
    ("P(sum)", "hpfun's layout notation", "a P cannot ask for a pending sum"),
], ids=repr)
def test_a_spec_that_is_not_a_P_names_the_path_and_the_spelling(spec, what, fix):
    """Strings, bare tuples of axis names, DTensor's and hpfun's placements: the path and the P meant."""
    f = hpfun.shard(_step, mesh=MESH, in_specs=(None, spec, P("dp")))
    err, text = _error(f, _params(), torch.randn(8, 4), torch.randn(8, 4), error=hpfun.SpecError)
    assert len(err.problems) == 1 and err.problems[0].where == "args[1]"
    assert what in err.problems[0].what and fix in err.problems[0].fix, text


def test_out_spec_mistakes_name_the_output_path():
    """out_specs problems are named by the output's path in its tree, not a flat index, without FakeTensor."""
    f = hpfun.shard(_step, mesh=MESH, in_specs=STEP_SPECS["in_specs"],
                    out_specs=({"w1": P("zz"), "w2": P(None, None, "tp")}, P()))
    err, text = _error(f, _params(), torch.randn(8, 4), torch.randn(8, 4), error=hpfun.SpecError)
    assert [p.where for p in err.problems] == ["outputs[0]['w1']", "outputs[0]['w2']"]
    f = hpfun.shard(_step, mesh=MESH, in_specs=STEP_SPECS["in_specs"], out_specs=(P(),))
    _, text = _error(f, _params(), torch.randn(8, 4), torch.randn(8, 4), error=hpfun.SpecError)
    assert "outputs: spec (P(),) does not fit a tuple of length 2" in text
    assert "FakeTensor" not in text and "dims=" not in text


def test_all_problems_of_one_call_are_reported_together():
    """in_specs, out_specs and pattern problems of one call come in one report, each with its path."""
    f = hpfun.shard(_step, mesh=MESH, in_specs=({"w9": P(), "w1": "tp"}, DShard(0), P("xx")),
                    out_specs=({"w1": (DShard(1), DReplicate()), "w2": "dp"}, P()))
    err, text = _error(f, _params(), torch.randn(8, 4), torch.randn(8, 4), error=hpfun.SpecError)
    assert [p.where for p in err.problems] == [
        "args[0]['w9']", "args[0]['w1']", "args[1]", "args[2]", "outputs[0]['w1']", "outputs[0]['w2']"]
    assert "matches no name; closest: w1, w2" in text and "write P(None, 'dp')" in text


def test_name_patterns_that_miss_or_overlap():
    """A pattern matching nothing names itself and the closest names; a name two patterns match
    takes the more specific one's spec, and two as specific as each other that differ are an error."""
    params = {"layers": [{"q_proj": torch.randn(4, 4), "k_proj": torch.randn(4, 4)}]}
    f = hpfun.shard(lambda p: p, mesh=MESH, in_specs=({"layers.*.q_prj": P("tp")},))
    _, text = _error(f, params, error=hpfun.SpecError)
    assert "args[0]['layers.*.q_prj']: matches no name; closest: layers.0.q_proj" in text
    f = hpfun.shard(lambda p: p, mesh=MESH, in_specs=({"q_*": P("tp"), "*oj": P()},))
    _, text = _error(f, params, error=hpfun.SpecError)
    assert "'layers.0.q_proj' is matched by two patterns as specific as each other, 'q_*' and '*oj'" in text
    f = hpfun.shard(lambda p: p, mesh=MESH, in_specs=({"*_proj": P("tp"), "q_proj": P()},))  # the more specific decides
    out = f(params)["layers"][0]
    assert out["q_proj"].layout == P().to_layout(MESH, 2) and out["k_proj"].layout == P("tp").to_layout(MESH, 2)
    f = hpfun.shard(lambda p: p, mesh=MESH, in_specs=({"q_proj": P("tp")},))
    assert f(params)["layers"][0]["q_proj"].layout == P("tp").to_layout(MESH, 2)


# -- rule tables that fail to load --------------------------------------------------------------

_BAD = "aten.special_airy_ai.default: {family: pointwis}\n"
_GOOD = "aten.special_airy_ai.default: {family: pointwise}\n"


def test_a_bad_table_on_the_rules_path_raises_at_every_use_until_fixed(tmp_path, monkeypatch):
    """A table in HPFUN_RULES_PATH that fails raises at each lookup, not only the first; fixed, it loads."""
    table = tmp_path / "extra.yaml"
    table.write_text(_BAD)
    monkeypatch.setenv("HPFUN_RULES_PATH", str(tmp_path))
    registry = Registry()
    for _ in range(3):
        with pytest.raises(hpfun.RuleFileError, match="extra.yaml:1.*unknown family 'pointwis'"):
            registry.lookup(aten.mm.default)
    table.write_text(_GOOD)
    assert isinstance(registry.lookup(aten.special_airy_ai.default), Pointwise)
    assert registry.lookup(aten.mm.default) is not None
    assert registry.load(table) == 0  # a file already loaded is not loaded again


@pytest.fixture
def restored_registry():
    """The global registry as it was, after a test that loads tables into it (the built-in
    tables loaded first: saved before they were, it came back empty, and so did every later
    test's rules in that worker)."""
    REGISTRY._ensure_builtins()
    saved = dict(REGISTRY._entries), list(REGISTRY._pending or []), set(REGISTRY._loaded)
    yield REGISTRY
    REGISTRY._entries, REGISTRY._pending, REGISTRY._loaded = saved[0], saved[1], saved[2]


def test_loading_a_bad_table_fails_every_sharded_call_until_fixed(tmp_path, restored_registry):
    """hpfun.rules.load of a bad file raises, and so does every call that needs rules, until the file is fixed."""
    table = tmp_path / "mine.yaml"
    table.write_text(textwrap.dedent(_BAD))
    with pytest.raises(hpfun.RuleFileError, match="mine.yaml:1"):
        hpfun.rules.load(table)
    x = torch.randn(8)
    for _ in range(2):
        f = hpfun.shard(torch.special.airy_ai, mesh=MESH, in_specs=P("dp"))
        with pytest.raises(hpfun.RuleFileError, match="mine.yaml:1"):
            f(x)
    table.write_text(_GOOD)
    out = hpfun.shard(torch.special.airy_ai, mesh=MESH, in_specs=P("dp"))(x)
    torch.testing.assert_close(out.full(), torch.special.airy_ai(x))
    with pytest.raises(hpfun.RuleFileError, match="does not exist"):
        hpfun.rules.load(tmp_path / "missing.yaml")
    assert hpfun.rules.lookup(aten.mm.default) is not None  # a path that does not exist is not kept


def test_torch_compile_around_a_sharded_function_runs_it_as_it_is():
    """`torch.compile(step)` of a sharded function: dynamo leaves hpfun's call alone (capture,
    seed draw), so the first call, a new shape and the seed all behave as without the wrapper."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    f = hpfun.shard(lambda x: torch.sin(x) * 2 + torch.rand_like(x), mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
    g = torch.compile(f)
    for shape in ((4, 3), (8, 3)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        torch.manual_seed(11)
        compiled = g(x).full()
        torch.manual_seed(11)
        assert torch.equal(compiled, f(x).full())


@functools.lru_cache(maxsize=4)
def _decay_mask(n: int) -> torch.Tensor:
    """A memoized constant tensor, as yet-another-retnet builds its decay mask."""
    return torch.tril(torch.ones(n, n)) * 0.9


def test_a_tensor_a_memoized_helper_makes_is_a_constant_of_the_program():
    """A functools.lru_cache helper returning a tensor: traced first, the cache keeps no
    placeholder of the trace (a later eager call failed inside torch); called eagerly first, the
    cached real tensor is made again inside the trace (it was refused as a tensor hpfun cannot
    lift, at a library's line)."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 3, 4)

    def f(x):
        return (_decay_mask(x.shape[1]) @ lin(x)).sum()

    for eager_first in (False, True):
        _decay_mask.cache_clear()
        if eager_first:
            want = f(x)
        g = hpfun.shard(f, mesh=MESH, in_specs=P("dp"), out_specs=P())
        got = g(x).full()
        want = f(x)  # (eagerly, after the trace: from the cache)
        torch.testing.assert_close(got, want)
        assert type(_decay_mask(3)) is torch.Tensor


class _Vocabulary:
    """Memoizes a lookup table built from a dict, as transformers' Emu3 image vocabulary does."""

    def __init__(self, ids: dict):
        self.ids = ids

    @functools.cached_property
    def table(self) -> torch.Tensor:
        t = torch.zeros(max(self.ids) + 1, dtype=torch.long)
        for k, v in self.ids.items():
            t[k] = v
        return t


def test_a_cached_property_a_held_object_computes_while_tracing_is_a_constant_of_the_program():
    """A `functools.cached_property` an object held by a module computes first inside the trace:
    the program computes it as a constant, and the object keeps the value eager computes (no
    placeholder: that was refused as a tensor stored where hpfun cannot write it back)."""
    model = torch.nn.Linear(4, 4, dtype=torch.float64)
    model.vocab = _Vocabulary({0: 0, 1: 3, 2: 5, 3: 1})

    def f(x, ids):
        return (model(x) * model.vocab.table[ids].unsqueeze(-1)).sum()

    x, ids = torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    g = hpfun.shard(f, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P())
    got = g(x, ids).full()
    assert type(vars(model.vocab)["table"]) is torch.Tensor
    assert vars(model.vocab)["table"].tolist() == [0, 3, 5, 1]
    torch.testing.assert_close(got, f(x, ids), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g(x, ids).full(), f(x, ids), rtol=1e-12, atol=1e-12)  # (read as the object's)


class _Table(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = 2

    @functools.cached_property
    def table(self) -> torch.Tensor:  # (from constants and a Python number of the module)
        return torch.arange(4.0, dtype=torch.float64) * self.heads


def test_a_cached_property_tensor_made_from_constants_keeps_its_first_value_as_eager_does():
    """Eager computes it once and keeps it; after `heads` changes, eager still reads the first
    table. The trace computed it anew and kept nothing, so the program retraced with the new
    number (silently other results from the second call on)."""
    model, ref = _Table(), _Table()
    f = hpfun.shard(lambda x: x + model.table, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    x = torch.zeros(4, 4, dtype=torch.float64)
    for heads in (2, 4):
        model.heads = ref.heads = heads
        torch.testing.assert_close(f(x).full(), x + ref.table, rtol=0, atol=0)
    assert vars(model)["table"].tolist() == [0.0, 2.0, 4.0, 6.0]


class _Frozen(torch.nn.Linear):
    @functools.cached_property
    def frozen(self) -> torch.Tensor:
        return self.weight.detach() * 2


def test_a_cached_property_computed_from_state_inside_the_trace_is_refused_with_the_fix():
    """One computed from a parameter: eager keeps the first call's value, a program would compute
    it at every call (silently other numbers from the second step on); refused, and read once
    before the call it is a tensor the module holds, state like any other."""
    model = _Frozen(4, 4, dtype=torch.float64)
    f = hpfun.shard(lambda x: (model(x) * (x @ model.frozen.T)).sum(), mesh=MESH, in_specs=P("dp"), out_specs=P())
    x = torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(hpfun.CaptureError, match=r"(?s)_Frozen.frozen at .*cached_property first computed inside.*"
                                                 r"read it once before the first call"):
        f(x)
    assert "frozen" not in vars(model)
    want = (model(x) * (x @ model.frozen.T)).sum()
    torch.testing.assert_close(f(x).full(), want, rtol=1e-12, atol=1e-12)


class _Drawn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = 2

    @functools.cached_property
    def projection(self) -> torch.Tensor:  # (random features, drawn once)
        return torch.randn(4, 8, dtype=torch.float64)

    @functools.cached_property
    def scale(self) -> float:
        return 1.0 / self.heads


def test_a_cached_property_drawn_inside_the_trace_is_refused_and_a_number_is_kept_as_eager_keeps_it():
    """One drawn inside the trace: eager draws once and keeps it, a program would draw anew at
    every call (two calls on one input differed): refused. One holding no tensor is kept on the
    object as eager keeps it (it was computed anew, so a later change of `heads` reached the
    program while eager kept the first value)."""
    model, ref = _Drawn(), _Drawn()
    f = hpfun.shard(lambda x: torch.cos(x @ model.projection), mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    with pytest.raises(hpfun.CaptureError, match=r"(?s)_Drawn.projection at .*from its inputs, state or a random draw"):
        f(torch.randn(4, 4, dtype=torch.float64))
    g = hpfun.shard(lambda x: x * model.scale, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    x = torch.ones(4, 2, dtype=torch.float64)
    for heads in (2, 8):
        model.heads = ref.heads = heads
        torch.testing.assert_close(g(x).full(), x * ref.scale, rtol=0, atol=0)
    assert vars(model)["scale"] == 0.5
