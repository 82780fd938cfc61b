"""`fp8dist import --from trl`: TRL / alignment-handbook recipes (TrlParser: ModelConfig + ScriptArguments + a
TrainingArguments subclass) import with the precision the HF Trainer really runs, their LoRA adapter, batch,
optimizer and layout, or are refused naming the key fp8dist cannot keep."""
import json
import subprocess
import sys

import pytest
import yaml

from fp8dist.config.load import load_config
from fp8dist.formats.common import ImportProblem
from fp8dist.formats.importing import detect, import_file
from tests.conftest import ROOT, run_cli
from tests.unit.formats.importing import refused_keys

LORA = {"use_peft": True, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _import(tmp_path, document: dict, kind: str | None = "trl", name: str = "recipe.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"model_name_or_path": "x", **document}))
    return import_file(path, kind)


def _spec(tmp_path, document: dict, **kwargs):
    return load_config(yaml.safe_load(_import(tmp_path, document, **kwargs)))


def _refused(tmp_path, document: dict) -> set[str]:
    return refused_keys(lambda: _import(tmp_path, document))


# -- precision: the main pain ------------------------------------------------------------------------------
def test_a_model_loaded_in_bf16_trains_bf16_weights_without_fp32_masters(tmp_path):
    """torch_dtype: bfloat16 + bf16: true under the plain Trainer: autocast over bf16 parameters, AdamW on them (bf16
    states), DDP reduces bf16 gradients: no fp32 master copy anywhere."""
    text = _import(tmp_path, {"torch_dtype": "bfloat16", "bf16": True})
    spec = load_config(yaml.safe_load(text))
    p = spec.precision
    assert (p.load_dtype, p.mixed_precision, p.master_weights, p.reduce_dtype) == ("bf16", "bf16", "none", "bf16")
    assert (p.weight_dtype, spec.optimizer_state_dtype) == ("bf16", "bf16")
    assert spec.engine == "fsdp2" and spec.parallel.sharding == "replicate"
    assert "no fp32 master copy, AdamW states in bf16" in text


@pytest.mark.parametrize("document, expected", [
    # dtype left out / null: TRL's ModelConfig default float32: fp32 weights and states under bf16 autocast
    ({"bf16": True}, ("fp32", "bf16", "none", "fp32")),
    ({"torch_dtype": None, "bf16": True}, ("fp32", "bf16", "none", "fp32")),
    ({"dtype": "float32", "bf16": True}, ("fp32", "bf16", "none", "fp32")),
    # bf16 left out: TRL's default, on unless fp16
    ({"dtype": "bfloat16"}, ("bf16", "bf16", "none", "bf16")),
    ({"dtype": "bfloat16", "bf16": False}, ("bf16", "none", "none", "bf16")),  # pure bf16 (the bf16-pure preset)
    ({"dtype": "float32", "fp16": True}, ("fp32", "fp16", "none", "fp32")),  # fp16 AMP
    ({"torch_dtype": "float32", "bf16": False}, ("fp32", "none", "none", "fp32")),
])
def test_load_dtype_and_mixed_precision(tmp_path, document, expected):
    p = _spec(tmp_path, document).precision
    assert (p.load_dtype, p.mixed_precision, p.master_weights, p.reduce_dtype) == expected


def test_dtype_auto_is_refused_it_is_the_checkpoints_own(tmp_path):
    assert _refused(tmp_path, {"torch_dtype": "auto"}) == {"torch_dtype"}
    assert _refused(tmp_path, {"dtype": "auto"}) == {"dtype"}


def test_fsdp_upcasts_to_fp32_masters(tmp_path):
    spec = _spec(tmp_path, {"torch_dtype": "bfloat16", "bf16": True, "fsdp": "full_shard auto_wrap",
                            "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}})
    p = spec.precision
    assert (p.load_dtype, p.mixed_precision, p.master_weights, p.reduce_dtype) == ("bf16", "bf16", "fp32", "bf16")
    assert spec.parallel.sharding == "full" and spec.fsdp2.wrap == ("LlamaDecoderLayer",)
    spec = _spec(tmp_path, {"dtype": "bfloat16", "fsdp": ["shard_grad_op", "offload"]})
    assert (spec.parallel.sharding, spec.parallel.offload) == ("grad_op", "params")


def test_deepspeed_path_is_read_beside_the_recipe(tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "zero3.json").write_text(json.dumps({
        "zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}))
    monkeypatch.chdir(ROOT)  # not the recipe's directory
    path = tmp_path / "cfg" / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "x", "torch_dtype": "bfloat16", "bf16": True,
                                    "deepspeed": "zero3.json", "per_device_train_batch_size": 2,
                                    "gradient_accumulation_steps": 8}))
    spec = load_config(yaml.safe_load(import_file(path)))
    assert spec.engine == "deepspeed" and spec.deepspeed.zero_stage == 3
    assert (spec.precision.mixed_precision, spec.precision.master_weights) == ("bf16", "fp32")
    assert (spec.train.micro_batch_size, spec.train.gradient_accumulation_steps) == (2, 8)


def test_tf32_is_refused_only_where_matmuls_are_fp32(tmp_path):
    assert _refused(tmp_path, {"torch_dtype": "float32", "bf16": False, "tf32": True}) == {"tf32"}
    assert "# not kept: tf32: true" in _import(tmp_path, {"torch_dtype": "float32", "bf16": True, "tf32": True})


def test_fp16_with_bf16_and_fp16_over_fp16_weights_are_refused(tmp_path):
    assert _refused(tmp_path, {"bf16": True, "fp16": True}) == {"fp16"}
    assert _refused(tmp_path, {"torch_dtype": "float16", "fp16": True}) == {"fp16"}


# -- each kept key ---------------------------------------------------------------------------------------
def test_each_kept_training_key_is_mapped(tmp_path):
    spec = _spec(tmp_path, {
        "torch_dtype": "bfloat16", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 16,
        "learning_rate": "2e-5", "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-6,
        "max_grad_norm": 0.2, "optim": "adamw_torch", "gradient_checkpointing": True, "torch_compile": True,
        "seed": 7, "max_steps": 100, "max_seq_length": 2048})
    t, o = spec.train, spec.optimizer
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.gradient_clipping, t.seed, t.steps, t.seq_len) == \
        (4, 16, 0.2, 7, 100, 2048)
    assert (o.name, o.lr, o.weight_decay, tuple(o.betas), o.eps) == ("adamw", 2e-5, 0.1, (0.9, 0.95), 1e-6)
    assert spec.parallel.activation_checkpointing == "full" and spec.compile is True


def test_left_out_keys_take_trl_and_trainingarguments_defaults(tmp_path):
    text = _import(tmp_path, {"dataset_name": "d"})
    spec = load_config(yaml.safe_load(text))
    assert (spec.train.micro_batch_size, spec.train.gradient_accumulation_steps, spec.train.gradient_clipping,
            spec.train.seed, spec.train.seq_len) == (8, 1, 1.0, 42, 1024)
    assert spec.parallel.activation_checkpointing == "full"  # TRL's gradient_checkpointing default
    assert "resolved: per_device_train_batch_size -> 8" in text and "resolved: bf16 -> true" in text
    assert "learning_rate" in text  # the trainer's default lr is said, not guessed


@pytest.mark.parametrize("optim, name, state", [("adamw_torch_fused", "adamw", "auto"), ("sgd", "sgd", "auto"),
                                                ("adamw_torch_8bit", "adamw", "int8"),
                                                ("adamw_bnb_8bit", "adamw", "int8")])
def test_optim(tmp_path, optim, name, state):
    o = _spec(tmp_path, {"torch_dtype": "bfloat16", "optim": optim}).optimizer
    assert (o.name, o.state_dtype) == (name, state)


@pytest.mark.parametrize("optim", ["rmsprop", "adafactor", "lion_8bit", "paged_lion_8bit"])
def test_an_optimizer_fp8dist_has_not_is_refused(tmp_path, optim):
    assert _refused(tmp_path, {"optim": optim}) == {"optim"}


def test_gradient_checkpointing_false_and_activation_checkpointing(tmp_path):
    assert _spec(tmp_path, {"gradient_checkpointing": False}).parallel.activation_checkpointing == "none"
    assert _spec(tmp_path, {"activation_checkpointing": True}).parallel.activation_checkpointing == "full"


# -- LoRA ------------------------------------------------------------------------------------------------
def test_lora_imports_into_the_adapter_with_trl_defaults_and_fp32_adapter_masters(tmp_path):
    text = _import(tmp_path, {"torch_dtype": "bfloat16", "bf16": True, **LORA})
    spec = load_config(yaml.safe_load(text))
    a, p = spec.adapter, spec.precision
    assert (a.kind, a.r, a.alpha, a.dropout, a.target_modules) == \
        ("lora", 16, 32, 0.05, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert (p.load_dtype, p.master_weights, p.reduce_dtype) == ("bf16", "fp32", "fp32")
    assert "resolved: lora_r -> 16" in text and "resolved: lora_alpha -> 32" in text


def test_lora_keys_and_all_linear(tmp_path):
    a = _spec(tmp_path, {"torch_dtype": "bfloat16", "use_peft": True, "lora_r": 64, "lora_alpha": 16,
                         "lora_dropout": 0.1, "lora_target_modules": "all-linear", "lora_task_type": "CAUSAL_LM"}).adapter
    assert (a.r, a.alpha, a.dropout, a.target_modules) == (64, 16, 0.1, "auto")
    assert _spec(tmp_path, {"use_peft": True, "lora_target_modules": ["all-linear"]}).adapter.target_modules == "auto"


def test_lora_modules_to_save_train_whole_modules_beside_the_adapters(tmp_path):
    """get_peft_config passes lora_modules_to_save to LoraConfig(modules_to_save=...): trained whole."""
    a = _spec(tmp_path, {"use_peft": True, "lora_target_modules": "all-linear",
                         "lora_modules_to_save": ["embed_tokens", "lm_head"]}).adapter
    assert (a.modules_to_save, a.target_modules) == (("embed_tokens", "lm_head"), "auto")
    text = _import(tmp_path, {"lora_modules_to_save": ["lm_head"]})  # without use_peft TRL reads none of it
    assert "# not kept: lora_modules_to_save: " in text


def test_use_dora_trains_dora_adapters(tmp_path):
    """get_peft_config passes use_dora to LoraConfig(use_dora=...): adapter.use_dora; without use_peft TRL reads none
    of it."""
    assert _spec(tmp_path, {"use_dora": True, **LORA}).adapter.use_dora
    assert "# not kept: use_dora: true - read only with `use_peft: true`" in _import(tmp_path, {"use_dora": True})


def test_lora_keys_without_use_peft_are_noted(tmp_path):
    text = _import(tmp_path, {"lora_r": 16, "lora_target_modules": ["q_proj", "v_proj"]})
    assert "# not kept: lora_r: 16 - read only with `use_peft: true`" in text
    assert load_config(yaml.safe_load(text)).adapter.kind == "none"


@pytest.mark.parametrize("document, keys", [
    ({"load_in_4bit": True}, {"load_in_4bit"}),  # a quantized base without adapters
    ({"load_in_8bit": True, **LORA}, {"load_in_8bit"}),
    ({"use_dora": "auto", **LORA}, {"use_dora"}),  # a switch: true or false
    ({"use_rslora": True, **LORA}, {"use_rslora"}),
    ({"lora_modules_to_save": "lm_head", **LORA}, {"lora_modules_to_save"}),  # ModelConfig: a list
    ({"lora_target_parameters": ["experts.down_proj"], **LORA}, {"lora_target_parameters"}),
    ({"lora_task_type": "SEQ_CLS", **LORA}, {"lora_task_type"}),
    ({"use_peft": True}, {"lora_target_modules"}),  # None: PEFT's per-architecture default, not guessed
    ({"use_peft": True, "lora_target_modules": ["q_proj"]}, {"lora_target_modules"}),  # one name: a regex in PEFT
    ({"use_peft": True, "lora_target_modules": "q_proj|v_proj"}, {"lora_target_modules"}),
    ({"torch_dtype": "bfloat16", "bf16": False, **LORA}, {"bf16"}),  # fp32 adapters without autocast
    ({"model_init_kwargs": {"dtype": "bfloat16"}}, {"model_init_kwargs"}),
    ({"auto_find_batch_size": True}, {"auto_find_batch_size"}),
    ({"accelerator_config": {"split_batches": True}}, {"accelerator_config"}),
])
def test_what_fp8dist_cannot_keep_is_refused_naming_the_key(tmp_path, document, keys):
    assert _refused(tmp_path, document) == keys


def test_adapter_switches_that_are_off_are_noted(tmp_path):
    text = _import(tmp_path, {"use_dora": False, "use_rslora": False, "load_in_4bit": False, **LORA})
    assert "# not kept: use_dora: false - off" in text and "# not kept: load_in_4bit: false - off" in text


# -- detection and the command line ----------------------------------------------------------------------
@pytest.mark.parametrize("document", [
    {"model_name_or_path": "x", "bf16": True, "learning_rate": 2e-5},  # shares bf16 / learning_rate with Axolotl
    {"per_device_train_batch_size": 4, "lora_r": 8, "deepspeed": "z.json"},
    {"torch_dtype": "bfloat16", "dataset_mixture": {"datasets": []}},
    {"use_peft": True, "num_train_epochs": 1},
])
def test_a_recipe_is_detected_by_keys_only_trl_writes(document):
    assert detect(document) == "trl"


def test_axolotl_keeps_its_shared_keys_without_trl_keys():
    assert detect({"bf16": True, "learning_rate": 1e-5, "lora_r": 8}) == "axolotl"
    assert detect({"base_model": "x", "bf16": True}) == "axolotl"


def test_a_file_with_axolotl_and_trl_keys_asks_for_from(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump({"base_model": "x", "per_device_train_batch_size": 2}))
    with pytest.raises(ImportProblem, match=r"--from accelerate\|axolotl\|deepspeed\|trl"):
        import_file(path)


def test_every_corpus_recipe_is_detected_as_trl():
    corpus = ROOT / "tests" / "data" / "corpus"
    sources = json.loads((corpus / "SOURCES.json").read_text())
    recipes = [relative for relative, source in sources.items() if source["tool"] == "trl"]
    assert len(recipes) >= 12
    for relative in recipes:
        assert detect(yaml.safe_load((corpus / relative).read_text())) == "trl", relative


def test_the_printed_output_round_trips_through_validate(tmp_path):
    recipe = ROOT / "tests/data/corpus/trl/alignment-handbook__recipes_zephyr-7b-beta_sft_config_lora.yaml"
    out = tmp_path / "imported.yaml"
    result = run_cli("import", str(recipe), "--from", "trl")
    assert result.returncode == 0, result.stderr
    out.write_text(result.stdout)
    validated = run_cli("validate", str(out))
    assert validated.returncode == 0, validated.stderr + validated.stdout
    spec = load_config(out)
    assert spec.adapter.kind == "lora" and spec.precision.load_dtype == "fp16"


def test_a_refused_recipe_exits_2_and_writes_nothing(tmp_path):
    recipe = ROOT / "tests/data/corpus/trl/alignment-handbook__recipes_zephyr-7b-beta_dpo_config_lora.yaml"
    out = tmp_path / "out.yaml"
    result = run_cli("import", str(recipe), "-o", str(out))
    assert result.returncode == 2 and "torch_dtype" in result.stderr and not out.exists()


def test_import_of_a_recipe_does_not_import_torch():
    recipe = ROOT / "tests/data/corpus/trl/alignment-handbook__recipes_zephyr-7b-beta_sft_config_full.yaml"
    code = ("import sys, fp8dist.cli; from fp8dist.formats.importing import import_file; "
            f"import_file({str(recipe)!r}); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.stdout.strip() == "False", result.stderr
