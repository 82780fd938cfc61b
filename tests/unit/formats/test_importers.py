"""`fp8dist import`: Accelerate configs, Axolotl YAMLs and DeepSpeed JSONs become fp8dist configs that validate and
translate back to the same precision; seeds 002 and 004 import; "auto" is resolved in a comment; hostile files exit 2."""
import json
import time

import pytest

from fp8dist.config.load import load_config
from fp8dist.formats.common import ImportProblem
from fp8dist.formats.importing import import_file
from fp8dist.translate import to_deepspeed, to_fsdp2
from fp8dist.formats.accelerate.translate import NotExpressible, accelerate_file, render
from tests.conftest import CONFIGS, ROOT, run_cli
from tests.unit.formats.test_accelerate import AO_VERSION, CASES, DS_VERSION, IDS

FIXTURES = ROOT / "tests" / "data" / "fixtures"
DS_PRECISION = ("bf16", "fp16", "torch_autocast", "data_types", "communication_data_type", "msamp")
ZERO = ("stage", "offload_optimizer", "offload_param", "zero_hpz_partition_size")
FSDP2_PARTS = ("mixed_precision_policy", "float8", "sharding", "offload_policy")


def ds_version(spec):
    return "0.13.1" if spec.fp8.backend == "msamp" else DS_VERSION


def deepspeed_precision(ds):
    out = {key: ds.get(key) for key in DS_PRECISION}
    out["zero"] = {key: ds["zero_optimization"].get(key) for key in ZERO}
    return out


def fsdp2_plan(spec):
    plan = to_fsdp2(spec, AO_VERSION)
    return {key: plan[key] for key in FSDP2_PARTS}


def imported_spec(text, tmp_path, name="imported.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return load_config(path)


def _expressible(case):
    try:
        accelerate_file(load_config(*case), DS_VERSION, AO_VERSION)
        return True
    except NotExpressible:  # refusals are tested in test_accelerate.py
        return False


ACCELERATE_CASES = [(case, name) for case, name in zip(CASES, IDS) if _expressible(case)]


@pytest.mark.parametrize("config,overrides", [c for c, _ in ACCELERATE_CASES], ids=[n for _, n in ACCELERATE_CASES])
def test_round_trip_through_accelerate(config, overrides, tmp_path):
    spec = load_config(config, overrides)
    document, plan = accelerate_file(spec, ds_version(spec), AO_VERSION)
    path = tmp_path / "accelerate.yaml"
    path.write_text(render(document, plan, spec, str(config)))
    back = imported_spec(import_file(path), tmp_path)
    assert back.engine == spec.engine
    if spec.engine == "deepspeed":
        assert deepspeed_precision(to_deepspeed(back, ds_version(spec))) == deepspeed_precision(
            to_deepspeed(spec, ds_version(spec)))
        assert back.parallel.cpu_ram_efficient_loading == spec.parallel.cpu_ram_efficient_loading
    else:
        assert fsdp2_plan(back) == fsdp2_plan(spec)
        assert back.compile == spec.compile and back.parallel.activation_checkpointing == spec.parallel.activation_checkpointing
        assert back.fsdp2.wrap == spec.fsdp2.wrap


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_round_trip_through_deepspeed(config, tmp_path):
    spec = load_config(config)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(to_deepspeed(spec, ds_version(spec))))
    text = import_file(path)
    assert text.startswith("# fp8dist config imported from")
    back = imported_spec(text, tmp_path)
    assert back.engine == "deepspeed"
    assert deepspeed_precision(to_deepspeed(back, ds_version(spec))) == deepspeed_precision(
        to_deepspeed(spec, ds_version(spec)))


def test_cli_import_output_validates(tmp_path):
    out = tmp_path / "imported.yaml"
    result = run_cli("import", FIXTURES / "accelerate_fsdp_config.yaml", "-o", out)
    assert result.returncode == 0 and result.stdout == "", result.stderr
    assert run_cli("validate", out).returncode == 0
    result = run_cli("import", FIXTURES / "axolotl_fp8_fsdp2.yaml")
    assert result.returncode == 0, result.stderr
    (tmp_path / "ax.yaml").write_text(result.stdout)
    assert run_cli("validate", tmp_path / "ax.yaml").returncode == 0


def test_seed_002_axolotl_fp8_fsdp2(tmp_path):
    text = import_file(FIXTURES / "axolotl_fp8_fsdp2.yaml")
    spec = imported_spec(text, tmp_path)
    assert spec.engine == "fsdp2" and spec.compile is True
    p = spec.precision
    assert (p.load_dtype, p.mixed_precision, p.master_weights, p.reduce_dtype) == ("fp32", "bf16", "fp32", "bf16")
    ao = spec.fp8.torchao
    assert spec.fp8.backend == "torchao" and ao.recipe_name == "tensorwise" and ao.enable_fsdp_float8_all_gather is True
    assert ao.force_recompute_fp8_weight_in_bwd is True and ao.pad_inner_dim is False
    assert (spec.fp8.modules.exclude, spec.fp8.modules.skip_first_last) == ((), True)
    assert spec.parallel.sharding == "full" and spec.parallel.cpu_ram_efficient_loading is True
    assert spec.fsdp2.wrap == ("LlamaDecoderLayer",)
    assert "not kept: fsdp_config.state_dict_type: FULL_STATE_DICT" in text
    assert "Accelerate 1.15 refuses torchao FP8 with FSDP2 and RAM-efficient loading" in text


