"""Indexing by a traced 0-d integer tensor: `alphas_cumprod[t]` for `t` in a scheduler's
timesteps (every diffusers sampling loop), `cache[:, pos] = k` with a position tensor. torch
reads such an index as the integer it holds, in C++, where no trace can; hpfun indexes by it
as a one-element index tensor instead and drops the size-1 dim, which is what the integer
index gives, for any value at every call (nothing read, nothing retraced). Compared with the
unsharded run in float64, on split and replicated layouts, forward and gradient."""

import warnings

import numpy as np
import pytest
import torch

import hpfun
from hpfun import P

D = torch.float64
MESH = hpfun.Mesh.simulated((2,), ("dp",))


def _gen():
    return torch.Generator().manual_seed(0)


GETS = {
    "t[i]": lambda x, i: x[i],
    "t[-i]": lambda x, i: x[-i - 1],
    "t[:, i]": lambda x, i: x[:, i],
    "t[..., i]": lambda x, i: x[..., i],
    "t[i, 1:3]": lambda x, i: x[i, 1:3],
    "t[None, i]": lambda x, i: x[None, i],
    "t[i, :, i]": lambda x, i: x[i, :, i],
    "t[1, i]": lambda x, i: x[1, i],
}


@pytest.mark.parametrize("spec", [P(), P("dp"), P(None, "dp"), P(None, None, "dp")], ids=str)
@pytest.mark.parametrize("name", sorted(GETS))
def test_reading_by_a_0d_index_tensor(name, spec):
    x = torch.randn(4, 6, 4, dtype=D, generator=_gen())
    f = GETS[name]
    g = hpfun.shard(f, mesh=MESH, in_specs=(spec, P()), out_specs=P())
    for i in (0, 3, 2):  # one program for every value
        torch.testing.assert_close(g(x, torch.tensor(i)).full(), f(x, torch.tensor(i)), rtol=0, atol=0)
    assert g.trace_count == 1


