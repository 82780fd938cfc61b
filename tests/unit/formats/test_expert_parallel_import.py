"""`fp8dist import` reads expert parallel: Axolotl's expert_parallel_size and DeepSpeed's AutoEP section
(`expert_parallel`: enabled with autoep_size) become parallel.expert_size; what fp8dist cannot keep (a token capacity,
expert tensor parallel, load balancing, DeepEP) is refused naming the key; the AutoEP keys that describe the model go
to deepspeed.extra and back into the translated JSON, where DeepSpeed's own parser reads them; a section that is off,
or on at autoep_size 1, is noted. Accelerate 1.15's ParallelismConfig has no expert-parallel axis."""
import dataclasses
import json

import pytest

from fp8dist.translate import to_deepspeed, to_fsdp2
from tests.unit.formats.importing import DS, FSDP2, import_document, refusals, spec_of


# -- Axolotl ---------------------------------------------------------------------------------------------------
def _axolotl(tmp_path, document: dict) -> str:
    return import_document(tmp_path, "axolotl", {"base_model": "x", "bf16": True, **document})


def test_axolotl_expert_parallel_size_is_parallel_expert_size(tmp_path):
    text = _axolotl(tmp_path, {**FSDP2, "expert_parallel_size": 4, "dp_shard_size": 2})
    spec = spec_of(text)
    assert (spec.engine, spec.parallel.sharding, spec.parallel.expert_size) == ("fsdp2", "full", 4)
    assert "# resolved: expert_parallel_size -> parallel.expert_size=4" in text, text
    assert "dp_shard_size x tensor_parallel_size x context_parallel_size x expert_parallel_size ranks" in text, text
    # the FSDP2 plan names the experts' mesh
    assert "ep = 4" in to_fsdp2(spec).to_json()["sharding"]["mesh"]


@pytest.mark.parametrize("value", [1, "1", None])
def test_axolotl_expert_parallel_size_one_or_unset_splits_nothing(tmp_path, value):
    text = _axolotl(tmp_path, {**FSDP2, "expert_parallel_size": value})
    assert spec_of(text).parallel.expert_size == 1
    assert "expert_parallel_size" not in text, text


@pytest.mark.parametrize("value", [0, -2, "two", 1.5, True])
def test_axolotl_expert_parallel_size_must_be_an_integer_of_one_or_more(tmp_path, value):
    refused = refusals(tmp_path, "axolotl", {"base_model": "x", "bf16": True, **FSDP2, "expert_parallel_size": value})
    assert refused == {"expert_parallel_size": "must be an integer >= 1"}, refused


def test_axolotl_expert_parallel_under_ddp_is_refused_by_fp8dists_rule(tmp_path):
    """Without fsdp_config Axolotl runs DDP, which fp8dist runs as replicate sharding: its expert parallel borrows
    ranks from the shard axis only, so the import stops naming the fp8dist key and the fix."""
    refused = refusals(tmp_path, "axolotl", {"base_model": "x", "bf16": True, "expert_parallel_size": 2})
    assert "parallel.sharding=replicate" in refused["parallel.expert_size"], refused


def test_axolotl_deepep_settings_are_noted_and_a_token_capacity_refused(tmp_path):
    text = _axolotl(tmp_path, {**FSDP2, "expert_parallel_size": 2, "expert_parallel_backend": "deep_ep",
                               "expert_parallel_num_nvl_bytes": 268435456,
                               "expert_parallel_fallback_on_unsupported": False})
    for key in ("expert_parallel_backend", "expert_parallel_num_nvl_bytes", "expert_parallel_fallback_on_unsupported"):
        assert f"# not kept: {key}:" in text and "torch's all-to-all" in text, text
    refused = refusals(tmp_path, "axolotl", {"base_model": "x", "bf16": True, **FSDP2, "expert_parallel_size": 2,
                                             "expert_parallel_token_capacity": 1024})
    assert set(refused) == {"expert_parallel_token_capacity"}, refused
    assert "drops the lowest-weight" in refused["expert_parallel_token_capacity"]


