"""What the importers of other tools' files share (pure: no torch, no accelerate import): reading a YAML or JSON
file with the loader's safety (fp8dist/config/reading.py: regular files only, size cap, no binary, no YAML tags,
bounded nesting and aliases, plain data; JSON the same way), the notes an import writes, its refusal, and the
value readers. The importers themselves: fp8dist.formats.{accelerate,axolotl,deepspeed,trl,peft}.importer; the dispatch:
fp8dist.formats.importing.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import fp8dist.config.reading as reading
import fp8dist.dtypes as dtypes
from fp8dist.errors import ConfigError, Fp8distError, Issue

KINDS = ("accelerate", "axolotl", "deepspeed", "trl", "peft")
TITLE = {"accelerate": "Accelerate config", "axolotl": "Axolotl config", "deepspeed": "DeepSpeed config",
         "trl": "TRL / alignment-handbook recipe", "peft": "PEFT adapter_config.json"}


class WrongShape(Exception):
    """A source key holds a value of the wrong type; convert() turns it into an ImportProblem naming the key."""

    def __init__(self, key: str, value: Any, want: str):
        super().__init__(key)
        self.key, self.value, self.want = key, value, want


def mapping(value: Any, key: str) -> dict[str, Any]:
    """A section that must be a mapping (None: empty)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise WrongShape(key, value, "a mapping")
    return dict(value)


def integer(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().lstrip("-").isdigit():
        raise WrongShape(key, value, "an integer")
    return int(value)


class ImportProblem(Fp8distError):
    """The file cannot be imported: every problem, each naming the source key, why, and the fix (exit 2)."""

    def __init__(self, issues: list[Issue], source: str, kind: str | None = None):
        self.issues, self.source = list(issues), source
        what = f" ({TITLE[kind]})" if kind else ""
        lines = [f"cannot import {source}{what}: {len(self.issues)} problem(s)"]
        lines += [f"  - {issue.render()}" for issue in self.issues]
        super().__init__("\n".join(lines))


@dataclass
class Imported:
    kind: str
    document: dict[str, Any]
    notes: list[str] = field(default_factory=list)


class Notes(list):
    """Comment lines of the output: keys with no fp8dist meaning, and resolved "auto" / left-out values."""

    def dropped(self, key: str, value: Any, why: str) -> None:
        self.append(f"not kept: {key}: {_short(value)} - {why}")

    def auto(self, key: str, resolved: Any, why: str) -> None:
        self.append(f"auto: {key} -> {_short(resolved)} ({why})")

    def resolved(self, key: str, resolved: Any, why: str) -> None:
        self.append(f"resolved: {key} -> {_short(resolved)} ({why})")


def comment_line(text: str) -> str:
    """`text` as one YAML comment line: whitespace runs (line breaks included) become one space, and a character
    YAML cannot hold in a comment (a control character from a file name, a key or a value) is written as its
    escape."""
    flat = " ".join(text.split())
    return "# " + "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in flat)


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- reading -------------------------------------------------------------------------------------------------
def _as_import_problem(read, source: str):
    """What `read` returns; a refusal of fp8dist.config.reading as this import's problem (same issues)."""
    try:
        return read()
    except ConfigError as exc:
        raise ImportProblem(exc.issues, source) from None


def read_json_text(text: str, source: str) -> Any:
    """JSON with the loader's bounds (fp8dist.config.reading.parse_json)."""
    return _as_import_problem(lambda: reading.parse_json(text, source), source)


def read_document(path: str | Path) -> tuple[Any, str]:
    """(parsed document, raw text) of a YAML or JSON file, refused like the loader refuses a hostile config."""
    source = str(path)
    text = _as_import_problem(lambda: reading.read_text(path), source)
    if source.endswith(".json") or text.lstrip().startswith(("{", "[")):
        return read_json_text(text, source), text
    return _as_import_problem(lambda: reading.parse_yaml(text, source), source), text


def read_beside(path: str, base: Path, key: str, source: str) -> tuple[Any, str]:
    """A file another config names (a DeepSpeed JSON): relative paths from the launch directory, else beside it.
    os.path.isfile, as the tools test it: a value that cannot be a path (too long, a NUL byte) is no file."""
    candidates = [path] if os.path.isabs(path) else [path, str(base / path)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            document, _ = read_document(candidate)
            return document, candidate
    raise ImportProblem([Issue(key, "names a file that does not exist (looked in the current directory and beside "
                               f"{source})", path, "give the path of the DeepSpeed JSON, or copy it beside the config")],
                        source)


# -- shared value readers ------------------------------------------------------------------------------------
def dtype_name(value: Any) -> str | None:
    """How the tools spell a dtype ('bfloat16', 'torch.float16', 'half') -> fp8dist's name (fp8dist.dtypes)."""
    return dtypes.from_alias(value)


def truthy(value: Any) -> bool | None:
    """YAML/JSON booleans as the tools write them: true/false, "true"/"false", "yes"/"no", 1/0."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
        return value.lower() in ("true", "yes", "1")
    return None


def set_path(document: dict[str, Any], dotted: str, value: Any) -> None:
    node = document
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
