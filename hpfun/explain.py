"""Reports on a lowered program: the per-shard graph with layouts, and its collectives."""

from __future__ import annotations

import torch

from hpfun.lower import Collective, Program


def _arg(a) -> str:
    if isinstance(a, torch.fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    return repr(a)


def _op_name(target) -> str:
    return str(target).replace("aten.", "").replace("_c10d_functional.", "c10d.")


class Lowered:
    """What `f.lower(*args)` returns: `str()` shows the per-shard program, `.collectives` lists
    every collective with its mesh axes, bytes per rank and the node that needed it."""

    def __init__(self, program: Program):
        self.program = program

    @property
    def collectives(self) -> list[Collective]:
        return list(self.program.collectives)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.program.module.graph

    def __str__(self) -> str:
        p = self.program
        lines = [f"per-shard program on mesh {p.mesh} ({p.mesh.size} ranks)"]
        inputs = iter(zip(p.input_layouts, p.input_shapes, strict=True))
        for node in self.graph.nodes:
            lines.append(self._line(node, inputs))
        lines.append(f"collectives ({len(p.collectives)}):")
        lines += [f"  {c}" for c in p.collectives] or ["  none"]
        return "\n".join(lines)

    def _line(self, node, inputs) -> str:
        if node.op == "placeholder":
            if node.name == "coords":
                return "  %coords: this rank's mesh coordinates"
            if node.name == "seed":
                return "  %seed: this call's random seed" + ("" if node.users else " (unused)")
            layout, shape = next(inputs)
            return f"  %{node.name}: global {list(shape)} {layout.placements_str()}"
        if node.op == "output":
            outs = zip(self.program.output_layouts, self.program.output_shapes, strict=True)
            shown = ", ".join(f"{_arg(n)} {l.placements_str()}" for n, (l, _) in zip(node.args[0], outs, strict=True))
            return f"  return {shown}"
        if node.op == "get_attr":
            return f"  %{node.name} = constant {node.target}"
        args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
        text = f"  %{node.name} = {_op_name(node.target)}({args})"
        if "hpfun_collective" in node.meta:
            c = node.meta["hpfun_collective"]
            text += f"    # {c.kind} over {', '.join(c.axes)}, {c.bytes} B"
        elif "hpfun_layout" in node.meta:
            layout = node.meta["hpfun_layout"]
            shown = layout.placements_str() if hasattr(layout, "placements_str") else ", ".join(l.placements_str() for l in layout)
            text += f"    # {shown}"
        return text

    def __repr__(self) -> str:
        return f"<Lowered: {len(self.program.collectives)} collectives on {self.program.mesh}>"
