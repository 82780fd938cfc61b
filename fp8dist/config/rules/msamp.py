"""The rules of precision.fp8.backend=msamp: what MS-AMP's DeepSpeed integration runs (it has no FSDP2 one: the
FSDP2 rules refuse it there)."""
from __future__ import annotations

from typing import Any, Mapping

from fp8dist.config.spec import Spec
from fp8dist.errors import Issue


def check(spec: Spec, explicit: Mapping[str, Any]) -> list[Issue]:
    ds, opt, level = spec.deepspeed, spec.optimizer, spec.fp8.msamp.opt_level
    issues = []
    if level == "O3" and ds.zero_stage not in (1, 2):
        issues.append(Issue("deepspeed.zero_stage", "MS-AMP O3 needs ZeRO stage 1 or 2 "
                            "(msamp/deepspeed/runtime/config.py asserts it)", ds.zero_stage,
                            "set deepspeed.zero_stage=2 (or 1)"))
    elif ds.zero_stage == 3:
        issues.append(Issue("deepspeed.zero_stage", "MS-AMP does not work with ZeRO-3 (Azure/MS-AMP#182)", 3,
                            "set deepspeed.zero_stage to 0, 1 or 2"))
    if opt.name not in ("adam", "adamw"):
        issues.append(Issue("optimizer.name", "msamp.initialize accepts Adam/AdamW only", opt.name,
                            "set optimizer.name=adamw"))
    if opt.state_dtype != "auto":
        issues.append(Issue("optimizer.state_dtype", "MS-AMP decides the optimizer-state dtypes from opt_level",
                            opt.state_dtype, "set optimizer.state_dtype=auto"))
    for key, offload in (("offload_optimizer", ds.offload_optimizer), ("offload_param", ds.offload_param)):
        if offload != "none":
            issues.append(Issue(f"deepspeed.{key}", "MS-AMP cannot step DeepSpeedCPUAdam; offload is unsupported",
                                offload, f"set deepspeed.{key}=none"))
    if spec.precision.mixed_precision == "bf16" and ds.zero_stage == 1 and ds.grad_accum_dtype == "fp32":
        issues.append(Issue("deepspeed.grad_accum_dtype", "bf16 + ZeRO-1 + fp32 accumulation makes DeepSpeed pick "
                            "BF16_Optimizer, which bypasses MS-AMP's FP8 ZeRO optimizer", "fp32",
                            "leave deepspeed.grad_accum_dtype unset"))
    if spec.precision.mixed_precision == "none":
        issues.append(Issue("precision.mixed_precision", "MS-AMP runs on DeepSpeed's fp16 or bf16 mode", "none",
                            "set precision.mixed_precision=fp16 (MS-AMP's examples) or bf16"))
    if spec.parallel.tensor_size > 1:
        issues.append(Issue("parallel.tensor_size", "MS-AMP's FP8 tensor parallel exists only through Megatron-LM "
                            "(MS-AMP v0.4.0 msamp/megatron); DeepSpeed AutoTP would replace its FP8 Linears",
                            spec.parallel.tensor_size, "set parallel.tensor_size=1, or use engine=fsdp2 with "
                            "precision.fp8.backend=torchao"))
    return issues
