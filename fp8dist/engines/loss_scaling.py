"""Dynamic loss scaling for fp16 compute on FSDP2, with the skip decision agreed across ranks.

FSDP2 has no loss scaler of its own, and torch.amp.GradScaler decides on each rank's local gradients
only: with sharded gradients an overflow may land in one rank's shard alone, and that rank would skip
the step while the others take it. Here every rank checks its local shards, the verdict is all-reduced
(MAX), and all ranks skip together and back off the scale.

The schedule is DeepSpeed's (deepspeed/runtime/fp16/loss_scaler.py `DynamicLossScaler`, 0.19.8), with
the same knobs as its `fp16` section, so that `precision.loss_scaling` means the same on both engines:
start at 2**initial_scale_power; on overflow skip the step and, once `hysteresis` overflows have been
absorbed, halve the scale (not below min_loss_scale); after `loss_scale_window` clean steps since the
last overflow, double it. `loss_scale > 0` is a static scale (overflowing steps are still skipped).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fp8dist.config.spec import LossScalingSpec

SCALE_FACTOR = 2.0


@dataclass
class StepOutcome:
    """What the scaler decided for one optimizer step."""

    skipped: bool
    scale_before: float
    scale_after: float


class DynamicLossScaler:
    def __init__(self, settings: LossScalingSpec, group=None):
        self.dynamic = settings.loss_scale == 0
        self.scale = float(2 ** settings.initial_scale_power) if self.dynamic else float(settings.loss_scale)
        self.window = settings.loss_scale_window
        self.hysteresis = settings.hysteresis
        self.min_scale = float(settings.min_loss_scale)
        self.group = group
        self._hysteresis_left = settings.hysteresis
        self._iteration = 0
        self._last_overflow = -1

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the scale and where the growth window and hysteresis stand."""
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "iteration": self._iteration,
                "last_overflow": self._last_overflow}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._iteration = int(state["iteration"])
        self._last_overflow = int(state["last_overflow"])

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def found_inf_anywhere(self, params) -> bool:
        """True when any rank holds a non-finite gradient (local shards; one all-reduce, one host sync)."""
        device = _collective_device(self.group)
        local = [_local(p.grad) for p in params if p.grad is not None]
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        if local:
            flag += torch.stack([(~torch.isfinite(g)).any().to(device) for g in local]).any().float()
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def unscale_(self, params) -> None:
        inverse = 1.0 / self.scale
        for p in params:
            if p.grad is not None:
                _local(p.grad).mul_(inverse)

    def update(self, overflow: bool) -> StepOutcome:
        before = self.scale
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self._hysteresis_left == 1:
                    self.scale = max(self.scale / SCALE_FACTOR, self.min_scale)
                else:
                    self._hysteresis_left -= 1
                self._last_overflow = self._iteration
            elif (self._iteration - self._last_overflow) % self.window == 0:
                self._hysteresis_left = self.hysteresis
                self.scale *= SCALE_FACTOR
        self._iteration += 1
        return StepOutcome(overflow, before, self.scale)



def _collective_device(group) -> torch.device:
    """Where the flag must live for the group's backend: NCCL alone carries only CUDA tensors (gradient
    shards offloaded to the CPU included); gloo, or "cuda:nccl,cpu:gloo", takes a CPU tensor."""
    if dist.is_initialized():
        backend = str(dist.get_backend(group))
        if "nccl" in backend and "cpu:" not in backend:
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor gradient (FSDP2), the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
