"""torchao (pytorch/ao): its float8 recipes and the hardware each needs, the MoE and MX prototype API fp8dist calls,
the options that changed meaning between releases, and its own size heuristics. Source paths are relative to the
pytorch/ao repository at the release named (the wheel's torchao/ for files under it)."""
from __future__ import annotations

from fp8dist.facts.hardware import (BLOCKWISE_MIN_CAPABILITY, FP8_MIN_CAPABILITY, ROWWISE_MIN_CAPABILITY,
                                    Capability)
from fp8dist.facts.versions import Version, fmt

TORCHAO_RECIPE_MIN_CAPABILITY = {
    "tensorwise": FP8_MIN_CAPABILITY,
    "rowwise": ROWWISE_MIN_CAPABILITY,
    "rowwise_with_gw_hp": ROWWISE_MIN_CAPABILITY,
    "mxfp8": BLOCKWISE_MIN_CAPABILITY,
}
# GEMMs a torchao recipe runs in high precision by design, per phase: `rowwise_with_gw_hp` keeps the weight
# gradient's GEMM in the original precision (torchao 0.18 torchao/float8/config.py, ROWWISE_WITH_GW_HP:
# "grad_weight ... computation in high precision"). The audit allows exactly these.
TORCHAO_HIGH_PRECISION_GEMMS = {
    "rowwise_with_gw_hp": {"weight_gradient": "rowwise_with_gw_hp computes the weight gradient in high precision"},
}
# torchao's MXFP8 training Linear (torchao 0.18 torchao/prototype/moe_training/mxfp8_linear.py MXFP8Linear): e4m3
# values with one e8m0 scale per block of 32 along the contracted dim, in forward (K), input gradient (N) and weight
# gradient (the tokens): in/out features and the tokens of a micro-batch must be multiples of the block.
TORCHAO_MX_BLOCK = 32


# MoE experts as grouped GEMMs (torchao 0.18 torchao/prototype/moe_training/):
# - mxfp8: `_to_mxfp8_then_scaled_grouped_mm`; its AUTO kernels need SM 10.x ("SM100 kernels",
#   mxfp8_grouped_mm.py _MXFP8GroupedMM.forward), KernelPreference.EMULATED runs anywhere (dequantize, then a
#   high-precision grouped GEMM); blocks of 32 along the contracted dims, so hidden and expert sizes % 32.
# - float8: `_to_fp8_rowwise_then_scaled_grouped_mm` needs `torch._scaled_grouped_mm` (SM 9.0+) and has no
#   emulated mode ("TODO: support emulated mode", fp8_grouped_mm.py); K and N % 16.
TORCHAO_EXPERTS_MIN_CAPABILITY: dict[str, Capability] = {"mxfp8": BLOCKWISE_MIN_CAPABILITY,
                                                         "float8": ROWWISE_MIN_CAPABILITY}
# The MoE experts' grouped GEMMs and the MX Linear are torchao prototype API (torchao/prototype/moe_training:
# `_to_mxfp8_then_scaled_grouped_mm`, `_to_fp8_rowwise_then_scaled_grouped_mm`, mxfp8_linear.MXFP8Linear), whose
# names and arguments move between releases; fp8dist calls them as torchao 0.18.0 has them (verified against the
# installed wheel by tests/unit/facts/test_installed_wheels.py) and refuses older torchao for these two features,
# instead of failing inside a rank on an import.
TORCHAO_PROTOTYPE_VERIFIED = (0, 18, 0)
TORCHAO_EXPERTS_EMULATED = {"mxfp8"}
# Expert-parallel token dispatch in MXFP8 (forward; bf16 in backward): torchao 0.18
# prototype/moe_training/ep/a2a_dispatch.py a2a_dispatch_mxfp8_fwd_hp_bwd quantizes with the Triton kernel
# mx_formats/kernels.py triton_to_mxfp8_dim0 (GPU only), and the tutorial
# docs/source/eager_tutorials/mxfp8_expert_parallel_training.rst needs the wgrad_with_hp recipe for it.
TORCHAO_MXFP8_DISPATCH = ("torchao's MXFP8 all-to-all, prototype/moe_training/ep/a2a_dispatch.py, quantizes with a "
                          "Triton GPU kernel (torchao 0.18)")
