"""Tensor and sequence parallel on the `tp` axis of the run's mesh, FP8 kept (FSDP2 engine).

The plan is the model's own: transformers 5 configs carry `base_model_tp_plan` (e.g.
models/llama/configuration_llama.py: q/k/v/gate/up `colwise`, o/down `rowwise`); fp8dist's `DEFAULT_PLAN` (the same
Llama names) serves a model without one. Each planned Linear gets torch's DTensor style for its kind (torch 2.13
torch/distributed/tensor/parallel/style.py), chosen by what the Linear became in FP8 conversion:
- torchao tensorwise `Float8Linear`: torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel`, and under sequence
  parallel `PrepareFloat8ModuleInput`, so activations are all-gathered in float8 once per attention / MLP
  (torchao 0.18 torchao/float8/float8_tensor_parallel.py; torchtitan v0.2.2 models/llama3/infra/parallelize.py
  apply_tp). Those styles assume tensorwise scaling and do not check it (a rowwise Linear in them gives NaNs,
  torchtitan #3109): they are given to tensorwise Linears only.
- rowwise / rowwise_with_gw_hp Float8Linear, MXFP8 and high-precision Linears: the plain styles (communication in the
  compute dtype: torchao "for rowwise scaling, keep high precision all_gather", testing/training/dtensor_utils.py).
Sequence parallel (Megatron-style): the residual stream between the blocks' attention and MLP stays sharded along the
sequence (`Shard(1)`): the block norms run `SequenceParallel`, attention and MLP gather their input, o/down
reduce-scatter their output. The model-level rotary embeddings and masks are computed from the whole sequence, so
the first block takes the embedding's replicated output and shards it, and the LM head gathers the last norm's
output back.
The vocabulary is split over tp (embedding row-wise, LM head column-wise, logits gathered) where it divides by tp and
the two are not tied; otherwise both stay whole on every tp rank (their gradients agree there: every tp rank computes
them on the same full activations).

Order (written once in engine.prepare): float8 conversion -> tensor parallel -> MXFP8 conversion -> activation
checkpointing -> compile -> fully_shard on the data axes (torchao: "For Float8: quantize first, then parallelize ...
For MXFP8: parallelize first, then quantize", dtensor_utils.py; fsdp_utils.py: "apply TP first then FSDP2").
"""
from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from fp8dist.errors import Fp8distError

# fp8dist's plan for a model whose config has no base_model_tp_plan: the names of Llama-style decoders (transformers 5
# models/llama/configuration_llama.py base_model_tp_plan), relative to the base model.
DEFAULT_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
                "layers.*.mlp.down_proj": "rowwise"}
STYLES = ("colwise", "rowwise")  # the plan styles fp8dist applies; any other is refused naming it
NORM_CLASS_SUFFIXES = ("RMSNorm", "LayerNorm")


@dataclass
class TensorParallelPlan:
    """What `apply` did: the Linears split per style, the ones that all-gather float8, and what stayed whole."""

    source: str  # where the plan came from
    colwise: list[str] = field(default_factory=list)
    rowwise: list[str] = field(default_factory=list)
    float8_styles: list[str] = field(default_factory=list)
    vocabulary: str = ""
    sequence_parallel: bool = False

    def summary(self) -> str:
        return (f"tensor parallel ({self.source}): {len(self.colwise)} column-wise, {len(self.rowwise)} row-wise "
                f"Linears ({len(self.float8_styles)} with torchao's float8 styles); {self.vocabulary}; sequence "
                f"parallel {'on' if self.sequence_parallel else 'off'}")


def model_plan(model) -> tuple[dict[str, str], str]:
    """(plan relative to the base model, where it came from): the config's base_model_tp_plan, else DEFAULT_PLAN."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if plan:
        return dict(plan), f"{type(model.config).__name__}.base_model_tp_plan"
    return dict(DEFAULT_PLAN), "fp8dist's Llama-style plan (the model's config has no base_model_tp_plan)"


def base_model(model) -> Any:
    """transformers' PreTrainedModel.base_model (the decoder under a ...ForCausalLM), or the model itself."""
    return getattr(model, "base_model", model)


