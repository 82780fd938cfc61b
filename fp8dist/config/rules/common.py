"""The rules for every engine and backend: master weights, the backend blocks written, loss scaling, the adapter."""
from __future__ import annotations

from typing import Any, Mapping

import fp8dist.speed as speed
from fp8dist.config.parallel import pipeline_microbatches, pipeline_stages_per_rank
from fp8dist.config.spec import FP8Spec, Spec
from fp8dist.errors import Fp8distError, Issue
from fp8dist.facts.torch import PIPELINE_SCHEDULES


def written(explicit: Mapping[str, Any], *path: str) -> Any:
    """What the user wrote at `path` (None where nothing): the rules that refuse a written setting ask this, since the
    resolved spec holds every key at its default."""
    value: Any = explicit
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def blocks_in_use(fp8: FP8Spec) -> tuple[str, ...]:
    """The precision.fp8 blocks that act: the backend's own, and `te` under MS-AMP with use_te (MS-AMP then runs
    Transformer Engine's Linear, configured by that block)."""
    if fp8.backend == "none":
        return ()
    return (fp8.backend, "te") if fp8.backend == "msamp" and fp8.msamp.use_te else (fp8.backend,)


def check(spec: Spec, explicit: Mapping[str, Any]) -> list[Issue]:
    return [*_master_needs_mixed_precision(spec), *_explicit_block_matches_backend(spec, explicit),
            *_loss_scaling(spec, explicit), *_adapter(spec, explicit), *_mesh(spec),
            *_hardware(spec)]


def _hardware(spec: Spec) -> list[Issue]:
    """A GPU named in hardware.gpu that has no tensor cores or kernels for the FP8 recipe (the libraries' own
    capability gates, fp8dist/speed.py check_supported): the run could not run there, nor be predicted."""
    recipe = spec.fp8.recipe
    if spec.hardware.gpu == "auto" or recipe is None:
        return []
    try:
        speed.check_supported(recipe[0], spec.hardware.gpu, recipe[1])
    except Fp8distError as error:
        return [Issue("hardware.gpu", str(error), spec.hardware.gpu,
                      "name the GPU the run is on, or pick an FP8 recipe it has (precision.fp8.torchao.recipe_name / "
                      "precision.fp8.te.recipe)")]
    return []


def _mesh(spec: Spec) -> list[Issue]:
    """The tensor / sequence / context axes where no backend or engine can honour them (fp8dist.config.parallel has
    the size rules; each engine and backend module its own refusals)."""
    par, issues = spec.parallel, []
    if par.sequence_parallel is True and par.tensor_size == 1:
        issues.append(Issue("parallel.sequence_parallel", "sequence parallel shards the activations over the "
                            "tensor-parallel ranks, and parallel.tensor_size is 1", True,
                            "set parallel.tensor_size > 1, or leave parallel.sequence_parallel auto"))
    if spec.adapter.enabled and par.tensor_size > 1:
        issues.append(Issue("parallel.tensor_size", "LoRA adapters wrap the Linears tensor parallel splits (PEFT's "
                            "lora.Linear holds the base Linear), and fp8dist splits plain nn.Linear layers only",
                            par.tensor_size, "set parallel.tensor_size=1 with an adapter (FSDP2 shards the frozen "
                            "base over every rank)"))
    if par.expert_size > 1:
        issues += _expert_parallel(spec)
    if par.pipeline_size > 1:
        issues += _pipeline_parallel(spec)
    return issues


