"""FSDP2 runtime: execute the plan of fp8dist.translate.fsdp2 on a real model.

Order (torchtitan parallelize_llama, Accelerate fsdp2_prepare_model): upcast to the master dtype (FSDP2
wants one original dtype per group) -> FP8 conversion -> activation checkpointing -> torch.compile per
block, in place -> fully_shard each block, then the root, on the mesh of `parallel.sharding` -> (meta-built
models) materialise the shards and load the weights -> the optimizer. Compiling blocks in place before sharding (torchtitan apply_compile:
"per-TransformerBlock compile ... before FSDP") keeps the root an FSDPModule, so gradient accumulation
still skips the reduce-scatter of all but the last micro-batch. The optimizer gets a step post-hook for the
backend (torchao float8 scale precompute); fp16 compute gets the loss scaler (engines/loss_scaling.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fp8dist.backends.base import PrecisionBackend, get_backend
from fp8dist.backends.module_filter import Decision
from fp8dist.config.spec import Spec
from fp8dist.config.vocabulary import check_world_size, fsdp2_layout
from fp8dist.engines import activation_checkpointing
from fp8dist.engines.advice import advise_small_gemms
from fp8dist.engines.blocks import wrap_units
from fp8dist.engines.checkpoint import EngineCheckpointing
from fp8dist.engines.inspect import first_step_audit
from fp8dist.engines.loss_scaling import DynamicLossScaler, StepOutcome
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
    spec: Spec
    decisions: list[Decision] = field(default_factory=list)
    wrapped: list[str] = field(default_factory=list)
    scaler: DynamicLossScaler | None = None  # fp16 compute only
    last_step: StepOutcome | None = None
    first_step_audit: str = "warn"  # audit.first_step: warn | raise | off
    audit_report: dict | None = None  # the report of the audited first step (the first one the optimizer took)


def _dtype(name):
    return None if name is None else torch_dtype(name)


def _float8_all_gather(plan: dict) -> bool:
    float8 = plan.get("float8") or {}
    return bool(float8.get("float8_linear_config", {}).get("enable_fsdp_float8_all_gather"))


def device_mesh(spec: Spec, world: int, device_type: str):
    """The mesh of `parallel.sharding`: 1-D over all ranks (full, grad_op), or a named 2-D mesh
    (replicate, shard) for hybrid (shard = shard_size) and replicate (shard = 1). FSDP2 wants 2-D meshes
    named (torch 2.13 _fsdp_init.py _validate_mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    layout = fsdp2_layout(spec.to_dict())
    shard = world if layout["shard_size"] == "world" else layout["shard_size"]
    check_world_size(spec, world)
    if layout["strategy"] in ("full", "grad_op"):
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("dp_replicate", "dp_shard"))


