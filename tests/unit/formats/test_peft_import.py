"""`fp8dist import adapter_config.json [--from peft]`: the LoraConfig PEFT saves beside a LoRA adapter imports into
fp8dist's `adapter` section (everything else at fp8dist's defaults, said in a comment), or is refused naming each
key that changes which parameters train or the adapters' numerics in a way fp8dist cannot keep."""
import json
import subprocess
import sys

import pytest
import yaml

from fp8dist.config.load import load_config
from fp8dist.formats.common import ImportProblem
from fp8dist.formats.importing import detect, import_file
from fp8dist.formats.keys import KeyClass
from fp8dist.formats.peft.importer import KEYS
from tests.conftest import ROOT, run_cli
from tests.unit.formats.importing import refused_keys

CORPUS = ROOT / "tests" / "data" / "corpus"
KEPT_FILE = CORPUS / "peft" / "cosmos-reason2-2b-retail-grocery-egoexo__adapter_config.json"
LORA = {"peft_type": "LORA", "target_modules": ["q_proj", "v_proj"]}


def _import(tmp_path, document: dict, kind: str | None = "peft"):
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps(document))
    return import_file(path, kind)


def _spec(tmp_path, document: dict, **kwargs):
    return load_config(yaml.safe_load(_import(tmp_path, document, **kwargs)))


def _refused(tmp_path, document: dict) -> set[str]:
    return refused_keys(lambda: _import(tmp_path, document))


# -- kept keys ---------------------------------------------------------------------------------------------
def test_each_kept_key_is_mapped_and_the_rest_is_fp8dists_defaults(tmp_path):
    text = _import(tmp_path, {**LORA, "r": 32, "lora_alpha": 64, "lora_dropout": 0.05})
    assert yaml.safe_load(text).keys() == {"adapter"}
    spec = load_config(yaml.safe_load(text))
    a = spec.adapter
    assert (a.kind, a.r, a.alpha, a.dropout, a.target_modules) == ("lora", 32, 64, 0.05, ("q_proj", "v_proj"))
    assert spec == load_config({"adapter": {"kind": "lora", "r": 32, "alpha": 64, "dropout": 0.05,
                                            "target_modules": ["q_proj", "v_proj"]}})
    assert "# resolved: precision / engine / batch -> fp8dist's defaults" in text
    assert "engine fsdp2, load_dtype bf16" in text


def test_left_out_lora_keys_take_peft_defaults(tmp_path):
    text = _import(tmp_path, LORA)
    a = load_config(yaml.safe_load(text)).adapter
    assert (a.r, a.alpha, a.dropout) == (8, 8, 0.0)
    assert "resolved: r -> 8" in text and "resolved: lora_alpha -> 8" in text


@pytest.mark.parametrize("targets, expected", [
    ("all-linear", "auto"), ("ALL-LINEAR", "auto"), (["q_proj"], ("q_proj",)),  # a one-item list is a list in PEFT
    (["self_attn.q_proj", "mlp.down_proj"], ("self_attn.q_proj", "mlp.down_proj")),
])
def test_target_modules(tmp_path, targets, expected):
    assert _spec(tmp_path, {**LORA, "target_modules": targets}).adapter.target_modules == expected


