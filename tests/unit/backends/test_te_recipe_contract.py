"""Contract tests against Transformer Engine's real code, on CPU: for each release of TE_CHECKED the
registry wheel's recipe module (transformer_engine/common/recipe/__init__.py, loaded by path under a private name:
tests/te_wheels.py) and its Python sources.

- every recipe and field fp8dist writes is built by fp8dist's own code (backends/transformer_engine.py
  build_recipe, from translate/fsdp2.py te_recipe_plan) on the real class: a value fp8dist writes is kept on the
  object; what fp8dist refuses for a release is what that release lacks (and would drop without a word);
- every value TE's classes raise on is refused by fp8dist's config rules first, with TE's own message;
- facts.transformer_engine.TE_RECIPES says when each class and field appears, and the rejections, as the wheels do;
- the names the audit and the backend read in TE's tensors and modules exist in the wheels' sources.

The wheels are downloaded once (~1 s each, in parallel) into $FP8DIST_TE_WHEEL_CACHE, else the session's
temporary directory; without the registry the tests skip, saying so.
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import os
import re
from pathlib import Path

import pytest

from fp8dist.audit.library_gemms import TE_MODULE_PREFIX
from fp8dist.backends.storage import ENUM_NAMES, TE_BUFFER_ATTRS, TE_FORMAT_ATTRS
from fp8dist.backends.transformer_engine import build_recipe
from fp8dist.config.load import load_config
from fp8dist.errors import ConfigError
from fp8dist.facts.transformer_engine import (TE_AUTOCAST_RENAMED, TE_CHECKED, TE_NEWEST_KNOWN, TE_OLDEST_SUPPORTED,
                                              TE_RECIPES, te_field_kept, te_recipe_available)
from fp8dist.facts.versions import fmt, parse_version
from fp8dist.translate.fsdp2 import te_float8_plan
from tests import te_wheels

pytest.importorskip("pydantic", reason="TE's recipe module needs pydantic (DeepSpeed installs it)")

VERSIONS = [fmt(v) for v in TE_CHECKED]
OLDEST_NEWEST = [VERSIONS[0], VERSIONS[-1]]
# One non-default value per field fp8dist writes (TE's defaults: HYBRID or E4M3, margin 0, 1024, "max", True,
# False), so that a kept value cannot be the default by chance; nvfp4 takes E4M3 only.
VALUES = {"delayed": {"fp8_format": "E4M3", "margin": 1, "amax_history_len": 16, "amax_compute_algo": "most_recent",
                      "reduce_amax": False},
          "current": {"fp8_format": "E4M3", "use_power_2_scales": True},
          "block": {"fp8_format": "HYBRID"},
          "mxfp8": {"fp8_format": "HYBRID", "enable_2d_quantization": True},
          "nvfp4": {"fp8_format": "E4M3"}}
CASES = [(recipe, field) for recipe, fields in VALUES.items() for field in fields]
# Every value a schema key may take, for finding what TE raises on.
CANDIDATES = {"fp8_format": ["HYBRID", "E4M3"], "margin": [1], "amax_history_len": [16],
              "amax_compute_algo": ["max", "most_recent"], "reduce_amax": [True, False],
              "use_power_2_scales": [True, False], "enable_2d_quantization": [True, False],
              "fp8_dpa": [True, False], "fp8_mha": [True, False]}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    cache = os.environ.get(te_wheels.CACHE_ENV)
    try:
        return te_wheels.download(VERSIONS, Path(cache) if cache else tmp_path_factory.mktemp("te-wheels"))
    except te_wheels.Unavailable as exc:
        pytest.skip(f"the Transformer Engine wheels cannot be had here: {exc}")


@pytest.fixture(scope="module")
def recipes(wheels):
    return {version: te_wheels.load_recipe_module(wheel) for version, wheel in wheels.items()}


def te_spec(recipe, **fields):
    return load_config({"precision": {"preset": "te", "fp8": {"te": {"recipe": recipe, **fields}}}})


def field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def plain(value):
    return value.name if isinstance(value, enum.Enum) else value


def te_value(module, field, value):
    return module.Format[value] if field == "fp8_format" else value


def te_message(error: Exception) -> str:
    """TE's assert text: pydantic 2 wraps it ('Assertion failed, <text> [type=...'), pydantic 1 raises it bare."""
    found = re.search(r"Assertion failed, (.*?) \[type=", str(error))
    return found.group(1) if found else str(error)


def test_pinned_releases_cover_every_first_release():
    firsts = {r.since for r in TE_RECIPES.values()} | {f.since for r in TE_RECIPES.values() for f in r.fields}
    wanted = {TE_OLDEST_SUPPORTED, TE_NEWEST_KNOWN} | {v for v in firsts if v >= TE_OLDEST_SUPPORTED}
    assert wanted <= set(TE_CHECKED)
    assert {(r, f.name) for r in TE_RECIPES for f in TE_RECIPES[r].fields
            if not f.ignored} == set(CASES)  # VALUES covers every field fp8dist writes


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("recipe,field", CASES)
def test_fp8dist_writes_a_field_only_where_the_release_keeps_it(recipes, version, recipe, field):
    module, record, value = recipes[version], TE_RECIPES[recipe], VALUES[recipe][field]
    spec, cls = te_spec(recipe, **{field: value}), getattr(module, record.cls, None)
    try:
        built = build_recipe(module, spec, parse_version(version))
    except ConfigError as refusal:
        text = str(refusal)
        if cls is None:
            assert "precision.fp8.te.recipe" in text and f">= {fmt(record.since)}" in text, text
        else:  # the release lacks the field: its class would drop it without a word
            assert field not in field_names(cls)
            assert not hasattr(cls(**{field: te_value(module, field, value)}), field)
            assert f"precision.fp8.te.{field}" in text and fmt(record.field(field).since) in text, text
        return
    assert cls is not None and field in field_names(cls), f"TE {version} {record.cls} would drop {field}"
    assert plain(getattr(built, field)) == value
    for path in record.field(field).also_sets:  # what te.Linear reads instead (use_power_2_scales)
        attribute, member = path.split(".")
        assert getattr(getattr(built, attribute), member) == value, path
    plan = te_float8_plan(spec, te_version=version).recipe_build  # the translation says what was built
    assert plan.recipe_class == record.cls and plan.recipe_fields == {field: value}
    assert all(getattr(getattr(built, p.split(".")[0]), p.split(".")[1]) == v
               for p, v in plan.recipe_attributes.items())


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("recipe", list(VALUES))
def test_every_field_of_a_recipe_together(recipes, version, recipe):
    module, record = recipes[version], TE_RECIPES[recipe]
    fields = {f: v for f, v in VALUES[recipe].items() if te_field_kept(recipe, f, parse_version(version))[0]}
    if not te_recipe_available(recipe, parse_version(version))[0]:
        assert not hasattr(module, record.cls)
        return
    built = build_recipe(module, te_spec(recipe, **fields), parse_version(version))
    assert {f: plain(getattr(built, f)) for f in fields} == fields


@pytest.mark.parametrize("version", VERSIONS)
def test_records_say_what_each_release_has(recipes, version):
    module, release = recipes[version], parse_version(version)
    for record in TE_RECIPES.values():
        cls = getattr(module, record.cls, None)
        assert (cls is not None) == (release >= record.since), record.cls
        if cls is None:
            continue
        for field in record.fields:
            assert (field.name in field_names(cls)) == (release >= field.since), (record.cls, field.name)
            if release >= field.since:
                for path in field.also_sets:  # a class attribute holding a dataclass with that member
                    attribute, member = path.split(".")
                    assert member in {f.name for f in dataclasses.fields(getattr(cls, attribute))}, path
        for rejection in record.rejects:
            raises = rejection.since <= release and (rejection.until is None or release <= rejection.until)
            try:
                cls(**{rejection.field: te_value(module, rejection.field, rejection.value)})
            except (AssertionError, ValueError) as error:
                assert raises and te_message(error) == rejection.message, (record.cls, rejection.field, version)
            else:
                assert not raises, (record.cls, rejection.field, version)


@pytest.mark.parametrize("version", VERSIONS)
def test_what_te_raises_on_fp8dist_refuses_first_with_tes_reason(recipes, version):
    module = recipes[version]
    for record in TE_RECIPES.values():
        cls = getattr(module, record.cls, None)
        for field, values in (CANDIDATES.items() if cls else ()):
            for value in values:
                try:
                    cls(**{field: te_value(module, field, value)})
                except (AssertionError, ValueError) as error:
                    with pytest.raises(ConfigError) as refused:
                        te_spec(record.name, **{field: value})
                    assert te_message(error) in str(refused.value), (record.cls, field, value)


@pytest.mark.parametrize("version", [v for v in VERSIONS if parse_version(v) >= (2, 8, 0)])
@pytest.mark.parametrize("value", [True, False])
def test_power_2_scales_reach_what_te_linear_reads(wheels, version, value):
    """te.Linear sets its input, weight and grad-output quantizers from recipe.fp8_quant_*.power_2_scale, class
    attributes TE computes from NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES at import, not from the field: fp8dist
    sets them to the field's value, whatever the variable said (here: the opposite)."""
    linear = te_wheels.sources(wheels[version], "transformer_engine/pytorch/module/linear.py")
    read = set(re.findall(r"recipe\.(fp8_quant_\w+)\.power_2_scale", next(iter(linear.values()))))
    assert read == {"fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"}
    module = te_wheels.load_recipe_module(wheels[version], NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=str(int(not value)))
    assert {name: getattr(module.Float8CurrentScaling, name).power_2_scale for name in read} == \
        dict.fromkeys(read, not value)  # what te.Linear would read without fp8dist
    built = build_recipe(module, te_spec("current", use_power_2_scales=value), parse_version(version))
    assert built.use_power_2_scales is value
    assert {name: getattr(built, name).power_2_scale for name in read} == dict.fromkeys(read, value)


# --- what the audit and the backend read in TE's Python sources --------------------------------------------

# The quantized storages of the recipes fp8dist writes: file stem -> (its recipes, the format attribute)
STORAGES = {"float8_tensor": (("delayed", "current"), "_fp8_dtype"), "mxfp8_tensor": (("mxfp8",), "_fp8_dtype"),
            "float8_blockwise_tensor": (("block",), "_fp8_dtype"), "nvfp4_tensor": (("nvfp4",), "_fp4_dtype")}


def assigned_names(text: str) -> set[str]:
    """Private attributes a file sets on self or annotates in a class body."""
    return set(re.findall(r"self\.(_\w+)\s*(?::[^=\n]+)?=", text)) | set(re.findall(r"^\s+(_\w+)\s*:", text, re.M))


def init_args(text: str, owner: str) -> set[str]:
    """Parameter names of `owner` (a function, or a class's __init__) defined in `text`."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == owner:
            node = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        elif not (isinstance(node, ast.FunctionDef) and node.name == owner):
            continue
        return {a.arg for a in node.args.args + node.args.kwonlyargs}
    raise AssertionError(f"{owner} is not defined there")


@pytest.mark.parametrize("version", OLDEST_NEWEST)
def test_audit_reads_te_storages_by_names_the_release_has(wheels, version):
    files = te_wheels.sources(wheels[version], "transformer_engine/pytorch/tensor/")
    for stem, (recipes, format_attr) in STORAGES.items():
        path = next((p for p in files if p.endswith((f"/_internal/{stem}_base.py", f"/storage/{stem}_storage.py"))),
                    None)
        has = any(parse_version(version) >= TE_RECIPES[r].since for r in recipes)
        assert (path is not None) == has, stem
        if path is None:
            continue
        names = assigned_names(files[path])
        assert format_attr in TE_FORMAT_ATTRS and format_attr in names, (path, format_attr)
        assert names & set(TE_BUFFER_ATTRS), path
    text = "\n".join(te_wheels.sources(wheels[version], "transformer_engine/pytorch/").values())
    fp4 = parse_version(version) >= TE_RECIPES["nvfp4"].since
    for member in ("kFloat8E4M3", "kFloat8E5M2") + (("kFloat4E2M1",) if fp4 else ()):
        assert f"DType.{member}" in text and member in ENUM_NAMES, member  # the tex.DType names storage reads


@pytest.mark.parametrize("version", [v for v in VERSIONS if parse_version(v) >= (2, 8, 0)])
def test_nvfp4_packs_two_values_per_byte(wheels, version):
    """What storage() assumes for `_fp4_dtype` storages (tests/unit/backends/test_storage.py counts them so)."""
    text = te_wheels.sources(wheels[version], "transformer_engine/pytorch/tensor/nvfp4_tensor.py")
    assert "shape[-1] = shape[-1] // 2" in next(iter(text.values()))  # convert_shape_for_fp4: [M, K] -> [M, K/2]


@pytest.mark.parametrize("version", OLDEST_NEWEST)
def test_backend_calls_match_the_release(wheels, version):
    py = te_wheels.sources(wheels[version], "transformer_engine/pytorch/")
    linear = py["transformer_engine/pytorch/module/linear.py"]
    assert {"in_features", "out_features", "bias", "params_dtype", "device"} <= init_args(linear, "Linear")
    assert 'defer_init=device == "meta"' in linear  # why the backend passes the string "meta"
    assert re.search(r"\bgeneral_gemm\(", linear)  # the entry point the audit wraps under TE_MODULE_PREFIX
    assert TE_MODULE_PREFIX == "transformer_engine.pytorch.module."
    exports = py["transformer_engine/pytorch/__init__.py"]
    renamed = parse_version(version) >= TE_AUTOCAST_RENAMED
    assert bool(re.search(r"\bimport\b[^\n]*\bautocast\b|^\s+autocast,", exports, re.M)) == renamed
    where = py["transformer_engine/pytorch/quantization.py" if renamed else "transformer_engine/pytorch/fp8.py"]
    assert ({"enabled", "recipe", "amax_reduction_group"} if renamed else {"enabled", "fp8_recipe", "fp8_group"}) \
        <= init_args(where, "autocast" if renamed else "fp8_autocast")
    assert {"activation_recompute", "recompute_phase"} <= init_args(
        py["transformer_engine/pytorch/distributed.py"], "activation_recompute_forward")
