"""Start-up messages of the libraries fp8dist drives that are known to be benign, filtered in this one place.

Each entry names the logger (or, for a Python warning, its category and module), what the message says, where it
comes from upstream, and why it says nothing about the user's run. A record is dropped only when its logger, its
text and the stated condition all match: a message about the run itself (a dtype, a fallback, a failed kernel the
run needs) always gets through.

`install()` attaches the filters to the named loggers without importing any of those libraries (logging keeps the
logger objects, and a library that later adds its handlers keeps the filters), so it runs on `import fp8dist`,
before torchao or DeepSpeed load, in every fp8dist process: the CLI, the launch scripts, the rank processes and a
user's own script that imports fp8dist first.
"""
from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from typing import Callable


def _no_cuda() -> bool:
    """True when torch sees no CUDA device: the CUDA-only kernels and accelerators cannot matter to this run.
    torch is already imported whenever one of these records is emitted (torchao and DeepSpeed import it first)."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and not torch.cuda.is_available()


def _registered_by_torchao(record: logging.LogRecord) -> bool:
    args = record.args if isinstance(record.args, tuple) else ()
    return bool(args) and getattr(args[0], "__module__", "").startswith("torchao")


@dataclass(frozen=True)
class BenignMessage:
    logger: str
    pattern: str  # a regular expression searched in the formatted message
    source: str  # where upstream emits it
    why: str  # why it is benign on the paths fp8dist runs
    when: Callable[[logging.LogRecord], bool] = lambda record: True

    def matches(self, record: logging.LogRecord) -> bool:
        return bool(re.search(self.pattern, record.getMessage())) and self.when(record)


BENIGN = (
    BenignMessage(
        logger="torchao",
        pattern=r"^Failed to load \S*_C_(mxfp8|cutlass_90a)\S*\.so",
        source="torchao 0.18 torchao/__init__.py (logger.warning while loading every _C*.so next to the package)",
        why="these extensions hold CUDA kernels (MXFP8 casts, SM90 CUTLASS GEMMs); on a machine without CUDA no "
            "run can call them, and torchao's CPU and emulated paths do not use them. With CUDA the message is "
            "kept: a run on that GPU may need the kernel.",
        when=lambda record: _no_cuda()),
    BenignMessage(
        logger="torch.utils._pytree",
        pattern=r"is an Enum subclass and is now natively supported by torch\.compile",
        source="torch 2.13 torch/utils/_pytree.py _private_register_pytree_node (log.warning), triggered by torchao "
               "registering its KernelPreference enum at import",
        why="a deprecation of how torchao registers its own enum with torch.compile; it changes nothing in a run. "
            "Only registrations of torchao's classes are filtered.",
        when=_registered_by_torchao),
    BenignMessage(
        logger="DeepSpeed",
        pattern=r"^Setting accelerator to CPU\. If you have GPU",
        source="DeepSpeed 0.19 deepspeed/accelerator/real_accelerator.py get_accelerator (accel_logger.warning when "
               "auto-detection finds no accelerator)",
        why="on a machine where torch sees no CUDA device the run is a CPU run by fp8dist's choice too (`fp8dist env` "
            "says so); with a CUDA device visible the message is kept.",
        when=lambda record: _no_cuda()),
    BenignMessage(
        logger="torch.distributed.tensor._redistribute",
        pattern=r"redistributing from \((Partial\(max\)(, )?)+\) to \((Replicate\(\)(, )?)+\), \d+ sequential "
                r"all_reduce operations",
        source="torch 2.13 torch/distributed/tensor/_redistribute.py (logger.warning when a Partial DTensor spans "
               "several mesh dims), triggered by torchao's precompute_float8_dynamic_scale_for_fsdp taking the amax "
               "of weights sharded over (dp_shard, tp) (torchao 0.18 torchao/float8/fsdp_utils.py)",
        why="a latency hint for one scalar per weight; a max is the same in any reduction order, so the warning's "
            "'inconsistent results between ranks' cannot happen for it. Other partial reductions are kept.",
    ),
)


@dataclass(frozen=True)
class BenignWarning:
    """A Python warning (warnings.warn) known to be benign: ignored by a warnings filter on its category, the module
    that warns and the start of its text."""
    category: type[Warning]
    module: str  # the module that calls warnings.warn (a regular expression, as warnings.filterwarnings takes it)
    message: str  # a regular expression matched at the start of the text
    source: str
    why: str


BENIGN_WARNINGS = (
    BenignWarning(
        category=FutureWarning,
        module=r"transformers\.modeling_utils",
        message=r"`is_gradient_checkpointing` is deprecated",
        source="transformers 5.24 modeling_utils.py PreTrainedModel.is_gradient_checkpointing (a deprecated property "
               "that warns when read), read by peft 0.21 peft_model.py PeftModel.__init__ (getattr(model, "
               "'is_gradient_checkpointing', True)) as fp8dist applies the LoRA adapters, once per rank",
        why="PEFT's read of the deprecated name, not the user's: the property returns is_activation_checkpointing, "
            "unchanged, and the run's checkpointing is fp8dist's parallel.activation_checkpointing. A user's own "
            "read of the name loses the deprecation notice too."),
)


class _BenignFilter(logging.Filter):
    def __init__(self, messages: tuple[BenignMessage, ...]):
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(message.matches(record) for message in self.messages)


def install() -> None:
    """Attach one filter per logger named in BENIGN, and a warnings filter per BENIGN_WARNINGS entry (idempotent:
    warnings.filterwarnings replaces an equal filter)."""
    for name in {message.logger for message in BENIGN}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _BenignFilter) for f in logger.filters):
            logger.addFilter(_BenignFilter(tuple(m for m in BENIGN if m.logger == name)))
    for warning in BENIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=warning.message, category=warning.category, module=warning.module)
