"""`fp8dist import`: Accelerate configs, Axolotl YAMLs and DeepSpeed JSONs become fp8dist configs that validate and
translate back to the same precision; Axolotl's FP8 + FSDP2 example and Accelerate's fsdp_config import; "auto" is resolved in a comment; hostile files exit 2."""
import json
import time

import pytest

from fp8dist.config.load import load_config
from fp8dist.formats.common import ImportProblem, Launcher
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
    plan = to_fsdp2(spec, AO_VERSION).to_json()
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


def test_axolotl_docs_fp8_fsdp2_example(tmp_path):
    text = import_file(FIXTURES / "axolotl_fp8_fsdp2.yaml")
    spec = imported_spec(text, tmp_path)
    assert spec.engine == "fsdp2" and spec.compile is True
    p = spec.precision
    # the file has no bf16 key: Axolotl's default `auto` turns it on (bf16 load), said in a comment
    assert (p.load_dtype, p.mixed_precision, p.master_weights, p.reduce_dtype) == ("bf16", "bf16", "fp32", "bf16")
    assert "# auto: bf16 -> true (left out, Axolotl's default `auto`" in text
    ao = spec.fp8.torchao
    assert spec.fp8.backend == "torchao" and ao.recipe_name == "tensorwise" and ao.enable_fsdp_float8_all_gather is True
    assert ao.force_recompute_fp8_weight_in_bwd is True and ao.pad_inner_dim is False
    assert (spec.fp8.modules.exclude, spec.fp8.modules.skip_first_last) == ((), True)
    assert spec.parallel.sharding == "full" and spec.parallel.cpu_ram_efficient_loading is True
    assert spec.fsdp2.wrap == ("LlamaDecoderLayer",)
    assert "not kept: fsdp_config.state_dict_type: FULL_STATE_DICT" in text
    assert "Accelerate 1.15 refuses torchao FP8 with FSDP2 and RAM-efficient loading" in text


def test_accelerate_fsdp_config_file(tmp_path):
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
    text = import_file(path, launcher=Launcher(mixed_precision="no"))  # the "auto" precision: test_launch_values.py
    for key in ("fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                "gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu",
                "zero_optimization.reduce_bucket_size"):
        assert f"# auto: {key} ->" in text, key
    assert "# not kept: scheduler:" in text and "# auto: train_batch_size -> micro batch x accumulation" in text
    assert "pass --per-device-train-batch-size N" in text and "pass --learning-rate LR" in text  # defaults said
    spec = imported_spec(text, tmp_path)
    assert spec.precision.mixed_precision == "none" and spec.precision.reduce_dtype == "fp32"  # launched with "no"
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
    # "auto" next to a file: accelerate launch --mixed_precision decides (without it: test_launch_values.py)
    spec = imported_spec(import_file(with_file, launcher=Launcher(mixed_precision="fp16")), tmp_path, "b.yaml")
    assert spec.precision.mixed_precision == "fp16" and spec.precision.loss_scaling.initial_scale_power == 16


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
    # Detection by evidence: an Accelerate file without distributed_type (the case that was read as Axolotl and lost
    # its FP8) is Accelerate by its mixed_precision and fp8_config, and refused for the missing required key.
    accelerate = tmp_path / "acc.yaml"
    accelerate.write_text("mixed_precision: fp8\nfp8_config: {backend: AO}\nfsdp_config: {fsdp_version: 2}\n")
    with pytest.raises(ImportProblem, match="distributed_type: missing: Accelerate refuses"):
        import_file(accelerate)
    # Two tools' keys: refused asking for --from; with --from the named tool reads it (and says what it cannot).
    both = tmp_path / "both.json"
    both.write_text('{"bf16": true, "zero_optimization": {"stage": 2}}')
    with pytest.raises(ImportProblem, match=r"Axolotl config: bf16; DeepSpeed config: zero_optimization"):
        import_file(both)
    with pytest.raises(ImportProblem, match="bf16: must be a mapping"):
        import_file(both, "deepspeed")


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
    "wrong_shape.json": (b'{"bf16": [1], "zero_optimization": {"stage": 2}}', "bf16: must be a mapping"),
    "two_tools.json": (b'{"bf16": true, "zero_optimization": {"stage": 2}}', "keys are those of more than one tool"),
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


def _import_json(tmp_path, document, kind=None):
    path = tmp_path / "in.json"
    path.write_text(json.dumps(document))
    return import_file(path, kind)


