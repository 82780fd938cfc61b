"""The run's DeviceMesh, built once from its fp8dist.config.parallel.ParallelDims after the process group starts
(the runtime loop builds it and hands it to the engine; an engine set up alone builds it here too)."""
from __future__ import annotations

from fp8dist.config.parallel import ParallelDims


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_device_mesh(dims: ParallelDims):
    """A DeviceMesh over the default process group with the dims of `dims` (ParallelDims.mesh_shape). Named dims,
    so a later axis (cp, tp) is sliced by name: mesh["dp_shard"]."""
    from torch.distributed.device_mesh import init_device_mesh

    names, shape = dims.mesh_shape()
    return init_device_mesh(device_type(), shape, mesh_dim_names=names)



def axis_ranks(mesh) -> dict[frozenset[int], str]:
    """The ranks this rank shares each named dim of `mesh` with -> the dim's name (the audit attributes a collective
    to the axis whose ranks its process group holds). Read from the mesh's rank layout, not its groups' names:
    one process may build several meshes of one shape (the tests do), and names differ where ranks do not."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh
        return {}
    out = {}
    for dim, name in enumerate(mesh.mesh_dim_names or ()):
        index: list = list(coordinate)
        index[dim] = slice(None)
        out[frozenset(mesh.mesh[tuple(index)].flatten().tolist())] = name
    return out

def data_mesh(mesh):
    """The sub-mesh FSDP2 shards over: the data axes (dp_replicate, when in the mesh, and dp_shard), with cp folded
    into the shard axis (torchtitan parallel_dims.py: "fsdp = dp_shard * cp"; FSDP always applies when cp is
    used)."""
    names = mesh.mesh_dim_names or ()
    if "cp" in names:
        shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh["dp_replicate", "dp_shard_cp"] if "dp_replicate" in names else shard
    data = tuple(name for name in ("dp_replicate", "dp_shard") if name in names)
    return mesh if data == names else mesh[data]