# -- refusals ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("document, keys", [
    ({"peft_type": "IA3", "target_modules": ["q_proj"]}, {"peft_type"}),
    ({"target_modules": ["q_proj"], "r": 8}, {"peft_type"}),  # PEFT cannot load it either
    ({"peft_type": "LORA"}, {"target_modules"}),  # null: PEFT's per-architecture default, not guessed
    ({"peft_type": "LORA", "target_modules": ".*(q_proj|v_proj)$"}, {"target_modules"}),  # a regex in PEFT
    ({"peft_type": "LORA", "target_modules": []}, {"target_modules"}),
    ({**LORA, "use_rslora": True}, {"use_rslora"}),
    ({**LORA, "use_dora": "sometimes"}, {"use_dora"}),  # a switch: true or false
    ({**LORA, "modules_to_save": "lm_head"}, {"modules_to_save"}),  # PEFT's field is a list
    ({**LORA, "layers_to_transform": [0, 1], "layers_pattern": "layers"}, {"layers_to_transform", "layers_pattern"}),
    ({**LORA, "rank_pattern": {"q_proj": 4}, "alpha_pattern": {"q_proj": 4}}, {"rank_pattern", "alpha_pattern"}),
    ({**LORA, "bias": "lora_only"}, {"bias"}),
    ({**LORA, "bias": "all"}, {"bias"}),
    ({**LORA, "lora_bias": True}, {"lora_bias"}),
    ({**LORA, "target_parameters": ["experts.down_proj"]}, {"target_parameters"}),
    ({**LORA, "init_lora_weights": False}, {"init_lora_weights"}),  # random lora_B: not a no-op at the start
    ({**LORA, "init_lora_weights": "pissa"}, {"init_lora_weights"}),
    ({**LORA, "init_lora_weights": "eva", "eva_config": {"rho": 2.0}}, {"init_lora_weights"}),
    ({**LORA, "exclude_modules": ["lm_head"]}, {"exclude_modules"}),
    ({**LORA, "use_qalora": True}, {"use_qalora"}),
    ({**LORA, "megatron_config": {"tensor_model_parallel_size": 2}}, {"megatron_config"}),
    ({**LORA, "trainable_token_indices": [0, 1]}, {"trainable_token_indices"}),
    ({**LORA, "layer_replication": [[0, 4], [2, 5]]}, {"layer_replication"}),
    ({**LORA, "ensure_weight_tying": True}, {"ensure_weight_tying"}),
    ({**LORA, "alora_invocation_tokens": [1, 2]}, {"alora_invocation_tokens"}),
    ({**LORA, "task_type": "SEQ_CLS"}, {"task_type"}),  # PEFT trains the classifier head too
    ({**LORA, "task_type": "TOKEN_CLS"}, {"task_type"}),
])
def test_what_fp8dist_cannot_keep_is_refused_naming_the_key(tmp_path, document, keys):
    assert _refused(tmp_path, document) == keys


def test_the_values_that_change_nothing_are_noted(tmp_path):
    text = _import(tmp_path, {**LORA, "use_dora": False, "use_rslora": False, "modules_to_save": None,
                              "rank_pattern": {}, "bias": "none", "init_lora_weights": True, "fan_in_fan_out": True,
                              "task_type": "CAUSAL_LM", "loftq_config": {}, "eva_config": {"rho": 2.0},
                              "base_model_name_or_path": "meta-llama/Llama-2-7b-hf", "inference_mode": True,
                              "merge_weights": False})
    for key in ("use_dora: false - off: changes nothing", "rank_pattern: {} - empty or unset: changes nothing",
                "bias: none", "init_lora_weights: true",
                "fan_in_fan_out: true - PEFT sets it from the layer's class", "task_type: CAUSAL_LM",
                "eva_config: ", "inference_mode: true", "merge_weights: false"):
        assert f"# not kept: {key}" in text, key
    assert "modules_to_save" not in text  # null sets nothing
    # a Hub id: the base cannot be read, so whether it was quantized is unknown
    assert "# resolved: base_model_name_or_path -> adapter.base_dtype auto ('meta-llama/Llama-2-7b-hf' is not a " \
           "local model directory" in text and "is unknown" in text


def test_the_table_covers_peft_021s_lora_config():
    """Every field of the installed PEFT's LoraConfig (and PeftConfig) is in the table, with a class."""
    import dataclasses

    LoraConfig = pytest.importorskip("peft").LoraConfig

    fields = {field.name for field in dataclasses.fields(LoraConfig) if field.init}
    missing = fields - set(KEYS.rules)
    assert not missing, missing
    for key in ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules"):
        assert KEYS.rules[key].cls is KeyClass.KEPT, key


