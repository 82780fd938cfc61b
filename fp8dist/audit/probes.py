"""Probes that observe a real prepared model without changing its numerics.

Tensor subclasses are read by their storage, not their logical `.dtype`: torchao float8 tensors
(`Float8TrainingTensor._data`), FSDP2 float8 all-gather weights (`WeightWithDynamicFloat8CastTensor._tensor`),
torchao low-bit optimizer states (`.codes`), DTensors (`.to_local()`).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
         torch.uint8: "uint8", torch.int8: "int8"}
for _name, _short in (("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2"), ("float8_e4m3fnuz", "fp8_e4m3"),
                      ("float8_e5m2fnuz", "fp8_e5m2")):
    if hasattr(torch, _name):
        SHORT[getattr(torch, _name)] = _short


def short(dtype) -> str:
    return SHORT.get(dtype, str(dtype).replace("torch.", ""))


def storage(tensor) -> torch.Tensor:
    """The tensor that really holds the bytes."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    for attr in ("_data", "codes", "_tensor"):
        inner = getattr(tensor, attr, None)
        if isinstance(inner, torch.Tensor):
            return storage(inner)
    return tensor


def summarize(tensors: Iterable[torch.Tensor]) -> tuple[str, dict[str, int]]:
    """Dominant storage dtype over floating tensors, and elements per dtype."""
    counts: Counter = Counter()
    for t in tensors:
        s = storage(t)
        counts[short(s.dtype)] += s.numel()
    if not counts:
        return "none", {}
    return ("+".join(sorted(counts)) if len(counts) > 1 else next(iter(counts))), dict(counts)


def trainable(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm",
           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"}


class MatmulRecorder(TorchDispatchMode):
    """Records the operand storage dtypes of every matmul-like op (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMULS:
            operands = tuple(short(storage(a).dtype) for a in args[:3] if isinstance(a, torch.Tensor)
                             and (a.is_floating_point() or hasattr(a, "_data")))
            self.calls[(name, operands)] += 1
        return func(*args, **(kwargs or {}))

    def split(self) -> tuple[Counter, Counter]:
        fp8, other = Counter(), Counter()
        for (name, operands), n in self.calls.items():
            (fp8 if any(o.startswith("fp8") for o in operands) else other)[(name, operands)] += n
        return fp8, other


def describe_fp8(fp8: Counter) -> str:
    formats = Counter()
    for (_, operands), n in fp8.items():
        formats["x".join(o.replace("fp8_", "") for o in operands)] += n
    return ", ".join(f"{k}: {v}" for k, v in sorted(formats.items()))


def compute_dtype(other: Counter) -> tuple[str, str]:
    """Dominant operand dtype of the non-FP8 matmuls, with the breakdown."""
    dtypes = Counter()
    for (_, operands), n in other.items():
        for o in set(operands):
            dtypes[o] += n
    if not dtypes:
        return "none", ""
    top = dtypes.most_common()
    return top[0][0] if len(top) == 1 else "+".join(sorted(dtypes)), ", ".join(f"{k}: {v}" for k, v in top)


def optimizer_states(optimizer) -> tuple[str, dict[str, Any]]:
    """Adam-like states as 'exp_avg+exp_avg_sq' storage dtypes; other optimizers: all tensor states."""
    per_key: dict[str, Counter] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                s = storage(value)
                per_key.setdefault(key, Counter())[short(s.dtype)] += s.numel()
    if not per_key:
        return "none", {}
    ordered = [k for k in ("exp_avg", "exp_avg_sq") if k in per_key] or sorted(per_key)
    parts = ["+".join(sorted(per_key[k])) for k in ordered]
    return "+".join(parts), {k: dict(v) for k, v in per_key.items()}


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        s = storage(t)
        total += s.numel() * s.element_size()
    return total
