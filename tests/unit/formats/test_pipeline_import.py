"""`fp8dist import` and pipeline parallel (issue 49, Imports): what each tool's file says about a pipeline, mapped or
refused naming the key, never dropped without a word.

- DeepSpeed's `pipeline` section (deepspeed 0.19.8 runtime/config.py get_pipeline_config) is read by its
  PipelineEngine alone, for a PipelineModule: `pipeline.stages` above 1 is refused (fp8dist's pipeline runs on FSDP2),
  the fix naming parallel.pipeline_size / pipeline_microbatches / train.micro_batch_size with the file's numbers; the
  other keys are noted; under Accelerate, Axolotl or TRL (no PipelineEngine) the whole section is noted.
- Accelerate 1.15: megatron_lm_config is read with distributed_type MEGATRON_LM only (refused); there its pipeline
  keys are refused naming fp8dist's; with another distributed_type it is noted. ParallelismConfig has no pp size.
- PEFT: megatron_config (a Megatron TransformerConfig, with its pipeline_model_parallel_size) is refused.
- Axolotl and TRL carry no pipeline-parallel key: one of that name is noted as unknown."""
import json

import pytest

from fp8dist.formats.axolotl.importer import KEYS as AXOLOTL_KEYS
from fp8dist.formats.common import ImportProblem
from fp8dist.formats.importing import import_file
from fp8dist.formats.trl.importer import KEYS as TRL_KEYS
from tests.unit.formats.importing import DS, FSDP2, import_document, refusals, spec_of, write_document


def _problem(tmp_path, kind: str, document: dict, name: str) -> ImportProblem:
    path = write_document(tmp_path, document, name)
    with pytest.raises(ImportProblem) as err:
        import_file(path, kind)
    assert all(issue.fix for issue in err.value.issues), err.value
    return err.value


# -- DeepSpeed -------------------------------------------------------------------------------------------------
def _deepspeed(tmp_path, pipeline, **top) -> str:
    return import_document(tmp_path, "deepspeed", {**DS, **top, "pipeline": pipeline}, "ds.json")


def test_deepspeed_pipeline_stages_are_refused_with_the_fp8dist_keys_of_the_same_pipeline(tmp_path):
    document = {**DS, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                "pipeline": {"stages": 4, "partition": "uniform", "activation_checkpoint_interval": 1}}
    problem = _problem(tmp_path, "deepspeed", document, "ds.json")
    (issue,) = problem.issues
    assert issue.path == "pipeline.stages" and issue.value == 4
    assert "PipelineModule" in issue.message and "FSDP2" in issue.message, issue.render()
    # DeepSpeed's PipelineEngine runs gradient_accumulation_steps micro-batches of the micro batch a step
    for fragment in ("engine: fsdp2", "parallel.pipeline_size: 4", "parallel.pipeline_microbatches: 4",
                     "train.micro_batch_size: 8", "gradient_accumulation_steps: 1"):
        assert fragment in issue.fix, issue.render()


def test_deepspeed_pipeline_stages_refused_with_the_files_other_problems(tmp_path):
    problem = _problem(tmp_path, "deepspeed", {**DS, "sequence_parallel_size": 2, "pipeline": {"stages": 2}},
                       "ds.json")
    assert {issue.path for issue in problem.issues} == {"pipeline.stages", "sequence_parallel_size"}


def test_deepspeed_pipeline_stages_refusal_without_a_known_batch_names_the_keys(tmp_path):
    problem = _problem(tmp_path, "deepspeed", {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                                               "pipeline": {"stages": "2"}}, "ds.json")
    (issue,) = [issue for issue in problem.issues if issue.path == "pipeline.stages"]
    assert "parallel.pipeline_size" in issue.fix and "parallel.pipeline_microbatches" in issue.fix, issue.render()


