"""A file descriptor silenced while C code that writes to it runs (HiGHS's debug lines on
stdout, the profiler backend's start and stop messages on stderr)."""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def silenced(fd: int):
    """File descriptor `fd` (1 or 2) sent to /dev/null inside the block; Python's own stream
    for it is flushed first, so nothing the caller printed is lost. Where the process has no
    such descriptor (an embedded interpreter), nothing is done."""
    stream = sys.stdout if fd == 1 else sys.stderr
    if stream is not None:
        stream.flush()
    try:
        saved = os.dup(fd)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
