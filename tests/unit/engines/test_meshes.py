"""engines.mesh.build_meshes: the one place the run's DeviceMeshes are built and sliced by name (a fake process
group of N ranks: the meshes' shapes and rank layout, no collective)."""
import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from fp8dist import load_config
from fp8dist.config.parallel import ParallelDims
from fp8dist.engines.mesh import build_meshes


@pytest.fixture
def world():
    def start(size: int, rank: int = 0):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    yield start
    dist.destroy_process_group()


@pytest.mark.parametrize("parallel, size, data, tp, cp", [
    ({}, 4, ("dp_shard", 4), None, None),
    ({"tensor_size": 2}, 4, ("dp_shard", 2), 2, None),
    ({"context_size": 2}, 4, ("dp_shard_cp", 4), None, 2),
    ({"sharding": "hybrid", "shard_size": 2, "context_size": 2}, 8, (("dp_replicate", "dp_shard_cp"), (2, 4)),
     None, 2),
])
def test_each_axis_gets_its_sub_mesh_and_fsdp_shards_over_dp_shard_times_cp(world, parallel, size, data, tp, cp):
    world(size)
    meshes = build_meshes(ParallelDims.of(load_config({"parallel": parallel}), size))
    names, sizes = data
    if isinstance(names, str):
        assert meshes.data.mesh_dim_names == (names,) and meshes.data.size() == sizes
    else:
        assert meshes.data.mesh_dim_names == names and tuple(meshes.data.mesh.shape) == sizes
    assert (meshes.tp.size() if meshes.tp is not None else None) == tp
    assert (meshes.cp.size() if meshes.cp is not None else None) == cp
    assert meshes.experts is None and meshes.expert_data is None and meshes.all() == [meshes.dense]


def test_expert_parallel_gets_its_own_mesh_over_the_dp_shard_ranks(world):
    world(4, rank=1)
    meshes = build_meshes(ParallelDims.of(load_config({"parallel": {"expert_size": 2}}), 4))
    assert meshes.experts.mesh_dim_names == ("efsdp", "ep")
    assert meshes.expert_parallel.size() == 2 and meshes.expert_data.size() == 2
    assert sorted(meshes.expert_parallel.mesh.tolist()) == [0, 1]  # rank 1's ep group: neighbours, ep innermost
    assert len(meshes.all()) == 2
