"""Spec -> FSDP2 plan: a frozen, typed `FSDP2Plan` whose `to_json()` is the JSON `fp8dist translate --to fsdp2`
writes (tests/golden pins it). Pure: no torch import.

The plan is what `fp8dist.engines.fsdp2.prepare` executes, in this order (torchtitan, Accelerate):
upcast to the master dtype -> float8 conversion -> activation checkpointing -> torch.compile per block ->
fully_shard each block, then the root, on the mesh of `parallel.sharding` -> materialise and load (RAM-
efficient loading) -> the optimizer, with the step post-hook that precomputes float8 scales and, for fp16
compute, the loss scaler.

The float8 part (`float8_plan`) is typed too: the torchao backend reads it under either engine and the audit reads
its module filter; the DeepSpeed JSON never carries it (DeepSpeed has no FP8 key: translate/deepspeed.py
left_to_runtime).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from fp8dist.config.parallel import CP, TP, pipeline_microbatches, pipeline_stages_per_rank, sequence_parallel
from fp8dist.config.spec import Dtype, Spec, min_speedup_number, min_speedup_of
from fp8dist.errors import ConfigError, Issue
from fp8dist.facts import versions
from fp8dist.facts.torch import PIPELINE_SCHEDULES
from fp8dist.facts.torchao import NEWEST_KNOWN_TORCHAO, TORCHAO_MX_BLOCK, torchao_force_recompute
from fp8dist.facts.transformer_engine import (TE_NEWEST_KNOWN, TE_OLDEST_SUPPORTED, TE_RECIPES, te_field_kept,
                                              te_recipe_available, te_supported)
from fp8dist.facts.versions import Version, fmt, parse_version

# The plan's enumerations (tests/unit/translate/test_fsdp2_plan.py keeps those that come from the config in step with
# schemas/fp8dist.schema.json).
Strategy = Literal["full", "grad_op", "hybrid", "replicate"]
ShardSize = int | Literal["world"]
"""Ranks in one shard group; "world": all of them. A translation does not know the world size: the run's
fp8dist.config.parallel.ParallelDims resolves it on the world it starts on."""
ActivationCheckpointing = Literal["none", "full", "selective"]
StateDtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "fp8+fp16"]  # fp8+fp16: MS-AMP O2/O3 (config/spec.py)
OptimizerClass = Literal["torchao.optim.AdamWFp8", "torchao.optim.AdamW8bit", "torch.optim.AdamW", "torch.optim.Adam",
                         "torch.optim.SGD"]
Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"]
ExpertsMode = Literal["auto", "none", "float8", "mxfp8"]
TERecipe = Literal["delayed", "current", "block", "mxfp8", "nvfp4"]

# torchao's _scaled_mm needs both Linear dims divisible by 16 (torchao/float8/config.py, pad_inner_dim).
FP8_DIM_MULTIPLE = 16

OPTIMIZER_CLASSES: dict[tuple[str, str | None], OptimizerClass] = {
    ("adamw", "fp8"): "torchao.optim.AdamWFp8",
    ("adamw", "int8"): "torchao.optim.AdamW8bit",
    ("adamw", None): "torch.optim.AdamW",
    ("adam", None): "torch.optim.Adam",
    ("sgd", None): "torch.optim.SGD",
}
# parallel.sharding -> the FSDP2 strategy (`auto` is full on FSDP2: config/vocabulary.py's table)
STRATEGIES: dict[str, Strategy] = {"auto": "full", "full": "full", "grad_op": "grad_op", "hybrid": "hybrid",
                                   "replicate": "replicate"}


def _json(value: Any) -> Any:
    if isinstance(value, PlanSection):
        return value.to_json()
    if isinstance(value, tuple):
        return [_json(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _json(item) for key, item in value.items()}
    return value


def _json_key(name: str, **kwargs: Any) -> Any:
    """A field whose JSON key is not its name (`class`, a Python keyword)."""
    return field(metadata={"json": name}, **kwargs)


def _left_out_when(value: Any) -> Any:
    """A field the JSON leaves out while it holds `value` (None or False), its default."""
    return field(default=value, metadata={"left_out_when": value})


@dataclass(frozen=True)
class PlanSection:
    """A part of the plan. `to_json()`: its fields in order, under their JSON keys (field metadata `json`), those
    marked `left_out_when` left out while they hold that value, a field marked `inline` spliced in key by key;
    tuples become lists."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "left_out_when" in f.metadata and value is f.metadata["left_out_when"]:
                continue
            if f.metadata.get("inline"):
                out.update(_json(value))
            else:
                out[f.metadata.get("json", f.name)] = _json(value)
        return out


