"""FSDP2's tensor parallel (fp8dist.engines.fsdp2.tensor_parallel), one process: where the plan comes from, what it
refuses, the styles and shards `apply` gives each Linear (rank 0 of a fake 2-rank tp mesh: real shard shapes, no
communication), that a split model on a 1-rank gloo mesh computes what the whole one does, and that the gradient
clipping over mixed DTensor / plain gradients is torch's. The multi-rank runs are tests/distributed's."""
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import AutoModelForCausalLM

from fp8dist.engines.fsdp2.clipping import clip_grad_norm_
from fp8dist.engines.fsdp2.tensor_parallel import (DEFAULT_PLAN, apply, final_norm, model_plan,
                                                   planned_linears, vocabulary_split)
from fp8dist.errors import Fp8distError
from fp8dist.config.models import tiny_config, tiny_llama_config, tiny_moe_config

LAYER_LINEARS = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                 "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                 "mlp.down_proj": "rowwise"}


def _model(config=None, **changes):
    torch.manual_seed(0)
    config = config or tiny_llama_config()
    for key, value in changes.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config)


def _float8(module, recipe: str) -> None:
    """torchao's float8 conversion of `module`'s Linears, emulated (this machine has no FP8 GPU)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(module, config=config)


@pytest.fixture
def fake_tp2():
    """The tp mesh of rank 0 in a world of 2 (torch's fake process group: collectives return at once)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


@pytest.fixture
def gloo_tp1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    dist.destroy_process_group()


# ---- the plan ----

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_transformers_model_brings_its_own_plan(arch):
    model = _model(tiny_config(arch))
    plan, source = model_plan(model)
    assert plan == dict(model.config.base_model_tp_plan)
    assert source == f"{type(model.config).__name__}.base_model_tp_plan"  # not fp8dist's default, equal for Llama
    planned = planned_linears(model.base_model, plan, type(model).__name__)
    layers = model.config.num_hidden_layers
    assert planned.keys() == {f"layers.{i}.{name}" for i in range(layers) for name in LAYER_LINEARS}
    assert all(style == LAYER_LINEARS[fqn.split(".", 2)[2]] for fqn, (style, _) in planned.items())


def test_a_model_without_a_plan_gets_the_llama_style_default():
    plan, source = model_plan(torch.nn.Linear(4, 4))
    assert plan == DEFAULT_PLAN and "has no base_model_tp_plan" in source
    model = _model()
    model.config.base_model_tp_plan = None
    assert model_plan(model)[0] == DEFAULT_PLAN
    assert {fqn.split(".", 2)[2] for fqn in planned_linears(model.base_model, DEFAULT_PLAN, "LlamaForCausalLM")} \
        == set(LAYER_LINEARS)


def test_plan_styles_fp8dist_does_not_apply_are_refused_by_name():
    model = _model(tiny_moe_config("mixtral"))
    with pytest.raises(Fp8distError) as raised:
        planned_linears(model.base_model, model_plan(model)[0], "MixtralForCausalLM")
    text = str(raised.value)
    assert text.startswith("MixtralForCausalLM: its tensor-parallel plan uses moe_tp_experts, packed_colwise, "), text
    assert text.endswith("fix: parallel.tensor_size=1 for this model"), text


def test_a_plan_naming_a_module_that_is_not_a_linear_is_refused():
    model = _model()
    with pytest.raises(Fp8distError, match=r"names layers.0.mlp \(LlamaMLP\) as colwise, but fp8dist splits "
                                           "nn.Linear layers only"):
        planned_linears(model.base_model, {"layers.*.mlp": "colwise"}, "LlamaForCausalLM")


def test_a_model_no_plan_entry_matches_is_refused():
    with pytest.raises(Fp8distError, match=r"^Sequential: no module matches its tensor-parallel plan "
                                           r"\(layers.\*.self_attn.q_proj, "):
        planned_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)), DEFAULT_PLAN, "Sequential")


# ---- apply: styles and shards ----

