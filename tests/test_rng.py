"""Random numbers under sharding: the same values for every layout and mesh, right distributions."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import hpfun
from hpfun import P, rng
from hpfun.rules.random import _sample, sample
from hpfun.testing.models import MEGATRON, REPLICATED, mlp_data, mlp_dropout_step, mlp_init

KAT = [  # Random123's published Philox4x32-10 known answers: counter, key -> output
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    """The int64 Philox 4x32-10 reproduces the published known-answer vectors."""
    words = rng.philox4x32(*(torch.tensor([c]) for c in counter), *(torch.tensor([k]) for k in key))
    assert tuple(int(w) for w in words) == expected


RANDOM_OPS = {
    "rand": lambda x: torch.rand(x.shape),
    "randn": lambda x: torch.randn(x.shape, dtype=torch.float64),
    "rand_like": lambda x: torch.rand_like(x),
    "randn_like": lambda x: torch.randn_like(x),
    "uniform_": lambda x: torch.empty_like(x).uniform_(-2.0, 3.0),
    "normal_": lambda x: torch.empty_like(x).normal_(1.0, 2.0),
    "bernoulli_p": lambda x: torch.bernoulli(torch.full_like(x, 0.3)),
    "bernoulli_probs": lambda x: torch.bernoulli(torch.sigmoid(x)),
    "dropout": lambda x: F.dropout(x, 0.4),
    "randint": lambda x: torch.randint(3, 17, x.shape).float(),
    "randperm": lambda x: torch.randperm(x.shape[0]).float(),
    "rand_bf16": lambda x: torch.rand(x.shape, dtype=torch.bfloat16).float(),
    "randint_like": lambda x: torch.randint_like(x, 2, 9),
    "gumbel_noise": lambda x: -torch.empty_like(x).exponential_().log(),  # F.gumbel_softmax's
    "log_normal_": lambda x: torch.empty_like(x).log_normal_(0.5, 0.3),
    "cauchy_": lambda x: torch.empty_like(x).cauchy_(1.0, 2.0),
    "geometric_": lambda x: torch.empty_like(x).geometric_(0.3),
    "normal(tensor, float)": lambda x: torch.normal(x, 2.0),
    "normal(float, tensor)": lambda x: torch.normal(1.0, x.abs() + 0.1),
    "normal(float, float, size)": lambda x: torch.normal(1.0, 2.0, x.shape),
    "randn_complex": lambda x: torch.randn(x.shape, dtype=torch.complex128).imag,
    "randint_wide": lambda x: torch.randint(-2**40, 2**40, x.shape).double(),
    "bernoulli_(tensor)": lambda x: torch.empty_like(x).bernoulli_(torch.sigmoid(x)),
    # spelled with generator=None (diffusers' randn_tensor): the `.generator` overloads
    "randn(generator=None)": lambda x: torch.randn(x.shape, generator=None, dtype=torch.float64),
    "rand(generator=None)": lambda x: torch.rand(x.shape, generator=None),
    "randint(generator=None)": lambda x: torch.randint(3, 17, x.shape, generator=None).float(),
    "randint(high, generator=None)": lambda x: torch.randint(17, x.shape, generator=None).float(),
    "randperm(generator=None)": lambda x: torch.randperm(x.shape[0], generator=None).float(),
}
MESHES = [(1,), (2,), (4,), (8,), (2, 2), (2, 4), (4, 2)]


@st.composite
def layouts(draw):
    """A mesh of 1-8 ranks and a spec splitting any dim of an (8, 8, 4) tensor, axes may share a
    dim (in any order)."""
    shape = draw(st.sampled_from(MESHES))
    names = ("a", "b")[: len(shape)]
    entries = [[], [], []]
    for name, size in zip(names, shape, strict=True):
        choices = [d for d in range(3) if (8, 8, 4)[d] % (size * math.prod(dict(zip(names, shape))[n] for n in entries[d])) == 0]
        dim = draw(st.sampled_from([None] + choices))
        if dim is not None:
            entries[dim].append(name)
    return hpfun.Mesh.simulated(shape, names), P(*[tuple(draw(st.permutations(e))) if e else None for e in entries])


@settings(max_examples=100)
@given(op=st.sampled_from(sorted(RANDOM_OPS)), case=layouts(), seed=st.integers(0, 2**40))
def test_values_do_not_depend_on_mesh_or_layout(op, case, seed):
    """.full() of a random op's sharded output is bitwise the one-device draw with the same seed."""
    mesh, spec = case
    x = torch.randn(8, 8, 4)
    one = hpfun.shard(RANDOM_OPS[op], mesh=hpfun.Mesh.simulated((1,), ("a",)), in_specs=P())
    sharded = hpfun.shard(RANDOM_OPS[op], mesh=mesh, in_specs=spec)
    with hpfun.random_seed(seed):
        expected = one(x).full()
    with hpfun.random_seed(seed):
        got = sharded(x)
    assert torch.equal(got.full(), expected), (op, str(mesh), str(spec), got.layout)
    for group in _replica_groups(got.layout):  # replicated placements: identical on every rank
        assert all(torch.equal(got.shards[r], got.shards[group[0]]) for r in group)


