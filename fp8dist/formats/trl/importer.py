"""A TRL / alignment-handbook recipe YAML -> an fp8dist config.

Such a file is read by TRL's TrlParser (trl scripts/utils.py parse_args_and_config: `yaml.safe_load`, an `env`
section exported, every other key a field of ScriptArguments, the trainer's config (SFTConfig, DPOConfig, ... all
transformers TrainingArguments subclasses) or ModelConfig). What runs, with the sources this rests on
(huggingface/trl@f2cd57710ae345ea6428ae95363267fcf38a3dc8 (v1.9.0+26),
huggingface/alignment-handbook@925acdfe4b2b4e38c3dabd1851bc418f0b656351, transformers 5.24 training_args.py):
- the model loads in `dtype` (TRL >= 0.22; `torch_dtype` before, which the handbook's get_model still reads:
  src/alignment/model_utils.py). Left out or null: TRL's ModelConfig default `float32` (trl/trainer/model_config.py,
  since TRL 0.27, #4778), which is also what transformers 4's from_pretrained loaded for None; `auto` is the
  checkpoint's own dtype, which the file does not say (refused: write it);
- `bf16` defaults to on unless `fp16` (trl/trainer/base_config.py _BaseConfig.__post_init__: `bf16 = not fp16`),
  and `gradient_checkpointing` to true (the same class);
- the Trainer autocasts to bf16/fp16 (Accelerate's mixed precision) over the parameters as loaded: a model loaded in
  bfloat16 has bf16 parameters, bf16 AdamW states and no fp32 master copy (fp8dist: load_dtype bf16,
  mixed_precision bf16, master_weights none); a model loaded in float32 keeps fp32 weights and states;
- `fsdp` + `fsdp_config` is Accelerate's FSDP (transformers 5.24 _process_fsdp_args: FSDP2 unless
  `version: 1`): fp32 masters, one dtype for compute and reduction; `deepspeed: FILE` (or an inline dict) is that
  DeepSpeed JSON with "auto" filled from these keys; neither: DDP (or one process), which fp8dist runs as FSDP2 with
  nothing sharded. The alignment-handbook picks FSDP or ZeRO-3 with `accelerate launch --config_file`, which the
  recipe does not name: import that file too (`fp8dist import recipes/accelerate_configs/zero3.yaml`);
- `use_peft: true` is TRL's get_peft_model_config -> peft.LoraConfig(r=lora_r (16), lora_alpha (32),
  lora_dropout (0.05), target_modules=lora_target_modules, modules_to_save=lora_modules_to_save, use_dora=use_dora,
  ...) (trl/trainer/utils.py get_peft_config); PEFT makes
  the adapters fp32 over a 16-bit base (peft get_peft_model autocast_adapter_dtype=True; TRL turns that off only
  under ZeRO-3, trl/trainer/sft_trainer.py);
- `load_in_4bit: true` with `use_peft: true` is QLoRA: get_quantization_config builds BitsAndBytesConfig(load_in_4bit,
  bnb_4bit_quant_type (nf4), bnb_4bit_use_double_quant=use_bnb_nested_quant (false), bnb_4bit_quant_storage,
  compute dtype = dtype) (trl/trainer/utils.py), and the trainers then cast the trainable adapters to bf16
  (sft_trainer.py, dpo_trainer.py: `_is_quantized_model`): fp8dist's adapter.base_dtype nf4.
Every key is in KEYS with its class (fp8dist/formats/keys.py: kept, no effect, refused); docs/import.md prints it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from fp8dist.errors import Issue
from fp8dist.facts.peft import PEFT_ALL_LINEAR
from fp8dist.formats.accelerate.sections import fsdp_settings, note_accelerate_refusals
from fp8dist.formats.common import (pop_switch, NF4_SCALES, NF4_STORAGE, Imported, ImportProblem, Notes, WrongShape,
                                   dtype_name, hf_optimizer, integer, mapping, module_names, read_beside, stepped_dtype,
                                   truthy, yaml11_number)
from fp8dist.formats.deepspeed.importer import AutoContext, convert_config
from fp8dist.formats.keys import Table, disabled, kept, no_effect, refused

# What a recipe that leaves a key out gets: TrainingArguments' defaults (transformers 5.24 training_args.py; the same
# in 4.x but `optim`, which was adamw_torch) and TRL's (trl/trainer/model_config.py ModelConfig lora_r / lora_alpha /
# lora_dropout, SFTConfig / DPOConfig max_length).
DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_grad_norm": 1.0, "seed": 42,
            "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "max_length": 1024}
_TRAIN = {"per_device_train_batch_size": "micro_batch_size",
          "gradient_accumulation_steps": "gradient_accumulation_steps", "max_grad_norm": "gradient_clipping",
          "seed": "seed"}
_OPTIM = {"learning_rate": "lr", "weight_decay": "weight_decay", "adam_epsilon": "eps"}
_LORA = {"lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout"}
# ModelConfig's LoRA keys, read by get_peft_config only with use_peft: true
_PEFT_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
              "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora")

_DATA = "data, tokenisation, the model's name or the loss your script computes: not part of a precision config"
_LOGGING = "logging, evaluation, saving or the Hub: no effect on the training numerics"
_KERNEL = "a fused or alternative kernel for the same computation in the same dtypes"
_SCHEDULE = "fp8dist builds no learning-rate schedule; your script's scheduler is used"
_LAUNCH = "a launch or process setting, not one of the run's numerics or layout"
_TF32 = ("with fp32 compute it turns every matmul into TF32 (10-bit mantissa; transformers training_args.py "
         "enable_tf32), which fp8dist does not do")
_WITH_PEFT = "read only with `use_peft: true` (trl/trainer/utils.py get_peft_config)"
_WITH_4BIT = "read only with load_in_4bit and use_peft (trl get_quantization_config)"
_VLLM = ("the tensor parallel of vLLM's generation (trl/scripts/vllm_serve.py ScriptArguments; GRPOConfig's "
         "vllm_tensor_parallel_size), not the trainer's: the training layout does not change")


KEYS = Table("TRL", {
    # precision (kept)
    "dtype": kept("precision.load_dtype (TRL's default float32; `auto`, the checkpoint's dtype, is refused)",
                  example="bfloat16"),
    "torch_dtype": kept("precision.load_dtype (TRL < 0.27 and the alignment-handbook's name of `dtype`)",
                        example="bfloat16"),
    "bf16": kept("precision.mixed_precision bf16 over the weights as loaded (TRL's default: on unless fp16)"),
    "fp16": kept("precision.mixed_precision fp16 over the weights as loaded, with loss scaling"),
    "tf32": refused(_TF32, "set tf32: false to train in full fp32, or bf16: true"),  # no effect on 16-bit compute
    # parallel layout (kept)
    "fsdp": kept("engine fsdp2 / parallel.sharding (the FSDP option string: full_shard, shard_grad_op, offload)",
                 example="full_shard auto_wrap"),
    "fsdp_config": kept("parallel / fsdp2 (fp8dist/formats/accelerate/sections.py; with fsdp)", example={"version": 2}),
    "deepspeed": kept("engine deepspeed, from that JSON (a path, or the dict itself)", example="ds.json"),
    "gradient_checkpointing": kept("parallel.activation_checkpointing: full (TRL's default true)"),
    "activation_checkpointing": kept("parallel.activation_checkpointing: full (transformers 5's name)"),
    "torch_compile": kept("compile"),
    # batch and optimizer (kept)
    "per_device_train_batch_size": kept("train.micro_batch_size (TrainingArguments' default 8)", example=2),
    "gradient_accumulation_steps": kept("train.gradient_accumulation_steps (default 1)", example=4),
    "max_grad_norm": kept("train.gradient_clipping (default 1.0)", example=1.0),
    "max_steps": kept("train.steps (-1: the epochs decide)", example=10),
    "max_length": kept("train.seq_len (SFT/DPO's max_length, default 1024)", example=512),
    "max_seq_length": kept("train.seq_len (SFTConfig's name before TRL 0.20)", example=512),
    "seed": kept("train.seed (default 42)", example=7),
    "learning_rate": kept("optimizer.lr", example=2e-5),
    "weight_decay": kept("optimizer.weight_decay", example=0.01),
    "adam_epsilon": kept("optimizer.eps", example=1e-8),
    "adam_beta1": kept("optimizer.betas[0]", example=0.9),
    "adam_beta2": kept("optimizer.betas[1]", example=0.95),
    "optim": kept("optimizer.name / state_dtype (AdamW, SGD; 8-bit AdamW: torchao AdamW8bit on FSDP2; paged_adamw_32bit"
                  " / _8bit: that AdamW, paging being memory management)",
                  example="adamw_torch"),
    # adapters (ModelConfig)
    "use_peft": kept("adapter.kind lora (with lora_r, lora_alpha, lora_dropout, lora_target_modules, "
                     "lora_modules_to_save, use_dora)"),
    "lora_r": kept("adapter.r (TRL's default 16)", example=8),
    "lora_alpha": kept("adapter.alpha (TRL's default 32)", example=16),
    "lora_dropout": kept("adapter.dropout (TRL's default 0.05)", example=0.1),
    "lora_target_modules": kept("adapter.target_modules (`all-linear`: auto; a list: those names)",
                                example=["q_proj", "v_proj"]),
    # refused: what fp8dist cannot keep
    "load_in_4bit": refused("a 4-bit base without use_peft: TRL quantizes the model anyway (get_quantization_config) "
                            "and the HF Trainer refuses to train a purely quantized model", "set use_peft: true "
                            "(QLoRA; fp8dist: adapter.base_dtype nf4), or remove load_in_4bit", unless=disabled,
                            otherwise="off"),
    "load_in_8bit": refused("an 8-bit bitsandbytes base (LLM.int8; fp8dist's adapter.base_dtype int8), which fp8dist "
                            "does not build", "remove it (LoRA over the 16-bit base), or use load_in_4bit: true with "
                            "use_peft (fp8dist's NF4 base)", unless=disabled, otherwise="off"),
    "use_dora": kept("adapter.use_dora (DoRA: a trained magnitude vector beside each adapter; false: plain LoRA, "
                     "noted)"),
    "use_rslora": refused("rank-stabilised LoRA: scales the update by alpha / sqrt(r), not alpha / r",
                          "remove it (or scale lora_alpha by sqrt(r) yourself)", unless=disabled, otherwise="off"),
    "lora_modules_to_save": kept("adapter.modules_to_save (modules trained whole beside the adapters: PEFT "
                                 "modules_to_save, e.g. embed_tokens and lm_head for new tokens)", example=["lm_head"]),
    "lora_target_parameters": refused("adapters on parameters (PEFT target_parameters, e.g. MoE experts), which "
                                      "fp8dist's `adapter` does not run", "remove it", unless=disabled,
                                      otherwise="none", example=["experts.down_proj"]),
    "lora_task_type": refused("a task other than causal LM: PEFT then trains the task head too (SEQ_CLS: the score "
                              "layer, as modules_to_save)", "use CAUSAL_LM (TRL's default)",
                              unless=lambda value: value in (None, "CAUSAL_LM"), otherwise="CAUSAL_LM",
                              example="SEQ_CLS"),
    "model_init_kwargs": refused("keyword arguments of from_pretrained that the trainer applies when it loads the "
                                 "model itself: a dtype or a quantization there decides the load", "write the dtype "
                                 "as `dtype:` and remove model_init_kwargs", unless=disabled, otherwise="none",
                                 example={"dtype": "bfloat16"}),
    "auto_find_batch_size": refused("halves the batch on an out-of-memory error (accelerate "
                                    "find_executable_batch_size): the global batch depends on the run",
                                    "set it to false and write per_device_train_batch_size", unless=disabled,
                                    otherwise="off"),
    "per_gpu_train_batch_size": refused("the deprecated name transformers 4 preferred over "
                                        "per_device_train_batch_size", "write per_device_train_batch_size",
                                        unless=disabled, otherwise="none", example=4),
    "optim_args": refused("extra optimizer arguments (momentum, ...) that fp8dist's optimizer does not take",
                          "remove it", unless=disabled, otherwise="none", example="momentum=0.9"),
    "optim_target_modules": refused("GaLore / APOLLO projections on some modules: another optimizer",
                                    "remove it", unless=disabled, otherwise="none", example=["attn"]),
    "adafactor": refused("trains with Adafactor (transformers 4's switch for optim: adafactor)", "remove it",
                         unless=disabled, otherwise="off"),
    "half_precision_backend": refused("apex AMP (O1/O2 casts) instead of torch autocast", "use auto",
                                      unless=lambda value: value in (None, "auto", "cuda_amp", "cpu_amp"),
                                      otherwise="torch autocast", example="apex"),
    # TrainingArguments.parallelism_config is an accelerate ParallelismConfig object (transformers 5.24
    # training_args.py): TrlParser hands a recipe's mapping to it as it is (scripts/utils.py set_defaults_with_config;
    # HfArgumentParser leaves a mapping a dict), and the Trainer passes it to Accelerator, which calls its methods
    # (accelerate 1.15 accelerator.py: parallelism_config.get_device_mesh).
    "parallelism_config": refused("a mapping where the Trainer needs an accelerate ParallelismConfig object: "
                                  "nothing converts a recipe's mapping, and Accelerator() stops on it (AttributeError: "
                                  "'dict' object has no attribute 'get_device_mesh')",
                                  "move the sizes into the accelerate config file you launch with (parallelism_config: "
                                  "parallelism_config_tp_size, _cp_size, ...) and import that file",
                                  unless=disabled, otherwise="none", example={"tp_size": 2}),
    "accelerator_config": refused("split_batches divides the batch over the processes: the global batch no longer "
                                  "grows with the world size", "set split_batches: false",
                                  unless=lambda value: isinstance(value, Mapping) and
                                  not truthy(value.get("split_batches")),
                                  otherwise="without split_batches: data loading only",
                                  example={"split_batches": True}),
    "split_batches": refused("divides the batch over the processes: the global batch no longer grows with the "
                             "world size", "remove it", unless=disabled, otherwise="off"),
    "tensor_parallel_size": no_effect(_VLLM, example=2),
    "vllm_tensor_parallel_size": no_effect(_VLLM, example=2),
    # no effect on the numerics, the layout, the trained parameters or the global batch
    "model_name_or_path": no_effect("which model: fp8dist's config describes how it is trained, the script loads "
                                    "it", example="x/y"),
    "model_revision": no_effect(_DATA, example="main"),
    "attn_implementation": no_effect(_KERNEL, example="flash_attention_2"),
    "trust_remote_code": no_effect(_DATA),
    "bnb_4bit_quant_type": no_effect(_WITH_4BIT, example="nf4"),
    "use_bnb_nested_quant": no_effect(_WITH_4BIT),
    "bnb_4bit_quant_storage": no_effect(_WITH_4BIT, example="uint8"),
    "env": no_effect("environment variables exported before the run (TrlParser): launch settings; check that "
                     "none of them sets a precision (ACCELERATE_MIXED_PRECISION)",
                     example={"CUDA_VISIBLE_DEVICES": "0"}),
    **{key: no_effect(_DATA, example="x") for key in (
        "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_streaming",
        "dataset_mixture", "dataset_mixer", "dataset_splits", "dataset_configs", "dataset_num_proc",
        "dataset_kwargs", "dataset_text_field", "dataset_batch_size", "preprocessing_num_workers",
        "chat_template", "chat_template_path", "eos_token", "pad_token", "truncation_side", "truncation_mode",
        "auto_insert_empty_system_msg", "packing", "packing_strategy", "padding_free", "pad_to_multiple_of",
        "eval_packing", "shuffle_dataset", "completion_only_loss", "assistant_only_loss", "loss_type",
        "loss_weights", "beta", "label_smoothing", "label_smoothing_factor", "max_prompt_length",
        "max_completion_length", "max_target_length", "rpo_alpha", "ld_alpha", "f_divergence_type",
        "f_alpha_divergence_coef", "use_weighting", "discopop_tau", "reference_free", "sync_ref_model",
        "ref_model_mixup_alpha", "ref_model_sync_steps", "precompute_ref_log_probs", "precompute_ref_batch_size",
        "ref_model_init_kwargs", "ref_adapter_name", "model_adapter_name", "force_use_ref_model",
        "disable_dropout", "router_aux_loss_coef", "padding_value", "label_pad_token_id", "is_encoder_decoder",
        "generate_during_eval", "use_logits_to_keep", "tools", "neftune_noise_alpha", "average_tokens_across_devices",
        "remove_unused_columns", "label_names", "group_by_length", "length_column_name", "train_sampling_strategy",
        "ignore_bias_buffers", "num_of_sequences", "chars_per_token", "tokenizer_name_or_path", "data_seed",
        "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
        "dataloader_prefetch_factor", "dataloader_in_order", "dispatch_batches", "use_cache",
        "full_determinism")},
    **{key: no_effect(_LOGGING, example="x") for key in (
        "output_dir", "overwrite_output_dir", "logging_dir", "logging_strategy", "logging_steps", "logging_first_step",
        "logging_nan_inf_filter", "log_level", "log_level_replica", "log_on_each_node", "report_to", "run_name",
        "project", "trackio_space_id", "disable_tqdm", "include_num_input_tokens_seen", "include_tokens_per_second",
        "eval_strategy", "evaluation_strategy", "eval_steps", "eval_delay", "eval_on_start", "do_train", "do_eval",
        "do_predict", "per_device_eval_batch_size", "eval_accumulation_steps", "prediction_loss_only",
        "eval_do_concat_batches", "eval_use_gather_object", "include_for_metrics", "batch_eval_metrics",
        "bf16_full_eval", "fp16_full_eval", "metric_for_best_model", "greater_is_better", "load_best_model_at_end",
        "save_strategy", "save_steps", "save_total_limit", "save_only_model", "save_on_each_node",
        "save_safetensors", "enable_jit_checkpoint", "restore_callback_states_from_checkpoint",
        "resume_from_checkpoint", "ignore_data_skip", "push_to_hub", "hub_model_id", "hub_strategy", "hub_token",
        "hub_private_repo", "hub_always_push", "hub_revision", "hub_model_revision", "skip_memory_metrics",
        "torch_empty_cache_steps")},
    **{key: no_effect(_KERNEL) for key in ("use_liger_kernel", "use_liger", "liger_kernel_config")},
    **{key: no_effect(_SCHEDULE, example="cosine") for key in (
        "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio", "warmup_steps")},
    **{key: no_effect(_LAUNCH, example="x") for key in (
        "local_rank", "ddp_backend", "ddp_timeout", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers", "ddp_static_graph", "use_cpu", "no_cuda", "debug", "tpu_num_cores")},
    "num_train_epochs": no_effect("how long to train; fp8dist's runs take train.steps", example=3),
    "gradient_checkpointing_kwargs": no_effect("fp8dist checkpoints with torch's non-reentrant checkpoint_wrapper "
                                               "(the same recomputation)", example={"use_reentrant": False}),
    "activation_checkpointing_kwargs": no_effect("which layers are recomputed and where saved activations live: "
                                                 "memory, not numerics or layout", example={"every_n_layers": 2}),
    "activation_offloading": no_effect("moves saved activations to the host: memory, not numerics or layout"),
    "torch_compile_backend": no_effect("fp8dist compiles with torch.compile's defaults (inductor); setting it turns "
                                       "compiling on (kept as compile: true)", example="inductor"),
    "torch_compile_mode": no_effect("fp8dist compiles with torch.compile's defaults; setting it turns compiling on "
                                    "(kept as compile: true)", example="max-autotune"),
    "fp16_opt_level": no_effect("read only with apex (half_precision_backend: apex)", example="O1"),
}, unknown_why="check that it changes neither the precision, nor the parallel layout, nor which parameters train, "
               "nor the global batch")


def convert(document: dict[str, Any], text: str, source: str) -> Imported:
    notes = Notes()
    issues: list[Issue] = []
    cfg = dict(document)
    load_dtype = _load_dtype(cfg, notes, issues)
    bf16, fp16 = _half_precision(cfg, notes, issues)
    peft = bool(truthy(cfg.get("use_peft", False)))
    nf4 = peft and bool(truthy(cfg.get("load_in_4bit", False)))
    mixed = "bf16" if bf16 else "fp16" if fp16 else "no"
    compute = mixed if mixed != "no" else load_dtype
    _tf32(cfg, compute, notes, issues)
    if mixed == "fp16" and load_dtype == "fp16" and not peft:
        issues.append(Issue("fp16", "fp16 mixed precision over a model loaded in float16: torch's GradScaler refuses "
                            "to unscale fp16 gradients (\"Attempting to unscale FP16 gradients\"), so the Trainer "
                            "stops at the first step", True, "load in float32 (dtype: float32) with fp16: true, or "
                            "use bf16"))
    deepspeed = cfg.pop("deepspeed", None)
    fsdp, fsdp_config = cfg.pop("fsdp", None), cfg.pop("fsdp_config", None)
    _batch_defaults(cfg, notes)
    fsdp_on = not disabled(fsdp)
    if deepspeed and fsdp_on:
        issues.append(Issue("deepspeed", "set together with fsdp; the Trainer runs one of them", deepspeed,
                            "remove deepspeed or fsdp"))
    if fsdp_config is not None and not fsdp_on:
        notes.dropped("fsdp_config", fsdp_config, "read only with fsdp (transformers _process_fsdp_args)")
    if deepspeed:
        out = _deepspeed(cfg, deepspeed, mixed, source, notes, issues, peft)
    else:
        out = {"engine": "fsdp2"}
        if fsdp_on:
            parallel, fsdp2 = _fsdp(fsdp, fsdp_config, source, notes, issues)
            precision = {"mixed_precision": compute, "master_weights": "fp32" if mixed != "no" else "none",
                         "reduce_dtype": compute if mixed != "no" else load_dtype}
            if mixed != "no":
                notes.resolved("bf16/fp16", f"{compute} compute, fp32 masters, {compute} reduction",
                               "Accelerate's FSDP under the Trainer: one policy dtype, weights upcast to fp32")
        else:
            parallel, fsdp2 = {"sharding": "replicate"}, {}
            precision = {"mixed_precision": mixed if mixed != "no" else "none", "master_weights": "none",
                         "reduce_dtype": load_dtype}
            stepped = ("the optimizer steps the weights as loaded, in fp32" if load_dtype == "fp32" else
                       f"the optimizer steps the weights as loaded: {load_dtype} weights, no fp32 master copy, "
                       f"AdamW states in {load_dtype}")
            notes.resolved("(no fsdp or deepspeed)", "parallel.sharding=replicate", "the Trainer runs DDP (one "
                           "process: the same), which fp8dist runs as FSDP2 with nothing sharded; "
                           + ("PEFT's adapters are trained" if peft else stepped) + ". A launch with "
                           "`accelerate launch --config_file` (the alignment-handbook's zero3.yaml, fsdp.yaml) "
                           "decides another layout: import that file for it")
            if nf4:
                _bf16_adapters(precision, load_dtype, notes, issues)
            elif peft and mixed != "no":
                # PEFT creates the adapters in fp32 over a 16-bit base (peft get_peft_model autocast_adapter_dtype=
                # True, which TRL keeps outside ZeRO-3) and the Trainer autocasts the forward
                precision.update(master_weights="fp32", reduce_dtype="fp32")
                notes.resolved("use_peft", "precision.master_weights=fp32, reduce_dtype=fp32", "PEFT keeps the LoRA "
                               f"adapters in fp32 (the frozen base stays {load_dtype}) and DDP reduces their "
                               "gradients in fp32")
            elif peft and load_dtype != "fp32":
                issues.append(Issue("bf16", f"LoRA over a {load_dtype} base without mixed precision: PEFT keeps the "
                                    "adapters in fp32 and computes them in fp32 with no autocast, which fp8dist "
                                    "(master copies only with mixed precision) does not run", False,
                                    "set bf16: true (the adapters then train as fp32 masters under bf16 compute)"))
        out["precision"] = {"load_dtype": load_dtype, **precision}
        if mixed == "fp16":
            notes.resolved("fp16", "fp8dist's dynamic loss scaler", "the Trainer scales fp16 losses with torch's "
                           "GradScaler (Accelerate)")
        if parallel:
            out["parallel"] = parallel
        if fsdp2:
            out["fsdp2"] = fsdp2
    _compile(cfg, out, notes)
    _checkpointing(cfg, out, notes)
    _train_and_optimizer(cfg, out, notes, issues, bool(deepspeed))
    _adapter(cfg, out, notes, issues, peft)
    if nf4:
        _nf4_base(cfg, out, load_dtype, notes, issues)
    for key, value in cfg.items():
        KEYS.settle(key, value, notes, issues)
    if issues:
        raise ImportProblem(issues, source, "trl", out)
    note_accelerate_refusals(out, notes, "this TRL config")
    return Imported("trl", out, notes)


# -- precision -----------------------------------------------------------------------------------------------
def _load_dtype(cfg: dict[str, Any], notes: Notes, issues: list[Issue]) -> str:
    """ModelConfig `dtype` (or the older `torch_dtype`, which the handbook's get_model reads) -> fp8dist's name."""
    written = {key: cfg.pop(key) for key in ("dtype", "torch_dtype") if key in cfg}
    values = {key: value for key, value in written.items() if value is not None}
    if len(values) == 2 and dtype_name(values["dtype"]) != dtype_name(values["torch_dtype"]):
        notes.dropped("torch_dtype", values.pop("torch_dtype"), "TRL reads dtype when both are set (ModelConfig "
                      "took torch_dtype only without dtype)")
    key, value = next(iter(values.items()), (next(iter(written), "dtype"), None))
    if value is None:
        notes.resolved("precision.load_dtype", "fp32", f"{key} " + ("null" if key in written else "left out") +
                       ": TRL's ModelConfig default float32 (trl/trainer/model_config.py since 0.27), and what "
                       "transformers 4 loads for None (the handbook's get_model); transformers 5 would load None "
                       "as the checkpoint's dtype: write the dtype to be sure")
        return "fp32"
    if value == "auto":
        issues.append(Issue(key, "`auto` loads the checkpoint's own dtype (its config.json), which the file does not "
                            "say and which decides the weights', gradients' and optimizer states' dtypes", value,
                            "write the dtype the model is stored in (bfloat16 for most recent checkpoints), or "
                            "float32"))
        return "fp32"
    name = dtype_name(value)
    if name not in ("fp32", "bf16", "fp16"):
        issues.append(Issue(key, "not a dtype TRL loads models in (auto, bfloat16, float16, float32)", value,
                            "write bfloat16, float16 or float32"))
        return "fp32"
    return name


def _half_precision(cfg: dict[str, Any], notes: Notes, issues: list[Issue]) -> tuple[bool, bool]:
    """(bf16, fp16) as TRL's configs resolve them: bf16 left out (or null) is `not fp16` (trl base_config.py)."""
    fp16 = bool(truthy(cfg.pop("fp16", False)))
    raw = cfg.pop("bf16", None)
    if raw is None:
        bf16 = not fp16
        notes.resolved("bf16", bf16, "left out: TRL's default, on unless fp16 (trl/trainer/base_config.py)")
    else:
        value = truthy(raw)
        if value is None:
            raise WrongShape("bf16", raw, "true or false")
        bf16 = value
    if bf16 and fp16:
        issues.append(Issue("fp16", "set together with bf16; TrainingArguments refuses that (\"At most one of fp16 "
                            "and bf16 can be True\")", True, "remove one of them"))
    return bf16, fp16


def _tf32(cfg: dict[str, Any], compute: str, notes: Notes, issues: list[Issue]) -> None:
    """`compute`: the dtype the GEMMs run in (the mixed precision, else the weights')."""
    if cfg.get("tf32") is None:
        cfg.pop("tf32", None)
        return
    value = cfg.pop("tf32")
    if compute != "fp32":
        notes.dropped("tf32", value, f"every GEMM runs in the {compute} compute dtype, so TF32 (which acts on fp32 "
                                     "matmuls) changes nothing")
    elif truthy(value):
        issues.append(Issue("tf32", _TF32, value, KEYS.rules["tf32"].fix))
    else:
        notes.dropped("tf32", value, "off: fp32 matmuls stay fp32, as in fp8dist")


# -- layout --------------------------------------------------------------------------------------------------
_FSDP_STRATEGIES = {"full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard"}


def _fsdp(fsdp: Any, config: Any, source: str, notes: Notes, issues: list[Issue]):
    """TrainingArguments `fsdp` (true, or the option string / list) + `fsdp_config` (a dict or a JSON path) ->
    (parallel, fsdp2), read as transformers 5.24 _process_fsdp_args / _apply_legacy_fsdp_to_config does."""
    if isinstance(config, str):
        try:
            config, where = read_beside(config, Path(source).parent, "fsdp_config", source)
            notes.resolved("fsdp_config", where, "read from that JSON")
        except ImportProblem as exc:  # reported with the file's other problems
            issues.extend(exc.issues)
            config = {}
    settings = {(key[5:] if key.startswith("fsdp_") else key): value
                for key, value in mapping(config, "fsdp_config").items()}
    version = settings.pop("version", None)
    if version is None:
        version = 2
        notes.resolved("fsdp_config.version", 2, "left out: transformers 5's default FSDP2 (training_args.py "
                       "_process_fsdp_args; transformers 4 defaulted to FSDP1, read here for its FSDP2 meaning)")
    else:
        version = integer(version, "fsdp_config.version")
    options = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, list) else []
    for option in options:
        name = str(option).lower()
        if name in _FSDP_STRATEGIES:
            settings.setdefault("sharding_strategy", name.upper())
        elif name == "offload":
            settings.setdefault("cpu_offload", True)
        elif name != "auto_wrap":
            issues.append(Issue("fsdp", "not an FSDP option transformers knows (full_shard, shard_grad_op, "
                                "hybrid_shard, hybrid_shard_zero2, no_shard, offload, auto_wrap)", option,
                                "remove it"))
    if "cpu_offload" in settings:
        settings["offload_params"] = settings.pop("cpu_offload")
    for key in [key for key in settings if key.startswith("xla")]:
        notes.dropped(f"fsdp_config.{key}", settings.pop(key), "TPU (XLA) only")
    # transformers' default policy: TRANSFORMER_BASED_WRAP on the model's _no_split_modules (fp8dist's blocks)
    settings.setdefault("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    return fsdp_settings(settings, version, notes, issues, "fsdp_config.")


def _deepspeed(cfg: dict[str, Any], deepspeed: Any, mixed: str, source: str, notes: Notes, issues: list[Issue],
               peft: bool) -> dict[str, Any]:
    if isinstance(deepspeed, Mapping):
        ds, where = dict(deepspeed), "inline"
    elif isinstance(deepspeed, str):
        try:
            ds, where = read_beside(deepspeed, Path(source).parent, "deepspeed", source)
        except ImportProblem as exc:  # reported with the file's other problems
            issues.extend(exc.issues)
            return {"engine": "deepspeed"}
    else:
        raise WrongShape("deepspeed", deepspeed, "the path of a DeepSpeed JSON, or its dict")
    ctx = AutoContext(who="HF Trainer (TRL)", mixed_precision=mixed,
                      micro_batch_size=cfg.get("per_device_train_batch_size"),
                      gradient_accumulation_steps=cfg.get("gradient_accumulation_steps"),
                      gradient_clipping=yaml11_number(cfg.get("max_grad_norm")),
                      lr=yaml11_number(cfg.get("learning_rate")),
                      weight_decay=yaml11_number(cfg.get("weight_decay", 0.0)),
                      eps=yaml11_number(cfg.get("adam_epsilon", 1e-8)),
                      betas=[yaml11_number(cfg.get("adam_beta1", 0.9)), yaml11_number(cfg.get("adam_beta2", 0.999))])
    try:
        out = convert_config(ds, source, notes, ctx, f"deepspeed ({where}): ")
    except ImportProblem as exc:  # reported with the file's other problems
        issues.extend(exc.issues)
        return {"engine": "deepspeed"}
    if (ds.get("zero_optimization") or {}).get("stage") == 3:
        if peft:
            notes.resolved("parallel.cpu_ram_efficient_loading", False, "under ZeRO-3 the HF Trainer builds the model "
                           "inside deepspeed.zero.Init; fp8dist adds LoRA adapters to a fully loaded model, then "
                           "partitions it (the result is the same partitioned base)")
        else:
            out.setdefault("parallel", {})["cpu_ram_efficient_loading"] = True
            notes.resolved("parallel.cpu_ram_efficient_loading", True, "under ZeRO-3 the HF Trainer builds the model "
                           "inside deepspeed.zero.Init (transformers integrations/deepspeed.py "
                           "is_deepspeed_zero3_enabled)")
    return out


def _compile(cfg: dict[str, Any], out: dict[str, Any], notes: Notes) -> None:
    value = cfg.pop("torch_compile", None)
    backend = [key for key in ("torch_compile_backend", "torch_compile_mode") if cfg.get(key) is not None]
    if truthy(value) or backend:
        out["compile"] = True
        if backend and not truthy(value):
            notes.resolved("torch_compile", True, f"{backend[0]} is set, which turns compiling on (transformers "
                           "training_args.py)")


def _checkpointing(cfg: dict[str, Any], out: dict[str, Any], notes: Notes) -> None:
    written = [key for key in ("activation_checkpointing", "gradient_checkpointing") if cfg.get(key) is not None]
    values = [truthy(cfg.pop(key)) for key in written]
    for key in ("activation_checkpointing", "gradient_checkpointing"):
        cfg.pop(key, None)
    if not written:
        notes.resolved("gradient_checkpointing", True, "left out: TRL's default (trl/trainer/base_config.py)")
        on = True
    else:
        on = any(values)
    if on:
        out.setdefault("parallel", {}).setdefault("activation_checkpointing", "full")


# -- batch, optimizer, adapter -------------------------------------------------------------------------------
def _batch_defaults(cfg: dict[str, Any], notes: Notes) -> None:
    """TrainingArguments' values for left-out batch keys: the global batch is micro x accumulation x ranks."""
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_grad_norm", "seed"):
        if cfg.get(key) is None:
            cfg[key] = DEFAULTS[key]
            notes.resolved(key, cfg[key], "left out: TrainingArguments' default")


def _train_and_optimizer(cfg: dict[str, Any], out: dict[str, Any], notes: Notes, issues: list[Issue],
                         deepspeed: bool) -> None:
    train = out.setdefault("train", {})
    for key, target in _TRAIN.items():
        value = yaml11_number(cfg.pop(key))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WrongShape(key, value, "a number")
        train.setdefault(target, int(value) if target != "gradient_clipping" and float(value).is_integer() else value)
    if cfg.get("max_steps") is not None:
        steps = integer(cfg.pop("max_steps"), "max_steps")
        if steps > 0:
            train.setdefault("steps", steps)
        else:
            notes.dropped("max_steps", steps, "-1: num_train_epochs decides how long; fp8dist's runs take train.steps")
    _seq_len(cfg, train, notes)
    optimizer = out.setdefault("optimizer", {})
    for key, target in _OPTIM.items():
        if cfg.get(key) is not None:
            optimizer.setdefault(target, yaml11_number(cfg.pop(key)))
    if "lr" not in optimizer:
        notes.resolved("learning_rate", "fp8dist's optimizer.lr default", "left out: the trainer's own default "
                       "applies in TRL (SFTConfig 2e-5, DPOConfig 1e-6, TrainingArguments 5e-5), which the file "
                       "does not name: set optimizer.lr")
    if cfg.get("adam_beta1") is not None or cfg.get("adam_beta2") is not None:
        optimizer.setdefault("betas", [yaml11_number(cfg.pop("adam_beta1", None) or 0.9),
                                       yaml11_number(cfg.pop("adam_beta2", None) or 0.999)])
    if (optimizer.get("weight_decay") or 0) > 0:
        notes.resolved("weight_decay", optimizer["weight_decay"], "the HF Trainer decays every weight but biases and "
                       "norm weights (Trainer.get_decay_parameter_names); fp8dist's optimizer decays every parameter")
    name = cfg.pop("optim", None)
    if name is None:
        name = "adamw_torch_fused"
        notes.resolved("optim", name, "left out: TrainingArguments' default (transformers 5; adamw_torch in 4.x): "
                       "torch AdamW")
    hf_optimizer("optim", name, deepspeed, optimizer, notes, issues, stepped=stepped_dtype(out))
    if not optimizer:
        out.pop("optimizer")


def _seq_len(cfg: dict[str, Any], train: dict[str, Any], notes: Notes) -> None:
    """max_length (SFTConfig / DPOConfig, default 1024), or SFTConfig's max_seq_length before TRL 0.20."""
    written = [key for key in ("max_length", "max_seq_length") if key in cfg]
    if not written:
        train["seq_len"] = DEFAULTS["max_length"]
        notes.resolved("max_length", DEFAULTS["max_length"], "left out: TRL's SFTConfig / DPOConfig default")
        return
    key = written[0]
    value = cfg.pop(key)
    for other in written[1:]:
        notes.dropped(other, cfg.pop(other), f"TRL reads {key}")
    if value is None:
        notes.dropped(key, None, "null: sequences are not truncated; fp8dist's synthetic batches take train.seq_len")
        return
    train["seq_len"] = integer(value, key)


def _nf4_base(cfg: dict[str, Any], out: dict[str, Any], load_dtype: str, notes: Notes, issues: list[Issue]) -> None:
    """load_in_4bit with use_peft and ModelConfig's bnb_* keys -> adapter.base_dtype nf4 (get_quantization_config)."""
    cfg.pop("load_in_4bit")
    out["adapter"]["base_dtype"] = "nf4"
    notes.resolved("load_in_4bit", "adapter.base_dtype=nf4", f"TRL's QLoRA: bitsandbytes 4-bit for every Linear but "
                   f"the output layer, computed in {load_dtype} (get_quantization_config); fp8dist quantizes the "
                   "frozen Linears but the output layer and MoE routers with torchao's NF4 at load (FSDP2 only)")
    kind = cfg.pop("bnb_4bit_quant_type", None)
    if kind not in (None, "nf4"):
        issues.append(Issue("bnb_4bit_quant_type", "bitsandbytes' FP4 data type, not NF4: fp8dist's 4-bit base is NF4 "
                            "only", kind, "write nf4 (TRL's default), or remove it"))
    nested = cfg.pop("use_bnb_nested_quant", None)
    if not truthy(nested):
        notes.dropped("use_bnb_nested_quant", False if nested is None else nested,
                      ("left out: TRL's default false; " if nested is None else "") + NF4_SCALES)
    storage = cfg.pop("bnb_4bit_quant_storage", None)
    if storage is not None:
        notes.dropped("bnb_4bit_quant_storage", storage, NF4_STORAGE)


def _bf16_adapters(precision: dict[str, Any], load_dtype: str, notes: Notes, issues: list[Issue]) -> None:
    """Without FSDP or DeepSpeed: over a 4-bit base TRL casts the trainable adapters to bf16 (the QLoRA paper's
    choice; sft_trainer.py / dpo_trainer.py `_is_quantized_model`), which the Trainer steps as they are."""
    if load_dtype != "bf16":
        issues.append(Issue("load_in_4bit", f"over a 4-bit base TRL casts the LoRA adapters to bf16 while the rest of "
                            f"the model loads in {load_dtype}; fp8dist keeps the adapters in the load dtype (or fp32 "
                            "masters)", True, "write dtype: bfloat16 with load_in_4bit"))
        return
    precision.update(master_weights="none", reduce_dtype="bf16")
    notes.resolved("load_in_4bit", "precision.master_weights=none, reduce_dtype=bf16", "over a 4-bit base TRL casts "
                   "the LoRA adapters to bf16 (trl/trainer/sft_trainer.py), which the optimizer steps with no fp32 "
                   "copy and DDP reduces in bf16")


def _adapter(cfg: dict[str, Any], out: dict[str, Any], notes: Notes, issues: list[Issue], peft: bool) -> None:
    """`use_peft: true` and ModelConfig's lora_* keys -> `adapter` (TRL's get_peft_config builds the LoraConfig)."""
    cfg.pop("use_peft", None)
    if not peft:
        for key in _PEFT_KEYS:
            if cfg.get(key) is not None:
                notes.dropped(key, cfg.pop(key), _WITH_PEFT)
        return
    adapter: dict[str, Any] = {"kind": "lora"}
    for key, target in _LORA.items():
        if cfg.get(key) is None:
            cfg.pop(key, None)
            adapter[target] = DEFAULTS[key]
            notes.resolved(key, DEFAULTS[key], "left out: TRL's ModelConfig default")
        else:
            adapter[target] = yaml11_number(cfg.pop(key))
    modules = cfg.pop("lora_target_modules", None)
    # ModelConfig.__post_init__ turns a one-item list into a string, and PEFT matches a string as a regular
    # expression against the full module name (peft tuners_utils check_target_module_exists), except all-linear.
    single = modules[0] if isinstance(modules, list) and len(modules) == 1 else modules
    if modules is None:
        issues.append(Issue("lora_target_modules", "use_peft names no target, and TRL then passes None to PEFT, whose "
                            "choice is its per-architecture default (e.g. q_proj, v_proj for Llama), which fp8dist "
                            "does not guess", None, "write lora_target_modules: all-linear (fp8dist: target_modules "
                            "auto) or list the modules"))
    elif single == PEFT_ALL_LINEAR:
        adapter["target_modules"] = "auto"
    elif isinstance(single, str):
        issues.append(Issue("lora_target_modules", "one name is a regular expression PEFT matches against the full "
                            "module name (TRL's ModelConfig turns a one-item list into that string), which fp8dist's "
                            "list of module names does not express", modules, "list two or more module names, or "
                            "all-linear"))
    elif isinstance(modules, list) and all(isinstance(name, str) and name for name in modules):
        adapter["target_modules"] = list(modules)
    else:
        raise WrongShape("lora_target_modules", modules, "all-linear or a list of module names")
    saved = module_names(cfg.pop("lora_modules_to_save", None), "lora_modules_to_save")
    if saved:  # get_peft_config passes it to LoraConfig(modules_to_save=...) as it is
        adapter["modules_to_save"] = saved
    if pop_switch(cfg, "use_dora", notes, "off"):  # get_peft_config: LoraConfig(use_dora=use_dora)
        adapter["use_dora"] = True
    out["adapter"] = adapter