def test_a_real_saved_config_round_trips_through_peft(tmp_path):
    """What fp8dist builds from the imported adapter (backends/adapters.py lora_config) is the file's LoraConfig in
    every field the table keeps or refuses."""
    pytest.importorskip("peft")
    from fp8dist.backends.adapters import lora_config

    spec = load_config(yaml.safe_load(import_file(KEPT_FILE)))
    built = lora_config(spec.adapter).to_dict()
    saved = json.loads(KEPT_FILE.read_text())
    for key, value in saved.items():
        rule = KEYS.rules[key]
        # task_type: no head for CAUSAL_LM; base_model_name_or_path: fp8dist reads the base's quantization from it
        if rule.cls is not KeyClass.NO_EFFECT and key not in ("task_type", "base_model_name_or_path"):
            built_value = sorted(built[key]) if isinstance(built[key], (set, list)) else built[key]
            saved_value = sorted(value) if isinstance(value, list) else value
            assert built_value == saved_value, key


def test_modules_to_save_train_whole_modules_beside_the_adapters(tmp_path):
    spec = _spec(tmp_path, {**LORA, "modules_to_save": ["embed_tokens", "lm_head"]})
    assert spec.adapter.modules_to_save == ("embed_tokens", "lm_head")
    assert spec == load_config({"adapter": {"kind": "lora", "target_modules": ["q_proj", "v_proj"],
                                            "modules_to_save": ["embed_tokens", "lm_head"]}})


# -- the base: QLoRA's adapter_config.json is LoRA's, its base's config.json says bitsandbytes 4-bit --------------
def _base(tmp_path, quantization: dict | None) -> str:
    """A local model directory whose config.json holds `quantization_config` (as transformers saves it)."""
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    config = {"model_type": "llama", **({"quantization_config": quantization} if quantization is not None else {})}
    (base / "config.json").write_text(json.dumps(config))
    return str(base)


NF4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
       "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
       "llm_int8_skip_modules": None}


def test_an_adapter_over_a_local_nf4_base_imports_an_nf4_base(tmp_path):
    text = _import(tmp_path, {**LORA, "base_model_name_or_path": _base(tmp_path, NF4)})
    assert load_config(yaml.safe_load(text)).adapter.base_dtype == "nf4"
    assert "bnb_4bit_quant_type nf4 -> adapter.base_dtype=nf4 (QLoRA" in text and "computed in bfloat16" in text
    nested = _import(tmp_path, {**LORA, "base_model_name_or_path": _base(tmp_path, {
        **NF4, "bnb_4bit_use_double_quant": False, "llm_int8_skip_modules": ["lm_head"]})})
    assert "quantization_config.bnb_4bit_use_double_quant: false - fp8dist's NF4 always quantizes its scales" in nested


def test_an_older_nf4_base_without_quant_method_and_a_skip_list_of_what_stays_16_bit_import(tmp_path):
    """transformers takes load_in_4bit for bitsandbytes whatever quant_method says (quantizers/auto.py from_dict),
    and a skip list of modules fp8dist keeps out of NF4 anyway (embeddings, the output layer, routers) is no change."""
    older = {key: value for key, value in NF4.items() if key != "quant_method"}
    for quantization in (older, {**NF4, "llm_int8_skip_modules": ["lm_head", "embed_tokens", "gate"]}):
        text = _import(tmp_path, {**LORA, "base_model_name_or_path": _base(tmp_path, quantization)})
        assert load_config(yaml.safe_load(text)).adapter.base_dtype == "nf4"


def test_an_unquantized_local_base_stays_as_it_loads(tmp_path):
    text = _import(tmp_path, {**LORA, "base_model_name_or_path": _base(tmp_path, None)})
    assert load_config(yaml.safe_load(text)).adapter.base_dtype == "auto" and "has no quantization_config" in text