def test_axolotl_expert_parallel_next_to_a_deepspeed_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps(DS))
    spec = spec_of(_axolotl(tmp_path, {"deepspeed": "ds.json", "expert_parallel_size": 2}))
    assert (spec.engine, spec.parallel.expert_size) == ("deepspeed", 2)
    assert to_deepspeed(spec, "0.19.8")["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    # a JSON with its own AutoEP section: the same size imports, another is refused
    (tmp_path / "ds.json").write_text(json.dumps({**DS, "expert_parallel": {"enabled": True, "autoep_size": 2}}))
    assert spec_of(_axolotl(tmp_path, {"deepspeed": "ds.json", "expert_parallel_size": 2})).parallel.expert_size == 2
    (tmp_path / "ds.json").write_text(json.dumps({**DS, "expert_parallel": {"enabled": True, "autoep_size": 4}}))
    refused = refusals(tmp_path, "axolotl", {"base_model": "x", "bf16": True, "deepspeed": "ds.json",
                                             "expert_parallel_size": 2})
    assert "autoep_size 4" in refused["expert_parallel_size"], refused


# -- DeepSpeed -------------------------------------------------------------------------------------------------
def _deepspeed(tmp_path, section: dict) -> str:
    return import_document(tmp_path, "deepspeed", {**DS, "expert_parallel": section}, "ds.json")


def test_deepspeed_autoep_is_parallel_expert_size_and_its_layer_keys_go_back_to_deepspeed(tmp_path):
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    section = {"enabled": True, "autoep_size": 4, "preset_model": "qwen3_moe", "router_pattern": "gate",
               "use_grouped_mm": True, "top_k": 2}
    spec = spec_of(_deepspeed(tmp_path, section))
    assert (spec.engine, spec.parallel.expert_size) == ("deepspeed", 4)
    assert spec.deepspeed.extra == {"expert_parallel": {"preset_model": "qwen3_moe", "router_pattern": "gate",
                                                        "use_grouped_mm": True, "top_k": 2}}
    translated = to_deepspeed(spec, "0.19.8")["expert_parallel"]
    assert translated == section
    parsed = parse_autoep_config(translated)  # DeepSpeed's own reading of the JSON fp8dist writes
    assert (parsed.enabled, parsed.autoep_size, parsed.preset_model, parsed.router_pattern, parsed.top_k) == \
        (True, 4, "qwen3_moe", "gate", 2)


@pytest.mark.parametrize("enabled", [True, False, "false", 0, 1])
def test_deepspeed_reads_enabled_as_deepspeed_does(tmp_path, enabled):
    """DeepSpeed's AutoEP config is a plain dict read (parse_autoep_config): a string "false" turns it on."""
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    section = {"enabled": enabled, "autoep_size": 2}
    text = _deepspeed(tmp_path, section)
    on = bool(parse_autoep_config(section).enabled)
    assert spec_of(text).parallel.expert_size == (2 if on else 1)
    assert ("# not kept: expert_parallel:" in text) is not on, text


def test_deepspeed_autoep_at_size_one_is_noted(tmp_path):
    text = _deepspeed(tmp_path, {"enabled": True, "autoep_size": 1, "preset_model": "mixtral"})
    spec = spec_of(text)
    assert spec.parallel.expert_size == 1 and "expert_parallel" not in to_deepspeed(spec, "0.19.8")
    assert "# not kept: expert_parallel:" in text and "autoep_size 1 splits no experts" in text, text


@pytest.mark.parametrize("key, value, fragment", [
    ("expert_tensor_parallel_size", 2, "splits each expert's weights"),
    ("load_balance_coeff", 0.001, "auxiliary-loss-free load balancing"),
    ("comm_backend", "deepep", "DeepEP"),
])
def test_deepspeed_autoep_keys_fp8dist_cannot_keep_are_refused(tmp_path, key, value, fragment):
    refused = refusals(tmp_path, "deepspeed", {**DS, "expert_parallel": {"enabled": True, "autoep_size": 2,
                                                                         key: value}}, "ds.json")
    assert set(refused) == {f"expert_parallel.{key}"} and fragment in refused[f"expert_parallel.{key}"], refused


@pytest.mark.parametrize("key, value", [("expert_tensor_parallel_size", 1), ("comm_backend", "comm"),
                                        ("comm_num_sm", 8), ("row_weighting_impl", "eager")])
def test_deepspeed_autoep_keys_without_effect_here_are_noted(tmp_path, key, value):
    text = _deepspeed(tmp_path, {"enabled": True, "autoep_size": 2, key: value})
    assert f"# not kept: expert_parallel.{key}:" in text, text
    assert "expert_parallel" not in spec_of(text).deepspeed.extra


def test_deepspeed_autoep_size_must_be_an_integer_of_one_or_more(tmp_path):
    refused = refusals(tmp_path, "deepspeed", {**DS, "expert_parallel": {"enabled": True, "autoep_size": 0}},
                       "ds.json")
    assert refused == {"expert_parallel.autoep_size": "must be an integer >= 1"}, refused


def test_an_accelerate_deepspeed_json_keeps_autoep(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps({**DS, "expert_parallel": {"enabled": True, "autoep_size": 2}}))
    text = import_document(tmp_path, "accelerate", {"distributed_type": "DEEPSPEED",
                                            "deepspeed_config": {"deepspeed_config_file": "ds.json"}})
    assert spec_of(text).parallel.expert_size == 2


def test_accelerate_parallelism_config_has_no_expert_axis(tmp_path):
    """Accelerate 1.15's ParallelismConfig has no ep size, so an Accelerate file sets no expert parallel: a key by
    that name is noted, never turned into parallel.expert_size."""
    from accelerate.parallelism_config import ParallelismConfig

    assert not [f.name for f in dataclasses.fields(ParallelismConfig) if "ep" in f.name.split("_")]
    text = import_document(tmp_path, "accelerate", {"distributed_type": "FSDP", "mixed_precision": "bf16",
                                            "fsdp_config": {"fsdp_version": 2},
                                            "parallelism_config": {"parallelism_config_dp_shard_size": 2,
                                                                   "parallelism_config_ep_size": 2}})
    assert spec_of(text).parallel.expert_size == 1
    assert "# not kept: parallelism_config.parallelism_config_ep_size: 2" in text, text
