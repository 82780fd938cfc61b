"""Spec -> Accelerate: a config file for `accelerate launch --config_file`, or the plan the Python helpers
(fp8dist.integrations) build real objects from. Pure: no torch, no accelerate import.

Everything here follows accelerate 1.15 (facts.accelerate.ACCELERATE_KNOWN):
- the file's keys are ClusterConfig's (commands/config/config_args.py); `fsdp_config`, `fp8_config` and
  `dynamo_config` entries become `fsdp_*` / `fp8_*` / `dynamo_*` launcher arguments and then environment
  variables (commands/launch.py _validate_launch_command, utils/launch.py prepare_multi_gpu_env, setup_fp8_env);
- FullyShardedDataParallelPlugin, DeepSpeedPlugin, AORecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs read those
  variables (utils/dataclasses.py); Accelerator and fsdp2_prepare_model decide the rest (accelerator.py,
  utils/fsdp_utils.py).

What Accelerate cannot express is an error naming the fp8dist key (docs/accelerate.md lists them), never a
silent drop. For a config file, `nearest_accelerate_file` moves each such key to the nearest value Accelerate can
express (Refusal.nearest) and lists every difference; keys with no near value (FP8 under DeepSpeed, FP8 experts or
adapters, fp16 loss scaling on FSDP2, ...) stay refused. The DeepSpeed config is fp8dist's own translation
(to_deepspeed), carried whole.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Sequence, cast

from fp8dist.config.load import load_config
from fp8dist.config.parallel import sequence_parallel
from fp8dist.config.spec import Spec
from fp8dist.errors import ConfigError, Fp8distError, Issue
from fp8dist.facts import versions
from fp8dist.facts.accelerate import (ACCELERATE_AO_DIM_MULTIPLE, ACCELERATE_FP8_BACKEND, ACCELERATE_FP8_COMPUTE_DTYPE,
                                      ACCELERATE_KNOWN, accelerate_matches)
from fp8dist.facts.peft import PEFT_ALL_LINEAR
from fp8dist.facts.transformer_engine import TE_RECIPES
from fp8dist.facts.versions import fmt, parse_version
from fp8dist.formats.common import comment_line, set_path
from fp8dist.translate.deepspeed import to_deepspeed
from fp8dist.translate.fsdp2 import torchao_float8_plan

# file: a config file for `accelerate launch`; python: Accelerator(**accelerator_kwargs(...));
# trainer: transformers.TrainingArguments(**training_arguments_kwargs(...)).
MODES = ("file", "python", "trainer")
_HOW = {"file": "an Accelerate config file", "python": "Accelerate's Accelerator",
        "trainer": "transformers.TrainingArguments (through Accelerate)"}
_HELPER = "fp8dist.integrations.accelerator_kwargs(CONFIG) in your script"


@dataclass(frozen=True)
class Refusal(Issue):
    """What Accelerate cannot express, with the nearest setting it can (`nearest`: fp8dist keys -> values; None where
    no Accelerate run keeps what the key asks for: FP8 under DeepSpeed, MoE experts or LoRA adapters in FP8, ...)."""

    nearest: dict[str, Any] | None = field(default=None, kw_only=True, compare=False)


class NotExpressible(ConfigError):
    """The config asks for something Accelerate (in this mode) cannot do; every such key, why, and the fix."""

    def __init__(self, issues: list[Issue], source: str | None, mode: str):
        self.issues, self.source = list(issues), source
        lines = [f"cannot translate {source or 'the config'} for {_HOW[mode]} "
                 f"(accelerate {fmt(ACCELERATE_KNOWN[:2])}): {len(self.issues)} problem(s)"]
        lines += [f"  - {issue.render()}" for issue in self.issues]
        Fp8distError.__init__(self, "\n".join(lines))


def accelerate_mixed_precision(spec: Spec) -> str:
    """Accelerate's `mixed_precision` for the config: fp8 for an FP8 backend, else the compute dtype or `no`."""
    if spec.fp8.enabled:
        return "fp8"
    return {"none": "no"}.get(spec.precision.mixed_precision, spec.precision.mixed_precision)


