"""An Axolotl YAML -> an fp8dist config (Axolotl's examples/llama-3/3b-fp8-fsdp2.yaml, docs/mixed_precision).

Axolotl trains through transformers' Trainer and Accelerate, so its precision is Accelerate's:
- `bf16` defaults to `auto` (Axolotl's schema): on where the GPU has bf16, and then it wins over `fp16` (axolotl
  utils/trainer.py prepare_optim_env: fp8, else bf16 (auto and available, or true), else fp16); the model loads
  in bf16 with bf16, fp16 with fp16 or load_in_8bit, fp32 otherwise (axolotl utils/config normalize_config);
- `fp8: true` is Accelerate's fp8 mode with torchao: AORecipeKwargs(Float8LinearConfig(enable_fsdp_float8_all_gather
  =fp8_enable_fsdp_float8_all_gather, force_recompute_fp8_weight_in_bwd=the same)), tensorwise, Accelerate's module
  filter (first and last Linear kept), bf16 compute (axolotl core/trainers/base.py additional_accelerator_args);
- FSDP2 (`fsdp_version: 2` + `fsdp_config`) is Accelerate's FSDP2: fp32 masters, one dtype for compute and
  reduction; `deepspeed: FILE` is that DeepSpeed JSON with "auto" filled from these keys (HF Trainer);
- neither: DDP, which fp8dist runs as FSDP2 with nothing sharded;
- tensor_parallel_size / context_parallel_size (sequence_parallel_degree, its deprecated name) split the model and
  the sequence (axolotl-ai-cloud/axolotl@067b021: transformers' tp_plan, or AutoTP under DeepSpeed; ring-flash-attn),
  the data-parallel sizes being what is left of the world size, as fp8dist's mesh has them;
- expert_parallel_size splits each MoE layer's experts over that many ranks (its plugin, DeepEP), each of them reading
  its own batch: fp8dist's parallel.expert_size;
- `adapter: qlora` + `load_in_4bit: true` is LoRA over a bitsandbytes NF4 base with its scales quantized too
  (loaders/model.py _set_quantization_config: bnb_4bit_quant_type nf4, bnb_4bit_use_double_quant true, overridden by
  bnb_config_kwargs): fp8dist's adapter.base_dtype nf4 (torchao's NF4, whose scales are always quantized);
- `lora_modules_to_save` is PEFT's modules_to_save (loaders/adapter.py load_lora): fp8dist's adapter.modules_to_save;
  `peft_use_dora: true` is PEFT's use_dora there: fp8dist's adapter.use_dora;
- `model_quantization_config: Mxfp4Config` with `model_quantization_config_kwargs: {dequantize: true}` (the gpt-oss
  examples) dequantizes the MXFP4 checkpoint at load: the run trains 16-bit weights.
Every key is in KEYS with its class (fp8dist/formats/keys.py: kept, no effect, refused); docs/import.md prints it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from fp8dist.errors import Issue
from fp8dist.formats.accelerate.sections import fsdp_settings, note_accelerate_refusals
from fp8dist.formats.common import (pop_switch, HF_OPTIMIZERS, NF4_SCALES, NF4_STORAGE, Imported, ImportProblem, Notes,
                                   WrongShape, dtype_name, hf_optimizer, integer, mapping, module_names, parallel_size,
                                   read_beside, stepped_dtype, truthy, yaml11_number)
from fp8dist.formats.deepspeed.importer import AutoContext, convert_config
from fp8dist.formats.keys import Table, disabled, kept, no_effect, refused

# Axolotl also takes `adamw` (its config's OptimizerNames, axolotl utils/schemas/enums.py) for torch's AdamW
_OPTIMIZERS = {**HF_OPTIMIZERS, "adamw": ("adamw", None)}
_TRAIN = {"micro_batch_size": "micro_batch_size", "gradient_accumulation_steps": "gradient_accumulation_steps",
          "max_grad_norm": "gradient_clipping", "seed": "seed", "max_steps": "steps", "sequence_len": "seq_len"}
_OPTIM = {"learning_rate": "lr", "weight_decay": "weight_decay", "adam_epsilon": "eps", "adam_eps": "eps"}

_DATA = "data, tokenisation or the model's choice: not part of a precision config"
_LOGGING = "logging, evaluation or saving: no effect on the training numerics"
_KERNEL = "a fused or alternative kernel for the same computation in the same dtypes"
_SCHEDULE = "fp8dist builds no learning-rate schedule; your script's scheduler is used"
_TF32 = ("with fp32 compute it turns every matmul into TF32 (10-bit mantissa; axolotl utils/config normalize_config), "
         "which fp8dist does not do")
_WITH_ADAPTER = "read only with `adapter: lora`"
# Axolotl's expert parallel (axolotl-ai-cloud/axolotl@067b021 src/axolotl/integrations/expert_parallel: its plugin's
# DeepEP dispatch and combine; args.py ExpertParallelArgs)
_DEEPEP = "DeepEP's {what}; fp8dist sends the tokens to their experts with torch's all-to-all"
_ADAPTER = ("trains another kind of adapter than LoRA (llama-adapter, a plugin's), which fp8dist's `adapter` section "
            "does not run")
_WITH_QLORA = "read only with `adapter: qlora` and `load_in_4bit: true` (loaders/model.py _set_quantization_config)"
_BNB_8BIT = "an option of bitsandbytes' 8-bit base (LLM.int8), read only with load_in_8bit"
# What Axolotl uses for a left-out key (axolotl src/axolotl/utils/schemas/training.py HyperparametersConfig:
# micro_batch_size 1, gradient_accumulation_steps 1; schemas/config.py sequence_len 512, bf16 `auto`), and what the
# HF Trainer's TrainingArguments uses for max_grad_norm (transformers 5.24 training_args.py: 1.0).
DEFAULTS = {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "sequence_len": 512, "bf16": "auto",
            "max_grad_norm": 1.0}
KEYS = Table("Axolotl", {
    # precision (kept)
    "bf16": kept("precision.mixed_precision / load_dtype (Axolotl's default `auto`: bf16 where the GPU has it)"),
    "bfloat16": kept("precision.load_dtype bf16 (the weights' dtype only; bf16 decides the mixed precision)"),
    "fp16": kept("precision.mixed_precision / load_dtype"),
    "float16": kept("precision.load_dtype fp16 (the weights' dtype only; fp16 decides the mixed precision)"),
    "fp8": kept("precision.fp8 (torchao tensorwise, Accelerate's module filter)"),
    "fp8_enable_fsdp_float8_all_gather": kept("precision.fp8.torchao.enable_fsdp_float8_all_gather"),
    "tf32": refused(_TF32, "set tf32: false to train in full fp32, or bf16: true"),  # no effect on 16-bit compute
    # axolotl src/axolotl/utils/schemas/nvfp4.py NVFP4TrainingConfig: FP4 GEMMs by Axolotl's own module swap; its
    # skip_first_n_blocks / skip_last_n_blocks are Megatron-Core's num_layers_at_start/end_in_bf16
    "nvfp4_training": refused("Axolotl's NVFP4 GEMM training (FP4 forward and backward GEMMs through its own "
                              "module swap), which fp8dist does not build; its skip_first_n_blocks / "
                              "skip_last_n_blocks are fp8dist's precision.fp8.keep_first_layers / keep_last_layers",
                              "remove it and write precision.fp8 (fp8: true, or Transformer Engine's recipe nvfp4) "
                              "with precision.fp8.keep_first_layers / keep_last_layers for the skipped blocks",
                              unless=disabled, otherwise="off",
                              example={"enabled": True, "skip_first_n_blocks": 1, "skip_last_n_blocks": 2}),
    # parallel layout (kept)
    "fsdp": kept("parallel.sharding (with fsdp_config)", example=["full_shard", "auto_wrap"]),
    "fsdp_config": kept("parallel / fsdp2 (fp8dist/formats/accelerate/sections.py)", example={"fsdp_version": 2}),
    "fsdp_version": kept("FSDP2 (fp8dist runs FSDP2; FSDP1's keys are read for their FSDP2 meaning)", example=2),
    "deepspeed": kept("engine deepspeed, from that JSON", example="deepspeed_configs/zero2.json"),
    "dp_shard_size": kept("parallel.sharding / shard_size (with dp_replicate_size > 1: hybrid)", example=2),
    "dp_replicate_size": kept("parallel.sharding hybrid (with dp_shard_size)", example=2),
    "tensor_parallel_size": kept("parallel.tensor_size (FSDP2: transformers' tp_plan, without sequence parallel; "
                                 "deepspeed: AutoTP, tensor_parallel.autotp_size)", example=2),
    "context_parallel_size": kept("parallel.context_size (ring attention)", example=2),
    "sequence_parallel_degree": kept("parallel.context_size (the deprecated name of context_parallel_size)",
                                     example=2),
    "gradient_checkpointing": kept("parallel.activation_checkpointing: full"),
    "torch_compile": kept("compile"),
    # batch and optimizer (kept)
    "micro_batch_size": kept("train.micro_batch_size (Axolotl's default 1)", example=2),
    "batch_size": kept("train.gradient_accumulation_steps = batch_size // micro_batch_size (Axolotl's derivation)",
                       example=8),
    "gradient_accumulation_steps": kept("train.gradient_accumulation_steps", example=4),
    "max_grad_norm": kept("train.gradient_clipping", example=1.0),
    "max_steps": kept("train.steps", example=10),
    "sequence_len": kept("train.seq_len", example=512),
    "seed": kept("train.seed", example=42),
    "learning_rate": kept("optimizer.lr", example=2e-5),
    "weight_decay": kept("optimizer.weight_decay", example=0.0),
    "adam_epsilon": kept("optimizer.eps", example=1e-8),
    "adam_eps": kept("optimizer.eps", example=1e-8),
    "adam_beta1": kept("optimizer.betas[0]", example=0.9),
    "adam_beta2": kept("optimizer.betas[1]", example=0.95),
    "optimizer": kept("optimizer.name / state_dtype (8-bit Adam: torchao AdamW8bit on FSDP2; paged_adamw_32bit / "
                      "_8bit: that AdamW, paging being memory management)", example="adamw_torch"),
    # refused: what fp8dist cannot keep
    "adapter": refused(_ADAPTER, "use adapter: lora (or qlora with load_in_4bit), or keep training it with Axolotl",
                       unless=lambda value: disabled(value) or value in ("lora", "qlora"),
                       otherwise="none: no adapter; lora: kept as adapter.kind lora (with lora_r, lora_alpha, "
                                 "lora_dropout, lora_target_modules / lora_target_linear); qlora: the same over "
                                 "adapter.base_dtype nf4", example="llama-adapter"),
    "load_in_4bit": refused("a 4-bit base is built only with adapter: qlora (loaders/model.py "
                            "_set_quantization_config); without it Axolotl refuses load_in_4bit (no adapter) or loads "
                            "the base unquantized and still runs PEFT's prepare_model_for_kbit_training (adapter: "
                            "lora; before axolotl@aa1240a: transformers' default 4-bit base, FP4), neither of which "
                            "fp8dist builds", "write adapter: qlora (fp8dist: adapter.base_dtype nf4), or remove "
                            "load_in_4bit", unless=disabled, otherwise="off"),
    "load_in_8bit": refused("an 8-bit bitsandbytes base (LLM.int8; fp8dist's adapter.base_dtype int8), which fp8dist "
                            "does not build", "remove it (LoRA over the 16-bit base), or use adapter: qlora with "
                            "load_in_4bit: true (fp8dist's NF4 base)", unless=disabled, otherwise="off"),
    "bnb_config_kwargs": kept("adapter.base_dtype nf4's settings (bitsandbytes' 4-bit options over Axolotl's: nf4, "
                              "double quantization, storage)", example={"bnb_4bit_quant_type": "nf4"}),
    "gptq": refused("trains a GPTQ-quantised model", "start from the unquantised model", unless=disabled,
                    otherwise="off"),
    "model_quantization_config": refused("loads the model quantised (MXFP4, FP8) and trains on those weights; only "
                                         "Mxfp4Config with dequantize: true, which dequantizes the checkpoint at load, "
                                         "trains 16-bit weights", "remove it, or for an MXFP4 checkpoint (gpt-oss) set "
                                         "model_quantization_config_kwargs: {dequantize: true}", unless=disabled,
                                         otherwise="none", example="Mxfp4Config"),
    "model_quantization_config_kwargs": no_effect("read only with model_quantization_config (loaders/model.py "
                                                  "_set_quantization_config)", example={"dequantize": True}),
    "quantize_moe_experts": refused("quantises the MoE experts' weights", "remove it", unless=disabled,
                                    otherwise="off"),
    "qat": refused("quantization-aware training (fake-quantised weights and activations)", "remove the qat section: "
                   "fp8dist has no QAT", unless=disabled, otherwise="empty", example={"weight_dtype": "int4"}),
    "unfrozen_parameters": refused("trains only the parameters it lists", "remove it (fp8dist trains every "
                                   "parameter)", unless=disabled, otherwise="empty", example=["^lm_head.weight$"]),
    "peft_use_dora": kept("adapter.use_dora (DoRA: a trained magnitude vector beside each adapter; false: plain "
                          "LoRA, noted)"),
    "peft_use_rslora": refused("rank-stabilised LoRA: scales the update by alpha / sqrt(r), not alpha / r",
                               "remove it (or scale adapter.alpha by sqrt(r) yourself)", unless=disabled,
                               otherwise="off", example=True),
    "lora_modules_to_save": kept("adapter.modules_to_save (modules trained whole beside the adapters: PEFT "
                                 "modules_to_save, e.g. embed_tokens and lm_head for new tokens)", example=["lm_head"]),
    "lora_target_parameters": refused("adapters on parameters (PEFT target_parameters, e.g. MoE experts), which "
                                      "fp8dist's `adapter` does not run", "remove it", unless=disabled,
                                      otherwise="none", example=["experts.gate_up_proj"]),
    "peft_layers_to_transform": refused("adapters on some layers only (PEFT layers_to_transform)", "remove it",
                                        unless=disabled, otherwise="every layer", example=[0, 1]),
    "relora_steps": refused("ReLoRA: adapters merged every N steps", "remove it", unless=disabled, otherwise="off",
                            example=200),
    "fp32_norms": refused("keeps norm layers in fp32 under FSDP2 (a per-module policy)", "remove it: fp8dist gives "
                          "every FSDP2 unit the same MixedPrecisionPolicy", unless=disabled, otherwise="off"),
    "expert_parallel_size": kept("parallel.expert_size (each MoE layer's experts split over this many ranks, every "
                                 "rank reading its own batch)", example=2),
    "expert_parallel_token_capacity": refused("drops the lowest-weight (token, expert) assignments past this many "
                                              "tokens per expert (integrations/expert_parallel/experts_fn.py "
                                              "_apply_expert_capacity): a routing fp8dist does not run",
                                              "remove it (every token reaches its experts in fp8dist)", example=1024),
    "expert_parallel_backend": no_effect(_DEEPEP.format(what="kernels (deep_ep, the only choice)"), example="deep_ep"),
    "expert_parallel_num_nvl_bytes": no_effect(_DEEPEP.format(what="NVLink buffer size"), example=268435456),
    "expert_parallel_num_rdma_bytes": no_effect(_DEEPEP.format(what="RDMA buffer size"), example=0),
    "expert_parallel_fallback_on_unsupported": no_effect(_DEEPEP.format(what="absence: Axolotl then runs the experts "
                                                                              "unsplit, or stops"), example=True),
    "lora_r": kept("adapter.r", example=16),
    "lora_alpha": kept("adapter.alpha", example=32),
    "lora_dropout": kept("adapter.dropout", example=0.05),
    "lora_target_modules": kept("adapter.target_modules", example=["q_proj"]),
    "lora_target_linear": kept("adapter.target_modules: auto (every Linear but the output layer)"),
    "lora_fan_in_fan_out": refused("sets PEFT's fan_in_fan_out by hand", "remove it (PEFT sets it from the layer "
                                   "type)", unless=disabled, otherwise="off"),
    "lora_model_dir": refused("starts from saved adapter weights; fp8dist creates new adapters", "remove it",
                              unless=disabled, otherwise="none", example="adapter/"),
    # no effect on the numerics, the layout, the trained parameters or the global batch
    **{key: no_effect(_DATA, example="x") for key in (
        "base_model", "base_model_ignore_patterns", "base_model_config", "model_type", "tokenizer_type",
        "tokenizer_legacy", "tokenizer_use_fast", "tokenizer_config", "trust_remote_code", "datasets",
        "dataset_prepared_path", "pretraining_dataset", "push_dataset_to_hub", "val_set_size", "test_datasets",
        "chat_template", "special_tokens", "tokens", "eot_tokens", "train_on_inputs", "group_by_length",
        "sample_packing", "eval_sample_packing", "pad_to_sequence_len", "min_sample_len", "max_packed_sequence_len",
        "model_config", "reward_model", "num_labels", "cls_model_config", "center_rewards_coefficient", "rl",
        "hf_use_auth_token", "strict", "reinit_weights", "plugins", "use_eaft", "eaft_alpha", "eaft_k",
        "experts_implementation")},
    **{key: no_effect(_LOGGING, example="x") for key in (
        "output_dir", "wandb_project", "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model",
        "wandb_run_id", "trackio_project_name", "trackio_run_name", "trackio_space_id", "use_tensorboard",
        "logging_steps", "evals_per_epoch", "eval_steps", "eval_batch_size", "evaluation_strategy",
        "saves_per_epoch", "save_steps", "save_strategy", "save_total_limit", "save_only_model",
        "early_stopping_patience", "loss_watchdog_threshold", "loss_watchdog_patience", "debug",
        "resume_from_checkpoint", "auto_resume_from_checkpoints", "save_safetensors")},
    **{key: no_effect(_KERNEL) for key in (
        "flash_attention", "sdp_attention", "xformers_attention", "flex_attention", "attn_implementation",
        "flash_attn_cross_entropy", "flash_attn_rms_norm", "flash_attn_fuse_mlp", "flash_attn_fuse_qkv",
        "flash_optimum", "flex_attn_compile_kwargs", "liger_rope", "liger_rms_norm", "liger_rms_norm_gated",
        "liger_glu_activation", "liger_layer_norm", "liger_fused_linear_cross_entropy", "liger_cross_entropy",
        "use_kernels", "lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "tiled_mlp",
        "cut_cross_entropy")},
    **{key: no_effect(_SCHEDULE, example="cosine") for key in (
        "lr_scheduler", "warmup_steps", "warmup_ratio", "cosine_min_lr_ratio", "cosine_constant_lr_ratio",
        "lr_quadratic_warmup", "lr_scheduler_kwargs")},
    "num_epochs": no_effect("how long to train; fp8dist's runs take train.steps", example=3),
    "gradient_checkpointing_kwargs": no_effect("fp8dist checkpoints with torch's non-reentrant checkpoint_wrapper",
                                               example={"use_reentrant": False}),
    "activation_offloading": no_effect("moves saved activations to the host: memory, not numerics or layout"),
    "torch_compile_backend": no_effect("fp8dist compiles with torch.compile's defaults (inductor)", example="inductor"),
    "torch_compile_mode": no_effect("fp8dist compiles with torch.compile's defaults", example="max-autotune"),
    "ddp_find_unused_parameters": no_effect("a DDP bookkeeping switch", example=False),
    "device_map": no_effect("Accelerate places the model under accelerate launch (axolotl choose_device)",
                            example="auto"),
    "low_cpu_mem_usage": no_effect("transformers 5 ignores it (modeling_utils.py: 'Not used anymore')"),
    "local_rank": no_effect("set by the launcher", example=0),
    "use_ray": no_effect("a launcher choice"),
    "ray_num_workers": no_effect("a launcher choice", example=2),
    "torchdistx_path": no_effect("a model-loading helper", example="/x"),
    "experimental_skip_move_to_device": no_effect("a model-loading detail"),
    "gptq_groupsize": no_effect("read only with gptq", example=128),
    "gptq_model_v1": no_effect("read only with gptq", example=False),
    "gptq_disable_exllama": no_effect("read only with gptq"),
}, unknown_why="check that it changes neither the precision, nor the parallel layout, nor which parameters train, "
               "nor the global batch")


def convert(document: dict[str, Any], text: str, source: str) -> Imported:
    notes = Notes()
    issues: list[Issue] = []
    cfg = dict(document)
    fp8 = bool(truthy(cfg.pop("fp8", False)))
    bf16, fp16 = _half_precision(cfg, notes)
    bfloat16, float16 = (bool(truthy(cfg.pop(key, False))) for key in ("bfloat16", "float16"))
    all_gather = bool(truthy(cfg.pop("fp8_enable_fsdp_float8_all_gather", False)))
    load_8bit = bool(truthy(cfg.get("load_in_8bit", False)))
    load_dtype = "bf16" if bf16 or bfloat16 else "fp16" if (fp16 or load_8bit or float16) else "fp32"
    notes.resolved("precision.load_dtype", load_dtype, "Axolotl loads the model in bf16 with bf16 or bfloat16, fp16 "
                   "with fp16, float16 or load_in_8bit, fp32 otherwise (utils/config normalize_config: torch_dtype)")
    mixed = "fp8" if fp8 else "bf16" if bf16 else "fp16" if fp16 else "no"
    compute = {"fp8": "bf16", "no": "none"}.get(mixed, mixed)
    _tf32(cfg, compute if compute != "none" else load_dtype, notes, issues)
    deepspeed = cfg.pop("deepspeed", None)
    fsdp_config, fsdp_version, legacy = (cfg.pop("fsdp_config", None), cfg.pop("fsdp_version", None),
                                         cfg.pop("fsdp", None))
    _batch_defaults(cfg, notes)
    ctx = AutoContext(who="HF Trainer (Axolotl)", mixed_precision=mixed,
                      micro_batch_size=cfg.get("micro_batch_size"),
                      gradient_accumulation_steps=cfg.get("gradient_accumulation_steps"),
                      gradient_clipping=yaml11_number(cfg.get("max_grad_norm", DEFAULTS["max_grad_norm"])),
                      lr=yaml11_number(cfg.get("learning_rate")),
                      weight_decay=yaml11_number(cfg.get("weight_decay", 0.0)),
                      eps=yaml11_number(cfg.get("adam_epsilon", cfg.get("adam_eps", 1e-8))),
                      betas=[yaml11_number(cfg.get("adam_beta1", 0.9)), yaml11_number(cfg.get("adam_beta2", 0.999))])
    fsdp_on = not disabled(fsdp_config) or not disabled(legacy)
    if deepspeed and fsdp_on:
        issues.append(Issue("deepspeed", "set together with FSDP; Accelerate runs one of them", deepspeed,
                            "remove deepspeed or fsdp_config"))
    ds: dict[str, Any] = {}  # the DeepSpeed JSON, when the file names one
    if deepspeed:
        # what the rest of the file is read against when the JSON cannot be
        out: dict[str, Any] = {"engine": "deepspeed"}
        try:
            ds, where = read_beside(str(deepspeed), Path(source).parent, "deepspeed", source)
            out = convert_config(ds, source, notes, ctx, f"deepspeed ({where}): ")
        except ImportProblem as exc:  # reported with the file's other problems
            issues.extend(exc.issues)
            ds = {}
        if (ds.get("zero_optimization") or {}).get("stage") == 3 and cfg.get("adapter") in _LORA_KINDS:
            notes.resolved("parallel.cpu_ram_efficient_loading", False, "under ZeRO-3 the HF Trainer builds the model "
                           "inside deepspeed.zero.Init; fp8dist adds LoRA adapters to a fully loaded model, then "
                           "partitions it (the result is the same partitioned base)")
        elif (ds.get("zero_optimization") or {}).get("stage") == 3:
            out.setdefault("parallel", {})["cpu_ram_efficient_loading"] = True
            notes.resolved("parallel.cpu_ram_efficient_loading", True, "under ZeRO-3 the HF Trainer builds the "
                           "model inside deepspeed.zero.Init (transformers integrations/deepspeed.py "
                           "is_deepspeed_zero3_enabled)")
        for key in ("dp_shard_size", "dp_replicate_size"):
            if key in cfg:
                notes.dropped(key, cfg.pop(key), "DeepSpeed's ZeRO stage decides the sharding")
    else:
        out = {"engine": "fsdp2"}
        if fsdp_on:
            if not disabled(legacy):
                notes.resolved("fsdp", "FSDP", "the FSDP1 option list turns FSDP on; fsdp_config decides its settings")
            version = integer(fsdp_version, "fsdp_version") if fsdp_version is not None else None
            parallel, fsdp2 = fsdp_settings(mapping(fsdp_config, "fsdp_config"), version, notes, issues, "fsdp_config.")
            precision = {"mixed_precision": compute, "master_weights": "fp32" if mixed != "no" else "none",
                         "reduce_dtype": compute if mixed != "no" else load_dtype}
            if mixed != "no":
                notes.resolved("bf16/fp16/fp8", f"{compute} compute, fp32 masters, {compute} reduction",
                               "Accelerate's FSDP2 under the Trainer: one policy dtype, weights upcast to fp32")
        else:
            if fsdp_version is not None:
                notes.dropped("fsdp_version", fsdp_version, "no fsdp_config")
            parallel, fsdp2 = {"sharding": "replicate"}, {}
            precision = {"mixed_precision": compute, "master_weights": "none", "reduce_dtype": load_dtype}
            notes.resolved("(no fsdp_config or deepspeed)", "parallel.sharding=replicate", "Axolotl runs DDP, which "
                           "fp8dist runs as FSDP2 with nothing sharded; the optimizer steps the weights as loaded")
            if cfg.get("adapter") in _LORA_KINDS and mixed != "no":
                # PEFT creates the adapters in fp32 over a 16-bit base (peft 0.21 get_peft_model
                # autocast_adapter_dtype=True, which Axolotl keeps) and the Trainer autocasts the forward
                precision.update(master_weights="fp32", reduce_dtype="fp32")
                notes.resolved("adapter", "precision.master_weights=fp32, reduce_dtype=fp32", "PEFT keeps the LoRA "
                               f"adapters in fp32 under Axolotl (the frozen base stays {load_dtype}) and DDP reduces "
                               "their gradients in fp32")
        _data_parallel_sizes(cfg, parallel, notes, issues)
        out["precision"] = {"load_dtype": load_dtype, **precision}
        if parallel:
            out["parallel"] = parallel
        if fsdp2:
            out["fsdp2"] = fsdp2
    _model_parallel_sizes(cfg, out, ds, notes, issues)
    if fp8:
        ao = {"recipe_name": "tensorwise", "enable_fsdp_float8_all_gather": all_gather and out["engine"] == "fsdp2",
              "force_recompute_fp8_weight_in_bwd": all_gather, "pad_inner_dim": False}
        out.setdefault("precision", {})["fp8"] = {"backend": "torchao", "torchao": ao,
                                                  "modules": {"exclude": [], "skip_first_last": True}}
        notes.resolved("fp8", "torchao tensorwise, Accelerate's module filter (first and last Linear kept)",
                       "Axolotl passes AORecipeKwargs(Float8LinearConfig(...)) to Accelerate")
    elif all_gather:
        notes.dropped("fp8_enable_fsdp_float8_all_gather", True, "acts only with fp8: true")
    _dequantized_checkpoint(cfg, load_dtype, notes)
    _compile(cfg, out)
    _checkpointing(cfg, out, notes)
    _train_and_optimizer(cfg, out, notes, issues, bool(deepspeed))
    _adapter(cfg, out, load_dtype, notes, issues)
    for key, value in cfg.items():
        KEYS.settle(key, value, notes, issues)
    if issues:
        raise ImportProblem(issues, source, "axolotl", out)
    note_accelerate_refusals(out, notes, "this Axolotl config")
    return Imported("axolotl", out, notes)


_LORA = {"lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout"}
_LORA_KINDS = ("lora", "qlora")  # both train LoRA adapters; qlora over a 4-bit base
# What Axolotl's union with lora_target_linear can add beyond PEFT's all-linear (axolotl loaders/adapter.py
# load_lora: target_modules + find_all_linear_names, which leaves the output layer out): output layers and
# embeddings named by hand.
_NOT_IN_ALL_LINEAR = {"lm_head", "embed_tokens", "embed_out", "wte", "wpe", "output", "embeddings"}
_LORA_TARGETS = ("lora_target_modules", "lora_target_linear")


def _adapter(cfg: dict[str, Any], out: dict[str, Any], load_dtype: str, notes: Notes, issues: list[Issue]) -> None:
    """`adapter: lora` / `qlora` and their keys -> `adapter`. Axolotl targets lora_target_modules plus, with
    lora_target_linear, every Linear but the output layer (axolotl loaders/adapter.py load_lora,
    find_all_linear_names): fp8dist's `auto`. qlora with load_in_4bit is the same LoRA over an NF4 base; other kinds
    and the 4/8-bit bases of other adapters are refused by KEYS; without an adapter the lora_* keys are noted."""
    kind = cfg.pop("adapter", None)
    bnb_options = cfg.pop("bnb_config_kwargs", None)
    nf4 = kind == "qlora" and bool(truthy(cfg.get("load_in_4bit")))
    if bnb_options is not None and not nf4:
        notes.dropped("bnb_config_kwargs", bnb_options, _WITH_QLORA)
    if kind == "qlora" and not nf4:
        issues.append(Issue("adapter", "qlora without load_in_4bit: Axolotl refuses it (utils/schemas/peft.py "
                            "validate_qlora: \"Require cfg.load_in_4bit to be True for qlora\")", kind,
                            "add load_in_4bit: true (fp8dist: adapter.base_dtype nf4), or write adapter: lora"))
    if kind not in _LORA_KINDS:
        KEYS.refuse("adapter", kind, issues)
        for key, value in {key: cfg.pop(key) for key in [k for k in cfg if k.startswith("lora_")
                                                          or k == "peft_use_dora"]}.items():
            if value is not None:
                notes.dropped(key, value, _WITH_ADAPTER)
        return
    mapped = {key: cfg.pop(key) for key in [*_LORA, *_LORA_TARGETS] if key in cfg}
    adapter = {"kind": "lora", **{_LORA[key]: value for key, value in mapped.items() if key in _LORA
                                  and value is not None}}
    saved = module_names(cfg.pop("lora_modules_to_save", None), "lora_modules_to_save")
    if saved:  # Axolotl passes an empty list to PEFT as None (loaders/adapter.py load_lora)
        adapter["modules_to_save"] = saved
    if pop_switch(cfg, "peft_use_dora", notes, "off"):  # load_lora: LoraConfig(use_dora=cfg.peft_use_dora)
        adapter["use_dora"] = True
    if nf4:
        cfg.pop("load_in_4bit")
        adapter["base_dtype"] = "nf4"
        notes.resolved("adapter: qlora, load_in_4bit", "adapter.kind=lora, base_dtype=nf4", "Axolotl's QLoRA: "
                       "bitsandbytes NF4 with double quantization for every Linear but the output layer, computed in "
                       "the load dtype; fp8dist quantizes the frozen Linears but the output layer, MoE routers and "
                       "modules to save with torchao's NF4 at load (FSDP2 only)")
        _nf4_options(bnb_options, load_dtype, notes, issues)
    modules = mapped.get("lora_target_modules")
    modules = [modules] if isinstance(modules, str) else list(modules or [])
    outside = [name for name in modules if name in _NOT_IN_ALL_LINEAR]
    if truthy(mapped.get("lora_target_linear")) and outside:
        issues.append(Issue("lora_target_modules", f"with lora_target_linear Axolotl adapts every Linear and also "
                            f"{outside}, which fp8dist's target_modules auto (every Linear but the output layer) "
                            "leaves out", modules, "remove them from lora_target_modules, or list every target "
                            "without lora_target_linear"))
    elif truthy(mapped.get("lora_target_linear")):
        adapter["target_modules"] = "auto"
    elif modules:
        adapter["target_modules"] = modules
    else:
        issues.append(Issue("lora_target_modules", "adapter: lora names no target (neither lora_target_modules nor "
                            "lora_target_linear), and Axolotl's choice then is PEFT's per-architecture default, "
                            "which fp8dist does not guess", modules, "set lora_target_linear: true (fp8dist: "
                            "target_modules auto) or list lora_target_modules"))
    out["adapter"] = adapter


def _nf4_options(options: Any, load_dtype: str, notes: Notes, issues: list[Issue]) -> None:
    """bnb_config_kwargs: Axolotl updates its QLoRA BitsAndBytesConfig with them (loaders/model.py
    _set_quantization_config: nf4, double quantization, compute dtype = the load dtype, storage bf16)."""
    for key, value in mapping(options, "bnb_config_kwargs").items():
        shown = f"bnb_config_kwargs.{key}"
        if value is None:
            continue
        if key == "bnb_4bit_quant_type" and value != "nf4":
            issues.append(Issue(shown, "bitsandbytes' FP4 data type, not NF4: fp8dist's 4-bit base is NF4 only",
                                value, "write nf4 (Axolotl's default), or remove it"))
        elif key == "bnb_4bit_use_double_quant" and not truthy(value):
            notes.dropped(shown, value, NF4_SCALES)
        elif key == "bnb_4bit_quant_storage":
            notes.dropped(shown, value, NF4_STORAGE)
        elif key == "bnb_4bit_compute_dtype" and dtype_name(value) != load_dtype:
            issues.append(Issue(shown, f"computes the 4-bit GEMMs in another dtype than the model loads in "
                                f"({load_dtype}); fp8dist dequantizes its NF4 base to the run's compute dtype", value,
                                "remove it (Axolotl's default: the load dtype)"))
        elif key in ("llm_int8_threshold", "llm_int8_has_fp16_weight", "llm_int8_enable_fp32_cpu_offload"):
            notes.dropped(shown, value, _BNB_8BIT)
        elif key not in ("bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype"):
            issues.append(Issue(shown, "changes which modules bitsandbytes quantizes, or how, beyond the NF4 options "
                                "fp8dist maps (quant type nf4, double quantization, storage, compute dtype)", value,
                                "remove it: fp8dist's NF4 base covers every frozen Linear but the output layer and "
                                "MoE routers"))


def _dequantized_checkpoint(cfg: dict[str, Any], load_dtype: str, notes: Notes) -> None:
    """`model_quantization_config: Mxfp4Config` with `dequantize: true` (Axolotl's gpt-oss examples): transformers
    dequantizes the MXFP4 checkpoint as it loads it, so the run trains 16-bit weights. Any other quantization config
    is left to KEYS, which refuses it."""
    kwargs = cfg.get("model_quantization_config_kwargs")
    if cfg.get("model_quantization_config") != "Mxfp4Config" or not isinstance(kwargs, Mapping) \
            or not truthy(kwargs.get("dequantize")):
        return
    cfg.pop("model_quantization_config")
    cfg.pop("model_quantization_config_kwargs")
    notes.resolved("model_quantization_config: Mxfp4Config, dequantize: true", f"{load_dtype} weights",
                   f"transformers dequantizes the MXFP4 checkpoint to the load dtype ({load_dtype}) as it loads it "
                   "(transformers 5.24 integrations/mxfp4.py Mxfp4Dequantize), and the run trains those; fp8dist "
                   "loads with from_pretrained and no quantization_config: give it the checkpoint dequantized (as "
                   "Axolotl's gpt-oss-120b example does: axolotl-ai-co/gpt-oss-120b-dequantized)")
    for key, value in kwargs.items():
        if key != "dequantize":
            notes.dropped(f"model_quantization_config_kwargs.{key}", value, "an MXFP4 option; dequantized, no "
                          "weight stays MXFP4")


def _batch_defaults(cfg: dict[str, Any], notes: Notes) -> None:
    """Axolotl's own values for left-out batch keys (DEFAULTS), and its `batch_size` (the batch per
    rank step: gradient_accumulation_steps = batch_size // micro_batch_size when accumulation is left out)."""
    for key in ("micro_batch_size", "sequence_len"):
        if key not in cfg:
            cfg[key] = DEFAULTS[key]
            notes.resolved(key, cfg[key], "left out: Axolotl's default")
    batch = cfg.pop("batch_size", None)
    if "gradient_accumulation_steps" not in cfg:
        if batch is not None:
            cfg["gradient_accumulation_steps"] = max(integer(batch, "batch_size") // integer(cfg["micro_batch_size"],
                                                                                               "micro_batch_size"), 1)
            notes.resolved("gradient_accumulation_steps", cfg["gradient_accumulation_steps"],
                           "batch_size // micro_batch_size, as Axolotl derives it")
            return
        cfg["gradient_accumulation_steps"] = DEFAULTS["gradient_accumulation_steps"]
        notes.resolved("gradient_accumulation_steps", 1, "left out: Axolotl's default")
    elif batch is not None:
        notes.dropped("batch_size", batch, "derived by Axolotl from micro_batch_size x gradient_accumulation_steps, "
                      "which the file sets")


