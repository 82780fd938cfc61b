"""Pipeline parallel on the `pp` mesh axis (`parallel.pipeline_size`): a Hugging Face decoder split by layer ranges
into stages that torch.distributed.pipelining's schedules run (torch 2.13 torch/distributed/pipelining/schedules.py),
as torchtitan does it (torchtitan/distributed/pipeline_parallel.py: split the model by layer ranges into stage
modules, one schedule over them, FSDP and TP applied per stage, float8 converted before).

Each rank keeps the model object with only its own stages' modules (`keep_own_stages`): the decoder layers in a
ModuleDict keyed by their index in the model, the embeddings on the rank of the first stage, the final norm and the
LM head on the rank of the last, so that every parameter keeps the name it has in the Hugging Face model (the
checkpoint, the export and the audit read those names, and a checkpoint reads back on another pipeline size by
name). A stage is a `DecoderStage`, a view over that model's modules whose forward is the decoder's own loop over
its layers (embeddings -> rotary embeddings and causal mask -> layers -> norm -> LM head); FSDP2 shards each stage
as a root of its own, its layers as units, on the data mesh of its pp slice.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from fp8dist.config.parallel import ParallelDims, pipeline_bubble
from fp8dist.errors import Fp8distError
from fp8dist.facts.torch import PIPELINE_SCHEDULES


def decoder_of(model) -> Any:
    """The decoder a causal LM wraps (`model.model` for Llama, Qwen, Mistral, Mixtral: transformers 5
    `base_model_prefix`), refused unless it has the parts a stage is made of."""
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    missing = [part for part in parts if decoder is None or not hasattr(decoder, part)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if missing or head is None or not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        raise Fp8distError(f"parallel.pipeline_size: {type(model).__name__} is not a Hugging Face decoder fp8dist can "
                           "split into stages (a causal LM whose decoder has embed_tokens, layers, norm and "
                           f"rotary_emb{f'; missing {missing}' if missing else ''})\n  fix: "
                           "parallel.pipeline_size=1 for this model")
    if getattr(model.config, "tie_word_embeddings", False):
        raise Fp8distError(f"parallel.pipeline_size: {type(model).__name__} ties its LM head to its embeddings "
                           "(tie_word_embeddings), and the two live on the first and the last stage, on different "
                           "ranks, where they would train apart\n  fix: parallel.pipeline_size=1 for this model")
    return decoder


class DecoderStage(torch.nn.Module):
    """Stage `index` of `count`: the decoder layers `layers` of `model`, with the embeddings on the first stage and
    the final norm and LM head on the last. Its submodules are the model's own (no copy), under the names they have
    in the model (`model.layers.<i>`, `lm_head`). Input: token ids (first stage) or hidden states; output: hidden
    states, or the logits on the last stage."""

    def __init__(self, model, layers: range, index: int, count: int):
        super().__init__()
        decoder, prefix = decoder_of(model), getattr(model, "base_model_prefix", "model")
        self.first, self.last, self.index = index == 0, index == count - 1, index
        self.config = model.config
        inner = torch.nn.Module()
        if self.first:
            inner.embed_tokens = decoder.embed_tokens
        inner.layers = torch.nn.ModuleDict({str(i): decoder.layers[i] for i in layers})
        inner.rotary_emb = decoder.rotary_emb  # buffers only: each stage computes the position embeddings again
        if self.last:
            inner.norm = decoder.norm
            self.lm_head = model.get_output_embeddings()
        self.add_module(prefix, inner)
        self._decoder_name = prefix

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        decoder = getattr(self, self._decoder_name)
        hidden = decoder.embed_tokens(inputs) if self.first else inputs
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # what the decoder's own forward builds (transformers 5 models/llama/modeling_llama.py LlamaModel.forward):
        # None for SDPA on a batch without padding, which then attends causally
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        position_embeddings = decoder.rotary_emb(hidden, position_ids=positions)
        for layer in decoder.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           position_ids=positions)
        if self.last:
            hidden = self.lm_head(decoder.norm(hidden))
        return hidden


@dataclass(frozen=True)
class PipelinePlan:
    """What pipeline parallel did on this rank (the run says it once)."""

    schedule: str
    microbatches: int
    stages: int  # all ranks' stages (pipeline_size x stages per rank)
    own: tuple[tuple[int, range], ...]  # (stage index, its layers) of the stages this rank runs

    @property
    def bubble_theory(self) -> float:
        """The idle fraction of a step the schedule has by design (fp8dist.config.parallel.pipeline_bubble)."""
        return pipeline_bubble(self.stages // len(self.own), len(self.own), self.microbatches)

    def summary(self) -> str:
        own = ", ".join(f"stage {index}: layers {layers.start}-{layers.stop - 1}" for index, layers in self.own)
        return (f"pipeline parallel: {self.stages} stages, schedule {self.schedule}, {self.microbatches} microbatches "
                f"per micro-batch; this rank runs {own}")


def keep_own_stages(model, dims: ParallelDims, pp_rank: int, section) -> tuple[list[DecoderStage], PipelinePlan]:
    """Split `model` into this rank's stages (ParallelDims.pipeline_stages) and drop the other ranks' modules from
    it, in place: the model then holds only this rank's parameters, under their names. `section`: the plan's
    fp8dist.translate.fsdp2.PipelineSection."""
    decoder = decoder_of(model)
    ranges = dims.stage_layers(len(decoder.layers))
    own = dims.pipeline_stages(pp_rank)
    stages = [DecoderStage(model, ranges[index], index, len(ranges)) for index in own]
    kept = {i for index in own for i in ranges[index]}
    decoder.layers = torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(decoder.layers) if i in kept})
    if 0 not in own:
        decoder.embed_tokens = None
    if len(ranges) - 1 not in own:
        decoder.norm = None
        setattr(model, _head_name(model), None)
    plan = PipelinePlan(schedule=section.schedule, microbatches=section.microbatches, stages=len(ranges),
                        own=tuple((index, ranges[index]) for index in own))
    return stages, plan


def _head_name(model) -> str:
    head = model.get_output_embeddings()
    return next(name for name, module in model.named_children() if module is head)


class PipelineSchedule:
    """One torch pipeline schedule over this rank's stages: `step(batch, scale)` runs one micro-batch (its
    `input_ids` on the first stage, its `labels` on the last) through every stage, forward and backward, and returns
    its mean loss on every rank of the pp group (the last stage's, broadcast)."""

    def __init__(self, stages: list[DecoderStage], plan: PipelinePlan, pp_mesh, device,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        from torch.distributed import pipelining

        self.group, self.stages, self.plan = pp_mesh.get_group(), stages, plan
        self.last_rank = dist.get_global_rank(self.group, (plan.stages - 1) % pp_mesh.size())  # the last stage's
        self._scale = 1.0
        pipeline_stages = [pipelining.PipelineStage(stage, stage.index, plan.stages, device, group=self.group)
                           for stage in stages]
        fact = PIPELINE_SCHEDULES[plan.schedule]
        schedule_class = getattr(pipelining, fact.torch_class)

        def loss_fn(logits, labels):
            return loss(logits, labels) * self._scale

        self.schedule = schedule_class(pipeline_stages if fact.multi_stage else pipeline_stages[0],
                                       n_microbatches=plan.microbatches, loss_fn=loss_fn)
        self.first = any(stage.first for stage in stages)
        self.last = any(stage.last for stage in stages)
        self.idle: list[float] = []  # per step: the fraction of the schedule's time spent waiting for a neighbour

    def step(self, batch: dict, scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one micro-batch; each microbatch's loss times `scale` (1 / the micro-batches of
        the optimizer step) is what backward sees; the schedule divides the gradients by its microbatch count."""
        other = sorted(set(batch) - {"input_ids", "labels"})
        if other:
            raise Fp8distError(f"parallel.pipeline_size: the batch has {', '.join(other)} beside input_ids and labels; "
                               "fp8dist's stages take token ids in and labels at the end only\n  fix: "
                               "parallel.pipeline_size=1 for this data")
        self._scale = scale
        losses: list[torch.Tensor] = []
        args = (batch["input_ids"],) if self.first else ()
        kwargs = {"target": batch["labels"], "losses": losses} if self.last else {}
        with _timed_waits() as waited:
            start = time.perf_counter()
            self.schedule.step(*args, **kwargs)
            self.idle.append(waited[0] / max(time.perf_counter() - start, 1e-9))
        mean = (torch.stack(losses).mean().detach().float() / scale if losses
                else torch.zeros((), dtype=torch.float32, device=batch["input_ids"].device))
        dist.broadcast(mean, src=self.last_rank, group=self.group)
        return mean


@contextlib.contextmanager
def _timed_waits() -> Iterator[list[float]]:
    """The seconds this rank's schedule spends waiting on its sends and receives: every schedule waits through
    `_wait_batch_p2p` (torch 2.13 torch/distributed/pipelining/schedules.py), timed here while the block runs. A rank
    waits while its neighbour computes: the measured bubble."""
    from torch.distributed.pipelining import schedules

    waited = [0.0]
    original = schedules._wait_batch_p2p

    def timed(work):
        start = time.perf_counter()
        try:
            return original(work)
        finally:
            waited[0] += time.perf_counter() - start

    schedules._wait_batch_p2p = timed
    try:
        yield waited
    finally:
        schedules._wait_batch_p2p = original
