"""Every version and hardware fact fp8dist relies on, each with its source.

Pure functions: versions and compute capabilities come in as arguments, answers go out as
``(ok, reason)``. Nothing here imports torch; `installed_version` reads package metadata only.
Each record names the upstream file, release or pull request it rests on.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any

Version = tuple[int, ...]
Capability = tuple[int, int]


def parse_version(text: str) -> Version:
    """'0.19.8' -> (0, 19, 8); '2.13.0+cpu' -> (2, 13, 0); '0.19.0.dev0' -> (0, 19, 0)."""
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", str(text))
    if not match:
        raise ValueError(f"not a version: {text!r}")
    parts = tuple(int(p) for p in match.group(1).split("."))
    return (parts + (0, 0, 0))[:3]


def fmt(version: Version) -> str:
    return ".".join(str(p) for p in version)


def installed_version(distribution: str) -> str | None:
    """Version of an installed distribution from its metadata, without importing it."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


# --- PyTorch / FSDP2 -------------------------------------------------------------------------
# fully_shard is public at torch.distributed.fsdp from torch 2.6 (pytorch#141868).
TORCH_FSDP2_PUBLIC = (2, 6, 0)
# FSDPModule.set_custom_all_gather / set_custom_reduce_scatter (DefaultAllGather, DefaultReduceScatter in
# _fully_shard/_fsdp_collectives.py) first ship in torch 2.9.0 (pytorch#155189; absent from the 2.8 API docs).
# fp8dist needs them for float8 all-gather over gloo and the audit's FSDP2 collective record.
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


# --- FP8 hardware ----------------------------------------------------------------------------
# FP8 tensor-core GEMMs: SM 8.9 (Ada) and 9.0 (Hopper); rowwise/axiswise scaling needs 9.0
# (ao v0.18.0 test/float8/test_base.py test_axiswise_gemm); MXFP8/NVFP4 need SM 10.x
# (TransformerEngine 2.20 transformer_engine/pytorch/quantization.py check_mxfp8_support, check_nvfp4_support).
FP8_MIN_CAPABILITY: Capability = (8, 9)
ROWWISE_MIN_CAPABILITY: Capability = (9, 0)
BLOCKWISE_MIN_CAPABILITY: Capability = (10, 0)

TORCHAO_RECIPE_MIN_CAPABILITY = {
    "tensorwise": FP8_MIN_CAPABILITY,
    "rowwise": ROWWISE_MIN_CAPABILITY,
    "rowwise_with_gw_hp": ROWWISE_MIN_CAPABILITY,
    "mxfp8": BLOCKWISE_MIN_CAPABILITY,
}
# GEMMs a torchao recipe runs in high precision by design, per phase: `rowwise_with_gw_hp` keeps the weight
# gradient's GEMM in the original precision (torchao 0.18 torchao/float8/config.py, ROWWISE_WITH_GW_HP:
# "grad_weight ... computed in high precision"). The audit allows exactly these.
TORCHAO_HIGH_PRECISION_GEMMS = {
    "rowwise_with_gw_hp": {"weight_gradient": "rowwise_with_gw_hp computes the weight gradient in high precision"},
}
# torchao's MXFP8 training Linear (torchao 0.18 prototype/moe_training/mxfp8_linear.py MXFP8Linear): e4m3 values with
# one e8m0 scale per block of 32 along the contracted dim, in forward (K), input gradient (N) and weight gradient
# (the tokens): in/out features and the tokens of a micro-batch must be multiples of the block.
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
# names and arguments move between releases; fp8dist calls them as torchao 0.18.0 has them (verified here) and
# refuses older torchao for these two features, instead of failing inside a rank on an import.
TORCHAO_PROTOTYPE_VERIFIED = (0, 18, 0)
TORCHAO_EXPERTS_EMULATED = {"mxfp8"}
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


# --- torchao ---------------------------------------------------------------------------------
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
# AdamW8bit works on both. Measured with torch 2.13.0+cpu and torchao 0.18.0 (2026-11-22, tests/option_matrix.py).
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


