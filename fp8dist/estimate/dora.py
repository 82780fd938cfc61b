"""What DoRA (`adapter.use_dora`) allocates for a moment in each adapted Linear's forward, on top of the stores:
an in x in identity PEFT runs the adapters over, and DORA_UPDATE_COPIES out x in copies of the update
(fp8dist.facts.peft, from peft 0.21 tuners/lora/dora.py), in the adapters' forward dtype (the compute dtype under
FSDP2's and ZeRO's mixed precision); one layer at a time. Measured by tests/unit/estimate/test_estimate_dora.py
(tests/live_bytes.py)."""
from __future__ import annotations

from typing import Callable

from fp8dist.facts.peft import DORA_MAGNITUDE, DORA_UPDATE_COPIES


def dora_transient_bytes(model, compute_bytes: int, holds: Callable[[str], bool] | None = None) -> int:
    """The largest DoRA forward transient among the adapted layers of `model` (PEFT's layers injected: the meta
    model after fp8dist.estimate.model.adapted_counts), or 0 without DoRA. Sizes are PEFT's own (a LoraLayer's
    in_features / out_features, also for GPT-2's Conv1D); an adapted embedding (DoraEmbeddingLayer) builds its update
    as lora_A @ lora_B, with no identity: its three vocabulary x dim copies only. `holds`: whether the rank holds
    a parameter (a pipeline rank, its stages'), asked of each layer's base weight; None: every layer."""
    import torch

    worst = 0
    for name, module in model.named_modules():
        if holds is not None and not holds(f"{name}.base_layer.weight"):
            continue
        if getattr(module, DORA_MAGNITUDE, None) and hasattr(module, "get_base_layer"):
            fan_in, fan_out = module.in_features, module.out_features
            identity = 0 if isinstance(module.get_base_layer(), torch.nn.Embedding) else fan_in * fan_in
            worst = max(worst, (identity + DORA_UPDATE_COPIES * fan_in * fan_out) * compute_bytes)
    return worst
