"""`fp8dist import FILE [--from accelerate|axolotl|deepspeed|trl|peft]`: which kind of file it is, its importer, and the
fp8dist YAML it becomes (comment lines first), validated like any config before it is printed.

One importer per source format (fp8dist.formats.{accelerate,axolotl,deepspeed,trl,peft}.importer); each turns the parsed
file into an fp8dist document plus notes: one comment line per source key that has no fp8dist meaning, and one per
`"auto"` (or left-out key that matters to precision) saying what DeepSpeed or Accelerate would actually use. What a
DeepSpeed JSON or an Accelerate config leaves to the launch command comes from the `Launcher` flags
(--mixed-precision, --per-device-train-batch-size, --gradient-accumulation-steps, --learning-rate).
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Callable, Mapping

import fp8dist.config.load as load
import fp8dist.config.reading as reading
import fp8dist.config.schema as schema
from fp8dist.errors import ConfigError, Issue
from fp8dist.formats.accelerate import importer as accelerate
from fp8dist.formats.axolotl import importer as axolotl
from fp8dist.formats.common import (KINDS, LAUNCHER_FLAGS, TITLE, Imported, ImportProblem, Launcher, WrongShape,
                                   comment_line, read_document)
from fp8dist.formats.deepspeed import importer as deepspeed
from fp8dist.formats.peft import importer as peft
from fp8dist.formats.trl import importer as trl

# (document, text, source) -> Imported; the LAUNCHED kinds' also take the Launcher.
IMPORTERS: dict[str, Callable[..., Imported]] = {
    "accelerate": accelerate.convert, "axolotl": axolotl.convert, "deepspeed": deepspeed.convert, "trl": trl.convert,
    "peft": peft.convert}
# The kinds whose file leaves values to the launch command (Launcher: `fp8dist import` flags): a DeepSpeed JSON's
# "auto", and what `accelerate launch` flags set over an Accelerate config. Axolotl and TRL files hold the HF
# Trainer's arguments themselves; a PEFT file holds the adapter only.
LAUNCHED = ("accelerate", "deepspeed")
_OWN_VALUES = {"axolotl": "its bf16 / fp16 / fp8, micro_batch_size, gradient_accumulation_steps and learning_rate",
               "trl": "its bf16 / fp16, per_device_train_batch_size, gradient_accumulation_steps and learning_rate",
               "peft": "only the adapter: the precision, batch and learning rate are fp8dist's defaults"}

# -- kinds ----------------------------------------------------------------------------------------------
# Evidence of a kind: keys only that tool writes (a shared name counts where its shape tells the tools apart:
# DeepSpeed's bf16 / fp16 / optimizer are sections, Axolotl's are flags and names; Axolotl's deepspeed is a path).
def _is_section(value: Any) -> bool:
    return isinstance(value, Mapping)


EVIDENCE: dict[str, dict[str, Any]] = {
    "accelerate": {key: None for key in (
        "compute_environment", "distributed_type", "num_processes", "num_machines", "machine_rank",
        "main_training_function", "mixed_precision", "deepspeed_config", "dynamo_config", "parallelism_config",
        "fp8_config", "use_cpu", "rdzv_backend", "same_network", "gpu_ids", "main_process_ip", "main_process_port",
        "downcast_bf16", "megatron_lm_config", "mpirun_config", "enable_cpu_affinity", "tpu_env", "tpu_use_cluster")},
    "axolotl": {**{key: None for key in (
        "base_model", "datasets", "micro_batch_size", "sequence_len", "num_epochs", "adapter", "lora_r", "lora_alpha",
        "lora_target_modules", "load_in_4bit", "load_in_8bit", "special_tokens", "val_set_size", "chat_template",
        "flash_attention", "fp8_enable_fsdp_float8_all_gather", "fsdp_version", "lr_scheduler", "learning_rate",
        "max_grad_norm", "tf32", "wandb_project", "dataset_prepared_path", "sample_packing", "train_on_inputs")},
        "fp8": lambda v: isinstance(v, bool), "deepspeed": lambda v: isinstance(v, str),
        "bf16": lambda v: isinstance(v, bool) or v in ("auto", "full"), "fp16": lambda v: isinstance(v, bool),
        "optimizer": lambda v: isinstance(v, str)},
    "deepspeed": {**{key: None for key in (
        "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print",
        "wall_clock_breakdown", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
        "communication_data_type", "msamp", "amp", "torch_autocast", "aio", "flops_profiler", "data_types",
        "tensor_parallel", "pipeline", "gradient_clipping", "bfloat16")},
        "bf16": _is_section, "fp16": _is_section, "optimizer": _is_section, "scheduler": _is_section},
    # TRL / alignment-handbook recipes: ModelConfig, ScriptArguments and TrainingArguments names no other tool writes
    # (Axolotl: base_model, micro_batch_size, sequence_len, num_epochs, optimizer; Accelerate: mixed_precision).
    "trl": {key: None for key in (
        "model_name_or_path", "model_revision", "use_peft", "use_rslora", "use_dora", "lora_task_type", "torch_dtype",
        "per_device_train_batch_size", "per_device_eval_batch_size", "dataset_name", "dataset_mixture",
        "dataset_mixer", "dataset_splits", "dataset_train_split", "dataset_test_split", "max_seq_length",
        "num_train_epochs", "lr_scheduler_type", "optim", "overwrite_output_dir", "do_train", "do_eval",
        "push_to_hub", "report_to", "logging_strategy", "eval_strategy", "hub_strategy", "max_prompt_length")},
    # PEFT's adapter_config.json (LoraConfig / PeftConfig fields): names no config of the other tools has (Axolotl
    # writes lora_alpha, lora_fan_in_fan_out, peft_use_rslora...; TRL use_rslora, use_dora)
    "peft": {key: None for key in (
        "peft_type", "base_model_name_or_path", "inference_mode", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
        "init_lora_weights", "megatron_core", "loftq_config", "peft_version", "layers_to_transform",
        "qalora_group_size")},
    "fp8dist": {"engine": lambda v: v in ("fsdp2", "deepspeed"), "precision": _is_section, "parallel": _is_section,
                "train": _is_section, "audit": _is_section, "fsdp2": _is_section, "checkpoint": _is_section},
}


# Keys that are evidence of a kind unless the file has evidence of the other kind named: Axolotl and TRL (the HF
# TrainingArguments) share these names, which then say nothing about which of the two it is.
OUTRANKED: dict[str, dict[str, tuple[str, ...]]] = {
    "axolotl": {"trl": ("learning_rate", "max_grad_norm", "tf32", "lora_r", "lora_alpha", "lora_target_modules",
                        "load_in_4bit", "load_in_8bit", "chat_template", "bf16", "fp16", "deepspeed"),
                "peft": ("lora_alpha",)},
    "accelerate": {"trl": ("use_cpu",)},
    "trl": {"peft": ("use_rslora", "use_dora")},
}


def evidence(document: Mapping[str, Any]) -> dict[str, list[str]]:
    """kind -> the keys of `document` that only that kind writes."""
    found: dict[str, list[str]] = {}
    for kind, keys in EVIDENCE.items():
        hits = [key for key, shape in keys.items() if key in document and (shape is None or shape(document[key]))]
        if hits:
            found[kind] = hits
    for kind, by in OUTRANKED.items():
        for other, shared in by.items():
            if kind in found and other in found:
                found[kind] = [key for key in found[kind] if key not in shared]
                if not found[kind]:
                    del found[kind]
    return found


def detect(document: Mapping[str, Any]) -> str | None:
    """The one kind the keys are evidence of (accelerate | axolotl | deepspeed | trl | peft | fp8dist), or None when
    they are evidence of none; a file with evidence of two kinds is refused by `import_file`, asking for --from."""
    found = evidence(document)
    return next(iter(found)) if len(found) == 1 else None


def other_tool_issue(document: Mapping[str, Any], source: str) -> Issue | None:
    """A file given as an fp8dist config that is another tool's: keys fp8dist does not know that only that tool
    writes, and none that is fp8dist's in fp8dist's form (a key both write, as `optimizer`, counts as fp8dist's where
    what the file holds under such keys passes fp8dist's schema). One issue saying which tool's, and the `fp8dist
    import` that makes it an fp8dist config; None for a file that is not recognisably another tool's
    (fp8dist.config.load then names each unknown key)."""
    if "fp8dist" in evidence(document):
        return None
    own = {key: value for key, value in document.items() if key in schema.schema()["properties"]}
    if own and not schema.validate(own):  # an fp8dist config with keys of another tool in it
        return None
    found = evidence({key: value for key, value in document.items() if key not in own})
    if not found:
        return None
    titles = " or ".join(f"{'an' if TITLE[kind][0] in 'AEIOU' else 'a'} {TITLE[kind]}" for kind in found)
    keys = ", ".join(dict.fromkeys(key for hits in found.values() for key in hits[:4]))
    path = Path(source)
    named = shlex.quote(source) if path.suffix else "FILE"  # a dict or omegaconf object has no file to name
    written = shlex.quote(path.stem + ".fp8dist.yaml") if path.suffix else "fp8dist.yaml"
    pick = "" if len(found) == 1 else f" --from {'|'.join(found)}"
    return Issue("", f"this is {titles}, not an fp8dist config ({keys}: keys only that tool writes; no fp8dist "
                 "section)", fix=f"fp8dist import {named}{pick} -o {written}, then pass {written} instead")


def launcher_issues(launcher: Launcher, kind: str) -> list[Issue]:
    """The flags given that this kind of file does not take, and values no launch runs with."""
    issues = []
    for name, flag in LAUNCHER_FLAGS.items():
        value = getattr(launcher, name)
        if value is None:
            continue
        if kind not in LAUNCHED:
            issues.append(Issue(flag, f"gives the launch's value to a DeepSpeed JSON or an Accelerate config; this "
                                f"{TITLE[kind]} says {_OWN_VALUES[kind]}", value,
                                f"drop {flag} (change the value in the file, or in the imported config)"))
        elif name == "mixed_precision" and value not in ("no", "fp16", "bf16"):
            issues.append(Issue(flag, "not a precision the launch takes", value, "use no, fp16 or bf16"))
        elif name != "mixed_precision" and (isinstance(value, bool) or not value > 0 or value == float("inf")):
            issues.append(Issue(flag, "must be a positive finite number", value,
                                f"pass {flag} with the launch's value"))
    return issues


def import_file(path: str | Path, kind: str | None = None, launcher: Launcher = Launcher()) -> str:
    """The fp8dist YAML (comment lines first) for a file of `kind` (detected when None); validated. `launcher`: the
    launch's own values (`fp8dist import` flags), for what the file leaves to the launch command."""
    source = str(path)
    document, text = read_document(path)
    if not isinstance(document, Mapping):
        what = "a list" if isinstance(document, list) else f"a {type(document).__name__}"
        raise ImportProblem([Issue("", f"the top level must be a mapping, not {what}",
                                   fix="pass an Accelerate config.yaml, an Axolotl YAML, a DeepSpeed JSON, a "
                                       "TRL recipe or a PEFT adapter_config.json")], source)
    if kind is None:
        found = evidence(document)
        if list(found) == ["fp8dist"]:
            raise ImportProblem([Issue("", "this is already an fp8dist config", fix=f"fp8dist validate {source}")],
                                source)
        if not found:
            raise ImportProblem([Issue("", "cannot tell which kind of file this is (no key that only an Accelerate "
                                       "config, an Axolotl config, a DeepSpeed config, a TRL recipe or a PEFT "
                                       "adapter_config.json has)", sorted(map(str, document))[:8],
                                       "say it with --from accelerate|axolotl|deepspeed|trl|peft")], source)
        if len(found) > 1:
            seen = "; ".join(f"{TITLE.get(k, 'fp8dist config')}: {', '.join(keys[:4])}" for k, keys in found.items())
            raise ImportProblem([Issue("", f"its keys are those of more than one tool ({seen})",
                                       fix="say which tool runs it with --from accelerate|axolotl|deepspeed|trl|peft")],
                                 source)
        kind = next(iter(found))
    if kind not in KINDS:
        raise ImportProblem([Issue("--from", f"unknown kind; one of {', '.join(KINDS)}", kind)], source)
    flags = launcher_issues(launcher, kind)
    refused = {issue.path for issue in flags}
    usable = Launcher(**{name: value for name, value in vars(launcher).items() if LAUNCHER_FLAGS[name] not in refused})
    try:
        imported = convert(kind, document, text, source, usable)
    except ImportProblem as exc:  # with what fp8dist refuses in the rest of the file: every problem at once
        rest = fp8dist_refusals(exc.document, kind, source) if exc.document is not None else []
        raise ImportProblem(flags + exc.issues + rest, source, kind) from None
    problems = flags + fp8dist_refusals(imported.document, kind, source)
    if problems:
        raise ImportProblem(problems, source, kind)
    return render(imported, source)


def fp8dist_refusals(document: Mapping[str, Any], kind: str, source: str) -> list[Issue]:
    """What fp8dist refuses in an imported document: what would not read back as the same config, else its own
    config rules' issues."""
    unreadable = reading.plain_data_issues(document) + load.literal_interpolations(
        document, f"(as the {TITLE[kind]} has it)")
    if unreadable:
        return unreadable
    try:
        load.resolve(document, source)
    except ConfigError as exc:
        return [Issue(i.path, f"the imported config is refused by fp8dist: {i.message}", i.value, i.fix)
                for i in exc.issues]
    return []


def convert(kind: str, document: Mapping[str, Any], text: str, source: str,
            launcher: Launcher = Launcher()) -> Imported:
    try:
        if kind in LAUNCHED:
            return IMPORTERS[kind](dict(document), text, source, launcher)
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
    lines = [comment_line(f"fp8dist config imported from {source} ({TITLE[imported.kind]}) by `fp8dist import`.")]
    lines += [comment_line(note) for note in imported.notes]
    return "\n".join(lines) + "\n" + reading.dump_yaml(imported.document, default_flow_style=False, width=4096)
