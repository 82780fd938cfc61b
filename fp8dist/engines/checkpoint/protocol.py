"""Saving and resuming, with every rank: what each rank writes, what rank 0 alone decides and writes, and in which
order, so that a checkpoint is complete on every rank or not there at all.

A save writes everything under the `.partial` name; rank 0 then writes the manifest (with every file's size) and
renames the directory (fp8dist.engines.checkpoint.layout.make_complete), and only then deletes checkpoints beyond
`checkpoint.keep_last` and unfinished saves. A resume lets rank 0 find and check the checkpoint
(fp8dist.engines.checkpoint.compatibility) and gives every rank its answer, or the same error, before any weight
is read.

One rule says which checkpoints are another run's, for every caller (launch/train.py, fp8dist's run loop, a script
of its own calling `save`): a run is the engine's model object; it draws an id at its first save, or takes the id
of the checkpoint it resumed, and each manifest records it. A save into a directory holding checkpoints of any
other run is refused (so is a new run's `check_run_directory`): its steps would interleave with theirs, pruning
would delete theirs, and a resume or `fp8dist export` of the directory would take whichever run's step is newest.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import fp8dist.distributed as distributed
from fp8dist.engines.checkpoint.compatibility import check_compatible
from fp8dist.engines.checkpoint.files import write_file_atomic
from fp8dist.engines.checkpoint.interface import checkpointing_for
from fp8dist.engines.checkpoint.layout import (FORMAT, HF_CONFIG_DIR, MANIFEST, RUN, another_run, find_latest,
                                               foreign_checkpoints, make_complete, partial_path, prune, rank_file,
                                               read_manifest, run_of, step_name)
from fp8dist.engines.checkpoint.rng import rng_state, set_rng_state
from fp8dist.errors import Fp8distError
from fp8dist.facts import versions

# The releases a manifest records: what wrote the checkpoint, for whoever reads it later.
RECORDED_DISTRIBUTIONS = ("fp8dist", "torch", "deepspeed", "torchao", "transformers")


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run stands."""

    path: Path
    step: int  # optimizer steps already taken
    data_position: int  # the step index of the next batch
    notes: tuple[str, ...] = ()  # what is not exact (e.g. RNG states of another world size)


@dataclass
class _Run:
    """One run as checkpoints know it: the id its saves record, and the runs whose checkpoints are its own history
    (itself; the run it resumed, None where that checkpoint had no id)."""

    id: str
    continues: set[str | None] = field(default_factory=set)


# The engine's model object (an FSDP2Run, a DeepSpeedRun, the module of an EngineCheckpointing) -> its run, held
# weakly: a run object gone takes its entry with it.
_RUNS: weakref.WeakKeyDictionary[Any, _Run] = weakref.WeakKeyDictionary()


def _run(engine: Any, resumed: dict[str, Any] | None = None) -> _Run:
    """The run of `engine`'s model object; `resumed`: the manifest of the checkpoint it resumes, whose run it
    continues (a run resumed before its first save takes that run's id)."""
    run = _RUNS.get(engine.module)
    if run is None:
        found = run_of(resumed) if resumed is not None else None
        run = _Run(found or uuid.uuid4().hex[:12])
        run.continues.add(run.id)
        _RUNS[engine.module] = run
    if resumed is not None:
        run.continues.add(run_of(resumed))
    return run


def checkpoint_ranks() -> tuple[int, int]:
    """(this process's rank, the number of ranks) as checkpoints count them: which rank file is this process's, the
    `world_size` a manifest records, and the one a resume compares it with. Today the default process group's (a
    process without one is rank 0 of 1, whatever its launcher's RANK); the one place to change when checkpoints
    count data-parallel ranks."""
    if not distributed.is_initialized():
        return 0, 1
    return distributed.rank(), distributed.world_size()


