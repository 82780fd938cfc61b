"""FSDP2 (torch.distributed.fsdp.fully_shard): `prepare(model, spec)` -> an FSDP2Run, `train_step(run, batches)`.

`profile` (what fp8dist knows of the engine before anything runs) imports no torch; the runtime names load on first use.
"""
from fp8dist.engines.fsdp2 import profile

__all__ = ["Checkpointing", "FSDP2Run", "accumulate_gradients", "apply_gradients", "profile", "prepare",
           "setup", "train_step"]


def __getattr__(name: str):
    if name == "Checkpointing":
        from fp8dist.engines.fsdp2.checkpointing import Checkpointing

        return Checkpointing
    if name in __all__:
        from fp8dist.engines.fsdp2 import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'fp8dist.engines.fsdp2' has no attribute {name!r}")
