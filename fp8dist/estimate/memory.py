"""The memory model: per-rank bytes of each store, of each phase of a step, and the peak, for one model, config and
world size (see fp8dist/estimate/__init__.py for what is counted and how)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Mapping, cast

from fp8dist.audit.expected import expected, implied_bytes_per_param
from fp8dist.config.parallel import ParallelDims
from fp8dist.config.spec import Spec, min_speedup_number
from fp8dist.dtypes import get as dtype_info
from fp8dist.engines.registry import profile_for
from fp8dist.errors import Fp8distError
from fp8dist.estimate.coverage import fp8_coverage, fp8_extra_bytes
from fp8dist.estimate.expert_parallel import ExpertSplit, expert_split
from fp8dist.estimate.dora import dora_transient_bytes
from fp8dist.estimate.frozen import FrozenBase, frozen_base
from fp8dist.estimate.model import (MeasuredActivations, MetaModel, activation_bytes, adapted_counts, blocks,
                                    build_meta_model)
from fp8dist.estimate.pipeline import Pipeline, RankStages, peak_in_flight, pipeline_layout
from fp8dist.estimate.result import (ActivationBytes, CheckpointingMode, Estimate, ExpertParallelCounted, Phase,
                                     PipelineCounted, PipelineRankCounted, PipelineStageCounted, ShardedStore, Store,
                                     STORES, TensorParallelCounted, TransientBytes)
from fp8dist.estimate.step import check as check_speed
from fp8dist.estimate.step import step_speed
from fp8dist.estimate.tensor_parallel import TensorSplit, tensor_split


# The engine's facts, asked here only (engines/<name>/profile.py, through the registry).
def shard_counts(spec: Spec, dims: ParallelDims) -> dict[ShardedStore, int]:
    """Over how many data-parallel ranks each store is divided (1: every rank holds all of it); a parameter tensor
    parallel splits is divided by tp on top (tensor_parallel.py); an expert parameter is divided by these alone, its
    ep x efsdp ranks being the dp_shard ranks (expert_parallel.py)."""
    return profile_for(spec).shard_counts(spec, dims)


def offloaded(spec: Spec) -> set[ShardedStore]:
    """The stores that live in host memory instead of the accelerator's."""
    return profile_for(spec).offloaded(spec)


def bytes_per_param(spec: Spec) -> dict[ShardedStore, float]:
    """Bytes per trainable parameter of each sharded store, in the dtypes the audit expects for the config (the same
    rules it checks a real run against)."""
    implied = implied_bytes_per_param(spec)
    return {"weights": implied["weights"], "master_weights": implied["master"], "gradients": implied["gradients"],
            "optimizer": implied["optimizer"]}


def masters_note(spec: Spec, per_param: dict[ShardedStore, float]) -> str | None:
    """Why the master-weights store holds no bytes of its own (None when it does): no master copy at all, or the
    engine's weights are the masters (FSDP2 shards the parameters in the master dtype: engines/fsdp2/profile.py)."""
    if per_param["master_weights"]:
        return None
    cell = expected(spec, nproc=2)["master_weights"][0]
    if cell == "n/a":
        return "none: the optimizer steps the weights themselves (precision.master_weights)"
    return f"the sharded {cell} parameters are the master weights (counted under weights; no copy beside them)"


def compute_bytes(spec: Spec) -> int:
    """Bytes per value of the compute dtype (compute dtypes are whole bytes)."""
    return int(dtype_info(spec.precision.compute_dtype).bits) // 8


