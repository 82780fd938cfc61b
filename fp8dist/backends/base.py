"""One small interface per precision backend (after Lightning Fabric's precision plugins):
check the environment, convert the module, the forward context, the hook after the optimizer step."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from fp8dist.backends.module_filter import Decision
from fp8dist.config.spec import Spec


class PrecisionBackend:
    """The native backend (fp32 / bf16 / fp16): the engines' own mixed precision does all the work."""

    name = "native"

    def __init__(self, spec: Spec):
        self.spec = spec

    def check_environment(self, device: dict[str, Any]) -> None:
        """Raise UnsupportedEnvironment (with the fix) when this backend cannot run on `device`."""

    def convert_module(self, model) -> list[Decision]:
        """Swap layers for their low-precision versions in place; return one decision per candidate layer."""
        return []

    def forward_context(self):
        """Context to run the forward pass in (Transformer Engine's autocast, for example)."""
        return nullcontext()

    def after_optimizer_step(self, model) -> None:
        """Called after every optimizer step (torchao: precompute float8 scales for FSDP2)."""


def get_backend(spec: Spec) -> PrecisionBackend:
    backend = spec.fp8.backend
    if backend == "torchao":
        from fp8dist.backends.torchao import TorchaoFloat8

        return TorchaoFloat8(spec)
    if backend == "te":
        from fp8dist.backends.transformer_engine import TransformerEngine

        return TransformerEngine(spec)
    if backend == "msamp":
        from fp8dist.backends.msamp import MSAMP

        return MSAMP(spec)
    return PrecisionBackend(spec)
