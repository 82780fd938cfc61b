"""The rules of engine=deepspeed: what DeepSpeed 0.19.8's ZeRO stages, precision sections and ZeRO-Offload run."""
from __future__ import annotations

from typing import Any, Mapping

from fp8dist.config.rules.common import written
from fp8dist.config.spec import Spec
from fp8dist.errors import Issue


def check(spec: Spec, explicit: Mapping[str, Any]) -> list[Issue]:
    return [*_loss_scaling(spec, explicit), *_precision(spec), *_offload(spec), *_optimizer(spec),
            *_parallel(spec), *_expert_parallel(spec), *_quantized_base(spec), *_policy_auto(spec)]


def _policy_auto(spec: Spec) -> list[Issue]:
    """precision.fp8.policy auto's calibration runs before the first step in the FSDP2 engine's start only."""
    if not (spec.fp8.enabled and spec.fp8.backend == "torchao" and spec.fp8.policy == "auto"):
        return []
    return [Issue("precision.fp8.policy", "the calibration before the first step is wired into the FSDP2 engine's "
                  "start; engine deepspeed with it has not been run", "auto",
                  "run `fp8dist calibrate MODEL --config C -o policy.yaml` where it can run and train with its "
                  "overrides (policy manual), or use engine fsdp2")]


def _quantized_base(spec: Spec) -> list[Issue]:
    if not (spec.adapter.enabled and spec.adapter.base_dtype == "nf4"):
        return []
    return [Issue("adapter.base_dtype", "DeepSpeed casts and broadcasts every module parameter as a plain tensor "
                  "(runtime/engine.py _configure_distributed_model), and ZeRO-3 partitions them into flat buffers: an "
                  "NF4 base's packed codes survive neither", "nf4",
                  "engine: fsdp2 for a QLoRA base, or adapter.base_dtype=auto")]


def _loss_scaling(spec: Spec, explicit: Mapping[str, Any]) -> list[Issue]:
    scaling, p = written(explicit, "precision", "loss_scaling"), spec.precision
    if scaling and p.mixed_precision == "fp16" and p.master_weights == "none":
        return [Issue("precision.loss_scaling", "fp16 compute on fp32 weights maps to DeepSpeed's torch_autocast, "
                      "whose torch.amp.GradScaler keeps its own defaults and never reads these settings "
                      "(deepspeed/runtime/engine.py, 0.19.8)", scaling,
                      "remove precision.loss_scaling, or set precision.master_weights=fp32 (DeepSpeed fp16 section)")]
    return []


def _precision(spec: Spec) -> list[Issue]:
    """What DeepSpeed does with the precision section it is given (or without one): the gradient accumulation and
    reduction dtypes it honours, and whether anything scales an fp16 loss."""
    ds, p, issues = spec.deepspeed, spec.precision, []
    stage, accum = ds.zero_stage, ds.grad_accum_dtype
    if accum is not None and stage == 0:
        issues.append(Issue("deepspeed.grad_accum_dtype", "DeepSpeed refuses a separate accumulation dtype at ZeRO "
                            "stage 0 (NotImplementedError at initialize)", accum,
                            "use zero_stage>=1 or leave grad_accum_dtype null"))
    section = p.mixed_precision != "none" and p.master_weights != "none"
    module = p.mixed_precision if section else p.load_dtype
    offloaded = ds.offload_optimizer != "none" and stage in (1, 2)
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
    if p.mixed_precision != "none" and p.master_weights == "none" and p.reduce_dtype != p.load_dtype:
        issues.append(Issue("precision.reduce_dtype", f"{p.load_dtype} weights with {p.mixed_precision} compute "
                            "run on DeepSpeed's torch_autocast, which reduces each gradient in its parameter's dtype "
                            f"({p.load_dtype}) and ignores communication_data_type", p.reduce_dtype,
                            f"set precision.reduce_dtype={p.load_dtype}"))
    if p.load_dtype == "fp16" and p.mixed_precision == "none":
        issues.append(Issue("precision.load_dtype", "fp16 weights without mixed precision give DeepSpeed no fp16 "
                            "section, so nothing scales the loss and small gradients underflow silently (its ZeRO "
                            "optimizer then keeps a static loss scale of 1)", "fp16",
                            "set precision.mixed_precision=fp16 with master_weights=fp32 (DeepSpeed's fp16 section), "
                            "or use engine=fsdp2, whose fp16 compute runs fp8dist's loss scaler"))
    return issues


def _offload(spec: Spec) -> list[Issue]:
    ds, issues = spec.deepspeed, []
    stage = ds.zero_stage
    if ds.offload_param != "none" and stage != 3:
        issues.append(Issue("deepspeed.offload_param", "parameter offload needs ZeRO stage 3", ds.offload_param,
                            "set deepspeed.zero_stage=3 or offload_param=none"))
    if ds.offload_optimizer != "none" and stage == 0:
        if spec.parallel.offload == "optimizer":  # the vocabulary decided deepspeed.offload_optimizer
            issues.append(Issue("parallel.offload", "optimizer offload is ZeRO-Offload, which needs ZeRO stage >= 1; "
                                "the sharding here is ZeRO-0", "optimizer",
                                "set parallel.sharding=grad_op (ZeRO-2) or full, or parallel.offload=none"))
        else:
            issues.append(Issue("deepspeed.offload_optimizer", "optimizer offload needs ZeRO stage >= 1",
                                ds.offload_optimizer, "set deepspeed.zero_stage>=1"))
    if "nvme" in (ds.offload_optimizer, ds.offload_param) and not ds.nvme_path:
        issues.append(Issue("deepspeed.nvme_path", "nvme offload needs a path", None, "set deepspeed.nvme_path"))
    return issues


