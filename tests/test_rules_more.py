"""Rules for ops generated programs reached without one (issue 11): full max/min, scans
(cummax, cummin, logcumsumexp), order statistics (kthvalue, median, nanmedian), hypot and
copysign, cdist's backward, diagonal_scatter, prims.copy_strided (index_fill of a transposed
tensor), and F.one_hot captured under torch.func.grad.

Each op runs through `hpfun.shard` on a (2,) and a (2, 2) simulated mesh, in float64, against
the unsharded run: with a split the rule keeps (no collective, the output split or Partial as
the rule's algebra says) and with one that needs a collective (a split of a dim the op works
along, or a Partial input of an op that is not linear).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import hpfun
from hpfun import P
from hpfun.capture import capture

aten = torch.ops.aten
MESHES = [(2,), (2, 2)]
TOL = 1e-12
_GEN = torch.Generator().manual_seed(0)


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float64, generator=_GEN)


def _flat(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _run(fn, args, mesh_shape, in_specs, out_specs=None):
    """`fn` sharded: checks every output against `fn` unsharded; returns the outputs' layouts
    (compact notation) and the kinds of the collectives `lower()` lists."""
    mesh = hpfun.Mesh.simulated(mesh_shape, ("a", "b")[: len(mesh_shape)])
    f = hpfun.shard(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    kinds = [c.kind for c in f.lower(*args).collectives]
    got, want = _flat(f(*args)), _flat(fn(*args))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.full(), w, rtol=TOL, atol=TOL, equal_nan=True)
    return [g.layout.placements_str() for g in got], kinds


def _leading(mesh_shape) -> str:
    """The layout of a value split on dim 0 over "a" and (on a 2-D mesh) on dim 1 over "b"."""
    return "[S(0)]" if len(mesh_shape) == 1 else "[S(0), S(1)]"


def _replicated(mesh_shape) -> str:
    return "[" + ", ".join(["R"] * len(mesh_shape)) + "]"


def _spec(ndim: int, where: dict) -> P:
    """A P spec splitting dim d over mesh axis where[d]."""
    return P(*(where.get(d) for d in range(ndim)))


# ---------------------------------------------------------------------------------------------
# Full reductions: x.max(), x.min() leave Partial(max)/Partial(min) over a split dim
# ---------------------------------------------------------------------------------------------

FULL = {"max": (lambda x: x.max(), "max"), "min": (lambda x: x.min(), "min")}


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name", sorted(FULL))
def test_full_max_min_of_a_split_tensor_is_partial(name, mesh_shape):
    """x.max() of a split x: each rank's max, Partial(max), with no collective; asked for
    replicated, one all-reduce."""
    fn, reduce = FULL[name]
    x = _rand(4, 6, 4)
    spec = P("a") if len(mesh_shape) == 1 else P("a", None, "b")
    layouts, kinds = _run(fn, (x,), mesh_shape, spec)
    assert (layouts, kinds) == ([f"[{', '.join([f'P({reduce})'] * len(mesh_shape))}]"], [])
    layouts, kinds = _run(fn, (x,), mesh_shape, spec, out_specs=P())
    assert kinds == ["all_reduce"] * len(kinds) and kinds


@pytest.mark.parametrize("name", sorted(FULL))
def test_full_max_min_pass_their_own_partial(name):
    """max(Partial(max)) is Partial(max): amax over a split dim feeds x.max() with no collective."""
    fn, reduce = FULL[name]
    before = (lambda x: x.amax(0).max()) if reduce == "max" else (lambda x: x.amin(0).min())
    assert _run(before, (_rand(4, 6),), (2,), P("a")) == ([f"[P({reduce})]"], [])


@pytest.mark.parametrize("name", sorted(FULL))
def test_full_max_min_gradient(name):
    """The gradient of x.max() (ties shared) needs the global max: one all-reduce."""
    fn, _ = FULL[name]
    layouts, kinds = _run(torch.func.grad(fn), (_rand(4, 6),), (2,), P("a"))
    assert layouts == ["[S(0)]"] and "all_reduce" in kinds


# ---------------------------------------------------------------------------------------------
# Scans and order statistics along one dim: that dim whole, the others split
# ---------------------------------------------------------------------------------------------

ALONG = {  # name: (fn of x (4, 6, 4), the dim it works along, whether the output drops it)
    "cummax": (lambda x: tuple(x.cummax(1)), 1, False),
    "cummin": (lambda x: tuple(x.cummin(1)), 1, False),
    "logcumsumexp": (lambda x: x.logcumsumexp(1), 1, False),
    "kthvalue": (lambda x: tuple(x.kthvalue(3, 1)), 1, True),
    "kthvalue_keepdim": (lambda x: tuple(x.kthvalue(3, 1, keepdim=True)), 1, False),
    "kthvalue_last_dim": (lambda x: tuple(x.kthvalue(2)), 2, True),
    "median_dim": (lambda x: tuple(x.median(1)), 1, True),
    "nanmedian_dim": (lambda x: tuple(x.nanmedian(1, keepdim=True)), 1, False),
    "mode": (lambda x: tuple(x.round().mode(1)), 1, True),
    "mode_last_dim_keepdim": (lambda x: tuple(torch.mode(x.round(), keepdim=True)), 2, False),
}


def _other_dims(dim: int) -> list[int]:
    return [d for d in range(3) if d != dim]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name", sorted(ALONG))
def test_ops_along_a_dim_keep_other_splits(name, mesh_shape):
    """Split on dims the op does not work along: values and indices keep the split, no collective."""
    fn, dim, drops = ALONG[name]
    others = _other_dims(dim)
    where = dict(zip(others, ("a", "b")[: len(mesh_shape)]))
    out = [f"S({d - (drops and d > dim)})" for d in where]
    layouts, kinds = _run(fn, (_rand(4, 6, 4),), mesh_shape, _spec(3, where))
    assert kinds == [] and set(layouts) == {f"[{', '.join(out)}]"}


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name", sorted(ALONG))
def test_ops_along_a_split_dim_gather_it(name, mesh_shape):
    """Split along the dim the op works along: gathered first (a collective), values right."""
    fn, dim, _ = ALONG[name]
    where = {dim: "a", **({_other_dims(dim)[0]: "b"} if len(mesh_shape) == 2 else {})}
    _, kinds = _run(fn, (_rand(4, 6, 4),), mesh_shape, _spec(3, where))
    assert kinds


WHOLE = {"median": lambda x: x.median(), "nanmedian": lambda x: x.nanmedian()}


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name", sorted(WHOLE))
def test_median_of_all_elements_needs_them_all(name, mesh_shape):
    """median() of a replicated tensor runs locally; of a split one, gathers it (the median of
    the blocks' medians is not the median)."""
    x = _rand(4, 6)
    assert _run(WHOLE[name], (x,), mesh_shape, P()) == ([_replicated(mesh_shape)], [])
    _, kinds = _run(WHOLE[name], (x,), mesh_shape, P("a") if len(mesh_shape) == 1 else P("a", "b"))
    assert kinds


@pytest.mark.parametrize("name", ["kthvalue", "median_dim", "cummax", "logcumsumexp"])
def test_ops_along_a_dim_gradient(name):
    """Their gradients (scatters along the dim) keep a split of the other dims."""
    fn, dim, _ = ALONG[name]
    loss = lambda x: _flat(fn(x))[0].sum()  # noqa: E731
    where = {_other_dims(dim)[0]: "a"}
    layouts, kinds = _run(torch.func.grad(loss), (_rand(4, 6, 4),), (2,), _spec(3, where))
    assert (layouts, kinds) == ([f"[S({_other_dims(dim)[0]})]"], [])


# ---------------------------------------------------------------------------------------------
# hypot and copysign: pointwise, not linear
# ---------------------------------------------------------------------------------------------

POINTWISE = {
    "hypot": torch.hypot,
    "copysign": torch.copysign,
    "copysign_scalar": lambda x, y: torch.copysign(x, -0.5) * y,
}


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name", sorted(POINTWISE))
def test_hypot_copysign_follow_splits(name, mesh_shape):
    """Both inputs split alike: the output too, no collective; split differently: a collective."""
    fn, x, y = POINTWISE[name], _rand(4, 6), _rand(4, 6)
    same = P("a") if len(mesh_shape) == 1 else P("a", "b")
    assert _run(fn, (x, y), mesh_shape, (same, same)) == ([_leading(mesh_shape)], [])
    other = P(None, "a") if len(mesh_shape) == 1 else P("b", "a")
    _, kinds = _run(fn, (x, y), mesh_shape, (same, other))
    assert kinds


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name", sorted(POINTWISE))
def test_hypot_copysign_reduce_a_partial_input_first(name, mesh_shape):
    """hypot(a1 + a2, y) != hypot(a1, y) + hypot(a2, y): a Partial(sum) input (a matmul over a
    split contraction) is all-reduced before the op."""
    fn = POINTWISE[name]
    a, b, y = _rand(4, 6), _rand(6, 4), _rand(4, 4)
    specs = (P(None, "a"), P("a", None), P()) if len(mesh_shape) == 1 else (P("b", "a"), P("a", None), P("b"))
    _, kinds = _run(lambda a, b, y: fn(a @ b, y), (a, b, y), mesh_shape, specs)
    assert "all_reduce" in kinds


# ---------------------------------------------------------------------------------------------
# cdist's backward: rows and columns (m) split; a split r leaves Partial(sum)
# ---------------------------------------------------------------------------------------------

NORMS = [1.0, 2.0, 3.0, math.inf]


@pytest.mark.parametrize("p", NORMS, ids=str)
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_cdist_backward_keeps_rows_and_sums_split_r(p, mesh_shape):
    """grad of cdist: x1's rows split give grad_x1 split and grad_x2 Partial(sum) (a sum over
    x1's rows), with no collective; x1's columns split need the forward's gather."""
    x1, x2 = _rand(2, 8, 4), _rand(2, 6, 4)
    fn = torch.func.grad(lambda a, b: torch.cdist(a, b, p=p).sum(), argnums=(0, 1))
    if len(mesh_shape) == 1:
        specs, want = (P(None, "a"), P()), ["[S(1)]", "[P(sum)]"]
    else:
        specs, want = (P("a", "b"), P("a")), ["[S(0), S(1)]", "[S(0), P(sum)]"]
    assert _run(fn, (x1, x2), mesh_shape, specs) == (want, [])
    _, kinds = _run(fn, (x1, x2), mesh_shape, (P(None, None, "a"), P()))
    assert kinds


@pytest.mark.parametrize("p", NORMS, ids=str)
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_cdist_backward_op_splits_m(p, mesh_shape):
    """_cdist_backward itself: column m of grad_x1 reads column m of x1 and x2 and the whole
    distances, so m stays split; x2's rows (r) split leave Partial(sum); a split contracted
    dim of the forward's layout elsewhere needs a collective."""
    x1, x2, g = _rand(8, 4), _rand(6, 4), _rand(8, 6)
    d = torch.cdist(x1, x2, p=p)

    def fn(g, x1, x2, d):
        return aten._cdist_backward.default(g, x1, x2, p, d)

    args = (g, x1, x2, d)
    if len(mesh_shape) == 1:
        assert _run(fn, args, mesh_shape, (P(), P(None, "a"), P(None, "a"), P())) == (["[S(1)]"], [])
        assert _run(fn, args, mesh_shape, (P(None, "a"), P(), P("a"), P(None, "a"))) == (["[P(sum)]"], [])
    else:
        specs = (P("b"), P("b", "a"), P(None, "a"), P("b"))
        assert _run(fn, args, mesh_shape, specs) == (["[S(1), S(0)]"], [])
        specs = (P("b", "a"), P("b"), P("a"), P("b", "a"))
        assert _run(fn, args, mesh_shape, specs) == (["[P(sum), S(0)]"], [])
    # grad split on r but x2 split on m: the two must agree, so something moves
    _, kinds = _run(fn, args, mesh_shape, (P(None, "a"), P(), P(None, "a"), P()))
    assert kinds


def test_cdist_backward_passes_a_partial_grad():
    """_cdist_backward is linear in grad: a Partial(sum) grad (a matmul over a split
    contraction) passes, the output Partial(sum), no collective; a Partial x1 does not (its
    terms are reduced, or the matmul's factors gathered, first)."""
    x1, x2, u, v = _rand(8, 4), _rand(6, 4), _rand(8, 4), _rand(4, 6)
    d = torch.cdist(x1, x2)

    def via_grad(u, v, x1, x2, d):
        return aten._cdist_backward.default(u @ v, x1, x2, 2.0, d)

    specs = (P(None, "a"), P("a"), P(), P(), P())
    assert _run(via_grad, (u, v, x1, x2, d), (2,), specs) == (["[P(sum)]"], [])

    def via_x1(u, v, x1, x2, d):
        return aten._cdist_backward.default(x1, u @ v[:, :4], x2, 2.0, d)

    _, kinds = _run(via_x1, (u, v, _rand(8, 6), x2, d), (2,), specs)
    assert kinds


# ---------------------------------------------------------------------------------------------
# diagonal_scatter: the backward of diagonal and einsum("ii->i")
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_diagonal_scatter_keeps_other_dims_split(mesh_shape):
    """diagonal_scatter over dims (0, 2) of a 4-D x: dims 1 and 3 split like src's dims 0 and 1,
    no collective; dim 0 split needs a gather."""
    x, src = _rand(6, 4, 6, 4), _rand(4, 4, 5)

    def fn(x, src):
        return aten.diagonal_scatter.default(x, src, 1, 0, 2)

    if len(mesh_shape) == 1:
        specs, want = (P(None, None, None, "a"), P(None, "a")), "[S(3)]"
    else:
        specs, want = (P(None, "a", None, "b"), P("a", "b")), "[S(1), S(3)]"
    assert _run(fn, (x, src), mesh_shape, specs) == ([want], [])
    _, kinds = _run(fn, (x, src), mesh_shape, (P("a"), P(None, "a")))
    assert kinds


def test_diagonal_scatter_passes_partial():
    """x and src Partial together give Partial: a slice of a sum is the sum of slices."""
    a, w, v = _rand(6, 4), _rand(4, 6), _rand(4)

    def fn(a, w, v):
        return aten.diagonal_scatter.default(a @ w, a @ v)

    assert _run(fn, (a, w, v), (2,), (P(None, "a"), P("a"), P("a"))) == (["[P(sum)]"], [])


GRADS_OF_DIAGONALS = {
    "diagonal": (lambda x, w: (x.diagonal(0, 1, 2) ** 2 * w).sum(), (4, 6, 6), (4, 6)),
    "einsum_ii": (lambda x, w: (torch.einsum("bii->bi", x) ** 2 * w).sum(), (4, 6, 6), (4, 6)),
}


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name", sorted(GRADS_OF_DIAGONALS))
def test_gradients_of_diagonals(name, mesh_shape):
    """Gradients of diagonal, einsum("bii->bi") and trace keep a batch split (no collective);
    split along the diagonal's dims, they gather."""
    loss, xs, ws = GRADS_OF_DIAGONALS[name]
    fn, x, w = torch.func.grad(loss), _rand(*xs), _rand(*ws)
    batch = (P("a"), P("a")) if len(mesh_shape) == 1 else (P(("a", "b")), P(("a", "b")))
    layouts, kinds = _run(fn, (x, w), mesh_shape, batch)
    assert kinds == [] and layouts == ["[" + ", ".join(["S(0)"] * len(mesh_shape)) + "]"]
    _, kinds = _run(fn, (x, w), mesh_shape, (P(None, "a"), P()))
    assert kinds


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_gradient_of_trace(mesh_shape):
    """trace's gradient (an index_put on the diagonal, not diagonal_scatter): replicated runs
    locally, a split x gathers for the trace."""
    fn, x = torch.func.grad(lambda x: x.trace() ** 2), _rand(6, 6)
    assert _run(fn, (x,), mesh_shape, P()) == ([_replicated(mesh_shape)], [])
    _, kinds = _run(fn, (x,), mesh_shape, P("a"))
    assert kinds


def test_gradients_of_diagonals_reach_diagonal_scatter():
    """What the tests above exercise: diagonal's and einsum's backward is diagonal_scatter."""
    for name in ("diagonal", "einsum_ii"):
        loss, xs, ws = GRADS_OF_DIAGONALS[name]
        gm = capture(lambda x, w: [torch.func.grad(loss)(x, w)], [(xs, torch.float64), (ws, torch.float64)])
        assert aten.diagonal_scatter.default in {n.target for n in gm.graph.nodes}, name


# ---------------------------------------------------------------------------------------------
# prims.copy_strided: index_fill of a non-contiguous tensor keeps its strides
# ---------------------------------------------------------------------------------------------


def _index_fill_transposed(x):
    return x.t().index_fill(1, torch.tensor([0, 2]), 1.5)


def test_index_fill_of_a_transposed_tensor_reaches_copy_strided():
    """What the next test exercises: torch's index_fill restores the input's strides so."""
    gm = capture(lambda x: [_index_fill_transposed(x)], [((4, 6), torch.float64)])
    assert torch.ops.prims.copy_strided.default in {n.target for n in gm.graph.nodes}


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_copy_strided_keeps_the_split(mesh_shape):
    """index_fill along the transposed tensor's dim 1 keeps its dim 0 split through copy_strided
    (the global strides, on a block, address each element once); gathered on request."""
    x = _rand(4, 6)
    spec = P(None, "a") if len(mesh_shape) == 1 else P("b", "a")
    assert _run(_index_fill_transposed, (x,), mesh_shape, spec) == ([_leading(mesh_shape)], [])
    _, kinds = _run(_index_fill_transposed, (x,), mesh_shape, spec, out_specs=P())
    assert kinds


def test_copy_strided_passes_partial():
    """copy_strided moves data: a Partial(sum) input passes (the program has no collective)."""
    a, b = _rand(6, 4), _rand(4, 6)
    fn = lambda a, b: torch.ops.prims.copy_strided.default(a @ b, [1, 6])  # noqa: E731
    assert _run(fn, (a, b), (2,), (P(None, "a"), P("a"))) == (["[P(sum)]"], [])


# ---------------------------------------------------------------------------------------------
# F.one_hot
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_one_hot_with_num_classes(mesh_shape):
    """F.one_hot(y, n): split ids give split rows, no collective; gathered on request."""
    y = torch.randint(0, 5, (4, 6), generator=_GEN)
    spec = P("a") if len(mesh_shape) == 1 else P("a", "b")
    fn = lambda y: F.one_hot(y, 5)  # noqa: E731
    assert _run(fn, (y,), mesh_shape, spec) == ([_leading(mesh_shape)], [])
    _, kinds = _run(fn, (y,), mesh_shape, spec, out_specs=P())
    assert kinds


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_one_hot_under_grad(mesh_shape):
    """Under torch.func.grad torch's kernel reads the ids (`.item()`); captured as the
    comparison, the gradient keeps the batch split."""
    w, y = _rand(4, 6, 5), torch.randint(0, 5, (4, 6), generator=_GEN)
    spec = P("a") if len(mesh_shape) == 1 else P("a", "b")
    layouts, kinds = _run(torch.func.grad(lambda w, y: (F.one_hot(y, 5).to(w.dtype) * w).sum()), (w, y),
                          mesh_shape, (spec, spec))
    assert (layouts, kinds) == ([_leading(mesh_shape)], [])


@pytest.mark.parametrize("spec", [P(), P("a")], ids=str)
def test_one_hot_of_a_class_out_of_range_raises_as_eager_raises(spec):
    """A class id >= num_classes or negative: eager's kernel raises; the comparison hpfun
    captures gave a row of zeros, silently. Each rank checks its own ids (no collective)."""
    mesh = hpfun.Mesh.simulated((2,), ("a",))
    f = hpfun.shard(lambda y: F.one_hot(y, 4), mesh=mesh, in_specs=spec, out_specs=spec)
    assert not f.lower(torch.tensor([0, 1, 2, 3])).collectives
    for ids in ([0, 1, 4, 3], [0, -1, 2, 3]):
        with pytest.raises(RuntimeError, match="Class values must be"):
            F.one_hot(torch.tensor(ids), 4)
        with pytest.raises(hpfun.ExecutionError, match="Class values must be(.|\n)*raises on these values too"):
            f(torch.tensor(ids))
    assert torch.equal(f(torch.tensor([3, 1, 0, 2])).full(), F.one_hot(torch.tensor([3, 1, 0, 2]), 4))


def test_one_hot_without_num_classes_reads_the_arguments_or_is_a_clear_error():
    """Without num_classes the class count is read from the data: from an argument's values it is
    read, as eager reads it, and checked at every call (a batch with another largest class runs
    its own program); from values the program computes (a parameter's), an error saying so, and
    the fix."""
    mesh = hpfun.Mesh.simulated((2,), ("a",))
    f = hpfun.shard(lambda y: F.one_hot(y), mesh=mesh, in_specs=P("a"), out_specs=P("a"))
    for ids in ([0, 1, 2, 3], [0, 1, 1, 0], [0, 1, 2, 3]):
        ids = torch.tensor(ids)
        assert torch.equal(f(ids).full(), F.one_hot(ids))
    assert f.trace_count == 2
    w = torch.ones(4, requires_grad=True)
    g = hpfun.shard(lambda y: F.one_hot(y * w.long()), mesh=mesh, in_specs=P("a"))
    with pytest.raises(hpfun.CaptureError, match=r"F.one_hot without num_classes at .*test_rules_more.py:\d+.*pass num_classes="):
        g(torch.tensor([0, 1, 2, 3]))


def test_bincount_reads_its_length_from_the_arguments_or_is_a_clear_error():
    """torch.bincount (class counts for a balanced loss) is the scatter-add it computes, over the
    split labels: counts, and weighted counts under grad, equal eager's. Its length is read from
    the labels' values at every call: within minlength it stays the same (one program); past it,
    or without minlength, a new largest label compiles again. From computed values: the fix."""
    mesh = hpfun.Mesh.simulated((2,), ("a",))
    f = hpfun.shard(lambda y: torch.bincount(y, minlength=5), mesh=mesh, in_specs=P("a"), out_specs=P())
    for ids in ([0, 1, 1, 3], [4, 4, 0, 2], [0, 0, 0, 0], [1, 6, 2, 0]):
        ids = torch.tensor(ids)
        out = f(ids).full()
        assert torch.equal(out, torch.bincount(ids, minlength=5)) and out.dtype == torch.int64
    assert f.trace_count == 2  # the last batch's label 6 is past minlength

    def balanced(w, x, y):  # class weights from the batch's own counts
        counts = torch.bincount(y, weights=torch.ones_like(y, dtype=w.dtype), minlength=3)
        return F.cross_entropy(x @ w, y, weight=counts.sum() / (counts + 1))

    w, x, y = _rand(4, 3), _rand(8, 4), torch.tensor([0, 1, 1, 2, 2, 2, 0, 1])
    g = hpfun.shard(torch.func.grad_and_value(balanced), mesh=mesh, in_specs=(P(), P("a"), P("a")),
                    out_specs=(P(), P()))
    grad, loss = g(w, x, y)
    want_grad, want_loss = torch.func.grad_and_value(balanced)(w, x, y)
    torch.testing.assert_close(loss.full(), want_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad.full(), want_grad, rtol=1e-12, atol=0)
    h = hpfun.shard(lambda x: torch.bincount(torch.rand_like(x).argmax(-1)), mesh=mesh, in_specs=P("a"))  # drawn
    with pytest.raises(hpfun.CaptureError, match=r"torch.bincount at .*test_rules_more.py:\d+.*F.one_hot\(values, num_classes\)"):
        h(_rand(8, 4))


@pytest.mark.parametrize("spec", [P("a"), P(None, "a")], ids=str)
def test_cov_corrcoef_and_triangle_indices_equal_eager(spec):
    """torch.cov and torch.corrcoef (whose kernels read values to check weights), over variables
    or observations split, and under grad; tril_indices/triu_indices (factories) index a split
    value. Weighted cov stays a read, refused as one."""
    mesh = hpfun.Mesh.simulated((2,), ("a",))
    x = _rand(4, 8)
    fns = {"cov": torch.cov, "cov0": lambda x: torch.cov(x, correction=0), "corrcoef": torch.corrcoef,
           "one variable": lambda x: torch.cov(x[0]) + torch.corrcoef(x[1]),
           "tril": lambda x: x[tuple(torch.tril_indices(4, 8, 1))], "triu": lambda x: x[tuple(torch.triu_indices(4, 8))],
           "grad": torch.func.grad(lambda x: (torch.corrcoef(x) * torch.cov(x)).sum())}
    for name, fn in fns.items():
        got = hpfun.shard(fn, mesh=mesh, in_specs=spec, out_specs=P())(x).full()
        torch.testing.assert_close(got, fn(x), rtol=1e-12, atol=1e-14, msg=name)
    weighted = hpfun.shard(lambda x: torch.cov(x, fweights=torch.ones(8, dtype=torch.int64)), mesh=mesh, in_specs=spec)
    with pytest.raises(hpfun.CaptureError, match="reads tensor values"):
        weighted(x)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_histc_over_a_fixed_range_adds_blocks_over_the_datas_range_gathers(mesh_shape):
    """histc (a mixture of experts' tokens per expert) over a fixed range: each block's
    histogram, summed (one all-reduce). Over the data's own range (min == max) a block's
    range would be its own: the input is gathered first. Both equal the unsharded histogram."""
    mesh = hpfun.Mesh.simulated(mesh_shape, ("a", "b")[:len(mesh_shape)])
    x = _rand(8, 6)
    spec = P(*mesh.axis_names)
    for kwargs, kind in (({"bins": 7, "min": -2, "max": 2}, "all_reduce"), ({"bins": 7}, "all_gather")):
        f = hpfun.shard(lambda x: torch.histc(x, **kwargs), mesh=mesh, in_specs=spec, out_specs=P())
        assert torch.equal(f(x).full(), torch.histc(x, **kwargs))
        assert {c.kind for c in f.lower(x).collectives} == {kind}


def _gaussian_nll(L_raw, x):
    """A batch of Gaussians' negative log-likelihoods, each with its own covariance: cholesky,
    cholesky_solve and slogdet over a batch of matrices, and inv and solve."""
    cov = L_raw @ L_raw.mT + 4 * torch.eye(L_raw.shape[-1], dtype=L_raw.dtype)
    chol = torch.linalg.cholesky(cov)
    alpha = torch.cholesky_solve(x.unsqueeze(-1), chol).squeeze(-1)
    logdet = torch.linalg.slogdet(cov).logabsdet
    extra = torch.linalg.solve(cov, x).square().sum(-1) + torch.linalg.inv(cov).diagonal(dim1=-2, dim2=-1).sum(-1)
    return (0.5 * (x * alpha).sum(-1) + 0.5 * logdet + extra).mean()


def test_batched_linear_algebra_splits_the_batch():
    """Each matrix of a batch is factorized, inverted and solved on its own: the batch split on
    dp stays split through cholesky, cholesky_solve, slogdet, solve and inv, forward and
    backward (no matrix is gathered: only the factorizations' error codes, so that every rank
    raises alike), equal to the unsharded gradient."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    L_raw, x = _rand(8, 4, 4), _rand(8, 4)
    f = hpfun.shard(torch.func.grad_and_value(_gaussian_nll), mesh=mesh, in_specs=(P("dp"), P("dp")),
                    out_specs=(P("dp"), P()))
    (grad, loss), (ref_grad, ref_loss) = f(L_raw, x), torch.func.grad_and_value(_gaussian_nll)(L_raw, x)
    assert torch.allclose(grad.full(), ref_grad, rtol=0, atol=TOL) and abs(loss.full() - ref_loss) < TOL
    gathered = [c for c in f.lower(L_raw, x).collectives if c.kind in ("all_gather", "all_to_all")]
    assert gathered and all(c.op == "aten._linalg_check_errors.default" and c.dtype == "int32" for c in gathered)


def test_greedy_decoding_over_a_vocabulary_split_head_gathers_winners_not_logits():
    """argmax / max over a split vocabulary: each rank's winner (value and global index) is
    gathered, B x tp pairs, where the whole logits were (B x V); equal to eager, ties and NaN
    included (the first index wins, a NaN is the max)."""
    mesh = hpfun.Mesh.simulated((2,), ("tp",))
    h, w = torch.randn(8, 16, dtype=torch.float64), torch.randn(4096, 16, dtype=torch.float64)
    for fn in (lambda h, w: (h @ w.t()).argmax(-1), lambda h, w: (h @ w.t()).round().max(-1)):
        f = hpfun.shard(fn, mesh=mesh, in_specs=(P(), P("tp")), out_specs=P())
        got, want = f(h, w), fn(h, w)
        for g, e in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(g.full(), e)
        moved = f.lower(h, w).collectives
        assert [c.kind for c in moved] == ["all_gather"] * 2 and sum(c.bytes for c in moved) == 8 * 2 * (8 + 8) // 2
    x = torch.randn(4, 8, dtype=torch.float64)
    x[1, 5] = x[2, 2] = x[2, 6] = float("nan")
    x[3] = 1.0
    f = hpfun.shard(lambda x: x.argmax(1), mesh=mesh, in_specs=P(None, "tp"), out_specs=P())
    assert torch.equal(f(x).full(), x.argmax(1))


# ---------------------------------------------------------------------------------------------
# Shifts by a Python number, by a tensor, of a number by a tensor (x << 2, x >> 1)
# ---------------------------------------------------------------------------------------------

SHIFTS = {
    "x << 2": lambda x, y: x << 2,
    "x >> 1": lambda x, y: x >> 1,
    "x << y": lambda x, y: x << y,
    "x >> y": lambda x, y: x >> y,
    "bitwise_left_shift(x, 3)": lambda x, y: torch.bitwise_left_shift(x, 3),
    "bitwise_right_shift(x, 1)": lambda x, y: torch.bitwise_right_shift(x, 1),
    "bitwise_left_shift(2, y)": lambda x, y: torch.bitwise_left_shift(2, y),
    "bitwise_right_shift(1024, y)": lambda x, y: torch.bitwise_right_shift(1024, y),
}


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
@pytest.mark.parametrize("name", sorted(SHIFTS))
def test_shifts_follow_splits(name, mesh_shape):
    """Elementwise on integers: split alike, the output follows with no collective; exact."""
    x = torch.randint(-100, 100, (4, 6), generator=_GEN)
    y = torch.randint(0, 5, (4, 6), generator=_GEN)
    same = P("a") if len(mesh_shape) == 1 else P("a", "b")
    assert _run(SHIFTS[name], (x, y), mesh_shape, (same, same)) == ([_leading(mesh_shape)], [])


@pytest.mark.parametrize("parts", ["one", "empty cache first", "legacy empty", "two"])
def test_a_cat_of_one_tensor_along_its_split_dim_is_a_copy(parts):
    """cat([x], 0) (einops.pack of one tensor) and cat([cache with no rows, x], 0) (a cache that
    starts empty) copy x: split along the cat dim, it stays split, forward and backward, moving
    no bytes (the batch was gathered whole, and every rank ran what followed on all of it).
    Two inputs with rows still gather."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))

    def f(x):
        others = {"one": [], "empty cache first": [x[:0] * 3], "legacy empty": [torch.zeros(0, dtype=x.dtype)],
                  "two": [x[:2]]}[parts]
        y = torch.cat([*others, x * 2], 0)
        return (y @ y.transpose(1, 2)).sum(-1)

    x = _rand(8, 4, 3)
    g = hpfun.shard(torch.func.grad(lambda x: f(x).pow(2).sum()), mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    torch.testing.assert_close(g(x).full(), torch.func.grad(lambda x: f(x).pow(2).sum())(x), rtol=TOL, atol=TOL)
    if parts == "two":
        return
    s = hpfun.shard(f, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    assert s.lower(x).collectives == [] and all(c.bytes == 0 for c in g.lower(x).collectives)  # (the empty
    torch.testing.assert_close(s(x).full(), f(x), rtol=TOL, atol=TOL)  # slice's backward writes no rows, gathered)


@pytest.mark.parametrize("name", ["slice grad", "narrow grad", "split one piece", "split_with_sizes one piece"])
def test_a_whole_slice_or_one_piece_split_keeps_its_dim_split_backward_too(name):
    """The gradient of x[0:n] (a slice_scatter of the whole dim) and a split into one piece
    (einops.unpack of one tensor: x.split(n), x.split([n])) copy each block: the dim stays split
    with no collective (both gathered the whole tensor), and equal eager."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    fn = {"slice grad": torch.func.grad(lambda x: (x[0:8] ** 2).sum()),
          "narrow grad": torch.func.grad(lambda x: (x.narrow(0, 0, 8) ** 2).sum()),
          "split one piece": lambda x: x.split(8)[0] * 2,
          "split_with_sizes one piece": lambda x: x.split([8])[0] * 2}[name]
    x = _rand(8, 6)
    f = hpfun.shard(fn, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    assert f.lower(x).collectives == []
    torch.testing.assert_close(f(x).full(), fn(x), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name,rows", [("cls token", 1), ("last token", 1), ("narrow", 2), ("strided slice", 2)])
@pytest.mark.parametrize("mesh_shape,spec", [((2,), P(None, "dp")), ((2, 2), P(None, ("dp", "tp")))])
def test_a_few_rows_of_a_split_dim_move_only_those_rows(name, rows, mesh_shape, spec):
    """select, narrow and slice along a split dim (BERT's CLS pooling or a last-token head under
    sequence parallelism): each rank picks the rows its block holds and writes 0 for the others,
    so the result is their sum: one all-reduce of the picked rows at the pick, not an all-gather
    of the whole sequence; forward and backward equal eager, integers exactly."""
    mesh = hpfun.Mesh.simulated(mesh_shape, ("dp", "tp")[: len(mesh_shape)])
    pick = {"cls token": lambda h: h[:, 0], "last token": lambda h: h[:, -1],
            "narrow": lambda h: h.narrow(1, 3, 2), "strided slice": lambda h: h[:, 1::5]}[name]
    h, w = _rand(2, 8, 4), _rand(4, 3)
    fn = lambda h, w: pick(h) @ w  # noqa: E731
    f = hpfun.shard(fn, mesh=mesh, in_specs=(spec, P()), out_specs=P())
    moved = f.lower(h, w).collectives
    assert [c.kind for c in moved] == ["all_reduce"] and moved[0].bytes == 2 * rows * 4 * 8
    torch.testing.assert_close(f(h, w).full(), fn(h, w), rtol=TOL, atol=TOL)
    g = torch.func.grad(lambda h, w: fn(h, w).square().sum(), argnums=(0, 1))
    sg = hpfun.shard(g, mesh=mesh, in_specs=(spec, P()), out_specs=(spec, P()))
    for got, want in zip(sg(h, w), g(h, w), strict=True):
        torch.testing.assert_close(got.full(), want, rtol=TOL, atol=TOL)
    ids = torch.arange(16).reshape(2, 8)
    s = hpfun.shard(pick, mesh=mesh, in_specs=spec, out_specs=P())
    assert torch.equal(s(ids).full(), pick(ids))


def test_an_async_assert_checks_the_whole_condition_on_every_rank():
    """torch._assert_async (kornia's focal loss checks its labels so) on a condition of split
    labels: the condition is made whole and every rank checks it; a false one raises at its line."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))

    def f(logits, y):
        torch._assert_async(y.min() >= 0, "Class values must be non-negative.")
        torch._assert_async(y.max() < 4)
        return F.cross_entropy(logits, y)

    logits, y = _rand(8, 4), torch.tensor([0, 1, 2, 3, 3, 2, 1, 0])
    g = hpfun.shard(f, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P())
    torch.testing.assert_close(g(logits, y).full(), f(logits, y), rtol=TOL, atol=TOL)
    with pytest.raises(hpfun.ExecutionError, match="non-negative"):
        g(logits, torch.tensor([0, 1, 2, 3, 3, 2, 1, -1]))
    bare = hpfun.shard(lambda y: torch._assert_async(y.max() < 4) or y.sum(), mesh=mesh, in_specs=P("dp"), out_specs=P())
    assert int(bare(y)) == int(y.sum())
    with pytest.raises(hpfun.ExecutionError):  # (the form without a message was dropped as dead code: it ran on)
        bare(torch.tensor([0, 1, 2, 3, 3, 2, 1, 9]))


def test_picked_rows_keep_the_sign_of_zero_and_a_slice_of_most_of_the_dim_is_gathered():
    """A pick along a split dim (select, gather, an embedding of a vocabulary-split table) fills
    the other ranks' rows with -0.0, so the sum over ranks is the value itself: 1 / x[:, 0] of a
    -0.0 is -inf, as eager (+0.0 made it +inf). A picked row is summed at the pick, so a sign
    change or a factor of inf after it is exact too (a pending sum gave 1 / -x[:, 0] of +0.0 as
    +inf, the other ranks' -0.0 negated, and x[:, 0] * inf NaN). A slice of most of the dim (the
    label shift `lg[:, :-1]` of sequence parallelism) is gathered, not all-reduced at full size."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    x = torch.tensor([[-0.0, 1.0, 2.0, 3.0], [0.0, -1.0, -0.0, 4.0]], dtype=torch.float64).repeat(1, 2)
    ids = torch.tensor([[2, 0], [6, 5]])
    cases = {"select": (lambda x: 1 / x[:, 0], P(None, "dp")),
             "gather": (lambda x: 1 / torch.gather(x, 1, ids), P(None, "dp")),
             "embedding": (lambda x: 1 / F.embedding(ids[0], x.t()), P(None, "dp")),
             "negated": (lambda x: 1 / -x[:, 4], P(None, "dp")),
             "scaled": (lambda x: 1 / (x[:, 4] * -2.0), P(None, "dp")),
             "times inf": (lambda x: x[:, 1] * torch.tensor([math.inf, -math.inf], dtype=torch.float64), P(None, "dp"))}
    for name, (fn, spec) in cases.items():
        got = hpfun.shard(fn, mesh=mesh, in_specs=spec, out_specs=P())(x).full()
        assert torch.equal(got, fn(x)), name
    lg = _rand(2, 16, 8)
    shift = hpfun.shard(lambda lg: lg[:, :-1].exp().sum(), mesh=mesh, in_specs=P(None, "dp"), out_specs=P())
    assert all(c.kind != "all_reduce" or c.bytes <= 8 for c in shift.lower(lg).collectives)
    torch.testing.assert_close(shift(lg).full(), lg[:, :-1].exp().sum(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_sorted_lookups_and_unfold_keep_the_splits_they_can(mesh_shape):
    """bucketize and searchsorted are elementwise in the values looked up: their split dims pass
    with the sorted table read whole (a batched table split along its rows with them);
    Tensor.unfold keeps every dim but the windowed one split, and that one too where the
    windows tile each block (patches). Each gathered the whole input; forward and backward equal
    eager, the lookups exactly."""
    names = ("dp", "tp")[: len(mesh_shape)]
    mesh = hpfun.Mesh.simulated(mesh_shape, names)
    x, bounds = _rand(8, 12), torch.linspace(-1, 1, 5, dtype=torch.float64)
    rows = torch.sort(_rand(8, 5), -1).values
    split = P(names) if len(names) > 1 else P("dp")
    cases = [(lambda x, b: torch.bucketize(x, b, right=True), (x, bounds), (split, P())),
             (lambda b, x: torch.searchsorted(b, x), (bounds, x), (P(), P(None, names[-1]))),
             (lambda s, x: torch.searchsorted(s, x, out_int32=True), (rows, x), (split, split))]
    for fn, args, specs in cases:
        f = hpfun.shard(fn, mesh=mesh, in_specs=specs, out_specs=None)
        assert f.lower(*args).collectives == [] and torch.equal(f(*args).full(), fn(*args))
    for unfold, spec in [(lambda x: x.unfold(1, 4, 2), split), (lambda x: x.unfold(0, 2, 2), split)]:
        fn = lambda x: unfold(x).sin()  # noqa: E731
        f = hpfun.shard(fn, mesh=mesh, in_specs=spec, out_specs=None)
        assert f.lower(x).collectives == []
        torch.testing.assert_close(f(x).full(), fn(x), rtol=TOL, atol=TOL)
        g = torch.func.grad(lambda x: fn(x).square().sum())  # noqa: B023
        torch.testing.assert_close(hpfun.shard(g, mesh=mesh, in_specs=spec, out_specs=spec)(x).full(), g(x),
                                   rtol=TOL, atol=TOL)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_a_strided_slice_whose_step_tiles_each_block_keeps_the_split(mesh_shape):
    """x[::2] and x[1::2] of a split dim whose blocks the step tiles (even and odd positions, as
    rotary embeddings and polyphase filters take them): each block's own rows, with no
    collective forward or backward (the forward gathered x, the backward its gradient). A step
    that does not tile the blocks still equals eager."""
    names = ("dp", "tp")[: len(mesh_shape)]
    mesh = hpfun.Mesh.simulated(mesh_shape, names)
    spec = P(names)
    x = _rand(16, 4)
    for sl, free in ((slice(None, None, 2), True), (slice(1, None, 2), True), (slice(1, 16, 4), True),
                     (slice(2, None, 2), False), (slice(0, None, 3), False)):
        fn = lambda x: x[sl].exp()  # noqa: E731,B023
        g = torch.func.grad(lambda x: fn(x).square().sum())  # noqa: B023
        f, sg = (hpfun.shard(h, mesh=mesh, in_specs=spec, out_specs=None) for h in (fn, g))
        if free:
            assert f.lower(x).collectives == [] and sg.lower(x).collectives == [], sl
        torch.testing.assert_close(f(x).full(), fn(x), rtol=TOL, atol=TOL)
        torch.testing.assert_close(sg(x).full(), g(x), rtol=TOL, atol=TOL)


def test_index_add_of_a_zero_dim_index_runs_as_eager():
    """x.index_add(dim, i, source) with a 0-d index (one row, as eager takes it), in or out of
    place, keywords too: torch's decomposition made it an index_put whose value did not fit the
    row, and every rank's program failed."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    x, i = _rand(8, 6), torch.tensor(3)
    cases = [lambda x: x.index_add(0, i, torch.ones(1, 6, dtype=torch.float64)),
             lambda x: x.clone().index_add_(1, i, torch.ones(8, 1, dtype=torch.float64), alpha=3),
             lambda x: torch.index_add(x, dim=0, index=i, source=torch.ones(1, 6, dtype=torch.float64))]
    for fn in cases:
        for spec in (P("dp"), P(None, "dp")):
            got = hpfun.shard(fn, mesh=mesh, in_specs=spec, out_specs=P())(x).full()
            torch.testing.assert_close(got, fn(x), rtol=TOL, atol=TOL)
    zero_d = lambda x: x.index_add(0, i, torch.tensor(0.7, dtype=torch.float64))  # noqa: E731
    with pytest.raises(RuntimeError, match="source tensor shape must match"):  # (a 0-d source: eager refuses it,
        zero_d(x)  # and the sharded run broadcast it over the row)
    with pytest.raises(hpfun.CaptureError, match="source tensor shape must match"):
        hpfun.shard(zero_d, mesh=mesh, in_specs=P(None, "dp"), out_specs=P())(x)


def test_index_reduce_and_put_run_as_eager_and_index_reduce_keeps_the_split():
    """index_reduce (in place too, and amax's gradient) and put had no rule, so a step using
    them was refused. index_reduce keeps self's split, along the reduced dim too (masked rows,
    no collective); put runs whole (its indices name elements of the flattened tensor)."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    x, i, src = _rand(8, 6), torch.tensor([0, 3, 5, 7, 3]), _rand(5, 6)

    def amax_grad(x):
        return torch.func.grad(lambda x: x.index_reduce(0, i, src, "amax").square().sum())(x)

    cases = [(lambda x: x.index_reduce(0, i, src, "prod"), True),
             (lambda x: x.clone().index_reduce_(0, i, src, "mean", include_self=False), True),
             (amax_grad, False),
             (lambda x: x.put(torch.tensor([1, 40, 1]), torch.tensor([9.0, 8.0, 1.0], dtype=torch.float64),
                              accumulate=True), False)]
    for fn, free in cases:
        for spec in (P("dp"), P(None, "dp")):
            f = hpfun.shard(fn, mesh=mesh, in_specs=spec, out_specs=spec)
            torch.testing.assert_close(f(x).full(), fn(x), rtol=TOL, atol=TOL)
            if free:
                assert f.lower(x).collectives == [], f.lower(x)


def test_any_and_all_over_a_split_dim_all_reduce_the_blocks_booleans():
    """any (and all, which torch writes as any) over a split dim is the max of the blocks'
    booleans: one all-reduce of the result's size, where the input was gathered whole. NaN is
    true, as in eager."""
    mesh = hpfun.Mesh.simulated((2,), ("dp",))
    x = _rand(8, 6)
    x[2, 3] = float("nan")
    for fn in (lambda x: (x > 1.0).any(0), lambda x: (x > -1.0).all(0), lambda x: x.isnan().any(),
               lambda x: (x > 1.0).any(dim=(0, 1), keepdim=True)):
        f = hpfun.shard(fn, mesh=mesh, in_specs=P("dp"), out_specs=P())
        assert torch.equal(f(x).full(), fn(x))
        (move,) = f.lower(x).collectives
        assert move.kind == "all_reduce" and move.bytes == fn(x).numel(), move


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_gaussian_nll_loss_checks_its_variance_at_every_call(mesh_shape):
    """F.gaussian_nll_loss reads its variances (`if torch.any(var < 0): raise`), mostly made
    by a network from parameters: the check is made in the program, at every call (it was
    refused as a read of values), and the loss and gradients equal eager's for each reduction,
    `full=True` and a variance of one dim fewer (homoscedastic)."""
    names = ("dp", "tp")[: len(mesh_shape)]
    mesh = hpfun.Mesh.simulated(mesh_shape, names)
    x, t = _rand(8, 6), _rand(8, 3)
    w = _rand(6, 6)

    def loss(w, x, t, reduction, full, homoscedastic):
        out = x @ w
        var = F.softplus(out[:, 3:])
        return F.gaussian_nll_loss(out[:, :3], t, var[:, :1].squeeze(1) if homoscedastic else var,
                                   full=full, reduction=reduction).sum()

    for reduction, full, homoscedastic in (("mean", False, False), ("sum", True, False), ("none", False, True)):
        g = torch.func.grad_and_value(lambda w, x, t: loss(w, x, t, reduction, full, homoscedastic))  # noqa: B023
        f = hpfun.shard(g, mesh=mesh, in_specs=(P(None, names[-1]), P(names[0]), P(names[0])), out_specs=P())
        for got, want in zip(f(w, x, t), g(w, x, t), strict=True):
            torch.testing.assert_close(got.full(), want, rtol=TOL, atol=TOL)
    direct = hpfun.shard(lambda m, t, v: F.gaussian_nll_loss(m, t, v), mesh=mesh, in_specs=P(names[0]), out_specs=P())
    v = _rand(8, 3).abs()
    torch.testing.assert_close(direct(x[:, :3], t, v).full(), F.gaussian_nll_loss(x[:, :3], t, v), rtol=TOL, atol=TOL)
    v[5, 1] = -1.0
    with pytest.raises(hpfun.ExecutionError, match="var has negative entry"):
        direct(x[:, :3], t, v)


@pytest.mark.parametrize("dims", [2, 3], ids=["2d", "3d"])
def test_grid_sample_gradient_keeps_split_channels_with_no_collective(dims):
    """grid_sample's backward works on each channel alike: with the input's channels split and
    the grid replicated, the gradient of the input keeps the split and the grid's gradient is a
    Partial sum over the channels, its one all-reduce the only collective (it gathered the
    incoming gradient and the whole input); both equal the unsharded gradients."""
    spatial = (6,) * dims
    x = _rand(2, 4, *spatial)
    grid = _rand(2, *(3,) * dims, dims).tanh()

    def grads(x, grid):
        return torch.func.grad(lambda x, g: (F.grid_sample(x, g, align_corners=False) ** 2).sum(), argnums=(0, 1))(x, grid)

    f = hpfun.shard(grads, mesh=hpfun.Mesh.simulated((2,), ("a",)), in_specs=(P(None, "a"), P()),
                    out_specs=(P(None, "a"), P()))
    gx, ggrid = f(x, grid)
    want_x, want_grid = grads(x, grid)
    torch.testing.assert_close(gx.full(), want_x, rtol=0, atol=TOL)
    torch.testing.assert_close(ggrid.full(), want_grid, rtol=0, atol=TOL)
    moved = [(c.kind, c.bytes) for c in f.lower(x, grid).collectives]
    assert moved == [("all_reduce", grid.numel() * 8)], moved


@pytest.mark.parametrize("name", ["index_copy", "index_add", "index_fill", "scatter"])
def test_group_norm_of_a_write_at_indices_of_a_split_dim_equals_eager(name):
    """A write at indices of a split dim ends in a slice of the whole value, a strided view on each
    rank, where eager's value is contiguous; the CPU group norm kernel takes contiguous (or
    channels-last) input only, and failed at run time after planning accepted the program."""
    x = torch.randn(8, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    src, ix = torch.randn(8, 2, 6, dtype=torch.float64), torch.tensor([6, 5])
    where = ix.view(1, 2, 1).expand(8, 2, 6).contiguous()
    writes = {"index_copy": lambda x: x.index_copy(1, ix, src), "index_add": lambda x: x.index_add(1, ix, src),
              "index_fill": lambda x: x.index_fill(1, ix, 1.0), "scatter": lambda x: x.scatter(1, where, 0.0)}

    def f(x):
        return F.group_norm(writes[name](x), 4)

    for spec in (P(None, "a"), P(None, None, "a")):
        out = hpfun.shard(f, mesh=hpfun.Mesh.simulated((2,), ("a",)), in_specs=(spec,), out_specs=P())(x)
        torch.testing.assert_close(out.full(), f(x), rtol=1e-12, atol=1e-12)



# ---------------------------------------------------------------------------------------------
# torch.combinations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r, with_replacement", [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)])
def test_combinations_pick_positions_their_length_decides(r, with_replacement):
    """torch.combinations masks a grid of positions (a shape read from the data, refused): its
    rows are the r-combinations of the positions, which the length decides, picked by a constant
    index; of a split vector and under torch.func.grad, with a length short of r too."""
    x, w = _rand(6), _rand(5)
    fn = lambda x, w: torch.combinations(x, r, with_replacement)  # noqa: E731
    _run(fn, (x, w), (2,), (P("a"), P()))
    _run(lambda x, w: torch.combinations(x[:2], 3, with_replacement), (x, w), (2,), (P("a"), P()))
    loss = lambda w: (torch.combinations(w, r, with_replacement).prod(-1) if r else w).sum()  # noqa: E731
    _run(lambda x, w: torch.func.grad(loss)(w), (x, w), (2, 2), (P("a"), P()))


@pytest.mark.parametrize("ranks", [2, 4])
def test_an_empty_or_whole_slice_of_a_split_dim_is_that_of_every_block(ranks):
    """A slice of none or all of a split dim keeps it split; each block was then sliced by the
    slice's own bounds, which mean other rows of a block: `x[-4:3]` of 8 rows (empty) was rows
    0-2 of each block of 4, so its sum counted them and its shards held rows, silently, and the
    write `y[-4:3] += 1` failed at run time."""
    mesh = hpfun.Mesh.simulated((ranks,), ("a",))
    x = torch.arange(16, dtype=torch.float64).reshape(8, 2)

    def written(x, rows):
        y = x.clone()
        y[rows] += 100.0
        return y

    for rows in (slice(-4, 3), slice(-1, 5), slice(5, 2), slice(-8, None), slice(-100, 100), slice(0, 8)):
        for fn in (lambda x: x[rows].sum() + x.sum(), lambda x: x[rows] * 2.0, lambda x: written(x, rows)):
            want = fn(x)
            got = hpfun.shard(fn, mesh=mesh, in_specs=(P("a"),), out_specs=None)(x)
            assert got.shape == want.shape and torch.equal(got.full(), want), rows
            if want.ndim:
                assert all(s.shape[0] <= want.shape[0] for s in got.shards), rows


def test_linspace_and_logspace_made_in_a_step_hold_eager_bits():
    """torch's reference formula for linspace rounds otherwise than its kernel: the middle of
    linspace(-1, 1, 13) was 0.0 where eager's is 5.55e-17, so `grid > 0` flipped, silently."""
    mesh = hpfun.Mesh.simulated((2,), ("a",))

    def f(x):
        grid = torch.linspace(-1, 1, 13, dtype=torch.float64) + torch.linspace(-1.3, 1.7, 13, dtype=torch.float64)
        grid = grid + torch.logspace(-2, 1, 13, dtype=torch.float64) * 0 + torch.linspace(-1, 1, 13, dtype=torch.float64)
        return x * 0 + grid, (x * 0 + torch.linspace(-1, 1, 13, dtype=torch.float64)) > 0, \
            torch.logspace(-2, 1, 13, base=3.0, dtype=torch.float64) + x

    x = torch.ones(4, 13, dtype=torch.float64)
    for spec in (P(), P("a")):
        got = hpfun.shard(f, mesh=mesh, in_specs=(spec,), out_specs=P())(x)
        for a, b in zip(got, f(x), strict=True):
            assert torch.equal(a.full(), b)
