"""Drawings of what hpfun decided, as text and HTML: which rank holds which block of a layout
(`Visualization`, shown by `hpfun.visualize` and by `Layout` and `Sharded` values in a
notebook), and the tables of the lowered report (`hpfun.explain`).

It reads layouts through their methods and imports none of hpfun's values, so the values can
draw themselves with it.
"""

from __future__ import annotations

import functools
import html
import itertools
import math

import attrs

MAX_LINES = 64  # panels and rank lines shown before "... N more"


# ---------------------------------------------------------------------------------------------
# The model: blocks and who holds them
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class Visualization:
    """A layout's blocks for a tensor of `shape` (None: blocks numbered, any shape)."""

    layout: object  # a Layout (hpfun.layout imports this module for its notebook view)
    shape: tuple | None
    dtype: object = None

    @property
    def ndim(self) -> int:
        if self.shape is not None:
            return len(self.shape)
        return max((d + 1 for d in self.layout.sharded_dims()), default=1)

    def factors(self) -> tuple[int, ...]:
        return tuple(self.layout.shard_factor(d) for d in range(self.ndim))

    def label(self, dim: int, block: int) -> str:
        """A block's index range along `dim` ("0:4"), or its number without a shape."""
        if self.shape is None:
            return f"#{block}"
        size = self.shape[dim] // self.factors()[dim]
        return f"{block * size}:{(block + 1) * size}"

    @functools.cached_property
    def holders(self) -> dict[tuple, list[list[int]]]:
        """Block (index per dim) -> its copies, each a list of ranks whose terms reduce to it."""
        mesh, layout = self.layout.mesh, self.layout
        copies_on = layout.replicated_axes
        out: dict[tuple, dict[tuple, list[int]]] = {}
        for r in range(mesh.size):
            coords = mesh.coords(r)
            block = tuple(layout.shard_index(d, coords) for d in range(self.ndim))
            out.setdefault(block, {}).setdefault(tuple(coords[a] for a in copies_on), []).append(r)
        return {block: list(copies.values()) for block, copies in out.items()}

    def cell(self, block: tuple) -> str:
        copies = self.holders[block]
        if all(len(terms) == 1 for terms in copies):
            return _runs([terms[0] for terms in copies])
        return ",".join("+".join(map(str, terms)) for terms in copies)

    def panels(self) -> list[tuple]:
        """Block indices of the leading dims, one tuple per panel."""
        lead = self.factors()[: max(self.ndim - 2, 0)]
        return list(itertools.product(*(range(n) for n in lead)))

    def grid(self, panel: tuple) -> tuple[list[str], list[str], list[list[tuple]]]:
        """(row labels, column labels, block per cell) of one panel; a 1-D tensor is one
        unlabelled row, a 0-D one a single cell."""
        factors, ndim = self.factors(), self.ndim
        if ndim == 0:
            return [""], [""], [[()]]
        cols = range(factors[-1])
        col_labels = [self.label(ndim - 1, c) for c in cols]
        if ndim == 1:
            return [""], col_labels, [[(c,) for c in cols]]
        rows = range(factors[-2])
        return [self.label(ndim - 2, r) for r in rows], col_labels, [[panel + (r, c) for c in cols] for r in rows]

    def rank_block(self, rank: int) -> str:
        coords = self.layout.mesh.coords(rank)
        return "[" + ", ".join(self.label(d, self.layout.shard_index(d, coords)) for d in range(self.ndim)) + "]"

    def coords_text(self, rank: int) -> str:
        mesh = self.layout.mesh
        return ", ".join(f"{n}={c}" for n, c in zip(mesh.axis_names, mesh.coords(rank), strict=True))

    def headline(self) -> str:
        text = str(self.layout)
        if self.shape is not None:
            text += f": global {self.shape}, each rank holds {self.layout.local_shape(self.shape)}"
        return text + (f", {str(self.dtype).replace('torch.', '')}" if self.dtype is not None else "")

    def legend(self) -> str:
        dims = {0: "", 1: "columns: dim 0", 2: f"rows: dim {self.ndim - 2}, columns: dim {self.ndim - 1}"}
        text = dims[min(self.ndim, 2)]
        if self.ndim > 2:
            lead = "dim 0" if self.ndim == 3 else f"dims 0-{self.ndim - 3}"
            text = f"one panel per block of {lead}; " + text
        return (text + ("; " if text else "") + "a cell lists the ranks holding that block" + self._partial_note()
                + self._order_note())

    def _partial_note(self) -> str:
        partial = {self.layout.mesh.axis_names[a]: str(self.layout.placements[a]) for a in self.layout.partial_axes}
        if not partial:
            return ""
        return f" (a+b: terms of {'/'.join(sorted(set(partial.values())))} over {', '.join(partial)})"

    def _order_note(self) -> str:
        """Dims split over several mesh axes in another order than the mesh's, and that order."""
        layout, names = self.layout, self.layout.mesh.axis_names
        return "".join(f"; dim {layout.placements[group[0]].dim} split over {', '.join(names[a] for a in group)}, "
                       "major first" for group in layout.order)

    def panel_title(self, panel: tuple) -> str:
        shown = [self.label(d, b) for d, b in enumerate(panel)] + [":"] * (self.ndim - len(panel))
        return "[" + ", ".join(shown) + "]"

    def __str__(self) -> str:
        return _render_text(self)

    def __repr__(self) -> str:
        return _render_text(self)

    def _repr_html_(self) -> str:
        return _render_html(self)


