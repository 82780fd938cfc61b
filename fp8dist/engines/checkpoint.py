"""Checkpoints that survive: save, exact resume, crash safety. One layout for both engines.

    DIR/step-00000004/                 one complete checkpoint (the step count it was taken after)
        fp8dist-checkpoint.json        the manifest: written last, so its presence means "complete"
        hf/config.json                 the model's Hugging Face config (what `fp8dist export` needs)
        rank-00000.pt ...              per rank: RNG states, the fp16 loss scaler, the LR scheduler
        dcp/ | deepspeed/              the engine's own files (torch.distributed.checkpoint / engine.save_checkpoint)
    DIR/.step-00000006.partial/        a save in progress, or one a crash interrupted: never loaded

A save writes everything under the `.partial` name; rank 0 then writes the manifest (with every file's size)
and renames the directory (one atomic rename on a POSIX filesystem), and only then deletes checkpoints
beyond `checkpoint.keep_last` and unfinished saves. A job killed during a save leaves the previous
checkpoint as the newest complete one. Resuming checks the manifest against the files (a truncated shard is
named), the engine, the world size where the engine cannot reshard, and the model's parameters, before any
weight is read.

What an engine writes and reads lives in the engine (`fp8dist.engines.fsdp2.checkpointing`,
`fp8dist.engines.deepspeed.checkpointing`, reached through `Engine.checkpointing`); this module is the protocol
around them. The checkpoint
directory must be on a filesystem every rank sees (as for torch.distributed.checkpoint and DeepSpeed).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fp8dist.errors import Fp8distError

MANIFEST = "fp8dist-checkpoint.json"
FORMAT = 1
HF_CONFIG_DIR = "hf"
_COMPLETE = re.compile(r"^step-(\d{8})$")
_PARTIAL = re.compile(r"^\.step-(\d{8})\.partial$")
_LEFTOVER = re.compile(r"^\.step-(\d{8})\.(partial|replaced)$")
# Module wrappers that insert a path component into parameter names: activation checkpointing
# (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py _CHECKPOINT_WRAPPED_MODULE), torch.compile
# (OptimizedModule._orig_mod), FSDP1. torch.distributed.checkpoint.state_dict._get_fqns strips the same ones.
WRAPPER_COMPONENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def model_key(name: str) -> str:
    """A parameter's name as the model's own state dict (and Hugging Face) spells it."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


