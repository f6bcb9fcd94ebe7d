"""`python -m hpfun.demo` runs as its docstring says and trains as the unsharded run does: the
functional MLP and `--module` (an nn.Module with AdamW, state lifted by name) on a simulated
mesh, and `--module --distributed` as torchrun would launch it, 4 gloo processes on 127.0.0.1.

Each run is a subprocess with a bounded wait; nothing is left running."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpfun.testing import ranks

ROOT = Path(__file__).resolve().parent.parent
DEMO = [sys.executable, "-m", "hpfun.demo"]
_DIFF = re.compile(r"after (\d+) steps: max \|param difference\| = (\S+); traced (\d+) time")


def _result(text: str) -> tuple[int, float, int]:
    """(steps, max parameter difference, traces) from the demo's last line."""
    found = _DIFF.search(text)
    assert found, text[-3000:]
    return int(found[1]), float(found[2]), int(found[3])


def _run(args, env=None, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(DEMO + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags", [[], ["--module"]], ids=["functional", "module"])
def test_demo_matches_the_unsharded_run(flags):
    """Three steps on the simulated 2x2 mesh end within float32 rounding of the unsharded steps."""
    done = _run(flags + ["--steps", "3"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps, diff, traces = _result(done.stdout)
    assert steps == 3 and diff < 1e-5
    if flags:  # the stock step: a second trace once AdamW has made its state, then cache hits
        assert traces == 2
        assert re.search(r"model\.up\.weight\s+float32\s+global \[64, 16\]\s+\[R, S\(0\)\]", done.stdout), done.stdout
        assert "opt.state.model.down.weight.exp_avg" in done.stdout


def test_module_demo_on_four_processes(tmp_path):
    """`torchrun --nproc-per-node 4 -m hpfun.demo --module --distributed`, launched by hand: the
    parameters stay sharded between calls, and gathered they match the unsharded run."""
    world = 4
    codes = ranks.launch(DEMO + ["--module", "--distributed", "--steps", "3"], world, tmp_path, timeout=300, cwd=ROOT)
    logs = [(tmp_path / f"log-rank{rank}.txt").read_text() for rank in range(world)]
    assert codes == [0] * world, "\n".join(log[-3000:] for log in logs)
    steps, diff, traces = _result(logs[0])
    assert steps == 3 and diff < 1e-5 and traces == 2
    assert "model.up.weight holds its block, [32, 16] of [64, 16]" in logs[0], logs[0]
    assert not any(_DIFF.search(log) for log in logs[1:])  # only rank 0 prints


def test_distributed_demo_names_the_process_count_that_fits():
    """Launched with a world size its 2x2 mesh does not fit, the demo says to use 4, before any
    process group starts."""
    done = _run(["--module", "--distributed"], env={"WORLD_SIZE": "2", "RANK": "0"}, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "torchrun --nproc-per-node 4" in done.stderr and "has 2 processes" in done.stderr, done.stderr
