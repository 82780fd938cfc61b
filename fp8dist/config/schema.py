"""The JSON Schema and the presets: finding them, filling defaults, reporting every error at once."""
from __future__ import annotations

import copy
import difflib
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from fp8dist.errors import Issue

SCHEMA_FILE = "fp8dist.schema.json"
# Keys that moved: old dotted path -> new one. An old key is refused with the new name (no silent alias).
# old dotted path -> (new path, how the old values read there)
MOVED_KEYS = {"deepspeed.fp16": ("precision.loss_scaling", "same sub-keys"),
              "fsdp2.reshard_after_forward": ("parallel.sharding", "true is full, false is grad_op"),
              "fsdp2.offload": ("parallel.offload", "cpu is params")}
PRESETS_FILE = "presets.json"


def schema_dir() -> Path:
    """schemas/ ships inside the wheel as the package `fp8dist.schemas` (see pyproject.toml)."""
    return Path(str(resources.files("fp8dist.schemas")))


def read_schema_file(name: str) -> Any:
    return json.loads((schema_dir() / name).read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def _presets() -> dict[str, Any]:
    return read_schema_file(PRESETS_FILE)


def presets() -> dict[str, Any]:
    return copy.deepcopy(_presets())


@lru_cache(maxsize=None)
def _schema() -> dict[str, Any]:
    schema = read_schema_file(SCHEMA_FILE)
    preset = schema["properties"]["precision"]["properties"]["preset"]
    preset["enum"] = [None, *sorted(_presets())]
    return schema


def schema() -> dict[str, Any]:
    """The full schema, with the preset names from presets.json injected."""
    return copy.deepcopy(_schema())


def defaults(node: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every default of the schema, as a nested dict."""
    node = _schema() if node is None else node
    out: dict[str, Any] = {}
    for key, sub in node.get("properties", {}).items():
        if sub.get("type") == "object" and "properties" in sub:
            out[key] = defaults(sub)
        elif "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
    return out


def _path(parts) -> str:
    return ".".join(str(p) for p in parts)


def _subschema(path: list[Any]) -> dict[str, Any] | None:
    node: Any = _schema()
    for part in path:
        if isinstance(part, int):
            node = node.get("items", {})
            continue
        props = node.get("properties", {})
        if part not in props:
            return None
        node = props[part]
    return node


def _describe_allowed(node: dict[str, Any]) -> str | None:
    if "enum" in node:
        return ", ".join(json.dumps(v) for v in node["enum"])
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        return _describe_allowed(_schema()["$defs"][name])
    return None


def _issues_for(error) -> list[Issue]:
    """Turn one jsonschema error into issues with a path, the value and a fix."""
    path = list(error.absolute_path)
    where = _path(path)
    if error.validator == "additionalProperties":
        known = sorted(error.schema.get("properties", {}))
        out = []
        for key in sorted(set(error.instance) - set(known)):
            moved = MOVED_KEYS.get(_path(path + [key]))
            if moved:
                new, how = moved
                out.append(Issue(_path(path + [key]), f"this key moved to `{new}` ({how})",
                                 fix=f"write it as {new}"))
                continue
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`?" if close else f"known keys here: {', '.join(known)}"
            out.append(Issue(_path(path + [key]), "unknown key", fix=f"remove it; {hint}"))
        return out
    if error.validator in ("enum", "const") or (error.validator == "anyOf" and _subschema(path)):
        node = _subschema(path) or error.schema
        allowed = _describe_allowed(node) or _describe_allowed(error.schema)
        if error.validator == "anyOf" and allowed is None:
            return [Issue(where, "value does not match any allowed form", error.instance, fix=passing_value(node))]
        return [Issue(where, "value not allowed", error.instance,
                      fix=f"use one of: {allowed}" if allowed else None)]
    if error.validator == "type":
        expected = error.validator_value
        expected = expected if isinstance(expected, str) else " or ".join(expected)
        return [Issue(where, f"wrong type, expected {expected}", error.instance,
                      fix=_describe_fix(path))]
    return [Issue(where, error.message, error.instance, fix=_describe_fix(path))]


def _describe_fix(path: list[Any]) -> str | None:
    node = _subschema(path)
    return passing_value(node) if node else None


def passing_value(node: dict[str, Any]) -> str:
    """A fix that names values which pass `node`: its allowed values, or its form with the bounds and, where the
    schema has one, the default as an example ("write a number > 0, e.g. 0.001 (the default)")."""
    allowed = _describe_allowed(node)
    if allowed:
        return f"use one of: {allowed}"
    example = f", e.g. {json.dumps(node['default'])} (the default)" if "default" in node else ""
    return f"write {_form(node)}{example}"


_NOUNS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
          "null": "null", "object": "a mapping of keys to values"}


def _form(node: dict[str, Any]) -> str:
    """What values pass `node`, in words: its type with the bounds the schema sets."""
    if "$ref" in node:
        return _form(_schema()["$defs"][node["$ref"].rsplit("/", 1)[-1]])
    if "const" in node:
        return json.dumps(node["const"])
    if "enum" in node:
        return "one of " + ", ".join(json.dumps(value) for value in node["enum"])
    if "anyOf" in node:
        return " or ".join(_form(option) for option in node["anyOf"])
    types = node.get("type", [])
    forms = [_typed_form(kind, node) for kind in ([types] if isinstance(types, str) else types)]
    return " or ".join(forms) or "a JSON value"


def _typed_form(kind: str, node: dict[str, Any]) -> str:
    if kind in ("integer", "number"):
        bounds = [f"{sign} {json.dumps(node[key])}" for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                                      ("maximum", "<="), ("exclusiveMaximum", "<"))
                  if key in node]
        return " ".join([_NOUNS[kind], " and ".join(bounds)]).strip()
    if kind == "string" and node.get("minLength"):
        return "a non-empty string"
    if kind == "array":
        low, high = node.get("minItems"), node.get("maxItems")
        size = (f" of {low} items" if low is not None and low == high else
                f" of at least {low} item{'s' if low > 1 else ''}" if low else "")
        each = f", each {_form(node['items'])}" if isinstance(node.get("items"), dict) and node["items"] else ""
        return f"a list{size}{each}"
    return _NOUNS.get(kind, kind)


def validate(document: Any) -> list[Issue]:
    """All schema violations of `document`, sorted by path."""
    from jsonschema import Draft202012Validator  # jsonschema is light; imported late all the same

    validator = Draft202012Validator(_schema())
    issues: list[Issue] = []
    for error in validator.iter_errors(document):
        issues.extend(_issues_for(error))
    unique = {(i.path, i.message): i for i in issues}
    return sorted(unique.values(), key=lambda i: i.path)
