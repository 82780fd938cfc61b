"""What fp8dist writes gets the permissions of any file the user makes: the umask's, not a temporary file's.

Atomic writers make a private temporary file or directory (tempfile.mkstemp / mkdtemp: mode 0600 / 0700) and rename
it into place, and safetensors 0.8's save_file writes its files 0600 as well (transformers' and PEFT's save_pretrained
with it); renamed as they are, an exported model or a written config could not be read by the rest of a cluster.
`share` gives them the mode `open()` / `mkdir()` would have: 0666 / 0777 less the umask.
"""
from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status, Linux 4.7+; setting it
    to read it back would be seen by another thread creating a file at that moment)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share(path: str | os.PathLike) -> None:
    """Give `path` the mode a new file (0666) or directory (0777) gets under the umask; a directory's whole tree."""
    mask = umask()
    root = Path(path)
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    for item in paths:
        if not item.is_symlink():
            os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)
