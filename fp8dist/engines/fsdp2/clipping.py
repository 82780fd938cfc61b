"""Gradient clipping over gradients that live on different meshes: FSDP2 x tensor parallel ((dp, tp) beside dp) and
expert parallel ((efsdp, ep) beside dp_shard), where torch's foreach norm refuses the mix."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(parameters, max_norm: float, across=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over gradients that live on different meshes (tensor-parallel Linears on (dp, tp),
    expert-parallel experts on (efsdp, ep), the rest on dp), where torch's foreach norm refuses the mix ("mixed
    torch.Tensor and DTensor"; transformers #36296). Each gradient's local sum of squares is summed over the mesh dims
    it is sharded on (one all-reduce per group of gradients that share a mesh and placements, per sharded dim of more
    than one rank); replicated dims hold copies and are not summed. `across`: a process group whose ranks hold the
    model's other parameters (pipeline stages): the sums of squares are summed over it too."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict[tuple | None, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    total_squares = torch.zeros((), dtype=torch.float32)
    for key, group in groups.items():
        local = [g._local_tensor if isinstance(g, DTensor) else g for g in group]
        squares = torch.stack([(t.detach().float() ** 2).sum() for t in local]).sum().cpu()
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                # Shard, and FSDP2's _StridedShard (dp over a dim 0 that tp or ep shards already), which torch 2.13
                # does not make a Shard subclass
                if not placement.is_replicate() and not placement.is_partial() and mesh.size(dim) > 1:
                    dist.all_reduce(squares, group=mesh.get_group(dim))
        total_squares = total_squares + squares
    if across is not None:
        dist.all_reduce(total_squares, group=across)
    total = total_squares.sqrt()
    coefficient = float(max_norm) / (float(total) + 1e-6)
    if not coefficient >= 1.0:  # a non-finite norm scales by NaN, as torch's clip_grad_norm_ does
        coefficient = min(coefficient, 1.0)
        for grad in grads:
            grad.mul_(coefficient)
    return total
