"""Other tools' config files -> an fp8dist config (pure: no torch, no accelerate import).

    fp8dist import FILE [--from accelerate|axolotl|deepspeed]

One module per source format (accelerate.py, axolotl.py, deepspeed.py); each turns the parsed file into an
fp8dist document plus notes: one comment line per source key that has no fp8dist meaning, and one per
`"auto"` (or left-out key that matters to precision) saying what DeepSpeed or Accelerate would actually use.
Files are read with the loader's safety (fp8dist/config/load.py: size cap, no binary, no YAML tags, bounded
nesting and aliases); JSON the same way (size, binary, depth, duplicate keys). The result is validated like any
config before it is printed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fp8dist.config import load
from fp8dist.errors import ConfigError, Fp8distError, Issue

KINDS = ("accelerate", "axolotl", "deepspeed")
_TITLE = {"accelerate": "Accelerate config", "axolotl": "Axolotl config", "deepspeed": "DeepSpeed config"}


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
        what = f" ({_TITLE[kind]})" if kind else ""
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


# -- kinds ---------------------------------------------------------------------------------------------------
_DEEPSPEED_KEYS = {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "bf16", "fp16",
                   "bfloat16", "torch_autocast", "communication_data_type", "gradient_clipping", "optimizer", "scheduler",
                   "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "msamp", "amp"}
_ACCELERATE_KEYS = {"compute_environment", "distributed_type"}
_AXOLOTL_KEYS = {"base_model", "datasets", "micro_batch_size", "sequence_len", "fp8", "fsdp_version",
                 "fp8_enable_fsdp_float8_all_gather", "adapter", "num_epochs", "output_dir", "torch_compile",
                 "special_tokens", "load_in_8bit", "load_in_4bit", "lora_r", "flash_attention", "fsdp", "fsdp_config",
                 "deepspeed", "gradient_checkpointing", "val_set_size", "chat_template", "learning_rate", "optimizer",
                 "lr_scheduler", "bf16", "fp16", "tf32"}


def detect(document: Mapping[str, Any]) -> str | None:
    """accelerate | axolotl | deepspeed | fp8dist, from the top-level keys; None when nothing matches."""
    keys = set(document)
    if keys & _ACCELERATE_KEYS:
        return "accelerate"
    if keys & {"precision", "engine"}:
        return "fp8dist"
    if keys & (_AXOLOTL_KEYS - _DEEPSPEED_KEYS):
        return "axolotl"
    return "deepspeed" if keys & _DEEPSPEED_KEYS else None


def import_file(path: str | Path, kind: str | None = None) -> str:
    """The fp8dist YAML (comment lines first) for a file of `kind` (detected when None); validated."""
    source = str(path)
    document, text = read_document(path)
    if not isinstance(document, Mapping):
        what = "a list" if isinstance(document, list) else f"a {type(document).__name__}"
        raise ImportProblem([Issue("", f"the top level must be a mapping, not {what}",
                                   fix="pass an Accelerate config.yaml, an Axolotl YAML or a DeepSpeed JSON")], source)
    found = detect(document)
    if kind is None:
        if found == "fp8dist":
            raise ImportProblem([Issue("", "this is already an fp8dist config", fix=f"fp8dist validate {source}")],
                                source)
        if found is None:
            raise ImportProblem([Issue("", "cannot tell which kind of file this is (no key of an Accelerate config, "
                                       "an Axolotl config or a DeepSpeed config)", sorted(document)[:8],
                                       "say it with --from accelerate|axolotl|deepspeed")], source)
        kind = found
    if kind not in KINDS:
        raise ImportProblem([Issue("--from", f"unknown kind; one of {', '.join(KINDS)}", kind)], source)
    imported = convert(kind, document, text, source)
    try:
        load.resolve(imported.document, source)
    except ConfigError as exc:
        raise ImportProblem([Issue(i.path, f"the imported config is refused by fp8dist: {i.message}", i.value, i.fix)
                             for i in exc.issues], source, kind) from None
    return render(imported, source)


def convert(kind: str, document: Mapping[str, Any], text: str, source: str) -> Imported:
    if kind == "accelerate":
        from fp8dist.importers.accelerate import convert as run
    elif kind == "axolotl":
        from fp8dist.importers.axolotl import convert as run
    else:
        from fp8dist.importers.deepspeed import convert as run
    try:
        return run(dict(document), text, source)
    except ImportProblem:
        raise
    except WrongShape as exc:
        raise ImportProblem([Issue(exc.key, f"must be {exc.want}", exc.value,
                                   f"write {exc.want} there, as the tool documents it")], source, kind) from None
    except (AttributeError, TypeError, ValueError, KeyError) as exc:  # a value of the wrong shape somewhere
        raise ImportProblem([Issue("", f"a value has the wrong type or shape for an {_TITLE[kind]} "
                                   f"({type(exc).__name__}: {exc})", fix="compare the file with the tool's documented "
                                   "format (sections are mappings, flags true/false, sizes numbers)")],
                            source, kind) from None


def render(imported: Imported, source: str) -> str:
    import yaml

    lines = [f"# fp8dist config imported from {source} ({_TITLE[imported.kind]}) by `fp8dist import`."]
    lines += [f"# {' '.join(note.split())}" for note in imported.notes]
    body = yaml.safe_dump(imported.document, sort_keys=False, default_flow_style=False, width=4096)
    return "\n".join(lines) + "\n" + body


# -- shared value readers ------------------------------------------------------------------------------------
_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "fp16": "fp16",
           "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "bf16": "bf16", "bfloat16": "bf16",
           "bfp16": "bf16", "torch.bfloat16": "bf16"}


def dtype_name(value: Any) -> str | None:
    return _DTYPES.get(str(value).lower()) if value is not None else None


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
