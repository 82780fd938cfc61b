"""Which nn.Linear layers get FP8, and why the others do not. Pure: layer facts in, decisions out."""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Iterable, Sequence

import fp8dist.speed as speed
from fp8dist.config.spec import Spec, min_speedup_number, min_speedup_of
from fp8dist.errors import UnsupportedEnvironment
from fp8dist.facts.peft import is_lora_module, peft_base_name


@dataclass(frozen=True)
class LinearInfo:
    fqn: str
    in_features: int
    out_features: int
    router: bool = False  # an MoE router (is_router): stays in high precision


ROUTER_REASON = "MoE router: kept in high precision by design (top-k on FP8 logits changes which experts run)"


def is_router(name: str, module, parent) -> bool:
    """An MoE router: a `*Router` class (transformers 5 `MixtralTopKRouter`, ...) or a `gate` / `router` beside an
    `experts` module (transformers 5 afmoe's is an nn.Linear). Every FP8 recipe that handles MoE keeps routers in
    high precision (torchao prototype/moe_training, torchtitan): top-k selection on FP8 logits changes which
    experts run."""
    leaf = name.rsplit(".", 1)[-1]
    return "Router" in type(module).__name__ or (leaf in ("gate", "router") and parent is not None
                                                  and hasattr(parent, "experts"))


ADAPTER_REASON = "LoRA adapter (trained, kept in the master dtype)"
is_adapter = is_lora_module  # a LoRA adapter's own Linear: never converted, trained in the master dtype
base_name = peft_base_name  # the Linear's name before PEFT wrapped it, for exclusion patterns


@dataclass(frozen=True)
class Decision:
    fqn: str
    convert: bool
    reason: str


# The words every reason of the speed rule ends with (the audit reads them: a run whose rule kept every Linear).
SPEED_KEPT = "below precision.fp8.min_speedup"


@dataclass(frozen=True)
class SpeedRule:
    """precision.fp8.min_speedup as it acts on one run: a Linear whose predicted speedup (fp8dist/speed.py
    linear_times: its three GEMMs and the recipe's casts, its input made by a norm, compiled or not as the run is) at
    `tokens` tokens per micro-batch on `gpu` is below `min_speedup` stays in the compute dtype.

    The anchor is torchao's own filter, `_auto_filter_for_recipe` (pytorch/ao torchao/float8/float8_linear_utils.py,
    via `_auto_filter_for_tensorwise` / `_auto_filter_for_rowwise`), which keeps a Linear in high precision by its
    weight's shape alone (`K, N = mod.weight.shape`, i.e. out x in; tensorwise: K <= 4096 and N <= 1024; rowwise:
    N <= 2048, or K <= 1024, or N <= 4096 and K <= 2048), thresholds "run on H100 GPUs, and may not be representative
    of other hardware" (its comment), at no particular M. This rule asks the speed model (fp8dist/speed.py) at the
    run's own tokens per micro-batch, GPU, recipe and compile setting."""
    min_speedup: float
    tokens: int
    recipe: str
    backend: str
    gpu: str
    compiled: bool

    def predicted(self, info: LinearInfo) -> float:
        return speed.linear_times(self.tokens, info.in_features, info.out_features, self.recipe, self.gpu,
                                  backend=self.backend, compiled=self.compiled).speedup

    def too_slow(self, info: LinearInfo) -> str | None:
        """The reason a Linear stays in the compute dtype, None where FP8 is predicted to pay enough."""
        predicted = self.predicted(info)
        if predicted >= self.min_speedup:
            return None
        leaf = info.fqn.rsplit(".", 1)[-1]
        return (f"{leaf} {info.in_features}x{info.out_features} at M={self.tokens}: predicted {predicted:.2f}x on "
                f"{self.gpu.upper()} ({self.recipe}{'' if self.compiled else ', not compiled'}), {SPEED_KEPT}"
                f"={self.min_speedup:g}")


def speed_rule(spec: Spec, gpu: str | None) -> SpeedRule | None:
    """The speed rule of `spec` on `gpu` (hardware.gpu resolved: facts.hardware.run_gpu), None for none. A number
    written for min_speedup with no GPU the speed model knows is refused: there is nothing to predict with."""
    fp8 = spec.fp8
    recipe = fp8.recipe
    if recipe is None:
        return None
    if gpu is None and min_speedup_number(fp8.min_speedup) is not None:
        raise UnsupportedEnvironment(
            f"precision.fp8.min_speedup={fp8.min_speedup} keeps Linears whose predicted FP8 speedup is below it, and "
            "there is no GPU to predict for: hardware.gpu is auto and this machine has no GPU the speed model knows "
            f"({', '.join(speed.GPU_NAMES)})", "set hardware.gpu to the GPU the run is planned for, or "
            "precision.fp8.min_speedup=auto (no speed rule without a known GPU) or off",
            fix_settings={"precision.fp8.min_speedup": "auto"})
    threshold = min_speedup_of(fp8.min_speedup, gpu, fp8.emulated)
    if threshold is None or gpu is None:
        return None
    return SpeedRule(threshold, spec.tokens_per_micro_batch, recipe[0], recipe[1], gpu, spec.compile)


def matching_pattern(fqn: str, patterns: Iterable[str]) -> str | None:
    """The first exclusion pattern that matches the module's full name or its last part."""
    return next((p for p in patterns if fnmatchcase(fqn, p) or fnmatchcase(fqn.rsplit(".", 1)[-1], p)), None)


def decide(linears: Sequence[LinearInfo], exclude: Iterable[str], skip_first_last: bool,
           dim_multiple: int | None, dim_hint: str = "", speed_rule: SpeedRule | None = None) -> list[Decision]:
    """One decision per Linear, in model order. `dim_multiple` None means no divisibility rule;
    `dim_hint` is appended to the reason of a layer that breaks it (how to convert it anyway); `speed_rule`
    (precision.fp8.min_speedup) keeps the Linears FP8 is predicted not to pay for, checked last."""
    exclude = list(exclude)
    bases = [info for info in linears if not is_adapter(info.fqn)]
    edges = {bases[0].fqn, bases[-1].fqn} if (skip_first_last and bases) else set()
    out = []
    for info in linears:
        pattern = matching_pattern(base_name(info.fqn), exclude)
        if is_adapter(info.fqn):
            out.append(Decision(info.fqn, False, ADAPTER_REASON))
        elif info.router:
            out.append(Decision(info.fqn, False, ROUTER_REASON))
        elif pattern:
            out.append(Decision(info.fqn, False, f"excluded by pattern {pattern!r}"))
        elif info.fqn in edges:
            out.append(Decision(info.fqn, False, "first/last Linear (skip_first_last)"))
        elif dim_multiple and (info.in_features % dim_multiple or info.out_features % dim_multiple):
            out.append(Decision(info.fqn, False, f"dims {info.in_features}x{info.out_features} are not multiples of "
                                f"{dim_multiple} (FP8 quantization rule{dim_hint})"))
        elif speed_rule is not None and (slow := speed_rule.too_slow(info)):
            out.append(Decision(info.fqn, False, slow))
        else:
            out.append(Decision(info.fqn, True, "converted"))
    return out


def linear_infos(model) -> list[LinearInfo]:
    import torch

    modules = dict(model.named_modules())
    return [LinearInfo(name, m.in_features, m.out_features, is_router(name, m, modules.get(name.rpartition(".")[0])))
            for name, m in modules.items() if isinstance(m, torch.nn.Linear)]
