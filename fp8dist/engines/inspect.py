"""What an engine knows about where a run keeps its numbers, for the audit to ask (fp8dist.audit.watch).

Every engine answers the same questions about a prepared model and its optimizer, whoever prepared them
(fp8dist, the user by hand, Accelerate, HF Trainer):
- `weights()`: the tensors the module stores (FSDP2: the local shards; ZeRO-3: the partitions);
- `masters()`: the tensors the optimizer steps, where they are, and whether they are a store separate
  from the module's weights (DeepSpeed's fp32 partitions) or the weights themselves (FSDP2, DDP);
- `capture_gradients(record)`: calls `record(tensors, where)` with the gradients as they are when the
  optimizer is about to step (after accumulation and reduction, before the step can free them);
- `state_optimizer()`: the torch optimizer whose `.state` holds the moments.

`inspector_for(model, optimizer)` recognises the engine from the objects. This module covers the engines of
torch itself (FSDP2, DDP, a plain module); DeepSpeed's answers live in fp8dist.engines.deepspeed.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import torch

from fp8dist.errors import Fp8distError

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

    def __init__(self, engine: str, module: torch.nn.Module, optimizer):
        self.engine = engine
        self.module = module
        self.optimizer = optimizer
        self.decisions = list(getattr(module, "fp8dist_decisions", []))

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


@contextlib.contextmanager
def first_step_audit(model, optimizer, spec, mode: str, done, skipped: Callable[[], bool] = lambda: False):
    """The engines' train steps: the first optimizer step under `fp8dist.audit.watch`, its table printed once on
    rank 0 and `mode` (warn | raise) applied, unless audit.first_step is off or the audit is `done`. A step the
    optimizer did not take (`skipped()`: non-finite fp16 gradients) has no gradients or states to show, so its
    observation is dropped and the next step is audited instead. Yields the Watch (its `report` None when
    dropped), or None."""
    if done or mode == "off":
        yield None
        return
    from fp8dist.audit.watching import watch

    with watch(model, optimizer, spec, on_mismatch="defer") as audit:
        yield audit
    if skipped():
        audit.report = None
        return
    audit.conclude(mode, verbose=True)


def _is_deepspeed_engine(model) -> bool:
    deepspeed = sys.modules.get("deepspeed")
    return deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine)


def _is_deepspeed_optimizer(optimizer) -> bool:
    """DeepSpeed's ZeRO / BF16 optimizers wrap a torch optimizer and are not torch optimizers themselves
    (deepspeed 0.19 deepspeed/runtime/base_optimizer.py); DeepSpeedCPUAdam is a torch optimizer."""
    return (type(optimizer).__module__.startswith("deepspeed.") and not isinstance(optimizer, torch.optim.Optimizer)
            and hasattr(optimizer, "optimizer"))


def inspector_for(model, optimizer) -> Inspector:
    """The engine that prepared `model` (and `optimizer`), recognised from the objects themselves."""
    optimizer = unwrap_optimizer(optimizer)
    if _is_deepspeed_engine(model):
        from fp8dist.engines.deepspeed import DeepSpeedInspector

        return DeepSpeedInspector(model.module, model.optimizer, engine=model)
    if _is_deepspeed_optimizer(optimizer):  # HF Trainer hands callbacks the module, not the engine
        from fp8dist.engines.deepspeed import DeepSpeedInspector

        return DeepSpeedInspector(model, optimizer)
    if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
        raise Fp8distError(f"fp8dist.audit.watch needs the optimizer that steps the model, got "
                           f"{type(optimizer).__name__}: pass the optimizer your loop calls .step() on")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return Inspector("ddp", model.module, optimizer)
    from torch.distributed.fsdp import FSDPModule

    modules = list(model.modules())
    if any(isinstance(m, FSDPModule) for m in modules):
        return Inspector("fsdp2", model, optimizer)
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in modules):
        return Inspector("fsdp1", model, optimizer)
    return Inspector("none", model, optimizer)
