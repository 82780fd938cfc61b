"""What the importers of other tools' files share (pure: no torch, no accelerate import): reading a YAML or JSON
file with the loader's safety (fp8dist/config/load.py: size cap, no binary, no YAML tags, bounded nesting and
aliases; JSON the same way: size, binary, depth, duplicate keys), the notes an import writes, its refusal, and the
value readers. The importers themselves: fp8dist.formats.{accelerate,axolotl,deepspeed}.importer; the dispatch:
fp8dist.formats.importing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import fp8dist.config.load as load
import fp8dist.dtypes as dtypes
from fp8dist.errors import ConfigError, Fp8distError, Issue

KINDS = ("accelerate", "axolotl", "deepspeed")
TITLE = {"accelerate": "Accelerate config", "axolotl": "Axolotl config", "deepspeed": "DeepSpeed config"}


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


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- reading -------------------------------------------------------------------------------------------------
def read_json_text(text: str, source: str) -> Any:
    """JSON with the loader's bounds: duplicate keys refused, nesting bounded, errors without a traceback."""
    def pairs(items):
        seen = {}
        for key, value in items:
            if key in seen:
                raise ImportProblem([Issue(key, "duplicate key", fix="keep one of them")], source)
            seen[key] = value
        return seen

    try:
        document = json.loads(text, object_pairs_hook=pairs)
    except RecursionError:
        raise ImportProblem([Issue("", f"nesting deeper than {load.MAX_DEPTH} levels",
                                   fix="a config is a few levels deep; check the file")], source) from None
    except json.JSONDecodeError as exc:
        raise ImportProblem([Issue("", f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                                   fix="fix the JSON syntax")], source) from None
    _check_depth(document, source)
    return document


def _check_depth(document: Any, source: str) -> None:
    stack = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > load.MAX_DEPTH:
            raise ImportProblem([Issue("", f"nesting deeper than {load.MAX_DEPTH} levels",
                                       fix="a config is a few levels deep; check the file")], source)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def read_document(path: str | Path) -> tuple[Any, str]:
    """(parsed document, raw text) of a YAML or JSON file, refused like the loader refuses a hostile config."""
    source = str(path)
    try:
        text = load.read_text(path)
    except ConfigError as exc:
        raise ImportProblem(exc.issues, source) from None
    stripped = text.lstrip()
    if source.endswith(".json") or stripped.startswith(("{", "[")):
        return read_json_text(text, source), text
    try:
        return load.parse_yaml(text, source), text
    except ConfigError as exc:
        raise ImportProblem(exc.issues, source) from None


def read_beside(path: str, base: Path, key: str, source: str) -> tuple[Any, str]:
    """A file another config names (a DeepSpeed JSON): relative paths from the launch directory, else beside it."""
    candidates = [Path(path)] if Path(path).is_absolute() else [Path(path), base / path]
    for candidate in candidates:
        if candidate.is_file():
            document, _ = read_document(candidate)
            return document, str(candidate)
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
