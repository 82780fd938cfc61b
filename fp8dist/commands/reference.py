"""The config reference as Markdown (`fp8dist schema --format markdown`, committed as docs/config.md): every key of
the schema with its values, default and meaning; the documented dtype tables with their public sources; and per
preset the dtype each audit phase expects on each engine, derived by the audit's own rules (audit/expected.py).
Pure: no torch. tests/unit/config/test_config_reference.py keeps docs/config.md equal to this output."""
from __future__ import annotations

import json
import re
from typing import Any

import fp8dist.config.schema as schema
from fp8dist.audit.expected import PHASES, expected, tables
from fp8dist.config.load import load_config
from fp8dist.errors import Fp8distError

COMMAND = "fp8dist schema --format markdown > docs/config.md"
ENGINES = ("fsdp2", "deepspeed")


def _value(value: Any) -> str:
    """A value as it is written in a YAML config."""
    return "null" if value is None else json.dumps(value) if not isinstance(value, str) else value


def _cell(text: str) -> str:
    """Text for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _code(values) -> str:
    return ", ".join(f"`{_value(v)}`" for v in values)


def _bounds(node: dict) -> str:
    low = (f">= {node['minimum']}" if "minimum" in node else
           f"> {node['exclusiveMinimum']}" if "exclusiveMinimum" in node else "")
    high = (f"<= {node['maximum']}" if "maximum" in node else
            f"< {node['exclusiveMaximum']}" if "exclusiveMaximum" in node else "")
    return " and ".join(part for part in (low, high) if part)


def values(node: dict, defs: dict) -> str:
    """What a key accepts, from its schema node."""
    if "$ref" in node:
        return values(defs[node["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in node:
        return " or ".join(values(option, defs) for option in node["anyOf"])
    if "const" in node:
        return _code([node["const"]])
    if "enum" in node:
        return _code(node["enum"])
    kinds = node.get("type", "any")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    described = []
    for kind in kinds:
        if kind == "null":
            described.append("`null`")
        elif kind == "boolean":
            described.append("`true`, `false`")
        elif kind == "array":
            described.append(_list(node, defs))
        elif kind == "object":
            described.append("map of keys to values")
        else:
            described.append(" ".join(part for part in (kind, _bounds(node)) if part))
    return " or ".join(described)


def _list(node: dict, defs: dict) -> str:
    """'list of 2 numbers, each >= 0 and < 1', 'list of strings (at least one)', 'list of values'."""
    items, low, high = node.get("items"), node.get("minItems"), node.get("maxItems")
    if not items:
        what = "values"
    elif isinstance(items.get("type"), str) and not {"enum", "const", "anyOf", "$ref"} & set(items):
        what = f"{items['type']}s" + (f", each {_bounds(items)}" if _bounds(items) else "")
    else:
        what = f"values, each {values(items, defs)}"
    if low is not None and low == high:
        return f"list of {low} {what}"
    return f"list of {what}" + (f" (at least {low})" if low else "")


def _sections(node: dict, path: str = "") -> list[tuple[str, dict, list[tuple[str, dict]]]]:
    """(section path, section node, its keys that are not sections themselves), depth first."""
    keys, nested = [], []
    for key, sub in node["properties"].items():
        dotted = f"{path}.{key}" if path else key
        if sub.get("type") == "object" and "properties" in sub:
            nested += _sections(sub, dotted)
        else:
            keys.append((dotted, sub))
    return [(path, node, keys)] + nested


def _link_tables(text: str) -> str:
    """'Table A row ...' in a preset's description -> a link to the table below."""
    return re.sub(r"\b[Tt]able ([AB])\b", lambda m: f"[table {m.group(1)}](#table-{m.group(1).lower()})", text)


def keys_section(document: dict) -> list[str]:
    defs = document.get("$defs", {})
    lines = ["## Keys", ""]
    for path, node, keys in _sections(document):
        lines += [f"### `{path}`", "", node["description"], ""] if path else ["### Top level", ""]
        if keys:
            lines += ["| key | values | default | meaning |", "|---|---|---|---|"]
            lines += [f"| `{key}` | {_cell(values(sub, defs))} | `{_cell(_value(sub.get('default')))}` | "
                      f"{_cell(sub.get('description', ''))} |" for key, sub in keys] + [""]
    return lines


