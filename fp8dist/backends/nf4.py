"""QLoRA's frozen base in NF4 (`adapter.base_dtype: nf4`): every frozen nn.Linear weight of an adapter run, but the
output layer, MoE routers and modules to save (adapter.modules_to_save), quantized at load with torchao's NF4
(fp8dist/facts/torchao.py NF4_BLOCK: 4-bit codes, a scale per 64 values, the scales in int8 per 256), about 0.52
bytes per value instead of 2.

Why torchao's NF4Tensor and not bitsandbytes' Params4bit: NF4Tensor is a tensor subclass FSDP2 shards and all-gathers
itself (torchao 0.18 nf4_tensor.py `fsdp_pre_all_gather` / `fsdp_post_all_gather`: the codes, scales and factors each
gathered, torchtune's QLoRA recipe), it runs forward and backward on any device in plain torch (`F.linear` of the
weight dequantized to the input's dtype; no weight gradient), and it re-quantizes to the same bytes from the same
weights (a resume reads the base again). Params4bit packs its codes into a float storage for FSDP (bitsandbytes
docs/source/fsdp_qlora.md), which FSDP2's parameter handling corrupts (NaN canonicalisation of packed bf16 bytes,
bitsandbytes#1945), and with the default uint8 storage FSDP2 trains silently wrong (accelerate#3983).

Every weight is quantized whole before FSDP2 splits it by rows, with one scale mean (`scaler_mean`) for all of it.
Its scales are double-quantized per NF4_SCALER_BLOCK of them (256), or per the largest count under that which divides
a shard's blocks (`nf4_scaler_block`): NF4Tensor's three buffers must split into whole scaler blocks per shard
(torchao's `nf4_split`), and a Qwen2 MLP of 704 (11 x 64) on 2 ranks, or a 128 x 896 k_proj, holds no whole number
of 256-scale blocks per shard. A smaller scaler block only adds one factor (2 bytes) per scaler block. A weight stays
in its load dtype only when its rows do not split over the shards or a shard's values are not whole NF4 blocks of 64
(`nf4_unfit`); the run says which. The base's bytes are what the audit reads back (fp8dist/backends/storage.py:
NF4Tensor's buffers).
"""
from __future__ import annotations

from typing import Sequence

from fp8dist.backends.module_filter import linear_infos
from fp8dist.errors import Fp8distError
from fp8dist.facts.torchao import NF4_BLOCK, NF4_SCALER_BLOCK