TORCHAO_EXPERTS_DIM_MULTIPLE = {"mxfp8": TORCHAO_MX_BLOCK, "float8": 16}


def torchao_experts_mode(requested: str, emulate: bool, capability: Capability | None) -> tuple[str | None, str]:
    """(mode, why) for precision.fp8.torchao.experts on this hardware; mode None: refused, `why` says so.
    `auto` picks the format this hardware runs: MXFP8 emulated or on SM 10.x, float8 rowwise on SM 9.x."""
    if requested == "none":
        return "none", "precision.fp8.torchao.experts=none: experts stay in the compute dtype"
    if requested == "auto":
        if emulate or (capability is not None and tuple(capability) >= BLOCKWISE_MIN_CAPABILITY):
            requested = "mxfp8"
        elif capability is not None and tuple(capability) >= ROWWISE_MIN_CAPABILITY:
            requested = "float8"
        else:
            found = "no CUDA GPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
            return None, (f"experts=auto found no FP8 grouped GEMM for {found}: torchao runs MoE experts in float8 "
                          "on SM 9.0+ and in MXFP8 on SM 10.0+ (or emulated)")
    if emulate:
        if requested in TORCHAO_EXPERTS_EMULATED:
            return requested, f"{requested} experts, emulated (precision.fp8.torchao.emulate)"
        return None, "torchao's float8 grouped GEMM has no emulated mode (torchao 0.18 fp8_grouped_mm.py)"
    need = TORCHAO_EXPERTS_MIN_CAPABILITY[requested]
    if capability is None or tuple(capability) < need:
        found = "no CUDA GPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
        return None, f"torchao {requested} grouped GEMMs need compute capability >= {need[0]}.{need[1]}; {found}"
    return requested, f"{requested} experts on compute capability {capability[0]}.{capability[1]}"


def torchao_fp8_hardware(recipe_name: str, capability: Capability | None) -> tuple[bool, str]:
    """Can this GPU run torchao float8 `recipe_name` natively? capability None = no CUDA GPU."""
    need = TORCHAO_RECIPE_MIN_CAPABILITY[recipe_name]
    if capability is None:
        return False, (f"torchao float8 '{recipe_name}' needs an NVIDIA GPU with compute capability "
                       f">= {need[0]}.{need[1]}; none is visible")
    if tuple(capability) >= need:
        return True, f"compute capability {capability[0]}.{capability[1]} >= {need[0]}.{need[1]}"
    return False, (f"torchao float8 '{recipe_name}' needs compute capability >= {need[0]}.{need[1]}, "
                   f"this GPU has {capability[0]}.{capability[1]}")


# torchao's C++ extensions load only with torch >= 2.11 (ao v0.18.0 torchao/__init__.py); float8
# training is pure Python.
# Newest torchao whose float8 API this module knows (PyPI, 2026-07-31).
NEWEST_KNOWN_TORCHAO = (0, 18, 0)
# force_recompute_fp8_weight_in_bwd: added in 0.6.0 (pytorch/ao#936), a logged no-op from 0.12.0
# (pytorch/ao#2356, issue #2251); still a no-op in 0.18.0 (torchao/float8/config.py).
TORCHAO_FORCE_RECOMPUTE_ADDED = (0, 6, 0)
TORCHAO_FORCE_RECOMPUTE_NOOP = (0, 12, 0)


def torchao_force_recompute(torchao_version: Version, requested: object,
                            float8_all_gather: bool) -> tuple[bool, str]:
    """Decide force_recompute_fp8_weight_in_bwd for the installed torchao.

    Returns (value to pass, reason). Raises ValueError where the request cannot be honoured.
    """
    version = fmt(torchao_version)
    if torchao_version < TORCHAO_FORCE_RECOMPUTE_ADDED:
        if requested is True:
            raise ValueError(f"torchao {version} has no force_recompute_fp8_weight_in_bwd "
                             f"(added in {fmt(TORCHAO_FORCE_RECOMPUTE_ADDED)})")
        return False, f"not passed: torchao {version} predates the field"
    if torchao_version >= TORCHAO_FORCE_RECOMPUTE_NOOP:
        if requested is True:
            return False, (f"not passed: a deprecated no-op since torchao "
                           f"{fmt(TORCHAO_FORCE_RECOMPUTE_NOOP)} (pytorch/ao#2251); torch's partitioner "
                           f"already avoids saving unsharded fp8 weights")
        return False, (f"not needed: torchao {version} >= {fmt(TORCHAO_FORCE_RECOMPUTE_NOOP)} "
                       f"made it a no-op (pytorch/ao#2251)")
    if requested == "auto":
        if float8_all_gather:
            return True, (f"set: torchao {version} needs it with float8 all-gather under FSDP2 "
                          f"(pytorch/ao#936)")
        return False, "off: only useful with float8 all-gather"
    return bool(requested), f"as configured (torchao {version} honours it)"