def accelerate_plan(spec: Spec, mode: str = "file", *, deepspeed_version: str | None = None,
                    torchao_version: str | None = None) -> dict[str, Any]:
    """What Accelerate must be given for `spec`, as plain data; every key it cannot express is an Issue."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    issues: list[Issue] = []
    mixed = accelerate_mixed_precision(spec)
    plan: dict[str, Any] = {"engine": spec.engine, "mixed_precision": mixed, "load_dtype": spec.precision.load_dtype,
                            "fsdp": None, "deepspeed": None, "ddp": None, "fp8": None, "notes": []}
    _check_fp8_compute(spec, mode, issues)
    if spec.parallel.pipeline_size > 1:
        issues.append(Refusal("parallel.pipeline_size", "Accelerate has no pipeline parallel over a Hugging Face "
                              "model: its ParallelismConfig's axes are dp_replicate, dp_shard, tp, cp and sp "
                              "(accelerate 1.15 parallelism_config.py; its Megatron-LM mode's pp_degree trains "
                              "Megatron-Core's own model), so every rank would hold every layer",
                              spec.parallel.pipeline_size, "set parallel.pipeline_size=1 for Accelerate (the same "
                              "numerics, every layer on each rank: more memory), or run fp8dist's own FSDP2 runtime",
                              nearest={"parallel.pipeline_size": 1}))
    if spec.engine == "fsdp2" and spec.parallel.sharding == "replicate":
        plan["ddp"] = _ddp_plan(spec, mode, issues, plan["notes"])
    elif spec.engine == "fsdp2":
        plan["fsdp"] = _fsdp_plan(spec, mode, mixed, issues, plan["notes"])
    else:
        plan["deepspeed"] = _deepspeed_plan(spec, mode, deepspeed_version, issues, plan["notes"])
    if spec.fp8.enabled:
        plan["fp8"] = _fp8_plan(spec, mode, torchao_version, issues)
    if spec.adapter.enabled and spec.adapter.base_dtype == "nf4":
        issues.append(Refusal("adapter.base_dtype", "Accelerate has no setting for a quantized base: the script "
                              "would load one with bitsandbytes, whose 4-bit weights FSDP2 trains wrong in uint8 "
                              "storage (accelerate#3983) and corrupts in bf16 storage (bitsandbytes#1945); fp8dist "
                              "quantizes its base with torchao's NF4 itself", "nf4",
                              "train the NF4 base with fp8dist's FSDP2 runtime, or adapter.base_dtype=auto for "
                              "Accelerate", nearest={"adapter.base_dtype": "auto"}))
    plan["compile"] = ({"backend": "inductor", "regional": spec.engine == "fsdp2"} if spec.compile else None)
    if issues:
        raise NotExpressible(issues, spec.source, mode)
    return plan


# -- precision -----------------------------------------------------------------------------------------------
def _check_fp8_compute(spec: Spec, mode: str, issues: list[Issue]) -> None:
    p = spec.precision
    if not spec.fp8.enabled:
        return
    if mode == "trainer":
        issues.append(Refusal("precision.fp8.backend", "transformers.TrainingArguments has no FP8 setting: it reads "
                            "FP8 only from ACCELERATE_MIXED_PRECISION=fp8 and turns it off again when bf16 or fp16 is "
                            "set (transformers 5 training_args.py, section 'Mixed Precision')", spec.fp8.backend,
                            "launch with the file of `fp8dist translate CONFIG --to accelerate`, or build the "
                            f"Accelerator with {_HELPER}"))
    if p.mixed_precision != ACCELERATE_FP8_COMPUTE_DTYPE:
        issues.append(Refusal("precision.mixed_precision", "Accelerate's fp8 mode computes every non-FP8 op in bf16 "
                            "(FSDP2: MixedPrecisionPolicy of bf16; DeepSpeed: a bf16 section, and an fp16 section is "
                            "refused; accelerate 1.15 utils/dataclasses.py set_mixed_precision)", p.mixed_precision,
                            "set precision.mixed_precision=bf16 (with master_weights=fp32)",
                              nearest={"precision.mixed_precision": "bf16"}))


def _fsdp_plan(spec: Spec, mode: str, mixed: str, issues: list[Issue], notes: list[str]) -> dict[str, Any]:
    p, par, f = spec.precision, spec.parallel, spec.fsdp2
    compute = None if mixed == "no" else (ACCELERATE_FP8_COMPUTE_DTYPE if mixed == "fp8" else mixed)
    # fsdp2_prepare_model upcasts every trainable parameter to fp32 whenever mixed_precision is set.
    stored = "fp32" if mixed != "no" else p.load_dtype
    if p.weight_dtype != stored:
        key = "precision.master_weights" if p.master_weights != "none" else "precision.load_dtype"
        value = p.master_weights if p.master_weights != "none" else p.load_dtype
        issues.append(Refusal(key, f"Accelerate's FSDP2 keeps the weights the optimizer steps in {stored}: with "
                            "mixed_precision set it upcasts every trainable parameter to fp32, without it they stay "
                            "in the loading dtype (accelerate 1.15 utils/fsdp_utils.py fsdp2_prepare_model); this "
                            f"config steps {p.weight_dtype}", value,
                            "use master_weights=fp32 with mixed precision, or master_weights=none without it",
                              nearest={"precision.master_weights": "fp32" if mixed != "no" else "none"}))
    if p.compute_dtype == "fp16":
        ls = p.loss_scaling
        issues.append(Refusal("precision.loss_scaling", "Accelerate scales fp16 losses under FSDP2 with torch's "
                            "GradScaler, which has neither hysteresis nor a minimum scale and grows every 2000 steps "
                            "by default (accelerate 1.15 accelerator.py get_fsdp2_grad_scaler); fp8dist's schedule "
                            "(DeepSpeed's) cannot be given to it",
                            {"hysteresis": ls.hysteresis, "min_loss_scale": ls.min_loss_scale,
                             "loss_scale_window": ls.loss_scale_window},
                            "use bf16, or engine=deepspeed (its fp16 section takes these knobs), or fp8dist's own "
                            "FSDP2 runtime (launch/train.py)"))
    policy_in_file = mode != "python"
    if policy_in_file:
        want = compute if compute else p.load_dtype
        if p.reduce_dtype != want:
            how = (f"mixed_precision {mixed} gives FSDP2 one dtype for parameters, reduction and outputs ({want})"
                   if compute else "without mixed_precision FSDP2 reduces in the parameters' dtype "
                   f"(the loading dtype, {p.load_dtype})")
            issues.append(Refusal("precision.reduce_dtype", f"{_HOW[mode]} cannot set a reduce dtype: {how} "
                                "(accelerate 1.15 utils/dataclasses.py "
                                "FullyShardedDataParallelPlugin.set_mixed_precision)",
                                p.reduce_dtype, f"set precision.reduce_dtype={want}, or build the Accelerator with "
                                f"{_HELPER} (it passes a MixedPrecisionPolicy)",
                                nearest={"precision.reduce_dtype": want}))
        if not f.cast_forward_inputs:
            issues.append(Refusal("fsdp2.cast_forward_inputs", f"{_HOW[mode]} cannot set MixedPrecisionPolicy."
                                "cast_forward_inputs (it keeps torch's default, true)", False,
                                f"remove the key, or build the Accelerator with {_HELPER}",
                                  nearest={"fsdp2.cast_forward_inputs": True}))
    if f.output_dtype is not None and f.output_dtype != compute:
        issues.append(Refusal("fsdp2.output_dtype", "Accelerate gives every FSDP2 unit the same MixedPrecisionPolicy, "
                            "so an output dtype for the root alone cannot be set (accelerate 1.15 utils/fsdp_utils.py "
                            "fsdp2_prepare_model)", f.output_dtype,
                            "remove fsdp2.output_dtype (outputs stay in the compute dtype)",
                              nearest={"fsdp2.output_dtype": None}))
    sharding = "full" if par.sharding == "auto" else par.sharding
    parallelism = _parallelism_plan(spec, sharding, mode, issues, notes)
    if par.activation_checkpointing == "selective":
        issues.append(Refusal("parallel.activation_checkpointing", "Accelerate's FSDP2 activation checkpointing wraps "
                            "whole blocks (torch checkpoint_wrapper, full recompute); it has no op-level policy "
                            "(accelerate 1.15 accelerator.py)", "selective",
                            "use parallel.activation_checkpointing=full, or fp8dist's own runtime",
                              nearest={"parallel.activation_checkpointing": "full"}))
    if par.cpu_ram_efficient_loading and spec.fp8.backend == "torchao":
        issues.append(Refusal("parallel.cpu_ram_efficient_loading", "Accelerate refuses torchao FP8 with FSDP2 and "
                            "cpu_ram_efficient_loading (accelerate 1.15 accelerator.py: 'torchao with FSDP2 and "
                            "cpu_ram_efficient_loading is not supported')", True,
                            "set parallel.cpu_ram_efficient_loading=false for Accelerate, or keep it and run "
                            "fp8dist's own FSDP2 runtime (launch/torchrun.sh), which loads each rank's shards",
                              nearest={"parallel.cpu_ram_efficient_loading": False}))
    if par.cpu_ram_efficient_loading:
        notes.append("RAM-efficient loading in Accelerate: rank 0 reads the checkpoint and broadcasts the shards "
                     "(fsdp2_load_full_state_dict); fp8dist's runtime reads each rank's own rows")
    if f.wrap == "auto":
        notes.append("wrap auto: Accelerate's TRANSFORMER_BASED_WRAP without class names shards the model's "
                     "_no_split_modules (Hugging Face models); fp8dist also falls back to the first nn.ModuleList's "
                     "children, Accelerate does not")
    notes.append("Accelerate 1.15 also gives the input embedding and [final norm, lm_head] FSDP2 units of their own")
    if mixed != "no":
        notes.append(f"Accelerate runs the forward under torch.autocast({compute}) on top of the FSDP2 policy "
                     "and returns fp32 outputs (convert_outputs_to_fp32)")
    return {"version": 2, "reshard_after_forward": sharding != "grad_op", "offload_params": par.offload == "params",
            "wrap": None if f.wrap == "auto" else list(f.wrap),
            "activation_checkpointing": par.activation_checkpointing != "none",
            "cpu_ram_efficient_loading": par.cpu_ram_efficient_loading, "parallelism": parallelism,
            "policy": {"param_dtype": compute, "reduce_dtype": p.reduce_dtype,
                       "output_dtype": f.output_dtype or compute, "cast_forward_inputs": f.cast_forward_inputs}}


def _parallelism_plan(spec: Spec, sharding: str, mode: str, issues: list[Issue],
                      notes: list[str]) -> dict[str, Any] | None:
    """Accelerate's ParallelismConfig sizes for FSDP2 (None: none needed), its sizes multiplying to the world size,
    as fp8dist's mesh axes do (fp8dist.config.parallel): hybrid sharding's dp_replicate x dp_shard, tensor parallel's
    tp (the model split by transformers' tp_plan when loaded: accelerate 1.15 accelerator.py prepare_model takes it
    so, examples/torch_native_parallelism/nd_parallel.py loads it so), context parallel's cp (torch's context_parallel
    around each step: accelerator.py maybe_context_parallel). The data sizes that need the world size are written as
    expressions of it."""
    par = spec.parallel
    tp, cp = par.tensor_size, par.context_size
    if tp > 1 and sequence_parallel(spec):
        issues.append(Refusal("parallel.sequence_parallel", "Accelerate's tensor parallel is the model split by "
                              "transformers' tp_plan (from_pretrained(tp_plan='auto'); accelerate 1.15 accelerator.py "
                              "prepare_model), and the models of transformers 5.24 plan no SequenceParallel: the "
                              "activations between the split Linears stay whole", par.sequence_parallel,
                              "set parallel.sequence_parallel=false for Accelerate, or run fp8dist's own FSDP2 runtime",
                              nearest={"parallel.sequence_parallel": False}))
    if tp > 1 and spec.fp8.enabled:
        issues.append(Refusal("parallel.tensor_size", "fp8dist converts to FP8 before the split and splits tensorwise "
                              "float8 Linears with torchao's float8 styles (fp8dist/engines/fsdp2/tensor_parallel.py); "
                              "Accelerate takes the model split when loaded (transformers' tp_plan) and converts it "
                              "afterwards (accelerate 1.15 accelerator.py prepare: _prepare_tp, then _prepare_ao / "
                              "_prepare_te)", tp, "run FP8 with tensor parallel on fp8dist's own FSDP2 runtime, or set "
                              "parallel.tensor_size=1 for Accelerate"))
    if par.expert_size > 1:
        issues.append(Refusal("parallel.expert_size", "Accelerate has no expert parallel: its ParallelismConfig's axes "
                              "are dp_replicate, dp_shard, tp, cp and sp (accelerate 1.15 parallelism_config.py), so "
                              "every rank would hold every expert, FSDP2-sharded like the dense weights",
                              par.expert_size, "set parallel.expert_size=1 for Accelerate (the same numerics, the "
                              "experts sharded instead of split), or run fp8dist's own FSDP2 runtime",
                              nearest={"parallel.expert_size": 1}))
    split = tp * cp
    shard = cast(int, par.shard_size)  # read with hybrid only, which the config's rules refuse without it
    if sharding == "hybrid" and mode == "file":
        issues.append(Refusal("parallel.sharding", "an Accelerate config file writes HSDP as parallelism_config "
                              "dp_replicate_size x dp_shard_size, which with the other sizes must equal the number of "
                              "processes, and an fp8dist config does not fix the world size", "hybrid",
                              f"build the Accelerator with {_HELPER} (it reads WORLD_SIZE), or add "
                              f"parallelism_config_dp_shard_size: {shard} and "
                              f"parallelism_config_dp_replicate_size: WORLD/{shard * split} under "
                              "parallelism_config yourself",
                              nearest={"parallel.sharding": "full", "parallel.shard_size": None}))
    if sharding != "hybrid" and split == 1:
        return None
    if tp > 1:
        notes.append("tensor parallel: your script loads the model split, from_pretrained(..., tp_plan='auto', "
                     "device_mesh=accelerator.torch_device_mesh), before accelerator.prepare (Accelerate splits "
                     "nothing itself)")
    if cp > 1:
        notes.append("context parallel: your script runs each step inside accelerator.maybe_context_parallel("
                     "buffers=..., buffer_seq_dims=...) (the HF Trainer does it itself)")
    if sharding == "hybrid":
        data = {"dp_shard_size": shard, "dp_replicate_size": f"world_size / {shard * split}"}
    else:
        data = {"dp_shard_size": f"world_size / {split}", "dp_replicate_size": 1}
    return {**data, "tp_size": tp, "cp_size": cp}


def _ddp_plan(spec: Spec, mode: str, issues: list[Issue], notes: list[str]) -> dict[str, Any]:
    """`parallel.sharding: replicate` as Accelerate's data parallelism (MULTI_GPU; one process runs it as NO): the
    weights stay as loaded (Accelerate upcasts only under FSDP), the forward autocasts to the mixed precision, and
    DDP all-reduces each gradient in its parameter's dtype (accelerate 1.15 accelerator.py prepare_model,
    torch DistributedDataParallel). fp8dist's replicate keeps its own numbers where that differs: refused, named."""
    p, par, issues_before = spec.precision, spec.parallel, len(issues)
    if p.weight_dtype != p.load_dtype:
        issues.append(Refusal("precision.master_weights", f"Accelerate's DDP steps the weights as loaded "
                            f"({p.load_dtype}); this config keeps {p.weight_dtype} master weights", p.master_weights,
                            "set precision.master_weights=none (or load in the master dtype: precision.load_dtype="
                            f"{p.weight_dtype})", nearest={"precision.load_dtype": p.weight_dtype}))
    if p.reduce_dtype != p.load_dtype:
        issues.append(Refusal("precision.reduce_dtype", f"DDP all-reduces each gradient in its parameter's dtype "
                            f"({p.load_dtype}); this config reduces in {p.reduce_dtype}", p.reduce_dtype,
                            f"set precision.reduce_dtype={p.load_dtype}",
                            nearest={"precision.reduce_dtype": p.load_dtype}))
    if p.compute_dtype == "fp16":
        issues.append(Refusal("precision.loss_scaling", "Accelerate scales fp16 losses with torch's GradScaler, "
                            "which has neither hysteresis nor a minimum scale; fp8dist's schedule (DeepSpeed's) "
                            "cannot be given to it", p.mixed_precision,
                            "use bf16, or fp8dist's own runtime (launch/train.py)"))
    for key, value, why in (("parallel.offload", par.offload, "DDP keeps everything on the device"),
                            ("parallel.activation_checkpointing", par.activation_checkpointing, "an Accelerate file "
                             "checkpoints activations only under FSDP (fsdp_activation_checkpointing)"),
                            ("parallel.cpu_ram_efficient_loading", par.cpu_ram_efficient_loading, "Accelerate's "
                             "RAM-efficient loading is FSDP's")):
        if value not in ("none", False):
            issues.append(Refusal(key, f"{why} (accelerate 1.15)", value,
                                "remove it for Accelerate's DDP, or use parallel.sharding=full (FSDP) / fp8dist's own "
                                "runtime" + (" (call model.gradient_checkpointing_enable() in your script for "
                                             "activation checkpointing)" if "activation" in key else ""),
                                  nearest={key: False if value is True else "none"}))
    if mode != "python" and not spec.fsdp2.cast_forward_inputs:
        issues.append(Refusal("fsdp2.cast_forward_inputs", "an FSDP2 setting; Accelerate's DDP has no such policy",
                              False, "remove the key", nearest={"fsdp2.cast_forward_inputs": True}))
    for key, size in (("parallel.tensor_size", par.tensor_size), ("parallel.context_size", par.context_size)):
        if size > 1:
            issues.append(Refusal(key, "Accelerate refuses tensor or context parallel with pure data parallelism "
                                  "(dp_replicate_size above 1 with dp_shard_size 1: accelerate 1.15 "
                                  "parallelism_config.py ParallelismConfig.__post_init__)", size,
                                  "use parallel.sharding=full (FSDP2 over the data-parallel ranks) for Accelerate",
                                  nearest={"parallel.sharding": "full"}))
            break
    if len(issues) == issues_before:
        notes.append("DDP: run it with `accelerate launch --num_processes N` (N 1 runs one process); the weights "
                     f"stay in the loading dtype ({p.load_dtype}), as in fp8dist's parallel.sharding: replicate")
    return {"distributed_type": "MULTI_GPU"}


