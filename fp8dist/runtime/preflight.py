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
from fp8dist.errors import Checks, UnsupportedEnvironment
from fp8dist.machine import device_info


def translate(spec: Spec) -> dict:
    """The run's translation for its engine, made once per run and handed to the loader and the engine."""
    return facts_for(spec).translate(spec)


def preflight(spec: Spec, plan: dict | None = None) -> dict:
    """Refuse what cannot run here (UnsupportedEnvironment, ConfigError; several at once: Problems); returns the
    run's translation. A torch that cannot run stops the checks; the others are independent, and all are said."""
    installed = compat.installed_version("torch")
    ok, reason = compat.torch_supported(compat.parse_version(installed)) if installed else (False, "torch is missing")
    if not ok:
        raise UnsupportedEnvironment(reason, f"pip install 'torch>={compat.fmt(compat.TORCH_FLOOR)}'")
    device = device_info()
    checks = Checks()
    with checks.one():
        get_backend(spec).check_environment(device)
    with checks.one():
        check_optimizer_environment(spec, device)
    with checks.one():
        plan = plan or translate(spec)
    if plan is not None and spec.engine == "deepspeed":
        with checks.one():
            check_deepspeed_environment(spec, plan)
    checks.raise_found()
    return plan