def target_torchao_version(explicit: str | None = None) -> tuple[Version, str]:
    """The torchao version to plan for, and where that choice came from (like the DeepSpeed target)."""
    if explicit:
        try:
            return parse_version(explicit), "given with --torchao-version"
        except ValueError:
            raise ConfigError([Issue("--torchao-version", "not a version", explicit, "write e.g. 0.18.0")]) from None
    version = versions.installed_version("torchao")
    if version:
        return parse_version(version), "installed"
    return NEWEST_KNOWN_TORCHAO, "newest known (torchao is not installed)"


TE_DISTRIBUTIONS = ("transformer-engine", "transformer_engine")  # the wheel's name; a source build's


def installed_te() -> str | None:
    """The installed Transformer Engine's version, from package metadata (no import)."""
    return next((v for v in map(versions.installed_version, TE_DISTRIBUTIONS) if v), None)


def target_te_version(explicit: str | None = None) -> tuple[Version, str]:
    """The Transformer Engine release to plan the recipe for, and where that choice came from."""
    installed = installed_te()
    if explicit:
        try:
            version, origin, where = parse_version(explicit), "given with --te-version", "--te-version"
        except ValueError:
            raise ConfigError([Issue("--te-version", "not a version", explicit, "write e.g. 2.20.2")]) from None
    elif installed:
        version, origin, where = parse_version(installed), "installed", "transformer-engine (installed)"
    else:
        return TE_NEWEST_KNOWN, "newest known (Transformer Engine is not installed)"
    ok, reason = te_supported(version)
    if not ok:
        raise ConfigError([Issue(where, reason, fmt(version),
                                 f"use Transformer Engine >= {fmt(TE_OLDEST_SUPPORTED)}")])
    return version, origin


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPlan(PlanSection):
    """torch's MixedPrecisionPolicy of every FSDP unit; `output_dtype` is the root's alone (the model outputs): a
    block returning it would hand the next block inputs in another dtype than its weights."""
    param_dtype: Dtype | None  # None: no mixed precision (compute in the stored dtype)
    reduce_dtype: Dtype
    output_dtype: Dtype | None
    cast_forward_inputs: bool


@dataclass(frozen=True, kw_only=True)
class WrapPlan(PlanSection):
    units: Literal["auto"] | tuple[str, ...]  # fsdp2.wrap: the module classes fully_shard wraps one by one
    root: bool = True
    auto_rule: str = "Hugging Face _no_split_modules, else the children of the first nn.ModuleList"


