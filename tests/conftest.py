"""Shared test set-up: deterministic hypothesis, small helpers."""

import logging
import multiprocessing
import os
import tempfile

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
# started as soon as the suite is collected: on the second core while the first runs other
# tests, and in a fresh interpreter, where it takes 50-70 s. In the suite's own process, by
# the time the validation ran, it took 125-145 s: fx's tracer patches torch.nn.Module at every
# trace, and each patch walks every nn.Module subclass defined so far (the suite's and
# transformers'), 3,700 traces of it.
_INDEX_BUILD: dict = {}


@pytest.hookimpl(trylast=True)  # the items left after -k and -m
def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under `pytest -n` every worker collects every test, and which worker runs the
        # validation (one xdist_group) is known only when it starts: the fixture builds the
        # index then, in a process of its own, while the other workers go on.
        return
    if any("validation_index" in getattr(item, "fixturenames", ()) for item in items):
        _start_index_build()


def _start_index_build() -> None:
    if _INDEX_BUILD:
        return
    from hpfun import validate

    folder = tempfile.mkdtemp(prefix="hpfun-index-")
    path, log = os.path.join(folder, "index.pickle"), os.path.join(folder, "log.txt")
    process = multiprocessing.get_context("spawn").Process(target=validate.write_portable_index, args=(path, log),
                                                          daemon=True, name="hpfun validation index")
    process.start()
    _INDEX_BUILD.update(process=process, path=path, log=log, folder=folder)


@pytest.fixture(scope="session")
def validation_index():
    from hpfun import validate

    _start_index_build()  # (started at collection already in a run without workers)
    process, path = _INDEX_BUILD["process"], _INDEX_BUILD["path"]
    process.join(timeout=1800)
    if process.is_alive():
        process.terminate()
        raise RuntimeError("building the validation index took over 30 minutes")
    if process.exitcode != 0 or not os.path.exists(path):
        with open(_INDEX_BUILD["log"], errors="replace") as f:
            output = f.read()[-6000:]
        raise RuntimeError(f"building the validation index failed (exit code {process.exitcode}); its output "
                           f"ends:\n{output}")
    return validate.read_portable_index(path)


def pytest_sessionfinish(session, exitstatus):
    if _INDEX_BUILD:
        process = _INDEX_BUILD["process"]
        if process.is_alive():  # (an interrupted run)
            process.terminate()
            process.join(10)
        import shutil

        shutil.rmtree(_INDEX_BUILD["folder"], ignore_errors=True)
