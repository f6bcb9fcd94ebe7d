"""The `HPFUN_DEBUG` log: what hpfun decided at each compile.

`HPFUN_DEBUG` (read at every compile, so it can change between calls) sets what each compile
logs, through `logging` at DEBUG level:

- 1: the layout chosen for every node of the traced program   (logger "hpfun.layouts")
- 2: also each collective, its bytes and the reason           (logger "hpfun.collectives")
- 3: also the whole per-shard program                         (logger "hpfun.program")

With the variable set, the "hpfun" logger is set to DEBUG; when no handler is configured
anywhere, a handler writing to stderr is added to it, so the records show in a plain script.
Configure `logging` yourself to send them elsewhere.
"""

from __future__ import annotations

import logging
import os

import torch

from hpfun.explain import Lowered

LAYOUTS, COLLECTIVES, PROGRAM = (logging.getLogger(f"hpfun.{name}") for name in ("layouts", "collectives", "program"))


def level() -> int:
    """The `HPFUN_DEBUG` level, 0 (off) to 3; a value that is not a number means 1."""
    value = os.environ.get("HPFUN_DEBUG", "").strip()
    if not value:
        return 0
    try:
        return max(0, min(int(value), 3))
    except ValueError:
        logging.getLogger("hpfun").warning("HPFUN_DEBUG=%r is not a level 0-3; using 1", value)
        return 1


def log_compile(name: str, gm: torch.fx.GraphModule, lowered: Lowered, debug_level: int) -> None:
    """Log one compile of function `name` (the propagated global graph and its report)."""
    _make_visible()
    LAYOUTS.debug("%s: compiled for mesh %s, %d nodes", name, lowered.mesh, len(gm.graph.nodes))
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    paths = {node: x["path"] for node, x in zip(placeholders, lowered.inputs, strict=True)}
    for node in gm.graph.nodes:
        if "hpfun_layout" in node.meta:
            LAYOUTS.debug("%s: %s", name, _node_text(node, paths))
    if debug_level >= 2:
        for c in lowered.collectives:
            COLLECTIVES.debug("%s: %s", name, c)
        COLLECTIVES.debug("%s: %s", name, lowered.cost())
    if debug_level >= 3:
        PROGRAM.debug("%s:\n%s", name, lowered)


def _node_text(node: torch.fx.Node, paths: dict) -> str:
    """`%mm = aten.mm.default: [S(0), R], [R, S(1)] -> [S(0), S(1)] global [8, 32]`"""
    out = node.meta["hpfun_layout"]
    outs = ", ".join("-" if l is None else l.placements_str() for l in (out if isinstance(out, tuple) else (out,)))
    val = node.meta.get("val")
    shape = f" global {list(val.shape)}" if isinstance(val, torch.Tensor) else ""
    if node.op == "placeholder":
        return f"%{node.name} ({paths[node]}): {outs}{shape}"
    strategy = node.meta.get("hpfun_strategy")
    ins = ", ".join(l.placements_str() for l in strategy.inputs) + " " if strategy and strategy.inputs else ""
    return f"%{node.name} = {node.target}: {ins}-> {outs}{shape}"


def _make_visible() -> None:
    logger = logging.getLogger("hpfun")
    if logger.getEffectiveLevel() > logging.DEBUG:
        logger.setLevel(logging.DEBUG)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
