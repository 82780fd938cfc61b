"""The step on a GPU (`fp8dist estimate ... --gpu NAME`): one rank's predicted time per optimizer step for the config
and for its bf16 twin (the same config, every Linear in bf16), from the estimate's own layout and the speed model
(speed.py, whose constants it uses; no constant of its own).

The layout: each Linear's shape on a rank (tensor parallel's shard of it) and the module filter's decision
(coverage.py), MoE experts as one grouped GEMM per weight over the rows a rank receives (tokens x top_k, balanced
routing), the tokens of a rank's micro-batch (micro_batch_size x seq_len / cp; tensor parallel's regions take the
whole sequence), the mesh and the bytes of each store a rank holds (memory.py). Per micro-batch: the Linears' GEMMs
and casts (linear_times, with what makes each Linear's input and output gradient, so what compile fuses:
Llama-style names, a norm before q/k/v/gate/up, SiLU x up before down_proj, attention before o_proj; q/k/v and
gate/up share their input's cast under compile, as its common-subexpression elimination merges identical casts),
flash attention's FLOPs, the blocks' elementwise work and the loss in bytes, what activation checkpointing
recomputes (full: the blocks' forward; selective, fp8dist's policy: the elementwise forward, every second bf16 mm,
the FP8 Linears' input casts). Per step: the optimizer over the rank's shards of masters, gradients and states.
Communication per mesh axis, in bytes from the layout: FSDP2 / ZeRO-3 gather every weight in forward and again in
backward (in the compute dtype, float8 for weights torchao all-gathers in float8) and reduce-scatter the gradients
in the reduce dtype every micro-batch; hybrid sharding all-reduces them over dp_replicate; ZeRO-1/2 reduce-scatter
the gradients and gather the updated weights once a step; ZeRO-0 all-reduces; tensor parallel gathers and
reduce-scatters each block's activations (all-reduces them without sequence parallel), exposed; expert parallel's
all-to-all, exposed. The data-parallel collectives overlap the compute (FSDP2's prefetch): exposed are one block's
gather and reduce-scatter plus whatever exceeds the compute. A collective is a ring over its axis' link: NVLink (or
PCIe) while the axis' ranks share a node, the network (hardware.INTER_NODE_BANDWIDTH per GPU) once they span nodes.
Pipeline parallel (`parallel.pipeline_size`, estimate/pipeline.py): each pipeline rank computes its stages' Linears,
layers (and the loss on the last stage) on microbatches of micro_batch_size / M sequences, M times a micro-batch
(smaller GEMMs: FP8 gains less); FSDP2 gathers a stage as often as the schedule's order makes it (pipeline.py
gathers_per_stage) and reduce-scatters its gradients once a micro-batch; the stages send each microbatch's
activations forward and their gradients backward (`pp`: micro_batch / M x seq_len x hidden in the compute dtype per
stage boundary and direction, a sequence shard of it under sequence parallel, counted exposed). The step is the
slowest pipeline rank's, its busy time stretched by the schedule's bubble (config/parallel.py pipeline_bubble:
(P - 1) / (V x M + P - 1) of the schedule idle, the `pipeline_bubble` part).
Not modelled: context parallel's K/V exchange (taken as hidden behind attention), the optimizer on the host, stages of
unequal time beyond taking the slowest.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from fp8dist.backends.experts import experts_modules
from fp8dist.backends.module_filter import LinearInfo
from fp8dist.config.parallel import DP_REPLICATE, DP_SHARD, EP, PP, TP, ParallelDims
from fp8dist.config.spec import Spec
from fp8dist.engines.registry import profile_for
from fp8dist.errors import Fp8distError
from fp8dist.estimate import speed
from fp8dist.estimate.coverage import decisions
from fp8dist.estimate.model import MetaModel, blocks
from fp8dist.estimate.pipeline import Pipeline, RankStages, gathers_per_stage
from fp8dist.estimate.result import Estimate, SpeedEstimate, SpeedLinear, Store
from fp8dist.estimate.tensor_parallel import TensorSplit
from fp8dist.facts.hardware import INTER_NODE_BANDWIDTH
from fp8dist.facts.torchao import torchao_experts_mode

# A Linear's last name -> (the group whose members read the same input, what makes its input, what makes its
# output's gradient). Unknown names: nothing shared, nothing fused.
ROLES: dict[str, tuple[str, speed.Producer, speed.Producer]] = {
    **{name: ("qkv", "norm", "elementwise") for name in ("q_proj", "k_proj", "query", "key", "wq", "wk")},
    **{name: ("qkv", "norm", "opaque") for name in ("v_proj", "value", "wv")},  # its gradient: attention's backward
    **{name: ("mlp_in", "norm", "elementwise") for name in ("gate_proj", "up_proj", "w1", "w3")},
    **{name: ("", "elementwise", "norm") for name in ("down_proj", "w2")},  # the residual's gradient: a norm's
    **{name: ("", "opaque", "norm") for name in ("o_proj", "wo", "out_proj")},
    "lm_head": ("", "norm", "opaque"),
}
PARTS = ("fp8_gemms", "high_precision_gemms", "casts", "attention", "norms_elementwise", "recompute", "optimizer",
         "communication_exposed")


@dataclass
class _Side:
    """One side's sums (the config or its bf16 twin), seconds per micro-batch unless said."""
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    linears: list[tuple[str, int, int, int, str, float]] = field(default_factory=list)