def _replica_groups(layout):
    axes = [a for a, p in enumerate(layout.placements) if isinstance(p, hpfun.Replicate)]
    return layout.mesh.groups(tuple(layout.mesh.axis_names[a] for a in axes)) if axes else []


@pytest.mark.parametrize("op", ["randn", "rand", "randint", "randperm"])
def test_generator_none_draws_what_the_plain_call_draws(op):
    """`generator=None` is torch's default: the same numbers as the call without it."""
    x = torch.randn(8, 8, 4)
    mesh = hpfun.Mesh.simulated((2,), ("a",))
    plain, spelled = (hpfun.shard(RANDOM_OPS[name], mesh=mesh, in_specs=P("a")) for name in (op, f"{op}(generator=None)"))
    with hpfun.random_seed(7):
        want = plain(x).full()
    with hpfun.random_seed(7):
        assert torch.equal(spelled(x).full(), want)


def test_manual_seed_reproduces_and_successive_calls_differ():
    """torch.manual_seed(s) reproduces a run; successive calls draw new numbers."""
    f = hpfun.shard(lambda x: torch.rand_like(x), mesh=hpfun.Mesh.simulated((2,), ("a",)), in_specs=P("a"))
    x = torch.empty(8)
    torch.manual_seed(5)
    first, second = f(x).full(), f(x).full()
    torch.manual_seed(5)
    assert torch.equal(f(x).full(), first) and not torch.equal(first, second)


def test_manual_seed_inside_the_function_fixes_its_draws():
    """torch.manual_seed(s) called by the function (an evaluation step seeding its dropout) makes
    every call draw the same numbers, on every layout, whatever torch's generator held before,
    and leaves torch's generator seeded with s, as the eager call would. A seed set after the
    function has drawn is refused: a program's draws share one seed."""
    def noisy(x):
        torch.manual_seed(123)
        return F.dropout(x, 0.5) + torch.rand_like(x)

    x = torch.ones(8, 4)
    results = []
    for mesh, spec in ((hpfun.Mesh.simulated((2,), ("a",)), P("a")), (hpfun.Mesh.simulated((2, 2), ("a", "b")), P("b", "a"))):
        f = hpfun.shard(noisy, mesh=mesh, in_specs=spec, out_specs=spec)
        torch.manual_seed(1)
        results.append(f(x).full())
        after = torch.rand(3)
        torch.manual_seed(2)
        results.append(f(x).full())
        torch.manual_seed(123)
        assert torch.equal(after, torch.rand(3))  # the generator was left seeded with 123
    assert all(torch.equal(r, results[0]) for r in results)

    def late(x):
        y = torch.rand_like(x)
        torch.manual_seed(0)
        return y + torch.rand_like(x)

    with pytest.raises(hpfun.CaptureError, match="after the function drew random numbers"):
        hpfun.shard(late, mesh=hpfun.Mesh.simulated((2,), ("a",)), in_specs=P("a"), out_specs=P("a"))(x)


