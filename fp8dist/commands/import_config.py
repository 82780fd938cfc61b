"""`fp8dist import FILE [--from accelerate|axolotl|deepspeed|trl|peft] [-o FILE]`: another tool's config as an fp8dist
config (fp8dist.formats)."""
from __future__ import annotations

from fp8dist.commands.output import emit
from fp8dist.errors import ExitCode
from fp8dist.formats.importing import import_file


def run(args) -> int:
    emit(import_file(args.file, args.kind), args.output)
    return ExitCode.OK
