"""hpfun.visualize: which rank holds which block, as text and HTML, for any tensor and mesh rank."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hpfun
from hpfun import Layout, Partial, Replicate, Shard
from hpfun.testing import layouts, meshes

MESH3 = hpfun.Mesh.simulated((2, 2, 2), ("a", "b", "c"))


def test_3d_tensor_on_3d_mesh_text():
    """A 3-D tensor on a 3-D mesh: one panel per block of dim 0, copies listed together."""
    text = str(hpfun.visualize(Layout(MESH3, (Shard(0), Shard(2), Replicate())), (4, 3, 8)))
    assert text == """\
[S(0), S(2), R] on {a: 2, b: 2, c: 2}: global (4, 3, 8), each rank holds (2, 3, 4)
one panel per block of dim 0; rows: dim 1, columns: dim 2; a cell lists the ranks holding that block
[0:2, :, :]
      0:4   4:8
    ┌─────┬─────┐
0:3 │ 0,1 │ 2,3 │
    └─────┴─────┘
[2:4, :, :]
      0:4   4:8
    ┌─────┬─────┐
0:3 │ 4,5 │ 6,7 │
    └─────┴─────┘
rank 0 (a=0, b=0, c=0): [0:2, 0:3, 0:4]
rank 1 (a=0, b=0, c=1): [0:2, 0:3, 0:4]
rank 2 (a=0, b=1, c=0): [0:2, 0:3, 4:8]
rank 3 (a=0, b=1, c=1): [0:2, 0:3, 4:8]
rank 4 (a=1, b=0, c=0): [2:4, 0:3, 0:4]
rank 5 (a=1, b=0, c=1): [2:4, 0:3, 0:4]
rank 6 (a=1, b=1, c=0): [2:4, 0:3, 4:8]
rank 7 (a=1, b=1, c=1): [2:4, 0:3, 4:8]"""


def test_partial_terms_and_two_axes_on_one_dim():
    """Partial axes list terms with +; two axes on one dim split it major-first."""
    text = str(hpfun.visualize(Layout(MESH3, (Shard(1), Partial(), Shard(1))), (2, 8)))
    assert "│ 0+2 │ 1+3 │ 4+6 │ 5+7 │" in text and "(a+b: terms of P(sum) over b)" in text
    assert "rank 5 (a=1, b=0, c=1): [0:2, 6:8]" in text


def test_4d_tensor_panels_and_scalar():
    """Every block combination of the leading dims is a panel; a 0-D tensor is one cell."""
    mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
    text = str(hpfun.visualize(Layout(mesh, (Shard(0), Shard(1))), (2, 4, 3, 5)))
    panels = re.findall(r"^\[.*, :, :\]$", text, re.M)
    assert panels == ["[0:1, 0:2, :, :]", "[0:1, 2:4, :, :]", "[1:2, 0:2, :, :]", "[1:2, 2:4, :, :]"]
    assert "one panel per block of dims 0-1" in text
    scalar = str(hpfun.visualize(Layout.replicated(MESH3), ()))
    assert "│ 0-7 │" in scalar


def test_layout_without_shape_numbers_blocks():
    """Without a global shape, blocks are numbered and the tensor has as many dims as the layout needs."""
    text = str(hpfun.visualize(hpfun.parse("[S(1), R] on {dp: 2, tp: 2}")))
    assert text.splitlines()[2].split() == ["#0", "#1"] and "rank 3 (dp=1, tp=1): [#0, #1]" in text


def test_sharded_values_and_html():
    """A Sharded value's view names its dtype; the HTML lists every rank, in a cell and a row."""
    x = hpfun.Sharded.from_global(torch.zeros(4, 2, 8), Layout(MESH3, (Shard(0), Replicate(), Shard(2))))
    headline = str(hpfun.visualize(x)).splitlines()[0]
    assert headline == "[S(0), R, S(2)] on {a: 2, b: 2, c: 2}: global (4, 2, 8), each rank holds (2, 2, 4), float32"
    page = x._repr_html_()
    assert page == hpfun.visualize(x)._repr_html_()
    cells = re.findall(r"<td style=\"[^\"]*background:[^\"]*\">([^<]*)</td>", page)
    assert sorted(cells) == ["0,2", "1,3", "4,6", "5,7"]
    rows = re.findall(r"<td style=\"[^\"]*\">(rank \d+)</td>", page)
    assert rows == [f"rank {r}" for r in range(8)]


def test_layout_html():
    """Layout._repr_html_ draws its blocks; the layout stays an equal, hashable value."""
    layout = hpfun.parse("[S(0), S(1)] on {dp: 2, tp: 2}")
    page = layout._repr_html_()
    assert "[S(0), S(1)] on {dp: 2, tp: 2}" in page and all(f"rank {r}" in page for r in range(4))
    again = hpfun.parse("[S(0), S(1)] on {dp: 2, tp: 2}")
    assert layout == again and hash(layout) == hash(again)


def test_bad_arguments():
    """Only Layouts (with a shape they divide) and Sharded values can be drawn."""
    with pytest.raises(hpfun.LayoutError, match="visualize takes a Layout"):
        hpfun.visualize(torch.zeros(2))
    with pytest.raises(hpfun.LayoutError, match="not divisible"):
        hpfun.visualize(hpfun.parse("[S(0)] on {dp: 2}"), (3,))


def test_large_meshes_are_capped():
    """Past 64 ranks the per-rank lines stop with a count of the rest."""
    mesh = hpfun.Mesh.simulated((4, 4, 8), ("a", "b", "c"))
    text = str(hpfun.visualize(Layout(mesh, (Shard(0), Shard(1), Replicate())), (8, 8)))
    assert text.endswith("... and 64 more ranks") and "│ 120-127 │" in text


@settings(max_examples=40)
@given(st.data())
def test_each_rank_block_is_its_shard(data):
    """For 1-3-D meshes and 1-4-D tensors, each rank's block in the view is what its shard holds,
    and each rank sits in exactly one cell."""
    mesh = data.draw(meshes(max_ranks=8, ndims=(1, 2, 3), sizes=(1, 2)))
    shape = tuple(data.draw(st.lists(st.sampled_from([2, 4]), min_size=1, max_size=4)))
    layout = data.draw(layouts(mesh, shape))
    full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    x = hpfun.Sharded.from_global(full, layout)
    view = hpfun.visualize(x)
    for r in range(mesh.size):
        block = view.rank_block(r)[1:-1].split(", ")
        index = tuple(slice(*map(int, b.split(":"))) for b in block)
        assert torch.equal(full[index], x.shards[r]), (str(layout), r, block)
    cells = re.findall(r"│([^│\n]+)", str(view))
    assert sorted(r for cell in cells for r in _ranks(cell.strip())) == list(range(mesh.size))  # each rank in one cell


def _ranks(cell: str) -> list[int]:
    """The ranks a cell lists: "0-2,5" or "0+1,2+3"."""
    out = []
    for term in re.split("[,+]", cell):
        first, _, last = term.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out
