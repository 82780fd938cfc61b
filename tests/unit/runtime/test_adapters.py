"""adapter.kind=lora: PEFT applied at loading, the FP8 module filter's view of it, and the config's refusals."""
import pytest
import torch

from fp8dist.backends.module_filter import ADAPTER_REASON, base_name, decide, linear_infos
from fp8dist.config.load import load_config
from fp8dist.errors import ConfigError, Fp8distError
from fp8dist.backends.adapters import apply_adapter, split_parameters
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


# -- adapter.modules_to_save: whole modules trained beside the adapters (PEFT's ModulesToSaveWrapper) --------------
def _step(model, spec):
    """One AdamW step of `model` on a tiny-llama batch (the trainable parameters only, as the engines build it)."""
    from fp8dist.runtime.models import causal_lm_batch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = causal_lm_batch(256)(2, 16, spec.train.seed)
    model(**batch).loss.backward()
    optimizer.step()


def test_modules_to_save_train_whole_and_export_as_peft_saves_them(tmp_path):
    """lm_head trained whole beside the adapters: a trainable copy in the master dtype next to PEFT's frozen original;
    the adapter export is a directory PeftModel loads to the same logits, the merged export a model transformers
    loads with the trained lm_head."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fp8dist.backends.adapters import trained_beside_base
    from fp8dist.runtime.adapter_files import write_adapter, write_merged
    from fp8dist.runtime.models import load_model

    spec = load_config({"adapter": {"kind": "lora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                    "modules_to_save": ["lm_head"]}, "precision": {"preset": "fp32"}})
    model = load_for_run("tiny-llama", spec).model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if trained_beside_base(n)}
    assert "lm_head.modules_to_save.default.weight" in trainable and len(trainable) == 2 * 2 * 2 + 1
    frozen = dict(model.named_parameters())["lm_head.original_module.weight"]
    assert not frozen.requires_grad and model.fp8dist_lora_config.modules_to_save == ["lm_head"]
    before = frozen.detach().clone()
    _step(model, spec)
    trained = model.get_submodule("lm_head.modules_to_save.default").weight
    assert not torch.equal(trained, before) and torch.equal(frozen, before)

    tensors = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    adapter_dir.mkdir()
    write_adapter(tensors, spec.to_dict(), "tiny-llama", adapter_dir)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert torch.equal(saved["base_model.model.lm_head.weight"], trained)  # PEFT's key for a module to save
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        base = load_model("tiny-llama", "fp32", seed=spec.train.seed).model
        loaded = PeftModel.from_pretrained(base, str(adapter_dir))
        torch.testing.assert_close(loaded(input_ids=ids).logits, want)

    write_merged(adapter_dir, spec.to_dict(), "tiny-llama", "fp32", merged_dir)
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir))
    assert torch.equal(merged.lm_head.weight, trained)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want)


def test_a_module_to_save_the_model_lacks_or_ties_is_refused_at_load():
    """PEFT skips a name it matches nowhere and matches the end of any module name; a tied output layer would be
    untied by PEFT's copy (tie_word_embeddings): each refused naming the key."""
    from transformers import AutoModelForCausalLM

    from fp8dist.config.models import _llama_config

    for names, says in ((["score"], "no module of LlamaForCausalLM is named 'score'"),
                        (["head"], "would also train lm_head whole")):
        spec = load_config({"adapter": {"kind": "lora", "modules_to_save": names}})
        with pytest.raises(Fp8distError, match=rf"(?s)adapter.modules_to_save=.*{says}.*fix:"):
            load_for_run("tiny-llama", spec)
    spec = load_config({"adapter": {"kind": "lora", "modules_to_save": ["embed_tokens", "lm_head"]}})
    tied = AutoModelForCausalLM.from_config(_llama_config(tie_word_embeddings=True))
    with pytest.raises(Fp8distError, match=r"(?s)embed_tokens.weight is tied to lm_head.weight.*tie_word_embeddings"
                                           r".*fix: train a copy of the model saved untied"):
        apply_adapter(tied, spec.adapter, "fp32", 0)


