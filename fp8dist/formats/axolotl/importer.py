"""An Axolotl YAML -> an fp8dist config (seed 002's FP8 + FSDP2 example, Axolotl's docs/mixed_precision).

Axolotl trains through transformers' Trainer and Accelerate, so its precision is Accelerate's:
- the model loads in bf16 when `bf16` is on, fp16 with `fp16` / `load_in_8bit`, fp32 otherwise (axolotl
  utils/config normalize_config: cfg.torch_dtype);
- `fp8: true` is Accelerate's fp8 mode with torchao: AORecipeKwargs(Float8LinearConfig(enable_fsdp_float8_all_gather
  =fp8_enable_fsdp_float8_all_gather, force_recompute_fp8_weight_in_bwd=the same)), tensorwise, Accelerate's module
  filter (first and last Linear kept), bf16 compute (axolotl core/trainers/base.py additional_accelerator_args);
- FSDP2 (`fsdp_version: 2` + `fsdp_config`) is Accelerate's FSDP2: fp32 masters, one dtype for compute and
  reduction; `deepspeed: FILE` is that DeepSpeed JSON with "auto" filled from these keys (HF Trainer);
- neither: DDP, which fp8dist runs as FSDP2 with nothing sharded.
Keys about data, the model, adapters, logging or evaluation have no fp8dist meaning: one note each.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fp8dist.errors import Issue
from fp8dist.formats.common import Imported, ImportProblem, Notes, integer, mapping, read_beside, truthy
from fp8dist.formats.accelerate.sections import fsdp_settings, note_accelerate_refusals
from fp8dist.formats.deepspeed.importer import AutoContext, convert_config

_OPTIMIZERS = {"adamw_torch": ("adamw", None), "adamw_torch_fused": ("adamw", None), "adamw_hf": ("adamw", None),
               "adamw": ("adamw", None), "sgd": ("sgd", None), "adamw_torch_8bit": ("adamw", "int8"),
               "adamw_bnb_8bit": ("adamw", "int8"), "adamw_8bit": ("adamw", "int8"),
               "adamw_torch_4bit": (None, None)}
_TRAIN = {"micro_batch_size": "micro_batch_size", "gradient_accumulation_steps": "gradient_accumulation_steps",
          "max_grad_norm": "gradient_clipping", "seed": "seed", "max_steps": "steps", "sequence_len": "seq_len"}
_OPTIM = {"learning_rate": "lr", "weight_decay": "weight_decay", "adam_epsilon": "eps"}


def convert(document: dict[str, Any], text: str, source: str) -> Imported:
    notes, issues = Notes(), []
    cfg = dict(document)
    bf16, fp16, fp8 = _flag(cfg, "bf16", notes), _flag(cfg, "fp16", notes), bool(truthy(cfg.pop("fp8", False)))
    for alias, target in (("bfloat16", "bf16"), ("float16", "fp16")):
        if alias in cfg:
            value = bool(truthy(cfg.pop(alias)))
            bf16, fp16 = (bf16 or value, fp16) if target == "bf16" else (bf16, fp16 or value)
    all_gather = bool(truthy(cfg.pop("fp8_enable_fsdp_float8_all_gather", False)))
    load_8bit = bool(truthy(cfg.get("load_in_8bit", False)))
    load_dtype = "bf16" if bf16 else "fp16" if (fp16 or load_8bit) else "fp32"
    notes.resolved("precision.load_dtype", load_dtype, "Axolotl loads the model in bf16 with bf16, fp16 with fp16 or "
                   "load_in_8bit, fp32 otherwise")
    mixed = "fp8" if fp8 else "bf16" if bf16 else "fp16" if fp16 else "no"
    compute = {"fp8": "bf16", "no": "none"}.get(mixed, mixed)
    deepspeed = cfg.pop("deepspeed", None)
    fsdp_config, fsdp_version, legacy = cfg.pop("fsdp_config", None), cfg.pop("fsdp_version", None), cfg.pop("fsdp", None)
    ctx = AutoContext(who="HF Trainer (Axolotl)", mixed_precision=mixed,
                      micro_batch_size=cfg.get("micro_batch_size"),
                      gradient_accumulation_steps=cfg.get("gradient_accumulation_steps", 1),
                      gradient_clipping=_number(cfg.get("max_grad_norm", 1.0)), lr=_number(cfg.get("learning_rate")),
                      weight_decay=_number(cfg.get("weight_decay", 0.0)), eps=_number(cfg.get("adam_epsilon", 1e-8)),
                      betas=[_number(cfg.get("adam_beta1", 0.9)), _number(cfg.get("adam_beta2", 0.999))])
    if deepspeed and (fsdp_config or legacy):
        issues.append(Issue("deepspeed", "set together with FSDP; Accelerate runs one of them", deepspeed,
                            "remove deepspeed or fsdp_config"))
    if deepspeed:
        ds, where = read_beside(str(deepspeed), Path(source).parent, "deepspeed", source)
        try:
            out = convert_config(ds, source, notes, ctx, f"deepspeed ({where}): ")
        except ImportProblem as exc:
            raise ImportProblem(issues + exc.issues, source, "axolotl") from None
        if (ds.get("zero_optimization") or {}).get("stage") == 3:
            out.setdefault("parallel", {})["cpu_ram_efficient_loading"] = True
            notes.resolved("parallel.cpu_ram_efficient_loading", True, "under ZeRO-3 the HF Trainer builds the model "
                           "inside deepspeed.zero.Init (transformers integrations/deepspeed.py is_deepspeed_zero3_enabled)")
    else:
        out = {"engine": "fsdp2"}
        if fsdp_config or legacy:
            if legacy:
                notes.dropped("fsdp", legacy, "the FSDP1 option list; fsdp_config decides")
            version = integer(fsdp_version, "fsdp_version") if fsdp_version is not None else None
            parallel, fsdp2 = fsdp_settings(mapping(fsdp_config, "fsdp_config"), version, notes, issues, "fsdp_config.")
            precision = {"mixed_precision": compute, "master_weights": "fp32" if mixed != "no" else "none",
                         "reduce_dtype": compute if mixed != "no" else load_dtype}
            if mixed != "no":
                notes.resolved("bf16/fp16/fp8", f"{compute} compute, fp32 masters, {compute} reduction",
                               "Accelerate's FSDP2 under the Trainer: one policy dtype, weights upcast to fp32")
        else:
            if fsdp_version is not None:
                notes.dropped("fsdp_version", fsdp_version, "no fsdp_config")
            parallel, fsdp2 = {"sharding": "replicate"}, {}
            precision = {"mixed_precision": compute, "master_weights": "none", "reduce_dtype": load_dtype}
            notes.resolved("(no fsdp_config or deepspeed)", "parallel.sharding=replicate", "Axolotl runs DDP, which "
                           "fp8dist runs as FSDP2 with nothing sharded; the optimizer steps the weights as loaded")
        out["precision"] = {"load_dtype": load_dtype, **precision}
        if parallel:
            out["parallel"] = parallel
        if fsdp2:
            out["fsdp2"] = fsdp2
    if fp8:
        ao = {"recipe_name": "tensorwise", "enable_fsdp_float8_all_gather": all_gather and out["engine"] == "fsdp2",
              "force_recompute_fp8_weight_in_bwd": all_gather, "pad_inner_dim": False}
        out.setdefault("precision", {})["fp8"] = {"backend": "torchao", "torchao": ao,
                                                  "modules": {"exclude": [], "skip_first_last": True}}
        notes.resolved("fp8", "torchao tensorwise, Accelerate's module filter (first and last Linear kept)",
                       "Axolotl passes AORecipeKwargs(Float8LinearConfig(...)) to Accelerate")
    elif all_gather:
        notes.dropped("fp8_enable_fsdp_float8_all_gather", True, "acts only with fp8: true")
    _compile(cfg, out, notes)
    _checkpointing(cfg, out, notes)
    _train_and_optimizer(cfg, out, notes, issues, bool(deepspeed))
    for key, value in cfg.items():
        notes.dropped(key, value, "no fp8dist meaning")
    if issues:
        raise ImportProblem(issues, source, "axolotl")
    note_accelerate_refusals(out, notes, "this Axolotl config")
    return Imported("axolotl", out, notes)


def _flag(cfg: dict[str, Any], name: str, notes: Notes) -> bool:
    value = cfg.pop(name, False)
    if value == "auto":
        resolved = name == "bf16"
        notes.auto(name, resolved, "Axolotl turns bf16 on where the GPU supports it (Ampere and newer); on older "
                   "GPUs it uses fp16 instead")
        return resolved
    if value == "full":
        notes.resolved(name, True, "`full` also evaluates in bf16 (bf16_full_eval), which fp8dist does not run")
        return True
    return bool(truthy(value))


def _compile(cfg: dict[str, Any], out: dict[str, Any], notes: Notes) -> None:
    value = cfg.pop("torch_compile", None)
    if value == "auto":
        notes.auto("torch_compile", True, "Axolotl compiles where the installed torch supports torch.compile")
        value = True
    if truthy(value):
        out["compile"] = True
    for key in ("torch_compile_backend", "torch_compile_mode"):
        if key in cfg:
            notes.dropped(key, cfg.pop(key), "fp8dist compiles with torch.compile's defaults (inductor)")


def _checkpointing(cfg: dict[str, Any], out: dict[str, Any], notes: Notes) -> None:
    value = cfg.pop("gradient_checkpointing", None)
    if value is None or value is False:
        return
    if truthy(value):
        out.setdefault("parallel", {}).setdefault("activation_checkpointing", "full")
    else:
        notes.dropped("gradient_checkpointing", value, "fp8dist checkpoints each block on the device (full)")
        out.setdefault("parallel", {}).setdefault("activation_checkpointing", "full")


def _number(value: Any) -> Any:
    """YAML 1.1 (PyYAML, as Axolotl reads it) leaves `2e-5` a string; Axolotl's pydantic model makes it a float."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _train_and_optimizer(cfg: dict[str, Any], out: dict[str, Any], notes: Notes, issues: list[Issue],
                         deepspeed: bool) -> None:
    train = out.setdefault("train", {})
    for key, target in _TRAIN.items():
        value = _number(cfg.get(key))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            cfg.pop(key)
            train.setdefault(target, int(value) if target != "gradient_clipping" and float(value).is_integer() else value)
    if not train:
        out.pop("train")
    optimizer = out.setdefault("optimizer", {})
    for key, target in _OPTIM.items():
        if key in cfg:
            optimizer.setdefault(target, _number(cfg.pop(key)))
    if "adam_beta1" in cfg or "adam_beta2" in cfg:
        optimizer.setdefault("betas", [_number(cfg.pop("adam_beta1", 0.9)), _number(cfg.pop("adam_beta2", 0.999))])
    if "optimizer" in cfg:
        name = str(cfg.pop("optimizer"))
        mapped, state = _OPTIMIZERS.get(name, (None, None))
        if mapped is None:
            issues.append(Issue("optimizer", "fp8dist builds AdamW, Adam or SGD (torch.optim; int8 states through "
                                "torchao's AdamW8bit); this optimizer has no equivalent", name,
                                "use adamw_torch, adamw_torch_8bit or sgd"))
        else:
            optimizer["name"] = mapped
            if state and deepspeed:
                notes.dropped("optimizer", name, "8-bit optimizer states are FSDP2-only in fp8dist (torchao AdamW8bit)")
            elif state:
                optimizer["state_dtype"] = state
                if name != "adamw_torch_8bit":
                    notes.resolved("optimizer", "optimizer.state_dtype=int8", f"{name} (bitsandbytes) becomes torchao's "
                                   "AdamW8bit: the same blockwise 8-bit Adam states")
    if not optimizer:
        out.pop("optimizer")