def test_apply_shards_columns_and_rows_and_gives_float8_styles_to_tensorwise_linears_only(fake_tp2):
    model = _model()
    _float8(model.model.layers[0], "tensorwise")
    _float8(model.model.layers[1], "rowwise")  # torchao's float8 styles would give NaNs here (torchtitan #3109)
    result = apply(model, fake_tp2, sequence_parallel=True)
    assert result.float8_styles == [f"layers.0.{name}" for name in LAYER_LINEARS]
    assert sorted(result.colwise) == sorted(f"layers.{i}.{n}" for i in (0, 1) for n, s in LAYER_LINEARS.items()
                                            if s == "colwise")
    assert len(result.rowwise) == 4 and result.sequence_parallel
    assert result.vocabulary == "vocabulary (256) split over tp 2"
    for layer in model.model.layers:
        q, o = layer.self_attn.q_proj.weight, layer.self_attn.o_proj.weight
        assert isinstance(q, DTensor) and q.placements == (Shard(0),) and q.to_local().shape == (32, 64)
        assert o.placements == (Shard(1),) and o.to_local().shape == (64, 32)
        assert layer.input_layernorm.weight.placements == (Replicate(),)  # sequence parallel's norms
    assert model.model.embed_tokens.weight.to_local().shape == (128, 64)
    assert model.lm_head.weight.placements == (Shard(0),)


@pytest.mark.parametrize("changes, says", [
    ({"tie_word_embeddings": True}, "embedding and LM head whole on each tp rank (tied)"),
    ({"vocab_size": 255}, "embedding and LM head whole on each tp rank (vocabulary 255 does not divide by tp 2)"),
])
def test_the_vocabulary_stays_whole_where_it_cannot_split(fake_tp2, changes, says):
    assert vocabulary_split(_model(), 2) == ("model.embed_tokens", "lm_head")
    model = _model(**changes)
    assert vocabulary_split(model, 2) is None and final_norm(model) == "model.norm"
    assert apply(model, fake_tp2, sequence_parallel=False).vocabulary == says
    assert not isinstance(model.lm_head.weight, DTensor)
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, DTensor)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_a_split_model_computes_what_the_whole_one_does(gloo_tp1, sequence_parallel):
    """Every style, hook and layout change on a 1-rank mesh: the forward, the loss and the gradients are the whole
    model's (the multi-rank equality is tests/distributed's)."""
    model = _model()
    _float8(model.model.layers, "tensorwise")
    whole = copy.deepcopy(model)
    apply(model, gloo_tp1, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    split_out, whole_out = model(input_ids=ids, labels=ids), whole(input_ids=ids, labels=ids)
    torch.testing.assert_close(split_out.logits, whole_out.logits)
    split_out.loss.backward()
    whole_out.loss.backward()
    split_grads = dict(model.named_parameters())
    for name, param in whole.named_parameters():
        grad = split_grads[name].grad
        torch.testing.assert_close(grad.full_tensor() if isinstance(grad, DTensor) else grad, param.grad)
    # sequence parallel runs the norms as DTensors too; without it they stay plain, beside the split Linears'
    # DTensor gradients: a mix torch's clip_grad_norm_ refuses (transformers #36296)
    for norm_weight in (model.model.norm.weight, model.model.layers[0].input_layernorm.weight):
        assert isinstance(norm_weight, DTensor) is sequence_parallel

    # fp8dist's clipping gives torch's norm and clipping
    norm = clip_grad_norm_(model.parameters(), max_norm=0.5)
    expected = torch.nn.utils.clip_grad_norm_(whole.parameters(), max_norm=0.5)
    torch.testing.assert_close(norm, expected)
    assert expected > 0.5  # the clipping acted
    for name, param in whole.named_parameters():
        grad = split_grads[name].grad
        torch.testing.assert_close(grad.full_tensor() if isinstance(grad, DTensor) else grad, param.grad)


# ---- gradient clipping on plain gradients (no process group) ----

def _with_gradients():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4),
                                torch.nn.Linear(4, 4))
    model[3].requires_grad_(False)  # a parameter without a gradient is left out, as torch leaves it out
    model(torch.randn(5, 8)).pow(2).sum().backward()
    return model


@pytest.mark.parametrize("max_norm", [0.1, 1e6])
def test_clip_grad_norm_on_plain_gradients_is_torchs(max_norm):
    ours, torchs, unclipped = _with_gradients(), _with_gradients(), _with_gradients()
    norm = clip_grad_norm_(ours.parameters(), max_norm)
    expected = torch.nn.utils.clip_grad_norm_(torchs.parameters(), max_norm)
    torch.testing.assert_close(norm, expected)
    clipped = float(expected) > max_norm
    for mine, theirs, before in zip(ours.parameters(), torchs.parameters(), unclipped.parameters()):
        assert (mine.grad is None) == (theirs.grad is None)
        if mine.grad is not None:
            torch.testing.assert_close(mine.grad, theirs.grad)
            assert torch.equal(mine.grad, before.grad) is not clipped
