"""Which nn.Linear layers get FP8, and why the others do not. Pure: layer facts in, decisions out."""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Iterable, Mapping, Sequence

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
    block: int | None = None  # the index of the decoder block that holds it (block_list), None outside the blocks
    blocks: int = 0  # how many decoder blocks the model has


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
    recipe: str | None = None  # the recipe a converted Linear runs (the run's, or an override's); None: kept


@dataclass(frozen=True)
class Policy:
    """precision.fp8's per-Linear policy on top of the run's recipe: `overrides` ((patterns, recipe) in order, the
    first whose pattern matches a Linear decides it: as `modules.exclude` matches, and so that the specific entry
    written first wins over a broad one after it), `keep_first` / `keep_last` decoder blocks in the compute dtype
    (Megatron-Core's num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16), and the dims multiple each recipe
    needs (`dims`; a recipe not named there: decide's `dim_multiple`)."""
    recipe: str | None
    overrides: tuple[tuple[tuple[str, ...], str], ...] = ()
    keep_first: int = 0
    keep_last: int = 0
    dims: Mapping[str, int | None] = field(default_factory=dict)

    def override(self, fqn: str) -> tuple[int, str, str] | None:
        """(index, pattern, recipe) of the first override that matches `fqn`, None where none does."""
        for index, (patterns, recipe) in enumerate(self.overrides):
            if pattern := matching_pattern(fqn, patterns):
                return index, pattern, recipe
        return None

    def kept_block(self, info: "LinearInfo") -> str | None:
        """Why a Linear's decoder block stays in the compute dtype (keep_first / keep_last), None where it does not."""
        if info.block is None:
            return None
        if info.block < self.keep_first:
            return f"decoder block {info.block} of {info.blocks}: precision.fp8.keep_first_layers={self.keep_first}"
        if info.block >= info.blocks - self.keep_last:
            return f"decoder block {info.block} of {info.blocks}: precision.fp8.keep_last_layers={self.keep_last}"
        return None


def policy_of(fp8, dims: Mapping[str, int | None] | None = None) -> Policy:
    """The Policy of a spec's precision.fp8 (config.spec.FP8Spec)."""
    return Policy(fp8.recipe[0] if fp8.recipe else None, tuple((o.modules, o.recipe) for o in fp8.overrides),
                  fp8.keep_first_layers, fp8.keep_last_layers, dict(dims or {}))


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

    def predicted(self, info: LinearInfo, recipe: str | None = None) -> float:
        return speed.linear_times(self.tokens, info.in_features, info.out_features, recipe or self.recipe, self.gpu,
                                  backend=self.backend, compiled=self.compiled).speedup

    def too_slow(self, info: LinearInfo, recipe: str | None = None) -> str | None:
        """The reason a Linear stays in the compute dtype, None where FP8 is predicted to pay enough; `recipe`: the
        Linear's own (an override's), default the run's."""
        recipe = recipe or self.recipe
        predicted = self.predicted(info, recipe)
        if predicted >= self.min_speedup:
            return None
        leaf = info.fqn.rsplit(".", 1)[-1]
        return (f"{leaf} {info.in_features}x{info.out_features} at M={self.tokens}: predicted {predicted:.2f}x on "
                f"{self.gpu.upper()} ({recipe}{'' if self.compiled else ', not compiled'}), {SPEED_KEPT}"
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
           dim_multiple: int | None, dim_hint: str = "", speed_rule: SpeedRule | None = None,
           policy: Policy | None = None) -> list[Decision]:
    """One decision per Linear, in model order, checked in this order: adapters, routers, `exclude`, the policy's
    kept decoder blocks, `skip_first_last`, the policy's first matching override (`none`: kept), the dims the
    Linear's recipe needs (`dim_multiple` None: no divisibility rule; `dim_hint` appended to the reason: how to
    convert it anyway), and last `speed_rule` (precision.fp8.min_speedup) at the Linear's recipe."""
    exclude = list(exclude)
    policy = policy or Policy(speed_rule.recipe if speed_rule else None)
    bases = [info for info in linears if not is_adapter(info.fqn)]
    edges = {bases[0].fqn, bases[-1].fqn} if (skip_first_last and bases) else set()
    out = []
    for info in linears:
        name = base_name(info.fqn)
        pattern = matching_pattern(name, exclude)
        override = policy.override(name)
        recipe, why = (override[2], f"precision.fp8.overrides[{override[0]}] ({override[1]!r})") if override else (
            policy.recipe, "the run's recipe")
        multiple = policy.dims.get(recipe, dim_multiple) if recipe is not None else dim_multiple
        if is_adapter(info.fqn):
            out.append(Decision(info.fqn, False, ADAPTER_REASON))
        elif info.router:
            out.append(Decision(info.fqn, False, ROUTER_REASON))
        elif pattern:
            out.append(Decision(info.fqn, False, f"excluded by pattern {pattern!r}"))
        elif kept := policy.kept_block(info):
            out.append(Decision(info.fqn, False, kept))
        elif info.fqn in edges:
            out.append(Decision(info.fqn, False, "first/last Linear (skip_first_last)"))
        elif recipe == "none":
            out.append(Decision(info.fqn, False, f"{why}: none (compute dtype)"))
        elif multiple and (info.in_features % multiple or info.out_features % multiple):
            out.append(Decision(info.fqn, False, f"dims {info.in_features}x{info.out_features} are not multiples of "
                                f"{multiple} (FP8 quantization rule{'' if override else dim_hint})"))
        elif speed_rule is not None and (slow := speed_rule.too_slow(info, recipe)):
            out.append(Decision(info.fqn, False, slow))
        else:
            out.append(Decision(info.fqn, True, "converted" + (f": {why}" if override else ""), recipe))
    return out


def block_list(model) -> str | None:
    """The name of the model's decoder-block list: the first nn.ModuleList whose every entry holds an nn.Linear
    (transformers' `model.layers`, GPT-2's `transformer.h`), None where there is none."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(
                any(isinstance(m, torch.nn.Linear) for m in child.modules()) for child in module):
            return name
    return None


def linear_infos(model) -> list[LinearInfo]:
    import torch

    modules = dict(model.named_modules())
    blocks_name = block_list(model)
    blocks = len(modules[blocks_name]) if blocks_name is not None else 0

    def block_of(name: str) -> int | None:
        if blocks_name is None or not name.startswith(f"{blocks_name}."):
            return None
        return int(name[len(blocks_name) + 1:].split(".", 1)[0])

    return [LinearInfo(name, m.in_features, m.out_features, is_router(name, m, modules.get(name.rpartition(".")[0])),
                       block_of(name), blocks)
            for name, m in modules.items() if isinstance(m, torch.nn.Linear)]


def policy_lines(decisions: Sequence[Decision]) -> list[str]:
    """The start report of a per-Linear policy: each Linear with what it got and why, one line each."""
    return [f"  {d.fqn}: {d.recipe if d.convert else 'compute dtype'} ({d.reason})" for d in decisions
            if d.reason != ADAPTER_REASON]