def transient_bytes(meta: MetaModel, spec: Spec, shards: dict[ShardedStore, int], gathered: Mapping[str, int],
                    all_to_all: int = 0, nf4_dequantize: int = 0, dora: int = 0, stage: RankStages | None = None,
                    pipeline: Pipeline | None = None, trainable: int = 0) -> TransientBytes:
    """Bytes that exist only for a moment of the step, on top of the stores: the gathered weights of the wrap units
    in flight when weights are sharded (the unit computing and the one prefetched: FSDP2's default prefetch of
    one, torch 2.13 _fully_shard/_fsdp_state.py; ZeRO-3 prefetches likewise), gathered over the data axes only:
    a unit's tensor-parallel shards, and its E / ep experts under expert parallel, which gathers them over efsdp
    (`gathered`: parameter fqn -> the bytes a rank gathers: of the elements expert_parallel.ExpertSplit.gathered_numels
    counts, in the compute dtype, an NF4 base's weights in NF4: frozen.FrozenBase.gathered_bytes); and
    the gradient of the logits of the rank's `seq_len / cp` tokens, which a causal LM's loss upcasts to fp32
    (transformers 5 loss/loss_utils.py ForCausalLMLoss) and which reaches the bf16 lm_head output as a
    compute-dtype copy (the whole vocabulary: a split LM head gathers its logits); under expert parallel, the
    all-to-all buffers of the MoE layer in flight (`all_to_all`, measured: MeasuredActivations.all_to_all); an NF4
    base's dequantization of its largest weight for a GEMM (`nf4_dequantize`: frozen.FrozenBase.dequantize_bytes);
    DoRA's update of its largest adapted Linear (`dora`: dora.dora_transient_bytes).

    Pipeline rank `stage` of `pipeline` (`gathered`: of its own parameters only; `trainable`: its trainable elements
    on a tp rank): the logits' gradient of one microbatch, on the last stage's rank only. With the weights sharded,
    torch's pipeline stages keep FSDP2 from resharding after each microbatch's backward and from reducing its
    gradients until the last microbatch (torch 2.13 torch/distributed/pipelining/stage.py
    `backward_maybe_with_nosync`: `set_reshard_after_backward(False)`, `set_requires_gradient_sync(False)`;
    `perform_reduce_grad` once at the end): after a backward the rank's stages are gathered whole
    (`pipeline_weights`, in place of two units in flight), and their gradients accumulate unsharded in the reduce
    dtype (`pipeline_gradients`: _fully_shard/_fsdp_param.py `to_accumulated_grad_if_needed`), in place of the
    sharded gradients during backward (phases)."""
    compute = compute_bytes(spec)
    units = pipeline_weights = pipeline_gradients = 0
    if shards["weights"] > 1 and stage is not None:
        pipeline_weights = sum(gathered[fqn] for fqn in stage.parameters)
        pipeline_gradients = trainable * int(dtype_info(spec.precision.reduce_dtype).bits) // 8
    elif shards["weights"] > 1:
        sizes = sorted((sum(gathered[f"{name}.{param}"] for param, _ in block.named_parameters())
                        for name, block in blocks(meta.model, spec)), reverse=True)
        units = sum(sizes[:2])
    logits = 0
    vocab = getattr(meta.config, "vocab_size", 0)
    if meta.causal_lm and vocab and (stage is None or stage.last):
        sequences = pipeline.microbatch_sequences if pipeline is not None else spec.train.micro_batch_size
        logits = sequences * (spec.train.seq_len // spec.parallel.context_size) * vocab * (4 + compute)
    return TransientBytes(unsharded_units=units, logits_gradient=logits, all_to_all=all_to_all,
                          nf4_dequantize=nf4_dequantize, dora=dora, pipeline_weights=pipeline_weights,
                          pipeline_gradients=pipeline_gradients)


def phases(device: dict[Store, int], transient: TransientBytes) -> dict[Phase, int]:
    """The device bytes of each phase of a step, every store alive in it counted (`device`: the per-rank stores, 0
    for those in host memory). Under pipeline parallel with sharded weights the gradients are accumulated unsharded
    during backward (`transient.pipeline_gradients`) and sharded only after the last microbatch: those take the
    sharded gradients' place in the backward phases."""
    model = device["weights"] + device["master_weights"] + device["buffers"]
    gradients = transient.pipeline_gradients or device["gradients"]
    backward = (model + gradients + device["activations"] + device["fp8_extras"]
                + transient.unsharded_units + transient.logits_gradient + transient.all_to_all
                + transient.nf4_dequantize + transient.dora + transient.pipeline_weights)
    return {"model": model, "gradients": model + device["gradients"], "backward_pass": backward,
            "optimizer_step": model + device["gradients"] + device["optimizer"],
            "later_backward_pass": backward + device["optimizer"]}


def estimate(name: str, spec: Spec, world: int, gpu: str | None = None, nodes: int = 1) -> Estimate:
    """The estimate of model `name` (a built-in model or shape, a model directory or a config.json) trained with
    `spec` on `world` ranks; with `gpu`, its predicted step on `nodes` nodes of that GPU too (step.py)."""
    if world < 1:
        raise Fp8distError(f"--world-size must be at least 1, got {world}")
    dims = ParallelDims.of(spec, world, "--world-size")  # a world the config's layout does not fit: before the build
    shards = shard_counts(spec, dims)
    if gpu is None and spec.hardware.gpu != "auto":  # the config names the GPU the run is planned for
        gpu = spec.hardware.gpu
    if gpu is None and spec.fp8.enabled and min_speedup_number(spec.fp8.min_speedup) is not None:
        raise Fp8distError(f"precision.fp8.min_speedup={spec.fp8.min_speedup} keeps the Linears FP8 is predicted "
                           "not to pay for, and the estimate has no GPU to predict for\n  fix: "
                           "name it: --gpu h100 (or hardware.gpu in the config), or set precision.fp8.min_speedup="
                           "auto or off")
    if gpu is not None:  # a GPU the speed model does not know, or a recipe it cannot run: before the build too
        check_speed(spec, gpu, nodes, world)
    meta = build_meta_model(name, spec.precision.compute_dtype)
    dims.check_model(meta.config.to_dict(), spec.train.seq_len, source=name)
    trainable, frozen = adapted_counts(meta, spec)
    split = tensor_split(meta.model, spec)
    local = split.local_numels(meta.model)  # a tp rank's elements of each parameter
    experts = expert_split(meta.model, spec)
    params = list(meta.model.named_parameters())
    per_param = bytes_per_param(spec)
    mode = cast(CheckpointingMode, spec.parallel.activation_checkpointing)
    pipeline = pipeline_layout(meta.model, spec, dims)  # a model the engine cannot split into stages: refused
    # one micro-batch through the whole model; under pipeline parallel one microbatch (micro_batch_size / M
    # sequences), which each stage's blocks keep their part of
    measured = activation_bytes(meta, spec if pipeline is None else microbatch_spec(spec, pipeline), split, experts)
    coverage = fp8_coverage(meta, spec, gpu)  # the speed rule on `gpu` decides as the backend will
    host = offloaded(spec)
    if pipeline is None:
        ranks = [_rank_memory(meta, spec, gpu, split, local, experts, shards, per_param, host, mode, measured)]
    else:
        _check_blocks(meta, spec, pipeline)
        ranks = [_rank_memory(meta, spec, gpu, split, local, experts, shards, per_param, host, mode, measured, stage,
                              pipeline) for stage in pipeline.ranks]
    heaviest = max(ranks, key=lambda rank: rank.peak)  # the first of equals: the lowest pipeline rank
    per_rank, base, transient, acts = heaviest.per_rank, heaviest.base, heaviest.transient, heaviest.activations
    tensor_parallel = TensorParallelCounted(
        plan=split.plan, split_parameters=sum(param.numel() for fqn, param in params if local[fqn] < param.numel()),
        vocabulary_split=split.vocabulary is not None, sequence_parallel=dims.sequence_parallel)
    expert_parallel = ExpertParallelCounted(
        ep=dims.ep, efsdp=dims.efsdp, expert_parameters=sum(param.numel() for fqn, param in params
                                                           if fqn in experts.parameters),
        moe_layers=len(experts.modules), dispatch_kept=measured.dispatch_kept)
    result = Estimate(
        model=name, shape_only=meta.shape_only, world_size=world, mesh=dims.sizes,
        trainable_parameters=trainable, frozen_parameters=frozen, frozen_bytes_per_param=base.bytes_per_param,
        frozen_bytes_by_format=base.by_format, nf4_kept=base.nf4_kept,
        engine=spec.engine, config=spec.source, preset=spec.precision.preset,
        micro_batch_size=spec.train.micro_batch_size, seq_len=spec.train.seq_len, bytes_per_param=per_param,
        master_weights_note=masters_note(spec, per_param), shards=shards, tensor_parallel=tensor_parallel,
        expert_parallel=expert_parallel,
        per_rank_bytes={store: per_rank[store] for store in STORES}, offloaded_to_host=tuple(sorted(host)),
        activations_bytes=ActivationBytes(none=acts["none"], full_checkpointing=acts["full"],
                                          selective_checkpointing=acts["selective"], mode=mode),
        phases_bytes=heaviest.phases, fp8_extras_counted=heaviest.extras_how, transient_bytes=transient,
        fp8_coverage=coverage,
        pipeline=None if pipeline is None else _pipeline_counted(meta, pipeline, ranks, heaviest, measured, mode))
    if gpu is None:
        return result
    return replace(result, speed=step_speed(meta, spec, result, split, dims, local, gpu, nodes, pipeline))


@dataclass(frozen=True)
class _RankMemory:
    """One rank's memory: the whole model's rank, or one pipeline rank's (`stage`)."""
    stage: RankStages | None
    per_rank: dict[Store, int]
    base: FrozenBase
    extras_how: str
    transient: TransientBytes
    phases: dict[Phase, int]
    activations: dict[CheckpointingMode, int]  # per mode: what the rank keeps at once (in flight under pp)
    in_flight: int  # stage microbatches kept at once under pipeline parallel (1 without)

    @property
    def peak(self) -> int:
        return max(self.phases.values())


def _rank_memory(meta: MetaModel, spec: Spec, gpu: str | None, split: TensorSplit, local: Mapping[str, int],
                 experts: ExpertSplit, shards: dict[ShardedStore, int], per_param: dict[ShardedStore, float],
                 host: set[ShardedStore], mode: CheckpointingMode, measured: MeasuredActivations,
                 stage: RankStages | None = None, pipeline: Pipeline | None = None) -> _RankMemory:
    """The stores, transients and phases of one rank: of every parameter, or under pipeline parallel of pipeline rank
    `stage`'s (its stages' parameters; `measured`: one microbatch's activations)."""
    held = dict(local) if stage is None else {fqn: n if stage.holds(fqn) else 0 for fqn, n in local.items()}
    trainable_local = sum(held[fqn] for fqn, param in meta.model.named_parameters() if param.requires_grad)
    # the trainable parameters carry every store; the frozen ones (an adapter run's base) their weight only, by
    # storage format (frozen.py: an NF4 base's Linears in NF4); each store of a tp rank's shards divided over the
    # store's data-parallel ranks (under pipeline parallel: the data ranks of the rank's pp slice)
    per_rank: dict[Store, int] = {store: math.ceil(trainable_local * per_param[store] / shards[store])
                                  for store in per_param}
    base = frozen_base(meta, spec, held, shards["weights"])
    per_rank["weights"] += base.per_rank_bytes
    extras, extras_how = fp8_extra_bytes(meta, spec, split, gpu, None if stage is None else stage.holds)
    # Buffers (RoPE tables, BERT's position ids) stay whole on every rank that holds them, in their own dtype.
    per_rank["buffers"] = sum(b.numel() * b.element_size() for fqn, b in meta.model.named_buffers()
                              if stage is None or fqn in stage.buffers)
    per_rank["fp8_extras"] = extras
    activations, in_flight = _activations(measured, stage, pipeline)
    per_rank["activations"] = activations[mode]
    device: dict[Store, int] = {store: 0 if store in host else per_rank[store] for store in STORES}
    compute = compute_bytes(spec)
    gathered = {fqn: base.gathered_bytes(fqn, numel, compute) for fqn, numel in experts.gathered_numels(held).items()}
    transient = transient_bytes(meta, spec, shards, gathered, measured.all_to_all, base.dequantize_bytes(),
                                dora_transient_bytes(meta.model, compute, None if stage is None else stage.holds),
                                stage, pipeline, trainable_local)
    return _RankMemory(stage, per_rank, base, extras_how, transient, phases(device, transient), activations,
                       in_flight)


MODES: tuple[CheckpointingMode, ...] = ("none", "full", "selective")


def _activations(measured: MeasuredActivations, stage: RankStages | None,
                 pipeline: Pipeline | None) -> tuple[dict[CheckpointingMode, int], int]:
    """Per checkpointing mode, the activations a rank keeps at once, and the stage microbatches that makes: one
    micro-batch without pipeline parallel; under it, the most its schedule keeps in flight (pipeline.py: each
    forward keeps its stage's microbatch until its backward), plus one block recomputed when checkpointing."""
    if stage is None or pipeline is None:
        return {mode: measured.per_rank(mode) for mode in MODES}, 1
    ops, count = pipeline.ops(stage.pp_rank), len(pipeline.stage_layers)
    out, chunks = {}, 0
    for mode in MODES:
        sizes = [measured.stage(layers, index == 0, index == count - 1, mode) for index, layers in stage.stages]
        most, chunks = peak_in_flight(ops, sizes, pipeline.released_by)
        out[mode] = most + (measured.recomputed(stage.layers) if mode != "none" else 0)
    return out, chunks


def microbatch_spec(spec: Spec, pipeline: Pipeline) -> Spec:
    """`spec` with one pipeline microbatch as its micro-batch (the config rules make M divide it)."""
    return replace(spec, train=replace(spec.train, micro_batch_size=pipeline.microbatch_sequences))


def _check_blocks(meta: MetaModel, spec: Spec, pipeline: Pipeline) -> None:
    """The blocks the activations are measured per are the decoder layers the stages split, in order."""
    names = [name for name, _ in blocks(meta.model, spec)]
    layers = sum(len(layers) for layers in pipeline.stage_layers)
    if len(names) != layers or any(not name.endswith(f"layers.{i}") for i, name in enumerate(names)):
        raise Fp8distError(f"parallel.pipeline_size={pipeline.pp}: the estimate measures activations per wrap unit "
                           f"({', '.join(names[:3])}...), which are not the {layers} decoder layers the stages split"
                           "\n  fix: parallel.pipeline_size=1 to estimate this model")


IN_FLIGHT_RULES = {
    "1f1b": "1F1B keeps up to P - r microbatches in flight on pipeline rank r, P on the first (torch 2.13 "
            "pipelining/schedules.py Schedule1F1B: warmup_chunks = min(M, num_stages - stage_index))",
    "gpipe": "GPipe keeps all M microbatches in flight: every forward runs before the first backward (torch 2.13 "
             "pipelining/schedules.py ScheduleGPipe)",
    "interleaved_1f1b": "interleaved 1F1B keeps its warmup's forward chunks and one more, each a local stage's "
                        "microbatch: min((V - 1) x M / rounds + 2 x (P - 1 - r), V x M) + 1 (torch 2.13 "
                        "pipelining/schedules.py _get_warmup_ops, _get_1f1b_rank_ops)",
    "zero_bubble": "interleaved zero bubble keeps its warmup's chunks, (V - 1) x M / rounds + (P - 1 - r), and each "
                   "chunk until its weight gradient runs, counted whole (torch 2.13 pipelining/schedules.py "
                   "ScheduleInterleavedZeroBubble: num_1f1b_microbatches = rank)",
}


def _pipeline_counted(meta: MetaModel, pipeline: Pipeline, ranks: list[_RankMemory], heaviest: _RankMemory,
                      measured: MeasuredActivations, mode: CheckpointingMode) -> PipelineCounted:
    """The per-stage and per-rank table of a pipeline estimate, and why its heaviest rank is the heaviest."""
    numels = {fqn: param.numel() for fqn, param in meta.model.named_parameters()}
    count = len(pipeline.stage_layers)
    stages = []
    for rank in pipeline.ranks:
        for index, layers in rank.stages:
            first, last = index == 0, index == count - 1
            own = [fqn for fqn in rank.parameters if pipeline.parameter_stages[fqn] == index]
            stages.append(PipelineStageCounted(
                stage=index, pp_rank=rank.pp_rank, layers=tuple(layers), embeddings=first, lm_head=last,
                parameters=sum(numels[fqn] for fqn in own),
                activations_per_microbatch=measured.stage(layers, first, last, mode)))
    rows = tuple(PipelineRankCounted(
        pp_rank=rank.stage.pp_rank, stages=tuple(index for index, _ in rank.stage.stages),
        microbatches_in_flight=rank.in_flight, per_rank_bytes={store: rank.per_rank[store] for store in STORES},
        transient_bytes=rank.transient, phases_bytes=rank.phases) for rank in ranks if rank.stage is not None)
    assert heaviest.stage is not None
    return PipelineCounted(
        schedule=pipeline.schedule, pipeline_size=pipeline.pp, stages_per_rank=pipeline.stages_per_rank,
        microbatches=pipeline.microbatches, microbatch_sequences=pipeline.microbatch_sequences,
        in_flight_rule=IN_FLIGHT_RULES[pipeline.schedule], bubble_theory=pipeline.bubble_theory,
        heaviest_rank=heaviest.stage.pp_rank, heaviest_why=_heaviest_why(heaviest, ranks, pipeline, mode),
        stages=tuple(sorted(stages, key=lambda stage: stage.stage)), ranks=rows)


def _heaviest_why(heaviest: _RankMemory, ranks: list[_RankMemory], pipeline: Pipeline,
                  mode: CheckpointingMode) -> str:
    """Why the heaviest pipeline rank peaks highest, against the next heaviest: the part of its peak that differs
    the most (its parameters' stores, the activations in flight, the transients of backward), and what it holds."""
    stage = heaviest.stage
    assert stage is not None
    others = [rank for rank in ranks if rank is not heaviest]
    other = max(others, key=lambda rank: rank.peak)

    def parts(rank: _RankMemory) -> dict[str, int]:
        stores = sum(rank.per_rank[s] for s in STORES if s != "activations")
        return {"stores": stores, "activations": rank.per_rank["activations"],
                "transient": sum(asdict(rank.transient).values())}

    mine, theirs = parts(heaviest), parts(other)
    holds = (["the embeddings"] if stage.first else []) + (
        ["the final norm and lm_head, and the logits' gradient"] if stage.last else [])
    layers = f"{len(stage.layers)} decoder layers"
    what = {"stores": f"its parameters' stores ({layers}" + (f", {' and '.join(holds)}" if holds else "") + ")",
            "activations": f"the activations in flight ({heaviest.in_flight} stage microbatches of "
                           f"{pipeline.microbatch_sequences} sequence(s), checkpointing {mode}; "
                           + IN_FLIGHT_RULES[pipeline.schedule].split(" (")[0] + ")",
            "transient": "the transients of backward (" + ("the logits' gradient, " if stage.last else "")
                         + "gathered weights and unsharded gradients)"}
    lead = max(mine, key=lambda part: mine[part] - theirs[part])
    tie = " (as heavy: the first of equals)" if heaviest.peak == other.peak else ""
    return (f"pp rank {stage.pp_rank} ({stage.describe()}) peaks at {_mib(heaviest.peak)} against "
            f"{_mib(other.peak)} on pp rank {other.stage.pp_rank if other.stage else '?'}{tie}: most of the "
            f"difference is {what[lead]}, {_mib(mine[lead] - theirs[lead], sign=True)}")


def _mib(n: int, sign: bool = False) -> str:
    """`n` bytes in MiB, or GiB from one GiB (powers of 1024, as the table prints them)."""
    unit, size = ("GiB", n / 2**30) if abs(n) >= 2**30 else ("MiB", n / 2**20)
    return f"{size:{'+' if sign else ''},.2f} {unit}"
