"""Where a checkpoint's files are, and which directories count as checkpoints.

    DIR/step-00000004/                 one complete checkpoint (the step count it was taken after)
        fp8dist-checkpoint.json        the manifest: written last, so its presence means "complete"
        hf/config.json                 the model's Hugging Face config (what `fp8dist export` needs)
        rank-00000.pt ...              per rank: RNG states, the fp16 loss scaler, the LR scheduler
        dcp/ | deepspeed/              the engine's own files (torch.distributed.checkpoint / engine.save_checkpoint)
    DIR/.step-00000006.partial/        a save in progress, or one a crash interrupted: never loaded
    DIR/.step-00000006.replaced/       a complete checkpoint of the same step, moved aside while it is saved again
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from fp8dist.engines.checkpoint.files import fsync_dir
from fp8dist.errors import Fp8distError

MANIFEST = "fp8dist-checkpoint.json"
FORMAT = 1
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
