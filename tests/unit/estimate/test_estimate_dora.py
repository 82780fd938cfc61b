"""`fp8dist estimate` of a DoRA run (adapter.use_dora): the forward transient of the largest adapted Linear
(fp8dist/estimate/dora.py), against what PEFT's DoRA layer allocates."""
import pytest
import torch

from fp8dist.config.load import load_config
from fp8dist.estimate.memory import estimate


def test_the_dora_transient_is_what_a_dora_forward_allocates():
    """fp8dist/estimate/dora.py: one DoRA Linear's forward (8192 in, 2048 out, bf16 as under mixed precision): the peak
    of what it allocates beyond its weights and input, against the estimate's count for the same module."""
    from peft import LoraConfig, get_peft_model

    from fp8dist.estimate.dora import dora_transient_bytes
    from tests.live_bytes import LiveBytes

    class Projection(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8192, 2048, bias=False)

        def forward(self, x):
            return self.proj(x)

    model = get_peft_model(Projection(), LoraConfig(r=16, target_modules=["proj"], use_dora=True)).to(torch.bfloat16)
    x = torch.randn(4, 8192, dtype=torch.bfloat16)
    with LiveBytes(before=(x, *model.parameters())) as live:
        model(x)
    assert live.peak == pytest.approx(dora_transient_bytes(model, 2), rel=0.01)
    assert dora_transient_bytes(Projection(), 2) == 0  # no DoRA layer, nothing counted


def test_the_estimate_counts_the_largest_adapted_linear():
    """tiny-llama (hidden 64, MLP 128): down_proj, 128 in x 64 out, has the largest in^2 + 3 x in x out, in bf16."""
    spec = load_config({"engine": "fsdp2", "precision": {"preset": "bf16"}, "adapter": {"kind": "lora", "use_dora": True}})
    with_dora = estimate("tiny-llama", spec, 2)
    assert with_dora.transient_bytes.dora == (128 * 128 + 3 * 128 * 64) * 2
    plain = estimate("tiny-llama", load_config({"engine": "fsdp2", "precision": {"preset": "bf16"},
                                                "adapter": {"kind": "lora"}}), 2)
    assert plain.transient_bytes.dora == 0
    assert with_dora.phases_bytes["backward_pass"] - plain.phases_bytes["backward_pass"] >= with_dora.transient_bytes.dora


@pytest.mark.parametrize("use_dora", [False, True])
def test_activations_are_what_the_forward_leaves_alive(use_dora):
    """The estimate's `none` bytes equal what a real bf16 forward of the adapted model leaves alive for backward
    (tests/live_bytes.py, the loss held). DoRA's identity matrices are saved by autograd for a graph the loss does not
    reach, and die with the layer's forward: counted at save time, they would add in^2 per adapted Linear."""
    from fp8dist.estimate.model import activation_bytes, adapted_counts, build_meta_model
    from fp8dist.backends.adapters import apply_adapter
    from fp8dist.runtime.models import load_model
    from tests.live_bytes import LiveBytes

    spec = load_config({"engine": "fsdp2", "precision": {"preset": "bf16", "master_weights": "bf16"},
                        "adapter": {"kind": "lora", "use_dora": use_dora}, "train": {"micro_batch_size": 2,
                                                                                     "seq_len": 64}})
    meta = build_meta_model("tiny-llama", "bf16")
    adapted_counts(meta, spec)
    counted = activation_bytes(meta, spec).kept["none"]
    model = apply_adapter(load_model("tiny-llama", "bf16").model, spec.adapter, "bf16", 0)
    ids = torch.randint(0, model.config.vocab_size, (2, 64))
    with LiveBytes(before=(ids, *model.parameters(), *model.buffers())) as live:
        loss = model(input_ids=ids, labels=ids).loss
    assert loss.requires_grad and counted == pytest.approx(live.live, rel=0.01)


def test_an_adapted_embedding_builds_no_identity():
    """PEFT's DoraEmbeddingLayer makes its update as lora_A @ lora_B: three vocabulary x dim copies, no V x V identity
    (tiny-llama: vocabulary 256, dim 64, against down_proj's 128^2 + 3 x 128 x 64)."""
    spec = load_config({"engine": "fsdp2", "precision": {"preset": "bf16"},
                        "adapter": {"kind": "lora", "use_dora": True, "target_modules": ["embed_tokens", "down_proj"]}})
    assert estimate("tiny-llama", spec, 2).transient_bytes.dora == max(3 * 256 * 64, 128 * 128 + 3 * 128 * 64) * 2
