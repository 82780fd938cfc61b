"""parallel.expert_size in the translations: DeepSpeed's AutoEP section (`expert_parallel.enabled` / `autoep_size`,
read back by DeepSpeed's own parser), refused for a DeepSpeed older than AutoEP (or than its ZeRO-3 support), never
set behind the config's back through deepspeed.extra; the note that the JSON names no preset_model; Accelerate,
which has no expert parallel, says so; FSDP2's plan names the experts' mesh."""
import pytest

from fp8dist.config.load import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.errors import ConfigError
from fp8dist.facts.deepspeed import DS_AUTOEP, DS_AUTOEP_ZERO3
from fp8dist.facts.versions import fmt
from fp8dist.formats.accelerate.translate import NotExpressible, accelerate_file, nearest_accelerate_file
from fp8dist.translate import to_fsdp2
from fp8dist.translate.deepspeed import extra_issues, generated_from, left_to_runtime, to_deepspeed
from tests.conftest import run_cli


def _spec(parallel: dict, **rest):
    return load_config({"engine": "deepspeed", "parallel": parallel, **rest})


def _before(version: tuple[int, int, int]) -> str:
    return fmt(version[:2] + (version[2] - 1,))


def _issues(spec, version: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        to_deepspeed(spec, version)
    return {issue.path: f"{issue.message} | {issue.fix}" for issue in err.value.issues}


def test_expert_size_is_autoep_which_deepspeed_parses_back():
    from deepspeed.runtime.config import DeepSpeedConfig

    config = to_deepspeed(_spec({"expert_size": 4}), "0.19.8")
    assert config["expert_parallel"] == {"enabled": True, "autoep_size": 4}
    parsed = DeepSpeedConfig(config).expert_parallel_config  # without a process group it assumes world size 1
    assert (parsed.enabled, parsed.autoep_size, parsed.preset_model) == (True, 4, None)
    assert "expert_parallel" not in to_deepspeed(_spec({}), "0.19.8")
    for key in ("expert_parallel.enabled", "expert_parallel.autoep_size"):
        assert generated_from(key).startswith("parallel.expert_size")


def test_a_deepspeed_without_autoep_is_refused_naming_the_release_that_has_it():
    issues = _issues(_spec({"expert_size": 2}), _before(DS_AUTOEP))
    assert set(issues) == {"parallel.expert_size"}
    assert f"has no AutoEP (added in {fmt(DS_AUTOEP)})" in issues["parallel.expert_size"]
    assert f"deepspeed>={fmt(DS_AUTOEP)}" in issues["parallel.expert_size"]
    assert to_deepspeed(_spec({"expert_size": 2, "sharding": "grad_op"}), fmt(DS_AUTOEP))["expert_parallel"]


def test_autoep_at_zero3_needs_the_release_that_runs_it():
    full = _spec({"expert_size": 2, "sharding": "full"})
    issues = _issues(full, _before(DS_AUTOEP_ZERO3))
    assert "not supported with ZeRO stage 3" in issues["parallel.expert_size"]
    assert f"deepspeed>={fmt(DS_AUTOEP_ZERO3)}" in issues["parallel.expert_size"]
    assert "parallel.sharding=grad_op" in issues["parallel.expert_size"]
    assert to_deepspeed(full, fmt(DS_AUTOEP_ZERO3))["zero_optimization"]["stage"] == 3


def test_extra_cannot_set_autoep_behind_the_config():
    # with parallel.expert_size > 1 the section is generated: its keys conflict, naming the fp8dist key
    conflicting = _spec({"expert_size": 2}, deepspeed={"extra": {"expert_parallel": {"autoep_size": 4}}})
    issues = _issues(conflicting, "0.19.8")
    assert "fp8dist generates from parallel.expert_size" in issues["deepspeed.extra.expert_parallel.autoep_size"]
    assert {issue.path for issue in extra_issues(conflicting)} == set(issues)  # validate refuses it too
    # without it, AutoEP turned on in extra swaps the MoE layers (even at autoep_size 1): refused
    for section in ({"enabled": True}, {"enabled": 1, "autoep_size": 1}, {"autoep_size": 2}):
        issues = _issues(_spec({}, deepspeed={"extra": {"expert_parallel": section}}), "0.19.8")
        assert issues and all("set parallel.expert_size instead" in why for why in issues.values()), issues
    off = to_deepspeed(_spec({}, deepspeed={"extra": {"expert_parallel": {"enabled": False}}}), "0.19.8")
    assert off["expert_parallel"] == {"enabled": False}


def test_extra_names_the_preset_that_the_config_cannot():
    spec = _spec({"expert_size": 2}, deepspeed={"extra": {"expert_parallel": {"preset_model": "mixtral"}}})
    assert to_deepspeed(spec, "0.19.8")["expert_parallel"] == {"enabled": True, "autoep_size": 2,
                                                               "preset_model": "mixtral"}
    assert extra_issues(spec) == []
    assert not [line for line in left_to_runtime(spec) if "preset_model" in line]
    notes = [line for line in left_to_runtime(_spec({"expert_size": 2})) if "preset_model" in line]
    assert len(notes) == 1 and "config.model_type" in notes[0], notes


def test_translate_says_the_missing_preset_and_strict_refuses_it(tmp_path):
    config = tmp_path / "ep.yaml"
    config.write_text("engine: deepspeed\nparallel:\n  expert_size: 2\n")
    said = run_cli("translate", config, "--to", "deepspeed", "--deepspeed-version", "0.19.8")
    assert said.returncode == 0, said.stderr
    assert "note: parallel.expert_size=2: the JSON's expert_parallel section names no preset_model" in said.stderr
    strict = run_cli("translate", config, "--to", "deepspeed", "--deepspeed-version", "0.19.8", "--strict")
    assert strict.returncode == 2 and strict.stdout == "", strict.stderr


def test_accelerate_has_no_expert_parallel():
    spec = load_config({"parallel": {"expert_size": 2}})
    with pytest.raises(NotExpressible) as err:
        accelerate_file(spec)
    assert "parallel.expert_size" in {issue.path for issue in err.value.issues}
    _, _, nearest, differences = nearest_accelerate_file(spec)
    assert nearest.parallel.expert_size == 1
    assert [line for line in differences if line.startswith("parallel.expert_size: 2 -> 1 (Accelerate has no expert "
                                                            "parallel")], differences


def test_accelerate_hands_autoep_to_deepspeed():
    _, plan = accelerate_file(_spec({"expert_size": 2}), "0.19.8")
    assert plan["deepspeed"]["config"]["expert_parallel"] == {"enabled": True, "autoep_size": 2}
    assert any(note.startswith("expert parallel: DeepSpeed AutoEP") for note in plan["notes"]), plan["notes"]


@pytest.mark.parametrize("expert_size", [2, 4])
def test_the_fsdp2_plan_names_the_experts_mesh_parallel_dims_builds(expert_size):
    spec = load_config({"parallel": {"expert_size": expert_size}})
    mesh = to_fsdp2(spec).to_json()["sharding"]["mesh"]
    assert mesh == f"1-D (shard over all ranks); experts 2-D (efsdp = world / {expert_size}, ep = {expert_size})"
    dims = ParallelDims.of(spec, 8)
    assert dims.expert_mesh_shape() == (("efsdp", "ep"), (8 // expert_size, expert_size))
    assert "experts" not in to_fsdp2(load_config({})).to_json()["sharding"]["mesh"]
