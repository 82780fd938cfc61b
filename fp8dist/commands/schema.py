"""`fp8dist schema` (the JSON Schema of the config, or the readable reference: docs/config.md) and `fp8dist presets`
(the named presets)."""
from __future__ import annotations

import sys

import fp8dist.config.schema as schema
from fp8dist.commands.output import dump_json
from fp8dist.errors import ExitCode

TABLES_AT = ("Their rows, and the dtypes each preset makes the audit expect: docs/config.md (or `fp8dist schema "
             "--format markdown`).")


def run_schema(args) -> int:
    if args.format == "markdown":
        from fp8dist.commands.reference import markdown

        sys.stdout.write(markdown())
    else:
        sys.stdout.write(dump_json(schema.schema()))
    return ExitCode.OK


def run_presets(args) -> int:
    from fp8dist.audit.expected import tables

    for name, preset in schema.presets().items():
        print(f"{name:24s} {preset['description']}")
    print("\nThe tables the presets reproduce (the dtype of each phase of a run, as the sources document them):")
    for letter, table in tables().items():
        print(f"  Table {letter}: {table['title']}. Source: {table['source']}.")
    print(TABLES_AT)
    return ExitCode.OK
