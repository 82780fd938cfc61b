"""DeepSpeed engine: `initialize` mirrors `deepspeed.initialize`.

It checks the environment, applies the precision backend to the model (torchao float8 conversion, Transformer
Engine swap, MS-AMP's module marks) and then activation checkpointing to its blocks (DeepSpeed's own
activation_checkpointing section only configures its model-parallel checkpoint function, which user code must
call: runtime/activation_checkpointing/checkpointing.py), builds the optimizer the config names (or points the
caller's at the swapped parameters), and calls `deepspeed.initialize` with the translated config -- or, for
MS-AMP, `msamp.deepspeed.initialize` through the MS-AMP backend. The fp8dist side of the run (a DeepSpeedRun,
the engine interface of fp8dist.engines.base) rides on the DeepSpeedEngine as `engine.fp8dist_run`.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import TYPE_CHECKING, Any, cast

import fp8dist.engines.activation_checkpointing as activation_checkpointing
from fp8dist.backends.base import get_backend
from fp8dist.config.spec import Spec
from fp8dist.engines.advice import advise_small_gemms, say_when_fp8_is_kept_off_every_linear
from fp8dist.engines.base import Engine, FirstStepAudit, forward_loss, training_mode
from fp8dist.engines.blocks import wrap_units
from fp8dist.engines.deepspeed.checkpointing import Checkpointing
from fp8dist.engines.deepspeed.inspector import DeepSpeedInspector
from fp8dist.engines.deepspeed.jit_ops import CPU_ADAM, SHM_COMM, say_builds
from fp8dist.engines.optim import (build_optimizer, offloads_optimizer, rebind_optimizer, rebind_parameters,
                                   trainable_parameters)
from fp8dist.errors import Fp8distError, UnsupportedEnvironment
from fp8dist.facts import versions
from fp8dist.machine import device_info
from fp8dist.translate.deepspeed import to_deepspeed

if TYPE_CHECKING:
    from fp8dist.backends.msamp import MSAMP


class DeepSpeedRun(Engine):
    """fp8dist's side of a DeepSpeedEngine: its config, backend and decisions, and one optimizer step of it.
    `model` is the DeepSpeedEngine (what the loop calls), `optimizer` DeepSpeed's optimizer."""

    name = "deepspeed"

    def __init__(self, ds, config: dict, spec: Spec, backend, decisions: list, *, audit: str | None = None,
                 first_step_audit: FirstStepAudit | None = None):
        super().__init__(spec, backend, decisions, audit=audit, first_step_audit=first_step_audit)
        self.model, self.optimizer, self.config = ds, ds.optimizer, config
        self.saved_checkpoint = False  # under ZeRO-3 an engine that saved cannot load (Checkpointing.read)
        self._skipped_before = 0

    def accumulate(self, batches: list[dict]) -> float:
        """Forward and backward of every micro-batch; DeepSpeed counts the micro-steps, so each but the last is
        followed by `engine.step()` (a no-op for the optimizer before the accumulation boundary)."""
        ds, total = self.model, 0.0
        self._skipped_before = ds.skipped_steps
        for i, batch in enumerate(batches):
            batch = {k: v.to(ds.device) for k, v in batch.items()}
            with self.backend.forward_context():
                loss = forward_loss(ds, batch)
            ds.backward(loss)
            if i < len(batches) - 1:
                ds.step()
            total += loss.detach().float().item() / len(batches)
        return total

    def apply_gradients(self) -> bool:
        self.model.step()  # the accumulation boundary: unscale, clip, step (or skip on fp16 overflow)
        return self.skipped_note is None

    @property
    def skipped_note(self) -> str | None:
        return "skipped by DeepSpeed (overflow)" if self.model.skipped_steps > self._skipped_before else None

    def checkpointing(self, model_name: str = "", scheduler=None) -> Checkpointing:
        return Checkpointing(self, model_name, scheduler)

    def inspector(self) -> DeepSpeedInspector:
        return DeepSpeedInspector(self.model.module, self.optimizer, self.decisions)

    @property
    def input_device(self):
        return self.model.device


