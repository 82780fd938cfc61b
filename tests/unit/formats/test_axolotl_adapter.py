"""Axolotl `adapter: lora` (or qlora) and its lora_* keys import into fp8dist's `adapter`; other adapters and other
quantised bases are refused naming the key (QLoRA itself: test_qlora_import.py)."""
import pytest
import yaml

from fp8dist.config.load import load_config
from fp8dist.formats.common import ImportProblem
from fp8dist.formats.importing import import_file


def _import(tmp_path, document: dict):
    path = tmp_path / "axolotl.yaml"
    path.write_text(yaml.safe_dump({"base_model": "x", "bf16": True, **document}))
    return import_file(path, "axolotl")


@pytest.mark.parametrize("targets, expected", [
    ({"lora_target_linear": True}, "auto"),
    ({"lora_target_modules": ["q_proj", "v_proj"]}, ("q_proj", "v_proj")),
    ({"lora_target_modules": ["q_proj"], "lora_target_linear": True}, "auto"),  # Axolotl adds every Linear
])
def test_lora_keys_become_the_adapter_section(tmp_path, targets, expected):
    text = _import(tmp_path, {"adapter": "lora", "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, **targets})
    adapter = load_config(yaml.safe_load(text)).adapter
    assert (adapter.kind, adapter.r, adapter.alpha, adapter.dropout, adapter.target_modules) == \
        ("lora", 16, 32, 0.05, expected)


def test_lora_modules_to_save_train_whole_modules_beside_the_adapters(tmp_path):
    """A new-token run trains the embeddings and the output layer whole (Axolotl's load_lora: PEFT modules_to_save),
    over an NF4 base too."""
    for kind, extra, base in (("lora", {}, "auto"), ("qlora", {"load_in_4bit": True}, "nf4")):
        text = _import(tmp_path, {"adapter": kind, "lora_target_linear": True, **extra,
                                  "lora_modules_to_save": ["embed_tokens", "lm_head"]})
        adapter = load_config(yaml.safe_load(text)).adapter
        assert (adapter.modules_to_save, adapter.target_modules, adapter.base_dtype) == \
            (("embed_tokens", "lm_head"), "auto", base)
        assert "# not kept: lora_modules_to_save" not in text
    for empty in (None, []):  # Axolotl passes an empty list to PEFT as None: nothing trains whole
        text = _import(tmp_path, {"adapter": "lora", "lora_target_linear": True, "lora_modules_to_save": empty})
        assert load_config(yaml.safe_load(text)).adapter.modules_to_save == ()


def test_lora_keys_without_an_adapter_are_noted(tmp_path):
    text = _import(tmp_path, {"lora_r": 16, "peft_use_dora": True})
    assert "# not kept: lora_r: 16 - read only with `adapter: lora`" in text
    assert "# not kept: peft_use_dora: true - read only with `adapter: lora`" in text
    assert load_config(yaml.safe_load(text)).adapter.kind == "none"


def test_peft_use_dora_trains_dora_adapters_and_off_is_noted(tmp_path):
    """Axolotl's load_lora passes peft_use_dora to LoraConfig(use_dora=...): adapter.use_dora."""
    text = _import(tmp_path, {"adapter": "lora", "lora_target_linear": True, "peft_use_dora": True})
    assert load_config(yaml.safe_load(text)).adapter.use_dora and "# not kept: peft_use_dora" not in text
    text = _import(tmp_path, {"adapter": "lora", "lora_target_linear": True, "peft_use_dora": False})
    assert not load_config(yaml.safe_load(text)).adapter.use_dora and "# not kept: peft_use_dora: false - off" in text


@pytest.mark.parametrize("document, keys", [
    # lora + load_in_4bit: Axolotl builds no 4-bit base for it (qlora only); qlora without load_in_4bit: it refuses
    ({"adapter": "lora", "load_in_4bit": True, "lora_target_linear": True}, {"load_in_4bit"}),
    ({"adapter": "qlora", "lora_target_linear": True}, {"adapter"}),
    ({"adapter": "llama-adapter"}, {"adapter"}),
    ({"adapter": "lora", "load_in_8bit": True, "lora_target_linear": True}, {"load_in_8bit"}),
    ({"adapter": "lora"}, {"lora_target_modules"}),  # no target: Axolotl's choice is PEFT's per-model default
    ({"adapter": "lora", "lora_target_linear": True, "lora_model_dir": "out/"}, {"lora_model_dir"}),
    # Axolotl adapts the union: every Linear and the output layer, which auto leaves out
    ({"adapter": "lora", "lora_target_linear": True, "lora_target_modules": ["lm_head"]}, {"lora_target_modules"}),
    ({"adapter": "lora", "lora_target_linear": True, "peft_use_rslora": True}, {"peft_use_rslora"}),
    ({"adapter": "lora", "lora_target_linear": True, "peft_use_dora": "auto"}, {"peft_use_dora"}),  # a switch
    # DoRA's second base GEMM on the dropped-out input would run outside FP8 (fp8dist's rule, named by its key)
    ({"adapter": "lora", "lora_target_linear": True, "peft_use_dora": True, "lora_dropout": 0.05, "fp8": True,
      "fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}, "fp8_enable_fsdp_float8_all_gather": False},
     {"adapter.use_dora"}),
    ({"adapter": "lora", "lora_target_linear": True, "lora_modules_to_save": "lm_head"}, {"lora_modules_to_save"}),
    # lm_head would train whole and get no adapter (fp8dist's rule, named through the imported key)
    ({"adapter": "lora", "lora_target_modules": ["q_proj", "lm_head"], "lora_modules_to_save": ["lm_head"]},
     {"adapter.modules_to_save"}),
    ({"adapter": "lora", "lora_target_linear": True, "lora_target_parameters": ["experts.down_proj"]},
     {"lora_target_parameters"}),
    ({"adapter": "lora", "lora_target_linear": True, "peft_layers_to_transform": [0]}, {"peft_layers_to_transform"}),
])
def test_what_fp8dist_cannot_keep_is_refused_naming_the_key(tmp_path, document, keys):
    with pytest.raises(ImportProblem) as err:
        _import(tmp_path, document)
    assert {issue.path for issue in err.value.issues} == keys, err.value



def test_lora_under_ddp_keeps_peft_fp32_adapters(tmp_path):
    """Axolotl without FSDP or DeepSpeed runs DDP, and PEFT keeps the adapters in fp32 over the bf16 base: fp32
    masters for the adapters, not bf16 weights stepped as loaded."""
    spec = load_config(yaml.safe_load(_import(tmp_path, {"adapter": "lora", "lora_target_linear": True})))
    assert (spec.precision.load_dtype, spec.precision.master_weights, spec.precision.weight_dtype) == \
        ("bf16", "fp32", "fp32")


def test_lora_under_zero3_imports_without_shard_on_read_loading(tmp_path):
    """Under ZeRO-3 the HF Trainer builds the model inside zero.Init; fp8dist adds the adapters to a loaded model
    (the rules refuse RAM-efficient loading with an adapter), so the import leaves it off, saying so."""
    (tmp_path / "zero3.json").write_text('{"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}')
    text = _import(tmp_path, {"adapter": "lora", "lora_target_linear": True, "deepspeed": "zero3.json"})
    spec = load_config(yaml.safe_load(text))
    assert spec.adapter.kind == "lora" and spec.engine == "deepspeed" and not spec.parallel.cpu_ram_efficient_loading
    assert "resolved: parallel.cpu_ram_efficient_loading -> false" in text
