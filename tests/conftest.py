"""Shared test set-up: deterministic hypothesis, small helpers."""

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
