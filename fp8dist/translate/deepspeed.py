"""Spec -> DeepSpeed config dict. Pure: no torch, no deepspeed import.

Rules (DeepSpeed 0.19.8 sources: deepspeed/runtime/config.py, deepspeed/runtime/precision_config.py):
- exactly one of `bf16` / `fp16` / `torch_autocast`; never `amp` (removed in 0.19.8, #8564);
- `torch_autocast` always with an explicit `dtype` (its default is fp16 on CUDA);
- never `"auto"` inside a typed section (DeepSpeedConfigModel drops it silently);
- `gradient_clipping` always explicit (default changed 0.0 -> 1.0 in 0.19.3, #8068);
- the `msamp` section only for DeepSpeed versions MS-AMP supports (facts.msamp.MSAMP_DEEPSPEED_WINDOWS);
- tensor parallel as AutoTP, `tensor_parallel.autotp_size`; expert parallel as AutoEP, `expert_parallel.enabled` /
  `autoep_size`; no split of the model through `deepspeed.extra`.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import fp8dist.dtypes as dtypes
from fp8dist.config.spec import Spec
from fp8dist.config.vocabulary import deepspeed_extras
from fp8dist.errors import ConfigError, Issue
from fp8dist.facts import versions
from fp8dist.facts.deepspeed import (DS_AMP_REMOVED, DS_AUTOCAST_WITH_BF16, DS_AUTOEP, DS_AUTOEP_PRESETS,
                                     DS_AUTOEP_ZERO3, DS_AUTOTP_ZERO3, DS_BF16_MASTER, NEWEST_KNOWN_DEEPSPEED,
                                     deepspeed_autoep, deepspeed_autotp, deepspeed_has_bf16_master,
                                     deepspeed_has_torch_autocast)
from fp8dist.facts.msamp import MSAMP_RELEASE, MSAMP_RELEASE_DEEPSPEED, installed_msamp, msamp_supports_deepspeed
from fp8dist.facts.versions import Version, fmt, parse_version



def target_deepspeed_version(explicit: str | None) -> tuple[Version, str]:
    """The DeepSpeed version to translate for, and where that choice came from."""
    if explicit:
        try:
            return parse_version(explicit), "given with --deepspeed-version"
        except ValueError:
            raise ConfigError([Issue("--deepspeed-version", "not a version", explicit, "write e.g. 0.13.1")]) from None
    installed = versions.installed_version("deepspeed")
    if installed:
        return parse_version(installed), "installed"
    return NEWEST_KNOWN_DEEPSPEED, "newest known (DeepSpeed is not installed)"


def to_deepspeed(spec: Spec, deepspeed_version: str | None = None) -> dict[str, Any]:
    """The DeepSpeed config of `spec`, `deepspeed.extra` merged last; every problem of both at once (ConfigError)."""
    version, origin = target_deepspeed_version(deepspeed_version)
    config, issues = _generated(spec, version, origin)
    merged, extra_issues = _merged_with_extra(config, spec.deepspeed.extra, version)
    if issues or extra_issues:
        raise ConfigError(issues + extra_issues, spec.source)
    return merged


def extra_issues(spec: Spec) -> list[Issue]:
    """What `translate --to deepspeed` refuses in `deepspeed.extra`, for the DeepSpeed it targets by default (installed,
    else newest known): `validate` runs these checks too, so it never accepts an extra that translate refuses. The
    checks of the generated sections against a DeepSpeed release (MS-AMP's windows, torch_autocast, bf16 masters)
    stay with translate and the run's preflight, which know the version."""
    if not spec.deepspeed.extra:
        return []
    version, origin = target_deepspeed_version(None)
    return _merged_with_extra(_generated(spec, version, origin)[0], spec.deepspeed.extra, version)[1]


def _generated(spec: Spec, version, origin) -> tuple[dict[str, Any], list[Issue]]:
    """The keys fp8dist generates from the config (before `deepspeed.extra`), and what `version` cannot take."""
    issues: list[Issue] = []
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.train.micro_batch_size,
        "gradient_accumulation_steps": spec.train.gradient_accumulation_steps,
        "gradient_clipping": float(spec.train.gradient_clipping),
        "steps_per_print": spec.deepspeed.steps_per_print,
    }
    config.update(_precision_sections(spec, version, origin, issues))
    config["communication_data_type"] = spec.precision.reduce_dtype
    config["zero_optimization"] = _zero_section(spec)
    if spec.parallel.tensor_size > 1:
        # AutoTP training (deepspeed 0.19.8 runtime/tensor_parallel/config.py TPTrainingConfig.autotp_size;
        # deepspeed.initialize turns it on for autotp_size > 0, runtime/engine.py splits for > 1)
        config["tensor_parallel"] = {"autotp_size": spec.parallel.tensor_size}
        ok, reason = deepspeed_autotp(version, spec.deepspeed.zero_stage)
        if not ok:
            issues.append(Issue("parallel.tensor_size", f"{reason} ({origin})", spec.parallel.tensor_size,
                                f"pip install 'deepspeed>={fmt(DS_AUTOTP_ZERO3)}', or parallel.sharding=grad_op "
                                "(ZeRO-2), or parallel.tensor_size=1"))
    if spec.parallel.expert_size > 1:
        config["expert_parallel"] = _expert_parallel_section(spec, version, origin, issues)
    if spec.deepspeed.grad_accum_dtype:
        config["data_types"] = {"grad_accum_dtype": spec.deepspeed.grad_accum_dtype}
    if spec.optimizer.name not in ("adam", "adamw") and spec.deepspeed.zero_stage > 0:
        # torch.optim.SGD is not in ZERO_SUPPORTED_OPTIMIZERS (deepspeed/runtime/zero/utils.py).
        config["zero_allow_untested_optimizer"] = True
        if spec.deepspeed.offload_optimizer != "none":
            # DeepSpeed's CPU optimizers are Adam and Lion; SGD steps on the CPU as a client optimizer only
            # with this switch (engine.py _configure_optimizer, 0.19.8).
            config["zero_force_ds_cpu_optimizer"] = False
    if spec.fp8.backend == "msamp":
        config["msamp"] = _msamp_section(spec, version, origin, issues)
    return config, issues