def _deepspeed_plan(spec: Spec, mode: str, deepspeed_version: str | None, issues: list[Issue],
                    notes: list[str]) -> dict[str, Any] | None:
    config = None
    try:
        config = to_deepspeed(spec, deepspeed_version)
    except ConfigError as exc:
        issues.extend(exc.issues)
    par = spec.parallel
    if par.activation_checkpointing != "none" and (mode != "trainer" or par.activation_checkpointing == "selective"):
        how = ("TrainingArguments(activation_checkpointing=True) recomputes whole blocks only"
               if mode == "trainer" else "Accelerate has no activation checkpointing for DeepSpeed")
        issues.append(Refusal("parallel.activation_checkpointing", f"{how} (accelerate 1.15 accelerator.py "
                            "_prepare_deepspeed)", par.activation_checkpointing,
                            "call model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
                            "False}) in your script and set parallel.activation_checkpointing=none here, or use "
                            "transformers.TrainingArguments (training_arguments_kwargs) with full",
                              nearest={"parallel.activation_checkpointing": "full" if mode == "trainer" else "none"}))
    if spec.fp8.enabled and mode == "file":
        issues.append(Refusal("precision.fp8.backend", "an Accelerate config file turns FP8 on only with "
                            "mixed_precision: fp8, and `accelerate launch` refuses mixed_precision next to a "
                            "deepspeed_config_file (accelerate 1.15 commands/launch.py marks it in "
                            "ACCELERATE_CONFIG_DS_FIELDS; DeepSpeedPlugin._deepspeed_config_checks raises), while "
                            "Accelerate's own DeepSpeed keys cannot carry communication_data_type or the "
                            "master-weight dtype", spec.fp8.backend,
                            f"build the Accelerator with {_HELPER} (mixed_precision='fp8' with the DeepSpeed dict), "
                            "or run fp8dist's runtime: deepspeed launch/train.py --fp8dist-config CONFIG"))
    if spec.fp8.enabled and spec.precision.master_weights == "none":
        issues.append(Refusal("precision.master_weights", "Accelerate's fp8 mode adds a bf16 section to the DeepSpeed "
                            "config, next to the torch_autocast section fp8dist writes for weights without masters "
                            "(accelerate 1.15 utils/dataclasses.py DeepSpeedPlugin.set_mixed_precision)", "none",
                            "set precision.master_weights=fp32", nearest={"precision.master_weights": "fp32"}))
    if par.tensor_size > 1:
        notes.append(f"tensor parallel: DeepSpeed AutoTP by the config's tensor_parallel.autotp_size "
                     f"({par.tensor_size}), which Accelerate reads (accelerate 1.15 accelerator.py _prepare_deepspeed)")
    if par.expert_size > 1:
        notes.append(f"expert parallel: DeepSpeed AutoEP by the config's expert_parallel section (autoep_size "
                     f"{par.expert_size}), which Accelerate hands to deepspeed.initialize unchanged")
    if spec.deepspeed.zero_stage == 3 and not par.cpu_ram_efficient_loading:
        notes.append("zero3_init_flag false: Accelerate would otherwise build a ZeRO-3 model inside "
                     "deepspeed.zero.Init (fp8dist does that only with parallel.cpu_ram_efficient_loading)")
    return {"config": config, "zero3_init_flag": bool(par.cpu_ram_efficient_loading)}


