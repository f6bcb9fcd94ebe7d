"""Counter-based random numbers: the same value at each global element for every layout.

Every random op of a sharded program draws from Philox 4x32-10 (Salmon et al., SC11) with
key = the call's 64-bit seed and counter = (global element index, op number): a pure function,
so each rank computes exactly its block of the tensor the unsharded program would draw, on
any mesh, any layout, CPU or CUDA.

The generator is written with int64 torch ops holding 32-bit words. Run eagerly it makes about
a hundred passes over memory, so large draws go through `torch.compile` (see `compiled`):
generator and distribution fuse into one loop writing only the result, bitwise equal to the
eager code, compiled once per process and kind of draw; small draws stay eager.

Seeding: each call of a sharded function that uses random numbers draws its seed from torch's
default generator, so `torch.manual_seed(s)` reproduces a run and successive calls differ;
`with hpfun.random_seed(s):` fixes the seed of the calls inside it.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading

import torch

from hpfun.errors import CaptureError, Problem, SpecError

MASK = 0xFFFFFFFF
M0, M1 = 0xD2511F53, 0xCD9E8D57  # Philox 4x32 multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
COMPILE_ABOVE = 1 << 18  # elements; below this the eager generator is faster than a kernel call


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit words of a * b for a 32-bit constant a and 32-bit words b, in int64."""
    p_lo = a * (b & 0xFFFF)  # < 2^48
    p_hi = a * (b >> 16)  # < 2^48
    t = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2^49
    return (p_hi >> 16) + (t >> 32), t & MASK


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = 10):
    """Philox 4x32 on int64 tensors holding 32-bit words (broadcasting); returns 4 words."""
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        hi0, lo0 = _mulhilo(M0, c0)
        hi1, lo1 = _mulhilo(M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def words(index: torch.Tensor, seed: torch.Tensor, op: int):
    """Four random 32-bit words per element of `index` (global element indices, int64)."""
    k0, k1 = seed[0] & MASK, (seed[0] >> 32) & MASK
    return philox4x32(index & MASK, (index >> 32) & MASK, torch.full_like(index, op), torch.zeros_like(index), k0, k1)


_compiled: dict = {}
_lock = threading.Lock()


def compiled(fn):
    """`fn` as one compiled kernel (shapes dynamic), compiled at first use.

    Callers choose it by the *global* size of a draw (COMPILE_ABOVE), never the local one: the
    compiled transcendental functions may differ from eager ones in the last bit, and every
    layout must take the same path to draw the same values.
    """

    def run(*args):
        with _lock:
            if fn not in _compiled:
                _compiled[fn] = torch.compile(fn, dynamic=True)
        # each kind, dtype and parameter compiles its own kernel: past dynamo's limit of eight
        # it would run the eager code instead, whose normals differ in the last bits
        with torch._dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16):
            return _compiled[fn](*args)

    return run


# ---------------------------------------------------------------------------------------------
# From words to distributions
# ---------------------------------------------------------------------------------------------


def uniform(w, dtype: torch.dtype) -> torch.Tensor:
    """Uniform in [0, 1) with every representable step of `dtype`'s precision, exactly."""
    bits = 1 - round(math.log2(torch.finfo(dtype).eps))
    if bits <= 24:
        return ((w[0] >> (32 - bits)).to(torch.float32) * 2.0**-bits).to(dtype)
    return (((w[0] << 21) | (w[1] >> 11)).to(torch.float64) * 2.0**-53).to(dtype)


def normal(w, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal by Box-Muller on two words (in float64 for float64, else float32)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    u1 = (w[0].to(work) + 1.0) * 2.0**-32  # (0, 1]: log is finite
    u2 = w[1].to(work) * 2.0**-32
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).to(dtype)


def below(w, n: int) -> torch.Tensor:
    """Integers in [0, n): multiply-shift on one word below 2^31 (the product fits in int64),
    else the 64-bit integer of two words modulo n, as torch's generator draws a range of 2^32
    or more. n must be below 2^63."""
    if n < 2**31:
        return (w[0] * n) >> 32
    r = (w[0] << 32) | w[1]  # the 64 bits, read as a signed int64: r + 2^64 where negative
    low = torch.remainder(r, n)
    shifted = low - (n - 2**64 % n)  # (low + 2^64 mod n) mod n, in int64 for n up to 2^63
    return torch.where(r < 0, torch.where(shifted < 0, shifted + n, shifted), low)


def sort_keys(w) -> torch.Tensor:
    """Distinct-with-high-probability int64 keys (for random permutations)."""
    return (w[0] << 31) | (w[1] >> 1)


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------

_fixed = threading.local()


@contextlib.contextmanager
def random_seed(seed: int):
    """Sharded calls inside use `seed` (the same for each call) instead of drawing one.

    >>> import hpfun, torch
    >>> mesh = hpfun.Mesh.simulated((2,), ("dp",))
    >>> f = hpfun.shard(lambda x: torch.rand_like(x), mesh=mesh, in_specs=hpfun.P("dp"))
    >>> with hpfun.random_seed(7):
    ...     a = f(torch.empty(4)).full()
    >>> with hpfun.random_seed(7):
    ...     b = f(torch.empty(4)).full()
    >>> torch.equal(a, b)
    True
    """
    from hpfun.capture import tracing, user_line_past_stdlib  # (capture imports this module)

    if tracing():
        raise CaptureError(Problem(f"hpfun.random_seed{user_line_past_stdlib()}", "is used inside a sharded function, where it would fix nothing "
                                "(the program's seed is chosen when it is called)",
                                "put `with hpfun.random_seed(s):` around the call, or call torch.manual_seed(s) "
                                "inside the function before its first draw"))
    whole = isinstance(seed, numbers.Integral) or isinstance(seed, torch.Tensor) and seed.numel() == 1 and \
        not (seed.is_floating_point() or seed.is_complex())
    if isinstance(seed, bool) or not whole:
        raise SpecError(Problem("random_seed", f"takes an integer seed, got {type(seed).__name__} {seed!r}",
                                "pass an int, e.g. hpfun.random_seed(7)"), headline="bad random seed")
    previous = getattr(_fixed, "seed", None)
    _fixed.seed = int(seed) & (2**63 - 1)
    try:
        yield
    finally:
        _fixed.seed = previous


def draw_seed() -> torch.Tensor:
    """The seed of one call: fixed by `random_seed`, else drawn from torch's default generator."""
    seed = getattr(_fixed, "seed", None)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    return torch.tensor([seed], dtype=torch.int64)
