"""The one table of dtypes: fp8dist's name, the torch dtype, the safetensors code, the size, and the names other
tools write. Pure: torch is imported only by `torch_dtype` and `name_of`.

fp8dist's names are the documented tables' (fp32, bf16, fp16, fp8_e4m3, ...); a format family is the part before
the first `_` (fp8_e4m3 -> fp8). Sources: torch 2.13 torch/_C/__init__.pyi (dtype attributes), the safetensors
format's dtype codes (huggingface/safetensors README, "dtype"), DeepSpeed 0.19 runtime/torch_autocast.py (torch
names in `torch_autocast.dtype`), Accelerate / HF Trainer / Axolotl dtype spellings (their config docs).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # fp8dist's name
    torch: str  # attribute of the torch module
    safetensors: str | None  # dtype code in a safetensors header
    bits: float  # bits per element as stored (fp4 packs two per byte)
    aliases: tuple[str, ...] = ()  # how other tools' configs spell it

    @property
    def nbytes(self) -> float:
        return self.bits / 8

    @property
    def family(self) -> str:
        return self.name.split("_")[0]


TABLE: tuple[DType, ...] = (
    DType("fp32", "float32", "F32", 32, ("float32", "float", "torch.float32", "fp32")),
    DType("bf16", "bfloat16", "BF16", 16, ("bfloat16", "bfp16", "torch.bfloat16", "bf16")),
    DType("fp16", "float16", "F16", 16, ("float16", "half", "torch.float16", "fp16")),
    DType("fp64", "float64", "F64", 64, ("float64", "double", "torch.float64")),
    DType("fp8_e4m3", "float8_e4m3fn", "F8_E4M3", 8),
    DType("fp8_e4m3", "float8_e4m3fnuz", None, 8),  # ROCm's variant: the same format for the tables
    DType("fp8_e5m2", "float8_e5m2", "F8_E5M2", 8),
    DType("fp8_e5m2", "float8_e5m2fnuz", None, 8),
    DType("fp8_e8m0", "float8_e8m0fnu", "F8_E8M0", 8),  # MX block scales (torch 2.7+)
    DType("fp4_e2m1", "float4_e2m1fn_x2", None, 4),  # two E2M1 values per byte (torch 2.8+)
    DType("int64", "int64", "I64", 64), DType("int32", "int32", "I32", 32), DType("int16", "int16", "I16", 16),
    DType("int8", "int8", "I8", 8), DType("uint64", "uint64", "U64", 64), DType("uint32", "uint32", "U32", 32),
    DType("uint16", "uint16", "U16", 16), DType("uint8", "uint8", "U8", 8), DType("bool", "bool", "BOOL", 8),
)
# The dtypes a config may name for weights, compute and communication (schemas/fp8dist.schema.json $defs.dtype).
CONFIG_DTYPES = ("fp32", "bf16", "fp16")
# Bytes per element of a table cell's format family (audit/expected.py: bytes a config implies per parameter).
FAMILY_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp4": 0.5, "int8": 1, "int4": 0.5, "none": 0, "n/a": 0}

_BY_NAME: dict[str, DType] = {}
for _entry in TABLE:
    _BY_NAME.setdefault(_entry.name, _entry)
_BY_TORCH = {entry.torch: entry for entry in TABLE}
_BY_SAFETENSORS = {entry.safetensors: entry for entry in TABLE if entry.safetensors}
_BY_ALIAS = {alias: entry for entry in TABLE for alias in entry.aliases}


def get(name: str) -> DType:
    return _BY_NAME[name]


def torch_name(name: str) -> str:
    """'bf16' -> 'bfloat16' (what DeepSpeed's torch_autocast.dtype and transformers' dtype strings take)."""
    return _BY_NAME[name].torch


def torch_dtype(name: str):
    """fp8dist's name -> the torch dtype."""
    import torch

    return getattr(torch, _BY_NAME[name].torch)


def name_of(dtype) -> str:
    """A torch dtype -> fp8dist's name ('torch.float8_e4m3fn' -> 'fp8_e4m3'); unknown ones by torch's own name."""
    text = str(dtype).replace("torch.", "")
    entry = _BY_TORCH.get(text)
    return entry.name if entry else text


def from_safetensors(code: str) -> DType | None:
    """A safetensors header dtype code ('BF16') -> its entry, None when fp8dist does not know it."""
    return _BY_SAFETENSORS.get(code)


def safetensors_codes() -> tuple[str, ...]:
    return tuple(_BY_SAFETENSORS)


def from_alias(value) -> str | None:
    """How another tool's config spells a dtype ('bfloat16', 'torch.float16', 'half') -> fp8dist's name, or None."""
    if value is None or isinstance(value, bool):
        return None
    entry = _BY_ALIAS.get(str(value).strip().lower())
    return entry.name if entry and entry.name in CONFIG_DTYPES else None


def family(name: str) -> str:
    """'fp8_e4m3' -> 'fp8'; 'fp32' -> 'fp32'."""
    return name.split("_")[0]