# The fp8dist key each generated DeepSpeed key comes from (dotted DeepSpeed path, or its section: the longest one
# that prefixes a key wins), so a conflicting `deepspeed.extra` key is answered with the key to set instead.
_LOSS_SCALING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
GENERATED_FROM = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "gradient_clipping": "train.gradient_clipping",
    "steps_per_print": "deepspeed.steps_per_print",
    "communication_data_type": "precision.reduce_dtype",
    "bf16": "precision.mixed_precision (bf16 with master weights)",
    "bf16.bf16_master_weights_and_grads": "precision.master_weights",
    "bf16.bf16_optimizer_states": "optimizer.state_dtype",
    "fp16": "precision.mixed_precision (fp16 with master weights)",
    **{f"fp16.{key}": f"precision.loss_scaling.{key}" for key in _LOSS_SCALING},
    "fp16.fp16_master_weights_and_grads": "precision.master_weights",
    "torch_autocast": "precision.mixed_precision (with precision.master_weights=none)",
    "zero_optimization.stage": "parallel.sharding (or deepspeed.zero_stage)",
    "zero_optimization.zero_hpz_partition_size": "parallel.shard_size",
    "zero_optimization.offload_optimizer": "parallel.offload (or deepspeed.offload_optimizer)",
    "zero_optimization.offload_param": "parallel.offload (or deepspeed.offload_param)",
    "zero_optimization.offload_optimizer.nvme_path": "deepspeed.nvme_path",
    "zero_optimization.offload_param.nvme_path": "deepspeed.nvme_path",
    "tensor_parallel.autotp_size": "parallel.tensor_size",
    "expert_parallel.enabled": "parallel.expert_size (> 1 turns AutoEP on)",
    "expert_parallel.autoep_size": "parallel.expert_size",
    "data_types.grad_accum_dtype": "deepspeed.grad_accum_dtype",
    "zero_allow_untested_optimizer": "optimizer.name",
    "zero_force_ds_cpu_optimizer": "optimizer.name (with deepspeed.offload_optimizer)",
    "msamp": "precision.fp8.backend (msamp)",
    "msamp.opt_level": "precision.fp8.msamp.opt_level",
    "msamp.use_te": "precision.fp8.msamp.use_te",
}