# torchao.optim.AdamWFp8 steps FSDP2's DTensor shards through a torch.compile'd kernel that fails on CPU
# ("AttributeError: 'OptimStateFp8' object has no attribute 'qmap'"); on plain CPU tensors it works, and
# AdamW8bit works on both. Measured with torch 2.13.0+cpu and torchao 0.18.0 (2026-11-22); the option matrix
# (tests/option_matrix.py, fsdp2-fp8-states-on-cpu) holds fp8dist to the refusal.
def torchao_fp8_states_on_fsdp2(cuda_available: bool) -> tuple[bool, str]:
    if cuda_available:
        return True, "CUDA is available"
    return False, ("torchao's AdamWFp8 fails on FSDP2's CPU shards (its compiled step raises AttributeError "
                   "'OptimStateFp8' object has no attribute 'qmap'; torch 2.13, torchao 0.18)")


# Linear sizes below which float8 GEMMs tend to be slower than bf16 on H100: torchao's own heuristics
# (ao v0.18.0 torchao/float8/float8_linear_utils.py _auto_filter_for_tensorwise / _auto_filter_for_rowwise,
# from the performance tables in torchao/float8/README.md). N = out_features, K = in_features.
def torchao_too_small_to_gain(recipe_name: str, out_features: int, in_features: int) -> bool:
    n, k = out_features, in_features
    if recipe_name == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


# torchao's low-bit optimizers (AdamW8bit, AdamWFp8, 4-bit) quantize a tensor's states only when its local
# shard has at least this many elements and a whole number of blocks; smaller ones keep full-precision states
# by design, following bitsandbytes (ao v0.18.0 torchao/optim/adam.py _AdamBase._new_buffer).
TORCHAO_LOW_BIT_MIN_NUMEL = 4096

# QLoRA's NF4 base (adapter.base_dtype: nf4): torchao 0.18 `torchao.quantization.to_nf4` (the module moved from
# torchao/dtypes/nf4tensor.py to torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py in 0.18, pytorch/ao#4256):
# 4-bit codes two per byte (`quantized_data`, uint8), one scale per NF4_BLOCK values quantized to int8 per
# NF4_SCALER_BLOCK scales (`quantized_scalers`, int8) with one factor per scaler block (`quantization_factor`, in the
# weight's dtype): to_nf4's defaults, torchtune's and the QLoRA paper's (block 64, double quantization of the scales).
# to_nf4 takes any scaler_block_size that divides the weight's blocks; FSDP2 splits each of the three buffers by rows
# (NF4Tensor's aten.split: every buffer's numel divisible by the shard count), so a shard must hold whole scaler
# blocks: fp8dist/backends/nf4.py nf4_scaler_block takes 256 where that fits, else the largest count under it.
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256

# What an NF4 weight's GEMM allocates to dequantize it (torchao 0.18 nf4_tensor.py: LinearNF4 forward and backward
# call `weight.to(dtype)`, i.e. NF4Tensor.get_original_weight): the codes of both halves as int64 indices (8 bytes per
# value together), then three tensors of the weight's dtype alive at once (the looked-up values, the scaled values,
# the stacked result). Eager mode, per weight, in forward and again in backward; measured on CPU, an 8192 x 8192 bf16
# weight: 896 MiB, 14 bytes per value (tests/unit/estimate/test_estimate_qlora.py). Under torch.compile the fused
# kernels may allocate less (not measured here): the estimate counts the eager bytes.
NF4_DEQUANTIZE_INDEX_BYTES = 8
NF4_DEQUANTIZE_VALUE_COPIES = 3