def test_a_scheduler_table_indexed_by_its_timesteps():
    """diffusers' DDIM step, reduced: a table held by a module, indexed by each timestep of a
    buffer, scaling the sample; the same at every step of the loop."""
    class Scheduler(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("alphas", torch.linspace(0.9, 0.1, 10, dtype=D))
            self.register_buffer("timesteps", torch.tensor([9, 6, 3, 0]))

    sched = Scheduler()

    def sample(x):
        for t in sched.timesteps:
            x = x * sched.alphas[t].sqrt() + (1 - sched.alphas[t]) * 0.1
        return x

    x = torch.randn(8, 3, dtype=D, generator=_gen())
    f = hpfun.shard(sample, mesh=MESH, in_specs=(P("dp"),), out_specs=P("dp"))
    torch.testing.assert_close(f(x).full(), sample(x), rtol=1e-14, atol=1e-14)
    sched.timesteps = torch.tensor([8, 5, 2, 1])  # other values: the same program
    torch.testing.assert_close(f(x).full(), sample(x), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_writing_a_cache_at_a_0d_position_tensor(spec):
    """`cache[:, pos] = k` and `cache[pos] = v` with a 0-d position tensor (a decoding loop's
    KV cache), a value broadcast into the written row; then the gradient through a read."""
    def write(cache, k, pos):
        cache = cache.clone()
        cache[:, pos] = k
        cache[pos] = 0.5 * cache[pos]
        cache[pos, pos] = 1.0
        return cache

    cache = torch.randn(4, 6, 3, dtype=D, generator=_gen())
    k = torch.randn(4, 3, dtype=D, generator=_gen())
    f = hpfun.shard(write, mesh=MESH, in_specs=(spec, spec, P()), out_specs=P())
    for pos in (0, 3):
        torch.testing.assert_close(f(cache, k, torch.tensor(pos)).full(), write(cache, k, torch.tensor(pos)))

    def loss(table, i):
        return (table[i] * table[:, i].sum()).sum()

    table = torch.randn(4, 4, dtype=D, generator=_gen())
    grad = hpfun.shard(torch.func.grad(loss), mesh=MESH, in_specs=(spec, P()), out_specs=P())
    torch.testing.assert_close(grad(table, torch.tensor(2)).full(), torch.func.grad(loss)(table, torch.tensor(2)))


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
@pytest.mark.parametrize("i", [4, -5])
def test_an_index_out_of_range_raises_as_eager_raises(spec, i):
    """Out of range, eager raises IndexError; a split dim's index, wrapped into the rank's block,
    would have picked a row silently. Reading and writing, a 0-d index or an index tensor."""
    x = torch.randn(4, 3, dtype=D, generator=_gen())

    def write(x, i):
        x = x.clone()
        x[i] += 1
        return x

    for fn, index in ((lambda x, i: x[i], torch.tensor(i)), (lambda x, i: x[i], torch.tensor([0, i])), (write, torch.tensor(i))):
        with pytest.raises(IndexError):
            fn(x, index)
        f = hpfun.shard(fn, mesh=MESH, in_specs=(spec, P()), out_specs=P())
        with pytest.raises(hpfun.ExecutionError, match="out of range|out of bounds") as info:
            f(x, index)
        assert "test_scalar_tensor_index.py" in str(info.value), str(info.value)


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_0d_masks_and_small_integer_indices_index_as_eager(spec):
    """`x[b]` with `b` a 0-d bool (or uint8, torch's old mask dtype) adds a dim of one row or
    none; a 0-d int8/int16 index is the integer it holds; masked_select of 0-d tensors is 1-D."""
    x = torch.randn(4, 6, dtype=D, generator=_gen())
    cases = [(lambda x, b: x[b] * 1, torch.tensor(True)), (lambda x, b: x[b] * 1, torch.tensor(False)),
             (lambda x, b: x[b] * 1, torch.tensor(1, dtype=torch.uint8)),
             (lambda x, t: x[t] * 1, torch.tensor(2, dtype=torch.int8)),
             (lambda x, t: x[t] * 1, torch.tensor(-1, dtype=torch.int16)),
             (lambda x, b: torch.masked_select(x.sum(), b), torch.tensor(True))]
    for fn, index in cases:
        want = fn(x, index)
        got = hpfun.shard(fn, mesh=MESH, in_specs=(spec, P()), out_specs=P())(x, index).full()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


LOOKUPS = {  # (function of a (4, 6) table and an index tensor, the index, the table's split dim)
    "gather": (lambda x, i: x.gather(0, i.expand(1, 6)), torch.tensor([[4]]), 0),
    "gather, negative": (lambda x, i: x.gather(1, i.expand(4, 1)), torch.tensor([[-1]]), 1),
    "index_select": (lambda x, i: x.index_select(0, i), torch.tensor([1, 4]), 0),
    "embedding": (lambda x, i: torch.nn.functional.embedding(i, x), torch.tensor([0, 4]), 0),
    "embedding's gradient": (lambda x, i: torch.func.grad(
        lambda w: torch.nn.functional.embedding(i, w).sum())(x), torch.tensor([0, 4]), 0),
    "scatter": (lambda x, i: x.scatter(0, i.expand(1, 6), 1.0), torch.tensor([[4]]), 0),
    "scatter_add": (lambda x, i: x.scatter_add(1, i.expand(4, 1), x[:, :1]), torch.tensor([[6]]), 1),
    "cross_entropy": (lambda x, i: torch.nn.functional.cross_entropy(x, i), torch.tensor([0, 1, 6, 2]), 1),
}


@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_a_lookup_out_of_range_over_a_split_dim_raises_as_eager_raises(name):
    """gather, index_select, embedding (and its gradient), scatter and cross_entropy with an
    index outside the table, the table split along the looked-up dim: eager raises, and each
    rank's block lookup (an index outside it reads zero) returned a result silently."""
    fn, index, dim = LOOKUPS[name]
    x = torch.randn(4, 6, dtype=D, generator=_gen())
    with pytest.raises((IndexError, RuntimeError)):
        fn(x, index)
    spec = P(*[None] * dim, "dp")
    f = hpfun.shard(fn, mesh=hpfun.Mesh.simulated((2,), ("dp",)) if x.shape[dim] % 2 == 0 else MESH,
                    in_specs=(spec, P()), out_specs=P())
    with pytest.raises(hpfun.ExecutionError, match="out of range|out of bounds") as info:
        f(x, index)
    assert "the unsharded function raises on these values too" in str(info.value), str(info.value)
    torch.testing.assert_close(f(x, index.clamp(0, 3)).full(), fn(x, index.clamp(0, 3)))


@pytest.mark.parametrize("name", ["index_add", "index_copy"])
@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_a_negative_index_of_index_add_or_copy_raises_as_eager_raises(name, spec):
    """index_add and index_copy refuse a negative index; written as the index_put that counts it
    from the end, they wrote into the last row silently. Valid indices, forward and gradient,
    equal eager."""
    def fn(w, i):
        return getattr(torch.zeros(4, 6, dtype=D), name)(0, i, w)

    def loss(w, i):
        return fn(w, i).sin().sum()

    w = torch.randn(4, 6, dtype=D, generator=_gen())
    bad, good = torch.tensor([0, 2, -1, 1]), torch.tensor([3, 2, 0, 1])
    with pytest.raises((IndexError, RuntimeError)):
        fn(w, bad)
    f = hpfun.shard(fn, mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=(spec, spec), out_specs=P())
    with pytest.raises(hpfun.ExecutionError, match="negative index(.|\n)*raises on these values too"):
        f(w, bad)
    torch.testing.assert_close(f(w, good).full(), fn(w, good))
    g = hpfun.shard(torch.func.grad(loss), mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=(spec, spec),
                    out_specs=spec)
    torch.testing.assert_close(g(w, good).full(), torch.func.grad(loss)(w, good))


@pytest.mark.parametrize("name", ["gather", "embedding", "index", "index_put", "index_put_2d"])
def test_a_lookup_out_of_range_along_a_dim_each_rank_holds_whole_names_the_values(name):
    """The table split along another dim: torch's own kernel raises on the rank's block, as the
    unsharded function does, and the error says to fix the values (it said hpfun had a bug), also
    where the kernel that raises is one of the steps the rule emits (`t[rows, cols] = v`)."""
    fn, index = {"gather": (lambda x, i: x.gather(0, i), torch.full((6, 4), 7)),
                 "embedding": (lambda x, i: torch.nn.functional.embedding(i, x), torch.tensor([0, 5, 6, 1])),
                 "index": (lambda x, i: x[i], torch.tensor([0, 5, 6, 1])),
                 "index_put": (lambda x, i: x.clone().index_put_((i,), torch.ones((), dtype=D)), torch.tensor([0, 6])),
                 "index_put_2d": (lambda x, i: x.clone().index_put_((i, torch.tensor([0, 1])), torch.ones((), dtype=D)),
                                  torch.tensor([1, 6]))}[name]
    x = torch.randn(6, 4, dtype=D, generator=_gen())
    with pytest.raises((IndexError, RuntimeError)):
        fn(x, index)
    f = hpfun.shard(fn, mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=(P(None, "dp"), P()), out_specs=None)
    with pytest.raises(hpfun.ExecutionError, match="out of bounds|out of range") as info:
        f(x, index)
    assert "the unsharded function raises on these values too" in str(info.value), str(info.value)


def test_a_0d_tensor_of_an_argument_as_a_slice_bound_is_read_as_its_integer():
    """`x[:, n - 1:]`, `x[b, n:] = 0` and `x.narrow(1, n, 3)` with `n` a 0-d tensor among the arguments (torch-struct's
    CRF slices its labels by `lengths[b] - 1`) read `n` as `int(n)` does, and key the program by
    it (it was refused as a value read from parameters); one made from a parameter is still refused."""
    def read(x, lengths):
        return x[:, lengths[0] - 1:].sum(0)

    def write(x, lengths):
        y = x.clone()
        y[1, lengths[1]:] = 0
        return y

    def narrowed(x, lengths):  # (`narrow`'s start and length too, by keyword as well)
        return x.narrow(1, lengths[2], 3).sum(0) + x.narrow(1, 0, lengths[2]).sum() + \
            torch.narrow(x, 1, start=lengths[2], length=2).sum() + x.narrow(dim=1, start=0, length=lengths[2]).sum()

    x = torch.randn(4, 6, dtype=D, generator=_gen())
    f = hpfun.shard(read, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P())
    g = hpfun.shard(write, mesh=MESH, in_specs=(P(None, "dp"), P()), out_specs=P(None, "dp"))
    h = hpfun.shard(narrowed, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P())
    for lengths in (torch.tensor([3, 6, 2, 5]), torch.tensor([3, 2, 2, 5]), torch.tensor([5, 6, 1, 5])):
        torch.testing.assert_close(f(x, lengths).full(), read(x, lengths), rtol=0, atol=1e-12)
        torch.testing.assert_close(g(x, lengths).full(), write(x, lengths), rtol=0, atol=1e-12)
        torch.testing.assert_close(h(x, lengths).full(), narrowed(x, lengths), rtol=0, atol=1e-12)
    assert f.trace_count == 2 and g.trace_count == 2 and h.trace_count == 2

    w = torch.nn.Parameter(torch.tensor(2.0, dtype=D))
    with pytest.raises(hpfun.CaptureError, match="reads tensor values"):
        hpfun.shard(lambda x: x[:, (w * 2).long():].sum(), mesh=MESH, in_specs=P("dp"), out_specs=P())(x)


def test_0d_tensors_of_an_argument_given_as_sizes_are_read_as_their_integers():
    """`x.split(list(sizes))`, `torch.split`, `F.pad(x, (0, s[0]))`, `x.roll(s[0])`, `x.topk(s[0])` and `v in t`
    with values of an argument (Mistral3's patch merger splits its features by sizes made from
    `image_sizes`; transformers checks `pad_token_id in input_ids[:, [-1, 0]]`) read them as
    `int(t)` does, and key the program by them (torch read them in C++, where the trace refused
    them as values of parameters)."""
    def f(x, s):
        parts = x.split(list(s), 1)
        padded = torch.nn.functional.pad(x, (0, s[0]))
        flag = 1.0 if 4 in s else 0.0
        return parts[1].sum(0) + torch.split(x, list(s), 1)[0].sum() + padded.sum(0)[-1] \
            + x.roll(s[0], 1).sum(0)[0] + flag + x.topk(s[0], dim=1).values.sum() + x.chunk(s[0], 1)[0].sum()

    x = torch.randn(4, 6, dtype=D, generator=_gen())
    g = hpfun.shard(f, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P())
    for sizes in (torch.tensor([2, 4]), torch.tensor([2, 4]), torch.tensor([5, 1])):
        torch.testing.assert_close(g(x, sizes).full(), f(x, sizes), rtol=0, atol=1e-12)
    assert g.trace_count == 2


def test_scalar_tensor_of_a_traced_number_is_that_number_in_the_default_dtype():
    """`torch.scalar_tensor(x.sum())` is the number as a tensor of the default dtype (or the one
    asked for), as eager gives it (it was refused as a read of parameters' values)."""
    x = torch.randn(4, 3, dtype=D, generator=_gen())
    for f in (lambda x: torch.scalar_tensor(x.sum()) * x, lambda x: torch.scalar_tensor(x.max(), dtype=D) + x,
              lambda x: torch.scalar_tensor(x.sum().long()) + x):
        got = hpfun.shard(f, mesh=MESH, in_specs=(P("dp"),), out_specs=P())(x).full()
        want = f(x)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if want.dtype == torch.float32 else 1e-12)


MADE_OF_A_NUMBER = {  # each makes an integer tensor of the traced number n
    "tensor": lambda n, dtype: torch.tensor([n], dtype=dtype),
    "scalar_tensor": lambda n, dtype: torch.scalar_tensor(n, dtype=dtype),
    "full": lambda n, dtype: torch.full((2,), n, dtype=dtype),
    "new_full": lambda n, dtype: torch.zeros(1, dtype=dtype).new_full((3,), n),
    "masked_fill": lambda n, dtype: torch.zeros(4, dtype=dtype).masked_fill(torch.tensor([True, False] * 2), n),
    "index_fill": lambda n, dtype: torch.zeros(4, dtype=dtype).index_fill(0, torch.tensor([1, 3]), n),
    "masked_fill value=": lambda n, dtype: torch.zeros(4, dtype=dtype).masked_fill(torch.tensor([True, False] * 2),
                                                                                  value=n),
    "index_fill value=": lambda n, dtype: torch.zeros(4, dtype=dtype).index_fill(0, torch.tensor([1, 3]), value=n),
}


@pytest.mark.parametrize("make", sorted(MADE_OF_A_NUMBER))
def test_a_traced_number_that_does_not_fit_the_integer_dtype_asked_for_raises_as_eager_raises(make):
    """`torch.tensor([n], dtype=torch.int8)` (or scalar_tensor, full, new_full) of a traced
    n = 320: eager raises that it cannot be converted without overflow; the program checks it too
    (it wrapped to 64, silently). An unsigned type takes what torch's check lets through, a
    negative number down to minus its maximum, wrapped (it raised where eager gives 224)."""
    x = torch.ones(32, dtype=D)
    f = hpfun.shard(lambda x: MADE_OF_A_NUMBER[make]((x > 0).sum() * k, dtype), mesh=MESH, in_specs=(P("dp"),),
                    out_specs=P())
    for dtype, k, fits in ((torch.int8, 3, True), (torch.int8, 10, False), (torch.uint8, -1, True),
                           (torch.uint8, -7, True), (torch.uint8, -8, False), (torch.uint8, 8, False)):
        if fits:
            torch.testing.assert_close(f(x).full(), MADE_OF_A_NUMBER[make](torch.tensor(32 * k), dtype))
            continue
        with pytest.raises(RuntimeError, match="without overflow"):
            MADE_OF_A_NUMBER[make](torch.tensor(32 * k), dtype)
        with pytest.raises(hpfun.ExecutionError, match=f"cannot be converted to type {str(dtype)[6:]} without overflow"):
            f(x)


@pytest.mark.parametrize("make", sorted(MADE_OF_A_NUMBER))
def test_a_traced_float_made_an_integer_or_a_number_of_another_dtype_is_checked_and_cast_as_eager(make):
    """A traced float asked for as an integer is checked against the type's range, then
    truncated (eager raises for 127.5 as an int8, NaN too); a traced integer filled into a float
    tensor (`index_fill`, `masked_fill`) is cast (it failed in torch's decomposition of
    index_fill: "Index put requires the source and destination dtypes match")."""
    x = torch.ones(32, dtype=D)
    for value, dtype in ((lambda x: x.sum() * 3.9, torch.int8), (lambda x: x.sum() * 3.99, torch.int8),
                         (lambda x: x.sum() / 0 * 0, torch.int8), (lambda x: (x > 0).sum() * 4, D),
                         (lambda x: -x.sum() * 0.01, torch.uint8), (lambda x: x.sum() * 7.9, torch.uint8)):
        def fn(x):
            return MADE_OF_A_NUMBER[make](value(x), dtype)
        try:
            want = fn(x)
        except (RuntimeError, TypeError) as err:  # (torch.tensor([a float], dtype=torch.int8): a TypeError at once)
            kind, says = (hpfun.ExecutionError, "without overflow") if isinstance(err, RuntimeError) else \
                (hpfun.CaptureError, "only integer tensors")
            with pytest.raises(kind, match=says):
                hpfun.shard(fn, mesh=MESH, in_specs=(P("dp"),), out_specs=P())(x)
            continue
        got = hpfun.shard(fn, mesh=MESH, in_specs=(P("dp"),), out_specs=P())(x).full()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_index_fill_by_a_negative_index_differentiates_as_eager(spec):
    """`index_fill` counts a negative index from the end; its gradient, which torch's own
    decomposition writes with `index_copy` of the user's index, equals eager's (hpfun's check
    that `index_copy` is given no negative index, as its kernel checks, had fired on torch's call)."""
    x = torch.randn(4, 6, dtype=D, generator=_gen())
    idx = torch.tensor([-1, 2])

    def step(x, idx):
        return torch.func.grad(lambda x: (x.index_fill(1, idx, -2.0) ** 2).sum())(x)

    f = hpfun.shard(step, mesh=MESH, in_specs=(spec, P()), out_specs=spec)
    torch.testing.assert_close(f(x, idx).full(), step(x, idx), rtol=0, atol=1e-12)


@pytest.mark.parametrize("spec", [P(), P("dp"), P(None, "dp")], ids=str)
def test_index_fill_by_a_value_that_takes_a_gradient_differentiates_as_eager(spec):
    """`x.index_fill(dim, idx, w.prod())`: torch's backward for the value takes `_unique` of the
    index (a shape read from the data: refused); written as `torch.where` over the positions it
    names, the gradients of the value and of `x` equal eager's: a repeated index,
    in place, under `loss.backward()` and `torch.func.grad`."""
    x, w = torch.randn(4, 6, dtype=D, generator=_gen()), torch.randn(3, dtype=D, generator=_gen())
    idx = torch.tensor([0, 5, 2, 0])

    def step(x, w, idx):
        w, x = w.clone().requires_grad_(), x.clone().requires_grad_()
        filled = x.index_fill(1, idx, w.prod()) + torch.index_fill(x, 0, idx[2:], w.sum())
        y = x * 1.0
        y.index_fill_(1, idx[1:], w[0])
        ((filled ** 2).sum() + (y ** 3).sum()).backward()
        in_grad = torch.func.grad(lambda w: (x.detach().index_fill(1, idx, w.sum()) ** 2).sum())(w.detach())
        return x.grad, w.grad, in_grad

    f = hpfun.shard(step, mesh=MESH, in_specs=(spec, P(), P()), out_specs=(spec, P(), P()))
    for got, want in zip(f(x, w, idx), step(x, w, idx), strict=True):
        torch.testing.assert_close(got.full(), want, rtol=1e-12, atol=1e-12)


def test_a_0d_tensor_of_an_argument_given_as_a_size_is_read_as_its_integer():
    """`torch.arange(n)`, `torch.zeros(n)`, `linspace(0, 1, n)`, `x.new_zeros(n)` and `x.view(n, -1)` with `n`
    computed from the arguments (Longformer's `torch.arange(max_num_global_attn_indices)`, n a mask's
    count): read as `int(n)`, keying the program by it (each was refused as a data-dependent read)."""
    def sizes(mask, x):
        n = mask.sum(1).max()
        return (torch.arange(n).sum() + torch.zeros(n).sum() + torch.linspace(0, 1, n).sum() + mask.new_zeros(n).sum()
                + x.view(n, -1).sum(1).sum() + torch.arange(0, n, dtype=D).sum())

    f = hpfun.shard(sizes, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P())
    x = torch.randn(12, dtype=D, generator=_gen())
    for rows in ([1, 1, 0], [1, 1, 0], [1, 0, 1], [1, 1, 1], [1, 0, 0]):
        mask = torch.tensor([rows, [1, 0, 0], [0, 0, 0], [1, 0, 0]])
        torch.testing.assert_close(f(mask, x).full(), sizes(mask, x), rtol=0, atol=1e-12)
    assert f.trace_count == 3  # (n = 2, 3, 1)


def test_a_0d_tensor_given_as_a_fill_is_its_value_not_a_size():
    """`torch.full((3,), m.any())` keeps the flag's bool dtype (fa988c3 read it as a size, an
    int64 1, and a mask made with it picked the wrong elements); an int fills int64, a float the
    default dtype, a complex the default's complex type, as eager's number does; `fill_value=`,
    `new_full` and `full_like` alike (new_full had been refused since dbd64ee), their arguments
    by position or keyword."""
    m = torch.tensor([0, 1, 0, 0])
    x = torch.tensor([10.0, 20.0, 30.0], dtype=D)

    def masked(m, x):
        return x[torch.full((3,), m.any())] + torch.full((3,), m.sum()) + torch.full((3,), (m * 1.5).sum()) \
            + torch.full((3,), fill_value=m.sum()) + x.new_full((3,), m.sum()) + torch.full_like(x, m.sum()) \
            + torch.full(size=(3,), fill_value=m.sum()) + x.new_full(size=(3,), fill_value=m.max()) \
            + torch.full_like(input=x, fill_value=m.sum()) + torch.full((3,), m.sum(), layout=torch.strided) \
            + torch.full_like(x, m.max(), memory_format=torch.preserve_format)  # (by keyword, with layout
        # and memory format: refused as a read of data the trace cannot read)

    got = hpfun.shard(masked, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P())(m, x).full()
    torch.testing.assert_close(got, masked(m, x), rtol=0, atol=0)
    before = torch.get_default_dtype()  # (a complex fill: the default dtype's complex type)
    torch.set_default_dtype(torch.float64)
    try:
        f = hpfun.shard(lambda m: torch.full((2,), (m * (1 + 1e-9j)).sum()), mesh=MESH, in_specs=P("dp"), out_specs=P())
        got, want = f(m).full(), torch.full((2,), (m * (1 + 1e-9j)).sum())
        assert got.dtype == want.dtype == torch.complex128 and torch.equal(got, want)
    finally:
        torch.set_default_dtype(before)


def test_a_0d_fill_in_channels_last_is_made_so():
    """`torch.full_like(x, x.mean(), memory_format=torch.channels_last)` (and its 3-d kind): the
    fill expanded and copied in that format (it was refused as a read of data)."""
    for shape, laid in (((4, 3, 2, 2), torch.channels_last), ((4, 3, 2, 2, 2), torch.channels_last_3d)):
        x = torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(0))

        def fill(x):
            return x * torch.full_like(x, x.mean(), memory_format=laid)

        got = hpfun.shard(fill, mesh=MESH, in_specs=P("dp"), out_specs=P())(x).full()
        torch.testing.assert_close(got, fill(x), rtol=1e-12, atol=1e-15)  # (the mean's sum: blocks, then theirs)


