"""DeepSpeed runtime: `fp8dist.engines.deepspeed.initialize` mirrors `deepspeed.initialize`.

It checks the environment, applies the precision backend to the model (torchao float8 conversion,
Transformer Engine swap, MS-AMP's module marks) and then activation checkpointing to its blocks
(DeepSpeed's own activation_checkpointing section only configures its model-parallel checkpoint function,
which user code must call: runtime/activation_checkpointing/checkpointing.py), builds the optimizer the config names (or points the
caller's at the swapped parameters), and calls `deepspeed.initialize` with the translated config -- or,
for MS-AMP, `msamp.deepspeed.initialize` through the MS-AMP backend.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from fp8dist.audit.formats import is_scaling_tensor, is_tensor_like
from fp8dist.backends.base import get_backend
from fp8dist.config.spec import Spec
from fp8dist.engines import activation_checkpointing
from fp8dist.engines.advice import advise_small_gemms
from fp8dist.engines.blocks import wrap_units
from fp8dist.engines.checkpoint import EngineCheckpointing
from fp8dist.engines.inspect import Inspector, first_step_audit
from fp8dist.engines.optim import build_optimizer, offloads_optimizer, rebind_optimizer, rebind_parameters
from fp8dist.environment import device_info
from fp8dist.errors import Fp8distError, UnsupportedEnvironment
from fp8dist.translate.deepspeed import to_deepspeed


def initialize(model, spec: Spec, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, audit: str | None = None, **kwargs: Any):
    """Same return tuple as deepspeed.initialize: (engine, optimizer, training_dataloader, lr_scheduler).

    The backend used is available as `engine.fp8dist_backend`, the DeepSpeed config as
    `engine.fp8dist_config`. `audit`: what the audit of the first `train_step` does (warn | raise | off);
    default: audit.first_step. Its report is kept in `engine.fp8dist_audit_report`.
    """
    if spec.engine != "deepspeed":
        raise Fp8distError(f"config engine is {spec.engine!r}; fp8dist.engines.deepspeed needs engine=deepspeed")
    if "config" in kwargs or "config_params" in kwargs:
        raise Fp8distError("fp8dist builds the DeepSpeed config from the fp8dist spec; put raw keys in "
                           "deepspeed.extra instead of passing config=")
    backend = get_backend(spec)
    backend.check_environment(device_info())  # a missing library is the first thing to say
    config = to_deepspeed(spec)
    check_environment(spec, config)
    before = dict(model.named_parameters())
    decisions = backend.convert_module(model)
    advise_small_gemms(spec, model)
    if optimizer is None:
        params = model.parameters() if model_parameters is None else rebind_parameters(model_parameters, before, model)
        optimizer = build_optimizer(params, spec)
    else:
        _check_client_optimizer(optimizer, spec, config)
        rebind_optimizer(optimizer, before, model)
    # after the optimizer is bound to the backend's parameters: the wrapper renames them (by name is how the
    # rebinding finds a swapped parameter), it does not replace them
    activation_checkpointing.apply(model, wrap_units(model, spec), spec.parallel.activation_checkpointing)
    _forget_earlier_torch_autocast(config)
    initialize_fn = backend.deepspeed_initialize if spec.fp8.backend == "msamp" else _deepspeed_initialize()
    engine, optimizer, dataloader, scheduler = initialize_fn(
        model=model, optimizer=optimizer, training_data=training_data, lr_scheduler=lr_scheduler,
        config=config, **kwargs)
    engine.fp8dist_backend = backend
    engine.fp8dist_config = config
    engine.fp8dist_decisions = decisions
    engine.fp8dist_spec = spec
    engine.fp8dist_first_step_audit = audit or spec.audit.first_step
    engine.fp8dist_audit_report = None
    if spec.compile:
        engine.compile()  # DeepSpeedEngine.compile (0.19.8): torch.compile of the module, hooks kept
    return engine, optimizer, dataloader, scheduler


def check_environment(spec: Spec, config: dict) -> None:
    """What DeepSpeed itself would reject here, said before any process group or model work:
    a 16-bit mode the accelerator lacks, nvme offload without the async_io op."""
    accelerator = _accelerator()
    if config.get("fp16", {}).get("enabled") and not accelerator.is_fp16_supported():
        raise UnsupportedEnvironment(
            f"precision.mixed_precision=fp16 with master_weights={spec.precision.master_weights} maps to DeepSpeed's "
            f"fp16 section, which the {accelerator.device_name()} accelerator here does not support "
            "(DeepSpeedEngine._do_sanity_check: 'Type fp16 is not supported on your device')",
            "run on a CUDA GPU, or use mixed_precision=bf16 here")
    if offloads_optimizer(spec) and spec.optimizer.name in ("adam", "adamw"):
        builder = accelerator.get_op_builder("CPUAdamBuilder")
        if builder is None or not builder().is_compatible(verbose=False):
            raise UnsupportedEnvironment("deepspeed.offload_optimizer steps with DeepSpeedCPUAdam, whose C++ op cannot "
                                         f"be built on the {accelerator.device_name()} accelerator here",
                                         "install a C++ compiler and the Python headers (the op is JIT-built), "
                                         "or set deepspeed.offload_optimizer=none")
    if "nvme" in (spec.deepspeed.offload_optimizer, spec.deepspeed.offload_param):
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            raise UnsupportedEnvironment("nvme offload needs DeepSpeed's async_io op, which cannot be built here "
                                         "(libaio is missing)",
                                         "install libaio-dev (apt) on the training nodes, or offload to cpu")


def _accelerator():
    """DeepSpeed's accelerator. Importing DeepSpeed sets up its logger on stdout and logs the accelerator it
    picks; done here first, both go to stderr, so a report on stdout (the audit's JSON) stays clean."""
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.accelerator import get_accelerator

        return get_accelerator()


def _check_client_optimizer(optimizer, spec: Spec, config: dict) -> None:
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.lion import DeepSpeedCPULion

    if (offloads_optimizer(spec) and not isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPULion))
            and config.get("zero_force_ds_cpu_optimizer", True)):
        raise Fp8distError(f"deepspeed.offload_optimizer={spec.deepspeed.offload_optimizer} steps the optimizer on "
                           f"the CPU, and DeepSpeed accepts only its CPU optimizers there (DeepSpeedCPUAdam, DeepSpeedCPULion), not "
                           f"{type(optimizer).__name__}"
                           "\n  fix: pass no optimizer (fp8dist builds DeepSpeedCPUAdam from `optimizer`), pass a "
                           "deepspeed.ops.adam.DeepSpeedCPUAdam, or set "
                           "deepspeed.extra.zero_force_ds_cpu_optimizer=false to step yours on the CPU (slow)")


