"""`fp8dist import` reads the mesh: Axolotl's tensor_parallel_size / context_parallel_size (and its deprecated
sequence_parallel_degree), Accelerate's parallelism_config, DeepSpeed's tensor_parallel (AutoTP) become
parallel.tensor_size / context_size next to the data-parallel sizes; what fp8dist cannot keep (DeepSpeed's Ulysses,
AutoTP partition rules, a TRL recipe's parallelism_config mapping) is refused naming the key; a size that is not an
integer >= 1 is refused naming its key; TRL's vLLM tensor_parallel_size never becomes the trainer's."""
import json

import pytest

from fp8dist.translate import to_deepspeed
from tests.unit.formats.importing import DS, FSDP2, import_document, refusals, spec_of


# -- Axolotl ---------------------------------------------------------------------------------------------------
def _axolotl(tmp_path, document: dict) -> str:
    return import_document(tmp_path, "axolotl", {"base_model": "x", "bf16": True, **document})


def test_axolotl_tensor_and_context_sizes_under_fsdp2(tmp_path):
    text = _axolotl(tmp_path, {**FSDP2, "dp_shard_size": 2, "tensor_parallel_size": 2, "context_parallel_size": 4})
    par = spec_of(text).parallel
    assert (par.sharding, par.tensor_size, par.context_size, par.sequence_parallel) == ("full", 2, 4, False)
    assert "# resolved: tensor_parallel_size -> parallel.tensor_size=2, sequence_parallel=false" in text
    assert "plan no SequenceParallel" in text and "ring-flash-attn" in text, text


def test_axolotl_hybrid_with_tensor_parallel(tmp_path):
    text = _axolotl(tmp_path, {**FSDP2, "dp_shard_size": 4, "dp_replicate_size": 2, "tensor_parallel_size": 2})
    par = spec_of(text).parallel
    assert (par.sharding, par.shard_size, par.tensor_size, par.context_size) == ("hybrid", 4, 2, 1)


def test_axolotl_deprecated_sequence_parallel_degree_is_context_parallel(tmp_path):
    text = _axolotl(tmp_path, {**FSDP2, "sequence_parallel_degree": 2})
    assert spec_of(text).parallel.context_size == 2
    assert "# resolved: sequence_parallel_degree -> parallel.context_size" in text
    text = _axolotl(tmp_path, {**FSDP2, "context_parallel_size": 4, "sequence_parallel_degree": 2})
    assert spec_of(text).parallel.context_size == 4
    assert "# not kept: sequence_parallel_degree: 2 - context_parallel_size decides" in text, text


def test_axolotl_tensor_parallel_under_ddp_says_how_the_gradients_differ(tmp_path):
    text = _axolotl(tmp_path, {"tensor_parallel_size": 2})
    par = spec_of(text).parallel
    assert (par.sharding, par.tensor_size) == ("replicate", 2)
    assert "would not average their gradients; fp8dist's do" in text, text


def test_axolotl_tensor_parallel_with_deepspeed_is_autotp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps(DS))
    text = _axolotl(tmp_path, {"deepspeed": "ds.json", "tensor_parallel_size": 2})
    spec = spec_of(text)
    assert (spec.engine, spec.parallel.tensor_size) == ("deepspeed", 2)
    assert to_deepspeed(spec, "0.19.8")["tensor_parallel"] == {"autotp_size": 2}
    assert "Axolotl writes tensor_parallel.autotp_size into the DeepSpeed JSON" in text
    # a JSON with its own tensor_parallel section decides: the same size imports, another is refused
    (tmp_path / "ds.json").write_text(json.dumps({**DS, "tensor_parallel": {"autotp_size": 2}}))
    assert spec_of(_axolotl(tmp_path, {"deepspeed": "ds.json", "tensor_parallel_size": 2})).parallel.tensor_size == 2
    (tmp_path / "ds.json").write_text(json.dumps({**DS, "tensor_parallel": {"autotp_size": 4}}))
    refused = refusals(tmp_path, "axolotl", {"base_model": "x", "bf16": True, "deepspeed": "ds.json",
                                             "tensor_parallel_size": 2})
    assert "autotp_size 4" in refused["tensor_parallel_size"], refused


@pytest.mark.parametrize("key", ["tensor_parallel_size", "context_parallel_size", "sequence_parallel_degree",
                                 "dp_shard_size"])