@pytest.mark.parametrize("stages", ["auto", 1])
def test_deepspeed_pipeline_stages_auto_or_one_is_noted(tmp_path, stages):
    text = _deepspeed(tmp_path, {"stages": stages})
    assert f"# not kept: pipeline.stages: {stages} - \"auto\" (DeepSpeed's default: the PipelineModule's " \
           "num_stages) or 1; read only by DeepSpeed's PipelineEngine" in text, text
    assert "engine fsdp2 with parallel.pipeline_size" in text
    spec = spec_of(text)
    assert (spec.engine, spec.parallel.pipeline_size) == ("deepspeed", 1)


@pytest.mark.parametrize("key, value, fragment", [
    ("partition", "type:transformer", "read from the config by no part of DeepSpeed 0.19.8"),
    ("seed_layers", True, "read from the config by no part of DeepSpeed 0.19.8"),
    ("activation_checkpoint_interval", 1, "recomputing changes no number"),
    ("use_reentrant", False, "the same numbers"),
    ("pipe_partitioned", False, "communication only"),
    ("grad_partitioned", False, "communication only"),
])
def test_deepspeed_pipeline_keys_without_a_pipeline_engine_are_noted(tmp_path, key, value, fragment):
    text = _deepspeed(tmp_path, {key: value})
    line = next(line for line in text.splitlines() if line.startswith(f"# not kept: pipeline.{key}:"))
    assert fragment in line and "PipelineModule" in line, line
    assert "pipeline" not in json.dumps(spec_of(text).deepspeed.extra or {})


def test_deepspeed_pipeline_unknown_and_empty(tmp_path):
    text = _deepspeed(tmp_path, {"shiny_schedule": "zb"})
    assert "# not kept: pipeline.shiny_schedule: zb - not in fp8dist's table of DeepSpeed keys" in text, text
    text = _deepspeed(tmp_path, {})
    assert "# not kept: pipeline: {} - read only by DeepSpeed's PipelineEngine" in text, text


