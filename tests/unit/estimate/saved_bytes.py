"""What the estimate's measuring scripts (one_rank_of_a_mesh.py, one_rank_dispatch.py) share: the bytes autograd
saves for backward in one forward, as the rank holds them."""
import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from fp8dist.engines.base import forward_loss


def kept_for_backward(model, batch) -> int:
    """Bytes autograd saves in one forward on this rank: each rank-local storage once (a DTensor's local tensor, an
    all-to-all's output once waited for); parameters left out."""
    seen: dict[int, tuple[int, object]] = {}

    def pack(tensor):
        if isinstance(tensor, AsyncCollectiveTensor):  # a functional collective's output, saved by a later op
            tensor = tensor.trigger_wait()
        base = tensor._base if tensor._base is not None else tensor
        if not isinstance(base, torch.nn.Parameter):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = (storage.nbytes(), storage)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward_loss(model, batch)
    return sum(nbytes for nbytes, _ in seen.values())
