"""The engines, keyed by the config's `engine`. Importing this module imports no torch.

- `profile_for(spec)`: what fp8dist knows about the engine before anything runs (fp8dist.engines.profile.EngineProfile,
  answered in engines/<name>/profile.py: its translation, the dtypes it keeps, how it shards, offloads, loads and
  launches), which the runtime, the commands, estimate and the audit ask instead of testing the engine's name;
- `setup(model, spec, ...)`: the prepared run (an fp8dist.engines.base.Engine);
- `checkpoint_reader(path, manifest)`: the model tensors of a checkpoint the engine wrote, read offline (export);
- `inspector_for(model, optimizer)`: the engine recognised from a prepared run's objects alone, whoever prepared
  them (fp8dist, the user, Accelerate or HF Trainer).

A new engine is its package, fp8dist/engines/<name>/ (`profile.PROFILE`, `setup`, `checkpointing.Reader` and, if
torch's own checks below do not recognise its objects, `recognize`), with one entry in ENGINES and PROFILES here, plus
the pure parts that the layer order keeps below engines/ (config -> translate -> ... -> engines): its config traits
(fp8dist.config.engines TRAITS), its config rules (fp8dist/config/rules/<name>.py, ENGINE_RULES) and its translation
(fp8dist/translate/<name>.py, which `profile.translate` calls), and its value in the schema's `engine` enum
(docs/architecture.md, "Where a change goes").
"""
from __future__ import annotations

from types import ModuleType

from fp8dist.config.spec import Spec
from fp8dist.engines import deepspeed, fsdp2
from fp8dist.engines.base import Engine
from fp8dist.engines.profile import EngineProfile
from fp8dist.errors import Fp8distError

ENGINES: dict[str, ModuleType] = {"fsdp2": fsdp2, "deepspeed": deepspeed}
# Their profiles, named one by one so that the type checker holds each to the EngineProfile protocol.
PROFILES: dict[str, EngineProfile] = {"fsdp2": fsdp2.profile.PROFILE, "deepspeed": deepspeed.profile.PROFILE}


def profile_for(spec: Spec) -> EngineProfile:
    return PROFILES[spec.engine]


def setup(model, spec: Spec, **kwargs) -> Engine:
    """The engine `spec.engine` names, prepared around `model` (see each engine's `setup` for the keywords)."""
    return ENGINES[spec.engine].setup(model, spec, **kwargs)


def checkpoint_reader(path, manifest: dict):
    """The `Reader` of the engine that wrote the checkpoint at `path` (its manifest names it)."""
    from importlib import import_module

    package = ENGINES.get(manifest["engine"])
    if package is None:
        raise Fp8distError(f"{path}: written by engine={manifest['engine']}, which this fp8dist does not have"
                           f"\n  fix: export it with the fp8dist version that wrote it")
    return import_module(f"{package.__name__}.checkpointing").Reader(path, manifest)


def inspector_for(model, optimizer):
    """The engine that prepared `model` (and `optimizer`), recognised from the objects themselves."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from fp8dist.engines.inspector import Inspector, unwrap_optimizer

    optimizer = unwrap_optimizer(optimizer)
    for package in ENGINES.values():
        recognize = getattr(package, "recognize", None)
        found = recognize(model, optimizer) if recognize is not None else None
        if found is not None:
            return found
    if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
        raise Fp8distError(f"fp8dist.audit.watch needs the optimizer that steps the model, got "
                           f"{type(optimizer).__name__}: pass the optimizer your loop calls .step() on")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return Inspector("ddp", model.module, optimizer)
    modules = list(model.modules())
    if any(isinstance(m, FSDPModule) for m in modules):
        return Inspector("fsdp2", model, optimizer)
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in modules):
        return Inspector("fsdp1", model, optimizer)
    return Inspector("none", model, optimizer)