def test_deepspeed_pipeline_in_another_tools_json_is_noted_whole(tmp_path, monkeypatch):
    """The HF Trainer (Axolotl, TRL) and Accelerate call forward / backward / step, which a PipelineEngine refuses:
    their runs build none, so a pipeline section in their DeepSpeed JSON changes nothing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps({**DS, "pipeline": {"stages": 4}}))
    for kind, document in (("axolotl", {"base_model": "x", "bf16": True, "deepspeed": "ds.json"}),
                           ("trl", {"model_name_or_path": "x", "bf16": True, "deepspeed": "ds.json"}),
                           ("accelerate", {"distributed_type": "DEEPSPEED",
                                           "deepspeed_config": {"deepspeed_config_file": "ds.json"}})):
        text = import_document(tmp_path, kind, document)
        assert "pipeline: {\"stages\": 4} - " in text and "never DeepSpeed's PipelineEngine" in text, (kind, text)
        assert spec_of(text).parallel.pipeline_size == 1


# -- Accelerate ------------------------------------------------------------------------------------------------
MEGATRON = {"megatron_lm_tp_degree": 2, "megatron_lm_pp_degree": 4, "megatron_lm_num_micro_batches": 8,
            "megatron_lm_decoder_last_pipeline_num_layers": 6, "megatron_lm_sequence_parallelism": True}


def test_accelerate_megatron_pipeline_keys_are_refused_naming_fp8dists(tmp_path):
    problem = _problem(tmp_path, "accelerate", {"distributed_type": "MEGATRON_LM", "mixed_precision": "bf16",
                                                "megatron_lm_config": MEGATRON}, "file.yaml")
    issues = {issue.path: issue for issue in problem.issues}
    assert set(issues) == {"distributed_type", "megatron_lm_config.megatron_lm_pp_degree",
                           "megatron_lm_config.megatron_lm_num_micro_batches",
                           "megatron_lm_config.megatron_lm_decoder_last_pipeline_num_layers"}, problem
    assert "parallel.pipeline_size" in issues["megatron_lm_config.megatron_lm_pp_degree"].fix
    assert "parallel.pipeline_microbatches" in issues["megatron_lm_config.megatron_lm_num_micro_batches"].fix
    assert "parallel.pipeline_split" in issues["megatron_lm_config.megatron_lm_decoder_last_pipeline_num_layers"].fix
    assert all("Megatron-Core's own model" in issues[key].message for key in issues if key != "distributed_type")


def test_accelerate_megatron_without_a_pipeline_is_refused_for_the_mode_alone(tmp_path):
    refused = refusals(tmp_path, "accelerate", {"distributed_type": "MEGATRON_LM", "mixed_precision": "fp7",
                                                "megatron_lm_config": {"megatron_lm_pp_degree": 1,
                                                                       "megatron_lm_num_micro_batches": 1}})
    assert set(refused) == {"distributed_type", "mixed_precision"}, refused  # every problem at once


def test_accelerate_megatron_config_under_another_mode_is_noted(tmp_path):
    text = import_document(tmp_path, "accelerate", {"distributed_type": "FSDP", "mixed_precision": "bf16",
                                                    "fsdp_config": {"fsdp_version": 2},
                                                    "megatron_lm_config": MEGATRON})
    assert "# not kept: megatron_lm_config: {" in text and "read only with distributed_type MEGATRON_LM" in text, text
    assert spec_of(text).parallel.pipeline_size == 1


def test_accelerate_parallelism_config_has_no_pipeline_size(tmp_path):
    text = import_document(tmp_path, "accelerate", {
        "distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": {"fsdp_version": 2},
        "parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_pp_size": 2}})
    assert "# not kept: parallelism_config.parallelism_config_pp_size: 2 - Accelerate 1.15's ParallelismConfig has " \
           "no pipeline axis" in text, text
    assert spec_of(text).parallel.pipeline_size == 1


# -- PEFT, Axolotl, TRL ----------------------------------------------------------------------------------------
def test_peft_megatron_config_with_a_pipeline_is_refused(tmp_path):
    refused = refusals(tmp_path, "peft", {"peft_type": "LORA", "target_modules": ["q_proj"],
                                          "megatron_config": {"pipeline_model_parallel_size": 2}}, "adapter.json")
    assert set(refused) == {"megatron_config"} and "pipeline_model_parallel_size" in refused["megatron_config"]


@pytest.mark.parametrize("kind, document, keys", [
    ("axolotl", {"base_model": "x", "bf16": True, **FSDP2}, AXOLOTL_KEYS),
    ("trl", {"model_name_or_path": "x", "bf16": True}, TRL_KEYS),
])
def test_axolotl_and_trl_have_no_pipeline_key_and_one_is_noted_as_unknown(tmp_path, kind, document, keys):
    assert not [key for key in keys.rules if "pipeline" in key or key.startswith("pp_")]
    text = import_document(tmp_path, kind, {**document, "pipeline_parallel_size": 2})
    assert "# not kept: pipeline_parallel_size: 2 - not in fp8dist's table of" in text, text
    assert spec_of(text).parallel.pipeline_size == 1


# -- the other way: translate --to accelerate ------------------------------------------------------------------
def test_translate_to_accelerate_refuses_a_pipeline_and_its_nearest_run_has_none():
    from fp8dist.config.load import load_config
    from fp8dist.formats.accelerate.translate import NotExpressible, accelerate_plan, nearest_accelerate_file

    spec = load_config({"engine": "fsdp2", "parallel": {"pipeline_size": 2, "pipeline_microbatches": 4},
                        "train": {"micro_batch_size": 8},
                        "precision": {"load_dtype": "bf16", "mixed_precision": "bf16", "master_weights": "fp32",
                                      "reduce_dtype": "bf16"}})
    for mode in ("file", "python", "trainer"):
        with pytest.raises(NotExpressible) as err:
            accelerate_plan(spec, mode)
        assert [issue.path for issue in err.value.issues] == ["parallel.pipeline_size"], err.value
        assert "ParallelismConfig" in err.value.issues[0].message
    _, _, nearest, differences = nearest_accelerate_file(spec)
    assert nearest.parallel.pipeline_size == 1
    assert [line.split(":")[0] for line in differences] == ["parallel.pipeline_size"], differences
