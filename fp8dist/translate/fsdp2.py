"""Spec -> FSDP2 plan (plain data). Pure: no torch import.

The plan is what `fp8dist.engines.fsdp2.prepare` executes, in this order (torchtitan, Accelerate):
upcast to the master dtype -> float8 conversion -> activation checkpointing -> torch.compile per block ->
fully_shard each block, then the root, on the mesh of `parallel.sharding` -> materialise and load (RAM-
efficient loading) -> the optimizer, with the step post-hook that precomputes float8 scales and, for fp16
compute, the loss scaler.
"""
from __future__ import annotations

from typing import Any

import fp8dist.compat as compat
from fp8dist.config.spec import Spec
from fp8dist.config.vocabulary import fsdp2_layout
from fp8dist.errors import ConfigError, Issue

# torchao's _scaled_mm needs both Linear dims divisible by 16 (torchao/float8/config.py, pad_inner_dim).
FP8_DIM_MULTIPLE = 16

OPTIMIZER_CLASSES = {
    ("adamw", "fp8"): "torchao.optim.AdamWFp8",
    ("adamw", "int8"): "torchao.optim.AdamW8bit",
    ("adamw", None): "torch.optim.AdamW",
    ("adam", None): "torch.optim.Adam",
    ("sgd", None): "torch.optim.SGD",
}


def target_torchao_version(explicit: str | None = None) -> tuple[compat.Version, str]:
    """The torchao version to plan for, and where that choice came from (like the DeepSpeed target)."""
    if explicit:
        try:
            return compat.parse_version(explicit), "given with --torchao-version"
        except ValueError:
            raise ConfigError([Issue("--torchao-version", "not a version", explicit, "write e.g. 0.18.0")]) from None
    version = compat.installed_version("torchao")
    if version:
        return compat.parse_version(version), "installed"
    return compat.NEWEST_KNOWN_TORCHAO, "newest known (torchao is not installed)"


TE_DISTRIBUTIONS = ("transformer-engine", "transformer_engine")  # the wheel's name; a source build's


def installed_te() -> str | None:
    """The installed Transformer Engine's version, from package metadata (no import)."""
    return next((v for v in map(compat.installed_version, TE_DISTRIBUTIONS) if v), None)


def target_te_version(explicit: str | None = None) -> tuple[compat.Version, str]:
    """The Transformer Engine release to plan the recipe for, and where that choice came from."""
    installed = installed_te()
    if explicit:
        try:
            version, origin, where = compat.parse_version(explicit), "given with --te-version", "--te-version"
        except ValueError:
            raise ConfigError([Issue("--te-version", "not a version", explicit, "write e.g. 2.20.2")]) from None
    elif installed:
        version, origin, where = compat.parse_version(installed), "installed", "transformer-engine (installed)"
    else:
        return compat.TE_NEWEST_KNOWN, "newest known (Transformer Engine is not installed)"
    ok, reason = compat.te_supported(version)
    if not ok:
        raise ConfigError([Issue(where, reason, compat.fmt(version),
                                 f"use Transformer Engine >= {compat.fmt(compat.TE_OLDEST_SUPPORTED)}")])
    return version, origin


def to_fsdp2(spec: Spec, torchao_version: str | None = None, te_version: str | None = None) -> dict[str, Any]:
    p, f = spec.precision, spec.fsdp2
    master, state = p.weight_dtype, spec.optimizer_state_dtype
    plan: dict[str, Any] = {
        "engine": "fsdp2",
        "load_dtype": p.load_dtype,
        "upcast_before_shard": master if master != p.load_dtype else None,
        "mixed_precision_policy": {
            "param_dtype": None if p.mixed_precision == "none" else p.mixed_precision,
            "reduce_dtype": p.reduce_dtype,
            "output_dtype": f.output_dtype,  # the root's (the model outputs); blocks keep the compute dtype
            "cast_forward_inputs": f.cast_forward_inputs,
        },
        "wrap": {"units": "auto" if f.wrap == "auto" else list(f.wrap), "root": True,
                 "auto_rule": "Hugging Face _no_split_modules, else the children of the first nn.ModuleList"},
        "sharding": fsdp2_layout(spec.to_dict()),
        # pin_memory needs CUDA: CPUOffloadPolicy() pins by default and fails on CPU-only torch
        # (torch 2.13 torch/distributed/fsdp/_fully_shard/_fsdp_param.py). The runtime pins where CUDA exists.
        "offload_policy": {"class": "CPUOffloadPolicy", "pin_memory": "where CUDA is available"}
        if spec.parallel.offload == "params" else None,
        "activation_checkpointing": spec.parallel.activation_checkpointing,
        "loading": ({"mode": "meta build in the master dtype, shard, then each rank reads its own rows of "
                             "the safetensors files", "dtype": master}
                    if spec.parallel.cpu_ram_efficient_loading else {"mode": "full model on every rank"}),
        "loss_scaling": loss_scaling_plan(spec),
        "float8": float8_plan(spec, torchao_version, te_version),
        "optimizer": {
            "class": OPTIMIZER_CLASSES[(spec.optimizer.name, state if state in ("fp8", "int8") else None)],
            "steps_on": master, "state_dtype": state,
            "lr": spec.optimizer.lr, "weight_decay": spec.optimizer.weight_decay,
        },
        "compile": {"per_block": True, "root_if_no_blocks": True, "before": "fully_shard"} if spec.compile else False,
        "gradient_clipping": spec.train.gradient_clipping,
    }
    return plan