def _half_precision(cfg: dict[str, Any], notes: Notes) -> tuple[bool, bool]:
    """(bf16, fp16) as Axolotl resolves them: `bf16` defaults to `auto`, which is on on the GPUs fp8dist runs on
    (every GPU with FP8 has bf16), and then bf16 wins over fp16 (axolotl utils/trainer.py prepare_optim_env)."""
    written = "bf16" in cfg
    bf16, fp16 = cfg.pop("bf16", DEFAULTS["bf16"]), bool(truthy(cfg.pop("fp16", False)))
    if bf16 == "auto":
        notes.auto("bf16", True, ("left out, Axolotl's default `auto`" if not written else "`auto`") +
                   ": on where the GPU has bf16 (Ampere and newer, every GPU with FP8); on an older GPU Axolotl "
                   "would use fp16 instead")
        bf16 = True
    elif bf16 == "full":
        notes.resolved("bf16", True, "`full` also evaluates in bf16 (bf16_full_eval), which fp8dist does not run")
        bf16 = True
    bf16 = bool(truthy(bf16))
    if bf16 and fp16:
        notes.dropped("fp16", True, "bf16 wins over fp16 in Axolotl (utils/trainer.py prepare_optim_env)")
        fp16 = False
    return bf16, fp16


def _tf32(cfg: dict[str, Any], compute: str, notes: Notes, issues: list[Issue]) -> None:
    """`compute`: the dtype the GEMMs run in (the mixed precision, else the weights')."""
    if "tf32" not in cfg:
        return
    value = cfg.pop("tf32")
    if compute != "fp32":
        notes.dropped("tf32", value, f"every GEMM runs in the {compute} compute dtype, so TF32 (which acts on fp32 "
                                     "matmuls) changes nothing")
    elif value == "auto" or truthy(value):
        issues.append(Issue("tf32", _TF32, value, KEYS.rules["tf32"].fix))


