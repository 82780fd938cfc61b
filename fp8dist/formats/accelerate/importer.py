"""An Accelerate config file (`accelerate config` / examples/config_yaml_templates/fsdp.yaml) -> an fp8dist config.

Read as accelerate 1.15 runs it (facts.accelerate.ACCELERATE_KNOWN): FSDP (1 or 2) becomes engine fsdp2 with the
precision Accelerate's FSDP2 gives (mixed_precision X: MixedPrecisionPolicy(X, X, X) on weights upcast to fp32;
`no`: the weights as loaded); DEEPSPEED becomes engine deepspeed from the deepspeed_config_file (a path, inline
JSON or base64, as HfDeepSpeedConfig reads it) or from Accelerate's own DeepSpeed keys (the config
DeepSpeedPlugin builds from them); fp8_config the FP8 backend with the values `accelerate launch` really exports
(commands/launch.py defaults; keys it exports under names no recipe reads are resolved to those defaults).
The fsdp_config and fp8_config readers (sections.py) are shared with the Axolotl importer.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, cast

from fp8dist.errors import Issue
from fp8dist.formats.common import (LAUNCHER_FLAGS, Imported, ImportProblem, Launcher, Notes, integer, mapping,
                                   parallel_size, read_beside, read_json_text, set_path, truthy)
from fp8dist.formats.deepspeed.importer import AutoContext, convert_config
from fp8dist.formats.accelerate.sections import fp8_section, fsdp_settings, note_accelerate_refusals
from fp8dist.formats.accelerate.translate import ADAPTER_MARK, LOAD_DTYPE_MARK
from fp8dist.formats.keys import KeyClass, Table, kept, no_effect, one_or_unset, refused

_MARK = re.compile("^" + re.escape(LOAD_DTYPE_MARK) + r"(fp32|bf16|fp16)\b", re.MULTILINE)
_ADAPTER = re.compile("^" + re.escape(ADAPTER_MARK) + r"(\S*)", re.MULTILINE)
# distributed_type values Accelerate runs as replicated data parallelism (accelerate 1.15 utils/dataclasses.py
# DistributedType): fp8dist runs them as FSDP2 with nothing sharded. NO is one process.
_DDP = {"NO", "MULTI_GPU", "MULTI_CPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
        "MULTI_HPU", "MULTI_NEURON"}
# Accelerate's Megatron-LM mode: `accelerate launch` exports megatron_lm_config (MEGATRON_LM_*) only for it
# (accelerate 1.15 utils/launch.py prepare_multi_gpu_env, `if args.use_megatron_lm`), and MegatronLMPlugin trains
# Megatron-Core's own model and optimizer (utils/megatron_lm.py), which fp8dist does not build.
_MEGATRON_ONLY = ("read only with distributed_type MEGATRON_LM (accelerate launch exports it then: utils/launch.py "
                  "prepare_multi_gpu_env), which fp8dist refuses")
_MEGATRON_MODEL = ("Megatron-Core's own model and optimizer (distributed_type MEGATRON_LM, accelerate 1.15 "
                   "utils/megatron_lm.py), which fp8dist does not build")
_LAUNCH = "a launch setting (where and how many processes), not one of the run's numerics or layout"
KEYS = Table("Accelerate", {
    "distributed_type": kept("engine (FSDP: fsdp2; DEEPSPEED: deepspeed; NO / MULTI_*: fsdp2 with nothing sharded); "
                             "required, as Accelerate requires it", example="MULTI_GPU"),
    "mixed_precision": kept("precision (Accelerate's policy for the distributed_type)", example="bf16"),
    "fsdp_config": kept("parallel / fsdp2 (with distributed_type FSDP)", example={"fsdp_version": 2}),
    "deepspeed_config": kept("engine deepspeed: its JSON, or Accelerate's own DeepSpeed keys",
                             example={"zero_stage": 2}),
    "fp8_config": kept("precision.fp8 (with mixed_precision fp8)", example={"backend": "AO"}),
    "dynamo_config": kept("compile", example={"dynamo_backend": "INDUCTOR"}),
    "parallelism_config": kept("parallel: sharding hybrid from dp_shard x dp_replicate, tensor_size from tp, "
                               "context_size from cp (sp, DeepSpeed's Ulysses, refused; Accelerate 1.15 has no "
                               "pipeline size there: a pp_size is noted)",
                               example={"parallelism_config_dp_shard_size": 2}),
    "megatron_lm_config": no_effect(f"{_MEGATRON_ONLY}; with it, the keys below are refused naming fp8dist's",
                                    example={"megatron_lm_tp_degree": 2}),
    # accelerate 1.15 utils/dataclasses.py MegatronLMPlugin (pp_degree, num_micro_batches,
    # decoder_last_pipeline_num_layers), exported from the file by utils/launch.py prepare_multi_gpu_env
    "megatron_lm_config.megatron_lm_pp_degree": refused(
        f"Megatron-LM's pipeline-parallel degree (pipeline_model_parallel_size over {_MEGATRON_MODEL})",
        "fp8dist's pipeline is parallel.pipeline_size (engine fsdp2: the Hugging Face model split by layer ranges, "
        "torch.distributed.pipelining): write it with this degree in an fp8dist config, or import a distributed_type "
        "FSDP file and add it", unless=one_or_unset, otherwise="1: no pipeline", example=2),
    "megatron_lm_config.megatron_lm_num_micro_batches": refused(
        f"the micro-batches Megatron-LM runs a step (global batch = data-parallel size x batch x this), through its "
        f"pipeline when pp_degree is above 1, over {_MEGATRON_MODEL}",
        "in fp8dist, parallel.pipeline_microbatches: N with train.micro_batch_size: your batch x N (each micro-batch "
        "is split into the pipeline's microbatches); without a pipeline, train.gradient_accumulation_steps: N",
        unless=one_or_unset, otherwise="1: one micro-batch a step", example=4),
    "megatron_lm_config.megatron_lm_decoder_last_pipeline_num_layers": refused(
        f"the decoder layers of Megatron-LM's last pipeline stage, the others split evenly, over {_MEGATRON_MODEL}",
        "in fp8dist, parallel.pipeline_split: the first layer of each stage after the first (the last at the "
        "model's layer count minus N)", unless=lambda value: value in (None, "None", ""), otherwise="unset: even",
        example=2),
    "downcast_bf16": no_effect("TPU only (XLA_DOWNCAST_BF16)", example="no"),
    "use_cpu": no_effect("where the processes run, not their dtypes"),
    "debug": no_effect("Accelerate's debug checks of collective shapes"),
    **{key: no_effect(_LAUNCH, example="x") for key in (
        "compute_environment", "num_processes", "num_machines", "machine_rank", "gpu_ids", "main_process_ip",
        "main_process_port", "rdzv_backend", "same_network", "main_training_function", "enable_cpu_affinity",
        "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
        "mpirun_config", "ec2_instance_type", "iam_role_name", "profile", "region", "base_job_name",
        "pytorch_version", "transformers_version", "py_version", "sagemaker_inputs_file", "sagemaker_metrics_file",
        "additional_args", "num_cpu_threads_per_process", "dynamo_backend", "ipex_config", "mpirun_hostfile")},
}, unknown_why="check that it changes neither the precision, nor the parallel layout, nor the batch")
DEEPSPEED_KEYS = Table("Accelerate deepspeed_config", {
    "deepspeed_config_file": kept("engine deepspeed, from that JSON (a path, inline JSON or base64)",
                                  example="ds.json"),
    "zero3_init_flag": kept("parallel.cpu_ram_efficient_loading (ZeRO-3 builds under zero.Init)"),
    "zero_stage": kept("parallel.sharding / deepspeed.zero_stage", example=2),
    "offload_optimizer_device": kept("parallel.offload / deepspeed.offload_optimizer", example="cpu"),
    "offload_param_device": kept("parallel.offload / deepspeed.offload_param", example="cpu"),
    "offload_optimizer_nvme_path": kept("deepspeed.nvme_path", example="/nvme"),
    "offload_param_nvme_path": kept("deepspeed.nvme_path", example="/nvme"),
    "gradient_accumulation_steps": kept("train.gradient_accumulation_steps", example=2),
    "gradient_clipping": kept("train.gradient_clipping", example=1.0),
    "zero3_save_16bit_model": kept("deepspeed.extra zero_optimization.stage3_gather_16bit_weights_on_model_save"),
    **{key: no_effect(_LAUNCH, example="x") for key in (
        "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
        "deepspeed_multinode_launcher")},
    "deepspeed_moe_layer_cls_names": no_effect("ZeRO-3 leaf modules for MoE layers: how parameters are gathered, not "
                                               "their dtypes", example="MixtralSparseMoeBlock"),
}, unknown_why="check that DeepSpeedPlugin (accelerate 1.15 utils/dataclasses.py) does not read it")


def _distributed_type(doc: dict[str, Any], notes: Notes, source: str) -> str:
    """distributed_type, which Accelerate requires (ClusterConfig has no default for it). YAML 1.1 (PyYAML, as
    Accelerate reads the file) makes a bare `NO` false: that is the NO the file means."""
    if "distributed_type" not in doc:
        raise ImportProblem([Issue("distributed_type", "missing: Accelerate refuses a config file without it (and "
                                   "whether the run is one process, replicated or sharded depends on it)",
                                   fix="add distributed_type: NO, MULTI_GPU, FSDP or DEEPSPEED, as `accelerate "
                                       "config` writes it")], source, "accelerate")
    value = doc.pop("distributed_type")
    if value is False:
        notes.resolved("distributed_type", "NO", "a bare NO is false in YAML 1.1; Accelerate reads it as NO")
        return "NO"
    return str(value).upper()


def convert(document: dict[str, Any], text: str, source: str, launcher: Launcher = Launcher()) -> Imported:
    """`launcher`: what the `accelerate launch` command line (and the script) give: its --mixed_precision wins over
    the file's, as in commands/launch.py _validate_launch_command; batch and learning rate are the script's."""
    notes, issues = Notes(), []
    doc = dict(document)
    mark = _MARK.search(text)
    load_dtype = mark.group(1) if mark else None
    dist = _distributed_type(doc, notes, source)
    raw_mixed = doc.pop("mixed_precision", None)
    mixed = "no" if raw_mixed in (None, False) else str(raw_mixed).lower()
    if mixed not in ("no", "bf16", "fp16", "fp8"):  # said, and the rest of the file read as without it
        issues.append(Issue("mixed_precision", "not one of Accelerate's modes", raw_mixed, "use no, bf16, fp16 or fp8"))
        mixed = "no"
    if launcher.mixed_precision:
        section = doc.get("deepspeed_config")
        beside_file = dist == "DEEPSPEED" and isinstance(section, Mapping) and section.get(
            "deepspeed_config_file") not in (None, "none")  # said in _deepspeed
        if raw_mixed is not None and launcher.mixed_precision != mixed and not beside_file:
            notes.resolved("mixed_precision", launcher.mixed_precision, f"--mixed-precision, as accelerate launch "
                           f"--mixed_precision, wins over the file's {mixed}")
        mixed = launcher.mixed_precision
    fp8_config = mapping(doc.pop("fp8_config", None), "fp8_config")
    if mixed != "fp8" and fp8_config:
        notes.dropped("fp8_config", fp8_config,
                      "acts only with mixed_precision: fp8 (accelerate launch exports it then)")
    if dist == "DEEPSPEED":
        out = _deepspeed(mapping(doc.pop("deepspeed_config", None), "deepspeed_config"), raw_mixed, mixed, launcher,
                         notes, issues, source)
    elif dist == "FSDP" or dist in _DDP:
        out = _fsdp(doc, dist, mixed, load_dtype, notes, issues, source)
        _script_values(launcher, out, notes)
    else:
        issues.append(Issue("distributed_type", "fp8dist runs FSDP2 or DeepSpeed (or replicated data parallelism as "
                            "FSDP2 with nothing sharded); this Accelerate mode (Megatron-LM, TPU) has no fp8dist "
                            "equivalent", dist, "use FSDP, DEEPSPEED or MULTI_GPU"))
        if dist == "MEGATRON_LM":
            _megatron(mapping(doc.get("megatron_lm_config"), "megatron_lm_config"), issues)
        raise ImportProblem(issues, source, "accelerate")
    if mixed == "fp8" and out is not None:
        fp8 = fp8_section(fp8_config, out["engine"], notes, issues, "fp8_config.")
        if fp8 is not None and not (fp8["backend"] == "msamp" and "fp8" in out.get("precision", {})):
            out.setdefault("precision", {})["fp8"] = fp8
    dynamo = mapping(doc.pop("dynamo_config", None), "dynamo_config")
    if out is not None:
        _dynamo(dynamo, out, notes)
    parallelism = mapping(doc.pop("parallelism_config", None), "parallelism_config")
    if out is not None and parallelism:
        _parallelism(parallelism, out, notes, issues)
    for key, value in doc.items():
        if key in ("fsdp_config", "deepspeed_config", "fp8_config") and not value:
            continue
        if key in ("fsdp_config", "deepspeed_config"):
            notes.dropped(key, value, f"not read with distributed_type {dist}")
            continue
        KEYS.settle(key, value, notes, issues)
    adapter = _adapter_mark(text, issues)
    if adapter is not None and out is not None:
        out["adapter"] = adapter
        notes.resolved("adapter", json.dumps(adapter), "the header fp8dist wrote when it translated this file: the "
                       "script applies PEFT's LoRA (Accelerate itself has no adapter setting)")
    if issues:
        raise ImportProblem(issues, source, "accelerate", out)
    imported = cast(dict[str, Any], out)  # _deepspeed returns None only after recording an issue
    note_accelerate_refusals(imported, notes, "this file")
    return Imported("accelerate", imported, notes)


def _megatron(config: Mapping[str, Any], issues: list[Issue]) -> None:
    """megatron_lm_config under distributed_type MEGATRON_LM (refused itself): its pipeline keys refused too, each
    naming the fp8dist key that says the same of an fp8dist run (KEYS megatron_lm_config.KEY). Its other keys go
    with the refused mode: nothing is written."""
    for key, value in config.items():
        rule = KEYS.rule(f"megatron_lm_config.{key}")
        if rule is not None and rule.cls is KeyClass.REFUSED:
            KEYS.settle(f"megatron_lm_config.{key}", value, Notes(), issues)


def _adapter_mark(text: str, issues: list[Issue]) -> dict[str, Any] | None:
    """The `adapter` section of fp8dist's header (translate --to accelerate writes it for a LoRA run), or None."""
    mark = _ADAPTER.search(text)
    if mark is None:
        return None
    try:
        adapter = json.loads(mark.group(1))
    except ValueError:
        adapter = None
    if not isinstance(adapter, dict):
        issues.append(Issue("adapter", "the header line fp8dist writes for an adapter run holds no JSON object",
                            mark.group(1)[:80], f"restore the line as fp8dist translate wrote it ({ADAPTER_MARK}"
                            '{"kind":"lora",...}), or delete it for a full fine-tune'))
        return None
    return adapter