def save(target: Any, directory: str | os.PathLike[str], step: int, *, spec: Any, model_name: str = "",
         scheduler: Any = None, data_position: int | None = None) -> Path:
    """Write a checkpoint of `target` taken after `step` optimizer steps into `directory`/step-NNNNNNNN.
    Every rank calls it. Returns the checkpoint's path once it is complete on every rank. `spec` is the run's
    fp8dist.config.spec.Spec (recorded in the manifest; its checkpoint.keep_last prunes)."""
    engine = checkpointing_for(target, model_name=model_name, scheduler=scheduler)
    directory = Path(directory)
    rank, world = checkpoint_ranks()
    final, partial = directory / step_name(step), partial_path(directory, step)
    run = _run(engine)

    def begin() -> None:
        if directory.exists() and not directory.is_dir():
            raise Fp8distError(f"--checkpoint-dir {directory}: is a file\n  fix: name a directory")
        foreign = foreign_checkpoints(directory, run.continues)
        if foreign:
            raise another_run(str(directory), foreign, "save this run into a new or empty directory; to continue "
                              "that run instead, resume from the directory first (fp8dist.engines.checkpoint.resume, "
                              "launch/train.py --resume), then save")
        directory.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
        config = engine.hf_config()
        if config is not None:
            (partial / HF_CONFIG_DIR).mkdir()
            config.to_json_file(str(partial / HF_CONFIG_DIR / "config.json"))

    def commit() -> None:
        manifest = {
            "fp8dist_checkpoint": FORMAT,
            RUN: run.id,
            "engine": engine.engine,
            "step": step,
            "data_position": step if data_position is None else data_position,
            "world_size": world,
            "model": {"name": model_name, "parameters": engine.parameter_shapes()},
            "config": spec.to_dict(),
            "precision_schedule": schedule_state(spec, step),
            "files": {str(p.relative_to(partial)): p.stat().st_size
                      for p in sorted(partial.rglob("*")) if p.is_file()},
            "versions": _versions(),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_file_atomic(partial / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        make_complete(partial, final)
        prune(directory, spec.checkpoint.keep_last, keep=final)

    distributed.on_rank_zero(f"preparing {partial}", begin)
    engine.write(partial)
    torch.save({"rng": rng_state(), **engine.rank_state()}, partial / rank_file(rank))
    distributed.barrier()
    distributed.on_rank_zero(f"completing {final}", commit)
    return final


def resume(target: Any, directory: str | os.PathLike[str], *, model_name: str = "",
           scheduler: Any = None) -> Resumed | None:
    """Load the newest complete checkpoint under `directory` into `target` (every rank calls it). Returns
    None when there is none yet. Rank 0 decides which checkpoint and checks it; every rank raises the same
    error when it cannot be used, before any weight is read."""
    engine = checkpointing_for(target, model_name=model_name, scheduler=scheduler)
    spec = getattr(getattr(target, "fp8dist_run", target), "spec", None)
    rank, world = checkpoint_ranks()

    def decide() -> tuple[str, dict[str, Any], list[str]] | None:
        path = find_latest(directory)
        if path is None:
            return None
        manifest = read_manifest(path)
        config = spec.to_dict() if spec is not None else None
        return str(path), manifest, check_compatible(manifest, path, engine, world, config)

    decided = distributed.on_rank_zero(f"resuming from {directory}", decide)
    if decided is None:
        return None
    path, manifest, notes = Path(decided[0]), decided[1], decided[2]
    _run(engine, resumed=manifest)  # its saves continue that run: the directory's checkpoints are its own
    engine.read(path)
    if manifest["world_size"] == world:
        state = torch.load(path / rank_file(rank), weights_only=True)
        set_rng_state(state.pop("rng"))
        engine.load_rank_state(state)
    else:  # the scaler and the scheduler: the same on all ranks
        engine.load_rank_state(torch.load(path / rank_file(0), weights_only=True))
    distributed.barrier()
    run = getattr(target, "fp8dist_run", target)
    if isinstance(getattr(run, "step_number", None), int):  # precision.schedule switches by the engine's step count
        run.step_number = manifest["step"]
    return Resumed(path, manifest["step"], manifest["data_position"], tuple(notes))


def schedule_state(spec: Any, step: int) -> dict[str, Any] | None:
    """precision.schedule as a checkpoint taken after `step` steps records it: the switch step, the GEMMs it switches
    and how many of the steps taken ran switched (fp8dist.engines.checkpoint.compatibility refuses a resume that
    would run FP8 again after them). None without a schedule."""
    switch = getattr(spec, "switch_step", None)
    if switch is None:
        return None
    return {"switch_step": switch, "gemms": spec.precision.schedule.gemms,
            "switched_steps": max(0, step - switch + 1)}


def check_run_directory(directory: str | os.PathLike[str], resuming: bool) -> None:
    """Before the first step (every rank calls it): `directory` must be a directory this job can write (made if
    missing), not one checkpoint, and for a new run hold no checkpoint of an earlier one (the rule `save` applies,
    said before any step is spent): the new run's saves would interleave with them, and pruning and `--resume`
    would pick the other run's newer steps."""
    directory = Path(directory)

    def check() -> None:
        if (directory / MANIFEST).is_file():
            raise Fp8distError(f"--checkpoint-dir {directory}: names one checkpoint, not the directory of a run"
                               f"\n  fix: pass its parent, {directory.parent}"
                               + (" (--resume then continues from its newest checkpoint)" if resuming else ""))
        if directory.exists() and not directory.is_dir():
            raise Fp8distError(f"--checkpoint-dir {directory}: is a file\n  fix: name a directory")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".fp8dist-write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise Fp8distError(f"--checkpoint-dir {directory}: cannot write there ({exc.strerror})"
                               "\n  fix: name a directory this job can write, on a filesystem every rank sees"
                               ) from None
        foreign = [] if resuming else foreign_checkpoints(directory)  # a new run: none is its own yet
        if foreign:
            raise another_run(f"--checkpoint-dir {directory}", foreign, "add --resume to continue that run, or "
                                                                          "name a new or empty directory")

    distributed.on_rank_zero(f"--checkpoint-dir {directory}", check)


def failure_text(exc: BaseException) -> str:
    """One line for an error while reading or writing a checkpoint; torch.distributed.checkpoint's
    CheckpointException holds each failing rank's own error (`failures`)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:  # rank -> (exception, traceback) in torch 2.13 (api.py)
        errors = {rank: e[0] if isinstance(e, tuple) else e for rank, e in failures.items()}
        return "; ".join(f"rank {rank}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
                         for rank, e in sorted(errors.items()))
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def _versions() -> dict[str, str]:
    return {name: version for name in RECORDED_DISTRIBUTIONS
            if (version := versions.installed_version(name)) is not None}
