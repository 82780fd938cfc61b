"""`adapter`: PEFT's LoRA applied to a loaded model, before any FP8 conversion or sharding (the engines then
see frozen base weights, `requires_grad=False`, beside trainable adapters, and keep each group in its own
precision: engines/fsdp2/engine.py, engines/optim.py).

The engines get the model PEFT injected the adapters into (`PeftModel.get_base_model()`), not the PeftModel
wrapper: the module names stay those of the base model plus `.base_layer` / `.lora_A.default` /
`.lora_B.default`, so exclusion patterns, activation checkpointing and FSDP2's units find the same blocks as
in a full fine-tune. The LoraConfig rides along as `model.fp8dist_lora_config` (export writes it back).

`adapter.modules_to_save` trains whole modules beside the adapters, as PEFT's LoraConfig(modules_to_save=...) does
(peft 0.21 utils/other.py ModulesToSaveWrapper): `<module>` becomes a wrapper holding the frozen
`<module>.original_module` and the trained copy `<module>.modules_to_save.default`, which the engines step with the
adapters (every parameter with requires_grad) and the checkpoint and export keep with them.
"""
from __future__ import annotations


from typing import Sequence

from fp8dist.backends.module_filter import is_adapter, linear_infos
from fp8dist.config.spec import AdapterSpec
from fp8dist.dtypes import torch_dtype
from fp8dist.errors import Fp8distError
from fp8dist.facts.peft import PEFT_ALL_LINEAR, PEFT_MODULE_NAMES, SAVED_COPY

ADAPTER_NAME = "default"  # the adapter PEFT's get_peft_model creates


def lora_config(adapter: AdapterSpec, exclude: Sequence[str] = ()):
    """PEFT's LoraConfig for `adapter`. No task type: fp8dist keeps only the injected base model, and a task type
    would make PEFT require generation methods of the model (PeftModelForCausalLM). `use_dora` adds DoRA's magnitude
    vector beside each adapter (peft 0.21 tuners/lora/dora.py: `<target>.lora_magnitude_vector.<adapter>.weight`,
    trained with the adapters)."""
    from peft import LoraConfig

    targets = PEFT_ALL_LINEAR if adapter.target_modules == "auto" else list(adapter.target_modules)
    # peft 0.21 annotates lora_alpha as int, yet only ever divides by it (tuners/lora/layer.py update_layer:
    # scaling = lora_alpha / r): a fractional alpha is a valid scale.
    return LoraConfig(r=adapter.r, lora_alpha=adapter.alpha,  # type: ignore[arg-type]
                      lora_dropout=adapter.dropout, target_modules=targets,
                      exclude_modules=list(exclude) or None, bias="none",
                      modules_to_save=list(adapter.modules_to_save) or None, use_dora=adapter.use_dora)


def is_saved_module(name: str) -> bool:
    """A parameter (or module) of the trained copy of a module to save (adapter.modules_to_save), by PEFT's names,
    whatever the adapter's name (a loop fp8dist.audit.watch sees may name it otherwise than `default`)."""
    return f".{SAVED_COPY}." in f".{name}."


def trained_beside_base(name: str) -> bool:
    """What an adapter run trains (and its checkpoint holds): the adapters and the modules to save."""
    return is_adapter(name) or is_saved_module(name)


def _check_modules_to_save(model, names: Sequence[str]) -> None:
    """Each module to save names modules of `model` by their last name parts, as PEFT wraps them, and none holds a
    weight tied to a module outside it. PEFT matches the end of each module's name (peft 0.21 utils/other.py
    _set_trainable): a name it would match inside a part (`head` in lm_head) is refused, and so is one it matches
    nowhere, which PEFT skips in silence. PEFT copies a module to save alone (ModulesToSaveWrapper.update: deepcopy),
    which unties a tied pair: the output layer would train while the embedding it shares stays frozen, and a merged
    export would hold two matrices where the model has one; PEFT's ensure_weight_tying (one trained copy shared by
    both modules) is not a path fp8dist runs."""
    for name in names:  # PEFT wraps after injecting LoRA: its own modules' names are matched too
        own = [part for part in PEFT_MODULE_NAMES if part.endswith(name)]
        if own:
            raise Fp8distError(f"adapter.modules_to_save={list(names)!r}: PEFT matches the end of every module name "
                               f"once the adapters are in, so {name!r} would also train PEFT's own {own[0]} modules "
                               f"whole\n  fix: name modules of this model by their last name parts, not a suffix of "
                               f"{', '.join(PEFT_MODULE_NAMES)}")
    modules = [name for name, _ in model.named_modules()]
    owners: dict[int, list[str]] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(pname)
    key, fix = f"adapter.modules_to_save={list(names)!r}", "name modules of this model by their last name parts"
    for name in names:
        matched = [module for module in modules if module.endswith(name)]
        exact = [module for module in matched if module == name or module.endswith(f".{name}")]
        if matched != exact:
            raise Fp8distError(f"{key}: PEFT matches the end of every module name, so {name!r} would also train "
                               f"{', '.join(m for m in matched if m not in exact)} whole\n  fix: {fix}")
        if not exact:
            raise Fp8distError(f"{key}: no module of {type(model).__name__} is named {name!r}\n  fix: {fix} (e.g. "
                               "lm_head, embed_tokens), or remove it")
        for module in exact:
            for pname, param in model.get_submodule(module).named_parameters(prefix=module, remove_duplicate=False):
                tied = [other for other in owners[id(param)] if not other.startswith(f"{module}.")]
                if tied:
                    raise Fp8distError(
                        f"{key}: {pname} is tied to {tied[0]} (tied weights, e.g. tie_word_embeddings), and PEFT "
                        f"trains a copy of {module} alone, which unties them: {module} would train while {tied[0]} "
                        "stays "
                        "frozen, and a merged export would hold two matrices where the model has one (fp8dist does "
                        "not run PEFT's ensure_weight_tying)\n  fix: train a copy of the model saved untied "
                        "(tie_word_embeddings=false, both weights written), or remove "
                        f"{name} from adapter.modules_to_save")


