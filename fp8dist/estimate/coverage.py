"""What the FP8 recipe does to the meta model: the share of weight-GEMM FLOPs that runs in FP8 under the config's
module filter (what the audit measures as gemm_flops.fp8_share), and the bytes the recipe keeps beyond the stores."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, cast

from fp8dist.backends.experts import experts_modules
from fp8dist.backends.module_filter import (Decision, LinearInfo, decide, is_router, linear_infos, matching_pattern,
                                           policy_of, speed_rule)
from fp8dist.config.spec import Spec
from fp8dist.estimate.model import MetaModel
from fp8dist.estimate.result import Fp8Coverage, LeftOut
from fp8dist.estimate.tensor_parallel import TensorSplit
from fp8dist.facts.torchao import TORCHAO_EXPERTS_DIM_MULTIPLE, torchao_too_small_to_gain
from fp8dist.facts.transformer_engine import TE_RECIPES
from fp8dist.translate.fsdp2 import torchao_dims_multiple, torchao_recipe_dims

if TYPE_CHECKING:
    import torch


def decisions(meta: MetaModel, spec: Spec, gpu: str | None = None) -> tuple[list[LinearInfo], list[Decision]]:
    """(Linear facts, the backend's module-filter decision for each), as the backend would decide on `gpu` (the
    estimate's --gpu or hardware.gpu; None: no GPU, so no speed rule: precision.fp8.min_speedup)."""
    fp8 = spec.fp8
    infos = linear_infos(meta.model)
    multiple = {"te": TE_RECIPES[fp8.te.recipe].dim_multiple, "msamp": None,  # backends/msamp.py: no dims rule
                "torchao": torchao_dims_multiple(fp8.torchao)}.get(fp8.backend)
    if fp8.backend == "msamp" and fp8.msamp.use_te:
        multiple = TE_RECIPES[fp8.te.recipe].dim_multiple  # MS-AMP with use_te converts with TE's filter
    dims = torchao_recipe_dims(fp8.torchao) if fp8.backend == "torchao" else {}
    return infos, decide(infos, fp8.modules.exclude, fp8.modules.skip_first_last, multiple,
                         speed_rule=speed_rule(spec, gpu) if fp8.enabled else None, policy=policy_of(fp8, dims))


def _experts(meta: MetaModel, spec: Spec) -> list[tuple[str, int, str | None]]:
    """(name, weight-GEMM FLOPs per token, why it stays in high precision or None) of each MoE experts module: a
    token meets `num_experts_per_tok` experts, each a GEMM per 3-D weight (backends/experts.py converts them)."""
    fp8 = spec.fp8
    top_k = getattr(meta.config, "num_experts_per_tok", 1)
    mode = {"auto": "float8" if not fp8.torchao.emulate else "mxfp8"}.get(fp8.torchao.experts, fp8.torchao.experts)
    found = []
    for name, module in experts_modules(meta.model):
        module = cast("torch.nn.Module", module)  # experts_modules types its modules as object
        weights = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        flops = top_k * sum(2 * w.shape[1] * w.shape[2] for w in weights)
        sizes = {size for w in weights for size in w.shape[1:]}
        if fp8.backend != "torchao":
            why = f"the {fp8.backend} backend converts nn.Linear only; experts are 3-D parameters"
        elif mode == "none":
            why = "precision.fp8.torchao.experts=none"
        elif pattern := matching_pattern(name, fp8.modules.exclude):
            why = f"excluded by pattern {pattern!r}"
        elif any(size % TORCHAO_EXPERTS_DIM_MULTIPLE[mode] for size in sizes):
            why = f"expert sizes are not multiples of {TORCHAO_EXPERTS_DIM_MULTIPLE[mode]} ({mode})"
        else:
            why = None
        found.append((name, flops, why))
    return found


def _routers(meta: MetaModel) -> list[tuple[str, int]]:
    """(name, FLOPs per token) of each MoE router that is not an nn.Linear (transformers 5 `*TopKRouter`: F.linear on
    its own 2-D weight; nn.Linear routers are among the Linears already). Every recipe keeps them in high precision,
    and the audit counts their GEMMs (backends/module_filter.is_router)."""
    import torch

    parents = {name: module for name, module in meta.model.named_modules()}
    found = []
    for name, module in meta.model.named_modules():
        parent = parents.get(name.rsplit(".", 1)[0]) if "." in name else meta.model
        if isinstance(module, torch.nn.Linear) or not is_router(name, module, parent):
            continue
        weights = [p for p in module.parameters(recurse=False) if p.dim() == 2]
        found.append((name, sum(2 * w.numel() for w in weights)))
    return found


def fp8_coverage(meta: MetaModel, spec: Spec, gpu: str | None = None) -> Fp8Coverage:
    """Share of the weight-GEMM FLOPs of one token that run in FP8 under the config's module filter (what the
    audit measures as gemm_flops.fp8_share), the modules left out and why, and the converted Linears below
    torchao's size heuristics. MoE experts count with the experts a token is routed to (top-k). Attention's own
    matmuls (QK^T, AV) multiply activations, not weights, and are not weight GEMMs."""
    fp8 = spec.fp8
    infos, chosen = decisions(meta, spec, gpu)
    experts = _experts(meta, spec)
    if not fp8.enabled:
        return Fp8Coverage(backend="none", fp8_share=0.0, linears=len(infos), converted=0, left_out=(),
                           too_small_to_gain=(), experts=len(experts))
    by_fqn = {i.fqn: i for i in infos}
    flops = {i.fqn: 2 * i.in_features * i.out_features for i in infos}
    converted = [d.fqn for d in chosen if d.convert]
    small: list[str] = []
    if fp8.backend == "torchao":
        small = [d.fqn for d in chosen if d.convert and torchao_too_small_to_gain(
            d.recipe or fp8.torchao.recipe_name, by_fqn[d.fqn].out_features, by_fqn[d.fqn].in_features)]
    in_fp8 = sum(flops[f] for f in converted) + sum(n for _, n, why in experts if why is None)
    total = sum(flops.values()) + sum(n for _, n, _ in experts) + sum(n for _, n in _routers(meta))
    left_out = [LeftOut(d.fqn, d.reason) for d in chosen if not d.convert]
    left_out += [LeftOut(name, why) for name, _, why in experts if why]
    return Fp8Coverage(backend=fp8.backend, fp8_share=in_fp8 / total if total else 0.0, linears=len(infos),
                       converted=len(converted), left_out=tuple(left_out), too_small_to_gain=tuple(small),
                       experts=len(experts))


def fp8_extra_bytes(meta: MetaModel, spec: Spec, split: TensorSplit, gpu: str | None = None,
                    holds: Callable[[str], bool] | None = None) -> tuple[int, str]:
    """Per-rank bytes the FP8 recipe keeps beyond the other stores (the fp8_extras store), and how they were
    counted. A weight tensor parallel splits is kept as its tp rank's shard. `holds`: whether the rank holds a
    parameter (a pipeline rank, its stages'); None: every one."""
    if not spec.fp8.enabled:
        return 0, "no FP8 backend"
    infos, chosen = decisions(meta, spec, gpu)
    kept = [(i, d) for i, d in zip(infos, chosen) if holds is None or holds(f"{i.fqn}.weight")]
    infos, chosen = [i for i, _ in kept], [d for _, d in kept]
    dims = split.split_dims()
    sizes = [i.in_features * i.out_features // (split.tp if f"{i.fqn}.weight" in dims else 1)
             for i, d in zip(infos, chosen) if d.convert]
    if spec.fp8.backend == "torchao":
        scales = 4 * 3 * len(sizes)  # input, weight and grad scales (fp32) per Float8Linear
        if spec.float8_all_gather:  # the tensorwise Linears' weights (the only ones gathered in float8)
            gathered = [size for size, d in zip(sizes, [d for d in chosen if d.convert]) if d.recipe == "tensorwise"]
            return sum(gathered) + scales, ("unsharded float8 weights of the converted tensorwise Linears, saved for "
                                            "backward in eager mode (1 byte/param), plus their scales")
        return scales, "float8 scales only: weights are cast per GEMM and not kept"
    if spec.fp8.backend == "te":
        history = spec.fp8.te.amax_history_len or 1024  # TE's DelayedScaling default
        per_linear = 3 * 4 * (history + 1) if spec.fp8.te.recipe == "delayed" else 3 * 4
        return sum(sizes) + per_linear * len(sizes), ("the FP8 weight copy each te.Linear caches (1 byte/param), "
                                                      "plus amax history and scales (fp32)")
    return 0, "MS-AMP keeps its FP8 weights and scales inside the stores above (table A)"