# --- DeepSpeed -------------------------------------------------------------------------------
# Newest DeepSpeed whose config rules this module knows (the PyPI release fp8dist is tested against).
NEWEST_KNOWN_DEEPSPEED = (0, 19, 8)
# `torch_autocast` section: 0.17.2 (#6993); combined with fp16/bf16 since 0.18.3 (#7700).
DS_TORCH_AUTOCAST = (0, 17, 2)
DS_AUTOCAST_WITH_BF16 = (0, 18, 3)
# bf16_master_weights_and_grads / bf16_optimizer_states: 0.18.3 (#7700).
DS_BF16_MASTER = (0, 18, 3)
# `amp` (Apex) section removed: any `amp` key raises DeepSpeedConfigError in 0.19.8 (#8564).
DS_AMP_REMOVED = (0, 19, 8)
# gradient_clipping default became 1.0 in 0.19.3 (#8068); 0.0 before.
DS_CLIPPING_DEFAULT_CHANGED = (0, 19, 3)


def deepspeed_has_torch_autocast(ds: Version) -> tuple[bool, str]:
    if ds >= DS_TORCH_AUTOCAST:
        return True, f"DeepSpeed {fmt(ds)} has the torch_autocast section"
    return False, (f"DeepSpeed {fmt(ds)} has no torch_autocast section (added in "
                   f"{fmt(DS_TORCH_AUTOCAST)})")


def deepspeed_has_bf16_master(ds: Version) -> tuple[bool, str]:
    if ds >= DS_BF16_MASTER:
        return True, f"DeepSpeed {fmt(ds)} has bf16_master_weights_and_grads"
    return False, (f"DeepSpeed {fmt(ds)} lacks bf16_master_weights_and_grads / bf16_optimizer_states "
                   f"(added in {fmt(DS_BF16_MASTER)})")


# --- MS-AMP ----------------------------------------------------------------------------------
# MS-AMP <= 0.3 pins deepspeed==0.9.2 and passes `cpu_offload`, removed in DeepSpeed 0.10.1.
# MS-AMP 0.4 pins deepspeed==0.13.1; it needs use_multi_rank_bucket_allreduce (0.12.4) and breaks from
# 0.17.5, where DeepSpeedZeroOptimizer.__init__ gained the positional `optimizer_params`
# (Azure/MS-AMP v0.4.0 pyproject.toml, msamp/deepspeed/runtime/engine.py).
# Each window: (label, first MS-AMP release it covers, last one, lowest DeepSpeed, highest DeepSpeed).
MSAMP_DEEPSPEED_WINDOWS = (
    ("MS-AMP <= 0.3 (pins deepspeed 0.9.2)", (0, 2, 0), (0, 3, 99), (0, 9, 2), (0, 10, 0)),
    ("MS-AMP 0.4 (pins deepspeed 0.13.1)", (0, 4, 0), (0, 4, 99), (0, 12, 4), (0, 17, 4)),
)
MSAMP_TESTED_DEEPSPEED = ((0, 9, 2), (0, 13, 1))
MSAMP_DISTRIBUTION = "ms-amp"  # pyproject name "MS-AMP"; set only by a source install (not on PyPI)
# The last release, the DeepSpeed it pins, and its image (Azure/MS-AMP v0.4.0 pyproject.toml,
# docs/user-tutorial/container-images.mdx).
MSAMP_RELEASE, MSAMP_RELEASE_DEEPSPEED = (0, 4, 0), (0, 13, 1)
MSAMP_IMAGE = "ghcr.io/azure/msamp:v0.4.0-cuda12.2"
# `import msamp` imports msamp.te, which loads TE's `transformer_engine_extensions` (msamp/te/extension.py); TE
# renamed that module transformer_engine_torch in 1.8 (TE#877), and MS-AMP 0.4.0 pins TE v1.1 (pyproject.toml).
# MS-AMP tests torch 1.14 and 2.1 only (Azure/MS-AMP .github/workflows/unit-tests.yaml: NGC 22.12 and 23.10). So
# MS-AMP lives in an environment of its own, below fp8dist's torch floor (TORCH_FLOOR).
MSAMP_MAX_TE, MSAMP_PINNED_TE, MSAMP_TESTED_TORCH = (1, 7, 0), (1, 1, 0), (2, 1, 0)