def _pipeline_parallel(spec: Spec) -> list[Issue]:
    """What fp8dist's pipeline parallel (engines/fsdp2/pipeline_parallel.py) needs of the rest of the config: its
    microbatches and stages meet the schedule's rule (fp8dist.facts.torch PIPELINE_SCHEDULES), and what it has not
    run with is refused, with the reason."""
    par, issues, pp = spec.parallel, [], spec.parallel.pipeline_size
    rule = PIPELINE_SCHEDULES[par.pipeline_schedule]
    micro, stages = pipeline_microbatches(spec), pipeline_stages_per_rank(spec)
    how = " (auto: 2 x pipeline_size)" if par.pipeline_microbatches == "auto" else ""
    if spec.train.micro_batch_size % micro:
        issues.append(Issue("parallel.pipeline_microbatches", f"{micro} microbatches{how} do not divide "
                            f"train.micro_batch_size={spec.train.micro_batch_size}: the pipeline splits each "
                            "micro-batch along the batch dim", par.pipeline_microbatches,
                            f"set train.micro_batch_size to a multiple of {micro}, or parallel.pipeline_microbatches "
                            "to a divisor of it"))
    if (rule.microbatches == "at least P" and micro < pp) or (rule.microbatches == "a multiple of P" and micro % pp):
        issues.append(Issue("parallel.pipeline_microbatches", f"{par.pipeline_schedule} ({rule.torch_class}) needs "
                            f"{rule.microbatches.replace('P', f'pipeline_size={pp}')} microbatches, got {micro}{how}",
                            par.pipeline_microbatches, f"set parallel.pipeline_microbatches to {2 * pp}"))
    if rule.multi_stage != (stages > 1):
        need = "at least 2" if rule.multi_stage else "exactly 1"
        issues.append(Issue("parallel.pipeline_stages_per_rank", f"{par.pipeline_schedule} ({rule.torch_class}) runs "
                            f"{need} stages per rank, got {stages}", par.pipeline_stages_per_rank,
                            "leave parallel.pipeline_stages_per_rank auto"))
    if par.pipeline_schedule == "zero_bubble":
        # torch 2.13 torch/distributed/pipelining/stage.py backward_maybe_with_nosync -> stage_backward_weight: the
        # split weight-gradient pass differentiates with respect to self.submod.parameters(), which fully_shard keeps
        # sharded while the forward ran on the gathered ones (measured here: the gradients come back None)
        issues.append(Issue("parallel.pipeline_schedule", "zero_bubble computes the weight gradients in a pass of "
                            "their own, with respect to the stage's parameters as stored; FSDP2 stores them sharded "
                            "while the forward ran on the gathered ones, so torch 2.13's pass gets no gradient "
                            "(stage.py stage_backward_weight)", "zero_bubble",
                            "use interleaved_1f1b (the smallest bubble that runs on FSDP2), or 1f1b"))
    if par.pipeline_split and len(par.pipeline_split) != pp * stages - 1:
        issues.append(Issue("parallel.pipeline_split", f"{len(par.pipeline_split)} stage starts for {pp * stages} "
                            f"stages (pipeline_size {pp} x {stages} per rank): it names the first layer of every "
                            "stage after the first", list(par.pipeline_split),
                            f"give {pp * stages - 1} increasing layer indices, or [] for even ranges"))
    if par.tensor_size > 1 and par.sequence_parallel is True:
        # measured on gloo: a stage's hidden states arrive sequence-sharded (16 of 32 positions at tp 2) where the
        # next stage's rotary embeddings and torch's PipelineStage, which infers one activation shape per stage
        # boundary (torch 2.13 torch/distributed/pipelining/stage.py), expect the whole sequence
        issues.append(Issue("parallel.sequence_parallel", "sequence parallel with pipeline parallel: the stages "
                            "send and receive whole-sequence activations, and a sequence-sharded one does not fit "
                            "the next stage", True, "set parallel.sequence_parallel=false (or auto, which is off with "
                            "pipeline parallel), or parallel.pipeline_size=1"))
    for key, size, why in (
            ("expert_size", par.expert_size, "expert parallel borrows its ranks from dp_shard across the whole world; "
             "an expert mesh per pipeline stage is not wired"),
            ("context_size", par.context_size, "context parallel shards the sequence around the whole model's "
             "forward, and the schedule runs each stage's forward apart")):
        if size > 1:
            issues.append(Issue("parallel.pipeline_size", f"pipeline parallel with parallel.{key}={size}: {why}",
                                pp, f"set parallel.{key}=1, or parallel.pipeline_size=1"))
    if spec.precision.mixed_precision == "fp16":
        issues.append(Issue("parallel.pipeline_size", "pipeline parallel with fp16 compute: the loss scaler's skip "
                            "of a step with non-finite gradients is not wired through the schedule's backward", pp,
                            "use precision.preset bf16 (or an FP8 preset on bf16), or parallel.pipeline_size=1"))
    if par.cpu_ram_efficient_loading:
        issues.append(Issue("parallel.pipeline_size", "pipeline parallel with CPU-RAM-efficient loading: the meta "
                            "build reads its shards after sharding the whole model, and each rank keeps only its "
                            "stages", pp, "set parallel.cpu_ram_efficient_loading=false, or parallel.pipeline_size=1"))
    return issues


def _expert_parallel(spec: Spec) -> list[Issue]:
    """What expert parallel is not combined with (yet) on any engine: each refused with its reason, none silently
    dropped (each engine's rules refuse what its own expert parallel does not run)."""
    par, issues = spec.parallel, []
    for key, size, why in (
            ("tensor_size", par.tensor_size, "fp8dist's tensor parallel refuses MoE models (routed experts are split "
             "by expert parallel; torchao's MoE tutorial recommends against TP on them), and the dense layers' TP with "
             "an (efsdp, ep) expert mesh has not been run"),
            ("context_size", par.context_size, "expert parallel over the context-parallel ranks (torchtitan's "
             "efsdp = dp_shard x cp / ep) is not wired: fp8dist's EP borrows ranks from dp_shard only")):
        if size > 1:
            issues.append(Issue("parallel.expert_size", f"expert parallel with parallel.{key}={size}: {why}",
                                par.expert_size, f"set parallel.{key}=1, or parallel.expert_size=1"))
    if spec.adapter.enabled:
        issues.append(Issue("parallel.expert_size", "expert parallel with LoRA adapters: PEFT wraps Linears, the "
                            "experts are 3-D parameters, and an adapter run over an expert mesh has not been run",
                            par.expert_size, "set parallel.expert_size=1 with an adapter"))
    return issues