def test_native_rng_is_disjoint_per_block_and_same_where_replicated():
    """rng="native": blocks differ, replicated ranks agree, and the shape is right."""
    mesh = hpfun.Mesh.simulated((2, 2), ("a", "b"))
    f = hpfun.shard(lambda x: torch.rand_like(x), mesh=mesh, in_specs=P("a"), rng="native")
    out = f(torch.empty(8, 4))
    assert torch.equal(out.shards[0], out.shards[1]) and not torch.equal(out.shards[0], out.shards[2])
    assert out.full().shape == (8, 4) and 0 <= out.full().min() and out.full().max() < 1


LAYOUTS = {"one": ((1,), ("dp",), REPLICATED, P(), P()), "dp": ((2,), ("dp",), REPLICATED, P("dp"), P("dp")),
           "tp": ((2,), ("tp",), MEGATRON, P(), P()), "dp_tp": ((2, 2), ("dp", "tp"), MEGATRON, P("dp"), P("dp"))}


def test_dropout_training_step_is_identical_across_layouts():
    """A step with dropout draws bitwise-equal masks and equal losses under DP, TP, DP x TP and on one device."""
    params, (x, y) = mlp_init(), mlp_data()
    results = {}
    for name, (shape, axes, pspec, xspec, yspec) in LAYOUTS.items():
        step = hpfun.shard(mlp_dropout_step, mesh=hpfun.Mesh.simulated(shape, axes),
                           in_specs=(pspec, xspec, yspec), out_specs=(pspec, P(), P()))
        with hpfun.random_seed(11):
            new, loss, mask = step(params, x, y)
        results[name] = (loss.full(), mask.full(), new["w1"].full())
    loss0, mask0, w0 = results["one"]
    assert 0.15 < (mask0 == 0).float().mean() < 0.35  # p = 0.25
    for name, (loss, mask, w1) in results.items():
        assert torch.equal(mask, mask0), name
        torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Distributions (fixed seeds: deterministic)
# ---------------------------------------------------------------------------------------------

N = 1 << 16
INDEX = torch.arange(N, dtype=torch.int64)
SEED = torch.tensor([987654321], dtype=torch.int64)


def _ks(sorted_values: torch.Tensor, cdf) -> float:
    """Kolmogorov-Smirnov distance of a sorted sample to a CDF."""
    n = sorted_values.numel()
    model = cdf(sorted_values.double())
    ranks = torch.arange(1, n + 1, dtype=torch.float64) / n
    return max((ranks - model).abs().max().item(), (model - (ranks - 1 / n)).abs().max().item())


def test_uniform_moments_and_goodness_of_fit():
    """rand: mean 1/2, variance 1/12, KS distance to U(0,1) below the 1% critical value."""
    u = _sample("rand", INDEX, SEED, 1, torch.float32, 0.0, 1.0)
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / N)
    assert abs(u.var().item() - 1 / 12) < 0.002
    assert _ks(u.sort().values, lambda v: v) < 1.63 / math.sqrt(N)


def test_normal_moments_and_goodness_of_fit():
    """randn: mean 0, variance 1, KS distance to N(0,1) below the 1% critical value."""
    z = _sample("randn", INDEX, SEED, 2, torch.float64, 0.0, 1.0)
    assert abs(z.mean().item()) < 4 / math.sqrt(N)
    assert abs(z.var().item() - 1) < 0.03
    assert _ks(z.sort().values, torch.special.ndtr) < 1.63 / math.sqrt(N)


def test_bernoulli_rate_and_randint_frequencies():
    """bernoulli hits its rate; randint covers [low, high) evenly (chi-square at 1%)."""
    b = _sample("bernoulli_p", INDEX, SEED, 3, torch.float32, 0.3)
    assert abs(b.mean().item() - 0.3) < 4 * math.sqrt(0.21 / N)
    r = _sample("randint", INDEX, SEED, 4, torch.int64, 3, 13)
    counts = torch.bincount(r - 3, minlength=10).double()
    assert r.min() == 3 and r.max() == 12
    assert ((counts - N / 10) ** 2 / (N / 10)).sum().item() < 21.67  # chi-square, 9 dof, 1%


