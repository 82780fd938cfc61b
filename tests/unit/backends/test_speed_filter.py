"""The speed-aware module filter (precision.fp8.min_speedup, hardware.gpu): one decision
(backends/module_filter.speed_rule + decide) that the torchao backend applies when it converts and that `estimate`'s
coverage follows; the audit's `speed` row (audit/speed_row.py) from the GEMMs a step ran."""
import pytest

import fp8dist.speed as speed
from fp8dist.backends.base import get_backend
from fp8dist.backends.module_filter import LinearInfo, decide, speed_rule
from fp8dist.config.load import load_config
from fp8dist.errors import ConfigError, UnsupportedEnvironment
from fp8dist.facts.hardware import GPUS, gpu_from_device_name, run_gpu
from tests.option_matrix import RUNS

LLAMA_8B = [LinearInfo(f"model.layers.0.self_attn.{n}", 4096, out) for n, out in
            (("q_proj", 4096), ("k_proj", 1024), ("v_proj", 1024), ("o_proj", 4096))] + [
    LinearInfo("model.layers.0.mlp.gate_proj", 4096, 14336), LinearInfo("model.layers.0.mlp.up_proj", 4096, 14336),
    LinearInfo("model.layers.0.mlp.down_proj", 14336, 4096)]


def _spec(seq_len=4096, min_speedup="auto", gpu="h100", recipe="rowwise", emulate=False, compile=True):
    return load_config({"compile": compile, "train": {"micro_batch_size": 1, "seq_len": seq_len},
                        "hardware": {"gpu": gpu},
                        "precision": {"fp8": {"backend": "torchao", "min_speedup": min_speedup,
                                              "torchao": {"recipe_name": recipe, "emulate": emulate}}}})


def _kept(spec, gpu="h100"):
    decisions = decide(LLAMA_8B, (), False, 16, speed_rule=speed_rule(spec, gpu))
    return {d.fqn.rsplit(".", 1)[-1]: d.reason for d in decisions if not d.convert}


def test_llama_8b_at_4096_tokens_on_h100_keeps_k_and_v_and_says_why():
    kept = _kept(_spec(4096))
    assert {"k_proj", "v_proj"} <= set(kept)
    at_16k = _kept(_spec(16384))
    assert {"k_proj", "v_proj"} <= set(at_16k) and not {"gate_proj", "up_proj", "down_proj"} & set(at_16k)
    reason = kept["k_proj"]
    predicted = speed.linear_speedup(4096, 4096, 1024, "rowwise", "h100")
    assert reason.startswith(f"k_proj 4096x1024 at M=4096: predicted {predicted:.2f}x on H100"), reason
    assert "precision.fp8.min_speedup=1" in reason


def test_more_tokens_per_micro_batch_convert_more():
    """The rule looks at M (torchao's _auto_filter_for_recipe does not): 16384 tokens keep fewer Linears."""
    assert len(_kept(_spec(16384))) < len(_kept(_spec(1024)))
    assert set(_kept(_spec(16384))) <= set(_kept(_spec(4096)))


def test_the_threshold_is_the_config_value_and_off_or_emulation_turn_the_auto_rule_off():
    assert speed_rule(_spec(min_speedup=1.3), "h100").min_speedup == 1.3
    assert speed_rule(_spec(min_speedup="off"), "h100") is None
    assert speed_rule(_spec(emulate=True, compile=False), "h100") is None  # auto: off when emulating
    assert speed_rule(_spec(), None) is None  # auto: no GPU known, no rule
    rule = speed_rule(_spec(min_speedup=0.5, emulate=True, compile=False), "h100")  # a number acts when emulating
    assert rule is not None and rule.min_speedup == 0.5 and not rule.compiled
    assert _kept(_spec(min_speedup=0.01)) == {}


def test_a_number_without_a_gpu_is_refused_naming_the_key_and_the_fix():
    with pytest.raises(UnsupportedEnvironment) as info:
        speed_rule(_spec(min_speedup=1.0, gpu="auto"), None)
    assert "precision.fp8.min_speedup=1.0" in str(info.value) and "hardware.gpu" in info.value.fix