def _master_needs_mixed_precision(spec: Spec) -> list[Issue]:
    p = spec.precision
    if p.mixed_precision == "none" and p.master_weights != "none":
        return [Issue("precision.master_weights",
                      "a master copy only exists with mixed precision; without it the optimizer steps on "
                      "the weights as loaded", p.master_weights,
                      "set precision.master_weights=none, or turn on precision.mixed_precision=bf16")]
    if p.master_weights in ("bf16", "fp16") and p.master_weights != p.mixed_precision:
        return [Issue("precision.master_weights",
                      f"{p.master_weights} master weights need {p.master_weights} mixed precision",
                      p.master_weights, "use master_weights=fp32, or match mixed_precision")]
    return []


def _explicit_block_matches_backend(spec: Spec, explicit: Mapping[str, Any]) -> list[Issue]:
    blocks = written(explicit, "precision", "fp8") or {}
    in_use = blocks_in_use(spec.fp8)
    return [Issue(f"precision.fp8.{block}", f"these settings do nothing with backend '{spec.fp8.backend}'",
                  fix=f"set precision.fp8.backend={block}, or remove the block")
            for block in ("torchao", "te", "msamp") if block in blocks and block not in in_use]


def _loss_scaling(spec: Spec, explicit: Mapping[str, Any]) -> list[Issue]:
    """Loss scaling acts on fp16 compute only (what each engine does with it: its own rules)."""
    scaling, compute = written(explicit, "precision", "loss_scaling"), spec.precision.compute_dtype
    if scaling and compute != "fp16":
        return [Issue("precision.loss_scaling", f"loss scaling acts only on fp16 compute; the compute dtype here is "
                      f"{compute}, so these settings would do nothing", scaling,
                      "remove precision.loss_scaling, or set precision.mixed_precision=fp16")]
    return []


def _quantized_base(spec: Spec) -> list[Issue]:
    """adapter.base_dtype: nf4 runs on FSDP2 (fp8dist/backends/nf4.py; DeepSpeed's refusal is its rules'); what it
    cannot run with on any engine is refused here."""
    base, issues = spec.adapter.base_dtype, []
    if base == "int8":
        issues.append(Issue("adapter.base_dtype", "an 8-bit base (bitsandbytes LLM.int8) is not one fp8dist builds",
                            "int8", "adapter.base_dtype=nf4 (QLoRA's 4-bit base, FSDP2), or auto"))
    if base != "nf4":
        return issues
    if spec.fp8.enabled:
        issues.append(Issue("adapter.base_dtype", f"an NF4 base's GEMMs dequantize it to the compute dtype; FP8 "
                            f"(precision.fp8.backend={spec.fp8.backend}) would convert the same frozen Linears", "nf4",
                            "precision.fp8.backend=none with an NF4 base (preset bf16), or adapter.base_dtype=auto "
                            "for an FP8 base"))
    return issues


def _modules_to_save(spec: Spec) -> list[Issue]:
    """adapter.modules_to_save as PEFT runs it (peft 0.21 LoraConfig modules_to_save): what would change its meaning
    is refused here; a name the model lacks and a weight tied to another module, when the model loads
    (fp8dist/backends/adapters.py)."""
    ad, issues = spec.adapter, []
    saved = list(ad.modules_to_save)
    adapted = sorted(set(saved) & set(ad.target_modules)) if ad.target_modules != "auto" else []
    if adapted:
        issues.append(Issue("adapter.modules_to_save", f"{', '.join(adapted)} also in adapter.target_modules: PEFT "
                            "puts no adapter on a module to save (peft 0.21 tuners/tuners_utils.py "
                            "check_target_module_exists excludes it) and trains it whole, so the target would "
                            "silently get no adapter", saved, "name each module in one of the two lists"))
    if saved and spec.fp8.enabled:
        issues.append(Issue("adapter.modules_to_save", "PEFT renames a module to save (lm_head becomes "
                            "lm_head.modules_to_save.default, trained, beside the frozen lm_head.original_module), "
                            "and the FP8 module filter matches precision.fp8.modules against those names: "
                            f"precision.fp8.backend={spec.fp8.backend} would convert the trained copy of a Linear "
                            "its exclusions name", saved,
                            "precision.fp8.backend=none with adapter.modules_to_save (preset bf16), or remove "
                            "adapter.modules_to_save"))
    return issues


