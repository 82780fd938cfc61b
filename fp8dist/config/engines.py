"""What the config layer must know of each engine to validate a config and derive its values, by the schema's
`engine` value. Pure, no torch. Everything else about an engine (its translation, where it keeps each number, how
it loads, launches and offloads) lives in its own package, fp8dist/engines/<name>/, behind the typed
fp8dist.engines.profile.EngineProfile; its config rules in fp8dist/config/rules/<name>.py.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineTraits:
    gathers_float8: bool
    """Whether the engine can all-gather torchao's float8 weights (`enable_fsdp_float8_all_gather`): FSDP2's
    fully_shard runs torchao's fsdp_pre_all_gather / fsdp_post_all_gather extension (torchao 0.18
    torchao/float8/fsdp_utils.py WeightWithDynamicFloat8CastTensor); DeepSpeed gathers its partitions in the module
    dtype."""
    sequence_parallel: bool
    """Whether the engine's tensor parallel can also shard activations along the sequence (FSDP2: DTensor
    SequenceParallel styles, torch 2.13 torch/distributed/tensor/parallel/style.py; DeepSpeed AutoTP has no such
    mode, deepspeed 0.19 module_inject/auto_tp.py: its sequence parallel is Ulysses, a separate axis)."""
    own_expert_parallel: bool
    """Whether `parallel.expert_size` runs fp8dist's expert parallel (its expert mesh and token dispatch in the
    compute dtype: FSDP2) rather than a layer and layout the engine keeps itself (DeepSpeed AutoEP, deepspeed 0.19
    moe/ep_*.py), which the audit's rows and the estimate do not model."""


TRAITS: dict[str, EngineTraits] = {
    "fsdp2": EngineTraits(gathers_float8=True, sequence_parallel=True, own_expert_parallel=True),
    "deepspeed": EngineTraits(gathers_float8=False, sequence_parallel=False, own_expert_parallel=False),
}