def test_hardware_gpu_auto_reads_the_device_name():
    assert gpu_from_device_name("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_from_device_name("NVIDIA H100 PCIe") is None  # another card: not the SXM figures
    assert gpu_from_device_name("NVIDIA B200") == "b200" and gpu_from_device_name(None) is None
    assert run_gpu("auto", "NVIDIA L40S") == "l40s" and run_gpu("h200", None) == "h200"


def test_the_schema_offers_the_gpus_the_speed_model_knows():
    from fp8dist.config.schema import schema

    assert schema()["properties"]["hardware"]["properties"]["gpu"]["enum"] == ["auto", *GPUS]


def test_a_named_gpu_without_the_recipe_is_refused_at_load():
    with pytest.raises(ConfigError) as info:
        _spec(gpu="l40s", recipe="rowwise")
    assert "hardware.gpu" in str(info.value) and "l40s" in str(info.value) and "fix:" in str(info.value)


def test_the_torchao_backend_converts_what_the_rule_decides():
    """The option-matrix run fsdp2-torchao-min-speedup expects the split this in-process conversion makes, and the
    split is real: some Linears kept, some converted."""
    from fp8dist.runtime.models import _from_hf_config
    from fp8dist.config.models import tiny_config

    case = next(c for c in RUNS if c.id == "fsdp2-torchao-min-speedup")
    from tests.option_matrix import RUN_BASE, merge

    spec = load_config(merge(RUN_BASE, case.config))
    backend = get_backend(spec)
    backend.check_environment({"capability": None})
    backend.resolve_speed_rule({"name": None})  # hardware.gpu names the GPU: no device needed
    decisions = backend.convert_module(_from_hf_config(tiny_config("llama"), "fp32", 0))
    converted = [d for d in decisions if d.convert]
    kept = [d for d in decisions if not d.convert and "min_speedup" in d.reason]
    assert len(converted) == case.expect["float8_linears"]
    assert converted and kept and all("on L40S" in d.reason for d in kept)


def test_estimate_coverage_follows_the_same_decision():
    from fp8dist.estimate.memory import estimate

    spec = _spec(4096)
    with_rule = estimate("llama-3-8b", spec, 8, gpu="h100").fp8_coverage
    without = estimate("llama-3-8b", _spec(4096, min_speedup="off"), 8, gpu="h100").fp8_coverage
    kept = [left for left in with_rule.left_out if "min_speedup" in left.reason]
    assert kept and with_rule.converted < without.converted and with_rule.fp8_share < without.fp8_share
    # the same decision as the backend's, Linear by Linear: every layer keeps what one layer's shapes keep
    assert {left.fqn.rsplit(".", 1)[-1] for left in kept} == set(_kept(spec)), kept
    assert len(kept) == 32 * len(_kept(spec))
    # hardware.gpu stands in for --gpu
    assert estimate("llama-3-8b", spec, 8).fp8_coverage.converted == with_rule.converted


def test_estimate_refuses_a_number_with_no_gpu():
    from fp8dist.errors import Fp8distError
    from fp8dist.estimate.memory import estimate

    with pytest.raises(Fp8distError, match="--gpu"):
        estimate("llama-3-8b", _spec(min_speedup=1.0, gpu="auto"), 8)


def test_translate_says_the_rule():
    from fp8dist.translate.fsdp2 import module_filter_plan

    assert module_filter_plan(_spec()).speed_rule.to_json() == {
        "min_speedup": 1.0, "gpu": "h100", "recipe": "rowwise", "tokens_per_micro_batch": 4096, "compiled": True}
    assert module_filter_plan(_spec(min_speedup="off")).speed_rule is None
    assert module_filter_plan(_spec(gpu="auto")).speed_rule.min_speedup == "auto"  # resolved on the device


def test_an_unquoted_yaml_off_is_off(tmp_path):
    """YAML 1.1 reads `min_speedup: off` as false: accepted, and it means off."""
    path = tmp_path / "c.yaml"
    path.write_text("precision:\n  fp8:\n    backend: torchao\n    min_speedup: off\nhardware:\n  gpu: h100\n")
    spec = load_config(path)
    assert spec.fp8.min_speedup is False and speed_rule(spec, "h100") is None
    with pytest.raises(ConfigError, match="min_speedup"):
        _spec(min_speedup=0)  # a threshold must be above 0