@dataclass(frozen=True, kw_only=True)
class ShardingPlan(PlanSection):
    """The FSDP2 layout of `parallel.sharding` (fsdp2_layout)."""
    strategy: Strategy
    shard_size: ShardSize
    reshard_after_forward: bool
    # The root (embeddings, final norm, output layer) is needed first in backward: kept unsharded after
    # forward, as torch does for the root by default ("For best performance, we usually set False for the
    # root module", torch 2.13 distributed/fsdp/_fully_shard/_fully_shard.py); one all-gather less per step.
    root_reshard_after_forward: bool = False

    tensor_size: int = 1
    context_size: int = 1
    expert_size: int = 1
    pipeline_size: int = 1

    @property
    def mesh(self) -> str:
        """The DeviceMesh, in words (the run builds it: fp8dist.config.parallel.ParallelDims.mesh_shape), and with
        expert parallel the experts' own mesh over the same ranks (ParallelDims.expert_mesh_shape)."""
        dense = self._dense_mesh
        if self.expert_size == 1:
            return dense
        return f"{dense}; experts 2-D (efsdp = world / {self.expert_size}, ep = {self.expert_size})"

    @property
    def _dense_mesh(self) -> str:
        inner = [f"{axis} = {size}" for axis, size in ((CP, self.context_size), (TP, self.tensor_size))
                 if size > 1]
        data = " / ".join(["world"] + [str(size) for size in (self.pipeline_size, self.context_size,
                                                               self.tensor_size) if size > 1])
        outer = [f"pp = {self.pipeline_size}"] if self.pipeline_size > 1 else []
        if self.strategy == "hybrid":
            dims = [f"replicate = {data} / {self.shard_size}", f"shard = {self.shard_size}", *inner]
        elif self.strategy == "replicate":
            dims = [f"replicate = {data}", "shard = 1", *inner]
        elif inner or outer:
            dims = [f"shard = {data}", *inner]
        else:
            return "1-D (shard over all ranks)"
        dims = outer + dims
        return f"{len(dims)}-D ({', '.join(dims)})"

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "mesh": self.mesh, "shard_size": self.shard_size,
                "reshard_after_forward": self.reshard_after_forward,
                "root_reshard_after_forward": self.root_reshard_after_forward}


@dataclass(frozen=True, kw_only=True)
class TensorParallelSection(PlanSection):
    """`parallel.tensor_size` > 1: DTensor tensor parallel on the mesh's `tp` axis, applied by
    fp8dist/engines/fsdp2/tensor_parallel.py (the run says how it split the model)."""
    size: int
    sequence_parallel: bool
    plan: str = "the model's config.base_model_tp_plan (transformers 5); fp8dist's Llama-style plan where it has none"
    float8_styles: bool
    """torchao's Float8ColwiseParallel / Float8RowwiseParallel for the tensorwise Float8Linears (activations
    all-gathered in float8 under sequence parallel); the plain styles otherwise (compute-dtype communication)."""
    order: str
    vocabulary: str = ("split over tp where it divides and embeddings are untied (logits gathered); else whole on "
                       "each tp rank")


@dataclass(frozen=True, kw_only=True)
class PipelineSection(PlanSection):
    """`parallel.pipeline_size` > 1: the decoder split by layer ranges into stages on the mesh's `pp` axis, run by
    a torch.distributed.pipelining schedule (fp8dist/engines/fsdp2/pipeline_parallel.py; the run says which layers
    each rank's stages hold)."""
    size: int
    schedule: str
    schedule_class: str  # torch.distributed.pipelining's
    microbatches: int
    stages_per_rank: int
    split: tuple[int, ...] | Literal["even"]
    order: str = ("FP8 conversion, tensor parallel, activation checkpointing and compile on the whole model, then "
                  "the split into this rank's stages, then fully_shard per stage (each stage a root)")


@dataclass(frozen=True, kw_only=True)
class OffloadPolicyPlan(PlanSection):
    """CPUOffloadPolicy (`parallel.offload: params`). pin_memory needs CUDA: CPUOffloadPolicy() pins by default and
    fails on CPU-only torch (torch 2.13 torch/distributed/fsdp/_fully_shard/_fsdp_param.py), so the runtime pins
    where CUDA exists."""
    cls: Literal["CPUOffloadPolicy"] = _json_key("class", default="CPUOffloadPolicy")
    pin_memory: Literal["where CUDA is available"] = "where CUDA is available"


# LoadingPlan.mode -> what the JSON says
LOADING_MODES = {"meta": "meta build in the master dtype, shard, then each rank reads its own rows of the safetensors "
                         "files",
                 "full": "full model on every rank"}


@dataclass(frozen=True, kw_only=True)
class LoadingPlan(PlanSection):
    """How the model reaches the ranks: `meta` (parallel.cpu_ram_efficient_loading, fp8dist.runtime.loading), or
    the full model on every rank."""
    mode: Literal["meta", "full"]
    dtype: Dtype | None = _left_out_when(None)  # the meta build's (the master dtype)

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "mode": LOADING_MODES[self.mode]}


