"""Which nn.Linear layers get FP8, and why the others do not. Pure: layer facts in, decisions out."""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Iterable, Sequence

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


def matching_pattern(fqn: str, patterns: Iterable[str]) -> str | None:
    """The first exclusion pattern that matches the module's full name or its last part."""
    return next((p for p in patterns if fnmatchcase(fqn, p) or fnmatchcase(fqn.rsplit(".", 1)[-1], p)), None)


def decide(linears: Sequence[LinearInfo], exclude: Iterable[str], skip_first_last: bool,
           dim_multiple: int | None, dim_hint: str = "") -> list[Decision]:
    """One decision per Linear, in model order. `dim_multiple` None means no divisibility rule;
    `dim_hint` is appended to the reason of a layer that breaks it (how to convert it anyway)."""
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
        else:
            out.append(Decision(info.fqn, True, "converted"))
    return out


def linear_infos(model) -> list[LinearInfo]:
    import torch

    modules = dict(model.named_modules())
    return [LinearInfo(name, m.in_features, m.out_features, is_router(name, m, modules.get(name.rpartition(".")[0])))
            for name, m in modules.items() if isinstance(m, torch.nn.Linear)]
