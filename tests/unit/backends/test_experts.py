"""MoE experts as grouped GEMMs (fp8dist.backends.experts): the forward equals transformers' own, the modes per
hardware (torchao_experts_mode), and what cannot convert says why."""
import pytest
import torch

from fp8dist.backends import experts
from fp8dist.backends.base import get_backend
from fp8dist.config.load import load_config
from fp8dist.errors import UnsupportedEnvironment
from fp8dist.facts import versions
from fp8dist.facts.torchao import torchao_experts_mode
from fp8dist.runtime.models import _from_hf_config
from fp8dist.config.models import tiny_config


def _gpt_oss():
    from transformers import GptOssConfig

    # transposed (E, K, N) experts with biases and their own gate: the layout variants transformers has
    return GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        head_dim=16, layer_types=["full_attention"])


def _plain_grouped_mm(tokens, weight_t, offsets):
    return torch._grouped_mm(tokens, weight_t, offs=offsets)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"])
def test_the_grouped_forward_computes_what_transformers_computes(arch):
    config = _gpt_oss() if arch == "gpt_oss" else tiny_config(arch)
    model = _from_hf_config(config, "fp32", 0)
    name, module = experts.experts_modules(model)[0]
    torch.manual_seed(1)
    for param in module.parameters():  # biases start at zero: make them count
        param.data.normal_(0, 0.05)
    tokens, k = 40, config.num_experts_per_tok
    hidden = torch.randn(tokens, config.hidden_size)
    index = torch.stack([torch.randperm(module.num_experts)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k)
    expected = module(hidden, index, weights)  # transformers' grouped_mm implementation (the default)
    got = experts.experts_forward(_plain_grouped_mm, module, hidden, index, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_experts_of_a_transformers_without_post_expert_norms_run():
    """transformers 5.17's experts decorator sets no `has_post_expert_norm` (5.24's does): seen on an H100 image
    as an AttributeError in the first MoE step."""
    config = tiny_config("mixtral")
    name, module = experts.experts_modules(_from_hf_config(config, "fp32", 0))[0]
    assert module.__dict__.pop("has_post_expert_norm") is False
    hidden = torch.randn(12, config.hidden_size)
    index = torch.stack([torch.randperm(module.num_experts)[:2] for _ in range(12)])
    got = experts.experts_forward(_plain_grouped_mm, module, hidden, index, torch.rand(12, 2))
    assert got.shape == hidden.shape and torch.isfinite(got).all()


def test_experts_modules_finds_the_experts_and_nothing_else():
    model = _from_hf_config(tiny_config("mixtral"), "fp32", 0)
    assert [n for n, _ in experts.experts_modules(model)] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert experts.experts_modules(_from_hf_config(tiny_config("llama"), "fp32", 0)) == []


@pytest.mark.parametrize("requested, emulate, capability, mode", [
    ("auto", True, None, "mxfp8"), ("auto", False, (10, 0), "mxfp8"), ("auto", False, (9, 0), "float8"),
    ("auto", False, (8, 9), None), ("auto", False, None, None), ("none", False, None, "none"),
    ("mxfp8", True, None, "mxfp8"), ("mxfp8", False, (9, 0), None), ("float8", True, None, None),
    ("float8", False, (9, 0), "float8"), ("float8", False, (8, 9), None),
])
def test_modes_per_hardware(requested, emulate, capability, mode):
    got, why = torchao_experts_mode(requested, emulate, capability)
    assert got == mode, why
    assert why


def _backend(experts_value, emulate=True):
    spec = load_config({"engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        "emulate": emulate, "experts": experts_value}}}})
    return get_backend(spec)


def test_float8_experts_without_hardware_are_refused_with_the_fix():
    with pytest.raises(UnsupportedEnvironment) as err:
        _backend("float8").check_environment({"capability": None})
    assert "no emulated mode" in str(err.value) and "experts=none" in err.value.fix


def test_torchao_older_than_the_verified_prototype_api_is_refused_for_experts_and_mx_linears(monkeypatch):
    """Experts and MX Linears call torchao's prototype API as 0.18 has it: an older torchao is refused up front
    (naming the key and the version), not left to fail on an import inside a rank; plain float8 is unaffected."""
    monkeypatch.setattr(versions, "installed_version", lambda name: "0.17.0" if name == "torchao" else "9.9.9")
    with pytest.raises(UnsupportedEnvironment, match=r"experts=mxfp8 calls torchao's prototype.*torchao 0.17.0"):
        _backend("mxfp8").check_environment({"capability": None})
    spec = load_config({"engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {"torchao": {
        "emulate": True, "experts": "none", "recipe_name": "mxfp8"}}}})
    with pytest.raises(UnsupportedEnvironment, match="recipe_name=mxfp8") as err:
        get_backend(spec).check_environment({"capability": None})
    assert "torchao>=0.18.0" in err.value.fix
    backend = _backend("auto")
    backend.check_environment({"capability": None})  # auto: refused only once the model turns out to have experts
    with pytest.raises(UnsupportedEnvironment, match="experts=auto.*the model has MoE experts"):
        backend._convert_experts(_from_hf_config(tiny_config("mixtral"), "bf16", 0), [])
    _backend("none").check_environment({"capability": None})


def test_auto_refuses_only_a_model_that_has_experts():
    backend = _backend("auto", emulate=False)
    backend.check_environment({"capability": (8, 9)})  # no refusal yet: the model may have no experts
    assert backend._convert_experts(_from_hf_config(tiny_config("llama"), "bf16", 0), []) == []
    with pytest.raises(UnsupportedEnvironment, match="has MoE experts"):
        backend._convert_experts(_from_hf_config(tiny_config("mixtral"), "bf16", 0), [])


def test_conversion_switches_the_implementation_and_says_so():
    backend = _backend("mxfp8")
    backend.check_environment({"capability": None})
    model = _from_hf_config(tiny_config("mixtral"), "bf16", 0)
    decisions = [d for d in backend.convert_module(model) if d.fqn.endswith("experts")]
    assert [d.convert for d in decisions] == [True, True]
    assert model.config._experts_implementation == "fp8dist_mxfp8_emulated"
    batch = {"input_ids": torch.randint(0, 256, (2, 32))}
    model(**batch, labels=batch["input_ids"]).loss.backward()
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


def test_an_excluded_or_misshapen_experts_module_keeps_all_experts_and_says_why():
    model = _from_hf_config(tiny_config("mixtral"), "bf16", 0)
    decisions = experts.convert(model, "mxfp8", True, lambda name: "*layers.1*" if ".1." in name else None)
    assert [d.convert for d in decisions] == [False, False]
    assert "excluded by pattern" in decisions[1].reason and "kept with the model's other experts" in decisions[0].reason
    assert model.config._experts_implementation == "grouped_mm"
    odd = tiny_config("mixtral")
    odd.intermediate_size = 48
    decisions = experts.convert(_from_hf_config(odd, "bf16", 0), "mxfp8", True, lambda name: None)
    assert not any(d.convert for d in decisions) and "multiples of 32" in decisions[0].reason


def test_accelerate_cannot_carry_mx_linears_or_fp8_experts():
    from fp8dist.errors import ConfigError
    from fp8dist.formats.accelerate.translate import to_accelerate

    for torchao in ({"recipe_name": "mxfp8"}, {"experts": "mxfp8"}):
        spec = load_config({"engine": "fsdp2", "precision": {"preset": "torchao-float8", "fp8": {"torchao": {
            "emulate": True, **torchao}}}})
        with pytest.raises(ConfigError) as err:
            to_accelerate(spec)
        key = next(iter(torchao))
        assert f"precision.fp8.torchao.{key}" in str(err.value) and "fix:" in str(err.value)


def test_an_nn_linear_router_stays_in_high_precision():
    """Routers are kept in high precision by every FP8 recipe that handles MoE; transformers' afmoe has an
    nn.Linear `gate` beside its `experts`, which the Linear filter would otherwise convert."""
    from fp8dist.backends.module_filter import decide, linear_infos
    from tests.audit_factories import LinearRouterBlock

    decisions = {d.fqn: d for d in decide(linear_infos(torch.nn.Sequential(LinearRouterBlock())), [], False, None)}
    assert not decisions["0.gate"].convert and "MoE router" in decisions["0.gate"].reason
    assert decisions["0.up"].convert and decisions["0.experts.0"].convert
