"""Writes that a crash cannot leave half done: a file replaced whole, a directory's entries made durable.

POSIX promises that rename(2) replaces its target atomically; fsync(2) of a file and of its directory makes the
new contents and the new name survive a power loss (the directory's own fsync is what persists a rename).
"""
from __future__ import annotations

import os
from pathlib import Path


def write_file_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it, synced, then renamed over `path`: a reader sees
    the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def fsync_dir(directory: Path) -> None:
    """Make the renames and new entries of `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
