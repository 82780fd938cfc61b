"""What DoRA (`adapter.use_dora`) allocates for a moment in each adapted Linear's forward, on top of the stores.

peft 0.21 tuners/lora/dora.py DoraLinearLayer: `get_lora_weight` builds the adapter's whole update by running lora_A
and lora_B over an identity matrix of in_features x in_features (`torch.eye`, in the adapter weights' dtype in the
forward: the compute dtype under FSDP2's and ZeRO's mixed precision), and autograd keeps that identity as lora_A's
saved input until the forward of the layer ends; `get_weight_norm` then adds the scaled update to the base weight
(the update, its scaled copy and the sum: three out x in tensors). The layer's peak is in^2 + 3 x in x out values;
one layer at a time. Measured by tests/unit/estimate/test_estimate_qlora.py (tests/live_bytes.py: every tensor a
forward allocates, alive or freed)."""
from __future__ import annotations

from fp8dist.facts.peft import DORA_MAGNITUDE


def dora_transient_bytes(model, compute_bytes: int) -> int:
    """The largest DoRA forward transient among the adapted layers of `model` (PEFT's layers injected: the meta
    model after fp8dist.estimate.model.adapted_counts), or 0 without DoRA. Sizes are PEFT's own (a LoraLayer's
    in_features / out_features, also for GPT-2's Conv1D); an adapted embedding (DoraEmbeddingLayer) builds its update
    as lora_A @ lora_B, with no identity: its three vocabulary x dim copies only."""
    import torch

    worst = 0
    for module in model.modules():
        if getattr(module, DORA_MAGNITUDE, None) and hasattr(module, "get_base_layer"):
            fan_in, fan_out = module.in_features, module.out_features
            identity = 0 if isinstance(module.get_base_layer(), torch.nn.Embedding) else fan_in * fan_in
            worst = max(worst, (identity + 3 * fan_in * fan_out) * compute_bytes)
    return worst