class EngineCheckpointing:
    """What an engine provides (all ranks call `write` / `read` together); the engines subclass it:
    fp8dist.engines.fsdp2.Checkpointing, fp8dist.engines.deepspeed.Checkpointing."""

    engine = ""
    reshardable = False  # can a checkpoint written by W ranks be read by another number of ranks

    def __init__(self, module, model_name: str = "", scheduler=None):
        self.module, self.model_name, self.scheduler = module, model_name, scheduler

    def write(self, directory: Path) -> None:
        raise NotImplementedError

    def read(self, directory: Path) -> None:
        raise NotImplementedError

    def shape(self, param) -> list[int]:
        return list(param.shape)

    def parameter_shapes(self) -> dict[str, list[int]]:
        return {model_key(name): self.shape(p) for name, p in self.module.named_parameters()}

    def hf_config(self):
        """The model's transformers config (recorded for `fp8dist export`), or None for other models."""
        config = getattr(self.module, "config", None)
        return config if hasattr(config, "to_json_file") else None

    def rank_state(self) -> dict:
        """What this rank keeps beside model and optimizer (plain objects, for torch.load(weights_only=True))."""
        return {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_rank_state(self, state: dict) -> None:
        if self.scheduler is not None:
            if state.get("scheduler") is None:
                raise Fp8distError("the checkpoint holds no LR scheduler state, and this run has a scheduler"
                                   "\n  fix: resume without the scheduler, or from a checkpoint saved with one")
            self.scheduler.load_state_dict(state["scheduler"])


class ModelReader:
    """The model tensors of one checkpoint, read in one process without a process group (`fp8dist export`): each
    engine's checkpointing module has its `Reader`, found through fp8dist.engines.registry.checkpoint_reader."""

    stored: set = set()  # dtypes of the weights when they are not the fp32 masters

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = path, manifest

    def sizes(self, dtype) -> dict[str, int]:
        """Model key -> bytes once exported in `dtype` (floating tensors take it, others keep theirs)."""
        raise NotImplementedError

    def read(self, keys: list[str]):
        """(model key, plain tensor) for each of `keys`."""
        raise NotImplementedError


def exported_bytes(shape, stored, target) -> int:
    """Bytes of a tensor of `shape` once exported: floating tensors take the export dtype, others keep theirs."""
    count = 1
    for dim in shape:
        count *= int(dim)
    itemsize = target.itemsize if stored is None or stored.is_floating_point else stored.itemsize
    return count * itemsize


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run stands."""

    path: Path
    step: int  # optimizer steps already taken
    data_position: int  # the step index of the next batch
    notes: tuple[str, ...] = ()  # what is not exact (e.g. RNG states of another world size)


def checkpointing_for(target, *, model_name: str = "", scheduler=None) -> EngineCheckpointing:
    """The checkpointing of an fp8dist engine (fp8dist.engines.base.Engine: an FSDP2Run, a DeepSpeedRun) or of a
    DeepSpeedEngine from fp8dist.engines.deepspeed.initialize; an EngineCheckpointing passes through."""
    if isinstance(target, EngineCheckpointing):
        return target
    run = getattr(target, "fp8dist_run", target)
    if callable(getattr(run, "checkpointing", None)):
        return run.checkpointing(model_name, scheduler)
    raise Fp8distError(f"cannot checkpoint a {type(target).__name__}: pass the FSDP2Run of "
                       "fp8dist.engines.fsdp2.prepare or the engine of fp8dist.engines.deepspeed.initialize")


# --- saving -------------------------------------------------------------------------------------------

def save(target, directory: str | os.PathLike, step: int, *, spec, model_name: str = "", scheduler=None,
         data_position: int | None = None) -> Path:
    """Write a checkpoint of `target` taken after `step` optimizer steps into `directory`/step-NNNNNNNN.
    Every rank calls it. Returns the checkpoint's path once it is complete on every rank."""
    engine = checkpointing_for(target, model_name=model_name, scheduler=scheduler)
    directory = Path(directory)
    rank, world = _rank_world()
    final, partial = directory / step_name(step), directory / f".{step_name(step)}.partial"

    def begin():
        if directory.exists() and not directory.is_dir():
            raise Fp8distError(f"--checkpoint-dir {directory}: is a file\n  fix: name a directory")
        directory.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
        config = engine.hf_config()
        if config is not None:
            (partial / HF_CONFIG_DIR).mkdir()
            config.to_json_file(str(partial / HF_CONFIG_DIR / "config.json"))

    def commit():
        manifest = {
            "fp8dist_checkpoint": FORMAT,
            "engine": engine.engine,
            "step": step,
            "data_position": step if data_position is None else data_position,
            "world_size": world,
            "model": {"name": model_name, "parameters": engine.parameter_shapes()},
            "config": spec.to_dict(),
            "files": {str(p.relative_to(partial)): p.stat().st_size
                      for p in sorted(partial.rglob("*")) if p.is_file()},
            "versions": _versions(),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        _write_file_atomic(partial / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        replaced = directory / f".{step_name(step)}.replaced"
        if final.exists():  # the same step saved again: moved aside first, so a crash keeps one of the two
            os.rename(final, replaced)
        os.rename(partial, final)
        _fsync_dir(directory)
        shutil.rmtree(replaced, ignore_errors=True)
        prune(directory, spec.checkpoint.keep_last, keep=final)

    on_rank_zero(f"preparing {partial}", begin)
    engine.write(partial)
    torch.save({"rng": _rng_state(), **engine.rank_state()}, partial / f"rank-{rank:05d}.pt")
    _barrier()
    on_rank_zero(f"completing {final}", commit)
    return final


def prune(directory: Path, keep_last: int, keep: Path | None = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last` (never `keep`, the one just written), and
    unfinished saves. A checkpoint loses its manifest first, so a crash during deletion leaves an incomplete
    directory, never a "complete" one with files missing."""
    complete = complete_checkpoints(directory)
    doomed = [p for p in complete[:-keep_last] if p != keep]
    doomed += [p for p in directory.iterdir() if _LEFTOVER.match(p.name) and p.is_dir()]
    for path in doomed:
        (path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    for path in directory.iterdir():  # complete-looking names without a manifest: a deletion a crash interrupted
        if _COMPLETE.match(path.name) and path.is_dir() and not (path / MANIFEST).exists():
            shutil.rmtree(path, ignore_errors=True)
            doomed.append(path)
    return doomed


# --- finding and checking -----------------------------------------------------------------------------

def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first."""
    found = [p for p in directory.iterdir() if _COMPLETE.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(_COMPLETE.match(p.name).group(1)))


def find_latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `directory`, or None when it has none yet (missing, empty, or only
    saves a crash interrupted). `directory` may also name one checkpoint. Raises when `directory` holds
    something else: resuming from it would silently start over."""
    directory = Path(directory)
    if (directory / MANIFEST).is_file():
        return directory
    if not directory.exists():
        return None
    if not directory.is_dir():
        raise Fp8distError(f"{directory}: is a file, not a checkpoint directory"
                           "\n  fix: pass the --checkpoint-dir of an earlier run (it holds step-NNNNNNNN directories)")
    complete = complete_checkpoints(directory)
    if complete:
        return complete[-1]
    ours = [p.name for p in directory.iterdir() if _PARTIAL.match(p.name) or _COMPLETE.match(p.name)]
    others = [p.name for p in directory.iterdir() if p.name not in ours]
    if others and not ours:
        raise Fp8distError(f"{directory}: not an fp8dist checkpoint directory (it holds {', '.join(sorted(others)[:5])}"
                           f"{' ...' if len(others) > 5 else ''}, and no step-NNNNNNNN checkpoint)"
                           "\n  fix: pass the --checkpoint-dir of an earlier run (it holds step-NNNNNNNN "
                           "checkpoints); a new run needs a new or empty directory")
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, after checking that every file it lists is there, whole."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Fp8distError(f"{file}: unreadable checkpoint manifest ({exc})"
                           f"\n  fix: delete {path} to resume from the checkpoint before it") from None
    if not isinstance(manifest, dict) or manifest.get("fp8dist_checkpoint") != FORMAT:
        raise Fp8distError(f"{file}: not an fp8dist checkpoint manifest of format {FORMAT}"
                           f"\n  fix: delete {path}, or resume with the fp8dist version that wrote it")
    for relative, size in manifest.get("files", {}).items():
        shard = path / relative
        if not shard.is_file():
            raise Fp8distError(f"{shard}: missing from the checkpoint (its manifest lists it, {size} bytes)"
                               f"\n  fix: restore the file, or delete {path} to resume from the checkpoint before it")
        actual = shard.stat().st_size
        if actual != size:
            raise Fp8distError(f"{shard}: truncated or changed since the save ({actual} bytes, the manifest says "
                               f"{size})\n  fix: restore the file, or delete {path} to resume from the checkpoint "
                               "before it")
    return manifest


# Settings that say how long and how observed a run is, not what it computes: a resume that changes them says
# nothing (extending `train.steps` is what resuming is for).
_BOOKKEEPING = frozenset({"train.steps", "train.process_group_timeout_s", "checkpoint.keep_last", "audit.first_step",
                          "deepspeed.steps_per_print"})


def _leaves(document: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(document, dict):
        return {key: value for name, child in document.items()
                for key, value in _leaves(child, f"{prefix}{name}.").items()}
    return {prefix[:-1]: document}


def config_changes(saved: dict | None, here: dict | None) -> list[tuple[str, Any, Any]]:
    """The settings (dotted keys) a resumed run changes from the checkpoint's config: (key, saved, here)."""
    if not saved or not here:
        return []
    before, after = _leaves(saved), _leaves(here)
    return [(key, before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
            if key not in _BOOKKEEPING and before.get(key) != after.get(key)]


def check_compatible(manifest: dict, path: Path, engine: EngineCheckpointing, world: int,
                     config: dict | None = None) -> list[str]:
    """Refuse what cannot be resumed here; return what is resumed but not exactly (notes). `config` is this run's
    config (Spec.to_dict()), compared with the one the checkpoint was written under."""
    if manifest["engine"] != engine.engine:
        raise Fp8distError(f"{path}: written by engine={manifest['engine']}, this run is engine={engine.engine}"
                           f"\n  fix: resume with a config of engine={manifest['engine']}, or start a new "
                           "--checkpoint-dir (export the old one with `fp8dist export` to reuse its weights)")
    saved, here = manifest["model"]["parameters"], engine.parameter_shapes()
    if saved != here:
        missing = sorted(set(saved) - set(here))
        extra = sorted(set(here) - set(saved))
        shapes = sorted(k for k in set(saved) & set(here) if saved[k] != here[k])
        detail = (f"parameter {missing[0]} is not in this model" if missing else
                  f"this model's parameter {extra[0]} is not in the checkpoint" if extra else
                  f"{shapes[0]} is {saved[shapes[0]]} there and {here[shapes[0]]} here")
        raise Fp8distError(f"{path}: a checkpoint of another model ({manifest['model'].get('name') or '?'}: {detail})"
                           "\n  fix: resume with the --model it was trained with, or start a new --checkpoint-dir")
    notes = []
    other_model = manifest["model"].get("name") and engine.model_name and manifest["model"]["name"] != engine.model_name
    if other_model and (manifest.get("config") or {}).get("adapter", {}).get("kind", "none") != "none":
        raise Fp8distError(f"{path}: an adapter run's checkpoint of --model {manifest['model']['name']}; it holds the "
                           f"adapters only and the frozen base is read again from MODEL, so resuming with "
                           f"{engine.model_name} would train these adapters on another base"
                           f"\n  fix: resume with --model {manifest['model']['name']}, or start a new --checkpoint-dir")
    changes = config_changes(manifest.get("config"), config)
    for key, before, after in changes:
        if key == "adapter.alpha":  # PEFT scales the adapters' output by alpha / r (peft 0.21 tuners/lora/layer.py)
            raise Fp8distError(f"{path}: adapter.alpha is {before} in the checkpoint and {after} in this config; the "
                               f"adapters were trained under the scaling alpha / r, so another alpha makes the "
                               f"checkpoint another model\n  fix: resume with adapter.alpha={before}, or start a new "
                               "--checkpoint-dir")
    if changes:
        notes.append("resumed with settings other than the checkpoint's: " + ", ".join(
            f"{key} {before!r} -> {after!r}" for key, before, after in changes))
    if other_model:
        notes.append(f"written by a run of --model {manifest['model']['name']}, resumed with {engine.model_name}: "
                     "the weights come from the checkpoint, buffers that are not saved (e.g. rotary frequencies) "
                     "from this model")
    if manifest["world_size"] != world:
        if not engine.reshardable:
            raise Fp8distError(
                f"{path}: written by {manifest['world_size']} ranks; this job has {world}, and {engine.engine} "
                f"partitions optimizer states per rank\n  fix: resume with {manifest['world_size']} ranks (or "
                "convert it with DeepSpeed's deepspeed/checkpoint/ds_to_universal.py and load it with "
                "DeepSpeed's universal checkpoint support)")
        notes.append(f"written by {manifest['world_size']} ranks, resumed on {world}: weights and optimizer states "
                     "are resharded; RNG states and per-rank data differ, so the run is not an exact continuation")
    return notes


# --- resuming -----------------------------------------------------------------------------------------

def resume(target, directory: str | os.PathLike, *, model_name: str = "", scheduler=None) -> Resumed | None:
    """Load the newest complete checkpoint under `directory` into `target` (every rank calls it). Returns
    None when there is none yet. Rank 0 decides which checkpoint and checks it; every rank raises the same
    error when it cannot be used, before any weight is read."""
    engine = checkpointing_for(target, model_name=model_name, scheduler=scheduler)
    spec = getattr(getattr(target, "fp8dist_run", target), "spec", None)
    rank, world = _rank_world()

    def decide():
        path = find_latest(directory)
        if path is None:
            return None
        manifest = read_manifest(path)
        config = spec.to_dict() if spec is not None else None
        return str(path), manifest, check_compatible(manifest, path, engine, world, config)

    decided = on_rank_zero(f"resuming from {directory}", decide)
    if decided is None:
        return None
    path, manifest, notes = Path(decided[0]), decided[1], decided[2]
    engine.read(path)
    if manifest["world_size"] == world:
        state = torch.load(path / f"rank-{rank:05d}.pt", weights_only=True)
        _set_rng_state(state.pop("rng"))
        engine.load_rank_state(state)
    else:
        engine.load_rank_state(torch.load(path / "rank-00000.pt", weights_only=True))  # the scaler: the same on all
    _barrier()
    return Resumed(path, manifest["step"], manifest["data_position"], tuple(notes))


def check_run_directory(directory: str | os.PathLike, resuming: bool) -> None:
    """Before the first step (every rank calls it): `directory` must be a directory this job can write (made if
    missing), not one checkpoint, and for a new run hold no checkpoint of an earlier one: the new run's saves
    would interleave with them, and pruning and `--resume` would pick the other run's newer steps."""
    directory = Path(directory)

    def check():
        if (directory / MANIFEST).is_file():
            raise Fp8distError(f"--checkpoint-dir {directory}: names one checkpoint, not the directory of a run"
                               f"\n  fix: pass its parent, {directory.parent}" + (" (--resume then continues from its "
                                                                                 "newest checkpoint)" if resuming else ""))
        if directory.exists() and not directory.is_dir():
            raise Fp8distError(f"--checkpoint-dir {directory}: is a file\n  fix: name a directory")
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".fp8dist-write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise Fp8distError(f"--checkpoint-dir {directory}: cannot write there ({exc.strerror})"
                               "\n  fix: name a directory this job can write, on a filesystem every rank sees") from None
        complete = complete_checkpoints(directory)
        if complete and not resuming:
            raise Fp8distError(f"--checkpoint-dir {directory}: holds checkpoints of an earlier run (newest "
                               f"{complete[-1].name})\n  fix: add --resume to continue that run, or name a new or "
                               "empty directory")

    on_rank_zero(f"--checkpoint-dir {directory}", check)


# --- helpers ------------------------------------------------------------------------------------------

def failure_text(exc: BaseException) -> str:
    """One line for an error while reading or writing a checkpoint; torch.distributed.checkpoint's
    CheckpointException holds each failing rank's own error (`failures`)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:  # rank -> (exception, traceback) in torch 2.13 (api.py)
        errors = {rank: e[0] if isinstance(e, tuple) else e for rank, e in failures.items()}
        return "; ".join(f"rank {rank}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
                         for rank, e in sorted(errors.items()))
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def on_rank_zero(what: str, action):
    """Run `action` on rank 0 only and give its result, or its error, to every rank: a failure there raises the
    same Fp8distError everywhere instead of leaving the other ranks waiting in a collective."""
    rank, world = _rank_world()
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            outcome[0] = ("ok", action())
        except Fp8distError as exc:
            outcome[0] = ("error", str(exc))
        except Exception as exc:  # an OSError, a malformed manifest: said with what was being done
            outcome[0] = ("error", f"{what}: {type(exc).__name__}: {exc}")
    if dist.is_initialized() and world > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0][0] == "error":
        raise Fp8distError(outcome[0][1])
    return outcome[0][1]


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("fp8dist", "torch", "deepspeed", "torchao", "transformers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def _write_file_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
