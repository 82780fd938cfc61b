"""NVIDIA Transformer Engine backend, for TE 2.1-2.20.2 (TE_OLDEST_SUPPORTED-TE_NEWEST_KNOWN in
fp8dist.facts.transformer_engine; written against NVIDIA/TransformerEngine d0067d0 and the registry wheels:
transformer_engine/common/recipe/__init__.py,
transformer_engine/pytorch/{quantization,distributed,module/linear,module/layernorm}.py).

What it does, as Accelerate's convert_model / apply_fp8_autowrap do: swap nn.Linear -> te.Linear and
nn.LayerNorm -> te.LayerNorm copying the weights (Linears whose dims break the recipe's block size stay
nn.Linear: TE_RECIPES dim_multiple), then run the forward inside te.autocast (TE >= 2.9) or
te.fp8_autocast (older) with the recipe the FSDP2 translation plans (translate/fsdp2.py te_recipe_plan) for the
installed TE.

On a meta-built model (RAM-efficient loading) te.Linear is built with device="meta", the string: TE defers the
initialisation only when `device == "meta"` (2.20.2 module/linear.py:2242; torch.device("meta") == "meta" is False,
and TE would then allocate the full weight on CUDA, module/base.py:1820-1821), and the loader fills the weights.

Activation checkpointing recomputes a block in backward, outside te.autocast: the checkpoint's context_fn re-enters
the autocast there, as TE's own checkpoint does (checkpoint_context_fn).

Engines: under DeepSpeed the JSON carries only the bf16/fp16 section (DeepSpeed has no FP8 key) and the
forward runs in the autocast, backward and step outside it (Accelerate benchmarks/fp8/transformer_engine/
distrib_deepspeed.py). Under FSDP2 the swap happens before fully_shard, the te modules keep high-precision
primary weights (no quantized_model_init) and `fuse_wgrad_accumulation` stays at its default False: FSDP2's
reduce-scatter must see the gradients (TE examples/pytorch/quantized_model_init/fully_shard.py). Delayed
scaling reduces amax over the default group, so every rank must run every module each step.
"""
from __future__ import annotations

import dataclasses
import inspect
from contextlib import contextmanager
from typing import Any

from fp8dist.backends.base import PrecisionBackend, register
from fp8dist.backends.module_filter import Decision, decide, linear_infos, policy_of
from fp8dist.errors import UnsupportedEnvironment
from fp8dist.facts.transformer_engine import TE_OLDEST_SUPPORTED, TE_RECIPES, te_recipe_hardware, te_supported
from fp8dist.facts.versions import Version, fmt, parse_version
from fp8dist.translate.fsdp2 import installed_te, te_recipe_plan


def installed_te_version() -> Version | None:
    version = installed_te()
    return parse_version(version) if version else None


def build_recipe(recipe_module, spec, te_version: Version):
    """The recipe object te_recipe_plan describes for `te_version`, from `recipe_module`
    (transformer_engine.common.recipe; the contract tests pass a release wheel's): the class with the user's
    arguments, then the recipe attributes te.Linear reads instead of a field (each a frozen dataclass, replaced)."""
    plan = te_recipe_plan(spec, te_version)
    kwargs = dict(plan.recipe_fields)
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = recipe_module.Format[kwargs["fp8_format"]]
    recipe = getattr(recipe_module, plan.recipe_class)(**kwargs)
    for path, value in plan.recipe_attributes.items():
        attribute, member = path.split(".")
        setattr(recipe, attribute, dataclasses.replace(getattr(recipe, attribute), **{member: value}))
    return recipe


