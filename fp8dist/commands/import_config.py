"""`fp8dist import FILE [--from accelerate|axolotl|deepspeed|trl|peft] [--mixed-precision no|fp16|bf16] [-o FILE]`:
another tool's config as an fp8dist config (fp8dist.formats); the launch flags fill what the file leaves to the
launch command (a DeepSpeed JSON's "auto")."""
from __future__ import annotations

from fp8dist.commands.output import emit
from fp8dist.errors import ExitCode
from fp8dist.formats.common import LAUNCHER_FLAGS, Launcher
from fp8dist.formats.importing import import_file


def run(args) -> int:
    launcher = Launcher(**{name: getattr(args, name, None) for name in LAUNCHER_FLAGS})
    emit(import_file(args.file, args.kind, launcher), args.output)
    return ExitCode.OK