def _routers(model) -> list[str]:
    """MoE routers that are nn.Linear (transformers 5 afmoe): PEFT's all-linear would adapt them, and fp8dist keeps
    routers as they are (backends/module_filter.is_router)."""
    return [info.fqn for info in linear_infos(model) if info.router]


def apply_adapter(model, adapter: AdapterSpec, weight_dtype: str, seed: int):
    """`model` with LoRA adapters on `adapter.target_modules`, a trained copy of each of `adapter.modules_to_save`,
    and every other parameter frozen (kind none: the model as it is). The adapters' initial values (lora_A's) are
    drawn after seeding with `seed`, so every rank and every run of a config starts from the same ones. PEFT creates
    the adapters in fp32 over a 16-bit base (peft 0.21 get_peft_model `autocast_adapter_dtype=True`); they and the
    modules' copies are then given the dtype the optimizer steps, `weight_dtype` (the master dtype, or the load
    dtype without masters), as every trainable parameter has it."""
    if not adapter.enabled:
        return model
    import torch
    from peft import get_peft_model

    config = lora_config(adapter, _routers(model) if adapter.target_modules == "auto" else ())
    if adapter.modules_to_save:
        _check_modules_to_save(model, adapter.modules_to_save)
    torch.manual_seed(seed)
    try:
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as exc:  # PEFT's "Target modules {...} not found in the base model"
        named = adapter.target_modules if adapter.target_modules == "auto" else list(adapter.target_modules)
        saved = (f" (adapter.modules_to_save={list(adapter.modules_to_save)!r} train whole, with no adapter on or "
                 "inside them)") if adapter.modules_to_save else ""
        raise Fp8distError(f"adapter.target_modules={named!r}: {str(exc).splitlines()[0]}{saved}\n  fix: "
                           "name modules of this model (e.g. q_proj, v_proj), or use adapter.target_modules=auto") \
            from None
    base = peft_model.get_base_model()
    if adapter.modules_to_save and adapter.target_modules != "auto":
        _check_targets_outside_saved(base, adapter)
    for param in base.parameters():
        if param.requires_grad:
            param.data = param.data.to(torch_dtype(weight_dtype))
    base.fp8dist_lora_config = peft_model.peft_config["default"]
    return base


def _check_targets_outside_saved(model, adapter: AdapterSpec) -> None:
    """A listed target inside a module to save gets no adapter: PEFT leaves out of LoRA every module under one it
    saves whole (peft 0.21 tuners/tuners_utils.py _check_target_module_exists with modules_to_save), so the list
    would not mean what it says for those (e.g. target_modules [q_proj] with modules_to_save [self_attn])."""
    from peft.tuners.lora import LoraLayer

    targets = set(adapter.target_modules)
    inside = [name for name, module in model.named_modules() if name.rpartition(".")[2] in targets
              and f".{SAVED_COPY}." not in f".{name}." and ".original_module." in f".{name}."
              and not isinstance(module, LoraLayer)]
    if inside:
        raise Fp8distError(f"adapter.target_modules={list(adapter.target_modules)!r} with adapter.modules_to_save="
                           f"{list(adapter.modules_to_save)!r}: {inside[0].replace('.original_module', '')}"
                           f"{f' and {len(inside) - 1} more' if len(inside) > 1 else ''} lie inside a module trained "
                           "whole, where PEFT puts no adapter\n  fix: leave those targets out, or save smaller "
                           "modules")


def split_parameters(model) -> tuple[int, int]:
    """(trainable, frozen) element counts of `model`'s whole parameters (ZeRO-3: `ds_numel`, its partitioned
    module tensors are empty; FSDP2's DTensors count their global size)."""
    trainable = frozen = 0
    for param in model.parameters():
        numel = param.ds_numel if hasattr(param, "ds_numel") else param.numel()
        if param.requires_grad:
            trainable += numel
        else:
            frozen += numel
    return trainable, frozen


