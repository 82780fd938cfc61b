"""Models the tensor- and expert-parallel tests build by `package.module:factory` (fp8dist.runtime.models), shapes
no built-in has: heads, KV heads, hidden, MLP and vocabulary sizes that split over tp 2 into shards of multiples of 16
(what torchao's float8 GEMMs need); experts that split over ep 2 and 4 with sizes of multiples of 32 (MXFP8)."""
from __future__ import annotations


def unseen_qwen2():
    """A 2-layer Qwen2 (q/k/v biases) of a shape no other test uses: 6 heads over 2 KV heads of 16, hidden 96,
    MLP 160, vocabulary 320, untied embeddings."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fp8dist.runtime.models import causal_lm_batch

    config = Qwen2Config(vocab_size=320, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return {"model": AutoModelForCausalLM.from_config(config), "make_batch": causal_lm_batch(config.vocab_size)}


def unseen_qwen2_qlora():
    """A 2-layer Qwen2 whose Linears split into whole NF4 scaler blocks (64 x 256 values) over 2 ranks: 8 heads over
    4 KV heads of 32, hidden 256, MLP 512, vocabulary 512, untied embeddings."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fp8dist.runtime.models import causal_lm_batch

    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return {"model": AutoModelForCausalLM.from_config(config), "make_batch": causal_lm_batch(config.vocab_size)}


def unseen_qwen2_qlora_704():
    """A 2-layer Qwen2 whose Linears hold no whole number of 64 x 256-value NF4 scaler blocks per shard on 2 ranks:
    MLP 704 (11 x 64), 2 KV heads of 32 (k/v: 64 x 256, one block of 64 x 256 in all), hidden 256, 8 heads."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fp8dist.runtime.models import causal_lm_batch

    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return {"model": AutoModelForCausalLM.from_config(config), "make_batch": causal_lm_batch(config.vocab_size)}


def unseen_qwen3_moe():
    """A 2-layer Qwen3-MoE of a shape no other test uses: 4 experts of 96 x 64, top-2 (every expert's share of the
    tokens differs), 6 heads over 2 KV heads of 16, vocabulary 288, untied embeddings."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from fp8dist.runtime.models import causal_lm_batch

    config = Qwen3MoeConfig(vocab_size=288, hidden_size=96, intermediate_size=128, moe_intermediate_size=64,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, num_hidden_layers=2,
                            num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                            tie_word_embeddings=False)
    return {"model": AutoModelForCausalLM.from_config(config), "make_batch": causal_lm_batch(config.vocab_size)}


def unseen_gpt_oss():
    """A 2-layer gpt-oss: experts stored transposed, (experts, hidden, 2 x intermediate), with per-expert biases (the
    experts layout no other test model has); 4 experts of 64 x 64, top-2, full attention in both layers."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    from fp8dist.runtime.models import causal_lm_batch

    config = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False,
                          layer_types=["full_attention", "full_attention"])
    return {"model": AutoModelForCausalLM.from_config(config), "make_batch": causal_lm_batch(config.vocab_size)}