@pytest.mark.parametrize("value", [0, -2, "two", 1.5, True])
def test_axolotl_sizes_must_be_integers_of_one_or_more(tmp_path, key, value):
    refused = refusals(tmp_path, "axolotl", {"base_model": "x", "bf16": True, **FSDP2, key: value})
    assert refused == {key: "must be an integer >= 1"}, refused


# -- Accelerate ------------------------------------------------------------------------------------------------
def _accelerate(parallelism: dict, distributed_type: str = "FSDP") -> dict:
    document = {"distributed_type": distributed_type, "mixed_precision": "bf16",
                "parallelism_config": {f"parallelism_config_{k}": v for k, v in parallelism.items()}}
    if distributed_type == "FSDP":
        document["fsdp_config"] = {"fsdp_version": 2}
    if distributed_type == "DEEPSPEED":
        document["deepspeed_config"] = {"zero_stage": 2}
    return document


def test_accelerate_tp_cp_and_hybrid(tmp_path):
    text = import_document(tmp_path, "accelerate", _accelerate({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2,
                                                      "cp_size": 2, "cp_comm_strategy": "allgather"}))
    par = spec_of(text).parallel
    assert (par.sharding, par.shard_size, par.tensor_size, par.context_size, par.sequence_parallel) == \
        ("hybrid", 2, 2, 2, False)
    assert "cp_comm_strategy" not in text  # allgather: torch's default rotation, which fp8dist runs
    text = import_document(tmp_path, "accelerate", _accelerate({"dp_shard_size": 2, "cp_size": 2,
                                                      "cp_comm_strategy": "alltoall"}))
    assert spec_of(text).parallel.context_size == 2
    assert "# not kept: parallelism_config.parallelism_config_cp_comm_strategy: alltoall - fp8dist leaves torch's " \
           "default rotation, allgather" in text, text


def test_accelerate_settings_of_a_part_that_is_off_are_noted(tmp_path):
    text = import_document(tmp_path, "accelerate", _accelerate({"dp_shard_size": 2, "sp_backend": "deepspeed",
                                                      "cp_comm_strategy": "alltoall"}))
    assert "# not kept: parallelism_config.parallelism_config_sp_backend: deepspeed - acts only with " \
           "parallelism_config_sp_size above 1" in text
    assert "parallelism_config_cp_comm_strategy: alltoall - acts only with parallelism_config_cp_size" in text


@pytest.mark.parametrize("parallelism, distributed_type, key, fragment", [
    ({"dp_shard_size": 2, "sp_size": 2, "sp_backend": "deepspeed"}, "DEEPSPEED", "sp_size", "Ulysses"),
    ({"tp_size": 2}, "DEEPSPEED", "tp_size", "tensor_parallel.autotp_size"),
    ({"dp_replicate_size": 2, "tp_size": 2}, "FSDP", "dp_replicate_size", "pure data parallelism"),
    ({"dp_shard_size": 2, "tp_size": 2}, "MULTI_GPU", "dp_shard_size", "would not average their gradients"),
    ({"dp_shard_size": 2, "cp_size": 2, "cp_comm_strategy": "ring"}, "FSDP", "cp_comm_strategy", "allgather or alltoall"),
    ({"dp_shard_size": 2, "cp_size": 2, "cp_backend": "deepspeed"}, "FSDP", "cp_backend", "torch only"),
])
def test_accelerate_what_fp8dist_or_accelerate_cannot_run_is_refused(tmp_path, parallelism, distributed_type, key,
                                                                    fragment):
    refused = refusals(tmp_path, "accelerate", _accelerate(parallelism, distributed_type))
    assert fragment in refused[f"parallelism_config.parallelism_config_{key}"], refused


@pytest.mark.parametrize("key", ["tp_size", "cp_size", "dp_shard_size", "dp_replicate_size", "sp_size"])
@pytest.mark.parametrize("value", [0, -1, "x"])
def test_accelerate_sizes_must_be_integers_of_one_or_more(tmp_path, key, value):
    refused = refusals(tmp_path, "accelerate", _accelerate({key: value}))
    assert refused == {f"parallelism_config.parallelism_config_{key}": "must be an integer >= 1"}, refused


def test_accelerate_data_sizes_under_deepspeed_are_said(tmp_path):
    text = import_document(tmp_path, "accelerate", _accelerate({"dp_shard_size": 4}, "DEEPSPEED"))
    assert "# not kept: parallelism_config.parallelism_config_dp_shard_size x dp_replicate_size: 4 x 1 - DeepSpeed's " \
           "ZeRO stage decides the sharding" in text, text


