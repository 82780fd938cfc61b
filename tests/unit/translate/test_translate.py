"""Translations: golden files, DeepSpeed's own parser accepts them, and the version rules."""
import json

import pytest

from fp8dist.config.load import load_config
from fp8dist.errors import ConfigError
from fp8dist.translate import to_deepspeed, to_fsdp2
from fp8dist.translate.fsdp2 import TorchaoFloat8Plan
from tests.conftest import ROOT
from tests.golden.regenerate import golden_cases, translate

CASES = list(golden_cases())


@pytest.mark.parametrize("config,spec,target,version", CASES, ids=[f"{c.stem}.{t}" for c, _, t, _ in CASES])
def test_golden(config, spec, target, version):
    golden = json.loads((ROOT / "tests" / "golden" / f"{config.stem}.{target}.json").read_text())
    assert translate(spec, target, version) == golden


DS_CASES = [c for c in CASES if c[2] == "deepspeed"]


@pytest.mark.parametrize("config,spec,target,version", DS_CASES, ids=[c.stem for c, *_ in DS_CASES])
def test_deepspeed_parser_accepts_translation(config, spec, target, version):
    from deepspeed.runtime.config import DeepSpeedConfig

    document = translate(spec, target, version)
    parsed = DeepSpeedConfig(document)  # without dist init it assumes world size 1
    assert parsed.zero_optimization_stage == spec.deepspeed.zero_stage
    assert parsed.gradient_clipping == spec.train.gradient_clipping
    mp = spec.precision.mixed_precision if spec.precision.master_weights != "none" else "none"
    assert parsed.bfloat16_config.enabled is (mp == "bf16")
    assert parsed.float16_config.enabled is (mp == "fp16")
    assert parsed.train_micro_batch_size_per_gpu == spec.train.micro_batch_size
    assert str(parsed.communication_data_type).endswith({"fp32": "float32", "bf16": "bfloat16"}[spec.precision.reduce_dtype])


def test_no_auto_anywhere_and_no_amp():
    for config, spec, target, version in DS_CASES:
        text = json.dumps(translate(spec, target, version))
        assert '"auto"' not in text and '"amp"' not in text


def test_torch_autocast_always_names_its_dtype():
    spec = load_config({"engine": "deepspeed", "precision": {"preset": "fp16-amp"}})
    ds = to_deepspeed(spec, "0.19.8")
    # No lower-precision-safe modules: gradients are reduced in fp32, the reduce_dtype (the audit sees it on the wire)
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "float16", "lower_precision_safe_modules": []}
    assert "fp16" not in ds and "bf16" not in ds
    from deepspeed.runtime.config import DeepSpeedConfig

    DeepSpeedConfig(ds)
    with pytest.raises(ConfigError, match="torch_autocast"):
        to_deepspeed(spec, "0.16.0")


def test_msamp_gated_on_deepspeed_version():
    spec = load_config(ROOT / "configs" / "msamp-o3.yaml")
    with pytest.raises(ConfigError) as info:
        to_deepspeed(spec, "0.19.8")
    text = str(info.value)
    assert "0.19.8" in text and "0.12.4-0.17.4" in text and "--deepspeed-version 0.13.1" in text
    assert to_deepspeed(spec, "0.13.1")["msamp"] == {"enabled": True, "opt_level": "O3", "use_te": False}
    assert to_deepspeed(spec, "0.9.2")["msamp"]["opt_level"] == "O3"


def test_bf16_master_and_states_version_gated():
    spec = load_config({"engine": "deepspeed", "precision": {"load_dtype": "bf16", "mixed_precision": "bf16",
                                                            "master_weights": "bf16"}})
    ds = to_deepspeed(spec, "0.19.8")
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    with pytest.raises(ConfigError, match="0.18.3"):
        to_deepspeed(spec, "0.17.0")