def test_a_tensor_made_of_traced_numbers_holds_their_values():
    """`torch.tensor([row.max() + 1 - len(row) for row in ids])` (transformers' Qwen2-VL makes its
    rotary position deltas so): torch reads each 0-d tensor as a number; the program stacks
    them, in the dtype torch infers (the elements' promoted, Python numbers beside them) or the
    one given, nested lists too, and computes them anew at each call (it failed inside torch:
    "data is not allocated yet")."""
    import numpy as np

    def deltas(ids, x):
        out = ids + torch.tensor([row.max() + 1 - len(row) for row in ids]).unsqueeze(1)
        grid = torch.tensor([[x.sum(), 2.5], [x.amax(), 1]])  # (float64 elements, a float, an int)
        halves = torch.tensor([x.mean(), x.amin()], dtype=torch.float32)
        others = torch.as_tensor([x.sum().reshape(1), np.float16(0.5)]) + ids.new_tensor([ids.max(), 3])
        return out, grid, halves, others

    f = hpfun.shard(deltas, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=(P(), P(), P(), P()))
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        ids, x = torch.randint(0, 50, (4, 6), generator=g), torch.randn(4, 3, dtype=D, generator=g)
        for got, want in zip(f(ids, x), deltas(ids, x), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got.full(), want, rtol=1e-12, atol=1e-12)
    assert f.trace_count == 1
    with pytest.raises(hpfun.CaptureError, match="only integer tensors"):  # (eager's TypeError: a float read as an int)
        hpfun.shard(lambda x: torch.tensor([x.sum()], dtype=torch.int32), mesh=MESH, in_specs=P("dp"), out_specs=P())(x)


