"""The rules of the per-Linear precision policy (precision.fp8.overrides, keep_first_layers / keep_last_layers)
and of precision.schedule: what each backend's path can run, the rest refused naming the key and why."""
from __future__ import annotations

from typing import Any, Mapping

from fp8dist.config.engines import TRAITS
from fp8dist.config.spec import Spec
from fp8dist.errors import Issue

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
TE_ONLY_RECIPES = ("delayed", "current", "block", "nvfp4")


def check(spec: Spec, explicit: Mapping[str, Any]) -> list[Issue]:
    return _without_fp8(spec) + _overrides(spec) + _schedule(spec) + _auto(spec)


def _without_fp8(spec: Spec) -> list[Issue]:
    """A policy or a schedule with no FP8 backend would change nothing: said, not ignored."""
    fp8, schedule = spec.fp8, spec.precision.schedule
    if fp8.enabled:
        return []
    written = [(key, value) for key, value in (
        ("precision.fp8.overrides", [o.recipe for o in fp8.overrides] or None),
        ("precision.fp8.keep_first_layers", fp8.keep_first_layers or None),
        ("precision.fp8.keep_last_layers", fp8.keep_last_layers or None),
        ("precision.fp8.policy", fp8.policy if fp8.policy == "auto" else None),
        ("precision.schedule", schedule.from_step or schedule.from_fraction)) if value]
    return [Issue(key, "a per-Linear FP8 policy or schedule with precision.fp8.backend=none: there is no FP8 GEMM for "
                  "it to act on", value, "set precision.fp8.backend (e.g. preset torchao-float8), or remove it")
            for key, value in written]


def _overrides(spec: Spec) -> list[Issue]:
    fp8 = spec.fp8
    issues: list[Issue] = []
    te_path = fp8.backend == "te" or (fp8.backend == "msamp" and fp8.msamp.use_te)
    for index, override in enumerate(fp8.overrides):
        key, recipe = f"precision.fp8.overrides[{index}].recipe", override.recipe
        if recipe == "none":
            continue
        if fp8.backend == "torchao" and recipe not in TORCHAO_RECIPES:
            issues.append(Issue(key, f"'{recipe}' is a Transformer Engine recipe; backend torchao runs "
                                f"{', '.join(TORCHAO_RECIPES)}", recipe, f"use one of {', '.join(TORCHAO_RECIPES)} "
                                "or none"))
        elif te_path and recipe != fp8.te.recipe:
            issues.append(Issue(key, f"Transformer Engine runs one recipe per run in fp8dist (the te.fp8_autocast "
                                f"around the model's forward: precision.fp8.te.recipe={fp8.te.recipe}); a per-module "
                                "recipe would need an autocast per module, which fp8dist does not wire", recipe,
                                f"use recipe {fp8.te.recipe} (the run's) or none, or backend torchao for several "
                                "recipes side by side"))
        elif fp8.backend == "msamp" and not fp8.msamp.use_te:
            issues.append(Issue(key, "MS-AMP converts its Linears itself (msamp.initialize), with one scaling for all; "
                                "it can only leave a Linear out", recipe, "use recipe none"))
    mixed = len(fp8.recipes) > 1
    if mixed and spec.parallel.tensor_size > 1:
        issues.append(Issue("precision.fp8.overrides", f"recipes {', '.join(fp8.recipes)} side by side under tensor "
                            "parallel: torchao's float8 TP styles fit tensorwise Float8Linears, and MXFP8 converts "
                            "after the split while float8 converts before it (fp8dist/engines/fsdp2/tensor_parallel.py)"
                            "; not run", [o.recipe for o in fp8.overrides],
                            "set parallel.tensor_size=1, or give the overrides the run's recipe or none"))
    return issues


