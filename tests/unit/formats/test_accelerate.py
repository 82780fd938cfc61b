"""Accelerate: `translate --to accelerate` read back by Accelerate 1.15's own loader and launcher, the plugin
objects Accelerate builds from what the launcher exports, `accelerator_kwargs` building real plugins and kwargs
handlers, and `training_arguments_kwargs` building real transformers.TrainingArguments (one process, CPU)."""
import json
import os
import warnings

import pytest
import yaml

from fp8dist.config.load import load_config
from fp8dist.errors import Fp8distError
from fp8dist.translate import to_deepspeed, to_fsdp2
from fp8dist.translate.fsdp2 import torchao_float8_plan
from fp8dist.formats.accelerate.translate import NotExpressible, accelerate_file, accelerate_plan, render
from tests.conftest import CONFIGS, ROOT, run_cli

DS_VERSION, AO_VERSION = "0.19.8", "0.18.0"
# Example configs with the keys an Accelerate config file cannot take changed to ones it can (docs/accelerate.md).
EXPRESSIBLE = {
    "fsdp2-bf16": ["precision.reduce_dtype=bf16"],
    "fsdp2-grad-op": ["precision.reduce_dtype=bf16"],
    "fsdp2-offload": ["precision.reduce_dtype=bf16"],
    "fsdp2-torchao-float8": ["precision.load_dtype=fp32", "precision.reduce_dtype=bf16",
                             "precision.fp8.torchao.emulate=false",
                             "precision.fp8.modules.exclude=[]", "precision.fp8.modules.skip_first_last=true",
                             "compile=true", "fsdp2.wrap=[LlamaDecoderLayer]"],
    "te": ["precision.mixed_precision=bf16", "precision.master_weights=fp32", "precision.reduce_dtype=bf16",
           "precision.fp8.modules.exclude=[]"],
    "deepspeed-zero3-efficient": ["parallel.activation_checkpointing=none"],
}
CASES = [(c, []) for c in CONFIGS] + [(ROOT / "configs" / f"{name}.yaml", o) for name, o in EXPRESSIBLE.items()]
IDS = [c.stem + ("+" if o else "") for c, o in CASES]