def _data_parallel_sizes(cfg: dict[str, Any], parallel: dict[str, Any], notes: Notes, issues: list[Issue]) -> None:
    """Axolotl's dp_shard_size x dp_replicate_size (its ParallelismConfig): HSDP when both are above 1."""
    shard, replicate = cfg.pop("dp_shard_size", None), cfg.pop("dp_replicate_size", None)
    if shard is None and replicate is None:
        return
    shard_n = parallel_size(shard, "dp_shard_size") if shard is not None else None
    replicate_n = parallel_size(replicate, "dp_replicate_size")
    if replicate_n > 1 and shard_n and shard_n > 1:
        parallel.update(sharding="hybrid", shard_size=shard_n)
        notes.resolved("dp_shard_size x dp_replicate_size", f"parallel.sharding=hybrid, shard_size={shard_n}",
                       "Axolotl's ParallelismConfig: shard within groups of dp_shard_size, replicate across them")
    elif replicate_n > 1:
        issues.append(Issue("dp_replicate_size", "replicas without a shard size: Axolotl derives dp_shard_size from "
                            "the world size, which depends on the launch", replicate,
                            "write dp_shard_size too (the ranks that shard one copy)"))
    elif shard_n is not None:
        notes.resolved("dp_shard_size", "parallel.sharding (every data-parallel rank)", "Axolotl shards over "
                       "dp_shard_size ranks and replicates over any left (utils/distributed.py "
                       "_get_parallel_config_kwargs): the same run on dp_shard_size x tensor_parallel_size x "
                       "context_parallel_size x expert_parallel_size ranks; for more, write parallel.sharding: hybrid, "
                       f"shard_size: {shard_n}")


