"""What an estimate says, typed (torch-free): the `Estimate` of one model, config and world size, and the parts it is
made of. `Estimate.to_json()` is the document `fp8dist estimate --format json` prints; its keys are a contract
(README, tests/unit/commands/test_estimate.py)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Mapping

from fp8dist.engines.profile import Store as ShardedStore

# The stores of a rank's memory, in the order the table lists them: the four an engine shards (engines/profile.py),
# then what every rank keeps whole.
Store = Literal[ShardedStore, "buffers", "fp8_extras", "activations"]
STORES: tuple[Store, ...] = ("weights", "master_weights", "gradients", "optimizer", "buffers", "fp8_extras",
                             "activations")
# The phases of a step, each with every store alive in it (not an increment over the one before). The first four
# are the training columns of the Model Memory Usage tool (huggingface.co/spaces/hf-accelerate/model-memory-usage),
# counted for the first step, before the optimizer's states exist; from step 2 on the states are there during every
# backward pass, which is where a run peaks (what published peaks measure).
Phase = Literal["model", "gradients", "backward_pass", "optimizer_step", "later_backward_pass"]
PHASES: tuple[Phase, ...] = ("model", "gradients", "backward_pass", "optimizer_step", "later_backward_pass")
CheckpointingMode = Literal["none", "full", "selective"]


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes kept for backward by one micro-batch, per `parallel.activation_checkpointing` mode (checkpointing: plus
    one block recomputed in backward), and the mode the config counts."""
    none: int
    full_checkpointing: int
    selective_checkpointing: int
    mode: CheckpointingMode


@dataclass(frozen=True)
class TransientBytes:
    """Bytes that exist only for a moment of backward, on top of the stores."""
    unsharded_units: int  # the gathered weights of the wrap units in flight (weights sharded)
    logits_gradient: int  # the gradient of a causal LM's logits: fp32 from the loss, plus a compute-dtype copy
    all_to_all: int = 0  # expert parallel: the send and receive buffers of one MoE layer's all-to-all
    nf4_dequantize: int = 0  # an NF4 base: dequantizing its largest weight for a GEMM (estimate/frozen.py)
    dora: int = 0  # adapter.use_dora: the largest adapted Linear's identity matrix and update copies (estimate/dora.py)
    # pipeline parallel with sharded weights (memory.transient_bytes): the rank's stages left gathered after a
    # microbatch's backward, and their gradients accumulated unsharded until the last microbatch (in place of the
    # sharded gradients during backward)
    pipeline_weights: int = 0
    pipeline_gradients: int = 0


@dataclass(frozen=True)
class TensorParallelCounted:
    """What the estimate divided by the mesh's `tp` axis (fp8dist/estimate/tensor_parallel.py)."""
    plan: str  # where the tensor-parallel plan came from; "" without tensor parallel
    split_parameters: int  # elements of the parameters split over tp: their stores are divided by tp x the shards
    vocabulary_split: bool  # embedding and LM head among them
    sequence_parallel: bool  # what the blocks keep outside attention and MLP divided by tp too


@dataclass(frozen=True)
class ExpertParallelCounted:
    """The experts' mesh and what the estimate counted for it (fp8dist/estimate/expert_parallel.py): the experts'
    sharded stores are divided as every parameter's (E / (ep x efsdp) = E / dp_shard), their gathered weights by ep;
    the dispatch's buffers are in transient_bytes.all_to_all."""
    ep: int  # the ranks a MoE layer's experts are split whole over (1: no expert parallel)
    efsdp: int  # the ranks that FSDP-shard the same experts (dp_shard / ep): a block's experts are gathered over these
    expert_parameters: int  # elements of the MoE experts' parameters, all experts of all layers
    moe_layers: int  # the experts modules
    dispatch_kept: int  # what the dispatch keeps for backward in one micro batch, no checkpointing (0: ep 1)


@dataclass(frozen=True)
class PipelineStageCounted:
    """One pipeline stage (fp8dist/estimate/pipeline.py): its decoder layers and what else it holds, its parameters,
    and what one microbatch of it keeps for backward in the counted checkpointing mode."""
    stage: int
    pp_rank: int  # the pipeline rank that runs it
    layers: tuple[int, ...]  # its decoder layers' indices
    embeddings: bool  # the first stage: the input embeddings
    lm_head: bool  # the last stage: the final norm and the LM head (and the loss)
    parameters: int  # elements of its parameters (whole, before any sharding)
    activations_per_microbatch: int  # kept for backward by one microbatch (no block recomputed)


class PhasePeak:
    """The phase where device memory peaks, and its bytes, of a record with `phases_bytes` (the whole estimate's
    rank, or one pipeline rank)."""

    phases_bytes: Mapping[Phase, int]

    @property
    def highest_phase(self) -> Phase:
        return max(PHASES, key=lambda phase: self.phases_bytes[phase])

    @property
    def peak_bytes(self) -> int:
        """The one total the estimate gives: the device bytes of the phase where a rank peaks."""
        return self.phases_bytes[self.highest_phase]


