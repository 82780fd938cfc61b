"""PyTorch and FSDP2: the releases fp8dist needs, and why."""
from __future__ import annotations

from dataclasses import dataclass

from fp8dist.facts.versions import Version, fmt

# fully_shard is public at torch.distributed.fsdp from torch 2.6 (pytorch/pytorch#141868).
TORCH_FSDP2_PUBLIC = (2, 6, 0)
# FSDPModule.set_custom_all_gather / set_custom_reduce_scatter (torch/distributed/fsdp/_fully_shard/_fully_shard.py;
# DefaultAllGather, DefaultReduceScatter in _fully_shard/_fsdp_collectives.py) first ship in torch 2.9.0
# (pytorch/pytorch#155189; absent from the 2.8 API docs). fp8dist needs them for float8 all-gather over gloo and the
# audit's FSDP2 collective record.
TORCH_FSDP2_CUSTOM_COLLECTIVES = (2, 9, 0)
# The lowest torch fp8dist runs on: pyproject.toml's `torch>=` (tests/unit/test_promises.py keeps them equal).
TORCH_FLOOR = TORCH_FSDP2_CUSTOM_COLLECTIVES


def torch_supported(torch_version: Version) -> tuple[bool, str]:
    if torch_version >= TORCH_FLOOR:
        return True, f"torch {fmt(torch_version)} >= {fmt(TORCH_FLOOR)}"
    return False, (f"torch {fmt(torch_version)} is older than fp8dist's floor {fmt(TORCH_FLOOR)} (FSDP2 custom "
                   "collectives, pytorch#155189)")


def fsdp2_supported(torch_version: Version) -> tuple[bool, str]:
    if torch_version >= TORCH_FSDP2_PUBLIC:
        return True, f"torch {fmt(torch_version)} has torch.distributed.fsdp.fully_shard"
    return False, (f"torch {fmt(torch_version)} lacks the public FSDP2 API "
                   f"(needs >= {fmt(TORCH_FSDP2_PUBLIC)}); upgrade torch")


# F.scaled_dot_product_attention on a CPU picks its fused kernel (`_scaled_dot_product_flash_attention_for_cpu`,
# computing in the inputs' dtype) only without dropout (torch 2.13 aten/src/ATen/native/transformers/sdp_utils_cpp.cpp
# use_flash_attention_cpp: check_for_dropout); otherwise it runs its math path, which upcasts fp16 / bf16 query, key and
# value to fp32 for accuracy and casts the result back (attention.cpp _scaled_dot_product_attention_math). Training
# with attention dropout on a CPU therefore runs attention's matmuls in fp32 whatever the run's compute dtype.
SDPA_MATH_UPCAST = ("torch's SDPA ran its math path, which computes fp16 / bf16 attention in fp32 "
                    "(torch aten/src/ATen/native/transformers/attention.cpp, _scaled_dot_product_attention_math)")
SDPA_CPU_DROPOUT = ("it takes that path for attention dropout on a CPU, as its fused CPU kernel takes none "
                    "(sdp_utils_cpp.cpp, use_flash_attention_cpp: check_for_dropout)")


def sdpa_kernel_reason(dropout_on_cpu: bool) -> str:
    """Why F.scaled_dot_product_attention computed in another precision than the inputs it was given."""
    return SDPA_MATH_UPCAST + (f"; {SDPA_CPU_DROPOUT}" if dropout_on_cpu else "")


@dataclass(frozen=True)
class PipelineScheduleFact:
    torch_class: str
    """The schedule's class in torch.distributed.pipelining."""
    multi_stage: bool
    """Whether it runs several stages per rank (virtual stages: `parallel.pipeline_stages_per_rank`, default 2)."""
    microbatches: str
    """What its microbatch count must be, as torch checks it (pipeline_size: P)."""


# parallel.pipeline_schedule -> the torch schedule it runs (torch 2.13 torch/distributed/pipelining/schedules.py):
# Schedule1F1B refuses fewer microbatches than stages; ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble
# need a multiple of the rounds (max(1, microbatches // P)), which a multiple of P always is; GPipe takes any count.
# fp8dist's `zero_bubble` is the interleaved zero-bubble schedule (backward split into input and weight gradients,
# arXiv 2401.10241), not the V-shaped ZBV one, whose stage placement differs.
PIPELINE_SCHEDULES = {
    "1f1b": PipelineScheduleFact("Schedule1F1B", multi_stage=False, microbatches="at least P"),
    "gpipe": PipelineScheduleFact("ScheduleGPipe", multi_stage=False, microbatches="any"),
    "interleaved_1f1b": PipelineScheduleFact("ScheduleInterleaved1F1B", multi_stage=True,
                                             microbatches="a multiple of P"),
    "zero_bubble": PipelineScheduleFact("ScheduleInterleavedZeroBubble", multi_stage=True,
                                        microbatches="a multiple of P"),
}
