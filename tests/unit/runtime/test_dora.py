"""adapter.use_dora: PEFT's DoRA (peft 0.21 tuners/lora/dora.py) at loading, its export as PEFT saves it, and the
upstream behaviour each of the config's DoRA refusals rests on (fp8dist/config/rules/common.py `_dora`): if one of
those tests starts failing, the refusal it backs can be lifted."""
import json

import pytest
import torch

from fp8dist.backends.module_filter import is_adapter
from fp8dist.config.load import load_config
from fp8dist.config.spec import AdapterSpec
from fp8dist.errors import ConfigError
from fp8dist.backends.adapters import apply_adapter, trained_beside_base
from fp8dist.runtime.loading import load_for_run
from fp8dist.runtime.models import causal_lm_batch

MAGNITUDE = ".lora_magnitude_vector.default.weight"


def _steps(model, spec, count: int = 1, autocast: bool = False) -> list[float]:
    """`count` AdamW steps of `model` on one tiny-llama batch (the trainable parameters only, as the engines build
    it); the losses."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = causal_lm_batch(256)(2, 16, spec.train.seed)
    losses = []
    for _ in range(count):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_dora_trains_a_magnitude_vector_beside_each_adapter_in_the_master_dtype():
    spec = load_config({"adapter": {"kind": "lora", "r": 4, "alpha": 8, "use_dora": True},
                        "precision": {"preset": "bf16"}})
    model = load_for_run("tiny-llama", spec).model
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    magnitudes = {n: p for n, p in trainable.items() if n.endswith(MAGNITUDE)}
    # auto: the 7 projections of each of the 2 blocks, each with lora_A, lora_B and its magnitude vector
    assert len(trainable) == 3 * 7 * 2 and len(magnitudes) == 7 * 2
    assert all(is_adapter(n) and trained_beside_base(n) for n in trainable)  # what the audit and export see
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    q_proj = model.get_submodule("model.layers.0.self_attn.q_proj")
    # it starts at the norms of the base weight's rows (lora_B is zero), one value per output feature, taken in the
    # base's bf16 (one bf16 rounding: 2**-8 relative)
    torch.testing.assert_close(magnitudes["model.layers.0.self_attn.q_proj" + MAGNITUDE],
                               torch.linalg.norm(q_proj.base_layer.weight.float(), dim=1), rtol=2**-8, atol=0)
    before = {n: p.detach().clone() for n, p in magnitudes.items()}
    _steps(model, spec)
    assert all(not torch.equal(before[n], p) for n, p in magnitudes.items())
    assert model.fp8dist_lora_config.use_dora


def test_a_dora_adapter_exports_as_peft_saves_it_and_loads_back_to_the_same_output(tmp_path):
    """The adapter directory holds PEFT's own keys (the magnitude vector as `...lora_magnitude_vector`, no `.weight`;
    a module to save beside it), PeftModel.from_pretrained gives the trained model's logits, and --merge's model
    (PEFT's DoRA merge) the same."""
    from peft import PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fp8dist.backends.adapters import lora_config
    from fp8dist.runtime.adapter_files import write_adapter, write_merged
    from fp8dist.runtime.models import load_model

    spec = load_config({"adapter": {"kind": "lora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                    "use_dora": True, "modules_to_save": ["lm_head"]}, "precision": {"preset": "fp32"}})
    model = load_for_run("tiny-llama", spec).model
    _steps(model, spec, count=2)
    tensors = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert len(tensors) == 2 * 2 * 3 + 1

    own = tmp_path / "peft"  # what PEFT itself writes for the same LoraConfig
    get_peft_model(load_model("tiny-llama", "fp32").model, lora_config(spec.adapter)).save_pretrained(str(own))
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    adapter_dir.mkdir()
    write_adapter(tensors, spec.to_dict(), "tiny-llama", adapter_dir)
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(load_file(str(own / "adapter_model.safetensors")))
    assert torch.equal(saved["base_model.model.model.layers.1.self_attn.v_proj.lora_magnitude_vector"],
                       tensors["model.layers.1.self_attn.v_proj" + MAGNITUDE])
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["use_dora"] is True

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(load_model("tiny-llama", "fp32", seed=spec.train.seed).model,
                                           str(adapter_dir))
        torch.testing.assert_close(loaded(input_ids=ids).logits, want)
    write_merged(adapter_dir, spec.to_dict(), "tiny-llama", "fp32", merged_dir)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(str(merged_dir))
        torch.testing.assert_close(merged(input_ids=ids).logits, want)


@pytest.mark.parametrize("config, says", [
    ({"adapter": {"kind": "lora", "use_dora": True, "base_dtype": "nf4"}, "precision": {"preset": "bf16"}},
     "NF4Tensor.dequantize does not take"),
    ({"adapter": {"kind": "lora", "use_dora": True},
      "precision": {"preset": "torchao-float8", "fp8": {"torchao": {"emulate": True}}}},
     "the frozen weights are all-gathered in float8"),
    ({"adapter": {"kind": "lora", "use_dora": True, "dropout": 0.1},
      "precision": {"preset": "torchao-float8",
                    "fp8": {"torchao": {"emulate": True, "enable_fsdp_float8_all_gather": False}}}},
     "a second GEMM of every FP8 Linear"),
    ({"adapter": {"use_dora": True}}, "adapter settings do nothing with adapter.kind=none"),
])
def test_dora_refusals_name_the_key_and_a_fix(config, says):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert err.value.exit_code == 2 and "adapter.use_dora:" in str(err.value) and says in str(err.value)
    assert "fix:" in str(err.value)


FP8_DORA = {"adapter": {"kind": "lora", "r": 4, "alpha": 8, "use_dora": True},
            "precision": {"preset": "torchao-float8",
                          "fp8": {"torchao": {"emulate": True, "enable_fsdp_float8_all_gather": False}}}}


def _float8_dora(dropout: float):
    """tiny-llama with DoRA adapters over torchao float8 base Linears (emulated), as the engines convert them."""
    from fp8dist.backends.torchao import TorchaoFloat8

    spec = load_config(FP8_DORA)
    # a spec built by hand: the rules refuse dropout with DoRA and FP8, whose premise the caller measures
    adapter = AdapterSpec(**{**vars(spec.adapter), "dropout": dropout})
    model = apply_adapter(load_for_run("tiny-llama", load_config({"precision": {"preset": "bf16"}})).model, adapter,
                          spec.precision.weight_dtype, spec.train.seed)
    backend = TorchaoFloat8(spec)
    backend.check_environment({})
    converted = [d.fqn for d in backend.convert_module(model) if d.convert]
    return spec, model, converted


def test_dora_over_a_float8_base_trains_and_keeps_every_base_gemm_in_float8():
    """DoRA reads the base weight of a torchao Float8Linear (stored in the load dtype) for its norms and reuses the
    FP8 GEMM's output: finite losses, the magnitude vectors trained. With adapter dropout PEFT computes the base
    output again from the dropped-out input in the compute dtype (DoraLinearLayer.forward: F.linear of the weight),
    a high-precision GEMM per converted Linear: why the rules refuse dropout with DoRA and FP8."""
    from fp8dist.audit.probes import MatmulRecorder

    spec, model, converted = _float8_dora(0.0)
    assert len(converted) == 14 and all(name.endswith(".base_layer") for name in converted)
    losses = _steps(model, spec, count=3, autocast=True)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]

    def high_precision_gemms(dropout: float) -> int:
        spec, model, _ = _float8_dora(dropout)
        batch = causal_lm_batch(256)(2, 16, spec.train.seed)
        with MatmulRecorder() as recorder, torch.autocast("cpu", torch.bfloat16):
            model(**batch).loss.backward()
        return sum(count for (name, operands), count in recorder.calls.items()
                   if name == "mm" and operands == ("bf16", "bf16"))

    assert high_precision_gemms(0.1) - high_precision_gemms(0.0) >= len(converted)


def test_peft_cannot_read_torchaos_nf4_or_gathered_float8_weight_back():
    """The premises of the NF4 and float8 all-gather refusals: PEFT reads a torchao weight with a bare
    `weight.dequantize()` (peft 0.21 utils/integrations.py dequantize_module_weight), which torchao's NF4Tensor
    does not take (DoRA over fp8dist's NF4 base fails in its first forward) and FSDP2's float8 all-gather output,
    Float8TrainingTensor, does not implement."""
    from peft.utils.integrations import dequantize_module_weight
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from transformers import AutoModelForCausalLM

    from fp8dist.backends.nf4 import quantize_frozen_base
    from fp8dist.config.models import _llama_config

    adapter = AdapterSpec(kind="lora", r=4, alpha=8, dropout=0.0, target_modules="auto", base_dtype="nf4",
                          use_dora=True)  # built by hand: the rules refuse it
    base = AutoModelForCausalLM.from_config(_llama_config(hidden_size=128, intermediate_size=256)).to(torch.bfloat16)
    model = apply_adapter(base, adapter, "fp32", 0)
    quantized, _ = quantize_frozen_base(model, 1)
    assert quantized
    batch = causal_lm_batch(256)(2, 16, 0)
    with pytest.raises(TypeError, match="dequantize"):
        model(**batch)

    linear = torch.nn.Linear(32, 32)
    linear.weight = torch.nn.Parameter(hp_tensor_and_scale_to_float8(linear.weight.detach(), torch.tensor(1.0),
                                                                     torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(NotImplementedError, match="dequantize"):
        dequantize_module_weight(linear)
