"""Every ```python block of README.md runs as pasted.

The blocks run in file order in one namespace, as a reader pastes them into one session (a later
block may use what an earlier one defined), in this process: a simulated mesh needs no other.
A block that needs a `torchrun` job is skipped: one whose first line is the comment
`# torchrun`, or that calls `hpfun.Mesh.distributed` (it would wait for peers that never come).
The distributed runtime is tested in tests/test_distributed.py instead.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first code line's number, code) of every ```python block."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _BLOCK.finditer(text)]


def needs_torchrun(code: str) -> bool:
    return code.lstrip().startswith("# torchrun") or "Mesh.distributed(" in code


def test_readme_python_blocks_run_in_order():
    """Each block runs without an error; a failure names the block and README.md's own line."""
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 2, "no ```python blocks found: has the fence changed?"
    assert any(not needs_torchrun(code) for _, code in blocks)
    namespace = {"__name__": "readme"}
    for line, code in blocks:
        if needs_torchrun(code):
            continue
        try:  # leading newlines: a traceback's line numbers are README.md's
            exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)
        except Exception:
            pytest.fail(f"the README.md block at line {line} raised:\n{traceback.format_exc()}", pytrace=False)
