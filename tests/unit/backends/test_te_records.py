"""The Transformer Engine records (fp8dist.facts.transformer_engine.TE_RECIPES, one per recipe) against the schema and
the docs, and what reads them: the config rules, `translate --to fsdp2 --te-version`, `fp8dist env`. The records
themselves are checked against TE's real classes in test_te_recipe_contract.py."""
import json
import re

import pytest

from fp8dist.commands.env import backend_status
from fp8dist.config.load import load_config
from fp8dist.config.schema import schema
from fp8dist.errors import ConfigError
from fp8dist.facts import versions
from fp8dist.facts.transformer_engine import (TE_CHECKED, TE_FIELDS, TE_INERT_FIELDS, TE_NEWEST_KNOWN, TE_RECIPES,
                                              TE_REMOVED_FIELDS)
from fp8dist.facts.versions import fmt
from fp8dist.translate.fsdp2 import TEFloat8Plan, te_float8_plan, to_fsdp2
from tests.conftest import ROOT, run_cli

TE_SCHEMA = schema()["properties"]["precision"]["properties"]["fp8"]["properties"]["te"]["properties"]


def te_spec(**te):
    return load_config({"precision": {"preset": "te", "fp8": {"te": te}}})


def test_schema_recipe_enum_is_the_records():
    assert TE_SCHEMA["recipe"]["enum"] == list(TE_RECIPES)


def test_every_te_key_of_the_schema_is_handled_by_a_record_or_a_refusal():
    handled = {"recipe", "swap_layernorm", *TE_FIELDS, *TE_INERT_FIELDS, *TE_REMOVED_FIELDS}
    assert set(TE_SCHEMA) == handled


def test_every_record_fact_has_its_source():
    for record in TE_RECIPES.values():
        assert record.source and all(f.source for f in record.fields) and all(r.source for r in record.rejects)
        assert record.since <= TE_NEWEST_KNOWN and record.dim_multiple % 16 == 0
        assert all(r.field in TE_SCHEMA for r in record.rejects)


@pytest.mark.parametrize("recipe", list(TE_RECIPES))
def test_the_plan_and_the_module_filter_read_the_record(recipe):
    plan = te_float8_plan(te_spec(recipe=recipe), te_version="2.20.2")
    record = TE_RECIPES[recipe]
    assert plan.recipe_build.recipe_class == record.cls
    assert plan.module_filter.require_dims_multiple_of == record.dim_multiple


def test_field_of_another_recipe_names_the_recipes_that_take_it():
    with pytest.raises(ConfigError, match=r"(?s)use_power_2_scales: not a field of recipe 'mxfp8' .*use recipe current"):
        te_spec(recipe="mxfp8", use_power_2_scales=True)


def test_tokens_per_micro_batch_must_be_a_multiple_of_8():
    with pytest.raises(ConfigError, match=r"train\.seq_len: .*micro_batch_size \* train\.seq_len = 60\) to be a "
                                          r"multiple of 8.*\n    fix: set train\.seq_len to a multiple of 8 \(e\.g\. 64\)"):
        load_config({"precision": {"preset": "te"}, "train": {"micro_batch_size": 1, "seq_len": 60}})
    load_config({"precision": {"preset": "te"}, "train": {"micro_batch_size": 2, "seq_len": 60}})  # 120 tokens
    load_config({"train": {"micro_batch_size": 1, "seq_len": 60}})  # not a TE run: no such limit


def test_te_version_defaults_to_the_installed_te_else_the_newest_known(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda name: "2.19.0" if name == "transformer-engine" else None)
    plan = to_fsdp2(te_spec(recipe="mxfp8", enable_2d_quantization=True)).float8
    assert isinstance(plan, TEFloat8Plan) and (plan.te_version, plan.te_version_origin) == ("2.19.0", "installed")
    monkeypatch.setattr(versions, "installed_version", lambda name: "2.18.0" if name == "transformer-engine" else None)
    with pytest.raises(ConfigError, match="the first release that keeps it is 2.19.0"):
        to_fsdp2(te_spec(recipe="mxfp8", enable_2d_quantization=True))
    monkeypatch.setattr(versions, "installed_version", lambda name: None)
    plan = to_fsdp2(te_spec()).float8
    assert isinstance(plan, TEFloat8Plan)
    assert plan.te_version == fmt(TE_NEWEST_KNOWN) and "newest known" in plan.te_version_origin