# deepspeed.extra keys that would split the model behind the config's back (fp8dist's runtime builds its mesh, the
# data-parallel ranks and its checks from `parallel`), even where the translation does not write them: the fp8dist key
# that says the same (None where fp8dist has none), and which values split nothing and merge: 1, and DeepSpeed's
# default 0 for autotp_size; AutoEP off for expert_parallel.enabled (DeepSpeed reads it as a truth value), since an
# enabled AutoEP swaps the MoE layers for its own even at autoep_size 1 (deepspeed 0.19.8
# module_inject/auto_ep_config.py validate_autoep_config: "AutoEP replacement remains enabled").
LAYOUT_KEYS: dict[str, tuple[str | None, Callable[[Any], bool]]] = {
    "tensor_parallel.autotp_size": ("parallel.tensor_size", lambda value: value in (0, 1)),
    "sequence_parallel_size": (None, lambda value: value in (0, 1)),
    "expert_parallel.enabled": ("parallel.expert_size", lambda value: not value),
    "expert_parallel.autoep_size": ("parallel.expert_size", lambda value: value == 1),
}


def generated_from(dotted: str) -> str | None:
    """The fp8dist key that produces the generated DeepSpeed key `dotted` (GENERATED_FROM)."""
    parts = dotted.split(".")
    return next((GENERATED_FROM[".".join(parts[:n])] for n in range(len(parts), 0, -1)
                 if ".".join(parts[:n]) in GENERATED_FROM), None)


_HOW = ("run `deepspeed launch/train.py --fp8dist-config CONFIG`, or call fp8dist.engines.deepspeed.initialize(model, "
        "spec) in your script")


def left_to_runtime(spec: Spec) -> list[str]:
    """What the config asks for that the DeepSpeed JSON cannot carry, because fp8dist's runtime applies it around
    deepspeed.initialize (fp8dist/engines/deepspeed/engine.py): one line each, with how to get it. A user who hands
    the JSON alone to their own DeepSpeed script trains without these. Also what the JSON leaves DeepSpeed to find in
    the model, which the config does not name (the MoE layers AutoEP splits)."""
    out = []
    if spec.fp8.backend in ("torchao", "te"):
        what = "float8 conversion of the Linears (torchao)" if spec.fp8.backend == "torchao" else \
            "swap to te.Linear and the te.autocast forward (Transformer Engine)"
        out.append(f"precision.fp8.backend={spec.fp8.backend}: DeepSpeed has no FP8 setting; the {what} is done by "
                   f"fp8dist's runtime, so the JSON alone trains without FP8 (only its bf16/fp16 section); {_HOW}")
    if spec.parallel.activation_checkpointing != "none":
        out.append(f"parallel.activation_checkpointing={spec.parallel.activation_checkpointing}: fp8dist's runtime "
                   "wraps the blocks (DeepSpeed's activation_checkpointing section configures only its own checkpoint "
                   f"function, which a model must call); {_HOW}")
    if spec.parallel.cpu_ram_efficient_loading:
        out.append("parallel.cpu_ram_efficient_loading: the model must be built inside deepspeed.zero.Init "
                   "(fp8dist.load_model does it; the JSON cannot); " + _HOW)
    if spec.compile:
        out.append(f"compile: fp8dist's runtime calls engine.compile() after deepspeed.initialize; {_HOW}")
    given = spec.deepspeed.extra.get("expert_parallel")
    if spec.parallel.expert_size > 1 and not (isinstance(given, dict) and any(given.get(key) for key in
                                                                              _AUTOEP_LAYER_KEYS)):
        out.append(f"parallel.expert_size={spec.parallel.expert_size}: the JSON's expert_parallel section names no "
                   "preset_model, since the config names no model: DeepSpeed's AutoEP takes the preset of the model's "
                   f"config.model_type ({', '.join(DS_AUTOEP_PRESETS)}), else "
                   "tries every preset, and leaves the MoE layers no preset matches unsplit (deepspeed 0.19.8 "
                   "module_inject/auto_ep_presets/registry.py resolve_preset_candidates); for another model set "
                   "deepspeed.extra.expert_parallel.preset_model (or moe_layer_pattern and its patterns)")
    if spec.adapter.enabled:
        out.append(f"adapter.kind={spec.adapter.kind}: DeepSpeed has no adapter setting; fp8dist's loading applies "
                   "PEFT's LoRA and its engine gives the optimizer the adapters only, so the JSON alone trains the "
                   "full model; run `deepspeed launch/train.py --fp8dist-config CONFIG`, or load the model with "
                   "fp8dist.load_model(MODEL, spec) before fp8dist.engines.deepspeed.initialize(model, spec) (or "
                   "apply peft.get_peft_model yourself and give DeepSpeed an optimizer over the trainable parameters)")
    return out


