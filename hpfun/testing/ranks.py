"""Run a command as the ranks of a gloo job on 127.0.0.1, as `torchrun` would start them, for
tests: a free port, one process per rank with `RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT` and one compute thread, each rank's output in
`out/log-rank{r}.txt`; no process is left behind, whatever happens."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], world: int, out: Path, timeout: float = 240, cwd=None) -> list[int]:
    """Run `argv` once per rank; the ranks' exit codes (a rank past `timeout` raises
    `subprocess.TimeoutExpired`, after every rank is killed)."""
    port, procs = free_port(), []
    try:
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            with open(Path(out) / f"log-rank{rank}.txt", "w") as log:
                procs.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def logs(out: Path, tail: int = 3000) -> str:
    """The last `tail` characters of each rank's output, for an assertion message."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-tail:]}" for p in sorted(Path(out).glob("log-rank*.txt")))
