"""What a tensor-like object really stores: format name, logical elements and bytes.

Logical `.dtype` lies for every low-precision container the audit meets, so each is read by its storage:
- DTensor (FSDP2 shards): `.to_local()`;
- torchao: `Float8TrainingTensor._data`, `WeightWithDynamicFloat8CastTensor._tensor`, `MXTensor.qdata`, low-bit
  optimizer state `.codes`, `NF4Tensor`'s codes and scales (torchao 0.18 torchao/float8/float8_training_tensor.py,
  fsdp_utils.py, optim/subclass_*.py);
- bitsandbytes 4-bit weights (`Params4bit`): packed codes in any storage dtype, read by `quant_state`;
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

import math
from dataclasses import dataclass

import torch

import fp8dist.dtypes as dtypes


# TE's tex.DType members and MS-AMP's QType names share this spelling.
ENUM_NAMES = {"kFloat8E4M3": "fp8_e4m3", "kFloat8E5M2": "fp8_e5m2", "kFloat4E2M1": "fp4_e2m1",
              "kFloat16": "fp16", "kBFloat16": "bf16", "kFloat32": "fp32"}
TE_FORMAT_ATTRS = ("_fp8_dtype", "_fp4_dtype")
TE_BUFFER_ATTRS = ("_data", "_rowwise_data", "_columnwise_data", "_transpose")
# torchao: the inner tensor that holds the bytes (`qdata`: MXTensor, torchao 0.18 prototype/mx_formats/mx_tensor.py)
WRAPPER_ATTRS = ("_data", "_tensor", "qdata")
# torchao's low-bit optimizer states (torchao 0.18 torchao/optim/subclass_8bit.py, subclass_4bit.py, subclass_fp8.py):
# `codes` with one fp32 `scale` per `block_size` values, and for 8/4 bits `qmap`, the table from code to value (a
# tensor of its own per state). OptimState8bit keeps one 8-bit code per value in uint8, OptimState4bit two 4-bit
# codes per uint8 byte (flattened), OptimStateFp8 float8_e4m3fn codes. What uint8 codes hold is named by the class.
CODE_FORMATS = {"OptimState8bit": "int8", "OptimState4bit": "int4"}
OPTIM_STATES = (*CODE_FORMATS, "OptimStateFp8")
OPTIM_STATE_BUFFERS = ("codes", "scale", "qmap")
# torchao's NF4Tensor (an adapter run's NF4 base, fp8dist/backends/nf4.py): its buffers (torchao 0.18
# torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py): 4-bit codes two per uint8, int8 scales, their
# factors and mean, the 16-entry NF4 table.
NF4_BUFFERS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
# bitsandbytes' 4-bit weight, `Params4bit` (bitsandbytes 0.50.2 bitsandbytes/nn/modules.py; QuantState in
# functional.py): once quantized (`bnb_quantized`; on CPU too, by the module's first `.to(device)`), its data holds
# the packed 4-bit codes in `quant_storage` (uint8 by default, bf16 where FSDP users set it: the same bytes), and its
# `quant_state` what else is held: `quant_type` ("nf4" / "fp4"), the logical `shape`, `absmax` (one per `blocksize`
# values), `code` (the 16-entry table), and with compress_statistics (`nested`) the absmax quantized to uint8 around
# `offset`, its own fp32 absmax and 256-entry code in `state2`. A CPU forward in eval mode repacks the codes and
# drops `state2` (functional.py _convert_weight_packed_for_cpu), so each part is read only where present.
BNB_STATE_BUFFERS = ("absmax", "code", "offset")


def short(dtype) -> str:
    """A torch dtype by fp8dist's name (fp8dist.dtypes): torch.float8_e4m3fn -> 'fp8_e4m3'."""
    return dtypes.name_of(dtype)


def enum_short(value) -> str:
    """`DType.kFloat8E4M3`, a QType named `kFloat8E5M2`, or the bare name -> 'fp8_e4m3' / 'fp8_e5m2' / ..."""
    name = getattr(value, "name", None) or str(value)
    name = name.rsplit(".", 1)[-1]
    return ENUM_NAMES.get(name, name)


@dataclass(frozen=True)
class BlockLayout:
    """How a block-quantized tensor holds its values: codes of `format` kept in `codes` storage (`per_code` values
    each), one `scale`-dtype scale per `block_size` values."""
    format: str      # what the codes are: int8, int4, fp8_e4m3
    codes: str       # the dtype they are stored in: uint8, fp8_e4m3
    per_code: int    # values per stored code element: 2 for 4-bit codes packed in uint8
    block_size: int
    scale: str

    def describe(self) -> str:
        """'int8 codes (uint8), block 256, fp32 scale per block'."""
        packing = f", {self.per_code} per element" if self.per_code > 1 else ""
        held = f" ({self.codes}{packing})" if self.codes != self.format or packing else ""
        return f"{self.format} codes{held}, block {self.block_size}, {self.scale} scale per block"