@dataclass(frozen=True)
class PipelineRankCounted(PhasePeak):
    """What one pipeline rank holds: its stages' stores (divided over the data ranks of its pp slice), the
    activations its schedule keeps in flight, the transients of backward, and its phases and peak."""
    pp_rank: int
    stages: tuple[int, ...]
    microbatches_in_flight: int  # stage microbatches kept for backward at once, at the schedule's most
    per_rank_bytes: Mapping[Store, int]
    transient_bytes: TransientBytes
    phases_bytes: Mapping[Phase, int]

    def to_json(self) -> dict[str, Any]:
        return {"pp_rank": self.pp_rank, "stages": list(self.stages),
                "microbatches_in_flight": self.microbatches_in_flight, "per_rank_bytes": dict(self.per_rank_bytes),
                "transient_bytes": asdict(self.transient_bytes), "phases_bytes": dict(self.phases_bytes),
                "highest_phase": self.highest_phase, "peak_bytes": self.peak_bytes}


@dataclass(frozen=True)
class PipelineCounted:
    """Pipeline parallel as the estimate counted it: the schedule, its sizes and bubble, each stage and each pipeline
    rank; the estimate's per-rank figures are those of `heaviest_rank`, and `heaviest_why` says why it is."""
    schedule: str
    pipeline_size: int
    stages_per_rank: int
    microbatches: int
    microbatch_sequences: int  # train.micro_batch_size / microbatches
    in_flight_rule: str  # what the schedule keeps in flight, and where that comes from
    bubble_theory: float  # (P - 1) / (V x M + P - 1): config/parallel.py pipeline_bubble
    heaviest_rank: int
    heaviest_why: str
    stages: tuple[PipelineStageCounted, ...]
    ranks: tuple[PipelineRankCounted, ...]

    def to_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "pipeline_size": self.pipeline_size,
                "stages_per_rank": self.stages_per_rank, "microbatches": self.microbatches,
                "microbatch_sequences": self.microbatch_sequences, "in_flight_rule": self.in_flight_rule,
                "bubble_theory": round(self.bubble_theory, 6), "heaviest_rank": self.heaviest_rank,
                "heaviest_why": self.heaviest_why,
                "stages": [{**asdict(stage), "layers": list(stage.layers)} for stage in self.stages],
                "ranks": [rank.to_json() for rank in self.ranks]}


@dataclass(frozen=True)
class LeftOut:
    fqn: str
    reason: str


@dataclass(frozen=True)
class FrozenFormat:
    """The part of an adapter run's frozen base held in one storage format (fp8dist/estimate/frozen.py): `nf4` (an
    NF4 base's quantized Linears) or a dtype (the rest), as the audit's `frozen_bytes_by_format` names them."""
    parameters: int  # elements held in this format, the whole model
    bytes: int  # what they hold in one whole copy of the model (one process, unsharded)
    per_rank_bytes: int  # a rank's share of them (its shards)
    bytes_per_param: float  # a rank's bytes per element it holds: what the audit's frozen_bytes_by_format reads


@dataclass(frozen=True)
class Fp8Coverage:
    """Share of one token's weight-GEMM FLOPs that run in FP8, the Linears and MoE experts modules counted, those left
    in high precision and why, and the converted Linears below torchao's size heuristics."""
    backend: str  # "none" without an FP8 backend
    fp8_share: float
    linears: int
    converted: int
    left_out: tuple[LeftOut, ...]
    too_small_to_gain: tuple[str, ...]
    experts: int

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "left_out": [asdict(item) for item in self.left_out],
                "too_small_to_gain": list(self.too_small_to_gain)}


@dataclass(frozen=True)
class SpeedLinear:
    """A Linear (or an MoE experts GEMM) as the speed model counted it: its forward shape on one rank (M tokens, K in,
    N out), its format and its predicted speedup over bf16; `count`: the Linears of the same name in every block."""
    module: str  # the fqn, the block index written as `*` when every block has it
    m: int
    k: int
    n: int
    format: str  # the recipe ("torchao rowwise", "te current", ...) or "bf16" (kept in high precision)
    speedup: float
    count: int = 1


@dataclass(frozen=True)
class SpeedEstimate:
    """The predicted step of one rank on a GPU, for the config and its bf16 twin (fp8dist/estimate/step.py). Parts
    are seconds per optimizer step; `communication`: per mesh axis, bytes a rank sends per step, their seconds on
    the axis' link and the seconds left exposed (not hidden behind compute)."""
    gpu: str
    nodes: int
    step_s: float
    bf16_step_s: float
    tokens_per_s: float  # per GPU
    bf16_tokens_per_s: float
    parts: Mapping[str, float]
    bf16_parts: Mapping[str, float]
    communication: Mapping[str, Mapping[str, Any]]
    linears: tuple[SpeedLinear, ...]
    reasons: tuple[str, ...]  # why the ratio is what it is, in plain words (what costs the most first)
    notes: tuple[str, ...]  # what the prediction assumes about this config
    # pipeline parallel: the schedule, its bubble (theory and seconds a step), the slowest pipeline rank (whose step
    # this is) and the point-to-point bytes it sends a step; None without (no `pipeline` key)
    pipeline: Mapping[str, Any] | None = None

    @property
    def fp8_over_bf16(self) -> float:
        return self.tokens_per_s / self.bf16_tokens_per_s

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "nodes": self.nodes, "tokens_per_s": round(self.tokens_per_s, 1),
                "bf16_tokens_per_s": round(self.bf16_tokens_per_s, 1),
                "fp8_over_bf16": round(self.fp8_over_bf16, 4), "step_s": round(self.step_s, 6),
                "bf16_step_s": round(self.bf16_step_s, 6),
                "parts": {k: round(v, 6) for k, v in self.parts.items()},
                "bf16_parts": {k: round(v, 6) for k, v in self.bf16_parts.items()},
                "communication": {axis: dict(row) for axis, row in self.communication.items()},
                "linears": [{**asdict(row), "speedup": round(row.speedup, 3)} for row in self.linears],
                "reasons": list(self.reasons), "notes": list(self.notes),
                **({"pipeline": dict(self.pipeline)} if self.pipeline is not None else {})}


