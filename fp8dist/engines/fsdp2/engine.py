"""FSDP2 engine: execute the plan of fp8dist.translate.fsdp2 on a real model.

The order of model transforms is written once, as code: `TRANSFORMS` below (torchtitan parallelize_llama,
Accelerate fsdp2_prepare_model), then (meta-built models) materialise the shards and load the weights, then the
optimizer. Compiling blocks in place before sharding (torchtitan apply_compile: "per-TransformerBlock compile
... before FSDP") keeps the root an FSDPModule, so gradient accumulation still skips the reduce-scatter of all but
the last micro-batch. The optimizer gets a step post-hook for the backend (torchao float8 scale precompute); fp16
compute gets the loss scaler (engines/loss_scaling.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

import fp8dist.engines.activation_checkpointing as activation_checkpointing
from fp8dist.backends.base import get_backend
from fp8dist.config.spec import Spec
from fp8dist.config.parallel import ParallelDims
from fp8dist.dtypes import torch_dtype
from fp8dist.engines.advice import advise_small_gemms, say, say_when_fp8_is_kept_off_every_linear
from fp8dist.engines.base import Engine, FirstStepAudit, forward_loss, training_mode
from fp8dist.engines.blocks import wrap_units
from fp8dist.engines.fsdp2.checkpointing import Checkpointing
from fp8dist.engines.fsdp2.clipping import clip_grad_norm_
import fp8dist.engines.fsdp2.context_parallel as context_parallel
import fp8dist.engines.fsdp2.expert_parallel as expert_parallel
import fp8dist.engines.fsdp2.pipeline_parallel as pipeline_parallel
import fp8dist.engines.fsdp2.tensor_parallel as tensor_parallel
from fp8dist.engines.mesh import Meshes, build_meshes, device_type
from fp8dist.engines.inspector import Inspector
from fp8dist.engines.loss_scaling import DynamicLossScaler, StepOutcome
from fp8dist.engines.optim import build_optimizer, trainable_parameters
from fp8dist.errors import Fp8distError
from fp8dist.machine import device_info
from fp8dist.translate.fsdp2 import FSDP2Plan, TorchaoFloat8Plan, to_fsdp2


class FSDP2Run(Engine):
    """What `prepare` made: the sharded model, its optimizer, and what was decided on the way."""

    name = "fsdp2"

    def __init__(self, model, optimizer, backend, plan: FSDP2Plan, spec: Spec, decisions: list, wrapped: list[str],
                 scaler: DynamicLossScaler | None, *, audit: str | None = None,
                 first_step_audit: FirstStepAudit | None = None,
                 tensor_parallel_plan: tensor_parallel.TensorParallelPlan | None = None, cp_mesh=None,
                 expert_parallel_plan: expert_parallel.ExpertParallelPlan | None = None,
                 pipeline: pipeline_parallel.PipelineSchedule | None = None):
        super().__init__(spec, backend, decisions, audit=audit, first_step_audit=first_step_audit)
        self.model, self.optimizer, self.plan, self.wrapped = model, optimizer, plan, wrapped
        self.tensor_parallel = tensor_parallel_plan  # None: no tp axis
        self.cp_mesh = cp_mesh  # None: no cp axis (fp8dist/engines/fsdp2/context_parallel.py)
        self.expert_parallel = expert_parallel_plan  # None: no ep axis
        self.pipeline = pipeline  # None: no pp axis
        self.scaler = scaler  # fp16 compute only
        self.clip = spec.train.gradient_clipping
        self.last_step: StepOutcome | None = None  # how the fp16 loss scale moved on the last step

    def accumulate(self, batches: list[dict]) -> float:
        """Forward and backward over `batches` (reduce-scatter on the last micro-batch only); the loss is scaled
        where fp16 compute needs it. Returns the mean loss."""
        if self.pipeline is not None:  # the schedule runs each micro-batch's forward and backward over the stages
            return sum(self.pipeline.step(batch, 1 / len(batches)).item() for batch in batches) / len(batches)
        total = 0.0
        for i, batch in enumerate(batches):
            self.model.set_requires_gradient_sync(i == len(batches) - 1)
            if self.cp_mesh is not None:
                batch = context_parallel.split_batch(batch)
            with (context_parallel.sharded_sequence(self.cp_mesh, batch) if self.cp_mesh is not None
                  else contextlib.nullcontext()):
                with self.backend.forward_context():
                    loss = forward_loss(self.model, batch) / len(batches)
                (self.scaler.scale_loss(loss) if self.scaler else loss).backward()
            total += loss.detach().float().item()
        if self.cp_mesh is not None:  # each cp rank's loss is its slice's mean: the step's is their mean
            mean = torch.tensor(total, device=self.input_device)
            dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=self.cp_mesh.get_group())
            total = mean.item()
        return total

    def apply_gradients(self) -> bool:
        """Unscale (fp16), clip and step; False when the step was skipped because some rank saw a non-finite
        gradient (all ranks skip together; `last_step` says how the scale moved)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.scaler is not None:
            overflow = self.scaler.found_inf_anywhere(params)
            self.last_step = self.scaler.update(overflow)
            if overflow:
                self.optimizer.zero_grad(set_to_none=True)
                return False
            self.scaler.unscale_(params)
        if self.clip > 0 and self.pipeline is not None:  # the norm over every stage's gradients
            clip_grad_norm_(params, self.clip, across=self.pipeline.group)
        elif self.clip > 0 and (self.tensor_parallel is not None or self.expert_parallel is not None):
            clip_grad_norm_(params, self.clip)  # gradients on (dp, tp) or (efsdp, ep) and dp meshes
        elif self.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def full_weights(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {name: _unwrapped_float8_weight(cast(torch.Tensor, tensor)).detach().to("cpu", copy=True)
                for name, tensor in state.items()}

    @contextlib.contextmanager
    def weights(self, full: dict[str, Any]):
        """Loads `full` into the shards (torch's set_model_state_dict distributes each whole tensor over its
        placements) and, after the block, this run's own shards copied aside before: bitwise what they were. The
        float8 scales precomputed for the all-gather follow each load, as after a checkpoint load."""
        own: dict[str, Any] = {name: cast(torch.Tensor, tensor).detach().clone()
                               for name, tensor in get_model_state_dict(self.model).items()}
        if set(full) != set(own):
            raise Fp8distError("the two runs' models name different parameters: "
                               f"{sorted(set(full) ^ set(own))[:6]}\n  fix: compare configs that build the same "
                               "model (the same adapter section)")
        try:
            set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))
            self.backend.after_optimizer_step(self.model)
            yield
        finally:
            set_model_state_dict(self.model, own)
            self.backend.after_optimizer_step(self.model)

    def probe(self, batch: dict) -> tuple[float, float]:
        scale = self.scaler.scale if self.scaler is not None else 1.0
        loss = self.accumulate([batch])
        self.optimizer.zero_grad(set_to_none=True)
        return loss, scale

    @property
    def skipped_note(self) -> str | None:
        step = self.last_step
        if step is None or not step.skipped:
            return None
        return (f"skipped on every rank (non-finite gradients; loss scale {step.scale_before:g} -> "
                f"{step.scale_after:g})")

    def checkpointing(self, model_name: str = "", scheduler=None) -> Checkpointing:
        return Checkpointing(self, model_name, scheduler)

    def inspector(self) -> Inspector:
        return Inspector("fsdp2", self.model, self.optimizer, self.decisions)

    @property
    def input_device(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"


def _dtype(name):
    return None if name is None else torch_dtype(name)


@dataclass
class _Preparing:
    """What the transforms of one `prepare` share: each step reads what the steps before it left."""

    model: Any
    spec: Spec
    plan: FSDP2Plan
    backend: Any
    meshes: Meshes
    unsharded: set = field(default_factory=set)  # weights FSDP2 leaves alone (QLoRA's NF4 base on one rank)
    decisions: list = field(default_factory=list)  # the backend's per-Linear FP8 decisions
    tensor_parallel: tensor_parallel.TensorParallelPlan | None = None
    expert_parallel: expert_parallel.ExpertParallelPlan | None = None
    units: list = field(default_factory=list)  # (name, module) of the blocks fully_shard wraps one by one
    stages: list = field(default_factory=list)  # this rank's pipeline stages (each an FSDP2 root), or none
    pipeline: pipeline_parallel.PipelinePlan | None = None

    def roots(self) -> list:
        """The modules fully_shard makes roots: this rank's pipeline stages, or the model."""
        return self.stages or [self.model]


def _upcast_trainable(state: _Preparing) -> None:
    """Only what the optimizer steps gets a master copy: frozen weights (an adapter run's base) keep the load dtype.
    FSDP2 wants one original dtype among a group's trainable parameters only (torch 2.13 _fsdp_param_group.py
    _init_mp_dtypes), so frozen bf16 beside fp32 adapters shard together."""
    if state.plan.upcast_before_shard:
        master = _dtype(state.plan.upcast_before_shard)
        for param in state.model.parameters():
            if param.requires_grad and param.is_floating_point() and param.dtype != master:
                param.data = param.data.to(master)


def _quantize_nf4_base(state: _Preparing) -> None:
    """QLoRA: the frozen base in NF4, before sharding."""
    if state.spec.adapter.enabled and state.spec.adapter.base_dtype == "nf4":
        state.unsharded = _quantize_base(state.model, state.meshes.dims.fsdp_size)


def _convert_before_tensor_parallel(state: _Preparing) -> None:
    """torchao float8 (and TE / MS-AMP) convert the whole Linears, before tensor parallel splits them."""
    if not state.backend.converts_after_tensor_parallel:
        state.decisions = state.backend.convert_module(state.model)


def _split_tensor_parallel(state: _Preparing) -> None:
    section, tp_mesh = state.plan.tensor_parallel, state.meshes.tp
    if section is None or tp_mesh is None:
        return
    state.tensor_parallel = tensor_parallel.apply(state.model, tp_mesh, sequence_parallel=section.sequence_parallel)
    if state.tensor_parallel.float8_styles and dist.get_backend() == "gloo":
        # imported only here: it builds on torchao's float8 op table (tests/unit: no import otherwise)
        from fp8dist.engines.fsdp2.collectives import carry_float8_tensor_parallel_over_gloo

        carry_float8_tensor_parallel_over_gloo()
    say("tensor-parallel", state.tensor_parallel.summary())


def _convert_after_tensor_parallel(state: _Preparing) -> None:
    """MXFP8 converts after tensor parallel: torchao wraps the DTensor weights."""
    if state.backend.converts_after_tensor_parallel:
        state.decisions = state.backend.convert_module(state.model)
    say_when_fp8_is_kept_off_every_linear(state.decisions)


def _split_experts(state: _Preparing) -> None:
    """Expert parallel, after the conversions (they choose the experts' implementation)."""
    if state.meshes.expert_parallel is not None:
        state.expert_parallel = expert_parallel.apply(state.model, state.meshes.expert_parallel)
        say("expert-parallel", state.expert_parallel.summary())
    advise_small_gemms(state.spec, state.model)


def _checkpoint_activations(state: _Preparing) -> None:
    state.units = activation_checkpointing.apply(state.model, wrap_units(state.model, state.spec),
                                                 state.plan.activation_checkpointing, state.backend)


def _compile_blocks(state: _Preparing) -> None:
    """torch.compile per block, in place: the module object (and so the FSDP unit) stays the same."""
    if state.plan.compile:
        for unit in [unit for _, unit in state.units] or [state.model]:
            unit.compile()


def _split_pipeline(state: _Preparing) -> None:
    """Pipeline parallel: this rank's stages of the converted, split, wrapped and compiled model; the model keeps
    only their modules (engines/fsdp2/pipeline_parallel.py)."""
    section, meshes = state.plan.pipeline, state.meshes
    if section is None or meshes.pp is None:
        return
    state.stages, state.pipeline = pipeline_parallel.keep_own_stages(state.model, meshes.dims,
                                                                    meshes.pp.get_local_rank(), section)
    own = {id(module) for stage in state.stages for module in stage.modules()}
    state.units = [(name, unit) for name, unit in state.units if id(unit) in own]
    say("pipeline-parallel", state.pipeline.summary())


def _shard(state: _Preparing) -> None:
    """fully_shard the experts (on their own mesh), each block, then the root (each pipeline stage), on the data
    mesh."""
    plan, meshes = state.plan, state.meshes
    mp = plan.mixed_precision_policy
    policy = dict(param_dtype=_dtype(mp.param_dtype), reduce_dtype=_dtype(mp.reduce_dtype),
                  cast_forward_inputs=mp.cast_forward_inputs)
    # output_dtype applies to the model's outputs, so only the root gets it: a block returning it would hand
    # the next block (or a root-owned norm / lm_head) inputs in another dtype than its weights.
    block_policy = MixedPrecisionPolicy(**policy)
    root_policy = MixedPrecisionPolicy(**policy, output_dtype=_dtype(mp.output_dtype))
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if plan.offload_policy else OffloadPolicy()
    reshard = plan.sharding.reshard_after_forward
    if meshes.expert_data is not None:  # the experts first: their blocks' fully_shard then leaves them alone
        expert_parallel.shard(state.model, meshes.expert_data, meshes.dims.dp_shard, mp_policy=block_policy,
                              reshard_after_forward=reshard, offload_policy=offload)
    for _, unit in state.units:
        fully_shard(unit, mesh=meshes.data, mp_policy=block_policy, reshard_after_forward=reshard,
                    offload_policy=offload, ignored_params=state.unsharded)
    for root in state.roots():
        fully_shard(root, mesh=meshes.data, mp_policy=root_policy, offload_policy=offload,
                    reshard_after_forward=plan.sharding.root_reshard_after_forward, ignored_params=state.unsharded)


def _gather_float8_over_gloo(state: _Preparing) -> None:
    """torchao's float8 all-gather on gloo goes through a byte view (elsewhere the default collective carries
    float8)."""
    float8 = state.plan.float8
    if (dist.get_backend() == "gloo" and isinstance(float8, TorchaoFloat8Plan)
            and float8.float8_linear_config.enable_fsdp_float8_all_gather):
        # imported only here: it builds on torch's private FSDP2 collectives (tests/unit: no import otherwise)
        from fp8dist.engines.fsdp2.collectives import ByteViewAllGather

        for module in {id(m): m for root in state.roots() for m in root.modules()}.values():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(ByteViewAllGather())


# The order of model transforms, written once (torchtitan parallelize_llama, Accelerate fsdp2_prepare_model); the
# docs point here. Materialising a meta-built model's shards and loading its weights follows, then the optimizer.
TRANSFORMS: tuple[tuple[str, Callable[[_Preparing], None]], ...] = (
    ("upcast trainable parameters to the master dtype", _upcast_trainable),
    ("a QLoRA base in NF4", _quantize_nf4_base),
    ("float8 conversion (torchao tensorwise / rowwise, TE, MS-AMP)", _convert_before_tensor_parallel),
    ("tensor parallel on the tp mesh", _split_tensor_parallel),
    ("MXFP8 conversion (after tensor parallel)", _convert_after_tensor_parallel),
    ("expert parallel on the experts' mesh", _split_experts),
    ("activation checkpointing", _checkpoint_activations),
    ("torch.compile per block", _compile_blocks),
    ("pipeline parallel: this rank's stages on the pp mesh", _split_pipeline),
    ("fully_shard: experts, blocks, root", _shard),
    ("float8 all-gather's collective", _gather_float8_over_gloo),
)


def prepare(model, spec: Spec, meshes: Meshes | None = None, *, optimizer=None, audit: str | None = None,
            materialize=None, plan: FSDP2Plan | None = None,
            first_step_audit: FirstStepAudit | None = None) -> FSDP2Run:
    """Make `model` an FSDP2 model with the precision of `spec`, and build its optimizer.

    `meshes`: the run's meshes (fp8dist.engines.mesh.build_meshes; default: those `parallel` describes on this
    world, over the default process group).
    `optimizer`: a callable params -> optimizer (called on the sharded parameters); default: the config's.
    `audit`: what the audit of the first `train_step` does (warn | raise | off); default: audit.first_step.
    `materialize`: for a model built on the meta device (fp8dist.runtime.loading.ShardOnRead), allocates the
    local shards and loads the weights once the model is sharded.
    `plan`: the run's translation (fp8dist.translate.fsdp2.to_fsdp2), when the caller made it already.
    `first_step_audit`: the audit of the first step (default: fp8dist.audit's, fp8dist.engines.base).
    """
    if not dist.is_initialized():
        raise Fp8distError("fp8dist.engines.fsdp2.prepare needs torch.distributed initialised "
                           "(launch with torchrun; see launch/train.py)")
    plan = plan or to_fsdp2(spec)
    backend = get_backend(spec, plan)
    device = device_info()
    backend.check_environment(device)
    backend.resolve_speed_rule(device)  # precision.fp8.min_speedup on this device (or hardware.gpu)
    training_mode(model)
    meshes = meshes or build_meshes(ParallelDims.of(spec, dist.get_world_size()))
    _check_model_splits(model, spec, meshes.dims)
    state = _Preparing(model, spec, plan, backend, meshes)
    for _, transform in TRANSFORMS:
        transform(state)
    if materialize is not None:  # offloaded shards live on the CPU (torchtitan enable_cpu_offload)
        materialize.materialize(model, "cpu" if plan.offload_policy else device_type())

    optimizer = (optimizer or (lambda params: build_optimizer(params, spec)))(trainable_parameters(model))
    optimizer.register_step_post_hook(lambda *_: backend.after_optimizer_step(model))
    scaler = DynamicLossScaler(spec.precision.loss_scaling) if plan.loss_scaling else None  # ranks agree on a skip
    model.fp8dist_decisions = state.decisions  # for an inspector that recognises the model (fp8dist.audit.watch)
    model.fp8dist_pipeline_mesh = meshes.pp  # likewise: the ranks that hold the other stages (or None)
    pipeline = None
    if state.pipeline is not None:
        pipeline = pipeline_parallel.PipelineSchedule(
            state.stages, state.pipeline, meshes.pp, torch.device(device_type()),
            loss=lambda logits, labels: model.loss_function(logits=logits, labels=labels,
                                                            vocab_size=model.config.vocab_size))
    return FSDP2Run(model, optimizer, backend, plan, spec, state.decisions, [name for name, _ in state.units],
                    scaler, audit=audit, first_step_audit=first_step_audit,
                    tensor_parallel_plan=state.tensor_parallel, cp_mesh=meshes.cp,
                    expert_parallel_plan=state.expert_parallel, pipeline=pipeline)


def _quantize_base(model, shards: int) -> set[torch.nn.Parameter]:
    """The frozen Linears in NF4 (fp8dist/backends/nf4.py); the run says which stayed in their dtype and why.
    Returns the NF4 weights FSDP2 must leave alone: on a shard group of one rank, all of them. torch 2.13's FSDP2
    skips the all-gather there and hands `fsdp_post_all_gather` only the first of the tensors NF4Tensor's
    `fsdp_pre_all_gather` returns (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py wait_for_unshard;
    open upstream: https://github.com/pytorch/pytorch/pull/197999), which fails; one rank's weights are whole
    anyway, and frozen weights have no gradient to reduce."""
    from fp8dist.backends.nf4 import quantize_frozen_base

    quantized, kept = quantize_frozen_base(model, shards)
    if not quantized:
        raise Fp8distError(f"adapter.base_dtype=nf4: no frozen Linear of {type(model).__name__} fits NF4's blocks on "
                           f"{shards} shard(s) ({'; '.join(f'{k}: {v}' for k, v in list(kept.items())[:3])})\n  fix: "
                           "adapter.base_dtype=auto for this model")
    if kept:
        by_reason: dict[str, list[str]] = {}
        for name, why in kept.items():
            by_reason.setdefault(why, []).append(name)
        say("nf4_base", f"adapter.base_dtype=nf4: {len(quantized)} frozen Linears in NF4; kept in their dtype: "
            + "; ".join(f"{', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''} ({why})"
                        for why, names in by_reason.items())
            + "; biases, norms, embeddings and MoE experts (not Linears) stay in it too")
    if shards > 1:
        return set()
    modules = dict(model.named_modules())
    return {modules[name].weight for name in quantized}


def _check_model_splits(model, spec: Spec, dims: ParallelDims) -> None:
    """The checks that need the model itself (a factory model was not seen before the ranks started): its sizes
    split on the mesh (ParallelDims.check_model); no MoE experts under tensor parallel (splitting experts is expert
    parallel's); a causal LM under context parallel."""
    from fp8dist.backends.experts import experts_modules

    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        dims.check_model(config.to_dict(), spec.train.seq_len, source=type(model).__name__)
    if dims.tp_enabled and experts_modules(model):
        raise Fp8distError(f"{type(model).__name__} has MoE experts: fp8dist's tensor parallel splits dense "
                           "Linears and does not split experts (torchtitan recommends expert parallel for routed "
                           "experts)\n  fix: parallel.tensor_size=1 for MoE models")
    if dims.cp_enabled and getattr(model, "loss_function", None) is None:
        raise Fp8distError(f"parallel.context_size={dims.cp}: context parallel splits a causal language "
                           f"model's sequence and gives it the whole sequence's positions and shifted labels; "
                           f"{type(model).__name__} is not a transformers model that takes them\n  fix: "
                           "parallel.context_size=1 for this model")


def _unwrapped_float8_weight(tensor: torch.Tensor) -> torch.Tensor:
    """The high-precision tensor inside torchao's float8 all-gather wrapper (WeightWithDynamicFloat8CastTensor keeps
    it as `_tensor`, torchao 0.18 float8/fsdp_utils.py); any other tensor as it is."""
    inner = getattr(tensor, "_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else tensor


def setup(model, spec: Spec, **kwargs) -> FSDP2Run:
    """The registry's entry (fp8dist.engines.registry)."""
    return prepare(model, spec, **kwargs)


# The functions of the public API before the engine interface (README; the run's methods do the work).
def accumulate_gradients(run: FSDP2Run, batches: list[dict]) -> float:
    return run.accumulate(batches)


def apply_gradients(run: FSDP2Run, clip: float | None = None) -> bool:
    if clip is not None:
        run.clip = clip
    return run.apply_gradients()


def train_step(run: FSDP2Run, batches: list[dict], clip: float | None = None) -> float:
    """One optimizer step over `batches`; the first one under the dtype audit (see Engine.train_step)."""
    if clip is not None:
        run.clip = clip
    return run.train_step(batches)
