"""The optimizer named by `optimizer` in the config (torch.optim, or torchao's low-bit AdamW on FSDP2)."""
from __future__ import annotations

from typing import Any, TypedDict

from fp8dist.config.spec import Spec
from fp8dist.errors import Fp8distError, UnsupportedEnvironment
from fp8dist.facts.torchao import TORCHAO_LOW_BIT_MIN_NUMEL, torchao_fp8_states_on_fsdp2


def check_optimizer_environment(spec: Spec, device: dict[str, Any]) -> None:
    """Refuse an optimizer that cannot step here, before anything is launched."""
    if spec.engine == "fsdp2" and spec.optimizer_state_dtype == "fp8":
        ok, reason = torchao_fp8_states_on_fsdp2(device["cuda_available"])
        if not ok:
            raise UnsupportedEnvironment(f"optimizer.state_dtype=fp8: {reason}",
                                         "run on a CUDA GPU, or use optimizer.state_dtype=int8 (AdamW8bit) here")


def offloads_optimizer(spec: Spec) -> bool:
    return spec.engine == "deepspeed" and spec.deepspeed.offload_optimizer != "none"


def trainable_parameters(model) -> list:
    """The parameters the optimizer steps: frozen ones (an adapter run's base weights) get no state, and no fp32
    partition under DeepSpeed's ZeRO optimizers."""
    return [p for p in model.parameters() if p.requires_grad]


class _AdamArguments(TypedDict):
    """The keywords every Adam-family optimizer built here takes alike."""
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


def build_optimizer(params, spec: Spec):
    import torch

    opt = spec.optimizer
    state = spec.optimizer_state_dtype
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)
    kwargs = _AdamArguments(lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    if offloads_optimizer(spec):
        # ZeRO-Offload steps on the CPU with DeepSpeedCPUAdam, which it requires for a client Adam
        # (engine.py _configure_optimizer) and for bf16/fp16 master weights (stage_1_and_2.py
        # _enforce_cpu_offload), DeepSpeed 0.19.8. Its C++ op is JIT-built on first use (about a minute).
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=opt.name == "adamw", fp32_optimizer_states=state != "bf16",
                                **kwargs)
    if state in ("fp8", "int8"):
        from torchao.optim import AdamW8bit, AdamWFp8

        return (AdamWFp8 if state == "fp8" else AdamW8bit)(params, **kwargs)
    return (torch.optim.Adam if opt.name == "adam" else torch.optim.AdamW)(params, **kwargs)


def full_precision_by_design(optimizer) -> set[int]:
    """ids of the optimizer's state tensors that its low-bit design keeps in full precision (empty for others):
    torchao quantizes a tensor's states only from TORCHAO_LOW_BIT_MIN_NUMEL elements and in whole blocks."""
    if not type(optimizer).__module__.startswith("torchao.optim"):
        return set()
    import torch

    block = getattr(optimizer, "block_size", None) or 1
    kept: set[int] = set()
    for param, state in optimizer.state.items():
        numel = (param.to_local() if hasattr(param, "to_local") else param).numel()
        if numel < TORCHAO_LOW_BIT_MIN_NUMEL or numel % block:
            kept.update(id(t) for t in state.values() if isinstance(t, torch.Tensor))
    return kept


def _moved(before: dict, model) -> dict[int, Any]:
    """id(parameter before the backend's module swap) -> the parameter of the same name now in `model`."""
    after = dict(model.named_parameters())
    return {id(old): after[name] for name, old in before.items() if name in after and after[name] is not old}


def rebind_parameters(params, before: dict, model) -> list:
    """`params` (tensors or param-group dicts, as deepspeed.initialize takes them) collected before the
    backend swapped modules, pointed at the parameters that replaced them. te.Linear/te.LayerNorm are new
    modules with new parameters (copied weights); torchao's Float8Linear keeps the original ones."""
    moved = _moved(before, model)
    out = []
    for item in params:
        if isinstance(item, dict):
            out.append({**item, "params": [moved.get(id(p), p) for p in item["params"]]})
        else:
            out.append(moved.get(id(item), item))
    return out


def rebind_optimizer(optimizer, before: dict, model) -> None:
    """Point a caller's optimizer, built before the module swap, at the new parameters (in place)."""
    moved = _moved(before, model)
    for group in optimizer.param_groups:
        for i, param in enumerate(group["params"]):
            if id(param) in moved:
                if optimizer.state.get(param):
                    raise Fp8distError("the optimizer already holds state for parameters that the FP8 backend "
                                       "replaces; pass a fresh optimizer (or none) to fp8dist's initialize")
                group["params"][i] = moved[id(param)]
