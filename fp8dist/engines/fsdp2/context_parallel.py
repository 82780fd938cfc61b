"""Context parallel on the `cp` axis of the run's mesh (FSDP2 engine): each forward and backward runs inside torch's
`context_parallel`, which shards the batch's sequence over the cp ranks and turns SDPA into ring attention
(torch 2.13 torch/distributed/tensor/experimental/_context_parallel/_attention.py; Accelerate 1.15
`maybe_context_parallel` and torchtitan v0.2.2 distributed/context_parallel.py apply it the same way).

Only the CUDA SDPA kernels (flash / memory-efficient / cuDNN) have a sharding rule, so FSDP2Profile.check_environment
refuses cp > 1 where there is no CUDA device. Causal language modelling over a split sequence needs two things a
single rank would otherwise get wrong:
- labels are shifted before the split (`shift_labels`, transformers 5 loss/loss_utils.py ForCausalLMLoss): a rank's
  slice does not hold the token after its last one;
- positions are the whole sequence's (`position_ids`), so rotary embeddings see where each slice sits.
FSDP2 shards over dp_shard x cp (engines/mesh.py Meshes.data), so its gradient average covers the cp ranks' slices.
"""
from __future__ import annotations

import contextlib

import torch

IGNORE_INDEX = -100  # transformers' ignore_index for the label after a sequence's last token


def split_batch(batch: dict) -> dict:
    """`batch` with what the split needs: labels shifted beforehand, positions of the whole sequence."""
    ids = batch["input_ids"]
    out = dict(batch)
    if "labels" in batch:
        labels = batch["labels"]
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        out["shift_labels"] = shifted
    out.setdefault("position_ids", torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous())
    return out


@contextlib.contextmanager
def sharded_sequence(cp_mesh, batch: dict):
    """Inside: `batch` (from split_batch) holds this cp rank's slice of every sequence tensor, and SDPA runs as ring
    attention over the cp ranks. The caller's tensors are restored afterwards except the ones the step consumed."""
    from torch.distributed.tensor.experimental import context_parallel

    names = [name for name in ("input_ids", "labels", "shift_labels", "position_ids") if name in batch]
    buffers = [batch[name] for name in names]
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                          no_restore_buffers=set(buffers)):
        yield