def _model_parallel_sizes(cfg: dict[str, Any], out: dict[str, Any], ds: Mapping[str, Any], notes: Notes,
                          issues: list[Issue]) -> None:
    """tensor_parallel_size -> parallel.tensor_size, context_parallel_size (or its deprecated name
    sequence_parallel_degree) -> parallel.context_size. Axolotl builds Accelerate's ParallelismConfig from them, the
    data-parallel sizes being what is left of the world size (axolotl utils/distributed.py
    _get_parallel_config_kwargs), as fp8dist's mesh does. `ds`: the DeepSpeed JSON the file names ({} without one)."""
    tp = parallel_size(cfg.pop("tensor_parallel_size", None), "tensor_parallel_size")
    # Axolotl copies the deprecated name over, with a warning, only where context_parallel_size is unset
    # (utils/schemas/validation.py check_context_parallel_size)
    alias = cfg.pop("sequence_parallel_degree", None)
    key, value = "context_parallel_size", cfg.pop("context_parallel_size", None)
    if value is None and alias is not None:
        key, value = "sequence_parallel_degree", alias
        notes.resolved(key, "parallel.context_size", "Axolotl's deprecated name of context_parallel_size, which it "
                       "copies over with a warning")
    elif alias is not None:
        notes.dropped("sequence_parallel_degree", alias, "context_parallel_size decides (Axolotl copies its "
                      "deprecated name only where context_parallel_size is unset)")
    cp = parallel_size(value, key)
    parallel = out.setdefault("parallel", {})
    _expert_parallel_size(cfg, parallel, notes, issues)
    if tp > 1 and out["engine"] == "deepspeed":
        # AutoTP: Axolotl writes tensor_parallel.autotp_size into a JSON without a tensor_parallel section (and
        # leaves a JSON that has one as it is: utils/schemas/validation.py check_tensor_parallel_size_update_ds_json)
        if "tensor_parallel" not in ds:
            parallel["tensor_size"] = tp
            notes.resolved("tensor_parallel_size", f"parallel.tensor_size={tp}", "DeepSpeed AutoTP: Axolotl writes "
                           "tensor_parallel.autotp_size into the DeepSpeed JSON")
        elif parallel.get("tensor_size", 1) != tp:
            issues.append(Issue("tensor_parallel_size", f"the DeepSpeed JSON's tensor_parallel section splits by "
                                f"autotp_size {parallel.get('tensor_size', 1)}, and Axolotl writes its own size only "
                                "into a JSON without that section", tp,
                                "write the same size in both, or remove one of them"))
    elif tp > 1:
        parallel.update(tensor_size=tp, sequence_parallel=False)
        notes.resolved("tensor_parallel_size", f"parallel.tensor_size={tp}, sequence_parallel=false", "Axolotl "
                       "loads the model split by transformers' tp_plan (loaders/model.py _build_model: "
                       "from_pretrained tp_plan='auto'), and the models of transformers 5.24 plan no "
                       "SequenceParallel: the activations between the split Linears stay whole")
        if parallel.get("sharding") == "replicate":
            notes.resolved("tensor_parallel_size", "data-parallel gradients averaged", "without fsdp_config or "
                           "deepspeed Accelerate wraps no tensor-parallel model in DDP (accelerate 1.15 "
                           "accelerator.py prepare_model), so Axolotl's data-parallel ranks (a launch on more than "
                           "tensor_parallel_size x context_parallel_size ranks) would not average their gradients; "
                           "fp8dist's do")
    if cp > 1:
        parallel["context_size"] = cp
        notes.resolved(key, f"parallel.context_size={cp}", "Axolotl splits each sequence over these ranks with "
                       "ring-flash-attn over flash attention (CUDA); fp8dist runs torch's ring attention over SDPA, "
                       "and refuses to start where no GPU attention kernel can shard the sequence")
    if not parallel:
        del out["parallel"]


