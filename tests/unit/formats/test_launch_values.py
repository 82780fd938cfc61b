"""`fp8dist import`: what a DeepSpeed JSON leaves to the launch (its "auto") comes from the launch's own values,
`--mixed-precision` and the batch / learning-rate flags, resolved as Accelerate 1.15 resolves them (checked against its
own DeepSpeedPlugin.set_mixed_precision); without them an "auto" precision is refused (issue 35 item 2). Every problem
of a file is reported at once, and Axolotl's / the HF Trainer's paged AdamW maps to what it computes (item 9)."""
import copy
import json

import pytest
import yaml

from fp8dist.config.load import load_config
from fp8dist.formats.common import ImportProblem, Launcher
from fp8dist.formats.importing import import_file
from tests.conftest import run_cli
from tests.unit.formats.importing import refused_keys
from tests.unit.formats.test_importers import HF_ZERO2

# The HF docs' ds_config_zero3.json (transformers docs, deepspeed.md "ZeRO-3 example"), "auto" everywhere: the
# ZeRO-2 example's sections with its own zero_optimization.
HF_ZERO3 = {**HF_ZERO2, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "none", "pin_memory": True},
    "offload_param": {"device": "none", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
    "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}}


def _written(tmp_path, name, document):
    path = tmp_path / name
    path.write_text(json.dumps(document) if name.endswith(".json") else yaml.safe_dump(document))
    return path


def _spec(text):
    return load_config(yaml.safe_load(text))


# -- item 2: the launch's precision ----------------------------------------------------------------------------
def test_the_hf_zero3_json_is_refused_without_the_launch_precision_naming_the_flag(tmp_path):
    result = run_cli("import", _written(tmp_path, "ds_config_zero3.json", HF_ZERO3))
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert "bf16.enabled" in result.stderr and "--mixed-precision no|fp16|bf16" in result.stderr, result.stderr


@pytest.mark.parametrize("mixed, want", [("bf16", ("bf16", "bf16", "fp32", "bf16")),
                                         ("fp16", ("fp16", "fp32", "fp32", "fp16")),
                                         ("no", ("none", "fp32", "none", "fp32"))])
def test_with_the_launch_precision_the_hf_zero3_json_imports_as_launched(tmp_path, mixed, want):
    result = run_cli("import", _written(tmp_path, "ds_config_zero3.json", HF_ZERO3), "--mixed-precision", mixed)
    assert result.returncode == 0, result.stderr
    p = _spec(result.stdout).precision
    assert (p.mixed_precision, p.load_dtype, p.master_weights, p.reduce_dtype) == want
    assert f"# auto: bf16.enabled -> {str(mixed == 'bf16').lower()} (--mixed-precision {mixed}" in result.stdout


JSONS = {"auto both": {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}},
         "fp16 auto only": {"fp16": {"enabled": "auto"}},
         "no section": {},
         "bf16 written": {"bf16": {"enabled": True}},
         "fp16 written": {"fp16": {"enabled": True}}}


@pytest.mark.parametrize("mixed", ["no", "fp16", "bf16"])
@pytest.mark.parametrize("name", list(JSONS))
def test_the_launch_precision_is_resolved_as_accelerate_resolves_it(tmp_path, name, mixed):
    """Accelerate's own DeepSpeedPlugin.set_mixed_precision (which the HF Trainer's Accelerator runs too) decides what
    the import must give: a filled "auto", an added section, or a refusal."""
    from accelerate.utils import DeepSpeedPlugin

    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
          **JSONS[name]}
    plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(ds))
    path = _written(tmp_path, "ds.json", ds)
    try:
        plugin.set_mixed_precision(mixed)
    except ValueError:  # "`--mixed_precision` arg cannot be set to ... when ... is set in the DeepSpeed config file"
        assert refused_keys(lambda: import_file(path, launcher=Launcher(mixed_precision=mixed))) == {
            f"{'fp16' if mixed == 'bf16' else 'bf16'}.enabled"}
        return
    config = plugin.deepspeed_config
    want = "bf16" if config["bf16"]["enabled"] is True else "fp16" if config["fp16"]["enabled"] is True else "none"
    spec = _spec(import_file(path, launcher=Launcher(mixed_precision=mixed)))
    assert spec.precision.mixed_precision == want, (config, spec.precision)


def test_an_accelerate_config_naming_an_auto_json_takes_accelerate_launch_mixed_precision(tmp_path):
    _written(tmp_path, "ds.json", HF_ZERO3)
    plain = _written(tmp_path, "plain.yaml", {"distributed_type": "DEEPSPEED",
                                              "deepspeed_config": {"deepspeed_config_file": "ds.json"}})
    assert refused_keys(lambda: import_file(plain)) == {f"deepspeed_config_file ({tmp_path / 'ds.json'}): bf16.enabled"}
    assert _spec(import_file(plain, launcher=Launcher(mixed_precision="bf16"))).precision.mixed_precision == "bf16"
    # mixed_precision in the file next to a deepspeed_config_file: accelerate launch refuses it without its own flag
    beside = _written(tmp_path, "beside.yaml", {"distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
                                                "deepspeed_config": {"deepspeed_config_file": "ds.json"}})
    assert "mixed_precision" in refused_keys(lambda: import_file(beside))
    text = import_file(beside, launcher=Launcher(mixed_precision="fp16"))
    assert _spec(text).precision.mixed_precision == "fp16" and "# not kept: mixed_precision: bf16" in text


