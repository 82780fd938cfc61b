"""FSDP2 custom all-gather that (1) lets gloo move float8 bytes and (2) can record, per FSDP unit, what it
sends (benchmarks/comm_bytes.py; the audit reads every collective on the wire instead: fp8dist.audit.wire).

gloo has no float8 dtypes ("Invalid scalar type"), so 1-byte floats are viewed as uint8 for the
transfer (torch 2.13 ProcessGroupGloo has no case for them); the bytes sent are unchanged. Interface:
torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultAllGather (torch 2.13).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

import fp8dist.dtypes as dtypes

# gloo has no float8 dtypes: every 8-bit float of the dtype table goes on the wire as its bytes
FLOAT8_DTYPES = {getattr(torch, entry.torch) for entry in dtypes.TABLE
                 if entry.family == "fp8" and hasattr(torch, entry.torch)}


@dataclass
class CommRecord:
    """All-gathers: dtype of the flat buffer -> [calls, bytes sent by this rank]."""

    all_gather: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def add(self, tensor: torch.Tensor) -> None:
        entry = self.all_gather[str(tensor.dtype).replace("torch.", "")]
        entry[0] += 1
        entry[1] += tensor.numel() * tensor.element_size()


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype in FLOAT8_DTYPES else tensor


class ByteViewAllGather(DefaultAllGather):
    def __init__(self, record: CommRecord | None = None):
        self.record = record

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if self.record is not None:
            self.record.add(input_tensor)
        return dist.all_gather_single(_wire(output_tensor), _wire(input_tensor), group=group, async_op=async_op)


def carry_float8_tensor_parallel_over_gloo() -> None:
    """Let torchao's float8 tensor-parallel styles all-gather over gloo, as ByteViewAllGather does for FSDP2: torchao
    runs a float8 all-gather by calling the functional collective on the Float8TrainingTensor's float8 data
    (torchao 0.18 torchao/float8/float8_ops.py allgather_fp8, registered in FLOAT8_OPS_TABLE); the entry installed
    here hands it a collective that moves those bytes as uint8 and views the result back. Process-wide and
    idempotent; called only where the backend is gloo (NCCL carries float8: elsewhere nothing changes)."""
    import torchao.float8.float8_ops as float8_ops

    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    torchao_gather = float8_ops.FLOAT8_OPS_TABLE[gather]
    if getattr(torchao_gather, "byte_view", False):
        return

    def byte_view_gather(aten_op, args, kwargs=None):
        def gather_bytes(data, *rest, **more):
            return aten_op(_wire(data), *rest, **more).view(data.dtype)

        return torchao_gather(gather_bytes, args, kwargs or {})

    byte_view_gather.byte_view = True  # type: ignore[attr-defined]
    float8_ops.FLOAT8_OPS_TABLE[gather] = byte_view_gather
