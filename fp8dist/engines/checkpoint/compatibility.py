"""Whether a checkpoint can be resumed by this run: the engine, the model, the config it was written under, and
the number of ranks. Refusals raise before any weight is read; what is resumed but not exactly is returned as
notes."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fp8dist.engines.checkpoint.interface import EngineCheckpointing
from fp8dist.errors import Fp8distError

# Settings that say how long and how observed a run is, not what it computes: a resume that changes them says
# nothing (extending `train.steps` is what resuming is for). The whole `audit` section observes and computes nothing.
_BOOKKEEPING = frozenset({"train.steps", "train.process_group_timeout_s", "checkpoint.keep_last",
                          "deepspeed.steps_per_print"})
_BOOKKEEPING_SECTIONS = ("audit.",)


def _leaves(document: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(document, dict):
        return {key: value for name, child in document.items()
                for key, value in _leaves(child, f"{prefix}{name}.").items()}
    return {prefix[:-1]: document}


def _with_defaults(document: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config with the keys added to fp8dist since at their defaults (a key the old file lacks is no
    change when this run leaves it at its default); the document as saved where it no longer loads."""
    from fp8dist.config.load import load_config

    try:
        return load_config(document).to_dict()
    except Fp8distError:
        return document


def config_changes(saved: dict[str, Any] | None, here: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    """The settings (dotted keys) a resumed run changes from the checkpoint's config: (key, saved, here)."""
    if not saved or not here:
        return []
    before, after = _leaves(_with_defaults(saved)), _leaves(here)
    return [(key, before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
            if key not in _BOOKKEEPING and not key.startswith(_BOOKKEEPING_SECTIONS)
            and before.get(key) != after.get(key)]


def check_compatible(manifest: dict[str, Any], path: Path, engine: EngineCheckpointing, world: int,
                     config: dict[str, Any] | None = None) -> list[str]:
    """Refuse what cannot be resumed here; return what is resumed but not exactly (notes). `world` is the number
    of ranks resuming (fp8dist.engines.checkpoint.protocol.checkpoint_ranks), `config` this run's config
    (Spec.to_dict()), compared with the one the checkpoint was written under."""
    if manifest["engine"] != engine.engine:
        raise Fp8distError(f"{path}: written by engine={manifest['engine']}, this run is engine={engine.engine}"
                           f"\n  fix: resume with a config of engine={manifest['engine']}, or start a new "
                           "--checkpoint-dir (export the old one with `fp8dist export` to reuse its weights)")
    changes = config_changes(manifest.get("config"), config)
    _refuse_adapter_changes(changes, path)
    _refuse_pipeline_changes(changes, path)
    _refuse_switching_back(manifest, config, path)  # before the shapes: use_dora adds parameters, and the key says why
    saved, here = manifest["model"]["parameters"], engine.parameter_shapes()
    if saved != here:
        missing = sorted(set(saved) - set(here))
        extra = sorted(set(here) - set(saved))
        shapes = sorted(k for k in set(saved) & set(here) if saved[k] != here[k])
        detail = (f"parameter {missing[0]} is not in this model" if missing else
                  f"this model's parameter {extra[0]} is not in the checkpoint" if extra else
                  f"{shapes[0]} is {saved[shapes[0]]} there and {here[shapes[0]]} here")
        raise Fp8distError(f"{path}: a checkpoint of another model ({manifest['model'].get('name') or '?'}: {detail})"
                           "\n  fix: resume with the --model it was trained with, or start a new --checkpoint-dir")
    notes = []
    other_model = manifest["model"].get("name") and engine.model_name and manifest["model"]["name"] != engine.model_name
    if other_model and (manifest.get("config") or {}).get("adapter", {}).get("kind", "none") != "none":
        raise Fp8distError(f"{path}: an adapter run's checkpoint of --model {manifest['model']['name']}; it holds the "
                           f"adapters only and the frozen base is read again from MODEL, so resuming with "
                           f"{engine.model_name} would train these adapters on another base"
                           f"\n  fix: resume with --model {manifest['model']['name']}, or start a new --checkpoint-dir")
    if changes:
        notes.append("resumed with settings other than the checkpoint's: " + ", ".join(
            f"{key} {before!r} -> {after!r}" for key, before, after in changes))
    if other_model:
        notes.append(f"written by a run of --model {manifest['model']['name']}, resumed with {engine.model_name}: "
                     "the weights come from the checkpoint, buffers that are not saved (e.g. rotary frequencies) "
                     "from this model")
    if manifest["world_size"] != world:
        if not engine.reshardable:
            raise Fp8distError(
                f"{path}: written by {manifest['world_size']} ranks; this job has {world}, and {engine.engine} "
                f"partitions optimizer states per rank\n  fix: resume with {manifest['world_size']} ranks (or "
                "convert it with DeepSpeed's deepspeed/checkpoint/ds_to_universal.py and load it with "
                "DeepSpeed's universal checkpoint support)")
        notes.append(f"written by {manifest['world_size']} ranks, resumed on {world}: weights and optimizer states "
                     "are resharded; RNG states and per-rank data differ, so the run is not an exact continuation")
        if ((config or {}).get("adapter") or {}).get("base_dtype") == "nf4":
            notes.append("adapter.base_dtype=nf4: which frozen Linears fit NF4's blocks depends on the shard count; "
                         f"the base is quantized for this job's shards, not those of the {manifest['world_size']} "
                         "ranks that trained so far (the start note lists what stayed in the load dtype)")
    return notes


def _refuse_switching_back(manifest: dict[str, Any], config: dict[str, Any] | None, path: Path) -> None:
    """A checkpoint whose last steps ran after precision.schedule's switch, resumed under a config that would run
    the next steps in FP8 again (no schedule, a later switch, or fewer GEMMs switched): the run would change meaning
    mid-way without a word."""
    from fp8dist.config.spec import ScheduleSpec, switch_step_of

    recorded = manifest.get("precision_schedule")
    if not recorded or not recorded["switched_steps"] or config is None:
        return
    schedule = ScheduleSpec(**config["precision"].get("schedule", {}))
    here = switch_step_of(schedule, config["train"]["steps"]) if config["precision"]["fp8"]["backend"] != "none" \
        else None
    if here is None or here > manifest["step"] + 1 or (recorded["gemms"] == "all" and schedule.gemms != "all"):
        raise Fp8distError(f"{path}: its last {recorded['switched_steps']} steps ran after precision.schedule's switch "
                           f"(from step {recorded['switch_step']}, {recorded['gemms']} GEMMs in the compute dtype); "
                           "this config would run the next steps in FP8 again"
                           f"\n  fix: resume with the checkpoint's precision.schedule (from_step "
                           f"{recorded['switch_step']}, gemms {recorded['gemms']}), or start a new --checkpoint-dir")


def _refuse_pipeline_changes(changes: list[tuple[str, Any, Any]], path: Path) -> None:
    """A checkpoint of another pipeline layout: each rank saved its own stages' parameters and their optimizer state
    by parameter name, and a resume on other stages has not been run (refused rather than guessed)."""
    for key, before, after in changes:
        if key in ("parallel.pipeline_size", "parallel.pipeline_stages_per_rank", "parallel.pipeline_split"):
            raise Fp8distError(f"{path}: written with {key}={before!r}, this run has {after!r}: a pipeline run's "
                               "checkpoint holds each stage's parameters and optimizer state as its ranks saved them, "
                               f"and resuming on another stage layout is not supported\n  fix: resume with {key}="
                               f"{before!r}, or export it (`fp8dist export`) and start a new --checkpoint-dir from "
                               "the exported model")


def _refuse_adapter_changes(changes: list[tuple[str, Any, Any]], path: Path) -> None:
    """The adapter settings a resume cannot change: the checkpoint's adapters were trained under them."""
    for key, before, after in changes:
        if key == "adapter.alpha":  # PEFT scales the adapters' output by alpha / r (peft 0.21 tuners/lora/layer.py)
            raise Fp8distError(f"{path}: adapter.alpha is {before} in the checkpoint and {after} in this config; the "
                               f"adapters were trained under the scaling alpha / r, so another alpha makes the "
                               f"checkpoint another model\n  fix: resume with adapter.alpha={before}, or start a new "
                               "--checkpoint-dir")
        if key == "adapter.base_dtype":  # the frozen base the adapters were trained on
            raise Fp8distError(f"{path}: adapter.base_dtype is {before} in the checkpoint and {after} in this config; "
                               "the adapters were trained on that base, so another one makes the checkpoint another "
                               f"model\n  fix: resume with adapter.base_dtype={before}, or start a new "
                               "--checkpoint-dir")
        if key == "adapter.use_dora":  # a trained magnitude vector per adapter (peft 0.21 tuners/lora/dora.py)
            raise Fp8distError(f"{path}: adapter.use_dora is {before} in the checkpoint and {after} in this config; "
                               "DoRA rescales each adapted Linear's output by a magnitude vector trained with the "
                               "adapters, so the checkpoint's adapters under the other setting make another model"
                               f"\n  fix: resume with adapter.use_dora={str(before).lower()}, or start a new "
                               "--checkpoint-dir")
