"""Shared test set-up: deterministic hypothesis, small helpers."""

import logging
import multiprocessing
import os
import tempfile
import time

import pytest
from hypothesis import HealthCheck, settings

# Derandomized everywhere (CI and local) and no deadline: these machines are shared and slow.
settings.register_profile(
    "hpfun", derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "hpfun"))

# Every compile in the suite checks hpfun's own invariants after propagation and after lowering
# (hpfun.verify); subprocesses (torchrun workers, notebooks) inherit it.
os.environ.setdefault("HPFUN_VERIFY", "1")


def _torch_trace_log_left_alone():
    """pytest (9 and later) attaches its log capture to every logger that does not propagate,
    torch's structured-trace logger among them. torch checks only that this logger has a
    handler before it builds an event, and an event made outside torch.compile carries the
    summary of the whole stack, pytest's frames included: each real tensor made fake paid for
    one (the rule validation's OpInfo index, traced in the suite's process, took 79 s against 53).
    The logger writes nowhere unless TORCH_TRACE names a directory; there it is left as torch
    set it. Made to propagate, it keeps no handler of its own and pytest attaches none."""
    if os.environ.get("TORCH_TRACE"):
        return
    trace = logging.getLogger("torch.__trace")
    trace.handlers.clear()
    trace.propagate = True


_torch_trace_log_left_alone()


def pytest_runtest_logstart(nodeid, location):
    _torch_trace_log_left_alone()  # again before each test: torch._logging.set_logs() resets the logger


# The rule validation's OpInfo index (tests/test_validate.py), traced in a process of its own
# started as soon as the suite is collected: on a core of its own while the suite runs other
# tests, and in a fresh interpreter, where it takes 50-70 s. In the suite's own process, by
# the time the validation ran, it took 125-145 s: fx's tracer patches torch.nn.Module at every
# trace, and each patch walks every nn.Module subclass defined so far (the suite's and
# transformers'), 3,700 traces of it.
#
# Under `pytest -n` (make test) the folder is made by the controller, which runs no tests and
# outlives the workers, and reaches them through the environment; worker gw0 starts the build
# (every worker collects the same tests), and whichever worker runs a validation test reads
# the index from the folder when it is there.
_INDEX_DIR = "HPFUN_TEST_INDEX_DIR"
_INDEX_BUILD: dict = {}
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def pytest_configure(config):
    if not _WORKER and _INDEX_DIR not in os.environ:
        os.environ[_INDEX_DIR] = _INDEX_BUILD["folder"] = tempfile.mkdtemp(prefix="hpfun-index-")


@pytest.hookimpl(trylast=True)  # the items left after -k and -m
def pytest_collection_modifyitems(session, config, items):
    if _WORKER not in (None, "gw0"):
        return
    if any("validation_index" in getattr(item, "fixturenames", ()) for item in items):
        _start_index_build()


def _index_files() -> tuple[str, str, str]:
    folder = os.environ[_INDEX_DIR]
    return os.path.join(folder, "index.pickle"), os.path.join(folder, "log.txt"), os.path.join(folder, "pid")


def _start_index_build() -> None:
    if "process" in _INDEX_BUILD:
        return
    from hpfun import validate

    path, log, pid = _index_files()
    process = multiprocessing.get_context("spawn").Process(target=validate.write_portable_index, args=(path, log),
                                                          daemon=True, name="hpfun validation index")
    process.start()
    with open(pid + ".part", "w") as f:
        f.write(str(process.pid))
    os.replace(pid + ".part", pid)
    _INDEX_BUILD["process"] = process


def _builder_gone(pid_file: str) -> bool:
    """Whether the process that builds the index has ended (a zombie counts as ended)."""
    if "process" in _INDEX_BUILD:
        return not _INDEX_BUILD["process"].is_alive()
    try:
        with open(pid_file) as f:
            pid = int(f.read())
    except FileNotFoundError:  # gw0 has not started it yet (still collecting)
        return False
    try:  # Linux: the process's state, where a zombie still answers a signal
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return True  # no such process
    try:  # elsewhere (macOS): whether a signal reaches it
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


@pytest.fixture(scope="session")
def validation_index():
    from hpfun import validate

    if _WORKER in (None, "gw0"):
        _start_index_build()  # (started at collection already, unless a plugin added the test after it)
    path, log, pid = _index_files()
    deadline = time.monotonic() + 1800
    while not os.path.exists(path):
        if (os.path.exists(path + ".failed") or _builder_gone(pid)) and not os.path.exists(path):
            output = ""
            if os.path.exists(log):
                with open(log, errors="replace") as f:
                    output = f.read()[-6000:]
            raise RuntimeError("building the validation index failed; " + (
                f"its output ends:\n{output}" if output.strip() else
                "its process ended with no output (killed by a signal, or out of memory?)"))
        if time.monotonic() > deadline:
            raise RuntimeError("building the validation index took over 30 minutes")
        time.sleep(0.2)
    return validate.read_portable_index(path)


def pytest_sessionfinish(session, exitstatus):
    process = _INDEX_BUILD.get("process")
    if process is not None and process.is_alive():
        if _WORKER and exitstatus != pytest.ExitCode.INTERRUPTED:
            process.join(1800)  # another worker may still read the index: this worker waits for it
        process.terminate()
        process.join(10)
    if "folder" in _INDEX_BUILD:  # the run's own process, last to finish
        import shutil

        shutil.rmtree(_INDEX_BUILD["folder"], ignore_errors=True)
