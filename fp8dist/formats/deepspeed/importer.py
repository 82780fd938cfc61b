"""A DeepSpeed config (JSON) -> an fp8dist config with engine deepspeed.

Precision sections (bf16 / fp16 / torch_autocast, communication_data_type, data_types, msamp) become
`precision`; zero_optimization's stage and offload the `parallel` vocabulary (fp8dist/config/vocabulary.py), and
tensor_parallel.autotp_size (AutoTP) parallel.tensor_size, expert_parallel (AutoEP) enabled with autoep_size
parallel.expert_size;
the pipeline section (DeepSpeed's PipelineEngine, for a PipelineModule) key by key: stages above 1 refused with the
fp8dist keys of the same pipeline (engine fsdp2), the others noted;
batch and clipping keys `train`; the optimizer section `optimizer`; every other DeepSpeed key goes to
`deepspeed.extra` unchanged. `"auto"` is what only Accelerate / the HF Trainer fill in, from the launch (DeepSpeed
alone would drop it inside a typed section, DeepSpeedConfigModel, or crash on a top-level scalar): it is resolved
to what they would use (AutoContext: the launching tool's settings, from the file that names this JSON or from
`fp8dist import` flags), said in a note. An "auto" precision with no launch precision known is refused, naming
--mixed-precision: the file alone does not say whether it runs in fp32, fp16 or bf16.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, cast

from fp8dist.config.vocabulary import DEEPSPEED_OFFLOAD, ZERO_STAGE
import fp8dist.dtypes as dtypes
from fp8dist.errors import Issue
from fp8dist.facts.deepspeed import DS_CLIPPING_DEFAULT_CHANGED
from fp8dist.facts.versions import fmt
from fp8dist.formats.common import (LAUNCHER_FLAGS, Imported, ImportProblem, Launcher, Notes, dtype_name, mapping,
                                   parallel_size, set_path, truthy)
from fp8dist.formats.keys import KeyClass, Table, disabled, kept, no_effect, one_or_unset, refused

SHARDING_OF_STAGE = {stage: name for name, stage in ZERO_STAGE.items() if name != "hybrid"}
OFFLOAD_OF_DEVICES = {devices: name for name, devices in DEEPSPEED_OFFLOAD.items()}
_EXTRA = "deepspeed.extra: DeepSpeed reads it as written"
# DeepSpeed's pipeline section (deepspeed 0.19.8 runtime/config.py get_pipeline_config: stages, partition,
# seed_layers, activation_checkpoint_interval, pipe_partitioned, grad_partitioned, and use_reentrant that
# runtime/pipe/engine.py adds) is read by runtime/pipe/engine.py PipelineEngine alone, which deepspeed/__init__.py
# initialize builds only for a PipelineModule; stages, partition and seed_layers are read nowhere (PipelineModule's
# own num_stages / partition_method / seed_layers arguments decide), and the engine runs gradient_accumulation_steps
# micro-batches of train_micro_batch_size_per_gpu through the pipeline (PipelineEngine.__init__ micro_batches).
_PIPELINE_ENGINE = ("read only by DeepSpeed's PipelineEngine, which runs a PipelineModule (deepspeed/__init__.py "
                    "initialize); fp8dist passes the Hugging Face model, whose DeepSpeedEngine ignores the section "
                    "(a pipelined run is fp8dist's engine fsdp2 with parallel.pipeline_size)")
_PIPELINE_ARGUMENT = ("read from the config by no part of DeepSpeed 0.19.8 (runtime/config.py get_pipeline_config "
                      "only fills it in; the PipelineModule's own argument decides)")
_PIPELINE_STAGES = ("the pipeline stages of the run (DeepSpeed's PipelineEngine over a PipelineModule, the model "
                    "written as a list of layers; DeepSpeed 0.19.8 takes the count from PipelineModule(num_stages) "
                    "and reads this key nowhere): a layout fp8dist does not build on DeepSpeed (its pipeline "
                    "parallel runs on FSDP2, over the Hugging Face model)")
_PIPELINE_FIX = ("write engine: fsdp2 with parallel.pipeline_size (this count), parallel.pipeline_microbatches "
                 "(DeepSpeed's gradient_accumulation_steps: its PipelineEngine runs that many micro-batches a step) "
                 "and train.micro_batch_size train_micro_batch_size_per_gpu x gradient_accumulation_steps with "
                 "gradient_accumulation_steps 1; or remove the pipeline section")
# DeepSpeed's Ulysses: runtime/config.py divides the data-parallel world by it; deepspeed/sequence/layer.py
# DistributedAttention exchanges the attention heads all-to-all.
_ULYSSES = ("DeepSpeed's Ulysses sequence parallel (each sequence split over this many ranks, attention heads "
            "exchanged all-to-all; the data-parallel world divided by it), which fp8dist does not wire; its context "
            "parallel (parallel.context_size) is FSDP2's ring attention")
_AUTOTP_RULES = ("custom AutoTP partition rules (which weights split, and how); fp8dist runs AutoTP with DeepSpeed's "
                 "own rules for the model (its HF tp_plan, else AutoTP's parser: runtime/engine.py "
                 "_apply_autotp_partitioning), which its checks of heads and sizes assume")
_AUTOTP_TRAINING = "not read by AutoTP training (runtime/engine.py _apply_autotp_partitioning)"
_AUTOEP_LAYERS = f"{_EXTRA} (which layers AutoEP swaps and how it reads them: module_inject/auto_ep_presets)"
_AUTOEP_ROUTING = f"{_EXTRA} (AutoEP's routing where it overrides the model's: module_inject/auto_ep_layer.py)"
_AUTOEP_KERNELS = f"{_EXTRA} (AutoEP's kernels and checks for the same computation)"
_QUANTIZED = ("quantises {what}, a precision fp8dist's config does not describe (its audit would expect the "
              "unquantised dtypes)")
# What DeepSpeed 0.19.8 uses when a config leaves a key out (or writes "auto" inside a typed section, which
# DeepSpeedConfigModel replaces by the default): runtime/precision_config.py, runtime/zero/config.py (measured with
# deepspeed.runtime.config.DeepSpeedConfig).
FP16_DEFAULTS = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                 "min_loss_scale": 1}
ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                 "stage3_param_persistence_threshold": 100_000}
# "auto" in a DeepSpeed config, as Accelerate fills it at prepare (accelerate 1.15 accelerator.py
# _prepare_deepspeed): gradient_clipping 1.0; optimizer lr / weight_decay from DummyOptim (utils/deepspeed.py:
# lr=0.001, weight_decay=0); the bucket sizes from the model's hidden_size h (h*h, 0.9*h*h, 10*h).
ACCELERATE_AUTO = {"gradient_clipping": 1.0, "optimizer.params.lr": 0.001, "optimizer.params.weight_decay": 0.0,
                   "gradient_accumulation_steps": 1}
ACCELERATE_HIDDEN_SIZE_AUTO = {"zero_optimization.reduce_bucket_size": "hidden_size * hidden_size",
                               "zero_optimization.stage3_prefetch_bucket_size": "0.9 * hidden_size * hidden_size",
                               "zero_optimization.stage3_param_persistence_threshold": "10 * hidden_size"}


def default_communication(section: str | None) -> str:
    """communication_data_type when the config leaves it out: the 16-bit section's dtype, else fp32
    (deepspeed 0.19.8 runtime/engine.py DeepSpeedEngine.communication_data_type)."""
    return {"fp16": "fp16", "bf16": "bf16"}.get(section or "", "fp32")


# DeepSpeed 0.19.8's config keys (runtime/config.py DeepSpeedConfig._initialize_params, runtime/zero/config.py) and
# their class (fp8dist/formats/keys.py). Top-level keys, then zero_optimization's as `zero_optimization.KEY`.
KEYS = Table("DeepSpeed", {
    "bf16": kept("precision (bf16 compute; bf16_master_weights_and_grads, bf16_optimizer_states)",
                 example={"enabled": True}),
    "bfloat16": kept("precision (the old name of bf16)", example={"enabled": True}),
    "fp16": kept("precision (fp16 compute) and precision.loss_scaling", example={"enabled": True}),
    "torch_autocast": kept("precision (compute dtype on weights kept as loaded)",
                           example={"enabled": True, "dtype": "bfloat16"}),
    "communication_data_type": kept("precision.reduce_dtype", example="fp32"),
    "data_types": kept("deepspeed.grad_accum_dtype", example={"grad_accum_dtype": "fp32"}),
    "msamp": kept("precision.fp8 (MS-AMP)", example={"enabled": True, "opt_level": "O2"}),
    "zero_optimization": kept("parallel.sharding / offload (the rest of the section: deepspeed.extra)",
                              example={"stage": 2}),
    "train_micro_batch_size_per_gpu": kept("train.micro_batch_size", example=4),
    "gradient_accumulation_steps": kept("train.gradient_accumulation_steps", example=2),
    "train_batch_size": kept("derived: micro batch x accumulation x world size; alone (or with only one of the two) "
                             "it depends on the world size and is refused", example=64),
    "gradient_clipping": kept("train.gradient_clipping", example=1.0),
    "steps_per_print": kept("deepspeed.steps_per_print", example=10),
    "optimizer": kept("optimizer (fp8dist builds it: AdamW, also for type Adam unless params.adam_w_mode is false, "
                      "as DeepSpeed runs it; Adam; SGD; params.bias_correction false and params.amsgrad true refused)",
                      example={"type": "AdamW"}),
    "amp": refused("Apex AMP, a mixed-precision mode of its own (and removed from DeepSpeed 0.19.8)",
                   "remove it and say the precision with a bf16 or fp16 section", unless=disabled, otherwise="disabled",
                   example={"enabled": True, "opt_level": "O1"}),
    # pipeline: deepspeed 0.19.8 runtime/config.py get_pipeline_config (a plain dict over its defaults)
    "pipeline": no_effect(f"{_PIPELINE_ENGINE}; its keys by their rules (pipeline.stages above 1 refused); in a JSON "
                          "an Accelerate, Axolotl or TRL file names, the whole section is noted (they train through "
                          "DeepSpeedEngine)", example={}),
    "pipeline.stages": refused(_PIPELINE_STAGES, _PIPELINE_FIX, unless=lambda value: value == "auto" or
                               one_or_unset(value), otherwise=f"\"auto\" (DeepSpeed's default: the PipelineModule's "
                               f"num_stages) or 1; {_PIPELINE_ENGINE}", example=2),
    "pipeline.partition": no_effect(f"how a PipelineModule assigns its layers to stages, {_PIPELINE_ARGUMENT} "
                                    "(partition_method); fp8dist's split of a pipeline is parallel.pipeline_split",
                                    example="uniform"),
    "pipeline.seed_layers": no_effect(f"a seed per layer as a PipelineModule builds them, {_PIPELINE_ARGUMENT}"),
    "pipeline.activation_checkpoint_interval": no_effect(f"recomputes every N layers of a PipelineModule, "
                                                         f"{_PIPELINE_ENGINE}; recomputing changes no number "
                                                         "(fp8dist's: parallel.activation_checkpointing)", example=1),
    "pipeline.use_reentrant": no_effect(f"which checkpoint function recomputes a PipelineModule's layers (the same "
                                        f"numbers), {_PIPELINE_ENGINE}", example=False),
    **{f"pipeline.{key}": no_effect(f"splits the {what} sent between stages over the tensor-parallel ranks "
                                    f"(communication only), {_PIPELINE_ENGINE}", example=False)
       for key, what in (("pipe_partitioned", "activations"), ("grad_partitioned", "gradients"))},
    "sequence_parallel_size": refused(_ULYSSES, "set it to 1 (for context parallel: parallel.context_size with "
                                      "engine fsdp2)", unless=one_or_unset, otherwise="1", example=2),
    # expert_parallel: deepspeed 0.19.8 module_inject/auto_ep_config.py parse_autoep_config (a plain dict: unknown keys
    # are ignored, `enabled` is read as a truth value)
    "expert_parallel": kept("parallel.expert_size from enabled with autoep_size (AutoEP); its other keys by their "
                            "rules", example={"enabled": True, "autoep_size": 2}),
    "expert_parallel.enabled": kept("parallel.expert_size (AutoEP on; off, or on at autoep_size 1, the section is "
                                    "noted)"),
    "expert_parallel.autoep_size": kept("parallel.expert_size", example=2),
    **{f"expert_parallel.{key}": kept(_AUTOEP_LAYERS, example="x") for key in (
        "preset_model", "moe_layer_pattern", "expert_pattern", "router_pattern", "expert_w1", "expert_w2", "expert_w3",
        "num_experts_attr", "top_k_attr", "shared_experts_pattern", "shared_experts_gate_pattern")},
    "expert_parallel.has_shared_experts": kept(_AUTOEP_LAYERS),
    **{f"expert_parallel.{key}": kept(_AUTOEP_ROUTING, example=example) for key, example in (
        ("route_norm", True), ("route_scale", 1.0), ("score_apply", "post"), ("score_func", "softmax"), ("top_k", 2),
        ("routed_scaling_factor", 1.0), ("num_expert_groups", 1), ("num_limited_groups", 1),
        ("expert_activation", "silu"))},
    **{f"expert_parallel.{key}": kept(_AUTOEP_KERNELS, example=example) for key, example in (
        ("use_grouped_mm", True), ("disable_triton_grouped_mm", True), ("gate_up_impl", "fused"),
        ("combine_impl", "weighted_sum"), ("validate_folding_routing", True), ("async_split_plan", True))},
    **{f"expert_parallel.{key}": no_effect("read by DeepEP's dispatch only (comm_backend deepep, which fp8dist "
                                           "refuses: module_inject/auto_ep_comm.py)", example=example)
       for key, example in (("comm_num_sm", 12), ("comm_qp_margin", 4), ("comm_max_tokens_per_rank", 4096),
                            ("row_weighting_impl", "eager"))},
    "expert_parallel.expert_tensor_parallel_size": refused(
        "splits each expert's weights over this many ranks too: a layout DeepSpeed 0.19.8 does not run yet "
        "(module_inject/auto_ep_folding.py validate_folding_global) and fp8dist's mesh has no axis for",
        "set it to 1, or remove it", unless=one_or_unset, otherwise="1: each expert whole on its rank", example=2),
    "expert_parallel.load_balance_coeff": refused(
        "auxiliary-loss-free load balancing: a bias on each expert's routing score, updated from its load, so the "
        "routing changes as it trains; DeepSpeed 0.19.8 refuses it too (module_inject/auto_ep_presets/base.py "
        "_raise_unsupported_load_balance_coeff)", "remove it (or write null)", example=0.001),
    "expert_parallel.comm_backend": refused(
        "sends the tokens with DeepEP (the deep_ep library, bfloat16 rows only: module_inject/auto_ep_comm.py), which "
        "fp8dist neither checks before launch nor has run", "set it to \"comm\" (DeepSpeed's all-to-all), or remove it",
        unless=lambda value: value == "comm", otherwise="\"comm\": DeepSpeed's own all-to-all, its default",
        example="deepep"),
    "compression_training": refused(_QUANTIZED.format(what="or prunes the model during training"),
                                    "remove compression_training", unless=disabled, otherwise="empty",
                                    example={"weight_quantization": {}}),
    "weight_quantization": refused(_QUANTIZED.format(what="the weights"), "remove it", unless=disabled,
                                   otherwise="empty", example={"quantized_initialization": {}}),
    "quantize_training": refused(_QUANTIZED.format(what="the weights during training"), "remove it", unless=disabled,
                                 otherwise="empty", example={"enabled": True}),
    "zero_optimization.stage": kept("parallel.sharding (deepspeed.zero_stage for ZeRO-1)", example=2),
    "zero_optimization.offload_optimizer": kept("parallel.offload / deepspeed.offload_optimizer",
                                                example={"device": "cpu"}),
    "zero_optimization.offload_param": kept("parallel.offload / deepspeed.offload_param", example={"device": "cpu"}),
    "zero_optimization.cpu_offload": kept("parallel.offload: optimizer (DeepSpeed's old name of offload_optimizer "
                                          "cpu)"),
    "zero_optimization.zero_hpz_partition_size": kept("parallel.sharding hybrid, shard_size", example=2),
    "zero_optimization.zenflow": refused("ZenFlow steps the optimizer asynchronously on stale gradients for the "
                                         "less important columns: another optimizer numerics", "remove zenflow",
                                         unless=disabled, otherwise="empty", example={"topk_ratio": 0.1}),
    "zero_optimization.zero_quantized_weights": refused(_QUANTIZED.format(what="the all-gathered weights to int8 "
                                                                         "(ZeRO++ qwZ)"), "remove it",
                                                        unless=disabled, otherwise="off"),
    "zero_optimization.zero_quantized_gradients": refused(_QUANTIZED.format(what="the reduced gradients to int4 "
                                                                           "(ZeRO++ qgZ)"), "remove it",
                                                          unless=disabled, otherwise="off"),
    "zero_optimization.zero_quantized_nontrainable_weights": refused(_QUANTIZED.format(what="the frozen weights to "
                                                                                      "int8"), "remove it",
                                                                     unless=disabled, otherwise="off"),
    # tensor_parallel: deepspeed 0.19.8 runtime/tensor_parallel/config.py TPTrainingConfig (a typed section that
    # refuses unknown keys), `tp` its TPConfig (also spelled tensor_parallel)
    "tensor_parallel": kept("parallel.tensor_size from autotp_size (AutoTP); its other keys by their rules",
                            example={"autotp_size": 2}),
    "tensor_parallel.autotp_size": kept("parallel.tensor_size (0, DeepSpeed's default, and 1: no split)", example=2),
    "tensor_parallel.tp.tp_size": refused("AutoTP training splits by autotp_size; tp.tp_size alone leaves training "
                                          "unsplit, and next to another autotp_size DeepSpeed stops (runtime/engine.py "
                                          "_apply_autotp_partitioning)", "write the degree as autotp_size (and "
                                          "tp.tp_size the same, or remove it)", example=2),
    "tensor_parallel.tp.tp_grain_size": no_effect("read by AutoTP only with partition_config (runtime/engine.py), "
                                                  "which fp8dist refuses", example=64),
    "tensor_parallel.tp_overlap_comm": kept(_EXTRA),
    "tensor_parallel.keep_module_on_host": kept(_EXTRA),
    "tensor_parallel.partition_config": refused(_AUTOTP_RULES, "remove it", unless=disabled, otherwise="none",
                                                example={"use_default_specs": False, "layer_specs": []}),
    "tensor_parallel.preset_model": refused(_AUTOTP_RULES, "remove it", unless=disabled, otherwise="none",
                                            example="llama"),
    "tensor_parallel.injection_policy_tuple": refused(_AUTOTP_RULES, "remove it", unless=disabled, otherwise="none",
                                                      example=["LlamaDecoderLayer"]),
    "tensor_parallel.vocab_parallel_lm_head": refused("decides whether the LM head and the loss split over the "
                                                      "vocabulary; fp8dist leaves it to DeepSpeed (unset: as the "
                                                      "model's HF tp_plan says, runtime/engine.py)", "remove it"),
    "tensor_parallel.vocab_parallel_ce_backend": no_effect("the kernel of the vocabulary-parallel loss (torch or "
                                                           "Liger): the same loss", example="liger"),
    "tensor_parallel.dtype": no_effect(f"{_AUTOTP_TRAINING}; the bf16 / fp16 section decides the weights' dtype",
                                       example="bfloat16"),
    "tensor_parallel.replace_with_kernel_inject": no_effect(f"inference kernel injection, {_AUTOTP_TRAINING}"),
    "tensor_parallel.kernel_inject": no_effect(f"inference kernel injection, {_AUTOTP_TRAINING}"),
    "zero_optimization.mics_shard_size": refused("MiCS partitions within groups of this size: a layout fp8dist does "
                                                 "not run (its hybrid is ZeRO-3 + ZeRO++ hpZ)", "use "
                                                 "zero_hpz_partition_size (parallel.sharding: hybrid) instead",
                                                 unless=lambda v: one_or_unset(v) or v == -1, otherwise="off",
                                                 example=4),
    "scheduler": no_effect("fp8dist builds no learning-rate schedule; your script's scheduler is used",
                           example={"type": "WarmupLR"}),
    "zero_allow_untested_optimizer": no_effect("fp8dist writes it itself when its optimizer needs it"),
    "zero_force_ds_cpu_optimizer": no_effect("fp8dist writes it itself when its optimizer needs it", example=False),
    **{key: kept(_EXTRA, example={"enabled": True}) for key in (
        "wall_clock_breakdown", "memory_breakdown", "dump_state", "flops_profiler", "comms_logger", "comms_config",
        "tensorboard", "wandb", "csv_monitor", "comet", "monitor_config", "aio", "checkpoint",
        "activation_checkpointing", "prescale_gradients", "gradient_predivide_factor", "gradient_allreduce_op",
        "dataloader_drop_last", "disable_allgather", "disable_python_gc", "log_level", "timers",
        "seq_parallel_communication_data_type", "sparse_gradients", "sparse_attention", "elasticity", "autotuning",
        "data_efficiency", "curriculum_learning", "compile", "use_node_local_storage", "load_universal_checkpoint",
        "nebula", "hybrid_engine", "eigenvalue", "progressive_layer_drop", "managed_gradient_accumulation",
        "vocabulary_size", "use_data_before_expert_parallelism", "checkpoint_config", "datastates")},
}, unknown_why="not a key DeepSpeed 0.19.8 reads (runtime/config.py), so DeepSpeed ignores it too")
_OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "sgd": "sgd"}
# DeepSpeed 0.19.8 runtime/engine.py `_configure_basic_optimizer`: type Adam runs AdamW's decoupled weight decay
# unless params.adam_w_mode is false (ADAM_W_MODE_DEFAULT = True, runtime/config.py); type AdamW always does.
# `torch_adam` picks torch's implementation over FusedAdam / DeepSpeedCPUAdam: the same update.


@dataclass
class AutoContext:
    """What fills "auto": the launching tool's settings where known (None: not known; then the fill of Accelerate 1.15
    and the HF Trainer where both agree, said in a note, and a refusal for the precision)."""

    who: str = "the launcher (Accelerate or the HF Trainer)"
    mixed_precision: str | None = None  # no | bf16 | fp16 | fp8
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    lr: float | None = None
    weight_decay: float | None = None
    betas: list | None = None
    eps: float | None = None
    # True: the values come from `fp8dist import` flags (Launcher), not from a file of the launching tool
    from_flags: bool = False

    @classmethod
    def of_launch(cls, launcher: Launcher, who: str = "the launcher (Accelerate or the HF Trainer)") -> "AutoContext":
        """The context of a DeepSpeed JSON that the launch command fills (a bare JSON, or an Accelerate config's)."""
        return cls(who=who, mixed_precision=launcher.mixed_precision,
                   micro_batch_size=launcher.per_device_train_batch_size,
                   gradient_accumulation_steps=launcher.gradient_accumulation_steps, lr=launcher.learning_rate,
                   from_flags=True)

    def setting(self, flag_field: str | None, value: Any) -> str:
        """Where a known value came from, for a note."""
        if self.from_flags:  # a launch knows only the values its flags give (of_launch): this one has its flag
            return f"{LAUNCHER_FLAGS[cast(str, flag_field)]} {value}"
        return f"{self.who}'s own setting"


def convert(document: dict[str, Any], text: str, source: str, launcher: Launcher = Launcher()) -> Imported:
    notes = Notes()
    return Imported("deepspeed", convert_config(document, source, notes, AutoContext.of_launch(launcher)), notes)


def convert_config(config: Mapping[str, Any], source: str, notes: Notes, ctx: AutoContext,
                   prefix: str = "") -> dict[str, Any]:
    """The fp8dist document for DeepSpeed config `config`; notes name keys as `prefix + key`."""
    importer = _Importer(copy.deepcopy(dict(config)), source, notes, ctx, prefix)
    return importer.run()


class _Importer:
    def __init__(self, config: dict[str, Any], source: str, notes: Notes, ctx: AutoContext, prefix: str):
        self.config, self.source, self.notes, self.ctx, self.prefix = config, source, notes, ctx, prefix
        self.doc: dict[str, Any] = {"engine": "deepspeed"}
        self.extra: dict[str, Any] = {}
        self.issues: list[Issue] = []

    def key(self, dotted: str) -> str:
        return f"{self.prefix}{dotted}"

    def run(self) -> dict[str, Any]:
        self._precision()
        self._zero()
        self._tensor_parallel()
        self._expert_parallel()
        self._train()
        self._pipeline()
        self._optimizer()
        for key, value in self.config.items():  # the rest: DeepSpeed's own keys go to extra, the others by the rule
            rule = KEYS.rule(key)
            if rule is not None and rule.cls is KeyClass.KEPT:
                self._keep(key, value)
            else:
                KEYS.settle(key, value, self.notes, self.issues, shown=self.key(key))
        if self.extra:
            set_path(self.doc, "deepspeed.extra", self.extra)
        if self.issues:
            raise ImportProblem(self.issues, self.source, "deepspeed", self.doc)
        return self.doc

    def _keep(self, dotted: str, value: Any) -> None:
        """A raw DeepSpeed key into deepspeed.extra, with every "auto" inside it resolved or left out."""
        if isinstance(value, dict):
            for sub, inner in value.items():
                self._keep(f"{dotted}.{sub}", inner)
            return
        if value == "auto":
            if dotted in ACCELERATE_HIDDEN_SIZE_AUTO:
                default = ZERO_DEFAULTS[dotted.split(".")[-1]]
                self.notes.auto(self.key(dotted), ACCELERATE_HIDDEN_SIZE_AUTO[dotted],
                                f"{self.ctx.who} fills it from the model at prepare; not kept, so DeepSpeed's default "
                                f"{default} applies: write a number in deepspeed.extra to keep it")
            elif dotted == "zero_optimization.stage3_gather_16bit_weights_on_model_save":
                self.notes.auto(self.key(dotted), False, f"{self.ctx.who}'s fill (accelerator.py _prepare_deepspeed)")
                set_path(self.extra, dotted, False)
            else:
                self.notes.dropped(self.key(dotted), value,
                                   "\"auto\" that fp8dist cannot resolve; DeepSpeed's default applies")
            return
        set_path(self.extra, dotted, value)

    # -- precision ------------------------------------------------------------------------------------------
    def _launched(self, blocks: dict[str, Any]) -> dict[str, Any] | None:
        """The bf16 / fp16 sections as the launch leaves them, or None (a problem was added). With the launch's mixed
        precision known, what accelerate 1.15 utils/dataclasses.py DeepSpeedPlugin.set_mixed_precision does (the
        HF Trainer's Accelerator runs it too; transformers 5.24 integrations/deepspeed.py trainer_config_process
        fills "auto" alike): "auto" becomes fp16.enabled = (fp16), bf16.enabled = (bf16 or fp8); a missing section
        of that dtype is added; the other 16-bit dtype enabled in the file is refused. Unknown: the file as DeepSpeed
        reads it, and an "auto" precision refused, since it may run in fp32, fp16 or bf16."""
        mixed, who = self.ctx.mixed_precision, self.ctx.who
        autos = [name for name, block in blocks.items() if block is not None and block.get("enabled") == "auto"]
        if mixed is None:
            if autos:
                self.issues.append(Issue(
                    self.key(f"{autos[0]}.enabled"), f"\"auto\" ({' and '.join(f'{n}.enabled' for n in autos)}): the "
                    "launcher fills it with the precision it is started with (accelerate launch --mixed_precision; "
                    "the HF Trainer's bf16 / fp16 arguments), which this file does not say, so the run may be fp32, "
                    "fp16 or bf16", "auto", "pass the precision you launch with: fp8dist import FILE --mixed-precision "
                    "no|fp16|bf16 (Accelerate's flag; bf16 for TrainingArguments(bf16=True))"))
                return None
            return blocks
        wanted = {"bf16": mixed in ("bf16", "fp8"), "fp16": mixed == "fp16"}
        where = (self.ctx.setting("mixed_precision", mixed) if self.ctx.from_flags
                 else f"{who}'s mixed precision {mixed}")
        if mixed != "no":
            other = "bf16" if mixed == "fp16" else "fp16"
            if blocks[other] is not None and str(blocks[other].get("enabled")).lower() == "true":
                self.issues.append(Issue(self.key(f"{other}.enabled"), f"enabled, while the launch runs {mixed} "
                                         f"({where}): Accelerate refuses that (\"`--mixed_precision` arg cannot be set "
                                         f"to `{mixed}` when `{other}` is set in the DeepSpeed config file\", "
                                         "utils/dataclasses.py DeepSpeedPlugin.set_mixed_precision)", True,
                                         f"set {other}.enabled to \"auto\" or false, or launch with {other}"))
                return None
        for name in ("bf16", "fp16"):
            if blocks[name] is None and wanted[name]:
                blocks[name] = {"enabled": True, "auto_cast": True} if name == "fp16" else {"enabled": True}
                self.notes.resolved(self.key(name), blocks[name], f"the file has no {name} section and {where} asks "
                                    "for it: Accelerate adds it (DeepSpeedPlugin.set_mixed_precision)")
            elif name in autos:
                blocks[name] = {**blocks[name], "enabled": wanted[name]}
                self.notes.auto(self.key(f"{name}.enabled"), wanted[name], f"{where}: Accelerate and the HF Trainer "
                                f"fill {name}.enabled with it (DeepSpeedPlugin.set_mixed_precision, transformers "
                                "integrations/deepspeed.py trainer_config_process); DeepSpeed alone would read false")
            elif blocks[name] is not None and self.ctx.from_flags and bool(truthy(blocks[name].get("enabled"))) \
                    != wanted[name]:
                self.notes.resolved(self.key(f"{name}.enabled"), blocks[name].get("enabled"), f"written in the file: "
                                    f"{where} fills only \"auto\" under Accelerate (the HF Trainer refuses the "
                                    "mismatch)")
        return blocks

    def _precision(self) -> str | None:
        c = self.config
        precision: dict[str, Any] = {}
        if "bfloat16" in c and "bf16" not in c:
            c["bf16"] = c.pop("bfloat16")
        bf16, fp16 = (mapping(c[k], self.key(k)) if k in c else None for k in ("bf16", "fp16"))
        autocast = mapping(c.get("torch_autocast"), self.key("torch_autocast"))  # {}: left out
        for key in ("bf16", "fp16", "torch_autocast"):
            c.pop(key, None)
        launched = self._launched({"bf16": bf16, "fp16": fp16})
        if launched is None:
            return None
        bf16, fp16 = launched["bf16"], launched["fp16"]
        on = [name for name, block in launched.items() if block is not None and truthy(block.get("enabled", False))]
        autocast_on = bool(truthy(autocast.get("enabled", False)))
        if len(on) > 1:
            self.issues.append(Issue(self.key("bf16"), "both bf16 and fp16 are enabled; DeepSpeed refuses that",
                                     fix="enable only one of bf16, fp16"))
            return None
        if on and autocast_on:
            # DeepSpeed >= 0.18.3 runs torch_autocast next to a 16-bit section
            # (facts.deepspeed.DS_AUTOCAST_WITH_BF16): the weights are in the section's dtype, the forward autocasts to
            # torch_autocast.dtype (fp16 when left out).
            dtype = dtype_name(autocast.get("dtype")) or "fp16"
            if dtype != on[0]:
                self.issues.append(Issue(self.key("torch_autocast.dtype"), f"autocasts the forward of {on[0]} weights "
                                         f"to {dtype}" + (" (DeepSpeed's default on CUDA, the key is left out)"
                                                          if autocast.get("dtype") is None else "") +
                                         ": a compute dtype other than the weights', which fp8dist does not run",
                                         autocast.get("dtype"),
                                         f"set torch_autocast.dtype to {dtypes.torch_name(on[0])} (the section's "
                                         "dtype), or remove torch_autocast"))
                return None
            self.notes.resolved(self.key("torch_autocast"), f"the {on[0]} section", f"autocasting {on[0]} weights to "
                                f"{dtype} changes no compute dtype")
            autocast, autocast_on = {}, False
        section = on[0] if on else None
        comm_raw = c.pop("communication_data_type", None)
        comm = dtype_name(comm_raw)
        if comm_raw is not None and comm is None:
            self.issues.append(Issue(self.key("communication_data_type"), "not a dtype fp8dist knows", comm_raw,
                                     "use fp32, bf16 or fp16"))
        if section == "bf16":
            precision.update(mixed_precision="bf16", load_dtype="bf16")
            precision["master_weights"] = "bf16" if truthy(bf16.get("bf16_master_weights_and_grads")) else "fp32"
            if truthy(bf16.get("bf16_optimizer_states")):
                set_path(self.doc, "optimizer.state_dtype", "bf16")
            self._rest("bf16", bf16, ("enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states"))
        elif section == "fp16":
            precision.update(mixed_precision="fp16", load_dtype="fp32")
            precision["master_weights"] = "fp16" if truthy(fp16.get("fp16_master_weights_and_grads")) else "fp32"
            scaling = {k: fp16[k] for k in FP16_DEFAULTS if k in fp16 and fp16[k] != "auto"}
            for k in FP16_DEFAULTS:
                if fp16.get(k) == "auto":
                    self.notes.auto(self.key(f"fp16.{k}"), FP16_DEFAULTS[k], "DeepSpeed's default")
            if scaling:
                precision["loss_scaling"] = scaling
            self._rest("fp16", fp16, ("enabled", "fp16_master_weights_and_grads", *FP16_DEFAULTS))
        elif autocast_on:
            forward_dtype = dtype_name(autocast.get("dtype"))
            if forward_dtype is None or forward_dtype == "fp32":
                forward_dtype = "fp16"
                self.notes.resolved(self.key("torch_autocast.dtype"), forward_dtype, "left out: DeepSpeed autocasts to "
                                    "fp16 on CUDA (runtime/torch_autocast.py)")
            load = comm or "fp32"
            precision.update(mixed_precision=forward_dtype, master_weights="none", load_dtype=load)
            if autocast.get("lower_precision_safe_modules") != []:
                self.notes.dropped(self.key("torch_autocast.lower_precision_safe_modules"),
                                   autocast.get("lower_precision_safe_modules", "DeepSpeed's default list"),
                                   f"fp8dist reduces every gradient in the weights' dtype ({load}) and writes []; "
                                   "DeepSpeed's list would reduce those modules' gradients in the autocast dtype")
        else:
            load = comm or "fp32"
            precision.update(mixed_precision="none", master_weights="none", load_dtype=load)
            if autocast:
                self.notes.dropped(self.key("torch_autocast"), autocast, "not enabled")
        for name, block in (("bf16", bf16), ("fp16", fp16)):
            if block is not None and name != section and isinstance(block, dict) and len(block) > 1:
                self.notes.dropped(self.key(name), block, "the section is not enabled")
        if comm is None:
            comm = default_communication(section)
            if section or precision["mixed_precision"] != "none":
                self.notes.resolved(self.key("communication_data_type"), comm, "left out: DeepSpeed reduces in the "
                                    "16-bit section's dtype, else fp32 (runtime/engine.py communication_data_type)")
        precision["reduce_dtype"] = comm
        data_types = mapping(c.pop("data_types", None), self.key("data_types"))
        if data_types:
            accum = dtype_name(data_types.pop("grad_accum_dtype", None))
            if accum:
                set_path(self.doc, "deepspeed.grad_accum_dtype", accum)
            for key, value in data_types.items():
                self._keep(f"data_types.{key}", value)
        msamp = mapping(c.pop("msamp", None), self.key("msamp"))
        if truthy(msamp.get("enabled", False)):
            precision["fp8"] = {"backend": "msamp", "msamp": {"opt_level": msamp.get("opt_level", "O1"),
                                                              "use_te": bool(truthy(msamp.get("use_te", False)))}}
            if "opt_level" not in msamp:
                self.notes.resolved(self.key("msamp.opt_level"), "O1", "left out: MS-AMP's default")
        self.doc["precision"] = precision
        return section

    def _rest(self, name: str, block: dict[str, Any], known: tuple) -> None:
        for key, value in block.items():
            if key not in known:
                self._keep(f"{name}.{key}", value)

    # -- ZeRO -----------------------------------------------------------------------------------------------
    def _zero(self) -> None:
        zero = mapping(self.config.pop("zero_optimization", None), self.key("zero_optimization"))
        for key in list(zero):
            rule = KEYS.rule(f"zero_optimization.{key}")
            if rule is not None and rule.cls is KeyClass.REFUSED:
                KEYS.settle(f"zero_optimization.{key}", zero.pop(key), self.notes, self.issues,
                            shown=self.key(f"zero_optimization.{key}"))
        if "cpu_offload" in zero:  # DeepSpeed's old spelling of offload_optimizer: {device: cpu}
            legacy = zero.pop("cpu_offload")
            if truthy(legacy) and "offload_optimizer" not in zero:
                zero["offload_optimizer"] = {"device": "cpu"}
                self.notes.resolved(self.key("zero_optimization.cpu_offload"), "offload_optimizer: {device: cpu}",
                                    "DeepSpeed's old name for optimizer offload to the CPU (runtime/zero/config.py)")
            elif truthy(legacy):
                self.notes.dropped(self.key("zero_optimization.cpu_offload"), legacy, "offload_optimizer decides")
        stage = zero.pop("stage", 0)
        if stage not in (0, 1, 2, 3):
            self.issues.append(Issue(self.key("zero_optimization.stage"), "not a ZeRO stage", stage,
                                     "use 0, 1, 2 or 3"))
            return
        hpz = zero.pop("zero_hpz_partition_size", 1)
        if stage == 3 and isinstance(hpz, int) and hpz > 1:
            set_path(self.doc, "parallel.sharding", "hybrid")
            set_path(self.doc, "parallel.shard_size", hpz)
        elif stage in SHARDING_OF_STAGE:
            set_path(self.doc, "parallel.sharding", SHARDING_OF_STAGE[stage])
        else:
            set_path(self.doc, "deepspeed.zero_stage", stage)  # ZeRO-1 has no engine-agnostic name
        devices = []
        for name in ("offload_optimizer", "offload_param"):
            block = mapping(zero.pop(name, None), self.key(f"zero_optimization.{name}"))
            device = str(block.pop("device", "none")).lower()
            nvme = block.pop("nvme_path", None)
            devices.append(device)
            if device == "nvme":
                set_path(self.doc, "deepspeed.nvme_path", nvme)
            if device == "none":
                if block:
                    self.notes.dropped(self.key(f"zero_optimization.{name}"), block, "no offload device")
                continue
            for key, value in block.items():
                self._keep(f"zero_optimization.{name}.{key}", value)
        pair = tuple(devices)  # (optimizer's, parameters')
        if pair in OFFLOAD_OF_DEVICES:
            if pair != ("none", "none"):
                set_path(self.doc, "parallel.offload", OFFLOAD_OF_DEVICES[pair])
        else:
            set_path(self.doc, "deepspeed.offload_optimizer", pair[0])
            set_path(self.doc, "deepspeed.offload_param", pair[1])
        for key, value in zero.items():
            self._keep(f"zero_optimization.{key}", value)

    # -- tensor parallel (AutoTP) ----------------------------------------------------------------------------
    def _tensor_parallel(self) -> None:
        """tensor_parallel.autotp_size -> parallel.tensor_size; the section's other keys by their rules
        (tensor_parallel.KEY in KEYS; DeepSpeed refuses a key its typed section does not have)."""
        if "tensor_parallel" not in self.config:
            return
        section = mapping(self.config.pop("tensor_parallel"), self.key("tensor_parallel"))
        autotp = section.pop("autotp_size", None)
        # 0 is DeepSpeed's own default: AutoTP off (TPTrainingConfig.autotp_size)
        size = 1 if autotp in (0, "0") else parallel_size(autotp, self.key("tensor_parallel.autotp_size"))
        if size > 1:
            set_path(self.doc, "parallel.tensor_size", size)
        for spelling in ("tp", "tensor_parallel"):  # TPConfig's alias and its field name (populate_by_name)
            tp = mapping(section.pop(spelling, None), self.key(f"tensor_parallel.{spelling}"))
            if tp.get("tp_size") is not None:
                shown = self.key(f"tensor_parallel.{spelling}.tp_size")
                value = tp.pop("tp_size")
                degree = parallel_size(value, shown)
                if degree in (1, size):
                    self.notes.dropped(shown, value, "the same degree as autotp_size" if degree == size else
                                       "DeepSpeed sets it to autotp_size's degree (runtime/engine.py)")
                else:
                    rule = KEYS.rules["tensor_parallel.tp.tp_size"]
                    self.issues.append(Issue(shown, rule.why, value, rule.fix))
            for key, value in tp.items():
                self._tensor_parallel_key(f"tp.{key}", value, f"{spelling}.{key}")
        for key, value in section.items():
            self._tensor_parallel_key(key, value, key)

    def _tensor_parallel_key(self, key: str, value: Any, written: str) -> None:
        """`tensor_parallel.key` (as `tensor_parallel.written` in the file) by its rule: kept keys to
        deepspeed.extra, which DeepSpeed reads as written."""
        rule, shown = KEYS.rule(f"tensor_parallel.{key}"), self.key(f"tensor_parallel.{written}")
        if rule is None and value is not None:
            self.issues.append(Issue(shown, "not a key of DeepSpeed 0.19.8's tensor_parallel section, which refuses "
                                     "unknown keys (runtime/tensor_parallel/config.py, DeepSpeedConfigModel extra="
                                     "'forbid')", value, "remove it, or correct its name"))
        elif rule is not None and rule.cls is KeyClass.KEPT:
            self._keep(f"tensor_parallel.{written}", value)
        else:
            KEYS.settle(f"tensor_parallel.{key}", value, self.notes, self.issues, shown=shown)

    # -- expert parallel (AutoEP) ------------------------------------------------------------------------------
    def _expert_parallel(self) -> None:
        """expert_parallel enabled with autoep_size > 1 -> parallel.expert_size; the section's other keys by their
        rules (expert_parallel.KEY in KEYS). DeepSpeed reads `enabled` as a truth value (parse_autoep_config), and
        an enabled AutoEP swaps the MoE layers for its own even at autoep_size 1, where nothing is split: fp8dist then
        keeps the model's layers, said in a note, as it says a section that is off."""
        if "expert_parallel" not in self.config:
            return
        section = mapping(self.config.pop("expert_parallel"), self.key("expert_parallel"))
        if not section.get("enabled"):
            if section:
                self.notes.dropped(self.key("expert_parallel"), section, "not enabled: DeepSpeed runs no AutoEP")
            return
        size = parallel_size(section.get("autoep_size"), self.key("expert_parallel.autoep_size"))
        if size == 1:
            self.notes.dropped(self.key("expert_parallel"), section, "autoep_size 1 splits no experts; DeepSpeed would "
                               "still swap each MoE layer for its AutoEPMoELayer (the same routing and experts), "
                               "fp8dist keeps the model's own")
            return
        set_path(self.doc, "parallel.expert_size", size)
        for key, value in section.items():
            if key in ("enabled", "autoep_size"):
                continue
            rule = KEYS.rule(f"expert_parallel.{key}")
            if rule is not None and rule.cls is KeyClass.KEPT:
                self._keep(f"expert_parallel.{key}", value)
            else:
                KEYS.settle(f"expert_parallel.{key}", value, self.notes, self.issues,
                            shown=self.key(f"expert_parallel.{key}"))

    # -- pipeline (DeepSpeed's PipelineEngine) -----------------------------------------------------------------
    def _pipeline(self) -> None:
        """The pipeline section key by key (pipeline.KEY in KEYS): a stage count above 1 refused, with the fp8dist
        keys of the same pipeline in the fix (train already imported: the micro batch and the accumulation that
        DeepSpeed's PipelineEngine runs as its micro-batches); the others noted. In a JSON another tool's file names
        (a prefix: Accelerate, Axolotl, TRL) the whole section is noted: the HF Trainer and Accelerate call the
        engine's forward / backward / step, which a PipelineEngine refuses outside train_batch (deepspeed 0.19.8
        runtime/pipe/engine.py PipelineError), so their runs build none."""
        if "pipeline" not in self.config:
            return
        section = mapping(self.config.pop("pipeline"), self.key("pipeline"))
        if not section:
            KEYS.settle("pipeline", section, self.notes, self.issues, shown=self.key("pipeline"))
            return
        if self.prefix:
            self.notes.dropped(self.key("pipeline"), section, f"{self.ctx.who} trains through DeepSpeedEngine, "
                               "never DeepSpeed's PipelineEngine (its forward, backward and step raise PipelineError "
                               "outside train_batch: runtime/pipe/engine.py), so the section changes nothing")
            return
        for key, value in section.items():
            rule, shown = KEYS.rule(f"pipeline.{key}"), self.key(f"pipeline.{key}")
            if key == "stages" and rule is not None and value is not None and not cast(Any, rule.unless)(value):
                train = self.doc.get("train", {})
                micro, accum = train.get("micro_batch_size"), train.get("gradient_accumulation_steps")
                fix = rule.fix
                if isinstance(micro, int) and isinstance(accum, int):
                    fix = (f"write engine: fsdp2 with parallel.pipeline_size: {value}, parallel.pipeline_microbatches: "
                           f"{accum} and train.micro_batch_size: {micro * accum}, gradient_accumulation_steps: 1 "
                           f"(DeepSpeed's PipelineEngine runs gradient_accumulation_steps {accum} micro-batches of "
                           f"{micro} a step); or remove the pipeline section")
                self.issues.append(Issue(shown, rule.why, value, fix))
            else:
                KEYS.settle(f"pipeline.{key}", value, self.notes, self.issues, shown=shown)

    # -- batch, clipping, optimizer -------------------------------------------------------------------------
    def _launch_value(self, key: str, value: Any, flag_field: str | None, known: Any, fallback: Any, why: str) -> Any:
        """`value` of `key` as the launch leaves it: "auto" filled with the launch's own value (`known`), else with
        `fallback`, said with `why`. A value the launch command gives (an `fp8dist import` flag, `flag_field`) fills a
        key the file leaves out too, and contradicting a value written in the file is refused, as the HF Trainer
        refuses it (transformers 5.24 integrations/deepspeed.py HfTrainerDeepSpeedConfig.fill_match)."""
        # the launch flag that gave `known`, when one did
        flag = flag_field if self.ctx.from_flags and known is not None else None
        if value == "auto":
            resolved = known if known is not None else fallback
            self.notes.auto(self.key(key), resolved, self.ctx.setting(flag_field, known) if known is not None else why)
            return resolved
        if flag is not None and value is None:
            self.notes.resolved(self.key(key), known, f"left out of the file: {self.ctx.setting(flag, known)}")
            return known
        if flag is not None and value != known:
            self.issues.append(Issue(self.key(key), f"written in the file, while {self.ctx.setting(flag, known)} "
                                     "launches with another value: the HF Trainer refuses that mismatch "
                                     "(transformers integrations/deepspeed.py fill_match)", value,
                                     f"write \"auto\" there (or {known}), or launch and import without "
                                     f"{LAUNCHER_FLAGS[flag]}"))
        return value

    def _value(self, key: str, flag_field: str | None, known: Any, fallback: Any, why: str) -> Any:
        return self._launch_value(key, self.config.pop(key, None), flag_field, known, fallback, why)

    def _train(self) -> None:
        ctx, train = self.ctx, {}
        written = {key: self.config.get(key) not in (None, "auto") for key in
                   ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")}
        micro = self._value("train_micro_batch_size_per_gpu", "per_device_train_batch_size", ctx.micro_batch_size, 2,
                            f"{ctx.who} fills it with the launch's batch per rank (the HF Trainer's "
                            "per_device_train_batch_size, Accelerate's DataLoader batch_size), which the file does not "
                            "say: fp8dist's default 2 kept; pass --per-device-train-batch-size N")
        accum = self._value("gradient_accumulation_steps", "gradient_accumulation_steps",
                            ctx.gradient_accumulation_steps, ACCELERATE_AUTO["gradient_accumulation_steps"],
                            "the default of both the HF Trainer and Accelerate (gradient_accumulation_steps 1); pass "
                            "--gradient-accumulation-steps N if you launch with another")
        batch = self.config.pop("train_batch_size", None)
        self._batch_triangle(written, micro, accum, batch)
        if micro is not None and accum is None and not written["gradient_accumulation_steps"]:
            accum = 1
            self.notes.resolved(self.key("gradient_accumulation_steps"), 1, "left out: DeepSpeed's default with a "
                                "micro batch (runtime/config.py _set_batch_related_parameters)")
        clip = self._value("gradient_clipping", None, ctx.gradient_clipping,
                           ACCELERATE_AUTO["gradient_clipping"], "the HF Trainer fills its max_grad_norm "
                           "(default 1.0), Accelerate 1.0 (accelerator.py _prepare_deepspeed): edit "
                           "train.gradient_clipping if your launch clips at another norm")
        if clip is None and ctx.gradient_clipping is None:
            clip = 1.0
            self.notes.resolved(self.key("gradient_clipping"), 1.0, "left out: DeepSpeed's default since "
                                f"{fmt(DS_CLIPPING_DEFAULT_CHANGED)} (0.0, no clipping, before it)")
        elif clip is None:
            clip = ctx.gradient_clipping
        for key, value in (("micro_batch_size", micro), ("gradient_accumulation_steps", accum),
                           ("gradient_clipping", clip)):
            if value is not None:
                train[key] = value
        if train:
            self.doc["train"] = train
        steps = self.config.pop("steps_per_print", None)
        if isinstance(steps, (int, float)) and not isinstance(steps, bool) and steps >= 1 and float(steps).is_integer():
            set_path(self.doc, "deepspeed.steps_per_print", int(steps))
        elif steps is not None:
            self.notes.dropped(self.key("steps_per_print"), steps, "not a positive whole number (only logging)")

    def _batch_triangle(self, written: dict[str, bool], micro: Any, accum: Any, batch: Any) -> None:
        """DeepSpeed's batch triangle, train_batch_size = micro batch x accumulation x world size
        (runtime/config.py _set_batch_related_parameters): fp8dist keeps the micro batch and accumulation, which give
        the same global batch on any number of ranks. A train_batch_size without both depends on the world size."""
        if batch is None or batch == "auto":
            if batch == "auto":
                self.notes.auto(self.key("train_batch_size"), "micro batch x accumulation x world size",
                                f"{self.ctx.who} fills it so")
            elif not written["train_micro_batch_size_per_gpu"] and micro is None:
                self.notes.resolved("train.micro_batch_size", 2, "the file sets no batch size (DeepSpeed needs "
                                    "train_batch_size or train_micro_batch_size_per_gpu; the launching tool fills "
                                    "them): fp8dist's default; set train.micro_batch_size and "
                                    "train.gradient_accumulation_steps to your run's")
            return
        if written["train_micro_batch_size_per_gpu"] and written["gradient_accumulation_steps"]:
            self.notes.resolved(self.key("train_batch_size"), "micro batch x accumulation x world size",
                                f"{batch} in the file: DeepSpeed checks it equals that product at launch")
        elif micro is not None and accum is not None and not written["train_micro_batch_size_per_gpu"] \
                and not written["gradient_accumulation_steps"]:
            self.notes.resolved(self.key("train_batch_size"), "micro batch x accumulation x world size",
                                f"{batch} in the file: {self.ctx.who} derives it from its own settings")
        else:
            missing = [k for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if not written[k]]
            self.issues.append(Issue(self.key("train_batch_size"), "without " + " and ".join(missing) + " DeepSpeed "
                                     "divides it by the world size at launch, so the micro batch depends on how many "
                                     "ranks run; fp8dist fixes the micro batch and accumulation instead", batch,
                                     "write train_micro_batch_size_per_gpu and gradient_accumulation_steps (their "
                                     "product x the world size is the global batch)"))

    def _optimizer(self) -> None:
        if "optimizer" not in self.config:
            if self.ctx.from_flags and self.ctx.lr is not None:
                set_path(self.doc, "optimizer.lr", self.ctx.lr)
                self.notes.resolved("optimizer.lr", self.ctx.lr, "the file has no optimizer section (your script "
                                    f"builds it): {self.ctx.setting('learning_rate', self.ctx.lr)}")
            return
        block = mapping(self.config.pop("optimizer"), self.key("optimizer"))
        kind = str(block.get("type", "")).lower()
        if kind not in _OPTIMIZERS:
            self.issues.append(Issue(self.key("optimizer.type"), "fp8dist builds AdamW, Adam or SGD (torch.optim) "
                                     "itself; it has no equivalent of this DeepSpeed optimizer", block.get("type"),
                                     "set the type to AdamW, Adam or SGD, or remove the optimizer section"))
            return
        ctx = self.ctx
        out: dict[str, Any] = {"name": _OPTIMIZERS[kind]}
        params = dict(mapping(block.get("params"), self.key("optimizer.params")))
        if kind == "adam" and "adam_w_mode" in params and not truthy(params["adam_w_mode"]):
            out["name"] = "adam"
        why = "fp8dist builds it (a torch.optim client optimizer) instead of DeepSpeed"
        if kind == "adam":
            why += ("; DeepSpeed's type Adam is AdamW (decoupled weight decay) unless adam_w_mode is false "
                    "(runtime/engine.py _configure_basic_optimizer)")
        self.notes.resolved(self.key("optimizer"), f"optimizer.name={out['name']}", why)
        for key, torch_default in (("bias_correction", True), ("amsgrad", False)):
            if key not in params:
                continue
            value = params.pop(key)
            if bool(truthy(value)) != torch_default:
                self.issues.append(Issue(self.key(f"optimizer.params.{key}"), "another update than the torch.optim "
                                         "optimizer fp8dist builds, which has no setting for it", value,
                                         f"remove optimizer.params.{key} (torch's {key}={torch_default})"))
            else:
                self.notes.dropped(self.key(f"optimizer.params.{key}"), value, "torch's own, the update fp8dist builds")
        if kind in ("adam", "adamw"):
            for key in ("adam_w_mode", "torch_adam"):
                if key in params:
                    self.notes.dropped(self.key(f"optimizer.params.{key}"), params.pop(key),
                                       "kept as optimizer.name" if key == "adam_w_mode" else
                                       "which implementation steps (torch's or DeepSpeed's fused Adam): the same "
                                       "update")
        lr = ACCELERATE_AUTO["optimizer.params.lr"]
        fills = {"lr": ("learning_rate", ctx.lr, lr, f"the launch's learning rate, which the file does not say: "
                        f"Accelerate's DummyOptim default {lr} kept (the HF Trainer's learning_rate defaults to 5e-5, "
                        "transformers 5.24 training_args.py); pass --learning-rate LR"),
                 "weight_decay": (None, ctx.weight_decay, ACCELERATE_AUTO["optimizer.params.weight_decay"],
                                  "the default of both the HF Trainer (weight_decay) and Accelerate (DummyOptim)"),
                 "betas": (None, ctx.betas, [0.9, 0.999], "the HF Trainer's adam_beta1 / adam_beta2 defaults, "
                           "torch's"),
                 "eps": (None, ctx.eps, 1e-8, "the HF Trainer's adam_epsilon default, torch's")}
        for key, (flag_field, known, fallback, why) in fills.items():
            if key not in params and not (flag_field and ctx.from_flags and known is not None):
                continue
            value = self._launch_value(f"optimizer.params.{key}", params.pop(key, None), flag_field, known, fallback,
                                       why)
            out[key] = list(value) if key == "betas" else value
        for key, value in params.items():
            self.notes.dropped(self.key(f"optimizer.params.{key}"), value, "no fp8dist optimizer setting")
        self.doc["optimizer"] = {**self.doc.get("optimizer", {}), **out}
