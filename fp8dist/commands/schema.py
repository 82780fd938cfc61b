"""`fp8dist schema` (the JSON Schema of the config) and `fp8dist presets` (the named presets)."""
from __future__ import annotations

import sys

import fp8dist.config.schema as schema
from fp8dist.commands.output import dump_json
from fp8dist.errors import ExitCode


def run_schema(args) -> int:
    sys.stdout.write(dump_json(schema.schema()))
    return ExitCode.OK


def run_presets(args) -> int:
    for name, preset in schema.presets().items():
        print(f"{name:24s} {preset['description']}")
    return ExitCode.OK