@dataclass(frozen=True, kw_only=True)
class LossScalingPlan(PlanSection):
    """fp16 compute needs loss scaling; FSDP2 has none, so fp8dist's scaler runs (engines/loss_scaling.py)."""
    scaler: str = "fp8dist.engines.loss_scaling.DynamicLossScaler"
    found_inf: str = "all-reduced (MAX) across ranks"
    dynamic: bool
    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: float


@dataclass(frozen=True, kw_only=True)
class OptimizerPlan(PlanSection):
    cls: OptimizerClass = _json_key("class")
    steps_on: Dtype
    state_dtype: StateDtype
    lr: float
    weight_decay: float


@dataclass(frozen=True, kw_only=True)
class CompilePlan(PlanSection):
    """torch.compile of each block in place before fully_shard (the root when there is no block)."""
    per_block: bool = True
    root_if_no_blocks: bool = True
    before: Literal["fully_shard"] = "fully_shard"


@dataclass(frozen=True, kw_only=True)
class SpeedRulePlan(PlanSection):
    """precision.fp8.min_speedup (backends/module_filter.SpeedRule): a Linear whose predicted speedup at
    `tokens_per_micro_batch` on `gpu` in `recipe` is below `min_speedup` stays in the compute dtype. `gpu` auto: the
    device at start (a `min_speedup` of auto is then 1.0 on a GPU the speed model knows, no rule elsewhere)."""
    min_speedup: float | Literal["auto"]
    gpu: str
    recipe: str
    tokens_per_micro_batch: int
    compiled: bool


@dataclass(frozen=True, kw_only=True)
class ModuleFilterPlan(PlanSection):
    """Which Linears a float8 backend converts (backends/module_filter.py decide)."""
    exclude: tuple[str, ...]
    skip_first_last: bool
    require_dims_multiple_of: int | None  # None: any dims (torchao pads them)
    speed_rule: SpeedRulePlan | None = _left_out_when(None)  # None: no speed rule can act
    # precision.fp8's per-Linear policy where one is written (overrides, keep_first/last_layers, policy auto)
    policy: Mapping[str, Any] | None = _left_out_when(None)


def speed_rule_plan(spec: Spec) -> SpeedRulePlan | None:
    """The speed rule as far as the config decides it (min_speedup_of; `auto` GPU: resolved at start)."""
    fp8 = spec.fp8
    written = min_speedup_number(fp8.min_speedup)
    if fp8.recipe is None or (written is None and (fp8.min_speedup != "auto" or fp8.emulated)):
        return None  # off (or false), or auto while emulating
    gpu = spec.hardware.gpu
    threshold = fp8.min_speedup if gpu == "auto" else min_speedup_of(fp8.min_speedup, gpu, fp8.emulated)
    if threshold is None:
        return None
    return SpeedRulePlan(min_speedup=threshold, gpu=gpu, recipe=fp8.recipe[0],
                         tokens_per_micro_batch=spec.tokens_per_micro_batch, compiled=spec.compile)


@dataclass(frozen=True, kw_only=True)
class RecomputeDecision(PlanSection):
    value: bool
    reason: str


@dataclass(frozen=True, kw_only=True)
class Float8LinearSettings(PlanSection):
    """The fields of torchao's Float8LinearConfig fp8dist sets (its recipe's config, then these replaced)."""
    recipe_name: Float8Recipe
    enable_fsdp_float8_all_gather: bool
    pad_inner_dim: bool
    emulate: bool
    # Passed only when set: a torchao without the field, or where it is a no-op, never sees it
    # (facts.torchao.torchao_force_recompute).
    force_recompute_fp8_weight_in_bwd: bool = _left_out_when(False)


@dataclass(frozen=True, kw_only=True)
class TorchaoFloat8Plan(PlanSection):
    backend: Literal["torchao"] = "torchao"
    torchao_version: str
    torchao_version_origin: str
    float8_linear_config: Float8LinearSettings
    force_recompute_fp8_weight_in_bwd: RecomputeDecision
    precompute_float8_dynamic_scale_for_fsdp: bool
    module_filter: ModuleFilterPlan
    # MoE experts (grouped GEMMs); `auto` is resolved on the machine that runs (facts.torchao.torchao_experts_mode)
    experts: ExpertsMode


