"""FSDP2 runtime: execute the plan of fp8dist.translate.fsdp2 on a real model.

Order (torchtitan, Accelerate fsdp2_prepare_model): upcast to the master dtype (FSDP2 wants one
original dtype per group) -> FP8 conversion -> fully_shard each block -> fully_shard the root ->
torch.compile. The optimizer gets a step post-hook for the backend (torchao float8 scale precompute).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fp8dist.backends.base import PrecisionBackend, get_backend
from fp8dist.backends.module_filter import Decision
from fp8dist.config.spec import Spec
from fp8dist.engines.collectives import ByteViewAllGather, CommRecord, RecordingReduceScatter
from fp8dist.engines.optim import build_optimizer
from fp8dist.environment import device_info
from fp8dist.errors import Fp8distError
from fp8dist.models import torch_dtype
from fp8dist.translate.fsdp2 import to_fsdp2


@dataclass
class FSDP2Run:
    """What `prepare` made: the sharded model, its optimizer, and what was decided on the way."""

    model: Any
    optimizer: Any
    backend: PrecisionBackend
    plan: dict
    decisions: list[Decision] = field(default_factory=list)
    wrapped: list[str] = field(default_factory=list)
    comm: CommRecord | None = None


def _dtype(name):
    return None if name is None else torch_dtype(name)


def wrap_units(model, spec: Spec) -> list[tuple[str, torch.nn.Module]]:
    """The modules to shard before the root: configured class names, HF `_no_split_modules`, or the
    children of the first nn.ModuleList."""
    names = spec.fsdp2.wrap
    if names == "auto":
        names = tuple(getattr(model, "_no_split_modules", None) or ())
    if names:
        units = [(n, m) for n, m in model.named_modules() if type(m).__name__ in set(names) and m is not model]
        if not units:
            raise Fp8distError(f"fsdp2.wrap: no module of class {', '.join(names)} in {type(model).__name__}; "
                               "list the transformer block class names")
        return units
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            return [(f"{name}.{i}", child) for i, child in enumerate(module)]
    return []


def _float8_all_gather(plan: dict) -> bool:
    float8 = plan.get("float8") or {}
    return bool(float8.get("float8_linear_config", {}).get("enable_fsdp_float8_all_gather"))


def prepare(model, spec: Spec, mesh=None, *, record_comm: bool = False, optimizer=None) -> FSDP2Run:
    """Make `model` an FSDP2 model with the precision of `spec`, and build its optimizer.

    `mesh`: a 1-D DeviceMesh (default: all ranks of the default process group).
    `record_comm`: record the dtype and bytes of every all-gather and reduce-scatter (audit, benchmarks).
    `optimizer`: a callable params -> optimizer (called on the sharded parameters); default: the config's.
    """
    if not dist.is_initialized():
        raise Fp8distError("fp8dist.engines.fsdp2.prepare needs torch.distributed initialised "
                           "(launch with torchrun; see launch/train.py)")
    plan = to_fsdp2(spec)
    backend = get_backend(spec)
    backend.check_environment(device_info())

    if plan["upcast_before_shard"]:
        master = _dtype(plan["upcast_before_shard"])
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != master:
                param.data = param.data.to(master)
    decisions = backend.convert_module(model)

    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    mp = plan["mixed_precision_policy"]
    policy = MixedPrecisionPolicy(param_dtype=_dtype(mp["param_dtype"]), reduce_dtype=_dtype(mp["reduce_dtype"]),
                                  output_dtype=_dtype(mp["output_dtype"]), cast_forward_inputs=mp["cast_forward_inputs"])
    offload = CPUOffloadPolicy() if plan["offload_policy"] else OffloadPolicy()
    units = wrap_units(model, spec)
    for _, unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=plan["reshard_after_forward"],
                    offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=plan["reshard_after_forward"],
                offload_policy=offload)

    record = CommRecord() if record_comm else None
    float8_on_gloo = dist.get_backend() == "gloo" and _float8_all_gather(plan)
    if record is not None or float8_on_gloo:  # the default collective is kept wherever it can carry the bytes
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(ByteViewAllGather(record))
                if record is not None:
                    module.set_custom_reduce_scatter(RecordingReduceScatter(record))

    optimizer = (optimizer or (lambda params: build_optimizer(params, spec)))(model.parameters())
    optimizer.register_step_post_hook(lambda *_: backend.after_optimizer_step(model))
    if spec.compile:
        model = torch.compile(model)
    return FSDP2Run(model, optimizer, backend, plan, decisions, [name for name, _ in units], record)


def train_step(run: FSDP2Run, batches: list[dict], clip: float) -> float:
    """One optimizer step over `batches` (gradient accumulation); returns the mean loss."""
    from fp8dist.models import forward_loss

    total = 0.0
    for i, batch in enumerate(batches):
        if isinstance(run.model, FSDPModule):  # reduce-scatter only on the last micro-batch
            run.model.set_requires_gradient_sync(i == len(batches) - 1)
        with run.backend.forward_context():
            loss = forward_loss(run.model, batch) / len(batches)
        loss.backward()
        total += loss.detach().float().item()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return total
