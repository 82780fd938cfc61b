"""FSDP2 custom all-gather / reduce-scatter that (1) let gloo move float8 bytes and (2) record what
crosses the wire for the audit and the benchmarks.

gloo has no float8 dtypes ("Invalid scalar type"), so 1-byte floats are viewed as uint8 for the
transfer (research/torchao_fsdp2.md 1.5); the bytes sent are unchanged. Interface:
torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultAllGather / DefaultReduceScatter (torch 2.13).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

FLOAT8_DTYPES = {d for d in (getattr(torch, n, None) for n in
                             ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")) if d}


@dataclass
class CommRecord:
    """Per collective: dtype of the flat buffer -> [calls, bytes sent by this rank]."""

    all_gather: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    reduce_scatter: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def add(self, table: dict, tensor: torch.Tensor) -> None:
        entry = table[str(tensor.dtype).replace("torch.", "")]
        entry[0] += 1
        entry[1] += tensor.numel() * tensor.element_size()

    def as_dict(self) -> dict:
        return {"all_gather": {k: {"calls": v[0], "bytes": v[1]} for k, v in self.all_gather.items()},
                "reduce_scatter": {k: {"calls": v[0], "bytes": v[1]} for k, v in self.reduce_scatter.items()}}


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype in FLOAT8_DTYPES else tensor


class ByteViewAllGather(DefaultAllGather):
    def __init__(self, record: CommRecord | None = None):
        self.record = record

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if self.record is not None:
            self.record.add(self.record.all_gather, input_tensor)
        return dist.all_gather_single(_wire(output_tensor), _wire(input_tensor), group=group, async_op=async_op)


class RecordingReduceScatter(DefaultReduceScatter):
    def __init__(self, record: CommRecord):
        self.record = record

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.record.add(self.record.reduce_scatter, input_tensor)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)

