"""The engine-agnostic `parallel` vocabulary: what each value becomes on each engine, conflicts named with
both keys, moved keys, aliases, the notes users get, and what estimate divides by."""
import pytest

from fp8dist.config.load import load_config
from fp8dist.errors import ConfigError
from fp8dist.translate import to_deepspeed, to_fsdp2
from tests.conftest import ROOT


@pytest.mark.parametrize("sharding,stage,reshard,mesh_shard", [
    ("full", 3, True, "world"), ("grad_op", 2, False, "world"), ("replicate", 0, True, 1),
    ("FULL_SHARD", 3, True, "world"), ("SHARD_GRAD_OP", 2, False, "world"), ("NO_SHARD", 0, True, 1),
])
def test_one_strategy_means_the_same_on_both_engines(sharding, stage, reshard, mesh_shard):
    fsdp2 = to_fsdp2(load_config({"parallel": {"sharding": sharding}})).sharding
    assert fsdp2.reshard_after_forward is reshard and fsdp2.shard_size == mesh_shard
    ds = to_deepspeed(load_config({"engine": "deepspeed", "parallel": {"sharding": sharding}}), "0.19.8")
    assert ds["zero_optimization"]["stage"] == stage and "zero_hpz_partition_size" not in ds["zero_optimization"]


def test_hybrid_is_a_2d_mesh_and_zero3_with_hpz():
    values = {"parallel": {"sharding": "HYBRID_SHARD", "shard_size": 8}}
    assert to_fsdp2(load_config(values)).sharding.shard_size == 8
    zero = to_deepspeed(load_config({**values, "engine": "deepspeed"}), "0.19.8")["zero_optimization"]
    assert zero["stage"] == 3 and zero["zero_hpz_partition_size"] == 8


def test_auto_keeps_each_engines_default_and_deepspeed_keys_alone_still_work():
    assert to_fsdp2(load_config({})).sharding.strategy == "full"
    assert load_config({"engine": "deepspeed"}).deepspeed.zero_stage == 2
    assert load_config({"engine": "deepspeed", "deepspeed": {"zero_stage": 1}}).deepspeed.zero_stage == 1


@pytest.mark.parametrize("values,key,says", [
    ({"parallel": {"sharding": "full"}, "deepspeed": {"zero_stage": 2}}, "deepspeed.zero_stage",
     "conflicts with parallel.sharding=full"),
    ({"parallel": {"offload": "params"}, "deepspeed": {"offload_optimizer": "nvme", "nvme_path": "/x"}},
     "deepspeed.offload_optimizer", "conflicts with parallel.offload=params"),
    ({"parallel": {"sharding": "hybrid"}}, "parallel.shard_size", "needs the size of a shard group"),
    ({"parallel": {"sharding": "grad_op", "shard_size": 4}}, "parallel.shard_size", "only hybrid"),
    ({"parallel": {"offload": "optimizer"}}, "parallel.offload", "cannot offload the optimizer alone"),
    ({"fsdp2": {"reshard_after_forward": False}}, "fsdp2.reshard_after_forward",
     "moved to `parallel.sharding` (true is full, false is grad_op)"),
    ({"fsdp2": {"offload": "cpu"}}, "fsdp2.offload", "moved to `parallel.offload` (cpu is params)"),
    ({"parallel": {"sharding": "ZERO3"}}, "parallel.sharding", "ZERO3"),
])
def test_bad_values_name_the_key_the_value_and_the_fix(values, key, says):
    with pytest.raises(ConfigError) as raised:
        load_config({**values, "engine": "deepspeed" if "deepspeed" in values else "fsdp2"})
    text = str(raised.value)
    assert key in text and says in text and "fix:" in text, text