def msamp_install_hint() -> str:
    """Where MS-AMP runs, for messages: its own environment, and what fp8dist can and cannot do for it."""
    return (f"not on PyPI, and it needs an environment of its own: Transformer Engine <= {fmt(MSAMP_MAX_TE[:2])} "
            f"(`import msamp` loads TE's transformer_engine_extensions, renamed in TE 1.8; MS-AMP "
            f"{fmt(MSAMP_RELEASE)} pins TE {fmt(MSAMP_PINNED_TE[:2])}), torch {fmt(MSAMP_TESTED_TORCH[:2])} (below "
            f"fp8dist's torch floor {fmt(TORCH_FLOOR[:2])}) and deepspeed {fmt(MSAMP_RELEASE_DEEPSPEED)}: install it "
            f"from source (github.com/Azure/MS-AMP v{fmt(MSAMP_RELEASE)}) or use the {MSAMP_IMAGE} image, on a CUDA "
            f"GPU. fp8dist translates O1, O2 and O3 for it (`fp8dist translate --to deepspeed --deepspeed-version "
            f"{fmt(MSAMP_RELEASE_DEEPSPEED)}`, whose JSON msamp.deepspeed.initialize reads in that environment), but "
            f"fp8dist's own runtime, engines and audit cannot run there")


def installed_msamp() -> Version | None:
    version = installed_version(MSAMP_DISTRIBUTION)
    return parse_version(version) if version else None


def msamp_supports_deepspeed(ds: Version, msamp: Version | None = None) -> tuple[bool, str]:
    """Can MS-AMP `msamp` (None: whichever release the user installs) drive DeepSpeed `ds`?"""
    windows = [w for w in MSAMP_DEEPSPEED_WINDOWS if msamp is None or w[1] <= msamp <= w[2]]
    if not windows:
        return False, (f"MS-AMP {fmt(msamp)} is not a release fp8dist knows (newest known: "
                       f"{fmt(MSAMP_RELEASE)}, 2024-02-26); its DeepSpeed range is unknown")
    for label, _, _, low, high in windows:
        if low <= ds <= high:
            tested = " (the pinned, tested version)" if ds in MSAMP_TESTED_DEEPSPEED else \
                " (API-compatible by code reading; MS-AMP tested only its pin)"
            return True, f"DeepSpeed {fmt(ds)} is inside {label}: {fmt(low)}-{fmt(high)}{tested}"
    ranges = "; ".join(f"{label}: {fmt(lo)}-{fmt(hi)}" for label, _, _, lo, hi in windows)
    who = f"installed MS-AMP {fmt(msamp)}" if msamp else "every MS-AMP window"
    return False, f"DeepSpeed {fmt(ds)} is outside {who} ({ranges})"


# msamp.initialize (v0.4.0 msamp/__init__.py) tests isinstance(optimizer, torch.optim.Adam) before AdamW and
# builds its low-bit optimizer from optimizer.defaults minus foreach/capturable/differentiable/fused. Since
# torch's "Refactor AdamW into Adam" (pytorch#143710) AdamW subclasses Adam, so an AdamW becomes LBAdam,
# whose `use_adam=True` applies L2 weight decay instead of decoupled decay (msamp/optim/adamw_base.py), and
# both classes carry defaults LBAdamW.__init__ does not accept (TypeError).
MSAMP_REJECTED_OPTIMIZER_DEFAULTS = ("decoupled_weight_decay",)


# Real FP8 GEMMs in MS-AMP only when the GPU name contains "h100"; elsewhere emulated in 16-bit
# (Azure/MS-AMP v0.4.0 msamp/common/utils/device.py Device.is_fp8_supported).
def msamp_native_fp8(gpu_name: str | None) -> tuple[bool, str]:
    if gpu_name and "h100" in gpu_name.lower():
        return True, f"'{gpu_name}' runs MS-AMP FP8 GEMMs natively"
    return False, (f"MS-AMP runs FP8 GEMMs natively only on GPUs named 'H100'; on "
                   f"'{gpu_name or 'no GPU'}' they are emulated in 16-bit (memory savings only)")


