"""`fp8dist estimate` of a QLoRA run (adapter.base_dtype: nf4): the frozen Linears that fit NF4's blocks on the shard
count held at NF4's bytes (fp8dist/estimate/frozen.py), checked against what the audit's storage reading measures
on the same model quantized in this process (fp8dist/backends/nf4.py, fp8dist/backends/storage.py), and the rest of
the base at the load dtype."""
from collections import Counter

import pytest
import torch

from fp8dist.audit.probes import bytes_per_param_by_format
from fp8dist.backends.nf4 import quantize_frozen_base
from fp8dist.backends.storage import storage
from fp8dist.config.load import load_config
from fp8dist.dtypes import torch_dtype
from fp8dist.estimate.frozen import frozen_base
from fp8dist.config.parallel import ParallelDims
from fp8dist.estimate.memory import estimate, shard_counts
from fp8dist.estimate.model import adapted_counts, build_meta_model
from fp8dist.backends.adapters import apply_adapter
from tests.conftest import ROOT
from tests.tp_models import unseen_qwen2_qlora

QLORA = ROOT / "configs" / "fsdp2-qlora.yaml"


@pytest.fixture(scope="module")
def qwen2_config_dir(tmp_path_factory):
    """The test model's config.json (the estimate builds a directory's model on the meta device)."""
    path = tmp_path_factory.mktemp("unseen_qwen2_qlora")
    unseen_qwen2_qlora()["model"].config.save_pretrained(path)
    return str(path)


def _quantized_in_process(shards: int):
    """The test model as the run holds its base: loaded in the load dtype, adapted, its frozen Linears that fit
    quantized to NF4 for `shards` ranks; (the frozen parameters, the Linears kept in the load dtype -> why)."""
    spec = load_config(QLORA)
    torch.manual_seed(0)
    model = unseen_qwen2_qlora()["model"].to(torch_dtype(spec.precision.load_dtype))
    model = apply_adapter(model, spec.adapter, spec.precision.weight_dtype, spec.train.seed)
    _, kept = quantize_frozen_base(model, shards)
    return [param for param in model.parameters() if not param.requires_grad], kept


def _measured_by_format(frozen) -> tuple[Counter, Counter]:
    """(bytes, elements) per storage format, read as the audit reads the frozen base (backends/storage.py)."""
    held, elements = Counter(), Counter()
    for param in frozen:
        found = storage(param)
        held[found.format] += found.nbytes
        elements[found.format] += found.numel
    return held, elements


@pytest.mark.parametrize("world", [2, 4])
def test_the_frozen_bytes_match_the_audits_reading_of_the_base_quantized_in_process(qwen2_config_dir, world):
    result = estimate(qwen2_config_dir, load_config(QLORA), world)
    frozen, kept = _quantized_in_process(world)
    held, elements = _measured_by_format(frozen)
    assert set(result.frozen_bytes_by_format) == set(held) == {"bf16", "nf4"}
    assert result.nf4_kept and {item.fqn: item.reason for item in result.nf4_kept} == kept
    for fmt, part in result.frozen_bytes_by_format.items():
        assert part.parameters == elements[fmt]
        assert part.bytes == pytest.approx(held[fmt], rel=0.05)
        assert part.per_rank_bytes * world == pytest.approx(held[fmt], rel=0.05)  # each rank holds its shards
    measured = bytes_per_param_by_format(frozen)  # the audit's frozen_bytes_by_format, of the whole base
    assert result.frozen_bytes_by_format["nf4"].bytes_per_param == pytest.approx(measured["nf4"], rel=0.05)
    assert result.frozen_bytes_by_format["bf16"].bytes_per_param == measured["bf16"] == 2
    assert result.frozen_parameters == sum(elements.values())
    assert result.per_rank_bytes["weights"] > sum(part.per_rank_bytes for part in result.frozen_bytes_by_format.values())


