"""NVIDIA Transformer Engine backend, written against TE 2.20 (NVIDIA/TransformerEngine d0067d0:
transformer_engine/common/recipe/__init__.py, transformer_engine/pytorch/{quantization,module/linear,
module/layernorm}.py) with the fallbacks older 2.x releases need.

What it does, as Accelerate's convert_model / apply_fp8_autowrap do: swap nn.Linear -> te.Linear and
nn.LayerNorm -> te.LayerNorm copying the weights (Linears whose dims break the recipe's block size stay
nn.Linear: compat.TE_RECIPE_DIM_MULTIPLE), then run the forward inside te.autocast (TE >= 2.9) or
te.fp8_autocast (older) with the recipe built from the config's upstream-named knobs.

Engines: under DeepSpeed the JSON carries only the bf16/fp16 section (DeepSpeed has no FP8 key) and the
forward runs in the autocast, backward and step outside it (Accelerate benchmarks/fp8/transformer_engine/
distrib_deepspeed.py). Under FSDP2 the swap happens before fully_shard, the te modules keep high-precision
primary weights (no quantized_model_init) and `fuse_wgrad_accumulation` stays at its default False: FSDP2's
reduce-scatter must see the gradients (TE examples/pytorch/quantized_model_init/fully_shard.py). Delayed
scaling reduces amax over the default group, so every rank must run every module each step.
"""
from __future__ import annotations

import inspect
from typing import Any

import fp8dist.compat as compat
from fp8dist.backends.base import PrecisionBackend, register
from fp8dist.backends.module_filter import Decision, decide, linear_infos
from fp8dist.errors import UnsupportedEnvironment
from fp8dist.translate.fsdp2 import te_recipe_fields

TE_DISTRIBUTION = "transformer-engine"


def recipe_kwargs(spec, te_version: compat.Version) -> tuple[str, dict[str, Any]]:
    """The TE recipe class name and constructor kwargs for the config. Pure (no TE import).

    Only fields the user set are passed (TE would silently drop unknown kwargs, so the rules in
    fp8dist.config.rules refuse them up front).
    """
    te = spec.fp8.te
    ok, reason = compat.te_recipe_available(te.recipe, te_version)
    if not ok:
        raise UnsupportedEnvironment(f"precision.fp8.te.recipe={te.recipe}: {reason}",
                                     "upgrade Transformer Engine or choose another recipe")
    for field in compat.TE_REMOVED_FIELDS:
        value = getattr(te, field)
        removed, why = compat.te_field_removed(field, te_version)
        if value is not None and removed:
            raise UnsupportedEnvironment(f"precision.fp8.te.{field}={value!r}: {why}", f"remove precision.fp8.te.{field}")
    return compat.TE_RECIPES[te.recipe][0], te_recipe_fields(spec)


def _te_version() -> compat.Version | None:
    version = compat.installed_version(TE_DISTRIBUTION) or compat.installed_version("transformer_engine")
    return compat.parse_version(version) if version else None


@register
class TransformerEngine(PrecisionBackend):
    name = "te"

    def check_environment(self, device: dict[str, Any]) -> None:
        version = _te_version()
        if version is None:
            raise UnsupportedEnvironment(
                "precision.fp8.backend=te but Transformer Engine is not installed. It needs an NVIDIA GPU with "
                "CUDA 12.1+ to build and to run (H100/H200: every recipe but mxfp8/nvfp4)",
                "on a CUDA machine: pip install 'transformer-engine[pytorch]'; on a CPU machine use "
                "backend=torchao with precision.fp8.torchao.emulate=true")
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception as exc:  # TE raises RuntimeError/OSError without CUDA libraries, not only ImportError
            raise UnsupportedEnvironment(f"Transformer Engine {compat.fmt(version)} is installed but cannot be "
                                         f"imported: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                                         "TE needs the NVIDIA driver and CUDA libraries; run on a GPU machine") from None
        recipe = self.spec.fp8.te.recipe
        cuda = compat.parse_version(device["cuda"]) if device.get("cuda") else None
        ok, reason = compat.te_recipe_hardware(recipe, tuple(device["capability"]) if device.get("capability") else None, cuda)
        if not ok:
            raise UnsupportedEnvironment(f"refusing FP8: {reason}", "run on a GPU the recipe supports, or pick "
                                         "another precision.fp8.te.recipe")
        self.recipe = self.build_recipe(version)

    def build_recipe(self, version: compat.Version):
        from transformer_engine.common import recipe as te_recipe

        class_name, kwargs = recipe_kwargs(self.spec, version)
        if "fp8_format" in kwargs:
            kwargs["fp8_format"] = te_recipe.Format[kwargs["fp8_format"]]
        return getattr(te_recipe, class_name)(**kwargs)

    def convert_module(self, model) -> list[Decision]:
        import torch
        import transformer_engine.pytorch as te

        rules = self.spec.fp8.modules
        decisions = decide(linear_infos(model), rules.exclude, rules.skip_first_last,
                           compat.TE_RECIPE_DIM_MULTIPLE[self.spec.fp8.te.recipe])
        chosen = {d.fqn for d in decisions if d.convert}
        for fqn, module in list(model.named_modules()):
            if fqn in chosen:
                _replace(model, fqn, _te_linear(te, module))
            elif self.spec.fp8.te.swap_layernorm and type(module) is torch.nn.LayerNorm and module.elementwise_affine:
                _replace(model, fqn, _te_layernorm(te, module))
                decisions.append(Decision(fqn, True, "nn.LayerNorm -> te.LayerNorm"))
        return decisions

    def forward_context(self):
        import transformer_engine.pytorch as te

        group = None
        if self.spec.fp8.te.recipe == "delayed":  # only delayed scaling reduces amax across ranks
            import torch.distributed as dist

            group = dist.group.WORLD if dist.is_initialized() else None
        if hasattr(te, "autocast"):  # TE >= 2.9 (TransformerEngine#2256)
            return te.autocast(enabled=True, recipe=self.recipe, amax_reduction_group=group)
        return te.fp8_autocast(enabled=True, fp8_recipe=self.recipe, fp8_group=group)


def _replace(root, fqn: str, new) -> None:
    parent_name, _, child = fqn.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def _te_linear(te, linear):
    import torch

    weight = linear.weight
    new = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    params_dtype=weight.dtype, device=weight.device)
    with torch.no_grad():  # TE's default init is normal(0, 0.023), not nn.Linear's: copy the weights
        new.weight.copy_(weight)
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    return new


def _te_layernorm(te, norm):
    import torch

    weight = norm.weight
    dtype_kw = "dtype" if "dtype" in inspect.signature(te.LayerNorm).parameters else "params_dtype"
    new = te.LayerNorm(norm.normalized_shape[0], eps=norm.eps, device=weight.device, **{dtype_kw: weight.dtype})
    with torch.no_grad():
        new.weight.copy_(weight)
        if norm.bias is not None:
            new.bias.copy_(norm.bias)
    return new
