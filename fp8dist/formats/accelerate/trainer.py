"""fp8dist with `transformers.Trainer`: `training_arguments_kwargs(config)` (the audit's callback for the Trainer is
fp8dist.audit.trainer_callback.AuditCallback).

    args = TrainingArguments(output_dir="out", **training_arguments_kwargs("fp8dist.yaml"))

`training_arguments_kwargs` gives bf16/fp16, the DeepSpeed dict (fp8dist's translation, AutoTP included) or fsdp +
fsdp_config (FSDP2) with a ParallelismConfig for hybrid sharding, tensor and context parallel (give the Trainer the
model loaded split, from_pretrained(..., tp_plan="auto"); it runs context parallel itself), torch_compile,
activation checkpointing, the optimizer (optim, lr, betas, eps, weight decay) and the batch, accumulation and
clipping the DeepSpeed dict also holds; what the Trainer cannot express through Accelerate is refused with the key
(docs/accelerate.md), never dropped. max_steps, seed and the rest stay yours.

"""
from __future__ import annotations

from typing import Any

from fp8dist.errors import ConfigError, Issue
from fp8dist.formats.accelerate.kwargs import as_spec, parallelism_config
from fp8dist.formats.accelerate.translate import accelerate_plan


def training_arguments_kwargs(config, *, world_size: int | None = None,
                              deepspeed_version: str | None = None) -> dict[str, Any]:
    """Keyword arguments for `transformers.TrainingArguments` (transformers 5) equivalent to `config` (path, dict or
    Spec); add output_dir and the rest of your run's own settings. TrainingArguments has no adapter setting: with
    `adapter.kind=lora` give the Trainer `peft.get_peft_model(model, fp8dist.backends.adapters.lora_config(
    spec.adapter), autocast_adapter_dtype=False)`, as for `accelerator_kwargs`."""
    spec = as_spec(config)
    plan = accelerate_plan(spec, "trainer", deepspeed_version=deepspeed_version)
    o, t = spec.optimizer, spec.train
    kwargs: dict[str, Any] = {
        "per_device_train_batch_size": t.micro_batch_size, "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "max_grad_norm": float(t.gradient_clipping), "learning_rate": o.lr, "weight_decay": o.weight_decay,
        "adam_beta1": o.betas[0], "adam_beta2": o.betas[1], "adam_epsilon": o.eps, "optim": _optim(spec),
        "torch_compile": spec.compile,
    }  # train.steps and train.seed are fp8dist's own runs' (launch/train.py, the audit): max_steps and seed stay yours
    if plan["ddp"]:  # DDP: the Trainer's own, with bf16 / fp16 autocast
        kwargs.update(bf16=plan["mixed_precision"] == "bf16", fp16=plan["mixed_precision"] == "fp16")
    elif plan["fsdp"]:
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
            kwargs["parallelism_config"] = parallelism_config(spec, world_size)
    else:
        ds = plan["deepspeed"]["config"]
        # HfTrainerDeepSpeedConfig checks bf16/fp16.enabled against these flags (integrations/deepspeed.py).
        kwargs.update(bf16=bool((ds.get("bf16") or {}).get("enabled")),
                      fp16=bool((ds.get("fp16") or {}).get("enabled")), deepspeed=ds)
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
