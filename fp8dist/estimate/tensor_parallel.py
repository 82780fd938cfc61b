"""What tensor parallel splits in the model an estimate counts: the Linears of the model's plan and, where it divides,
the vocabulary, each parameter on the dim torch's DTensor styles shard it (torch 2.13
torch/distributed/tensor/parallel/style.py: ColwiseParallel weight and bias `Shard(0)`, RowwiseParallel weight
`Shard(1)` and bias `Replicate()`, an nn.Embedding under RowwiseParallel `Shard(0)`).

The Linears are found by the FSDP2 engine's own resolution of the plan (engines/fsdp2/tensor_parallel.py: the config's
`base_model_tp_plan`, else fp8dist's Llama-style plan), so the estimate splits what a run splits and refuses what it
refuses (plan styles it does not apply, a plan no module matches). DeepSpeed AutoTP reads the same transformers plan
first (deepspeed 0.19.8 runtime/engine.py: "custom config > HF tp_plan > AutoTP"); its vocabulary split differs
(the LM head by the model class's `_tp_plan`, the embedding whole) and is counted here as FSDP2's.

FSDP2 then shards each tensor-parallel shard over the data axes (torchao 0.18 torchao/float8/fsdp_utils.py: "apply TP
first then FSDP2"), and ZeRO partitions over the data-parallel ranks: a split parameter's stores are divided by
tp x the store's data-parallel shards (the engines' `shard_counts`), every other parameter's by those shards alone.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping

from fp8dist.config.parallel import sequence_parallel
from fp8dist.config.spec import Spec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorSplit:
    """The model's parameters tensor parallel splits over `tp` ranks; names are fqns of the meta model."""
    tp: int
    linears: Mapping[str, str]  # Linear fqn -> "colwise" | "rowwise", as the plan names it
    vocabulary: tuple[str, str] | None  # (embedding, LM head) fqns where the vocabulary is split over tp
    final_norm: str | None  # the base model's norm after the blocks: on the sequence shard under sequence parallel
    plan: str  # where the plan came from ("" without tensor parallel)
    sequence_parallel: bool = False  # the activations between the split modules split along the sequence too

    def split_dims(self) -> dict[str, int]:
        """Parameter fqn -> the dim split over tp (a parameter not named stays whole on every tp rank)."""
        dims = {}
        for fqn, style in self.linears.items():
            dims[f"{fqn}.weight"] = 0 if style == "colwise" else 1
            if style == "colwise":
                dims[f"{fqn}.bias"] = 0  # a row-wise bias is replicated, added after the reduction
        if self.vocabulary:  # the embedding's rows and the LM head's output columns: the vocabulary
            embed, head = self.vocabulary
            dims.update({f"{embed}.weight": 0, f"{head}.weight": 0, f"{head}.bias": 0})
        return dims

    @property
    def regions(self) -> frozenset[str]:
        """The modules (attention, MLP) whose Linears are split: each gathers its input whole from the sequence
        shards under sequence parallel, and holds only its tp rank's heads / columns inside."""
        return frozenset(fqn.rpartition(".")[0] for fqn in self.linears)

    def local_numels(self, model: torch.nn.Module) -> dict[str, int]:
        """Parameter fqn -> the elements one tp rank holds of it."""
        dims = self.split_dims()
        return {name: param.numel() // (self.tp if name in dims else 1) for name, param in model.named_parameters()}


def tensor_split(model: torch.nn.Module, spec: Spec) -> TensorSplit:
    """What `parallel.tensor_size` splits in `model` (the meta model, after an adapter, as a run splits it), or the
    engine's Fp8distError where its plan cannot be applied."""
    tp = spec.parallel.tensor_size
    if tp == 1:
        return TensorSplit(tp=1, linears={}, vocabulary=None, final_norm=None, plan="")
    from fp8dist.engines.fsdp2.tensor_parallel import (base_model, final_norm, model_plan, planned_linears,
                                                       vocabulary_split)

    plan, source = model_plan(model)
    names = {id(module): name for name, module in model.named_modules()}  # the plan's fqns are the base model's
    linears = {names[id(module)]: style
               for style, module in planned_linears(base_model(model), plan, type(model).__name__).values()}
    return TensorSplit(tp=tp, linears=linears, vocabulary=vocabulary_split(model, tp), final_norm=final_norm(model),
                       plan=source, sequence_parallel=sequence_parallel(spec))


@contextlib.contextmanager
def local_linears(model: torch.nn.Module, split: TensorSplit) -> Iterator[None]:
    """`model` with each split Linear holding one tp rank's shard of its weight (and column-wise bias) while inside:
    what a forward on one rank computes with (transformers' attention reshapes to `-1` heads, so it runs on a rank's
    heads as under a tp plan). The vocabulary stays whole: its logits are gathered whole on every rank."""
    import torch

    dims = split.split_dims()
    saved = []
    for fqn in split.linears:
        module = model.get_submodule(fqn)
        for name, param in list(module.named_parameters(recurse=False)):
            dim = dims.get(f"{fqn}.{name}")
            if dim is None:
                continue
            shape = list(param.shape)
            shape[dim] //= split.tp
            saved.append((module, name, param))
            module._parameters[name] = torch.nn.Parameter(
                torch.empty(shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad)
    try:
        yield
    finally:
        for module, name, param in saved:
            module._parameters[name] = param