@pytest.fixture
def clean_env(monkeypatch):
    """Accelerate's plugins read (and FullyShardedDataParallelPlugin writes) process-wide environment variables."""
    saved = dict(os.environ)
    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")) or key == "WORLD_SIZE":
            monkeypatch.delenv(key)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def _known_key(spec, path):
    node = spec.to_dict()
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _launch_env(path):
    """What `accelerate launch --config_file path --num_processes 2` exports to the ranks, without launching."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "--num_processes", "2", "train.py"])
    args, defaults, mixed_from_file = _validate_launch_command(args)
    if args.use_deepspeed:  # as launch_command does before deepspeed_launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_from_file else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def _dtype(name):
    import torch

    return None if name is None else {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@pytest.mark.parametrize("config,overrides", CASES, ids=IDS)
def test_accelerate_file_is_read_by_accelerate_or_refused_naming_the_key(config, overrides, tmp_path, clean_env):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    spec = load_config(config, overrides)
    try:
        document, plan = accelerate_file(spec, DS_VERSION, AO_VERSION)
    except NotExpressible as exc:
        assert not overrides, f"a variant meant to be expressible was refused: {exc}"
        assert exc.issues and all(_known_key(spec, i.path) and i.fix for i in exc.issues), str(exc)
        assert "cannot translate" in str(exc) and "accelerate 1.15" in str(exc)
        return
    path = tmp_path / "accelerate.yaml"
    path.write_text(render(document, plan, spec, str(config)))
    loaded = load_config_from_file(str(path))
    assert isinstance(loaded, ClusterConfig)
    assert loaded.distributed_type.value == ("FSDP" if spec.engine == "fsdp2" else "DEEPSPEED")

    env = _launch_env(path)
    for key, value in env.items():
        clean_env.setenv(key, value)
    if spec.engine == "fsdp2":
        _check_fsdp_env(spec, env)
    else:
        _check_deepspeed_env(spec, env)


def _check_fsdp_env(spec, env):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = FullyShardedDataParallelPlugin()  # built from the launcher's environment, as in each rank
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is to_fsdp2(spec).sharding.reshard_after_forward
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) is (spec.parallel.offload == "params")
    assert plugin.activation_checkpointing is (spec.parallel.activation_checkpointing == "full")
    assert plugin.cpu_ram_efficient_loading is spec.parallel.cpu_ram_efficient_loading
    if spec.fsdp2.wrap != "auto":
        assert plugin.transformer_cls_names_to_wrap == list(spec.fsdp2.wrap)
    mixed = env["ACCELERATE_MIXED_PRECISION"]
    policy = to_fsdp2(spec).mixed_precision_policy
    if mixed != "no":
        plugin.set_mixed_precision(mixed)  # what AcceleratorState does with it
        assert plugin.mixed_precision_policy.param_dtype == _dtype(policy.param_dtype)
        assert plugin.mixed_precision_policy.reduce_dtype == _dtype(policy.reduce_dtype)
    else:
        assert plugin.mixed_precision_policy is None and policy.param_dtype is None
        assert spec.precision.reduce_dtype == spec.precision.load_dtype
    if spec.compile:
        assert env["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR"
        assert env["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] == "True"
    if spec.fp8.backend == "torchao":
        from accelerate.utils import AORecipeKwargs
        from accelerate.utils.dataclasses import FP8BackendType

        assert FP8BackendType(env["ACCELERATE_FP8_BACKEND"]) == FP8BackendType.AO
        ao = AORecipeKwargs().config
        want = torchao_float8_plan(spec, AO_VERSION).float8_linear_config
        assert ao.enable_fsdp_float8_all_gather is want.enable_fsdp_float8_all_gather
        assert ao.pad_inner_dim is want.pad_inner_dim and ao.emulate is want.emulate
    elif spec.fp8.backend == "te":  # TERecipeKwargs needs Transformer Engine: the exported values are checked
        assert env["ACCELERATE_FP8_BACKEND"] == "TE"
        assert env["ACCELERATE_FP8_AMAX_COMPUTE_ALGO"] == spec.fp8.te.amax_compute_algo
        assert env["ACCELERATE_FP8_FORMAT"] == spec.fp8.te.fp8_format


def _check_deepspeed_env(spec, env):
    from accelerate.utils import DeepSpeedPlugin

    assert "ACCELERATE_MIXED_PRECISION" not in env or env["ACCELERATE_MIXED_PRECISION"] == "no"
    plugin = DeepSpeedPlugin()  # reads ACCELERATE_DEEPSPEED_CONFIG_FILE and refuses conflicting fields
    plugin.set_mixed_precision(env.get("ACCELERATE_MIXED_PRECISION", "no"))
    want, got = to_deepspeed(spec, DS_VERSION), dict(plugin.deepspeed_config)
    for key in ("bf16", "fp16", "torch_autocast", "communication_data_type", "zero_optimization", "data_types",
                "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        if key in want:
            assert got[key] == want[key], key
    assert plugin.zero3_init_flag is spec.parallel.cpu_ram_efficient_loading


def test_every_refusal_names_a_key_value_reason_and_fix():
    spec = load_config(ROOT / "configs" / "fsdp2-float8-efficient.yaml")
    with pytest.raises(NotExpressible) as info:
        accelerate_plan(spec, "file")
    text = str(info.value)
    for key in ("precision.reduce_dtype", "parallel.cpu_ram_efficient_loading", "precision.fp8.torchao.emulate"):
        assert f"- {key}:" in text
    assert "cpu_ram_efficient_loading is not supported" in text and "fix:" in text and "(got" in text


def test_deepspeed_fp8_master_and_loss_scaling_refusals():
    for overrides, key in ((["precision.preset=torchao-float8", "engine=deepspeed"], "precision.fp8.backend"),
                           (["precision.preset=fp16-amp"], "precision.loss_scaling"),
                           (["precision.mixed_precision=bf16", "precision.master_weights=none"], "precision.load_dtype"),
                           (["parallel.sharding=replicate", "precision.preset=bf16"], "precision.master_weights"),
                           (["parallel.sharding=replicate", "precision.reduce_dtype=fp32"], "precision.reduce_dtype"),
                           (["parallel.activation_checkpointing=selective"], "parallel.activation_checkpointing")):
        spec = load_config(ROOT / "configs" / "fsdp2-bf16-pure.yaml", overrides)
        with pytest.raises(NotExpressible) as info:
            accelerate_plan(spec, "file")
        assert key in [i.path for i in info.value.issues], (overrides, str(info.value))


def test_replicated_configs_are_accelerates_ddp(tmp_path):
    """Accelerate's most common file: replicated data parallelism (MULTI_GPU). fp8dist writes it where Accelerate's
    DDP gives the same dtypes (weights stepped as loaded, gradients all-reduced in their dtype), and Accelerate reads
    it back as DDP with that mixed precision; otherwise it names the difference (the test above)."""
    from accelerate.commands.config.config_args import load_config_from_file

    out = tmp_path / "ddp.yaml"
    result = run_cli("translate", "configs/fsdp2-bf16-pure.yaml", "parallel.sharding=replicate",
                     "precision.mixed_precision=bf16", "--to", "accelerate", "-o", out)
    assert result.returncode == 0, result.stderr
    loaded = load_config_from_file(str(out))
    assert loaded.distributed_type == "MULTI_GPU" and loaded.mixed_precision == "bf16", out.read_text()
    assert "the weights stay in the loading dtype (bf16)" in out.read_text()
    back = load_config(tmp_path / "back.yaml") if (tmp_path / "back.yaml").write_text(
        run_cli("import", out).stdout) else None
    assert back.parallel.sharding == "replicate" and back.precision.weight_dtype == "bf16"
    assert back.precision.compute_dtype == "bf16" and back.precision.reduce_dtype == "bf16"


def test_cli_translate_to_accelerate(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    result = run_cli("translate", "configs/deepspeed-bf16-zero2.yaml", "--to", "accelerate")
    assert result.returncode == 0, result.stderr
    document = yaml.safe_load(result.stdout)
    embedded = json.loads(document["deepspeed_config"]["deepspeed_config_file"])
    assert embedded == to_deepspeed(load_config(ROOT / "configs" / "deepspeed-bf16-zero2.yaml"))
    out = tmp_path / "acc.yaml"
    result = run_cli("translate", "configs/deepspeed-bf16-zero2.yaml", "--to", "accelerate", "-o", out)
    assert result.returncode == 0 and result.stdout == "", result.stderr
    beside = tmp_path / "acc.deepspeed.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acc.deepspeed.json", "acc.yaml"]
    loaded = load_config_from_file(str(out))
    assert loaded.deepspeed_config["deepspeed_config_file"] == str(beside.resolve())
    assert json.loads(beside.read_text())["bf16"] == {"enabled": True}
    as_json = tmp_path / "acc.json"
    assert run_cli("translate", "configs/fp32.yaml", "--to", "accelerate", "-o", as_json).returncode == 0
    assert load_config_from_file(str(as_json)).fsdp_config["fsdp_version"] == 2


def test_cli_translate_to_accelerate_refusal_writes_nothing(tmp_path):
    out = tmp_path / "acc.yaml"
    result = run_cli("translate", "configs/fsdp2-bf16.yaml", "--to", "accelerate", "--strict", "-o", out)
    assert result.returncode == 2 and "precision.reduce_dtype" in result.stderr and "fix:" in result.stderr
    assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []
    result = run_cli("translate", "configs/fsdp2-lora-float8.yaml", "--to", "accelerate", "-o", out)  # no nearest run
    assert result.returncode == 2 and "adapter.kind" in result.stderr and list(tmp_path.iterdir()) == []
    result = run_cli("translate", "configs/deepspeed-bf16-zero2.yaml", "--to", "accelerate", "-o", tmp_path / "no" / "x.yaml")
    assert result.returncode == 2 and "does not exist" in result.stderr and list(tmp_path.iterdir()) == []


# -- accelerator_kwargs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_accelerator_kwargs_builds_real_objects_or_refuses(config, clean_env):
    import torch.distributed as dist
    from accelerate.utils import AORecipeKwargs, DeepSpeedPlugin, FullyShardedDataParallelPlugin

    from fp8dist.integrations import accelerator_kwargs

    spec = load_config(config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kwargs = accelerator_kwargs(str(config), world_size=4, deepspeed_version=DS_VERSION,
                                        torchao_version=AO_VERSION)
    except NotExpressible as exc:
        assert all(_known_key(spec, i.path) and i.fix for i in exc.issues), str(exc)
        return
    assert not dist.is_initialized()
    if spec.engine == "fsdp2":
        plugin = kwargs["fsdp_plugin"]
        assert isinstance(plugin, FullyShardedDataParallelPlugin) and plugin.fsdp_version == 2
        policy = to_fsdp2(spec).mixed_precision_policy
        if plugin.mixed_precision_policy is not None:
            assert plugin.mixed_precision_policy.param_dtype == _dtype(policy.param_dtype)
            assert plugin.mixed_precision_policy.reduce_dtype == _dtype(policy.reduce_dtype)
        else:
            assert policy.param_dtype is None and spec.precision.reduce_dtype == spec.precision.load_dtype
        if spec.parallel.sharding == "hybrid":
            pc = kwargs["parallelism_config"]
            assert (pc.dp_replicate_size, pc.dp_shard_size) == (4 // spec.parallel.shard_size, spec.parallel.shard_size)
    else:
        plugin = kwargs["deepspeed_plugin"]
        assert isinstance(plugin, DeepSpeedPlugin)
        want = to_deepspeed(spec, DS_VERSION)
        assert {k: v for k, v in plugin.deepspeed_config.items() if k != "steps_per_print"} == \
            {k: v for k, v in want.items() if k != "steps_per_print"}
        assert kwargs["mixed_precision"] == ("fp8" if spec.fp8.enabled else "no")
    if spec.fp8.backend == "torchao":
        (handler,) = kwargs["kwargs_handlers"]
        assert isinstance(handler, AORecipeKwargs) and kwargs["mixed_precision"] == "fp8"
        want = torchao_float8_plan(spec, AO_VERSION).float8_linear_config
        assert handler.config.emulate is want.emulate
        assert handler.config.enable_fsdp_float8_all_gather is want.enable_fsdp_float8_all_gather
        if not spec.fp8.modules.skip_first_last:
            assert handler.module_filter_func is not None


def test_accelerator_kwargs_takes_a_path_a_dict_or_a_spec(clean_env):
    from fp8dist.integrations import accelerator_kwargs

    path = ROOT / "configs" / "fsdp2-bf16.yaml"
    spec = load_config(path)
    for config in (str(path), path, {"precision": {"preset": "bf16"}}, spec):
        plugin = accelerator_kwargs(config)["fsdp_plugin"]
        assert str(plugin.mixed_precision_policy.reduce_dtype) == "torch.float32"  # what a config file cannot say


def test_accelerator_kwargs_module_filter_and_hybrid_world_size(clean_env):
    import torch

    from fp8dist.integrations import accelerator_kwargs
    from fp8dist.formats.accelerate.kwargs import LinearFilter

    keep = LinearFilter(["lm_head", "*.gate"], 16)
    assert keep(torch.nn.Linear(32, 32), "layers.0.q_proj")
    assert not keep(torch.nn.Linear(32, 32), "lm_head") and not keep(torch.nn.Linear(32, 32), "mlp.gate")
    assert not keep(torch.nn.Linear(20, 32), "layers.0.up_proj") and LinearFilter([], None)(torch.nn.Linear(20, 32), "x")
    with pytest.raises(Fp8distError, match="WORLD_SIZE is not set"):
        accelerator_kwargs(ROOT / "configs" / "fsdp2-hybrid.yaml")
    with pytest.raises(Fp8distError, match="does not divide the 3 ranks"):
        accelerator_kwargs(ROOT / "configs" / "fsdp2-hybrid.yaml", world_size=3)
    clean_env.setenv("WORLD_SIZE", "8")
    pc = accelerator_kwargs(ROOT / "configs" / "fsdp2-hybrid.yaml")["parallelism_config"]
    assert (pc.dp_replicate_size, pc.dp_shard_size) == (4, 2)


# -- training_arguments_kwargs -------------------------------------------------------------------------------
TRAINER_CONFIGS = ["deepspeed-bf16-zero2", "deepspeed-bf16-zero3", "deepspeed-fp16", "deepspeed-offload", "fp32",
                   "fsdp2-bf16-pure"]


@pytest.fixture
def trainer_state(clean_env):
    yield
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("name", TRAINER_CONFIGS)
def test_training_arguments_kwargs_build_real_training_arguments(name, tmp_path, trainer_state):
    from transformers import TrainingArguments

    from fp8dist.integrations import training_arguments_kwargs

    config = ROOT / "configs" / f"{name}.yaml"
    spec = load_config(config)
    kwargs = training_arguments_kwargs(config, deepspeed_version=DS_VERSION)
    # On a CPU-only machine TrainingArguments refuses bf16 unless use_cpu is set (transformers 5 _validate_args).
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    assert args.per_device_train_batch_size == spec.train.micro_batch_size and args.learning_rate == spec.optimizer.lr
    if spec.engine == "deepspeed":
        got, want = args.hf_deepspeed_config.config, to_deepspeed(spec, DS_VERSION)
        for key in ("bf16", "fp16", "torch_autocast", "communication_data_type", "zero_optimization"):
            assert got.get(key) == want.get(key), key
        assert args.mixed_precision == {"bf16": "bf16", "fp16": "fp16"}.get(
            next((k for k in ("bf16", "fp16") if (want.get(k) or {}).get("enabled")), None), "no")
    else:
        assert args.fsdp and args.fsdp_plugin_args["fsdp_version"] == 2
        assert args.fsdp_plugin_args["reshard_after_forward"] is True and args.mixed_precision == "no"


def test_training_arguments_kwargs_for_bf16_fsdp2_and_refusals(tmp_path, trainer_state):
    from transformers import TrainingArguments

    from fp8dist.integrations import training_arguments_kwargs

    config = ROOT / "configs" / "fsdp2-offload.yaml"
    kwargs = training_arguments_kwargs(load_config(config, ["precision.reduce_dtype=bf16"]))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    assert args.mixed_precision == "bf16" and args.fsdp_plugin_args["cpu_offload"] is True
    assert args.fsdp_plugin_args["activation_checkpointing"] is True
    for name, key in (("fsdp2-bf16", "precision.reduce_dtype"), ("fsdp2-torchao-float8", "precision.fp8.backend"),
                      ("deepspeed-zero3-efficient", "parallel.activation_checkpointing")):
        with pytest.raises(NotExpressible) as info:
            training_arguments_kwargs(ROOT / "configs" / f"{name}.yaml")
        assert key in [i.path for i in info.value.issues]


def test_the_file_says_when_the_installed_accelerate_is_another_release(monkeypatch):
    from fp8dist.facts import versions
    from fp8dist.facts.accelerate import accelerate_matches
    assert accelerate_matches((1, 15, 2))[0] and not accelerate_matches((1, 14, 0))[0]
    spec = load_config(ROOT / "configs" / "fp32.yaml")
    document, plan = accelerate_file(spec)
    assert "is installed, the file follows" not in render(document, plan, spec, "x")
    monkeypatch.setattr(versions, "installed_version", lambda name: "1.14.0" if name == "accelerate" else None)
    assert "# note: Accelerate 1.14.0 is installed, the file follows 1.15.x" in render(document, plan, spec, "x")


# -- the mesh: tensor and context parallel ---------------------------------------------------------------------
TP_CP = {"engine": "fsdp2", "precision": {"preset": "bf16", "reduce_dtype": "bf16"},
         "parallel": {"tensor_size": 2, "context_size": 2, "sequence_parallel": False}}


def test_tensor_and_context_parallel_file_is_launched_by_accelerate_and_imports_back(tmp_path, clean_env):
    """The file carries tp and cp; the launch gives dp_shard_size (the header says how), and Accelerate's launcher
    exports the ParallelismConfig the ranks build."""
    from accelerate import ParallelismConfig
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from fp8dist.formats.importing import import_file

    spec = load_config(TP_CP)
    document, plan = accelerate_file(spec, DS_VERSION, AO_VERSION)
    assert document["parallelism_config"] == {"parallelism_config_tp_size": 2, "parallelism_config_cp_size": 2}
    path = tmp_path / "accelerate.yaml"
    path.write_text(render(document, plan, spec, "tp-cp.yaml"))
    text = path.read_text()
    assert "--parallelism_config_dp_shard_size N/4" in text and "tp_plan='auto'" in text
    assert "accelerator.maybe_context_parallel" in text
    args = launch_command_parser().parse_args(["--config_file", str(path), "--num_processes", "8",
                                               "--parallelism_config_dp_shard_size", "2", "train.py"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    for key, value in env.items():
        if key.startswith("PARALLELISM_CONFIG_"):
            clean_env.setenv(key, value)
    built = ParallelismConfig()  # what each rank builds from the launcher's environment
    assert (built.dp_replicate_size, built.dp_shard_size, built.tp_size, built.cp_size) == (1, 2, 2, 2)
    back = load_config(yaml.safe_load(import_file(path)))
    assert (back.parallel.tensor_size, back.parallel.context_size, back.parallel.sequence_parallel) == (2, 2, False)
    assert to_fsdp2(back).mixed_precision_policy == to_fsdp2(spec).mixed_precision_policy


@pytest.mark.parametrize("overrides, key, nearest", [
    (["parallel.sequence_parallel=auto"], "parallel.sequence_parallel", {"parallel.sequence_parallel": False}),
    (["precision.preset=torchao-float8", "precision.fp8.torchao.emulate=true"], "parallel.tensor_size", None),
    (["parallel.sharding=replicate", "precision.master_weights=none", "precision.reduce_dtype=bf16",
      "precision.load_dtype=bf16"], "parallel.tensor_size", {"parallel.sharding": "full"}),
    (["parallel.sharding=hybrid", "parallel.shard_size=2"], "parallel.sharding",
     {"parallel.sharding": "full", "parallel.shard_size": None}),
])
def test_what_accelerates_mesh_cannot_hold_is_refused_with_its_nearest(overrides, key, nearest):
    spec = load_config(TP_CP, overrides)
    with pytest.raises(NotExpressible) as info:
        accelerate_plan(spec, "file")
    (issue,) = [i for i in info.value.issues if i.path == key]
    assert issue.fix and getattr(issue, "nearest") == nearest, str(info.value)
    if key == "parallel.sharding":
        assert "parallelism_config_dp_replicate_size: WORLD/8" in issue.fix  # shard 2 x tp 2 x cp 2


def test_deepspeed_autotp_rides_in_the_deepspeed_config_accelerate_reads(tmp_path, clean_env):
    spec = load_config({"engine": "deepspeed", "precision": {"preset": "bf16"}, "parallel": {"tensor_size": 2}})
    document, plan = accelerate_file(spec, DS_VERSION)
    path = tmp_path / "accelerate.yaml"
    path.write_text(render(document, plan, spec, "ds-tp.yaml"))
    env = _launch_env(path)
    for key, value in env.items():
        clean_env.setenv(key, value)
    from accelerate.utils import DeepSpeedPlugin

    assert DeepSpeedPlugin().deepspeed_config["tensor_parallel"] == {"autotp_size": 2}
    assert "DeepSpeed AutoTP by the config's tensor_parallel.autotp_size (2)" in path.read_text()


def test_accelerator_and_trainer_kwargs_build_the_mesh_from_the_world_size(tmp_path, trainer_state):
    from transformers import TrainingArguments

    from fp8dist.integrations import accelerator_kwargs, training_arguments_kwargs

    pc = accelerator_kwargs(TP_CP, world_size=8)["parallelism_config"]
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size) == (1, 2, 2, 2)
    hybrid = load_config(TP_CP, ["parallel.sharding=hybrid", "parallel.shard_size=2", "parallel.context_size=1"])
    pc = accelerator_kwargs(hybrid, world_size=16)["parallelism_config"]
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size) == (4, 2, 2, 1)
    with pytest.raises(Fp8distError, match="parallel.tensor_size=2 x parallel.context_size=2 does not divide the 6"):
        accelerator_kwargs(TP_CP, world_size=6)
    with pytest.raises(Fp8distError, match="parallel.tensor_size: Accelerate's ParallelismConfig needs the world size"):
        accelerator_kwargs(TP_CP)
    kwargs = training_arguments_kwargs(TP_CP, world_size=8)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    assert (args.parallelism_config.tp_size, args.parallelism_config.cp_size) == (2, 2) and args.fsdp
