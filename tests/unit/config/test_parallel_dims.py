"""ParallelDims: the mesh the config's `parallel` section names on a world size (what the FSDP2 engine shards
over, tests/distributed/test_option_runs.py checks the real meshes), and the data-parallel rank arithmetic that
data loading and the audit use."""
import pytest

from fp8dist import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.errors import Fp8distError


@pytest.mark.parametrize("parallel, world, names, shape", [
    ({}, 4, ("dp_shard",), (4,)),
    ({"sharding": "grad_op"}, 2, ("dp_shard",), (2,)),
    ({"sharding": "hybrid", "shard_size": 2}, 2, ("dp_replicate", "dp_shard"), (1, 2)),
    ({"sharding": "hybrid", "shard_size": 2}, 4, ("dp_replicate", "dp_shard"), (2, 2)),
    ({"sharding": "replicate"}, 2, ("dp_replicate", "dp_shard"), (2, 1)),
    ({"sharding": "replicate"}, 1, ("dp_replicate", "dp_shard"), (1, 1)),
])
def test_the_mesh_of_each_sharding(parallel, world, names, shape):
    dims = ParallelDims.of(load_config({"parallel": parallel}), world)
    assert dims.mesh_shape() == (names, shape)
    assert dims.world_size == dims.data_size == world


def test_data_rank_counts_only_the_data_axes():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=2)
    assert dims.world_size == 8 and dims.data_size == 4
    assert [dims.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # tp ranks share a batch
    assert dims.mesh_shape() == (("dp_replicate", "dp_shard", "tp"), (2, 2, 2))
    with pytest.raises(ValueError, match="outside a world of 8"):
        dims.data_rank(8)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        ParallelDims(tp=0)


@pytest.mark.parametrize("parallel, world, fsdp, divisor, data_dims, enabled", [
    ({}, 4, 4, 1, (("dp_shard",), None), {"dp_shard"}),
    ({"context_size": 2}, 4, 4, 4, (("dp_shard", "cp"), "dp_shard_cp"), {"dp_shard", "cp"}),
    ({"tensor_size": 2}, 4, 2, 2, (("dp_shard",), None), {"dp_shard", "tp"}),  # sequence parallel: auto, on
    ({"tensor_size": 2, "sequence_parallel": False}, 4, 2, 1, (("dp_shard",), None), {"dp_shard", "tp"}),
    ({"sharding": "hybrid", "shard_size": 2, "context_size": 2}, 8, 4, 4,
     (("dp_replicate", "dp_shard", "cp"), "dp_shard_cp"), {"dp_replicate", "dp_shard", "cp"}),
    ({"expert_size": 2}, 4, 4, 1, (("dp_shard",), None), {"dp_shard", "ep"}),
])
def test_every_derived_axis_comes_from_the_one_object(parallel, world, fsdp, divisor, data_dims, enabled):
    """What used to be recomputed at each call site (FSDP over dp_shard x cp, the sequence divisor, which axes are
    on, the dims FSDP shards over) is ParallelDims's."""
    dims = ParallelDims.of(load_config({"parallel": parallel}), world)
    assert dims.fsdp_size == fsdp and dims.seq_len_divisor == divisor
    assert dims.data_mesh_dims() == data_dims
    assert {axis for axis in ("dp_replicate", "dp_shard", "cp", "tp", "ep")
            if getattr(dims, f"{axis}_enabled")} == enabled
    assert dims.sizes == {axis: getattr(dims, axis) for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}


def test_the_model_checks_use_the_resolved_sequence_parallel():
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128}
    split = ParallelDims.of(load_config({"parallel": {"tensor_size": 2}}), 2)
    whole = ParallelDims.of(load_config({"parallel": {"tensor_size": 2, "sequence_parallel": False}}), 2)
    whole.check_model(config, 63, source="m")  # the sequence is not split: any length
    with pytest.raises(Fp8distError, match=r"(?s)train.seq_len=63\) does not divide by 2.*fix: train.seq_len=64"):
        split.check_model(config, 63, source="m")
    with pytest.raises(ValueError, match="sequence_parallel needs tp > 1"):
        ParallelDims(sequence_parallel=True)
