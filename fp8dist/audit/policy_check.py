"""The gemm row's check of the per-Linear policy: each Linear's weight GEMMs, phase by phase, in the scaling its
recipe (precision.fp8.overrides, keep_first_layers / keep_last_layers) and precision.schedule say, observed from the
GEMMs' own operands (gemm_flops.gemm_scaling), and the share of weight-GEMM FLOPs the policy asks to run in FP8."""
from __future__ import annotations

from typing import Any, Mapping

from fp8dist.audit.gemm_flops import WeightGemmLedger

PHASES = ("forward", "input_gradient", "weight_gradient")
HIGH = "compute dtype"
# What each torchao recipe runs per phase, as gemm_scaling names it (torchao 0.18 torchao/float8/config.py
# Float8LinearConfig.from_recipe_name; prototype/moe_training/mxfp8_linear.py for MXFP8Linear).
RECIPE_PHASES: dict[str, tuple[str, str, str]] = {
    "tensorwise": ("tensorwise", "tensorwise", "tensorwise"),
    "rowwise": ("rowwise", "rowwise", "rowwise"),
    "rowwise_with_gw_hp": ("rowwise", "rowwise", HIGH),
    "mxfp8": ("mxfp8", "mxfp8", "mxfp8"),
}


def _low(label: str) -> bool:
    """A gemm_scaling label of a low-precision GEMM."""
    return label in ("tensorwise", "rowwise", "fp8") or label.startswith("mx")


def expected_phases(recipe: str | None, switched_gemms: str | None = None) -> dict[str, str]:
    """phase -> the scaling a Linear of `recipe` (None: kept in the compute dtype) runs it in; `switched_gemms`: the
    GEMMs precision.schedule has switched to the compute dtype at this step (forward | all), None before the switch."""
    labels = list(RECIPE_PHASES.get(recipe or "", (HIGH, HIGH, HIGH)))
    if switched_gemms == "all":
        labels = [HIGH] * 3
    elif switched_gemms == "forward":
        labels[0] = HIGH
    return dict(zip(PHASES, labels))


def check(ledger: WeightGemmLedger, expected: Mapping[str, tuple[str | None, str]],
          switched_gemms: str | None = None, switch_why: str = "precision.schedule") -> dict[str, Any]:
    """`expected`: module -> (its recipe or None, why). Returns {mismatches: [{module, phase, expected, observed,
    why}], asked_fp8_share}: a Linear whose observed phase scaling differs is a mismatch (a phase the schedule switched
    gives `switch_why`); the asked share counts the
    FLOPs of each observed (module, phase) the policy puts in FP8, and of the modules it does not cover (MoE experts,
    a library's GEMMs) as they ran."""
    mismatches = []
    asked = 0
    for (module, phase), labels in sorted(ledger.phase_scalings.items()):
        flops = ledger.phase_flops[(module, phase)]
        if module not in expected:
            asked += flops if all(map(_low, labels)) else 0
            continue
        recipe, why = expected[module]
        want = expected_phases(recipe, switched_gemms)[phase]
        if want != expected_phases(recipe)[phase]:
            why = switch_why
        got = sorted({label if _low(label) else HIGH for label in labels})
        asked += flops if want != HIGH else 0
        if got != [want] and not (got == ["fp8"] and want != HIGH):
            mismatches.append({"module": module, "phase": phase, "expected": want, "observed": "+".join(got),
                               "why": why})
    total = sum(ledger.flops.values())
    return {"mismatches": mismatches, "asked_fp8_share": round(asked / total, 4) if total else 0.0}


def describe(mismatches: list[dict[str, Any]], limit: int = 4) -> str:
    """The mismatches in words, one per Linear (its phases together; the first `limit` Linears)."""
    grouped: dict[tuple[str, str, str, str], list[str]] = {}
    for m in mismatches:
        grouped.setdefault((m["module"], m["observed"], m["expected"], m["why"]), []).append(m["phase"])
    words = [f"{module} ran {got} in {', '.join(phases)}, the policy says {want} ({why})"
             for (module, got, want, why), phases in list(grouped.items())[:limit]]
    more = len(grouped) - limit
    return "; ".join(words) + (f"; and {more} more Linears" if more > 0 else "")