# -- FP8 -----------------------------------------------------------------------------------------------------
def _fp8_plan(spec: Spec, mode: str, torchao_version: str | None, issues: list[Issue]) -> dict[str, Any]:
    backend = spec.fp8.backend
    if backend == "torchao":
        return _torchao_plan(spec, mode, torchao_version, issues)
    if backend == "te":
        return _te_plan(spec, issues)
    return {"backend": "msamp", "accelerate_backend": ACCELERATE_FP8_BACKEND["msamp"],
            "opt_level": spec.fp8.msamp.opt_level, "use_te": spec.fp8.msamp.use_te}


def _torchao_plan(spec: Spec, mode: str, torchao_version: str | None, issues: list[Issue]) -> dict[str, Any]:
    ao, modules = spec.fp8.torchao, spec.fp8.modules
    if ao.recipe_name == "mxfp8":
        issues.append(Refusal("precision.fp8.torchao.recipe_name", "Accelerate's torchao path builds a "
                            "Float8LinearConfig (accelerate 1.15 utils/ao.py convert_model_to_fp8_ao); torchao's "
                            "MXFP8 Linear is another module it does not apply", ao.recipe_name,
                            "use tensorwise, rowwise or rowwise_with_gw_hp for Accelerate, or train with fp8dist's "
                            "runtime (launch/train.py, fp8dist.engines)"))
        return {}
    if ao.experts in ("float8", "mxfp8"):
        issues.append(Refusal("precision.fp8.torchao.experts", "Accelerate converts nn.Linear layers only; MoE experts "
                            "would stay in bf16", ao.experts,
                            "set precision.fp8.torchao.experts=none (and accept bf16 experts under Accelerate), or "
                            "train with fp8dist's runtime"))
    plan = torchao_float8_plan(spec, torchao_version)
    linear = plan.float8_linear_config.to_json()  # torchao's Float8LinearConfig fields, as AORecipeKwargs takes them
    recompute = plan.force_recompute_fp8_weight_in_bwd.value
    if mode == "file":
        why = ("a config file gives AORecipeKwargs only pad_inner_dim and enable_fsdp_float8_all_gather and builds "
               "the rest of Float8LinearConfig() (tensorwise) itself (accelerate 1.15 utils/dataclasses.py "
               "AORecipeKwargs)")
        for key, value, default in (("recipe_name", ao.recipe_name, "tensorwise"), ("emulate", ao.emulate, False)):
            if value != default:
                issues.append(Refusal(f"precision.fp8.torchao.{key}", why, value,
                                    f"set it to {json.dumps(default)} for the file, or build the Accelerator with "
                                    f"{_HELPER} (it passes a full Float8LinearConfig)",
                                      nearest={f"precision.fp8.torchao.{key}": default}))
        if recompute:
            issues.append(Refusal("precision.fp8.torchao.force_recompute_fp8_weight_in_bwd", f"{why}; the torchao "
                                f"targeted here ({plan.torchao_version}) needs it set",
                                ao.force_recompute_fp8_weight_in_bwd, f"build the Accelerator with {_HELPER}"))
    if spec.adapter.enabled and (mode == "file" or modules.skip_first_last):
        issues.append(Refusal("adapter.kind", "Accelerate's own torchao filter (every nn.Linear but the first and the "
                            "last, dims multiples of 16; accelerate 1.15 utils/ao.py filter_linear_layers) also "
                            "converts LoRA's lora_A / lora_B Linears, so the adapters would train in float8", "lora",
                            "set precision.fp8.modules.skip_first_last=false and build the Accelerator with "
                            f"{_HELPER} (fp8dist's filter leaves the adapters in high precision), or train with "
                            "fp8dist's runtime"))
    if mode == "file" or modules.skip_first_last:
        # Accelerate's own filter: every Linear except the first and the last, dims divisible by 16.
        if modules.exclude or not modules.skip_first_last:
            key = "precision.fp8.modules.exclude" if modules.exclude else "precision.fp8.modules.skip_first_last"
            issues.append(Refusal(key, "Accelerate's torchao filter keeps exactly the first and the last nn.Linear "
                                "in high precision (and those whose dims are not multiples of 16); a config file "
                                "cannot pass another, and fp8dist can pass its own only without skip_first_last "
                                "(accelerate 1.15 utils/ao.py convert_model_to_fp8_ao)",
                                list(modules.exclude) if modules.exclude else modules.skip_first_last,
                                "set precision.fp8.modules={exclude: [], skip_first_last: true} (Accelerate's filter)"
                                + ("" if mode == "file" else ", or skip_first_last=false with any exclude list"),
                                  nearest={"precision.fp8.modules.exclude": [],
                                           "precision.fp8.modules.skip_first_last": True}))
        if ao.pad_inner_dim:
            issues.append(Refusal("precision.fp8.torchao.pad_inner_dim", "Accelerate's torchao filter skips every "
                                "Linear whose dims are not multiples of 16, so padding never converts them (accelerate "
                                "1.15 utils/ao.py filter_linear_layers)", True,
                                "set pad_inner_dim=false, or modules.skip_first_last=false with "
                                f"{_HELPER} (fp8dist's own filter)",
                                nearest={"precision.fp8.torchao.pad_inner_dim": False}))
    if (spec.engine == "fsdp2" and linear["enable_fsdp_float8_all_gather"] and spec.precision.load_dtype != "fp32"
            and accelerate_mixed_precision(spec) != "no"):
        # Verified on torch 2.13 / torchao 0.18: `param.data = param.data.to(fp32)` on a
        # WeightWithDynamicFloat8CastTensor changes the wrapper's dtype, not its inner tensor, and fully_shard then
        # fails with "FSDP expects uniform original parameter dtype". fp8dist's runtime upcasts before converting.
        issues.append(Refusal("precision.load_dtype", "Accelerate converts to float8 before its FSDP2 upcast to fp32 "
                            "masters (accelerate 1.15 utils/fsdp_utils.py fsdp2_prepare_model: param.data = "
                            "param.data.to(float32)), which leaves torchao's float8 all-gather weights in the load "
                            "dtype: FSDP2 then stops with 'FSDP expects uniform original parameter dtype'",
                            spec.precision.load_dtype,
                            "set precision.load_dtype=fp32 (load the model in fp32: nothing left to upcast), or "
                            "enable_fsdp_float8_all_gather=false, or run fp8dist's own FSDP2 runtime",
                              nearest={"precision.load_dtype": "fp32"}))
    if linear["enable_fsdp_float8_all_gather"] and not ao.precompute_float8_dynamic_scale_for_fsdp:
        issues.append(Refusal("precision.fp8.torchao.precompute_float8_dynamic_scale_for_fsdp", "Accelerate always "
                            "registers torchao's scale precompute after each optimizer step with float8 all-gather "
                            "(accelerate 1.15 accelerator.py _prepare_ao)", False, "remove the key (true)",
                              nearest={"precision.fp8.torchao.precompute_float8_dynamic_scale_for_fsdp": True}))
    return {"backend": "torchao", "accelerate_backend": ACCELERATE_FP8_BACKEND["torchao"],
            "float8_linear_config": linear, "force_recompute_fp8_weight_in_bwd": recompute,
            "module_filter": {"accelerate_default": modules.skip_first_last, "exclude": list(modules.exclude),
                              "dims_multiple_of": None if ao.pad_inner_dim else ACCELERATE_AO_DIM_MULTIPLE}}


