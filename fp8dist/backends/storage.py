"""What a tensor-like object really stores: format name, logical elements and bytes.

Logical `.dtype` lies for every low-precision container the audit meets, so each is read by its storage:
- DTensor (FSDP2 shards): `.to_local()`;
- torchao: `Float8TrainingTensor._data`, `WeightWithDynamicFloat8CastTensor._tensor`, `MXTensor.qdata`, low-bit
  optimizer state `.codes`, `NF4Tensor`'s codes and scales (torchao 0.18 torchao/float8/float8_training_tensor.py, fsdp_utils.py, optim/subclass_*.py);
- Transformer Engine quantized tensors (`Float8Tensor`, `MXFP8Tensor`, `Float8BlockwiseQTensor`,
  `NVFP4Tensor` and their `*Storage` bases, `*TensorBase` up to 2.8): uint8 buffers `_data` / `_rowwise_data` /
  `_columnwise_data` / `_transpose`, the format in `_fp8_dtype` / `_fp4_dtype`, a `tex.DType` such as
  `DType.kFloat8E4M3` (TE 2.20 transformer_engine/pytorch/tensor/storage/*.py, 2.1-2.8 tensor/_internal/*_base.py;
  tests/unit/backends/test_te_recipe_contract.py reads these names in the wheels). NVFP4 packs two values per
  byte: the `_rowwise_data` of an [M, K] tensor is [M, K/2] uint8 (2.20.2 tensor/nvfp4_tensor.py:336-340, :380);
- MS-AMP `ScalingTensor` / `ScalingParameter` (not a torch.Tensor): `.value` (uint8 for E4M3, int8 for E5M2)
  and `.meta.qtype`, a `QType` named like TE's enum, e.g. `kFloat8E4M3` (MS-AMP v0.4.0
  msamp/common/tensor/tensor.py, msamp/common/dtype/dtypes.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import fp8dist.dtypes as dtypes


# TE's tex.DType members and MS-AMP's QType names share this spelling.
ENUM_NAMES = {"kFloat8E4M3": "fp8_e4m3", "kFloat8E5M2": "fp8_e5m2", "kFloat4E2M1": "fp4_e2m1",
              "kFloat16": "fp16", "kBFloat16": "bf16", "kFloat32": "fp32"}
TE_FORMAT_ATTRS = ("_fp8_dtype", "_fp4_dtype")
TE_BUFFER_ATTRS = ("_data", "_rowwise_data", "_columnwise_data", "_transpose")
# torchao: the inner tensor that holds the bytes (`qdata`: MXTensor, torchao 0.18 prototype/mx_formats/mx_tensor.py)
WRAPPER_ATTRS = ("_data", "codes", "_tensor", "qdata")
# torchao's low-bit optimizer states keep their codes in uint8; what they hold is named by the class
# (torchao 0.18 torchao/optim/subclass_8bit.py, subclass_4bit.py; subclass_fp8.py's codes are float8 already).
CODE_FORMATS = {"OptimState8bit": "int8", "OptimState4bit": "int4"}
# torchao's NF4Tensor (an adapter run's NF4 base, fp8dist/backends/nf4.py): its buffers (torchao 0.18
# torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py): 4-bit codes two per uint8, int8 scales, their
# factors and mean, the 16-entry NF4 table.
NF4_BUFFERS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def short(dtype) -> str:
    """A torch dtype by fp8dist's name (fp8dist.dtypes): torch.float8_e4m3fn -> 'fp8_e4m3'."""
    return dtypes.name_of(dtype)


def enum_short(value) -> str:
    """`DType.kFloat8E4M3`, a QType named `kFloat8E5M2`, or the bare name -> 'fp8_e4m3' / 'fp8_e5m2' / ..."""
    name = getattr(value, "name", None) or str(value)
    name = name.rsplit(".", 1)[-1]
    return ENUM_NAMES.get(name, name)


@dataclass(frozen=True)
class Storage:
    format: str  # fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, fp4_e2m1, uint8, ...
    numel: int   # logical elements
    nbytes: int  # bytes really held


def is_scaling_tensor(obj) -> bool:
    meta = getattr(obj, "meta", None)
    return (not isinstance(obj, torch.Tensor) and isinstance(getattr(obj, "value", None), torch.Tensor)
            and hasattr(meta, "qtype"))


def _te_format(obj) -> str | None:
    for attr in TE_FORMAT_ATTRS:
        value = getattr(obj, attr, None)
        if value is not None:
            return enum_short(value)
    return None


def _bits(fmt: str) -> int:
    """Bits per value of a TE format (fp8dist.dtypes); an unknown one as a byte."""
    try:
        return int(dtypes.get(fmt).bits)
    except KeyError:
        return 8


def is_tensor_like(obj) -> bool:
    return isinstance(obj, torch.Tensor) or is_scaling_tensor(obj) or _te_format(obj) is not None


def storage(obj) -> Storage:
    if is_scaling_tensor(obj):
        value = obj.value
        return Storage(enum_short(obj.meta.qtype), value.numel(), value.numel() * value.element_size())
    te_format = _te_format(obj)
    if te_format is not None:
        buffers = [b for b in (getattr(obj, a, None) for a in TE_BUFFER_ATTRS) if isinstance(b, torch.Tensor)]
        held = sum(b.numel() * b.element_size() for b in buffers)
        if isinstance(obj, torch.Tensor):
            numel = obj.numel()
        else:  # a *Storage base: count the values of its first buffer (NVFP4 packs two per uint8 byte)
            numel = buffers[0].numel() * buffers[0].element_size() * 8 // _bits(te_format) if buffers else 0
        return Storage(te_format, numel, held)
    if hasattr(obj, "to_local"):
        # the local tensor as held: to_local() runs view_as, which torchao's Float8TrainingTensor does not implement
        # (a tensor-parallel float8 operand is a DTensor over one; torch 2.13 torch/distributed/tensor/_api.py)
        return storage(getattr(obj, "_local_tensor", None) if hasattr(obj, "_local_tensor") else obj.to_local())
    if type(obj).__name__ == "NF4Tensor":  # appearance dtype: the original one; held: codes, int8 scales, factors
        buffers = [getattr(obj, attr) for attr in NF4_BUFFERS if isinstance(getattr(obj, attr, None), torch.Tensor)]
        return Storage("nf4", obj.numel(), sum(t.numel() * t.element_size() for t in buffers))
    if type(obj).__name__ in CODE_FORMATS:
        codes = obj.codes
        return Storage(CODE_FORMATS[type(obj).__name__], obj.numel(),
                       codes.numel() * codes.element_size() + obj.scale.numel() * obj.scale.element_size())
    for attr in WRAPPER_ATTRS:
        inner = getattr(obj, attr, None)
        if isinstance(inner, torch.Tensor):
            return storage(inner)
    return Storage(short(obj.dtype), obj.numel(), obj.numel() * obj.element_size())
