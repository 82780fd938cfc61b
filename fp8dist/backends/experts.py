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
from typing import Any

from fp8dist.backends.module_filter import Decision
from fp8dist.errors import UnsupportedEnvironment
from fp8dist.facts.torchao import TORCHAO_EXPERTS_DIM_MULTIPLE

IMPLEMENTATION = "fp8dist_{mode}"


def experts_modules(model) -> list[tuple[str, Any]]:
    """(name, module) of every transformers experts module: one whose forward is chosen by
    `config._experts_implementation` (the `use_experts_implementation` decorator sets `_apply_gate` and
    `is_transposed` on it) and that holds 3-D parameters."""
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "is_transposed") and hasattr(module, "_apply_gate") and any(
                p.dim() == 3 for p in module.parameters(recurse=False)):
            found.append((name, module))
    return found


def expert_parameters(module) -> list[tuple[str, Any]]:
    """(name, parameter) of an experts module's per-expert parameters, the experts their leading dim: the 3-D weights
    and the (experts, out) biases (what expert parallel splits by expert)."""
    return [(name, param) for name, param in module.named_parameters(recurse=False)
            if param.dim() >= 2 and param.size(0) == module.num_experts]


def _grouped_linear(grouped_mm, tokens, weight, offsets, transposed: bool):
    """tokens (rows, K) through each row's expert: weight is (E, N, K), or (E, K, N) when `transposed`. torchao
    takes the weight as (E, K, N) in per-expert column-major layout, which the transpose of (E, N, K) is."""
    weight_t = weight.transpose(-2, -1).contiguous().transpose(-2, -1) if transposed else weight.transpose(-2, -1)
    return grouped_mm(tokens, weight_t, offsets)


def _local(weight):
    """An experts weight as this rank holds it: under expert parallel FSDP2 hands the forward a DTensor sharded over
    the `ep` axis (the rank's own experts), which the grouped GEMMs take as a plain tensor."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if to_local is not None else weight


def experts_forward(grouped_mm, self, hidden_states, top_k_index, top_k_weights):
    """A transformers experts forward (hidden_states (tokens, hidden), top_k_index / top_k_weights (tokens, k)) with
    both expert projections as one grouped GEMM each: rows sorted by expert, `offsets` ending each expert's rows.
    Under expert parallel (`self.fp8dist_token_dispatch`, fp8dist.engines.fsdp2.expert_parallel) the sorted rows go
    to their experts' ranks and come back before the routing weights are applied, so routing and weighting stay
    where the tokens live."""
    import torch

    if getattr(self, "_is_expert_parallel", False):
        raise UnsupportedEnvironment("fp8dist's experts do not run under transformers' own expert parallelism",
                                     "use fp8dist's parallel.expert_size (engine=fsdp2) instead of transformers' "
                                     "distributed_config")
    top_k = top_k_index.size(-1)
    expert_of_row = top_k_index.reshape(-1)
    order = torch.argsort(expert_of_row, stable=True)
    rows = hidden_states[order // top_k]
    counts = torch.bincount(expert_of_row, minlength=self.num_experts)
    dispatch = getattr(self, "fp8dist_token_dispatch", None)
    if dispatch is not None:
        rows, counts, route = dispatch.send(rows, counts)
    if dispatch is not None and rows.size(0) == 0:
        # Every token of the ep group went to other ranks' experts (the grouped GEMM's backward refuses 0 rows,
        # torch 2.13): no output rows; zero gradients for every expert weight, so that FSDP2 reduces the same
        # tensors on every rank; the received rows kept in the graph, so that backward runs the dispatch's
        # all-to-all as the peers do
        anchor = rows.sum() + sum(_local(p).sum() for p in self.parameters())
        out = rows.new_zeros(0, hidden_states.size(-1)) + anchor * 0
        return _combine(self, dispatch.receive(out, route), top_k_weights, order, top_k, hidden_states)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    expert_of_sorted_row = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    up = _local(self.gate_up_proj if self.has_gate else self.up_proj)
    out = _grouped_linear(grouped_mm, rows, up, offsets, self.is_transposed)
    if self.has_bias:
        bias = _local(self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)
        out = out + bias[expert_of_sorted_row].to(out.dtype)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
    out = _grouped_linear(grouped_mm, out, _local(self.down_proj), offsets, self.is_transposed)
    if self.has_bias:
        out = out + _local(self.down_proj_bias)[expert_of_sorted_row].to(out.dtype)
    # transformers 5.24's experts decorator sets has_post_expert_norm (integrations/moe.py); 5.17's has none (seen
    # on an H100 image with transformers 5.17.0): no norm after the experts there
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    if dispatch is not None:
        out = dispatch.receive(out, route)
    return _combine(self, out, top_k_weights, order, top_k, hidden_states)


def _combine(self, out, top_k_weights, order, top_k: int, hidden_states):
    """The experts' outputs (rows sorted by expert) weighted by the router and summed back per token."""
    import torch

    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    back = torch.empty_like(out)
    back[order] = out
    return back.view(-1, top_k, out.size(-1)).sum(dim=1).to(hidden_states.dtype)


def _high_precision_grouped_mm(tokens, weight_t, offsets):
    """The experts' GEMMs unquantized, through transformers' own dispatcher (transformers 5.24 integrations/moe.py
    `_grouped_mm`: torch's grouped_mm where its kernel takes the shapes, else transformers' fallback)."""
    from transformers.integrations.moe import _grouped_mm as transformers_grouped_mm

    return transformers_grouped_mm(tokens, weight_t, offs=offsets)


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
    """Register fp8dist's experts forward for `mode` (mxfp8 | float8 | none: unquantized) with transformers; returns
    its implementation name."""
    from transformers.integrations.moe import ExpertsInterface

    name = IMPLEMENTATION.format(mode=mode + ("_emulated" if emulate and mode != "none" else ""))
    grouped_mm = _high_precision_grouped_mm if mode == "none" else _grouped_mm(mode, emulate)
    ExpertsInterface.register(name, partial(experts_forward, grouped_mm))
    return name


def is_fp8dist_implementation(model) -> bool:
    """Whether `model`'s experts already run fp8dist's forward (one of `register`'s names)."""
    name = getattr(getattr(model, "config", None), "_experts_implementation", None) or ""
    return name.startswith(IMPLEMENTATION.format(mode=""))


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
