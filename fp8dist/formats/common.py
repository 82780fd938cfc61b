"""What the importers of other tools' files share (pure: no torch, no accelerate import): reading a YAML or JSON
file with the loader's safety (fp8dist/config/reading.py: regular files only, size cap, no binary, no YAML tags,
bounded nesting and aliases, plain data; JSON the same way), the notes an import writes, its refusal, and the
value readers. The importers themselves: fp8dist.formats.{accelerate,axolotl,deepspeed,trl,peft}.importer; the dispatch:
fp8dist.formats.importing.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import fp8dist.config.reading as reading
import fp8dist.dtypes as dtypes
from fp8dist.config.spec import weight_dtype_of
from fp8dist.errors import ConfigError, Fp8distError, Issue
from fp8dist.facts.torchao import NF4_BLOCK, NF4_SCALER_BLOCK

KINDS = ("accelerate", "axolotl", "deepspeed", "trl", "peft")
# bitsandbytes' 4-bit options (transformers BitsAndBytesConfig) that have no effect on the NF4 base fp8dist builds
NF4_SCALES = (f"fp8dist's NF4 always quantizes its scales (torchao to_nf4: one scale per {NF4_BLOCK} values, the "
              f"scales in int8 per {NF4_SCALER_BLOCK})")
NF4_STORAGE = ("the dtype bitsandbytes packs its 4-bit codes into for FSDP / DeepSpeed; fp8dist's NF4 keeps its "
               "codes in uint8 and FSDP2 shards them itself")
TITLE = {"accelerate": "Accelerate config", "axolotl": "Axolotl config", "deepspeed": "DeepSpeed config",
         "trl": "TRL / alignment-handbook recipe", "peft": "PEFT adapter_config.json"}


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


def module_names(value: Any, key: str) -> list[str]:
    """A list of module names (PEFT's modules_to_save as the tools pass it on); None: empty."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(name, str) and name for name in value):
        raise WrongShape(key, value, "a list of module names")
    return list(value)


def parallel_size(value: Any, key: str) -> int:
    """A parallel degree (tensor, context, sequence, data shard or replicate size): an integer >= 1; null or left out
    is 1 (each tool's default)."""
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit() \
            or int(value) < 1:
        raise WrongShape(key, value, "an integer >= 1")
    return int(value)


class ImportProblem(Fp8distError):
    """The file cannot be imported: every problem, each naming the source key, why, and the fix (exit 2).
    `document`: what the rest of the file became, where an importer refuses keys of it (fp8dist.formats.importing
    checks it against fp8dist's rules too, so that every problem is said at once)."""

    def __init__(self, issues: list[Issue], source: str, kind: str | None = None,
                 document: Mapping[str, Any] | None = None):
        self.issues, self.source, self.document = list(issues), source, document
        what = f" ({TITLE[kind]})" if kind else ""
        lines = [f"cannot import {source}{what}: {len(self.issues)} problem(s)"]
        lines += [f"  - {issue.render()}" for issue in self.issues]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Launcher:
    """The launch's own values, which Accelerate and the HF Trainer write into a DeepSpeed config's "auto" entries
    (`fp8dist import` flags, named as `accelerate launch` / TrainingArguments name them; None: not given)."""

    # no | fp16 | bf16: accelerate launch --mixed_precision, TrainingArguments bf16/fp16
    mixed_precision: str | None = None
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    learning_rate: float | None = None

    def given(self) -> dict[str, Any]:
        """flag -> value of the flags given."""
        return {LAUNCHER_FLAGS[name]: value for name, value in vars(self).items() if value is not None}


LAUNCHER_FLAGS = {"mixed_precision": "--mixed-precision",
                  "per_device_train_batch_size": "--per-device-train-batch-size",
                  "gradient_accumulation_steps": "--gradient-accumulation-steps", "learning_rate": "--learning-rate"}


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


def comment_line(text: str) -> str:
    """`text` as one YAML comment line: whitespace runs (line breaks included) become one space, and a character
    YAML cannot hold in a comment (a control character from a file name, a key or a value) is written as its
    escape."""
    flat = " ".join(text.split())
    return "# " + "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in flat)


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- reading -------------------------------------------------------------------------------------------------
def _as_import_problem(read, source: str):
    """What `read` returns; a refusal of fp8dist.config.reading as this import's problem (same issues)."""
    try:
        return read()
    except ConfigError as exc:
        raise ImportProblem(exc.issues, source) from None


def read_json_text(text: str, source: str) -> Any:
    """JSON with the loader's bounds (fp8dist.config.reading.parse_json)."""
    return _as_import_problem(lambda: reading.parse_json(text, source), source)


def read_document(path: str | Path) -> tuple[Any, str]:
    """(parsed document, raw text) of a YAML or JSON file, refused like the loader refuses a hostile config."""
    source = str(path)
    text = _as_import_problem(lambda: reading.read_text(path), source)
    if source.endswith(".json") or text.lstrip().startswith(("{", "[")):
        return read_json_text(text, source), text
    return _as_import_problem(lambda: reading.parse_yaml(text, source), source), text


def read_beside(path: str, base: Path, key: str, source: str) -> tuple[Any, str]:
    """A file another config names (a DeepSpeed JSON): relative paths from the launch directory, else beside it.
    os.path.isfile, as the tools test it: a value that cannot be a path (too long, a NUL byte) is no file."""
    candidates = [path] if os.path.isabs(path) else [path, str(base / path)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            document, _ = read_document(candidate)
            return document, candidate
    raise ImportProblem([Issue(key, "names a file that does not exist (looked in the current directory and beside "
                               f"{source})", path,
                               "give the path of the DeepSpeed JSON, or copy it beside the config")],
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


def pop_switch(section: dict[str, Any], key: str, notes: "Notes", off: str) -> bool:
    """A true/false key taken out of `section`: True when on; off, the note that it changes nothing (`off` says why);
    unset, False; anything else, WrongShape."""
    value = section.pop(key, None)
    if value is None:
        return False
    on = truthy(value)
    if on is None:
        raise WrongShape(key, value, "true or false")
    if not on:
        notes.dropped(key, value, off)
    return on


def set_path(document: dict[str, Any], dotted: str, value: Any) -> None:
    node = document
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def yaml11_number(value: Any) -> Any:
    """A number as the tool reads it: YAML 1.1 (PyYAML's safe_load, as Axolotl and TrlParser read their files) leaves
    `2e-5` a string, which their pydantic model / argparse then makes a float. Anything else stays as it is ("nan" and
    "inf" are no settings)."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return value


# transformers 5 TrainingArguments.optim names (training_args.py OptimizerNames) that fp8dist builds:
# name -> (optimizer.name, optimizer.state_dtype or None). bitsandbytes' 8-bit AdamW becomes torchao's AdamW8bit, which
# transformers runs for adamw_torch_8bit: the same blockwise 8-bit Adam states. The paged names are bitsandbytes'
# AdamW with is_paged=True (transformers 5.24 trainer_optimizer.py _get_bitsandbytes_optimizer: optim_bits 32 or 8):
# paging lets CUDA move the states to host memory under memory pressure, which changes no number; optim_bits 32
# keeps fp32 states whatever the parameters' dtype.
HF_OPTIMIZERS = {"adamw_torch": ("adamw", None), "adamw_torch_fused": ("adamw", None), "adamw_hf": ("adamw", None),
                 "adamw_torch_xla": ("adamw", None), "adamw_torch_npu_fused": ("adamw", None),
                 "adamw_apex_fused": ("adamw", None), "sgd": ("sgd", None), "adamw_torch_8bit": ("adamw", "int8"),
                 "adamw_bnb_8bit": ("adamw", "int8"), "adamw_8bit": ("adamw", "int8"),
                 "paged_adamw_32bit": ("adamw", "fp32"), "paged_adamw_8bit": ("adamw", "int8")}
_PAGING = ("paging (bitsandbytes is_paged: CUDA unified memory moves the Adam states to host memory under GPU memory "
           "pressure) is memory management, not numerics")


def stepped_dtype(document: Mapping[str, Any]) -> str | None:
    """The dtype the optimizer steps in an imported document (its master weights, else the weights as loaded), or
    None where its precision is not known (a refused part)."""
    precision = document.get("precision") or {}
    if "load_dtype" not in precision:
        return None
    return weight_dtype_of(precision["load_dtype"], precision.get("master_weights", "none"))


def hf_optimizer(key: str, name: Any, deepspeed: bool, optimizer: dict[str, Any], notes: Notes, issues: list[Issue],
                 names: Mapping[str, tuple[str, str | None]] = HF_OPTIMIZERS, fsdp_fix: str = "FSDP",
                 stepped: str | None = None) -> None:
    """`key: name` (a TrainingArguments optim name, as the HF Trainer, TRL and Axolotl take it) into `optimizer`, or
    refused: an optimizer fp8dist does not build, 8-bit states under DeepSpeed (fp8dist has them on FSDP2 only), or
    fp32 states over weights stepped in another dtype (`stepped`; torch.optim keeps states in the weights' dtype)."""
    name = str(name)
    mapped, state = names.get(name, (None, None))
    if state == "fp32" and stepped not in (None, "fp32"):
        issues.append(Issue(key, f"{name} keeps fp32 Adam states (bitsandbytes optim_bits=32) over the {stepped} "
                            "weights it steps; fp8dist's torch.optim AdamW keeps them in the weights' dtype "
                            f"({stepped})", name,
                            f"use adamw_torch ({stepped} states, as the weights), or {fsdp_fix}, which keeps fp32 "
                            "master weights"))
    elif mapped is None:
        issues.append(Issue(key, "fp8dist builds AdamW, Adam or SGD (torch.optim; int8 states through torchao's "
                            "AdamW8bit); this optimizer has no equivalent", name,
                            "use adamw_torch, adamw_torch_fused, adamw_torch_8bit or sgd"))
    elif state == "int8" and deepspeed:
        issues.append(Issue(key, "8-bit Adam states change the optimizer's numerics, and fp8dist has them on FSDP2 "
                            "only (torchao AdamW8bit); under DeepSpeed the states would be fp32" +
                            (f" ({_PAGING})" if name.startswith("paged_") else ""), name,
                            f"use adamw_torch (or paged_adamw_32bit) under DeepSpeed, or {fsdp_fix} for 8-bit states"))
    else:
        optimizer["name"] = mapped
        if state:
            optimizer["state_dtype"] = state
        paged = f"; {_PAGING}, and fp8dist keeps the states on the device" if name.startswith("paged_") else ""
        if state == "int8" and name != "adamw_torch_8bit":
            notes.resolved(key, "optimizer.state_dtype=int8", f"{name} (bitsandbytes) becomes torchao's AdamW8bit, "
                           "which transformers runs for adamw_torch_8bit: the same blockwise 8-bit Adam states"
                           + paged)
        elif state == "fp32":
            notes.resolved(key, "optimizer.name=adamw, state_dtype=fp32", f"{name} is bitsandbytes' AdamW with 32-bit "
                           "states: the AdamW update with fp32 states, as torch.optim.AdamW over fp32 weights" + paged)