def initialize(model, spec: Spec, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, audit: str | None = None, *, plan: dict | None = None,
               first_step_audit: FirstStepAudit | None = None, **kwargs: Any):
    """Same return tuple as deepspeed.initialize: (engine, optimizer, training_dataloader, lr_scheduler).

    fp8dist's side of the run is `engine.fp8dist_run` (a DeepSpeedRun: `.config` the DeepSpeed config, `.backend`,
    `.decisions`, `.audit_report`). `audit`: what the audit of the first `train_step` does (warn | raise | off);
    default: audit.first_step. `plan`: the run's translation (fp8dist.translate.deepspeed.to_deepspeed), when
    the caller made it already. `first_step_audit`: the audit of the first step (default: fp8dist.audit's).
    """
    if spec.engine != "deepspeed":
        raise Fp8distError(f"config engine is {spec.engine!r}; fp8dist.engines.deepspeed needs engine=deepspeed")
    if "config" in kwargs or "config_params" in kwargs:
        raise Fp8distError("fp8dist builds the DeepSpeed config from the fp8dist spec; put raw keys in "
                           "deepspeed.extra instead of passing config=")
    backend = get_backend(spec)
    device = device_info()
    backend.check_environment(device)  # a missing library is the first thing to say
    backend.resolve_speed_rule(device)  # precision.fp8.min_speedup on this device (or hardware.gpu)
    training_mode(model)
    config = plan or to_deepspeed(spec)
    check_environment(spec, config)
    before = dict(model.named_parameters())
    decisions = backend.convert_module(model)
    say_when_fp8_is_kept_off_every_linear(decisions)
    advise_small_gemms(spec, model)
    if optimizer is None:
        params = (trainable_parameters(model) if model_parameters is None
                  else rebind_parameters(model_parameters, before, model))
        optimizer = build_optimizer(params, spec)
    else:
        _check_client_optimizer(optimizer, spec, config)
        rebind_optimizer(optimizer, before, model)
    # after the optimizer is bound to the backend's parameters: the wrapper renames them (by name is how the
    # rebinding finds a swapped parameter), it does not replace them
    activation_checkpointing.apply(model, wrap_units(model, spec), spec.parallel.activation_checkpointing, backend)
    _forget_earlier_torch_autocast(config)
    # get_backend gives the MSAMP backend for precision.fp8.backend=msamp
    initialize_fn = (cast("MSAMP", backend).deepspeed_initialize if spec.fp8.backend == "msamp"
                     else _deepspeed_initialize())
    engine, optimizer, dataloader, scheduler = initialize_fn(
        model=model, optimizer=optimizer, training_data=training_data, lr_scheduler=lr_scheduler,
        config=config, **kwargs)
    engine.fp8dist_run = DeepSpeedRun(engine, config, spec, backend, decisions, audit=audit,
                                      first_step_audit=first_step_audit)
    if spec.compile:
        engine.compile()  # DeepSpeedEngine.compile (0.19.8): torch.compile of the module, hooks kept
    return engine, optimizer, dataloader, scheduler


def setup(model, spec: Spec, *, optimizer=None, audit: str | None = None, plan: dict | None = None,
          first_step_audit: FirstStepAudit | None = None, materialize=None) -> DeepSpeedRun:
    """The registry's entry (fp8dist.engines.registry): `optimizer` is a callable params -> optimizer, as FSDP2's;
    a meta-built model has no place here (DeepSpeed's RAM-efficient loading builds under zero.Init)."""
    if materialize is not None:
        raise Fp8distError("a meta-built model cannot be given to DeepSpeed; RAM-efficient loading on DeepSpeed "
                           "builds the model inside deepspeed.zero.Init (fp8dist.runtime.loading)")
    client = optimizer(trainable_parameters(model)) if optimizer is not None else None
    engine, *_ = initialize(model, spec, optimizer=client, audit=audit, plan=plan,
                            first_step_audit=first_step_audit)
    return engine.fp8dist_run


def train_step(engine, batches: list[dict]) -> float:
    """One optimizer step of an engine from `initialize` over `batches`; the first one under the dtype audit
    (see fp8dist.engines.base.Engine.train_step)."""
    run = getattr(engine, "fp8dist_run", None)
    if run is None:
        raise Fp8distError("train_step needs the engine of fp8dist.engines.deepspeed.initialize")
    return run.train_step(batches)


