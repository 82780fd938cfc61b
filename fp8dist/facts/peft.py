"""PEFT's LoRA names: how an adapter's own modules and a wrapped model's modules are named, and the shorthand for
every Linear. Paths are relative to the peft 0.21 wheel's peft/."""
from __future__ import annotations

# tuners/lora/layer.py LoraLayer.adapter_layer_names ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
# "lora_magnitude_vector"): an adapter's own modules are named `<target>.lora_A.<adapter>`; the Linear it adapts
# becomes `<target>.base_layer`. FP8 filters (fp8dist's and the one fp8dist hands Accelerate) leave them out.
LORA_MODULE_PREFIX = "lora_"


def is_lora_module(fqn: str) -> bool:
    """A LoRA adapter's own module or parameter (lora_A, lora_B, lora_embedding_*, lora_magnitude_vector), by PEFT's
    names."""
    return any(part.startswith(LORA_MODULE_PREFIX) for part in fqn.split("."))


# utils/constants.py INCLUDE_LINEAR_LAYERS_SHORTHAND: LoraConfig target_modules for every Linear but the output layer
# (tuners/tuners_utils.py _maybe_include_all_linear_layers); fp8dist's `adapter.target_modules: auto`.
PEFT_ALL_LINEAR = "all-linear"

# peft_model.py / tuners/tuners_utils.py BaseTuner.model: a PeftModel puts `base_model.model.` in front.
PEFT_MODEL_PREFIX = "base_model.model."


def peft_base_name(fqn: str) -> str:
    """The name a module had before PEFT wrapped it (`base_model.model.` and `.base_layer` left out): exclusion
    patterns written for the base model match the same modules in an adapter run."""
    fqn = fqn[len(PEFT_MODEL_PREFIX):] if fqn.startswith(PEFT_MODEL_PREFIX) else fqn
    return fqn.replace(".base_layer", "")

# utils/other.py ModulesToSaveWrapper: the trained copy of a module to save is `<module>.modules_to_save.<adapter>`,
# the frozen one `<module>.original_module`.
SAVED_COPY = "modules_to_save"
# The module names PEFT adds around an adapted Linear (tuners/lora/layer.py LoraLayer.adapter_layer_names /
# other_param_names) and a module to save, which its modules_to_save matching (utils/other.py _set_trainable:
# key.endswith(name)) also sees.
# tuners/lora/layer.py LoraLayer: DoRA's magnitude vector, a module per adapter (`<target>.lora_magnitude_vector.
# <adapter>.weight`), which the adapter file keeps under `<target>.lora_magnitude_vector` (tuners/lora/model.py
# LoraModel._get_adapter_state_dict).
DORA_MAGNITUDE = "lora_magnitude_vector"
PEFT_MODULE_NAMES = ("lora_A", "lora_B", "lora_dropout", "lora_embedding_A", "lora_embedding_B",
                     DORA_MAGNITUDE, "base_layer", "default", "original_module", SAVED_COPY)

# tuners/lora/dora.py DoraLinearLayer, each forward: `get_lora_weight` runs lora_A and lora_B over an in_features x
# in_features identity (torch.eye, in the adapter weights' dtype), kept by autograd as lora_A's input until the layer's
# forward ends; `get_weight_norm` then holds the update, its scaled copy and their sum with the base weight (three
# out x in tensors). DoraEmbeddingLayer builds its update as lora_A @ lora_B, with no identity. (fp8dist/estimate/
# dora.py counts them; tests/unit/estimate/test_estimate_dora.py measures one.)
DORA_UPDATE_COPIES = 3
