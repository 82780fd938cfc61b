"""`fp8dist estimate` with expert parallel (`parallel.expert_size`, the experts' (efsdp, ep) mesh over the dp_shard
ranks): the experts' sharded stores per rank as without it, their gathered weights divided by ep, what each MoE
layer's dispatch keeps and holds in flight, the refusals, and the mesh the output names. Expected figures are
computed from the model's config sizes, not from the estimate; what the dispatch keeps is also measured on the
engine's own TokenDispatch (tests/unit/estimate/one_rank_dispatch.py)."""
import json
import math
import os
import subprocess
import sys

import pytest

from fp8dist.commands.estimate import render_table
from fp8dist.config.load import load_config
from fp8dist.errors import Fp8distError
from fp8dist.estimate.memory import estimate
from fp8dist.estimate.model import build_meta_model
from fp8dist.config.models import tiny_llama_config, tiny_moe_config
from tests.conftest import ROOT, run_cli

FSDP2_BF16 = ROOT / "configs" / "fsdp2-bf16.yaml"  # bf16 compute (2 bytes), micro batch 2 x 64 tokens
COMPUTE_BYTES = 2


def _spec(expert_size: int):
    return load_config(FSDP2_BF16, overrides=[f"parallel.expert_size={expert_size}"])


def _tokens() -> int:
    train = _spec(1).train
    return train.micro_batch_size * train.seq_len


def _experts_per_layer(config) -> int:
    """Elements of one MoE layer's experts: gate_up_proj (E, 2I, H) and down_proj (E, H, I), I the experts' own
    intermediate size (Qwen3-MoE's moe_intermediate_size, Mixtral's intermediate_size)."""
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return experts * 3 * intermediate * config.hidden_size


def _rows(config) -> int:
    """The rows one MoE layer dispatches: a rank's tokens, each to top_k experts."""
    return _tokens() * config.num_experts_per_tok


def _kept_per_layer(config) -> int:
    """The int64 regroup index of the received rows and its inverse, saved by the dispatch's two gathers."""
    return 2 * _rows(config) * 8


def _all_to_all(config) -> int:
    """The send and receive buffers of one MoE layer's all-to-all: tokens x top_k rows of hidden, twice."""
    return 2 * _rows(config) * config.hidden_size * COMPUTE_BYTES


def _block_elements(name: str, index: int) -> int:
    params = build_meta_model(name, "bf16").model.named_parameters()
    return sum(p.numel() for fqn, p in params if fqn.startswith(f"model.layers.{index}."))


@pytest.fixture(scope="module")
def tiny_mixtral():
    return build_meta_model("tiny-mixtral", "bf16").config


@pytest.fixture(scope="module")
def by_ep():
    """tiny-mixtral (8 experts) on 8 ranks, expert parallel 1, 2 and 8."""
    return {ep: estimate("tiny-mixtral", _spec(ep), 8) for ep in (1, 2, 8)}


