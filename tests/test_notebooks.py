"""Every notebook in notebooks/ runs top to bottom without an error.

Each notebook runs in a fresh ipykernel whose working directory is notebooks/. The kernel is
ipykernel's built-in `python3` spec, which starts `sys.executable`. That is the interpreter
running pytest, so the kernel imports the same hpfun (the editable install in the venv), even
when some other `python3` kernelspec is installed on the machine.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from traitlets import default

import hpfun

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class ThisInterpreterKernelManager(AsyncKernelManager):
    """Looks up kernels only in ipykernel's own spec: `python3` is `sys.executable -m ipykernel_launcher`."""

    @default("kernel_spec_manager")
    def _kernel_spec_manager_default(self) -> KernelSpecManager:
        return KernelSpecManager(kernel_dirs=[])


def execute(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", kernel_manager_class=ThisInterpreterKernelManager,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    return client.execute()


def _failing_cell(nb: nbformat.NotebookNode) -> str:
    for i, cell in enumerate(nb.cells):
        if any(out.get("output_type") == "error" for out in cell.get("outputs", ())):
            return f"cell {i} (execution count {cell.get('execution_count')})"
    return "a cell"


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_runs(path: Path):
    nb = nbformat.read(path, as_version=4)
    try:
        execute(nb)
    except CellExecutionError as err:
        message = _ANSI.sub("", str(err))
        pytest.fail(f"{path.name}: {_failing_cell(nb)} raised:\n{message}", pytrace=False)


def test_kernel_imports_this_hpfun():
    """The notebooks test the hpfun under test, not one installed elsewhere."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import sys, hpfun\nprint(sys.executable)\nprint(hpfun.__file__)"
    )])
    out = execute(nb).cells[0].outputs
    lines = "".join(o.get("text", "") for o in out if o.get("output_type") == "stream").split()
    assert lines == [sys.executable, hpfun.__file__], out
