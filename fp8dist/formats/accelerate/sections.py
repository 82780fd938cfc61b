"""Sections two importers share: an Accelerate / Axolotl `fsdp_config`, Accelerate's `fp8_config` (read as
`accelerate launch` 1.15 exports it), and the settings fp8dist keeps although Accelerate would refuse them."""
from __future__ import annotations

from typing import Any, Mapping, cast

from fp8dist.config.vocabulary import SHARDING_ALIASES
from fp8dist.errors import Issue
from fp8dist.facts.accelerate import ACCELERATE_FP8_BACKEND, ACCELERATE_MSAMP_OPT_LEVELS
from fp8dist.facts.transformer_engine import TE_RECIPES, TEField
from fp8dist.formats.common import Notes, integer, mapping, truthy
from fp8dist.formats.keys import Table, disabled, kept, no_effect, refused

# FSDP1 ShardingStrategy by number (torch.distributed.fsdp.ShardingStrategy, as accelerate accepts digits).
_STRATEGY_NUMBERS = {"1": "FULL_SHARD", "2": "SHARD_GRAD_OP", "3": "NO_SHARD", "4": "HYBRID_SHARD",
                     "5": "_HYBRID_SHARD_ZERO2"}
# The keys of an Accelerate / Axolotl fsdp_config, without their `fsdp_` prefix (accelerate 1.15
# utils/dataclasses.py FullyShardedDataParallelPlugin, commands/config/cluster.py).
FSDP_KEYS = Table("fsdp_config", {
    "version": kept("FSDP2 (fp8dist runs FSDP2; FSDP1's keys are read for their FSDP2 meaning)", example=2),
    "sharding_strategy": kept("parallel.sharding", example="FULL_SHARD"),
    "reshard_after_forward": kept("parallel.sharding (FSDP2: true full, false grad_op)"),
    "offload_params": kept("parallel.offload: params"),
    "cpu_ram_efficient_loading": kept("parallel.cpu_ram_efficient_loading"),
    "activation_checkpointing": kept("parallel.activation_checkpointing: full"),
    "auto_wrap_policy": kept("fsdp2.wrap (TRANSFORMER_BASED_WRAP with class names; the others: fp8dist's blocks)",
                             example="TRANSFORMER_BASED_WRAP"),
    "transformer_layer_cls_to_wrap": kept("fsdp2.wrap", example="LlamaDecoderLayer"),
    "transformer_cls_names_to_wrap": kept("fsdp2.wrap", example=["LlamaDecoderLayer"]),
    "ignored_modules": refused("leaves those modules unsharded (replicated on every rank)", "remove it: fp8dist shards "
                               "every parameter", unless=disabled, otherwise="none", example="lm_head"),
    "backward_prefetch": no_effect("FSDP1 only; FSDP2 prefetches by itself", example="BACKWARD_PRE"),
    "forward_prefetch": no_effect("FSDP1 only (FSDP2 refuses it in Accelerate)"),
    "use_orig_params": no_effect("FSDP1 only; FSDP2 always uses the original parameters"),
    "sync_module_states": no_effect("FSDP1 only; fp8dist's RAM-efficient loading reads each rank's shards instead"),
    "state_dict_type": no_effect("a checkpoint format, not a precision setting", example="SHARDED_STATE_DICT"),
    "limit_all_gathers": no_effect("FSDP1 only"),
    "min_num_params": no_effect("size-based wrapping: fp8dist makes each block a unit (the sharding is the same)",
                                example=100000000),
    "activation_checkpointing_offload": no_effect("fp8dist keeps checkpointed inputs on the device"),
    "cpu_offload_pin_memory": no_effect("fp8dist pins offloaded memory where CUDA exists"),
}, unknown_why="check that it changes neither the sharding, nor the precision")
# accelerate 1.15 utils/constants.py FSDP_AUTO_WRAP_POLICY
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")


def note_accelerate_refusals(out: dict[str, Any], notes: Notes, what: str) -> None:
    """Settings fp8dist keeps although Accelerate itself would refuse them at Accelerator()."""
    fp8 = (out.get("precision") or {}).get("fp8") or {}
    if (out["engine"] == "fsdp2" and fp8.get("backend") == "torchao"
            and (out.get("parallel") or {}).get("cpu_ram_efficient_loading")):
        notes.resolved("parallel.cpu_ram_efficient_loading", True, f"kept, although Accelerate 1.15 refuses torchao "
                       f"FP8 with FSDP2 and RAM-efficient loading (accelerator.py), so {what} fails at Accelerator(); "
                       "fp8dist's FSDP2 runtime runs it, each rank reading its own shards")