def _forget_earlier_torch_autocast(config: dict) -> None:
    """DeepSpeed 0.19.8 records torch_autocast in module globals that no engine resets
    (runtime/torch_autocast.py TORCH_AUTOCAST_INITIALIZED, "TODO: Avoid using global variables"): an engine
    without torch_autocast, built in a process where an earlier engine had it, reduces every gradient in its
    parameter's dtype and ignores communication_data_type (stage_1_and_2.py ipg_buckets). The audit saw bf16
    gradient all-reduces where fp32 was configured. Reset them when this engine does not use torch_autocast."""
    if config.get("torch_autocast", {}).get("enabled"):
        return
    autocast = sys.modules.get("deepspeed.runtime.torch_autocast")
    if autocast is not None and getattr(autocast, "TORCH_AUTOCAST_INITIALIZED", False):
        autocast.TORCH_AUTOCAST_INITIALIZED = False
        autocast.TORCH_AUTOCAST_DTYPE = None


def _deepspeed_initialize():
    import deepspeed

    return deepspeed.initialize


def train_step(engine, batches: list[dict]) -> float:
    """One optimizer step over `batches` (DeepSpeed counts the micro-steps); returns the mean loss. The first
    step of an engine from `initialize` runs under the dtype audit unless its audit is off."""
    from fp8dist.models import forward_loss

    total, skipped_before = 0.0, engine.skipped_steps
    with first_step_audit(engine, engine.optimizer, engine.fp8dist_spec, engine.fp8dist_first_step_audit,
                          engine.fp8dist_audit_report is not None,
                          skipped=lambda: engine.skipped_steps > skipped_before) as audit:
        for batch in batches:
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            with engine.fp8dist_backend.forward_context():
                loss = forward_loss(engine, batch)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().item() / len(batches)
    if audit is not None and audit.report is not None:
        engine.fp8dist_audit_report = audit.report
    return total


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

    def __init__(self, module, optimizer, engine=None):
        super().__init__("deepspeed", module, optimizer)
        self.decisions = list(getattr(engine, "fp8dist_decisions", None) or self.decisions)

    def weights(self) -> tuple[list, str]:
        return [getattr(p, "ds_tensor", p) for p in self.parameters()], "module parameters (ZeRO-3: partitions)"

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


class Checkpointing(EngineCheckpointing):
    """DeepSpeed checkpoints through its own `engine.save_checkpoint` / `load_checkpoint` (every rank writes its
    optimizer partition; the engine keeps its LR scheduler and loss scaler in them), under the tag
    `deepspeed`. ZeRO partitions are tied to the world size that wrote them (DeepSpeed refuses another one
    without its universal-checkpoint conversion), so this is not reshardable."""

    engine = "deepspeed"
    reshardable = False
    TAG = "deepspeed"

    def __init__(self, engine, model_name: str = "", scheduler=None):
        # the engine's own scheduler is in DeepSpeed's files already
        super().__init__(engine.module, model_name, None if scheduler is engine.lr_scheduler else scheduler)
        self.ds = engine

    def shape(self, param) -> list[int]:
        return list(getattr(param, "ds_shape", param.shape))  # ZeRO-3 parameters are empty outside forward

    def write(self, directory: Path) -> None:
        self.ds.save_checkpoint(str(directory), tag=self.TAG, client_state={}, save_latest=False)
        self.ds.fp8dist_saved_checkpoint = True

    def read(self, directory: Path) -> None:
        if self.ds.zero_optimization_stage() == 3 and getattr(self.ds, "fp8dist_saved_checkpoint", False):
            # deepspeed 0.19 runtime/engine.py load_checkpoint docstring: under ZeRO-3 an engine cannot load
            # right after it saved
            raise Fp8distError("DeepSpeed ZeRO-3 cannot load a checkpoint into an engine that has saved one"
                               "\n  fix: build a new engine with fp8dist.engines.deepspeed.initialize, then resume")
        path, _ = self.ds.load_checkpoint(str(directory), tag=self.TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
        if path is None:
            raise Fp8distError(f"{directory}: DeepSpeed found no checkpoint under tag {self.TAG!r}"
                               f"\n  fix: delete {directory} to resume from the checkpoint before it")
