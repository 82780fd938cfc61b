"""Every refusal that can be decided before a process group exists: the FP8 backend's library and hardware, the
engine's translation, and what the engine itself would reject on this machine.

The audit's and compare's parent processes, launch/train.py and the tests call this, so a config that cannot run
exits 2 with fp8dist's message before anything is launched.
"""
from __future__ import annotations

import fp8dist.compat as compat
from fp8dist.backends.base import get_backend
from fp8dist.config.spec import Spec
from fp8dist.engines.deepspeed import check_environment as check_deepspeed_environment
from fp8dist.engines.optim import check_optimizer_environment
from fp8dist.engines.registry import facts_for
from fp8dist.errors import UnsupportedEnvironment
from fp8dist.machine import device_info


def translate(spec: Spec) -> dict:
    """The run's translation for its engine, made once per run and handed to the loader and the engine."""
    return facts_for(spec).translate(spec)


def preflight(spec: Spec, plan: dict | None = None) -> dict:
    """Refuse what cannot run here (UnsupportedEnvironment, ConfigError); returns the run's translation."""
    installed = compat.installed_version("torch")
    ok, reason = compat.torch_supported(compat.parse_version(installed)) if installed else (False, "torch is missing")
    if not ok:
        raise UnsupportedEnvironment(reason, f"pip install 'torch>={compat.fmt(compat.TORCH_FLOOR)}'")
    device = device_info()
    get_backend(spec).check_environment(device)  # a missing library is the first thing to say
    check_optimizer_environment(spec, device)
    plan = plan or translate(spec)
    if spec.engine == "deepspeed":
        check_deepspeed_environment(spec, plan)
    return plan
