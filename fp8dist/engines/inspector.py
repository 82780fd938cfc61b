"""What an engine knows about where a run keeps its numbers, for the audit to ask (fp8dist.audit.watch).

Every engine answers the same questions about a prepared model and its optimizer, whoever prepared them
(fp8dist, the user by hand, Accelerate, HF Trainer):
- `weights()`: the tensors the module stores (FSDP2: the local shards; ZeRO-3: the partitions);
- `masters()`: the tensors the optimizer steps, where they are, and whether they are a store separate
  from the module's weights (DeepSpeed's fp32 partitions) or the weights themselves (FSDP2, DDP);
- `capture_gradients(record)`: calls `record(tensors, where)` with the gradients as they are when the
  optimizer is about to step (after accumulation and reduction, before the step can free them);
- `state_optimizer()`: the torch optimizer whose `.state` holds the moments.

fp8dist.engines.registry.inspector_for(model, optimizer) recognises the engine from the objects. This module
covers the engines of torch itself (FSDP2, DDP, a plain module); DeepSpeed's answers live in
fp8dist.engines.deepspeed.inspector.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


GradientRecord = Callable[[list, str], None]


def local(tensor):
    """A DTensor's local shard (FSDP2), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def unwrap_optimizer(optimizer):
    """Accelerate's AcceleratedOptimizer (and its DeepSpeed variant) wrap the real optimizer in `.optimizer`
    (accelerate 1.15 accelerate/optimizer.py); other wrappers are the engine's own and stay."""
    while optimizer is not None and type(optimizer).__module__.startswith("accelerate.") and \
            hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


class Inspector:
    """The engines of torch itself: the optimizer is a torch optimizer that steps the module's parameters."""

    def __init__(self, engine: str, module: torch.nn.Module, optimizer, decisions: list | None = None):
        self.engine = engine
        self.module = module
        self.optimizer = optimizer
        # which Linears the FP8 backend converted: the engine's own record, else what fp8dist's prepare left on the
        # module for an inspector that only sees the objects
        self.decisions = list(decisions if decisions is not None else getattr(module, "fp8dist_decisions", []))

    def parameters(self) -> list:
        return [p for p in self.module.parameters() if p.requires_grad]

    def weights(self) -> tuple[list, str]:
        kind = "local shards of the sharded parameters" if self.engine == "fsdp2" else "module parameters"
        return [local(p) for p in self.parameters()], kind

    def masters(self) -> tuple[list, str, bool]:
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        own = {id(p) for p in self.parameters()}
        strangers = sum(1 for p in stepped if id(p) not in own)
        if strangers:  # e.g. an optimizer built before the model was upcast or sharded (Accelerate #3979)
            return ([local(p) for p in stepped],
                    f"the optimizer steps {strangers} of {len(stepped)} tensors that are not the model's parameters "
                    "(built before the model was cast or sharded?)", True)
        return [local(p) for p in stepped], "the optimizer steps the module's own parameters", False

    def state_optimizer(self):
        return self.optimizer

    def stored(self, param):
        """What this rank stores of `param` (frozen ones too): FSDP2's local shard, else the tensor."""
        return local(param)

    def left_whole(self, params: list[tuple[str, torch.Tensor]]) -> list[str]:
        """The names among `params` that every rank holds whole while FSDP2 shards the module's other parameters
        over more than one rank: fully_shard left them out (e.g. a bitsandbytes 4-bit weight in uint8 storage,
        which Accelerate keeps out of FSDP2), so their bytes do not fall with the world size. None when nothing
        is sharded (DDP, one rank, DeepSpeed, whose partitions are no DTensors)."""
        from torch.distributed.fsdp import FSDPModule

        def sharded(param) -> bool:  # split on a mesh dim of more than one rank (HSDP's (N, 1) mesh splits nothing)
            mesh = getattr(param, "device_mesh", None)
            return mesh is not None and any(placement.is_shard() and mesh.size(dim) > 1
                                            for dim, placement in enumerate(param.placements))

        if not any(isinstance(m, FSDPModule) for m in self.module.modules()) or \
                not any(sharded(p) for p in self.module.parameters()):
            return []
        return [name for name, param in params if getattr(param, "device_mesh", None) is None]

    def stepped(self) -> list:
        """The module parameters the optimizer steps (its param groups)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def pipeline_mesh(self):
        """The pp mesh of a pipeline-parallel run (the FSDP2 engine leaves it on the model it keeps, as
        `fp8dist_pipeline_mesh`): the ranks that hold the model's other stages. None without pipeline parallel."""
        return getattr(self.module, "fp8dist_pipeline_mesh", None)

    def mesh_axes(self) -> dict[frozenset[int], str]:
        """The ranks of each group this run communicates on -> its mesh axis: every named dim of the meshes its
        DTensor parameters live on (FSDP2's data axes, tensor parallel's `tp`, expert parallel's `efsdp` and `ep`),
        and pipeline parallel's `pp` (`pipeline_mesh`)."""
        from fp8dist.engines.mesh import axis_ranks, merge_axes

        axes: dict[frozenset[int], str] = {}
        meshes = {id(p.device_mesh): p.device_mesh for p in self.module.parameters() if hasattr(p, "device_mesh")}
        if self.pipeline_mesh() is not None:
            meshes[id(self.pipeline_mesh())] = self.pipeline_mesh()
        for mesh in meshes.values():
            merge_axes(axes, axis_ranks(mesh))
        return axes

    @contextlib.contextmanager
    def capture_gradients(self, record: GradientRecord) -> Iterator[None]:
        def before_step(*_):
            grads = [local(p.grad) for p in self.parameters() if p.grad is not None]
            record(grads, "gradients of the module's parameters when the optimizer steps")

        handle = self.optimizer.register_step_pre_hook(before_step)
        try:
            yield
        finally:
            handle.remove()
