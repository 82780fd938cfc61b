"""ParallelDims: the mesh the config's `parallel` section names on a world size (what the FSDP2 engine shards
over, tests/distributed/test_option_runs.py checks the real meshes), and the data-parallel rank arithmetic that
data loading and the audit use."""
import pytest

from fp8dist import load_config
from fp8dist.config.parallel import ParallelDims, parallel_dims


@pytest.mark.parametrize("parallel, world, names, shape", [
    ({}, 4, ("dp_shard",), (4,)),
    ({"sharding": "grad_op"}, 2, ("dp_shard",), (2,)),
    ({"sharding": "hybrid", "shard_size": 2}, 2, ("dp_replicate", "dp_shard"), (1, 2)),
    ({"sharding": "hybrid", "shard_size": 2}, 4, ("dp_replicate", "dp_shard"), (2, 2)),
    ({"sharding": "replicate"}, 2, ("dp_replicate", "dp_shard"), (2, 1)),
    ({"sharding": "replicate"}, 1, ("dp_replicate", "dp_shard"), (1, 1)),
])
def test_the_mesh_of_each_sharding(parallel, world, names, shape):
    dims = parallel_dims(load_config({"parallel": parallel}), world)
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
