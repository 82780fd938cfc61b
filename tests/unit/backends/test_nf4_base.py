"""The NF4 base of `adapter.base_dtype: nf4` (fp8dist/backends/nf4.py) below the engine: which Linears it quantizes
on a real PEFT-adapted Llama, what the audit reads back as their bytes, and the export's dequantized base. The
2-rank runs: tests/distributed/test_qlora.py."""
import pytest
import torch

from fp8dist.backends.nf4 import dequantize_like_training, nf4_unfit, quantize_frozen_base
from fp8dist.backends.storage import storage


@pytest.mark.parametrize("shape, shards, fits", [((256, 256), 2, True), ((128, 256), 2, True),
                                                  ((128, 128), 2, True), ((64, 64), 1, True), ((704, 256), 2, True),
                                                  ((64, 256), 2, True), ((3, 256), 2, False), ((2, 96), 2, False)])
def test_a_weight_fits_nf4_when_its_rows_split_over_the_shards_into_whole_nf4_blocks(shape, shards, fits):
    assert (nf4_unfit(*shape, shards) is None) == fits


@pytest.mark.parametrize("shape, shards, scaler_block", [((256, 256), 2, 256), ((704, 256), 2, 176),
                                                         ((256, 704), 2, 176), ((64, 256), 2, 128),
                                                         ((128, 896), 2, 224), ((64, 64), 1, 64)])
def test_a_weight_quantizes_whole_with_the_largest_scaler_block_a_shard_holds_whole(shape, shards, scaler_block):
    """torchao's NF4Tensor of the whole weight, split by rows as FSDP2 splits it: every shard holds whole scaler
    blocks, and the shards put back together dequantize to the whole weight's values."""
    from fp8dist.backends.nf4 import nf4_of, nf4_scaler_block

    assert nf4_scaler_block(*shape, shards) == scaler_block
    torch.manual_seed(0)
    weight = torch.randn(*shape, dtype=torch.bfloat16)
    nf4 = nf4_of(weight, shards)
    assert nf4.scaler_block_size == scaler_block and nf4.block_size == 64
    pieces = torch.chunk(nf4, shards, dim=0)  # NF4Tensor's aten.split: what FSDP2's sharding runs
    assert all(piece.quantization_factor.numel() * scaler_block * 64 == piece.numel() for piece in pieces)
    whole = nf4.get_original_weight()
    assert torch.equal(torch.cat([piece.get_original_weight() for piece in pieces]), whole)
    assert 0 < (whole.float() - weight.float()).abs().max() / weight.abs().max() < 0.2


def _adapted_llama(targets=("q_proj", "v_proj"), tied=False):
    from transformers import AutoModelForCausalLM

    from fp8dist.config.spec import AdapterSpec
    from fp8dist.backends.adapters import apply_adapter
    from fp8dist.config.models import small_llama_config

    torch.manual_seed(0)
    config = small_llama_config()
    config.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    adapter = AdapterSpec(kind="lora", r=4, alpha=8, dropout=0.0, target_modules=targets, base_dtype="nf4")
    return apply_adapter(model, adapter, "fp32", seed=0)


def test_the_frozen_linears_but_the_output_layer_become_nf4_and_read_back_at_their_bytes():
    model = _adapted_llama()
    before = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    quantized, kept = quantize_frozen_base(model, shards=2)
    assert kept == {"lm_head": "the output layer stays in 16 bit, as in QLoRA"}
    assert len(quantized) == 4 * 7  # q/v as .base_layer under their adapters, the other five as they are
    assert "model.layers.0.self_attn.q_proj.base_layer" in quantized
    assert not any("lora_" in name for name in quantized)  # adapters train in their own dtype
    weight = model.model.layers[0].mlp.down_proj.weight
    assert type(weight).__name__ == "NF4Tensor" and not weight.requires_grad and weight.dtype == torch.bfloat16
    held = storage(weight)  # the appearance dtype says bf16; the storage is codes and scales
    assert held.format == "nf4" and held.numel == before.numel()
    assert held.nbytes == before.numel() // 2 + before.numel() // 64 + 2 * (before.numel() // (64 * 256)) + 2 + 32
    error = (weight.get_original_weight().float() - before.float()).abs().max() / before.abs().max()
    assert 0 < error < 0.2  # 4-bit codes: real rounding, bounded by a block's scale
    ids = torch.randint(0, 1024, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.lora_B.default.weight.grad is not None
    assert weight.grad is None


def test_the_export_base_is_the_dequantized_one_the_run_computed_with():
    model = _adapted_llama()
    quantize_frozen_base(model, shards=2)
    trained = model.model.layers[1].mlp.up_proj.weight.get_original_weight()
    from transformers import AutoModelForCausalLM

    from fp8dist.config.models import small_llama_config

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(small_llama_config()).to(torch.bfloat16)
    lm_head = base.lm_head.weight.detach().clone()
    assert len(dequantize_like_training(base, shards=2)) == 4 * 7
    assert torch.equal(base.model.layers[1].mlp.up_proj.weight, trained)
    assert torch.equal(base.lm_head.weight, lm_head)


@pytest.mark.parametrize("tied", [False, True])
def test_an_output_layer_lora_adapts_stays_16_bit_and_tied(tied):
    model = _adapted_llama(targets=("q_proj", "lm_head"), tied=tied)
    quantized, kept = quantize_frozen_base(model, shards=2)
    assert "lm_head.base_layer" in kept and not any(name.startswith("lm_head") for name in quantized)
    assert type(model.lm_head.base_layer.weight).__name__ == "Parameter"
    if tied:
        assert model.lm_head.base_layer.weight is model.model.embed_tokens.weight
