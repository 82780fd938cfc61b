"""The model's transformer blocks: the units FSDP2 shards one by one, activation checkpointing wraps and
per-block torch.compile compiles, on both engines."""
from __future__ import annotations

import torch

from fp8dist.config.spec import Spec
from fp8dist.errors import Fp8distError


def wrap_units(model, spec: Spec) -> list[tuple[str, torch.nn.Module]]:
    """The modules to shard before the root: configured class names, HF `_no_split_modules`, or the
    children of the first nn.ModuleList."""
    names = spec.fsdp2.wrap
    if names == "auto":
        names = tuple(getattr(model, "_no_split_modules", None) or ())
    if names:
        # by the class or a base of it: fully_shard swaps a block's class for a subclass (FSDPLlamaDecoderLayer)
        units = [(n, m) for n, m in model.named_modules()
                 if any(cls.__name__ in set(names) for cls in type(m).__mro__) and m is not model]
        if not units:
            raise Fp8distError(f"fsdp2.wrap: no module of class {', '.join(names)} in {type(model).__name__}; "
                               "list the transformer block class names")
        return units
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            return [(f"{name}.{i}", child) for i, child in enumerate(module)]
    return []
