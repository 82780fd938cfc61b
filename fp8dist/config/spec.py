"""The resolved config as frozen, typed dataclasses, and the values derived from it.

Field meanings and defaults live in schemas/fp8dist.schema.json (one place); these classes give the validated
dict a typed shape (tests/unit/config/test_schema_and_presets.py keeps the two in step). Each derived value
(the weight, compute and optimizer-state dtypes, float8 all-gather's `auto`) is computed once, by the functions
below: the properties of the spec use them (the cross-field rules, fp8dist.config.rules, read those), and so do
the importers, which hold another tool's values before a spec exists.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_type_hints

from fp8dist.config.engines import TRAITS
Dtype = Literal["fp32", "bf16", "fp16"]


def weight_dtype_of(load_dtype: str, master_weights: str) -> str:
    """dtype of the copy the optimizer steps on: the master dtype, or the weights as loaded without masters."""
    return load_dtype if master_weights == "none" else master_weights


def compute_dtype_of(mixed_precision: str, load_dtype: str, master_weights: str) -> str:
    """dtype of the non-FP8 ops: the mixed-precision dtype, or the stored weight dtype without it."""
    return mixed_precision if mixed_precision != "none" else weight_dtype_of(load_dtype, master_weights)


def state_dtype_of(state_dtype: str, backend: str, msamp_opt_level: str, weight_dtype: str) -> str:
    """optimizer.state_dtype with `auto` resolved: the dtype of the weights the optimizer steps, except under
    MS-AMP O2/O3 (FP8 first moment + FP16 second, MS-AMP docs optimization-level.md)."""
    if state_dtype != "auto":
        return state_dtype
    if backend == "msamp" and msamp_opt_level in ("O2", "O3"):
        return "fp8+fp16"
    return weight_dtype


def float8_all_gather_of(value, recipe_name: str, engine: str, backend: str, sharding: str = "full") -> bool:
    """precision.fp8.torchao.enable_fsdp_float8_all_gather with `auto` resolved: on for torchao tensorwise under
    FSDP2 (the only recipe torchao all-gathers in float8: Float8LinearConfig.__post_init__, torchao 0.18) when it
    shards (replicate gathers nothing); never on an engine that cannot gather float8 (config.engines)."""
    if backend != "torchao" or not TRAITS[engine].gathers_float8:
        return False
    if value == "auto":
        return recipe_name == "tensorwise" and sharding != "replicate"
    return bool(value)


def min_speedup_of(value: Any, gpu: str | None, emulate: bool) -> float | None:
    """precision.fp8.min_speedup resolved for the GPU the run is predicted on (`gpu`: hardware.gpu, or the device's;
    None: not one the speed model knows): the predicted speedup below which a Linear stays in the compute dtype, or
    None for no speed rule. `auto`: 1.0 where the GPU is known and FP8 is not emulated, else none; `off`: none; a
    number: that number (where no GPU is known the caller refuses it: backends/module_filter.speed_rule)."""
    if min_speedup_number(value) is None and value != "auto" or gpu is None:  # off (or false: YAML's off)
        return None
    if value == "auto":
        return None if emulate else 1.0
    return float(value)


def min_speedup_number(value: Any) -> float | None:
    """precision.fp8.min_speedup when it is written as a number (not auto, off or false)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class ModulesSpec:
    exclude: tuple[str, ...]
    skip_first_last: bool


@dataclass(frozen=True)
class TorchaoSpec:
    recipe_name: str
    enable_fsdp_float8_all_gather: Any  # "auto" | bool
    force_recompute_fp8_weight_in_bwd: Any  # "auto" | bool
    emulate: bool
    pad_inner_dim: bool
    precompute_float8_dynamic_scale_for_fsdp: bool
    experts: str  # auto | none | float8 | mxfp8: MoE expert weights (backends/experts.py)


@dataclass(frozen=True)
class TESpec:
    recipe: str
    fp8_format: str | None
    margin: int | None
    amax_history_len: int | None
    amax_compute_algo: str | None
    reduce_amax: bool | None
    use_power_2_scales: bool | None
    enable_2d_quantization: bool | None
    fp8_dpa: bool | None
    fp8_mha: bool | None
    interval: int | None
    override_linear_precision: tuple | None
    swap_layernorm: bool


@dataclass(frozen=True)
class MSAMPSpec:
    opt_level: str
    use_te: bool


@dataclass(frozen=True)
class OverrideSpec:
    """One entry of precision.fp8.overrides: the Linears its patterns match get `recipe` (`none`: compute dtype)."""
    modules: tuple[str, ...]
    recipe: str