def _expert_parallel_size(cfg: dict[str, Any], parallel: dict[str, Any], notes: Notes, issues: list[Issue]) -> None:
    """expert_parallel_size -> parallel.expert_size. Axolotl's EP is a data-parallel axis: each ep rank reads its own
    batch, the dense weights are sharded over ep x dp_shard and the experts split over ep, sharded over dp_shard
    (axolotl-ai-cloud/axolotl@067b021 monkeypatch/accelerate/parallelism_config.py: ep in dp_dim_names and
    dp_shard_cp_dim_names; utils/distributed.py _get_parallel_config_kwargs divides the world by it): fp8dist's
    expert_size borrowed from the data-parallel ranks, with the experts sharded over efsdp = dp_shard / expert_size.
    A DeepSpeed JSON that sets AutoEP with another size is refused."""
    size = parallel_size(cfg.pop("expert_parallel_size", None), "expert_parallel_size")
    if size == 1:
        return
    if parallel.get("expert_size", size) != size:
        issues.append(Issue("expert_parallel_size", f"the DeepSpeed JSON's expert_parallel section splits the experts "
                            f"by autoep_size {parallel['expert_size']}, next to Axolotl's own expert parallel", size,
                            "write the same size in both, or remove one of them"))
        return
    parallel["expert_size"] = size
    notes.resolved("expert_parallel_size", f"parallel.expert_size={size}", "Axolotl's expert parallel reads a batch on "
                   "every rank and splits each MoE layer's experts over this many of them, sharded over the others "
                   "(its plugin sends the tokens with DeepEP, fp8dist with torch's all-to-all)")


