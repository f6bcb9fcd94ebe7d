"""In-place ops rewritten out of place on the captured graph (`hpfun.functionalize`), and the
re-trace through torch's functionalization wherever a write could be seen through a view.

Every result is compared with the same function run eagerly on copies of its arguments."""

import functools
import random

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import hpfun
import hpfun.capture
from hpfun import P
from hpfun.functionalize import functionalize

DP = hpfun.Mesh.simulated((2,), ("dp",))


@pytest.fixture
def traces(monkeypatch):
    """How many times each compile traced the function (1: rewritten in place; 2: re-traced)."""
    calls = []
    original = hpfun.capture._trace
    monkeypatch.setattr(hpfun.capture, "_trace", lambda fn, fakes: (calls.append(1), original(fn, fakes))[1])
    return calls


def _check(fn, *args, specs=None):
    """`fn` sharded and eager on copies: the same results, and bitwise the same writes into the
    arguments (elementwise: no reduction order to differ)."""
    specs = specs or tuple(P("dp") if a.ndim else P() for a in args)
    mine, theirs = [a.clone() for a in args], [a.clone() for a in args]
    out = hpfun.shard(fn, mesh=DP, in_specs=specs, out_specs=P())(*mine)
    want = fn(*theirs)
    got = out.full() if isinstance(out, hpfun.Sharded) else out
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # a sum over shards: another order
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def momentum_step(p, g, buf):
    """SGD with momentum as torch.optim writes it: every write in place, into the arguments."""
    buf.mul_(0.9).add_(g)
    p.add_(buf, alpha=-0.1)
    return (p * p).sum()


def traced(fn, *args):
    """`fn`'s graph as capture records it: a list of outputs."""
    return make_fx(lambda *a: [fn(*a)], tracing_mode="fake")(*args)


def test_writes_into_arguments_are_rewritten_without_a_second_trace(traces):
    p, g, buf = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    _check(momentum_step, p, g, buf)
    assert len(traces) == 1


def test_an_in_place_op_keeps_its_targets_dtype(traces):
    """`a.add_(b)` with a bfloat16 `a` and a float32 `b` stays bfloat16, as eager's does."""

    def f(a, b):
        a.add_(b)
        return a.float().sum()

    _check(f, torch.randn(8, 4).bfloat16(), torch.randn(8, 4))
    assert len(traces) == 1


def test_an_in_place_op_becomes_the_overload_of_its_arguments(traces):
    """`x.pow_(3)` is `pow_.Scalar(Tensor, Scalar)`: out of place that is `pow.Tensor_Scalar`, not
    the like-named `pow.Scalar(Scalar, Tensor)`; likewise `float_power_` and `ldexp_`.
    The gradient of a 3-norm writes `pow_` (it crashed capture); each becomes one rewrite."""

    def f(a, b):
        a.pow_(3).float_power_(1).ldexp_(torch.ones_like(a, dtype=torch.int64))
        b.pow_(b.abs())
        return a.sum() + b.sum()

    _check(f, torch.randn(8, 4, dtype=torch.float64), torch.rand(4, 4, dtype=torch.float64) + 0.5, specs=(P("dp"), P()))
    assert len(traces) == 1
    x = torch.randn(8, 4, dtype=torch.float64)
    grad_norm = hpfun.shard(lambda t: torch.func.grad(lambda u: torch.linalg.vector_norm(u, 3))(t), mesh=DP,
                            in_specs=(P("dp"),), out_specs=P("dp"))
    torch.testing.assert_close(grad_norm(x).full(), torch.func.grad(lambda u: torch.linalg.vector_norm(u, 3))(x))


def test_a_view_read_after_its_base_is_written_sees_the_write(traces):
    """A view made before the write and read after it: read again from the new value, in the
    same walk (it took a second trace, through torch's functionalization)."""

    def f(x):
        flat = x.view(-1)
        x.mul_(2)
        return flat.sum()

    _check(f, torch.randn(8, 4, dtype=torch.float64))
    assert len(traces) == 1


def test_a_write_into_a_view_reaches_its_base(traces):
    """Scattered back into the base, in the same walk (it took a second trace)."""
    def f(x):
        x[:, 0].mul_(3)
        return x.sum()

    _check(f, torch.randn(8, 4, dtype=torch.float64))
    assert len(traces) == 1


def test_a_view_made_after_the_write_reads_the_new_value(traces):
    def f(x, y):
        x.add_(y)
        return x.view(-1).sum() + x.t().sum()

    _check(f, torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64))
    assert len(traces) == 1


