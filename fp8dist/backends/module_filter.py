"""Which nn.Linear layers get FP8, and why the others do not. Pure: layer facts in, decisions out."""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Iterable, Sequence


@dataclass(frozen=True)
class LinearInfo:
    fqn: str
    in_features: int
    out_features: int


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
    edges = {linears[0].fqn, linears[-1].fqn} if (skip_first_last and linears) else set()
    out = []
    for info in linears:
        pattern = matching_pattern(info.fqn, exclude)
        if pattern:
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

    return [LinearInfo(name, m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)]