# --- Transformer Engine ----------------------------------------------------------------------
# Every fact below was read from the registry's `transformer-engine` wheels 2.1.0-2.20.2 (pure Python; there is
# no 2.0.x on PyPI) by loading transformer_engine/common/recipe/__init__.py and constructing each class; a path
# `file:N` is relative to the wheel's transformer_engine/ for the release named. The contract tests
# (tests/unit/backends/test_te_recipe_contract.py) check the records against the real classes of TE_CHECKED.
# Unknown constructor arguments are dropped without a word by every release (pydantic dataclasses), so a field
# is written only from the release that keeps it.
# The releases fp8dist supports: the first 2.x wheel to the newest on the registry. TE 1.x is not checked.
TE_OLDEST_SUPPORTED = (2, 1, 0)
TE_NEWEST_KNOWN = (2, 20, 2)
# The releases the contract tests load: the oldest and newest supported, the first release of each recipe and of
# each field fp8dist writes (2.2, 2.3, 2.8, 2.19), and the releases just before the fields' (2.7, 2.18).
TE_CHECKED = ((2, 1, 0), (2, 2, 0), (2, 3, 0), (2, 7, 0), (2, 8, 0), (2, 18, 0), (2, 19, 0), (2, 20, 2))


@dataclass(frozen=True)
class TEField:
    """A recipe constructor argument fp8dist writes (precision.fp8.te.<name>)."""

    name: str
    since: Version  # the first TE release whose class keeps it; older ones drop it without a word
    source: str
    ignored: str | None = None  # kept on the object but read by nothing: why (fp8dist refuses the key)
    # Recipe attributes te.Linear reads instead of the field: "attribute.member", set to the field's value after
    # construction (the attribute is a frozen dataclass, replaced whole)
    also_sets: tuple[str, ...] = ()


@dataclass(frozen=True)
class TERejection:
    """A value the recipe class refuses (an assert in __post_init__): TE's own message and the releases."""

    field: str
    value: Any
    message: str
    since: Version
    until: Version | None  # the last release that raises; None: still raises in TE_NEWEST_KNOWN
    source: str


@dataclass(frozen=True)
class TERecipe:
    """One precision.fp8.te.recipe value: its class and everything fp8dist needs to know about it."""

    name: str
    cls: str  # in transformer_engine.common.recipe
    since: Version  # the first TE release with the class
    min_capability: Capability  # TE 2.20 pytorch/quantization.py check_*_support
    max_capability: Capability | None  # exclusive
    # Both Linear dims must be multiples of this for te.Linear to quantize them: FP8 GEMMs need 16 (pytorch/utils.py
    # assert_dim_for_fp8_exec: in % 16, out % 8; 16 for both, as torchao and Accelerate do); MXFP8 blocks are 32 wide,
    # NVFP4 16, Float8BlockScaling 128 (TE 2.20 constants.py MXFP8_BLOCK_SCALING_SIZE, NVFP4_BLOCK_SCALING_SIZE;
    # tensor/float8_blockwise_tensor.py block_len; each quantizer's is_quantizable)
    dim_multiple: int
    fields: tuple[TEField, ...]
    source: str
    rejects: tuple[TERejection, ...] = ()
    min_cuda: Version | None = None
    # Accelerate can build it: DelayedScaling, or MXFP8BlockScaling with use_mxfp8_block_scaling (accelerate 1.15
    # utils/transformer_engine.py apply_fp8_autowrap)
    accelerate: bool = False

    def field(self, name: str) -> TEField | None:
        return next((f for f in self.fields if f.name == name), None)


