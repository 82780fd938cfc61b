"""The facts' decisions (fp8dist.facts), with versions and capabilities as inputs."""
import pytest

from fp8dist.facts.msamp import msamp_native_fp8, msamp_supports_deepspeed
from fp8dist.facts.torchao import (TORCHAO_HIGH_PRECISION_GEMMS, TORCHAO_RECIPE_MIN_CAPABILITY, torchao_force_recompute,
                                   torchao_fp8_hardware)
from fp8dist.facts.transformer_engine import te_recipe_available, te_recipe_hardware, te_removed_field_reason
from fp8dist.facts.versions import fmt, parse_version


@pytest.mark.parametrize("text,expected", [("0.19.8", (0, 19, 8)), ("2.13.0+cpu", (2, 13, 0)),
                                           ("0.19.0.dev0", (0, 19, 0)), ("2.6", (2, 6, 0)), ("v1.2.3", (1, 2, 3))])
def test_parse_version(text, expected):
    assert parse_version(text) == expected


@pytest.mark.parametrize("version,requested,all_gather,expected", [
    ((0, 5, 0), "auto", True, False),
    ((0, 6, 0), "auto", True, True),
    ((0, 11, 0), "auto", True, True),
    ((0, 11, 0), "auto", False, False),
    ((0, 9, 0), False, True, False),
    ((0, 12, 0), "auto", True, False),
    ((0, 12, 0), True, True, False),
    ((0, 18, 0), True, True, False),
])
def test_force_recompute_decision_across_torchao_versions(version, requested, all_gather, expected):
    value, reason = torchao_force_recompute(version, requested, all_gather)
    assert value is expected and reason


def test_force_recompute_requested_on_torchao_without_it_is_an_error():
    with pytest.raises(ValueError, match="has no force_recompute"):
        torchao_force_recompute((0, 5, 0), True, True)


def test_force_recompute_noop_reason_cites_the_issue():
    _, reason = torchao_force_recompute((0, 18, 0), True, True)
    assert "2251" in reason and "no-op" in reason


@pytest.mark.parametrize("ds,ok", [((0, 9, 2), True), ((0, 10, 0), True), ((0, 10, 1), False), ((0, 12, 3), False),
                                   ((0, 12, 4), True), ((0, 13, 1), True), ((0, 17, 4), True), ((0, 17, 5), False),
                                   ((0, 19, 8), False)])
def test_msamp_deepspeed_windows(ds, ok):
    assert msamp_supports_deepspeed(ds)[0] is ok


@pytest.mark.parametrize("ds,msamp,ok", [((0, 9, 2), (0, 3, 0), True), ((0, 13, 1), (0, 3, 0), False),
                                         ((0, 13, 1), (0, 4, 0), True), ((0, 9, 2), (0, 4, 0), False),
                                         ((0, 17, 4), (0, 4, 0), True), ((0, 13, 1), (0, 5, 0), False)])
def test_msamp_window_follows_the_installed_msamp(ds, msamp, ok):
    supported, reason = msamp_supports_deepspeed(ds, msamp)
    assert supported is ok, reason
    if msamp == (0, 5, 0):
        assert "not a release fp8dist knows" in reason
    elif not ok:
        assert f"installed MS-AMP {fmt(msamp)}" in reason


@pytest.mark.parametrize("recipe,cap,ok", [("tensorwise", (8, 9), True), ("tensorwise", (8, 0), False),
                                           ("rowwise", (8, 9), False), ("rowwise", (9, 0), True),
                                           ("rowwise_with_gw_hp", (10, 0), True), ("tensorwise", None, False)])
def test_torchao_hardware_gate(recipe, cap, ok):
    assert torchao_fp8_hardware(recipe, cap)[0] is ok


@pytest.mark.parametrize("recipe,cap,cuda,ok", [
    ("delayed", (9, 0), (12, 4, 0), True), ("delayed", (8, 0), (12, 4, 0), False),
    ("delayed", (8, 9), (12, 0, 0), False), ("delayed", (8, 9), (12, 1, 0), True),
    ("current", (9, 0), (12, 4, 0), True), ("block", (9, 0), (12, 8, 0), False), ("block", (9, 0), (12, 9, 0), True),
    ("mxfp8", (9, 0), (12, 8, 0), False), ("mxfp8", (10, 0), (12, 8, 0), True), ("mxfp8", (12, 0), (12, 8, 0), False),
    ("nvfp4", (10, 0), (12, 8, 0), True), ("nvfp4", (9, 0), (12, 8, 0), False), ("delayed", None, None, False)])
def test_te_recipe_hardware(recipe, cap, cuda, ok):
    assert te_recipe_hardware(recipe, cap, cuda)[0] is ok


@pytest.mark.parametrize("recipe,version,ok", [("delayed", (1, 0, 0), True), ("current", (2, 1, 0), False),
                                               ("current", (2, 2, 0), True), ("block", (2, 2, 0), False),
                                               ("nvfp4", (2, 7, 0), False), ("nvfp4", (2, 8, 0), True),
                                               ("mxfp8", (2, 0, 0), True)])
def test_te_recipe_versions(recipe, version, ok):
    assert te_recipe_available(recipe, version)[0] is ok


def test_te_removed_fields():
    assert "removed from Transformer Engine in 2.2.0" in te_removed_field_reason("interval")
    assert "removed from Transformer Engine in 2.0.0" in te_removed_field_reason("override_linear_precision")


def test_msamp_native_fp8_only_on_h100():
    assert msamp_native_fp8("NVIDIA H100 80GB HBM3")[0]
    assert not msamp_native_fp8("NVIDIA H200")[0]
    assert not msamp_native_fp8(None)[0]


def test_schema_torchao_recipe_enum_is_the_hardware_table():
    """A torchao recipe is one entry of TORCHAO_RECIPE_MIN_CAPABILITY plus its value in the schema's enum."""
    from fp8dist.config.schema import schema

    torchao = schema()["properties"]["precision"]["properties"]["fp8"]["properties"]["torchao"]["properties"]
    assert torchao["recipe_name"]["enum"] == list(TORCHAO_RECIPE_MIN_CAPABILITY)
    assert set(TORCHAO_HIGH_PRECISION_GEMMS) <= set(TORCHAO_RECIPE_MIN_CAPABILITY)