@dataclass(frozen=True)
class FP8Spec:
    backend: str
    modules: ModulesSpec
    torchao: TorchaoSpec
    te: TESpec
    msamp: MSAMPSpec
    # "auto" | "off" | False (YAML's off) | a number: the speed-aware module filter (backends/module_filter)
    min_speedup: Any = "auto"
    # the per-Linear policy (backends/module_filter.Policy); the schema's defaults, for a spec built by hand
    overrides: tuple[OverrideSpec, ...] = ()
    keep_first_layers: int = 0
    keep_last_layers: int = 0
    # manual | auto: auto calibrates each Linear's recipe before the first step (fp8dist.audit.calibration)
    policy: str = "manual"
    calibration_steps: int = 2

    def __post_init__(self):
        # _build hands the list's entries over as dicts (it builds nested dataclasses, not lists of them)
        object.__setattr__(self, "overrides", tuple(
            o if isinstance(o, OverrideSpec) else OverrideSpec(tuple(o["modules"]), o["recipe"])
            for o in self.overrides))

    @property
    def recipes(self) -> tuple[str, ...]:
        """Every recipe the run's Linears may get: the run's own (recipe) and the overrides' (`none` left out)."""
        own = [self.recipe[0]] if self.recipe else []
        return tuple(dict.fromkeys(own + [o.recipe for o in self.overrides if o.recipe != "none"]))

    @property
    def enabled(self) -> bool:
        return self.backend != "none"

    @property
    def emulated(self) -> bool:
        """FP8 emulated rather than run on FP8 tensor cores (torchao's emulate; the other backends never emulate)."""
        return self.backend == "torchao" and self.torchao.emulate

    @property
    def recipe(self) -> tuple[str, str] | None:
        """(recipe, backend) as the speed model spells them (fp8dist/speed.py), None without FP8: torchao's
        recipe_name; Transformer Engine's recipe (also under MS-AMP with use_te); MS-AMP's own Linear as per-tensor
        delayed scaling."""
        if self.backend == "torchao":
            return self.torchao.recipe_name, "torchao"
        if self.backend == "te" or (self.backend == "msamp" and self.msamp.use_te):
            return self.te.recipe, "te"
        if self.backend == "msamp":
            return "delayed", "msamp"
        return None


@dataclass(frozen=True)
class LossScalingSpec:
    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: float


@dataclass(frozen=True)
class ScheduleSpec:
    """precision.schedule: from one step on, the FP8 GEMMs (`gemms`: forward | all) run in the compute dtype."""
    from_step: int | None = None
    from_fraction: float | None = None
    gemms: str = "forward"


def switch_step_of(schedule: ScheduleSpec, steps: int) -> int | None:
    """The first step (counted from 1) that precision.schedule runs in the compute dtype, None without a schedule:
    from_step, or floor(from_fraction x train.steps) + 1 (the first fraction of the steps in FP8)."""
    if schedule.from_step is not None:
        return schedule.from_step
    if schedule.from_fraction is not None:
        return int(schedule.from_fraction * steps) + 1
    return None


@dataclass(frozen=True)
class PrecisionSpec:
    preset: str | None
    load_dtype: Dtype
    mixed_precision: str
    master_weights: str
    reduce_dtype: Dtype
    loss_scaling: LossScalingSpec
    fp8: FP8Spec
    schedule: ScheduleSpec = ScheduleSpec()

    @property
    def compute_dtype(self) -> str:
        return compute_dtype_of(self.mixed_precision, self.load_dtype, self.master_weights)

    @property
    def weight_dtype(self) -> str:
        return weight_dtype_of(self.load_dtype, self.master_weights)


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    state_dtype: str


@dataclass(frozen=True)
class TrainSpec:
    steps: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    seq_len: int
    gradient_clipping: float
    seed: int
    process_group_timeout_s: int


@dataclass(frozen=True)
class AdapterSpec:
    kind: str  # none | lora
    r: int
    alpha: float
    dropout: float
    target_modules: Any  # "auto" | tuple[str, ...]
    base_dtype: str  # auto | nf4 (fp8dist/backends/nf4.py; FSDP2 only) | int8 (refused by the rules)
    # trained whole beside the adapters (PEFT modules_to_save); the schema's default, for a spec built by hand
    modules_to_save: tuple[str, ...] = ()
    # DoRA (PEFT use_dora): a trained magnitude vector beside each adapter; the schema's default, as above
    use_dora: bool = False

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


@dataclass(frozen=True)
class CheckpointSpec:
    keep_last: int


@dataclass(frozen=True)
class SqnrLimitsSpec:
    forward: float
    input_grad: float
    weight_grad: float


@dataclass(frozen=True)
class NumericsSpec:
    max_underflow: float
    max_saturated: float
    min_sqnr_db: SqnrLimitsSpec