_EVERY_WHEEL = "2.1 recipe L135-141, 2.20.2 L253-258; kept by every wheel with code, 1.9.0.post1-2.20.2"
_FP8_ATTENTION = "FP8 attention is not supported for {}."
TE_RECIPES: dict[str, TERecipe] = {r.name: r for r in (
    TERecipe("delayed", "DelayedScaling", (0, 8, 0), (8, 9), None, 16, (
        TEField("fp8_format", (1, 9, 0), _EVERY_WHEEL),
        TEField("margin", (1, 9, 0), _EVERY_WHEEL),
        TEField("amax_history_len", (1, 9, 0), _EVERY_WHEEL),
        TEField("amax_compute_algo", (1, 9, 0), _EVERY_WHEEL),
        TEField("reduce_amax", (1, 9, 0), _EVERY_WHEEL),
    ), "NVIDIA/TransformerEngine tags", accelerate=True),
    TERecipe("current", "Float8CurrentScaling", (2, 2, 0), (8, 9), None, 16, (
        TEField("fp8_format", (2, 2, 0), "2.2 recipe L228, 2.20.2 L303"),
        # 2.2-2.7 have no such field. From 2.8 the field reaches only the output and grad-input quantizers
        # (2.8 pytorch/fp8.py:974 make_quantizers); te.Linear sets the input, weight and grad-output quantizers
        # from the class attributes fp8_quant_*, which the recipe module computes once from
        # NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES when it is imported (2.8 recipe L230-234, 2.20.2 L302-306;
        # 2.20.2 module/linear.py:2282-2289 set_meta_tensor -> :2762-2786; layernorm_linear, layernorm_mlp alike)
        TEField("use_power_2_scales", (2, 8, 0), "2.8 recipe L230, 2.20.2 L302; 2.7 drops it", also_sets=(
            "fp8_quant_fwd_inp.power_2_scale", "fp8_quant_fwd_weight.power_2_scale",
            "fp8_quant_bwd_grad.power_2_scale")),
    ), "2.2 recipe L187", rejects=tuple(
        TERejection(f, True, _FP8_ATTENTION.format("Float8CurrentScaling"), (2, 4, 0), (2, 7, 0),
                    "2.7 recipe L216-218; the assert is gone in 2.8") for f in ("fp8_dpa", "fp8_mha"))),
    TERecipe("block", "Float8BlockScaling", (2, 3, 0), (9, 0), None, 128, (
        TEField("fp8_format", (2, 3, 0), "2.3 recipe L346, 2.20.2 L431"),
    ), "2.3 recipe L298", rejects=tuple(
        TERejection(f, True, _FP8_ATTENTION.format("Float8BlockScaling"), (2, 4, 0), None,
                    "2.7 recipe L336, 2.8 L360, 2.20.2 L463; 2.3 accepts it") for f in ("fp8_dpa", "fp8_mha")),
        min_cuda=(12, 9, 0)),  # TE 2.9+ check_fp8_block_scaling_support
    TERecipe("mxfp8", "MXFP8BlockScaling", (2, 0, 0), (10, 0), (12, 0), 32, (
        TEField("fp8_format", (2, 0, 0), "2.1 recipe L190, 2.20.2 L369"),
        TEField("margin", (2, 0, 0), "2.1 recipe L189, 2.20.2 L368", ignored=(
            "MXFP8BlockScaling keeps margin but nothing reads it: only delayed scaling does (2.20.2 "
            "pytorch/quantization.py:700 and :1148; MXFP8BlockScalingRecipeState.make_quantizers builds "
            "MXFP8Quantizer(dtype) alone, :1537)")),
        TEField("enable_2d_quantization", (2, 19, 0), "2.19 recipe L373, read at 2.19 pytorch/quantization.py:1536; "
                "2.18 drops it"),
    ), "git tag v2.0 (no 2.0 wheel: 2.1.0 L165 is the first); max capability: \"not supported on 12.0+ "
       "architectures yet\" (2.20 pytorch/quantization.py check_mxfp8_support)", accelerate=True),
    TERecipe("nvfp4", "NVFP4BlockScaling", (2, 8, 0), (10, 0), None, 16, (
        TEField("fp8_format", (2, 8, 0), "2.8 recipe L419, 2.20.2 L569"),
    ), "2.8 recipe L381", rejects=(
        TERejection("fp8_format", "HYBRID", "Only E4M3 is supported for NVFP4 scaling", (2, 8, 0), None,
                    "2.8 recipe L427, 2.20.2 L578"),)),
)}
# Every field some recipe takes, in the order fp8dist writes them.
TE_FIELDS = tuple(dict.fromkeys(f.name for r in TE_RECIPES.values() for f in r.fields))
# Keys no recipe fp8dist runs can use: fp8_dpa / fp8_mha are read only by TE's attention modules
# (2.20.2 attention/dot_product_attention/dot_product_attention.py:282-309, attention/multi_head_attention.py:924)
# and by make_graphed_callables (pytorch/graph.py:1320), and fp8dist swaps nn.Linear and nn.LayerNorm only.
TE_INERT_FIELDS = {name: ("read only by Transformer Engine's attention modules (te.DotProductAttention, "
                          "te.MultiheadAttention), which fp8dist never installs: it swaps nn.Linear and nn.LayerNorm "
                          "only, so the key would do nothing") for name in ("fp8_dpa", "fp8_mha")}
