"""fp8dist inside other frontends (Accelerate, HF Trainer): `accelerator_kwargs(config)` for
`accelerate.Accelerator`, `training_arguments_kwargs(config)` for `transformers.TrainingArguments`, and
`AuditCallback(config)`, the audit as an HF Trainer callback; for an Accelerate loop, `fp8dist.audit.watch`
around the first step (README, "Audit any run" and "Coming from Accelerate / Axolotl / DeepSpeed").

Importing this package imports neither torch nor accelerate nor transformers; each helper loads its module on
first use.
"""
from __future__ import annotations

__all__ = ["AuditCallback", "accelerator_kwargs", "training_arguments_kwargs"]


def __getattr__(name: str):
    if name == "AuditCallback":
        from fp8dist.audit.trainer_callback import AuditCallback

        return AuditCallback
    if name == "training_arguments_kwargs":
        from fp8dist.formats.accelerate.trainer import training_arguments_kwargs

        return training_arguments_kwargs
    if name == "accelerator_kwargs":
        from fp8dist.formats.accelerate.kwargs import accelerator_kwargs

        return accelerator_kwargs
    raise AttributeError(f"module 'fp8dist.integrations' has no attribute {name!r}")
