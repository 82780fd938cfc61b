"""What the commands write: strict JSON, and files written atomically (a reader never sees half a file, an error
leaves none) with the permissions the umask gives any new file."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from fp8dist.errors import Fp8distError
from fp8dist.runtime.files import share


def dump_json(document: Any) -> str:
    """JSON text for stdout or a file. A value JSON cannot hold (NaN, infinity, a date) is refused, never written:
    the config reader lets none through, so this guards the translators."""
    try:
        return json.dumps(document, indent=2, sort_keys=False, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise Fp8distError(f"cannot write the output as JSON: {exc}\n  fix: report this; the config held a value "
                           "JSON cannot carry") from None


def check_output(path: str) -> Path:
    """The -o target as a Path, or an error naming it, before anything is written: a file name in an existing
    folder."""
    target = Path(path)
    try:
        if target.is_dir():
            raise _output_error(path, "is a directory", "name a file")
        if not target.parent.is_dir():
            why = f"{target.parent} is not a folder" if target.parent.exists() else \
                f"folder {target.parent} does not exist"
            raise _output_error(path, why, "write into an existing folder")
    except OSError as exc:
        raise _output_error(path, exc.strerror or str(exc), "check the path") from None
    return target


def _output_error(path: str, why: str, fix: str) -> Fp8distError:
    return Fp8distError(f"-o {path}: {why}; nothing written\n  fix: {fix}")


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` so that a reader never sees half a file and an error leaves none (a temporary file
    with a short name beside it, then renamed)."""
    target = check_output(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".fp8dist-", suffix=".partial", dir=target.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        share(tmp)  # mkstemp's file is 0600: the written file gets the umask's mode, as open() would give it
        os.replace(tmp, target)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _output_error(path, exc.strerror or str(exc), "check the path and that you may write there") \
                from None
        raise


def emit(text: str, output: str | None) -> None:
    """`text` to `output` (atomically) or to stdout."""
    if output:
        write_atomic(output, text)
    else:
        import sys

        sys.stdout.write(text)
