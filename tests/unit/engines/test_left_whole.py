"""Inspector.left_whole: the frozen weights every rank holds whole while FSDP2 shards the others (a bitsandbytes
4-bit base in uint8 storage, which Accelerate keeps out of FSDP2), and nothing where nothing is split."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from fp8dist.engines.inspector import Inspector


@pytest.fixture
def two_ranks():
    """Rank 0 of 2 (torch's fake process group: one process, collectives return at once)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def left_whole(mesh) -> list[str]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fully_shard(model, mesh=mesh, ignored_params={model[1].weight})
    return Inspector("fsdp2", model, None).left_whole(list(model.named_parameters()))


def test_a_weight_left_out_of_fsdp2_is_named(two_ranks):
    assert left_whole(init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))) == ["1.weight"]


def test_a_replicate_mesh_splits_nothing_so_nothing_is_left_whole(two_ranks):
    """HSDP's (2, 1) mesh: placements (Replicate, Shard) over a shard dim of one rank (fp8dist's replicate QLoRA
    keeps its NF4 weights out of FSDP2 there, by design)."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    assert left_whole(mesh) == []


def test_a_module_without_fsdp2_has_nothing_left_whole():
    model = torch.nn.Linear(4, 4)
    assert Inspector("none", model, None).left_whole(list(model.named_parameters())) == []