@dataclass(frozen=True)
class Estimate(PhasePeak):
    """Per-rank memory of one run before it starts (fp8dist/estimate/memory.py `estimate` builds it)."""
    model: str
    shape_only: bool  # a built-in shape: parameter count and sizes are real, no weights exist
    world_size: int
    mesh: Mapping[str, int]  # the size of each mesh axis (config/parallel.py AXES), outermost first
    trainable_parameters: int
    frozen_parameters: int  # an adapter run's base: weights only
    frozen_bytes_per_param: float  # a rank's frozen bytes per frozen element it holds, every format together
    frozen_bytes_by_format: Mapping[str, FrozenFormat]  # the frozen base by storage format ({} without an adapter)
    nf4_kept: tuple[LeftOut, ...]  # an NF4 base: the frozen Linears kept in the load dtype, and why
    engine: str
    config: str
    preset: str | None
    micro_batch_size: int
    seq_len: int
    bytes_per_param: Mapping[ShardedStore, float]  # of a trainable parameter
    master_weights_note: str | None  # why master_weights holds no bytes of its own (None: it does)
    shards: Mapping[ShardedStore, int]  # the ranks each store is sharded on: the data axes (FSDP2: x cp)
    tensor_parallel: TensorParallelCounted  # the parameters whose stores are divided by tp on top
    expert_parallel: ExpertParallelCounted  # the experts' (efsdp, ep) mesh
    per_rank_bytes: Mapping[Store, int]
    offloaded_to_host: tuple[Store, ...]
    activations_bytes: ActivationBytes
    phases_bytes: Mapping[Phase, int]  # on the device; each phase holds every store alive in it
    fp8_extras_counted: str  # how the fp8_extras store was counted
    transient_bytes: TransientBytes
    fp8_coverage: Fp8Coverage
    speed: SpeedEstimate | None = None  # `--gpu`: the predicted step (no GPU named: None, no `speed` key)
    # pipeline parallel: each stage and pipeline rank; the figures above are the heaviest rank's (pipeline_size 1:
    # None, no `pipeline` key)
    pipeline: PipelineCounted | None = None

    @property
    def parameters(self) -> int:
        return self.trainable_parameters + self.frozen_parameters

    @property
    def host_bytes(self) -> int:
        """Per-rank bytes of the stores in host memory (outside the phases)."""
        return sum(self.per_rank_bytes[store] for store in self.offloaded_to_host)

    def to_json(self) -> dict[str, Any]:
        """The JSON document of `fp8dist estimate --format json`, keys in their documented order."""
        return {
            "model": self.model, "shape_only": self.shape_only, "parameters": self.parameters,
            "world_size": self.world_size, "mesh": dict(self.mesh), "trainable_parameters": self.trainable_parameters,
            "frozen_parameters": self.frozen_parameters, "frozen_bytes_per_param": self.frozen_bytes_per_param,
            "frozen_bytes_by_format": {fmt: asdict(part) for fmt, part in self.frozen_bytes_by_format.items()},
            "nf4_kept": [asdict(item) for item in self.nf4_kept],
            "engine": self.engine, "config": self.config, "preset": self.preset,
            "micro_batch_size": self.micro_batch_size, "seq_len": self.seq_len,
            "bytes_per_param": dict(self.bytes_per_param), "master_weights_note": self.master_weights_note,
            "shards": dict(self.shards), "tensor_parallel": asdict(self.tensor_parallel),
            "expert_parallel": asdict(self.expert_parallel),
            "per_rank_bytes": dict(self.per_rank_bytes),
            "offloaded_to_host": list(self.offloaded_to_host), "host_bytes": self.host_bytes,
            "activations_bytes": asdict(self.activations_bytes), "phases_bytes": dict(self.phases_bytes),
            "highest_phase": self.highest_phase, "peak_bytes": self.peak_bytes,
            "fp8_extras_counted": self.fp8_extras_counted, "transient_bytes": asdict(self.transient_bytes),
            "fp8_coverage": self.fp8_coverage.to_json(),
            **({"pipeline": self.pipeline.to_json()} if self.pipeline is not None else {}),
            **({"speed": self.speed.to_json()} if self.speed is not None else {}),
        }