def loss_scaling_plan(spec: Spec) -> dict[str, Any] | None:
    """fp16 compute needs loss scaling; FSDP2 has none, so fp8dist's scaler runs (engines/loss_scaling.py)."""
    if spec.precision.compute_dtype != "fp16":
        return None
    ls = spec.precision.loss_scaling
    return {"scaler": "fp8dist.engines.loss_scaling.DynamicLossScaler", "found_inf": "all-reduced (MAX) across ranks",
            "dynamic": ls.loss_scale == 0, "loss_scale": ls.loss_scale, "initial_scale_power": ls.initial_scale_power,
            "loss_scale_window": ls.loss_scale_window, "hysteresis": ls.hysteresis,
            "min_loss_scale": ls.min_loss_scale}


def torchao_dims_multiple(ao) -> int | None:
    """What a Linear's dims must be a multiple of to convert: 16 for float8's _scaled_mm (None: pad_inner_dim pads
    instead), 32 for MXFP8's blocks."""
    if ao.recipe_name == "mxfp8":
        return compat.TORCHAO_MX_BLOCK
    return None if ao.pad_inner_dim else FP8_DIM_MULTIPLE


def float8_plan(spec: Spec, torchao_version: str | None = None, te_version: str | None = None) -> dict[str, Any] | None:
    fp8 = spec.fp8
    if fp8.backend == "none":
        return None
    modules = {"exclude": list(fp8.modules.exclude), "skip_first_last": fp8.modules.skip_first_last}
    if fp8.backend == "te":
        version, origin = target_te_version(te_version)
        return {"backend": "te", "te_version": compat.fmt(version), "te_version_origin": origin,
                "recipe": fp8.te.recipe, **te_recipe_plan(spec, version),
                "swap": ["nn.Linear -> te.Linear"] + (["nn.LayerNorm -> te.LayerNorm"] if fp8.te.swap_layernorm else []),
                "module_filter": {**modules,
                                  "require_dims_multiple_of": compat.TE_RECIPES[fp8.te.recipe].dim_multiple}}
    ao = fp8.torchao
    all_gather = spec.float8_all_gather
    version, origin = target_torchao_version(torchao_version)
    recompute, reason = compat.torchao_force_recompute(version, ao.force_recompute_fp8_weight_in_bwd, all_gather)
    config = {"recipe_name": ao.recipe_name, "enable_fsdp_float8_all_gather": all_gather,
              "pad_inner_dim": ao.pad_inner_dim, "emulate": ao.emulate}
    if recompute:
        config["force_recompute_fp8_weight_in_bwd"] = True
    return {
        "backend": "torchao",
        "torchao_version": compat.fmt(version), "torchao_version_origin": origin,
        "float8_linear_config": config,
        "force_recompute_fp8_weight_in_bwd": {"value": recompute, "reason": reason},
        "precompute_float8_dynamic_scale_for_fsdp": bool(
            all_gather and ao.precompute_float8_dynamic_scale_for_fsdp and spec.engine == "fsdp2"),
        "module_filter": {**modules, "require_dims_multiple_of": torchao_dims_multiple(ao)},
        # MoE experts (grouped GEMMs); `auto` is resolved on the machine that runs (compat.torchao_experts_mode)
        "experts": ao.experts,
    }


def te_recipe_plan(spec: Spec, te_version: compat.Version) -> dict[str, Any]:
    """The TE recipe for Transformer Engine `te_version` (compat.TE_RECIPES): its class, the constructor arguments
    the user set (upstream names; unset ones fall through to TE's defaults) and the recipe attributes set after
    construction. Refuses (ConfigError) the recipe or a field that release lacks: its class would drop the field
    without a word. The runtime backend builds exactly this (backends/transformer_engine.py build_recipe)."""
    te = spec.fp8.te
    record = compat.TE_RECIPES[te.recipe]
    ok, reason = compat.te_recipe_available(te.recipe, te_version)
    issues = [] if ok else [Issue("precision.fp8.te.recipe", reason, te.recipe,
                                  f"use Transformer Engine >= {compat.fmt(record.since)}, or another recipe")]
    fields, attributes = {}, {}
    for field in record.fields:  # the config rules refuse the other keys and the ignored fields
        value = getattr(te, field.name)
        if value is None:
            continue
        kept, reason = compat.te_field_kept(te.recipe, field.name, te_version)
        if not kept:
            issues.append(Issue(f"precision.fp8.te.{field.name}", reason, value,
                                f"remove it, or use Transformer Engine >= {compat.fmt(field.since)}"))
        fields[field.name] = value
        attributes.update(dict.fromkeys(field.also_sets, value))
    if issues:
        raise ConfigError(issues)
    return {"recipe_class": record.cls, "recipe_fields": fields, "recipe_attributes": attributes}
