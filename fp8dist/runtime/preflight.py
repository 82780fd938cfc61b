"""Every refusal that can be decided before a process group exists: the FP8 backend's library and hardware, the
engine's translation, and what the engine itself would reject on this machine.

The audit's and compare's parent processes, launch/train.py and the tests call this, so a config that cannot run
exits 2 with fp8dist's message before anything is launched.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from fp8dist.backends.base import get_backend
from fp8dist.config.load import load_config
from fp8dist.config.spec import Spec
from fp8dist.engines.optim import check_optimizer_environment
from fp8dist.engines.registry import profile_for
from fp8dist.errors import Checks, ConfigError, Issue, UnsupportedEnvironment
from fp8dist.facts import versions
from fp8dist.facts.torch import TORCH_FLOOR, torch_supported
from fp8dist.facts.versions import fmt, parse_version
from fp8dist.machine import device_info
from fp8dist.translate import EnginePlan


def translate(spec: Spec) -> EnginePlan:
    """The run's translation for its engine, made once per run and handed to the loader and the engine."""
    return profile_for(spec).translate(spec)


def preflight(spec: Spec, plan: EnginePlan | None = None) -> EnginePlan:
    """Refuse what cannot run here (UnsupportedEnvironment, ConfigError; several at once: Problems); returns the
    run's translation. A torch that cannot run stops the checks; the others are independent, and all are said, with
    what the config would be refused for once a refusal's fix is made (refused_once_fixed)."""
    installed = versions.installed_version("torch")
    ok, reason = torch_supported(parse_version(installed)) if installed else (False, "torch is missing")
    if not ok:
        raise UnsupportedEnvironment(reason, f"pip install 'torch>={fmt(TORCH_FLOOR)}'")
    device = device_info()
    checks = Checks()
    with checks.one():
        backend = get_backend(spec)
        backend.check_environment(device)
        backend.resolve_speed_rule(device)  # precision.fp8.min_speedup: a number needs a GPU to predict for
    with checks.one():
        check_optimizer_environment(spec, device)
    with checks.one():
        plan = plan or translate(spec)
    if plan is not None:
        with checks.one():
            profile_for(spec).check_environment(spec, plan)
    for error in list(checks.errors):
        if isinstance(error, UnsupportedEnvironment) and error.fix_settings:
            refused = refused_once_fixed(spec, error.fix_settings)
            if refused is not None:
                checks.add(refused)
    checks.raise_found()
    return plan


def refused_once_fixed(spec: Spec, settings: Mapping[str, Any]) -> ConfigError | None:
    """What the config is refused for once the settings a refusal's fix names are made (precision.fp8.torchao.emulate
    =true on a machine without FP8, where the config compiles): said with that refusal, so that both changes are made
    at once. Only the issues the settings bring: the config was valid without them."""
    overrides = [f"{key}={json.dumps(value)}" for key, value in settings.items()]
    before = _issues(spec, ())
    after = [issue for issue in _issues(spec, overrides) if issue not in before]
    return ConfigError(after, f"{spec.source} once {', '.join(overrides)} is set (the fix above)") if after else None


def _issues(spec: Spec, overrides: Sequence[str]) -> list[Issue]:
    try:
        load_config(spec.to_dict(), overrides=overrides)
    except ConfigError as exc:
        return exc.issues
    return []
