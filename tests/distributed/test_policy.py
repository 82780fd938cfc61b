"""The per-Linear precision policy and the precision schedule on 2 gloo ranks (tests/distributed/scripts/
policy_runs.py, one job for all cases)."""
import pytest

from tests.conftest import ROOT
from tests.distributed.launch import cases

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    return cases(ROOT / "tests" / "distributed" / "scripts" / "policy_runs.py", nproc=2, timeout=900)


def test_three_recipes_side_by_side_pass_the_audit(results):
    case = results["three-recipes"]
    assert case["passed"] and case["failing"] == [], case["gemm"]
    recipes = case["recipes"]
    assert {recipes[f"model.layers.0.self_attn.{p}_proj"] for p in "qkvo"} == {"rowwise"}
    assert {recipes[f"model.layers.0.mlp.{p}_proj"] for p in ("gate", "up", "down")} == {"tensorwise"}
    assert not any(recipes[name] for name in recipes if name.startswith("model.layers.1."))
    assert case["all_gather"] == "fp8"  # the tensorwise MLP weights travel in float8
    assert case["flops"]["policy"]["mismatches"] == []
    assert case["flops"]["policy"]["asked_fp8_share"] == case["flops"]["fp8_share"] == pytest.approx(0.4091)


def test_a_linear_in_another_format_than_the_policy_fails_naming_it(results):
    case = results["another-policy"]
    assert not case["passed"] and case["failing"] == ["gemm"]
    wrong = {(m["module"], m["observed"], m["expected"]) for m in case["flops"]["policy"]["mismatches"]}
    assert wrong == {(f"model.layers.0.self_attn.{p}_proj", "rowwise", "tensorwise") for p in "qkvo"}
    assert "model.layers.0.self_attn.k_proj ran rowwise" in case["gemm"]["detail"]


def test_schedule_switches_at_step_3_is_audited_and_resumes_bitwise_across_it(results):
    case = results["schedule-resume"]
    assert case["audited"] == [1, 3] and case["first_report_passed"]
    assert case["forward_casts_after"] == ["ScalingType.DISABLED"]
    for saved in ("2", "4"):  # before and after the switch
        assert case["resumed"][saved] == {"weights": True, "losses": True, "step_number": 6}


def test_a_run_that_did_not_switch_fails_the_audit_of_a_step_after_the_switch(results):
    case = results["unswitched-after-switch"]
    assert not case["passed"] and case["failing"] == ["gemm"]
    assert {m["phase"] for m in case["flops"]["policy"]["mismatches"]} == {"forward"}
    assert "the policy says compute dtype (precision.schedule: from step 3" in case["gemm"]["detail"]
