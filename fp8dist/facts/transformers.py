"""Hugging Face transformers: what fp8dist's export matches so that the result loads as a save_pretrained
checkpoint."""
from __future__ import annotations

# transformers 5.24 modeling_utils.py PreTrainedModel.save_pretrained: max_shard_size="50GB" (decimal, as
# huggingface_hub serialization/_base.py parse_size_to_int reads "GB": 10**9); fp8dist.runtime.export writes
# safetensors shards of at most this.
HF_MAX_SHARD_BYTES = 50 * 10**9