def _te_plan(spec: Spec, issues: list[Issue]) -> dict[str, Any]:
    te, modules = spec.fp8.te, spec.fp8.modules
    if not TE_RECIPES[te.recipe].accelerate:
        built = [r for r in TE_RECIPES.values() if r.accelerate]
        issues.append(Refusal("precision.fp8.te.recipe", f"Accelerate builds only {' or '.join(r.cls for r in built)} "
                            "(accelerate 1.15 utils/transformer_engine.py apply_fp8_autowrap)", te.recipe,
                            f"use recipe {' or '.join(r.name for r in built)}, or fp8dist's own runtime",
                              # current scaling's per-tensor scales are nearest to delayed scaling's; block and FP4
                              # recipes have no near Accelerate recipe
                              nearest={"precision.fp8.te.recipe": "delayed"} if te.recipe == "current" else None))
    for name in ("reduce_amax", "use_power_2_scales", "enable_2d_quantization"):
        if getattr(te, name) is not None:
            issues.append(Refusal(f"precision.fp8.te.{name}", "TERecipeKwargs has no such field, so Accelerate's "
                                "recipe keeps Transformer Engine's default (accelerate 1.15 utils/dataclasses.py)",
                                getattr(te, name), f"remove precision.fp8.te.{name}",
                                  nearest={f"precision.fp8.te.{name}": None}))
    if modules.exclude or modules.skip_first_last:
        issues.append(Refusal("precision.fp8.modules.exclude" if modules.exclude
                              else "precision.fp8.modules.skip_first_last",
                            "Accelerate swaps every nn.Linear whose dims are multiples of 16 for te.Linear, lm_head "
                            "included (accelerate 1.15 utils/transformer_engine.py convert_model)",
                            list(modules.exclude) if modules.exclude else True,
                            "set precision.fp8.modules={exclude: [], skip_first_last: false}",
                              nearest={"precision.fp8.modules.exclude": [],
                                       "precision.fp8.modules.skip_first_last": False}))
    if not te.swap_layernorm:
        issues.append(Refusal("precision.fp8.te.swap_layernorm", "Accelerate always swaps nn.LayerNorm for "
                            "te.LayerNorm (accelerate 1.15 utils/transformer_engine.py convert_model)", False,
                            "remove the key (true)",
                              nearest={"precision.fp8.te.swap_layernorm": True}))
    # Accelerate passes TE only the fields that differ from TERecipeKwargs' own defaults (KwargsHandler.to_kwargs,
    # defaults taken with a clean environment), so a value equal to Accelerate's default never reaches TE and
    # TE's default applies: amax_compute_algo most_recent and, for MXFP8, fp8_format HYBRID cannot be asked for.
    if te.amax_compute_algo == "most_recent":
        issues.append(Refusal("precision.fp8.te.amax_compute_algo", "most_recent is TERecipeKwargs' default, which "
                            "Accelerate leaves out of the recipe, so Transformer Engine's own default (max) applies "
                            "(accelerate 1.15 utils/dataclasses.py KwargsHandler.to_kwargs)", "most_recent",
                            "use max (TE's default), or fp8dist's own runtime",
                              nearest={"precision.fp8.te.amax_compute_algo": "max"}))
    if te.recipe == "mxfp8" and te.fp8_format == "HYBRID":
        issues.append(Refusal("precision.fp8.te.fp8_format", "HYBRID is TERecipeKwargs' default, which Accelerate "
                            "leaves out, so MXFP8BlockScaling keeps its own E4M3 (KwargsHandler.to_kwargs)", "HYBRID",
                            "use E4M3 or leave it null", nearest={"precision.fp8.te.fp8_format": "E4M3"}))
    recipe = {name: getattr(te, name) for name in ("fp8_format", "margin", "amax_history_len", "amax_compute_algo")
              if getattr(te, name) is not None}
    return {"backend": "te", "accelerate_backend": ACCELERATE_FP8_BACKEND["te"], "recipe": recipe,
            "use_mxfp8_block_scaling": te.recipe == "mxfp8"}