def test_the_gathered_experts_fall_with_ep_and_the_sharded_stores_stay(tiny_mixtral, by_ep):
    experts = _experts_per_layer(tiny_mixtral)
    dense = _block_elements("tiny-mixtral", 0) - experts  # attention, router, norms: gathered whole
    total = sum(p.numel() for p in build_meta_model("tiny-mixtral", "bf16").model.parameters())
    for ep, result in by_ep.items():
        # the two blocks in flight, each with its dense parameters and the rank's E / ep experts, in bf16
        assert result.transient_bytes.unsharded_units == 2 * (dense + experts // ep) * COMPUTE_BYTES
        # E / ep experts over efsdp = dp_shard / ep ranks: E / dp_shard per rank, as without expert parallel
        assert result.shards == {"weights": 8, "master_weights": 8, "gradients": 8, "optimizer": 8}
        for store in ("weights", "gradients", "optimizer"):
            assert result.per_rank_bytes[store] == math.ceil(total * result.bytes_per_param[store] / 8)
        assert result.expert_parallel.expert_parameters == tiny_mixtral.num_hidden_layers * experts
        assert result.expert_parallel.moe_layers == tiny_mixtral.num_hidden_layers
    assert by_ep[8].transient_bytes.unsharded_units < by_ep[2].transient_bytes.unsharded_units \
        < by_ep[1].transient_bytes.unsharded_units


def test_the_dispatch_is_counted_per_moe_layer_only_with_expert_parallel(tiny_mixtral, by_ep):
    alone, layer, layers = by_ep[1].activations_bytes, _kept_per_layer(tiny_mixtral), tiny_mixtral.num_hidden_layers
    assert by_ep[1].expert_parallel.dispatch_kept == 0 and by_ep[1].transient_bytes.all_to_all == 0
    for ep in (2, 8):  # balanced routing: a rank sends and receives tokens x top_k rows whatever ep is
        act = by_ep[ep].activations_bytes
        assert by_ep[ep].expert_parallel.dispatch_kept == layers * layer
        assert act.none - alone.none == layers * layer
        # the selective policy keeps no index op's output: only the block recomputed in backward holds its indices
        assert act.full_checkpointing - alone.full_checkpointing == layer
        assert act.selective_checkpointing - alone.selective_checkpointing == layer
        # one layer's all-to-all in flight in backward, counted in that phase
        transient = by_ep[ep].transient_bytes
        assert transient.all_to_all == _all_to_all(tiny_mixtral)
        assert by_ep[ep].phases_bytes["backward_pass"] == sum(
            by_ep[ep].per_rank_bytes[store] for store in ("weights", "master_weights", "buffers", "gradients",
                                                           "activations", "fp8_extras")
        ) + transient.unsharded_units + transient.logits_gradient + transient.all_to_all


def test_what_the_dispatch_keeps_is_what_the_engines_token_dispatch_keeps():
    """fp8dist's experts forward with the FSDP2 engine's TokenDispatch (a 1-rank group: every row comes back) keeps
    for backward what the estimate counts beyond a forward without it."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "unit" / "estimate" / "one_rank_dispatch.py"), "tiny-mixtral",
         str(FSDP2_BF16), "parallel.expert_size=2", "train.micro_batch_size=3", "train.seq_len=32"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.splitlines()[-1])
    assert figures["measured"] == figures["estimated"] == 2 * 2 * (3 * 32 * 2) * 8  # 2 layers, 96 tokens, top-2


def test_dense_blocks_and_the_experts_own_intermediate_size_are_told_apart(tmp_path):
    """Qwen3-MoE with one dense MLP block (mlp_only_layers): its experts are moe_intermediate_size wide, not
    intermediate_size; the dense block neither dispatches nor holds experts."""
    config = tiny_moe_config("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    assert config.moe_intermediate_size != config.intermediate_size
    config.save_pretrained(tmp_path)
    result = estimate(str(tmp_path), _spec(4), 8)
    experts = _experts_per_layer(config)
    assert result.expert_parallel.moe_layers == 2
    assert result.expert_parallel.expert_parameters == 2 * experts
    assert result.expert_parallel.dispatch_kept == 2 * _kept_per_layer(config)
    assert result.transient_bytes.all_to_all == _all_to_all(config)
    moe_block, dense_block = _block_elements(str(tmp_path), 0), _block_elements(str(tmp_path), 1)
    blocks = sorted([moe_block - experts + experts // 4, dense_block, moe_block - experts + experts // 4])
    assert result.transient_bytes.unsharded_units == sum(blocks[-2:]) * COMPUTE_BYTES  # the two largest in flight


def test_experts_that_do_not_split_whole_over_ep_are_refused_with_the_fix():
    with pytest.raises(Fp8distError, match=r"8 MoE experts do not split whole over parallel.expert_size=3"):
        estimate("tiny-mixtral", _spec(3), 6)
    with pytest.raises(Fp8distError, match=r"parallel.expert_size=2\b[^\n]*\n  fix: .*parallel.expert_size=1"):
        estimate("tiny-llama", _spec(2), 2)  # a dense model: no experts to split
    result = run_cli("estimate", "tiny-mixtral", "--config", FSDP2_BF16, "--world-size", "6", "parallel.expert_size=3")
    assert result.returncode == 2 and "parallel.expert_size=3" in result.stderr, result.stderr[-2000:]
    assert "fix: a parallel.expert_size that divides 8" in result.stderr and "Traceback" not in result.stderr


def test_a_config_that_names_experts_transformers_does_not_build_is_refused(tmp_path):
    """A dense Llama whose config.json carries a `num_experts` key: the count divides, but there is no experts
    module for expert parallel to split."""
    config = tiny_llama_config()
    config.num_experts = 8
    config.save_pretrained(tmp_path)
    with pytest.raises(Fp8distError, match=r"parallel.expert_size=2: .*LlamaForCausalLM has none\n  fix: "):
        estimate(str(tmp_path), _spec(2), 2)


def test_the_output_names_the_experts_mesh_only_with_expert_parallel(tiny_mixtral, by_ep):
    text = render_table(by_ep[2])
    mesh = "mesh pp 1 x dp_replicate 1 x dp_shard 8 x cp 1 x tp 1, experts efsdp 4 x ep 2"
    assert f"fsdp2 on 8 rank(s) ({mesh})" in text.splitlines()[0]
    divided = next(line for line in text.splitlines() if line.startswith("divided by"))
    assert mesh in divided and "split whole over ep 2, then sharded over efsdp 4" in divided
    assert "of all-to-all buffers (one MoE layer's send and receive" in text
    assert by_ep[2].to_json()["expert_parallel"] == {
        "ep": 2, "efsdp": 4, "expert_parameters": tiny_mixtral.num_hidden_layers * _experts_per_layer(tiny_mixtral),
        "moe_layers": tiny_mixtral.num_hidden_layers,
        "dispatch_kept": tiny_mixtral.num_hidden_layers * _kept_per_layer(tiny_mixtral)}
    plain = render_table(by_ep[1])
    assert "efsdp" not in plain and " ep " not in plain and "all-to-all" not in plain


def test_a_moe_model_is_estimated_in_fp32_too():
    """torch 2.13's meta kernel of the experts' grouped GEMM takes bf16 only; the estimate's meta forward stands in
    for it, so an fp32 run of a MoE model gets an estimate whose activations grow with the wider dtype."""
    activations = {preset: estimate("tiny-mixtral", load_config({"precision": {"preset": preset}}), 2)
                   .activations_bytes.none for preset in ("fp32", "bf16")}
    assert activations["bf16"] < activations["fp32"] < 2.05 * activations["bf16"], activations


def test_deepspeed_expert_parallel_is_not_estimated_as_fsdp2s():
    spec = load_config({"engine": "deepspeed", "parallel": {"expert_size": 2}})
    with pytest.raises(Fp8distError, match="(?s)DeepSpeed's AutoEP keeps its own layer.*fix: engine=fsdp2"):
        estimate("tiny-mixtral", spec, 2)