# -- DeepSpeed -------------------------------------------------------------------------------------------------
def _deepspeed(tmp_path, section: dict) -> str:
    return import_document(tmp_path, "deepspeed", {**DS, **section}, "ds.json")


def test_deepspeed_autotp_size_is_tensor_size_and_round_trips(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    spec = spec_of(_deepspeed(tmp_path, {"tensor_parallel": {"autotp_size": 4, "tp_overlap_comm": True}}))
    assert spec.parallel.tensor_size == 4 and spec.deepspeed.extra == {"tensor_parallel": {"tp_overlap_comm": True}}
    back = to_deepspeed(spec, "0.19.8")
    assert back["tensor_parallel"] == {"autotp_size": 4, "tp_overlap_comm": True}
    assert DeepSpeedConfig(back).tensor_parallel_config.autotp_size == 4  # DeepSpeed's own parser reads it
    assert spec_of(import_document(tmp_path, "deepspeed", back, "back.json")).parallel.tensor_size == 4
    for off in (0, 1):  # DeepSpeed's default 0 and 1 split nothing
        assert spec_of(_deepspeed(tmp_path, {"tensor_parallel": {"autotp_size": off}})).parallel.tensor_size == 1


@pytest.mark.parametrize("section, key, fragment", [
    ({"autotp_size": -1}, "tensor_parallel.autotp_size", "must be an integer >= 1"),
    ({"autotp_size": "two"}, "tensor_parallel.autotp_size", "must be an integer >= 1"),
    ({"tp": {"tp_size": 2}}, "tensor_parallel.tp.tp_size", "AutoTP training splits by autotp_size"),
    ({"autotp_size": 2, "tensor_parallel": {"tp_size": 4}}, "tensor_parallel.tensor_parallel.tp_size",
     "next to another autotp_size DeepSpeed stops"),
    ({"autotp_size": 2, "partition_config": {"use_default_specs": False}}, "tensor_parallel.partition_config",
     "custom AutoTP partition rules"),
    ({"autotp_size": 2, "preset_model": "llama"}, "tensor_parallel.preset_model", "custom AutoTP partition rules"),
    ({"autotp_size": 2, "vocab_parallel_lm_head": True}, "tensor_parallel.vocab_parallel_lm_head", "vocabulary"),
    ({"autotp_size": 2, "autotp_sise": 2}, "tensor_parallel.autotp_sise", "refuses unknown keys"),
])
def test_deepspeed_tensor_parallel_keys_fp8dist_cannot_keep_are_refused(tmp_path, section, key, fragment):
    refused = refusals(tmp_path, "deepspeed", {**DS, "tensor_parallel": section}, "ds.json")
    assert fragment in refused[key], refused


def test_deepspeed_tp_size_equal_to_autotp_size_is_the_same_split(tmp_path):
    text = _deepspeed(tmp_path, {"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 2}, "dtype": "bfloat16"}})
    assert spec_of(text).parallel.tensor_size == 2
    assert "# not kept: tensor_parallel.tp.tp_size: 2 - the same degree as autotp_size" in text
    assert "# not kept: tensor_parallel.dtype: bfloat16 - not read by AutoTP training" in text, text


def test_deepspeed_ulysses_stays_refused_with_the_reason(tmp_path):
    refused = refusals(tmp_path, "deepspeed", {**DS, "sequence_parallel_size": 2}, "ds.json")
    assert "Ulysses" in refused["sequence_parallel_size"] and "does not wire" in refused["sequence_parallel_size"]


# -- TRL -------------------------------------------------------------------------------------------------------
def test_trl_tensor_parallel_size_is_vllms_and_never_the_trainers(tmp_path):
    text = import_document(tmp_path, "trl", {"model_name_or_path": "x", "tensor_parallel_size": 2,
                                   "vllm_tensor_parallel_size": 2})
    assert spec_of(text).parallel.tensor_size == 1
    assert "# not kept: tensor_parallel_size: 2 - the tensor parallel of vLLM's generation" in text
    assert "# not kept: vllm_tensor_parallel_size: 2 - the tensor parallel of vLLM's generation" in text, text


def test_trl_parallelism_config_mapping_is_refused_with_the_reason(tmp_path):
    refused = refusals(tmp_path, "trl", {"model_name_or_path": "x", "parallelism_config": {"tp_size": 2}})
    assert "ParallelismConfig object" in refused["parallelism_config"], refused