# TE's FP8 GEMMs need the tokens of a micro-batch (all dims of the input but the last) to be a multiple of 8,
# the last dim of 16 (pytorch/utils.py assert_dim_for_fp8_exec: 2.1 L236, 2.20.2 L704; an AssertionError up to
# 2.13, a ValueError from 2.14; called by module/linear.py, layernorm_linear.py, layernorm_mlp.py under autocast).
TE_TOKEN_MULTIPLE = 8
TE_ADA_MIN_CUDA = (12, 1, 0)  # FP8 on SM 8.9 needs CUDA 12.1
# Removed DelayedScaling fields: `interval` in 2.2 (TE#1607), `override_linear_precision` in 2.0.
TE_REMOVED_FIELDS = {"interval": (2, 2, 0), "override_linear_precision": (2, 0, 0)}
# te.autocast / te.quantized_model_init since 2.9 (TE#2256); fp8_autocast deprecated there.
TE_AUTOCAST_RENAMED = (2, 9, 0)


def te_supported(te_version: Version) -> tuple[bool, str]:
    span = f"{fmt(TE_OLDEST_SUPPORTED)}-{fmt(TE_NEWEST_KNOWN)}"
    if te_version >= TE_OLDEST_SUPPORTED:
        newer = "" if te_version <= TE_NEWEST_KNOWN else f", newer than the newest checked ({fmt(TE_NEWEST_KNOWN)})"
        return True, f"Transformer Engine {fmt(te_version)} is supported ({span}){newer}"
    return False, (f"fp8dist supports Transformer Engine {span} (checked: {', '.join(fmt(v) for v in TE_CHECKED)}); "
                   f"{fmt(te_version)} is older")


def te_recipe_available(recipe: str, te_version: Version) -> tuple[bool, str]:
    record = TE_RECIPES[recipe]
    if te_version >= record.since:
        return True, f"Transformer Engine {fmt(te_version)} has {record.cls}"
    return False, f"{record.cls} needs Transformer Engine >= {fmt(record.since)}, found {fmt(te_version)}"


def te_field_kept(recipe: str, field: str, te_version: Version) -> tuple[bool, str]:
    """Does `recipe`'s class in TE `te_version` keep the constructor argument `field`?"""
    record, entry = TE_RECIPES[recipe], TE_RECIPES[recipe].field(field)
    if te_version >= entry.since:
        return True, f"{record.cls} keeps {field} from Transformer Engine {fmt(entry.since)}"
    return False, (f"{record.cls} in Transformer Engine {fmt(te_version)} has no field {field} (the first release "
                   f"that keeps it is {fmt(entry.since)}); it would drop it without a word")


def te_recipe_hardware(recipe: str, capability: Capability | None,
                       cuda: Version | None) -> tuple[bool, str]:
    record = TE_RECIPES[recipe]
    cls, low, high = record.cls, record.min_capability, record.max_capability
    if capability is None:
        return False, f"{cls} needs an NVIDIA GPU with compute capability >= {low[0]}.{low[1]}; none is visible"
    cap = tuple(capability)
    if cap < low or (high is not None and cap >= high):
        bound = f">= {low[0]}.{low[1]}" + (f" and < {high[0]}.{high[1]}" if high else "")
        return False, f"{cls} needs compute capability {bound}, this GPU has {cap[0]}.{cap[1]}"
    if record.min_cuda and (cuda is None or cuda < record.min_cuda):
        return False, f"{cls} needs CUDA >= {fmt(record.min_cuda)}, found {fmt(cuda) if cuda else 'none'}"
    if cap == (8, 9) and (cuda is None or cuda < TE_ADA_MIN_CUDA):
        return False, f"FP8 on SM 8.9 needs CUDA >= {fmt(TE_ADA_MIN_CUDA)}, found {fmt(cuda) if cuda else 'none'}"
    return True, f"compute capability {cap[0]}.{cap[1]} supports {cls}"


def te_removed_field_reason(field: str) -> str:
    """Why a DelayedScaling field TE has removed is refused (every supported TE but the oldest drops it)."""
    return (f"`{field}` was removed from Transformer Engine in {fmt(TE_REMOVED_FIELDS[field])}; newer TE would "
            f"silently drop it, so fp8dist refuses it")


