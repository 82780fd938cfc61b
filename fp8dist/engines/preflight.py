"""Every refusal that can be decided before a process group exists: the FP8 backend's library and
hardware, the engine's translation, and what the engine itself would reject on this machine.

The audit's parent process, launch/train.py and the tests call this, so a config that cannot run
exits 2 with fp8dist's message before anything is launched.
"""
from __future__ import annotations

from fp8dist.config.spec import Spec
from fp8dist.errors import UnsupportedEnvironment


def preflight(spec: Spec) -> None:
    from fp8dist import compat
    from fp8dist.backends.base import get_backend
    from fp8dist.engines.optim import check_optimizer_environment
    from fp8dist.environment import device_info

    installed = compat.installed_version("torch")
    ok, reason = compat.torch_supported(compat.parse_version(installed)) if installed else (False, "torch is missing")
    if not ok:
        raise UnsupportedEnvironment(reason, f"pip install 'torch>={compat.fmt(compat.TORCH_FLOOR)}'")
    device = device_info()
    get_backend(spec).check_environment(device)
    check_optimizer_environment(spec, device)
    if spec.engine == "deepspeed":
        from fp8dist.engines.deepspeed import check_environment
        from fp8dist.translate.deepspeed import to_deepspeed

        check_environment(spec, to_deepspeed(spec))
    else:
        from fp8dist.translate.fsdp2 import to_fsdp2

        to_fsdp2(spec)