def test_extra_merges_last_and_conflicts_name_both():
    spec = load_config({"engine": "deepspeed", "deepspeed": {"extra": {"zero_optimization": {"overlap_comm": True},
                                                                       "wall_clock_breakdown": True}}})
    ds = to_deepspeed(spec, "0.19.8")
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True} and ds["wall_clock_breakdown"] is True
    for extra, fragment in [({"zero_optimization": {"stage": 3}}, "conflicts with `zero_optimization.stage` = 2"),
                            ({"fp16": {"enabled": True}}, "second precision mode"),
                            ({"gradient_clipping": "auto"}, "conflicts with `gradient_clipping`"),
                            ({"zero_optimization": {"reduce_bucket_size": "auto"}}, '"auto" is only filled'),
                            ({"amp": {"enabled": False}}, "removed in DeepSpeed 0.19.8")]:
        spec = load_config({"engine": "deepspeed", "deepspeed": {"extra": extra}})
        with pytest.raises(ConfigError, match="deepspeed.extra") as info:
            to_deepspeed(spec, "0.19.8")
        assert fragment in str(info.value)


def test_fsdp2_plan_policy_and_float8():
    plan = to_fsdp2(load_config(ROOT / "configs" / "fsdp2-torchao-float8.yaml"))
    assert plan.mixed_precision_policy.param_dtype == "bf16"
    assert plan.upcast_before_shard == "fp32"
    f8 = plan.float8
    assert isinstance(f8, TorchaoFloat8Plan)
    assert f8.float8_linear_config.enable_fsdp_float8_all_gather is True
    assert f8.precompute_float8_dynamic_scale_for_fsdp is True
    assert f8.force_recompute_fp8_weight_in_bwd.reason
    rowwise = to_fsdp2(load_config(ROOT / "configs" / "fsdp2-torchao-rowwise.yaml")).float8
    assert isinstance(rowwise, TorchaoFloat8Plan)
    assert rowwise.float8_linear_config.enable_fsdp_float8_all_gather is False
    assert rowwise.precompute_float8_dynamic_scale_for_fsdp is False
    pure = to_fsdp2(load_config(ROOT / "configs" / "fsdp2-bf16-pure.yaml"))
    assert pure.mixed_precision_policy.param_dtype is None and pure.upcast_before_shard is None
    assert pure.optimizer.state_dtype == "bf16"


def test_fsdp2_low_bit_optimizer_states():
    plan = to_fsdp2(load_config({"optimizer": {"state_dtype": "fp8"}}))
    assert plan.optimizer.cls == "torchao.optim.AdamWFp8"
    with pytest.raises(ConfigError, match="torch.optim keeps states"):
        load_config({"optimizer": {"state_dtype": "bf16"}})


def test_tensor_size_is_deepspeeds_autotp_size():
    from deepspeed.runtime.config import DeepSpeedConfig

    base = {"engine": "deepspeed", "precision": {"preset": "bf16"}}
    assert "tensor_parallel" not in to_deepspeed(load_config(base), "0.19.8")
    ds = to_deepspeed(load_config({**base, "parallel": {"tensor_size": 4}}), "0.19.8")
    assert ds["tensor_parallel"] == {"autotp_size": 4}
    assert DeepSpeedConfig(ds).tensor_parallel_config.autotp_size == 4


@pytest.mark.parametrize("tensor_size, extra, fragment", [
    (1, {"tensor_parallel": {"autotp_size": 2}}, "its key is parallel.tensor_size"),
    (2, {"tensor_parallel": {"autotp_size": 4}}, "which fp8dist generates from parallel.tensor_size"),
    (1, {"sequence_parallel_size": 2}, "Ulysses sequence parallel, which fp8dist does not wire"),
])
def test_extra_cannot_split_the_model_behind_the_config(tensor_size, extra, fragment):
    spec = load_config({"engine": "deepspeed", "parallel": {"tensor_size": tensor_size},
                        "deepspeed": {"extra": extra}})
    with pytest.raises(ConfigError) as info:
        to_deepspeed(spec, "0.19.8")
    assert fragment in str(info.value) and "deepspeed.extra." in str(info.value)


def test_extra_keeps_autotp_settings_that_split_nothing():
    spec = load_config({"engine": "deepspeed", "parallel": {"tensor_size": 2},
                        "deepspeed": {"extra": {"tensor_parallel": {"tp_overlap_comm": True}, "sequence_parallel_size": 1}}})
    ds = to_deepspeed(spec, "0.19.8")
    assert ds["tensor_parallel"] == {"autotp_size": 2, "tp_overlap_comm": True} and ds["sequence_parallel_size"] == 1