def test_the_graph_has_no_in_place_op_left_and_names_what_was_written():
    gm = traced(momentum_step, *(torch.randn(8, 4) for _ in range(3)))
    assert any(n.op == "call_function" and n.target._schema.is_mutable for n in gm.graph.nodes)
    written = functionalize(gm)
    assert written == [0, 2]  # p and buf; g is only read
    mutable = [n for n in gm.graph.nodes if n.op == "call_function" and n.target._schema.is_mutable]
    assert not mutable
    gm.recompile()
    args = [torch.randn(8, 4) for _ in range(3)]
    copies = [a.clone() for a in args]
    originals = [a.clone() for a in args]
    loss, new_p, new_buf = gm(*args)
    want = momentum_step(*copies)
    assert torch.equal(loss, want) and torch.equal(new_p, copies[0]) and torch.equal(new_buf, copies[2])
    assert all(torch.equal(a, b) for a, b in zip(args, originals, strict=True))  # the program writes nothing


def test_declines_and_leaves_the_graph_alone_when_a_write_cannot_be_scattered_back():
    """A write into a split's piece: torch's functionalization, by a second trace, does it."""
    def f(x):
        v = x.view(-1)
        x.add_(1)
        x.split(2)[0].mul_(3)
        return v * 2

    gm = traced(f, torch.randn(4, 2))
    before = [(n.op, n.target, n.args) for n in gm.graph.nodes]
    assert functionalize(gm) is None
    assert [(n.op, n.target, n.args) for n in gm.graph.nodes] == before


def test_a_write_through_unfold_windows_tiling_the_dim_reaches_its_base():
    """`y.unfold(0, 2, 2)[1] = v` with windows that tile the dim: written back exactly."""
    def tiled(x):
        y = x.clone()
        y.unfold(0, 2, 2)[1] = 0.5
        x.unfold(1, 3, 3)[:, 0].mul_(2)
        return y
    _check(tiled, torch.randn(8, 6, dtype=torch.float64), specs=(P(),))


@pytest.mark.parametrize("size, step", [(2, 3), (2, 2), (4, 2)], ids=["gaps", "a tail left out", "overlapping"])
def test_a_write_through_unfold_windows_not_tiling_the_dim_is_refused_at_its_line(size, step):
    """torch's functionalization writes an unfold view back with unfold_backward: elements no
    window reaches became zeros (silently wrong), overlapping windows failed with a message about
    torch.compile. Refused, naming the line and the fix."""
    def windows(x):
        y = x.clone()
        y.unfold(0, size, step)[0] = 0.5
        return y
    f = hpfun.shard(windows, mesh=DP, in_specs=(P(),), out_specs=P())
    with pytest.raises(hpfun.CaptureError, match=r"y.unfold\(0, size, step\)\[0\] = 0.5(.|\n)*unfolded windows"):
        f(torch.arange(9.0 if step == 2 and size == 2 else 8.0, dtype=torch.float64))


def test_a_write_through_one_unfold_window_of_the_whole_dim():
    """One window of the whole dim tiles it: with a step past its size it is written back (it
    was refused as leaving elements out); with a step smaller than its size torch refuses it, and
    the message says so and gives the step that makes the same window (it said "overlap")."""
    def one(x, step):
        y = x.clone()
        y.unfold(1, 4, step).mul_(2.0)
        return y
    x = torch.randn(4, 4, dtype=torch.float64)
    for spec in (P(), P("dp")):
        f = hpfun.shard(functools.partial(one, step=7), mesh=DP, in_specs=(spec,), out_specs=spec)
        torch.testing.assert_close(f(x).full(), one(x, 7), rtol=0, atol=0)
    f = hpfun.shard(functools.partial(one, step=2), mesh=DP, in_specs=(P(),), out_specs=P())
    with pytest.raises(hpfun.CaptureError, match=r"one window of all 4 elements with a step of 2(.|\n)*"
                                                 r"give unfold a step of 4"):
        f(x)


WRITES = {  # a write into the memory a view shares, after the view
    "through the view": lambda z, flat, row: flat.mul_(3),
    "through a split's piece": lambda z, flat, row: z.split(2, 0)[0].add_(9),
    "through a chunk's piece": lambda z, flat, row: z.t().chunk(2)[1].add_(9),
    "through a view taken before the in-place op": lambda z, flat, row: row.mul_(5),
}