@dataclass(frozen=True, kw_only=True)
class TERecipePlan(PlanSection):
    """The TE recipe object to build (te_recipe_plan): its class, constructor arguments and attributes."""
    recipe_class: str
    recipe_fields: Mapping[str, Any]  # upstream argument names -> the user's values
    recipe_attributes: Mapping[str, Any]  # "attribute.member" -> value, set after construction


@dataclass(frozen=True, kw_only=True)
class TEFloat8Plan(PlanSection):
    backend: Literal["te"] = "te"
    te_version: str
    te_version_origin: str
    recipe: TERecipe
    recipe_build: TERecipePlan = field(metadata={"inline": True})  # its keys sit in this section's JSON
    swap: tuple[str, ...]
    module_filter: ModuleFilterPlan


Float8Plan = TorchaoFloat8Plan | TEFloat8Plan


@dataclass(frozen=True, kw_only=True)
class FSDP2Plan(PlanSection):
    engine: Literal["fsdp2"] = "fsdp2"
    load_dtype: Dtype
    upcast_before_shard: Dtype | None  # the master dtype, where the model is loaded in another
    mixed_precision_policy: MixedPrecisionPlan
    wrap: WrapPlan
    sharding: ShardingPlan
    offload_policy: OffloadPolicyPlan | None
    activation_checkpointing: ActivationCheckpointing
    loading: LoadingPlan
    loss_scaling: LossScalingPlan | None
    float8: Float8Plan | None
    tensor_parallel: TensorParallelSection | None = _left_out_when(None)
    pipeline: PipelineSection | None = _left_out_when(None)
    optimizer: OptimizerPlan
    compile: CompilePlan | None
    gradient_clipping: float

    def to_json(self) -> dict[str, Any]:
        """The JSON plan (no compile: `false`)."""
        return {**super().to_json(), "compile": self.compile.to_json() if self.compile else False}


def fsdp2_layout(spec: Spec) -> ShardingPlan:
    """The FSDP2 mesh and resharding of `parallel.sharding` (config/vocabulary.py's table)."""
    strategy = STRATEGIES[spec.parallel.sharding]
    shard_size: ShardSize = "world"
    if strategy == "hybrid":
        assert spec.parallel.shard_size is not None, "the config rules refuse hybrid without parallel.shard_size"
        shard_size = spec.parallel.shard_size
    elif strategy == "replicate":
        shard_size = 1
    return ShardingPlan(strategy=strategy, shard_size=shard_size, reshard_after_forward=strategy != "grad_op",
                        tensor_size=spec.parallel.tensor_size, context_size=spec.parallel.context_size,
                        expert_size=spec.parallel.expert_size, pipeline_size=spec.parallel.pipeline_size)


def tensor_parallel_section(spec: Spec) -> TensorParallelSection | None:
    if spec.parallel.tensor_size == 1:
        return None
    ao = spec.fp8.torchao
    mxfp8 = spec.fp8.backend == "torchao" and ao.recipe_name == "mxfp8"
    return TensorParallelSection(
        size=spec.parallel.tensor_size, sequence_parallel=sequence_parallel(spec),
        float8_styles=spec.fp8.backend == "torchao" and ao.recipe_name == "tensorwise",
        order=("tensor parallel, then MXFP8 conversion (torchao wraps the DTensor weights)" if mxfp8 else
               "FP8 conversion, then tensor parallel (torchao's float8 styles need Float8Linears)" if spec.fp8.enabled
               else "tensor parallel, then activation checkpointing, compile and fully_shard"))


def pipeline_section(spec: Spec) -> PipelineSection | None:
    par = spec.parallel
    if par.pipeline_size == 1:
        return None
    return PipelineSection(size=par.pipeline_size, schedule=par.pipeline_schedule,
                           schedule_class=PIPELINE_SCHEDULES[par.pipeline_schedule].torch_class,
                           microbatches=pipeline_microbatches(spec), stages_per_rank=pipeline_stages_per_rank(spec),
                           split=tuple(par.pipeline_split) or "even")