# -- the config file -----------------------------------------------------------------------------------------
def to_accelerate(spec: Spec, deepspeed_version: str | None = None,
                  torchao_version: str | None = None) -> dict[str, Any]:
    """The ClusterConfig document (accelerate 1.15 commands/config/config_args.py) for `accelerate launch`."""
    return accelerate_file(spec, deepspeed_version, torchao_version)[0]


def accelerate_file(spec: Spec, deepspeed_version: str | None = None,
                    torchao_version: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the ClusterConfig document, the plan it came from)."""
    plan = accelerate_plan(spec, "file", deepspeed_version=deepspeed_version, torchao_version=torchao_version)
    doc: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False,
                           "distributed_type": "FSDP" if plan["fsdp"] else "MULTI_GPU" if plan["ddp"] else "DEEPSPEED"}
    if plan["ddp"]:
        doc["mixed_precision"] = plan["mixed_precision"]
    elif plan["fsdp"]:
        fs = plan["fsdp"]
        doc["mixed_precision"] = plan["mixed_precision"]
        fsdp = {"fsdp_version": 2, "fsdp_reshard_after_forward": fs["reshard_after_forward"],
                "fsdp_offload_params": fs["offload_params"], "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
        if fs["wrap"]:
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(fs["wrap"])
        fsdp["fsdp_activation_checkpointing"] = fs["activation_checkpointing"]
        fsdp["fsdp_cpu_ram_efficient_loading"] = fs["cpu_ram_efficient_loading"]
        # The launcher refuses RAM-efficient loading without sync_module_states, FSDP2 included (utils/launch.py
        # prepare_multi_gpu_env); FSDP2 itself ignores the key.
        fsdp["fsdp_sync_module_states"] = fs["cpu_ram_efficient_loading"]
        doc["fsdp_config"] = fsdp
        if fs["parallelism"]:
            # A file cannot hold hybrid sharding (refused above); what is left takes dp_shard_size, the world size
            # over tp x cp, from the launch command (render's header; commands/launch.py lets a flag win over the
            # file's parallelism_config).
            doc["parallelism_config"] = {f"parallelism_config_{name}": fs["parallelism"][name]
                                         for name in ("tp_size", "cp_size")}
    else:
        # mixed_precision is left out: accelerate launch refuses it next to deepspeed_config_file; the bf16/fp16
        # section of the DeepSpeed config decides (state.py AcceleratorState.mixed_precision).
        doc["deepspeed_config"] = {"deepspeed_config_file": json.dumps(plan["deepspeed"]["config"],
                                                                       separators=(",", ":")),
                                   "zero3_init_flag": plan["deepspeed"]["zero3_init_flag"]}
    if plan["fp8"]:
        doc["fp8_config"] = _fp8_config(plan["fp8"])
    if plan["compile"]:
        doc["dynamo_config"] = {"dynamo_backend": "INDUCTOR",
                                "dynamo_use_regional_compilation": plan["compile"]["regional"]}
    doc.update({"machine_rank": 0, "main_training_function": "main", "num_machines": 1, "rdzv_backend": "static",
                "same_network": True, "use_cpu": False})
    return doc, plan


def nearest_accelerate_file(spec: Spec, deepspeed_version: str | None = None, torchao_version: str | None = None
                            ) -> tuple[dict[str, Any], dict[str, Any], Spec, list[str]]:
    """The file of the nearest run Accelerate can express: each key it refuses moved to its nearest value
    (Refusal.nearest), one at a time (a move can settle another refusal: fp32 loading for DDP's fp32 masters also
    settles its fp32 reduction), until the file holds. (document, plan, the spec it expresses, every difference from
    `spec`: `KEY: FROM -> TO (why)`). NotExpressible naming the keys with no nearest value when one is left, and the
    full refusal when the moved values break one of fp8dist's own rules."""
    current, why, refused = spec, {}, None
    while True:
        try:
            document, plan = accelerate_file(current, deepspeed_version, torchao_version)
            break
        except NotExpressible as exc:
            refused = refused or exc.issues
            stuck = [issue for issue in exc.issues if getattr(issue, "nearest", None) is None]
            if stuck:
                raise NotExpressible(stuck, spec.source, "file") from None
            moves: dict[str, Any] = getattr(exc.issues[0], "nearest")  # noqa: B009 - a Refusal's, set: none is stuck
            if any(key in why for key in moves):  # a move that does not settle its refusal: never loop
                raise NotExpressible(refused, spec.source, "file") from None
            why.update({key: exc.issues[0].message for key in moves})
            try:
                current = _moved(current, moves)
            except ConfigError:  # fp8dist's own rules refuse the nearest values: the whole refusal stands
                raise NotExpressible(refused, spec.source, "file") from None
    before, after = _flat(spec.to_dict()), _flat(current.to_dict())
    differences = [f"{key}: {json.dumps(before.get(key))} -> {json.dumps(after.get(key))}"
                   + (f" ({why[key]})" if key in why else "")
                   for key in sorted(set(before) | set(after), key=_order(why))
                   if before.get(key) != after.get(key)]
    return document, plan, current, differences