def _dora(spec: Spec) -> list[Issue]:
    """adapter.use_dora as PEFT runs it (peft 0.21 tuners/lora/dora.py DoraLinearLayer.forward): every forward reads
    the adapted Linear's base weight through utils/integrations.py dequantize_module_weight to take its row norms,
    and, where adapter dropout acts, runs the base GEMM again on the dropped-out input (F.linear of that weight)."""
    ad = spec.adapter
    issues: list[Issue] = []
    if not ad.use_dora:
        return issues
    if ad.base_dtype == "nf4":
        issues.append(Issue("adapter.use_dora", "PEFT reads a torchao base weight with weight.dequantize() and no "
                            "arguments, which NF4Tensor.dequantize does not take (it needs the NF4 code table): the "
                            "first forward fails (PEFT's QDoRA dequantizes bitsandbytes' 4-bit weights only)", True,
                            "adapter.use_dora=false with an NF4 base, or adapter.base_dtype=auto for DoRA"))
    if spec.float8_all_gather:
        issues.append(Issue("adapter.use_dora", "the frozen weights are all-gathered in float8 "
                            "(precision.fp8.torchao.enable_fsdp_float8_all_gather), so the base weight DoRA reads in "
                            "its forward is torchao's Float8TrainingTensor, which PEFT's dequantize() call cannot read "
                            "(torchao 0.18: aten.dequantize is not supported): the first forward fails", True,
                            "precision.fp8.torchao.enable_fsdp_float8_all_gather=false with DoRA (the weights are "
                            "then gathered in the load dtype and cast to FP8 in each GEMM), or adapter.use_dora=false"))
    if spec.fp8.enabled and ad.dropout > 0:
        issues.append(Issue("adapter.use_dora", f"with adapter.dropout={ad.dropout:g} DoRA computes each adapted "
                            "Linear's base output again from the dropped-out input (F.linear of the base weight): a "
                            "second GEMM of every FP8 Linear, run in the compute dtype, outside "
                            f"precision.fp8.backend={spec.fp8.backend}", True,
                            "adapter.dropout=0 with DoRA and FP8 (DoRA then reuses the FP8 GEMM's output), or "
                            "precision.fp8.backend=none"))
    return issues


def _adapter(spec: Spec, explicit: Mapping[str, Any]) -> list[Issue]:
    """LoRA composes with torchao's float8 conversion (the frozen base Linears convert, the adapters do not: a
    module filter on the names). MS-AMP and Transformer Engine replace or wrap every Linear's weight in their
    own types, under PEFT's layers; neither path runs here (both need a CUDA GPU), so neither is claimed."""
    ad, issues = spec.adapter, []
    settings = written(explicit, "adapter")
    settings = settings if isinstance(settings, Mapping) else {}
    if not ad.enabled:
        extra = sorted(k for k in settings if k != "kind")
        if extra:
            issues.append(Issue(f"adapter.{extra[0]}", f"adapter settings do nothing with adapter.kind=none "
                                f"({', '.join('adapter.' + k for k in extra)})", settings[extra[0]],
                                "set adapter.kind=lora, or remove them"))
        return issues
    issues += _quantized_base(spec) + _modules_to_save(spec) + _dora(spec)
    backend = spec.fp8.backend
    if backend == "msamp":
        issues.append(Issue("precision.fp8.backend", "MS-AMP casts every Linear weight to its ScalingTensor and its "
                            "optimizer steps them all; frozen base weights under LoRA adapters are not a regime it "
                            "has", "msamp", "use precision.fp8.backend=torchao with the adapter, or adapter.kind=none"))
    if backend == "te":
        issues.append(Issue("precision.fp8.backend", "Transformer Engine under LoRA is not a path fp8dist runs: "
                            "fp8dist applies PEFT before FP8 conversion, while PEFT's TE layers (peft 0.21 "
                            "tuners/lora/te.py) wrap te.Linear modules that already exist and cannot merge", "te",
                            "use precision.fp8.backend=torchao with the adapter, or adapter.kind=none"))
    if spec.parallel.cpu_ram_efficient_loading:
        issues.append(Issue("parallel.cpu_ram_efficient_loading", "the adapters are not in the model directory's "
                            "files, and shard-on-read loads only what the files hold", True,
                            "set parallel.cpu_ram_efficient_loading=false with adapter.kind=lora (an NF4 base, "
                            "adapter.base_dtype=nf4, is read from a model directory tensor by tensor without it: "
                            "each weight quantized as it is read)"))
    return issues