def _scattered_then_viewed(x, y, write=None, out=False):
    """`scatter_` into a clone of a transposed `x` keeps the clone's strides, so `.t().view(-1)` of
    the result is a view; functionalized, `scatter` returns a contiguous tensor, and it is not. The
    write into `y` through a view makes the graph go through torch's functionalization."""
    c = x.clone()
    row = c[0]
    index = torch.tensor([[2, 1, 3, 0]] * 4)
    z = torch.scatter(x, 1, index, x * 2, out=c) if out else c.scatter_(1, index, x * 2)
    flat = z.t().view(-1)
    if write is not None:
        write(z, flat, row)
    y.t().split(1)[0].add_(1)  # (a write the walk leaves to a second trace)
    return flat * 1, z


@pytest.mark.parametrize("out", [False, True], ids=["scatter_", "out="])
def test_a_view_that_the_functional_program_lays_out_otherwise_is_a_reshape_there(traces, out):
    """Nothing writes through the view: a copy reads the same, and the results are the eager ones."""
    _check(lambda x, y: _scattered_then_viewed(x, y, out=out)[0],
           torch.randn(4, 4, dtype=torch.float64).t(), torch.zeros(4, 4, dtype=torch.float64), specs=(P(), P()))
    assert len(traces) == 2


@pytest.mark.parametrize("out", [False, True], ids=["scatter_", "out="])
@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_through_a_view_that_the_functional_program_lays_out_otherwise_is_refused_at_its_line(write, out):
    """A write into the viewed memory, through the view or through another view of its base (a
    split's piece reached by getitem too, one taken before the in-place op, or the out= op,
    that wrote the base), after the view: refused, never a copy that misses it."""
    f = hpfun.shard(lambda x, y: _scattered_then_viewed(x, y, WRITES[write], out), mesh=DP, in_specs=(P(), P()),
                    out_specs=P())
    with pytest.raises(hpfun.CaptureError, match=r"(?s)flat = z.t\(\).view\(-1\).*write the in-place op before "
                                                 r"it out of place"):
        f(torch.randn(4, 4, dtype=torch.float64).t(), torch.zeros(4, 4, dtype=torch.float64))


IN_PLACE_ON_SLICES = {  # autograd's backward of each writes the gradient's view at the slice with as_strided
    "narrow": lambda y: y.narrow(2, 1, 2).mul_(3.0),
    "select": lambda y: y[:, 2].add_(1.0),
    "a transposed slice": lambda y: y.transpose(1, 2)[:, 1:3, 0:2].mul_(2.0),
    "a slice of a slice": lambda y: y[1:, :, 2:][:, 0].mul_(5.0),
    "permuted": lambda y: y.permute(2, 0, 1)[1:4].mul_(0.5),
}


@pytest.mark.parametrize("spec", [P(), P("dp"), P(None, "dp"), P(None, None, "dp")], ids=str)
@pytest.mark.parametrize("name", sorted(IN_PLACE_ON_SLICES))
def test_the_gradient_of_a_write_into_a_slice_keeps_the_batch_split(name, spec):
    """The backward of an in-place op on a slice reads and writes the gradient through
    as_strided / as_strided_scatter, which address storage and were taken whole: under data
    parallelism the gradient was gathered. They are written as the slices, selects and
    permutation they pick: equal to eager, and a batch split over a dim the slice keeps whole
    moves nothing."""
    def loss(x):
        y = x.clone()
        IN_PLACE_ON_SLICES[name](y)
        return y.sin().sum()

    x = torch.randn(4, 6, 6, dtype=torch.float64)
    f = hpfun.shard(torch.func.grad(loss), mesh=DP, in_specs=(spec,), out_specs=spec)
    torch.testing.assert_close(f(x).full(), torch.func.grad(loss)(x))
    text = str(f.lower(x))
    assert "as_strided" not in text, text
    if spec == P("dp") and name != "a slice of a slice":  # (that one slices the batch dim itself)
        assert not f.lower(x).collectives


