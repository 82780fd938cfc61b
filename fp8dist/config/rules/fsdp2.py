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
    if spec.parallel.expert_size > 1:
        issues += _expert_parallel(spec)
    return issues


def _expert_parallel(spec: Spec) -> list[Issue]:
    """What fp8dist's FSDP2 expert parallel (engines/fsdp2/expert_parallel.py) has not run with: refused, not
    guessed."""
    par, issues = spec.parallel, []
    if par.sharding in ("hybrid", "replicate"):
        issues.append(Issue("parallel.expert_size", f"expert parallel with parallel.sharding={par.sharding}: the "
                            "experts' (efsdp, ep) mesh is built over the shard ranks only, and a replicate axis would "
                            "need its gradient all-reduce over the expert copies too (not wired)", par.expert_size,
                            "set parallel.sharding=full (or auto), or parallel.expert_size=1"))
    if par.offload == "params":
        issues.append(Issue("parallel.offload", "CPUOffloadPolicy over the experts' (efsdp, ep) DTensors has not been "
                            "run with expert parallel", "params",
                            "set parallel.offload=none, or parallel.expert_size=1"))
    if spec.compile:
        issues.append(Issue("compile", "torch.compile of blocks whose experts dispatch tokens (host-side split sizes, "
                            "uneven all-to-all) has not been run with expert parallel", True,
                            "set compile=false, or parallel.expert_size=1"))
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