def test_exponential_cauchy_geometric_and_log_normal_fit():
    """The draws by inversion and log-normal: KS distance to their CDFs below the 1% critical
    value; geometric's support starts at 1 and hits its mean 1/p."""
    critical = 1.63 / math.sqrt(N)
    e = _sample("exponential", INDEX, SEED, 5, torch.float64, 2.0)
    assert e.min() >= 0 and _ks(e.sort().values, lambda v: 1 - torch.exp(-2.0 * v)) < critical
    c = _sample("cauchy", INDEX, SEED, 6, torch.float64, 1.0, 2.0)
    assert _ks(c.sort().values, lambda v: 0.5 + torch.atan((v - 1.0) / 2.0) / math.pi) < critical
    n = _sample("log_normal", INDEX, SEED, 7, torch.float64, 0.5, 0.3)
    assert _ks(n.sort().values, lambda v: torch.special.ndtr((torch.log(v) - 0.5) / 0.3)) < critical
    g = _sample("geometric", INDEX, SEED, 8, torch.float64, 0.3)
    assert g.min() == 1 and torch.equal(g, g.floor())
    assert abs(g.mean().item() - 1 / 0.3) < 4 * math.sqrt(0.7 / 0.09 / N)


def test_randperm_is_a_permutation_and_ops_are_independent():
    """randperm gives a permutation; different op numbers give uncorrelated streams."""
    perm = _sample("randperm", torch.arange(1000), SEED, 5, torch.int64)
    assert torch.equal(perm.sort().values, torch.arange(1000))
    a = _sample("rand", INDEX, SEED, 6, torch.float64, 0.0, 1.0)
    b = _sample("rand", INDEX, SEED, 7, torch.float64, 0.0, 1.0)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 4 / math.sqrt(N)


def test_compiled_kernel_matches_the_eager_generator():
    """The compiled kernel draws the eager generator's words bit for bit (normals: to the last bit
    of log/cos, which is why the path is chosen by global size, the same for every layout)."""
    index = torch.arange(rng.COMPILE_ABOVE + 1000, dtype=torch.int64)
    assert torch.equal(sample("rand", index, SEED, 9, torch.float32, 0.0, 1.0),
                       _sample("rand", index, SEED, 9, torch.float32, 0.0, 1.0))
    torch.testing.assert_close(sample("randn", index, SEED, 9, torch.float32, 0.0, 1.0),
                               _sample("randn", index, SEED, 9, torch.float32, 0.0, 1.0), rtol=0, atol=2e-6)


