"""What DeepSpeed knows about where a run keeps its numbers (fp8dist.engines.inspector), and how to recognise a
DeepSpeed run from its objects (a DeepSpeedEngine, or the optimizer DeepSpeed wraps: HF Trainer hands callbacks
the module, not the engine)."""
from __future__ import annotations

import contextlib
import sys

import torch

from fp8dist.backends.storage import is_scaling_tensor, is_tensor_like
from fp8dist.config.parallel import DP_SHARD, TP
from fp8dist.engines.inspector import Inspector


def recognize(model, optimizer) -> Inspector | None:
    """The DeepSpeed inspector for these objects, or None when they are not DeepSpeed's."""
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine):
        run = getattr(model, "fp8dist_run", None)
        return DeepSpeedInspector(model.module, model.optimizer, run.decisions if run is not None else None)
    # DeepSpeed's ZeRO / BF16 optimizers wrap a torch optimizer and are not torch optimizers themselves
    # (deepspeed 0.19 deepspeed/runtime/base_optimizer.py); DeepSpeedCPUAdam is a torch optimizer.
    if (type(optimizer).__module__.startswith("deepspeed.") and not isinstance(optimizer, torch.optim.Optimizer)
            and hasattr(optimizer, "optimizer")):
        return DeepSpeedInspector(model, optimizer)
    return None


_NOT_SET = object()
# Where DeepSpeed's optimizers keep the master partitions and the reduced gradients, first match wins
# (deepspeed 0.19 runtime/zero/stage_1_and_2.py, stage3.py, runtime/bf16_optimizer.py).
MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
                "fp32_groups_flat", "fp32_groups")
GRADIENT_ATTRS = ("averaged_gradients", "fp32_groups_gradients_flat", "grad_partitions_flat_buffer")


class DeepSpeedInspector(Inspector):
    """DeepSpeed's answers: ZeRO-3 weights are `ds_tensor` partitions; the optimizer DeepSpeed wraps keeps its
    own master partitions; the reduced gradients sit in its buffers until its `step()`, which is when they
    are read (the step of the optimizer object, so a loop that calls `engine.step()` and Accelerate's
    DeepSpeed wrapper, which calls it for you, are seen alike). MS-AMP's FP8 ZeRO optimizer links a 16-bit
    master to each FP8 weight (`_link_hp_param`, MS-AMP v0.4.0 msamp/deepspeed/runtime/zero/fp8_stage_1_and_2.py)."""

    def __init__(self, module, optimizer, decisions: list | None = None):
        super().__init__("deepspeed", module, optimizer, decisions)


    def mesh_axes(self) -> dict[frozenset[int], str]:
        """DeepSpeed's own groups: AutoTP's tensor-parallel group is `tp`, its data-parallel group `dp_shard` (ZeRO
        partitions over it). deepspeed 0.19 deepspeed/utils/groups.py _init_tp_mesh_device keeps both in module
        globals once AutoTP has built them (its public getters assert when they are not); without AutoTP no group
        is named and every collective counts on the data axes."""
        import torch.distributed as dist

        groups = sys.modules.get("deepspeed.utils.groups")
        tp = getattr(groups, "_TENSOR_MODEL_PARALLEL_GROUP", None)
        # The groups outlive the engine that built them (module globals): only a model AutoTP split uses them.
        split_layer = getattr(sys.modules.get("deepspeed.module_inject.layers"), "TensorParallel_Layer", None)
        if groups is None or tp is None or split_layer is None or not any(
                isinstance(module, split_layer) for module in self.module.modules()):
            return {}
        return {frozenset(dist.get_process_group_ranks(groups.get_data_parallel_group())): DP_SHARD,
                frozenset(dist.get_process_group_ranks(tp)): TP}

    def weights(self) -> tuple[list, str]:
        return [self.stored(p) for p in self.parameters()], "module parameters (ZeRO-3: partitions)"

    def masters(self) -> tuple[list, str, bool]:
        linked = [m for m in (getattr(p, "_link_hp_param", None) for p in self.parameters()) if m is not None]
        if linked:
            return linked, "MS-AMP's 16-bit master of each FP8 weight (_link_hp_param)", True
        attr, found = _first_attr(self.optimizer, MASTER_ATTRS)
        if found:
            return found, f"the optimizer's {attr}", True
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        return stepped, "no separate master copy: the optimizer steps the module parameters", False

    def state_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def stored(self, param):
        """ZeRO-3 keeps this rank's partition of a parameter in `ds_tensor` (DeepSpeed 0.19.8
        runtime/zero/partition_parameters.py); below stage 3 the parameter is whole."""
        return getattr(param, "ds_tensor", param)

    def stepped(self) -> list:
        """The module parameters the ZeRO optimizer steps: `bit16_groups` (stage 1/2, stage_1_and_2.py) or
        `fp16_groups` (stage 3, stage3.py), DeepSpeed 0.19.8; a torch optimizer's param groups otherwise."""
        groups = getattr(self.optimizer, "bit16_groups", None) or getattr(self.optimizer, "fp16_groups", None)
        return [p for group in groups for p in group] if groups is not None else super().stepped()

    @contextlib.contextmanager
    def capture_gradients(self, record):
        optimizer, step = self.optimizer, self.optimizer.step

        def step_and_record(*args, **kwargs):
            scaling = [p for p in self.parameters() if is_scaling_tensor(p)]
            if scaling:  # MS-AMP keeps the FP8 weights' gradients on the weights
                record([p.grad for p in scaling if p.grad is not None], "FP8 weights' .grad")
            else:
                attr, grads = _first_attr(optimizer, GRADIENT_ATTRS)
                masters, where, separate = self.masters()
                offloaded = [m.grad for m in masters if separate and m.grad is not None]
                if grads:
                    record(grads, f"the optimizer's {attr}")
                elif offloaded:  # ZeRO-Offload copies each reduced gradient into the fp32 partition's .grad on the
                    # CPU (stage_1_and_2.py async_inplace_copy_grad_to_fp32_buffer_from_gpu)
                    record(offloaded, f"{where}'s .grad (optimizer offload)")
                else:
                    record([p.grad for p in self.parameters() if p.grad is not None], "param.grad")
            return step(*args, **kwargs)

        own = optimizer.__dict__.get("step", _NOT_SET)  # a wrapper already on the instance (a scheduler's, a watch's)
        optimizer.step = step_and_record  # on the instance, for the watched block only
        try:
            yield
        finally:
            if optimizer.__dict__.get("step") is step_and_record:
                if own is _NOT_SET:
                    del optimizer.step
                else:
                    optimizer.step = own


def _tensors(obj) -> list:
    if is_tensor_like(obj):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


def _first_attr(obj, names) -> tuple[str | None, list]:
    for name in names:
        found = [t for t in _tensors(getattr(obj, name, None)) if t.numel() > 0]
        if found:
            return name, found
    return None, []