def _optimizer(spec: Spec) -> list[Issue]:
    """Where DeepSpeed keeps master weights and optimizer states, and which optimizer steps them."""
    ds, p, issues = spec.deepspeed, spec.precision, []
    master, state, stage = p.master_weights, spec.optimizer.state_dtype, ds.zero_stage
    if master in ("bf16", "fp16"):
        if stage == 0:
            issues.append(Issue("precision.master_weights", f"{master} master weights need ZeRO stage >= 1 in "
                                "DeepSpeed", master, "set deepspeed.zero_stage>=1"))
        needs_offload = master == "fp16" or state not in ("auto", "bf16")
        if needs_offload and ds.offload_optimizer != "cpu":
            issues.append(Issue("precision.master_weights", f"DeepSpeed keeps {master} master weights with fp32 "
                                "optimizer states only under ZeRO-Offload (DeepSpeedCPUAdam)", master,
                                "set deepspeed.offload_optimizer=cpu, or optimizer.state_dtype=bf16 with bf16 masters"))
        if needs_offload and spec.optimizer.name == "sgd":
            issues.append(Issue("optimizer.name", f"DeepSpeed steps {master} master weights only with "
                                "DeepSpeedCPUAdam (stage_1_and_2.py _enforce_cpu_offload), an Adam", "sgd",
                                "set optimizer.name=adamw, or use fp32 master weights with SGD"))
    if state == "bf16" and master != "bf16":
        issues.append(Issue("optimizer.state_dtype", "DeepSpeed's bf16_optimizer_states needs bf16 master weights",
                            state, "set precision.master_weights=bf16 (and mixed_precision=bf16)"))
    if state in ("fp8", "int8"):
        issues.append(Issue("optimizer.state_dtype", f"{state} optimizer states are a torchao optimizer for FSDP2; "
                            "DeepSpeed has none (MS-AMP O2/O3 has its own)", state,
                            "use engine=fsdp2, or backend=msamp with opt_level O2/O3"))
    return issues


def _parallel(spec: Spec) -> list[Issue]:
    """The `parallel` vocabulary where DeepSpeed cannot run it at the ZeRO stage it resolved to."""
    par, stage, issues = spec.parallel, spec.deepspeed.zero_stage, []
    if par.pipeline_size > 1:
        # deepspeed 0.19 runtime/pipe/module.py PipelineModule(layers=[...]) and runtime/pipe/engine.py: the model is
        # given as a list of layers and trained by its own PipelineEngine.train_batch, not a module's forward
        issues.append(Issue("parallel.pipeline_size", "DeepSpeed's pipeline engine trains a PipelineModule, a model "
                            "written as a list of layers, through its own train_batch; a Hugging Face model is not "
                            "one", par.pipeline_size, "use engine=fsdp2 for pipeline parallel, or "
                            "parallel.pipeline_size=1"))
    if par.offload == "params" and stage != 3:
        issues.append(Issue("parallel.offload", "DeepSpeed offloads parameters only under ZeRO-3 "
                            f"(deepspeed.zero_stage is {stage})", "params",
                            "set parallel.sharding=full (ZeRO-3), or parallel.offload=optimizer"))
    if par.cpu_ram_efficient_loading and stage != 3:
        issues.append(Issue("parallel.cpu_ram_efficient_loading", "on DeepSpeed the model is built partitioned inside "
                            "deepspeed.zero.Init, which is ZeRO-3; at ZeRO-"
                            f"{stage} every rank holds the whole model anyway", True,
                            "set parallel.sharding=full (ZeRO-3), or parallel.cpu_ram_efficient_loading=false"))
    if par.tensor_size > 1 and spec.fp8.enabled:
        issues.append(Issue("parallel.tensor_size", "DeepSpeed's tensor parallel (AutoTP) replaces every nn.Linear "
                            "subclass with its own LinearLayer / LinearAllreduce (deepspeed 0.19 "
                            "module_inject/auto_tp.py _replace_module), FP8 Linears included: FP8 would be silently "
                            f"off (precision.fp8.backend={spec.fp8.backend})", par.tensor_size,
                            "use engine=fsdp2 (DTensor tensor parallel keeps FP8), or parallel.tensor_size=1, or "
                            "precision.fp8.backend=none"))
    if par.tensor_size > 1 and par.sharding == "hybrid":
        issues.append(Issue("parallel.sharding", "hybrid is ZeRO-3 + ZeRO++ hpZ on DeepSpeed, which AutoTP does not "
                            "compose with (deepspeed 0.19 runtime/engine.py: AutoTP takes the model-parallel group "
                            "hpZ partitions inside)", "hybrid", "set parallel.sharding=full, grad_op or replicate"))
    if par.sequence_parallel is True:
        issues.append(Issue("parallel.sequence_parallel", "DeepSpeed AutoTP has no sequence parallel, and DeepSpeed's "
                            "own (Ulysses, `sequence_parallel_size`) needs its attention registered with transformers "
                            "before the model is built (deepspeed 0.19 runtime/sequence_parallel/ulysses_sp.py), "
                            "which fp8dist does not wire", True,
                            "leave parallel.sequence_parallel auto (off on DeepSpeed), or use engine=fsdp2"))
    if par.context_size > 1:
        issues.append(Issue("parallel.context_size", "context parallel is torch's context_parallel on FSDP2; "
                            "DeepSpeed's sequence splitting is Ulysses (`sequence_parallel_size`), which fp8dist does "
                            "not wire",
                            par.context_size, "use engine=fsdp2 on GPUs, or parallel.context_size=1"))
    if par.sharding == "hybrid" and spec.fp8.backend == "msamp":
        issues.append(Issue("parallel.sharding", "hybrid is ZeRO-3 + hpZ on DeepSpeed, and MS-AMP does not run "
                            "ZeRO-3 (Azure/MS-AMP#182)", "hybrid", "set parallel.sharding=grad_op"))
    return issues


