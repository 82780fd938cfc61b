"""QLoRA in Axolotl configs and TRL recipes imports as fp8dist's NF4 base (adapter.base_dtype: nf4): Axolotl's
`adapter: qlora` + `load_in_4bit` (bitsandbytes NF4 with double quantization, bnb_config_kwargs over it), TRL's
`load_in_4bit` with `use_peft` (bnb_4bit_quant_type, use_bnb_nested_quant, bnb_4bit_quant_storage); what fp8dist's NF4
base is not (FP4, 8-bit bases, a 4-bit base without the adapter that needs it) is refused naming the key. Axolotl's
gpt-oss configs that dequantize an MXFP4 checkpoint at load import as the 16-bit run they are."""
import pytest

from tests.unit.formats.importing import FSDP2, import_document, refusals, spec_of

AXOLOTL_QLORA = {"base_model": "x", "bf16": True, "adapter": "qlora", "load_in_4bit": True, "lora_r": 8,
                 "lora_alpha": 16, "lora_target_linear": True}
TRL_QLORA = {"model_name_or_path": "x", "torch_dtype": "bfloat16", "bf16": True, "use_peft": True,
             "load_in_4bit": True, "lora_target_modules": ["q_proj", "v_proj"]}
NESTED_NOTE = "fp8dist's NF4 always quantizes its scales (torchao to_nf4: one scale per 64 values"


# -- Axolotl ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [{}, FSDP2])
def test_axolotl_qlora_is_lora_over_an_nf4_base(tmp_path, layout):
    text = import_document(tmp_path, "axolotl", {**AXOLOTL_QLORA, **layout})
    spec = spec_of(text)
    adapter = spec.adapter
    assert (adapter.kind, adapter.base_dtype, adapter.r, adapter.alpha, adapter.target_modules) == \
        ("lora", "nf4", 8, 16, "auto")
    assert spec.engine == "fsdp2" and spec.precision.load_dtype == "bf16" and spec.precision.master_weights == "fp32"
    assert "resolved: adapter: qlora, load_in_4bit -> adapter.kind=lora, base_dtype=nf4" in text


def test_axolotl_bnb_config_kwargs_that_keep_the_base_are_noted(tmp_path):
    options = {"bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False, "bnb_4bit_quant_storage": "uint8",
               "bnb_4bit_compute_dtype": "bfloat16", "llm_int8_threshold": 6.0}
    text = import_document(tmp_path, "axolotl", {**AXOLOTL_QLORA, "bnb_config_kwargs": options})
    assert spec_of(text).adapter.base_dtype == "nf4"
    assert f"# not kept: bnb_config_kwargs.bnb_4bit_use_double_quant: false - {NESTED_NOTE}" in text
    assert "# not kept: bnb_config_kwargs.bnb_4bit_quant_storage: uint8 - the dtype bitsandbytes packs" in text
    assert "# not kept: bnb_config_kwargs.llm_int8_threshold: 6.0 - an option of bitsandbytes' 8-bit base" in text
    assert "bnb_4bit_quant_type" not in text and "bnb_4bit_compute_dtype" not in text  # Axolotl's own values


@pytest.mark.parametrize("document, keys", [
    ({"bnb_config_kwargs": {"bnb_4bit_quant_type": "fp4"}}, {"bnb_config_kwargs.bnb_4bit_quant_type"}),
    ({"bnb_config_kwargs": {"bnb_4bit_compute_dtype": "float32"}}, {"bnb_config_kwargs.bnb_4bit_compute_dtype"}),
    ({"bnb_config_kwargs": {"llm_int8_skip_modules": ["out_proj"]}}, {"bnb_config_kwargs.llm_int8_skip_modules"}),
    ({"adapter": "lora"}, {"load_in_4bit"}),  # Axolotl builds its 4-bit base for qlora only
    ({"load_in_4bit": False}, {"adapter"}),  # Axolotl: "Require cfg.load_in_4bit to be True for qlora"
    ({"load_in_4bit": False, "load_in_8bit": True}, {"adapter", "load_in_8bit"}),
    ({"deepspeed": "ds.json"}, {"adapter.base_dtype"}),  # the NF4 base runs on FSDP2 only
    ({"fp8": True, **FSDP2}, {"adapter.base_dtype"}),  # FP8 would convert the same frozen Linears
    ({"peft_use_dora": True}, {"adapter.use_dora"}),  # QDoRA: PEFT cannot read torchao's NF4 weight back
])
def test_axolotl_what_the_nf4_base_is_not_is_refused_naming_the_key(tmp_path, document, keys):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}')
    assert set(refusals(tmp_path, "axolotl", {**AXOLOTL_QLORA, **document})) == keys


def test_axolotl_8bit_base_is_refused_as_fp8dists_int8_base(tmp_path):
    document = {**AXOLOTL_QLORA, "adapter": "lora", "load_in_4bit": False, "load_in_8bit": True}
    assert "adapter.base_dtype int8" in refusals(tmp_path, "axolotl", document)["load_in_8bit"]


