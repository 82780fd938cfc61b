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



def build_expert_mesh(dims: ParallelDims):
    """The experts' DeviceMesh, (efsdp, ep) over the dp_shard ranks (ParallelDims.expert_mesh_shape); None without
    expert parallel. Its own mesh (a root of its own): the experts' DTensors and their FSDP2 sharding both live on
    it, while the dense layers stay on `build_device_mesh`'s."""
    from torch.distributed.device_mesh import init_device_mesh

    if dims.ep == 1:
        return None
    if dims.world_size != dims.dp_shard:
        raise ValueError(f"expert parallel borrows dp_shard's ranks; this mesh has other axes ({dims})")
    names, shape = dims.expert_mesh_shape()
    return init_device_mesh(device_type(), shape, mesh_dim_names=names)


EXPERT_AXIS = "ep"
SHARED_AXES = "|"  # joins the names of axes whose groups hold the same ranks (`merge_axes`)


def merge_axes(axes: dict[frozenset[int], str], more: dict[frozenset[int], str]) -> None:
    """Add `more` to `axes`; a group of ranks already known under another axis keeps both names (expert parallel over
    all the dp_shard ranks: ep's group is dp_shard's), and `axis_of` picks one per collective."""
    for ranks, name in more.items():
        known = axes.get(ranks)
        if known is None:
            axes[ranks] = name
        elif name not in known.split(SHARED_AXES):
            axes[ranks] = known + SHARED_AXES + name


def axis_of(names: str, kind: str) -> str:
    """The axis a collective of `kind` on a group known as `names` belongs to: where ep shares its ranks with a data
    axis, the all-to-alls are expert parallel's token dispatch and the rest (FSDP's gathers and reductions) the data
    axis's."""
    options = names.split(SHARED_AXES)
    if len(options) == 1:
        return names
    if kind == "all_to_all" and EXPERT_AXIS in options:
        return EXPERT_AXIS
    return next(name for name in options if name != EXPERT_AXIS)


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