def test_every_frozen_linear_but_the_output_layer_is_nf4_at_any_of_these_shard_counts(qwen2_config_dir):
    """k_proj and v_proj (128 x 256: 512 NF4 blocks) hold 128 per shard on 4 ranks and 64 on 8, q_proj and o_proj
    (1024 blocks) 128 on 8: each quantized with that many scales per scaler block instead of 256, none left 16-bit."""
    spec = load_config(QLORA)
    for world in (2, 4, 8):
        result = estimate(qwen2_config_dir, spec, world)
        assert {item.fqn: item.reason for item in result.nf4_kept} == {
            "lm_head": "the output layer stays in 16 bit, as in QLoRA"}, world
        # the embeddings and lm_head, the norms, q/k/v's biases
        assert result.frozen_bytes_by_format["bf16"].parameters == 2 * 256 * 512 + 5 * 256 + 2 * (256 + 128 + 128)
        assert 0.51 < result.frozen_bytes_by_format["nf4"].bytes_per_param < 0.53, world


def test_a_base_with_no_linear_that_fits_nf4_is_refused_as_the_run_refuses_it(tmp_path):
    from transformers import Qwen2Config

    from fp8dist.errors import Fp8distError

    # every shard of every Linear over 2 ranks: 36 or 18 rows of 72, not whole NF4 blocks of 64 values
    Qwen2Config(vocab_size=96, hidden_size=72, intermediate_size=72, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=36, tie_word_embeddings=False).save_pretrained(tmp_path)
    with pytest.raises(Fp8distError, match=r"(?s)no frozen Linear of .* fits NF4's blocks on 2 shard\(s\).*fix: "
                                           r"adapter.base_dtype=auto"):
        estimate(str(tmp_path), load_config(QLORA), 2)


def test_llama_3_70b_qlora_frozen_base_halves_from_8_to_16_ranks():
    """The estimate's frozen base (frozen.py) on the ranks the engine shards weights over at each world size; the
    70B shape is built on the meta device once for both (most of the time a 70B estimate takes)."""
    spec = load_config(QLORA)
    meta = build_meta_model("llama-3-70b", spec.precision.compute_dtype)
    adapted_counts(meta, spec)
    local = {fqn: param.numel() for fqn, param in meta.model.named_parameters()}  # tp 1: every rank's whole
    eight, sixteen = (frozen_base(meta, spec, local, shard_counts(spec, ParallelDims.of(spec, world))["weights"]) for world in (8, 16))
    nf4 = eight.by_format["nf4"]
    assert [item.fqn for item in eight.nf4_kept] == ["lm_head"]  # every other Linear fits 8 and 16 shards
    assert 34e9 < nf4.bytes < 36e9  # ~68.5B values at 0.516 bytes
    assert nf4.per_rank_bytes == pytest.approx(nf4.bytes / 8, rel=1e-4)
    assert eight.per_rank_bytes == pytest.approx(2 * sixteen.per_rank_bytes, rel=1e-4)
    frozen_at_bf16 = sum(part.parameters for part in eight.by_format.values()) * 2 / 8
    assert eight.per_rank_bytes < 0.3 * frozen_at_bf16  # an NF4 base is about a quarter of a bf16 one
    # the largest NF4 weight, an MLP projection of 28672 x 8192, dequantized whole for its GEMM: 14 bytes a value
    assert eight.dequantize_bytes() == sixteen.dequantize_bytes() == 28672 * 8192 * 14


def test_the_dequantize_transient_is_what_an_nf4_gemm_allocates():
    """fp8dist.facts.torchao NF4_DEQUANTIZE_*: the peak of the bytes one eager GEMM of a 4096 x 4096 bf16 NF4 weight
    allocates (tests/live_bytes.py), against the estimate's count."""
    from torchao.quantization import to_nf4

    from fp8dist.estimate.frozen import nf4_dequantize_bytes
    from tests.live_bytes import LiveBytes

    weight = to_nf4(torch.randn(4096, 4096, dtype=torch.bfloat16), 64, 256)
    x = torch.randn(2, 4096, dtype=torch.bfloat16)
    with LiveBytes(before=(x, weight.quantized_data, weight.quantized_scalers, weight.quantization_factor,
                           weight.scaler_mean, weight.nf4)) as live:
        torch.nn.functional.linear(x, weight)
    assert live.peak == pytest.approx(nf4_dequantize_bytes(4096 * 4096, 2), rel=0.01)