# --- Accelerate (config files, plugins, FP8 recipe kwargs) -----------------------------------
# The Accelerate release whose config-file keys, launcher environment and recipe kwargs
# fp8dist/translate/accelerate.py and fp8dist/importers/accelerate.py follow (the installed one, PyPI).
ACCELERATE_KNOWN = (1, 15, 0)
# fp8_config.backend must hold FP8BackendType's value (accelerate 1.15 utils/dataclasses.py): the launcher
# exports it as ACCELERATE_FP8_BACKEND and Accelerator.fp8_backend builds FP8BackendType(value) from it.
ACCELERATE_FP8_BACKEND = {"torchao": "AO", "te": "TE", "msamp": "MSAMP"}
# What `accelerate launch` exports for an fp8_config key it is not given: its argparse defaults
# (commands/launch.py "FP8 Arguments"); the recipe kwargs read these env names (utils/dataclasses.py
# AORecipeKwargs / TERecipeKwargs / MSAMPRecipeKwargs).
ACCELERATE_LAUNCH_FP8_DEFAULTS = {"margin": 0, "interval": 1, "fp8_format": "HYBRID", "amax_history_len": 1024,
                                  "amax_compute_algo": "most_recent", "opt_level": "O2",
                                  "enable_fsdp_float8_all_gather": True, "pad_inner_dim": True,
                                  "use_autocast_during_eval": False, "use_mxfp8_block_scaling": False}
# TERecipeKwargs then hands Transformer Engine only the fields that differ from these same defaults
# (KwargsHandler.to_kwargs builds the default instance in a clean environment), so a value equal to one of them
# never reaches TE and TE's own default applies (amax_compute_algo "max"; MXFP8BlockScaling's fp8_format E4M3).
# Keys `accelerate config` writes into fp8_config (commands/config/cluster.py) under names that the launcher
# exports as ACCELERATE_FP8_<KEY> and no recipe ever reads: the run silently uses the launcher default of the
# name on the right.
ACCELERATE_UNREAD_FP8_KEYS = {"amax_history_length": "amax_history_len", "amax_compute_algorithm": "amax_compute_algo",
                              "optimization_level": "opt_level"}
# MSAMPRecipeKwargs / DeepSpeedPlugin.msamp_opt_level accept O1 and O2 only (utils/dataclasses.py OptLevel).
ACCELERATE_MSAMP_OPT_LEVELS = ("O1", "O2")
# torchao's module filter when a config file (not Python) sets up FP8: every nn.Linear except the first and the
# last one and those with a dim not divisible by 16 (utils/ao.py convert_model_to_fp8_ao, filter_linear_layers).
ACCELERATE_AO_DIM_MULTIPLE = 16
# The FSDP2 MixedPrecisionPolicy a config file can give: `mixed_precision` sets param_dtype, reduce_dtype and
# output_dtype to one dtype, fp8 meaning bf16 (utils/dataclasses.py FullyShardedDataParallelPlugin.set_mixed_precision);
# and with any mixed precision fsdp2_prepare_model upcasts trainable parameters to fp32 (utils/fsdp_utils.py).
ACCELERATE_FP8_COMPUTE_DTYPE = "bf16"
# "auto" in a DeepSpeed config, as Accelerate fills it at prepare (accelerator.py _prepare_deepspeed):
# gradient_clipping 1.0; optimizer lr / weight_decay from DummyOptim (utils/deepspeed.py: lr=0.001,
# weight_decay=0); the bucket sizes from the model's hidden_size h (h*h, 0.9*h*h, 10*h).
ACCELERATE_DS_AUTO = {"gradient_clipping": 1.0, "optimizer.params.lr": 0.001, "optimizer.params.weight_decay": 0.0,
                      "gradient_accumulation_steps": 1}
ACCELERATE_DS_HIDDEN_SIZE_AUTO = {"zero_optimization.reduce_bucket_size": "hidden_size * hidden_size",
                                  "zero_optimization.stage3_prefetch_bucket_size": "0.9 * hidden_size * hidden_size",
                                  "zero_optimization.stage3_param_persistence_threshold": "10 * hidden_size"}


def accelerate_matches(version: Version | None) -> tuple[bool, str]:
    """Is `version` the Accelerate release whose key names and behaviour the translation follows?"""
    if version is None:
        return False, (f"Accelerate is not installed here; the file follows Accelerate "
                       f"{fmt(ACCELERATE_KNOWN[:2])}.x (pip install 'accelerate>=1.15')")
    if version[:2] == ACCELERATE_KNOWN[:2]:
        return True, f"Accelerate {fmt(version)} is the {fmt(ACCELERATE_KNOWN[:2])}.x release the file follows"
    return False, (f"Accelerate {fmt(version)} is installed, the file follows {fmt(ACCELERATE_KNOWN[:2])}.x; check it "
                   "with `accelerate launch --config_file`")