def test_accelerate_launch_flags_win_over_an_fsdp_config_file_and_batch_flags_are_the_scripts(tmp_path):
    path = _written(tmp_path, "fsdp.yaml", {"distributed_type": "FSDP", "mixed_precision": "bf16",
                                            "fsdp_config": {"fsdp_version": 2}})
    text = import_file(path, launcher=Launcher(mixed_precision="no", per_device_train_batch_size=4))
    spec = _spec(text)
    assert spec.precision.mixed_precision == "none" and spec.train.micro_batch_size == 4
    assert "# resolved: mixed_precision -> no (--mixed-precision, as accelerate launch --mixed_precision, wins" in text


def test_the_axolotl_file_is_the_launch_so_its_json_needs_no_flag_and_takes_none(tmp_path):
    _written(tmp_path, "zero3.json", HF_ZERO3)
    axolotl = _written(tmp_path, "axolotl.yaml", {"base_model": "x", "deepspeed": "zero3.json", "bf16": True,
                                                  "micro_batch_size": 4, "learning_rate": 2e-5})
    spec = _spec(import_file(axolotl))
    assert spec.precision.mixed_precision == "bf16" and spec.train.micro_batch_size == 4 and spec.optimizer.lr == 2e-5
    assert refused_keys(lambda: import_file(axolotl, launcher=Launcher(mixed_precision="fp16"))) == {"--mixed-precision"}


def test_batch_and_learning_rate_auto_take_the_launch_flags_and_a_contradiction_is_refused(tmp_path):
    path = _written(tmp_path, "ds.json", HF_ZERO3)
    launch = Launcher(mixed_precision="bf16", per_device_train_batch_size=4, gradient_accumulation_steps=8,
                      learning_rate=2e-5)
    text = import_file(path, launcher=launch)
    spec = _spec(text)
    assert (spec.train.micro_batch_size, spec.train.gradient_accumulation_steps, spec.optimizer.lr) == (4, 8, 2e-5)
    assert "# auto: train_micro_batch_size_per_gpu -> 4 (--per-device-train-batch-size 4)" in text
    written = _written(tmp_path, "written.json", {**HF_ZERO3, "train_micro_batch_size_per_gpu": 2})
    assert refused_keys(lambda: import_file(written, launcher=launch)) == {"train_micro_batch_size_per_gpu"}
    unsaid = import_file(path, launcher=Launcher(mixed_precision="bf16"))  # the batch and lr defaults are said
    assert "fp8dist's default 2 kept; pass --per-device-train-batch-size N" in unsaid
    assert "pass --learning-rate LR" in unsaid


def test_flags_with_bad_values_or_for_files_that_say_them_are_refused_naming_the_flag(tmp_path):
    path = _written(tmp_path, "ds.json", HF_ZERO3)
    assert refused_keys(lambda: import_file(path, launcher=Launcher(mixed_precision="bf16",
                                                                    per_device_train_batch_size=0))) == {
        "--per-device-train-batch-size"}
    result = run_cli("import", path, "--mixed-precision", "fp8")  # argparse: no|fp16|bf16 only
    assert result.returncode == 2 and "--mixed-precision" in result.stderr
    peft = _written(tmp_path, "adapter_config.json", {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]})
    assert refused_keys(lambda: import_file(peft, launcher=Launcher(learning_rate=1e-4))) == {"--learning-rate"}


# -- item 9: every problem at once, paged AdamW ------------------------------------------------------------------
@pytest.mark.parametrize("kind, document, named", [
    ("axolotl", {"base_model": "x", "deepspeed": "missing/zero3.json", "load_in_8bit": True, "adapter": "qlora"},
     {"deepspeed", "load_in_8bit", "adapter"}),
    ("trl", {"model_name_or_path": "x", "deepspeed": "missing/zero3.json", "load_in_4bit": True,
             "torch_dtype": "bfloat16"}, {"deepspeed", "load_in_4bit"}),
    ("accelerate", {"distributed_type": "DEEPSPEED", "mixed_precision": "fp7",
                    "deepspeed_config": {"deepspeed_config_file": "missing.json"}, "megatron_lm_config": {"x": 2}},
     {"mixed_precision", "deepspeed_config.deepspeed_config_file"}),
])
def test_a_missing_deepspeed_json_is_reported_with_the_files_other_problems(tmp_path, kind, document, named):
    path = _written(tmp_path, f"{kind}.yaml", document)
    assert named <= refused_keys(lambda: import_file(path, kind))


def test_paged_adamw_maps_to_the_adamw_it_computes_paging_being_memory_management(tmp_path):
    fsdp = {"base_model": "x", "fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}}
    text = import_file(_written(tmp_path, "a.yaml", {**fsdp, "optimizer": "paged_adamw_32bit"}))
    o = _spec(text).optimizer
    assert (o.name, o.state_dtype) == ("adamw", "fp32") and "memory management, not numerics" in text
    o = _spec(import_file(_written(tmp_path, "b.yaml", {**fsdp, "optimizer": "paged_adamw_8bit"}))).optimizer
    assert (o.name, o.state_dtype) == ("adamw", "int8")
    _written(tmp_path, "zero2.json", {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2},
                                      "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"})
    on_deepspeed = {"base_model": "x", "deepspeed": "zero2.json"}
    o = _spec(import_file(_written(tmp_path, "c.yaml", {**on_deepspeed, "optimizer": "paged_adamw_32bit"}))).optimizer
    assert (o.name, o.state_dtype) == ("adamw", "fp32")  # the fp32 masters DeepSpeed steps
    # 8-bit states under DeepSpeed, and fp32 states over bf16 weights (DDP without masters): refused, saying why
    assert refused_keys(lambda: import_file(_written(tmp_path, "d.yaml", {**on_deepspeed,
                                                                          "optimizer": "paged_adamw_8bit"}))) == {"optimizer"}
    with pytest.raises(ImportProblem, match="keeps fp32 Adam states"):
        import_file(_written(tmp_path, "e.yaml", {"base_model": "x", "optimizer": "paged_adamw_32bit"}))
