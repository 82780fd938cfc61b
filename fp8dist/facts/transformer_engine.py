"""NVIDIA Transformer Engine: one record per precision.fp8.te.recipe value (its class, the first release with it,
the hardware it needs, its block size, the constructor arguments fp8dist writes and from which release each is
kept, the values the class refuses), the releases fp8dist supports, and the gates read from them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8dist.facts.hardware import Capability
from fp8dist.facts.versions import Version, fmt

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
    min_capability: Capability  # TE 2.20 pytorch/quantization.py check_*_support (_compute_*_support)
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
        # SM >= 9.0 and CUDA >= 12.9: TE 2.18-2.20.2 pytorch/quantization.py _compute_fp8_block_scaling_support (2.8
        # pytorch/fp8.py check_fp8_block_scaling_support also required SM < 10.0)
        min_cuda=(12, 9, 0)),
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
TE_ADA_MIN_CUDA = (12, 1, 0)  # FP8 on SM 8.9 needs CUDA 12.1 (2.20.2 pytorch/quantization.py _compute_fp8_support)
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
    if entry is None:  # callers ask about the record's own fields only
        raise KeyError(f"{record.cls} has no field {field} in fp8dist's records")
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

# Delayed scaling's state on a TE module (read by fp8dist/audit/scaling_history.py), TE 2.1 to 2.20.2
# (transformer_engine/pytorch/quantization.py DelayedScalingRecipeState, _update_amax_history; the fused
# tex.fused_amax_and_scale_update_after_reduction rolls the same way): `fp8_meta[key]` holds `scale` (one per
# quantizer) and `amax_history` (length x quantizers); a pass writes its amax into row 0, the update computes the next
# scale from all rows, moves row 0 to the last row and zeroes row 0. Quantizers by index
# (transformer_engine/pytorch/csrc/common.h FP8FwdTensors / FP8BwdTensors): per GEMM, forward input, weight, output;
# backward grad_output, grad_input.
TE_SCALING_STATES = (("scaling_fwd", "forward"), ("scaling_bwd", "backward"))
TE_QUANTIZER_ROLES = {"forward": ("input", "weight", "output"), "backward": ("grad_output", "grad_input")}
