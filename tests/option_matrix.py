"""The option matrix: every key and enum value of schemas/fp8dist.schema.json, either run for real on
2 ranks (RUNS, one torchrun launch for all: tests/distributed/test_option_runs.py) or refused with a
clear message (REFUSALS, decided in-process: tests/unit/test_option_matrix.py).

`uncovered()` walks the schema and lists what neither exercises; the unit test fails on any. Regenerate
the table with `python -m tests.option_matrix > docs/options.md` (a test keeps it in step).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from fp8dist.config.load import deep_merge
from fp8dist.config.schema import defaults, schema

# Every run is short: 2 optimizer steps of tiny-llama unless the case says otherwise.
RUN_BASE = {"train": {"steps": 2, "seq_len": 32}}


@dataclass(frozen=True)
class Run:
    id: str
    config: dict
    expect: dict = field(default_factory=dict)  # facts the worker reports, checked by the run test
    inject_inf: dict | None = None  # {"rank": r, "step": s}: a non-finite gradient on one rank
    model: str = "tiny-llama"  # a built-in model (fp8dist.config.models.BUILTIN)


@dataclass(frozen=True)
class Refusal:
    id: str
    config: dict
    says: str  # a fragment of the message
    kind: str = "config"  # config: load_config refuses; environment: fp8dist.runtime.preflight refuses
    unless: str | None = None  # environment refusals: the capability that lifts it (tests skip where present)


DS = {"engine": "deepspeed"}


def LORA_FACTS(adapted: int, frozen: int) -> dict:
    """What an adapter run reports: 2 adapter tensors per adapted Linear, all stepped; the frozen tensors at the
    load dtype (bf16) with no gradient and no optimizer state."""
    return {"trainable_tensors": 2 * adapted, "stepped_tensors": 2 * adapted, "frozen_tensors": frozen,
            "frozen_dtype": "bf16", "frozen_with_gradient": 0, "frozen_with_state": 0}
EMULATE = {"emulate": True}


def merge(*docs: dict) -> dict:
    return functools.reduce(deep_merge, docs, {})


RUNS = [
    # QLoRA: every frozen Linear but lm_head in NF4 (small-llama's split into whole NF4 blocks on 2 ranks). First:
    # a DeepSpeed ZeRO-3 engine built earlier in the same process leaves torch.nn.functional.linear patched
    # (deepspeed/runtime/zero/linear.py zero3_linear_wrap), and NF4Tensor's linear calls F.linear.
    Run("fsdp2-qlora-nf4", {"adapter": {"kind": "lora", "base_dtype": "nf4"}, "precision": {"preset": "bf16"}},
        {**LORA_FACTS(adapted=28, frozen=39), "frozen_dtype": "bf16+nf4"}, model="small-llama"),
    Run("fsdp2-defaults", {}, {"optimizer": "AdamW", "local_dtype": "fp32"}),
    Run("fsdp2-fp32-adam", {"precision": {"preset": "fp32"},
                            "optimizer": {"name": "adam", "lr": 0.002, "weight_decay": 0.01, "betas": [0.8, 0.99],
                                          "eps": 1e-6},
                            "train": {"seed": 3, "micro_batch_size": 1}},
        {"optimizer": "Adam", "local_dtype": "fp32"}),
    Run("fsdp2-bf16-pure-sgd", {"precision": {"preset": "bf16-pure"}, "optimizer": {"name": "sgd"},
                                "train": {"gradient_clipping": 0}},
        {"optimizer": "SGD", "local_dtype": "bf16"}),
    Run("fsdp2-fp16-amp-offload-overflow",
        {"precision": {"preset": "fp16-amp", "reduce_dtype": "fp16",
                       "loss_scaling": {"loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 2,
                                        "hysteresis": 1, "min_loss_scale": 0.5}},
         "parallel": {"offload": "params"}, "fsdp2": {"output_dtype": "fp16"}, "train": {"steps": 4}},
        {"local_dtype": "fp32", "skipped_steps": [2], "loss_scales": [1024, 512, 512, 1024]},
        inject_inf={"rank": 1, "step": 2}),
    Run("fsdp2-fp16-masters-static-scale",
        {"precision": {"load_dtype": "fp16", "mixed_precision": "fp16", "master_weights": "fp16",
                       "loss_scaling": {"loss_scale": 64}},
         "optimizer": {"eps": 1e-4}},
        {"local_dtype": "fp16", "loss_scales": [64, 64]}),
    Run("fsdp2-bf16-masters", {"precision": {"master_weights": "bf16"}, "optimizer": {"state_dtype": "bf16"},
                               "parallel": {"sharding": "grad_op"}, "fsdp2": {"output_dtype": "fp32"}},
        {"local_dtype": "bf16", "state_dtype": "bf16", "logits_dtype": "fp32"}),
    # checkpoint.keep_last and the timeout act in launch/train.py: tests/distributed/test_checkpoints.py runs them
    # (keep_last=1 after a resume, a 20 s timeout around a rank killed during a save)
    Run("fsdp2-inputs-not-cast", {"fsdp2": {"cast_forward_inputs": False, "output_dtype": "fp32"},
                                  "checkpoint": {"keep_last": 1}, "train": {"process_group_timeout_s": 120}},
        {"local_dtype": "fp32", "logits_dtype": "fp32"}),
    Run("fsdp2-torchao-tensorwise",
        {"precision": {"preset": "torchao-float8",
                       "fp8": {"torchao": {**EMULATE, "enable_fsdp_float8_all_gather": True,
                                           "force_recompute_fp8_weight_in_bwd": True,
                                           "precompute_float8_dynamic_scale_for_fsdp": False},
                               "modules": {"exclude": ["lm_head", "model.layers.0.mlp.*"], "skip_first_last": True}}},
         "fsdp2": {"wrap": ["LlamaDecoderLayer"], "output_dtype": "bf16"},
         "parallel": {"sharding": "full", "activation_checkpointing": "full"},
         "train": {"gradient_accumulation_steps": 2}},
        {"float8_linears": 10, "reduce_scatters_per_step": 3, "checkpointed_blocks": 2}),
    Run("fsdp2-hybrid-selective-ac", {"parallel": {"sharding": "HYBRID_SHARD", "shard_size": 2,
                                                   "activation_checkpointing": "selective"}},
        {"mesh": [1, 2], "checkpointed_blocks": 2}),
    Run("fsdp2-replicate", {"parallel": {"sharding": "replicate"}}, {"mesh": [2, 1], "local_dtype": "fp32"}),
    Run("fsdp2-float8-efficient-loading",
        {"precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE}},
         "parallel": {"cpu_ram_efficient_loading": True, "activation_checkpointing": "full"}},
        {"float8_linears": 14, "local_dtype": "fp32", "float8_all_gather_weights": 14, "loaded_from_files": True}),
    Run("fsdp2-torchao-rowwise",
        {"precision": {"preset": "torchao-float8-rowwise",
                       "fp8": {"torchao": {**EMULATE, "enable_fsdp_float8_all_gather": False,
                                           "force_recompute_fp8_weight_in_bwd": False, "pad_inner_dim": True}}},
         "hardware": {"gpu": "h100"}},  # min_speedup auto: no rule when emulating; the audit's speed row is H100's
        {"float8_linears": 14}),
    # The speed-aware module filter on a GPU named in the config (emulated, so min_speedup is written): at 64 tokens
    # per micro-batch, eager, on an L40S, tiny-llama's q/k/v/o are predicted below MIN_SPEEDUP_RUN and stay in bf16,
    # gate/up/down above it (tests/unit/backends/test_speed_filter.py checks the split is real)
    Run("fsdp2-torchao-min-speedup",
        {"precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE, "min_speedup": 0.0125}},
         "hardware": {"gpu": "l40s"}},
        {"float8_linears": 6}),
    Run("fsdp2-torchao-min-speedup-off",  # the same GPU with the rule off: every Linear but lm_head in float8
        {"precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE, "min_speedup": "off"}},
         "hardware": {"gpu": "l40s"}},
        {"float8_linears": 14}),
    # The per-Linear policy: block 0 kept (keep_first_layers), block 1's attention tensorwise, its MLP rowwise
    # (an override); on DeepSpeed the last block kept and precision.schedule switching every GEMM at step 2 of 2
    Run("fsdp2-torchao-policy",
        {"precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE, "keep_first_layers": 1,
                                                           "overrides": [{"modules": ["*.mlp.*"],
                                                                          "recipe": "rowwise"}]}}},
        {"float8_linears": 7}),
    # policy auto: the calibration pass on the first step's batches, every Linear of the healthy tiny-llama passes
    # tensorwise numerics on both ranks (tests/distributed/test_policy_auto.py runs the outlier model)
    Run("fsdp2-torchao-policy-auto",
        {"precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE, "policy": "auto",
                                                           "calibration_steps": 1}}},
        {"float8_linears": 14}),
    Run("ds-zero2-torchao-keep-last-schedule-all",
        {**DS, "precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE, "keep_last_layers": 1},
                             "schedule": {"from_fraction": 0.5, "gemms": "all"}}},
        {"float8_linears": 7}),
    # MoE: experts in MXFP8 (emulated) on both engines pass the first-step audit, which counts the experts'
    # grouped GEMMs; with experts=none the audit fails on the gemm row, naming the experts
    Run("fsdp2-moe-mxfp8-experts",
        {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {**EMULATE, "experts": "mxfp8"}}},
         "hardware": {"gpu": "b200"}},  # the audit's speed row on a GPU that has MXFP8
        {"experts": "fp8dist_mxfp8_emulated"}, model="tiny-mixtral"),
    # Expert parallel on 2 ranks (efsdp 1 x ep 2): 4 of tiny-mixtral's 8 experts per rank, tokens dispatched by
    # all-to-all. The EP=1 comparisons on 2 and 4 ranks are tests/distributed/test_expert_parallel.py.
    Run("fsdp2-expert-parallel-mxfp8",
        {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {**EMULATE, "experts": "mxfp8"}}},
         "parallel": {"expert_size": 2}},
        {"experts": "fp8dist_mxfp8_emulated", "expert_parallel": 2}, model="tiny-mixtral"),
    Run("ds-zero3-moe-auto-experts",
        {**DS, "deepspeed": {"zero_stage": 3}, "precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE}}},
        {"experts": "fp8dist_mxfp8_emulated", "zero_stage": 3}, model="tiny-mixtral"),
    Run("ds-zero2-moe-mxfp8-experts",
        {**DS, "precision": {"preset": "torchao-float8", "fp8": {"torchao": {**EMULATE, "experts": "mxfp8"}}}},
        {"experts": "fp8dist_mxfp8_emulated", "zero_stage": 2}, model="tiny-mixtral"),
    Run("fsdp2-moe-experts-none",
        {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {**EMULATE, "experts": "none"}}}},
        {"experts": "grouped_mm", "audit_passed": False, "audit_failing": ["gemm"]}, model="tiny-mixtral"),
    Run("ds-zero2-torchao-mxfp8-linears",
        {**DS, "precision": {"preset": "torchao-float8", "fp8": {"torchao": {**EMULATE, "recipe_name": "mxfp8"}}}},
        {"mx_linears": 14, "zero_stage": 2}),
    Run("fsdp2-torchao-mxfp8-linears",
        {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {**EMULATE, "recipe_name": "mxfp8"}}}},
        {"mx_linears": 14, "float8_all_gather_weights": 0}),
    Run("fsdp2-torchao-gw-hp-int8-states",
        {"precision": {"fp8": {"backend": "torchao", "torchao": {**EMULATE, "recipe_name": "rowwise_with_gw_hp"}}},
         "optimizer": {"state_dtype": "int8"}},
        {"float8_linears": 14, "optimizer": "AdamW8bit"}),
    Run("fsdp2-compile-accumulate", {"compile": True, "train": {"gradient_accumulation_steps": 2},
                                     "audit": {"first_step": "off"}},
        {"compiled": True, "reduce_scatters_per_step": 3, "audit_passed": None}),
    Run("ds-zero0-fp32", {**DS, "precision": {"preset": "fp32"}, "parallel": {"sharding": "replicate"},
                          "deepspeed": {"steps_per_print": 1,
                                        "extra": {"wall_clock_breakdown": False}}},
        {"zero_stage": 0, "optimizer": "AdamW"}),
    Run("ds-zero1-compile", {**DS, "compile": True, "precision": {"preset": "bf16"}, "audit": {"first_step": "raise"},
                             "deepspeed": {"zero_stage": 1, "grad_accum_dtype": "fp32"}},
        {"zero_stage": 1, "compiled": True, "audit_passed": True}),
    Run("ds-zero2-bf16-masters-fp32-states-offload",
        {**DS, "precision": {"master_weights": "bf16"}, "optimizer": {"state_dtype": "fp32"},
         "parallel": {"offload": "optimizer"}, "deepspeed": {"zero_stage": 2, "grad_accum_dtype": "fp32"}},
        {"zero_stage": 2, "optimizer": "DeepSpeedCPUAdam", "master_dtype": "bf16"}),
    Run("ds-zero1-bf16-masters-bf16-states", {**DS, "precision": {"master_weights": "bf16"},
                                              "optimizer": {"state_dtype": "bf16"}, "deepspeed": {"zero_stage": 1}},
        {"zero_stage": 1, "master_dtype": "bf16"}),
    Run("ds-zero3-offload-params", {**DS, "optimizer": {"name": "adam"},
                                    "parallel": {"sharding": "full", "offload": "params"}},
        {"zero_stage": 3, "optimizer": "DeepSpeedCPUAdam"}),
    Run("ds-hybrid-hpz", {**DS, "parallel": {"sharding": "hybrid", "shard_size": 2}}, {"zero_stage": 3}),
    # Tensor parallel on 2 ranks (dp_shard 1 x tp 2): both ranks read the same batch. The 4-rank FSDP2 x TP runs with
    # every FP8 path are tests/distributed/test_tensor_parallel.py.
    # Pipeline parallel on 2 ranks (one data rank): tiny-llama's 2 layers as 2 stages under 1f1b; small-llama's 4 as 4
    # stages, 2 per rank, interleaved; GPipe with the split given (tests/distributed/test_pipeline_parallel.py checks
    # the losses against one process, the audit on pp x dp_shard, resume and export)
    Run("fsdp2-pipeline-1f1b-float8", {"precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE}},
                                       "parallel": {"pipeline_size": 2, "pipeline_microbatches": 2}},
        {"pipeline": "pipeline parallel: 2 stages, schedule 1f1b, 2 microbatches per micro-batch; this rank runs "
                     "stage 0: layers 0-0", "float8_linears": 7}),  # rank 0 keeps its stage's layer only
    Run("fsdp2-pipeline-interleaved", {"parallel": {"pipeline_size": 2, "pipeline_schedule": "interleaved_1f1b",
                                                    "pipeline_stages_per_rank": 2},
                                       "train": {"micro_batch_size": 4}},
        {"pipeline": "pipeline parallel: 4 stages, schedule interleaved_1f1b, 4 microbatches per micro-batch; this "
                     "rank runs stage 0: layers 0-0, stage 2: layers 2-2"}, model="small-llama"),
    Run("fsdp2-pipeline-gpipe-split", {"parallel": {"pipeline_size": 2, "pipeline_schedule": "gpipe",
                                                    "pipeline_split": [1], "pipeline_microbatches": 1}},
        {"pipeline": "pipeline parallel: 2 stages, schedule gpipe, 1 microbatches per micro-batch; this rank runs "
                     "stage 0: layers 0-0"}),
    Run("fsdp2-tp-sequence-parallel", {"parallel": {"tensor_size": 2, "sequence_parallel": True}},
        {"mesh": [1, 2], "sequence_parallel": True}),
    Run("fsdp2-tp-no-sequence-parallel", {"parallel": {"tensor_size": 2, "sequence_parallel": False}},
        {"mesh": [1, 2], "sequence_parallel": False}),
    Run("ds-zero3-efficient-loading-float8-ac",
        {**DS, "precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE}},
         "parallel": {"sharding": "full", "cpu_ram_efficient_loading": True, "activation_checkpointing": "selective"}},
        {"zero_stage": 3, "float8_linears": 14, "loaded_from_files": True, "checkpointed_blocks": 2}),
    Run("ds-sgd-offload", {**DS, "optimizer": {"name": "sgd"},
                           "deepspeed": {"zero_stage": 1, "offload_optimizer": "cpu"}},
        {"zero_stage": 1, "optimizer": "SGD"}),
    Run("ds-bf16-pure-bf16-accumulation", {**DS, "precision": {"preset": "bf16-pure"},
                                           "parallel": {"sharding": "grad_op"},
                                           "deepspeed": {"grad_accum_dtype": "bf16"}}, {"zero_stage": 2}),
    Run("ds-fp16-amp-autocast", {**DS, "precision": {"preset": "fp16-amp"}}, {"zero_stage": 2}),
    Run("ds-torchao-float8", {**DS, "precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE}}},
        {"float8_linears": 14}),
    # LoRA: the frozen base keeps the load dtype (FSDP2: in torchao's float8 all-gather wrapper), no gradient and
    # no optimizer state; only the adapters are stepped, in the master dtype
    Run("fsdp2-lora-float8",
        {"adapter": {"kind": "lora", "r": 4, "alpha": 16, "dropout": 0.05,
                     "target_modules": ["q_proj", "v_proj", "up_proj"], "base_dtype": "auto"},
         "precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE}}},
        {"float8_linears": 14, "float8_all_gather_weights": 14, **LORA_FACTS(adapted=6, frozen=21)}),
    Run("fsdp2-lora-bf16-qwen2", {"adapter": {"kind": "lora"}, "precision": {"preset": "bf16"}},
        LORA_FACTS(adapted=14, frozen=27), model="tiny-qwen2"),
    Run("ds-zero2-lora-qwen2", {**DS, "adapter": {"kind": "lora"}, "deepspeed": {"zero_stage": 2}},
        {"zero_stage": 2, **LORA_FACTS(adapted=14, frozen=27)}, model="tiny-qwen2"),
    Run("ds-zero3-lora", {**DS, "adapter": {"kind": "lora", "target_modules": ["q_proj", "v_proj"]},
                          "deepspeed": {"zero_stage": 3}},
        {"zero_stage": 3, **LORA_FACTS(adapted=4, frozen=21)}),
    # modules_to_save (a new-token run): the embeddings and lm_head trained whole beside the adapters, each a trained
    # copy stepped in the master dtype (2 more trainable tensors) beside PEFT's frozen original in bf16 (frozen count
    # unchanged: the originals take the place of the base's two weights)
    Run("fsdp2-lora-modules-to-save", {"adapter": {"kind": "lora", "modules_to_save": ["embed_tokens", "lm_head"]},
                                       "precision": {"preset": "bf16"}},
        {**LORA_FACTS(adapted=14, frozen=21), "trainable_tensors": 30, "stepped_tensors": 30}),
    Run("ds-zero3-lora-modules-to-save", {**DS, "adapter": {"kind": "lora", "target_modules": ["q_proj", "v_proj"],
                                                           "modules_to_save": ["lm_head"]},
                                          "deepspeed": {"zero_stage": 3}},
        {"zero_stage": 3, **LORA_FACTS(adapted=4, frozen=21), "trainable_tensors": 9, "stepped_tensors": 9}),
    # DoRA: a magnitude vector per adapted Linear beside lora_A / lora_B (3 trained tensors each, stepped in the
    # master dtype); the frozen base unchanged
    Run("fsdp2-lora-dora", {"adapter": {"kind": "lora", "use_dora": True}, "precision": {"preset": "bf16"}},
        {**LORA_FACTS(adapted=14, frozen=21), "trainable_tensors": 42, "stepped_tensors": 42}),
    # DoRA over a float8 base: the frozen Linears' GEMMs in FP8, DoRA scaling their output (dropout 0: no second
    # GEMM) and reading the bf16 base weight for its norms (the all-gather in bf16: rules/common.py _dora)
    Run("fsdp2-lora-dora-float8",
        {"adapter": {"kind": "lora", "r": 4, "target_modules": ["q_proj", "v_proj", "up_proj"], "use_dora": True},
         "precision": {"preset": "torchao-float8",
                       "fp8": {"torchao": {**EMULATE, "enable_fsdp_float8_all_gather": False}}}},
        {**LORA_FACTS(adapted=6, frozen=21), "trainable_tensors": 18, "stepped_tensors": 18}),
    Run("ds-zero3-lora-dora", {**DS, "adapter": {"kind": "lora", "target_modules": ["q_proj", "v_proj"],
                                                "use_dora": True},
                               "deepspeed": {"zero_stage": 3}},
        {"zero_stage": 3, **LORA_FACTS(adapted=4, frozen=21), "trainable_tensors": 12, "stepped_tensors": 12}),
    # Last: after an AutoTP engine, DeepSpeed 0.19.8 keeps its tensor-parallel groups in module globals
    # (deepspeed/utils/groups.py, released only when the world group is destroyed), and the next engine built in the
    # same process fails in _configure_distributed_model (self.mpu is None). A run builds one engine per process.
    Run("ds-autotp", {**DS, "parallel": {"tensor_size": 2}}, {"zero_stage": 2, "tensor_parallel_linears": 15}),
]

TE = {"precision": {"fp8": {"backend": "te"}}}
TE_MISSING = "Transformer Engine is not installed"
MSAMP_MISSING = "MS-AMP is not installed"


def te(**fields) -> dict:
    return merge(TE, {"precision": {"fp8": {"te": fields}}})


REFUSALS = [
    # Needs a GPU or a library that cannot exist here: refused by preflight, naming what is missing.
    Refusal("preset-te", {"precision": {"preset": "te"}}, TE_MISSING, "environment", "transformer_engine"),
    *[Refusal(f"te-recipe-{recipe}", te(recipe=recipe), TE_MISSING, "environment", "transformer_engine")
      for recipe in ("delayed", "current", "block", "mxfp8", "nvfp4")],
    Refusal("te-delayed-fields", te(recipe="delayed", fp8_format="HYBRID", margin=1, amax_history_len=16,
                                    amax_compute_algo="most_recent", reduce_amax=False,
                                    swap_layernorm=False), TE_MISSING, "environment", "transformer_engine"),
    Refusal("te-delayed-max", te(amax_compute_algo="max", fp8_format="E4M3"), TE_MISSING, "environment", "transformer_engine"),
    Refusal("te-current-fields", te(recipe="current", use_power_2_scales=True), TE_MISSING, "environment", "transformer_engine"),
    Refusal("te-mxfp8-fields", te(recipe="mxfp8", enable_2d_quantization=True), TE_MISSING, "environment", "transformer_engine"),
    Refusal("te-on-deepspeed", {**DS, **te()}, TE_MISSING, "environment", "transformer_engine"),
    *[Refusal(f"preset-msamp-{level.lower()}", {"precision": {"preset": f"msamp-{level.lower()}"}}, MSAMP_MISSING,
              "environment", "msamp") for level in ("O1", "O2", "O3")],
    Refusal("msamp-use-te", {**DS, "precision": {"preset": "msamp-o2", "fp8": {"msamp": {"use_te": True}}}},
            MSAMP_MISSING, "environment", "msamp"),
    Refusal("msamp-bf16", {**DS, "precision": {"preset": "msamp-o1", "mixed_precision": "bf16"}}, MSAMP_MISSING,
            "environment", "msamp"),
    Refusal("torchao-without-fp8-hardware", {"precision": {"preset": "torchao-float8"}}, "refusing FP8",
            "environment", "fp8_gpu"),
    # precision.fp8.min_speedup written as a number needs a GPU to predict for: hardware.gpu, or a device it knows
    Refusal("min-speedup-without-a-gpu", {"precision": {"preset": "torchao-float8", "fp8": {
        "torchao": EMULATE, "min_speedup": 1.0}}}, "no GPU to predict for", "environment", "cuda"),
    Refusal("hardware-gpu-without-the-recipe", {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        **EMULATE, "recipe_name": "mxfp8"}}}, "hardware": {"gpu": "h200"}}, "torchao mxfp8 does not run on h200"),
    Refusal("torchao-float8-experts-emulated", {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        **EMULATE, "experts": "float8"}}}}, "no emulated mode", "environment"),
    Refusal("mxfp8-pad-inner-dim", {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        **EMULATE, "recipe_name": "mxfp8", "pad_inner_dim": True}}}}, "MXFP8Linear has no padding"),
    Refusal("mxfp8-tokens-not-a-block", {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        **EMULATE, "recipe_name": "mxfp8"}}}, "train": {"seq_len": 48, "micro_batch_size": 1}}, "blocks of 32 tokens"),
    Refusal("mxfp8-float8-all-gather", {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        **EMULATE, "recipe_name": "mxfp8", "enable_fsdp_float8_all_gather": True}}}}, "needs tensorwise scaling"),
    Refusal("mxfp8-without-hardware", {"precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        "emulate": False, "recipe_name": "mxfp8"}}}}, "refusing FP8", "environment", "mx_gpu"),
    Refusal("torchao-explicit-no-emulate", {"precision": {"preset": "torchao-float8",
                                                          "fp8": {"torchao": {"emulate": False}}}},
            "refusing FP8", "environment", "fp8_gpu"),
    Refusal("deepspeed-fp16-section", {**DS, "precision": {"load_dtype": "fp32", "mixed_precision": "fp16"}},
            "does not support", "environment", "deepspeed_fp16"),
    Refusal("deepspeed-fp16-masters", {**DS, "precision": {"load_dtype": "fp16", "mixed_precision": "fp16",
                                                           "master_weights": "fp16"},
                                       "deepspeed": {"offload_optimizer": "cpu"}}, "does not support", "environment", "deepspeed_fp16"),
    Refusal("deepspeed-nvme-optimizer", {**DS, "deepspeed": {"offload_optimizer": "nvme", "nvme_path": "/tmp/nvme"}},
            "async_io", "environment", "libaio"),
    Refusal("deepspeed-nvme-params", {**DS, "deepspeed": {"zero_stage": 3, "offload_param": "nvme",
                                                          "nvme_path": "/tmp/nvme"}}, "async_io", "environment", "libaio"),
    Refusal("fsdp2-fp8-states-on-cpu", {"optimizer": {"state_dtype": "fp8"}}, "AdamWFp8", "environment", "cuda"),
    # Cross-field rules (fp8dist/config/rules/): every Issue they can raise.
    Refusal("master-without-mixed", {"precision": {"mixed_precision": "none"}}, "a master copy only exists"),
    Refusal("bf16-master-fp16-compute", {"precision": {"master_weights": "bf16", "mixed_precision": "fp16"}},
            "bf16 master weights need bf16 mixed precision"),
    Refusal("block-without-backend", {"precision": {"fp8": {"torchao": {"emulate": True}}}},
            "these settings do nothing"),
    Refusal("loss-scaling-without-fp16", {"precision": {"loss_scaling": {"hysteresis": 1}}},
            "loss scaling acts only on fp16 compute"),
    Refusal("loss-scaling-under-autocast", {**DS, "precision": {"preset": "fp16-amp", "loss_scaling":
                                                                {"initial_scale_power": 8}}},
            "torch.amp.GradScaler keeps its own defaults"),
    Refusal("float8-all-gather-rowwise", {"precision": {"preset": "torchao-float8-rowwise", "fp8": {
        "torchao": {"enable_fsdp_float8_all_gather": True}}}}, "float8 all-gather needs tensorwise"),
    Refusal("float8-all-gather-deepspeed", {**DS, "precision": {"preset": "torchao-float8", "fp8": {
        "torchao": {"enable_fsdp_float8_all_gather": True}}}}, "float8 all-gather is an FSDP2 feature"),
    Refusal("emulate-with-compile", {"compile": True, "precision": {"preset": "torchao-float8", "fp8": {
        "torchao": {"emulate": True}}}}, "emulated float8 does not work with torch.compile"),
    Refusal("torchao-without-mixed", {"precision": {"preset": "bf16-pure", "fp8": {"backend": "torchao"}}},
            "torchao float8 runs the non-FP8 ops"),
    Refusal("te-interval-removed", te(interval=16), "`interval` was removed"),
    Refusal("te-override-removed", te(override_linear_precision=[False, False, True]),
            "`override_linear_precision` was removed"),
    Refusal("te-field-of-other-recipe", te(recipe="current", margin=2), "not a field of recipe 'current'"),
    Refusal("te-nvfp4-format", te(recipe="nvfp4", fp8_format="HYBRID"), "Only E4M3 is supported for NVFP4 scaling"),
    Refusal("te-fp8-dpa", te(fp8_dpa=True), "read only by Transformer Engine's attention modules"),
    Refusal("te-fp8-mha", te(fp8_mha=False), "read only by Transformer Engine's attention modules"),
    Refusal("te-block-fp8-dpa", te(recipe="block", fp8_dpa=True), "FP8 attention is not supported for Float8BlockScaling"),
    Refusal("te-mxfp8-margin", te(recipe="mxfp8", margin=1), "MXFP8BlockScaling keeps margin but nothing reads it"),
    Refusal("te-tokens-not-multiple-of-8", merge(te(), {"train": {"micro_batch_size": 1, "seq_len": 60}}),
            "need the tokens of a micro-batch"),
    Refusal("msamp-on-fsdp2", {"precision": {"preset": "msamp-o2"}, "engine": "fsdp2"}, "MS-AMP has no FSDP2"),
    Refusal("msamp-o3-zero3", {"precision": {"preset": "msamp-o3"}, "deepspeed": {"zero_stage": 3}},
            "MS-AMP O3 needs ZeRO stage 1 or 2"),
    Refusal("msamp-zero3", {"precision": {"preset": "msamp-o2"}, "deepspeed": {"zero_stage": 3}},
            "MS-AMP does not work with ZeRO-3"),
    Refusal("msamp-sgd", {"precision": {"preset": "msamp-o2"}, "optimizer": {"name": "sgd"}},
            "msamp.initialize accepts Adam/AdamW only"),
    Refusal("msamp-state-dtype", {"precision": {"preset": "msamp-o2"}, "optimizer": {"state_dtype": "fp32"}},
            "MS-AMP decides the optimizer-state dtypes"),
    Refusal("msamp-offload", {"precision": {"preset": "msamp-o2"}, "deepspeed": {"offload_optimizer": "cpu"}},
            "MS-AMP cannot step DeepSpeedCPUAdam"),
    Refusal("msamp-bf16-zero1-fp32-accum", {"precision": {"preset": "msamp-o1", "mixed_precision": "bf16"},
                                            "deepspeed": {"zero_stage": 1, "grad_accum_dtype": "fp32"}},
            "bypasses MS-AMP's FP8 ZeRO optimizer"),
    Refusal("msamp-without-mixed", {"precision": {"preset": "msamp-o2", "mixed_precision": "none",
                                                  "master_weights": "none"}}, "MS-AMP runs on DeepSpeed's fp16"),
    Refusal("ds-accum-dtype-zero0", {**DS, "deepspeed": {"zero_stage": 0, "grad_accum_dtype": "fp32"}},
            "separate accumulation dtype at ZeRO stage 0"),
    Refusal("ds-accum-dtype-ignored", {**DS, "precision": {"preset": "bf16-pure"}, "deepspeed": {"grad_accum_dtype": "fp16"}},
            "ignored by DeepSpeed without a bf16/fp16 section"),
    Refusal("ds-accum-dtype-ignored-by-offload", {**DS, "deepspeed": {"offload_optimizer": "cpu", "grad_accum_dtype": "bf16"}},
            "ignored by ZeRO-Offload"),
    Refusal("ds-autocast-reduce-in-compute-dtype", {**DS, "precision": {"preset": "fp16-amp", "reduce_dtype": "fp16"}},
            "reduces each gradient in its parameter's dtype (fp32) and ignores communication_data_type"),
    Refusal("fsdp2-offload-optimizer", {"parallel": {"offload": "optimizer"}}, "cannot offload the optimizer alone"),
    Refusal("hybrid-without-shard-size", {"parallel": {"sharding": "hybrid"}}, "needs the size of a shard group"),
    Refusal("shard-size-without-hybrid", {"parallel": {"sharding": "full", "shard_size": 2}},
            "only hybrid sharding has shard groups"),
    Refusal("sharding-conflicts-with-zero-stage", {**DS, "parallel": {"sharding": "full"}, "deepspeed": {"zero_stage": 2}},
            "conflicts with parallel.sharding=full"),
    Refusal("offload-conflicts-with-deepspeed-key", {**DS, "parallel": {"sharding": "full", "offload": "params"},
                                                     "deepspeed": {"offload_param": "none"}},
            "conflicts with parallel.offload=params"),
    Refusal("ds-offload-params-zero2", {**DS, "parallel": {"offload": "params"}}, "offloads parameters only under ZeRO-3"),
    Refusal("ds-efficient-loading-zero2", {**DS, "parallel": {"cpu_ram_efficient_loading": True}},
            "built partitioned inside deepspeed.zero.Init"),
    Refusal("msamp-hybrid", {"precision": {"preset": "msamp-o2"}, "parallel": {"sharding": "hybrid", "shard_size": 2}},
            "MS-AMP does not run ZeRO-3"),
    Refusal("ds-param-offload-zero2", {**DS, "deepspeed": {"offload_param": "cpu"}},
            "parameter offload needs ZeRO stage 3"),
    Refusal("ds-optimizer-offload-zero0", {**DS, "deepspeed": {"zero_stage": 0, "offload_optimizer": "cpu"}},
            "optimizer offload needs ZeRO stage >= 1"),
    Refusal("ds-parallel-offload-optimizer-replicate", {**DS, "parallel": {"sharding": "replicate", "offload": "optimizer"}},
            "optimizer offload is ZeRO-Offload, which needs ZeRO stage >= 1"),
    Refusal("ds-nvme-without-path", {**DS, "deepspeed": {"offload_optimizer": "nvme"}}, "nvme offload needs a path"),
    Refusal("ds-bf16-masters-zero0", {**DS, "precision": {"master_weights": "bf16"}, "deepspeed": {"zero_stage": 0}},
            "bf16 master weights need ZeRO stage >= 1"),
    Refusal("ds-fp32-states-need-offload", {**DS, "precision": {"master_weights": "bf16"},
                                            "optimizer": {"state_dtype": "fp32"}},
            "only under ZeRO-Offload"),
    Refusal("ds-low-precision-masters-sgd", {**DS, "precision": {"master_weights": "bf16"},
                                             "optimizer": {"name": "sgd", "state_dtype": "fp32"},
                                             "deepspeed": {"offload_optimizer": "cpu"}},
            "only with DeepSpeedCPUAdam"),
    Refusal("ds-pure-fp16-no-loss-scaling", {**DS, "precision": {"load_dtype": "fp16", "mixed_precision": "none",
                                                                 "master_weights": "none"}},
            "nothing scales the loss"),
    Refusal("ds-bf16-states-fp32-masters", {**DS, "optimizer": {"state_dtype": "bf16"}},
            "bf16_optimizer_states needs bf16 master weights"),
    Refusal("ds-fp8-states", {**DS, "optimizer": {"state_dtype": "fp8"}}, "torchao optimizer for FSDP2"),
    Refusal("fsdp2-low-bit-states-sgd", {"optimizer": {"name": "sgd", "state_dtype": "int8"}},
            "states come from torchao's low-bit AdamW"),
    Refusal("adapter-settings-without-kind", {"adapter": {"r": 16}}, "adapter settings do nothing"),
    Refusal("adapter-base-int8", {"adapter": {"kind": "lora", "base_dtype": "int8"}}, "an 8-bit base"),
    Refusal("adapter-base-nf4-deepspeed", {**DS, "adapter": {"kind": "lora", "base_dtype": "nf4"}},
            "packed codes survive neither"),
    Refusal("adapter-base-nf4-fp8", {"adapter": {"kind": "lora", "base_dtype": "nf4"},
                                     "precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE}}},
            "would convert the same frozen Linears"),
    Refusal("context-parallel-without-cuda", {"parallel": {"context_size": 2}}, "torch's CUDA SDPA kernels",
            "environment", "cuda"),
    Refusal("sequence-parallel-without-tp", {"parallel": {"sequence_parallel": True}},
            "parallel.tensor_size is 1"),
    Refusal("ds-autotp-fp8", {**DS, "precision": {"preset": "torchao-float8"}, "parallel": {"tensor_size": 2}},
            "FP8 would be silently off"),
    Refusal("ds-autotp-hybrid", {**DS, "parallel": {"tensor_size": 2, "sharding": "hybrid", "shard_size": 2}},
            "which AutoTP does not compose with"),
    Refusal("ds-sequence-parallel", {**DS, "parallel": {"tensor_size": 2, "sequence_parallel": True}},
            "DeepSpeed AutoTP has no sequence parallel"),
    Refusal("ds-context-parallel", {**DS, "parallel": {"context_size": 2}}, "which fp8dist does not wire"),
    Refusal("te-tensor-parallel", {**te(), "parallel": {"tensor_size": 2}}, "huggingface/accelerate#3827"),
    Refusal("msamp-tensor-parallel", {"precision": {"preset": "msamp-o2"}, "engine": "deepspeed",
                                      "parallel": {"tensor_size": 2}}, "only through Megatron-LM"),
    Refusal("adapter-tensor-parallel", {"adapter": {"kind": "lora"}, "parallel": {"tensor_size": 2}},
            "fp8dist splits plain nn.Linear layers only"),
    Refusal("ds-pipeline", {**DS, "parallel": {"pipeline_size": 2}, "train": {"micro_batch_size": 4}},
            "DeepSpeed's pipeline engine trains a PipelineModule"),
    Refusal("pipeline-sequence-parallel", {"parallel": {"pipeline_size": 2, "tensor_size": 2, "sequence_parallel": True},
                                           "train": {"micro_batch_size": 4}}, "sequence parallel with pipeline parallel"),
    Refusal("pipeline-zero-bubble", {"parallel": {"pipeline_size": 2, "pipeline_schedule": "zero_bubble"},
                                     "train": {"micro_batch_size": 4}}, "stage_backward_weight"),
    Refusal("pipeline-microbatches-do-not-divide", {"parallel": {"pipeline_size": 2, "pipeline_microbatches": 3}},
            "do not divide train.micro_batch_size=2"),
    Refusal("pipeline-1f1b-too-few-microbatches", {"parallel": {"pipeline_size": 2, "pipeline_microbatches": 1}},
            "needs at least pipeline_size=2 microbatches"),
    Refusal("pipeline-stages-per-rank-single-stage-schedule",
            {"parallel": {"pipeline_size": 2, "pipeline_stages_per_rank": 2}, "train": {"micro_batch_size": 4}},
            "runs exactly 1 stages per rank"),
    Refusal("pipeline-split-length", {"parallel": {"pipeline_size": 2, "pipeline_split": [1, 2]},
                                      "train": {"micro_batch_size": 4}}, "2 stage starts for 2 stages"),
    Refusal("pipeline-expert-parallel", {"parallel": {"pipeline_size": 2, "expert_size": 2},
                                         "train": {"micro_batch_size": 4}}, "an expert mesh per pipeline stage"),
    Refusal("pipeline-context-parallel", {"parallel": {"pipeline_size": 2, "context_size": 2},
                                          "train": {"micro_batch_size": 4}}, "the schedule runs each stage"),
    Refusal("pipeline-fp16", {"precision": {"preset": "fp16-amp"}, "parallel": {"pipeline_size": 2},
                              "train": {"micro_batch_size": 4}}, "pipeline parallel with fp16 compute"),
    Refusal("pipeline-efficient-loading", {"parallel": {"pipeline_size": 2, "cpu_ram_efficient_loading": True},
                                           "train": {"micro_batch_size": 4}}, "CPU-RAM-efficient loading"),
    Refusal("expert-parallel-tensor-parallel", {"parallel": {"expert_size": 2, "tensor_size": 2}},
            "fp8dist's tensor parallel refuses MoE models"),
    Refusal("expert-parallel-context-parallel", {"parallel": {"expert_size": 2, "context_size": 2}},
            "fp8dist's EP borrows ranks from dp_shard only"),
    Refusal("expert-parallel-hybrid", {"parallel": {"expert_size": 2, "sharding": "hybrid", "shard_size": 2}},
            "the experts' (efsdp, ep) mesh is built over the shard ranks only"),
    Refusal("expert-parallel-offload", {"parallel": {"expert_size": 2, "offload": "params"}},
            "CPUOffloadPolicy over the experts' (efsdp, ep) DTensors"),
    Refusal("expert-parallel-compile", {"compile": True, "parallel": {"expert_size": 2}},
            "torch.compile of blocks whose experts dispatch tokens"),
    Refusal("ds-expert-parallel-hybrid", {**DS, "parallel": {"expert_size": 2, "sharding": "hybrid", "shard_size": 2}},
            "AutoEP with ZeRO stage 3 does not support hpZ"),
    Refusal("ds-expert-parallel-fp8-experts", {**DS, "precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        **EMULATE, "experts": "mxfp8"}}}, "parallel": {"expert_size": 2}}, "would be silently dropped"),
    Refusal("ds-expert-parallel-zero3-quantized-gradients", {**DS, "parallel": {"expert_size": 2, "sharding": "full"},
            "deepspeed": {"extra": {"zero_optimization": {"zero_quantized_gradients": True}}}},
            "_validate_zero3_moe_compatibility"),
    Refusal("ds-expert-parallel-zero3-nvme", {**DS, "parallel": {"expert_size": 2, "sharding": "full"},
            "deepspeed": {"offload_optimizer": "nvme", "nvme_path": "/nvme"}}, "does not support NVMe optimizer swapping"),
    # DeepSpeed 0.19.8's AutoEP next to transformers 5.24 raises inside deepspeed.initialize: refused before launch
    Refusal("ds-expert-parallel-autoep-registry", {**DS, "parallel": {"expert_size": 2}}, "which takes no default",
            "environment", "deepspeed_autoep"),
    Refusal("expert-parallel-adapter", {"adapter": {"kind": "lora"}, "parallel": {"expert_size": 2}},
            "expert parallel with LoRA adapters"),
    Refusal("adapter-msamp", {"adapter": {"kind": "lora"}, "precision": {"preset": "msamp-o2"}},
            "MS-AMP casts every Linear weight"),
    Refusal("adapter-te", merge(te(), {"adapter": {"kind": "lora"}}), "Transformer Engine under LoRA"),
    Refusal("adapter-efficient-loading", {"adapter": {"kind": "lora"}, "parallel": {"cpu_ram_efficient_loading": True}},
            "the adapters are not in the model directory"),
    Refusal("adapter-modules-to-save-without-kind", {"adapter": {"modules_to_save": ["lm_head"]}},
            "adapter settings do nothing with adapter.kind=none"),
    Refusal("adapter-modules-to-save-also-targeted",
            {"adapter": {"kind": "lora", "target_modules": ["q_proj", "lm_head"], "modules_to_save": ["lm_head"]}},
            "puts no adapter on a module to save"),
    Refusal("adapter-modules-to-save-fp8", {"adapter": {"kind": "lora", "modules_to_save": ["lm_head"]},
                                            "precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE}}},
            "would convert the trained copy"),
    Refusal("adapter-dora-without-kind", {"adapter": {"use_dora": True}},
            "adapter settings do nothing with adapter.kind=none"),
    Refusal("adapter-dora-nf4", {"adapter": {"kind": "lora", "use_dora": True, "base_dtype": "nf4"},
                                 "precision": {"preset": "bf16"}}, "NF4Tensor.dequantize does not take"),
    Refusal("adapter-dora-float8-all-gather", {"adapter": {"kind": "lora", "use_dora": True},
                                               "precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE}}},
            "the frozen weights are all-gathered in float8"),
    Refusal("adapter-dora-fp8-dropout",
            {"adapter": {"kind": "lora", "use_dora": True, "dropout": 0.05},
             "precision": {"preset": "torchao-float8",
                           "fp8": {"torchao": {**EMULATE, "enable_fsdp_float8_all_gather": False}}}},
            "a second GEMM of every FP8 Linear"),
    Refusal("fsdp2-state-dtype-mismatch", {"optimizer": {"state_dtype": "bf16"}}, "torch.optim keeps states"),
    # Moved keys are refused with their new name.
    Refusal("moved-deepspeed-fp16", {**DS, "deepspeed": {"fp16": {"loss_scale": 0}}},
            "moved to `precision.loss_scaling`"),
    # The numerics limits are shares (0..1) and dB floors (>= 0); every one out of range is named at once. What
    # they judge is tested in-process (tests/unit/audit/test_numerics.py): `--numerics` is not part of a run.
    Refusal("numerics-limits-out-of-range", {"audit": {"numerics": {
        "max_underflow": 1.5, "max_saturated": -0.1,
        "min_sqnr_db": {"forward": -1, "input_grad": -1, "weight_grad": -1}}}},
        "audit.numerics.max_underflow: 1.5 is greater than the maximum of 1"),
    # The per-Linear policy and the schedule: what a backend's path cannot run (tests/unit/backends/test_policy.py
    # has the rest)
    Refusal("policy-without-fp8", {"precision": {"preset": "bf16", "fp8": {"keep_last_layers": 1}}}, "no FP8 GEMM"),
    Refusal("te-override-other-recipe", merge(TE, {"precision": {"fp8": {"overrides": [
        {"modules": ["*"], "recipe": "current"}]}}}), "one recipe per run"),
    Refusal("schedule-after-last-step", {"precision": {"preset": "torchao-float8", "fp8": {
        "torchao": {**EMULATE, "enable_fsdp_float8_all_gather": False}}, "schedule": {"from_step": 9}}},
        "never act"),
    Refusal("schedule-float8-all-gather", {"precision": {"preset": "torchao-float8", "fp8": {"torchao": EMULATE},
                                                         "schedule": {"from_fraction": 0.5}}},
            "all-gathered in float8"),
    Refusal("override-te-recipe-on-torchao", {"precision": {"preset": "torchao-float8", "fp8": {
        "torchao": EMULATE, "overrides": [{"modules": ["*"], "recipe": "delayed"}]}}}, "a Transformer Engine recipe"),
    Refusal("msamp-override-recipe", {**DS, "precision": {"preset": "msamp-o1", "fp8": {"overrides": [
        {"modules": ["*"], "recipe": "tensorwise"}]}}}, "use recipe none"),
    Refusal("overrides-mixed-under-tp", {"precision": {"preset": "torchao-float8", "fp8": {
        "torchao": EMULATE, "overrides": [{"modules": ["*mlp*"], "recipe": "rowwise"}]}},
        "parallel": {"tensor_size": 2}}, "side by side under tensor parallel"),
    Refusal("schedule-twice", {"precision": {"preset": "torchao-float8", "fp8": {
        "torchao": {**EMULATE, "enable_fsdp_float8_all_gather": False}},
        "schedule": {"from_step": 1, "from_fraction": 0.5}}}, "the switch is given twice"),
    Refusal("schedule-te", merge(TE, {"precision": {"schedule": {"from_step": 1}}}), "no switch of it is wired"),
    Refusal("schedule-mxfp8-forward", {"precision": {"preset": "torchao-float8", "fp8": {
        "torchao": {**EMULATE, "recipe_name": "mxfp8"}}, "schedule": {"from_step": 1}}}, "forward alone"),
    Refusal("policy-auto-te", merge(TE, {"precision": {"fp8": {"policy": "auto"}}}), "numerics probes cannot run"),
    Refusal("policy-auto-deepspeed", {**DS, "precision": {"preset": "torchao-float8", "fp8": {
        "torchao": EMULATE, "policy": "auto"}}}, "wired into the FSDP2 engine"),
    Refusal("policy-auto-lora", {"adapter": {"kind": "lora"}, "precision": {"preset": "torchao-float8", "fp8": {
        "torchao": EMULATE, "policy": "auto"}}}, "base Linears are frozen"),
    Refusal("policy-auto-tensor-parallel", {"parallel": {"tensor_size": 2}, "precision": {
        "preset": "torchao-float8", "fp8": {"torchao": EMULATE, "policy": "auto"}}}, "runs each rank's whole model"),
    Refusal("policy-auto-ram-efficient-loading", {"parallel": {"cpu_ram_efficient_loading": True}, "precision": {
        "preset": "torchao-float8", "fp8": {"torchao": EMULATE, "policy": "auto"}}}, "builds the model on the meta"),
    Refusal("policy-auto-schedule-all-gather", {"precision": {"preset": "torchao-float8", "fp8": {
        "torchao": {**EMULATE, "enable_fsdp_float8_all_gather": "auto"}, "policy": "auto"},
        "schedule": {"from_step": 1}}}, "calibration may give Linears tensorwise"),
    Refusal("schedule-compile", {"compile": True, "precision": {"preset": "torchao-float8", "fp8": {
        "torchao": {"enable_fsdp_float8_all_gather": False}}, "schedule": {"from_step": 1}}}, "torch.compile"),
]


# --- the schema walk --------------------------------------------------------------------------

def leaves(node: dict | None = None, path: tuple = ()) -> dict[str, dict]:
    """Dotted path -> schema node, for every leaf key of the schema."""
    node = schema() if node is None else node
    props = node.get("properties")
    if node.get("type") == "object" and props:
        out: dict[str, dict] = {}
        for key, sub in props.items():
            out.update(leaves(sub, path + (key,)))
        return out
    return {".".join(path): node}


def enum_values(node: dict) -> list | None:
    """The finite set of values a leaf takes (enums, booleans, nullable enums), None for free values."""
    defs = schema()["$defs"]

    def of(sub: dict) -> list | None:
        if "enum" in sub:
            return list(sub["enum"])
        if "const" in sub:
            return [sub["const"]]
        if "$ref" in sub:
            return of(defs[sub["$ref"].rsplit("/", 1)[-1]])
        if sub.get("type") == "boolean":
            return [True, False]
        if sub.get("type") == "null":
            return [None]
        return None

    if "anyOf" in node:
        parts = [of(sub) for sub in node["anyOf"]]
        return None if any(p is None for p in parts) else [v for p in parts for v in p]
    return of(node)


def _get(doc: dict, dotted: str, missing=KeyError):
    for part in dotted.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return missing
        doc = doc[part]
    return doc


def _key(value: Any) -> str:
    return json.dumps(value)


def active(path: str, resolved: dict) -> bool:
    """Does this key act in this resolved config? A block's defaults do not run when its backend or engine
    is off (te.recipe is `delayed` in every config, but only a TE run exercises it)."""
    from fp8dist.config.spec import compute_dtype_of

    precision, fp8 = resolved["precision"], resolved["precision"]["fp8"]
    gates = {
        "precision.fp8.torchao.": fp8["backend"] == "torchao",
        "precision.fp8.te.": fp8["backend"] == "te" or (fp8["backend"] == "msamp" and fp8["msamp"]["use_te"]),
        "precision.fp8.msamp.": fp8["backend"] == "msamp",
        "precision.fp8.modules.": fp8["backend"] != "none",
        "precision.loss_scaling.": compute_dtype_of(precision["mixed_precision"], precision["load_dtype"],
                                                    precision["master_weights"]) == "fp16",
        "fsdp2.": resolved["engine"] == "fsdp2",
        "adapter.base_dtype": resolved["adapter"]["kind"] != "none",
        "deepspeed.": resolved["engine"] == "deepspeed",
    }
    return all(on for prefix, on in gates.items() if path.startswith(prefix))


def coverage() -> dict[tuple[str, str], dict[str, list[str]]]:
    """(key, value) -> {"run": [case ids], "refusal": [case ids]}. Enum leaves are covered per value by the
    resolved config of a run or of an environment refusal (defaults and presets count where the key acts)
    or by a config refusal that wrote it; free leaves (numbers, lists, strings, `extra`) by a case that
    writes a non-default value."""
    from fp8dist.config.load import resolve

    found: dict[tuple[str, str], dict[str, list[str]]] = {}
    base = defaults()
    for kind, cases in (("run", RUNS), ("refusal", REFUSALS)):
        for case in cases:
            written = merge(RUN_BASE, case.config) if kind == "run" else case.config
            resolvable = kind == "run" or case.kind == "environment"
            resolved = resolve(written) if resolvable else None
            for path, node in leaves().items():
                values = enum_values(node)
                if path == "fsdp2.wrap" and resolved is not None and active(path, resolved):
                    wrap = _get(resolved, path)
                    item = (path, _key(wrap) if wrap == "auto" else "<set>")
                    found.setdefault(item, {"run": [], "refusal": []})[kind].append(case.id)
                elif values is not None and path != "fsdp2.wrap":
                    if resolved is not None and not active(path, resolved):
                        continue
                    value = _get(resolved if resolved is not None else written, path)
                    if value is KeyError:
                        continue
                    found.setdefault((path, _key(value)), {"run": [], "refusal": []})[kind].append(case.id)
                else:
                    value = _get(written, path)
                    if value is KeyError or value == _get(base, path, None):
                        continue
                    found.setdefault((path, "<set>"), {"run": [], "refusal": []})[kind].append(case.id)
    return found


def required() -> list[tuple[str, str]]:
    """Every (key, value) that must be covered; free leaves need one non-default use ("<set>")."""
    out = []
    for path, node in leaves().items():
        values = enum_values(node)
        if path == "fsdp2.wrap":
            out += [(path, _key("auto")), (path, "<set>")]
        elif values is None:
            out.append((path, "<set>"))
        else:
            out += [(path, _key(v)) for v in values]
    return out


def uncovered() -> list[tuple[str, str]]:
    found = coverage()
    return [item for item in required() if item not in found]


# --- the generated table --------------------------------------------------------------------

AUDIT_ROWS = {  # what the audit shows for a key: the phases whose expected dtype it sets
    "precision.preset": "every phase (the row of the documented table)",
    "precision.load_dtype": "loading",
    "precision.mixed_precision": "training, gemm, weight_all_gather",
    "precision.master_weights": "preparation, master_weights, weights, weight_gradients",
    "precision.reduce_dtype": "communication",
    "precision.fp8.backend": "gemm",
    "precision.fp8.torchao.enable_fsdp_float8_all_gather": "weight_all_gather",
    "precision.fp8.torchao.experts": "gemm (gemm_flops: the experts' grouped GEMMs by FLOPs)",
    "precision.fp8.te.recipe": "gemm (fp4 for nvfp4)",
    "precision.fp8.msamp.opt_level": "gemm, communication, weights, master_weights, weight_gradients, optimizer",
    "optimizer.state_dtype": "optimizer",
    "optimizer.name": "optimizer (states per parameter)",
    "deepspeed.grad_accum_dtype": "weight_gradients",
    "deepspeed.zero_stage": "preparation, master_weights",
    "parallel.offload": "weights / masters / optimizer where offloaded (their dtype does not change)",
    "parallel.tensor_size": "tp_reduction, tp_all_gather (collectives attributed by mesh axis: "
                            "communication_bytes_by_axis)",
    "parallel.sequence_parallel": "tp_all_gather (fp8 for tensorwise float8, else the compute dtype)",
    "parallel.expert_size": "ep_all_to_all (the tokens' dispatch in the compute dtype, on the ep axis of "
                            "communication_bytes_by_axis)",
    "parallel.pipeline_size": "gemm (every stage's GEMM ledger merged), communication_bytes_by_axis.pp (send / recv), "
                              "pipeline (the bubble measured beside the schedule's theory)",
    "engine": "engine (recognised from the prepared objects), then every phase",
    "audit.first_step": "whether step 1 is audited, and what a mismatch does",
    **{f"audit.numerics.{key}": "numerics (with `--numerics` / `watch(..., numerics=True)`)" for key in (
        "max_underflow", "max_saturated", "min_sqnr_db.forward", "min_sqnr_db.input_grad", "min_sqnr_db.weight_grad")},
    "precision.fp8.modules.exclude": "FP8 modules list",
    "precision.fp8.modules.skip_first_last": "FP8 modules list",
    "precision.fp8.torchao.pad_inner_dim": "FP8 modules list",
    "precision.fp8.min_speedup": "FP8 modules list (each Linear kept with its predicted speedup)",
    "hardware.gpu": "speed (info: the predicted FP8 / bf16 ratio of the GEMMs the step ran, on this GPU)",
    "adapter.kind": "frozen_weights, frozen_state (lora: the other rows cover the adapters only)",
    "adapter.base_dtype": "frozen_weights",
}


def render() -> str:
    found = coverage()
    lines = ["# Option matrix", "",
             "Generated by `python -m tests.option_matrix > docs/options.md`; `tests/unit/test_option_matrix.py` "
             "fails when a schema key or value has neither a run nor a refusal, or when this file is stale.", "",
             "- **run**: trained for real on 2 ranks (gloo) in `tests/distributed/test_option_runs.py`, one case "
             "per id in `tests/option_matrix.py` `RUNS`.",
             "- **refused**: a clear error, tested in-process in `tests/unit/test_option_matrix.py` (`REFUSALS`): "
             "the key needs a GPU or a library that cannot exist on a CPU machine, or the combination is invalid.",
             "", "| option | value | run | refused | audit shows |", "|---|---|---|---|---|"]
    for path, value in required():
        cases = found.get((path, value), {"run": [], "refusal": []})
        shown = "any non-default" if value == "<set>" else f"`{value}`"
        audit = AUDIT_ROWS.get(path, "not a dtype: not audited")
        lines.append(f"| `{path}` | {shown} | {', '.join(cases['run'][:3]) or '-'} | "
                     f"{', '.join(cases['refusal'][:3]) or '-'} | {audit} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