def _expert_parallel(spec: Spec) -> list[Issue]:
    """parallel.expert_size > 1 on DeepSpeed is AutoEP (`expert_parallel.autoep_size`): refused where its swap of the
    MoE layers would drop FP8 experts, and where DeepSpeed refuses AutoEP at ZeRO-3. Tensor parallel and hybrid
    sharding next to expert parallel are refused for every engine (fp8dist.config.rules.common); the DeepSpeed
    release that has AutoEP is translate's to check (facts.deepspeed.deepspeed_autoep)."""
    par, ds = spec.parallel, spec.deepspeed
    issues: list[Issue] = []
    if par.expert_size == 1:
        return issues
    ao = spec.fp8.torchao
    if spec.fp8.backend == "torchao" and ao.experts != "none":
        converted = "are converted" if ao.experts != "auto" else "are converted wherever the GPU runs FP8 grouped GEMMs"
        issues.append(Issue("parallel.expert_size", "DeepSpeed's expert parallel (AutoEP) replaces each MoE layer "
                            "it detects with its own AutoEPMoELayer and grouped-GEMM experts (deepspeed 0.19.8 "
                            "module_inject/auto_ep_layer.py, runtime/engine.py _configure_expert_parallel), so the "
                            f"FP8 experts of precision.fp8.torchao.experts={ao.experts}, which {converted}, would "
                            "be silently dropped", par.expert_size,
                            "set precision.fp8.torchao.experts=none (the experts in the compute dtype under AutoEP), "
                            "or use engine=fsdp2 (its expert parallel keeps FP8 experts), or parallel.expert_size=1"))
    if par.sharding == "hybrid":
        issues.append(Issue("parallel.sharding", "hybrid is ZeRO-3 + hpZ on DeepSpeed, and DeepSpeed asserts that "
                            "AutoEP with ZeRO stage 3 does not support hpZ (deepspeed 0.19.8 runtime/engine.py "
                            "_validate_zero3_moe_compatibility)", "hybrid",
                            "set parallel.sharding=full, or parallel.expert_size=1"))
    if ds.zero_stage == 3:
        # AutoEP with ZeRO-3: deepspeed 0.19.8 runtime/engine.py _validate_zero3_moe_compatibility (at initialize)
        # and _save_moe_checkpoint (at every checkpoint save)
        zero = ds.extra.get("zero_optimization")
        zero = zero if isinstance(zero, dict) else {}
        hpz = zero.get("zero_hpz_partition_size")
        turned_on = {"zero_quantized_gradients": bool(zero.get("zero_quantized_gradients")),
                     "zero_hpz_partition_size": isinstance(hpz, int) and hpz > 1}
        for key in (key for key, on in turned_on.items() if on):
            issues.append(Issue(f"deepspeed.extra.zero_optimization.{key}", "DeepSpeed asserts that AutoEP with ZeRO "
                                f"stage 3 does not support {key} (deepspeed 0.19.8 runtime/engine.py "
                                "_validate_zero3_moe_compatibility)", zero[key],
                                f"remove {key} from deepspeed.extra, or set parallel.sharding=grad_op (ZeRO-2), or "
                                "parallel.expert_size=1"))
        if ds.offload_optimizer == "nvme":
            issues.append(Issue("deepspeed.offload_optimizer", "DeepSpeed cannot save a checkpoint of AutoEP at ZeRO "
                                "stage 3 with the optimizer swapped to NVMe (deepspeed 0.19.8 runtime/engine.py "
                                "_save_moe_checkpoint: \"does not support NVMe optimizer swapping yet\")", "nvme",
                                "set deepspeed.offload_optimizer=cpu, or parallel.sharding=grad_op (ZeRO-2), or "
                                "parallel.expert_size=1"))
    return issues
