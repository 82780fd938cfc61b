"""What crosses the wire: every collective issued through a torch ProcessGroup, whoever issues it.

torch.distributed's collectives reach the backend through the dispatcher as `c10d` ops
(`c10d.allreduce_`, `c10d._reduce_scatter_base_`, `c10d._allgather_base_`, ...; torch 2.13
torch/csrc/distributed/c10d/ProcessGroup.hpp), so one TorchDispatchMode sees the collectives of FSDP2,
DeepSpeed (deepspeed.comm calls torch.distributed), DDP and user code alike, with the real tensors.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8dist.backends.storage import short

# c10d op name -> kind. Reductions carry gradients; gathers carry weights.
KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "reduce_": "reduce",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "broadcast_": "broadcast",
}
REDUCTIONS = {"all_reduce", "reduce", "reduce_scatter"}
# Gathers and reduce-scatters take (outputs, inputs); the others reduce or broadcast their first argument
# in place (torch 2.13 c10d op schemas, torch/csrc/distributed/c10d/Ops.cpp).
INPUT_SECOND = {"all_gather", "reduce_scatter"}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


class WireRecorder(TorchDispatchMode):
    """Record (kind, dtype) -> [calls, bytes sent by this rank, largest tensor numel] inside the block."""

    def __init__(self):
        super().__init__()
        self.calls: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            kind = KINDS.get(func._opname)
            if kind is not None:
                sent = _tensors(args[1] if kind in INPUT_SECOND else args[0])
                for tensor in sent:
                    entry = self.calls[(kind, short(tensor.dtype))]
                    entry[0] += 1
                    entry[1] += tensor.numel() * tensor.element_size()
                    entry[2] = max(entry[2], tensor.numel())
        return func(*args, **kwargs)

    def dtypes(self, kinds, min_numel: int = 2) -> list[str]:
        """dtypes seen for these kinds, ignoring scalars (norms, overflow flags: not payload)."""
        return sorted({dtype for (kind, dtype), (_, _, largest) in self.calls.items()
                       if kind in kinds and largest >= min_numel})

    def as_dict(self) -> dict:
        out: dict = {}
        for (kind, dtype), (calls, nbytes, _) in sorted(self.calls.items()):
            out.setdefault(kind, {})[dtype] = {"calls": calls, "bytes": nbytes}
        return out