def test_a_mask_made_like_a_parameters_product_is_read_from_its_own_values():
    """`mask = torch.zeros_like(x @ w)` (w a parameter), set where two labels match, then checked
    in Python (`assert not (mask > 1).any()`; pytorch-metric-learning's pair losses): the mask's
    values are a number's and the labels', not the product's, so the check reads them, as it
    does for `torch.zeros(shape)` (it was refused as a value made from parameters)."""
    w = torch.nn.Parameter(torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(0)))

    def paired(x, labels):
        mat = x @ w
        masks = [torch.zeros_like(mat), torch.full_like(mat, 0.0), mat.new_zeros(mat.shape), torch.ones_like(mat) - 1]
        for mask in masks:
            i, j = torch.where(labels[:, None] == labels[None, :])
            mask[i, j] = 1
            assert not torch.any(mask > 1)
        return sum((mat * mask).sum() for mask in masks)

    f = hpfun.shard(paired, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P())
    for labels in ([0, 1, 0, 1], [2, 2, 0, 1]):
        x, labels = torch.randn(4, 4, dtype=D), torch.tensor(labels)
        torch.testing.assert_close(f(x, labels).full(), paired(x, labels), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_ops_by_a_0d_index_and_their_gradients_equal_eager(spec):
    """`index_select` by a 0-d index (what `mask.nonzero().squeeze()` gives for one hit, as
    nn.AdaptiveLogSoftmaxWithLoss does per cluster) differentiates as eager (its backward, an
    index_add by the 0-d index, failed in torch's decomposition); index_add and index_copy by one."""
    w = torch.randn(4, 4, dtype=D, generator=_gen())
    x = torch.randn(8, 4, dtype=D, generator=_gen())

    def step(w, x, i):
        h = x @ w
        picked = h.index_select(0, i).pow(2).sum() + h.index_add(0, i, h[:1]).sum() + h.index_copy(0, i, h[1:2]).pow(2).sum()
        return torch.func.grad(lambda w: (x @ w).index_select(0, i).pow(2).sum())(w), picked

    f = hpfun.shard(step, mesh=MESH, in_specs=(P(), spec, P()), out_specs=(P(), P()))
    for i in (5, 0):
        i = torch.tensor(i)
        for got, want in zip(f(w, x, i), step(w, x, i), strict=True):
            torch.testing.assert_close(got.full(), want, rtol=1e-12, atol=1e-12)


TAKING_AN_INT = {  # each given a 0-d integer tensor of an argument where torch takes an int (or an index)
    "tile": lambda x, n: x.tile((1, n)), "tril": lambda x, n: torch.tril(x, diagonal=n), "triu": lambda x, n: x.triu(n),
    "select": lambda x, n: x.select(1, n), "diagonal": lambda x, n: x.diagonal(offset=n),
    "unfold": lambda x, n: x.unfold(1, n, 1), "movedim": lambda x, n: x.movedim(n - 2, 1),
    "cumsum": lambda x, n: x.cumsum(n - 1), "flip": lambda x, n: x.flip(n - 1),
    "one_hot": lambda x, n: torch.nn.functional.one_hot((x > 0).long()[:, 0], num_classes=n + 1) * x[:, :1],
    "adaptive_avg_pool1d": lambda x, n: torch.nn.functional.adaptive_avg_pool1d(x[:, None], n)[:, 0],
    "take": lambda x, n: torch.take(x, n) * x[:, :1],
    "select of a uint8": lambda x, n: x.select(1, n.to(torch.uint8)),  # (an index takes it as a mask; select, an int)
    "leaky_relu (a float)": lambda x, n: torch.nn.functional.leaky_relu(x, n * 0.1),
    "huber_loss (a float)": lambda x, n: torch.nn.functional.huber_loss(x, x.flip(0), delta=n * 0.5, reduction="none"),
}


@pytest.mark.parametrize("op", sorted(TAKING_AN_INT))
def test_a_0d_integer_argument_given_for_an_int_is_read_as_int_reads_it(op):
    """`x.tile((1, n))`, `torch.tril(x, n)`, `x.select(1, n)`, `one_hot(t, num_classes=n)`... with
    `n` a 0-d integer tensor of an argument: read as `int(n)`, as eager's argument parsing reads
    it (refused as a read of data-dependent values); another value compiles again. torch.take by
    a 0-d index of an argument too (its decomposition read it as a Python int); a 0-d float where
    torch parses a float (`leaky_relu(x, slope)`) as `float(slope)`."""
    fn = TAKING_AN_INT[op]
    x = torch.randn(8, 6, dtype=D, generator=_gen())
    f = hpfun.shard(fn, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P())
    for n in (2, 1, 2):
        n = torch.tensor(n)
        torch.testing.assert_close(f(x, n).full(), fn(x, n), rtol=0, atol=0)
    assert f.trace_count == (1 if op == "take" else 2)


def test_a_0d_uint8_index_is_a_mask_not_an_int():
    """`x[:, t]` with `t` a 0-d uint8 tensor indexes by it as a byte mask (a new dim of one row or
    none), not as the integer it holds (it gave x[:, 2], silently, when uint8 tensors were read
    where torch parses an int)."""
    x = torch.arange(20, dtype=D).reshape(4, 5)
    f = hpfun.shard(lambda x, t: x[:, t], mesh=MESH, in_specs=(P("dp"), P()), out_specs=P())
    for t in (torch.tensor(2, dtype=torch.uint8), torch.tensor(0, dtype=torch.uint8)):
        want = x[:, t.bool()]
        got = f(x, t).full()
        assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_a_0d_mask_after_other_indices_adds_its_dim_where_it_stands(spec):
    """`x[:, b]`, `x[..., b]`, `x[b, b]` and `y[:, b] = 0`: torch puts a dim of one (b True) or
    none there; the 0-d mask was read as a 1-d mask of the dim it stood at (`x[:, b]` gave
    column 0 as a (4, 1) result), silently."""
    x = torch.arange(48, dtype=D).reshape(4, 3, 4)

    def zeroed(x, b):
        y = x.clone()
        y[:, b] = 0.0
        return y

    cases = {"x[:, b]": lambda x, b: x[:, b], "x[..., b]": lambda x, b: x[..., b], "x[b, b]": lambda x, b: x[b, b],
             "x[None, b, ..., 1]": lambda x, b: x[None, b, ..., 1], "x[b, 1:, b]": lambda x, b: x[b, 1:, b],
             "x[:, b] made inside": lambda x, b: x[:, torch.tensor(True)], "y[:, b] = 0": zeroed,
             "grad of x[..., b]": lambda x, b: torch.func.grad(lambda x: (x[..., b] ** 2).sum())(x)}
    for name, fn in cases.items():
        for b in (torch.tensor(True), torch.tensor(False)):
            want = fn(x, b)
            got = hpfun.shard(fn, mesh=MESH, in_specs=(spec, P()), out_specs=P())(x, b).full()
            assert got.shape == want.shape and torch.equal(got, want), (name, b)


def _chunked(x, lens):
    """Qwen2.5-Omni's audio chunking: a table sized by one read of the arguments, written at
    positions a second read names, then read whole."""
    n = torch.ceil(lens / 16).long()
    chunks = torch.full((int(n.sum()),), 16, dtype=torch.long)
    chunks[torch.nn.functional.pad(n, (1, 0), value=-1).cumsum(0)[1:]] = lens % 16
    chunks[chunks == 0] = 16
    return x * sum(chunks.tolist())


def test_a_read_whose_steps_fail_on_other_arguments_does_not_hold_for_them():
    """A program traced for 7 chunks, checked on arguments of 8: its second read's steps index
    past the table its first read sized, and the IndexError came out of hpfun's check of the
    cached program instead of a program for the new arguments."""
    x = torch.ones(2, dtype=D)
    for order in (([24, 32, 32, 32], [16, 32, 32, 32], [32, 24, 32, 32]),
                  ([16, 32, 32, 32], [32, 24, 32, 32], [24, 32, 32, 32])):
        f = hpfun.shard(_chunked, mesh=MESH, in_specs=(P(), P()), out_specs=P())
        for lens in map(torch.tensor, order):
            torch.testing.assert_close(f(x, lens).full(), _chunked(x, lens), rtol=0, atol=0)


@pytest.mark.parametrize("spec", [P(), P("dp"), P(None, "dp")], ids=str)
def test_a_0d_integer_index_beside_other_indices_reads_and_writes_as_eager(spec):
    """`h[i, :, j] = v`, `h[i, j] += v`, `h[m, :, j] = v` and a read after a write through a
    view, with `j` a 0-d integer argument beside an index tensor, list or mask: torch reads `j`
    in C++ where the index is written, and the call was refused as a read of parameters or
    random draws (`j` is an argument)."""
    x = torch.randn(4, 4, 6, dtype=D, generator=_gen())
    i, j, m = torch.tensor([0, 2]), torch.tensor(3), torch.tensor([True, False, True, True])

    def written(index, value=1.0):
        def f(x, i, j, m):
            h = x.clone()
            h[index(i, j, m)] = value
            return h
        return f

    def added(x, i, j, m):
        h = x.clone()
        h[i, j] += torch.arange(6, dtype=D)
        return h

    def read_after_a_view_write(x, i, j, m):
        h = x.clone()
        h.select(0, 1).add_(1.0)
        return h[i, j]

    cases = [written(lambda i, j, m: (i, slice(None), j)), written(lambda i, j, m: (j, i)),
             written(lambda i, j, m: (m, slice(None), j)), added, read_after_a_view_write,
             lambda x, i, j, m: x[[0, 2], j], lambda x, i, j, m: x[m, j],
             lambda x, i, j, m: torch.func.grad(lambda x: (x[i, :, j] ** 2).sum())(x)]
    for fn in cases:
        want = fn(x, i, j, m)
        got = hpfun.shard(fn, mesh=MESH, in_specs=(spec, P(), P(), P()), out_specs=P())(x, i, j, m).full()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=str)