def _compile(cfg: dict[str, Any], out: dict[str, Any]) -> None:
    value = cfg.pop("torch_compile", None)
    if value == "auto" or truthy(value):
        out["compile"] = True  # Axolotl's `auto`: on where the installed torch compiles


def _checkpointing(cfg: dict[str, Any], out: dict[str, Any], notes: Notes) -> None:
    value = cfg.pop("gradient_checkpointing", None)
    if value is None or value is False:
        return
    if not truthy(value):
        notes.resolved("gradient_checkpointing", "full", f"{value!r}: fp8dist checkpoints each block on the device")
    out.setdefault("parallel", {}).setdefault("activation_checkpointing", "full")


def _train_and_optimizer(cfg: dict[str, Any], out: dict[str, Any], notes: Notes, issues: list[Issue],
                         deepspeed: bool) -> None:
    train = out.setdefault("train", {})
    for key, target in _TRAIN.items():
        if cfg.get(key) is None:  # left out or written without a value: Axolotl's default
            continue
        value = yaml11_number(cfg.pop(key))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WrongShape(key, value, "a number")
        train.setdefault(target, int(value) if target != "gradient_clipping" and float(value).is_integer() else value)
    if not train:
        out.pop("train")
    optimizer = out.setdefault("optimizer", {})
    for key, target in _OPTIM.items():
        if key in cfg:
            optimizer.setdefault(target, yaml11_number(cfg.pop(key)))
    if "adam_beta1" in cfg or "adam_beta2" in cfg:
        optimizer.setdefault("betas", [yaml11_number(cfg.pop("adam_beta1", 0.9)),
                                       yaml11_number(cfg.pop("adam_beta2", 0.999))])
    if "optimizer" in cfg:
        hf_optimizer("optimizer", cfg.pop("optimizer"), deepspeed, optimizer, notes, issues, _OPTIMIZERS,
                     "FSDP2 (fsdp_config)", stepped_dtype(out))
    if not optimizer:
        out.pop("optimizer")