def test_axolotl_bnb_config_kwargs_without_qlora_are_noted(tmp_path):
    document = {"base_model": "x", "bf16": True, "bnb_config_kwargs": {"bnb_4bit_quant_type": "fp4"}}
    text = import_document(tmp_path, "axolotl", document)
    assert "# not kept: bnb_config_kwargs: " in text and spec_of(text).adapter.kind == "none"


def test_axolotl_dequantized_mxfp4_checkpoint_trains_its_16bit_weights(tmp_path):
    document = {"base_model": "openai/gpt-oss-20b", "bf16": True, "model_quantization_config": "Mxfp4Config",
                "model_quantization_config_kwargs": {"dequantize": True}, **FSDP2}
    text = import_document(tmp_path, "axolotl", document)
    spec = spec_of(text)
    assert (spec.precision.load_dtype, spec.adapter.kind, spec.fp8.backend) == ("bf16", "none", "none")
    assert "resolved: model_quantization_config: Mxfp4Config, dequantize: true -> bf16 weights" in text


@pytest.mark.parametrize("kwargs", [None, {"dequantize": False}, {}])
def test_axolotl_training_on_mxfp4_weights_is_refused(tmp_path, kwargs):
    document = {"base_model": "x", "bf16": True, "model_quantization_config": "Mxfp4Config", **FSDP2}
    if kwargs is not None:
        document["model_quantization_config_kwargs"] = kwargs
    assert set(refusals(tmp_path, "axolotl", document)) == {"model_quantization_config"}


# -- TRL ---------------------------------------------------------------------------------------------------------
def test_trl_load_in_4bit_with_peft_is_an_nf4_base_with_bf16_adapters(tmp_path):
    text = import_document(tmp_path, "trl", TRL_QLORA)
    spec = spec_of(text)
    assert (spec.adapter.kind, spec.adapter.base_dtype, spec.adapter.target_modules) == \
        ("lora", "nf4", ("q_proj", "v_proj"))
    # TRL casts the adapters to bf16 over a quantized base: stepped as they are, no fp32 master copy
    assert (spec.precision.load_dtype, spec.precision.master_weights, spec.precision.weight_dtype) == \
        ("bf16", "none", "bf16")
    assert f"# not kept: use_bnb_nested_quant: false - left out: TRL's default false; {NESTED_NOTE}" in text


def test_trl_bnb_keys_that_keep_the_base_are_noted(tmp_path):
    document = {**TRL_QLORA, "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": True,
                "bnb_4bit_quant_storage": "bfloat16"}
    text = import_document(tmp_path, "trl", document)
    assert spec_of(text).adapter.base_dtype == "nf4" and "use_bnb_nested_quant" not in text
    assert "# not kept: bnb_4bit_quant_storage: bfloat16 - the dtype bitsandbytes packs its 4-bit codes" in text


def test_trl_qlora_under_fsdp_keeps_fp32_masters(tmp_path):
    spec = spec_of(import_document(tmp_path, "trl", {**TRL_QLORA, "fsdp": "full_shard"}))
    assert (spec.adapter.base_dtype, spec.parallel.sharding, spec.precision.master_weights) == ("nf4", "full", "fp32")


@pytest.mark.parametrize("document, keys", [
    ({"bnb_4bit_quant_type": "fp4"}, {"bnb_4bit_quant_type"}),
    ({"torch_dtype": "float32"}, {"load_in_4bit"}),  # bf16 adapters over an fp32 model
    ({"use_peft": False}, {"load_in_4bit"}),  # the Trainer does not train a purely quantized model
    ({"load_in_4bit": False, "load_in_8bit": True}, {"load_in_8bit"}),
    ({"deepspeed": "ds.json"}, {"adapter.base_dtype"}),
    ({"use_dora": True}, {"adapter.use_dora"}),  # QDoRA: PEFT cannot read torchao's NF4 weight back
])
def test_trl_what_the_nf4_base_is_not_is_refused_naming_the_key(tmp_path, document, keys):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}')
    assert set(refusals(tmp_path, "trl", {**TRL_QLORA, **document})) == keys


def test_trl_8bit_base_is_refused_as_fp8dists_int8_base(tmp_path):
    document = {**TRL_QLORA, "load_in_4bit": False, "load_in_8bit": True}
    assert "adapter.base_dtype int8" in refusals(tmp_path, "trl", document)["load_in_8bit"]


def test_trl_bnb_keys_without_a_4bit_base_are_noted(tmp_path):
    text = import_document(tmp_path, "trl", {**TRL_QLORA, "load_in_4bit": False, "bnb_4bit_quant_type": "fp4"})
    assert "# not kept: bnb_4bit_quant_type: fp4 - read only with load_in_4bit" in text
    assert spec_of(text).adapter.base_dtype == "auto"