# Spec's enumerated fields are `str` (the schema has checked their values): `cast` names the plan's Literal type.
def to_fsdp2(spec: Spec, torchao_version: str | None = None, te_version: str | None = None) -> FSDP2Plan:
    p, f = spec.precision, spec.fsdp2
    master, state = cast(Dtype, p.weight_dtype), cast(StateDtype, spec.optimizer_state_dtype)
    return FSDP2Plan(
        load_dtype=p.load_dtype,
        upcast_before_shard=master if master != p.load_dtype else None,
        mixed_precision_policy=MixedPrecisionPlan(
            param_dtype=None if p.mixed_precision == "none" else cast(Dtype, p.mixed_precision),
            reduce_dtype=p.reduce_dtype, output_dtype=f.output_dtype, cast_forward_inputs=f.cast_forward_inputs),
        wrap=WrapPlan(units="auto" if f.wrap == "auto" else tuple(f.wrap)),
        sharding=fsdp2_layout(spec),
        offload_policy=OffloadPolicyPlan() if spec.parallel.offload == "params" else None,
        activation_checkpointing=cast(ActivationCheckpointing, spec.parallel.activation_checkpointing),
        loading=LoadingPlan(mode="meta", dtype=master) if spec.parallel.cpu_ram_efficient_loading
        else LoadingPlan(mode="full"),
        loss_scaling=loss_scaling_plan(spec),
        float8=float8_plan(spec, torchao_version, te_version),
        tensor_parallel=tensor_parallel_section(spec),
        pipeline=pipeline_section(spec),
        optimizer=OptimizerPlan(
            cls=OPTIMIZER_CLASSES[(spec.optimizer.name, state if state in ("fp8", "int8") else None)],
            steps_on=master, state_dtype=state, lr=spec.optimizer.lr, weight_decay=spec.optimizer.weight_decay),
        compile=CompilePlan() if spec.compile else None,
        gradient_clipping=spec.train.gradient_clipping,
    )


def loss_scaling_plan(spec: Spec) -> LossScalingPlan | None:
    """The loss scaler of fp16 compute; None for any other compute dtype."""
    if spec.precision.compute_dtype != "fp16":
        return None
    ls = spec.precision.loss_scaling
    return LossScalingPlan(dynamic=ls.loss_scale == 0, loss_scale=ls.loss_scale,
                           initial_scale_power=ls.initial_scale_power, loss_scale_window=ls.loss_scale_window,
                           hysteresis=ls.hysteresis, min_loss_scale=ls.min_loss_scale)


def torchao_dims_multiple(ao, recipe: str | None = None) -> int | None:
    """What a Linear's dims must be a multiple of to convert under `recipe` (default the run's): 16 for float8's
    _scaled_mm (None: pad_inner_dim pads instead), 32 for MXFP8's blocks."""
    if (recipe or ao.recipe_name) == "mxfp8":
        return TORCHAO_MX_BLOCK
    return None if ao.pad_inner_dim else FP8_DIM_MULTIPLE


def torchao_recipe_dims(ao) -> dict[str, int | None]:
    """torchao_dims_multiple for each torchao recipe (module_filter.Policy.dims: a Linear's own recipe decides)."""
    return {recipe: torchao_dims_multiple(ao, recipe) for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp",
                                                                       "mxfp8")}


def policy_section(spec: Spec) -> dict[str, Any] | None:
    """precision.fp8's per-Linear policy as the plan shows it, None where none is written."""
    fp8 = spec.fp8
    section = {key: value for key, value in (
        ("overrides", [{"modules": list(o.modules), "recipe": o.recipe} for o in fp8.overrides]),
        ("keep_first_layers", fp8.keep_first_layers), ("keep_last_layers", fp8.keep_last_layers)) if value}
    return section or None


def float8_plan(spec: Spec, torchao_version: str | None = None, te_version: str | None = None) -> Float8Plan | None:
    """The float8 part of the run: Transformer Engine's recipe, torchao's otherwise (None: no FP8)."""
    if spec.fp8.backend == "none":
        return None
    if spec.fp8.backend == "te":
        return te_float8_plan(spec, te_version)
    return torchao_float8_plan(spec, torchao_version)


