"""Where a checkpoint's files are, which directories count as checkpoints, and which run wrote each.

    DIR/step-00000004/                 one complete checkpoint (the step count it was taken after)
        fp8dist-checkpoint.json        the manifest: written last, so its presence means "complete"
        hf/config.json                 the model's Hugging Face config (what `fp8dist export` needs)
        rank-00000.pt ...              per rank: RNG states, the fp16 loss scaler, the LR scheduler
        dcp/ | deepspeed/              the engine's own files (torch.distributed.checkpoint / engine.save_checkpoint)
    DIR/.step-00000006.partial/        a save in progress, or one a crash interrupted: never loaded
    DIR/.step-00000006.replaced/       a complete checkpoint of the same step, moved aside while it is saved again

A manifest names the run that wrote it (`run`: an id a fresh run draws at its first save and a resumed run takes
from the checkpoint it resumed), so a directory holding checkpoints of two runs is told apart from one run's
history; checkpoints written before fp8dist recorded it have none (`run_of` gives None).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import AbstractSet, Any

from fp8dist.engines.checkpoint.files import fsync_dir
from fp8dist.errors import Fp8distError

MANIFEST = "fp8dist-checkpoint.json"
FORMAT = 1
RUN = "run"  # the manifest key of the id of the run that wrote the checkpoint
HF_CONFIG_DIR = "hf"
_COMPLETE = re.compile(r"^step-(\d{8})$")
_PARTIAL = re.compile(r"^\.step-(\d{8})\.partial$")
_LEFTOVER = re.compile(r"^\.step-(\d{8})\.(partial|replaced)$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_path(directory: Path, step: int) -> Path:
    """Where the save of `step` is written until it is complete."""
    return directory / f".{step_name(step)}.partial"


def rank_file(rank: int) -> str:
    """The name of the file of what `rank` keeps beside model and optimizer."""
    return f"rank-{rank:05d}.pt"


def make_complete(partial: Path, final: Path) -> None:
    """Give the finished save `partial` its complete name `final` (one atomic rename on a POSIX filesystem). A
    checkpoint already at `final` (the same step saved again) is moved aside first and deleted last, so a crash
    keeps one of the two."""
    directory = final.parent
    replaced = directory / f".{final.name}.replaced"
    if final.exists():
        os.rename(final, replaced)
    os.rename(partial, final)
    fsync_dir(directory)
    shutil.rmtree(replaced, ignore_errors=True)


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


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first."""
    found = [(int(match.group(1)), p) for p in directory.iterdir()
             if (match := _COMPLETE.match(p.name)) and (p / MANIFEST).is_file()]
    return [path for _, path in sorted(found)]


def find_latest(directory: str | os.PathLike[str]) -> Path | None:
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
        _refuse_mixed_runs(directory, complete)
        return complete[-1]
    ours = [p.name for p in directory.iterdir() if _PARTIAL.match(p.name) or _COMPLETE.match(p.name)]
    others = [p.name for p in directory.iterdir() if p.name not in ours]
    if others and not ours:
        raise Fp8distError(f"{directory}: not an fp8dist checkpoint directory (it holds {', '.join(sorted(others)[:5])}"
                           f"{' ...' if len(others) > 5 else ''}, and no step-NNNNNNNN checkpoint)"
                           "\n  fix: pass the --checkpoint-dir of an earlier run (it holds step-NNNNNNNN "
                           "checkpoints); a new run needs a new or empty directory")
    return None


def run_of(manifest: dict[str, Any]) -> str | None:
    """The id of the run that wrote a checkpoint; None for one written before fp8dist recorded it."""
    value = manifest.get(RUN)
    return value if isinstance(value, str) else None


def describe_run(manifest: dict[str, Any]) -> str:
    """A checkpoint's run in words: 'run 3f2a9c1e07b4 (tiny-qwen2, adapter lora, fsdp2 on 2 rank(s), saved
    2025-01-02T03:04:05Z)'; what the manifest does not hold is left out."""
    run = run_of(manifest)
    config = manifest.get("config")
    adapter = (config.get("adapter") if isinstance(config, dict) else None) or {}
    kind, base = adapter.get("kind", "none"), adapter.get("base_dtype")
    engine, world = manifest.get("engine"), manifest.get("world_size")
    facts = [str((manifest.get("model") or {}).get("name") or ""),  # what the manifest holds, the rest left out
             (f"adapter {kind}" + (f" on an {base.upper()} base" if base == "nf4" else "")
              if kind not in ("none", None) else ""),
             f"{engine} on {world} rank(s)" if engine and world else "",
             f"saved {manifest['saved_at']}" if manifest.get("saved_at") else ""]
    said = ", ".join(fact for fact in facts if fact)
    return f"{f'run {run}' if run else 'a run without a recorded id'}{f' ({said})' if said else ''}"


def peek_manifest(path: Path) -> dict[str, Any]:
    """A complete checkpoint's manifest as it stands (its files are not checked: read_manifest does that before
    anything is loaded); {} where it cannot be read."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def foreign_checkpoints(directory: Path, ours: AbstractSet[str | None] = frozenset()) -> list[Path]:
    """The complete checkpoints in `directory` that another run wrote: those whose run is not in `ours` (the ids a
    run writes and continues; None among them where it continues a checkpoint without an id). A run that has
    neither saved nor resumed yet passes nothing: every checkpoint there is another run's. Oldest first."""
    if not directory.is_dir():
        return []
    return [path for path in complete_checkpoints(directory) if run_of(peek_manifest(path)) not in ours]


def another_run(where: str, foreign: list[Path], fix: str) -> Fp8distError:
    """The refusal of a save into, or a new run in, a directory (`where`: how the caller names it) holding
    `foreign`, another run's checkpoints: its saves would interleave with them, and a resume or `fp8dist export` of
    the directory would take the newest step, whichever run wrote it."""
    newest = foreign[-1]
    return Fp8distError(f"{where}: holds checkpoints of an earlier run (newest {newest.name}), "
                        f"{describe_run(peek_manifest(newest))}; this run's saves there would mix with them, and a "
                        f"resume or `fp8dist export` of the directory would take the newest step of either run"
                        f"\n  fix: {fix}")


def _refuse_mixed_runs(directory: Path, complete: list[Path]) -> None:
    """A directory whose complete checkpoints were written by more than one identified run has no newest checkpoint
    to resume or export: the newest step may be the other run's."""
    newest: dict[str, Path] = {}
    for path in complete:
        run = run_of(peek_manifest(path))
        if run is None and newest:  # an unidentified checkpoint after an identified one: written by another run
            run = f"without a recorded id ({path.name})"  # (this fp8dist records an id in every checkpoint it writes)
        if run is not None:
            newest[run] = path  # oldest first: the last one seen is the run's newest
    if len(newest) > 1:
        runs = "; ".join(f"{path.name}: {describe_run(peek_manifest(path))}"
                         for path in sorted(newest.values(), key=lambda p: p.name))
        raise Fp8distError(f"{directory}: holds checkpoints of {len(newest)} runs (the newest of each: {runs}), so "
                           f"its newest checkpoint is not one run's\n  fix: name the checkpoint itself "
                           f"({directory / sorted(newest.values(), key=lambda p: p.name)[-1].name}, say), or move "
                           "each run's step-NNNNNNNN directories into a directory of their own")


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
