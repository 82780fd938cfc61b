"""`fp8dist estimate` of an adapter run: the frozen base counts its weights only, the adapters every store."""
from fp8dist.estimate.memory import estimate
from fp8dist.config.load import load_config

MIB = 2 ** 20


def test_llama_3_8b_lora_r16_on_8_ranks_needs_mibs_of_optimizer_state_not_gibs():
    lora = estimate("llama-3-8b", load_config({"engine": "deepspeed", "deepspeed": {"zero_stage": 3},
                                               "adapter": {"kind": "lora", "r": 16}}), 8)
    full = estimate("llama-3-8b", load_config({"engine": "deepspeed", "deepspeed": {"zero_stage": 3}}), 8)
    # r=16 on the 7 projections of 32 blocks: 16 * (in + out) each (PEFT's all-linear)
    assert lora.trainable_parameters == 41_943_040
    assert lora.frozen_parameters == full.parameters  # the whole base; the adapters come on top
    assert lora.frozen_bytes_per_param == 2.0  # the bf16 base under DeepSpeed's bf16 section
    per_rank = lora.per_rank_bytes
    assert per_rank["optimizer"] < 50 * MIB < full.per_rank_bytes["optimizer"] / 100
    assert per_rank["gradients"] < 20 * MIB
    # the frozen base's bf16 weights, sharded 8 ways, dominate
    assert abs(per_rank["weights"] - full.parameters * 2 / 8) < 0.01 * per_rank["weights"]
