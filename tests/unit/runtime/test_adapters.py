"""adapter.kind=lora: PEFT applied at loading, the FP8 module filter's view of it, and the config's refusals."""
import pytest
import torch

from fp8dist.backends.module_filter import ADAPTER_REASON, base_name, decide, linear_infos
from fp8dist.config.load import load_config
from fp8dist.errors import ConfigError, Fp8distError
from fp8dist.runtime.adapters import apply_adapter, split_parameters
from fp8dist.runtime.loading import load_for_run
from tests.audit_factories import LinearRouterBlock

LORA = {"adapter": {"kind": "lora", "r": 4, "alpha": 8}}


def test_lora_at_loading_freezes_the_base_in_the_load_dtype_and_keeps_names():
    spec = load_config({**LORA, "precision": {"preset": "bf16"}})
    model = load_for_run("tiny-llama", spec).model
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    # auto = PEFT's all-linear: the 7 projections of each of the 2 blocks, not lm_head
    assert len(trainable) == 2 * 7 * 2 and all(".lora_" in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}  # the master dtype
    assert {p.dtype for p in frozen.values()} == {torch.bfloat16}
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in frozen and "lm_head.weight" in frozen
    assert split_parameters(model) == (sum(p.numel() for p in trainable.values()),
                                       sum(p.numel() for p in frozen.values()))
    assert model.fp8dist_lora_config.r == 4


def test_named_targets_and_a_target_the_model_lacks():
    spec = load_config({"adapter": {"kind": "lora", "target_modules": ["q_proj", "v_proj"]}})
    model = load_for_run("tiny-llama", spec).model
    assert sum(p.requires_grad for p in model.parameters()) == 2 * 2 * 2
    spec = load_config({"adapter": {"kind": "lora", "target_modules": ["qkv"]}})
    with pytest.raises(Fp8distError, match=r"(?s)adapter.target_modules=\['qkv'\]: Target modules.*fix: name modules"):
        load_for_run("tiny-llama", spec)


def test_kind_none_changes_nothing():
    spec = load_config({})
    model = load_for_run("tiny-llama", spec).model
    assert apply_adapter(model, spec.adapter, "fp32", 0) is model and all(p.requires_grad for p in model.parameters())


def test_without_masters_the_adapters_take_the_load_dtype():
    spec = load_config({**LORA, "precision": {"preset": "bf16-pure"}})
    model = load_for_run("tiny-llama", spec).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_fp8_filter_skips_adapters_and_matches_exclusions_on_base_names():
    spec = load_config(LORA)
    model = load_for_run("tiny-llama", spec).model
    decisions = {d.fqn: d for d in decide(linear_infos(model), ["model.layers.0.mlp.*"], True, 16)}
    assert decisions["model.layers.0.self_attn.q_proj.lora_A.default"].reason == ADAPTER_REASON
    assert decisions["model.layers.1.self_attn.q_proj.base_layer"].convert
    assert not decisions["model.layers.0.mlp.up_proj.base_layer"].convert  # the pattern names the base model
    # skip_first_last counts the base Linears only
    assert decisions["model.layers.0.self_attn.q_proj.base_layer"].reason.startswith("first/last")
    assert base_name("base_model.model.model.layers.0.mlp.up_proj.base_layer") == "model.layers.0.mlp.up_proj"


@pytest.mark.parametrize("config, key", [
    ({"adapter": {"alpha": 16}}, "adapter.alpha"),
    ({"adapter": {"kind": "lora", "base_dtype": "int8"}}, "adapter.base_dtype"),
    ({"engine": "deepspeed", "adapter": {"kind": "lora", "base_dtype": "nf4"}}, "adapter.base_dtype"),
    ({"adapter": {"kind": "lora"}, "precision": {"preset": "msamp-o1"}}, "precision.fp8.backend"),
    ({"adapter": {"kind": "lora"}, "parallel": {"cpu_ram_efficient_loading": True}},
     "parallel.cpu_ram_efficient_loading"),
])
def test_refusals_name_the_key_the_value_and_a_fix(config, key):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert err.value.exit_code == 2 and f"{key}:" in str(err.value) and "fix:" in str(err.value)


def test_auto_targets_leave_an_nn_linear_router_alone_and_the_seed_fixes_the_adapters():
    """PEFT's all-linear would adapt an MoE router that is an nn.Linear (transformers 5 afmoe's `gate` beside its
    `experts`); fp8dist keeps routers as they are. lora_A's initial values come from the config's seed."""
    spec = load_config(LORA)
    models = [apply_adapter(torch.nn.Sequential(LinearRouterBlock(), torch.nn.Linear(64, 64)), spec.adapter, "fp32", 7)
              for _ in range(2)]
    names = {n for n, p in models[0].named_parameters() if p.requires_grad}
    assert "0.up.lora_A.default.weight" in names and not any(n.startswith("0.gate.") for n in names)
    torch.manual_seed(123)  # whatever the process drew before: the adapters come from the seed
    again = apply_adapter(torch.nn.Sequential(LinearRouterBlock(), torch.nn.Linear(64, 64)), spec.adapter, "fp32", 7)
    for model in (models[1], again):
        assert torch.equal(model.get_submodule("0.up.lora_A.default").weight,
                           models[0].get_submodule("0.up.lora_A.default").weight)


def test_a_model_without_generation_methods_takes_adapters():
    """No task type in fp8dist's LoraConfig: PEFT's causal-LM wrapper would require generation methods."""
    spec = load_config(LORA)
    model = apply_adapter(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                          spec.adapter, "fp32", 0)
    assert any(p.requires_grad for p in model.parameters()) and not all(p.requires_grad for p in model.parameters())