def _views_and_writes(seed: int, steps: int = 10):
    """A random program of views of a (6, 4, 5) tensor (of views too), in-place writes through
    them and reads of them (made before or after the writes), each step kept only where eager
    runs it. Returns the function (of x, written in place, and a (6, 4, 5) source) and its text."""
    rng = random.Random(seed)
    program = []  # (kind, index of the tensor it takes, text, function); tensors[0] is x or its clone

    def make_view(t):
        d = rng.randrange(t.ndim) if t.ndim else None
        choices = []
        if t.ndim:
            size = t.shape[d]
            start, step = rng.randrange(max(size, 1)), rng.choice([1, 1, 2])
            choices.append((f"[{d}: {start}::{step}]", lambda u, d=d, s=start, k=step: u[(slice(None),) * d + (slice(s, None, k),)]))
            if size:
                i = rng.randrange(-size, size)
                choices.append((f".select({d}, {i})", lambda u, d=d, i=i: u.select(d, i)))
        if t.ndim >= 2:
            a, b = rng.sample(range(t.ndim), 2)
            choices.append((f".transpose({a}, {b})", lambda u, a=a, b=b: u.transpose(a, b)))
            choices.append((f".diagonal(0, {a}, {b})", lambda u, a=a, b=b: u.diagonal(0, a, b)))
            dims = list(range(t.ndim))
            rng.shuffle(dims)
            choices.append((f".permute({dims})", lambda u, dims=tuple(dims): u.permute(dims)))
        choices.append((".unsqueeze(0)", lambda u: u.unsqueeze(0)))
        if t.is_contiguous():
            choices.append((".view(-1)", lambda u: u.view(-1)))
        if 1 in t.shape:
            choices.append((".squeeze()", lambda u: u.squeeze()))
        return rng.choice(choices)

    def make_write():
        c = rng.choice([0.5, -2.0, 3.0])
        return rng.choice([
            (f".add_({c})", lambda u, s: u.add_(c)),
            (f".mul_({c})", lambda u, s: u.mul_(c)),
            (".copy_(source)", lambda u, s: u.copy_(s.flatten()[:u.numel()].reshape(u.shape))),
            (f".fill_({c})", lambda u, s: u.fill_(c)),
            (".clamp_(min=0)", lambda u, s: u.clamp_(min=0)),
            (f"[u > 0] = {c}", lambda u, s: u.masked_fill_(u > 0, c)),
        ])

    sample = [torch.randn(6, 4, 5, dtype=torch.float64), torch.randn(6, 4, 5, dtype=torch.float64)]
    clone_first = rng.random() < 0.5
    tensors = [sample[0].clone() if clone_first else sample[0]]
    for _ in range(steps):
        kind = rng.choice(["view", "view", "write", "write", "read"])
        k = rng.randrange(len(tensors))
        try:
            if kind == "view":
                text, fn = make_view(tensors[k])
                tensors.append(fn(tensors[k]))
            elif kind == "write":
                text, fn = make_write()
                fn(tensors[k], sample[1])
            else:
                text, fn = ".sum()", None
        except RuntimeError:
            continue
        program.append((kind, k, text, fn))

    def f(x, source):
        ts = [x.clone() if clone_first else x]
        out = x.new_zeros(())
        for kind, k, _, fn in program:
            if kind == "view":
                ts.append(fn(ts[k]))
            elif kind == "write":
                fn(ts[k], source)
            else:
                out = out + ts[k].sum() * (k + 1)
        return out + sum(t.sum() * (i + 2) for i, t in enumerate(ts))  # (every view read at the end too)

    return f, f"clone={clone_first}; " + "; ".join(f"{kind} t{k}{text}" for kind, k, text, _ in program)


@pytest.mark.parametrize("seed", range(40))
def test_random_writes_and_reads_through_views_equal_eager_in_one_walk(traces, seed):
    """Writes through chains of slices, selects, transposes, diagonals, permutes, unsqueezes
    and flat views, and reads of views made before them: equal to eager (bitwise for what is
    written into the argument), in one trace."""
    f, text = _views_and_writes(seed)
    x, source = (torch.randn(6, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + k))
                 for k in range(2))
    for spec in (P(), P("dp")):
        traces.clear()
        try:
            _check(f, x, source, specs=(spec, P()))
        except AssertionError as err:
            raise AssertionError(f"{text} (x {spec})") from err
        assert len(traces) == 1, text


def _delta_rule_rows(k, beta):
    """The row-by-row solve of the chunked gated delta rule (Qwen3-Next's, Kimi Linear's, OLMo's
    linear attention in transformers): each row written into a slice of `attn` in a loop."""
    attn = -(k @ k.transpose(-1, -2) * beta.unsqueeze(-1)).tril(-1)
    for i in range(1, attn.shape[-1]):
        row = attn[..., i, :i].clone()
        sub = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    return attn + torch.eye(attn.shape[-1], dtype=attn.dtype)