# -- FSDP ----------------------------------------------------------------------------------------------------
def _fsdp(doc: dict[str, Any], dist: str, mixed: str, load_dtype: str | None, notes: Notes, issues: list[Issue],
          source: str) -> dict[str, Any]:
    out: dict[str, Any] = {"engine": "fsdp2"}
    fsdp = mapping(doc.pop("fsdp_config", None), "fsdp_config")
    if dist == "FSDP":
        gpus = _gpus_per_node(doc)
        parallel, fsdp2 = fsdp_settings(fsdp, None, notes, issues, "fsdp_config.", gpus)
    else:
        parallel, fsdp2 = {"sharding": "replicate"}, {}
        notes.resolved("distributed_type", "parallel.sharding=replicate", f"{dist} is data parallel (DDP), which "
                       "fp8dist runs as FSDP2 with nothing sharded")
        if fsdp:
            notes.dropped("fsdp_config", fsdp, f"not read with distributed_type {dist}")
    if load_dtype is None:
        load_dtype = "fp32" if dist in _DDP else "bf16"
        notes.resolved("precision.load_dtype", load_dtype, "an Accelerate config has no loading dtype (your script's "
                       f"from_pretrained torch_dtype); {load_dtype} assumed: set it to what your script loads")
    compute = {"fp8": "bf16"}.get(mixed, mixed)
    if mixed == "no":
        precision = {"load_dtype": load_dtype, "mixed_precision": "none", "master_weights": "none",
                     "reduce_dtype": load_dtype}
    elif dist in _DDP:
        precision = {"load_dtype": load_dtype, "mixed_precision": compute, "master_weights": "none",
                     "reduce_dtype": load_dtype}
        notes.resolved("mixed_precision", f"{compute} compute on {load_dtype} weights",
                       "DDP autocasts the forward and reduces gradients in the weights' dtype")
    else:
        precision = {"load_dtype": load_dtype, "mixed_precision": compute, "master_weights": "fp32",
                     "reduce_dtype": compute}
        notes.resolved("mixed_precision", f"{compute} compute, fp32 masters, {compute} reduction",
                       f"Accelerate's FSDP policy for {mixed} is MixedPrecisionPolicy({compute}, {compute}, "
                       f"{compute}) and it upcasts the weights to fp32 (utils/fsdp_utils.py fsdp2_prepare_model)")
    if compute == "fp16":
        notes.resolved("mixed_precision", "fp8dist's loss scaler", "Accelerate would scale fp16 losses with torch's "
                       "GradScaler (no hysteresis); fp8dist's FSDP2 runtime uses DeepSpeed's schedule")
    out["precision"] = precision
    if parallel:
        out["parallel"] = parallel
    if fsdp2:
        out["fsdp2"] = fsdp2
    return out


