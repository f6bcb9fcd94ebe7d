"""Which rank holds which block: text for terminals, HTML for notebooks, for any tensor and mesh.

A layout cuts every tensor dim into blocks (dim d into `layout.shard_factor(d)` of them). The
view draws the last two dims as a grid of blocks (a 1-D tensor as one row) and every block
combination of the leading dims as one panel, so tensors of any rank fit; the mesh's rank only
changes which ranks a cell lists. A cell lists the ranks holding its block: `0,1` are copies
(the ranks differ on replicated mesh axes), `0+2` are terms whose reduction is the block (the
ranks differ on Partial axes). Below the panels, each rank's mesh coordinates and its block.

>>> import hpfun
>>> mesh = hpfun.Mesh.simulated((2, 2), ("dp", "tp"))
>>> print(hpfun.visualize(hpfun.P("dp", "tp").to_layout(mesh, 2), (4, 6)))
[S(0), S(1)] on {dp: 2, tp: 2}: global (4, 6), each rank holds (2, 3)
rows: dim 0, columns: dim 1; a cell lists the ranks holding that block
      0:3   3:6
    ┌─────┬─────┐
0:2 │  0  │  1  │
    ├─────┼─────┤
2:4 │  2  │  3  │
    └─────┴─────┘
rank 0 (dp=0, tp=0): [0:2, 0:3]
rank 1 (dp=0, tp=1): [0:2, 3:6]
rank 2 (dp=1, tp=0): [2:4, 0:3]
rank 3 (dp=1, tp=1): [2:4, 3:6]
"""

from __future__ import annotations

from hpfun.drawing import MAX_LINES, Visualization, html_table, lowered_html, rank_color  # importable from here as before
from hpfun.errors import LayoutError
from hpfun.layout import Layout
from hpfun.memory import Memory
from hpfun.sharded import Sharded


def visualize(x, shape=None) -> "Visualization":
    """The blocks of a `Sharded` value, or of a tensor of global `shape` under a `Layout`
    (without a shape, blocks are numbered instead of given as index ranges); or a program's
    memory per rank (`Lowered.memory()`), as a table and the live bytes over the program. `str()` draws it
    as text, `_repr_html_` as HTML (a notebook shows it when it is a cell's value).

    >>> import hpfun
    >>> layout = hpfun.parse("[S(0), P(sum)] on {dp: 2, tp: 2}")
    >>> print(str(hpfun.visualize(layout, (4,))).splitlines()[4])
    │ 0+1 │ 2+3 │
    """
    if isinstance(x, Memory):
        return x
    if isinstance(x, Sharded):
        return Visualization(x.layout, tuple(x.global_shape), x.dtype)
    if not isinstance(x, Layout):
        raise LayoutError(f"visualize takes a Layout (with a global shape), a Sharded value or a Memory, got {type(x).__name__}")
    if shape is not None:
        if not isinstance(shape, (tuple, list)) or \
                not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise LayoutError(f"visualize's shape is the global shape, a tuple of ints such as (8, 4), got {shape!r}")
        layout = x.normalized(len(shape))
        problems = layout.problems(tuple(shape))
        if problems:
            raise LayoutError(problems)
        return Visualization(layout, tuple(shape))
    return Visualization(x, None)
