"""Cross-field rules the schema cannot express. Pure: a resolved dict in, every issue out.

Rules that depend on an installed or targeted version live with the translators and runtimes.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import fp8dist.compat as compat
from fp8dist.config.schema import schema
from fp8dist.config.spec import compute_dtype_of, state_dtype_of, weight_dtype_of
from fp8dist.errors import Issue

Doc = Mapping[str, Any]
RULES: list[Callable[[Doc, Doc], list[Issue]]] = []


def rule(fn):
    RULES.append(fn)
    return fn


def check(doc: Doc, explicit: Doc | None = None) -> list[Issue]:
    issues: list[Issue] = []
    for fn in RULES:
        issues.extend(fn(doc, explicit or {}))
    return issues


# The derived values on the plain dict (the spec's properties, fp8dist.config.spec, on a validated one).
def weight_dtype(doc: Doc) -> str:
    p = doc["precision"]
    return weight_dtype_of(p["load_dtype"], p["master_weights"])


def compute_dtype(doc: Doc) -> str:
    p = doc["precision"]
    return compute_dtype_of(p["mixed_precision"], p["load_dtype"], p["master_weights"])


def effective_state_dtype(doc: Doc) -> str:
    fp8 = doc["precision"]["fp8"]
    return state_dtype_of(doc["optimizer"]["state_dtype"], fp8["backend"], fp8["msamp"]["opt_level"], weight_dtype(doc))


# What says the same on the selected engine as a key of another engine's own section: {(section, selected engine):
# {key: value -> equivalent or None}} (fp8dist.config.vocabulary). An engine with no entry just gets the key named.
_OTHER_ENGINE_EQUIVALENTS = {
    ("deepspeed", "fsdp2"): {
        "zero_stage": lambda v: {0: "parallel.sharding: replicate", 2: "parallel.sharding: grad_op",
                                 3: "parallel.sharding: full"}.get(v, "none (ZeRO-1 has no FSDP2 equivalent)"),
        "offload_optimizer": lambda v: "parallel.offload: params (FSDP2 offloads parameters and the optimizer step "
                                       "together)" if v != "none" else None,
        "offload_param": lambda v: "parallel.offload: params" if v != "none" else None},
}


def notes(doc: Doc, explicit: Doc) -> list[str]:
    """What the user wrote that does nothing on the selected engine: another engine's own section (one line per
    key, with what says the same on this engine where something does). Not errors: a config may keep both engines'
    settings to switch `engine` alone; `--strict` refuses them."""
    engine, out = doc["engine"], []
    for other in schema()["properties"]["engine"]["enum"]:
        written = explicit.get(other) if other != engine else None
        equivalents = _OTHER_ENGINE_EQUIVALENTS.get((other, engine), {})
        for key, value in (written.items() if isinstance(written, Mapping) else ()):
            if key == "extra" and not value:
                continue
            equivalent = equivalents[key](value) if key in equivalents else None
            out.append(f"{other}.{key}={value!r} does nothing with engine {engine} (a {other} key)"
                       + (f"; on {engine} it is {equivalent}" if equivalent else ""))
    return out


@rule
def _master_needs_mixed_precision(doc, _):
    p = doc["precision"]
    if p["mixed_precision"] == "none" and p["master_weights"] != "none":
        return [Issue("precision.master_weights",
                      "a master copy only exists with mixed precision; without it the optimizer steps on "
                      "the weights as loaded", p["master_weights"],
                      "set precision.master_weights=none, or turn on precision.mixed_precision=bf16")]
    if p["master_weights"] in ("bf16", "fp16") and p["master_weights"] != p["mixed_precision"]:
        return [Issue("precision.master_weights",
                      f"{p['master_weights']} master weights need {p['master_weights']} mixed precision",
                      p["master_weights"], "use master_weights=fp32, or match mixed_precision")]
    return []


@rule
def _explicit_block_matches_backend(doc, explicit):
    fp8 = doc["precision"]["fp8"]
    written = ((explicit.get("precision") or {}).get("fp8") or {})
    issues = []
    for block in ("torchao", "te", "msamp"):
        in_use = fp8["backend"] == block or (block == "te" and fp8["backend"] == "msamp" and fp8["msamp"]["use_te"])
        if block in written and not in_use:
            issues.append(Issue(f"precision.fp8.{block}", f"these settings do nothing with backend "
                                f"'{fp8['backend']}'", fix=f"set precision.fp8.backend={block}, or remove the block"))
    return issues


@rule
def _loss_scaling(doc, explicit):
    written = (explicit.get("precision") or {}).get("loss_scaling")
    if not written:
        return []
    p = doc["precision"]
    if compute_dtype(doc) != "fp16":
        return [Issue("precision.loss_scaling", f"loss scaling acts only on fp16 compute; the compute dtype here is "
                      f"{compute_dtype(doc)}, so these settings would do nothing", written,
                      "remove precision.loss_scaling, or set precision.mixed_precision=fp16")]
    if doc["engine"] == "deepspeed" and p["mixed_precision"] == "fp16" and p["master_weights"] == "none":
        return [Issue("precision.loss_scaling", "fp16 compute on fp32 weights maps to DeepSpeed's torch_autocast, "
                      "whose torch.amp.GradScaler keeps its own defaults and never reads these settings "
                      "(deepspeed/runtime/engine.py, 0.19.8)", written,
                      "remove precision.loss_scaling, or set precision.master_weights=fp32 (DeepSpeed fp16 section)")]
    return []


@rule
def _torchao(doc, _):
    fp8, engine = doc["precision"]["fp8"], doc["engine"]
    if fp8["backend"] != "torchao":
        return []
    ao, issues = fp8["torchao"], []
    if ao["enable_fsdp_float8_all_gather"] is True:
        if ao["recipe_name"] != "tensorwise":
            issues.append(Issue("precision.fp8.torchao.enable_fsdp_float8_all_gather",
                                f"float8 all-gather needs tensorwise scaling, recipe is '{ao['recipe_name']}'",
                                True, "set it to auto/false, or use recipe_name=tensorwise "
                                      "(torchao Float8LinearConfig.__post_init__ asserts this)"))
        if engine != "fsdp2":
            issues.append(Issue("precision.fp8.torchao.enable_fsdp_float8_all_gather",
                                f"float8 all-gather is an FSDP2 feature, engine is '{engine}'", True,
                                "set it to auto/false, or use engine=fsdp2"))
    if ao["recipe_name"] == "mxfp8":
        issues += _mxfp8(doc, ao)
    if ao["emulate"] and doc["compile"]:
        issues.append(Issue("precision.fp8.torchao.emulate", "emulated float8 does not work with torch.compile",
                            True, "set compile=false, or emulate=false on FP8 hardware"))
    if doc["precision"]["mixed_precision"] == "none":
        issues.append(Issue("precision.mixed_precision", "torchao float8 runs the non-FP8 ops and the float8 "
                            "casts from a bf16/fp32 compute dtype; it needs mixed precision here", "none",
                            "set precision.mixed_precision=bf16 (preset torchao-float8)"))
    return issues


def _te_raises(record, rejection) -> str:
    until = f"-{compat.fmt(rejection.until)}" if rejection.until else " and later"
    return (f"{record.cls} raises '{rejection.message}' in Transformer Engine {compat.fmt(rejection.since)}{until} "
            f"({rejection.source})")


@rule
def _te(doc, _):
    fp8 = doc["precision"]["fp8"]
    uses_te = fp8["backend"] == "te" or (fp8["backend"] == "msamp" and fp8["msamp"]["use_te"])
    if not uses_te:
        return []
    te, issues = fp8["te"], []
    record = compat.TE_RECIPES[te["recipe"]]
    for field in compat.TE_REMOVED_FIELDS:
        if te[field] is not None:
            issues.append(Issue(f"precision.fp8.te.{field}", compat.te_removed_field_reason(field), te[field],
                                f"remove precision.fp8.te.{field}"))
    for field, reason in compat.TE_INERT_FIELDS.items():
        if te[field] is not None:
            raises = [_te_raises(record, r) for r in record.rejects if r.field == field and r.value == te[field]]
            issues.append(Issue(f"precision.fp8.te.{field}", "; ".join([reason, *raises]), te[field],
                                f"remove precision.fp8.te.{field}"))
    for name in compat.TE_FIELDS:
        if te[name] is None:
            continue
        field = record.field(name)
        if field is None:
            takers = [r.name for r in compat.TE_RECIPES.values() if r.field(name) and not r.field(name).ignored]
            issues.append(Issue(f"precision.fp8.te.{name}", f"not a field of recipe '{record.name}' ({record.cls}); "
                                "TE would silently drop it", te[name],
                                f"remove it, or use recipe {' / '.join(takers)}"))
        elif field.ignored:
            issues.append(Issue(f"precision.fp8.te.{name}", field.ignored, te[name], f"remove precision.fp8.te.{name}"))
    for rejection in record.rejects:
        if rejection.field not in compat.TE_INERT_FIELDS and te[rejection.field] == rejection.value:
            issues.append(Issue(f"precision.fp8.te.{rejection.field}", _te_raises(record, rejection),
                                rejection.value, f"leave precision.fp8.te.{rejection.field} null ({record.cls}'s default)"))
    train = doc["train"]
    tokens = train["micro_batch_size"] * train["seq_len"]
    if tokens % compat.TE_TOKEN_MULTIPLE:
        multiple = compat.TE_TOKEN_MULTIPLE
        issues.append(Issue("train.seq_len", f"Transformer Engine's FP8 GEMMs need the tokens of a micro-batch "
                            f"(train.micro_batch_size * train.seq_len = {tokens}) to be a multiple of {multiple} "
                            "(pytorch/utils.py assert_dim_for_fp8_exec fails the forward otherwise)", train["seq_len"],
                            f"set train.seq_len to a multiple of {multiple} (e.g. {-(-train['seq_len'] // multiple) * multiple})"))
    return issues


def _mxfp8(doc, ao) -> list[Issue]:
    """torchao's MXFP8 Linear: blocks of 32 along every contracted dim, the tokens included; no padding, no float8
    all-gather (compat.TORCHAO_MX_BLOCK)."""
    issues, block, train = [], compat.TORCHAO_MX_BLOCK, doc["train"]
    if ao["pad_inner_dim"]:
        issues.append(Issue("precision.fp8.torchao.pad_inner_dim", "MXFP8Linear has no padding: a Linear whose dims "
                            f"are not multiples of {block} stays in high precision", True,
                            "set precision.fp8.torchao.pad_inner_dim=false"))
    tokens = train["micro_batch_size"] * train["seq_len"]
    if tokens % block:
        issues.append(Issue("train.seq_len", f"MXFP8 quantizes the weight gradient's inputs in blocks of {block} "
                            f"tokens: train.micro_batch_size * train.seq_len = {tokens} is not a multiple of {block}",
                            train["seq_len"], f"set train.seq_len to a multiple of {block} "
                                              f"(e.g. {-(-train['seq_len'] // block) * block})"))
    return issues


@rule
def _msamp(doc, _):
    fp8 = doc["precision"]["fp8"]
    if fp8["backend"] != "msamp":
        return []
    ds, opt, level = doc["deepspeed"], doc["optimizer"], fp8["msamp"]["opt_level"]
    issues = []
    if doc["engine"] != "deepspeed":
        issues.append(Issue("engine", "MS-AMP has no FSDP2 support (msamp.fsdp patches FSDP1 internals only)",
                            doc["engine"], "use engine=deepspeed, or backend=torchao for FP8 with FSDP2"))
    if level == "O3" and ds["zero_stage"] not in (1, 2):
        issues.append(Issue("deepspeed.zero_stage", "MS-AMP O3 needs ZeRO stage 1 or 2 "
                            "(msamp/deepspeed/runtime/config.py asserts it)", ds["zero_stage"],
                            "set deepspeed.zero_stage=2 (or 1)"))
    elif ds["zero_stage"] == 3:
        issues.append(Issue("deepspeed.zero_stage", "MS-AMP does not work with ZeRO-3 (Azure/MS-AMP#182)", 3,
                            "set deepspeed.zero_stage to 0, 1 or 2"))
    if opt["name"] not in ("adam", "adamw"):
        issues.append(Issue("optimizer.name", "msamp.initialize accepts Adam/AdamW only", opt["name"],
                            "set optimizer.name=adamw"))
    if opt["state_dtype"] != "auto":
        issues.append(Issue("optimizer.state_dtype", "MS-AMP decides the optimizer-state dtypes from opt_level",
                            opt["state_dtype"], "set optimizer.state_dtype=auto"))
    for key in ("offload_optimizer", "offload_param"):
        if ds[key] != "none":
            issues.append(Issue(f"deepspeed.{key}", "MS-AMP cannot step DeepSpeedCPUAdam; offload is unsupported",
                                ds[key], f"set deepspeed.{key}=none"))
    if (doc["precision"]["mixed_precision"] == "bf16" and ds["zero_stage"] == 1
            and ds["grad_accum_dtype"] == "fp32"):
        issues.append(Issue("deepspeed.grad_accum_dtype", "bf16 + ZeRO-1 + fp32 accumulation makes DeepSpeed pick "
                            "BF16_Optimizer, which bypasses MS-AMP's FP8 ZeRO optimizer", "fp32",
                            "leave deepspeed.grad_accum_dtype unset"))
    if doc["precision"]["mixed_precision"] == "none":
        issues.append(Issue("precision.mixed_precision", "MS-AMP runs on DeepSpeed's fp16 or bf16 mode", "none",
                            "set precision.mixed_precision=fp16 (MS-AMP's examples) or bf16"))
    return issues


@rule
def _deepspeed(doc, _):
    if doc["engine"] != "deepspeed":
        return []
    ds, p, issues = doc["deepspeed"], doc["precision"], []
    stage = ds["zero_stage"]
    if ds["grad_accum_dtype"] is not None and stage == 0:
        issues.append(Issue("deepspeed.grad_accum_dtype", "DeepSpeed refuses a separate accumulation dtype at ZeRO "
                            "stage 0 (NotImplementedError at initialize)", ds["grad_accum_dtype"],
                            "use zero_stage>=1 or leave grad_accum_dtype null"))
    section = p["mixed_precision"] != "none" and p["master_weights"] != "none"
    module = p["mixed_precision"] if section else p["load_dtype"]
    accum = ds["grad_accum_dtype"]
    offloaded = ds["offload_optimizer"] != "none" and stage in (1, 2)
    # What DeepSpeed 0.19.8 does with data_types.grad_accum_dtype, as the audit observed it: honoured with a
    # bf16/fp16 section (ZeRO-1 fp32: BF16_Optimizer; ZeRO-2/3: fp32 averaged_gradients); with ZeRO-1/2
    # optimizer offload every gradient lands in the fp32 CPU partition (stage_1_and_2.py
    # async_inplace_copy_grad_to_fp32_buffer_from_gpu); without a section the module's dtype wins.
    ignored_by = ("ZeRO-Offload, which accumulates every gradient in its fp32 CPU partition" if offloaded and
                  accum != "fp32" else None if section else
                  f"DeepSpeed without a bf16/fp16 section, whose ZeRO optimizer accumulates in the module dtype "
                  f"({module})" if accum != module else None)
    if accum is not None and stage >= 1 and ignored_by:
        want = "fp32" if offloaded else module
        issues.append(Issue("deepspeed.grad_accum_dtype", f"ignored by {ignored_by}", accum,
                            f"leave deepspeed.grad_accum_dtype null (or {want})"))
    if p["mixed_precision"] != "none" and p["master_weights"] == "none" and p["reduce_dtype"] != p["load_dtype"]:
        issues.append(Issue("precision.reduce_dtype", f"{p['load_dtype']} weights with {p['mixed_precision']} compute "
                            "run on DeepSpeed's torch_autocast, which reduces each gradient in its parameter's dtype "
                            f"({p['load_dtype']}) and ignores communication_data_type", p["reduce_dtype"],
                            f"set precision.reduce_dtype={p['load_dtype']}"))
    if ds["offload_param"] != "none" and stage != 3:
        issues.append(Issue("deepspeed.offload_param", "parameter offload needs ZeRO stage 3", ds["offload_param"],
                            "set deepspeed.zero_stage=3 or offload_param=none"))
    if ds["offload_optimizer"] != "none" and stage == 0:
        issues.append(Issue("deepspeed.offload_optimizer", "optimizer offload needs ZeRO stage >= 1",
                            ds["offload_optimizer"], "set deepspeed.zero_stage>=1"))
    if "nvme" in (ds["offload_optimizer"], ds["offload_param"]) and not ds["nvme_path"]:
        issues.append(Issue("deepspeed.nvme_path", "nvme offload needs a path", None, "set deepspeed.nvme_path"))
    master, state = p["master_weights"], doc["optimizer"]["state_dtype"]
    if master in ("bf16", "fp16"):
        if stage == 0:
            issues.append(Issue("precision.master_weights", f"{master} master weights need ZeRO stage >= 1 in "
                                "DeepSpeed", master, "set deepspeed.zero_stage>=1"))
        needs_offload = master == "fp16" or state not in ("auto", "bf16")
        if needs_offload and ds["offload_optimizer"] != "cpu":
            issues.append(Issue("precision.master_weights", f"DeepSpeed keeps {master} master weights with fp32 "
                                "optimizer states only under ZeRO-Offload (DeepSpeedCPUAdam)", master,
                                "set deepspeed.offload_optimizer=cpu, or optimizer.state_dtype=bf16 with bf16 masters"))
        if needs_offload and doc["optimizer"]["name"] == "sgd":
            issues.append(Issue("optimizer.name", f"DeepSpeed steps {master} master weights only with "
                                "DeepSpeedCPUAdam (stage_1_and_2.py _enforce_cpu_offload), an Adam", "sgd",
                                "set optimizer.name=adamw, or use fp32 master weights with SGD"))
    if p["load_dtype"] == "fp16" and p["mixed_precision"] == "none":
        issues.append(Issue("precision.load_dtype", "fp16 weights without mixed precision give DeepSpeed no fp16 "
                            "section, so nothing scales the loss and small gradients underflow silently (its ZeRO "
                            "optimizer then keeps a static loss scale of 1)", "fp16",
                            "set precision.mixed_precision=fp16 with master_weights=fp32 (DeepSpeed's fp16 section), "
                            "or use engine=fsdp2, whose fp16 compute runs fp8dist's loss scaler"))
    if state == "bf16" and master != "bf16":
        issues.append(Issue("optimizer.state_dtype", "DeepSpeed's bf16_optimizer_states needs bf16 master weights",
                            state, "set precision.master_weights=bf16 (and mixed_precision=bf16)"))
    if state in ("fp8", "int8"):
        issues.append(Issue("optimizer.state_dtype", f"{state} optimizer states are a torchao optimizer for FSDP2; "
                            "DeepSpeed has none (MS-AMP O2/O3 has its own)", state,
                            "use engine=fsdp2, or backend=msamp with opt_level O2/O3"))
    return issues


@rule
def _fsdp2_optimizer_states(doc, _):
    if doc["engine"] != "fsdp2":
        return []
    state, opt = doc["optimizer"]["state_dtype"], doc["optimizer"]["name"]
    if state in ("fp8", "int8") and opt != "adamw":
        return [Issue("optimizer.state_dtype", f"{state} states come from torchao's low-bit AdamW", state,
                      "set optimizer.name=adamw")]
    if state in ("fp32", "bf16") and state != weight_dtype(doc):
        return [Issue("optimizer.state_dtype", f"torch.optim keeps states in the dtype of the parameters it steps "
                      f"({weight_dtype(doc)} here)", state,
                      "leave it auto, or change precision.master_weights")]
    return []


@rule
def _parallel(doc, _):
    par, engine, issues = doc["parallel"], doc["engine"], []
    if engine == "fsdp2" and par["offload"] == "optimizer":
        issues.append(Issue("parallel.offload", "FSDP2 offloads parameters, gradients and the optimizer step together "
                            "(CPUOffloadPolicy); it cannot offload the optimizer alone", "optimizer",
                            "set parallel.offload=params, or run engine=deepspeed (ZeRO-Offload)"))
    if engine == "deepspeed" and par["offload"] == "params" and doc["deepspeed"]["zero_stage"] != 3:
        issues.append(Issue("parallel.offload", "DeepSpeed offloads parameters only under ZeRO-3 "
                            f"(deepspeed.zero_stage is {doc['deepspeed']['zero_stage']})", "params",
                            "set parallel.sharding=full (ZeRO-3), or parallel.offload=optimizer"))
    if engine == "deepspeed" and par["cpu_ram_efficient_loading"] and doc["deepspeed"]["zero_stage"] != 3:
        issues.append(Issue("parallel.cpu_ram_efficient_loading", "on DeepSpeed the model is built partitioned inside "
                            "deepspeed.zero.Init, which is ZeRO-3; at ZeRO-"
                            f"{doc['deepspeed']['zero_stage']} every rank holds the whole model anyway", True,
                            "set parallel.sharding=full (ZeRO-3), or parallel.cpu_ram_efficient_loading=false"))
    if engine == "deepspeed" and par["sharding"] == "hybrid" and doc["precision"]["fp8"]["backend"] == "msamp":
        issues.append(Issue("parallel.sharding", "hybrid is ZeRO-3 + hpZ on DeepSpeed, and MS-AMP does not run "
                            "ZeRO-3 (Azure/MS-AMP#182)", "hybrid", "set parallel.sharding=grad_op"))
    return issues


@rule
def _adapter(doc, explicit):
    """LoRA composes with torchao's float8 conversion (the frozen base Linears convert, the adapters do not: a
    module filter on the names). MS-AMP and Transformer Engine replace or wrap every Linear's weight in their
    own types, under PEFT's layers; neither path runs here (both need a CUDA GPU), so neither is claimed."""
    ad, issues = doc["adapter"], []
    written = explicit.get("adapter") if isinstance(explicit.get("adapter"), Mapping) else {}
    if ad["kind"] == "none":
        extra = sorted(k for k in written if k != "kind")
        if extra:
            issues.append(Issue(f"adapter.{extra[0]}", f"adapter settings do nothing with adapter.kind=none "
                                f"({', '.join('adapter.' + k for k in extra)})", written[extra[0]],
                                "set adapter.kind=lora, or remove them"))
        return issues
    if ad["base_dtype"] != "auto":
        issues.append(Issue("adapter.base_dtype", f"a {ad['base_dtype']} base (QLoRA) runs on bitsandbytes' CUDA "
                            "kernels, which fp8dist does not run", ad["base_dtype"],
                            "set adapter.base_dtype=auto (the base stays in precision.load_dtype, or FP8 with "
                            "precision.fp8.backend=torchao)"))
    backend = doc["precision"]["fp8"]["backend"]
    if backend == "msamp":
        issues.append(Issue("precision.fp8.backend", "MS-AMP casts every Linear weight to its ScalingTensor and its "
                            "optimizer steps them all; frozen base weights under LoRA adapters are not a regime it "
                            "has", "msamp", "use precision.fp8.backend=torchao with the adapter, or adapter.kind=none"))
    if backend == "te":
        issues.append(Issue("precision.fp8.backend", "Transformer Engine under LoRA is not a path fp8dist runs: "
                            "fp8dist applies PEFT before FP8 conversion, while PEFT's TE layers (peft 0.21 "
                            "tuners/lora/te.py) wrap te.Linear modules that already exist and cannot merge", "te",
                            "use precision.fp8.backend=torchao with the adapter, or adapter.kind=none"))
    if doc["parallel"]["cpu_ram_efficient_loading"]:
        issues.append(Issue("parallel.cpu_ram_efficient_loading", "the adapters are not in the model directory's "
                            "files, and shard-on-read loads only what the files hold", True,
                            "set parallel.cpu_ram_efficient_loading=false with adapter.kind=lora"))
    return issues
