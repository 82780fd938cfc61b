"""The run's DeviceMeshes, built in one place (`build_meshes`) from its fp8dist.config.parallel.ParallelDims after
the process group starts: the runtime loop builds them and hands them to the engine; an engine set up alone (the
public `prepare`) builds them here too. Nothing else builds a mesh or slices one by name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8dist.config.parallel import CP, EFSDP, EP, PP, TP, ParallelDims


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Meshes:
    """The meshes of one layout, each None where its axis is not used."""

    dims: ParallelDims
    dense: Any
    """The whole dense mesh (ParallelDims.mesh_shape): dp_replicate?, dp_shard, cp?, tp?."""
    data: Any
    """What FSDP2 shards the dense model over: the data dims, cp folded into the shard dim (ParallelDims.
    data_mesh_dims; torchtitan parallel_dims.py "fsdp = dp_shard * cp": FSDP always applies when cp is used)."""
    tp: Any = None
    cp: Any = None
    pp: Any = None
    """The pipeline ranks this rank's stages talk to (send / recv of activations and their gradients)."""
    experts: Any = None
    """The experts' own mesh, (efsdp, ep) over the dp_shard ranks (ParallelDims.expert_mesh_shape): a root of its
    own, so that the experts' DTensors and their FSDP2 sharding live on it while the dense layers stay on `dense`."""

    @property
    def expert_data(self):
        """The experts' FSDP2 shard dim (efsdp)."""
        return None if self.experts is None else self.experts[EFSDP]

    @property
    def expert_parallel(self):
        """The ranks one MoE layer's experts split over (ep)."""
        return None if self.experts is None else self.experts[EP]

    def all(self) -> list:
        """Every mesh built, for the audit's map of process groups to axes."""
        return [mesh for mesh in (self.dense, self.experts) if mesh is not None]


def build_meshes(dims: ParallelDims) -> Meshes:
    """The meshes of `dims` over the default process group (named dims: an axis is sliced by its name here)."""
    from torch.distributed.device_mesh import init_device_mesh

    names, shape = dims.mesh_shape()
    dense = init_device_mesh(device_type(), shape, mesh_dim_names=names)
    data_names, flattened = dims.data_mesh_dims()
    if flattened is None:
        data = dense if data_names == names else dense[data_names]
    else:  # (dp_shard, cp) flattened, beside dp_replicate where it is in the mesh
        shard = dense[data_names[-2:]]._flatten(flattened)
        data = dense[data_names[0], flattened] if len(data_names) == 3 else shard
    experts = None
    if dims.ep_enabled:
        if dims.world_size != dims.dp_shard:
            raise ValueError(f"expert parallel borrows dp_shard's ranks; this mesh has other axes ({dims})")
        expert_names, expert_shape = dims.expert_mesh_shape()
        experts = init_device_mesh(device_type(), expert_shape, mesh_dim_names=expert_names)
    return Meshes(dims, dense, data, tp=dense[TP] if dims.tp_enabled else None,
                  cp=dense[CP] if dims.cp_enabled else None, pp=dense[PP] if dims.pp_enabled else None,
                  experts=experts)


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
    if kind == "all_to_all" and EP in options:
        return EP
    return next(name for name in options if name != EP)


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
