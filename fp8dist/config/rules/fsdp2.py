"""The rules of engine=fsdp2: what fully_shard, torch.optim / torchao's low-bit AdamW and CPUOffloadPolicy run."""
from __future__ import annotations

from typing import Any, Mapping

from fp8dist.config.spec import Spec
from fp8dist.errors import Issue


def check(spec: Spec, explicit: Mapping[str, Any]) -> list[Issue]:
    issues = []
    if spec.fp8.backend == "msamp":
        issues.append(Issue("engine", "MS-AMP has no FSDP2 support (msamp.fsdp patches FSDP1 internals only)",
                            spec.engine, "use engine=deepspeed, or backend=torchao for FP8 with FSDP2"))
    issues += _optimizer_states(spec)
    if spec.parallel.offload == "optimizer":
        issues.append(Issue("parallel.offload", "FSDP2 offloads parameters, gradients and the optimizer step together "
                            "(CPUOffloadPolicy); it cannot offload the optimizer alone", "optimizer",
                            "set parallel.offload=params, or run engine=deepspeed (ZeRO-Offload)"))
    return issues


def _optimizer_states(spec: Spec) -> list[Issue]:
    state, opt, weights = spec.optimizer.state_dtype, spec.optimizer.name, spec.precision.weight_dtype
    if state in ("fp8", "int8") and opt != "adamw":
        return [Issue("optimizer.state_dtype", f"{state} states come from torchao's low-bit AdamW", state,
                      "set optimizer.name=adamw")]
    if state in ("fp32", "bf16") and state != weights:
        return [Issue("optimizer.state_dtype", f"torch.optim keeps states in the dtype of the parameters it steps "
                      f"({weights} here)", state, "leave it auto, or change precision.master_weights")]
    return []
