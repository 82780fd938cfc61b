"""The peak of the bytes a block of torch code allocates, counted op by op (a TorchDispatchMode): each new storage an
op returns adds its bytes, and its release (a weakref finalizer on the storage) takes them off, so freed memory counts
as freed whatever the allocator keeps. The figure a device allocator would see, measured on the CPU. Tensors named in
`before` are not counted; any other tensor that existed before the block counts from its first use in it. What a
tensor subclass allocates inside its own __torch_dispatch__ is not seen (the mode is off there): the code measured
here runs on plain tensors (torchao's NF4Tensor dequantizes through __torch_function__ into plain ops; PEFT's DoRA
is plain ops). CPU tensors only (meta tensors share one address)."""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self, before: tuple[torch.Tensor, ...] = ()):
        super().__init__()
        self.live = self.peak = 0
        self.storages: set[int] = {t.untyped_storage().data_ptr() for t in before}  # not counted: existed before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if type(tensor) is not torch.Tensor:  # subclasses hold plain tensors, counted as those are made
                continue
            assert tensor.device.type == "cpu", f"LiveBytes measures CPU tensors, not {tensor.device}"
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in self.storages or not size:
                continue
            self.storages.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, key, size)
        return out

    def _release(self, key: int, size: int) -> None:
        self.live -= size
        self.storages.discard(key)