@dataclass(frozen=True)
class Storage:
    format: str  # fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, fp4_e2m1, int8, int4, nf4, fp4, uint8, ...
    numel: int   # logical elements
    nbytes: int  # bytes really held
    layout: BlockLayout | None = None  # a block-quantized optimizer state's codes and scales


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
    """What `obj` holds: its storage format, logical elements and bytes (the module docstring says how each
    container is read)."""
    if isinstance(obj, Storage):  # read already, where the tensor alone cannot say (bnb_4bit_shard)
        return obj
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
        return Storage("nf4", obj.numel(), _held(obj, NF4_BUFFERS))
    if type(obj).__name__ == "Params4bit" and getattr(obj, "quant_state", None) is not None:
        return _bnb_4bit(obj)
    if type(obj).__name__ in OPTIM_STATES:  # appearance dtype: fp32 or bf16, whatever the codes
        return _optim_state(obj)
    for attr in WRAPPER_ATTRS:
        inner = getattr(obj, attr, None)
        if isinstance(inner, torch.Tensor):
            return storage(inner)
    return Storage(short(obj.dtype), obj.numel(), obj.numel() * obj.element_size())


def _held(obj, attrs: tuple[str, ...]) -> int:
    """Bytes of the tensors among `obj`'s attributes `attrs` (those it lacks or holds as None left out)."""
    buffers = [t for t in (getattr(obj, attr, None) for attr in attrs) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in buffers)


def _optim_state(obj) -> Storage:
    """A torchao low-bit optimizer state by its codes: their format, the elements they stand for, the bytes of
    codes, scales and code table, and the block layout read from the tensor."""
    codes = obj.codes
    stored = short(codes.dtype)
    fmt = CODE_FORMATS.get(type(obj).__name__, stored)
    layout = BlockLayout(fmt, stored, max(obj.numel() // max(codes.numel(), 1), 1), int(obj.block_size),
                         short(obj.scale.dtype))
    return Storage(fmt, obj.numel(), _held(obj, OPTIM_STATE_BUFFERS), layout)


def _quant_state_bytes(state) -> int:
    """A bitsandbytes QuantState's tensors, its nested `state2` (double quantization) included."""
    nested = getattr(state, "state2", None)
    return _held(state, BNB_STATE_BUFFERS) + (_quant_state_bytes(nested) if nested is not None else 0)


def _bnb_4bit(param) -> Storage:
    """A quantized bitsandbytes Params4bit: named by its quant_type, counted by its logical shape (the data's
    shape is the packed one), held: the packed codes and the quant_state's tensors."""
    state = param.quant_state
    return Storage(str(state.quant_type), math.prod(state.shape),
                   param.numel() * param.element_size() + _quant_state_bytes(state))


def bnb_4bit_quant_states(module) -> dict[int, object]:
    """id(weight) -> quant_state of every bitsandbytes 4-bit module under `module`. bitsandbytes keeps the state on
    the module too, because a parameter swap loses it from the weight: FSDP2's sharded weight is a DTensor over a
    plain tensor of the packed codes (bitsandbytes 0.50.2 nn/modules.py `fix_4bit_weight_quant_state_from_module`:
    "the quant state got lost when the parameter got converted. This happens for example for fsdp")."""
    return {id(sub.weight): sub.quant_state for sub in module.modules()
            if getattr(sub, "quant_state", None) is not None and isinstance(getattr(sub, "weight", None), torch.Tensor)}


def bnb_4bit_shard(local: torch.Tensor, state) -> Storage:
    """This rank's part of a bitsandbytes 4-bit weight whose tensor no longer says so (`local`: the packed codes as
    a plain tensor of the quant storage dtype): the codes it holds (two per byte), named by the quant_state, and
    the quant_state's absmax / code tensors whole (they are the module's attribute: no engine shards them)."""
    held = local.numel() * local.element_size()
    return Storage(str(state.quant_type), held * 2, held + _quant_state_bytes(state))


def held_of(param, local, quant_states: dict[int, object]):
    """What a rank holds of `param` (`local`: the engine's stored part of it), read through its module's quant_state
    where the tensor lost it (`quant_states`: bnb_4bit_quant_states of the model): the local part otherwise."""
    state = quant_states.get(id(param))
    if state is None or type(local).__name__ == "Params4bit":
        return local
    return bnb_4bit_shard(local, state)
