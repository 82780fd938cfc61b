"""precision.fp8.policy: auto, the decision: which recipe each Linear gets from what the calibration pass measured
(the numerics of `audit --numerics` per candidate recipe) and what the speed model predicts (fp8dist/speed.py).
Pure: layer facts and measurements in, one decision per Linear out (fp8dist.audit.calibration measures).

Per Linear, the rule is the issue's (issue 50) and Megatron-Core's spirit of a per-module precision config, with
every choice measured: a candidate recipe passes where every cast of the Linear's three GEMMs (forward, input
gradient, weight gradient) is within `audit.numerics` (underflow, saturation) and every GEMM's SQNR is at least its
limit; on a GPU the speed model knows, where its predicted speedup at the run's tokens per micro-batch is at least
`precision.fp8.min_speedup` too; the passing recipe predicted fastest wins (without a GPU: the first that passes,
in CANDIDATES order after the run's own). None passing: the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import fp8dist.speed as speed
from fp8dist.backends.module_filter import LinearInfo, Policy, base_name, decide, is_adapter
from fp8dist.errors import Fp8distError

# The recipes the calibration tries, after the run's own: torchao's float8 recipes (torchao 0.18
# float8/config.py Float8LinearRecipeName); MXFP8 only where it is the run's recipe (its dims: multiples of 32).
CANDIDATES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
GEMMS = ("forward", "input_grad", "weight_grad")


def candidates(run_recipe: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys((run_recipe, *CANDIDATES)))


@dataclass(frozen=True)
class Limits:
    """audit.numerics (fp8dist.audit.numerics.Thresholds, without torch)."""
    max_underflow: float
    max_saturated: float
    min_sqnr_db: Mapping[str, float]


@dataclass(frozen=True)
class SpeedModel:
    """The speed model as the calibration asks it: `gpu` (hardware.gpu or the device's), the run's tokens per micro-
    batch and compile setting; `min_speedup`: precision.fp8.min_speedup resolved (None: rank the recipes, keep all)."""
    gpu: str
    tokens: int
    compiled: bool
    min_speedup: float | None

    def predicted(self, info: LinearInfo, recipe: str) -> float:
        return speed.linear_times(self.tokens, info.in_features, info.out_features, recipe, self.gpu,
                                  backend="torchao", compiled=self.compiled).speedup


@dataclass(frozen=True)
class AutoDecision:
    """One Linear's calibrated recipe (None: the compute dtype) and the two reasons the start report gives."""
    fqn: str
    recipe: str | None
    numerics: str
    speed: str


def eligible(linears: Sequence[LinearInfo], exclude: Iterable[str], skip_first_last: bool,
             policy: Policy) -> list[LinearInfo]:
    """The Linears that `auto` decides: those the written policy leaves to the run's recipe (not an adapter or a
    router, not excluded, not in a kept block, not first/last under skip_first_last, matched by no written
    override). The dims rules come per candidate (`fits`), the speed rule in `choose`."""
    by_name = {info.fqn: info for info in linears}
    return [by_name[d.fqn] for d in decide(linears, exclude, skip_first_last, None, policy=policy)
            if d.convert and not is_adapter(d.fqn) and policy.override(base_name(d.fqn)) is None]


def fits(info: LinearInfo, multiple: int | None) -> bool:
    return not multiple or not (info.in_features % multiple or info.out_features % multiple)


def per_module(numerics: Mapping[str, Any]) -> dict[str, dict[str, list]]:
    """A numerics document (fp8dist.audit.numerics.document: `casts`, `gemms`) grouped by module."""
    out: dict[str, dict[str, list]] = {}
    for kind in ("casts", "gemms"):
        for row in numerics.get(kind, []):
            out.setdefault(row["module"], {"casts": [], "gemms": []})[kind].append(row)
    return out


def judge(rows: Mapping[str, list] | None, limits: Limits) -> tuple[bool, str]:
    """(passes, what was measured) of one Linear under one recipe: its casts' worst underflow and saturation, its
    GEMMs' SQNR, every value beyond its limit named. Not measured (its GEMMs did not run): does not pass."""
    if not rows or not rows["gemms"]:
        return False, "not measured (none of its GEMMs ran in the calibration steps)"
    failing = [f"{c['gemm']} {c['operand']} {metric} {c[metric]:.4g} > {limit:g}"
               for c in rows["casts"] for metric, limit in (("underflow", limits.max_underflow),
                                                           ("saturated", limits.max_saturated)) if c[metric] > limit]
    failing += [f"{g['gemm']} SQNR {g['sqnr_db']} dB < {limits.min_sqnr_db[g['gemm']]:g}" for g in rows["gemms"]
                if g["sqnr_db"] is not None and g["sqnr_db"] < limits.min_sqnr_db[g["gemm"]]]
    if failing:
        return False, "; ".join(failing)
    sqnr = {g["gemm"]: g["sqnr_db"] for g in rows["gemms"]}
    under = max((c["underflow"] for c in rows["casts"]), default=0.0)
    return True, ("SQNR " + "/".join("exact" if sqnr.get(g) is None else f"{sqnr[g]:g}" for g in GEMMS if g in sqnr)
                  + f" dB, underflow <= {under:g}")


def choose(linears: Sequence[LinearInfo], recipes: Sequence[str], dims: Mapping[str, int | None],
           measured: Mapping[str, Mapping[str, Any]], limits: Limits, model: SpeedModel | None,
           unmeasured: Mapping[str, Mapping[str, str]] | None = None) -> list[AutoDecision]:
    """One AutoDecision per Linear of `linears` (the eligible ones): `recipes` the candidates in order, `dims` each
    recipe's dims multiple, `measured` recipe -> its numerics document, `unmeasured` recipe -> {module: why its
    probe failed}."""
    grouped = {recipe: per_module(doc) for recipe, doc in measured.items()}
    out = []
    for info in linears:
        verdicts: list[str] = []
        passing: list[str] = []
        for recipe in recipes:
            if not fits(info, dims.get(recipe)):
                verdicts.append(f"{recipe}: dims {info.in_features}x{info.out_features} not multiples of "
                                f"{dims.get(recipe)}")
                continue
            failed = (unmeasured or {}).get(recipe, {}).get(info.fqn)
            ok, said = (False, f"its probe failed: {failed}") if failed else judge(
                grouped.get(recipe, {}).get(info.fqn), limits)
            verdicts.append(f"{recipe} {'passes' if ok else 'fails'} ({said})")
            if ok:
                passing.append(recipe)
        numerics = "numerics: " + "; ".join(verdicts)
        if model is None:
            chosen = passing[0] if passing else None
            why = "speed: not predicted (no GPU the speed model knows: numerics only)"
        else:
            chosen, why = _fastest(info, passing, model)
        out.append(AutoDecision(info.fqn, chosen, numerics, why))
    return out


def _fastest(info: LinearInfo, passing: Sequence[str], model: SpeedModel) -> tuple[str | None, str]:
    if not passing:
        return None, "speed: not asked (no recipe passes the numerics)"
    predicted: dict[str, float] = {}
    unsupported = []
    for recipe in passing:
        try:
            predicted[recipe] = model.predicted(info, recipe)
        except Fp8distError:  # speed.check_supported: no tensor cores or kernels for it on that GPU
            unsupported.append(recipe)
    fast = [r for r in predicted if model.min_speedup is None or predicted[r] >= model.min_speedup]
    at = f"at M={model.tokens} on {model.gpu.upper()}{'' if model.compiled else ', not compiled'}"
    listed = ", ".join([f"{r} {p:.2f}x" for r, p in predicted.items()] +
                       [f"{r} does not run on {model.gpu.upper()}" for r in unsupported])
    threshold = (" (no min_speedup: FP8 emulated, or min_speedup off)" if model.min_speedup is None
                 else f", precision.fp8.min_speedup={model.min_speedup:g}")
    if not fast:
        return None, f"speed: predicted {listed} {at}: below min_speedup{threshold}"
    chosen = max(fast, key=lambda r: predicted[r])  # max keeps the first of equal ones: candidate order
    return chosen, f"speed: predicted {listed} {at}{threshold}: {chosen} fastest"


def overrides_of(decisions: Sequence[AutoDecision]) -> list[dict[str, Any]]:
    """The calibrated decisions as precision.fp8.overrides entries: one per recipe (`none` for the compute dtype),
    each naming its Linears in full, in the order the recipes first appear."""
    by_recipe: dict[str, list[str]] = {}
    for d in decisions:
        by_recipe.setdefault(d.recipe or "none", []).append(d.fqn)
    return [{"modules": fqns, "recipe": recipe} for recipe, fqns in by_recipe.items()]


def report_lines(decisions: Sequence[AutoDecision]) -> list[str]:
    """The start report's lines: each Linear, what it got, its numerics reason and its speed reason."""
    return [f"  {d.fqn}: {d.recipe or 'compute dtype'} ({d.numerics}; {d.speed})" for d in decisions]