def prepare(model, spec: Spec, mesh=None, *, optimizer=None, audit: str | None = None,
            materialize=None) -> FSDP2Run:
    """Make `model` an FSDP2 model with the precision of `spec`, and build its optimizer.

    `mesh`: a DeviceMesh (default: the one `parallel.sharding` describes, over the default process group).
    `optimizer`: a callable params -> optimizer (called on the sharded parameters); default: the config's.
    `audit`: what the audit of the first `train_step` does (warn | raise | off); default: audit.first_step.
    `materialize`: for a model built on the meta device (fp8dist.engines.loading.ShardOnRead), allocates the
    local shards and loads the weights once the model is sharded.
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
    advise_small_gemms(spec, model)
    units = activation_checkpointing.apply(model, wrap_units(model, spec), plan["activation_checkpointing"])
    if plan["compile"]:
        for unit in [unit for _, unit in units] or [model]:
            unit.compile()  # in place: the module object (and so the FSDP unit) stays the same

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = mesh or device_mesh(spec, dist.get_world_size(), device_type)
    mp = plan["mixed_precision_policy"]
    policy = dict(param_dtype=_dtype(mp["param_dtype"]), reduce_dtype=_dtype(mp["reduce_dtype"]),
                  cast_forward_inputs=mp["cast_forward_inputs"])
    # output_dtype applies to the model's outputs, so only the root gets it: a block returning it would hand
    # the next block (or a root-owned norm / lm_head) inputs in another dtype than its weights.
    block_policy = MixedPrecisionPolicy(**policy)
    root_policy = MixedPrecisionPolicy(**policy, output_dtype=_dtype(mp["output_dtype"]))
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if plan["offload_policy"] else OffloadPolicy()
    reshard = plan["sharding"]["reshard_after_forward"]
    for _, unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=block_policy, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=root_policy, reshard_after_forward=reshard, offload_policy=offload)
    if materialize is not None:  # offloaded shards live on the CPU (torchtitan enable_cpu_offload)
        materialize.materialize(model, "cpu" if plan["offload_policy"] else device_type)

    if dist.get_backend() == "gloo" and _float8_all_gather(plan):  # elsewhere the default collective carries them
        from fp8dist.engines.collectives import ByteViewAllGather

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(ByteViewAllGather())

    optimizer = (optimizer or (lambda params: build_optimizer(params, spec)))(model.parameters())
    optimizer.register_step_post_hook(lambda *_: backend.after_optimizer_step(model))
    scaler = None
    if plan["loss_scaling"]:
        scaler = DynamicLossScaler(spec.precision.loss_scaling)  # all ranks of the job agree on a skip
    model.fp8dist_decisions = decisions  # for the audit's engine inspector
    return FSDP2Run(model, optimizer, backend, plan, spec, decisions, [name for name, _ in units], scaler,
                    first_step_audit=audit or spec.audit.first_step)


def accumulate_gradients(run: FSDP2Run, batches: list[dict]) -> float:
    """Forward and backward over `batches` (gradient accumulation, reduce-scatter on the last micro-batch
    only); the loss is scaled where fp16 compute needs it. Returns the mean loss."""
    from fp8dist.models import forward_loss

    total = 0.0
    for i, batch in enumerate(batches):
        run.model.set_requires_gradient_sync(i == len(batches) - 1)
        with run.backend.forward_context():
            loss = forward_loss(run.model, batch) / len(batches)
        (run.scaler.scale_loss(loss) if run.scaler else loss).backward()
        total += loss.detach().float().item()
    return total


def apply_gradients(run: FSDP2Run, clip: float) -> bool:
    """Unscale (fp16), clip and step; returns False when the step was skipped because some rank saw a
    non-finite gradient (all ranks skip together; `run.last_step` says how the scale moved)."""
    params = [p for p in run.model.parameters() if p.requires_grad]
    if run.scaler is not None:
        overflow = run.scaler.found_inf_anywhere(params)
        run.last_step = run.scaler.update(overflow)
        if overflow:
            run.optimizer.zero_grad(set_to_none=True)
            return False
        run.scaler.unscale_(params)
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return True


def train_step(run: FSDP2Run, batches: list[dict], clip: float) -> float:
    """One optimizer step over `batches` (gradient accumulation); returns the mean loss. The first step runs
    under the dtype audit (fp8dist.audit.watch) unless `run.first_step_audit` is off; its report is kept in
    `run.audit_report`."""
    with first_step_audit(run.model, run.optimizer, run.spec, run.first_step_audit, run.audit_report is not None,
                          skipped=lambda: bool(run.last_step and run.last_step.skipped)) as audit:
        loss = accumulate_gradients(run, batches)
        apply_gradients(run, clip)
    if audit is not None and audit.report is not None:
        run.audit_report = audit.report
    return loss


class Checkpointing(EngineCheckpointing):
    """FSDP2 checkpoints through torch.distributed.checkpoint: every rank writes its own shards of the model
    and optimizer state (get_state_dict / set_state_dict), and any number of ranks can read them back (DCP
    reshards). torchao's float8 weight wrappers are pickled by DCP and loadable because torchao registers
    them as safe globals (torchao 0.18 float8/fsdp_utils.py; torchtitan#651 before it did). After a load
    the float8 scales precomputed for the all-gather are recomputed from the loaded weights, as after an
    optimizer step, so the next forward is the one the uninterrupted run would have made."""

    engine = "fsdp2"
    reshardable = True

    def __init__(self, run: FSDP2Run, model_name: str = "", scheduler=None):
        super().__init__(run.model, model_name, scheduler)
        self.run = run

    def _state(self) -> dict:
        model_state, optim_state = get_state_dict(self.run.model, self.run.optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def write(self, directory: Path) -> None:
        dcp.save(self._state(), checkpoint_id=directory / "dcp")

    def read(self, directory: Path) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=directory / "dcp")
        set_state_dict(self.run.model, self.run.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.run.backend.after_optimizer_step(self.run.model)

    def rank_state(self) -> dict:
        scaler = self.run.scaler.state_dict() if self.run.scaler is not None else None
        return {**super().rank_state(), "loss_scaler": scaler}

    def load_rank_state(self, state: dict) -> None:
        super().load_rank_state(state)
        if self.run.scaler is not None and state.get("loss_scaler") is not None:
            self.run.scaler.load_state_dict(state["loss_scaler"])
