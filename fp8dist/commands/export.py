"""`fp8dist export CHECKPOINT_DIR OUT_DIR [--dtype D]`: a checkpoint's model as a Hugging Face directory."""
from __future__ import annotations

from fp8dist.errors import ExitCode
from fp8dist.runtime.export import export_hf


def run(args) -> int:
    exported = export_hf(args.checkpoint, args.out_dir, args.dtype, merge=args.merge)
    print(f"exported {exported.origin()}\n  to {exported.directory} ({exported.dtype}, {exported.tensors} tensors, "
          f"{exported.bytes} bytes in {', '.join(exported.files)})")
    return ExitCode.OK
