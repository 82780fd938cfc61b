"""QLoRA's base read tensor by tensor (fp8dist.runtime.loading.load_nf4_base): each Linear weight quantized as it is
read, giving the same model as a full 16-bit load quantized after (the engine's own path)."""
from __future__ import annotations

import pytest
import torch

from fp8dist import load_config
from fp8dist.backends.nf4 import SAVED_MODULE_REASON, is_nf4, quantize_frozen_base
from fp8dist.errors import Fp8distError
from fp8dist.backends.adapters import apply_adapter
from fp8dist.runtime.loading import load_for_run, load_nf4_base
from fp8dist.runtime.models import load_model


def _save(directory, tie: bool = False):
    """unseen Qwen2 shape (tests.tp_models: every Linear splits into whole NF4 blocks on 2 ranks), seeded, in bf16."""
    from transformers import AutoModelForCausalLM

    from tests.tp_models import unseen_qwen2_qlora

    config = unseen_qwen2_qlora()["model"].config
    config.tie_word_embeddings = tie
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(str(directory))
    return str(directory)


def _spec(**adapter):
    return load_config({"engine": "fsdp2", "adapter": {"kind": "lora", "base_dtype": "nf4", **adapter}})


def _plain(model) -> dict[str, torch.Tensor]:
    return {name: (t.get_original_weight() if is_nf4(t) else t.detach())
            for name, t in model.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("tie,saved", [(False, ()), (True, ()), (False, ("o_proj",))])
def test_reading_quantizes_as_the_engine_would_after_a_full_load(tmp_path, tie, saved):
    directory = _save(tmp_path / "model", tie)
    spec = _spec(modules_to_save=list(saved), target_modules=["q_proj", "v_proj"] if saved else "auto")
    read = load_for_run(directory, spec).model
    full = apply_adapter(load_model(directory, "bf16").model, spec.adapter, spec.precision.weight_dtype,
                         spec.train.seed)
    # read: every chosen weight in NF4 already, before the engine's pass (which keeps them)
    already = {name for name, module in read.named_modules() if isinstance(module, torch.nn.Linear)
               and is_nf4(module.weight)}
    chosen_read, kept_read = quantize_frozen_base(read, 2)
    chosen_full, kept_full = quantize_frozen_base(full, 2)
    assert already == set(chosen_read) == set(chosen_full) and len(chosen_full) > 0
    assert read.training == full.training  # from_pretrained's eval mode: dropout acts alike
    assert kept_read == kept_full
    if saved:
        assert {kept_full[name] for name in kept_full if "o_proj" in name} == {SAVED_MODULE_REASON}
    plain_read, plain_full = _plain(read), _plain(full)
    assert plain_read.keys() == plain_full.keys()
    for name, value in plain_full.items():
        assert plain_read[name].dtype == value.dtype and torch.equal(plain_read[name], value), name
    codes = {n: m.weight.quantized_data for n, m in read.named_modules() if n in chosen_read}
    assert all(torch.equal(codes[n], full.get_submodule(n).weight.quantized_data) for n in chosen_full)
    if tie:
        assert read.get_output_embeddings().weight is read.get_input_embeddings().weight
    if saved:  # a trained copy in the fp32 master dtype computes only under the engine's mixed precision
        return
    batch = {"input_ids": torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))}
    with torch.no_grad():
        assert torch.equal(read(**batch).logits, full(**batch).logits)


def test_a_weight_read_as_nf4_that_the_run_cannot_shard_is_refused(tmp_path):
    """Read for 1 shard, run on 1024: the engine names the weight and the fix, rather than failing in FSDP2."""
    directory = _save(tmp_path / "model")
    model = load_nf4_base(tmp_path / "model", _spec(), shards=1).model
    with pytest.raises(Fp8distError, match=r"was quantized to NF4 when the model was read.*\n  fix: load the model"):
        quantize_frozen_base(model, 1024)
    assert directory


def test_files_that_do_not_belong_to_the_config_are_refused(tmp_path):
    import json

    directory = _save(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["intermediate_size"] = 1024
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Fp8distError, match=r"has shape \[512, 256\] in the file and \[1024, 256\] in the model"):
        load_for_run(directory, _spec())


def test_files_read_otherwise_than_by_name_load_whole_and_say_why(tmp_path, capsys):
    """A tensor the model built from config.json lacks (transformers renames such keys as it loads): the directory is
    loaded by transformers and quantized after, and the run says so."""
    from safetensors.torch import load_file, save_file

    directory = _save(tmp_path / "model")
    tensors = load_file(str(tmp_path / "model" / "model.safetensors"))
    tensors["model.norm.gamma"] = tensors.pop("model.norm.weight")  # a legacy name from_pretrained renames
    save_file(tensors, str(tmp_path / "model" / "model.safetensors"), metadata={"format": "pt"})
    assert "model.norm.gamma" in load_nf4_base(tmp_path / "model", _spec(), shards=2)
    model = load_for_run(directory, _spec()).model
    assert "is loaded whole and quantized after, not tensor by tensor" in capsys.readouterr().err
    assert not any(is_nf4(p) for p in model.parameters())  # the engine quantizes it (its usual pass)
    assert torch.equal(model.model.norm.weight, tensors["model.norm.gamma"])


def test_the_audits_loading_row_reads_the_dtype_the_base_was_read_in(tmp_path):
    """loading: the NF4 weights count in the dtype they were read in (frozen_weights reads what they hold)."""
    from fp8dist.commands.audit_worker import loading_cell

    directory = _save(tmp_path / "model")
    cell = loading_cell(load_for_run(directory, _spec()))
    assert cell["observed"] == "bf16" and "values quantized to NF4 as they were read" in cell["detail"], cell


def test_the_engine_trains_a_model_loaded_in_eval_mode(tmp_path):
    """from_pretrained (and the NF4 reader, alike) returns the model in eval mode, where the config's attention
    dropout does nothing (transformers' attention passes dropout=0.0 unless the module is training); FSDP2's prepare
    puts every module in training mode (engines/base.training_mode). PEFT's adapters, made after loading, train
    either way. One process, torch's fake process group of one rank."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fp8dist.engines.fsdp2 import prepare

    spec = load_config({"engine": "fsdp2", "adapter": {"kind": "lora", "dropout": 0.05, "base_dtype": "nf4"}})
    model = load_for_run(_save(tmp_path / "model"), spec).model
    attention = [module for name, module in model.named_modules() if name.endswith("self_attn")]
    assert attention and not model.training and not any(module.training for module in attention)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        run = prepare(model, spec, audit="off")
    finally:
        dist.destroy_process_group()
    assert all(module.training for module in run.model.modules())


def test_a_non_persistent_buffer_in_the_files_is_ignored_as_from_pretrained_does(tmp_path):
    """Older checkpoints hold RoPE's inv_freq, a buffer the model computes (non-persistent): still read tensor by
    tensor, the buffer as the model computed it."""
    from safetensors.torch import load_file, save_file

    directory = _save(tmp_path / "model")
    tensors = load_file(str(tmp_path / "model" / "model.safetensors"))
    tensors["model.rotary_emb.inv_freq"] = torch.zeros(16)
    save_file(tensors, str(tmp_path / "model" / "model.safetensors"), metadata={"format": "pt"})
    model = load_for_run(directory, _spec()).model
    assert any(is_nf4(p) for p in model.parameters()) and model.model.rotary_emb.inv_freq.abs().sum() > 0
