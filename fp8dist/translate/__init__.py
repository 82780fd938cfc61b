"""Pure translators: a validated Spec in, the plan an engine executes out (no torch import): DeepSpeed's JSON config
as a dict, FSDP2's as a typed FSDP2Plan whose to_json() is its JSON."""
from typing import Any

from fp8dist.translate.deepspeed import to_deepspeed
from fp8dist.translate.fsdp2 import FSDP2Plan, to_fsdp2

EnginePlan = FSDP2Plan | dict[str, Any]
"""What an engine's translation returns (fp8dist.engines.profile.EngineProfile.translate): the FSDP2 plan, or the
DeepSpeed config."""

__all__ = ["EnginePlan", "FSDP2Plan", "to_deepspeed", "to_fsdp2"]
