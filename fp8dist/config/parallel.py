"""The run's parallel dimensions: one object that derives every mesh axis from the config and the world size
(pure, no torch), in the spirit of torchtitan's ParallelDims (torchtitan/distributed/parallel_dims.py) and
Accelerate's ParallelismConfig (accelerate 1.15 accelerate/parallelism_config.py).

Axes, outermost first (the order of the DeviceMesh and of the rank numbering):
- `pp`: pipeline parallel (`parallel.pipeline_size`): the model split by layer ranges into stages, each pipeline
  rank running `pp_stages_per_rank` of them (`pipeline_stages`, `stage_layers`); the ranks of one pipeline hold
  different layers and read the same batch;
- `dp_replicate`: copies of the model that only all-reduce gradients (HSDP's replicate dim, `parallel.sharding:
  replicate`);
- `dp_shard`: the ranks one copy is sharded over (FSDP2's shard dim; DeepSpeed's ZeRO partition group);
- `cp`: context parallel (`parallel.context_size`): the sequence split inside attention;
- `tp`: tensor parallel (`parallel.tensor_size`): each block's Linears split over its ranks; with sequence parallel
  (`parallel.sequence_parallel`) the activations between them split along the sequence too;
- `ep`: expert parallel (`parallel.expert_size`): each MoE layer's experts split whole over its ranks. EP is not a
  factor of the world size: it borrows its ranks from dp_shard (torchtitan parallel_dims.py, "EP borrows ranks from
  FSDP and TP: efsdp = dp_shard * cp * tp / ep"; fp8dist borrows from dp_shard only), so the experts live on a mesh
  of their own, (efsdp, ep), over the same ranks as dp_shard, and are FSDP-sharded over `efsdp`.
A new axis gets its config key, its size rule in `ParallelDims.of`, and its mesh dim here (the meshes are built
from these dims in one place, fp8dist.engines.mesh.build_meshes; docs/architecture.md lists the files an axis touches).

The data-parallel group is dp_replicate x dp_shard: the ranks that read different batches. Data loading,
checkpoints and the audit count data-parallel ranks (`data_rank`, `data_size`), which equal the global rank and
world size only while cp and tp are 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fp8dist.config.engines import TRAITS
from fp8dist.errors import Fp8distError
from fp8dist.facts.torch import PIPELINE_SCHEDULES

# The mesh dim names: the one place they are spelled (the meshes, the audit's axes and the estimate read them here).
PP, DP_REPLICATE, DP_SHARD, CP, TP = "pp", "dp_replicate", "dp_shard", "cp", "tp"
EP, EFSDP = "ep", "efsdp"  # the experts' own mesh (expert_mesh_shape)
FSDP = "dp_shard_cp"  # dp_shard x cp flattened: the dim FSDP shards a dense model over when cp > 1
# The dense mesh's dims, outermost first (torchtitan's order: pp, dp_replicate, dp_shard, cp, tp).
AXES = (PP, DP_REPLICATE, DP_SHARD, CP, TP)
# The axes whose collectives carry gradients and weight shards (FSDP's gathers and reductions, DDP's all-reduce).
DATA_AXES = (DP_REPLICATE, DP_SHARD, FSDP, EFSDP)

# How ranks already launched were given their number, for a fix said inside them (the commands that launch name
# their own flag: --nproc, --world-size).
RANKS_LAUNCHED = "torchrun --nproc_per_node / deepspeed --num_gpus"


@dataclass(frozen=True)
class ParallelDims:
    """The run's layout: built once per process with `ParallelDims.of(spec, world)` (and once by the commands that
    launch, before the ranks start), then handed down; nothing below recomputes it."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert parallel: borrowed from dp_shard, not a factor of `world_size` (see the module docstring)."""
    replicate_dim: bool = False
    """Keep the dp_replicate dim in the mesh at size 1 too: `parallel.sharding` hybrid and replicate name a 2-D
    (replicate, shard) layout, and FSDP2 runs HSDP on it as configured whatever the world size."""
    sequence_parallel: bool = False
    """`parallel.sequence_parallel` resolved (`sequence_parallel(spec)`): the activations between a block's
    tensor-parallel Linears split along the sequence too. Only with tp > 1."""
    pp: int = 1
    pp_stages_per_rank: int = 1
    """The stages each pipeline rank runs (`parallel.pipeline_stages_per_rank` resolved)."""
    pp_split: tuple[int, ...] = ()
    """The first layer of every stage after the first (`parallel.pipeline_split`); empty: even layer ranges."""

    def __post_init__(self) -> None:
        for axis in AXES + (EP,):
            if getattr(self, axis) < 1:
                raise ValueError(f"ParallelDims.{axis} must be >= 1, got {getattr(self, axis)}")
        if self.dp_shard % self.ep:
            raise ValueError(f"ParallelDims.ep={self.ep} must divide dp_shard={self.dp_shard}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("ParallelDims.sequence_parallel needs tp > 1")
        if self.pp_stages_per_rank < 1 or (self.pp_split and len(self.pp_split) != self.pipeline_stage_count - 1):
            raise ValueError(f"ParallelDims: pp_split {self.pp_split} must name {self.pipeline_stage_count - 1} "
                             "stage starts")

    @classmethod
    def of(cls, spec, world: int, world_flag: str = RANKS_LAUNCHED) -> ParallelDims:
        """The dims of `spec` on `world` ranks, or an Fp8distError naming the key when they do not fit (said when
        the ranks start, and by the launching commands before they do). tp and cp come first; the data axes are what
        is left of the world size (torchtitan's dp_shard = -1). `world_flag`: the option that sets the world size
        where the caller was given it (`--nproc`, `--world-size`), named with a world size that fits in the fix."""
        par = spec.parallel
        tp, cp, ep, pp = par.tensor_size, par.context_size, par.expert_size, par.pipeline_size
        sequence = sequence_parallel(spec)
        pipeline = dict(pp=pp, pp_stages_per_rank=pipeline_stages_per_rank(spec), pp_split=tuple(par.pipeline_split))
        if world % (pp * tp * cp):
            keys = " x ".join(f"parallel.{key}={value}" for key, value in (
                ("pipeline_size", pp), ("tensor_size", tp), ("context_size", cp)) if value > 1)
            raise Fp8distError(f"{keys} does not divide the {world} ranks of this job: the mesh is pp x dp_replicate "
                               f"x dp_shard x cp x tp = world size\n  fix: "
                               f"{_ranks_fix(world, pp * tp * cp, world_flag)}, or lower {keys.split('=')[0]} to a "
                               f"divisor of {world}")
        data = world // (pp * tp * cp)
        if par.sharding == "hybrid":
            size = par.shard_size
            if data % size:
                splitting = " x ".join(axis for axis, degree in ((PP, pp), (TP, tp), (CP, cp)) if degree > 1)
                left = (f"the {data} data-parallel ranks left by {splitting}" if splitting
                        else f"the {world} ranks of this job")
                raise Fp8distError(f"parallel.shard_size={size} does not divide {left}: hybrid sharding needs whole "
                                   f"shard groups\n  fix: set parallel.shard_size to a divisor of {data} (e.g. the "
                                   f"GPUs per node / tensor_size), or "
                                   f"{_ranks_fix(world, pp * tp * cp * size, world_flag)}")
            return cls(dp_replicate=data // size, dp_shard=size, cp=cp, tp=tp, replicate_dim=True,
                       sequence_parallel=sequence, **pipeline)
        if par.sharding == "replicate":
            return cls(dp_replicate=data, dp_shard=1, cp=cp, tp=tp, replicate_dim=True, sequence_parallel=sequence,
                       **pipeline)
        if data % ep:
            raise Fp8distError(f"parallel.expert_size={ep} does not divide the {data} data-parallel ranks of this "
                               f"job: expert parallel borrows its ranks from dp_shard, whole groups of {ep}\n  fix: "
                               f"{_ranks_fix(world, pp * tp * cp * ep, world_flag)}, or set parallel.expert_size to a "
                               f"divisor of {data}")
        return cls(dp_shard=data, cp=cp, tp=tp, ep=ep, sequence_parallel=sequence, **pipeline)

    # -- sizes ----------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def data_size(self) -> int:
        """The data-parallel ranks: how many different batches one step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """The ranks one copy of the dense model is sharded over: dp_shard x cp (torchtitan parallel_dims.py:
        "fsdp = dp_shard * cp"; the cp ranks of a batch hold different tokens but the same weights)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """The expert-data axis: the ranks that hold the same experts and FSDP-shard them."""
        return self.dp_shard // self.ep

    @property
    def seq_len_divisor(self) -> int:
        """What the sequence length must divide by: tp where sequence parallel shards it, 2 x cp where context
        parallel does (its load balancer cuts each cp shard in two; torchtitan ParallelDims.seq_len_divisor)."""
        return (self.tp if self.sequence_parallel else 1) * (2 * self.cp if self.cp > 1 else 1)

    # -- which axes are used ----------------------------------------------------------------------------------
    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def sizes(self) -> dict[str, int]:
        """Each dense mesh axis's size, outermost first (AXES), used or not."""
        return {axis: getattr(self, axis) for axis in AXES}

    def data_rank(self, rank: int) -> int:
        """The data-parallel index of global `rank`: the ranks of one cp x tp group, and the pipeline ranks of one
        data rank, read the same batch."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return (rank % (self.world_size // self.pp)) // (self.cp * self.tp)

    def pp_rank(self, rank: int) -> int:
        """The pipeline rank of global `rank` (pp is the outermost dim)."""
        return rank // (self.world_size // self.pp)

    # -- the pipeline's stages --------------------------------------------------------------------------------
    @property
    def pipeline_stage_count(self) -> int:
        return self.pp * self.pp_stages_per_rank

    def pipeline_stages(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank `pp_rank` runs: pp_rank, pp_rank + pp, ... (the looped placement torch's
        interleaved schedules expect, torch 2.13 torch/distributed/pipelining/schedules.py)."""
        return tuple(pp_rank + k * self.pp for k in range(self.pp_stages_per_rank))

    def stage_layers(self, num_layers: int) -> list[range]:
        """Each stage's decoder layers: even ranges, or those `pp_split` starts."""
        count = self.pipeline_stage_count
        if self.pp_split:
            starts = [0, *self.pp_split, num_layers]
        elif num_layers % count == 0:
            starts = [num_layers // count * k for k in range(count + 1)]
        else:
            raise ValueError(f"{num_layers} layers do not split into {count} even stages")
        return [range(starts[k], starts[k + 1]) for k in range(count)]

    # -- the meshes' shapes (built by fp8dist.engines.mesh.build_meshes) ----------------------------------------
    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(dim names, sizes) of the DeviceMesh: (dp_replicate, dp_shard) when ranks replicate or the layout
        names the replicate dim (FSDP2 wants a named 2-D mesh for HSDP and replicate, torch 2.13 _fsdp_init.py
        _validate_mesh), else a 1-D shard mesh; cp and tp only when they are used."""
        dims = [(PP, self.pp)] if self.pp > 1 else []
        dims += [(DP_REPLICATE, self.dp_replicate)] if self.dp_replicate > 1 or self.replicate_dim else []
        dims.append((DP_SHARD, self.dp_shard))
        dims += [(axis, getattr(self, axis)) for axis in (CP, TP) if getattr(self, axis) > 1]
        return tuple(name for name, _ in dims), tuple(size for _, size in dims)

    def data_mesh_dims(self) -> tuple[tuple[str, ...], str | None]:
        """The dims of the dense mesh FSDP shards over, outermost first, and the name they are flattened to (None:
        used as they are): dp_replicate (when in the mesh) and dp_shard, with cp folded into the shard dim."""
        names = self.mesh_shape()[0]
        replicate = (DP_REPLICATE,) if DP_REPLICATE in names else ()
        if self.cp_enabled:
            return replicate + (DP_SHARD, CP), FSDP
        return replicate + (DP_SHARD,), None

    def expert_mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(dim names, sizes) of the experts' DeviceMesh: dp_shard's ranks as (efsdp, ep), ep innermost (the ranks
        of one ep group are neighbours, as in torchtitan's sparse mesh)."""
        return (EFSDP, EP), (self.efsdp, self.ep)

    # -- does this model split --------------------------------------------------------------------------------
    def _check_pipeline(self, config: Mapping[str, Any], problems: list[str], fixes: list[str]) -> None:
        """The decoder layers split into the stages (even ranges, or `pipeline_split` within the layers), and no
        LM head tied to the embeddings, which live on the first and the last stage."""
        layers, count = config.get("num_hidden_layers"), self.pipeline_stage_count
        if not isinstance(layers, int):
            problems.append("its config names no num_hidden_layers for the pipeline stages to split")
            fixes.append("parallel.pipeline_size=1 for this model")
        elif self.pp_split:
            if list(self.pp_split) != sorted(set(self.pp_split)) or self.pp_split[-1] >= layers:
                problems.append(f"parallel.pipeline_split={list(self.pp_split)} is not increasing layer indices "
                                f"below its {layers} layers")
                fixes.append(f"parallel.pipeline_split: {count - 1} increasing indices between 1 and {layers - 1}")
        elif layers % count:
            problems.append(f"its {layers} layers do not split evenly into {count} pipeline stages (pipeline_size "
                            f"{self.pp} x {self.pp_stages_per_rank} stages per rank)")
            fixes.append(f"parallel.pipeline_split with {count - 1} stage starts, or a pipeline_size x "
                         f"pipeline_stages_per_rank that divides {layers}")
        if config.get("tie_word_embeddings"):
            problems.append("its LM head is tied to its embeddings (tie_word_embeddings), which live on the first "
                            "and the last pipeline stage, on different ranks, where they would train apart")
            fixes.append("parallel.pipeline_size=1 for this model")

    def check_model(self, config: Mapping[str, Any], seq_len: int, *, source: str) -> None:
        """Refuse, before any weight is loaded, a mesh the model cannot be split on: heads, KV heads, hidden and MLP
        sizes by tp (each rank holds whole heads: torchtitan and DeepSpeed AutoTP distribute heads whole); experts
        whole by ep; the sequence length by `seq_len_divisor`. `config`: the model's config.json values; `source`:
        where they come from, for the message."""
        problems, fixes = [], []
        experts = expert_count(config)
        if self.ep > 1 and (not experts or experts % self.ep):
            problems.append(f"its {experts or 'no'} MoE experts do not split whole over parallel.expert_size="
                            f"{self.ep}" if experts else f"it has no MoE experts for parallel.expert_size={self.ep} "
                            "to split")
            fixes.append(f"a parallel.expert_size that divides {experts}" if experts else "parallel.expert_size=1")
        if self.tp > 1 and experts > 1:
            problems.append(f"it has {experts} MoE experts, which fp8dist's tensor parallel does not split (routed "
                            "experts are expert parallel's: torchao's MoE tutorial recommends against TP on them)")
            fixes.append("parallel.tensor_size=1 for this model")
        if self.tp > 1:
            for key, what in _TP_DIVIDES:
                value = config.get(key)
                if isinstance(value, int) and value % self.tp:
                    problems.append(f"{what} ({key}={value}) do not divide by parallel.tensor_size={self.tp}")
            if len(problems) > len(fixes):
                fixes.append("a parallel.tensor_size that divides every size named, or parallel.tensor_size=1")
        factors = ([f"tp {self.tp}"] if self.sequence_parallel else []) + (
            [f"2 x cp {self.cp}"] if self.cp > 1 else [])
        divisor = self.seq_len_divisor
        if self.pp > 1:
            self._check_pipeline(config, problems, fixes)
        if divisor > 1 and seq_len % divisor:
            problems.append(f"the sequence length (train.seq_len={seq_len}) does not divide by {divisor} "
                            f"({' x '.join(factors)}: each rank holds an equal slice of the sequence)")
            fixes.append(f"train.seq_len={-(-seq_len // divisor) * divisor} (a multiple of {divisor})")
        if problems:
            raise Fp8distError(f"{source}: the model does not split on this mesh: " + "; ".join(problems)
                               + "\n  fix: " + "; ".join(dict.fromkeys(fixes)))


def _ranks_fix(world: int, multiple: int, world_flag: str) -> str:
    """'run on a multiple of M ranks (--nproc N)': N the first multiple at or above `world`."""
    fits = -(-world // multiple) * multiple
    named = " / ".join(f"{flag} {fits}" for flag in world_flag.split(" / "))
    return f"run on a multiple of {multiple} ranks ({named})"


def pipeline_stages_per_rank(spec) -> int:
    """`parallel.pipeline_stages_per_rank` resolved: `auto` is 2 for the schedules that run several stages per rank
    (fp8dist.facts.torch PIPELINE_SCHEDULES), else 1."""
    value = spec.parallel.pipeline_stages_per_rank
    if value != "auto":
        return int(value)
    multi_stage = PIPELINE_SCHEDULES[spec.parallel.pipeline_schedule].multi_stage
    return 2 if spec.parallel.pipeline_size > 1 and multi_stage else 1


def pipeline_bubble(pipeline_size: int, stages_per_rank: int, microbatches: int) -> float:
    """The idle fraction of a step a pipeline schedule has by design: (P - 1) / (V x M + P - 1) for P pipeline
    ranks, V stages per rank and M microbatches (GPipe and 1F1B: V = 1, Huang et al. 2019, Narayanan et al. 2021
    sec. 2.2; interleaved: V stages, ibid. 2.2.1). The zero-bubble schedule fills part of it with weight gradients
    (arXiv 2401.10241): for it, this is the bound it starts from. The one place the formula is written (the
    engine's PipelinePlan and the estimate's step read it)."""
    if min(pipeline_size, stages_per_rank, microbatches) < 1:
        raise ValueError(f"pipeline_bubble needs sizes >= 1, got P={pipeline_size}, V={stages_per_rank}, "
                         f"M={microbatches}")
    return (pipeline_size - 1) / (stages_per_rank * microbatches + pipeline_size - 1)


def pipeline_microbatches(spec) -> int:
    """`parallel.pipeline_microbatches` resolved: `auto` is 2 x pipeline_size."""
    value = spec.parallel.pipeline_microbatches
    return 2 * spec.parallel.pipeline_size if value == "auto" else int(value)


def sequence_parallel(spec) -> bool:
    """`parallel.sequence_parallel` resolved from the config alone (the pure translation says it; a run reads
    ParallelDims.sequence_parallel): `auto` is on where the engine's tensor parallel can shard the sequence
    (FSDP2's DTensor plans; DeepSpeed AutoTP has no sequence parallel) and tensor_size > 1."""
    value = spec.parallel.sequence_parallel
    if value == "auto":  # off with pipeline parallel, whose stages exchange whole-sequence activations
        return (spec.parallel.tensor_size > 1 and TRAITS[spec.engine].sequence_parallel
                and spec.parallel.pipeline_size == 1)
    return bool(value) and spec.parallel.tensor_size > 1


# What each mesh axis must divide in a Hugging Face config (the names transformers 5 uses across decoder models).
_TP_DIVIDES = (("num_attention_heads", "attention heads"), ("num_key_value_heads", "KV heads"),
               ("hidden_size", "hidden size"), ("intermediate_size", "MLP size"))
# Mixtral; Qwen2/3-MoE, OLMoE; DeepSeek-V2/V3, GLM4-MoE (transformers 5 configuration files)
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def expert_count(config: Mapping[str, Any]) -> int:
    """The routed experts per MoE layer of a Hugging Face config.json (0: a dense model); a composite model's (Llama 4,
    Qwen3-VL-MoE) from its `text_config`."""
    count = next((config[key] for key in _EXPERT_COUNTS if isinstance(config.get(key), int)), 0)
    text = config.get("text_config")
    return count or (expert_count(text) if isinstance(text, Mapping) else 0)