def nf4_unfit(out_features: int, in_features: int, shards: int) -> str | None:
    """Why a [out, in] weight cannot be an NF4 base sharded over `shards` ranks, or None when it can: FSDP2 splits it
    by rows, and each shard holds whole NF4 blocks of NF4_BLOCK values."""
    if out_features % shards:
        return f"its {out_features} rows do not split over {shards} shards"
    if (out_features // shards * in_features) % NF4_BLOCK:
        return (f"a shard of {out_features}x{in_features} over {shards} holds {out_features // shards * in_features} "
                f"values, not whole NF4 blocks of {NF4_BLOCK}")
    return None


def nf4_scaler_block(out_features: int, in_features: int, shards: int) -> int:
    """The scales an NF4 weight double-quantizes together (NF4Tensor's scaler_block_size): NF4_SCALER_BLOCK where a
    shard holds a whole number of such blocks, else the largest count under it that divides a shard's NF4 blocks
    (torchao's nf4_split cuts every buffer into whole scaler blocks per shard). For a weight `nf4_unfit` passes."""
    blocks = out_features * in_features // NF4_BLOCK // shards
    return max(size for size in range(1, min(NF4_SCALER_BLOCK, blocks) + 1) if blocks % size == 0)


def output_layer_names(model) -> set[str]:
    """The output projection (lm_head), and its `.base_layer` where LoRA adapts it (PEFT's lora.Linear wraps it, and
    get_output_embeddings returns the wrapper): QLoRA keeps it in 16 bit (bitsandbytes' llm_int8_skip_modules
    default, transformers get_keys_to_not_convert); quantizing it would also untie it from tied input embeddings."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    names = {name for name, module in model.named_modules() if output is not None and module is output}
    return names | {f"{name}.base_layer" for name in names if hasattr(output, "base_layer")}


SAVED_MODULE_REASON = ("a module to save (adapter.modules_to_save): PEFT's frozen copy of it stays in the load "
                       "dtype, as the trained copy beside it")


def saved_module_originals(model) -> set[int]:
    """The ids of the frozen `original_module` of each module to save and of every module inside it
    (adapter.modules_to_save: peft 0.21 utils/other.py ModulesToSaveWrapper, whose trained copy is not frozen, so no
    NF4 candidate). A module trained
    whole stays out of NF4 in both copies: the frozen one runs only with the adapters disabled, where it stands for
    the module as loaded, and QLoRA's modules to save (embeddings, the output layer) are those bitsandbytes leaves
    unquantized."""
    from peft.utils.other import ModulesToSaveWrapper

    return {id(inner) for module in model.modules() if isinstance(module, ModulesToSaveWrapper)
            for inner in module.original_module.modules()}  # a saved block's Linears too, not only a saved Linear


def inside_saved_module(fqn: str, saved: Sequence[str]) -> bool:
    """Whether the module `fqn` is, or is inside, a module PEFT will wrap to save (adapter.modules_to_save, by PEFT's
    match on the end of a module's name, peft 0.21 utils/other.py _set_trainable): for a model the adapters are not
    in yet."""
    parts = fqn.split(".")
    prefixes = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
    return any(prefix == name or prefix.endswith(f".{name}") for prefix in prefixes for name in saved)


def nf4_linears(model, shards: int, frozen_only: bool = True,
                saved: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """(the Linears whose weights an NF4 base holds in NF4, name -> why each other one keeps its dtype): the frozen
    ones (`frozen_only`; a base read again for export, or read before the adapters are in, is all base) but the
    output layer, MoE routers and modules to save (PEFT's originals; before the adapters, those `saved` names), that
    fit."""
    modules = dict(model.named_modules())
    outputs = output_layer_names(model)
    originals = saved_module_originals(model)
    chosen, kept = [], {}
    for info in linear_infos(model):
        if frozen_only and modules[info.fqn].weight.requires_grad:
            continue  # an adapter, or anything else the optimizer steps
        why = ("the output layer stays in 16 bit, as in QLoRA" if info.fqn in outputs else
               SAVED_MODULE_REASON if id(modules[info.fqn]) in originals or inside_saved_module(info.fqn, saved) else
               "an MoE router stays in high precision" if info.router else
               nf4_unfit(info.out_features, info.in_features, shards))
        if why:
            kept[info.fqn] = why
        else:
            chosen.append(info.fqn)
    return chosen, kept


def quantize_frozen_base(model, shards: int) -> tuple[list[str], dict[str, str]]:
    """Every frozen Linear weight that fits, in NF4, in place: (the names quantized, name -> why each other frozen
    Linear kept its dtype). Weights already in NF4 (quantized as the base was read: fp8dist.runtime.loading) stay."""
    chosen, kept = nf4_linears(model, shards)
    for name in [*kept, *chosen]:  # quantized as the base was read (fp8dist.runtime.loading) for another shard count
        weight = model.get_submodule(name).weight
        needed = None if name in kept else nf4_scaler_block(weight.shape[0], weight.shape[1], shards)
        why = kept.get(name) or (f"its scales are double-quantized per {weight.scaler_block_size}, a shard's per "
                                 f"{needed}" if is_nf4(weight) and weight.scaler_block_size != needed else None)
        if is_nf4(weight) and why:
            raise Fp8distError(f"adapter.base_dtype=nf4: {name} was quantized to NF4 when the model was read, but on "
                               f"{shards} shard(s) it cannot be that one: {why}\n  fix: load the model (fp8dist."
                               "load_model) on the world size and parallel settings the run has")
    for name in chosen:
        linear = model.get_submodule(name)
        if not is_nf4(linear.weight):  # else quantized as the base was read
            linear.weight = quantize_weight(linear.weight, shards)
    return chosen, kept


def is_nf4(tensor) -> bool:
    from torchao.quantization import NF4Tensor

    return isinstance(tensor, NF4Tensor)


def nf4_of(weight, shards: int):
    """torchao's NF4Tensor of a [out, in] weight to be sharded over `shards` ranks (NF4_BLOCK, `nf4_scaler_block`)."""
    from torchao.quantization import to_nf4

    return to_nf4(weight.detach(), NF4_BLOCK, nf4_scaler_block(weight.shape[0], weight.shape[1], shards))


def quantize_weight(weight, shards: int):
    """One weight as an NF4 base on `shards` shards holds it: a frozen Parameter of torchao's NF4Tensor."""
    import torch

    return torch.nn.Parameter(nf4_of(weight, shards), requires_grad=False)


def dequantize_like_training(model, shards: int) -> list[str]:
    """The base as the run computed with it: each weight the run held in NF4 quantized and dequantized again (the
    same bytes the run's `to_nf4` made from the same weights), in place, in its dtype. For a merged export."""
    import torch

    chosen, _ = nf4_linears(model, shards, frozen_only=False)
    with torch.no_grad():
        for name in chosen:
            weight = model.get_submodule(name).weight
            weight.copy_(nf4_of(weight, shards).get_original_weight())
    return chosen