def _schedule(spec: Spec) -> list[Issue]:
    schedule, fp8 = spec.precision.schedule, spec.fp8
    issues: list[Issue] = []
    if schedule.from_step is None and schedule.from_fraction is None or not fp8.enabled:
        return issues
    if schedule.from_step is not None and schedule.from_fraction is not None:
        issues.append(Issue("precision.schedule.from_fraction", "the switch is given twice (from_step and "
                            "from_fraction)", schedule.from_fraction, "keep one of the two"))
    step = spec.switch_step
    if step is not None and step > spec.train.steps:
        issues.append(Issue("precision.schedule.from_step", f"the switch at step {step} comes after the run's last "
                            f"step (train.steps={spec.train.steps}), so it would never act", step,
                            f"set it to at most {spec.train.steps}, or remove precision.schedule"))
    if fp8.backend != "torchao":
        issues.append(Issue("precision.schedule", f"the switch turns off the FP8 casts of torchao's Linears; backend "
                            f"{fp8.backend} keeps its FP8 state inside its own modules, and no switch of it is wired",
                            fp8.backend, "use precision.fp8.backend=torchao, or remove precision.schedule"))
        return issues
    if spec.float8_all_gather:
        issues.append(Issue("precision.schedule", "the weights are all-gathered in float8 "
                            "(precision.fp8.torchao.enable_fsdp_float8_all_gather), so the forward receives them "
                            "already cast (torchao 0.18 float8_linear.py: tensor_already_casted_to_fp8) and cannot run "
                            "in the compute dtype after the switch", schedule.gemms,
                            "set precision.fp8.torchao.enable_fsdp_float8_all_gather=false with a schedule"))
    if "mxfp8" in fp8.recipes and schedule.gemms == "forward":
        issues.append(Issue("precision.schedule.gemms", "torchao's MXFP8Linear quantizes its forward and backward "
                            "together (torchao 0.18 prototype/moe_training/mxfp8_linear.py); it has no switch for the "
                            "forward alone", "forward", "set precision.schedule.gemms=all with MXFP8 Linears"))
    if spec.compile:
        issues.append(Issue("precision.schedule", "a switch mid-run under torch.compile (the compiled blocks "
                            "recompiled with the new cast configs) has not been run", True,
                            "set compile=false with a schedule"))
    return issues


def _auto(spec: Spec) -> list[Issue]:
    """precision.fp8.policy: auto calibrates on each rank's whole model before the engine prepares it
    (fp8dist.audit.calibration): what that cannot do is refused, with `fp8dist calibrate` and its explicit overrides
    (policy manual) as the fix where the run itself can take them."""
    fp8 = spec.fp8
    if fp8.policy != "auto" or not fp8.enabled:
        return []
    issues = calibration_issues(spec)
    if fp8.backend != "torchao":
        return issues
    if spec.precision.schedule.from_step is not None or spec.precision.schedule.from_fraction is not None:
        if fp8.torchao.enable_fsdp_float8_all_gather is not False and TRAITS[spec.engine].gathers_float8:
            issues.append(Issue("precision.fp8.torchao.enable_fsdp_float8_all_gather", "with policy auto and a "
                                "schedule: the calibration may give Linears tensorwise, which `auto` all-gathers in "
                                "float8, and a schedule cannot switch weights gathered in float8",
                                fp8.torchao.enable_fsdp_float8_all_gather,
                                "set precision.fp8.torchao.enable_fsdp_float8_all_gather=false"))
    return issues


def calibration_issues(spec: Spec, run: bool = True) -> list[Issue]:
    """What the calibration itself cannot measure, each naming its key: a run's policy auto (`run`) and
    `fp8dist calibrate` alike."""
    fp8 = spec.fp8
    what = "precision.fp8.policy auto" if run else "fp8dist calibrate"
    if fp8.backend != "torchao":
        return [Issue("precision.fp8.backend", f"{what}: the calibration casts each Linear's operands with torchao's "
                      f"own float8 cast functions and recipes; backend {fp8.backend} casts inside its own kernels "
                      "(or there is no FP8), which fp8dist's numerics probes cannot run per recipe", fp8.backend,
                      "set precision.fp8.backend=torchao (preset torchao-float8)" +
                      (", or policy manual with explicit overrides" if run else ""))]
    issues = []
    for key, size in (("parallel.tensor_size", spec.parallel.tensor_size),
                      ("parallel.expert_size", spec.parallel.expert_size)):
        if size > 1:
            issues.append(Issue(key, f"{what}: the calibration runs each rank's whole model before the engine splits "
                                "it; tensor parallel runs one recipe for the whole model (recipes side by side are "
                                "refused there), and an expert-parallel rank holds part of the experts", size,
                                f"set {key}=1 to calibrate" + (", or policy manual" if run else "")))
    if spec.adapter.enabled:
        issues.append(Issue("adapter.kind", f"{what}: a LoRA run's base Linears are frozen (no weight-gradient GEMM) "
                            "and wrapped by PEFT; their calibration has not been run", spec.adapter.kind,
                            "write explicit precision.fp8.overrides for the base Linears (policy manual)"))
    if spec.parallel.cpu_ram_efficient_loading:
        issues.append(Issue("parallel.cpu_ram_efficient_loading", f"{what}: RAM-efficient loading builds the model "
                            "on the meta device and reads the weights after sharding; the calibration needs each "
                            "rank's whole model with its weights before", True,
                            "set parallel.cpu_ram_efficient_loading=false" + (
                                ", or run `fp8dist calibrate` (without it) and train with its overrides" if run
                                else " to calibrate (the written overrides then apply with it on)")))
    return issues