def _recipe(spec: Spec) -> tuple[str, str] | None:
    """(recipe, backend) the config runs, None without FP8."""
    return spec.fp8.recipe


def _collective(volume: float, ranks: int, extent: int, per_node: int, gpu: str, all_reduce: bool = False
                ) -> tuple[float, str]:
    """Seconds of a ring collective moving `volume` bytes per rank over `ranks` ranks spread over `extent`
    consecutive ranks, and the link it runs on."""
    if ranks <= 1 or volume <= 0:
        return 0.0, ""
    spec = speed.gpu_spec(gpu)
    bandwidth, link = ((INTER_NODE_BANDWIDTH, "network, 400 Gb/s per GPU") if extent > per_node
                       else (spec.intra_node_bandwidth, spec.intra_node_link))
    moved = volume * (ranks - 1) / ranks * (2 if all_reduce else 1)
    return moved / (bandwidth * speed.COMM_EFFICIENCY), link


def _elementwise(meta: MetaModel, spec: Spec, split: TensorSplit, tokens: int, gpu: str, compiled: bool,
                 forward_only: bool = False, layers: int | None = None, loss: bool = True) -> float:
    """Seconds of the blocks' norms, RoPE and MLP activation and of the loss, one micro-batch (`layers` blocks, every
    one by default; `loss`: the rank computes the loss)."""
    c, tp = meta.config, split.tp
    hidden, layers = c.hidden_size, c.num_hidden_layers if layers is None else layers
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    inner = (getattr(c, "moe_intermediate_size", None) or c.intermediate_size) * getattr(c, "num_experts_per_tok", 1)
    norm_elements = hidden // (tp if split.sequence_parallel else 1)  # a norm runs on its sequence shard
    rotary = getattr(c, "rope_parameters", None) or hasattr(c, "rope_theta")  # transformers 5 / older configs
    sizes = {"norm": (norm_elements, 2), "rope": ((heads + kv) * head_dim // tp, 1 if rotary else 0),
             "mlp_activation": (inner // tp, 1)}  # kind -> (elements per token, how many per block)
    bandwidth = speed.gpu_spec(gpu).memory_bandwidth * speed.MEMORY_EFFICIENCY
    share = 0.4 if forward_only else 1.0  # the forward's part of each op's bytes (a backward moves ~1.5x)
    total = 0.0
    for kind, (elements, count) in sizes.items():
        nbytes, passes = speed.ELEMENTWISE[kind][0 if compiled else 1]
        total += layers * count * (tokens * elements * nbytes / bandwidth + passes * speed.PASS_FIXED_S) * share
    if meta.causal_lm and not forward_only and loss:
        nbytes, passes = speed.ELEMENTWISE["loss"][0 if compiled else 1]
        total += tokens * c.vocab_size * nbytes / bandwidth + passes * speed.PASS_FIXED_S
    return total


def _attention(meta: MetaModel, spec: Spec, split: TensorSplit, gpu: str, sequences: int | None = None,
               layers: int | None = None) -> float:
    """Flash attention's seconds for one micro-batch (or `sequences` of it), forward + backward (causal: half the
    scores), over `layers` blocks (every one by default)."""
    c, t = meta.config, spec.train
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    queries = t.seq_len // spec.parallel.context_size
    sequences = t.micro_batch_size if sequences is None else sequences
    flops = 4 * sequences * queries * t.seq_len * head_dim * (c.num_attention_heads // split.tp)
    flops *= (0.5 if meta.causal_lm else 1.0) * (1 + speed.ATTENTION_BACKWARD_FLOPS) * (
        c.num_hidden_layers if layers is None else layers)
    return flops / (speed.gpu_spec(gpu).bf16_flops * speed.ATTENTION_EFFICIENCY)


def _linear_rows(meta: MetaModel, spec: Spec, split: TensorSplit,
                 gpu: str) -> list[tuple[LinearInfo, int, int, str | None]]:
    """(Linear, K and N on a rank, its recipe where converted, else None) of every Linear of the model, converted as
    the backend decides on `gpu` (precision.fp8.min_speedup and the per-Linear policy included: coverage.decisions)."""
    infos, chosen = decisions(meta, spec, gpu)
    rows = []
    for info, decision in zip(infos, chosen):
        style = split.linears.get(info.fqn)
        k = info.in_features // (split.tp if style == "rowwise" else 1)
        head = split.vocabulary is not None and info.fqn == split.vocabulary[1]  # a vocabulary split over tp
        n = info.out_features // (split.tp if style == "colwise" or head else 1)
        rows.append((info, k, n, decision.recipe if spec.fp8.enabled and decision.convert else None))
    return rows


def _side(meta: MetaModel, spec: Spec, split: TensorSplit, dims: ParallelDims, gpu: str, fp8: bool,
          weight_share: float, stage: RankStages | None = None, microbatches: int = 1) -> _Side:
    """The compute of one micro-batch on one rank, with FP8 as configured (`fp8`) or every Linear in bf16. Pipeline
    rank `stage`: its stages' Linears, blocks and (last stage) loss, on `microbatches` microbatches of the
    micro-batch, each its own GEMMs and passes."""
    side, compiled = _Side(), spec.compile
    tokens = spec.tokens_per_micro_batch // microbatches
    sequences = spec.train.micro_batch_size // microbatches
    layers = None if stage is None else len(stage.layers)
    loss = stage is None or stage.last
    backend = spec.fp8.recipe[1] if spec.fp8.recipe else ""
    in_blocks = tuple(f"{name}." for name, _ in blocks(meta.model, spec))
    shared: set[tuple[str, str]] = set()
    full, selective = (spec.parallel.activation_checkpointing == mode for mode in ("full", "selective"))
    for info, k, n, own in _linear_rows(meta, spec, split, gpu):
        if stage is not None and not stage.holds(f"{info.fqn}.weight"):
            continue
        converted = own is not None
        recipe = (own, backend) if fp8 and own is not None else None  # the Linear's own (the per-Linear policy)
        last = info.fqn.rsplit(".", 1)[-1]
        group, input_from, grad_from = ROLES.get(last, ("", "opaque", "opaque"))
        block = info.fqn.startswith(in_blocks)
        forward_bf16 = speed.gemm_seconds(tokens, k, n, "bf16", gpu)
        if recipe is not None and converted:
            key = (info.fqn.rsplit(".", 1)[0], group)
            reuse = compiled and recipe[1] == "torchao" and bool(group) and key in shared
            shared.add(key)
            times = speed.linear_times(tokens, k, n, recipe[0], gpu, backend=recipe[1], compiled=compiled,
                                       input_from=input_from, grad_from=grad_from, cast_input=not reuse,
                                       weight_share=weight_share)
            side.parts["fp8_gemms"] += times.gemms
            side.parts["casts"] += times.casts
            label = f"{recipe[1]} {recipe[0]}"
            fmt = speed.gemm_formats(recipe[0])[0]
            if block and (full or selective):  # the forward GEMM (full) and the casts' forward share, again
                forward = speed.gemm_seconds(tokens, k, n, fmt, gpu) if full else 0.0
                side.parts["recompute"] += forward + times.casts / 3
            alone = times if not reuse else speed.linear_times(  # the row: the Linear on its own, its input cast too
                tokens, k, n, recipe[0], gpu, backend=recipe[1], compiled=compiled, input_from=input_from,
                grad_from=grad_from, weight_share=weight_share)
            side.linears.append((info.fqn, tokens, k, n, label, alone.speedup))
        else:
            bf16 = sum(speed.gemm_seconds(*shape, "bf16", gpu) for shape in ((tokens, k, n), (tokens, n, k),
                                                                              (k, tokens, n)))
            side.parts["fp8_gemms" if converted and not fp8 else "high_precision_gemms"] += bf16
            if block and (full or selective):
                side.parts["recompute"] += forward_bf16 if full else forward_bf16 / 2
            side.linears.append((info.fqn, tokens, k, n, "bf16", 1.0))
    _experts(meta, spec, dims, gpu, tokens, side, fp8, full, stage)
    side.parts["attention"] = _attention(meta, spec, split, gpu, sequences, layers)
    side.parts["norms_elementwise"] = _elementwise(meta, spec, split, tokens, gpu, compiled, layers=layers, loss=loss)
    if full or selective:
        side.parts["recompute"] += _elementwise(meta, spec, split, tokens, gpu, compiled, forward_only=True,
                                                layers=layers)
    if full:
        side.parts["recompute"] += side.parts["attention"] / (1 + speed.ATTENTION_BACKWARD_FLOPS)
    side.parts = {part: seconds * microbatches for part, seconds in side.parts.items()}
    return side


def _experts(meta: MetaModel, spec: Spec, dims: ParallelDims, gpu: str, tokens: int, side: _Side, fp8: bool,
             full: bool, stage: RankStages | None = None) -> None:
    """MoE experts: per 3-D weight (E, N, K) one grouped GEMM per role over the rows a rank's experts receive, in
    the format torchao's experts mode picks on this GPU (`fp8` False: the bf16 twin)."""
    top_k = getattr(meta.config, "num_experts_per_tok", 1)
    recipe, mode, found = _recipe(spec), None, experts_modules(meta.model)
    if found and recipe is not None and recipe[1] == "torchao" and spec.fp8.torchao.experts != "none":
        mode, why = torchao_experts_mode(spec.fp8.torchao.experts, False, speed.gpu_spec(gpu).capability)
        if mode is None:  # the backend refuses it on this GPU: so does the prediction
            raise Fp8distError(f"precision.fp8.torchao.experts={spec.fp8.torchao.experts} on {gpu}: {why}")
    fmt_recipe = {"mxfp8": "mxfp8", "float8": "rowwise"}.get(mode or "")
    for name, module in found:
        for key, weight in ((k, w) for k, w in module.named_parameters(recurse=False) if w.dim() == 3
                            and (stage is None or stage.holds(f"{name}.{k}"))):
            experts, n, k = weight.shape[0] // dims.ep, weight.shape[1], weight.shape[2]
            rows = tokens * top_k  # balanced routing: each rank's experts receive its tokens x top_k rows
            m = max(rows // experts, 1)
            shapes = ((m, k, n), (m, n, k), (k, m, n))
            if fmt_recipe and fp8:
                gemms = sum(speed.gemm_seconds(*s, "fp8", gpu, 1 / 32 if fmt_recipe == "mxfp8" else 0.0,
                                               count=experts) for s in shapes)
                activation = speed.cast_passes(fmt_recipe, "activation", "opaque", spec.compile)
                weights = speed.cast_passes(fmt_recipe, "weight", "parameter", spec.compile)
                casts = 0.0
                for numel, passes in ((rows * k, activation), (rows * n, activation), (experts * k * n, weights)):
                    casts += sum(speed.pass_seconds(numel, p, gpu) for p in passes)
                side.parts["fp8_gemms"] += gemms
                side.parts["casts"] += casts
                bf16 = sum(speed.gemm_seconds(*s, "bf16", gpu, count=experts) for s in shapes)
                side.linears.append((f"{name}.{key}", m, k, n, f"torchao {mode} experts", bf16 / (gemms + casts)))
            else:
                gemms = sum(speed.gemm_seconds(*s, "bf16", gpu, count=experts) for s in shapes)
                side.parts["fp8_gemms" if fmt_recipe else "high_precision_gemms"] += gemms
                side.linears.append((f"{name}.{key}", m, k, n, "bf16", 1.0))
            if full:
                side.parts["recompute"] += gemms / 3


def _communication(meta: MetaModel, spec: Spec, result: Estimate, split: TensorSplit, dims: ParallelDims,
                   local: Mapping[str, int], gpu: str, nodes: int, fp8: bool, converted: set[str],
                   stage: RankStages | None = None, pipeline: Pipeline | None = None) -> dict[str, dict[str, Any]]:
    """Per mesh axis: bytes a rank sends per micro-batch (per step for what happens once a step), seconds, link.
    Pipeline rank `stage` of `pipeline`: of its stages' parameters and layers, and the `pp` row."""
    per_node = result.world_size // nodes
    compute = {"bf16": 2, "fp32": 4, "fp16": 2}[spec.precision.compute_dtype]
    reduce = {"bf16": 2, "fp32": 4, "fp16": 2}[spec.precision.reduce_dtype]
    params = [(f, p) for f, p in meta.model.named_parameters() if stage is None or stage.holds(f)]
    f8_gather = fp8 and spec.float8_all_gather

    def gathered_bytes(f: str) -> int:
        return local[f] * (1 if f8_gather and f.rsplit(".", 1)[0] in converted and f.endswith(".weight") else compute)

    gathered = sum(gathered_bytes(f) for f, _ in params)
    grads = sum(local[f] * reduce for f, p in params if p.requires_grad)
    tp, out = dims.tp, {}
    shard = result.shards["weights"]
    if profile_for(spec).gathers_weights(spec):
        extent = shard * tp
        gathers = 2 * gathered  # each weight in forward and again in backward
        if stage is not None and pipeline is not None:  # as often as the schedule's order regathers each stage
            counts = gathers_per_stage(pipeline.ops(stage.pp_rank), len(stage.stages),
                                       pipeline.reshard_after_forward)
            gathers = sum(count * sum(gathered_bytes(f) for f, _ in params if pipeline.parameter_stages[f] == index)
                          for count, (index, _) in zip(counts, stage.stages))
        volume = gathers + grads
        seconds = (_collective(gathers, shard, extent, per_node, gpu)[0]
                   + _collective(grads, shard, extent, per_node, gpu)[0])
        out[DP_SHARD] = {"bytes": volume, "seconds": seconds,
                           "link": _collective(1, shard, extent, per_node, gpu)[1], "overlapped": True}
        if dims.dp_replicate > 1:
            s, link = _collective(grads / shard, dims.dp_replicate, result.world_size, per_node, gpu, all_reduce=True)
            out[DP_REPLICATE] = {"bytes": 2 * grads / shard, "seconds": s, "link": link, "overlapped": True}
    else:
        ranks = dims.data_size
        zero = spec.deepspeed.zero_stage
        s, link = _collective(grads, ranks, result.world_size, per_node, gpu, all_reduce=zero == 0)
        out["dp"] = {"bytes": grads * (2 if zero == 0 else 1), "seconds": s, "link": link, "overlapped": True}
        if zero in (1, 2):
            weights = sum(local[f] * compute for f, p in params if p.requires_grad)
            s, link = _collective(weights, ranks, result.world_size, per_node, gpu)
            ga = spec.train.gradient_accumulation_steps  # once a step: a micro-batch's share
            out["dp_weights_after_step"] = {"bytes": weights / ga, "seconds": s / ga,
                                            "link": link, "overlapped": False}
    tokens = spec.tokens_per_micro_batch
    layers = meta.config.num_hidden_layers if stage is None else len(stage.layers)
    if tp > 1:  # per block, forward and backward: 4 gathers (float8 under torchao's tensorwise styles), 4 reductions
        gather = 1 if fp8 and _recipe(spec) == ("tensorwise", "torchao") else compute
        volume = tokens * meta.config.hidden_size * (4 * gather + 4 * compute) * layers
        s, link = _collective(volume, tp, tp, per_node, gpu, all_reduce=not split.sequence_parallel)
        out[TP] = {"bytes": volume, "seconds": s, "link": link, "overlapped": False}
    if dims.ep > 1:
        top_k = getattr(meta.config, "num_experts_per_tok", 1)
        volume = 4 * tokens * top_k * meta.config.hidden_size * compute * result.expert_parallel.moe_layers
        s, link = _collective(volume, dims.ep, dims.ep * dims.cp * tp, per_node, gpu)
        out[EP] = {"bytes": volume, "seconds": s, "link": link, "overlapped": False}
    if stage is not None and pipeline is not None:
        out[PP] = _point_to_point(meta, spec, split, stage, pipeline, result.world_size, per_node, gpu, compute)
    return out


def _point_to_point(meta: MetaModel, spec: Spec, split: TensorSplit, stage: RankStages, pipeline: Pipeline,
                    world: int, per_node: int, gpu: str, compute: int) -> dict[str, Any]:
    """The `pp` row: what pipeline rank `stage` sends per micro-batch, each microbatch's activations forward from
    each of its stages but the last and their gradients backward from each but the first (micro_batch / M x seq_len
    x hidden in the compute dtype a microbatch, M a micro-batch; under sequence parallel a tp rank's sequence shard:
    the blocks' outputs are local Shard(1) tensors, engines/fsdp2/tensor_parallel.py), over the link between
    neighbouring pp ranks (world / pp ranks apart; interleaved schedules also from the last pp rank back to the
    first). Counted exposed: a stage waits for its input (torch 2.13 pipelining/schedules.py `_wait_batch_p2p`)."""
    count = len(pipeline.stage_layers)
    sends = sum((index != count - 1) + (index != 0) for index, _ in stage.stages)
    shard = split.tp if split.sequence_parallel else 1
    volume = sends * spec.tokens_per_micro_batch * meta.config.hidden_size * compute / shard
    apart = world // pipeline.pp
    pairs = [(i, (i + apart) % world) for i in range(world)] if pipeline.stages_per_rank > 1 else [
        (i, i + apart) for i in range(world - apart)]
    spec_gpu = speed.gpu_spec(gpu)
    bandwidth, link = ((INTER_NODE_BANDWIDTH, "network, 400 Gb/s per GPU")
                       if any(a // per_node != b // per_node for a, b in pairs)
                       else (spec_gpu.intra_node_bandwidth, spec_gpu.intra_node_link))
    return {"bytes": volume, "seconds": volume / (bandwidth * speed.COMM_EFFICIENCY), "link": link,
            "overlapped": False}


def _exposed(comm: Mapping[str, Mapping[str, Any]], compute: float, units: int) -> float:
    """Seconds of communication not hidden behind `compute`: one unit's share of each overlapped collective (the
    first gather, the last reduce-scatter) and what exceeds the compute, plus every collective that blocks."""
    overlapped = sum(row["seconds"] for row in comm.values() if row["overlapped"])
    blocking = sum(row["seconds"] for row in comm.values() if not row["overlapped"])
    return overlapped / max(units, 1) + max(0.0, overlapped - compute) + blocking


def _optimizer(result: Estimate, gpu: str, rank: Mapping[Store, int] | None = None) -> float:
    """Seconds of one optimizer step on the device: AdamW reads and writes the rank's masters (the weights where
    they are the masters) and both moments, and reads its gradients (`rank`: a pipeline rank's stores, default the
    estimate's rank); on the host: 0 (not modelled)."""
    if "optimizer" in result.offloaded_to_host:
        return 0.0
    held = result.per_rank_bytes if rank is None else rank
    masters = held["master_weights"] or held["weights"]
    moved = 2 * masters + held["gradients"] + 2 * held["optimizer"]
    bandwidth = speed.gpu_spec(gpu).memory_bandwidth * speed.MEMORY_EFFICIENCY
    return moved / bandwidth + speed.OPTIMIZER_PASSES * speed.PASS_FIXED_S


def _grouped(rows: list[tuple[str, int, int, int, str, float]]) -> tuple[SpeedLinear, ...]:
    """One row per Linear name, the block index as `*`, with how many blocks have it."""
    out: dict[tuple[str, int, int, int, str], list[float]] = {}
    for fqn, m, k, n, fmt, ratio in rows:
        out.setdefault((re.sub(r"\.\d+\.", ".*.", fqn), m, k, n, fmt), []).append(ratio)
    return tuple(SpeedLinear(name, m, k, n, fmt, ratios[0], len(ratios))
                 for (name, m, k, n, fmt), ratios in out.items())


def _reasons(spec: Spec, fp8: _Side, bf16: _Side, linears: tuple[SpeedLinear, ...], comm: Mapping[str, Any],
             twin_comm: Mapping[str, Any], tokens: int) -> list[str]:
    """Why the ratio is what it is, in plain words, the largest cost first."""
    if _recipe(spec) is None:
        return ["no FP8 backend in the config: it is its own bf16 twin"]
    found: list[tuple[float, str]] = []
    step = sum(fp8.parts.values())
    slow = sorted((row for row in linears if row.format != "bf16" and row.speedup < 1), key=lambda row: row.speedup)
    if slow:
        shown = ", ".join(f"{row.module.rsplit('.', 1)[-1]} ({row.k}x{row.n}) at {row.speedup:.2f}x"
                          for row in slow[:4])
        lost = sum((1 - row.speedup) * row.count for row in slow) / max(sum(row.count for row in linears), 1)
        found.append((lost, f"{tokens} tokens per micro-batch: {shown} (FP8 pays where M, K and N are large; these "
                            "GEMMs are too small for their casts)"))
    if not spec.compile:
        found.append((fp8.parts["casts"] / step, "torch.compile is off (`compile: false`): each float8 cast runs op by "
                      f"op through fp32 and fuses into nothing; the casts take {fp8.parts['casts'] * 1e3:.1f} ms, "
                      f"{fp8.parts['casts'] / step:.0%} of the step"))
    elif fp8.parts["casts"] / step > 0.05:
        found.append((fp8.parts["casts"] / step, f"the casts and scale computations take {fp8.parts['casts'] * 1e3:.1f}"
                      f" ms, {fp8.parts['casts'] / step:.0%} of the step"))
    high = fp8.parts["high_precision_gemms"]
    gemms = high + fp8.parts["fp8_gemms"]
    if gemms and high / gemms > 0.05:
        names = sorted({row.module.rsplit(".", 1)[-1] for row in linears if row.format == "bf16"})
        found.append((high / step, f"{', '.join(names[:3])}{' and more' if len(names) > 3 else ''} in bf16 "
                      f"{'is' if len(names) == 1 else 'are'} {high / gemms:.0%} of the GEMM time"))
    fixed = sum(bf16.parts[p] for p in ("attention", "norms_elementwise", "optimizer"))
    if fixed / sum(bf16.parts.values()) > 0.2:
        found.append((fixed / step, f"attention, norms / elementwise ops and the optimizer are "
                      f"{fixed / sum(bf16.parts.values()):.0%} of the bf16 step and FP8 does not touch them"))
    saved = bf16.parts["fp8_gemms"] - fp8.parts["fp8_gemms"]
    if saved > 0.01 * step:
        found.append((saved / step, f"the FP8 GEMMs save {saved * 1e3:.1f} ms against bf16 "
                      f"({bf16.parts['fp8_gemms'] * 1e3:.1f} -> {fp8.parts['fp8_gemms'] * 1e3:.1f} ms)"))
    exposed, twin_exposed = fp8.parts["communication_exposed"], bf16.parts["communication_exposed"]
    if twin_exposed - exposed > 0.02 * step:
        sent, twin_sent = (sum(row["bytes"] for row in side.values()) for side in (comm, twin_comm))
        found.append(((twin_exposed - exposed) / step, f"less communication waits: {twin_exposed * 1e3:.1f} ms exposed "
                      f"in bf16, {exposed * 1e3:.1f} ms here (a rank sends {sent / 2**30:.1f} GiB a micro-batch "
                      f"against {twin_sent / 2**30:.1f} GiB in bf16, and the longer FP8 step hides more of it)"))
    if exposed / step > 0.05:
        axis = max(comm, key=lambda a: comm[a]["seconds"])
        found.append((exposed / step, f"communication left exposed: {exposed * 1e3:.1f} ms, {exposed / step:.0%} of "
                      f"the step (most on {axis}, over {comm[axis]['link']})"))
    return [text for _, text in sorted(found, key=lambda item: -item[0])]


def _notes(spec: Spec, gpu: str, nodes: int, world: int, pipeline: Pipeline | None = None,
           slowest: int = 0) -> list[str]:
    notes = [f"{world} GPU(s) on {nodes} node(s) of {gpu}; the bf16 twin is this config with every Linear in bf16"]
    if pipeline is not None:
        notes.append(f"pipeline parallel: the step is pp rank {slowest}'s, the slowest, on {pipeline.microbatches} "
                     f"microbatches of {pipeline.microbatch_sequences} sequence(s) (GEMMs of those tokens), plus the "
                     f"{pipeline.schedule} schedule's bubble, {pipeline.bubble_theory:.1%} of it idle by design "
                     "((P - 1) / (V x M + P - 1)); the point-to-point sends between stages counted exposed")
    if spec.fp8.backend == "torchao" and spec.fp8.torchao.emulate:
        notes.append("precision.fp8.torchao.emulate is on: predicted as the native run on the GPU (emulate false)")
    if spec.fp8.backend == "msamp":
        notes.append("MS-AMP counted as per-tensor delayed scaling with its own cast kernels")
    if spec.parallel.context_size > 1:
        notes.append("context parallel: the K/V exchange is taken as hidden behind attention")
    if spec.float8_all_gather:
        notes.append("float8 all-gather: the converted weights are gathered in 1 byte and cast on each rank's shard")
    return notes


def check(spec: Spec, gpu: str, nodes: int, world: int) -> None:
    """Refuse, before any model is built, a GPU the model does not know, a node count that does not divide the
    world, or a recipe the GPU cannot run."""
    speed.gpu_spec(gpu)
    if nodes < 1 or world % nodes:
        raise Fp8distError(f"--nodes {nodes} must be at least 1 and divide --world-size {world}\n  fix: --nodes N "
                           f"with N dividing {world} (the ranks of one node each: {world} / N)")
    recipe = _recipe(spec)
    if recipe is not None:
        speed.check_supported(recipe[0], gpu, recipe[1])


def step_speed(meta: MetaModel, spec: Spec, result: Estimate, split: TensorSplit, dims: ParallelDims,
               local: Mapping[str, int], gpu: str, nodes: int = 1, pipeline: Pipeline | None = None) -> SpeedEstimate:
    """The predicted step of one rank of `result`'s run on `nodes` nodes of `gpu`, and of its bf16 twin. Under
    pipeline parallel (`pipeline`): each pipeline rank's, and the step is the slowest's, stretched by the bubble."""
    check(spec, gpu, nodes, result.world_size)
    shard = result.shards["weights"]
    share = 1 / shard if spec.float8_all_gather and shard > 1 else 1.0
    converted = {info.fqn for info, _, _, own in _linear_rows(meta, spec, split, gpu) if own is not None}
    ga = spec.train.gradient_accumulation_steps
    microbatches = 1 if pipeline is None else pipeline.microbatches
    ranks: list[RankStages | None] = [None] if pipeline is None else list(pipeline.ranks)
    held = {} if result.pipeline is None else {row.pp_rank: row.per_rank_bytes for row in result.pipeline.ranks}
    sides: dict[bool, _Side] = {}
    comms: dict[bool, dict[str, dict[str, Any]]] = {}
    slowest: dict[bool, int] = {}
    for fp8 in (True, False):
        for stage in ranks:
            side = _side(meta, spec, split, dims, gpu, fp8, share if fp8 else 1.0, stage, microbatches)
            comm = _communication(meta, spec, result, split, dims, local, gpu, nodes, fp8, converted, stage, pipeline)
            compute = sum(v for p, v in side.parts.items() if p != "communication_exposed")
            units = len(blocks(meta.model, spec) if stage is None else stage.layers) + 1
            side.parts["communication_exposed"] = _exposed(comm, compute, units)
            side.parts = {p: v * ga for p, v in side.parts.items()}
            side.parts["optimizer"] = _optimizer(result, gpu, None if stage is None else held[stage.pp_rank])
            if pipeline is not None:  # the schedule idles (P - 1) / (V x M + P - 1) of its time: busy / (1 - bubble)
                bubble = pipeline.bubble_theory
                side.parts["pipeline_bubble"] = (sum(side.parts.values()) - side.parts["optimizer"]) * bubble / (
                    1 - bubble)
            if fp8 not in sides or sum(side.parts.values()) > sum(sides[fp8].parts.values()):
                sides[fp8], comms[fp8], slowest[fp8] = side, comm, 0 if stage is None else stage.pp_rank
    tokens = spec.tokens_per_micro_batch
    per_gpu = ga * tokens / (split.tp * dims.pp)  # every pipeline rank of a data rank runs the same tokens
    step, twin = (sum(sides[fp8].parts.values()) for fp8 in (True, False))
    linears = _grouped(sides[True].linears)
    communication = {axis: {"bytes": int(row["bytes"] * ga), "seconds": round(row["seconds"] * ga, 6),
                            "bf16_bytes": int(comms[False][axis]["bytes"] * ga),
                            "bf16_seconds": round(comms[False][axis]["seconds"] * ga, 6),
                            "link": row["link"], "overlapped": row["overlapped"]} for axis, row in comms[True].items()}
    counted = None if pipeline is None else {
        "schedule": pipeline.schedule, "microbatches": pipeline.microbatches,
        "bubble_theory": round(pipeline.bubble_theory, 6), "slowest_rank": slowest[True],
        "bf16_slowest_rank": slowest[False], "bubble_s": round(sides[True].parts["pipeline_bubble"], 6),
        "point_to_point_bytes": communication[PP]["bytes"]}
    return SpeedEstimate(gpu=gpu, nodes=nodes, step_s=step, bf16_step_s=twin, tokens_per_s=per_gpu / step,
                         bf16_tokens_per_s=per_gpu / twin, parts=sides[True].parts, bf16_parts=sides[False].parts,
                         communication=communication, linears=linears,
                         reasons=tuple(_reasons(spec, sides[True], sides[False], linears, comms[True], comms[False],
                                                tokens // microbatches)),
                         notes=tuple(_notes(spec, gpu, nodes, result.world_size, pipeline, slowest[True])),
                         pipeline=counted)
