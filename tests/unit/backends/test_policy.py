"""The per-Linear precision policy (precision.fp8.overrides, keep_first_layers / keep_last_layers) as the module
filter decides it, the config rules that refuse what a backend's path cannot run, and precision.schedule's switch."""
import pytest

from fp8dist.backends.module_filter import LinearInfo, Policy, decide, linear_infos, policy_of
from fp8dist.config.load import load_config
from fp8dist.config.spec import ScheduleSpec, switch_step_of
from fp8dist.errors import ConfigError

AO = {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}}


def blocks(n=3):
    return [LinearInfo(f"model.layers.{i}.{part}", 64, 64, block=i, blocks=n)
            for i in range(n) for part in ("self_attn.q_proj", "mlp.up_proj")] + [LinearInfo("lm_head", 64, 256)]


def spec(**fp8):
    return load_config({"precision": {**AO, "fp8": {"torchao": {"emulate": True}, **fp8}}})


def test_first_matching_override_wins_and_kept_blocks_come_before_it():
    policy = Policy("tensorwise", ((("*.mlp.*",), "rowwise"), (("*up_proj", "*q_proj"), "mxfp8"),
                                   (("model.layers.1.*",), "none")), keep_first=1, dims={"mxfp8": 32})
    got = {d.fqn: (d.recipe, d.reason) for d in decide(blocks(), ["lm_head"], False, 16, policy=policy)}
    assert got["model.layers.0.mlp.up_proj"] == (None, "decoder block 0 of 3: precision.fp8.keep_first_layers=1")
    assert got["model.layers.1.mlp.up_proj"] == ("rowwise", "converted: precision.fp8.overrides[0] ('*.mlp.*')")
    assert got["model.layers.1.self_attn.q_proj"][0] == "mxfp8"  # entry 1 matches before entry 2's none
    assert got["model.layers.2.self_attn.q_proj"] == ("mxfp8", "converted: precision.fp8.overrides[1] ('*q_proj')")
    assert got["lm_head"][0] is None


def test_keep_last_layers_and_a_recipe_s_own_dims():
    infos = blocks(2) + [LinearInfo("model.layers.0.mlp.odd", 48, 64, block=0, blocks=2)]
    policy = Policy("tensorwise", ((("*odd",), "mxfp8"),), keep_last=1, dims={"mxfp8": 32, "tensorwise": 16})
    got = {d.fqn: d for d in decide(infos, [], False, 16, policy=policy)}
    assert "keep_last_layers=1" in got["model.layers.1.mlp.up_proj"].reason
    assert got["model.layers.0.mlp.odd"].reason == "dims 48x64 are not multiples of 32 (FP8 quantization rule)"
    assert got["model.layers.0.mlp.up_proj"].recipe == "tensorwise"


def test_the_blocks_of_a_real_model_are_found():
    from fp8dist.runtime.models import load_model

    infos = {i.fqn: i for i in linear_infos(load_model("tiny-llama", "bf16").model)}
    assert (infos["model.layers.1.mlp.up_proj"].block, infos["model.layers.1.mlp.up_proj"].blocks) == (1, 2)
    assert infos["lm_head"].block is None


def test_the_spec_s_policy_and_recipes():
    s = spec(overrides=[{"modules": ["*mlp*"], "recipe": "rowwise"}, {"modules": ["*o_proj"], "recipe": "none"}],
             keep_last_layers=2)
    assert s.fp8.recipes == ("tensorwise", "rowwise")
    assert policy_of(s.fp8).overrides == ((("*mlp*",), "rowwise"), (("*o_proj",), "none"))
    assert s.float8_all_gather  # auto: the tensorwise Linears gather in float8
    rowwise = spec(torchao={"emulate": True, "recipe_name": "rowwise"},
                   overrides=[{"modules": ["*mlp*"], "recipe": "tensorwise"}])
    assert rowwise.float8_all_gather


@pytest.mark.parametrize("fp8, key, says", [
    ({"overrides": [{"modules": ["*"], "recipe": "delayed"}]}, "precision.fp8.overrides[0].recipe",
     "a Transformer Engine recipe"),
    ({"torchao": {"emulate": True, "recipe_name": "rowwise", "enable_fsdp_float8_all_gather": True}},
     "precision.fp8.torchao.enable_fsdp_float8_all_gather", "needs tensorwise"),
    ({"overrides": [{"modules": ["*"], "recipe": "mxfp8"}], "torchao": {"emulate": True, "pad_inner_dim": True}},
     "precision.fp8.torchao.pad_inner_dim", "MXFP8Linear has no padding"),
])
def test_torchao_refusals_name_the_key(fp8, key, says):
    with pytest.raises(ConfigError) as info:
        spec(**fp8)
    assert key in str(info.value) and says in str(info.value)


@pytest.mark.parametrize("config, key, says", [
    ({"precision": {"preset": "bf16", "fp8": {"keep_last_layers": 1}}}, "precision.fp8.keep_last_layers",
     "no FP8 GEMM"),
    ({"precision": {"preset": "te", "fp8": {"overrides": [{"modules": ["*"], "recipe": "current"}]}}},
     "precision.fp8.overrides[0].recipe", "one recipe per run"),
    ({"engine": "deepspeed", "precision": {"preset": "msamp-o1", "fp8": {"overrides": [
        {"modules": ["*"], "recipe": "tensorwise"}]}}}, "precision.fp8.overrides[0].recipe", "use recipe none"),
    ({"precision": {**AO, "fp8": {"torchao": {"emulate": True},
                                  "overrides": [{"modules": ["*"], "recipe": "rowwise"}]}},
      "parallel": {"tensor_size": 2}}, "precision.fp8.overrides", "tensor parallel"),
    ({"precision": {**AO, "schedule": {"from_step": 2}}}, "precision.schedule", "all-gathered in float8"),
    ({"precision": {**AO, "fp8": {"torchao": {"emulate": True, "recipe_name": "mxfp8"}},
                    "schedule": {"from_fraction": 0.5}}, "train": {"seq_len": 32}},
     "precision.schedule.gemms", "forward alone"),
    ({"precision": {**AO, "fp8": {"torchao": {"emulate": True, "enable_fsdp_float8_all_gather": False}},
                    "schedule": {"from_step": 9}}}, "precision.schedule.from_step", "never act"),
    ({"precision": {"preset": "te", "schedule": {"from_step": 2}}}, "precision.schedule", "no switch of it"),
])
def test_refusals_name_the_key_and_why(config, key, says):
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert key in str(info.value) and says in str(info.value)


def test_switch_step():
    assert switch_step_of(ScheduleSpec(from_step=3), 6) == 3
    assert switch_step_of(ScheduleSpec(from_fraction=0.5), 6) == 4  # steps 1-3 in FP8
    assert switch_step_of(ScheduleSpec(), 6) is None


def test_a_resume_that_would_switch_back_to_fp8_is_refused(tmp_path):
    from fp8dist.engines.checkpoint.compatibility import _refuse_switching_back
    from fp8dist.errors import Fp8distError

    switched = load_config({"precision": {**AO, "fp8": {"torchao": {"emulate": True,
                                                                     "enable_fsdp_float8_all_gather": False}},
                                          "schedule": {"from_step": 3}}, "train": {"steps": 6}})
    manifest = {"step": 4, "precision_schedule": {"switch_step": 3, "gemms": "forward", "switched_steps": 2}}
    _refuse_switching_back(manifest, switched.to_dict(), tmp_path)  # the same schedule: resumes
    with pytest.raises(Fp8distError, match="would run the next steps in FP8 again"):
        _refuse_switching_back(manifest, spec().to_dict(), tmp_path)
