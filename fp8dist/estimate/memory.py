"""The memory model: per-rank bytes of each store, of each phase of a step, and the peak, for one model, config and
world size (see fp8dist/estimate/__init__.py for what is counted and how)."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, cast

from fp8dist.audit.expected import expected, implied_bytes_per_param
from fp8dist.config.parallel import ParallelDims
from fp8dist.config.spec import Spec, min_speedup_number
from fp8dist.dtypes import get as dtype_info
from fp8dist.engines.registry import profile_for
from fp8dist.errors import Fp8distError
from fp8dist.estimate.coverage import fp8_coverage, fp8_extra_bytes
from fp8dist.estimate.expert_parallel import expert_split
from fp8dist.estimate.dora import dora_transient_bytes
from fp8dist.estimate.frozen import frozen_base
from fp8dist.estimate.model import MetaModel, activation_bytes, adapted_counts, blocks, build_meta_model
from fp8dist.estimate.result import (ActivationBytes, CheckpointingMode, Estimate, ExpertParallelCounted, Phase,
                                     ShardedStore, Store, STORES, TensorParallelCounted, TransientBytes)
from fp8dist.estimate.step import check as check_speed
from fp8dist.estimate.step import step_speed
from fp8dist.estimate.tensor_parallel import tensor_split


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
                    all_to_all: int = 0, nf4_dequantize: int = 0, dora: int = 0) -> TransientBytes:
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
    DoRA's update of its largest adapted Linear (`dora`: dora.dora_transient_bytes)."""
    compute = compute_bytes(spec)
    units = 0
    if shards["weights"] > 1:
        sizes = sorted((sum(gathered[f"{name}.{param}"] for param, _ in block.named_parameters())
                        for name, block in blocks(meta.model, spec)), reverse=True)
        units = sum(sizes[:2])
    logits = 0
    vocab = getattr(meta.config, "vocab_size", 0)
    if meta.causal_lm and vocab:
        tokens = spec.train.micro_batch_size * (spec.train.seq_len // spec.parallel.context_size)
        logits = tokens * vocab * (4 + compute)
    return TransientBytes(unsharded_units=units, logits_gradient=logits, all_to_all=all_to_all,
                          nf4_dequantize=nf4_dequantize, dora=dora)


def phases(device: dict[Store, int], transient: TransientBytes) -> dict[Phase, int]:
    """The device bytes of each phase of a step, every store alive in it counted (`device`: the per-rank stores, 0
    for those in host memory)."""
    model = device["weights"] + device["master_weights"] + device["buffers"]
    backward = (model + device["gradients"] + device["activations"] + device["fp8_extras"]
                + transient.unsharded_units + transient.logits_gradient + transient.all_to_all
                + transient.nf4_dequantize + transient.dora)
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
    trainable_local = sum(local[fqn] for fqn, param in params if param.requires_grad)
    per_param = bytes_per_param(spec)
    # the trainable parameters carry every store; the frozen ones (an adapter run's base) their weight only, by
    # storage format (frozen.py: an NF4 base's Linears in NF4); each store of a tp rank's shards divided over the
    # store's data-parallel ranks
    per_rank: dict[Store, int] = {store: math.ceil(trainable_local * per_param[store] / shards[store])
                                  for store in per_param}
    base = frozen_base(meta, spec, local, shards["weights"])
    per_rank["weights"] += base.per_rank_bytes
    mode = cast(CheckpointingMode, spec.parallel.activation_checkpointing)
    measured = activation_bytes(meta, spec, split, experts)
    coverage = fp8_coverage(meta, spec, gpu)  # the speed rule on `gpu` decides as the backend will
    extras, extras_how = fp8_extra_bytes(meta, spec, split, gpu)
    # Buffers (RoPE tables, BERT's position ids) stay whole on every rank, in their own dtype.
    per_rank["buffers"] = sum(b.numel() * b.element_size() for b in meta.model.buffers())
    per_rank["fp8_extras"] = extras
    per_rank["activations"] = measured.per_rank(mode)
    host = offloaded(spec)
    device: dict[Store, int] = {store: 0 if store in host else per_rank[store] for store in STORES}
    compute = compute_bytes(spec)
    gathered = {fqn: base.gathered_bytes(fqn, numel, compute) for fqn, numel in experts.gathered_numels(local).items()}
    transient = transient_bytes(meta, spec, shards, gathered, measured.all_to_all, base.dequantize_bytes(),
                                dora_transient_bytes(meta.model, compute))
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
        activations_bytes=ActivationBytes(none=measured.per_rank("none"), full_checkpointing=measured.per_rank("full"),
                                          selective_checkpointing=measured.per_rank("selective"), mode=mode),
        phases_bytes=phases(device, transient), fp8_extras_counted=extras_how, transient_bytes=transient,
        fp8_coverage=coverage)
    if gpu is None:
        return result
    return replace(result, speed=step_speed(meta, spec, result, split, dims, local, gpu, nodes))