@register
class TransformerEngine(PrecisionBackend):
    name = "te"

    def check_environment(self, device: dict[str, Any]) -> None:
        version = installed_te_version()
        if version is None:
            raise UnsupportedEnvironment(
                "precision.fp8.backend=te but Transformer Engine is not installed. It needs an NVIDIA GPU with "
                "CUDA 12.1+ to build and to run (H100/H200: every recipe but mxfp8/nvfp4)",
                "on a CUDA machine: pip install 'transformer-engine[pytorch]'; on a CPU machine use "
                "backend=torchao with precision.fp8.torchao.emulate=true")
        ok, reason = te_supported(version)
        if not ok:
            raise UnsupportedEnvironment(f"precision.fp8.backend=te: {reason}", "pip install -U "
                                         f"'transformer-engine[pytorch]>={fmt(TE_OLDEST_SUPPORTED)}'")
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception as exc:  # TE raises RuntimeError/OSError without CUDA libraries, not only ImportError
            raise UnsupportedEnvironment(f"Transformer Engine {fmt(version)} is installed but cannot be "
                                         f"imported: {type(exc).__name__}: "
                                         f"{str(exc).splitlines()[0] if str(exc) else ''}",
                                         "TE needs the NVIDIA driver and CUDA libraries; run on a GPU machine"
                                         ) from None
        recipe = self.spec.fp8.te.recipe
        cuda = parse_version(device["cuda"]) if device.get("cuda") else None
        ok, reason = te_recipe_hardware(recipe, tuple(device["capability"]) if device.get("capability") else None, cuda)
        if not ok:
            raise UnsupportedEnvironment(f"refusing FP8: {reason}", "run on a GPU the recipe supports, or pick "
                                         "another precision.fp8.te.recipe")
        from transformer_engine.common import recipe as te_recipe

        self.recipe = build_recipe(te_recipe, self.spec, version)

    def convert_module(self, model) -> list[Decision]:
        import torch
        import transformer_engine.pytorch as te

        rules = self.spec.fp8.modules
        decisions = decide(linear_infos(model), rules.exclude, rules.skip_first_last,
                           TE_RECIPES[self.spec.fp8.te.recipe].dim_multiple, speed_rule=self.speed_rule,
                           policy=policy_of(self.spec.fp8))  # overrides: the run's recipe or none (config rules)
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

    def checkpoint_context_fn(self):
        return self._checkpoint_contexts

    def _checkpoint_contexts(self):
        """TE's own checkpoint's pair (2.20.2 pytorch/distributed.py:611-621 get_activation_recompute_contexts and
        :808-815; 2.2 L712-713): the forward stashes the delayed-scaling scales and amaxes for the recompute
        (activation_recompute_forward, in every 2.x), which runs in the recipe's autocast again."""
        from transformer_engine.pytorch.distributed import activation_recompute_forward

        @contextmanager
        def recompute():
            with activation_recompute_forward(activation_recompute=True, recompute_phase=True), \
                    self.forward_context():
                yield

        return activation_recompute_forward(activation_recompute=True, recompute_phase=False), recompute()


def _replace(root, fqn: str, new) -> None:
    parent_name, _, child = fqn.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def _te_linear(te, linear):
    import torch

    weight = linear.weight
    meta = weight.device.type == "meta"  # TE defers the init only for the string (module docstring)
    new = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    params_dtype=weight.dtype, device="meta" if meta else weight.device)
    if not meta:  # on meta the loader fills the weights once the model is sharded
        with torch.no_grad():  # TE's default init is normal(0, 0.023), not nn.Linear's: copy the weights
            new.weight.copy_(weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
    return new


def _te_layernorm(te, norm):
    import torch

    weight = norm.weight
    dtype_kw = "dtype" if "dtype" in inspect.signature(te.LayerNorm).parameters else "params_dtype"
    # te.LayerNorm defers on torch.device("meta") too (2.20.2 ops/basic/layer_norm.py:96-97, device.type)
    new = te.LayerNorm(norm.normalized_shape[0], eps=norm.eps, device=weight.device, **{dtype_kw: weight.dtype})
    if weight.device.type != "meta":
        with torch.no_grad():
            new.weight.copy_(weight)
            if norm.bias is not None:
                new.bias.copy_(norm.bias)
    return new