# --- Hugging Face export ----------------------------------------------------------------------
# transformers 5.23 modeling_utils.py PreTrainedModel.save_pretrained: max_shard_size="50GB" (decimal, as
# huggingface_hub parse_size_to_int reads "GB"); fp8dist.runtime.export writes safetensors shards of at most this.
HF_MAX_SHARD_BYTES = 50 * 10**9

# --- Axolotl defaults an import resolves to ---------------------------------------------------
# What Axolotl uses for a left-out key (axolotl src/axolotl/utils/schemas/training.py HyperparametersConfig:
# micro_batch_size 1, gradient_accumulation_steps 1; schemas/config.py sequence_len 512; bf16 `auto`), and what
# the HF Trainer's TrainingArguments uses for max_grad_norm (transformers 5 training_args.py: 1.0).
# --- TRL / alignment-handbook defaults an import resolves to ---------------------------------------
# TrainingArguments' defaults (transformers 5.24 training_args.py; the same in 4.x but `optim`, which was adamw_torch)
# and TRL's (trl ModelConfig lora_r / lora_alpha / lora_dropout, SFTConfig / DPOConfig max_length) for keys a recipe
# leaves out.
TRL_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_grad_norm": 1.0, "seed": 42,
                "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "max_length": 1024}

AXOLOTL_DEFAULTS = {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "sequence_len": 512, "bf16": "auto",
                    "max_grad_norm": 1.0}

# --- DeepSpeed defaults an import resolves to -------------------------------------------------
# When a DeepSpeed config leaves a key out (or writes "auto" inside a typed section, which
# DeepSpeedConfigModel replaces by the default), DeepSpeed 0.19.8 uses these (runtime/precision_config.py,
# runtime/zero/config.py; measured with deepspeed.runtime.config.DeepSpeedConfig).
DS_FP16_DEFAULTS = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                    "min_loss_scale": 1}
DS_ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                    "stage3_param_persistence_threshold": 100_000}


def deepspeed_default_communication(section: str | None) -> str:
    """communication_data_type when the config leaves it out: the 16-bit section's dtype, else fp32
    (deepspeed 0.19.8 runtime/engine.py DeepSpeedEngine.communication_data_type)."""
    return {"fp16": "fp16", "bf16": "bf16"}.get(section or "", "fp32")

# --- PEFT's LoRA module names -------------------------------------------------------------------
# peft 0.21 tuners/lora/layer.py LoraLayer.adapter_layer_names ("lora_A", "lora_B", "lora_embedding_A",
# "lora_embedding_B"): an adapter's own modules are named `<target>.lora_A.<adapter>`; the Linear it adapts
# becomes `<target>.base_layer`. FP8 filters (fp8dist's and the one fp8dist hands Accelerate) leave them out.
LORA_MODULE_PREFIX = "lora_"


def is_lora_module(fqn: str) -> bool:
    """A LoRA adapter's own module or parameter (lora_A / lora_B / lora_embedding_*), by PEFT's names."""
    return any(part.startswith(LORA_MODULE_PREFIX) for part in fqn.split("."))


# peft 0.21 utils/constants.py INCLUDE_LINEAR_LAYERS_SHORTHAND: LoraConfig target_modules for every Linear but the
# output layer (tuners_utils.py _maybe_include_all_linear_layers); fp8dist's `adapter.target_modules: auto`.
PEFT_ALL_LINEAR = "all-linear"
# peft 0.21 tuners/lora/config.py LoraConfig's defaults for r, lora_alpha and lora_dropout (what an adapter_config.json
# that leaves them out means).
PEFT_LORA_DEFAULTS = {"r": 8, "lora_alpha": 8, "lora_dropout": 0.0}

# peft 0.21 peft_model.py / tuners_utils.py BaseTuner.model: a PeftModel puts `base_model.model.` in front.
PEFT_MODEL_PREFIX = "base_model.model."


def peft_base_name(fqn: str) -> str:
    """The name a module had before PEFT wrapped it (`base_model.model.` and `.base_layer` left out): exclusion
    patterns written for the base model match the same modules in an adapter run."""
    fqn = fqn[len(PEFT_MODEL_PREFIX):] if fqn.startswith(PEFT_MODEL_PREFIX) else fqn
    return fqn.replace(".base_layer", "")
