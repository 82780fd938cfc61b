"""precision.fp8.policy auto's decision (fp8dist/backends/auto_policy.py): measured numerics and the speed model in,
one recipe per Linear out, both reasons said."""
import pytest

from fp8dist.backends.auto_policy import (Limits, SpeedModel, candidates, choose, eligible, judge, overrides_of,
                                          report_lines)
from fp8dist.backends.module_filter import LinearInfo, Policy

LIMITS = Limits(0.01, 0.0, {"forward": 18.0, "input_grad": 12.0, "weight_grad": 17.0})
UP = LinearInfo("model.layers.0.mlp.up_proj", 4096, 14336, block=0, blocks=2)
Q = LinearInfo("model.layers.0.self_attn.q_proj", 4096, 4096, block=0, blocks=2)


def doc(module: str, underflow: float = 0.0, sqnr: float = 28.0, weight_grad: bool = True) -> dict:
    """A numerics document (fp8dist.audit.numerics.document) of one module: its casts and GEMMs."""
    gemms = ["forward", "input_grad"] + ["weight_grad"] * weight_grad
    return {"casts": [{"module": module, "gemm": g, "operand": op, "format": "e4m3", "underflow": underflow,
                       "saturated": 0.0} for g in gemms for op in ("input", "weight")],
            "gemms": [{"module": module, "gemm": g, "format": "e4m3", "sqnr_db": sqnr} for g in gemms]}


def merged(*docs: dict) -> dict:
    return {kind: [row for d in docs for row in d[kind]] for kind in ("casts", "gemms")}


def test_numerics_only_takes_the_first_recipe_that_passes_and_says_why():
    recipes = candidates("tensorwise")
    assert recipes == ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    measured = {"tensorwise": merged(doc(UP.fqn, underflow=0.99), doc(Q.fqn)),
                "rowwise": merged(doc(UP.fqn), doc(Q.fqn)),
                "rowwise_with_gw_hp": merged(doc(UP.fqn, weight_grad=False), doc(Q.fqn, weight_grad=False))}
    up, q = choose([UP, Q], recipes, {}, measured, LIMITS, None)
    assert (up.recipe, q.recipe) == ("rowwise", "tensorwise")
    assert "tensorwise fails (forward input underflow 0.99 > 0.01;" in up.numerics
    assert "rowwise passes (SQNR 28/28/28 dB, underflow <= 0)" in up.numerics
    assert up.speed == "speed: not predicted (no GPU the speed model knows: numerics only)"
    assert report_lines([up])[0].startswith("  model.layers.0.mlp.up_proj: rowwise (numerics: ")


def test_no_recipe_passing_keeps_the_compute_dtype_naming_each_failure():
    measured = {r: doc(UP.fqn, sqnr=10.0) for r in candidates("rowwise")}
    (up,) = choose([UP], candidates("rowwise"), {}, measured, LIMITS, None)
    assert up.recipe is None and "forward SQNR 10.0 dB < 18" in up.numerics
    assert report_lines([up])[0].startswith("  model.layers.0.mlp.up_proj: compute dtype (")
    (unmeasured,) = choose([UP], ("tensorwise",), {}, {"tensorwise": {"casts": [], "gemms": []}}, LIMITS, None)
    assert unmeasured.recipe is None and "not measured" in unmeasured.numerics


def test_the_speed_model_picks_the_fastest_passing_recipe_and_applies_min_speedup():
    recipes = candidates("rowwise")
    measured = {r: merged(doc(UP.fqn), doc(Q.fqn)) for r in recipes}
    model = SpeedModel("h100", 16384, True, 1.0)
    up, _ = choose([UP, Q], recipes, {}, measured, LIMITS, model)
    predicted = {r: model.predicted(UP, r) for r in recipes}
    assert up.recipe == max(predicted, key=predicted.get)
    assert f"{up.recipe} fastest" in up.speed and "H100" in up.speed and "min_speedup=1" in up.speed
    slow = SpeedModel("h100", 64, False, 1.0)  # 64 tokens: no recipe pays on a Linear this size
    (kept,) = choose([Q], recipes, {}, measured, LIMITS, slow)
    assert kept.recipe is None and "below min_speedup" in kept.speed
    # L40S (SM 8.9) has no rowwise kernels in torchao: said, and tensorwise taken where it passes
    (l40s,) = choose([UP], recipes, {}, measured, LIMITS, SpeedModel("l40s", 16384, True, None))
    assert l40s.recipe == "tensorwise" and "rowwise does not run on L40S" in l40s.speed


def test_a_recipe_whose_dims_do_not_fit_is_not_tried():
    odd = LinearInfo("model.layers.0.mlp.odd", 4096, 100)
    (d,) = choose([odd], ("mxfp8", "tensorwise"), {"mxfp8": 32, "tensorwise": None},
                  {"mxfp8": {"casts": [], "gemms": []}, "tensorwise": doc(odd.fqn)}, LIMITS, None)
    assert d.recipe == "tensorwise" and "mxfp8: dims 4096x100 not multiples of 32" in d.numerics


def test_auto_decides_only_what_the_written_policy_leaves_to_the_run_recipe():
    linears = [LinearInfo(f"model.layers.{b}.{n}", 64, 64, block=b, blocks=3) for b in range(3)
               for n in ("self_attn.q_proj", "mlp.up_proj")] + [LinearInfo("lm_head", 64, 128)]
    policy = Policy("tensorwise", ((("*.mlp.*",), "rowwise"),), keep_first=1)
    names = [info.fqn for info in eligible(linears, ["lm_head"], False, policy)]
    assert names == ["model.layers.1.self_attn.q_proj", "model.layers.2.self_attn.q_proj"]


def test_the_overrides_group_the_linears_per_recipe_in_order():
    measured = {"tensorwise": merged(doc(UP.fqn, underflow=0.5), doc(Q.fqn))}
    decisions = choose([UP, Q], ("tensorwise",), {}, measured, LIMITS, None)
    assert overrides_of(decisions) == [{"modules": [UP.fqn], "recipe": "none"},
                                       {"modules": [Q.fqn], "recipe": "tensorwise"}]


@pytest.mark.parametrize("rows", [None, {"casts": [], "gemms": []}])
def test_a_linear_without_measurements_does_not_pass(rows):
    assert judge(rows, LIMITS)[0] is False