@pytest.mark.parametrize("version,says", [("1.13.0", "fp8dist supports Transformer Engine 2.1.0-2.20.2"),
                                          ("two", "not a version")])
def test_te_version_outside_what_fp8dist_supports_is_refused(version, says):
    with pytest.raises(ConfigError, match=f"--te-version: {says}"):
        to_fsdp2(te_spec(), te_version=version)


def test_translate_cli_writes_exactly_what_the_release_keeps(tmp_path):
    config = tmp_path / "current.yaml"
    config.write_text("precision: {preset: te, fp8: {te: {recipe: current, use_power_2_scales: true}}}\n")
    refused = run_cli("translate", config, "--to", "fsdp2", "--te-version", "2.7.0")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and refused.stdout == ""
    assert re.search(r"precision\.fp8\.te\.use_power_2_scales: Float8CurrentScaling in Transformer Engine 2\.7\.0 has "
                     r"no field use_power_2_scales \(the first release that keeps it is 2\.8\.0\).*\n.*fix: remove "
                     r"it, or use Transformer Engine >= 2\.8\.0", refused.stderr), refused.stderr
    kept = run_cli("translate", config, "--to", "fsdp2", "--te-version", "2.8.0")
    assert kept.returncode == 0, kept.stderr
    float8 = json.loads(kept.stdout)["float8"]
    assert float8["recipe_fields"] == {"use_power_2_scales": True} and float8["te_version"] == "2.8.0"
    assert float8["recipe_attributes"]["fp8_quant_fwd_inp.power_2_scale"] is True
    wrong = run_cli("translate", config, "--to", "deepspeed", "--te-version", "2.8.0")
    assert wrong.returncode == 2 and "--te-version applies to --to fsdp2 only" in wrong.stderr


def test_env_says_when_the_installed_te_is_not_supported():
    out = backend_status({"torch": "2.13.0", "transformer_engine": "1.13.0"},
                         {"cuda_available": True, "name": "NVIDIA H100", "capability": [9, 0], "cuda": "12.8"})
    assert not out["transformer_engine"]["usable"] and "2.1.0-2.20.2" in out["transformer_engine"]["reason"]


def recipe_rows() -> list[str]:
    """docs/gpu_paths.md's recipe table, from the records."""
    rows = []
    for r in TE_RECIPES.values():
        fields = ", ".join(f"`{f.name}` {'refused: never read' if f.ignored else fmt(f.since)}"
                           for f in r.fields)
        raises = ", ".join(f"`{x.field}={json.dumps(x.value)}` {fmt(x.since)}"
                           f"{'-' + fmt(x.until) if x.until else '+'}" for x in r.rejects) or "-"
        top = f" to < {r.max_capability[0]}.{r.max_capability[1]}" if r.max_capability else ""
        rows.append(f"| `{r.name}` | {r.cls} | {fmt(r.since)} | {r.min_capability[0]}."
                    f"{r.min_capability[1]}{top} | {r.dim_multiple} | {fields} | {raises} |")
    return rows


def test_gpu_paths_page_shows_the_records():
    text = (ROOT / "docs" / "gpu_paths.md").read_text()
    for row in recipe_rows():
        assert row in text, row
    assert ", ".join(fmt(v) for v in TE_CHECKED) in text


def test_accelerate_import_drops_margin_for_mxfp8_with_the_reason(tmp_path):
    """margin for mxfp8 is refused by the config rules; an Accelerate file that writes it imports without it."""
    from fp8dist.formats.importing import import_file

    source = tmp_path / "accelerate.yaml"
    source.write_text("distributed_type: MULTI_GPU\nmixed_precision: fp8\nfp8_config: {backend: TE, "
                      "use_mxfp8_block_scaling: true, margin: 0, fp8_format: E4M3}\n")
    text = import_file(source)
    assert "# not kept: fp8_config.margin: 0 - MXFP8BlockScaling keeps margin but nothing reads it" in text
    assert "margin" not in text.split("\nengine:")[1]