def test_large_draws_are_layout_invariant_across_the_compile_threshold():
    """A draw above the threshold globally, below it per rank, equals the one-device draw bitwise."""
    x = torch.empty(rng.COMPILE_ABOVE // 64 * 2, 64)
    draw = lambda x: torch.randn_like(x)  # noqa: E731
    with hpfun.random_seed(3):
        one = hpfun.shard(draw, mesh=hpfun.Mesh.simulated((1,), ("a",)), in_specs=P())(x).full()
    with hpfun.random_seed(3):
        eight = hpfun.shard(draw, mesh=hpfun.Mesh.simulated((8,), ("a",)), in_specs=P("a"))(x)
    assert eight.shards[0].numel() < rng.COMPILE_ABOVE <= x.numel()
    assert torch.equal(eight.full(), one)


def test_gumbel_softmax_draws_the_same_for_every_batch_split():
    """F.gumbel_softmax (exponential_ noise) split on the batch equals its one-device draw."""
    x = torch.randn(8, 6)
    step = lambda x: F.gumbel_softmax(x, tau=0.5, hard=True)  # noqa: E731
    one = hpfun.shard(step, mesh=hpfun.Mesh.simulated((1,), ("a",)), in_specs=P("a"), out_specs=P("a"))
    four = hpfun.shard(step, mesh=hpfun.Mesh.simulated((4,), ("a",)), in_specs=P("a"), out_specs=P("a"))
    with hpfun.random_seed(3):
        expected = one(x).full()
    with hpfun.random_seed(3):
        got = four(x).full()
    assert torch.equal(got, expected) and torch.equal(got.sum(-1), torch.ones(8))


def test_a_random_op_without_a_draw_says_to_draw_outside():
    """torch.multinomial has no exact draw yet: the error says to draw outside and pass it in."""
    f = hpfun.shard(lambda p: torch.multinomial(p, 2), mesh=hpfun.Mesh.simulated((2,), ("a",)), in_specs=P("a"),
                    out_specs=P("a"))
    with pytest.raises(hpfun.HpfunError, match="draw the values outside the sharded function"):
        f(torch.rand(4, 6))


def test_randint_over_ranges_wider_than_32_bits_stays_in_range():
    """A range of 2^31 or more (a multiply-shift on one word would overflow int64) draws a 63-bit
    integer modulo the range, as torch does: every value inside, spread evenly (chi-square over
    16 bins). (A 64-bit integer modulo a range past 2^62 favours its low values, as torch's does:
    3 * 2^61 is only checked for range.)"""
    r = _sample("randint", INDEX, SEED, 3, torch.int64, 0, 3 * 2**61)
    assert r.min() >= 0 and r.max() < 3 * 2**61
    for low, high in [(0, 2**31), (0, 2**40), (-2**40, 2**40), (5, 2**62 + 5), (-2**62, 2**62 - 1)]:
        r = _sample("randint", INDEX, SEED, 3, torch.int64, low, high)
        assert r.min() >= low and r.max() < high, (low, high)
        bins = torch.bincount(((r - low).double() / (high - low) * 16).long(), minlength=16).double()
        assert ((bins - N / 16) ** 2 / (N / 16)).sum().item() < 30.58, (low, high)  # 15 dof, 1%


def test_complex_draws_split_their_variance_between_independent_parts():
    """randn in a complex dtype, as torch draws it: real and imaginary parts independent standard
    normals of variance 1/2 each; rand: both parts uniform in [0, 1); normal_(mean, std): the mean
    added to both parts."""
    z = _sample("randn", INDEX, SEED, 4, torch.complex128, 0.0, 1.0)
    assert z.dtype == torch.complex128
    for part in (z.real, z.imag):
        assert abs(part.mean().item()) < 4 * math.sqrt(0.5 / N) and abs(part.var().item() - 0.5) < 0.02
    assert abs(torch.corrcoef(torch.stack([z.real, z.imag]))[0, 1].item()) < 4 / math.sqrt(N)
    u = _sample("rand", INDEX, SEED, 5, torch.complex64, 0.0, 1.0)
    assert u.real.min() >= 0 and u.imag.max() < 1 and abs(u.imag.mean().item() - 0.5) < 0.01
    n = _sample("normal", INDEX, SEED, 6, torch.complex128, 1.0, 2.0)
    assert abs(n.real.mean().item() - 1) < 0.02 and abs(n.imag.mean().item() - 1) < 0.02
    assert abs(n.imag.var().item() - 2.0) < 0.08
    mean = torch.complex(torch.ones(N, dtype=torch.float64), -torch.ones(N, dtype=torch.float64))
    t = _sample("normal_tensor", INDEX, SEED, 7, torch.complex128, mean, 1.0)  # torch.normal(complex mean, std)
    for part, centre in ((t.real, 1.0), (t.imag, -1.0)):
        assert abs(part.mean().item() - centre) < 0.02 and abs(part.var().item() - 0.5) < 0.02


BAD_DRAWS = {  # each refused by eager PyTorch's CPU kernels, whose checks the trace's meta kernels skip
    "bernoulli p > 1": lambda x: torch.bernoulli(x, 1.5),
    "uniform_ from > to": lambda x: torch.empty_like(x).uniform_(2.0, 1.0),
    "uniform_ to infinity": lambda x: torch.empty_like(x).uniform_(0.0, math.inf),
    "randint beyond int8": lambda x: torch.randint(0, 300, x.shape, dtype=torch.int8),
    "randperm beyond float16": lambda x: torch.randperm(3000, dtype=torch.float16),
    "exponential_ of complex": lambda x: torch.empty(x.shape, dtype=torch.complex64).exponential_(),
    "geometric_ p > 1": lambda x: torch.empty_like(x).geometric_(1.5),
    "rand of int64": lambda x: torch.rand(x.shape, dtype=torch.int64),
}


@pytest.mark.parametrize("name", sorted(BAD_DRAWS))
def test_draw_arguments_eager_refuses_are_refused_at_the_line(name):
    """Bad draw arguments (which hpfun's own draws would otherwise turn into numbers silently)
    raise before anything runs, naming the user's line, as eager raises."""
    x = torch.rand(4)
    with pytest.raises(RuntimeError):
        BAD_DRAWS[name](x)
    f = hpfun.shard(BAD_DRAWS[name], mesh=hpfun.Mesh.simulated((2,), ("a",)), in_specs=P("a"))
    with pytest.raises(hpfun.HpfunError, match="test_rng.py"):
        f(x)


def test_setting_torchs_generator_inside_a_drawing_function_is_refused():
    """torch.random.fork_rng (which sets the generator back on leaving) and seeding the generator
    object directly change what eager's later draws are; hpfun's draws are numbered by op and
    cannot follow, so a function that draws is refused, at the fork's line, and torch's generator
    is left as it was. A fork in a function that draws nothing is fine."""
    mesh = hpfun.Mesh.simulated((2,), ("a",))

    def forked(x):
        with torch.random.fork_rng():
            torch.manual_seed(1)
            fixed = torch.rand_like(x)
        return fixed + torch.rand_like(x)

    def reseeded(x):
        torch.default_generator.manual_seed(7)
        return torch.rand_like(x)

    def quiet(x):
        with torch.random.fork_rng():
            return x * 2

    torch.manual_seed(0)
    state = torch.get_rng_state()
    with pytest.raises(hpfun.HpfunError, match=r"set_rng_state at .*test_rng.py:\d+ in forked"):
        hpfun.shard(forked, mesh=mesh, in_specs=P("a"))(torch.zeros(4))
    with pytest.raises(hpfun.HpfunError, match="default_generator"):
        hpfun.shard(reseeded, mesh=mesh, in_specs=P("a"))(torch.zeros(4))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(hpfun.shard(quiet, mesh=mesh, in_specs=P("a"))(torch.ones(4)).full(), torch.full((4,), 2.0))


def test_fallback_does_not_run_a_random_op_without_a_draw():
    """fallback="replicate" would run torch.poisson on every rank with torch's own generator, so
    that a replicated value's copies differ: such an op is refused, fallback or not."""
    f = hpfun.shard(lambda x: torch.poisson(x), mesh=hpfun.Mesh.simulated((2,), ("a",)), in_specs=P("a"),
                    out_specs=P(), fallback="replicate")
    with pytest.raises(hpfun.HpfunError, match="nor can fallback"):
        f(torch.rand(4) * 3)


def test_random_seed_inside_a_sharded_function_is_refused():
    """`with hpfun.random_seed(s):` inside the function would run once, at the trace, and fix
    nothing: refused at its line, pointing outside the call."""
    def f(x):
        with hpfun.random_seed(3):
            return torch.rand_like(x)

    with pytest.raises(hpfun.HpfunError, match=r"random_seed at .*test_rng.py:\d+ in f"):
        hpfun.shard(f, mesh=hpfun.Mesh.simulated((2,), ("a",)), in_specs=P("a"))(torch.zeros(4))


def test_attention_with_dropout_draws_hpfuns_numbers_on_any_device():
    """scaled_dot_product_attention with dropout takes the math path on every device (CUDA's fused
    kernels would draw from torch's generator, a mask per rank): planned on meta tensors, the
    program draws with hpfun's rule, and on the CPU it equals the one-device run bitwise."""
    attend = lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)  # noqa: E731
    f = hpfun.shard(attend, mesh=hpfun.Mesh.simulated((2,), ("dp",)), in_specs=P("dp"), out_specs=P("dp"))
    lowered = f.lower(torch.empty(4, 2, 8, 16, device="meta"))
    targets = [n.target for n in lowered.graph.nodes]
    assert any(t in (_sample, sample) for t in targets)
    assert not any("scaled_dot_product" in str(t) for t in targets)
    q = torch.randn(4, 2, 8, 16)
    one = hpfun.shard(attend, mesh=hpfun.Mesh.simulated((1,), ("dp",)), in_specs=P("dp"), out_specs=P("dp"))
    with hpfun.random_seed(1):
        want = one(q).full()
    with hpfun.random_seed(1):
        assert torch.equal(f(q).full(), want)