def _runs(ranks: list[int]) -> str:
    """Ranks as text, runs of three or more consecutive ones shortened: 0-3,6."""
    groups = [list(g) for _, g in itertools.groupby(enumerate(ranks), key=lambda t: t[1] - t[0])]
    return ",".join(f"{g[0][1]}-{g[-1][1]}" if len(g) > 2 else ",".join(str(r) for _, r in g) for g in groups)


def _capped(items: list, what: str) -> tuple[list, list[str]]:
    """The first MAX_LINES items, and a note on how many were left out."""
    if len(items) <= MAX_LINES:
        return items, []
    return items[:MAX_LINES], [f"... and {len(items) - MAX_LINES} more {what}"]


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


def _render_text(v: Visualization) -> str:
    lines = [v.headline(), v.legend()]
    panels, more = _capped(v.panels(), "panels")
    for panel in panels:
        if panel:
            lines.append(v.panel_title(panel))
        lines += _text_grid(v, *v.grid(panel))
    lines += more
    ranks, more = _capped(list(range(v.layout.mesh.size)), "ranks")
    lines += [f"rank {r} ({v.coords_text(r)}): {v.rank_block(r)}" for r in ranks] + more
    return "\n".join(lines)


def _text_grid(v: Visualization, row_labels, col_labels, blocks) -> list[str]:
    cells = [[v.cell(b) for b in row] for row in blocks]
    widths = [max(len(col_labels[c]), *(len(row[c]) for row in cells)) + 2 for c in range(len(col_labels))]
    pad = max(map(len, row_labels)) + 1 if any(row_labels) else 0

    def rule(left, mid, right):
        return " " * pad + left + mid.join("─" * w for w in widths) + right

    lines = [" " * pad + " " + " ".join(l.center(w) for l, w in zip(col_labels, widths, strict=True)).rstrip()]
    lines = lines if any(col_labels) else []
    lines.append(rule("┌", "┬", "┐"))
    for i, (label, row) in enumerate(zip(row_labels, cells, strict=True)):
        if i:
            lines.append(rule("├", "┼", "┤"))
        body = "│".join(c.center(w) for c, w in zip(row, widths, strict=True))
        lines.append(label.ljust(pad) + "│" + body + "│")
    lines.append(rule("└", "┴", "┘"))
    return lines


# ---------------------------------------------------------------------------------------------
# HTML (inline styles only: notebook viewers drop <style> blocks)
# ---------------------------------------------------------------------------------------------

_TABLE = "border-collapse:collapse;margin:4px 0 8px 0;font-family:monospace;font-size:12px"
_CELL = "border:1px solid #555;padding:6px 10px;text-align:center;min-width:36px;color:#111"
_HEAD = "padding:2px 8px;color:#555;font-family:monospace;font-size:11px;text-align:center"


def rank_color(rank: int) -> str:
    """A light colour per rank, well apart for neighbouring ranks (golden-angle hues)."""
    return f"hsl({rank * 137.508 % 360:.0f}, 70%, 82%)"