def test_auto_targets_train_a_module_to_save_whole_and_nf4_leaves_both_copies():
    """Under target_modules auto PEFT puts no adapter on a module to save; an NF4 base leaves its frozen original in
    the load dtype (fp8dist/backends/nf4.py), and its trained copy is no frozen Linear."""
    from fp8dist.backends.nf4 import SAVED_MODULE_REASON, nf4_linears, nf4_unfit

    spec = load_config({"adapter": {"kind": "lora", "base_dtype": "nf4", "modules_to_save": ["o_proj", "lm_head"]},
                        "precision": {"preset": "bf16"}})
    model = load_for_run("tiny-llama", spec).model
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.0.self_attn.o_proj.modules_to_save.default.weight" in names
    assert not any(n.startswith("model.layers.0.self_attn.o_proj.") and ".lora_" in n for n in names)
    chosen, kept = nf4_linears(model, shards=1)
    for name in ("model.layers.0.self_attn.o_proj.original_module", "lm_head.original_module"):
        assert kept[name] == SAVED_MODULE_REASON and name not in chosen
    assert not any(".modules_to_save." in name for name in chosen)
    assert nf4_unfit(256, 64, shards=1) is None  # lm_head's frozen original would fit NF4's blocks: left alone


@pytest.mark.parametrize("config, says", [
    ({"adapter": {"modules_to_save": ["lm_head"]}}, "adapter settings do nothing with adapter.kind=none"),
    ({"adapter": {"kind": "lora", "target_modules": ["q_proj", "lm_head"], "modules_to_save": ["lm_head"]}},
     "lm_head also in adapter.target_modules"),
    ({"adapter": {"kind": "lora", "modules_to_save": ["lm_head"]}, "precision": {"preset": "torchao-float8"}},
     "would convert the trained copy"),
])
def test_modules_to_save_refusals_name_the_key_and_a_fix(config, says):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert err.value.exit_code == 2 and "adapter.modules_to_save:" in str(err.value) and says in str(err.value)
    assert "fix:" in str(err.value)


def test_the_adapter_export_records_the_bases_quantization_in_its_model_card(tmp_path):
    """adapter_config.json has no field for it: PEFT records the quantization used in training in the model card
    (peft 0.21 create_or_update_model_card); loading the adapter onto a 16-bit base is then a choice, not a surprise."""
    from huggingface_hub import ModelCard

    from fp8dist.runtime.adapter_files import write_adapter
    from tests.conftest import ROOT

    qlora, lora = tmp_path / "qlora", tmp_path / "lora"
    qlora.mkdir()
    lora.mkdir()
    write_adapter({}, load_config(ROOT / "configs" / "fsdp2-qlora.yaml").to_dict(), "org/base: v1", qlora)
    write_adapter({}, load_config({"adapter": {"kind": "lora"}}).to_dict(), "tiny-llama", lora)
    card = ModelCard.load(qlora / "README.md")
    assert card.data.library_name == "peft" and card.data.base_model == "org/base: v1"
    assert ("torchao NF4 (`torchao.quantization.to_nf4`, block_size 64, scaler_block_size 256, or the largest count "
            "under it that divides a shard's blocks)") in card.text
    plain = ModelCard.load(lora / "README.md")
    assert plain.data.base_model == "tiny-llama" and "frozen base during training: bf16" in plain.text
    assert "NF4" not in plain.text


def test_modules_to_save_that_peft_would_match_beyond_their_meaning_are_refused():
    """PEFT matches modules to save by the end of every name once LoRA is in (`dropout` would train each
    lora_dropout whole), and puts no adapter on a listed target inside a saved module."""
    for adapter, says in (({"target_modules": ["q_proj"], "modules_to_save": ["dropout"]},
                           "would also train PEFT's own lora_dropout modules whole"),
                          ({"target_modules": ["q_proj", "up_proj"], "modules_to_save": ["self_attn"]},
                           "model.layers.0.self_attn.q_proj and 1 more lie inside a module trained whole")):
        with pytest.raises(Fp8distError, match=rf"(?s){says}.*fix:"):
            load_for_run("tiny-llama", load_config({"adapter": {"kind": "lora", **adapter}}))


def test_an_nf4_base_keeps_every_linear_of_a_saved_block_in_its_dtype():
    from fp8dist.backends.nf4 import SAVED_MODULE_REASON, nf4_linears
    from tests.tp_models import unseen_qwen2_qlora

    spec = load_config({"adapter": {"kind": "lora", "target_modules": ["q_proj"], "modules_to_save": ["mlp"]}})
    model = apply_adapter(unseen_qwen2_qlora()["model"], spec.adapter, "fp32", 0)
    chosen, kept = nf4_linears(model, 2)
    inside = {name for name in kept if ".mlp.original_module." in name}
    assert len(inside) == 6 and {kept[name] for name in inside} == {SAVED_MODULE_REASON}
    assert not [name for name in chosen if ".mlp." in name] and "model.layers.0.self_attn.k_proj" in chosen
