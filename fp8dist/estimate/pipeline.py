"""What pipeline parallel (`parallel.pipeline_size`, the mesh's `pp` axis) changes in an estimate: which parameters a
pipeline rank holds, and the order its schedule runs forwards and backwards in, from which follow the activations it
keeps in flight and the gathers FSDP2 makes.

The split is the FSDP2 engine's (engines/fsdp2/pipeline_parallel.py, `keep_own_stages`): the decoder's layers by the
ranges `ParallelDims.stage_layers` gives, pipeline rank r running stages `ParallelDims.pipeline_stages(r)`; the
embeddings with the first stage, the final norm and the LM head with the last; the rotary embeddings' buffers on every
stage (each computes the position embeddings again). Parameters are attributed by name: `<decoder>.layers.<i>.*` to
the stage of layer i, `<decoder>.embed_tokens.*` to the first stage, everything else to the last.

The schedules' order per rank is torch 2.13's (torch/distributed/pipelining/schedules.py), written out here so that
the estimate stays torch-free at this point and says what it counts:
- `gpipe` (ScheduleGPipe): every microbatch's forward, then every backward: all M microbatches in flight;
- `1f1b` (Schedule1F1B): `warmup_chunks = min(M, num_stages - stage_index)` forwards, then one backward and one
  forward in turn, then the rest of the backwards: at most P - r microbatches in flight on pipeline rank r (P on the
  first);
- `interleaved_1f1b` (ScheduleInterleaved1F1B) and `zero_bubble` (ScheduleInterleavedZeroBubble): V local stages,
  `_get_warmup_ops` = min((V - 1) x M / rounds + k x (P - 1 - r), V x M) forward chunks (k = 2, and 1 for zero
  bubble; rounds = max(1, M // P)), the local stage of step s `(s // (M / rounds)) % V` forward and
  `V - 1 - ((s - warmup) // (M / rounds)) % V` backward, then `_get_1f1b_rank_ops`: a forward then a backward per
  step, then the cooldown's backwards. In flight: the warmup's chunks and the one forward before the first backward,
  each chunk its own local stage's microbatch. The zero-bubble schedule splits the backward into its input gradient
  (B) and its weight gradient (W, run `rank` steps later: `num_1f1b_microbatches = rank`); a chunk is counted in
  flight until its W, whole (an upper bound: after B only the inputs the weight gradients read are left).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Mapping, Sequence

from fp8dist.config.parallel import ParallelDims, pipeline_bubble, pipeline_microbatches
from fp8dist.config.spec import Spec
from fp8dist.translate.fsdp2 import fsdp2_layout

if TYPE_CHECKING:
    import torch

OpKind = Literal["F", "B", "W"]  # forward, backward (zero bubble: its input gradient), weight gradient (zero bubble)
Op = tuple[OpKind, int, int]  # (kind, local stage index on the rank, microbatch)
# What multiplies the hops from the last rank in the interleaved schedules' warmup (torch 2.13 schedules.py:
# ScheduleInterleaved1F1B `multiply_factor=2`, ScheduleInterleavedZeroBubble `multiply_factor=1`).
_WARMUP_FACTOR = {"interleaved_1f1b": 2, "zero_bubble": 1}


def schedule_ops(schedule: str, pp: int, stages_per_rank: int, microbatches: int, rank: int) -> list[Op]:
    """The compute actions pipeline rank `rank` runs in one schedule step, in torch 2.13's order (module docstring);
    the stage index of each is the rank's local one (0 .. stages_per_rank - 1)."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(m, pp - rank)
        ops: list[Op] = [("F", 0, i) for i in range(warmup)]
        forward = warmup
        for backward in range(m):
            ops.append(("B", 0, backward))
            if forward < m:
                ops.append(("F", 0, forward))
                forward += 1
        return ops
    if schedule not in _WARMUP_FACTOR:
        raise ValueError(f"unknown pipeline schedule {schedule!r}")
    local = stages_per_rank
    per_round = m // max(1, m // pp)
    warmup = min((local - 1) * per_round + _WARMUP_FACTOR[schedule] * (pp - 1 - rank), m * local)
    total = local * m + warmup  # warmup forwards, V x M - warmup forward-backward steps, warmup cooldown backwards
    zero_bubble = schedule == "zero_bubble"
    counters: dict[tuple[OpKind, int], int] = {}
    ops, backward_steps = [], []

    def act(kind: OpKind, stage: int) -> None:
        index = counters.get((kind, stage), 0)
        counters[kind, stage] = index + 1
        ops.append((kind, stage, index))

    def backward_stage(step: int) -> int:
        return local - 1 - ((step - warmup) // per_round) % local

    weights = 0
    for step in range(total):
        if step < warmup:
            act("F", (step // per_round) % local)
            continue
        if step < local * m:
            act("F", (step // per_round) % local)
        act("B", backward_stage(step))
        backward_steps.append(step)
        if zero_bubble and step - warmup >= rank:
            act("W", backward_stage(backward_steps[weights]))
            weights += 1
    while zero_bubble and weights < len(backward_steps):
        act("W", backward_stage(backward_steps[weights]))
        weights += 1
    return ops


def peak_in_flight(ops: Sequence[Op], chunk_bytes: Sequence[int], released_by: OpKind = "B") -> tuple[int, int]:
    """(the most bytes, the most chunks) kept for backward at once over `ops`: each forward keeps `chunk_bytes` of
    its local stage until the op `released_by` of the same chunk frees them."""
    held = chunks = most = most_chunks = 0
    for kind, stage, _ in ops:
        if kind == "F":
            held, chunks = held + chunk_bytes[stage], chunks + 1
            most, most_chunks = max(most, held), max(most_chunks, chunks)
        elif kind == released_by:
            held, chunks = held - chunk_bytes[stage], chunks - 1
    return most, most_chunks


def gathers_per_stage(ops: Sequence[Op], stages: int, reshard_after_forward: bool) -> list[int]:
    """The all-gathers FSDP2 makes of each local stage over one schedule step: a forward gathers a resharded stage
    and reshards it after (reshard_after_forward); a backward gathers it if resharded and leaves it gathered (torch
    2.13 torch/distributed/pipelining/stage.py: `set_reshard_after_backward(False)` for every microbatch but the
    last, whose gradients it reduces once, `perform_reduce_grad`)."""
    gathered, count = [False] * stages, [0] * stages
    for kind, stage, _ in ops:
        if kind == "W":  # a weight gradient reads activations and output gradients, not the weights
            continue
        if not gathered[stage]:
            count[stage] += 1
        gathered[stage] = kind == "B" or not reshard_after_forward
    return count


@dataclass(frozen=True)
class RankStages:
    """What one pipeline rank holds: its stages (index, decoder layers) and the parameter / buffer names of the
    meta model in them."""
    pp_rank: int
    stages: tuple[tuple[int, range], ...]
    first: bool  # the first stage is among them: the embeddings
    last: bool  # the last stage is among them: the final norm and the LM head, the logits and the loss
    parameters: frozenset[str]
    buffers: frozenset[str]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(i for _, layers in self.stages for i in layers)

    def holds(self, fqn: str) -> bool:
        return fqn in self.parameters

    def describe(self) -> str:
        """'stage 0: embeddings + layers 0-1' and so on, one per stage of the rank."""
        parts = []
        for index, layers in self.stages:
            span = f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else f"layer {layers.start}"
            first = "embeddings + " if index == 0 else ""
            last = " + norm + lm_head" if self.last and index == max(i for i, _ in self.stages) else ""
            parts.append(f"stage {index}: {first}{span}{last}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Pipeline:
    """The pipeline of a config on its mesh: the schedule, its sizes, and each pipeline rank's part."""
    schedule: str
    pp: int
    stages_per_rank: int
    microbatches: int
    microbatch_sequences: int  # sequences per microbatch: micro_batch_size / microbatches
    reshard_after_forward: bool
    ranks: tuple[RankStages, ...]
    stage_layers: tuple[range, ...]
    parameter_stages: Mapping[str, int]  # parameter fqn -> the stage that holds it

    @property
    def bubble_theory(self) -> float:
        return pipeline_bubble(self.pp, self.stages_per_rank, self.microbatches)

    def ops(self, pp_rank: int) -> list[Op]:
        return schedule_ops(self.schedule, self.pp, self.stages_per_rank, self.microbatches, pp_rank)

    @property
    def released_by(self) -> OpKind:
        return "W" if self.schedule == "zero_bubble" else "B"


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def pipeline_layout(model: torch.nn.Module, spec: Spec, dims: ParallelDims) -> Pipeline | None:
    """Each pipeline rank's stages and the names of what it holds in `model` (the meta model, after an adapter), or
    None without pipeline parallel. A model the engine cannot split into stages is refused as the run refuses it
    (engines/fsdp2/pipeline_parallel.py `decoder_of`)."""
    if dims.pp == 1:
        return None
    from fp8dist.engines.fsdp2.pipeline_parallel import decoder_of

    decoder = decoder_of(model)
    names = {id(module): name for name, module in model.named_modules()}
    prefix = names[id(decoder)]
    embeddings, rotary = f"{prefix}.embed_tokens.", f"{prefix}.rotary_emb."
    ranges = dims.stage_layers(len(decoder.layers))
    stage_of_layer = {i: index for index, layers in enumerate(ranges) for i in layers}
    last = len(ranges) - 1

    def stage(fqn: str) -> int | None:
        """The stage that holds `fqn`; None: every stage (the rotary embeddings' buffers)."""
        if fqn.startswith(rotary):
            return None
        found = _LAYER.search(f".{fqn}") if fqn.startswith(f"{prefix}.layers.") else None
        if found:
            return stage_of_layer[int(found.group(1))]
        return 0 if fqn.startswith(embeddings) else last

    params = [(fqn, stage(fqn)) for fqn, _ in model.named_parameters()]
    buffers = [(fqn, stage(fqn)) for fqn, _ in model.named_buffers()]
    ranks = []
    for pp_rank in range(dims.pp):
        own = dims.pipeline_stages(pp_rank)
        ranks.append(RankStages(
            pp_rank=pp_rank, stages=tuple((index, ranges[index]) for index in own), first=0 in own, last=last in own,
            parameters=frozenset(fqn for fqn, index in params if index in own),
            buffers=frozenset(fqn for fqn, index in buffers if index is None or index in own)))
    microbatches = pipeline_microbatches(spec)
    return Pipeline(schedule=spec.parallel.pipeline_schedule, pp=dims.pp, stages_per_rank=dims.pp_stages_per_rank,
                    microbatches=microbatches, microbatch_sequences=spec.train.micro_batch_size // microbatches,
                    reshard_after_forward=fsdp2_layout(spec).reshard_after_forward, ranks=tuple(ranks),
                    stage_layers=tuple(ranges), parameter_stages={fqn: index for fqn, index in params
                                                                  if index is not None})
