"""Activation checkpointing of the wrap units (transformer blocks), for both engines: `full` recomputes each
block in backward; `selective` keeps the outputs of the expensive ops and recomputes the rest.

Applied after the float8 conversion and before torch.compile and sharding (torchtitan parallelize_llama:
float8 -> AC -> per-block compile -> fully_shard; Accelerate _prepare_fsdp2 the same). The wrapper is
torch's non-reentrant `checkpoint_wrapper` (torch 2.13 torch/distributed/algorithms/_checkpoint/
checkpoint_wrapper.py); its state-dict hooks strip the wrapper prefix, so checkpoints keep the model's keys.

The selective policy is torchtitan's op-level one (torchtitan/distributed/activation_checkpoint.py,
`_get_default_save_ops`): save matmul / attention outputs (every second mm recomputed, to halve their
memory) and `aten.max`, "the absolute maximum used to compute the scaling factor for quantization", so a
recomputed float8 cast uses the same scale as the forward did.

The recompute runs in backward, outside the backend's forward context (Transformer Engine's autocast), so the
wrapper's context_fn enters it again there (the backend's checkpoint_context_fn), combined with the selective
policy's own pair.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fp8dist.errors import Fp8distError

def in_backward() -> bool:
    """Whether autograd's backward is running: a forward there is an activation-checkpoint recompute of one that ran
    before (what the audit's probes, compare's taps and routing replay count once)."""
    return torch._C._current_graph_task_id() != -1


def _save_ops() -> set:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
           aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default, aten.max.default}
    if hasattr(aten, "_scaled_mm"):
        ops.add(aten._scaled_mm.default)
    return ops


class SavePolicy:
    """torchtitan's op-level selective policy for one checkpointed block: the outputs it keeps (matmuls, attention,
    `max`), every second `mm` recomputed instead. One instance per forward (or recompute) of a block, so both
    pick the same mms; fp8dist's estimate runs the same policy to count what selective checkpointing keeps."""

    def __init__(self):
        self.save, self.mm_seen = _save_ops(), 0

    def keeps(self, op) -> bool:
        if op == torch.ops.aten.mm.default:
            self.mm_seen += 1
            return self.mm_seen % 2 == 1
        return op in self.save


def _selective_context():
    policies = {"forward": SavePolicy(), "recompute": SavePolicy()}

    def policy(ctx, op, *args, **kwargs):
        keeps = policies["recompute" if ctx.is_recompute else "forward"].keeps(op)
        return CheckpointPolicy.MUST_SAVE if keeps else CheckpointPolicy.PREFER_RECOMPUTE

    contexts = create_selective_checkpoint_contexts(policy)
    if _CACHES is not None:  # kept_for_backward() is counting: its forward cache holds what is kept
        _CACHES.append(contexts[0])
    return contexts


_CACHES: list | None = None


@contextlib.contextmanager
def kept_for_backward() -> Iterator[Callable[[], int]]:
    """Bytes kept for backward by the forward run inside the block, each storage once: what autograd saves
    (saved-tensor hooks) plus the op outputs selective checkpointing caches, which live in its caching
    dispatch mode's storage rather than in autograd (torch 2.13 torch/utils/checkpoint.py
    _CachingTorchDispatchMode.storage). Parameters are not counted; float8 tensors by the bytes they hold.
    Yields a function that returns the total once the block has run (benchmarks, tests)."""
    from torch.utils._pytree import tree_leaves

    global _CACHES
    seen: dict[int, tuple[int, Any]] = {}  # data_ptr -> (bytes, storage kept alive so no address is reused)

    def pack(tensor):
        base = getattr(tensor, "_base", None)
        # a parameter, or a view of one (the transposed weight a matmul saves), is not an activation
        if isinstance(tensor, torch.Tensor) and not isinstance(base if base is not None else tensor,
                                                               torch.nn.Parameter):
            inner = getattr(tensor, "_data", tensor)
            try:
                storage = inner.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a subclass without a storage of its own
                return tensor
            seen[storage.data_ptr()] = (storage.nbytes(), storage)
        return tensor

    def total() -> int:
        for cache in caches:
            for entries in cache.storage.values():
                for entry in entries.values():
                    for leaf in tree_leaves(entry):
                        pack(getattr(leaf, "val", None))
        return sum(nbytes for nbytes, _ in seen.values())

    previous = _CACHES
    caches: list[Any] = []
    _CACHES = caches
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield total
    finally:
        _CACHES = previous


def _both(first, second):
    """One context entering `first`, then `second`."""
    @contextlib.contextmanager
    def both():
        with first, second:
            yield

    return both()


def _context_fn(mode: str, backend) -> Callable | None:
    """The checkpoint's context_fn: selective checkpointing's caching pair and the backend's (forward, recompute)
    pair (Transformer Engine re-enters its autocast on recompute: backends/base.py checkpoint_context_fn), both
    entered where both exist; None for full checkpointing on a backend without a forward context."""
    backend_fn = backend.checkpoint_context_fn() if backend is not None else None
    if mode != "selective":
        return backend_fn
    if backend_fn is None:
        return _selective_context

    def context_fn():
        (forward, recompute), (selective_forward, selective_recompute) = backend_fn(), _selective_context()
        return _both(forward, selective_forward), _both(recompute, selective_recompute)

    return context_fn


def apply(model: torch.nn.Module, units: list[tuple[str, torch.nn.Module]], mode: str,
          backend=None) -> list[tuple[str, torch.nn.Module]]:
    """Wrap each unit (name, module) in place in its parent; returns the units as they now are (the wrappers,
    which sharding and compile then treat as the blocks). `none`: the units unchanged. `backend`: the run's
    precision backend (fp8dist.backends), whose forward context the recompute in backward enters again."""
    if mode == "none":
        return units
    if not units:
        raise Fp8distError(f"parallel.activation_checkpointing={mode} wraps the model's blocks, and "
                           f"{type(model).__name__} has none that fp8dist finds (no _no_split_modules, no "
                           "nn.ModuleList)\n  fix: list the block class names in fsdp2.wrap, or set "
                           "parallel.activation_checkpointing=none")
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        # A Hugging Face model in training still fills a KV cache when use_cache is on; the recompute would then
        # attend over the cache the forward already extended (transformers 5 modeling_layers.py: "otherwise the
        # cache is updated a second time on the backward replay"). Its own gradient_checkpointing_enable turns
        # the cache off too.
        config.use_cache = False
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    context_fn = _context_fn(mode, backend)
    wrap = partial(checkpoint_wrapper, context_fn=context_fn) if context_fn else checkpoint_wrapper
    wrapped = []
    for name, unit in units:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapper = wrap(unit, preserve_rng_state=True)
        parent.register_module(child, wrapper)
        wrapped.append((name, wrapper))
    return wrapped
