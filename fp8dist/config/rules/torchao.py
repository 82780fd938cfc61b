"""The rules of precision.fp8.backend=torchao (float8 Linear, MXFP8)."""
from __future__ import annotations

from typing import Any, Mapping

from fp8dist.config.engines import TRAITS
from fp8dist.config.spec import Spec, TorchaoSpec
from fp8dist.errors import Issue
from fp8dist.facts.torchao import TORCHAO_MX_BLOCK


def check(spec: Spec, explicit: Mapping[str, Any]) -> list[Issue]:
    ao, issues = spec.fp8.torchao, []
    if ao.enable_fsdp_float8_all_gather is True:
        if "tensorwise" not in spec.fp8.recipes:  # with overrides: the tensorwise Linears gather in float8
            issues.append(Issue("precision.fp8.torchao.enable_fsdp_float8_all_gather",
                                f"float8 all-gather needs tensorwise scaling, recipe is '{ao.recipe_name}'",
                                True, "set it to auto/false, or use recipe_name=tensorwise "
                                      "(torchao Float8LinearConfig.__post_init__ asserts this)"))
        if not TRAITS[spec.engine].gathers_float8:
            issues.append(Issue("precision.fp8.torchao.enable_fsdp_float8_all_gather",
                                f"float8 all-gather is an FSDP2 feature, engine is '{spec.engine}'", True,
                                "set it to auto/false, or use engine=fsdp2"))
    if "mxfp8" in spec.fp8.recipes:  # the run's recipe, or an override's
        issues += _mxfp8(spec, ao)
    if ao.emulate and spec.compile:
        issues.append(Issue("precision.fp8.torchao.emulate", "emulated float8 does not work with torch.compile",
                            True, "set compile=false, or emulate=false on FP8 hardware"))
    if spec.precision.mixed_precision == "none":
        issues.append(Issue("precision.mixed_precision", "torchao float8 runs the non-FP8 ops and the float8 "
                            "casts from a bf16/fp32 compute dtype; it needs mixed precision here", "none",
                            "set precision.mixed_precision=bf16 (preset torchao-float8)"))
    return issues


def _mxfp8(spec: Spec, ao: TorchaoSpec) -> list[Issue]:
    """torchao's MXFP8 Linear: blocks of 32 along every contracted dim, the tokens included; no padding, no float8
    all-gather (fp8dist.facts.torchao TORCHAO_MX_BLOCK)."""
    issues, block, train = [], TORCHAO_MX_BLOCK, spec.train
    if ao.pad_inner_dim:
        issues.append(Issue("precision.fp8.torchao.pad_inner_dim", "MXFP8Linear has no padding: a Linear whose dims "
                            f"are not multiples of {block} stays in high precision", True,
                            "set precision.fp8.torchao.pad_inner_dim=false"))
    tokens = train.micro_batch_size * train.seq_len
    if tokens % block:
        issues.append(Issue("train.seq_len", f"MXFP8 quantizes the weight gradient's inputs in blocks of {block} "
                            f"tokens: train.micro_batch_size * train.seq_len = {tokens} is not a multiple of {block}",
                            train.seq_len, f"set train.seq_len to a multiple of {block} "
                                           f"(e.g. {-(-train.seq_len // block) * block})"))
    return issues
