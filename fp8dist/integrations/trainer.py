"""fp8dist with `transformers.Trainer`: `training_arguments_kwargs(config)` and `AuditCallback(config)`.

    args = TrainingArguments(output_dir="out", **training_arguments_kwargs("fp8dist.yaml"))

`training_arguments_kwargs` gives bf16/fp16, the DeepSpeed dict (fp8dist's translation) or fsdp + fsdp_config
(FSDP2), torch_compile, activation checkpointing, the optimizer (optim, lr, betas, eps, weight decay) and the batch,
accumulation and clipping the DeepSpeed dict also holds; what the Trainer cannot express through Accelerate is
refused with the key (docs/accelerate.md), never dropped. max_steps, seed and the rest stay yours.

`AuditCallback`: the dtype audit of the first optimizer step of `transformers.Trainer.train()`.

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[AuditCallback("fp8dist.yaml")])
    trainer.train()                      # step 1 is observed; the table is printed once on rank 0
    trainer.callback_handler.callbacks[-1].report

The watch opens at `on_step_begin` of the first step and closes at its `on_step_end`, so it sees every
micro-batch's forward and backward, the gradient reduction, and the optimizer step, as the Trainer runs them
(transformers 5 trainer.py `_inner_training_loop`). The Trainer hands callbacks the unwrapped model and its
optimizer; the engine is recognised from them (DeepSpeed from its optimizer, FSDP2 from the sharded model,
DDP from the gradient all-reduces on the wire).
"""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from fp8dist.audit.watching import watch
from fp8dist.errors import ConfigError, Issue
from fp8dist.integrations.accelerate import as_spec, hybrid_sizes, resolve_world_size
from fp8dist.translate.accelerate import accelerate_plan


class AuditCallback(TrainerCallback):
    """config: fp8dist config (path, dict or Spec) the run is meant to follow. on_mismatch: warn (default:
    one table on rank 0) | raise (fp8dist.audit.AuditMismatch ends `train()` on every rank) | ignore.
    After step 1: `report` (the `fp8dist audit --format json` document) and `passed`."""

    def __init__(self, config, on_mismatch: str = "warn"):
        self.config, self.on_mismatch = config, on_mismatch
        self.report: dict | None = None
        self.passed: bool | None = None
        self._watch = None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.report is None and self._watch is None:
            self._watch = watch(model, optimizer, self.config, on_mismatch=self.on_mismatch, verbose=True,
                                name=type(model).__name__)
            self._watch.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._watch is not None:
            audit, self._watch = self._watch, None
            try:
                audit.__exit__(None, None, None)
            finally:
                self.report, self.passed = audit.report, audit.passed


def training_arguments_kwargs(config, *, world_size: int | None = None,
                              deepspeed_version: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `transformers.TrainingArguments` (transformers 5) equivalent to `config` (path, dict or
    Spec); add output_dir and the rest of your run's own settings."""
    spec = as_spec(config)
    plan = accelerate_plan(spec, "trainer", deepspeed_version=deepspeed_version)
    o, t = spec.optimizer, spec.train
    kwargs: dict[str, Any] = {
        "per_device_train_batch_size": t.micro_batch_size, "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "max_grad_norm": float(t.gradient_clipping), "learning_rate": o.lr, "weight_decay": o.weight_decay,
        "adam_beta1": o.betas[0], "adam_beta2": o.betas[1], "adam_epsilon": o.eps, "optim": _optim(spec),
        "torch_compile": spec.compile,
    }  # train.steps and train.seed are fp8dist's own runs' (launch/train.py, the audit): max_steps and seed stay yours
    if plan["fsdp"]:
        fs = plan["fsdp"]
        kwargs.update(bf16=plan["mixed_precision"] == "bf16", fp16=plan["mixed_precision"] == "fp16", fsdp=True)
        # transformers 5 training_args.py _process_fsdp_args reads these keys into FullyShardedDataParallelPlugin.
        fsdp_config = {"version": 2, "reshard_after_forward": fs["reshard_after_forward"],
                       "cpu_offload": fs["offload_params"], "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                       "cpu_ram_efficient_loading": fs["cpu_ram_efficient_loading"],
                       "activation_checkpointing": fs["activation_checkpointing"]}
        if fs["wrap"]:
            fsdp_config["transformer_layer_cls_to_wrap"] = fs["wrap"]
        kwargs["fsdp_config"] = fsdp_config
        if fs["parallelism"]:
            from accelerate import ParallelismConfig

            kwargs["parallelism_config"] = ParallelismConfig(
                **hybrid_sizes(spec.parallel.shard_size, resolve_world_size(world_size)))
    else:
        ds = plan["deepspeed"]["config"]
        # HfTrainerDeepSpeedConfig checks bf16/fp16.enabled against these flags (integrations/deepspeed.py).
        kwargs.update(bf16=bool((ds.get("bf16") or {}).get("enabled")), fp16=bool((ds.get("fp16") or {}).get("enabled")),
                      deepspeed=ds)
        if spec.parallel.activation_checkpointing == "full":
            kwargs["activation_checkpointing"] = True
    return kwargs


def _optim(spec) -> str:
    """TrainingArguments.optim for optimizer.name / state_dtype (transformers 5 OptimizerNames)."""
    o = spec.optimizer
    if o.name == "sgd":
        return "sgd"
    if o.state_dtype == "int8":
        return "adamw_torch_8bit"  # torchao AdamW8bit, fp8dist's int8 states
    issues = []
    if o.state_dtype == "fp8":
        issues.append(Issue("optimizer.state_dtype", "TrainingArguments has no torchao AdamWFp8 (transformers 5 "
                            "OptimizerNames)", "fp8", "use state_dtype int8 (adamw_torch_8bit) or auto"))
    if o.name == "adam" and o.weight_decay:
        issues.append(Issue("optimizer.name", "TrainingArguments has no Adam with L2 weight decay; its Adam is AdamW",
                            "adam", "use optimizer.name=adamw, or weight_decay=0 (then AdamW is Adam)"))
    if issues:
        raise ConfigError(issues, spec.source)
    return "adamw_torch"
