"""What an engine provides to the checkpoint protocol: `EngineCheckpointing` (write and read its own files, in a
process group) and `ModelReader` (the model tensors of one checkpoint, in one process, for `fp8dist export`).

The engines implement them in fp8dist.engines.fsdp2.checkpointing and fp8dist.engines.deepspeed.checkpointing,
reached through `Engine.checkpointing` and fp8dist.engines.registry.checkpoint_reader.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from fp8dist.errors import Fp8distError

if TYPE_CHECKING:
    import torch

# Module wrappers that insert a path component into parameter names: activation checkpointing
# (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py _CHECKPOINT_WRAPPED_MODULE), torch.compile
# (OptimizedModule._orig_mod), FSDP1. torch.distributed.checkpoint.state_dict._get_fqns strips the same ones.
WRAPPER_COMPONENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def model_key(name: str) -> str:
    """A parameter's name as the model's own state dict (and Hugging Face) spells it."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


class EngineCheckpointing:
    """What an engine provides (all ranks call `write` / `read` together); the engines subclass it:
    fp8dist.engines.fsdp2.Checkpointing, fp8dist.engines.deepspeed.Checkpointing."""

    engine = ""
    reshardable = False  # can a checkpoint written by W ranks be read by another number of ranks

    def __init__(self, module: Any, model_name: str = "", scheduler: Any = None):
        self.module, self.model_name, self.scheduler = module, model_name, scheduler

    def write(self, directory: Path) -> None:
        raise NotImplementedError

    def read(self, directory: Path) -> None:
        raise NotImplementedError

    def shape(self, param: torch.Tensor) -> list[int]:
        return list(param.shape)

    def parameter_shapes(self) -> dict[str, list[int]]:
        return {model_key(name): self.shape(p) for name, p in self.module.named_parameters()}

    def hf_config(self) -> Any:
        """The model's transformers config (recorded for `fp8dist export`), or None for other models."""
        config = getattr(self.module, "config", None)
        return config if hasattr(config, "to_json_file") else None

    def rank_state(self) -> dict[str, Any]:
        """What this rank keeps beside model and optimizer (plain objects, for torch.load(weights_only=True))."""
        return {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None:
            if state.get("scheduler") is None:
                raise Fp8distError("the checkpoint holds no LR scheduler state, and this run has a scheduler"
                                   "\n  fix: resume without the scheduler, or from a checkpoint saved with one")
            self.scheduler.load_state_dict(state["scheduler"])


class ModelReader:
    """The model tensors of one checkpoint, read in one process without a process group (`fp8dist export`): each
    engine's checkpointing module has its `Reader`, found through fp8dist.engines.registry.checkpoint_reader."""

    stored: set[torch.dtype] = set()  # dtypes of the weights when they are not the fp32 masters

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path, self.manifest = path, manifest

    def sizes(self, dtype: torch.dtype) -> dict[str, int]:
        """Model key -> bytes once exported in `dtype` (floating tensors take it, others keep theirs)."""
        raise NotImplementedError

    def read(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(model key, plain tensor) for each of `keys`."""
        raise NotImplementedError


def exported_bytes(shape: Iterable[int], stored: torch.dtype | None, target: torch.dtype) -> int:
    """Bytes of a tensor of `shape` once exported: floating tensors take the export dtype, others keep theirs."""
    count = 1
    for dim in shape:
        count *= int(dim)
    itemsize = target.itemsize if stored is None or stored.is_floating_point else stored.itemsize
    return count * itemsize


def checkpointing_for(target: Any, *, model_name: str = "", scheduler: Any = None) -> EngineCheckpointing:
    """The checkpointing of an fp8dist engine (fp8dist.engines.base.Engine: an FSDP2Run, a DeepSpeedRun) or of a
    DeepSpeedEngine from fp8dist.engines.deepspeed.initialize; an EngineCheckpointing passes through."""
    if isinstance(target, EngineCheckpointing):
        return target
    run = getattr(target, "fp8dist_run", target)
    if callable(getattr(run, "checkpointing", None)):
        checkpointing: EngineCheckpointing = run.checkpointing(model_name, scheduler)
        return checkpointing
    raise Fp8distError(f"cannot checkpoint a {type(target).__name__}: pass the FSDP2Run of "
                       "fp8dist.engines.fsdp2.prepare or the engine of fp8dist.engines.deepspeed.initialize")