def _moved(spec: Spec, moves: dict[str, Any]) -> Spec:
    document = spec.to_dict()
    for key, value in moves.items():
        set_path(document, key, value)
    return dataclasses.replace(load_config(document), source=spec.source)


def _flat(document: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in document.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _order(moved: dict[str, Any]):
    """The keys moved first, in the order they were moved, then any key that followed from them."""
    rank = {key: index for index, key in enumerate(moved)}
    return lambda key: (rank.get(key, len(rank)), key)


def _fp8_config(fp8: dict[str, Any]) -> dict[str, Any]:
    """fp8_config entries under the names the recipe kwargs read (each becomes ACCELERATE_FP8_<KEY>)."""
    out: dict[str, Any] = {"backend": fp8["accelerate_backend"]}
    if fp8["backend"] == "torchao":
        linear = fp8["float8_linear_config"]
        out.update(enable_fsdp_float8_all_gather=linear["enable_fsdp_float8_all_gather"],
                   pad_inner_dim=linear["pad_inner_dim"])
    elif fp8["backend"] == "te":
        out.update(fp8["recipe"], use_mxfp8_block_scaling=fp8["use_mxfp8_block_scaling"])
    else:
        out["opt_level"] = fp8["opt_level"]
    return out


LOAD_DTYPE_MARK = "# fp8dist: precision.load_dtype="
# Accelerate has no adapter setting: the script applies PEFT before accelerator.prepare (Accelerate 1.15 upcasts
# only trainable parameters to fp32 masters, utils/fsdp_utils.py fsdp2_prepare_model, so the frozen base keeps the
# load dtype as under fp8dist's runtime). The header carries the section, and `fp8dist import` reads it back.
ADAPTER_MARK = "# fp8dist: adapter="


def _launch_line(document: dict[str, Any]) -> str:
    """How to launch the file: fp8dist configs do not fix the number of processes N, and a parallelism_config also
    needs its dp_shard_size, N over the other sizes (Accelerate wants their product to be N and, under FSDP2, a
    dp_shard_size or cp_size above 1: accelerate 1.15 parallelism_config.py _validate_accelerator)."""
    sizes = document.get("parallelism_config")
    if not sizes:
        return ("# accelerate launch --config_file THIS --num_processes N your_script.py   "
                "(fp8dist configs do not fix N)")
    split = sizes["parallelism_config_tp_size"] * sizes["parallelism_config_cp_size"]
    return (f"# accelerate launch --config_file THIS --num_processes N --parallelism_config_dp_shard_size N/{split} "
            "your_script.py   (fp8dist configs do not fix N; Accelerate wants the parallelism_config sizes to "
            "multiply to N)")


def render(document: dict[str, Any], plan: dict[str, Any], spec: Spec, source: str,
           differences: Sequence[str] = ()) -> str:
    """The file: a comment header (what it needs from the launch and the script, and where the run differs from
    `source`: nearest_accelerate_file), then the YAML."""
    import yaml

    o, t = spec.optimizer, spec.train
    batch = ("" if spec.engine == "deepspeed" else
             f", micro batch {t.micro_batch_size} x accumulation {t.gradient_accumulation_steps}, clipping "
             f"{t.gradient_clipping}")
    lines = [comment_line(f"Accelerate {fmt(ACCELERATE_KNOWN[:2])} config translated by fp8dist from "
                          f"{source}."),
             _launch_line(document),
             f"{LOAD_DTYPE_MARK}{spec.precision.load_dtype}   (the torch_dtype your script loads the model in; "
             "an Accelerate file has no place for it)",
             f"# your script builds the optimizer: {o.name} lr={o.lr} weight_decay={o.weight_decay}{batch}"]
    if spec.adapter.enabled:
        a = spec.adapter
        targets = PEFT_ALL_LINEAR if a.target_modules == "auto" else list(a.target_modules)
        extra = (f", modules_to_save={list(a.modules_to_save)!r}" if a.modules_to_save else "") + (
            ", use_dora=True" if a.use_dora else "")
        lines += [f"{ADAPTER_MARK}{json.dumps(spec.to_dict()['adapter'], separators=(',', ':'))}",
                  "#   your script applies it before accelerator.prepare: peft.get_peft_model(model, "
                  f"LoraConfig(r={a.r}, lora_alpha={a.alpha:g}, lora_dropout={a.dropout:g}, "
                  f"target_modules={targets!r}{extra}), "
                  "autocast_adapter_dtype=False), and gives the optimizer the trainable parameters only (the "
                  "adapters then start in the load dtype, as every trainable weight: Accelerate's DeepSpeed would "
                  "keep PEFT's fp32 adapters in fp32, and its FSDP2 upcasts them to fp32 masters itself)"]
    installed = versions.installed_version("accelerate")
    same, reason = accelerate_matches(parse_version(installed) if installed else None)
    if not same:
        lines.append(f"# note: {reason}")
    if differences:
        lines.append(comment_line(f"NOT the run of {source}: the nearest one Accelerate can express, "
                                  f"{len(differences)} setting(s) differ "
                                  "(`fp8dist translate --strict` refuses instead):"))
        lines += [comment_line(f"  differs: {difference}") for difference in differences]
    lines += [comment_line(f"note: {note}") for note in plan["notes"]]
    return "\n".join(lines) + "\n" + yaml.safe_dump(document, sort_keys=False, default_flow_style=False, width=4096)
