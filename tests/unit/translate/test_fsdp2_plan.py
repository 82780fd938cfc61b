"""The typed FSDP2 plan: frozen, every value of the type its field names, its enumerations those of the schema, its
JSON the golden text to the byte, and its "world" shard size what the run's ParallelDims resolves."""
import dataclasses
import json
import types
import typing
from collections.abc import Mapping

import pytest

import fp8dist.translate.fsdp2 as fsdp2
from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.config.spec import Dtype
from fp8dist.facts.transformer_engine import TE_RECIPES
from fp8dist.translate.fsdp2 import FSDP2Plan, PlanSection, fsdp2_layout, to_fsdp2
from tests.conftest import ROOT
from tests.golden.regenerate import golden_cases, translate

SCHEMA = json.loads((ROOT / "schemas" / "fp8dist.schema.json").read_text())
FSDP2_CASES = [case for case in golden_cases() if case[2] == "fsdp2"]


def schema_enum(*path: str) -> set:
    node = SCHEMA
    for key in path:
        node = node["properties"][key]
    return set(node["enum"])


def check_types(value, hint, where: str) -> None:
    """`value` is of the type `hint` names (the subset of typing the plan uses), recursing into plan sections."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        assert value in args, f"{where}: {value!r} is not one of {args}"
    elif origin in (typing.Union, types.UnionType):
        errors = []
        for option in args:
            try:
                check_types(value, option, where)
                return
            except AssertionError as exc:
                errors.append(str(exc))
        raise AssertionError(f"{where}: {value!r} matches no option of {hint}: {errors}")
    elif origin is tuple:
        assert isinstance(value, tuple), f"{where}: {value!r} is not a tuple"
        for i, item in enumerate(value):
            check_types(item, args[0], f"{where}[{i}]")
    elif origin is Mapping:
        assert isinstance(value, Mapping), f"{where}: {value!r} is not a mapping"
    elif hint is type(None):
        assert value is None, f"{where}: {value!r} is not None"
    elif hint is float:
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{where}: {value!r}"
    elif isinstance(hint, type) and issubclass(hint, PlanSection):
        assert isinstance(value, hint), f"{where}: {value!r} is not a {hint.__name__}"
        hints = typing.get_type_hints(hint, vars(fsdp2))
        for f in dataclasses.fields(value):
            check_types(getattr(value, f.name), hints[f.name], f"{where}.{f.name}")
    else:
        assert isinstance(value, hint) and (hint is bool or not isinstance(value, bool)), f"{where}: {value!r}"


@pytest.mark.parametrize("config,spec,target,version", FSDP2_CASES, ids=[c.stem for c, *_ in FSDP2_CASES])
def test_the_json_is_the_golden_text_and_every_value_has_its_fields_type(config, spec, target, version):
    golden = (ROOT / "tests" / "golden" / f"{config.stem}.fsdp2.json").read_text()
    assert json.dumps(translate(spec, target, version), indent=2) + "\n" == golden  # key order included
    check_types(to_fsdp2(spec, torchao_version=version, te_version="2.20.2"), FSDP2Plan, "plan")


def test_the_plan_is_frozen():
    plan = to_fsdp2(load_config({}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.sharding.reshard_after_forward = False


def test_the_enumerations_are_the_schemas():
    assert set(typing.get_args(fsdp2.Strategy)) == schema_enum("parallel", "sharding") - {"auto"}
    assert set(fsdp2.STRATEGIES) == schema_enum("parallel", "sharding")
    assert set(typing.get_args(fsdp2.ActivationCheckpointing)) == schema_enum("parallel", "activation_checkpointing")
    assert set(typing.get_args(Dtype)) == set(SCHEMA["$defs"]["dtype"]["enum"])
    assert set(typing.get_args(fsdp2.StateDtype)) >= schema_enum("optimizer", "state_dtype") - {"auto"}
    assert set(typing.get_args(fsdp2.Float8Recipe)) == schema_enum("precision", "fp8", "torchao", "recipe_name")
    assert set(typing.get_args(fsdp2.ExpertsMode)) == schema_enum("precision", "fp8", "torchao", "experts")
    assert set(typing.get_args(fsdp2.TERecipe)) == schema_enum("precision", "fp8", "te", "recipe") == set(TE_RECIPES)
    assert set(typing.get_args(fsdp2.OptimizerClass)) == set(fsdp2.OPTIMIZER_CLASSES.values())


@pytest.mark.parametrize("parallel", [{"sharding": "full"}, {"sharding": "grad_op"}, {"sharding": "auto"},
                                      {"sharding": "replicate"}, {"sharding": "hybrid", "shard_size": 2}])
def test_the_world_shard_size_is_what_parallel_dims_resolves(parallel):
    spec = load_config({"parallel": parallel})
    layout = fsdp2_layout(spec)
    for world in (4, 8):
        dims = ParallelDims.of(spec, world)
        assert dims.dp_shard == (world if layout.shard_size == "world" else layout.shard_size)
        assert layout.to_json()["mesh"].startswith("1-D" if dims.dp_replicate == 1 else "2-D")


def test_keys_left_out_or_false_as_the_json_has_them():
    float8 = load_config(ROOT / "configs" / "fsdp2-torchao-float8.yaml")
    old, new = (to_fsdp2(float8, torchao_version=v).to_json()["float8"] for v in ("0.11.0", "0.18.0"))
    assert old["float8_linear_config"]["force_recompute_fp8_weight_in_bwd"] is True  # torchao 0.11 needs it
    assert "force_recompute_fp8_weight_in_bwd" not in new["float8_linear_config"]  # a no-op from 0.12: not passed
    assert to_fsdp2(load_config({"compile": False})).to_json()["compile"] is False
    assert to_fsdp2(load_config({"compile": True})).to_json()["compile"] == {
        "per_block": True, "root_if_no_blocks": True, "before": "fully_shard"}
    loading = to_fsdp2(load_config({})).to_json()["loading"]
    assert loading == {"mode": "full model on every rank"}