def _precision_sections(spec: Spec, version, origin, issues) -> dict[str, Any]:
    p = spec.precision
    if p.mixed_precision == "none":
        return {}
    if p.master_weights == "none":
        ok, reason = deepspeed_has_torch_autocast(version)
        if not ok:
            issues.append(Issue("precision.master_weights", f"fp32 weights with {p.mixed_precision} compute map to "
                                f"DeepSpeed's torch_autocast; {reason} ({origin})", "none",
                                "upgrade DeepSpeed, or set precision.master_weights=fp32 (bf16/fp16 section)"))
        # No lower-precision-safe modules: every gradient is reduced in its parameter's dtype (the load dtype,
        # which fp8dist.config.rules.deepspeed requires reduce_dtype to be). DeepSpeed's default list would reduce
        # nn.Linear gradients in the autocast dtype and ignore communication_data_type (deepspeed 0.19
        # runtime/torch_autocast.py init_autocast_params, zero/stage_1_and_2.py ipg_buckets).
        return {"torch_autocast": {"enabled": True, "dtype": dtypes.torch_name(p.mixed_precision),
                                   "lower_precision_safe_modules": []}}
    if p.mixed_precision == "fp16":
        fp16 = p.loss_scaling
        section = {"enabled": True, "loss_scale": fp16.loss_scale, "initial_scale_power": fp16.initial_scale_power,
                   "loss_scale_window": fp16.loss_scale_window, "hysteresis": fp16.hysteresis,
                   "min_loss_scale": fp16.min_loss_scale}
        if p.master_weights == "fp16":
            section["fp16_master_weights_and_grads"] = True
        return {"fp16": section}
    section = {"enabled": True}
    if p.master_weights == "bf16":
        ok, reason = deepspeed_has_bf16_master(version)
        if not ok:
            issues.append(Issue("precision.master_weights", f"{reason} ({origin})", "bf16",
                                f"upgrade to DeepSpeed >= {fmt(DS_BF16_MASTER)} or use fp32 masters"))
        section["bf16_master_weights_and_grads"] = True
        if spec.optimizer_state_dtype == "bf16":
            section["bf16_optimizer_states"] = True
    return {"bf16": section}


def _zero_section(spec: Spec) -> dict[str, Any]:
    ds = spec.deepspeed
    zero: dict[str, Any] = {"stage": ds.zero_stage, **deepspeed_extras(spec.to_dict())}
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(ds, key)
        if device != "none":
            zero[key] = {"device": device, **({"nvme_path": ds.nvme_path} if device == "nvme" else {})}
    return zero


def _expert_parallel_section(spec: Spec, version, origin, issues) -> dict[str, Any]:
    """AutoEP (deepspeed 0.19.8 module_inject/auto_ep_config.py parse_autoep_config; runtime/engine.py
    _configure_expert_parallel swaps each MoE layer it detects for its AutoEPMoELayer, experts split over autoep_size
    ranks). No `preset_model`: the config names no model, and AutoEP picks the preset from the model's
    config.model_type (left_to_runtime says so; deepspeed.extra.expert_parallel.preset_model sets it)."""
    size = spec.parallel.expert_size
    ok, reason = deepspeed_autoep(version, spec.deepspeed.zero_stage)
    if not ok:
        zero3 = spec.deepspeed.zero_stage == 3 and version >= DS_AUTOEP
        issues.append(Issue("parallel.expert_size", f"{reason} ({origin})", size,
                            f"pip install 'deepspeed>={fmt(DS_AUTOEP_ZERO3 if zero3 else DS_AUTOEP)}', or "
                            + ("parallel.sharding=grad_op (ZeRO-2), or " if zero3 else "")
                            + "engine=fsdp2, or parallel.expert_size=1"))
    return {"enabled": True, "autoep_size": size}