def test_seed_004_accelerate_fsdp_config(tmp_path):
    text = import_file(FIXTURES / "accelerate_fsdp_config.yaml")
    spec = imported_spec(text, tmp_path)
    p = spec.precision
    assert spec.engine == "fsdp2" and spec.parallel.sharding == "full" and spec.parallel.cpu_ram_efficient_loading
    assert (p.mixed_precision, p.master_weights, p.reduce_dtype) == ("bf16", "fp32", "bf16")
    for key in ("fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_state_dict_type", "fsdp_sync_module_states",
                "fsdp_use_orig_params", "num_processes", "main_training_function"):
        assert f"not kept: {key}" in text or f"not kept: fsdp_config.{key}" in text, key
    assert "resolved: precision.load_dtype -> bf16" in text


HF_ZERO2 = {  # the HF docs' ds_config_zero2.json, "auto" everywhere
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_deepspeed_auto_values_are_resolved_in_comments(tmp_path):
    path = tmp_path / "ds_config_zero2.json"
    path.write_text(json.dumps(HF_ZERO2))
    text = import_file(path)
    for key in ("fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                "gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu",
                "zero_optimization.reduce_bucket_size"):
        assert f"# auto: {key} ->" in text, key
    assert "# not kept: scheduler:" in text and "# not kept: train_batch_size: auto" in text
    spec = imported_spec(text, tmp_path)
    assert spec.precision.mixed_precision == "none" and spec.precision.reduce_dtype == "fp32"  # Accelerate's default "no"
    assert spec.optimizer.lr == 0.001 and spec.train.gradient_clipping == 1.0
    assert spec.parallel.offload == "optimizer" and spec.deepspeed.zero_stage == 2
    ds = to_deepspeed(spec, DS_VERSION)
    assert ds["zero_optimization"]["overlap_comm"] is True and ds["zero_optimization"]["offload_optimizer"] == {
        "device": "cpu", "pin_memory": True}
    assert "reduce_bucket_size" not in ds["zero_optimization"] and '"auto"' not in json.dumps(ds)


def test_accelerate_deepspeed_auto_takes_mixed_precision_and_plugin_keys(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(HF_ZERO2))
    plugin = tmp_path / "plugin.yaml"
    plugin.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nmixed_precision: bf16\n"
                      "deepspeed_config:\n  zero_stage: 3\n  offload_param_device: cpu\n  offload_optimizer_device: cpu\n"
                      "  gradient_accumulation_steps: 4\n  zero3_save_16bit_model: true\n")
    text = import_file(plugin)
    spec = imported_spec(text, tmp_path)
    assert spec.precision.mixed_precision == "bf16" and spec.precision.reduce_dtype == "bf16"
    assert "resolved: deepspeed_config (as DeepSpeedPlugin builds it): communication_data_type -> bf16" in text
    assert spec.parallel.sharding == "full" and spec.parallel.offload == "params"
    assert spec.parallel.cpu_ram_efficient_loading is True and spec.train.gradient_accumulation_steps == 4
    with_file = tmp_path / "with_file.yaml"
    with_file.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
                         "  zero3_init_flag: false\n")
    spec = imported_spec(import_file(with_file), tmp_path, "b.yaml")
    assert spec.precision.mixed_precision == "none"  # "auto" with no mixed_precision: Accelerate's "no"


def test_accelerate_fp8_config_keys_that_accelerate_never_reads(tmp_path):
    path = tmp_path / "te.yaml"
    path.write_text("distributed_type: FSDP\nmixed_precision: fp8\nfsdp_config:\n  fsdp_version: 2\n"
                    "fp8_config:\n  backend: TE\n  amax_history_length: 16\n  amax_compute_algorithm: max\n"
                    "  fp8_format: E4M3\n  interval: 1\n  override_linear_precision: [false, false, false]\n")
    text = import_file(path)
    assert "ACCELERATE_FP8_AMAX_HISTORY_LENGTH, which no recipe reads" in text
    assert "not kept: fp8_config.interval" in text
    spec = imported_spec(text, tmp_path, "out.yaml")
    te = spec.fp8.te
    assert spec.fp8.backend == "te" and te.fp8_format == "E4M3" and te.amax_history_len is None
    assert te.amax_compute_algo is None and (spec.fp8.modules.exclude, spec.fp8.modules.skip_first_last) == ((), False)