def module_filter_plan(spec: Spec) -> ModuleFilterPlan:
    """Which Linears the float8 backend of `spec` converts: precision.fp8.modules, and the dims the recipe needs
    (Transformer Engine: its block size, TE_RECIPES; torchao: torchao_dims_multiple)."""
    fp8 = spec.fp8
    dims_multiple = (TE_RECIPES[fp8.te.recipe].dim_multiple if fp8.backend == "te"
                     else torchao_dims_multiple(fp8.torchao))
    return ModuleFilterPlan(exclude=tuple(fp8.modules.exclude), skip_first_last=fp8.modules.skip_first_last,
                            require_dims_multiple_of=dims_multiple, speed_rule=speed_rule_plan(spec),
                            policy=policy_section(spec))


def te_float8_plan(spec: Spec, te_version: str | None = None) -> TEFloat8Plan:
    te = spec.fp8.te
    version, origin = target_te_version(te_version)
    return TEFloat8Plan(te_version=fmt(version), te_version_origin=origin, recipe=cast(TERecipe, te.recipe),
                        recipe_build=te_recipe_plan(spec, version),
                        swap=("nn.Linear -> te.Linear",) + (("nn.LayerNorm -> te.LayerNorm",) if te.swap_layernorm
                                                            else ()),
                        module_filter=module_filter_plan(spec))


def torchao_float8_plan(spec: Spec, torchao_version: str | None = None) -> TorchaoFloat8Plan:
    ao = spec.fp8.torchao
    all_gather = spec.float8_all_gather
    version, origin = target_torchao_version(torchao_version)
    recompute, reason = torchao_force_recompute(version, ao.force_recompute_fp8_weight_in_bwd, all_gather)
    return TorchaoFloat8Plan(
        torchao_version=fmt(version), torchao_version_origin=origin,
        float8_linear_config=Float8LinearSettings(
            recipe_name=cast(Float8Recipe, ao.recipe_name), enable_fsdp_float8_all_gather=all_gather,
            pad_inner_dim=ao.pad_inner_dim, emulate=ao.emulate, force_recompute_fp8_weight_in_bwd=recompute),
        force_recompute_fp8_weight_in_bwd=RecomputeDecision(value=recompute, reason=reason),
        precompute_float8_dynamic_scale_for_fsdp=bool(
            all_gather and ao.precompute_float8_dynamic_scale_for_fsdp),
        module_filter=module_filter_plan(spec),
        experts=cast(ExpertsMode, ao.experts),
    )


def te_recipe_plan(spec: Spec, te_version: Version) -> TERecipePlan:
    """The TE recipe for Transformer Engine `te_version` (TE_RECIPES): its class, the constructor arguments
    the user set (upstream names; unset ones fall through to TE's defaults) and the recipe attributes set after
    construction. Refuses (ConfigError) the recipe or a field that release lacks: its class would drop the field
    without a word. The runtime backend builds exactly this (backends/transformer_engine.py build_recipe)."""
    te = spec.fp8.te
    record = TE_RECIPES[te.recipe]
    ok, reason = te_recipe_available(te.recipe, te_version)
    issues = [] if ok else [Issue("precision.fp8.te.recipe", reason, te.recipe,
                                  f"use Transformer Engine >= {fmt(record.since)}, or another recipe")]
    fields: dict[str, Any] = {}
    attributes: dict[str, Any] = {}
    for field_record in record.fields:  # the config rules refuse the other keys and the ignored fields
        value = getattr(te, field_record.name)
        if value is None:
            continue
        kept, reason = te_field_kept(te.recipe, field_record.name, te_version)
        if not kept:
            issues.append(Issue(f"precision.fp8.te.{field_record.name}", reason, value,
                                f"remove it, or use Transformer Engine >= {fmt(field_record.since)}"))
        fields[field_record.name] = value
        attributes.update(dict.fromkeys(field_record.also_sets, value))
    if issues:
        raise ConfigError(issues)
    return TERecipePlan(recipe_class=record.cls, recipe_fields=fields, recipe_attributes=attributes)
