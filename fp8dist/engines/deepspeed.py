"""DeepSpeed runtime: `fp8dist.engines.deepspeed.initialize` mirrors `deepspeed.initialize`.

It checks the environment, applies the precision backend to the model (torchao float8 conversion,
Transformer Engine swap, MS-AMP's module marks), builds the optimizer the config names (or points the
caller's at the swapped parameters), and calls `deepspeed.initialize` with the translated config -- or,
for MS-AMP, `msamp.deepspeed.initialize` through the MS-AMP backend.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any

from fp8dist.backends.base import get_backend
from fp8dist.config.spec import Spec
from fp8dist.engines.optim import build_optimizer, offloads_optimizer, rebind_optimizer, rebind_parameters
from fp8dist.environment import device_info
from fp8dist.errors import Fp8distError, UnsupportedEnvironment
from fp8dist.translate.deepspeed import to_deepspeed


def initialize(model, spec: Spec, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, **kwargs: Any):
    """Same return tuple as deepspeed.initialize: (engine, optimizer, training_dataloader, lr_scheduler).

    The backend used is available as `engine.fp8dist_backend`, the DeepSpeed config as
    `engine.fp8dist_config`.
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
    if optimizer is None:
        params = model.parameters() if model_parameters is None else rebind_parameters(model_parameters, before, model)
        optimizer = build_optimizer(params, spec)
    else:
        _check_client_optimizer(optimizer, spec, config)
        rebind_optimizer(optimizer, before, model)
    initialize_fn = backend.deepspeed_initialize if spec.fp8.backend == "msamp" else _deepspeed_initialize()
    engine, optimizer, dataloader, scheduler = initialize_fn(
        model=model, optimizer=optimizer, training_data=training_data, lr_scheduler=lr_scheduler,
        config=config, **kwargs)
    engine.fp8dist_backend = backend
    engine.fp8dist_config = config
    engine.fp8dist_decisions = decisions
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


def _deepspeed_initialize():
    import deepspeed

    return deepspeed.initialize


def train_step(engine, batches: list[dict]) -> float:
    """One optimizer step over `batches` (DeepSpeed counts the micro-steps); returns the mean loss."""
    from fp8dist.models import forward_loss

    total = 0.0
    for batch in batches:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        with engine.fp8dist_backend.forward_context():
            loss = forward_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float().item() / len(batches)
    return total
