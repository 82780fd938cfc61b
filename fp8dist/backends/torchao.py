"""torchao float8 training (torchao 0.18: torchao/float8/{config,float8_linear_utils,fsdp_utils}.py)."""
from __future__ import annotations

import dataclasses
from typing import Any

from fp8dist.backends.experts import convert as convert_experts, experts_modules
from fp8dist.backends.base import PrecisionBackend, register
from fp8dist.backends.module_filter import Decision, decide, linear_infos, matching_pattern, policy_of
from fp8dist.errors import UnsupportedEnvironment
from fp8dist.facts import versions
from fp8dist.facts.torchao import TORCHAO_PROTOTYPE_VERIFIED, torchao_experts_mode, torchao_fp8_hardware
from fp8dist.facts.versions import fmt, parse_version
from fp8dist.translate.fsdp2 import FSDP2Plan, TorchaoFloat8Plan, torchao_float8_plan, torchao_recipe_dims


_EXPERTS_FIX = ("set precision.fp8.torchao.experts=none to keep the experts in the compute dtype (the audit then "
                "fails naming them), precision.fp8.torchao.emulate=true to emulate MXFP8 (tests only), or run on a "
                "GPU that has the format")


@register
class TorchaoFloat8(PrecisionBackend):
    name = "torchao"

    def __init__(self, spec, plan: FSDP2Plan | None = None):
        super().__init__(spec, plan)
        self.plan = (plan.float8 if plan is not None and isinstance(plan.float8, TorchaoFloat8Plan)
                     else torchao_float8_plan(spec))
        # resolved for the hardware by check_environment, which every engine calls before convert_module
        self.experts_mode: str | None = None
        self.experts_why = "check_environment was not called"
        self.converted: list = []  # the Linears convert_module converted (precision.schedule switches them)
        self.switched = False
        # MXFP8 after TP (torchao 0.18 testing/training/dtensor_utils.py: "For MXFP8: parallelize first, then
        # quantize"); float8 Linears before it ("Float8 TP strategies expect Float8 weights").
        self.converts_after_tensor_parallel = self.plan.float8_linear_config.recipe_name == "mxfp8"

    def check_environment(self, device: dict[str, Any]) -> None:
        if versions.installed_version("torchao") is None:
            raise UnsupportedEnvironment("precision.fp8.backend=torchao but torchao is not installed",
                                         "pip install torchao")
        ao = self.spec.fp8.torchao
        if ao.recipe_name == "mxfp8":
            self._check_prototype_api("precision.fp8.torchao.recipe_name=mxfp8")
        if ao.experts in ("mxfp8", "float8"):
            self._check_prototype_api(f"precision.fp8.torchao.experts={ao.experts}")
        capability = tuple(device["capability"]) if device.get("capability") else None
        self.experts_mode, self.experts_why = torchao_experts_mode(ao.experts, ao.emulate, capability)
        if self.experts_mode is None and ao.experts != "auto":  # auto refuses only a model that has experts
            raise UnsupportedEnvironment(f"precision.fp8.torchao.experts={ao.experts}: {self.experts_why}",
                                         _EXPERTS_FIX)
        if ao.emulate:
            return
        ok, reason = torchao_fp8_hardware(ao.recipe_name,
                                          tuple(device["capability"]) if device.get("capability") else None)
        if not ok:
            raise UnsupportedEnvironment(f"refusing FP8: {reason}",
                                         "run on an H100/H200 (SM 9.0) or Ada (SM 8.9) GPU, or set "
                                         "precision.fp8.torchao.emulate=true to emulate float8 (tests only, slow)",
                                         fix_settings={"precision.fp8.torchao.emulate": True})

    @staticmethod
    def _check_prototype_api(key: str) -> None:
        installed = versions.installed_version("torchao")
        if installed and parse_version(installed) < TORCHAO_PROTOTYPE_VERIFIED:
            verified = fmt(TORCHAO_PROTOTYPE_VERIFIED)
            raise UnsupportedEnvironment(f"{key} calls torchao's prototype MoE / MX training API as torchao {verified} "
                                         f"has it; torchao {installed} is installed",
                                         f"pip install 'torchao>={verified}', or set precision.fp8.torchao.experts="
                                         "none and recipe_name to a float8 recipe")

    def float8_linear_config(self, recipe: str | None = None):
        """torchao's Float8LinearConfig of `recipe` (default the run's) with fp8dist's knobs; float8 all-gather only
        for tensorwise (torchao 0.18 Float8LinearConfig.__post_init__ asserts it), so a tensorwise override under a
        rowwise run gathers its weights in float8 and the rowwise Linears in the compute dtype."""
        from torchao.float8 import Float8LinearConfig

        knobs = self.plan.float8_linear_config.to_json()  # the fields to replace, as torchao names them
        recipe = recipe or knobs["recipe_name"]
        knobs.pop("recipe_name")
        if recipe != "tensorwise":
            knobs["enable_fsdp_float8_all_gather"] = False
            knobs.pop("force_recompute_fp8_weight_in_bwd", None)  # acts with float8 all-gather only
        return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), **knobs)

    def convert_module(self, model) -> list[Decision]:
        from torchao.float8 import convert_to_float8_training

        rules = self.plan.module_filter
        decisions = decide(linear_infos(model), rules.exclude, rules.skip_first_last,
                           rules.require_dims_multiple_of, "; precision.fp8.torchao.pad_inner_dim=true pads instead",
                           self.speed_rule, policy_of(self.spec.fp8, torchao_recipe_dims(self.spec.fp8.torchao)))
        by_recipe: dict[str, set[str]] = {}
        for d in decisions:
            if d.convert and d.recipe is not None:
                by_recipe.setdefault(d.recipe, set()).add(d.fqn)
        for recipe, chosen in by_recipe.items():  # each Linear with its own recipe's config
            if recipe == "mxfp8":
                self._to_mxfp8_linears(model, chosen)
            else:
                convert_to_float8_training(model, config=self.float8_linear_config(recipe),
                                           module_filter_fn=lambda module, fqn, chosen=chosen: fqn in chosen)
        modules = dict(model.named_modules())
        self.converted = [modules[d.fqn] for d in decisions if d.convert]
        experts = self._convert_experts(model, rules.exclude)
        if self.spec.switch_step is not None and any(d.convert for d in experts):
            raise UnsupportedEnvironment(
                "precision.schedule: the model's MoE experts run torchao's grouped GEMMs, which the switch does not "
                "turn off (it acts on the FP8 Linears)", "set precision.fp8.torchao.experts=none with a schedule, or "
                "remove precision.schedule", fix_settings={"precision.fp8.torchao.experts": "none"})
        return decisions + experts

    def at_step(self, step: int) -> None:
        """precision.schedule: from its switch step on, the converted Linears' forward GEMMs (or all) run in the
        compute dtype. A Float8Linear reads its cast configs at every call (torchao 0.18 float8_linear.py
        matmul_with_hp_or_float8_args: an operand whose CastConfig is ScalingType.DISABLED stays in high
        precision), so the switch replaces each one's config; an MXFP8Linear (gemms: all only, the config rules)
        becomes the nn.Linear it was, its parameters untouched. The switch depends on the step alone, so a run
        resumed past it switches before its first step, as the uninterrupted run did."""
        switch = self.spec.switch_step
        if self.switched or switch is None or step < switch:
            return
        import torch
        from torchao.float8.config import CastConfig, ScalingType

        off = CastConfig(scaling_type=ScalingType.DISABLED)
        forward = {"cast_config_input": off, "cast_config_weight": off}
        every = {**forward, "cast_config_grad_output": off, "cast_config_weight_for_grad_input": off,
                 "cast_config_input_for_grad_weight": off, "cast_config_grad_output_for_grad_weight": off}
        gemms = self.spec.precision.schedule.gemms
        for module in self.converted:
            if type(module).__name__ == "MXFP8Linear":  # a Linear inside a block: fully_shard leaves its class
                module.__class__ = torch.nn.Linear
            else:
                module.config = dataclasses.replace(module.config, **(forward if gemms == "forward" else every))
        self.switched = True

    def _to_mxfp8_linears(self, model, chosen: set[str]) -> None:
        """torchao's MXFP8Linear is an nn.Linear whose forward quantizes both operands of all three GEMMs to MXFP8
        (torchao 0.18 prototype/moe_training/mxfp8_linear.py): the chosen Linears become one in place, keeping
        their parameters (and so the loader's and the engines' view of them)."""
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
        from torchao.prototype.mx_formats.config import ScaleCalculationMode

        preference = KernelPreference.EMULATED if self.spec.fp8.torchao.emulate else KernelPreference.AUTO
        for fqn, module in model.named_modules():
            if fqn in chosen:
                module.__class__ = MXFP8Linear
                module.kernel_preference, module.wgrad_with_hp = preference, False
                module.scale_calculation_mode = ScaleCalculationMode.RCEIL

    def _convert_experts(self, model, exclude) -> list[Decision]:
        """MoE experts (3-D parameters, grouped GEMMs): in the mode check_environment resolved for this hardware."""
        if self.experts_mode == "none" or not experts_modules(model):
            return []
        if self.experts_mode is None:
            raise UnsupportedEnvironment(f"the model has MoE experts and {self.experts_why}", _EXPERTS_FIX)
        self._check_prototype_api(f"precision.fp8.torchao.experts={self.spec.fp8.torchao.experts} (here "
                                  f"{self.experts_mode}, the model has MoE experts)")
        return convert_experts(model, self.experts_mode, self.spec.fp8.torchao.emulate,
                               lambda name: matching_pattern(name, exclude))

    def after_optimizer_step(self, model) -> None:
        if self.plan.precompute_float8_dynamic_scale_for_fsdp:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