def test_offload_maps_to_deepspeed_keys():
    spec = load_config({"engine": "deepspeed", "parallel": {"sharding": "full", "offload": "params"}})
    assert (spec.deepspeed.offload_optimizer, spec.deepspeed.offload_param) == ("cpu", "cpu")
    zero = to_deepspeed(spec, "0.19.8")["zero_optimization"]
    assert zero["offload_param"] == {"device": "cpu"} and zero["offload_optimizer"] == {"device": "cpu"}
    assert to_fsdp2(load_config({"parallel": {"offload": "params"}})).offload_policy is not None


def test_world_size_check():
    from fp8dist.config.parallel import ParallelDims
    from fp8dist.errors import Fp8distError

    spec = load_config({"parallel": {"sharding": "hybrid", "shard_size": 4}})
    assert ParallelDims.of(spec, 8) == ParallelDims(dp_replicate=2, dp_shard=4, replicate_dim=True)
    with pytest.raises(Fp8distError, match="parallel.shard_size=4 does not divide the 6 ranks"):
        ParallelDims.of(spec, 6)


def test_estimate_divides_fsdp2_stores_by_the_shard_group():
    from fp8dist.config.parallel import ParallelDims
    from fp8dist.estimate.memory import shard_counts

    def counts(values):
        spec = load_config(values)
        return shard_counts(spec, ParallelDims.of(spec, 8))

    assert counts({})["weights"] == 8
    assert counts({"parallel": {"sharding": "hybrid", "shard_size": 4}})["optimizer"] == 4
    assert counts({"parallel": {"sharding": "replicate"}})["weights"] == 1


def test_notes_for_fp8_users():
    from fp8dist.engines.advice import advise

    float8 = {"precision": {"preset": "torchao-float8"}}
    assert advise(load_config(float8), 8, rank=1, cuda=True) == ["fp8-without-compile"]
    assert advise(load_config(float8), 8, rank=1, cuda=False) == []  # on CPU there is no speed to lose
    compiled_ac = load_config({**float8, "compile": True, "parallel": {"activation_checkpointing": "full"}})
    assert advise(compiled_ac, 8, rank=1, cuda=True) == ["fp8-fsdp2-compile-ac"]
    replicated = load_config({**float8, "compile": True, "parallel": {"sharding": "replicate"}})
    assert advise(replicated, 8, rank=1, cuda=True) == ["fp8-replicate-compile"]
    assert advise(load_config({}), 8, rank=1, cuda=True) == []
    # the shipped configs emulate (for the CPU tests): on an H100 that is emulated FP8, no speedup (seen on one)
    emulated = load_config(ROOT / "configs" / "fsdp2-torchao-float8.yaml")
    assert "fp8-emulated-on-fp8-gpu" in advise(emulated, 1, rank=1, cuda=True, capability=(9, 0))
    assert "fp8-emulated-on-fp8-gpu" not in advise(emulated, 1, rank=1, cuda=True, capability=(8, 0))  # A100
    rowwise = load_config(ROOT / "configs" / "fsdp2-torchao-rowwise.yaml")
    assert "fp8-emulated-on-fp8-gpu" not in advise(rowwise, 1, rank=1, cuda=True, capability=(8, 9))  # needs 9.0


def test_a_preset_that_sets_the_stage_conflicts_like_a_written_key():
    with pytest.raises(ConfigError) as raised:
        load_config({"precision": {"preset": "msamp-o3"}, "parallel": {"sharding": "full"}})
    text = str(raised.value)
    assert "(set by preset msamp-o3) conflicts with parallel.sharding=full" in text and "(grad_op)" in text


def test_activation_checkpointing_without_blocks_is_refused():
    import torch

    import fp8dist.engines.activation_checkpointing as activation_checkpointing
    from fp8dist.errors import Fp8distError

    with pytest.raises(Fp8distError, match="has none that fp8dist finds"):
        activation_checkpointing.apply(torch.nn.Linear(4, 4), [], "full")
    assert activation_checkpointing.apply(torch.nn.Linear(4, 4), [], "none") == []