def tables_section() -> list[str]:
    lines = ["## The documented dtype tables", "",
             "The presets reproduce these rows; the audit derives its expectation for any config by the same rules "
             "(a unit test checks that every row below comes out of its preset and engine). `n/a`: no separate "
             "copy. `a+b`: Adam's two states (first moment + second moment).", ""]
    for letter, table in tables().items():
        columns = table["columns"] + [c for row in table["rows"] for c in row["cells"] if c not in table["columns"]]
        columns = list(dict.fromkeys(columns))
        lines += [f'<a id="table-{letter.lower()}"></a>', "", f"### Table {letter}: {table['title']}", "",
                  f"Source: {table['source']}.", "",
                  "| row | preset | engine | " + " | ".join(columns) + " |",
                  "|---|---|---|" + "---|" * len(columns)]
        for row in table["rows"]:
            cells = [row["cells"].get(column, "") for column in columns]
            lines.append(f"| {row['name']} | `{row['preset']}` | {row['engine']} | " + " | ".join(cells) + " |")
        added = [row for row in table["rows"] if "source" in row]
        lines += [""] + [f"- {row['name']}: {row['source']}." for row in added] + ([""] if added else [])
    return lines


def _flatten(document: dict, path: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in document.items():
        dotted = f"{path}.{key}" if path else key
        out += _flatten(value, dotted) if isinstance(value, dict) and value else [(dotted, value)]
    return out


def _expected_per_engine(name: str) -> dict[str, dict[str, tuple[str, str]] | str]:
    """engine -> {phase: (dtype, why)} on 2 ranks, or why the preset is refused on that engine."""
    out: dict[str, dict[str, tuple[str, str]] | str] = {}
    for engine in ENGINES:
        try:
            out[engine] = expected(load_config({"engine": engine, "precision": {"preset": name}}), nproc=2)
        except Fp8distError as exc:
            issues = getattr(exc, "issues", [])
            out[engine] = "refused: " + ("; ".join(issue.message for issue in issues) or str(exc).splitlines()[0])
    return out


def presets_section() -> list[str]:
    lines = ["## Presets and what the audit expects of them", "",
             "`precision.preset: NAME` sets the keys listed; keys you write yourself win. Each table gives the dtype "
             "`fp8dist audit` (and `fp8dist.audit.watch`) expects in each phase of a 2-rank run with that preset "
             "and otherwise default keys, on each engine, and why. The phases:", "",
             "| phase | what is measured |", "|---|---|"]
    lines += [f"| `{phase}` | {_cell(meaning)} |" for phase, meaning in PHASES.items()]
    lines.append("")
    for name, preset in schema.presets().items():
        sets = ", ".join(f"`{key}: {_value(value)}`" for key, value in _flatten(preset["values"]))
        lines += [f"### `{name}`", "", _link_tables(preset["description"]), "",
                  f"Source: {preset['source']}.", "", f"Sets: {sets}.", ""]
        per_engine = _expected_per_engine(name)
        refused = {engine: why for engine, why in per_engine.items() if isinstance(why, str)}
        runs = {engine: rows for engine, rows in per_engine.items() if not isinstance(rows, str)}
        lines += ["| phase | " + " | ".join(runs) + " | why |", "|---|" + "---|" * len(runs) + "---|"]
        for phase in PHASES:
            cells = {engine: rows.get(phase) for engine, rows in runs.items()}
            if not any(cells.values()):
                continue
            whys = list(dict.fromkeys(cell[1] for cell in cells.values() if cell))
            why = whys[0] if len(whys) == 1 else "; ".join(f"{engine}: {cell[1]}" for engine, cell in cells.items()
                                                           if cell)
            lines.append(f"| `{phase}` | " + " | ".join(cell[0] if cell else "-" for cell in cells.values())
                         + f" | {_cell(why)} |")
        lines += [""] + [f"On {engine}: {_cell(why)}" for engine, why in refused.items()] + ([""] if refused else [])
    return lines


def markdown() -> str:
    document = schema.schema()
    lines = ["# Config reference", "",
             f"Generated by `{COMMAND}` from the JSON Schema (`fp8dist schema`), the presets (`fp8dist presets`) and "
             "the audit's expected dtypes; a unit test fails when this file and that output differ. Which values "
             "run for real on 2 ranks in the tests and which are refused, and why: [options.md](options.md).", "",
             document["description"], "",
             "Contents: [keys](#keys), [the documented dtype tables](#the-documented-dtype-tables), "
             "[presets and what the audit expects of them](#presets-and-what-the-audit-expects-of-them).", ""]
    lines += keys_section(document) + tables_section() + presets_section()
    return "\n".join(lines).rstrip("\n") + "\n"
