"""The model shapes `fp8dist estimate` builds by name: the config.json of public checkpoints, without weights (what
users name most). The CLI's help and the estimate's errors list these names from here."""
from __future__ import annotations

from typing import Any

# name -> the Hub model whose config.json it is: `fp8dist estimate` takes that id for the shape, without the network.
HUB_IDS: dict[str, str] = {"llama-3-8b": "meta-llama/Meta-Llama-3-8B", "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
                           "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1", "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
                           "bert-base-cased": "google-bert/bert-base-cased"}
# name -> the checkpoint's config.json (HUB_IDS: whose); `model_type` picks transformers' config class.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
                   "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                   "tie_word_embeddings": False},
    "llama-3-70b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
                    "hidden_size": 8192, "intermediate_size": 28672,
                    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                    "tie_word_embeddings": False},
    # 46.70B parameters, 12.88B active per token
    "mixtral-8x7b": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 32000,
                     "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                     "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    # 30.53B parameters
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
                      "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                      "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    # the base model, as Accelerate's estimate-memory counts it
    "bert-base-cased": {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 28996,
                        "hidden_size": 768, "num_hidden_layers": 12,
                        "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 512,
                        "type_vocab_size": 2},
}