def _script_values(launcher: Launcher, out: dict[str, Any], notes: Notes) -> None:
    """The batch and learning rate given as flags: under FSDP or DDP they are the script's (its DataLoader,
    Accelerator(gradient_accumulation_steps=...) and optimizer), which an Accelerate config file does not hold."""
    for field, key in (("per_device_train_batch_size", "train.micro_batch_size"),
                       ("gradient_accumulation_steps", "train.gradient_accumulation_steps"),
                       ("learning_rate", "optimizer.lr")):
        value = getattr(launcher, field)
        if value is not None:
            set_path(out, key, value)
            notes.resolved(key, value, f"{LAUNCHER_FLAGS[field]}: the script's value (an Accelerate config file has "
                           "no place for it)")


def _gpus_per_node(doc: Mapping[str, Any]) -> int | None:
    processes, machines = doc.get("num_processes"), doc.get("num_machines", 1)
    if isinstance(processes, int) and processes > 0 and isinstance(machines, int) and machines > 0:
        return processes // machines
    return None


# -- DeepSpeed -----------------------------------------------------------------------------------------------
def _deepspeed(config: dict[str, Any], raw_mixed: Any, mixed: str, launcher: Launcher, notes: Notes,
               issues: list[Issue], source: str) -> dict[str, Any] | None:
    config = dict(config)
    file = config.pop("deepspeed_config_file", None)
    zero3_init = config.pop("zero3_init_flag", None)
    for key in [k for k in config if (rule := DEEPSPEED_KEYS.rule(k)) is not None and rule.cls is KeyClass.NO_EFFECT]:
        DEEPSPEED_KEYS.settle(key, config.pop(key), notes, issues, shown=f"deepspeed_config.{key}")
    if file not in (None, "none"):
        # accelerate 1.15 commands/launch.py launch_command: a mixed_precision from the config file (not from the
        # command line) goes into ACCELERATE_CONFIG_DS_FIELDS, which DeepSpeedPlugin._deepspeed_config_checks
        # refuses next to a deepspeed_config_file; `accelerate launch --mixed_precision X` is the launch's precision.
        if raw_mixed is not None and launcher.mixed_precision is None:
            issues.append(Issue("mixed_precision", "accelerate launch refuses it next to a deepspeed_config_file "
                                "(DeepSpeedPlugin._deepspeed_config_checks) unless its --mixed_precision flag is "
                                "given, which then decides", raw_mixed,
                                "remove it from the file (`accelerate config` writes none with a "
                                "deepspeed_config_file) and pass the precision you launch with: fp8dist import FILE "
                                "--mixed-precision no|fp16|bf16, as accelerate launch --mixed_precision"))
        elif raw_mixed is not None:
            notes.dropped("mixed_precision", raw_mixed, "next to a deepspeed_config_file, accelerate launch "
                          "--mixed_precision (here --mixed-precision) takes its place")
        for key, value in config.items():
            notes.dropped(f"deepspeed_config.{key}", value, "accelerate launch refuses it next to a "
                          "deepspeed_config_file")
        try:
            ds, where = _deepspeed_file(str(file), source)
        except ImportProblem as exc:  # reported with the file's other problems
            issues.extend(exc.issues)
            return None
        ctx = AutoContext.of_launch(launcher, who="accelerate launch")
        prefix = f"deepspeed_config_file ({where}): "
    else:
        ds = _plugin_config(config, mixed, notes, issues)  # its bf16 / fp16 sections written from `mixed`
        ctx = AutoContext.of_launch(launcher, who="Accelerate 1.15")
        prefix = "deepspeed_config (as DeepSpeedPlugin builds it): "
    try:
        out = convert_config(ds, source, notes, ctx, prefix)
    except ImportProblem as exc:
        issues.extend(exc.issues)
        return None
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage == 3:
        flag = zero3_init if zero3_init is not None else True
        if zero3_init is None:
            notes.resolved("deepspeed_config.zero3_init_flag", True, "left out: Accelerate builds ZeRO-3 models inside "
                           "deepspeed.zero.Init (utils/dataclasses.py DeepSpeedPlugin)")
        if truthy(flag):
            set_path(out, "parallel.cpu_ram_efficient_loading", True)
    elif zero3_init is not None:
        notes.dropped("deepspeed_config.zero3_init_flag", zero3_init, "acts only with ZeRO-3")
    return out


