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


def to_fsdp2(spec: Spec, torchao_version: str | None = None) -> dict[str, Any]:
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
        # (torch 2.13 _fsdp_param.py; research/scaling.md section 6). The runtime pins where CUDA exists.
        "offload_policy": {"class": "CPUOffloadPolicy", "pin_memory": "where CUDA is available"}
        if spec.parallel.offload == "params" else None,
        "activation_checkpointing": spec.parallel.activation_checkpointing,
        "loading": ({"mode": "meta build in the master dtype, shard, then each rank reads its own rows of "
                             "the safetensors files", "dtype": master}
                    if spec.parallel.cpu_ram_efficient_loading else {"mode": "full model on every rank"}),
        "loss_scaling": loss_scaling_plan(spec),
        "float8": float8_plan(spec, torchao_version),
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


def float8_plan(spec: Spec, torchao_version: str | None = None) -> dict[str, Any] | None:
    fp8 = spec.fp8
    if fp8.backend == "none":
        return None
    modules = {"exclude": list(fp8.modules.exclude), "skip_first_last": fp8.modules.skip_first_last}
    if fp8.backend == "te":
        return {"backend": "te", "recipe": fp8.te.recipe, "recipe_fields": te_recipe_fields(spec),
                "swap": ["nn.Linear -> te.Linear"] + (["nn.LayerNorm -> te.LayerNorm"] if fp8.te.swap_layernorm else []),
                "module_filter": {**modules, "require_dims_multiple_of": compat.TE_RECIPE_DIM_MULTIPLE[fp8.te.recipe]}}
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
        "module_filter": {**modules, "require_dims_multiple_of": None if ao.pad_inner_dim else FP8_DIM_MULTIPLE},
    }


def te_recipe_fields(spec: Spec) -> dict[str, Any]:
    """The TE recipe knobs the user set (upstream names); unset ones fall through to TE's own defaults."""
    te = spec.fp8.te
    names = ("fp8_format", "margin", "amax_history_len", "amax_compute_algo", "reduce_amax", "use_power_2_scales",
             "enable_2d_quantization", "fp8_dpa", "fp8_mha")
    return {name: getattr(te, name) for name in names if getattr(te, name) is not None}
