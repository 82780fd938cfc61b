"""Hugging Face transformers: what fp8dist's export matches so that the result loads as a save_pretrained
checkpoint, and how it lays out what it saves."""
from __future__ import annotations

# transformers 5.24 modeling_utils.py PreTrainedModel.save_pretrained: max_shard_size="50GB" (decimal, as
# huggingface_hub serialization/_base.py parse_size_to_int reads "GB": 10**9); fp8dist.runtime.export writes
# safetensors shards of at most this.
HF_MAX_SHARD_BYTES = 50 * 10**9

# transformers 5 keeps a MoE layer's experts as 3-D parameters in memory but converts them to and from the
# checkpoint's one-tensor-per-expert layout when it loads and saves (transformers 5.24 conversion_mapping.py, e.g.
# Mixtral's block_sparse_moe.experts.N.w1/w2/w3): a file's tensor names and shapes are not the model's.
HF_MOE_CHECKPOINT_LAYOUT = ("its files hold one tensor per expert (transformers 5 converts its 3-D experts to and "
                            "from that layout, transformers/conversion_mapping.py)")