def test_deepspeed_sections_autocast_msamp_and_optimizer(tmp_path):
    cases = [
        ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "communication_data_type": "fp32",
          "zero_optimization": {"stage": 1}}, ("bf16", "none", "fp32", "fp32")),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
          "zero_optimization": {"stage": 2}, "communication_data_type": "bf16"}, ("bf16", "bf16", "bf16", "bf16")),
        ({"fp16": {"enabled": True, "loss_scale": 128}, "msamp": {"enabled": True, "opt_level": "O2"},
          "zero_optimization": {"stage": 2}}, ("fp16", "fp32", "fp32", "fp16")),
    ]
    for i, (config, (mixed, master, load, reduce)) in enumerate(cases):
        path = tmp_path / f"ds{i}.json"
        path.write_text(json.dumps(config))
        spec = imported_spec(import_file(path), tmp_path, f"out{i}.yaml")
        p = spec.precision
        assert (p.mixed_precision, p.master_weights, p.load_dtype, p.reduce_dtype) == (mixed, master, load, reduce), i
    assert spec.fp8.backend == "msamp" and spec.fp8.msamp.opt_level == "O2" and spec.precision.loss_scaling.loss_scale == 128
    bad = tmp_path / "lamb.json"
    bad.write_text(json.dumps({"optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 1}}))
    with pytest.raises(ImportProblem, match="optimizer.type"):
        import_file(bad)


def test_accelerate_json_config_and_ddp(tmp_path):
    path = tmp_path / "default_config.json"
    path.write_text(json.dumps({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU",
                                "mixed_precision": "bf16", "num_processes": 2, "dynamo_config": {"dynamo_backend": "EAGER"}}))
    text = import_file(path)
    spec = imported_spec(text, tmp_path)
    p = spec.precision
    assert spec.parallel.sharding == "replicate" and spec.compile is True
    assert (p.load_dtype, p.mixed_precision, p.master_weights, p.reduce_dtype) == ("fp32", "bf16", "none", "fp32")
    assert "fp8dist compiles with inductor, not EAGER" in text


def test_kind_detection_and_from(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("bf16: true\nmicro_batch_size: 4\nbase_model: x\n")
    assert "Axolotl config" in import_file(path)
    ambiguous = tmp_path / "y.yaml"
    ambiguous.write_text("something: 1\n")
    with pytest.raises(ImportProblem, match="cannot tell which kind"):
        import_file(ambiguous)
    assert "DeepSpeed config" in import_file(ambiguous, "deepspeed")
    with pytest.raises(ImportProblem, match="already an fp8dist config"):
        import_file(ROOT / "configs" / "fp32.yaml")


BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"] +
                 [f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(9)])
HOSTILE = {
    "huge.yaml": (b"# " + b"x" * (3 << 20) + b"\n", "larger than"),
    "deep.yaml": (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nesting deeper than"),
    "deep.json": (b"[" * 5000 + b"]" * 5000, "nesting deeper than"),
    "deep_object.json": (b'{"a":' * 40 + b"1" + b"}" * 40, "nesting deeper than"),
    "tag.yaml": (b"distributed_type: !!python/object/apply:os.system ['touch PWNED']\n", "is not allowed"),
    "binary.json": (bytes(range(256)) * 4, "binary file"),
    "list.yaml": (b"- distributed_type\n- FSDP\n", "top level must be a mapping"),
    "scalar.json": (b"42", "top level must be a mapping"),
    "unknown.yaml": (b"foo: 1\nbar: 2\n", "cannot tell which kind"),
    "bomb.yaml": (BOMB.encode(), "aliases expand to more than"),
    "duplicate.json": (b'{"bf16": {"enabled": true}, "bf16": {}}', "duplicate key"),
    "missing_ds.yaml": (b"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: nowhere.json\n",
                        "names a file that does not exist"),
    "bad_json.json": (b'{"bf16": ', "not valid JSON"),
    "refused.yaml": (b"distributed_type: FSDP\nmixed_precision: fp8\nfp8_config:\n  backend: MSAMP\n",
                     "MS-AMP has no FSDP2 support"),
    "wrong_shape.yaml": (b"distributed_type: FSDP\nfsdp_config: [1, 2]\n", "fsdp_config: must be a mapping"),
    "wrong_shape.json": (b'{"bf16": true, "zero_optimization": {"stage": 2}}', "bf16: must be a mapping"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_inputs_exit_2_without_traceback(name, tmp_path):
    content, expected = HOSTILE[name]
    path = tmp_path / name
    path.write_bytes(content)
    out = tmp_path / "out.yaml"
    start = time.monotonic()
    result = run_cli("import", path, "-o", out, cwd=tmp_path)
    assert time.monotonic() - start < 30
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr and str(path.name) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not out.exists() and not (tmp_path / "PWNED").exists()
