"""One small interface per precision backend (after Lightning Fabric's precision plugins):
check the environment, convert the module, the forward context, the hook after the optimizer step."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from fp8dist.backends.module_filter import Decision, SpeedRule, speed_rule
from fp8dist.config.spec import Spec
from fp8dist.facts.hardware import run_gpu
from fp8dist.translate.fsdp2 import FSDP2Plan


class PrecisionBackend:
    """The native backend (fp32 / bf16 / fp16, `precision.fp8.backend: none`): the engines' own mixed precision
    does all the work."""

    name = "none"
    converts_after_tensor_parallel = False
    """Whether convert_module runs after tensor parallel has split the Linears (True where the low-precision
    layer wraps the DTensor weights, as torchao's MXFP8 does), rather than before it (float8 Linears, which
    torchao's float8 TP styles require)."""

    def __init__(self, spec: Spec, plan: FSDP2Plan | None = None):
        self.spec = spec
        self._speed_rule: SpeedRule | None = None
        self._speed_resolved = False

    def check_environment(self, device: dict[str, Any]) -> None:
        """Raise UnsupportedEnvironment (with the fix) when this backend cannot run on `device`."""

    def resolve_speed_rule(self, device: dict[str, Any]) -> SpeedRule | None:
        """precision.fp8.min_speedup on `device` (hardware.gpu, or the device's name): the rule convert_module
        applies (module_filter.speed_rule; raises UnsupportedEnvironment for a number with no GPU to predict for).
        The engines and the preflight call it beside check_environment."""
        self._speed_rule = speed_rule(self.spec, run_gpu(self.spec.hardware.gpu, device.get("name")))
        self._speed_resolved = True
        return self._speed_rule

    @property
    def speed_rule(self) -> SpeedRule | None:
        """The resolved speed rule (resolved on this machine's device if nobody did)."""
        if not self._speed_resolved:
            from fp8dist.machine import device_info

            return self.resolve_speed_rule(device_info())
        return self._speed_rule

    def convert_module(self, model) -> list[Decision]:
        """Swap layers for their low-precision versions in place; return one decision per candidate layer."""
        return []

    def forward_context(self):
        """Context to run the forward pass in (Transformer Engine's autocast, for example)."""
        return nullcontext()

    def checkpoint_context_fn(self):
        """Activation checkpointing's torch.utils.checkpoint `context_fn` (returns the (forward, recompute) context
        pair): backward recomputes a checkpointed block outside forward_context(), so a backend that has one enters
        it again there. None: nothing to enter."""
        return None

    def after_optimizer_step(self, model) -> None:
        """Called after every optimizer step (torchao: precompute float8 scales for FSDP2)."""

    def at_step(self, step: int) -> None:
        """Called before optimizer step `step` (from 1; a resumed run's first is the checkpoint's step + 1):
        precision.schedule's switch acts here (torchao; the config rules refuse a schedule elsewhere)."""


# precision.fp8.backend -> its class. Each backend module registers itself (fp8dist/backends/__init__.py imports
# them all, so the registry is complete whenever this module is importable).
BACKENDS: dict[str, type[PrecisionBackend]] = {"none": PrecisionBackend}


def register(cls: type[PrecisionBackend]) -> type[PrecisionBackend]:
    """Class decorator: the backend for `precision.fp8.backend == cls.name`."""
    BACKENDS[cls.name] = cls
    return cls


def get_backend(spec: Spec, plan: FSDP2Plan | None = None) -> PrecisionBackend:
    """The backend of `spec`; `plan`: the run's FSDP2 translation (fp8dist.translate.fsdp2), whose `float8` part a
    backend takes instead of planning again."""
    return BACKENDS[spec.fp8.backend](spec, plan)