def check_environment(spec: Spec, config: dict) -> None:
    """What DeepSpeed itself would reject here, said before any process group or model work:
    a 16-bit mode the accelerator lacks, nvme offload without the async_io op, AutoEP with a transformers it
    cannot run with, a C++ op it must build whose build lock a stopped build left (the builds it will make are
    said: jit_ops.py)."""
    accelerator = _accelerator()
    if accelerator.device_name() == "cpu":  # its collectives: a C++ op built when deepspeed.initialize starts them
        say_builds((SHM_COMM,))
    if config.get("expert_parallel", {}).get("enabled"):
        clash = autoep_registry_clash()
        if clash:
            raise UnsupportedEnvironment(
                f"parallel.expert_size={spec.parallel.expert_size} runs DeepSpeed's AutoEP, which stops inside "
                f"deepspeed.initialize on every rank with the libraries installed here: {clash}",
                "use engine=fsdp2 (fp8dist's own expert parallel), or parallel.expert_size=1, or install a "
                "transformers whose _CanRecordRegistry.get takes a default (as dict.get does)")
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
        say_builds((CPU_ADAM,))
    if "nvme" in (spec.deepspeed.offload_optimizer, spec.deepspeed.offload_param):
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            raise UnsupportedEnvironment("nvme offload needs DeepSpeed's async_io op, which cannot be built here "
                                         "(libaio is missing)",
                                         "install libaio-dev (apt) on the training nodes, or offload to cpu")


def autoep_registry_clash() -> str | None:
    """Why DeepSpeed's AutoEP cannot swap MoE layers next to the installed transformers, or None where it can.

    After swapping a MoE layer, AutoEP points transformers' router-logit recorders at its own router and restores
    transformers' output-capture registry, reading each entry as `registry.get(key, _MISSING_REGISTRY_ENTRY)`
    (deepspeed 0.19.8 module_inject/auto_ep_presets/base.py _install_instance_transformers_output_recorders).
    transformers 5.24's registry overrides dict.get with a one-argument get(model) (utils/output_capturing.py
    _CanRecordRegistry), so that call raises TypeError. Probed on the installed libraries, not by version: DeepSpeed's
    side by the default it passes (the module's _MISSING_REGISTRY_ENTRY), transformers' by the signature of its get.
    Imports DeepSpeed and transformers."""
    try:
        from deepspeed.module_inject.auto_ep_presets import base as autoep_presets
        from transformers.utils import output_capturing
    except ImportError:  # a DeepSpeed without AutoEP (translate refuses it) or no transformers: nothing to clash
        return None
    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    # AutoEP skips a registry that is not a dict (base.py _retarget_transformers_output_recorders_for_modules)
    if not hasattr(autoep_presets, "_MISSING_REGISTRY_ENTRY") or not isinstance(registry, dict):
        return None
    try:
        inspect.signature(registry.get).bind("key", autoep_presets._MISSING_REGISTRY_ENTRY)
        return None
    except TypeError:
        return (f"DeepSpeed {versions.installed_version('deepspeed')} (deepspeed/module_inject/auto_ep_presets/"
                "base.py) reads transformers' output-capture registry as registry.get(key, default), and transformers "
                f"{versions.installed_version('transformers')} (transformers/utils/output_capturing.py) registers "
                f"{type(registry).__qualname__}.get{inspect.signature(registry.get)}, which takes no default: "
                "TypeError")


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
                           f"the CPU, and DeepSpeed accepts only its CPU optimizers there (DeepSpeedCPUAdam, "
                           "DeepSpeedCPULion), not "
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
    autocast: Any = sys.modules.get("deepspeed.runtime.torch_autocast")  # its globals are DeepSpeed's, untyped
    if autocast is not None and getattr(autocast, "TORCH_AUTOCAST_INITIALIZED", False):
        autocast.TORCH_AUTOCAST_INITIALIZED = False
        autocast.TORCH_AUTOCAST_DTYPE = None


def _deepspeed_initialize():
    import deepspeed

    return deepspeed.initialize