def _render_html(v: Visualization) -> str:
    esc = html.escape
    parts = [f'<div class="hpfun-visualize"><div style="font-family:monospace;font-weight:bold">{esc(v.headline())}</div>',
             f'<div style="font-size:11px;color:#555">{esc(v.legend())}</div>']
    panels, more = _capped(v.panels(), "panels")
    parts.append('<div style="display:flex;flex-wrap:wrap;column-gap:16px">')
    for panel in panels:
        title = f'<div style="font-family:monospace;font-size:11px">{esc(v.panel_title(panel))}</div>' if panel else ""
        parts.append(f"<div>{title}{_html_grid(v, *v.grid(panel))}</div>")
    parts += [f"<div>{esc(m)}</div>" for m in more] + ["</div>"]
    ranks, more = _capped(list(range(v.layout.mesh.size)), "ranks")
    rows = [(f"rank {r}", v.coords_text(r), v.rank_block(r)) for r in ranks] + [(m, "", "") for m in more]
    parts.append(f"<details><summary>each rank's block</summary>{html_table(('rank', 'coords', 'block'), rows)}</details></div>")
    return "".join(parts)


def _html_grid(v: Visualization, row_labels, col_labels, blocks) -> str:
    head = "".join(f'<th style="{_HEAD}">{html.escape(l)}</th>' for l in col_labels)
    rows = [f'<tr><th style="{_HEAD}"></th>{head}</tr>'] if any(col_labels) else []
    for label, row in zip(row_labels, blocks, strict=True):
        cells = "".join(f'<td style="{_CELL};background:{rank_color(v.holders[b][0][0])}">{html.escape(v.cell(b))}</td>'
                        for b in row)
        rows.append(f'<tr><th style="{_HEAD}">{html.escape(label)}</th>{cells}</tr>')
    return f'<table style="{_TABLE}">{"".join(rows)}</table>'


def html_table(headers, rows) -> str:
    """A plain table (the lowered report's tables use it too)."""
    style = "border:1px solid #ccc;padding:2px 6px;text-align:left;font-family:monospace;font-size:12px"
    head = "".join(f'<th style="{style};background:#eee">{html.escape(str(h))}</th>' for h in headers)
    body = "".join("<tr>" + "".join(f'<td style="{style}">{html.escape(str(c))}</td>' for c in row) + "</tr>" for row in rows)
    return f'<table style="border-collapse:collapse;margin:4px 0">{"<tr>" + head + "</tr>"}{body}</table>'


def lowered_html(data: dict, cost, text: str) -> str:
    """The lowered report (see `hpfun.explain`) as HTML: cost, collectives, inputs and
    outputs as tables, the per-shard program folded below them."""
    esc, mesh = html.escape, data["mesh"]
    ranks = math.prod(mesh["shape"])
    mesh_text = "{" + ", ".join(f"{a}: {n}" for a, n in zip(mesh["axis_names"], mesh["shape"], strict=True)) + "}"
    title = (f"per-shard program on mesh {mesh_text} ({ranks} ranks): {len(data['nodes'])} nodes, "
             f"{len(data['collectives'])} collectives, {cost.bytes} B per rank, about {cost.seconds * 1e6:.1f} us")
    costs = [(axes, a.collectives, a.bytes, f"{a.wire_bytes:.0f}", f"{a.seconds * 1e6:.2f}") for axes, a in cost.per_axis.items()]
    collectives = [(i, c["kind"], ",".join(c["axes"]), c["bytes"], f"{c['node']} ({c['op']})", c["reason"])
                   for i, c in enumerate(data["collectives"])]
    tensors = [(x["path"], x["shape"], x["dtype"], x["layout"], x["local_shape"]) for x in data["inputs"] + data["outputs"]]
    return "".join([
        f'<div class="hpfun-lowered"><div style="font-family:monospace;font-weight:bold">{esc(title)}</div>',
        "<div>communication per mesh axis</div>",
        html_table(("axes", "collectives", "bytes", "wire bytes", "est. us"), costs),
        "<div>collectives</div>",
        html_table(("#", "kind", "axes", "bytes", "for", "why"), collectives),
        "<div>inputs and outputs</div>",
        html_table(("path", "global shape", "dtype", "layout", "local shape"), tensors),
        f'<details><summary>per-shard program</summary><pre style="font-size:11px">{esc(text)}</pre></details></div>',
    ])