def test_what_used_to_import_as_another_run_is_refused_or_kept(tmp_path):
    """The cases that came out as another run with exit 0 (issue: three files in ten)."""
    # a DeepSpeed JSON with only train_batch_size: the micro batch depends on the world size
    with pytest.raises(ImportProblem, match="train_batch_size: without train_micro_batch_size_per_gpu and "
                                            "gradient_accumulation_steps DeepSpeed divides it by the world size"):
        _import_json(tmp_path, {"train_batch_size": 64, "zero_optimization": {"stage": 2}})
    # bf16 next to torch_autocast (DeepSpeed >= 0.18.3): the same compute dtype is the bf16 run; another one refused
    text = _import_json(tmp_path, {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                   "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    spec = imported_spec(text, tmp_path)
    assert (spec.precision.mixed_precision, spec.precision.master_weights) == ("bf16", "fp32")
    with pytest.raises(ImportProblem, match="torch_autocast.dtype: autocasts the forward of bf16 weights to fp16"):
        _import_json(tmp_path, {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                "torch_autocast": {"enabled": True}})
    # steps_per_print written as 1e5 (a float in JSON) is kept
    text = _import_json(tmp_path, {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1e5})
    assert imported_spec(text, tmp_path).deepspeed.steps_per_print == 100000
    # a misspelled wrap policy is refused, as Accelerate would stop on it
    path = tmp_path / "acc.yaml"
    path.write_text("distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_version: 2\n"
                    "  fsdp_auto_wrap_policy: TRANSFORMER_BASE_WRAP\n")
    with pytest.raises(ImportProblem, match="fsdp_config.fsdp_auto_wrap_policy: not an FSDP auto-wrap policy"):
        import_file(path)


def test_eight_bit_optimizers_mean_the_same_everywhere(tmp_path):
    """An 8-bit Adam is int8 optimizer states where fp8dist has them (FSDP2: torchao AdamW8bit) and refused where it
    has not (DeepSpeed): never silently fp32 states."""
    path = tmp_path / "axolotl.yaml"
    path.write_text("base_model: x\nbf16: true\noptimizer: adamw_bnb_8bit\n")
    assert imported_spec(import_file(path), tmp_path).optimizer.state_dtype == "int8"
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}))
    path.write_text("base_model: x\nbf16: true\noptimizer: adamw_bnb_8bit\ndeepspeed: ds.json\n")
    with pytest.raises(ImportProblem, match="optimizer: 8-bit Adam states change the optimizer's numerics"):
        import_file(path)


def test_keys_of_the_engine_not_selected_are_said_and_refused_under_strict(tmp_path):
    """engine: fsdp2 with deepspeed keys (the offload the user wrote never happens) and fsdp2 keys under DeepSpeed:
    one line each, with what says the same on this engine; --strict refuses them."""
    config = ROOT / "configs" / "fsdp2-bf16.yaml"
    said = run_cli("validate", config, "deepspeed.zero_stage=3", "deepspeed.offload_optimizer=cpu")
    assert said.returncode == 0 and said.stderr.count(": note: ") == 2, said.stderr
    assert "deepspeed.zero_stage=3 does nothing with engine fsdp2 (a deepspeed key); on fsdp2 it is " \
           "parallel.sharding: full" in said.stderr
    assert "deepspeed.offload_optimizer='cpu' does nothing with engine fsdp2" in said.stderr
    strict = run_cli("validate", config, "deepspeed.zero_stage=3", "--strict")
    assert strict.returncode == 2 and "refused (--strict)" in strict.stderr and strict.stdout == ""
    out = tmp_path / "ds.json"
    translated = run_cli("translate", ROOT / "configs" / "deepspeed-bf16-zero2.yaml", "fsdp2.wrap=[LlamaDecoderLayer]",
                         "--to", "deepspeed", "--strict", "-o", out)
    assert translated.returncode == 2 and not out.exists(), translated.stderr
    assert "fsdp2.wrap=['LlamaDecoderLayer'] does nothing with engine deepspeed" in translated.stderr
    assert run_cli("validate", config).stderr == ""  # a config without such keys says nothing


def test_translate_to_deepspeed_says_what_the_json_leaves_to_fp8dists_runtime(tmp_path):
    out = tmp_path / "ds.json"
    result = run_cli("translate", ROOT / "configs" / "deepspeed-torchao-float8.yaml", "parallel.activation_checkpointing=full",
                     "compile=false", "--to", "deepspeed", "-o", out)
    assert result.returncode == 0 and out.exists(), result.stderr
    lines = [line for line in result.stderr.splitlines() if ": note: " in line]
    assert len(lines) == 2, result.stderr
    assert "precision.fp8.backend=torchao: DeepSpeed has no FP8 setting" in lines[0]
    assert "parallel.activation_checkpointing=full: fp8dist's runtime wraps the blocks" in lines[1]
    assert all("deepspeed launch/train.py --fp8dist-config" in line for line in lines)
    assert "fp8" not in out.read_text().lower()  # the JSON itself has no FP8: hence the notes
    strict = run_cli("translate", ROOT / "configs" / "deepspeed-torchao-float8.yaml", "--to", "deepspeed", "--strict",
                     "-o", tmp_path / "strict.json")
    assert strict.returncode == 2 and not (tmp_path / "strict.json").exists() and "nothing written" in strict.stderr
    plain = run_cli("translate", ROOT / "configs" / "deepspeed-bf16-zero2.yaml", "--to", "deepspeed")
    assert plain.returncode == 0 and plain.stderr == ""


def test_translate_to_deepspeed_says_the_adapter_is_left_to_fp8dists_loading(tmp_path):
    result = run_cli("translate", ROOT / "configs" / "deepspeed-lora-zero3.yaml", "--to", "deepspeed")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if ": note: " in line]
    assert len(lines) == 1 and "adapter.kind=lora: DeepSpeed has no adapter setting" in lines[0], result.stderr
    assert "fp8dist.load_model(MODEL, spec)" in lines[0] and "lora" not in result.stdout.lower()
    strict = run_cli("translate", ROOT / "configs" / "deepspeed-lora-zero3.yaml", "--to", "deepspeed", "--strict",
                     "-o", tmp_path / "strict.json")
    assert strict.returncode == 2 and not (tmp_path / "strict.json").exists()
