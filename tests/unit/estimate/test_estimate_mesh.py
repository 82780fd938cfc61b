"""`fp8dist estimate` on a mesh with tensor, sequence and context parallel axes: what each store and the activations
are divided by, the refusals, and the figures of one rank of a real FSDP2 x TP layout (tests/unit/estimate/
one_rank_of_a_mesh.py)."""
import json
import os
import subprocess
import sys

import pytest

from fp8dist.config.load import load_config
from fp8dist.errors import Fp8distError
from fp8dist.estimate.memory import estimate
from fp8dist.estimate.model import activation_bytes, build_meta_model
from fp8dist.config.models import tiny_llama_config
from tests.conftest import ROOT, run_cli

FSDP2_BF16 = ROOT / "configs" / "fsdp2-bf16.yaml"


def _spec(config=FSDP2_BF16, **parallel):
    return load_config(config, overrides=[f"parallel.{key}={value}" for key, value in parallel.items()])


def _elements(name: str) -> tuple[int, int]:
    """(elements of the Linears and the vocabulary, elements of the norms) of built-in model `name`, counted by
    parameter name."""
    params = dict(build_meta_model(name, "bf16").model.named_parameters())
    norms = sum(p.numel() for fqn, p in params.items() if "norm" in fqn)
    return sum(p.numel() for p in params.values()) - norms, norms


def test_tensor_parallel_halves_the_split_parameters_bytes_on_the_same_dp_shard():
    split, whole = _elements("tiny-llama")
    alone = estimate("tiny-llama", _spec(), 2)  # dp_shard 2
    with_tp = estimate("tiny-llama", _spec(tensor_size=2), 4)  # dp_shard 2 x tp 2
    assert alone.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}
    assert with_tp.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert with_tp.shards == alone.shards == {"weights": 2, "master_weights": 2, "gradients": 2, "optimizer": 2}
    assert with_tp.tensor_parallel.split_parameters == split and with_tp.tensor_parallel.vocabulary_split
    for store in ("weights", "gradients", "optimizer"):
        per_param = alone.bytes_per_param[store]
        assert alone.per_rank_bytes[store] == (split + whole) * per_param / 2
        assert with_tp.per_rank_bytes[store] == (split / 2 + whole) * per_param / 2
    # the gathered weights of a block in flight are its tp shards
    assert with_tp.transient_bytes.unsharded_units < alone.transient_bytes.unsharded_units


@pytest.mark.parametrize("change", [{"vocab_size": 255}, {"tie_word_embeddings": True}])
def test_what_tensor_parallel_does_not_split_is_not_divided_by_tp(tmp_path, change):
    """An odd vocabulary, or tied embeddings: the embedding and LM head stay whole on every tp rank, as the norms
    do; only the blocks' Linears are divided by tp."""
    tiny_llama_config().__class__(**{**tiny_llama_config().to_dict(), **change}).save_pretrained(tmp_path)
    params = dict(build_meta_model(str(tmp_path), "bf16").model.named_parameters())
    linears = sum(p.numel() for fqn, p in params.items() if "proj" in fqn)
    whole = sum(p.numel() for p in params.values()) - linears
    result = estimate(str(tmp_path), _spec(tensor_size=2), 4)
    assert result.tensor_parallel.split_parameters == linears and not result.tensor_parallel.vocabulary_split
    assert result.per_rank_bytes["weights"] == (linears / 2 + whole) * result.bytes_per_param["weights"] / 2


def test_deepspeed_partitions_over_the_data_parallel_ranks_left_by_tp():
    split, whole = _elements("tiny-llama")
    zero3 = estimate("tiny-llama", _spec(ROOT / "configs" / "deepspeed-bf16-zero3.yaml", tensor_size=2), 8)
    assert zero3.shards == {"weights": 4, "master_weights": 4, "gradients": 4, "optimizer": 4}  # 8 ranks / tp 2
    assert zero3.per_rank_bytes["weights"] == (split / 2 + whole) * zero3.bytes_per_param["weights"] / 4
    zero1 = estimate("tiny-llama", _spec(ROOT / "configs" / "deepspeed-bf16-zero1.yaml", tensor_size=2), 8)
    assert zero1.shards["weights"] == 1  # ZeRO-1 keeps the module's weights whole: the tp shards only
    assert zero1.per_rank_bytes["weights"] == (split / 2 + whole) * zero1.bytes_per_param["weights"]