@dataclass(frozen=True)
class AuditSpec:
    first_step: str  # warn | raise | off
    numerics: NumericsSpec  # the limits of `audit --numerics` (fp8dist.audit.numerics)


@dataclass(frozen=True)
class ParallelSpec:
    sharding: str  # auto | full | grad_op | hybrid | replicate
    shard_size: int | None
    tensor_size: int
    sequence_parallel: Any  # "auto" | bool
    context_size: int
    expert_size: int
    pipeline_size: int
    pipeline_schedule: str  # 1f1b | gpipe | interleaved_1f1b | zero_bubble
    pipeline_microbatches: Any  # "auto" | int
    pipeline_stages_per_rank: Any  # "auto" | int
    pipeline_split: tuple[int, ...]
    offload: str  # none | optimizer | params
    activation_checkpointing: str  # none | full | selective
    cpu_ram_efficient_loading: bool


@dataclass(frozen=True)
class FSDP2Spec:
    wrap: Any  # "auto" | tuple[str, ...]
    output_dtype: Dtype | None
    cast_forward_inputs: bool


@dataclass(frozen=True)
class DeepSpeedSpec:
    zero_stage: int
    offload_optimizer: str
    offload_param: str
    nvme_path: str | None
    grad_accum_dtype: Dtype | None
    steps_per_print: int
    extra: dict = field(hash=False, compare=True)


@dataclass(frozen=True)
class HardwareSpec:
    gpu: str  # auto | a GPU the speed model knows (facts/hardware.py GPUS)


@dataclass(frozen=True)
class Spec:
    engine: str
    compile: bool
    precision: PrecisionSpec
    optimizer: OptimizerSpec
    train: TrainSpec
    adapter: AdapterSpec
    checkpoint: CheckpointSpec
    audit: AuditSpec
    parallel: ParallelSpec
    fsdp2: FSDP2Spec
    deepspeed: DeepSpeedSpec
    hardware: HardwareSpec = HardwareSpec("auto")
    source: str = field(default="<config>", compare=False)
    # What the config says that does nothing on this engine (fp8dist.config.rules.notes): said by validate,
    # translate and the runtimes, refused by `--strict`.
    notes: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<config>", notes: tuple[str, ...] = ()) -> "Spec":
        spec = _build(cls, data)
        return dataclasses.replace(spec, source=source, notes=tuple(notes))

    def to_dict(self) -> dict[str, Any]:
        out = _to_plain(dataclasses.asdict(self))
        out.pop("source", None)
        out.pop("notes", None)
        return out

    @property
    def fp8(self) -> FP8Spec:
        return self.precision.fp8

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens a rank's Linears see per micro-batch (M of their GEMMs): micro_batch_size x seq_len, over the
        context-parallel ranks."""
        return self.train.micro_batch_size * self.train.seq_len // self.parallel.context_size

    @property
    def optimizer_state_dtype(self) -> str:
        """optimizer.state_dtype with `auto` resolved (state_dtype_of)."""
        return state_dtype_of(self.optimizer.state_dtype, self.fp8.backend, self.fp8.msamp.opt_level,
                              self.precision.weight_dtype)

    @property
    def float8_all_gather(self) -> bool:
        """Whether FSDP2 all-gathers the converted tensorwise weights in float8 (float8_all_gather_of): a run whose
        overrides give some Linears tensorwise gathers those in float8, the others in the compute dtype."""
        recipe = "tensorwise" if "tensorwise" in self.fp8.recipes else self.fp8.torchao.recipe_name
        return float8_all_gather_of(self.fp8.torchao.enable_fsdp_float8_all_gather, recipe,
                                    self.engine, self.fp8.backend, self.parallel.sharding)

    @property
    def switch_step(self) -> int | None:
        """The first step precision.schedule runs in the compute dtype (switch_step_of), None without one."""
        return switch_step_of(self.precision.schedule, self.train.steps) if self.fp8.enabled else None


def with_overrides(spec: "Spec", overrides: list[dict[str, Any]]) -> "Spec":
    """`spec` with `overrides` ({modules, recipe} entries) after its written precision.fp8.overrides: how
    precision.fp8.policy auto hands its calibrated decisions to the engine (the written entries still win)."""
    fp8 = spec.fp8
    added = tuple(OverrideSpec(tuple(o["modules"]), o["recipe"]) for o in overrides)
    return dataclasses.replace(spec, precision=dataclasses.replace(
        spec.precision, fp8=dataclasses.replace(fp8, overrides=fp8.overrides + added)))


def _build(cls, data: dict[str, Any]):
    hints = get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        value, hint = data[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint):
            value = _build(hint, value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def _to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value
