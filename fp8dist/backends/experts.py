"""Mixture-of-Experts expert weights in FP8: grouped GEMMs through torchao, as a transformers experts implementation.

transformers 5 keeps a MoE layer's experts as 3-D parameters of an `*Experts` module (e.g. `MixtralExperts.gate_up_proj`
(experts, 2*intermediate, hidden) and `.down_proj`), whose forward is chosen per model by name from
`ExpertsInterface` (transformers 5.24 integrations/moe.py `use_experts_implementation`, `ALL_EXPERTS_FUNCTIONS`;
`PreTrainedModel.set_experts_implementation`). fp8dist registers one more name per format and switches the
model to it: the experts keep their plain parameters (so FSDP2 shards them and ZeRO flattens them like any
other) and only their two grouped GEMMs change, to torchao's dynamically quantizing ones (torchao 0.18
prototype/moe_training: `_to_mxfp8_then_scaled_grouped_mm`, `_to_fp8_rowwise_then_scaled_grouped_mm`). Routers
are `nn.Linear`-like modules outside the experts and stay in high precision.
"""
from __future__ import annotations

from functools import partial

from fp8dist.backends.module_filter import Decision
from fp8dist.errors import UnsupportedEnvironment
from fp8dist.facts.torchao import TORCHAO_EXPERTS_DIM_MULTIPLE

IMPLEMENTATION = "fp8dist_{mode}"


def experts_modules(model) -> list[tuple[str, object]]:
    """(name, module) of every transformers experts module: one whose forward is chosen by
    `config._experts_implementation` (the `use_experts_implementation` decorator sets `_apply_gate` and
    `is_transposed` on it) and that holds 3-D parameters."""
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "is_transposed") and hasattr(module, "_apply_gate") and any(
                p.dim() == 3 for p in module.parameters(recurse=False)):
            found.append((name, module))
    return found


def _grouped_linear(grouped_mm, tokens, weight, offsets, transposed: bool):
    """tokens (rows, K) through each row's expert: weight is (E, N, K), or (E, K, N) when `transposed`. torchao
    takes the weight as (E, K, N) in per-expert column-major layout, which the transpose of (E, N, K) is."""
    weight_t = weight.transpose(-2, -1).contiguous().transpose(-2, -1) if transposed else weight.transpose(-2, -1)
    return grouped_mm(tokens, weight_t, offsets)


def experts_forward(grouped_mm, self, hidden_states, top_k_index, top_k_weights):
    """A transformers experts forward (hidden_states (tokens, hidden), top_k_index / top_k_weights (tokens, k)) with
    both expert projections as one grouped GEMM each: rows sorted by expert, `offsets` ending each expert's rows."""
    import torch

    if getattr(self, "_is_expert_parallel", False):
        raise UnsupportedEnvironment("fp8dist's FP8 experts do not run under transformers' expert parallelism",
                                     "set precision.fp8.torchao.experts=none, or train without expert parallelism")
    top_k = top_k_index.size(-1)
    expert_of_row = top_k_index.reshape(-1)
    order = torch.argsort(expert_of_row, stable=True)
    rows = hidden_states[order // top_k]
    offsets = torch.cumsum(torch.bincount(expert_of_row, minlength=self.num_experts), 0, dtype=torch.int32)
    sorted_experts = expert_of_row[order]
    up = self.gate_up_proj if self.has_gate else self.up_proj
    out = _grouped_linear(grouped_mm, rows, up, offsets, self.is_transposed)
    if self.has_bias:
        out = out + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[sorted_experts].to(out.dtype)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
    out = _grouped_linear(grouped_mm, out, self.down_proj, offsets, self.is_transposed)
    if self.has_bias:
        out = out + self.down_proj_bias[sorted_experts].to(out.dtype)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    back = torch.empty_like(out)
    back[order] = out
    return back.view(-1, top_k, out.size(-1)).sum(dim=1).to(hidden_states.dtype)


def _grouped_mm(mode: str, emulate: bool):
    """torchao's quantizing grouped GEMM for `mode`, as (tokens, weight_t (E, K, N), offsets) -> (tokens, N)."""
    from torchao.prototype.moe_training import (_to_fp8_rowwise_then_scaled_grouped_mm,
                                                _to_mxfp8_then_scaled_grouped_mm)
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    if mode == "mxfp8":
        preference = KernelPreference.EMULATED if emulate else KernelPreference.AUTO

        def mxfp8(tokens, weight_t, offsets):
            # pad each expert's rows to the 32-row block (torchao pads and unpads inside)
            return _to_mxfp8_then_scaled_grouped_mm(tokens, weight_t, offsets, out_dtype=tokens.dtype,
                                                    kernel_preference=preference,
                                                    pad_token_groups_for_grouped_mm=True)
        return mxfp8

    def float8(tokens, weight_t, offsets):
        return _to_fp8_rowwise_then_scaled_grouped_mm(tokens, weight_t, offsets, out_dtype=tokens.dtype,
                                                      pad_token_groups_for_grouped_mm=True)
    return float8


def register(mode: str, emulate: bool) -> str:
    """Register fp8dist's experts forward for `mode` with transformers; returns its implementation name."""
    from transformers.integrations.moe import ExpertsInterface

    name = IMPLEMENTATION.format(mode=mode + ("_emulated" if emulate else ""))
    ExpertsInterface.register(name, partial(experts_forward, _grouped_mm(mode, emulate)))
    return name


def _sizes(module) -> tuple[int, ...]:
    """The contracted and produced sizes of the experts' GEMMs: hidden, intermediate (and 2*intermediate)."""
    return tuple(sorted({size for p in module.parameters(recurse=False) if p.dim() == 3 for size in p.shape[1:]}))


def convert(model, mode: str, emulate: bool, excluded) -> list[Decision]:
    """Switch `model`'s experts to `mode` grouped GEMMs; one Decision per experts module. `excluded(name)`: the
    config's exclusion pattern that names it, else None. All experts of a model share one implementation
    (transformers chooses it per model), so one that cannot convert keeps them all in high precision."""
    found = experts_modules(model)
    if not found:
        return []
    multiple = TORCHAO_EXPERTS_DIM_MULTIPLE[mode]
    reasons = {}
    for name, module in found:
        pattern = excluded(name)
        bad = [size for size in _sizes(module) if size % multiple]
        if pattern:
            reasons[name] = f"excluded by pattern {pattern!r}"
        elif bad:
            reasons[name] = (f"expert sizes {_sizes(module)} are not all multiples of {multiple} "
                             f"({mode} quantizes blocks of {multiple})")
    if reasons or not hasattr(model, "set_experts_implementation"):
        why = "; ".join(f"{n}: {r}" for n, r in reasons.items()) or (
            f"{type(model).__name__} is not a transformers PreTrainedModel (no set_experts_implementation)")
        return [Decision(name, False, reasons.get(name, f"kept with the model's other experts ({why})"))
                for name, _ in found]
    model.set_experts_implementation(register(mode, emulate))
    return [Decision(name, True, f"converted: {mode} grouped GEMMs" + (" (emulated)" if emulate else ""))
            for name, _ in found]