def test_a_row_by_row_solve_into_slices_and_its_gradient_equal_eager_in_one_trace(traces):
    """Writes into slices in a loop, under torch.func.grad: one trace (the second, through
    torch's functionalization, had doubled this model family's first call)."""
    def loss(k, beta):
        return (_delta_rule_rows(k, beta) ** 2).sum()

    k = torch.randn(4, 2, 6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    beta = torch.rand(4, 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    f = hpfun.shard(torch.func.grad(loss, argnums=(0, 1)), mesh=DP, in_specs=(P("dp"), P("dp")),
                    out_specs=(P("dp"), P("dp")))
    for got, want in zip(f(k, beta), torch.func.grad(loss, argnums=(0, 1))(k, beta), strict=True):
        torch.testing.assert_close(got.full(), want, rtol=1e-12, atol=1e-12)
    assert len(traces) == 1


@pytest.mark.parametrize("seed", [s for s in range(80) if "clone=True" in _views_and_writes(s)[1]][:24])
def test_random_writes_and_reads_through_views_of_a_clone_differentiate_as_eager(traces, seed):
    """The same programs where they write into a clone of the argument, under torch.func.grad
    (whose views of the clone are as_strided): the gradients equal eager's, in one trace."""
    f, text = _views_and_writes(seed)
    x, source = (torch.randn(6, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + k))
                 for k in range(2))
    grad = torch.func.grad(f, argnums=(0, 1))
    want = grad(x, source)
    for spec in (P(), P("dp")):
        traces.clear()
        got = hpfun.shard(grad, mesh=DP, in_specs=(spec, P()), out_specs=(spec, P()))(x, source)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.full(), w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{m}\n{text} (x {spec})")
        assert len(traces) == 1, text


def test_a_stepped_slice_written_from_a_split_source_into_a_dim_the_mesh_does_not_divide():
    """`x[1::2].add_(y)` with x of 5 elements (whole) and y split: slice_scatter's rule kept only
    the layouts whose blocks the step tiles, and dropped the whole one too, so it offered none (a
    message for rule authors). The whole layout is kept: y is gathered, as eager's result."""
    def f(x, y):
        x[1::2].add_(y)
        return x * 2

    x, y = torch.randn(5, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    _check(f, x, y, specs=(P(), P("dp")))
    g = hpfun.shard(lambda x, y: torch.slice_scatter(x, y, 0, 1, None, 2), mesh=DP, in_specs=(P(), P("dp")),
                    out_specs=None)
    torch.testing.assert_close(g(x, y).full(), torch.slice_scatter(x, y, 0, 1, None, 2), rtol=0, atol=0)


@pytest.mark.parametrize("write", ["scatter_", "index_put_", "sub_", "mul_"])
def test_a_write_through_a_transpose_leaves_its_base_laid_out_as_eagers(traces, write):
    """`y.t().scatter_(...)` then `y.view(-1)`: scattered back through the transpose, y's new value
    was laid out transposed, and the view of it failed (it failed in the second trace too, before
    the walk wrote into views). The base is made contiguous again, as eager's y stays."""
    def f(x):
        y = x.clone()
        if write == "scatter_":
            y.t().scatter_(0, torch.zeros(1, 6, dtype=torch.long), 5.0)
        elif write == "index_put_":
            y.t().index_put_((torch.tensor([1]),), torch.tensor(5.0, dtype=torch.float64))
        elif write == "sub_":
            y.t().sub_(x.t().sin())
        else:
            y.t().mul_(2)
        return y.view(-1)[:5].sum() + y.sum()

    _check(f, torch.randn(6, 4, dtype=torch.float64))
    assert len(traces) == 1


@pytest.mark.parametrize("of", ["a clone", "the argument"])
def test_a_write_through_a_permute_of_an_unflattened_view_reaches_its_base(traces, of):
    """`y.unflatten(0, (2, 3)).permute(3, 0, 2, 1).scatter_(...)`: scattered back through the
    permute, the value was laid out permuted, and the view back to y's shape failed ("Cannot view
    a tensor with shape [2, 3, 4, 5]"; in the second trace too). The inverse of a view is a
    reshape in the elements' logical order: a copy where the value is not contiguous."""
    def f(x):
        y = x if of == "the argument" else x.clone()
        y.unflatten(0, (2, 3)).permute(3, 0, 2, 1).scatter_(0, torch.zeros(1, 2, 4, 3, dtype=torch.long), 2.0)
        return y * 1

    _check(f, torch.randn(6, 4, 5, dtype=torch.float64), specs=(P(),))
    assert len(traces) == 1