def _deepspeed_file(value: str, source: str) -> tuple[Any, str]:
    """HfDeepSpeedConfig's reading order (accelerate 1.15 utils/deepspeed.py): a path (os.path.exists, so a value too
    long to be a path is none), JSON text, base64 JSON (urlsafe_b64decode, which reads standard base64 too)."""
    if value.lstrip().startswith("{"):
        return read_json_text(value, f"{source}: deepspeed_config_file"), "inline JSON"
    if not os.path.exists(value) and not os.path.exists(Path(source).parent / value):
        try:
            decoded = base64.urlsafe_b64decode(value.encode()).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            decoded = None
        if decoded and decoded.lstrip().startswith("{"):
            return read_json_text(decoded, f"{source}: deepspeed_config_file"), "base64 JSON"
    document, where = read_beside(value, Path(source).parent, "deepspeed_config.deepspeed_config_file", source)
    if not isinstance(document, Mapping):
        raise ImportProblem([Issue("deepspeed_config.deepspeed_config_file", "the DeepSpeed config must be a JSON "
                                   "object", where, "point it at a DeepSpeed JSON config")], source)
    return document, where


def _plugin_config(config: dict[str, Any], mixed: str, notes: Notes, issues: list[Issue]) -> dict[str, Any]:
    """The DeepSpeed config DeepSpeedPlugin builds from Accelerate's own keys, then set_mixed_precision
    (accelerate 1.15 utils/dataclasses.py; launcher defaults from commands/launch.py)."""
    stage = config.pop("zero_stage", None)
    if stage is None:
        stage = 2
        notes.resolved("deepspeed_config.zero_stage", 2, "left out: DeepSpeedPlugin's default")
    zero: dict[str, Any] = {"stage": integer(stage, "deepspeed_config.zero_stage")}
    for name in ("optimizer", "param"):
        device = str(config.pop(f"offload_{name}_device", "none") or "none").lower()
        path = config.pop(f"offload_{name}_nvme_path", None)
        zero[f"offload_{name}"] = {"device": device, **({"nvme_path": path} if device == "nvme" else {})}
    save16 = config.pop("zero3_save_16bit_model", None)
    if save16 is not None:
        zero["stage3_gather_16bit_weights_on_model_save"] = bool(truthy(save16))
    ds: dict[str, Any] = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                          "gradient_accumulation_steps": config.pop("gradient_accumulation_steps", "auto"),
                          "zero_optimization": zero}
    clip = config.pop("gradient_clipping", None)
    ds["gradient_clipping"] = clip if clip is not None else "auto"
    if mixed == "fp16":
        ds["fp16"] = {"enabled": True, "auto_cast": True}
    elif mixed in ("bf16", "fp8"):
        ds["bf16"] = {"enabled": True}
    for key, value in config.items():
        DEEPSPEED_KEYS.settle(key, value, notes, issues, shown=f"deepspeed_config.{key}")
    return ds


