"""`fp8dist import FILE [--from accelerate|axolotl|deepspeed]`: which kind of file it is, its importer, and the
fp8dist YAML it becomes (comment lines first), validated like any config before it is printed.

One importer per source format (fp8dist.formats.{accelerate,axolotl,deepspeed}.importer); each turns the parsed
file into an fp8dist document plus notes: one comment line per source key that has no fp8dist meaning, and one per
`"auto"` (or left-out key that matters to precision) saying what DeepSpeed or Accelerate would actually use.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import fp8dist.config.load as load
from fp8dist.errors import ConfigError, Issue
from fp8dist.formats.accelerate import importer as accelerate
from fp8dist.formats.axolotl import importer as axolotl
from fp8dist.formats.common import KINDS, TITLE, Imported, ImportProblem, WrongShape, read_document
from fp8dist.formats.deepspeed import importer as deepspeed

IMPORTERS = {"accelerate": accelerate.convert, "axolotl": axolotl.convert, "deepspeed": deepspeed.convert}

# -- kinds ----------------------------------------------------------------------------------------------
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
    try:
        return IMPORTERS[kind](dict(document), text, source)
    except ImportProblem:
        raise
    except WrongShape as exc:
        raise ImportProblem([Issue(exc.key, f"must be {exc.want}", exc.value,
                                   f"write {exc.want} there, as the tool documents it")], source, kind) from None
    except (AttributeError, TypeError, ValueError, KeyError) as exc:  # a value of the wrong shape somewhere
        raise ImportProblem([Issue("", f"a value has the wrong type or shape for an {TITLE[kind]} "
                                   f"({type(exc).__name__}: {exc})", fix="compare the file with the tool's documented "
                                   "format (sections are mappings, flags true/false, sizes numbers)")],
                            source, kind) from None


def render(imported: Imported, source: str) -> str:
    import yaml

    lines = [f"# fp8dist config imported from {source} ({TITLE[imported.kind]}) by `fp8dist import`."]
    lines += [f"# {' '.join(note.split())}" for note in imported.notes]
    body = yaml.safe_dump(imported.document, sort_keys=False, default_flow_style=False, width=4096)
    return "\n".join(lines) + "\n" + body