def test_a_list_or_numpy_array_of_booleans_indexes_as_the_mask_it_is(spec):
    """`x[[True, False, ...]]` and `x[:, np_bools] = 0`: torch makes the mask in C++, where the
    trace saw no constant to read its positions from: refused as a shape read from the data; a
    1-d uint8 mask was refused as not a byte tensor."""
    x = torch.arange(48, dtype=D).reshape(8, 6)
    rows, cols = [True, False, False, True] * 2, np.array([True, False, True, True, False, False])

    def written(x):
        y = x.clone()
        y[:, cols] = 0.0
        return y

    bytes_ = torch.tensor(rows, dtype=torch.uint8)  # (torch's old mask dtype, which it still takes)
    for fn in (lambda x: x[rows] * 1.0, lambda x: x[np.array(rows), 1:], written, lambda x: x[bytes_] * 1.0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (torch's deprecation of uint8 masks)
            want = fn(x)
        got = hpfun.shard(fn, mesh=MESH, in_specs=(spec,), out_specs=P())(x).full()
        assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("spec", [P(), P("dp"), P(None, None, "dp")], ids=str)
def test_a_0d_integer_index_before_a_slice_and_another_index_selects_first_as_torch_does(spec):
    """`x[j, :, i]`: torch selects by `j` first, so `i`'s dims keep their place (a (4, 2) result);
    taken as an index beside `i`, the two went first (a (2, 4) result, or the same shape
    transposed: `x[j, 1:3, i]`), silently. Reads, masks, None and writes alike."""
    x = torch.arange(8 * 4 * 6, dtype=D).reshape(8, 4, 6)
    j, i = torch.tensor(3), torch.tensor([0, 5])

    def written(x, j, i):
        y = x.clone()
        y[j, :, i] = x[j, :, i] * 2.0 + torch.arange(4, dtype=D)[:, None]
        return y

    cases = [lambda x, j, i: x[j, :, i], lambda x, j, i: x[j, 1:3, i], lambda x, j, i: x[j, None, i % 4],
             lambda x, j, i: x[-j, :, [True, False, False, False, False, True]], lambda x, j, i: x[..., j, i % 4],
             written]
    for fn in cases:
        want = fn(x, j, i)
        got = hpfun.shard(fn, mesh=MESH, in_specs=(spec, P(), P()), out_specs=P())(x, j, i).full()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("spec", [P(), P("dp"), P(None, "dp")], ids=str)
@pytest.mark.parametrize("write", ["mul_", "setitem", "view", "copy_", "iadd", "twice", "two 0-d", "two 0-d iadd",
                                   "three 0-d", "held row"])
def test_an_in_place_write_into_a_view_a_0d_integer_tensor_indexes_reaches_the_tensor(write, spec):
    """`y[j].mul_(2)`, `y[j][:, k] = 5`, `y[j].view(-1)[:5] = 1`, `queue[ptr].copy_(v)` with `j` a
    traced 0-d integer: eager writes through the view into `y`; hpfun reads `y[j]` by index, a
    copy, and the write was lost, silently. Each write into the copy is put back where it was
    read from; `y[j][k] = v`, `k` a 0-d tensor too, was refused (its write read `k`), and
    `y[j][k][j] = v` did not reach `y`."""
    x = torch.randn(4, 4, 6, dtype=D, generator=_gen())

    def f(x, j):
        y = x.clone()
        if write == "mul_":
            y[j].mul_(2.0)
        elif write == "setitem":
            y[j][:, 1] = 5.0
        elif write == "view":
            y[j].view(-1)[:5] = 1.0
        elif write == "copy_":
            y[j].copy_(torch.zeros(4, 6, dtype=D))
        elif write == "iadd":
            y[j] += 1.0
        elif write == "two 0-d":  # (a 0-d index into the copy: it was read, and the trace refused)
            y[j][j + 1] = 7.0
        elif write == "two 0-d iadd":
            y[j][-j] += x[0, 0]
        elif write == "three 0-d":  # (the innermost copy put back into the copy it was read from, and on into y)
            y[j][j - 1][j] = 3.0
        elif write == "held row":
            row = y[j]
            row[j - 1] = 4.0
            row[1, j] *= 2.0
        else:
            row = y[j]
            row.mul_(2.0)
            row[0].add_(1.0)
        return y

    g = hpfun.shard(f, mesh=MESH, in_specs=(spec, P()), out_specs=P())
    for j in (torch.tensor(2), torch.tensor(-1)):
        torch.testing.assert_close(g(x, j).full(), f(x, j), rtol=0, atol=0)