def fsdp_settings(config: Mapping[str, Any], version: int | None, notes: Notes, issues: list[Issue], prefix: str,
                  gpus_per_node: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(parallel, fsdp2) sections for an Accelerate / Axolotl fsdp_config (keys with or without `fsdp_`)."""
    items = {}
    for key, value in mapping(config, prefix.rstrip(".")).items():
        items[key[5:] if key.startswith("fsdp_") else key] = (key, value)
    if "version" in items:
        key, value = items.pop("version")
        version = integer(value, f"{prefix}{key}")
        if version not in (1, 2):
            issues.append(Issue(f"{prefix}{key}", "FSDP versions are 1 and 2", value, "write 1 or 2"))
            version = 2
    if version is None:
        version = 1
        notes.resolved(f"{prefix}fsdp_version", 1, "left out: Accelerate's default FSDP1 (commands/launch.py)")
    if version == 1:
        notes.resolved(f"{prefix}fsdp_version", "FSDP2", "fp8dist runs FSDP2; the FSDP1 keys are read for their "
                       "FSDP2 meaning")
    parallel: dict[str, Any] = {}
    strategy = None
    if "sharding_strategy" in items:
        strategy = items.pop("sharding_strategy")
    reshard = items.pop("reshard_after_forward", None)
    if version == 2 and reshard is not None:
        value = truthy(reshard[1])
        if value is None:
            issues.append(Issue(f"{prefix}{reshard[0]}", "FSDP2 takes true or false", reshard[1],
                                "write true or false"))
        else:
            parallel["sharding"] = "full" if value else "grad_op"
        if strategy is not None:
            notes.dropped(f"{prefix}{strategy[0]}", strategy[1], "FSDP1 only; fsdp_reshard_after_forward decides")
    else:
        chosen = strategy or reshard
        name = str(chosen[1]).upper() if chosen else "FULL_SHARD"
        name = _STRATEGY_NUMBERS.get(name, name)
        if chosen and name == "_HYBRID_SHARD_ZERO2":  # a written value: the default is FULL_SHARD
            notes.resolved(f"{prefix}{chosen[0]}", "hybrid", "fp8dist's hybrid reshards parameters after forward "
                           "(HYBRID_SHARD); the ZeRO-2 variant keeps them")
            name = "HYBRID_SHARD"
        if name not in SHARDING_ALIASES:
            key = chosen[0] if chosen else "fsdp_sharding_strategy"
            issues.append(Issue(f"{prefix}{key}", "not an FSDP sharding strategy", chosen[1] if chosen else None,
                                f"use one of {', '.join(SHARDING_ALIASES)}"))
        else:
            parallel["sharding"] = SHARDING_ALIASES[name]
    if parallel.get("sharding") == "hybrid":
        if gpus_per_node:
            parallel["shard_size"] = gpus_per_node
            notes.resolved("parallel.shard_size", gpus_per_node, "HYBRID_SHARD shards within a node: num_processes / "
                           "num_machines")
        else:
            issues.append(Issue(f"{prefix}sharding_strategy", "HYBRID_SHARD shards within each node, and the file "
                                "does not say how many processes a node runs", "HYBRID_SHARD",
                                "add num_processes and num_machines to the file, or import and set "
                                "parallel.shard_size by hand"))
    if "offload_params" in items:
        if truthy(items.pop("offload_params")[1]):
            parallel["offload"] = "params"
    if "cpu_ram_efficient_loading" in items:
        parallel["cpu_ram_efficient_loading"] = bool(truthy(items.pop("cpu_ram_efficient_loading")[1]))
    if "activation_checkpointing" in items:
        if truthy(items.pop("activation_checkpointing")[1]):
            parallel["activation_checkpointing"] = "full"
    fsdp2: dict[str, Any] = {}
    policy = items.pop("auto_wrap_policy", None)
    classes = items.pop("transformer_layer_cls_to_wrap", None) or items.pop("transformer_cls_names_to_wrap", None)
    policy_name = str(policy[1]).upper() if policy else "NO_WRAP"
    if policy and policy_name not in WRAP_POLICIES:  # not written: NO_WRAP
        issues.append(Issue(f"{prefix}{policy[0]}", "not an FSDP auto-wrap policy Accelerate knows (it would stop at "
                            "Accelerator())", policy[1], f"use one of {', '.join(WRAP_POLICIES)}"))
    elif policy_name == "TRANSFORMER_BASED_WRAP":
        if classes and classes[1]:
            names = classes[1].split(",") if isinstance(classes[1], str) else list(classes[1])
            fsdp2["wrap"] = [name.strip() for name in names if str(name).strip()]
    else:
        if classes:
            notes.dropped(f"{prefix}{classes[0]}", classes[1], "read only with TRANSFORMER_BASED_WRAP")
        notes.resolved(f"{prefix}{policy[0] if policy else 'fsdp_auto_wrap_policy'}", "fsdp2.wrap=auto",
                       f"{policy_name} has no fp8dist equivalent: fp8dist shards each block (the model's "
                       "_no_split_modules), then the root")
    for short, (key, value) in items.items():
        FSDP_KEYS.settle(short, value, notes, issues, shown=f"{prefix}{key}")
    return parallel, fsdp2


# What `accelerate launch` 1.15 exports for an fp8_config key it is not given: its argparse defaults
# (commands/launch.py "FP8 Arguments"; use_mxfp8_block_scaling has no launcher argument, and TERecipeKwargs reads
# its unset variable as false); the recipe kwargs read these env names (utils/dataclasses.py AORecipeKwargs /
# TERecipeKwargs / MSAMPRecipeKwargs). TERecipeKwargs then hands Transformer Engine only the fields that differ from
# these same defaults (KwargsHandler.to_kwargs builds the default instance in a clean environment), so a value equal
# to one of them never reaches TE and TE's own default applies (amax_compute_algo "max"; MXFP8BlockScaling's
# fp8_format E4M3).
LAUNCH_FP8_DEFAULTS = {"margin": 0, "interval": 1, "fp8_format": "HYBRID", "amax_history_len": 1024,
                       "amax_compute_algo": "most_recent", "opt_level": "O2", "enable_fsdp_float8_all_gather": True,
                       "pad_inner_dim": True, "use_autocast_during_eval": False, "use_mxfp8_block_scaling": False}
# Keys `accelerate config` writes into fp8_config (commands/config/cluster.py) under names that the launcher
# exports as ACCELERATE_FP8_<KEY> and no recipe ever reads: the run silently uses the launcher default of the
# name on the right.
UNREAD_FP8_KEYS = {"amax_history_length": "amax_history_len", "amax_compute_algorithm": "amax_compute_algo",
                   "optimization_level": "opt_level"}


def fp8_section(config: Mapping[str, Any], engine: str, notes: Notes, issues: list[Issue],
                prefix: str) -> dict[str, Any] | None:
    """precision.fp8 for Accelerate's fp8 mode, from fp8_config as `accelerate launch` exports it."""
    items: dict[str, tuple[str, Any]] = {}
    for key, value in config.items():
        short = key[4:] if key.startswith("fp8_") and key != "fp8_format" else key
        items[short] = (key, value)
    raw = items.pop("backend", (None, None))[1]
    backend: str | None
    if raw is None:
        backend = "torchao"
        notes.resolved(f"{prefix}backend", "torchao", "left out: Accelerate picks torchao when installed, then "
                       "Transformer Engine, then MS-AMP (accelerator.py)")
    else:
        backend = {"AO": "torchao", "TORCHAO": "torchao", "TE": "te", "MSAMP": "msamp"}.get(str(raw).upper())
        if backend is None:
            issues.append(Issue(f"{prefix}backend", "not an Accelerate FP8 backend", raw, "use AO, TE or MSAMP"))
            return None
        if str(raw) != ACCELERATE_FP8_BACKEND[backend]:
            notes.resolved(f"{prefix}backend", ACCELERATE_FP8_BACKEND[backend], "Accelerator builds "
                           "FP8BackendType from the exported value, which takes the upper-case name only")

    def take(name: str) -> Any:
        if name in items:
            return items.pop(name)[1]
        for written, read in UNREAD_FP8_KEYS.items():
            if read == name and written in items:
                key, value = items.pop(written)
                notes.resolved(f"{prefix}{key}", LAUNCH_FP8_DEFAULTS[name],
                               f"accelerate launch exports it as ACCELERATE_FP8_{written.upper()}, which no recipe "
                               f"reads: the run used the launcher's {name}={LAUNCH_FP8_DEFAULTS[name]} "
                               f"(the written {value!r} never acted)")
        return LAUNCH_FP8_DEFAULTS.get(name)

    if backend == "torchao":
        all_gather = bool(truthy(take("enable_fsdp_float8_all_gather")))
        pad = bool(truthy(take("pad_inner_dim")))
        if pad:
            notes.resolved(f"{prefix}pad_inner_dim", False, "Accelerate's torchao filter skips every Linear whose "
                           "dims are not multiples of 16, so padding never acts (utils/ao.py)")
        if all_gather and engine != "fsdp2":
            notes.resolved(f"{prefix}enable_fsdp_float8_all_gather", False, "acts only under FSDP2")
            all_gather = False
        fp8 = {"backend": "torchao", "modules": {"exclude": [], "skip_first_last": True},
               "torchao": {"recipe_name": "tensorwise", "enable_fsdp_float8_all_gather": all_gather,
                           "force_recompute_fp8_weight_in_bwd": False, "pad_inner_dim": False}}
        notes.resolved(f"{prefix}(module filter)", "modules: {exclude: [], skip_first_last: true}", "Accelerate "
                       "keeps the first and the last nn.Linear in high precision (utils/ao.py convert_model_to_fp8_ao)")
    elif backend == "te":
        mxfp8 = bool(truthy(take("use_mxfp8_block_scaling")))
        te: dict[str, Any] = {"recipe": "mxfp8" if mxfp8 else "delayed"}
        # Accelerate passes only the fields that differ from TERecipeKwargs' defaults (KwargsHandler.to_kwargs): a
        # value equal to its default (or a key the launcher exports under an unread name) leaves TE's default.
        for name, accelerate_default in (("fp8_format", "HYBRID"), ("margin", 0), ("amax_history_len", 1024),
                                         ("amax_compute_algo", "most_recent")):
            written = name in items
            value = take(name)
            if not written:
                continue
            if name == "fp8_format":
                value = str(value).upper()
                if value == "E5M2":
                    issues.append(Issue(f"{prefix}{name}", "Transformer Engine rejects E5M2-only training", value,
                                        "use HYBRID or E4M3"))
                    continue
            if value == accelerate_default and (name == "amax_compute_algo" or (mxfp8 and name == "fp8_format")):
                notes.resolved(f"{prefix}{name}", "Transformer Engine's default", f"{value} is TERecipeKwargs' "
                               "default, which Accelerate leaves out of the recipe (KwargsHandler.to_kwargs)")
                continue
            if mxfp8 and name in ("amax_history_len", "amax_compute_algo"):
                notes.dropped(f"{prefix}{name}", value, "not a field of MXFP8BlockScaling (Accelerate raises on it)")
                continue
            if mxfp8 and name == "margin":
                # fp8dist's MXFP8BlockScaling record has `margin` as a field the class keeps and ignores, with why
                margin = cast(TEField, TE_RECIPES["mxfp8"].field("margin"))
                notes.dropped(f"{prefix}{name}", value, cast(str, margin.ignored))
                continue
            te[name] = int(value) if name in ("margin", "amax_history_len") else value
        for name in ("interval", "override_linear_precision", "use_autocast_during_eval"):
            if name in items:
                key, value = items.pop(name)
                why = {"interval": "removed from Transformer Engine 2.2 (TransformerEngine#1607)",
                       "override_linear_precision": "removed from Transformer Engine 2.0",
                       "use_autocast_during_eval": "fp8dist does not run evaluation"}[name]
                notes.dropped(f"{prefix}{key}", value, why)
        fp8 = {"backend": "te", "te": te, "modules": {"exclude": [], "skip_first_last": False}}
    else:
        level = str(take("opt_level"))
        if level not in ACCELERATE_MSAMP_OPT_LEVELS:
            notes.resolved(f"{prefix}opt_level", level, "kept, although Accelerate refuses it (MSAMPRecipeKwargs and "
                           "DeepSpeedPlugin accept O1 and O2), so this file fails in Accelerate")
        fp8 = {"backend": "msamp", "msamp": {"opt_level": level}}
    for _short, (key, value) in items.items():
        notes.dropped(f"{prefix}{key}", value, f"not read for the {backend} backend")
    return fp8
