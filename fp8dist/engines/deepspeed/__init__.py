"""DeepSpeed: `initialize(model, spec)` mirrors `deepspeed.initialize`; `train_step(engine, batches)`.

`profile` (what fp8dist knows of the engine before anything runs) imports no torch; the runtime names load on first use.
"""
from fp8dist.engines.deepspeed import profile

__all__ = ["Checkpointing", "DeepSpeedInspector", "DeepSpeedRun", "check_environment", "profile", "initialize",
           "recognize", "setup", "train_step"]


def __getattr__(name: str):
    if name == "Checkpointing":
        from fp8dist.engines.deepspeed.checkpointing import Checkpointing

        return Checkpointing
    if name in ("DeepSpeedInspector", "recognize"):
        from fp8dist.engines.deepspeed import inspector

        return getattr(inspector, name)
    if name in __all__:
        from fp8dist.engines.deepspeed import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'fp8dist.engines.deepspeed' has no attribute {name!r}")
