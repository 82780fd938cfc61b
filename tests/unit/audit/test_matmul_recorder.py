"""What the audit's matmul recorder counts as a GEMM of the training."""
import torch

from fp8dist.audit.probes import MatmulRecorder, compute_dtype


def rotary_frequencies_before_transformers_5_2x(inv_freq, position_ids):
    """transformers 5.17 LlamaRotaryEmbedding.forward (and every 4.x): the positions' frequencies as an fp32
    matmul whose inner dimension is 1, autocast off. Seen on an H100 image (transformers 5.17.0) as `training
    bf16+fp32 MISMATCH` before the recorder left outer products out."""
    inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    position_ids_expanded = position_ids[:, None, :].float()
    return (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)


def test_an_outer_product_is_not_a_gemm_of_the_training():
    linear = torch.nn.Linear(16, 16, dtype=torch.bfloat16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    with MatmulRecorder() as recorder:
        freqs = rotary_frequencies_before_transformers_5_2x(inv_freq, torch.arange(12)[None])
        linear(torch.randn(3, 16, dtype=torch.bfloat16))
    assert freqs.shape == (1, 12, 4)
    _, other = recorder.split()
    assert compute_dtype(other)[0] == "bf16", other


def test_an_fp32_gemm_is_still_seen():
    with MatmulRecorder() as recorder:
        torch.randn(4, 2) @ torch.randn(2, 3)  # inner dimension 2: a GEMM, however small
        torch.addmm(torch.zeros(4, 3), torch.randn(4, 1), torch.randn(1, 3))  # inner 1: an outer product
    _, other = recorder.split()
    assert sum(other.values()) == 1 and compute_dtype(other)[0] == "fp32", other