def _is_tensorwise_float8(module) -> bool:
    """A torchao Float8Linear with tensorwise input scaling (torchao imported only for a model that has one)."""
    if "Float8Linear" not in {cls.__name__ for cls in type(module).__mro__}:
        return False
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    return (isinstance(module, Float8Linear)
            and module.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE)


def _hidden_first(module, args, kwargs):
    """Forward pre-hook: `hidden_states` passed by keyword (transformers' decoder layers call attention so) moves to
    the first position, so one positional input style covers both call forms."""
    if "hidden_states" in kwargs:
        kwargs = dict(kwargs)
        args = (kwargs.pop("hidden_states"), *args)
    return args, kwargs


def planned_linears(base: torch.nn.Module, plan: dict[str, str],
                    model_name: str) -> dict[str, tuple[str, torch.nn.Module]]:
    """fqn (relative to the base model) -> (style, module) for every module a plan entry names."""
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise Fp8distError(f"{model_name}: its tensor-parallel plan uses {', '.join(unknown)}, which fp8dist does not "
                           f"apply (it applies {', '.join(STYLES)}: dense decoder Linears; MoE experts are expert "
                           "parallel's)\n  fix: parallel.tensor_size=1 for this model")
    found: dict[str, tuple[str, torch.nn.Module]] = {}
    for fqn, module in base.named_modules():
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(fqn, pattern)), None)
        if style is not None:
            if not isinstance(module, torch.nn.Linear):
                raise Fp8distError(f"{model_name}: the tensor-parallel plan names {fqn} ({type(module).__name__}) "
                                   f"as {style}, but fp8dist splits nn.Linear layers only\n  fix: "
                                   "parallel.tensor_size=1 for this model")
            found[fqn] = (style, module)
    if not found:
        raise Fp8distError(f"{model_name}: no module matches its tensor-parallel plan ({', '.join(plan)})\n  fix: "
                           "parallel.tensor_size=1, or a model with Llama-style names (layers.*.self_attn.q_proj ...)")
    return found


def apply(model, tp_mesh, *, sequence_parallel: bool) -> TensorParallelPlan:
    """Split `model` over `tp_mesh` in place (after float8 conversion, before MXFP8 conversion and FSDP)."""
    plan, source = model_plan(model)
    name = type(model).__name__
    base = base_model(model)
    planned = planned_linears(base, plan, name)
    result = TensorParallelPlan(source=source, sequence_parallel=sequence_parallel)
    activation_layout = Shard(1) if sequence_parallel else Replicate()

    # The parents of the planned Linears (attention, MLP) and the blocks that hold them.
    parents: dict[str, list[str]] = {}
    for fqn in planned:
        parents.setdefault(fqn.rpartition(".")[0], []).append(fqn)
    styles: dict[str, ParallelStyle] = {}
    for fqn, (style, module) in planned.items():
        float8 = _is_tensorwise_float8(module)
        if float8:
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

            col, row = Float8ColwiseParallel, Float8RowwiseParallel
            result.float8_styles.append(fqn)
        else:
            col, row = ColwiseParallel, RowwiseParallel
        if style == "colwise":
            styles[fqn] = col()
            result.colwise.append(fqn)
        else:
            styles[fqn] = row(output_layouts=activation_layout)
            result.rowwise.append(fqn)
    if sequence_parallel:
        styles.update(_sequence_parallel_styles(base, parents, planned))
    parallelize_module(base, tp_mesh, styles)
    result.vocabulary = _split_vocabulary(model, tp_mesh, sequence_parallel)
    return result