def test_use_dora_imports_dora_and_over_an_nf4_base_is_refused_naming_it(tmp_path):
    """PEFT's use_dora is adapter.use_dora; over a local NF4 base (QLoRA's file) the imported config is refused by the
    rule that DoRA does not run over fp8dist's NF4 base, naming adapter.use_dora."""
    spec = _spec(tmp_path, {**LORA, "use_dora": True})
    assert spec == load_config({"adapter": {"kind": "lora", "target_modules": ["q_proj", "v_proj"], "use_dora": True}})
    with pytest.raises(ImportProblem) as err:
        _import(tmp_path, {**LORA, "use_dora": True, "base_model_name_or_path": _base(tmp_path, NF4)})
    [issue] = err.value.issues
    assert issue.path == "adapter.use_dora" and "NF4Tensor.dequantize" in issue.message and issue.fix


@pytest.mark.parametrize("quantization, key, value", [
    ({**NF4, "bnb_4bit_quant_type": "fp4"}, "bnb_4bit_quant_type", "fp4"),
    ({key: value for key, value in NF4.items() if key != "bnb_4bit_quant_type"}, "bnb_4bit_quant_type", "fp4"),
    ({**NF4, "load_in_4bit": False, "load_in_8bit": True}, "load_in_8bit", True),
    ({"quant_method": "gptq", "bits": 4}, "quant_method", "gptq"),
    ({**NF4, "llm_int8_skip_modules": ["lm_head", "mlp"]}, "llm_int8_skip_modules", ["lm_head", "mlp"]),
])
def test_another_quantized_base_is_refused_naming_the_key_and_value(tmp_path, quantization, key, value):
    base = _base(tmp_path, quantization)
    with pytest.raises(ImportProblem) as err:
        _import(tmp_path, {**LORA, "base_model_name_or_path": base})
    [issue] = err.value.issues
    assert issue.path == f"{base}/config.json quantization_config.{key}" and issue.value == value and issue.fix


# -- detection and the command line ----------------------------------------------------------------------
@pytest.mark.parametrize("document", [
    {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]},  # lora_alpha is Axolotl's too
    {"base_model_name_or_path": "x", "lora_alpha": 16, "use_rslora": False, "use_dora": False},  # and TRL's
])
def test_an_adapter_config_is_detected_by_keys_only_peft_writes(document):
    assert detect(document) == "peft"


def test_axolotl_and_trl_keep_their_shared_keys_without_peft_keys():
    assert detect({"lora_alpha": 16, "lora_r": 8}) == "axolotl"
    assert detect({"use_dora": True, "lora_alpha": 16}) == "trl"


def test_every_corpus_adapter_config_is_detected_as_peft_and_no_other_file_is():
    sources = json.loads((CORPUS / "SOURCES.json").read_text())
    assert sum(source["tool"] == "peft" for source in sources.values()) >= 6
    for relative, source in sources.items():
        if relative.startswith("axolotl/deepspeed_configs/"):
            continue
        text = (CORPUS / relative).read_text()
        document = json.loads(text) if relative.endswith(".json") else yaml.safe_load(text)
        assert (detect(document) == "peft") == (source["tool"] == "peft"), relative


def test_the_printed_output_validates(tmp_path):
    result = run_cli("import", str(KEPT_FILE), "--from", "peft")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "imported.yaml"
    out.write_text(result.stdout)
    validated = run_cli("validate", str(out))
    assert validated.returncode == 0, validated.stderr + validated.stdout
    assert load_config(out).adapter.r == 32


def test_a_refused_adapter_exits_2_and_writes_nothing(tmp_path):
    refused = CORPUS / "peft" / "bert-gpt2-multitask-finetuning__adapter_config.json"
    out = tmp_path / "out.yaml"
    result = run_cli("import", str(refused), "-o", str(out))
    assert result.returncode == 2 and "modules_to_save" in result.stderr and not out.exists()


def test_import_of_an_adapter_config_does_not_import_torch():
    code = ("import sys, fp8dist.cli; from fp8dist.formats.importing import import_file; "
            f"import_file({str(KEPT_FILE)!r}); print('torch' in sys.modules, 'peft' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.stdout.strip() == "False False", result.stderr
