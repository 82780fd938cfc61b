"""The gemm row's policy check on a real ledger: torchao emulated Linears in two recipes, one step."""
import dataclasses

import torch

import fp8dist.audit.probes as probes
from fp8dist.audit.policy_check import HIGH, check, describe, expected_phases


def _ledger(recipes: dict[str, str | None]):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False) for _ in recipes]).to(torch.bfloat16)
    for name, recipe in recipes.items():
        if recipe:
            config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
            convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn, n=name: fqn == n)
    recorder = probes.MatmulRecorder()
    with recorder.ledger.owners(model), recorder:
        model(torch.randn(16, 32, dtype=torch.bfloat16)).float().sum().backward()
    return recorder.ledger


def test_each_recipe_is_seen_in_its_phases_and_a_wrong_one_is_named():
    ledger = _ledger({"0": "tensorwise", "1": "rowwise_with_gw_hp", "2": None})
    policy = {"0": ("tensorwise", "a"), "1": ("rowwise_with_gw_hp", "b"), "2": (None, "c")}
    assert check(ledger, policy) == {"mismatches": [], "asked_fp8_share": round(5 / 9, 4)}
    wrong = check(ledger, {**policy, "0": ("rowwise", "override 0")})
    assert [(m["module"], m["phase"], m["observed"]) for m in wrong["mismatches"]] == [
        ("0", "forward", "tensorwise"), ("0", "input_gradient", "tensorwise"), ("0", "weight_gradient", "tensorwise")]
    assert describe(wrong["mismatches"]).startswith("0 ran tensorwise in forward, input_gradient, weight_gradient, "
                                                    "the policy says rowwise (override 0)")


def test_the_schedule_s_switch_changes_what_is_expected():
    assert expected_phases("rowwise", "forward") == {"forward": HIGH, "input_gradient": "rowwise",
                                                     "weight_gradient": "rowwise"}
    assert set(expected_phases("mxfp8", "all").values()) == {HIGH}
    ledger = _ledger({"0": "tensorwise"})
    found = check(ledger, {"0": ("tensorwise", "x")}, "forward", "precision.schedule: from step 3")
    assert [(m["phase"], m["why"]) for m in found["mismatches"]] == [("forward", "precision.schedule: from step 3")]