def _sequence_parallel_styles(base, parents: dict[str, list[str]], planned) -> dict[str, ParallelStyle]:
    """The block-level styles of sequence parallel: each block's input sharded along the sequence, its norms
    `SequenceParallel`, its attention / MLP inputs gathered (in float8 where all their planned Linears are
    tensorwise Float8Linears)."""
    styles: dict[str, ParallelStyle] = {}
    blocks = sorted({parent.rpartition(".")[0] for parent in parents}, key=_natural)
    for index, block in enumerate(blocks):
        # The first block shards the embedding's (replicated) output; later ones receive the sequence shards.
        styles[block] = PrepareModuleInput(input_layouts=(Replicate() if index == 0 else Shard(1),),
                                           desired_input_layouts=(Shard(1),), use_local_output=True)
        for child_name, child in base.get_submodule(block).named_children():
            if type(child).__name__.endswith(NORM_CLASS_SUFFIXES):
                styles[f"{block}.{child_name}"] = SequenceParallel()
    for parent, linears in parents.items():
        base.get_submodule(parent).register_forward_pre_hook(_hidden_first, with_kwargs=True)
        consumers = [planned[fqn][1] for fqn in linears if planned[fqn][0] == "colwise"]
        if consumers and all(_is_tensorwise_float8(m) for m in consumers):
            from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

            styles[parent] = PrepareFloat8ModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        else:
            styles[parent] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return styles


def _natural(fqn: str) -> list:
    return [int(part) if part.isdigit() else part for part in fqn.split(".")]


def vocabulary_split(model, tp: int) -> tuple[str, str] | None:
    """(embedding fqn, LM head fqn) where the vocabulary is split over tp: it divides by tp and the two are not tied;
    None where both stay whole (or the model has no such pair)."""
    base = base_model(model)
    embed = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is None or head is None or embed.weight is head.weight or embed.weight.shape[0] % tp:
        return None
    names = {id(module): name for name, module in model.named_modules()}
    return names[id(embed)], names[id(head)]


def final_norm(model) -> str | None:
    """The fqn of the base model's own norm (the last one, before the LM head): the first norm among its children."""
    base = base_model(model)
    names = {id(module): name for name, module in model.named_modules()}
    return next((names[id(child)] for child in base.children()
                 if type(child).__name__.endswith(NORM_CLASS_SUFFIXES)), None)


def _split_vocabulary(model, tp_mesh, sequence_parallel: bool) -> str:
    """Embedding and LM head: vocabulary-parallel where vocabulary_split says so; else whole, with the last norm (and
    the LM head's input) handled for sequence parallel. Returns what was done, for the run's notes."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return "no embedding / LM head found: left whole"
    tp, split = tp_mesh.size(), vocabulary_split(model, tp_mesh.size())
    head_fqn = next(name for name, module in model.named_modules() if module is head)
    norm = final_norm(model)
    styles: dict[str, ParallelStyle] = {}
    if sequence_parallel and norm is not None:
        styles[norm] = SequenceParallel()
    head_input = Shard(1) if sequence_parallel else Replicate()
    if split is not None:
        # The LM head's logits come out of DTensor.to_local(), a view, and FSDP2 warns of any view the root returns
        # (torch 2.13 _fsdp_state.py _register_pre_backward_hook) in case the caller changes it in place; the loss
        # reads the logits and nothing writes them.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor",
                                category=UserWarning)
        embed_fqn, head_fqn = split
        styles[embed_fqn] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        styles[head_fqn] = ColwiseParallel(input_layouts=head_input, output_layouts=Replicate())
        done = f"vocabulary ({head.weight.shape[0]}) split over tp {tp}"
    else:
        if sequence_parallel:
            styles[head_fqn] = PrepareModuleInput(input_layouts=(head_input,), desired_input_layouts=(Replicate(),),
                                                  use_local_output=True)
        base = base_model(model)
        embed = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
        why = "tied" if embed is not None and embed.weight is head.weight else (
            f"vocabulary {head.weight.shape[0]} does not divide by tp {tp}")
        done = f"embedding and LM head whole on each tp rank ({why})"
    parallelize_module(model, tp_mesh, styles)
    return done
