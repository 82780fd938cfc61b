"""PyTorch and FSDP2: the releases fp8dist needs, and why."""
from __future__ import annotations

from fp8dist.facts.versions import Version, fmt

# fully_shard is public at torch.distributed.fsdp from torch 2.6 (pytorch/pytorch#141868).
TORCH_FSDP2_PUBLIC = (2, 6, 0)
# FSDPModule.set_custom_all_gather / set_custom_reduce_scatter (torch/distributed/fsdp/_fully_shard/_fully_shard.py;
# DefaultAllGather, DefaultReduceScatter in _fully_shard/_fsdp_collectives.py) first ship in torch 2.9.0
# (pytorch/pytorch#155189; absent from the 2.8 API docs). fp8dist needs them for float8 all-gather over gloo and the
# audit's FSDP2 collective record.
TORCH_FSDP2_CUSTOM_COLLECTIVES = (2, 9, 0)
# The lowest torch fp8dist runs on: pyproject.toml's `torch>=` (tests/unit/test_promises.py keeps them equal).
TORCH_FLOOR = TORCH_FSDP2_CUSTOM_COLLECTIVES


def torch_supported(torch_version: Version) -> tuple[bool, str]:
    if torch_version >= TORCH_FLOOR:
        return True, f"torch {fmt(torch_version)} >= {fmt(TORCH_FLOOR)}"
    return False, (f"torch {fmt(torch_version)} is older than fp8dist's floor {fmt(TORCH_FLOOR)} (FSDP2 custom "
                   "collectives, pytorch#155189)")


def fsdp2_supported(torch_version: Version) -> tuple[bool, str]:
    if torch_version >= TORCH_FSDP2_PUBLIC:
        return True, f"torch {fmt(torch_version)} has torch.distributed.fsdp.fully_shard"
    return False, (f"torch {fmt(torch_version)} lacks the public FSDP2 API "
                   f"(needs >= {fmt(TORCH_FSDP2_PUBLIC)}); upgrade torch")