# The expert_parallel keys that tell AutoEP which layers are the MoE layers (deepspeed 0.19.8
# module_inject/auto_ep_presets/registry.py resolve_preset_candidates: preset_model, else the preset of the model's
# config.model_type, else moe_layer_pattern, else every preset tried).
_AUTOEP_LAYER_KEYS = ("preset_model", "moe_layer_pattern")


def _msamp_section(spec: Spec, version, origin, issues) -> dict[str, Any]:
    level = spec.fp8.msamp.opt_level
    ok, reason = msamp_supports_deepspeed(version, installed_msamp())
    if not ok:
        issues.append(Issue("precision.fp8.msamp.opt_level", f"MS-AMP {level} runs through msamp.deepspeed.initialize, "
                            f"which needs an older DeepSpeed: {reason}; target DeepSpeed {fmt(version)} is "
                            f"{origin}", level,
                            f"translate for an MS-AMP environment with --deepspeed-version "
                            f"{fmt(MSAMP_RELEASE_DEEPSPEED)} (MS-AMP {fmt(MSAMP_RELEASE)}'s pin), "
                            "or use backend=torchao or te on this DeepSpeed"))
    return {"enabled": True, "opt_level": level, "use_te": spec.fp8.msamp.use_te}


def _leaves(node: dict[str, Any], prefix: tuple = ()):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _merged_with_extra(config: dict[str, Any], extra: dict[str, Any], version) -> tuple[dict[str, Any], list[Issue]]:
    """`deepspeed.extra` merged last, and what it cannot hold: a key the translation generated (named with the
    fp8dist key that produces it), a split of the model fp8dist's mesh would not know (LAYOUT_KEYS), `"auto"`, `amp`
    on a DeepSpeed that rejects it, or a second 16-bit mode."""
    merged = copy.deepcopy(config)
    issues = []
    for path, value in _leaves(extra):
        dotted = ".".join(path)
        node, generated = merged, True
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                generated = part in node
                break
            node = node[part]
        if generated and path[-1] in node:
            source = generated_from(dotted)
            issues.append(Issue(f"deepspeed.extra.{dotted}", f"conflicts with `{dotted}` = {node[path[-1]]!r}, which "
                                f"fp8dist generates from {source or 'the config'}", value,
                                f"set {source.split(' ')[0]} instead, or drop {dotted} from deepspeed.extra" if source
                                else "set it through the fp8dist key that produces it, or drop it from extra"))
            continue
        if dotted in LAYOUT_KEYS and not LAYOUT_KEYS[dotted][1](value):
            key = LAYOUT_KEYS[dotted][0]
            issues.append(Issue(f"deepspeed.extra.{dotted}", "splits the model over ranks fp8dist's mesh does not "
                                "know of" + (f" (its key is {key})" if key else " (DeepSpeed's Ulysses sequence "
                                "parallel, which fp8dist does not wire)"), value,
                                f"set {key} instead" if key else f"drop {dotted} from deepspeed.extra (context "
                                "parallel: parallel.context_size with engine fsdp2)"))
            continue
        if value == "auto":
            issues.append(Issue(f"deepspeed.extra.{dotted}", "\"auto\" is only filled in by Accelerate/HF Trainer; "
                                "raw DeepSpeed drops it inside typed sections and crashes on top-level scalars",
                                value, "write the actual value"))
        if path[0] == "amp" and version >= DS_AMP_REMOVED:
            issues.append(Issue("deepspeed.extra.amp", f"the `amp` section was removed in DeepSpeed "
                                f"{fmt(DS_AMP_REMOVED)}", value, "use precision.mixed_precision"))
    for path, value in _leaves(extra):
        if not any(i.path == f"deepspeed.extra.{'.'.join(path)}" for i in issues):
            _set(merged, path, value)
    enabled = [mode for mode in ("fp16", "bf16") if isinstance(merged.get(mode), dict) and merged[mode].get("enabled")]
    if len(enabled) > 1 or (enabled and "torch_autocast" in merged and version < DS_AUTOCAST_WITH_BF16):
        issues.append(Issue("deepspeed.extra", f"enables a second precision mode next to the generated one "
                            f"({', '.join(enabled + (['torch_autocast'] if 'torch_autocast' in merged else []))}); "
                            "DeepSpeed allows only one", fix="choose the mode with precision.mixed_precision"))
    return merged, issues


def _set(node: dict[str, Any], path: tuple, value: Any) -> None:
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = copy.deepcopy(value)
