"""What the commands write: strict JSON, and files written atomically (a reader never sees half a file, an error
leaves none)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from fp8dist.errors import Fp8distError


def dump_json(document: Any) -> str:
    """JSON text for stdout or a file; NaN and Infinity are refused (they are not JSON)."""
    return json.dumps(document, indent=2, sort_keys=False, allow_nan=False) + "\n"


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` so that a reader never sees half a file and an error leaves none."""
    target = Path(path)
    if target.is_dir():
        raise Fp8distError(f"-o {path}: is a directory; name a file")
    if not target.parent.exists():
        raise Fp8distError(f"-o {path}: directory {target.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def emit(text: str, output: str | None) -> None:
    """`text` to `output` (atomically) or to stdout."""
    if output:
        write_atomic(output, text)
    else:
        import sys

        sys.stdout.write(text)
