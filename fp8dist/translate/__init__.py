"""Pure translators: a validated Spec in, the plan an engine executes out, as plain JSON-able data (no torch import)."""
from fp8dist.translate.deepspeed import to_deepspeed
from fp8dist.translate.fsdp2 import to_fsdp2

__all__ = ["to_deepspeed", "to_fsdp2"]