def test_sequence_parallel_divides_what_the_blocks_keep_outside_attention_and_mlp():
    meta = build_meta_model("tiny-llama", "bf16")
    alone = activation_bytes(meta, _spec())
    tp = activation_bytes(meta, _spec(tensor_size=2, sequence_parallel="false"))
    sp = activation_bytes(meta, _spec(tensor_size=2, sequence_parallel="true"))
    assert sp.kept["none"] < tp.kept["none"] < alone.kept["none"]
    # full checkpointing keeps the blocks' inputs (the residual stream) and what is outside the blocks: whole on
    # every tp rank without sequence parallel, split along the sequence with it
    assert tp.kept["full"] == alone.kept["full"] and sp.kept["full"] < alone.kept["full"]


def test_context_parallel_gives_each_rank_its_share_of_the_sequence_and_folds_into_the_shard_axis():
    cp = estimate("tiny-llama", load_config(FSDP2_BF16, overrides=["parallel.context_size=2", "train.seq_len=64"]), 4)
    shorter = estimate("tiny-llama", load_config(FSDP2_BF16, overrides=["train.seq_len=32"]), 4)
    assert cp.mesh == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1}
    assert cp.shards == shorter.shards == {"weights": 4, "master_weights": 4, "gradients": 4, "optimizer": 4}
    assert cp.activations_bytes == shorter.activations_bytes
    assert cp.transient_bytes.logits_gradient == shorter.transient_bytes.logits_gradient


def test_a_tensor_size_the_model_does_not_split_on_is_refused_naming_the_key():
    with pytest.raises(Fp8distError, match=r"num_key_value_heads=2\) do not divide by parallel.tensor_size=4"):
        estimate("tiny-llama", _spec(tensor_size=4), 4)  # 2 KV heads
    result = run_cli("estimate", "tiny-llama", "--world-size", "6", "parallel.tensor_size=3")
    assert result.returncode == 2 and "parallel.tensor_size=3" in result.stderr, result.stderr[-2000:]
    assert "fix: " in result.stderr and "Traceback" not in result.stderr


def test_the_table_shows_the_mesh_and_what_each_store_was_divided_by():
    from fp8dist.commands.estimate import render_table

    text = render_table(estimate("tiny-llama", _spec(tensor_size=2), 4))
    mesh = "mesh pp 1 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2"
    assert f"fsdp2 on 4 rank(s) ({mesh})" in text.splitlines()[0]
    divided = next(line for line in text.splitlines() if line.startswith("divided by"))
    assert mesh in divided and "by tp 2 x the ranks each store is sharded on" in divided
    assert "(weights 2, master weights 2, gradients 2, optimizer 2)" in divided
    assert "the rest of each block by tp 2 (sequence parallel)" in divided


@pytest.mark.parametrize("sequence_parallel", ["true", "false"])
def test_one_rank_of_a_real_fsdp2_tp_layout_holds_what_the_estimate_says(sequence_parallel):
    """The FSDP2 engine prepares tiny-qwen2 (q/k/v biases: split column-wise) on dp_shard 2 x tp 2, as rank 0 of
    torch's fake process group; the bytes that rank holds equal the estimate's, store by store, and so do the
    activations one forward keeps (every block's tensors at their tp-local sizes)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "unit" / "estimate" / "one_rank_of_a_mesh.py"), "tiny-qwen2",
         str(FSDP2_BF16), "4", "parallel.tensor_size=2", f"parallel.sequence_parallel={sequence_parallel}",
         "train.micro_batch_size=2", "train.seq_len=64"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.splitlines()[-1])
    assert figures["measured"] == figures["estimated"]

