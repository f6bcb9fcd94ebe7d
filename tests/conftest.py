"""Shared test set-up: deterministic hypothesis, small helpers."""

import logging
import os

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
    summary of the whole stack, pytest's frames included: each real tensor made fake (every
    OpInfo sample of the rule validation) paid for one, a third of the validation index's time.
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
