"""Pure translators: a validated Spec in, a plain JSON-able document out (no torch import)."""
from fp8dist.translate.accelerate import to_accelerate
from fp8dist.translate.deepspeed import to_deepspeed
from fp8dist.translate.fsdp2 import to_fsdp2

TARGETS = {"deepspeed": to_deepspeed, "fsdp2": to_fsdp2, "accelerate": to_accelerate}