# -- FP8, compile, parallelism --------------------------------------------------------------------------------
def _dynamo(config: Mapping[str, Any], out: dict[str, Any], notes: Notes) -> None:
    config = dict(config)
    backend = str(config.pop("dynamo_backend", "NO")).upper()
    if backend == "NO":
        return
    out["compile"] = True
    if backend != "INDUCTOR":
        notes.resolved("dynamo_config.dynamo_backend", "compile: true (inductor)", f"fp8dist compiles with inductor, "
                       f"not {backend}")
    for key, value in config.items():
        notes.dropped(f"dynamo_config.{key}", value, "fp8dist compiles each block (FSDP2) or the engine (DeepSpeed) "
                      "with torch.compile's defaults")


_PC = "parallelism_config.parallelism_config_"
# ParallelismConfig's own settings (accelerate 1.15 parallelism_config.py; `accelerate launch` exports them from the
# file's parallelism_config section, commands/launch.py): those of a part that is off (size 1) act on nothing.
_ACTS_WITH = {"cp_backend": "cp_size", "cp_comm_strategy": "cp_size", "sp_backend": "sp_size",
              "sp_seq_length": "sp_size", "sp_seq_length_is_variable": "sp_size", "sp_attn_implementation": "sp_size"}


def _parallelism(config: Mapping[str, Any], out: dict[str, Any], notes: Notes, issues: list[Issue]) -> None:
    """parallelism_config (Accelerate's ParallelismConfig, whose sizes multiply to the number of processes, as
    fp8dist's mesh axes do): dp_replicate x dp_shard -> parallel.sharding hybrid, tp -> parallel.tensor_size,
    cp -> parallel.context_size; sp (DeepSpeed's Ulysses) refused."""
    settings = {key.replace("parallelism_config_", "", 1): value for key, value in config.items()}
    sizes = {name: parallel_size(settings.pop(f"{name}_size", None), f"{_PC}{name}_size")
             for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}
    parallel = out.setdefault("parallel", {})
    fsdp = out["engine"] == "fsdp2" and parallel.get("sharding") != "replicate"
    if sizes["sp"] > 1:
        issues.append(Issue(f"{_PC}sp_size", "DeepSpeed's Ulysses sequence parallel (ALST, Accelerate's sp_backend "
                            "deepspeed), which fp8dist does not wire; fp8dist's context parallel is FSDP2's ring "
                            "attention (parallelism_config_cp_size)", sizes["sp"],
                            "set it to 1 (for context parallel: parallelism_config_cp_size with distributed_type "
                            "FSDP)"))
    if sizes["tp"] > 1 and out["engine"] == "deepspeed":
        issues.append(Issue(f"{_PC}tp_size", "under DEEPSPEED Accelerate splits the model by the DeepSpeed config's "
                            "tensor_parallel.autotp_size (accelerator.py _prepare_deepspeed); "
                            "parallelism_config_tp_size is its FSDP2 and DDP path (a model split by transformers' "
                            "tp_plan)", sizes["tp"],
                            "write tensor_parallel: {autotp_size: N} in the DeepSpeed config and set "
                            "parallelism_config_tp_size to 1"))
    elif sizes["tp"] > 1:
        parallel.update(tensor_size=sizes["tp"], sequence_parallel=False)
        notes.resolved(f"{_PC}tp_size", f"parallel.tensor_size={sizes['tp']}, sequence_parallel=false", "Accelerate "
                       "takes the model split by transformers' tp_plan (from_pretrained(tp_plan='auto'): "
                       "accelerator.py prepare_model), and the models of transformers 5.24 plan no SequenceParallel: "
                       "the activations between the split Linears stay whole")
    if sizes["cp"] > 1:
        parallel["context_size"] = sizes["cp"]
    data = sizes["dp_replicate"] * sizes["dp_shard"]
    if (sizes["tp"] > 1 or sizes["cp"] > 1) and sizes["dp_replicate"] > 1 and sizes["dp_shard"] == 1:
        issues.append(Issue(f"{_PC}dp_replicate_size", "Accelerate refuses tensor or context parallel with pure data "
                            "parallelism (dp_replicate_size > 1 with dp_shard_size 1: parallelism_config.py "
                            "ParallelismConfig.__post_init__)", sizes["dp_replicate"],
                            "set parallelism_config_dp_shard_size above 1 (and distributed_type FSDP)"))
    elif sizes["tp"] > 1 and data > 1 and not fsdp and out["engine"] == "fsdp2":
        issues.append(Issue(f"{_PC}dp_shard_size", "without FSDP Accelerate wraps no tensor-parallel model in DDP "
                            "(accelerator.py prepare_model), so these data-parallel ranks would not average their "
                            "gradients; fp8dist's would", sizes["dp_shard"],
                            "use distributed_type FSDP (fsdp_version 2) for data parallel next to tensor parallel"))
    if out["engine"] == "deepspeed" and data > 1:
        notes.dropped(f"{_PC}dp_shard_size x dp_replicate_size", f"{sizes['dp_shard']} x {sizes['dp_replicate']}",
                      "DeepSpeed's ZeRO stage decides the sharding")
    elif sizes["dp_replicate"] > 1 and sizes["dp_shard"] > 1 and fsdp:
        parallel.update(sharding="hybrid", shard_size=sizes["dp_shard"])
    elif data > 1 and not fsdp and sizes["tp"] == 1:
        notes.dropped(f"{_PC}dp_shard_size x dp_replicate_size", f"{sizes['dp_shard']} x {sizes['dp_replicate']}",
                      "DDP replicates the model over every data-parallel rank")
    for name, value in settings.items():
        size = _ACTS_WITH.get(name)
        if value is None:
            continue
        if size is not None and sizes[size.removesuffix("_size")] == 1:
            notes.dropped(f"{_PC}{name}", value, f"acts only with parallelism_config_{size} above 1")
        elif name == "cp_backend" and value != "torch":
            issues.append(Issue(f"{_PC}{name}", "not a context-parallel backend of Accelerate 1.15 (torch only: "
                                "parallelism_config.py)", value, "write torch"))
        elif name == "cp_comm_strategy" and value not in ("allgather", "alltoall"):
            issues.append(Issue(f"{_PC}{name}", "Accelerate takes allgather or alltoall (utils/dataclasses.py "
                                "TorchContextParallelConfig)", value, "write allgather or alltoall"))
        elif name == "cp_comm_strategy" and value == "alltoall":
            notes.dropped(f"{_PC}{name}", value, "fp8dist leaves torch's default rotation, allgather (torch 2.13 "
                          "distributed/tensor/experimental/_context_parallel/_attention.py set_rotate_method): each "
                          "rank merges the same K/V blocks in the same order, gathered at once instead of passed "
                          "round the ring")
        elif name == "pp_size":
            notes.dropped(f"{_PC}{name}", value, "Accelerate 1.15's ParallelismConfig has no pipeline axis "
                          "(dp_replicate, dp_shard, tp, cp, sp: parallelism_config.py) and accelerate launch exports "
                          "no such key (utils/launch.py prepare_extend_env_parallelism_config): the run has no "
                          "pipeline; fp8dist's is parallel.pipeline_size")
        elif name not in ("cp_backend", "cp_comm_strategy"):  # torch, allgather: fp8dist's own
            notes.dropped(f"{_PC}{name}", value, "no fp8dist meaning")
    if not parallel:
        del out["parallel"]
