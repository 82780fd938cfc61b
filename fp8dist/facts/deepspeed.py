"""DeepSpeed: the config sections and defaults that changed between releases, by the release that changed them.
Pull requests are deepspeedai/DeepSpeed's; paths are relative to the wheel's deepspeed/ at the release named."""
from __future__ import annotations

from fp8dist.facts.versions import Version, fmt

# Newest DeepSpeed whose config rules this module knows (the PyPI release fp8dist is tested against).
NEWEST_KNOWN_DEEPSPEED = (0, 19, 8)
# `torch_autocast` section: 0.17.2 (#6993; runtime/torch_autocast.py, runtime/config.py get_torch_autocast_enabled);
# combined with fp16/bf16 since 0.18.3 (#7700).
DS_TORCH_AUTOCAST = (0, 17, 2)
DS_AUTOCAST_WITH_BF16 = (0, 18, 3)
# bf16_master_weights_and_grads / bf16_optimizer_states (runtime/precision_config.py): 0.18.3 (#7700).
DS_BF16_MASTER = (0, 18, 3)
# `amp` (Apex) section removed: any `amp` key raises DeepSpeedConfigError in 0.19.8 (#8564; 0.19.8
# runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS, which points to issue #8489).
DS_AMP_REMOVED = (0, 19, 8)
# AutoTP training (`tensor_parallel.autotp_size`): 0.16.4 (#6922; Accelerate 1.15 utils/constants.py
# DEEPSPEED_AUTOTP_MIN_VERSION checks the same); with ZeRO-3 only from 0.19.4 (#8168; runtime/engine.py: "AutoTP +
# ZeRO stage 3 is supported for both inference and training"; 0.17.0-0.19.3 assert zero_optimization_stage() <= 2).
DS_AUTOTP_TRAINING = (0, 16, 4)
DS_AUTOTP_ZERO3 = (0, 19, 4)
# AutoEP (`expert_parallel.enabled` / `autoep_size`: each detected MoE layer swapped for DeepSpeed's own
# AutoEPMoELayer, its experts split over autoep_size ranks): 0.19.2 (#7938; module_inject/auto_ep_config.py
# parse_autoep_config), at ZeRO 0-2 only (0.19.2 runtime/engine.py asserts "MoE not supported with Stage 3"); with
# ZeRO-3 from 0.19.3 (#8060; runtime/engine.py _validate_zero3_moe_compatibility).
DS_AUTOEP = (0, 19, 2)
DS_AUTOEP_ZERO3 = (0, 19, 3)
# The models AutoEP has presets for (deepspeed 0.19.8 module_inject/auto_ep_presets/registry.py PRESET_MODELS): it
# takes the preset of the model's config.model_type, else tries each (resolve_preset_candidates).
DS_AUTOEP_PRESETS = ("mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "minimax_m3")
# gradient_clipping default became 1.0 in 0.19.3 (#8068; runtime/constants.py GRADIENT_CLIPPING_DEFAULT); 0.0 before.
DS_CLIPPING_DEFAULT_CHANGED = (0, 19, 3)


def deepspeed_has_torch_autocast(ds: Version) -> tuple[bool, str]:
    if ds >= DS_TORCH_AUTOCAST:
        return True, f"DeepSpeed {fmt(ds)} has the torch_autocast section"
    return False, (f"DeepSpeed {fmt(ds)} has no torch_autocast section (added in "
                   f"{fmt(DS_TORCH_AUTOCAST)})")


def deepspeed_has_bf16_master(ds: Version) -> tuple[bool, str]:
    if ds >= DS_BF16_MASTER:
        return True, f"DeepSpeed {fmt(ds)} has bf16_master_weights_and_grads"
    return False, (f"DeepSpeed {fmt(ds)} lacks bf16_master_weights_and_grads / bf16_optimizer_states "
                   f"(added in {fmt(DS_BF16_MASTER)})")


def _split_gate(ds: Version, zero_stage: int, name: str, added: Version, zero3: Version,
                zero3_refusal: str) -> tuple[bool, str]:
    """Whether DeepSpeed `ds` trains with its model-splitting feature `name` (added in `added`, with ZeRO-3 from
    `zero3`; before that DeepSpeed asserts `zero3_refusal`) at this ZeRO stage."""
    if ds < added:
        return False, f"DeepSpeed {fmt(ds)} has no {name} (added in {fmt(added)})"
    if zero_stage == 3 and ds < zero3:
        return False, f"DeepSpeed {fmt(ds)} asserts {zero3_refusal} ({name} with ZeRO-3 from {fmt(zero3)})"
    return True, f"DeepSpeed {fmt(ds)} trains with {name} at ZeRO-{zero_stage}"


def deepspeed_autotp(ds: Version, zero_stage: int) -> tuple[bool, str]:
    """Whether DeepSpeed `ds` trains with AutoTP at this ZeRO stage."""
    return _split_gate(ds, zero_stage, "AutoTP", DS_AUTOTP_TRAINING, DS_AUTOTP_ZERO3, "ZeRO stage <= 2 with AutoTP")


def deepspeed_autoep(ds: Version, zero_stage: int) -> tuple[bool, str]:
    """Whether DeepSpeed `ds` trains with AutoEP (expert parallel) at this ZeRO stage."""
    return _split_gate(ds, zero_stage, "AutoEP", DS_AUTOEP, DS_AUTOEP_ZERO3,
                       "that MoE layers are not supported with ZeRO stage 3")
